"""Training-throughput tools on CPU: no f32 matrix product in a bf16 step (benchmarks/hlo_dots.py),
the profiler trace of `python -m train --profile-steps` and its breakdown table
(benchmarks/trace_breakdown.py)."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from benchmarks import hlo_dots, trace_breakdown
from train.cli import main
from train.config import ConfigError, get_preset
from train.loop import init_state
from train.parallel import make_runner


def test_bf16_step_has_no_f32_products():
    """Every matrix product of a bf16 training step (forward, backward, compressor, indexer)
    takes bf16 operands; an f32 step keeps f32 ones (the lister sees both)."""
    rows = hlo_dots.list_dots(hlo_dots.lower_step("tiny", 256, "xla", "bfloat16", batch_size=2))
    assert len(rows) > 50
    f32 = [r for r in rows if "f32" in (hlo_dots._elem(r[1]), hlo_dots._elem(r[2]))]
    assert not f32, f32[:3]
    # the compressor's products are found and attributed to their source line
    assert any(f.startswith("csa_jax/compressor.py:") for r in rows for f in r[4])
    rows32 = hlo_dots.list_dots(hlo_dots.lower_step("tiny", 256, "xla", "float32", batch_size=2))
    assert rows32 and all(hlo_dots._elem(r[1]) == "f32" for r in rows32)


def test_compress_backward_products_are_bf16():
    x = jnp.ones((1, 16, 8), jnp.bfloat16)
    w = jnp.ones((8, 8), jnp.bfloat16)
    ape, ns = jnp.zeros((4, 8)), jnp.ones((4,))
    f = jax.grad(lambda x, w: csa_jax.compress(x, w, w, ape, ns, ratio=4).sum(), argnums=(0, 1))
    rows = hlo_dots.list_dots(jax.jit(f).lower(x, w).as_text(debug_info=True))
    assert len(rows) >= 3  # forward, d/dx, d/dw
    assert all(hlo_dots._elem(r[1]) == hlo_dots._elem(r[2]) == "bf16" for r in rows), rows


def test_classify_by_innermost_scope():
    c = trace_breakdown.classify
    assert c("jit(train_step)/jvp(csa_attention)/jit(attention)/gather", False) == \
        ("CSA attention forward", False)
    assert c("jit(train_step)/transpose(jvp(csa_attention))/jit(attention)/dot_general", True) == \
        ("CSA attention backward", True)
    assert c("jit(train_step)/jvp(indexer)/compressor/dot_general", True)[0] == "compressor"
    assert c("jit(train_step)/jvp(indexer)/indexer_topk/sort", False)[0] == "indexer top-k"
    assert c("jit(train_step)/transpose(jvp(q_proj))/dot_general", True) == ("dense matmuls", True)
    assert c("jit(train_step)/jvp(q_proj)/norm/mul", False)[0] == "norms and RoPE"
    assert c("jit(train_step)/jvp(q_proj)/mul", False)[0] == "other XLA ops"
    assert c("jit(train_step)/optimizer/mul", False)[0] == "optimizer"
    module, ops = trace_breakdown.parse_hlo(
        "HloModule jit_f, entry_computation_layout={}\n\n"
        "%fused_dot (p0: f32[2,2], p1: f32[2,2]) -> f32[2,2] {\n"
        "  ROOT %dot.1 = f32[2,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}\n}\n\n"
        "ENTRY %main (a: f32[2,2]) -> f32[2,2] {\n"
        '  ROOT %fusion.3 = f32[2,2]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_dot, '
        'metadata={op_name="jit(f)/jvp(mlp)/dot_general"}\n}\n')
    assert module == "jit_f" and ops["fusion.3"] == ("jit(f)/jvp(mlp)/dot_general", "fusion", True)


def test_profile_steps_trace_and_breakdown(tmp_path, capsys):
    """`--profile-steps 2:3` writes a trace of two steps and the step's HLO; the breakdown finds
    every family the model has, split into forward and backward."""
    text = tmp_path / "text.txt"
    text.write_text("compressed sparse attention reads bytes\n" * 300)
    work = tmp_path / "w"
    argv = ["--data", str(text), "--layers", "0,4,16", "--seq-len", "64", "--batch-size", "2",
            "--steps", "3", "--log-every", "5", "--eval-every", "5", "--eval-batches", "1",
            "--no-progress", "--workdir", str(work)]
    assert main(argv + ["--profile-steps", "3:2"]) == 2
    assert "--profile-steps '3:2' must satisfy 1 <= A <= B" in capsys.readouterr().err
    assert main(argv + ["--profile-steps", "2:9"]) == 2
    assert "ends after the run's last step 3" in capsys.readouterr().err
    assert main(argv + ["--profile-steps", "2:3"]) == 0
    assert "profile of steps 2..3" in capsys.readouterr().err
    prof = work / "profile"
    assert (prof / "train_step.hlo.txt").exists() and list(prof.glob("**/*.xplane.pb"))
    out = tmp_path / "b.json"
    trace_breakdown.main([str(prof), "--json", str(out), "--top", "5"])
    table = capsys.readouterr().out
    assert "| CSA attention backward |" in table and "| host gaps |" in table
    res = json.loads(out.read_text())
    assert res["steps"] == 2
    fam = res["families"]
    for name in ("CSA attention forward", "CSA attention backward", "indexer scores",
                 "indexer top-k", "compressor", "index lists", "dense matmuls", "norms and RoPE",
                 "optimizer"):
        assert fam[name]["ms"] > 0, name
    assert fam["CSA attention backward"]["bwd_ms"] == fam["CSA attention backward"]["ms"]
    assert fam["compressor"]["bwd_ms"] > 0 and fam["indexer top-k"]["bwd_ms"] == 0
    assert 0 < res["busy_ms_per_step"] <= res["span_ms_per_step"]


def test_remat_policies_give_the_same_step():
    """remat block / dots recompute parts of the forward in the backward: same loss and grads."""
    tok = np.random.default_rng(0).integers(0, 256, (2, 32), dtype=np.int32)
    out = {}
    for remat in ("none", "block", "dots"):
        cfg = get_preset("tiny", model=dict(remat=remat, layer_ratios=(0, 4, 8), window=8, topk=4),
                         seq_len=32, batch_size=2, steps=2)
        graphdef, state, tx, schedule = init_state(cfg)
        runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
        batch = (tok, np.roll(tok, -1, 1))
        jaxpr = str(jax.make_jaxpr(runner.train_step)(state, batch))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (remat != "none"), remat
        new, m = jax.jit(runner.train_step)(state, batch)
        out[remat] = (float(m["loss"]), float(m["grad_norm"]), new["params"])
    for remat in ("block", "dots"):
        assert abs(out[remat][0] - out["none"][0]) < 1e-6
        assert abs(out[remat][1] - out["none"][1]) < 1e-5 * out["none"][1]
        for a, b in zip(jax.tree.leaves(out[remat][2]), jax.tree.leaves(out["none"][2])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="remat='all' must be one of"):
        get_preset("tiny", model=dict(remat="all"))


def test_find_cycle():
    from train.layer_scan import find_cycle

    assert find_cycle((0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128)) == (2, 2, 5)
    assert find_cycle((0, 0, 4, 16)) == (0, 1, 2)
    assert find_cycle((0, 4, 8)) is None
    assert find_cycle((4, 4, 4, 4)) == (0, 1, 4)
    assert find_cycle((128, 128, 4, 128, 4, 128, 4)) == (1, 2, 3)


def test_scan_layers_gives_the_same_step():
    """scan_layers runs the repeating cycle (cr4 cr8) x 2 as one lax.scan (one traced body): the
    same loss, gradient norm and updated parameters as the layer loop, and with remat too."""
    tok = np.random.default_rng(1).integers(0, 256, (2, 32), dtype=np.int32)
    out, n_scans = {}, {}
    for scan, remat in ((False, "none"), (True, "none"), (True, "dots")):
        cfg = get_preset("tiny", model=dict(scan_layers=scan, remat=remat, window=8, topk=4,
                                            layer_ratios=(0, 4, 8, 4, 8)),
                         seq_len=32, batch_size=2, steps=2)
        graphdef, state, tx, schedule = init_state(cfg)
        runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
        batch = (tok, np.roll(tok, -1, 1))
        n_scans[scan] = str(jax.make_jaxpr(runner.train_step)(state, batch)).count(" scan[")
        new, m = jax.jit(runner.train_step)(state, batch)
        out[scan, remat] = (float(m["loss"]), float(m["grad_norm"]), new["params"])
    assert n_scans[True] > n_scans[False]  # (the xla attention's chunk loops are scans too)
    ref = out[False, "none"]
    for key in ((True, "none"), (True, "dots")):
        loss, gnorm, params = out[key]
        assert abs(loss - ref[0]) < 1e-6 and abs(gnorm - ref[1]) < 1e-5 * ref[1], key
        assert jax.tree.structure(params) == jax.tree.structure(ref[2])  # per-layer layout kept
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref[2])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="scan_layers=True does not combine"):
        get_preset("tiny", model=dict(scan_layers=True), fsdp="explicit")


_CMDBUF_HLO = """HloModule jit_train_step, is_scheduled=true, entry_computation_layout={}

