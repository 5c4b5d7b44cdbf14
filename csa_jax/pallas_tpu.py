"""CSA forward and backward as Pallas TPU-dialect kernels with explicit DMAs (impl="pallas_tpu").

The paper's Tensor-Data-Mover model ("issue N+1 tensor loads, compute on the oldest, wait on a
counter") written with `pltpu.make_async_copy` and one DMA semaphore per ring slot. kv stays in
HBM (`memory_space=pl.ANY`); index lists arrive in SMEM and drive the copies: each program gets
its own block's gathered slots as an SMEM block (pipelined by Pallas like scalar prefetch, but
a few KiB per program instead of all of idx), and the CSR reduce gets its maps by scalar
prefetch.
The softmax block math and the ring arithmetic come from csa_jax/blockmath.py (shared with the
GPU dialects); only the data movement below is TPU-specific. docs/pallas_tpu.md has the numbers.

A program owns block_t consecutive tokens and all H heads of each (rows of q, o and the
online-softmax state are (token, head) pairs, [block_t*H, ...]), so one fetched kv row serves
every head and both products (QK^T and PV; K == V). It streams a sequence of tiles of block_k kv
rows through a ring of `depth` VMEM slots [depth, block_k, D], one DMA semaphore per slot:

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
  [max(t0 - window + 1, 0), t0 + block_t); fetched once as contiguous tiles, ONE DMA per tile;
  every (token, head) row masks the tile by its own band [t - window + 1, t].
- pool tiles ("cr128"): the pool rows visible to the block's last token, contiguous, one DMA
  per tile, masked per token by p < (t + 1) // pool_ratio.
- gathered tiles ("generic": all K slots; "cr4": the top-k pool slots): per token, block_k
  slots, ONE DMA PER NON-EMPTY SLOT (kv row idx[t, j]); an empty slot (-1) is never fetched:
  its ring row is zero-filled by a vector store and its probability masked to exactly 0.
"generic" works for every idx and is the default; the structured layouts are a promise by the
caller (the model layer knows its layer type), checked by check_layout whenever idx is concrete.

Backward (csa_spec.md section 3; deterministic, no atomics, no scatter):
1. `_bwd_kernel`, the same stream: re-fetch the tiles, recompute p = exp(s - lse) (delta = o.dO
   fused in), ds = p * (dp - delta + dlse), dq += scale * ds @ tile, and the tile's dkv rows
   scale * ds^T q + p^T dO, written once per (program, tile) or per slot (one writer each)
   to HBM through a 2-slot write-back ring (stage in VMEM, async copy out, wait two steps
   later), so no intermediate block has to fit in VMEM.
   The transposed products are transposed-operand dots (dot_general contracting dim 0 of both);
   Config.explicit_transpose forces `x.T @ y` so the two can be compared on hardware.
2. dkv of gathered slots: per-slot intermediate [T, K, D] f32 (in `slot_chunk` launches), a CSR
   inverse map (stable sort by kv row + searchsorted, XLA), then `_dkv_kernel` twice: over
   segments of at most `fanin_split` entries of one row (a program owns block_r segments and
   streams their entries through a ring, one DMA per intermediate row, adding them in sorted
   order; a hot row is spread over many programs), then over rows (each row's segments in
   order). Fixed summation order: bit-identical across runs and program orders.
3. dkv of window / pool tiles: closed-form inverse maps (`_dkv_struct`): window row r gathers
   the unions of blocks r // block_t .. (r + window - 1) // block_t at fixed offsets; pool row p
   sums one partial per block (the fan-in of cr128 pool row 0 is split across all programs).
4. dsink = sum_t exp(sink - lse) * (dlse - delta) from the kernel's delta (XLA).
Launches and partials are added in a fixed order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_jax import blockmath as bm

LAYOUTS = ("generic", "cr0", "cr4", "cr128")


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs of the TPU kernels (hashable, validated in __post_init__).

    block_t      tokens per program (a program owns all H heads of its tokens).
    block_k      rows per ring slot: one gathered tile (block_k slots of one token) or one
                 contiguous tile (block_k consecutive kv rows: window union or cr128 pool).
    depth        ring slots, 2..4: depth - 1 tiles are in flight while one is computed.
    block_r      kv rows (or row segments) per program of the CSR gather-reduce forming dkv.
    fanin_split  slots per segment of that reduce: a row used by more slots is summed in
                 segments by several programs, then the segments are added (fixed order).
    slot_chunk   gathered slots per backward launch (None = all): bounds the per-slot f32
                 intermediate [T, slot_chunk, D]; a multiple of block_k.
    explicit_transpose  write ds^T q and p^T dO as x.T @ y instead of transposed-operand dots
                 (exists only to measure the difference on hardware).
    layout       what the caller promises about idx (csa_spec.md section 4):
                 "generic" (default): nothing; every slot is gathered by its own DMA.
                 "cr0":   slots [0, window) hold token t's window rows max(0, t-window+1)..t
                          (each once, any order, -1 for the rest) and every later slot is -1.
                 "cr4":   the same window; slots [window, K) are arbitrary (gathered per row).
                 "cr128": the same window; slots [window, K) hold pool rows T + p for every
                          p < (t + 1) // pool_ratio (any order), -1 elsewhere; N - T pool rows.
                 Structured layouts fetch the window union of a token block (and the cr128 pool)
                 as contiguous tiles, one DMA per tile, and ignore idx there; check_layout
                 verifies the promise (forward calls it whenever idx is concrete).
    window, pool_ratio  the layout's window size and (cr128) pool ratio.
    """
    block_t: int = 8
    block_k: int = 128
    depth: int = 2
    block_r: int = 64
    slot_chunk: int | None = None
    explicit_transpose: bool = False
    layout: str = "generic"
    window: int = 128
    pool_ratio: int = 128
    fanin_split: int = 512

    def __post_init__(self):
        for name in ("block_t", "block_k", "block_r", "window", "pool_ratio", "fanin_split"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config.{name}={v!r} must be a positive int")
        if self.block_k % 8:
            raise ValueError(f"Config.block_k={self.block_k} must be a multiple of 8")
        if self.block_r % 8:
            raise ValueError(f"Config.block_r={self.block_r} must be a multiple of 8")
        if self.depth not in (2, 3, 4):
            raise ValueError(f"Config.depth={self.depth!r} must be 2, 3 or 4")
        if self.slot_chunk is not None and (
                isinstance(self.slot_chunk, bool) or not isinstance(self.slot_chunk, int)
                or self.slot_chunk < 1 or self.slot_chunk % self.block_k):
            raise ValueError(f"Config.slot_chunk={self.slot_chunk!r} must be None or a positive "
                             f"multiple of block_k={self.block_k}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Config.layout={self.layout!r} must be one of {LAYOUTS}")
        if self.pool_ratio < 2:
            raise ValueError(f"Config.pool_ratio={self.pool_ratio} must be >= 2")


def _round_up(x, m):
    return -(-x // m) * m


def default_config(q_shape, kv_shape, idx_shape, dtype, *, layout="generic", window=128,
                   pool_ratio=128) -> Config:
    """The default Config for these shapes (what the public op uses when given none).

    Rule. block_k = 128 (one lane-width tile) when K >= 128, else K rounded up to 8.
    block_t: generic layout 8 tokens (a sublane tile of o; T itself when T < 8); structured
    layouts (window reuse) as many tokens as keep the block's (token, head) rows near 256
    (256 // H rounded down to 8, at least 8; T itself when T is smaller), because a larger block
    shares one window union among more tokens (DMAs per token ~ (block_t + window) / block_t /
    block_k). depth 3 when a program streams at least 4 tiles (two loads in flight), else 2.
    block_r = 64, fanin_split = 512. slot_chunk = None (whole K) unless the f32 per-slot
    intermediate T*K*D*4 of one sequence would exceed 1 GiB, then the largest multiple of
    block_k that fits.
    layout / window / pool_ratio are passed through (the caller's promise about idx)."""
    del dtype, kv_shape
    _, t, h, d = q_shape
    k = idx_shape[-1]
    block_k = 128 if k >= 128 else _round_up(max(k, 1), 8)
    if layout == "generic":
        block_t = min(8, t)
        n_steps = block_t * bm.num_tiles(k, block_k)
    else:
        cap = max(8, (256 // h) // 8 * 8)
        block_t = t if t <= cap else cap
        n_steps = bm.num_tiles(block_t + window - 1, block_k) + bm.num_tiles(k - window, block_k)
    depth = 3 if n_steps >= 4 else 2
    slot_chunk = None
    if t * k * d * 4 > (1 << 30):
        slot_chunk = max(block_k, ((1 << 30) // (t * d * 4)) // block_k * block_k)
    return Config(block_t=block_t, block_k=block_k, depth=depth, slot_chunk=slot_chunk,
                  layout=layout, window=window, pool_ratio=pool_ratio)


def _resolve_interpret(interpret):
    if interpret is None:
        return jax.default_backend() != "tpu"
    return interpret


def _precision(dtype):
    # f32 inputs: full-precision MXU passes (the default may use bf16 passes on TPU).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot_nt(a, b, precision):
    """a [M, X] . b [N, X] -> [M, N] f32 (contract the last dims; b is never transposed)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b, precision, explicit_transpose):
    """a [X, M] . b [X, N] -> a^T b [M, N] f32, as a transposed-operand dot (contract dim 0)."""
    if explicit_transpose:
        return _dot_nn(a.T, b, precision)
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- geometry

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static geometry of one launch (Python ints only)."""
    t: int          # tokens T
    t_pad: int      # T padded to block_t
    h: int
    d: int
    n: int          # kv rows N
    n_pad: int      # kv rows after tail padding (contiguous tiles never read past the end)
    bt: int         # block_t
    bk: int         # block_k
    depth: int
    n_w: int        # window tiles per program (0: no window reuse)
    n_pm: int       # pool tiles per program, at most (cr128 only)
    n_kg: int       # gathered tiles per token
    g_off: int      # first gathered slot of idx
    window: int
    ratio: int      # cr128 pool ratio
    pool_rows: int  # N - T (cr128)

    @property
    def nb(self):
        return self.t_pad // self.bt

    @property
    def n_struct(self):
        return self.n_w + self.n_pm


def _make_plan(q_shape, n, k, config):
    _, t, h, d = q_shape
    bt, bk = config.block_t, config.block_k
    t_pad = _round_up(t, bt)
    layout, w = config.layout, config.window
    if layout != "generic" and k < w:
        raise ValueError(f"layout={layout!r} needs K >= window, got K={k}, window={w}")
    if layout == "cr128" and n - t < t // config.pool_ratio:
        raise ValueError(f"layout='cr128' needs N - T >= T // pool_ratio pool rows, got N={n}, "
                         f"T={t}, pool_ratio={config.pool_ratio}")
    n_w = 0 if layout == "generic" else bm.num_tiles(bt + w - 1, bk)
    n_pm = bm.num_tiles(n - t, bk) if layout == "cr128" else 0
    g_off = w if layout == "cr4" else 0
    gathered = {"generic": k, "cr4": k - w}.get(layout, 0)      # slots gathered per token
    n_kg = bm.num_tiles(gathered, bk)
    n_pad = n
    if n_w:
        n_pad = max(n_pad, t_pad + n_w * bk)
    if n_pm:
        n_pad = max(n_pad, t + n_pm * bk)
    return _Plan(t=t, t_pad=t_pad, h=h, d=d, n=n, n_pad=n_pad, bt=bt, bk=bk,
                 depth=config.depth, n_w=n_w, n_pm=n_pm, n_kg=n_kg, g_off=g_off, window=w,
                 ratio=config.pool_ratio, pool_rows=n - t)


def _sorted_rows(x):
    """Each row's non-empty ids in ascending order, empties (-1) moved to the end as -1."""
    big = np.iinfo(np.int32).max
    x = np.sort(np.where(x >= 0, x, big), axis=-1)
    return np.where(x == big, -1, x)


def check_layout(idx, num_kv, config):
    """Eager check that a concrete idx [B, T, K] keeps the promise of config.layout (see Config);
    raises ValueError naming the first token whose slots break it. No-op for "generic"."""
    if config.layout == "generic":
        return
    idx = np.asarray(idx)
    _, t, k = idx.shape
    w = config.window
    if k < w:
        raise ValueError(f"layout={config.layout!r} needs K >= window, got K={k}, window={w}")
    tok = np.arange(t)[:, None]
    j = np.arange(w)[None, :]
    start = np.maximum(tok - w + 1, 0)
    want_win = np.where(j <= tok - start, start + j, -1)                  # [T, window]
    checks = [("window", idx[:, :, :w], want_win, slice(None, w))]
    if config.layout == "cr0":
        checks.append(("-1 (nothing after the window)", idx[:, :, w:],
                       np.full((t, k - w), -1), slice(w, None)))
    if config.layout == "cr128":
        j = np.arange(k - w)[None, :]
        visible = (tok + 1) // config.pool_ratio
        if num_kv < t + visible.max(initial=0):
            raise ValueError(f"layout='cr128': {num_kv=} kv rows cannot hold the "
                             f"{visible.max()} pool rows visible at T={t}")
        checks.append(("the visible pool", idx[:, :, w:], np.where(j < visible, t + j, -1),
                       slice(w, None)))
    for what, got, want, sl in checks:
        got = _sorted_rows(got)
        bad = np.argwhere(np.any(got != want[None], axis=-1))
        if bad.size:
            b, tk = (int(v) for v in bad[0])
            raise ValueError(
                f"layout={config.layout!r}: idx[{b}, {tk}, {sl.start or 0}:{sl.stop or k}] holds "
                f"rows {sorted(int(v) for v in got[b, tk] if v >= 0)}, expected {what} "
                f"{sorted(int(v) for v in want[tk] if v >= 0)}")


def _when(cond, fn):
    """pl.when that also takes a static Python bool (skips dead branches at trace time)."""
    if isinstance(cond, (bool, np.bool_)):
        if cond:
            fn()
        return
    pl.when(cond)(fn)


# ----------------------------------------------------------------------------- the ring

class _Ring:
    """A ring of `depth` VMEM slots of [rows, D], one DMA semaphore per slot, over a stream of
    tiles of three kinds, in this order:

        [0, n_win)                      contiguous window tiles: one DMA of `rows` kv rows
        [n_win, n_win + n_pool)         contiguous pool tiles: one DMA each
        [n_win + n_pool, ...)           gathered tiles: one DMA per non-empty row

    win_start(c) / pool_start(c) give a contiguous tile's first source row; gather_row(g, r)
    the source row of row r of gathered tile g (< 0: empty; never fetched, its ring row is
    zero-filled by a vector store so stale data cannot leak into p @ v). Every DMA into a slot
    signals that slot's semaphore; wait() waits once per DMA issue() started, with a copy
    descriptor of the same shape, so every start has its wait. `on_dma` (optional) is called
    once per DMA started (used to count them)."""

    def __init__(self, src, ring, sems, *, n_win=0, win_start=None, n_pool=0, pool_start=None,
                 gather=False, gather_row=None, on_dma=None):
        self.src, self.ring, self.sems = src, ring, sems
        self.depth, self.rows = ring.shape[0], ring.shape[1]
        self.n_win, self.win_start = n_win, win_start
        self.n_pool, self.pool_start = n_pool, pool_start
        self.gather, self.gather_row = gather, gather_row
        self.on_dma = on_dma or (lambda: None)
        self.has_win = not (isinstance(n_win, int) and n_win == 0)
        self.has_pool = not (isinstance(n_pool, int) and n_pool == 0)

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
            def body(r, c):
                row = self.gather_row(g, r)

                @pl.when(row >= 0)
                def _():
                    self._row_copy(slot, r, row).start()
                    self.on_dma()

                @pl.when(row < 0)
                def _():
                    self.ring[slot, pl.ds(r, 1), :] = jnp.zeros((1, self.ring.shape[2]),
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
                row = self.gather_row(g, r)
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
    [u0, t0 + bt) with u0 = max(t0 - window + 1, 0): n_win tiles starting at u0. Pool (cr128):
    the rows visible to the block's last token, T .. T + (t0 + bt) // ratio - 1. Gathered: the
    block's tokens in order, n_kg tiles each; idx_blk (SMEM) holds the block's gathered
    slots, k_g per token."""
    bt, bk = plan.bt, plan.bk
    t0 = i * bt
    n_win = n_pool = 0
    u0 = None
    if plan.n_w:
        u0 = jnp.maximum(t0 - plan.window + 1, 0)
        n_win = bm.num_tiles(t0 + bt - u0, bk)
    if plan.n_pm:
        n_pool = bm.num_tiles(jnp.minimum((t0 + bt) // plan.ratio, plan.pool_rows), bk)
    def gather_row(g, r):
        t, kt = bm.step_coords(g, plan.n_kg)
        return idx_blk[0, t * k_g + kt * bk + r]

    ring = _Ring(kv_b, ring_ref, sems, n_win=n_win, win_start=lambda c: u0 + c * bk,
                 n_pool=n_pool, pool_start=lambda c: plan.t + c * bk, gather=plan.n_kg > 0,
                 gather_row=gather_row, on_dma=on_dma)
    n_steps = n_win + n_pool + bt * plan.n_kg
    return ring, n_win, n_pool, u0, n_steps


def _tile_mask(plan, t0, step, n_win, u0):
    """[bt*H, bk] mask of a contiguous tile: which (token, head) rows see which tile rows."""
    bt, bk, h = plan.bt, plan.bk, plan.h
    tpos = t0 + lax.broadcasted_iota(jnp.int32, (bt * h, 1), 0) // h     # token of each row
    col = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    if plan.n_w:
        rows = u0 + step * bk + col                                     # kv row of each column
        in_win = (rows >= tpos - plan.window + 1) & (rows <= tpos)
    else:
        in_win = None
    if plan.n_pm:
        prow = (step - n_win) * bk + col                                # pool row of each column
        in_pool = (prow < (tpos + 1) // plan.ratio) & (prow < plan.pool_rows)
    else:
        in_pool = None
    if in_win is None:
        return in_pool
    if in_pool is None:
        return in_win
    return jnp.where(step < n_win, in_win, in_pool)


# ----------------------------------------------------------------------------- forward kernel

def _fwd_kernel(
        # inputs
        idx_blk,     # [1, bt * Kg] int32 (SMEM): the block's gathered slots, token-major
        q_ref,       # [bt*H, D]
        valid_ref,   # [bt * n_kg, 1, bk] int32: 1 = non-empty gathered slot
        sink_ref,    # [bt*H, 1] f32
        kv_hbm,      # [B, Np, D] (HBM, pl.ANY)
        # outputs
        o_ref,       # [bt*H, D]
        lse_ref,     # [bt*H, 1] f32
        *rest,       # (dma count [1] int32 SMEM, if counted) + scratch:
                     # ring [depth, bk, D], DMA sems [depth], m, l [bt*H, 1] f32, acc [bt*H, D]
        plan, scale, k_g, broken, count):
    if count:
        cnt_ref, ring_ref, sems, m_ref, l_ref, acc_ref = rest
        cnt_ref[0] = 0

        def on_dma():
            cnt_ref[0] += 1
    else:
        ring_ref, sems, m_ref, l_ref, acc_ref = rest
        on_dma = None
    b, i = pl.program_id(0), pl.program_id(1)
    h, n_kg = plan.h, plan.n_kg
    prec = _precision(q_ref.dtype)
    ring, n_win, n_pool, u0, n_steps = _program_stream(plan, b, i, kv_hbm.at[b], ring_ref,
                                                       sems, idx_blk, k_g, on_dma)
    n_struct = n_win + n_pool

    m0, l0, a0 = bm.init_state((plan.bt * h,), plan.d)
    m_ref[...], l_ref[...], acc_ref[...] = m0, l0, a0

    def update(rows, q, v, valid):
        """Online-softmax step for state rows `rows` (a slice) with queries q, tile v."""
        s = scale * _dot_nt(q, v, prec)
        m, l, p, alpha = bm.softmax_update(m_ref[rows], l_ref[rows], s, valid)
        acc_ref[rows] = alpha * acc_ref[rows] + _dot_nn(p.astype(v.dtype), v, prec)
        m_ref[rows], l_ref[rows] = m, l

    def consume(step, slot):
        v = ring_ref[slot]                                          # [bk, D]

        def tile():                                                 # all tokens of the block
            update(slice(None), q_ref[...], v, _tile_mask(plan, i * plan.bt, step, n_win, u0))

        def gathered():                                             # one token's own slots
            g = step - n_struct
            t, _ = bm.step_coords(g, n_kg)
            rows = pl.ds(t * h, h)
            update(rows, q_ref[rows], v, valid_ref[g] > 0)

        if plan.n_struct:
            _when(step < n_struct, tile)
        if n_kg:
            _when(step >= n_struct, gathered)

    _stream(ring, n_steps, consume, broken_wait_after_read=broken)
    o, lse = bm.finalize(m_ref[...], l_ref[...], acc_ref[...], sink_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def _gathered_idx(idx, plan, k_g):
    """The gathered part of idx, [B, Tp, k_g] with -1 padding (k_g a multiple of block_k)."""
    g = idx[:, :, plan.g_off:plan.g_off + k_g]
    return jnp.pad(g, ((0, 0), (0, plan.t_pad - plan.t), (0, k_g - g.shape[-1])),
                   constant_values=-1)


def _valid_tiles(idx_g, block_k):
    """[B, Tp, Kg] -> [B, Tp * n_kg, 1, block_k] int32 mask, one row per gathered step."""
    b, t, k = idx_g.shape
    return (idx_g >= 0).astype(jnp.int32).reshape(b, t * (k // block_k), 1, block_k)


def _flat_tokens(x, plan):
    """[B, T, H, ...] -> [B, Tp*H, ...] (pad T; rows of one token are H consecutive rows)."""
    pad = [(0, 0), (0, plan.t_pad - plan.t)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad)
    return x.reshape((x.shape[0], plan.t_pad * plan.h) + x.shape[3:])


def _pad_kv(kv, plan):
    if plan.n_pad == plan.n:
        return kv
    return jnp.pad(kv, ((0, 0), (0, plan.n_pad - plan.n), (0, 0)))


def _gather_inputs(idx, plan):
    """The gathered part of idx as kernel inputs: (idx blocks [B, nb, 1, bt*k_g], their SMEM
    BlockSpec, valid tiles [B, Tp*n_kg, 1, bk] with their BlockSpec, k_g slots per token);
    small dummies when nothing is gathered (cr0 / cr128), so the kernel signature is fixed.
    Each program gets only its own block's index list in SMEM (a few KiB), not all of idx."""
    bsz, bt, bk = idx.shape[0], plan.bt, plan.bk
    if plan.n_kg == 0:
        idx_b, valid, k_g, v_rows = (jnp.zeros((bsz, plan.nb, 1, 1), jnp.int32),
                                     jnp.zeros((bsz, plan.nb, 1, bk), jnp.int32), 0, 1)
    else:
        k_g = plan.n_kg * bk
        idx_g = _gathered_idx(idx, plan, k_g)
        idx_b, valid, v_rows = (idx_g.reshape(bsz, plan.nb, 1, bt * k_g),
                                _valid_tiles(idx_g, bk), bt * plan.n_kg)
    # [.., 1, L] so the block's last two dims are the array's (a TPU block-shape rule)
    idx_spec = pl.BlockSpec((None, None, 1, idx_b.shape[-1]), lambda b, i: (b, i, 0, 0),
                            memory_space=pltpu.SMEM)
    valid_spec = pl.BlockSpec((None, v_rows, 1, bk), lambda b, i: (b, i, 0, 0))
    return (idx_b, idx_spec), (valid, valid_spec), k_g


def _maybe_check_layout(idx, n, config):
    """check_layout when idx is concrete; under jit (a tracer) the promise is trusted."""
    if config.layout == "generic":
        return
    try:
        idx = np.asarray(idx)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    check_layout(idx, n, config)


def _forward_impl(q, kv, idx, sink, *, scale, interpret, config, broken=False,
                  count_dmas=False):
    """forward(); `broken` (racy wait-after-read) and `count_dmas` (also return the DMAs each
    program issued, [B, T/bt] int32) exist for the tests and the docs' measurements."""
    _maybe_check_layout(idx, kv.shape[1], config)
    return _forward_jit(q, kv, idx, sink, scale=scale, interpret=interpret, config=config,
                        broken=broken, count_dmas=count_dmas)


# jit with the static knobs: one compiled program per (shapes, config), reused across calls
# (interpret mode otherwise rebuilds the kernel on every eager call).
@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "broken",
                                             "count_dmas"))
def _forward_jit(q, kv, idx, sink, *, scale, interpret, config, broken, count_dmas):
    bsz, _, h, d = q.shape
    plan = _make_plan(q.shape, kv.shape[1], idx.shape[-1], config)
    bt, bk = plan.bt, plan.bk
    (idx_b, idx_spec), (valid, valid_spec), k_g = _gather_inputs(idx, plan)
    kernel = functools.partial(_fwd_kernel, plan=plan, scale=scale, k_g=k_g, broken=broken,
                               count=count_dmas)
    tok = pl.BlockSpec((None, bt * h, d), lambda b, i, *_: (b, i, 0))
    col = pl.BlockSpec((None, bt * h, 1), lambda b, i, *_: (b, i, 0))
    out_specs = [tok, col]
    out_shape = [jax.ShapeDtypeStruct((bsz, plan.t_pad * h, d), q.dtype),
                 jax.ShapeDtypeStruct((bsz, plan.t_pad * h, 1), jnp.float32)]
    if count_dmas:
        out_specs.append(pl.BlockSpec((None, None, 1), lambda b, i, *_: (b, i, 0),
                                      memory_space=pltpu.SMEM))
        out_shape.append(jax.ShapeDtypeStruct((bsz, plan.nb, 1), jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(bsz, plan.nb),
        in_specs=[idx_spec, tok, valid_spec,
                  pl.BlockSpec((bt * h, 1), lambda b, i, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((plan.depth, bk, d), kv.dtype),
                        pltpu.SemaphoreType.DMA((plan.depth,)),
                        pltpu.VMEM((bt * h, 1), jnp.float32),
                        pltpu.VMEM((bt * h, 1), jnp.float32),
                        pltpu.VMEM((bt * h, d), jnp.float32)],
    )
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_resolve_interpret(interpret),
        name="csa_fwd_tpu",
    )(idx_b, _flat_tokens(q, plan), valid,
      jnp.tile(sink.astype(jnp.float32), bt).reshape(bt * h, 1), _pad_kv(kv, plan))
    o = outs[0].reshape(bsz, plan.t_pad, h, d)[:, :plan.t]
    lse = outs[1].reshape(bsz, plan.t_pad, h)[:, :plan.t]
    if count_dmas:
        return o, lse, outs[2][..., 0]
    return o, lse


def forward(q, kv, idx, sink, *, scale, interpret, config):
    """o [B,T,H,D] q.dtype, lse [B,T,H] f32 (impl-module interface, see csa_jax/vjp.py)."""
    return _forward_impl(q, kv, idx, sink, scale=scale, interpret=interpret, config=config)


# ----------------------------------------------------------------------------- backward kernel

def _bwd_kernel(
        # inputs
        idx_blk,     # [1, bt * Kg] int32 (SMEM): the block's gathered slots of this launch
        q_ref,       # [bt*H, D]
        do_ref,      # [bt*H, D]
        o_ref,       # [bt*H, D]
        lse_ref,     # [bt*H, 1] f32
        dlse_ref,    # [bt*H, 1] f32
        valid_ref,   # [bt * n_kg, 1, bk] int32
        kv_hbm,      # [B, Np, D] (HBM)
        # outputs
        dq_ref,      # [bt*H, D] f32: this launch's part of dq
        delta_ref,   # [bt*H, 1] f32: o . dO (fused here, reused for dsink)
        *rest,       # interm_s [B, nb * n_struct, bk, D] f32 HBM (structured layouts): the
                     #   block's contribution to each row of its window union / pool tiles;
                     # interm_g [B, Tp * n_kg, bk, D] f32 HBM (if gathering): per slot;
                     # scratch: ring [depth, bk, D], DMA sems [depth],
                     #   stage [2, bk, D] f32 + DMA sems [2]: the write-back ring
        plan, scale, k_g, explicit_transpose):
    rest = list(rest)
    interm_s = rest.pop(0) if plan.n_struct else None
    interm_g = rest.pop(0) if plan.n_kg else None
    ring_ref, sems, stage, out_sems = rest
    b, i = pl.program_id(0), pl.program_id(1)
    h, n_kg = plan.h, plan.n_kg
    prec = _precision(q_ref.dtype)
    ring, n_win, n_pool, u0, n_steps = _program_stream(plan, b, i, kv_hbm.at[b], ring_ref,
                                                       sems, idx_blk, k_g)
    n_struct = n_win + n_pool

    delta_ref[...] = jnp.sum(o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32),
                             axis=-1, keepdims=True)
    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    def grads(rows, v, valid):
        """dq rows += scale * ds @ v; returns the tile rows' dkv part scale*ds^T q + p^T dO."""
        q, do = q_ref[rows], do_ref[rows]
        s = scale * _dot_nt(q, v, prec)
        p = bm.recompute_p(s, lse_ref[rows], valid)
        dp = _dot_nt(do, v, prec)
        ds = bm.softmax_grad(p, dp, delta_ref[rows], dlse_ref[rows])
        dq_ref[rows] += scale * _dot_nn(ds.astype(v.dtype), v, prec)
        # Both transposed products contract the (token, head) axis of ds / p: transposed-
        # operand dots, so no [bk, H] transpose is materialised.
        return (scale * _dot_tn(ds.astype(q.dtype), q, prec, explicit_transpose)
                + _dot_tn(p.astype(do.dtype), do, prec, explicit_transpose))

    # Write-back ring: the [bk, D] contribution of step i goes to stage[i % 2] and leaves by an
    # async copy to HBM; step i+2 waits for that copy before overwriting the stage slot, and the
    # program drains the last two before it ends. Intermediates never sit in VMEM as a block.
    def target(step):
        if plan.n_struct:
            j = jnp.where(step < n_win, step, plan.n_w + step - n_win) if plan.n_pm else step
            dst_s = interm_s.at[b, i * plan.n_struct + j]
        if n_kg:
            dst_g = interm_g.at[b, i * plan.bt * n_kg + step - n_struct]
        if not plan.n_struct:
            return dst_g
        if not n_kg:
            return dst_s
        return dst_s, dst_g

    def write_back(step, value):
        k = step % 2

        @pl.when(step >= 2)
        def _():   # any [bk, D] f32 destination: a wait only needs the semaphore and the size
            pltpu.make_async_copy(stage.at[k], _first(target(step)), out_sems.at[k]).wait()
        stage[k] = value
        dsts = target(step)
        if isinstance(dsts, tuple):   # structured tile or gathered slot tile
            _when(step < n_struct, lambda: pltpu.make_async_copy(
                stage.at[k], dsts[0], out_sems.at[k]).start())
            _when(step >= n_struct, lambda: pltpu.make_async_copy(
                stage.at[k], dsts[1], out_sems.at[k]).start())
        else:
            pltpu.make_async_copy(stage.at[k], dsts, out_sems.at[k]).start()

    def consume(step, slot):
        v = ring_ref[slot]

        def tile():
            write_back(step, grads(slice(None), v,
                                   _tile_mask(plan, i * plan.bt, step, n_win, u0)))

        def gathered():
            g = step - n_struct
            t, _ = bm.step_coords(g, n_kg)
            write_back(step, grads(pl.ds(t * h, h), v, valid_ref[g] > 0))

        if plan.n_struct:
            _when(step < n_struct, tile)
        if n_kg:
            _when(step >= n_struct, gathered)

    _stream(ring, n_steps, consume)

    def drain(step, c):
        pltpu.make_async_copy(stage.at[step % 2], _first(target(step)),
                              out_sems.at[step % 2]).wait()
        return c

    lax.fori_loop(jnp.maximum(n_steps - 2, 0), n_steps, drain, 0)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _bwd_launch(q2, kv_p, idx, o2, lse2, do2, dlse2, plan, *, scale, interpret, config):
    """One backward launch. Returns (dq f32 [B,Tp*H,D], delta [B,Tp*H,1],
    interm_s [B, nb, n_struct*bk, D] or None, interm_g [B, Tp*Kg, D] or None, idx_g or None).
    interm_s rows of tiles a block did not stream are NOT written (uninitialised): _dkv_struct
    reads only rows a block streamed."""
    bsz = q2.shape[0]
    h, d, bt, bk = plan.h, plan.d, plan.bt, plan.bk
    (idx_b, idx_spec), (valid, valid_spec), k_g = _gather_inputs(idx, plan)
    kernel = functools.partial(_bwd_kernel, plan=plan, scale=scale, k_g=k_g,
                               explicit_transpose=config.explicit_transpose)
    tok = pl.BlockSpec((None, bt * h, d), lambda b, i, *_: (b, i, 0))
    col = pl.BlockSpec((None, bt * h, 1), lambda b, i, *_: (b, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_specs = [tok, col]
    out_shape = [jax.ShapeDtypeStruct((bsz, plan.t_pad * h, d), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, plan.t_pad * h, 1), jnp.float32)]
    if plan.n_struct:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct((bsz, plan.nb * plan.n_struct, bk, d),
                                              jnp.float32))
    if plan.n_kg:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct((bsz, plan.t_pad * plan.n_kg, bk, d),
                                              jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(bsz, plan.nb),
        in_specs=[idx_spec, tok, tok, tok, col, col, valid_spec, hbm],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((plan.depth, bk, d), kv_p.dtype),
                        pltpu.SemaphoreType.DMA((plan.depth,)),
                        pltpu.VMEM((2, bk, d), jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
    )
    outs = list(pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_resolve_interpret(interpret),
        name="csa_bwd_tpu",
    )(idx_b, q2, do2, o2, lse2, dlse2, valid, kv_p))
    dq, delta = outs[0], outs[1]
    interm_s = interm_g = idx_g = None
    if plan.n_struct:
        interm_s = outs[2].reshape(bsz, plan.nb, plan.n_struct * bk, d)
    if plan.n_kg:
        interm_g = outs[-1].reshape(bsz, plan.t_pad * k_g, d)
        idx_g = _gathered_idx(idx, plan, k_g)
    return dq, delta, interm_s, interm_g, idx_g


# ----------------------------------------------------------------------------- dkv reductions

def inverse_map(idx, num_kv, num_rows):
    """CSR inverse of idx [B, E] (flat slots): (perm [B, E], key [B, E], offsets [B, R+1]).

    perm lists the slots sorted by kv row (stable, so the slots of one row stay in slot order;
    empty slots sort last under key num_kv); key = the row of each sorted entry; the entries of
    row r are perm[offsets[r]:offsets[r+1]]. num_rows >= num_kv (rows past num_kv are empty)."""
    key = jnp.where(idx >= 0, idx, num_kv).astype(jnp.int32)
    perm = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    skey = jnp.take_along_axis(key, perm, axis=-1)
    # rows past num_kv are empty: clamp so the empty slots (key num_kv) belong to no row
    rows = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), num_kv)
    offs = jax.vmap(lambda k: jnp.searchsorted(k, rows, side="left"))(skey).astype(jnp.int32)
    return perm, skey, offs


def _dkv_kernel(
        # prefetch
        perm_smem,   # [B * E] int32: slot of each sorted entry
        key_smem,    # [B * E] int32: kv row of each sorted entry
        offs_smem,   # [B * (R + 1)] int32: CSR row offsets
        # inputs
        interm_hbm,  # [B, E, D] f32 (HBM)
        # outputs
        dkv_ref,     # [block_r, D] f32
        # scratch
        ring_ref, sems,
        *, num_entries, num_rows):
    b, j = pl.program_id(0), pl.program_id(1)
    block_r = dkv_ref.shape[0]
    rows = ring_ref.shape[1]
    r0 = j * block_r
    start = offs_smem[b * (num_rows + 1) + r0]
    end = offs_smem[b * (num_rows + 1) + r0 + block_r]

    def entry(g, r):
        e = start + g * rows + r
        return e, b * num_entries + jnp.minimum(e, num_entries - 1)   # clamp: never read OOB

    def gather_row(g, r):
        e, flat = entry(g, r)
        return jnp.where(e < end, perm_smem[flat], -1)

    dkv_ref[...] = jnp.zeros(dkv_ref.shape, jnp.float32)

    def consume(step, slot):
        # Entries are added one by one in sorted (row, slot) order: a fixed summation order,
        # hence bit-identical dkv across runs and program orders.
        def body(r, c):
            e, flat = entry(step, r)

            @pl.when(e < end)
            def _():
                row = key_smem[flat] - r0
                dkv_ref[pl.ds(row, 1), :] += ring_ref[slot, pl.ds(r, 1), :]
            return c

        lax.fori_loop(0, rows, body, 0)

    ring = _Ring(interm_hbm.at[b], ring_ref, sems, gather=True, gather_row=gather_row)
    _stream(ring, bm.num_tiles(end - start, rows), consume)


def _csr_reduce(values, perm, key, offs, *, interpret, config):
    """out[b, r] = sum of values[b, perm[b, e]] over e in [offs[b, r], offs[b, r+1]) (whose
    key[b, e] == r), in e order. values [B, E, D] f32; offs [B, R+1] with R a multiple of
    block_r. Returns [B, R, D] f32."""
    bsz, e, d = values.shape
    br = config.block_r
    r = offs.shape[1] - 1
    kernel = functools.partial(_dkv_kernel, num_entries=e, num_rows=r)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(bsz, r // br),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, br, d), lambda b, j, *_: (b, j, 0)),
        scratch_shapes=[pltpu.VMEM((config.depth, config.block_k, d), jnp.float32),
                        pltpu.SemaphoreType.DMA((config.depth,))],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((bsz, r, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_resolve_interpret(interpret),
        name="csa_dkv_reduce_tpu",
    )(perm.reshape(-1), key.reshape(-1), offs.reshape(-1), values)


def split_map(key, offs, num_kv, seg_len, block_r):
    """Split every row's entry list into segments of at most seg_len entries (fan-in skew).

    key [B, E] / offs [B, R+1]: a CSR from inverse_map. Returns (seg [B, E]: the segment of each
    sorted entry, numbered in entry order, s_pad for empty slots; seg_offs [B, S+1]: the CSR of
    entries by segment; row_of_seg [B, S]: the row of each segment, num_kv past the last;
    row_offs [B, R+1]: the CSR of segments by row), with S = s_pad a static bound (multiple of
    block_r). Segment s of row r covers entries offs[r] + s' * seg_len ... of that row."""
    bsz, e = key.shape
    r = offs.shape[1] - 1
    s_pad = _round_up(r + bm.num_tiles(e, seg_len), block_r)
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
    r_pad = _round_up(num_kv, config.block_r)
    perm, key, offs = inverse_map(idx_g.reshape(bsz, e), num_kv, r_pad)
    seg, seg_offs, row_of_seg, row_offs = split_map(key, offs, num_kv, config.fanin_split,
                                                    config.block_r)
    part = _csr_reduce(interm, perm, seg, seg_offs, interpret=interpret, config=config)
    s_pad = part.shape[1]
    ident = jnp.broadcast_to(jnp.arange(s_pad, dtype=jnp.int32), (bsz, s_pad))
    dkv = _csr_reduce(part, ident, row_of_seg, row_offs, interpret=interpret, config=config)
    return dkv[:, :num_kv]


def _dkv_struct(interm_s, plan):
    """dkv rows [0, T) (window) and [T, N) (cr128 pool) from the per-block contributions
    interm_s [B, nb, n_struct*bk, D], by closed-form inverse maps, in a fixed order.

    Window: block i's union starts at u0_i = max(i*bt - window + 1, 0), so row r is in the
    unions of blocks r // bt .. (r + window - 1) // bt, at offset r - u0_i; at most
    (window - 1) // bt + 2 blocks, summed in block order. Pool row p: every block's pool tile
    row p, summed over blocks (each block is one partial: a hot row such as pool row 0 is
    split across all programs)."""
    bsz, nb, _, d = interm_s.shape
    bt, bk = plan.bt, plan.bk
    out = []
    if plan.n_w:
        span = plan.n_w * bk
        flat = interm_s[:, :, :span].reshape(bsz, nb * span, d)
        r = jnp.arange(plan.t, dtype=jnp.int32)
        acc = jnp.zeros((bsz, plan.t, d), jnp.float32)
        for c in range((plan.window - 1) // bt + 2):
            blk = r // bt + c
            off = r - jnp.maximum(blk * bt - plan.window + 1, 0)
            ok = (blk < nb) & (off >= 0) & (off < span)
            g = jnp.where(ok, blk * span + off, 0)
            acc = acc + jnp.where(ok[None, :, None], flat[:, g], 0.0)
        out.append(acc)
    else:
        out.append(jnp.zeros((bsz, plan.t, d), jnp.float32))
    if plan.n_pm:
        pool = interm_s[:, :, plan.n_w * bk:]                     # [B, nb, n_pm*bk, D]
        # block i streamed (and wrote) the pool rows p < (i*bt + bt) // ratio only
        p = jnp.arange(plan.n_pm * bk, dtype=jnp.int32)[None, :, None]

        def add_block(blk, acc):                                  # fixed order: block 0, 1, ..
            seen = p < jnp.minimum((blk * bt + bt) // plan.ratio, plan.pool_rows)
            part = lax.dynamic_index_in_dim(pool, blk, axis=1, keepdims=False)
            return acc + jnp.where(seen, part, 0.0)

        acc = lax.fori_loop(0, nb, add_block,
                            jnp.zeros(pool.shape[:1] + pool.shape[2:], jnp.float32))
        out.append(acc[:, :plan.pool_rows])
    dkv = jnp.concatenate(out, axis=1)
    return jnp.pad(dkv, ((0, 0), (0, plan.n - dkv.shape[1]), (0, 0)))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """(dq q.dtype, dkv kv.dtype, dsink [H] f32) (impl-module interface, csa_spec.md s. 3)."""
    bsz, t, h, d = q.shape
    n = kv.shape[1]
    plan = _make_plan(q.shape, n, idx.shape[-1], config)
    q2, do2, o2 = (_flat_tokens(x, plan) for x in (q, do, o))
    lse2 = _flat_tokens(lse[..., None].astype(jnp.float32), plan)
    dlse2 = _flat_tokens(dlse[..., None].astype(jnp.float32), plan)
    kv_p = _pad_kv(kv, plan)
    k_g_all = plan.n_kg * plan.bk
    chunk = config.slot_chunk or max(k_g_all, plan.bk)
    # Launch 0 streams the structured tiles and the first chunk of gathered slots; later
    # launches only further chunks. Partial results are added in launch order (deterministic).
    launches = []
    for c0 in range(0, max(k_g_all, 1), chunk):
        n_g = min(chunk, k_g_all - c0)
        lp = dataclasses.replace(plan, n_kg=bm.num_tiles(n_g, plan.bk), g_off=plan.g_off + c0)
        if c0:
            lp = dataclasses.replace(lp, n_w=0, n_pm=0)
        launches.append(lp)
    dq = dkv = delta = None
    for lp in launches:
        dq_c, delta, interm_s, interm_g, idx_g = _bwd_launch(
            q2, kv_p, idx, o2, lse2, do2, dlse2, lp, scale=scale, interpret=interpret,
            config=config)
        dkv_c = None
        if interm_s is not None:
            dkv_c = _dkv_struct(interm_s, lp)
        if interm_g is not None:
            dkv_g = _dkv_csr(interm_g, idx_g, n, interpret=interpret, config=config)
            dkv_c = dkv_g if dkv_c is None else dkv_c + dkv_g
        dq = dq_c if dq is None else dq + dq_c
        if dkv_c is not None:
            dkv = dkv_c if dkv is None else dkv + dkv_c
    if dkv is None:
        dkv = jnp.zeros(kv.shape, jnp.float32)
    delta = delta.reshape(bsz, plan.t_pad, h)[:, :t]
    dsink = jnp.sum(jnp.exp(sink[None, None, :] - lse) * (dlse - delta), axis=(0, 1))
    dq = dq.reshape(bsz, plan.t_pad, h, d)[:, :t]
    return dq.astype(q.dtype), dkv.astype(kv.dtype), dsink.astype(jnp.float32)
