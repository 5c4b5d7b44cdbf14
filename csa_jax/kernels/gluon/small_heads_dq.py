"""The CSA dq kernel in Gluon for few heads (H <= 32, NVIDIA Hopper): kv rows as the wgmma M.

The backward's counterpart of small_heads.py (read that first). At H <= 32 the 64-head dq
kernel (bwd.py) puts the heads on wgmma's M (64 per warpgroup) and computes three quarters
padding at H = 16. Here the token's gathered kv rows are M and the heads (padded to HN = 16
or 32 in shared memory only) are N, per tile of BK = 64 rows:

    [S^T | dP^T] [BK, 2 HN] = tile [BK, D] [q; dO]^T [D, 2 HN]   (one wgmma, N = 2 HN)
    P^T  = exp2(S^T scale log2e - lse log2e) on valid rows (0 on empty slots)
    dS^T = P^T (dP^T + dlse - delta)                               (csa_spec.md section 3)
    dq^T [D, HN] += tile^T [D, BK] dS^T [BK, HN]                  (A = the tile, MN-major)

No softmax statistic is formed (lse is known), so the consumer has no cross-warp reduction.
scale * dS and P go to dsp [B*T, Kp, 2, H] (slot-major, the H real heads) for dkv: by kv row
blocks (dkv_blocks.py, Config.bwd_dkv="blocks", the default) or by the per-slot GEMM
interm[t] = dsp[t] [q; dO][t] and the deterministic inverse-map reduce of dkv.py, as the
64-head kernel's do; tiles past a token's last non-empty one are written as zeros.

Partitions (8 warps): the producer = the default partition, 4 warps, ring._produce_row with
dO: per token the first STAGES tiles, then q and dO into one [2 HN, D] buffer (q's rows, then
dO's; heads H .. HN-1 zero-filled) once the consumer released the previous token's, then the
other tiles; the consumer = one worker warpgroup. One program per SM, walking tokens. Shared
memory at D = 512: [q; dO] 32 KiB + 3 stages of 64 rows at HN = 16 (64 KiB + 2 at HN = 32).
delta = sum(o dO) is formed in XLA.
"""
from __future__ import annotations

import functools

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.ring import LOG2E, _release, _row_info
from csa_jax.kernels.gluon.small_heads import (BLOCK_K, CONSUMER_REGS, NUM_WARPS, WG_WARPS,
                                               _next_tile, _producer, _ring_buffers)

_LOG2E = gl.constexpr(LOG2E)
__all__ = ["csa_dq_small_heads_kernel", "arg_types", "constexprs", "dq", "backward"]


