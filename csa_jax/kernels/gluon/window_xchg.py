"""Window reuse, cr0: the exchange schedule (`Config(layout="cr0", win_schedule="exchange")`).

The same block structure as window.py (a program owns strided blocks of BT = 16 consecutive
tokens of one 64-head block; per block the span, kv rows t0 - W .. t0 + 15, is copied once into
shared memory; per token q [64, D] is the only copy), with the consumer work laid out so that the
two consumer warpgroups synchronise twice per token instead of at every cross-warpgroup reduction
(Nsight Compute of window.py, docs/perf/gluon_window_h200.md: latency-bound, 14% issue slots
busy, the top stall on local / global loads, 120k local-memory spill requests per launch):

- three partitions of one warpgroup each (384 threads): the producer is the default partition
  (window._producer, unchanged: q per token, the span per block, 16-byte cp.async); consumer
  warpgroups 0 and 1 are the two workers (setmaxnreg `Config.win_regs`).
- warpgroup 0 computes the scores of the span's first W/2 rows, warpgroup 1 those of the next W/2
  rows and of the block's 16 own rows, each over all of D (wgmma, q and the span from shared
  memory, heads as M = 64; m64n64 + m64n16 per warpgroup at W = 128). Each keeps whole score rows
  of its columns, so its row max and sum are warp shuffles, no barrier.
- exchange 1 (`ex_m`): each publishes its row max (256 B) and takes the other's: the token's max.
- exchange 2 (`ex_p`): each writes its bf16 P tiles to shared memory and takes the other's.
  The other's row sum is summed from its P tiles (no second f32 buffer: with q 64 KiB + span
  144 KiB + P 18 KiB the H200's 227 KiB per block leave ~500 B).
- PV: each warpgroup owns D/2 output columns ([64, 256] f32, 128 registers a thread): its own P
  from registers, the other's from shared memory, one product per span tile; then it writes its
  half of o (warpgroup 0 also lse).
The window is one softmax step per token (all W + 16 columns at once): no running rescale.
Buffer reuse is ordered by the two exchanges (a warpgroup publishes token i + 1's max only after
its PV and epilogue of token i, so the other may then overwrite the P tiles and the max slot).

OVERLAP (`win_schedule="overlap"`): one loop over the program's tokens that issues token i + 1's
score products before token i's o stores. Q_AHEAD (`win_prefetch`): the producer prefetches a
later token's q into L2. ABLATE (`win_ablate`, benchmark only): see constexprs(). Measured on the
H200 (round 1): 12% faster than window.py's lockstep kernel, 1.29x FlashMLA's time at Pro cr0
T = 4096.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.fwd import NEG, _finish
from csa_jax.kernels.gluon.fwd_alt import _opaque, _release
from csa_jax.kernels.gluon.window import (BLOCK_T, BT, HBC, _producer, _program_blocks,
                                          _span_barriers, _span_buffers)

WG_WARPS = gl.constexpr(4)
NUM_WARPS = 4                # the default partition (the producer); 12 warps in all


@gluon.jit
def _mask(sc, row0, lo, hi, QK_SCALE: gl.constexpr):
    """Scores of consecutive kv rows row0 .. in the exp2 domain, -inf outside lo .. hi."""
    n: gl.constexpr = sc.shape[1]
    rows = row0 + gl.arange(0, n, layout=gl.SliceLayout(0, sc.type.layout))
    return gl.where(((rows >= lo) & (rows <= hi))[None, :], sc * QK_SCALE, float("-inf"))


@gluon.jit
def _qk(q_smem, tile, layout: gl.constexpr):
    n: gl.constexpr = tile.shape[0]
    return warpgroup_mma(q_smem, tile.permute((1, 0)), gl.zeros([HBC, n], gl.float32, layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _rowsum(p_smem, layout: gl.constexpr, srow: gl.constexpr):
    """Row sums of a bf16 P tile in shared memory, in the row layout srow."""
    return gl.convert_layout(gl.sum(p_smem.load(layout).to(gl.float32), axis=1), srow)


@gluon.constexpr_function
def _s_layout(W):
    """Scores of a W/2-row span tile (one warpgroup, heads as M = 64)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, W // 2, 16])


@gluon.constexpr_function
def _c_layout():
    """Scores of the span's 16-row tail."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, BLOCK_T, 16])


@gluon.constexpr_function
def _o_layout(D):
    """A warpgroup's [64, D/2] f32 accumulator."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, D // 2, 16])


