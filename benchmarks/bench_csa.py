"""Paper-style CSA benchmark: forward, backward and step (fwd + bwd) times of each impl.

    python -m benchmarks.bench_csa --impls xla,pallas_triton[,gluon] \
        [--families flash,pro] [--ratios 0,4,128] [--seqs 4096,8192,16384] \
        [--cr4-indices causal,random] [--out bench.json] [--variants 'name:key=v,key=v;...']
        [--heads 8,16,32,64,128]

Inputs are random bf16 at the V4 shapes (H = 64 Flash / 128 Pro, D = 512, window 128, top-k
512 / 1024, B = 1); kv = [T token rows ; P pool rows]. Index lists:
  cr0    window_indices(T)                       (-1 for t < 127)
  cr128  build_indices(T, 128): window + every visible pool row (-1 for invisible ones)
  cr4    causal: window + the lightning indexer's top-k on random indexer inputs (-1 at
                 the tail for early tokens); until commit 6317ea8 this script used top-k of
                 uniform random scores over the visible pool rows instead;
         random: window + k uniform random pool ids, every slot valid (the convention of
                 the published AMD numbers; drawn with replacement, so a token may list a
                 pool row twice);
         unique: the same draw without replacement (no repeats within a token, as a top-k;
                 gluon's few-heads dkv by row blocks needs that, else it falls back).
  (the generator is csa_jax.problems, shared with python -m csa_jax)
--heads H1,H2,... replaces the family's H (the heads one device holds under tensor parallelism:
Pro's 128 over TP = 2, 4, 8, 16 is 64, 32, 16, 8); every row then carries its H in the config
name (pro-cr4-T16384-H16), and a table per H (each impl's fwd / step ms) is printed last.
FLOPs follow csa_spec.md: forward = 4*T*H*K*D with K nominal (128 / 128+k / 128+T/128);
"valid" counts only the non-empty slots; backward = 2.5x forward, step = 3.5x forward.
Every impl is checked against impl="xla" on the same inputs when xla runs in the same call
(max-abs error / max-abs of the reference, per output), else at a reduced size (T=1024).
Each (config, impl) is guarded: an OOM or compile failure prints a row with the error.
A variant runs only for the impls whose Config has all of its keys (e.g. gluon's pipeline=true
is not tried on pallas_triton); `layout=auto` in a variant means the row's own layout promise
(cr0 / cr4 / cr128, e.g. gluon's window-reuse kernel on cr0 and cr128).
--timing synced (default) times each call waited for (the launch and the host's wait are in
it: ~0.3-0.45 ms per call on the H200 with jax 0.11.2, measured 2026-12-02); --timing pipelined
times calls enqueued back to back (the device time per call), for every impl and the anchor.
--anchor DIR times FlashMLA's SM90 sparse prefill forward (benchmarks/anchor_flashmla.py says
what DIR holds) on each config's inputs in the same process, as impl "flashmla" (forward only),
and prints a last table: each impl's forward over FlashMLA's (ours / theirs) and FlashMLA's
output agreement with the config's reference (xla's outputs when xla ran, else the first impl's).
The table is printed last; --out writes every number as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import math
import sys
import traceback

import jax
import jax.numpy as jnp

from benchmarks.common import (apply_overrides, device_diff_stats, flops, make_problem,
                               parse_overrides, parse_variants, time_fn, TIMINGS)
from csa_jax import problems, registry
from csa_jax.config import preset



def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    csv = lambda f: (lambda s: [f(x) for x in s.split(",") if x])
    ap.add_argument("--impls", type=csv(str), default=["xla", "pallas_triton"])
    ap.add_argument("--families", type=csv(str), default=["flash", "pro"])
    ap.add_argument("--ratios", type=csv(int), default=[0, 4, 128])
    ap.add_argument("--seqs", type=csv(int), default=[4096, 8192, 16384])
    ap.add_argument("--cr4-indices", type=csv(str), default=["causal", "random"])
    ap.add_argument("--modes", type=csv(str), default=["fwd", "bwd", "step"])
    ap.add_argument("--heads", type=csv(int), default=[],
                    help="head counts replacing each family's H, e.g. 8,16,32,64,128 (the "
                         "per-device heads under tensor parallelism); default: the family's")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (median)")
    ap.add_argument("--timing", choices=TIMINGS, default="synced",
                    help="synced: median of calls each waited for (launch + host wait + "
                         "device); pipelined: calls enqueued back to back, waited for once "
                         "(the device time per call; FlashMLA's too): benchmarks.common.time_fn")
    ap.add_argument("--time-cap", type=float, default=10.0,
                    help="seconds of timed runs per (config, impl, mode); fewer reps past it")
    ap.add_argument("--check", choices=["auto", "reduced", "default", "none"], default="auto",
                    help="auto: vs xla on the same inputs if xla runs, else at T=1024; "
                         "default: each variant vs its impl's default row on the same inputs")
    ap.add_argument("--variants", default="",
                    help="extra configs of non-xla impls: 'name:key=val,key=val;name2:...'")
    ap.add_argument("--impl-config", default="",
                    help="'key=val,...' overrides of every non-xla impl's default config")
    ap.add_argument("--speedup-over", default="xla", metavar="IMPL",
                    help="the speedup columns and their geometric means are IMPL ms / impl ms "
                         "(default xla; e.g. pallas_triton for the paper's Table 8 analog)")
    ap.add_argument("--out", default=None, help="write JSON here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of the script")
    ap.add_argument("--anchor", default=None, metavar="DIR",
                    help="also time FlashMLA's SM90 sparse prefill forward on the same inputs "
                         "(the harness and sources in DIR: benchmarks/anchor_flashmla.py)")
    ap.add_argument("--diag", action="store_true",
                    help="also time pallas_triton's backward parts and inverse map alone: "
                         "bwd_dq (the dq kernel; with interm='gemm' it also stores dS and P), "
                         "bwd_interm (with 'gemm': dq kernel + the GEMM), bwd_interm+reduce")
    args = ap.parse_args(argv)
    bad = [h for h in args.heads if h <= 0]
    if bad:
        ap.error(f"--heads {bad} must be positive head counts")
    return args


# ----------------------------------------------------------------------------- inputs


def build_fns(mod, cfg_obj, scale, interpret):
    kw = dict(scale=scale, interpret=interpret, config=cfg_obj)
    fwd = jax.jit(functools.partial(mod.forward, **kw))
    bwd = jax.jit(functools.partial(mod.backward, **kw))

    @jax.jit
    def step(q, kv, idx, sink, do):
        o, lse = fwd(q, kv, idx, sink)
        return bwd(q, kv, idx, sink, o, lse, do, jnp.zeros_like(lse))

    return fwd, bwd, step


rel_err = problems.rel_err


def _rel_err_device(a, b):
    """problems.rel_err from common.device_diff_stats (f32 on the device; no host copy:
    --check default at T = 16384)."""
    diff, den, nan, _ = device_diff_stats(a, b)
    return float("nan") if bool(nan) else float(diff) / max(float(den), 1e-30)


OUT_NAMES = ("o", "lse", "dq", "dkv", "dsink")


def run_impl(impl, variant, cfg_overrides, problem, args, row):
    cfg, q, kv, idx, sink, do = problem
    mod = registry.get(impl)
    cfg_obj = mod.default_config(q.shape, kv.shape, idx.shape, q.dtype)
    if cfg_overrides:
        if cfg_overrides.get("layout") == "auto":     # the problem's own layout promise
            cfg_overrides = {**cfg_overrides, "layout": f"cr{cfg.ratio}"}
        cfg_obj = apply_overrides(mod, cfg_obj, q.shape, cfg_overrides)
    row["config"] = repr(cfg_obj)
    fwd, bwd, step = build_fns(mod, cfg_obj, cfg.scale, args.interpret)
    outs = {}
    o, lse = None, None
    if "fwd" in args.modes or "bwd" in args.modes:
        ms, n, first, (o, lse) = time_fn(fwd, (q, kv, idx, sink), args.reps, args.time_cap,
                                         args.timing)
        row.update(fwd_ms=ms, fwd_reps=n, fwd_first_s=first)
        outs.update(o=o, lse=lse)
    if "bwd" in args.modes:
        zeros = jnp.zeros_like(lse)
        ms, n, first, g = time_fn(bwd, (q, kv, idx, sink, o, lse, do, zeros), args.reps,
                                  args.time_cap, args.timing)
        row.update(bwd_ms=ms, bwd_reps=n, bwd_first_s=first)
        outs.update(dq=g[0], dkv=g[1], dsink=g[2])
    if args.diag and impl == "pallas_triton" and "bwd" in args.modes:
        # Backward kernels one at a time (csa_jax.kernels.triton.testing: internal entry points).
        from csa_jax.kernels.triton import testing as tt
        d = tt.dims(q, kv, idx, cfg_obj)
        inv = jax.jit(lambda i: tt.inverse_map(tt.prep_idx(i, d)[0], d.N))
        row["inverse_map_ms"] = time_fn(inv, (idx,), 3, 1.0)[0]
        bargs = (q, kv, idx, sink, o, lse, do, jnp.zeros_like(lse))
        for parts in (("dq",), ("interm",), ("interm", "reduce")):
            part_fn = jax.jit(functools.partial(tt.backward_parts, scale=cfg.scale,
                                                interpret=args.interpret,
                                                config=cfg_obj, parts=parts))
            row["bwd_" + "+".join(parts) + "_ms"] = time_fn(part_fn, bargs, 3, 1.0)[0]
    if "step" in args.modes:
        ms, n, first, _ = time_fn(step, (q, kv, idx, sink, do), args.reps, args.time_cap,
                                  args.timing)
        row.update(step_ms=ms, step_reps=n, step_first_s=first)
        row["step_temp_bytes"] = _temp_bytes(step, (q, kv, idx, sink, do))
    return outs


def _temp_bytes(fn, args):
    """XLA's temporary buffer bytes of jitted fn at args (its buffer assignment, both branches
    of a lax.cond counted as assigned), or None where the backend does not say."""
    try:
        return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (memory_analysis is optional per backend)
        return None


_CHECKED = {}


def reduced_check(impl, cfg_overrides, family, ratio, idx_kind, args, heads=None):
    """rel errors of impl vs xla at T=1024 (same generator); once per layer type, H and
    config."""
    key = (impl, repr(sorted(cfg_overrides.items())), family, ratio, idx_kind, heads)
    if key not in _CHECKED:
        _CHECKED[key] = _reduced_check(impl, cfg_overrides, family, ratio, idx_kind, args,
                                       heads)
    return _CHECKED[key]


def _reduced_check(impl, cfg_overrides, family, ratio, idx_kind, args, heads=None):
    problem = make_problem(family, ratio, 1024, idx_kind, args.seed + 1, heads)
    sub = argparse.Namespace(**{**vars(args), "modes": ["fwd", "bwd"], "reps": 1, "time_cap": 0})
    got = run_impl(impl, None, cfg_overrides, problem, sub, {})
    ref = run_impl("xla", None, {}, problem, sub, {})
    return {k: rel_err(got[k], ref[k]) for k in OUT_NAMES}


# ----------------------------------------------------------------------------- main


def run_anchor(anchor, problem, args, row, ref_outs):
    """FlashMLA's forward on the problem (timed like the impls, --timing), and its o / lse
    against ref_outs (max-abs error over max-abs of the reference, on the device)."""
    from benchmarks import anchor_flashmla
    _, q, kv, idx, sink, _ = problem
    run, to_jax = anchor_flashmla.prepare(anchor, q, kv, idx, sink, problem[0].scale)
    ms, n, first, out = time_fn(run, (), args.reps, args.time_cap, args.timing,
                                sync=anchor_flashmla.synced,
                                issue=lambda: run(sync=False))
    row.update(fwd_ms=ms, fwd_reps=n, fwd_first_s=first)
    if ref_outs:
        o, lse = to_jax(out)
        row["rel_err_vs_ref"] = {"o": _rel_err_device(o, ref_outs["o"]),
                                 "lse": _rel_err_device(lse, ref_outs["lse"])}


def main(argv=None):
    args = parse_args(argv)
    variants = parse_variants(args.variants, parse_overrides(args.impl_config))
    anchor = None
    if args.anchor:
        import os
        # JAX's allocator takes 75% of the GPU by default: leave torch room for FlashMLA.
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
        from benchmarks import anchor_flashmla
        try:
            anchor = anchor_flashmla.load(args.anchor)
        except anchor_flashmla.Unavailable as e:
            raise SystemExit(f"bench_csa: error: {e}") from None
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python3 " + " ".join(sys.argv), timing=args.timing)
    print(f"# {meta}", flush=True)
    rows = []
    for family, heads in itertools.product(args.families, args.heads or [None]):
        for ratio in args.ratios:
            for T in args.seqs:
                for idx_kind in (args.cr4_indices if ratio == 4 else ["-"]):
                    H = heads or preset(family, ratio).num_heads
                    try:
                        problem = make_problem(family, ratio, T, idx_kind, args.seed, heads)
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(family=family, ratio=ratio, T=T, idx=idx_kind, H=H,
                                         impl="-", error=f"inputs: {e!r}"[:300]))
                        continue
                    cfg, idx = problem[0], problem[3]
                    f_nom, f_val = flops(cfg, T, idx)
                    ref_outs = first_outs = None
                    for impl in args.impls:
                        for vname, over in _impl_variants(impl, variants):
                            row = dict(family=family, ratio=ratio, T=T, idx=idx_kind, H=H,
                                       impl=impl, variant=vname, fwd_flops_nominal=f_nom,
                                       fwd_flops_valid=f_val)
                            outs = None
                            try:
                                outs = run_impl(impl, vname, over, problem, args, row)
                            except Exception as e:  # noqa: BLE001
                                row["error"] = f"{type(e).__name__}: {e}"[:400]
                                traceback.print_exc(limit=3)
                            if anchor is not None and outs and first_outs is None:
                                first_outs = {k: outs[k] for k in ("o", "lse") if k in outs}
                            if impl == "xla" and outs:
                                ref_outs = outs
                            elif args.check == "default":
                                if vname == "default":
                                    ref_outs = outs
                                elif outs and ref_outs:
                                    row["rel_err_vs_default"] = {
                                        k: _rel_err_device(outs[k], ref_outs[k])
                                        for k in OUT_NAMES if k in outs and k in ref_outs}
                            elif outs and args.check != "none":
                                try:
                                    if ref_outs is not None and args.check == "auto":
                                        errs = {k: rel_err(outs[k], ref_outs[k])
                                                for k in OUT_NAMES if k in outs and k in ref_outs}
                                    else:
                                        errs = reduced_check(impl, over, family, ratio,
                                                             idx_kind, args, heads)
                                        row["check_T"] = 1024
                                    row["rel_err"] = errs
                                except Exception as e:  # noqa: BLE001
                                    row["check_error"] = f"{type(e).__name__}: {e}"[:300]
                            del outs
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                            if args.out:         # after every row: a killed run keeps its rows
                                with open(args.out, "w") as f:
                                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
                    if anchor is not None and "fwd" in args.modes:
                        row = dict(family=family, ratio=ratio, T=T, idx=idx_kind, H=H,
                                   impl="flashmla", variant="anchor", fwd_flops_nominal=f_nom,
                                   fwd_flops_valid=f_val)
                        try:
                            run_anchor(anchor, problem, args, row, ref_outs or first_outs)
                        except Exception as e:  # noqa: BLE001
                            row["error"] = f"{type(e).__name__}: {e}"[:400]
                            traceback.print_exc(limit=3)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    ref_outs = first_outs = None
                    del problem
    add_derived(rows, args.speedup_over)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print_table(rows, meta, args.speedup_over, with_heads=bool(args.heads))
    if args.heads:
        print_heads_table(rows)
    if anchor is not None:
        print_anchor_table(rows, with_heads=bool(args.heads))
    return rows


def print_anchor_table(rows, with_heads=False):
    """Each impl's forward against FlashMLA's on the same inputs (same call), and FlashMLA's
    agreement with the reference; the geometric mean of ours / theirs per impl."""
    key = lambda r: (r["family"], r["ratio"], r["T"], r["idx"], r.get("H"))  # noqa: E731
    theirs = {key(r): r for r in rows if r.get("impl") == "flashmla" and r.get("fwd_ms")}
    print("\n## Forward against FlashMLA (same call, same inputs): ours / theirs")
    print("| config | idx | impl | variant | ours ms | FlashMLA ms | ours / theirs | "
          "FlashMLA o / lse err vs ref |")
    print("|---|---|---|---|---|---|---|---|")
    logs = {}
    for r in rows:
        t = theirs.get(key(r))
        if r.get("impl") in ("flashmla", "-") or not t or not r.get("fwd_ms"):
            continue
        ratio = r["fwd_ms"] / t["fwd_ms"]
        logs.setdefault((r["impl"], r.get("variant", "default")), []).append(math.log(ratio))
        e = t.get("rel_err_vs_ref") or {}
        err = " / ".join(f"{e[k]:.1e}" for k in ("o", "lse") if k in e) or "-"
        print(f"| {config_name(r, with_heads)} | {r['idx']} | {r['impl']} | "
              f"{r.get('variant', '-')} | {r['fwd_ms']:.2f} | {t['fwd_ms']:.2f} | "
              f"{ratio:.2f}x | {err} |")
    for (impl, var), v in sorted(logs.items()):
        print(f"geometric mean ours / theirs, {impl} {var}: "
              f"{math.exp(sum(v) / len(v)):.2f}x over {len(v)} configs")


def _impl_variants(impl, variants):
    """The variants that apply to an impl: those whose keys are all fields of its Config."""
    if impl == "xla":
        return [("default", {})]
    try:
        fields = {f.name for f in dataclasses.fields(registry.get(impl).Config)}
    except Exception:  # noqa: BLE001  (run_impl reports why the impl is missing)
        return variants
    return [(n, o) for n, o in variants if n == "default" or set(o) <= fields]


def add_derived(rows, over="xla"):
    """TF/s per mode, and `<mode>_speedup` = the `over` impl's default-variant ms / this ms."""
    key = lambda r: (r["family"], r["ratio"], r["T"], r["idx"], r.get("H"))  # noqa: E731
    base = {key(r): r for r in rows
            if r.get("impl") == over and r.get("variant", "default") == "default"
            and "error" not in r}
    for r in rows:
        for mode, mult in (("fwd", 1.0), ("bwd", 2.5), ("step", 3.5)):
            ms = r.get(f"{mode}_ms")
            if ms:
                r[f"{mode}_tflops_nominal"] = mult * r["fwd_flops_nominal"] / ms / 1e9
                r[f"{mode}_tflops_valid"] = mult * r["fwd_flops_valid"] / ms / 1e9
            b = base.get(key(r))
            if b and ms and b.get(f"{mode}_ms"):
                r[f"{mode}_speedup"] = b[f"{mode}_ms"] / ms


