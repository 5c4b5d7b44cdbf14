"""The training CLI never loses or silently corrupts a run (issue 16): one test per fault.

Corrupt and truncated checkpoints, unusable workdirs and --json paths, empty lists, --data
directories with hidden and binary files, relative --data paths on resume, a diverged loss, two
Ctrl-C, --help's defaults, the README's quick start. Most run without compiling a step (a fake
runner, or a checkpoint already at --steps); one trains a few real steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from csa_jax import registry
from _train_fault_worker import fake_runners
from conftest import REPO
from test_train_cli import run_main, save_checkpoint_like_the_cli
from train.checkpoint import CheckpointError, Checkpointer
from train.cli import build_parser, config_from_args, main
from train.loop import init_state
from train.config import PRESETS, get_preset
from train.data import ByteDataset

SMALL = ["--seq-len", "32", "--batch-size", "2", "--layers", "0,4", "--eval-batches", "1",
         "--no-progress"]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("hello compressed sparse attention\n" * 400)
    return path


def data_file(step_dir: Path) -> Path:
    """The largest array data file of a checkpoint (orbax's OCDBT store)."""
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def strict_json_lines(path: Path) -> list[dict]:
    def no_constants(name):
        raise ValueError(f"{path}: {name} is not JSON")
    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]


def run_cli(*argv, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


# --------------------------------------------------------------------------- checkpoints


def flip_4kb_where_only_the_checksum_can_tell(argv, ckpts: Path, step: int):
    """Invert 4 KB inside checkpoint `step`'s largest data file (same size), at an offset that
    the storage format itself does not notice (about half of them land in a zstd literal
    stream that still decodes: the array comes back with other values). Any offset that
    restores without complaint fails the test."""
    cfg = config_from_args(build_parser().parse_args(argv))
    _, state, _, _ = init_state(cfg)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)
    f = data_file(ckpts / str(step))
    pristine = f.read_bytes()
    ckpt = Checkpointer(ckpts, keep=10)
    try:
        for frac in (0.5, 0.02, 0.2, 0.45, 0.63, 0.72, 0.81, 0.98, 0.3, 0.9):
            raw = bytearray(pristine)
            o = int(len(raw) * frac)
            raw[o:o + 4096] = bytes(b ^ 0xFF for b in raw[o:o + 4096])
            f.write_bytes(bytes(raw))
            assert f.stat().st_size == len(pristine)
            with pytest.raises(CheckpointError) as e:  # never restored without complaint
                ckpt.restore(step, abstract)
            if "checksum mismatch" in str(e.value):
                return
    finally:
        ckpt.close()
    pytest.fail("zstd noticed every 4 KB flip: no case left for the checksum")


def test_flipped_and_truncated_checkpoints_are_refused_and_the_run_falls_back(capsys, tmp_path,
                                                                             text):
    """Row 1 (4 KB flipped, same size) and row 2 (truncated), then a real diverging run: it
    resumes from the newest checkpoint that verifies, saves over the refused steps without
    deleting them, and the divergence names the real last checkpoint."""
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), "--lr", "1e6", "--warmup-steps",
            "0", "--log-every", "1", "--ckpt-every", "1", "--steps", "9", *SMALL]
    for step in (2, 3, 4):
        save_checkpoint_like_the_cli(argv, workdir, step=step)
    ckpts = workdir / "checkpoints"
    flip_4kb_where_only_the_checksum_can_tell(argv, ckpts, 4)
    truncated = data_file(ckpts / "3")
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 3])
    damaged = {s: tree_digest(ckpts / str(s)) for s in (3, 4)}

    code, err = run_main(capsys, argv)
    lines = err.splitlines()
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 2, err
    assert str(ckpts / "4") in refused[0] and "checksum mismatch" in refused[0], err
    assert str(ckpts / "3") in refused[1] and "cannot be restored" in refused[1], err
    assert "pybind" not in err and "TensorStore(" not in err
    assert "resuming from step 2, the newest checkpoint that verifies" in err
    # nothing deleted: the refused checkpoints were moved aside, byte for byte
    for s in (3, 4):
        assert tree_digest(workdir / "corrupt_checkpoints" / str(s)) == damaged[s]
    # the run trained on from step 2 and diverged; the error names its own last checkpoint
    assert code == 2
    (last_line,) = [line for line in lines if line.startswith("error:")]
    nan_step = int(re.search(r"became (?:nan|inf|-inf) at step (\d+)", last_line).group(1))
    assert nan_step >= 4, last_line
    assert f"the last checkpoint is step {nan_step - 1} ('{ckpts / str(nan_step - 1)}')" in last_line
    assert (workdir / "loss.png").stat().st_size > 0
    rows = strict_json_lines(workdir / "metrics.jsonl")
    assert [r["loss"] for r in rows if r["step"] == nan_step] == [None]


