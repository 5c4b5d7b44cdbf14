"""DeepSeek-V4 attention shapes: presets per family and compression ratio, and the paper's grid."""
from __future__ import annotations

import dataclasses

FAMILIES = ("flash", "pro")
PRESET_RATIOS = (0, 4, 128)


def check_ratio(ratio, *, allow_zero=True, what="ratio"):
    """A compression ratio is 0 (window only) or an integer >= 2 (4 is the overlapping CSA one)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int):
        raise TypeError(f"{what} must be a Python int, got {ratio!r} ({type(ratio).__name__})")
    if ratio == 0 and allow_zero:
        return ratio
    if ratio < 2:
        allowed = "0 or an integer >= 2" if allow_zero else "an integer >= 2"
        raise ValueError(f"{what}={ratio} is not allowed: use {allowed} (V4 uses 0, 4 and 128)")
    return ratio


@dataclasses.dataclass(frozen=True)
class CSAConfig:
    """One attention layer: the V4 shapes (csa_spec.md sections 1 and 6; `preset()` fills them)
    and everything the NNX layer (csa_jax.layers.CSAAttention) takes. The one per-layer config:
    a model holds a base CSAConfig and a layer schedule, and each layer's config is the base with
    its own ratio (`dataclasses.replace(base, ratio=r)`)."""

    family: str | None = None  # "flash" | "pro" for a preset, None for any other layer
    ratio: int = 0             # 0 (cr0, SWA), 4 (cr4, CSA), 128 (cr128, HCA) or any int >= 2
    num_heads: int = 64        # H: 64 Flash, 128 Pro
    head_dim: int = 512        # D; K and V share one row
    window: int = 128          # causal sliding window (includes the token itself)
    topk: int = 0              # pool rows chosen by the indexer (used by cr4): 512 Flash, 1024 Pro
    rope_dim: int = 64         # RoPE on the last rope_dim channels
    q_rank: int = 1024         # low-rank query latent: 1024 Flash, 1536 Pro
    o_groups: int = 8          # grouped output projection: 8 Flash, 16 Pro
    o_rank: int = 1024         # rank per output group
    index_heads: int = 64      # lightning indexer heads
    index_dim: int = 128       # lightning indexer head dim
    d_model: int = 4096        # model width C: 4096 Flash, 7168 Pro
    rope_theta: float = 10000.0            # RoPE base of cr0 layers
    compress_rope_theta: float = 160000.0  # RoPE base of compressed layers (cr4, HCA)
    norm_eps: float = 1e-6
    impl: str = "auto"                     # sparse_attention impl (csa_jax.registry)
    indexer_loss_coef: float = 0.0         # > 0: auxiliary indexer KL loss (cr4 layers)
    out_init_scale: float = 1.0            # init std factor of the layer's last projection
    indexer_scores: str = "auto"           # indexer_topk's scores: auto | xla | kernel
    indexer_select: str = "auto"           # indexer_topk's select: auto | prefix | top_k |
                                           # kernel | approx
    context_axis: str | None = None        # mesh axis the sequence is split over (context
                                           # parallelism, csa_jax/context_parallel.py); None:
                                           # the axis that splits x's T under Explicit axes, if any
    context_overlap: str = "none"          # how the pool's collective meets the attention under
                                           # context parallelism: none | xla | ring |
                                           # bidirectional

    def __post_init__(self):
        if self.family is not None and self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} must be one of {FAMILIES} or None")
        check_ratio(self.ratio)
        for name in ("num_heads", "head_dim", "window", "q_rank", "o_groups", "o_rank",
                     "index_heads", "index_dim", "d_model"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 0:
            raise ValueError(f"topk={self.topk!r} must be an int >= 0")
        if self.ratio == 4 and self.topk <= 0:
            raise ValueError(f"cr4 needs topk > 0, got topk={self.topk}")
        if not isinstance(self.rope_dim, int) or self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"rope_dim={self.rope_dim!r} must be a positive even int")
        if self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be <= head_dim={self.head_dim}")
        if self.ratio == 4 and self.rope_dim > self.index_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be <= index_dim={self.index_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} must divide num_heads={self.num_heads}")
        if not self.indexer_loss_coef >= 0:
            raise ValueError(f"indexer_loss_coef={self.indexer_loss_coef} must be >= 0")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be > 0")
        if self.indexer_scores not in ("auto", "xla", "kernel"):
            raise ValueError(f"indexer_scores={self.indexer_scores!r} must be one of auto | xla "
                             f"| kernel (csa_jax.indexer_topk's scores=)")
        if self.indexer_select not in ("auto", "prefix", "top_k", "kernel", "approx"):
            raise ValueError(f"indexer_select={self.indexer_select!r} must be one of auto | prefix "
                             f"| top_k | kernel | approx (csa_jax.indexer_topk's select=)")
        if self.context_axis is not None and not isinstance(self.context_axis, str):
            raise ValueError(f"context_axis={self.context_axis!r} must be a mesh axis name or None")
        if self.context_overlap not in ("none", "xla", "ring", "bidirectional"):
            raise ValueError(f"context_overlap={self.context_overlap!r} must be one of none | xla "
                             f"| ring | bidirectional (csa_jax.context_parallel.OVERLAPS)")
        from csa_jax import registry   # late: the registry imports the kernels
        if self.impl not in registry.choices():
            raise ValueError(f"impl={self.impl!r} must be one of {registry.choices()}")

    @property
    def layer_type(self) -> str:
        return f"cr{self.ratio}"

    @property
    def rope_base(self) -> float:
        """This layer's RoPE base: rope_theta for cr0, compress_rope_theta for compressed ones."""
        return self.rope_theta if self.ratio == 0 else self.compress_rope_theta

    @property
    def name(self) -> str:
        return f"{self.family}-cr{self.ratio}" if self.family else self.layer_type

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def pool_rows(self, T: int) -> int:
        """P: pool rows for a sequence of T tokens (leftover tokens are not pooled)."""
        return T // self.ratio if self.ratio else 0

    def num_kv(self, T: int) -> int:
        """N = T token rows + P pool rows."""
        return T + self.pool_rows(T)

    def nominal_slots(self, T: int) -> int:
        """K per token by the FLOP convention: 128 (cr0), 128 + k (cr4), 128 + T/128 (cr128)."""
        if self.ratio == 0:
            return self.window
        if self.ratio == 4:
            return self.window + min(self.topk, self.pool_rows(T))
        return self.window + self.pool_rows(T)


