"""Random CSA problems at V4 shapes, shared by the CLI (python -m csa_jax) and benchmarks/."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from csa_jax.compressor import indexer_topk
from csa_jax.config import CSAConfig, forward_flops
from csa_jax.indices import build_indices

INDEX_MODES = ("causal", "random", "unique")


@dataclasses.dataclass
class Problem:
    cfg: CSAConfig
    T: int
    B: int
    q: jax.Array        # [B, T, H, D]
    kv: jax.Array       # [B, N, D]
    idx: jax.Array      # [B, T, K] int32
    sink: jax.Array     # [H] f32
    do: jax.Array       # [B, T, H, D] output cotangent
    dlse: jax.Array     # [B, T, H] lse cotangent
    index_mode: str

    @property
    def K(self) -> int:
        return self.idx.shape[-1]

    def flops(self) -> tuple[float, float]:
        """(nominal, valid) forward FLOPs by the csa_spec.md convention (backward = 2.5x)."""
        c = self.cfg
        nominal = forward_flops(self.T, c.num_heads, c.nominal_slots(self.T), c.head_dim, self.B)
        return nominal, valid_flops(self.idx, c.num_heads, c.head_dim)


def valid_flops(idx, H: int, D: int) -> float:
    """Forward FLOPs counting only the non-empty slots of idx: 2 * slots * H * (D + D)."""
    return 2.0 * int(jnp.sum(idx >= 0)) * H * (2 * D)


def make_indices(cfg: CSAConfig, T: int, B: int, mode: str, key):
    """[B, T, K] kv row ids of the layer type: window + pool (cr4: indexer top-k)."""
    if mode not in INDEX_MODES:
        raise ValueError(f"index mode {mode!r} must be one of {INDEX_MODES}")
    if cfg.ratio != 4:
        idx = build_indices(T, cfg.ratio, window=cfg.window)
        return jnp.broadcast_to(idx, (B,) + idx.shape)
    P = cfg.pool_rows(T)
    k = min(cfg.topk, P)
    if mode == "random":
        # The convention of published AMD numbers: every pool slot valid, ids uniform in [0, P).
        topk = jax.random.randint(key, (B, T, k), 0, P, dtype=jnp.int32)
    elif mode == "unique":
        # The same without repeats in a token's list (a top-k never repeats a row): k
        # distinct ids per token, uniform over the k-subsets of [0, P).
        topk = jax.lax.top_k(jax.random.uniform(key, (B, T, P)), k)[1].astype(jnp.int32)
    else:
        # Realistic causal lists: the lightning indexer's top-k on random indexer inputs.
        kq, kk, kw = jax.random.split(key, 3)
        Hi, Di = cfg.index_heads, cfg.index_dim
        q_i = jax.random.normal(kq, (B, T, Hi, Di), jnp.bfloat16)
        k_i = jax.random.normal(kk, (B, P, Di), jnp.bfloat16)
        w = jax.random.uniform(kw, (B, T, Hi), jnp.float32) * (Hi * Di) ** -0.5
        topk = jax.jit(lambda a, b, c: indexer_topk(a, b, c, ratio=4, topk=k))(q_i, k_i, w)
    return build_indices(T, 4, window=cfg.window, pool_topk=topk)


def make_problem(cfg: CSAConfig, T: int, *, B: int = 1, dtype=jnp.bfloat16,
                 index_mode: str = "causal", seed: int = 0) -> Problem:
    key = jax.random.PRNGKey(seed)
    kq, kkv, ks, kdo, kdl, ki = jax.random.split(key, 6)
    H, D = cfg.num_heads, cfg.head_dim
    N = cfg.num_kv(T)
    q = jax.random.normal(kq, (B, T, H, D), dtype)
    kv = jax.random.normal(kkv, (B, N, D), dtype)
    sink = jax.random.normal(ks, (H,), jnp.float32)
    do = jax.random.normal(kdo, (B, T, H, D), dtype)
    dlse = jax.random.normal(kdl, (B, T, H), jnp.float32) * 0.1
    idx = make_indices(cfg, T, B, index_mode, ki)
    return Problem(cfg, T, B, q, kv, idx, sink, do, dlse, index_mode)


def loss_fn(attn):
    """sum(o * dO) + sum(lse * dlse): its gradient is the backward with both cotangents."""
    def loss(q, kv, sink, idx, do, dlse):
        o, lse = attn(q, kv, idx, sink)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(lse * dlse)
    return loss


def rel_err(a, b) -> float:
    """max |a - b| / max |b| over the finite entries of b; NaN if a has any NaN."""
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if np.isnan(a).any():
        return float("nan")
    fin = np.isfinite(b)
    den = max(np.abs(b[fin]).max(initial=0.0), 1e-30)
    return float(np.abs(a[fin] - b[fin]).max(initial=0.0) / den)
