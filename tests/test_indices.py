"""Index-list builders and validate_indices."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from conftest import golden


@pytest.mark.parametrize("T, window", [(1, 4), (5, 4), (37, 16), (200, 128)])
def test_window_indices(T, window):
    w = np.asarray(csa_jax.window_indices(T, window))
    assert w.shape == (T, window) and w.dtype == np.int32
    for t in range(T):
        want = [r if r >= 0 else -1 for r in range(t - window + 1, t + 1)]
        assert list(w[t]) == want


@pytest.mark.parametrize("T, ratio", [(16, 4), (17, 4), (19, 8), (300, 128), (3, 4)])
def test_pool_indices_causality(T, ratio):
    p = np.asarray(csa_jax.pool_indices(T, ratio))
    assert p.shape == (T, T // ratio)
    for t in range(T):
        for i in range(T // ratio):
            # row i summarises tokens up to (i+1)*ratio - 1: visible from its last token on
            assert p[t, i] == (i if (i + 1) * ratio - 1 <= t else -1)


@pytest.mark.parametrize("T, ratio", [(40, 8), (43, 8), (257, 128), (20, 0)])
def test_build_indices_layout(T, ratio):
    idx = np.asarray(csa_jax.build_indices(T, ratio, window=16))
    P = T // ratio if ratio else 0
    assert idx.shape == (T, 16 + P)
    np.testing.assert_array_equal(idx[:, :16], np.asarray(csa_jax.window_indices(T, 16)))
    if ratio:
        pool = np.asarray(csa_jax.pool_indices(T, ratio))
        np.testing.assert_array_equal(idx[:, 16:], np.where(pool >= 0, pool + T, -1))
        assert idx.max() < T + P


def test_build_indices_cr4_keeps_minus_one(rng):
    T, k = 24, 5
    topk = rng.integers(-1, T // 4, size=(2, T, k)).astype(np.int32)
    idx = np.asarray(csa_jax.build_indices(T, 4, window=8, pool_topk=jnp.asarray(topk)))
    assert idx.shape == (2, T, 8 + k)
    np.testing.assert_array_equal(idx[..., 8:], np.where(topk >= 0, topk + T, -1))
    np.testing.assert_array_equal(idx[0, :, :8], np.asarray(csa_jax.window_indices(T, 8)))


@pytest.mark.parametrize("case", ["cr0", "cr8"])
def test_build_indices_matches_golden_sets(case):
    d = golden(case)
    T, ratio, window = int(d["T"]), int(d["ratio"]), int(d["window"])
    ours = np.asarray(csa_jax.build_indices(T, ratio, window=window))
    for b in range(d["idx"].shape[0]):
        for t in range(T):
            assert sorted(x for x in ours[t] if x >= 0) == sorted(x for x in d["idx"][b, t] if x >= 0)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: csa_jax.window_indices(0), ValueError, r"T must be a positive int, got T=0"),
    (lambda: csa_jax.window_indices(8, -3), ValueError, r"window=-3"),
    (lambda: csa_jax.pool_indices(8, 1), ValueError, r"ratio=1 is not allowed"),
    (lambda: csa_jax.pool_indices(8, 0), ValueError, r"ratio=0 is not allowed"),
    (lambda: csa_jax.build_indices(8, -4), ValueError, r"ratio=-4 is not allowed"),
    (lambda: csa_jax.build_indices(8, 4.0), TypeError, r"ratio must be a Python int"),
    (lambda: csa_jax.build_indices(8, 4), ValueError, r"ratio=4 needs pool_topk"),
    (lambda: csa_jax.build_indices(8, 8, pool_topk=jnp.zeros((8, 2), jnp.int32)), ValueError,
     r"pool_topk is only used with ratio=4"),
    (lambda: csa_jax.build_indices(8, 4, pool_topk=jnp.zeros((7, 2), jnp.int32)), ValueError,
     r"pool_topk must be \[B, T, k\] or \[T, k\] with T=8"),
    (lambda: csa_jax.build_indices(8, 4, pool_topk=jnp.zeros((8, 2))), TypeError,
     r"pool_topk must be an integer array"),
])
def test_builder_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_validate_indices():
    ok = np.array([[[0, -1, 4]]], np.int32)
    assert csa_jax.validate_indices(ok, 5) is ok
    with pytest.raises(ValueError, match=r"idx\[0, 0, 2\] = 5 is outside \[-1, 5\)"):
        csa_jax.validate_indices(np.array([[[0, -1, 5]]]), 5)
    with pytest.raises(ValueError, match=r"idx\[0, 1, 0\] = -2 .*2 bad slot"):
        csa_jax.validate_indices(np.array([[[0, 1], [-2, 9]]]), 5)
    with pytest.raises(TypeError, match=r"integer array, got dtype=float32"):
        csa_jax.validate_indices(np.zeros((1, 1, 1), np.float32), 5)
    with pytest.raises(ValueError, match=r"num_kv=0"):
        csa_jax.validate_indices(ok, 0)


def test_the_api_lines_of_the_readme(rng):
    """README's API lines (issue 31): a [T, K] list is broadcast to [B, T, K] before
    sparse_attention, which rejects [T, K]; the cr4 list is [B, T, 128 + min(512, T // 4)]."""
    B, T, H, D = 2, 256, 2, 16
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, T + T // 128, D)), jnp.float32)
    idx = csa_jax.build_indices(T, 128, window=128)
    assert idx.shape == (T, 128 + T // 128)
    with pytest.raises(ValueError, match=r"idx must be \[B, T, K\]"):
        csa_jax.sparse_attention(q, kv, idx)
    idx = jnp.broadcast_to(idx, (B, *idx.shape))
    o, lse = csa_jax.sparse_attention(q, kv, idx)
    assert o.shape == (B, T, H, D) and lse.shape == (B, T, H)
    Hi, Di = 2, 8
    top = csa_jax.indexer_topk(jnp.asarray(rng.standard_normal((B, T, Hi, Di)), jnp.float32),
                               jnp.asarray(rng.standard_normal((B, T // 4, Di)), jnp.float32),
                               jnp.asarray(rng.standard_normal((B, T, Hi)), jnp.float32),
                               ratio=4, topk=512)
    assert top.shape == (B, T, min(512, T // 4))  # clipped to the pool's 64 rows
    assert csa_jax.build_indices(T, 4, pool_topk=top).shape == (B, T, 128 + T // 4)
