"""TPU kernel config: the tuning knobs, their defaults, and the layout promise check."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm
from csa_jax import layouts

LAYOUTS = ("generic", "cr0", "cr4", "cr128")
# Where the kernels run compiled; elsewhere interpret=None means interpret mode.
PLATFORMS = ("tpu",)



# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs of the TPU kernels (hashable, validated in __post_init__).

    block_t      tokens per program (a program owns all H heads of its tokens).
    block_k      rows per ring slot: one gathered tile (block_k slots of one token) or one
                 contiguous tile (block_k consecutive kv rows: window union or cr128 pool).
    depth        ring slots, 2..4: depth - 1 tiles are in flight while one is computed.
    block_r      kv rows (or row segments) per program of the CSR gather-reduce forming dkv.
    fanin_split  slots per segment of that reduce: a row used by more slots is summed in
                 segments by several programs, then the segments are added (fixed order).
    token_chunk  tokens per backward launch (None = all T): bounds the f32 intermediates of
                 a launch (the gathered slots' [token_chunk, K_g, D], the structured tiles'
                 per-block partials); a multiple of block_t. Each launch streams every tile
                 of its own tokens only.
    layout       what the caller promises about idx (csa_spec.md section 4):
                 "generic" (default): nothing; every slot is gathered by its own DMA.
                 "cr0":   slots [0, window) hold token t's window rows max(0, t-window+1)..t
                          (each once, any order, -1 for the rest) and every later slot is -1.
                 "cr4":   the same window; slots [window, K) are arbitrary (gathered per row).
                 "cr128": the same window; slots [window, K) hold pool rows T + p for every
                          p < (t + 1) // pool_ratio (any order), -1 elsewhere; N - T pool rows.
                 Structured layouts fetch the window union of a token block (and the cr128 pool)
                 as contiguous tiles, one DMA per tile, and ignore idx there; check_layout
                 verifies the promise (forward calls it whenever idx is concrete).
    window, pool_ratio  the layout's window size and (cr128) pool ratio.
    vmem_limit_bytes  the scoped VMEM limit the kernels are compiled under; None: the
                 generation's default (vmem_limit; docs/pallas_tpu.md says why).
    """
    block_t: int = 8
    block_k: int = 128
    depth: int = 2
    block_r: int = 64
    token_chunk: int | None = None
    layout: str = "generic"
    window: int = 128
    pool_ratio: int = 128
    fanin_split: int = 512
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        for name in ("block_t", "block_k", "block_r", "window", "pool_ratio", "fanin_split"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config.{name}={v!r} must be a positive int")
        if self.block_k % 8:
            raise ValueError(f"Config.block_k={self.block_k} must be a multiple of 8")
        if self.block_r % 8:
            raise ValueError(f"Config.block_r={self.block_r} must be a multiple of 8")
        if self.depth not in (2, 3, 4):
            raise ValueError(f"Config.depth={self.depth!r} must be 2, 3 or 4")
        c = self.token_chunk
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1
                              or c % self.block_t):
            raise ValueError(f"Config.token_chunk={c!r} must be None or a positive multiple "
                             f"of block_t={self.block_t}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Config.layout={self.layout!r} must be one of {LAYOUTS}")
        if self.pool_ratio < 2:
            raise ValueError(f"Config.pool_ratio={self.pool_ratio} must be >= 2")
        v = self.vmem_limit_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"Config.vmem_limit_bytes={v!r} must be None or a positive int")


# The topology names aot.py compiles for and the chip versions they are (pltpu.get_tpu_info).
GENERATIONS = {"TPU_V4": "v4", "TPU_V5E": "v5e", "TPU_V5P": "v5p", "TPU_V6E": "v6e"}
# Scoped VMEM the backward asks for per (token, head) row of a program and unit of D, bf16 and
# f32, as the real compiler reported it (docs/pallas_tpu.md: Pro, D = 512, block_t 8: 18.3 MiB
# bf16, 39.7 MiB f32; f32 products run as several bf16 MXU passes with their own temporaries).
_BWD_VMEM_PER_ROW_D = (36, 80)


