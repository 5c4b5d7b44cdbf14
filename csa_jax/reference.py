"""The XLA reference ("xla" impl): the specification of CSA in plain JAX, and the speed baseline.

Forward and backward follow csa_spec.md section 3 exactly. Memory is bounded by walking the
tokens in chunks of C: per chunk the kv rows of its index lists are gathered ONCE ([B, C, K, D] in
the input dtype) and serve QK^T, PV and, in the backward, dP, dQ and the per-slot dkv
intermediate. No [T, H, K, D] tensor ever exists; accumulation is f32 (preferred_element_type).

dkv strategies (Config.dkv):
- "inverse_map" (default): the per-slot intermediate interm[t, j] = sum_h(scale*ds*q + p*dO) of a
  chunk is reduced into kv rows by an inverse map built with a stable sort + histogram (CSR), then
  a tree of fixed-width, fixed-order gather-sums ("items" of `reduce_width` slots per row, then
  items of items, ...). Every step is a sort, a gather or an ordered add, so dkv is
  bit-deterministic run to run on every backend. Chunks add into dkv in a fixed order.
- "scatter": segment-sum (scatter-add) of the same intermediate. Faster on some backends; the order
  of additions into a row is unspecified, so bits may differ between runs on GPUs.
The two agree to f32 rounding.

This module is also the template of the impl-module interface (see csa_jax/registry.py).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from csa_jax.blockmath import inverse_map, precision
from csa_jax.common import NEG_INIT, finalize_lse

DKV_MODES = ("inverse_map", "scatter")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the XLA reference.

    chunk_tokens: tokens per chunk C (None: the largest power of two with C*H*K <= chunk_elems).
    chunk_elems:  budget for one [B, C, H, K] f32 intermediate when chunk_tokens is None.
    dkv:          "inverse_map" (deterministic) or "scatter".
    reduce_width: slots summed per item in the inverse-map gather-reduce tree (>= 2).
    low_precision_probs: with bf16/f16 inputs, round p and ds to the input dtype before the second
                  products (PV, dS K, dS^T Q, P^T dO), as flash kernels do; f32 inputs never round.
    """

    chunk_tokens: int | None = None
    chunk_elems: int = 2 ** 28
    dkv: str = "inverse_map"
    reduce_width: int = 8
    low_precision_probs: bool = True

    def __post_init__(self):
        if self.chunk_tokens is not None and (not isinstance(self.chunk_tokens, int)
                                              or self.chunk_tokens <= 0):
            raise ValueError(f"chunk_tokens={self.chunk_tokens!r} must be None or a positive int")
        if not isinstance(self.chunk_elems, int) or self.chunk_elems <= 0:
            raise ValueError(f"chunk_elems={self.chunk_elems!r} must be a positive int")
        if self.dkv not in DKV_MODES:
            raise ValueError(f"dkv={self.dkv!r} must be one of {DKV_MODES}")
        if not isinstance(self.reduce_width, int) or self.reduce_width < 2:
            raise ValueError(f"reduce_width={self.reduce_width!r} must be an int >= 2")


def default_config(q_shape, kv_shape, idx_shape, dtype) -> Config:
    """The defaults work for every shape; the chunk size is derived at call time."""
    del q_shape, kv_shape, idx_shape, dtype
    return Config()


def _chunk_size(B, T, H, K, config):
    if config.chunk_tokens is not None:
        return min(config.chunk_tokens, T)
    c = max(1, config.chunk_elems // max(B * H * K, 1))
    c = 1 << (c.bit_length() - 1)               # power of two: divides power-of-two T
    return min(c, T)


def _gather_rows(kv, idx_c):
    """kv [B, N, D], idx_c [B, C, K] (-1 = empty) -> rows [B, C, K, D] (zeros for empty), valid."""
    valid = idx_c >= 0
    safe = jnp.where(valid, idx_c, 0)
    # safe ids are in [0, N): promise it, so the gather carries no bounds mask over [C, K, D]
    rows = jax.vmap(lambda kv_b, i_b: kv_b.at[i_b].get(mode="promise_in_bounds"))(kv, safe)
    # An empty slot reads nothing: zero its row (else 0 * a NaN / inf in kv row 0 poisons the
    # PV and dS K products). An elementwise select on the gather's output: XLA fuses it there.
    rows = jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype))
    return rows, valid


