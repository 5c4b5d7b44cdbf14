"""benchmarks/gluon_asm_diff.py without a compile: what its line-info removal keeps and drops,
and that `compare` flags a changed, missing or failing kernel row (exit 1) and passes equal ones."""
from __future__ import annotations

import json

from benchmarks import gluon_asm_diff as ad

PTX = """.visible .entry k(
{
	.loc	1 42 7                          // fwd.py:42:7
$L__tmp0:
	mov.u32 	%r1, %tid.x;
$L__BB0_2:
	ret;
}
	.file	1 "/a/b/fwd.py"
	.section	.debug_abbrev
	{
.b8 1
	}
"""
AMDGCN = """k:
	.loc	2 10 3 prologue_end
.Ltmp3:
	v_mov_b32 v0, 0
.LBB0_1:
	s_endpgm
	.file	2 "/a/b" "amd_fwd.py"
	.section	.debug_info,"",@progbits
	.long	.Ltmp3-.Lfunc_begin0
	.section	".note.GNU-stack","",@progbits
	.amdgpu_metadata
"""


def test_strip_line_info_keeps_code_drops_debug():
    ptx = ad.strip_line_info(PTX)
    assert "mov.u32" in ptx and "$L__BB0_2:" in ptx and "ret;" in ptx
    assert not any(s in ptx for s in (".loc", "$L__tmp0", ".file", "debug", ".b8 1"))
    # moved source lines / another checkout path: the same normalized text
    assert ad.strip_line_info(PTX.replace("42 7", "99 1").replace("/a/b", "/c")) == ptx
    gcn = ad.strip_line_info(AMDGCN)
    assert "v_mov_b32" in gcn and ".LBB0_1:" in gcn and ".amdgpu_metadata" in gcn
    assert not any(s in gcn for s in (".loc", ".Ltmp3", ".file", "debug_info"))
    assert ad.strip_line_info(PTX.replace("%r1", "%r2")) != ptx


def test_compare_flags_differences(tmp_path, capsys):
    def dump(name, rows, nl=False):
        p = tmp_path / name
        p.write_text(json.dumps(dict(meta=dict(no_line_info=nl, commit=name), kernels=rows)))
        return str(p)
    row = dict(ptx="a", sass="s", raw="r", bin="b")
    base = dump("a", {"k@sm_90a": row, "g@gfx950": dict(amdgcn="x", raw="r", bin="b")})
    assert ad.compare(base, dump("b", {"k@sm_90a": dict(row, raw="r2", bin="b2"),
                                       "g@gfx950": dict(amdgcn="x", raw="r", bin="b")})) == 0
    assert ad.compare(base, dump("c", {"k@sm_90a": dict(row, sass="t"),
                                       "g@gfx950": dict(amdgcn="x")})) == 1
    assert "k@sm_90a: differs in sass" in capsys.readouterr().out
    assert ad.compare(base, dump("d", {"k@sm_90a": row})) == 1              # a row missing
    assert ad.compare(base, dump("e", {"k@sm_90a": row, "g@gfx950": dict(error="x")})) == 1
    # both without line info: raw text and binaries count too
    nl = dump("f", {"k@sm_90a": row}, nl=True)
    assert ad.compare(nl, dump("g", {"k@sm_90a": dict(row, bin="b2")}, nl=True)) == 1
    h = dump("h", {"k@sm_90a": dict(row, sass="t"), "g@gfx950": dict(amdgcn="x")})
    assert ad.compare(base, h, only="^g@") == 0 and ad.compare(base, h, only="^k@") == 1


