"""How a step runs: on one device (`fsdp="off"`) or sharded with comm's FSDP (`xla`/`explicit`).

A runner keeps the train state in the layout its step wants ("device state") and converts to and
from the portable layout that checkpoints store (train.loop's state dict), so a run saved under
one mode resumes under another:

    dstate = runner.put(state)            # portable -> device layout (placement, sharding)
    dstate, metrics = runner.step(dstate, runner.batch(np_batch))
    loss = runner.eval(dstate, runner.batch(np_eval_batch))
    state = runner.get(dstate)            # device -> portable layout (for the checkpoint)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from csa_jax.layers import LOGICAL_AXIS_RULES
from train.config import ConfigError

__all__ = ["ContextParallelRunner", "FSDPRunner", "SingleDeviceRunner", "check_parallel",
           "make_runner"]


def _next_rng(rng):
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), 1))


def compute_params(params, dtype):
    """Mixed precision: matrices in the compute dtype; vectors (norms, sinks, biases) stay f32."""
    return jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, params)


def lm_loss(model, inputs, targets):
    """(cross-entropy, aux loss) of the decoder on one batch."""
    logits, aux = model(inputs)  # [B, T, V] f32
    with jax.named_scope("loss"):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return ce, aux


class SingleDeviceRunner:
    """The pure `train_step(state, batch) -> (state, metrics)` under jax.jit."""

    def __init__(self, graphdef, tx, schedule, compute_dtype):
        dtype = jnp.dtype(compute_dtype)

        def loss_fn(params, inputs, targets):
            ce, aux = lm_loss(nnx.merge(graphdef, compute_params(params, dtype)), inputs, targets)
            return ce + aux, (ce, aux)

        def train_step(state, batch):
            grads, (ce, aux) = jax.grad(loss_fn, has_aux=True)(state["params"], *batch)
            with jax.named_scope("optimizer"):  # attributed in profiles (trace_breakdown.py)
                updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
                params = optax.apply_updates(state["params"], updates)
            new_state = {"step": state["step"] + 1,
                         "params": params,
                         "opt_state": opt_state,
                         "rng": _next_rng(state["rng"])}  # per-step key for stochastic layers
            metrics = {"loss": ce, "aux_loss": aux, "grad_norm": optax.tree.norm(grads),
                       "lr": schedule(state["step"])}
            return new_state, metrics

        self.train_step = train_step  # pure, un-jitted (tests and FSDP comparisons use it)
        self.step = jax.jit(train_step, donate_argnums=0)
        self._eval = jax.jit(lambda params, batch: loss_fn(params, *batch)[1][0])

    def hlo_text(self, state, batch):
        """The compiled HLO text of the step (from jit's cache once the step has run)."""
        return self.step.lower(state, batch).compile().as_text()

    def put(self, state):
        return jax.tree.map(jnp.array, state)  # a copy: the step donates its input state

    def shardings(self, state):
        """Where each leaf of the portable state goes (checkpoint restore target)."""
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, state)

    def get(self, dstate):
        return dstate

    def batch(self, batch):
        return tuple(map(jnp.asarray, batch))

    def eval(self, dstate, batch):
        return self._eval(dstate["params"], batch)


