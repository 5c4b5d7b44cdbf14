"""impl="gluon" on a CPU: adapter plumbing, argument validation and compile-only kernel checks.

Gluon has no interpreter: numerics are checked on the GPU (benchmarks/gluon_check.py, results in
docs/perf/gluon_h200.md). The compile tests need the optional extra (triton 3.6.0) and skip with
that reason without it; they compile for sm_90a on the CPU with the wheel's bundled LLVM and
ptxas (a few seconds a kernel).
"""
from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import pytest

import csa_jax
from contract import ImplContract
from csa_jax.kernels import gluon as impl
from csa_jax.kernels.gluon import adapter


class TestContract(ImplContract):
    """The shared contract names every available impl (tests/test_api.py), but it cannot run for
    gluon in this suite: Gluon has no interpreter (CPU: nothing to run), and the contract's cases
    are float32, which gluon refuses (bf16/f16 wgmma; f32 stays on xla). gluon's numerics
    (random inputs with -1 / out-of-range / duplicate slots and empty rows, golden cases cast to
    bf16, gradients) are checked on the GPU by benchmarks/gluon_check.py, results in
    docs/perf/gluon_h200.md."""
    IMPL = "gluon"

    @pytest.fixture(autouse=True)
    def _available(self):
        pytest.skip("gluon: no CPU interpreter and no float32 kernel; checked on the GPU by "
                    "benchmarks/gluon_check.py (docs/perf/gluon_h200.md)")


def _need_triton():
    why = adapter.missing()
    if why:
        pytest.skip(why)


# ----------------------------------------------------------------------------- config


def test_config_defaults_fit_shared_memory():
    from csa_jax.kernels.gluon.dims import dq_shared_bytes, fwd_shared_bytes
    for D in (64, 128, 512):
        cfg = impl.default_config((1, 8, 64, D), (1, 16, D), (1, 8, 64), jnp.bfloat16)
        assert fwd_shared_bytes(D, cfg.block_k, cfg.stages) <= impl.SMEM_BUDGET
        assert dq_shared_bytes(D, cfg.bwd_block_k, cfg.bwd_stages) <= 232_448 - 8192
        assert cfg.stages % 2 == 0              # the alternating forward's ring parity
    # D = 512: q (64 KiB) + 2 stages of 64 rows (128 KiB); a third stage would not fit.
    c = impl.default_config((1, 8, 128, 512), None, (1, 8, 640), jnp.bfloat16)
    assert (c.block_k, c.stages, c.bwd_block_k, c.bwd_stages) == (64, 2, 32, 2)
    assert impl.default_config((1, 8, 64, 128), None, (1, 8, 64), jnp.bfloat16).stages == 4


def test_config_has_only_real_choices():
    """Ten fields (docs/gluon.md): no ablation or never-timed switch reaches the public op."""
    import dataclasses
    assert [f.name for f in dataclasses.fields(impl.Config)] == [
        "block_k", "stages", "layout", "window", "pool_ratio", "fwd_consumers", "bwd",
        "bwd_block_k", "bwd_stages", "bwd_dkv"]


