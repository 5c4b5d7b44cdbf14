"""The GPU kernel resource check on a CPU (benchmarks/gluon_resources.py).

Compile-only (the triton 3.6.0 wheel's NVIDIA and AMD backends; skipped without triton): the
report's rows for every kept NVIDIA Gluon kernel (forward, dq, dkv reduce, cr0 window kernel)
on sm_90a; the AMD Gluon forward (amd_fwd.py) must compile for gfx942, gfx950 and gfx1250 at
its default tiles without spills and inside the target's LDS, with the instructions its design
names; the pallas_triton kernels at their AMD defaults must not spill on gfx942 / gfx950.
NOTHING HERE RUNS AN AMD GPU: numerics of the AMD kernels are unchecked (no AMD GPU was
available).
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon")

from benchmarks import gluon_resources  # noqa: E402
from csa_jax.kernels.gluon import adapter, amd_fwd  # noqa: E402

AMD = ("gfx942", "gfx950", "gfx1250")
# What each target's default kernel must contain (the design's data movers and matrix ops).
WANT = {
    "gfx942": ("buffer_load_dwordx4", "v_mfma_f32_16x16x16_bf16", "ds_write_b128"),
    "gfx950": ("offen lds", "v_mfma_f32_16x16x32_bf16", "ds_read_b64_tr_b16"),   # async copies
    "gfx1250": ("tensor_load_to_lds", "global_load_async_to_lds_b128",
                "v_wmma_f32_16x16x32_bf16", "s_wait_asynccnt"),
}


def _compile(target, trans=0, D=512, K=1152, dt="bf16"):
    d = amd_fwd.TARGET_DEFAULTS[target]
    c = adapter.compile_kernel(
        amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(dt),
        amd_fwd.constexprs(target=target, T=64, N=300, NHB=2, D=D, K=K, BK=d["block_k"],
                           stages=d["stages"], scale=D ** -0.5, trans=trans),
        target=target, num_warps=d["warps"])
    return c, adapter.resources(c, target)


@pytest.mark.parametrize("target", AMD)
def test_amd_forward_compiles_without_spills(target):
    c, r = _compile(target)
    assert r["num_warps"] == amd_fwd.TARGET_DEFAULTS[target]["warps"]
    assert r["launch_problem"] is None, r
    assert r["shared"] <= r["shared_limit"], r
    assert r["vgpr_spill"] == 0 and r["scratch"] == 0, r
    from csa_jax.kernels.gluon.dims import amd_lds_bytes
    d = amd_fwd.TARGET_DEFAULTS[target]
    est = amd_lds_bytes(target, 512, d["block_k"], d["stages"], int(target == "gfx1250"))
    assert est - 1024 <= r["shared"] <= est + 8192, (r["shared"], est)   # the wrapper's check
    gcn = c.asm["amdgcn"]
    missing = [w for w in WANT[target] if w not in gcn]
    assert not missing, (target, missing)
    # the masked gather zero-fills -1 slots: buffer ops by hardware range checks (no branch),
    # gfx1250's pointer copies by a plain LDS store of zeros in the masked-off branch
    if target == "gfx1250":
        assert "store <8 x bfloat> zeroinitializer, ptr addrspace(3)" in c.asm["llir"]


def test_amd_forward_fp16_and_small_d_compile():
    for target in ("gfx950", "gfx1250"):
        _, r = _compile(target, D=128, K=64, dt="fp16")
        assert r["vgpr_spill"] == 0 and r["shared"] <= r["shared_limit"], r


def test_transposed_operand_switch_on_cdna4():
    """Issue 14's switch on gfx950: PV's kv operand by ds_read_b64_tr_b16 (trans=0) or 16-byte
    row reads + a register transpose (trans=1, through LDS scratch); the report's numbers."""
    c0, r0 = _compile("gfx950", trans=0)
    c1, r1 = _compile("gfx950", trans=1)
    assert "ds_read_b64_tr_b16" in c0.asm["amdgcn"]
    assert "ds_read_b64_tr_b16" not in c1.asm["amdgcn"]
    assert r0["vgpr"] < r1["vgpr"] or r1["vgpr_spill"] > 0, (r0, r1)


