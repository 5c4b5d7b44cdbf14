"""benchmarks/gluon_kernel_time.py on a CPU: the synced and pipelined times of a forward (the
kernel-only time needs the Gluon kernel, i.e. an NVIDIA GPU)."""
from __future__ import annotations

import json


def test_kernel_time_rows_on_cpu(tmp_path):
    from benchmarks import gluon_kernel_time
    out = tmp_path / "t.json"
    rows = gluon_kernel_time.main(["--impl", "xla", "--families", "flash", "--ratios", "0",
                                   "--seqs", "128", "--calls", "2", "--out", str(out)])
    assert len(rows) == 1 and json.loads(out.read_text()) == rows
    r = rows[0]
    assert (r["family"], r["ratio"], r["T"], r["impl"]) == ("flash", 0, 128, "xla")
    assert r["synced_ms"] > 0 and r["pipelined_ms"] > 0
    assert "kernel_pipelined_ms" not in r          # impl != gluon: no kernel-only time
