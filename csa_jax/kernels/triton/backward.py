"""The Triton backward: the dq kernel, the per-slot intermediate (XLA's GEMM or the dq
kernel's own), the dkv gather-reduce over the shared CSR inverse map, and backward()."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from csa_jax import blockmath
from csa_jax.kernels.triton.config import PLATFORMS, _params, quiet_lowering
from csa_jax.kernels.triton.plan import (_dims, _gather_rows, _gather_tile, _head_block,
                                         _ntiles, _pad_to, _prep_idx, _scores,
                                         _token_head_grid)


def _dq_kernel(ntiles_ref, idx_ref, q_ref, do_ref, lse_ref, delta_ref, dlse_ref, kv_ref,  # in
               dq_ref, *extra_refs,                                                       # out
               scale, bk, precision, slot_major, dsp, interm):
    # q_ref, do_ref [hb, D]; lse/delta/dlse [hb, 1]; extra_refs, in this order: dsp
    # (interm="gemm") [2, hb, Kp], this head block's scale * dS and P over all slots, in the
    # dtype of the interm products; interm (interm="dq": hb = all heads) [Kp, D], the token's
    # per-slot intermediate scale * dS^T q + P^T dO itself, tile by tile.
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    extra = list(extra_refs)
    dsp = extra.pop(0) if dsp else None
    interm_ref = extra.pop(0) if interm else None
    delta = delta_ref[...]
    dlse = dlse_ref[...]
    ntiles = ntiles_ref[...]

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
        if interm_ref is not None:
            # The GEMM path's products, rounded the same way (scale * dS and P to q's dtype,
            # f32 sums over the heads): [bk, D] = (scale dS)^T q + P^T dO, one writer per slot.
            g = pltriton.dot((ds * scale).astype(q.dtype), q, trans_a=True, precision=precision)
            g = g + pltriton.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
            interm_ref[pl.ds(i * bk, bk), :] = g.astype(interm_ref.dtype)
        return acc + pltriton.dot(ds.astype(rows.dtype), rows, precision=precision)

    acc = lax.fori_loop(0, ntiles, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (acc * scale).astype(dq_ref.dtype)
    # interm: tiles past the token's last non-empty slot are left unwritten: they hold only
    # empty slots, which the inverse map never lists, so the reduce never reads them.
    if dsp is not None:   # tiles past the token's last non-empty slot: exact zeros, never garbage
        zero = jnp.zeros((q.shape[0], bk), dsp.dtype)

        def clear(i, c):
            store(i, zero, zero)
            return c

        lax.fori_loop(ntiles, dsp.shape[-1] // bk, clear, 0)


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
    The map is csa_jax.blockmath.inverse_map; offsets holds each row's [start, end)."""
    B = idx_p.shape[0]
    perm, _, offs = blockmath.inverse_map(idx_p.reshape(B, -1), N, N)       # offs [B, N+1]
    return jnp.stack([offs[:, :-1], offs[:, 1:]], axis=-1), perm


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "parts"))
def _backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config,
              parts=("dq", "interm", "reduce")):
    """`parts` (all by default) lets a benchmark time the kernels one by one; skipped parts
    return zeros (the interm part needs the dq kernel, so its dq is kept; with interm="dq" the
    dq kernel forms the intermediate itself, so "dq" includes it)."""
    d = _dims(q, kv, idx, config)
    prec = blockmath.precision(q.dtype)
    f32 = jnp.float32
    idx_p, used = _prep_idx(idx, d)
    fused = config.interm == "dq"
    if fused and d.Hp != _head_block(d, config.block_h_dq):
        raise ValueError(f"interm='dq' needs all heads in one dq program: H={d.H} (padded "
                         f"{d.Hp}) > block_h_dq={config.block_h_dq}; use interm='gemm'")
    run_dq = "dq" in parts or "interm" in parts
    # Padded heads: q = dO = 0, lse = delta = dlse = 0, so p = 1 but ds = 0 and p * dO = 0.
    q_p = _pad_to(_pad_to(q, 3, d.Dp), 2, d.Hp)
    do_p = _pad_to(_pad_to(do, 3, d.Dp), 2, d.Hp)
    kv_p = _pad_to(kv, 2, d.Dp)
    col = lambda x: _pad_to(x.astype(f32), 2, d.Hp)[..., None]                 # [B, T, Hp, 1]
    lse_p, dlse_p = col(lse), col(dlse)
    delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)                  # [B, T, H]
    delta_p = col(delta)

    dq = jnp.zeros_like(q_p)
    dkv = jnp.zeros_like(kv_p)
    idt = q_p.dtype                       # the intermediate's dtype: q's (f32 for f32 inputs)
    if run_dq:
        dq, *dsp = _dq_call(d, config, scale, interpret, prec, used, idx_p, q_p, do_p, lse_p,
                            delta_p, dlse_p, kv_p, dsp_dtype=None if fused else q_p.dtype,
                            interm_dtype=idt if fused else None)
    if "interm" in parts:
        interm = dsp[0] if fused else _interm_gemm(dsp[0], q_p, do_p, prec, idt)
        if "reduce" in parts:
            dkv = _reduce_call(d, config, interpret, idx_p, interm, kv.dtype)
        else:   # keep the kernel alive for timing
            dkv = dkv.at[:, 0].set(interm[:, 0, 0].astype(dkv.dtype))

    dsink = blockmath.sink_grad(sink, lse, dlse - delta)
    return dq[:, :, :d.H, :d.D], dkv[:, :, :d.D], dsink