def test_gfx1250_kv_rows_by_tdm():
    """tdm_rows: one TDM block load per kv row (the TDM has no gather in triton 3.6.0), waited by
    tensor count (BK per tile and wave); refused for the CDNA targets, which have no TDM."""
    c = adapter.compile_kernel(
        amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(),
        amd_fwd.constexprs(target="gfx1250", T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=2,
                           scale=0.05, tdm_rows=True), target="gfx1250", num_warps=8)
    r = adapter.resources(c, "gfx1250")
    gcn = c.asm["amdgcn"]
    assert r["vgpr_spill"] == 0 and r["shared"] <= r["shared_limit"], r
    assert gcn.count("tensor_load_to_lds") == 1 + 2 * 32      # q, prologue tile, loop tile
    assert "s_wait_tensorcnt 0x20" in gcn and "global_load_async_to_lds" not in gcn
    with pytest.raises(ValueError, match="tdm_rows needs gfx1250"):
        amd_fwd.constexprs(target="gfx950", T=1, N=1, NHB=1, D=64, K=64, BK=64, stages=2,
                           scale=1.0, tdm_rows=True)


def test_resource_report_amd_gluon_passes(capsys):
    assert gluon_resources.main(["--targets", ",".join(AMD), "--kernels", "gluon_amd"]) == 0
    out = capsys.readouterr().out
    for t in AMD:
        assert re.search(rf"\| csa_fwd_amd\[default\] \| {t} \| \d+ \|", out), out


