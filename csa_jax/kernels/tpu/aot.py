"""Ahead-of-time compile of the pallas_tpu kernels with the real Mosaic compiler, on a CPU.

Mosaic (the TPU kernel compiler) lives in libtpu (`pip install -e '.[tpu-aot]'`, the pin jax's
own `[tpu]` extra uses). It compiles for a TPU generation with no TPU present:
`jax.experimental.topologies.get_topology_desc(name, platform="tpu")` gives devices of that
generation; arguments are placed on one of them and the program is traced, lowered and compiled
under `jax.default_device(device)` (without it, lowering asks the CPU device for its TPU info).

    PYTHONPATH=. python -m csa_jax.kernels.tpu.aot [--gens v5e,v6e] [--families flash,pro] \
        [--seqs 4096,16384] [--ratios 0,4,128] [--dtypes bfloat16,float32] [--layouts struct] \
        [--kernels fwd,bwd] [--whole] [--json out.json]

compiles every kernel of each problem on its own (fwd: the forward op; bwd: backward launch 0
= dq + per-tile / per-slot dkv intermediates of its token blocks; bwd_chunk: the last
token-chunk launch; dkv_seg / dkv_row: the two CSR dkv reductions of a launch's gathered
slots, `_chunk` those of the last launch; with --whole also bwd_all, the whole backward op)
and prints one row per kernel and generation: compile time, code size, scoped VMEM (the
compiler's own number: what XLA records for the kernel's custom call, or, over the limit,
what the error says it asked for), the VMEM limit it was compiled under, the program's HBM
footprint (memory_analysis: arguments + outputs - aliased + temporaries) and HBM traffic
(counted from the launch geometry, see `hbm_traffic`). A kernel that does not compile shows
the compiler's error.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

from csa_jax import blockmath as bm
from csa_jax.config import FAMILIES, PRESET_RATIOS, preset
from csa_jax.kernels.tpu.backward import _bwd_launch, backward, launch_blocks
from csa_jax.kernels.tpu.config import default_config, vmem_limit
from csa_jax.kernels.tpu.dkv import _csr_reduce, csr_sizes
from csa_jax.kernels.tpu.forward import forward
from csa_jax.kernels.tpu.plan import _make_plan, kv_operand, struct_tiles

# topology names get_topology_desc accepts (a 1x1 v5e is refused, so every one has 4 chips)
GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def target_device(gen: str):
    """Device 0 of a `gen` topology (no TPU needed; libtpu must be installed)."""
    if gen not in GENERATIONS:
        raise ValueError(f"generation {gen!r} must be one of {sorted(GENERATIONS)}")
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) when it loads, so a second
    # process (another pytest-xdist worker) fails with "Internal error when accessing libtpu
    # multi-process lockfile". Compiling drives no TPU, so several processes may load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    td = topologies.get_topology_desc(topology_name=GENERATIONS[gen], platform="tpu")
    return td.devices[0]


# ----------------------------------------------------------------------------- problems

@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes of one V4 attention layer (B = 1) and the kernel Config used for it."""
    name: str
    q: tuple
    kv: tuple
    idx: tuple
    dtype: str
    config: object

    @property
    def h(self):
        return self.q[2]


def layer_problem(family, ratio, seq, dtype, *, layout="struct", generation=None, **overrides):
    """The V4 layer (family, ratio) at T = seq: K = its nominal slots, N = T + pool rows.
    layout "struct" = the layer's structured layout (cr0 / cr4 / cr128), or any Config layout.
    The Config is default_config's for that generation, with `overrides` replaced."""
    c = preset(family, ratio)
    t, h, d = seq, c.num_heads, c.head_dim
    n, k = c.num_kv(t), c.nominal_slots(t)
    if layout == "struct":
        layout = f"cr{ratio}"
    lay = {} if layout == "generic" else dict(layout=layout, window=c.window,
                                              pool_ratio=max(ratio, 2))
    q, kv, idx = (1, t, h, d), (1, n, d), (1, t, k)
    cfg = default_config(q, kv, idx, jnp.dtype(dtype), generation=generation, **lay)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return Problem(f"{c.name}-T{t}-{layout}-{jnp.dtype(dtype).name}", q, kv, idx,
                   jnp.dtype(dtype).name, cfg)


# ----------------------------------------------------------------------------- kernels

