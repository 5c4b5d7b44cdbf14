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
    layout: what the caller promises about idx (csa_spec.md section 4; the same promise as
        pallas_tpu's Config.layout, checked by check_layout / csa_jax/layouts.py):
        "generic" (default) nothing; "cr0" slots [0, window) hold token t's window rows
        max(0, t - window + 1) .. t (each once, any order, -1 for the rest), every later slot -1;
        "cr4" the same window, the other slots arbitrary; "cr128" the same window, then the
        visible pool rows T + p, p < (t + 1) // pool_ratio (any order), -1 elsewhere.
        cr0 / cr128 run the window-reuse kernel (window.py: a block of 16 tokens copies its
        window union once and every token reads it at its own offset; idx is not read, a traced
        idx that breaks the promise gives NaN for its tokens); generic / cr4 the gather kernel.
        Measured on the H200 it is no faster than the gather kernel, and cr128's numerics have
        not been checked there yet (docs/perf/gluon_h200.md, window reuse).
    window, pool_ratio: the layout's window (the window kernel takes 64 or 128) and cr128 ratio.
    win_programs: programs per (sequence, head block) of the window kernel along the tokens
        (0 = one program per SM in all); win_producer_regs: its producer's registers (40: its
        consumers need the rest, 232, for a 144-row span without spills); pool_tile,
        pool_stages: its cr128 pool ring (rows per tile, depth); win_p_smem: cr0's window P
        goes to the PV products through shared memory instead of registers (cr128 always uses
        the pool slot for it: window.p_smem_mode). win_ablate: BENCHMARK ONLY, wrong results:
        1 = the window kernel computes everything but stores no o / lse, 2 = its consumers only
        wait for and release the copies (the producer's pace).
    ablate: BENCHMARK ONLY, wrong results: 1 = no PV product, 2 = no QK^T product, 3 = neither,
        4 = no compute at all (the consumers only wait for and release the ring: the producer's
        pace). Used to place the time inside the kernel (docs/perf/gluon_h200.md).
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
    layout: str = "generic"
    window: int = 128
    pool_ratio: int = 128
    win_programs: int = 0
    win_producer_regs: int = 40
    pool_tile: int = 16
    pool_stages: int = 1
    win_p_smem: bool = False
    win_ablate: int = 0
    ablate: int = 0
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
        for name in ("pipeline", "smem_epilogue", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.ablate not in (0, 1, 2, 3, 4) or isinstance(self.ablate, bool):
            raise ValueError(f"ablate={self.ablate!r} must be 0 (off) or 1..4 (benchmark only)")
        if self.ablate and self.pipeline:
            raise ValueError("ablate applies to pipeline=False only")
        _check_layout_fields(self)


LAYOUTS = ("generic", "cr0", "cr4", "cr128")


def _check_layout_fields(c):
    if c.layout not in LAYOUTS:
        raise ValueError(f"layout={c.layout!r} must be one of {LAYOUTS}")
    for name in ("window", "pool_ratio", "pool_tile", "pool_stages", "win_producer_regs"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if isinstance(c.win_programs, bool) or not isinstance(c.win_programs, int) or (
            c.win_programs < 0):
        raise ValueError(f"win_programs={c.win_programs!r} must be an int >= 0 (0 = auto)")
    if c.pool_ratio < 2:
        raise ValueError(f"pool_ratio={c.pool_ratio} must be >= 2")
    if c.win_producer_regs % 8 or not 24 <= c.win_producer_regs <= 256:
        raise ValueError(f"win_producer_regs={c.win_producer_regs} must be a multiple of 8 in "
                         f"24..256")
    if c.layout in ("cr0", "cr128") and c.window not in (64, 128):
        raise ValueError(f"window={c.window}: the window-reuse kernel (layout={c.layout!r}) "
                         f"takes window 64 or 128")
    if not isinstance(c.win_p_smem, bool):
        raise ValueError(f"win_p_smem={c.win_p_smem!r} must be a bool")
    if isinstance(c.win_ablate, bool) or c.win_ablate not in (0, 1, 2):
        raise ValueError(f"win_ablate={c.win_ablate!r} must be 0 (off), 1 or 2 (benchmark only)")
    if c.pool_tile not in (16, 32, 64):
        raise ValueError(f"pool_tile={c.pool_tile} must be 16, 32 or 64")


def shared_bytes(D, config, itemsize=2):
    """Shared memory the kernel's buffers need (q + ring; the compiler adds a few KiB)."""
    from csa_jax.kernels.gluon.dims import HB, padded_dims
    Dp = padded_dims(64, D, config.block_k, config.block_k)[1]
    return (HB + config.stages * config.block_k) * Dp * itemsize


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


def _first_rows(row, limit=12):
    rows = sorted(int(v) for v in row if v >= 0)
    more = f" ... ({len(rows)} in all)" if len(rows) > limit else ""
    return f"{rows[:limit]}{more}"


def check_layout(idx, num_kv, config):
    """Eager check that a concrete (sanitized) idx [B, T, K] keeps config.layout's promise,
    by csa_jax/layouts.py's exact-set test; ValueError naming the first token that breaks it,
    what its slots hold and what the promise wants. No-op for "generic"."""
    if config.layout == "generic":
        return
    import numpy as np
    from csa_jax import layouts
    idx = np.asarray(idx)
    _, t_len, k = idx.shape
    w, r = config.window, config.pool_ratio
    if k < w:
        raise ValueError(f"layout={config.layout!r} needs K >= window, got K={k}, window={w}")
    if config.layout == "cr128" and num_kv < t_len + t_len // r:
        raise ValueError(f"layout='cr128': num_kv={num_kv} rows cannot hold the "
                         f"{t_len // r} pool rows visible at T={t_len} (pool_ratio={r})")
    bad = np.asarray(layouts.violations(jnp.asarray(idx, jnp.int32), config.layout, w, r))
    if not bad.any():
        return
    b, t = (int(v) for v in np.argwhere(bad)[0])
    want = f"window rows {max(t - w + 1, 0)}..{t} in slots [0, {w})"
    if config.layout == "cr0":
        want += f", nothing (-1) in slots [{w}, {k})"
    elif config.layout == "cr128":
        vis = (t + 1) // r
        want += (f", pool rows {t_len}..{t_len + vis - 1}" if vis else ", no pool row") + (
            f" in slots [{w}, {k})")
    raise ValueError(
        f"layout={config.layout!r}: idx[{b}, {t}] breaks the promise ({int(bad.sum())} "
        f"token(s) do): slots [0, {w}) hold {_first_rows(idx[b, t, :w])}, slots [{w}, {k}) "
        f"hold {_first_rows(idx[b, t, w:])}; expected {want}, each row once")


def forward(q, kv, idx, sink, *, scale, interpret, config):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 (the impl interface: csa_jax/registry.py).
    layout cr0 / cr128: the window-reuse kernel, which does not read idx; a concrete idx is
    checked here (check_layout); for a traced one csa_jax/layouts.py finds the tokens that break
    the promise and the kernel writes their o and lse as NaN."""
    _check(q, kv, idx, interpret)
    if config.layout in ("cr0", "cr128"):
        from csa_jax import layouts
        from csa_jax.kernels.gluon import window as _win
        if isinstance(idx, jax.core.Tracer):
            bad = layouts.violations(idx, config.layout, config.window, config.pool_ratio)
        else:
            check_layout(idx, kv.shape[1], config)
            bad = jnp.zeros(idx.shape[:2], jnp.int32)
        return _win.forward(q, kv, sink, bad, scale=float(scale), config=config)
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
