"""Multi-host FSDP through JAX's own runtime: 2 local processes x 4 CPU devices, joined with
jax.distributed.initialize on 127.0.0.1, give the same FSDP step as this process's 8 devices.

Needs the 8 simulated CPU devices that tests/conftest.py asks for (fixture eight_devices).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from comm import fsdp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _comm_worker import one_step  # noqa: E402

TIMEOUT_S = 200  # a hang (e.g. a peer that never joins) fails the test instead of CI


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.usefixtures("eight_devices")
def test_two_processes_match_one_process(tmp_path):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed={seed}")
    out = tmp_path / "fsdp_2proc.npz"
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "_comm_worker.py"), str(i), "2", str(port), str(seed),
                               str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the 2-process FSDP run did not finish within {TIMEOUT_S}s")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    got = np.load(out)
    for mode in fsdp.MODES:
        loss, leaves = one_step(seed, mode)  # 1 process, 8 devices
        np.testing.assert_allclose(got[f"{mode}/loss"], loss, rtol=1e-6)
        for i, leaf in enumerate(leaves):
            np.testing.assert_allclose(got[f"{mode}/{i}"], leaf, rtol=1e-5, atol=2e-6, err_msg=f"{mode} leaf {i}")
