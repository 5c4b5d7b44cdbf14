"""The CSA backward in Gluon: the warp-specialized dq kernel (NVIDIA Hopper) and the backward.

dq kernel, one program (CTA) = 64 heads of one token (as the forward, ring.py):

- producer partition (4 warps): copies q and dO [64, D] each into one resident [128, D] shared
  buffer with their rows interleaved by 8 (_qdo_row: row 16a + 8c + j = plane c (0 q, 1 dO),
  head 8a + j), then gathers the token's kv tiles of BK rows with cp.async into the
  STAGES-deep mbarrier ring (-1 slots zero-filled).
- default partition, 8 warps = 2 consumer warpgroups, per tile:
  1. one wgmma [q; dO] kv^T -> [128, BK] f32 over all 8 warps. With the interleaved rows the
     accumulator holds S and dP of one (head, slot) in the same thread (rows r and r + 8 of an
     m64 fragment), so _split_sd regroups them in registers: no shared-memory exchange;
  2. p = exp2(S * scale * log2e - lse * log2e) on valid slots (0 on empty),
     dS = p * (dP + dlse - delta) (csa_spec.md section 3 with the lse cotangent); delta =
     sum(o * dO) per head is formed by the consumers themselves (_load_dc) while the producer
     copies;
  3. scale * dS and p go to dsp [B*T, NHB, 2, 64, Kp] (head block first, q's dtype) for the
     per-slot intermediate GEMM; dS (q's dtype) goes to shared memory;
  4. dq[:, half] += dS kv[:, half] on wgmma (warps_per_cta [4, 2]: each warpgroup owns half of
     dq's columns, 64 x 256 f32 at D = 512), A = dS from shared memory, B = the ring tile
     through an MN-major ("transposed") descriptor;
  5. the stage is released. Tiles past the token's last non-empty one are not walked; their
     dsp columns are written as zeros. The consumers also copy the resident [q; dO] out
     (qdo [B*T, NHB, 2, 64, D]: the GEMM's operand, no XLA stack). dq = scale * acc.

dkv stays deterministic: interm[t] = dsp[t]^T qdo[t], one batched GEMM per token in XLA, then
the CSR inverse-map gather-reduce (dkv.py; no atomics; empty slots have no inverse-map entry).
dsink = sum_t exp(sink - lse) (dlse - delta) is an XLA reduction.

AMD (gfx942 / gfx950 / gfx1250): amd_bwd.py's dq kernel (dsp in [B*T, 2, Hp, Kp], delta in
XLA), the XLA stack of [q; dO] and the Pallas Triton impl's reduce. NEVER RUN (no AMD GPU).
"""
from __future__ import annotations

import functools

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma)

from csa_jax.kernels.gluon.dims import HB, SMEM_LIMIT, padded_dims
from csa_jax.kernels.gluon.dims import dq_shared_bytes as shared_bytes
from csa_jax.kernels.gluon.ring import (CONSUMER_WARPS, LOG2E, PRODUCER_WARPS, _program,
                                        _release, _wait_tile)

__all__ = ["csa_dq_kernel", "arg_types", "constexprs", "backward"]
_LOG2E = gl.constexpr(LOG2E)
PRODUCER_REGS = 96           # registers per producer thread (setmaxnreg)


