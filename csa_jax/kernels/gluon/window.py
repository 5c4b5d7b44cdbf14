"""Window reuse for cr0 layers (`layout="cr0"`, window 128): the window kernel, and its wrapper.

Under the cr0 promise (csa_spec.md section 4: slots [0, window) hold token t's window rows
max(0, t - window + 1) .. t, each once, any order, every later slot -1) idx is not read: a
program owns strided blocks of BT = 16 consecutive tokens of one 64-head block; per block the
span, kv rows t0 - W .. t0 + 15, is copied once into shared memory, and every token of the
block reads its window at its own offset; per token q [64, D] is the only copy. Measured
faster than the gather kernel at the layer's shapes (docs/perf/gluon_window_h200.md: Pro cr0
T = 4096 0.653 vs 0.746 ms, Flash 0.364 vs 0.395 ms, Pro T = 16384 2.994 vs 3.166 ms).

- three partitions of one warpgroup each (384 threads): the producer is the default partition
  (_producer: q per token, the span per block, 16-byte cp.async); consumer warpgroups 0 and 1
  are the two workers (setmaxnreg CONSUMER_REGS).
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
A traced idx is checked by csa_jax/layouts.py; the tokens that break the promise (`bad`) get NaN
o and lse from the kernel itself.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.config import WINDOW_KERNEL
from csa_jax.kernels.gluon.dims import HB, SMEM_LIMIT, padded_dims
from csa_jax.kernels.gluon.fwd import _opaque
from csa_jax.kernels.gluon.ring import LOG2E, NEG, PRODUCER_WARPS, _finish, _pad, _release

BLOCK_T = 16                   # tokens per window block = extra span rows (a wgmma K step)
BT = gl.constexpr(BLOCK_T)
HBC = gl.constexpr(HB)         # heads per program (wgmma M)
WG_WARPS = gl.constexpr(4)
NUM_WARPS = 4                  # the default partition (the producer); 12 warps in all
CONSUMER_REGS = 216            # registers per consumer thread (setmaxnreg)
SMS = 132                      # streaming multiprocessors of the H200


@gluon.jit
def _copy_rows(dst, base, row0, NROWS: gl.constexpr, N, D: gl.constexpr, COLS: gl.constexpr):
    """cp.async the first COLS columns of rows row0 .. row0 + NROWS - 1 of a [N, D] matrix
    into dst (rows outside [0, N) zero-filled, never read); 8 producer threads per 128-byte
    row segment, 16 rows at a time (few live addresses: the producer runs on few registers)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    RCH: gl.constexpr = 16 if NROWS > 16 else NROWS
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(NROWS // RCH):
        rows = row0 + c * RCH + gl.arange(0, RCH, layout=gl.SliceLayout(1, layout))
        ok = (rows >= 0) & (rows < N)
        ptrs = base + gl.where(ok, rows, 0).to(gl.int64)[:, None] * D + cols[None, :]
        async_copy.async_copy_global_to_shared(dst.slice(c * RCH, RCH), ptrs, mask=ok[:, None])


@gluon.jit
def _producer(q_ptr, kv_ptr, q_smem, win_a, win_b, q_ready, q_free, span_ready, span_free,
              b, hb, g, nblk, T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr,
              D: gl.constexpr, W: gl.constexpr, G: gl.constexpr):
    """Per token its q (once the consumers freed the single q buffer); per block, after the
    block's first q (which waits only for a QK^T), its span."""
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    for k in range(nblk):
        t0 = (g + k * G) * BT
        for i in range(gl.minimum(T - t0, BT)):
            it = k * BT + i
            qrow = ((b * T + t0 + i) * NHB + hb) * HBC
            if it > 0:
                mbarrier.wait(q_free, (it - 1) & 1)
            _copy_rows(q_smem, q_ptr, qrow, HBC, qrow + HBC, D, D)
            async_copy.mbarrier_arrive(q_ready, increment_count=False)
            if i == 0:
                if k > 0:
                    mbarrier.wait(span_free, (k - 1) & 1)
                _copy_rows(win_a, kv_base, t0 - W, W, N, D, D)
                _copy_rows(win_b, kv_base, t0, BT, N, D, D)
                async_copy.mbarrier_arrive(span_ready, increment_count=False)


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
    are rebuilt per token instead of hoisted out of the loops (and spilled: fwd.py)."""
    q_smem, win_a, win_b = bufs[0], bufs[1], bufs[2]
    s_layout: gl.constexpr = _s_layout(W)
    c_layout: gl.constexpr = _c_layout()
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
def _final(acc, m, l, broken, sink_ptrs, o_dtype: gl.constexpr, D: gl.constexpr):
    """(o, lse) of one token: this warpgroup's bf16 [64, D/2] half of o; NaN if `broken`."""
    orow: gl.constexpr = gl.SliceLayout(1, _o_layout(D))
    lse, o_scale = _finish(m, l, sink_ptrs)
    o_scale = gl.where(broken, float("nan"), o_scale)
    o = (acc * gl.convert_layout(o_scale, orow)[:, None]).to(o_dtype)
    return o, gl.where(broken, float("nan"), lse)


@gluon.jit
def _store(o, lse, row, o_ptr, lse_ptr, W: gl.constexpr, D: gl.constexpr, WG: gl.constexpr):
    """This warpgroup's half of o (and, warpgroup 0, lse) of one token."""
    o_layout: gl.constexpr = _o_layout(D)
    DH: gl.constexpr = D // 2
    if WG == 0:
        hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, _s_layout(W)))
        gl.store(lse_ptr + row * HBC + hrows, lse)
    orows = gl.arange(0, HBC, layout=gl.SliceLayout(1, o_layout))
    ocols = WG * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :], o)


