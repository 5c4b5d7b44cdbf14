"""GPU check and timing of the Gluon backward (impl="gluon", Config.bwd="gluon").

    python -m benchmarks.gluon_bwd_check [--parts grad,det,time] [--out f.json]
        [--shapes pro:4:4096,pro:4:16384] [--variants 'bk16:bwd_block_k=16,bwd_stages=4']
        [--grad-variants ...] [--grad-cases h64_d512_f16_sink,...] [--skip default,e2e,dq,...]

--variants (time part) and --grad-variants (grad part): 'name:key=val,...;...', fields of the
gluon Config on top of its default_config (the backward's: bwd_block_k, bwd_stages, and
bwd=pallas_triton, the escape hatch); a field the Config lacks or a value it refuses is a
failed `variant` row.

Parts:
  grad  the backward alone on fresh random inputs (-1 slots anywhere, out-of-range ids made
        empty by sanitize_indices, duplicate rows, all-empty tokens, with and without sink,
        H in {16, 64, 128}, D in {64, 512}, K not a multiple of the tile, bf16 and f16), both
        cotangents (dO and dlse), against impl="xla"'s backward on the same (o, lse): dq, dkv,
        dsink by max-abs error over max-abs reference; then jax.grad through
        sparse_attention(impl="gluon") vs impl="xla" (forward and backward Gluon);
  det   dkv (and dq) bit-identical across two runs of the Gluon backward on the same inputs;
  time  backward ms (and the dq kernel alone: only dq is kept, XLA drops the dkv work) of
        pallas_triton and gluon (+ variants) at V4 shapes, each checked against the first row
        timed (pallas_triton unless skipped) in the same call; the step (value and grad of the
        loss) of both.
--skip (to fit a short GPU call): default = the grad part checks only the variants, not the
default config; e2e = no jax.grad case; dq = no dq-only timing; step = no step timing;
pallas, time_default = no pallas_triton / gluon default row in the time part (the first row
timed is the reference of the others' error check).
One JSON line per check (helpers from gluon_check.py); exits non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import apply_overrides, parse_variants, time_fn
from benchmarks.gluon_check import (RESULTS, grad_check, parse_shapes, random_case, rel, report,
                                    report_failure, run_parts)


def time_ms(fn, args, reps):
    """Median ms of `reps` timed runs after the compile and a warm run (no time cap)."""
    return time_fn(fn, args, reps, float("inf"))[0]


def _mods():
    from csa_jax import registry
    return registry.get("gluon"), registry.get("xla")


def _bwd_inputs(key, B, T, H, D, N, K, dt, sink):
    from csa_jax.common import sanitize_indices
    q, kv, idx, s = random_case(key, B, T, H, D, N, K, dt, sink)
    idx = sanitize_indices(idx, N)
    s = jnp.full((H,), -jnp.inf, jnp.float32) if s is None else s
    kd, kl = jax.random.split(jax.random.fold_in(key, 7))
    do = jax.random.normal(kd, q.shape, dt)
    dlse = jax.random.normal(kl, q.shape[:3], jnp.float32) * 0.3
    return q, kv, idx, s, do, dlse


def _run_bwd(mod, cfg, args, scale):
    q, kv, idx, s, o, lse, do, dlse = args
    f = jax.jit(lambda *a: mod.backward(*a, scale=scale, interpret=False, config=cfg))
    return jax.block_until_ready(f(q, kv, idx, s, o, lse, do, dlse))


CASES = [
    ("h64_d512_bf16_sink", 1, 192, 64, 512, 320, 192, jnp.bfloat16, True),
    ("h128_d512_bf16_nosink_k130", 2, 96, 128, 512, 200, 130, jnp.bfloat16, False),
    ("h16_d64_bf16_sink_pad", 1, 64, 16, 64, 100, 40, jnp.bfloat16, True),
    ("h64_d512_f16_sink", 1, 64, 64, 512, 150, 100, jnp.float16, True),
    ("h128_d512_bf16_k1152", 1, 48, 128, 512, 2000, 1152, jnp.bfloat16, True),
]


def part_grad(seed, variants, cases=None, skip=()):
    import csa_jax
    from csa_jax import problems
    g, x = _mods()
    key = jax.random.PRNGKey(seed + 11)
    for name, B, T, H, D, N, K, dt, sink in CASES:
        key, k = jax.random.split(key)
        if cases and name not in cases:
            continue
        q, kv, idx, s, do, dlse = _bwd_inputs(k, B, T, H, D, N, K, dt, sink)
        scale = D ** -0.5
        o, lse = x.forward(q, kv, idx, s, scale=scale, interpret=False, config=x.Config())
        ref = _run_bwd(x, x.Config(), (q, kv, idx, s, o, lse, do, dlse), scale)
        for vname, cfg in variants(q.shape):
            if vname == "default" and "default" in skip:
                continue
            try:
                got = _run_bwd(g, cfg, (q, kv, idx, s, o, lse, do, dlse), scale)
            except Exception as e:  # noqa: BLE001
                report_failure(e, part="grad", case=name, variant=vname)
                continue
            errs, ok = grad_check(got, ref, sink, dt)
            report(part="grad", case=name, variant=vname, shape=[B, T, H, D], K=K,
                   dtype=jnp.dtype(dt).name, sink=sink, errs=errs, ok=ok)
    if "e2e" in skip:
        return
    # End to end: jax.grad through sparse_attention, forward and backward Gluon.
    q, kv, idx, s, do, dlse = _bwd_inputs(key, 1, 128, 64, 512, 256, 160, jnp.bfloat16, True)
    grads = {}
    for impl in ("gluon", "xla"):
        loss = problems.loss_fn(lambda q, kv, idx, s, impl=impl: csa_jax.sparse_attention(
            q, kv, idx, s, impl=impl))
        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, s, idx, do, dlse)
    errs = {n: rel(a, b) for n, a, b in zip(("dq", "dkv", "dsink"), grads["gluon"], grads["xla"])}
    report(part="grad_e2e", errs=errs, ok=all(e <= 2e-2 for e in errs.values()))


def part_det(seed):
    g, x = _mods()
    key = jax.random.PRNGKey(seed + 13)
    q, kv, idx, s, do, dlse = _bwd_inputs(key, 1, 256, 128, 512, 400, 320, jnp.bfloat16, True)
    o, lse = g.forward(q, kv, idx, s, scale=512 ** -0.5, interpret=False,
                       config=g.default_config(q.shape, kv.shape, idx.shape, q.dtype))
    cfg = g.default_config(q.shape, kv.shape, idx.shape, q.dtype)
    a = _run_bwd(g, cfg, (q, kv, idx, s, o, lse, do, dlse), 512 ** -0.5)
    b = _run_bwd(g, cfg, (q, kv, idx, s, o, lse, do, dlse), 512 ** -0.5)
    same = {n: bool(jnp.array_equal(u, v)) for n, u, v in zip(("dq", "dkv", "dsink"), a, b)}
    report(part="det", bit_identical=same, ok=same["dkv"] and same["dq"])


def part_time(seed, shapes, variants, skip=()):
    from csa_jax import problems
    import csa_jax
    from csa_jax import registry
    from csa_jax.config import preset
    for family, ratio, T in shapes:
        c = preset(family, ratio)
        pr = problems.make_problem(c, T, B=1, seed=seed,
                                   index_mode="random" if ratio == 4 else "causal")
        nominal, valid = pr.flops()
        bwd_flops = 2.5 * nominal
        g = registry.get("gluon")
        gcfg = g.default_config(pr.q.shape, pr.kv.shape, pr.idx.shape, pr.q.dtype)
        o, lse = g.forward(pr.q, pr.kv, pr.idx, pr.sink, scale=c.scale, interpret=False,
                           config=gcfg)
        args = (pr.q, pr.kv, pr.idx, pr.sink, o, lse, pr.do, pr.dlse)
        runs = [] if "pallas" in skip else [("pallas_triton", registry.get("pallas_triton"), None)]
        runs += [("gluon:" + v, g, cfg) for v, cfg in variants(pr.q.shape)
                 if not (v == "default" and "time_default" in skip)]
        ref = None
        for name, mod, cfg in runs:
            try:
                cfg = cfg or mod.default_config(pr.q.shape, pr.kv.shape, pr.idx.shape,
                                                pr.q.dtype)
                f = jax.jit(lambda *a, mod=mod, cfg=cfg: mod.backward(
                    *a, scale=c.scale, interpret=False, config=cfg))
                fdq = jax.jit(lambda *a, mod=mod, cfg=cfg: mod.backward(
                    *a, scale=c.scale, interpret=False, config=cfg)[0])
                reps = 5 if T > 8192 else 10
                ms = time_ms(f, args, reps=reps)
                dq_ms = None if "dq" in skip else time_ms(fdq, args, reps=reps)
                out = f(*args)
                row = dict(part="time", family=family, ratio=ratio, T=T, impl=name, bwd_ms=ms,
                           dq_ms=dq_ms, bwd_tflops_nominal=bwd_flops / ms / 1e9,
                           bwd_tflops_valid=2.5 * valid / ms / 1e9)
                if ref is None:
                    ref = out
                else:
                    key = "err_vs_" + runs[0][0].replace("gluon:", "")
                    row[key] = {n: rel(a, b) for n, a, b in zip(("dq", "dkv", "dsink"), out, ref)}
                    row["ok"] = all(e <= 2e-2 for e in row[key].values())
                report(**row)
                del out
            except Exception as e:  # noqa: BLE001
                report_failure(e, 400, part="time", family=family, ratio=ratio, T=T, impl=name)
        del ref, args, o, lse
        for impl in () if "step" in skip else ("pallas_triton", "gluon"):
            try:
                loss = problems.loss_fn(lambda q, kv, idx, s, impl=impl: csa_jax.sparse_attention(
                    q, kv, idx, s, scale=c.scale, impl=impl))
                step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
                ms = time_ms(step, (pr.q, pr.kv, pr.sink, pr.idx, pr.do, pr.dlse),
                             reps=5 if T > 8192 else 10)
                report(part="step", family=family, ratio=ratio, T=T, impl=impl, step_ms=ms,
                       step_tflops_nominal=3.5 * nominal / ms / 1e9)
            except Exception as e:  # noqa: BLE001
                report_failure(e, 400, part="step", family=family, ratio=ratio, T=T, impl=impl)
        del pr


def make_variants(spec):
    """'name:key=val,key=val;...' -> f(q_shape) -> [(name, gluon Config)], default first."""
    from csa_jax import registry
    g = registry.get("gluon")
    parsed = parse_variants(spec or "")[1:]          # common.parse_variants' "default" first

    def variants(q_shape):
        base = g.default_config(q_shape, None, (0, 0, 0), jnp.bfloat16)
        out = [("default", base)]
        for name, kw in parsed:
            try:
                out.append((name, apply_overrides(g, base, q_shape, kw)))
            except (TypeError, ValueError) as e:
                report(part="variant", variant=name, ok=False, error=str(e)[:300])
        return out

    return variants


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="grad,det,time")
    ap.add_argument("--shapes", default="pro:4:4096,pro:4:16384")
    ap.add_argument("--variants", default="")
    ap.add_argument("--grad-variants", default="")
    ap.add_argument("--grad-cases", default="", help="comma list of CASES names (default all)")
    ap.add_argument("--skip", default="",
                    help="comma list of default,e2e,dq,step,pallas,time_default")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(f"# device {jax.devices()[0].device_kind}, jax {jax.__version__}, seed {args.seed}",
          flush=True)
    skip = set(x for x in args.skip.split(",") if x)
    known = {"default", "e2e", "dq", "step", "pallas", "time_default"}
    if skip - known:
        ap.error(f"--skip {args.skip!r}: only {', '.join(sorted(known))}")
    names = {c[0] for c in CASES}
    if set(x for x in args.grad_cases.split(",") if x) - names:
        ap.error(f"--grad-cases {args.grad_cases!r}: cases are {sorted(names)}")
    return run_parts(args.parts.split(","), {
        "grad": lambda: part_grad(args.seed, make_variants(args.grad_variants),
                                  [c for c in args.grad_cases.split(",") if c], skip),
        "det": lambda: part_det(args.seed),
        "time": lambda: part_time(args.seed, parse_shapes(args.shapes),
                                  make_variants(args.variants), skip),
    }, seed=args.seed, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