def _pdtype(dtype, config):
    return dtype if (config.low_precision_probs and dtype != jnp.float32) else jnp.float32


def _scores(q_c, rows, valid, scale, prec):
    s = jnp.einsum("bchd,bckd->bchk", q_c, rows, preferred_element_type=jnp.float32,
                   precision=prec) * scale
    return jnp.where(valid[:, :, None, :], s, NEG_INIT)                        # [B, C, H, K]


def _forward_chunk(q_c, kv, idx_c, sink, scale, config):
    prec = precision(q_c.dtype)
    rows, valid = _gather_rows(kv, idx_c)
    s = _scores(q_c, rows, valid, scale, prec)
    m = jnp.max(s, axis=-1)                                                     # [B, C, H]
    p = jnp.where(valid[:, :, None, :], jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    lse, o_scale = finalize_lse(m, l, sink)
    acc = jnp.einsum("bchk,bckd->bchd", p.astype(_pdtype(q_c.dtype, config)), rows,
                     preferred_element_type=jnp.float32, precision=prec)
    o = (acc * o_scale[..., None]).astype(q_c.dtype)
    return o, lse


def _pad_tokens(x, T_pad, value=0):
    T = x.shape[1]
    if T_pad == T:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, T_pad - T)
    return jnp.pad(x, pad, constant_values=value)