@gluon.jit
def _issue(bufs, q_ready, it, W: gl.constexpr, D: gl.constexpr, WG: gl.constexpr):
    """Wait for token `it`'s q and issue this warpgroup's score products (async): warpgroup 0
    the span rows t0 - W .. t0 - W/2 - 1, warpgroup 1 rows t0 - W/2 .. t0 - 1 and the tail
    t0 .. t0 + 15. The buffers are indexed with an opaque 0 so that their wgmma descriptors
    are rebuilt per token instead of hoisted out of the loops (and spilled: fwd_alt.py)."""
    q_smem, win_a, win_b = bufs[0], bufs[1], bufs[2]
    s_layout: gl.constexpr = _s_layout(W)
    c_layout: gl.constexpr = _c_layout()
    o_layout: gl.constexpr = _o_layout(D)
    HALF: gl.constexpr = W // 2
    mbarrier.wait(q_ready, it & 1)
    fence_async_shared()
    z = _opaque(it * 0)
    q = q_smem.index(z)
    if WG == 0:
        s = (_qk(q, win_a.index(z).slice(0, HALF), s_layout),)
    else:
        s = (_qk(q, win_a.index(z).slice(HALF, HALF), s_layout),
             _qk(q, win_b.index(z), c_layout))
    return s


@gluon.jit
def _token(s, t0, t, it, bufs, bars, W: gl.constexpr, D: gl.constexpr,
           QK_SCALE: gl.constexpr, WG: gl.constexpr):
    """The token's softmax and PV from its score products `s` (in flight): (acc, m, l) of this
    warpgroup's D/2 output columns, the token's row max and sum (exp2 domain)."""
    q_smem, win_a, win_b, p_a, p_b, p_c, mx = bufs
    q_ready, q_free, span_ready, span_free, ex_m, ex_p = bars
    s_layout: gl.constexpr = _s_layout(W)
    c_layout: gl.constexpr = _c_layout()
    o_layout: gl.constexpr = _o_layout(D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    crow: gl.constexpr = gl.SliceLayout(1, c_layout)
    DH: gl.constexpr = D // 2
    HALF: gl.constexpr = W // 2
    OTHER: gl.constexpr = 1 - WG
    dtype: gl.constexpr = p_a.dtype
    ph = it & 1
    lo = gl.maximum(t - W + 1, 0)                  # rows < 0 are zero-filled
    if WG == 0:
        sa = warpgroup_mma_wait(0, deps=[s[0]])
        _release(q_free)                           # q may be refilled once both are
        sa = _mask(sa, t0 - W, lo, t, QK_SCALE)
        m_own = gl.max(sa, axis=1)
    else:
        sb, sc = warpgroup_mma_wait(0, deps=[s[0], s[1]])
        _release(q_free)
        sb = _mask(sb, t0 - HALF, lo, t, QK_SCALE)
        sc = _mask(sc, t0, lo, t, QK_SCALE)
        m_own = gl.maximum(gl.max(sb, axis=1), gl.convert_layout(gl.max(sc, axis=1), srow))
    # exchange 1: the row max
    mx.slice(WG * HBC, HBC).store(m_own)
    _release(ex_m.index(WG))
    mbarrier.wait(ex_m.index(OTHER), ph)
    m = gl.maximum(gl.maximum(m_own, mx.slice(OTHER * HBC, HBC).load(srow)), NEG)
    # P of this warpgroup's columns, to shared memory for the other
    if WG == 0:
        pa = gl.exp2(sa - m[:, None]).to(dtype)
        l_own = gl.sum(pa.to(gl.float32), axis=1)
        p_a.store(pa)
    else:
        pb = gl.exp2(sb - m[:, None]).to(dtype)
        pc = gl.exp2(sc - gl.convert_layout(m, crow)[:, None]).to(dtype)
        l_own = gl.sum(pb.to(gl.float32), axis=1) + gl.convert_layout(
            gl.sum(pc.to(gl.float32), axis=1), srow)
        p_b.store(pb)
        p_c.store(pc)
    fence_async_shared()          # P is read by the other warpgroup's wgmma
    _release(ex_p.index(WG))
    mbarrier.wait(ex_p.index(OTHER), ph)
    # exchange 2 done. PV on this warpgroup's D/2 columns: own P from registers, the other's
    # from shared memory
    z = _opaque(it * 0)
    va = win_a.index(z).slice(0, HALF).slice(WG * DH, DH, dim=1)
    vb = win_a.index(z).slice(HALF, HALF).slice(WG * DH, DH, dim=1)
    vc = win_b.index(z).slice(WG * DH, DH, dim=1)
    acc = gl.zeros([HBC, DH], gl.float32, o_layout)
    if WG == 0:
        acc = warpgroup_mma(gl.convert_layout(pa, a_layout), va, acc, use_acc=False,
                            is_async=True)
        acc = warpgroup_mma(p_b, vb, acc, is_async=True)
        acc = warpgroup_mma(p_c, vc, acc, is_async=True)
        l_oth = _rowsum(p_b, s_layout, srow) + _rowsum(p_c, c_layout, srow)
    else:
        acc = warpgroup_mma(p_a, va, acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(pb, a_layout), vb, acc, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(pc, a_layout), vc, acc, is_async=True)
        l_oth = _rowsum(p_a, s_layout, srow)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return acc, m, l_own + l_oth


@gluon.jit
def _final(acc, m, l, broken, sink_ptrs, o_dtype: gl.constexpr, D: gl.constexpr,
           PIN: gl.constexpr):
    """(o, lse) of one token: this warpgroup's bf16 [64, D/2] half of o; NaN if `broken`."""
    orow: gl.constexpr = gl.SliceLayout(1, _o_layout(D))
    lse, o_scale = _finish(m, l, sink_ptrs)
    o_scale = gl.where(broken, float("nan"), o_scale)
    o = (acc * gl.convert_layout(o_scale, orow)[:, None]).to(o_dtype)
    if PIN:
        # through an opaque move: o (64 registers) is materialised here, so acc (128) is
        # dead before the next token's score products are issued (else LLVM sinks the
        # conversion past them and ptxas spills)
        o = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [o], dtype=o.dtype,
                                      is_pure=False, pack=2)
    return o, gl.where(broken, float("nan"), lse)