def test_no_checkpoint_verifies_one_clean_line_and_nothing_deleted(tmp_path, text):
    """Row 2 without a fallback: exit 2, one `error:` line, no asyncio or pybind noise."""
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), *SMALL]
    save_checkpoint_like_the_cli(argv, workdir, step=5)
    f = data_file(workdir / "checkpoints" / "5")
    f.write_bytes(f.read_bytes()[:100])
    before = tree_digest(workdir)
    proc = run_cli("-m", "train", *argv, "--steps", "6")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "no checkpoint in" in errors[0] and str(workdir / "checkpoints" / "5") in errors[0]
    for noise in ("Traceback", "Event loop is closed", "pybind", "TensorStore("):
        assert noise not in proc.stderr, proc.stderr
    assert tree_digest(workdir) == before


# --------------------------------------------------------------------------- user mistakes


@pytest.mark.parametrize("where", ["uncreatable", "read-only", "under-a-file"])
def test_unusable_workdir_is_refused_before_any_work(capsys, tmp_path, text, where):
    if where != "under-a-file" and not Path("/sys/kernel").is_dir():
        pytest.skip("needs Linux /sys")
    (tmp_path / "afile").write_text("x")
    workdir = {"uncreatable": "/sys/csa_jax_no_such_dir/run", "read-only": "/sys/kernel",
               "under-a-file": str(tmp_path / "afile" / "run")}[where]
    code, err = run_main(capsys, ["--data", str(text), "--workdir", workdir, *SMALL])
    assert code == 2
    assert err.startswith(f"error: --workdir {workdir!r}") and len(err.splitlines()) == 1, err


def test_benchmark_json_path_is_checked_before_the_benchmark(capsys, tmp_path):
    from csa_jax.__main__ import main as bench_main

    for path in ("/sys/csa_jax_results.json", str(tmp_path / "no_dir" / "r.json"), str(tmp_path)):
        with pytest.raises(SystemExit) as e:
            bench_main(["--seq-len", "128", "--check-seq", "0", "--reps", "1", "--json", path])
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert f"error: --json {path!r}" in err and "csa_jax 0" not in out  # nothing ran
    assert not (tmp_path / "no_dir").exists()


def test_empty_and_malformed_lists_are_refused(capsys, tmp_path, text):
    missing = str(tmp_path / "missing.txt")  # the old code reached the data (and stopped) first
    for argv, msg in ((["--layers", ""], "--layers '': empty"),
                      (["--layers", " , "], "is not a compress ratio"),
                      (["--layers", "flash:"], "layer count '' is not an int"),
                      (["--data", ""], "--data '': empty path"),
                      (["--data", str(text), "", "--layers", "0"], "--data '': empty path"),
                      (["--workdir", ""], "--workdir '': empty path")):
        code, err = run_main(capsys, ["--data", missing, "--workdir", str(tmp_path / "w"),
                                      *SMALL, *argv])
        assert code == 2 and err.startswith("error:") and msg in err, (argv, err)
    from csa_jax.__main__ import main as bench_main

    for impl in ("", "xla,", ",xla"):
        with pytest.raises(SystemExit) as e:
            bench_main(["--impl", impl])
        assert e.value.code == 2 and "empty name in the list" in capsys.readouterr().err


def test_diverged_run_without_checkpoint_says_so_and_keeps_valid_outputs(capsys, tmp_path,
                                                                        text, monkeypatch):
    """Row 7: `--lr 1e6` with nothing saved yet (a fake step whose loss turns NaN at step 3)."""
    fake_runners(monkeypatch.setattr, loss=lambda step: 5.0 if step < 3 else float("nan"))
    workdir = tmp_path / "w"
    code, err = run_main(capsys, ["--data", str(text), "--workdir", str(workdir), "--lr", "1e6",
                                  "--log-every", "1", "--steps", "10", *SMALL])
    assert code == 2
    assert err.splitlines()[-1] == ("error: the loss became nan at step 3; no checkpoint was "
                                    "saved, so a rerun starts over (try a lower --lr)")
    assert (workdir / "loss.png").stat().st_size > 0
    rows = strict_json_lines(workdir / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 5.0), (2, 5.0), (3, None)]
    assert not any((workdir / "checkpoints").iterdir())


# --------------------------------------------------------------------------- data


