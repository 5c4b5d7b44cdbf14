"""The fused indexer-scores Triton kernel (csa_jax/kernels/triton/indexer.py), in interpret mode
off-GPU: the scores of csa_jax.indexer_scores to f32 rounding (the -inf pattern exactly), the same
top-k ids through indexer_topk(scores="kernel"), and its refusals."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax import compressor
from csa_jax.kernels.triton import indexer as tki


def _inputs(B=1, T=256, Hi=4, Di=32, ratio=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, Hi, Di), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T // ratio, Di), jnp.bfloat16)
    w = jax.random.normal(ks[2], (B, T, Hi), jnp.float32)
    return q, k, w


@pytest.mark.parametrize("skip", [True, False])
def test_kernel_scores_match_xla(skip):
    q, k, w = _inputs(B=2)
    ref = np.asarray(csa_jax.indexer_scores(q, k, w, ratio=4))
    got = np.asarray(tki.indexer_scores(q, k, w, ratio=4, skip=skip))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert fin.sum() > 1000 and np.isfinite(got[fin]).all()
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5 * np.abs(ref[fin]).max())


@pytest.mark.parametrize("select", ["prefix", "top_k"])
def test_topk_through_the_kernel(monkeypatch, select):
    q, k, w = _inputs(T=512, seed=1)
    monkeypatch.setattr(compressor, "_PREFIX_MIN_SCORES", 1)   # the banded path at this size
    want = compressor.indexer_topk(q, k, w, ratio=4, topk=16, select=select, scores="xla")
    got = compressor.indexer_topk(q, k, w, ratio=4, topk=16, select=select, scores="kernel")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_scores_refusals():
    q, k, w = _inputs()
    assert not compressor._kernel_scores("auto", q, k) or jax.default_backend() == "gpu"
    with pytest.raises(ValueError, match="scores='fused' must be one of"):
        compressor.indexer_topk(q, k, w, ratio=4, topk=8, scores="fused")
    with pytest.raises(ValueError, match="dtype float32: the kernel takes bf16"):
        compressor.indexer_topk(q.astype(jnp.float32), k.astype(jnp.float32), w, ratio=4,
                                topk=8, scores="kernel")
    with pytest.raises(ValueError, match="T=200, P=50: the kernel needs multiples of 64"):
        tki.indexer_scores(q[:, :200], k[:, :50], w[:, :200], ratio=4)
    with pytest.raises(ValueError, match="Hi=3, Di=32: the kernel needs powers of two"):
        tki.indexer_scores(q[:, :, :3], k, w[:, :, :3], ratio=4)


def test_layer_runs_the_kernel_scores_from_its_config():
    """CSAConfig.indexer_scores reaches indexer_topk: a bf16 cr4 layer gives the same output
    with the kernel's scores as with XLA's; a bad value names the choices."""
    from flax import nnx

    from csa_jax.layers import CSAAttention

    base = csa_jax.CSAConfig(d_model=64, num_heads=2, head_dim=32, rope_dim=16, q_rank=32,
                             o_groups=1, o_rank=32, window=16, topk=8, index_heads=2,
                             index_dim=32, ratio=4)
    x = jax.random.normal(jax.random.key(2), (1, 256, 64), jnp.bfloat16)
    outs = []
    for scores in ("xla", "kernel"):
        import dataclasses
        layer = CSAAttention(dataclasses.replace(base, indexer_scores=scores), dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0))
        outs.append(np.asarray(layer(x)[0], np.float32))
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="indexer_scores='fused' must be one of auto"):
        csa_jax.CSAConfig(indexer_scores="fused")


def test_auto_picks_the_kernel_where_measured(monkeypatch):
    """scores="auto" on an NVIDIA GPU (simulated: the Triton impl's own refusal lifted): the
    kernel for bf16 indexers of <= 16 heads (the measured shape), the XLA products for wider
    ones, f32 inputs and more than 2**26 scores."""
    from csa_jax.kernels import triton as tk
    monkeypatch.setattr(tk, "unsupported", lambda *a: None)
    z = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    assert compressor._kernel_scores("auto", z(1, 8192, 16, 64), z(1, 2048, 64))
    assert not compressor._kernel_scores("auto", z(1, 8192, 64, 128), z(1, 2048, 128))
    assert not compressor._kernel_scores("auto", z(1, 65536, 16, 64), z(1, 16384, 64))
    f = jax.ShapeDtypeStruct((1, 8192, 16, 64), jnp.float32)
    assert not compressor._kernel_scores("auto", f, jax.ShapeDtypeStruct((1, 2048, 64),
                                                                         jnp.float32))
    assert not compressor._kernel_scores("xla", z(1, 8192, 16, 64), z(1, 2048, 64))
