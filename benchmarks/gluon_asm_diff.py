"""Did a source change alter the generated GPU code? Hashes of every Gluon kernel's final assembly.

    python -m benchmarks.gluon_asm_diff dump OUT.json [--only REGEX] [--no-line-info]
        [--keep DIR] [--label COMMIT]
    python -m benchmarks.gluon_asm_diff compare BEFORE.json AFTER.json [--only REGEX]

`dump` compiles each kernel of KERNELS (the Gluon kernels at their defaults and at the switches
that select other code paths: fwd.py's pipeline / smem_epilogue / prefetch, fwd_alt.py's orders
and split, bwd.py's pair / lockstep / qdo / dq operands / ablations (the paired kernel's
no-gather 5 / 6 too), bwd_pipe.py's pipelined and blocked dq kernels, bwd_alt.py's orders,
the window kernels (window.py with cr0 / cr128 / P in shared memory, window_xchg.py, bwd_win.py's
dq kernel at 5 settings), the AMD forward and dq kernels with trans / qdo / tdm_rows) for every
target it is built for, on the CPU (triton 3.6.0's bundled compilers, a fresh cache directory), and writes
per kernel/target sha256 hashes of:

- ptx (sm_90a): the PTX with source line info removed (`.loc` / `.file` directives, the
  `$L__tmp` labels they use, the `.debug_*` sections), which is the only place file names and
  line numbers appear;
- sass (sm_90a): `cuobjdump -sass` of the cubin (machine code, no line info);
- amdgcn (gfx942 / gfx950 / gfx1250): the assembly text with the same removal (`.loc`,
  `.file`, `.Ltmp` labels, `.debug_*` sections);
- raw: the unmodified PTX / amdgcn text (differs whenever a kernel's source lines move);
- with --no-line-info (TRITON_DISABLE_LINE_INFO: no debug info at all), `raw` and `bin` (the
  cubin / hsaco bytes) are comparable too.

--label names the tree's commit when it is not a git checkout (a `git archive` of it).
`compare` prints one line per kernel/target whose normalized hashes (ptx, sass, amdgcn, and bin
when both files were made with --no-line-info) differ, or were compiled in one file only, and
exits 1 if there is any. --keep DIR writes the normalized texts there, to diff a mismatch.
Used in docs/perf/gpu_resources.md ("Deduplicated kernels: generated code unchanged").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

SHAPE = dict(T=4096, N=5120, NHB=2, D=512, K=1152, scale=512 ** -0.5)
_DROP = re.compile(r"^\s*(\.loc|\.file)\s|^\s*(\$L__tmp|\.Ltmp)\d+:\s*$")


def strip_line_info(text):
    """The assembly without source line info: `.loc` / `.file` lines, the labels only line
    tables use, and every `.debug_*` section (PTX: a braced block; amdgcn: up to the next
    .section / .text directive)."""
    out, in_debug = [], False
    for ln in text.splitlines():
        s = ln.strip()
        if s.startswith(".section") or s in (".text", ".data"):
            in_debug = s.split()[1].startswith(".debug_") if s.startswith(".section") else False
            if in_debug:
                continue
        if in_debug:
            if s == "}":              # PTX: the end of a debug section's block
                in_debug = False
            continue
        if not _DROP.match(ln):
            out.append(ln)
    return "\n".join(out) + "\n"


def _sha(data):
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()


def sass(cubin):
    from triton.backends.nvidia.compiler import get_ptxas
    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def kernels():
    """(name, kernel, arg types, constexprs, warps, targets) of every kernel variant compared."""
    from csa_jax.kernels import gluon as impl
    from csa_jax.kernels.gluon import (amd_bwd, amd_fwd, bwd, bwd_alt, bwd_pipe, bwd_win, fwd,
                                       fwd_alt, window, window_xchg)
    base = impl.default_config((1, 4096, 128, 512), (1, 5120, 512), (1, 4096, 1152), "bfloat16")
    nv = ("sm_90a",)
    dims = dict(SHAPE, BK=base.block_k, stages=base.stages, prefetch=base.prefetch)
    lock = dict(producer_regs=base.producer_regs)
    for tag, over in (("", {}), ("pipeline", dict(pipeline=True)),
                      ("smem_epilogue", dict(smem_epilogue=True)),
                      ("noprefetch", dict(prefetch=False)), ("ablate=1", dict(ablate=1)),
                      ("ablate=4", dict(ablate=4))):
        yield (f"csa_fwd[lockstep{',' + tag if tag else ''}]", fwd.csa_fwd_kernel,
               fwd.arg_types(), fwd.constexprs(**{**dims, **lock, **over}), fwd.CONSUMER_WARPS, nv)
    for order in fwd_alt.ORDERS:
        for split in (False, True):
            yield (f"csa_fwd_alt[{order}{',split' if split else ''}]", fwd_alt.csa_fwd_alt_kernel,
                   fwd.arg_types(), fwd_alt.constexprs(**dims, consumer_regs=base.alt_regs,
                                                       split=split, order=order),
                   fwd_alt.NUM_WARPS, nv)
    bdims = dict(SHAPE, BK=base.bwd_block_k, stages=base.bwd_stages,
                 producer_regs=base.producer_regs, prefetch=base.bwd_prefetch,
                 qdo=base.bwd_qdo, dq_operand=base.bwd_dq_operand, pair=base.bwd_pair,
                 fuse_delta=base.bwd_fuse_delta)
    dq_variants = [("default", {}), ("pair=0", dict(pair=False)),
                   ("pair=0,qdo=0,fuse=0", dict(pair=False, qdo=False, fuse_delta=False)),
                   ("qdo=0", dict(qdo=False)), ("pair=0,prefetch", dict(pair=False, prefetch=True))]
    dq_variants += [(f"dq_operand={op}", dict(dq_operand=op)) for op in bwd.DQ_OPERANDS[1:]]
    dq_variants += [(f"pair=0,ablate={a}", dict(pair=False, ablate=a)) for a in (1, 2, 3, 4)]
    dq_variants += [(f"ablate={a}", dict(ablate=a)) for a in (5, 6)]       # paired: no gathers
    for tag, over in dq_variants:
        yield (f"csa_dq[{tag}]", bwd.csa_dq_kernel, bwd.arg_types(),
               bwd.constexprs(**{**bdims, **over}), bwd.CONSUMER_WARPS, nv)
    # bwd_pipe.py: Config.bwd_pipeline's consumer (bwd.csa_dq_kernel, PIPE) and the blocked
    # bwd_qdo_regs=1 kernel, 2 stages and 3 with bwd_scores_ahead (producer 40 registers)
    yield ("csa_dq[pipeline]", bwd.csa_dq_kernel, bwd.arg_types(),
           bwd.constexprs(**{**bdims, "pipeline": True}), bwd.CONSUMER_WARPS, nv)
    for tag, over in (("", {}), (",stages=3,ahead", dict(stages=3, producer_regs=40,
                                                         scores_ahead=True))):
        yield (f"csa_dq_blk[qdo_regs=1{tag}]", bwd_pipe.csa_dq_blk_kernel, bwd.arg_types(),
               bwd.constexprs(**{**bdims, "pipeline": True, "qdo_regs": 1, **over}),
               bwd.CONSUMER_WARPS, nv)
    for order in bwd_alt.ORDERS:
        for qdo in (True, False):
            yield (f"csa_dq_alt[{order}{'' if qdo else ',qdo=0'}]", bwd_alt.csa_dq_alt_kernel,
                   bwd.arg_types(),
                   bwd_alt.constexprs(**SHAPE, BK=32, stages=2, consumer_regs=base.bwd_alt_regs,
                                      qdo=qdo, fuse_delta=base.bwd_fuse_delta, order=order),
                   bwd_alt.NUM_WARPS, nv)
    for ratio in (0, 128):
        consts = window.constexprs(T=4096, N=4096 + (4096 // ratio if ratio else 0), NHB=2,
                                   D=512, window=base.window, G=window.programs(1, 4096, 2),
                                   ratio=ratio, pool_tile=base.pool_tile,
                                   pool_stages=base.pool_stages, scale=SHAPE["scale"],
                                   producer_regs=base.win_producer_regs, p_smem=base.win_p_smem)
        yield (f"csa_window[cr{ratio}]", window.csa_window_kernel, window.arg_types(), consts,
               window.CONSUMER_WARPS, nv)
        if not ratio:              # cr0 with the window's P through shared memory (P_SMEM 1)
            yield ("csa_window[cr0,p_smem]", window.csa_window_kernel, window.arg_types(),
                   {**consts, "P_SMEM": window.p_smem_mode(512, base.window, 0, base.pool_tile,
                                                           True)}, window.CONSUMER_WARPS, nv)
    consts = window_xchg.constexprs(T=4096, N=4096, NHB=2, D=512, window=base.window,
                                    G=window.programs(1, 4096, 2), scale=SHAPE["scale"],
                                    consumer_regs=base.win_regs)
    yield ("csa_window_xchg[cr0]", window_xchg.csa_window_xchg_kernel, window.arg_types(),
           consts, window_xchg.NUM_WARPS, nv)
    # bwd_win.py (Config.bwd_win, cr0): the 4 settings of tests/test_gluon_bwd_win.py + ablate 3
    for tag, over in (("", {}), ("qdo=0,fuse=0", dict(qdo=False, fuse_delta=0)),
                      ("fuse=2,dq_mm,dsp_block", dict(fuse_delta=2, dq_mm=True, dsp_block=True)),
                      ("overlap=0", dict(overlap=False)), ("ablate=3", dict(ablate=3))):
        consts = bwd_win.constexprs(**{**dict(
            T=4096, N=4096, NH2=4, D=512, window=base.window, G=window.programs(1, 4096, 4),
            scale=SHAPE["scale"], producer_regs=base.bwd_win_producer_regs, qdo=True,
            fuse_delta=1), **over})
        yield (f"csa_dq_win[cr0{',' + tag if tag else ''}]", bwd_win.csa_dq_win_kernel,
               bwd_win.arg_types(), consts, bwd_win.CONSUMER_WARPS, nv)
    for target, d in amd_fwd.TARGET_DEFAULTS.items():
        for trans in (0, 1):
            yield (f"csa_fwd_amd[trans={trans}]", amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(),
                   amd_fwd.constexprs(target=target, BK=d["block_k"], stages=d["stages"],
                                      trans=trans, **SHAPE), d["warps"], (target,))
    yield ("csa_fwd_amd[tdm_rows]", amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(),
           amd_fwd.constexprs(target="gfx1250", BK=32, stages=2, tdm_rows=True, **SHAPE), 8,
           ("gfx1250",))
    for target, d in amd_bwd.DQ_DEFAULTS.items():
        for trans in (0, 1):
            for qdo in (0, 1):
                yield (f"csa_dq_amd[trans={trans},qdo={qdo}]", amd_bwd.csa_dq_amd_kernel,
                       amd_bwd.arg_types(),
                       amd_bwd.constexprs(target=target, BK=d["block_k"], stages=d["stages"],
                                          qdo=qdo, trans=trans, **SHAPE), d["warps"], (target,))


def dump(out, only=None, no_line_info=False, keep=None, label=None):
    import triton
    from csa_jax.kernels.gluon import adapter
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="gluon_asm_diff_")
    triton.knobs.compilation.disable_line_info = bool(no_line_info)
    rows = {}
    for name, fn, types, consts, warps, targets in kernels():
        for target in targets:
            key = f"{name}@{target}"
            if only and not re.search(only, key):
                continue
            try:
                c = adapter.compile_kernel(fn, types, consts, target=target, num_warps=warps)
            except Exception as e:  # noqa: BLE001 (a kernel that stops compiling is a result)
                rows[key] = dict(error=str(e).strip().splitlines()[-1][:300])
                print(f"{key}: ERROR {rows[key]['error']}", flush=True)
                continue
            text_key, bin_key = ("ptx", "cubin") if "ptx" in c.asm else ("amdgcn", "hsaco")
            norm = strip_line_info(c.asm[text_key])
            row = {text_key: _sha(norm), "raw": _sha(c.asm[text_key]),
                   "bin": _sha(c.asm[bin_key]), "lines": norm.count("\n")}
            if bin_key == "cubin":
                row["sass"] = _sha(sass(c.asm["cubin"]))
            rows[key] = row
            if keep:
                os.makedirs(keep, exist_ok=True)
                safe = re.sub(r"[^A-Za-z0-9_.=,@-]", "_", key)
                with open(os.path.join(keep, f"{safe}.{text_key}"), "w") as f:
                    f.write(norm)
            print(f"{key}: {text_key} {row[text_key][:16]} ({row['lines']} lines)", flush=True)
    meta = dict(no_line_info=bool(no_line_info), triton=triton.__version__,
                commit=label or _git("rev-parse", "--short", "HEAD"),
                dirty=bool(_git("status", "--porcelain", "--untracked-files=no")) and not label)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, kernels=rows), f, indent=1, sort_keys=True)
    print(f"{len(rows)} kernel/target rows -> {out} ({meta})")
    return 0 if not any("error" in r for r in rows.values()) else 1


def _git(*args):
    r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return r.stdout.strip()


def compare(a_path, b_path, only=None):
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    fields = ["ptx", "sass", "amdgcn"]
    if a["meta"]["no_line_info"] and b["meta"]["no_line_info"]:
        fields += ["raw", "bin"]
    bad = 0
    keys = sorted(k for k in set(a["kernels"]) | set(b["kernels"])
                  if not only or re.search(only, k))
    for key in keys:
        ra, rb = a["kernels"].get(key), b["kernels"].get(key)
        if ra is None or rb is None:
            bad += 1
            print(f"{key}: only in {a_path if rb is None else b_path}")
            continue
        diff = [k for k in fields + ["error"] if ra.get(k) != rb.get(k)]
        if diff:
            bad += 1
            print(f"{key}: differs in {', '.join(diff)}")
    n = len(set(a["kernels"]) & set(b["kernels"]) & set(keys))
    print(f"{n} kernel/target rows in both ({a['meta']['commit']} vs {b['meta']['commit']}), "
          f"compared on {', '.join(fields)}: {bad} differ")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--only", default=None, help="regex on 'name@target'")
    d.add_argument("--no-line-info", action="store_true")
    d.add_argument("--keep", default=None)
    d.add_argument("--label", default=None, help="the commit the tree is (default: git HEAD)")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--only", default=None, help="regex on 'name@target'")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.before, args.after, args.only)
    from csa_jax.kernels.gluon import adapter
    why = adapter.missing()
    if why:
        print(f"skipped: {why}")
        return 0
    return dump(args.out, args.only, args.no_line_info, args.keep, args.label)


if __name__ == "__main__":
    sys.exit(main())
