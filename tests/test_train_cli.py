"""`python -m train`: --help and the error paths (a clear one-line message, exit code 2, no
traceback, nothing saved is lost)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train.checkpoint import Checkpointer
from train.cli import build_parser, config_from_args, main
from train.data import ByteDataset
from train.loop import init_state

@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("hello compressed sparse attention\n" * 400)
    return path


def run_main(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err


def _help_problems(parser):
    """What is wrong with a parser's help: options whose help text is missing or shorter than
    four words, and an --impl whose choices or help disagree with csa_jax.registry."""
    from csa_jax import registry
    bad = []
    for action in parser._actions:
        flag = max(action.option_strings, key=len, default=action.dest)
        if flag == "--help":
            continue
        if len((action.help or "").split()) < 4:
            bad.append(f"{flag}: help {action.help!r} explains nothing")
        if flag == "--impl":
            if tuple(action.choices or ()) != registry.choices():
                bad.append(f"--impl choices {action.choices} != registry {registry.choices()}")
            shown = " ".join(parser.format_help().split())
            runnable = f"Runnable here: auto, {', '.join(registry.available_impls())}."
            if runnable not in shown:
                bad.append(f"--impl help does not say {runnable!r}")
    return bad


def test_help_explains_every_flag():
    parser = build_parser()
    assert _help_problems(parser) == []
    proc = subprocess.run([sys.executable, "-m", "train", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    flags = [max(a.option_strings, key=len) for a in parser._actions if a.option_strings]
    assert [f for f in flags if f not in proc.stdout] == []
    assert "resumes" in proc.stdout and "pallas_mosaic_gpu" not in proc.stdout


def test_help_check_catches_an_unexplained_flag():
    """The check above can fail: a flag without help, or one-word help, is reported."""
    parser = build_parser()
    parser.add_argument("--bogus", type=int)
    parser.add_argument("--terse", help="steps")
    assert _help_problems(parser) == ["--bogus: help None explains nothing",
                                      "--terse: help 'steps' explains nothing"]


def test_unknown_preset(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--preset", "huge"])
    assert e.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_missing_data_path(capsys, tmp_path):
    missing = tmp_path / "no_such_corpus.txt"
    code, err = run_main(capsys, ["--data", str(missing), "--workdir", str(tmp_path / "w")])
    assert code == 2
    assert err.startswith("error:") and str(missing) in err


def test_sequence_length_the_schedule_cannot_use(capsys, tmp_path, text):
    code, err = run_main(capsys, ["--data", str(text), "--seq-len", "100",
                                  "--workdir", str(tmp_path / "w")])
    assert code == 2
    assert err.startswith("error: --seq-len=100 is not usable") and "multiple" in err
    code, err = run_main(capsys, ["--layers", "0,4,x", "--workdir", str(tmp_path / "w")])
    assert code == 2 and "'x' is not a compress ratio" in err


def test_fsdp_batch_must_divide_devices(capsys, tmp_path, text):
    code, err = run_main(capsys, ["--data", str(text), "--fsdp", "xla", "--batch-size", "6",
                                  "--workdir", str(tmp_path / "w")])
    assert code == 2
    assert "--batch-size=6 must divide by the 8 devices" in err


def save_checkpoint_like_the_cli(argv, workdir, step=5):
    """A valid checkpoint of the run `argv` describes, written without training (no compile)."""
    cfg = config_from_args(build_parser().parse_args(argv))
    data = ByteDataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    _, state, _, _ = init_state(cfg)
    ckpt = Checkpointer(workdir / "checkpoints", keep=3)
    ckpt.save(step, state, {"config": cfg.to_json(), "data_fingerprint": data.fingerprint,
                            "batches_consumed": step})
    ckpt.close()


def test_corrupt_checkpoint_is_reported_and_kept(capsys, tmp_path, text):
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), "--no-progress"]
    save_checkpoint_like_the_cli(argv, workdir)
    damaged = []
    for f in sorted((workdir / "checkpoints" / "5" / "state").rglob("*")):
        if f.is_file() and f.name != "commit_success.txt":
            f.write_bytes(b"not a checkpoint")
            damaged.append(f)
    assert damaged
    code, err = run_main(capsys, argv)
    assert code == 2
    assert "cannot be restored" in err and str(workdir / "checkpoints" / "5") in err
    assert all(f.read_bytes() == b"not a checkpoint" for f in damaged)  # nothing deleted


def test_other_settings_or_data_in_same_workdir_are_refused(capsys, tmp_path, text):
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), "--no-progress"]
    save_checkpoint_like_the_cli(argv, workdir)
    code, err = run_main(capsys, argv + ["--lr", "0.5"])
    assert code == 2 and "lr: saved 0.003, now 0.5" in err
    text.write_text("other text entirely\n" * 500)
    code, err = run_main(capsys, argv)
    assert code == 2 and "training data differs" in err