%fused_add (p0: f32[8]) -> f32[8] {
  ROOT %add.1 = f32[8]{0} add(%p0, %p0)
}

ENTRY %main.9 (a: f32[8]) -> f32[8] {
  %loop_add_fusion.3 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jvp(compressor)/add"}
  %custom-call.7 = (f32[8]{0}, s8[4]{0}) custom-call(%loop_add_fusion.3, %a), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(compressor)/dot_general"}
  %custom-call.8 = (f32[8]{0}, s8[4]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(mlp)/dot_general"}
  %custom-call.9 = (f32[8]{0}, s8[4]{0}) custom-call(%a), custom_call_target="__cub$DeviceRadixSort", metadata={op_name="jit(train_step)/jvp(indexer)/indexer_topk/sort"}
  %triton_kernel_call.5 = f32[8]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(csa_attention)/triton_kernel_call"}
  ROOT %custom-call.10 = (f32[8]{0}, s8[4]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/transpose(jvp(mlp))/dot_general"}
}
"""


def test_command_buffer_kernels_are_located():
    """Inside a CUDA-graph command buffer the trace names only `command_buffer_N` and the kernel:
    fusions are found by name, GEMM / cub / Triton kernels in schedule order (two steps)."""
    module, hlo = trace_breakdown.parse_hlo(_CMDBUF_HLO)
    step = ["loop_add_fusion_3", "nvjet_sm90_tst_64x128", "cublasLt::splitKreduce_kernel",
            "nvjet_sm90_tst_128x64",
            "DeviceRadixSortHistogramKernel", "DeviceRadixSortOnesweepKernel", "csa_triton_fwd",
            "nvjet_sm90_tst_64x128"]
    events = [(i * 10, 10, 10, k, "command_buffer_12", module)
              for i, k in enumerate(step + step)]
    events.append((1000, 5, 5, "mystery_kernel", "command_buffer_12", module))
    res = trace_breakdown.breakdown(events, hlo, module, 2,
                                    locator=trace_breakdown.KernelLocator(_CMDBUF_HLO))
    fam = res["families"]
    ms = 10 / 1e6
    assert fam["compressor"]["ms"] == pytest.approx(3 * ms)   # the fusion, its GEMM, split-K
    assert fam["dense matmuls"]["ms"] == pytest.approx(2 * ms)       # the mlp GEMMs
    assert fam["dense matmuls"]["bwd_ms"] == pytest.approx(ms)       # the transposed one
    assert fam["indexer top-k"]["ms"] == pytest.approx(2 * ms)       # both cub kernels
    assert fam["CSA attention forward"]["ms"] == pytest.approx(ms)
    assert fam["other XLA ops"]["ms"] == pytest.approx(5 / 1e6 / 2)
    assert res["command_buffer_kernels"] == {"located": 16, "not_located": 1}
    # without the locator everything in the command buffer is "other XLA ops" (as before)
    plain = trace_breakdown.breakdown(events, hlo, module, 2)["families"]
    assert plain["other XLA ops"]["ms"] == pytest.approx((14 * 10 + 5) / 1e6 / 2)
    assert plain["dense matmuls"]["ms"] == pytest.approx(ms)   # only the name says 'cublas'

