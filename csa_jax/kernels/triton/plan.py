"""Padded launch dims and the gather / score helpers every Triton kernel uses."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from csa_jax import blockmath
from csa_jax.kernels.triton.config import _next_pow2


@dataclasses.dataclass(frozen=True)
class _Dims:
    B: int
    T: int
    H: int
    D: int
    N: int
    K: int
    Hp: int   # heads padded to a multiple of every head block
    Dp: int   # head dim padded to a power of two >= 16
    Kp: int   # slots padded to a multiple of every row block


def _dims(q, kv, idx, config):
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    hp = max(16, _next_pow2(H))
    hmax = min(hp, max(config.block_h, config.block_h_dq))
    Hp = blockmath.round_up(H, hmax)
    Dp = max(16, _next_pow2(D))
    # Slots: a multiple of the largest slot tile and, for 16-bit inputs, of 32 slots (16 when
    # K <= 16). The 32 is the padding every default kernel was compiled and measured with; it
    # came from the per-slot interm kernel's tile (removed 2026-12-02) and matters only where
    # both tiles are 16 rows (AMD's bf16 defaults); kept so that no default kernel changed
    # (benchmarks/triton_asm_diff.py).
    kp = max(16, _next_pow2(K))
    align = min(kp, 32) if q.dtype.itemsize < 4 else 16
    kmax = max(config.block_k, config.block_k_dq, align)
    return _Dims(B, T, H, D, N, K, Hp, Dp, blockmath.round_up(K, kmax))


def _pad_to(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _prep_idx(idx, d):
    """Padded idx [B, T, Kp] and the slot count up to the last non-empty slot [B, T]."""
    idx_p = _pad_to(idx, 2, d.Kp, -1)
    j = jnp.arange(d.Kp, dtype=jnp.int32)
    used = jnp.max(jnp.where(idx_p >= 0, j, -1), axis=2) + 1                   # 0 if empty
    return idx_p, used.astype(jnp.int32)


def _ntiles(used, bk):
    """Tiles of bk slots a token must walk: empty tails (early tokens) are skipped."""
    return (used + bk - 1) // bk


def _head_block(d, block):
    return min(block, d.Hp)


def _gather_tile(idx_ref, kv_ref, start, bk):
    """One tile of bk slots: (rows [bk, D] with zeros for empty slots, valid [bk])."""
    ids = idx_ref[pl.ds(start, bk)]                                            # [bk]
    valid = ids >= 0
    # Empty slots read nothing (masked load) and are masked again in the scores.
    rows = _gather_rows(kv_ref, jnp.where(valid, ids, 0), valid)
    return rows, valid


def _scores(a, rows, slot_major, precision):
    """a rows^T [hb, bk] for a resident [hb, D] operand a (q or dO) and a gathered tile.

    slot_major (the dq kernel's Config.slot_major_dq) computes it as (rows a^T)^T: a becomes
    the MMA's second operand (shared memory on Hopper) rather than a register-resident first
    operand; the [bk, hb] result is transposed in registers."""
    if slot_major:
        return pltriton.dot(rows, a, trans_b=True, precision=precision).T
    return pltriton.dot(a, rows, trans_b=True, precision=precision)


def _gather_rows(ref, rows, mask):
    """ref[rows, :] for a [n] vector of row ids, masked rows read as 0.

    Written with two broadcast index arrays (not `ref.at[rows, :]`) because the interpreter
    only discharges loads whose indexers are all arrays or all slices."""
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    return pltriton.load(ref.at[rows[:, None], cols], mask=mask[:, None], other=0)


def _token_head_grid(d, hb):
    """1-D grid over (b, t, head block), head block fastest; index-map helpers."""
    nh = d.Hp // hb

    def coords(i):
        return i // (d.T * nh), (i // nh) % d.T, i % nh

    return d.B * d.T * nh, coords
