"""The contract every impl runs: csa_spec.md section 3 through the public op.

Each impl's test file subclasses `ImplContract` once (tokamax's shared backend test base):

    class TestContract(ImplContract):
        IMPL = "pallas_triton"
        CONFIG = <a small Config, so interpret mode walks several tiles and programs>

and keeps only what is specific to that impl (races, layouts, lowering, config rules). An impl
without an interpret mode sets RUNS_ON (e.g. ("gpu",)); an optional impl whose extra is not
installed is skipped with the registry's reason.
tests/test_api.py checks that every available registered impl has such a subclass.

What the contract checks: the three golden cases (o, lse, dq, dkv, dsink; default config), the
float64 dense oracle (values and gradients of both outputs, f32 and bf16, with and without a
sink), a hypothesis fuzz of the index lists (-1 anywhere, out-of-range ids, duplicates, empty
rows) against the oracle, the gradient of lse alone, empty rows and slot-order invariance,
bit-identical repeated runs, and bad input.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import csa_jax
from csa_jax import registry
from conftest import assert_close, dense_oracle, golden, random_problem

# Fixed fuzz shapes (one compile per impl; hypothesis draws the index lists and the seed).
FUZZ_B, FUZZ_T, FUZZ_H, FUZZ_D, FUZZ_K, FUZZ_N = 2, 8, 4, 16, 12, 12


def value_and_grads(q, kv, idx, sink, do, dlse, **kw):
    """(o, lse) and the gradients (dq, dkv[, dsink]) of sum(o*do) + sum(lse*dlse) through the
    public op; do / dlse may be None (that output's cotangent is zero)."""
    def loss(q, kv, sink):
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, **kw)
        val = jnp.zeros((), jnp.float32)
        if do is not None:
            val = val + jnp.sum(o.astype(jnp.float32) * do)
        if dlse is not None:
            val = val + jnp.sum(lse * dlse)
        return val, (o, lse)

    argnums = (0, 1, 2) if sink is not None else (0, 1)
    grads, (o, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, kv, sink)
    return o, lse, grads


def check_against_oracle(q, kv, idx, sink, do, dlse, *, scale, grad_factor=2.0, **kw):
    """Values and gradients of both outputs against the float64 oracle, tolerance by dtype."""
    dt = q.dtype
    if do is not None:   # the cotangent the impl sees is in q.dtype: give the oracle the same
        do = jnp.asarray(do).astype(dt).astype(jnp.float32)
    o, lse, grads = value_and_grads(q, kv, idx, sink, do, dlse, scale=scale, **kw)
    ro, rlse, *rgrads = dense_oracle(q, kv, idx, sink, scale,
                                     jnp.zeros(q.shape) if do is None else do, dlse)
    chex.assert_shape(o, q.shape)
    chex.assert_shape(lse, q.shape[:3])
    chex.assert_type([o, lse, grads[0], grads[1]], [dt, jnp.float32, dt, dt])
    assert_close(o, ro, dt, what="o")
    assert_close(lse, rlse, dt, what="lse")
    # low-precision gradients pass through rounded products twice (p and ds): allow 2x
    for name, got, ref in zip(("dq", "dkv", "dsink"), grads, rgrads):
        assert_close(got, ref, dt, factor=grad_factor, what=name)
    return o, lse


