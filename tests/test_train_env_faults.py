"""The trainer under faults a user meets (issue 31): a full disk, two runs on one workdir, an
impl that cannot run here, libtpu's start-up lines on a CPU machine, a Latin-1 --data file,
--no-progress, an absurd size, Ctrl-C while the first step compiles, flag names in messages, a
stray traceback at the end of an xdist run. Most run without compiling a step (a fake runner).

The disk tests mount a small tmpfs (root); where mount is refused, the mid-save one limits the
file size instead (RLIMIT_FSIZE: the same failure path, "File too large") and the two that need
a disk with a known amount of free space are skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import csa_jax
from _train_fault_worker import fake_runners
from conftest import REPO, random_problem
from csa_jax import registry
from csa_jax.platforms import accelerator_present
from test_train_cli import run_main, save_checkpoint_like_the_cli
from train.cli import build_parser
from train.data import ByteDataset

SMALL = ["--seq-len", "32", "--batch-size", "2", "--layers", "0,4", "--eval-batches", "1",
         "--no-progress"]
WORKER = str(REPO / "tests" / "_train_fault_worker.py")


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("hello compressed sparse attention\n" * 400)
    return path


def env(**extra):
    out = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    out.update(extra)
    return out


def worker(mode, *argv, timeout=120, **kw):
    return subprocess.run([sys.executable, WORKER, mode, *argv], capture_output=True,
                          text=True, timeout=timeout, env=env(), cwd=REPO, **kw)


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path`, or None where mounting is refused (not root)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def grow(path: Path, size: str):
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# --------------------------------------------------------------------------- 1: full disk


def test_disk_too_full_for_the_next_checkpoint_one_line_before_writing(tmp_path, text,
                                                                      capsys, monkeypatch):
    """An 11 MB disk: the first checkpoint fits (about 2.5 MB written, 8.4 MB uncompressed),
    a later save finds less room than a checkpoint may need and is refused before it writes
    (one line: the workdir, the cause, the bytes); the complete ones stay and resume."""
    with small_disk(tmp_path / "disk", "11m") as disk:
        if disk is None:
            pytest.skip("mount -t tmpfs refused (not root)")
        workdir = disk / "w"
        argv = ["--data", str(text), "--workdir", str(workdir), "--steps", "8",
                "--ckpt-every", "2", *SMALL]
        proc = worker("fake", *argv)
        assert proc.returncode == 2, proc.stderr
        err = lines(proc.stderr)
        assert [line for line in err if not line.startswith(("data:", "model:", "step "))] \
            == [err[-1]], proc.stderr
        m = re.fullmatch(
            rf"error: cannot save checkpoint (\d+) in '{workdir}/checkpoints': no space left on "
            rf"the device \(the checkpoint needs about [\d.]+ MB, ([\d.]+) MB are free\); the "
            rf"newest complete checkpoint, step (\d+) \('{workdir}/checkpoints/\3'\), is "
            rf"untouched: make room and rerun the same command to resume from it", err[-1])
        assert m, err[-1]
        refused, free, last = int(m.group(1)), float(m.group(2)), int(m.group(3))
        assert last == refused - 2 >= 2 and free < 8.4
        ckpts = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())
        assert ckpts == list(range(2, last + 1, 2))  # no partial directory
        grow(disk, "40m")
        fake_runners(monkeypatch.setattr)
        code, err = run_main(capsys, argv)
        assert code == 0 and f"resuming from step {last}" in err and "done: step 8" in err, err


def test_orbax_noise_filter_holds_tensorstore_write_errors(tmp_path):
    """asyncio's "Future exception was never retrieved" for a TensorStore write into the
    checkpoint directory carries no orbax frame; the filter still holds it (and drops it once
    a failed save was reported), so a full disk stays one `error:` line whenever those futures
    are collected. Other asyncio records pass."""
    import logging

    from train.checkpoint import _OrbaxNoise
    ckpt = tmp_path / "checkpoints"
    noise = _OrbaxNoise(ckpt)
    err = ValueError(f'RESOURCE_EXHAUSTED: Error writing "params/0.0" in OCDBT database at '
                     f'local file "{ckpt}/4.orbax-checkpoint-tmp/d/x": No space left on device')

    def record(msg, exc=None):
        return logging.LogRecord("asyncio", logging.ERROR, "/usr/lib/asyncio/base_events.py", 1,
                                 msg, None, (type(exc), exc, None) if exc else None)

    ours = record(f"Future exception was never retrieved\nfuture: <Future finished "
                  f"exception={err!r}>", err)
    assert noise.filter(ours) is False and noise.held == [ours]
    assert noise.filter(record("Future exception was never retrieved", err)) is False
    other = record("Task was destroyed but it is pending!")
    assert noise.filter(other) is True
    noise.held.clear()
    noise.drop = True
    assert noise.filter(ours) is False and noise.held == []
    assert _OrbaxNoise().filter(ours) is True            # no directory known: not ours


def test_disk_full_during_a_save_one_line_and_no_partial_checkpoint(tmp_path, text, capsys,
                                                                    monkeypatch):
    """The free-space check passes (it sees unlimited room) but the write fails half-way:
    one line with the OS error, nothing on stderr from orbax's threads, the partial
    `<step>.orbax-checkpoint-tmp` removed, the previous checkpoint resumes."""
    with small_disk(tmp_path / "disk", "5m") as disk:
        limit = None
        if disk is None:  # fallback: a 1 MB file size limit fails the first save's write
            disk, limit = tmp_path, 2**20
        workdir = disk / "w"
        argv = ["--data", str(text), "--workdir", str(workdir), "--steps", "6",
                "--ckpt-every", "2", *SMALL]
        pre = None
        if limit is not None:
            def pre():
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        proc = worker("unchecked-space", *argv, preexec_fn=pre)
        assert proc.returncode == 2, proc.stderr
        err = lines(proc.stderr)
        assert [line for line in err if not line.startswith(("data:", "model:", "step "))] \
            == [err[-1]], proc.stderr
        if limit is not None:
            assert err[-1] == (f"error: cannot save checkpoint 2 in '{workdir}/checkpoints': "
                               f"File too large [errno 27]; no checkpoint of this run is on "
                               f"disk: make room or use another --workdir")
            assert list((workdir / "checkpoints").iterdir()) == []  # no partial directory
            return
        assert re.fullmatch(
            rf"error: cannot save checkpoint (\d+) in '{workdir}/checkpoints': No space left "
            rf"on device \[errno 28\]; the newest complete checkpoint, step (\d+) "
            rf"\('{workdir}/checkpoints/\2'\), is untouched: make room and rerun the same "
            rf"command to resume from it", err[-1]), err[-1]
        last = int(re.search(r"step (\d+) \(", err[-1]).group(1))
        assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) \
            == list(range(2, last + 1, 2))  # no `<failed>.orbax-checkpoint-tmp`
        grow(disk, "40m")
        fake_runners(monkeypatch.setattr)
        code, err = run_main(capsys, argv)
        assert code == 0 and f"resuming from step {last}" in err, err


def test_disk_full_from_the_start_one_line_and_nothing_left_behind(tmp_path, text):
    """A 300 KB disk that is already full: the run stops before any work (one line, the
    workdir it created removed); with that check blinded, the first metrics line fails (one
    line, and nothing from tensorboardX's thread or its atexit hook)."""
    with small_disk(tmp_path / "disk", "300k") as disk:
        if disk is None:
            pytest.skip("mount -t tmpfs refused (not root)")
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        workdir = disk / "w"
        argv = ["--data", str(text), "--workdir", str(workdir), "--steps", "6", *SMALL]
        proc = worker("fake", *argv)
        assert proc.returncode == 2, proc.stderr
        assert re.fullmatch(rf"error: --workdir '{workdir}' has 0.0 MB free and one checkpoint "
                            rf"of this run needs about [\d.]+ MB: make room or use another "
                            rf"--workdir", lines(proc.stderr)[-1]), proc.stderr
        assert lines(proc.stderr)[:-1] == ["data: took 1 files, 0.0 MB"], proc.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
        proc = worker("unchecked-space", *argv)
        assert proc.returncode == 2, proc.stderr
        assert [line for line in lines(proc.stderr) if not line.startswith(("data:", "model:"))] \
            == [f"error: cannot write '{workdir}/metrics.jsonl': No space left on device"], \
            proc.stderr


# --------------------------------------------------------------------------- 2: one run per workdir


def test_second_run_on_a_workdir_in_use_is_refused_and_a_stale_lock_is_taken_over(
        tmp_path, text, capsys, monkeypatch):
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), "--steps", "4", *SMALL]
    holder = subprocess.Popen([sys.executable, WORKER, "hold", *argv], env=env(), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = workdir / ".lock"
        deadline = time.time() + 90
        while not (lock.exists() and lock.read_text().strip()):
            assert holder.poll() is None and time.time() < deadline, holder.stderr.read()
            time.sleep(0.2)
        # the same command, and one with another seed: both refused at once
        for extra in ([], ["--seed", "1"]):
            code, err = run_main(capsys, argv + extra)
            assert code == 2
            (line,) = lines(err)
            assert re.fullmatch(
                rf"error: --workdir '{workdir}' is in use by process {holder.pid} on host "
                rf"{re.escape(socket.gethostname())} \(started [-\d:T+]+\): two runs would "
                rf"overwrite each other's checkpoints and metrics; wait for it to end, stop it, "
                rf"or use another --workdir", line), line
    finally:
        holder.kill()  # SIGKILL: a crash, the lock file stays behind
        holder.wait()
    assert str(holder.pid) in lock.read_text()
    fake_runners(monkeypatch.setattr)
    code, err = run_main(capsys, argv)
    assert code == 0, err
    assert lines(err)[0].startswith(f"note: took over the lock of --workdir '{workdir}' from "
                                    f"process {holder.pid} on host ")
    assert lines(err)[0].endswith("which ended without releasing it (a crash or a kill)")
    assert not lock.exists()  # a run that ends normally removes it


# --------------------------------------------------------------------------- 3, 6: impls


def test_available_impls_lists_only_what_runs_here(rng):
    names = csa_jax.available_impls()
    for name in registry.names():
        why = registry.get(name).cannot_run_here()
        assert (why is None) == (name in names), (name, why)
    q, kv, idx, sink = random_problem(rng, B=1, T=8, H=2, D=16, K=4)
    for name in names:  # each one listed really runs a call here
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, impl=name)
        assert np.isfinite(np.asarray(o)).all(), name
    if jax.default_backend() == "cpu":
        assert "gluon" not in names
        assert registry.get("gluon").cannot_run_here().startswith(
            "impl='gluon' cannot run here: ")
    text = " ".join(build_parser().format_help().split())
    assert f"Runnable here: auto, {', '.join(names)}." in text


