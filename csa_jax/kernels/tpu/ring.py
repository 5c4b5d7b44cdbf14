"""The DMA ring of the TPU kernels: one VMEM slot and one DMA semaphore per tile in flight."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm
from csa_jax.kernels.tpu.plan import struct_tiles, win_start


def _when(cond, fn):
    """pl.when that also takes a static Python bool (skips dead branches at trace time)."""
    if isinstance(cond, (bool, np.bool_)):
        if cond:
            fn()
        return
    pl.when(cond)(fn)


# ----------------------------------------------------------------------------- the ring

class _Ring:
    """A ring of `depth` VMEM slots of [rows, D] (or [rows, 1, D], see below), one DMA
    semaphore per slot, over a stream of tiles of three kinds, in this order:

        [0, n_win)                      contiguous window tiles: one DMA of `rows` kv rows
        [n_win, n_win + n_pool)         contiguous pool tiles: one DMA each
        [n_win + n_pool, ...)           gathered tiles: one DMA per non-empty row

    win_start(c) / pool_start(c) give a contiguous tile's first source row (on a [rows, D]
    ring a multiple of the dtype's sublane tile, 8 rows f32 / 16 bf16: the caller aligns it);
    gather_row(g, r, slot) the source row of row r of gathered tile g (< 0: empty; never
    fetched, its ring row is zero-filled by a vector store so stale data cannot leak into
    p @ v); on_gather(g, slot) (optional) runs before tile g's rows are issued. A ring of
    [rows, 1, D] slots over a [N, 1, D] source keeps every row in its own VMEM tile, so a
    one-row DMA or zero store may target any row (Mosaic rejects a one-row bf16 copy into a
    [rows, D] tile, where rows are packed in pairs); tile(slot) reads it back as [rows, D].
    Every DMA into a slot signals that slot's semaphore; wait() waits once per DMA issue()
    started, with a copy descriptor of the same shape, so every start has its wait. `on_dma`
    (optional) is called once per DMA started (used to count them)."""

    def __init__(self, src, ring, sems, *, n_win=0, win_start=None, n_pool=0, pool_start=None,
                 gather=False, gather_row=None, on_gather=None, on_dma=None):
        self.src, self.ring, self.sems = src, ring, sems
        self.depth, self.rows = ring.shape[0], ring.shape[1]
        self.n_win, self.win_start = n_win, win_start
        self.n_pool, self.pool_start = n_pool, pool_start
        self.gather, self.gather_row = gather, gather_row
        self.on_gather = on_gather or (lambda g, slot: None)
        self.on_dma = on_dma or (lambda: None)
        self.has_win = not (isinstance(n_win, int) and n_win == 0)
        self.has_pool = not (isinstance(n_pool, int) and n_pool == 0)

    def tile(self, slot):
        """The [rows, D] tile in ring slot `slot`."""
        return self.ring[slot].reshape(self.rows, self.ring.shape[-1])

    def _tile_copy(self, slot, start):
        return pltpu.make_async_copy(self.src.at[pl.ds(start, self.rows)], self.ring.at[slot],
                                     self.sems.at[slot])

    def _row_copy(self, slot, r, row):
        return pltpu.make_async_copy(self.src.at[pl.ds(jnp.maximum(row, 0), 1)],
                                     self.ring.at[slot, pl.ds(r, 1)], self.sems.at[slot])

    def _dispatch(self, step, on_tile, on_gather):
        """Run on_tile(start) for a contiguous step, on_gather(g) for a gathered one."""
        n_struct = self.n_win + self.n_pool
        if self.has_win:
            _when(step < self.n_win, lambda: on_tile(self.win_start(step)))
        if self.has_pool:
            _when((step >= self.n_win) & (step < n_struct),
                  lambda: on_tile(self.pool_start(step - self.n_win)))
        if self.gather:
            _when(step >= n_struct, lambda: on_gather(step - n_struct))

    def issue(self, step):
        slot = bm.ring_slot(step, self.depth)

        def tile(start):
            self._tile_copy(slot, start).start()
            self.on_dma()

        def gather(g):
            self.on_gather(g, slot)

            def body(r, c):
                row = self.gather_row(g, r, slot)

                @pl.when(row >= 0)
                def _():
                    self._row_copy(slot, r, row).start()
                    self.on_dma()

                @pl.when(row < 0)
                def _():
                    self.ring[slot, pl.ds(r, 1)] = jnp.zeros((1,) + self.ring.shape[2:],
                                                             self.ring.dtype)
                return c
            lax.fori_loop(0, self.rows, body, 0)

        self._dispatch(step, tile, gather)

    def wait(self, step):
        slot = bm.ring_slot(step, self.depth)

        def tile(start):
            self._tile_copy(slot, start).wait()

        def gather(g):
            def body(r, c):
                row = self.gather_row(g, r, slot)
                _when(row >= 0, lambda: self._row_copy(slot, r, row).wait())
                return c
            lax.fori_loop(0, self.rows, body, 0)

        self._dispatch(step, tile, gather)


def _stream(ring, n_steps, consume, *, broken_wait_after_read=False):
    """Run the ring over steps 0..n_steps-1 (n_steps may be traced): the prologue issues the
    first depth-1 steps; step i issues i+depth-1 (into the slot freed by step i-1), waits on its
    own slot and calls consume(i, slot). `broken_wait_after_read` consumes before waiting: a
    deliberately racy variant that exists only so a test can prove the race detector fires."""
    la = bm.lookahead(ring.depth)

    def prologue(p, c):
        ring.issue(p)
        return c

    # one traced copy of issue() for the whole prologue (a loop, not depth-1 unrolled copies)
    lax.fori_loop(0, jnp.minimum(la, n_steps), prologue, 0)

    def body(i, c):
        _when(i + la < n_steps, lambda: ring.issue(i + la))
        slot = bm.ring_slot(i, ring.depth)
        if broken_wait_after_read:
            consume(i, slot)
            ring.wait(i)
        else:
            ring.wait(i)
            consume(i, slot)
        return c

    lax.fori_loop(0, n_steps, body, 0)


def _program_stream(plan, b, i, kv_b, ring_ref, sems, idx_blk, k_g, on_dma=None):
    """The ring of program (b, i) over its window / pool / gathered tiles, and the step counts.

    Window: the union of the windows of tokens t0..t0+bt-1 is the contiguous rows
    [max(t0 - window + 1, 0), t0 + bt); its tiles start at a0 = that start rounded down to
    plan.align (win_start), n_win tiles. Pool (cr128): the rows visible to the block's last
    token, pool rows 0 .. (t0 + bt) // ratio - 1, at kv operand rows pool_base + p. Gathered:
    the block's tokens in order, n_kg tiles each; idx_blk (SMEM) holds the block's gathered
    slots, k_g per token."""
    bt, bk = plan.bt, plan.bk
    n_win, n_pool = struct_tiles(plan, i, traced=True)
    a0 = win_start(i * bt, plan, jnp.maximum) if plan.n_w else None

    def aligned(x):
        return pl.multiple_of(x, plan.align) if plan.align > 1 else x

    def gather_row(g, r, slot):
        t, kt = bm.step_coords(g, plan.n_kg)
        return idx_blk[0, t * k_g + kt * bk + r]

    ring = _Ring(kv_b, ring_ref, sems, n_win=n_win, win_start=lambda c: aligned(a0 + c * bk),
                 n_pool=n_pool, pool_start=lambda c: aligned(plan.pool_base + c * bk),
                 gather=plan.n_kg > 0, gather_row=gather_row, on_dma=on_dma)
    n_steps = n_win + n_pool + bt * plan.n_kg
    return ring, n_win, n_pool, a0, n_steps


def _tile_mask(plan, t0, step, n_win, a0):
    """[bt*H, bk] mask of a contiguous tile: which (token, head) rows see which tile rows.

    Column c of the step's tile is kv row x = a0 + step*bk + c (window tile) or pool row
    x = (step - n_win)*bk + c (pool tile); a row of token t sees it iff lo <= x <= hi, with
    [lo, hi] = [t - window + 1, t] (window) or [0, min((t+1) // ratio, pool_rows) - 1] (pool).
    The tile kind is chosen on the int32 bounds, not between two boolean masks (Mosaic has no
    layout for a select of i1 vectors)."""
    bt, bk, h = plan.bt, plan.bk, plan.h
    tpos = t0 + lax.broadcasted_iota(jnp.int32, (bt * h, 1), 0) // h     # token of each row
    col = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    if plan.n_w:
        w_x, w_lo, w_hi = a0 + step * bk, tpos - plan.window + 1, tpos
    if plan.n_pm:
        p_x, p_lo = (step - n_win) * bk, jnp.zeros_like(tpos)
        p_hi = jnp.minimum((tpos + 1) // plan.ratio, plan.pool_rows) - 1
    if not plan.n_pm:
        x, lo, hi = w_x, w_lo, w_hi
    elif not plan.n_w:
        x, lo, hi = p_x, p_lo, p_hi
    else:
        is_win = step < n_win
        x = jnp.where(is_win, w_x, p_x)
        lo, hi = jnp.where(is_win, w_lo, p_lo), jnp.where(is_win, w_hi, p_hi)
    x = x + col
    return (x >= lo) & (x <= hi)
