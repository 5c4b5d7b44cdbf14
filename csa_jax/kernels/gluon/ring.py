"""What every Gluon CSA kernel shares: the program's place in the grid, the producer's gather
ring, the ring's barriers, the online-softmax step and the sink epilogue, and the host-side
padding of a forward's operands.

A row = 64 heads of one token (H = 128: two rows per token, side by side in the grid so their
repeated gathers hit L2), the structure of FlashMLA's SM90 sparse prefill; the dq kernel and the
AMD kernels run one row per program (_program), the NVIDIA forward one program per SM walking
rows (fwd.py, _row_info). For a row the producer (PRODUCER_WARPS = 4 warps) copies q [64, D]
into shared memory once (_load_q), then walks the token's slots in tiles of BK rows and gathers each tile's kv rows [BK, D] with 16-byte cp.async
(`async_copy_global_to_shared` from a pointer tensor, 8 threads per 128-byte row segment) into a
STAGES-deep shared-memory ring (the row ids one or two tiles ahead: _gather_tiles). Empty
slots (-1) are masked: zero-filled, never read from global
memory. Each producer thread arrives on the stage's "full" mbarrier when its copies land
(cp.async.mbarrier.arrive.noinc; barrier count = producer threads); before refilling a stage it
waits on its "consumed" mbarrier. The tile loop stops at the token's last non-empty tile
(ntiles from idx), so causally empty tails cost nothing.

Numerics (csa_spec.md section 3): exp2 domain, finite initial running max NEG = -1e30 (also
EMPTY_LSE), empty slots masked, the sink joined at the end (_finish); an empty row gives o = 0
and lse = sink or EMPTY_LSE.

Padding (host side, prepare): H to a multiple of 64 (padded heads have zero q and no sink; they
are computed and dropped; the few-heads kernel takes hp = H and pads in shared memory, _load_q),
D to a power of two >= 64 (zero columns change neither scores nor outputs), K to a multiple of
BK with -1.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from csa_jax.kernels.gluon.dims import HB, padded_dims

PRODUCER_WARPS = gl.constexpr(4)
CONSUMER_WARPS = 8           # the dq kernel's consumer partition: 2 warpgroups
LOG2E = 1.4426950408889634
NEG = gl.constexpr(-1.0e30)   # finite initial running max, and EMPTY_LSE


# The producer's copy layout: 8 threads cover one 128-byte segment of a row (16 B each),
# 4 rows per warp.
PRODUCER_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS.value, 1],
                                                [1, 0]))


@gluon.jit
def _copy_heads(src_ptr, dst_smem, row, D: gl.constexpr, HBC: gl.constexpr, HQ: gl.constexpr):
    """cp.async of head block `row` [HBC, D] of src (q or dO) into dst_smem. HQ = the heads src
    holds per row in memory (rows row*HQ .. of the [B*T*HQ, D] view): HQ = HBC, or fewer (the
    few-heads kernels at H = 8 or 24: q is not padded in memory; heads HQ .. HBC-1 are
    zero-filled in shared memory)."""
    layout: gl.constexpr = PRODUCER_LAYOUT
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, layout))
    if HQ == HBC:
        ptrs = src_ptr + (row * HBC + hrows).to(gl.int64)[:, None] * D + cols[None, :]
        async_copy.async_copy_global_to_shared(dst_smem, ptrs)
    else:
        live = hrows < HQ
        rows = row * HQ + gl.where(live, hrows, 0)
        ptrs = src_ptr + rows.to(gl.int64)[:, None] * D + cols[None, :]
        async_copy.async_copy_global_to_shared(dst_smem, ptrs, mask=live[:, None])


@gluon.jit
def _load_q(q_ptr, q_smem, q_bar, row, D: gl.constexpr, HBC: gl.constexpr, HQ: gl.constexpr,
            do_ptr):
    """q [HBC, D] of head block `row` into q_smem with cp.async (_copy_heads), each producer
    thread arriving on q_bar when its copies land. With do_ptr (the few-heads dq kernel,
    small_heads_dq.py; None for the forwards) q_smem is [2*HBC, D]: q's rows, then dO's."""
    if do_ptr is None:
        _copy_heads(q_ptr, q_smem, row, D, HBC, HQ)
    else:
        _copy_heads(q_ptr, q_smem.slice(0, HBC), row, D, HBC, HQ)
        _copy_heads(do_ptr, q_smem.slice(HBC, HBC), row, D, HBC, HQ)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)


@gluon.jit
def _tile_ids(idx_ptr, i, K: gl.constexpr, BK: gl.constexpr):
    """Tile i's BK row ids (-1 past K), in the producer's copy layout."""
    r = i * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, PRODUCER_LAYOUT))
    return gl.load(idx_ptr + r, mask=r < K, other=-1)


@gluon.jit
def _gather_tiles(kv_ptr, idx_ptr, ring, full, consumed, base, b, start, stop, ids, ids2,
                  N: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                  STAGES: gl.constexpr, AHEAD: gl.constexpr):
    """Tiles start .. stop-1 of a row into the ring: tile i is number base + i of the program's
    tile stream (its stage and barrier phases); each stage is refilled once its "consumed"
    barrier completed for the stream's previous use of it. ids / ids2: tiles start's and
    start+1's row ids, loaded beforehand (_tile_ids; ids2 unused at AHEAD = 1). AHEAD = 1: the
    next tile's ids are loaded once this tile's copies are issued; AHEAD = 2: before, for the
    tile after next, so a tile's copies never wait on an idx load (measured on the H200: a
    producer-only ring gathers at 8.2 instead of 6.4 TB/s; docs/perf/heads_h200.md). Returns
    the (ids, ids2) of tiles stop, stop+1, for a caller that goes on with the same row."""
    layout: gl.constexpr = PRODUCER_LAYOUT
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    for i in range(start, stop):
        g = base + i
        s = g % STAGES
        valid = ids >= 0
        safe = gl.where(valid, ids, 0)
        ptrs = kv_base + safe.to(gl.int64)[:, None] * D + cols[None, :]
        if AHEAD == 2:
            ids = ids2
            ids2 = _tile_ids(idx_ptr, i + 2, K, BK)
        if g >= STAGES:
            mbarrier.wait(consumed.index(s), ((g // STAGES) - 1) & 1)
        # (Triton 3.6 drops eviction_policy on cp.async: the PTX carries no L2 cache hint.)
        async_copy.async_copy_global_to_shared(ring.index(s), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)
        if AHEAD == 1:
            ids = _tile_ids(idx_ptr, i + 1, K, BK)
    return ids, ids2


@gluon.jit
def _produce_row(q_ptr, kv_ptr, idx_tok, q_smem, ring, full, consumed, q_bar, q_free, row, n,
                 base, b, ntiles, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
                 HQ: gl.constexpr, PRE: gl.constexpr, AHEAD: gl.constexpr, do_ptr):
    """A persistent producer's row n (head block `row`): the row's first PRE (<= STAGES) tiles
    (their stages free up as the previous row's last tiles are consumed), then q once the
    consumers released the previous row's (q_free, after their last read of it), then the
    other tiles (row ids AHEAD tiles ahead: _gather_tiles). So the next row's first tiles are
    in flight while the consumers finish this one, and q is not queued behind more than PRE
    tiles; no deadlock: every wait is for a release the consumers make with what they already
    have. HQ: q's heads per row in memory (_copy_heads); do_ptr: dO's rows too (_load_q; None
    for the forwards)."""
    pre = gl.minimum(ntiles, PRE)
    ids = _tile_ids(idx_tok, 0, K, BK)
    ids2 = ids
    if AHEAD == 2:
        ids2 = _tile_ids(idx_tok, 1, K, BK)
    ids, ids2 = _gather_tiles(kv_ptr, idx_tok, ring, full, consumed, base, b, 0, pre, ids, ids2,
                              N, D, K, BK, STAGES, AHEAD)
    if n >= 1:
        mbarrier.wait(q_free, (n - 1) & 1)
    _load_q(q_ptr, q_smem, q_bar, row, D, HBC, HQ, do_ptr)
    if AHEAD == 1:
        # reloaded after q: the order the 64-head kernel was measured with
        ids = _tile_ids(idx_tok, pre, K, BK)
    _gather_tiles(kv_ptr, idx_tok, ring, full, consumed, base, b, pre, ntiles, ids, ids2, N, D,
                  K, BK, STAGES, AHEAD)


@gluon.jit
def _softmax_step(sc, ids, m, l, QK_SCALE: gl.constexpr):
    """One online-softmax step in the exp2 domain: (p, alpha, m_new, l_new)."""
    sc = gl.where((ids >= 0)[None, :], sc * QK_SCALE, float("-inf"))
    m_new = gl.maximum(m, gl.max(sc, axis=1))
    p = gl.exp2(sc - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, alpha, m_new, l * alpha + gl.sum(p, axis=1)


@gluon.jit
def _row_info(ntiles_ptr, idx_ptr, row, T: gl.constexpr, NHB: gl.constexpr, K: gl.constexpr):
    """(tok, hb, b, ntiles, idx_tok) of head block `row` of the [B*T*NHB] head blocks (head
    block fastest: rows row*64.. of q / o): its token, head block, batch, tiles up to the
    last non-empty slot and the token's K slots."""
    tok = row // NHB
    return tok, row % NHB, tok // T, gl.load(ntiles_ptr + tok), idx_ptr + tok.to(gl.int64) * K


@gluon.jit
def _ntiles_of(ntiles_ptr, row, ROWS: gl.constexpr, NHB: gl.constexpr):
    """ntiles of head block `row` (0 past the last row): a persistent program loads the next
    row's count while it runs this one, so no row starts on a global load's latency."""
    return gl.load(ntiles_ptr + row // NHB, mask=row < ROWS, other=0)


@gluon.jit
def _program(ntiles_ptr, idx_ptr, T: gl.constexpr, NHB: gl.constexpr, K: gl.constexpr):
    """(row, tok, hb, b, ntiles, idx_tok) of a program that runs one head block, row =
    program_id (_row_info). Used by the dq kernel (bwd.py) and the AMD kernels."""
    row = gl.program_id(0)
    tok, hb, b, ntiles, idx_tok = _row_info(ntiles_ptr, idx_ptr, row, T, NHB, K)
    return row, tok, hb, b, ntiles, idx_tok


@gluon.jit
def _finish(m, l, sink_ptrs):
    """Join the sink (natural-log logits, converted to the exp2 domain) to the running (m, l):
    (lse, o_scale) per csa_spec.md section 3: natural-log lse, EMPTY_LSE (NEG) and o = 0 for an
    empty row without sink. Shared by the NVIDIA and AMD forwards (amd_fwd.py)."""
    return _finish_sink(m, l, gl.load(sink_ptrs))


@gluon.jit
def _finish_sink(m, l, sink):
    """_finish with the sink logits already loaded (a persistent program loads them once)."""
    sink2 = sink * 1.4426950408889634
    m_tot = gl.maximum(m, sink2)
    l_tot = l * gl.exp2(m - m_tot) + gl.exp2(sink2 - m_tot)
    nonempty = l_tot > 0
    safe_l = gl.where(nonempty, l_tot, 1.0)
    lse = gl.where(nonempty, (m_tot + gl.log2(safe_l)) * 0.6931471805599453, NEG)
    return lse, gl.where(nonempty, gl.exp2(m - m_tot) / safe_l, 0.0)


@gluon.jit
def _release(bar):
    # Every consumer warp of this partition is past its reads of the stage, then one arrival.
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _wait_tile(ring, full, i, STAGES: gl.constexpr):
    """(stage, ring tile) of tile i once its copies landed, made visible to wgmma."""
    s = i % STAGES
    mbarrier.wait(full.index(s), (i // STAGES) & 1)
    fence_async_shared()          # cp.async (generic proxy) -> wgmma (async proxy)
    return s, ring.index(s)


# ----------------------------------------------------------------------------- host side

# q, kv, idx, ntiles, sink | o, lse
ARG_TYPES = ("*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*{dt}", "*fp32")


def arg_types(dt="bf16"):
    """The forward kernels' argument types (fwd.py's and amd_fwd.py's)."""
    return [a.format(dt=dt) for a in ARG_TYPES]


def _pad(x, axis, size, v=0):
    import jax.numpy as jnp
    if x.shape[axis] == size:
        return x
    return jnp.pad(x, [(0, size - x.shape[a]) if a == axis else (0, 0) for a in range(x.ndim)],
                   constant_values=v)


def prepare(q, kv, idx, sink, bk, hp=None):
    """The padded operands of a forward kernel (fwd.py's, small_heads.py's and amd_fwd.py's) and
    its dims: (q [B*T*Hp, Dp], kv [B*N, Dp], idx [B*T, Kp] (-1 padding), ntiles [B*T], sink [Hp]
    (-inf padding), (B, T, H, D, N, Hp, Dp, Kp, NHB)). ntiles = tiles up to the last non-empty
    slot. Hp = hp, or H to a multiple of 64 (NHB = Hp // 64, 1 if Hp < 64)."""
    import jax.numpy as jnp
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    Hp, Dp, Kp = padded_dims(H, D, K, bk)
    Hp = hp or Hp
    idx_p = _pad(idx, 2, Kp, -1)
    j = jnp.arange(Kp, dtype=jnp.int32)
    used = jnp.max(jnp.where(idx_p >= 0, j, -1), axis=2) + 1
    ntiles = ((used + bk - 1) // bk).astype(jnp.int32).reshape(B * T)
    q_p = _pad(_pad(q, 3, Dp), 2, Hp).reshape(B * T * Hp, Dp)
    kv_p = _pad(kv, 2, Dp).reshape(B * N, Dp)
    sink_p = _pad(sink.astype(jnp.float32), 0, Hp, -jnp.inf)
    return (q_p, kv_p, idx_p.reshape(B * T, Kp), ntiles, sink_p,
            (B, T, H, D, N, Hp, Dp, Kp, max(1, Hp // HB)))


def out_shapes(q, dims):
    """o [B*T*Hp, Dp] in q's dtype and lse [B*T*Hp] f32: a forward kernel's outputs."""
    import jax
    import jax.numpy as jnp
    B, T, _, _, _, Hp, Dp, _, _ = dims
    return [jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
            jax.ShapeDtypeStruct((B * T * Hp,), jnp.float32)]


def unpad(o, lse, dims):
    """o [B, T, H, D], lse [B, T, H] from the kernel's padded outputs."""
    B, T, H, D, _, Hp, Dp, _, _ = dims
    return o.reshape(B, T, Hp, Dp)[:, :, :H, :D], lse.reshape(B, T, Hp)[:, :, :H]
