"""benchmarks/gluon_kernel_time.py on a CPU: the synced and pipelined times of a forward (the
kernel-only time needs the Gluon kernel, i.e. an NVIDIA GPU)."""
from __future__ import annotations

import json


def test_kernel_time_rows_on_cpu(tmp_path):
    from benchmarks import gluon_kernel_time
    out = tmp_path / "t.json"
    rows = gluon_kernel_time.main(["--impl", "xla", "--families", "flash", "--ratios", "0",
                                   "--seqs", "128", "--calls", "2", "--check", "--out", str(out)])
    assert len(rows) == 1 and json.loads(out.read_text()) == rows
    r = rows[0]
    assert (r["family"], r["ratio"], r["T"], r["impl"]) == ("flash", 0, 128, "xla")
    assert r["synced_ms"] > 0 and r["pipelined_ms"] > 0
    assert r["err_o"] == 0 and r["err_lse"] == 0           # --check: xla against itself
    assert "kernel_pipelined_ms" not in r          # impl != gluon: no kernel-only time


def test_kernel_time_gluon_rows_launch_faked(monkeypatch):
    """The gluon rows' code on a CPU up to the kernel launch (faked: zero outputs), with the
    kernel-only time: a cr0 problem through the gather kernel, then with --window-layouts
    (the cr0 promise) through the window kernel; both the jitted forward and the kernel-only
    function launch the same kernel."""
    import jax.numpy as jnp
    from benchmarks import gluon_kernel_time
    from csa_jax.kernels import gluon
    from csa_jax.kernels.gluon import adapter
    launched = []

    def fake_call(*arrays, kernel, out_shape, grid, num_warps, name="", **consts):
        launched.append(kernel.__name__)
        return [jnp.zeros(s.shape, s.dtype) for s in out_shape]
    monkeypatch.setattr(gluon, "_cannot_run", lambda *a: None)
    monkeypatch.setattr(adapter, "gluon_call", fake_call)
    argv = ["--families", "flash", "--ratios", "0", "--seqs", "256", "--calls", "2"]
    rows = gluon_kernel_time.main(argv)
    assert set(launched) == {"csa_fwd_kernel"}, launched
    launched.clear()
    rows += gluon_kernel_time.main(argv + ["--window-layouts"])
    assert set(launched) == {"csa_window_kernel"}, launched
    assert ["layout='cr0'" in r["config"] for r in rows] == [False, True]
    assert all(r["kernel_pipelined_ms"] > 0 and r["o_finite"] for r in rows), rows


def test_breakdown_rows_on_cpu(capsys):
    """--breakdown: a profiled step's kernels (on a CPU the XLA thunks) with their own time per
    step, largest first, beside the step's pipelined time; --indices reaches the problem."""
    from benchmarks import gluon_kernel_time
    rows = gluon_kernel_time.main(["--impl", "xla", "--families", "pro", "--ratios", "4",
                                   "--seqs", "256", "--heads", "8", "--indices", "unique",
                                   "--calls", "1", "--breakdown", "--top", "3"])
    (r,) = rows
    assert (r["H"], r["T"], r["impl"]) == (8, 256, "xla") and r["step_pipelined_ms"] > 0
    ms = [k[1] for k in r["kernels"]]
    assert ms and ms == sorted(ms, reverse=True) and abs(sum(ms) - r["kernels_sum_ms"]) < 1e-6
    table = capsys.readouterr().out.split("| kernel | ms / step")[1]
    assert table.count("\n|") == 1 + 3                 # the separator, then --top rows
