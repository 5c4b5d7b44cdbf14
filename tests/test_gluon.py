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
    for D in (64, 128, 512):
        cfg = impl.default_config((1, 8, 64, D), (1, 16, D), (1, 8, 64), jnp.bfloat16)
        assert impl.shared_bytes(D, cfg) <= 232_448
    # D = 512: q (64 KiB) + 2 stages of 64 rows (128 KiB); a third stage would not fit.
    assert impl.default_config((1, 8, 128, 512), None, (1, 8, 640), jnp.bfloat16).stages == 2
    assert impl.default_config((1, 8, 64, 128), None, (1, 8, 64), jnp.bfloat16).stages == 4


@pytest.mark.parametrize("kw, match", [
    (dict(block_k=48), "block_k=48"),
    (dict(stages=0), "stages=0"),
    (dict(stages=True), "stages=True"),
    (dict(producer_regs=100), "producer_regs=100"),
    (dict(producer_regs=8), "producer_regs=8"),
    (dict(pipeline=1), "pipeline=1"),
    (dict(ablate=7), "ablate=7"),
    (dict(ablate=2, pipeline=True), "pipeline=False only"),
    (dict(schedule="lockstep"), "schedule='lockstep'"),
    (dict(schedule="alternate", stages=3), "even stages, got stages=3"),
    (dict(schedule="alternate", pipeline=True), "pipeline apply to schedule='default' only"),
    (dict(alt_split=True, schedule="default"), "alt_split=True applies to schedule='alternate'"),
    (dict(schedule="alternate", alt_regs=250), "alt_regs=250"),
    (dict(alt_order="later"), "alt_order='later' must be"),
    (dict(alt_order="s_first", schedule="default"), "alt_order='s_first' applies to"),
    (dict(alt_ablate=2), "alt_ablate=2 must be 0"),
    (dict(alt_ablate=1, schedule="default"), "alt_ablate applies to schedule='alternate'"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        impl.Config(**kw)


def test_schedule_auto_resolution():
    """schedule="auto" (the default) runs the alternating kernel unless a lockstep-only option
    or an odd ring depth asks for fwd.py's."""
    assert impl.Config().resolved_schedule == "alternate"
    for kw in (dict(pipeline=True), dict(smem_epilogue=True), dict(ablate=1), dict(stages=3)):
        assert impl.Config(**kw).resolved_schedule == "default", kw
    assert impl.Config(schedule="default").resolved_schedule == "default"
    assert impl.Config(alt_split=True).resolved_schedule == "alternate"
    with pytest.raises(ValueError, match="alt_split=True applies"):
        impl.Config(alt_split=True, pipeline=True)


@pytest.mark.parametrize("family", ["flash", "pro"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_auto_schedule_per_layout_and_family(family, ratio):
    """auto's measured rule (docs/perf/gluon_alt_h200.md, section 3): the default Config of
    every V4 family and layout runs the alternating gather kernel at T = 4096 and 16384, and
    its step order is "pv_first" (1.09x / 1.08x faster than "s_first" at Pro cr4 T = 4096 /
    16384 in the same call; "stats_first" 0.93x)."""
    from csa_jax.config import preset
    cfg = preset(family, ratio)
    for T in (4096, 16384):
        H, D, K = cfg.num_heads, cfg.head_dim, cfg.window + cfg.topk
        c = impl.default_config((1, T, H, D), (1, T, D), (1, T, K), "bfloat16")
        assert c.layout == "generic" and c.resolved_schedule == "alternate", (family, ratio, c)
        assert c.alt_order == "pv_first"


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
    from csa_jax.kernels.gluon.probe import ring_gather_kernel
    try:
        import jax_triton  # noqa: F401
        pytest.skip("jax-triton imports here (GPU jaxlib): the launch path is tested on the GPU")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"csa_jax\[gluon\]"):
        adapter.gluon_call(jnp.zeros((4, 8)), kernel=ring_gather_kernel,
                           out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(1,),
                           num_warps=4)


# ----------------------------------------------------------------------------- compile only


def _compile_fwd(D=512, K=1152, block_k=64, stages=2, dt="bf16", **kw):
    from csa_jax.kernels.gluon import fwd
    if kw.pop("schedule", "default") == "alternate":
        from csa_jax.kernels.gluon import fwd_alt
        return adapter.compile_kernel(
            fwd_alt.csa_fwd_alt_kernel, fwd.arg_types(dt),
            fwd_alt.constexprs(T=64, N=256, NHB=2, D=D, K=K, BK=block_k, stages=stages,
                               scale=D ** -0.5, **kw),
            target="sm_90a", num_warps=fwd_alt.NUM_WARPS)
    return adapter.compile_kernel(
        fwd.csa_fwd_kernel, fwd.arg_types(dt),
        fwd.constexprs(T=64, N=256, NHB=2, D=D, K=K, BK=block_k, stages=stages,
                       scale=D ** -0.5, producer_regs=96, **kw),
        target="sm_90a", num_warps=fwd.CONSUMER_WARPS)


def test_forward_compiles_for_sm90a_without_spills():
    """The default D = 512 kernel: 12 warps (8 consumers + 4 producer), fits shared memory,
    no spills, wgmma and 16-byte cp.async in the PTX, setmaxnreg register split."""
    _need_triton()
    c = _compile_fwd()
    r = adapter.resources(c, "sm_90a")
    assert r["num_warps"] == 12
    assert r["launch_problem"] is None
    assert r["shared"] <= r["shared_limit"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas"]
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert re.search(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+96;", ptx)  # producer


@pytest.mark.parametrize("kw", [dict(D=64, K=64, stages=4), dict(D=512, dt="fp16"),
                                dict(block_k=32, stages=4), dict(pipeline=True),
                                dict(smem_epilogue=True)])
def test_forward_variants_compile(kw):
    _need_triton()
    r = adapter.resources(_compile_fwd(**kw), "sm_90a")
    assert r["num_warps"] == 12 and r["shared"] <= r["shared_limit"]


@pytest.mark.parametrize("kw, regs", [(dict(), 216), (dict(consumer_regs=200), 200),
                                      (dict(D=64, K=64, stages=4), 216),
                                      (dict(split=True), 216),
                                      (dict(order="s_first"), 216),
                                      (dict(order="stats_first"), 216),
                                      (dict(order="stats_first", split=True), 216),
                                      (dict(order="pv_release"), 216),
                                      (dict(block_k=32, stages=4, dt="fp16"), 216)])
def test_alternate_schedule_compiles_without_spills(kw, regs):
    """schedule="alternate" (fwd_alt.py): 12 warps = producer (default partition) + two 4-warp
    consumer workers at `regs` registers (setmaxnreg; the producer gets the rest), shared
    memory within the limit, 0 spills (it spilled 232 B before its q descriptors were kept in
    the loop), a full m64n64 S per tile and m64n(D/2) PV on wgmma."""
    _need_triton()
    from csa_jax.kernels.gluon import fwd_alt
    c = _compile_fwd(schedule="alternate", **kw)
    r = adapter.resources(c, "sm_90a")
    assert r["num_warps"] == 12 and r["launch_problem"] is None
    assert r["shared"] <= r["shared_limit"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas"]
    assert "C7514" not in r["ptxas"], r["ptxas"]     # ptxas: "wgmma ... serialized"
    ptx = c.asm["ptx"]
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{regs};", ptx)
    prod = fwd_alt.producer_regs(regs)                    # 72 at 216, 104 at 200
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{prod};", ptx)
    bk, dh = kw.get("block_k", 64), kw.get("D", 512) // 2
    dt = "f16.f16" if kw.get("dt") == "fp16" else "bf16.bf16"
    assert f"wgmma.mma_async.sync.aligned.m64n{bk}k16.f32.{dt}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{dh}k16.f32.{dt}" in ptx


def test_alternate_ablation_has_no_products():
    """alt_ablate=1 (benchmark only): the same kernel without a single wgmma, 0 spills."""
    _need_triton()
    c = _compile_fwd(schedule="alternate", ablate=1, order="pv_first")
    r = adapter.resources(c, "sm_90a")
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas"]
    assert "wgmma.mma_async" not in c.asm["ptx"] and "cp.async.cg.shared.global" in c.asm["ptx"]


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "gfx1250"])
def test_forward_is_nvidia_only(target):
    """The kernel uses NVIDIA-only ops (wgmma, NVMMA layouts, cp.async): the AMD targets refuse
    it at compile time (docs/perf/gluon_h200.md, AMD section)."""
    _need_triton()
    from csa_jax.kernels.gluon import fwd
    with pytest.raises(Exception):
        adapter.compile_kernel(
            fwd.csa_fwd_kernel, fwd.arg_types(),
            fwd.constexprs(T=64, N=256, NHB=1, D=512, K=128, BK=64, stages=2, scale=0.1,
                           producer_regs=96),
            target=target, num_warps=fwd.CONSUMER_WARPS)
    from csa_jax.kernels.gluon import fwd_alt
    with pytest.raises(Exception):
        adapter.compile_kernel(
            fwd_alt.csa_fwd_alt_kernel, fwd.arg_types(),
            fwd_alt.constexprs(T=64, N=256, NHB=1, D=512, K=128, BK=64, stages=2, scale=0.1),
            target=target, num_warps=fwd_alt.NUM_WARPS)


def test_probe_compiles():
    _need_triton()
    from csa_jax.kernels.gluon.probe import ring_gather_kernel
    c = adapter.compile_kernel(ring_gather_kernel, ["*bf16", "*i32", "*bf16"],
                               dict(NT=2, BK=16, D=128, STAGES=2), num_warps=4)
    assert c.metadata.num_warps == 8 and adapter.launch_problem(c.metadata) is None


def test_resource_report_sm90a(capsys):
    """benchmarks/gluon_resources.py: the default forward fits and does not spill (exit 0)."""
    _need_triton()
    from benchmarks import gluon_resources
    assert gluon_resources.main(["--targets", "sm_90a", "--kernels", "gluon_nv,triton"]) == 0
    out = capsys.readouterr().out
    assert "| csa_fwd[default] | sm_90a | 12 |" in out


@pytest.mark.parametrize("H, D, dtype, cc, want", [
    (128, 512, jnp.bfloat16, "9.0", "gluon"),
    (64, 512, jnp.float16, "9.0", "gluon"),
    (16, 512, jnp.bfloat16, "9.0", "pallas_triton"),     # outside the measured regime
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
    got = registry.resolve("auto", (1, 8, H, D), (1, 8, D), (1, 8, 4), dtype, "gpu")
    assert got.name == want
