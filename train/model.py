"""The decoder LM: embedding, blocks (RMSNorm, CSAAttention, RMSNorm, SwiGLU), final norm, head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from csa_jax.layers import CSAAttention, RMSNorm
from train.config import ModelConfig

# Explicit FSDP gathers the blocks' weights layer by layer through this call; outside an FSDP
# step it is the plain loop over the layers.
from comm.fsdp import apply_layers

__all__ = ["Block", "DecoderLM", "REMAT_POLICIES", "SwiGLU", "count_params"]

# ModelConfig.remat -> what a block keeps for the backward (nnx.remat policy; None: no remat).
# block: nothing (the block's forward runs again in the backward; least memory);
# dots: the matrix products' outputs (norms, RoPE, activations and the attention core recomputed).
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _weight(rngs, shape, fan_in, scale=1.0):
    init = jax.nn.initializers.truncated_normal(stddev=scale / math.sqrt(fan_in))
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, out_init_scale: float = 1.0, rngs: nnx.Rngs):
        self.w_gate = _weight(rngs, (d_model, hidden), d_model)
        self.w_up = _weight(rngs, (d_model, hidden), d_model)
        self.w_down = _weight(rngs, (hidden, d_model), hidden, out_init_scale)

    def __call__(self, x):
        dt = x.dtype
        with jax.named_scope("mlp"):
            h = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (x @ self.w_up[...].astype(dt))
            return h @ self.w_down[...].astype(dt)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, *, rngs: nnx.Rngs):
        out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)  # residual branches start small
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CSAAttention(cfg.layer(ratio, out_init_scale=out_scale), rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden, out_init_scale=out_scale, rngs=rngs)
        self.remat = cfg.remat

    def __call__(self, carry):
        """(x [B,T,C], aux loss so far) -> the same after this block."""
        policy = REMAT_POLICIES[self.remat]
        if policy is None:
            return self._forward(carry)
        return nnx.remat(type(self)._forward, policy=policy)(self, carry)

    def _forward(self, carry):
        x, aux = carry
        h, a = self.attn(self.attn_norm(x))
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), aux + a


class DecoderLM(nnx.Module):
    """tokens [B, T] int -> (logits [B, T, vocab] f32, aux_loss scalar f32)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, r, rngs=rngs) for r in cfg.layer_ratios])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = _weight(rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model)

    def __call__(self, tokens):
        dt = jnp.dtype(self.cfg.compute_dtype)
        with jax.named_scope("embed"):
            x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)  # [B, T, C]
        x, aux = apply_layers(self.blocks, (x, jnp.zeros((), jnp.float32)))
        x = self.final_norm(x)
        with jax.named_scope("head"):
            logits = (x @ self.head[...].astype(dt)).astype(jnp.float32)
        return logits, aux


def count_params(params) -> int:
    return int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))
