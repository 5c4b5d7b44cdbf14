"""Where a window-kernel forward's time goes (NVIDIA Hopper): the kernel vs its wrapper.

    python -m benchmarks.gluon_window_time [--shapes pro:0:4096,...] [--schedules exchange,...]
        [--reps 20] [--out times.json]

For each shape (family:ratio:T, the V4 inputs of benchmarks/bench_csa.py) and each window
schedule (Config.win_schedule; "gather" = the default gather kernel, layout generic; "+key=val"
appends Config overrides, e.g. "exchange+win_ablate=1") it times
  traced  jit(impl.forward) with idx traced: what bench_csa.py times (the promise check
          csa_jax/layouts.violations in XLA + the kernel);
  kernel  jit(window.forward) with a precomputed all-false `bad`: the kernel and its padding
          only (not for "gather");
  check   jit(layouts.violations) alone (once per shape);
each as the median of per-call synchronised runs (`ms`) and as the mean of `reps` back-to-back
calls with one sync (`ms_pipelined`: host dispatch overlapped, closest to the kernel's own time),
and o / lse of each schedule against the first one's on the same inputs (max-abs error over
max-abs; the first is "gather" by default, the gather kernel checked against xla elsewhere).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.common import make_problem, parse_overrides, time_fn


def rel_err(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def pipelined(fn, args, reps):
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t) / reps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="pro:0:4096")
    ap.add_argument("--schedules", default="gather,lockstep,exchange")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--plan", default="",
                    help="instead of --shapes x --schedules: 'shape=sched,sched;shape=sched,...'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    plan = ([(p.split("=", 1)[0], p.split("=", 1)[1].split(","))
             for p in args.plan.split(";") if p] if args.plan else
            [(spec, args.schedules.split(",")) for spec in args.shapes.split(",")])
    from csa_jax import layouts
    from csa_jax.kernels import gluon as impl
    from csa_jax.kernels.gluon import window
    rows = []
    for spec, schedules in plan:
        family, ratio, T = spec.split(":")
        cfg, q, kv, idx, sink, _ = make_problem(family, int(ratio), int(T), "causal", 0)
        layout = f"cr{int(ratio)}"
        scale = cfg.scale
        chk = jax.jit(lambda i: layouts.violations(i, layout, 128, 128))
        row = dict(shape=spec, schedule="check", ms=time_fn(chk, (idx,), args.reps, 2.0)[0],
                   ms_pipelined=pipelined(chk, (idx,), args.reps))
        rows.append(row)
        print(json.dumps(row), flush=True)
        base = impl.default_config(q.shape, kv.shape, idx.shape, q.dtype)
        ref = None
        for name in schedules:
            sched, *extra = name.split("+")        # e.g. exchange+win_ablate=1
            over = dict(layout="generic") if sched == "gather" else dict(
                layout=layout, win_schedule=sched, **({"win_regs": 224} if sched == "overlap"
                                                      else {}))
            over.update(parse_overrides(",".join(extra)))
            c = dataclasses.replace(base, **over)
            row = dict(shape=spec, schedule=name)
            try:
                f = jax.jit(lambda q, kv, i, s, c=c: impl.forward(
                    q, kv, i, s, scale=scale, interpret=False, config=c))
                ms, _, _, (o, lse) = time_fn(f, (q, kv, idx, sink), args.reps, 2.0)
                row.update(traced_ms=ms,
                           traced_ms_pipelined=pipelined(f, (q, kv, idx, sink), args.reps))
                if ref is None:
                    ref = (o, lse)
                elif c.win_ablate:
                    pass            # wrong results by design
                else:       # the same inputs: each schedule against the first one
                    row.update(err_o_vs_first=rel_err(o, ref[0]),
                               err_lse_vs_first=rel_err(lse, ref[1]),
                               nan=bool(jnp.isnan(o).any() | jnp.isnan(lse).any()))
                if sched != "gather":
                    bad = jnp.zeros(idx.shape[:2], jnp.int32)
                    k = jax.jit(lambda q, kv, s, bd, c=c: window.forward(
                        q, kv, s, bd, scale=scale, config=c))
                    row.update(kernel_ms=time_fn(k, (q, kv, sink, bad), args.reps, 2.0)[0],
                               kernel_ms_pipelined=pipelined(k, (q, kv, sink, bad), args.reps))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
