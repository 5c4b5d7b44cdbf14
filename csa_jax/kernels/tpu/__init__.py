"""CSA forward and backward as Pallas TPU-dialect kernels with explicit DMAs (impl="pallas_tpu").

The paper's Tensor-Data-Mover model ("issue N+1 tensor loads, compute on the oldest, wait on a
counter") written with `pltpu.make_async_copy` and one DMA semaphore per ring slot. kv stays in
HBM (`memory_space=pltpu.HBM`); index lists arrive in SMEM and drive the copies: each program gets
its own block's gathered slots as an SMEM block (pipelined by Pallas like scalar prefetch, but
a few KiB per program instead of all of idx), and the CSR reduce gets its maps by scalar
prefetch.
The softmax block math and the ring arithmetic come from csa_jax/blockmath.py (shared with the
GPU dialects); only the data movement below is TPU-specific. docs/pallas_tpu.md has the numbers.

A program owns block_t consecutive tokens and all H heads of each (rows of q, o and the
online-softmax state are (token, head) pairs, [block_t*H, ...]), so one fetched kv row serves
every head and both products (QK^T and PV; K == V). It streams a sequence of tiles of block_k kv
rows through a ring of `depth` VMEM slots [depth, block_k, D] ([depth, block_k, 1, D] for the
layouts that gather rows, see ring._Ring), one DMA semaphore per slot:

    prologue: issue steps 0 .. depth-2
    step i:   issue step i+depth-1 into slot (i-1) % depth  (freed by step i-1's compute)
              wait on slot i % depth                         (once per DMA issued into it)
              s = scale * q @ tile^T; online-softmax update; acc = alpha*acc + p @ tile

    depth 3      slot 0        slot 1        slot 2
    prologue     load 0        load 1        .
    step 0       [compute 0]   (load 1)      load 2
    step 1       load 3        [compute 1]   (load 2)
    step 2       (load 3)      load 4        [compute 2]
    step 3       [compute 3]   (load 4)      load 5          ... (load = DMA in flight)

The tiles of a program, in stream order (Config.layout says which exist):
- window tiles ("cr0", "cr4", "cr128"): the union of the block's windows is the contiguous rows
  [max(t0 - window + 1, 0), t0 + block_t); fetched once as contiguous tiles, ONE DMA per tile,
  the first starting at that row rounded down to the sublane tile (Mosaic's alignment rule);
  every (token, head) row masks the tile by its own band [t - window + 1, t].
- pool tiles ("cr128"): the pool rows visible to the block's last token, contiguous, one DMA
  per tile, masked per token by p < (t + 1) // pool_ratio.
- gathered tiles ("generic": all K slots; "cr4": the top-k pool slots): per token, block_k
  slots, ONE DMA PER NON-EMPTY SLOT (kv row idx[t, j]); an empty slot (-1) is never fetched:
  its ring row is zero-filled by a vector store and its probability masked to exactly 0.
"generic" works for every idx and is the default; the structured layouts are a promise by the
caller (the model layer knows its layer type), checked by check_layout whenever idx is concrete.

Backward (csa_spec.md section 3; deterministic, no atomics, no scatter), in launches of
Config.token_chunk tokens (all T when None; the per-slot intermediate below is bounded by it),
run one after another; each streams every tile of its own token blocks:
1. `_bwd_kernel`, the same stream: re-fetch the tiles, recompute p = exp(s - lse) (delta = o.dO
   fused in), ds = p * (dp - delta + dlse), dq += scale * ds @ tile (accumulated in f32 in
   VMEM, written once per block over dO's HBM buffer: input_output_aliases, each program
   reads its dO block before its dq block is written back), and the tile's dkv rows
   scale * ds^T q + p^T dO, written once per (program, tile) or per slot (one writer each)
   to HBM through a 2-slot write-back ring (stage in VMEM, async copy out, wait two steps
   later), so no intermediate block has to fit in VMEM.
   lse, dlse and delta live in HBM as lane-dense [B, nb, block_t, H] blocks (token_rows; a
   [T*H, 1] f32 column pads to 128 lanes) and become [block_t*H, 1] columns in VMEM by a select
   and a sum (plan.rows_to_col / col_to_rows, exact).
   The transposed products are transposed-operand dots (dot_general contracting dim 0 of both;
   the `x.T @ y` variant, an ablation never run on a TPU, is at tag gluon-variants-2026-12-02).
2. dkv of gathered slots: per-slot intermediate [token_chunk, K, D] f32 per launch, a CSR
   inverse map (stable sort by kv row + searchsorted, XLA), then `_dkv_kernel` twice: over
   segments of at most `fanin_split` entries of one row (a program owns block_r segments and
   streams their entries through a ring, one DMA per intermediate row, adding them in sorted
   order, the next step's index window fetched while the current one is in flight; a hot row
   is spread over many programs), then over rows (each row's segments in order). Fixed
   summation order: bit-identical across runs and program orders.
3. dkv of window / pool tiles: closed-form inverse maps (`_dkv_struct`) over the per-block
   partials every launch fills in place: window row r gathers the unions of blocks
   r // block_t .. (r + window - 1) // block_t at fixed offsets; pool row p sums one partial
   per block (the fan-in of cr128 pool row 0 is split across all programs).
4. dsink = sum_t exp(sink - lse) * (dlse - delta) from the kernel's delta (XLA).
Launches and partials are added in a fixed order.

Files: config.py (Config, default_config, check_layout, the per-generation VMEM limit), plan.py
(launch geometry, kernel inputs, MXU products), ring.py (the DMA ring and a program's tile
stream), forward.py, backward.py, dkv.py (the dkv reductions), aot.py (compile ahead of time for
TPU generations with the real Mosaic compiler, on a CPU; docs/pallas_tpu.md). This package is
the impl module (interface: csa_jax/registry.py).
"""
from csa_jax.blockmath import inverse_map
from csa_jax.kernels.tpu.backward import backward
from csa_jax.kernels.tpu.config import (LAYOUTS, PLATFORMS, Config, check_layout,
                                        default_config)
from csa_jax.kernels.tpu.dkv import split_map
from csa_jax.kernels.tpu.forward import forward

__all__ = ["Config", "default_config", "forward", "backward", "check_layout", "LAYOUTS",
           "PLATFORMS", "inverse_map", "split_map"]
