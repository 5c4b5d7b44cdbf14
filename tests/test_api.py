"""The public op's validation, impl choice and the registry (every impl's numerics: contract.py)."""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax import registry
from conftest import random_problem, rel_err
from contract import ImplContract


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


def test_jit_and_auto(rng):
    q, kv, idx, sink = random_problem(rng, T=8)
    f = jax.jit(lambda q, kv, idx, s: csa_jax.sparse_attention(q, kv, idx, s))
    o1, _ = f(q, kv, idx, sink)
    o2, _ = csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")
    assert rel_err(o1, o2) < 1e-6


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


@pytest.mark.parametrize("H, D, want", [
    (1, 512, ("gluon", "pallas_triton")), (8, 512, ("gluon", "pallas_triton")),
    (12, 512, ("gluon", "pallas_triton")), (16, 512, ("gluon", "pallas_triton")),
    (17, 512, ("gluon", "pallas_triton")), (32, 512, ("gluon", "pallas_triton")),
    (48, 512, ("gluon", "pallas_triton")), (64, 512, ("gluon", "pallas_triton")),
    (128, 512, ("gluon", "pallas_triton")), (16, 128, ("pallas_triton",)),
    (128, 256, ("pallas_triton",)),
])
def test_auto_order_table(H, D, want):
    """registry.AUTO_GPU by head-count bucket (the padded head count) and D; other platforms
    keep the registration order."""
    assert registry.auto_order("gpu", (1, 8, H, D)) == want
    assert registry.auto_order("tpu", (1, 8, H, D)) == ("pallas_tpu",)
    assert registry.auto_order("cpu", (1, 8, H, D)) == ()


def test_auto_table_names_gpu_auto_impls():
    """Every impl the table names is registered and may be auto-picked on GPUs."""
    for order in (*registry.AUTO_GPU.values(), registry.AUTO_GPU_OTHER_D):
        for name in order:
            assert "gpu" in registry.get(name).auto, name
    assert {b for b, _ in registry.AUTO_GPU} == {8, 16, 32, 64}


@pytest.mark.parametrize("H, D, dtype, refuse, want", [
    (8, 512, jnp.bfloat16, (), "gluon"),                   # H100 cr0 fwd 0.83 vs 0.49 ms
    (16, 512, jnp.bfloat16, (), "gluon"),                  # the step with its own backward
    (32, 512, jnp.bfloat16, (), "gluon"),                  # cr0 fwd 0.94 vs 0.83 ms
    (64, 512, jnp.bfloat16, (), "gluon"),
    (128, 512, jnp.float16, (), "gluon"),
    (16, 128, jnp.bfloat16, (), "pallas_triton"),          # no gluon row at D = 128
    (64, 512, jnp.bfloat16, ("gluon",), "pallas_triton"),  # gluon cannot run: the next one
    (32, 512, jnp.bfloat16, ("pallas_triton",), "gluon"),
    (32, 512, jnp.bfloat16, ("gluon",), "pallas_triton"),
    (16, 512, jnp.float32, ("gluon", "pallas_triton"), "xla"),
])
def test_auto_choice_per_heads_on_a_simulated_h200(monkeypatch, H, D, dtype, refuse, want):
    """resolve("auto") on a simulated H200 follows AUTO_GPU, skipping what refuses the problem.
    The capability checks are simulated (`refuse`: the impls whose unsupported() says no), so
    the choice does not depend on the installed extras or on a kernel's own extra limits."""
    def unsupported(self, q_shape, kv_shape, idx_shape, dt):
        return f"simulated: {self.name} refuses" if self.name in refuse else None

    monkeypatch.setattr(registry.Impl, "unsupported", unsupported)
    got = registry.resolve("auto", (1, 8, H, D), (1, 8, D), (1, 8, 4), dtype, "gpu")
    assert got.name == want


def test_registry_entries():
    assert registry.names()[:1] == ("xla",) and "pallas_mosaic_gpu" not in registry.choices()
    assert set(registry.available_impls()) >= {"xla", "pallas_tpu", "pallas_triton"}
    for name in registry.names():
        impl = registry.get(name)
        hash(impl)                                   # the static argument of the custom_vjp
        assert impl.name == name and registry.get(impl) is impl
        if impl.unavailable() is None:
            for attr in ("Config", "default_config", "forward", "backward"):
                assert hasattr(impl.mod, attr), (name, attr)
    # an always-present impl is its module itself: the op's imports lead to its kernels
    from csa_jax.kernels import tpu, triton
    assert registry.get("pallas_tpu").module is tpu
    assert registry.get("pallas_triton").module is triton
    with pytest.raises(ValueError, match="already taken"):
        registry.register(registry.Impl("xla", csa_jax.reference, platforms=("cpu",)))


def test_optional_impl_reports_the_extra_to_install():
    """An optional impl whose module or pinned packages are missing is registered but not
    available, says which extra installs it, and raises that when requested."""
    ghost = registry.Impl("ghost", "csa_jax.kernels.no_such_module", platforms=("gpu",),
                          extra="ghost", requires=("no-such-dist==1.0",))
    why = ghost.unavailable()
    assert why.startswith("impl='ghost' is not available: install csa_jax[ghost]")
    assert "no-such-dist is not installed" in why
    with pytest.raises(registry.ImplUnavailable, match=r"install csa_jax\[ghost\]"):
        ghost.mod
    no_module = registry.Impl("ghost2", "csa_jax.kernels.no_such_module", platforms=("gpu",),
                              extra="ghost2")
    assert "no module csa_jax.kernels.no_such_module" in no_module.unavailable()
    gluon = registry.get("gluon")
    assert gluon.extra == "gluon" and gluon.requires == ("triton==3.6.0", "jax-triton==0.3.1")
    if gluon.unavailable() is not None:
        assert "install csa_jax[gluon]" in gluon.unavailable()
        with pytest.raises(NotImplementedError, match=r"install csa_jax\[gluon\]"):
            csa_jax.sparse_attention(*random_problem(np.random.default_rng(0), T=4),
                                     impl="gluon")


def test_every_available_impl_runs_the_contract():
    """Each available registered impl has a test file with an ImplContract subclass naming it."""
    tests = pathlib.Path(__file__).parent
    named = set()
    for path in tests.glob("test_*.py"):
        for line in path.read_text().splitlines():
            if line.strip().startswith("IMPL = "):
                named.add(line.split("=", 1)[1].strip().strip("\"'"))
    missing = set(registry.available_impls()) - named
    assert not missing, f"no ImplContract subclass for {sorted(missing)}"
    assert ImplContract.IMPL == ""                   # the base itself is never collected