def preset(family: str, ratio: int) -> CSAConfig:
    """The V4 layer type: family "flash" | "pro", ratio 0 | 4 | 128."""
    if not isinstance(family, str) or family.lower() not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    if ratio not in PRESET_RATIOS or isinstance(ratio, bool):
        raise ValueError(f"ratio={ratio!r} has no preset: V4 layer types are {PRESET_RATIOS}")
    family = family.lower()
    pro = family == "pro"
    return CSAConfig(
        family=family,
        ratio=ratio,
        num_heads=128 if pro else 64,
        topk=(1024 if pro else 512) if ratio == 4 else 0,
        q_rank=1536 if pro else 1024,
        o_groups=16 if pro else 8,
        d_model=7168 if pro else 4096,
    )


def forward_flops(T: int, H: int, K: int, D: int, B: int = 1) -> float:
    """FLOP convention of csa_spec.md: forward = 2*T*H*K*(D+D) (QK^T and PV); backward = 2.5x."""
    return 2.0 * B * T * H * K * (D + D)


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """A named point of the paper's benchmark grid."""

    name: str
    family: str
    ratio: int
    seq_len: int
    batch: int = 1

    @property
    def config(self) -> CSAConfig:
        return preset(self.family, self.ratio)


BENCHMARK_GRID: tuple[BenchShape, ...] = tuple(
    BenchShape(f"{fam}-cr{r}-T{t}", fam, r, t)
    for fam in FAMILIES for r in PRESET_RATIOS for t in (4096, 8192, 16384)
)