@dataclasses.dataclass(frozen=True)
class Kernel:
    """One pallas_call of a problem: fn(*args) runs exactly that kernel."""
    name: str
    fn: object
    args: tuple           # jax.ShapeDtypeStruct (no sharding)
    hbm_bytes: int        # HBM bytes moved (read + written) by the kernel, see hbm_traffic
    donate: tuple = ()    # args whose buffers the kernel overwrites (dO -> dq)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def kernels(p: Problem, whole=False) -> list[Kernel]:
    """Every pallas_call that forward + backward of problem p launch, each on its own; with
    `whole`, also "bwd_all": the whole backward op (every launch, the CSR maps, the XLA glue;
    dO donated, as in a training step where nothing reads it after), for its HBM footprint."""
    cfg, dt = p.config, jnp.dtype(p.dtype)
    plan = _make_plan(p.q, p.kv[1], p.idx[-1], cfg, dt)
    scale = p.q[-1] ** -0.5
    q, kv, idx = _sds(p.q, dt), _sds(p.kv, dt), _sds(p.idx, jnp.int32)
    sink = _sds((p.h,), jnp.float32)
    out = [Kernel("fwd", lambda q, kv, idx, sink: forward(
        q, kv, idx, sink, scale=scale, interpret=False, config=cfg), (q, kv, idx, sink),
        hbm_traffic(plan, dt, "fwd"))]
    rows = p.q[0], plan.t_pad * plan.h
    tok = _sds(rows + (plan.d,), dt)
    lse_r = _sds((p.q[0], plan.nb, plan.bt, plan.h), jnp.float32)
    kv_p = jax.eval_shape(lambda x: kv_operand(x, plan), kv)
    launches = launch_blocks(plan, cfg)
    # bwd: launch 0; bwd_chunk: the last launch, if its grid is shorter (every launch of
    # launch 0's size runs launch 0's compiled kernel and CSR passes: the first block is an
    # operand, not a constant), so nothing is compiled twice
    picks = launches[:1] + [b for b in launches[-1:] if b[1] != launches[0][1]]
    for j, blocks in enumerate(picks):
        name = "bwd" if j == 0 else "bwd_chunk"

        def bwd(q2, kv_p, idx, o2, lse_r, dlse_r, do2, blocks=blocks):
            return _bwd_launch(q2, kv_p, idx, o2, lse_r, dlse_r, do2, plan, blocks,
                               scale=scale, interpret=False, config=cfg)
        out.append(Kernel(name, bwd, (tok, kv_p, idx, tok, lse_r, lse_r, tok),
                          hbm_traffic(plan, dt, "bwd", blocks), donate=(6,)))
        if plan.n_kg:
            e = blocks[1] * plan.bt * plan.n_kg * plan.bk
            s_pad, r_pad = csr_sizes(e, p.kv[1], cfg)
            for kname, (n_in, n_out) in (("dkv_seg", (e, s_pad)), ("dkv_row", (s_pad, r_pad))):
                if j:
                    kname += "_chunk"

                def red(values, perm, key, offs):
                    return _csr_reduce(values, perm, key, offs, interpret=False, config=cfg)
                ints = _sds((p.q[0], n_in), jnp.int32)
                out.append(Kernel(kname, red, (_sds((p.q[0], n_in, plan.d), jnp.float32), ints,
                                               ints, _sds((p.q[0], n_out + 1), jnp.int32)),
                                  (n_in + n_out) * plan.d * 4 * p.q[0]))
    if whole:
        lse = _sds(p.q[:3], jnp.float32)

        def bwd_all(q, kv, idx, sink, o, lse, do, dlse):
            return backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale, interpret=False,
                            config=cfg)
        total = 0
        for blocks in launch_blocks(plan, cfg):
            total += hbm_traffic(plan, dt, "bwd", blocks)
            if plan.n_kg:
                e = blocks[1] * plan.bt * plan.n_kg * plan.bk
                s_pad, r_pad = csr_sizes(e, p.kv[1], cfg)
                total += (e + 2 * s_pad + r_pad) * plan.d * 4 * p.q[0]
        out.append(Kernel("bwd_all", bwd_all, (q, kv, idx, sink, q, lse, q, lse), total,
                          donate=(6,)))
    return out


def hbm_traffic(plan, dtype, kernel, blocks=None) -> int:
    """HBM bytes the forward ("fwd") or backward ("bwd") kernel of one launch (token blocks
    `blocks` = (first, count), default all) reads + writes for B = 1, counted from the launch
    geometry: kv tiles as streamed (window / pool tiles per program; gathered slots as if all
    were non-empty, an upper bound) plus the pipelined blocks (q / o / dO / dq, lse / dlse /
    delta, idx and valid masks, the dkv intermediates)."""
    s = jnp.dtype(dtype).itemsize
    d, bk, h = plan.d, plan.bk, plan.h
    b0, nblk = blocks or (0, plan.nb)
    tiles = 0
    for i in range(b0, b0 + nblk):
        n_win, n_pool = struct_tiles(plan, i)
        tiles += n_win + n_pool
    tokens = nblk * plan.bt
    gathered = tokens * plan.n_kg * bk
    kv = (tiles * bk + gathered) * d * s
    idx = gathered * 4 * 2                             # idx blocks (SMEM) + valid masks
    rows = tokens * h
    if kernel == "fwd":
        return kv + idx + rows * (2 * d * s + 4)       # q in, o out, lse out
    interm = (tiles * bk + gathered) * d * 4           # per-tile / per-slot dkv parts, f32
    return kv + idx + rows * (4 * d * s + 3 * 4) + interm   # q, o, dO in, dq out; lse, dlse, delta


