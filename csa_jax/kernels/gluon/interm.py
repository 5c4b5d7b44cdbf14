"""The per-slot intermediate of the dkv path as a Gluon GEMM (Config.bwd_interm="gluon").

interm[t] [Kp, D] = dsp[t]^T [q[t]; dO[t]]: per token, M = slots, N = D, contraction over the
2 * Hp rows (plane 0 = scale * dS against q, plane 1 = P against dO), reading q and dO where
they are (no stacked copy) and dsp as the dq kernel wrote it ([B*T, 2, Hp, Kp]). Both operands
are "transposed" for wgmma (the paper's dS^T Q and P^T dO): A = dsp^T, stored with the slots
contiguous, through an MN-major shared-memory descriptor (or, Config.bwd_interm_operand, loaded
into registers with ldmatrix .trans or plain ldmatrix + movmatrix); B = [q; dO] rows, D
contiguous, through an MN-major descriptor.

One program (CTA) = one token x one BN-column block of D, warp-specialized like the dq kernel:
- producer partition (4 warps): the program's B block [2*Hp, BN] (q's rows then dO's) once, in
  BKC-row chunks, each on its own mbarrier (the first M tile starts on the first chunk); then
  the A chunks [BKC heads, BM slots] of every M tile through a STAGES-deep ring (cp.async,
  16-byte copies);
- default partition (8 warps = 2 consumer warpgroups, each 64 slots x BN f32 = 128 registers
  per thread at BN = 256): acc = sum over the 2*Hp / BKC chunks of A^T B on wgmma, then the tile
  leaves as bf16 (f32 accumulation, one rounding) straight from the accumulator layout.
  pipeline (Config.bwd_interm_pipeline, operand "desc" only): each chunk's wgmma is issued
  asynchronously and waited for one chunk later (one product in flight under the next chunk's
  barrier wait).
Deterministic: a fixed contraction order, no atomics. Every slot of every token is written
(empty slots have dsp = 0, so their rows are 0; they are in no inverse-map row anyway).
"""
from __future__ import annotations

import jax
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from csa_jax.kernels.gluon.fwd import CONSUMER_WARPS, PRODUCER_WARPS, _release
from csa_jax.kernels.gluon.regtrans import transpose_load

__all__ = ["csa_interm_kernel", "interm", "arg_types", "constexprs", "OPERANDS",
           "shared_bytes", "block_n"]

OPERANDS = ("desc", "ldsm_trans", "movmatrix")       # Config.bwd_interm_operand
BM = 128                                             # slots per M tile (2 warpgroups x 64)
BKC = 64                                             # contraction rows per chunk


