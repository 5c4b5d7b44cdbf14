"""GPU check of the cr0 window backward (Config.bwd_win, kernels/gluon/bwd_win.py) against xla.

    python -m benchmarks.gluon_bwd_win_check [--parts grad,det,poison] [--cases a,b] [--out f.json]

Parts:
  grad    the backward alone on cr0-layout problems (the window slots in a random order per
          token, -1 for rows < 0, slots past the window -1 when K > window; both cotangents,
          with and without sink, H 16 / 64 / 128, D 64 / 512, window 64 / 128, T not a multiple
          of 16), gluon with bwd_win=True (on top of default_config, layout="cr0") and, with
          --variants bwd_win,gather, the gluon default (the gather kernel) against impl="xla"'s
          backward on the same (o, lse):
          dq, dkv, dsink by max-abs error over max-abs reference;
  det     dq, dkv, dsink of bwd_win bit-identical across two runs;
  poison  a traced idx with one token breaking the promise: that token's dq is NaN, a token
          outside its reach finite; a concrete one: ValueError from check_layout;
  time    at V4 cr0 shapes (--shapes flash:4096,pro:16384; bench_csa's cr0 inputs), the whole
          backward and the dq kernel alone (only dq kept: XLA drops the dkv work) of the gluon
          default (gather dq kernel, layout="cr0") and bwd_win, median of --reps after a warm
          run, bwd_win checked against the default in the same call (dO and dlse cotangents)
          and bit-identical across two runs;
          --win-variants adds rows on top of bwd_win (e.g. its benchmark-only bwd_win_ablate).
One JSON line per check (gluon_check's helpers); exits non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import parse_variants
from benchmarks.gluon_check import grad_check, rel, report, report_failure, run_parts

# name, B, T, H, D, N (kv rows >= T), window, K, dtype, sink
CASES = [
    ("h128_d512_bf16_sink_t200", 1, 200, 128, 512, 200, 128, 128, jnp.bfloat16, True),
    ("h64_d512_f16_nosink_b2_k160", 2, 90, 64, 512, 100, 128, 160, jnp.float16, False),
    ("h16_d64_bf16_sink_w64", 1, 150, 16, 64, 170, 64, 64, jnp.bfloat16, True),
]


def cr0_case(key, B, T, H, D, N, W, K, dt, sink):
    """Random q, kv, sink, dO, dlse and a cr0 idx [B, T, K] (window slots shuffled per token)."""
    from csa_jax.indices import window_indices
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, H, D), dt)
    kv = jax.random.normal(ks[1], (B, N, D), dt)
    s = (jax.random.normal(ks[2], (H,), jnp.float32) if sink
         else jnp.full((H,), -jnp.inf, jnp.float32))
    perm = jnp.argsort(jax.random.uniform(ks[3], (B, T, W)), axis=-1)
    win = jnp.take_along_axis(jnp.broadcast_to(window_indices(T, W), (B, T, W)), perm, -1)
    idx = jnp.concatenate([win, jnp.full((B, T, K - W), -1, jnp.int32)], -1)
    do = jax.random.normal(ks[4], q.shape, dt)
    dlse = jax.random.normal(ks[5], q.shape[:3], jnp.float32) * 0.3
    return q, kv, idx, s, do, dlse


def _mods():
    from csa_jax import registry
    return registry.get("gluon"), registry.get("xla")


def _cfgs(g, q, W):
    base = g.default_config(q.shape, None, None, q.dtype)
    gather = dataclasses.replace(base, layout="cr0", window=W)
    return {"gather": gather, "bwd_win": dataclasses.replace(gather, bwd_win=True)}


def _bwd(mod, cfg, args, scale, jit=True):
    f = lambda *a: mod.backward(*a, scale=scale, interpret=False, config=cfg)
    return jax.block_until_ready((jax.jit(f) if jit else f)(*args))


def _prepare(seed, case):
    name, B, T, H, D, N, W, K, dt, sink = case
    g, x = _mods()
    q, kv, idx, s, do, dlse = cr0_case(jax.random.PRNGKey(seed + zlib.crc32(name.encode()) % 1000), B, T, H,
                                       D, N, W, K, dt, sink)
    scale = D ** -0.5
    o, lse = x.forward(q, kv, idx, s, scale=scale, interpret=False, config=x.Config())
    return g, x, (q, kv, idx, s, o, lse, do, dlse), scale


def part_grad(seed, cases, variants):
    for case in CASES:
        name, B, T, H, D, N, W, K, dt, sink = case
        if cases and name not in cases:
            continue
        g, x, args, scale = _prepare(seed, case)
        ref = _bwd(x, x.Config(), args, scale)
        for vname, cfg in _cfgs(g, args[0], W).items():
            if vname not in variants:
                continue
            try:
                got = _bwd(g, cfg, args, scale)
            except Exception as e:  # noqa: BLE001
                report_failure(e, part="grad", case=name, variant=vname)
                continue
            errs, ok = grad_check(got, ref, sink, dt)
            report(part="grad", case=name, variant=vname, shape=[B, T, H, D], window=W, K=K,
                   dtype=jnp.dtype(dt).name, sink=sink, errs=errs, ok=ok)


def part_det(seed):
    g, _, args, scale = _prepare(seed, CASES[0])
    cfg = _cfgs(g, args[0], CASES[0][6])["bwd_win"]
    a, b = _bwd(g, cfg, args, scale), _bwd(g, cfg, args, scale)
    same = {n: bool(jnp.array_equal(u, v)) for n, u, v in zip(("dq", "dkv", "dsink"), a, b)}
    report(part="det", case=CASES[0][0], bit_identical=same, ok=all(same.values()))


def part_poison(seed):
    g, _, args, scale = _prepare(seed, CASES[0])
    q, kv, idx, s, o, lse, do, dlse = args
    cfg = _cfgs(g, q, CASES[0][6])["bwd_win"]
    t_bad = 170                             # window rows 43..170: put row 10 in one slot
    bad_idx = idx.at[0, t_bad, 0].set(10)
    dq = _bwd(g, cfg, (q, kv, bad_idx, s, o, lse, do, dlse), scale)[0]
    nan_bad = bool(jnp.all(jnp.isnan(dq[0, t_bad])))
    fin_far = bool(jnp.all(jnp.isfinite(dq[0, 20])))
    report(part="poison_traced", bad_token_dq_nan=nan_bad, far_token_dq_finite=fin_far,
           ok=nan_bad and fin_far)
    try:
        _bwd(g, cfg, (q, kv, bad_idx, s, o, lse, do, dlse), scale, jit=False)
        report(part="poison_concrete", ok=False, error="no ValueError")
    except ValueError as e:
        report(part="poison_concrete", ok=f"idx[0, {t_bad}]" in str(e), error=str(e)[:300])


def part_time(seed, shapes, reps, win_variants=""):
    from benchmarks.gluon_bwd_check import time_ms
    from csa_jax import problems
    from csa_jax.config import preset
    g, _ = _mods()
    for family, T in shapes:
        c = preset(family, 0)
        pr = problems.make_problem(c, T, B=1, seed=seed, index_mode="causal")
        cfgs = _cfgs(g, pr.q, c.window)
        o, lse = jax.jit(lambda *a: g.forward(*a, scale=c.scale, interpret=False,
                                              config=cfgs["gather"]))(pr.q, pr.kv, pr.idx,
                                                                       pr.sink)
        args = (pr.q, pr.kv, pr.idx, pr.sink, o, lse, pr.do, pr.dlse)
        for name, kw in parse_variants(win_variants)[1:]:    # on top of bwd_win
            cfgs[name] = dataclasses.replace(cfgs["bwd_win"], **kw)
        ref = None
        for vname, cfg in cfgs.items():
            try:
                f = jax.jit(lambda *a, cfg=cfg: g.backward(*a, scale=c.scale, interpret=False,
                                                          config=cfg))
                fdq = jax.jit(lambda *a, cfg=cfg: g.backward(*a, scale=c.scale,
                                                            interpret=False, config=cfg)[0])
                row = dict(part="time", family=family, T=T, variant=vname,
                           bwd_ms=time_ms(f, args, reps),
                           dq_ms=None if cfg.bwd_win_ablate else time_ms(fdq, args, reps))
                out = f(*args)
                if ref is None:
                    ref = out
                elif cfg.bwd_win_ablate:
                    row["ablated"] = cfg.bwd_win_ablate        # wrong results by design
                else:
                    row["err_vs_gather"] = {n: rel(a, b) for n, a, b in
                                            zip(("dq", "dkv", "dsink"), out, ref)}
                    again = f(*args)                            # a second run: the same bits
                    row["bit_identical"] = {n: bool(jnp.array_equal(a, b)) for n, a, b in
                                            zip(("dq", "dkv", "dsink"), out, again)}
                    row["ok"] = all(np.isfinite(e) and e <= 2e-2
                                    for e in row["err_vs_gather"].values()) and all(
                        row["bit_identical"].values())
                    del again
                report(**row)
            except Exception as e:  # noqa: BLE001
                report_failure(e, 400, part="time", family=family, T=T, variant=vname)
        del ref, args, o, lse, pr


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="grad,det,poison")
    ap.add_argument("--cases", default="", help="comma list of CASES names (default all)")
    ap.add_argument("--variants", default="bwd_win",
                    help="grad part: bwd_win and / or gather (the default gluon backward)")
    ap.add_argument("--shapes", default="flash:4096,pro:16384", help="time part: family:T,...")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--win-variants", default="",
                    help="time part: more bwd_win rows, 'name:key=val,...;...' on top of it")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(f"# device {jax.devices()[0].device_kind}, jax {jax.__version__}, seed {args.seed}",
          flush=True)
    cases = [c for c in args.cases.split(",") if c]
    if set(cases) - {c[0] for c in CASES}:
        ap.error(f"--cases {args.cases!r}: cases are {[c[0] for c in CASES]}")
    return run_parts(args.parts.split(","), {
        "grad": lambda: part_grad(args.seed, cases, args.variants.split(",")),
        "det": lambda: part_det(args.seed),
        "poison": lambda: part_poison(args.seed),
        "time": lambda: part_time(args.seed, [(f, int(t)) for f, t in (
            x.split(":") for x in args.shapes.split(",") if x)], args.reps, args.win_variants),
    }, seed=args.seed, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
