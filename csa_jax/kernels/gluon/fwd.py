"""The warp-specialized CSA forward in Gluon (NVIDIA Hopper): the kernel and its JAX wrapper.

One program (CTA) = 64 heads of one token (H = 128: two programs per token, side by side in
the grid so their repeated gathers hit L2), the structure of FlashMLA's SM90 sparse prefill:

- producer partition, PRODUCER_WARPS = 4 warps (worker registers `Config.producer_regs`): copies
  q [64, D] into shared memory once, then walks the token's slots in tiles of BK = 64 rows and
  gathers each tile's kv rows [BK, D] with 16-byte cp.async (`async_copy_global_to_shared` from a
  pointer tensor, 8 threads per 128-byte row segment) into a STAGES-deep shared-memory ring.
  Empty slots (-1) are masked: zero-filled, never read from global memory. Each producer thread
  arrives on the stage's "full" mbarrier when its copies land (cp.async.mbarrier.arrive.noinc;
  barrier count = producer threads); before refilling a stage it waits on its "consumed" mbarrier.
- default partition, 8 warps = 2 consumer warpgroups: waits on "full", S = q kv^T on wgmma (q and
  the tile both from shared memory, heads as M = 64), the online softmax with the scores' validity
  mask (exp2 domain, finite running max -1e30), O += P kv on wgmma (P from registers, the tile as
  the [BK, D] operand: K and V are the same buffer, read transposed for QK^T and plainly for PV),
  then releases the stage (one arrival on "consumed" after a partition barrier). The accumulator
  layout has warps_per_cta = [4, 2]: warpgroup 0 owns output columns 0..D/2-1 and warpgroup 1 the
  rest (64 x 256 f32 each at D = 512, 128 registers per thread), and each computes half of S's
  columns; the row max/sum and the P exchange between them go through shared memory (compiler).
- the tile loop stops at the token's last non-empty tile (ntiles from idx), so causally empty
  tails cost nothing; lse and o per the contract (csa_spec.md section 3): natural-log lse with the
  sink, EMPTY_LSE for an empty row without sink, o = 0 for an empty row.

Padding (wrapper only): H to a multiple of 64 (padded heads have zero q and no sink; they are
computed and dropped), D to a power of two >= 64 (zero columns change neither scores nor outputs), K to a
multiple of BK with -1. bf16 and f16 inputs; f32 inputs are refused (wgmma would run them as tf32).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from csa_jax.kernels.gluon.dims import HB, padded_dims

PRODUCER_WARPS = gl.constexpr(4)
CONSUMER_WARPS = 8
LOG2E = 1.4426950408889634
NEG = gl.constexpr(-1.0e30)   # finite initial running max, and EMPTY_LSE


# The producer's copy layout: 8 threads cover one 128-byte segment of a row (16 B each),
# 4 rows per warp.
PRODUCER_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS.value, 1],
                                                [1, 0]))


@gluon.jit
def _producer_start(q_ptr, kv_ptr, idx_ptr, q_smem, q_bar, row, b, N: gl.constexpr,
                    D: gl.constexpr, BK: gl.constexpr, HBC: gl.constexpr):
    """A forward producer's preamble (this kernel's and fwd_alt.py's): q [HBC, D] of this
    program (rows row*HBC .. of the [B*T*Hp, D] view) copied into q_smem, arriving on q_bar;
    returns (cols, krows, kv_base, tile 0's ids) for the gather loop."""
    layout: gl.constexpr = PRODUCER_LAYOUT
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    hrows = gl.arange(0, HBC, layout=gl.SliceLayout(1, layout))
    q_ptrs = q_ptr + (row * HBC + hrows).to(gl.int64)[:, None] * D + cols[None, :]
    async_copy.async_copy_global_to_shared(q_smem, q_ptrs)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    krows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    kv_base = kv_ptr + b.to(gl.int64) * (N * D)
    ids = gl.load(idx_ptr + krows)                     # K >= BK: always in bounds
    return cols, krows, kv_base, ids


@gluon.jit
def _producer(q_ptr, kv_ptr, idx_ptr, q_smem, ring, full, consumed, q_bar, row, b, ntiles,
              N: gl.constexpr, D: gl.constexpr, K: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, HBC: gl.constexpr, PREFETCH: gl.constexpr):
    cols, krows, kv_base, ids = _producer_start(q_ptr, kv_ptr, idx_ptr, q_smem, q_bar, row, b,
                                                N, D, BK, HBC)
    for i in range(ntiles):
        s = i % STAGES
        if not PREFETCH:
            ids = gl.load(idx_ptr + i * BK + krows)
        valid = ids >= 0
        safe = gl.where(valid, ids, 0)
        ptrs = kv_base + safe.to(gl.int64)[:, None] * D + cols[None, :]
        if i >= STAGES:
            mbarrier.wait(consumed.index(s), ((i // STAGES) - 1) & 1)
        # (Triton 3.6 drops eviction_policy on cp.async: the PTX carries no L2 cache hint.)
        async_copy.async_copy_global_to_shared(ring.index(s), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)
        if PREFETCH:
            # The next tile's ids load while this stage's copies fly and the next stage drains.
            nxt = (i + 1) * BK + krows
            ids = gl.load(idx_ptr + nxt, mask=nxt < K, other=-1)


@gluon.jit
def _softmax_step(sc, ids, m, l, QK_SCALE: gl.constexpr):
    """One online-softmax step in the exp2 domain: (p, alpha, m_new, l_new)."""
    sc = gl.where((ids >= 0)[None, :], sc * QK_SCALE, float("-inf"))
    m_new = gl.maximum(m, gl.max(sc, axis=1))
    p = gl.exp2(sc - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, alpha, m_new, l * alpha + gl.sum(p, axis=1)


@gluon.jit
def _program(ntiles_ptr, idx_ptr, T: gl.constexpr, NHB: gl.constexpr, K: gl.constexpr):
    """(row, tok, hb, b, ntiles, idx_tok) of this program: program = (b, t, head block), head
    block fastest; `row` indexes the [B*T*NHB] head blocks (rows row*64.. of q / o), idx_tok
    the token's K slots. Shared by every Gluon CSA kernel (fwd, bwd, amd_fwd, amd_bwd)."""
    row = gl.program_id(0)
    tok = row // NHB
    hb = row % NHB
    return row, tok, hb, tok // T, gl.load(ntiles_ptr + tok), idx_ptr + tok.to(gl.int64) * K


@gluon.jit
def _finish(m, l, sink_ptrs):
    """Join the sink (natural-log logits, converted to the exp2 domain) to the running (m, l):
    (lse, o_scale) per csa_spec.md section 3: natural-log lse, EMPTY_LSE (NEG) and o = 0 for an
    empty row without sink. Shared by the NVIDIA and AMD forwards (amd_fwd.py)."""
    sink2 = gl.load(sink_ptrs) * 1.4426950408889634
    m_tot = gl.maximum(m, sink2)
    l_tot = l * gl.exp2(m - m_tot) + gl.exp2(sink2 - m_tot)
    nonempty = l_tot > 0
    safe_l = gl.where(nonempty, l_tot, 1.0)
    lse = gl.where(nonempty, (m_tot + gl.log2(safe_l)) * 0.6931471805599453, NEG)
    return lse, gl.where(nonempty, gl.exp2(m - m_tot) / safe_l, 0.0)


@gluon.jit
def _next_ids(idx_ptr, ids_next, i, kcols, K: gl.constexpr, BK: gl.constexpr,
              PREFETCH: gl.constexpr):
    """(tile i's ids, the prefetched ids of tile i+1); without PREFETCH tile i's ids load now."""
    if PREFETCH:
        ids = ids_next
        nxt = (i + 1) * BK + kcols
        ids_next = gl.load(idx_ptr + nxt, mask=nxt < K, other=-1)
    else:
        ids = gl.load(idx_ptr + i * BK + kcols)
    return ids, ids_next


@gluon.jit
def _release(bar):
    # Every consumer warp is past its reads of the stage, then one arrival.
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _wait_tile(ring, full, i, STAGES: gl.constexpr):
    """(stage, ring tile) of tile i once its copies landed, made visible to wgmma (this
    kernel's consumer loops and bwd.py's)."""
    s = i % STAGES
    mbarrier.wait(full.index(s), (i // STAGES) & 1)
    fence_async_shared()          # cp.async (generic proxy) -> wgmma (async proxy)
    return s, ring.index(s)


@gluon.jit
def _q_and_ring(dtype: gl.constexpr, HBC: gl.constexpr, D: gl.constexpr, BK: gl.constexpr,
                STAGES: gl.constexpr, Q_INDEXED: gl.constexpr):
    """A forward's first shared-memory buffers (this kernel's and fwd_alt.py's, allocated in
    this order): q [HBC, D] ([1, HBC, D] with Q_INDEXED, fwd_alt.py's, read through .index) and
    the kv ring [STAGES, BK, D], in wgmma's default layouts."""
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HBC, D], dtype)
    if Q_INDEXED:
        q_smem = gl.allocate_shared_memory(dtype, [1, HBC, D], q_layout)
    else:
        q_smem = gl.allocate_shared_memory(dtype, [HBC, D], q_layout)
    ring = gl.allocate_shared_memory(dtype, [STAGES, BK, D],
                                     gl.NVMMASharedLayout.get_default_for([BK, D], dtype))
    return q_smem, ring


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The ring's mbarriers, initialized (this kernel's and bwd_pipe.py's blocked dq kernel's,
    allocated in this order): full [STAGES] (the producer's warps arrive when a stage's copies
    landed), consumed [STAGES] (one consumer arrival frees a stage), q_bar (q's copy landed)."""
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=PRODUCER_WARPS * 32)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=1)
    return full, consumed, q_bar


@gluon.jit
def _scaled_o(m, l, acc, sink_ptr, lse_ptr, o_ptr, row, h0, srow: gl.constexpr,
              orow: gl.constexpr, HBC: gl.constexpr, STORE_LSE: gl.constexpr):
    """A forward consumer's epilogue (this kernel's and fwd_alt.py's) up to the o store: the
    sink joined (_finish), lse stored when STORE_LSE, o = acc * o_scale in o's dtype (acc's
    layout; srow: the rows of the (m, l) layout, orow: of acc's)."""
    hrows = gl.arange(0, HBC, layout=srow)
    lse, o_scale = _finish(m, l, sink_ptr + h0 + hrows)
    if STORE_LSE:
        gl.store(lse_ptr + row * HBC + hrows, lse)
    return (acc * gl.convert_layout(o_scale, orow)[:, None]).to(o_ptr.dtype.element_ty)


@gluon.jit
def _store_o(o_ptr, o, row, orows, ocols, D: gl.constexpr, HBC: gl.constexpr):
    """o's rows orows and columns ocols of this program's head block (rows row*HBC.. of the
    [B*T*Hp, D] output)."""
    o_ptrs = o_ptr + (row * HBC + orows).to(gl.int64)[:, None] * D + ocols[None, :]
    gl.store(o_ptrs, o)


@gluon.jit
def _consumer(idx_ptr, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full, consumed, q_bar, row, h0,
              ntiles, D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              HBC: gl.constexpr, QK_SCALE: gl.constexpr, PIPELINE: gl.constexpr,
              SMEM_EPILOGUE: gl.constexpr, ABLATE: gl.constexpr, K: gl.constexpr,
              PREFETCH: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BK // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    scol: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    ocol: gl.constexpr = gl.SliceLayout(0, o_layout)

    m = gl.full([HBC], NEG, gl.float32, srow)
    l = gl.zeros([HBC], gl.float32, srow)
    acc = gl.zeros([HBC, D], gl.float32, o_layout)
    s_zero = gl.zeros([HBC, BK], gl.float32, s_layout)
    kcols = gl.arange(0, BK, layout=scol)
    ids_next = gl.load(idx_ptr + kcols)                # tile 0's ids (K >= BK)
    mbarrier.wait(q_bar, 0)
    if PIPELINE:
        # PV of tile i-1 runs on the tensor cores while tile i's S is issued; both are waited
        # together, then stage i-1 is released and tile i's softmax runs.
        acc = warpgroup_mma_init(acc)
        for i in range(ntiles):
            _, tile = _wait_tile(ring, full, i, STAGES)
            sc = warpgroup_mma(q_smem, tile.permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            ids, ids_next = _next_ids(idx_ptr, ids_next, i, kcols, K, BK, PREFETCH)
            sc, acc = warpgroup_mma_wait(0, deps=[sc, acc])
            if i > 0:
                _release(consumed.index((i - 1) % STAGES))
            p, alpha, m, l = _softmax_step(sc, ids, m, l, QK_SCALE)
            acc = acc * gl.convert_layout(alpha, orow)[:, None]
            pv = gl.convert_layout(p.to(ring.dtype), p_layout)
            acc = warpgroup_mma(pv, tile, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        for i in range(ntiles):
            s, tile = _wait_tile(ring, full, i, STAGES)
            if ABLATE == 4:           # benchmark only: no compute, the producer's pace
                _release(consumed.index(s))
            else:
                ids, ids_next = _next_ids(idx_ptr, ids_next, i, kcols, K, BK, PREFETCH)
                if ABLATE == 2 or ABLATE == 3:
                    sc = s_zero
                else:
                    sc = warpgroup_mma(q_smem, tile.permute((1, 0)), s_zero, use_acc=False)
                p, alpha, m, l = _softmax_step(sc, ids, m, l, QK_SCALE)
                acc = acc * gl.convert_layout(alpha, orow)[:, None]
                pv = gl.convert_layout(p.to(ring.dtype), p_layout)
                if ABLATE != 1 and ABLATE != 3:
                    acc = warpgroup_mma(pv, tile, acc)
                else:
                    acc = acc + gl.convert_layout(gl.sum(p, axis=1), orow)[:, None]
                _release(consumed.index(s))

    o = _scaled_o(m, l, acc, sink_ptr, lse_ptr, o_ptr, row, h0, srow, orow, HBC, True)
    if SMEM_EPILOGUE:
        # q is no longer needed: o goes registers -> q's buffer -> 16-byte coalesced stores.
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        gl.thread_barrier()
        q_smem.store(o)
        gl.thread_barrier()
        o = q_smem.load(st_layout)
        orows = gl.arange(0, HBC, layout=gl.SliceLayout(1, st_layout))
        ocols = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
    else:
        orows = gl.arange(0, HBC, layout=orow)
        ocols = gl.arange(0, D, layout=ocol)
    _store_o(o_ptr, o, row, orows, ocols, D, HBC)


@gluon.jit
def csa_fwd_kernel(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr,
                   T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
                   K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   QK_SCALE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                   PIPELINE: gl.constexpr, SMEM_EPILOGUE: gl.constexpr, ABLATE: gl.constexpr,
                   PREFETCH: gl.constexpr):
    row, tok, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HBC: gl.constexpr = 64
    q_smem, ring = _q_and_ring(dtype, HBC, D, BK, STAGES, False)
    full, consumed, q_bar = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (idx_tok, sink_ptr, o_ptr, lse_ptr, q_smem, ring, full, consumed, q_bar,
                     row, hb * HBC, ntiles, D, BK, STAGES, HBC, QK_SCALE, PIPELINE,
                     SMEM_EPILOGUE, ABLATE, K, PREFETCH)),
        (_producer, (q_ptr, kv_ptr, idx_tok, q_smem, ring, full, consumed, q_bar, row, b,
                     ntiles, N, D, K, BK, STAGES, HBC, PREFETCH)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def constexprs(*, T, N, NHB, D, K, BK, stages, scale, producer_regs, pipeline=False,
               smem_epilogue=False, ablate=0, prefetch=True):
    """The kernel's compile-time parameters (also used by the CPU compile checks)."""
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, PRODUCER_REGS=producer_regs,
                PIPELINE=bool(pipeline), SMEM_EPILOGUE=bool(smem_epilogue), ABLATE=int(ablate),
                PREFETCH=bool(prefetch))


ARG_TYPES = ("*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*{dt}", "*fp32")


def arg_types(dt="bf16"):
    return [a.format(dt=dt) for a in ARG_TYPES]


def prepare(q, kv, idx, sink, bk):
    """The padded operands of a forward kernel (this one and amd_fwd.py's) and its dims:
    (q [B*T*Hp, Dp], kv [B*N, Dp], idx [B*T, Kp] (-1 padding), ntiles [B*T], sink [Hp] (-inf
    padding), (B, T, H, D, N, Hp, Dp, Kp, NHB)). ntiles = tiles up to the last non-empty slot."""
    import jax.numpy as jnp
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    Hp, Dp, Kp = padded_dims(H, D, K, bk)
    pad = lambda x, axis, size, v=0: x if x.shape[axis] == size else jnp.pad(
        x, [(0, size - x.shape[a]) if a == axis else (0, 0) for a in range(x.ndim)],
        constant_values=v)
    idx_p = pad(idx, 2, Kp, -1)
    j = jnp.arange(Kp, dtype=jnp.int32)
    used = jnp.max(jnp.where(idx_p >= 0, j, -1), axis=2) + 1
    ntiles = ((used + bk - 1) // bk).astype(jnp.int32).reshape(B * T)
    q_p = pad(pad(q, 3, Dp), 2, Hp).reshape(B * T * Hp, Dp)
    kv_p = pad(kv, 2, Dp).reshape(B * N, Dp)
    sink_p = pad(sink.astype(jnp.float32), 0, Hp, -jnp.inf)
    return (q_p, kv_p, idx_p.reshape(B * T, Kp), ntiles, sink_p,
            (B, T, H, D, N, Hp, Dp, Kp, Hp // HB))


def out_shapes(q, dims):
    import jax
    import jax.numpy as jnp
    B, T, _, _, _, Hp, Dp, _, _ = dims
    return [jax.ShapeDtypeStruct((B * T * Hp, Dp), q.dtype),
            jax.ShapeDtypeStruct((B * T * Hp,), jnp.float32)]


def unpad(o, lse, dims):
    """o [B, T, H, D], lse [B, T, H] from the kernel's padded outputs."""
    B, T, H, D, _, Hp, Dp, _, _ = dims
    return o.reshape(B, T, Hp, Dp)[:, :, :H, :D], lse.reshape(B, T, Hp)[:, :, :H]


def forward(q, kv, idx, sink, *, scale, config):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 through csa_fwd_kernel, or fwd_alt's
    csa_fwd_alt_kernel for Config.schedule "alternate" (CUDA only)."""
    from csa_jax.kernels.gluon.adapter import gluon_call
    bk = config.block_k
    q_p, kv_p, idx_p, ntiles, sink_p, dims = prepare(q, kv, idx, sink, bk)
    B, T, H, D, N, Hp, Dp, Kp, nhb = dims
    common = dict(T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=bk, stages=config.stages, scale=scale,
                  prefetch=config.prefetch)
    if config.resolved_schedule == "alternate":
        from csa_jax.kernels.gluon import fwd_alt
        kernel, warps, consts = (fwd_alt.csa_fwd_alt_kernel, fwd_alt.NUM_WARPS,
                                 fwd_alt.config_constexprs(config, **common))
    else:
        kernel, warps = csa_fwd_kernel, CONSUMER_WARPS
        consts = constexprs(**common, producer_regs=config.producer_regs,
                            pipeline=config.pipeline, smem_epilogue=config.smem_epilogue,
                            ablate=config.ablate)
    o, lse = gluon_call(q_p, kv_p, idx_p, ntiles, sink_p, kernel=kernel,
                        out_shape=out_shapes(q, dims), grid=(B * T * nhb,), num_warps=warps,
                        name="csa_gluon_fwd", **consts)
    return unpad(o, lse, dims)