@gluon.jit
def _qdo_row(r, HBC: gl.constexpr):
    """(plane, head) of row r of the resident [q; dO] buffer: plane 0 = q, 1 = dO; 8-row groups
    alternate, row 16a + 8c + j = plane c, head 8a + j, so that S and dP of one (head, slot)
    land in the same thread's wgmma accumulator registers (rows r and r + 8 of an m64
    fragment)."""
    return (r // 8) % 2, (r // 16) * 8 + r % 8


@gluon.jit
def _producer(q_ptr, do_ptr, kv_ptr, idx_ptr, qdo_smem, ring, full, consumed, q_bar, row, b,
              ntiles, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, HBC: gl.constexpr):
    """q and dO rows interleaved into [q; dO] (_qdo_row) by one cp.async pass, then the kv
    ring: tile i's BK rows gathered into stage i % STAGES once its previous tile was consumed
    (row ids loaded per tile, -1 zero-filled)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    r = gl.arange(0, 2 * HBC, layout=gl.SliceLayout(1, layout))
    plane, head = _qdo_row(r, HBC)
    off = (row * HBC + head).to(gl.int64)[:, None] * D + cols[None, :]
    src = gl.where((plane == 0)[:, None], q_ptr + off, do_ptr + off)
    async_copy.async_copy_global_to_shared(qdo_smem, src)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    krows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    for i in range(ntiles):
        s = i % STAGES
        ids = gl.load(idx_ptr + i * BK + krows)
        valid = ids >= 0
        ptrs = kv_base + gl.where(valid, ids, 0).to(gl.int64)[:, None] * D + cols[None, :]
        if i >= STAGES:
            mbarrier.wait(consumed.index(s), ((i // STAGES) - 1) & 1)
        async_copy.async_copy_global_to_shared(ring.index(s), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _store_qdo(qdo_ptr, qdo_smem, row, D: gl.constexpr, HBC: gl.constexpr):
    """Copy this program's resident [q; dO] [2*HBC, D] from shared memory to qdo[row] (the
    interm GEMM's operand, in place of XLA's stack; q's rows then dO's), 32 rows at a time,
    16-byte stores."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    base = qdo_ptr + row.to(gl.int64) * (2 * HBC * D)
    for j in gl.static_range(0, 2 * HBC // 32):
        v = qdo_smem.slice(32 * j, 32).load(blk)
        plane, head = _qdo_row(32 * j + r, HBC)
        gl.store(base + (plane * HBC + head)[:, None] * D + c[None, :], v)


@gluon.jit
def _split_sd(sd, HBC: gl.constexpr, BK: gl.constexpr):
    """(S, dP) [HBC, BK] of the paired [q; dO] kv^T accumulator [2*HBC, BK] (rows as _qdo_row):
    a register-only regrouping (reshape, permute, split of the register bit that selects rows
    r / r + 8 of each m64 fragment; no shared memory, no barrier)."""
    x = sd.reshape([HBC // 8, 2, 8, BK]).permute((0, 2, 3, 1)).reshape([HBC, BK, 2])
    return gl.split(x)


@gluon.jit
def _load_dc(dc_ptr, fz, row, hrows, D: gl.constexpr, HBC: gl.constexpr):
    """dlse - delta of this program's HBC heads at hrows (any layout): dc_ptr holds dlse and the
    kernel forms delta itself from o and dO (fz = (o_ptr, do_ptr, dcout_ptr); 16-row chunks,
    16-byte loads issued before the consumers wait for the producer's copies), writes dc to
    dcout (for XLA's dsink) and reads it back in hrows' layout after a partition barrier
    (global writes of the CTA are visible to it after bar.sync)."""
    o_ptr, do_ptr, dcout_ptr = fz
    CH: gl.constexpr = 16
    TC: gl.constexpr = 32 if D >= 256 else D // 8
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, CH, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    for k in gl.static_range(HBC // CH):
        rows = row * HBC + k * CH + r
        off = rows.to(gl.int64)[:, None] * D + c[None, :]
        o = gl.load(o_ptr + off).to(gl.float32)
        d = gl.load(do_ptr + off).to(gl.float32)
        gl.store(dcout_ptr + rows, gl.load(dc_ptr + rows) - gl.sum(o * d, axis=1))
    gl.thread_barrier()
    return gl.load(dcout_ptr + row * HBC + hrows)


@gluon.jit
def _consumer(idx_ptr, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, ring, full,
              consumed, q_bar, ds_smem, row, tok, hb, ntiles, D: gl.constexpr, K: gl.constexpr,
              HP: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
              QK_SCALE: gl.constexpr, SCALE: gl.constexpr):
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    # The element-wise operands in the layout _split_sd gives S and dP.
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BK, 16])
    sd_zero = gl.zeros([2 * HBC, BK], gl.float32, sd_layout)
    sc0, dp0 = _split_sd(sd_zero, HBC, BK)
    ew: gl.constexpr = sc0.type.layout
    hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, ew))
    kcols = gl.arange(0, BK, layout=gl.SliceLayout(0, ew))
    lse2 = gl.load(lse_ptr + row * HBC + hrows) * _LOG2E       # exp2 domain
    dc = _load_dc(dc_ptr, fz, row, hrows, D, HBC)              # dlse - delta
    # scale*dS and P pointers of tile 0: dsp [B*T, NHB, 2, HBC, K] (head block outermost, as
    # the qdo rows the kernel writes), plane 0 = scale*dS, plane 1 = P
    ds_ptrs = (dsp_ptr + tok.to(gl.int64) * (2 * HP * K) + hb.to(gl.int64) * (2 * HBC * K)
               + hrows.to(gl.int64)[:, None] * K + kcols[None, :])
    p_ptrs = ds_ptrs + HBC * K
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    acc = gl.zeros([HBC, D], gl.float32, acc_layout)
    mbarrier.wait(q_bar, 0)
    _store_qdo(qdo_ptr, qdo_smem, row, D, HBC)
    for i in range(ntiles):
        s, tile = _wait_tile(ring, full, i, STAGES)
        ids = gl.load(idx_ptr + i * BK + kcols)    # (under the score product's wait)
        sd = warpgroup_mma(qdo_smem, tile.permute((1, 0)), sd_zero, use_acc=False)
        sc, dp = _split_sd(sd, HBC, BK)
        valid = (ids >= 0)[None, :]
        p = gl.where(valid, gl.exp2(sc * QK_SCALE - lse2[:, None]), 0.0)
        ds = p * (dp + dc[:, None])
        gl.store(ds_ptrs + i * BK, (ds * SCALE).to(dt))
        gl.store(p_ptrs + i * BK, p.to(dt))
        ds_smem.store(ds.to(dt))
        fence_async_shared()          # generic-proxy stores -> wgmma reads
        gl.thread_barrier()
        acc = warpgroup_mma(ds_smem, tile, acc)
        _release(consumed.index(s))
    # Exact zeros in dsp's tiles past the last non-empty one.
    zero = gl.zeros([HBC, BK], dt, ew)
    for i in range(ntiles, K // BK, 1):
        gl.store(ds_ptrs + i * BK, zero)
        gl.store(p_ptrs + i * BK, zero)
    orows = gl.arange(0, HBC, layout=gl.SliceLayout(1, acc_layout))
    ocols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    dq_ptrs = dq_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :]
    gl.store(dq_ptrs, (acc * SCALE).to(dq_ptr.dtype.element_ty))


