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

Variants `ring{rows}s{stages}` (and `...a1`, `...nr`) gather the same rows the way the Gluon
forwards do (NVIDIA only): one persistent program per SM whose producer partition (4 warps,
csa_jax/kernels/gluon/ring.py's _gather_tiles: 16-byte cp.async into a `stages`-deep
shared-memory ring of `rows`-row tiles, mbarriers; row ids two tiles ahead, `a1`: one, as the
64-head forward's producer) feeds one consumer warpgroup
that loads each tile from shared memory and sums it (`nr`: the consumer releases each stage
as soon as it lands and sums nothing, so every stage is in flight; its sums are not checked).
`regring...` / `reg2ring...`: the producer loads each tile into registers (16-byte global
loads, as the register floor does) one / two tiles before it waits for the tile's stage, then
stores it there.
Against the register floor above, this says how fast a cp.async ring alone can gather.

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


@functools.lru_cache(maxsize=None)
def _ring_kernels():
    """The Gluon ring gather (imported on first use: triton's Gluon is optional)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    from csa_jax.kernels.gluon.ring import (PRODUCER_LAYOUT, PRODUCER_WARPS, _gather_tiles,
                                            _release, _tile_ids)

    @gluon.jit
    def producer(kv_ptr, idx_ptr, ntiles_ptr, ring, full, consumed, T: gl.constexpr,
                 N: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr, AHEAD: gl.constexpr):
        base = 0
        for row in range(gl.program_id(0), T, gl.num_programs(0)):
            ntiles = gl.load(ntiles_ptr + row)
            idx_tok = idx_ptr + row.to(gl.int64) * K
            _gather_tiles(kv_ptr, idx_tok, ring, full, consumed, base, row * 0, 0, ntiles,
                          _tile_ids(idx_tok, 0, K, BK), _tile_ids(idx_tok, 1, K, BK), N, D, K,
                          BK, STAGES, AHEAD)                # (row * 0: batch 0, as a tensor)
            base += ntiles

    @gluon.jit
    def _load_tile(kv_ptr, idx_tok, i, ntiles, cols, krows, D: gl.constexpr, K: gl.constexpr,
                   BK: gl.constexpr):
        # Tile i's rows into registers (16-byte global loads); nothing is read past ntiles.
        r = i * BK + krows
        ids = gl.load(idx_tok + r, mask=(r < K) & (i < ntiles), other=-1)
        valid = ids >= 0
        ptrs = kv_ptr + gl.where(valid, ids, 0).to(gl.int64)[:, None] * D + cols[None, :]
        return gl.load(ptrs, mask=valid[:, None], other=0.0)

    @gluon.jit
    def reg_producer(kv_ptr, idx_ptr, ntiles_ptr, ring, full, consumed, T: gl.constexpr,
                     N: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, DEPTH: gl.constexpr):
        # Tiles are loaded into registers DEPTH (1 or 2) tiles ahead of the stage they go to,
        # then stored there once it is free: DEPTH tiles in flight beside the ring.
        layout: gl.constexpr = PRODUCER_LAYOUT
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        krows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
        base = 0
        for row in range(gl.program_id(0), T, gl.num_programs(0)):
            ntiles = gl.load(ntiles_ptr + row)
            idx_tok = idx_ptr + row.to(gl.int64) * K
            cur = _load_tile(kv_ptr, idx_tok, 0, ntiles, cols, krows, D, K, BK)
            nxt = cur
            if DEPTH == 2:
                nxt = _load_tile(kv_ptr, idx_tok, 1, ntiles, cols, krows, D, K, BK)
            for i in range(ntiles):
                g = base + i
                s = g % STAGES
                if DEPTH == 1:
                    nxt = _load_tile(kv_ptr, idx_tok, i + 1, ntiles, cols, krows, D, K, BK)
                if g >= STAGES:
                    mbarrier.wait(consumed.index(s), ((g // STAGES) - 1) & 1)
                ring.index(s).store(cur)
                _release(full.index(s))
                cur = nxt
                if DEPTH == 2:
                    nxt = _load_tile(kv_ptr, idx_tok, i + 2, ntiles, cols, krows, D, K, BK)
            base += ntiles

    @gluon.jit
    def consumer(ntiles_ptr, o_ptr, ring, full, consumed, T: gl.constexpr, D: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, READ: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        base = 0
        for row in range(gl.program_id(0), T, gl.num_programs(0)):
            ntiles = gl.load(ntiles_ptr + row)
            acc = gl.zeros([D], gl.float32, gl.SliceLayout(0, layout))
            for i in range(ntiles):
                g = base + i
                s = g % STAGES
                mbarrier.wait(full.index(s), (g // STAGES) & 1)
                if READ:
                    acc += gl.sum(ring.index(s).load(layout).to(gl.float32), axis=0)
                _release(consumed.index(s))
            gl.store(o_ptr + row.to(gl.int64) * D + cols, acc)
            base += ntiles

    @gluon.jit
    def csa_gather_ring(kv_ptr, idx_ptr, ntiles_ptr, o_ptr, T: gl.constexpr, N: gl.constexpr,
               D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
               READ: gl.constexpr, REG: gl.constexpr, AHEAD: gl.constexpr):
        # REG = 0: the cp.async producer; 1 / 2: the register producer, that many tiles ahead.
        dtype: gl.constexpr = kv_ptr.dtype.element_ty
        ring = gl.allocate_shared_memory(dtype, [STAGES, BK, D],
                                         gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1 if REG else PRODUCER_WARPS * 32)
            mbarrier.init(consumed.index(s), count=1)
        if REG:
            gl.warp_specialize([
                (reg_producer, (kv_ptr, idx_ptr, ntiles_ptr, ring, full, consumed, T, N, D, K,
                                BK, STAGES, REG)),
                (consumer, (ntiles_ptr, o_ptr, ring, full, consumed, T, D, BK, STAGES, READ)),
            ], [4], [232])
        else:
            gl.warp_specialize([
                (producer, (kv_ptr, idx_ptr, ntiles_ptr, ring, full, consumed, T, N, D, K, BK,
                            STAGES, AHEAD)),
                (consumer, (ntiles_ptr, o_ptr, ring, full, consumed, T, D, BK, STAGES, READ)),
            ], [4], [232])

    return csa_gather_ring


def ring_constexprs(T, N, D, K, bk, stages, read=True, reg=0, ahead=2):
    return dict(T=T, N=N, D=D, K=K, BK=bk, STAGES=stages, READ=bool(read), REG=int(reg),
                AHEAD=int(ahead))


def ring_gather_sum(kv, idx, *, bk=64, stages=3, read=True, reg=0, ahead=2):
    """gather_sum through the Gluon ring (NVIDIA Hopper; read=False: nothing summed)."""
    from csa_jax.kernels.gluon.adapter import gluon_call
    from csa_jax.kernels.gluon.fwd import grid
    T, K = idx.shape
    kp = -(-K // bk) * bk
    idx = jnp.pad(idx, ((0, 0), (0, kp - K)), constant_values=-1)
    j = jnp.arange(kp, dtype=jnp.int32)
    ntiles = ((jnp.max(jnp.where(idx >= 0, j, -1), axis=1) + bk) // bk).astype(jnp.int32)
    return gluon_call(kv, idx, ntiles, kernel=_ring_kernels(),
                      out_shape=jax.ShapeDtypeStruct((T, kv.shape[1]), jnp.float32),
                      grid=grid(T), num_warps=4, name="csa_gather_floor_ring",
                      **ring_constexprs(T, kv.shape[0], kv.shape[1], kp, bk, stages, read, reg,
                                       ahead))


def reference(kv, idx):
    rows = jnp.where((idx >= 0)[..., None], kv[jnp.maximum(idx, 0)].astype(jnp.float32), 0.0)
    return rows.sum(axis=1)


def parse_variant(v):
    m = re.fullmatch(r"bk(\d+)w(\d+)s(\d+)", v.strip())
    if m:
        return dict(bk=int(m[1]), num_warps=int(m[2]), num_stages=int(m[3]))
    m = re.fullmatch(r"(reg2?)?ring(\d+)s(\d+)(a1)?(nr)?", v.strip())
    if m:
        return dict(ring=True, reg={None: 0, "reg": 1, "reg2": 2}[m[1]], bk=int(m[2]),
                    stages=int(m[3]), ahead=1 if m[4] else 2, read=not m[5])
    raise ValueError(f"variant {v!r}: expected bk<rows>w<warps>s<stages> (e.g. bk64w4s3) or "
                     f"[reg|reg2]ring<rows>s<stages>[a1][nr] (e.g. ring64s3)")


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
                    if kw.get("ring"):
                        opts = {k: v for k, v in kw.items() if k != "ring"}
                        fn = jax.jit(lambda kv, i, o=opts: ring_gather_sum(kv, i, **o))
                    else:
                        fn = jax.jit(lambda kv, i, kw=kw: gather_sum(
                            kv, i, interpret=a.interpret, **kw))
                    out = np.asarray(fn(kv2, idx2))[:256]
                    err = float(np.max(np.abs(out - ref)) / max(1e-30, np.max(np.abs(ref))))
                    ok = err < 1e-5 or kw.get("read") is False   # nr sums nothing
                    ms = time_fn(fn, (kv2, idx2), a.reps, a.time_cap)[0]
                    r = dict(family=fam, ratio=ratio, T=T, variant=name, **kw, ms=ms,
                             gbytes=gbytes, gb_s=gbytes / ms * 1e3, err=err, ok=ok)
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
