"""Compressor and lightning indexer against the golden cases and their definitions."""
from __future__ import annotations

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from conftest import assert_close, golden


@pytest.mark.parametrize("case", ["cr4", "cr8"])
def test_compress_golden(case):
    d = golden(case)
    pool = csa_jax.compress(d["x"], d["w_kv"], d["w_gate"], d["ape"], d["norm_scale"],
                            ratio=int(d["ratio"]))
    assert pool.shape == d["pool_prerope"].shape and pool.dtype == jnp.float32
    assert_close(pool, d["pool_prerope"], jnp.float32, what="pool rows")
    if case == "cr4":
        key = csa_jax.compress(d["x"], d["iw_kv"], d["iw_gate"], d["iape"], d["inorm_scale"],
                               ratio=4)
        assert_close(key, d["ikey_prerope"], jnp.float32, what="indexer keys")


def test_indexer_topk_golden_as_sets():
    d = golden("cr4")
    k = int(d["topk_k"])
    got = np.asarray(csa_jax.indexer_topk(d["iq"], d["ik"], d["iw"], ratio=4, topk=k))
    assert got.shape == d["topk"].shape and got.dtype == np.int32
    B, T, _ = got.shape
    for b in range(B):
        for t in range(T):
            assert set(got[b, t]) == set(d["topk"][b, t]), (b, t)


def _np_scores(q, k, w, ratio):
    q, k, w = (np.asarray(a, np.float64) for a in (q, k, w))
    s = np.einsum("bth,bths->bts", w, np.maximum(np.einsum("bthd,bsd->bths", q, k), 0))
    T, P = s.shape[1], s.shape[2]
    vis = np.arange(P)[None, :] < (np.arange(T)[:, None] + 1) // ratio
    return np.where(vis[None], s, -np.inf)