@gluon.jit
def csa_dq_kernel(q_ptr, do_ptr, kv_ptr, idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, o_ptr, dq_ptr,
                  dsp_ptr, qdo_ptr, dcout_ptr, T: gl.constexpr, N: gl.constexpr,
                  NHB: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                  STAGES: gl.constexpr, QK_SCALE: gl.constexpr, SCALE: gl.constexpr,
                  PRODUCER_REGS: gl.constexpr):
    row, tok, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    qdo_smem = gl.allocate_shared_memory(
        dtype, [2 * HBC, D], gl.NVMMASharedLayout.get_default_for([2 * HBC, D], dtype))
    ring = gl.allocate_shared_memory(
        dtype, [STAGES, BK, D], gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    ds_smem = gl.allocate_shared_memory(
        dtype, [HBC, BK], gl.NVMMASharedLayout.get_default_for([HBC, BK], dtype))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=1)
    fz = (o_ptr, do_ptr, dcout_ptr)    # delta's operands and dc's output
    gl.warp_specialize([
        (_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, ring,
                     full, consumed, q_bar, ds_smem, row, tok, hb, ntiles, D, K, NHB * HBC, BK,
                     STAGES, HBC, QK_SCALE, SCALE)),
        (_producer, (q_ptr, do_ptr, kv_ptr, idx_tok, qdo_smem, ring, full, consumed, q_bar,
                     row, b, ntiles, N, D, K, BK, STAGES, HBC)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side

# q, dO, kv, idx, ntiles, lse, dlse, o | dq, dsp, qdo, dcout
ARG_TYPES = ("*{dt}", "*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*fp32", "*{dt}", "*{dt}",
             "*{dt}", "*{dt}", "*fp32")


def arg_types(dt="bf16"):
    return [a.format(dt=dt) for a in ARG_TYPES]


def constexprs(*, T, N, NHB, D, K, BK, stages, scale):
    """The dq kernel's compile-time parameters (also used by the CPU compile checks)."""
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, SCALE=float(scale), PRODUCER_REGS=PRODUCER_REGS)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "stages", "amd",
                                             "interpret_reduce"))
