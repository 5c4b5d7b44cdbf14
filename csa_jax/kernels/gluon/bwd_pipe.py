"""Config.bwd_pipeline: the paired dq kernel's consumers with the dq product in flight (bwd.py).

Same program, buffers, producer (bwd._dq_pair_producer) and element-wise math as
bwd._dq_pair_consumer; per tile i the order changes:
1. wait for tile i's copies, issue its score product [q; dO] kv^T asynchronously: on the tensor
   pipe it queues right behind tile i-1's dq product, which is still in flight (no wait / drain
   between the two);
2. wait_group 1 (tile i-1's dq product, the older group, done), a partition barrier, and stage
   i-1 goes back to the producer while the scores run (the same release point as the lockstep
   kernel's, right after that dq product);
3. wait for the scores, p and dS in registers, dS to shared memory, barrier, issue dq += dS kv
   asynchronously; tile i's scale*dS / P stores to dsp go out after that issue, under the
   product (the lockstep kernel stores them before the dS barrier).
The partition barrier of step 2 also orders tile i-1's dS reads before tile i's dS store.

Config.bwd_qdo_regs (AREG): the first AREG * 64 columns of [q; dO] are also loaded once per
program into registers (the score product's A operand layout) and the score product takes
that part from them (wgmma with A in registers), the rest from shared memory in 64-column
pieces: AREG * 16 KiB less shared-memory traffic per tile (of 268 KiB at D = 512, BK = 32).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from csa_jax.kernels.gluon.bwd import (
    _dq_acc_layout, _p_ds, _pair_rows, _split_sd, _store_dq, _store_dsp, _store_qdo)
from csa_jax.kernels.gluon.fwd import _release


@gluon.jit
def _pair_scores(qdo_smem, a_reg, tile, sd_zero, D: gl.constexpr, AREG: gl.constexpr):
    """[q; dO] kv^T of one tile, issued asynchronously (the caller waits); with AREG the first
    AREG * 64 columns of [q; dO] come from a_reg (registers), the rest from shared memory in
    64-column pieces (the shapes must be powers of two), into one accumulator."""
    if AREG == 0:
        sd = warpgroup_mma(qdo_smem, tile.permute((1, 0)), sd_zero, use_acc=False,
                           is_async=True)
    else:
        KR: gl.constexpr = AREG * 64
        sd = warpgroup_mma(a_reg, tile.slice(0, KR, dim=1).permute((1, 0)), sd_zero,
                           use_acc=False, is_async=True)
        for c in gl.static_range(AREG, D // 64):
            sd = warpgroup_mma(qdo_smem.slice(c * 64, 64, dim=1),
                               tile.slice(c * 64, 64, dim=1).permute((1, 0)), sd, is_async=True)
    return sd


@gluon.jit
def _dq_pipe_consumer(idx_ptr, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, ring,
                      full, consumed, q_bar, ds_smem, row, tok, hb, ntiles, D: gl.constexpr,
                      K: gl.constexpr, HP: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, HBC: gl.constexpr, QK_SCALE: gl.constexpr,
                      SCALE: gl.constexpr, QDO: gl.constexpr, FUSE: gl.constexpr,
                      AREG: gl.constexpr):
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BK, 16])
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    sd_zero, kcols, lse2, dc, ds_ptrs, p_ptrs = _pair_rows(
        sd_layout, lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, D, K, HP, BK, HBC, QDO, FUSE)
    ew: gl.constexpr = ds_ptrs.type.layout
    acc = warpgroup_mma_init(_dq_acc_layout(D, HBC, 0))
    mbarrier.wait(q_bar, 0)
    if QDO:
        _store_qdo(qdo_ptr, qdo_smem, row, D, HBC, True, 0, 2 * HBC // 32)
    a_reg = sd_zero                   # (unused without AREG)
    if AREG > 0:
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sd_layout,
                                                     k_width=2)
        a_reg = qdo_smem.slice(0, AREG * 64, dim=1).load(a_layout)
    for i in range(ntiles):
        s = i % STAGES
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        fence_async_shared()          # cp.async (generic proxy) -> wgmma (async proxy)
        tile = ring.index(s)
        sd = _pair_scores(qdo_smem, a_reg, tile, sd_zero, D, AREG)
        ids = gl.load(idx_ptr + i * BK + kcols)
        # tile i-1's dq product done in every warp: its stage goes back (the barrier is
        # unconditional: it also orders that product's dS reads before this tile's dS store)
        acc = warpgroup_mma_init(warpgroup_mma_wait(1, deps=[acc]))
        gl.thread_barrier()
        mbarrier.arrive(consumed.index((i + STAGES - 1) % STAGES), pred=i > 0)
        sd = warpgroup_mma_wait(0, deps=[sd])
        sc, dp = _split_sd(sd, HBC, BK)
        p, ds = _p_ds(sc, dp, ids, lse2, dc, QK_SCALE)
        ds_smem.store(ds.to(dt))
        fence_async_shared()          # generic-proxy stores -> wgmma reads
        gl.thread_barrier()
        acc = warpgroup_mma(ds_smem, tile, acc, is_async=True)
        _store_dsp(ds_ptrs, p_ptrs, i, ds, p, BK, SCALE)
    acc = warpgroup_mma_wait(0, deps=[acc])
    if ntiles > 0:
        _release(consumed.index((ntiles - 1) % STAGES))
    zero = gl.zeros([HBC, BK], dt, ew)
    for i in range(ntiles, K // BK):  # past the last non-empty tile: exact zeros
        gl.store(ds_ptrs + i * BK, zero)
        gl.store(p_ptrs + i * BK, zero)
    _store_dq(dq_ptr, acc, row, D, HBC, SCALE, 0)
