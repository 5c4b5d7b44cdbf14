"""Index lists: which kv rows each query attends to (csa_spec.md section 4).

kv = [token rows ; pool rows]; per token the list is [window | pool]; -1 marks an empty slot.
Every builder here is traceable (T and ratio are static Python ints).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from csa_jax.config import check_ratio


def _check_len(T, name="T"):
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={T!r}")
    return int(T)


def window_indices(T: int, window: int = 128):
    """[T, window] int32: slot j of token t is row t - window + 1 + j, or -1 when negative."""
    T = _check_len(T)
    window = _check_len(window, "window")
    t = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = jnp.arange(window, dtype=jnp.int32)[None, :]
    rows = t - window + 1 + j
    return jnp.where(rows >= 0, rows, -1)


def pool_indices(T: int, ratio: int):
    """[T, T // ratio] int32: slot p of token t is pool row p if p < (t + 1) // ratio, else -1.

    Pool-local ids (add T to address kv). Row p summarises tokens up to (p+1)*ratio - 1, so it
    becomes visible to the last token of its own group.
    """
    T = _check_len(T)
    check_ratio(ratio, allow_zero=False)
    P = T // ratio
    t = jnp.arange(T, dtype=jnp.int32)[:, None]
    p = jnp.arange(P, dtype=jnp.int32)[None, :]
    return jnp.where(p < (t + 1) // ratio, p, -1)


def build_indices(T: int, ratio: int, *, window: int = 128, pool_topk=None):
    """The full [window | pool] list of a layer, as kv row ids (pool rows offset by T).

    ratio 0: window only, [T, window].
    ratio 4: window + pool_topk + T, where pool_topk are the indexer's pool-local ids, [B, T, k]
             (or [T, k]); -1 stays -1. Returns [B, T, window + k] (or [T, window + k]).
             indexer_topk returns k = min(topk, T // 4) ids (top-k is clipped to the pool), so
             the list is [B, T, window + 512] for topk=512 only when T // 4 >= 512.
    other ratios (>= 2): window + pool_indices(T, ratio) + T, [T, window + T // ratio].

    sparse_attention takes idx [B, T, K]: broadcast a [T, K] list over the batch first,
    `jnp.broadcast_to(idx, (B, *idx.shape))`.
    """
    T = _check_len(T)
    check_ratio(ratio)
    win = window_indices(T, window)
    if ratio == 4:
        if pool_topk is None:
            raise ValueError("ratio=4 needs pool_topk (the indexer's top-k pool ids, [B, T, k])")
        pool_topk = jnp.asarray(pool_topk)
        if not jnp.issubdtype(pool_topk.dtype, jnp.integer):
            raise TypeError(f"pool_topk must be an integer array, got dtype={pool_topk.dtype}")
        if pool_topk.ndim not in (2, 3) or pool_topk.shape[-2] != T:
            raise ValueError(f"pool_topk must be [B, T, k] or [T, k] with T={T}, "
                             f"got shape {tuple(pool_topk.shape)}")
        pool = jnp.where(pool_topk >= 0, pool_topk.astype(jnp.int32) + T, -1)
        win = jnp.broadcast_to(win, pool.shape[:-1] + (window,))
        return jnp.concatenate([win, pool], axis=-1)
    if pool_topk is not None:
        raise ValueError(f"pool_topk is only used with ratio=4, got ratio={ratio}")
    if ratio == 0:
        return win
    pool = pool_indices(T, ratio)
    pool = jnp.where(pool >= 0, pool + T, -1)
    return jnp.concatenate([win, pool], axis=-1)


def validate_indices(idx, num_kv: int):
    """Eager check of an index list: every value must be -1 (empty) or in [0, num_kv).

    Raises TypeError for a non-integer array and ValueError naming the first bad slot. Returns
    idx unchanged so it can be used inline. (sparse_attention itself treats any out-of-range id as
    an empty slot; this is for callers who want such ids to be an error.)
    """
    num_kv = _check_len(num_kv, "num_kv")
    try:
        arr = np.asarray(idx)
    except Exception as e:  # a tracer: this check needs concrete values
        raise TypeError("validate_indices needs a concrete array (call it outside jit)") from e
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"idx must be an integer array, got dtype={arr.dtype}")
    bad = (arr < -1) | (arr >= num_kv)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"idx{list(pos)} = {int(arr[pos])} is outside [-1, {num_kv}) "
                         f"(num_kv={num_kv}; {int(bad.sum())} bad slot(s) in all)")
    return idx
