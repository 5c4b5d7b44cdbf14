"""Where the pallas_triton forward spends its time: the kernel with one stage left out or swapped.

    PYTHONPATH=. python3 benchmarks/triton_fwd_probe.py [--problems pro-cr4-16384,pro-cr0-16384] \
        [--probes full,contig,hot,nosoftmax,loadonly,noloop] [--variants 'name:key=val,...;...'] \
        [--reps 5] [--out $OUT/probe.json]

Every probe runs under the very launch of `impl="pallas_triton"` (same grid, block specs, tile
loop bounds, compiler parameters; `csa_jax.kernels.triton.testing.forward_with_kernel(...,
kernel=probe)`); only the body of the tile loop differs:

  full       the library's kernel (checked against impl="xla" on the same inputs: o and lse)
  contig     the same number of rows per tile, but read as one contiguous run of kv rows
             (pl.ds) instead of the pointer gather: the cost of gathering (on the H200 with
             the default tiles Triton asks 262,656 B of shared memory for it: no compile)
  hot        the pointer gather of rows 0..block_k-1 in every tile (L1/L2-resident): compute
             and load issue without memory traffic
  nosoftmax  gathered rows, both products, but P = S (no max, exp, rescale): the softmax's cost
  loadonly   gathered rows summed into a [1, D] accumulator, no products: the gather alone
  noloop     no tile loop at all: q load, o / lse store and the launch

Probe outputs other than `full` are meaningless numbers; only their times matter. Problems are
`family-crR-T` (cr4 uses the causal indexer top-k of csa_jax.problems). TF/s are nominal forward
FLOPs of the problem over the probe's time, for comparison only. Table last; JSON with --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax.experimental.pallas import triton as pltriton

from benchmarks.common import flops, make_problem, parse_variants, time_fn
from csa_jax import blockmath, problems
from csa_jax.kernels import triton as pallas_triton
from csa_jax.kernels.triton import testing as tt
from csa_jax.reference import forward as xla_forward



def _loop_probe(tile_fn):
    """A forward kernel whose tile step is tile_fn(i, q, carry, idx_ref, kv_ref, bk, ...)."""
    def kernel(ntiles_ref, idx_ref, q_ref, kv_ref, sink_ref, o_ref, lse_ref, *, scale, bk,
               precision):
        q = q_ref[...]
        hb, D = q.shape
        body = functools.partial(tile_fn, q=q, idx_ref=idx_ref, kv_ref=kv_ref, bk=bk,
                                 scale=scale, precision=precision)
        m, l, acc = lax.fori_loop(0, ntiles_ref[...], body, blockmath.init_state((hb,), D))
        tt.fwd_store(o_ref, lse_ref, sink_ref, m, l, acc)
    return kernel


def _contig(i, carry, *, q, idx_ref, kv_ref, bk, scale, precision):
    ids = idx_ref[pl.ds(i * bk, bk)]
    valid = ids >= 0
    n = kv_ref.shape[0]
    base = jnp.clip(idx_ref[0], 0, n - bk)                 # any in-range run of rows
    rows = kv_ref[pl.ds(jnp.minimum(base + i * bk, n - bk), bk), :]
    return tt.fwd_step(carry, q, rows, valid, scale=scale, precision=precision)


def _hot(i, carry, *, q, idx_ref, kv_ref, bk, scale, precision):
    valid = idx_ref[pl.ds(i * bk, bk)] >= 0
    ids = (i * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)) % bk       # rows 0..bk-1
    rows = tt.gather_rows(kv_ref, ids, valid)
    return tt.fwd_step(carry, q, rows, valid, scale=scale, precision=precision)


def _nosoftmax(i, carry, *, q, idx_ref, kv_ref, bk, scale, precision):
    m, l, acc = carry
    rows, valid = tt.gather_tile(idx_ref, kv_ref, i * bk, bk)
    s = pltriton.dot(q, rows, trans_b=True, precision=precision) * scale
    p = jnp.where(valid[None, :], s, 0.0)
    acc = acc + pltriton.dot(p.astype(rows.dtype), rows, precision=precision)
    return m, l + 1.0, acc


def _loadonly(i, carry, *, q, idx_ref, kv_ref, bk, scale, precision):
    m, l, acc = carry
    rows, _ = tt.gather_tile(idx_ref, kv_ref, i * bk, bk)
    acc = acc + jnp.sum(rows.astype(jnp.float32), axis=0, keepdims=True)  # [1, D] broadcast
    return m, l + 1.0, acc


def _noloop(ntiles_ref, idx_ref, q_ref, kv_ref, sink_ref, o_ref, lse_ref, *, scale, bk,
            precision):
    q = q_ref[...].astype(jnp.float32)
    m, l, _ = blockmath.init_state((q.shape[0],), q.shape[1])
    tt.fwd_store(o_ref, lse_ref, sink_ref, m, l + 1.0, q)


PROBES = {
    "full": None,   # pallas_triton's own kernel
    "contig": _loop_probe(_contig),
    "hot": _loop_probe(_hot),
    "nosoftmax": _loop_probe(_nosoftmax),
    "loadonly": _loop_probe(_loadonly),
    "noloop": _noloop,
}


def parse_problem(s):
    family, ratio, T = s.split("-")
    if not ratio.startswith("cr"):
        raise ValueError(f"problem {s!r}: expected family-crR-T, e.g. pro-cr4-16384")
    return family, int(ratio[2:]), int(T)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]
    ap.add_argument("--problems", type=csv, default=["pro-cr4-16384", "pro-cr0-16384"])
    ap.add_argument("--probes", type=csv, default=list(PROBES))
    ap.add_argument("--variants", default="", help="'name:key=val,...;...' config overrides")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-cap", type=float, default=2.0)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bad = [p for p in args.probes if p not in PROBES]
    if bad:
        ap.error(f"unknown probe(s) {bad}; choose from {sorted(PROBES)}")
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, jax=jax.__version__, command="python3 " + " ".join(
        sys.argv), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(f"# {meta}", flush=True)
    rows = []
    for spec in args.problems:
        family, ratio, T = parse_problem(spec)
        cfg, q, kv, idx, sink, _ = make_problem(family, ratio, T, "causal", 0)
        nominal, valid = flops(cfg, T, idx)
        ref = jax.jit(functools.partial(xla_forward, scale=cfg.scale))(q, kv, idx, sink)
        for vname, over in parse_variants(args.variants):
            c = dataclasses.replace(pallas_triton.default_config(q.shape, kv.shape, idx.shape, q.dtype),
                                    **over)
            for probe in args.probes:
                row = dict(problem=spec, variant=vname, probe=probe, config=repr(c))
                fn = jax.jit(functools.partial(tt.forward_with_kernel, scale=cfg.scale,
                                               interpret=args.interpret, config=c,
                                               kernel=PROBES[probe]))
                try:
                    ms, n, _, out = time_fn(fn, (q, kv, idx, sink), args.reps, args.time_cap)
                    row.update(ms=ms, reps=n, tflops_nominal=nominal / ms / 1e9,
                               tflops_valid=valid / ms / 1e9)
                    if probe == "full":
                        row["rel_err"] = {k: problems.rel_err(a, b)
                                          for k, a, b in zip(("o", "lse"), out, ref)}
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n## pallas_triton forward probes: {meta['device']}, jax {meta['jax']}, "
          f"{meta['date']}, B=1, bf16")
    print("| problem | variant | probe | ms | vs full | TF/s nominal (valid) | err o/lse |")
    print("|---|---|---|---|---|---|---|")
    full = {(r["problem"], r["variant"]): r.get("ms") for r in rows if r["probe"] == "full"}
    for r in rows:
        if "error" in r:
            print(f"| {r['problem']} | {r['variant']} | {r['probe']} | ERROR: "
                  f"{r['error'][:120]} |")
            continue
        base = full.get((r["problem"], r["variant"]))
        rel = f"{r['ms'] / base:.2f}x" if base else "-"
        err = r.get("rel_err")
        err = "-" if not err else f"{err['o']:.1e}/{err['lse']:.1e}"
        print(f"| {r['problem']} | {r['variant']} | {r['probe']} | {r['ms']:.2f} | {rel} | "
              f"{r['tflops_nominal']:.0f} ({r['tflops_valid']:.0f}) | {err} |")
    return rows


if __name__ == "__main__":
    main()
