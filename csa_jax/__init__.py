"""csa_jax: DeepSeek-V4 Compressed Sparse Attention for JAX.

Public API (fixed contract, see README):
    sparse_attention, validate_indices, window_indices, pool_indices, build_indices,
    compress, indexer_scores, indexer_topk, preset, CSAConfig, BENCHMARK_GRID.
"""
from csa_jax.platforms import skip_absent_tpu

skip_absent_tpu()  # before anything starts jax's backends: no libtpu probe on a CPU machine

from csa_jax import reference
from csa_jax.api import sparse_attention
from csa_jax.common import EMPTY_LSE
from csa_jax.compressor import compress, indexer_scores, indexer_topk
from csa_jax.config import BENCHMARK_GRID, BenchShape, CSAConfig, forward_flops, preset
from csa_jax.indices import build_indices, pool_indices, validate_indices, window_indices
from csa_jax.layouts import Layout
from csa_jax.registry import available_impls

__all__ = [
    "sparse_attention", "validate_indices", "window_indices", "pool_indices", "build_indices",
    "compress", "indexer_scores", "indexer_topk", "preset", "CSAConfig", "BENCHMARK_GRID",
    "BenchShape", "forward_flops", "available_impls", "EMPTY_LSE", "reference", "Layout",
]
__version__ = "0.1.0"
