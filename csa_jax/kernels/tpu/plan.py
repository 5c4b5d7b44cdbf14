"""Static geometry of a TPU launch (_Plan), the kernels' input preparation and MXU products."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm


# ----------------------------------------------------------------------------- MXU products

def _dot_nt(a, b, precision):
    """a [M, X] . b [N, X] -> [M, N] f32 (contract the last dims; b is never transposed)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b, precision):
    """a [X, M] . b [X, N] -> a^T b [M, N] f32, as a transposed-operand dot (contract dim 0)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)



# ----------------------------------------------------------------------------- geometry

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static geometry of one launch (Python ints only)."""
    t: int          # tokens T
    t_pad: int      # T padded to block_t
    h: int
    d: int
    n: int          # kv rows N
    n_pad: int      # rows of the kv operand (pool moved to pool_base, tail padded so that
                    # contiguous tiles never read past the end)
    bt: int         # block_t
    bk: int         # block_k
    depth: int
    n_w: int        # window tiles per program, at most (0: no window reuse)
    n_pm: int       # pool tiles per program, at most (cr128 only)
    n_kg: int       # gathered tiles per token
    g_off: int      # first gathered slot of idx
    window: int
    ratio: int      # cr128 pool ratio
    pool_rows: int  # N - T (cr128)
    rows_ring: bool  # ring [depth, bk, 1, D] over a kv operand [B, Np, 1, D] (any row is a
                     # DMA target: layouts that gather); else [depth, bk, D] over [B, Np, D]
    align: int      # window / pool tile starts are multiples of this (the kv dtype's sublane
                    # tile on a [.., bk, D] ring; 1 on a rows ring, which has no such rule)
    pool_base: int  # kv operand row of pool row 0 (T rounded up to align)

    @property
    def nb(self):
        return self.t_pad // self.bt

    @property
    def n_struct(self):
        return self.n_w + self.n_pm


