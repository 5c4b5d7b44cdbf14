"""Shared memory -> registers for a transposed MMA operand, three ways (issue 14's ablation probe).

    python -m benchmarks.gluon_transpose_probe [--compile-only] [--out f.json]

A bf16 tile sits in shared memory as [K, M] (M contiguous); the consumer wants it as the wgmma
A operand [M, K] in registers (DotOperandLayout, k_width 2): the situation of dS^T q, P^T dO and
a kv tile read transposed in the CSA backward. Modes, everything else equal (same tile, same
loop, same register consumer: acc += a in bf16, one store at the end):

  0 plain      the tile stored [M, K] (K contiguous) and loaded as it is: the reference
  1 ldsm_trans stored [K, M] with the NVMMA swizzle, `.permute((1, 0)).load(dot)`: the compiler
               uses ldmatrix .trans, Hopper's transpose-load (AMD's ds_read_tr analog)
  2 reg_trans  stored [K, M], loaded with 16-byte vector reads along M into a blocked layout,
               transposed in registers (gl.permute) and converted to the operand layout
               (the conversion is the compiler's: shuffles or a shared-memory round trip,
               reported from the PTX)
  3 strided    stored [K, M] unswizzled, `.permute((1, 0)).load(dot)`: no ldmatrix applies, so
               each thread reads its elements with strided 2-byte shared loads

Each program fills NB buffers of [M, K] once, then reads buffer i % NB for ITERS iterations
(the dynamic index keeps the loads in the loop). Reported: GB/s of shared memory read
(ITERS * M * K * 2 bytes per program over the kernel time) and its ratio to mode 0; with
--compile-only (CPU), the sm_90a resources and the shared-memory instruction mix of each mode.
Not yet run on a GPU (docs/perf/gluon_bwd_h200.md).
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MODES = {0: "plain", 1: "ldsm_trans", 2: "reg_trans", 3: "strided"}


@gluon.jit
def transpose_probe_kernel(src_ptr, out_ptr, MODE: gl.constexpr, M: gl.constexpr,
                           KD: gl.constexpr, ITERS: gl.constexpr, NB: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 64, 16])
    dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # 16-byte vectors along the contiguous dimension of a [R, C] tile.
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    # Mode 2's read layout of the [K, M] tile: 16-byte vectors along M, and warp w holds
    # columns m = 16w..16w+15 (the rows of the operand that warp w owns in the wgmma layout),
    # so the transpose needs no data from other warps.
    wblk: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, gl.num_warps()], [1, 0])
    dt: gl.constexpr = src_ptr.dtype.element_ty
    pid = gl.program_id(0)
    if MODE == 0:
        R: gl.constexpr = M
        C: gl.constexpr = KD
    else:
        R: gl.constexpr = KD
        C: gl.constexpr = M
    if MODE == 3:
        # Element-granular swizzle: no 16-byte row segments, so ldmatrix cannot apply.
        lay: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 8, [1, 0])
    else:
        lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, C], dt)
    smem = gl.allocate_shared_memory(dt, [NB, R, C], lay)
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, blk))
    for b in gl.static_range(NB):                          # src [NB, R, C]
        tile = gl.load(src_ptr + (b * R + rows)[:, None] * C + cols[None, :])
        smem.index(b).store(tile)
    gl.thread_barrier()
    acc = gl.zeros([M, KD], dt, dot)
    for i in range(ITERS):
        buf = smem.index(i % NB)
        if MODE == 0:
            a = buf.load(dot)
        elif MODE == 2:
            a = gl.convert_layout(gl.permute(buf.load(wblk), (1, 0)), dot)
        else:
            a = buf.permute((1, 0)).load(dot)
        acc = acc + a
    orows = gl.arange(0, M, layout=gl.SliceLayout(1, blk))
    ocols = gl.arange(0, KD, layout=gl.SliceLayout(0, blk))
    gl.store(out_ptr + pid * (M * KD) + orows[:, None] * KD + ocols[None, :],
             gl.convert_layout(acc, blk))


def constexprs(mode, M=64, KD=64, iters=2048, nb=2):
    return dict(MODE=mode, M=M, KD=KD, ITERS=iters, NB=nb)


def instruction_mix(ptx):
    """Counts of the shared-memory and shuffle instructions in a PTX module (static)."""
    keys = ("ldmatrix.sync.aligned.m8n8.x4.trans", "ldmatrix.sync.aligned.m8n8.x4.shared",
            "ld.shared.v4", "ld.shared.v2", "ld.shared.b16", "ld.shared.u16", "ld.shared.b32",
            "st.shared", "shfl.sync", "prmt", "bar.sync")
    out = {}
    for k in keys:
        n = len(re.findall(re.escape(k), ptx))
        if n:
            out[k] = n
    return out


def loop_body(ptx):
    """The PTX of the kernel's one backward branch (the ITERS loop): from its label to the
    branch that jumps back to it."""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\S+);", line)
        if m:
            head = [k for k, l in enumerate(lines[:i]) if l.startswith(m.group(1) + ":")]
            if head:
                return "\n".join(lines[head[0]:i])
    raise ValueError("no backward branch (loop) in the PTX")


def compile_only():
    from csa_jax.kernels.gluon.adapter import compile_kernel, resources
    rows = []
    for mode, name in MODES.items():
        c = compile_kernel(transpose_probe_kernel, ["*bf16", "*bf16"], constexprs(mode),
                           target="sm_90a", num_warps=4)
        r = resources(c, "sm_90a")
        r.pop("ptxas", None)
        rows.append(dict(mode=mode, name=name, shared=r["shared"], registers=r.get("registers"),
                         spill_stores=r.get("spill_stores"),
                         loop_mix=instruction_mix(loop_body(c.asm["ptx"]))))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_gpu(reps=20, programs=132 * 8):
    import jax
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    from benchmarks.common import time_fn
    rows = []
    M = KD = 64
    nb, iters = 2, 2048
    src = jax.random.normal(jax.random.PRNGKey(0), (nb, KD, M), jnp.bfloat16)    # [K, M] tiles
    src_t = jnp.swapaxes(src, 1, 2)                       # the same tiles stored [M, K] (mode 0)
    base = ref = None
    for mode, name in MODES.items():
        f = jax.jit(lambda s, mode=mode: gluon_call(
            s, kernel=transpose_probe_kernel,
            out_shape=jax.ShapeDtypeStruct((programs * M * KD,), jnp.bfloat16),
            grid=(programs,), num_warps=4, **constexprs(mode, M, KD, iters, nb)))
        arg = (src_t if mode == 0 else src).reshape(-1)
        out = f(arg)
        ms = time_fn(f, (arg,), reps, float("inf"))[0]
        gbs = programs * iters * M * KD * 2 / ms / 1e6
        row = dict(mode=mode, name=name, ms=ms, gb_s=gbs)
        if mode == 0:
            base, ref = gbs, out
        else:
            # Every mode hands the consumer the same operand: the sums must agree exactly.
            row["ratio_to_plain"] = gbs / base
            row["same_as_plain"] = bool(jnp.array_equal(out, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = compile_only() if args.compile_only else run_gpu()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
