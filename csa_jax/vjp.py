"""The custom_vjp around every impl, and the impl-module interface it dispatches to.

Each impl is a module (csa_jax.reference for "xla", csa_jax.kernels.tpu, csa_jax.kernels.triton,
csa_jax.pallas_mosaic_gpu) exposing:

    class Config                      frozen, validated dataclass of tuning knobs
    default_config(q_shape, kv_shape, idx_shape, dtype) -> Config
    forward(q, kv, idx, sink, *, scale, interpret, config) -> (o, lse)
    backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config) -> (dq, dkv, dsink)

and may expose `unsupported(q_shape, kv_shape, idx_shape, dtype) -> str | None` (a reason, for
"auto" to skip it). What the wrapper guarantees to a module: validated shapes, q and kv of one
dtype, idx int32 with every value -1 or in [0, N), sink always an f32 [H] array (-inf = no sink),
scale a Python float. Kernels never import this file.
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

IMPL_MODULES = {
    "xla": "csa_jax.reference",
    "pallas_tpu": "csa_jax.kernels.tpu",
    "pallas_mosaic_gpu": "csa_jax.pallas_mosaic_gpu",
    "pallas_triton": "csa_jax.kernels.triton",
}


def _load(impl: str):
    """The impl's module, or None if it has not landed."""
    name = IMPL_MODULES[impl]
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None
    if not all(hasattr(mod, f) for f in ("Config", "default_config", "forward", "backward")):
        return None
    return mod


def impl_module(impl: str):
    """The module of an impl name; NotImplementedError if that impl has not landed."""
    mod = _load(impl)
    if mod is None:
        raise NotImplementedError(
            f"impl={impl!r} is not implemented yet (no module {IMPL_MODULES[impl]} with the impl "
            f"interface); available: {available_impls()}")
    return mod


def available_impls() -> list[str]:
    return [impl for impl in IMPL_MODULES if _load(impl) is not None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def attention(q, kv, idx, sink, impl, scale, interpret, config):
    return impl_module(impl).forward(q, kv, idx, sink, scale=scale, interpret=interpret,
                                     config=config)


def _fwd(q, kv, idx, sink, impl, scale, interpret, config):
    o, lse = attention(q, kv, idx, sink, impl, scale, interpret, config)
    return (o, lse), (q, kv, idx, sink, o, lse)


def _bwd(impl, scale, interpret, config, res, cts):
    q, kv, idx, sink, o, lse = res
    do, dlse = cts
    dq, dkv, dsink = impl_module(impl).backward(
        q, kv, idx, sink, o, lse, do.astype(q.dtype), dlse.astype(jnp.float32),
        scale=scale, interpret=interpret, config=config)
    # Without a sink (sink == -inf everywhere) its cotangent is exactly zero.
    dsink = jnp.where(jnp.isneginf(sink), 0.0, dsink)
    return dq, dkv, None, dsink


attention.defvjp(_fwd, _bwd)
