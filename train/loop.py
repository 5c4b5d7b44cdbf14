"""Training: state, a pure `train_step(state, batch) -> (state, metrics)`, and the run loop.

The train state is a plain pytree (dict), the layout checkpoints store:

    {"step": int32 [], "params": pure dict of f32 arrays, "opt_state": optax state,
     "rng": uint32 [2]}

The step itself lives in train.parallel (one device, or comm's FSDP). Mixed precision: params
stay float32 (the master weights); the loss casts every matrix to ModelConfig.compute_dtype
(bf16 on GPU) for the forward and backward, so the gradients come back to the f32 masters
through the cast. Norm scales, sinks and the compressor's position biases stay float32.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train.checkpoint import CheckpointError, Checkpointer
from train import distributed
from train.config import ConfigError, TrainConfig
from train.data import ByteDataset
from train.interrupt import StopFlag
from train.metrics import MetricsWriter, plot_losses
from train.model import DecoderLM, count_params
from train.parallel import check_parallel, make_runner
from train.profile import StepProfiler
from train.workdir import WorkdirLock, free_bytes, prepare_workdir, remove_if_unused

__all__ = ["DivergedError", "RunResult", "init_state", "make_optimizer", "train_and_evaluate"]

# Fields that may differ when a run resumes (they do not change the numbers of later steps,
# except `steps`, which is the run's total length and so shapes the LR schedule's tail).
_RESUMABLE_CHANGES = {"steps", "log_every", "eval_every", "eval_batches", "ckpt_every",
                      "keep_checkpoints", "model.attention.impl", "model.remat",
                      "model.scan_layers", "model.attention.indexer_scores",
                      "model.attention.indexer_select", "model.swiglu", "model.norm", "fsdp",
                      "context_parallel", "model.attention.context_axis"}


# Fields added to TrainConfig later, with the value that behaves as runs saved before did.
_ADDED_FIELDS = {"data_encoding": "utf-8"}


def make_optimizer(cfg: TrainConfig):
    """AdamW with linear warmup + cosine decay to min_lr_ratio * lr, global-norm clipping.
    Weight decay applies to matrices only (not norms, sinks, position biases)."""
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=cfg.b2, eps=1e-8, weight_decay=cfg.weight_decay,
                    mask=decay_mask))
    return tx, schedule


def init_state(cfg: TrainConfig):
    """(graphdef, state, tx, schedule) of a fresh run, seeded by cfg.seed."""
    graphdef, params = _init_model(cfg.model, cfg.seed)
    tx, schedule = make_optimizer(cfg)
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "rng": jax.random.key_data(jax.random.key(cfg.seed + 1)),
    }
    return graphdef, state, tx, schedule


def _init_model(model_cfg, seed):
    """The model's graphdef and f32 params (eager init: each small random op compiles once per
    shape and is cached, which beats compiling one big init program per run)."""
    model = DecoderLM(model_cfg, rngs=nnx.Rngs(params=seed))
    graphdef, variables = nnx.split(model)
    return graphdef, nnx.to_pure_dict(variables)


# ----------------------------------------------------------------------------- the run


def _with_last(e: CheckpointError, stop, ckpt) -> CheckpointError:
    """A failed save's error, saying what is safe on disk and how to go on."""
    if stop.last_saved is not None:
        return CheckpointError(f"{e}; the newest complete checkpoint, step {stop.last_saved} "
                               f"({str(ckpt.path(stop.last_saved))!r}), is untouched: make room "
                               f"and rerun the same command to resume from it")
    return CheckpointError(f"{e}; no checkpoint of this run is on disk: make room or use "
                           f"another --workdir")


class DivergedError(RuntimeError):
    """The loss became NaN or infinite (reported by the CLI without a traceback)."""


@dataclasses.dataclass
class RunResult:
    status: str  # "done" | "interrupted" | "already_done"
    step: int
    losses: dict  # step -> train loss (this invocation's steps)
    eval_losses: dict
    signal: int | None = None


