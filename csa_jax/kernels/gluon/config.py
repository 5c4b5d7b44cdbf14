"""Config of impl="gluon": the choices a user or default_config (the package's) makes
(docs/gluon.md)."""
from __future__ import annotations

import dataclasses

from csa_jax.kernels.gluon.dims import SMEM_LIMIT, small_heads_block
from csa_jax.layouts import check_window_pool

LAYOUTS = ("generic", "cr0", "cr4", "cr128")
WINDOW_KERNEL = 128          # the window the cr0 window kernel runs for (window.py)
SMEM_BUDGET = SMEM_LIMIT - 16_384      # the forward's buffers: the limit minus compiler scratch


def _int_in(name, value, allowed):
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {tuple(allowed)}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of impl="gluon" (defaults: default_config, per shape and device).

    block_k, stages: the forward's gathered kv rows per ring stage (64 or 32) and the ring's
        depth (1..4; the NVIDIA forward's alternating warpgroups need an even depth: 2 at
        D = 512, where q 64 KiB + 2 x 64 KiB stages fill the H200's shared memory).
    layout, window, pool_ratio: what the caller promises about idx (csa_spec.md section 4;
        `sparse_attention(..., layout=...)` sets them, the NNX layer does for its layer type):
        "generic" nothing; "cr0" slots [0, window) hold token t's window rows
        max(0, t - window + 1) .. t (each once, any order, -1 for the rest), every later slot
        -1; "cr4" the same window, the other slots arbitrary; "cr128" the same window, then the
        visible pool rows T + p, p < (t + 1) // pool_ratio, -1 elsewhere. "cr0" with window 128
        runs the window kernel (window.py, which does not read idx; a concrete idx is checked
        first, a traced one inside: tokens that break the promise get NaN); the others run the
        gather kernel.
    bwd: "gluon" (the dq kernel of bwd.py, at H <= 32 on NVIDIA the few-heads one of
        small_heads_dq.py; dkv by the deterministic per-slot GEMM and inverse-map reduce) or
        "pallas_triton" (that impl's whole backward on this forward's (o, lse): the escape
        hatch).
    fwd_consumers: consumer warpgroups of the few-heads forward (small_heads.py, H <= 16,
        D >= 128, a ring of >= 3 stages): 1, or 2 splitting each token's tiles (one's softmax overlaps
        the other's products; merged at the token's end). Other forwards take 1 only.
    bwd_block_k, bwd_stages: the dq kernel's ring tile rows (16, 32, 64) and depth (1..4):
        32 x 2 at D = 512; the few-heads dq kernel takes 64-row tiles (3 stages at H <= 16,
        2 at H <= 32 for D = 512).
    bwd_dkv: the few-heads backward's dkv (NVIDIA, H <= 32): "slots" (the per-slot GEMM
        [T, K, D] and the inverse-map reduce, dkv.py) or "blocks" (kv row blocks x tokens on
        wgmma, no intermediate: dkv_blocks.py; a call whose lists repeat a row within a token,
        or whose block maps would pass 2 GiB or int32, takes "slots"). Both deterministic.
    """

    block_k: int = 64
    stages: int = 2
    layout: str = "generic"
    window: int = 128
    pool_ratio: int = 128
    fwd_consumers: int = 1
    bwd: str = "gluon"
    bwd_block_k: int = 32
    bwd_stages: int = 2
    bwd_dkv: str = "slots"

    def __post_init__(self):
        _int_in("block_k", self.block_k, (32, 64))
        _int_in("stages", self.stages, (1, 2, 3, 4))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        check_window_pool(self.window, self.pool_ratio)
        _int_in("fwd_consumers", self.fwd_consumers, (1, 2))
        if self.bwd not in ("gluon", "pallas_triton"):
            raise ValueError(f"bwd={self.bwd!r} must be 'gluon' or 'pallas_triton'")
        _int_in("bwd_block_k", self.bwd_block_k, (16, 32, 64))
        _int_in("bwd_stages", self.bwd_stages, (1, 2, 3, 4))
        if self.bwd_dkv not in ("slots", "blocks"):
            raise ValueError(f"bwd_dkv={self.bwd_dkv!r} must be 'slots' or 'blocks'")

    @property
    def window_kernel(self) -> bool:
        """Whether the promise is the one the cr0 window kernel is built for (cr0, window 128);
        runs_window_kernel says whether the forward runs it."""
        return self.layout == "cr0" and self.window == WINDOW_KERNEL

    def runs_window_kernel(self, heads: int) -> bool:
        """Whether the NVIDIA forward runs the cr0 window kernel (else a gather kernel) for
        `heads` query heads: under window_kernel's promise above 32 heads. At H <= 32 the
        few-heads forward runs under any promise: the window kernel's 64-head programs took
        3-4.6x its time there (docs/perf/heads_h100.md)."""
        return self.window_kernel and small_heads_block(heads) is None
