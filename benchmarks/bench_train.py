"""Training throughput of the train/ stack: tokens/s and model FLOP utilisation per impl.

    python -m benchmarks.bench_train                       # small preset, T=8192, xla + best kernel
    python -m benchmarks.bench_train --impls xla,pallas_triton --seq-len 8192 --batch-size 1

Times full optimizer steps (forward, backward, AdamW; bf16 compute, f32 master weights) on
random bytes, after a warm-up whose first step is the compilation (reported as compile_s). MFU =
model FLOPs per token (train/flops.py: 6 x trained matmul weights, the indexer forward only,
the attention core at nominal slots by the csa_spec.md section 3 convention, and again at the
causally valid slots: mfu_valid) x tokens/s / the device's peak bf16 dense FLOP/s
(--peak-tflops; default 989 for H100/H200 SXM). Prints a markdown table and writes JSON (--out).

--profile DIR: after timing, trace 3 more steps of each impl with jax.profiler into DIR/<impl>
and write the step's compiled HLO beside it (python -m benchmarks.trace_breakdown DIR/<impl>
makes the table).

--variants 'NAME:k=v,k=v; NAME2:k=v': besides the preset as it is ("default"), time each impl
with these model / attention field overrides (ModelConfig.replace), e.g.
`scan:scan_layers=true; dots:remat=dots`, in one process (one start-up for all). Profiles of a
variant go to DIR/<impl>-<NAME> (with --profile-variants; by default only the default is
traced). Keys `config.<field>` override fields of the attention impl's
default Config instead (e.g. `w4:config.num_warps=4` for pallas_triton): the impl module's
default_config is wrapped for that variant's run only (an impl whose Config lacks such a field
skips the variant). Every run starts from cleared jit caches, so a variant's step is traced
with its overrides (a cached step of an earlier run would ignore them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import parse_variants
from train.config import get_preset
from train.flops import step_flops
from train.loop import init_state
from train.model import count_params
from train.parallel import make_runner


def best_impl(preset, seq_len, batch_size, dtype, model=None) -> str:
    """What impl="auto" runs for this model on this platform: the registry's choice for every
    layer type's attention shapes (csa_jax.registry.resolve asks each kernel's unsupported():
    gluon is not picked for H = 16 / D = 128, for instance). "auto" when the layer types resolve
    to different impls (the run then uses impl="auto")."""
    from csa_jax import registry

    model = {k: v for k, v in (model or {}).items() if not k.startswith("config.")}
    cfg = get_preset(preset, model=dict(model, compute_dtype=dtype), seq_len=seq_len,
                     batch_size=batch_size)
    a, T, B = cfg.model.attention, seq_len, batch_size
    picked = set()
    for r in set(cfg.model.layer_ratios):
        P = T // r if r else 0
        K = a.window + (min(a.topk, P) if r == 4 else P)
        picked.add(registry.resolve("auto", (B, T, a.num_heads, a.head_dim),
                                    (B, T + P, a.head_dim), (B, T, K), dtype,
                                    jax.default_backend()).name)
    return picked.pop() if len(picked) == 1 else "auto"


class SkipVariant(Exception):
    """A variant that does not apply to an impl (a config key its Config lacks)."""


@contextlib.contextmanager
def impl_config(impl, over):
    """Within the block, impl's default_config returns its default with `over` replaced."""
    if not over:
        yield
        return
    from csa_jax import registry

    mod = registry.get(impl).mod
    orig = mod.default_config
    mod.default_config = lambda *a, **k: dataclasses.replace(orig(*a, **k), **over)
    try:
        yield
    finally:
        mod.default_config = orig


def bench(preset, impl, seq_len, batch_size, steps, warmup, dtype, profile=None, model=None,
          variant="default"):
    model = dict(model or {})
    conf = {k.removeprefix("config."): model.pop(k) for k in list(model)
            if k.startswith("config.")}
    if conf:
        from csa_jax import registry
        fields = {f.name for f in dataclasses.fields(registry.get(impl).mod.Config)}
        if set(conf) - fields:
            raise SkipVariant(f"{impl}'s Config has no field {sorted(set(conf) - fields)}")
    jax.clear_caches()
    with impl_config(impl, conf):
        return _bench(preset, impl, seq_len, batch_size, steps, warmup, dtype, profile, model,
                      variant, conf)