def _same_paths(a, b) -> bool:
    """Two `data` lists name the same paths (a relative path and its absolute form are equal;
    a relative path saved by an older version is taken relative to the current directory)."""
    norm = lambda specs: [os.path.realpath(os.path.expanduser(s)) for s in specs]  # noqa: E731
    return norm(a or ()) == norm(b or ())


def _config_diff(saved: dict, now: dict, prefix="") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        name = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, prefix=name + ".")
        elif name == "data" and _same_paths(a, b):
            continue
        elif k not in saved and name in _ADDED_FIELDS and b == _ADDED_FIELDS[name]:
            continue  # a field added after the run was saved, at its old behaviour
        elif (list(a) if isinstance(a, (list, tuple)) else a) != \
                (list(b) if isinstance(b, (list, tuple)) else b) and name not in _RESUMABLE_CHANGES:
            out.append(f"{name}: saved {a!r}, now {b!r}")
    return out


def check_impl(cfg: TrainConfig) -> None:
    """An explicitly requested attention impl must run on this machine (before any model is
    built): ConfigError naming what it needs and what runs here."""
    from csa_jax import registry

    impl = cfg.model.attention.impl
    if impl == "auto":
        return
    why = registry.get(impl).cannot_run_here()
    if why is not None:
        raise ConfigError(f"{why}; runnable here: auto, {', '.join(registry.available_impls())}")


def check_room(workdir, state) -> None:
    """Before any work: the workdir's disk must hold at least one checkpoint of this run (its
    uncompressed size) and the logs (CheckpointError if not)."""
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) + 2**20
    try:
        free = free_bytes(workdir)
    except OSError:
        return
    if free < need:
        raise CheckpointError(f"--workdir {str(workdir)!r} has {free / 1e6:.1f} MB free and one "
                              f"checkpoint of this run needs about {need / 1e6:.1f} MB: make "
                              f"room or use another --workdir")


def _device_memory() -> tuple[int | None, str]:
    """(bytes, what) of the first device's memory: the allocator's limit on an accelerator, the
    machine's RAM (or its cgroup limit, if lower) on a CPU."""
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return (int(limit) if limit else None), f"the {dev.device_kind} has"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None, ""
    try:
        cg = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cg.isdigit():
            ram = min(ram, int(cg))
    except OSError:
        pass
    return ram, "this machine has"


def _gb(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e6:.1f} MB"


