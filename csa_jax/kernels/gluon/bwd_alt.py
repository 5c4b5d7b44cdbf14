"""The dq kernel with alternating consumer warpgroups (`Config.bwd_schedule="alternate"`).

The forward's FlashMLA-style schedule (fwd_alt.py) applied to bwd.py's dq kernel: three
partitions of 4 warps each (384 threads), one program = 64 heads of one token, as in bwd.py:

- producer = the default partition: bwd._dq_pair_producer unchanged (q and dO rows paired in
  8-row groups in the resident [q; dO] buffer, then the kv ring of BK-row tiles); a stage is
  refilled once its "consumed" barrier has had one arrival from EACH consumer.
- consumer warpgroup W = 0, 1 (worker partitions, `Config.alt_regs` registers per thread):
  W owns the tiles i with i % 2 == W and dq's columns [W*D/2, (W+1)*D/2). For its own tile it
  computes the whole [q; dO] kv^T (M = 128 on one warpgroup; S and dP of a (head, slot) in
  the same thread thanks to the paired rows: bwd._split_sd), p, dS, the tile's dsp stores, and
  publishes dS (bf16, its own shared buffer, its `ex` barrier), then runs dq += dS kv on its
  column half. For the other's tile it waits on the other's `ex` and runs its column half of
  that tile's dq product with dS from shared memory, then hands the buffer back (`exfree`).
  Order per own tile i (`Config.bwd_alt_order`): "s_first" (default): issue [q; dO] kv_i^T;
  the other's tile i-1 dq product (async, so the two share the tensor pipe while the other
  warpgroup runs its element-wise work); wait for the scores; p, dS, dsp stores; publish dS_i;
  wait for dq_{i-1}, release its stage; dq_i; release stage i. "dq_first" (fwd_alt.py's
  pv_first, measured faster in the forward): the other's dq_{i-1} first (it waits only for
  the other's dS), then the scores; both waited, stage i-1 and the other's dS buffer released
  before the element-wise work; then as s_first.

Numerics are bwd.py's (exp2 domain, p = 0 on empty slots, dS = p (dP + dlse - delta), dq and
dsp in q's dtype, scale * dS in plane 0 of dsp); the tile loop stops at the token's last
non-empty tile and the remaining dsp columns are written as zeros. Needs an even ring depth.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from csa_jax.kernels.gluon.bwd import (_dq_pair_producer, _dsp_zeros, _p_ds, _pair_rows,
                                       _split_sd, _store_dsp, _store_qdo)
from csa_jax.kernels.gluon.dims import dq_alt_shared_bytes
from csa_jax.kernels.gluon.fwd import LOG2E, PRODUCER_WARPS, _program
from csa_jax.kernels.gluon.fwd_alt import REG_FILE, _opaque, _release

WG_WARPS = gl.constexpr(4)   # each consumer partition is one warpgroup
NUM_WARPS = 4                # the default partition (the producer); 12 warps in all


@gluon.jit
def _other_dq_issue(oth_ds, ring, full, ex, acc, j, W: gl.constexpr, STAGES: gl.constexpr,
                    DH: gl.constexpr):
    """Wait for the other warpgroup's dS of tile j, issue this half's dq product on it
    (async)."""
    mbarrier.wait(ex, (j // 2) & 1)
    # The tile's own barrier too (long complete; its next phase needs this warpgroup's
    # release), then the proxy fence, so this warpgroup's wgmma sees the cp.async data.
    mbarrier.wait(full.index(j % STAGES), (j // STAGES) & 1)
    fence_async_shared()
    v = ring.index(j % STAGES).slice(W * DH, DH, dim=1)
    return warpgroup_mma(oth_ds, v, acc, is_async=True)


@gluon.jit
def _alt_dq_consumer(idx_ptr, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_bufs, ring,
                     full, consumed, q_bar, ds_bufs, ex, exfree, row, tok, hb, ntiles,
                     W: gl.constexpr, D: gl.constexpr, K: gl.constexpr, HP: gl.constexpr,
                     BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
                     QK_SCALE: gl.constexpr, SCALE: gl.constexpr, QDO: gl.constexpr,
                     FUSE: gl.constexpr, DQ_FIRST: gl.constexpr):
    DH: gl.constexpr = D // 2
    OTHER: gl.constexpr = 1 - W
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    sd_zero, kcols, lse2, dc, ds_ptrs, p_ptrs = _pair_rows(
        4, lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, D, K, HP, BK, HBC, QDO, FUSE)
    acc = gl.zeros([HBC, DH], gl.float32, acc_layout)
    own_ds = ds_bufs.index(W)
    oth_ds = ds_bufs.index(OTHER)
    mbarrier.wait(q_bar, 0)
    if QDO:     # each warpgroup copies out its half of the [q; dO] rows
        _store_qdo(qdo_ptr, qdo_bufs.index(0), row, D, HBC, True, 2 * W, 2)
    for i in range(W, ntiles, 2):
        # (_opaque: the descriptors of [q; dO] and the tile stay in the loop; hoisted, ptxas
        # spills them, as in fwd_alt.py)
        s = _opaque(i % STAGES)
        tile = ring.index(s)
        qdo = qdo_bufs.index(_opaque(i * 0))
        ids = gl.load(idx_ptr + i * BK + kcols)
        if DQ_FIRST:
            # The other's tile i-1 first (it waits only for the other's dS, not for tile i's
            # copies), then this tile's scores; both complete before the element-wise work,
            # so stage i-1 and the other's dS buffer go back before it (fwd_alt's pv_first).
            acc = warpgroup_mma_init(acc)
            if i >= 1:
                acc = _other_dq_issue(oth_ds, ring, full, ex.index(OTHER), acc, i - 1, W,
                                      STAGES, DH)
            mbarrier.wait(full.index(s), (i // STAGES) & 1)
            fence_async_shared()
            sd = warpgroup_mma(qdo, tile.permute((1, 0)), sd_zero, use_acc=False,
                               is_async=True)
            sd, acc = warpgroup_mma_wait(0, deps=[sd, acc])
            if i >= 1:
                _release(consumed.index((i - 1) % STAGES))
                mbarrier.arrive(exfree.index(OTHER))
        else:
            mbarrier.wait(full.index(s), (i // STAGES) & 1)
            fence_async_shared()      # cp.async (generic proxy) -> wgmma (async proxy)
            sd = warpgroup_mma(qdo, tile.permute((1, 0)), sd_zero, use_acc=False,
                               is_async=True)
            acc = warpgroup_mma_init(acc)
            if i >= 1:
                # The other's tile i-1 (its dS published once its element-wise work is done)
                # runs on the tensor cores behind this tile's scores.
                acc = _other_dq_issue(oth_ds, ring, full, ex.index(OTHER), acc, i - 1, W,
                                      STAGES, DH)
            else:
                # Tile 0: the scores are all that is in flight (the wait count must be an
                # immediate, so the wait below is the same in both branches).
                acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))
            sd = warpgroup_mma_wait(1, deps=[sd])
        sc, dp = _split_sd(sd, HBC, BK)
        p, ds = _p_ds(sc, dp, ids, lse2, dc, QK_SCALE)
        _store_dsp(ds_ptrs, p_ptrs, i, ds, p, BK, SCALE)
        if i >= 2:
            mbarrier.wait(exfree.index(W), ((i // 2) - 1) & 1)   # the other read dS_{i-2}
        own_ds.store(ds.to(dt))
        fence_async_shared()          # generic-proxy stores -> wgmma reads (both warpgroups)
        gl.thread_barrier()
        mbarrier.arrive(ex.index(W))
        if not DQ_FIRST:
            acc = warpgroup_mma_wait(0, deps=[acc])
            if i >= 1:
                _release(consumed.index((i - 1) % STAGES))
                mbarrier.arrive(exfree.index(OTHER))
        acc = warpgroup_mma(own_ds, tile.slice(W * DH, DH, dim=1), acc)
        _release(consumed.index(s))
    # The other's last tile, if the list ends on one.
    last = ntiles - 1
    if last >= 0:
        if last % 2 == OTHER:
            acc = warpgroup_mma_init(acc)
            acc = _other_dq_issue(oth_ds, ring, full, ex.index(OTHER), acc, last, W, STAGES,
                                  DH)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _release(consumed.index(last % STAGES))
    _dsp_zeros(ds_ptrs, p_ptrs, ntiles + W, 2, K, BK, HBC)     # this warpgroup's tiles
    orows = gl.arange(0, HBC, layout=gl.SliceLayout(1, acc_layout))
    ocols = W * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, acc_layout))
    dq_ptrs = dq_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :]
    gl.store(dq_ptrs, (acc * SCALE).to(dq_ptr.dtype.element_ty))


@gluon.jit
def csa_dq_alt_kernel(q_ptr, do_ptr, kv_ptr, idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, o_ptr, dq_ptr,
                      dsp_ptr, qdo_ptr, dcout_ptr, T: gl.constexpr, N: gl.constexpr,
                      NHB: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, QK_SCALE: gl.constexpr, SCALE: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, QDO: gl.constexpr, FUSE: gl.constexpr,
                      DQ_FIRST: gl.constexpr):
    row, tok, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    qdo_bufs = gl.allocate_shared_memory(
        dtype, [1, 2 * HBC, D], gl.NVMMASharedLayout.get_default_for([2 * HBC, D], dtype))
    qdo_smem = qdo_bufs.index(0)
    ring = gl.allocate_shared_memory(
        dtype, [STAGES, BK, D], gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    ds_bufs = gl.allocate_shared_memory(
        dtype, [2, HBC, BK], gl.NVMMASharedLayout.get_default_for([HBC, BK], dtype))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ex = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    exfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=2)   # one arrival per consumer warpgroup
    for w in gl.static_range(2):
        mbarrier.init(ex.index(w), count=1)
        mbarrier.init(exfree.index(w), count=1)
    fz = (o_ptr, do_ptr, dcout_ptr)    # Config.bwd_fuse_delta's operands (FUSE only)
    gl.warp_specialize([
        (_dq_pair_producer, (q_ptr, do_ptr, kv_ptr, idx_tok, qdo_smem, ring, full, consumed,
                             q_bar, row, b, ntiles, N, D, K, BK, STAGES, HBC)),
        (_alt_dq_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_bufs,
                            ring, full, consumed, q_bar, ds_bufs, ex, exfree, row, tok, hb,
                            ntiles, 0, D, K, NHB * HBC, BK, STAGES, HBC, QK_SCALE, SCALE, QDO,
                            FUSE, DQ_FIRST)),
        (_alt_dq_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_bufs,
                            ring, full, consumed, q_bar, ds_bufs, ex, exfree, row, tok, hb,
                            ntiles, 1, D, K, NHB * HBC, BK, STAGES, HBC, QK_SCALE, SCALE, QDO,
                            FUSE, DQ_FIRST)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


def shared_bytes(D, block_k, stages, itemsize=2):
    """[q; dO], the ring, the two dS buffers, the barriers (dims.dq_alt_shared_bytes)."""
    return dq_alt_shared_bytes(D, block_k, stages, itemsize)


def producer_regs(consumer_regs):
    """Registers per producer thread that two consumer warpgroups of consumer_regs leave."""
    return (REG_FILE - 256 * int(consumer_regs)) // 128


ORDERS = ("s_first", "dq_first")       # Config.bwd_alt_order


def constexprs(*, T, N, NHB, D, K, BK, stages, scale, consumer_regs=216, qdo=False,
               fuse_delta=False, order="s_first"):
    """The alternating dq kernel's compile-time parameters (also used by the CPU compile
    checks)."""
    if stages % 2:
        raise ValueError(f"bwd_schedule='alternate' needs an even ring depth, got "
                         f"bwd_stages={stages}")
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, SCALE=float(scale),
                CONSUMER_REGS=int(consumer_regs), QDO=bool(qdo), FUSE=bool(fuse_delta),
                DQ_FIRST=ORDERS.index(order) == 1)