@pytest.mark.parametrize("kw, match", [
    (dict(block_k=48), "block_k=48"),
    (dict(stages=0), "stages=0"),
    (dict(stages=True), "stages=True"),
    (dict(layout="cr8"), "layout='cr8'"),
    (dict(window=0), "window=0"),
    (dict(pool_ratio=1), "pool_ratio=1"),
    (dict(bwd="xla"), "bwd='xla'"),
    (dict(bwd_block_k=128), "bwd_block_k=128"),
    (dict(bwd_stages=5), "bwd_stages=5"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        impl.Config(**kw)


def test_odd_ring_depth_is_refused_by_the_nvidia_forward(monkeypatch):
    """stages=3 is a valid AMD ring depth but not for the alternating NVIDIA forward: a clear
    ValueError at the call, not a wrong result."""
    monkeypatch.setattr(impl, "_cannot_run", lambda *a: None)
    monkeypatch.setattr(impl, "_amd", lambda: None)
    q = jnp.zeros((1, 4, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="stages=3.*even ring depth"):
        impl.forward(q, jnp.zeros((1, 4, 64), jnp.bfloat16), jnp.zeros((1, 4, 64), jnp.int32),
                     jnp.zeros((64,)), scale=1.0, interpret=False, config=impl.Config(stages=3))


@pytest.mark.parametrize("family", ["flash", "pro"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_default_config_per_layer_and_promise(family, ratio):
    """Every V4 family and layer gets the same kernel tiles; the layout promise is passed
    through, and only cr0 with window 128 runs the window kernel (docs/perf/gluon_window_h200.md:
    faster than the gather kernel at cr0; cr128's window kernel was slower and is gone)."""
    from csa_jax.config import preset
    cfg = preset(family, ratio)
    H, D, K, T = cfg.num_heads, cfg.head_dim, cfg.window + cfg.topk, 4096
    c = impl.default_config((1, T, H, D), (1, T, D), (1, T, K), "bfloat16")
    assert c.layout == "generic" and not c.window_kernel
    kind = {0: "cr0", 4: "cr4", 128: "cr128"}[ratio]
    p = impl.default_config((1, T, H, D), (1, T, D), (1, T, K), "bfloat16", layout=kind,
                            window=cfg.window, pool_ratio=128)
    assert (p.layout, p.block_k, p.stages) == (kind, c.block_k, c.stages)
    assert p.window_kernel == (ratio == 0)
    assert not impl.Config(layout="cr0", window=64).window_kernel


def test_unsupported_on_cpu_names_the_reason():
    why = impl.unsupported((1, 8, 64, 512), (1, 16, 512), (1, 8, 64), jnp.bfloat16)
    assert why is not None and ("NVIDIA Hopper" in why or "triton" in why)


def test_sparse_attention_gluon_on_cpu_raises_clearly():
    q = jnp.zeros((1, 4, 2, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 4, 64), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 3), jnp.int32)
    # Without the extra the registry says so; with it, the module says why it cannot run here.
    with pytest.raises(NotImplementedError,
                       match="impl='gluon' (cannot run here|is not available)"):
        csa_jax.sparse_attention(q, kv, idx, impl="gluon")
    with pytest.raises(NotImplementedError, match="no interpreter"):
        impl.forward(q, kv, idx, jnp.zeros((2,)), scale=1.0, interpret=True,
                     config=impl.Config())


def test_registered_and_auto_never_picks_it_on_cpu():
    from csa_jax import registry
    assert "gluon" in registry.names() and "gpu" in registry.get("gluon").auto
    for platform in ("cpu", "gpu"):      # on this CPU-only install it cannot run: auto skips it
        got = registry.resolve("auto", (1, 4, 128, 512), (1, 4, 512), (1, 4, 3), jnp.bfloat16,
                               platform)
        assert got.name != "gluon"


def test_padded_dims():
    from csa_jax.kernels.gluon.dims import padded_dims
    assert padded_dims(128, 512, 1152, 64) == (128, 512, 1152)
    assert padded_dims(4, 128, 20, 64) == (64, 128, 64)
    assert padded_dims(100, 96, 130, 32) == (128, 128, 160)


# ----------------------------------------------------------------------------- adapter plumbing


def _fake_kernel(names):
    return types.SimpleNamespace(arg_names=names, __name__="k", is_gluon=lambda: True)


def test_build_signature_like_jax_triton():
    fn = _fake_kernel(["x", "y", "out", "BLOCK", "D"])
    sig, attrs, consts = adapter.build_signature(fn, ["*bf16", "*i32", "*fp32"],
                                                 {"BLOCK": 64, "D": 512})
    assert sig == {"x": "*bf16", "y": "*i32", "out": "*fp32", "BLOCK": "constexpr",
                   "D": "constexpr"}
    assert attrs == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]],
                     (2,): [["tt.divisibility", 16]]}
    assert consts == {"BLOCK": 64, "D": 512}


@pytest.mark.parametrize("types_, consts, match", [
    (["*bf16"], {"BLOCK": 1, "D": 2}, "2 runtime arguments|got 1 runtime"),
    (["*bf16", "i32", "*fp32"], {"BLOCK": 1, "D": 2}, "only array arguments"),
    (["*bf16", "*i32", "*fp32"], {"BLOCK": 1, "E": 2}, r"constexprs \['E'\]"),
    (["*bf16", "*i32", "*fp32", "*fp32"], {"y": 1}, "must come before"),
])
def test_build_signature_rejects(types_, consts, match):
    fn = _fake_kernel(["x", "y", "out", "BLOCK", "D"])
    with pytest.raises(TypeError, match=match):
        adapter.build_signature(fn, types_, consts)


def test_triton_type():
    assert adapter.triton_type(jnp.bfloat16) == "*bf16"
    assert adapter.triton_type(jnp.int32) == "*i32"
    with pytest.raises(TypeError, match="complex64"):
        adapter.triton_type(jnp.complex64)


def test_launch_problem():
    ok = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, tmem_size=0,
                               launch_pdl=False, launch_cooperative_grid=False, num_ctas=1)
    assert adapter.launch_problem(ok) is None
    for key, value, match in (("global_scratch_size", 256, "global scratch"),
                              ("tmem_size", 128, "tensor memory"),
                              ("launch_pdl", True, "dependent launch"),
                              ("num_ctas", 2, "num_ctas=2")):
        md = types.SimpleNamespace(**{**vars(ok), key: value})
        assert match in adapter.launch_problem(md)


def test_gluon_call_rejects_plain_functions():
    with pytest.raises(TypeError, match="not a Gluon kernel"):
        adapter.gluon_call(jnp.zeros(4), kernel=lambda x: x, out_shape=None, grid=(1,),
                           num_warps=4)


def test_gluon_call_without_gpu_jaxlib_names_the_extra():
    _need_triton()
    from csa_jax.kernels.gluon.dkv import csa_dkv_reduce_kernel
    try:
        import jax_triton  # noqa: F401
        pytest.skip("jax-triton imports here (GPU jaxlib): the launch path is tested on the GPU")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"csa_jax\[gluon\]"):
        adapter.gluon_call(jnp.zeros((4, 8)), kernel=csa_dkv_reduce_kernel,
                           out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(1,),
                           num_warps=4)


