"""pallas_tpu compiled ahead of time by the real Mosaic compiler (libtpu) for TPU v5e and v6e.

No TPU is needed: libtpu compiles for a named topology on the CPU (csa_jax/kernels/tpu/aot.py).
Skipped when libtpu is not installed (it is in the [tpu-aot] extra, which [dev], and so
scripts/setup.sh and CI, install on Linux). One realistic size: V4-Flash (H = 64, D = 512),
T = 4096, every layout (cr0, cr4, cr128 each in its own layer's index shape, and the generic
layout on the cr4 one), bf16 and f32: every kernel kind (forward; backward launch 0 and a
shorter last token-chunk launch; both CSR dkv reductions of gathered slots) must compile under the
generation's default scoped VMEM limit; the compiler's scoped VMEM, code size and HBM
footprint (memory_analysis) of each are printed (pytest -s) and checked.
"""
from __future__ import annotations

import pytest

from csa_jax.kernels.tpu import aot
from csa_jax.kernels.tpu.backward import launch_blocks
from csa_jax.kernels.tpu.config import generation_vmem
from csa_jax.kernels.tpu.plan import _make_plan

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(),
                                  reason="libtpu not installed (pip install -e '.[tpu-aot]')")

CASES = [(ratio, layout, dtype) for ratio, layout in ((0, "struct"), (4, "struct"),
                                                      (128, "struct"), (4, "generic"))
         for dtype in ("bfloat16", "float32")]
# what every problem launches, and what only those that gather slots do (cr4, generic: at
# T = 4096 their backward intermediates, 4-5 GiB, are split into token-chunk launches of at
# most 1 GiB; where the last launch is shorter (both, here) it is compiled too: bwd_chunk,
# dkv_*_chunk)
ALWAYS = {"fwd", "bwd"}
GATHERED = {"dkv_seg", "dkv_row"}
SHORT_LAST_LAUNCH = {"bwd_chunk", "dkv_seg_chunk", "dkv_row_chunk"}


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
@pytest.mark.parametrize("ratio,layout,dtype", CASES)
def test_kernels_compile_for_tpu(gen, ratio, layout, dtype):
    p = aot.layer_problem("flash", ratio, 4096, dtype, layout=layout, generation=gen)
    rows = aot.compile_kernels(p, gen)
    report = aot.table(rows)
    print("\n" + report)
    names = {r["kernel"] for r in rows}
    gathers = p.config.layout in ("generic", "cr4")
    want = ALWAYS | (GATHERED if gathers else set())
    if gathers:
        launches = launch_blocks(_make_plan(p.q, p.kv[1], p.idx[-1], p.config, p.dtype),
                                 p.config)
        assert len(launches) > 1                      # the token-chunk launches are exercised
        if launches[-1][1] != launches[0][1]:
            want |= SHORT_LAST_LAUNCH
    assert want <= names, report
    bad = [r for r in rows if not r["ok"]]
    assert not bad, f"did not compile for {gen}:\n{report}"
    for r in rows:
        assert r["vmem_limit"] == generation_vmem(gen)[1]
        assert r["scoped_vmem"] is not None and 0 < r["scoped_vmem"] <= r["vmem_limit"], report
        assert r["code_bytes"] > 0 and r["hbm_peak"] > 0, report


def test_scoped_vmem_parsers():
    """The two forms of the compiler's over-limit error, and the compiled custom call's record."""
    assert aot.scoped_vmem_from_error(
        "Scoped allocation with size 16.50M and limit 16.00M exceeded") == int(16.5 * 2**20)
    assert aot.scoped_vmem_from_error("Used 548.0K of 4.0K vmem") == 548 * 1024
    assert aot.scoped_vmem_from_error("some other error") is None

    class Compiled:
        def as_text(self):
            return ('%k = f32[8] custom-call(%a), custom_call_target="tpu_custom_call", '
                    'backend_config={"used_scoped_memory_configs":[{"memory_space":"1",'
                    '"offset":"0","size":"16482304"}],"retry_config":{}}\n'
                    '%f = f32[8] fusion(%a), backend_config={"used_scoped_memory_configs":'
                    '[{"memory_space":"1","offset":"0","size":"99"}]}')
    assert aot.scoped_vmem_of(Compiled()) == 16482304
