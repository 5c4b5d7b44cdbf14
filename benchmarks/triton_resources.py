"""Compiler resource report of the pallas_triton kernels: registers, spills, threads per kernel.

    PYTHONPATH=. python3 benchmarks/triton_resources.py [--family pro] [--ratio 4] [--seq 4096] \
        [--variants 'name:key=val,...;...'] [--out $OUT/resources.json]

Each variant's forward and backward is compiled (not run) with XLA's dump directory set for that
compilation only; the module's PTX (the Triton kernels are linked into it; taken from the dump,
or cut out of the serialized executable when the dump has none) is assembled again with
`ptxas -v` for its target, which prints per kernel the registers per thread, the stack frame and
the spill stores / loads. The dump's thunk lines naming the kernels are kept in the JSON. Threads per block come from
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


def parse_ptxas_log(log):
    """{kernel: {registers, stack, spill_stores, spill_loads}} from the text of `ptxas -v`."""
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
    return out


_OPS = {"wgmma": r"\bwgmma\.mma_async", "mma_sync": r"\bmma\.sync",
        "cp_async": r"\bcp\.async\.(?:ca|cg)", "ld_local": r"\bld\.local",
        "st_local": r"\bst\.local", "ld_global": r"\bld\.global"}


def ptx_op_counts(text):
    """{kernel: {op: count}} of static PTX instructions per .entry: which matrix instruction
    Triton chose (wgmma is Hopper's; mma.sync the Ampere path), async copies, local memory."""
    out = {}
    parts = re.split(r"(?=^\.(?:visible\s+)?\.?entry\s)", text, flags=re.M)
    for part in parts:
        name = re.match(r"\.(?:visible\s+)?\.?entry\s+(\w+)", part)
        if name:
            out[name.group(1)] = {k: len(re.findall(v, part)) for k, v in _OPS.items()}
    return out


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
    out = parse_ptxas_log(log)
    ops = ptx_op_counts(text)
    for k, v in out.items():
        v["threads"] = threads.get(k)
        v["arch"] = arch
        v["ptx_ops"] = ops.get(k, {})
    if res.returncode != 0:
        out["_ptxas_error"] = {"log": log[-2000:]}
    return out


def _text_blocks(blob, start_marker):
    """ASCII runs of `blob` that start with start_marker (PTX is plain text inside the
    serialized executable; it ends at the first byte that is not printable text)."""
    out, i = [], blob.find(start_marker)
    while i >= 0:
        j = i
        while j < len(blob) and (32 <= blob[j] < 127 or blob[j] in (9, 10, 13)):
            j += 1
        out.append(blob[i:j].decode())
        i = blob.find(start_marker, j)
    return out


def compile_dump(fn, args, dump_root):
    """PTX files of fn's compiled executable, and the thunk lines that name csa kernels.

    The whole process dumps to dump_root (XLA_FLAGS, set in main before the backend starts);
    the files a compilation adds are its own. If XLA wrote no PTX, it is cut out of the
    serialized executable when it is there."""
    before = set(glob.glob(os.path.join(dump_root, "**", "*"), recursive=True))
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"compile failed: {e!r}") from e
    new = sorted(set(glob.glob(os.path.join(dump_root, "**", "*"), recursive=True)) - before)
    ptx = [p for p in new if p.endswith(".ptx")]
    if not ptx:
        from jax.experimental.serialize_executable import serialize
        blob = serialize(compiled)[0]
        tag = len(before)
        for n, text in enumerate(_text_blocks(blob, b"//\n// Generated by LLVM NVPTX")):
            path = os.path.join(dump_root, f"serialized_{tag}_{n}.ptx")
            with open(path, "w") as f:
                f.write(text)
            ptx.append(path)
    thunks = []
    for path in (p for p in new if p.endswith("thunk_sequence.txt")):
        thunks += [ln.strip()[:400] for ln in open(path) if "csa" in ln]
    return ptx, thunks, [os.path.basename(p) for p in new]


def ops_cell(ops):
    if not ops:
        return "-"
    return " / ".join(str(ops.get(k, "-")) for k in ("wgmma", "mma_sync", "cp_async", "ld_local"))


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
            try:
                ptx, row["thunks"], files = compile_dump(fn, fargs, dump_root)
                row["ptx_files"] = [os.path.basename(p) for p in ptx]
                kernels = {}
                for p in ptx:
                    kernels.update(ptxas_report(ptxas, p))
                row["kernels"] = kernels
                if not kernels:
                    row["error"] = "no PTX found; new dump files: " + ", ".join(
                        f for f in files if "module" in f and "jit_" in f)[:300]
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
    print("\nKernel launches (XLA thunk sequence: grid, threads, Triton's shared memory):")
    for r in rows:
        for ln in r.get("thunks", []):
            print(f"  {r['variant']} {r['part']}: {ln.split('kCustomKernel')[-1].strip()}")
    print(f"\n## pallas_triton compiler resources: {meta['device']}, {meta['problem']}")
    print("| variant | part | kernel | threads | registers/thread | stack B | spill stores B "
          "| spill loads B | PTX wgmma / mma.sync / cp.async / ld.local |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['part']} | ERROR: {r['error'][:150]} |")
        for k, v in sorted(r.get("kernels", {}).items()):
            print(f"| {r['variant']} | {r['part']} | {k} | {v.get('threads')} | "
                  f"{v.get('registers')} | {v.get('stack')} | {v.get('spill_stores')} | "
                  f"{v.get('spill_loads')} | {ops_cell(v.get('ptx_ops'))} |")


if __name__ == "__main__":
    main()
