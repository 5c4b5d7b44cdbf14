"""dkv reductions of the TPU backward: the CSR gather-reduce kernel over gathered slots and the
closed-form inverse maps of window / pool tiles. Fixed summation order everywhere."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm
from csa_jax.blockmath import inverse_map
from csa_jax.kernels.tpu.config import PLATFORMS, compiler_params
from csa_jax.kernels.tpu.plan import win_start
from csa_jax.kernels.tpu.ring import _Ring, _stream


def _index_window(rows):
    """Entries of perm / key fetched into SMEM per ring step: a window starting at a multiple
    of 128 (Mosaic slices a 1-D int32 HBM array only there) that holds the step's `rows`."""
    return bm.round_up(rows + 127, 128)


def _dkv_kernel(
        # prefetch
        offs_smem,   # [B * (R + 1)] int32: CSR row offsets
        # inputs
        perm_hbm,    # [B * Ep] int32 (HBM): slot of each sorted entry (Ep: see _csr_reduce)
        key_hbm,     # [B * Ep] int32 (HBM): kv row of each sorted entry
        interm_hbm,  # [B, E, D] f32 (HBM)
        # outputs
        dkv_ref,     # [block_r, D] f32
        # scratch
        ring_ref, sems, perm_win, key_win, win_sems,   # windows [depth+1, W] int32 (SMEM)
        *, entries_pad, num_rows):
    b, j = pl.program_id(0), pl.program_id(1)
    block_r = dkv_ref.shape[0]
    rows = ring_ref.shape[1]
    r0 = j * block_r
    start = offs_smem[b * (num_rows + 1) + r0]
    end = offs_smem[b * (num_rows + 1) + r0 + block_r]

    def window(g):
        """(first entry of step g's index window, offset of the step's first entry in it)."""
        e0 = start + g * rows
        w0 = e0 // 128 * 128
        return w0, e0 - w0

    n_steps = bm.num_tiles(end - start, rows)
    n_win = perm_win.shape[0]                        # depth + 1 index windows

    def index_copies(g):
        """Step g's perm / key entries -> SMEM window g % n_win (two DMAs)."""
        w0, _ = window(g)
        src = pl.ds(pl.multiple_of(b * entries_pad + w0, 128), perm_win.shape[1])
        return [pltpu.make_async_copy(h.at[src], w.at[g % n_win], win_sems.at[k])
                for k, (h, w) in enumerate(((perm_hbm, perm_win), (key_hbm, key_win)))]

    def fetch_index(g, slot):
        # Runs when step g is issued, before its row DMAs (which read perm from the window):
        # wait for step g's window (started when step g-1 was issued; step 0 starts its own),
        # then start step g+1's, so the index fetch overlaps a whole step. Window g+1 reuses
        # the window of step g+1-n_win = g-depth, already consumed: issue(g) runs in stream
        # iteration g-depth+1, after step g-depth's consume.
        del slot

        @pl.when(g == 0)
        def _():
            for c in index_copies(g):
                c.start()
        for c in index_copies(g):
            c.wait()

        @pl.when(g + 1 < n_steps)
        def _():
            for c in index_copies(g + 1):
                c.start()

    def gather_row(g, r, slot):
        _, off = window(g)
        return jnp.where(start + g * rows + r < end, perm_win[g % n_win, off + r], -1)

    dkv_ref[...] = jnp.zeros(dkv_ref.shape, jnp.float32)

    def consume(step, slot):
        # Entries are added one by one in sorted (row, slot) order: a fixed summation order,
        # hence bit-identical dkv across runs and program orders.
        _, off = window(step)

        def body(r, c):
            @pl.when(start + step * rows + r < end)
            def _():
                row = key_win[step % n_win, off + r] - r0
                dkv_ref[pl.ds(row, 1), :] += ring_ref[slot, pl.ds(r, 1), :]
            return c

        lax.fori_loop(0, rows, body, 0)

    ring = _Ring(interm_hbm.at[b], ring_ref, sems, gather=True, gather_row=gather_row,
                 on_gather=fetch_index)
    _stream(ring, n_steps, consume)