def test_impl_that_cannot_run_here_is_one_line_before_the_model_is_built(tmp_path, text,
                                                                        capsys):
    why = registry.get("gluon").cannot_run_here()
    if why is None:
        pytest.skip("gluon runs on this machine")
    workdir = tmp_path / "w"
    code, err = run_main(capsys, ["--impl", "gluon", "--data", str(text), "--workdir",
                                  str(workdir), *SMALL])
    assert code == 2
    assert lines(err) == [f"error: --impl gluon {why.removeprefix('impl=' + repr('gluon') + ' ')}"
                          f"; runnable here: auto, {', '.join(csa_jax.available_impls())}"]
    assert not workdir.exists()


# --------------------------------------------------------------------------- 4: libtpu's lines


def test_cli_calls_start_without_libtpu_lines(tmp_path, text):
    """A failing and a succeeding CLI call and `import csa_jax`, with JAX_PLATFORMS unset: on a
    machine without an accelerator their stderr holds only their own lines."""
    where = accelerator_present()
    if where is not None:
        pytest.skip(f"an accelerator is present ({where}): jax's own platform choice stands")
    clean = {k: v for k, v in env().items() if k != "JAX_PLATFORMS"}
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=120, env=clean, cwd=REPO)
    bad = run("-m", "train", "--batch-size", "0")
    assert bad.returncode == 2 and lines(bad.stderr) == [
        "error: --batch-size 0: must be a positive integer"], bad.stderr
    workdir = tmp_path / "w"
    argv = ["--data", str(text), "--workdir", str(workdir), *SMALL]
    save_checkpoint_like_the_cli(argv, workdir, step=5)
    good = run("-m", "train", *argv, "--steps", "5")
    assert good.returncode == 0 and [line.split(":")[0] for line in lines(good.stderr)] == [
        "data", "nothing to do"], good.stderr
    probe = run("-c", "import csa_jax, jax; print(jax.config.jax_platforms, jax.devices())")
    assert probe.returncode == 0 and probe.stderr == "", probe.stderr
    if importlib.util.find_spec("libtpu") is not None:
        assert probe.stdout.startswith("cpu "), probe.stdout  # the TPU probe was skipped
    chose = subprocess.run([sys.executable, "-c", "import csa_jax, jax; "
                            "print(jax.config.jax_platforms)"], capture_output=True, text=True,
                           timeout=120, env={**clean, "JAX_PLATFORMS": ""}, cwd=REPO)
    assert chose.stdout.strip() in ("", "None")  # the user's choice (even '') is left alone


