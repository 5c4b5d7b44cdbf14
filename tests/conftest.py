"""Shared test set-up: simulated devices, golden cases, tolerances, random problems, a dense oracle.

XLA_FLAGS must be set before anything imports jax: conftest is imported first by pytest.
"""
from __future__ import annotations

import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from csa_jax.problems import rel_err  # noqa: E402,F401  (the one rel_err; tests import it here)

# hypothesis's pytest plugin imports hypothesis lazily, in pytest_terminal_summary; importing it
# now keeps that hook instant. What once ended a passing xdist run with "PytestUnraisableException
# Warning ... gc_callback ... KeyboardInterrupt" was execnet's SIGINT to a worker whose session
# end outlasted 5 s: tests/_quiet_worker_exit.py explains it and makes the worker ignore it.
try:
    import hypothesis  # noqa: E402, F401
except ImportError:  # not installed: its plugin is not loaded either
    pass
from _quiet_worker_exit import pytest_sessionfinish  # noqa: E402, F401  (the hook itself)

REPO = pathlib.Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO / "tests" / "golden"   # copies of ../shared/golden (README there)
GOLDEN_FILES = {
    "cr0": "v4_sliding_attention_s0.npz",
    "cr4": "v4_compressed_sparse_attention_s0.npz",
    "cr8": "v4_heavily_compressed_attention_s0.npz",
}

# Relative tolerances (max-abs error / max-abs reference) by input dtype, in one place.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 5e-3}


def golden(name):
    path = GOLDEN_DIR / GOLDEN_FILES[name]
    if not path.exists():
        pytest.fail(f"golden case missing: {path} (tests/golden/ holds the three public cases)")
    return dict(np.load(path))


# The index-list fuzz (tests/contract.py): a fixed, small number of examples per impl (each runs
# a forward and a backward in interpret mode); fresh examples every run, printed on failure.
settings.register_profile(
    "ci", max_examples=6, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def assert_close(actual, expected, dtype, *, factor=1.0, what=""):
    """max|a - e| / max|e| (csa_jax.problems.rel_err) within the dtype's tolerance, after checking
    shapes and that inf/NaN sit at the same places."""
    tol = TOL[jnp.dtype(dtype)] * factor
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN in result"
    np.testing.assert_array_equal(np.isinf(a), np.isinf(e), err_msg=f"{what}: inf positions")
    err = rel_err(a, e)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} ({jnp.dtype(dtype).name})"


@pytest.fixture(scope="session")
def eight_devices():
    """The simulated devices the multi-device tests need (XLA_FLAGS above)."""
    if jax.device_count() < 8:
        pytest.fail(f"this test needs 8 devices, got {jax.device_count()}: XLA_FLAGS must hold "
                    "--xla_force_host_platform_device_count=8 before jax is imported")


