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

Config.bwd_qdo_regs=1 (csa_dq_blk_kernel): the same consumers on [q; dO] kept in 64-column
blocks [D / 64, 2*HBC, 64]; block 0 is also loaded once per program into registers (the
score product's A operand layout, 16 registers a thread) and the score product takes that
part from them (wgmma with A in registers), blocks 1.. from shared memory: 16 KiB less
shared-memory traffic per tile (of 268 KiB at D = 512, BK = 32), and block 0's shared memory,
read only in the prologue, holds dS, so a third 32-row stage fits at D = 512.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from csa_jax.kernels.gluon.bwd import (
    _dq_acc_layout, _kv_ring, _p_ds, _pair_rows, _qdo_row, _split_sd, _store_dq, _store_dsp,
    _store_qdo)
from csa_jax.kernels.gluon.fwd import PRODUCER_WARPS, _program, _release, _ring_barriers


@gluon.jit
def _pair_scores(qdo_smem, a_reg, tile, sd_zero, D: gl.constexpr, BLK: gl.constexpr):
    """[q; dO] kv^T of one tile, issued asynchronously (the caller waits). BLK: qdo_smem is the
    blocked buffer [D / 64, 2*HBC, 64] and block 0 comes from a_reg (registers, the wgmma A
    operand layout), blocks 1.. from shared memory, into one accumulator."""
    if BLK:
        sd = warpgroup_mma(a_reg, tile.slice(0, 64, dim=1).permute((1, 0)), sd_zero,
                           use_acc=False, is_async=True)
        for c in gl.static_range(1, D // 64):
            sd = warpgroup_mma(qdo_smem.index(c), tile.slice(c * 64, 64, dim=1).permute((1, 0)),
                               sd, is_async=True)
    else:
        sd = warpgroup_mma(qdo_smem, tile.permute((1, 0)), sd_zero, use_acc=False,
                           is_async=True)
    return sd


@gluon.jit
def _store_qdo_blocks(qdo_ptr, qdo_blk, row, D: gl.constexpr, HBC: gl.constexpr):
    """_store_qdo for the blocked buffer: [q; dO] (paired rows) to qdo[row], q's rows then
    dO's, one 64-column block at a time, 16-byte stores."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, 2 * HBC, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
    plane, head = _qdo_row(r, HBC, True)
    ptrs = (qdo_ptr + row.to(gl.int64) * (2 * HBC * D)
            + (plane * HBC + head)[:, None] * D + c[None, :])
    for k in gl.static_range(D // 64):
        gl.store(ptrs + k * 64, qdo_blk.index(k).load(blk))


@gluon.jit
def _blk_producer(q_ptr, do_ptr, kv_ptr, idx_ptr, qdo_blk, ring, full, consumed, q_bar, row,
                  b, ntiles, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
                  BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr):
    """bwd._dq_pair_producer for the blocked [q; dO] buffer: the paired rows copied one
    64-column block at a time, then the same kv ring."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    r = gl.arange(0, 2 * HBC, layout=gl.SliceLayout(1, layout))
    plane, head = _qdo_row(r, HBC, True)
    off = (row * HBC + head).to(gl.int64)[:, None] * D + cols[None, :]
    src = gl.where((plane == 0)[:, None], q_ptr + off, do_ptr + off)
    for c in gl.static_range(D // 64):
        async_copy.async_copy_global_to_shared(qdo_blk.index(c), src + c * 64)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    _kv_ring(kv_ptr, idx_ptr, ring, full, consumed, b, ntiles, N, D, K, BK, STAGES)


@gluon.jit
def _dq_pipe_consumer(idx_ptr, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, ring,
                      full, consumed, q_bar, ds_smem, row, tok, hb, ntiles, D: gl.constexpr,
                      K: gl.constexpr, HP: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, HBC: gl.constexpr, QK_SCALE: gl.constexpr,
                      SCALE: gl.constexpr, QDO: gl.constexpr, FUSE: gl.constexpr,
                      BLK: gl.constexpr, AHEAD: gl.constexpr):
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BK, 16])
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    sd_zero, kcols, lse2, dc, ds_ptrs, p_ptrs = _pair_rows(
        8, lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, D, K, HP, BK, HBC, QDO, FUSE)
    ew: gl.constexpr = ds_ptrs.type.layout
    acc = warpgroup_mma_init(_dq_acc_layout(D, HBC, 0))
    mbarrier.wait(q_bar, 0)
    if QDO:
        if BLK:
            _store_qdo_blocks(qdo_ptr, qdo_smem, row, D, HBC)
        else:
            _store_qdo(qdo_ptr, qdo_smem, row, D, HBC, True, 0, 2 * HBC // 32)
    # each warpgroup_mma call is one wgmma group: the score product is NG of them
    NG: gl.constexpr = D // 64 if BLK else 1
    a_reg = sd_zero                   # (unused without BLK)
    if BLK:   # block 0 of [q; dO] into registers; dS then lives in its shared memory
        a_reg = qdo_smem.index(0).load(
            gl.DotOperandLayout(operand_index=0, parent=sd_layout, k_width=2))
    if AHEAD:
        # tile i+1's scores issued before tile i's element-wise work (3 stages: tiles i-1..i+1
        # live until tile i-1's dq product is done): queue S_i, dq_{i-1}, S_{i+1}, ... (each
        # S is NG wgmma groups)
        if ntiles > 0:
            mbarrier.wait(full.index(0), 0)
            fence_async_shared()
            sd = _pair_scores(qdo_smem, a_reg, ring.index(0), sd_zero, D, BLK)
        else:
            sd = warpgroup_mma_init(sd_zero)
        for i in range(ntiles):
            tile = ring.index(i % STAGES)
            ids = gl.load(idx_ptr + i * BK + kcols)
            nxt = i + 1
            if nxt < ntiles:
                mbarrier.wait(full.index(nxt % STAGES), (nxt // STAGES) & 1)
                fence_async_shared()
                sd_next = _pair_scores(qdo_smem, a_reg, ring.index(nxt % STAGES), sd_zero, D,
                                       BLK)
                # all but S_{i+1}'s NG groups: S_i and dq_{i-1} done
                sd_now, acc_t = warpgroup_mma_wait(NG, deps=[sd, acc])
            else:
                sd_next = warpgroup_mma_init(sd_zero)
                sd_now, acc_t = warpgroup_mma_wait(0, deps=[sd, acc])
            acc = warpgroup_mma_init(acc_t)
            gl.thread_barrier()
            mbarrier.arrive(consumed.index((i + STAGES - 1) % STAGES), pred=i > 0)
            sc, dp = _split_sd(sd_now, HBC, BK)
            p, ds = _p_ds(sc, dp, ids, lse2, dc, QK_SCALE)
            ds_smem.store(ds.to(dt))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(ds_smem, tile, acc, is_async=True)
            _store_dsp(ds_ptrs, p_ptrs, i, ds, p, BK, SCALE)
            sd = sd_next
    else:
        for i in range(ntiles):
            s = i % STAGES
            mbarrier.wait(full.index(s), (i // STAGES) & 1)
            fence_async_shared()          # cp.async (generic proxy) -> wgmma (async proxy)
            tile = ring.index(s)
            sd = _pair_scores(qdo_smem, a_reg, tile, sd_zero, D, BLK)
            ids = gl.load(idx_ptr + i * BK + kcols)
            # tile i-1's dq product done in every warp: its stage goes back (the barrier is
            # unconditional: it also orders that product's dS reads before this tile's dS store)
            acc = warpgroup_mma_init(warpgroup_mma_wait(NG, deps=[acc]))  # all but S_i
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


@gluon.jit
def csa_dq_blk_kernel(q_ptr, do_ptr, kv_ptr, idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, o_ptr,
                      dq_ptr, dsp_ptr, qdo_ptr, dcout_ptr, T: gl.constexpr, N: gl.constexpr,
                      NHB: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, EW_C: gl.constexpr, QK_SCALE: gl.constexpr,
                      SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      PREFETCH: gl.constexpr, ABLATE: gl.constexpr, QDO: gl.constexpr,
                      DQ_OP: gl.constexpr, PAIR: gl.constexpr, FUSE: gl.constexpr,
                      PIPE: gl.constexpr, AREG: gl.constexpr, AHEAD: gl.constexpr):
    """bwd.csa_dq_kernel's contract (same arguments and constexprs) with bwd_pipeline +
    bwd_qdo_regs=1 on a blocked [q; dO] buffer ([D / 64, 2*HBC, 64]): block 0 is held in
    registers, so after the prologue its 16 KiB hold dS (no buffer of its own): [q; dO]
    128 KiB + STAGES x BK x D ring, 3 stages of 32 rows at D = 512 (229,376 B + barriers)."""
    row, tok, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    qdo_blk = gl.allocate_shared_memory(
        dtype, [D // 64, 2 * HBC, 64], gl.NVMMASharedLayout.get_default_for([2 * HBC, 64], dtype))
    ring = gl.allocate_shared_memory(
        dtype, [STAGES, BK, D], gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    # dS [HBC, BK] in the first bytes of block 0 (whose reads all precede the first dS store)
    ds_smem = qdo_blk._reinterpret(
        dtype, [D * 2 * HBC // (HBC * BK), HBC, BK],
        gl.NVMMASharedLayout.get_default_for([HBC, BK], dtype)).index(0)
    full, consumed, q_bar = _ring_barriers(STAGES)
    fz = (o_ptr, do_ptr, dcout_ptr)
    gl.warp_specialize([
        (_dq_pipe_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_blk,
                             ring, full, consumed, q_bar, ds_smem, row, tok, hb, ntiles, D, K,
                             NHB * HBC, BK, STAGES, HBC, QK_SCALE, SCALE, QDO, FUSE, True,
                             AHEAD)),
        (_blk_producer, (q_ptr, do_ptr, kv_ptr, idx_tok, qdo_blk, ring, full, consumed, q_bar,
                         row, b, ntiles, N, D, K, BK, STAGES, HBC)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
