"""The CSA forward in Gluon (NVIDIA Hopper): alternating consumer warpgroups, and its wrapper.

FlashMLA's SM90 schedule (../shared/gpu_kernels.md), written for Gluon: three partitions of
4 warps each (384 threads), one program per SM (persistent) walking head blocks ("rows": 64
heads of one token, ring.py) in turn:

- producer = the default partition (_producer, ring._produce_row): per row, the row's first
  PRE_TILES (1) tiles gathered with cp.async into the ring ("full" barriers), then q once both
  consumers are done with the previous row's q (q_free, after that row's last PV), then the
  other tiles; it refills a stage once its "consumed" barrier has had one arrival from EACH
  consumer. Stages and barrier phases count the program's whole tile stream, so the next row's
  first tiles and q are in flight while the consumers finish this row. It keeps what the
  consumers leave of the register file (`producer_regs(CONSUMER_REGS)`: 72 at 216).
- consumer warpgroup W = 0, 1: two worker partitions of CONSUMER_REGS = 216 registers per
  thread (setmaxnreg, FlashMLA's split). Warpgroup W owns the tiles g of the program's tile
  stream with g % 2 == W (a row may start on either warpgroup) and
  output columns [W*D/2, (W+1)*D/2). For its own tile it computes the whole S = q kv^T (m64n64,
  q and the tile from shared memory) and the online softmax from the running (max, sum) left by
  the other warpgroup's previous tile, publishes (max, sum, rescale factor) and the bf16 P tile
  in shared memory (its `ex` barrier), then runs PV for its column half with P from registers.
  For the other's tiles it waits on the other's `ex`, rescales its accumulator and runs PV for
  its half with P from shared memory, then hands the P buffer back (`exfree`).
  Order per own tile i ("pv_first", measured 1.08-1.09x faster than issuing S_i first:
  docs/perf/gluon_alt_h200.md): issue the other's PV_{i-1} (it waits only for the other's
  publish, not for tile i's copies), issue S_i, wait for both; release stage i-1 and the
  other's P buffer; softmax; publish; PV_i; release stage i.
  The running max and sum travel with the tiles, so both warpgroups end with the final (m, l)
  and each writes its half of o; warpgroup 0 writes lse.

The barrier protocol is modeled in tests/test_gluon_alt_protocol.py. Needs an even ring depth
(stage parity = tile parity). Register spills (CPU compile, sm_90a, ptxas -v): without
`_opaque`, LLVM hoisted q's 32 wgmma descriptors out of the tile loop and ptxas spilled them
(232 B); as written: 0 spills at 216 consumer registers.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from csa_jax.kernels.gluon.ring import (LOG2E, NEG, PRODUCER_WARPS, _finish_sink, _ntiles_of,
                                        _produce_row, _release, _softmax_step, out_shapes,
                                        prepare, unpad)

WG_WARPS = gl.constexpr(4)   # each consumer partition is one warpgroup
NUM_WARPS = 4                # the default partition (the producer); 12 warps in all
CONSUMER_REGS = 216          # registers per consumer thread (setmaxnreg)
PRE_TILES = 1                # tiles of a row gathered before its q (ring._produce_row)


@gluon.jit
def _opaque(x):
    # A value LLVM cannot see through, so the wgmma descriptors built from it stay in the loop:
    # q's 32 (and, with 2 stages and a step-2 loop, the tile's) are loop invariant, and hoisting
    # them out of the tile loop left ptxas spilling uniform registers (232 B at 216 registers).
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _stat(stats, k):
    n: gl.constexpr = stats.shape[0] // 8
    return stats.slice(k * n, n)


@gluon.jit
def _publish(stats, W: gl.constexpr, p_smem, p, m, l, alpha, bar):
    """Owner -> other warpgroup: the bf16 P tile and (max, sum, rescale) of a tile."""
    p_smem.store(p.to(p_smem.dtype))
    _stat(stats, 4 * W).store(m)
    _stat(stats, 4 * W + 1).store(l)
    _stat(stats, 4 * W + 2).store(alpha)
    fence_async_shared()         # P is read by the other warpgroup's wgmma (async proxy)
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _other_pv_issue(stats, p_smem, ring, full, acc, ex, j, srow: gl.constexpr,
                    orow: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr,
                    DH: gl.constexpr):
    """Wait for the other warpgroup's tile j, rescale, issue PV_j on this half (async)."""
    mbarrier.wait(ex, (j // 2) & 1)
    # The tile's own barrier too (long complete; its next phase needs this warpgroup's release),
    # then the proxy fence, so this warpgroup's wgmma sees the cp.async data.
    mbarrier.wait(full.index(j % STAGES), (j // STAGES) & 1)
    fence_async_shared()
    acc = warpgroup_mma_wait(1, deps=[acc])       # (nothing of acc's is in flight)
    m = _stat(stats, 4 * (1 - W)).load(srow)
    l = _stat(stats, 4 * (1 - W) + 1).load(srow)
    alpha = _stat(stats, 4 * (1 - W) + 2).load(srow)
    acc = acc * gl.convert_layout(alpha, orow)[:, None]
    v = ring.index(j % STAGES).slice(W * DH, DH, dim=1)
    return warpgroup_mma(p_smem, v, acc, is_async=True), m, l


@gluon.jit
def _own_tile(idx_ptr, i, g, acc, m, l, bufs, W: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, DH: gl.constexpr, QK_SCALE: gl.constexpr,
              srow: gl.constexpr, orow: gl.constexpr, p_layout: gl.constexpr):
    """This warpgroup's tile i of its row (g = its number in the program's tile stream: ring
    stage, barrier phases), and before it (i >= 1) the PV of the other's tile i-1 ("pv_first"):
    returns (acc, m, l) after both."""
    ring, q_smem, full, consumed, ex, exfree, own_p, oth_p, st_bufs, s_zero, kcols = bufs
    OTHER: gl.constexpr = 1 - W
    # Tile g's stage, row ids for the mask, ring view and q view; the views come from opaque
    # indices (see _opaque).
    s = _opaque(g % STAGES)
    ids = gl.load(idx_ptr + i * BK + kcols)
    tile = ring.index(s)
    q = q_smem.index(_opaque(i * 0))
    acc = warpgroup_mma_init(acc)
    if i >= 1:
        acc, m, l = _other_pv_issue(st_bufs, oth_p, ring, full, acc, ex.index(OTHER), g - 1,
                                    srow, orow, W, STAGES, DH)
    mbarrier.wait(full.index(s), (g // STAGES) & 1)
    fence_async_shared()
    sc = warpgroup_mma(q, tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc, acc = warpgroup_mma_wait(0, deps=[sc, acc])
    if i >= 1:
        _release(consumed.index((g - 1) % STAGES))
        _release(exfree.index(OTHER))
    p, alpha, m_new, l = _softmax_step(sc, ids, m, l, QK_SCALE)
    if g >= 2:
        mbarrier.wait(exfree.index(W), ((g // 2) - 1) & 1)   # the other has read tile g-2's P
    _publish(st_bufs, W, own_p, p, m_new, l, alpha, ex.index(W))
    # Rescale, PV_i on this warpgroup's half with P from registers, release stage i.
    acc = acc * gl.convert_layout(alpha, orow)[:, None]
    pv = gl.convert_layout(p.to(tile.dtype), p_layout)
    acc = warpgroup_mma(pv, tile.slice(W * DH, DH, dim=1), acc)
    _release(consumed.index(s))
    return acc, m_new, l


@gluon.jit
def _consumer(idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full, consumed,
              q_bar, q_free, p_bufs, st_bufs, ex, exfree, T: gl.constexpr, NHB: gl.constexpr,
              K: gl.constexpr, ROWS: gl.constexpr, W: gl.constexpr, D: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
              QK_SCALE: gl.constexpr):
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
    s_zero = gl.zeros([HBC, BK], gl.float32, s_layout)
    kcols = gl.arange(0, BK, layout=scol)
    hrows = gl.arange(0, HBC, layout=srow)
    orows = gl.arange(0, HBC, layout=orow)
    ocols = W * DH + gl.arange(0, DH, layout=ocol)
    bufs = (ring, q_smem, full, consumed, ex, exfree, own_p, oth_p, st_bufs, s_zero, kcols)
    base = 0          # the row's first tile in this program's tile stream
    n = 0             # rows done by this program
    # The next row's tile count and sink logits are loaded while this row runs (a row never
    # starts on a global load's latency).
    nt = _ntiles_of(ntiles_ptr, gl.program_id(0), ROWS, NHB)
    snk = gl.load(sink_ptr + (gl.program_id(0) % NHB) * HBC + hrows)
    for row in range(gl.program_id(0), ROWS, gl.num_programs(0)):
        ntiles = nt
        sink = snk
        nxt = row + gl.num_programs(0)
        nt = _ntiles_of(ntiles_ptr, nxt, ROWS, NHB)
        snk = gl.load(sink_ptr + (nxt % NHB) * HBC + hrows)
        idx_tok = idx_ptr + (row // NHB).to(gl.int64) * K
        m = gl.full([HBC], NEG, gl.float32, srow)
        l = gl.zeros([HBC], gl.float32, srow)
        acc = gl.zeros([HBC, DH], gl.float32, o_layout)
        mbarrier.wait(q_bar, n & 1)
        # Warpgroup W owns the tiles g = base + i with g % 2 == W.
        for i in range((W + base) % 2, ntiles, 2):
            acc, m, l = _own_tile(idx_tok, i, base + i, acc, m, l, bufs, W, BK, STAGES, DH,
                                  QK_SCALE, srow, orow, p_layout)
        # The other's last tile, if the row ends on one.
        last = base + ntiles - 1
        if ntiles > 0:
            if last % 2 == OTHER:
                acc, m, l = _other_pv_issue(st_bufs, oth_p, ring, full, acc, ex.index(OTHER),
                                            last, srow, orow, W, STAGES, DH)
                acc = warpgroup_mma_wait(0, deps=[acc])
                _release(consumed.index(last % STAGES))
                _release(exfree.index(OTHER))
        # Every S of this row (q's readers) is done: the producer may load the next row's q
        # while this epilogue runs. (Releasing it right after each warpgroup's last S instead,
        # a branch and a barrier in the tile loop, made the forward 1.1-1.5x slower on the
        # H200: docs/perf/gluon_persistent_h200.md.)
        _release(q_free)
        # The epilogue: the sink joined (_finish), lse stored by warpgroup 0, this half of o.
        lse, o_scale = _finish_sink(m, l, sink)
        if W == 0:
            gl.store(lse_ptr + row * HBC + hrows, lse)
        o = (acc * gl.convert_layout(o_scale, orow)[:, None]).to(o_ptr.dtype.element_ty)
        o_ptrs = o_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :]
        gl.store(o_ptrs, o)
        base += ntiles
        n += 1


@gluon.jit
def _producer(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, q_smem, ring, full, consumed, q_bar, q_free,
              T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
              K: gl.constexpr, ROWS: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              HBC: gl.constexpr, PRE: gl.constexpr):
    """The program's rows in turn (ring._produce_row): each row's first PRE tiles, then its q
    once both consumers are done with the previous row's (q_free, after the row's last PV),
    then the other tiles; the ring's stages and phases count the program's whole tile stream,
    so the next row's first tiles and q are in flight while the consumers finish this row.
    (PRE 0, 1 and 2 timed in one process on the H200: no value wins on every layer type, 1
    kept; docs/perf/gluon_persistent_h200.md.)"""
    base = 0
    n = 0
    nt = _ntiles_of(ntiles_ptr, gl.program_id(0), ROWS, NHB)
    for row in range(gl.program_id(0), ROWS, gl.num_programs(0)):
        ntiles = nt
        nt = _ntiles_of(ntiles_ptr, row + gl.num_programs(0), ROWS, NHB)
        tok = row // NHB
        # (row ids one tile ahead: two ahead was level or 1-2% slower here, heads_h200.md)
        _produce_row(q_ptr, kv_ptr, idx_ptr + tok.to(gl.int64) * K, q_smem, ring, full,
                     consumed, q_bar, q_free, row, n, base, tok // T, ntiles, N, D, K, BK,
                     STAGES, HBC, HBC, PRE, 1, None)
        base += ntiles
        n += 1


@gluon.jit
def csa_fwd_kernel(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr,
                   T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
                   K: gl.constexpr, ROWS: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, QK_SCALE: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRE: gl.constexpr):
    """Each program walks rows program_id, program_id + num_programs, ... of the ROWS = B * T *
    NHB head blocks of 64 (forward() launches one program per SM; a grid of ROWS would run
    one row per program)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    q_smem = gl.allocate_shared_memory(dtype, [1, HBC, D],
                                       gl.NVMMASharedLayout.get_default_for([HBC, D], dtype))
    ring = gl.allocate_shared_memory(dtype, [STAGES, BK, D],
                                     gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    p_bufs = gl.allocate_shared_memory(dtype, [2, HBC, BK],
                                       gl.NVMMASharedLayout.get_default_for([HBC, BK], dtype))
    # (max, sum, rescale) of warpgroup w's latest tile: rows 4w .. 4w+2.
    st_bufs = gl.allocate_shared_memory(gl.float32, [8 * HBC], gl.SwizzledSharedLayout(
        1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ex = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    exfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    mbarrier.init(q_free, count=2)               # one arrival per consumer warpgroup
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=2)   # one arrival per consumer warpgroup
    for w in gl.static_range(2):
        mbarrier.init(ex.index(w), count=1)
        mbarrier.init(exfree.index(w), count=1)
    # The producer is the default partition (it gets what the two consumers leave of the
    # register file: 72 per thread at 216 each); the consumers are the two workers.
    gl.warp_specialize([
        (_producer, (q_ptr, kv_ptr, idx_ptr, ntiles_ptr, q_smem.index(0), ring, full,
                     consumed, q_bar, q_free, T, N, NHB, D, K, ROWS, BK, STAGES, HBC, PRE)),
        (_consumer, (idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full,
                     consumed, q_bar, q_free, p_bufs, st_bufs, ex, exfree, T, NHB, K, ROWS, 0,
                     D, BK, STAGES, HBC, QK_SCALE)),
        (_consumer, (idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full,
                     consumed, q_bar, q_free, p_bufs, st_bufs, ex, exfree, T, NHB, K, ROWS, 1,
                     D, BK, STAGES, HBC, QK_SCALE)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side

REG_FILE = 168 * 384   # what ptxas gives 384 threads (.maxnreg 168), shared out by setmaxnreg


def producer_regs(consumer_regs=CONSUMER_REGS):
    """Registers per producer thread that two consumer warpgroups of consumer_regs leave."""
    return (REG_FILE - 256 * int(consumer_regs)) // 128


def constexprs(*, T, N, NHB, D, K, BK, stages, scale, B=1):
    """The kernel's compile-time parameters (also used by the CPU compile checks)."""
    if stages % 2:
        raise ValueError(f"the alternating forward needs an even ring depth, got {stages=}")
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, ROWS=B * T * NHB, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, CONSUMER_REGS=CONSUMER_REGS,
                PRE=min(PRE_TILES, stages))


def sm_count():
    """Streaming multiprocessors of the first GPU (jax's `core_count`; 132, an H100 / H200 SXM,
    where it does not say)."""
    import jax
    try:
        devices = jax.devices("gpu")
    except RuntimeError:          # no GPU backend: only compile checks get here
        devices = []
    for d in devices:
        n = getattr(d, "core_count", None)
        if isinstance(n, int) and n > 0:
            return n
    return 132


def grid(rows):
    """Programs of a launch over `rows` head blocks: one per SM (persistent), each walking
    rows program_id, program_id + num_programs, ... (measured against one program per row
    on the H200, same call: 0-9% faster on five V4 layer types (Flash cr128 not in that call),
    docs/perf/gluon_persistent_h200.md)."""
    return (min(rows, sm_count()),)


def kernel_call(q, kv, idx, sink, *, scale, config):
    """(launch, operands, dims): launch(*operands) runs csa_fwd_kernel on the padded operands
    (ring.prepare) and returns its padded (o, lse); forward() unpads them. A benchmark times
    launch alone (benchmarks/gluon_kernel_time.py)."""
    import functools
    from csa_jax.kernels.gluon.adapter import gluon_call
    bk = config.block_k
    q_p, kv_p, idx_p, ntiles, sink_p, dims = prepare(q, kv, idx, sink, bk)
    B, T, H, D, N, Hp, Dp, Kp, nhb = dims
    consts = constexprs(T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=bk, stages=config.stages,
                        scale=scale, B=B)
    launch = functools.partial(gluon_call, kernel=csa_fwd_kernel, out_shape=out_shapes(q, dims),
                               grid=grid(consts["ROWS"]), num_warps=NUM_WARPS,
                               name="csa_gluon_fwd", **consts)
    return launch, (q_p, kv_p, idx_p, ntiles, sink_p), dims


def forward(q, kv, idx, sink, *, scale, config):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 through csa_fwd_kernel (CUDA only)."""
    launch, operands, dims = kernel_call(q, kv, idx, sink, scale=scale, config=config)
    return unpad(*launch(*operands), dims)
