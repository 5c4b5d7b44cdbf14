"""CSA forward and backward in the Pallas Triton dialect ("pallas_triton" impl).

The Triton dialect is the only Pallas path to AMD ROCm GPUs, and on Hopper its pointer gather
(`kv_ref.at[ids[:, None], cols]`, thread-issued vector loads) beats per-row TMA for top-k rows. The
compiler pipelines the loads (`num_stages`); there are no explicit async copies here: this is the
"thread-issued loads" baseline that the explicit-DMA kernels are compared against.

Kernels (grids are 1-D and ordered so that the programs sharing a token run side by side and
their repeated gathers hit L2):

- forward, program = (b, t, head block): q [hb, D] stays resident; the token's slots are walked
  in tiles of `block_k` gathered rows [bk, D], one online-softmax step per tile (the shared block
  math of csa_jax.blockmath). All heads of the block share one gathered tile. The loop stops at
  the token's last non-empty tile (a dynamic trip count computed from idx), so causally empty
  tails (early tokens of cr4 / cr128) cost nothing.
- dq, program = (b, t, head block): recompute p from lse, dp = dO kv^T, ds, dq += ds kv; with
  Config.interm="gemm" (default) it also stores scale*ds and p of every slot, [B, T, 2, H, K].
  On NVIDIA its score products are slot-major (Config.slot_major_dq): q and dO sit in shared
  memory as the MMA's second operand instead of in registers beside the accumulator.
- per-slot intermediate, "gemm": interm[t] = [scale*dS; P]^T [q; dO], one batched GEMM per token
  in XLA (contraction over 2H). "dq" (all heads in one dq program, the default at H <= 16,
  D <= 128 on NVIDIA): the dq kernel itself writes each tile's interm = (scale*ds)^T q + p^T dO
  from the ds and p it holds (no dS/P buffer, no GEMM).
- dkv gather-reduce, program = (b, kv row): the inverse map (kv row -> (t, j) slots, CSR built by
  a stable sort + histogram in XLA) is walked in fixed order, `block_r` slots at a time, and summed
  in f32. No atomics, no scatter: dkv is bit-deterministic.
- dsink and delta = sum_d o * dO are small XLA reductions.

Not implemented: window reuse for structured layouts (cr0 / cr128 contiguous-tile loads shared by
a block of tokens); every layout goes through the generic gather. docs/perf/triton_h200.md has the
measured speed and what limits it (registers and spills, not gathered bytes: a probe that
gathers cache-resident rows is at most 9% faster).

Padding (inside this module only): D to a power of two >= 16, H to a multiple of the head block,
K to a multiple of block_k (with -1). Triton needs power-of-two block shapes and dots of >= 16.

The Triton dialect is deprecated by JAX (it warns at every lowering). This module is the only
one in csa_jax that imports it, and it silences exactly that one warning message.

ROCm: the kernels use only dialect-generic primitives (load/store with masks, dot, fori_loop);
num_stages is always set explicitly (the ROCm default is 1) and tiles stay <= 64 rows. See
docs/pallas_triton.md for what has and has not been run on AMD hardware.

Files: config.py (Config, default_config, unsupported), plan.py (padded dims, gathers, scores),
forward.py, backward.py (dq kernel, per-slot GEMM, dkv reduce). This package is the impl module
(interface: csa_jax/registry.py); csa_jax/kernels/triton/testing.py is the entry point for benchmarks.
"""
from csa_jax.kernels.triton.backward import backward
from csa_jax.kernels.triton.config import (PLATFORMS, Config, default_config, quiet_lowering,
                                           unsupported)
from csa_jax.kernels.triton.forward import forward

__all__ = ["Config", "default_config", "unsupported", "forward", "backward", "PLATFORMS",
           "quiet_lowering"]