class FSDPRunner:
    """comm.fsdp's train step over every device: params and optimizer state sharded along
    their largest divisible dimension, the batch split over the devices."""

    def __init__(self, graphdef, params, tx, schedule, compute_dtype, mode):
        try:
            from comm import fsdp
        except Exception as e:  # comm missing or broken: a clear message, not a traceback
            raise ConfigError(f"--fsdp {mode} needs comm.fsdp, which failed to import "
                              f"({type(e).__name__}: {e}); use --fsdp off") from None
        dtype = jnp.dtype(compute_dtype)

        def loss_fn(model, batch):
            g, p, rest = nnx.split(model, nnx.Param, ...)
            ce, aux = lm_loss(nnx.merge(g, compute_params(p, dtype), rest), *batch)
            return ce + aux

        self.mesh = fsdp.make_mesh()
        self.n = self.mesh.size
        model = nnx.merge(graphdef, params)
        self._step = fsdp.make_train_step(model, loss_fn, tx, self.mesh, mode=mode,
                                          layers_attr="blocks", rules=LOGICAL_AXIS_RULES)
        t = self._step.init(model)  # FSDPState: its tree and the params' shardings
        self._defs = tuple(jax.tree.structure(x) for x in (t.params, t.opt_state))
        # comm's sharding rule reads each param's partition metadata, which Adam's moments carry
        # too (optax maps over the params' Variables): they are sharded like their params,
        # scalars (the count) replicated.
        self._shardings = tuple(jax.tree.leaves(self._step.param_sharding(x))
                                for x in (t.params, t.opt_state))
        self._state_type, self._rest = type(t), t.rest
        del t
        self._schedule = schedule
        single = SingleDeviceRunner(graphdef, tx, schedule, compute_dtype)
        self._eval = single._eval

    def put(self, state):
        # Same leaf order: pure dicts and nnx.State both flatten by sorted key.
        parts = []
        for tree, treedef, shardings in zip((state["params"], state["opt_state"]), self._defs,
                                            self._shardings):
            leaves = jax.tree.leaves(tree)
            if len(leaves) != treedef.num_leaves:
                raise ValueError(f"state has {len(leaves)} leaves where the FSDP layout has "
                                 f"{treedef.num_leaves}")
            leaves = [jax.device_put(x, s) for x, s in zip(leaves, shardings)]
            parts.append(jax.tree.unflatten(treedef, leaves))
        # step and rng replicated over the mesh: global arrays, as orbax wants them when the
        # run spans several processes
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return {"step": jax.device_put(state["step"], replicated),
                "fsdp": self._state_type(*parts, self._rest),
                "rng": jax.device_put(state["rng"], replicated)}

    def shardings(self, state):
        """Where each leaf of the portable state goes (checkpoint restore target)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        out = {k: jax.tree.map(lambda _: replicated, v) for k, v in state.items()}
        for key, shardings in zip(("params", "opt_state"), self._shardings):
            out[key] = jax.tree.unflatten(jax.tree.structure(state[key]), shardings)
        return out

    def get(self, dstate):
        fs = dstate["fsdp"]
        params = nnx.to_pure_dict(fs.params)
        opt_def = jax.tree.structure(jax.eval_shape(self._step.tx.init, params))
        return {"step": dstate["step"], "params": params,
                "opt_state": jax.tree.unflatten(opt_def, jax.tree.leaves(fs.opt_state)),
                "rng": dstate["rng"]}

    def batch_sharding(self, shape):
        """The sharding of a batch array of this shape (rows split over the devices)."""
        return self._step.batch_sharding(jax.ShapeDtypeStruct(shape, jnp.int32))

    def batch(self, batch):
        try:
            return self._step.shard_batch(tuple(map(jnp.asarray, batch)))
        except ValueError as e:
            raise ConfigError(f"--fsdp over {self.n} devices: {e}") from None

    def step(self, dstate, batch):
        lr = self._schedule(dstate["step"])
        fs, loss = self._step(dstate["fsdp"], batch)
        return ({"step": dstate["step"] + 1, "fsdp": fs, "rng": _next_rng(dstate["rng"])},
                {"loss": loss, "lr": lr})

    def eval(self, dstate, batch):
        return self._eval(nnx.to_pure_dict(dstate["fsdp"].params), batch)


class ContextParallelRunner(SingleDeviceRunner):
    """Context parallelism (csa_jax/context_parallel.py) without FSDP: a mesh of Auto axes
    ("data", "cp") = (devices / N, N); params and optimizer state replicated, each batch array
    [B, T] split as P("data", "cp"), so every device holds B / (devices / N) sequences' T / N
    tokens. The layers (context_axis "cp") attend with the halo and pool collectives; the rest
    of the model is per token and the partitioner keeps it split; the gradients' sums over the
    mesh are XLA's."""

    def __init__(self, graphdef, tx, schedule, compute_dtype, context_parallel, devices=None):
        import numpy as np
        from jax.sharding import AxisType, Mesh

        super().__init__(graphdef, tx, schedule, compute_dtype)
        devices = list(jax.devices() if devices is None else devices)
        n = context_parallel
        self.mesh = Mesh(np.array(devices).reshape(len(devices) // n, n), ("data", "cp"),
                         axis_types=(AxisType.Auto, AxisType.Auto))
        self.n = len(devices)
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._split = NamedSharding(self.mesh, PartitionSpec("data", "cp"))
        jit_step, jit_eval = self.step, self._eval
        self._jit_step = jit_step
        self.step = self._in_mesh(jit_step)
        self._eval = self._in_mesh(jit_eval)

    def _in_mesh(self, fn):
        def run(*args):
            with jax.set_mesh(self.mesh):
                return fn(*args)
        return run

    def hlo_text(self, state, batch):
        with jax.set_mesh(self.mesh):
            return self._jit_step.lower(state, batch).compile().as_text()

    def put(self, state):
        return jax.tree.map(lambda x: jax.device_put(jnp.array(x), self._replicated), state)

    def shardings(self, state):
        return jax.tree.map(lambda _: self._replicated, state)

    def batch(self, batch):
        return tuple(jax.device_put(jnp.asarray(b), self._split) for b in batch)


_CACHE: dict = {}


def _step_key(cfg):
    """The fields that shape the compiled step (not logging, data or checkpoint settings)."""
    return (cfg.model, cfg.fsdp, cfg.context_parallel, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio,
            cfg.weight_decay, cfg.b2, cfg.grad_clip, jax.device_count())


def make_runner(cfg, graphdef, params, tx, schedule):
    """The runner for cfg.fsdp. Runners are cached per step-shaping config, so a resumed run in
    the same process (tests, notebooks) reuses the compiled step."""
    key = _step_key(cfg)
    if key not in _CACHE:
        if len(_CACHE) >= 4:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _make_runner(cfg, graphdef, params, tx, schedule)
    return _CACHE[key]


def check_parallel(cfg):
    """Cheap checks of cfg against the devices, before any model is built."""
    n = jax.device_count()
    if cfg.fsdp == "off" and jax.process_count() > 1:
        raise ConfigError(f"this run spans {jax.process_count()} processes: --fsdp off trains "
                          f"on one device; pass --fsdp xla or --fsdp explicit")
    cp = cfg.context_parallel
    if cp > 1:
        if n % cp:
            raise ConfigError(f"--context-parallel {cp} must divide the {n} devices")
        if cfg.batch_size % (n // cp):
            raise ConfigError(f"--context-parallel {cp}: batch_size={cfg.batch_size} must divide "
                              f"by the {n // cp} groups of {cp} devices")
        if cfg.fsdp != "off":
            raise ConfigError(f"--context-parallel {cp} with --fsdp {cfg.fsdp} is not "
                              "implemented: params are replicated over the mesh (use --fsdp off)")
        if jax.process_count() > 1:
            raise ConfigError(f"--context-parallel {cp} runs in one process (got "
                              f"{jax.process_count()})")
        return
    if cfg.fsdp != "off" and cfg.batch_size % n:
        raise ConfigError(f"--fsdp {cfg.fsdp}: batch_size={cfg.batch_size} must divide by the "
                          f"{n} devices")


def _make_runner(cfg, graphdef, params, tx, schedule):
    check_parallel(cfg)
    if cfg.context_parallel > 1:
        return ContextParallelRunner(graphdef, tx, schedule, cfg.model.compute_dtype,
                                     cfg.context_parallel)
    if cfg.fsdp == "off":
        return SingleDeviceRunner(graphdef, tx, schedule, cfg.model.compute_dtype)
    return FSDPRunner(graphdef, params, tx, schedule, cfg.model.compute_dtype, cfg.fsdp)
