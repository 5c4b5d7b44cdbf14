"""The CSA backward's dq kernel in Gluon for AMD: gfx942, gfx950, gfx1250 (compile-only).

NOTHING HERE HAS RUN ON AN AMD GPU: compiled on a CPU (triton 3.6.0's AMD backend), resources in
docs/perf/gpu_resources.md; numerics unchecked. The contract is bwd.py's csa_dq_kernel (same
arguments, same outputs: dq and the per-slot dsp = [scale * dS; P] for the deterministic dkv
path of bwd.backward), the data movement amd_fwd.py's: one program = 64 heads of one token,
every warp gathers tile i + STAGES - 1 (gfx950: async buffer_load_to_shared; gfx942: buffer_load
into registers, stored to the single LDS stage after tile i; gfx1250: async global_to_shared)
while tile i is computed; -1 slots are zero-filled and masked.

Per tile: S = q kv^T and dP = dO kv^T (two MFMA / WMMA products sharing the transposed kv
operand; q and dO are the A operands, in registers, or dO in LDS with QDO = 1), p = exp2(S *
scale * log2e - lse * log2e) on valid slots, dS = p * (dP + dlse - delta), scale * dS and p
stored to dsp, dq += dS kv (the kv tile read transposed, as the forward's PV: gfx950's
ds_read_b64_tr_b16). Tiles past the token's last non-empty one are not walked; their dsp columns
are written as zeros. dq = scale * acc.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from csa_jax.kernels.gluon.amd_fwd import (
    ARCH, HBC_, _drain, _first_tiles, _layouts, _lds_layout, _load_block, _mma, _program_setup,
    _tile_operand, _tile_scores)
from csa_jax.kernels.gluon.dims import AMD_DQ_DEFAULTS
from csa_jax.kernels.gluon.regtrans import strided_layout, swap01
from csa_jax.kernels.gluon.ring import LOG2E

_LOG2E = gl.constexpr(LOG2E)

DQ_DEFAULTS = AMD_DQ_DEFAULTS            # per target at D = 512: dims.py says why


@gluon.jit
def csa_dq_amd_kernel(q_ptr, do_ptr, kv_ptr, idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, dq_ptr,
                      dsp_ptr, T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr,
                      D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                      QK_SCALE: gl.constexpr, SCALE: gl.constexpr, MMA: gl.constexpr,
                      LOADER: gl.constexpr, WARP: gl.constexpr, QDO: gl.constexpr,
                      TRANS: gl.constexpr):
    HBC: gl.constexpr = HBC_
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    L: gl.constexpr = _layouts(MMA, gl.num_warps(), D, WARP)
    row, tok, hb, ntiles, idx_tok, ring, kv_src, cols, krows = _program_setup(
        ntiles_ptr, idx_ptr, kv_ptr, dtype, T, NHB, N, D, K, BK, STAGES, WARP, LOADER)
    blk = row.to(gl.int64) * (HBC * D)                  # this program's rows of q / dO / dq

    q = _load_block(q_ptr + blk, HBC, D, L.a_op)
    if QDO == 1:
        do_smem = gl.allocate_shared_memory(dtype, [HBC, D], _lds_layout(HBC, D))
        do_smem.store(_load_block(do_ptr + blk, HBC, D, L.rl))
    else:
        do = _load_block(do_ptr + blk, HBC, D, L.a_op)
    nxt = _first_tiles(ring, kv_src, idx_tok, krows, cols, ntiles, N, BK, D, STAGES, LOADER)

    hrows = gl.arange(0, HBC, layout=L.srow)
    kcols = gl.arange(0, BK, layout=L.scol)
    lse2 = gl.load(lse_ptr + row * HBC + hrows) * _LOG2E           # exp2 domain
    dc = gl.load(dc_ptr + row * HBC + hrows)                       # dlse - delta
    # dsp [B*T, 2, HP, K]: this program's heads hb*HBC.., plane 0 = scale*dS, plane 1 = P
    HP: gl.constexpr = NHB * HBC
    ds_ptrs = (dsp_ptr + tok.to(gl.int64) * (2 * HP * K)
               + (hb * HBC + hrows).to(gl.int64)[:, None] * K + kcols[None, :])
    p_ptrs = ds_ptrs + HP * K
    s_zero = gl.zeros([HBC, BK], gl.float32, L.mma)
    acc = gl.zeros([HBC, D], gl.float32, L.mma)
    if QDO == 1:
        gl.thread_barrier()
    for i in range(ntiles):
        tile, nxt, sid, kt, sc = _tile_scores(ring, nxt, i, kv_src, idx_tok, krows, cols, ntiles,
                                              kcols, q, s_zero, L.b_op, N, BK, D, STAGES,
                                              LOADER, MMA)
        if QDO == 1:
            dp = _mma(do_smem.load(L.a_op), kt, s_zero, MMA)
        else:
            dp = _mma(do, kt, s_zero, MMA)
        p = gl.where((sid >= 0)[None, :], gl.exp2(sc * QK_SCALE - lse2[:, None]), 0.0)
        ds = p * (dp + dc[:, None])
        gl.store(ds_ptrs + i * BK, (ds * SCALE).to(dtype))
        gl.store(p_ptrs + i * BK, p.to(dtype))
        dsa = gl.convert_layout(ds.to(dtype), L.a_op)
        if TRANS == 2:        # plain 2-byte LDS reads in transposed order (regtrans.py)
            kvt = tile.load(strided_layout(gl.to_linear_layout(L.b_op, [BK, D]), 1))
            kvt = gl.convert_layout(swap01(kvt, BK, D, 1), L.b_op)
        else:
            kvt = _tile_operand(tile, L.b_op, L.rl, TRANS)
        acc = _mma(dsa, kvt, acc, MMA)
    _drain(LOADER)
    zero = gl.zeros([HBC, BK], dtype, L.mma)
    for i in range(ntiles, K // BK):          # past the last non-empty tile: exact zeros
        gl.store(ds_ptrs + i * BK, zero)
        gl.store(p_ptrs + i * BK, zero)
    if TRANS == 2:
        acc = swap01(acc, HBC, D, 1)          # dq's columns back in order
        hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, acc.type.layout))
        ocols = gl.arange(0, D, layout=gl.SliceLayout(0, acc.type.layout))
    else:
        ocols = gl.arange(0, D, layout=L.scol)
    gl.store(dq_ptr + blk + hrows[:, None] * D + ocols[None, :],
             (acc * SCALE).to(dq_ptr.dtype.element_ty))


def constexprs(*, target, T, N, NHB, D, K, BK, stages, scale, qdo=0, trans=0):
    """Compile-time parameters for an AMD target; qdo 1 = dO in LDS (read per tile) instead of
    registers; trans: how dS kv reads the kv tile (amd_fwd.constexprs; 2 = plain 2-byte LDS
    reads in transposed order, the dq kernel only: regtrans.strided_layout)."""
    a = ARCH[target]
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, SCALE=float(scale), MMA=a["mma"],
                LOADER=a["loader"], WARP=a["warp"], QDO=int(qdo), TRANS=int(trans))


ARG_TYPES = ("*{dt}", "*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*fp32", "*{dt}", "*{dt}")


def arg_types(dt="bf16"):
    return [t.format(dt=dt) for t in ARG_TYPES]
