"""GPU benchmarks (run by hand on the device machine; each checks correctness and prints a table).

Run them from the repository root as modules, e.g. `python -m benchmarks.bench_csa --help`
(or `PYTHONPATH=. python benchmarks/bench_csa.py`): `benchmarks` is a package, and its scripts
share helpers through benchmarks/common.py, never through sys.path.

What is here, by topic (docs/perf/README.md lists the pages whose commands use them):
- the op: bench_csa (forward / backward / step of each impl, the grid), bench_xla_reference
  (the XLA reference's chunk and dkv choices);
- training: bench_train (tokens/s, MFU), trace_breakdown (a profile by op family), hlo_dots (the
  step's matrix products and their dtypes, on a CPU), train_ops_probe (a step's XLA-side pieces
  alone), topk_select_probe (the exact top-k select kernel), train_perf_gpu.sh (the one runner
  of the above on a GPU);
- communication: bench_comm (GEMMs under concurrent collectives);
- pallas_tpu: tpu_mlir_diff (the default kernels' Mosaic MLIR before and after a change, on a CPU);
- anchors: anchor_flashmla (FlashMLA's forward in the same call: bench_csa --anchor DIR);
- pallas_triton: triton_compile / triton_ir / triton_resources (compile and resources on a CPU),
  triton_asm_diff (the default kernels' code before and after a change, on a CPU),
  triton_fwd_probe (the forward kernel with one stage left out), triton_ncu.sh (Nsight Compute);
- gluon: gluon_check, gluon_bwd_check, gluon_grad_configs (checks vs xla on the GPU),
  gluon_kernel_time (where the time goes), gluon_resources
  (every GPU kernel's resources for every target, on a CPU), gluon_asm_diff (same code before
  and after a change, on a CPU).
Probes and sweeps of Gluon variants that left the library (the dq-operand modes, the window
backward, ...) were removed with them; tag `gluon-variants-2026-12-02` has them.

The entry points they use, in one place:
- the public API: csa_jax.sparse_attention and friends, csa_jax.preset, csa_jax.BENCHMARK_GRID;
- csa_jax.registry (registry.get(name): the impl's Config / default_config / forward /
  backward, called directly to time the forward and backward alone), csa_jax.problems (the
  random V4 problems python -m csa_jax also times), csa_jax.__main__'s table helpers;
- internal, for testing and benchmarking only: csa_jax.kernels.triton.testing (a kernel's
  pieces: the backward part by part, the forward with another kernel body, the inverse map),
  csa_jax.kernels.triton.topk (the select kernel alone), csa_jax.kernels.gluon's kernel
  modules and adapter (the gluon_* modules compile and time single kernels);
- train/ and comm/ public functions (bench_train, bench_comm, train_ops_probe, hlo_dots).
"""
