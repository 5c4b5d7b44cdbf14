"""Compile the pallas_triton (Triton-dialect) kernels for a GPU target on a plain CPU.

The Triton IR comes from Pallas's lowering, lowered separately per platform (CUDA IR calls
`__nv_expf`, which the AMD backend rejects), with the impl's default config for that device kind
(csa_jax/kernels/triton/config.py), and is compiled by the triton wheel's backend with every
stage from TTIR on (a `.ttir` file handed to `triton.compile` would skip the TTIR passes). The
launch parameters (num_warps, num_stages) are read from the lowered custom call, not guessed.
Used by benchmarks/gluon_resources.py (the one command that reports every GPU kernel).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from unittest import mock

# (lowering platform, device kind) per target name of csa_jax.kernels.gluon.adapter.TARGETS.
LOWERING = {"sm_90a": ("cuda", "NVIDIA H200"), "gfx942": ("rocm", "gfx942"),
            "gfx950": ("rocm", "gfx950"), "gfx1250": ("rocm", "gfx1250")}
# The V4 shape the reports use: Pro (H = 128, D = 512) cr4, K = 1152 slots; T only sizes the
# grid, which does not change a kernel's resources.
SHAPE = dict(B=1, T=64, H=128, D=512, N=1088, K=1152)


def default_config(target, **over):
    """pallas_triton's default Config for the target's device kind, with overrides."""
    import jax.numpy as jnp
    from csa_jax.kernels import triton as pt
    from csa_jax.kernels.triton import config as tc
    s = SHAPE
    with mock.patch.object(tc, "_device_kind", lambda: LOWERING[target]):
        cfg = pt.default_config((s["B"], s["T"], s["H"], s["D"]), (s["B"], s["N"], s["D"]),
                                (s["B"], s["T"], s["K"]), jnp.bfloat16)
    return dataclasses.replace(cfg, **over)


def lowered_kernels(target, config):
    """{kernel name: (TTIR text, num_warps, num_stages)} of the forward and the backward."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    from benchmarks import triton_ir
    from csa_jax.kernels import triton as pt
    platform, kind = LOWERING[target]
    s, S = SHAPE, jax.ShapeDtypeStruct
    q = S((s["B"], s["T"], s["H"], s["D"]), jnp.bfloat16)
    kv = S((s["B"], s["N"], s["D"]), jnp.bfloat16)
    idx = S((s["B"], s["T"], s["K"]), jnp.int32)
    sink, lse = S((s["H"],), jnp.float32), S((s["B"], s["T"], s["H"]), jnp.float32)
    kw = dict(scale=s["D"] ** -0.5, interpret=False, config=config)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=None, platform=platform))
    out = {}
    with use_abstract_mesh(mesh):
        for fn, args in ((lambda *a: pt.forward(*a, **kw), (q, kv, idx, sink)),
                         (lambda *a: pt.backward(*a, **kw), (q, kv, idx, sink, q, lse, q, lse))):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            out.update(triton_ir.kernel_texts(text))
    return out


def compile_ttir(text, target, num_warps, num_stages):
    """(metadata dict, {stage: assembly text}) of Triton-dialect IR compiled for a target, up to
    the PTX / AMDGCN text (the binary stage is left out)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import Language
    from triton.compiler.compiler import make_backend
    from csa_jax.kernels.gluon.adapter import _ensure_cache_dir, make_target
    _ensure_cache_dir()
    backend = make_backend(make_target(target))
    opts = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttir")
        with open(path, "w") as f:
            f.write(text)
        mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    stages = {}
    backend.add_stages(stages, opts, Language.TRITON)
    md, asm, src = {}, {}, mod
    for name, step in stages.items():
        if name in ("cubin", "hsaco"):
            break
        src = step(src, md)
        if isinstance(src, str):
            asm[name] = src
    return md, asm
