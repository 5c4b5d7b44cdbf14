"""The exact top-k threshold-select kernel (csa_jax/kernels/triton/topk.py), in interpret mode
off-GPU: lax.top_k's ids, in its order (descending score, ties by the lower id, -0.0 below +0.0),
-1 where a token sees fewer than k rows; through indexer_topk(select="kernel"); its refusals."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax import compressor
from csa_jax.kernels.triton import topk as tkt


def _masked(s, ratio=4):
    T, P = s.shape[-2:]
    t = np.arange(T)[:, None]
    return np.where(np.arange(P)[None] < (t + 1) // ratio, s, -np.inf).astype(np.float32)


def _want(s, k):
    v, i = jax.lax.top_k(jnp.asarray(s), k)
    return np.asarray(jnp.where(v > -jnp.inf, i, -1))


@pytest.mark.parametrize("case", ["normal", "ties", "signed_zeros", "constant"])
def test_select_matches_lax_top_k(case):
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 64, 64)).astype(np.float32)
    if case == "ties":
        s = np.round(s * 2) / 2
    elif case == "signed_zeros":
        s = np.where(rng.random(s.shape) < 0.5, 0.0, -0.0) * (rng.random(s.shape) < 0.7)
    elif case == "constant":
        s[:] = 1.0
    s = _masked(s)
    for k, rows, sort in ((16, 1, "pair"), (16, 4, "stable"), (64, 2, "pair")):
        got = np.asarray(tkt.select_topk(jnp.asarray(s), k, rows=rows, sort=sort))
        np.testing.assert_array_equal(got, _want(s, k), err_msg=f"{case} k={k} rows={rows}")
    # unordered: the same set per token, in id order, -1 after it
    got = np.asarray(tkt.select_topk(jnp.asarray(s), 16, ordered=False))
    want = np.sort(np.where(_want(s, 16) < 0, 1 << 20, _want(s, 16)), axis=-1)
    np.testing.assert_array_equal(got, np.where(want == 1 << 20, -1, want))


def test_indexer_topk_kernel_select_matches_top_k():
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (1, 256, 4, 32), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, 64, 32), jnp.bfloat16)
    w = jax.random.normal(ks[2], (1, 256, 4), jnp.float32)
    want = csa_jax.indexer_topk(q, k, w, ratio=4, topk=16, select="top_k", scores="xla")
    got = csa_jax.indexer_topk(q, k, w, ratio=4, topk=16, select="kernel", scores="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # off NVIDIA GPUs "auto" is "prefix" (the CPU default run keeps its path)
    assert compressor._kernel_select("auto", (1, 256, 64), 16) == tkt.on_nvidia()


def test_select_refusals():
    with pytest.raises(ValueError, match="k=80: must be an int in \\[1, P=64\\]"):
        tkt.select_topk(jnp.zeros((1, 64, 64), jnp.float32), 80)
    with pytest.raises(ValueError, match="rows \\* P = 16384 \\(P=5000 padded"):
        tkt.select_topk(jnp.zeros((1, 8, 5000), jnp.float32), 16, rows=2)
    with pytest.raises(ValueError, match="T=60, rows=8: rows must be a power of two dividing"):
        tkt.select_topk(jnp.zeros((1, 60, 64), jnp.float32), 16, rows=8)
    with pytest.raises(ValueError, match="select='kernel': k=0"):
        compressor._kernel_select("kernel", (1, 64, 48), 0)
    with pytest.raises(ValueError, match="sort='radix' must be one of"):
        tkt.select_topk(jnp.zeros((1, 64, 64), jnp.float32), 16, sort="radix")
    with pytest.raises(ValueError, match="indexer_select='fast' must be one of auto"):
        csa_jax.CSAConfig(indexer_select="fast")


def test_golden_and_padded_widths():
    """The golden cr4 case (P = 10, k = 4: both padded) gives lax.top_k's ids and the golden
    sets; so does an odd P / k on random scores."""
    from conftest import golden

    d = golden("cr4")
    k = int(d["topk_k"])
    got = np.asarray(csa_jax.indexer_topk(d["iq"], d["ik"], d["iw"], ratio=4, topk=k,
                                          select="kernel"))
    want = np.asarray(csa_jax.indexer_topk(d["iq"], d["ik"], d["iw"], ratio=4, topk=k,
                                           select="top_k"))
    np.testing.assert_array_equal(got, want)
    for b, t in np.ndindex(got.shape[:2]):
        assert set(got[b, t]) == set(d["topk"][b, t]), (b, t)
    s = _masked(np.random.default_rng(1).standard_normal((1, 40, 37)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(tkt.select_topk(jnp.asarray(s), 5)), _want(s, 5))


def test_select_probe_runs_and_checks(tmp_path):
    """benchmarks.topk_select_probe (interpret mode off-GPU): every ordered variant has
    lax.top_k's ids."""
    from benchmarks import topk_select_probe

    rows = topk_select_probe.main(["--seq-len", "128", "--topk", "8", "--tiles", "2x4",
                                   "--reps", "1", "--time-cap", "0.01",
                                   "--out", str(tmp_path / "p.json")])
    assert [r["probe"] for r in rows] == ["kernel_r2w4", "sort_pair", "sort_stable",
                                          "sort_unstable", "ordered_pair", "lax_top_k"]
    assert all(r["same_ids_as_lax_top_k"] for r in rows if "same_ids_as_lax_top_k" in r)
