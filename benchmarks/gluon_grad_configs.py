"""Gradients of impl="gluon" vs impl="xla" at the V4 grid configs, both cotangents (GPU).

    python -m benchmarks.gluon_grad_configs [--configs pro:4:16384,flash:0:4096,...]
        [--cr4-indices causal,random] [--impl gluon] [--ref xla] [--config key=val,...]
        [--seed S] [--out f.json]

For each config (family:ratio:T; default: all 18 of Flash / Pro x cr0 / cr4 / cr128 x
T = 16384, 4096, 8192, in that order of T) and, for cr4, each index mode of --cr4-indices
(bench_csa's: causal = window + the lightning indexer's top-k, random = window + uniform pool
ids), the inputs are csa_jax.problems.make_problem's (bf16, B = 1, random q / kv / sink /
dO / dlse: BOTH cotangents nonzero). Each impl runs as the user gets it:
jax.vjp of csa_jax.sparse_attention(impl=...) with config=None (the registry's default_config),
under jax.jit, pulling back (dO, dlse). --config: `layout=auto` passes the row's own promise
as the NNX layer does (sparse_attention(layout=csa_jax.Layout("cr<ratio>", window,
pool_ratio)): cr0 runs gluon's window kernel); other key=val pairs override fields of the
checked impl's Config (gluon: block_k, stages, bwd, bwd_block_k, bwd_stages). The reference
runs without either. Compared per output, o, lse, dq, dkv, dsink:
max |got - ref| / max |ref| (gluon_check.rel's measure, over the entries where ref is
finite; a NaN in got, or non-finite entries in other places than ref's, is a failure), against
gluon_check.TOL of the dtype (bf16 2e-2). The impl runs twice: dkv and dq must be
bit-identical across the two runs.
One JSON line per (config, index mode), printed as it finishes (a killed run keeps its rows;
--out is rewritten after each row); a failure also prints a `# FAIL <config>: <output> ...`
line naming the config and the output; an exception is a failed row with the stage (inputs /
impl / ref / compare) and the error. Memory is freed between configs (the xla reference is
chunked, but one of its allocations at Pro cr0 T = 16384 is 11.5 GiB). The summary table is
printed last; exit status 1 if any row failed.
Run ONE such process on a GPU at a time: six at once (XLA_PYTHON_CLIENT_PREALLOCATE=false,
2026-12-01 at 8bfe8bb) ran out of device memory at T = 16384, each process's allocator
keeping its own peak (docs/perf/gluon_bwd_h200.md part 5d); alone, the Pro cr4 (2 index
modes) + cr0 T = 16384 rows took 21 s.
--impl / --ref choose other registered impls (e.g. a CPU dry run of the plumbing:
--impl xla --ref xla --configs flash:0:256).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_diff_stats
from benchmarks.gluon_check import TOL, parse_shapes

OUTS = ("o", "lse", "dq", "dkv", "dsink")
FAMILIES, RATIOS, SEQS = ("flash", "pro"), (0, 4, 128), (16384, 4096, 8192)
ALL = ",".join(f"{f}:{r}:{t}" for t in SEQS for f in FAMILIES for r in RATIOS)


def vjp_fn(impl, scale, config=None, layout=None):
    """jit(q, kv, idx, sink, do, dlse) -> {o, lse, dq, dkv, dsink}: the forward and the vjp of
    sparse_attention (with `config` and the `layout` promise) pulling back both cotangents
    (dO, dlse)."""
    import csa_jax

    def run(q, kv, idx, sink, do, dlse):
        attn = lambda q, kv, s: csa_jax.sparse_attention(q, kv, idx, s, scale=scale, impl=impl,
                                                         config=config, layout=layout)
        (o, lse), pull = jax.vjp(attn, q, kv, sink)
        dq, dkv, dsink = pull((do, dlse))
        return dict(o=o, lse=lse, dq=dq, dkv=dkv, dsink=dsink)

    return jax.jit(run)


def rel_err(a, b):
    """gluon_check.rel's max-abs error over max-abs reference (ref's finite entries); NaN if a
    has a NaN, inf if a is non-finite where b is finite or the reverse."""
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} vs reference {b.shape}")
    diff, den, nan, moved = (np.asarray(x) for x in device_diff_stats(a, b))
    if nan:
        return float("nan")
    if moved:
        return float("inf")
    return float(diff) / max(float(den), 1e-30)


def bits_equal(a, b):
    """a and b hold the same bits (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(a.dtype).itemsize]
    return bool(jnp.array_equal(jax.lax.bitcast_convert_type(a, u),
                                jax.lax.bitcast_convert_type(b, u)))


