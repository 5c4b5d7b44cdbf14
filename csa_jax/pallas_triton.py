"""CSA forward and backward in the Pallas Triton dialect ("pallas_triton" impl).

The Triton dialect is the only Pallas path to AMD ROCm GPUs, and on Hopper its pointer gather
(`kv_ref.at[ids[:, None], cols]`, thread-issued vector loads) beats per-row TMA for top-k rows. The
compiler pipelines the loads (`num_stages`); there are no explicit async copies here: this is the
"thread-issued loads" baseline that the explicit-DMA kernels are compared against.

Kernels (grids are 1-D and ordered so that the programs sharing a token run side by side and
their repeated gathers hit L2):

- forward, program = (b, t, head block): q [hb, D] stays resident; the token's slots are walked
  in tiles of `block_k` gathered rows [bk, D], one online-softmax step per tile (the shared block
  math of csa_jax.blockmath). All heads of the block share one gathered tile. The loop stops at
  the token's last non-empty tile (a dynamic trip count computed from idx), so causally empty
  tails (early tokens of cr4 / cr128) cost nothing.
- dq, program = (b, t, head block): recompute p from lse, dp = dO kv^T, ds, dq += ds kv; with
  Config.interm="gemm" (default) it also stores scale*ds and p of every slot, [B, T, 2, H, K].
  On NVIDIA its score products are slot-major (Config.slot_major_dq): q and dO sit in shared
  memory as the MMA's second operand instead of in registers beside the accumulator.
- per-slot intermediate, "gemm": interm[t] = [scale*dS; P]^T [q; dO], one batched GEMM per token
  in XLA (contraction over 2H). "kernel", program = (b, t, slot tile[, column chunk]): the tile
  is gathered once and every head block of the token streams past it: interm[t, j] =
  sum_h (scale*ds*q + p*dO), with the scores recomputed slot-major (s^T = rows q^T) so the head
  sums ds^T q and p^T dO are plain dots into a [block_k_dkv, D] accumulator. One writer per slot.
- dkv gather-reduce, program = (b, kv row): the inverse map (kv row -> (t, j) slots, CSR built by
  a stable sort + histogram in XLA) is walked in fixed order, `block_r` slots at a time, and summed
  in f32. No atomics, no scatter: dkv is bit-deterministic.
- dsink and delta = sum_d o * dO are small XLA reductions.

Not implemented: window reuse for structured layouts (cr0 / cr128 contiguous-tile loads shared by
a block of tokens); every layout goes through the generic gather. docs/perf/triton_h200.md has the
measured speed and what limits it (registers and spills, not gathered bytes: a probe that
gathers cache-resident rows is at most 9% faster).

Padding (inside this module only): D to a power of two >= 16, H to a multiple of the head block,
K to a multiple of block_k (with -1). Triton needs power-of-two block shapes and dots of >= 16.

The Triton dialect is deprecated by JAX (it warns at every lowering). This module is the only
one in csa_jax that imports it, and it silences exactly that one warning message.

ROCm: the kernels use only dialect-generic primitives (load/store with masks, dot, fori_loop);
num_stages is always set explicitly (the ROCm default is 1) and tiles stay <= 64 rows. See
docs/pallas_triton.md for what has and has not been run on AMD hardware.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from csa_jax import blockmath

# Exactly the dialect's own deprecation message; nothing else is filtered.
warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated", category=DeprecationWarning)

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _is_pow2(x):
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


def _next_pow2(x):
    return 1 << max(0, (int(x) - 1).bit_length())


def _round_up(x, m):
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the four Triton-dialect kernels; block sizes are powers of two.

    forward:  block_k gathered kv rows per tile, block_h heads per program, num_warps, num_stages.
    dq:       block_k_dq, block_h_dq (heads per program), num_warps_dq, num_stages_dq.
    interm:   block_k_dkv slots per program (all heads), block_h_dkv heads per inner step,
              num_warps_dkv, num_stages_dkv; dkv_split_d > 1 splits the [block_k_dkv, D] f32
              accumulator's columns over that many programs; each recomputes the tile's scores,
              so the kernel does (2 * split + 2) / 4 times the products, with a smaller
              accumulator. Never timed: with the default interm tiles it asked for 262,528 B
              of shared memory on the H200 and did not compile (docs/perf/triton_h200.md).
    reduce:   block_r inverse-map entries summed per step, num_warps_reduce (memory bound).
    interm_f32: keep the per-slot intermediate in f32 even for bf16 inputs (2x its bytes).
    slot_major (forward), slot_major_dq (dq kernel): form the scores as (rows q^T)^T instead of
              q rows^T. The resident q (and dO) [heads, D] then feed the MMA as its second
              operand, which Hopper's MMA reads from shared memory, instead of being held in
              registers beside the [heads, D] f32 accumulator. On the H200 the head-major dq
              kernel spilled 10.1 M requests per launch and the slot-major one 0.13 M, with the
              same shared memory per program (docs/perf/triton_h200.md).
    interm:   how the per-slot intermediate is formed. "gemm" (default): the dq kernel also
              stores scale * dS and P [B, T, 2, H, K] (q's dtype, as the kernel path rounds them
              before its dots) and one batched GEMM per token in XLA contracts them with
              [q; dO] over the heads. "kernel": the interm kernel above recomputes the scores
              slot-major (7 products instead of 5, no [B, T, 2, H, K] buffer).

    Row and head blocks are >= 16 (Triton's dot minimum). Shared memory per program is about
    (resident operands + num_stages * streamed tile) bytes: e.g. the dq kernel holds q and dO
    [block_h_dq, D] and streams [block_k_dq, D] tiles; <= 64-row tiles keep AMD's LDS in reach.
    """

    block_k: int = 64
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 3
    block_k_dq: int = 32
    block_h_dq: int = 32
    num_warps_dq: int = 4
    num_stages_dq: int = 3
    block_k_dkv: int = 64
    block_h_dkv: int = 32
    num_warps_dkv: int = 4
    num_stages_dkv: int = 2
    dkv_split_d: int = 1
    block_r: int = 32
    num_warps_reduce: int = 4
    interm_f32: bool = False
    interm: str = "gemm"
    slot_major: bool = False
    slot_major_dq: bool = True

    def __post_init__(self):
        for name in ("block_k", "block_h", "block_k_dq", "block_h_dq", "block_k_dkv",
                     "block_h_dkv"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"{name}={v!r} must be a power of two >= 16 (Triton dot minimum)")
        if not _is_pow2(self.dkv_split_d):
            raise ValueError(f"dkv_split_d={self.dkv_split_d!r} must be a power of two")
        if not _is_pow2(self.block_r):
            raise ValueError(f"block_r={self.block_r!r} must be a power of two")
        for name in ("num_warps", "num_warps_dq", "num_warps_dkv", "num_warps_reduce"):
            v = getattr(self, name)
            if v not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={v!r} must be one of 1, 2, 4, 8, 16")
        for name in ("num_stages", "num_stages_dq", "num_stages_dkv"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.interm not in ("gemm", "kernel"):
            raise ValueError(f"interm={self.interm!r} must be 'gemm' or 'kernel'")
        for name in ("interm_f32", "slot_major", "slot_major_dq"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")


def _device_kind():
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return "cpu", ""
    return d.platform, d.device_kind


def _is_amd(platform, kind):
    kind = kind.lower()
    return platform == "rocm" or kind.startswith("gfx") or "amd" in kind or "instinct" in kind


def unsupported(q_shape, kv_shape, idx_shape, dtype):
    """Why impl="auto" should not pick this impl here (None = it may).

    auto picks it only where it was verified and measured faster end to end: NVIDIA GPUs with
    bf16/f16 inputs (docs/perf/triton_h200.md, docs/perf/train_h200.md). On ROCm it has never
    run (request impl="pallas_triton" explicitly); f32 inputs stay on the exact XLA reference.
    """
    del q_shape, kv_shape, idx_shape
    platform, kind = _device_kind()
    if platform not in _GPU_PLATFORMS or _is_amd(platform, kind) or "nvidia" not in kind.lower():
        return f"not an NVIDIA GPU (platform={platform!r}, device_kind={kind!r})"
    if jnp.dtype(dtype) == jnp.float32:
        return "f32 inputs: the XLA reference computes true f32 products"
    return None


def default_config(q_shape, kv_shape, idx_shape, dtype) -> Config:
    """Defaults by device kind, clipped to the problem.

    NVIDIA (and CPU interpret): the Config defaults, measured on the H200 (docs/perf/triton_h200.md):
    forward 8 warps, 3 stages, 64-row tiles, 64 heads (4 warps ran 2.3x slower, 16 warps 2.5x,
    32 heads 1.5x);
    dq 4 warps, 32 heads, 32-row tiles, 3 stages (with the GEMM interm path: Pro cr4 T=16384
    backward 54.9 ms, against 72.7 ms for 64-row tiles / 2 stages and 90.9 ms for 64 heads /
    8 warps), slot-major scores (47.5 ms; docs/perf/triton_h200.md table 4); forward scores
    head-major (slot-major ran 1.3-1.7x slower); interm kernel (interm="kernel" only) 4 warps,
    64-row tiles (8 warps ran 4.6x slower, 32-row tiles 8x). AMD (ROCm): <= 32-row tiles,
    2 stages, so each program's shared memory stays near the 64 KiB LDS of MI300-class GPUs,
    and head-major dq scores (AMD's matrix instructions read both operands from registers, so
    the slot-major form frees none); not measured, no AMD GPU was available. f32 inputs halve
    the tile rows (twice the bytes per row). Tiles never exceed the padded slot count, head
    blocks never the padded heads.
    """
    del kv_shape
    platform, kind = _device_kind()
    H, K = q_shape[2], idx_shape[2]
    cfg = Config()
    if _is_amd(platform, kind):
        cfg = dataclasses.replace(cfg, block_k=32, block_k_dkv=32, block_h_dq=32, block_k_dq=32,
                                  num_stages_dq=2, block_h_dkv=16, num_stages=2,
                                  slot_major_dq=False)
    if jnp.dtype(dtype) == jnp.float32:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2, block_k_dkv=cfg.block_k_dkv // 2,
                                  block_h_dq=cfg.block_h_dq // 2, num_stages=2)
    kp = max(16, _next_pow2(K))
    hp = max(16, _next_pow2(H))
    clip = lambda v, top: max(16, min(v, top))
    return dataclasses.replace(
        cfg, block_k=clip(cfg.block_k, kp), block_k_dq=clip(cfg.block_k_dq, kp),
        block_k_dkv=clip(cfg.block_k_dkv, kp), block_h=clip(cfg.block_h, hp),
        block_h_dq=clip(cfg.block_h_dq, hp), block_h_dkv=clip(cfg.block_h_dkv, hp))


def _resolve_interpret(interpret):
    if interpret is None:
        return _device_kind()[0] not in _GPU_PLATFORMS
    return interpret


def _precision(dtype):
    # f32 inputs: true f32 products (Triton's default for f32 dots is TF32).
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _params(num_warps, num_stages):
    # num_stages is always explicit: the ROCm default (1) would disable load pipelining.
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- layout helpers


@dataclasses.dataclass(frozen=True)
class _Dims:
    B: int
    T: int
    H: int
    D: int
    N: int
    K: int
    Hp: int   # heads padded to a multiple of every head block
    Dp: int   # head dim padded to a power of two >= 16
    Kp: int   # slots padded to a multiple of every row block


def _dims(q, kv, idx, config):
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    hp = max(16, _next_pow2(H))
    hmax = min(hp, max(config.block_h, config.block_h_dq, config.block_h_dkv))
    Hp = _round_up(H, hmax)
    Dp = max(16, _next_pow2(D))
    kmax = max(config.block_k, config.block_k_dq, config.block_k_dkv)
    return _Dims(B, T, H, D, N, K, Hp, Dp, _round_up(K, kmax))


def _pad_to(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _prep_idx(idx, d):
    """Padded idx [B, T, Kp] and the slot count up to the last non-empty slot [B, T]."""
    idx_p = _pad_to(idx, 2, d.Kp, -1)
    j = jnp.arange(d.Kp, dtype=jnp.int32)
    used = jnp.max(jnp.where(idx_p >= 0, j, -1), axis=2) + 1                   # 0 if empty
    return idx_p, used.astype(jnp.int32)


def _ntiles(used, bk):
    """Tiles of bk slots a token must walk: empty tails (early tokens) are skipped."""
    return (used + bk - 1) // bk


def _head_block(d, block):
    return min(block, d.Hp)


def _gather_tile(idx_ref, kv_ref, start, bk):
    """One tile of bk slots: (rows [bk, D] with zeros for empty slots, valid [bk])."""
    ids = idx_ref[pl.ds(start, bk)]                                            # [bk]
    valid = ids >= 0
    # Empty slots read nothing (masked load) and are masked again in the scores.
    rows = _gather_rows(kv_ref, jnp.where(valid, ids, 0), valid)
    return rows, valid


def _scores(a, rows, slot_major, precision):
    """a rows^T [hb, bk] for a resident [hb, D] operand a (q or dO) and a gathered tile.

    slot_major computes it as (rows a^T)^T: a becomes the MMA's second operand (shared memory
    on Hopper) rather than a register-resident first operand; the [bk, hb] result is
    transposed in registers."""
    if slot_major:
        return pltriton.dot(rows, a, trans_b=True, precision=precision).T
    return pltriton.dot(a, rows, trans_b=True, precision=precision)


def _gather_rows(ref, rows, mask):
    """ref[rows, :] for a [n] vector of row ids, masked rows read as 0.

    Written with two broadcast index arrays (not `ref.at[rows, :]`) because the interpreter
    only discharges loads whose indexers are all arrays or all slices."""
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    return pltriton.load(ref.at[rows[:, None], cols], mask=mask[:, None], other=0)


# ----------------------------------------------------------------------------- forward


def _fwd_step(carry, q, rows, valid, *, scale, precision, slot_major=False):
    """One online-softmax step of the forward over a gathered tile rows [bk, D]."""
    m, l, acc = carry
    s = _scores(q, rows, slot_major, precision) * scale                       # [hb, bk]
    m, l, p, alpha = blockmath.softmax_update(m, l, s, valid[None, :])
    acc = alpha * acc + pltriton.dot(p.astype(rows.dtype), rows, precision=precision)
    return m, l, acc


def _fwd_store(o_ref, lse_ref, sink_ref, m, l, acc):
    """Join the sink, normalize, and write o [hb, D] and lse [hb, 1]."""
    o, lse = blockmath.finalize(m, l, acc, sink_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def _fwd_kernel(ntiles_ref, idx_ref, q_ref, kv_ref, sink_ref,      # inputs
                o_ref, lse_ref,                                    # outputs
                *, scale, bk, precision, slot_major=False):
    # ntiles_ref (); idx_ref [Kp]; q_ref [hb, D]; kv_ref [N, D]; sink_ref [hb, 1]
    q = q_ref[...]
    hb, D = q.shape

    def body(i, carry):
        rows, valid = _gather_tile(idx_ref, kv_ref, i * bk, bk)
        return _fwd_step(carry, q, rows, valid, scale=scale, precision=precision,
                         slot_major=slot_major)

    m, l, acc = lax.fori_loop(0, ntiles_ref[...], body, blockmath.init_state((hb,), D))
    _fwd_store(o_ref, lse_ref, sink_ref, m, l, acc)


def _token_head_grid(d, hb):
    """1-D grid over (b, t, head block), head block fastest; index-map helpers."""
    nh = d.Hp // hb

    def coords(i):
        return i // (d.T * nh), (i // nh) % d.T, i % nh

    return d.B * d.T * nh, coords


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "kernel"))
def _forward(q, kv, idx, sink, *, scale, interpret, config, kernel=None):
    """`kernel` (default _fwd_kernel) lets benchmarks/triton_fwd_probe.py time variants of the
    kernel body (same signature) under exactly this launch; the library never passes it."""
    d = _dims(q, kv, idx, config)
    hb = _head_block(d, config.block_h)
    idx_p, used = _prep_idx(idx, d)
    ntiles = _ntiles(used, config.block_k)
    q_p = _pad_to(_pad_to(q, 3, d.Dp), 2, d.Hp)
    kv_p = _pad_to(kv, 2, d.Dp)
    sink_p = _pad_to(sink, 0, d.Hp, -jnp.inf)[:, None]                         # [Hp, 1]
    n, coords = _token_head_grid(d, hb)

    def tok(i):
        b, t, _ = coords(i)
        return b, t

    def tok_head(i):
        b, t, h = coords(i)
        return b, t, h, 0

    kernel = kernel or functools.partial(_fwd_kernel, slot_major=config.slot_major)
    kernel = functools.partial(kernel, scale=scale, bk=config.block_k,
                               precision=_precision(q.dtype))
    o, lse = pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[
            pl.BlockSpec((None, None), tok),                                   # ntiles
            pl.BlockSpec((None, None, d.Kp), lambda i: (*tok(i), 0)),          # idx
            pl.BlockSpec((None, None, hb, d.Dp), tok_head),                    # q
            pl.BlockSpec((None, d.N, d.Dp), lambda i: (coords(i)[0], 0, 0)),   # kv (gathered)
            pl.BlockSpec((hb, 1), lambda i: (coords(i)[2], 0)),                # sink
        ],
        out_specs=[
            pl.BlockSpec((None, None, hb, d.Dp), tok_head),
            pl.BlockSpec((None, None, hb, 1), tok_head),
        ],
        out_shape=[jax.ShapeDtypeStruct((d.B, d.T, d.Hp, d.Dp), q.dtype),
                   jax.ShapeDtypeStruct((d.B, d.T, d.Hp, 1), jnp.float32)],
        compiler_params=_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="csa_triton_fwd",
    )(ntiles, idx_p, q_p, kv_p, sink_p)
    return o[:, :, :d.H, :d.D], lse[:, :, :d.H, 0]


def forward(q, kv, idx, sink, *, scale, interpret, config):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32; see the impl-module interface in vjp.py."""
    return _forward(q, kv, idx, sink, scale=float(scale),
                    interpret=_resolve_interpret(interpret), config=config)


# ----------------------------------------------------------------------------- backward


def _dq_kernel(ntiles_ref, idx_ref, q_ref, do_ref, lse_ref, delta_ref, dlse_ref, kv_ref,  # in
               dq_ref, *dsp_ref,                                                          # out
               scale, bk, precision, slot_major):
    # q_ref, do_ref [hb, D]; lse/delta/dlse [hb, 1]; dsp_ref (interm="gemm" only) [2, hb, Kp]:
    # this head block's scale * dS and P over all slots, in the dtype of the interm products.
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    dlse = dlse_ref[...]
    ntiles = ntiles_ref[...]
    dsp = dsp_ref[0] if dsp_ref else None

    def store(i, ds_scaled, p):
        cols = pl.ds(i * bk, bk)
        dsp[0, :, cols] = ds_scaled.astype(dsp.dtype)
        dsp[1, :, cols] = p.astype(dsp.dtype)

    def body(i, acc):
        rows, valid = _gather_tile(idx_ref, kv_ref, i * bk, bk)
        s = _scores(q, rows, slot_major, precision) * scale                   # [hb, bk]
        p = blockmath.recompute_p(s, lse, valid[None, :])
        dp = _scores(do, rows, slot_major, precision)
        ds = blockmath.softmax_grad(p, dp, delta, dlse)
        if dsp is not None:
            store(i, ds * scale, p)
        return acc + pltriton.dot(ds.astype(rows.dtype), rows, precision=precision)

    acc = lax.fori_loop(0, ntiles, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (acc * scale).astype(dq_ref.dtype)
    if dsp is not None:   # tiles past the token's last non-empty slot: exact zeros, never garbage
        zero = jnp.zeros((q.shape[0], bk), dsp.dtype)

        def clear(i, c):
            store(i, zero, zero)
            return c

        lax.fori_loop(ntiles, dsp.shape[-1] // bk, clear, 0)


def _interm_kernel(ntiles_ref, idx_ref, q_ref, do_ref, lse_ref, delta_ref, dlse_ref, kv_ref,
                   interm_ref,
                   *, scale, bk, hh, n_heads, split, precision):
    # idx_ref [bk] (this slot tile); q_ref, do_ref [Hp, D]; lse/delta/dlse [1, Hp] (all heads);
    # interm_ref [bk, D / split]: this program's column chunk of the tile's intermediate.
    dc = interm_ref.shape[-1]
    cols = pl.ds((pl.program_id(0) % split) * dc, dc)

    @pl.when(ntiles_ref[0] > ntiles_ref[1])
    def _():
        rows, valid = _gather_tile(idx_ref, kv_ref, 0, bk)                    # [bk, D], [bk]

        def body(h, acc):
            hs = pl.ds(h * hh, hh)
            q = q_ref[hs, :]                                                   # [hh, D]
            do = do_ref[hs, :]
            lse = lse_ref[:, hs]                                               # [1, hh]
            delta = delta_ref[:, hs]
            dlse = dlse_ref[:, hs]
            # Slot-major products: s^T [bk, hh] = rows q^T, so the head sums below are plain dots.
            s = pltriton.dot(rows, q, trans_b=True, precision=precision) * scale
            p = blockmath.recompute_p(s, lse, valid[:, None])
            dp = pltriton.dot(rows, do, trans_b=True, precision=precision)
            ds = blockmath.softmax_grad(p, dp, delta, dlse)
            if split > 1:   # the scores need all of D, the accumulator only its chunk
                q, do = q_ref[hs, cols], do_ref[hs, cols]
            acc = acc + pltriton.dot((ds * scale).astype(q.dtype), q, precision=precision)
            return acc + pltriton.dot(p.astype(do.dtype), do, precision=precision)

        acc = lax.fori_loop(0, n_heads // hh, body, jnp.zeros((bk, dc), jnp.float32))
        interm_ref[...] = acc.astype(interm_ref.dtype)


def _reduce_kernel(off_ref, perm_ref, interm_ref, dkv_ref, *, br):
    # off_ref [2] (this row's CSR range); perm_ref [E + br]; interm_ref [E, D]; dkv_ref [1, D]
    start = off_ref[0]
    count = off_ref[1] - start
    D = dkv_ref.shape[-1]

    def body(c, acc):
        k = c * br + lax.broadcasted_iota(jnp.int32, (br,), 0)
        live = k < count
        pos = pltriton.load(perm_ref.at[pl.ds(start + c * br, br)], mask=live, other=0)
        rows = _gather_rows(interm_ref, pos, live)
        return acc + jnp.sum(rows.astype(jnp.float32), axis=0, keepdims=True)   # fixed order

    acc = lax.fori_loop(0, (count + br - 1) // br, body, jnp.zeros((1, D), jnp.float32))
    dkv_ref[...] = acc.astype(dkv_ref.dtype)


def _inverse_map(idx_p, N):
    """CSR of the slot -> kv row map per batch: (offsets [B, N, 2], perm [B, T*Kp]).

    perm lists flat slot positions t*Kp + j sorted by kv row (stable: ascending slot order within
    a row, which fixes the summation order); empty slots sort past row N-1 and are never read.
    """
    B = idx_p.shape[0]
    keys = jnp.where(idx_p >= 0, idx_p, N).reshape(B, -1)                     # [B, E]
    perm = jnp.argsort(keys, axis=1, stable=True).astype(jnp.int32)
    counts = jax.vmap(lambda k: jnp.bincount(k, length=N + 1))(keys)[:, :N]   # integer: exact
    ends = jnp.cumsum(counts, axis=1).astype(jnp.int32)
    offsets = jnp.stack([ends - counts, ends], axis=-1)                        # [B, N, 2]
    return offsets, perm


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "parts"))
def _backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config,
              parts=("dq", "interm", "reduce")):
    """`parts` (all by default) lets a benchmark time the kernels one by one; skipped parts
    return zeros (with interm="gemm" the interm part needs the dq kernel, so its dq is kept)."""
    d = _dims(q, kv, idx, config)
    prec = _precision(q.dtype)
    f32 = jnp.float32
    idx_p, used = _prep_idx(idx, d)
    delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)                  # [B, T, H]
    # Padded heads: q = dO = 0, lse = delta = dlse = 0, so p = 1 but ds = 0 and p * dO = 0.
    q_p = _pad_to(_pad_to(q, 3, d.Dp), 2, d.Hp)
    do_p = _pad_to(_pad_to(do, 3, d.Dp), 2, d.Hp)
    kv_p = _pad_to(kv, 2, d.Dp)
    col = lambda x: _pad_to(x.astype(f32), 2, d.Hp)[..., None]                 # [B, T, Hp, 1]
    lse_p, delta_p, dlse_p = col(lse), col(delta), col(dlse)

    dq = jnp.zeros_like(q_p)
    dkv = jnp.zeros_like(kv_p)
    idt = f32 if (config.interm_f32 or q_p.dtype == f32) else q_p.dtype
    gemm = config.interm == "gemm"
    if "dq" in parts or (gemm and "interm" in parts):
        dq, *dsp = _dq_call(d, config, scale, interpret, prec, used, idx_p, q_p, do_p, lse_p,
                            delta_p, dlse_p, kv_p, dsp_dtype=q_p.dtype if gemm else None)
    if "interm" in parts:
        if gemm:
            interm = _interm_gemm(dsp[0], q_p, do_p, prec, idt)
        else:
            interm = _interm_call(d, config, scale, interpret, prec, used, idx_p, q_p, do_p,
                                  lse_p, delta_p, dlse_p, kv_p, idt)
        if "reduce" in parts:
            dkv = _reduce_call(d, config, interpret, idx_p, interm, kv.dtype)
        else:   # keep the kernel alive for timing
            dkv = dkv.at[:, 0].set(interm[:, 0, 0].astype(dkv.dtype))

    # dsink = sum_t exp(sink - lse) * (dlse - delta); zero weight where sink = -inf.
    w = jnp.exp(sink[None, None, :] - lse)
    dsink = jnp.sum(w * (dlse - delta), axis=(0, 1))
    return dq[:, :, :d.H, :d.D], dkv[:, :, :d.D], dsink


def _dq_call(d, config, scale, interpret, prec, used, idx_p, q_p, do_p, lse_p, delta_p, dlse_p,
             kv_p, dsp_dtype=None):
    """dq [B, T, Hp, Dp]: programs over (b, t, head block). With dsp_dtype also returns
    dsp [B, T, 2, Hp, Kp] = (scale * dS, P) of every slot (zeros past a token's last tile)."""
    bk = config.block_k_dq
    hb = _head_block(d, config.block_h_dq)
    n, coords = _token_head_grid(d, hb)
    tok = lambda i: coords(i)[:2]
    tok_head = lambda i: (*coords(i), 0)
    head_spec = pl.BlockSpec((None, None, hb, d.Dp), tok_head)
    col_spec = pl.BlockSpec((None, None, hb, 1), tok_head)
    out_specs = [head_spec]
    out_shape = [jax.ShapeDtypeStruct(q_p.shape, q_p.dtype)]
    if dsp_dtype is not None:
        out_specs.append(pl.BlockSpec((None, None, 2, hb, d.Kp),
                                      lambda i: (*tok(i), 0, coords(i)[2], 0)))
        out_shape.append(jax.ShapeDtypeStruct((d.B, d.T, 2, d.Hp, d.Kp), dsp_dtype))
    return pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, bk=bk, precision=prec,
                          slot_major=config.slot_major_dq),
        grid=(n,),
        in_specs=[
            pl.BlockSpec((None, None), tok),
            pl.BlockSpec((None, None, d.Kp), lambda i: (*tok(i), 0)),
            head_spec, head_spec, col_spec, col_spec, col_spec,
            pl.BlockSpec((None, d.N, d.Dp), lambda i: (coords(i)[0], 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(config.num_warps_dq, config.num_stages_dq),
        interpret=interpret,
        name="csa_triton_dq",
    )(_ntiles(used, bk), idx_p, q_p, do_p, lse_p, delta_p, dlse_p, kv_p)


def _interm_gemm(dsp, q_p, do_p, prec, idt):
    """interm[b, t, j] = sum_h scale * dS[h, j] q[h] + P[h, j] dO[h]: one batched GEMM per token
    (M = slots, N = D, contraction over 2 * heads) in XLA (cuBLAS on GPU, which accumulates bf16
    products in f32), written straight in the interm dtype: no f32 [B, T, K, D] temporary."""
    qdo = jnp.stack([q_p, do_p], axis=2)                                       # [B, T, 2, Hp, Dp]
    dims = (((2, 3), (2, 3)), ((0, 1), (0, 1)))
    return lax.dot_general(dsp, qdo, dims, precision=prec, preferred_element_type=idt)


def _interm_call(d, config, scale, interpret, prec, used, idx_p, q_p, do_p, lse_p, delta_p,
                 dlse_p, kv_p, idt):
    """Per-slot intermediate [B, T, Kp, Dp]: programs over (b, t, slot tile, column chunk)."""
    bk = config.block_k_dkv
    nkt = d.Kp // bk
    split = min(config.dkv_split_d, d.Dp // 16)
    dc = d.Dp // split
    hh = _head_block(d, config.block_h_dkv)
    ntiles = _ntiles(used, bk)

    def slot_coords(i):
        i = i // split
        return i // (d.T * nkt), (i // nkt) % d.T, i % nkt

    # (ntiles[t], tile) pairs tell a program whether its tile holds any non-empty slot.
    tile_no = jnp.broadcast_to(jnp.arange(nkt, dtype=jnp.int32), (d.B, d.T, nkt))
    live = jnp.stack([jnp.broadcast_to(ntiles[..., None], tile_no.shape), tile_no], -1)
    all_heads = pl.BlockSpec((None, None, d.Hp, d.Dp), lambda i: (*slot_coords(i)[:2], 0, 0))
    all_rows = pl.BlockSpec((None, None, 1, d.Hp), lambda i: (*slot_coords(i)[:2], 0, 0))
    return pl.pallas_call(
        functools.partial(_interm_kernel, scale=scale, bk=bk, hh=hh, n_heads=d.Hp,
                          split=split, precision=prec),
        grid=(d.B * d.T * nkt * split,),
        in_specs=[
            pl.BlockSpec((None, None, None, 2), lambda i: (*slot_coords(i), 0)),
            pl.BlockSpec((None, None, bk), slot_coords),
            all_heads, all_heads, all_rows, all_rows, all_rows,
            pl.BlockSpec((None, d.N, d.Dp), lambda i: (slot_coords(i)[0], 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bk, dc), lambda i: (*slot_coords(i), i % split)),
        out_shape=jax.ShapeDtypeStruct((d.B, d.T, d.Kp, d.Dp), idt),
        compiler_params=_params(config.num_warps_dkv, config.num_stages_dkv),
        interpret=interpret,
        name="csa_triton_interm",
    )(live, idx_p, q_p, do_p, *(jnp.swapaxes(x, 2, 3) for x in (lse_p, delta_p, dlse_p)), kv_p)


def _reduce_call(d, config, interpret, idx_p, interm, dtype):
    """dkv [B, N, Dp]: deterministic gather-reduce over the inverse map, programs over rows."""
    E = d.T * d.Kp
    br = config.block_r
    offsets, perm = _inverse_map(idx_p, d.N)
    perm = _pad_to(perm, 1, E + br)          # a masked tail read never leaves the array
    return pl.pallas_call(
        functools.partial(_reduce_kernel, br=br),
        grid=(d.B * d.N,),
        in_specs=[
            pl.BlockSpec((None, None, 2), lambda i: (i // d.N, i % d.N, 0)),
            pl.BlockSpec((None, E + br), lambda i: (i // d.N, 0)),
            pl.BlockSpec((None, E, d.Dp), lambda i: (i // d.N, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, 1, d.Dp), lambda i: (i // d.N, i % d.N, 0)),
        out_shape=jax.ShapeDtypeStruct((d.B, d.N, d.Dp), dtype),
        compiler_params=_params(config.num_warps_reduce, 2),
        interpret=interpret,
        name="csa_triton_dkv_reduce",
    )(offsets, perm, interm.reshape(d.B, E, d.Dp))


def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """(dq, dkv, dsink) of csa_spec.md section 3 with the dlse terms; dkv is deterministic."""
    return _backward(q, kv, idx, sink, o, lse, do, dlse, scale=float(scale),
                     interpret=_resolve_interpret(interpret), config=config)