# ----------------------------------------------------------------------------- compiling

_SIZE = r"([0-9.]+)\s*([KMG]?)i?B?"


def _bytes(num, unit):
    return int(float(num) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


def scoped_vmem_from_error(msg: str):
    """The scoped VMEM a kernel asked for, from the compiler's over-limit error (None if the
    error states none): 'Scoped allocation with size 16.50M and limit 16.00M' (E1001) or
    'Used 16.5M of 16.0M vmem'. Only near the limit is it the kernel's whole need: far below
    it (a 4 KiB limit) the compiler names the first allocation that failed, a smaller number."""
    m = re.search(r"Scoped allocation with size " + _SIZE, msg)
    if m is None:
        m = re.search(r"Used " + _SIZE + r" of", msg)
    return None if m is None else _bytes(m.group(1), m.group(2))


def scoped_vmem_of(compiled):
    """Scoped VMEM (bytes) of the Mosaic kernel in a compiled program: the size XLA records in
    the custom call's used_scoped_memory_configs (memory space 1 = VMEM)."""
    total = 0
    for line in compiled.as_text().splitlines():
        if "tpu_custom_call" not in line:
            continue
        used = re.search(r'"used_scoped_memory_configs":\[(.*?)\]', line)
        for m in re.finditer(r'"memory_space":"1","offset":"\d+","size":"(\d+)"',
                             used.group(1) if used else ""):
            total = max(total, int(m.group(1)))
    return total or None


def _limit_on(config, dev):
    with jax.default_device(dev):
        return vmem_limit(config, interpret=False)


def _compile(fn, args, dev, donate=()):
    sh = jax.sharding.SingleDeviceSharding(dev)
    placed = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
              for a in args]
    donate = tuple(j for j in donate if placed[j] is not None)
    with jax.default_device(dev):
        return jax.jit(fn, donate_argnums=donate).trace(*placed).lower().compile()


def _first_line(msg: str) -> str:
    for line in str(msg).splitlines():
        line = line.strip()
        if line and not line.startswith(("WARNING", "E0000", "===")):
            return line[:300]
    return str(msg)[:300]


def compile_kernels(p: Problem, gen: str, only=None, whole=False) -> list[dict]:
    """Compile every kernel of p (those named in `only`, if given; `whole`: see kernels) for
    generation gen; one result row per kernel."""
    dev = target_device(gen)
    rows = []
    for k in kernels(p, whole):
        if only is not None and k.name not in only:
            continue
        row = dict(problem=p.name, generation=gen, kernel=k.name, hbm_bytes=k.hbm_bytes,
                   vmem_limit=_limit_on(p.config, dev), ok=False)
        t0 = time.perf_counter()
        try:
            c = _compile(k.fn, k.args, dev, k.donate)
        except Exception as e:            # the compiler's error is the result
            row.update(compile_s=time.perf_counter() - t0, error=_first_line(e),
                       scoped_vmem=scoped_vmem_from_error(str(e)))
            rows.append(row)
            continue
        ma = c.memory_analysis()
        row.update(ok=True, compile_s=time.perf_counter() - t0,
                   code_bytes=ma.generated_code_size_in_bytes,
                   temp_bytes=ma.temp_size_in_bytes, arg_bytes=ma.argument_size_in_bytes,
                   out_bytes=ma.output_size_in_bytes, alias_bytes=ma.alias_size_in_bytes,
                   scoped_vmem=scoped_vmem_of(c))
        # the program's HBM footprint: arguments + outputs (less the in-place ones) + temps
        row["hbm_peak"] = (row["arg_bytes"] + row["out_bytes"] - row["alias_bytes"]
                           + row["temp_bytes"])
        rows.append(row)
    return rows


def _mib(x):
    return "-" if x is None else f"{x / 2**20:.2f}"