@gluon.jit
def _consumer(idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, dq_ptr, dsp_ptr, qdo_smem, ring, dst_smem,
              full, consumed, q_bar, q_free, T: gl.constexpr, K: gl.constexpr,
              ROWS: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              HN: gl.constexpr, H: gl.constexpr, QK_SCALE: gl.constexpr,
              SCALE: gl.constexpr):
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    # [S^T | dP^T] [BK, 2HN]: a thread holds columns c and c + HN of a row (HN is a multiple of
    # the 8-column repeat), so splitting the two planes is a register regrouping.
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * HN, 16])
    sd_zero = gl.zeros([BK, 2 * HN], gl.float32, sd_layout)
    sc0, dp0 = gl.split(sd_zero.reshape([BK, 2, HN]).permute((0, 2, 1)))
    ew: gl.constexpr = sc0.type.layout
    krows = gl.arange(0, BK, layout=gl.SliceLayout(1, ew))
    hcols = gl.arange(0, HN, layout=gl.SliceLayout(0, ew))
    live = hcols < H
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 16])
    drows = gl.arange(0, D, layout=gl.SliceLayout(1, acc_layout))
    ocols = gl.arange(0, HN, layout=gl.SliceLayout(0, acc_layout))
    qdo_t = qdo_smem.permute((1, 0))              # [D, 2HN]: K-major B
    base = 0
    n = 0
    for row in range(gl.program_id(0), ROWS, gl.num_programs(0)):
        _, _, _, ntiles, idx_tok = _row_info(ntiles_ptr, idx_ptr, row, T, 1, K)
        hrow = row * H + gl.where(live, hcols, 0)
        lse2 = gl.load(lse_ptr + hrow, mask=live, other=0.0) * _LOG2E
        dc = gl.load(dc_ptr + hrow, mask=live, other=0.0)
        # dsp[row, slot, plane, head]: plane 0 = scale * dS, 1 = P
        ds_ptrs = (dsp_ptr + row.to(gl.int64) * (K * 2 * H) + krows[:, None] * (2 * H)
                   + gl.where(live, hcols, 0)[None, :])
        acc = gl.zeros([D, HN], gl.float32, acc_layout)
        mbarrier.wait(q_bar, n & 1)
        for i in range(ntiles):
            s, ids, tile = _next_tile(base + i, i, idx_tok, krows, ring, full, BK, STAGES)
            sd = warpgroup_mma(tile, qdo_t, sd_zero, use_acc=False, is_async=True)
            sd = warpgroup_mma_wait(0, deps=[sd])
            sc, dp = gl.split(sd.reshape([BK, 2, HN]).permute((0, 2, 1)))
            valid = (ids >= 0)[:, None]
            p = gl.where(valid, gl.exp2(sc * QK_SCALE - lse2[None, :]), 0.0)
            ds = p * (dp + dc[None, :])
            tile_ptrs = ds_ptrs + i * (BK * 2 * H)
            gl.store(tile_ptrs, (ds * SCALE).to(dt), mask=live[None, :])
            gl.store(tile_ptrs + H, p.to(dt), mask=live[None, :])
            dst_smem.store(ds.to(dst_smem.dtype))
            fence_async_shared()                  # dS^T is read by wgmma (async proxy)
            gl.thread_barrier()
            acc = warpgroup_mma(tile.permute((1, 0)), dst_smem, acc)
            _release(consumed.index(s))
        _release(q_free)
        zero = gl.zeros([BK, HN], dt, ew)
        for i in range(ntiles, K // BK):          # exact zeros past the last non-empty tile
            tile_ptrs = ds_ptrs + i * (BK * 2 * H)
            gl.store(tile_ptrs, zero, mask=live[None, :])
            gl.store(tile_ptrs + H, zero, mask=live[None, :])
        oh = row * H + gl.where(ocols < H, ocols, 0)
        gl.store(dq_ptr + oh.to(gl.int64)[None, :] * D + drows[:, None],
                 (acc * SCALE).to(dq_ptr.dtype.element_ty), mask=(ocols < H)[None, :])
        base += ntiles
        n += 1


@gluon.jit
def csa_dq_small_heads_kernel(q_ptr, do_ptr, kv_ptr, idx_ptr, ntiles_ptr, lse_ptr, dc_ptr,
                              dq_ptr, dsp_ptr, T: gl.constexpr, N: gl.constexpr,
                              D: gl.constexpr, K: gl.constexpr, ROWS: gl.constexpr,
                              HN: gl.constexpr, H: gl.constexpr, BK: gl.constexpr,
                              STAGES: gl.constexpr, QK_SCALE: gl.constexpr,
                              SCALE: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Each program walks rows (tokens) program_id, program_id + num_programs, ... of the
    ROWS = B * T tokens. q, dO, dq: [B*T*H, D] (H <= HN heads, not padded in memory); lse, dc
    (= dlse - delta): [B*T*H] f32; dsp: [B*T, K, 2, H]."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qdo_smem = gl.allocate_shared_memory(
        dtype, [2 * HN, D], gl.NVMMASharedLayout.get_default_for([2 * HN, D], dtype))
    ring, dst_smem, full, consumed, q_bar, q_free = _ring_buffers(dtype, D, BK, STAGES, HN)
    gl.warp_specialize([
        (_producer, (q_ptr, kv_ptr, idx_ptr, ntiles_ptr, qdo_smem, ring, full, consumed, q_bar,
                     q_free, T, N, D, K, ROWS, BK, STAGES, HN, H, do_ptr)),
        (_consumer, (idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, dq_ptr, dsp_ptr, qdo_smem, ring,
                     dst_smem, full, consumed, q_bar, q_free, T, K, ROWS, D, BK, STAGES, HN, H,
                     QK_SCALE, SCALE)),
    ], [WG_WARPS], [CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side

# q, dO, kv, idx, ntiles, lse, dc | dq, dsp
ARG_TYPES = ("*{dt}", "*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*fp32", "*{dt}", "*{dt}")


def arg_types(dt="bf16"):
    return [a.format(dt=dt) for a in ARG_TYPES]


def constexprs(*, T, N, HN, D, K, stages, scale, B=1, H=None):
    """The kernel's compile-time parameters (also used by the CPU compile checks); H = the
    heads q / dO / dq / lse hold (default HN), 1 <= H <= HN; K a multiple of 64."""
    if HN not in (16, 32):
        raise ValueError(f"the few-heads dq kernel takes 16 or 32 padded heads, got HN={HN}")
    H = HN if H is None else H
    if not 1 <= H <= HN:
        raise ValueError(f"the few-heads dq kernel takes 1 <= H <= HN={HN} heads, got H={H}")
    if K % BLOCK_K:
        raise ValueError(f"the few-heads dq kernel needs K a multiple of {BLOCK_K}, got K={K}")
    return dict(T=T, N=N, D=D, K=K, ROWS=B * T, HN=HN, H=H, BK=BLOCK_K, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, SCALE=float(scale), CONSUMER_REGS=CONSUMER_REGS)


def dq(q, kv, idx, lse, do, dc, *, scale, HN, stages):
    """(dq [B, T, H, D], dsp [B, T, Kp, 2, H], idx_p [B, T, Kp], dims) through
    csa_dq_small_heads_kernel (CUDA only); dc = dlse - delta [B, T, H] f32."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    from csa_jax.kernels.gluon.fwd import grid
    from csa_jax.kernels.gluon.ring import _pad, prepare
    B, T, H, D = q.shape
    if H > HN:
        raise ValueError(f"the few-heads dq kernel takes H <= HN={HN}, got H={H}")
    sink = jnp.zeros((H,), jnp.float32)                 # (prepare pads one; unused here)
    q_p, kv_p, idx_p, ntiles, _, dims = prepare(q, kv, idx, sink, BLOCK_K, hp=H)
    _, _, _, _, N, _, Dp, Kp, _ = dims
    do_p = _pad(do.astype(q.dtype), 3, Dp).reshape(B * T * H, Dp)   # (copied beside q's bytes)
    f32 = lambda x: x.astype(jnp.float32).reshape(B * T * H)  # noqa: E731
    consts = constexprs(T=T, N=N, HN=HN, D=Dp, K=Kp, stages=stages, scale=scale, B=B, H=H)
    dq_p, dsp = gluon_call(
        q_p, do_p, kv_p, idx_p, ntiles, f32(lse), f32(dc), kernel=csa_dq_small_heads_kernel,
        out_shape=[jax.ShapeDtypeStruct((B * T * H, Dp), q.dtype),
                   jax.ShapeDtypeStruct((B * T, Kp, 2, H), q.dtype)],
        grid=grid(consts["ROWS"]), num_warps=NUM_WARPS, name="csa_gluon_dq_small_heads",
        **consts)
    return (dq_p.reshape(B, T, H, Dp)[..., :D], dsp.reshape(B, T, Kp, 2, H),
            idx_p.reshape(B, T, Kp), dims)


@functools.partial(jax.jit, static_argnames=("scale", "HN", "stages", "dkv"))
def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, HN, stages, dkv="slots"):
    """(dq, dkv, dsink) at H <= HN heads: dq and dsp by the kernel above, dkv by the
    deterministic per-slot GEMM + inverse-map reduce (dkv.py) or, dkv="blocks", by
    dkv_blocks.py; dsink in XLA. idx must be sanitized (-1 for every empty or out-of-range
    slot)."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.dkv import dkv_dsink_slot_major
    f32 = jnp.float32
    delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)            # [B, T, H]
    dc = dlse.astype(f32) - delta
    dq_, dsp, idx_p, dims = dq(q, kv, idx, lse, do, dc, scale=scale, HN=HN, stages=stages)
    dkv_, dsink = dkv_dsink_slot_major(dsp, q, do, idx_p, kv.shape[1], dims[6], kv.dtype,
                                       sink, lse, dc, blocks=dkv == "blocks")
    return dq_, dkv_, dsink
