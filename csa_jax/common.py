"""Constants and small helpers shared by the reference and every kernel dialect.

Conventions used across csa_jax (one vocabulary of dimension letters):
B batch, T queries (tokens), N kv rows (T token rows + P pool rows), H query heads,
D head dim, K slots per token, P pool rows, C chunk of tokens.
"""
from __future__ import annotations

import jax.numpy as jnp

# Finite initial running max for online softmax: never compute -inf - (-inf).
NEG_INIT = -1e30
# lse of a row with no valid slot and no sink (log 0 would be -inf; we return this finite value).
EMPTY_LSE = -1e30

def sanitize_indices(idx, num_kv):
    """Map every id outside [0, num_kv) to -1 (empty slot); int32 in, int32 out."""
    return jnp.where((idx >= 0) & (idx < num_kv), idx, -1).astype(jnp.int32)


def finalize_lse(m, l, sink):
    """Join the sink to a running (max m, sum l) pair and return (lse, o_scale).

    m, l: f32 running max and sum of exp(s - m) over valid slots (l == 0 for an empty row, m the
    finite NEG_INIT). sink: f32, broadcastable to m; -inf means "no sink".
    Returns lse (natural log, sink included; EMPTY_LSE for an empty row without sink) and the
    factor 1 / (sum incl. sink) * exp(m - m_tot) that turns the unnormalised PV accumulator into o.

    Non-finite inputs (README, semantics): a NaN or +inf among the row's used scores (or a NaN /
    +inf sink) leaves l (or m) NaN; that is not "empty" (only l_tot == 0 is), so lse and o_scale
    come out NaN and so does o, as in the IEEE softmax. A -inf score weighs exp(-inf) = 0.
    """
    m_tot = jnp.maximum(m, sink)  # finite: m >= NEG_INIT (NaN / inf only from non-finite input)
    l_tot = l * jnp.exp(m - m_tot) + jnp.exp(sink - m_tot)
    empty = l_tot == 0
    safe_l = jnp.where(empty, 1.0, l_tot)
    lse = jnp.where(empty, EMPTY_LSE, m_tot + jnp.log(safe_l))
    o_scale = jnp.where(empty, 0.0, jnp.exp(m - m_tot) / safe_l)
    return lse, o_scale
