"""Compile-only checks of the two Pallas Triton indexer kernels (the scores kernel,
csa_jax/kernels/triton/indexer.py, and the top-k threshold select, topk.py) for GPU targets on a
CPU: lowered by Pallas for the target's platform (non-interpreted), compiled by the triton
wheel's backend to PTX / AMDGCN, then no spills and shared memory inside the target's limit.
indexer_topk's "auto" runs them on NVIDIA GPUs (measured on the H200); on AMD they run only
when asked for, so AMD is compile-checked here and not timed. Skipped without triton."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

pytest.importorskip("triton")

from benchmarks import triton_compile as tcm  # noqa: E402
from benchmarks import triton_ir  # noqa: E402
from csa_jax.kernels.gluon import adapter  # noqa: E402
from csa_jax.kernels.triton import indexer as tki  # noqa: E402
from csa_jax.kernels.triton import topk as tkt  # noqa: E402

S = jax.ShapeDtypeStruct


def _kernels(fn, args, target):
    """{kernel name: (TTIR, num_warps, num_stages)} of fn lowered for the target's platform."""
    platform, kind = tcm.LOWERING[target]
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=None, platform=platform))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return triton_ir.kernel_texts(text)


@pytest.mark.parametrize("target", ["sm_90a", "gfx942", "gfx950"])
def test_indexer_kernels_compile(target):
    kernels = dict(_kernels(lambda s: tkt.select_topk(s, 64, interpret=False),
                            (S((1, 128, 512), jnp.float32),), target))
    kernels.update(_kernels(
        lambda q, k, w: tki.indexer_scores(q, k, w, ratio=4, interpret=False),
        (S((1, 256, 4, 64), jnp.bfloat16), S((1, 64, 64), jnp.bfloat16),
         S((1, 256, 4), jnp.float32)), target))
    assert set(kernels) == {"csa_triton_topk_select", "csa_triton_indexer_scores"}
    for name, (text, nw, ns) in kernels.items():
        md, asm = tcm.compile_ttir(text, target, nw, ns)
        r = adapter.asm_resources(asm, target, name=name, num_warps=nw, shared=md["shared"],
                                  launch_problem=None)
        spills = r.get("spill_stores", 0) or r.get("vgpr_spill", 0)
        assert spills == 0, (name, target, r)
        assert r["shared"] <= r["shared_limit"], (name, target, r)
