"""impl="gluon": CSA kernels in Triton's Gluon dialect, called from JAX (docs/gluon.md).

The impl-module interface of csa_jax/registry.py: Config (config.py), default_config,
forward, backward, unsupported, check_layout. One kernel per job (the explicit data mover: a
producer partition gathers kv rows with cp.async into an mbarrier ring, consumer warpgroups
run wgmma; ring.py holds what they share):

- forward, NVIDIA Hopper: fwd.py (FlashMLA's alternating consumer warpgroups, 64 heads a
  program); at H <= 32 small_heads.py (the kv rows as wgmma's M, the heads as N); under the cr0
  promise with window 128, window.py (a block of 16 tokens copies its window once);
- backward: bwd.py's dq kernel (it also writes scale*dS, P and [q; dO]; at H <= 32
  small_heads_dq.py, the kv rows as M), then dkv by a per-slot GEMM in XLA and dkv.py's
  deterministic inverse-map gather-reduce (at H <= 32 by default dkv_blocks.py: kv row
  blocks x tokens on wgmma, no per-slot intermediate); Config.bwd="pallas_triton"
  runs that impl's whole backward instead;
- AMD (gfx942 / gfx950 / gfx1250): amd_fwd.py and amd_bwd.py, COMPILED FOR THOSE TARGETS ON A
  CPU, NEVER RUN (no AMD GPU was available: neither their numerics nor the ROCm launch path
  are tested); auto never picks gluon on ROCm.

Needs the optional extra `csa_jax[gluon]` (triton==3.6.0, jax-triton==0.3.1) and an NVIDIA GPU of
compute capability 9.0 (sm_90a: wgmma, setmaxnreg). Gluon has no CPU interpreter: on a CPU the
kernels can only be compiled (adapter.compile_kernel), never run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from csa_jax.kernels.gluon.adapter import missing as _missing_triton
from csa_jax.kernels.gluon.config import SMEM_BUDGET, Config
from csa_jax.kernels.gluon.dims import (AMD_DEFAULTS, AMD_DQ_DEFAULTS, amd_arch, dq_tiles,
                                        fwd_shared_bytes, small_heads_block,
                                        small_heads_shared_bytes, small_heads_stages,
                                        SMALL_HEADS_BUDGET)

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _device():
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return "cpu", "", None
    cc = getattr(d, "compute_capability", None)
    return d.platform, d.device_kind, cc


def _amd():
    """The gfx architecture of the first device if it is an AMD GPU, else None."""
    platform, kind, cc = _device()
    if platform == "rocm" or "amd" in kind.lower() or kind.lower().startswith("gfx"):
        return amd_arch(kind, cc) or f"unknown AMD GPU ({kind!r}, {cc!r})"
    return None


def default_config(q_shape, kv_shape, idx_shape, dtype, *, layout="generic", window=128,
                   pool_ratio=128) -> Config:
    """NVIDIA, H <= 32: the few-heads forward (small_heads.py) and dq kernel
    (small_heads_dq.py), each with the deepest ring of 64-row tiles that fits (3 at H <= 16,
    2 at H <= 32 for D = 512), and dkv by row blocks (bwd_dkv="blocks", dkv_blocks.py: steps
    1.22-1.93x faster than the per-slot path on lists without repeats, H100); at H <= 16 and
    D = 512 two forward consumer warpgroups (fwd_consumers=2: 7-13% faster on cr4 lists) unless
    the promise is cr0 / cr128 (8-11% slower there) (docs/perf/heads_h100.md).
    NVIDIA, H > 32: block_k 64 and the deepest even ring that fits (4 for D <= 256, 2 at D = 512;
    block_k 32 if even 2 stages of 64 rows would not fit); the dq kernel's tiles from
    dims.dq_tiles (32 x 2 at D = 512). AMD: the per-target tiles of dims.AMD_DEFAULTS /
    AMD_DQ_DEFAULTS. layout / window / pool_ratio: the caller's promise, passed through."""
    del kv_shape, idx_shape, dtype
    D = q_shape[3]
    promise = dict(layout=layout, window=window, pool_ratio=pool_ratio)
    arch = _amd()
    if arch in AMD_DEFAULTS:
        d, b = AMD_DEFAULTS[arch], AMD_DQ_DEFAULTS[arch]
        return Config(block_k=d["block_k"], stages=d["stages"], bwd_block_k=b["block_k"],
                      bwd_stages=b["stages"], **promise)
    bk, bs = dq_tiles(D) or (32, 2)
    hn = small_heads_block(q_shape[2])
    if hn:
        # the few-heads forward and dq kernel: the deepest rings that fit
        stages, dq_stages = small_heads_stages(D, hn), small_heads_stages(D, hn, planes=2)
        if stages and dq_stages:
            pair = hn == 16 and D == 512 and stages >= 3 and layout not in ("cr0", "cr128")
            return Config(block_k=64, stages=stages, bwd_block_k=64, bwd_stages=dq_stages,
                          fwd_consumers=2 if pair else 1, bwd_dkv="blocks", **promise)
    for stages in (4, 2):
        if fwd_shared_bytes(D, 64, stages) <= SMEM_BUDGET:
            return Config(block_k=64, stages=stages, bwd_block_k=bk, bwd_stages=bs, **promise)
    return Config(block_k=32, stages=2, bwd_block_k=bk, bwd_stages=bs, **promise)


