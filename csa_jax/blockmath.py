"""Online-softmax block math and ring-slot arithmetic shared by every Pallas dialect.

Only data movement differs between the dialects (TPU DMAs, Mosaic-GPU TMA, Triton pointer
gathers); the arithmetic on one gathered tile of kv rows is the same everywhere and lives here.
Everything is plain `jax.numpy` on values (no refs, no dialect primitives), so it traces inside
any kernel body and outside one. Matrix products are left to the caller (each dialect has its
own dot), except where a docstring says otherwise.

Shapes (one vocabulary: H heads, D head dim, bk rows of one gathered tile):
    s, p, dp, ds  [..., bk] f32   scores / probabilities of one tile (`...` is usually H)
    valid         broadcastable to s, bool: the slot is non-empty (idx >= 0)
    m, l          [..., 1] f32    running max and running sum of exp(s - m) over valid slots
    acc           [..., D] f32    unnormalised sum_j p_j * v_j
    lse, delta, dlse  [..., 1] f32

Forward over the tiles of one token (all heads at once):

    m, l, acc = init_state((H,), D)
    for each tile:                              # v [bk, D]: gathered rows (finite where invalid)
        s = scale * (q @ v.T)                   # [H, bk], caller's dot
        m, l, p, alpha = softmax_update(m, l, s, valid)
        acc = alpha * acc + p @ v               # caller's dot
    o, lse = finalize(m, l, acc, sink)          # sink [H, 1] f32, -inf = no sink

Backward for one tile:

    p = recompute_p(s, lse, valid)
    ds = softmax_grad(p, dp, delta, dlse)       # dp = dO @ v.T

Ring of `depth` slots over a flat stream of tiles (step = token * n_tiles + tile): the prologue
issues steps 0 .. depth-2, step i waits on slot `ring_slot(i, depth)`, computes, then issues step
`i + lookahead(depth)` into the slot that step i-1 freed. This API is stable: add, don't change.

Also here, because every impl needs them once: the CSR inverse map of an index list
(`inverse_map`, used by the reference and every kernel's deterministic dkv), `round_up`,
`precision` (the dot precision per input dtype) and `resolve_interpret` (interpret=None).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from csa_jax.common import NEG_INIT, finalize_lse

__all__ = [
    "init_state", "softmax_update", "finalize", "recompute_p", "softmax_grad",
    "ring_slot", "lookahead", "step_coords", "flat_step", "num_tiles",
    "round_up", "precision", "resolve_interpret", "inverse_map",
]


# ----------------------------------------------------------------------------- softmax math

def init_state(lead_shape, d):
    """Running (m, l, acc) for an online softmax over rows of width d: m = NEG_INIT (finite,
    so the first update never computes -inf - (-inf)), l = 0, acc = 0; all f32."""
    lead_shape = tuple(lead_shape)
    m = jnp.full(lead_shape + (1,), NEG_INIT, jnp.float32)
    l = jnp.zeros(lead_shape + (1,), jnp.float32)
    acc = jnp.zeros(lead_shape + (d,), jnp.float32)
    return m, l, acc


def softmax_update(m, l, s, valid):
    """One online-softmax step over a tile of scores.

    Returns (m_new, l_new, p, alpha): p = exp(s - m_new) on valid slots and exactly 0 on empty
    ones (masked by `where`, not by a sentinel score, so an all-empty tile leaves m, l unchanged
    and never makes p = exp(0) = 1); alpha = exp(m - m_new) is the factor the caller applies to
    its accumulator before adding p @ v.
    """
    s = jnp.where(valid, s, NEG_INIT)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    return m_new, l_new, p, alpha


def finalize(m, l, acc, sink):
    """Join the sink (f32 broadcastable to m, -inf = none) and normalise.

    Returns (o f32 [..., D], lse [..., 1]); an all-empty row gives o = 0 and lse = sink, or
    EMPTY_LSE without a sink (csa_jax.common.finalize_lse)."""
    lse, o_scale = finalize_lse(m, l, sink)
    return acc * o_scale, lse


def recompute_p(s, lse, valid):
    """Probabilities of a tile from the saved lse (sink included): exp(s - lse), 0 where empty.
    Safe for an all-empty row (lse = EMPTY_LSE): the where drops the overflowing exp."""
    return jnp.where(valid, jnp.exp(jnp.where(valid, s, lse) - lse), 0.0)


def softmax_grad(p, dp, delta, dlse):
    """ds = p * (dp - delta + dlse): gradient w.r.t. the scaled scores of a tile, with the lse
    output's own gradient dlse folded in (delta = sum_d o * dO)."""
    return p * (dp - delta + dlse)