@pytest.fixture
def rng():
    """A fresh seed every run, printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (2 ** 31))
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


def random_problem(rng, *, B=2, T=24, H=4, D=32, N=None, K=12, dtype=jnp.float32,
                   empty_frac=0.25, dup_frac=0.1, oob_frac=0.05, empty_rows=1, sink=True):
    """Random q/kv/idx/sink with -1 anywhere, duplicate rows, out-of-range ids, all-empty rows."""
    N = N or T + T // 4
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, N, D)).astype(np.float32)
    idx = rng.integers(0, N, size=(B, T, K)).astype(np.int32)
    dup = rng.random((B, T, K)) < dup_frac                     # copy slot 0's row into some slots
    idx = np.where(dup, idx[..., :1], idx)
    idx = np.where(rng.random((B, T, K)) < empty_frac, -1, idx)
    oob = rng.random((B, T, K)) < oob_frac
    idx = np.where(oob, rng.choice([N, N + 7, -2, -100], size=(B, T, K)), idx).astype(np.int32)
    for _ in range(empty_rows):
        idx[rng.integers(B), rng.integers(T)] = -1
    s = (rng.standard_normal(H) * 1.5).astype(np.float32) if sink else None
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(kv), jnp.asarray(idx), (None if s is None else jnp.asarray(s))


def emulated_gather_forward(q, kv, idx, ntiles, sink, *, T, N, BK, QK_SCALE):
    """What the Gluon gather forwards compute on their padded operands (fwd.py's, amd_fwd.py's,
    small_heads.py's; csa_spec.md section 3), for tests of their host side with the launch
    faked: q [R*Hp, D] (R = B*T token rows of Hp heads), kv [B*N, D], idx [R, K], ntiles [R]
    (tiles of BK slots read), sink [Hp]; QK_SCALE in the exp2 domain. (o [R*Hp, D] f32, lse
    [R*Hp])."""
    from csa_jax.common import EMPTY_LSE
    f32 = jnp.float32
    R, K = idx.shape
    D = q.shape[-1]
    rows = kv.reshape(R // T, N, D)[jnp.arange(R)[:, None] // T, jnp.maximum(idx, 0)].astype(f32)
    valid = ((idx >= 0) & (jnp.arange(K)[None, :] < (ntiles * BK)[:, None]))[:, None, :]
    s = jnp.einsum("thd,tkd->thk", q.reshape(R, -1, D).astype(f32), rows)
    s = jnp.where(valid, s * (QK_SCALE / 1.4426950408889634), -jnp.inf)
    m = jnp.maximum(jnp.max(s, axis=2), sink[None, :])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m_safe[..., None])
    l_tot = jnp.sum(e, axis=2) + jnp.exp(sink[None, :] - m_safe)
    o = jnp.einsum("thk,tkd->thd", e, rows) / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    lse = jnp.where(l_tot > 0, m_safe + jnp.log(jnp.where(l_tot > 0, l_tot, 1.0)), EMPTY_LSE)
    return o.reshape(-1, D), lse.reshape(-1)


def dense_oracle(q, kv, idx, sink, scale, do=None, dlse=None):
    """csa_spec.md section 3 in float64 numpy, straight from the formulas (no chunking, no tricks).

    Returns o, lse and, when do is given, dq, dkv, dsink of sum(o*do) + sum(lse*dlse).
    """
    q, kv = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, kv))
    idx = np.asarray(idx)
    B, T, H, D = q.shape
    N = kv.shape[1]
    valid = (idx >= 0) & (idx < N)
    safe = np.where(valid, idx, 0)
    rows = np.take_along_axis(kv[:, None, :, :], safe[..., None], axis=2)       # [B,T,K,D]
    rows = np.where(valid[..., None], rows, 0.0)                # an empty slot reads nothing
    s = scale * np.einsum("bthd,btkd->bthk", q, rows)
    s = np.where(valid[:, :, None, :], s, -np.inf)
    sk = np.full(H, -np.inf) if sink is None else np.asarray(sink, np.float64)
    m = np.maximum(s.max(-1, initial=-np.inf), sk[None, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    tot = np.exp(s - m_safe[..., None]).sum(-1) + np.exp(sk[None, None] - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(tot == 0, -1e30, m_safe + np.log(tot))
    # README's rule for non-finite input: a NaN or +inf among the used scores (or sink) -> NaN
    lse = np.where(np.isposinf(m), np.nan, lse)
    p = np.where(valid[:, :, None, :], np.exp(s - lse[..., None]), 0.0)
    o = np.einsum("bthk,btkd->bthd", p, rows)
    if do is None:
        return o, lse
    do = np.asarray(jnp.asarray(do, jnp.float32), np.float64)
    dlse = np.zeros_like(lse) if dlse is None else np.asarray(dlse, np.float64)
    delta = (o * do).sum(-1)
    dp = np.einsum("bthd,btkd->bthk", do, rows)
    ds = p * (dp - delta[..., None] + dlse[..., None])
    dq = scale * np.einsum("bthk,btkd->bthd", ds, rows)
    interm = np.einsum("bthk,bthd->btkd", scale * ds, q) + np.einsum("bthk,bthd->btkd", p, do)
    dkv = np.zeros_like(kv)
    for b in range(B):
        np.add.at(dkv[b], safe[b][valid[b]], interm[b][valid[b]])
    w = np.where(np.isfinite(sk)[None, None], np.exp(sk[None, None] - lse), 0.0)
    dsink = (w * (dlse - delta)).sum((0, 1))
    return o, lse, dq, dkv, dsink