def geomeans(rows, over):
    """{(impl, variant): {mode: (geometric mean speedup over `over`, configs)}}."""
    acc = {}
    for r in rows:
        if r.get("impl") in (over, "-") or "error" in r:
            continue
        for mode in ("fwd", "bwd", "step"):
            sp = r.get(f"{mode}_speedup")
            if sp:
                acc.setdefault((r["impl"], r.get("variant", "default")), {}).setdefault(
                    mode, []).append(math.log(sp))
    return {k: {m: (math.exp(sum(v) / len(v)), len(v)) for m, v in d.items()}
            for k, d in acc.items()}


def config_name(r, with_heads=False):
    """A row's config: family-crR-TT, with -HH when the run set --heads."""
    name = f"{r['family']}-cr{r['ratio']}-T{r['T']}"
    return f"{name}-H{r['H']}" if with_heads and r.get("H") is not None else name


def print_heads_table(rows):
    """One line per (config, idx, H), one cell per impl (and variant): fwd / step ms."""
    cols, cells, order = [], {}, []
    for r in rows:
        if r.get("impl") == "-":
            continue
        col = r["impl"] if r.get("variant", "default") == "default" else \
            f"{r['impl']}:{r['variant']}"
        if col not in cols:
            cols.append(col)
        line = (f"{r['family']}-cr{r['ratio']}-T{r['T']}", r["idx"], r.get("H"))
        if line not in cells:
            order.append(line)
            cells[line] = {}
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        cells[line][col] = ("error" if "error" in r else
                            f"{f(r.get('fwd_ms'))} / {f(r.get('step_ms'))}")
    print("\n## Per head count: fwd / step ms")
    print("| config | idx | H | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for line in order:
        print(f"| {line[0]} | {line[1]} | {line[2]} | "
              + " | ".join(cells[line].get(c, "-") for c in cols) + " |")


def print_table(rows, meta, over="xla", with_heads=False):
    print(f"\n## CSA benchmark: {meta['device']}, jax {meta['jax']}, {meta['date']}, B=1, bf16, "
          f"{meta.get('timing', 'synced')} timing")
    print(f"TF/s nominal (valid); speedup = {over} ms / impl ms; err = max rel err vs xla over "
          "o, lse, dq, dkv, dsink")
    hdr = ("| config | idx | impl | variant | fwd ms | bwd ms | step ms | fwd TF/s | bwd TF/s "
           "| step TF/s | speedup f/b/s | err |")
    print(hdr)
    print("|" + "---|" * 12)
    f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)
    for r in rows:
        name = config_name(r, with_heads)
        if "error" in r:
            print(f"| {name} | {r['idx']} | {r['impl']} | {r.get('variant', '-')} | ERROR: "
                  f"{r['error'][:120]} |")
            continue
        tf = lambda m: (f"{f(r.get(f'{m}_tflops_nominal'), '{:.0f}')} "
                        f"({f(r.get(f'{m}_tflops_valid'), '{:.0f}')})")
        sp = "/".join(f(r.get(f"{m}_speedup"), "{:.1f}") for m in ("fwd", "bwd", "step"))
        errs = r.get("rel_err")
        err = "-" if not errs else f"{max(errs.values()):.1e}"
        if "check_error" in r:
            err = "check failed"
        print(f"| {name} | {r['idx']} | {r['impl']} | {r.get('variant', '-')} | "
              f"{f(r.get('fwd_ms'))} | {f(r.get('bwd_ms'))} | {f(r.get('step_ms'))} | "
              f"{tf('fwd')} | {tf('bwd')} | {tf('step')} | {sp} | {err} |")
    gm = geomeans(rows, over)
    if gm:
        print(f"\nGeometric mean speedup over {over} (configs where both ran)")
        print("| impl | variant | fwd | bwd | step |")
        print("|---|---|---|---|---|")
        for (impl, var), d in sorted(gm.items()):
            cell = lambda m: (f"{d[m][0]:.2f}x ({d[m][1]})" if m in d else "-")
            print(f"| {impl} | {var} | {cell('fwd')} | {cell('bwd')} | {cell('step')} |")


if __name__ == "__main__":
    main()
