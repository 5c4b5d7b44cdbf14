"""train.model.swiglu (the hand-written SwiGLU backward) and ModelConfig.swiglu's modes: the same
values and gradients as XLA's autodiff of jax.nn.silu(a) * b."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train.config import ConfigError, ModelConfig
from train.model import SwiGLU, swiglu


def test_swiglu_vjp_matches_autodiff():
    ks = jax.random.split(jax.random.key(0), 3)
    a, b, g = (jax.random.normal(k, (4, 33), jnp.float32) * 3 for k in ks)
    ref = lambda a, b: jax.nn.silu(a) * b  # noqa: E731
    np.testing.assert_allclose(swiglu(a, b), ref(a, b), rtol=1e-6, atol=1e-6)
    got = jax.vjp(swiglu, a, b)[1](g)
    want = jax.vjp(ref, a, b)[1](g)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["act", "gemm"])
def test_mlp_modes_match_xla(mode):
    x = jax.random.normal(jax.random.key(1), (2, 8, 16), jnp.float32)
    outs = []
    for m in ("xla", mode):
        mlp = SwiGLU(16, 24, mode=m, rngs=nnx.Rngs(0))
        graph, params = nnx.split(mlp)
        loss = lambda p: jnp.sum(nnx.merge(graph, p)(x) ** 2)  # noqa: E731
        outs.append((mlp(x), jax.grad(loss)(params)))
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(outs[1][1]), jax.tree.leaves(outs[0][1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="swiglu='fast' must be one of xla"):
        ModelConfig(swiglu="fast")
