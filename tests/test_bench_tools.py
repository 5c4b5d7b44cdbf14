"""The GPU benchmarks' helpers, on CPU (the scripts run on the device machine, so what can run
here is tested here): variant specs with int, bool and string values, and the forward probe
script end to end in interpret mode."""
from __future__ import annotations

import dataclasses
import re

import pytest

from benchmarks import common, triton_fwd_probe
from csa_jax.kernels import triton as pallas_triton


def test_variant_specs_reach_the_config():
    got = common.parse_variants("fused:interm=dq,block_k_dq=64; hm:slot_major_dq=false",
                                   base={"num_stages": 2})
    assert got == [("default", {"num_stages": 2}),
                   ("fused", {"num_stages": 2, "interm": "dq", "block_k_dq": 64}),
                   ("hm", {"num_stages": 2, "slot_major_dq": False})]
    cfg = dataclasses.replace(pallas_triton.Config(), **got[1][1])
    assert (cfg.interm, cfg.block_k_dq, cfg.num_stages) == ("dq", 64, 2)
    with pytest.raises(ValueError, match="interm='kernal'"):
        dataclasses.replace(pallas_triton.Config(), **common.parse_overrides("interm=kernal"))


def test_forward_probes_run_and_full_matches_xla():
    """Every probe kernel runs under the forward's launch (interpret mode, smallest V4 problem);
    `full` is the library kernel and must match impl="xla" on the same inputs."""
    rows = triton_fwd_probe.main(["--interpret", "--problems", "flash-cr0-128", "--reps", "1",
                                  "--time-cap", "0"])
    assert [r["probe"] for r in rows] == list(triton_fwd_probe.PROBES)
    assert all("error" not in r and r["ms"] > 0 for r in rows), rows
    full = rows[0]["rel_err"]
    assert full["o"] < 1e-2 and full["lse"] < 1e-4, full
    with pytest.raises(SystemExit):
        triton_fwd_probe.main(["--interpret", "--probes", "full,nope"])


