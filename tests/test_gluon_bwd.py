"""The Gluon backward (csa_jax/kernels/gluon/bwd.py) without a GPU.

- the dq kernel compiles for sm_90a (triton's own compiler and the bundled ptxas, on the CPU):
  launchable through jaxlib, inside the H200's shared memory, no spills, the wgmma shapes meant;
- the host wrapper (padding, dsp layout, the dlse - delta sign, dsink, the Pallas Triton
  interm GEMM + inverse-map reduce in interpret mode) against the float64 dense oracle, with the
  dq kernel replaced by a jnp emulation of its contract (Gluon has no interpreter);
- the Config switch and its validation.
The kernel itself ran on the H200 (benchmarks/gluon_bwd_check.py, docs/perf/gluon_bwd_h200.md).
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, dense_oracle, random_problem

pytest.importorskip("triton.experimental.gluon")

from csa_jax.kernels import gluon  # noqa: E402
from csa_jax.kernels.gluon import adapter, bwd  # noqa: E402


@pytest.mark.parametrize("dt,D,bk,stages", [("bf16", 512, 32, 2), ("fp16", 512, 16, 4),
                                            ("bf16", 128, 64, 3)])
def test_dq_kernel_compiles_sm90(dt, D, bk, stages):
    cfg = gluon.default_config((1, 64, 128, D), None, None, jnp.bfloat16)
    if D == 512 and dt == "bf16":       # the default tiles at D = 512 are the ones timed
        assert (cfg.bwd_block_k, cfg.bwd_stages) == (bk, stages)
    c = adapter.compile_kernel(
        bwd.csa_dq_kernel, bwd.arg_types(dt),
        bwd.constexprs(T=64, N=300, NHB=2, D=D, K=192, BK=bk, stages=stages, scale=D ** -0.5,
                       producer_regs=96), target="sm_90a", num_warps=bwd.CONSUMER_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None, r
    assert r["num_warps"] == bwd.CONSUMER_WARPS + 4          # consumers + producer partition
    est = bwd.shared_bytes(D, bk, stages)
    assert est <= r["shared"] <= min(est + 1024, adapter.SHARED_LIMIT["sm_90a"]), (r, est)
    assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0, r
    ptx = c.asm["ptx"]
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
    assert shapes == {str(bk), str(D // 2)}, shapes          # [q; dO] kv^T and dS kv
    assert "setmaxnreg" in ptx


@pytest.mark.parametrize("prefetch,ablate,shapes", [
    (True, 0, {"32", "256"}), (False, 1, {"32", "256"}), (False, 2, {"32"}),
    (False, 3, {"256"}), (False, 4, set())])
def test_dq_kernel_variants_compile(prefetch, ablate, shapes):
    """Config.bwd_prefetch and the benchmark-only Config.bwd_ablate modes (which product is left
    out shows in the PTX's wgmma shapes; 1 drops the dsp stores, checked by their count)."""
    c = adapter.compile_kernel(
        bwd.csa_dq_kernel, bwd.arg_types("bf16"),
        bwd.constexprs(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=2, scale=0.05,
                       producer_regs=96, prefetch=prefetch, ablate=ablate),
        target="sm_90a", num_warps=bwd.CONSUMER_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None and r.get("spill_stores", 0) == 0, r
    ptx = c.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == shapes
    assert ("st.global.v4" in ptx) == (ablate != 1)       # the scale*dS / P stores


def _compile_dq(**kw):
    """The dq kernel at D = 512, 32-row tiles x 2 stages for sm_90a: (compiled, resources),
    checked launchable and spill-free."""
    c = adapter.compile_kernel(
        bwd.csa_dq_kernel, bwd.arg_types("bf16"),
        bwd.constexprs(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=2, scale=0.05,
                       producer_regs=96, **kw),
        target="sm_90a", num_warps=bwd.CONSUMER_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None and r.get("spill_stores", 0) == 0, r
    return c, r


@pytest.mark.parametrize("op,wgmma,mix", [
    ("desc", {"32", "256"}, {}),
    ("desc_a", {"32", "64"}, {}),
    ("ldsm_trans", {"32", "64"}, {"ldmatrix.sync.aligned.m8n8.x4.trans": 8}),
    ("movmatrix", {"32", "64"}, {"ldmatrix.sync.aligned.m8n8.x4.shared": 8, "movmatrix": 32}),
    ("strided", {"32", "64"}, {"ld.shared.b16": 64})])
def test_dq_kernel_operand_modes_compile(op, wgmma, mix):
    """Config.bwd_dq_operand: the five ways the dq product takes the kv tile compile with the
    same shared memory, no spills, the instruction shapes and shared loads meant (strided: one
    2-byte load per element of the 512 x 32 tile over 256 threads, no ldmatrix), and no extra
    shared-memory round trip (st.shared count as the default's)."""
    c, r = _compile_dq(dq_operand=op)
    assert r["shared"] == 217_292, r
    ptx = c.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == wgmma
    keys = ("ldmatrix.sync.aligned.m8n8.x4.trans", "ldmatrix.sync.aligned.m8n8.x4.shared",
            "movmatrix", "ld.shared.b16")
    assert {k: ptx.count(k) for k in keys if ptx.count(k)} == mix
    assert ptx.count("st.shared") == 12


@pytest.mark.parametrize("op,stages,mix", [
    ("desc", 4, {}), ("desc", 3, {}), ("desc_pipe", 4, {}),
    ("ldsm_trans", 4, {"ldmatrix.sync.aligned.m8n8.x4.trans": 16}),
    ("movmatrix", 4, {"ldmatrix.sync.aligned.m8n8.x4.shared": 16, "movmatrix": 64})])
def test_interm_kernel_compiles_sm90(op, stages, mix):
    """kernels/gluon/interm.py at Pro shapes (Hp 128, Kp 1152, D 512): inside the H200's shared
    memory, no spills, m64n256k16 with B (and A when op = "desc") through MN-major descriptors
    (the wgmma transpose immediates), A loaded as meant otherwise."""
    from csa_jax.kernels.gluon import interm
    c = adapter.compile_kernel(interm.csa_interm_kernel, interm.arg_types("bf16"),
                               interm.constexprs(Hp=128, Kp=1152, D=512, stages=stages,
                                                 operand=op.split("_pipe")[0],
                                                 pipeline=op.endswith("_pipe")),
                               target="sm_90a", num_warps=bwd.CONSUMER_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None and r.get("spill_stores", 0) == 0, r
    est = interm.shared_bytes(128, 512, stages)
    assert est <= r["shared"] <= min(est + 1024, adapter.SHARED_LIMIT["sm_90a"]), (r, est)
    ptx = c.asm["ptx"]
    calls = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16[^;]*;", ptx)
    assert calls and not re.findall(r"m64n(?!256)\d+k16", ptx)
    tail = "1, 1, 1, 1;" if op.startswith("desc") else "1, 1, 1;"  # (scale-b,) trans-a, -b
    assert ("wgmma.wait_group.sync.aligned 1" in ptx) == op.endswith("_pipe")
    assert all(x.endswith(tail) for x in calls), calls[:2]
    keys = ("ldmatrix.sync.aligned.m8n8.x4.trans", "ldmatrix.sync.aligned.m8n8.x4.shared",
            "movmatrix", "ld.shared.b16")
    assert {k: ptx.count(k) for k in keys if ptx.count(k)} == mix


def test_dq_kernel_qdo_compiles():
    """Config.bwd_qdo: the same kernel plus the [q; dO] copy-out (2 * 64 rows x 512 columns in
    32-row chunks: 4 more 16-byte store instructions per chunk), same shared memory, no spills."""
    got = {}
    for qdo in (False, True):
        c, r = _compile_dq(qdo=qdo)
        got[qdo] = (r["shared"], len(re.findall(r"st\.global\.v4", c.asm["ptx"])))
    assert got[True][0] == got[False][0], got
    assert got[True][1] == got[False][1] + 32, got        # 128 rows x 1 KiB / (256 x 16 B)


@pytest.mark.parametrize("qdo,fuse", [(False, False), (True, True)])
def test_dq_kernel_pair_compiles(qdo, fuse):
    """Config.bwd_pair: S and dP regrouped in registers (no f32 S / dP exchange: no ld.shared in
    the tile loop beyond the default's [q; dO] copy-out), 16 KiB less shared memory, no spills,
    the same wgmma shapes; with Config.bwd_fuse_delta the o / dO loads of delta (16-byte)."""
    c, r = _compile_dq(pair=True, qdo=qdo, fuse_delta=fuse)
    assert r["shared"] == 200_876, r
    # ptxas did not serialize the wgmma (its C7514 warning: what slows bwd_scores_ahead down,
    # docs/perf/gluon_bwd_h200.md part 5)
    assert "C7514" not in r["ptxas"], r["ptxas"]
    assert r["shared"] <= bwd.shared_bytes(512, 32, 2, pair=True) + 1024
    ptx = c.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == {"32", "256"}
    base, _ = _compile_dq(qdo=qdo, fuse_delta=fuse)
    # the exchange's loads are gone (4 of them), the [q; dO] copy-out's remain
    assert ptx.count("ld.shared") == base.asm["ptx"].count("ld.shared") - 4
    plain, _ = _compile_dq(pair=True, qdo=qdo)
    # delta's 4 chunks x (o, dO, dlse) loads
    assert (ptx.count("ld.global") >= plain.asm["ptx"].count("ld.global") + 8) == fuse


def test_dq_kernel_no_gather_ablation():
    """Config.bwd_ablate 5 / 6 (benchmark only) in the paired lockstep kernel: the producer's
    16 cp.async a tile (32 rows x 1 KiB over 128 threads) are gone, the [q; dO] copy's stay;
    5 keeps the row-id loads (live through a predicated store of them), 6 drops them; same
    registers, no spills; refused by name where the kernel is not the paired lockstep one."""
    for a in (5, 6):
        assert gluon.Config(bwd_pair=True, bwd_ablate=a).bwd_ablate == a
    for bad in (dict(bwd_ablate=5), dict(bwd_ablate=6, bwd_pair=True, bwd_pipeline=True),
                dict(bwd_ablate=5, bwd_pair=True, bwd_schedule="alternate"),
                dict(bwd_ablate=7, bwd_pair=True)):
        with pytest.raises(ValueError, match=f"bwd_ablate={bad['bwd_ablate']}"):
            gluon.Config(**bad)
    base, _ = _compile_dq(pair=True, qdo=True, fuse_delta=True)
    ptx = {a: _compile_dq(pair=True, qdo=True, fuse_delta=True, ablate=a)[0].asm["ptx"]
           for a in (5, 6)}
    n = {a: (p.count("cp.async.cg"), p.count("ld.global")) for a, p in ptx.items()}
    assert n[5][0] == n[6][0] == base.asm["ptx"].count("cp.async.cg") - 16, n
    assert n[6][1] < n[5][1] and n[6][1] < base.asm["ptx"].count("ld.global"), n
    assert ptx[5].count("st.global") > ptx[6].count("st.global")     # the ids' store


def test_dq_kernel_pipeline_compiles():
    """Config.bwd_pipeline: the same buffers (200,876 B), no spills, the same wgmma shapes; the
    dq product left in flight (one wait_group 1 per tile: tile i-1's dq product retired behind
    tile i's issued scores) and the dsp stores issued after it; refused off bwd_pair / with
    another dq operand mode by name."""
    c, r = _compile_dq(pair=True, qdo=True, fuse_delta=True, pipeline=True)
    assert r["shared"] == 200_876, r
    ptx = c.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == {"32", "256"}
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    assert waits.count("1") == 1, waits
    loop = ptx[ptx.index("m64n256k16"):]
    assert "st.global.b32" in loop[:loop.index("mbarrier.try_wait")]   # dsp under dq
    for bad in (dict(bwd_pipeline=True), dict(bwd_pipeline=True, bwd_pair=True,
                                              bwd_dq_operand="desc_a"),
                dict(bwd_pipeline=1, bwd_pair=True)):
        with pytest.raises(ValueError, match="bwd_pipeline"):
            gluon.Config(**bad)


def test_dq_kernel_qdo_regs_compiles():
    """Config.bwd_qdo_regs=1 (bwd_pipe.csa_dq_blk_kernel): [q; dO] block 0 as the score
    product's register A operand (4 of the 32 k-steps a tile), dS in its shared memory: no dS
    buffer, 3 stages of 32 rows fit at D = 512; no spills, also with bwd_scores_ahead (the
    producer at 40 registers); the options' refusals by name."""
    from csa_jax.kernels.gluon import bwd_pipe
    from csa_jax.kernels.gluon.dims import dq_blk_shared_bytes
    for stages, ahead in ((2, False), (3, True)):
        c = adapter.compile_kernel(
            bwd_pipe.csa_dq_blk_kernel, bwd.arg_types("bf16"),
            bwd.constexprs(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=stages, scale=0.05,
                           producer_regs=40 if ahead else 96, qdo=True, pair=True,
                           fuse_delta=True, pipeline=True, qdo_regs=1, scores_ahead=ahead),
            target="sm_90a", num_warps=bwd.CONSUMER_WARPS)
        r = adapter.resources(c, "sm_90a")
        assert r["launch_problem"] is None and r.get("spill_stores", 0) == 0, r
        est = dq_blk_shared_bytes(512, 32, stages)
        assert est <= r["shared"] <= est + 1024, (r, est)       # 3 stages: 229,580 B
        rs = re.findall(r"m64n32k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", c.asm["ptx"])
        # register-A score k-steps (ahead: tile 0's scores are issued before the loop too)
        assert len(rs) == (8 if ahead else 4), len(rs)
        # the scores are 8 wgmma groups (one a 64-column block): the waits that must leave
        # them in flight leave 8
        waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", c.asm["ptx"]))
        assert waits == {"0", "8"}, waits
    for bad in (dict(bwd_qdo_regs=1, bwd_pair=True), dict(bwd_qdo_regs=3, bwd_pair=True,
                                                          bwd_pipeline=True),
                dict(bwd_qdo_regs=True, bwd_pair=True, bwd_pipeline=True)):
        with pytest.raises(ValueError, match="bwd_qdo_regs"):
            gluon.Config(**bad)
    blk = dict(bwd_pair=True, bwd_pipeline=True, bwd_qdo_regs=1)
    for bad in (dict(bwd_scores_ahead=True, bwd_pair=True, bwd_pipeline=True, bwd_stages=3),
                dict(bwd_scores_ahead=True, **blk, bwd_stages=2),
                dict(bwd_scores_ahead=1, **blk, bwd_stages=3)):
        with pytest.raises(ValueError, match="bwd_scores_ahead"):
            gluon.Config(**bad)


@pytest.mark.parametrize("qdo,fuse,regs,order", [(False, False, 232, "s_first"),
                                                 (True, True, 232, "s_first"),
                                                 (True, True, 224, "s_first"),
                                                 (True, True, 232, "dq_first")])
def test_dq_alt_kernel_compiles(qdo, fuse, regs, order):
    """Config.bwd_schedule="alternate" (bwd_alt.py): 12 warps, the scores on M = 128 per
    warpgroup (m64n32k16, twice per k-step) and the dq halves (m64n256k16), both dS buffers
    inside the H200's shared memory, no spills at the default consumer registers."""
    from csa_jax.kernels.gluon import bwd_alt
    c = adapter.compile_kernel(
        bwd_alt.csa_dq_alt_kernel, bwd.arg_types("bf16"),
        bwd_alt.constexprs(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=2, scale=0.05,
                           consumer_regs=regs, qdo=qdo, fuse_delta=fuse, order=order),
        target="sm_90a", num_warps=bwd_alt.NUM_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None and r["num_warps"] == 12, r
    assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0, r
    est = bwd_alt.shared_bytes(512, 32, 2)
    assert est <= r["shared"] <= est + 1024, (r, est)
    ptx = c.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == {"32", "256"}
    assert ptx.count("setmaxnreg") >= 3
    with pytest.raises(ValueError, match="even ring depth"):
        bwd_alt.constexprs(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=3, scale=0.05)


@pytest.mark.parametrize("D,R,warps,regs_max", [(512, 16, 4, 168), (512, 32, 8, 168),
                                                (64, 16, 4, 64)])
def test_dkv_reduce_kernel_compiles_sm90(D, R, warps, regs_max):
    """kernels/gluon/dkv.py: 16-byte loads (ld.global.v4), no spills at the tiles offered."""
    from csa_jax.kernels.gluon import dkv
    c = adapter.compile_kernel(dkv.csa_dkv_reduce_kernel, dkv.arg_types("bf16"),
                               dkv.constexprs(N=20480, E=16384 * 1152, D=D, R=R),
                               target="sm_90a", num_warps=warps)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None, r
    assert r.get("spill_stores", 0) == 0 and r["registers"] <= regs_max, r
    assert "ld.global.v4" in c.asm["ptx"]
    with pytest.raises(ValueError, match="block_r=8"):
        dkv.reduce_rows(jnp.zeros((1, 4, 2), jnp.int32), jnp.zeros((1, 8), jnp.int32),
                        jnp.zeros((1, 8, 512), jnp.bfloat16), jnp.bfloat16, block_r=8,
                        num_warps=16)


@pytest.mark.parametrize("target,warp", [("gfx942", 64), ("gfx950", 64), ("gfx1250", 32)])
def test_dkv_reduce_kernel_compiles_amd(target, warp):
    """The Gluon reduce uses no NVIDIA-only op: it compiles for the AMD targets (64-lane waves
    on CDNA), in their LDS, without scratch (spills). Compile only: nothing launches it on AMD."""
    from csa_jax.kernels.gluon import dkv
    c = adapter.compile_kernel(dkv.csa_dkv_reduce_kernel, dkv.arg_types("bf16"),
                               dkv.constexprs(N=20480, E=16384 * 1152, D=512, R=16, warp=warp),
                               target=target, num_warps=4)
    r = adapter.resources(c, target)
    assert r["shared"] <= adapter.SHARED_LIMIT[target], r
    assert not r.get("vgpr_spill") and not r.get("scratch"), r


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "gfx1250"])
def test_interm_kernel_is_nvidia_only(target):
    """wgmma, NVMMA layouts and setmaxnreg: the AMD backends reject the interm GEMM while
    building it, as they do the dq kernel."""
    from csa_jax.kernels.gluon import interm
    with pytest.raises(RuntimeError):
        adapter.compile_kernel(interm.csa_interm_kernel, interm.arg_types("bf16"),
                               interm.constexprs(Hp=128, Kp=256, D=512), target=target,
                               num_warps=bwd.CONSUMER_WARPS)


def test_transpose_probe_amd_transpose_load():
    """The AMD analog compiles (no AMD GPU here): on gfx950 the transposed view of the tile is
    read with ds_read_b64_tr_b16 (CDNA4's transpose-load), on gfx942 with 2-byte ds_read_u16;
    no spills."""
    from benchmarks import gluon_transpose_probe as tp
    rows = {(r["target"], r["mode"]): r for r in tp.compile_amd()}
    assert all(r["vgpr_spill"] == 0 for r in rows.values()), rows
    assert "ds_read_b64_tr_b16" not in rows["gfx950", 0]["lds_mix"]
    assert rows["gfx950", 1]["lds_mix"].get("ds_read_b64_tr_b16", 0) >= 8
    assert "ds_read_b64_tr_b16" not in rows["gfx942", 1]["lds_mix"]
    assert rows["gfx942", 1]["lds_mix"].get("ds_read_u16", 0) >= 32


def test_amd_dq_kernel_strided_read_gfx950():
    """amd_bwd.py trans=2 (the strided mode, no AMD GPU here): on gfx950 the kv tile of dS kv
    is read with plain 2-byte ds_read_u16 where the default uses CDNA4's ds_read_b64_tr_b16."""
    from csa_jax.kernels.gluon import amd_bwd
    d = amd_bwd.DQ_DEFAULTS["gfx950"]
    mix = {}
    for trans in (0, 2):
        c = adapter.compile_kernel(
            amd_bwd.csa_dq_amd_kernel, amd_bwd.arg_types("bf16"),
            amd_bwd.constexprs(target="gfx950", T=64, N=300, NHB=2, D=512, K=192,
                               BK=d["block_k"], stages=d["stages"], scale=0.05, qdo=d["qdo"],
                               trans=trans),
            target="gfx950", num_warps=d["warps"])
        asm = c.asm["amdgcn"]
        mix[trans] = {k: len(re.findall(rf"^\s+{k}\b", asm, re.M))
                      for k in ("ds_read_b64_tr_b16", "ds_read_u16")}
    assert mix[0]["ds_read_b64_tr_b16"] > 0 and mix[0]["ds_read_u16"] == 0, mix
    assert mix[2]["ds_read_b64_tr_b16"] == 0 and mix[2]["ds_read_u16"] > 0, mix


def test_config_switch():
    assert gluon.Config().bwd == "gluon"
    assert dataclasses.replace(gluon.Config(), bwd="pallas_triton").bwd == "pallas_triton"
    for bad in (dict(bwd="xla"), dict(bwd_block_k=48), dict(bwd_stages=0),
                dict(bwd_stages=True), dict(bwd_prefetch=1), dict(bwd_ablate=5),
                dict(bwd_ablate=True), dict(bwd_qdo=1), dict(bwd_narrow_keys="yes"),
                dict(bwd_block_r=24), dict(bwd_reduce_warps=3), dict(bwd_reduce="xla"),
                dict(bwd_dq_operand="strided_x"), dict(bwd_interm="cublas"),
                dict(bwd_interm_operand="strided"), dict(bwd_interm_stages=5),
                dict(bwd_interm_pipeline=1),
                dict(bwd_interm_pipeline=True, bwd_interm_operand="movmatrix"),
                dict(bwd_pair=1), dict(bwd_pair=True, bwd_prefetch=True),
                dict(bwd_pair=True, bwd_ablate=2), dict(bwd_fuse_delta=1),
                dict(bwd_schedule="default"), dict(bwd_schedule="alternate", bwd_stages=3),
                dict(bwd_schedule="alternate", bwd_dq_operand="desc_a"), dict(bwd_alt_regs=236),
                dict(bwd_alt_order="pv_first")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            gluon.Config(**bad)
    for D in (64, 128, 256, 512):
        c = gluon.default_config((1, 8, 64, D), None, None, jnp.bfloat16)
        assert bwd.shared_bytes(D, c.bwd_block_k, c.bwd_stages) <= bwd.SMEM_LIMIT - 8192


def test_default_config_backward_options(monkeypatch):
    """default_config: on NVIDIA (here: not an AMD device) the dq kernel writes [q; dO], pairs
    the q / dO rows and forms delta, and the Gluon reduce sums dkv (gluon.NVIDIA_BWD, checked
    against xla on the H200); the AMD route, which refuses bwd_qdo / bwd_pair, keeps the Pallas
    Triton reduce."""
    c = gluon.default_config((1, 8, 128, 512), None, None, jnp.bfloat16)
    assert (c.bwd_qdo, c.bwd_reduce, c.bwd_pair, c.bwd_fuse_delta) == (True, "gluon", True,
                                                                         True), c
    assert c.bwd_schedule == "lockstep" and (c.bwd_block_k, c.bwd_stages) == (32, 2), c
    assert gluon.NVIDIA_BWD == dict(bwd_qdo=True, bwd_reduce="gluon", bwd_pair=True,
                                    bwd_fuse_delta=True)
    monkeypatch.setattr(gluon, "_amd", lambda: "gfx950")
    c = gluon.default_config((1, 8, 128, 512), None, None, jnp.bfloat16)
    assert (c.bwd_qdo, c.bwd_reduce, c.bwd_pair) == (False, "pallas_triton", False), c


def test_dq_tiles_follow_the_schedule():
    """_bwd_default: the alternating dq kernel gets an even ring depth inside the H200's shared
    memory (dims.dq_alt_shared_bytes); bwd_pair's smaller buffers keep the lockstep tiles."""
    from csa_jax.kernels.gluon.dims import SMEM_LIMIT, dq_alt_shared_bytes
    for D in (64, 128, 256, 512):
        alt = gluon._bwd_default(D, gluon.Config(bwd_schedule="alternate"))
        assert alt.bwd_stages % 2 == 0 and dq_alt_shared_bytes(
            D, alt.bwd_block_k, alt.bwd_stages) <= SMEM_LIMIT - 8192, (D, alt)
        lock = gluon._bwd_default(D, gluon.Config())
        pair = gluon._bwd_default(D, gluon.Config(bwd_pair=True))
        assert (pair.bwd_block_k, pair.bwd_stages) == (lock.bwd_block_k, lock.bwd_stages)
    assert (alt.bwd_block_k, alt.bwd_stages) == (32, 2)                  # D = 512


def test_variant_schedule_repicks_the_dq_tiles():
    """gluon.replace_config (what bench_csa / gluon_bwd_check apply variants with): a variant
    that switches bwd_schedule on top of a default picked for the lockstep kernel gets the
    alternating kernel's even tiles (the D = 64 / 128 grad cases of call A failed with
    "needs an even bwd_stages, got 3"); tiles the variant names are kept; a plain override
    changes only itself."""
    from benchmarks import gluon_bwd_check as gb
    from benchmarks.common import apply_overrides
    for D in (64, 128, 512):
        base = gluon.default_config((1, 8, 64, D), None, None, jnp.bfloat16)
        alt = gluon.replace_config(base, (1, 8, 64, D), bwd_schedule="alternate")
        assert alt == gluon._bwd_default(D, dataclasses.replace(
            base, bwd_schedule="alternate", bwd_stages=2)), (D, alt)
        assert alt.bwd_stages % 2 == 0 and alt.bwd_schedule == "alternate"
        back = gluon.replace_config(alt, (1, 8, 64, D), bwd_schedule="lockstep")
        assert (back.bwd_block_k, back.bwd_stages) == (base.bwd_block_k, base.bwd_stages)
    base = gluon.default_config((1, 8, 64, 64), None, None, jnp.bfloat16)
    assert base.bwd_stages == 3                               # the case call A tripped on
    with pytest.raises(ValueError, match="even bwd_stages, got 3"):
        dataclasses.replace(base, bwd_schedule="alternate")
    kept = gluon.replace_config(base, (1, 8, 64, 64), bwd_schedule="alternate", bwd_block_k=32,
                                bwd_stages=4)
    assert (kept.bwd_block_k, kept.bwd_stages) == (32, 4)
    assert gluon.replace_config(base, (1, 8, 64, 64), bwd_reduce="pallas_triton") == (
        dataclasses.replace(base, bwd_reduce="pallas_triton"))
    assert apply_overrides(gluon, base, (1, 8, 64, 64), {"bwd_schedule": "alternate"}) == (
        gluon.replace_config(base, (1, 8, 64, 64), bwd_schedule="alternate"))
    got = gb.make_variants("alt:bwd_schedule=alternate")((1, 8, 64, 64))
    assert [n for n, _ in got] == ["default", "alt"] and got[1][1].bwd_stages % 2 == 0
    # bwd_qdo_regs (bwd_pipe's blocked kernel, no dS buffer): a third 32-row stage at D = 512
    base = gluon.default_config((1, 8, 128, 512), None, None, jnp.bfloat16)
    blk = gluon.replace_config(base, (1, 8, 128, 512), bwd_pipeline=True, bwd_qdo_regs=1)
    assert (blk.bwd_block_k, blk.bwd_stages) == (32, 3), blk


def test_oversized_tiles_are_refused_by_name():
    q = jnp.zeros((1, 4, 64, 512), jnp.bfloat16)
    kv = jnp.zeros((1, 8, 512), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 64), jnp.int32)
    f32 = jnp.zeros((1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="bwd_block_k=64, bwd_stages=2 at D=512"):
        bwd.backward(q, kv, idx, jnp.zeros(64), q, f32, q, f32, scale=0.1, block_k=64,
                     stages=2, producer_regs=96)


def _emulated_dq_kernel(q, do, kv, idx, ntiles, lse, dc, o=None, *, kernel, out_shape, grid,
                        num_warps, name, T, N, NHB, D, K, BK, SCALE, QDO, FUSE=False, **_):
    """What csa_dq_kernel computes, in jnp (its contract; see the bwd.py docstring). FUSE
    (Config.bwd_fuse_delta): dc holds dlse, the kernel subtracts delta = sum(o * dO) and
    writes the result out."""
    from csa_jax.kernels.gluon import amd_bwd, bwd_alt, bwd_pipe
    amd_warps = amd_bwd.DQ_DEFAULTS["gfx950"]["warps"]
    assert (kernel, num_warps) in ((bwd.csa_dq_kernel, bwd.CONSUMER_WARPS),
                                   (bwd_pipe.csa_dq_blk_kernel, bwd.CONSUMER_WARPS),
                                   (bwd_alt.csa_dq_alt_kernel, bwd_alt.NUM_WARPS),
                                   (amd_bwd.csa_dq_amd_kernel, amd_warps))
    BT = idx.shape[0]
    Hp, B = NHB * bwd.HB, BT // T
    assert grid == (BT * NHB,) and q.shape == (BT * Hp, D) and kv.shape == (B * N, D)
    f32 = jnp.float32
    qf = q.reshape(BT, Hp, D).astype(f32)
    dof = do.reshape(BT, Hp, D).astype(f32)
    rows = kv.reshape(B, N, D)[jnp.arange(BT)[:, None] // T, jnp.maximum(idx, 0)].astype(f32)
    walked = jnp.arange(K)[None, :] < (ntiles * BK)[:, None]
    valid = ((idx >= 0) & walked)[:, None, :]                                   # [BT, 1, K]
    s = jnp.einsum("thd,tkd->thk", qf, rows)
    if FUSE:
        dc = dc - jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)
    lse2, dc2 = lse.reshape(BT, Hp, 1), dc.reshape(BT, Hp, 1)
    p = jnp.where(valid, jnp.exp(jnp.where(valid, s * SCALE - lse2, 0.0)), 0.0)
    ds = p * (jnp.einsum("thd,tkd->thk", dof, rows) + dc2)
    dt = out_shape[0].dtype
    dq = SCALE * jnp.einsum("thk,tkd->thd", ds.astype(dt).astype(f32), rows)
    dsp = jnp.stack([ds * SCALE, p], axis=1)                                  # [BT, 2, Hp, K]
    if kernel is amd_bwd.csa_dq_amd_kernel:    # the AMD kernel: (dq, dsp), no [q; dO] copy
        return dq.reshape(BT * Hp, D).astype(dt), dsp.astype(out_shape[1].dtype)
    qdo = jnp.zeros(out_shape[2].shape, dt)
    if QDO:     # head block first: [BT, NHB, 2, 64, .], and the kernel's copy of [q; dO]
        hb = lambda x: x.reshape(BT, 2, NHB, bwd.HB, -1).transpose(0, 2, 1, 3, 4)
        dsp = hb(dsp)
        qdo = hb(jnp.stack([q.reshape(BT, Hp, D), do.reshape(BT, Hp, D)], axis=1)).astype(dt)
    assert dsp.shape == out_shape[1].shape and qdo.shape == out_shape[2].shape
    dcout = dc if FUSE else jnp.zeros((8,), f32)
    assert dcout.shape == out_shape[3].shape and o.shape == q.shape
    return dq.reshape(BT * Hp, D).astype(dt), dsp.astype(out_shape[1].dtype), qdo, dcout


def _emulated_reduce_kernel(offsets, perm, interm, *, kernel, out_shape, grid, num_warps, name,
                            N, E, D, R, TC, WARP):
    """What csa_dkv_reduce_kernel computes (kernels/gluon/dkv.py), in jnp: per row n of
    offsets [B*N, 2], the sum of interm rows perm[b, start:end]."""
    from csa_jax.kernels.gluon import dkv
    assert kernel is dkv.csa_dkv_reduce_kernel and grid == (offsets.shape[0],)
    assert R >= num_warps * (WARP // TC) and interm.shape == (perm.shape[0] * E, D)
    BN = offsets.shape[0]
    b = jnp.arange(BN) // N
    e = jnp.arange(E)[None, :]
    member = (e >= offsets[:, :1]) & (e < offsets[:, 1:])                      # [BN, E]
    rows = interm.reshape(-1, E, D)[b[:, None], perm[b]].astype(jnp.float32)   # [BN, E, D]
    out = jnp.sum(jnp.where(member[..., None], rows, 0.0), axis=1)
    return out.astype(out_shape.dtype)


def _emulated_interm_kernel(dsp, q, do, *, kernel, out_shape, grid, num_warps, name, HP, KP,
                            D, BN, BM, BKC, **_):
    """What csa_interm_kernel computes (kernels/gluon/interm.py), in jnp: per token,
    dsp[t]^T [q[t]; dO[t]] with f32 accumulation, one rounding."""
    BT = q.shape[0] // HP
    assert grid == (BT * (D // BN),) and KP % BM == 0 and HP % BKC == 0, (grid, KP, HP)
    assert dsp.shape == (BT * 2 * HP, KP) and num_warps == bwd.CONSUMER_WARPS
    x = jnp.concatenate([q.reshape(BT, HP, D), do.reshape(BT, HP, D)], axis=1)
    out = jnp.einsum("tck,tcd->tkd", dsp.reshape(BT, 2 * HP, KP).astype(jnp.float32),
                     x.astype(jnp.float32))
    return out.reshape(BT * KP, D).astype(out_shape.dtype)


def _emulated_call(*args, kernel, **kw):
    from csa_jax.kernels.gluon import dkv, interm
    f = {dkv.csa_dkv_reduce_kernel: _emulated_reduce_kernel,
         interm.csa_interm_kernel: _emulated_interm_kernel}.get(kernel, _emulated_dq_kernel)
    return f(*args, kernel=kernel, **kw)


@pytest.mark.parametrize("H,D,K,bk,qdo,narrow,reduce,interm,amd,fuse", [
    (20, 24, 40, 16, False, False, "pallas_triton", "xla", None, False),
    (64, 64, 70, 32, False, False, "gluon", "xla", None, False),
    (130, 24, 40, 16, True, True, "pallas_triton", "xla", None, False),
    (130, 24, 40, 16, True, True, "gluon", "xla", None, False),
    (130, 24, 140, 32, False, True, "gluon", "gluon", None, False),
    (64, 64, 40, 16, False, False, "pallas_triton", "gluon", None, False),
    (70, 40, 75, 32, False, False, "pallas_triton", "xla", "gfx950", False),
    (130, 24, 40, 16, True, False, "gluon", "xla", None, True),
    (20, 24, 40, 16, False, False, "pallas_triton", "xla", None, True),
    (70, 40, 75, 32, False, False, "pallas_triton", "xla", "gfx950", True),
    (130, 24, 40, 16, True, False, "gluon", "xla", None, "alternate"),
    (64, 64, 70, 32, True, False, "gluon", "xla", None, "dq_first"),
    (130, 24, 40, 16, True, False, "gluon", "xla", None, "blk"),
    (64, 64, 70, 32, True, False, "gluon", "xla", None, "ahead")])
def test_wrapper_against_dense_oracle(rng, monkeypatch, H, D, K, bk, qdo, narrow, reduce,
                                      interm, amd, fuse):
    """qdo = Config.bwd_qdo (the dq kernel writes [q; dO] and dsp head block first; 3 head
    blocks at H = 130), narrow = Config.bwd_narrow_keys (int16 inverse-map keys), reduce =
    Config.bwd_reduce, interm = Config.bwd_interm (the Gluon reduce and interm kernels
    emulated: their launch plumbing, K padded to 128 for the interm GEMM, the CSR map);
    amd: the ROCm route (amd_bwd.csa_dq_amd_kernel, same contract; never run on a GPU), which
    ignores fuse = Config.bwd_fuse_delta (dlse in, delta formed by the kernel, dlse - delta
    out for dsink; here with Config.bwd_pair, whose kernel has the same contract; fuse =
    "alternate" / "dq_first": both with Config.bwd_schedule="alternate" (bwd_alt's kernel, same
    contract), in its two step orders; "blk": bwd_pipeline + bwd_qdo_regs, bwd_pipe's blocked
    kernel, same contract; "ahead": the same at 3 stages with bwd_scores_ahead)."""
    from csa_jax.common import sanitize_indices
    monkeypatch.setattr(adapter, "gluon_call", _emulated_call)
    q, kv, idx, sink = random_problem(rng, T=10, H=H, D=D, K=K, dtype=jnp.float32, empty_rows=2)
    idx = sanitize_indices(idx, kv.shape[1])
    scale = 0.7 * D ** -0.5
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    o, lse = dense_oracle(q, kv, idx, sink, scale)
    o, lse = jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)
    dq, dkv, dsink = bwd.backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale, block_k=bk,
                                  stages=3 if fuse == "ahead" else 2, producer_regs=96, qdo=qdo, narrow_keys=narrow,
                                  reduce=reduce, interm=interm, block_r=16 if qdo else 0,
                                  interpret_reduce=True, amd=amd, fuse_delta=bool(fuse),
                                  pair=bool(fuse) and amd is None,
                                  schedule="alternate" if fuse in ("alternate", "dq_first") else
                                  "lockstep", dq_pipeline=fuse in ("blk", "ahead"),
                                  qdo_regs=int(fuse in ("blk", "ahead")),
                                  scores_ahead=fuse == "ahead",
                                  alt_order="dq_first" if fuse == "dq_first" else "s_first")
    _, _, rdq, rdkv, rdsink = dense_oracle(q, kv, idx, sink, scale, do, dlse)
    for what, got, want in (("dq", dq, rdq), ("dkv", dkv, rdkv), ("dsink", dsink, rdsink)):
        assert got.shape == want.shape, (what, got.shape, want.shape)
        assert_close(got, want, jnp.float32, factor=10, what=what)
    jax.clear_caches()          # the emulated kernel must not stay in bwd.backward's jit cache
    assert np.isfinite(np.asarray(dkv)).all()


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "gfx1250"])
@pytest.mark.parametrize("kind", ["lockstep", "pair", "alternate"])
def test_dq_kernel_is_nvidia_only(target, kind):
    """wgmma, NVMMA layouts, cp.async and setmaxnreg: the AMD backends reject the kernels (the
    lockstep one, with bwd_pair, the alternating one) while building them (a RuntimeError from
    Triton's parser or pass manager), not later at launch; the wrapper refuses the NVIDIA-only
    options by name on the AMD route (test_wrapper_against_dense_oracle's gfx950 rows)."""
    from csa_jax.kernels.gluon import bwd_alt
    dims = dict(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=2, scale=0.1)
    if kind == "alternate":
        fn, consts, warps = bwd_alt.csa_dq_alt_kernel, bwd_alt.constexprs(**dims), 4
    else:
        fn, warps = bwd.csa_dq_kernel, bwd.CONSUMER_WARPS
        consts = bwd.constexprs(**dims, producer_regs=96, pair=kind == "pair")
    with pytest.raises(RuntimeError):
        adapter.compile_kernel(fn, bwd.arg_types("bf16"), consts, target=target,
                               num_warps=warps)


def test_amd_route_refuses_nvidia_only_options():
    q = jnp.zeros((1, 4, 64, 512), jnp.bfloat16)
    kv = jnp.zeros((1, 8, 512), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 64), jnp.int32)
    f32 = jnp.zeros((1, 4, 64), jnp.float32)
    for kw, name in ((dict(pair=True), "bwd_pair=True"),
                     (dict(schedule="alternate"), "bwd_schedule='alternate'")):
        with pytest.raises(ValueError, match=name):
            bwd.backward(q, kv, idx, jnp.zeros(64), q, f32, q, f32, scale=0.1, block_k=32,
                         stages=1, producer_regs=96, amd="gfx942", **kw)


def test_transpose_probe_modes_compile_to_the_three_ways():
    """benchmarks/gluon_transpose_probe.py: what each mode's loop reads shared memory with, as
    docs/perf/gluon_bwd_h200.md reports it (sm_90a PTX of the ITERS loop)."""
    from benchmarks import gluon_transpose_probe as tp
    mix = {}
    for mode in tp.MODES:
        c = adapter.compile_kernel(tp.transpose_probe_kernel, tp.ARG_TYPES,
                                   tp.constexprs(mode), target="sm_90a", num_warps=4)
        assert adapter.resources(c, "sm_90a").get("spill_stores", 0) == 0
        mix[mode] = tp.instruction_mix(tp.loop_body(c.asm["ptx"]))
    assert mix[0] == {"ldmatrix.sync.aligned.m8n8.x4.shared": 4}            # plain
    assert mix[1] == {"ldmatrix.sync.aligned.m8n8.x4.trans": 4}             # transpose-load
    # "register" transpose: Triton's layout conversion goes back through shared memory.
    assert mix[2]["ld.shared.v4"] == 4 and mix[2]["st.shared"] >= 1 and mix[2]["bar.sync"] >= 1
    assert mix[3] == {"ld.shared.b16": 32}                                   # strided 2-byte
    assert mix[6] == {"ldmatrix.sync.aligned.m8n8.x4.shared": 4,             # register transpose
                      "movmatrix.sync.aligned.m8n8.trans.b16": 16}
    # wgmma reading both operands from shared memory: the descriptors' transpose immediates.
    for mode, bits in ((4, "0, 0"), (5, "1, 1")):
        c = adapter.compile_kernel(tp.wgmma_probe_kernel, tp.WGMMA_ARG_TYPES,
                                   tp.wgmma_constexprs(mode), target="sm_90a", num_warps=4)
        assert adapter.resources(c, "sm_90a").get("spill_stores", 0) == 0
        calls = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16[^;]*;",
                           c.asm["ptx"])
        assert len(calls) == 4 and all(x.endswith(f"1, 1, {bits};") for x in calls), calls


def test_dkv_parts_benchmark_dry_run():
    """benchmarks/gluon_dkv_parts.py's pieces on a CPU (tiny Pro cr4 problem, the reduce in the
    Pallas interpreter): every CPU piece reports a time, the int16-key inverse map equals the
    int32 one, and nothing fails (the GPU-only pieces are skipped)."""
    from benchmarks import gluon_check, gluon_dkv_parts as dp
    start = len(gluon_check.RESULTS)
    dp.part_pieces([("pro", 4, 64)], seed=3, reps=1, reduce_variants=[(16, 4)],
                   gluon_reduce_variants=[(16, 4)], interm_operands=["desc"], pieces=set(),
                   interpret=True)
    rows = gluon_check.RESULTS[start:]
    assert not [r for r in rows if r.get("ok") is False], rows
    timed = {r["piece"] for r in rows if "ms" in r}
    assert timed == {"stack", "gemm", "gemm_qdo", "invmap", "invmap16", "reduce", "reduce_16_4",
                     "read", "dkv"}, timed
    assert [r["ok"] for r in rows if r["piece"] == "invmap16_same"] == [True]


def test_bwd_check_selection_dry_run(monkeypatch):
    """benchmarks/gluon_bwd_check.py's --grad-cases / --skip on a CPU, the gluon and
    pallas_triton impls stood in for by xla (Gluon cannot run here) and the timed problem made
    tiny: which rows each option leaves, and that every row still reports and passes."""
    import csa_jax
    from benchmarks import gluon_bwd_check as gb, gluon_check
    from csa_jax import problems, registry
    xla = registry.get("xla")

    class Stand:                       # the gluon impl's Config, xla's numbers
        Config = gluon.Config
        default_config = staticmethod(gluon.default_config)

        @staticmethod
        def forward(q, kv, idx, s, *, scale, interpret, config):
            return xla.forward(q, kv, idx, s, scale=scale, interpret=False, config=xla.Config())

        @staticmethod
        def backward(*a, scale, interpret, config):
            return xla.backward(*a, scale=scale, interpret=False, config=xla.Config())

    real_get, real_make = registry.get, problems.make_problem
    monkeypatch.setattr(registry, "get",
                        lambda n: Stand if n in ("gluon", "pallas_triton") else real_get(n))
    monkeypatch.setattr(problems, "make_problem", lambda c, T, **kw: real_make(c, 32, **kw))
    del csa_jax
    v = "pf:bwd_pair=true,bwd_fuse_delta=true"
    start = len(gluon_check.RESULTS)
    assert gb.main(["--parts", "grad,time", "--grad-variants", v, "--variants", v,
                    "--grad-cases", "h16_d64_bf16_sink_pad", "--shapes", "flash:0:64",
                    "--skip", "default,e2e,dq,step,pallas"]) == 0
    rows = gluon_check.RESULTS[start:]
    assert [(r["part"], r.get("case"), r.get("variant")) for r in rows if r["part"] == "grad"] == [
        ("grad", "h16_d64_bf16_sink_pad", "pf")]
    timed = [r for r in rows if r["part"] == "time"]
    assert [r["impl"] for r in timed] == ["gluon:default", "gluon:pf"]
    assert timed[0]["dq_ms"] is None and "err_vs_default" in timed[1] and timed[1]["ok"]
    assert not [r for r in rows if r["part"] == "step"]
    with pytest.raises(SystemExit):
        gb.main(["--parts", "grad", "--skip", "nothing"])