def _vma(x):
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _varying_like(init, inputs):
    """init's leaves cast to vary over every manual mesh axis any input varies over: inside a
    shard_map (check_vma) the loop's carry must come out of the body with the type it went in,
    and the body mixes the inputs into it (zeros start invariant)."""
    axes = frozenset().union(*(_vma(x) for x in inputs))
    if not axes:
        return init

    def cast(x):
        missing = tuple(sorted(axes - _vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, init)


def _chunk_loop(B, T, H, K, config, body, init, padded, others=()):
    """Run body(start, C, carry) over token chunks; returns (carry, C, T_pad).

    `padded` lists the [B, T, ...] inputs; they are padded to a multiple of C (idx with -1).
    `others`: the other arrays the body reads (their manual-axis variance types the carry).
    """
    C = _chunk_size(B, T, H, K, config)
    n = -(-T // C)
    T_pad = n * C
    padded = [_pad_tokens(x, T_pad, v) for x, v in padded]
    if n == 1:
        return body(0, C, init, padded), C, T_pad
    init = _varying_like(init, list(padded) + list(others))
    carry = jax.lax.fori_loop(0, n, lambda i, c: body(i * C, C, c, padded), init)
    return carry, C, T_pad


def forward(q, kv, idx, sink, *, scale, interpret=None, config=None):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32. See the impl-module interface in registry.py."""
    del interpret
    config = config or Config()
    B, T, H, D = q.shape
    K = idx.shape[2]

    def body(start, C, carry, padded):
        o_buf, lse_buf = carry
        q_p, idx_p = padded
        q_c = jax.lax.dynamic_slice_in_dim(q_p, start, C, axis=1)
        idx_c = jax.lax.dynamic_slice_in_dim(idx_p, start, C, axis=1)
        o_c, lse_c = _forward_chunk(q_c, kv, idx_c, sink, scale, config)
        o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_c, start, axis=1)
        lse_buf = jax.lax.dynamic_update_slice_in_dim(lse_buf, lse_c, start, axis=1)
        return o_buf, lse_buf

    C = _chunk_size(B, T, H, K, config)
    T_pad = -(-T // C) * C
    init = (jnp.zeros((B, T_pad, H, D), q.dtype), jnp.zeros((B, T_pad, H), jnp.float32))
    (o, lse), _, _ = _chunk_loop(B, T, H, K, config, body, init, [(q, 0), (idx, -1)],
                                 others=(kv, sink))
    return o[:, :T], lse[:, :T]


# ----------------------------------------------------------------------------- backward


def _segment_reduce_deterministic(values, targets, num_rows, width, skip_single=None):
    """sum of values[e] over e with targets[e] == r, for r in [0, num_rows): [num_rows, D] f32.

    values [E, D] f32; targets [E] int32 in [0, num_rows). Inverse map by stable sort (CSR,
    csa_jax.blockmath.inverse_map), then a tree of fixed-order gather-sums: level l groups each
    row's current entries into items of `width` consecutive entries and sums each item in slot
    order. Deterministic.

    skip_single (None: everywhere but on GPUs): once no row holds more than one entry, a level
    gathers only slot 0 of each item, chosen by a lax.cond on max(count) > 1. On a GPU that
    predicate is read on the host (a device-to-host copy and a wait per level), so there every
    level gathers all `width` slots instead: the extra slots are masked to +0.0, which leaves
    every sum unchanged, and they are few (late levels have about num_rows items).
    """
    E, D = values.shape
    order, _, offs = inverse_map(targets[None], num_rows, num_rows)             # CSR, [1, ...]
    order, off = order[0], offs[0, :-1]
    cnt = offs[0, 1:] - off
    src = order
    # A row can hold at most E entries; each level divides the longest list by `width`.
    levels = max(1, math.ceil(math.log(max(E, 2), width)))
    for _ in range(levels):
        n_items = (cnt + width - 1) // width
        item_end = jnp.cumsum(n_items)
        item_off = item_end - n_items
        cap = -(-src.shape[0] // width) + num_rows                              # static bound
        i = jnp.arange(cap, dtype=jnp.int32)
        row = jnp.minimum(jnp.searchsorted(item_end, i, side="right"), num_rows - 1)
        a = i - item_off[row]
        live = i < item_end[-1]

        def gather_sum(w_count, src=src, row=row, a=a, live=live, values=values,
                       cnt=cnt, off=off):
            acc = jnp.zeros((cap, D), jnp.float32)
            for w in range(w_count):
                k = a * width + w
                ok = live & (k < cnt[row])
                pos = jnp.clip(off[row] + k, 0, src.shape[0] - 1)
                acc = acc + jnp.where(ok[:, None], values[src[pos]], 0.0)
            return acc

        # Once every row holds <= 1 entry only slot 0 of each item is live: skip the other gathers.
        if skip_single is None:
            skip_single = jax.default_backend() != "gpu"
        if skip_single:
            values = jax.lax.cond(jnp.max(cnt) > 1, lambda: gather_sum(width),
                                  lambda: gather_sum(1))
        else:
            values = gather_sum(width)
        cnt, off, src = n_items, item_off, i
    # now every row has 0 or 1 entries
    pos = jnp.clip(off, 0, src.shape[0] - 1)
    return jnp.where((cnt > 0)[:, None], values[src[pos]], 0.0)


def _dkv_from_slots(interm, idx_c, N, config):
    """interm [B, C, K, D] f32, idx_c [B, C, K] -> this chunk's dkv contribution [B, N, D] f32."""
    B, C, K, D = interm.shape
    # Empty slots go to a dump row N of their batch (dropped at the end).
    tgt = jnp.where(idx_c >= 0, idx_c, N) + (N + 1) * jnp.arange(B, dtype=jnp.int32)[:, None, None]
    tgt = tgt.reshape(-1)
    vals = interm.reshape(-1, D)
    if config.dkv == "scatter":
        out = jax.ops.segment_sum(vals, tgt, num_segments=B * (N + 1))
    else:
        out = _segment_reduce_deterministic(vals, tgt, B * (N + 1), config.reduce_width)
    return out.reshape(B, N + 1, D)[:, :N]


def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret=None, config=None):
    """(dq, dkv, dsink) of csa_spec.md section 3, with the lse cotangent dlse folded into ds."""
    del interpret
    config = config or Config()
    B, T, H, D = q.shape
    N = kv.shape[1]
    K = idx.shape[2]
    prec = precision(q.dtype)
    pdt = _pdtype(q.dtype, config)

    def body(start, C, carry, padded):
        dq_buf, dkv_acc, dsink_acc = carry
        q_p, idx_p, o_p, do_p, lse_p, dlse_p = padded
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, C, axis=1)
        q_c, idx_c, o_c, do_c, lse_c, dlse_c = map(sl, (q_p, idx_p, o_p, do_p, lse_p, dlse_p))
        rows, valid = _gather_rows(kv, idx_c)
        s = _scores(q_c, rows, valid, scale, prec)
        p = jnp.where(valid[:, :, None, :], jnp.exp(s - lse_c[..., None]), 0.0)  # [B, C, H, K]
        delta = jnp.sum(o_c.astype(jnp.float32) * do_c.astype(jnp.float32), axis=-1)  # [B, C, H]
        dp = jnp.einsum("bchd,bckd->bchk", do_c, rows, preferred_element_type=jnp.float32,
                        precision=prec)
        ds = p * (dp - delta[..., None] + dlse_c[..., None])
        dq_c = jnp.einsum("bchk,bckd->bchd", ds.astype(pdt), rows,
                          preferred_element_type=jnp.float32, precision=prec) * scale
        dq_buf = jax.lax.dynamic_update_slice_in_dim(dq_buf, dq_c.astype(q.dtype), start, axis=1)
        # Per-slot intermediate: [scale*ds ; p] (2H) contracted with [q ; dO] (2H) in one product.
        lhs = jnp.concatenate([(ds * scale).astype(pdt), p.astype(pdt)], axis=2)  # [B, C, 2H, K]
        rhs = jnp.concatenate([q_c, do_c], axis=2).astype(pdt)                     # [B, C, 2H, D]
        interm = jnp.einsum("bcgk,bcgd->bckd", lhs, rhs, preferred_element_type=jnp.float32,
                            precision=prec)                                       # [B, C, K, D]
        dkv_acc = dkv_acc + _dkv_from_slots(interm, idx_c, N, config)
        # dsink = sum_t exp(sink - lse) * (dlse - delta); padded tokens have lse = 1e30, so w = 0.
        w = jnp.exp(sink[None, None, :] - lse_c)
        dsink_acc = dsink_acc + jnp.sum(w * (dlse_c - delta), axis=(0, 1))
        return dq_buf, dkv_acc, dsink_acc

    C = _chunk_size(B, T, H, K, config)
    T_pad = -(-T // C) * C
    init = (jnp.zeros((B, T_pad, H, D), q.dtype), jnp.zeros((B, N, D), jnp.float32),
            jnp.zeros((H,), jnp.float32))
    (dq, dkv, dsink), _, _ = _chunk_loop(
        B, T, H, K, config, body, init,
        [(q, 0), (idx, -1), (o, 0), (do, 0), (lse, 1e30), (dlse, 0)], others=(kv, sink))
    return dq[:, :T], dkv.astype(kv.dtype), dsink


def naive(q, kv, idx, sink, *, scale):
    """Unchunked, f32, autodiff-only CSA: an independent check of the hand-written backward.

    Materialises [B, T, K, D]: only for small problems (tests, the CLI's correctness check).
    sink: f32 [H], -inf for none. idx: any ints (out-of-range = empty).
    """
    N = kv.shape[1]
    valid = (idx >= 0) & (idx < N)
    rows, _ = _gather_rows(kv.astype(jnp.float32), jnp.where(valid, idx, -1))
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bthd,btkd->bthk", q.astype(jnp.float32), rows, precision=hi) * scale
    s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
    m = jnp.maximum(jnp.max(s, axis=-1), sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    tot = jnp.sum(jnp.exp(s - m[..., None]), axis=-1) + jnp.exp(sink - m)
    lse = jnp.where(tot > 0, m + jnp.log(jnp.where(tot > 0, tot, 1.0)), -1e30)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bthk,btkd->bthd", p, rows, precision=hi)
    return o, lse
