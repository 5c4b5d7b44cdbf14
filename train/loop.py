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
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, TrainConfig
from train.data import ByteDataset
from train.metrics import MetricsWriter, plot_losses
from train.model import DecoderLM, count_params
from train.parallel import check_parallel, make_runner
from train.profile import StepProfiler

__all__ = ["DivergedError", "RunResult", "init_state", "make_optimizer", "train_and_evaluate"]

# Fields that may differ when a run resumes (they do not change the numbers of later steps,
# except `steps`, which is the run's total length and so shapes the LR schedule's tail).
_RESUMABLE_CHANGES = {"steps", "log_every", "eval_every", "eval_batches", "ckpt_every",
                      "keep_checkpoints", "model.attention.impl", "model.remat", "fsdp"}


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


class DivergedError(RuntimeError):
    """The loss became NaN or infinite (reported by the CLI without a traceback)."""


@dataclasses.dataclass
class RunResult:
    status: str  # "done" | "interrupted" | "already_done"
    step: int
    losses: dict  # step -> train loss (this invocation's steps)
    eval_losses: dict
    signal: int | None = None


class _StopFlag:
    """SIGINT / SIGTERM set a flag; the loop saves at the next step boundary and stops.
    A second signal gets the default behaviour (a hard stop)."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers
                pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _config_diff(saved: dict, now: dict, prefix="") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        name = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, prefix=name + ".")
        elif (list(a) if isinstance(a, (list, tuple)) else a) != \
                (list(b) if isinstance(b, (list, tuple)) else b) and name not in _RESUMABLE_CHANGES:
            out.append(f"{name}: saved {a!r}, now {b!r}")
    return out


def train_and_evaluate(cfg: TrainConfig, workdir, *, progress: bool = True,
                       log=print, profile_steps=None) -> RunResult:
    """Train `cfg` in `workdir`, resuming from its latest checkpoint if there is one.

    profile_steps: (A, B) writes a jax.profiler trace of steps A..B to workdir/profile
    (train.profile).

    Returns a RunResult; on SIGINT / SIGTERM the run saves a checkpoint of the current step and
    returns status "interrupted" (the CLI then exits with 128 + the signal number).
    """
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {str(workdir)!r} exists and is not a directory")
    check_parallel(cfg)
    workdir.mkdir(parents=True, exist_ok=True)
    data = ByteDataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                       max_bytes=cfg.max_corpus_bytes, eval_fraction=cfg.eval_fraction)
    graphdef, state, tx, schedule = init_state(cfg)
    ckpt = Checkpointer(workdir / "checkpoints", keep=cfg.keep_checkpoints)
    meta_now = {"config": cfg.to_json(), "data_fingerprint": data.fingerprint}
    start = ckpt.latest_step()
    if start is not None:
        meta = ckpt.read_meta(start)
        diff = _config_diff(meta.get("config", {}), cfg.to_json())
        if diff:
            raise ConfigError(f"--workdir {str(workdir)!r} holds a run with other settings ("
                              + "; ".join(diff) + "); rerun with the same flags or use a new --workdir")
        if meta.get("data_fingerprint") != data.fingerprint:
            raise ConfigError(f"the training data differs from the data of the run saved in "
                              f"{str(workdir)!r}; rerun with the same --data or use a new --workdir")
        if meta.get("batches_consumed", start) != start:
            raise CheckpointError(f"checkpoint {start} records data position "
                                  f"{meta.get('batches_consumed')} != its step {start}")
    start = start or 0
    if start >= cfg.steps:
        ckpt.close()
        plot_losses(workdir)
        log(f"nothing to do: {workdir} already holds step {start} >= --steps {cfg.steps}")
        return RunResult("already_done", start, {}, {})

    runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
    n_params = count_params(state["params"])
    if start:
        # Restore straight into this run's layout (whatever layout the checkpoint was saved from).
        abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                state, runner.shardings(state))
        state, _ = ckpt.restore(start, abstract)
        log(f"resuming from step {start} in {workdir}")
    state = runner.put(state)  # the device layout from here on
    eval_batches = [runner.batch(b) for b in data.eval_batches(cfg.eval_batches)]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.seq_len)
    if start == 0:
        log(f"model: {n_params / 1e6:.2f}M parameters, layers "
            f"{['cr%d' % r for r in cfg.model.layer_ratios]}; data: {data.n_files} files, "
            f"{data.n_bytes / 1e6:.1f} MB, {data.n_train} train / {data.n_eval} eval sequences; "
            f"workdir {workdir}")

    def save(step):
        ckpt.save(step, runner.get(state), {**meta_now, "batches_consumed": step, "step": step})

    writer = MetricsWriter(workdir, start_step=start, total_steps=cfg.steps, progress=progress)
    prof = StepProfiler(profile_steps, workdir / "profile", log=writer.message)
    losses, eval_losses = {}, {}
    status, signum = "done", None
    step = start
    saved_at = start
    t_last, step_last = time.perf_counter(), start
    try:
        with _StopFlag() as stop:
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
                        raise DivergedError(
                            f"the loss became {m['loss']} at step {step}; the last checkpoint "
                            f"is step {saved_at} in {workdir} (try a lower --lr)")
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    ev = float(np.mean([float(runner.eval(state, b)) for b in eval_batches]))
                    eval_losses[step] = ev
                    writer.write({"step": step, "eval_loss": ev})
                    t_last = time.perf_counter()  # eval time is not training throughput
                if step % cfg.ckpt_every == 0 or step == cfg.steps:
                    save(step)
                    saved_at = step
                    t_last = time.perf_counter()
                if stop.signum is not None:
                    signum = stop.signum
                    status = "interrupted"
                    break
        if saved_at != step:
            save(step)
    finally:
        prof.stop()
        writer.close()
        ckpt.close()
    plot_losses(workdir)
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
