"""Window reuse in the backward (Config.bwd_win, layout="cr0"): the dq kernel on a resident window.

Under the cr0 promise (csa_spec.md section 4) token t attends to kv rows max(0, t - W + 1) .. t.
As the forward's window kernel (window.py), a program owns blocks of BT = 16 consecutive tokens
and copies each block's window union, the W + BT rows t0 - W .. t0 + BT - 1 (144 KiB at W = 128,
D = 512), once into shared memory; every token of the block reads it at its own offset. What
differs from the forward is the A operand of the score product: [q; dO] (S and dP of the same
slots), 128 KiB for 64 heads, which does not fit beside the span. So a program here covers 32
heads (the layout docs/perf/gluon_bwd_h200.md part 3 found to fit):

- shared memory (bf16, D = 512, W = 128; dims.dq_win_shared_bytes):
  [q; dO] of 32 heads, rows interleaved by 8 as bwd_pair's (_qdo_row)  64 rows   65,536 B
  span: win_a [W, D] (rows t0 - W ..) + win_b [BT, D] (rows t0 ..)    144 rows  147,456 B
  dS of the token: [32, W] + [32, BT]                                           9,216 B
  4 mbarriers                                                                      32 B
  = 222,240 B of the H200's 232,448 (one program per SM; no room for a second [q; dO]).
- per token (consumers, 8 warps = 2 warpgroups): S and dP = [q; dO] span^T as two wgmma products
  (N = W, N = BT; M = 64 paired rows, each warpgroup half of the columns), both awaited, then the
  [q; dO] buffer is released, so the next token's [q; dO] (the only per-token load) streams in
  during this token's element-wise work, dsp stores and dq product. p = exp2(S scale log2e - lse
  log2e) on the token's window columns (0 elsewhere), dS = p (dP + dlse - delta) in registers
  (bwd._split_sd: S and dP of a (head, slot) in one thread); dq^T [D, 32] = span^T dS^T
  (A = the span through an MN-major descriptor, M = D over both warpgroups, N = 32 heads: no
  wgmma row wasted), stored as dq = scale * acc from the accumulator layout (bwd._store_dq).
- dsp (scale*dS and P) goes out in the CANONICAL slot order, slot j = kv row t - W + 1 + j: the
  wrapper runs the unchanged deterministic dkv path (interm GEMM + inverse-map reduce) on the
  canonical index list instead of idx (the same set of rows per token under the promise, so the
  same dkv up to the reduce's fixed summation order; bit-deterministic).
- the producer partition (4 warps) copies [q; dO] per token and the span once per block (after
  the block's first [q; dO]; the span of block k + 1 waits for the last dq product of block k).

Options (Config.bwd_win_*; docs/perf/gluon_bwd_h200.md part 4a): OVERLAP (default) issues the
[q; dO] copy-out under the async score products and the dsp stores under the async dq product;
FUSE 2 forms delta from o and the resident dO; DQ_MM stores dq in 4-byte stores after a register
transpose (movmatrix); DSP_BLOCK writes dsp in span-column order (slot_rows "block": aligned
4-byte stores); ABLATE is benchmark-only. cr128 (the pool slots) and AMD are refused (the
gather kernel of bwd.py runs those).
"""
from __future__ import annotations

import functools

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.bwd import _load_dc, _qdo_row, _split_sd, _store_dq
from csa_jax.kernels.gluon.dims import HB, SMEM_LIMIT, dq_win_shared_bytes, padded_dims
from csa_jax.kernels.gluon.fwd import CONSUMER_WARPS, LOG2E, PRODUCER_WARPS, _release
from csa_jax.kernels.gluon.window import (BLOCK_T, _copy_rows, _program_blocks, _span_barriers,
                                          _span_buffers, programs)

__all__ = ["csa_dq_win_kernel", "arg_types", "constexprs", "dq_window", "backward",
           "checked_backward", "slot_rows", "HEADS"]

