"""The compressor (pool rows) and the lightning indexer (top-k pool rows), csa_spec.md section 5.

Plain JAX (XLA) code in f32. The compressor is differentiable; top-k passes no gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from csa_jax.config import check_ratio


def _shape_error(name, arr, want):
    return ValueError(f"{name} must have shape {want}, got {tuple(arr.shape)}")


def compress(x, w_kv, w_gate, ape, norm_scale, *, ratio, eps=1e-6):
    """Pool rows before RoPE: [B, T // ratio, d] f32.

    x [B, T, C]; w_kv, w_gate [C, coff*d] (coff = 2 when ratio == 4, else 1); ape [ratio, coff*d];
    norm_scale [d]. Each pool row is a per-channel softmax-weighted sum over its tokens (gate z,
    value c), then RMSNorm with norm_scale. ratio 4 overlaps: pool row i pools the first halves
    ([:d]) of group i-1 and the second halves ([d:]) of group i (8 slots; none from before row 0).
    Leftover tokens (T mod ratio) are not pooled: T < ratio gives an empty pool [B, 0, d].
    """
    check_ratio(ratio, allow_zero=False)
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    _check_nonempty("x", x.shape, "BTC")
    B, T, C = x.shape
    coff = 2 if ratio == 4 else 1
    if w_kv.ndim != 2 or w_kv.shape[0] != C or w_kv.shape[1] % coff:
        raise ValueError(f"w_kv must be [C={C}, {coff}*d], got shape {tuple(w_kv.shape)}")
    width = w_kv.shape[1]
    d = width // coff
    if w_gate.shape != (C, width):
        raise _shape_error("w_gate", w_gate, (C, width))
    if ape.shape != (ratio, width):
        raise _shape_error("ape", ape, (ratio, width))
    if norm_scale.shape != (d,):
        raise _shape_error("norm_scale", norm_scale, (d,))
    if d == 0:
        raise ValueError(f"w_kv has width {width}: the pool row width d must be >= 1")
    P = T // ratio
    if P == 0:
        return jnp.zeros((B, 0, d), jnp.float32)
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    xs = x[:, : P * ratio].astype(f32)
    c = jnp.einsum("btc,cw->btw", xs, w_kv.astype(f32), precision=hi)        # [B, P*m, coff*d]
    z = jnp.einsum("btc,cw->btw", xs, w_gate.astype(f32), precision=hi)
    c = c.reshape(B, P, ratio, width)
    z = z.reshape(B, P, ratio, width) + ape.astype(f32)[None, None]
    if ratio == 4:
        # slots of row i: first halves of group i-1 (empty for i = 0), second halves of group i
        prev_c = jnp.pad(c[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_z = jnp.pad(z[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)),
                         constant_values=-jnp.inf)
        c = jnp.concatenate([prev_c, c[:, :, :, d:]], axis=2)                  # [B, P, 8, d]
        z = jnp.concatenate([prev_z, z[:, :, :, d:]], axis=2)
    w = jax.nn.softmax(z, axis=2)                                               # per channel
    pooled = jnp.sum(w * c, axis=2)                                             # [B, P, d]
    rms = jax.lax.rsqrt(jnp.mean(pooled * pooled, axis=-1, keepdims=True) + eps)
    return pooled * rms * norm_scale.astype(f32)


def _check_nonempty(name, shape, letters):
    if 0 in shape:
        dims = ", ".join(f"{a}={n}" for a, n in zip(letters, shape))
        raise ValueError(f"{name} has an empty dimension ({dims}): every one must be >= 1")


def _check_indexer(q_idx, k_idx, weights, ratio):
    check_ratio(ratio, allow_zero=False)
    if q_idx.ndim != 4:
        raise ValueError(f"q_idx must be [B, T, Hi, Di], got shape {tuple(q_idx.shape)}")
    _check_nonempty("q_idx", q_idx.shape, ("B", "T", "Hi", "Di"))    # P = T // ratio may be 0
    B, T, Hi, Di = q_idx.shape
    if k_idx.ndim != 3 or k_idx.shape[0] != B or k_idx.shape[2] != Di:
        raise ValueError(f"k_idx must be [B={B}, P, Di={Di}], got shape {tuple(k_idx.shape)}")
    if weights.shape != (B, T, Hi):
        raise _shape_error("weights", weights, (B, T, Hi))
    if k_idx.shape[1] != T // ratio:
        raise ValueError(f"k_idx has P={k_idx.shape[1]} rows but T // ratio = {T // ratio} "
                         f"(T={T}, ratio={ratio})")


def _chunked_over_tokens(fn, T, per_token_elems, budget=2 ** 26):
    """Split [0, T) into equal chunks so one chunk's largest intermediate stays under budget."""
    chunk = max(1, min(T, budget // max(per_token_elems, 1)))
    while T % chunk:
        chunk -= 1
    if chunk == T:
        return fn(0, T)
    outs = [fn(s, chunk) for s in range(0, T, chunk)] if T // chunk <= 8 else None
    if outs is not None:
        return jnp.concatenate(outs, axis=1)
    starts = jnp.arange(0, T, chunk)
    res = jax.lax.map(lambda s: fn(s, chunk), starts)                          # [n, B, chunk, ...]
    res = jnp.moveaxis(res, 0, 1)
    return res.reshape(res.shape[0], T, *res.shape[3:])


def _scores_block(q_idx, k_idx, weights, ratio, start, size):
    q = jax.lax.dynamic_slice_in_dim(q_idx, start, size, axis=1).astype(jnp.float32)
    w = jax.lax.dynamic_slice_in_dim(weights, start, size, axis=1).astype(jnp.float32)
    dots = jnp.einsum("bthd,bsd->bths", q, k_idx.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)                      # [B, c, Hi, P]
    score = jnp.einsum("bth,bths->bts", w, jax.nn.relu(dots),
                       precision=jax.lax.Precision.HIGHEST)
    t = start + jnp.arange(size)[:, None]
    s = jnp.arange(k_idx.shape[1])[None, :]
    return jnp.where((s < (t + 1) // ratio)[None], score, -jnp.inf)


def indexer_scores(q_idx, k_idx, weights, *, ratio):
    """[B, T, P] f32: score[t,s] = sum_h weights[t,h] * relu(q_idx[t,h] . k_idx[s]); -inf if invisible."""
    _check_indexer(q_idx, k_idx, weights, ratio)
    B, T, Hi, _ = q_idx.shape
    P = k_idx.shape[1]
    return _chunked_over_tokens(
        lambda s, n: _scores_block(q_idx, k_idx, weights, ratio, s, n), T, B * Hi * P)


def indexer_topk(q_idx, k_idx, weights, *, ratio, topk):
    """int32 [B, T, min(topk, P)]: pool-local ids by descending score, -1 where none is visible.

    q_idx [B,T,Hi,Di] (rotated), k_idx [B,P,Di], weights [B,T,Hi] with every scale folded in.
    Ties keep the lower id first. No gradient flows through the selection.
    """
    _check_indexer(q_idx, k_idx, weights, ratio)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got topk={topk!r}")
    B, T, Hi, _ = q_idx.shape
    P = k_idx.shape[1]
    k = min(topk, P)
    if k == 0:
        return jnp.zeros((B, T, 0), jnp.int32)
    q_idx, k_idx, weights = (jax.lax.stop_gradient(a) for a in (q_idx, k_idx, weights))

    def block(start, size):
        score = _scores_block(q_idx, k_idx, weights, ratio, start, size)
        vals, ids = jax.lax.top_k(score, k)
        return jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)

    return _chunked_over_tokens(block, T, B * Hi * P)
