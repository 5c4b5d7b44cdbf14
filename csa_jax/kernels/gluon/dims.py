"""Padded problem dimensions of the Gluon kernels (no triton import: used by config checks)."""
from __future__ import annotations

HB = 64                       # heads per program (the wgmma M dimension)


def round_up(x, m):
    return -(-x // m) * m


def padded_dims(H, D, K, block_k):
    """(Hp, Dp, Kp): heads to a multiple of 64, D to a power of two >= 64, K to block_k."""
    Dp = max(64, 1 << max(0, (int(D) - 1).bit_length()))
    return round_up(H, HB), Dp, round_up(K, block_k)
