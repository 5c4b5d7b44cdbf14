"""Model and training configuration: frozen dataclasses, presets and the layer schedule.

Per-layer fields live in one csa_jax.CSAConfig (the type the NNX attention layer takes), held by
ModelConfig as the base of every layer and validated there once per layer type; every other
check lives in the __post_init__ of the dataclass that owns the field. Errors are ConfigError (a ValueError)
naming the bad value, which the CLI prints without a traceback.
"""

from __future__ import annotations

import dataclasses
import math

import csa_jax

__all__ = [
    "ConfigError",
    "ModelConfig",
    "PRESETS",
    "TrainConfig",
    "get_preset",
    "parse_schedule",
    "release_schedule",
]


class ConfigError(ValueError):
    """A user-facing configuration mistake (the CLI prints it without a traceback)."""


def release_schedule(n_layers: int, family: str = "flash", hca_ratio: int = 128) -> tuple[int, ...]:
    """Compress ratio per layer as in the released models (csa_spec.md section 1).

    flash: two cr0 layers, then cr4 / cr-hca alternating starting with cr4.
    pro:   two cr-hca layers, then cr4 / cr-hca alternating starting with cr4.
    hca_ratio is the ratio of the "cr128" layers (128 in V4; smaller for short sequences).
    """
    if family not in ("flash", "pro"):
        raise ConfigError(f"the family {family!r} must be 'flash' or 'pro'")
    if n_layers < 1:
        raise ConfigError(f"the layer count must be >= 1, got {n_layers}")
    lead = 0 if family == "flash" else hca_ratio
    return tuple(lead if i < 2 else (4 if (i - 2) % 2 == 0 else hca_ratio) for i in range(n_layers))


def parse_schedule(text: str, hca_ratio: int = 128) -> tuple[int, ...]:
    """'flash:6' / 'pro:8' (released schedule with that many layers) or a comma list of ratios
    ('0,0,4,128'); 'cr4' style names are accepted too."""
    text = text.strip()
    if not text:
        raise ConfigError("schedule '': empty; give e.g. 'flash:4' or '0,0,4,128'")
    if ":" in text:
        family, _, n = text.partition(":")
        try:
            n_layers = int(n)
        except ValueError:
            raise ConfigError(f"schedule {text!r}: layer count {n!r} is not an int") from None
        try:
            return release_schedule(n_layers, family.strip().lower(), hca_ratio)
        except ConfigError as e:
            raise ConfigError(f"schedule {text!r}: {e}") from None
    ratios = []
    for part in text.split(","):
        part = part.strip().lower().removeprefix("cr")
        try:
            ratios.append(int(part))
        except ValueError:
            raise ConfigError(f"schedule {text!r}: {part!r} is not a compress ratio") from None
    return tuple(ratios)