def table(rows) -> str:
    """Markdown table of compile_kernels rows (HBM peak: the program's arguments + outputs, less
    what is overwritten in place, + temporaries, from memory_analysis)."""
    out = ["| problem | gen | kernel | compiles | s | code KiB | scoped VMEM MiB | limit MiB "
           "| HBM peak MiB | HBM traffic MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["ok"] else f"**no**: {r['error']}"
        code = f"{r['code_bytes'] / 1024:.0f}" if r.get("code_bytes") else "-"
        out.append(f"| {r['problem']} | {r['generation']} | {r['kernel']} | {ok} "
                   f"| {r['compile_s']:.1f} | {code} | {_mib(r.get('scoped_vmem'))} "
                   f"| {_mib(r['vmem_limit'])} | {_mib(r.get('hbm_peak'))} "
                   f"| {_mib(r['hbm_bytes'])} |")
    return "\n".join(out)


def pivot(rows) -> str:
    """Markdown table, one row per (problem, kernel), one column per generation: for a kernel
    that compiled, scoped VMEM MiB / code KiB / HBM peak GiB / HBM traffic GiB; **no** and the
    VMEM it asked for (or the error) if not."""
    gens = sorted({r["generation"] for r in rows}, key=list(GENERATIONS).index)
    cells, order = {}, []
    for r in rows:
        key = (r["problem"], r["kernel"])
        if key not in cells:
            order.append(key)
            cells[key] = {}
        if r["ok"]:
            cells[key][r["generation"]] = (
                f"{_mib(r.get('scoped_vmem'))} / {r['code_bytes'] / 1024:.0f} / "
                f"{r['hbm_peak'] / 2**30:.2f} / {r['hbm_bytes'] / 2**30:.2f}"
                if "hbm_peak" in r else _mib(r.get("scoped_vmem")))
        elif r.get("scoped_vmem"):
            cells[key][r["generation"]] = f"**no** ({_mib(r['scoped_vmem'])})"
        else:
            cells[key][r["generation"]] = "**no**: " + r["error"][:60]
    out = ["| problem | kernel | " + " | ".join(gens) + " |", "|---|---|" + "---|" * len(gens)]
    for key in order:
        out.append(f"| {key[0]} | {key[1]} | "
                   + " | ".join(cells[key].get(g, "") for g in gens) + " |")
    return "\n".join(out)


def compact(rows) -> str:
    """Markdown table, one row per problem, one column per generation: how many of its kernels
    compile, the largest scoped VMEM among them (MiB), and what failed."""
    gens = sorted({r["generation"] for r in rows}, key=list(GENERATIONS).index)
    cells, order = {}, []
    for r in rows:
        if r["problem"] not in cells:
            order.append(r["problem"])
            cells[r["problem"]] = {}
        cells[r["problem"]].setdefault(r["generation"], []).append(r)
    out = ["| problem | " + " | ".join(gens) + " |", "|---|" + "---|" * len(gens)]
    for prob in order:
        line = []
        for g in gens:
            rs = cells[prob].get(g, [])
            if not rs:
                line.append("")
                continue
            ok = [r for r in rs if r["ok"]]
            most = max((r.get("scoped_vmem") or 0 for r in ok), default=0)
            cell = f"{len(ok)}/{len(rs)}, max {_mib(most)}"
            bad = [r for r in rs if not r["ok"]]
            if bad:
                why = "HBM" if "on HBM" in bad[0]["error"] else bad[0]["error"][:40]
                cell = f"**{cell}**; no: {', '.join(r['kernel'] for r in bad)} ({why})"
            line.append(cell)
        out.append(f"| {prob} | " + " | ".join(line) + " |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gens", default="v5e,v6e,v5p,v4")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--ratios", default=",".join(map(str, PRESET_RATIOS)))
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--layouts", default="struct,generic",
                    help="struct (the layer's own layout) and / or generic")
    ap.add_argument("--vmem-limit", type=int, default=None,
                    help="compile under this scoped VMEM limit (bytes) instead of the default")
    ap.add_argument("--kernels", default=None,
                    help="compile only these kernels (fwd,bwd,bwd_chunk,dkv_seg,...,bwd_all)")
    ap.add_argument("--whole", action="store_true",
                    help="also compile the whole backward op (kernel bwd_all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-json", nargs="+", default=None,
                    help="print the tables of earlier --json results instead of compiling")
    a = ap.parse_args(argv)
    if a.from_json:
        rows = [r for f in a.from_json for r in json.load(open(f))]
        print(compact(rows) + "\n\n" + pivot(rows))
        return 0
    if not libtpu_available():
        sys.exit("aot: libtpu is not installed (pip install -e '.[tpu-aot]')")
    only = None if a.kernels is None else set(a.kernels.split(","))
    rows = []
    for gen in a.gens.split(","):
        for fam in a.families.split(","):
            for ratio in map(int, a.ratios.split(",")):
                for seq in map(int, a.seqs.split(",")):
                    for dt in a.dtypes.split(","):
                        for lay in a.layouts.split(","):
                            over = {} if a.vmem_limit is None else dict(
                                vmem_limit_bytes=a.vmem_limit)
                            p = layer_problem(fam, ratio, seq, dt, layout=lay,
                                              generation=gen, **over)
                            rs = compile_kernels(p, gen, only, a.whole)
                            rows += rs
                            print(table(rs).split("\n", 2)[2], flush=True)
    print(table(rows))
    print()
    print(pivot(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
