"""The CSA forward with alternating consumer warpgroups (`Config.schedule="alternate"`).

FlashMLA's SM90 schedule (../shared/gpu_kernels.md), written for Gluon: three partitions of
4 warps each (384 threads), one program = 64 heads of one token as in fwd.py:

- producer = the default partition: fwd._producer unchanged: q once, then every 64-row tile
  of the token's slots gathered with cp.async into the 2-stage ring ("full" barriers); it
  refills a stage once its "consumed" barrier has had one arrival from EACH consumer. It keeps
  what the consumers leave of the register file (`producer_regs(consumer_regs)`: 72 at 216).
- consumer warpgroup W = 0, 1: two worker partitions of `Config.alt_regs` registers per
  thread (setmaxnreg; 216 by default, FlashMLA's split). Warpgroup W owns the tiles
  i with i % 2 == W and output columns [W*D/2, (W+1)*D/2). For its own tile it computes the
  whole S = q kv^T (m64n64, q and the tile from shared memory) and the online softmax from the
  running (max, sum) left by the other warpgroup's previous tile, publishes (max, sum, rescale
  factor) and the bf16 P tile in shared memory (its `ex` barrier), then runs PV for its column
  half with P from registers. For the other's tiles it waits on the other's `ex`, rescales its
  accumulator and runs PV for its half with P from shared memory, then hands the P buffer back
  (`exfree`). Order per own tile i: issue S_i; PV_{i-1} of the other's tile (async, so S_i and
  PV_{i-1} share the tensor pipe while the other warpgroup runs its softmax); wait S_i;
  softmax; publish; wait PV_{i-1}, release its stage; PV_i; release stage i.
  The running max and sum travel with the tiles, so both warpgroups end with the final (m, l)
  and each writes its half of o; warpgroup 0 writes lse.

SPLIT (`Config.alt_split`): each stage is gathered as two column halves with their own "full"
and "consumed" barriers (_producer_split): half h is refilled once its readers are done (half
s % 2 of stage s: its owner's PV; the other half: the owner's S and the other warpgroup's PV),
FlashMLA's half-D pipelining. S still waits for both halves: issuing its first half before the
second half's barrier wait (one accumulator chained across the wait loop) made ptxas serialize
every wgmma of the kernel (C7514), and a second accumulator spilled 436 B.

STEP ORDER (`Config.alt_order`, ORDER): the above is "s_first" (0); "pv_first" (1,
_own_tile_pv_first, the default: measured 1.08-1.09x faster) issues the other's PV_{i-1}
before S_i, so the release of stage i-1 does not wait for tile i's copies; "stats_first" (2,
_own_tile_stats_first, measured slower) hands (max, sum, rescale) over on their own barriers
(`stb`) before P is written. The barrier
protocol of each is modeled in tests/test_gluon_alt_protocol.py; docs/perf/gluon_alt_h200.md.

Numerics are fwd.py's (exp2 domain, finite initial max, empty slots masked, sink joined at the
end, empty rows o = 0 and lse = sink or EMPTY_LSE); the tile loop stops at the token's last
non-empty tile. Needs an even ring depth (stage parity = tile parity).

Register spills (CPU compile, sm_90a, ptxas -v): without `_opaque`, LLVM hoisted q's 32 wgmma
descriptors out of the tile loop and ptxas spilled them (232 B with the consumers as the two
workers, 444 B with consumer 0 as the default partition); as written: 0 spills at 200 and 216
consumer registers.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from csa_jax.kernels.gluon.fwd import (LOG2E, NEG, PRODUCER_LAYOUT, PRODUCER_WARPS, _producer,
                                       _producer_start, _program, _q_and_ring, _scaled_o,
                                       _softmax_step, _store_o)

WG_WARPS = gl.constexpr(4)   # each consumer partition is one warpgroup
NUM_WARPS = 4                # the default partition (the producer); 12 warps in all


@gluon.jit
def _opaque(x):
    # A value LLVM cannot see through, so the wgmma descriptors built from it stay in the loop:
    # q's 32 (and, with 2 stages and a step-2 loop, the tile's) are loop invariant, and hoisting
    # them out of the tile loop left ptxas spilling uniform registers (232 B at 216 registers).
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _bar(bars, s, h, SPLIT: gl.constexpr):
    """Stage s's barrier, or with SPLIT its column half h's (barriers [2 * STAGES])."""
    if SPLIT:
        return bars.index(s * 2 + h)
    else:
        return bars.index(s)


@gluon.jit
def _producer_split(q_ptr, kv_ptr, idx_ptr, q_smem, ring, full, consumed, q_bar, row, b,
                    ntiles, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
                    BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr):
    """fwd._producer with each tile gathered as two column halves, each with its own "full"
    and "consumed" barrier: half h of stage s is refilled as soon as its readers are done."""
    DH: gl.constexpr = D // 2
    _, krows, kv_base, ids = _producer_start(q_ptr, kv_ptr, idx_ptr, q_smem, q_bar, row, b, N,
                                             D, BK, HBC)
    hcols = gl.arange(0, DH, layout=gl.SliceLayout(0, PRODUCER_LAYOUT))
    for i in range(ntiles):
        s = i % STAGES
        valid = ids >= 0
        rows = kv_base + gl.where(valid, ids, 0).to(gl.int64)[:, None] * D
        for h in gl.static_range(2):
            if i >= STAGES:
                mbarrier.wait(consumed.index(s * 2 + h), ((i // STAGES) - 1) & 1)
            async_copy.async_copy_global_to_shared(ring.index(s).slice(h * DH, DH, dim=1),
                                                   rows + (h * DH + hcols)[None, :],
                                                   mask=valid[:, None])
            async_copy.mbarrier_arrive(full.index(s * 2 + h), increment_count=False)
        nxt = (i + 1) * BK + krows
        ids = gl.load(idx_ptr + nxt, mask=nxt < K, other=-1)


@gluon.jit
def _producer_for(q_ptr, kv_ptr, idx_ptr, q_smem, ring, full, consumed, q_bar, row, b, ntiles,
                  N: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                  STAGES: gl.constexpr, HBC: gl.constexpr, PREFETCH: gl.constexpr,
                  SPLIT: gl.constexpr):
    if SPLIT:
        _producer_split(q_ptr, kv_ptr, idx_ptr, q_smem, ring, full, consumed, q_bar, row, b,
                        ntiles, N, D, K, BK, STAGES, HBC)
    else:
        _producer(q_ptr, kv_ptr, idx_ptr, q_smem, ring, full, consumed, q_bar, row, b, ntiles,
                  N, D, K, BK, STAGES, HBC, PREFETCH)


@gluon.jit
def _row(stats, k):
    n: gl.constexpr = stats.shape[0] // 8
    return stats.slice(k * n, n)


@gluon.jit
def _release(bar):
    gl.thread_barrier()          # every warp of this warpgroup is past its reads
    mbarrier.arrive(bar)


@gluon.jit
def _publish(stats, W: gl.constexpr, p_smem, p, m, l, alpha, bar):
    """Owner -> other warpgroup: the bf16 P tile and (max, sum, rescale) of a tile."""
    p_smem.store(p.to(p_smem.dtype))
    _row(stats, 4 * W).store(m)
    _row(stats, 4 * W + 1).store(l)
    _row(stats, 4 * W + 2).store(alpha)
    fence_async_shared()         # P is read by the other warpgroup's wgmma (async proxy)
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _other_pv_issue(stats, p_smem, ring, full, acc, ex, j, srow: gl.constexpr,
                    orow: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr,
                    DH: gl.constexpr, SPLIT: gl.constexpr, ABLATE: gl.constexpr):
    """Wait for the other warpgroup's tile j, rescale, issue PV_j on this half (async)."""
    mbarrier.wait(ex, (j // 2) & 1)
    # The tile's own barrier too (long complete; its next phase needs this warpgroup's release),
    # then the proxy fence, so this warpgroup's wgmma sees the cp.async data.
    mbarrier.wait(_bar(full, j % STAGES, W, SPLIT), (j // STAGES) & 1)
    fence_async_shared()
    acc = warpgroup_mma_wait(1, deps=[acc])       # (nothing of acc's is in flight)
    m = _row(stats, 4 * (1 - W)).load(srow)
    l = _row(stats, 4 * (1 - W) + 1).load(srow)
    alpha = _row(stats, 4 * (1 - W) + 2).load(srow)
    acc = acc * gl.convert_layout(alpha, orow)[:, None]
    v = ring.index(j % STAGES).slice(W * DH, DH, dim=1)
    return _pv_smem(p_smem, v, acc, ABLATE), m, l


@gluon.jit
def _pv_smem(p_smem, v, acc, ABLATE: gl.constexpr):
    """Issue PV on this half with the other's P from shared memory (async); ABLATE: none."""
    if ABLATE:
        return warpgroup_mma_init(acc)
    else:
        return warpgroup_mma(p_smem, v, acc, is_async=True)


@gluon.jit
def _tile_views(idx_ptr, i, ring, q_smem, kcols, BK: gl.constexpr, STAGES: gl.constexpr):
    """Tile i's (stage, row ids for the mask, ring view, q view); the views come from opaque
    indices (see _opaque)."""
    s = _opaque(i % STAGES)
    return s, gl.load(idx_ptr + i * BK + kcols), ring.index(s), q_smem.index(_opaque(i * 0))


@gluon.jit
def _issue_s(q, tile, full, s, i, s_zero, STAGES: gl.constexpr, SPLIT: gl.constexpr,
             ABLATE: gl.constexpr):
    """Wait for tile i's copies (both column halves with SPLIT), issue S_i = q tile^T (async)."""
    mbarrier.wait(_bar(full, s, 0, SPLIT), (i // STAGES) & 1)
    if SPLIT:
        mbarrier.wait(_bar(full, s, 1, SPLIT), (i // STAGES) & 1)
    fence_async_shared()
    if ABLATE:
        return warpgroup_mma_init(s_zero)
    else:
        return warpgroup_mma(q, tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _own_pv(acc, alpha, p, tile, consumed, s, W: gl.constexpr, DH: gl.constexpr,
            orow: gl.constexpr, p_layout: gl.constexpr, SPLIT: gl.constexpr,
            ABLATE: gl.constexpr):
    """Rescale, PV_i on this warpgroup's half with P from registers, release stage i."""
    acc = acc * gl.convert_layout(alpha, orow)[:, None]
    if ABLATE:   # (benchmark only) no product: P's row sums keep the softmax alive
        acc = acc + gl.convert_layout(gl.sum(p, axis=1), orow)[:, None]
    else:
        pv = gl.convert_layout(p.to(tile.dtype), p_layout)
        acc = warpgroup_mma(pv, tile.slice(W * DH, DH, dim=1), acc)
    _release(_bar(consumed, s, W, SPLIT))
    return acc


@gluon.jit
def _close_tile(acc, alpha, p, tile, consumed, exfree, s, i, W: gl.constexpr,
                STAGES: gl.constexpr, DH: gl.constexpr, orow: gl.constexpr,
                p_layout: gl.constexpr, SPLIT: gl.constexpr, ABLATE: gl.constexpr):
    """Wait for the other's PV_{i-1} (this half): release its stage and the other's P buffer;
    then PV_i and release stage i."""
    acc = warpgroup_mma_wait(0, deps=[acc])
    if i >= 1:
        _release(_bar(consumed, (i - 1) % STAGES, W, SPLIT))
        _release(exfree.index(1 - W))
    return _own_pv(acc, alpha, p, tile, consumed, s, W, DH, orow, p_layout, SPLIT, ABLATE)


@gluon.jit
def _stats(stats, k: gl.constexpr, srow: gl.constexpr):
    """(max, sum, rescale) of warpgroup k's latest tile, from shared memory."""
    return (_row(stats, 4 * k).load(srow), _row(stats, 4 * k + 1).load(srow),
            _row(stats, 4 * k + 2).load(srow))


@gluon.jit
def _other_pv_p(p_smem, ring, full, acc, alpha, ex, j, orow: gl.constexpr, W: gl.constexpr,
                STAGES: gl.constexpr, DH: gl.constexpr, SPLIT: gl.constexpr,
                ABLATE: gl.constexpr):
    """ORDER 2: wait for the other's P of tile j (its stats are already here), rescale, issue
    PV_j on this half (async)."""
    mbarrier.wait(ex, (j // 2) & 1)
    mbarrier.wait(_bar(full, j % STAGES, W, SPLIT), (j // STAGES) & 1)
    fence_async_shared()
    acc = warpgroup_mma_wait(0, deps=[acc])       # (nothing of acc's is in flight)
    acc = acc * gl.convert_layout(alpha, orow)[:, None]
    v = ring.index(j % STAGES).slice(W * DH, DH, dim=1)
    return _pv_smem(p_smem, v, acc, ABLATE)


@gluon.jit
def _own_tile_stats_first(idx_ptr, i, acc, m, l, bufs, W: gl.constexpr,
                          BK: gl.constexpr, STAGES: gl.constexpr, DH: gl.constexpr,
                          QK_SCALE: gl.constexpr, srow: gl.constexpr, orow: gl.constexpr,
                          p_layout: gl.constexpr, SPLIT: gl.constexpr, ABLATE: gl.constexpr):
    """ORDER 2 (Config.alt_order="stats_first"): tile i with (max, sum, rescale) handed over
    on their own barrier (`stb`) right after the softmax, before P is written, so the other
    warpgroup's softmax of tile i+1 waits only for the softmax of tile i. Order: issue S_i;
    wait the other's stats of tile i-1; wait S_i; softmax; publish stats; wait the other's
    P_{i-1}, issue PV_{i-1} (async); publish P_i; wait PV_{i-1}, release; PV_i; release."""
    ring, q_smem, full, consumed, ex, exfree, own_p, oth_p, st_bufs, s_zero, kcols, stb = bufs
    OTHER: gl.constexpr = 1 - W
    s, ids, tile, q = _tile_views(idx_ptr, i, ring, q_smem, kcols, BK, STAGES)
    sc = _issue_s(q, tile, full, s, i, s_zero, STAGES, SPLIT, ABLATE)
    alpha_o = gl.full([m.shape[0]], 1.0, gl.float32, srow)
    if i >= 1:
        mbarrier.wait(stb.index(OTHER), ((i - 1) // 2) & 1)
        m, l, alpha_o = _stats(st_bufs, OTHER, srow)
    sc = warpgroup_mma_wait(0, deps=[sc])
    if SPLIT:
        _release(_bar(consumed, s, OTHER, SPLIT))    # the other's column half: S is done
    p, alpha, m_new, l = _softmax_step(sc, ids, m, l, QK_SCALE)
    _row(st_bufs, 4 * W).store(m_new)
    _row(st_bufs, 4 * W + 1).store(l)
    _row(st_bufs, 4 * W + 2).store(alpha)
    gl.thread_barrier()
    mbarrier.arrive(stb.index(W))
    acc = warpgroup_mma_init(acc)
    if i >= 1:
        acc = _other_pv_p(oth_p, ring, full, acc, alpha_o, ex.index(OTHER), i - 1, orow, W,
                          STAGES, DH, SPLIT, ABLATE)
    else:
        acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))
    if i >= 2:
        mbarrier.wait(exfree.index(W), ((i // 2) - 1) & 1)   # the other has read tile i-2's P
    own_p.store(p.to(own_p.dtype))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ex.index(W))
    acc = _close_tile(acc, alpha, p, tile, consumed, exfree, s, i, W, STAGES, DH, orow,
                      p_layout, SPLIT, ABLATE)
    return acc, m_new, l


@gluon.jit
def _own_tile_pv_first(idx_ptr, i, acc, m, l, bufs, W: gl.constexpr,
                       BK: gl.constexpr, STAGES: gl.constexpr, DH: gl.constexpr,
                       QK_SCALE: gl.constexpr, srow: gl.constexpr, orow: gl.constexpr,
                       p_layout: gl.constexpr, SPLIT: gl.constexpr, ABLATE: gl.constexpr,
                       WAIT_PV: gl.constexpr):
    """ORDER 1 (Config.alt_order="pv_first"): the other's PV_{i-1} is issued before S_i (it
    only waits for the other's publish, not for tile i's copies), both are waited together,
    and this warpgroup's half of stage i-1 and the other's P buffer are released then, before
    the softmax of tile i (order 0 releases them after it). ORDER 3 ("pv_release", WAIT_PV):
    PV_{i-1} is waited and stage i-1 released before waiting for tile i's copies, so the
    release does not wait for tile i either (S_i then starts after PV_{i-1} is done)."""
    ring, q_smem, full, consumed, ex, exfree, own_p, oth_p, st_bufs, s_zero, kcols, _ = bufs
    OTHER: gl.constexpr = 1 - W
    s, ids, tile, q = _tile_views(idx_ptr, i, ring, q_smem, kcols, BK, STAGES)
    acc = warpgroup_mma_init(acc)
    if i >= 1:
        acc, m, l = _other_pv_issue(st_bufs, oth_p, ring, full, acc, ex.index(OTHER), i - 1,
                                    srow, orow, W, STAGES, DH, SPLIT, ABLATE)
        if WAIT_PV:
            acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))
            _release(_bar(consumed, (i - 1) % STAGES, W, SPLIT))
            _release(exfree.index(OTHER))
    sc = _issue_s(q, tile, full, s, i, s_zero, STAGES, SPLIT, ABLATE)
    sc, acc = warpgroup_mma_wait(0, deps=[sc, acc])
    if i >= 1:
        if not WAIT_PV:
            _release(_bar(consumed, (i - 1) % STAGES, W, SPLIT))
            _release(exfree.index(OTHER))
    if SPLIT:
        _release(_bar(consumed, s, OTHER, SPLIT))    # the other's column half: S is done
    p, alpha, m_new, l = _softmax_step(sc, ids, m, l, QK_SCALE)
    if i >= 2:
        mbarrier.wait(exfree.index(W), ((i // 2) - 1) & 1)   # the other has read tile i-2's P
    _publish(st_bufs, W, own_p, p, m_new, l, alpha, ex.index(W))
    acc = _own_pv(acc, alpha, p, tile, consumed, s, W, DH, orow, p_layout, SPLIT, ABLATE)
    return acc, m_new, l


@gluon.jit
def _own_tile(idx_ptr, i, acc, m, l, bufs, W: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, DH: gl.constexpr, QK_SCALE: gl.constexpr,
              srow: gl.constexpr, orow: gl.constexpr, p_layout: gl.constexpr,
              SPLIT: gl.constexpr, ABLATE: gl.constexpr):
    """This warpgroup's tile i, and meanwhile (i >= 1) the PV of the other's tile i-1:
    returns (acc, m, l) after both."""
    ring, q_smem, full, consumed, ex, exfree, own_p, oth_p, st_bufs, s_zero, kcols, _ = bufs
    OTHER: gl.constexpr = 1 - W
    s, ids, tile, q = _tile_views(idx_ptr, i, ring, q_smem, kcols, BK, STAGES)
    sc = _issue_s(q, tile, full, s, i, s_zero, STAGES, SPLIT, ABLATE)
    acc = warpgroup_mma_init(acc)
    if i >= 1:
        # The other's tile i-1 (its P and stats published once its softmax is done) runs on the
        # tensor cores behind S_i.
        acc, m, l = _other_pv_issue(st_bufs, oth_p, ring, full, acc, ex.index(OTHER), i - 1,
                                    srow, orow, W, STAGES, DH, SPLIT, ABLATE)
    else:
        # Tile 0: S_0 is all that is in flight (the wait-count below must be an immediate).
        acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))
    sc = warpgroup_mma_wait(1, deps=[sc])
    if SPLIT:
        _release(_bar(consumed, s, OTHER, SPLIT))    # the other's column half: S is done
    sc = gl.where((ids >= 0)[None, :], sc * QK_SCALE, float("-inf"))
    m_new = gl.maximum(m, gl.max(sc, axis=1))
    p = gl.exp2(sc - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    l = l * alpha + gl.sum(p, axis=1)
    if i >= 2:
        mbarrier.wait(exfree.index(W), ((i // 2) - 1) & 1)   # the other has read tile i-2's P
    _publish(st_bufs, W, own_p, p, m_new, l, alpha, ex.index(W))
    acc = _close_tile(acc, alpha, p, tile, consumed, exfree, s, i, W, STAGES, DH, orow,
                      p_layout, SPLIT, ABLATE)
    return acc, m_new, l


@gluon.jit
def _alt_consumer(idx_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full, consumed, q_bar,
                  p_bufs, st_bufs, ex, exfree, stb, row, h0, ntiles, W: gl.constexpr,
                  D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
                  QK_SCALE: gl.constexpr, SPLIT: gl.constexpr, ORDER: gl.constexpr,
                  ABLATE: gl.constexpr):
    DH: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    scol: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    ocol: gl.constexpr = gl.SliceLayout(0, o_layout)
    OTHER: gl.constexpr = 1 - W
    own_p = p_bufs.index(W)
    oth_p = p_bufs.index(OTHER)

    m = gl.full([HBC], NEG, gl.float32, srow)
    l = gl.zeros([HBC], gl.float32, srow)
    acc = gl.zeros([HBC, DH], gl.float32, o_layout)
    s_zero = gl.zeros([HBC, BK], gl.float32, s_layout)
    kcols = gl.arange(0, BK, layout=scol)
    mbarrier.wait(q_bar, 0)
    bufs = (ring, q_smem, full, consumed, ex, exfree, own_p, oth_p, st_bufs, s_zero, kcols,
            stb)
    for i in range(W, ntiles, 2):
        if ORDER == 2:
            acc, m, l = _own_tile_stats_first(idx_ptr, i, acc, m, l, bufs, W, BK, STAGES, DH,
                                              QK_SCALE, srow, orow, p_layout, SPLIT, ABLATE)
        elif ORDER == 1 or ORDER == 3:
            acc, m, l = _own_tile_pv_first(idx_ptr, i, acc, m, l, bufs, W, BK, STAGES, DH,
                                           QK_SCALE, srow, orow, p_layout, SPLIT, ABLATE,
                                           ORDER == 3)
        else:
            acc, m, l = _own_tile(idx_ptr, i, acc, m, l, bufs, W, BK, STAGES, DH, QK_SCALE,
                                  srow, orow, p_layout, SPLIT, ABLATE)
    # The other's last tile, if the list ends on one.
    last = ntiles - 1
    if last >= 0:
        if last % 2 == OTHER:
            if ORDER == 2:
                mbarrier.wait(stb.index(OTHER), (last // 2) & 1)
                m, l, alpha_o = _stats(st_bufs, OTHER, srow)
                acc = _other_pv_p(oth_p, ring, full, acc, alpha_o, ex.index(OTHER), last, orow,
                                  W, STAGES, DH, SPLIT, ABLATE)
            else:
                acc, m, l = _other_pv_issue(st_bufs, oth_p, ring, full, acc, ex.index(OTHER),
                                            last, srow, orow, W, STAGES, DH, SPLIT, ABLATE)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _release(_bar(consumed, last % STAGES, W, SPLIT))

    o = _scaled_o(m, l, acc, sink_ptr, lse_ptr, o_ptr, row, h0, srow, orow, HBC, W == 0)
    _store_o(o_ptr, o, row, gl.arange(0, HBC, layout=orow),
             W * DH + gl.arange(0, DH, layout=ocol), D, HBC)


@gluon.jit
def csa_fwd_alt_kernel(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr,
                       T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
                       K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       QK_SCALE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PREFETCH: gl.constexpr, SPLIT: gl.constexpr, ORDER: gl.constexpr,
                       ABLATE: gl.constexpr):
    row, _, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    q_smem, ring = _q_and_ring(dtype, HBC, D, BK, STAGES, True)
    p_bufs = gl.allocate_shared_memory(dtype, [2, HBC, BK],
                                       gl.NVMMASharedLayout.get_default_for([HBC, BK], dtype))
    # (max, sum, rescale) of warpgroup w's latest tile: rows 4w .. 4w+2.
    st_bufs = gl.allocate_shared_memory(gl.float32, [8 * HBC], gl.SwizzledSharedLayout(
        1, 1, 1, [0]))
    NB: gl.constexpr = STAGES * 2 if SPLIT else STAGES
    full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ex = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    exfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if ORDER == 2:   # the (max, sum, rescale) barriers of warpgroup w's latest tile
        stb = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    else:
        stb = ex    # (unused)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    for s in gl.static_range(STAGES):
        if SPLIT:
            # Half h of a stage: read by its owner's S (owner = s % 2) and by warpgroup h's PV.
            for h in gl.static_range(2):
                mbarrier.init(full.index(s * 2 + h), count=PRODUCER_WARPS * 32)
                mbarrier.init(consumed.index(s * 2 + h), count=1 if h == s % 2 else 2)
        else:
            mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
            mbarrier.init(consumed.index(s), count=2)   # one arrival per consumer warpgroup
    for w in gl.static_range(2):
        mbarrier.init(ex.index(w), count=1)
        mbarrier.init(exfree.index(w), count=1)
        if ORDER == 2:
            mbarrier.init(stb.index(w), count=1)
    # The producer is the default partition (it gets what the two consumers leave of the
    # register file: 72 per thread at 216 each); the consumers are the two workers.
    gl.warp_specialize([
        (_producer_for, (q_ptr, kv_ptr, idx_tok, q_smem.index(0), ring, full, consumed, q_bar,
                         row, b, ntiles, N, D, K, BK, STAGES, HBC, PREFETCH, SPLIT)),
        (_alt_consumer, (idx_tok, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full, consumed, q_bar,
                         p_bufs, st_bufs, ex, exfree, stb, row, hb * HBC, ntiles, 0, D, BK,
                         STAGES, HBC, QK_SCALE, SPLIT, ORDER, ABLATE)),
        (_alt_consumer, (idx_tok, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full, consumed, q_bar,
                         p_bufs, st_bufs, ex, exfree, stb, row, hb * HBC, ntiles, 1, D, BK,
                         STAGES, HBC, QK_SCALE, SPLIT, ORDER, ABLATE)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


REG_FILE = 168 * 384   # what ptxas gives 384 threads (.maxnreg 168), shared out by setmaxnreg


def producer_regs(consumer_regs):
    """Registers per producer thread that two consumer warpgroups of consumer_regs leave."""
    return (REG_FILE - 256 * int(consumer_regs)) // 128


# Config.alt_order -> ORDER 0, 1, 2, 3
ORDERS = ("s_first", "pv_first", "stats_first", "pv_release")


def constexprs(*, T, N, NHB, D, K, BK, stages, scale, consumer_regs=216, prefetch=True,
               split=False, order="pv_first", ablate=0):
    """The alternating kernel's compile-time parameters (also used by the CPU compile checks)."""
    if stages % 2:
        raise ValueError(f"schedule='alternate' needs an even ring depth, got stages={stages}")
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, CONSUMER_REGS=int(consumer_regs),
                PREFETCH=bool(prefetch), SPLIT=bool(split), ORDER=ORDERS.index(order),
                ABLATE=int(ablate))


def config_constexprs(config, **dims):
    """constexprs() from a gluon Config's alternate-schedule fields (fwd.forward and the
    resource report use the same mapping)."""
    return constexprs(**dims, consumer_regs=config.alt_regs, split=config.alt_split,
                      order=config.alt_order, ablate=config.alt_ablate)
