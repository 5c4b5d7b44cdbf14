"""The GPU benchmarks' helpers, on CPU (the scripts run on the device machine, so what can run
here is tested here): variant specs with int, bool and string values, the forward probe
script end to end in interpret mode, and the Gluon check scripts' plumbing up to the kernel
launch (faked, or the impls stood in for by xla: Gluon cannot run here)."""
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


def test_apply_overrides_is_a_checked_replace():
    """common.apply_overrides (bench_csa's and the Gluon scripts' variants): the Config with
    the named fields replaced; a field the Config lacks (a removed variant switch) is refused
    by name, a bad value by the Config's own check."""
    from csa_jax.kernels.gluon.config import Config
    base = Config()
    got = common.apply_overrides(None, base, None, common.parse_overrides(
        "bwd=pallas_triton,bwd_block_k=16"))
    assert got == dataclasses.replace(base, bwd="pallas_triton", bwd_block_k=16)
    with pytest.raises(ValueError, match="has no field bwd_pair, schedule"):
        common.apply_overrides(None, base, None, {"schedule": "alternate", "bwd_pair": True})
    with pytest.raises(ValueError, match="bwd_stages=5"):
        common.apply_overrides(None, base, None, {"bwd_stages": 5})


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
    """benchmarks/gluon_check's grad-check helpers (gluon_bwd_check's too): per-gradient
    errors, dsink dropped without a sink, NaN or over-TOL fails; a failure row keeps the
    caller's fields first, then ok=False and the cut error."""
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


