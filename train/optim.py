"""The gradient clip's global norm in a few large reductions on GPUs (issue 17).

optax.clip_by_global_norm (and the step's grad_norm metric, which XLA merges with it) sums each
parameter's squares in its own reduction: for `small` (229 arrays) 362 reduction kernels per step,
0.69 ms on the H200 for 0.68 GB of f32 gradients, whose read alone takes ~0.16 ms (the optimizer
probe's trace, docs/perf/train_h200.md). `global_norm` here sums the squares of up to GROUP arrays
at a time over one concatenation of their flattened values, which XLA can fuse into a single
reduction that reads them in place. The norm is the same up to f32 summation order.

Only on GPUs and only for the one-device step: elsewhere (CPU, FSDP, where a concatenation of
sharded arrays would move data) it is optax.tree.norm, so those programs are unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["GROUP", "clip_by_global_norm", "global_norm"]

GROUP = 32          # arrays per fused reduction
_GPU = ("gpu", "cuda", "rocm")


def _grouped_here(grouped):
    return grouped and jax.default_backend() in _GPU


def global_norm(tree, *, grouped=True):
    """sqrt(sum of squares of every leaf); grouped (on GPUs): GROUP leaves per reduction."""
    if not _grouped_here(grouped):
        return optax.tree.norm(tree)
    leaves = [jnp.ravel(x) for x in jax.tree.leaves(tree)]
    parts = [jnp.sum(jnp.square(jnp.concatenate(leaves[i:i + GROUP])))
             for i in range(0, len(leaves), GROUP)]
    return jnp.sqrt(sum(parts[1:], parts[0]))


def clip_by_global_norm(max_norm, *, grouped=True) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same state, same formula) with `global_norm`'s norm."""

    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates, grouped=grouped)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip_fn, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