# The tiny preset's attention (CPU, minutes); every layer is this with its own ratio.
_TINY_ATTENTION = csa_jax.CSAConfig(
    d_model=128, num_heads=4, head_dim=64, rope_dim=32, q_rank=128, o_groups=2, o_rank=128,
    window=64, topk=16, index_heads=4, index_dim=32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder LM over bytes whose attention layers are CSAAttention (csa_jax.layers).

    attention: the base per-layer config (csa_jax.CSAConfig); layer i runs
      `layer(layer_ratios[i])`, the base with that ratio (its own ratio field is not used).
    layer_ratios: compress ratio per layer (0 = SWA, 4 = CSA, other m = HCA with ratio m).
    cr0 layers use attention.rope_theta, compressed layers attention.compress_rope_theta.
    """

    attention: csa_jax.CSAConfig = _TINY_ATTENTION
    layer_ratios: tuple[int, ...] = (0, 0, 4, 16)
    mlp_hidden: int = 384
    vocab_size: int = 256
    compute_dtype: str = "float32"
    remat: str = "none"  # train.model.REMAT_POLICIES: none | block | dots
    scan_layers: bool = False  # the repeating layer cycle as one lax.scan (train/layer_scan.py)
    swiglu: str = "xla"  # the MLP's activation backward: xla | act | gemm (train.model.SwiGLU)
    norm: str = "nnx"  # the block / final RMSNorms: nnx | fused (train.model.rms_norm)

    def __post_init__(self):
        object.__setattr__(self, "layer_ratios", tuple(int(r) for r in self.layer_ratios))
        if not isinstance(self.attention, csa_jax.CSAConfig):
            raise ConfigError(f"attention must be a csa_jax.CSAConfig, got "
                              f"{type(self.attention).__name__}")
        if not self.layer_ratios:
            raise ConfigError("layer_ratios must name at least one layer")
        if self.remat not in ("none", "block", "dots"):
            raise ConfigError(f"remat={self.remat!r} must be one of none | block | dots")
        if self.swiglu not in ("xla", "act", "gemm"):
            raise ConfigError(f"swiglu={self.swiglu!r} must be one of xla | act | gemm")
        if self.norm not in ("nnx", "fused"):
            raise ConfigError(f"norm={self.norm!r} must be one of nnx | fused")
        if not isinstance(self.scan_layers, bool):
            raise ConfigError(f"scan_layers={self.scan_layers!r} must be True or False")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"compute_dtype={self.compute_dtype!r} must be 'float32' or 'bfloat16'")
        if self.mlp_hidden <= 0 or self.vocab_size <= 0:
            raise ConfigError(f"mlp_hidden={self.mlp_hidden} and vocab_size={self.vocab_size} must be > 0")
        for ratio in sorted(set(self.layer_ratios)):
            try:
                self.layer(ratio)  # validates every per-layer field once per layer type
            except ValueError as e:
                raise ConfigError(f"layer type cr{ratio}: {e}") from None

    @property
    def n_layers(self) -> int:
        return len(self.layer_ratios)

    @property
    def d_model(self) -> int:
        return self.attention.d_model

    @property
    def norm_eps(self) -> float:
        return self.attention.norm_eps

    def layer(self, ratio: int, *, out_init_scale: float = 1.0) -> csa_jax.CSAConfig:
        """The CSAConfig of a layer with this compress ratio: the base with its ratio."""
        return dataclasses.replace(self.attention, ratio=ratio, out_init_scale=out_init_scale)

    def replace(self, **fields) -> "ModelConfig":
        """A copy with fields changed; CSAConfig fields (impl, topk, ...) go to the base attention
        config, the others to the model. Unknown names raise ConfigError."""
        att = {f.name for f in dataclasses.fields(csa_jax.CSAConfig)} - {"ratio"}
        own = {f.name for f in dataclasses.fields(ModelConfig)} - {"attention"}
        bad = sorted(set(fields) - att - own)
        if bad:
            raise ConfigError(f"unknown model field(s) {bad}; model fields: {sorted(own)}, "
                              f"attention fields: {sorted(att)}")
        try:
            attention = dataclasses.replace(self.attention,
                                            **{k: v for k, v in fields.items() if k in att})
        except ValueError as e:
            raise ConfigError(f"attention: {e}") from None
        return dataclasses.replace(self, attention=attention,
                                   **{k: v for k, v in fields.items() if k in own})

    def check_seq_len(self, seq_len: int) -> None:
        """A sequence length is usable when every compressed layer pools all of its tokens:
        seq_len must be a positive multiple of every nonzero ratio in the schedule."""
        ratios = sorted({r for r in self.layer_ratios if r > 0})
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ConfigError(f"seq_len={seq_len!r} must be a positive int")
        if ratios:
            lcm = math.lcm(*ratios)
            if seq_len % lcm:
                raise ConfigError(
                    f"seq_len={seq_len} is not usable with the layer schedule {list(self.layer_ratios)}: "
                    f"it must be a multiple of every compress ratio {ratios} (i.e. of {lcm}); "
                    f"try --seq-len {max(lcm, seq_len // lcm * lcm)}")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward) of the matmuls and the
        attention core at nominal slots (csa_spec.md section 3 convention: attention backward =
        2.5x forward). Used for model FLOP utilisation."""
        a = self.attention
        C, H, D, G = a.d_model, a.num_heads, a.head_dim, a.o_groups
        dense = 0.0
        attn = 0.0
        for r in self.layer_ratios:
            dense += C * a.q_rank + a.q_rank * H * D + C * D  # wq_a, wq_b, wkv
            dense += H * D * a.o_rank + G * a.o_rank * C  # wo_a (grouped), wo_b
            dense += 3 * C * self.mlp_hidden
            k = a.window
            if r > 0:
                coff = 2 if r == 4 else 1
                dense += 2 * C * coff * D  # compressor projections
                k += min(a.topk, seq_len // r) if r == 4 else seq_len // r
            if r == 4:
                dense += a.q_rank * a.index_heads * a.index_dim + C * a.index_heads
                dense += 2 * C * 2 * a.index_dim
                # indexer scores over all pool rows (no gradient): forward only
                attn += 2 * a.index_heads * a.index_dim * (seq_len // r) / 3.0
            attn += 2 * H * k * (2 * D) * (1 + 2.5) / 3.0
        dense += C * self.vocab_size  # head
        return 3.0 * (2.0 * dense + attn)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs besides its workdir. Saved with every checkpoint."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    preset: str = "tiny"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_checkpoints: int = 3
    data: tuple[str, ...] = ()
    data_encoding: str = "utf-8"  # train.data.ENCODINGS: which found files count as text
    max_corpus_bytes: int = 16 * 2**20
    eval_fraction: float = 0.02
    fsdp: str = "off"
    context_parallel: int = 1   # devices the sequence is split over (csa_jax/context_parallel.py)

    def __post_init__(self):
        object.__setattr__(self, "data", tuple(self.data))
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ConfigError(f"context_parallel={cp!r} must be an int >= 1")
        # the layers find the sequence axis by name: "cp" while the sequence is split
        axis = "cp" if cp > 1 else None
        if self.model.attention.context_axis != axis:
            object.__setattr__(self, "model", self.model.replace(context_axis=axis))
        for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches",
                     "ckpt_every", "keep_checkpoints", "max_corpus_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive int")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr} must be > 0")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ConfigError(f"eval_fraction={self.eval_fraction} must be in (0, 0.5)")
        if self.data_encoding not in ("utf-8", "any"):
            raise ConfigError(f"data_encoding={self.data_encoding!r} must be 'utf-8' or 'any'")
        if self.fsdp not in ("off", "xla", "explicit"):
            raise ConfigError(f"fsdp={self.fsdp!r} must be one of off | xla | explicit")
        if self.fsdp == "explicit" and self.model.scan_layers:
            raise ConfigError("scan_layers=True does not combine with fsdp='explicit' (its "
                              "layer-by-layer weight gathers need the plain layer loop)")
        self.model.check_seq_len(self.seq_len)
        if cp > 1:
            self._check_context_parallel()

    def _check_context_parallel(self):
        cp, T = self.context_parallel, self.seq_len
        ratios = sorted({r for r in self.model.layer_ratios if r > 0})
        unit = cp * (math.lcm(*ratios) if ratios else 1)
        if T % unit:
            raise ConfigError(
                f"--context-parallel {cp}: seq_len={T} must be a multiple of {unit} (each of the "
                f"{cp} shards a multiple of every compress ratio {ratios}, so no compressor group "
                f"straddles two devices)")
        if 4 in ratios and self.model.attention.indexer_loss_coef > 0:
            raise ConfigError(f"--context-parallel {cp} with indexer_loss_coef="
                              f"{self.model.attention.indexer_loss_coef}: the auxiliary indexer "
                              "loss is not implemented for a split sequence")
        if self.fsdp == "explicit":
            raise ConfigError(f"--context-parallel {cp} with --fsdp explicit is not implemented "
                              "(use --fsdp xla or off)")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_TINY = ModelConfig()


def _v4_layer_preset(family: str) -> dict:
    """A 4-layer model whose attention is csa_jax.preset(family, 4) (V4 widths, d_model too)."""
    return dict(
        model=ModelConfig(attention=csa_jax.preset(family, 4),
                          layer_ratios=release_schedule(4, family, 128), mlp_hidden=4096,
                          compute_dtype="bfloat16"),
        batch_size=1, seq_len=8192, steps=100, lr=3e-4, warmup_steps=10)


PRESETS: dict[str, dict] = {
    # CPU default: trains visibly in a few minutes on 2 cores.
    "tiny": dict(model=_TINY, batch_size=8, seq_len=256, steps=200, lr=3e-3, warmup_steps=20,
                 log_every=10, eval_every=50, ckpt_every=50),
    # ~170M parameters for one GPU (bf16 compute, f32 master weights).
    "small": dict(
        model=ModelConfig(
            attention=csa_jax.CSAConfig(
                d_model=1024, num_heads=16, head_dim=128, rope_dim=64, q_rank=512, o_groups=4,
                o_rank=512, window=128, topk=512, index_heads=16, index_dim=64),
            layer_ratios=release_schedule(12, "flash", 128), mlp_hidden=2816,
            compute_dtype="bfloat16"),
        batch_size=8, seq_len=8192, steps=2000, lr=1e-3, warmup_steps=200, log_every=10,
        eval_every=250, ckpt_every=500),
    # Real V4 attention widths (csa_spec.md section 6, via csa_jax.preset) with few layers, for
    # benchmarking.
    "v4-flash-layer": _v4_layer_preset("flash"),
    "v4-pro-layer": _v4_layer_preset("pro"),
}


def get_preset(name: str, **overrides) -> TrainConfig:
    """TrainConfig of a preset with field overrides (model fields go in overrides['model'] as a
    dict of ModelConfig or CSAConfig fields: see ModelConfig.replace)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = dict(PRESETS[name])
    model_over = overrides.pop("model", None) or {}
    model = base.pop("model").replace(**model_over) if model_over else base.pop("model")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(model=model, preset=name, **base)
