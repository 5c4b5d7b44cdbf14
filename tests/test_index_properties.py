"""Property tests (hypothesis) of the index-list builders for any T, window and ratio, T not a
multiple of the ratio included, and chex's jit / no-jit variants of the builders.

The op-level fuzz (-1 anywhere, duplicates, out-of-range ids, empty rows against the dense
oracle, for every impl) is tests/contract.py's; this file covers the layer's side: the lists
that csa_jax.build_indices hands to the op."""
from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import csa_jax

# The "ci" profile of tests/conftest.py (fresh examples, no database, blob printed on failure)
# with more examples: the builders are cheap (eager jnp, a few small ops per new T).
PROPERTY = settings(max_examples=25, deadline=None)

ratios = st.one_of(st.sampled_from([0, 4, 8, 16, 128]), st.integers(2, 40))


def _expected_row(t, T, ratio, window):
    """The kv rows token t may see, as csa_spec.md section 4 defines them (a set)."""
    rows = set(range(max(0, t - window + 1), t + 1))
    if ratio and ratio != 4:
        rows |= {T + i for i in range(T // ratio) if (i + 1) * ratio - 1 <= t}
    return rows


@PROPERTY
@given(T=st.integers(1, 300), ratio=ratios.filter(lambda r: r != 4), window=st.integers(1, 64))
def test_build_indices_sees_exactly_the_spec_rows(T, ratio, window):
    idx = np.asarray(csa_jax.build_indices(T, ratio, window=window))
    P = T // ratio if ratio else 0  # leftover tokens (T mod ratio) are never pooled
    assert idx.shape == (T, window + P) and idx.dtype == np.int32
    assert idx.min() >= -1 and idx.max() < T + P
    for t in range(T):
        row = idx[t]
        assert (row[:window] <= t).all()  # the window part is causal
        live = [int(r) for r in row if r >= 0]
        assert len(live) == len(set(live))  # a builder never lists a row twice
        assert set(live) == _expected_row(t, T, ratio, window), t


@PROPERTY
@given(data=st.data())
def test_build_indices_cr4_maps_topk_to_kv_rows(data):
    """cr4: the indexer's pool-local ids (any of them -1, repeated, or any value the indexer
    could return) become kv rows T + id; -1 stays -1; the window part is the same as cr0's."""
    T = data.draw(st.integers(1, 120), label="T")
    window = data.draw(st.integers(1, 32), label="window")
    P = max(T // 4, 1)
    k = data.draw(st.integers(1, 8), label="k")
    lead = data.draw(st.sampled_from([(), (2,)]), label="batch")
    topk = data.draw(hnp.arrays(np.int32, lead + (T, k), elements=st.integers(-1, P - 1)),
                     label="topk")
    idx = np.asarray(csa_jax.build_indices(T, 4, window=window, pool_topk=jnp.asarray(topk)))
    assert idx.shape == lead + (T, window + k)
    np.testing.assert_array_equal(idx[..., window:], np.where(topk >= 0, topk + T, -1))
    win = np.broadcast_to(np.asarray(csa_jax.build_indices(T, 0, window=window)), lead + (T, window))
    np.testing.assert_array_equal(idx[..., :window], win)


@PROPERTY
@given(T=st.integers(1, 200), ratio=st.integers(2, 64))
def test_pool_rows_visible_only_after_their_last_token(T, ratio):
    p = np.asarray(csa_jax.pool_indices(T, ratio))
    assert p.shape == (T, T // ratio)
    t = np.arange(T)[:, None]
    i = np.arange(T // ratio)[None, :]
    np.testing.assert_array_equal(p, np.where((i + 1) * ratio - 1 <= t, i, -1))


class TestJitVariants(chex.TestCase):
    """The builders give the same lists traced under jit (static shapes) as eagerly."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_window_and_pool_lists(self):
        T, window, ratio = 37, 8, 8  # T not a multiple of the ratio
        build = self.variant(lambda: csa_jax.build_indices(T, ratio, window=window))
        idx = build()
        chex.assert_shape(idx, (T, window + T // ratio))
        chex.assert_type(idx, jnp.int32)
        chex.assert_trees_all_equal(idx, csa_jax.build_indices(T, ratio, window=window))

    @chex.variants(with_jit=True, without_jit=True)
    def test_cr4_lists(self):
        T, window = 22, 4
        topk = jnp.asarray(np.random.default_rng(0).integers(-1, T // 4, (2, T, 3)), jnp.int32)
        idx = self.variant(lambda tk: csa_jax.build_indices(T, 4, window=window, pool_topk=tk))(topk)
        chex.assert_shape(idx, (2, T, window + 3))
        chex.assert_trees_all_equal(idx, csa_jax.build_indices(T, 4, window=window, pool_topk=topk))
