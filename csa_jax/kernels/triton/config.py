"""Triton kernel config: the tuning knobs, defaults by device kind, and where auto may pick it."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

# Where the kernels run compiled; elsewhere interpret=None means interpret mode.
PLATFORMS = ("gpu", "cuda", "rocm")


# The dialect warns (DeprecationWarning) each time a Triton pallas_call is lowered. Silenced only
# inside quiet_lowering(): around this package's own entry points and sparse_attention's call,
# where eager calls lower; never process-wide (a user's own Triton kernels keep the warning).
_DEPRECATION = r"The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_lowering():
    """Ignore exactly the dialect's deprecation warning while lowering inside this block.

    Lowering happens where a program is compiled: within sparse_attention / forward / backward
    when called eagerly (covered), but inside the caller's jit it happens when the caller's
    program is lowered; wrap that (e.g. `with quiet_lowering(): step.lower(...)` or the first
    call) to silence it there too. Like warnings.catch_warnings, not thread-safe."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
        yield


# The narrow-heads backward settings (64-slot dq tiles, interm="dq", qdo, 64-entry reduce
# steps) apply up to this head dim, where they were measured (the `small` preset's D = 128). At
# V4's D = 512 they made the dq kernel hold a [64, 512] f32 per-slot intermediate beside its
# [16, 512] accumulator: 1,984 B of spill stores per thread on sm_90a (docs/small_heads.md) and a
# Pro cr4 T = 16384 H = 16 step of 67.3 ms against 29.1 ms at H = 32 on the H200.
NARROW_BWD_MAX_D = 128


def _is_pow2(x):
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


def _next_pow2(x):
    return 1 << max(0, (int(x) - 1).bit_length())



