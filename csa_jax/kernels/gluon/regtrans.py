"""A transposed MMA operand by an explicit transpose in registers (NVIDIA, PTX movmatrix).

transpose_load(buf, dot): a bf16/f16 tile X [K, M] in shared memory (M contiguous, NVMMA
swizzle) -> X^T [M, K] in the register operand layout `dot`, without a shared-memory round trip:

1. X is read with plain ldmatrix in the layout `mirrored(dot)`: `dot`'s linear layout with the
   8 x 8 block coordinates exchanged (a basis vector (p, q) of [M, K] becomes
   (p % 8 | q & ~7, q % 8 | p & ~7) of [K, M]), so every lane holds the same in-block positions
   as in `dot` and every warp the operand rows it will own;
2. every 32-bit register (2 consecutive M-elements of one row of an 8 x 8 block) goes through
   `movmatrix.sync.aligned.m8n8.trans.b16`: the block transposed across the warp's lanes;
3. Gluon takes the asm as element-wise, so the result read by position is Z[k, m] =
   X[8(k//8) + m%8, 8(m//8) + k%8]; exchanging the block indices (reshape, permute, reshape:
   layout only) gives X^T in exactly `dot`, and the final convert_layout is a no-op.
benchmarks/gluon_transpose_probe.py (mode 6) and the dq kernel's Config.bwd_dq_operand =
"movmatrix" use it; tests/test_gluon_bwd.py checks the PTX (ldmatrix + movmatrix, no
st.shared in the loop).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["mirrored", "strided_layout", "swap01", "transpose_load"]


@gluon.constexpr_function
def mirrored(ll):
    """The [K, M] read layout whose 8 x 8 block transpose is the [M, K] linear layout ll."""
    def swap(b):
        return [(b[0] & 7) | (b[1] & ~7), (b[1] & 7) | (b[0] & ~7)]
    return gl.DistributedLinearLayout(
        reg_bases=[swap(b) for b in ll.reg_bases], lane_bases=[swap(b) for b in ll.lane_bases],
        warp_bases=[swap(b) for b in ll.warp_bases],
        block_bases=[swap(b) for b in ll.block_bases], shape=[ll.shape[1], ll.shape[0]])


@gluon.constexpr_function
def strided_layout(ll, dim=0):
    """ll ([M, K] for dim 0) with the lane bases of bits 0 and 1 of dimension `dim` exchanged:
    a layout that holds index i of that dimension where ll holds swap01(i). No transpose-load
    (ldmatrix .trans, ds_read_tr) can deliver it from a tile whose `dim` runs along contiguous
    rows (the lanes' columns inside a row are fixed), so a shared-memory load of such a
    transposed view in it is plain 2-byte loads, one per element in transposed (strided)
    order; swap01 of the result is then in ll by register renaming only (the dq kernels'
    strided mode: bwd.py Config.bwd_dq_operand = "strided", amd_bwd.py trans = 2)."""
    unit = [[1, 0], [0, 1]][dim]
    lanes = [list(b) for b in ll.lane_bases]
    i1, i2 = lanes.index(unit), lanes.index([2 * u for u in unit])
    lanes[i1], lanes[i2] = lanes[i2], lanes[i1]
    return gl.DistributedLinearLayout(
        reg_bases=ll.reg_bases, lane_bases=lanes, warp_bases=ll.warp_bases,
        block_bases=ll.block_bases, shape=ll.shape)


@gluon.jit
def swap01(x, M: gl.constexpr, N: gl.constexpr, DIM: gl.constexpr):
    """x [M, N] with indices i and swap01(i) of dimension DIM exchanged (bits 0 and 1 of i
    swapped; an involution): reshape / permute / reshape, layout only."""
    if DIM == 0:
        x4 = gl.permute(gl.reshape(x, [M // 4, 2, 2, N]), (0, 2, 1, 3))
    else:
        x4 = gl.permute(gl.reshape(x, [M, N // 4, 2, 2]), (0, 1, 3, 2))
    return gl.reshape(x4, [M, N])


@gluon.jit
def transpose_load(buf, dot: gl.constexpr, M: gl.constexpr, K: gl.constexpr):
    """X^T [M, K] in layout `dot` from the shared-memory tile buf = X [K, M] (16-bit dtype)."""
    ll: gl.constexpr = gl.to_linear_layout(dot, [M, K])
    x = buf.load(mirrored(ll))                                       # [K, M]
    z = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
                                  [x], dtype=x.dtype, is_pure=True, pack=2)
    z4 = gl.reshape(z, [K // 8, 8, M // 8, 8])                       # [kb, kr, mb, mr]
    a4 = gl.permute(z4, (2, 1, 0, 3))                                # [mb, kr, kb, mr]
    return gl.convert_layout(gl.reshape(a4, [M, K]), dot)
