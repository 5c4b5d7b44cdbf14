"""train.distributed: when a run joins jax.distributed, each process's share of the data, and
`python -m train` as 2 local processes x 4 CPU devices against 1 process x 8 devices."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from train.cli import build_parser, config_from_args
from train.config import ConfigError
from train.data import ByteDataset
from train.distributed import ProcessShare, launch_settings
from train.loop import train_and_evaluate
from train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 400  # a peer that never joins fails the test instead of hanging CI


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    words = "bytes learn which byte comes next so common words become cheap to predict".split()
    rng = np.random.default_rng(7)
    (d / "a.txt").write_text(" ".join(rng.choice(words, size=2000)) + "\n")
    return d


# ----------------------------------------------------------------------------- launch settings


def test_launch_settings_from_flags_env_and_launchers():
    assert launch_settings(environ={}) is None  # plain single-process run
    assert launch_settings(num_processes=1, environ={}) is None
    full = {"coordinator_address": "h0:1234", "num_processes": 2, "process_id": 1}
    assert launch_settings("h0:1234", 2, 1, environ={}) == full
    env = {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert launch_settings(environ=env) == full
    assert launch_settings(process_id=0, environ=env)["process_id"] == 0  # a flag beats the env
    # launchers that jax.distributed detects itself: initialize() fills everything in
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}
    assert launch_settings(environ=slurm) == {}
    assert launch_settings(environ={**slurm, "SLURM_NTASKS": "1"}) is None
    assert launch_settings(environ={"OMPI_COMM_WORLD_SIZE": "2"}) == {}
    assert launch_settings(environ={"TPU_WORKER_HOSTNAMES": "t0,t1"}) == {}
    assert launch_settings(environ={"TPU_WORKER_HOSTNAMES": "t0"}) is None
    assert launch_settings(coordinator="h0:1", environ=slurm) == {"coordinator_address": "h0:1"}
    with pytest.raises(ConfigError, match=r"needs --process-id \(or JAX_PROCESS_ID\)"):
        launch_settings("h0:1234", 2, environ={})
    with pytest.raises(ConfigError, match=r"--process-id 2 must be in \[0, 2\)"):
        launch_settings("h0:1234", 2, 2, environ={})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two' is not an int"):
        launch_settings(environ={"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ConfigError, match="--num-processes 0 must be >= 1"):
        launch_settings("h0:1234", 0, 0, environ={})


# ----------------------------------------------------------------------------- the data split


def test_process_rows_reassemble_the_global_batch(corpus, eight_devices):
    data = ByteDataset([str(corpus)], seq_len=32, batch_size=8, seed=5)
    for step in (0, 3, 10 * data.n_train):  # a later epoch too
        x, y = data.batch(step)
        parts = [data.batch(step, slice(a, a + 4)) for a in (0, 4)]  # two processes' rows
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    ev = data.eval_batches(2)
    ev_parts = [data.eval_batches(2, slice(a, a + 2)) for a in range(0, 8, 2)]
    for b in range(2):
        np.testing.assert_array_equal(np.concatenate([p[b][0] for p in ev_parts]), ev[b][0])
    # ProcessShare over this process's 8 devices: the global array is the host batch, and
    # each device's shard was read from its own rows.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    share = ProcessShare(data, NamedSharding(mesh, PartitionSpec("fsdp")))
    assert share.rows == list(range(8)) and share.fingerprint == data.fingerprint
    gx, gy = share.batch(3)
    np.testing.assert_array_equal(np.asarray(gx), data.batch(3)[0])
    np.testing.assert_array_equal(np.asarray(gy), data.batch(3)[1])
    assert len(gx.sharding.device_set) == 8
    for shard in gx.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), data.batch(3, shard.index[0])[0])
    np.testing.assert_array_equal(np.asarray(share.eval_batches(2)[1][1]), ev[1][1])


# ----------------------------------------------------------------------------- 2 processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one_and_stop_together(corpus, tmp_path, rng, eight_devices):
    """2 processes x 4 devices = 1 process x 8 devices, loss for loss; SIGTERM to process 1
    alone (a preemption notice) stops both at one agreed step, which both save."""
    seed = int(rng.integers(1 << 20))
    steps = 60
    argv = ["--preset", "tiny", "--layers", "4", "--seq-len", "32", "--batch-size", "8",
            "--steps", str(steps), "--fsdp", "xla", "--data", str(corpus), "--seed", str(seed),
            "--log-every", "1", "--eval-every", "5", "--eval-batches", "1",
            "--ckpt-every", str(steps), "--no-progress"]
    work2 = tmp_path / "two"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "train", *argv, "--workdir", str(work2), "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not read_metrics(work2 / "metrics.jsonl"):  # step 1 done: compiled, training
            assert time.monotonic() < deadline and procs[0].poll() is None, "no step 1"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    except (subprocess.TimeoutExpired, AssertionError) as e:
        for p in procs:
            p.kill()
        pytest.fail(f"the 2-process run did not finish: {e}\n"
                    + "\n".join(p.communicate()[1][-3000:] for p in procs))
    for i, (p, (out, err)) in enumerate(zip(procs, logs)):
        assert p.returncode == 128 + signal.SIGTERM, f"process {i}: {p.returncode}\n{err[-4000:]}"
    m = re.search(r"SIGTERM: saved a checkpoint at step (\d+)", logs[0][1])
    assert m, logs[0][1][-3000:]
    stop = int(m.group(1))
    assert 1 < stop < steps
    assert "saved a checkpoint" not in logs[1][1] and "model:" not in logs[1][1]  # only 0 logs
    ckpts = sorted(int(c.name) for c in (work2 / "checkpoints").iterdir() if c.name.isdigit())
    assert ckpts == [stop]
    rows = read_metrics(work2 / "metrics.jsonl")
    two = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(two) == list(range(1, stop + 1))  # each step written once, by process 0
    two_eval = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert (work2 / "loss.png").exists()

    cfg = config_from_args(build_parser().parse_args(argv))  # the same run, 1 process x 8 devices
    one = train_and_evaluate(cfg, tmp_path / "one", progress=False, log=lambda s: None)
    for step, loss in two.items():
        assert loss == pytest.approx(one.losses[step], rel=1e-6), (step, loss, one.losses[step])
    assert sorted(two_eval) == list(range(5, stop + 1, 5))
    for step, loss in two_eval.items():
        assert loss == pytest.approx(one.eval_losses[step], rel=1e-6), (step, loss)
