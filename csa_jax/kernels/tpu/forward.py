"""The TPU forward kernel and its launch."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm
from csa_jax import layouts
from csa_jax.kernels.tpu.config import (PLATFORMS, _maybe_check_layout, compiler_params,
                                        layout_broken)
from csa_jax.kernels.tpu.plan import (_dot_nn, _dot_nt, _flat_tokens, _gather_inputs,
                                      _make_plan, col_to_rows, kv_operand, ring_scratch,
                                      token_blocks_spec)
from csa_jax.kernels.tpu.ring import _program_stream, _stream, _tile_mask, _when


def _fwd_kernel(
        # inputs
        idx_blk,     # [1, bt * Kg] int32 (SMEM): the block's gathered slots, token-major
        q_ref,       # [bt*H, D]
        valid_ref,   # [bt * n_kg, 1, bk] int32: 1 = non-empty gathered slot
        sink_ref,    # [bt*H, 1] f32
        kv_hbm,      # [B, Np, D] or [B, Np, 1, D] (rows ring) in HBM: kv_operand
        # outputs
        o_ref,       # [bt*H, D]
        lse_ref,     # [bt, H] f32 (token_rows layout)
        *rest,       # (dma count [1] int32 SMEM, if counted) + scratch:
                     # ring (ring_scratch), DMA sems [depth], m, l [bt*H, 1] f32, acc [bt*H, D]
        plan, scale, k_g, broken, count):
    if count:
        cnt_ref, ring_ref, sems, m_ref, l_ref, acc_ref = rest
        cnt_ref[0] = 0

        def on_dma():
            cnt_ref[0] += 1
    else:
        ring_ref, sems, m_ref, l_ref, acc_ref = rest
        on_dma = None
    b, i = pl.program_id(0), pl.program_id(1)
    h, n_kg = plan.h, plan.n_kg
    prec = bm.precision(q_ref.dtype)
    ring, n_win, n_pool, w0, n_steps = _program_stream(plan, b, i, kv_hbm.at[b], ring_ref,
                                                       sems, idx_blk, k_g, on_dma)
    n_struct = n_win + n_pool

    m0, l0, a0 = bm.init_state((plan.bt * h,), plan.d)
    m_ref[...], l_ref[...], acc_ref[...] = m0, l0, a0

    def update(rows, q, v, valid):
        """Online-softmax step for state rows `rows` (a slice) with queries q, tile v."""
        s = scale * _dot_nt(q, v, prec)
        m, l, p, alpha = bm.softmax_update(m_ref[rows], l_ref[rows], s, valid)
        acc_ref[rows] = alpha * acc_ref[rows] + _dot_nn(p.astype(v.dtype), v, prec)
        m_ref[rows], l_ref[rows] = m, l

    def consume(step, slot):
        v = ring.tile(slot)                                         # [bk, D]

        def tile():                                                 # all tokens of the block
            update(slice(None), q_ref[...], v, _tile_mask(plan, i * plan.bt, step, n_win, w0))

        def gathered():                                             # one token's own slots
            g = step - n_struct
            t, _ = bm.step_coords(g, n_kg)
            rows = pl.ds(t * h, h)
            update(rows, q_ref[rows], v, valid_ref[g] > 0)

        if plan.n_struct:
            _when(step < n_struct, tile)
        if n_kg:
            _when(step >= n_struct, gathered)

    _stream(ring, n_steps, consume, broken_wait_after_read=broken)
    o, lse = bm.finalize(m_ref[...], l_ref[...], acc_ref[...], sink_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)
    col_to_rows(lse, lse_ref, h)


def _forward_impl(q, kv, idx, sink, *, scale, interpret, config, broken=False,
                  count_dmas=False):
    """forward(); `broken` (racy wait-after-read) and `count_dmas` (also return the DMAs each
    program issued, [B, T/bt] int32) exist for the tests and the docs' measurements."""
    _maybe_check_layout(idx, kv.shape[1], config)
    return _forward_jit(q, kv, idx, sink, scale=scale, interpret=interpret, config=config,
                        broken=broken, count_dmas=count_dmas)


# jit with the static knobs: one compiled program per (shapes, config), reused across calls
# (interpret mode otherwise rebuilds the kernel on every eager call).
@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "broken",
                                             "count_dmas"))
def _forward_jit(q, kv, idx, sink, *, scale, interpret, config, broken, count_dmas):
    bsz, _, h, d = q.shape
    plan = _make_plan(q.shape, kv.shape[1], idx.shape[-1], config, kv.dtype)
    bt = plan.bt
    (idx_b, idx_spec), (valid, valid_spec), k_g = _gather_inputs(idx, plan)
    kernel = functools.partial(_fwd_kernel, plan=plan, scale=scale, k_g=k_g, broken=broken,
                               count=count_dmas)
    tok = token_blocks_spec(plan, tail=(d,))
    out_specs = [tok, token_blocks_spec(plan)]
    out_shape = [jax.ShapeDtypeStruct((bsz, plan.t_pad * h, d), q.dtype),
                 jax.ShapeDtypeStruct((bsz, plan.nb, bt, h), jnp.float32)]
    if count_dmas:
        out_specs.append(pl.BlockSpec((None, None, 1), lambda b, i, *_: (b, i, 0),
                                      memory_space=pltpu.SMEM))
        out_shape.append(jax.ShapeDtypeStruct((bsz, plan.nb, 1), jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(bsz, plan.nb),
        in_specs=[idx_spec, tok, valid_spec,
                  pl.BlockSpec((bt * h, 1), lambda b, i, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pltpu.HBM)],
        out_specs=out_specs,
        scratch_shapes=ring_scratch(plan, kv.dtype) + [
                        pltpu.VMEM((bt * h, 1), jnp.float32),
                        pltpu.VMEM((bt * h, 1), jnp.float32),
                        pltpu.VMEM((bt * h, d), jnp.float32)],
    )
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=compiler_params(config, interpret),
        interpret=bm.resolve_interpret(interpret, PLATFORMS),
        name="csa_fwd_tpu",
    )(idx_b, _flat_tokens(q, plan), valid,
      jnp.tile(sink.astype(jnp.float32), bt).reshape(bt * h, 1), kv_operand(kv, plan))
    o = outs[0].reshape(bsz, plan.t_pad, h, d)[:, :plan.t]
    lse = outs[1].reshape(bsz, plan.t_pad, h)[:, :plan.t]
    if count_dmas:
        return o, lse, outs[2][..., 0]
    return o, lse


def forward(q, kv, idx, sink, *, scale, interpret, config):
    """o [B,T,H,D] q.dtype, lse [B,T,H] f32 (impl-module interface, see csa_jax/registry.py).
    A broken layout promise: ValueError for a concrete idx, NaN o / lse at the breaking tokens
    for a traced one (config.layout_broken)."""
    bad = layout_broken(idx, kv.shape[1], config)
    o, lse = _forward_impl(q, kv, idx, sink, scale=scale, interpret=interpret, config=config)
    return (o, lse) if bad is None else layouts.poison(bad, o, lse)