def _cannot_run(q_shape, dtype):
    """Why the kernel cannot run here at all (None = it can)."""
    why = _missing_triton(launch=True)
    if why:
        return why
    platform, kind, cc = _device()
    arch = _amd()
    if arch is not None:
        if arch not in AMD_DEFAULTS:
            return f"{arch}: AMD Gluon kernels are built for {sorted(AMD_DEFAULTS)} only"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"dtype {jnp.dtype(dtype).name}: the Gluon kernels take bf16/f16"
        return None
    if platform not in _GPU_PLATFORMS or "nvidia" not in kind.lower():
        return f"needs an NVIDIA Hopper GPU (platform={platform!r}, device_kind={kind!r})"
    if cc is not None and not str(cc).startswith("9"):
        return f"needs compute capability 9.x (sm_90a wgmma), got {cc}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name}: the Gluon kernel takes bf16/f16 (wgmma)"
    cfg = default_config(q_shape, None, None, dtype)
    hn = small_heads_block(q_shape[2])
    need, budget = ((small_heads_shared_bytes(q_shape[3], hn, cfg.stages), SMALL_HEADS_BUDGET)
                    if hn else (fwd_shared_bytes(q_shape[3], cfg.block_k, cfg.stages),
                                SMEM_BUDGET))
    if need > budget:
        return f"D={q_shape[3]} needs {need} B of shared memory"
    return None


