"""The structured index layouts (csa_spec.md section 4) checked inside a traced computation.

An impl that exploits a layout promise (pallas_tpu's Config(layout="cr0" | "cr4" | "cr128"):
contiguous window / pool tiles instead of the index list) ignores idx where the promise holds,
so a broken promise would silently give another answer. pallas_tpu checks a concrete idx on the
host before tracing (check_layout, which names the first bad token); under jit idx is a tracer,
so `violations` below recomputes the promise in XLA, and the impl poisons the outputs of every
token that breaks it with NaN (never a silently wrong finite value).

Cost: a few bitwise-or reductions over [B, T, K] (one per 32 values of the window, and of
cr128's pool of P = K - window rows), fused by XLA; no sort, nothing in the kernels' loops.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

__all__ = ["Layout", "KINDS", "as_layout", "violations", "poison"]

KINDS = ("generic", "cr0", "cr4", "cr128")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A caller's promise about idx (csa_spec.md section 4), for `sparse_attention(layout=...)`.

    kind: "generic" (nothing promised); "cr0": slots [0, window) hold token t's window rows
        max(0, t - window + 1) .. t (each once, any order, -1 for the rest), every later slot -1
        (csa_jax.build_indices(T, 0, window=window)); "cr4": the same window, the other slots
        arbitrary; "cr128": the same window, then the visible pool rows T + p,
        p < (t + 1) // pool_ratio (any order), -1 elsewhere (build_indices(T, pool_ratio)).
    window, pool_ratio: the layer's window and (cr128) pool ratio.
    An impl may use the promise to read structured tiles instead of the list (gluon's cr0
    window kernel, pallas_tpu's window / pool tiles); others ignore it. Under jit a broken
    promise makes the offending tokens' outputs NaN, eagerly it raises ValueError.
    """
    kind: str = "generic"
    window: int = 128
    pool_ratio: int = 128

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layout kind={self.kind!r} must be one of {KINDS}")
        check_window_pool(self.window, self.pool_ratio, "layout ")


def check_window_pool(window, pool_ratio, prefix=""):
    """A layout promise's window and pool ratio: positive ints, the ratio >= 2; ValueError
    naming the bad value (field names after `prefix`). Layout's and gluon Config's check."""
    for name, v in (("window", window), ("pool_ratio", pool_ratio)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{prefix}{name}={v!r} must be a positive int")
    if pool_ratio < 2:
        raise ValueError(f"{prefix}pool_ratio={pool_ratio} must be >= 2")


def as_layout(layout) -> Layout:
    """None -> Layout() (generic); a kind string -> Layout(kind) (window 128, pool ratio 128:
    V4's); a Layout -> itself."""
    if layout is None:
        return Layout()
    if isinstance(layout, str):
        return Layout(layout)
    if isinstance(layout, Layout):
        return layout
    raise TypeError(f"layout must be None, one of {KINDS} or a csa_jax.Layout, got "
                    f"{type(layout).__name__}")


def _exact_set(vals, lo, count, width):
    """vals [B, T, S] (-1 = empty) holds exactly {lo + i : i < count} in any order (count, lo
    [T, 1]; 0 <= count <= width): bool [B, T], True where it does NOT.

    Exact in O(S * width / 32) per token: no used value outside [lo, lo + count), exactly
    `count` used slots, and the OR of their bits 1 << (v - lo) over 32-bit words covering
    0 .. count - 1 (count used slots hitting count distinct offsets: each once)."""
    off = vals - lo[None]                                          # [B, T, S]
    used = vals >= 0
    stray = jnp.any(used & ((off < 0) | (off >= count[None])), axis=-1)
    bad = stray | (jnp.sum(used, axis=-1) != count[None, :, 0])
    ok_off = jnp.where(used & ~stray[..., None], off, -1)
    bit = jnp.left_shift(jnp.uint32(1), (ok_off & 31).astype(jnp.uint32))
    for k in range(-(-width // 32)):
        word = jnp.where((ok_off >= 0) & ((ok_off >> 5) == k), bit, jnp.uint32(0))
        got = lax.reduce(word, jnp.uint32(0), lax.bitwise_or, (2,))             # [B, T]
        n = jnp.clip(count[:, 0] - 32 * k, 0, 32)                                 # [T]
        want = jnp.where(n >= 32, jnp.uint32(0xFFFFFFFF),
                         jnp.left_shift(jnp.uint32(1), jnp.minimum(n, 31).astype(jnp.uint32))
                         - jnp.uint32(1))
        bad = bad | (got != want[None])
    return bad


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