@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the four Triton-dialect kernels; block sizes are powers of two.

    forward:  block_k gathered kv rows per tile, block_h heads per program, num_warps, num_stages.
    dq:       block_k_dq, block_h_dq (heads per program), num_warps_dq, num_stages_dq.
    interm:   block_k_dkv slots per program (all heads), block_h_dkv heads per inner step,
              num_warps_dkv, num_stages_dkv; dkv_split_d > 1 splits the [block_k_dkv, D] f32
              accumulator's columns over that many programs; each recomputes the tile's scores,
              so the kernel does (2 * split + 2) / 4 times the products, with a smaller
              accumulator. Never timed: with the default interm tiles it asked for 262,528 B
              of shared memory on the H200 and did not compile (docs/perf/triton_h200.md).
    reduce:   block_r inverse-map entries summed per step, num_warps_reduce (memory bound);
              reduce_split = C > 0 sums every row's entry list in chunks of at most C entries
              (one program each, f32 partials), then each row's partials in chunk order: a
              hot row (a cr128 pool row gets an entry from every later token, up to T) no
              longer walks its whole list in one program while the other rows' programs have
              finished. 0: one program per row.
    qdo:      (interm="gemm") the dq kernel also writes the per-slot GEMM's [q; dO] operand
              [B, T, 2, H, D] from the tiles it reads, in place of XLA's stack of the two (which
              reads both and writes them again).
    dq_delta: (interm="gemm") the dq kernel forms delta = rowsum(o * dO) from o's block itself
              (and returns it for dsink), instead of an XLA reduction over o and dO before it.
    narrow_keys: sort the reduce's inverse map on int16 kv-row keys where N < 2**15
              (csa_jax.blockmath.inverse_map(narrow=True): the same map, half the radix passes).
    interm_f32: keep the per-slot intermediate in f32 even for bf16 inputs (2x its bytes).
    slot_major (forward), slot_major_dq (dq kernel): form the scores as (rows q^T)^T instead of
              q rows^T. The resident q (and dO) [heads, D] then feed the MMA as its second
              operand, which Hopper's MMA reads from shared memory, instead of being held in
              registers beside the [heads, D] f32 accumulator. On the H200 the head-major dq
              kernel spilled 10.1 M requests per launch and the slot-major one 0.13 M, with the
              same shared memory per program (docs/perf/triton_h200.md).
    interm:   how the per-slot intermediate is formed. "gemm" (default): the dq kernel also
              stores scale * dS and P [B, T, 2, H, K] (q's dtype, as the kernel path rounds them
              before its dots) and one batched GEMM per token in XLA contracts them with
              [q; dO] over the heads. "kernel": the interm kernel above recomputes the scores
              slot-major (7 products instead of 5, no [B, T, 2, H, K] buffer). "dq" (needs
              all heads in one dq program, H <= block_h_dq): the dq kernel forms each tile's
              intermediate from the dS and P it holds (two more products per tile, the GEMM
              path's roundings) and writes it: no [B, T, 2, H, K] buffer, no GEMM, no [q; dO].

    Row and head blocks are >= 16 (Triton's dot minimum). Shared memory per program is about
    (resident operands + num_stages * streamed tile) bytes: e.g. the dq kernel holds q and dO
    [block_h_dq, D] and streams [block_k_dq, D] tiles; <= 64-row tiles keep AMD's LDS in reach.
    """

    block_k: int = 64
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 3
    block_k_dq: int = 32
    block_h_dq: int = 32
    num_warps_dq: int = 4
    num_stages_dq: int = 3
    block_k_dkv: int = 64
    block_h_dkv: int = 32
    num_warps_dkv: int = 4
    num_stages_dkv: int = 2
    dkv_split_d: int = 1
    block_r: int = 32
    num_warps_reduce: int = 4
    reduce_split: int = 0
    narrow_keys: bool = False
    qdo: bool = False
    dq_delta: bool = False
    interm_f32: bool = False
    interm: str = "gemm"
    slot_major: bool = False
    slot_major_dq: bool = True

    def __post_init__(self):
        for name in ("block_k", "block_h", "block_k_dq", "block_h_dq", "block_k_dkv",
                     "block_h_dkv"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"{name}={v!r} must be a power of two >= 16 (Triton dot minimum)")
        if not _is_pow2(self.dkv_split_d):
            raise ValueError(f"dkv_split_d={self.dkv_split_d!r} must be a power of two")
        if not _is_pow2(self.block_r):
            raise ValueError(f"block_r={self.block_r!r} must be a power of two")
        if self.reduce_split != 0 and not _is_pow2(self.reduce_split):
            raise ValueError(f"reduce_split={self.reduce_split!r} must be 0 (off) or a power of "
                             f"two")
        for name in ("num_warps", "num_warps_dq", "num_warps_dkv", "num_warps_reduce"):
            v = getattr(self, name)
            if v not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={v!r} must be one of 1, 2, 4, 8, 16")
        for name in ("num_stages", "num_stages_dq", "num_stages_dkv"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.interm not in ("gemm", "kernel", "dq"):
            raise ValueError(f"interm={self.interm!r} must be 'gemm', 'kernel' or 'dq'")
        for name in ("interm_f32", "slot_major", "slot_major_dq", "narrow_keys", "qdo",
                     "dq_delta"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")


def _device_kind():
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return "cpu", ""
    return d.platform, d.device_kind


def _is_amd(platform, kind):
    kind = kind.lower()
    return platform == "rocm" or kind.startswith("gfx") or "amd" in kind or "instinct" in kind


def unsupported(q_shape, kv_shape, idx_shape, dtype):
    """Why impl="auto" should not pick this impl here (None = it may).

    auto picks it only where it was verified and measured faster end to end: NVIDIA GPUs with
    bf16/f16 inputs (docs/perf/triton_h200.md, docs/perf/train_h200.md). On ROCm it has never
    run (request impl="pallas_triton" explicitly); f32 inputs stay on the exact XLA reference.
    """
    del q_shape, kv_shape, idx_shape
    platform, kind = _device_kind()
    if platform not in PLATFORMS or _is_amd(platform, kind) or "nvidia" not in kind.lower():
        return f"not an NVIDIA GPU (platform={platform!r}, device_kind={kind!r})"
    if jnp.dtype(dtype) == jnp.float32:
        return "f32 inputs: the XLA reference computes true f32 products"
    return None


def default_config(q_shape, kv_shape, idx_shape, dtype) -> Config:
    """Defaults by device kind, clipped to the problem.

    NVIDIA (and CPU interpret): the Config defaults, measured on the H200 (docs/perf/triton_h200.md):
    forward 8 warps, 3 stages, 64-row tiles, 64 heads (4 warps ran 2.3x slower, 16 warps 2.5x,
    32 heads 1.5x);
    dq 4 warps, 32 heads, 32-row tiles, 3 stages (with the GEMM interm path: Pro cr4 T=16384
    backward 54.9 ms, against 72.7 ms for 64-row tiles / 2 stages and 90.9 ms for 64 heads /
    8 warps), slot-major scores (47.5 ms; docs/perf/triton_h200.md table 4); forward scores
    head-major (slot-major ran 1.3-1.7x slower); interm kernel (interm="kernel" only) 4 warps,
    64-row tiles (8 warps ran 4.6x slower, 32-row tiles 8x). AMD (ROCm): 16-row forward and
    dq tiles, 2 stages, head-major dq scores: the smallest tiles that compile for gfx942 without
    VGPR spills inside its 64 KiB LDS (the CPU compile report, docs/perf/gpu_resources.md: at
    32-row tiles the forward spilled 101 VGPRs and the dq kernel 182); not measured, no AMD GPU
    was available. f32 inputs halve
    the tile rows (twice the bytes per row). Tiles never exceed the padded slot count, head
    blocks never the padded heads.

    Narrow heads (H <= 16: the `small` training preset's 16 x 128, V4 under tensor parallelism
    of 8 or 16; NVIDIA): the forward with 4 warps (a cr4 layer at T = 8192, D = 128: 0.465 ms
    against 0.629 ms with 8; Pro cr4 T = 16384, D = 512, H = 16: 3.83 ms). The backward keeps
    the H = 32 tiling (the defaults) above D = NARROW_BWD_MAX_D = 128: the settings below made
    the D = 512 dq kernel spill 1,984 B per thread on sm_90a (0 with the H = 32 tiling) and its
    step 2.3x the H = 32 one (docs/small_heads.md). Up to D = 128: 64-slot dq tiles (the
    cr4 backward 2.51 ms against 2.74 ms with 32) and qdo (in a `small` step XLA's [q; dO]
    stack, 0.97 ms per step, was gone and the 12 dq kernels took 0.1 ms more; kept for
    interm="gemm"), and the per-slot intermediate formed by the dq kernel (interm="dq": the
    `small` step 37.9 -> 36.7 ms, its attention backward 10.9 -> 10.0 ms; the gradients the same
    bits as the GEMM path's at its layer shapes), and 64-entry dkv reduce steps (a cr4 layer's
    forward + backward 2.073 -> 1.889 ms; cr128 / cr0 not measured when this was set). Hot kv
    rows (every pool row in every list: 0 < N - T <= K, as in HCA layers, where a pool row
    gets an entry from each later token) and D <= 128 (where it was measured): the dkv reduce
    split into chunks of 128 entries (the cr128 backward 1.16 ms against 1.48 ms); H200,
    docs/perf/train_h200.md. (V4's D = 512 layers have
    the same hot rows, with 4x the bytes per entry; not measured yet, so not split.)
    """
    platform, kind = _device_kind()
    T, H, D, K = *q_shape[1:4], idx_shape[2]
    pool = kv_shape[1] - T
    cfg = Config()
    amd = _is_amd(platform, kind)
    if amd:
        cfg = dataclasses.replace(cfg, block_k=16, block_k_dkv=32, block_h_dq=32, block_k_dq=16,
                                  num_stages_dq=2, block_h_dkv=16, num_stages=2,
                                  slot_major_dq=False)
    elif max(16, _next_pow2(H)) <= 16:
        cfg = dataclasses.replace(cfg, num_warps=4)
        if D <= NARROW_BWD_MAX_D:
            cfg = dataclasses.replace(cfg, block_k_dq=64, qdo=True, interm="dq", block_r=64)
    if 0 < pool <= K and D <= 128:
        cfg = dataclasses.replace(cfg, reduce_split=128)
    if jnp.dtype(dtype) == jnp.float32:
        half = lambda v: max(16, v // 2)   # AMD's 16-row tiles stay 16 (8 is no Triton dot)
        cfg = dataclasses.replace(cfg, block_k=half(cfg.block_k), block_k_dkv=half(cfg.block_k_dkv),
                                  block_h_dq=half(cfg.block_h_dq), num_stages=2)
    kp = max(16, _next_pow2(K))
    hp = max(16, _next_pow2(H))
    clip = lambda v, top: max(16, min(v, top))
    return dataclasses.replace(
        cfg, block_k=clip(cfg.block_k, kp), block_k_dq=clip(cfg.block_k_dq, kp),
        block_k_dkv=clip(cfg.block_k_dkv, kp), block_h=clip(cfg.block_h, hp),
        block_h_dq=clip(cfg.block_h_dq, hp), block_h_dkv=clip(cfg.block_h_dkv, hp))


def _params(num_warps, num_stages):
    # num_stages is always explicit: the ROCm default (1) would disable load pipelining.
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
