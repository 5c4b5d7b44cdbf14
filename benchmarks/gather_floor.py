"""The gather floor of the CSA forward: a kernel that only gathers each token's kv rows.

    python -m benchmarks.gather_floor [--families pro] [--ratios 4] [--seqs 16384]
        [--variants 'bk64w4s3,bk32w4s4,...'] [--reps 7] [--out floor.json]

Every token reads its K rows of D (bf16) by idx, as the forward does, and sums them into one
f32 row (so no load can be dropped): no q, no scores, no softmax, no output beyond [T, D] f32.
Its time is what any one-token-per-program forward pays to move the rows from L2 / HBM into
the SMs, whatever its head count (issue 28: at H = 16 the forward's matrix work is 0.6 TFLOP,
so this gather, 19.3 GB at Pro cr4 T = 16384, is its floor). Pallas Triton dialect, the
pallas_triton forward's gather (csa_jax/kernels/triton/plan.py: masked 2-D pointer loads of
whole rows, pipelined by the compiler). Variants `bk{rows}w{warps}s{stages}`.

Checked on each run: the sums equal jnp's on the same inputs (f32, 1e-5 relative) for the
first 256 tokens. GB/s counts the valid rows' bytes (-1 slots are not read).
"""
from __future__ import annotations

import argparse
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from benchmarks.common import make_problem, time_fn
from csa_jax.kernels.triton.plan import _gather_tile


def _kernel(idx_ref, kv_ref, o_ref, *, bk):
    kp = idx_ref.shape[0]

    def body(i, acc):
        rows, _ = _gather_tile(idx_ref, kv_ref, i * bk, bk)
        return acc + jnp.sum(rows.astype(jnp.float32), axis=0)

    o_ref[...] = lax.fori_loop(0, kp // bk, body, jnp.zeros((kv_ref.shape[1],), jnp.float32))


def gather_sum(kv, idx, *, bk=64, num_warps=4, num_stages=3, interpret=False):
    """[T, D] f32: sum over each token's valid slots of kv[idx] (kv [N, D], idx [T, K])."""
    T, K = idx.shape
    kp = -(-K // bk) * bk
    idx = jnp.pad(idx, ((0, 0), (0, kp - K)), constant_values=-1)
    return pl.pallas_call(
        functools.partial(_kernel, bk=bk),
        grid=(T,),
        in_specs=[pl.BlockSpec((None, kp), lambda t: (t, 0)),
                  pl.BlockSpec(kv.shape, lambda t: (0, 0))],
        out_specs=pl.BlockSpec((None, kv.shape[1]), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((T, kv.shape[1]), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="csa_gather_floor")(idx, kv)


def reference(kv, idx):
    rows = jnp.where((idx >= 0)[..., None], kv[jnp.maximum(idx, 0)].astype(jnp.float32), 0.0)
    return rows.sum(axis=1)


def parse_variant(v):
    m = re.fullmatch(r"bk(\d+)w(\d+)s(\d+)", v.strip())
    if not m:
        raise ValueError(f"variant {v!r}: expected bk<rows>w<warps>s<stages>, e.g. bk64w4s3")
    return dict(bk=int(m[1]), num_warps=int(m[2]), num_stages=int(m[3]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="pro")
    ap.add_argument("--ratios", default="4")
    ap.add_argument("--seqs", default="16384")
    ap.add_argument("--variants", default="bk64w4s3,bk64w8s3,bk32w4s4,bk64w4s2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--time-cap", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test (tiny shapes)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    variants = [(v, parse_variant(v)) for v in a.variants.split(",") if v.strip()]
    rows = []
    for fam in a.families.split(","):
        for ratio in map(int, a.ratios.split(",")):
            for T in map(int, a.seqs.split(",")):
                _, q, kv, idx, _, _ = make_problem(fam, ratio, T, "random", a.seed)
                kv2, idx2 = kv[0], idx[0]
                if a.interpret:
                    idx2 = idx2[:8]
                n_valid = int(jnp.sum(idx2 >= 0))
                gbytes = n_valid * kv2.shape[1] * kv2.dtype.itemsize / 1e9
                ref = np.asarray(reference(kv2, idx2[:256]))
                for name, kw in variants:
                    fn = jax.jit(lambda kv, i, kw=kw: gather_sum(kv, i, interpret=a.interpret,
                                                                 **kw))
                    out = np.asarray(fn(kv2, idx2))[:256]
                    err = float(np.max(np.abs(out - ref)) / max(1e-30, np.max(np.abs(ref))))
                    ms = time_fn(fn, (kv2, idx2), a.reps, a.time_cap)[0]
                    r = dict(family=fam, ratio=ratio, T=T, variant=name, **kw, ms=ms,
                             gbytes=gbytes, gb_s=gbytes / ms * 1e3, err=err, ok=err < 1e-5)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)
    print("\n| layer | T | variant | ms | GB gathered | GB/s | err | ok |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} cr{r['ratio']} | {r['T']} | {r['variant']} | {r['ms']:.3f} | "
              f"{r['gbytes']:.2f} | {r['gb_s']:.0f} | {r['err']:.1e} | {r['ok']} |")
    if not all(r["ok"] for r in rows):
        raise SystemExit("gather_floor: a variant's sums differ from jnp's")


if __name__ == "__main__":
    main()
