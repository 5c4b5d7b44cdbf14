"""`ModelConfig.scan_layers`: the repeating cycle of the layer schedule as one `lax.scan`.

A V4 schedule repeats a short cycle of layer types (`small`: cr0 cr0, then (cr4 cr128) x 5). The
plain model traces, and XLA compiles, every block separately; with scan_layers the blocks of the
longest repeating run are applied by one `jax.lax.scan` whose body is one cycle (one block per
layer type), so each layer type of the run is traced and compiled once. The parameters keep their
per-layer layout (checkpoints, FSDP and the optimizer see the same pytree): inside the step each
cycle position's blocks are split with `nnx.split`, their (compute-dtype) states stacked along a
new leading axis and sliced back by the scan; the gradient flows back through the stack.

This is `nnx.scan` written with its two halves (`nnx.split` / `nnx.merge` around `lax.scan`):
the scan carries only the residual stream and the aux loss, and no module state changes inside
it, so no NNX state bookkeeping is needed.

Same numbers as the loop up to float rounding (the ops are the same; XLA fuses a loop body apart
from its neighbours). What it may cost: the stacked weights are one more copy (a few hundred MB
for `small`), and work that XLA shares between the layers of one type in the loop (the fixed
index lists of cr0 / cr128 layers and their inverse maps, csa_jax.blockmath) is inside the body,
computed once per iteration unless XLA hoists it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["find_cycle", "scan_blocks"]


def find_cycle(ratios):
    """(start, period, repeats) of the run of repeated cycles that saves the most traced layers
    ((repeats - 1) * period; ties: the shorter period, then the earlier start), or None when no
    cycle repeats (every layer type would be traced once anyway)."""
    ratios = tuple(ratios)
    n = len(ratios)
    best, best_saved = None, 0
    for start in range(n):
        for period in range(1, (n - start) // 2 + 1):
            reps = 1
            while (start + (reps + 1) * period <= n
                   and ratios[start + reps * period: start + (reps + 1) * period]
                   == ratios[start: start + period]):
                reps += 1
            saved = (reps - 1) * period
            if reps >= 2 and saved > best_saved:
                best, best_saved = (start, period, reps), saved
    return best


def scan_blocks(blocks, carry, cycle):
    """carry = block(carry) for every block in order, the `cycle` (find_cycle's triple) as one
    lax.scan. The blocks of one cycle position must have one graph structure (same layer type)."""
    blocks = list(blocks)
    start, period, reps = cycle
    end = start + period * reps
    for b in blocks[:start]:
        carry = b(carry)
    parts = [nnx.split(b) for b in blocks[start:end]]
    graphdefs = [g for g, _ in parts[:period]]
    for i, (g, _) in enumerate(parts):
        if g != graphdefs[i % period]:
            raise ValueError(f"scan_layers: layer {start + i} differs in structure from layer "
                             f"{start + i % period}, the same position of the layer cycle "
                             f"(start {start}, period {period})")
    stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in parts[j::period]])
               for j in range(period)]

    def body(c, states):
        for g, s in zip(graphdefs, states):
            c = nnx.merge(g, s)(c)
        return c, None

    with jax.named_scope("layer_scan"):
        carry, _ = jax.lax.scan(body, carry, stacked)
    for b in blocks[end:]:
        carry = b(carry)
    return carry
