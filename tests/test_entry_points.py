"""Console entry points (pyproject [project.scripts]) beside `python -m train` / `python -m csa_jax`."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
HELP_MARKERS = {"csa-train": "--preset", "csa-bench": "--indices"}


def test_scripts_declared_and_importable(capsys):
    assert set(SCRIPTS) == set(HELP_MARKERS)
    for name, target in SCRIPTS.items():
        module, _, func = target.partition(":")
        main = getattr(importlib.import_module(module), func)
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0, name
        assert HELP_MARKERS[name] in capsys.readouterr().out, name


@pytest.mark.parametrize("name", sorted(HELP_MARKERS))
def test_installed_script_runs_help_and_ignores_cwd_shadows(name, tmp_path):
    """The installed script (pip install -e . puts it beside the interpreter) runs `--help`,
    even from a folder that holds the user's own train.py / csa_jax.py."""
    script = Path(sys.executable).parent / name
    if not script.exists():
        pytest.skip(f"{script} not installed: rerun `pip install -e .` (scripts/setup.sh does)")
    for decoy in ("train.py", "csa_jax.py", "comm.py"):
        (tmp_path / decoy).write_text("raise SystemExit('decoy module was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # this checkout first (as in the team's shared venv)
    r = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert HELP_MARKERS[name] in r.stdout and "decoy" not in r.stderr