def _bench(preset, impl, seq_len, batch_size, steps, warmup, dtype, profile, model, variant,
           conf):
    cfg = get_preset(preset, model=dict(model or {}, impl=impl, compute_dtype=dtype),
                     seq_len=seq_len, batch_size=batch_size, steps=warmup + steps + 1, warmup_steps=1)
    graphdef, state, tx, schedule = init_state(cfg)
    n_params = count_params(state["params"])
    runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
    state = runner.put(state)
    rng = np.random.default_rng(0)
    batches = [runner.batch((x, np.roll(x, -1, axis=1)))
               for x in (rng.integers(0, 256, (batch_size, seq_len), dtype=np.int32) for _ in range(2))]
    t0 = time.perf_counter()
    state, m = runner.step(state, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0  # the first step: compilation + one step
    for i in range(1, warmup):
        state, m = runner.step(state, batches[i % 2])
    jax.block_until_ready(m)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = runner.step(state, batches[i % 2])
    loss = float(m["loss"])  # waits for the last step
    dt = (time.perf_counter() - t0) / steps
    tps = batch_size * seq_len / dt
    # printed before the profile, so a time limit during it still leaves the figure in the log
    print(f"timed {impl} ({variant}): {dt * 1e3:.2f} ms/step over {steps} steps, "
          f"compile {compile_s:.1f} s", file=sys.stderr, flush=True)
    if profile:
        from train.profile import StepProfiler

        name = impl if variant == "default" else f"{impl}-{variant}"
        prof = StepProfiler((1, 3), Path(profile) / name, log=lambda s: print(s, file=sys.stderr))
        for i in range(1, 4):
            with prof.annotation(i):
                state, m = runner.step(state, batches[i % 2])
            prof.after(i, state, runner, batches[i % 2])
    fl = step_flops(cfg.model, seq_len)
    return dict(preset=preset, impl=impl, variant=variant, model_overrides=dict(model or {}),
                config_overrides=conf,
                seq_len=seq_len, batch_size=batch_size, dtype=dtype,
                params_m=n_params / 1e6, step_ms=dt * 1e3, tokens_per_sec=tps,
                model_tflops=tps * fl["nominal"] / 1e12,
                model_tflops_valid=tps * fl["valid"] / 1e12,
                flops_per_token=fl, compile_s=compile_s, warmup_s=warmup_s, loss=loss,
                layers=list(cfg.model.layer_ratios))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--impls", default="xla,best", help="comma list; 'best' = the platform's kernel")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak bf16 dense TFLOP/s of the device (H100/H200 SXM: 989)")
    p.add_argument("--out", default="docs/perf/train_small.json")
    p.add_argument("--profile", metavar="DIR", help="trace 3 steps of each impl into DIR/<impl>")
    p.add_argument("--variants", default="", metavar="'NAME:k=v,...; ...'",
                   help="model-field overrides timed besides the default (see the module doc)")
    p.add_argument("--profile-variants", action="store_true",
                   help="with --profile: trace the variants too (default: only 'default')")
    args = p.parse_args()

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    meta = dict(device=str(jax.devices()[0].device_kind), date=datetime.date.today().isoformat(),
                commit=commit, jax=jax.__version__, peak_tflops=args.peak_tflops)

    def write():  # after every row: a time limit still leaves what ran
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=2))

    rows = []
    for variant, over in parse_variants(args.variants):
        for group in args.impls.split(","):
            for impl in ([best_impl(args.preset, args.seq_len, args.batch_size, args.dtype, over)]
                         if group == "best" else [group]):
                try:
                    r = bench(args.preset, impl, args.seq_len, args.batch_size, args.steps,
                              args.warmup, args.dtype, model=over, variant=variant,
                              profile=args.profile if (variant == "default"
                                                       or args.profile_variants) else None)
                except SkipVariant as e:
                    print(f"{impl} ({variant}): skipped: {e}", file=sys.stderr)
                    continue
                except Exception as e:  # report and go on with the next candidate
                    print(f"{impl} ({variant}): failed: {type(e).__name__}: {str(e)[:300]}",
                          file=sys.stderr)
                    continue
                r["mfu"] = r["model_tflops"] / args.peak_tflops
                r["mfu_valid"] = r["model_tflops_valid"] / args.peak_tflops
                rows.append(r)
                write()
                print(f"{impl} ({variant}): {r['step_ms']:.1f} ms/step, "
                      f"{r['tokens_per_sec']:.0f} tok/s, "
                      f"MFU {100 * r['mfu']:.1f}%, compile {r['compile_s']:.1f} s", file=sys.stderr)
                break

    base = next((r for r in rows if r["impl"] == "xla"), None)
    print("\n| preset | impl | variant | T | B | step ms | tokens/s | model TFLOP/s | MFU | "
          "MFU (valid) | compile s | vs xla |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r['tokens_per_sec'] / base['tokens_per_sec']:.2f}x" if base else "-"
        print(f"| {r['preset']} | {r['impl']} | {r['variant']} | {r['seq_len']} | "
              f"{r['batch_size']} | "
              f"{r['step_ms']:.1f} | {r['tokens_per_sec']:.0f} | {r['model_tflops']:.1f} | "
              f"{100 * r['mfu']:.1f}% | {100 * r['mfu_valid']:.1f}% | {r['compile_s']:.1f} | "
              f"{speed} |")
    write()
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
