"""`python -m train`: train a byte-level LM whose attention layers are CSA / HCA / SWA.

Every user mistake and environment fault (bad or empty flag value, missing data, unusable
sequence length, an impl that cannot run here, a size that cannot fit the device, an
uncreatable or unwritable workdir, a workdir in use by another run, a full disk, mismatched
checkpoints, no checkpoint that verifies, a diverged loss) ends with one `error:` line on stderr
naming the flag as typed, and exit code 2; an interrupted run (SIGINT / SIGTERM) says so at once,
saves a checkpoint and exits with 128 + the signal number (a second signal exits at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from train.config import PRESETS, ConfigError, TrainConfig, get_preset, parse_schedule


def preset_defaults(field: str) -> str:
    """'Default: tiny 200, small 2000, ...': each preset's value of a TrainConfig field."""
    base = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    values = {name: p.get(field, base[field]) for name, p in PRESETS.items()}
    if len(set(values.values())) == 1:
        return f"Default: {next(iter(values.values()))} (every preset)"
    return "Default: " + ", ".join(f"{name} {v}" for name, v in values.items())


EPILOG = """\
examples:
  python -m train                                   # tiny preset on CPU, ./runs/tiny
  python -m train --preset tiny --steps 50 --workdir /tmp/run1
  python -m train --data 'notes/**/*.md' --seq-len 512
  python -m train --preset small --impl pallas_triton --workdir runs/small   # one GPU

Rerunning the same command with the same --workdir resumes from the latest checkpoint and
reproduces the uninterrupted run exactly. Outputs in the workdir: checkpoints/, metrics.jsonl
(one JSON line per logged step), tb/ (TensorBoard), loss.png.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends to --impl's help the impls that run on this machine, asked only when the help is
    printed: the device check starts jax's backends, which must wait for
    jax.distributed.initialize in a multi-process run."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if action.dest == "impl":
            from csa_jax import registry

            text += f" Runnable here: auto, {', '.join(registry.available_impls())}."
        return text


# Flags of TrainConfig / ModelConfig fields: messages about a field name the flag instead.
FIELD_FLAGS = {
    "steps": "--steps", "batch_size": "--batch-size", "seq_len": "--seq-len", "seed": "--seed",
    "lr": "--lr", "warmup_steps": "--warmup-steps", "log_every": "--log-every",
    "eval_every": "--eval-every", "eval_batches": "--eval-batches", "ckpt_every": "--ckpt-every",
    "keep_checkpoints": "--keep", "fsdp": "--fsdp", "layer_ratios": "--layers",
    "compute_dtype": "--dtype", "indexer_loss_coef": "--indexer-loss-coef", "impl": "--impl",
    "data_encoding": "--data-encoding",
}
_FIELD_RE = re.compile(r"(?<![\w.\-'\"])(" + "|".join(FIELD_FLAGS) + r")=")


def flag_names(message: str) -> str:
    """`keep_checkpoints=0 must be ...` -> `--keep=0 must be ...`: a message about a config
    field, as the CLI user typed it (`--flag=value` is valid argparse syntax)."""
    return _FIELD_RE.sub(lambda m: FIELD_FLAGS[m.group(1)] + "=", message)


def build_parser() -> argparse.ArgumentParser:
    from csa_jax import registry      # the impl names (imports jax: --help takes a few seconds)

    p = argparse.ArgumentParser(
        prog="csa-train" if sys.argv[0].endswith("csa-train") else "python -m train",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog=EPILOG, formatter_class=_HelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="model size and defaults: tiny (CPU, minutes), small (~170M, one GPU), "
                        "v4-flash-layer / v4-pro-layer (real V4 widths, 4 layers, benchmarking). "
                        "Default: tiny")
    g.add_argument("--steps", type=int, help="total optimizer steps of the run (also the length "
                   "of the LR schedule); a resumed run continues up to this step. "
                   + preset_defaults("steps"))
    g.add_argument("--workdir", help="where checkpoints, metrics and plots go; an existing "
                   "workdir is resumed. Default: runs/<preset>")
    g.add_argument("--seed", type=int, help="seed of the init, data order and RNG. Default: 0")
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files, directories or globs ('docs/**/*.md') to train on, as raw "
                        "bytes. Default: this Python's standard library sources")
    g.add_argument("--batch-size", type=int, help="sequences per step. "
                   + preset_defaults("batch_size"))
    g.add_argument("--seq-len", type=int, help="tokens (bytes) per sequence; must be a multiple "
                   "of every compress ratio in the layer schedule. " + preset_defaults("seq_len"))
    g.add_argument("--data-encoding", choices=("utf-8", "any"), default="utf-8",
                   help="which files found in --data directories and globs are text: utf-8 "
                        "(default: other files are skipped, and the summary says so) or any "
                        "(every file without NUL bytes, e.g. Latin-1). A file named on its own "
                        "is taken whenever it has no NUL bytes")
    g.add_argument("--max-corpus-mb", type=float, help="read at most this many MB of text "
                   "(default 16)")
    g = p.add_argument_group("model")
    g.add_argument("--layers", metavar="SCHEDULE",
                   help="layer schedule: 'flash:N' / 'pro:N' (released pattern, N layers) or a "
                        "comma list of compress ratios, e.g. '0,0,4,128' (0 = sliding window, "
                        "4 = CSA, other m = HCA). Default: " + "; ".join(
                            f"{n} {','.join(map(str, p['model'].layer_ratios))}"
                            for n, p in PRESETS.items()))
    g.add_argument("--impl", choices=registry.choices(), default="auto",
                   help="sparse_attention implementation; auto = the best one for this "
                        "platform. Default: auto.")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (weights stay float32); auto = bfloat16 on GPU/TPU, "
                        "float32 on CPU")
    g.add_argument("--indexer-loss-coef", type=float,
                   help="weight of the auxiliary indexer KL loss on CSA layers (default 0)")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, help="peak learning rate of the warmup + cosine "
                   "schedule. " + preset_defaults("lr"))
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps before the cosine "
                   "decay. " + preset_defaults("warmup_steps"))
    g.add_argument("--fsdp", choices=("off", "xla", "explicit"), default="off",
                   help="shard params and optimizer state over all devices: xla (sharding "
                        "annotations, XLA schedules the collectives) or explicit (comm's "
                        "shard_map FSDP). Default: off")
    g.add_argument("--context-parallel", type=int, metavar="N", dest="context_parallel",
                   help="split each sequence over N devices (context parallelism, "
                        "docs/context_parallel.md); the devices / N groups split the batch "
                        "(with --fsdp xla they also shard params). seq_len must be a multiple "
                        "of N times every compress ratio. Default: 1")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-every", type=int, help="steps between metrics lines. "
                   + preset_defaults("log_every"))
    g.add_argument("--eval-every", type=int, help="steps between held-out eval losses. "
                   + preset_defaults("eval_every"))
    g.add_argument("--eval-batches", type=int, help="held-out batches per eval. "
                   + preset_defaults("eval_batches"))
    g.add_argument("--ckpt-every", type=int, help="steps between checkpoints. "
                   + preset_defaults("ckpt_every"))
    g.add_argument("--keep", type=int, dest="keep_checkpoints",
                   help="checkpoints to keep (default 3)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines only)")
    g.add_argument("--profile-steps", metavar="A:B", help="write a jax.profiler trace of steps "
                   "A..B (1-based, inclusive) and the step's HLO to <workdir>/profile; "
                   "python -m benchmarks.trace_breakdown turns it into a table by op family")
    g = p.add_argument_group(
        "multi-process (jax.distributed; see train/distributed.py)",
        "Run the same command once per host (or per local process) with --fsdp xla|explicit. "
        "Flags override JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; under "
        "Slurm, mpirun or on a multi-host TPU slice none is needed. Only process 0 writes "
        "metrics, plots and logs.")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="address of process 0's coordination service")
    g.add_argument("--num-processes", type=int, help="number of processes in the run")
    g.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1")
    return p


_POSITIVE = ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches",
             "ckpt_every", "keep_checkpoints")


def config_from_args(args):
    """TrainConfig from parsed flags (preset defaults for flags not given)."""
    import jax

    from csa_jax import registry

    if args.impl != "auto":
        why = registry.get(args.impl).cannot_run_here()
        if why is not None:
            why = why.removeprefix(f"impl={args.impl!r} ")
            raise ConfigError(f"--impl {args.impl} {why}; runnable here: auto, "
                              f"{', '.join(registry.available_impls())}")
    for field in _POSITIVE:  # flag values checked as typed, before any work
        v = getattr(args, field)
        if v is not None and v <= 0:
            raise ConfigError(f"{FIELD_FLAGS[field]} {v}: must be a positive integer")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps {args.warmup_steps}: must be >= 0")
    if args.lr is not None and not args.lr > 0:
        raise ConfigError(f"--lr {args.lr}: must be > 0")
    model = {"impl": args.impl}
    if args.layers is not None:
        try:
            model["layer_ratios"] = parse_schedule(args.layers)
        except ConfigError as e:  # "schedule 'x': ..." -> "--layers 'x': ..."
            raise ConfigError(re.sub(r"^schedule ", "--layers ", str(e))) from None
    if args.indexer_loss_coef is not None:
        model["indexer_loss_coef"] = args.indexer_loss_coef
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model["compute_dtype"] = dtype
    over = {k: getattr(args, k) for k in (
        "steps", "batch_size", "seq_len", "seed", "lr", "warmup_steps", "log_every",
        "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints", "fsdp", "data_encoding",
        "context_parallel")}
    if args.data is not None:
        for spec in args.data:
            if not spec.strip():
                raise ConfigError(f"--data {spec!r}: empty path")
        # Saved with the run as absolute paths, so a resume from another directory matches.
        over["data"] = tuple(os.path.abspath(os.path.expanduser(s)) for s in args.data)
    if args.max_corpus_mb is not None:
        if not args.max_corpus_mb > 0:
            raise ConfigError(f"--max-corpus-mb {args.max_corpus_mb} must be > 0")
        over["max_corpus_bytes"] = int(args.max_corpus_mb * 2**20)
    return get_preset(args.preset, model=model, **over)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after parsing so that --help and flag errors do not load the training stack.
    from train.checkpoint import CheckpointError
    from train.data import DataError
    from train.loop import DivergedError, train_and_evaluate
    from train.metrics import OutputError

    try:
        from train import distributed  # joins the other processes before jax picks a backend
        from train.profile import parse_profile_steps

        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        cfg = config_from_args(args)
        if args.workdir is not None and not args.workdir.strip():
            raise ConfigError("--workdir '': empty path")
        workdir = args.workdir or os.path.join("runs", args.preset)
        profile_steps = parse_profile_steps(args.profile_steps, cfg.steps)
        result = train_and_evaluate(cfg, workdir, progress=not args.no_progress,
                                    log=lambda s: print(s, file=sys.stderr, flush=True),
                                    profile_steps=profile_steps)
    except (ConfigError, DataError) as e:
        print(f"error: {flag_names(str(e))}", file=sys.stderr)
        return 2
    except (CheckpointError, DivergedError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the training loop (which handles signals) started
        print("interrupted before training started: nothing new was saved", file=sys.stderr)
        return 130
    if result.status == "interrupted":
        return 128 + (result.signal or 2)
    return 0
