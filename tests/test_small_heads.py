"""pallas_triton at the head counts of tensor parallelism (H = 8 / 16 / 32 per device) and its
small-H backward pathology (docs/small_heads.md).

- default_config for H >= 32 is pinned to its values at 14a1614 (the fix changes only H <= 16
  above D = 128), except the NVIDIA forward's 4 warps at H = 32 (measured 2026-12-02: Pro cr4
  T = 16384 5.53 ms against 8.68 with 8): NVIDIA and AMD, bf16 and f32, the V4 layer types and
  the `small` preset's D;
- at D = 512, H <= 16 keeps the 4-warp forward and takes the H = 32 backward tiling; at D = 128
  (the `small` preset, where it was measured) the narrow-heads backward stays;
- the H = 16, D = 512 kernels compile on the CPU for sm_90a, gfx942 and gfx950 without spills
  and inside the shared memory / LDS (the old narrow config's dq kernel spills on sm_90a: the
  cause, kept as a check that the compile report sees it);
- the new H = 16 config's gradients (both cotangents, -1 slots) equal the XLA reference.
"""
from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_problem
from csa_jax.kernels import triton as pallas_triton
from csa_jax.kernels.triton import config as tc

NVIDIA, AMD = ("gpu", "NVIDIA H200"), ("rocm", "gfx942")
# (q, kv, idx) shapes with H left open: V4 Pro layer types at T = 16384 and the `small`
# preset's D = 128 (cr4 and the hot-row cr128)
SHAPES = {"pro_cr4": ((1, 16384, 512), (1, 20480, 512), (1, 16384, 1152)),
          "pro_cr0": ((1, 16384, 512), (1, 16384, 512), (1, 16384, 128)),
          "pro_cr128": ((1, 16384, 512), (1, 16512, 512), (1, 16384, 256)),
          "d128_cr4": ((1, 8192, 128), (1, 10240, 128), (1, 8192, 640)),
          "d128_cr128": ((1, 8192, 128), (1, 8256, 128), (1, 8192, 192))}
# What default_config returned at 14a1614 (before the small-H fix), as the fields that differ
# from Config(): per device kind and dtype, plus reduce_split=128 on the D = 128 cr128 shape and
# block_h=32 at H = 32. AMD f32 raised ValueError there (block_k=8); see the test below. (The
# removed interm kernel's block_k_dkv / block_h_dkv, set there too, left Config on 2026-12-02;
# benchmarks/triton_asm_diff.py shows the default kernels unchanged by that.)
PINNED = {
    (NVIDIA, "bfloat16"): {},
    (NVIDIA, "float32"): dict(block_k=32, num_stages=2, block_h_dq=16),
    (AMD, "bfloat16"): dict(block_k=16, num_stages=2, block_k_dq=16, num_stages_dq=2,
                            slot_major_dq=False),
}


def _config(kind, H, shape, dtype):
    q, kv, idx = SHAPES[shape]
    with mock.patch.object(tc, "_device_kind", lambda: kind):
        return pallas_triton.default_config((*q[:2], H, q[2]), kv, idx, dtype)


def _diff(cfg):
    base = dataclasses.asdict(pallas_triton.Config())
    return {k: v for k, v in dataclasses.asdict(cfg).items() if base[k] != v}


@pytest.mark.parametrize("H", [32, 64, 128])
def test_default_config_unchanged_at_wide_heads(H):
    for (kind, dt), want in PINNED.items():
        for shape in SHAPES:
            exp = dict(want)
            if shape == "d128_cr128":
                exp["reduce_split"] = 128
            if H == 32:
                exp["block_h"] = 32
                if kind == NVIDIA:
                    exp["num_warps"] = 4
            got = _diff(_config(kind, H, shape, jnp.dtype(dt)))
            assert got == exp, (kind, H, shape, dt)


def test_amd_f32_default_config_is_valid():
    """AMD's 16-row tiles halved for f32 were 8 (not a Triton dot: ValueError at 14a1614)."""
    cfg = _config(AMD, 128, "pro_cr4", jnp.float32)
    assert (cfg.block_k, cfg.block_k_dq, cfg.block_h_dq, cfg.num_stages) == (16, 16, 16, 2)


@pytest.mark.parametrize("H", [8, 16])
def test_narrow_heads_backward_by_head_dim(H):
    """D = 512: the 4-warp forward, the backward tiling of H = 32; D = 128: the measured
    narrow-heads backward (64-slot dq tiles, interm='dq', 64-entry reduce steps)."""
    bwd = lambda c: (c.block_k_dq, c.num_warps_dq, c.num_stages_dq, c.interm,  # noqa: E731
                     c.block_r, c.slot_major_dq, c.reduce_split)
    for shape in ("pro_cr4", "pro_cr0", "pro_cr128"):
        small, wide = _config(NVIDIA, H, shape, jnp.bfloat16), _config(NVIDIA, 32, shape,
                                                                        jnp.bfloat16)
        assert bwd(small) == bwd(wide) == (32, 4, 3, "gemm", 32, True, 0), shape
        assert (small.num_warps, small.block_h, small.block_h_dq) == (4, 16, 16)
    for shape in ("d128_cr4", "d128_cr128"):
        c = _config(NVIDIA, H, shape, jnp.bfloat16)
        assert (c.num_warps, c.block_k_dq, c.interm, c.block_r) == (4, 64, "dq", 64)
    # one padded kernel for H = 8 and 16
    assert _config(NVIDIA, 8, "pro_cr4", jnp.bfloat16) == _config(NVIDIA, 16, "pro_cr4",
                                                                   jnp.bfloat16)