def _csr_reduce(values, perm, key, offs, *, interpret, config):
    """out[b, r] = sum of values[b, perm[b, e]] over e in [offs[b, r], offs[b, r+1]) (whose
    key[b, e] == r), in e order. values [B, E, D] f32; offs [B, R+1] with R a multiple of
    block_r. Returns [B, R, D] f32.

    Only offs is scalar-prefetched into SMEM (4 (R+1) bytes per sequence); perm and key stay in
    HBM and each ring step fetches its window of them (2 * _index_window(block_k) int32) into
    SMEM, so E is not bounded by SMEM (1 MiB on v5e / v6e, which a whole perm overruns)."""
    bsz, e, d = values.shape
    br, bk = config.block_r, config.block_k
    r = offs.shape[1] - 1
    win = _index_window(bk)
    e_pad = bm.round_up(e, 128) + win          # every window lies inside its sequence's part
    perm, key = (jnp.pad(x, ((0, 0), (0, e_pad - e))).reshape(-1) for x in (perm, key))
    kernel = functools.partial(_dkv_kernel, entries_pad=e_pad, num_rows=r)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(bsz, r // br),
        in_specs=[hbm, hbm, hbm],
        out_specs=pl.BlockSpec((None, br, d), lambda b, j, *_: (b, j, 0)),
        scratch_shapes=[pltpu.VMEM((config.depth, bk, d), jnp.float32),
                        pltpu.SemaphoreType.DMA((config.depth,)),
                        pltpu.SMEM((config.depth + 1, win), jnp.int32),
                        pltpu.SMEM((config.depth + 1, win), jnp.int32),
                        pltpu.SemaphoreType.DMA((2,))],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((bsz, r, d), jnp.float32),
        compiler_params=compiler_params(config, interpret),
        interpret=bm.resolve_interpret(interpret, PLATFORMS),
        name="csa_dkv_reduce_tpu",
    )(offs.reshape(-1), perm, key, values)


def csr_sizes(entries, num_kv, config):
    """(segments S, rows R) of the two CSR passes over `entries` gathered slots: pass 1 reduces
    entries to S segment partials, pass 2 the segments to R >= num_kv rows (see _dkv_csr)."""
    r_pad = bm.round_up(num_kv, config.block_r)
    return split_sizes(r_pad, entries, config.fanin_split, config.block_r), r_pad


def split_sizes(num_rows, entries, seg_len, block_r):
    """S: the static bound on the segments of split_map (a multiple of block_r)."""
    return bm.round_up(num_rows + bm.num_tiles(entries, seg_len), block_r)


