"""Did a source change alter pallas_triton's generated GPU code? Hashes of every Pallas Triton
kernel that the impl's default configs launch, lowered and compiled on a CPU.

    python -m benchmarks.triton_asm_diff dump OUT.json [--only REGEX] [--label COMMIT]
        [--no-compile]
    python -m benchmarks.triton_asm_diff compare BEFORE.json AFTER.json

`dump` lowers impl="pallas_triton"'s forward and backward (the impl-module interface:
default_config, forward, backward) with the default config that `default_config` returns for
the target's device kind (`config._device_kind` patched, as benchmarks/triton_compile.py does),
for every problem of `problems()`: NVIDIA (sm_90a) at H = 8, 16, 32, 64, 128 and D = 128, 512;
AMD gfx942 / gfx950 at H = 16, 64 and D = 128, 512; a few f32 ones; each at the cr0, cr4 and
cr128 index shapes (T = 2048: K = 128, 128 + min(topk, T/4), 128 + T/128 = 144, the last not a
multiple of 32). Every Triton kernel in the lowered program (`ir` attribute of each custom call,
in program order; the dkv reduce launches twice with reduce_split) is hashed three ways:

- ttir: its Triton-dialect module printed without debug info (locations);
- ptx (sm_90a) / amdgcn (gfx*): compiled by triton 3.6.0's bundled backend from that TTIR
  (benchmarks/triton_compile.compile_ttir; launch warps / stages read from the custom call) with
  line info off, `.loc` / `.file` lines and `.debug_*` sections removed
  (gluon_asm_diff.strip_line_info); the kernel name is the same on both sides;
- program: the whole lowered StableHLO text (XLA glue included: the inverse map, the per-slot
  GEMM, delta, padding) with each kernel's `ir` bytes replaced by its ttir hash.

`compare` prints each row whose hashes differ or that is in one file only and exits 1 if any.
The dump needs only the impl-module interface and `config._device_kind`, so the same script
dumps an older checkout: `PYTHONPATH=OLD_TREE python benchmarks/triton_asm_diff.py dump ...
--label COMMIT` (the file run as a script: `csa_jax` and `benchmarks` then come from OLD_TREE).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from unittest import mock

T = 2048
# (target, platform, device kind) of the lowering
TARGETS = {"sm_90a": ("cuda", "NVIDIA H200"), "gfx942": ("rocm", "gfx942"),
           "gfx950": ("rocm", "gfx950")}


def problems():
    """(tag, target, q_shape, kv_shape, idx_shape, dtype) of every problem dumped."""
    def layers(H, D, topk):
        for ratio in (0, 4, 128):
            pool = 0 if ratio == 0 else T // ratio
            K = 128 + (min(topk, pool) if ratio == 4 else pool)
            yield ratio, (1, T, H, D), (1, T + pool, D), (1, T, K)

    cases = [("sm_90a", H, D, "bfloat16") for H in (8, 16, 32, 64, 128) for D in (128, 512)]
    cases += [(t, H, D, "bfloat16") for t in ("gfx942", "gfx950") for H in (16, 64)
              for D in (128, 512)]
    cases += [("sm_90a", H, 128, "float32") for H in (16, 64)]
    cases += [("gfx942", H, 128, "float32") for H in (16, 64)]
    for target, H, D, dt in cases:
        topk = 1024 if D == 512 else 512
        for ratio, q, kv, idx in layers(H, D, topk):
            yield f"H{H},D{D},cr{ratio},{dt[:4]}", target, q, kv, idx, dt


_IR = re.compile(r'ir = "((?:[^"\\]|\\.)*)"')
_PARAMS = re.compile(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def _sha(data):
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()


def kernels_in(lowered_text):
    """([(name, ttir text, num_warps, num_stages)] in program order, the program text with each
    kernel's ir bytes replaced by the hash of its ttir text)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir._mlir_libs import _triton_ext
    from benchmarks import triton_ir
    out, pieces, at = [], [], 0
    for m in _IR.finditer(lowered_text):
        p = _PARAMS.search(lowered_text, m.end())
        with ir.Context() as ctx:
            _triton_ext.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            text = ir.Module.parse(triton_ir._bytecode(m.group(1))).operation.get_asm(
                enable_debug_info=False)
        out.append((p.group(1), text, int(p.group(3)), int(p.group(2))))
        pieces += [lowered_text[at:m.start()], f'ir = "sha256:{_sha(text)}"']
        at = m.end()
    pieces.append(lowered_text[at:])
    return out, "".join(pieces)


def lower(target, q, kv, idx, dtype):
    """(the default Config, [(job, name, ttir, warps, stages)], program hash) of one problem."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    from csa_jax.kernels import triton as pt
    from csa_jax.kernels.triton import config as tc
    platform, kind = TARGETS[target]
    dt = jnp.dtype(dtype)
    with mock.patch.object(tc, "_device_kind", lambda: (platform, kind)):
        cfg = pt.default_config(q, kv, idx, dt)
    S = jax.ShapeDtypeStruct
    qs, kvs, idxs = S(q, dt), S(kv, dt), S(idx, jnp.int32)
    sink, lse = S(q[2:3], jnp.float32), S(q[:3], jnp.float32)
    kw = dict(scale=q[3] ** -0.5, interpret=False, config=cfg)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=None, platform=platform))
    launches, programs = [], []
    with use_abstract_mesh(mesh):
        for job, fn, args in (("fwd", lambda *a: pt.forward(*a, **kw), (qs, kvs, idxs, sink)),
                              ("bwd", lambda *a: pt.backward(*a, **kw),
                               (qs, kvs, idxs, sink, qs, lse, qs, lse))):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            ks, program = kernels_in(text)
            programs.append(program)
            seen = {}
            for name, ttir, nw, ns in ks:
                seen[name] = seen.get(name, 0) + 1
                launches.append((f"{job}:{name}#{seen[name]}", name, ttir, nw, ns))
    return cfg, launches, _sha("\n".join(programs))


def dump(out, only=None, label=None, compile_=True):
    import triton
    from benchmarks.gluon_asm_diff import strip_line_info
    from benchmarks.triton_compile import compile_ttir
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="triton_asm_diff_")
    triton.knobs.compilation.disable_line_info = True
    rows, compiled = {}, {}
    for tag, target, q, kv, idx, dt in problems():
        if only and not re.search(only, f"{tag}@{target}"):
            continue
        cfg, launches, program = lower(target, q, kv, idx, dt)
        rows[f"program[{tag}]@{target}"] = dict(program=program)
        for job, name, ttir, nw, ns in launches:
            key = f"{job}[{tag}]@{target}"
            row = dict(ttir=_sha(ttir), warps=nw, stages=ns)
            ident = (row["ttir"], nw, ns, target)
            if compile_ and ident not in compiled:
                try:
                    _, asm = compile_ttir(ttir, target, nw, ns)
                    text_key = "ptx" if "ptx" in asm else "amdgcn"
                    norm = strip_line_info(asm[text_key])
                    compiled[ident] = {text_key: _sha(norm), "lines": norm.count("\n")}
                except Exception as e:  # noqa: BLE001 (a kernel that stops compiling is a result)
                    compiled[ident] = dict(error=str(e).strip().splitlines()[-1][:300])
            row.update(compiled.get(ident, {}))
            rows[key] = row
            asm_hash = row.get("ptx") or row.get("amdgcn") or row.get("error", "-")
            print(f"{key}: ttir {row['ttir'][:12]} asm {asm_hash[:12]} w{nw} s{ns}", flush=True)
    meta = dict(triton=triton.__version__, T=T, compiled=compile_,
                commit=label or _git("rev-parse", "--short", "HEAD"),
                dirty=bool(_git("status", "--porcelain", "--untracked-files=no")) and not label)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, kernels=rows), f, indent=1, sort_keys=True)
    n_launch = sum(1 for k in rows if not k.startswith("program"))
    print(f"{len(rows) - n_launch} programs, {n_launch} kernel launches ({len(compiled)} distinct "
          f"compiles) -> {out} ({meta})")
    return 0 if not any("error" in r for r in rows.values()) else 1


def _git(*args):
    r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return r.stdout.strip()


def _kind(key, row):
    return "program" if key.startswith("program") else ("ptx" if "ptx" in row else
                                                         "amdgcn" if "amdgcn" in row else "ttir")


def compare(a_path, b_path):
    from benchmarks import dump_diff
    return dump_diff.compare_tally(
        a_path, b_path, ("program", "ttir", "ptx", "amdgcn", "warps", "stages", "error"),
        lambda key, row: (key.rsplit("@", 1)[1], _kind(key, row)),
        ("target", "what", "identical"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--only", default=None, help="regex on 'H..,D..,cr..,dtype@target'")
    d.add_argument("--label", default=None, help="the commit the tree is (default: git HEAD)")
    d.add_argument("--no-compile", action="store_true", help="ttir and program hashes only")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.before, args.after)
    import warnings
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
    return dump(args.out, args.only, args.label, not args.no_compile)


if __name__ == "__main__":
    sys.exit(main())
