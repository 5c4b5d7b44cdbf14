"""The TPU backward kernel (dq and per-tile dkv contributions), its launches, and backward()."""
from __future__ import annotations

import dataclasses
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
                                      _gathered_idx, _make_plan, kv_operand, ring_scratch)
from csa_jax.kernels.tpu.ring import _program_stream, _stream, _tile_mask, _when


def _bwd_kernel(
        # inputs
        idx_blk,     # [1, bt * Kg] int32 (SMEM): the block's gathered slots of this launch
        q_ref,       # [bt*H, D]
        do_ref,      # [bt*H, D]
        o_ref,       # [bt*H, D]
        lse_ref,     # [bt*H, 1] f32
        dlse_ref,    # [bt*H, 1] f32
        valid_ref,   # [bt * n_kg, 1, bk] int32
        kv_hbm,      # [B, Np, D] or [B, Np, 1, D] (rows ring) in HBM: kv_operand
        # outputs
        dq_ref,      # [bt*H, D] f32: this launch's part of dq
        delta_ref,   # [bt*H, 1] f32: o . dO (fused here, reused for dsink)
        *rest,       # interm_s [B, nb * n_struct, bk, D] f32 HBM (structured layouts): the
                     #   block's contribution to each row of its window union / pool tiles;
                     # interm_g [B, Tp * n_kg, bk, D] f32 HBM (if gathering): per slot;
                     # scratch: ring (ring_scratch), DMA sems [depth],
                     #   stage [2, bk, D] f32 + DMA sems [2]: the write-back ring
        plan, scale, k_g, explicit_transpose):
    rest = list(rest)
    interm_s = rest.pop(0) if plan.n_struct else None
    interm_g = rest.pop(0) if plan.n_kg else None
    ring_ref, sems, stage, out_sems = rest
    b, i = pl.program_id(0), pl.program_id(1)
    h, n_kg = plan.h, plan.n_kg
    prec = bm.precision(q_ref.dtype)
    ring, n_win, n_pool, w0, n_steps = _program_stream(plan, b, i, kv_hbm.at[b], ring_ref,
                                                       sems, idx_blk, k_g)
    n_struct = n_win + n_pool

    delta_ref[...] = jnp.sum(o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32),
                             axis=-1, keepdims=True)
    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    def grads(rows, v, valid):
        """dq rows += scale * ds @ v; returns the tile rows' dkv part scale*ds^T q + p^T dO."""
        q, do = q_ref[rows], do_ref[rows]
        s = scale * _dot_nt(q, v, prec)
        p = bm.recompute_p(s, lse_ref[rows], valid)
        dp = _dot_nt(do, v, prec)
        ds = bm.softmax_grad(p, dp, delta_ref[rows], dlse_ref[rows])
        dq_ref[rows] += scale * _dot_nn(ds.astype(v.dtype), v, prec)
        # Both transposed products contract the (token, head) axis of ds / p: transposed-
        # operand dots, so no [bk, H] transpose is materialised.
        return (scale * _dot_tn(ds.astype(q.dtype), q, prec, explicit_transpose)
                + _dot_tn(p.astype(do.dtype), do, prec, explicit_transpose))

    # Write-back ring: the [bk, D] contribution of step i goes to stage[i % 2] and leaves by an
    # async copy to HBM; step i+2 waits for that copy before overwriting the stage slot, and the
    # program drains the last two before it ends. Intermediates never sit in VMEM as a block.
    def target(step):
        if plan.n_struct:
            j = jnp.where(step < n_win, step, plan.n_w + step - n_win) if plan.n_pm else step
            dst_s = interm_s.at[b, i * plan.n_struct + j]
        if n_kg:
            dst_g = interm_g.at[b, i * plan.bt * n_kg + step - n_struct]
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


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _bwd_launch(q2, kv_p, idx, o2, lse2, do2, dlse2, plan, *, scale, interpret, config):
    """One backward launch. Returns (dq f32 [B,Tp*H,D], delta [B,Tp*H,1],
    interm_s [B, nb, n_struct*bk, D] or None, interm_g [B, Tp*Kg, D] or None, idx_g or None).
    interm_s rows of tiles a block did not stream are NOT written (uninitialised): _dkv_struct
    reads only rows a block streamed."""
    bsz = q2.shape[0]
    h, d, bt, bk = plan.h, plan.d, plan.bt, plan.bk
    (idx_b, idx_spec), (valid, valid_spec), k_g = _gather_inputs(idx, plan)
    kernel = functools.partial(_bwd_kernel, plan=plan, scale=scale, k_g=k_g,
                               explicit_transpose=config.explicit_transpose)
    tok = pl.BlockSpec((None, bt * h, d), lambda b, i, *_: (b, i, 0))
    col = pl.BlockSpec((None, bt * h, 1), lambda b, i, *_: (b, i, 0))
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    out_specs = [tok, col]
    out_shape = [jax.ShapeDtypeStruct((bsz, plan.t_pad * h, d), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, plan.t_pad * h, 1), jnp.float32)]
    if plan.n_struct:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct((bsz, plan.nb * plan.n_struct, bk, d),
                                              jnp.float32))
    if plan.n_kg:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct((bsz, plan.t_pad * plan.n_kg, bk, d),
                                              jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(bsz, plan.nb),
        in_specs=[idx_spec, tok, tok, tok, col, col, valid_spec, hbm],
        out_specs=out_specs,
        scratch_shapes=ring_scratch(plan, kv_p.dtype) + [
                        pltpu.VMEM((2, bk, d), jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
    )
    outs = list(pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=compiler_params(config, interpret),
        interpret=bm.resolve_interpret(interpret, PLATFORMS),
        name="csa_bwd_tpu",
    )(idx_b, q2, do2, o2, lse2, dlse2, valid, kv_p))
    dq, delta = outs[0], outs[1]
    interm_s = interm_g = idx_g = None
    if plan.n_struct:
        interm_s = outs[2].reshape(bsz, plan.nb, plan.n_struct * bk, d)
    if plan.n_kg:
        interm_g = outs[-1].reshape(bsz, plan.t_pad * k_g, d)
        idx_g = _gathered_idx(idx, plan, k_g)
    return dq, delta, interm_s, interm_g, idx_g


def launch_plans(plan, config):
    """The backward's launches: launch 0 streams the structured tiles and the first
    config.slot_chunk gathered slots of each token; later launches only further chunks."""
    k_g_all = plan.n_kg * plan.bk
    chunk = config.slot_chunk or max(k_g_all, plan.bk)
    launches = []
    for c0 in range(0, max(k_g_all, 1), chunk):
        n_g = min(chunk, k_g_all - c0)
        lp = dataclasses.replace(plan, n_kg=bm.num_tiles(n_g, plan.bk), g_off=plan.g_off + c0)
        if c0:
            lp = dataclasses.replace(lp, n_w=0, n_pm=0)
        launches.append(lp)
    return launches


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
    q2, do2, o2 = (_flat_tokens(x, plan) for x in (q, do, o))
    lse2 = _flat_tokens(lse[..., None].astype(jnp.float32), plan)
    dlse2 = _flat_tokens(dlse[..., None].astype(jnp.float32), plan)
    kv_p = kv_operand(kv, plan)
    # Partial results of the launches are added in launch order (deterministic).
    dq = dkv = delta = None
    for lp in launch_plans(plan, config):
        dq_c, delta, interm_s, interm_g, idx_g = _bwd_launch(
            q2, kv_p, idx, o2, lse2, do2, dlse2, lp, scale=scale, interpret=interpret,
            config=config)
        dkv_c = None
        if interm_s is not None:
            dkv_c = _dkv_struct(interm_s, lp)
        if interm_g is not None:
            dkv_g = _dkv_csr(interm_g, idx_g, n, interpret=interpret, config=config)
            dkv_c = dkv_g if dkv_c is None else dkv_c + dkv_g
        dq = dq_c if dq is None else dq + dq_c
        if dkv_c is not None:
            dkv = dkv_c if dkv is None else dkv + dkv_c
    if dkv is None:
        dkv = jnp.zeros(kv.shape, jnp.float32)
    delta = delta.reshape(bsz, plan.t_pad, h)[:, :t]
    dsink = jnp.sum(jnp.exp(sink[None, None, :] - lse) * (dlse - delta), axis=(0, 1))
    dq = dq.reshape(bsz, plan.t_pad, h, d)[:, :t]
    return dq.astype(q.dtype), dkv.astype(kv.dtype), dsink.astype(jnp.float32)