# ----------------------------------------------------------------------------- compile only


def _compile_fwd(D=512, K=1152, block_k=64, stages=2, dt="bf16", target="sm_90a"):
    from csa_jax.kernels.gluon import fwd, ring
    return adapter.compile_kernel(
        fwd.csa_fwd_kernel, ring.arg_types(dt),
        fwd.constexprs(T=64, N=256, NHB=2, D=D, K=K, BK=block_k, stages=stages,
                       scale=D ** -0.5),
        target=target, num_warps=fwd.NUM_WARPS)


@pytest.mark.parametrize("kw", [dict(), dict(D=64, K=64, stages=4),
                                dict(block_k=32, stages=4, dt="fp16")])
def test_forward_compiles_for_sm90a_without_spills(kw):
    """fwd.py: 12 warps = producer (default partition) + two 4-warp consumer workers at 216
    registers (setmaxnreg; the producer gets the other 72), shared memory within the limit,
    0 spills (it spilled 232 B before its q descriptors were kept in the loop), ptxas does not
    serialize the wgmmas, a full m64n(BK) S per tile and m64n(D/2) PV on wgmma, 16-byte
    cp.async gathers completing on mbarriers."""
    _need_triton()
    from csa_jax.kernels.gluon import fwd
    c = _compile_fwd(**kw)
    r = adapter.resources(c, "sm_90a")
    assert r["num_warps"] == 12 and r["launch_problem"] is None
    assert r["shared"] <= r["shared_limit"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas"]
    assert "C7514" not in r["ptxas"], r["ptxas"]     # ptxas: "wgmma ... serialized"
    ptx = c.asm["ptx"]
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{fwd.CONSUMER_REGS};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{fwd.producer_regs()};", ptx)
    bk, dh = kw.get("block_k", 64), kw.get("D", 512) // 2
    dt = "f16.f16" if kw.get("dt") == "fp16" else "bf16.bf16"
    assert f"wgmma.mma_async.sync.aligned.m64n{bk}k16.f32.{dt}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{dh}k16.f32.{dt}" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx


def test_forward_refuses_an_odd_ring():
    from csa_jax.kernels.gluon import fwd
    with pytest.raises(ValueError, match="even ring depth"):
        fwd.constexprs(T=64, N=256, NHB=1, D=512, K=128, BK=64, stages=3, scale=0.1)


def test_forward_grid_is_one_program_per_sm(monkeypatch):
    """The forward is persistent: min(rows, SMs) programs, each walking rows; the SM count is
    the GPU's core_count (132 where jax gives none, e.g. on a CPU)."""
    from csa_jax.kernels.gluon import fwd
    if jax.devices()[0].platform == "cpu":
        assert fwd.sm_count() == 132                 # no GPU backend: the H200's count
    monkeypatch.setattr(fwd, "sm_count", lambda: 78)
    assert fwd.grid(32768) == (78,) and fwd.grid(5) == (5,)
    assert fwd.constexprs(T=64, N=256, NHB=2, D=512, K=128, BK=64, stages=2, scale=0.1,
                          B=3)["ROWS"] == 3 * 64 * 2


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "gfx1250"])
def test_forward_is_nvidia_only(target):
    """The kernel uses NVIDIA-only ops (wgmma, NVMMA layouts, cp.async): the AMD targets refuse
    it at compile time (they run amd_fwd.py)."""
    _need_triton()
    with pytest.raises(Exception):
        _compile_fwd(K=128, target=target)