def compare(got, ref, tol):
    """{output: rel error} and the outputs whose error is over tol (or NaN / inf)."""
    errs = {n: rel_err(got[n], ref[n]) for n in OUTS}
    return errs, [n for n in OUTS if not errs[n] <= tol]


def check_problem(pr, impl_fn, ref_fn, *, name, tol=None):
    """One row: impl_fn twice (bit identity of dkv / dq) and ref_fn on problem pr's inputs."""
    args = (pr.q, pr.kv, pr.idx, pr.sink, pr.do, pr.dlse)
    tol = TOL[jnp.dtype(pr.q.dtype).name] if tol is None else tol
    row = dict(config=name, tol=tol)
    stage = "impl"
    try:
        t0 = time.perf_counter()
        got = jax.block_until_ready(impl_fn(*args))
        row["impl_first_s"] = round(time.perf_counter() - t0, 2)
        again = jax.block_until_ready(impl_fn(*args))
        row["bit_identical"] = {n: bits_equal(got[n], again[n]) for n in ("dkv", "dq")}
        del again
        stage = "ref"
        t0 = time.perf_counter()
        ref = jax.block_until_ready(ref_fn(*args))
        row["ref_first_s"] = round(time.perf_counter() - t0, 2)
        stage = "compare"
        row["errs"], bad = compare(got, ref, tol)
        del got, ref
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(limit=4)
        row.update(ok=False, failed=[stage], error=f"{stage}: {type(e).__name__}: {e}"[:500])
        return row
    bad += [f"{n} not bit-identical" for n, same in row["bit_identical"].items() if not same]
    row.update(failed=bad, ok=not bad)
    return row


def emit_row(rows, row, out=None, meta=None):
    """Append and print a row; a failed one also prints `# FAIL <config>: <what>`."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    if not row["ok"]:
        what = row.get("error") or ", ".join(
            f"{n} {row['errs'][n]:.2e} > {row['tol']:g}" if n in row.get("errs", {}) else n
            for n in row["failed"])
        print(f"# FAIL {row['config']}: {what}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


def layer_layout(c):
    """The promise the NNX layer passes for preset c (csa_jax/layers.py, the layer's `layout`)."""
    import csa_jax
    if c.ratio == 0:
        return csa_jax.Layout("cr0", window=c.window)
    if c.ratio == 4:
        return csa_jax.Layout("cr4", window=c.window)
    return csa_jax.Layout("cr128", window=c.window, pool_ratio=c.ratio)


def run(configs, cr4_indices, impl, ref, overrides, seed, out=None, meta=None):
    from csa_jax import problems, registry
    from csa_jax.config import preset
    from benchmarks.common import apply_overrides
    rows = []
    emit = lambda row: emit_row(rows, row, out, meta)
    overrides = dict(overrides)
    auto = overrides.pop("layout", None) == "auto"
    if "layout" in overrides or {"window", "pool_ratio"} & set(overrides):
        raise ValueError("--config: the layout promise is `layout=auto` (the row's own); "
                         "layout / window / pool_ratio are not overrides")
    for family, ratio, T in configs:
        c = preset(family, ratio)
        base = dict(family=family, ratio=ratio, T=T, impl=impl, ref=ref, seed=seed)
        promise = layer_layout(c) if auto else None
        cfg = None
        if overrides:
            mod = registry.get(impl)
            H, D = c.num_heads, c.head_dim
            cfg = apply_overrides(mod, mod.default_config((1, T, H, D), None, (0, 0, 0),
                                                          jnp.bfloat16, promise),
                                  (1, T, H, D), overrides)
        impl_fn, ref_fn = vjp_fn(impl, c.scale, cfg, promise), vjp_fn(ref, c.scale)
        for mode in (cr4_indices if ratio == 4 else ["causal"]):
            name = f"{family}-cr{ratio}-T{T}" + (f"-{mode}" if ratio == 4 else "")
            try:
                pr = problems.make_problem(c, T, B=1, dtype=jnp.bfloat16, seed=seed,
                                           index_mode=mode)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=4)
                emit(dict(base, config=name, idx=mode, ok=False, failed=["inputs"],
                          error=f"inputs: {type(e).__name__}: {e}"[:500]))
                continue
            t0 = time.perf_counter()
            row = check_problem(pr, impl_fn, ref_fn, name=name)
            if cfg is not None or impl == "gluon":
                mod = registry.get(impl)
                row["impl_config"] = repr(cfg or mod.default_config(
                    pr.q.shape, pr.kv.shape, pr.idx.shape, pr.q.dtype, promise))
            emit(dict(base, idx=mode, K=pr.K, N=pr.kv.shape[1], **row,
                      wall_s=round(time.perf_counter() - t0, 2)))
            del pr
            gc.collect()
        del impl_fn, ref_fn
        jax.clear_caches()           # the executables (and their buffers) of this (config, T)
        gc.collect()
    return rows


