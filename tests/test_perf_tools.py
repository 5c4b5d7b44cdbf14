"""Training-throughput tools on CPU: no f32 matrix product in a bf16 step (benchmarks/hlo_dots.py),
the profiler trace of `python -m train --profile-steps` and its breakdown table
(benchmarks/trace_breakdown.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hlo_dots  # noqa: E402

import csa_jax  # noqa: E402


def test_bf16_step_has_no_f32_products():
    """Every matrix product of a bf16 training step (forward, backward, compressor, indexer)
    takes bf16 operands; an f32 step keeps f32 ones (the lister sees both)."""
    rows = hlo_dots.list_dots(hlo_dots.lower_step("tiny", 256, "xla", "bfloat16", batch_size=2))
    assert len(rows) > 50
    f32 = [r for r in rows if "f32" in (hlo_dots._elem(r[1]), hlo_dots._elem(r[2]))]
    assert not f32, f32[:3]
    # the compressor's products are found and attributed to their source line
    assert any(f.startswith("csa_jax/compressor.py:") for r in rows for f in r[4])
    rows32 = hlo_dots.list_dots(hlo_dots.lower_step("tiny", 256, "xla", "float32", batch_size=2))
    assert rows32 and all(hlo_dots._elem(r[1]) == "f32" for r in rows32)


def test_compress_backward_products_are_bf16():
    x = jnp.ones((1, 16, 8), jnp.bfloat16)
    w = jnp.ones((8, 8), jnp.bfloat16)
    ape, ns = jnp.zeros((4, 8)), jnp.ones((4,))
    f = jax.grad(lambda x, w: csa_jax.compress(x, w, w, ape, ns, ratio=4).sum(), argnums=(0, 1))
    rows = hlo_dots.list_dots(jax.jit(f).lower(x, w).as_text(debug_info=True))
    assert len(rows) >= 3  # forward, d/dx, d/dw
    assert all(hlo_dots._elem(r[1]) == hlo_dots._elem(r[2]) == "bf16" for r in rows), rows
