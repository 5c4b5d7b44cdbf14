"""One process of the 2-process FSDP test (tests/test_comm_multiprocess.py); not a test itself.

    python tests/_comm_worker.py PROCESS_ID NUM_PROCESSES PORT SEED OUT.npz

The parent sets XLA_FLAGS=--xla_force_host_platform_device_count=4. Each process joins the
others through jax.distributed on 127.0.0.1:PORT, takes one FSDP step in each mode over the
global 8-device mesh, and process 0 writes the gathered parameters and losses to OUT.npz.
"""

import os
import sys

import numpy as np

LR = 0.1  # SGD, not Adam: Adam's first step divides by |g| and amplifies rounding of tiny gradients


def make_model(seed: int):
    from flax import nnx

    from mlp_stack import MLPStack

    return MLPStack(12, 32, 64, 5, 3, rngs=nnx.Rngs(seed))


def make_batch(seed: int, b: int = 16):
    rng = np.random.default_rng(seed + 1)
    return {"x": rng.standard_normal((b, 12)).astype(np.float32),
            "y": rng.standard_normal((b, 5)).astype(np.float32)}


def one_step(seed: int, mode: str):
    """(loss, gathered param leaves as numpy) after one FSDP step over all devices."""
    import jax
    import optax
    from jax.experimental import multihost_utils

    from comm import fsdp
    from mlp_stack import mse_loss

    model = make_model(seed)
    step = fsdp.make_train_step(model, mse_loss, optax.sgd(LR, momentum=0.9), fsdp.make_mesh(), mode=mode)
    state = step.init(model)
    state, loss = step(state, step.shard_batch(make_batch(seed)))
    leaves = jax.tree.leaves(state.params)
    if jax.process_count() > 1:
        leaves = multihost_utils.process_allgather(leaves, tiled=True)
    return float(loss), [np.asarray(leaf) for leaf in leaves]


def main(process_id: int, num_processes: int, port: int, seed: int, out: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    from comm import fsdp

    assert jax.process_count() == num_processes and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    results = {}
    for mode in fsdp.MODES:
        loss, leaves = one_step(seed, mode)
        results[f"{mode}/loss"] = np.asarray(loss)
        for i, leaf in enumerate(leaves):
            results[f"{mode}/{i}"] = leaf
    if process_id == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    pid, nproc, port, seed = (int(a) for a in sys.argv[1:5])
    main(pid, nproc, port, seed, sys.argv[5])
