"""impl="gluon": CSA kernels in Triton's Gluon dialect (NVIDIA Hopper), called from JAX.

The impl-module interface of csa_jax/registry.py: Config, default_config, forward, backward,
unsupported. The forward is the warp-specialized kernel of fwd.py (a producer partition
gathering kv rows with cp.async into an mbarrier ring, two consumer warpgroups on wgmma), launched
through jax-triton's primitive by adapter.py.

BACKWARD (Config.bwd): "gluon" (default) = the warp-specialized dq kernel of bwd.py (it also
stores scale*dS and P) + the Pallas Triton impl's deterministic per-slot GEMM and inverse-map
reduce for dkv; "pallas_triton" = the whole Pallas Triton-dialect backward (its default config)
on the forward's (o, lse), which follow the same contract.

Needs the optional extra `csa_jax[gluon]` (triton==3.6.0, jax-triton==0.3.1) and an NVIDIA GPU of
compute capability 9.0 (sm_90a: wgmma, setmaxnreg). Gluon has no CPU interpreter: on a CPU the
kernels can only be compiled (adapter.compile_kernel), never run.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from csa_jax.kernels.gluon.adapter import missing as _missing_triton

_GPU_PLATFORMS = ("gpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the Gluon forward.

    block_k: gathered kv rows per ring stage (the wgmma N of QK^T and K of PV): 64 or 32.
    stages: depth of the shared-memory ring (2 at D = 512: q 64 KiB + 2 x 64 KiB stages).
    producer_regs: registers per thread of the producer partition (setmaxnreg; multiple of 8,
        24..256); the consumers get what is left of the 64K-register file.
    pipeline: issue tile i's QK^T while tile i-1's PV still runs (async wgmma), release stage
        i-1 after both; False = each tile's two products run back to back.
    smem_epilogue: write o through q's shared buffer and store it with 16-byte coalesced
        stores (False: straight from the wgmma accumulator layout, 4-byte stores).
    prefetch: load the next tile's row ids while the current tile is in flight (producer) or
        on the tensor cores (consumers), so no global-load latency sits between a stage's release
        and its refill, or between a tile's QK^T and its mask.
    ablate: BENCHMARK ONLY, wrong results: 1 = no PV product, 2 = no QK^T product, 3 = neither,
        4 = no compute at all (the consumers only wait for and release the ring: the producer's
        pace). Used to place the time inside the kernel (docs/perf/gluon_h200.md).
    schedule: "auto" (default) = "alternate" unless an option of the lockstep kernel is set
        (pipeline, smem_epilogue, ablate) or stages is odd, then "default" (measured:
        docs/perf/gluon_h200.md, "alternate" 1.22x faster at Pro cr4 T=16384);
        "default" = fwd.py (one 8-warp consumer partition: both warpgroups compute half
        of every S and their half of every PV); "alternate" = fwd_alt.py, FlashMLA's schedule
        (two 4-warp consumer partitions that take turns: S and the softmax of even tiles on
        warpgroup 0, odd tiles on 1, P and the running max / sum handed over in shared memory,
        each PV on the warpgroup's own 256 columns; registers per consumer thread `alt_regs`,
        the producer warpgroup gets the rest: 72 at 216; `producer_regs` is the default
        schedule's and the dq kernel's). `pipeline`,
        `smem_epilogue` and `ablate` apply to the default schedule only; "alternate" needs an
        even `stages`.
    alt_regs: schedule="alternate": registers per consumer thread (setmaxnreg; multiple of 8,
        128..240).
    alt_split: schedule="alternate" only: each ring stage in two column halves with their own
        barriers (the producer refills a half as soon as its readers are done; FlashMLA's
        half-D pipelining; measured no faster than without).
    bwd: "gluon" (the dq kernel of bwd.py, dkv by the Pallas Triton GEMM + reduce) or
        "pallas_triton" (its whole backward); bwd_block_k (16, 32, 64) and bwd_stages: the dq
        kernel's ring tile rows and depth (32 x 2 at D = 512: [q; dO] 128 KiB + 2 x 32 KiB).
    bwd_prefetch: the dq kernel loads the next tile's row ids ahead (producer and consumers, as
        `prefetch` in the forward); off by default: not yet timed in the dq kernel.
    bwd_ablate: BENCHMARK ONLY, wrong results: 1 = no scale*dS / P stores, 2 = no dq product,
        3 = no score product, 4 = no compute (the dq kernel's consumers only wait and release).
    """

    block_k: int = 64
    stages: int = 2
    producer_regs: int = 96
    pipeline: bool = False
    smem_epilogue: bool = False
    prefetch: bool = True
    ablate: int = 0
    schedule: str = "auto"
    alt_regs: int = 216
    alt_split: bool = False
    bwd: str = "gluon"
    bwd_block_k: int = 32
    bwd_stages: int = 2
    bwd_prefetch: bool = False
    bwd_ablate: int = 0

    def __post_init__(self):
        if self.bwd not in ("gluon", "pallas_triton"):
            raise ValueError(f"bwd={self.bwd!r} must be 'gluon' or 'pallas_triton'")
        if self.bwd_block_k not in (16, 32, 64):
            raise ValueError(f"bwd_block_k={self.bwd_block_k!r} must be 16, 32 or 64")
        if isinstance(self.bwd_stages, bool) or self.bwd_stages not in (1, 2, 3, 4):
            raise ValueError(f"bwd_stages={self.bwd_stages!r} must be an int in 1..4")
        if not isinstance(self.bwd_prefetch, bool):
            raise ValueError(f"bwd_prefetch={self.bwd_prefetch!r} must be a bool")
        if isinstance(self.bwd_ablate, bool) or self.bwd_ablate not in (0, 1, 2, 3, 4):
            raise ValueError(f"bwd_ablate={self.bwd_ablate!r} must be 0 (off) or 1..4 "
                             f"(benchmark only)")
        if self.block_k not in (32, 64):
            raise ValueError(f"block_k={self.block_k!r} must be 32 or 64")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not (
                1 <= self.stages <= 4):
            raise ValueError(f"stages={self.stages!r} must be an int in 1..4")
        r = self.producer_regs
        if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 24 <= r <= 256:
            raise ValueError(f"producer_regs={r!r} must be a multiple of 8 in 24..256")
        for name in ("pipeline", "smem_epilogue", "prefetch", "alt_split"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.ablate not in (0, 1, 2, 3, 4) or isinstance(self.ablate, bool):
            raise ValueError(f"ablate={self.ablate!r} must be 0 (off) or 1..4 (benchmark only)")
        if self.ablate and self.pipeline:
            raise ValueError("ablate applies to pipeline=False only")
        if self.schedule not in ("auto", "default", "alternate"):
            raise ValueError(f"schedule={self.schedule!r} must be 'auto', 'default' or "
                             f"'alternate'")
        a = self.alt_regs
        if isinstance(a, bool) or not isinstance(a, int) or a % 8 or not 128 <= a <= 240:
            raise ValueError(f"alt_regs={a!r} must be a multiple of 8 in 128..240")
        if self.alt_split and self.resolved_schedule != "alternate":
            raise ValueError("alt_split=True applies to schedule='alternate' only")
        if self.schedule == "alternate":
            if self.stages % 2:
                raise ValueError(f"schedule='alternate' needs an even stages, got "
                                 f"stages={self.stages}")
            on = self._lockstep_options()
            if on:
                raise ValueError(f"{', '.join(on)} apply to schedule='default' only "
                                 f"(schedule='alternate' has its own overlap and epilogue)")

    def _lockstep_options(self):
        return [n for n in ("pipeline", "smem_epilogue", "ablate") if getattr(self, n)]

    @property
    def resolved_schedule(self):
        """"default" or "alternate": what schedule="auto" runs (an option that only the
        lockstep kernel has, or an odd ring depth, selects "default")."""
        if self.schedule != "auto":
            return self.schedule
        return "default" if self._lockstep_options() or self.stages % 2 else "alternate"


def shared_bytes(D, config, itemsize=2):
    """Shared memory the kernel's buffers need (q + ring; "alternate" adds its two P tiles and
    the max / sum exchange; the compiler adds a few KiB)."""
    from csa_jax.kernels.gluon.dims import HB, padded_dims
    Dp = padded_dims(64, D, config.block_k, config.block_k)[1]
    extra = 0
    if config.resolved_schedule == "alternate":
        extra = 2 * HB * config.block_k * itemsize + 8 * HB * 4
    return (HB + config.stages * config.block_k) * Dp * itemsize + extra


_SMEM_BUDGET = 232_448 - 16_384      # the H200's per-block limit minus compiler scratch


def default_config(q_shape, kv_shape, idx_shape, dtype) -> Config:
    """block_k 64, 2 stages at D = 512 (the most that fits the H200's 227 KiB), more stages for
    smaller D while they fit; block_k 32 if even 2 stages of 64 rows would not fit."""
    del kv_shape, idx_shape
    D = q_shape[3]
    cfg = _bwd_default(D, Config())
    for stages in (4, 3, 2):
        c = dataclasses.replace(cfg, stages=stages)
        if shared_bytes(D, c) <= _SMEM_BUDGET:
            return c
    return dataclasses.replace(cfg, block_k=32, stages=2)


def _bwd_default(D, cfg):
    """The dq kernel's tiles: the largest (rows, stages) of 64x3, 64x2, 32x3, 32x2, 16x4 whose
    buffers fit (32 x 2 at D = 512); dims.dq_shared_bytes counts every buffer and barrier."""
    from csa_jax.kernels.gluon.dims import SMEM_LIMIT, dq_shared_bytes as bwd_bytes
    for bk, st in ((64, 3), (64, 2), (32, 3), (32, 2), (16, 4)):
        if bwd_bytes(D, bk, st) <= SMEM_LIMIT - 8192:
            return dataclasses.replace(cfg, bwd_block_k=bk, bwd_stages=st)
    return cfg


def _device():
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return "cpu", "", None
    cc = getattr(d, "compute_capability", None)
    return d.platform, d.device_kind, cc


def _cannot_run(q_shape, dtype):
    """Why the kernel cannot run here at all (None = it can)."""
    why = _missing_triton(launch=True)
    if why:
        return why
    platform, kind, cc = _device()
    if platform not in _GPU_PLATFORMS or "nvidia" not in kind.lower():
        return f"needs an NVIDIA Hopper GPU (platform={platform!r}, device_kind={kind!r})"
    if cc is not None and not str(cc).startswith("9"):
        return f"needs compute capability 9.x (sm_90a wgmma), got {cc}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name}: the Gluon kernel takes bf16/f16 (wgmma)"
    cfg = default_config(q_shape, None, None, dtype)
    if shared_bytes(q_shape[3], cfg) > _SMEM_BUDGET:
        return f"D={q_shape[3]} needs {shared_bytes(q_shape[3], cfg)} B of shared memory"
    return None


def unsupported(q_shape, kv_shape, idx_shape, dtype):
    """Why impl="auto" should not pick this impl (None = it may): it must be able to run here
    (triton + jax-triton, NVIDIA compute capability 9.x, bf16/f16), and the problem must be in
    the measured regime, H a multiple of 64 and D = 512 (docs/perf/gluon_h200.md). Other H and D
    run when requested explicitly (padded to 64 heads / a power of two >= 64)."""
    del kv_shape, idx_shape
    why = _cannot_run(q_shape, dtype)
    if why:
        return why
    H, D = q_shape[2], q_shape[3]
    if H % 64 or D != 512:
        return f"H={H}, D={D}: measured only for H a multiple of 64 and D = 512"
    return None


def _check(q, kv, idx, interpret):
    if interpret:
        raise NotImplementedError(
            "impl='gluon' has no interpreter (Gluon kernels compile for GPUs only); use "
            "impl='pallas_triton' or 'xla' on a CPU, or interpret=None/False on a GPU")
    why = _cannot_run(q.shape, q.dtype)
    if why:
        raise NotImplementedError(f"impl='gluon' cannot run here: {why}")


def forward(q, kv, idx, sink, *, scale, interpret, config):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 (the impl interface: csa_jax/registry.py)."""
    _check(q, kv, idx, interpret)
    from csa_jax.kernels.gluon import fwd as _fwd
    return _fwd.forward(q, kv, idx, sink, scale=float(scale), config=config)


def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """(dq, dkv, dsink): Config.bwd picks the Gluon dq kernel or the pallas_triton backward."""
    _check(q, kv, idx, interpret)
    if config.bwd == "gluon":
        from csa_jax.kernels.gluon import bwd as _bwd
        return _bwd.backward(q, kv, idx, sink, o, lse, do, dlse, scale=float(scale),
                             block_k=config.bwd_block_k, stages=config.bwd_stages,
                             producer_regs=config.producer_regs, prefetch=config.bwd_prefetch,
                             ablate=config.bwd_ablate)
    from csa_jax.kernels import triton as pt      # the pallas_triton impl module
    cfg = pt.default_config(q.shape, kv.shape, idx.shape, q.dtype)
    return pt.backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale, interpret=False,
                       config=cfg)