# ----------------------------------------------------------------------------- CPU compile

def _resources(target, H, **over):
    """{kernel name: resources} of pallas_triton's forward and backward at H heads, D = 512,
    K = 1152 (benchmarks/triton_compile.py's V4 shape with H replaced), compiled for target."""
    pytest.importorskip("triton.experimental.gluon")
    from benchmarks import triton_compile as tcm
    from csa_jax.kernels.gluon import adapter
    with mock.patch.dict(tcm.SHAPE, H=H):
        lowered = tcm.lowered_kernels(target, tcm.default_config(target, **over))
    out = {}
    for name, (text, nw, ns) in lowered.items():
        md, asm = tcm.compile_ttir(text, target, nw, ns)
        out[name] = adapter.asm_resources(asm, target, name=name, num_warps=nw,
                                          shared=md["shared"])
    return out


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("target", ["sm_90a", "gfx942", "gfx950"])
def test_small_heads_kernels_compile_without_spills(target):
    res = _resources(target, 16)
    assert set(res) == {"csa_triton_fwd", "csa_triton_dq", "csa_triton_dkv_reduce"}, sorted(res)
    for name, r in res.items():
        assert r["shared"] <= r["shared_limit"], r
        spills = r.get("spill_stores", 0) if target == "sm_90a" else r["vgpr_spill"]
        assert spills == 0 and r.get("scratch", 0) == 0, r
    if target == "sm_90a":
        # the cause (docs/small_heads.md): the narrow-heads backward at D = 512 spills ~2 KB
        old = _resources(target, 16, block_k_dq=64, interm="dq", block_r=64)
        assert old["csa_triton_dq"]["spill_stores"] > 1000, old["csa_triton_dq"]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_h32_four_warp_forward_compiles_for_sm90a():
    """The H = 32 default (4-warp forward, measured 1.20-1.57x faster than 8 warps on the H200)
    compiles for sm_90a inside the shared memory with the small spill it was measured with
    (140 B of stores at triton 3.6.0; 8 warps: none); the backward kernels as they were measured
    (the dq kernel's 44 B, unchanged since 14a1614: docs/small_heads.md; the reduce none)."""
    cfg = _config(NVIDIA, 32, "pro_cr4", jnp.bfloat16)
    assert (cfg.num_warps, cfg.block_h) == (4, 32)
    res = _resources("sm_90a", 32, num_warps=4)
    for name, r in res.items():
        assert r["shared"] <= r["shared_limit"], r
        limit = {"csa_triton_fwd": 256, "csa_triton_dq": 64}.get(name, 0)
        assert r.get("spill_stores", 0) <= limit and r.get("stack", 0) <= 512, (name, r)


# ----------------------------------------------------------------------------- numerics

@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_small_heads_default_config_gradients(rng):
    """H = 16 at D = 256 (> 128: the H = 32 backward tiling) under the H200's default config,
    interpret mode: o, lse and the gradients of a loss on both outputs equal impl='xla'."""
    import csa_jax
    q, kv, idx, sink = random_problem(rng, B=1, T=8, H=16, D=256, K=40, dtype=jnp.bfloat16)
    with mock.patch.object(tc, "_device_kind", lambda: NVIDIA):
        cfg = pallas_triton.default_config(q.shape, kv.shape, idx.shape, q.dtype)
    assert (cfg.interm, cfg.block_k_dq, cfg.num_warps) == ("gemm", 32, 4)
    w_o = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    w_l = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)

    def loss(impl, config):
        def f(q, kv, sink):
            o, lse = csa_jax.sparse_attention(q, kv, idx, sink, impl=impl, interpret=True,
                                              config=config)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(lse * w_l), (o, lse)
        return jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, kv, sink)

    grads, (o, lse) = loss("pallas_triton", cfg)
    ref, (o_x, lse_x) = loss("xla", None)
    assert_close(o, o_x, jnp.bfloat16, what="o")
    assert_close(lse, lse_x, jnp.bfloat16, what="lse")
    for name, got, exp in zip(("dq", "dkv", "dsink"), grads, ref):
        assert_close(got, exp, jnp.bfloat16, factor=2.0, what=name)
    assert np.isfinite(np.asarray(grads[0], np.float32)).all()