@gluon.jit
def _store(o, lse, row, o_ptr, lse_ptr, W: gl.constexpr, D: gl.constexpr, WG: gl.constexpr,
           ABLATE: gl.constexpr = 0):
    """This warpgroup's half of o (and, warpgroup 0, lse) of one token (ABLATE 1, benchmark
    only: none)."""
    if ABLATE == 1:
        return
    o_layout: gl.constexpr = _o_layout(D)
    DH: gl.constexpr = D // 2
    if WG == 0:
        hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, _s_layout(W)))
        gl.store(lse_ptr + row * HBC + hrows, lse)
    orows = gl.arange(0, HBC, layout=gl.SliceLayout(1, o_layout))
    ocols = WG * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :], o)


@gluon.jit
def _xconsumer(sink_ptr, bad_ptr, o_ptr, lse_ptr, bufs, bars, b, hb, g, nblk,
               T: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr, W: gl.constexpr,
               G: gl.constexpr, QK_SCALE: gl.constexpr, OVERLAP: gl.constexpr,
               ABLATE: gl.constexpr, WG: gl.constexpr):
    q_ready, q_free, span_ready, span_free, ex_m, ex_p = bars
    s_layout: gl.constexpr = _s_layout(W)
    c_layout: gl.constexpr = _c_layout()
    o_layout: gl.constexpr = _o_layout(D)
    sink_ptrs = sink_ptr + hb * HBC + gl.arange(0, HBC, layout=gl.SliceLayout(1, s_layout))
    if OVERLAP:
        # one loop over the program's tokens; token it + 1's score products are issued before
        # token it's epilogue (its o stores overlap them on the tensor cores)
        ntok = (nblk - 1) * BT + gl.minimum(T - (g + (nblk - 1) * G) * BT, BT)
        mbarrier.wait(span_ready, 0)
        s = _issue(bufs, q_ready, 0, W, D, WG)
        for it in range(ntok - 1):     # (no branch between an issue and its wait: ptxas
            t0 = (g + (it // BT) * G) * BT    # would serialize every wgmma, C7512)
            t = t0 + it % BT
            broken = gl.load(bad_ptr + b * T + t) != 0
            acc, m, l = _token(s, t0, t, it, bufs, bars, W, D, QK_SCALE, WG)
            o, lse = _final(acc, m, l, broken, sink_ptrs, o_ptr.dtype.element_ty, D, True)
            nxt = it + 1
            if nxt % BT == 0:                      # the next block: its span first
                _release(span_free)
                mbarrier.wait(span_ready, (nxt // BT) & 1)
            s = _issue(bufs, q_ready, nxt, W, D, WG)
            _store(o, lse, (b * T + t) * NHB + hb, o_ptr, lse_ptr, W, D, WG)
        it = ntok - 1                              # the last token: nothing to issue after it
        t0 = (g + (it // BT) * G) * BT
        t = t0 + it % BT
        broken = gl.load(bad_ptr + b * T + t) != 0
        acc, m, l = _token(s, t0, t, it, bufs, bars, W, D, QK_SCALE, WG)
        o, lse = _final(acc, m, l, broken, sink_ptrs, o_ptr.dtype.element_ty, D, False)
        _store(o, lse, (b * T + t) * NHB + hb, o_ptr, lse_ptr, W, D, WG)
    else:
        for k in range(nblk):
            t0 = (g + k * G) * BT
            mbarrier.wait(span_ready, k & 1)
            for i in range(gl.minimum(T - t0, BT)):
                t = t0 + i
                it = k * BT + i
                if ABLATE == 2:        # benchmark only: no compute, the copies' pace
                    mbarrier.wait(q_ready, it & 1)
                    _release(q_free)
                else:
                    # the promise check's verdict for this token (wrapper: NaN if broken)
                    broken = gl.load(bad_ptr + b * T + t) != 0
                    s = _issue(bufs, q_ready, it, W, D, WG)
                    acc, m, l = _token(s, t0, t, it, bufs, bars, W, D, QK_SCALE, WG)
                    o, lse = _final(acc, m, l, broken, sink_ptrs, o_ptr.dtype.element_ty, D,
                                    False)
                    _store(o, lse, (b * T + t) * NHB + hb, o_ptr, lse_ptr, W, D, WG, ABLATE)
            _release(span_free)                    # past the block's reads of the span


@gluon.jit
def csa_window_xchg_kernel(q_ptr, kv_ptr, sink_ptr, bad_ptr, o_ptr, lse_ptr,
                           T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr,
                           D: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
                           QK_SCALE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           OVERLAP: gl.constexpr, ABLATE: gl.constexpr,
                           Q_AHEAD: gl.constexpr):
    hb, g, b, nblk = _program_blocks(T, NHB, G)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = W // 2
    # [1, ...]: the consumers index them with an opaque 0 (_xconsumer)
    q_smem = gl.allocate_shared_memory(
        dtype, [1, HBC, D], gl.NVMMASharedLayout.get_default_for([HBC, D], dtype))
    win_a, win_b = _span_buffers(dtype, W, D, True)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HBC, HALF], dtype)
    p_a = gl.allocate_shared_memory(dtype, [HBC, HALF], p_layout)
    p_b = gl.allocate_shared_memory(dtype, [HBC, HALF], p_layout)
    p_c = gl.allocate_shared_memory(
        dtype, [HBC, BT], gl.NVMMASharedLayout.get_default_for([HBC, BT], dtype))
    mx = gl.allocate_shared_memory(gl.float32, [2 * HBC], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready, q_free, span_ready, span_free = _span_barriers(2)   # 2 consumer warpgroups
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    ex_m = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    ex_p = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    for w in gl.static_range(2):
        mbarrier.init(ex_m.index(w), count=1)
        mbarrier.init(ex_p.index(w), count=1)
    bufs = (q_smem, win_a, win_b, p_a, p_b, p_c, mx)
    bars = (q_ready, q_free, span_ready, span_free, ex_m, ex_p)
    # window._producer with RATIO = 0 (its pool arguments are not used: placeholders)
    gl.warp_specialize([
        (_producer, (q_ptr, kv_ptr, q_smem.index(0), win_a.index(0), win_b.index(0), p_c,
                     q_ready, q_free, span_ready, span_free, ex_m, ex_p, b, hb, g, nblk, T, N,
                     NHB, D, W, G, 0, BT, 1, ABLATE == 3, Q_AHEAD)),
        (_xconsumer, (sink_ptr, bad_ptr, o_ptr, lse_ptr, bufs, bars, b, hb, g, nblk, T, NHB, D,
                      W, G, QK_SCALE, OVERLAP, ABLATE, 0)),
        (_xconsumer, (sink_ptr, bad_ptr, o_ptr, lse_ptr, bufs, bars, b, hb, g, nblk, T, NHB, D,
                      W, G, QK_SCALE, OVERLAP, ABLATE, 1)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


def shared_bytes(D, window, itemsize=2):
    """Shared memory of the exchange kernel: q, the span, the P tiles, the max slots, the
    barriers, and 320 B for the compiler's own (it takes 288 B more than the buffers at W = 128;
    checked against the compiler by tests/test_gluon_window)."""
    from csa_jax.kernels.gluon.dims import HB, padded_dims
    Dp = padded_dims(HB, D, 1, 1)[1]
    rows = HB + window + int(BT)
    return (rows * Dp * itemsize + HB * (window + int(BT)) * itemsize + 2 * HB * 4 + 8 * 8
            + 320)


def constexprs(*, T, N, NHB, D, window, G, scale, consumer_regs=216, overlap=False, ablate=0,
               q_ahead=0):
    """ablate (benchmark only, wrong results; Config.win_ablate): 1 no o / lse stores, 2 the
    consumers only wait for and release q and the span (the copies' pace), 3 q copied for the
    program's first token only (the kernel without q's loads); overlap=False only. q_ahead
    (Config.win_prefetch): the producer prefetches the q of the token that many ahead into L2
    (window._producer)."""
    from csa_jax.kernels.gluon.fwd import LOG2E
    if ablate and overlap:
        raise ValueError("win_ablate applies to win_schedule='exchange' (not 'overlap')")
    return dict(T=T, N=N, NHB=NHB, D=D, W=window, G=G, QK_SCALE=float(scale) * LOG2E,
                CONSUMER_REGS=int(consumer_regs), OVERLAP=bool(overlap), ABLATE=int(ablate),
                Q_AHEAD=int(q_ahead))