class ImplContract:
    IMPL: str = ""
    CONFIG = None          # small tiles for the oracle, fuzz and determinism tests
    RUNS_ON: tuple[str, ...] | None = None   # backends it can run on here; None = any (an
                                             # interpret mode covers the CPU)

    @pytest.fixture(autouse=True)
    def _available(self):
        why = registry.get(self.IMPL).unavailable()
        if why is not None:
            pytest.skip(why)
        if self.RUNS_ON is not None and jax.default_backend() not in self.RUNS_ON:
            pytest.skip(f"impl={self.IMPL!r} runs on {self.RUNS_ON}, not on "
                        f"{jax.default_backend()!r}")

    def kw(self, config="small"):
        return dict(impl=self.IMPL, interpret=None,
                    config=self.CONFIG if config == "small" else config)

    # ------------------------------------------------------------------ golden cases

    @pytest.mark.parametrize("case", ["cr0", "cr4", "cr8"])
    def test_golden(self, case):
        g = golden(case)
        q, kv, idx, sink = (jnp.asarray(g[k]) for k in ("q", "kv", "idx", "sink"))
        scale = float(g["scale"])
        o, lse, (dq, dkv, dsink) = value_and_grads(q, kv, idx, sink, jnp.asarray(g["dO"]), None,
                                                   scale=scale, **self.kw(config=None))
        assert_close(o, g["o"], jnp.float32, what=f"{case} o")
        assert_close(lse, dense_oracle(q, kv, idx, sink, scale)[1], jnp.float32, what="lse")
        for name, got in (("dq", dq), ("dkv", dkv), ("dsink", dsink)):
            assert_close(got, g[name], jnp.float32, what=f"{case} {name}")

    # ------------------------------------------------------------------ dense oracle

    @pytest.mark.parametrize("dtype, with_sink", [(jnp.float32, True), (jnp.bfloat16, False)],
                             ids=["f32-sink", "bf16-nosink"])
    def test_dense_oracle(self, rng, dtype, with_sink):
        # H = 20, D = 24, K = 40: not multiples of any head block, lane width or tile.
        q, kv, idx, sink = random_problem(rng, T=10, H=20, D=24, K=40, dtype=dtype,
                                          sink=with_sink, empty_rows=2)
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
        check_against_oracle(q, kv, idx, sink, do, dlse, scale=0.7 * 24 ** -0.5, **self.kw())

    def test_lse_gradient_alone(self, rng):
        """Only lse is used (o's cotangent is zero): the dlse terms of ds and dsink."""
        q, kv, idx, sink = random_problem(rng, T=9, H=4, D=16, K=11)
        dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
        check_against_oracle(q, kv, idx, sink, None, dlse, scale=0.25, **self.kw())

    # ------------------------------------------------------------------ index-list fuzz

    def __init_subclass__(cls, **kw):
        """Each impl gets its own hypothesis test function (one function run by several test
        classes would share hypothesis' per-function state)."""
        super().__init_subclass__(**kw)

        @given(data=st.data())
        def test_index_fuzz(self, data):
            self.index_fuzz(data)

        test_index_fuzz.__doc__ = ImplContract.index_fuzz.__doc__
        cls.test_index_fuzz = test_index_fuzz

    def index_fuzz(self, data):
        """Index lists drawn by hypothesis: any ids in [-3, N+3) (so -1, other negatives and
        out-of-range ids anywhere), duplicates, whole rows empty; with and without a sink."""
        B, T, H, D, K, N = FUZZ_B, FUZZ_T, FUZZ_H, FUZZ_D, FUZZ_K, FUZZ_N
        ids = st.one_of(st.just(-1), st.integers(0, N - 1), st.integers(-3, N + 2))
        idx = data.draw(hnp.arrays(np.int32, (B, T, K), elements=ids), label="idx")
        empty = data.draw(st.lists(st.tuples(st.integers(0, B - 1), st.integers(0, T - 1)),
                                   max_size=3), label="empty rows")
        for b, t in empty:
            idx[b, t] = -1
        with_sink = data.draw(st.booleans(), label="sink")
        rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31 - 1), label="seed"))
        q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
        kv = jnp.asarray(rng.standard_normal((B, N, D)), jnp.float32)
        sink = jnp.asarray(rng.standard_normal(H) * 1.5, jnp.float32) if with_sink else None
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
        check_against_oracle(q, kv, jnp.asarray(idx), sink, do, dlse, scale=0.25, **self.kw())

    # ------------------------------------------------------------------ special values

    def test_empty_rows_out_of_range_and_slot_order(self, rng):
        q, kv, idx, sink = random_problem(rng, B=2, T=10, H=4, D=16, K=12, empty_rows=0)
        N = kv.shape[1]
        idx = np.array(idx)
        idx[0, 3] = -1                                    # all empty
        idx[1, 5] = [N + i for i in range(idx.shape[2])]  # all out of range -> all empty
        idx = jnp.asarray(idx)
        kw = self.kw()
        _, _, grads = value_and_grads(q, kv, idx, sink, jnp.ones(q.shape), jnp.ones(q.shape[:3]),
                                      **kw)
        chex.assert_tree_all_finite(grads)
        for s in (sink, None):
            o, lse = csa_jax.sparse_attention(q, kv, idx, s, **kw)
            assert np.all(np.asarray(o[0, 3]) == 0) and np.all(np.asarray(o[1, 5]) == 0)
            want = np.asarray(s) if s is not None else np.full(4, csa_jax.EMPTY_LSE, np.float32)
            np.testing.assert_allclose(np.asarray(lse[0, 3]), want, rtol=1e-6)
            np.testing.assert_allclose(np.asarray(lse[1, 5]), want, rtol=1e-6)
        # every id outside [0, N) behaves exactly like -1
        clean = jnp.where((idx >= 0) & (idx < N), idx, -1)
        a = csa_jax.sparse_attention(q, kv, idx, sink, **kw)
        b = csa_jax.sparse_attention(q, kv, clean, sink, **kw)
        chex.assert_trees_all_equal(a, b)
        # slot order and extra -1 padding do not matter
        perm = rng.permutation(idx.shape[2])
        padded = jnp.concatenate([clean[..., perm], -jnp.ones(idx.shape[:2] + (5,), jnp.int32)],
                                 -1)
        c = csa_jax.sparse_attention(q, kv, padded, sink, **kw)
        for x, y in zip(a, c):
            assert_close(x, y, jnp.float32, what="permuted and padded")

    # ------------------------------------------------------------------ determinism

    def test_bit_identical_runs(self, rng):
        """A skewed fan-in (half the slots on one row, like cr128's pool row 0): dkv is summed in
        a fixed order, so two runs give the same bits in every output and gradient."""
        q, kv, idx, sink = random_problem(rng, B=1, T=16, H=4, D=16, K=12, dup_frac=0.5)
        idx = idx.at[..., 1::2].set(0)
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
        first = value_and_grads(q, kv, idx, sink, do, dlse, **self.kw())
        again = value_and_grads(q, kv, idx, sink, do, dlse, **self.kw())
        chex.assert_trees_all_equal(first, again)

    # ------------------------------------------------------------------ bad input

    def test_bad_input(self, rng):
        q, kv, idx, sink = random_problem(rng, B=1, T=4, H=2, D=16, K=4)
        impl = registry.get(self.IMPL)
        with pytest.raises(TypeError, match=rf"config for impl='{self.IMPL}' must be "
                                            rf"{impl.mod.__name__}.Config"):
            csa_jax.sparse_attention(q, kv, idx, sink, impl=self.IMPL, config=object())
        with pytest.raises(ValueError, match=r"idx has T=3 tokens but q has T=4"):
            csa_jax.sparse_attention(q, kv, idx[:, :3], sink, impl=self.IMPL)
        with pytest.raises(TypeError, match=r"kv.dtype=bfloat16 must equal q.dtype=float32"):
            csa_jax.sparse_attention(q, kv.astype(jnp.bfloat16), idx, sink, impl=self.IMPL)
