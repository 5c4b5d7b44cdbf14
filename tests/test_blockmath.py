"""csa_jax/blockmath.py, the module every impl shares: online-softmax math, ring-slot arithmetic,
the CSR inverse map, and the small helpers (round_up, precision, resolve_interpret)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax import blockmath as bm


def test_blockmath_online_softmax_matches_direct(rng):
    h, k, d, bk = 3, 20, 8, 8
    s = rng.standard_normal((h, k)).astype(np.float32) * 4
    v = rng.standard_normal((k, d)).astype(np.float32)
    valid = rng.random(k) < 0.7
    sink = rng.standard_normal((h, 1)).astype(np.float32)
    m, l, acc = bm.init_state((h,), d)
    for j in range(0, k, bk):
        m, l, p, alpha = bm.softmax_update(m, l, s[:, j:j + bk], valid[None, j:j + bk])
        acc = alpha * acc + p @ v[j:j + bk]
    o, lse = bm.finalize(m, l, acc, sink)
    e = np.where(valid[None], np.exp(np.float64(s)), 0.0)
    tot = e.sum(1, keepdims=True) + np.exp(np.float64(sink))
    np.testing.assert_allclose(lse, np.log(tot), rtol=1e-5)
    np.testing.assert_allclose(o, (e / tot) @ v, rtol=1e-4, atol=1e-6)
    p = bm.recompute_p(jnp.asarray(s), lse, valid[None])
    np.testing.assert_allclose(p, e / tot, rtol=1e-5, atol=1e-7)
    # all-empty row, no sink: o = 0, lse = EMPTY_LSE, p = 0 (no exp overflow)
    m, l, acc = bm.init_state((h,), d)
    m, l, p, alpha = bm.softmax_update(m, l, jnp.asarray(s[:, :bk]), np.zeros((1, bk), bool))
    o, lse = bm.finalize(m, l, alpha * acc, -jnp.inf)
    assert np.all(np.asarray(p) == 0) and np.all(np.asarray(o) == 0)
    assert np.all(np.asarray(lse) == csa_jax.EMPTY_LSE)
    assert np.all(np.asarray(bm.recompute_p(jnp.asarray(s[:, :bk]), lse, np.zeros((1, bk), bool)))
                  == 0)


def test_blockmath_ring_arithmetic():
    depth, n_tiles = 3, 5
    la = bm.lookahead(depth)
    assert la == 2
    for i in range(40):
        # the slot that step i fills ahead is the one step i-1 consumed
        assert bm.ring_slot(i + la, depth) == bm.ring_slot(i - 1, depth)
        t, kt = bm.step_coords(i, n_tiles)
        assert bm.flat_step(t, kt, n_tiles) == i and 0 <= kt < n_tiles
    assert bm.num_tiles(17, 8) == 3 and bm.num_tiles(16, 8) == 2
    with pytest.raises(ValueError, match="depth=1"):
        bm.lookahead(1)


@pytest.mark.parametrize("narrow,search", [(False, None), (True, None), (False, "scan_unrolled")])
def test_inverse_map(rng, narrow, search):
    """Stable CSR of a [B, E] index list: row r's entries are its slots in slot order; empty
    (-1) slots, out-of-range ids and rows past num_kv belong to no row. narrow (int16 sort keys)
    and the unrolled search of the offsets (the GPU default) give the same rows."""
    idx = jnp.asarray(rng.integers(-1, 7, size=(2, 30)), jnp.int32)  # 5, 6: out of range
    idx = idx.at[1, :20].set(2)                                     # a hot row
    perm, key, offs = bm.inverse_map(idx, 5, 8, narrow=narrow, search=search)
    idx = jnp.where(idx < 5, idx, -1)
    for b in range(2):
        for r in range(8):
            ent = np.asarray(perm[b, offs[b, r]:offs[b, r + 1]])
            want = np.nonzero(np.asarray(idx[b]) == r)[0]
            np.testing.assert_array_equal(ent, want)       # stable: slot order kept
            assert np.all(np.asarray(key[b, offs[b, r]:offs[b, r + 1]]) == r)
        assert int(offs[b, -1]) == int((idx[b] >= 0).sum())


def test_small_helpers():
    assert [bm.round_up(x, 8) for x in (1, 8, 9)] == [8, 8, 16]
    assert bm.precision(jnp.float32) == jax.lax.Precision.HIGHEST
    assert bm.precision(jnp.bfloat16) is None
    assert bm.resolve_interpret(None, ("tpu",)) is (jax.default_backend() != "tpu")
    assert bm.resolve_interpret(None, (jax.default_backend(),)) is False
    assert bm.resolve_interpret(True, ("cpu",)) is True