def _dq_call(d, config, scale, interpret, prec, used, idx_p, q_p, do_p, lse_p, delta_p, dlse_p,
             kv_p, dsp_dtype=None, interm_dtype=None):
    """dq [B, T, Hp, Dp]: programs over (b, t, head block). With dsp_dtype also returns
    dsp [B, T, 2, Hp, Kp] = (scale * dS, P) of every slot (zeros past a token's last tile).
    With interm_dtype (one head block = all Hp heads) the per-slot intermediate
    [B, T, Kp, Dp] (the tiles past a token's last non-empty one unwritten)."""
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
    if interm_dtype is not None:
        if hb != d.Hp:
            raise ValueError(f"the dq kernel's interm output needs one head block: "
                             f"block {hb} < {d.Hp} heads")
        out_specs.append(pl.BlockSpec((None, None, d.Kp, d.Dp), lambda i: (*tok(i), 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((d.B, d.T, d.Kp, d.Dp), interm_dtype))
    return pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, bk=bk, precision=prec,
                          slot_major=config.slot_major_dq, dsp=dsp_dtype is not None,
                          interm=interm_dtype is not None),
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


def _reduce_call(d, config, interpret, idx_p, interm, dtype):
    """dkv [B, N, Dp]: deterministic gather-reduce over the inverse map, programs over rows."""
    offsets, perm = _inverse_map(idx_p, d.N)
    return _reduce_rows(d, config, interpret, offsets, perm, interm, dtype)


def _reduce_rows(d, config, interpret, offsets, perm, interm, dtype):
    """The gather-reduce kernel alone, on a ready inverse map (offsets, perm).

    config.reduce_split = C > 0: two passes of the same kernel. Pass 1 sums chunks of at most C
    consecutive entries of a row's list (one program per chunk: a hot row, such as a cr128 pool
    row that every later token sees, is spread over up to T / C programs instead of walking up
    to T entries alone), into f32 partials; pass 2 sums each row's partials in chunk order. Both
    orders are fixed: deterministic, bit for bit, from run to run."""
    E = d.T * d.Kp
    interm = interm.reshape(d.B, E, d.Dp)
    C = config.reduce_split
    if not C:
        return _reduce_launch(config, interpret, offsets, perm, interm, dtype)
    chunks, row_chunks = _split_rows(offsets, C, E // C)
    part = _reduce_launch(config, interpret, chunks, perm, interm, jnp.float32)   # [B, G, Dp]
    ident = jnp.broadcast_to(jnp.arange(part.shape[1], dtype=jnp.int32), part.shape[:2])
    return _reduce_launch(config, interpret, row_chunks, ident, part, dtype)


def _split_rows(offsets, chunk, extra):
    """Chunks of at most `chunk` entries of every row's CSR range [start, end).

    offsets [B, N, 2] -> (chunks [B, N + extra, 2]: the entry range of each chunk, rows in order
    and each row's chunks in entry order, [0, 0) past the last; row_chunks [B, N, 2]: each row's
    range of chunks). Every row has >= 1 chunk (an empty row one empty chunk), and the rows
    together have at most N + E / chunk chunks for E entries, so extra = E // chunk bounds them."""
    start, end = offsets[..., 0], offsets[..., 1]
    N = start.shape[1]
    nch = jnp.maximum(1, (end - start + chunk - 1) // chunk)                    # [B, N]
    last = jnp.cumsum(nch, axis=1, dtype=jnp.int32)
    first = last - nch
    w = jnp.arange(N + extra, dtype=jnp.int32)
    row = jax.vmap(lambda l: jnp.searchsorted(l, w, side="right", method="scan_unrolled"))(last)
    live = row < N
    row = jnp.minimum(row, N - 1).astype(jnp.int32)
    take = lambda x: jnp.take_along_axis(x, row, axis=1)
    cs = take(start) + (w[None] - take(first)) * chunk
    ce = jnp.minimum(cs + chunk, take(end))
    chunks = jnp.stack([jnp.where(live, cs, 0), jnp.where(live, ce, 0)], axis=-1)
    return chunks.astype(jnp.int32), jnp.stack([first, last], axis=-1)


def _reduce_launch(config, interpret, offsets, perm, values, dtype):
    """out [B, R, Dp]: out[b, r] = sum of values[b, perm[b, i]] for i in offsets[b, r]'s range."""
    B, R = offsets.shape[:2]
    E, Dp = values.shape[1:]
    br = config.block_r
    perm = _pad_to(perm, 1, E + br)          # a masked tail read never leaves the array
    return pl.pallas_call(
        functools.partial(_reduce_kernel, br=br),
        grid=(B * R,),
        in_specs=[
            pl.BlockSpec((None, None, 2), lambda i: (i // R, i % R, 0)),
            pl.BlockSpec((None, E + br), lambda i: (i // R, 0)),
            pl.BlockSpec((None, E, Dp), lambda i: (i // R, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, 1, Dp), lambda i: (i // R, i % R, 0)),
        out_shape=jax.ShapeDtypeStruct((B, R, Dp), dtype),
        compiler_params=_params(config.num_warps_reduce, 2),
        interpret=interpret,
        name="csa_triton_dkv_reduce",
    )(offsets, perm, values)


def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """(dq, dkv, dsink) of csa_spec.md section 3 with the dlse terms; dkv is deterministic."""
    with quiet_lowering():
        return _backward(q, kv, idx, sink, o, lse, do, dlse, scale=float(scale),
                         interpret=blockmath.resolve_interpret(interpret, PLATFORMS),
                         config=config)