def sublane_tile(dtype) -> int:
    """Rows of one (sublane, 128) VMEM tile of dtype: 8 for 32-bit, 16 for bf16 (2 rows per
    32-bit word). Mosaic slices and DMAs a tiled [.., rows, D] buffer only at multiples of it."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def win_start(t0, plan, maximum=max):
    """First kv row of token block t0's window tiles: the window union starts at
    max(t0 - window + 1, 0), rounded down to plan.align (rows before the union are masked).
    Python ints, or traced with maximum=jnp.maximum."""
    return maximum(t0 - plan.window + 1, 0) // plan.align * plan.align


def struct_tiles(plan, i, traced=False):
    """(window tiles, pool tiles) that block i streams: Python ints, or traced ones."""
    mx, mn = (jnp.maximum, jnp.minimum) if traced else (max, min)
    t0 = i * plan.bt
    n_win = bm.num_tiles(t0 + plan.bt - win_start(t0, plan, mx), plan.bk) if plan.n_w else 0
    n_pool = (bm.num_tiles(mn((t0 + plan.bt) // plan.ratio, plan.pool_rows), plan.bk)
              if plan.n_pm else 0)
    return n_win, n_pool


def _make_plan(q_shape, n, k, config, dtype):
    """The geometry of a launch for q [B, T, H, D], N kv rows of `dtype`, K slots."""
    _, t, h, d = q_shape
    bt, bk = config.block_t, config.block_k
    t_pad = bm.round_up(t, bt)
    layout, w = config.layout, config.window
    if layout != "generic" and k < w:
        raise ValueError(f"layout={layout!r} needs K >= window, got K={k}, window={w}")
    if layout == "cr128" and n - t < t // config.pool_ratio:
        raise ValueError(f"layout='cr128' needs N - T >= T // pool_ratio pool rows, got N={n}, "
                         f"T={t}, pool_ratio={config.pool_ratio}")
    rows_ring = layout in ("generic", "cr4")
    align = 1 if rows_ring else sublane_tile(dtype)
    if bk % align:
        raise ValueError(f"layout={layout!r} with {jnp.dtype(dtype).name} kv needs "
                         f"Config.block_k={bk} to be a multiple of {align} (contiguous tiles "
                         f"start at multiples of the sublane tile)")
    g_off = w if layout == "cr4" else 0
    gathered = {"generic": k, "cr4": k - w}.get(layout, 0)      # slots gathered per token
    pool_base = bm.round_up(t, align) if layout == "cr128" else t
    plan = _Plan(t=t, t_pad=t_pad, h=h, d=d, n=n, n_pad=n, bt=bt, bk=bk, depth=config.depth,
                 n_w=int(layout != "generic"), n_pm=int(layout == "cr128"),
                 n_kg=bm.num_tiles(gathered, bk), g_off=g_off, window=w,
                 ratio=config.pool_ratio, pool_rows=n - t, rows_ring=rows_ring, align=align,
                 pool_base=pool_base)
    # the most tiles any block streams (struct_tiles reads n_w, n_pm as on / off flags here)
    n_w, n_pm = (max(c) for c in zip(*(struct_tiles(plan, i) for i in range(plan.nb))))
    n_pad = n + pool_base - t
    if n_w:
        n_pad = max(n_pad, t_pad + n_w * bk)
    if n_pm:
        n_pad = max(n_pad, pool_base + n_pm * bk)
    return dataclasses.replace(plan, n_w=n_w, n_pm=n_pm, n_pad=n_pad)


# ----------------------------------------------------------------------------- kernel inputs

def _gathered_idx(idx, plan, k_g):
    """The gathered part of idx, [B, Tp, k_g] with -1 padding (k_g a multiple of block_k)."""
    g = idx[:, :, plan.g_off:plan.g_off + k_g]
    return jnp.pad(g, ((0, 0), (0, plan.t_pad - plan.t), (0, k_g - g.shape[-1])),
                   constant_values=-1)


def _valid_tiles(idx_g, block_k):
    """[B, Tp, Kg] -> [B, Tp * n_kg, 1, block_k] int32 mask, one row per gathered step."""
    b, t, k = idx_g.shape
    return (idx_g >= 0).astype(jnp.int32).reshape(b, t * (k // block_k), 1, block_k)


def token_blocks_spec(plan, tail=(), offset=False):
    """BlockSpec of program (b, i)'s token block of a [B, nb, bt, H] (token_rows) array, or of
    [B, Tp*H, D] token rows (tail=(D,): block [bt*H, D]): block i, or with `offset` block
    b0 + i, b0 the first scalar-prefetch operand (a backward launch's first block: a runtime
    value, so every launch runs the same compiled kernel)."""
    def blk(i, pre):
        return pre[0][0] + i if offset else i
    if tail:
        return pl.BlockSpec((None, plan.bt * plan.h) + tail,
                            lambda b, i, *pre: (b, blk(i, pre), 0))
    return pl.BlockSpec((None, None, plan.bt, plan.h), lambda b, i, *pre: (b, blk(i, pre), 0, 0))


def _flat_tokens(x, plan):
    """[B, T, H, ...] -> [B, Tp*H, ...] (pad T; rows of one token are H consecutive rows)."""
    pad = [(0, 0), (0, plan.t_pad - plan.t)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad)
    return x.reshape((x.shape[0], plan.t_pad * plan.h) + x.shape[3:])


def token_rows(x, plan):
    """[B, T, H] f32 per-(token, head) values (lse, dlse) -> [B, nb, bt, H]: one [bt, H] block
    per program, lane-dense in HBM (a [T*H, 1] column is padded to 128 lanes there: 1 GiB per
    column at Pro T = 16384). Kernels turn it into their [bt*H, 1] column with rows_to_col."""
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, plan.t_pad - plan.t), (0, 0)))
    return x.reshape(x.shape[0], plan.nb, plan.bt, plan.h)


def _eye(h):
    return (lax.broadcasted_iota(jnp.int32, (h, h), 0)
            == lax.broadcasted_iota(jnp.int32, (h, h), 1))


def rows_to_col(rows, col_ref, h):
    """rows [bt, H] (a token_rows block) -> col_ref [bt*H, 1] (row t*H + j = rows[t, j]): per
    token, the diagonal of its row broadcast over H sublanes, by a select and a lane sum of
    one value and zeros (exact; no lane-to-sublane reshape, which Mosaic does not lower)."""
    e = _eye(h)
    for t in range(rows.shape[0]):
        col_ref[t * h:(t + 1) * h, :] = jnp.sum(jnp.where(e, rows[t:t + 1, :], 0.0), axis=1,
                                                keepdims=True)


def col_to_rows(col, rows_ref, h):
    """The inverse: col [bt*H, 1] -> rows_ref [bt, H], by a select and a sublane sum."""
    e = _eye(h)
    for t in range(rows_ref.shape[0]):
        rows_ref[t:t + 1, :] = jnp.sum(jnp.where(e, col[t * h:(t + 1) * h, :], 0.0), axis=0,
                                       keepdims=True)


def kv_operand(kv, plan):
    """kv [B, N, D] as the kernels read it: cr128's pool moved to row pool_base (aligned), the
    tail padded to n_pad rows, and [B, Np, 1, D] for a rows ring (one row per VMEM tile, so a
    single-row DMA lands anywhere in the ring; bf16 rows are otherwise packed in pairs)."""
    if plan.pool_base != plan.t:
        kv = jnp.concatenate([kv[:, :plan.t], jnp.zeros((kv.shape[0], plan.pool_base - plan.t,
                                                         kv.shape[2]), kv.dtype),
                              kv[:, plan.t:]], axis=1)
    if plan.n_pad > kv.shape[1]:
        kv = jnp.pad(kv, ((0, 0), (0, plan.n_pad - kv.shape[1]), (0, 0)))
    return kv[:, :, None, :] if plan.rows_ring else kv


def ring_scratch(plan, dtype):
    """The ring's VMEM scratch and its DMA semaphores."""
    shape = (plan.depth, plan.bk, 1, plan.d) if plan.rows_ring else (plan.depth, plan.bk, plan.d)
    return [pltpu.VMEM(shape, dtype), pltpu.SemaphoreType.DMA((plan.depth,))]


