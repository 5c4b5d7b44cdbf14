"""A small NNX model with a layer stack, for the FSDP tests (test_comm_fsdp, _comm_worker).

The model calls `comm.fsdp.apply_layers(self.layers, x)`, which is all a model needs to do for
explicit FSDP to gather its weights layer by layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from comm import fsdp

__all__ = ["MLPBlock", "MLPStack", "mse_loss"]


class MLPBlock(nnx.Module):
    """x + down(gelu(up(norm(x)))): [B, D] -> [B, D]."""

    def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class MLPStack(nnx.Module):
    """inp -> num_layers MLPBlocks -> out: [B, d_in] -> [B, d_out]."""

    def __init__(self, d_in: int, d: int, hidden: int, d_out: int, num_layers: int, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(d_in, d, rngs=rngs)
        self.layers = nnx.List([MLPBlock(d, hidden, rngs=rngs) for _ in range(num_layers)])
        self.out = nnx.Linear(d, d_out, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        x = fsdp.apply_layers(self.layers, x)
        return self.out(x)


def mse_loss(model, batch):
    """Mean squared error of model(batch["x"]) against batch["y"]."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
