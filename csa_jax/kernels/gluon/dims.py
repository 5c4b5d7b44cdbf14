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


def fwd_shared_bytes(D, block_k, stages, itemsize=2):
    """Shared memory of the NVIDIA forward's buffers (fwd.py): q, the ring, the two P tiles and
    the (max, sum) exchange; the compiler adds a few KiB."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return (HB + stages * block_k) * Dp * itemsize + 2 * HB * block_k * itemsize + 8 * HB * 4


def small_heads_block(H):
    """The padded head count of the few-heads forward (small_heads.py): 16 at H <= 16, 32 at
    H <= 32, None above (the 64-head kernel)."""
    return 16 if H <= 16 else 32 if H <= 32 else None


def small_heads_shared_bytes(D, HN, stages, block_k=64, itemsize=2, planes=1, consumers=1):
    """Shared memory of the few-heads kernels' buffers: q [HN, D] (planes = 1, the forward,
    small_heads.py) or [q; dO] [2 HN, D] (planes = 2, the dq kernel, small_heads_dq.py), the
    ring, P^T or dS^T [block_k, HN] (one per consumer warpgroup: the forward's
    fwd_consumers); the compiler adds under 1 KiB (the forward's cross-warp max, measured
    348 - 604 B; the dq kernel's barriers, 252 B: SMALL_HEADS_BUDGET)."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return ((planes * HN + stages * block_k) * Dp * itemsize
            + consumers * block_k * HN * itemsize)


def small_heads_stages(D, HN, planes=1):
    """The deepest ring (4, 3 or 2 stages of 64 rows) of a few-heads kernel that fits
    SMALL_HEADS_BUDGET; 0 if none does. D = 512: the forward 3 at HN = 16, 2 at 32; the dq
    kernel the same."""
    return max((s for s in (4, 3, 2)
                if small_heads_shared_bytes(D, HN, s, planes=planes) <= SMALL_HEADS_BUDGET),
               default=0)


SMALL_HEADS_BUDGET = SMEM_LIMIT - 1024   # the few-heads forward's buffers (+ < 1 KiB scratch)


def dq_shared_bytes(D, block_k, stages, itemsize=2):
    """Shared memory of the dq kernel's buffers (bwd.py): [q; dO], the ring, dS, the barriers."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return ((2 * HB + stages * block_k) * Dp * itemsize + HB * block_k * itemsize
            + 8 * (2 * stages + 1))


def dq_tiles(D):
    """(block_k, stages) of the dq kernel: the largest of 64 x 3, 64 x 2, 32 x 3, 32 x 2, 16 x 4
    whose buffers fit with 8 KiB to spare (32 x 2 at D = 512); None if none fits."""
    for bk, st in ((64, 3), (64, 2), (32, 3), (32, 2), (16, 4)):
        if dq_shared_bytes(D, bk, st) <= SMEM_LIMIT - 8192:
            return bk, st
    return None


# AMD targets of amd_fwd.py and their default tiles at D = 512 (block_k rows a tile, stages of
# the LDS ring, warps a program), chosen from the CPU compile report (docs/perf/gpu_resources.md):
# gfx942 (64 KiB LDS): one 32-row stage + the next tile in registers, 4 warps (8 warps spill:
# without a transposed LDS read the PV operand is gathered with 2-byte reads); gfx950
# (160 KiB): two 64-row stages; gfx1250 (320 KiB): q (64 KiB) + three 64-row stages.
AMD_DEFAULTS = {"gfx942": dict(block_k=32, stages=1, warps=4),
                "gfx950": dict(block_k=64, stages=2, warps=8),
                "gfx1250": dict(block_k=64, stages=3, warps=8)}
# The AMD dq kernel (amd_bwd.py) at D = 512, from the same report: q and dO are both A operands
# (qdo 0: both in registers; 1: dO in LDS). gfx942: 4 warps, one 32-row stage (8 warps spill, as
# the forward); gfx950: 8 warps, four 32-row stages, q and dO in registers (252 VGPRs);
# gfx1250 (wave32: twice the registers a lane): dO in LDS, four 32-row stages (in registers:
# 8 VGPRs spill; 64-row tiles spill 118+).
AMD_DQ_DEFAULTS = {"gfx942": dict(block_k=32, stages=1, warps=4, qdo=0),
                   "gfx950": dict(block_k=32, stages=4, warps=8, qdo=0),
                   "gfx1250": dict(block_k=32, stages=4, warps=8, qdo=1)}
AMD_LDS = {"gfx942": 65_536, "gfx950": 163_840, "gfx1250": 327_680}


def amd_lds_bytes(arch, D, block_k, stages, extra_blocks=0, itemsize=2):
    """LDS of an AMD kernel's buffers (amd_fwd / amd_bwd): the ring of padded rows (16 B after
    each row) plus `extra_blocks` [64, D] blocks (gfx1250's q; the dq kernel's dO with qdo 1);
    the compiler adds a few KiB of scratch (8 KiB is kept free)."""
    del arch
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return (stages * block_k + extra_blocks * HB) * (Dp + 8) * itemsize


# device kinds of ROCm GPUs -> architecture, where jax reports no gfx name
AMD_KINDS = (("mi300", "gfx942"), ("mi325", "gfx942"), ("mi350", "gfx950"), ("mi355", "gfx950"))


def amd_arch(kind, cc=None):
    """The gfx architecture of a ROCm device (None if unknown): its compute capability string
    when it names one ("gfx942:sramecc+:xnack-" -> "gfx942"), else from its device kind."""
    for v in (cc, kind):
        if isinstance(v, str) and v.lower().startswith("gfx"):
            return v.lower().split(":")[0]
    kind = (kind or "").lower()
    return next((arch for key, arch in AMD_KINDS if key in kind), None)