@gluon.jit
def _consumer(sink_ptr, bad_ptr, o_ptr, lse_ptr, bufs, bars, b, hb, g, nblk,
              T: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr, W: gl.constexpr,
              G: gl.constexpr, QK_SCALE: gl.constexpr, WG: gl.constexpr):
    q_ready, q_free, span_ready, span_free, ex_m, ex_p = bars
    s_layout: gl.constexpr = _s_layout(W)
    sink_ptrs = sink_ptr + hb * HBC + gl.arange(0, HBC, layout=gl.SliceLayout(1, s_layout))
    for k in range(nblk):
        t0 = (g + k * G) * BT
        mbarrier.wait(span_ready, k & 1)
        for i in range(gl.minimum(T - t0, BT)):
            t = t0 + i
            it = k * BT + i
            # the promise check's verdict for this token (wrapper: NaN if broken)
            broken = gl.load(bad_ptr + b * T + t) != 0
            s = _issue(bufs, q_ready, it, W, D, WG)
            acc, m, l = _token(s, t0, t, it, bufs, bars, W, D, QK_SCALE, WG)
            o, lse = _final(acc, m, l, broken, sink_ptrs, o_ptr.dtype.element_ty, D)
            _store(o, lse, (b * T + t) * NHB + hb, o_ptr, lse_ptr, W, D, WG)
        _release(span_free)                    # past the block's reads of the span


