"""The paper's Table 13 on N devices: each Llama-3.1-8B GEMM alone, then with a concurrent
all-gather and a concurrent reduce-scatter of its FSDP payload (the weight [K, N]), for each
collective flavour:

    xla          lax.all_gather / lax.psum_scatter (NCCL on GPU)
    ring         comm.ring_all_gather / ring_psum_scatter: n-1 ppermutes (collective-permutes)
    ring_memcpy  the same rings with --xla_gpu_use_memcpy_local_p2p=true, i.e. local
                 collective-permutes on the copy engines (run in a child process, since XLA reads
                 the flag once per process)

Reported per (shape, flavour, collective): GEMM time alone and concurrent, GEMM slowdown %,
collective time (alone and concurrent) and the fraction of the collective overlapped by GEMM
kernels, all read from a jax.profiler trace of device 0 (kernel intervals), not assumed;
wall-clock medians are printed beside them as a cross-check.

    python -m benchmarks.bench_comm                 # all local devices, full shapes, bf16
    python -m benchmarks.bench_comm --small         # shapes / 32, e.g. on CPU:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.bench_comm --small

On one device there is nothing to communicate; on CPU the collectives run synchronously on the
host, so neither overlap nor copy-engine transfers can be measured: the script still runs every
program and says what it could not measure. NVLink multicast (NCCL_NVLS_ENABLE) is left alone.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# (name, M, N, K): y[M, N] = x[M, K] @ w[K, N]; FSDP payload = w
SHAPES = [
    ("qkv 8kx6kx4k", 8192, 6144, 4096),
    ("o 8kx4kx4k", 8192, 4096, 4096),
    ("up+gate 8kx28kx4k", 8192, 28672, 4096),
    ("down 8kx4kx14k", 8192, 4096, 14336),
]
FLAVOURS = ("xla", "ring", "ring_memcpy")
GEMM_RE = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas|matmul|\bdot|dot[._]|ynn_fusion|custom-call", re.I)
COLL_RE = re.compile(r"nccl|all[-_]?gather|reduce[-_]?scatter|collective[-_]?permute|sendrecv|memcpy|ptop|p2p|"
                     r"rendezvous", re.I)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="divide every GEMM dimension by 32 (CPU / smoke)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on GPU) or float32 (default otherwise)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--flavours", default=",".join(FLAVOURS))
    p.add_argument("--shapes", default=None, help="comma-separated indices into the 4 shapes")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--trace-dir", default=None, help="keep the profiler traces here")
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- trace analysis


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(u):
    return sum(e - s for s, e in u)


def _intersect(a, b):
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def read_trace(trace_dir: str):
    """Complete events of device 0 (or of the host on CPU): [(name, start_us, end_us)]."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    paths = paths or glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        return [], "no trace file written"
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev0 = [pid for pid, n in names.items() if re.search(r"(GPU|TPU):0\b", n)]
    source = f"device 0 ({names[dev0[0]]})" if dev0 else "host (no device timeline: CPU backend)"
    keep = set(dev0) if dev0 else set(names)
    out = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
           if e.get("ph") == "X" and e.get("pid") in keep]
    return out, source


def trace_stats(events, iters):
    gemm = [(s, e) for n, s, e in events if GEMM_RE.search(n) and not COLL_RE.search(n)]
    coll = [(s, e) for n, s, e in events if COLL_RE.search(n)]
    ug, uc = _union(gemm), _union(coll)
    return {
        "gemm_us": _length(ug) / iters if ug else None,
        "coll_us": _length(uc) / iters if uc else None,
        "overlap": (_intersect(ug, uc) / _length(uc)) if uc and ug else None,
        "n_gemm_events": len(gemm),
        "n_coll_events": len(coll),
    }


# --------------------------------------------------------------------------- programs


def build_programs(mesh, m, nn, k, flavour, dtype):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import comm

    ax = mesh.axis_names[0]
    n = mesh.size
    if k % n:
        raise ValueError(f"K={k} must be divisible by the number of devices {n}")

    def gather(ws):
        return lax.all_gather(ws, ax, axis=0, tiled=True) if flavour == "xla" else comm.ring_all_gather(ws, ax)

    def scatter(g):
        return lax.psum_scatter(g, ax, scatter_dimension=0, tiled=True) if flavour == "xla" else \
            comm.ring_psum_scatter(g, ax)

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    rep, shd = P(), P(ax)
    # every device runs its own full GEMM (as in the paper), on per-device data: specs stack them
    programs = {
        "gemm": smap(lambda x, w: x @ w, (shd, shd), shd),
        "ag": smap(gather, shd, shd),
        "rs": smap(scatter, shd, shd),
        "gemm+ag": smap(lambda x, w, ws: (x @ w, gather(ws)), (shd, shd, shd), (shd, shd)),
        "gemm+rs": smap(lambda x, w, g: (x @ w, scatter(g)), (shd, shd, shd), (shd, shd)),
    }
    key = jax.random.key(0)
    put = lambda shape: jax.device_put(  # noqa: E731
        jax.random.normal(key, shape, jnp.float32).astype(dtype), NamedSharding(mesh, shd))
    x, w = put((n * m, k)), put((n * k, nn))
    ws, g = put((k, nn)), put((n * k, nn))  # shard [K/n, N] per device; full grad [K, N] per device
    args = {"gemm": (x, w), "ag": (ws,), "rs": (g,), "gemm+ag": (x, w, ws), "gemm+rs": (x, w, g)}
    return programs, args