def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, block_k, stages, amd=None,
             interpret_reduce=False):
    """(dq, dkv, dsink): dq by csa_dq_kernel at (block_k, stages) (Config.bwd_block_k /
    bwd_stages), dkv by the deterministic per-slot GEMM + inverse-map reduce, dsink in XLA.
    idx must be sanitized (-1 for every empty or out-of-range slot). amd: a gfx architecture
    (amd_bwd.DQ_DEFAULTS) -> amd_bwd.csa_dq_amd_kernel, same contract (NEVER RUN: no AMD GPU).
    interpret_reduce runs the AMD route's Pallas reduce in its interpreter (the CPU test of
    this wrapper, with the dq kernel emulated)."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    from csa_jax.kernels.gluon.dkv import dkv_dsink
    # The Pallas Triton impl's padding helpers, shared rather than copied.
    from csa_jax.kernels.triton.plan import _Dims, _ntiles, _pad_to, _prep_idx
    f32 = jnp.float32
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    Hp, Dp, Kp = padded_dims(H, D, K, block_k)
    d = _Dims(B, T, H, D, N, K, Hp, Dp, Kp)
    pad = _pad_to
    idx_p, used = _prep_idx(idx, d)                 # -1 padding; slots up to the last non-empty
    ntiles = _ntiles(used, block_k).reshape(B * T)
    # Padded heads: q = dO = 0 and lse = dc = 0, so p = 1 on valid slots but dS = 0, p dO = 0.
    q_p = pad(pad(q, 3, Dp), 2, Hp)
    do_p = pad(pad(do, 3, Dp), 2, Hp)
    kv_p = pad(kv, 2, Dp)
    lse_p = pad(lse.astype(f32), 2, Hp).reshape(-1)
    nhb = Hp // HB
    common = (q_p.reshape(B * T * Hp, Dp), do_p.reshape(B * T * Hp, Dp), kv_p.reshape(B * N, Dp),
              idx_p.reshape(B * T, Kp), ntiles, lse_p)
    if amd is None:
        need = shared_bytes(D, block_k, stages)
        if need > SMEM_LIMIT:
            raise ValueError(f"dq kernel tiles bwd_block_k={block_k}, bwd_stages={stages} at "
                             f"D={D} need {need} B of shared memory; the H200 has {SMEM_LIMIT} "
                             f"per block")
        dq, dsp, qdo_st, dc = gluon_call(
            *common, pad(dlse.astype(f32), 2, Hp).reshape(-1),    # dlse: the kernel forms delta
            pad(pad(o, 3, Dp), 2, Hp).reshape(-1, Dp), kernel=csa_dq_kernel,
            out_shape=[jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
                       jax.ShapeDtypeStruct((B * T, nhb, 2, HB, Kp), q.dtype),
                       jax.ShapeDtypeStruct((B * T, nhb, 2, HB, Dp), q.dtype),
                       jax.ShapeDtypeStruct((B * T * Hp,), f32)],
            grid=(B * T * nhb,), num_warps=CONSUMER_WARPS, name="csa_gluon_dq",
            **constexprs(T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=block_k, stages=stages, scale=scale))
        dc = dc.reshape(B, T, Hp)[:, :, :H]         # dlse - delta as the kernel formed it
    else:
        from csa_jax.kernels.gluon import amd_bwd
        from csa_jax.kernels.gluon.amd_fwd import check_buffer_range
        from csa_jax.kernels.gluon.dims import AMD_LDS, amd_lds_bytes
        a = amd_bwd.DQ_DEFAULTS[amd]
        need = amd_lds_bytes(amd, D, block_k, stages, extra_blocks=a["qdo"])
        if need > AMD_LDS[amd] - 8192:
            raise ValueError(f"dq kernel tiles bwd_block_k={block_k}, bwd_stages={stages} at "
                             f"D={D} need {need} B of LDS; {amd} has {AMD_LDS[amd]}")
        check_buffer_range(N, Dp, q.dtype.itemsize)
        delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)             # [B, T, H]
        dc = dlse - delta
        dq, dsp = gluon_call(
            *common, pad(dc.astype(f32), 2, Hp).reshape(-1), kernel=amd_bwd.csa_dq_amd_kernel,
            out_shape=[jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
                       jax.ShapeDtypeStruct((B * T, 2, Hp, Kp), q.dtype)],
            grid=(B * T * nhb,), num_warps=a["warps"], name="csa_gluon_dq_amd",
            **amd_bwd.constexprs(target=amd, T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=block_k,
                                 stages=stages, scale=scale, qdo=a["qdo"]))
        qdo_st = None
    dkv, dsink = dkv_dsink(dsp, qdo_st, q_p, do_p, idx_p, d, kv.dtype, sink, lse, dc,
                           idx_shape=idx.shape, interpret_reduce=interpret_reduce)
    return dq.reshape(B, T, Hp, Dp)[:, :, :H, :D], dkv, dsink
