"""dkv for few heads without the per-slot intermediate: kv row blocks x tokens on wgmma (NVIDIA Hopper).

dkv[n] = sum over the slots (t, k) with idx[t, k] = n of dsp[t, k] [q; dO][t], where dsp[t, k]
is the 2 H vector (scale * dS, then P, of the H heads) the few-heads dq kernel writes
(small_heads_dq.py). The per-slot path (dkv.dkv_dsink_slot_major) forms that [D] product for
every slot: [T, K, D] written and read again (19.3 GB in bf16 at T = 16384, K = 1152, D = 512,
whatever H is). Here the sum is turned around: for a block of BN = 128 kv rows,

    dkv[block] = sum over the tokens t that list a row of the block of  A_t [BN, 2H] qdo_t [2H, D]

where row r of A_t is dsp[t, k] for the slot k of t that holds row r (0 if none) and qdo_t is
[q; dO] of token t (2H rows). The contraction (tokens x 2H) runs on wgmma with no intermediate
in memory: A_t is gathered from dsp by cp.async (zero-filled where the token lists no row of
the block), qdo_t copied whole. What it costs instead: the products over A's zero rows (at V4
Pro cr4's 1024 pool slots over 4096 pool rows a token lists a quarter of a pool block's rows),
and qdo_t read once per (block, token) pair (from L2: a block's tokens are walked in order).

Layout of the work (its maps, built on the device by the two kernels of block_maps): the
(block, token) pairs are listed per block, in token order (lists [B*NB, T] of tokens t of the
block's batch row, counts [B*NB]); posg [B*NB, T, BN] holds, for block blk and token t, the
slot k of t that lists row r of the block, or -1 (written only where t lists a row of blk: the
kernel reads no other). One program = one block, one D slice of DS columns and one of S splits
of the block's pair list; blocks run longest list first (order). The S partial sums go to part
[S, B*NB*BN, Dp] f32, summed in XLA in a fixed order: deterministic, no atomics. A token that
lists a row twice (csa_spec.md allows it) would need two dsp rows in one A row: the maps
report it (dup) and the caller takes the per-slot path for that call. B's rows come from q and
dO themselves (no stacked copy).

The maps: csa_dkv_maps_token_kernel, one program per token, writes its flag row [NB] (which
blocks it lists), -1 over its posg rows of those blocks, then each slot k into its row by
atomic exchange (a row already taken is a repeat: dup); csa_dkv_maps_block_kernel, one program
per block, scans its flag column into its list and count. posg is never filled whole: only
the pairs' rows are written (at Pro cr4 a fifth of its [B*NB, T, BN] or less).

Partitions (12 warps): the producer = the default partition, 4 warps: per stage TB = 64 / JP
pairs (JP = 2H padded to 16, 32 or 64), A [BN, 64] and B [64, DS] by cp.async into a
STAGES-deep ring, each stage's ids (tokens, posg slots) loaded a stage ahead; two consumer
warpgroups, rows 0-63 and 64-127 of the block: acc [64, DS] += A [64, 64] B [64, DS] per
stage (four m64nDSk16 products, one stage's in flight).

Measured on an H100 (docs/perf/heads_h100.md), Pro cr4, T = 16384, H = 16, lists without
repeats: 4.96 ms, maps 0.39 ms (2026-12-08; the per-slot GEMM + reduce it replaces: 7.91 +
6.33 ms plus a 0.60 ms inverse-map sort; with the maps in XLA (rank-indexed posg, 2026-12-07)
the kernel took 4.14 ms and the maps 1.90); the step 22.73 ms (per-slot) -> 12.41, H = 8 21.05
-> 9.30, H = 32 27.76 -> 21.32. By count 2.3 TFLOP of products at H = 16, three quarters over
A's zero rows: the kernel's time grows with H.
"""
from __future__ import annotations

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.ring import PRODUCER_WARPS, _release

__all__ = ["csa_dkv_blocks_kernel", "csa_dkv_maps_token_kernel", "csa_dkv_maps_block_kernel",
           "arg_types", "constexprs", "block_maps", "dkv_blocks", "fits"]

