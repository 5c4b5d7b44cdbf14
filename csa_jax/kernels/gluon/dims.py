"""Padded problem dimensions of the Gluon kernels (no triton import: used by config checks)."""
from __future__ import annotations

HB = 64                       # heads per program (the wgmma M dimension)
SMEM_LIMIT = 232_448          # the H200's shared memory per block


def round_up(x, m):
    return -(-x // m) * m


def padded_dims(H, D, K, block_k):
    """(Hp, Dp, Kp): heads to a multiple of 64, D to a power of two >= 64, K to block_k."""
    Dp = max(64, 1 << max(0, (int(D) - 1).bit_length()))
    return round_up(H, HB), Dp, round_up(K, block_k)


def dq_shared_bytes(D, block_k, stages, itemsize=2):
    """Shared memory of the dq kernel's buffers (bwd.py): [q; dO], the ring, the S/dP exchange,
    dS, the barriers."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return ((2 * HB + stages * block_k) * Dp * itemsize + 2 * HB * block_k * 4
            + HB * block_k * itemsize + 8 * (2 * stages + 2))
