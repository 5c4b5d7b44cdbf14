"""python -m csa_jax: the table, the check, the JSON, and its error paths."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from csa_jax.__main__ import main
from conftest import REPO


def test_cli_runs_checks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(["--family", "flash", "--ratio", "128", "--seq-len", "256", "--reps", "1",
               "--check-seq", "128", "--dtype", "f32", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "check flash-cr128 xla" in text and ": ok" in text
    rows = json.loads(out.read_text())["rows"]
    (row,) = rows
    assert row["shape"] == "flash-cr128-T256" and row["K"] == 128 + 2 and row["check"] == "ok"
    assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and 0 < row["valid_frac"] <= 1
    assert text.rstrip().splitlines()[-1].lstrip().startswith("flash-cr128-T256")


def test_cli_help_and_errors():
    run = lambda *a: subprocess.run([sys.executable, "-m", "csa_jax", *a], cwd=REPO,
                                    capture_output=True, text=True, timeout=120)
    h = run("--help")
    assert h.returncode == 0 and "--indices" in h.stdout and "published AMD" in h.stdout
    for argv, msg in ((["--impl", "cuda"], "impl='cuda' is unknown"),
                      (["--impl", "pallas_mosaic_gpu"], "use impl='pallas_triton'"),
                      (["--seq-len", "-5"], "--seq-len must be positive, got -5"),
                      (["--ratio", "8"], "invalid choice: 8")):
        r = run(*argv)
        assert r.returncode == 2 and msg in r.stderr, (argv, r.stderr)
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--reps", "0"], ["--check-seq", "-1"]])
def test_cli_rejects_nonpositive(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