# --------------------------------------------------------------------------- 5: Latin-1 data


def test_latin1_file_is_trained_on_and_a_skipped_one_says_how_to_take_it(tmp_path, capsys):
    latin1 = tmp_path / "notes" / "caf\u00e9.txt"
    latin1.parent.mkdir()
    latin1.write_bytes(("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n" * 200).encode("latin-1"))
    named = ByteDataset([str(latin1)], seq_len=32, batch_size=2)
    assert named.n_files == 1 and not named.not_utf8  # named on its own: taken
    code, err = run_main(capsys, ["--data", str(latin1.parent), "--workdir",
                                  str(tmp_path / "w"), *SMALL])
    assert code == 2
    assert lines(err) == [f"error: --data '{latin1.parent}': no text files; skipped 1 not UTF-8 "
                          f"(caf\u00e9.txt; --data-encoding any takes them)"]
    assert not (tmp_path / "w").exists()
    taken = ByteDataset([str(latin1.parent)], seq_len=32, batch_size=2, encoding="any")
    assert taken.n_files == 1 and taken.n_bytes == latin1.stat().st_size + 1


# --------------------------------------------------------------------------- 7: --no-progress


def test_no_progress_prints_one_line_per_logged_step(tmp_path, text, capsys, monkeypatch):
    fake_runners(monkeypatch.setattr, loss=lambda step: 5.0 - step / 10)
    code, err = run_main(capsys, ["--data", str(text), "--workdir", str(tmp_path / "w"),
                                  "--steps", "10", "--log-every", "5", "--eval-every", "10",
                                  *SMALL])
    assert code == 0, err
    steps = [line for line in lines(err) if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1/10", "step 5/10", "step 10/10",
                                                "step 10/10"]
    assert steps[1].startswith("step 5/10: loss 4.5000, grad_norm 0, lr 0, ") \
        and steps[1].endswith(" tok/s")
    assert steps[3] == "step 10/10: eval loss 1.0000"


