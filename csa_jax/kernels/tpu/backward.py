"""The TPU backward kernel (dq and per-tile dkv contributions), its launches, and backward()."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm
from csa_jax import layouts
from csa_jax.kernels.tpu.config import PLATFORMS, compiler_params, layout_broken
from csa_jax.kernels.tpu.dkv import _dkv_csr, _dkv_struct
from csa_jax.kernels.tpu.plan import (_dot_nn, _dot_nt, _dot_tn, _flat_tokens, _gather_inputs,
                                      _gathered_idx, _make_plan, col_to_rows, kv_operand,
                                      ring_scratch, rows_to_col, token_blocks_spec, token_rows)
from csa_jax.kernels.tpu.ring import _program_stream, _stream, _tile_mask, _when


def _bwd_kernel(
        # scalar prefetch
        b0_ref,      # [1] int32 (SMEM): the launch's first token block
        # inputs
        idx_blk,     # [1, bt * Kg] int32 (SMEM): the block's gathered slots
        q_ref,       # [bt*H, D]
        o_ref,       # [bt*H, D]
        lse_ref,     # [bt, H] f32 (token_rows layout)
        dlse_ref,    # [bt, H] f32
        valid_ref,   # [bt * n_kg, 1, bk] int32
        kv_hbm,      # [B, Np, D] or [B, Np, 1, D] (rows ring) in HBM: kv_operand
        do_ref,      # [bt*H, D]: dO, whose HBM buffer the dq output below overwrites
        *rest,       # outputs: dq [bt*H, D] (dO's dtype), delta [bt, H] f32 (o . dO, reused
                     #   for dsink), interm_s [B, launch blocks * n_struct, bk, D] f32 HBM
                     #   (structured layouts): each block's contribution to each row of its
                     #   window union / pool tiles; interm_g [B, launch tokens * n_kg, bk, D]
                     #   f32 HBM (if gathering): per slot;
                     # scratch: ring (ring_scratch), DMA sems [depth], stage [2, bk, D] f32 +
                     #   DMA sems [2] (the write-back ring), lse / dlse / delta columns
                     #   [bt*H, 1] f32, dq accumulator [bt*H, D] f32 (if dq is not f32)
        plan, scale, k_g):
    rest = list(rest)
    dq_ref, delta_out = rest.pop(0), rest.pop(0)
    interm_s = rest.pop(0) if plan.n_struct else None
    interm_g = rest.pop(0) if plan.n_kg else None
    ring_ref, sems, stage, out_sems, lse_c, dlse_c, delta_c = rest[:7]
    dq_acc = rest[7] if len(rest) > 7 else dq_ref
    b, il = pl.program_id(0), pl.program_id(1)
    i = b0_ref[0] + il                    # the block of the sequence (il: of this launch)
    h, n_kg = plan.h, plan.n_kg
    prec = bm.precision(q_ref.dtype)
    ring, n_win, n_pool, w0, n_steps = _program_stream(plan, b, i, kv_hbm.at[b], ring_ref,
                                                       sems, idx_blk, k_g)
    n_struct = n_win + n_pool

    rows_to_col(lse_ref[...], lse_c, h)
    rows_to_col(dlse_ref[...], dlse_c, h)
    delta = jnp.sum(o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32), axis=-1,
                    keepdims=True)
    delta_c[...] = delta
    col_to_rows(delta, delta_out, h)
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def grads(rows, v, valid):
        """dq rows += scale * ds @ v; returns the tile rows' dkv part scale*ds^T q + p^T dO."""
        q, do = q_ref[rows], do_ref[rows]
        s = scale * _dot_nt(q, v, prec)
        p = bm.recompute_p(s, lse_c[rows], valid)
        dp = _dot_nt(do, v, prec)
        ds = bm.softmax_grad(p, dp, delta_c[rows], dlse_c[rows])
        dq_acc[rows] += scale * _dot_nn(ds.astype(v.dtype), v, prec)
        # Both transposed products contract the (token, head) axis of ds / p: transposed-
        # operand dots, so no [bk, H] transpose is materialised.
        return (scale * _dot_tn(ds.astype(q.dtype), q, prec)
                + _dot_tn(p.astype(do.dtype), do, prec))

    # Write-back ring: the [bk, D] contribution of step i goes to stage[i % 2] and leaves by an
    # async copy to HBM; step i+2 waits for that copy before overwriting the stage slot, and the
    # program drains the last two before it ends. Intermediates never sit in VMEM as a block.
    def target(step):
        if plan.n_struct:
            j = jnp.where(step < n_win, step, plan.n_w + step - n_win) if plan.n_pm else step
            dst_s = interm_s.at[b, il * plan.n_struct + j]
        if n_kg:
            dst_g = interm_g.at[b, il * plan.bt * n_kg + step - n_struct]
        if not plan.n_struct:
            return dst_g
        if not n_kg:
            return dst_s
        return dst_s, dst_g

    def write_back(step, value):
        k = step % 2

        @pl.when(step >= 2)
        def _():   # any [bk, D] f32 destination: a wait only needs the semaphore and the size
            pltpu.make_async_copy(stage.at[k], _first(target(step)), out_sems.at[k]).wait()
        stage[k] = value
        dsts = target(step)
        if isinstance(dsts, tuple):   # structured tile or gathered slot tile
            _when(step < n_struct, lambda: pltpu.make_async_copy(
                stage.at[k], dsts[0], out_sems.at[k]).start())
            _when(step >= n_struct, lambda: pltpu.make_async_copy(
                stage.at[k], dsts[1], out_sems.at[k]).start())
        else:
            pltpu.make_async_copy(stage.at[k], dsts, out_sems.at[k]).start()

    def consume(step, slot):
        v = ring.tile(slot)

        def tile():
            write_back(step, grads(slice(None), v,
                                   _tile_mask(plan, i * plan.bt, step, n_win, w0)))

        def gathered():
            g = step - n_struct
            t, _ = bm.step_coords(g, n_kg)
            write_back(step, grads(pl.ds(t * h, h), v, valid_ref[g] > 0))

        if plan.n_struct:
            _when(step < n_struct, tile)
        if n_kg:
            _when(step >= n_struct, gathered)

    _stream(ring, n_steps, consume)

    def drain(step, c):
        pltpu.make_async_copy(stage.at[step % 2], _first(target(step)),
                              out_sems.at[step % 2]).wait()
        return c

    lax.fori_loop(jnp.maximum(n_steps - 2, 0), n_steps, drain, 0)
    if dq_acc is not dq_ref:
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _bwd_launch(q2, kv_p, idx, o2, lse_r, dlse_r, do2, plan, blocks, *, scale, interpret,
                config):
    """One backward launch over token blocks `blocks` = (first, count) of the sequence: every
    tile (structured and gathered) of those tokens. dq is written over dO's buffer (do2
    [B, Tp*H, D]: only this launch's blocks change, each after its program read its dO).
    Returns (dq-or-dO [B, Tp*H, D] (dO's dtype), delta [B, count, bt, H] f32,
    interm_s [B, count, n_struct*bk, D] or None, interm_g [B, count*bt*Kg, D] or None,
    idx_g [B, count*bt, Kg] or None). interm_s rows of tiles a block did not stream are NOT
    written (uninitialised): _dkv_struct reads only rows a block streamed."""
    bsz = q2.shape[0]
    h, d, bt, bk = plan.h, plan.d, plan.bt, plan.bk
    b0, nblk = blocks
    (idx_b, idx_spec), (valid, valid_spec), k_g = _gather_inputs(idx, plan, blocks)
    kernel = functools.partial(_bwd_kernel, plan=plan, scale=scale, k_g=k_g)
    tok, rows = token_blocks_spec(plan, (d,), True), token_blocks_spec(plan, offset=True)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    in_specs = [idx_spec, tok, tok, rows, rows, valid_spec, hbm, tok]
    args = [idx_b, q2, o2, lse_r, dlse_r, valid, kv_p, do2]
    aliases = {len(args): 0}           # dO -> dq (operand numbers count b0 first)
    out_specs = [tok, pl.BlockSpec((None, None, bt, h), lambda b, i, *_: (b, i, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct(do2.shape, do2.dtype),
                 jax.ShapeDtypeStruct((bsz, nblk, bt, h), jnp.float32)]
    if plan.n_struct:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct((bsz, nblk * plan.n_struct, bk, d),
                                              jnp.float32))
    if plan.n_kg:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct((bsz, nblk * bt * plan.n_kg, bk, d),
                                              jnp.float32))
    col = pltpu.VMEM((bt * h, 1), jnp.float32)
    scratch = ring_scratch(plan, kv_p.dtype) + [
        pltpu.VMEM((2, bk, d), jnp.float32), pltpu.SemaphoreType.DMA((2,)), col, col, col]
    if do2.dtype != jnp.float32:
        scratch.append(pltpu.VMEM((bt * h, d), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(bsz, nblk), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch)
    outs = list(pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params(config, interpret),
        interpret=bm.resolve_interpret(interpret, PLATFORMS),
        name="csa_bwd_tpu",
    )(jnp.full((1,), b0, jnp.int32), *args))
    dq, delta = outs[0], outs[1]
    interm_s = outs[2].reshape(bsz, nblk, plan.n_struct * bk, d) if plan.n_struct else None
    interm_g = idx_g = None
    if plan.n_kg:
        interm_g = outs[-1].reshape(bsz, nblk * bt * k_g, d)
        idx_g = _gathered_idx(idx, plan, k_g)[:, b0 * bt:(b0 + nblk) * bt]
    return dq, delta, interm_s, interm_g, idx_g


