"""The CSA forward in Gluon for AMD: CDNA3 (gfx942), CDNA4 (gfx950) and gfx1250 (compile-only).

NOTHING HERE HAS RUN ON AN AMD GPU: the kernels are compiled on a CPU (the triton 3.6.0 wheel's
AMD backend) and their resources read from the .amdgcn metadata (benchmarks/gluon_resources.py,
docs/perf/gpu_resources.md); their numerics are unchecked.

One program = 64 heads of one token (H = 128: two programs side by side), the NVIDIA kernel's
work split (fwd.py); heads are the M dimension of the matrix instructions. 8 warps (4 on gfx942;
wave64 on CDNA, wave32 on gfx1250), all of them both data movers and compute: triton 3.6.0's AMD
backend does not lower `gl.warp_specialize` (gfx1250: "failed to legalize 'ttg.warp_specialize'")
and its CDNA modules have no mbarrier, so instead of a producer partition every warp issues the
gathers of tile i + STAGES - 1 (CDNA4: async `buffer_load_to_shared`, the LDS ring's
commit groups; CDNA3: `buffer_load` into registers, stored to LDS after tile i's products) while
tile i is computed. On gfx1250 q arrives by the Tensor Data Mover (`tdm.async_load` of the
[64, D] block, an LDS mbarrier) and kv rows are gathered by `async_copy.global_to_shared` into the
ring; see `LOADER`.

Per tile (BK gathered kv rows): S = q kv^T (MFMA 16x16 / WMMA 16x16x32, warps_per_cta [4, NW/4]:
each warp owns 16 heads and, at 8 warps, half of S's columns and half of O's D columns), the
online softmax of fwd.py (`_softmax_step`: exp2 domain, scores masked by slot validity), O += P kv
with the same LDS tile as the B operand (K and V are the same rows). The matrix instructions want
K contiguous in each lane: QK^T's kv^T (K = D) is a plain read of the row-major tile, PV's kv
(K = BK rows) a transposed one (gfx950: ds_read_b64_tr_b16; `trans` in constexprs).
-1 slots are never read: their copies are masked (buffer ops: hardware out-of-range = zeros)
and their scores are -inf. The tile loop stops at the token's last non-empty tile (ntiles), and
the epilogue (sink, lse, o per csa_spec.md section 3) is fwd.py's `_finish`.

q stays in registers (the A operand of QK^T, 64 VGPRs a lane on wave64): the LDS is left to the
ring, which at D = 512 is what decides the tiles (`TARGET_DEFAULTS`, dims.py): gfx942's 64 KiB
hold one 32-row stage (32 KiB) plus the compiler's scratch for the P / row-max exchanges, the next
tile waiting in registers, at 4 warps (8 spill: no transpose-load on CDNA3); gfx950's 160 KiB hold
two 64-row stages; gfx1250 (320 KiB) holds q (64 KiB, delivered by the TDM) and three 64-row
stages. docs/perf/gpu_resources.md has the arithmetic and the compile report.
"""
from __future__ import annotations

import collections

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.amd import AMDMFMALayout, AMDWMMALayout, cdna3, gfx1250
from triton.experimental.gluon.language.amd.cdna4 import async_copy as cdna4_copy
from triton.experimental.gluon.language.amd.gfx1250 import async_copy as g1250_copy
from triton.experimental.gluon.language.amd.gfx1250 import mbarrier as g1250_bar
from triton.experimental.gluon.language.amd.gfx1250 import tdm

from csa_jax.kernels.gluon.dims import AMD_DEFAULTS, AMD_LDS, amd_lds_bytes
from csa_jax.kernels.gluon.ring import LOG2E, _finish, _program, _softmax_step

