"""Multi-process (multi-host) training through JAX's own runtime, `jax.distributed`.

    # the same command on every host (or as N local processes), one process per host:
    python -m train --fsdp xla --coordinator HOST0:1234 --num-processes 2 --process-id 0
    JAX_COORDINATOR_ADDRESS=HOST0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 python -m train --fsdp xla

When to join (`launch_settings`): flags first, then the environment variables
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; without either, a launcher that
jax.distributed detects by itself (Slurm with SLURM_NTASKS > 1, Open MPI's mpirun with
OMPI_COMM_WORLD_SIZE > 1, a multi-host Cloud TPU slice with several TPU_WORKER_HOSTNAMES) makes
`initialize` fill in all three. Otherwise the run is the usual single process.

What changes with several processes (train.loop stays the same program on every process):

- the step runs over the global mesh (every process's devices), so it needs --fsdp xla|explicit
  (train.parallel.check_parallel says so);
- each process reads only its rows of every batch (`ProcessShare`): the rows that its own
  devices hold under the batch sharding, assembled into one global array with
  `jax.make_array_from_single_device_arrays`; the global batch is the one a single process
  would read, so the losses are the same (tests/test_train_multiprocess.py). The corpus
  itself (at most --max-corpus-mb, 16 MB by default) is still read and packed on every process,
  which is what keeps the window order identical everywhere;
- only process 0 writes metrics.jsonl, TensorBoard events, loss.png and log lines
  (`is_main`, `main_only`, `NullWriter`); every process takes part in orbax's checkpoint saves
  and restores (the workdir must be on a file system that all hosts share).
"""

from __future__ import annotations

import os

import jax

from train.config import ConfigError

__all__ = ["NullWriter", "ProcessShare", "initialize", "is_main", "launch_settings", "main_only",
           "process_share"]

_ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
        "process_id": "JAX_PROCESS_ID"}


def _int_env(environ, name):
    text = environ.get(name)
    if text in (None, ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an int") from None


def _cluster_processes(environ) -> int:
    """Process count announced by a launcher that jax.distributed auto-detects (0: none)."""
    if "SLURM_JOB_ID" in environ and "SLURM_NTASKS" in environ:
        return _int_env(environ, "SLURM_NTASKS") or 0
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return _int_env(environ, "OMPI_COMM_WORLD_SIZE") or 0
    hosts = environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()])


def launch_settings(coordinator=None, num_processes=None, process_id=None, *,
                    environ=None) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None for a single-process run.

    Flags (the arguments) win over the JAX_* environment variables. A value left out is filled
    in by jax.distributed's own launcher detection when one is present; otherwise all three are
    needed. Raises ConfigError naming the bad or missing setting."""
    environ = os.environ if environ is None else environ
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for key, var in _ENV.items():
        if given[key] is None:
            given[key] = (environ.get(var) or None) if key == "coordinator" else _int_env(environ, var)
    cluster = _cluster_processes(environ)
    if all(v is None for v in given.values()):
        return {} if cluster > 1 else None
    n, pid = given["num_processes"], given["process_id"]
    if n is not None and n < 1:
        raise ConfigError(f"--num-processes {n} must be >= 1")
    if n == 1 and cluster <= 1:
        return None  # explicitly one process
    if n is not None and pid is not None and not 0 <= pid < n:
        raise ConfigError(f"--process-id {pid} must be in [0, {n}) for --num-processes {n}")
    missing = [k for k, v in given.items() if v is None]
    if missing and cluster <= 1:
        names = ", ".join(f"--{k.replace('_', '-')} (or {_ENV[k]})" for k in missing)
        raise ConfigError(f"a multi-process run needs {names} as well (no launcher such as "
                          f"Slurm or mpirun was detected to fill them in)")
    out = {"coordinator_address": given["coordinator"], "num_processes": n, "process_id": pid}
    return {k: v for k, v in out.items() if v is not None}


def initialize(coordinator=None, num_processes=None, process_id=None, *, timeout_s=300) -> bool:
    """Join the other processes with jax.distributed.initialize when `launch_settings` says this
    is a multi-process run; must come before anything touches a JAX backend. Returns whether
    it joined."""
    kwargs = launch_settings(coordinator, num_processes, process_id)
    if kwargs is None:
        return False
    # Cross-process collectives of the CPU backend (tests, CPU clusters); GPU / TPU ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=timeout_s)
    except Exception as e:  # unreachable coordinator, timeout, launcher detection failing
        raise ConfigError(f"jax.distributed.initialize({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
                          f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}") from None
    return True


def is_main() -> bool:
    """True on the process that writes metrics, plots and logs (process 0)."""
    return jax.process_index() == 0


def main_only(fn):
    """fn on process 0, a no-op returning None elsewhere."""
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs) if is_main() else None
    return wrapped


class NullWriter:
    """train.metrics.MetricsWriter's interface, writing nothing (processes other than 0)."""

    def __init__(self, *args, **kwargs):
        pass

    def write(self, record):
        pass

    def advance(self, n=1):
        pass

    def message(self, text):
        pass

    def close(self):
        pass


class ProcessShare:
    """A ByteDataset seen by one process: batch(step) and eval_batches(count) return global
    jax.Arrays laid out by `sharding` (rows over the data axis), built from only the rows whose
    shards live on this process's devices (`ByteDataset.batch(step, part)`). Every other
    attribute is the dataset's."""

    def __init__(self, data, sharding):
        self._data = data
        self.sharding = sharding
        self.global_shape = (data.batch_size, data.seq_len)
        index = sharding.addressable_devices_indices_map(self.global_shape)
        self._parts = []  # (device, row slice) for each of this process's devices
        for device, idx in index.items():
            rows = idx[0] if idx else slice(None)
            if any(s != slice(None) for s in idx[1:]) or rows.step not in (None, 1):
                raise ValueError(f"the batch sharding {sharding} splits more than the batch "
                                 f"rows on {device}: {idx}")
            self._parts.append((device, slice(*rows.indices(data.batch_size))))
        covered = sorted({(s.start, s.stop) for _, s in self._parts})
        self.rows = [r for a, b in covered for r in range(a, b)]  # this process's batch rows

    def __getattr__(self, name):
        return getattr(self._data, name)

    def _assemble(self, read):
        """read(row slice) -> (inputs, targets) numpy -> (inputs, targets) global arrays."""
        cache = {}
        for _, rows in self._parts:
            key = (rows.start, rows.stop)
            if key not in cache:
                cache[key] = read(rows)
        out = []
        for k in range(2):
            shards = [jax.device_put(cache[(rows.start, rows.stop)][k], device)
                      for device, rows in self._parts]
            out.append(jax.make_array_from_single_device_arrays(self.global_shape, self.sharding,
                                                                shards))
        return tuple(out)

    def batch(self, step: int):
        return self._assemble(lambda rows: self._data.batch(step, rows))

    def eval_batches(self, count: int):
        parts = {}
        for _, rows in self._parts:
            key = (rows.start, rows.stop)
            if key not in parts:
                parts[key] = self._data.eval_batches(count, rows)
        return [self._assemble(lambda rows, b=b: parts[(rows.start, rows.stop)][b])
                for b in range(count)]


def process_share(data, runner):
    """`data` itself in a single-process run; its ProcessShare under the runner's batch
    sharding when the run spans several processes."""
    if jax.process_count() == 1:
        return data
    return ProcessShare(data, runner.batch_sharding((data.batch_size, data.seq_len)))