# --------------------------------------------------------------------------- 8: absurd size


def test_absurd_sequence_length_is_refused_before_compiling(tmp_path, capsys):
    corpus = tmp_path / "big.txt"
    corpus.write_bytes(np.random.default_rng(0).integers(97, 123, 9_600_000, np.uint8)
                       .tobytes())
    t0 = time.perf_counter()
    code, err = run_main(capsys, ["--data", str(corpus), "--seq-len", "1048576",
                                  "--workdir", str(tmp_path / "w"), "--no-progress"])
    assert code == 2
    (line,) = [x for x in lines(err) if x.startswith("error:")]
    assert re.fullmatch(
        r"error: this step needs at least [\d.]+ TB \(its largest array is \w+\[8,1048576,\d+\], "
        r"[\d.]+ TB, beside [\d.]+ MB of parameters and optimizer state\) and this machine has "
        r"[\d.]+ GB: lower --seq-len \(1048576\) or --batch-size \(8\), or use a smaller "
        r"--preset or --layers schedule", line), line
    assert time.perf_counter() - t0 < 120  # the compile alone took 119 s (and then failed)
    assert not (tmp_path / "w").exists()


# --------------------------------------------------------------------------- 9: Ctrl-C in a compile


def test_first_ctrl_c_is_acknowledged_at_once(tmp_path, text):
    """One SIGINT during a first step that takes 4 s (a compile, say): the line saying it was
    received comes before the step ends, then the run saves that step and exits 130."""
    workdir = tmp_path / "w"
    proc = worker("first-sigint", "--data", str(text), "--workdir", str(workdir), "--steps",
                  "20", *SMALL)
    assert proc.returncode == 130, proc.stderr
    err = lines(proc.stderr)
    said = [i for i, line in enumerate(err) if line.startswith("SIGINT received:")]
    assert len(said) == 1 and said[0] < err.index("step 1 ends"), proc.stderr
    assert err[said[0]] == ("SIGINT received: the run stops after the step in progress (the "
                            "first step also compiles, which can take minutes) and saves a "
                            "checkpoint of it; SIGINT again stops at once without saving")
    assert err[-1].startswith("SIGINT: saved a checkpoint at step 1 in ")
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]