def current_generation():
    """The TPU generation being compiled for ("v4", "v5e", ...; the default device's, which
    jax.default_device sets when compiling ahead of time), None on a CPU / GPU or unknown."""
    try:
        info = pltpu.get_tpu_info()
    except ValueError:      # not a TPU device (CPU, GPU): "Unsupported TPU device kind"
        return None
    return GENERATIONS.get(info.chip_version.name, info.chip_version.name)


def generation_vmem(generation):
    """(VMEM bytes per TensorCore, the scoped VMEM limit the kernels are compiled under) of a
    generation name or chip version. The limit: all of VMEM on a 16 MiB part (v4), else 3/4
    of it, at most 64 MiB (v5e, v6e: 64 of 128 MiB; v5p: 48 of 64 MiB): every kernel's need at
    the default block sizes is below (at most 39.7 MiB) and XLA keeps the rest."""
    chip = {v: k for k, v in GENERATIONS.items()}.get(generation, generation)
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion[chip], 1)
    cap = info.vmem_capacity_bytes
    return cap, (cap if cap <= (16 << 20) else min(cap * 3 // 4, 64 << 20))


def vmem_limit(config, interpret=False):
    """The scoped VMEM limit (bytes) a kernel is compiled under: config.vmem_limit_bytes if
    set, else generation_vmem's limit for the generation being compiled for (None in interpret
    mode or for an unknown device: Mosaic's own default)."""
    if config.vmem_limit_bytes is not None or bm.resolve_interpret(interpret, PLATFORMS):
        return config.vmem_limit_bytes
    gen = current_generation()
    return None if gen is None else generation_vmem(gen)[1]


def compiler_params(config, interpret):
    """Mosaic compiler parameters of every TPU kernel: a (batch, block) grid of independent
    programs and the scoped VMEM limit."""
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                vmem_limit_bytes=vmem_limit(config, interpret))


def default_config(q_shape, kv_shape, idx_shape, dtype, *, layout="generic", window=128,
                   pool_ratio=128, generation=None) -> Config:
    """The default Config for these shapes (what the public op uses when given none).

    Rule. block_k = 128 (one lane-width tile) when K >= 128, else K rounded up to 8.
    block_t: generic layout 8 tokens (a sublane tile of o; T itself when T < 8); structured
    layouts (window reuse) as many tokens as keep the block's (token, head) rows near 256
    (256 // H rounded down to 8, at least 8; T itself when T is smaller), because a larger block
    shares one window union among more tokens (DMAs per token ~ (block_t + window) / block_t /
    block_k). depth 3 when a program streams at least 4 tiles (two loads in flight), else 2.
    block_r = 64, fanin_split = 512. token_chunk = None (all T in one backward launch) unless
    the backward's f32 intermediates of one sequence would exceed 1 GiB: per token D*4 bytes
    times K_g (the gathered slots: K for generic, K - window for cr4, none for cr0 / cr128)
    plus n_struct * block_k / block_t (its share of its block's window / pool tile partials,
    structured layouts); then the largest multiple of block_t that fits (at least block_t).
    On a TPU generation (`generation`, default: the one being compiled for; none on a CPU)
    block_t is then halved until the backward's scoped VMEM, about block_t*H*D*36 bytes (bf16)
    or *80 (f32), is at most 80% of the generation's limit (generation_vmem; the table per
    generation is in docs/pallas_tpu.md).
    layout / window / pool_ratio are passed through (the caller's promise about idx)."""
    del kv_shape
    _, t, h, d = q_shape
    k = idx_shape[-1]
    block_k = 128 if k >= 128 else bm.round_up(max(k, 1), 8)
    if layout == "generic":
        block_t = min(8, t)
    else:
        cap = max(8, (256 // h) // 8 * 8)
        block_t = t if t <= cap else cap
    generation = generation or current_generation()
    if generation is not None:
        budget = generation_vmem(generation)[1] * 4 // 5
        per_row = h * d * _BWD_VMEM_PER_ROW_D[jnp.dtype(dtype).itemsize >= 4]
        while block_t > 1 and block_t * per_row > budget:
            block_t //= 2
    if layout == "generic":
        n_steps = block_t * bm.num_tiles(k, block_k)
    else:
        n_steps = bm.num_tiles(block_t + window - 1, block_k) + bm.num_tiles(k - window, block_k)
    depth = 3 if n_steps >= 4 else 2
    # f32 backward intermediates per token: the gathered slots' dkv parts, and a share of its
    # block's window / pool tile partials (window union + 15 alignment rows, cr128 pool)
    k_g = {"generic": k, "cr4": k - window}.get(layout, 0)
    n_struct = 0
    if layout != "generic":
        n_struct = bm.num_tiles(block_t + window + 14, block_k)
        if layout == "cr128":
            n_struct += bm.num_tiles(t // pool_ratio, block_k)
    per_token = (k_g + n_struct * block_k / block_t) * d * 4
    token_chunk = None
    if t * per_token > (1 << 30):
        token_chunk = max(block_t, int((1 << 30) // per_token) // block_t * block_t)
    return Config(block_t=block_t, block_k=block_k, depth=depth, token_chunk=token_chunk,
                  layout=layout, window=window, pool_ratio=pool_ratio)


def _sorted_rows(x):
    """Each row's non-empty ids in ascending order, empties (-1) moved to the end as -1."""
    big = np.iinfo(np.int32).max
    x = np.sort(np.where(x >= 0, x, big), axis=-1)
    return np.where(x == big, -1, x)


def check_layout(idx, num_kv, config):
    """Eager check that a concrete idx [B, T, K] keeps the promise of config.layout (see Config);
    raises ValueError naming the first token whose slots break it. No-op for "generic"."""
    if config.layout == "generic":
        return
    idx = np.asarray(idx)
    _, t, k = idx.shape
    w = config.window
    if k < w:
        raise ValueError(f"layout={config.layout!r} needs K >= window, got K={k}, window={w}")
    tok = np.arange(t)[:, None]
    j = np.arange(w)[None, :]
    start = np.maximum(tok - w + 1, 0)
    want_win = np.where(j <= tok - start, start + j, -1)                  # [T, window]
    checks = [("window", idx[:, :, :w], want_win, slice(None, w))]
    if config.layout == "cr0":
        checks.append(("-1 (nothing after the window)", idx[:, :, w:],
                       np.full((t, k - w), -1), slice(w, None)))
    if config.layout == "cr128":
        j = np.arange(k - w)[None, :]
        visible = (tok + 1) // config.pool_ratio
        if num_kv < t + visible.max(initial=0):
            raise ValueError(f"layout='cr128': {num_kv=} kv rows cannot hold the "
                             f"{visible.max()} pool rows visible at T={t}")
        checks.append(("the visible pool", idx[:, :, w:], np.where(j < visible, t + j, -1),
                       slice(w, None)))
    for what, got, want, sl in checks:
        got = _sorted_rows(got)
        bad = np.argwhere(np.any(got != want[None], axis=-1))
        if bad.size:
            b, tk = (int(v) for v in bad[0])
            raise ValueError(
                f"layout={config.layout!r}: idx[{b}, {tk}, {sl.start or 0}:{sl.stop or k}] holds "
                f"rows {sorted(int(v) for v in got[b, tk] if v >= 0)}, expected {what} "
                f"{sorted(int(v) for v in want[tk] if v >= 0)}")


def layout_broken(idx, n, config):
    """The structured-layout promise: None if it holds for sure (generic, or a concrete idx,
    checked here: ValueError naming the token otherwise); for a traced idx, bool [B, T] of the
    tokens breaking it, whose outputs the caller sets to NaN (csa_jax/layouts.py)."""
    if config.layout == "generic":
        return None
    if not isinstance(idx, jax.core.Tracer):
        check_layout(idx, n, config)
        return None
    return layouts.violations(idx, config.layout, config.window, config.pool_ratio)


def _maybe_check_layout(idx, n, config):
    """check_layout when idx is concrete; under jit (a tracer) the promise is trusted."""
    if config.layout == "generic":
        return
    try:
        idx = np.asarray(idx)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    check_layout(idx, n, config)
