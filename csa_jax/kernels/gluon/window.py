"""Window reuse for the structured layouts cr0 / cr128 (Config.layout): the Gluon forward kernel.

Under the layout promise (csa_spec.md section 4, checked by check_layout / csa_jax/layouts.py)
token t attends to the window rows max(0, t - W + 1) .. t and, for cr128, to the pool rows
T + p, p < (t + 1) // R. Consecutive tokens share W - 1 of their W window rows, so instead of
gathering W rows per token (fwd.py) a program owns blocks of BT = 16 consecutive tokens of one
64-head block and copies each block's window union once, contiguously:

- span: the W + BT rows t0 - W .. t0 + BT - 1 of block t0 (a multiple of BT) sit in shared memory
  as one [W + BT, D] buffer (144 KiB at W = 128, D = 512), loaded by 16-byte cp.async row copies
  (rows < 0 or >= N zero-filled). Every token of the block reads its rows at its own offset:
  S = q [kv rows t0-W .. t0-1 | t0 .. t0+15]^T as two wgmma products (N = W and N = BT on static
  subviews of the buffer), the scores outside t - W + 1 .. t masked. The 16 extra columns per
  token (144 instead of 128 rows in both products) are the price of static, 16-aligned subviews.
- q [64, D] (64 KiB) is the only per-token load; it is released as soon as the token's QK^T
  products are done, so the next token's q streams in during this token's softmax, PV and
  epilogue. o goes out from the accumulator registers.
- cr128: each token's visible pool rows stream through a PSTAGES-deep ring of PT-row tiles
  (contiguous rows T + p, no index loads), one online-softmax step per tile, before the window.
- programs: grid = B x G x NHB (head block fastest, so the two programs of a Pro token block run
  side by side and share the span in L2); program g walks blocks g, g + G, g + 2G, ...
  (strided, so cr128's growing pool is spread evenly), reloading the span once per block.

The producer partition (4 warps) does every copy; the 8 consumer warps (2 warpgroups, the D = 512
accumulator split by columns) compute, as in fwd.py, whose softmax step and epilogue are reused.
idx is not read: the wrapper (forward) poisons tokens whose traced idx breaks the promise.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.dims import HB, SMEM_LIMIT, padded_dims
from csa_jax.kernels.gluon.fwd import (CONSUMER_WARPS, LOG2E, NEG, PRODUCER_WARPS, _finish,
                                       _release, _softmax_step)

BLOCK_T = 16                   # tokens per window block = extra span rows (a wgmma K step)
BT = gl.constexpr(BLOCK_T)
HBC = gl.constexpr(HB)         # heads per program (wgmma M)


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
def _prefetch_l2(ptr0, NELEM: gl.constexpr):
    """prefetch.global.L2 of the NELEM contiguous elements from ptr0 on: one 128-byte line per
    producer thread and step (a hint: no data, nothing to wait for)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0])
    LINE: gl.constexpr = 1024 // ptr0.dtype.element_ty.primitive_bitwidth   # elements a line
    lines = gl.arange(0, NELEM // LINE, layout=layout)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                              [ptr0 + lines.to(gl.int64) * LINE], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _producer(q_ptr, kv_ptr, q_smem, win_a, win_b, pool, q_ready, q_free, span_ready, span_free,
              pool_full, pool_free, b, hb, g, nblk, T: gl.constexpr, N: gl.constexpr,
              NHB: gl.constexpr, D: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
              RATIO: gl.constexpr, PT: gl.constexpr, PSTAGES: gl.constexpr,
              Q_ONCE: gl.constexpr = False, Q_AHEAD: gl.constexpr = 0):
    """Q_ONCE (benchmark only, wrong results): q is copied for the program's first token only,
    every later token's q_ready arrives without a copy (the kernel without q's loads).
    Q_AHEAD > 0: when token it's q is copied, the q of token it + Q_AHEAD is prefetched into L2
    (`prefetch.global.L2`, one per 128-byte line), so that its copy, which can only start once
    the single q buffer is free, reads L2 instead of HBM."""
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    pc = 0                                            # pool tiles issued so far
    for k in range(nblk):
        t0 = (g + k * G) * BT
        for i in range(gl.minimum(T - t0, BT)):
            it = k * BT + i
            qrow = ((b * T + t0 + i) * NHB + hb) * HBC
            if it > 0:
                mbarrier.wait(q_free, (it - 1) & 1)
            if not Q_ONCE or it == 0:
                _copy_rows(q_smem, q_ptr, qrow, HBC, qrow + HBC, D, D)
            async_copy.mbarrier_arrive(q_ready, increment_count=False)
            if Q_AHEAD > 0:
                ahead = it + Q_AHEAD
                t_ahead = (g + (ahead // BT) * G) * BT + ahead % BT
                ok = (ahead // BT < nblk) & (t_ahead < T)
                row_ahead = gl.where(ok, ((b * T + t_ahead) * NHB + hb) * HBC, qrow)
                _prefetch_l2(q_ptr + row_ahead.to(gl.int64) * D, HBC * D)
            if i == 0:        # after the block's first q: that q waits only for a QK^T
                if k > 0:
                    mbarrier.wait(span_free, (k - 1) & 1)
                _copy_rows(win_a, kv_base, t0 - W, W, N, D, D)
                _copy_rows(win_b, kv_base, t0, BT, N, D, D)
                async_copy.mbarrier_arrive(span_ready, increment_count=False)
            if RATIO > 0:
                vis = (t0 + i + 1) // RATIO
                # at least one tile per token (all zero when none is visible): the window's P
                # goes through the token's last pool slot (P_SMEM == 2), released after it
                for j in range(gl.maximum(gl.cdiv(vis, PT), 1)):
                    s = pc % PSTAGES
                    if pc >= PSTAGES:
                        mbarrier.wait(pool_free.index(s), ((pc // PSTAGES) - 1) & 1)
                    # rows T + j*PT .. of the pool; rows past the visible ones zero-filled
                    _copy_rows(pool.index(s), kv_base, T + j * PT, PT, T + vis, D, D)
                    async_copy.mbarrier_arrive(pool_full.index(s), increment_count=False)
                    pc += 1


@gluon.jit
def _scores(q_smem, tile, NC: gl.constexpr):
    """S [64, NC] = q tile^T on wgmma (both operands in shared memory), columns split over the
    two consumer warpgroups; issued async, waited by the caller."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, NC // 2, 16])
    return warpgroup_mma(q_smem, tile.permute((1, 0)), gl.zeros([HBC, NC], gl.float32, layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _step(sc, row0, lo, hi, m, l, NC: gl.constexpr, QK_SCALE: gl.constexpr):
    """fwd._softmax_step on a tile of NC consecutive kv rows row0 ..: the rows outside
    lo .. hi masked; m, l (and the returned alpha, m, l) in the row layout of `m`."""
    s_layout: gl.constexpr = sc.type.layout
    rows = row0 + gl.arange(0, NC, layout=gl.SliceLayout(0, s_layout))
    ids = gl.where((rows >= lo) & (rows <= hi), rows, -1)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    p, alpha, m2, l2 = _softmax_step(sc, ids, gl.convert_layout(m, srow),
                                     gl.convert_layout(l, srow), QK_SCALE)
    keep: gl.constexpr = m.type.layout
    return (p, gl.convert_layout(alpha, keep), gl.convert_layout(m2, keep),
            gl.convert_layout(l2, keep))


@gluon.jit
def _masked(sc, row0, lo, hi, NC: gl.constexpr, QK_SCALE: gl.constexpr):
    """Scores of NC consecutive kv rows row0 .. in the exp2 domain, -inf outside lo .. hi."""
    rows = row0 + gl.arange(0, NC, layout=gl.SliceLayout(0, sc.type.layout))
    return gl.where(((rows >= lo) & (rows <= hi))[None, :], sc * QK_SCALE, float("-inf"))


@gluon.jit
def _rescale(acc, alpha):
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _pv(p, tile, acc):
    """acc + p tile on wgmma (p from registers in the A-operand layout)."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                 k_width=2)
    return warpgroup_mma(gl.convert_layout(p.to(tile.dtype), a_layout), tile, acc)


@gluon.jit
def _pv_smem(p, pview, tile, acc):
    """acc + p tile on wgmma with p through shared memory (both warpgroups write their columns
    of p, then each reads all of it as the A operand): no register exchange of p, so no compiler
    scratch for it. Callers have synchronised the partition since pview's previous readers."""
    pview.store(p.to(pview.dtype))
    fence_async_shared()
    gl.thread_barrier()
    return warpgroup_mma(pview, tile, acc)


@gluon.jit
def _consumer(sink_ptr, bad_ptr, o_ptr, lse_ptr, q_smem, win_a, win_b, pool, q_ready, q_free,
              span_ready, span_free, pool_full, pool_free, b, hb, g, nblk, T: gl.constexpr,
              NHB: gl.constexpr, D: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
              RATIO: gl.constexpr, PT: gl.constexpr, PSTAGES: gl.constexpr,
              QK_SCALE: gl.constexpr, P_SMEM: gl.constexpr, ABLATE: gl.constexpr):
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    # rows per window product: all W when P goes through shared memory, else 64-row tiles (the
    # register P operand of one product then stays at 16 registers a thread)
    WT: gl.constexpr = W if P_SMEM != 0 else (64 if W > 64 else W)
    srow: gl.constexpr = gl.SliceLayout(1, gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, WT // 2, 16]))
    hrows = gl.arange(0, HBC, layout=srow)
    orows = gl.arange(0, HBC, layout=orow)
    ocols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    sink_ptrs = sink_ptr + hb * HBC + hrows
    pc = 0
    for k in range(nblk):
        t0 = (g + k * G) * BT
        mbarrier.wait(span_ready, k & 1)
        ntok = gl.minimum(T - t0, BT)
        for i in range(ntok):
            t = t0 + i
            it = k * BT + i
            m = gl.full([HBC], NEG, gl.float32, srow)
            l = gl.zeros([HBC], gl.float32, srow)
            acc = gl.zeros([HBC, D], gl.float32, o_layout)
            mbarrier.wait(q_ready, it & 1)
            fence_async_shared()
            q0 = q_smem
            # the promise check's verdict for this token (wrapper: NaN outputs if broken)
            broken = gl.load(bad_ptr + b * T + t) != 0
            if ABLATE == 2:       # benchmark only: no compute, the copies' pace
                _release(q_free)
                if RATIO > 0:
                    for j in range(gl.maximum(gl.cdiv((t + 1) // RATIO, PT), 1)):
                        mbarrier.wait(pool_full.index(pc % PSTAGES), (pc // PSTAGES) & 1)
                        _release(pool_free.index(pc % PSTAGES))
                        pc += 1
            else:
                if RATIO > 0:
                    vis = (t + 1) // RATIO
                    npt = gl.maximum(gl.cdiv(vis, PT), 1)
                    for j in range(npt):
                        s = pc % PSTAGES
                        mbarrier.wait(pool_full.index(s), (pc // PSTAGES) & 1)
                        fence_async_shared()
                        tile = pool.index(s)
                        sp = _scores(q0, tile, PT)
                        sp = warpgroup_mma_wait(0, deps=[sp])
                        p, alpha, m, l = _step(sp, T + j * PT, T, T + vis - 1, m, l, PT,
                                               QK_SCALE)
                        acc = _pv(p, tile, _rescale(acc, alpha))
                        if j < npt - 1 or P_SMEM != 2:
                            _release(pool_free.index(s))
                        pc += 1
                # the span's first W rows (one product, or two of 64 rows), then its last BT rows
                sa = _scores(q0, win_a.slice(0, WT), WT)
                if W > WT:
                    sa2 = _scores(q0, win_a.slice(WT, WT), WT)
                sb = _scores(q0, win_b, BT)
                if W > WT:
                    sa, sa2, sb = warpgroup_mma_wait(0, deps=[sa, sa2, sb])
                else:
                    sa, sb = warpgroup_mma_wait(0, deps=[sa, sb])
                _release(q_free)                          # the next token's q may load now
                # one online step over the whole span (joint running max)
                lo = gl.maximum(t - W + 1, 0)                  # rows < 0 are zero-filled
                sa = _masked(sa, t0 - W, lo, t, WT, QK_SCALE)
                mx = gl.max(sa, axis=1)
                if W > WT:
                    sa2 = _masked(sa2, t0 - W + WT, lo, t, WT, QK_SCALE)
                    mx = gl.maximum(mx, gl.max(sa2, axis=1))
                sb = _masked(sb, t0, lo, t, BT, QK_SCALE)
                m_new = gl.maximum(m, gl.maximum(mx, gl.convert_layout(gl.max(sb, axis=1), srow)))
                alpha = gl.exp2(m - m_new)
                acc = _rescale(acc, alpha)
                pa = gl.exp2(sa - m_new[:, None])
                l = l * alpha + gl.sum(pa, axis=1)
                if P_SMEM == 1:
                    pview = pool
                elif P_SMEM == 2:      # the token's last pool slot (its tile's products are done)
                    pview = pool.index((pc - 1) % PSTAGES)._reinterpret(
                        win_a.dtype, [W // WT, HBC, WT],
                        gl.NVMMASharedLayout.get_default_for([HBC, WT], win_a.dtype))
                if P_SMEM == 0:
                    acc = _pv(pa, win_a.slice(0, WT), acc)
                else:
                    acc = _pv_smem(pa, pview.index(0), win_a.slice(0, WT), acc)
                if W > WT:
                    pa = gl.exp2(sa2 - m_new[:, None])
                    l = l + gl.sum(pa, axis=1)
                    if P_SMEM == 0:
                        acc = _pv(pa, win_a.slice(WT, WT), acc)
                    else:
                        acc = _pv_smem(pa, pview.index(1), win_a.slice(WT, WT), acc)
                m_b = gl.convert_layout(m_new, gl.SliceLayout(1, sb.type.layout))
                pb = gl.exp2(sb - m_b[:, None])
                l = l + gl.convert_layout(gl.sum(pb, axis=1), srow)
                m = m_new
                acc = _pv(pb, win_b, acc)
                if P_SMEM == 2:
                    _release(pool_free.index((pc - 1) % PSTAGES))
                row = (b * T + t) * NHB + hb
                lse, o_scale = _finish(m, l, sink_ptrs)
                lse = gl.where(broken, float("nan"), lse)
                o_scale = gl.where(broken, float("nan"), o_scale)
                o = (acc * gl.convert_layout(o_scale, orow)[:, None]).to(o_ptr.dtype.element_ty)
                if ABLATE != 1 or t < 0:  # ABLATE 1, benchmark only: everything but the stores
                    gl.store(lse_ptr + row * HBC + hrows, lse)
                    gl.store(o_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :],
                             o)
        _release(span_free)


@gluon.jit
def _program_blocks(T: gl.constexpr, NHB: gl.constexpr, G: gl.constexpr):
    """(head block, g, sequence, number of blocks) of this program: program = (b, g, head
    block), head block fastest; it owns the 16-token blocks g, g + G, ... below T / 16."""
    pid = gl.program_id(0)
    NBLK: gl.constexpr = (T + BT - 1) // BT
    g = (pid // NHB) % G
    return pid % NHB, g, pid // (NHB * G), gl.cdiv(NBLK - g, G)


@gluon.jit
def _span_buffers(dtype: gl.constexpr, W: gl.constexpr, D: gl.constexpr,
                  INDEXED: gl.constexpr):
    """A 16-token block's span in shared memory (this kernel's, window_xchg.py's and
    bwd_win.py's): its first W rows win_a [W, D] and its last BT rows win_b [BT, D] (two
    buffers: shapes are powers of two); [1, W, D] / [1, BT, D] with INDEXED (window_xchg.py's,
    read through .index)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([W, D], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, D], dtype)
    if INDEXED:
        win_a = gl.allocate_shared_memory(dtype, [1, W, D], a_layout)
        win_b = gl.allocate_shared_memory(dtype, [1, BT, D], b_layout)
    else:
        win_a = gl.allocate_shared_memory(dtype, [W, D], a_layout)
        win_b = gl.allocate_shared_memory(dtype, [BT, D], b_layout)
    return win_a, win_b


@gluon.jit
def _span_barriers(FREE: gl.constexpr):
    """q_ready, q_free, span_ready, span_free (allocated in this order), initialized: the
    producer's warps arrive on q_ready / span_ready when a token's q / the block's span has
    landed, FREE consumer arrivals (one per consumer partition) free them. This kernel's,
    window_xchg.py's (FREE 2) and bwd_win.py's."""
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    q_free = gl.allocate_shared_memory(gl.int64, [1], bar)
    span_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    span_free = gl.allocate_shared_memory(gl.int64, [1], bar)
    mbarrier.init(q_ready, count=PRODUCER_WARPS * 32)
    mbarrier.init(q_free, count=FREE)
    mbarrier.init(span_ready, count=PRODUCER_WARPS * 32)
    mbarrier.init(span_free, count=FREE)
    return q_ready, q_free, span_ready, span_free


@gluon.jit
def csa_window_kernel(q_ptr, kv_ptr, sink_ptr, bad_ptr, o_ptr, lse_ptr,
                      T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
                      W: gl.constexpr, G: gl.constexpr, RATIO: gl.constexpr, PT: gl.constexpr,
                      PSTAGES: gl.constexpr, QK_SCALE: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, P_SMEM: gl.constexpr,
                      ABLATE: gl.constexpr):
    hb, g, b, nblk = _program_blocks(T, NHB, G)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(
        dtype, [HBC, D], gl.NVMMASharedLayout.get_default_for([HBC, D], dtype))
    win_a, win_b = _span_buffers(dtype, W, D, False)
    WT: gl.constexpr = W if P_SMEM != 0 else (64 if W > 64 else W)
    PS: gl.constexpr = PSTAGES if RATIO > 0 else 1
    if RATIO > 0:                  # the pool ring (P_SMEM 2: the window's P in its last slot)
        pool = gl.allocate_shared_memory(
            dtype, [PSTAGES, PT, D], gl.NVMMASharedLayout.get_default_for([PT, D], dtype))
    elif P_SMEM == 1:              # cr0: `pool` is the window's P buffer
        pool = gl.allocate_shared_memory(
            dtype, [W // WT, HBC, WT], gl.NVMMASharedLayout.get_default_for([HBC, WT], dtype))
    else:                          # cr0, P in registers: a placeholder
        pool = gl.allocate_shared_memory(
            dtype, [1, 8, 8], gl.NVMMASharedLayout.get_default_for([8, 8], dtype))
    q_ready, q_free, span_ready, span_free = _span_barriers(1)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    pool_full = gl.allocate_shared_memory(gl.int64, [PS, 1], bar)
    pool_free = gl.allocate_shared_memory(gl.int64, [PS, 1], bar)
    for s in gl.static_range(PS):
        mbarrier.init(pool_full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(pool_free.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (sink_ptr, bad_ptr, o_ptr, lse_ptr, q_smem, win_a, win_b, pool, q_ready, q_free,
                     span_ready, span_free, pool_full, pool_free, b, hb, g, nblk, T, NHB, D,
                     W, G, RATIO, PT, PSTAGES, QK_SCALE, P_SMEM, ABLATE)),
        (_producer, (q_ptr, kv_ptr, q_smem, win_a, win_b, pool, q_ready, q_free, span_ready,
                     span_free, pool_full, pool_free, b, hb, g, nblk, T, N, NHB, D, W, G,
                     RATIO, PT, PSTAGES)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


SMS = 132                      # streaming multiprocessors of the H200


def p_smem_mode(D, window, ratio, pool_tile, p_smem):
    """Where the window's P goes for its PV products: 0 registers (the compiler exchanges it
    between the warpgroups through 4 KiB of scratch), 1 a [window, 64] shared buffer (cr0 with
    p_smem), 2 the token's last cr128 pool slot when it is large enough (always tried for
    cr128: q + span + one 16-row pool tile + the register path's scratch is ~1 KiB over the H200's
    shared memory at D = 512)."""
    Dp = padded_dims(HB, D, 1, 1)[1]
    if ratio:
        return 2 if pool_tile * Dp >= HB * window else 0
    return 1 if p_smem else 0


def shared_bytes(D, window, ratio, pool_tile, pool_stages, p_mode, itemsize=2):
    """Shared memory of the kernel, estimated: q, the span, the cr128 pool ring or the cr0 P
    buffer, the compiler's scratch for P exchanges (4 KiB for 64-column P tiles, 2 KiB for
    16-column ones) and the barriers (checked against the compiler by tests/test_gluon_window)."""
    Dp = padded_dims(HB, D, 1, 1)[1]
    rows = HB + window + BLOCK_T
    if ratio:
        rows += pool_stages * pool_tile
    elif p_mode == 1:
        rows += window * HB // Dp
    scratch = (HB * min(window, 64) if p_mode == 0 else HB * BLOCK_T) * itemsize
    return rows * Dp * itemsize + scratch + 256


def programs(B, T, nhb, want=0):
    """G, the programs per (sequence, head block) along the tokens: `want`, else enough for one
    program per SM (one fits an SM: shared memory), never more than the T / BT blocks."""
    nblk = -(-T // BLOCK_T)
    g = want if want else -(-SMS // (B * nhb))
    return max(1, min(nblk, g))


def constexprs(*, T, N, NHB, D, window, G, ratio, pool_tile, pool_stages, scale,
               producer_regs, p_smem=False, ablate=0):
    p_mode = p_smem_mode(D, window, ratio, pool_tile, p_smem)
    return dict(T=T, N=N, NHB=NHB, D=D, W=window, G=G, RATIO=ratio, PT=pool_tile,
                PSTAGES=pool_stages, QK_SCALE=float(scale) * LOG2E, PRODUCER_REGS=producer_regs,
                P_SMEM=p_mode, ABLATE=int(ablate))


def arg_types(dt="bf16"):
    return [f"*{dt}", f"*{dt}", "*fp32", "*i32", f"*{dt}", "*fp32"]


def forward(q, kv, sink, bad, *, scale, config):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 of the cr0 / cr128 layout promise (idx is not
    read); bad [B, T] (bool or int): tokens whose idx breaks the promise, whose o and lse the
    kernel writes as NaN (no extra pass over o). CUDA only."""
    import jax
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    B, T, H, D = q.shape
    N = kv.shape[1]
    if config.layout == "cr128" and N < T + T // config.pool_ratio:
        raise ValueError(f"layout='cr128': kv has N={N} rows, fewer than the T + T // "
                         f"pool_ratio = {T + T // config.pool_ratio} the pool needs")
    Hp, Dp, _ = padded_dims(H, D, 1, 1)
    pad = lambda x, axis, size, v=0: x if x.shape[axis] == size else jnp.pad(
        x, [(0, size - x.shape[a]) if a == axis else (0, 0) for a in range(x.ndim)],
        constant_values=v)
    q_p = pad(pad(q, 3, Dp), 2, Hp).reshape(B * T * Hp, Dp)
    kv_p = pad(kv, 2, Dp).reshape(B * N, Dp)
    sink_p = pad(sink.astype(jnp.float32), 0, Hp, -jnp.inf)
    nhb = Hp // HB
    G = programs(B, T, nhb, config.win_programs)
    ratio = config.pool_ratio if config.layout == "cr128" else 0
    sched = config.window_schedule()
    if sched not in ("lockstep", "exchange", "overlap"):
        raise ValueError(f"window.forward: layout={config.layout!r} runs {sched!r}, not a "
                         f"window kernel")
    if sched in ("exchange", "overlap"):
        from csa_jax.kernels.gluon import window_xchg as wx
        need = wx.shared_bytes(Dp, config.window)
        kernel, warps = wx.csa_window_xchg_kernel, wx.NUM_WARPS
        consts = wx.constexprs(T=T, N=N, NHB=nhb, D=Dp, window=config.window, G=G,
                               scale=scale, consumer_regs=config.win_regs,
                               overlap=sched == "overlap", ablate=config.win_ablate,
                               q_ahead=config.win_prefetch)
    else:
        p_mode = p_smem_mode(Dp, config.window, ratio, config.pool_tile, config.win_p_smem)
        need = shared_bytes(Dp, config.window, ratio, config.pool_tile, config.pool_stages,
                            p_mode)
        kernel, warps = csa_window_kernel, CONSUMER_WARPS
        consts = constexprs(T=T, N=N, NHB=nhb, D=Dp, window=config.window, G=G, ratio=ratio,
                            pool_tile=config.pool_tile, pool_stages=config.pool_stages,
                            scale=scale, producer_regs=config.win_producer_regs,
                            p_smem=config.win_p_smem, ablate=config.win_ablate)
    if need > SMEM_LIMIT:
        raise NotImplementedError(
            f"layout={config.layout!r}, window={config.window}, D={D}, pool_tile="
            f"{config.pool_tile}, pool_stages={config.pool_stages}, schedule="
            f"{sched!r}: the window kernel needs ~{need} B of shared memory, "
            f"over the {SMEM_LIMIT} B per block")
    o, lse = gluon_call(
        q_p, kv_p, sink_p, bad.astype(jnp.int32).reshape(B * T), kernel=kernel,
        out_shape=[jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
                   jax.ShapeDtypeStruct((B * T * Hp,), jnp.float32)],
        grid=(B * G * nhb,), num_warps=warps, name="csa_gluon_window", **consts)
    o = o.reshape(B, T, Hp, Dp)[:, :, :H, :D]
    lse = lse.reshape(B, T, Hp)[:, :, :H]
    return o, lse
