"""Helpers the benchmark scripts share: the V4 problem, timing, variant specs, FLOPs."""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from csa_jax import problems
from csa_jax.config import forward_flops, preset


def heads_config(cfg, heads):
    """The layer config with H = heads (a tensor-parallel shard of its heads): o_groups, which
    must divide H and plays no part in the op, becomes gcd(o_groups, heads)."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"heads={heads!r} must be a positive int")
    return dataclasses.replace(cfg, num_heads=heads, o_groups=math.gcd(cfg.o_groups, heads))


def make_problem(family, ratio, T, idx_kind, seed, heads=None):
    """The V4 problem of csa_jax.problems (the same inputs python -m csa_jax times); heads
    (None: the family's own H) replaces H."""
    cfg = preset(family, ratio)
    if heads is not None:
        cfg = heads_config(cfg, heads)
    pr = problems.make_problem(cfg, T, B=1, dtype=jnp.bfloat16, seed=seed,
                               index_mode=idx_kind if ratio == 4 else "causal")
    return cfg, pr.q, pr.kv, pr.idx, pr.sink, pr.do


def _sync(x):
    jax.block_until_ready(x)
    return x


TIMINGS = ("synced", "pipelined")


def time_fn(fn, args, reps, cap, timing="synced", sync=_sync, issue=None):
    """Compile + one warm run, then timed runs (stopping after `cap` seconds): (ms, runs,
    first-call s, output).

    timing "synced": the median of up to `reps` calls, each waited for (launch, the host's wait
    and the device work: what a caller that blocks on every call sees). "pipelined": `reps`
    calls enqueued back to back and waited for once, divided by `reps`, the median of up to 3
    such rounds (the device time per call, each call's launch hidden behind the previous one:
    what a training step's ops cost, and the like-for-like time against a kernel timed in
    another framework). sync(out) waits for an output; issue (default fn) is the call without
    waiting, for a fn that waits itself (benchmarks/anchor_flashmla.py)."""
    if timing not in TIMINGS:
        raise ValueError(f"timing={timing!r}: expected one of {TIMINGS}")
    t0 = time.perf_counter()
    out = sync(fn(*args))
    first = time.perf_counter() - t0
    sync(fn(*args))                                   # warm: autotuning / caches settled
    times = []
    start = time.perf_counter()
    if timing == "pipelined":
        issue = issue or fn
        for _ in range(3):
            t = time.perf_counter()
            last = None
            for _ in range(reps):
                last = issue(*args)
            sync(last)
            times.append((time.perf_counter() - t) / reps)
            if time.perf_counter() - start > cap:
                break
        return statistics.median(times) * 1e3, len(times) * reps, first, out
    for _ in range(reps):
        t = time.perf_counter()
        sync(fn(*args))
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > cap:
            break
    return statistics.median(times) * 1e3, len(times), first, out


def timed_probe(name, make, reps, cap):
    """(row, output, (fn, args)) of one probe: make() -> (fn, args), timed by time_fn; a failure
    to build or run it is printed and gives an error row and None output (the caller goes on)."""
    try:
        fn, args = make()
        ms, n, first, out = time_fn(fn, args, reps, cap)
    except Exception as e:  # report and go on
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name}: failed: {msg}", file=sys.stderr)
        return dict(probe=name, error=msg), None, None
    return dict(probe=name, ms=ms, reps=n, first_s=first), out, (fn, args)


@jax.jit
def device_diff_stats(a, b):
    """problems.rel_err's pieces on the device (a host float64 copy of a 1e9-element dq costs
    seconds): max |a - b| and max |b| over b's finite entries, whether a has a NaN, whether
    a's and b's non-finite entries differ in place."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    fin = jnp.isfinite(b)
    diff = jnp.max(jnp.where(fin, jnp.abs(a - b), 0.0), initial=0.0)
    den = jnp.max(jnp.where(fin, jnp.abs(b), 0.0), initial=0.0)
    return diff, den, jnp.any(jnp.isnan(a)), jnp.any(jnp.isfinite(a) != fin)


def _value(v):
    v = v.strip()
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        return v          # a string option, e.g. bwd=pallas_triton


def parse_overrides(kvs):
    over = {}
    for kv in filter(None, kvs.split(",")):
        k, _, v = kv.partition("=")
        over[k.strip()] = _value(v)
    return over


def apply_overrides(mod, cfg, q_shape, over):
    """A variant's Config: dataclasses.replace(cfg, **over), a field the Config does not have
    refused by name (ValueError listing the fields); the Config's own checks refuse bad values.
    mod and q_shape are unused (kept for bench_csa.py's call)."""
    import dataclasses
    del mod, q_shape
    fields = [f.name for f in dataclasses.fields(cfg)]
    unknown = sorted(set(over) - set(fields))
    if unknown:
        raise ValueError(f"{type(cfg).__module__}.{type(cfg).__name__} has no field "
                         f"{', '.join(unknown)} (fields: {', '.join(fields)})")
    return dataclasses.replace(cfg, **over)


def parse_variants(spec, base=None):
    out = [("default", dict(base or {}))]
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, kvs = part.partition(":")
        out.append((name.strip(), {**(base or {}), **parse_overrides(kvs)}))
    return out


def flops(cfg, T, idx):
    nominal = forward_flops(T, cfg.num_heads, cfg.nominal_slots(T), cfg.head_dim)
    valid = problems.valid_flops(idx, cfg.num_heads, cfg.head_dim)
    return nominal, valid