def unsupported(q_shape, kv_shape, idx_shape, dtype):
    """Why impl="auto" may not pick this impl (None = it may): it must be able to run here
    (triton + jax-triton, NVIDIA compute capability 9.x, bf16/f16, the forward's buffers within
    shared memory). Which H and D it is picked for is registry.AUTO_GPU's measured table."""
    del kv_shape, idx_shape
    why = _cannot_run(q_shape, dtype)
    if why:
        return why
    if _amd():
        return (f"{_amd()}: the AMD Gluon forward is compiled, never run (no AMD GPU was "
                f"available); request impl='gluon' explicitly")
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
    Config.runs_window_kernel (the cr0 promise, H > 32): the cr0 window kernel, which does not
    read idx; a concrete idx is checked by the op before tracing (check_layout); for a traced
    one csa_jax/layouts.py finds the tokens that break the promise and the kernel writes their
    o and lse as NaN. At H <= 32 the few-heads forward runs under any promise (it reads idx, so
    the promise is only a promise, as on AMD)."""
    _check(q, kv, idx, interpret)
    arch = _amd()
    if config.fwd_consumers != 1 and (arch or small_heads_block(q.shape[2]) != 16):
        raise ValueError(f"fwd_consumers={config.fwd_consumers}: two consumer warpgroups are "
                         f"built for the NVIDIA few-heads forward at H <= 16 only "
                         f"(H={q.shape[2]}{', ' + arch if arch else ''})")
    if arch:            # (a layout promise is only a promise: AMD runs its gather kernel)
        from csa_jax.kernels.gluon import amd_fwd
        return amd_fwd.forward(q, kv, idx, sink, scale=float(scale), arch=arch,
                               block_k=config.block_k, stages=config.stages)
    if config.runs_window_kernel(q.shape[2]):
        from csa_jax import layouts
        from csa_jax.kernels.gluon import window as _win
        if isinstance(idx, jax.core.Tracer):
            bad = layouts.violations(idx, config.layout, config.window, config.pool_ratio)
        else:
            check_layout(idx, kv.shape[1], config)
            bad = jnp.zeros(idx.shape[:2], jnp.int32)
        return _win.forward(q, kv, sink, bad, scale=float(scale), window=config.window)
    hn = small_heads_block(q.shape[2])
    if hn:
        from csa_jax.kernels.gluon import small_heads as _small
        _check_small_heads(q.shape, hn, config)
        return _small.forward(q, kv, idx, sink, scale=float(scale), HN=hn,
                              stages=config.stages, consumers=config.fwd_consumers)
    if config.stages % 2:
        raise ValueError(f"stages={config.stages}: the NVIDIA forward (alternating consumer "
                         f"warpgroups) needs an even ring depth (2 or 4)")
    from csa_jax.kernels.gluon import fwd as _fwd
    return _fwd.forward(q, kv, idx, sink, scale=float(scale), config=config)


def _check_small_heads(q_shape, hn, config, dq=False):
    """The few-heads forward's (block_k, stages) or, with dq, the few-heads dq kernel's
    (bwd_block_k, bwd_stages): 64-row tiles, a ring within SMALL_HEADS_BUDGET."""
    H, D = q_shape[2], q_shape[3]
    what, pre = ("dq kernel", "bwd_") if dq else ("forward", "")
    block_k, stages = ((config.bwd_block_k, config.bwd_stages) if dq
                       else (config.block_k, config.stages))
    if block_k != 64:
        raise ValueError(f"{pre}block_k={block_k}: the few-heads {what} (H={H} <= 32) takes "
                         f"64-row tiles (the wgmma M dimension)")
    need = small_heads_shared_bytes(D, hn, stages, planes=2 if dq else 1,
                                    consumers=1 if dq else config.fwd_consumers)
    if need > SMALL_HEADS_BUDGET:
        raise ValueError(f"{pre}stages={stages}: the few-heads {what} at D={D}, {hn} heads "
                         f"needs {need} B of shared memory, over {SMALL_HEADS_BUDGET}")


def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """(dq, dkv, dsink): Config.bwd picks the Gluon dq kernel (NVIDIA at H <= 32 the
    few-heads one, small_heads_dq.py) + dkv path or the pallas_triton backward."""
    _check(q, kv, idx, interpret)
    hn = small_heads_block(q.shape[2])
    if config.bwd == "gluon" and hn and not _amd():
        from csa_jax.kernels.gluon import small_heads_dq as _sdq
        _check_small_heads(q.shape, hn, config, dq=True)
        return _sdq.backward(q, kv, idx, sink, o, lse, do, dlse, scale=float(scale), HN=hn,
                             stages=config.bwd_stages, dkv=config.bwd_dkv)
    if config.bwd == "gluon":
        from csa_jax.kernels.gluon import bwd as _bwd
        return _bwd.backward(q, kv, idx, sink, o, lse, do, dlse, scale=float(scale),
                             block_k=config.bwd_block_k, stages=config.bwd_stages, amd=_amd())
    from csa_jax.kernels import triton as pt      # the pallas_triton impl module
    cfg = pt.default_config(q.shape, kv.shape, idx.shape, q.dtype)
    return pt.backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale, interpret=False,
                       config=cfg)