@gluon.jit
def _interm_producer(dsp_ptr, q_ptr, do_ptr, ring, b_smem, full, consumed, b_bar, tok, n0,
                     HP: gl.constexpr, KP: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
                     BM: gl.constexpr, BKC: gl.constexpr, STAGES: gl.constexpr):
    NKC: gl.constexpr = 2 * HP // BKC
    blk_b: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BN // 8) if BN < 256 else 1,
                                                    BN // 8 if BN < 256 else 32],
                                           [PRODUCER_WARPS, 1], [1, 0])
    br = gl.arange(0, BKC, layout=gl.SliceLayout(1, blk_b))
    bc = gl.arange(0, BN, layout=gl.SliceLayout(0, blk_b))
    for kc in gl.static_range(NKC):
        if kc * BKC < HP:
            src = q_ptr
            h0 = kc * BKC
        else:
            src = do_ptr
            h0 = kc * BKC - HP
        b_ptrs = src + (tok.to(gl.int64) * HP + h0 + br)[:, None] * D + (n0 + bc)[None, :]
        async_copy.async_copy_global_to_shared(b_smem.slice(kc * BKC, BKC), b_ptrs)
        async_copy.mbarrier_arrive(b_bar.index(kc), increment_count=False)
    blk_a: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PRODUCER_WARPS, 1], [1, 0])
    ar = gl.arange(0, BKC, layout=gl.SliceLayout(1, blk_a))
    ac = gl.arange(0, BM, layout=gl.SliceLayout(0, blk_a))
    a_base = dsp_ptr + tok.to(gl.int64) * (2 * HP * KP)
    for mt in range(KP // BM):
        for kc in gl.static_range(NKC):
            i = mt * NKC + kc
            s = i % STAGES
            if i >= STAGES:
                mbarrier.wait(consumed.index(s), ((i // STAGES) - 1) & 1)
            ptrs = a_base + (kc * BKC + ar).to(gl.int64)[:, None] * KP + (mt * BM + ac)[None, :]
            async_copy.async_copy_global_to_shared(ring.index(s), ptrs)
            async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _interm_consumer(interm_ptr, ring, b_smem, full, consumed, b_bar, tok, n0,
                     HP: gl.constexpr, KP: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
                     BM: gl.constexpr, BKC: gl.constexpr, STAGES: gl.constexpr,
                     OP: gl.constexpr, PIPE: gl.constexpr):
    NKC: gl.constexpr = 2 * HP // BKC
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN, 16])
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    out_base = interm_ptr + tok.to(gl.int64) * (KP * D) + n0
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for mt in range(KP // BM):
        for kc in gl.static_range(NKC):
            i = mt * NKC + kc
            s = i % STAGES
            if mt == 0:
                mbarrier.wait(b_bar.index(kc), 0)
            mbarrier.wait(full.index(s), (i // STAGES) & 1)
            fence_async_shared()          # cp.async (generic proxy) -> wgmma (async proxy)
            tile = ring.index(s)          # [BKC, BM]: A^T
            b = b_smem.slice(kc * BKC, BKC)
            if OP == 0:
                a = tile.permute((1, 0))
            elif OP == 1:
                a = tile.permute((1, 0)).load(a_dot)
            else:
                a = transpose_load(tile, a_dot, BM, BKC)
            if PIPE:
                # Keep one wgmma in flight: chunk kc runs while chunk kc + 1's barrier wait and
                # fence are issued; stage i - 1 is released once its product has completed.
                acc = warpgroup_mma(a, b, acc, use_acc=kc > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                if kc > 0:
                    _release(consumed.index((i - 1) % STAGES))
            else:
                acc = warpgroup_mma(a, b, acc, use_acc=kc > 0)
                _release(consumed.index(s))
        if PIPE:
            acc = warpgroup_mma_wait(0, deps=[acc])
            _release(consumed.index((mt * NKC + NKC - 1) % STAGES))
        ptrs = out_base + (mt * BM + rows).to(gl.int64)[:, None] * D + cols[None, :]
        gl.store(ptrs, acc.to(interm_ptr.dtype.element_ty))


@gluon.jit
def csa_interm_kernel(dsp_ptr, q_ptr, do_ptr, interm_ptr, HP: gl.constexpr, KP: gl.constexpr,
                      D: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BKC: gl.constexpr,
                      STAGES: gl.constexpr, OP: gl.constexpr, PIPE: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr):
    NN: gl.constexpr = D // BN
    pid = gl.program_id(0)
    tok = pid // NN
    n0 = (pid % NN) * BN
    NKC: gl.constexpr = 2 * HP // BKC
    dt: gl.constexpr = dsp_ptr.dtype.element_ty
    ring = gl.allocate_shared_memory(
        dt, [STAGES, BKC, BM], gl.NVMMASharedLayout.get_default_for([BKC, BM], dt))
    b_smem = gl.allocate_shared_memory(
        dt, [2 * HP, BN], gl.NVMMASharedLayout.get_default_for([2 * HP, BN], dt))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_bar = gl.allocate_shared_memory(gl.int64, [NKC, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(consumed.index(s), count=1)
    for kc in gl.static_range(NKC):
        mbarrier.init(b_bar.index(kc), count=PRODUCER_WARPS * 32)
    gl.warp_specialize([
        (_interm_consumer, (interm_ptr, ring, b_smem, full, consumed, b_bar, tok, n0, HP, KP, D,
                            BN, BM, BKC, STAGES, OP, PIPE)),
        (_interm_producer, (dsp_ptr, q_ptr, do_ptr, ring, b_smem, full, consumed, b_bar, tok,
                            n0, HP, KP, D, BN, BM, BKC, STAGES)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------- host side


def block_n(Hp, D):
    """Columns per program, a power of two: B [2*Hp, BN] stays resident (<= 128 KiB), BN <= 256
    (the f32 accumulator: 64 x BN per warpgroup), BN >= 64."""
    top = min(256, D, 32768 // Hp)
    return max(64, 1 << (top.bit_length() - 1))


def shared_bytes(Hp, D, stages, itemsize=2):
    """The kernel's buffers: the A ring, the resident B block, the barriers."""
    bn = block_n(Hp, D)
    return (stages * BKC * BM + 2 * Hp * bn) * itemsize + 8 * (2 * stages + 2 * Hp // BKC)


def arg_types(dt="bf16"):
    return [f"*{dt}"] * 4


def constexprs(*, Hp, Kp, D, stages=4, operand="desc", pipeline=False, producer_regs=96):
    if pipeline and operand != "desc":
        # An in-flight wgmma still reads its register A operand; only the descriptor form
        # (A in shared memory, released one chunk later) is pipelined.
        raise ValueError(f"pipeline=True needs operand='desc' (got {operand!r})")
    return dict(HP=Hp, KP=Kp, D=D, BN=block_n(Hp, D), BM=BM, BKC=BKC, STAGES=stages,
                OP=OPERANDS.index(operand), PIPE=bool(pipeline), PRODUCER_REGS=producer_regs)


def interm(dsp, q_p, do_p, *, stages=4, operand="desc", pipeline=False, producer_regs=96):
    """interm [B, T, Kp, Dp] (q's dtype) = dsp^T [q; dO] per token; dsp [B*T, 2, Hp, Kp] (or
    [B, T, 2, Hp, Kp]), q_p / do_p [B, T, Hp, Dp]. Hp a multiple of 64, Kp of 128, Dp >= 64."""
    from csa_jax.kernels.gluon.adapter import gluon_call
    from csa_jax.kernels.gluon.dims import SMEM_LIMIT
    B, T, Hp, D = q_p.shape
    Kp = dsp.shape[-1]
    if Hp % BKC or Kp % BM or D % 64:
        raise ValueError(f"the Gluon interm GEMM needs Hp % {BKC} == 0, Kp % {BM} == 0 and "
                         f"D % 64 == 0; got Hp={Hp}, Kp={Kp}, D={D}")
    need = shared_bytes(Hp, D, stages)
    if need > SMEM_LIMIT - 4096:
        raise ValueError(f"the Gluon interm GEMM at Hp={Hp}, D={D}, stages={stages} needs "
                         f"{need} B of shared memory (limit {SMEM_LIMIT})")
    bn = block_n(Hp, D)
    out = gluon_call(
        dsp.reshape(B * T * 2 * Hp, Kp), q_p.reshape(B * T * Hp, D), do_p.reshape(B * T * Hp, D),
        kernel=csa_interm_kernel,
        out_shape=jax.ShapeDtypeStruct((B * T * Kp, D), q_p.dtype),
        grid=(B * T * (D // bn),), num_warps=CONSUMER_WARPS, name="csa_gluon_interm",
        **constexprs(Hp=Hp, Kp=Kp, D=D, stages=stages, operand=operand, pipeline=pipeline,
                     producer_regs=producer_regs))
    return out.reshape(B, T, Kp, D)
