"""Launch resources of the pallas_triton kernels: grid, threads and shared memory per kernel.

    PYTHONPATH=. python3 benchmarks/triton_resources.py [--family pro] [--ratio 4] [--seq 4096] \
        [--variants 'name:key=val,...;...'] [--out $OUT/resources.json]

Each variant's forward and backward is compiled (not run) with XLA dumping to a temporary
folder (XLA_FLAGS, set before the backend starts); the thunk sequence XLA writes names every
Triton launch with its grid, threads per program and the shared memory Triton asked for. A
variant whose shared memory is over the limit shows the compiler's error instead.

Registers per thread and spills are not in XLA's dump (it holds no PTX for the Triton kernels;
seen on the H200 with jax 0.11.2). They come from Nsight Compute (benchmarks/triton_ncu.sh) or,
without a GPU and for the AMD targets too, from the CPU compile report:
`python -m benchmarks.gluon_resources --kernels triton` (docs/perf/gpu_resources.md).
Needs a GPU. Table last, JSON with --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import parse_variants
from csa_jax import problems
from csa_jax.kernels import triton as pallas_triton
from csa_jax.config import preset



def compile_launches(fn, args, dump_root):
    """The thunk-sequence lines naming csa kernels that compiling fn adds to dump_root."""
    before = set(glob.glob(os.path.join(dump_root, "**", "*"), recursive=True))
    jax.jit(fn).lower(*args).compile()
    new = sorted(set(glob.glob(os.path.join(dump_root, "**", "*"), recursive=True)) - before)
    lines = []
    for path in (p for p in new if p.endswith("thunk_sequence.txt")):
        lines += [ln.strip()[:400] for ln in open(path) if "csa" in ln]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="pro")
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dump_root = tempfile.mkdtemp(prefix="csa_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_root}"
                               " --xla_dump_hlo_as_text").strip()
    if jax.devices()[0].platform != "gpu":   # the backend starts here, with the flags above
        sys.exit(f"needs a GPU (found platform {jax.devices()[0].platform!r})")
    cfg = preset(args.family, args.ratio)
    pr = problems.make_problem(cfg, args.seq, B=1, dtype=jnp.bfloat16, seed=0,
                               index_mode="causal")
    q, kv, idx, sink, do = pr.q, pr.kv, pr.idx, pr.sink, pr.do
    lse = jnp.zeros(q.shape[:3], jnp.float32)
    rows = []
    for name, over in parse_variants(args.variants):
        base = pallas_triton.default_config(q.shape, kv.shape, idx.shape, q.dtype)
        c = dataclasses.replace(base, **over)
        kw = dict(scale=cfg.scale, interpret=False, config=c)
        for part, fn, fargs in (
                ("fwd", functools.partial(pallas_triton.forward, **kw), (q, kv, idx, sink)),
                ("bwd", functools.partial(pallas_triton.backward, **kw),
                 (q, kv, idx, sink, q, lse, do, lse))):
            row = dict(variant=name, part=part, config=repr(c))
            try:
                row["launches"] = compile_launches(fn, fargs, dump_root)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                command="python3 " + " ".join(sys.argv),
                problem=f"{args.family} cr{args.ratio} T={args.seq} B=1 bf16")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n## pallas_triton launches (XLA thunk sequence): {meta['device']}, {meta['problem']}")
    print("| variant | part | launch (kernel, grid, threads, shared memory) |")
    print("|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['part']} | ERROR: {r['error'][:200]} |")
        for ln in r.get("launches", []):
            print(f"| {r['variant']} | {r['part']} | {ln.split('kCustomKernel')[-1].strip()} |")


if __name__ == "__main__":
    main()
