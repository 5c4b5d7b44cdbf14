"""The public op: validation, impl choice (csa_jax/registry.py) and dispatch into the custom_vjp
(csa_jax/vjp.py)."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from csa_jax import registry
from csa_jax.common import sanitize_indices
from csa_jax.layouts import as_layout
from csa_jax.vjp import attention

# Compiled once per shape and static option, also for eager callers.
_attention = jax.jit(attention, static_argnums=(4, 5, 6, 7))

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _shape(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_inputs(q, kv, idx, sink):
    qs, kvs, ids = _shape(q, "q"), _shape(kv, "kv"), _shape(idx, "idx")
    if len(qs) != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {qs} (rank {len(qs)})")
    if len(kvs) != 3:
        raise ValueError(f"kv must be [B, N, D], got shape {kvs} (rank {len(kvs)})")
    if len(ids) != 3:
        raise ValueError(f"idx must be [B, T, K], got shape {ids} (rank {len(ids)})")
    B, T, H, D = qs
    if kvs[0] != B or ids[0] != B:
        raise ValueError(f"batch sizes differ: q has B={B}, kv has B={kvs[0]}, idx has B={ids[0]}")
    if ids[1] != T:
        raise ValueError(f"idx has T={ids[1]} tokens but q has T={T}")
    if kvs[2] != D:
        raise ValueError(f"head dims differ: q has D={D}, kv has D={kvs[2]}")
    if min(B, T, H, D) == 0 or kvs[1] == 0 or ids[2] == 0:
        raise ValueError(f"empty dimension: q {qs}, kv {kvs}, idx {ids}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q.dtype={q.dtype} must be one of bfloat16, float16, float32")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv.dtype={kv.dtype} must equal q.dtype={q.dtype}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"idx must be an integer array, got idx.dtype={idx.dtype}")
    if sink is not None:
        ss = _shape(sink, "sink")
        if ss != (H,):
            raise ValueError(f"sink must be [H] = [{H}], got shape {ss}")
        if not jnp.issubdtype(sink.dtype, jnp.floating):
            raise TypeError(f"sink must be floating point, got sink.dtype={sink.dtype}")


def _platform():
    return jax.default_backend()


def resolve_impl(impl, q_shape, kv_shape, idx_shape, dtype) -> registry.Impl:
    """The registered Impl to run: `impl` itself, or for "auto" the platform's best (the order and
    the rules are csa_jax/registry.py's). On NVIDIA GPUs that is registry.AUTO_GPU's measured
    order per head-count bucket and head dim: at D = 512 gluon for H > 32, pallas_triton for
    H <= 32; pallas_triton at other D; each only where its unsupported() accepts the problem (bf16/f16 on NVIDIA; gluon also needs triton +
    jax-triton and compute capability 9.x). f32 inputs, CPUs and ROCm: xla; TPUs: pallas_tpu."""
    return registry.resolve(impl, q_shape, kv_shape, idx_shape, dtype, _platform())


def sparse_attention(q, kv, idx, sink=None, *, scale=None, impl="auto", interpret=None,
                     config=None, layout=None):
    """Compressed sparse attention (csa_spec.md section 3): returns (o, lse).

    q    [B, T, H, D] bf16/f16/f32, already normed and rotated.
    kv   [B, N, D], same dtype: one row serves as key and value (K == V).
    idx  [B, T, K] integer: the kv rows each query uses, in any order. -1 marks an empty slot and
         so does every value outside [0, N) (never an out-of-bounds read). A row listed twice
         counts twice.
    sink [H] float or None: a per-head logit that joins the softmax denominator, no value.
    scale: softmax scale, default D ** -0.5.
    impl: "auto" or a registered impl: "xla", "pallas_tpu", "pallas_triton", "gluon" (optional:
         pip install csa_jax[gluon]); csa_jax.available_impls() lists those that run here.
         "pallas_mosaic_gpu" is reserved (raises NotImplementedError).
    interpret: None (interpret a Pallas impl when its hardware is absent), True/False, or the
         dialect's InterpretParams, passed through (e.g. race detection).
    config: the impl's own Config (e.g. csa_jax.reference.Config(dkv="scatter")); None = default.
    layout: what idx is known to hold: None (nothing), "cr0" | "cr4" | "cr128" (window 128,
         pool ratio 128) or csa_jax.Layout(kind, window=, pool_ratio=) (csa_jax/layouts.py). An
         impl that can use it reads structured tiles instead of the list (gluon's cr0 window
         kernel; pallas_tpu's window / pool tiles); the values are the same. A concrete idx that
         breaks it raises ValueError; under jit its tokens' outputs are NaN. With an explicit
         `config` the config's own layout field must agree.

    o [B, T, H, D] in q.dtype; lse [B, T, H] f32, natural log, sink included. A row with no valid
    slot gives o = 0 and lse = sink[h] (or EMPTY_LSE = -1e30 without a sink). A NaN or +inf
    among a token's used scores (NaN / inf in q or a used kv row) makes its o and lse NaN, for
    every impl. Differentiable w.r.t. q, kv and sink through both outputs in reverse mode
    (forward mode raises NotImplementedError). Under jit, inputs split over batch (and q / sink
    over heads) run shard by shard (csa_jax/sharding.py).
    """
    _check_inputs(q, kv, idx, sink)
    B, T, H, D = q.shape
    if scale is None:
        scale = float(D) ** -0.5
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a Python float (static), got {type(scale).__name__}")
    scale = float(scale)
    if not np.isfinite(scale) or scale == 0:
        raise ValueError(f"scale={scale} must be finite and non-zero")
    promise = None if layout is None else as_layout(layout)
    impl = resolve_impl(impl, q.shape, kv.shape, idx.shape, q.dtype)
    if config is None:
        config = impl.default_config(q.shape, kv.shape, idx.shape, q.dtype, promise)
    elif not isinstance(config, impl.Config):
        raise TypeError(f"config for impl={impl.name!r} must be {impl.mod.__name__}.Config, "
                        f"got {type(config).__name__}")
    elif promise is not None and hasattr(config, "layout"):
        have = (config.layout, config.window, config.pool_ratio)
        if promise.kind != "generic" and have != (promise.kind, promise.window,
                                                  promise.pool_ratio):
            raise ValueError(f"layout={promise} disagrees with config.layout / window / "
                             f"pool_ratio = {have}; give one of them")
    idx = sanitize_indices(idx, kv.shape[1])
    check_layout = getattr(impl.mod, "check_layout", None)
    if check_layout is not None and not isinstance(idx, jax.core.Tracer):
        check_layout(idx, kv.shape[1], config)      # a layout promise, checked before tracing
    sink_arr = (jnp.full((H,), -jnp.inf, jnp.float32) if sink is None
                else sink.astype(jnp.float32))
    try:
        # an eager call lowers here: the impl may silence its dialect's own warnings meanwhile
        with getattr(impl.mod, "quiet_lowering", contextlib.nullcontext)():
            o, lse = _attention(q, kv, idx, sink_arr, impl, scale, interpret, config)
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        raise NotImplementedError(
            "sparse_attention supports reverse-mode autodiff only (jax.grad, jax.vjp, "
            "jax.jacrev: a custom_vjp with hand-written backward kernels); forward mode "
            "(jax.jvp, jax.jacfwd, jax.hessian) is not implemented") from e
    return o, lse
