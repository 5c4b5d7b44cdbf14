"""How much of a host-timed forward is the kernel: three times of the same forward.

    python -m benchmarks.gluon_kernel_time [--families pro] [--ratios 4] [--seqs 4096]
        [--heads 16,32] [--impl gluon] [--config key=val,...] [--window-layouts] [--check] [--calls 20]
        [--out times.json]

For each problem (the bench_csa problems: random cr4 indices, V4 index builders otherwise):
- synced: median of single calls of jax.jit(forward), each followed by block_until_ready (what
  bench_csa.py reports: the padding / ntiles ops, the launch and the host sync included);
- pipelined: `--calls` calls enqueued back to back, one block_until_ready, divided by the
  count (the device time per forward, launch latency hidden behind the previous call);
- kernel (impl gluon only): the same, of the forward kernel alone on operands prepared
  beforehand (ring.prepare outside the timed function: fwd.csa_fwd_kernel; under the cr0
  promise, --window-layouts, window.forward with the promise-violation flags computed
  beforehand: its padding is a no-op at Pro / Flash shapes).
--window-layouts gives the cr0 and cr128 problems their layout promise, as the NNX layer does
(csa_jax.Layout("cr0" / "cr128", window, pool_ratio) into the impl's default_config): cr0 runs
gluon's window kernel, cr128 the gather kernel (its promise changes no kernel). --config
overrides fields of the impl's Config (gluon: block_k, stages).
--check adds err_o / err_lse (max-abs error over max-abs, f32) of the timed forward's outputs
against impl="xla" on the same problem.
FlashMLA's targets (../shared/gpu_kernels.md) do not say how they were timed; these three
bound what a like-for-like comparison can be.

--breakdown (any impl): instead, where a step's device time goes: `--calls` steps (forward +
backward with both cotangents, bench_csa's step) under jax.profiler, and each GPU kernel's own
time per step (the trace parsed by benchmarks/trace_breakdown.py), largest first, with the sum
and the step's pipelined time beside it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp

import csa_jax
from benchmarks.common import apply_overrides, make_problem, parse_overrides, time_fn
from csa_jax import registry
from csa_jax.problems import INDEX_MODES


def _pipelined(fn, args, calls):
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls * 1e3


def _kernel_fn(q, kv, idx, sink, scale, config):
    """(jitted kernel-only function, its operands) of the Gluon forward: the gather kernel's
    launch on its prepared operands (fwd.kernel_call, or at H <= 32 small_heads.kernel_call),
    or under the cr0 promise window.forward
    on a precomputed all-good `bad` (the jitted forward computes it from idx:
    layouts.violations)."""
    from csa_jax.kernels.gluon import fwd, small_heads
    from csa_jax.kernels.gluon.dims import small_heads_block
    if config.runs_window_kernel(q.shape[2]):
        from csa_jax.kernels.gluon import window
        fn = jax.jit(lambda q, kv, s, bad: window.forward(q, kv, s, bad, scale=scale,
                                                          window=config.window))
        bad = jnp.zeros(idx.shape[:2], jnp.int32)
        return fn, jax.block_until_ready((q, kv, sink, bad))
    hn = small_heads_block(q.shape[2])
    if hn:                        # H <= 32: the few-heads kernel (small_heads.py)
        launch, operands, _ = small_heads.kernel_call(q, kv, idx, sink, scale=scale, HN=hn,
                                                      stages=config.stages,
                                                      consumers=config.fwd_consumers)
    else:
        launch, operands, _ = fwd.kernel_call(q, kv, idx, sink, scale=scale, config=config)
    return jax.jit(launch), jax.block_until_ready(operands)


def _step_breakdown(mod, config, scale, a, args):
    """{step_pipelined_ms, kernels: [(name, ms per step, launches per step)], kernels_sum_ms}
    of bench_csa's step under jax.profiler (`--calls` steps traced after a warm one)."""
    import tempfile
    from benchmarks.bench_csa import build_fns
    from benchmarks.trace_breakdown import load_events
    _, _, step = build_fns(mod, config, scale, False)
    ms = _pipelined(step, a, args.calls)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(args.calls):
                out = step(*a)
            jax.block_until_ready(out)
        events, _, planes = load_events(d)
    per = {}
    for _, self_ns, _, name, _, _ in events:
        t, n = per.get(name, (0.0, 0))
        per[name] = (t + self_ns, n + 1)
    kernels = sorted(((k, t / args.calls / 1e6, n / args.calls) for k, (t, n) in per.items()),
                     key=lambda r: -r[1])
    return dict(step_pipelined_ms=ms, planes=planes, kernels_sum_ms=sum(r[1] for r in kernels),
                kernels=kernels)


