"""Exact top-k of the indexer's scores by a threshold select in one Pallas Triton kernel (issue 17).

XLA runs `lax.top_k(scores, 512)` over [T, P] f32 as a full sort of every row (its sort kernels,
band by band in indexer_topk's "prefix" mode): ~0.48 ms per `small` cr4 layer at T = 8192 on the
H200, for 64 MB of scores. Here one program owns `rows` tokens' whole score rows in registers:

  1. each score becomes an int32 key whose signed order is f32's total order (-0.0 < +0.0, as
     lax.top_k orders them): key = bits ^ ((bits >> 31) & 0x7fffffff);
  2. the k-th largest key per row by a bitwise search: 32 passes of count(key >= candidate)
     (kk = min(k, visible rows); invisible rows are -inf and never taken);
  3. the rows above that threshold, plus the first (kk - count above) rows equal to it by id
     (lax.top_k's tie rule: the lower id first), are written in id order to slots 0..kk-1 of the
     token's output (their keys too) by an inclusive cumsum of the selection mask; slots kk..k-1
     get -1 ids / INT32_MIN keys from the first unselected rows.
select_topk then orders each token's k selected (key, id) pairs by one XLA sort on
(~key, id): descending score, ties by the lower id: the same ids, in the same order, as
lax.top_k over the whole row, with -1 where fewer than k rows are visible. The sort is over k
slots per token instead of the visible rows (up to P).

Measured in the `small` step on the H200 (T = 8192, P = 2048, k = 512; docs/perf/train_h200.md,
branch train4b at 311d332, 2026-12-01): this kernel 0.166 ms and the sort 0.224 ms per cr4 layer, against 0.484 ms for the
prefix bands' lax.top_k. Untried: several tokens per program (ROWS), ordering the k in-kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from csa_jax import blockmath
from csa_jax.kernels.triton.config import (PLATFORMS, _device_kind, _is_amd, _is_pow2,
                                           _next_pow2, _params, quiet_lowering)

__all__ = ["on_nvidia", "select_topk", "supported"]

ROWS = 1            # tokens per program (default)
NUM_WARPS = 4
MAX_ELEMS = 8192    # rows * P scores held in registers by one program, at most
_INT_MIN = -(2 ** 31)


def supported(shape, k, rows=ROWS) -> str | None:
    """Why select_topk does not take scores of this [B, T, P] shape and k (None = it does)."""
    if len(shape) != 3:
        return f"scores shape {tuple(shape)}: the kernel takes [B, T, P]"
    _, T, P = shape
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= P:
        return f"k={k!r}: must be an int in [1, P={P}]"
    if not _is_pow2(rows) or T % rows:
        return f"T={T}, rows={rows}: rows must be a power of two dividing T"
    if rows * _next_pow2(P) > MAX_ELEMS:
        return (f"rows * P = {rows * _next_pow2(P)} (P={P} padded to a power of two) > "
                f"{MAX_ELEMS} scores held by one program")
    return None


def on_nvidia() -> bool:
    """Whether the default device is an NVIDIA GPU (where indexer_topk's select="auto" may run
    the kernel: it was measured there; elsewhere it would run interpreted)."""
    platform, kind = _device_kind()
    return platform in PLATFORMS and not _is_amd(platform, kind) and "nvidia" in kind.lower()


def _sort_key(score):
    """int32 keys whose signed order is the total order of the f32 scores."""
    bits = lax.bitcast_convert_type(score, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


_NEG_INF_KEY = int(np.float32(-np.inf).view(np.int32)) ^ 0x7FFFFFFF    # the key of -inf


def _kernel(s_ref, ids_ref, keys_ref, *, k, rows, P):
    # s_ref [rows, P] f32; ids_ref / keys_ref [rows, 2k] int32: slots 0..k-1 are written
    key = _sort_key(s_ref[...])                           # [rows, P] int32
    live = key > _NEG_INF_KEY
    kk = jnp.minimum(jnp.sum(live.astype(jnp.int32), axis=1), k)               # [rows]

    def count_ge(v):
        return jnp.sum((key >= v[:, None]).astype(jnp.int32), axis=1)

    # the largest v with count(key >= v) >= kk, sign bit first, then bits 30..0
    thr = jnp.where(count_ge(jnp.zeros((rows,), jnp.int32)) >= kk, 0, _INT_MIN)

    def bit(i, thr):
        cand = thr | (jnp.int32(1) << (30 - i))
        return jnp.where(count_ge(cand) >= kk, cand, thr)

    thr = lax.fori_loop(0, 31, bit, thr.astype(jnp.int32))
    above = key > thr[:, None]
    quota = kk - jnp.sum(above.astype(jnp.int32), axis=1)                     # ties to take
    tie = key == thr[:, None]
    tie_rank = jnp.cumsum(tie.astype(jnp.int32), axis=1)                     # 1-based
    sel = live & (above | (tie & (tie_rank <= quota[:, None])))
    n_before = jnp.cumsum(sel.astype(jnp.int32), axis=1)                    # inclusive
    col = lax.broadcasted_iota(jnp.int32, (rows, P), 1)
    row = lax.broadcasted_iota(jnp.int32, (rows, P), 0)
    # Every one of a token's slots 0..k-1 gets exactly one writer: the kk selected rows in id
    # order (slot = selected rows before them), then the first k - kk unselected rows (an empty
    # slot each: id -1, key INT32_MIN). The other lanes are masked; their address is kept inside
    # the block's unused half [k, 2k), so the interpreter (which writes a masked lane's old value
    # back) never touches slots 0..k-1 through them.
    free = col - n_before                                 # unselected rows before (unselected)
    fill = ~sel & (free < (k - kk)[:, None])
    slot = jnp.where(sel, n_before - 1, jnp.where(fill, kk[:, None] + free, k + col % k))
    write = sel | fill
    pltriton.store(ids_ref.at[row, slot], jnp.where(sel, col, -1), mask=write)
    pltriton.store(keys_ref.at[row, slot], jnp.where(sel, key, _INT_MIN), mask=write)


@functools.partial(jax.jit, static_argnames=("k", "rows", "num_warps", "interpret"))
def _select(scores, *, k, rows, num_warps, interpret):
    B, T, P = scores.shape
    nt = T // rows

    def smap(i):
        return i // nt, i % nt, 0

    out_spec = pl.BlockSpec((None, rows, 2 * k), smap)
    ids, keys = pl.pallas_call(
        functools.partial(_kernel, k=k, rows=rows, P=P),
        grid=(B * nt,),
        in_specs=[pl.BlockSpec((None, rows, P), smap)],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((B, T, 2 * k), jnp.int32)] * 2,
        compiler_params=_params(num_warps, 1),
        interpret=interpret,
        name="csa_triton_topk_select",
    )(scores.astype(jnp.float32))
    return ids[:, :, :k], keys[:, :, :k]


SORTS = ("pair", "stable")


def select_topk(scores, k, *, rows=ROWS, num_warps=NUM_WARPS, interpret=None, ordered=True,
                sort="pair"):
    """int32 [B, T, k]: lax.top_k(scores, k)'s ids (descending score, ties by the lower id), -1
    where the score is -inf; scores [B, T, P] f32 with -inf at invisible rows. P and k that are
    not powers of two run padded (scores with -inf columns, k up to the next power of two).

    ordered=False returns the selected ids in id order (the same set; -1 after them) without the
    final sort. sort: how the k selected are ordered, "pair" (lax.sort on (~key, id), two keys)
    or "stable" (a stable sort on ~key alone: the kernel writes them in id order); the same
    result."""
    if sort not in SORTS:
        raise ValueError(f"sort={sort!r} must be one of {SORTS}")
    why = supported(scores.shape, k, rows)
    if why:
        raise ValueError(f"top-k select kernel: {why}")
    P, kp = scores.shape[2], _next_pow2(k)       # the kernel's widths: powers of two
    if _next_pow2(P) != P:
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, _next_pow2(P) - P)),
                         constant_values=-jnp.inf)
    with quiet_lowering():
        ids, keys = _select(scores, k=kp, rows=rows, num_warps=num_warps,
                            interpret=blockmath.resolve_interpret(interpret, PLATFORMS))
    if not ordered:
        if kp != k:
            raise ValueError(f"ordered=False needs k a power of two, got k={k}")
        return ids
    if sort == "stable":
        _, ids = lax.sort((jnp.invert(keys), ids), dimension=2, num_keys=1, is_stable=True)
    else:
        _, ids = lax.sort((jnp.invert(keys), ids), dimension=2, num_keys=2)
    return ids[:, :, :k]