def summary(rows):
    print("\n| config | ok | o | lse | dq | dkv | dsink | dkv/dq bit-identical | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e = r.get("errs", {})
        cell = lambda n: f"{e[n]:.1e}" if n in e else "-"
        bi = r.get("bit_identical")
        bi = "-" if bi is None else f"{'yes' if bi['dkv'] else 'NO'}/{'yes' if bi['dq'] else 'NO'}"
        ok = "ok" if r["ok"] else "FAIL: " + ", ".join(r["failed"])
        print(f"| {r['config']} | {ok} | " + " | ".join(cell(n) for n in OUTS)
              + f" | {bi} | {r.get('wall_s', '-')} |")
    bad = [r["config"] for r in rows if not r["ok"]]
    print(f"# {len(rows)} configs, {len(bad)} failed" + (f": {', '.join(bad)}" if bad else ""),
          flush=True)
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=ALL,
                    help="comma list of family:ratio:T (default: the 18 grid configs)")
    ap.add_argument("--cr4-indices", default="causal,random",
                    help="index modes of the cr4 configs (csa_jax.problems.INDEX_MODES)")
    ap.add_argument("--impl", default="gluon", help="the impl checked (default gluon)")
    ap.add_argument("--ref", default="xla", help="the reference impl (default xla)")
    ap.add_argument("--config", default="",
                    help="layout=auto (pass the row's layout promise, as the NNX layer does) "
                         "and key=val,... overrides of the impl's default Config; default "
                         "none: the user's defaults")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                    help="make_problem's seed (default: from the clock; printed)")
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every row")
    args = ap.parse_args(argv)
    from benchmarks.common import apply_overrides, parse_overrides
    from csa_jax.problems import INDEX_MODES
    try:
        configs = parse_shapes(args.configs)
    except ValueError:
        ap.error(f"--configs {args.configs!r}: expected family:ratio:T,...")
    for f, r, t in configs:
        if f not in FAMILIES or r not in RATIOS or t <= 0:
            ap.error(f"--configs: {f}:{r}:{t} is not a grid layer type (flash|pro : 0|4|128 : T)")
    modes = [m for m in args.cr4_indices.split(",") if m]
    if set(modes) - set(INDEX_MODES) or not modes:
        ap.error(f"--cr4-indices {args.cr4_indices!r}: modes are {INDEX_MODES}")
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                seed=args.seed, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="python -m benchmarks.gluon_grad_configs " + " ".join(sys.argv[1:]))
    print(f"# {json.dumps(meta)}", flush=True)
    over = parse_overrides(args.config)
    try:         # a field the Config lacks, a value it refuses: refused before any row runs
        from csa_jax import registry
        mod = registry.get(args.impl)
        rest = {k: v for k, v in over.items() if (k, v) != ("layout", "auto")}
        if rest:
            apply_overrides(mod, mod.default_config((1, 64, 64, 512), None, (0, 0, 0),
                                                    jnp.bfloat16), None, rest)
        if {"layout", "window", "pool_ratio"} & set(rest):
            raise ValueError("the layout promise is `layout=auto` (the row's own); layout / "
                             "window / pool_ratio are not overrides")
    except (TypeError, ValueError) as e:
        ap.error(f"--config {args.config!r}: {e}")
    rows = run(configs, modes, args.impl, args.ref, over, args.seed, args.out, meta)
    return summary(rows)


if __name__ == "__main__":
    sys.exit(main())
