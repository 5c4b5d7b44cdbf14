"""The Triton forward kernel, its tile step and output store, and its launch."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from csa_jax import blockmath
from csa_jax.kernels.triton.config import PLATFORMS, _params, quiet_lowering
from csa_jax.kernels.triton.plan import (_dims, _gather_tile, _head_block, _ntiles, _pad_to,
                                         _prep_idx, _scores, _token_head_grid)


def _fwd_step(carry, q, rows, valid, *, scale, precision):
    """One online-softmax step of the forward over a gathered tile rows [bk, D]; head-major
    scores q rows^T (the slot-major form ran 1.3-1.7x slower: docs/perf/triton_h200.md)."""
    m, l, acc = carry
    s = _scores(q, rows, False, precision) * scale                            # [hb, bk]
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
                *, scale, bk, precision):
    # ntiles_ref (); idx_ref [Kp]; q_ref [hb, D]; kv_ref [N, D]; sink_ref [hb, 1]
    q = q_ref[...]
    hb, D = q.shape

    def body(i, carry):
        rows, valid = _gather_tile(idx_ref, kv_ref, i * bk, bk)
        return _fwd_step(carry, q, rows, valid, scale=scale, precision=precision)

    m, l, acc = lax.fori_loop(0, ntiles_ref[...], body, blockmath.init_state((hb,), D))
    _fwd_store(o_ref, lse_ref, sink_ref, m, l, acc)


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

    kernel = functools.partial(kernel or _fwd_kernel, scale=scale, bk=config.block_k,
                               precision=blockmath.precision(q.dtype))
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
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32; see the impl-module interface in csa_jax/registry.py."""
    with quiet_lowering():
        return _forward(q, kv, idx, sink, scale=float(scale),
                        interpret=blockmath.resolve_interpret(interpret, PLATFORMS),
                        config=config)
