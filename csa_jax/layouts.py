"""The structured index layouts (csa_spec.md section 4) checked inside a traced computation.

An impl that exploits a layout promise (pallas_tpu's Config(layout="cr0" | "cr4" | "cr128"):
contiguous window / pool tiles instead of the index list) ignores idx where the promise holds,
so a broken promise would silently give another answer. pallas_tpu checks a concrete idx on the
host before tracing (check_layout, which names the first bad token); under jit idx is a tracer,
so `violations` below recomputes the promise in XLA, and the impl poisons the outputs of every
token that breaks it with NaN (never a silently wrong finite value).

Cost: one compare-and-count over [B, T, w, w] (window) and [B, T, P, P] (cr128's visible pool,
P = K - window), fused by XLA into a reduction; no sort, nothing in the kernels' loops.
"""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["violations", "poison"]


def _exact_set(vals, lo, count, width):
    """vals [B, T, S] (-1 = empty) holds exactly {lo + i : i < count} in any order (count, lo
    [T, 1]; 0 <= count <= width): bool [B, T], True where it does NOT."""
    off = vals - lo[None]                                          # [B, T, S]
    used = vals >= 0
    stray = jnp.any(used & ((off < 0) | (off >= count[None])), axis=-1)
    hits = jnp.sum(used[..., None] & (off[..., None] == jnp.arange(width)), axis=-2)  # [B,T,w]
    want = (jnp.arange(width) < count).astype(hits.dtype)          # [T, width]
    return stray | jnp.any(hits != want[None], axis=-1)


def violations(idx, layout, window, pool_ratio):
    """bool [B, T]: the tokens whose (sanitized: -1 = empty) idx [B, T, K] breaks `layout`.

    cr0: slots [0, window) hold the token's window {max(t - window + 1, 0) .. t}, the rest -1;
    cr4: the window as in cr0 (the other slots are gathered from idx as given);
    cr128: the window, then the visible pool rows {T + p : p < (t + 1) // pool_ratio}.
    The caller checks the static shape conditions (K >= window, N large enough)."""
    _, t, k = idx.shape
    w = window
    tok = jnp.arange(t, dtype=jnp.int32)[:, None]
    n_win = jnp.minimum(tok + 1, w)
    bad = _exact_set(idx[:, :, :w], tok - n_win + 1, n_win, w)
    rest = idx[:, :, w:]
    if layout == "cr0":
        bad = bad | jnp.any(rest >= 0, axis=-1)
    elif layout == "cr128":
        visible = (tok + 1) // pool_ratio
        bad = bad | _exact_set(rest, jnp.full_like(tok, t), visible, k - w)
    return bad


def poison(bad, *outs):
    """NaN where bad ([B, T] per token, or [B] per batch row, or a scalar) for each output
    whose leading dims are (B, T) / (B,) / anything (scalar bad)."""
    res = []
    for x in outs:
        b = bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim))
        res.append(jnp.where(b, jnp.asarray(jnp.nan, x.dtype), x))
    return tuple(res)
