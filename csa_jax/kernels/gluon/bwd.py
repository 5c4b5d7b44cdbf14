"""The warp-specialized CSA backward's dq kernel in Gluon (NVIDIA Hopper), and the backward.

dq kernel, one program (CTA) = 64 heads of one token (as the forward, fwd.py):

- producer partition (4 warps): copies dO [64, D] into rows 64..127 of a [128, D] shared buffer,
  then runs the forward's producer (fwd._producer: q into rows 0..63, then the token's kv tiles
  of BK rows gathered with cp.async into the STAGES-deep mbarrier ring, -1 slots zero-filled).
- default partition, 8 warps = 2 consumer warpgroups, per tile:
  1. one wgmma [q; dO] kv^T -> [128, BK] f32 (warps_per_cta [8, 1]: warpgroup 0 computes the
     scores S of its 64 heads, warpgroup 1 dP = dO kv^T, each with the full N = BK, so the
     resident operand is read once per tile, not once per column half);
  2. S and dP meet through a small f32 shared buffer and are read back in one blocked layout
     over all 8 warps: p = exp2(S * scale * log2e - lse * log2e) on valid slots (0 on empty),
     dS = p * (dP + dlse - delta) (csa_spec.md section 3 with the lse cotangent);
  3. scale * dS and p go to dsp [B*T, 2, Hp, Kp] (q's dtype, 16-byte coalesced stores) for the
     per-slot intermediate GEMM; dS (q's dtype) goes to shared memory;
  4. dq[:, half] += dS kv[:, half] on wgmma (warps_per_cta [4, 2]: each warpgroup owns half of
     dq's columns, 64 x 256 f32 at D = 512), A = dS from shared memory, B = the ring tile;
  5. the stage is released (fwd._release). Tiles past the token's last non-empty one are not
     walked; their dsp columns are written as zeros. dq = scale * acc in q's dtype.

Config.bwd_pair (_dq_pair_producer / _dq_pair_consumer): q and dO rows interleaved by 8 in the
resident buffer, so the score product's accumulator holds S and dP of a (head, slot) in one
thread and the exchange of step 2 goes away (_split_sd); bwd_alt.py is the alternating schedule on
the same layout. Config.bwd_fuse_delta: the consumers form delta from o and dO (_load_dc).

dkv stays deterministic: interm[t] = [scale*dS; P]^T [q; dO], one batched GEMM per token in XLA,
then a CSR inverse-map gather-reduce kernel (no atomics; empty slots have no inverse-map entry):
the Pallas Triton impl's, or the Gluon one of dkv.py (Config.bwd_reduce). With Config.bwd_qdo the
dq kernel also copies its resident [q; dO] out (the GEMM's operand, no XLA stack) and lays dsp
out head block first to match. Config.bwd_dq_operand picks how the dq product takes the kv tile
(the transposed-operand ablation, _dq_product). dsink = sum_t exp(sink - lse) (dlse - delta) is
an XLA reduction, delta = sum(o * dO) too unless fused.
"""
from __future__ import annotations

import functools

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma)

from csa_jax.kernels.gluon.dims import HB, SMEM_LIMIT, padded_dims
from csa_jax.kernels.gluon.dims import dq_shared_bytes as shared_bytes
from csa_jax.kernels.gluon.regtrans import strided_layout, swap01, transpose_load
from csa_jax.kernels.gluon.fwd import (
    CONSUMER_WARPS, LOG2E, PRODUCER_WARPS, _next_ids, _producer, _program, _release,
    _wait_tile)

__all__ = ["csa_dq_kernel", "arg_types", "constexprs", "backward", "shared_bytes", "SMEM_LIMIT"]
_LOG2E = gl.constexpr(LOG2E)


@gluon.jit
def _dq_producer(q_ptr, do_ptr, kv_ptr, idx_ptr, qdo_smem, ring, full, consumed, q_bar, do_bar,
                 row, b, ntiles, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
                 PREFETCH: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, layout))
    do_ptrs = do_ptr + (row * HBC + hrows).to(gl.int64)[:, None] * D + cols[None, :]
    async_copy.async_copy_global_to_shared(qdo_smem.slice(HBC, HBC), do_ptrs)
    async_copy.mbarrier_arrive(do_bar, increment_count=False)
    # q into rows 0..HBC-1, then the kv ring: exactly the forward's producer (its row-id prefetch
    # is Config.bwd_prefetch here, off by default: the dq kernel was timed without it).
    _producer(q_ptr, kv_ptr, idx_ptr, qdo_smem.slice(0, HBC), ring, full, consumed, q_bar, row,
              b, ntiles, N, D, K, BK, STAGES, HBC, PREFETCH)