def launch_blocks(plan, config):
    """The backward's launches as (first block, blocks): config.token_chunk tokens each (all
    T in one launch when None); each streams every tile of its own tokens."""
    per = (config.token_chunk or plan.t_pad) // plan.bt
    return [(b0, min(per, plan.nb - b0)) for b0 in range(0, plan.nb, max(per, 1))]


def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """(dq q.dtype, dkv kv.dtype, dsink [H] f32) (impl-module interface, csa_spec.md s. 3).
    A broken layout promise (traced idx) gives NaN dq for its tokens, NaN dkv for its batch
    rows and NaN dsink."""
    bad = layout_broken(idx, kv.shape[1], config)
    dq, dkv, dsink = _backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale,
                               interpret=interpret, config=config)
    if bad is None:
        return dq, dkv, dsink
    (dq,), (dkv,), (dsink,) = (layouts.poison(bad, dq), layouts.poison(bad.any(1), dkv),
                               layouts.poison(bad.any(), dsink))
    return dq, dkv, dsink


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def _backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    bsz, t, h, d = q.shape
    n = kv.shape[1]
    plan = _make_plan(q.shape, n, idx.shape[-1], config, kv.dtype)
    q2, o2, dq = (_flat_tokens(x, plan) for x in (q, o, do))   # dq: dO until overwritten
    lse_r, dlse_r = token_rows(lse, plan), token_rows(dlse, plan)
    kv_p = kv_operand(kv, plan)
    # Partial dkv of the launches are added in launch order (deterministic); within a launch
    # the structured part first, then the gathered one.
    dkv, deltas = None, []
    launches = launch_blocks(plan, config)
    for blocks in launches:
        dq, delta, interm_s, interm_g, idx_g = _bwd_launch(
            q2, kv_p, idx, o2, lse_r, dlse_r, dq, plan, blocks, scale=scale,
            interpret=interpret, config=config)
        deltas.append(delta)
        dkv_c = None
        if interm_s is not None:
            dkv_c = _dkv_struct(interm_s, plan, blocks)
        if interm_g is not None:
            dkv_g = _dkv_csr(interm_g, idx_g, n, interpret=interpret, config=config)
            dkv_c = dkv_g if dkv_c is None else dkv_c + dkv_g
        dkv = dkv_c if dkv is None else dkv + dkv_c
        if len(launches) > 1:
            # The next launch starts after this one's dkv is summed: one launch's
            # intermediates (and one dkv partial) are live at a time, not all of them.
            dq, dkv = lax.optimization_barrier((dq, dkv))
    if dkv is None:
        dkv = jnp.zeros(kv.shape, jnp.float32)
    delta = jnp.concatenate(deltas, axis=1).reshape(bsz, plan.t_pad, h)[:, :t]
    dsink = bm.sink_grad(sink, lse, dlse - delta)
    dq = dq.reshape(bsz, plan.t_pad, h, d)[:, :t]
    return dq.astype(q.dtype), dkv.astype(kv.dtype), dsink.astype(jnp.float32)
