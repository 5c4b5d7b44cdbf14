"""GPU benchmarks (run by hand on the device machine; each checks correctness and prints a table).

Run them from the repository root as modules, e.g. `python -m benchmarks.bench_csa --help`
(or `PYTHONPATH=. python benchmarks/bench_csa.py`): `benchmarks` is a package, and its scripts
share helpers through benchmarks/common.py, never through sys.path.

The entry points they use, in one place:
- the public API: csa_jax.sparse_attention and friends, csa_jax.preset, csa_jax.BENCHMARK_GRID;
- csa_jax.registry (registry.get(name): the impl's Config / default_config / forward /
  backward, called directly to time the forward and backward alone), csa_jax.problems (the
  random V4 problems python -m csa_jax also times), csa_jax.__main__'s table helpers;
- internal, for testing and benchmarking only: csa_jax.kernels.triton.testing (a kernel's
  pieces: the backward part by part, the forward with another kernel body, the inverse map);
- train/ and comm/ public functions (bench_train, bench_comm).
"""
