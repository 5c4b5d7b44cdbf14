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
    """One V4 attention layer type. Numbers from csa_spec.md section 1 and 6."""

    family: str
    ratio: int                 # 0 (cr0, SWA), 4 (cr4, CSA), 128 (cr128, HCA) or any int >= 2
    num_heads: int             # H: 64 Flash, 128 Pro
    head_dim: int = 512        # D; K and V share one row
    window: int = 128          # causal sliding window (includes the token itself)
    topk: int = 0              # pool rows chosen by the indexer (cr4 only): 512 Flash, 1024 Pro
    rope_dim: int = 64         # RoPE on the last rope_dim channels
    q_rank: int = 1024         # low-rank query latent: 1024 Flash, 1536 Pro
    o_groups: int = 8          # grouped output projection: 8 Flash, 16 Pro
    o_rank: int = 1024         # rank per output group
    index_heads: int = 64      # lightning indexer heads
    index_dim: int = 128       # lightning indexer head dim

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} must be one of {FAMILIES}")
        check_ratio(self.ratio)
        for name in ("num_heads", "head_dim", "window", "q_rank", "o_groups", "o_rank",
                     "index_heads", "index_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim={self.rope_dim} must be even and in [0, {self.head_dim=}]")
        if self.ratio == 4 and self.topk <= 0:
            raise ValueError(f"cr4 needs topk > 0, got topk={self.topk}")
        if self.ratio != 4 and self.topk != 0:
            raise ValueError(f"topk={self.topk} is only meaningful for ratio 4, got ratio={self.ratio}")

    @property
    def name(self) -> str:
        return f"{self.family}-cr{self.ratio}"

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