def test_resource_report_sm90a():
    """benchmarks/gluon_resources.py: the default NVIDIA kernels fit and do not spill (exit 0)."""
    _need_triton()
    from benchmarks import gluon_resources
    assert gluon_resources.main(["--targets", "sm_90a", "--kernels", "gluon_nv"]) == 0


@pytest.mark.parametrize("H, D, dtype, cc, want", [
    (128, 512, jnp.bfloat16, "9.0", "gluon"),
    (64, 512, jnp.float16, "9.0", "gluon"),
    (8, 512, jnp.bfloat16, "9.0", "gluon"),              # registry.AUTO_GPU: H <= 8
    (16, 512, jnp.bfloat16, "9.0", "gluon"),             # H = 16 / 32, a pool list (K = 1152)
    (32, 512, jnp.bfloat16, "9.0", "gluon"),
    (128, 128, jnp.bfloat16, "9.0", "pallas_triton"),
    (128, 512, jnp.float32, "9.0", "xla"),
    (128, 512, jnp.bfloat16, "8.0", "pallas_triton"),    # not Hopper
])
def test_auto_choice_on_a_simulated_h200(monkeypatch, H, D, dtype, cc, want):
    from csa_jax import registry
    from csa_jax.kernels.triton import config as triton_config
    why = registry.get("gluon").unavailable() or adapter.missing(launch=True)
    if why:
        pytest.skip(why)
    monkeypatch.setattr(impl, "_device", lambda: ("gpu", "NVIDIA H200", cc))
    monkeypatch.setattr(triton_config, "_device_kind", lambda: ("gpu", "NVIDIA H200"))
    got = registry.resolve("auto", (1, 8, H, D), (1, 8, D), (1, 8, 1152), dtype, "gpu")
    assert got.name == want


# ----------------------------------------------------------------------------- few heads


@pytest.mark.parametrize("H, D, stages, dq_stages", [(16, 512, 3, 3), (8, 512, 3, 3),
                                                     (32, 512, 2, 2), (24, 128, 4, 4),
                                                     (16, 64, 4, 4)])
