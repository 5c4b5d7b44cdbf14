"""The decoder LM: embedding, blocks (RMSNorm, CSAAttention, RMSNorm, SwiGLU), final norm, head
(Flax NNX conventions as in csa_jax.layers: dtype / param_dtype, kernel_init, nnx.RMSNorm,
logical partition metadata)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from csa_jax.layers import CSAAttention, kernel, rms_norm_layer, truncated_lecun
from train.config import ModelConfig

# Explicit FSDP gathers the blocks' weights layer by layer through this call; outside an FSDP
# step it is the plain loop over the layers.
from comm.fsdp import apply_layers
from train.layer_scan import find_cycle, scan_blocks

__all__ = ["Block", "DecoderLM", "FusedRMSNorm", "REMAT_POLICIES", "SWIGLU_MODES", "SwiGLU",
           "count_params", "norm_layer", "rms_norm", "swiglu"]

# ModelConfig.remat -> what a block keeps for the backward (nnx.remat policy; None: no remat).
# block: nothing (the block's forward runs again in the backward; least memory);
# dots: the matrix products' outputs (norms, RoPE, activations and the attention core recomputed).
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@jax.custom_vjp
def swiglu(a, b):
    """silu(a) * b with a hand-written backward (ModelConfig.swiglu != "xla"): the backward
    saves only a and b (the two GEMMs' outputs) and forms da, db in one f32 elementwise pass
    from a, b and dh, where XLA's autodiff keeps sigmoid(a) / silu(a) from the forward and
    splits the backward over several fusions (an add_any of the two product-rule terms)."""
    return _swiglu_fwd(a, b)[0]


def _swiglu_fwd(a, b):
    af = a.astype(jnp.float32)
    return (jax.nn.sigmoid(af) * af * b.astype(jnp.float32)).astype(a.dtype), (a, b)


def _swiglu_bwd(res, dh):
    a, b = res
    af, bf, g = a.astype(jnp.float32), b.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(af)
    silu = af * sig
    da = g * bf * (sig + silu * (1.0 - sig))      # d silu / da = sig * (1 + a * (1 - sig))
    return da.astype(a.dtype), (g * silu).astype(b.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)

SWIGLU_MODES = ("xla", "act", "gemm")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps):
    """nnx.RMSNorm's forward (f32 statistics, the same f32 products) returned in x's dtype, with a
    hand-written backward (ModelConfig.norm = "fused"): it saves x and the per-token rsqrt only
    (not an f32 copy of x) and forms dx and dscale from x, the rsqrt and the cotangent."""
    return _rms_fwd(x, scale, eps)[0]


def _rms_fwd(x, scale, eps):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)        # [..., 1]
    return (xf * (r * scale.astype(jnp.float32))).astype(x.dtype), (x, r, scale)


def _rms_bwd(eps, res, g):
    del eps
    x, r, scale = res
    xf, gf = x.astype(jnp.float32), g.astype(jnp.float32)
    gs = gf * scale.astype(jnp.float32)
    dx = r * (gs - xf * (r * r) * jnp.mean(gs * xf, axis=-1, keepdims=True))
    dscale = jnp.sum((gf * xf * r).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_fwd, _rms_bwd)


class FusedRMSNorm(nnx.RMSNorm):
    """nnx.RMSNorm (the same parameter, `scale`) through `rms_norm`: output in x's dtype."""

    def __call__(self, x, mask=None):
        if mask is not None or not self.use_scale:
            return super().__call__(x, mask)
        return rms_norm(x, self.scale[...], self.epsilon)


def norm_layer(dim, *, eps, param_dtype, mode="nnx"):
    """The block / final norms: csa_jax.layers.rms_norm_layer ("nnx") or FusedRMSNorm."""
    if mode == "nnx":
        return rms_norm_layer(dim, eps=eps, param_dtype=param_dtype)
    if mode != "fused":
        raise ValueError(f"norm mode={mode!r} must be 'nnx' or 'fused'")
    return FusedRMSNorm(dim, epsilon=eps, param_dtype=param_dtype, rngs=nnx.Rngs(0))


class SwiGLU(nnx.Module):
    """x -> (silu(x W_gate) * (x W_up)) W_down. mode (ModelConfig.swiglu): "xla" (autodiff of
    jax.nn.silu), "act" (the `swiglu` custom_vjp), "gemm" (also one [C, 2 * hidden] GEMM of the
    two weights side by side, split after; the parameters stay two)."""

    def __init__(self, d_model: int, hidden: int, *, out_init_scale: float = 1.0, dtype=None,
                 param_dtype=jnp.float32, kernel_init=truncated_lecun(), out_kernel_init=None,
                 mode: str = "xla", rngs: nnx.Rngs):
        if mode not in SWIGLU_MODES:
            raise ValueError(f"swiglu mode={mode!r} must be one of {SWIGLU_MODES}")
        self.dtype = dtype
        self.mode = mode
        out_init = out_kernel_init or truncated_lecun(out_init_scale)
        self.w_gate = kernel(kernel_init, rngs, (d_model, hidden), ("embed", "mlp"), param_dtype)
        self.w_up = kernel(kernel_init, rngs, (d_model, hidden), ("embed", "mlp"), param_dtype)
        self.w_down = kernel(out_init, rngs, (hidden, d_model), ("mlp", "embed"), param_dtype)

    def __call__(self, x):
        dt = self.dtype or x.dtype
        x = x.astype(dt)
        with jax.named_scope("mlp"):
            wg, wu = self.w_gate[...].astype(dt), self.w_up[...].astype(dt)
            if self.mode == "xla":
                h = jax.nn.silu(x @ wg) * (x @ wu)
            elif self.mode == "act":
                h = swiglu(x @ wg, x @ wu)
            else:
                ab = x @ jnp.concatenate([wg, wu], axis=1)
                n = wg.shape[1]
                h = swiglu(ab[..., :n], ab[..., n:])
            return h @ self.w_down[...].astype(dt)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)  # residual branches start small
        dt = jnp.dtype(cfg.compute_dtype)
        self.attn_norm = norm_layer(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype,
                                    mode=cfg.norm)
        self.attn = CSAAttention(cfg.layer(ratio, out_init_scale=out_scale), dtype=dt,
                                 param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = norm_layer(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype,
                                   mode=cfg.norm)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden, out_init_scale=out_scale, dtype=dt,
                          param_dtype=param_dtype, mode=cfg.swiglu, rngs=rngs)
        self.remat = cfg.remat

    def __call__(self, carry):
        """(x [B,T,C], aux loss so far) -> the same after this block."""
        policy = REMAT_POLICIES[self.remat]
        if policy is None:
            return self._forward(carry)
        return nnx.remat(type(self)._forward, policy=policy)(self, carry)

    def _forward(self, carry):
        x, aux = carry
        h, a = self.attn(self.attn_norm(x).astype(x.dtype))
        x = x + h
        return x + self.mlp(self.mlp_norm(x).astype(x.dtype)), aux + a


