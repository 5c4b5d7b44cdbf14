"""Did a source change alter the generated GPU code? Hashes of every Gluon kernel that the
library's default path launches, captured from the dispatch itself, on a CPU.

    python -m benchmarks.gluon_asm_diff dump OUT.json [--only REGEX] [--no-line-info]
        [--keep DIR] [--label COMMIT] [--T 4096]
    python -m benchmarks.gluon_asm_diff compare BEFORE.json AFTER.json [--only REGEX]

`dump` runs impl="gluon"'s forward and backward (the impl-module interface: default_config,
forward, backward) under `jax.eval_shape` for every V4 layer type (Flash H = 64 and Pro H = 128,
cr0 / cr4 / cr128, D = 512, T = --T), once as NVIDIA Hopper and once per AMD target
(gfx942 / gfx950 / gfx1250), with the launch (`adapter.gluon_call`) replaced by a recorder: so
the kernels compared are exactly those the dispatch picks at its defaults, with the constexprs
it computes, whatever the source files are called. cr0 is captured twice: with no layout
promise and with layout "cr0" (what the NNX layer passes). Each recorded launch is compiled for
its target with triton 3.6.0's bundled compilers (a fresh cache directory) and hashed:

- ptx (sm_90a): the PTX with source line info removed (`.loc` / `.file` directives, the
  `$L__tmp` labels they use, the `.debug_*` sections) and the kernel's own name replaced by
  `KERNEL` (a renamed function is the same code);
- sass (sm_90a): `cuobjdump -sass` of the cubin, the name replaced likewise;
- amdgcn (gfx942 / gfx950 / gfx1250): the assembly text with the same removals;
- raw / bin: the unmodified text / binary (differ whenever a source line moves, unless both
  dumps were made with --no-line-info; compared only for a kernel that kept its name).

Line info changes ptxas's register allocation (seen: the same normalized PTX, other SASS), so
the comparison that proves "same code" is two --no-line-info dumps.

Rows are keyed `job[family,layer(,promise)]@target` (job: fwd, dq, reduce, in launch order).
`compare` prints one line per row whose normalized hashes differ or that is in one file only,
and exits 1 if there is any. The dump needs only the impl-module interface and
`adapter.gluon_call`, so the same script dumps an older checkout:
`PYTHONPATH=OLD_TREE python benchmarks/gluon_asm_diff.py dump before.json --label COMMIT`.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

_DROP = re.compile(r"^\s*(\.loc|\.file)\s|^\s*(\$L__tmp|\.Ltmp)\d+:\s*$")
FAMILIES = (("flash", 64, 512), ("pro", 128, 1024))      # (family, H, cr4 top-k)
LAYERS = (0, 4, 128)
AMD_TARGETS = ("gfx942", "gfx950", "gfx1250")


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


def _unname(text, name):
    """The text with the kernel's own name (entry symbol, parameter names) made neutral, and the
    padding before end-of-line comments (which follows the name's length) made one space."""
    text = re.sub(rf"\b{re.escape(name)}(?=\b|_param)", "KERNEL", text)
    return re.sub(r"[ \t]+//", " //", text)


def sass(cubin):
    from triton.backends.nvidia.compiler import get_ptxas
    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def shapes(T):
    """(tag, q_shape, kv_shape, idx_shape, layout) of every V4 layer type at T tokens."""
    for family, H, topk in FAMILIES:
        for ratio in LAYERS:
            pool = 0 if ratio == 0 else T // ratio
            K = 128 + (topk if ratio == 4 else pool)
            q, kv, idx = (1, T, H, 512), (1, T + pool, 512), (1, T, K)
            yield f"{family},cr{ratio}", q, kv, idx, None
            if ratio == 0:
                yield f"{family},cr0,promise", q, kv, idx, "cr0"


@contextlib.contextmanager
def _recording(gluon, arch):
    """Within: gluon_call records (kernel, arg types, constexprs, warps) and returns zeros;
    the package believes it runs on NVIDIA Hopper (arch None) or on AMD `arch`."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon import adapter
    calls = []

    def record(*arrays, kernel, out_shape, grid, num_warps, name="", **constexprs):
        del grid, name
        outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
        types = [adapter.triton_type(a.dtype) for a in (*arrays, *outs)]
        calls.append((kernel, types, dict(constexprs), num_warps))
        zeros = [jnp.zeros(s.shape, s.dtype) for s in outs]
        return zeros if isinstance(out_shape, (list, tuple)) else zeros[0]

    saved = adapter.gluon_call, gluon._cannot_run, gluon._amd
    adapter.gluon_call = record
    gluon._cannot_run = lambda *a, **k: None
    gluon._amd = lambda: arch
    try:
        yield calls
    finally:
        adapter.gluon_call, gluon._cannot_run, gluon._amd = saved


def _config(gluon, q, kv, idx, layout):
    cfg = gluon.default_config(q, kv, idx, "bfloat16")
    if layout is None:
        return cfg
    import dataclasses
    return dataclasses.replace(cfg, layout=layout, window=128)


def captured(T=4096):
    """(key, kernel, arg types, constexprs, warps, target) of every launch the default path
    makes, in launch order, for NVIDIA (sm_90a) and each AMD target."""
    import jax
    import jax.numpy as jnp
    from csa_jax.kernels import gluon
    S = jax.ShapeDtypeStruct
    for target in ("sm_90a", *AMD_TARGETS):
        arch = None if target == "sm_90a" else target
        for tag, q, kv, idx, layout in shapes(T):
            if arch and layout:
                continue                 # AMD runs its generic kernel under any promise
            jax.clear_caches()          # bwd.backward is jitted: re-trace, so every launch records
            with _recording(gluon, arch) as calls:
                cfg = _config(gluon, q, kv, idx, layout)
                bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
                args = (S(q, bf), S(kv, bf), S(idx, i32), S(q[2:3], f32))
                fwd = lambda *a: gluon.forward(*a, scale=512 ** -0.5, interpret=False,  # noqa: E731
                                               config=cfg)
                jax.eval_shape(fwd, *args)
                n_fwd = len(calls)
                bwd = lambda *a: gluon.backward(*a, scale=512 ** -0.5, interpret=False,  # noqa: E731
                                                config=cfg)
                jax.eval_shape(bwd, *args, S(q, bf), S(q[:3], f32), S(q, bf), S(q[:3], f32))
            names = ["fwd"] * n_fwd + ["dq"] + ["reduce"] * (len(calls) - n_fwd - 1)
            jobs = {}
            for job, (kernel, types, consts, warps) in zip(names, calls):
                jobs[job] = jobs.get(job, 0) + 1
                key = f"{job}{jobs[job] if jobs[job] > 1 else ''}[{tag}]@{target}"
                yield key, kernel, types, consts, warps, target


def dump(out, only=None, no_line_info=False, keep=None, label=None, T=4096):
    import triton
    from csa_jax.kernels.gluon import adapter
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="gluon_asm_diff_")
    triton.knobs.compilation.disable_line_info = bool(no_line_info)
    rows, seen = {}, {}
    for key, fn, types, consts, warps, target in captured(T):
        if only and not re.search(only, key):
            continue
        ident = (fn.__module__, fn.__name__, tuple(types), tuple(sorted(consts.items())), warps,
                 target)
        if ident in seen:                # the same launch at another layer: compiled once
            rows[key] = dict(rows[seen[ident]], same_as=seen[ident])
            print(f"{key}: = {seen[ident]}", flush=True)
            continue
        try:
            c = adapter.compile_kernel(fn, types, consts, target=target, num_warps=warps)
        except Exception as e:  # noqa: BLE001 (a kernel that stops compiling is a result)
            rows[key] = dict(error=str(e).strip().splitlines()[-1][:300])
            print(f"{key}: ERROR {rows[key]['error']}", flush=True)
            continue
        seen[ident] = key
        text_key, bin_key = ("ptx", "cubin") if "ptx" in c.asm else ("amdgcn", "hsaco")
        norm = _unname(strip_line_info(c.asm[text_key]), c.metadata.name)
        row = {text_key: _sha(norm), "raw": _sha(c.asm[text_key]),
               "bin": _sha(c.asm[bin_key]), "lines": norm.count("\n"), "kernel": fn.__name__}
        if bin_key == "cubin":
            row["sass"] = _sha(_unname(sass(c.asm["cubin"]), c.metadata.name))
        rows[key] = row
        if keep:
            os.makedirs(keep, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_.=,@-]", "_", key)
            with open(os.path.join(keep, f"{safe}.{text_key}"), "w") as f:
                f.write(norm)
        print(f"{key}: {fn.__name__} {text_key} {row[text_key][:16]} ({row['lines']} lines)",
              flush=True)
    meta = dict(no_line_info=bool(no_line_info), triton=triton.__version__, T=T,
                commit=label or _git("rev-parse", "--short", "HEAD"),
                dirty=bool(_git("status", "--porcelain", "--untracked-files=no")) and not label)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, kernels=rows), f, indent=1, sort_keys=True)
    print(f"{len(rows)} kernel/target rows ({len(seen)} distinct launches) -> {out} ({meta})")
    return 0 if not any("error" in r for r in rows.values()) else 1


def _git(*args):
    r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return r.stdout.strip()


def compare(a_path, b_path, only=None):
    from benchmarks import dump_diff
    a, b = dump_diff.load_pair(a_path, b_path)
    fields = ["ptx", "sass", "amdgcn"]
    extra = a["meta"]["no_line_info"] and b["meta"]["no_line_info"]

    def compared(ra, rb):
        # raw / bin carry the kernel's name: compared only where it is the same
        same = fields + (["raw", "bin"] if extra and ra.get("kernel") == rb.get("kernel") else [])
        return same + ["error"]

    _, bad, both = dump_diff.row_diffs(a, b, a_path, b_path, compared, only)
    print(f"{len(both)} kernel/target rows in both ({a['meta']['commit']} vs {b['meta']['commit']}), "
          f"compared on {', '.join(fields)}{' (+ raw, bin where the name is the same)' if extra else ''}: {bad} differ")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--only", default=None, help="regex on 'job[family,layer]@target'")
    d.add_argument("--no-line-info", action="store_true")
    d.add_argument("--keep", default=None, help="write the normalized texts to this folder")
    d.add_argument("--label", default=None, help="the commit the tree is (default: git HEAD)")
    d.add_argument("--T", type=int, default=4096, help="tokens of the captured shapes")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--only", default=None, help="regex on 'job[family,layer]@target'")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.before, args.after, args.only)
    from csa_jax.kernels.gluon import adapter
    why = adapter.missing()
    if why:
        print(f"skipped: {why}")
        return 0
    return dump(args.out, args.only, args.no_line_info, args.keep, args.label, args.T)


if __name__ == "__main__":
    sys.exit(main())
