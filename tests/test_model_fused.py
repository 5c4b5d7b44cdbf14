"""train.model's hand-written backwards (ModelConfig.swiglu, ModelConfig.norm): the same values and
gradients as XLA's autodiff of jax.nn.silu(a) * b and of nnx.RMSNorm, and the same parameters."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train.config import ConfigError, ModelConfig
from train.model import DecoderLM, FusedRMSNorm, SwiGLU, swiglu
from csa_jax.layers import rms_norm_layer


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_norm_matches_nnx(dtype):
    x = (jax.random.normal(jax.random.key(2), (2, 8, 32), jnp.float32) * 3).astype(dtype)
    g = jax.random.normal(jax.random.key(3), (2, 8, 32), jnp.float32).astype(dtype)
    outs = []
    for norm in (rms_norm_layer(32, eps=1e-6),
                 FusedRMSNorm(32, epsilon=1e-6, param_dtype=jnp.float32, rngs=nnx.Rngs(0))):
        norm.scale[...] = jnp.linspace(0.5, 1.5, 32)
        graph, params = nnx.split(norm)
        f = lambda p, x: nnx.merge(graph, p)(x).astype(dtype)  # noqa: E731
        y, vjp = jax.vjp(f, params, x)
        outs.append((y, vjp(g)))
    np.testing.assert_array_equal(np.asarray(outs[1][0], np.float32),
                                  np.asarray(outs[0][0], np.float32))   # forward: same bits
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(outs[1][1]), jax.tree.leaves(outs[0][1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())


def test_fused_modes_keep_the_parameters():
    # the same parameter tree (eval_shape: no init run); the values come from the same
    # initialisers in the same order (the modes change only __call__)
    base = ModelConfig(layer_ratios=(0, 4))
    trees = [nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda cfg=cfg: DecoderLM(cfg, rngs=nnx.Rngs(params=0)))))
        for cfg in (base, base.replace(norm="fused", swiglu="gemm"))]
    assert jax.tree.map(lambda a: (a.shape, a.dtype), trees[0]) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), trees[1])
    with pytest.raises(ConfigError, match="norm='rms' must be one of nnx"):
        ModelConfig(norm="rms")
