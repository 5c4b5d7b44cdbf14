"""train.optim: the grouped global norm and the clip built on it match optax's (same state, the
norm to f32 summation order), and stay optax's own where they do not group."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train import optim


def _tree(n=40):   # more than optim.GROUP leaves: two groups
    rng = np.random.default_rng(0)
    return {f"p{i:02d}": (rng.standard_normal((3 + i % 5, 2 + i % 3)) * (1 + i)).astype(np.float32)
            for i in range(n)}


@pytest.mark.parametrize("max_norm", [1.0, 1e6])   # clipping active / not
def test_grouped_clip_matches_optax(monkeypatch, max_norm):
    monkeypatch.setattr(optim, "_GPU", optim._GPU + ("cpu",))   # group on this backend too
    g = _tree()
    want_norm = jax.jit(optax.tree.norm)(g)
    np.testing.assert_allclose(jax.jit(optim.global_norm)(g), want_norm, rtol=1e-6)
    ref, got = optax.clip_by_global_norm(max_norm), optim.clip_by_global_norm(max_norm)
    assert jax.tree.structure(got.init(g)) == jax.tree.structure(ref.init(g))
    want, _ = jax.jit(ref.update)(g, ref.init(g))
    out, _ = jax.jit(got.update)(g, got.init(g))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


def test_not_grouped_is_optax():
    g = _tree(3)
    want = optax.tree.norm(g)
    assert optim.global_norm(g, grouped=False) == want
    if jax.default_backend() not in optim._GPU:   # off GPUs grouped=True is optax's too
        assert optim.global_norm(g) == want