def test_resource_report_nvidia_gluon_passes(capsys):
    """Every kept NVIDIA Gluon kernel has its sm_90a row at the default Config (exit 0: within
    shared memory, spills only as KNOWN_SPILLS allows), each compiled, none for an AMD target;
    a --variants row appears only for the kernel whose tiles it changes."""
    import json
    assert gluon_resources.main(["--targets", ",".join(("sm_90a",) + AMD), "--kernels",
                                 "gluon_nv", "--variants", "bk32:block_k=32"]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert [r["kernel"] for r in rows] == [
        "csa_fwd[default]", "csa_dq[default]", "csa_fwd[bk32]", "csa_dkv_reduce[default]",
        "csa_fwd_small_heads[h16]", "csa_fwd_small_heads[h32]", "csa_dq_small_heads[h16]",
        "csa_dq_small_heads[h32]", "csa_dkv_blocks[h16]", "csa_dkv_blocks[h32]",
        "csa_dkv_maps_token", "csa_dkv_maps_block", "csa_window[cr0]",
        "csa_window[cr0,flash]"], rows
    assert all(r["target"] == "sm_90a" and "error" not in r for r in rows), rows
    by = {r["kernel"]: r for r in rows}
    assert by["csa_fwd[default]"]["name"] == "csa_fwd_kernel"
    assert by["csa_dq[default]"]["name"] == "csa_dq_kernel"
    assert by["csa_dkv_reduce[default]"]["name"] == "csa_dkv_reduce_kernel"
    assert by["csa_window[cr0]"]["name"] == "csa_window_kernel"
    assert by["csa_fwd_small_heads[h16]"]["name"] == "csa_fwd_small_heads_kernel"
    assert by["csa_dq_small_heads[h16]"]["name"] == "csa_dq_small_heads_kernel"
    assert by["csa_dkv_blocks[h16]"]["name"] == "csa_dkv_blocks_kernel"
    assert by["csa_fwd_small_heads[h16]"]["num_warps"] == 12      # two consumers: the default
    assert by["csa_fwd_small_heads[h32]"]["num_warps"] == 8
    assert by["csa_fwd[bk32]"]["shared"] < by["csa_fwd[default]"]["shared"]
    for k in ("csa_fwd[default]", "csa_dq[default]", "csa_dkv_reduce[default]",
              "csa_fwd_small_heads[h16]", "csa_fwd_small_heads[h32]", "csa_dq_small_heads[h16]",
              "csa_dq_small_heads[h32]", "csa_dkv_blocks[h16]", "csa_dkv_blocks[h32]",
              "csa_dkv_maps_token", "csa_dkv_maps_block", "csa_window[cr0]"):
        assert by[k]["spill_stores"] == 0, by[k]


def test_resource_report_refuses_removed_config_fields():
    with pytest.raises(SystemExit):
        gluon_resources.main(["--kernels", "gluon_nv", "--variants", "x:schedule=alternate"])


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_resource_report_triton_dialect_gfx942():
    """pallas_triton's AMD defaults (16-row tiles) compile for gfx942 without spills inside its
    64 KiB LDS (at 32-row tiles the forward spilled 101 VGPRs, the dq kernel 182)."""
    assert gluon_resources.main(["--targets", "gfx942", "--kernels", "triton"]) == 0


def test_check_fails_on_spills_overflow_and_refusals():
    ok = dict(name="k", target="gfx942", shared=100, shared_limit=65536, vgpr_spill=0)
    assert gluon_resources.check(ok, True, True) is None
    assert "spills 3" in gluon_resources.check({**ok, "vgpr_spill": 3}, True, True)
    assert gluon_resources.check({**ok, "vgpr_spill": 3}, False, True) is None  # a variant
    assert "> 65536" in gluon_resources.check({**ok, "shared": 70000}, True, True)
    assert "does not compile" in gluon_resources.check({"error": "x"}, False, True)
    assert gluon_resources.check({"error": "x"}, True, False) is None      # expected refusal
    sm90 = dict(name="csa_triton_dq", target="sm_90a", shared=1, spill_stores=40)
    assert gluon_resources.check(sm90, True, True) is None                  # KNOWN_SPILLS
    assert "spills 48" in gluon_resources.check({**sm90, "spill_stores": 48}, True, True)
    # KNOWN_SPILLS is keyed by the row's kernel label: Flash's window row, not Pro's
    win = dict(kernel="csa_window[cr0,flash]", name="csa_window_kernel", target="sm_90a",
               shared=1, spill_stores=100)
    assert gluon_resources.check(win, True, True) is None
    assert "spills 100" in gluon_resources.check({**win, "kernel": "csa_window[cr0]"}, True,
                                                 True)


# ----------------------------------------------------------------------------- ROCm dispatch
# The launch itself cannot be tested here (no ROCm jaxlib, no AMD GPU): the kernel call is
# replaced by a jnp emulation of its contract, which checks the host side (which kernel, grid,
# warps, padding, ntiles, unpadding) against the float64 oracle.

def _emulated_fwd_kernel(q, kv, idx, ntiles, sink, *, kernel, out_shape, grid, num_warps, name,
                         T, N, NHB, D, K, BK, QK_SCALE, **_):
    """What csa_fwd_amd_kernel computes (amd_fwd.py docstring, csa_spec.md section 3)."""
    from conftest import emulated_gather_forward
    assert kernel is amd_fwd.csa_fwd_amd_kernel and name == "csa_gluon_fwd_amd"
    BT = idx.shape[0]
    Hp, B = NHB * 64, BT // T
    assert grid == (BT * NHB,) and q.shape == (BT * Hp, D) and kv.shape == (B * N, D)
    assert num_warps == _emulated_fwd_kernel.warps
    o, lse = emulated_gather_forward(q, kv, idx, ntiles, sink, T=T, N=N, BK=BK,
                                     QK_SCALE=QK_SCALE)
    return o.astype(out_shape[0].dtype), lse


@pytest.mark.parametrize("cc, kind, arch", [("gfx942:sramecc+:xnack-", "AMD Instinct MI300X",
                                             "gfx942"),
                                            (None, "AMD Instinct MI355X", "gfx950")])
def test_rocm_forward_dispatch_against_oracle(rng, monkeypatch, cc, kind, arch):
    import jax.numpy as jnp
    from conftest import assert_close, dense_oracle, random_problem
    from csa_jax.common import sanitize_indices
    from csa_jax.kernels import gluon as impl
    monkeypatch.setattr(impl, "_device", lambda: ("rocm", kind, cc))
    monkeypatch.setattr(adapter, "gluon_call", _emulated_fwd_kernel)
    _emulated_fwd_kernel.warps = amd_fwd.TARGET_DEFAULTS[arch]["warps"]
    cfg = impl.default_config((1, 8, 70, 40), None, None, jnp.bfloat16)
    assert (cfg.block_k, cfg.stages) == (amd_fwd.TARGET_DEFAULTS[arch]["block_k"],
                                         amd_fwd.TARGET_DEFAULTS[arch]["stages"])
    assert "never run" in impl.unsupported((1, 8, 128, 512), None, None, jnp.bfloat16)
    q, kv, idx, sink = random_problem(rng, T=10, H=70, D=40, K=75, dtype=jnp.bfloat16,
                                      empty_rows=2)
    idx = sanitize_indices(idx, kv.shape[1]).at[:, :, 40:].set(-1)   # empty tail tiles
    o, lse = impl.forward(q, kv, idx, sink, scale=0.2, interpret=False, config=cfg)
    ro, rlse = dense_oracle(q, kv, idx, sink, 0.2)
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    assert o.dtype == jnp.bfloat16
    assert_close(o, ro, jnp.bfloat16, what="o")
    assert_close(lse, rlse, jnp.bfloat16, what="lse")


def test_rocm_unknown_arch_and_backward_route(monkeypatch):
    import jax.numpy as jnp
    from csa_jax.kernels import gluon as impl
    from csa_jax.kernels.gluon import dims
    assert dims.amd_arch("AMD Instinct MI300X") == "gfx942"
    assert dims.amd_arch("whatever", "gfx1250") == "gfx1250"
    assert dims.amd_arch("AMD Radeon", None) is None
    monkeypatch.setattr(impl, "_device", lambda: ("rocm", "AMD Radeon RX 7900", "gfx1100"))
    assert "gfx1100" in impl._cannot_run((1, 8, 64, 512), jnp.bfloat16)
    monkeypatch.setattr(impl, "_device", lambda: ("rocm", "AMD Instinct MI300X", "gfx942"))
    cfg = impl.default_config((1, 8, 128, 512), None, None, jnp.bfloat16)
    from csa_jax.kernels.gluon import amd_bwd
    d = amd_bwd.DQ_DEFAULTS["gfx942"]
    assert (cfg.bwd, cfg.bwd_block_k, cfg.bwd_stages) == ("gluon", d["block_k"], d["stages"])


@pytest.mark.parametrize("target", AMD)
def test_amd_dq_kernel_compiles_without_spills(target):
    from csa_jax.kernels.gluon import amd_bwd
    d = amd_bwd.DQ_DEFAULTS[target]
    c = adapter.compile_kernel(
        amd_bwd.csa_dq_amd_kernel, amd_bwd.arg_types("bf16"),
        amd_bwd.constexprs(target=target, T=64, N=300, NHB=2, D=512, K=192, BK=d["block_k"],
                           stages=d["stages"], scale=0.05, qdo=d["qdo"]),
        target=target, num_warps=d["warps"])
    r = adapter.resources(c, target)
    assert r["shared"] <= r["shared_limit"] and r["vgpr_spill"] == 0, r
    mm = re.findall(r"^\s+(v_mfma\w*|v_wmma\w*)", c.asm["amdgcn"], re.M)
    assert mm and len(set(mm)) == 1, set(mm)      # S, dP and dq products on one instruction


def test_amd_forward_refuses_tiles_over_lds():
    import jax.numpy as jnp
    q = jnp.zeros((1, 2, 64, 512), jnp.bfloat16)
    kv = jnp.zeros((1, 8, 512), jnp.bfloat16)
    idx = jnp.zeros((1, 2, 64), jnp.int32)
    with pytest.raises(ValueError, match="block_k=64, stages=2 at D=512 need .* gfx942 has 65536"):
        amd_fwd.forward(q, kv, idx, jnp.zeros(64), scale=0.1, arch="gfx942", block_k=64,
                        stages=2)
    with pytest.raises(ValueError, match="2 GiB byte-offset range"):
        amd_fwd.check_buffer_range(2 ** 21, 512, 2)             # 2 GiB of kv rows
    amd_fwd.check_buffer_range(2 ** 20, 512, 2)                 # 1 GiB: fine
    with pytest.raises(NotImplementedError, match="gfx90a"):
        amd_fwd.forward(q, kv, idx, jnp.zeros(64), scale=0.1, arch="gfx90a")


def test_rocm_launch_plumbing_with_a_fake_jaxlib(monkeypatch, tmp_path):
    """adapter's ROCm branch up to jaxlib (no ROCm jaxlib here): the patched kernel builder
    compiles for the device's gfx arch and hands TritonKernel the code object's file path, as
    jax-triton does for its own ROCm kernels. What jaxlib then does with it is untested."""
    import sys
    import types
    made = {}

    class FakeLib:
        @staticmethod
        def get_arch_details(device):
            return "gfx942:sramecc+:xnack-"

        @staticmethod
        def get_compute_capability(device):
            return 0

        @staticmethod
        def TritonKernel(*args):
            made["args"] = args
            return "kernel"

    triton_lib = types.SimpleNamespace(get_or_create_triton_kernel=lambda *a, **k: None,
                                       triton_kernel_call_lib=FakeLib)
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_lib=triton_lib))
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", triton_lib)
    monkeypatch.setattr(adapter, "_PATCHED", False)
    adapter._install()
    d = amd_fwd.TARGET_DEFAULTS["gfx942"]
    consts = amd_fwd.constexprs(target="gfx942", T=64, N=300, NHB=2, D=512, K=192,
                                BK=d["block_k"], stages=d["stages"], scale=0.05)
    kernel, attrs = triton_lib.get_or_create_triton_kernel(
        None, "rocm", amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(), [],
        num_warps=d["warps"], num_stages=None, num_ctas=1, compute_capability=None,
        enable_fp_fusion=True, metaparams=consts, dump=False)
    name, warps, ctas, shared, path, ttgir, cc = made["args"]
    assert kernel == "kernel" and name == "csa_fwd_amd_kernel" and (warps, ctas) == (4, 1)
    assert shared == 33264 and "amd_mfma" in ttgir and cc == 0
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"                # the gfx942 code object
    assert attrs[(0,)] == [["tt.divisibility", 16]]