def test_small_heads_default_config(H, D, stages, dq_stages):
    """H <= 32: the few-heads forward and dq kernel (bwd="gluon", measured faster than the
    pallas_triton backward), each with the deepest ring of 64-row tiles that fits beside q
    (the dq kernel: [q; dO]); the buffers within SMALL_HEADS_BUDGET; dkv by row blocks; two
    forward consumer warpgroups at H <= 16, D = 512 (measured there) unless the promise is
    cr0 / cr128 (measured slower)."""
    from csa_jax.kernels.gluon import dims
    c = impl.default_config((1, 8, H, D), None, None, jnp.bfloat16)
    assert (c.block_k, c.stages, c.bwd, c.bwd_dkv) == (64, stages, "gluon", "blocks")
    assert (c.bwd_block_k, c.bwd_stages) == (64, dq_stages)
    pair = 2 if H <= 16 and D == 512 else 1
    assert c.fwd_consumers == pair
    for layout, want in (("cr4", pair), ("cr0", 1), ("cr128", 1)):
        c2 = impl.default_config((1, 8, H, D), None, None, jnp.bfloat16, layout=layout)
        assert c2.fwd_consumers == want and c2.bwd_dkv == "blocks"
    assert impl.default_config((1, 8, 64, D), None, None, jnp.bfloat16).fwd_consumers == 1
    hn = dims.small_heads_block(H)
    for planes, st in ((1, c.stages), (2, c.bwd_stages)):
        assert dims.small_heads_shared_bytes(D, hn, st, planes=planes) <= dims.SMALL_HEADS_BUDGET
        if st < 4:
            assert (dims.small_heads_shared_bytes(D, hn, st + 1, planes=planes)
                    > dims.SMALL_HEADS_BUDGET)
    assert impl.default_config((1, 8, 33, D), None, None, jnp.bfloat16).bwd == "gluon"