class DecoderLM(nnx.Module):
    """tokens [B, T] int -> (logits [B, T, vocab] f32, aux_loss scalar f32).

    Computes in cfg.compute_dtype; parameters are stored in param_dtype (f32 masters) and carry
    logical axis names (csa_jax.layers.LOGICAL_AXIS_RULES) that FSDP reads."""

    def __init__(self, cfg: ModelConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        embed = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"),
                                      eager_sharding=False)
        self.embed = nnx.Param(embed(rngs.params(), (cfg.vocab_size, cfg.d_model), param_dtype))
        self.blocks = nnx.List([Block(cfg, r, param_dtype=param_dtype, rngs=rngs)
                                for r in cfg.layer_ratios])
        self.final_norm = norm_layer(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype,
                                     mode=cfg.norm)
        self.head = kernel(truncated_lecun(), rngs, (cfg.d_model, cfg.vocab_size),
                           ("embed", "vocab"), param_dtype)

    def __call__(self, tokens):
        dt = jnp.dtype(self.cfg.compute_dtype)
        with jax.named_scope("embed"):
            x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)  # [B, T, C]
        carry = (x, jnp.zeros((), jnp.float32))
        cycle = find_cycle(self.cfg.layer_ratios) if self.cfg.scan_layers else None
        if cycle is None:
            x, aux = apply_layers(self.blocks, carry)
        else:  # train/layer_scan.py (not with explicit FSDP: TrainConfig refuses the pair)
            x, aux = scan_blocks(self.blocks, carry, cycle)
        x = self.final_norm(x).astype(dt)
        with jax.named_scope("head"):
            logits = (x @ self.head[...].astype(dt)).astype(jnp.float32)
        return logits, aux


def count_params(params) -> int:
    return int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))