def sink_grad(sink, lse, dc):
    """dsink [H] = sum over (b, t) of exp(sink - lse) * dc, dc = dlse - delta [B, T, H]
    (csa_spec.md section 3): the sink's probability times the lse cotangent minus delta; zero
    weight where sink = -inf."""
    return jnp.sum(jnp.exp(sink[None, None, :] - lse) * dc, axis=(0, 1))


# ----------------------------------------------------------------------------- ring arithmetic

def ring_slot(step, depth):
    """Slot of the ring that holds tile `step` (works on Python ints and traced int32)."""
    return step % depth


def lookahead(depth):
    """Tiles in flight ahead of the one being computed: the prologue issues this many, and step
    i issues step i + lookahead(depth). depth - 1, so the slot written is the one step i-1
    freed."""
    if depth < 2:
        raise ValueError(f"ring {depth=} must be >= 2")
    return depth - 1


def step_coords(step, n_tiles):
    """Flat step -> (token within the program, tile within the token)."""
    return step // n_tiles, step % n_tiles


def flat_step(token, tile, n_tiles):
    """(token within the program, tile within the token) -> flat step."""
    return token * n_tiles + tile


def num_tiles(k, block_k):
    """Tiles of block_k slots covering k slots (the last one padded with empty slots)."""
    return -(-k // block_k)


# ----------------------------------------------------------------------------- shared helpers

def round_up(x, m):
    """x rounded up to a multiple of m (Python ints)."""
    return -(-x // m) * m


def precision(dtype):
    """Dot precision for inputs of this dtype: HIGHEST for f32 (true f32 products; the default
    is TF32 on NVIDIA and bf16 passes on TPU), the native MMA (None) for bf16 / f16."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def resolve_interpret(interpret, platforms):
    """interpret=None -> interpret mode unless the default backend is one of `platforms` (the
    kernel's own hardware); any other value is passed through (True/False/InterpretParams)."""
    if interpret is None:
        return jax.default_backend() not in platforms
    return interpret


def inverse_map(idx, num_kv, num_rows, *, narrow=False, search=None):
    """CSR inverse of idx [B, E] (flat slots): (perm [B, E], key [B, E], offsets [B, R+1]).

    perm lists the slots sorted by kv row (stable, so the slots of one row stay in slot order;
    empty slots sort last under key num_kv); key = the row of each sorted entry; the entries of
    row r are perm[offsets[r]:offsets[r+1]]. num_rows >= num_kv (rows past num_kv are empty).

    narrow (when num_kv < 2**15): sort int16 keys, with ids past num_kv clamped to num_kv
    (empty, like -1). A GPU sorts with a radix sort whose passes scale with the key's bits: 2
    passes instead of 4. perm and offsets of every row are the same; only the order of the
    empty / out-of-range slots after offsets[num_kv] may differ. Off by default: measured alone
    on the H200 (benchmarks/train_ops_probe.py, docs/perf/train_h200.md), not yet in a step.

    search: jnp.searchsorted's method for the offsets; None = "scan_unrolled" on GPUs (the
    binary search as one fused chain of gathers: "scan" is a while loop of ~log2(E) steps,
    each step its own kernels), "scan" elsewhere (the CPU run's program as it was). The same
    offsets either way."""
    narrow = narrow and num_kv < 2 ** 15
    key = jnp.where(idx >= 0, idx, num_kv).astype(jnp.int32)
    if narrow:
        key = jnp.minimum(key, num_kv)
        perm = jnp.argsort(key.astype(jnp.int16), axis=-1, stable=True).astype(jnp.int32)
    else:
        perm = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    skey = jnp.take_along_axis(key, perm, axis=-1)
    # rows past num_kv are empty: clamp so the empty slots (key num_kv) belong to no row
    rows = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), num_kv)
    if search is None:
        search = "scan_unrolled" if jax.default_backend() in ("gpu", "cuda", "rocm") else "scan"
    offs = jax.vmap(lambda k: jnp.searchsorted(k, rows, side="left", method=search))(skey)
    offs = offs.astype(jnp.int32)
    return perm, skey, offs
