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

Layout of the work (host side, block_maps): the (block, token) pairs are listed per block, in
token order (lists [B*NB, T], counts [B*NB]); posg [B*NB, T, BN] holds, for the i-th pair of a
block and row r, the global dsp row (b T + t) Kp + k, or -1. One program = one block, one
D slice of DS columns and one of S splits of the block's pair list; blocks run longest list
first (order). The S partial sums go to part [S, B*NB*BN, Dp] f32, summed in XLA in a fixed
order: deterministic, no atomics. A token that lists a row twice (csa_spec.md allows it) would
need two dsp rows in one A row: block_maps reports it (dup) and the caller takes the per-slot
path for that call.

Partitions (12 warps): the producer = the default partition, 4 warps: per stage TB = 64 / JP
pairs (JP = 2H padded to 16, 32 or 64), A [BN, 64] and B [64, DS] by cp.async into a
STAGES-deep ring; two consumer warpgroups, rows 0-63 and 64-127 of the block: acc [64, DS] +=
A [64, 64] B [64, DS] per stage (four m64nDSk16 products).

Measured on an H100 (docs/perf/heads_h100.md, 2026-12-07): Pro cr4, T = 16384, H = 16, lists
without repeats: 4.14 ms (the per-slot GEMM + reduce it replaces: 7.91 + 6.33 ms, plus the
0.60 ms inverse-map sort; its maps cost 1.90 ms); the step 22.73 -> 13.78 ms, H = 8 / 32
21.05 -> 10.88, 27.76 -> 22.71. By count 556 TFLOP/s of products, three quarters of them over
A's zero rows: the kernel's time grows with H.
"""
from __future__ import annotations

import functools

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.ring import PRODUCER_WARPS, _release

__all__ = ["csa_dkv_blocks_kernel", "arg_types", "constexprs", "block_maps", "dkv_blocks",
           "fits"]

NUM_WARPS = 4                 # the default partition (the producer); 12 warps in all
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
def _a_half(a_smem, dsp_ptr, pos_b, p0, hi, h, J: gl.constexpr, JP: gl.constexpr,
            BNC: gl.constexpr, KAC: gl.constexpr):
    """cp.async of rows 64 h .. 64 h + 63 of a stage's A [BNC, KAC] (pairs p0 .., JP columns
    each): the dsp row posg names (zero-filled for -1, for pairs past hi and columns past J).
    With J a multiple of 8 one posg load per 16-byte vector (a [64, KAC // 8] load, widened
    to the copy layout: every 8 columns of a row come from one dsp row), else one per
    element."""
    la: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS.value, 1], [1, 0])
    if J % 8 == 0:
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [PRODUCER_WARPS.value, 1, 1],
                                            [2, 1, 0])
        lv: gl.constexpr = gl.SliceLayout(2, l3)
        rows = h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, lv))
        vcol = gl.arange(0, KAC // 8, layout=gl.SliceLayout(0, lv)) * 8
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        pa = p0 + vcol // JP
        j = vcol % JP
        live = (pa < hi) & (j < J)
        gr = gl.load(pos_b + pa.to(gl.int64)[None, :] * BNC + rows[:, None],
                     mask=live[None, :], other=-1)                       # [64, KAC // 8]
        off3 = gl.expand_dims(gr.to(gl.int64) * J + j[None, :], 2) + e[None, None, :]
        off = gl.convert_layout(off3.reshape([64, KAC]), la)
        off = gl.max_contiguous(gl.multiple_of(off, [1, 8]), [1, 8])
        ok3 = gl.expand_dims(gr >= 0, 2) & (e >= 0)[None, None, :]
        ok = gl.max_constancy(gl.convert_layout(ok3.reshape([64, KAC]), la), [1, 8])
        async_copy.async_copy_global_to_shared(a_smem, dsp_ptr + off, mask=ok)
    else:
        rows = h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, la))
        c = gl.arange(0, KAC, layout=gl.SliceLayout(0, la))
        pa = p0 + c // JP
        j = c % JP
        live = (pa < hi) & (j < J)
        gr = gl.load(pos_b + pa.to(gl.int64)[None, :] * BNC + rows[:, None],
                     mask=live[None, :], other=-1)
        async_copy.async_copy_global_to_shared(a_smem, dsp_ptr + gr.to(gl.int64) * J
                                               + j[None, :], mask=gr >= 0)


@gluon.jit
def _producer(posg_ptr, list_ptr, order_ptr, cnt_ptr, dsp_ptr, qdo_ptr, a_ring, b_ring, full,
              consumed, T: gl.constexpr, J: gl.constexpr, JP: gl.constexpr, TB: gl.constexpr,
              DP: gl.constexpr, DS: gl.constexpr, NSL: gl.constexpr, S: gl.constexpr,
              BNC: gl.constexpr, KAC: gl.constexpr, STAGES: gl.constexpr):
    # B [KAC, DS]: a warp covers DS columns of one row (DS // 8 threads), or several rows.
    lb: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DS // 8), DS // 8],
                                        [PRODUCER_WARPS.value, 1], [1, 0])
    blk, sl, _, lo, hi, nst = _program(order_ptr, cnt_ptr, NSL, S, TB)
    br = gl.arange(0, KAC, layout=gl.SliceLayout(1, lb))
    bc = gl.arange(0, DS, layout=gl.SliceLayout(0, lb))
    b_tb = br // JP
    b_j = br % JP
    pos_b = posg_ptr + blk.to(gl.int64) * (T * BNC)
    list_b = list_ptr + blk.to(gl.int64) * T
    for g in range(nst):
        s = g % STAGES
        p0 = lo + g * TB
        pb = p0 + b_tb
        b_live = (pb < hi) & (b_j < J)
        tok = gl.load(list_b + pb, mask=b_live, other=0)          # b*T + t (global token)
        if g >= STAGES:
            mbarrier.wait(consumed.index(s), ((g // STAGES) - 1) & 1)
        for h in gl.static_range(BNC // 64):
            _a_half(a_ring.index(s).slice(h * 64, 64), dsp_ptr, pos_b, p0, hi, h, J, JP, BNC,
                    KAC)
        bptrs = (qdo_ptr + (tok.to(gl.int64) * J + b_j)[:, None] * DP + sl * DS
                 + bc[None, :])
        async_copy.async_copy_global_to_shared(b_ring.index(s), bptrs, mask=b_live[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


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
        acc = warpgroup_mma_wait(0, deps=[acc])
        _release(consumed.index(s))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, DS, layout=gl.SliceLayout(0, acc_layout))
    out_row = (sp * NBT + blk) * BNC + 64 * W + rows
    gl.store(part_ptr + out_row.to(gl.int64)[:, None] * DP + sl * DS + cols[None, :], acc)


@gluon.jit
def csa_dkv_blocks_kernel(posg_ptr, list_ptr, order_ptr, cnt_ptr, dsp_ptr, qdo_ptr, part_ptr,
                          T: gl.constexpr, NBT: gl.constexpr, J: gl.constexpr,
                          JP: gl.constexpr, DP: gl.constexpr, DS: gl.constexpr,
                          S: gl.constexpr, STAGES: gl.constexpr, BNC: gl.constexpr,
                          KAC: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """posg [NBT, T, BN] i32 (global dsp row or -1), list [NBT, T] i32 (global token of each
    pair), order [NBT] i32 (blocks, longest list first), cnt [NBT] i32, dsp [B*T*Kp, J],
    qdo [B*T*J, DP] | part [S, NBT*BN, DP] f32. One program per (block in order, D slice,
    split): grid NBT * (DP // DS) * S. BNC = BN and KAC = KA (constexprs) are what the
    layouts are built for: two consumer warpgroups of 64 rows, a producer copy layout of 64
    columns."""
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
        (_producer, (posg_ptr, list_ptr, order_ptr, cnt_ptr, dsp_ptr, qdo_ptr, a_ring, b_ring,
                     full, consumed, T, J, JP, TB, DP, DS, NSL, S, BNC, KAC, STAGES)),
        (_consumer, (order_ptr, cnt_ptr, part_ptr, a_ring, b_ring, full, consumed, NBT, TB, DP,
                     DS, NSL, S, BNC, STAGES, 0)),
        (_consumer, (order_ptr, cnt_ptr, part_ptr, a_ring, b_ring, full, consumed, NBT, TB, DP,
                     DS, NSL, S, BNC, STAGES, 1)),
    ], [WG_WARPS, WG_WARPS], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side

# posg, list, order, cnt, dsp, qdo | part
ARG_TYPES = ("*i32", "*i32", "*i32", "*i32", "*{dt}", "*{dt}", "*fp32")


def arg_types(dt="bf16"):
    return [a.format(dt=dt) for a in ARG_TYPES]


def head_pad(H):
    """JP: 2 H padded to 16, 32 or 64 (a stage's KA = 64 columns hold KA // JP tokens)."""
    if not 1 <= H <= 32:
        raise ValueError(f"the block dkv kernel takes 1 <= H <= 32 heads, got H={H}")
    return max(16, 1 << (2 * H - 1).bit_length())


def constexprs(*, T, NBT, H, DP, splits=SPLITS, stages=STAGES):
    """The kernel's compile-time parameters (also used by the CPU compile checks)."""
    if DP < 64 or DP & (DP - 1):
        raise ValueError(f"the block dkv kernel needs D padded to a power of two >= 64, got "
                         f"{DP}")
    return dict(T=T, NBT=NBT, J=2 * H, JP=head_pad(H), DP=DP, DS=min(DS_MAX, DP), S=splits,
                STAGES=stages, BNC=BN, KAC=KA, CONSUMER_REGS=CONSUMER_REGS)


def num_blocks(N):
    """Blocks of BN kv rows covering N rows (the last one partial)."""
    return -(-N // BN)


def grid_size(NBT, DP, splits=SPLITS):
    return NBT * (DP // min(DS_MAX, DP)) * splits


def fits(B, T, N, Kp):
    """Whether posg [B*NB, T, BN] i32 stays under POS_LIMIT bytes and its entries, dsp rows
    (b T + t) Kp + k, fit in int32 (else the caller takes the per-slot path)."""
    return B * num_blocks(N) * T * BN * 4 <= POS_LIMIT and B * T * Kp < 2 ** 31


def block_maps(idx_p, N):
    """(posg [B*NB, T, BN] i32, lists [B*NB, T] i32, cnt [B*NB] i32, order [B*NB] i32, dup)
    of idx_p [B, T, Kp] (-1 for empty slots; every other id < N): see the module docstring.
    dup: a token lists some row twice (then posg holds only one of its slots)."""
    import jax.numpy as jnp
    B, T, Kp = idx_p.shape
    NB = num_blocks(N)
    NBT = B * NB
    i32 = jnp.int32
    valid = idx_p >= 0
    n = jnp.where(valid, idx_p, 0)
    b = jnp.arange(B, dtype=i32)[:, None, None]
    t = jnp.arange(T, dtype=i32)[None, :, None]
    k = jnp.arange(Kp, dtype=i32)[None, None, :]
    blk = jnp.where(valid, b * NB + n // BN, NBT)              # NBT: dropped below
    r = n % BN
    flag = jnp.zeros((NBT, T), i32).at[blk, t].set(1, mode="drop")
    rank = jnp.cumsum(flag, axis=1, dtype=i32) - 1              # a pair's place in its list
    cnt = rank[:, -1] + 1
    tt = jnp.broadcast_to(jnp.arange(T, dtype=i32)[None, :], (NBT, T))
    bb = jnp.broadcast_to(jnp.arange(NBT, dtype=i32)[:, None], (NBT, T))
    lists = jnp.zeros((NBT, T), i32).at[bb, jnp.where(flag > 0, rank, T)].set(
        (bb // NB) * T + tt, mode="drop")
    er = rank[jnp.minimum(blk, NBT - 1), jnp.broadcast_to(t, blk.shape)]
    grow = (b * T + t) * Kp + k                                 # the slot's dsp row
    posg = jnp.full((NBT, T, BN), -1, i32).at[blk, er, r].set(grow, mode="drop")
    back = posg[jnp.minimum(blk, NBT - 1), er, r]
    dup = jnp.any(valid & (back != grow))
    order = jnp.argsort(-cnt, stable=True).astype(i32)
    return posg, lists, cnt, order, dup


def dkv_blocks(dsp, qdo, maps, N, *, launch=None):
    """dkv [B, N, Dp] f32 from dsp [B, T, Kp, 2, H], qdo [B, T, 2, H, Dp] and maps = the
    first four of block_maps (whose dup must be False): the kernel above (launch: a stand-in
    with the kernel's signature, for the CPU test) and the fixed-order sum of its splits."""
    import jax.numpy as jnp
    B, T, Kp, _, H = dsp.shape
    Dp = qdo.shape[-1]
    posg, lists, cnt, order = maps
    NBT = posg.shape[0]
    consts = constexprs(T=T, NBT=NBT, H=H, DP=Dp)
    operands = (posg, lists, order, cnt, dsp.reshape(B * T * Kp, 2 * H),
                qdo.reshape(B * T * 2 * H, Dp))
    if launch is None:
        from csa_jax.kernels.gluon.adapter import gluon_call
        launch = functools.partial(
            gluon_call, kernel=csa_dkv_blocks_kernel,
            out_shape=jax.ShapeDtypeStruct((consts["S"], NBT * BN, Dp), jnp.float32),
            grid=(grid_size(NBT, Dp, consts["S"]),), num_warps=NUM_WARPS,
            name="csa_gluon_dkv_blocks")
    part = launch(*operands, **consts)
    dkv = part[0]
    for s in range(1, part.shape[0]):                           # fixed order
        dkv = dkv + part[s]
    return dkv.reshape(B, -1, Dp)[:, :N]