def test_bench_csa_runs_end_to_end(tmp_path, capsys):
    """bench_csa.py's whole main() in interpret mode at the smallest size, with an impl config
    override: the GPU calls run this script, and a broken import there (as at 45c1411) costs a
    device call."""
    import json

    from benchmarks import bench_csa

    out = tmp_path / "bench.json"
    bench_csa.main(["--interpret", "--impls", "xla,pallas_triton", "--families", "flash",
                    "--ratios", "0", "--seqs", "256", "--modes", "fwd", "--reps", "1",
                    "--time-cap", "0.1", "--impl-config", "num_stages=2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    tri = [r for r in rows if r["impl"] == "pallas_triton"]
    assert tri and "num_stages=2" in tri[0]["config"], rows
    assert tri[0]["rel_err"]["o"] < 2e-2, tri[0]
    printed = capsys.readouterr().out
    assert "| flash-cr0-T256 |" in printed
    assert "| pallas_triton | default | " in printed.split("Geometric mean speedup over xla")[1]
    assert tri[0]["fwd_speedup"] > 0


def test_bench_csa_heads_sweep(tmp_path, capsys):
    """--heads replaces the family's H (Pro's 128 over TP = 8 / 16 is 16 / 8 per device): one
    row per (H, impl) with its H, checked against xla at that H, and the per-H table."""
    import json

    from benchmarks import bench_csa

    assert bench_csa.parse_args(["--heads", "8,16,32,64,128"]).heads == [8, 16, 32, 64, 128]
    assert bench_csa.parse_args([]).heads == []
    with pytest.raises(SystemExit):
        bench_csa.parse_args(["--heads", "16,0"])
    cfg = common.heads_config(common.preset("pro", 4), 8)
    assert (cfg.num_heads, cfg.o_groups, cfg.head_dim) == (8, 8, 512)   # o_groups divides H
    out = tmp_path / "bench.json"
    bench_csa.main(["--interpret", "--impls", "xla,pallas_triton", "--families", "pro",
                    "--heads", "8,16", "--ratios", "0", "--seqs", "256", "--modes", "fwd",
                    "--reps", "1", "--time-cap", "0.1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["H"], r["impl"]) for r in rows] == [(8, "xla"), (8, "pallas_triton"),
                                                   (16, "xla"), (16, "pallas_triton")], rows
    for r in rows:
        assert "error" not in r and r["fwd_ms"] > 0, r
        assert r["fwd_flops_nominal"] == 4 * 256 * r["H"] * 128 * 512
    for r in rows[1::2]:
        assert r["rel_err"]["o"] < 2e-2 and r["rel_err"]["lse"] < 1e-3, r
    printed = capsys.readouterr().out
    assert "| pro-cr0-T256-H8 | - | pallas_triton | default |" in printed
    table = printed.split("## Per head count: fwd / step ms")[1]
    assert "| config | idx | H | xla | pallas_triton |" in table
    assert re.search(r"\| pro-cr0-T256 \| - \| 16 \| [0-9.]+ / - \| [0-9.]+ / - \|", table)


def test_bench_train_best_asks_the_registry_per_layer_type(monkeypatch):
    """`--impls best` is what impl="auto" runs: registry.resolve (which asks each kernel's
    unsupported()) for every layer type's shapes, not the first kernel that imports."""
    from benchmarks import bench_train
    from csa_jax import registry

    seen = []

    def resolve(impl, q_shape, kv_shape, idx_shape, dtype, platform):
        seen.append((impl, q_shape, kv_shape, idx_shape))
        return registry.get("pallas_triton" if q_shape[2] == 16 else "gluon")

    monkeypatch.setattr(registry, "resolve", resolve)
    assert bench_train.best_impl("small", 8192, 1, "bfloat16") == "pallas_triton"
    # small: H = 16, D = 128, window 128, top-k 512; cr0, cr4 and cr128 once each
    assert sorted(seen) == [("auto", (1, 8192, 16, 128), (1, 8192, 128), (1, 8192, 128)),
                            ("auto", (1, 8192, 16, 128), (1, 8192 + 64, 128), (1, 8192, 192)),
                            ("auto", (1, 8192, 16, 128), (1, 8192 + 2048, 128), (1, 8192, 640))]
    assert bench_train.best_impl("v4-flash-layer", 8192, 1, "bfloat16") == "gluon"
    monkeypatch.setattr(registry, "resolve", lambda impl, q, kv, idx, *a: registry.get(
        "gluon" if idx[2] == 128 else "pallas_triton"))
    assert bench_train.best_impl("small", 8192, 1, "bfloat16") == "auto"  # layers differ


def test_bench_train_config_variant_overrides_the_impl_default():
    from benchmarks import bench_train
    from csa_jax import registry

    shapes = ((1, 64, 4, 64), (1, 80, 64), (1, 64, 32), "bfloat16")
    base = registry.get("pallas_triton").default_config(*shapes)
    with bench_train.impl_config("pallas_triton", {"num_warps": 2, "block_k_dq": 64}):
        got = registry.get("pallas_triton").default_config(*shapes)
    assert (got.num_warps, got.block_k_dq) == (2, 64)
    assert got == dataclasses.replace(base, num_warps=2, block_k_dq=64)
    assert registry.get("pallas_triton").default_config(*shapes) == base   # restored
    assert bench_train.best_impl("small", 256, 1, "bfloat16", {"config.num_warps": 4}) == "xla"


def test_grad_check_and_failure_rows(capsys):
    """benchmarks/gluon_check's grad-check helpers (gluon_bwd_check, gluon_bwd_win_check,
    gluon_dkv_parts): per-gradient errors, dsink dropped without a sink, NaN or over-TOL fails;
    a failure row keeps the caller's fields first, then ok=False and the cut error."""
    import json

    import jax.numpy as jnp

    from benchmarks import gluon_check as gc
    ref = (jnp.ones((2, 3)), jnp.full((4,), 2.0), jnp.ones((1,)))
    got = (ref[0] * 1.01, ref[1], ref[2] * 3)
    errs, ok = gc.grad_check(got, ref, False, jnp.bfloat16)
    assert set(errs) == {"dq", "dkv"} and abs(errs["dq"] - 0.01) < 1e-6 and ok
    assert not gc.grad_check(got, ref, True, jnp.bfloat16)[1]           # dsink off by 2x
    assert not gc.grad_check(got, ref, False, jnp.float16)[1]           # 1% > f16's 5e-3
    assert not gc.grad_check((ref[0] * jnp.nan,) + ref[1:], ref, True, "bfloat16")[1]
    try:
        raise ValueError("x" * 600)
    except ValueError as e:
        gc.report_failure(e, 400, part="grad", case="c", variant="v")
    cap = capsys.readouterr()
    row = json.loads(cap.out.splitlines()[-1])
    assert list(row) == ["part", "case", "variant", "ok", "error"] and row["ok"] is False
    assert row["error"] == ("ValueError: " + "x" * 600)[:400] and "Traceback" in cap.err
    gc.RESULTS.remove(row)


def _xpose_rows(name, step_ms, errs=None):
    """bench_csa --check default rows of one config: the default and four modes."""
    fam, cr, T = name.split("-")
    rows = []
    for v, s in step_ms.items():
        r = dict(family=fam, ratio=int(cr[2:]), T=int(T[1:]), variant=v, fwd_ms=1.0, bwd_ms=s - 1.0, step_ms=s)
        if v != "default":
            r["rel_err_vs_default"] = (errs or {}).get(v, {"o": 0.0, "dq": 0.0})
        rows.append(r)
    return rows


def test_xpose_table_geomeans_and_error_gate(tmp_path, capsys):
    import json
    import math

    from benchmarks import xpose_table

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    json.dump({"rows": _xpose_rows("pro-cr4-T4096", dict(default=10.0, da=11.0, lt=12.0, mm=13.0, st=14.0))}, open(a, "w"))
    # b re-measures nothing of a's config and adds one whose strided mode differs from the default
    json.dump({"rows": _xpose_rows("pro-cr0-T4096", dict(default=4.0, da=4.0, lt=4.0, mm=5.0, st=8.0),
                                   errs={"st": {"dq": 3e-3}})}, open(b, "w"))
    s = xpose_table.summarize(xpose_table.load([a, b]))
    assert s["configs"] == ["pro-cr4-T4096", "pro-cr0-T4096"]
    assert math.isclose(s["default_over_st_step"], math.sqrt(1.4 * 2.0))
    assert math.isclose(s["lt_over_mm_step"], math.sqrt(13 / 12 * 5 / 4))
    assert xpose_table.main([str(a)]) == 0
    assert xpose_table.main([str(a), str(b)]) == 1            # st's 3e-3 > the default tol 0 (bit-equal)
    assert "FAIL pro-cr0-T4096 st" in capsys.readouterr().err
    assert xpose_table.main([str(a), str(b), "--tol", "1e-2"]) == 0
    # a variant of another name is listed and gated too
    json.dump({"rows": _xpose_rows("pro-cr0-T4096", dict(default=4.0, zz=4.5), errs={"zz": {"dq": 1e-3}})}, open(b, "w"))
    assert xpose_table.main([str(a), str(b)]) == 1
    assert "FAIL pro-cr0-T4096 zz" in capsys.readouterr().err
    # a variant that failed (an error row, no times) fails the table too
    json.dump({"rows": _xpose_rows("pro-cr0-T4096", dict(default=4.0))
               + [dict(family="pro", ratio=0, T=4096, variant="mm", error="CompilationError: out of shared memory")]},
              open(b, "w"))
    assert xpose_table.main([str(a), str(b)]) == 1
    assert "FAIL pro-cr0-T4096 mm: not timed: CompilationError" in capsys.readouterr().err
    # a later file's rows replace an earlier one's for the same config
    json.dump({"rows": _xpose_rows("pro-cr4-T4096", dict(default=10.0, da=10.0, lt=10.0, mm=10.0, st=10.0))}, open(b, "w"))
    assert xpose_table.summarize(xpose_table.load([a, b]))["default_over_st_step"] == 1.0

