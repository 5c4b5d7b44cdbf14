"""The GPU kernel resource check on a CPU (benchmarks/gluon_resources.py), for the AMD targets.

Compile-only (the triton 3.6.0 wheel's AMD backend; skipped without triton): the AMD Gluon
forward (amd_fwd.py) must compile for gfx942, gfx950 and gfx1250 at its default tiles without
spills and inside the target's LDS, with the instructions its design names; the pallas_triton
kernels at their AMD defaults must not spill on gfx942 / gfx950. NOTHING HERE RUNS AN AMD GPU:
numerics of the AMD kernels are unchecked (no AMD GPU was available).
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
    "gfx950": ("buffer_load_dwordx4 ", "v_mfma_f32_16x16x32_bf16", "ds_read_b64_tr_b16"),
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


def test_resource_report_amd_gluon_passes(capsys):
    assert gluon_resources.main(["--targets", ",".join(AMD), "--kernels", "gluon_amd"]) == 0
    out = capsys.readouterr().out
    for t in AMD:
        assert re.search(rf"\| csa_fwd_amd\[default\] \| {t} \| \d+ \|", out), out


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
