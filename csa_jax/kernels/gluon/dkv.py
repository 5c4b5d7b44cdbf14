"""The dkv gather-reduce in Gluon: deterministic, no atomics (the NVIDIA backward's).

dkv[b, n] = sum of interm[b, e] over the entries e of kv row n in the CSR inverse map
(offsets [B*N, 2] = each row's [start, end) in perm, perm [B, E] = flat slot positions sorted by
row, stable). One program = one kv row, NUM_WARPS warps. The row's entries are walked in chunks
of R: each chunk's R interm rows [R, D] are loaded with 16-byte vector loads (8 consecutive bf16
per thread, a warp covering 256 contiguous columns of one row, so every 1 KiB interm row is read
in fully used 128-byte sectors), the NEXT chunk's loads are issued before the current chunk is
added (a register double buffer: two chunks in flight per program), and the chunk is added
element-wise into an f32 [R, D] accumulator; the R partial rows are summed once at the end.
Summation order (fixed by R and the layout, never by timing): entry k goes to partial row k % R in
entry order, then a fixed tree over the R rows, so the bits are the same on every run. Empty and
out-of-range slots are in no row's range and contribute nothing; a row with no entries gets 0.
"""
from __future__ import annotations

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from csa_jax import blockmath

__all__ = ["csa_dkv_reduce_kernel", "reduce_rows", "dkv_dsink", "dkv_dsink_slot_major",
           "arg_types", "constexprs"]


@gluon.jit
def _chunk(interm_ptr, perm_ptr, start, count, c, rows, cols, D: gl.constexpr, R: gl.constexpr):
    k = c * R + rows
    live = k < count
    pos = gl.load(perm_ptr + start + k, mask=live, other=0)
    ptrs = interm_ptr + pos.to(gl.int64)[:, None] * D + cols[None, :]
    return gl.load(ptrs, mask=live[:, None], other=0.0)


@gluon.jit
def csa_dkv_reduce_kernel(off_ptr, perm_ptr, interm_ptr, dkv_ptr, N: gl.constexpr,
                          E: gl.constexpr, D: gl.constexpr, R: gl.constexpr,
                          TC: gl.constexpr, WARP: gl.constexpr):
    pid = gl.program_id(0)                       # = b * N + n
    b = pid // N
    # TC threads per row segment of 8 * TC columns (TC = 32 at D >= 256: a warp reads 512 B of
    # one row per instruction), WARP // TC rows per warp (WARP = 32; 64 on AMD CDNA, where the
    # kernel compiles too: it uses no NVIDIA-only op).
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [WARP // TC, TC], [gl.num_warps(), 1],
                                            [1, 0])
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    start = gl.load(off_ptr + 2 * pid)
    count = gl.load(off_ptr + 2 * pid + 1) - start
    perm_b = perm_ptr + b.to(gl.int64) * E
    interm_b = interm_ptr + b.to(gl.int64) * E * D
    acc = gl.zeros([R, D], gl.float32, layout)
    x = _chunk(interm_b, perm_b, start, count, 0, rows, cols, D, R)
    for c in range(1, gl.cdiv(count, R) + 1):
        nxt = _chunk(interm_b, perm_b, start, count, c, rows, cols, D, R)   # in flight ...
        acc = acc + x.to(gl.float32)                                        # ... while this adds
        x = nxt
    out = gl.sum(acc, axis=0)
    gl.store(dkv_ptr + pid.to(gl.int64) * D + cols, out.to(dkv_ptr.dtype.element_ty))


def arg_types(dt="bf16", out_dt=None):
    return ["*i32", "*i32", f"*{dt}", f"*{out_dt or dt}"]