def _gather_inputs(idx, plan, blocks=None):
    """The gathered part of idx as kernel inputs: (idx blocks [B, nb, 1, bt*k_g], their SMEM
    BlockSpec, valid tiles [B, Tp*n_kg, 1, bk] with their BlockSpec, k_g slots per token);
    small dummies when nothing is gathered (cr0 / cr128), so the kernel signature is fixed.
    Each program gets only its own block's index list in SMEM (a few KiB), not all of idx.
    `blocks` = (first, count): only those token blocks (a backward launch), indexed from 0."""
    bsz, bt, bk = idx.shape[0], plan.bt, plan.bk
    b0, nb = blocks or (0, plan.nb)
    if plan.n_kg == 0:
        idx_b, valid, k_g, v_rows = (jnp.zeros((bsz, nb, 1, 1), jnp.int32),
                                     jnp.zeros((bsz, nb, 1, bk), jnp.int32), 0, 1)
    else:
        k_g = plan.n_kg * bk
        idx_g = _gathered_idx(idx, plan, k_g)[:, b0 * bt:(b0 + nb) * bt]
        idx_b, valid, v_rows = (idx_g.reshape(bsz, nb, 1, bt * k_g),
                                _valid_tiles(idx_g, bk), bt * plan.n_kg)
    # [.., 1, L] so the block's last two dims are the array's (a TPU block-shape rule)
    idx_spec = pl.BlockSpec((None, None, 1, idx_b.shape[-1]), lambda b, i, *_: (b, i, 0, 0),
                            memory_space=pltpu.SMEM)
    valid_spec = pl.BlockSpec((None, v_rows, 1, bk), lambda b, i, *_: (b, i, 0, 0))
    return (idx_b, idx_spec), (valid, valid_spec), k_g
