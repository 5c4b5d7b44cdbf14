"""The one custom_vjp around every impl (the impl-module interface: csa_jax/registry.py).

`impl` is the resolved csa_jax.registry.Impl (hashable, static): no name lookups here. Under a
mesh the impl runs shard by shard (csa_jax/sharding.py); it never sees a sharding itself.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from csa_jax import sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def attention(q, kv, idx, sink, impl, scale, interpret, config):
    return sharding.forward(impl, q, kv, idx, sink, scale=scale, interpret=interpret,
                            config=config)


def _fwd(q, kv, idx, sink, impl, scale, interpret, config):
    o, lse = attention(q, kv, idx, sink, impl, scale, interpret, config)
    return (o, lse), (q, kv, idx, sink, o, lse)


def _bwd(impl, scale, interpret, config, res, cts):
    q, kv, idx, sink, o, lse = res
    do, dlse = cts
    dq, dkv, dsink = sharding.backward(
        impl, q, kv, idx, sink, o, lse, do.astype(q.dtype), dlse.astype(jnp.float32),
        scale=scale, interpret=interpret, config=config)
    # Without a sink (sink == -inf everywhere) its cotangent is exactly zero.
    dsink = jnp.where(jnp.isneginf(sink), 0.0, dsink)
    return _like(dq, q), _like(dkv, kv), None, _like(dsink, sink)


def _vma(x):
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _like(ct, primal):
    """The cotangent typed like its primal inside a shard_map (check_vma): summed over the
    manual axes the primal is invariant over (it was used by every device: the shards'
    contributions add, e.g. a replicated sink's), cast to varying over those it varies over."""
    extra = tuple(sorted(_vma(ct) - _vma(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    missing = tuple(sorted(_vma(primal) - _vma(ct)))
    if missing:
        ct = jax.lax.pcast(ct, missing, to="varying")
    return ct


attention.defvjp(_fwd, _bwd)
