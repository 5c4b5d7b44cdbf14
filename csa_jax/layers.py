"""Flax NNX layers of a DeepSeek-V4 attention block (csa_spec.md sections 5 and 6).

`CSAAttention` is the whole attention layer for the three layer types:

- ratio 0  (cr0, SWA): causal sliding window only;
- ratio 4  (cr4, CSA): window + the lightning indexer's top-k pool rows;
- ratio m  (cr128 / HCA, any other m > 0): window + every visible pool row.

Data flow (shapes with B batch, T tokens, C model width, H heads, D head dim, P pool rows,
N = T + P kv rows, K slots per token):

    q:   x [B,T,C] -> wq_a -> RMSNorm -> wq_b -> [B,T,H,D] -> per-head RMSNorm (no weight) -> RoPE
    kv:  x -> wkv [B,T,D] -> RMSNorm -> RoPE                                  (token rows, K == V)
    pool: Compressor(x) [B,P,D] (csa_jax.compress) -> RoPE at position i*m    (pool rows)
    idx: csa_jax.build_indices(T, m, window=..., pool_topk=indexer top-k)    [B,T,K]
    o, lse = csa_jax.sparse_attention(q, [kv ; pool], idx, sink)             [B,T,H,D]
    o -> RoPE(-angle at the query position) -> grouped low-rank projection -> [B,T,C]

The layer takes one csa_jax.CSAConfig: a preset (`csa_jax.preset(family, ratio)`) or a model's
base config with the layer's ratio (train/config.py). RoPE is interleaved (channel pairs (2i, 2i+1)) on the last `rope_dim` channels. The compressor,
the indexer's scoring and the attention core are the functional pieces of `csa_jax`; this module
owns only parameters and wiring. Norms and the compressor run in float32; everything else runs
in `dtype` (None: the input's dtype; the trainer casts its f32 master weights to the compute
dtype before calling the model).

Flax NNX conventions: `dtype` (compute) and `param_dtype` (storage, f32 by default);
`kernel_init` for every projection matrix and `out_kernel_init` for the last one (defaults:
`truncated_lecun`, the initializer the layer always had); `nnx.RMSNorm` for the weighted norms
(the spec's RMSNorm: x * rsqrt(mean(x^2) + eps) * scale, f32 statistics, eps = cfg.norm_eps);
every matrix carries logical axis names (`nnx.with_partitioning`, read back with
`nnx.get_partition_spec`) that `LOGICAL_AXIS_RULES` maps to the mesh axes "fsdp" and "tensor"
(comm.fsdp.logical_to_mesh).

Context parallelism (docs/context_parallel.md): when x's sequence is split over a mesh axis
(an Explicit axis in x's type, or cfg.context_axis), the compressor, the indexer, the index lists
and the attention run shard by shard (csa_jax/context_parallel.py): q, kv rows and o stay with
their tokens; a halo of window - 1 kv rows and the pool rows move.

Named scopes (`jax.named_scope`) mark the parts of the layer in HLO op names and so in profiler
traces (benchmarks/trace_breakdown.py): q_proj, kv_proj, compressor, indexer (indexer_scores,
indexer_topk inside), index_lists, csa_attention, out_proj; RoPE and norms are rope / norm.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import csa_jax
from csa_jax.config import CSAConfig

__all__ = [
    "LOGICAL_AXIS_RULES",
    "CSAAttention",
    "Compressor",
    "Indexer",
    "apply_rope",
    "kernel",
    "rms_norm",
    "rms_norm_layer",
    "truncated_lecun",
]

_INDEXER_RATIO = 4  # the lightning indexer exists only on cr4 layers (csa_spec.md section 5)


# ----------------------------------------------------------------------------- functional pieces


def rms_norm(x, scale=None, *, eps=1e-6):
    """RMSNorm over the last axis in float32; returns x.dtype. scale=None: unweighted."""
    with jax.named_scope("norm"):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        if scale is not None:
            y = y * scale.astype(jnp.float32)
        return y.astype(x.dtype)


def apply_rope(x, positions, *, base, rope_dim, inverse=False):
    """Interleaved RoPE on the last `rope_dim` channels of x.

    x [..., D]; positions: integer array broadcastable to x.shape[:-1] (e.g. [T, 1] for
    x [B, T, H, D]). Channel pair (2i, 2i+1) of the rotated part turns by
    positions * base**(-2i/rope_dim); inverse=True turns by the negative angle (de-rotation).
    The angle is computed in float32 and the result has x.dtype.
    """
    d = x.shape[-1]
    if rope_dim > d or rope_dim % 2:
        raise ValueError(f"rope_dim={rope_dim} must be even and <= the last dim {d}")
    with jax.named_scope("rope"):
        return _rope(x, positions, base, rope_dim, inverse)


def _rope(x, positions, base, rope_dim, inverse):
    d = x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)  # [rope_dim/2]
    angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    keep, rot = x[..., : d - rope_dim], x[..., d - rope_dim:].astype(jnp.float32)
    pairs = rot.reshape(rot.shape[:-1] + (rope_dim // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([keep, out.astype(x.dtype)], axis=-1)


# Logical axis names of the parameters -> mesh axes: "fsdp" shards storage (FSDP), "tensor"
# splits heads / hidden units (tensor parallelism). A dim whose mesh axis is absent, already taken
# by an earlier dim of the same param, or does not divide it stays whole (comm.fsdp.logical_to_mesh).
LOGICAL_AXIS_RULES = (
    ("embed", "fsdp"),        # model width C
    ("q_lora", "fsdp"),       # query latent (q_rank)
    ("o_lora", "fsdp"),       # output latent per group (o_rank)
    ("heads", "tensor"),      # attention heads (H, or H * D flattened head-major)
    ("o_groups", "tensor"),   # output projection groups (G, or G * o_rank flattened)
    ("index_heads", "tensor"),
    ("mlp", "tensor"),        # feed-forward hidden units
    ("vocab", "tensor"),
    ("kv", None),             # the shared K = V row width D (and pool / indexer key widths)
)


def truncated_lecun(scale: float = 1.0):
    """Initializer: truncated normal (+-2 std) with std = scale / sqrt(fan_in), fan_in =
    shape[-2] (leading dims, like wo_a's groups, are batch dims). The layer's default."""
    def init(key, shape, dtype=jnp.float32):
        std = scale / math.sqrt(shape[-2])
        return jax.nn.initializers.truncated_normal(stddev=std)(key, shape, dtype)
    return init


def kernel(init, rngs, shape, names, param_dtype=jnp.float32):
    """An nnx.Param from `init` with logical axis names `names` as partition metadata (no mesh
    needed: the names are only recorded, comm.fsdp / a jit's shardings apply them)."""
    init = nnx.with_partitioning(init, tuple(names), eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, param_dtype))


def _vector(value, names):
    """A constant-initialised parameter (sink, ape, norm scales of the compressor) with names."""
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _reshape_tail(x, shape):
    """x.reshape(shape) where only dims after the first two (B, T) change. With x's T split
    over an Explicit axis (context parallelism) jax cannot infer the output's sharding
    (ShardingTypeError): it keeps x's B / T split, the new trailing dims unsplit."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None or len(tuple(spec)) < 2 or tuple(spec)[1] is None:
        return x.reshape(shape)     # T not split: as it always was
    lead = (tuple(spec) + (None, None))[:2]
    return jax.lax.reshape(x, shape, out_sharding=jax.sharding.PartitionSpec(
        *lead, *(None,) * (len(shape) - 2)))


# ----------------------------------------------------------------------------- modules


def rms_norm_layer(dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, use_scale=True):
    """nnx.RMSNorm as the spec defines it: f32 statistics, a scale initialised to 1 (ones need no
    randomness: its own Rngs keeps the caller's key stream, and so every other init, unchanged).
    Its output is f32 for a low-precision input; callers cast it to their compute dtype."""
    return nnx.RMSNorm(dim, epsilon=eps, param_dtype=param_dtype, use_scale=use_scale,
                       rngs=nnx.Rngs(0))


class Compressor(nnx.Module):
    """Builds pool rows from the layer input (csa_spec.md section 5), before RoPE.

    Parameters in the layout of `csa_jax.compress`: w_kv, w_gate [C, coff*d] (coff = 2 for
    ratio 4), ape [ratio, coff*d], norm_scale [d]. Returns [B, T//ratio, d] float32. The
    projections run in x's dtype (bf16 in a bf16 step, f32 accumulation), the pooling in f32.
    """

    def __init__(self, in_dim: int, dim: int, ratio: int, *, eps: float = 1e-6,
                 param_dtype=jnp.float32, kernel_init=truncated_lecun(), rngs: nnx.Rngs):
        if ratio <= 0:
            raise ValueError(f"Compressor needs ratio > 0, got {ratio=}")
        coff = 2 if ratio == 4 else 1
        self.ratio, self.eps = ratio, eps
        self.w_kv = kernel(kernel_init, rngs, (in_dim, coff * dim), ("embed", "kv"), param_dtype)
        self.w_gate = kernel(kernel_init, rngs, (in_dim, coff * dim), ("embed", "kv"), param_dtype)
        self.ape = _vector(jnp.zeros((ratio, coff * dim), param_dtype), (None, "kv"))
        self.norm_scale = _vector(jnp.ones((dim,), param_dtype), ("kv",))

    def __call__(self, x, *, context_axis=None):
        """context_axis: the mesh axis x's T is split over (pool rows come out split over P on
        it, csa_jax.context_parallel.compress_cp), or None."""
        f32 = lambda p: p[...].astype(jnp.float32)  # noqa: E731  (vectors: f32 pooling math)
        args = (x, self.w_kv[...], self.w_gate[...], f32(self.ape), f32(self.norm_scale))
        with jax.named_scope("compressor"):
            if context_axis is not None:
                from csa_jax import context_parallel
                return context_parallel.compress_cp(*args, ratio=self.ratio, eps=self.eps,
                                                    axis=context_axis)
            return csa_jax.compress(*args, ratio=self.ratio, eps=self.eps)


class Indexer(nnx.Module):
    """The lightning indexer of a cr4 layer: per-head queries from the query latent, one key per
    pool row from its own ratio-4 compressor, per-head weights from x (every scale folded in)."""

    def __init__(self, cfg: CSAConfig, *, param_dtype=jnp.float32, kernel_init=truncated_lecun(),
                 rngs: nnx.Rngs):
        hi, di = cfg.index_heads, cfg.index_dim
        self.cfg = cfg
        self.wq = kernel(kernel_init, rngs, (cfg.q_rank, hi * di), ("q_lora", "index_heads"),
                         param_dtype)
        self.ww = kernel(kernel_init, rngs, (cfg.d_model, hi), ("embed", "index_heads"), param_dtype)
        self.compressor = Compressor(cfg.d_model, di, _INDEXER_RATIO, eps=cfg.norm_eps,
                                     param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)

    def __call__(self, x, q_lat, *, context_axis=None):
        """x [B,T,C], q_lat [B,T,q_rank] -> q_idx [B,T,Hi,Di], k_idx [B,P,Di] (both in x's
        dtype: the score products run in it), weights [B,T,Hi] f32. context_axis: as for
        Compressor (k_idx split over P on it)."""
        cfg = self.cfg
        B, T, _ = x.shape
        hi, di = cfg.index_heads, cfg.index_dim
        pos = jnp.arange(T)
        q_idx = (q_lat @ self.wq[...].astype(q_lat.dtype)).reshape(B, T, hi, di)
        q_idx = apply_rope(q_idx, pos[:, None], base=cfg.rope_base, rope_dim=cfg.rope_dim)
        k_idx = self.compressor(x, context_axis=context_axis)  # [B, P, Di] f32
        k_idx = apply_rope(k_idx, jnp.arange(k_idx.shape[1]) * _INDEXER_RATIO,
                           base=cfg.rope_base, rope_dim=cfg.rope_dim)
        weights = (x @ self.ww[...].astype(x.dtype)).astype(jnp.float32) * (di ** -0.5 * hi ** -0.5)
        return q_idx.astype(x.dtype), k_idx.astype(x.dtype), weights


class CSAAttention(nnx.Module):
    """One DeepSeek-V4 attention layer (cr0 / cr4 / HCA), see the module docstring.

    __call__(x [B,T,C]) -> (y [B,T,C], aux_loss scalar f32). aux_loss is the auxiliary indexer
    loss already multiplied by cfg.indexer_loss_coef (0 when off or on non-cr4 layers).

    dtype: compute dtype of the projections and the attention (None: x's dtype); param_dtype:
    the parameters' storage dtype; kernel_init: initializer of every projection matrix
    (`init(key, shape, dtype)`), out_kernel_init the output projection's (default
    truncated_lecun(cfg.out_init_scale)).
    """

    def __init__(self, cfg: CSAConfig, *, dtype=None, param_dtype=jnp.float32,
                 kernel_init=truncated_lecun(), out_kernel_init=None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        if out_kernel_init is None:
            out_kernel_init = truncated_lecun(cfg.out_init_scale)
        C, H, D, G = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.o_groups
        pd = param_dtype
        self.wq_a = kernel(kernel_init, rngs, (C, cfg.q_rank), ("embed", "q_lora"), pd)
        self.q_norm = rms_norm_layer(cfg.q_rank, eps=cfg.norm_eps, param_dtype=pd)
        self.wq_b = kernel(kernel_init, rngs, (cfg.q_rank, H * D), ("q_lora", "heads"), pd)
        self.head_norm = rms_norm_layer(D, eps=cfg.norm_eps, use_scale=False)  # per head
        self.wkv = kernel(kernel_init, rngs, (C, D), ("embed", "kv"), pd)
        self.kv_norm = rms_norm_layer(D, eps=cfg.norm_eps, param_dtype=pd)
        self.sink = _vector(jnp.zeros((H,), pd), ("heads",))
        self.wo_a = kernel(kernel_init, rngs, (G, (H // G) * D, cfg.o_rank),
                           ("o_groups", None, "o_lora"), pd)
        self.wo_b = kernel(out_kernel_init, rngs, (G * cfg.o_rank, C), ("o_groups", "embed"), pd)
        self.compressor = (Compressor(C, D, cfg.ratio, eps=cfg.norm_eps, param_dtype=pd,
                                      kernel_init=kernel_init, rngs=rngs)
                           if cfg.ratio > 0 else None)
        self.indexer = (Indexer(cfg, param_dtype=pd, kernel_init=kernel_init, rngs=rngs)
                        if cfg.ratio == _INDEXER_RATIO else None)

    def __call__(self, x):
        cfg = self.cfg
        B, T, _ = x.shape
        H, D = cfg.num_heads, cfg.head_dim
        dt = self.dtype or x.dtype
        x = x.astype(dt)
        pos = jnp.arange(T)
        rope = dict(base=cfg.rope_base, rope_dim=cfg.rope_dim)

        with jax.named_scope("q_proj"):
            q_lat = self.q_norm(x @ self.wq_a[...].astype(dt)).astype(dt)  # [B, T, q_rank]
            q = (q_lat @ self.wq_b[...].astype(dt)).reshape(B, T, H, D)
            q = apply_rope(self.head_norm(q), pos[:, None], **rope)  # [B, T, H, D]
        with jax.named_scope("kv_proj"):
            kv = apply_rope(self.kv_norm(x @ self.wkv[...].astype(dt)).astype(dt), pos,
                            **rope)  # [B, T, D]

        aux = jnp.zeros((), jnp.float32)
        cp = self.context_axis(x)
        if cp is not None:
            o = self._attend_cp(x, q, kv, q_lat, cp)
        else:
            o, aux = self._attend(x, q, kv, q_lat)

        with jax.named_scope("out_proj"):
            o = apply_rope(o, pos[:, None], inverse=True, **rope)  # de-rotate at the query position
            G = cfg.o_groups
            og = _reshape_tail(o, (B, T, G, (H // G) * D))
            y = jnp.einsum("btgk,gkr->btgr", og, self.wo_a[...].astype(dt))  # [B, T, G, o_rank]
            y = _reshape_tail(y, (B, T, G * cfg.o_rank)) @ self.wo_b[...].astype(dt)  # [B, T, C]
        return y, aux

    def _attend(self, x, q, kv, q_lat):
        """The attention on one device (or shard by shard over batch / heads): (o, aux)."""
        cfg = self.cfg
        B, T, _ = x.shape
        m = cfg.ratio
        dt = q.dtype
        rope = dict(base=cfg.rope_base, rope_dim=cfg.rope_dim)
        aux = jnp.zeros((), jnp.float32)
        topk = None
        if m > 0:
            pool = self.compressor(x)  # [B, P, D] f32, before RoPE
            with jax.named_scope("compressor"):
                pool = apply_rope(pool, jnp.arange(pool.shape[1]) * m, **rope).astype(dt)
                kv = jnp.concatenate([kv, pool], axis=1)  # [B, N, D]
        if m == _INDEXER_RATIO:
            with jax.named_scope("indexer"):
                # The indexer learns only from its own auxiliary loss: its inputs are detached.
                q_idx, k_idx, w = self.indexer(jax.lax.stop_gradient(x),
                                               jax.lax.stop_gradient(q_lat))
                topk = csa_jax.indexer_topk(q_idx, k_idx, w, ratio=m, topk=cfg.topk,
                                            scores=cfg.indexer_scores,
                                            select=cfg.indexer_select)          # [B, T, k]
        with jax.named_scope("index_lists"):
            idx = self.index_lists(B, T, topk)  # [B, T, K]

        with jax.named_scope("csa_attention"):
            sink = self.sink[...].astype(jnp.float32)
            o, lse = csa_jax.sparse_attention(q, kv, idx, sink, impl=cfg.impl,
                                              layout=self.layout)
        if m == _INDEXER_RATIO and cfg.indexer_loss_coef > 0:
            with jax.named_scope("indexer_loss"):
                aux = cfg.indexer_loss_coef * self._indexer_loss(q, kv, idx, lse, q_idx, k_idx, w,
                                                                 topk)

        return o, aux

    def context_axis(self, x):
        """The mesh axis x's sequence is split over (context parallelism), or None: the config's
        context_axis, else the Explicit axis that splits x's T dimension, if any."""
        if self.cfg.context_axis is not None:
            return self.cfg.context_axis
        spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
        entry = tuple(spec)[1] if spec is not None and len(tuple(spec)) > 1 else None
        if entry is None:
            return None
        if isinstance(entry, (tuple, list)):
            if len(entry) != 1:
                raise ValueError(f"x's sequence is split over several mesh axes {entry}: "
                                 "context parallelism takes one axis")
            entry = entry[0]
        return entry

    def _attend_cp(self, x, q, kv, q_lat, axis):
        """The attention with T split over mesh axis `axis` (csa_jax/context_parallel.py): pool
        rows and indexer keys computed per shard, lists built per shard, the op's halo and pool
        collectives; q, kv rows and o stay where their tokens are."""
        from csa_jax import context_parallel as cpm
        cfg = self.cfg
        B, T, _ = x.shape
        m = cfg.ratio
        dt = q.dtype
        rope = dict(base=cfg.rope_base, rope_dim=cfg.rope_dim)
        if m == _INDEXER_RATIO and cfg.indexer_loss_coef > 0:
            raise NotImplementedError(
                f"indexer_loss_coef={cfg.indexer_loss_coef} with context parallelism (axis "
                f"{axis!r}): the auxiliary indexer loss is not implemented for a split sequence")
        pool, topk = None, None
        if m > 0:
            pool = self.compressor(x, context_axis=axis)  # [B, P, D] f32, split over P
            with jax.named_scope("compressor"):
                pool = apply_rope(pool, jnp.arange(pool.shape[1]) * m, **rope).astype(dt)
        if m == _INDEXER_RATIO:
            with jax.named_scope("indexer"):
                q_idx, k_idx, w = self.indexer(jax.lax.stop_gradient(x),
                                               jax.lax.stop_gradient(q_lat), context_axis=axis)
                topk = cpm.indexer_topk_cp(q_idx, k_idx, w, ratio=m, topk=cfg.topk, axis=axis,
                                           select=cfg.indexer_select, scores=cfg.indexer_scores)
        with jax.named_scope("index_lists"):
            idx = cpm.index_lists_cp(B, T, m, window=cfg.window, axis=axis, topk=topk, like=q)
        with jax.named_scope("csa_attention"):
            sink = self.sink[...].astype(jnp.float32)
            o, _ = cpm.sparse_attention_cp(q, kv, pool, idx, sink, axis=axis, window=cfg.window,
                                           overlap=cfg.context_overlap, impl=cfg.impl)
        return o

    @property
    def layout(self) -> csa_jax.Layout:
        """What index_lists promises about its lists (csa_jax.Layout), passed to the op so an
        impl can read structured tiles (gluon's cr0 window kernel) without a user Config."""
        cfg = self.cfg
        if cfg.ratio == 0:
            return csa_jax.Layout("cr0", window=cfg.window)
        if cfg.ratio == _INDEXER_RATIO:
            return csa_jax.Layout("cr4", window=cfg.window)
        return csa_jax.Layout("cr128", window=cfg.window, pool_ratio=cfg.ratio)

    def index_lists(self, B, T, topk=None):
        """[B, T, K] int32 kv rows per token: [window | pool] (csa_spec.md section 4). topk: the
        indexer's pool-local ids [B, T, k] (cr4 layers only)."""
        cfg = self.cfg
        if cfg.ratio == _INDEXER_RATIO:
            idx = csa_jax.build_indices(T, cfg.ratio, window=cfg.window, pool_topk=topk)
        else:
            idx = csa_jax.build_indices(T, cfg.ratio, window=cfg.window)
        return jnp.broadcast_to(idx, (B,) + idx.shape[-2:]).astype(jnp.int32)

    def _indexer_loss(self, q, kv, idx, lse, q_idx, k_idx, w, topk):
        """KL(attention's head-summed probabilities over the selected pool slots || softmax of the
        indexer's scores over the same slots), averaged over tokens with at least one selected
        row. The target is detached; gradients reach only the indexer (its inputs are detached)."""
        cfg = self.cfg
        T, k = q.shape[1], topk.shape[-1]
        valid = topk >= 0  # [B, T, k]
        # Target: p[t,h,j] = exp(scale * q.kv[idx] - lse), recomputed on the pool slots only.
        sg = jax.lax.stop_gradient
        pool_rows = idx[..., -k:]  # the pool part of the list; == topk + T where valid
        rows = jax.vmap(lambda a, i: a[i])(sg(kv), jnp.maximum(pool_rows, 0))  # kv's dtype
        prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = jnp.einsum("bthd,btjd->bthj", sg(q), rows.astype(q.dtype), precision=prec,
                       preferred_element_type=jnp.float32) * (cfg.head_dim ** -0.5)
        p = jnp.exp(s - sg(lse)[..., None]).sum(axis=2)  # [B, T, k] summed over heads
        p = jnp.where(valid, p, 0.0)
        target = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
        # Prediction: log-softmax of the indexer's scores over the selected slots.
        scores = csa_jax.indexer_scores(q_idx, k_idx, w, ratio=cfg.ratio)  # [B, T, P]
        sel = jnp.take_along_axis(scores, jnp.maximum(topk, 0), axis=-1)
        logq = jax.nn.log_softmax(jnp.where(valid, sel, -1e30), axis=-1)  # finite: no inf - inf
        kl = jnp.where(target > 0, target * (jnp.log(jnp.where(target > 0, target, 1.0)) - logq), 0.0)
        has = valid.any(-1)
        return kl.sum(-1).sum() / jnp.maximum(has.sum(), 1)