def constexprs(*, N, E, D, R, warp=32):
    return dict(N=N, E=E, D=D, R=R, TC=min(32, D // 8), WARP=warp)


def reduce_rows(offsets, perm, interm, dtype, *, block_r=16, num_warps=4):
    """dkv [B, N, D] (dtype) from the CSR map (offsets [B, N, 2], perm [B, E]) and interm
    [B, E, D] (or [B, T, Kp, D]); the Gluon kernel above, launched through adapter.gluon_call."""
    import jax
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    B, N = offsets.shape[:2]
    E = perm.shape[1]
    D = interm.shape[-1]
    if D < 64 or D & (D - 1):
        raise ValueError(f"the Gluon dkv reduce needs D a power of two >= 64, got D={D}")
    rows_per_pass = num_warps * (32 // min(32, D // 8))
    if block_r & (block_r - 1) or block_r < rows_per_pass:
        raise ValueError(f"block_r={block_r} must be a power of two >= {rows_per_pass} "
                         f"({num_warps} warps at D={D})")
    return gluon_call(
        offsets.reshape(B * N, 2).astype(jnp.int32), perm.astype(jnp.int32),
        interm.reshape(B * E, D),
        kernel=csa_dkv_reduce_kernel,
        out_shape=jax.ShapeDtypeStruct((B * N, D), dtype), grid=(B * N,), num_warps=num_warps,
        name="csa_gluon_dkv_reduce", **constexprs(N=N, E=E, D=D, R=block_r)).reshape(B, N, D)


def dkv_dsink(dsp, qdo_st, q_p, do_p, idx_p, d, kv_dtype, sink, lse, dc, *, idx_shape,
              interpret_reduce=False):
    """(dkv [B, N, D], dsink) from a dq kernel's dsp: the deterministic per-slot GEMM
    interm[t] = dsp[t]^T [q; dO][t] and the inverse-map gather-reduce over idx_p [B, T, Kp] (the
    slot order dsp was written in), dsink in XLA. With qdo_st (the NVIDIA dq kernel's copy of
    [q; dO], dsp head block first) the GEMM reads it and the reduce is this file's Gluon kernel;
    without (the AMD dq kernel) the Pallas Triton impl's stack, GEMM and reduce
    (interpret_reduce: its interpreter, for the CPU test of the wrapper)."""
    from csa_jax.kernels.triton import default_config as pt_default_config
    from csa_jax.kernels.triton.backward import _interm_gemm, _reduce_call
    B, T, Hp, Dp, Kp = d.B, d.T, d.Hp, d.Dp, d.Kp
    dt = dsp.dtype                                   # q.dtype
    if qdo_st is not None:
        # interm[t] = dsp[t]^T qdo[t], contracting (head block, plane, head) = 2 * Hp
        per_slot = jax.lax.dot_general(dsp.reshape(B, T, 2 * Hp, Kp),
                                       qdo_st.reshape(B, T, 2 * Hp, Dp),
                                       (((2,), (2,)), ((0, 1), (0, 1))),
                                       preferred_element_type=dt)
        dkv = _reduce_per_slot(per_slot, idx_p, d.N, kv_dtype)
    else:
        ptc = pt_default_config((B, T, d.H, d.D), (B, d.N, d.D), idx_shape, dt)
        per_slot = _interm_gemm(dsp.reshape(B, T, 2, Hp, Kp), q_p, do_p, None, dt)
        dkv = _reduce_call(d, ptc, interpret_reduce, idx_p, per_slot, kv_dtype)
    return dkv[:, :, :d.D], blockmath.sink_grad(sink, lse, dc)


def _reduce_per_slot(per_slot, idx_p, N, kv_dtype):
    """dkv [B, N, Dp] from per_slot [B, T, Kp, Dp] by this file's Gluon reduce over the inverse
    map of idx_p [B, T, Kp]."""
    from csa_jax.kernels.triton.backward import _inverse_map
    B, T, Kp, Dp = per_slot.shape
    offsets, perm = _inverse_map(idx_p, N)
    return reduce_rows(offsets, perm, per_slot.reshape(B, T * Kp, Dp), kv_dtype)


def dkv_dsink_slot_major(dsp, q, do, idx_p, N, Dp, kv_dtype, sink, lse, dc, *, blocks=False,
                         blocks_launch=None):
    """(dkv [B, N, D], dsink) from the few-heads dq kernel's dsp [B, T, Kp, 2, H]
    (small_heads_dq.py: slot-major, scale * dS then P, the H real heads): the per-slot GEMM
    interm[t] = dsp[t] [q; dO][t] (contracting plane and head, 2 H; XLA stacks [q; dO]), then
    the Gluon reduce; or, blocks, dkv_blocks.py (its maps and kernel, no intermediate and no
    stacked copy; the per-slot path where a token lists a row twice, chosen on the device by
    lax.cond, or where its maps do not fit; blocks_launch: the CPU tests' stand-in for
    gluon_call); dsink in XLA."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon import dkv_blocks as _blocks
    from csa_jax.kernels.gluon.ring import _pad
    B, T, _, D = q.shape
    q_p = _pad(q, 3, Dp)
    do_p = _pad(do.astype(q.dtype), 3, Dp)

    def per_slot_path():
        qdo = jnp.stack([q_p, do_p], axis=2)                            # [B, T, 2, H, Dp]
        per_slot = jax.lax.dot_general(dsp, qdo, (((3, 4), (2, 3)), ((0, 1), (0, 1))),
                                       preferred_element_type=dsp.dtype)   # [B, T, Kp, Dp]
        return _reduce_per_slot(per_slot, idx_p, N, kv_dtype)

    if blocks and _blocks.fits(B, T, N):
        maps, dup = _blocks.block_maps(idx_p, N, launch=blocks_launch)
        dkv = jax.lax.cond(dup, per_slot_path, lambda: _blocks.dkv_blocks(
            dsp, q_p, do_p, maps, N, launch=blocks_launch).astype(kv_dtype))
    else:
        dkv = per_slot_path()
    return dkv[:, :, :D], blockmath.sink_grad(sink, lse, dc)
