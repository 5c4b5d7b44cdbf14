"""A small warp-specialized Gluon kernel that proves the adapter end to end: a row-gather ring.

Program p gathers `ntiles` tiles of BK rows of a [N, D] table (row ids from idx [P, ntiles*BK],
-1 = empty row, read as zeros) into a 2-stage shared-memory ring. A 4-warp producer partition
issues the cp.async copies and arrives on the stage's "full" mbarrier when they land
(`mbarrier_arrive(increment_count=False)`: one arrival per producer thread); the default partition
(the consumer) waits on "full", reads the tile into registers, writes it out and arrives on the
stage's "consumed" mbarrier, which the producer waits on before it refills that stage. The output
out[p, i*BK + r] = table[idx[p, i*BK + r]] (or 0) is an exact gather: any ring bug shows.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.language.nvidia.ampere import async_copy

PRODUCER_WARPS = gl.constexpr(4)


@gluon.jit
def _ring_producer(table_ptr, idx_ptr, ring, full, consumed, pid,
                   NT: gl.constexpr, BK: gl.constexpr, D: gl.constexpr,
                   STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    for i in range(NT):
        s = i % STAGES
        if i >= STAGES:
            mbarrier.wait(consumed.index(s), ((i // STAGES) - 1) & 1)
        ids = gl.load(idx_ptr + pid * (NT * BK) + i * BK + rows)
        valid = ids >= 0
        safe = gl.where(valid, ids, 0)
        ptrs = table_ptr + safe[:, None] * D + cols[None, :]
        async_copy.async_copy_global_to_shared(ring.index(s), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _ring_consumer(out_ptr, ring, full, consumed, pid,
                   NT: gl.constexpr, BK: gl.constexpr, D: gl.constexpr,
                   STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    for i in range(NT):
        s = i % STAGES
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        tile = ring.index(s).load(layout)
        gl.thread_barrier()
        mbarrier.arrive(consumed.index(s))
        gl.store(out_ptr + (pid * (NT * BK) + i * BK + rows)[:, None] * D + cols[None, :], tile)


@gluon.jit
def ring_gather_kernel(table_ptr, idx_ptr, out_ptr,
                       NT: gl.constexpr, BK: gl.constexpr, D: gl.constexpr,
                       STAGES: gl.constexpr):
    pid = gl.program_id(0)
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(table_ptr.dtype.element_ty, [STAGES, BK, D], smem)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=1)
    gl.warp_specialize([
        (_ring_consumer, (out_ptr, ring, full, consumed, pid, NT, BK, D, STAGES)),
        (_ring_producer, (table_ptr, idx_ptr, ring, full, consumed, pid, NT, BK, D, STAGES)),
    ], [PRODUCER_WARPS], [96])


def ring_gather(table, idx, *, block_rows=16, stages=2, num_warps=4):
    """out [P, K, D] = table[idx] with -1 -> 0, via ring_gather_kernel; idx [P, K] int32."""
    import jax
    from csa_jax.kernels.gluon.adapter import gluon_call
    P, K = idx.shape
    D = table.shape[1]
    if K % block_rows:
        raise ValueError(f"idx has K={K} slots, not a multiple of block_rows={block_rows}")
    out = gluon_call(table, idx, kernel=ring_gather_kernel,
                     out_shape=jax.ShapeDtypeStruct((P, K, D), table.dtype), grid=(P,),
                     num_warps=num_warps, NT=K // block_rows, BK=block_rows, D=D, STAGES=stages)
    return out
