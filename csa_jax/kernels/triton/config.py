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
    """Tuning of the three Triton-dialect kernels (forward, dq, dkv reduce); blocks are powers
    of two, row and head blocks >= 16 (Triton's dot minimum). default_config chooses them.

    forward:  block_k gathered kv rows per tile, block_h heads per program, num_warps,
              num_stages (the compiler's load pipelining depth).
    dq:       block_k_dq, block_h_dq (heads per program), num_warps_dq, num_stages_dq;
              slot_major_dq forms the scores as (rows q^T)^T instead of q rows^T, so the
              resident q and dO [heads, D] feed the MMA as its second operand, which Hopper's
              MMA reads from shared memory, instead of sitting in registers beside the f32
              accumulator (on the H200 the dq kernel's spill requests fell 77x and its time
              23%; docs/perf/triton_h200.md table 4). NVIDIA default; AMD keeps head-major.
    interm:   how the per-slot intermediate interm[t, j] = sum_h scale dS q + P dO is formed.
              "gemm": the dq kernel also stores scale * dS and P [B, T, 2, H, K] (q's dtype)
              and one batched GEMM per token in XLA contracts them with [q; dO] over the
              heads. "dq" (all heads in one dq program: H <= block_h_dq): the dq kernel forms
              each tile's intermediate from the dS and P it holds (two more products per tile,
              the GEMM path's roundings) and writes it: no [B, T, 2, H, K] buffer, no GEMM.
    reduce:   block_r inverse-map entries summed per step, num_warps_reduce; reduce_split = C
              > 0 sums every row's entry list in chunks of at most C entries (one program
              each, f32 partials), then each row's partials in chunk order: a hot row (a cr128
              pool row gets an entry from every later token) no longer walks its whole list in
              one program. 0: one program per row.

    Shared memory per program is about (resident operands + num_stages * streamed tile)
    bytes: e.g. the dq kernel holds q and dO [block_h_dq, D] and streams [block_k_dq, D] tiles;
    <= 64-row tiles keep AMD's LDS in reach. Variants that left this Config (the interm kernel,
    the slot-major forward, int16 inverse-map keys, qdo, dq_delta, interm_f32): tag
    gluon-variants-2026-12-02 (docs/pallas_triton.md).
    """

    block_k: int = 64
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 3
    block_k_dq: int = 32
    block_h_dq: int = 32
    num_warps_dq: int = 4
    num_stages_dq: int = 3
    slot_major_dq: bool = True
    interm: str = "gemm"
    block_r: int = 32
    num_warps_reduce: int = 4
    reduce_split: int = 0

    def __post_init__(self):
        for name in ("block_k", "block_h", "block_k_dq", "block_h_dq"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"{name}={v!r} must be a power of two >= 16 (Triton dot minimum)")
        if not _is_pow2(self.block_r):
            raise ValueError(f"block_r={self.block_r!r} must be a power of two")
        if self.reduce_split != 0 and not _is_pow2(self.reduce_split):
            raise ValueError(f"reduce_split={self.reduce_split!r} must be 0 (off) or a power of "
                             f"two")
        for name in ("num_warps", "num_warps_dq", "num_warps_reduce"):
            v = getattr(self, name)
            if v not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name}={v!r} must be one of 1, 2, 4, 8, 16")
        for name in ("num_stages", "num_stages_dq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.interm not in ("gemm", "dq"):
            raise ValueError(f"interm={self.interm!r} must be 'gemm' or 'dq'")
        if not isinstance(self.slot_major_dq, bool):
            raise ValueError(f"slot_major_dq={self.slot_major_dq!r} must be a bool")


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
    32 heads 1.5x); dq 4 warps, 32 heads, 32-row tiles, 3 stages (with the GEMM interm path: Pro
    cr4 T=16384 backward 54.9 ms, against 72.7 ms for 64-row tiles / 2 stages and 90.9 ms for 64
    heads / 8 warps), slot-major scores (47.5 ms; table 4). AMD (ROCm): 16-row forward and dq
    tiles, 2 stages, head-major dq scores: the smallest tiles that compile for gfx942 without
    VGPR spills inside its 64 KiB LDS (the CPU compile report, docs/perf/gpu_resources.md: at
    32-row tiles the forward spilled 101 VGPRs and the dq kernel 182); not measured, no AMD GPU
    was available. f32 inputs halve the tile rows (twice the bytes per row). Tiles never exceed
    the padded slot count, head blocks never the padded heads.

    Narrow heads (H <= 32: the `small` training preset's 16 x 128, V4 under tensor parallelism
    of 4, 8 or 16; NVIDIA): the forward with 4 warps (a cr4 layer at T = 8192, D = 128, H = 16:
    0.465 ms against 0.629 ms with 8; Pro cr4 T = 16384, D = 512: H = 16 3.83 ms, H = 32 5.53
    ms against 8.68 ms with 8 and 1.20-1.57x on all six layer types at H = 32, measured in bf16
    at D = 512, docs/perf/heads_h200.md). At H <= 16 the backward keeps
    the H = 32 tiling (the defaults) above D = NARROW_BWD_MAX_D = 128: the settings below made
    the D = 512 dq kernel spill 1,984 B per thread on sm_90a (0 with the H = 32 tiling) and its
    step 2.3x the H = 32 one (docs/small_heads.md). Up to D = 128: 64-slot dq tiles (the
    cr4 backward 2.51 ms against 2.74 ms with 32), the per-slot intermediate formed by the dq
    kernel (interm="dq": the `small` step 37.9 -> 36.7 ms, its attention backward 10.9 -> 10.0
    ms; the gradients the same bits as the GEMM path's at its layer shapes), and 64-entry dkv
    reduce steps (a cr4 layer's forward + backward 2.073 -> 1.889 ms; cr128 / cr0 not measured
    when this was set). Hot kv rows (every pool row in every list: 0 < N - T <= K, as in HCA
    layers, where a pool row gets an entry from each later token) and D <= 128 (where it was
    measured): the dkv reduce split into chunks of 128 entries (the cr128 backward 1.16 ms
    against 1.48 ms); H200, docs/perf/train_h200.md. (V4's D = 512 layers have the same hot
    rows, with 4x the bytes per entry; not measured yet, so not split.)
    """
    platform, kind = _device_kind()
    T, H, D, K = *q_shape[1:4], idx_shape[2]
    pool = kv_shape[1] - T
    cfg = Config()
    amd = _is_amd(platform, kind)
    if amd:
        cfg = dataclasses.replace(cfg, block_k=16, block_h_dq=32, block_k_dq=16,
                                  num_stages_dq=2, num_stages=2, slot_major_dq=False)
    elif max(16, _next_pow2(H)) <= 32:
        cfg = dataclasses.replace(cfg, num_warps=4)
        if max(16, _next_pow2(H)) <= 16 and D <= NARROW_BWD_MAX_D:
            cfg = dataclasses.replace(cfg, block_k_dq=64, interm="dq", block_r=64)
    if 0 < pool <= K and D <= 128:
        cfg = dataclasses.replace(cfg, reduce_split=128)
    if jnp.dtype(dtype) == jnp.float32:
        half = lambda v: max(16, v // 2)   # AMD's 16-row tiles stay 16 (8 is no Triton dot)
        cfg = dataclasses.replace(cfg, block_k=half(cfg.block_k),
                                  block_h_dq=half(cfg.block_h_dq), num_stages=2)
    kp = max(16, _next_pow2(K))
    hp = max(16, _next_pow2(H))
    clip = lambda v, top: max(16, min(v, top))
    return dataclasses.replace(
        cfg, block_k=clip(cfg.block_k, kp), block_k_dq=clip(cfg.block_k_dq, kp),
        block_h=clip(cfg.block_h, hp), block_h_dq=clip(cfg.block_h_dq, hp))


def _params(num_warps, num_stages):
    # num_stages is always explicit: the ROCm default (1) would disable load pipelining.
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