def test_data_dir_skips_hidden_and_binary_files_and_says_so(capsys, tmp_path):
    d = tmp_path / "repo"
    for rel, content in {"a.txt": b"plain text\n" * 300, "docs/b.md": b"# notes\n" * 300,
                         ".git/objects/ab/cdef": b"text inside .git\n",
                         ".venv/lib/mod.so": b"\x7fELF\x00\x01", ".env": b"SECRET=1\n",
                         "img.png": b"\x89PNG\r\n\x1a\n\x00\x00", "latin1.txt": "caf\xe9".encode("latin-1"),
                         "__pycache__/m.cpython-312.pyc": b"\xcb\r\r\n\x00\x00"}.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(content)
    ds = ByteDataset([str(d)], seq_len=32, batch_size=2)
    assert ds.n_files == 2
    assert sorted(p.name for p in ds.hidden) == [".env", ".git", ".venv"]
    assert sorted(p.name for p in ds.binary) == ["img.png", "m.cpython-312.pyc"]
    assert [p.name for p in ds.not_utf8] == ["latin1.txt"]
    assert ds.summary().startswith("took 2 files, 0.0 MB; skipped 3 hidden (.env, .git, .venv) "
                                   "and 2 binary (NUL bytes: ")
    assert ds.summary().endswith(" and 1 not UTF-8 (latin1.txt; --data-encoding any takes them)")
    # the CLI prints it (here on a run that has nothing left to do: no compile)
    workdir = tmp_path / "w"
    argv = ["--data", str(d), "--workdir", str(workdir), *SMALL]
    save_checkpoint_like_the_cli(argv, workdir, step=5)
    code, err = run_main(capsys, argv + ["--steps", "5"])
    assert code == 0 and f"data: {ds.summary()}" in err.splitlines(), err


def test_resume_with_the_same_data_given_as_a_relative_path(capsys, tmp_path, text,
                                                            monkeypatch):
    workdir = tmp_path / "w"
    save_checkpoint_like_the_cli(["--data", str(text), "--workdir", str(workdir), *SMALL],
                                 workdir, step=5)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    code, err = run_main(capsys, ["--data", "../text.txt", "--workdir", "../w", "--steps", "5",
                                  *SMALL])
    assert code == 0, err
    assert "nothing to do" in err


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("during", ["step", "save"])
def test_second_ctrl_c_exits_at_once_saying_what_is_saved(capsys, tmp_path, text, during):
    """Row 8: two Ctrl-C 50 ms apart (a subprocess: the second one ends it with os._exit)."""
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), "--ckpt-every", "1", "--steps",
            "50", *SMALL]
    proc = run_cli(str(REPO / "tests" / "_train_fault_worker.py"), during, *argv)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    done = f"the last complete checkpoint is step 2 in {workdir / 'checkpoints'}"
    if during == "step":
        assert last == f"SIGINT again: stopped at once; nothing more was saved; {done}; rerun " \
                       f"the same command to resume from it", proc.stderr
    else:
        assert last.startswith("SIGINT again: stopped at once; the save of step 3 was cut "
                               "short and will not be used") and done in last, proc.stderr
    # not 3: the step / save that the second signal hit would have gone on for 20 s more
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) \
        == ["1", "2"]
    code, err = run_main(capsys, argv[:-len(SMALL) - 2] + ["--steps", "2", *SMALL])
    assert code == 0 and "nothing to do" in err and "refused" not in err, err


# --------------------------------------------------------------------------- help, docs, tests


def test_help_prints_each_presets_defaults_and_only_available_impls():
    parser = build_parser()
    text = parser.format_help()
    for flag, field in (("--steps", "steps"), ("--lr", "lr"), ("--batch-size", "batch_size"),
                        ("--seq-len", "seq_len"), ("--warmup-steps", "warmup_steps"),
                        ("--log-every", "log_every"), ("--eval-every", "eval_every"),
                        ("--ckpt-every", "ckpt_every")):
        values = {n: getattr(get_preset(n), field) for n in PRESETS}
        shown = (f"{values['tiny']} (every preset)" if len(set(values.values())) == 1 else
                 ", ".join(f"{n} {v}" for n, v in values.items()))
        assert parser._option_string_actions[flag].help.endswith(f"Default: {shown}"), flag
    assert "(preset default)" not in text
    impls = parser._option_string_actions["--impl"].choices
    assert list(impls) == list(registry.choices())  # the registry's names, no hard-coded list
    assert "pallas_mosaic_gpu" not in text  # reserved, never implemented
    runnable = " ".join(text.split())
    assert f"Runnable here: auto, {', '.join(registry.available_impls())}." in runnable


def test_readme_quick_start_matches_the_default_run():
    default = build_parser().get_default("preset")
    cfg = get_preset(default)
    readme = (REPO / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if "then train the default" in line]
    assert f"`{default}`" in line and f"{cfg.steps} steps" in line, line
    assert "default small" not in readme


def test_the_test_run_cannot_end_in_a_keyboardinterrupt_traceback():
    """hypothesis is imported up front (conftest explains why), so its pytest plugin's import
    at session end cannot outlast the 5 s execnet gives an xdist worker before SIGINTing it."""
    assert "hypothesis" in sys.modules
