"""Did a source change alter pallas_tpu's kernels? Hashes of the Mosaic MLIR of every kernel
that the impl's default configs launch, lowered for a TPU generation on a CPU (libtpu).

    python -m benchmarks.tpu_mlir_diff dump OUT.json [--only REGEX] [--label COMMIT]
    python -m benchmarks.tpu_mlir_diff compare BEFORE.json AFTER.json

`dump` takes every kernel of csa_jax.kernels.tpu.aot.kernels (forward; backward launch 0 and a
shorter last token-chunk launch; both CSR dkv reductions of gathered slots) for the V4 layers
(Flash and Pro, cr0 / cr4 / cr128 in their structured layout, cr4 also generic; bf16 and f32;
T = 4096) with default_config's Config for each generation (v4, v5e, v6e), lowers it for that
generation's device (aot.target_device: no TPU needed) and hashes

- mosaic: each tpu_custom_call's kernel body (base64 MLIR bytecode in its backend_config)
  parsed with the TPU dialect and printed without debug info (locations), so a moved source
  line is not a change;
- program: the whole lowered StableHLO text with each body replaced by its mosaic hash (the
  XLA glue around the kernel: padding, the CSR maps, the scoped VMEM limit, the launch
  parameters).

`compare` prints each row whose hashes differ or that is in one file only and exits 1 if any.
An older checkout dumps with the same file run as a script:
`PYTHONPATH=OLD_TREE python benchmarks/tpu_mlir_diff.py dump before.json --label COMMIT`.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys

T = 4096
GENS = ("v4", "v5e", "v6e")
_BODY = re.compile(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22')


def _sha(data):
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()


def problems():
    """(tag, family, ratio, layout, dtype, generation) of every problem dumped."""
    for gen in GENS:
        for family in ("flash", "pro"):
            for ratio, layout in ((0, "struct"), (4, "struct"), (128, "struct"), (4, "generic")):
                for dt in ("bfloat16", "float32"):
                    yield f"{family},cr{ratio},{layout},{dt[:4]}", family, ratio, layout, dt, gen


def mosaic_texts(lowered_text):
    """([Mosaic module text without locations] of each tpu_custom_call, in program order; the
    program text with each body replaced by its text's hash)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir._mlir_libs import _tpu_ext
    texts, pieces, at = [], [], 0
    for m in _BODY.finditer(lowered_text):
        with ir.Context() as ctx:
            _tpu_ext.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            text = ir.Module.parse(base64.b64decode(m.group(1))).operation.get_asm(
                enable_debug_info=False)
        texts.append(text)
        pieces += [lowered_text[at:m.start(1)], f"sha256:{_sha(text)}"]
        at = m.end(1)
    pieces.append(lowered_text[at:])
    return texts, "".join(pieces)


def dump(out, only=None, label=None):
    import jax
    from csa_jax.kernels.tpu import aot
    rows = {}
    for tag, family, ratio, layout, dt, gen in problems():
        if only and not re.search(only, f"{tag}@{gen}"):
            continue
        p = aot.layer_problem(family, ratio, T, dt, layout=layout, generation=gen)
        dev = aot.target_device(gen)
        sh = jax.sharding.SingleDeviceSharding(dev)
        for k in aot.kernels(p):
            placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in k.args]
            with jax.default_device(dev):
                text = jax.jit(k.fn, donate_argnums=k.donate).trace(*placed).lower().as_text()
            texts, program = mosaic_texts(text)
            key = f"{k.name}[{tag}]@{gen}"
            rows[key] = dict(mosaic=_sha("\n".join(texts)), kernels=len(texts),
                             program=_sha(program), config=repr(p.config))
            print(f"{key}: mosaic {rows[key]['mosaic'][:12]} program {rows[key]['program'][:12]}"
                  f" ({len(texts)} kernel(s))", flush=True)
    meta = dict(T=T, jax=jax.__version__, commit=label or _git("rev-parse", "--short", "HEAD"))
    with open(out, "w") as f:
        json.dump(dict(meta=meta, kernels=rows), f, indent=1, sort_keys=True)
    print(f"{len(rows)} kernel rows -> {out} ({meta})")
    return 0


def _git(*args):
    r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return r.stdout.strip()


def compare(a_path, b_path):
    from benchmarks import dump_diff
    return dump_diff.compare_tally(
        a_path, b_path, ("mosaic", "program", "kernels"),
        lambda key, row: (key.rsplit("@", 1)[1], key.split("[")[0]),
        ("generation", "kernel", "identical (mosaic and program)"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--only", default=None, help="regex on 'family,crR,layout,dtype@gen'")
    d.add_argument("--label", default=None, help="the commit the tree is (default: git HEAD)")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.before, args.after)
    from csa_jax.kernels.tpu import aot
    if not aot.libtpu_available():
        print("skipped: libtpu is not installed (pip install -e '.[tpu-aot]')")
        return 0
    return dump(args.out, args.only, args.label)


if __name__ == "__main__":
    sys.exit(main())