@pytest.mark.parametrize("T, ratio, topk", [(37, 4, 3), (64, 4, 100), (50, 8, 2)])
def test_indexer_scores_and_topk(rng, T, ratio, topk):
    B, Hi, Di = 2, 3, 8
    P = T // ratio
    q = rng.standard_normal((B, T, Hi, Di)).astype(np.float32)
    k = rng.standard_normal((B, P, Di)).astype(np.float32)
    w = rng.standard_normal((B, T, Hi)).astype(np.float32)
    want = _np_scores(q, k, w, ratio)
    got = np.asarray(csa_jax.indexer_scores(q, k, w, ratio=ratio))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    ids = np.asarray(csa_jax.indexer_topk(q, k, w, ratio=ratio, topk=topk))
    kk = min(topk, P)
    assert ids.shape == (B, T, kk)
    for b in range(B):
        for t in range(T):
            n_vis = min(kk, (t + 1) // ratio)
            row = ids[b, t]
            assert (row[n_vis:] == -1).all() and (row[:n_vis] >= 0).all()
            chosen = want[b, t, row[:n_vis]]
            assert np.all(np.diff(chosen) <= 1e-6)                  # descending score
            rest = np.delete(want[b, t], row[:n_vis])
            assert chosen.min(initial=np.inf) >= rest.max(initial=-np.inf) - 1e-5


def test_compress_gradient_and_leftover_tokens(rng):
    B, T, C, d, ratio = 1, 11, 6, 4, 4                 # 3 leftover tokens are not pooled
    x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
    w_kv = jnp.asarray(rng.standard_normal((C, 2 * d)), jnp.float32)
    w_g = jnp.asarray(rng.standard_normal((C, 2 * d)), jnp.float32)
    ape = jnp.asarray(rng.standard_normal((ratio, 2 * d)), jnp.float32)
    ns = jnp.ones((d,), jnp.float32)
    pool = csa_jax.compress(x, w_kv, w_g, ape, ns, ratio=ratio)
    assert pool.shape == (B, 2, d)
    x2 = x.at[:, 8:].set(123.0)
    np.testing.assert_array_equal(np.asarray(pool),
                                  np.asarray(csa_jax.compress(x2, w_kv, w_g, ape, ns, ratio=ratio)))
    g = jax.grad(lambda w: jnp.sum(csa_jax.compress(x, w, w_g, ape, ns, ratio=ratio) ** 2))(w_kv)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0
    jax.test_util.check_grads(lambda w: csa_jax.compress(x, w, w_g, ape, ns, ratio=ratio),
                              (w_kv,), order=1, modes=["rev"], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("call, match", [
    (lambda z: csa_jax.compress(z((2, 8)), z((4, 8)), z((4, 8)), z((4, 8)), z((4,)), ratio=4),
     r"x must be \[B, T, C\]"),
    (lambda z: csa_jax.compress(z((1, 8, 4)), z((4, 7)), z((4, 7)), z((4, 7)), z((4,)), ratio=4),
     r"w_kv must be \[C=4, 2\*d\]"),
    (lambda z: csa_jax.compress(z((1, 8, 4)), z((4, 8)), z((4, 8)), z((3, 8)), z((4,)), ratio=4),
     r"ape must have shape \(4, 8\)"),
    (lambda z: csa_jax.compress(z((1, 8, 4)), z((4, 8)), z((4, 8)), z((4, 8)), z((4,)), ratio=1),
     r"ratio=1 is not allowed"),
    (lambda z: csa_jax.indexer_topk(z((1, 8, 2, 4)), z((1, 3, 4)), z((1, 8, 2)), ratio=4, topk=2),
     r"k_idx has P=3 rows but T // ratio = 2"),
    (lambda z: csa_jax.indexer_topk(z((1, 8, 2, 4)), z((1, 2, 4)), z((1, 8, 2)), ratio=4, topk=0),
     r"topk must be a positive int"),
    (lambda z: csa_jax.indexer_scores(z((1, 8, 2, 4)), z((1, 2, 4)), z((1, 8, 3)), ratio=4),
     r"weights must have shape \(1, 8, 2\)"),
])
def test_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(lambda s: jnp.zeros(s, jnp.float32))


def test_presets_and_grid():
    p = csa_jax.preset("pro", 4)
    assert (p.num_heads, p.head_dim, p.topk, p.window, p.q_rank, p.o_groups) == (128, 512, 1024,
                                                                                128, 1536, 16)
    f = csa_jax.preset("flash", 128)
    assert (f.num_heads, f.topk, f.q_rank, f.o_groups) == (64, 0, 1024, 8)
    assert f.nominal_slots(16384) == 128 + 128 and p.nominal_slots(4096) == 128 + 1024
    assert csa_jax.preset("flash", 0).nominal_slots(4096) == 128
    assert len(csa_jax.BENCHMARK_GRID) == 18
    assert {s.seq_len for s in csa_jax.BENCHMARK_GRID} == {4096, 8192, 16384}
    assert csa_jax.forward_flops(4096, 128, 1152, 512) == 2 * 4096 * 128 * 1152 * 1024
    with pytest.raises(ValueError, match=r"ratio=8 has no preset"):
        csa_jax.preset("pro", 8)
    with pytest.raises(ValueError, match=r"family='mega'"):
        csa_jax.preset("mega", 4)
    with pytest.raises(ValueError, match=r"cr4 needs topk > 0"):
        csa_jax.CSAConfig(family="flash", ratio=4, num_heads=64)


@pytest.mark.parametrize("B, T, Hi, ratio, topk", [
    (2, 37, 3, 4, 3),       # T prime: 37 one-token chunks in 8 bands
    (1, 256, 4, 4, 16),
    (2, 64, 2, 4, 100),     # topk > P: every visible row, -1 tail
    (1, 1024, 2, 4, 40),    # 8 chunks of 128 tokens
    (1, 4096, 1, 4, 8),     # 16 chunks in 8 bands of 2 (the lax.map path)
])
def test_topk_prefix_equals_full_top_k(rng, monkeypatch, B, T, Hi, ratio, topk):
    """The default selection (visible prefix per band) returns exactly the ids of one top_k over
    all P rows, ties included (bf16 inputs make ties common)."""
    import csa_jax.compressor as comp

    monkeypatch.setattr(comp, "_PREFIX_MIN_SCORES", 0)  # the banded path even at these sizes
    P, Di = T // ratio, 8
    q = jnp.asarray(rng.standard_normal((B, T, Hi, Di)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, P, Di)), jnp.bfloat16)
    w = jnp.asarray(np.round(rng.standard_normal((B, T, Hi)), 1), jnp.float32)
    full = np.asarray(csa_jax.indexer_topk(q, k, w, ratio=ratio, topk=topk, select="top_k"))
    pre = np.asarray(csa_jax.indexer_topk(q, k, w, ratio=ratio, topk=topk))
    np.testing.assert_array_equal(pre, full)
    approx = np.asarray(csa_jax.indexer_topk(q, k, w, ratio=ratio, topk=topk, select="approx"))
    assert approx.shape == full.shape
    for b in range(B):  # approx: valid visible ids, no repeats, the -1 tail where full has it
        for t in range(0, T, max(1, T // 64)):
            got = approx[b, t][approx[b, t] >= 0]
            assert len(set(got)) == len(got) and (got < (t + 1) // ratio).all()
            assert len(got) == (full[b, t] >= 0).sum()
    with pytest.raises(ValueError, match="select='sorted' must be one of"):
        csa_jax.indexer_topk(q, k, w, ratio=ratio, topk=topk, select="sorted")


def test_bf16_compressor_tracks_golden():
    """bf16 activations (bf16 x bf16 products, f32 accumulation and pooling): pool rows and
    gradients within the bf16 tolerance of f32. (That no f32 product is left in the backward is
    checked on the lowered HLO in test_perf_tools.py.)"""
    from csa_jax.compressor import einsum_f32acc

    d = golden("cr4")
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(d["x"]), bf(d["w_kv"]), bf(d["w_gate"]), jnp.asarray(d["ape"]),
            jnp.asarray(d["norm_scale"]))
    pool = csa_jax.compress(*args, ratio=4)
    assert pool.dtype == jnp.float32
    assert_close(pool, d["pool_prerope"], jnp.bfloat16, what="bf16 pool rows")

    def loss(x, w_kv, w_gate):
        return jnp.sum(csa_jax.compress(x, w_kv, w_gate, *args[3:], ratio=4) ** 2)

    g16 = jax.grad(loss, argnums=(0, 1))(*args[:3])
    g32 = jax.grad(loss, argnums=(0, 1))(*(jnp.asarray(a, jnp.float32) for a in args[:3]))
    for a, b, name in zip(g16, g32, ("x", "w_kv")):
        assert a.dtype == jnp.bfloat16
        assert_close(a, b, jnp.bfloat16, factor=2, what=f"bf16 d/d{name}")
    with pytest.raises(TypeError, match="one dtype"):
        einsum_f32acc("ij,jk->ik", args[0][0], args[1].astype(jnp.float32))
