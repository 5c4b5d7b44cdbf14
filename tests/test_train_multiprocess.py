"""train.distributed: when a run joins jax.distributed, each process's share of the data, and
`python -m train` as 2 local processes x 4 CPU devices against 1 process x 8 devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
def test_two_processes_train_like_one(corpus, tmp_path, rng, eight_devices):
    seed = int(rng.integers(1 << 20))
    argv = ["--preset", "tiny", "--layers", "4", "--seq-len", "32", "--batch-size", "8",
            "--steps", "2", "--fsdp", "xla", "--data", str(corpus), "--seed", str(seed),
            "--log-every", "1", "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2",
            "--no-progress"]
    work2 = tmp_path / "two"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "train", *argv, "--workdir", str(work2), "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the 2-process run did not finish within {TIMEOUT_S}s")
    for i, (p, (out, err)) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{err[-4000:]}"
    assert "done: step 2" in logs[0][1]
    assert "done:" not in logs[1][1] and "model:" not in logs[1][1]  # process 1 logs nothing
    rows = read_metrics(work2 / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 2], rows  # written once (by process 0)
    assert (work2 / "loss.png").exists() and (work2 / "checkpoints" / "2").is_dir()

    cfg = config_from_args(build_parser().parse_args(argv))  # the same run, 1 process x 8 devices
    one = train_and_evaluate(cfg, tmp_path / "one", progress=False, log=lambda s: None)
    two = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert one.losses.keys() == two.keys()
    for step in two:
        assert two[step] == pytest.approx(one.losses[step], rel=1e-6), (step, two, one.losses)
    ev = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert ev == [pytest.approx(one.eval_losses[2], rel=1e-6)]
