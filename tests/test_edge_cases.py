"""Never silently wrong: non-finite inputs (one rule for every impl), edge shapes of every public
function, forward-mode autodiff, the structured-layout promise under jit, the Triton warning."""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from conftest import dense_oracle

IMPLS = ("xla", "pallas_triton", "pallas_tpu")


def _nonfinite_problem():
    """B=1, T=6, H=2: token 1 head 0 has a NaN in q; token 2 head 1 has +inf in q against
    positive kv rows (+inf scores); token 3 head 0 has -inf in one q entry (scores of either
    sign, so +inf among them); token 4 has one used slot; token 5 none (and a NaN in q that it
    never uses); kv row 0 is never used and holds NaN and inf (an empty slot must not read it)."""
    rng = np.random.default_rng(7)
    B, T, H, D, N, K = 1, 6, 2, 16, 8, 4
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, N, D)).astype(np.float32)
    idx = rng.integers(1, N, (B, T, K)).astype(np.int32)
    idx[0, 4, 1:] = -1
    idx[0, 5] = -1
    q[0, 1, 0, 3] = np.nan
    q[0, 2, 1, :] = np.inf
    kv[0, idx[0, 2]] = np.abs(kv[0, idx[0, 2]])
    q[0, 3, 0, 0] = -np.inf
    q[0, 5, 1, 0] = np.nan
    kv[0, 0, :8], kv[0, 0, 8:] = np.nan, np.inf
    sink = rng.standard_normal(H).astype(np.float32)
    return q, kv, idx, sink