def _fake_launch(monkeypatch):
    """Gluon's kernel launches faked on a CPU (zero outputs; the window kernel's o and lse NaN
    for the tokens its `bad` flags, as the kernel writes them): the list of kernels launched."""
    import jax.numpy as jnp

    from csa_jax.kernels import gluon
    from csa_jax.kernels.gluon import adapter
    launched = []

    def fake_call(*arrays, kernel, out_shape, grid, num_warps, name="", **consts):
        launched.append(kernel.__name__)
        if not isinstance(out_shape, (list, tuple)):
            return jnp.zeros(out_shape.shape, out_shape.dtype)
        outs = [jnp.zeros(o.shape, o.dtype) for o in out_shape]
        if kernel.__name__ == "csa_window_kernel":       # (q, kv, sink, bad) -> (o, lse)
            rows = jnp.repeat(arrays[3] != 0, outs[1].shape[0] // arrays[3].shape[0])
            outs = [jnp.where(rows.reshape((-1,) + (1,) * (o.ndim - 1)), jnp.nan, o)
                    for o in outs]
        return outs

    monkeypatch.setattr(gluon, "_cannot_run", lambda *a: None)
    monkeypatch.setattr(adapter, "gluon_call", fake_call)
    return launched


def test_gluon_check_plumbing_with_faked_kernels(monkeypatch, capsys):
    """benchmarks/gluon_check.py on a CPU up to the (faked) launches: the random and grad parts
    run the gather forwards and dq kernels (the few-heads ones at H <= 32) and the reduce, the
    window part the cr0 window kernel
    through sparse_attention(layout="cr0"); the fake's wrong outputs are failed rows (not
    crashes), and the poison check sees the broken token flagged to the kernel under jit."""
    import json

    from benchmarks import gluon_check as gc
    launched = _fake_launch(monkeypatch)
    first = start = len(gc.RESULTS)
    assert gc.main(["--parts", "random,grad", "--cases", "h16_d64_bf16_sink_pad",
                    "--seed", "4"]) == 1
    rows = gc.RESULTS[start:]
    assert [(r["part"], r.get("kernel"), r.get("H"), r["ok"]) for r in rows] == [
        ("forward", "gather", None, False)] + [("grad", None, H, False)
                                               for H in (64, 32, 24, 16, 8, 16, 32, 16, 8,
                                                         16)], rows
    assert rows[0]["err_o"] == 1.0
    # every grad case (H = 64: the 64-head kernels; H <= 32: the few-heads forward and dq
    # kernel) ran to the comparison: the fake's zeros are errors of 1, not crashes
    assert all("error" not in r and r["errs"]["dq"] == 1.0 for r in rows[1:]), rows
    # (csa_dkv_blocks_kernel and its maps kernels: the few-heads dkv, traced under lax.cond
    # beside the per-slot path, whose reduce is csa_dkv_reduce_kernel)
    assert set(launched) == {"csa_fwd_small_heads_kernel", "csa_fwd_kernel", "csa_dq_kernel",
                             "csa_dq_small_heads_kernel", "csa_dkv_reduce_kernel",
                             "csa_dkv_blocks_kernel", "csa_dkv_maps_token_kernel",
                             "csa_dkv_maps_block_kernel"}
    launched.clear()
    start = len(gc.RESULTS)
    # (an override, even the default's value, skips the promise-check timing: a CPU test)
    assert gc.main(["--parts", "window", "--cases", "cr0_w128_h40_d64", "--config", "stages=2",
                    "--seed", "4"]) == 1
    rows = gc.RESULTS[start:]
    assert [(r["case"], r.get("kernel"), r["ok"]) for r in rows] == [
        ("window:cr0_w128_h40_d64_t100_sink", "window", False),
        ("poison:cr0_w128_h40_d64_t100_sink", None, True)], rows
    assert set(launched) == {"csa_window_kernel"}
    out = capsys.readouterr().out
    assert [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")][-1] == rows[-1]
    del gc.RESULTS[first:]
    for bad in ("layout=cr0", "schedule=alternate", "block_k=48"):
        with pytest.raises(SystemExit):
            gc.main(["--parts", "random", "--config", bad])


def test_gluon_kernel_time_kernel_only_paths(monkeypatch):
    """benchmarks/gluon_kernel_time's kernel-only function launches the kernel the forward
    would (the few-heads one at H <= 32 on its H heads unpadded, the 64-head one above on
    heads padded to 64) on the prepared operands (launches faked on a CPU)."""
    import jax
    import jax.numpy as jnp
    from benchmarks import gluon_kernel_time as gkt
    from csa_jax.kernels import gluon
    launched = _fake_launch(monkeypatch)
    small = "csa_fwd_small_heads_kernel"
    for H, kernel, hp in ((12, small, 12), (24, small, 24), (40, "csa_fwd_kernel", 64)):
        q = jnp.zeros((1, 8, H, 64), jnp.bfloat16)
        kv = jnp.zeros((1, 40, 64), jnp.bfloat16)
        idx = jnp.zeros((1, 8, 70), jnp.int32)
        sink = jnp.zeros((H,), jnp.float32)
        cfg = gluon.default_config(q.shape, kv.shape, idx.shape, q.dtype)
        fn, args = gkt._kernel_fn(q, kv, idx, sink, 0.1, cfg)
        o, lse = jax.block_until_ready(fn(*args))
        assert launched[-1] == kernel and o.shape == (8 * hp, 64) and lse.shape == (8 * hp,)


def test_gluon_bwd_check_selection_dry_run(monkeypatch):
    """benchmarks/gluon_bwd_check.py's --grad-cases / --skip / variants on a CPU, the gluon and
    pallas_triton impls stood in for by xla (gluon's Config and default_config, xla's numbers)
    and the timed problem made tiny: which rows each option leaves, every row reports and
    passes; a variant naming a field the Config lacks is a failed `variant` row."""
    import csa_jax
    from benchmarks import gluon_bwd_check as gb, gluon_check
    from csa_jax import problems, registry
    from csa_jax.kernels import gluon
    xla = registry.get("xla")

    class Stand:
        Config = gluon.Config
        default_config = staticmethod(gluon.default_config)

        @staticmethod
        def forward(q, kv, idx, s, *, scale, interpret, config):
            return xla.forward(q, kv, idx, s, scale=scale, interpret=False, config=xla.Config())

        @staticmethod
        def backward(*a, scale, interpret, config):
            assert isinstance(config, gluon.Config), config
            return xla.backward(*a, scale=scale, interpret=False, config=xla.Config())

    real_get, real_make = registry.get, problems.make_problem
    monkeypatch.setattr(registry, "get",
                        lambda n: Stand if n in ("gluon", "pallas_triton") else real_get(n))
    monkeypatch.setattr(problems, "make_problem", lambda c, T, **kw: real_make(c, 32, **kw))
    del csa_jax
    v = "bk16:bwd_block_k=16,bwd_stages=4"
    start = len(gluon_check.RESULTS)
    assert gb.main(["--parts", "grad,time", "--grad-variants", v, "--variants", v,
                    "--grad-cases", "h16_d64_bf16_sink_pad", "--shapes", "flash:0:64",
                    "--skip", "default,e2e,dq,step,pallas"]) == 0
    rows = gluon_check.RESULTS[start:]
    assert [(r["part"], r.get("case"), r.get("variant")) for r in rows if r["part"] == "grad"] == [
        ("grad", "h16_d64_bf16_sink_pad", "bk16")]
    timed = [r for r in rows if r["part"] == "time"]
    assert [r["impl"] for r in timed] == ["gluon:default", "gluon:bk16"]
    assert timed[0]["dq_ms"] is None and "err_vs_default" in timed[1] and timed[1]["ok"]
    assert not [r for r in rows if r["part"] == "step"]
    start = len(gluon_check.RESULTS)
    got = gb.make_variants("old:bwd_pair=true;s4:bwd_stages=4")((1, 8, 64, 512))
    assert [(n, c.bwd_stages) for n, c in got] == [("default", 2), ("s4", 4)]
    rows = gluon_check.RESULTS[start:]
    assert [(r["part"], r["variant"], r["ok"]) for r in rows] == [("variant", "old", False)]
    assert "no field bwd_pair" in rows[0]["error"]
    del gluon_check.RESULTS[start:]
    with pytest.raises(SystemExit):
        gb.main(["--parts", "grad", "--skip", "nothing"])


def test_bench_csa_anchor_refuses_clearly_and_tabulates(tmp_path, capsys):
    """--anchor DIR: a folder without the harness (or a machine without torch / an SM90 GPU)
    stops with one line naming what is missing; the anchor table divides each impl's forward
    by FlashMLA's on the same config and takes their geometric mean."""
    import pytest

    from benchmarks import bench_csa
    with pytest.raises(SystemExit, match="bench_csa: error: --anchor .*build.py is missing"):
        bench_csa.main(["--impls", "xla", "--anchor", str(tmp_path), "--interpret"])
    base = dict(family="pro", ratio=4, T=4096, idx="random", H=128)
    rows = [dict(base, impl="gluon", variant="default", fwd_ms=3.0),
            dict(base, impl="flashmla", variant="anchor", fwd_ms=2.0,
                 rel_err_vs_ref={"o": 1e-3, "lse": 2e-7}),
            dict(base, ratio=0, impl="gluon", variant="default", fwd_ms=1.0),
            dict(base, ratio=0, impl="flashmla", variant="anchor", fwd_ms=2.0)]
    bench_csa.print_anchor_table(rows)
    out = capsys.readouterr().out
    assert "| pro-cr4-T4096 | random | gluon | default | 3.00 | 2.00 | 1.50x | 1.0e-03 / 2.0e-07 |" in out
    assert "| pro-cr0-T4096 | random | gluon | default | 1.00 | 2.00 | 0.50x | - |" in out
    assert "gluon default: 0.87x over 2 configs" in out          # sqrt(1.5 * 0.5)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_gather_floor_sums_the_valid_rows_and_names_bad_variants():
    """benchmarks/gather_floor.py (issue 28's floor): its kernel's per-token sums equal jnp's
    with -1 slots anywhere (interpret mode), and a malformed variant is refused by name."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import gather_floor
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    kv = jax.random.normal(k1, (50, 64), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(k2, (6, 40), -1, 50)             # -1 slots anywhere, K % 32 != 0
    out = gather_floor.gather_sum(kv, idx, bk=32, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(gather_floor.reference(kv, idx)),
                               rtol=1e-5, atol=1e-5)
    assert out.shape == (6, 64)
    with pytest.raises(ValueError, match="bk64w4"):
        gather_floor.parse_variant("bk64w4")
    assert gather_floor.parse_variant("reg2ring32s6nr") == dict(ring=True, reg=2, bk=32,
                                                                stages=6, ahead=2, read=False)
    assert gather_floor.parse_variant("ring64s2a1")["ahead"] == 1
    with pytest.raises(ValueError, match="reg3ring64s3"):
        gather_floor.parse_variant("reg3ring64s3")


@pytest.mark.parametrize("variant", ["ring64s3", "ring64s2a1nr", "reg2ring32s6nr"])
def test_gather_floor_ring_variants_compile_for_sm90a(variant):
    """The Gluon ring floors (GPU-only) compile for sm_90a without spills and fit in shared
    memory; their sums are checked against jnp on the GPU by gather_floor itself."""
    pytest.importorskip("triton.experimental.gluon")
    from benchmarks import gather_floor
    from csa_jax.kernels.gluon import adapter
    kw = gather_floor.parse_variant(variant)
    c = adapter.compile_kernel(
        gather_floor._ring_kernels(), ["*bf16", "*i32", "*i32", "*fp32"],
        gather_floor.ring_constexprs(64, 512, 512, 1152, kw["bk"], kw["stages"], kw["read"],
                                     kw["reg"], kw["ahead"]), target="sm_90a", num_warps=4)
    r = adapter.resources(c, "sm_90a")
    assert r["spill_stores"] == 0 and r["launch_problem"] is None, r


def test_time_fn_pipelined_waits_once_per_round():
    """--timing pipelined: `reps` calls issued back to back, one wait per round (at most 3
    rounds), the issue callable used when given; an unknown timing is refused by name."""
    calls, waits = [], []
    fn = lambda x: calls.append("fn") or x
    issue = lambda x: calls.append("issue") or x
    sync = lambda out: waits.append(out) or out
    ms, n, _, out = common.time_fn(fn, (7,), 5, 1e9, "pipelined", sync=sync, issue=issue)
    assert out == 7 and n == 15 and ms >= 0
    assert calls == ["fn", "fn"] + ["issue"] * 15 and len(waits) == 2 + 3
    ms, n, _, _ = common.time_fn(fn, (7,), 4, 1e9, sync=sync)
    assert n == 4 and len(waits) == 5 + 2 + 4
    with pytest.raises(ValueError, match="'device'"):
        common.time_fn(fn, (7,), 1, 1.0, "device")


def test_bench_train_config_variants_retrace_and_skip(monkeypatch):
    """bench_train's `config.<field>` variants: each run is traced afresh, so the override
    reaches the impl's default_config (a jit cache hit from an earlier run would ignore it);
    an impl whose Config lacks the field skips the variant."""
    from benchmarks import bench_train
    from csa_jax import registry
    mod = registry.get("xla").mod
    seen = []
    orig = mod.default_config
    monkeypatch.setattr(mod, "default_config",
                        lambda *a, **k: seen.append(1) or orig(*a, **k))
    kw = dict(preset="tiny", impl="xla", seq_len=256, batch_size=1, steps=1, warmup=1,
              dtype="float32")
    bench_train.bench(**kw)
    first = len(seen)
    assert first > 0
    r = bench_train.bench(**kw, model={"config.chunk_tokens": 64}, variant="c64")
    assert len(seen) > first and r["config_overrides"] == {"chunk_tokens": 64}
    with pytest.raises(bench_train.SkipVariant, match="no field.*bwd_dkv"):
        bench_train.bench(**kw, model={"config.bwd_dkv": "blocks"}, variant="blk")