def check_memory(cfg: TrainConfig, runner, state) -> None:
    """Before compiling: refuse a step that cannot fit the device (ConfigError with the bytes,
    the device's memory and what to lower). Traces the step (jit's cache keeps the trace for
    the first call) and takes its largest array, not counting broadcasts and iotas (XLA fuses
    those into their users), plus the train state: a lower bound of what the step needs at
    once. One device only (fsdp off)."""
    if cfg.fsdp != "off":
        return
    trace = getattr(runner.step, "trace", None)  # a jitted step (not a test's stand-in)
    limit, where = _device_memory()
    if trace is None or not limit:
        return
    batch = tuple(jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32) for _ in range(2))
    jaxpr = trace(state, batch).jaxpr
    largest, shape = 0, None
    todo = [jaxpr.jaxpr]
    while todo:
        jx = todo.pop()
        for eqn in jx.eqns:
            if eqn.primitive.name not in ("broadcast_in_dim", "iota"):
                for v in eqn.outvars:
                    a = v.aval
                    n = int(np.prod(getattr(a, "shape", ()))) * getattr(a, "dtype", np.int8).itemsize
                    if n > largest:
                        largest, shape = n, a.str_short()
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else (p,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        todo.append(sub)
    resident = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    need = resident + largest
    if need > limit:
        raise ConfigError(
            f"this step needs at least {_gb(need)} (its largest array is {shape}, "
            f"{_gb(largest)}, beside {_gb(resident)} of parameters and optimizer state) and "
            f"{where} {_gb(limit)}: lower --seq-len ({cfg.seq_len}) or --batch-size "
            f"({cfg.batch_size}), or use a smaller --preset or --layers schedule")


def train_and_evaluate(cfg: TrainConfig, workdir, *, progress: bool = True,
                       log=print, profile_steps=None) -> RunResult:
    """Train `cfg` in `workdir`, resuming from its newest checkpoint that verifies.

    profile_steps: (A, B) writes a jax.profiler trace of steps A..B to workdir/profile
    (train.profile).

    Returns a RunResult; on SIGINT / SIGTERM the run saves a checkpoint of the current step and
    returns status "interrupted" (the CLI then exits with 128 + the signal number); a second
    signal exits at once (train.interrupt). A NaN / infinite loss raises DivergedError after
    metrics.jsonl and loss.png are written.
    """
    log = distributed.main_only(log)  # processes other than 0 write no logs, metrics or plots
    check_parallel(cfg)
    check_impl(cfg)
    workdir, created = prepare_workdir(workdir)
    lock = WorkdirLock(workdir, jax.process_index())
    try:
        lock.acquire()
    except BaseException:
        remove_if_unused(created)
        raise
    started = False
    try:
        if lock.note:
            log(lock.note)
        data = ByteDataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                           seed=cfg.seed, max_bytes=cfg.max_corpus_bytes,
                           eval_fraction=cfg.eval_fraction, encoding=cfg.data_encoding)
        log(f"data: {data.summary()}")
        graphdef, state, tx, schedule = init_state(cfg)
        check_room(workdir, state)
        ckpt = Checkpointer(workdir / "checkpoints", keep=cfg.keep_checkpoints)
        try:
            def on_start():
                nonlocal started
                started = True
            return _run(cfg, workdir, data, graphdef, state, tx, schedule, ckpt, progress, log,
                        profile_steps, on_start)
        finally:
            ckpt.close()  # on every path: an unclosed manager spews asyncio errors at exit
    finally:
        lock.release()
        if not started:  # a failed start: leave no empty workdir behind
            try:
                (workdir / "checkpoints").rmdir()
            except OSError:
                pass
            remove_if_unused(created, names=[lock.name])


def _check_meta(cfg, workdir, data):
    def check(step, meta):
        diff = _config_diff(meta.get("config", {}), cfg.to_json())
        if diff:
            raise ConfigError(f"--workdir {str(workdir)!r} holds a run with other settings ("
                              + "; ".join(diff) + "); rerun with the same flags or use a new --workdir")
        if meta.get("data_fingerprint") != data.fingerprint:
            raise ConfigError(f"the training data differs from the data of the run saved in "
                              f"{str(workdir)!r}; rerun with the same --data or use a new --workdir")
        if meta.get("batches_consumed", step) != step:
            raise CheckpointError(f"checkpoint {step} records data position "
                                  f"{meta.get('batches_consumed')} != its step {step}")
    return check


