"""python -m csa_jax: run CSA forward + backward at V4 shapes on random data, check, time, tabulate.

Examples:
    python -m csa_jax                                   # Flash cr4, default length, impl xla
    python -m csa_jax --family pro --ratio 128 --seq-len 8192 --impl xla,pallas_triton
    python -m csa_jax --grid --json out.json            # the paper's 18-shape grid
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import csa_jax
from csa_jax import reference, registry
from csa_jax.config import BENCHMARK_GRID, FAMILIES, PRESET_RATIOS, preset
from csa_jax.problems import INDEX_MODES, loss_fn, make_problem, rel_err

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
CHECK_TOL = {"bf16": (2e-2, 5e-2), "f32": (1e-4, 1e-4)}        # (o, grads) relative


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="csa-bench" if sys.argv[0].endswith("csa-bench") else "python -m csa_jax",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="flash", choices=FAMILIES,
                    help="V4 family: flash (64 heads) or pro (128 heads). Default: flash")
    ap.add_argument("--ratio", type=int, default=4, choices=PRESET_RATIOS,
                    help="layer type: 0 (SWA), 4 (CSA, indexer top-k), 128 (HCA). Default: 4")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens T (default: 4096 on an accelerator, 512 on CPU)")
    ap.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    ap.add_argument("--impl", default="xla",
                    help=f"comma-separated impls to run: {', '.join(registry.choices())} "
                         f"(available here: {', '.join(registry.available_impls())}; "
                         "default: xla)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype")
    ap.add_argument("--indices", default="causal", choices=INDEX_MODES + ("both",),
                    help="cr4 pool lists: causal (top-k of a random lightning indexer), random "
                         "(every slot valid, uniform ids: the convention of published AMD "
                         "numbers; a token may list a row twice), unique (random without "
                         "repeats in a token) or both (causal and random). Default: causal")
    ap.add_argument("--grid", action="store_true",
                    help="run the paper's grid (flash/pro x cr0/cr4/cr128 x T 4096/8192/16384); "
                         "--family/--ratio/--seq-len are then ignored")
    ap.add_argument("--dkv", default=None, choices=reference.DKV_MODES,
                    help="dkv strategy of the xla impl (default: inverse_map, deterministic)")
    ap.add_argument("--check-seq", type=int, default=256,
                    help="length of the correctness check against an unchunked autodiff oracle "
                         "(0 = no check). Default 256")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median). Default 5")
    ap.add_argument("--json", default=None, help="write all rows as JSON to this path")
    args = ap.parse_args(argv)
    for name in ("batch", "reps"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.seq_len is not None and args.seq_len <= 0:
        ap.error(f"--seq-len must be positive, got {args.seq_len}")
    if args.check_seq < 0:
        ap.error(f"--check-seq must be >= 0, got {args.check_seq}")
    impls = [s.strip() for s in args.impl.split(",")]
    if not all(impls):
        ap.error(f"--impl {args.impl!r}: empty name in the list; give e.g. xla or xla,pallas_triton")
    for impl in impls:
        if impl == "auto":
            continue
        try:
            why = registry.get(impl).cannot_run_here()
        except (ValueError, NotImplementedError) as e:  # unknown or reserved name
            why = str(e)
        if why is not None:
            ap.error(f"{why}; available here: {', '.join(registry.available_impls())}")
    args.impls = impls
    if args.json is not None:
        problem = _unwritable(args.json)
        if problem:
            ap.error(f"--json {args.json!r}: {problem}")
    return args


def _unwritable(path) -> str | None:
    """Why `path` cannot be written (checked before the benchmark runs), or None. Leaves no
    file behind."""
    import os

    if not str(path).strip():
        return "empty path"
    if os.path.isdir(path):
        return "is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.remove(path)
    return None


def _write_json(path, rows) -> bool:
    try:
        with open(path, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    except OSError as e:
        print(f"error: cannot write --json {path!r}: {e.strerror or e} (the table below has "
              f"the results)", file=sys.stderr)
        return False
    return True


def _attn(impl, args, scale, config=None):
    if config is None and impl == "xla" and args.dkv:
        config = reference.Config(dkv=args.dkv)
    return lambda q, kv, idx, sink: csa_jax.sparse_attention(
        q, kv, idx, sink, scale=scale, impl=impl, config=config)


def _time(f, fargs, reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*fargs))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(f(*fargs))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*fargs))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, compile_s


def check(cfg, impl, args, mode):
    """Max relative errors (o, lse, grads) of impl against the unchunked autodiff oracle."""
    T = args.check_seq
    pr = make_problem(cfg, T, B=args.batch, dtype=DTYPES[args.dtype], index_mode=mode, seed=1)
    attn = _attn(impl, args, cfg.scale)
    naive = lambda q, kv, idx, sink: reference.naive(q, kv, idx, sink, scale=cfg.scale)
    fargs = (pr.q, pr.kv, pr.sink, pr.idx, pr.do, pr.dlse)
    out = jax.jit(lambda q, kv, sink, idx: attn(q, kv, idx, sink))(pr.q, pr.kv, pr.sink, pr.idx)
    ref = jax.jit(lambda q, kv, sink, idx: naive(q, kv, idx, sink))(
        pr.q.astype(jnp.float32), pr.kv.astype(jnp.float32), pr.sink, pr.idx)
    g = jax.jit(jax.grad(loss_fn(attn), argnums=(0, 1, 2)))(*fargs)
    up = (pr.q.astype(jnp.float32), pr.kv.astype(jnp.float32)) + fargs[2:]
    g_ref = jax.jit(jax.grad(loss_fn(naive), argnums=(0, 1, 2)))(*up)
    errs = {"o": rel_err(out[0], ref[0]), "lse": rel_err(out[1], ref[1])}
    errs.update({k: rel_err(a, b) for k, a, b in zip(("dq", "dkv", "dsink"), g, g_ref)})
    tol_o, tol_g = CHECK_TOL[args.dtype]
    ok = all(errs[k] <= tol_o for k in ("o", "lse")) and all(
        errs[k] <= tol_g for k in ("dq", "dkv", "dsink"))
    return ok, errs


def run_one(cfg, T, impl, args, mode, *, config=None, problem=None, backward=True):
    """Time forward and (optionally) the step of one shape; a row dict, with "error" on failure."""
    row = {"shape": f"{cfg.name}-T{T}", "family": cfg.family, "ratio": cfg.ratio, "T": T,
           "B": args.batch, "impl": impl, "indices": mode if cfg.ratio == 4 else "-",
           "dtype": args.dtype, "device": jax.devices()[0].device_kind}
    try:
        pr = problem or make_problem(cfg, T, B=args.batch, dtype=DTYPES[args.dtype],
                                     index_mode=mode)
        row["K"] = pr.K
        nominal, valid = pr.flops()
        attn = _attn(impl, args, cfg.scale, config)
        fwd = jax.jit(lambda q, kv, sink, idx: attn(q, kv, idx, sink))
        fwd_ms, fwd_c = _time(fwd, (pr.q, pr.kv, pr.sink, pr.idx), args.reps)
        row.update(fwd_ms=fwd_ms, compile_s=fwd_c, fwd_tflops_nominal=nominal / fwd_ms / 1e9,
                   fwd_tflops_valid=valid / fwd_ms / 1e9, valid_frac=valid / nominal)
        if not backward:
            return row
        step = jax.jit(jax.value_and_grad(loss_fn(attn), argnums=(0, 1, 2)))
        step_ms, step_c = _time(step, (pr.q, pr.kv, pr.sink, pr.idx, pr.do, pr.dlse), args.reps)
        bwd_ms = max(step_ms - fwd_ms, 1e-9)
        row.update(bwd_ms=bwd_ms, step_ms=step_ms, compile_s=fwd_c + step_c,
                   bwd_tflops_nominal=2.5 * nominal / bwd_ms / 1e9,
                   bwd_tflops_valid=2.5 * valid / bwd_ms / 1e9)
    except Exception as e:  # one failing shape (e.g. out of memory) must not end the table
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


COLS = [("shape", "{}"), ("impl", "{}"), ("indices", "{}"), ("K", "{}"), ("fwd_ms", "{:.3f}"),
        ("bwd_ms", "{:.3f}"), ("step_ms", "{:.3f}"), ("fwd_tflops_nominal", "{:.1f}"),
        ("fwd_tflops_valid", "{:.1f}"), ("bwd_tflops_nominal", "{:.1f}"),
        ("bwd_tflops_valid", "{:.1f}"), ("check", "{}")]
HEAD = ["shape", "impl", "idx", "K", "fwd ms", "bwd ms", "step ms", "fwd TF/s nom",
        "fwd TF/s valid", "bwd TF/s nom", "bwd TF/s valid", "check"]


def format_table(rows):
    cells = [HEAD]
    for r in rows:
        if "error" in r:
            cells.append([r["shape"], r["impl"], r["indices"], "-", "ERROR: " + r["error"]])
            continue
        cells.append([fmt.format(r[k]) if k in r else "-" for k, fmt in COLS])
    widths = [max(len(c[i]) for c in cells if i < len(c) and len(c) == len(HEAD))
              for i in range(len(HEAD))]
    lines = []
    for c in cells:
        if len(c) != len(HEAD):
            lines.append(" | ".join(c))
        else:
            lines.append(" | ".join(x.rjust(w) for x, w in zip(c, widths)))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    if args.grid:
        shapes = [(s.config, s.seq_len) for s in BENCHMARK_GRID]
    else:
        shapes = [(preset(args.family, args.ratio), args.seq_len or (512 if on_cpu else 4096))]
    modes = ["causal", "random"] if args.indices == "both" else [args.indices]
    print(f"csa_jax {csa_jax.__version__} | jax {jax.__version__} | "
          f"{jax.devices()[0].device_kind} ({jax.default_backend()}) | dtype {args.dtype}",
          flush=True)
    checks = {}
    rows = []
    failed = False
    json_ok = True
    for cfg, T in shapes:
        for mode in (modes if cfg.ratio == 4 else modes[:1]):
            for impl in args.impls:
                key = (cfg.name, impl, mode)
                if args.check_seq and key not in checks:
                    ok, errs = check(cfg, impl, args, mode)
                    checks[key] = "ok" if ok else "FAIL"
                    failed |= not ok
                    print(f"check {cfg.name} {impl} idx={mode} T={args.check_seq}: "
                          f"{'ok' if ok else 'FAIL'} "
                          + " ".join(f"{k}={v:.1e}" for k, v in errs.items()), flush=True)
                row = run_one(cfg, T, impl, args, mode)
                row["check"] = checks.get(key, "-")
                rows.append(row)
                msg = row.get("error") or (f"fwd {row['fwd_ms']:.2f} ms, bwd {row['bwd_ms']:.2f} "
                                           f"ms, compile {row['compile_s']:.0f} s")
                print(f"[{len(rows)}] {row['shape']} {impl} idx={row['indices']}: {msg}",
                      flush=True)
                if args.json and json_ok:  # after every row: a cut-off run keeps what it measured
                    json_ok = _write_json(args.json, rows)
    print()
    print(format_table(rows))
    if failed:
        print("\ncorrectness check FAILED (see the check lines above)", file=sys.stderr)
        return 1
    if any("error" in r for r in rows) or not json_ok:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
