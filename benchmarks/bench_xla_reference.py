"""Tune the XLA reference: chunk size and dkv strategy, on a few V4 shapes, in one call.

    PYTHONPATH=. python3 benchmarks/bench_xla_reference.py [--shapes flash-cr4-T4096,...]
        [--chunks auto,256,512,1024,2048] [--dkv inverse_map,scatter] [--out DIR]

Checks the reference against the unchunked autodiff oracle first (python -m csa_jax's check), then
times forward for every chunk size and the step for every (chunk, dkv) pair; prints a table last
and writes bench_xla_reference.json under --out (default $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from csa_jax import reference
from csa_jax.__main__ import check, format_table, parse_args, run_one
from csa_jax.config import BENCHMARK_GRID
from csa_jax.problems import make_problem


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="flash-cr4-T4096,pro-cr4-T4096,pro-cr0-T4096")
    ap.add_argument("--chunks", default="auto,128,256,512,1024,2048")
    ap.add_argument("--dkv", default="inverse_map,scatter")
    ap.add_argument("--indices", default="random")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    grid = {s.name: s for s in BENCHMARK_GRID}
    bad = [s for s in a.shapes.split(",") if s not in grid]
    if bad:
        sys.exit(f"unknown shape(s) {bad}; choose from {sorted(grid)}")
    args = parse_args(["--impl", "xla", "--reps", str(a.reps), "--indices", a.indices])
    rows = []
    for name in a.shapes.split(","):
        shape = grid[name]
        cfg, T = shape.config, shape.seq_len
        ok, errs = check(cfg, "xla", args, a.indices)
        print(f"check {cfg.name}: {'ok' if ok else 'FAIL'} {errs}", flush=True)
        pr = make_problem(cfg, T, dtype=jnp.bfloat16, index_mode=a.indices)
        for chunk in a.chunks.split(","):
            ct = None if chunk == "auto" else int(chunk)
            for i, dkv in enumerate(a.dkv.split(",")):
                cfgx = reference.Config(chunk_tokens=ct, dkv=dkv)
                row = run_one(cfg, T, "xla", args, a.indices, config=cfgx, problem=pr)
                row.update(impl=f"xla/{chunk}/{dkv}", chunk=chunk, dkv=dkv,
                           check="ok" if ok else "FAIL")
                rows.append(row)
                print(row.get("error") or f"{name} chunk={chunk} dkv={dkv}: fwd "
                      f"{row['fwd_ms']:.2f} ms step {row['step_ms']:.2f} ms", flush=True)
        with open(os.path.join(a.out, "bench_xla_reference.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    print()
    print(format_table(rows))


if __name__ == "__main__":
    main()