HEADS = 32                     # heads per program
H2 = gl.constexpr(HEADS)
BT = gl.constexpr(BLOCK_T)
_LOG2E = gl.constexpr(LOG2E)
HBC = gl.constexpr(HB)          # heads of a dsp / qdo head block (64)


@gluon.jit
def _producer(q_ptr, do_ptr, kv_ptr, qdo_smem, win_a, win_b, q_ready, q_free, span_ready,
              span_free, b, h2, g, nblk, T: gl.constexpr, N: gl.constexpr, NH2: gl.constexpr,
              D: gl.constexpr, W: gl.constexpr, G: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    for k in range(nblk):
        t0 = (g + k * G) * BT
        for i in range(gl.minimum(T - t0, BT)):
            it = k * BT + i
            if it > 0:
                mbarrier.wait(q_free, (it - 1) & 1)
            # [q; dO] of the token's 32 heads, rows interleaved by 8 (bwd._qdo_row), 16 at a time
            hrow0 = ((b * T + t0 + i) * NH2 + h2) * H2
            for c in gl.static_range(2 * H2 // 16):
                r = c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                plane, head = _qdo_row(r, H2, True)
                off = (hrow0 + head).to(gl.int64)[:, None] * D + cols[None, :]
                src = gl.where((plane == 0)[:, None], q_ptr + off, do_ptr + off)
                async_copy.async_copy_global_to_shared(qdo_smem.slice(c * 16, 16), src)
            async_copy.mbarrier_arrive(q_ready, increment_count=False)
            if i == 0:
                if k > 0:
                    mbarrier.wait(span_free, (k - 1) & 1)
                _copy_rows(win_a, kv_base, t0 - W, W, N, D, D)
                _copy_rows(win_b, kv_base, t0, BT, N, D, D)
                async_copy.mbarrier_arrive(span_ready, increment_count=False)


@gluon.jit
def _scores(qdo_smem, tile, NC: gl.constexpr):
    """[S; dP] [64 paired rows, NC] = [q; dO] tile^T, columns split over the two warpgroups;
    issued async."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, NC // 2, 16])
    return warpgroup_mma(qdo_smem, tile.permute((1, 0)),
                         gl.zeros([2 * H2, NC], gl.float32, layout), use_acc=False,
                         is_async=True)


@gluon.jit
def _p_ds_cols(sd, lse_ptr, dc_ptr, hoff, c_lo, c_hi, NC: gl.constexpr, QK_SCALE: gl.constexpr):
    """(p, dS, head rows, columns) [32, NC] of the paired accumulator sd on the columns
    c_lo <= c <= c_hi (0 elsewhere), with lse and dlse - delta (dc_ptr) of the token's heads at
    hoff."""
    sc, dp = _split_sd(sd, H2, NC)
    ew: gl.constexpr = sc.type.layout
    hrows = gl.arange(0, H2, layout=gl.SliceLayout(1, ew))
    cols = gl.arange(0, NC, layout=gl.SliceLayout(0, ew))
    lse2 = gl.load(lse_ptr + hoff + hrows) * _LOG2E
    dc = gl.load(dc_ptr + hoff + hrows)
    valid = ((cols >= c_lo) & (cols <= c_hi))[None, :]
    p = gl.where(valid, gl.exp2(sc * QK_SCALE - lse2[:, None]), 0.0)
    return p, p * (dp + dc[:, None]), hrows, cols


@gluon.jit
def _store_dsp(dsp_ptr, base, hrows, cols, shift, c_lo, c_hi, p, ds, KC: gl.constexpr,
               PSTRIDE: gl.constexpr, SCALE: gl.constexpr):
    """Columns c_lo .. c_hi of the token's span tile to canonical slots j = c + shift of dsp
    (scale*dS at base, P at base + PSTRIDE; rows of KC slots)."""
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    ptrs = dsp_ptr + base + hrows.to(gl.int64)[:, None] * KC + (cols + shift)[None, :]
    m = ((cols >= c_lo) & (cols <= c_hi))[None, :]
    gl.store(ptrs, (ds * SCALE).to(dt), mask=m)
    gl.store(ptrs + PSTRIDE, p.to(dt), mask=m)


@gluon.jit
def _store_dsp_block(dsp_ptr, base, hra, ca, hrb, cb, i, pa, dsa_v, pb, dsb_v, KC: gl.constexpr,
                     PSTRIDE: gl.constexpr, SCALE: gl.constexpr):
    """Config.bwd_win_dsp="block": slot j = span column j (win_a column j for j > i, win_b
    column j for j <= i): win_a's tile whole and unmasked (aligned 4-byte stores; its columns
    j <= i are 0 there), then, after a partition barrier (the later write wins), win_b's
    columns 0 .. i over them."""
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    pa_ptrs = dsp_ptr + base + hra.to(gl.int64)[:, None] * KC + ca[None, :]
    gl.store(pa_ptrs, (dsa_v * SCALE).to(dt))
    gl.store(pa_ptrs + PSTRIDE, pa.to(dt))
    gl.thread_barrier()
    _store_dsp(dsp_ptr, base, hrb, cb, 0, 0, i, pb, dsb_v, KC, PSTRIDE, SCALE)


@gluon.jit
def _dsp_out(dsp_ptr, base, hra, ca, hrb, cb, i, pa, dsa_v, pb, dsb_v, W: gl.constexpr,
             PSTRIDE: gl.constexpr, SCALE: gl.constexpr, DSP_BLOCK: gl.constexpr):
    """The token's dsp: win_a's (columns ca) and win_b's (cb) tiles in the slot order of
    slot_rows ("block" with DSP_BLOCK, else "canonical": slot j = c - i - 1 of win_a's column c,
    W - 1 - i + c of win_b's; every slot 0 .. W - 1 written once, 0 where the row is < 0)."""
    if DSP_BLOCK:
        _store_dsp_block(dsp_ptr, base, hra, ca, hrb, cb, i, pa, dsa_v, pb, dsb_v, W, PSTRIDE,
                         SCALE)
    else:
        _store_dsp(dsp_ptr, base, hra, ca, -i - 1, i + 1, W - 1, pa, dsa_v, W, PSTRIDE, SCALE)
        _store_dsp(dsp_ptr, base, hrb, cb, W - 1 - i, 0, i, pb, dsb_v, W, PSTRIDE, SCALE)


@gluon.jit
def _copy_qdo(qdo_ptr, qdo_smem, tok, hb, half, NH2: gl.constexpr, D: gl.constexpr):
    """The resident [q; dO] (paired rows) to the interm GEMM's operand qdo [B*T, NHB, 2, 64, D]
    (q's rows, then dO's, of this program's 32 heads of head block hb), 32 rows at a time."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    cc = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    base = qdo_ptr + (tok * (NH2 // 2) + hb).to(gl.int64) * (2 * HBC * D)
    for j in gl.static_range(2):
        r = 32 * j + gl.arange(0, 32, layout=gl.SliceLayout(1, blk))
        plane, head = _qdo_row(r, H2, True)
        gl.store(base + (plane * HBC + half * H2 + head)[:, None] * D + cc[None, :],
                 qdo_smem.slice(32 * j, 32).load(blk))


@gluon.jit
def _store_dq_mm(dq_ptr, acc, row, D: gl.constexpr, SCALE: gl.constexpr):
    """dq [32, D] = scale * acc^T from acc = dq^T [D, 32] (the wgmma accumulator layout) with
    4-byte stores: the bf16 values' 8 x 8 blocks transposed across the warp by movmatrix (as
    regtrans.transpose_load), so a thread's register pair holds 2 consecutive d of one head;
    the value at position (d, h) is then dq[8 (h // 8) + d % 8, 8 (d // 8) + h % 8]."""
    layout: gl.constexpr = acc.type.layout
    x = (acc * SCALE).to(dq_ptr.dtype.element_ty)
    z = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
                                  [x], dtype=x.dtype, is_pure=True, pack=2)
    d = gl.arange(0, D, layout=gl.SliceLayout(1, layout))[:, None]
    h = gl.arange(0, H2, layout=gl.SliceLayout(0, layout))[None, :]
    head = (h // 8) * 8 + d % 8
    col = (d // 8) * 8 + h % 8
    gl.store(dq_ptr + (row * H2 + head).to(gl.int64) * D + col, z)


@gluon.jit
def _delta8(dlse_ptr, dcout_ptr, hrow, o, do_view, layout: gl.constexpr):
    """dcout = dlse - sum(o * dO) of 8 heads (rows hrow), dO from the resident [q; dO]."""
    d = gl.sum(o.to(gl.float32) * do_view.load(layout).to(gl.float32), axis=1)
    gl.store(dcout_ptr + hrow, gl.load(dlse_ptr + hrow) - d)


@gluon.jit
def _token(lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, win_a, win_b, dsa, dsb,
           q_ready, q_free, acc0, it, i, t0, tok, h2, NH2: gl.constexpr, D: gl.constexpr,
           W: gl.constexpr, QK_SCALE: gl.constexpr, SCALE: gl.constexpr, QDO: gl.constexpr,
           FUSE: gl.constexpr, ABLATE: gl.constexpr, OVERLAP: gl.constexpr,
           DQ_MM: gl.constexpr, DSP_BLOCK: gl.constexpr):
    """One token of a block (token i of block t0, the it-th of the program): scores on the
    resident span, p / dS, dsp stores, dq^T = span^T dS^T, dq store. ABLATE (benchmark only,
    wrong results): 1 = no dsp / qdo stores, 2 = no dq product (dq stored as 0)."""
    HP: gl.constexpr = NH2 * H2
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    lrow: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 1], [32, 1], [gl.num_warps(), 1],
                                                            [1, 0]))
    hb = h2 // 2                                  # the 64-head block (dsp / qdo layout)
    half = h2 % 2
    if FUSE == 1:    # delta = sum(o * dO) formed here (bwd._load_dc): dlse - delta -> dcout
        _load_dc(dc_ptr, fz, tok * NH2 + h2, gl.arange(0, H2, layout=lrow), D, H2, True)
        dsrc = fz[2]
    elif FUSE == 2:  # the same from o (loads issued before the wait) and the resident dO
        dsrc = fz[2]
        o8: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        r8 = gl.arange(0, 8, layout=gl.SliceLayout(1, o8))
        c8 = gl.arange(0, D, layout=gl.SliceLayout(0, o8))
        obase = fz[0] + (tok * HP + h2 * H2).to(gl.int64) * D
        o0 = gl.load(obase + (r8 + 0)[:, None] * D + c8[None, :])
        o1 = gl.load(obase + (r8 + 8)[:, None] * D + c8[None, :])
        o2 = gl.load(obase + (r8 + 16)[:, None] * D + c8[None, :])
        o3 = gl.load(obase + (r8 + 24)[:, None] * D + c8[None, :])
    else:
        dsrc = dc_ptr
    mbarrier.wait(q_ready, it & 1)
    fence_async_shared()              # cp.async (generic proxy) -> wgmma
    if FUSE == 2:    # heads 8a .. 8a + 7: dO in rows 16a + 8 .. of the paired buffer
        hrow = tok * HP + h2 * H2 + r8
        _delta8(dc_ptr, dsrc, hrow + 0, o0, qdo_smem.slice(8, 8), o8)
        _delta8(dc_ptr, dsrc, hrow + 8, o1, qdo_smem.slice(24, 8), o8)
        _delta8(dc_ptr, dsrc, hrow + 16, o2, qdo_smem.slice(40, 8), o8)
        _delta8(dc_ptr, dsrc, hrow + 24, o3, qdo_smem.slice(56, 8), o8)
        gl.thread_barrier()           # dcout visible to every consumer thread
    if not OVERLAP and QDO and ABLATE != 1:
        _copy_qdo(qdo_ptr, qdo_smem, tok, hb, half, NH2, D)
    sa = _scores(qdo_smem, win_a, W)
    sb = _scores(qdo_smem, win_b, BT)
    if OVERLAP and QDO and ABLATE != 1:    # under the score products (both only read it)
        _copy_qdo(qdo_ptr, qdo_smem, tok, hb, half, NH2, D)
    sa, sb = warpgroup_mma_wait(0, deps=[sa, sb])
    # every consumer warp is past its [q; dO] reads (and past the previous token's dq
    # product, which read dS): the next [q; dO] may load, dS may be overwritten
    _release(q_free)
    hoff = tok * HP + h2 * H2
    # win_a column c = kv row t0 - W + c: the window's rows t - W + 1 .. t0 - 1 there
    # (rows < 0 were zero-filled: masked), canonical slot j = c - i - 1
    pa, dsa_v, hra, ca = _p_ds_cols(sa, lse_ptr, dsrc, hoff,
                                    gl.maximum(i + 1, W - t0), W - 1, W, QK_SCALE)
    # win_b column c = kv row t0 + c: rows t0 .. t, slot j = W - 1 - i + c
    pb, dsb_v, hrb, cb = _p_ds_cols(sb, lse_ptr, dsrc, hoff, 0, i, BT, QK_SCALE)
    if QDO:      # dsp [B*T, NHB, 2, 64, W]
        base = (tok * (NH2 // 2) + hb).to(gl.int64) * (2 * HBC * W) + half * H2 * W
        PSTRIDE: gl.constexpr = HBC * W
    else:        # dsp [B*T, 2, HP, W]
        base = tok.to(gl.int64) * (2 * HP * W) + h2 * H2 * W
        PSTRIDE: gl.constexpr = HP * W
    if not OVERLAP and ABLATE != 1:
        _dsp_out(dsp_ptr, base, hra, ca, hrb, cb, i, pa, dsa_v, pb, dsb_v, W, PSTRIDE, SCALE,
                 DSP_BLOCK)
    dsa.store(dsa_v.to(dt))
    dsb.store(dsb_v.to(dt))
    fence_async_shared()              # generic-proxy stores -> wgmma reads
    gl.thread_barrier()
    # dq^T [D, 32] = span^T dS^T: A = the span (MN-major), B = dS^T (K-major); with OVERLAP
    # issued async, the dsp stores (0 where the row < 0) under it
    acc = acc0
    if ABLATE != 2:
        acc = warpgroup_mma(win_a.permute((1, 0)), dsa.permute((1, 0)), acc0,
                            use_acc=False, is_async=OVERLAP)
        acc = warpgroup_mma(win_b.permute((1, 0)), dsb.permute((1, 0)), acc,
                            is_async=OVERLAP)
    if OVERLAP and ABLATE != 1:
        _dsp_out(dsp_ptr, base, hra, ca, hrb, cb, i, pa, dsa_v, pb, dsb_v, W, PSTRIDE, SCALE,
                 DSP_BLOCK)
    if OVERLAP and ABLATE != 2:
        acc = warpgroup_mma_wait(0, deps=[acc])
    if DQ_MM:
        _store_dq_mm(dq_ptr, acc, tok * NH2 + h2, D, SCALE)
    else:
        _store_dq(dq_ptr, acc, tok * NH2 + h2, D, H2, SCALE, 1)


@gluon.jit
def _consumer(lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, win_a, win_b, dsa, dsb,
              q_ready, q_free, span_ready, span_free, b, h2, g, nblk, T: gl.constexpr,
              NH2: gl.constexpr, D: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
              QK_SCALE: gl.constexpr, SCALE: gl.constexpr, QDO: gl.constexpr,
              FUSE: gl.constexpr, ABLATE: gl.constexpr, OVERLAP: gl.constexpr,
              DQ_MM: gl.constexpr, DSP_BLOCK: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, H2, 16])
    acc0 = gl.zeros([D, H2], gl.float32, acc_layout)
    for k in range(nblk):
        t0 = (g + k * G) * BT
        mbarrier.wait(span_ready, k & 1)
        for i in range(gl.minimum(T - t0, BT)):
            it = k * BT + i
            tok = b * T + t0 + i
            if ABLATE == 3:  # benchmark only: no compute, the copies' pace
                mbarrier.wait(q_ready, it & 1)
                _release(q_free)
            else:
                _token(lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, win_a, win_b,
                       dsa, dsb, q_ready, q_free, acc0, it, i, t0, tok, h2, NH2, D, W,
                       QK_SCALE, SCALE, QDO, FUSE, ABLATE, OVERLAP, DQ_MM, DSP_BLOCK)
        _release(span_free)


@gluon.jit
def csa_dq_win_kernel(q_ptr, do_ptr, kv_ptr, lse_ptr, dc_ptr, o_ptr, dq_ptr, dsp_ptr, qdo_ptr,
                      dcout_ptr, T: gl.constexpr, N: gl.constexpr, NH2: gl.constexpr,
                      D: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
                      QK_SCALE: gl.constexpr, SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      QDO: gl.constexpr, FUSE: gl.constexpr, ABLATE: gl.constexpr,
                      OVERLAP: gl.constexpr, DQ_MM: gl.constexpr, DSP_BLOCK: gl.constexpr):
    h2, g, b, nblk = _program_blocks(T, NH2, G)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qdo_smem = gl.allocate_shared_memory(
        dtype, [2 * H2, D], gl.NVMMASharedLayout.get_default_for([2 * H2, D], dtype))
    win_a, win_b = _span_buffers(dtype, W, D, False)
    dsa = gl.allocate_shared_memory(
        dtype, [H2, W], gl.NVMMASharedLayout.get_default_for([H2, W], dtype))
    dsb = gl.allocate_shared_memory(
        dtype, [H2, BT], gl.NVMMASharedLayout.get_default_for([H2, BT], dtype))
    q_ready, q_free, span_ready, span_free = _span_barriers(1)
    gl.warp_specialize([
        (_consumer, (lse_ptr, dc_ptr, (o_ptr, do_ptr, dcout_ptr), dq_ptr, dsp_ptr, qdo_ptr,
                     qdo_smem, win_a, win_b, dsa, dsb, q_ready, q_free, span_ready, span_free,
                     b, h2, g, nblk, T, NH2, D, W, G, QK_SCALE, SCALE, QDO, FUSE, ABLATE,
                     OVERLAP, DQ_MM, DSP_BLOCK)),
        (_producer, (q_ptr, do_ptr, kv_ptr, qdo_smem, win_a, win_b, q_ready, q_free,
                     span_ready, span_free, b, h2, g, nblk, T, N, NH2, D, W, G)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side

# q, dO, kv, lse, dc (dlse - delta; dlse with FUSE), o | dq, dsp, qdo, dcout
def arg_types(dt="bf16"):
    return [f"*{dt}", f"*{dt}", f"*{dt}", "*fp32", "*fp32", f"*{dt}", f"*{dt}", f"*{dt}",
            f"*{dt}", "*fp32"]


def constexprs(*, T, N, NH2, D, window, G, scale, producer_regs, qdo=True, fuse_delta=0,
               ablate=0, overlap=True, dq_mm=False, dsp_block=False):
    """fuse_delta: 0 delta from XLA (dc = dlse - delta in), 1 the kernel forms it from o and dO
    in global memory (bwd._load_dc), 2 from o (issued before the [q; dO] wait) and the resident
    dO (Config.bwd_win_delta="smem")."""
    return dict(T=T, N=N, NH2=NH2, D=D, W=window, G=G, QK_SCALE=float(scale) * LOG2E,
                SCALE=float(scale), PRODUCER_REGS=producer_regs, QDO=bool(qdo),
                FUSE=int(fuse_delta), ABLATE=int(ablate), OVERLAP=bool(overlap),
                DQ_MM=bool(dq_mm), DSP_BLOCK=bool(dsp_block))


def slot_rows(T, window, order="canonical"):
    """[T, window] int32: the kv row of each dsp slot the window dq kernel writes (-1 for rows
    < 0). "canonical": slot j of token t = row t - window + 1 + j (indices.window_indices);
    "block" (Config.bwd_win_dsp): slot j = span column j of t's 16-token block t0 = 16 (t // 16),
    i = t - t0: row t0 - window + j for j > i, row t0 + j for j <= i (the same row set)."""
    import jax.numpy as jnp
    from csa_jax.indices import window_indices
    if order == "canonical":
        return window_indices(T, window)
    t = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = jnp.arange(window, dtype=jnp.int32)[None, :]
    t0, i = t - t % BLOCK_T, t % BLOCK_T
    rows = jnp.where(j > i, t0 - window + j, t0 + j)
    return jnp.where(rows >= 0, rows, -1)


@functools.partial(jax.jit, static_argnames=("scale", "window", "qdo", "fuse_delta",
                                             "producer_regs", "programs_per", "ablate",
                                             "overlap", "dq_mm", "dsp_block"))
def dq_window(q, kv, lse, do, dc, o, *, scale, window, qdo=True, fuse_delta=0,
              producer_regs=56, programs_per=0, ablate=0, overlap=True, dq_mm=False,
              dsp_block=False):
    """(dq [B, T, H, D], dsp, qdo copy or None, dc) of the cr0 window dq kernel. dc: dlse -
    delta [B, T, H] f32, or with fuse_delta (1, 2: constexprs) dlse alone (the kernel forms
    delta from o and dO; the returned dc is then the kernel's dlse - delta). dsp is [B*T, NHB, 2, 64, window] with
    qdo (head block first, as bwd.py's QDO layout; the qdo copy [B*T, NHB, 2, 64, Dp]), else
    [B*T, 2, Hp, window]; slot j of token t = kv row t - window + 1 + j. CUDA only."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    B, T, H, D = q.shape
    N = kv.shape[1]
    Hp, Dp, _ = padded_dims(H, D, 1, 1)
    need = dq_win_shared_bytes(Dp, window)
    if need > SMEM_LIMIT:
        raise NotImplementedError(f"bwd_win at D={D}, window={window}: the window dq kernel "
                                  f"needs {need} B of shared memory, over the {SMEM_LIMIT} B")
    from csa_jax.kernels.triton.plan import _pad_to as pad   # (bwd.py's padding helper)
    rows = lambda x: pad(pad(x, 3, Dp), 2, Hp).reshape(B * T * Hp, Dp)
    f32 = jnp.float32
    nh2 = Hp // HEADS
    G = programs(B, T, nh2, programs_per)
    dsp_shape = (B * T, Hp // HB, 2, HB, window) if qdo else (B * T, 2, Hp, window)
    qdo_shape = (B * T, Hp // HB, 2, HB, Dp) if qdo else (8,)
    do_p = rows(do)
    dq, dsp, qdo_st, dcout = gluon_call(
        rows(q), do_p, pad(kv, 2, Dp).reshape(B * N, Dp),
        pad(lse.astype(f32), 2, Hp).reshape(-1), pad(dc.astype(f32), 2, Hp).reshape(-1),
        rows(o) if fuse_delta else do_p,          # o: read with fuse_delta only
        kernel=csa_dq_win_kernel,
        out_shape=[jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
                   jax.ShapeDtypeStruct(dsp_shape, q.dtype),
                   jax.ShapeDtypeStruct(qdo_shape, q.dtype),
                   jax.ShapeDtypeStruct((B * T * Hp,) if fuse_delta else (8,), f32)],
        grid=(B * G * nh2,), num_warps=CONSUMER_WARPS, name="csa_gluon_dq_win",
        **constexprs(T=T, N=N, NH2=nh2, D=Dp, window=window, G=G, scale=scale,
                     producer_regs=producer_regs, qdo=qdo, fuse_delta=fuse_delta,
                     ablate=ablate, overlap=overlap, dq_mm=dq_mm, dsp_block=dsp_block))
    if fuse_delta:
        dc = dcout.reshape(B, T, Hp)[:, :, :H]
    return dq.reshape(B, T, Hp, Dp)[:, :, :H, :D], dsp, (qdo_st if qdo else None), dc


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def backward(q, kv, sink, o, lse, do, dlse, bad, *, scale, config):
    """(dq, dkv, dsink) under the cr0 promise (Config.bwd_win; idx is not read: bad [B, T]
    marks the tokens whose traced idx breaks the promise, whose lse is taken as NaN, so their
    dq, the dkv rows of their window and dsink are NaN, never silently wrong). dkv: bwd.py's
    deterministic path (dkv.dkv_dsink) over the canonical window index list. CUDA only."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.dkv import dkv_dsink
    from csa_jax.kernels.triton.plan import _Dims
    f32 = jnp.float32
    B, T, H, D = q.shape
    N, W = kv.shape[1], config.window
    lse = jnp.where(jnp.asarray(bad, bool)[..., None], jnp.nan, lse.astype(f32))
    fuse = (2 if config.bwd_win_delta == "smem" else 1) if config.bwd_fuse_delta else 0
    dc = dlse.astype(f32)
    if not fuse:
        dc = dc - jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)
    dq, dsp, qdo_st, dc = dq_window(q, kv, lse, do, dc, o, scale=scale, window=W,
                                    qdo=config.bwd_qdo, fuse_delta=fuse,
                                    producer_regs=config.bwd_win_producer_regs,
                                    programs_per=config.win_programs,
                                    ablate=config.bwd_win_ablate,
                                    overlap=config.bwd_win_overlap,
                                    dq_mm=config.bwd_win_dq_movmatrix,
                                    dsp_block=config.bwd_win_dsp == "block")
    Hp, Dp, _ = padded_dims(H, D, 1, 1)
    idx_c = jnp.broadcast_to(slot_rows(T, W, config.bwd_win_dsp), (B, T, W))
    q_p = do_p = None
    if not config.bwd_qdo:          # XLA stacks [q; dO] for the interm GEMM
        from csa_jax.kernels.triton.plan import _pad_to
        q_p, do_p = (_pad_to(_pad_to(x, 3, Dp), 2, Hp) for x in (q, do))
    return (dq,) + dkv_dsink(
        dsp, qdo_st, q_p, do_p, idx_c, _Dims(B, T, H, D, N, W, Hp, Dp, W), kv.dtype, sink, lse,
        dc, idx_shape=idx_c.shape, qdo=config.bwd_qdo, interm="xla", interm_operand="desc",
        interm_stages=4, interm_pipeline=False, narrow_keys=config.bwd_narrow_keys,
        reduce=config.bwd_reduce, block_r=config.bwd_block_r,
        reduce_warps=config.bwd_reduce_warps, interpret_reduce=False)


def checked_backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, config, amd=None):
    """The impl's backward for Config.bwd_win (amd: the device's gfx architecture, refused): a
    concrete idx is checked against the cr0 promise (check_layout: ValueError naming the first
    bad token), a traced one by csa_jax/layouts.py (its broken tokens' gradients NaN)."""
    import jax.numpy as jnp
    from csa_jax import layouts
    from csa_jax.kernels.gluon import check_layout
    if amd:
        raise NotImplementedError(f"bwd_win=True: the window dq kernel is NVIDIA-only (sm_90a "
                                  f"wgmma), not built for {amd}")
    if isinstance(idx, jax.core.Tracer):
        bad = layouts.violations(idx, config.layout, config.window, config.pool_ratio)
    else:
        check_layout(idx, kv.shape[1], config)
        bad = jnp.zeros(idx.shape[:2], bool)
    return backward(q, kv, sink, o, lse, do, dlse, bad, scale=float(scale), config=config)
