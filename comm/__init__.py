"""comm: overlapped and hierarchical collectives (inside `jax.shard_map`) and FSDP for Flax NNX.

See docs/comm.md for the schedules and comm/fsdp.py for the FSDP API.
"""

from comm.collectives import (
    OVERLAPS,
    all_gather_matmul,
    hierarchical_all_gather,
    hierarchical_psum_scatter,
    matmul_reduce_scatter,
    ring_all_gather,
    ring_psum_scatter,
)

__all__ = [
    "OVERLAPS",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "hierarchical_all_gather",
    "hierarchical_psum_scatter",
    "ring_all_gather",
    "ring_psum_scatter",
]
