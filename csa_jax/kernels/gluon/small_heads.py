"""The CSA forward in Gluon for few heads (H <= 32, NVIDIA Hopper): kv rows as the wgmma M.

Under tensor parallelism a device runs the op with H = 8..32 heads. The 64-head kernel (fwd.py)
puts the heads on wgmma's M dimension, which is 64 per warpgroup: at H = 16 three quarters of
its products are padding. This kernel turns both products around so the token's gathered kv
rows are M and the heads are N (wgmma's N may be 16 or 32):

    S^T [BK, HN]  = tile [BK, D] q^T [D, HN]      (A = the ring tile, B = q, in shared memory)
    O^T [D, HN]  += tile^T [D, BK] P^T [BK, HN]  (A = the same tile read MN-major, B = P^T)

with HN = the heads padded to 16 or 32 in shared memory only (q, o, lse and sink hold the H
real heads; the producer zero-fills q's padded heads, which are computed and never stored;
padding q and slicing o in memory instead took Pro cr4 3.44 instead of 3.21 ms at H = 8, 4.66
instead of 4.07 at H = 24 on an H100, docs/perf/heads_h100.md). Nothing is padded on M, and
each wgmma reads its A operand from shared memory once per tile, so a tile should cost about
the same at HN = 16 or 32 (by count: ~1,000 clocks of shared-memory reads at D = 512, under the
~2,200 clocks of L2 bandwidth an SM's share of the gather takes). The softmax runs down the
columns (one per head): the max over a tile's BK rows is a reduction across the warpgroup's 4
warps; the row sums are kept per thread and reduced once per token.

Partitions (8 warps): the producer = the default partition, 4 warps, gathers with cp.async
into a STAGES-deep ring of BK-row tiles as the 64-head forward does (ring._produce_row: a row =
one token, all its heads; a row's first STAGES tiles go before its q; each tile's row ids are
loaded two tiles ahead); the consumer = one worker warpgroup that runs S^T, the softmax, P^T
into shared memory and O^T per tile, each product waited for, then releases the stage. One
program per SM, walking tokens. Smaller q leaves room for a deeper ring: 3 stages of 64 rows
at HN = 16, 2 at HN = 32 (D = 512; dims.small_heads_shared_bytes, default_config).

Measured on the H200 (docs/perf/heads_h200.md; Pro cr4, T = 16384, device time per call):
3.21 ms at H = 16 and 4.12 at H = 32 (FlashMLA padded to 64 heads, same call: 4.09 / 4.28). Nsight
Compute: the consumer is the bound (it almost never waits for a tile; a third of its time is
the wgmma waits, a fifth the softmax's cross-warp max). The producer alone, with row ids two
tiles ahead, gathers at 8.2 TB/s (benchmarks/gather_floor.py ring64s2nr, as fast as a gather
into registers); with the ids one tile ahead it waited on each tile's ids and gathered at 6.4
TB/s. Tried and slower: issuing S^T of the next tile behind O^T (holds two stages; 1.6-1.9x),
two consumer warpgroups of 16 heads each at HN = 32 (each reads every tile; 7-10%, commit
3f36e99).

CONSUMERS = 2 (Config.fwd_consumers, HN = 16, 12 warps): two consumer warpgroups split each
token's tiles instead (_consumer_pair: tiles i = w mod 2, each its own (m, l, O^T); warpgroup
1's partial reaches warpgroup 0 through the ring stage of its last tile). H100, same calls
(docs/perf/heads_h100.md): cr4 lists 7-13% faster (Pro H = 16 3.20 -> 2.86 ms), cr0 / cr128
8-11% slower (2-4 tiles a token); default_config picks it at D = 512 off the cr0 / cr128
promises.

The backward's few-heads dq kernel (small_heads_dq.py) shares this file's producer (with dO
copied beside q), ring buffers and tile wait (_producer, _ring_buffers, _next_tile).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.ring import (LOG2E, NEG, PRODUCER_WARPS, _finish, _finish_sink,
                                        _produce_row, _release, _row_info)

NUM_WARPS = 4                 # the default partition (the producer); 8 warps in all
WG_WARPS = gl.constexpr(4)    # the consumer partition: one warpgroup
CONSUMER_REGS = 232           # asked for the consumer (setmaxnreg); the compiled PTX gives
                              # every partition 256 (65,536 / 256 threads) all the same
BLOCK_K = 64                  # tile rows = wgmma M
PAIR_REGS = 216               # per consumer thread with two consumer warpgroups (12 warps)


@gluon.jit
def _tile(g, i, idx_tok, ring, full, q_t, pt_smem, m, lpart, acc, krows, s_zero,
          BK: gl.constexpr, STAGES: gl.constexpr, QK_SCALE: gl.constexpr):
    """Tile i of a token (number g of the program's tile stream) into the running (m, lpart,
    acc): S^T, the column softmax step, P^T through pt_smem, O^T. Returns its stage."""
    s, ids, tile = _next_tile(g, i, idx_tok, krows, ring, full, BK, STAGES)
    sc = warpgroup_mma(tile, q_t, s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(0, deps=[sc])
    sc = gl.where((ids >= 0)[:, None], sc * QK_SCALE, float("-inf"))
    m_new = gl.maximum(m, gl.max(sc, axis=0))
    p = gl.exp2(sc - m_new[None, :])
    alpha = gl.exp2(m - m_new)
    lpart = lpart * alpha[None, :] + p
    acc = acc * alpha[None, :]
    pt_smem.store(p.to(pt_smem.dtype))
    fence_async_shared()                  # P^T is read by wgmma (async proxy)
    gl.thread_barrier()
    acc = warpgroup_mma(tile.permute((1, 0)), pt_smem, acc)
    return s, m_new, lpart, acc


@gluon.jit
def _store_row(m, lpart, acc, row, sink_ptr, o_ptr, lse_ptr, hcols, drows, D: gl.constexpr,
               HN: gl.constexpr, H: gl.constexpr):
    """Join the sink and store the token's lse and o (H of the HN computed heads); lpart: the
    per-thread row sums [BK, HN], summed here."""
    if H == HN:
        lse, o_scale = _finish(m, gl.sum(lpart, axis=0), sink_ptr + hcols)
        gl.store(lse_ptr + row * HN + hcols, lse)
        o = (acc * o_scale[None, :]).to(o_ptr.dtype.element_ty)
        gl.store(o_ptr + (row * HN + hcols).to(gl.int64)[None, :] * D + drows[:, None], o)
    else:
        # H < HN: o / lse hold H heads a row; the zero-filled heads H .. HN-1 are dropped.
        live = hcols < H
        sink = gl.load(sink_ptr + hcols, mask=live, other=float("-inf"))
        lse, o_scale = _finish_sink(m, gl.sum(lpart, axis=0), sink)
        hrow = row * H + gl.where(live, hcols, 0)
        gl.store(lse_ptr + hrow, lse, mask=live)
        o = (acc * o_scale[None, :]).to(o_ptr.dtype.element_ty)
        gl.store(o_ptr + hrow.to(gl.int64)[None, :] * D + drows[:, None], o,
                 mask=live[None, :])


@gluon.jit
def _next_tile(g, i, idx_tok, krows, ring, full, BK: gl.constexpr, STAGES: gl.constexpr):
    """(stage, row ids, ring tile) of a token's tile i, number g of the program's tile stream:
    its ids loaded (into krows' layout) before the wait for its copies, which are then made
    visible to wgmma."""
    s = g % STAGES
    ids = gl.load(idx_tok + i * BK + krows)
    tile = ring.index(s)
    mbarrier.wait(full.index(s), (g // STAGES) & 1)
    fence_async_shared()                  # cp.async (generic proxy) -> wgmma
    return s, ids, tile


@gluon.jit
def _consumer(idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, pt_smem, full,
              consumed, q_bar, q_free, T: gl.constexpr, K: gl.constexpr, ROWS: gl.constexpr,
              D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, HN: gl.constexpr,
              H: gl.constexpr, QK_SCALE: gl.constexpr):
    # One layout for S^T [BK, HN] and O^T [D, HN] (M repeats in 64-row blocks): a head's
    # statistics (SliceLayout 0) are the same tensors for both.
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 16])
    mrow: gl.constexpr = gl.SliceLayout(1, layout)
    hcol: gl.constexpr = gl.SliceLayout(0, layout)
    krows = gl.arange(0, BK, layout=mrow)
    drows = gl.arange(0, D, layout=mrow)
    hcols = gl.arange(0, HN, layout=hcol)
    s_zero = gl.zeros([BK, HN], gl.float32, layout)
    q_t = q_smem.permute((1, 0))                  # [D, HN]: K-major B of S^T
    base = 0          # the row's first tile in this program's tile stream
    n = 0             # rows done by this program
    for row in range(gl.program_id(0), ROWS, gl.num_programs(0)):
        _, _, _, ntiles, idx_tok = _row_info(ntiles_ptr, idx_ptr, row, T, 1, K)
        m = gl.full([HN], NEG, gl.float32, hcol)
        lpart = gl.zeros([BK, HN], gl.float32, layout)     # row sums, per thread until the end
        acc = gl.zeros([D, HN], gl.float32, layout)
        mbarrier.wait(q_bar, n & 1)
        for i in range(ntiles):
            s, m, lpart, acc = _tile(base + i, i, idx_tok, ring, full, q_t, pt_smem, m, lpart,
                                     acc, krows, s_zero, BK, STAGES, QK_SCALE)
            _release(consumed.index(s))
        _release(q_free)
        _store_row(m, lpart, acc, row, sink_ptr, o_ptr, lse_ptr, hcols, drows, D, HN, H)
        base += ntiles
        n += 1


@gluon.jit
def _consumer_pair(idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, pt_smem,
                   full, consumed, q_bar, q_free, mfull, T: gl.constexpr,
                   K: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, HN: gl.constexpr, H: gl.constexpr,
                   QK_SCALE: gl.constexpr, W: gl.constexpr):
    """Consumer warpgroup W of two (CONSUMERS = 2): W runs the token's tiles i with
    i % 2 == W into its own (m, l, O^T), so one warpgroup's softmax overlaps the other's
    products. Warpgroup 1 keeps the stage of its last tile, writes its f32 O^T [D, HN] and
    its (m, l) there, and arrives on mfull; warpgroup 0 merges them into its own, releases
    that stage and stores the token. Merges alternate between two mfull barriers: warpgroup 1
    is at most one merge ahead (it needs the next token's q, which warpgroup 0 frees only
    before its merge), and never writes the held stage again before it is released."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 16])
    mrow: gl.constexpr = gl.SliceLayout(1, layout)
    hcol: gl.constexpr = gl.SliceLayout(0, layout)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    krows = gl.arange(0, BK, layout=mrow)
    drows = gl.arange(0, D, layout=mrow)
    hcols = gl.arange(0, HN, layout=hcol)
    s_zero = gl.zeros([BK, HN], gl.float32, layout)
    q_t = q_smem.permute((1, 0))
    pt = pt_smem.index(W)
    base = 0
    n = 0
    k = 0             # merges done (tokens with >= 2 tiles)
    for row in range(gl.program_id(0), ROWS, gl.num_programs(0)):
        _, _, _, ntiles, idx_tok = _row_info(ntiles_ptr, idx_ptr, row, T, 1, K)
        m = gl.full([HN], NEG, gl.float32, hcol)
        lpart = gl.zeros([BK, HN], gl.float32, layout)
        acc = gl.zeros([D, HN], gl.float32, layout)
        last1 = ntiles - 1 - ntiles % 2           # warpgroup 1's last tile (ntiles >= 2)
        mbarrier.wait(q_bar, n & 1)
        for i in range(W, ntiles, 2):
            s, m, lpart, acc = _tile(base + i, i, idx_tok, ring, full, q_t, pt, m, lpart, acc,
                                     krows, s_zero, BK, STAGES, QK_SCALE)
            if W == 0:
                _release(consumed.index(s))
            elif i != last1:
                _release(consumed.index(s))
        _release(q_free)
        # warpgroup 1's partial in the stage of its last tile (64 KiB as f32 [2 D, HN]): O^T in
        # rows [0, D), m and l (each broadcast over BK rows) in [D, D + BK), [D + BK, D + 2 BK)
        part = ring.index((base + last1) % STAGES)._reinterpret(gl.float32, [2 * D, HN], plain)
        slot = k % 2
        if W == 1:
            if ntiles >= 2:
                part.slice(0, D).store(acc)
                part.slice(D, BK).store(s_zero + m[None, :])
                part.slice(D + BK, BK).store(s_zero + gl.sum(lpart, axis=0)[None, :])
                gl.thread_barrier()
                mbarrier.arrive(mfull.index(slot))
        else:
            if ntiles >= 2:
                mbarrier.wait(mfull.index(slot), (k // 2) & 1)
                m1 = gl.max(part.slice(D, BK).load(layout), axis=0)
                l1 = gl.max(part.slice(D + BK, BK).load(layout), axis=0)
                acc1 = part.slice(0, D).load(layout)
                m_new = gl.maximum(m, m1)
                a0 = gl.exp2(m - m_new)
                a1 = gl.exp2(m1 - m_new)
                acc = acc * a0[None, :] + acc1 * a1[None, :]
                # warpgroup 1's sum joins the per-thread row sums as one more row
                lpart = lpart * a0[None, :] + gl.where(krows[:, None] == 0,
                                                       (l1 * a1)[None, :], 0.0)
                m = m_new
                _release(consumed.index((base + last1) % STAGES))
            _store_row(m, lpart, acc, row, sink_ptr, o_ptr, lse_ptr, hcols, drows, D, HN, H)
        k += (ntiles >= 2).to(gl.int32)
        base += ntiles
        n += 1


@gluon.jit
def _producer(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, q_smem, ring, full, consumed, q_bar, q_free,
              T: gl.constexpr, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
              ROWS: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, HN: gl.constexpr,
              H: gl.constexpr, do_ptr):
    """The few-heads kernels' producer (ring._produce_row per token); do_ptr: the dq kernel's
    dO, copied beside q (None for the forward)."""
    base = 0
    n = 0
    for row in range(gl.program_id(0), ROWS, gl.num_programs(0)):
        _, _, b, ntiles, idx_tok = _row_info(ntiles_ptr, idx_ptr, row, T, 1, K)
        _produce_row(q_ptr, kv_ptr, idx_tok, q_smem, ring, full, consumed, q_bar, q_free, row,
                     n, base, b, ntiles, N, D, K, BK, STAGES, HN, H, STAGES, 2, do_ptr)
        base += ntiles
        n += 1


@gluon.jit
def _ring_buffers(dtype: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  HN: gl.constexpr, CONSUMERS: gl.constexpr = 1):
    """The few-heads kernels' ring [STAGES, BK, D], their [BK, HN] product operand (P^T or
    dS^T) and the initialized barriers (full, consumed, q_bar, q_free): allocated after the
    kernel's q (or [q; dO]) buffer."""
    ring = gl.allocate_shared_memory(dtype, [STAGES, BK, D],
                                     gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, HN], dtype)
    if CONSUMERS == 1:
        pt_smem = gl.allocate_shared_memory(dtype, [BK, HN], pt_layout)
    else:                                 # one per consumer warpgroup (fwd_consumers = 2)
        pt_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BK, HN], pt_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    mbarrier.init(q_free, count=CONSUMERS)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=1)
    return ring, pt_smem, full, consumed, q_bar, q_free


