"""Config of impl="gluon" (the package, csa_jax/kernels/gluon/__init__.py, re-exports all of it):
the tuning dataclass and its checks, the forward's shared-memory estimate, default_config with
NVIDIA_BWD, and replace_config with the dq kernel's tile choice (_bwd_tiles)."""
from __future__ import annotations

import dataclasses

from csa_jax.kernels.gluon.dims import AMD_DEFAULTS, AMD_DQ_DEFAULTS, check_bwd_win


def _amd():
    """The package's _amd(), looked up at each call, so that a test that simulates a device
    (monkeypatch of gluon._amd or gluon._device) reaches default_config / replace_config."""
    from csa_jax.kernels import gluon
    return gluon._amd()


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the Gluon forward.

    block_k: gathered kv rows per ring stage (the wgmma N of QK^T and K of PV): 64 or 32.
    stages: depth of the shared-memory ring (2 at D = 512: q 64 KiB + 2 x 64 KiB stages).
    producer_regs: registers per thread of the producer partition (setmaxnreg; multiple of 8,
        24..256); the consumers get what is left of the 64K-register file.
    pipeline: issue tile i's QK^T while tile i-1's PV still runs (async wgmma), release stage
        i-1 after both; False = each tile's two products run back to back.
    smem_epilogue: write o through q's shared buffer and store it with 16-byte coalesced
        stores (False: straight from the wgmma accumulator layout, 4-byte stores).
    prefetch: load the next tile's row ids while the current tile is in flight (producer) or
        on the tensor cores (consumers), so no global-load latency sits between a stage's release
        and its refill, or between a tile's QK^T and its mask.
    layout: what the caller promises about idx (csa_spec.md section 4; the same promise as
        pallas_tpu's Config.layout, checked by check_layout / csa_jax/layouts.py):
        "generic" (default) nothing; "cr0" slots [0, window) hold token t's window rows
        max(0, t - window + 1) .. t (each once, any order, -1 for the rest), every later slot -1;
        "cr4" the same window, the other slots arbitrary; "cr128" the same window, then the
        visible pool rows T + p, p < (t + 1) // pool_ratio (any order), -1 elsewhere.
        cr0 / cr128 may run a window-reuse kernel (win_schedule: a block of 16 tokens copies
        its window union once and every token reads it at its own offset; idx is not read, a
        traced idx that breaks the promise gives NaN for its tokens); generic / cr4 the gather
        kernel (docs/perf/gluon_window_h200.md).
    window, pool_ratio: the layout's window (the window kernel takes 64 or 128) and cr128 ratio.
    win_programs: programs per (sequence, head block) of the window kernel along the tokens
        (0 = one program per SM in all); win_producer_regs: its producer's registers (40: its
        consumers need the rest, 232, for a 144-row span without spills); pool_tile,
        pool_stages: its cr128 pool ring (rows per tile, depth); win_p_smem: cr0's window P
        goes to the PV products through shared memory instead of registers (cr128 always uses
        the pool slot for it: window.p_smem_mode). win_ablate: BENCHMARK ONLY, wrong results:
        1 = the window kernel computes everything but stores no o / lse, 2 = its consumers only
        wait for and release the copies (the producer's pace); 3 (exchange only) = q copied
        for each program's first token only (the kernel without q's loads).
    win_schedule: which kernel a cr0 / cr128 promise runs (Config.window_schedule):
        "lockstep" (window.py: 8 consumer warps in step), "exchange" (cr0: window_xchg.py, two
        consumer warpgroups, two max / P exchanges per token), "overlap" (cr0: the same, the
        next token's scores issued before this token's o stores; win_regs=224), "gather" (the
        gather kernel, as without a promise) or "auto" (default: cr0 with window 128 exchange,
        the rest gather: the faster of the measured and checked ones, WIN_AUTO); exchange and
        overlap at cr128 run the lockstep kernel (there is no cr128 exchange kernel). win_regs:
        the exchange kernels' consumer registers (setmaxnreg). win_prefetch (exchange kernels
        only): 0 off, n = the producer prefetches the q of the token n ahead into L2.
    ablate: BENCHMARK ONLY, wrong results: 1 = no PV product, 2 = no QK^T product, 3 = neither,
        4 = no compute at all (the consumers only wait for and release the ring: the producer's
        pace). Used to place the time inside the kernel (docs/perf/gluon_h200.md).
    schedule: "auto" (default) = "alternate" unless an option of the lockstep kernel is set
        (pipeline, smem_epilogue, ablate) or stages is odd, then "default" (measured:
        docs/perf/gluon_h200.md, "alternate" 1.22x faster at Pro cr4 T=16384);
        "default" = fwd.py (one 8-warp consumer partition: both warpgroups compute half
        of every S and their half of every PV); "alternate" = fwd_alt.py, FlashMLA's schedule
        (two 4-warp consumer partitions that take turns: S and the softmax of even tiles on
        warpgroup 0, odd tiles on 1, P and the running max / sum handed over in shared memory,
        each PV on the warpgroup's own 256 columns; registers per consumer thread `alt_regs`,
        the producer warpgroup gets the rest: 72 at 216; `producer_regs` is the default
        schedule's and the dq kernel's). `pipeline`,
        `smem_epilogue` and `ablate` apply to the default schedule only; "alternate" needs an
        even `stages`.
    alt_regs: schedule="alternate": registers per consumer thread (setmaxnreg; multiple of 8,
        128..240).
    alt_split: schedule="alternate" only: each ring stage in two column halves with their own
        barriers (the producer refills a half as soon as its readers are done; FlashMLA's
        half-D pipelining; measured no faster than without).
    alt_order: schedule="alternate" only, the order of a consumer warpgroup's steps per own
        tile i (fwd_alt.py): "pv_first" (default since session 3: 1.09x / 1.08x faster than
        "s_first" at Pro cr4 T=4096 / 16384, docs/perf/gluon_alt_h200.md): the other's
        PV_{i-1} before S_i (it waits only for the other's publish, not for tile i's copies),
        stage i-1 and the other's P buffer released before the softmax; "s_first" (the
        default before): issue S_i, then the other's PV_{i-1}, softmax, publish P_i with (max,
        sum) on one barrier, release stage i-1 after the softmax;
        "stats_first": (max, sum, rescale) handed over on their own barrier right after the
        softmax, before P is written, so the next tile's softmax waits for the softmax alone
        (the other's PV_{i-1} then runs after the softmax); "pv_release": as "pv_first", but
        PV_{i-1} is waited and stage i-1 released before waiting for tile i's copies (not
        measured on the GPU yet).
    alt_ablate: BENCHMARK ONLY, wrong results, schedule="alternate": 1 = no wgmma products (S
        taken as 0, no PV; softmax, P and max / sum exchange, every barrier and the gather
        kept): the alternating kernel's pace without the tensor cores.
    bwd: "gluon" (the dq kernel of bwd.py, dkv by the per-slot GEMM + inverse-map reduce) or
        "pallas_triton" (its whole backward); bwd_block_k (16, 32, 64) and bwd_stages: the dq
        kernel's ring tile rows and depth (32 x 2 at D = 512: [q; dO] 128 KiB + 2 x 32 KiB).
    bwd_prefetch: the dq kernel loads the next tile's row ids ahead (producer and consumers, as
        `prefetch` in the forward); off by default: not yet timed in the dq kernel.
    bwd_ablate: BENCHMARK ONLY, wrong results: 1 = no scale*dS / P stores, 2 = no dq product,
        3 = no score product, 4 = no compute (the dq kernel's consumers only wait and release);
        5, 6 (bwd_pair's lockstep kernel only): the producer issues no kv-row gathers and still
        hands each ring stage over (5: the row ids still loaded; 6: not loaded either).
    bwd_dq_operand: how the dq kernel's dq product takes the kv tile, the transposed operand
        (bwd.py _dq_product; issue 14's ablation): "desc" (dq += dS kv, the tile as B through an
        MN-major shared-memory descriptor; default), or dq^T += kv^T dS^T with kv^T as A:
        "desc_a" (MN-major A descriptor), "ldsm_trans" (registers by ldmatrix .trans),
        "movmatrix" (registers by plain ldmatrix + an explicit register transpose),
        "strided" (registers by plain strided 2-byte shared loads, no ldmatrix).
    bwd_interm: how the per-slot intermediate interm = dsp^T [q; dO] is formed: "xla" (one
        batched XLA dot per token on a stacked [q; dO]) or "gluon" (kernels/gluon/interm.py: a
        warp-specialized wgmma GEMM reading q and dO in place, dsp^T and [q; dO] through
        MN-major, "transposed", descriptors); bwd_interm_operand: that kernel's A operand
        (dsp^T): "desc" (MN-major descriptor), "ldsm_trans" or "movmatrix" (into registers by
        ldmatrix .trans, or plain ldmatrix + a register transpose); bwd_interm_stages: its
        A ring depth (2..4); bwd_interm_pipeline: one async wgmma in flight ("desc" only).
    bwd_qdo (with bwd_interm="xla"; the Gluon interm GEMM reads q and dO in place and ignores
        it): the dq kernel also writes the interm GEMM's stacked [q; dO] operand from its shared
        memory (4.3 GB of writes at Pro cr4 T = 16384 in place of XLA's stack: 4.3 GB read +
        4.3 GB written); dsp is then laid out head block first to match. On by default_config
        on NVIDIA (NVIDIA_BWD), off on AMD (the AMD dq kernel has no such copy).
    bwd_pair: the dq kernel keeps q and dO rows interleaved in 8-row groups in its resident
        [q; dO] buffer (bwd.py _qdo_row), so the score product's accumulator holds S and dP of
        one (head, slot) in the same thread: p and dS are formed in registers, without the f32
        S / dP exchange through shared memory (16 KiB stored and loaded per 32-row tile) and
        one of the tile's three partition barriers; dsp leaves in 4-byte stores. 16 KiB less
        shared memory. No bwd_prefetch / bwd_ablate 1..4 modes.
    bwd_fuse_delta: the dq kernel forms delta = sum(o * dO) per head itself (o read in 16-row
        chunks while the producer copies q and dO; dlse - delta written out for dsink) instead
        of an XLA reduction reading o and dO (4.3 GB at Pro T = 16384). NVIDIA only (the AMD
        route ignores it).
    bwd_pipeline (bwd_pair, lockstep, bwd_dq_operand "desc" only): the dq kernel's dq product
        runs asynchronously: tile i's score product is issued right behind tile i-1's dq
        product, stage i-1 is released once that dq product is done (while the scores run),
        and tile i's dsp stores are issued under its dq product (bwd_pipe.py).
    bwd_qdo_regs (bwd_pipeline only; 0 or 1): 1 = bwd_pipe.csa_dq_blk_kernel: [q; dO] kept in
        64-column blocks, block 0 (16 KiB) also held in registers (16 a thread) as the
        register A operand of the score product, so its shared memory is free after the
        prologue and holds dS: 16 KiB less shared-memory traffic a tile (of 268 KiB at D = 512,
        32-row tiles) and room for a third 32-row stage at D = 512 (bwd_stages=3: 229,580 B).
    bwd_scores_ahead (bwd_qdo_regs=1 with bwd_stages >= 3): tile i+1's score product is issued
        before tile i's element-wise work, so the tensor cores run it while the consumers form
        p / dS and store dsp (3 ring tiles live: i-1 until its dq product is done, i, i+1);
        the consumers then need 232 registers and the producer gets 40.
    bwd_schedule: the dq kernel's schedule: "lockstep" (bwd.py: one 8-warp consumer partition,
        both warpgroups on every tile) or "alternate" (bwd_alt.py, the forward's alternating
        schedule: two 4-warp consumer warpgroups owning alternate tiles, each computing its
        tile's scores and dS on M = 128 paired [q; dO] rows, publishing dS in shared memory,
        each running its column half of every tile's dq product, the other's tile behind its
        own scores on the tensor pipe; even bwd_stages; bwd_pair is implied);
        bwd_alt_regs: its consumer registers per thread (232: no spills; the producer gets
        the rest, 40); bwd_alt_order: its steps per own tile, "s_first" (the tile's scores,
        then the other's tile's dq product behind them) or "dq_first" (the other's dq product
        first, both waited and the other's stage released before the element-wise work:
        fwd_alt's pv_first; bwd_alt.py).
    bwd_narrow_keys: the dkv inverse map sorts int16 keys when N < 2**15 (same map).
    bwd_win: window reuse in the backward, layout="cr0" only (bwd_win.py: a 16-token block's
        window union resident, [q; dO] of 32 heads streamed per token; dkv by the same
        deterministic path on the canonical window index list). bwd_qdo, bwd_fuse_delta, the
        reduce options and win_programs apply, the gather kernel's tiles and modes do not.
        NVIDIA only; off by default (docs/perf/gluon_bwd_h200.md, part 4a).
        bwd_win_producer_regs: its producer's registers (56: no spills at D = 512).
        bwd_win_delta (with bwd_fuse_delta): "global" (o and dO read from global memory per
        token, bwd.py's way) or "smem" (o loads issued before the [q; dO] wait, dO read from
        the resident buffer).
        bwd_win_overlap: the [q; dO] copy-out under the async score products and the dsp
        stores under the async dq product (False: each after the other, round 1's order).
        bwd_win_dq_movmatrix: dq leaves in 4-byte stores, its bf16 8 x 8 blocks transposed in
        registers (PTX movmatrix) first (False: 2-byte stores from the accumulator layout).
        bwd_win_dsp: dsp's slot order, "canonical" (slot j = row t - window + 1 + j; per-token
        shifted 2-byte stores) or "block" (slot j = span column j: aligned 4-byte stores; the
        dkv path then uses that order's index list, bwd_win.slot_rows).
        bwd_win_ablate: BENCHMARK ONLY, wrong results: 1 = no dsp / [q; dO] stores, 2 = no dq
        product, 3 = the consumers only wait for and release the copies (their pace).
    bwd_reduce: the dkv gather-reduce kernel: "pallas_triton" (the Pallas Triton impl's) or
        "gluon" (kernels/gluon/dkv.py: 16-byte loads, two chunks of rows in flight, f32 [R, D]
        partials summed once); both deterministic, with different (fixed) summation orders.
        default_config picks "gluon" on NVIDIA (NVIDIA_BWD), "pallas_triton" on AMD.
    bwd_block_r, bwd_reduce_warps: that kernel's inverse-map entries per step and warps
        (0 = its default: 32 x 4 warps for pallas_triton, 16 x 4 for gluon).
    """

    block_k: int = 64
    stages: int = 2
    producer_regs: int = 96
    pipeline: bool = False
    smem_epilogue: bool = False
    prefetch: bool = True
    layout: str = "generic"
    window: int = 128
    pool_ratio: int = 128
    win_programs: int = 0
    win_producer_regs: int = 40
    pool_tile: int = 16
    pool_stages: int = 1
    win_p_smem: bool = False
    win_ablate: int = 0
    win_schedule: str = "auto"
    win_regs: int = 216
    win_prefetch: int = 0
    ablate: int = 0
    schedule: str = "auto"
    alt_regs: int = 216
    alt_split: bool = False
    alt_order: str = "pv_first"
    alt_ablate: int = 0
    bwd: str = "gluon"
    bwd_block_k: int = 32
    bwd_stages: int = 2
    bwd_prefetch: bool = False
    bwd_ablate: int = 0
    bwd_dq_operand: str = "desc"
    bwd_interm: str = "xla"
    bwd_interm_operand: str = "desc"
    bwd_interm_stages: int = 4
    bwd_interm_pipeline: bool = False
    bwd_qdo: bool = False
    bwd_pair: bool = False
    bwd_fuse_delta: bool = False
    bwd_pipeline: bool = False
    bwd_qdo_regs: int = 0
    bwd_scores_ahead: bool = False
    bwd_schedule: str = "lockstep"
    bwd_alt_regs: int = 232
    bwd_alt_order: str = "s_first"
    bwd_narrow_keys: bool = False
    bwd_reduce: str = "pallas_triton"
    bwd_block_r: int = 0
    bwd_reduce_warps: int = 0
    bwd_win: bool = False
    bwd_win_producer_regs: int = 56
    bwd_win_ablate: int = 0
    bwd_win_delta: str = "global"
    bwd_win_overlap: bool = True
    bwd_win_dq_movmatrix: bool = False
    bwd_win_dsp: str = "canonical"

    def __post_init__(self):
        if self.bwd not in ("gluon", "pallas_triton"):
            raise ValueError(f"bwd={self.bwd!r} must be 'gluon' or 'pallas_triton'")
        check_bwd_win(self)
        if self.bwd_block_k not in (16, 32, 64):
            raise ValueError(f"bwd_block_k={self.bwd_block_k!r} must be 16, 32 or 64")
        if isinstance(self.bwd_stages, bool) or self.bwd_stages not in (1, 2, 3, 4):
            raise ValueError(f"bwd_stages={self.bwd_stages!r} must be an int in 1..4")
        if not isinstance(self.bwd_prefetch, bool):
            raise ValueError(f"bwd_prefetch={self.bwd_prefetch!r} must be a bool")
        if isinstance(self.bwd_ablate, bool) or self.bwd_ablate not in (0, 1, 2, 3, 4, 5, 6):
            raise ValueError(f"bwd_ablate={self.bwd_ablate!r} must be 0 (off) or 1..6 "
                             f"(benchmark only)")
        for name in ("bwd_qdo", "bwd_narrow_keys", "bwd_pair", "bwd_fuse_delta"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.bwd_pair and (self.bwd_prefetch or self.bwd_ablate in (1, 2, 3, 4)):
            raise ValueError(f"bwd_pair=True has no bwd_prefetch / bwd_ablate 1..4 modes (got "
                             f"bwd_prefetch={self.bwd_prefetch}, bwd_ablate={self.bwd_ablate})")
        if self.bwd_ablate in (5, 6) and not (self.bwd_pair and self.bwd_pipeline is False
                                              and self.bwd_schedule == "lockstep"):
            raise ValueError(f"bwd_ablate={self.bwd_ablate} (no kv gathers) needs the paired "
                             f"lockstep dq kernel: bwd_pair=True, bwd_pipeline=False, "
                             f"bwd_schedule='lockstep' (got {self.bwd_pair}, "
                             f"{self.bwd_pipeline!r}, {self.bwd_schedule!r})")
        if not isinstance(self.bwd_pipeline, bool):
            raise ValueError(f"bwd_pipeline={self.bwd_pipeline!r} must be a bool")
        if self.bwd_pipeline and not (self.bwd_pair and self.bwd_schedule == "lockstep"
                                      and self.bwd_dq_operand == "desc"):
            raise ValueError(f"bwd_pipeline=True needs bwd_pair=True, bwd_schedule='lockstep', "
                             f"bwd_dq_operand='desc' (got {self.bwd_pair}, "
                             f"{self.bwd_schedule!r}, {self.bwd_dq_operand!r})")
        r = self.bwd_qdo_regs
        if isinstance(r, bool) or r not in (0, 1):
            raise ValueError(f"bwd_qdo_regs={r!r} must be 0 (off) or 1")
        if r and not self.bwd_pipeline:
            raise ValueError(f"bwd_qdo_regs={r} needs bwd_pipeline=True")
        if not isinstance(self.bwd_scores_ahead, bool):
            raise ValueError(f"bwd_scores_ahead={self.bwd_scores_ahead!r} must be a bool")
        if self.bwd_scores_ahead and not (r and self.bwd_stages >= 3):
            raise ValueError(f"bwd_scores_ahead=True needs bwd_qdo_regs=1 and bwd_stages >= 3 "
                             f"(got {r}, {self.bwd_stages})")
        if self.bwd_schedule not in ("lockstep", "alternate"):
            raise ValueError(f"bwd_schedule={self.bwd_schedule!r} must be 'lockstep' or "
                             f"'alternate'")
        if self.bwd_schedule == "alternate":
            if self.bwd_stages % 2:
                raise ValueError(f"bwd_schedule='alternate' needs an even bwd_stages, got "
                                 f"{self.bwd_stages}")
            if self.bwd_prefetch or self.bwd_ablate or self.bwd_dq_operand != "desc":
                raise ValueError("bwd_schedule='alternate' has no bwd_prefetch / bwd_ablate / "
                                 "bwd_dq_operand modes")
        if self.bwd_alt_order not in ("s_first", "dq_first"):
            raise ValueError(f"bwd_alt_order={self.bwd_alt_order!r} must be 's_first' or "
                             f"'dq_first'")
        r = self.bwd_alt_regs
        if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 128 <= r <= 240:
            raise ValueError(f"bwd_alt_regs={r!r} must be a multiple of 8 in 128..240")
        if self.bwd_dq_operand not in ("desc", "desc_a", "ldsm_trans", "movmatrix", "strided"):
            raise ValueError(f"bwd_dq_operand={self.bwd_dq_operand!r} must be 'desc', 'desc_a', "
                             f"'ldsm_trans', 'movmatrix' or 'strided'")
        if self.bwd_interm not in ("xla", "gluon"):
            raise ValueError(f"bwd_interm={self.bwd_interm!r} must be 'xla' or 'gluon'")
        if self.bwd_interm_operand not in ("desc", "ldsm_trans", "movmatrix"):
            raise ValueError(f"bwd_interm_operand={self.bwd_interm_operand!r} must be 'desc', "
                             f"'ldsm_trans' or 'movmatrix'")
        if self.bwd_interm_stages not in (2, 3, 4) or isinstance(self.bwd_interm_stages, bool):
            raise ValueError(f"bwd_interm_stages={self.bwd_interm_stages!r} must be 2, 3 or 4")
        if not isinstance(self.bwd_interm_pipeline, bool):
            raise ValueError(f"bwd_interm_pipeline={self.bwd_interm_pipeline!r} must be a bool")
        if self.bwd_interm_pipeline and self.bwd_interm_operand != "desc":
            raise ValueError("bwd_interm_pipeline=True needs bwd_interm_operand='desc'")
        if self.bwd_reduce not in ("pallas_triton", "gluon"):
            raise ValueError(f"bwd_reduce={self.bwd_reduce!r} must be 'pallas_triton' or 'gluon'")
        if self.bwd_block_r not in (0, 8, 16, 32, 64, 128) or isinstance(self.bwd_block_r, bool):
            raise ValueError(f"bwd_block_r={self.bwd_block_r!r} must be 0 (default) or 8, 16, "
                             f"32, 64, 128")
        if self.bwd_reduce_warps not in (0, 1, 2, 4, 8, 16) or isinstance(
                self.bwd_reduce_warps, bool):
            raise ValueError(f"bwd_reduce_warps={self.bwd_reduce_warps!r} must be 0 (default) "
                             f"or 1, 2, 4, 8, 16")
        if self.block_k not in (32, 64):
            raise ValueError(f"block_k={self.block_k!r} must be 32 or 64")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not (
                1 <= self.stages <= 4):
            raise ValueError(f"stages={self.stages!r} must be an int in 1..4")
        r = self.producer_regs
        if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 24 <= r <= 256:
            raise ValueError(f"producer_regs={r!r} must be a multiple of 8 in 24..256")
        for name in ("pipeline", "smem_epilogue", "prefetch", "alt_split"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.ablate not in (0, 1, 2, 3, 4) or isinstance(self.ablate, bool):
            raise ValueError(f"ablate={self.ablate!r} must be 0 (off) or 1..4 (benchmark only)")
        if self.ablate and self.pipeline:
            raise ValueError("ablate applies to pipeline=False only")
        _check_layout_fields(self)
        if self.schedule not in ("auto", "default", "alternate"):
            raise ValueError(f"schedule={self.schedule!r} must be 'auto', 'default' or "
                             f"'alternate'")
        a = self.alt_regs
        if isinstance(a, bool) or not isinstance(a, int) or a % 8 or not 128 <= a <= 240:
            raise ValueError(f"alt_regs={a!r} must be a multiple of 8 in 128..240")
        if self.alt_split and self.resolved_schedule != "alternate":
            raise ValueError("alt_split=True applies to schedule='alternate' only")
        if self.alt_order not in ("s_first", "pv_first", "stats_first", "pv_release"):
            raise ValueError(f"alt_order={self.alt_order!r} must be 's_first', 'pv_first', "
                             f"'stats_first' or 'pv_release'")
        if isinstance(self.alt_ablate, bool) or self.alt_ablate not in (0, 1):
            raise ValueError(f"alt_ablate={self.alt_ablate!r} must be 0 (off) or 1 (benchmark "
                             f"only)")
        if self.alt_ablate and self.resolved_schedule != "alternate":
            raise ValueError("alt_ablate applies to schedule='alternate' only")
        if self.alt_order != "pv_first" and self.resolved_schedule != "alternate":
            raise ValueError(f"alt_order={self.alt_order!r} applies to schedule='alternate' "
                             f"only")
        if self.schedule == "alternate":
            if self.stages % 2:
                raise ValueError(f"schedule='alternate' needs an even stages, got "
                                 f"stages={self.stages}")
            on = self._lockstep_options()
            if on:
                raise ValueError(f"{', '.join(on)} apply to schedule='default' only "
                                 f"(schedule='alternate' has its own overlap and epilogue)")

    def _lockstep_options(self):
        return [n for n in ("pipeline", "smem_epilogue", "ablate") if getattr(self, n)]

    def window_schedule(self):
        """What this config runs for its layout: "generic" (no window promise: generic / cr4),
        "gather" (the gather kernel despite the promise), "lockstep", "exchange", "overlap"."""
        if self.layout not in ("cr0", "cr128"):
            return "generic"
        s = self.win_schedule
        if s == "auto":            # what the H200 measured faster and checked (WIN_AUTO)
            s = WIN_AUTO.get((self.layout, self.window), "gather")
        return "lockstep" if self.layout == "cr128" and s in ("exchange", "overlap") else s

    @property
    def resolved_schedule(self):
        """"default" or "alternate": what schedule="auto" runs (an option that only the
        lockstep kernel has, or an odd ring depth, selects "default")."""
        if self.schedule != "auto":
            return self.schedule
        return "default" if self._lockstep_options() or self.stages % 2 else "alternate"


LAYOUTS = ("generic", "cr0", "cr4", "cr128")
WIN_SCHEDULES = ("auto", "lockstep", "exchange", "overlap", "gather")
# win_schedule="auto" per (layout, window); the rest runs the gather kernel
# (docs/perf/gluon_window_h200.md: round 1, exchange checked vs xla and 12-16% faster than the
# gather kernel at Pro cr0 T=4096; cr128's lockstep window kernel slower than gather in call A)
WIN_AUTO = {("cr0", 128): "exchange"}


def _check_layout_fields(c):
    if c.layout not in LAYOUTS:
        raise ValueError(f"layout={c.layout!r} must be one of {LAYOUTS}")
    for name in ("window", "pool_ratio", "pool_tile", "pool_stages", "win_producer_regs"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if isinstance(c.win_programs, bool) or not isinstance(c.win_programs, int) or (
            c.win_programs < 0):
        raise ValueError(f"win_programs={c.win_programs!r} must be an int >= 0 (0 = auto)")
    if c.pool_ratio < 2:
        raise ValueError(f"pool_ratio={c.pool_ratio} must be >= 2")
    if c.win_producer_regs % 8 or not 24 <= c.win_producer_regs <= 256:
        raise ValueError(f"win_producer_regs={c.win_producer_regs} must be a multiple of 8 in "
                         f"24..256")
    if c.layout in ("cr0", "cr128") and c.window not in (64, 128):
        raise ValueError(f"window={c.window}: the window-reuse kernel (layout={c.layout!r}) "
                         f"takes window 64 or 128")
    if not isinstance(c.win_p_smem, bool):
        raise ValueError(f"win_p_smem={c.win_p_smem!r} must be a bool")
    if isinstance(c.win_ablate, bool) or c.win_ablate not in (0, 1, 2, 3):
        raise ValueError(f"win_ablate={c.win_ablate!r} must be 0 (off), 1, 2 or 3 (benchmark "
                         f"only; 3: win_schedule='exchange' only)")
    if c.pool_tile not in (16, 32, 64):
        raise ValueError(f"pool_tile={c.pool_tile} must be 16, 32 or 64")
    if c.win_schedule not in WIN_SCHEDULES:
        raise ValueError(f"win_schedule={c.win_schedule!r} must be one of {WIN_SCHEDULES}")
    ws = c.window_schedule()
    if ws in ("exchange", "overlap") and c.win_p_smem:
        raise ValueError(f"win_p_smem applies to the lockstep window kernel only "
                         f"(layout={c.layout!r} runs {ws!r})")
    if c.win_ablate and ws not in ("generic", "gather") and not (
            ws == "exchange" or (ws == "lockstep" and c.win_ablate < 3)):
        raise ValueError(f"win_ablate={c.win_ablate} does not apply to {ws!r} (lockstep: 1, 2; "
                         f"exchange: 1, 2, 3)")
    r = c.win_regs
    if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 128 <= r <= 240:
        raise ValueError(f"win_regs={r!r} must be a multiple of 8 in 128..240")
    p = c.win_prefetch
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 4:
        raise ValueError(f"win_prefetch={p!r} must be an int in 0..4 (tokens ahead)")
    if p and ws not in ("exchange", "overlap", "generic", "gather"):
        raise ValueError(f"win_prefetch={p} applies to the exchange window kernels only "
                         f"(layout={c.layout!r} runs {ws!r})")


def shared_bytes(D, config, itemsize=2):
    """Shared memory the kernel's buffers need (q + ring; "alternate" adds its two P tiles and
    the max / sum exchange; the compiler adds a few KiB)."""
    from csa_jax.kernels.gluon.dims import HB, padded_dims
    Dp = padded_dims(64, D, config.block_k, config.block_k)[1]
    extra = 0
    if config.resolved_schedule == "alternate":
        extra = 2 * HB * config.block_k * itemsize + 8 * HB * 4
    return (HB + config.stages * config.block_k) * Dp * itemsize + extra


_SMEM_BUDGET = 232_448 - 16_384      # the H200's per-block limit minus compiler scratch


# The backward options default_config turns on for NVIDIA (docs/perf/gluon_bwd_h200.md, part 3):
# bwd_qdo + the Gluon reduce (measured at Pro cr4 T=16384: backward 36.25 vs 41.51 ms), and the
# dq kernel's paired rows (no S / dP exchange) with delta formed in the kernel (chosen from the
# byte / barrier counts; the final call then measured 36.01 vs 36.47 ms without them). Every gradient case against xla passed on
# the H200 for both steps (empty and out-of-range slots, both cotangents, sink, f16, D = 64).
# The AMD route refuses bwd_qdo / bwd_pair and keeps the Pallas Triton reduce.
NVIDIA_BWD = dict(bwd_qdo=True, bwd_reduce="gluon", bwd_pair=True, bwd_fuse_delta=True)


def default_config(q_shape, kv_shape, idx_shape, dtype) -> Config:
    """block_k 64, 2 stages at D = 512 (the most that fits the H200's 227 KiB), more stages for
    smaller D while they fit; block_k 32 if even 2 stages of 64 rows would not fit. On NVIDIA
    the backward also takes NVIDIA_BWD (the dq kernel writes [q; dO], pairs q / dO rows and
    forms delta; the Gluon reduce)."""
    del kv_shape, idx_shape
    D = q_shape[3]
    arch = _amd()
    if arch in AMD_DEFAULTS:
        d, b = AMD_DEFAULTS[arch], AMD_DQ_DEFAULTS[arch]
        return Config(block_k=d["block_k"], stages=d["stages"], bwd_block_k=b["block_k"],
                      bwd_stages=b["stages"])
    cfg = _bwd_default(D, Config(**NVIDIA_BWD))
    for stages in (4, 3, 2):
        c = dataclasses.replace(cfg, stages=stages)
        if shared_bytes(D, c) <= _SMEM_BUDGET:
            return c
    return dataclasses.replace(cfg, block_k=32, stages=2)


def _bwd_tiles(D, schedule, pair, blk=False):
    """(bwd_block_k, bwd_stages) of the dq kernel: the largest (rows, stages) of 64x3, 64x2,
    32x3, 32x2, 16x4 whose buffers fit (32 x 2 at D = 512); dims.dq_shared_bytes counts every
    buffer and barrier (dq_alt_shared_bytes and even stages only for schedule "alternate";
    blk: bwd_pipe's blocked kernel, dq_blk_shared_bytes, whose compile adds 148 B: 1 KiB of
    margin, 32 x 3 at D = 512); None if none fits."""
    from csa_jax.kernels.gluon.dims import (
        SMEM_LIMIT, dq_alt_shared_bytes, dq_blk_shared_bytes, dq_shared_bytes)
    alt = schedule == "alternate"
    for bk, st in ((64, 3), (64, 2), (32, 3), (32, 2), (16, 4)):
        if alt and st % 2:
            continue
        if blk and not alt:
            if dq_blk_shared_bytes(D, bk, st) <= SMEM_LIMIT - 1024:
                return bk, st
            continue
        need = dq_alt_shared_bytes(D, bk, st) if alt else dq_shared_bytes(D, bk, st, pair=pair)
        if need <= SMEM_LIMIT - 8192:
            return bk, st
    return None


def _bwd_default(D, cfg):
    """cfg with the dq kernel's tiles of _bwd_tiles for its bwd_schedule / bwd_pair /
    bwd_qdo_regs."""
    tiles = _bwd_tiles(D, cfg.bwd_schedule, cfg.bwd_pair, bool(cfg.bwd_qdo_regs))
    if tiles is None:
        return cfg
    return dataclasses.replace(cfg, bwd_block_k=tiles[0], bwd_stages=tiles[1])


# Fields whose value decides the dq kernel's tiles (_bwd_tiles).
_BWD_TILE_KEYS = ("bwd_schedule", "bwd_pair", "bwd_qdo_regs")


def replace_config(cfg, q_shape, **overrides):
    """dataclasses.replace(cfg, **overrides) for a variant of a default config: an override
    that changes what the dq kernel's tiles depend on (bwd_schedule, bwd_pair) without naming
    bwd_block_k / bwd_stages re-picks them for the new kernel (_bwd_tiles at D = q_shape[3]),
    so that e.g. bwd_schedule="alternate" on top of a 3-stage lockstep default gets its even
    ring depth instead of a ValueError. Tiles named in the overrides are kept as given."""
    kw = dict(overrides)
    changed = any(k in kw and kw[k] != getattr(cfg, k) for k in _BWD_TILE_KEYS)
    if changed and "bwd_block_k" not in kw and "bwd_stages" not in kw and not _amd():
        tiles = _bwd_tiles(q_shape[3], kw.get("bwd_schedule", cfg.bwd_schedule),
                           kw.get("bwd_pair", cfg.bwd_pair),
                           bool(kw.get("bwd_qdo_regs", cfg.bwd_qdo_regs)))
        if tiles is not None:
            kw["bwd_block_k"], kw["bwd_stages"] = tiles
    return dataclasses.replace(cfg, **kw)