@gluon.jit
def csa_window_kernel(q_ptr, kv_ptr, sink_ptr, bad_ptr, o_ptr, lse_ptr,
                      T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr,
                      D: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
                      QK_SCALE: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    pid = gl.program_id(0)
    # program = (b, g, head block), head block fastest; it owns the 16-token blocks g, g + G,
    # ... below T / 16
    NBLK: gl.constexpr = (T + BT - 1) // BT
    g = (pid // NHB) % G
    hb, b, nblk = pid % NHB, pid // (NHB * G), gl.cdiv(NBLK - g, G)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = W // 2
    # [1, ...]: the consumers index them with an opaque 0 (_issue, _token)
    q_smem = gl.allocate_shared_memory(
        dtype, [1, HBC, D], gl.NVMMASharedLayout.get_default_for([HBC, D], dtype))
    # the block's span: its first W rows win_a [W, D] and its last BT rows win_b [BT, D] (two
    # buffers: shapes are powers of two)
    win_a = gl.allocate_shared_memory(dtype, [1, W, D],
                                      gl.NVMMASharedLayout.get_default_for([W, D], dtype))
    win_b = gl.allocate_shared_memory(dtype, [1, BT, D],
                                      gl.NVMMASharedLayout.get_default_for([BT, D], dtype))
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HBC, HALF], dtype)
    p_a = gl.allocate_shared_memory(dtype, [HBC, HALF], p_layout)
    p_b = gl.allocate_shared_memory(dtype, [HBC, HALF], p_layout)
    p_c = gl.allocate_shared_memory(
        dtype, [HBC, BT], gl.NVMMASharedLayout.get_default_for([HBC, BT], dtype))
    mx = gl.allocate_shared_memory(gl.float32, [2 * HBC], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # the producer's warps arrive on q_ready / span_ready when a token's q / the block's span
    # landed; one arrival of each consumer warpgroup frees them
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    q_free = gl.allocate_shared_memory(gl.int64, [1], bar)
    span_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    span_free = gl.allocate_shared_memory(gl.int64, [1], bar)
    mbarrier.init(q_ready, count=PRODUCER_WARPS * 32)
    mbarrier.init(q_free, count=2)
    mbarrier.init(span_ready, count=PRODUCER_WARPS * 32)
    mbarrier.init(span_free, count=2)
    ex_m = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    ex_p = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    for w in gl.static_range(2):
        mbarrier.init(ex_m.index(w), count=1)
        mbarrier.init(ex_p.index(w), count=1)
    bufs = (q_smem, win_a, win_b, p_a, p_b, p_c, mx)
    bars = (q_ready, q_free, span_ready, span_free, ex_m, ex_p)
    gl.warp_specialize([
        (_producer, (q_ptr, kv_ptr, q_smem.index(0), win_a.index(0), win_b.index(0),
                     q_ready, q_free, span_ready, span_free, b, hb, g, nblk, T, N, NHB, D, W,
                     G)),
        (_consumer, (sink_ptr, bad_ptr, o_ptr, lse_ptr, bufs, bars, b, hb, g, nblk, T, NHB, D,
                     W, G, QK_SCALE, 0)),
        (_consumer, (sink_ptr, bad_ptr, o_ptr, lse_ptr, bufs, bars, b, hb, g, nblk, T, NHB, D,
                     W, G, QK_SCALE, 1)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side

def shared_bytes(D, window, itemsize=2):
    """Shared memory of the kernel: q, the span, the P tiles, the max slots, the barriers,
    and 320 B for the compiler's own (it takes 288 B more than the buffers at W = 128;
    checked against the compiler by tests/test_gluon_window)."""
    Dp = padded_dims(HB, D, 1, 1)[1]
    rows = HB + window + int(BT)
    return (rows * Dp * itemsize + HB * (window + int(BT)) * itemsize + 2 * HB * 4 + 8 * 8
            + 320)


def programs(B, T, nhb):
    """G, the programs per (sequence, head block) along the tokens: enough for one program per
    SM (one fits an SM: shared memory), never more than the T / BT blocks."""
    nblk = -(-T // BLOCK_T)
    return max(1, min(nblk, -(-SMS // (B * nhb))))


def constexprs(*, T, N, NHB, D, window, G, scale):
    """The kernel's compile-time parameters (also used by the CPU compile checks)."""
    return dict(T=T, N=N, NHB=NHB, D=D, W=window, G=G, QK_SCALE=float(scale) * LOG2E,
                CONSUMER_REGS=CONSUMER_REGS)


def arg_types(dt="bf16"):
    """q, kv, sink, bad | o, lse."""
    return [f"*{dt}", f"*{dt}", "*fp32", "*i32", f"*{dt}", "*fp32"]


def forward(q, kv, sink, bad, *, scale, window):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 under the cr0 promise (idx is not read);
    bad [B, T] (bool or int): tokens whose idx breaks the promise, whose o and lse the kernel
    writes as NaN (no extra pass over o). CUDA only."""
    import jax
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    B, T, H, D = q.shape
    N = kv.shape[1]
    Hp, Dp, _ = padded_dims(H, D, 1, 1)
    need = shared_bytes(Dp, window)
    if window != WINDOW_KERNEL or need > SMEM_LIMIT:
        raise NotImplementedError(f"the cr0 window kernel runs window {WINDOW_KERNEL} within "
                                  f"{SMEM_LIMIT} B of shared memory; got {window=}, {D=} "
                                  f"({need} B)")
    q_p = _pad(_pad(q, 3, Dp), 2, Hp).reshape(B * T * Hp, Dp)
    kv_p = _pad(kv, 2, Dp).reshape(B * N, Dp)
    sink_p = _pad(sink.astype(jnp.float32), 0, Hp, -jnp.inf)
    nhb = Hp // HB
    G = programs(B, T, nhb)
    consts = constexprs(T=T, N=N, NHB=nhb, D=Dp, window=window, G=G, scale=scale)
    o, lse = gluon_call(
        q_p, kv_p, sink_p, bad.astype(jnp.int32).reshape(B * T), kernel=csa_window_kernel,
        out_shape=[jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
                   jax.ShapeDtypeStruct((B * T * Hp,), jnp.float32)],
        grid=(B * G * nhb,), num_warps=NUM_WARPS, name="csa_gluon_window", **consts)
    return o.reshape(B, T, Hp, Dp)[:, :, :H, :D], lse.reshape(B, T, Hp)[:, :, :H]