@pytest.mark.parametrize("H, kw, match", [
    (16, dict(block_k=32, stages=3), "block_k=32.*64-row tiles"),
    (16, dict(stages=4), "stages=4.*needs 2.*B of shared memory"),
    (32, dict(fwd_consumers=2), "fwd_consumers=2.*H <= 16 only \\(H=32\\)"),
    (64, dict(fwd_consumers=2), "fwd_consumers=2.*H <= 16 only \\(H=64\\)"),
    (16, dict(fwd_consumers=2, stages=2), "two consumer warpgroups need a ring of >= 3"),
    (16, dict(fwd_consumers=2, stages=4, D=64), "need HN = 16 and D >= 128.*D=64"),
])
def test_small_heads_refusals(monkeypatch, H, kw, match):
    monkeypatch.setattr(impl, "_cannot_run", lambda *a: None)
    monkeypatch.setattr(impl, "_amd", lambda: None)
    D = kw.pop("D", 512)
    q = jnp.zeros((1, 4, H, D), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        impl.forward(q, jnp.zeros((1, 4, D), jnp.bfloat16), jnp.zeros((1, 4, 64), jnp.int32),
                     jnp.zeros((H,)), scale=1.0, interpret=False, config=impl.Config(**kw))


def _emulated_small_heads(q, kv, idx, ntiles, sink, *, kernel, out_shape, grid, num_warps,
                          name, T, N, D, K, ROWS, HN, H, BK, STAGES, QK_SCALE, **_):
    """What csa_fwd_small_heads_kernel computes (small_heads.py, csa_spec.md section 3), for
    the wrapper's padding / unpadding: o [ROWS*H, D], lse [ROWS*H] (H heads in memory: the
    kernel pads to HN in shared memory only)."""
    from conftest import emulated_gather_forward
    from csa_jax.kernels.gluon import small_heads
    assert kernel is small_heads.csa_fwd_small_heads_kernel
    assert name == "csa_gluon_fwd_small_heads" and num_warps == small_heads.NUM_WARPS
    assert grid == (min(ROWS, 132),) and q.shape == (ROWS * H, D) and idx.shape == (ROWS, K)
    assert sink.shape == (H,) and K % BK == 0 and 1 <= H <= HN and HN in (16, 32)
    o, lse = emulated_gather_forward(q, kv, idx, ntiles, sink, T=T, N=N, BK=BK,
                                     QK_SCALE=QK_SCALE)
    return o.astype(out_shape[0].dtype), lse


@pytest.mark.parametrize("H, D, K", [(5, 40, 75), (24, 64, 130)])
def test_small_heads_wrapper_against_oracle(rng, monkeypatch, H, D, K):
    """The few-heads forward's host side (heads kept at H in memory, the kernel told HN = 16 /
    32; D padded to a power of two, K to 64 with -1, ntiles, the unpadding) around an emulation
    of the kernel, against the float64 oracle; no sink and empty rows included."""
    from conftest import assert_close, dense_oracle, random_problem
    from csa_jax.common import sanitize_indices
    monkeypatch.setattr(impl, "_cannot_run", lambda *a: None)
    monkeypatch.setattr(impl, "_amd", lambda: None)
    monkeypatch.setattr(adapter, "gluon_call", _emulated_small_heads)
    q, kv, idx, sink = random_problem(rng, T=10, H=H, D=D, K=K, dtype=jnp.bfloat16,
                                      empty_rows=2)
    idx = sanitize_indices(idx, kv.shape[1]).at[:, :, 40:].set(-1)   # empty tail tiles
    cfg = impl.default_config(q.shape, kv.shape, idx.shape, q.dtype)
    for s in (sink, None):
        o, lse = csa_jax.sparse_attention(q, kv, idx, s, scale=0.2, impl="gluon", config=cfg)
        ro, rlse = dense_oracle(q, kv, idx, s, 0.2)
        assert o.shape == q.shape and lse.shape == q.shape[:3] and o.dtype == jnp.bfloat16
        assert_close(o, ro, jnp.bfloat16, what="o")
        assert_close(lse, rlse, jnp.bfloat16, what="lse")


def _compile_small(HN, D, stages, dt="bf16", H=None, consumers=1):
    from csa_jax.kernels.gluon import ring, small_heads
    return adapter.compile_kernel(
        small_heads.csa_fwd_small_heads_kernel, ring.arg_types(dt),
        small_heads.constexprs(T=64, N=256, HN=HN, D=D, K=1152, BK=64, stages=stages,
                               scale=D ** -0.5, H=H, consumers=consumers),
        target="sm_90a", num_warps=small_heads.NUM_WARPS)


@pytest.mark.parametrize("D, stages, H", [(512, 3, None), (512, 3, 8), (128, 4, None)])
def test_small_heads_two_consumers_compile_for_sm90a(D, stages, H):
    """fwd_consumers=2 (Config): 12 warps (producer + two consumer warpgroups), no spills,
    inside shared memory (the partial of warpgroup 1 reuses its last ring stage)."""
    _need_triton()
    c = _compile_small(16, D, stages, H=H, consumers=2)
    r = adapter.resources(c, "sm_90a")
    assert r["num_warps"] == 12 and r["launch_problem"] is None
    assert r["shared"] <= r["shared_limit"]
    from csa_jax.kernels.gluon.dims import small_heads_shared_bytes
    est = small_heads_shared_bytes(D, 16, stages, consumers=2)
    assert est <= r["shared"] <= est + 1024, (r["shared"], est)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas"]
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in c.asm["ptx"]


@pytest.mark.parametrize("HN, D, stages, H", [(16, 512, 3, None), (32, 512, 2, None),
                                              (16, 512, 3, 8), (32, 512, 2, 24),
                                              (16, 64, 4, 1), (32, 128, 4, None)])
def test_small_heads_compiles_for_sm90a(HN, D, stages, H):
    """small_heads.py at its default rings: 8 warps (producer + one consumer warpgroup),
    shared memory within the limit (16 heads, D = 512: 215,388 B of 232,448), m64n{HN}k16
    wgmma for both products, cp.async gathers on mbarriers, no spills; also with fewer heads
    in memory than HN (H = 8, 24, 1: q's padded heads zero-filled, o / lse stores masked)."""
    _need_triton()
    c = _compile_small(HN, D, stages, H=H)
    r = adapter.resources(c, "sm_90a")
    assert r["num_warps"] == 8 and r["launch_problem"] is None
    assert r["shared"] <= r["shared_limit"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas"]
    ptx = c.asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{HN}k16.f32.bf16.bf16" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert "C7514" not in r["ptxas"], r["ptxas"]


def test_small_heads_constexprs_refuse():
    from csa_jax.kernels.gluon import small_heads
    with pytest.raises(ValueError, match="HN=64"):
        small_heads.constexprs(T=8, N=8, HN=64, D=64, K=64, BK=64, stages=2, scale=1.0)
    with pytest.raises(ValueError, match="BK=32"):
        small_heads.constexprs(T=8, N=8, HN=16, D=64, K=64, BK=32, stages=2, scale=1.0)
    for H in (0, 17):
        with pytest.raises(ValueError, match=f"H={H}"):
            small_heads.constexprs(T=8, N=8, HN=16, D=64, K=64, BK=64, stages=2, scale=1.0,
                                   H=H)
