"""The XLA reference ("xla"): the contract (tests/contract.py) and what is specific to it: chunking
with token padding, the two dkv strategies, the deterministic segment reduce, its Config."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax import reference
from conftest import assert_close, dense_oracle, random_problem, rel_err
from contract import ImplContract, check_against_oracle


class TestContract(ImplContract):
    IMPL = "xla"
    CONFIG = reference.Config(chunk_tokens=4)      # several chunks, the last one padded


@pytest.mark.parametrize("dtype, dkv, chunk, with_sink", [
    (jnp.float32, "scatter", 7, True),            # chunks with token padding
    (jnp.float32, "inverse_map", 8, False),       # three chunks, no sink
    (jnp.bfloat16, "scatter", None, False),       # one chunk
])
def test_chunking_and_dkv_modes_against_oracle(rng, dtype, dkv, chunk, with_sink):
    q, kv, idx, sink = random_problem(rng, T=21, dtype=dtype, sink=with_sink)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    check_against_oracle(q, kv, idx, sink, do, dlse, scale=0.7 * q.shape[-1] ** -0.5,
                         impl="xla", config=reference.Config(chunk_tokens=chunk, dkv=dkv))


def test_dkv_strategies_agree_and_inverse_map_is_deterministic(rng):
    # Skewed fan-in: half the slots hit row 0 (like cr128's pool row 0), many levels of the tree.
    q, kv, idx, sink = random_problem(rng, B=1, T=64, K=24, N=40, dup_frac=0.5)
    idx = idx.at[..., 1].set(0)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def dkv_of(mode, chunk):
        cfg = reference.Config(dkv=mode, chunk_tokens=chunk, reduce_width=2)
        f = jax.jit(lambda kv: jax.grad(lambda kv: jnp.sum(
            csa_jax.sparse_attention(q, kv, idx, sink, impl="xla", config=cfg)[0] * do))(kv))
        return np.asarray(f(kv))

    inv = dkv_of("inverse_map", 16)
    sca = dkv_of("scatter", 16)
    assert rel_err(inv, sca) < 1e-6
    assert_close(inv, dense_oracle(q, kv, idx, sink, q.shape[-1] ** -0.5, do)[3], jnp.float32)
    again = dkv_of("inverse_map", 16)
    assert inv.tobytes() == again.tobytes(), "inverse-map dkv is not bit-identical across runs"


def test_segment_reduce_tree(rng):
    """The deterministic gather-reduce on its own: every fan-in from 0 to all entries in one row."""
    E, R, D = 300, 7, 3
    targets = rng.integers(0, R, E).astype(np.int32)
    targets[:150] = 2                                   # one long list
    vals = rng.standard_normal((E, D)).astype(np.float32)
    want = np.zeros((R, D))
    np.add.at(want, targets, vals.astype(np.float64))
    for width in (2, 8):
        f = jax.jit(reference._segment_reduce_deterministic, static_argnums=(2, 3, 4))
        got = f(jnp.asarray(vals), jnp.asarray(targets), R, width, True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        # without the lax.cond (the GPU path: no host sync), the same sums bit for bit
        got2 = f(jnp.asarray(vals), jnp.asarray(targets), R, width, False)
        np.testing.assert_array_equal(np.asarray(got2), np.asarray(got))
        for skip in (True, False):
            jaxpr = jax.make_jaxpr(lambda v, t, skip=skip: reference._segment_reduce_deterministic(
                v, t, R, width, skip))(vals, targets)
            assert ("cond[" in str(jaxpr)) == skip


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"dkv='fast' must be one of"):
        reference.Config(dkv="fast")
    with pytest.raises(ValueError, match=r"chunk_tokens=0"):
        reference.Config(chunk_tokens=0)
    with pytest.raises(ValueError, match=r"reduce_width=1"):
        reference.Config(reduce_width=1)
