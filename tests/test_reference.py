"""The XLA reference against the golden cases and a float64 dense oracle, and the API's errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax import reference
from conftest import TOL, assert_close, dense_oracle, golden, random_problem, rel_err


def _grads(q, kv, idx, sink, do, dlse, **kw):
    """Gradients of sum(o*do) + sum(lse*dlse) w.r.t. q, kv, sink through sparse_attention."""
    def loss(q, kv, sink):
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse * dlse)
    return jax.grad(loss, argnums=(0, 1, 2) if sink is not None else (0, 1))(q, kv, sink)


@pytest.mark.parametrize("case", ["cr0", "cr4", "cr8"])
def test_golden(case):
    d = golden(case)
    q, kv, idx, sink = (jnp.asarray(d[k]) for k in ("q", "kv", "idx", "sink"))
    scale = float(d["scale"])
    o, lse = csa_jax.sparse_attention(q, kv, idx, sink, scale=scale, impl="xla")
    assert_close(o, d["o"], jnp.float32, what="o")
    _, lse_ref = dense_oracle(q, kv, idx, sink, scale)
    assert_close(lse, lse_ref, jnp.float32, what="lse")
    dq, dkv, dsink = _grads(q, kv, idx, sink, jnp.asarray(d["dO"]), jnp.zeros_like(lse),
                            scale=scale, impl="xla")
    for name, got in (("dq", dq), ("dkv", dkv), ("dsink", dsink)):
        assert_close(got, d[name], jnp.float32, what=name)


@pytest.mark.parametrize("dtype, dkv, chunk, with_sink", [
    (jnp.float32, "inverse_map", None, True),     # one chunk
    (jnp.float32, "inverse_map", 8, False),       # three chunks, no sink
    (jnp.float32, "scatter", 7, True),            # chunks with token padding
    (jnp.float32, "inverse_map", 7, True),
    (jnp.bfloat16, "inverse_map", 8, True),
    (jnp.bfloat16, "scatter", None, False),
])
def test_against_dense_oracle(rng, dtype, dkv, chunk, with_sink):
    q, kv, idx, sink = random_problem(rng, T=21, dtype=dtype, sink=with_sink)
    B, T, H, D = q.shape
    scale = 0.7 * D ** -0.5
    cfg = reference.Config(chunk_tokens=chunk, dkv=dkv)
    o, lse = csa_jax.sparse_attention(q, kv, idx, sink, scale=scale, impl="xla", config=cfg)
    do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    o_r, lse_r, dq_r, dkv_r, dsink_r = dense_oracle(q, kv, idx, sink, scale, do, dlse)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert_close(o, o_r, dtype, what="o")
    assert_close(lse, lse_r, dtype, what="lse")
    grads = _grads(q, kv, idx, sink, do, dlse, scale=scale, impl="xla", config=cfg)
    # bf16 gradients pass through bf16 products twice (p and ds are rounded): allow 2x.
    for name, got, ref in zip(("dq", "dkv", "dsink"), grads, (dq_r, dkv_r, dsink_r)):
        assert got.dtype == (jnp.float32 if name == "dsink" else dtype)
        assert_close(got, ref, dtype, factor=2.0, what=name)


def test_lse_gradient_alone(rng):
    """Differentiating only lse (o unused) exercises the dlse terms of ds and dsink."""
    q, kv, idx, sink = random_problem(rng, T=16)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    g = jax.grad(lambda q, kv, s: jnp.sum(csa_jax.sparse_attention(q, kv, idx, s, impl="xla")[1]
                                          * dlse), argnums=(0, 1, 2))(q, kv, sink)
    _, _, dq, dkv, dsink = dense_oracle(q, kv, idx, sink, q.shape[-1] ** -0.5,
                                        jnp.zeros(q.shape), dlse)
    for got, ref in zip(g, (dq, dkv, dsink)):
        assert_close(got, ref, jnp.float32)


def test_empty_rows_and_out_of_range(rng):
    q, kv, idx, sink = random_problem(rng, T=10, empty_rows=0)
    N = kv.shape[1]
    idx = np.array(idx)
    idx[0, 3] = -1                                    # all empty
    idx[1, 5] = [N + i for i in range(idx.shape[2])]  # all out of range -> all empty
    idx = jnp.asarray(idx)
    for s in (sink, None):
        o, lse = csa_jax.sparse_attention(q, kv, idx, s, impl="xla")
        assert np.all(np.asarray(o[0, 3]) == 0) and np.all(np.asarray(o[1, 5]) == 0)
        want = np.asarray(s) if s is not None else np.full(q.shape[2], csa_jax.EMPTY_LSE)
        np.testing.assert_allclose(np.asarray(lse[0, 3]), want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse[1, 5]), want, rtol=1e-6)
        g = jax.grad(lambda q, kv: jnp.sum(csa_jax.sparse_attention(q, kv, idx, s)[0]) +
                     jnp.sum(csa_jax.sparse_attention(q, kv, idx, s)[1]), argnums=(0, 1))(q, kv)
        assert all(np.isfinite(np.asarray(x)).all() for x in g)
    # every id outside [0, N) behaves exactly like -1
    clean = jnp.where((idx >= 0) & (idx < N), idx, -1)
    a = csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")
    b = csa_jax.sparse_attention(q, kv, clean, sink, impl="xla")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_slot_order_and_padding_do_not_matter(rng):
    q, kv, idx, sink = random_problem(rng, T=12, oob_frac=0.0)
    perm = rng.permutation(idx.shape[2])
    padded = jnp.concatenate([idx[..., perm], -jnp.ones(idx.shape[:2] + (5,), jnp.int32)], -1)
    a = csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")
    b = csa_jax.sparse_attention(q, kv, padded, sink, impl="xla")
    for x, y in zip(a, b):
        assert rel_err(x, y) < 1e-6


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
        f = jax.jit(reference._segment_reduce_deterministic, static_argnums=(2, 3))
        got = f(jnp.asarray(vals), jnp.asarray(targets), R, width)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_jit_and_auto(rng):
    q, kv, idx, sink = random_problem(rng, T=8)
    f = jax.jit(lambda q, kv, idx, s: csa_jax.sparse_attention(q, kv, idx, s))
    o1, _ = f(q, kv, idx, sink)
    o2, _ = csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")
    assert rel_err(o1, o2) < 1e-6


# ------------------------------------------------------------------------------- bad input


def _ok(rng):
    return random_problem(rng, B=2, T=6, H=3, D=8, K=4)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, kv, i, s: (q[0], kv, i, s), ValueError, r"q must be \[B, T, H, D\].*rank 3"),
    (lambda q, kv, i, s: (q, kv[0], i, s), ValueError, r"kv must be \[B, N, D\]"),
    (lambda q, kv, i, s: (q, kv, i[0], s), ValueError, r"idx must be \[B, T, K\]"),
    (lambda q, kv, i, s: (q, kv[:1], i, s), ValueError, r"batch sizes differ.*kv has B=1"),
    (lambda q, kv, i, s: (q, kv, i[:, :5], s), ValueError, r"idx has T=5 tokens but q has T=6"),
    (lambda q, kv, i, s: (q, kv[..., :7], i, s), ValueError, r"q has D=8, kv has D=7"),
    (lambda q, kv, i, s: (q, kv, i, s[:2]), ValueError, r"sink must be \[H\] = \[3\]"),
    (lambda q, kv, i, s: (q, kv, i.astype(jnp.float32), s), TypeError, r"idx.dtype=float32"),
    (lambda q, kv, i, s: (q, kv.astype(jnp.bfloat16), i, s), TypeError,
     r"kv.dtype=bfloat16 must equal q.dtype=float32"),
    (lambda q, kv, i, s: (q.astype(jnp.int32), kv.astype(jnp.int32), i, s), TypeError,
     r"q.dtype=int32"),
    (lambda q, kv, i, s: (q, kv, i, s.astype(jnp.int32)), TypeError, r"sink.dtype=int32"),
    (lambda q, kv, i, s: (q, kv, i[..., :0], s), ValueError, r"empty dimension"),
])
def test_bad_shapes_and_dtypes(rng, mutate, exc, match):
    args = mutate(*_ok(rng))
    with pytest.raises(exc, match=match):
        csa_jax.sparse_attention(*args, impl="xla")


def test_bad_options(rng):
    q, kv, idx, sink = _ok(rng)
    with pytest.raises(ValueError, match=r"impl='cuda' is unknown"):
        csa_jax.sparse_attention(q, kv, idx, sink, impl="cuda")
    with pytest.raises(NotImplementedError, match=r"impl='pallas_mosaic_gpu' is not implemented"):
        csa_jax.sparse_attention(q, kv, idx, sink, impl="pallas_mosaic_gpu")
    with pytest.raises(ValueError, match=r"scale=inf"):
        csa_jax.sparse_attention(q, kv, idx, sink, scale=float("inf"))
    with pytest.raises(TypeError, match=r"scale must be a Python float"):
        csa_jax.sparse_attention(q, kv, idx, sink, scale=jnp.float32(0.1) * jnp.ones(()))
    with pytest.raises(TypeError, match=r"config for impl='xla' must be csa_jax.reference.Config"):
        csa_jax.sparse_attention(q, kv, idx, sink, impl="xla", config=object())
    with pytest.raises(ValueError, match=r"dkv='fast' must be one of"):
        reference.Config(dkv="fast")
    with pytest.raises(ValueError, match=r"chunk_tokens=0"):
        reference.Config(chunk_tokens=0)
    with pytest.raises(ValueError, match=r"reduce_width=1"):
        reference.Config(reduce_width=1)


def test_tolerances_are_by_dtype():
    assert TOL[jnp.dtype(jnp.float32)] < TOL[jnp.dtype(jnp.bfloat16)]


@pytest.mark.parametrize("platform, kind, dtype, want", [
    ("gpu", "NVIDIA H200", jnp.bfloat16, "pallas_triton"),
    ("gpu", "NVIDIA H200", jnp.float32, "xla"),            # f32 stays on the exact reference
    ("gpu", "AMD Instinct MI300X", jnp.bfloat16, "xla"),   # never run on ROCm: explicit only
    ("cpu", "cpu", jnp.bfloat16, "xla"),
])
def test_auto_choice(monkeypatch, platform, kind, dtype, want):
    from csa_jax import api
    from csa_jax.kernels.triton import config as triton_config
    monkeypatch.setattr(api, "_platform", lambda: platform)
    monkeypatch.setattr(triton_config, "_device_kind", lambda: (platform, kind))
    assert api.resolve_impl("auto", (1, 8, 4, 32), (1, 8, 32), (1, 8, 4), dtype).name == want
    assert api.resolve_impl("xla", (1, 8, 4, 32), (1, 8, 32), (1, 8, 4), dtype).name == "xla"
