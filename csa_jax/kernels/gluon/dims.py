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


def dq_shared_bytes(D, block_k, stages, itemsize=2, pair=False):
    """Shared memory of the dq kernel's buffers (bwd.py): [q; dO], the ring, the S/dP exchange
    (none with pair: Config.bwd_pair), dS, the barriers."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    if pair:
        return (2 * HB + stages * block_k) * Dp * itemsize + HB * block_k * itemsize + 8 * (
            2 * stages + 1)
    return ((2 * HB + stages * block_k) * Dp * itemsize + 2 * HB * block_k * 4
            + HB * block_k * itemsize + 8 * (2 * stages + 2))


def dq_blk_shared_bytes(D, block_k, stages, itemsize=2):
    """Shared memory of the dq kernel with bwd_pipeline + bwd_qdo_regs (bwd_pipe.py
    csa_dq_blk_kernel): [q; dO] in 64-column blocks, the ring, the barriers; dS lives in the
    [q; dO] block held in registers."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return (2 * HB + stages * block_k) * Dp * itemsize + 8 * (2 * stages + 1)


def dq_alt_shared_bytes(D, block_k, stages, itemsize=2):
    """Shared memory of the alternating dq kernel (bwd_alt.py): [q; dO], the ring, the two dS
    buffers, the barriers."""
    Dp = padded_dims(HB, D, block_k, block_k)[1]
    return (2 * HB + stages * block_k) * Dp * itemsize + 2 * HB * block_k * itemsize + 8 * (
        2 * stages + 5)



def dq_win_shared_bytes(D, window, itemsize=2, heads=32, block_t=16):
    """Shared memory of the cr0 window dq kernel (bwd_win.py, Config.bwd_win): [q; dO] of 32
    heads (64 paired rows), the span (window + 16 rows), dS of the token [32, window + 16], 4
    barriers. D = 512, window 128: 65,536 + 147,456 + 9,216 + 32 = 222,240 B."""
    Dp = padded_dims(HB, D, 1, 1)[1]
    return ((2 * heads + window + block_t) * Dp + heads * (window + block_t)) * itemsize + 32


def check_bwd_win(c):
    """Config.bwd_win's checks (ValueError naming the bad field)."""
    if not isinstance(c.bwd_win, bool):
        raise ValueError(f"bwd_win={c.bwd_win!r} must be a bool")
    r = c.bwd_win_producer_regs
    if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 24 <= r <= 256:
        raise ValueError(f"bwd_win_producer_regs={r!r} must be a multiple of 8 in 24..256")
    if isinstance(c.bwd_win_ablate, bool) or c.bwd_win_ablate not in (0, 1, 2, 3):
        raise ValueError(f"bwd_win_ablate={c.bwd_win_ablate!r} must be 0 (off) or 1..3 "
                         f"(benchmark only)")
    for name in ("bwd_win_overlap", "bwd_win_dq_movmatrix"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"{name}={getattr(c, name)!r} must be a bool")
    if c.bwd_win_dsp not in ("canonical", "block"):
        raise ValueError(f"bwd_win_dsp={c.bwd_win_dsp!r} must be 'canonical' or 'block'")
    if c.bwd_win_delta not in ("global", "smem"):
        raise ValueError(f"bwd_win_delta={c.bwd_win_delta!r} must be 'global' or 'smem'")
    if not c.bwd_win:
        if c.bwd_win_ablate:
            raise ValueError("bwd_win_ablate applies to bwd_win=True only")
        return
    if c.layout != "cr0":
        raise ValueError(f"bwd_win=True needs layout='cr0' (the window dq kernel covers the "
                         f"window slots only; cr128's pool slots are not built), got "
                         f"layout={c.layout!r}")
    if c.bwd != "gluon" or c.bwd_interm != "xla":
        raise ValueError(f"bwd_win=True runs with bwd='gluon' and bwd_interm='xla', got "
                         f"bwd={c.bwd!r}, bwd_interm={c.bwd_interm!r}")
    if c.bwd_ablate or c.bwd_schedule != "lockstep":
        raise ValueError(f"bwd_win=True has no bwd_ablate / bwd_schedule modes (got "
                         f"bwd_ablate={c.bwd_ablate}, bwd_schedule={c.bwd_schedule!r})")

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