def _print_breakdown(row, top):
    print(f"\n## {row['family']} cr{row['ratio']} T={row['T']} H={row['H']} {row['impl']}: "
          f"step {row['step_pipelined_ms']:.3f} ms pipelined, kernels {row['kernels_sum_ms']:.3f}"
          f" ms (own time per step)")
    print("| kernel | ms / step | launches / step |\n|---|---|---|")
    for name, ms, n in row["kernels"][:top]:
        print(f"| {name[:90]} | {ms:.3f} | {n:g} |")


def _errors(out, ref):
    """err_o, err_lse: max |a - b| / max |b| in f32 (the forward's outputs vs the reference's)."""
    err = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                             / jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-30))
    return dict(err_o=err(out[0], ref[0]), err_lse=err(out[1], ref[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    csv = lambda f: lambda s: [f(v) for v in s.split(",") if v]
    ap.add_argument("--families", type=csv(str), default=["pro"])
    ap.add_argument("--ratios", type=csv(int), default=[4])
    ap.add_argument("--seqs", type=csv(int), default=[4096])
    ap.add_argument("--heads", type=csv(int), default=[None],
                    help="H per device (tensor parallelism), e.g. 16,32; default: the family's")
    ap.add_argument("--impl", default="gluon")
    ap.add_argument("--indices", default="random", choices=INDEX_MODES,
                    help="cr4 index mode (csa_jax.problems.INDEX_MODES): random (default), "
                         "unique (random without repeats in a token), causal")
    ap.add_argument("--config", default="", help="Config overrides: key=val,...")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--window-layouts", action="store_true",
                    help="cr0 / cr128 problems with their layout promise, as the NNX layer "
                         "passes it (cr0: gluon's window kernel); --config still applies")
    ap.add_argument("--check", action="store_true", help="err_o / err_lse vs impl='xla'")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-kernel device time of a whole step (fwd + bwd) instead")
    ap.add_argument("--top", type=int, default=12, help="--breakdown: kernels listed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    mod = registry.get(args.impl)
    rows = []
    for family in args.families:
        for ratio in args.ratios:
            for T, heads in itertools.product(args.seqs, args.heads):
                cfg, q, kv, idx, sink, do = make_problem(family, ratio, T, args.indices, 0, heads)
                promise = None
                if args.window_layouts and ratio in (0, 128):
                    if not mod.takes_layout:
                        raise ValueError(f"--window-layouts: impl {args.impl!r} takes no "
                                         f"layout promise")
                    promise = csa_jax.Layout(f"cr{ratio}", window=cfg.window,
                                             pool_ratio=ratio or 128)
                c = mod.default_config(q.shape, kv.shape, idx.shape, q.dtype, promise)
                c = apply_overrides(mod, c, q.shape, parse_overrides(args.config))
                if args.breakdown:
                    row = _step_breakdown(mod, c, cfg.scale, (q, kv, idx, sink, do), args)
                    row.update(family=family, ratio=ratio, T=T, H=q.shape[2], impl=args.impl,
                               config=repr(c), device=jax.devices()[0].device_kind)
                    print(json.dumps(row), flush=True)
                    _print_breakdown(row, args.top)
                    rows.append(row)
                    continue
                fwd = jax.jit(lambda q, kv, i, s, c=c: mod.forward(
                    q, kv, i, s, scale=cfg.scale, interpret=False, config=c))
                a = (q, kv, idx, sink)
                synced, _, first, out = time_fn(fwd, a, args.calls, 10.0)
                # o_finite: a window layout's broken promise would show as NaN rows
                row = dict(family=family, ratio=ratio, T=T, H=q.shape[2], impl=args.impl, config=repr(c),
                           device=jax.devices()[0].device_kind, synced_ms=synced,
                           pipelined_ms=_pipelined(fwd, a, args.calls), first_call_s=first,
                           o_finite=bool(jnp.isfinite(out[0]).all()))
                if args.check:
                    ref = registry.get("xla")
                    row.update(_errors(out, jax.jit(lambda q, kv, i, s: ref.forward(
                        q, kv, i, s, scale=cfg.scale, interpret=False, config=ref.default_config(
                            q.shape, kv.shape, i.shape, q.dtype)))(*a)))
                if args.impl == "gluon":
                    try:
                        kfn, ka = _kernel_fn(q, kv, idx, sink, cfg.scale, c)
                        row["kernel_pipelined_ms"] = _pipelined(kfn, ka, args.calls)
                    except Exception as e:  # noqa: BLE001
                        row["kernel_error"] = f"{type(e).__name__}: {e}"[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
