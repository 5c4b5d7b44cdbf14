"""A transposed MMA operand read by plain strided 2-byte shared-memory loads (no ldmatrix), for
the AMD dq kernel's TRANS == 2 mode (amd_bwd.py): strided_layout gives the read layout, swap01
undoes its row renaming in registers."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["strided_layout", "swap01"]


@gluon.constexpr_function
def strided_layout(ll, dim=0):
    """ll ([M, K] for dim 0) with the lane bases of bits 0 and 1 of dimension `dim` exchanged:
    a layout that holds index i of that dimension where ll holds swap01(i). No transpose-load
    (ldmatrix .trans, ds_read_tr) can deliver it from a tile whose `dim` runs along contiguous
    rows (the lanes' columns inside a row are fixed), so a shared-memory load of such a
    transposed view in it is plain 2-byte loads, one per element in transposed (strided)
    order; swap01 of the result is then in ll by register renaming only (amd_bwd.py
    trans = 2)."""
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