@gluon.jit
def _qdo_row(r, HBC: gl.constexpr, PAIR: gl.constexpr):
    """(plane, head) of row r of the resident [q; dO] buffer: plane 0 = q, 1 = dO. Stacked
    (PAIR False): rows 0..HBC-1 = q, then dO. Paired: 8-row groups alternate, row 16a + 8c + j =
    plane c, head 8a + j, so that S and dP of one (head, slot) land in the same thread's
    wgmma accumulator registers (rows r and r + 8 of an m64 fragment)."""
    if PAIR:
        return (r // 8) % 2, (r // 16) * 8 + r % 8
    else:
        return r // HBC, r % HBC


@gluon.jit
def _dq_pair_producer(q_ptr, do_ptr, kv_ptr, idx_ptr, qdo_smem, ring, full, consumed, q_bar,
                      row, b, ntiles, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
                      BK: gl.constexpr, STAGES: gl.constexpr, HBC: gl.constexpr,
                      ABLATE: gl.constexpr = 0):
    """Config.bwd_pair's producer: q and dO rows interleaved into [q; dO] (_qdo_row) by one
    cp.async pass, then the kv ring as fwd._producer's (row ids loaded per tile; ABLATE:
    _kv_ring's)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    r = gl.arange(0, 2 * HBC, layout=gl.SliceLayout(1, layout))
    plane, head = _qdo_row(r, HBC, True)
    off = (row * HBC + head).to(gl.int64)[:, None] * D + cols[None, :]
    src = gl.where((plane == 0)[:, None], q_ptr + off, do_ptr + off)
    async_copy.async_copy_global_to_shared(qdo_smem, src)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    _kv_ring(kv_ptr, idx_ptr, ring, full, consumed, b, ntiles, N, D, K, BK, STAGES, ABLATE)


@gluon.jit
def _kv_ring(kv_ptr, idx_ptr, ring, full, consumed, b, ntiles, N: gl.constexpr,
             D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
             ABLATE: gl.constexpr = 0):
    """The paired producers' kv ring: tile i's BK rows gathered with cp.async into stage
    i % STAGES once its previous tile was consumed (row ids loaded per tile, -1 zero-filled).
    ABLATE (Config.bwd_ablate, BENCHMARK ONLY: the consumers then compute on stale stages):
    5 = no gathers (the row ids still loaded, kept live by a store back to where they came
    from under a predicate that is never true for sanitized ids >= -1), 6 = no row-id loads
    either; both still wait for `consumed` and arrive on `full`, so the pipeline runs."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    krows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    for i in range(ntiles):
        s = i % STAGES
        if ABLATE != 6:
            ids = gl.load(idx_ptr + i * BK + krows)
            valid = ids >= 0
            ptrs = kv_base + gl.where(valid, ids, 0).to(gl.int64)[:, None] * D + cols[None, :]
        if i >= STAGES:
            mbarrier.wait(consumed.index(s), ((i // STAGES) - 1) & 1)
        if ABLATE == 0:
            async_copy.async_copy_global_to_shared(ring.index(s), ptrs, mask=valid[:, None])
        elif ABLATE == 5:
            gl.store(idx_ptr + i * BK + krows, ids, mask=ids < -1)
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _store_qdo(qdo_ptr, qdo_smem, row, D: gl.constexpr, HBC: gl.constexpr,
               PAIR: gl.constexpr, J0: gl.constexpr, NJ: gl.constexpr):
    """Copy this program's resident [q; dO] [2*HBC, D] from shared memory to qdo[row] (the
    interm GEMM's operand, in place of XLA's stack; q's rows then dO's, whatever the buffer's
    row order, _qdo_row), 32 rows at a time (chunks J0 .. J0+NJ-1 of the buffer), 16-byte
    stores."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    base = qdo_ptr + row.to(gl.int64) * (2 * HBC * D)
    for j in gl.static_range(J0, J0 + NJ):
        v = qdo_smem.slice(32 * j, 32).load(blk)
        plane, head = _qdo_row(32 * j + r, HBC, PAIR)
        gl.store(base + (plane * HBC + head)[:, None] * D + c[None, :], v)


@gluon.jit
def _dq_product(tile, ds_smem, acc, D: gl.constexpr, BK: gl.constexpr, DQ_OP: gl.constexpr):
    """dq += dS kv for one tile, the kv tile taken one of five ways (Config.bwd_dq_operand):
    0 "desc":       dq += dS kv, the tile [BK, D] as B through an MN-major ("transposed")
                    shared-memory descriptor (the timed default);
    then dq^T += kv^T dS^T with dS^T (K-major descriptor) as B and kv^T [D, BK] as A:
    1 "desc_a":     A from shared memory through an MN-major descriptor;
    2 "ldsm_trans": A in registers, loaded with ldmatrix .trans (the transpose-load);
    3 "movmatrix":  A in registers, loaded with plain ldmatrix and transposed in registers
                    (regtrans.transpose_load: PTX movmatrix, no shared-memory round trip);
    4 "strided":    A in registers by plain 2-byte shared loads in transposed (strided)
                    order, no ldmatrix (regtrans.strided_layout: a_dot with two lane bases
                    of D exchanged; the rows swapped back by renaming, so acc holds dq^T's
                    rows in swap01 order, undone in _store_dq)."""
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    if DQ_OP == 0:
        acc = warpgroup_mma(ds_smem, tile, acc)
    elif DQ_OP == 1:
        acc = warpgroup_mma(tile.permute((1, 0)), ds_smem.permute((1, 0)), acc)
    elif DQ_OP == 2:
        acc = warpgroup_mma(tile.permute((1, 0)).load(a_dot), ds_smem.permute((1, 0)), acc)
    elif DQ_OP == 3:
        acc = warpgroup_mma(transpose_load(tile, a_dot, D, BK), ds_smem.permute((1, 0)), acc)
    else:
        a = tile.permute((1, 0)).load(strided_layout(gl.to_linear_layout(a_dot, [D, BK])))
        a = gl.convert_layout(swap01(a, D, BK, 0), a_dot)
        acc = warpgroup_mma(a, ds_smem.permute((1, 0)), acc)
    return acc


@gluon.jit
def _dsp_ptrs(dsp_ptr, tok, hb, hrows, kcols, HP: gl.constexpr, K: gl.constexpr,
              HBC: gl.constexpr, QDO: gl.constexpr):
    """(scale*dS pointers, P pointers) of tile 0 at (hrows, kcols): dsp [B*T, 2, HP, K], this
    program's heads hb*HBC.., plane 0 = scale*dS, plane 1 = P; with QDO [B*T, NHB, 2, HBC, K]
    (head block outermost, as the qdo rows the kernel writes)."""
    if QDO:
        ds_ptrs = (dsp_ptr + tok.to(gl.int64) * (2 * HP * K) + hb.to(gl.int64) * (2 * HBC * K)
                   + hrows.to(gl.int64)[:, None] * K + kcols[None, :])
        p_ptrs = ds_ptrs + HBC * K
    else:
        ds_ptrs = (dsp_ptr + tok.to(gl.int64) * (2 * HP * K)
                   + (hb * HBC + hrows).to(gl.int64)[:, None] * K + kcols[None, :])
        p_ptrs = ds_ptrs + HP * K
    return ds_ptrs, p_ptrs


@gluon.jit
def _store_dq(dq_ptr, acc, row, D: gl.constexpr, HBC: gl.constexpr, SCALE: gl.constexpr,
              DQ_OP: gl.constexpr):
    """dq = scale * acc in dq's dtype, straight from the accumulator layout (acc = dq^T for
    the kv-as-A operand modes: element (d, h) goes to dq[h, d])."""
    if DQ_OP == 4:
        acc = swap01(acc, D, HBC, 0)            # _dq_product's "strided" row order
    acc_layout: gl.constexpr = acc.type.layout
    if DQ_OP == 0:
        orows = gl.arange(0, HBC, layout=gl.SliceLayout(1, acc_layout))
        ocols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        dq_ptrs = dq_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :]
    else:
        dcols = gl.arange(0, D, layout=gl.SliceLayout(1, acc_layout))
        hcols = gl.arange(0, HBC, layout=gl.SliceLayout(0, acc_layout))
        dq_ptrs = dq_ptr + (row * HBC + hcols).to(gl.int64)[None, :] * D + dcols[:, None]
    gl.store(dq_ptrs, (acc * SCALE).to(dq_ptr.dtype.element_ty))


@gluon.jit
def _dq_acc_layout(D: gl.constexpr, HBC: gl.constexpr, DQ_OP: gl.constexpr):
    """The zero accumulator of the dq product: dq [HBC, D] += dS kv with each
    warpgroup owning half of dq's columns (DQ_OP 0), or dq^T [D, HBC] += kv^T dS^T (the kv
    tile as the transposed A operand)."""
    if DQ_OP == 0:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
        acc = gl.zeros([HBC, D], gl.float32, acc_layout)
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HBC, 16])
        acc = gl.zeros([D, HBC], gl.float32, acc_layout)
    return acc


@gluon.jit
def _split_sd(sd, HBC: gl.constexpr, BK: gl.constexpr):
    """(S, dP) [HBC, BK] of the paired [q; dO] kv^T accumulator [2*HBC, BK] (rows as _qdo_row):
    a register-only regrouping (reshape, permute, split of the register bit that selects rows
    r / r + 8 of each m64 fragment; no shared memory, no barrier)."""
    x = sd.reshape([HBC // 8, 2, 8, BK]).permute((0, 2, 3, 1)).reshape([HBC, BK, 2])
    return gl.split(x)


@gluon.jit
def _load_dc(dc_ptr, fz, row, hrows, D: gl.constexpr, HBC: gl.constexpr, FUSE: gl.constexpr):
    """dlse - delta of this program's HBC heads at hrows (any layout). Without FUSE dc_ptr
    holds it (XLA formed delta = sum(o * dO)); with FUSE (Config.bwd_fuse_delta) dc_ptr holds
    dlse and the kernel forms delta itself from o and dO (fz = (o_ptr, do_ptr, dcout_ptr);
    16-row chunks, 16-byte loads issued before the consumers wait for the producer's copies),
    writes dc to dcout (for XLA's dsink) and reads it back in hrows' layout after a partition
    barrier (global writes of the CTA are visible to it after bar.sync)."""
    if FUSE:
        o_ptr, do_ptr, dcout_ptr = fz
        CH: gl.constexpr = 16
        TC: gl.constexpr = 32 if D >= 256 else D // 8
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [gl.num_warps(), 1],
                                             [1, 0])
        r = gl.arange(0, CH, layout=gl.SliceLayout(1, blk))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        for k in gl.static_range(HBC // CH):
            rows = row * HBC + k * CH + r
            off = rows.to(gl.int64)[:, None] * D + c[None, :]
            o = gl.load(o_ptr + off).to(gl.float32)
            d = gl.load(do_ptr + off).to(gl.float32)
            gl.store(dcout_ptr + rows, gl.load(dc_ptr + rows) - gl.sum(o * d, axis=1))
        gl.thread_barrier()
        return gl.load(dcout_ptr + row * HBC + hrows)
    else:
        return gl.load(dc_ptr + row * HBC + hrows)


@gluon.jit
def _row_operands(lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, hrows, kcols, D: gl.constexpr,
                  K: gl.constexpr, HP: gl.constexpr, HBC: gl.constexpr, QDO: gl.constexpr,
                  FUSE: gl.constexpr):
    """(lse * log2e, dlse - delta, scale*dS pointers, P pointers) of this program's heads at
    (hrows, kcols), in their layout: what every dq kernel's tile loop reads per row."""
    lse2 = gl.load(lse_ptr + row * HBC + hrows) * _LOG2E       # exp2 domain
    dc = _load_dc(dc_ptr, fz, row, hrows, D, HBC, FUSE)        # dlse - delta
    ds_ptrs, p_ptrs = _dsp_ptrs(dsp_ptr, tok, hb, hrows, kcols, HP, K, HBC, QDO)
    return lse2, dc, ds_ptrs, p_ptrs


@gluon.jit
def _dsp_zeros(ds_ptrs, p_ptrs, start, STEP: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
               HBC: gl.constexpr):
    """Exact zeros in dsp's tiles start, start + STEP, .. < K / BK (past the last non-empty)."""
    ew: gl.constexpr = ds_ptrs.type.layout
    zero = gl.zeros([HBC, BK], ds_ptrs.dtype.element_ty, ew)
    for i in range(start, K // BK, STEP):
        gl.store(ds_ptrs + i * BK, zero)
        gl.store(p_ptrs + i * BK, zero)


@gluon.jit
def _p_ds(sc, dp, ids, lse2, dc, QK_SCALE: gl.constexpr):
    """p = exp(S * scale - lse) on valid slots (0 on empty ones), dS = p (dP + dlse - delta)."""
    valid = (ids >= 0)[None, :]
    p = gl.where(valid, gl.exp2(sc * QK_SCALE - lse2[:, None]), 0.0)
    return p, p * (dp + dc[:, None])


@gluon.jit
def _store_dsp(ds_ptrs, p_ptrs, i, ds, p, BK: gl.constexpr, SCALE: gl.constexpr):
    """Tile i's columns of dsp: scale * dS and P in dsp's dtype."""
    dt: gl.constexpr = ds_ptrs.dtype.element_ty
    gl.store(ds_ptrs + i * BK, (ds * SCALE).to(dt))
    gl.store(p_ptrs + i * BK, p.to(dt))


@gluon.jit
def _pair_rows(WARPS: gl.constexpr, lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb,
               D: gl.constexpr, K: gl.constexpr, HP: gl.constexpr, BK: gl.constexpr,
               HBC: gl.constexpr, QDO: gl.constexpr, FUSE: gl.constexpr):
    """The paired kernels' element-wise operands (this file's, bwd_alt.py's): (zero score
    accumulator [2*HBC, BK] of a wgmma over WARPS warps (8 here, 4: one warpgroup), slot
    columns, then _row_operands) in the layout _split_sd gives S and dP."""
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BK, 16])
    sd_zero = gl.zeros([2 * HBC, BK], gl.float32, sd_layout)
    sc0, dp0 = _split_sd(sd_zero, HBC, BK)
    ew: gl.constexpr = sc0.type.layout
    hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, ew))
    kcols = gl.arange(0, BK, layout=gl.SliceLayout(0, ew))
    lse2, dc, ds_ptrs, p_ptrs = _row_operands(lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, hrows,
                                              kcols, D, K, HP, HBC, QDO, FUSE)
    return sd_zero, kcols, lse2, dc, ds_ptrs, p_ptrs


@gluon.jit
def _dq_pair_consumer(idx_ptr, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, ring,
                      full, consumed, q_bar, ds_smem, row, tok, hb, ntiles, D: gl.constexpr,
                      K: gl.constexpr, HP: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, HBC: gl.constexpr, QK_SCALE: gl.constexpr,
                      SCALE: gl.constexpr, QDO: gl.constexpr, DQ_OP: gl.constexpr,
                      FUSE: gl.constexpr):
    """Config.bwd_pair's consumers: as _dq_consumer, but the score product's accumulator holds
    S and dP of the same (head, slot) in one thread (the paired [q; dO] rows), so p and dS are
    formed in registers without the f32 S/dP exchange through shared memory and its barrier;
    the dsp stores go out from that layout (4-byte stores)."""
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    sd_zero, kcols, lse2, dc, ds_ptrs, p_ptrs = _pair_rows(
        8, lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, D, K, HP, BK, HBC, QDO, FUSE)
    acc = _dq_acc_layout(D, HBC, DQ_OP)
    mbarrier.wait(q_bar, 0)
    if QDO:
        _store_qdo(qdo_ptr, qdo_smem, row, D, HBC, True, 0, 2 * HBC // 32)
    for i in range(ntiles):
        s, tile = _wait_tile(ring, full, i, STAGES)
        ids = gl.load(idx_ptr + i * BK + kcols)    # (under the score product's wait)
        sd = warpgroup_mma(qdo_smem, tile.permute((1, 0)), sd_zero, use_acc=False)
        sc, dp = _split_sd(sd, HBC, BK)
        p, ds = _p_ds(sc, dp, ids, lse2, dc, QK_SCALE)
        _store_dsp(ds_ptrs, p_ptrs, i, ds, p, BK, SCALE)
        ds_smem.store(ds.to(dt))
        fence_async_shared()          # generic-proxy stores -> wgmma reads
        gl.thread_barrier()
        acc = _dq_product(tile, ds_smem, acc, D, BK, DQ_OP)
        _release(consumed.index(s))
    _dsp_zeros(ds_ptrs, p_ptrs, ntiles, 1, K, BK, HBC)
    _store_dq(dq_ptr, acc, row, D, HBC, SCALE, DQ_OP)


@gluon.jit
def _dq_consumer(idx_ptr, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem, ring, full,
                 consumed, q_bar, do_bar, sd_smem, ds_smem, row, tok, hb, ntiles,
                 D: gl.constexpr, K: gl.constexpr, HP: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr, HBC: gl.constexpr, EW_C: gl.constexpr,
                 QK_SCALE: gl.constexpr, SCALE: gl.constexpr, PREFETCH: gl.constexpr,
                 ABLATE: gl.constexpr, QDO: gl.constexpr, DQ_OP: gl.constexpr,
                 FUSE: gl.constexpr):
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BK, 16])
    # Element-wise layout of one [HBC, BK] tile over the 8 warps: EW_C consecutive slots per
    # thread (16-byte stores of the bf16 dsp rows).
    ew: gl.constexpr = gl.BlockedLayout([1, EW_C], [32 // (BK // EW_C), BK // EW_C],
                                        [gl.num_warps(), 1], [1, 0])
    erow: gl.constexpr = gl.SliceLayout(1, ew)
    ecol: gl.constexpr = gl.SliceLayout(0, ew)
    dt: gl.constexpr = dsp_ptr.dtype.element_ty

    hrows = gl.arange(0, HBC, layout=erow)
    kcols = gl.arange(0, BK, layout=ecol)
    lse2, dc, ds_ptrs, p_ptrs = _row_operands(lse_ptr, dc_ptr, fz, dsp_ptr, row, tok, hb, hrows,
                                              kcols, D, K, HP, HBC, QDO, FUSE)
    sd_zero = gl.zeros([2 * HBC, BK], gl.float32, sd_layout)
    acc = _dq_acc_layout(D, HBC, DQ_OP)
    ids_next = gl.load(idx_ptr + kcols)                 # tile 0's ids (K >= BK), PREFETCH only
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(do_bar, 0)
    if QDO:
        _store_qdo(qdo_ptr, qdo_smem, row, D, HBC, False, 0, 2 * HBC // 32)
    for i in range(ntiles):
        s, tile = _wait_tile(ring, full, i, STAGES)
        if ABLATE == 4:               # benchmark only: no compute, the producer's pace
            _release(consumed.index(s))
        else:
            if ABLATE == 3:
                sd = sd_zero
            else:
                sd = warpgroup_mma(qdo_smem, tile.permute((1, 0)), sd_zero, use_acc=False)
            sd_smem.store(sd)
            gl.thread_barrier()
            sc = sd_smem.slice(0, HBC).load(ew)
            dp = sd_smem.slice(HBC, HBC).load(ew)
            ids, ids_next = _next_ids(idx_ptr, ids_next, i, kcols, K, BK, PREFETCH)
            p, ds = _p_ds(sc, dp, ids, lse2, dc, QK_SCALE)
            if ABLATE != 1:
                _store_dsp(ds_ptrs, p_ptrs, i, ds, p, BK, SCALE)
            ds_smem.store(ds.to(dt))
            fence_async_shared()      # generic-proxy stores -> wgmma reads
            gl.thread_barrier()
            if ABLATE != 2:
                acc = _dq_product(tile, ds_smem, acc, D, BK, DQ_OP)
            _release(consumed.index(s))
    if ABLATE != 1:
        _dsp_zeros(ds_ptrs, p_ptrs, ntiles, 1, K, BK, HBC)
    _store_dq(dq_ptr, acc, row, D, HBC, SCALE, DQ_OP)


# Config.bwd_pipeline's consumers and its bwd_qdo_regs kernel (bwd_pipe.py uses the helpers
# above).
from csa_jax.kernels.gluon.bwd_pipe import _dq_pipe_consumer  # noqa: E402
from csa_jax.kernels.gluon.bwd_pipe import csa_dq_blk_kernel as _dq_blk_kernel  # noqa: E402


@gluon.jit
def csa_dq_kernel(q_ptr, do_ptr, kv_ptr, idx_ptr, ntiles_ptr, lse_ptr, dc_ptr, o_ptr, dq_ptr,
                  dsp_ptr, qdo_ptr, dcout_ptr, T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
                  K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, EW_C: gl.constexpr,
                  QK_SCALE: gl.constexpr, SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                  PREFETCH: gl.constexpr, ABLATE: gl.constexpr, QDO: gl.constexpr,
                  DQ_OP: gl.constexpr, PAIR: gl.constexpr, FUSE: gl.constexpr,
                  PIPE: gl.constexpr, AREG: gl.constexpr, AHEAD: gl.constexpr):
    row, tok, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    qdo_smem = gl.allocate_shared_memory(
        dtype, [2 * HBC, D], gl.NVMMASharedLayout.get_default_for([2 * HBC, D], dtype))
    ring = gl.allocate_shared_memory(
        dtype, [STAGES, BK, D], gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    if not PAIR:
        # 16-byte units XOR-swizzled by row: gl.bank_conflicts gives 1 for the accumulator-
        # layout stores and 0 (BK = 32) / 1 (BK = 64) for the element-wise loads (3 and 1
        # unswizzled). Config.bwd_pair needs no such exchange.
        sd_smem = gl.allocate_shared_memory(gl.float32, [2 * HBC, BK],
                                            gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
    ds_smem = gl.allocate_shared_memory(
        dtype, [HBC, BK], gl.NVMMASharedLayout.get_default_for([HBC, BK], dtype))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    if not PAIR:
        do_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(do_bar, count=PRODUCER_WARPS * 32)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=1)
    fz = (o_ptr, do_ptr, dcout_ptr)    # Config.bwd_fuse_delta's operands (FUSE only)
    if PIPE:    # Config.bwd_pipeline (bwd_pipe.py; paired rows)
        gl.warp_specialize([
            (_dq_pipe_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr,
                                 qdo_smem, ring, full, consumed, q_bar, ds_smem, row, tok, hb,
                                 ntiles, D, K, NHB * HBC, BK, STAGES, HBC, QK_SCALE, SCALE, QDO,
                                 FUSE, False, False)),
            (_dq_pair_producer, (q_ptr, do_ptr, kv_ptr, idx_tok, qdo_smem, ring, full, consumed,
                                 q_bar, row, b, ntiles, N, D, K, BK, STAGES, HBC)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
    elif PAIR:
        gl.warp_specialize([
            (_dq_pair_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr,
                                 qdo_smem, ring, full, consumed, q_bar, ds_smem, row, tok, hb,
                                 ntiles, D, K, NHB * HBC, BK, STAGES, HBC, QK_SCALE, SCALE, QDO,
                                 DQ_OP, FUSE)),
            (_dq_pair_producer, (q_ptr, do_ptr, kv_ptr, idx_tok, qdo_smem, ring, full, consumed,
                                 q_bar, row, b, ntiles, N, D, K, BK, STAGES, HBC, ABLATE)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_dq_consumer, (idx_tok, lse_ptr, dc_ptr, fz, dq_ptr, dsp_ptr, qdo_ptr, qdo_smem,
                            ring, full, consumed, q_bar, do_bar, sd_smem, ds_smem, row, tok, hb,
                            ntiles, D, K, NHB * HBC, BK, STAGES, HBC, EW_C, QK_SCALE, SCALE,
                            PREFETCH, ABLATE, QDO, DQ_OP, FUSE)),
            (_dq_producer, (q_ptr, do_ptr, kv_ptr, idx_tok, qdo_smem, ring, full, consumed,
                            q_bar, do_bar, row, b, ntiles, N, D, K, BK, STAGES, HBC, PREFETCH)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side

# q, dO, kv, idx, ntiles, lse, dc (dlse with FUSE), o | dq, dsp, qdo, dcout
ARG_TYPES = ("*{dt}", "*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*fp32", "*{dt}", "*{dt}",
             "*{dt}", "*{dt}", "*fp32")


def arg_types(dt="bf16"):
    return [a.format(dt=dt) for a in ARG_TYPES]


def ew_cols(bk):
    """Slots per thread in the element-wise layout (the 8 warps cover 64 rows x bk exactly)."""
    return 8 if bk >= 32 else 4


DQ_OPERANDS = ("desc", "desc_a", "ldsm_trans", "movmatrix", "strided")  # Config.bwd_dq_operand


def constexprs(*, T, N, NHB, D, K, BK, stages, scale, producer_regs, prefetch=False, ablate=0,
               qdo=False, dq_operand="desc", pair=False, fuse_delta=False, pipeline=False,
               qdo_regs=0, scores_ahead=False):
    """The dq kernel's compile-time parameters (also used by the CPU compile checks)."""
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages, EW_C=ew_cols(BK),
                QK_SCALE=float(scale) * LOG2E, SCALE=float(scale), PRODUCER_REGS=producer_regs,
                PREFETCH=bool(prefetch), ABLATE=int(ablate), QDO=bool(qdo),
                DQ_OP=DQ_OPERANDS.index(dq_operand), PAIR=bool(pair), FUSE=bool(fuse_delta),
                PIPE=bool(pipeline) and bool(pair), AREG=int(qdo_regs),
                AHEAD=bool(scores_ahead))


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "stages", "producer_regs",
                                             "prefetch", "ablate", "qdo", "dq_operand", "pair",
                                             "fuse_delta", "dq_pipeline", "qdo_regs",
                                             "scores_ahead",
                                             "schedule",
                                             "alt_regs", "alt_order",
                                             "interm", "interm_operand", "interm_stages",
                                             "interm_pipeline",
                                             "narrow_keys",
                                             "reduce", "block_r", "reduce_warps",
                                             "interpret_reduce", "amd"))
def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, block_k, stages, producer_regs,
             prefetch=False, ablate=0, qdo=False, dq_operand="desc", pair=False,
             fuse_delta=False, dq_pipeline=False, qdo_regs=0, scores_ahead=False,
             schedule="lockstep", alt_regs=232,
             alt_order="s_first",
             interm="xla",
             interm_operand="desc", interm_stages=4, interm_pipeline=False, narrow_keys=False,
             reduce="pallas_triton", block_r=0, reduce_warps=0, interpret_reduce=False,
             amd=None):
    """(dq, dkv, dsink): dq by csa_dq_kernel (or bwd_alt's), dkv by the deterministic interm
    GEMM + inverse-map reduce, dsink (and delta, unless fused) in XLA (CUDA only). idx must be
    sanitized (-1 for every empty or out-of-range slot). The keywords are the Config.bwd_*
    fields of the same names (block_k, stages, producer_regs, prefetch, ablate, qdo, dq_operand,
    pair, fuse_delta, schedule, alt_regs, alt_order, interm*, narrow_keys, reduce, block_r,
    reduce_warps; dq_pipeline, qdo_regs, scores_ahead are Config.bwd_pipeline, bwd_qdo_regs,
    bwd_scores_ahead;
    see Config); interpret_reduce runs the Pallas reduce in its interpreter (the CPU test of
    this wrapper, with the dq kernel emulated). amd: a gfx architecture (amd_bwd.DQ_DEFAULTS)
    -> amd_bwd.csa_dq_amd_kernel, same contract, at block_k / stages (producer_regs, prefetch,
    ablate, fuse_delta unused; qdo, pair, dq_operand, schedule and the Gluon interm GEMM are
    NVIDIA-only); NEVER RUN (no AMD GPU)."""
    import jax.numpy as jnp
    from csa_jax.kernels.gluon.adapter import gluon_call
    # The Pallas Triton impl's padding helpers and its dkv path (kernels/triton: plan.py,
    # backward.py), shared rather than copied.
    from csa_jax.kernels.gluon.dkv import dkv_dsink
    from csa_jax.kernels.triton.plan import _Dims, _ntiles, _pad_to, _prep_idx
    f32 = jnp.float32
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    qdo = qdo and interm == "xla"       # the Gluon interm GEMM reads q and dO in place
    # The Gluon interm GEMM walks slots in 128-row tiles: pad K to that (the dq kernel writes
    # exact zeros for the padding; padded slots are -1, in no inverse-map row).
    Hp, Dp, Kp = padded_dims(H, D, K, 128 if interm == "gluon" else block_k)
    alt = schedule == "alternate" and amd is None
    blk = bool(dq_pipeline and pair and qdo_regs) and amd is None    # bwd_pipe's blocked kernel
    if alt:
        from csa_jax.kernels.gluon import bwd_alt
        need = bwd_alt.shared_bytes(padded_dims(H, D, K, block_k)[1], block_k, stages)
    elif blk:
        from csa_jax.kernels.gluon.dims import dq_blk_shared_bytes
        need = dq_blk_shared_bytes(D, block_k, stages)
    else:
        need = shared_bytes(D, block_k, stages, pair=pair)
    if amd is None and need > SMEM_LIMIT:
        raise ValueError(f"dq kernel tiles bwd_block_k={block_k}, bwd_stages={stages} at D={D} "
                         f"need {need} B of shared memory; the H200 has {SMEM_LIMIT} per block")
    d = _Dims(B, T, H, D, N, K, Hp, Dp, Kp)
    pad = _pad_to
    idx_p, used = _prep_idx(idx, d)                 # -1 padding; slots up to the last non-empty
    ntiles = _ntiles(used, block_k).reshape(B * T)
    fuse_delta = fuse_delta and amd is None
    if not fuse_delta:
        delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)             # [B, T, H]
    # Padded heads: q = dO = 0 and lse = dc = 0, so p = 1 on valid slots but dS = 0, p dO = 0.
    q_p = pad(pad(q, 3, Dp), 2, Hp)
    do_p = pad(pad(do, 3, Dp), 2, Hp)
    kv_p = pad(kv, 2, Dp)
    lse_p = pad(lse.astype(f32), 2, Hp).reshape(-1)
    # dlse - delta, or with fuse_delta dlse alone (the kernel subtracts its own delta)
    dc_p = pad(dlse.astype(f32) - (0.0 if fuse_delta else delta), 2, Hp).reshape(-1)
    nhb = Hp // HB
    if amd is None:
        dsp_shape = (B * T, nhb, 2, HB, Kp) if qdo else (B * T, 2, Hp, Kp)
        qdo_shape = (B * T, nhb, 2, HB, Dp) if qdo else (8,)     # (8,): unused, never written
        if alt:
            kernel, warps, name = bwd_alt.csa_dq_alt_kernel, bwd_alt.NUM_WARPS, "csa_gluon_dq_alt"
            consts = bwd_alt.constexprs(T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=block_k,
                                        stages=stages, scale=scale, consumer_regs=alt_regs,
                                        qdo=qdo, fuse_delta=fuse_delta, order=alt_order)
        else:
            kernel, warps, name = csa_dq_kernel, CONSUMER_WARPS, "csa_gluon_dq"
            if blk:
                kernel, name = _dq_blk_kernel, "csa_gluon_dq_blk"
            # scores_ahead's consumers need 232 registers (0 spills): the producer gets 40
            consts = constexprs(T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=block_k, stages=stages,
                                scale=scale, producer_regs=40 if blk and scores_ahead else
                                producer_regs, prefetch=prefetch,
                                ablate=ablate, qdo=qdo, dq_operand=dq_operand, pair=pair,
                                fuse_delta=fuse_delta, pipeline=dq_pipeline,
                                qdo_regs=qdo_regs, scores_ahead=scores_ahead and blk)
        outs = [(B * T * Hp, Dp), dsp_shape, qdo_shape]
        # o (read only with fuse_delta; else dO stands in, never read) and the dcout output
        extra_in = [(pad(pad(o, 3, Dp), 2, Hp) if fuse_delta else do_p).reshape(-1, Dp)]
        extra_out = [jax.ShapeDtypeStruct((B * T * Hp,) if fuse_delta else (8,), f32)]
    else:
        # (fuse_delta: ignored)
        if qdo or pair or interm == "gluon" or dq_operand != "desc" or schedule != "lockstep":
            raise ValueError(f"bwd_qdo={qdo}, bwd_pair={pair}, bwd_interm={interm!r}, "
                             f"bwd_dq_operand={dq_operand!r}, bwd_schedule={schedule!r}: "
                             f"NVIDIA-only options (not on {amd})")
        from csa_jax.kernels.gluon import amd_bwd
        from csa_jax.kernels.gluon.dims import AMD_LDS, amd_lds_bytes
        a = amd_bwd.DQ_DEFAULTS[amd]
        need = amd_lds_bytes(amd, D, block_k, stages, extra_blocks=a["qdo"])
        if need > AMD_LDS[amd] - 8192:
            raise ValueError(f"dq kernel tiles bwd_block_k={block_k}, bwd_stages={stages} at "
                             f"D={D} need {need} B of LDS; {amd} has {AMD_LDS[amd]}")
        from csa_jax.kernels.gluon.amd_fwd import check_buffer_range
        check_buffer_range(N, Dp, q.dtype.itemsize)
        kernel, warps, name = amd_bwd.csa_dq_amd_kernel, a["warps"], "csa_gluon_dq_amd"
        consts = amd_bwd.constexprs(target=amd, T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=block_k,
                                    stages=stages, scale=scale, qdo=a["qdo"])
        outs = [(B * T * Hp, Dp), (B * T, 2, Hp, Kp)]
        extra_in, extra_out = [], []
    dq, dsp, *rest = gluon_call(
        q_p.reshape(B * T * Hp, Dp), do_p.reshape(B * T * Hp, Dp), kv_p.reshape(B * N, Dp),
        idx_p.reshape(B * T, Kp), ntiles, lse_p, dc_p, *extra_in,
        kernel=kernel,
        out_shape=[jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
                   *[jax.ShapeDtypeStruct(s, q.dtype) for s in outs[1:]], *extra_out],
        grid=(B * T * nhb,), num_warps=warps, name=name, **consts)
    qdo_st = rest[0] if rest else None
    if fuse_delta:              # dlse - delta as the kernel formed it, for dsink
        dc = rest[1].reshape(B, T, Hp)[:, :, :H]
    else:
        dc = dlse - delta
    dkv, dsink = dkv_dsink(dsp, qdo_st, q_p, do_p, idx_p, d, kv.dtype, sink, lse, dc,
                           idx_shape=idx.shape, qdo=qdo, interm=interm,
                           interm_operand=interm_operand, interm_stages=interm_stages,
                           interm_pipeline=interm_pipeline, narrow_keys=narrow_keys,
                           reduce=reduce, block_r=block_r, reduce_warps=reduce_warps,
                           interpret_reduce=interpret_reduce)
    return dq.reshape(B, T, Hp, Dp)[:, :, :H, :D], dkv, dsink