def test_captured_launches_are_the_default_path():
    """dump's rows come from the dispatch itself (gluon.forward / backward under eval_shape,
    the launch recorded): per layer the forward, the dq kernel and (NVIDIA) the dkv reduce; the
    cr0 promise runs the window kernel; AMD targets their own kernels. No compile here."""
    import pytest
    pytest.importorskip("triton.experimental.gluon")
    rows = {key: (fn.__name__, target) for key, fn, _, _, _, target in ad.captured(T=256)}
    assert rows["fwd[pro,cr4]@sm_90a"] == ("csa_fwd_kernel", "sm_90a")
    assert rows["dq[flash,cr128]@sm_90a"] == ("csa_dq_kernel", "sm_90a")
    assert rows["reduce[pro,cr0]@sm_90a"] == ("csa_dkv_reduce_kernel", "sm_90a")
    assert rows["fwd[pro,cr0,promise]@sm_90a"] == ("csa_window_kernel", "sm_90a")
    assert rows["fwd[pro,cr0]@sm_90a"] == ("csa_fwd_kernel", "sm_90a")
    assert rows["fwd[flash,cr4]@gfx950"] == ("csa_fwd_amd_kernel", "gfx950")
    assert rows["dq[pro,cr4]@gfx1250"] == ("csa_dq_amd_kernel", "gfx1250")
    assert not any(k.startswith("reduce") and "gfx" in k for k in rows)   # AMD: Pallas reduce
    assert len(rows) == 3 * 8 + 2 * 6 * 3                # NVIDIA 8 layer rows, AMD 6 x 3 targets


def test_renamed_kernel_is_the_same_code(tmp_path):
    """The kernel's own name is made neutral (a renamed function is the same code), also the
    comment padding that follows its length; raw / bin are compared only under one name."""
    ptx = ".visible .entry old_name(\n\t.param .u64 old_name_param_0\n)\n\t// .globl\told_name  // x\n"
    new = ptx.replace("old_name", "kernel_b")
    assert ad._unname(ptx, "old_name") == ad._unname(new, "kernel_b")

    def dump(name, kernel, raw):
        p = tmp_path / name
        p.write_text(json.dumps(dict(meta=dict(no_line_info=True, commit=name), kernels={
            "fwd@sm_90a": dict(ptx="a", sass="s", raw=raw, bin=raw, kernel=kernel)})))
        return str(p)
    assert ad.compare(dump("a", "k1", "r1"), dump("b", "k2", "r2")) == 0     # renamed
    assert ad.compare(dump("c", "k1", "r1"), dump("d", "k1", "r2")) == 1     # same name


def test_triton_and_tpu_dump_compare(tmp_path, capsys):
    """triton_asm_diff / tpu_mlir_diff's compare (benchmarks/dump_diff.compare_tally): 0 for
    equal dumps, 1 for a changed or missing row, and the per-group table of identical rows."""
    from benchmarks import tpu_mlir_diff, triton_asm_diff

    def dump(name, kernels):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(dict(meta=dict(commit=name), kernels=kernels)))
        return str(p)

    tri = {"program[H16]@sm_90a": dict(program="p"), "fwd[H16]@sm_90a": dict(ptx="x"),
           "fwd[H16]@gfx942": dict(amdgcn="y")}
    assert triton_asm_diff.compare(dump("a", tri), dump("b", tri)) == 0
    assert "| sm_90a | ptx | 1 | 1 |" in capsys.readouterr().out
    assert triton_asm_diff.compare(dump("a", tri), dump("c", dict(tri, **{
        "fwd[H16]@gfx942": dict(amdgcn="z")}))) == 1
    out = capsys.readouterr().out
    assert "fwd[H16]@gfx942: differs in amdgcn" in out and "| gfx942 | amdgcn | 1 | 0 |" in out
    tpu = {"fwd[pro,cr4]@v5e": dict(mosaic="m", program="p", kernels=1)}
    assert tpu_mlir_diff.compare(dump("d", tpu), dump("e", tpu)) == 0
    assert tpu_mlir_diff.compare(dump("d", tpu), dump("f", {})) == 1
    assert "fwd[pro,cr4]@v5e: only in" in capsys.readouterr().out