@pytest.mark.parametrize("impl", IMPLS)
def test_nonfinite_rule(impl):
    """README: a NaN or +inf among a token's used scores makes that (token, head)'s o and lse
    NaN; everything else is exact, unused kv rows are never read."""
    q, kv, idx, sink = _nonfinite_problem()
    o, lse = csa_jax.sparse_attention(*map(jnp.asarray, (q, kv, idx, sink)), impl=impl)
    want_o, want_lse = dense_oracle(q, kv, idx, sink, 16 ** -0.5)
    bad = {(1, 0), (2, 1), (3, 0)}
    assert {tuple(x[1:]) for x in np.argwhere(np.isnan(want_lse))} == bad   # the oracle agrees
    got_bad = {tuple(int(v) for v in x[1:]) for x in np.argwhere(np.isnan(np.asarray(lse)))}
    assert got_bad == bad, f"{impl}: NaN lse at {got_bad}"
    o = np.asarray(o)
    for t, h in np.ndindex(6, 2):
        if (t, h) in bad:
            assert np.isnan(o[0, t, h]).all(), (impl, t, h)
        else:
            np.testing.assert_allclose(o[0, t, h], want_o[0, t, h], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(lse[0, t, h], want_lse[0, t, h], rtol=1e-5)


# ----------------------------------------------------------------------------- layout promise

@pytest.mark.parametrize("layout", ["cr0", "cr4", "cr128"])
def test_traced_layout_check_agrees_with_check_layout(rng, layout):
    from csa_jax import layouts
    from csa_jax.kernels import tpu as pt
    from test_pallas_tpu import _structured_problem
    _, kv, idx, _, lay = _structured_problem(rng, layout, T=20, w=6, ratio=4, topk=3, B=2)
    cfg = pt.Config(**lay)
    viol = jax.jit(lambda i: layouts.violations(i, layout, cfg.window, cfg.pool_ratio))
    pt.check_layout(idx, kv.shape[1], cfg)
    assert not np.asarray(viol(idx)).any()
    w = cfg.window
    breaks = [idx.at[1, 9, :w].set(jnp.roll(idx[1, 9, :w], 1).at[0].set(-1)),   # a row missing
              idx.at[1, 9, 0].set(idx[1, 9, 1]),                                # a row twice
              idx.at[1, 9, :w].set(jnp.where(idx[1, 9, :w] >= 0, idx[1, 9, :w] + 1, -1))]
    if layout == "cr0":
        breaks.append(idx.at[1, 9, w].set(3))                                   # after the window
    if layout == "cr128":
        breaks.append(idx.at[1, 9, w:].set(-1))                                 # pool missing
    for bad in breaks:
        with pytest.raises(ValueError, match=rf"idx\[1, 9, "):
            pt.check_layout(bad, kv.shape[1], cfg)
        got = np.argwhere(np.asarray(viol(bad)))
        assert got.tolist() == [[1, 9]], got


def test_broken_layout_promise_is_never_silently_wrong(rng):
    """pallas_tpu Config(layout="cr0") with an idx that breaks it: eager (concrete idx) raises
    before tracing; under jit the broken token's o and lse are NaN, the others exact, and the
    gradients of its batch row are NaN."""
    from csa_jax.kernels import tpu as pt
    from test_pallas_tpu import _structured_problem
    q, kv, idx, sink, lay = _structured_problem(rng, "cr0", T=12, w=4, B=2, H=2, D=16)
    bad = idx.at[1, 9, :].set(jnp.asarray([6, 7, -1, 9, -1, -1, 5], jnp.int32))
    cfg = pt.Config(block_t=8, block_k=8, depth=2, **lay)
    run = lambda q, kv, i, s: csa_jax.sparse_attention(q, kv, i, s, impl="pallas_tpu",
                                                       config=cfg)
    with pytest.raises(ValueError, match=r"layout='cr0': idx\[1, 9, 0:4\]"):
        run(q, kv, bad, sink)
    o, lse = jax.jit(run)(q, kv, bad, sink)
    want_o, want_lse = dense_oracle(q, kv, bad, sink, 16 ** -0.5)
    nan = np.isnan(np.asarray(lse))
    assert np.argwhere(nan.any(-1)).tolist() == [[1, 9]] and nan[1, 9].all()
    assert np.isnan(np.asarray(o)[1, 9]).all()
    keep = ~nan[..., None]
    np.testing.assert_allclose(np.where(keep, o, 0), np.where(keep, want_o, 0), atol=1e-5)
    dkv, dsink = jax.jit(jax.grad(lambda kv, s: jnp.sum(run(q, kv, bad, s)[0]), (0, 1)))(kv, sink)
    assert np.isnan(np.asarray(dkv)[1]).all() and not np.isnan(np.asarray(dkv)[0]).any()
    assert np.isnan(np.asarray(dsink)).all()


# ----------------------------------------------------------------------------- autodiff modes

@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_forward_mode_autodiff_names_the_limitation(rng, mode):
    from conftest import random_problem
    q, kv, idx, sink = random_problem(rng, B=1, T=4, H=2, D=8, K=4)
    f = lambda q: csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")[0]
    with pytest.raises(NotImplementedError, match=r"reverse-mode autodiff only.*jax\.jvp"):
        if mode == "jvp":
            jax.jvp(f, (q,), (q,))
        else:
            jax.jacfwd(f)(q)
    jax.jacrev(f)(q)                                       # reverse mode works


# ----------------------------------------------------------------------------- edge shapes

def _z(*shape):
    return jnp.zeros(shape, jnp.float32)


@pytest.mark.parametrize("ratio,T", [(4, 3), (8, 7), (128, 100)])
def test_compress_shorter_than_ratio_is_an_empty_pool(ratio, T):
    coff = 2 if ratio == 4 else 1
    pool = csa_jax.compress(_z(2, T, 8), _z(8, coff * 4), _z(8, coff * 4), _z(ratio, coff * 4),
                            _z(4), ratio=ratio)
    assert pool.shape == (2, 0, 4) and pool.dtype == jnp.float32


@pytest.mark.parametrize("call,err,match", [
    (lambda: csa_jax.compress(_z(1, 0, 8), _z(8, 4), _z(8, 4), _z(8, 4), _z(4), ratio=8),
     ValueError, r"x has an empty dimension \(B=1, T=0, C=8\)"),
    (lambda: csa_jax.compress(_z(0, 8, 8), _z(8, 4), _z(8, 4), _z(8, 4), _z(4), ratio=8),
     ValueError, "B=0"),
    (lambda: csa_jax.compress(_z(1, 8, 8), _z(8, 0), _z(8, 0), _z(8, 0), _z(0), ratio=8),
     ValueError, "d must be >= 1"),
    (lambda: csa_jax.compress(_z(1, 8, 8), _z(8, 4), _z(8, 4), _z(8, 4), _z(4), ratio=0),
     ValueError, "ratio=0 is not allowed"),
    (lambda: csa_jax.compress(_z(1, 8, 8), _z(8, 4), _z(8, 4), _z(1, 4), _z(4), ratio=1),
     ValueError, "ratio=1 is not allowed"),
    (lambda: csa_jax.indexer_scores(_z(1, 0, 2, 4), _z(1, 0, 4), _z(1, 0, 2), ratio=4),
     ValueError, r"q_idx has an empty dimension \(B=1, T=0"),
    (lambda: csa_jax.indexer_topk(_z(1, 0, 2, 4), _z(1, 0, 4), _z(1, 0, 2), ratio=4, topk=2),
     ValueError, "T=0"),
    (lambda: csa_jax.indexer_scores(_z(1, 8, 0, 4), _z(1, 2, 4), _z(1, 8, 0), ratio=4),
     ValueError, "Hi=0"),
    (lambda: csa_jax.indexer_topk(_z(1, 8, 2, 4), _z(1, 2, 4), _z(1, 8, 2), ratio=0, topk=2),
     ValueError, "ratio=0 is not allowed"),
    (lambda: csa_jax.window_indices(0, 4), ValueError, "T must be a positive int, got T=0"),
    (lambda: csa_jax.window_indices(4, 0), ValueError, "window=0"),
    (lambda: csa_jax.pool_indices(8, 0), ValueError, "ratio=0 is not allowed"),
    (lambda: csa_jax.build_indices(0, 8), ValueError, "T=0"),
    (lambda: csa_jax.build_indices(8, 1), ValueError, "ratio=1 is not allowed"),
    (lambda: csa_jax.build_indices(8, 4), ValueError, "ratio=4 needs pool_topk"),
    (lambda: csa_jax.sparse_attention(_z(1, 0, 2, 4), _z(1, 4, 4), jnp.zeros((1, 0, 2), int)),
     ValueError, "empty dimension"),
    (lambda: csa_jax.sparse_attention(_z(1, 2, 2, 4), _z(1, 4, 4), jnp.zeros((1, 2, 0), int)),
     ValueError, "empty dimension"),
    (lambda: csa_jax.validate_indices(jnp.zeros((1, 2, 2), int), 0), ValueError, "num_kv=0"),
])
def test_edge_shapes_raise_clear_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_shorter_than_ratio_elsewhere_is_empty_not_an_error():
    """T < ratio: no pool row is visible, so pool lists and indexer outputs are [.., 0]."""
    assert csa_jax.pool_indices(3, 4).shape == (3, 0)
    assert csa_jax.build_indices(3, 8, window=2).shape == (3, 2)
    assert csa_jax.indexer_scores(_z(1, 3, 2, 4), _z(1, 0, 4), _z(1, 3, 2), ratio=4).shape == \
        (1, 3, 0)
    assert csa_jax.indexer_topk(_z(1, 3, 2, 4), _z(1, 0, 4), _z(1, 3, 2), ratio=4,
                                topk=2).shape == (1, 3, 0)


# ----------------------------------------------------------------------------- warnings

def test_deprecation_warning_silenced_only_around_own_lowering():
    """No process-wide filter: the dialect's deprecation warning (and a user's own warning of
    that text and category) stays visible, except while quiet_lowering() lowers our kernels."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    from csa_jax.kernels import triton as pt
    hides = lambda f: f[0] == "ignore" and f[1] is not None and f[1].match(
        "The Pallas Triton backend is deprecated")
    assert not any(hides(f) for f in warnings.filters), "a process-wide filter hides it"
    with warnings.catch_warnings(record=True) as rec:
        warnings.warn("The Pallas Triton backend is deprecated (a user's kernel)",
                      DeprecationWarning)
    assert [str(w.message) for w in rec] == [
        "The Pallas Triton backend is deprecated (a user's kernel)"]
    # pytest resets the filters per test, so check the process-wide state in a fresh process
    code = ("import warnings, csa_jax.kernels.triton\n"
            "with warnings.catch_warnings(record=True) as rec:\n"
            "    warnings.warn('The Pallas Triton backend is deprecated (user)', DeprecationWarning)\n"
            "print(len(rec))")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "1", (out.stdout, out.stderr[-800:])
    S = jax.ShapeDtypeStruct
    args = (S((1, 16, 16, 64), jnp.bfloat16), S((1, 20, 64), jnp.bfloat16),
            S((1, 16, 32), jnp.int32), S((16,), jnp.float32))
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    cfg = pt.Config(num_stages=2)
    for quiet in (True, False):        # a fresh jit each time, so each really lowers
        fwd = jax.jit(lambda *a: pt.forward(*a, scale=0.1, interpret=False,
                                                       config=cfg))
        with warnings.catch_warnings(record=True) as rec, use_abstract_mesh(mesh):
            warnings.simplefilter("always")
            with pt.quiet_lowering() if quiet else contextlib.nullcontext():
                fwd.trace(*args).lower(lowering_platforms=("cuda",))
        seen = [w for w in rec if re.match("The Pallas Triton backend is deprecated",
                                           str(w.message))]
        assert bool(seen) != quiet, (quiet, [str(w.message)[:60] for w in rec])
