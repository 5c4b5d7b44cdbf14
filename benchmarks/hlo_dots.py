"""Every matrix product of the jitted train step: operand dtypes and the source line it came from.

    python -m benchmarks.hlo_dots                          # small preset, T=512, bf16 compute, xla
    python -m benchmarks.hlo_dots --preset small --seq-len 1024 --only-f32

Lowers `SingleDeviceRunner.step` on abstract shapes (no parameters are materialised, nothing
runs), reads the StableHLO with debug locations, and lists each `dot_general` / `convolution`:
its operand and result types and the innermost frames of this repository (csa_jax/, train/)
that traced it. An f32 x f32 product on a GPU runs on CUDA cores (or TF32 at best), so in a
bf16 training step every such line is a candidate for bf16 operands with f32 accumulation.
Prints a table grouped by (operand dtypes, source line) with the count of products.
"""

from __future__ import annotations

import argparse
import collections
import re

_LOC_DEF = re.compile(r"^(#loc\d*) = (loc\(.*\))$", re.M)
_DOT = re.compile(r"stablehlo\.(dot_general|convolution)\b.*?:\s*\((tensor<[^>]*>),\s*"
                  r"(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)\s*loc\((#loc\d*)\)")
_FILE = re.compile(r'loc\("([^"]+)":(\d+):\d+')


def _frames(ref, locs, depth=0):
    """The file:line frames a location alias resolves to, innermost (callee) first."""
    text = locs.get(ref, "")
    if depth > 200 or not text:
        return []
    m = _FILE.match(text)
    if m:
        return [(m.group(1), int(m.group(2)))]
    m = re.match(r"loc\(callsite\((#loc\d*) at (#loc\d*)\)\)", text)
    if m:
        return _frames(m.group(1), locs, depth + 1) + _frames(m.group(2), locs, depth + 1)
    m = re.match(r'loc\("[^"]*"\((#loc\d*)\)\)', text)
    if m:
        return _frames(m.group(1), locs, depth + 1)
    out = []
    for inner in re.findall(r"#loc\d*", text[4:]):
        out += _frames(inner, locs, depth + 1)
    return out


def _elem(tensor_type):
    return tensor_type.rsplit("x", 1)[-1].rstrip(">").split("<")[-1]


def list_dots(mlir_text, repo_markers=("csa_jax/", "train/", "comm/")):
    """[(kind, lhs type, rhs type, result type, [repo frames 'path:line', innermost first])]."""
    locs = dict(_LOC_DEF.findall(mlir_text))
    rows = []
    for m in _DOT.finditer(mlir_text):
        kind, lhs, rhs, res, ref = m.groups()
        frames = [f"{_short(f, repo_markers)}:{ln}" for f, ln in _frames(ref, locs)
                  if _short(f, repo_markers)]
        rows.append((kind, lhs, rhs, res, frames))
    return rows


def _short(path, markers):
    for mk in markers:
        i = path.rfind("/" + mk)
        if i >= 0:
            return path[i + 1:]
        if path.startswith(mk):
            return path
    return None


def lower_step(preset, seq_len, impl, dtype, batch_size=1):
    """The StableHLO text (with debug locations) of the train step of a preset."""
    import jax
    import jax.numpy as jnp

    from train.config import get_preset
    from train.loop import init_state
    from train.parallel import make_runner

    cfg = get_preset(preset, model=dict(impl=impl, compute_dtype=dtype), seq_len=seq_len,
                     batch_size=batch_size, steps=10, warmup_steps=1)
    keep = {}

    def init():
        graphdef, state, tx, schedule = init_state(cfg)
        keep.update(graphdef=graphdef, tx=tx, schedule=schedule)
        return state

    state = jax.eval_shape(init)
    runner = make_runner(cfg, keep["graphdef"], None, keep["tx"], keep["schedule"])
    tok = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return runner.step.lower(state, (tok, tok)).as_text(debug_info=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--impl", default="xla")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--only-f32", action="store_true", help="only products with an f32 operand")
    p.add_argument("--frames", type=int, default=2, help="repo frames shown per product")
    args = p.parse_args(argv)
    rows = list_dots(lower_step(args.preset, args.seq_len, args.impl, args.dtype))
    groups = collections.Counter()
    for kind, lhs, rhs, res, frames in rows:
        ops = f"{_elem(lhs)} x {_elem(rhs)} -> {_elem(res)}"
        if args.only_f32 and "f32" not in (_elem(lhs), _elem(rhs)):
            continue
        groups[(ops, " < ".join(frames[: args.frames]) or "(outside the repo)")] += 1
    n32 = sum(1 for r in rows if "f32" in (_elem(r[1]), _elem(r[2])))
    print(f"{len(rows)} products, {n32} with an f32 operand "
          f"({args.preset}, T={args.seq_len}, {args.dtype}, impl={args.impl})\n")
    print("| count | operands | source (innermost first) |\n|---|---|---|")
    for (ops, src), n in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[1])):
        print(f"| {n} | {ops} | {src} |")


if __name__ == "__main__":
    main()