def split_map(key, offs, num_kv, seg_len, block_r):
    """Split every row's entry list into segments of at most seg_len entries (fan-in skew).

    key [B, E] / offs [B, R+1]: a CSR from inverse_map. Returns (seg [B, E]: the segment of each
    sorted entry, numbered in entry order, s_pad for empty slots; seg_offs [B, S+1]: the CSR of
    entries by segment; row_of_seg [B, S]: the row of each segment, num_kv past the last;
    row_offs [B, R+1]: the CSR of segments by row), with S = s_pad a static bound (multiple of
    block_r). Segment s of row r covers entries offs[r] + s' * seg_len ... of that row."""
    bsz, e = key.shape
    r = offs.shape[1] - 1
    s_pad = split_sizes(r, e, seg_len, block_r)
    counts = offs[:, 1:] - offs[:, :-1]                                   # [B, R]
    nseg = (counts + seg_len - 1) // seg_len
    row_offs = jnp.concatenate([jnp.zeros((bsz, 1), jnp.int32),
                                jnp.cumsum(nseg, axis=1).astype(jnp.int32)], axis=1)
    valid = key < num_kv
    row = jnp.minimum(key, r - 1)
    pos = jnp.arange(e, dtype=jnp.int32)[None] - jnp.take_along_axis(offs, row, axis=1)
    seg = jnp.where(valid, jnp.take_along_axis(row_offs, row, axis=1) + pos // seg_len, s_pad)
    total = row_offs[:, -1:]                                              # [B, 1]
    s_ids = jnp.minimum(jnp.arange(s_pad + 1, dtype=jnp.int32)[None], total)
    seg_offs = jax.vmap(lambda k, q: jnp.searchsorted(k, q, side="left"))(seg, s_ids)
    s_all = jnp.arange(s_pad, dtype=jnp.int32)
    row_of_seg = jax.vmap(lambda o: jnp.searchsorted(o[1:], s_all, side="right"))(row_offs)
    row_of_seg = jnp.where(s_all[None] < total, row_of_seg, num_kv)
    return (seg.astype(jnp.int32), seg_offs.astype(jnp.int32), row_of_seg.astype(jnp.int32),
            row_offs)


def _dkv_csr(interm, idx_g, num_kv, *, interpret, config):
    """dkv [B, N, D] f32 of the gathered slots: per kv row, the sum of its slots' interm rows.

    Two fixed-order passes of the CSR gather-reduce kernel: (1) segments of at most
    config.fanin_split entries (a program owns block_r segments, so a hot row such as cr128
    pool row 0 is spread over many programs), (2) per row, the sum of its segments."""
    bsz, e, d = interm.shape
    r_pad = bm.round_up(num_kv, config.block_r)
    perm, key, offs = inverse_map(idx_g.reshape(bsz, e), num_kv, r_pad)
    seg, seg_offs, row_of_seg, row_offs = split_map(key, offs, num_kv, config.fanin_split,
                                                    config.block_r)
    part = _csr_reduce(interm, perm, seg, seg_offs, interpret=interpret, config=config)
    s_pad = part.shape[1]
    ident = jnp.broadcast_to(jnp.arange(s_pad, dtype=jnp.int32), (bsz, s_pad))
    dkv = _csr_reduce(part, ident, row_of_seg, row_offs, interpret=interpret, config=config)
    return dkv[:, :num_kv]


def _dkv_struct(interm_s, plan, blocks=None):
    """dkv rows [0, T) (window) and [T, N) (cr128 pool) from the per-block contributions
    interm_s [B, count, n_struct*bk, D] of token blocks `blocks` = (first, count) (default:
    all), by closed-form inverse maps, in a fixed order. Returns [B, N, D] f32 (zero outside
    the rows those blocks touch).

    Window: block i's tiles start at a0_i = win_start(i*bt) (its union's first row rounded
    down to plan.align; rows before the union got exactly 0), so row r is in the unions of
    blocks r // bt .. (r + window - 1) // bt, at offset r - a0_i; at most
    (window - 1) // bt + 2 blocks, summed in block order (those of `blocks` only: the rows
    [a0_first, end of the last block)). Pool row p: every block's pool tile row p, summed over
    blocks (each block is one partial: a hot row such as pool row 0 is split across all
    programs)."""
    bsz, nblk, _, d = interm_s.shape
    b0, _ = blocks or (0, nblk)
    bt, bk = plan.bt, plan.bk
    out = []
    if plan.n_w:
        span = plan.n_w * bk
        flat = interm_s[:, :, :span].reshape(bsz, nblk * span, d)
        lo, hi = win_start(b0 * bt, plan), min((b0 + nblk) * bt, plan.t)
        r = jnp.arange(lo, hi, dtype=jnp.int32)
        acc = jnp.zeros((bsz, hi - lo, d), jnp.float32)
        for c in range((plan.window - 1) // bt + 2):
            blk = r // bt + c
            off = r - win_start(blk * bt, plan, jnp.maximum)
            ok = (blk >= b0) & (blk < b0 + nblk) & (off >= 0) & (off < span)
            g = jnp.where(ok, (blk - b0) * span + off, 0)
            acc = acc + jnp.where(ok[None, :, None], flat[:, g], 0.0)
        out.append(jnp.pad(acc, ((0, 0), (lo, plan.t - hi), (0, 0))))
    else:
        out.append(jnp.zeros((bsz, plan.t, d), jnp.float32))
    if plan.n_pm:
        pool = interm_s[:, :, plan.n_w * bk:]                     # [B, count, n_pm*bk, D]
        # block i streamed (and wrote) the pool rows p < (i*bt + bt) // ratio only
        p = jnp.arange(plan.n_pm * bk, dtype=jnp.int32)[None, :, None]

        def add_block(j, acc):                                    # fixed order: block order
            blk = b0 + j
            seen = p < jnp.minimum((blk * bt + bt) // plan.ratio, plan.pool_rows)
            part = lax.dynamic_index_in_dim(pool, j, axis=1, keepdims=False)
            return acc + jnp.where(seen, part, 0.0)

        acc = lax.fori_loop(0, nblk, add_block,
                            jnp.zeros(pool.shape[:1] + pool.shape[2:], jnp.float32))
        out.append(acc[:, :plan.pool_rows])
    dkv = jnp.concatenate(out, axis=1)
    return jnp.pad(dkv, ((0, 0), (0, plan.n - dkv.shape[1]), (0, 0)))
