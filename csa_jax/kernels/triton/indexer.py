"""The lightning indexer's scores as one Pallas Triton kernel (issue 17): q . k, ReLU and the
head-weighted sum in registers, so only the [B, T, P] scores reach memory.

`csa_jax.indexer_scores` in XLA forms the per-head products [B, T, Hi, P] in f32 (a GEMM),
writes them, and reads them back for the ReLU and the weighted sum over heads: at the `small`
preset's T = 8192 that is ~1 GB of f32 per cr4 layer each way, for ~0.03 TFLOP of products.
Here a program owns a [bt tokens, br pool rows] tile of the scores and walks the heads:

    acc = 0                                               # [bt, br] f32
    for h in range(Hi):                                   # static
        acc += w[:, h] * relu(q[:, h, :] @ k^T)           # bf16 operands, f32 accumulation
    scores = where(row < (t + 1) // ratio, acc, -inf)

The products take the inputs' dtype (bf16 / f16) with f32 accumulation, like the XLA path's
bf16 products; the sum over heads runs in head order (the XLA reduction's order is XLA's), so the
two agree to f32 rounding. Tiles whose rows are all invisible to all their tokens skip the
products. f32 inputs are not taken (the XLA path computes true-f32 products for them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from csa_jax import blockmath
from csa_jax.kernels.triton.config import PLATFORMS, _next_pow2, _params, quiet_lowering

__all__ = ["indexer_scores", "supported"]

BLOCK_T, BLOCK_R = 64, 64


def supported(q_shape, k_shape, dtype) -> str | None:
    """Why this kernel does not take the problem (None = it does)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)}: the kernel takes bf16 / f16 inputs"
    hi, di = q_shape[-2], q_shape[-1]
    if di < 16 or di != _next_pow2(di) or hi != _next_pow2(hi):
        return f"Hi={hi}, Di={di}: the kernel needs powers of two (Di >= 16)"
    if q_shape[1] % BLOCK_T or k_shape[1] % BLOCK_R or k_shape[1] == 0:
        return (f"T={q_shape[1]}, P={k_shape[1]}: the kernel needs multiples of "
                f"{BLOCK_T} / {BLOCK_R}")
    return None


def _kernel(q_ref, k_ref, w_ref, o_ref, *, hi, di, ratio, bt, br, nt, nr, skip):
    # q_ref [bt, hi * di]; k_ref [br, di]; w_ref [hi, bt] f32; o_ref [bt, br] f32
    i = pl.program_id(0) % (nt * nr)
    ti, ri = i // nr, i % nr
    tok = (ti * bt + lax.broadcasted_iota(jnp.int32, (bt, br), 0))
    row = ri * br + lax.broadcasted_iota(jnp.int32, (bt, br), 1)
    visible = row < (tok + 1) // ratio
    k = k_ref[...]
    # the tile's last token sees rows < (t_last + 1) // ratio: skip wholly invisible tiles
    live = ri * br < ((ti + 1) * bt) // ratio

    def products():
        acc = jnp.zeros((bt, br), jnp.float32)
        for h in range(hi):
            qh = q_ref[:, pl.ds(h * di, di)]
            s = pltriton.dot(qh, k, trans_b=True)                               # [bt, br] f32
            acc = acc + w_ref[h, :][:, None] * jnp.maximum(s, 0.0)
        return acc

    if skip:
        acc = lax.cond(live, products, lambda: jnp.zeros((bt, br), jnp.float32))
    else:
        acc = products()
    o_ref[...] = jnp.where(visible, acc, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("ratio", "interpret", "skip"))
def _scores(q_idx, k_idx, weights, *, ratio, interpret, skip=True):
    B, T, Hi, Di = q_idx.shape
    P = k_idx.shape[1]
    bt, br = BLOCK_T, BLOCK_R
    nt, nr = T // bt, P // br
    q2 = q_idx.reshape(B, T, Hi * Di)
    k = k_idx.astype(q_idx.dtype)
    wt = jnp.swapaxes(weights.astype(jnp.float32), 1, 2)                        # [B, Hi, T]
    per_b = nt * nr

    def qmap(i):
        return i // per_b, (i % per_b) // nr, 0

    def kmap(i):
        return i // per_b, i % nr, 0

    def wmap(i):
        return i // per_b, 0, (i % per_b) // nr

    def omap(i):
        return i // per_b, (i % per_b) // nr, i % nr

    return pl.pallas_call(
        functools.partial(_kernel, hi=Hi, di=Di, ratio=ratio, bt=bt, br=br, nt=nt, nr=nr,
                          skip=skip),
        grid=(B * per_b,),
        in_specs=[pl.BlockSpec((None, bt, Hi * Di), qmap),
                  pl.BlockSpec((None, br, Di), kmap),
                  pl.BlockSpec((None, Hi, bt), wmap)],
        out_specs=pl.BlockSpec((None, bt, br), omap),
        out_shape=jax.ShapeDtypeStruct((B, T, P), jnp.float32),
        compiler_params=_params(4, 2),
        interpret=interpret,
        name="csa_triton_indexer_scores",
    )(q2, k, wt)


def indexer_scores(q_idx, k_idx, weights, *, ratio, interpret=None, skip=True):
    """[B, T, P] f32 scores, -inf where invisible (csa_jax.indexer_scores' contract); inputs as
    there, bf16 / f16 (see supported()). skip=False computes the invisible tiles too (no
    branch in the kernel)."""
    why = supported(q_idx.shape, k_idx.shape, q_idx.dtype)
    if why:
        raise ValueError(f"indexer scores kernel: {why}")
    with quiet_lowering():
        return _scores(q_idx, k_idx, weights, ratio=ratio, skip=skip,
                       interpret=blockmath.resolve_interpret(interpret, PLATFORMS))