NUM_WARPS = 4                 # the default partition (the producer); 12 warps in all
MAPS_WARPS = gl.constexpr(4)  # each maps kernel
WG_WARPS = gl.constexpr(4)
CONSUMER_REGS = 184           # each consumer warpgroup (acc [64, 256] f32 = 128 a thread)
BN = 128                      # kv rows per block: two consumer warpgroups of 64 (wgmma M)
KA = 64                       # contraction per ring stage: TB = KA // JP pairs of JP columns
DS_MAX = 256                  # D columns per program (wgmma N <= 256)
STAGES = 4                    # 4 x (16 + 32) KiB at DS = 256
SPLITS = 4                    # programs per (block, D slice)
POS_LIMIT = 2 ** 31           # bytes of posg above which the caller keeps the per-slot path


@gluon.jit
def _program(order_ptr, cnt_ptr, NSL: gl.constexpr, S: gl.constexpr, TB: gl.constexpr):
    """(block, D slice, split, first pair, end pair, ring stages) of this program."""
    pid = gl.program_id(0)
    o = pid // (NSL * S)
    rem = pid % (NSL * S)
    blk = gl.load(order_ptr + o)
    cnt = gl.load(cnt_ptr + blk)
    sp = rem % S
    lo = cnt * sp // S
    hi = cnt * (sp + 1) // S
    return blk, rem // S, sp, lo, hi, gl.cdiv(hi - lo, TB)


@gluon.jit
def _a_ids(pos_b, list_b, p0, hi, J: gl.constexpr, JP: gl.constexpr, BNC: gl.constexpr,
           KAC: gl.constexpr):
    """(tok, k0, k1) of a stage's A [BNC, KAC] (pairs p0 .., JP columns each): the pair's
    token per column (per 16-byte vector where J is a multiple of 8) and the slots posg names
    for rows 0-63 (k0) and 64-127 (k1), -1 where none (and for pairs past hi, columns past
    J). The producer loads them a stage ahead of their copies."""
    gl.static_assert(BNC == 128, "two halves of 64 rows, one per consumer warpgroup")
    if J % 8 == 0:
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [PRODUCER_WARPS.value, 1, 1],
                                            [2, 1, 0])
        lv: gl.constexpr = gl.SliceLayout(2, l3)
        cols = gl.arange(0, KAC // 8, layout=gl.SliceLayout(0, lv)) * 8
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, lv))
    else:
        la: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS.value, 1], [1, 0])
        cols = gl.arange(0, KAC, layout=gl.SliceLayout(0, la))
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, la))
    pa = p0 + cols // JP
    live = (pa < hi) & (cols % JP < J)
    tok = gl.load(list_b + pa, mask=live, other=0).to(gl.int64)
    at = pos_b + (tok * BNC)[None, :] + rows[:, None]
    k0 = gl.load(at, mask=live[None, :], other=-1)
    k1 = gl.load(at + 64, mask=live[None, :], other=-1)
    return tok, k0, k1


