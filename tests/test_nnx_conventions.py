"""Flax NNX conventions of the layer and the model: the same init and numbers as before them
(tests/data/nnx_reference.npz, written by tests/_make_nnx_reference.py on the old layer),
dtype / param_dtype / kernel_init hooks, and the partition metadata that shardings are read from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _make_nnx_reference import LAYER_RATIOS, MODEL, layer_input, model_tokens, param_hashes
from comm.fsdp import logical_to_mesh, shardings_from_metadata
from csa_jax.layers import LOGICAL_AXIS_RULES, CSAAttention
from test_layers import make_layer, small_cfg
from train.config import ModelConfig
from train.model import DecoderLM

REF = dict(np.load(REPO / "tests" / "data" / "nnx_reference.npz"))


def _ref_hashes(prefix):
    return {k[len(prefix):]: str(v) for k, v in REF.items() if k.startswith(prefix)}


@pytest.mark.parametrize("ratio", LAYER_RATIOS)
def test_layer_init_and_output_unchanged(ratio):
    cfg = small_cfg(ratio)
    assert param_hashes(CSAAttention(cfg, rngs=nnx.Rngs(3))) == _ref_hashes(f"cr{ratio}/hash/")
    y, _ = make_layer(cfg, 3)(layer_input(ratio))
    # nnx.RMSNorm multiplies x by (rsqrt * scale) where the old norm did (x * rsqrt) * scale:
    # equal up to f32 rounding, not bit for bit.
    np.testing.assert_allclose(np.asarray(y), REF[f"cr{ratio}/y"], rtol=2e-5, atol=2e-6)


def test_model_init_and_logits_unchanged():
    model = DecoderLM(ModelConfig().replace(**MODEL), rngs=nnx.Rngs(params=5))
    assert param_hashes(model) == _ref_hashes("lm/hash/")
    logits, _ = model(model_tokens())
    np.testing.assert_allclose(np.asarray(logits), REF["lm/logits"], rtol=2e-5, atol=2e-5)


def test_dtype_param_dtype_and_kernel_init_hooks():
    cfg = small_cfg(4)
    x = layer_input(4)
    ref, _ = make_layer(cfg, 3, randomize=False)(x)
    bf = CSAAttention(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    y, _ = bf(x)  # f32 input, bf16 compute
    assert y.dtype == jnp.bfloat16 and bf.wq_a[...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=0.05 * float(jnp.abs(ref).max()))
    half = CSAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(half, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    zeros = CSAAttention(cfg, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(3))
    assert not np.asarray(zeros.wq_a[...]).any() and not np.asarray(zeros.indexer.ww[...]).any()
    assert np.asarray(zeros.wo_b[...]).any()  # out_kernel_init is its own hook
    ones = CSAAttention(cfg, out_kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(3))
    assert (np.asarray(ones.wo_b[...]) == 1).all()


def test_partition_metadata_and_mesh_specs(eight_devices):
    layer = CSAAttention(small_cfg(4), rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert specs["wq_b"].get_value() == P("q_lora", "heads")
    assert specs["wo_a"].get_value() == P("o_groups", None, "o_lora")
    assert specs["q_norm"]["scale"].get_value() == P()  # no metadata: replicated
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    rules = dict(LOGICAL_AXIS_RULES)
    # first dim that maps to an axis gets it; a later dim asking for the same axis does not
    assert logical_to_mesh(("embed", "q_lora"), (32, 24), mesh, rules) == P("fsdp", None)
    assert logical_to_mesh(("q_lora", "heads"), (24, 128), mesh, rules) == P("fsdp", "tensor")
    # an axis that does not divide the dim is dropped; unknown mesh axes too
    assert logical_to_mesh(("embed", "heads"), (32, 6), mesh, rules) == P("fsdp", None)
    assert logical_to_mesh(("embed", "heads"), (32, 8), jax.make_mesh((8,), ("fsdp",)), rules) == P("fsdp", None)


def test_tensor_parallel_forward_from_metadata(eight_devices):
    """Params placed by the metadata on a (fsdp=2, tensor=4) mesh: the jitted forward equals the
    unsharded one."""
    cfg = small_cfg(4)
    layer = make_layer(cfg, 3)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = shardings_from_metadata(params, mesh, dict(LOGICAL_AXIS_RULES))
    placed = jax.device_put(params, shardings)
    wq_b = placed["wq_b"][...]
    assert wq_b.sharding.spec == P("fsdp", "tensor") and len(wq_b.sharding.device_set) == 8
    assert placed["wo_b"][...].sharding.spec == P("tensor", "fsdp")
    x = layer_input(4)
    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p, rest)(x)[0])
    y_tp = fwd(placed, jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
    y_one = fwd(params, x)
    np.testing.assert_allclose(np.asarray(y_tp), np.asarray(y_one), rtol=2e-5, atol=1e-5)  # |y| ~ 5