HBC_ = gl.constexpr(64)
# LOADER: how kv tiles reach LDS. 0 = buffer_load into registers, then a local store (CDNA3:
# 3.6.0 has no async copy for gfx942); 1 = async buffer_load_to_shared + commit groups (CDNA4);
# 2 = q by TDM + mbarrier, kv rows by async global_to_shared + commit groups (gfx1250); 3 = as 2
# but kv rows by per-row TDM block loads (gfx1250, constexprs(tdm_rows=True), not a default).
ARCH = {"gfx942": dict(mma=3, loader=0, warp=64), "gfx950": dict(mma=4, loader=1, warp=64),
        "gfx1250": dict(mma=0, loader=2, warp=32)}
TARGET_DEFAULTS = AMD_DEFAULTS          # per target at D = 512: dims.py says why


@gluon.constexpr_function
def _mma_layout(MMA, NW):
    """The accumulator layout of S and O: 16 x 16 tiles, warps [4, 2] (16 heads, half the
    columns each). MMA 3 / 4 = MFMA of CDNA3 / CDNA4, 0 = WMMA v3 (gfx1250)."""
    if MMA == 0:
        return AMDWMMALayout(3, transposed=True, warps_per_cta=[4, NW // 4],
                             instr_shape=[16, 16, 32])
    k = 16 if MMA == 3 else 32
    return AMDMFMALayout(version=MMA, instr_shape=[16, 16, k], transposed=True,
                         warps_per_cta=[4, NW // 4])


@gluon.constexpr_function
def _k_width(MMA):
    return 4 if MMA == 3 else 8


@gluon.constexpr_function
def _operand(i, MMA, NW):
    """Operand i (0 = A, 1 = B) layout of the products on _mma_layout."""
    return gl.DotOperandLayout(operand_index=i, parent=_mma_layout(MMA, NW), k_width=_k_width(MMA))


@gluon.constexpr_function
def _row_layout(D, WARP, NW):
    """Gather layout: 8 contiguous elements (16 B) a thread, a whole D = 512 row per wave64."""
    tc = min(WARP, D // 8)
    return gl.BlockedLayout([1, 8], [WARP // tc, tc], [NW, 1], [1, 0])


_Layouts = collections.namedtuple("_Layouts", "mma a_op b_op rl srow scol")


@gluon.constexpr_function
def _layouts(MMA, NW, D, WARP):
    """Both kernels' register layouts in one constexpr (`L: gl.constexpr = _layouts(...)`, then
    L.mma ...): the accumulator, the A / B operands of its products, the gather rows, the
    accumulator's rows and columns. Each field is itself a gl.constexpr, so L.a_op passed to a
    @gluon.jit helper stays a compile-time layout: a bare layout read off a constexpr (a
    namedtuple of plain layouts) fails there, and neither a returned tuple of layouts nor a
    @gluon.jit helper's returned layout can be unpacked into names (triton 3.6.0;
    docs/perf/gpu_resources.md, "Deduplicated Gluon kernels")."""
    mma = _mma_layout(MMA, NW)
    fields = (mma, _operand(0, MMA, NW), _operand(1, MMA, NW), _row_layout(D, WARP, NW),
              gl.SliceLayout(1, mma), gl.SliceLayout(0, mma))
    return _Layouts(*(gl.constexpr(f) for f in fields))


@gluon.constexpr_function
def _lds_layout(R, D):
    # 16 bytes of padding after every row: consecutive rows start on different banks.
    return gl.PaddedSharedLayout.with_identity_for([[D, 8]], [R, D], [1, 0])


@gluon.jit
def _tile_ids(idx_ptr, j, krows, ntiles, BK: gl.constexpr):
    """Row ids of tile j (-1 for slots at or past the token's last walked tile)."""
    pos = j * BK + krows
    return gl.load(idx_ptr + pos, mask=j < ntiles, other=-1)


@gluon.jit
def _kv_offsets(ids, cols, D: gl.constexpr):
    """(int32 element offsets of the rows within the batch's kv, validity); -1 -> row 0."""
    valid = ids >= 0
    return gl.where(valid, ids, 0)[:, None] * D + cols[None, :], valid[:, None]


@gluon.jit
def _load_block(ptr, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """A contiguous [R, C] block at ptr (an operand: q, dO) straight into registers."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    return cdna3.buffer_load(ptr, r[:, None] * C + c[None, :])


@gluon.jit
def _tile_operand(tile, b_op: gl.constexpr, rl: gl.constexpr, TRANS: gl.constexpr):
    """The kv tile [BK, D] as the B operand of P kv / dS kv (K = BK: a transposed read of the
    row-major LDS tile): TRANS 0 = straight into the operand layout, 1 = 16-byte row reads and
    a register transpose (constexprs' trans)."""
    if TRANS == 0:
        v = tile.load(b_op)
    else:
        v = gl.convert_layout(tile.load(rl), b_op)
    return v


@gluon.jit
def _load_tile(ring, stage, kv_src, idx_tok, j, krows, cols, ntiles, N: gl.constexpr,
               BK: gl.constexpr, D: gl.constexpr, LOADER: gl.constexpr):
    """Tile j's gather from kv_src (the batch's kv rows: a pointer, or for LOADER 3 a TDM
    descriptor of them). LOADER 0 returns the tile in registers (buffer_load; masked rows read as
    hardware out-of-range zeros); 1 / 2 copy it asynchronously into ring stage `stage` (one
    commit group; 2's masked-off rows get a plain LDS store of zeros); 3 issues one TDM block
    load per row (row N, out of the descriptor's range, for an empty slot: zero-filled). 1-3
    return 0."""
    if LOADER == 3:
        for r in gl.static_range(BK):
            rid = gl.load(idx_tok + j * BK + r, mask=j < ntiles, other=-1)
            tdm.async_load(kv_src, [gl.where(rid >= 0, rid, N), 0],
                           ring.index(stage).slice(r, 1))
        out = 0
    else:
        ids = _tile_ids(idx_tok, j, krows, ntiles, BK)
        offs, valid = _kv_offsets(ids, cols, D)
        if LOADER == 0:
            out = cdna3.buffer_load(kv_src, offs, mask=valid, other=0.0)
        else:
            if LOADER == 1:
                cdna4_copy.buffer_load_to_shared(ring.index(stage), kv_src, offs, mask=valid,
                                                 other=0.0)
            else:
                g1250_copy.global_to_shared(ring.index(stage), kv_src + offs, mask=valid,
                                            other=0.0)
            cdna4_copy.commit_group()
            out = 0
    return out


@gluon.jit
def _first_tiles(ring, kv_src, idx_tok, krows, cols, ntiles, N: gl.constexpr,
                 BK: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, LOADER: gl.constexpr):
    """The prologue: tile 0 into registers (LOADER 0), or tiles 0..STAGES-2 in flight."""
    if LOADER == 0:
        nxt = _load_tile(ring, 0, kv_src, idx_tok, 0, krows, cols, ntiles, N, BK, D, LOADER)
    else:
        for j in gl.static_range(STAGES - 1):
            _load_tile(ring, j, kv_src, idx_tok, j, krows, cols, ntiles, N, BK, D, LOADER)
        nxt = 0
    return nxt


@gluon.jit
def _next_tile(ring, nxt, i, kv_src, idx_tok, krows, cols, ntiles, N: gl.constexpr,
               BK: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, LOADER: gl.constexpr):
    """(LDS tile i, registers carried to the next call) at the top of iteration i."""
    if LOADER == 0:
        # tile i waits in registers: into the (single) LDS stage once tile i-1's reads end,
        # then tile i+1's loads fly while tile i is computed
        gl.thread_barrier()
        ring.index(0).store(nxt)
        gl.thread_barrier()
        tile = ring.index(0)
        nxt = _load_tile(ring, 0, kv_src, idx_tok, i + 1, krows, cols, ntiles, N, BK, D,
                         LOADER)
    else:
        # refill the stage tile i-1 used (every warp is past its reads: the barrier), then wait
        # for tile i's own group (STAGES - 1 newer groups may stay in flight) and make every
        # thread's copies visible (the second barrier)
        gl.thread_barrier()
        jn = i + STAGES - 1
        _load_tile(ring, jn % STAGES, kv_src, idx_tok, jn, krows, cols, ntiles, N, BK, D,
                   LOADER)
        if LOADER == 3:
            tdm.async_wait((STAGES - 1) * BK)     # per wave: BK TDM ops a tile, in order
        else:
            cdna4_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        tile = ring.index(i % STAGES)
    return tile, nxt


@gluon.jit
def _tile_scores(ring, nxt, i, kv_src, idx_tok, krows, cols, ntiles, kcols, q, s_zero,
                 b_op: gl.constexpr, N: gl.constexpr, BK: gl.constexpr, D: gl.constexpr,
                 STAGES: gl.constexpr, LOADER: gl.constexpr, MMA: gl.constexpr):
    """Iteration i's first steps in both kernels: (LDS tile i, the registers _next_tile carries
    to the next call, tile i's slot ids, the tile as QK^T's B operand kv^T, S = q kv^T)."""
    tile, nxt = _next_tile(ring, nxt, i, kv_src, idx_tok, krows, cols, ntiles, N, BK, D,
                           STAGES, LOADER)
    sid = gl.load(idx_tok + i * BK + kcols)
    kt = tile.permute((1, 0)).load(b_op)
    return tile, nxt, sid, kt, _mma(q, kt, s_zero, MMA)


@gluon.jit
def _kv_source(kv_b, N: gl.constexpr, D: gl.constexpr, LOADER: gl.constexpr):
    """What the gathers read: the batch's kv base pointer (int32 offsets from it), or for
    LOADER 3 a TDM descriptor of its [N, D] rows with [1, D] blocks (zero padding)."""
    if LOADER == 3:
        src = tdm.make_tensor_descriptor(kv_b, shape=[N, D], strides=[D, 1], block_shape=[1, D],
                                         layout=_lds_layout(1, D))
    else:
        src = kv_b
    return src


@gluon.jit
def _program_setup(ntiles_ptr, idx_ptr, kv_ptr, dtype: gl.constexpr, T: gl.constexpr,
                   NHB: gl.constexpr, N: gl.constexpr, D: gl.constexpr, K: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, WARP: gl.constexpr,
                   LOADER: gl.constexpr):
    """Both kernels' start: ring._program's (row, tok, hb, ntiles, idx_tok), then the LDS ring
    [STAGES, BK, D], the gathers' source for the program's batch and the gather layout's column
    and row indices."""
    row, tok, hb, b, ntiles, idx_tok = _program(ntiles_ptr, idx_ptr, T, NHB, K)
    rl: gl.constexpr = _row_layout(D, WARP, gl.num_warps())
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, rl))
    krows = gl.arange(0, BK, layout=gl.SliceLayout(1, rl))
    kv_src = _kv_source(kv_ptr + b.to(gl.int64) * (N * D), N, D, LOADER)
    ring = gl.allocate_shared_memory(dtype, [STAGES, BK, D], _lds_layout(BK, D))
    return row, tok, hb, ntiles, idx_tok, ring, kv_src, cols, krows


@gluon.jit
def _drain(LOADER: gl.constexpr):
    """No async copy outlives the program (ntiles = 0 or the masked tail still issued groups)."""
    if LOADER == 3:
        tdm.async_wait(0)
    elif LOADER != 0:
        cdna4_copy.wait_group(0)


@gluon.jit
def csa_fwd_amd_kernel(q_ptr, kv_ptr, idx_ptr, ntiles_ptr, sink_ptr, o_ptr, lse_ptr,
                       T: gl.constexpr, N: gl.constexpr, NHB: gl.constexpr, D: gl.constexpr,
                       K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       QK_SCALE: gl.constexpr, MMA: gl.constexpr, LOADER: gl.constexpr,
                       WARP: gl.constexpr, TRANS: gl.constexpr):
    HBC: gl.constexpr = HBC_
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    L: gl.constexpr = _layouts(MMA, NW, D, WARP)
    row, tok, hb, ntiles, idx_tok, ring, kv_src, cols, krows = _program_setup(
        ntiles_ptr, idx_ptr, kv_ptr, dtype, T, NHB, N, D, K, BK, STAGES, WARP, LOADER)
    q_blk = q_ptr + row.to(gl.int64) * (HBC * D)

    # ---- q into registers (the A operand of every QK^T) and the ring's first tiles
    if LOADER >= 2:
        q_smem = gl.allocate_shared_memory(dtype, [HBC, D], _lds_layout(HBC, D))
        q_bar = gl.allocate_shared_memory(gl.int64, [1], g1250_bar.MBarrierLayout())
        # the TDM splits the block over the warps: each warp's tensor_load_to_lds (8 rows at
        # 8 warps) carries the barrier and arrives once, hence count = warps (as triton's own
        # gfx1250 TDM + mbarrier tests initialise it)
        g1250_bar.init(q_bar, count=NW)
        # this program's [HBC, D] block of q as a (one-block) tensor for the TDM
        q_desc = tdm.make_tensor_descriptor(q_blk, shape=[HBC, D], strides=[D, 1],
                                            block_shape=[HBC, D], layout=q_smem.layout)
        tdm.async_load(q_desc, [0, 0], q_smem, mbarrier=q_bar)
    else:
        q = _load_block(q_blk, HBC, D, L.a_op)
    nxt = _first_tiles(ring, kv_src, idx_tok, krows, cols, ntiles, N, BK, D, STAGES, LOADER)
    if LOADER >= 2:
        g1250_bar.wait(q_bar, 0)
        q = q_smem.load(L.a_op)

    m = gl.full([HBC], -1.0e30, gl.float32, L.srow)
    l = gl.zeros([HBC], gl.float32, L.srow)
    acc = gl.zeros([HBC, D], gl.float32, L.mma)
    s_zero = gl.zeros([HBC, BK], gl.float32, L.mma)
    kcols = gl.arange(0, BK, layout=L.scol)
    for i in range(ntiles):
        tile, nxt, sid, _, sc = _tile_scores(ring, nxt, i, kv_src, idx_tok, krows, cols, ntiles,
                                             kcols, q, s_zero, L.b_op, N, BK, D, STAGES,
                                             LOADER, MMA)
        p, alpha, m, l = _softmax_step(sc, sid, m, l, QK_SCALE)
        acc = acc * alpha[:, None]
        pa = gl.convert_layout(p.to(dtype), L.a_op)
        acc = _mma(pa, _tile_operand(tile, L.b_op, L.rl, TRANS), acc, MMA)
    _drain(LOADER)

    hrows = gl.arange(0, HBC, layout=L.srow)
    lse, o_scale = _finish(m, l, sink_ptr + hb * HBC + hrows)
    gl.store(lse_ptr + row * HBC + hrows, lse)
    o = (acc * o_scale[:, None]).to(o_ptr.dtype.element_ty)
    ocols = gl.arange(0, D, layout=L.scol)
    gl.store(o_ptr + row.to(gl.int64) * (HBC * D) + hrows[:, None] * D + ocols[None, :], o)


@gluon.jit
def _mma(a, b, acc, MMA: gl.constexpr):
    if MMA == 0:
        out = gfx1250.wmma(a, b, acc)
    else:
        out = cdna3.mfma(a, b, acc)
    return out


def constexprs(*, target, T, N, NHB, D, K, BK, stages, scale, trans=0, tdm_rows=False):
    """The kernel's compile-time parameters for an AMD target (also the CPU compile checks).
    trans: how PV reads its B operand (the kv tile, K = BK rows, row-major in LDS, so read
    transposed): 0 = the operand layout straight from LDS (the compiler's choice: gfx950
    ds_read_b64_tr_b16, gfx942 2-byte strided ds_read_u16, CDNA3 has no transpose-load);
    1 = 16-byte row reads into registers, then a layout conversion (a register transpose,
    through the compiler's LDS scratch). Issue 14's switch; only 0 is a default.
    tdm_rows (gfx1250 only, not a default): kv rows by one TDM block load per row (LOADER 3)
    instead of async_copy's pointer gather (the TDM has no gather form in triton 3.6.0)."""
    a = ARCH[target]
    if tdm_rows and target != "gfx1250":
        raise ValueError(f"tdm_rows needs gfx1250's Tensor Data Mover, not {target}")
    return dict(T=T, N=N, NHB=NHB, D=D, K=K, BK=BK, STAGES=stages,
                QK_SCALE=float(scale) * LOG2E, MMA=a["mma"],
                LOADER=3 if tdm_rows else a["loader"], WARP=a["warp"], TRANS=int(trans))


ARG_TYPES = ("*{dt}", "*{dt}", "*i32", "*i32", "*fp32", "*{dt}", "*fp32")


def arg_types(dt="bf16"):
    return [t.format(dt=dt) for t in ARG_TYPES]


def check_buffer_range(N, Dp, itemsize):
    """Buffer loads address a batch's kv rows with 32-bit byte offsets (range 2**31 - 2, the
    descriptor's num_records; out-of-range offsets are how masked rows read zeros)."""
    if N * Dp * itemsize > 2 ** 31 - 2:
        raise ValueError(f"kv of N={N} rows x D={Dp} ({itemsize} B) per batch exceeds the AMD "
                         f"buffer loads' 2 GiB byte-offset range")


def forward(q, kv, idx, sink, *, scale, arch, block_k=None, stages=None):
    """o [B, T, H, D] (q.dtype), lse [B, T, H] f32 through csa_fwd_amd_kernel on a ROCm GPU of
    architecture `arch` (a key of ARCH). NEVER RUN: no AMD GPU was available; the launch goes
    through adapter.gluon_call's ROCm branch, itself untested."""
    from csa_jax.kernels.gluon.adapter import gluon_call
    from csa_jax.kernels.gluon.ring import out_shapes, prepare, unpad
    if arch not in ARCH:
        raise NotImplementedError(f"no AMD Gluon forward for arch={arch!r}; built for "
                                  f"{sorted(ARCH)}")
    d = TARGET_DEFAULTS[arch]
    bk, st = block_k or d["block_k"], stages or d["stages"]
    q_p, kv_p, idx_p, ntiles, sink_p, dims = prepare(q, kv, idx, sink, bk)
    B, T, H, D, N, Hp, Dp, Kp, nhb = dims
    need = amd_lds_bytes(arch, D, bk, st, extra_blocks=int(arch == "gfx1250"))
    if need > AMD_LDS[arch] - 8192:
        raise ValueError(f"block_k={bk}, stages={st} at D={D} need {need} B of LDS; {arch} has "
                         f"{AMD_LDS[arch]} (8 KiB kept for the compiler's scratch)")
    check_buffer_range(N, Dp, q.dtype.itemsize)
    o, lse = gluon_call(
        q_p, kv_p, idx_p, ntiles, sink_p, kernel=csa_fwd_amd_kernel,
        out_shape=out_shapes(q, dims), grid=(B * T * nhb,), num_warps=d["warps"],
        name="csa_gluon_fwd_amd",
        **constexprs(target=arch, T=T, N=N, NHB=nhb, D=Dp, K=Kp, BK=bk, stages=st, scale=scale))
    return unpad(o, lse, dims)