@gluon.jit
def _a_issue(a_smem, dsp_ptr, tok, k, row0, J: gl.constexpr, JP: gl.constexpr,
             KP: gl.constexpr, KAC: gl.constexpr):
    """cp.async of 64 rows of a stage's A from dsp rows (row0 + tok) KP + k, zero-filled where
    k = -1 (tok, k from _a_ids). With J a multiple of 8 one id per 16-byte vector, widened
    to the copy layout (every 8 columns of a row come from one dsp row)."""
    la: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS.value, 1], [1, 0])
    gr = ((row0 + tok) * KP)[None, :] + k
    if J % 8 == 0:
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [PRODUCER_WARPS.value, 1, 1],
                                            [2, 1, 0])
        lv: gl.constexpr = gl.SliceLayout(2, l3)
        j = (gl.arange(0, KAC // 8, layout=gl.SliceLayout(0, lv)) * 8) % JP
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        off3 = gl.expand_dims(gr * J + j[None, :], 2) + e[None, None, :]
        off = gl.convert_layout(off3.reshape([64, KAC]), la)
        off = gl.max_contiguous(gl.multiple_of(off, [1, 8]), [1, 8])
        ok3 = gl.expand_dims(k >= 0, 2) & (e >= 0)[None, None, :]
        ok = gl.max_constancy(gl.convert_layout(ok3.reshape([64, KAC]), la), [1, 8])
        async_copy.async_copy_global_to_shared(a_smem, dsp_ptr + off, mask=ok)
    else:
        j = gl.arange(0, KAC, layout=gl.SliceLayout(0, la)) % JP
        async_copy.async_copy_global_to_shared(a_smem, dsp_ptr + gr * J + j[None, :],
                                               mask=k >= 0)


@gluon.jit
def _producer(posg_ptr, list_ptr, order_ptr, cnt_ptr, dsp_ptr, q_ptr, do_ptr, a_ring, b_ring,
              full, consumed, T: gl.constexpr, NB: gl.constexpr, J: gl.constexpr,
              JP: gl.constexpr, KP: gl.constexpr, TB: gl.constexpr, DP: gl.constexpr,
              DS: gl.constexpr, NSL: gl.constexpr, S: gl.constexpr, BNC: gl.constexpr,
              KAC: gl.constexpr, STAGES: gl.constexpr):
    # B [KAC, DS]: a warp covers DS columns of one row (DS // 8 threads), or several rows.
    lb: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DS // 8), DS // 8],
                                        [PRODUCER_WARPS.value, 1], [1, 0])
    H: gl.constexpr = J // 2
    blk, sl, _, lo, hi, nst = _program(order_ptr, cnt_ptr, NSL, S, TB)
    row0 = (blk // NB).to(gl.int64) * T                           # the block's batch row b T
    br = gl.arange(0, KAC, layout=gl.SliceLayout(1, lb))
    bc = gl.arange(0, DS, layout=gl.SliceLayout(0, lb))
    b_tb = br // JP
    b_j = br % JP
    b_h = b_j % H
    pos_b = posg_ptr + blk.to(gl.int64) * (T * BNC)
    list_b = list_ptr + blk.to(gl.int64) * T
    # each stage's ids (tokens, posg slots) are loaded a stage ahead: the chain list -> posg
    # -> copy address is not waited on at the stage's turn
    tok_a, k0, k1 = _a_ids(pos_b, list_b, lo, hi, J, JP, BNC, KAC)
    tok_b = gl.load(list_b + lo + b_tb, mask=(lo + b_tb < hi) & (b_j < J), other=0)
    for g in range(nst):
        s = g % STAGES
        p0 = lo + g * TB
        b_live = (p0 + b_tb < hi) & (b_j < J)
        if g >= STAGES:
            mbarrier.wait(consumed.index(s), ((g // STAGES) - 1) & 1)
        stage = a_ring.index(s)
        _a_issue(stage.slice(0, 64), dsp_ptr, tok_a, k0, row0, J, JP, KP, KAC)
        _a_issue(stage.slice(64, 64), dsp_ptr, tok_a, k1, row0, J, JP, KP, KAC)
        # B row (t, j): q[t, j] for j < H, dO[t, j - H] after
        src = (gl.where(b_j < H, q_ptr, do_ptr)
               + ((row0 + tok_b.to(gl.int64)) * H + b_h) * DP + sl * DS)
        async_copy.async_copy_global_to_shared(b_ring.index(s), src[:, None] + bc[None, :],
                                               mask=b_live[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)
        pn = p0 + TB
        tok_a, k0, k1 = _a_ids(pos_b, list_b, pn, hi, J, JP, BNC, KAC)
        tok_b = gl.load(list_b + pn + b_tb, mask=(pn + b_tb < hi) & (b_j < J), other=0)


@gluon.jit
def _consumer(order_ptr, cnt_ptr, part_ptr, a_ring, b_ring, full, consumed,
              NBT: gl.constexpr, TB: gl.constexpr, DP: gl.constexpr, DS: gl.constexpr,
              NSL: gl.constexpr, S: gl.constexpr, BNC: gl.constexpr, STAGES: gl.constexpr,
              W: gl.constexpr):
    """Consumer warpgroup W: rows 64 W .. 64 W + 63 of the block."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DS, 16])
    blk, sl, sp, _, _, nst = _program(order_ptr, cnt_ptr, NSL, S, TB)
    acc = gl.zeros([64, DS], gl.float32, acc_layout)
    for g in range(nst):
        s = g % STAGES
        mbarrier.wait(full.index(s), (g // STAGES) & 1)
        fence_async_shared()                      # cp.async (generic proxy) -> wgmma
        acc = warpgroup_mma(a_ring.index(s).slice(64 * W, 64), b_ring.index(s), acc,
                            is_async=True)
        # one product in flight: the one before this is done, its stage goes back
        acc = warpgroup_mma_wait(1, deps=[acc])
        if g > 0:
            _release(consumed.index((g + STAGES - 1) % STAGES))
    acc = warpgroup_mma_wait(0, deps=[acc])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, DS, layout=gl.SliceLayout(0, acc_layout))
    out_row = (sp * NBT + blk) * BNC + 64 * W + rows
    gl.store(part_ptr + out_row.to(gl.int64)[:, None] * DP + sl * DS + cols[None, :], acc)


@gluon.jit
def csa_dkv_blocks_kernel(posg_ptr, list_ptr, order_ptr, cnt_ptr, dsp_ptr, q_ptr, do_ptr,
                          part_ptr, T: gl.constexpr, NB: gl.constexpr, NBT: gl.constexpr,
                          J: gl.constexpr, JP: gl.constexpr, KP: gl.constexpr,
                          DP: gl.constexpr, DS: gl.constexpr, S: gl.constexpr,
                          STAGES: gl.constexpr, BNC: gl.constexpr, KAC: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr):
    """posg [NBT, T, BN] i32 (slot or -1), list [NBT, T] i32 (tokens of each block's pairs),
    order [NBT] i32 (blocks, longest list first), cnt [NBT] i32, dsp [B*T*KP, J], q and dO
    [B*T*H, DP] (J = 2 H) | part [S, NBT*BN, DP] f32. NBT = B * NB blocks. One program per
    (block in order, D slice, split): grid NBT * (DP // DS) * S. BNC = BN and KAC = KA
    (constexprs) are what the layouts are built for: two consumer warpgroups of 64 rows, a
    producer copy layout of 64 columns."""
    dtype: gl.constexpr = dsp_ptr.dtype.element_ty
    TB: gl.constexpr = KAC // JP
    NSL: gl.constexpr = DP // DS
    a_ring = gl.allocate_shared_memory(dtype, [STAGES, BNC, KAC],
                                       gl.NVMMASharedLayout.get_default_for([BNC, KAC], dtype))
    b_ring = gl.allocate_shared_memory(dtype, [STAGES, KAC, DS],
                                       gl.NVMMASharedLayout.get_default_for([KAC, DS], dtype))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=2)   # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_producer, (posg_ptr, list_ptr, order_ptr, cnt_ptr, dsp_ptr, q_ptr, do_ptr, a_ring,
                     b_ring, full, consumed, T, NB, J, JP, KP, TB, DP, DS, NSL, S, BNC, KAC,
                     STAGES)),
        (_consumer, (order_ptr, cnt_ptr, part_ptr, a_ring, b_ring, full, consumed, NBT, TB, DP,
                     DS, NSL, S, BNC, STAGES, 0)),
        (_consumer, (order_ptr, cnt_ptr, part_ptr, a_ring, b_ring, full, consumed, NBT, TB, DP,
                     DS, NSL, S, BNC, STAGES, 1)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


# ------------------------------------------------------------------------------- the maps

@gluon.jit
def csa_dkv_maps_token_kernel(idx_ptr, flag_ptr, posg_ptr, dup_ptr, T: gl.constexpr,
                              KP: gl.constexpr, NB: gl.constexpr, BNC: gl.constexpr,
                              KC: gl.constexpr, NBC: gl.constexpr):
    """idx [B*T, KP] i32 (-1 or a row < NB BN) | flag [B*T, NB] i32, posg [B*NB, T, BN] i32,
    dup [B*T] i32. One program per token (b, t): flag[bt, nb] = 1 where the token lists a row
    of block nb, else 0; posg[b NB + nb, t, :] = -1 over those blocks, then posg[b NB + n //
    BN, t, n % BN] = k for each slot k listing row n, by atomic exchange: dup[bt] = 1 where an
    exchange found the row taken (the token lists it twice), else 0. The phases are ordered by
    barriers of the program's threads (every row it writes is the token's own)."""
    l1: gl.constexpr = gl.BlockedLayout([1], [32], [MAPS_WARPS], [0])
    l2: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [MAPS_WARPS, 1], [1, 0])
    bt = gl.program_id(0)
    b = bt // T
    t = bt % T
    flag_t = flag_ptr + bt.to(gl.int64) * NB
    idx_t = idx_ptr + bt.to(gl.int64) * KP
    posg_t = posg_ptr + (b * NB).to(gl.int64) * (T * BNC) + t.to(gl.int64) * BNC
    for c in range(0, NB, KC):
        nb = c + gl.arange(0, KC, layout=l1)
        gl.store(flag_t + nb, gl.zeros([KC], gl.int32, l1), mask=nb < NB)
    gl.thread_barrier()
    for c in range(0, KP, KC):
        k = c + gl.arange(0, KC, layout=l1)
        n = gl.load(idx_t + k, mask=k < KP, other=-1)
        gl.store(flag_t + gl.maximum(n, 0) // BNC, gl.full([KC], 1, gl.int32, l1), mask=n >= 0)
    gl.thread_barrier()
    r = gl.arange(0, BNC, layout=gl.SliceLayout(0, l2))
    for c in range(0, NB, NBC):
        nb = c + gl.arange(0, NBC, layout=gl.SliceLayout(1, l2))
        f = gl.load(flag_t + nb, mask=nb < NB, other=0)
        rowp = posg_t + nb.to(gl.int64) * (T * BNC)
        gl.store(rowp[:, None] + r[None, :], gl.full([NBC, BNC], -1, gl.int32, l2),
                 mask=(f > 0)[:, None])
    gl.thread_barrier()
    d = gl.zeros([KC], gl.int32, l1)
    for c in range(0, KP, KC):
        k = c + gl.arange(0, KC, layout=l1)
        n = gl.load(idx_t + k, mask=k < KP, other=-1)
        ok = n >= 0
        m = gl.maximum(n, 0)
        old = gl.atomic_xchg(posg_t + (m // BNC).to(gl.int64) * (T * BNC) + m % BNC, k,
                             mask=ok, sem="relaxed")
        d = gl.maximum(d, (ok & (old != -1)).to(gl.int32))
    gl.store(dup_ptr + bt, gl.max(d, 0))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def csa_dkv_maps_block_kernel(flag_ptr, list_ptr, cnt_ptr, T: gl.constexpr, NB: gl.constexpr,
                              TC: gl.constexpr):
    """flag [B*T, NB] i32 | list [B*NB, T] i32, cnt [B*NB] i32. One program per block
    blk = b NB + nb: its tokens t (flag[b T + t, nb] = 1), in order, into list[blk, :cnt] by a
    running scan of the flag column (entries past cnt are not written)."""
    l1: gl.constexpr = gl.BlockedLayout([1], [32], [MAPS_WARPS], [0])
    blk = gl.program_id(0)
    b = blk // NB
    nb = blk % NB
    list_b = list_ptr + blk.to(gl.int64) * T
    run = gl.to_tensor(0)
    for c in range(0, T, TC):
        t = c + gl.arange(0, TC, layout=l1)
        f = gl.load(flag_ptr + (b * T + t).to(gl.int64) * NB + nb, mask=t < T, other=0)
        incl = gl.associative_scan(f, 0, _add)
        gl.store(list_b + run + incl - 1, t, mask=f > 0)
        run += gl.sum(f, 0)
    gl.store(cnt_ptr + blk, run)


# ----------------------------------------------------------------------------- host side

# posg, list, order, cnt, dsp, q, dO | part
ARG_TYPES = ("*i32", "*i32", "*i32", "*i32", "*{dt}", "*{dt}", "*{dt}", "*fp32")
MAPS_TOKEN_ARG_TYPES = ("*i32", "*i32", "*i32", "*i32")        # idx | flag, posg, dup
MAPS_BLOCK_ARG_TYPES = ("*i32", "*i32", "*i32")                # flag | list, cnt
KC = 256                      # slots (and flag entries) per step of the token maps kernel
NBC = 16                      # blocks per step of its posg fill ([16, BN] a step)
TC = 1024                     # tokens per step of the block maps kernel's scan


def arg_types(dt="bf16"):
    return [a.format(dt=dt) for a in ARG_TYPES]


def head_pad(H):
    """JP: 2 H padded to 16, 32 or 64 (a stage's KA = 64 columns hold KA // JP tokens)."""
    if not 1 <= H <= 32:
        raise ValueError(f"the block dkv kernel takes 1 <= H <= 32 heads, got H={H}")
    return max(16, 1 << (2 * H - 1).bit_length())


def constexprs(*, T, NB, B, H, Kp, DP, splits=SPLITS, stages=STAGES):
    """The kernel's compile-time parameters (also used by the CPU compile checks)."""
    if DP < 64 or DP & (DP - 1):
        raise ValueError(f"the block dkv kernel needs D padded to a power of two >= 64, got "
                         f"{DP}")
    return dict(T=T, NB=NB, NBT=B * NB, J=2 * H, JP=head_pad(H), KP=Kp, DP=DP,
                DS=min(DS_MAX, DP), S=splits, STAGES=stages, BNC=BN, KAC=KA,
                CONSUMER_REGS=CONSUMER_REGS)


def maps_token_constexprs(*, T, Kp, NB):
    return dict(T=T, KP=Kp, NB=NB, BNC=BN, KC=KC, NBC=NBC)


def maps_block_constexprs(*, T, NB):
    return dict(T=T, NB=NB, TC=TC)


def num_blocks(N):
    """Blocks of BN kv rows covering N rows (the last one partial)."""
    return -(-N // BN)


def grid_size(NBT, DP, splits=SPLITS):
    return NBT * (DP // min(DS_MAX, DP)) * splits


def fits(B, T, N):
    """Whether posg [B*NB, T, BN] i32 stays under POS_LIMIT bytes (else the caller takes the
    per-slot path)."""
    return B * num_blocks(N) * T * BN * 4 <= POS_LIMIT


def block_maps(idx_p, N, *, launch=None):
    """((posg [B*NB, T, BN] i32, lists [B*NB, T] i32, cnt [B*NB] i32, order [B*NB] i32), dup)
    of idx_p [B, T, Kp] (-1 for empty slots; every other id < N), by the two maps kernels
    (launch: a stand-in with gluon_call's signature, for the CPU tests): see the module
    docstring. posg is written only at the pairs' tokens, lists only up to cnt. dup: some
    token lists a row twice (posg is then not usable)."""
    import jax.numpy as jnp
    B, T, Kp = idx_p.shape
    NB = num_blocks(N)
    if launch is None:
        from csa_jax.kernels.gluon.adapter import gluon_call as launch
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    flag, posg, dup = launch(
        idx_p.astype(i32).reshape(B * T, Kp), kernel=csa_dkv_maps_token_kernel,
        out_shape=[sds((B * T, NB), i32), sds((B * NB, T, BN), i32), sds((B * T,), i32)],
        grid=(B * T,), num_warps=MAPS_WARPS.value, name="csa_gluon_dkv_maps_token",
        **maps_token_constexprs(T=T, Kp=Kp, NB=NB))
    lists, cnt = launch(
        flag, kernel=csa_dkv_maps_block_kernel,
        out_shape=[sds((B * NB, T), i32), sds((B * NB,), i32)], grid=(B * NB,),
        num_warps=MAPS_WARPS.value, name="csa_gluon_dkv_maps_block",
        **maps_block_constexprs(T=T, NB=NB))
    order = jnp.argsort(-cnt, stable=True).astype(i32)
    return (posg, lists, cnt, order), jnp.any(dup > 0)


def maps_token_reference(idx2, T, NB):
    """What csa_dkv_maps_token_kernel writes, in XLA, from idx2 [B*T, Kp]: (flag [B*T, NB],
    posg [B*NB, T, BN] (-1 also at the rows the kernel leaves unwritten), dup [B*T]); at a
    repeated row posg holds one of its slots. The GPU check (benchmarks/gluon_check.py) and the
    CPU tests' stand-in compare against it."""
    import jax.numpy as jnp
    i32 = jnp.int32
    BT, Kp = idx2.shape
    valid = idx2 >= 0
    n = jnp.where(valid, idx2, 0)
    bt = jnp.broadcast_to(jnp.arange(BT, dtype=i32)[:, None], n.shape)
    k = jnp.broadcast_to(jnp.arange(Kp, dtype=i32)[None, :], n.shape)
    nb = jnp.where(valid, n // BN, NB)                                  # NB: dropped
    flag = jnp.zeros((BT, NB), i32).at[bt, nb].set(1, mode="drop")
    blk = (bt // T) * NB + nb
    posg = jnp.full((BT // T * NB, T, BN), -1, i32).at[
        jnp.where(valid, blk, BT // T * NB), bt % T, n % BN].set(k, mode="drop")
    seen = jnp.zeros((BT, NB * BN), i32).at[bt, jnp.where(valid, n, NB * BN)].add(
        1, mode="drop")
    return flag, posg, jnp.any(seen > 1, axis=1).astype(i32)


def flag_by_block(flag, T):
    """flag [B*T, NB] (the token maps kernel's) as [B*NB, T]: which tokens each block's pairs
    hold."""
    BT, NB = flag.shape
    return flag.reshape(BT // T, T, NB).transpose(0, 2, 1).reshape(-1, T)


def maps_block_reference(flag, T):
    """What csa_dkv_maps_block_kernel writes, in XLA, from flag [B*T, NB]: (lists [B*NB, T]
    (0 past cnt), cnt [B*NB])."""
    import jax.numpy as jnp
    i32 = jnp.int32
    f = flag_by_block(flag, T)                                          # [blk, t]
    rank = jnp.cumsum(f, axis=1, dtype=i32) - 1
    rows = jnp.broadcast_to(jnp.arange(f.shape[0], dtype=i32)[:, None], f.shape)
    t = jnp.broadcast_to(jnp.arange(T, dtype=i32)[None, :], f.shape)
    lists = jnp.zeros(f.shape, i32).at[rows, jnp.where(f > 0, rank, T)].set(t, mode="drop")
    return lists, jnp.sum(f, axis=1, dtype=i32)


def dkv_blocks(dsp, q, do, maps, N, *, launch=None):
    """dkv [B, N, Dp] f32 from dsp [B, T, Kp, 2, H], q and dO [B, T, H, Dp] (q's dtype) and
    maps = the first output of block_maps (whose dup must be False): the kernel above
    (launch: a stand-in with gluon_call's signature, for the CPU tests) and the fixed-order
    sum of its splits."""
    import jax.numpy as jnp
    B, T, Kp, _, H = dsp.shape
    Dp = q.shape[-1]
    posg, lists, cnt, order = maps
    NB = posg.shape[0] // B
    consts = constexprs(T=T, NB=NB, B=B, H=H, Kp=Kp, DP=Dp)
    operands = (posg, lists, order, cnt, dsp.reshape(B * T * Kp, 2 * H),
                q.reshape(B * T * H, Dp), do.reshape(B * T * H, Dp))
    if launch is None:
        from csa_jax.kernels.gluon.adapter import gluon_call as launch
    part = launch(*operands, kernel=csa_dkv_blocks_kernel,
                  out_shape=jax.ShapeDtypeStruct((consts["S"], B * NB * BN, Dp), jnp.float32),
                  grid=(grid_size(B * NB, Dp, consts["S"]),), num_warps=NUM_WARPS,
                  name="csa_gluon_dkv_blocks", **consts)
    dkv = part[0]
    for s in range(1, part.shape[0]):                           # fixed order
        dkv = dkv + part[s]
    return dkv.reshape(B, -1, Dp)[:, :N]
