"""Compiler resource report of the pallas_triton kernels: registers, spills, threads per kernel.

    PYTHONPATH=. python3 benchmarks/triton_resources.py [--family pro] [--ratio 4] [--seq 4096] \
        [--variants 'name:key=val,...;...'] [--out $OUT/resources.json]

Each variant's forward and backward is compiled (not run) with XLA's dump directory set for that
compilation only; the PTX that XLA dumps (the Triton kernels are linked into the module's PTX) is
then assembled again with `ptxas -v` for the dumped target, which prints per kernel the
registers per thread, the stack frame and the spill stores / loads. Threads per block come from
the PTX's .maxntid. Shared memory is allocated dynamically by Triton and is not in this report.
Needs a CUDA GPU (the dump is NVIDIA PTX) and a ptxas binary: PATH, $PTXAS, or the
nvidia-cuda-nvcc pip package that jax[cuda] installs. Table last, JSON with --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from csa_jax import pallas_triton, problems
from csa_jax.config import preset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_csa import parse_variants  # noqa: E402


def find_ptxas():
    cands = [os.environ.get("PTXAS"), shutil.which("ptxas")]
    try:
        import nvidia  # namespace package of the CUDA pip wheels
        for root in nvidia.__path__:
            cands += glob.glob(os.path.join(root, "cuda_nvcc", "bin", "ptxas"))
    except ImportError:
        pass
    cands += glob.glob("/usr/local/cuda*/bin/ptxas")
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


_PROPS = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, "
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptxas, ptx_path):
    """{kernel: {registers, stack, spill_stores, spill_loads, threads}} of one PTX file."""
    text = open(ptx_path).read()
    target = re.search(r"^\.target\s+(\S+)", text, re.M)
    arch = target.group(1).rstrip(",") if target else "sm_90a"
    threads = {m.group(1): int(m.group(2)) * int(m.group(3) or 1) * int(m.group(4) or 1)
               for m in re.finditer(r"\.entry\s+(\S+)\s*\((?:.|\n)*?\.maxntid\s+(\d+)"
                                    r"(?:,\s*(\d+))?(?:,\s*(\d+))?", text)}
    res = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True)
    log = res.stdout + res.stderr
    out = {}
    for m in _PROPS.finditer(log):
        out.setdefault(m.group(1), {}).update(stack=int(m.group(2)),
                                              spill_stores=int(m.group(3)),
                                              spill_loads=int(m.group(4)))
    for block in re.split(r"(?=ptxas info\s+: Compiling entry function)", log):
        name = re.search(r"Compiling entry function '(\S+)'", block)
        regs = re.search(r"Used (\d+) registers", block)
        if name and regs:
            out.setdefault(name.group(1), {})["registers"] = int(regs.group(1))
    for k, v in out.items():
        v["threads"] = threads.get(k)
        v["arch"] = arch
    if res.returncode != 0:
        out["_ptxas_error"] = {"log": log[-2000:]}
    return out


def compile_dump(fn, args, dump_dir):
    lowered = jax.jit(fn).lower(*args)
    try:
        lowered.compile(compiler_options={"xla_dump_to": dump_dir})
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"compile with xla_dump_to failed: {e!r}") from e
    return sorted(glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="pro")
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        sys.exit(f"needs a CUDA GPU (found platform {jax.devices()[0].platform!r})")
    ptxas = find_ptxas()
    if ptxas is None:
        sys.exit("no ptxas found (PATH, $PTXAS, nvidia-cuda-nvcc wheel, /usr/local/cuda*)")
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
            with tempfile.TemporaryDirectory() as d:
                try:
                    ptx = compile_dump(fn, fargs, d)
                    row["ptx_files"] = [os.path.basename(p) for p in ptx]
                    kernels = {}
                    for p in ptx:
                        kernels.update(ptxas_report(ptxas, p))
                    row["kernels"] = kernels
                    if not ptx:
                        row["error"] = "no .ptx in the dump: " + ", ".join(
                            sorted(os.listdir(d))[:20])
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, ptxas=ptxas,
                command="python3 " + " ".join(sys.argv), problem=f"{args.family} cr{args.ratio} "
                f"T={args.seq} B=1 bf16")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n## pallas_triton compiler resources: {meta['device']}, {meta['problem']}")
    print("| variant | part | kernel | threads | registers/thread | stack B | spill stores B "
          "| spill loads B |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['part']} | ERROR: {r['error'][:150]} |")
        for k, v in sorted(r.get("kernels", {}).items()):
            print(f"| {r['variant']} | {r['part']} | {k} | {v.get('threads')} | "
                  f"{v.get('registers')} | {v.get('stack')} | {v.get('spill_stores')} | "
                  f"{v.get('spill_loads')} |")


if __name__ == "__main__":
    main()