@gluon.jit
def csa_fwd_small_heads_kernel(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr,
                               T: gl.constexpr, N: gl.constexpr, D: gl.constexpr,
                               K: gl.constexpr, ROWS: gl.constexpr, HN: gl.constexpr,
                               H: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                               QK_SCALE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               CONSUMERS: gl.constexpr):
    """Each program walks rows (tokens) program_id, program_id + num_programs, ... of the
    ROWS = B * T tokens; q / o rows row * H .. of the [B*T*H, D] views (H <= HN heads, not
    padded in memory: the producer zero-fills q's heads H .. HN-1 in shared memory and the
    consumer stores H heads of o and lse; sink holds H logits). CONSUMERS: one consumer
    warpgroup (_consumer) or two splitting each token's tiles (_consumer_pair)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [HN, D],
                                       gl.NVMMASharedLayout.get_default_for([HN, D], dtype))
    ring, pt_smem, full, consumed, q_bar, q_free = _ring_buffers(dtype, D, BK, STAGES, HN,
                                                                 CONSUMERS)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_producer, (q_ptr, kv_ptr, idx_ptr, ntiles_ptr, q_smem, ring, full, consumed,
                         q_bar, q_free, T, N, D, K, ROWS, BK, STAGES, HN, H, None)),
            (_consumer, (idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, pt_smem,
                         full, consumed, q_bar, q_free, T, K, ROWS, D, BK, STAGES, HN, H,
                         QK_SCALE)),
        ], [WG_WARPS], [CONSUMER_REGS])
    else:
        mfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            mbarrier.init(mfull.index(j), count=1)
        gl.warp_specialize([
            (_producer, (q_ptr, kv_ptr, idx_ptr, ntiles_ptr, q_smem, ring, full, consumed,
                         q_bar, q_free, T, N, D, K, ROWS, BK, STAGES, HN, H, None)),
            (_consumer_pair, (idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring,
                              pt_smem, full, consumed, q_bar, q_free, mfull, T, K,
                              ROWS, D, BK, STAGES, HN, H, QK_SCALE, 0)),
            (_consumer_pair, (idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring,
                              pt_smem, full, consumed, q_bar, q_free, mfull, T, K,
                              ROWS, D, BK, STAGES, HN, H, QK_SCALE, 1)),
        ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side


def constexprs(*, T, N, HN, D, K, BK, stages, scale, B=1, H=None, consumers=1):
    """The kernel's compile-time parameters (also used by the CPU compile checks); H = the
    heads q / o / lse / sink hold (default HN), 1 <= H <= HN; consumers: 1 or 2 consumer
    warpgroups (2 needs a ring of >= 3 stages: each warpgroup holds one while it computes;
    and HN = 16, D >= 2 BK: warpgroup 1's partial, f32 O^T [D, HN] then m and l [BK, HN]
    each, must fit the [BK, D] bf16 stage it is written to)."""
    if consumers not in (1, 2):
        raise ValueError(f"the few-heads forward takes 1 or 2 consumer warpgroups, got "
                         f"consumers={consumers}")
    if consumers == 2 and stages < 3:
        raise ValueError(f"two consumer warpgroups need a ring of >= 3 stages, got {stages=}")
    if consumers == 2 and (HN != 16 or D < 2 * BK):
        raise ValueError(f"two consumer warpgroups need HN = 16 and D >= {2 * BK} (their "
                         f"merge fills a ring stage), got HN={HN}, D={D}")
    if HN not in (16, 32):
        raise ValueError(f"the few-heads forward takes 16 or 32 padded heads, got HN={HN}")
    H = HN if H is None else H
    if not 1 <= H <= HN:
        raise ValueError(f"the few-heads forward takes 1 <= H <= HN={HN} heads, got H={H}")
    if BK != BLOCK_K:
        raise ValueError(f"the few-heads forward needs {BLOCK_K}-row tiles (wgmma M), got {BK=}")
    return dict(T=T, N=N, D=D, K=K, ROWS=B * T, HN=HN, H=H, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E,
                CONSUMER_REGS=CONSUMER_REGS if consumers == 1 else PAIR_REGS,
                CONSUMERS=consumers)


def kernel_call(q, kv, idx, sink, *, scale, HN, stages, consumers=1):
    """(launch, operands, dims): launch(*operands) runs csa_fwd_small_heads_kernel on the
    prepared operands (heads not padded in memory: hp = H; the kernel pads them in shared
    memory) and returns the padded (o, lse); forward() unpads them. A benchmark times launch
    alone (benchmarks/gluon_kernel_time.py)."""
    import functools
    from csa_jax.kernels.gluon.adapter import gluon_call
    from csa_jax.kernels.gluon.fwd import grid
    from csa_jax.kernels.gluon.ring import out_shapes, prepare
    H = q.shape[2]
    if H > HN:
        raise ValueError(f"the few-heads forward takes H <= HN={HN}, got H={H}")
    q_p, kv_p, idx_p, ntiles, sink_p, dims = prepare(q, kv, idx, sink, BLOCK_K, hp=H)
    B, T, _, _, N, _, Dp, Kp, _ = dims
    consts = constexprs(T=T, N=N, HN=HN, D=Dp, K=Kp, BK=BLOCK_K, stages=stages, scale=scale,
                        B=B, H=H, consumers=consumers)
    launch = functools.partial(gluon_call, kernel=csa_fwd_small_heads_kernel,
                               out_shape=out_shapes(q, dims), grid=grid(consts["ROWS"]),
                               num_warps=NUM_WARPS, name="csa_gluon_fwd_small_heads", **consts)
    return launch, (q_p, kv_p, idx_p, ntiles, sink_p), dims


def forward(q, kv, idx, sink, *, scale, HN, stages, consumers=1):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 through csa_fwd_small_heads_kernel (CUDA
    only, H <= HN, HN = 16 or 32)."""
    from csa_jax.kernels.gluon.ring import unpad
    launch, operands, dims = kernel_call(q, kv, idx, sink, scale=scale, HN=HN, stages=stages,
                                         consumers=consumers)
    return unpad(*launch(*operands), dims)