def _run(cfg, workdir, data, graphdef, state, tx, schedule, ckpt, progress, log, profile_steps,
         on_start):
    runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
    data = distributed.process_share(data, runner)  # several processes: each reads its rows
    plot = distributed.main_only(plot_losses)
    n_params = count_params(state["params"])
    # Restore straight into this run's layout (whatever layout the checkpoint was saved from).
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            state, runner.shardings(state))
    resume = ckpt.restore_newest(abstract, check_meta=_check_meta(cfg, workdir, data), log=log)
    start = 0
    if resume is not None:
        start, state, _ = resume
        if start >= cfg.steps:
            plot(workdir)
            log(f"nothing to do: {workdir} already holds step {start} >= --steps {cfg.steps}")
            return RunResult("already_done", start, {}, {})
        log(f"resuming from step {start} in {workdir}")
    state = runner.put(state)  # the device layout from here on
    check_memory(cfg, runner, state)
    eval_batches = [runner.batch(b) for b in data.eval_batches(cfg.eval_batches)]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.seq_len)
    if start == 0:
        log(f"model: {n_params / 1e6:.2f}M parameters, layers "
            f"{['cr%d' % r for r in cfg.model.layer_ratios]}; {data.n_train} train / "
            f"{data.n_eval} eval sequences; workdir {workdir}")
    meta_now = {"config": cfg.to_json(), "data_fingerprint": data.fingerprint}
    stop = StopFlag(where=f" in {ckpt.directory}")
    stop.last_saved = resume[0] if resume is not None else None


    def save(step):
        # `stop.saving` is the step being written (train.interrupt reports it as cut short),
        # `stop.last_saved` the newest complete one.
        if stop.saving is not None:  # the previous background write must finish first
            finish_saves()
        stop.saving = step
        try:
            ckpt.save(step, runner.get(state), {**meta_now, "batches_consumed": step,
                                                "step": step})
        except CheckpointError as e:
            stop.saving = None
            raise _with_last(e, stop, ckpt) from None
        if jax.process_count() == 1:
            # One process: wait, so that a second Ctrl-C can say exactly what is on disk.
            # Several processes: the write goes on in the background (orbax's async save).
            finish_saves()

    def finish_saves():
        try:
            ckpt.wait()
        except CheckpointError as e:
            stop.saving = None
            raise _with_last(e, stop, ckpt) from None
        if stop.saving is not None:
            stop.saving, stop.last_saved = None, stop.saving

    on_start()  # from here on the workdir holds this run's outputs
    writer = (MetricsWriter if distributed.is_main() else distributed.NullWriter)(
        workdir, start_step=start, total_steps=cfg.steps, progress=progress)
    prof = StepProfiler(profile_steps, workdir / "profile", log=writer.message)
    losses, eval_losses = {}, {}
    status, signum = "done", None
    step = start
    t_last, step_last = time.perf_counter(), start
    try:
        with stop:
            while step < cfg.steps:
                batch = runner.batch(data.batch(step))
                with prof.annotation(step + 1):
                    state, metrics = runner.step(state, batch)
                step += 1
                prof.after(step, state, runner, batch)
                writer.advance()
                if step % cfg.log_every == 0 or step == cfg.steps or step == start + 1:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    tps = tokens_per_step * (step - step_last) / max(now - t_last, 1e-9)
                    t_last, step_last = now, step
                    losses[step] = m["loss"]
                    writer.write({"step": step, **m, "tokens_per_sec": tps,
                                  "model_tflops_per_sec": tps * flops_per_token / 1e12})
                    if not np.isfinite(m["loss"]):
                        finish_saves()
                        last = (f"the last checkpoint is step {stop.last_saved} "
                                f"({str(ckpt.path(stop.last_saved))!r})"
                                if stop.last_saved is not None else
                                "no checkpoint was saved, so a rerun starts over")
                        raise DivergedError(f"the loss became {m['loss']} at step {step}; "
                                            f"{last} (try a lower --lr)")
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    ev = float(np.mean([float(runner.eval(state, b)) for b in eval_batches]))
                    eval_losses[step] = ev
                    writer.write({"step": step, "eval_loss": ev})
                    t_last = time.perf_counter()  # eval time is not training throughput
                if step % cfg.ckpt_every == 0 or step == cfg.steps:
                    save(step)
                    t_last = time.perf_counter()
                if stop.signum is None and ckpt.reached_preemption(step):
                    stop.signum = signal.SIGTERM  # every process: save this step, then stop
                if stop.signum is not None:
                    signum = stop.signum
                    status = "interrupted"
                    break
            if step not in (stop.saving, stop.last_saved):  # not saved yet
                save(step)
            finish_saves()
    except DivergedError:
        writer.close()
        plot(workdir)
        raise
    finally:
        prof.stop()
        writer.close()
    plot(workdir)
    if status == "interrupted":
        name = signal.Signals(signum).name
        log(f"{name}: saved a checkpoint at step {step} in {workdir}; rerun the same command "
            f"to resume")
    else:
        last = losses.get(step)
        log(f"done: step {step}" + (f", loss {last:.4f}" if last is not None else "")
            + (f", eval loss {eval_losses[step]:.4f}" if step in eval_losses else "")
            + f"; metrics in {workdir / 'metrics.jsonl'}, plot in {workdir / 'loss.png'}")
    return RunResult(status, step, losses, eval_losses, signum)