# --------------------------------------------------------------------------- 10: xdist's SIGINT


@pytest.mark.slow
def test_xdist_worker_slow_to_end_leaves_no_keyboardinterrupt_traceback(tmp_path):
    """A worker whose session end (a gc pass over a big heap: 11 s here) outlasts execnet's 5 s
    gets a SIGINT; without tests/_quiet_worker_exit.py it lands in a gc callback and ends the
    passing run with a PytestUnraisableExceptionWarning (the control run shows it still would).
    11 s: the SIGINT comes 5 s after the controller asks the worker to exit, which on a loaded
    machine can be seconds after the worker's session ended; execnet's os._exit would come
    10 s after the SIGINT."""
    pytest.importorskip("xdist")
    for name, fix in (("fixed", True), ("control", False)):
        d = tmp_path / name
        d.mkdir()
        (d / "test_one.py").write_text("def test_ok():\n    pass\n")
        (d / "conftest.py").write_text(
            "import gc, time\n"
            + ("from _quiet_worker_exit import pytest_sessionfinish\n" if fix else "")
            + "def pytest_unconfigure(config):\n"
              "    if hasattr(config, 'workerinput'):\n"
              "        def slow(phase, info):\n"
              "            if phase == 'start':\n"
              "                time.sleep(11)\n"
              "        gc.callbacks.insert(0, slow)\n"
              "        gc.collect()\n"
              "        gc.callbacks.remove(slow)\n")
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "."],
        cwd=tmp_path / name, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env(), "PYTHONPATH": str(REPO / "tests")}) for name in ("fixed", "control")}
    out = {name: p.communicate(timeout=120)[0] for name, p in procs.items()}
    assert procs["fixed"].returncode == 0, out["fixed"]
    for noise in ("KeyboardInterrupt", "PytestUnraisableExceptionWarning", "Traceback"):
        assert noise not in out["fixed"], out["fixed"]
    if "KeyboardInterrupt" not in out["control"]:
        # the SIGINT is timed by execnet against the worker's gc pass: on a loaded machine it
        # can miss it (seen once in 2026-12-08's runs), and then this run shows nothing
        pytest.skip(f"the control run did not reproduce the SIGINT: {out['control'][-300:]!r}")


# --------------------------------------------------------------------------- 12: flags, no litter


@pytest.mark.parametrize("argv, message", [
    (["--keep", "0"], "error: --keep 0: must be a positive integer"),
    (["--layers", "flash:0"], "error: --layers 'flash:0': the layer count must be >= 1, got 0"),
    (["--warmup-steps", "-1"], "error: --warmup-steps -1: must be >= 0"),
    (["--seq-len", "30"], "error: --seq-len=30 is not usable with the layer schedule [0, 4]: it "
                          "must be a multiple of every compress ratio [4] (i.e. of 4); try "
                          "--seq-len 28"),
])
def test_messages_name_the_flags_typed(capsys, tmp_path, text, argv, message):
    code, err = run_main(capsys, ["--data", str(text), "--workdir", str(tmp_path / "w"),
                                  *SMALL, *argv])
    assert code == 2 and lines(err) == [message]


def test_a_failed_start_leaves_no_workdir_behind(capsys, tmp_path):
    (tmp_path / "tiny.txt").write_text("too small")
    workdir = tmp_path / "new" / "run"
    code, err = run_main(capsys, ["--data", str(tmp_path / "tiny.txt"), "--workdir",
                                  str(workdir), *SMALL])
    assert code == 2 and "too small" in err
    assert not (tmp_path / "new").exists()  # both levels it created, and nothing else