def measure(fn, args, iters, trace_dir):
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(max(3, iters // 2)):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e6)
    os.makedirs(trace_dir, exist_ok=True)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
    events, source = read_trace(trace_dir)
    return {"wall_us": statistics.median(times), **trace_stats(events, iters), "source": source}


def run_flavour(flavour, shapes, args, trace_root):
    import jax
    import jax.numpy as jnp

    from comm import fsdp

    mesh = fsdp.make_mesh(axis="d")
    platform = jax.devices()[0].platform
    dtype = jnp.dtype(args.dtype or ("bfloat16" if platform == "gpu" else "float32"))
    rows = []
    for name, m, nn, k in shapes:
        programs, inputs = build_programs(mesh, m, nn, k, flavour, dtype)
        res = {}
        for prog, fn in programs.items():
            res[prog] = measure(fn, inputs[prog], args.iters,
                                os.path.join(trace_root, f"{flavour}_{name.split()[0]}_{prog}".replace("+", "_")))
        if mesh.size == 1:  # a 1-device collective is a copy at most: report nothing for it
            for r in res.values():
                r.update(coll_us=None, overlap=None)
        for coll in ("ag", "rs"):
            alone, conc, c_alone = res["gemm"], res[f"gemm+{coll}"], res[coll]
            slowdown = None
            if alone["gemm_us"] and conc["gemm_us"]:
                slowdown = 100.0 * (conc["gemm_us"] / alone["gemm_us"] - 1.0)
            rows.append({
                "shape": name, "M": m, "N": nn, "K": k, "flavour": flavour, "collective": coll,
                "devices": mesh.size, "platform": platform, "dtype": str(dtype),
                "gemm_alone_us": alone["gemm_us"], "gemm_concurrent_us": conc["gemm_us"],
                "gemm_slowdown_pct": slowdown,
                "coll_alone_us": c_alone["coll_us"], "coll_concurrent_us": conc["coll_us"],
                "overlap_fraction": conc["overlap"],
                "wall_gemm_us": alone["wall_us"], "wall_coll_us": c_alone["wall_us"],
                "wall_concurrent_us": conc["wall_us"],
                "payload_MB": k * nn * dtype.itemsize / 1e6, "trace_source": conc["source"],
            })
    return rows


def _fmt(v, spec):
    return "-".rjust(int(re.match(r"\d+", spec).group())) if v is None else format(v, spec)


def main(argv=None):
    args = parse_args(argv)
    flavours = [f for f in args.flavours.split(",") if f]
    bad = [f for f in flavours if f not in FLAVOURS]
    if bad:
        raise SystemExit(f"unknown flavours {bad}; choose from {FLAVOURS}")
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.small:
        shapes = [(n, m // 32, nn // 32, k // 32) for n, m, nn, k in shapes]
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="bench_comm_")

    from comm import flags

    if args.child_json:  # one flavour in this (flag-carrying) process
        rows = []
        for fl in flavours:
            rows += run_flavour(fl, shapes, args, trace_root)
        Path(args.child_json).write_text(json.dumps(rows))
        return

    import jax

    rows, notes = [], []
    local = [f for f in flavours if f != "ring_memcpy"]
    for fl in local:
        rows += run_flavour(fl, shapes, args, trace_root)
    if "ring_memcpy" in flavours:
        out = os.path.join(trace_root, "ring_memcpy.json")
        env = dict(os.environ)
        flags.set_xla_flags([flags.MEMCPY_P2P_FLAG], environ=env)
        cmd = [sys.executable, "-m", "benchmarks.bench_comm", "--flavours", "ring_memcpy",
               "--iters", str(args.iters), "--child-json", out, "--trace-dir", trace_root]
        cmd += ["--small"] if args.small else []
        cmd += ["--dtype", args.dtype] if args.dtype else []
        cmd += ["--shapes", args.shapes] if args.shapes else []
        proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1])
        if proc.returncode == 0:
            rows += json.loads(Path(out).read_text())
        else:
            notes.append(f"ring_memcpy child failed with exit code {proc.returncode}")

    platform, ndev = jax.devices()[0].platform, jax.device_count()
    if ndev == 1:
        notes.append("1 device: the collectives move nothing; collective time and overlap not measured")
    if platform == "cpu":
        notes.append("CPU: collectives run synchronously on the host and there is no device timeline, so "
                     "overlap and GEMM slowdown are not meaningful; ring_memcpy's flag is GPU-only (no effect)")
    if platform != "gpu":
        notes.append("copy-engine (SDMA-like) transfers need GPUs in one node: not measured here")

    hdr = (f"{'shape':20} {'flavour':12} {'coll':4} {'gemm us':>9} {'+coll us':>9} {'slow %':>7} "
           f"{'coll us':>9} {'conc us':>9} {'overlap':>7} {'wall gemm':>10} {'wall conc':>10}")
    print(f"\nTable 13 on {ndev} x {jax.devices()[0].device_kind} ({platform}), "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['shape']:20} {r['flavour']:12} {r['collective']:4} {_fmt(r['gemm_alone_us'], '9.1f')} "
              f"{_fmt(r['gemm_concurrent_us'], '9.1f')} {_fmt(r['gemm_slowdown_pct'], '7.1f')} "
              f"{_fmt(r['coll_alone_us'], '9.1f')} {_fmt(r['coll_concurrent_us'], '9.1f')} "
              f"{_fmt(r['overlap_fraction'], '7.2f')} {_fmt(r['wall_gemm_us'], '10.1f')} "
              f"{_fmt(r['wall_concurrent_us'], '10.1f')}")
    for note in notes:
        print(f"NOTE: {note}")
    print(f"traces: {trace_root}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes, "devices": ndev,
                                               "platform": platform}, indent=1))


if __name__ == "__main__":
    main()
