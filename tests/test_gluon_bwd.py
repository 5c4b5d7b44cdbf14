"""The Gluon backward (csa_jax/kernels/gluon/bwd.py, dkv.py) without a GPU.

- the dq kernel compiles for sm_90a (triton's own compiler and the bundled ptxas, on the CPU):
  launchable through jaxlib, inside the H200's shared memory, no spills, the wgmma shapes meant;
  the AMD backends refuse it; the dkv reduce compiles for every target;
- the host wrapper (padding, dsp layout, delta formed by the kernel, dsink, the per-slot GEMM and
  the inverse-map reduce; the AMD route's Pallas Triton GEMM + reduce in interpret mode) against
  the float64 dense oracle, with the Gluon kernels replaced by jnp emulations of their contracts
  (Gluon has no interpreter);
- the Config's backward fields and default tiles.
The kernels themselves run on the H200 (benchmarks/gluon_bwd_check.py,
docs/perf/gluon_bwd_h200.md).
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, dense_oracle, random_problem

pytest.importorskip("triton.experimental.gluon")

from csa_jax.kernels import gluon  # noqa: E402
from csa_jax.kernels.gluon import adapter, bwd, ring  # noqa: E402
from csa_jax.kernels.gluon.dims import SMEM_LIMIT, dq_shared_bytes  # noqa: E402


@pytest.mark.parametrize("dt,D,bk,stages", [("bf16", 512, 32, 2), ("fp16", 512, 16, 4),
                                            ("bf16", 128, 64, 3)])
def test_dq_kernel_compiles_sm90(dt, D, bk, stages):
    cfg = gluon.default_config((1, 64, 128, D), None, None, jnp.bfloat16)
    if dt == "bf16":                    # the default tiles (32 x 2 at D = 512: the ones timed)
        assert (cfg.bwd_block_k, cfg.bwd_stages) == (bk, stages)
    c = adapter.compile_kernel(
        bwd.csa_dq_kernel, bwd.arg_types(dt),
        bwd.constexprs(T=64, N=300, NHB=2, D=D, K=192, BK=bk, stages=stages, scale=D ** -0.5),
        target="sm_90a", num_warps=ring.CONSUMER_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None, r
    assert r["num_warps"] == ring.CONSUMER_WARPS + 4          # consumers + producer partition
    est = dq_shared_bytes(D, bk, stages)
    assert est <= r["shared"] <= min(est + 1024, adapter.SHARED_LIMIT["sm_90a"]), (r, est)
    assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0, r
    ptx = c.asm["ptx"]
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))
    assert shapes == {str(bk), str(D // 2)}, shapes          # [q; dO] kv^T and dS kv
    assert "setmaxnreg" in ptx


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "gfx1250"])
def test_dq_kernel_is_nvidia_only(target):
    """wgmma, NVMMA layouts, cp.async and setmaxnreg: the AMD backends reject the kernel while
    building it (Triton's front end or pass manager raises), not later at launch; AMD runs
    amd_bwd.py's dq kernel."""
    from triton.compiler.errors import CompilationError
    with pytest.raises((RuntimeError, CompilationError)):
        adapter.compile_kernel(
            bwd.csa_dq_kernel, bwd.arg_types("bf16"),
            bwd.constexprs(T=64, N=300, NHB=2, D=512, K=192, BK=32, stages=2, scale=0.1),
            target=target, num_warps=ring.CONSUMER_WARPS)


@pytest.mark.parametrize("D,R,warps,regs_max", [(512, 16, 4, 168), (512, 32, 8, 168),
                                                (64, 16, 4, 64)])
def test_dkv_reduce_kernel_compiles_sm90(D, R, warps, regs_max):
    """kernels/gluon/dkv.py: 16-byte loads (ld.global.v4), no spills at the tiles offered."""
    from csa_jax.kernels.gluon import dkv
    c = adapter.compile_kernel(dkv.csa_dkv_reduce_kernel, dkv.arg_types("bf16"),
                               dkv.constexprs(N=20480, E=16384 * 1152, D=D, R=R),
                               target="sm_90a", num_warps=warps)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None, r
    assert r.get("spill_stores", 0) == 0 and r["registers"] <= regs_max, r
    assert "ld.global.v4" in c.asm["ptx"]
    with pytest.raises(ValueError, match="block_r=8"):
        dkv.reduce_rows(jnp.zeros((1, 4, 2), jnp.int32), jnp.zeros((1, 8), jnp.int32),
                        jnp.zeros((1, 8, 512), jnp.bfloat16), jnp.bfloat16, block_r=8,
                        num_warps=16)


@pytest.mark.parametrize("target,warp", [("gfx942", 64), ("gfx950", 64), ("gfx1250", 32)])
def test_dkv_reduce_kernel_compiles_amd(target, warp):
    """The Gluon reduce uses no NVIDIA-only op: it compiles for the AMD targets (64-lane waves
    on CDNA), in their LDS, without scratch (spills). Compile only: nothing launches it on AMD."""
    from csa_jax.kernels.gluon import dkv
    c = adapter.compile_kernel(dkv.csa_dkv_reduce_kernel, dkv.arg_types("bf16"),
                               dkv.constexprs(N=20480, E=16384 * 1152, D=512, R=16, warp=warp),
                               target=target, num_warps=4)
    r = adapter.resources(c, target)
    assert r["shared"] <= adapter.SHARED_LIMIT[target], r
    assert not r.get("vgpr_spill") and not r.get("scratch"), r


def test_amd_dq_kernel_strided_read_gfx950():
    """amd_bwd.py trans=2 (the strided mode, no AMD GPU here): on gfx950 the kv tile of dS kv
    is read with plain 2-byte ds_read_u16 where the default uses CDNA4's ds_read_b64_tr_b16."""
    from csa_jax.kernels.gluon import amd_bwd
    d = amd_bwd.DQ_DEFAULTS["gfx950"]
    mix = {}
    for trans in (0, 2):
        c = adapter.compile_kernel(
            amd_bwd.csa_dq_amd_kernel, amd_bwd.arg_types("bf16"),
            amd_bwd.constexprs(target="gfx950", T=64, N=300, NHB=2, D=512, K=192,
                               BK=d["block_k"], stages=d["stages"], scale=0.05, qdo=d["qdo"],
                               trans=trans),
            target="gfx950", num_warps=d["warps"])
        asm = c.asm["amdgcn"]
        mix[trans] = {k: len(re.findall(rf"^\s+{k}\b", asm, re.M))
                      for k in ("ds_read_b64_tr_b16", "ds_read_u16")}
    assert mix[0]["ds_read_b64_tr_b16"] > 0 and mix[0]["ds_read_u16"] == 0, mix
    assert mix[2]["ds_read_b64_tr_b16"] == 0 and mix[2]["ds_read_u16"] > 0, mix


def test_backward_tiles_of_default_config(monkeypatch):
    """default_config's dq tiles: the largest that fit the H200 with 8 KiB to spare (32 x 2 at
    D = 512); on AMD the per-target tiles of dims.AMD_DQ_DEFAULTS."""
    from csa_jax.kernels.gluon.dims import AMD_DQ_DEFAULTS
    for D in (64, 128, 256, 512):
        c = gluon.default_config((1, 8, 64, D), None, None, jnp.bfloat16)
        assert c.bwd == "gluon"
        assert dq_shared_bytes(D, c.bwd_block_k, c.bwd_stages) <= SMEM_LIMIT - 8192
    c = gluon.default_config((1, 8, 128, 512), None, None, jnp.bfloat16)
    assert (c.bwd_block_k, c.bwd_stages) == (32, 2)
    assert dataclasses.replace(c, bwd="pallas_triton").bwd == "pallas_triton"
    monkeypatch.setattr(gluon, "_amd", lambda: "gfx950")
    c = gluon.default_config((1, 8, 128, 512), None, None, jnp.bfloat16)
    want = AMD_DQ_DEFAULTS["gfx950"]
    assert (c.bwd_block_k, c.bwd_stages) == (want["block_k"], want["stages"])


def test_oversized_tiles_are_refused_by_name():
    q = jnp.zeros((1, 4, 64, 512), jnp.bfloat16)
    kv = jnp.zeros((1, 8, 512), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 64), jnp.int32)
    f32 = jnp.zeros((1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="bwd_block_k=64, bwd_stages=2 at D=512"):
        bwd.backward(q, kv, idx, jnp.zeros(64), q, f32, q, f32, scale=0.1, block_k=64,
                     stages=2)


def _dq_contract(q, do, kv, idx, ntiles, lse, dc, *, T, N, BK, SCALE, dt):
    """The dq kernels' math in jnp on their flat operands (q, dO [BT*H, D], kv [B*N, D], idx
    [BT, K], lse and dc = dlse - delta [BT*H]): (dq [BT, H, D] f32 from dS rounded to dt,
    dS [BT, H, K], P [BT, H, K]), slots past the token's last tile and -1 slots empty."""
    BT, K = idx.shape
    D = q.shape[-1]
    f32 = jnp.float32
    qf = q.reshape(BT, -1, D).astype(f32)
    dof = do.reshape(BT, -1, D).astype(f32)
    rows = kv.reshape(-1, N, D)[jnp.arange(BT)[:, None] // T, jnp.maximum(idx, 0)].astype(f32)
    walked = jnp.arange(K)[None, :] < (ntiles * BK)[:, None]
    valid = ((idx >= 0) & walked)[:, None, :]                                   # [BT, 1, K]
    s = jnp.einsum("thd,tkd->thk", qf, rows)
    lse2, dc2 = lse.reshape(BT, -1, 1), dc.reshape(BT, -1, 1)
    p = jnp.where(valid, jnp.exp(jnp.where(valid, s * SCALE - lse2, 0.0)), 0.0)
    ds = p * (jnp.einsum("thd,tkd->thk", dof, rows) + dc2)
    dq = SCALE * jnp.einsum("thk,tkd->thd", ds.astype(dt).astype(f32), rows)
    return dq, ds, p


def _emulated_dq_kernel(q, do, kv, idx, ntiles, lse, dc, o=None, *, kernel, out_shape, grid,
                        num_warps, name, T, N, NHB, D, K, BK, SCALE, **_):
    """What the dq kernels compute, in jnp (their contract; see the bwd.py docstring). NVIDIA
    (csa_dq_kernel): dc holds dlse, the kernel subtracts delta = sum(o * dO) and writes the
    result out, dsp head block first, plus its copy of [q; dO]; AMD (csa_dq_amd_kernel): dc
    holds dlse - delta, outputs (dq, dsp [BT, 2, Hp, K])."""
    from csa_jax.kernels.gluon import amd_bwd
    amd = kernel is amd_bwd.csa_dq_amd_kernel
    assert (kernel, num_warps) in ((bwd.csa_dq_kernel, ring.CONSUMER_WARPS),
                                   (amd_bwd.csa_dq_amd_kernel,
                                    amd_bwd.DQ_DEFAULTS["gfx950"]["warps"]))
    BT = idx.shape[0]
    Hp, B = NHB * bwd.HB, BT // T
    assert grid == (BT * NHB,) and q.shape == (BT * Hp, D) and kv.shape == (B * N, D)
    if not amd:
        dc = dc - jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dt = out_shape[0].dtype
    dq, ds, p = _dq_contract(q, do, kv, idx, ntiles, lse, dc, T=T, N=N, BK=BK, SCALE=SCALE,
                             dt=dt)
    dsp = jnp.stack([ds * SCALE, p], axis=1)                                  # [BT, 2, Hp, K]
    if amd:
        return dq.reshape(BT * Hp, D).astype(dt), dsp.astype(out_shape[1].dtype)
    hb = lambda x: x.reshape(BT, 2, NHB, bwd.HB, -1).transpose(0, 2, 1, 3, 4)  # noqa: E731
    dsp = hb(dsp)
    qdo = hb(jnp.stack([q.reshape(BT, Hp, D), do.reshape(BT, Hp, D)], axis=1)).astype(dt)
    assert dsp.shape == out_shape[1].shape and qdo.shape == out_shape[2].shape
    assert dc.shape == out_shape[3].shape and o.shape == q.shape
    return dq.reshape(BT * Hp, D).astype(dt), dsp.astype(out_shape[1].dtype), qdo, dc


def _emulated_reduce_kernel(offsets, perm, interm, *, kernel, out_shape, grid, num_warps, name,
                            N, E, D, R, TC, WARP):
    """What csa_dkv_reduce_kernel computes (kernels/gluon/dkv.py), in jnp: per row n of
    offsets [B*N, 2], the sum of interm rows perm[b, start:end]."""
    from csa_jax.kernels.gluon import dkv
    assert kernel is dkv.csa_dkv_reduce_kernel and grid == (offsets.shape[0],)
    assert R >= num_warps * (WARP // TC) and interm.shape == (perm.shape[0] * E, D)
    BN = offsets.shape[0]
    b = jnp.arange(BN) // N
    e = jnp.arange(E)[None, :]
    member = (e >= offsets[:, :1]) & (e < offsets[:, 1:])                      # [BN, E]
    rows = interm.reshape(-1, E, D)[b[:, None], perm[b]].astype(jnp.float32)   # [BN, E, D]
    out = jnp.sum(jnp.where(member[..., None], rows, 0.0), axis=1)
    return out.astype(out_shape.dtype)


def _emulated_dq_small_heads(q, do, kv, idx, ntiles, lse, dc, *, kernel, out_shape, grid,
                             num_warps, name, T, N, D, K, ROWS, HN, H, BK, SCALE, **_):
    """What csa_dq_small_heads_kernel computes (small_heads_dq.py), in jnp: dq [BT*H, D] and
    dsp [BT, K, 2, H] (slot-major, scale * dS then P; zeros past the token's last tile); dc
    holds dlse - delta; q / dO / lse / dc hold the H real heads."""
    assert num_warps == 4 and grid == (min(ROWS, 132),) and H <= HN and K % BK == 0
    BT = idx.shape[0]
    B = BT // T
    assert ROWS == BT and q.shape == do.shape == (BT * H, D) and kv.shape == (B * N, D)
    dt = out_shape[0].dtype
    dq, ds, p = _dq_contract(q, do, kv, idx, ntiles, lse, dc, T=T, N=N, BK=BK, SCALE=SCALE,
                             dt=dt)
    dsp = jnp.stack([ds * SCALE, p], axis=1).transpose(0, 3, 1, 2)          # [BT, K, 2, H]
    assert dsp.shape == out_shape[1].shape
    return dq.reshape(BT * H, D).astype(dt), dsp.astype(out_shape[1].dtype)


def _emulated_dkv_blocks(posg, lists, order, cnt, dsp, q, do, *, kernel, out_shape, grid,
                         num_warps, name, T, NB, NBT, J, JP, KP, DP, DS, S, **_):
    """What csa_dkv_blocks_kernel computes (dkv_blocks.py), in jnp: part [S, NBT*BN, DP] f32,
    split s of block blk = the sum over its pairs [cnt s // S, cnt (s + 1) // S) of A [BN, J]
    (the dsp rows of the pair's token t at the slots posg[blk, t] names, 0 for -1) times
    [q; dO] [J, DP] of t; list entries past cnt and posg rows of other tokens never read."""
    from csa_jax.kernels.gluon.dkv_blocks import BN, NUM_WARPS, grid_size
    assert num_warps == NUM_WARPS and grid == (grid_size(NBT, DP, S),) and DS == min(256, DP)
    assert posg.shape == (NBT, T, BN) and lists.shape == (NBT, T) and J <= JP and 64 % JP == 0
    if not isinstance(order, jax.core.Tracer):                          # (eager callers)
        assert sorted(np.asarray(order).tolist()) == list(range(NBT))
        assert (np.diff(np.asarray(cnt)[np.asarray(order)]) <= 0).all()  # longest list first
    H = J // 2
    pi = jnp.arange(T)[None, :]
    live = pi < cnt[:, None]
    tok = jnp.where(live, lists, 0)                                     # [NBT, T]
    row = (jnp.arange(NBT)[:, None] // NB) * T + tok                    # b T + t
    k = jnp.where(live[..., None], posg[jnp.arange(NBT)[:, None], tok], -1)   # [NBT, T, BN]
    a = jnp.where((k >= 0)[..., None], dsp[row[..., None] * KP + jnp.maximum(k, 0)], 0)
    qdo = jnp.concatenate([q.reshape(-1, H, DP), do.reshape(-1, H, DP)], axis=1)
    contrib = jnp.einsum("bprj,bpjd->bprd", a.astype(jnp.float32),
                         qdo[row].astype(jnp.float32))                 # [NBT, T, BN, DP]
    parts = []
    for sp in range(S):
        sl = (pi >= cnt[:, None] * sp // S) & (pi < cnt[:, None] * (sp + 1) // S)
        parts.append(jnp.sum(jnp.where(sl[..., None, None], contrib, 0.0), axis=1))
    out = jnp.stack(parts).reshape(S, NBT * BN, DP)
    assert out.shape == out_shape.shape
    return out


JUNK = 3        # what the maps stand-ins leave where the kernels write nothing (a valid id)


def _emulated_maps_token(idx2, *, kernel, out_shape, grid, num_warps, name, T, NB, **_):
    """csa_dkv_maps_token_kernel: its XLA twin, with JUNK in the posg rows it never writes."""
    from csa_jax.kernels.gluon import dkv_blocks
    flag, posg, dup = dkv_blocks.maps_token_reference(idx2, T, NB)
    pair = dkv_blocks.flag_by_block(flag, T)                            # [blk, t]
    posg = jnp.where(pair[..., None] > 0, posg, JUNK)
    assert [o.shape for o in out_shape] == [flag.shape, posg.shape, dup.shape]
    assert grid == (idx2.shape[0],)
    return flag, posg, dup


def _emulated_maps_block(flag, *, kernel, out_shape, grid, num_warps, name, T, NB, **_):
    """csa_dkv_maps_block_kernel: its XLA twin, with JUNK in the list entries past cnt."""
    from csa_jax.kernels.gluon import dkv_blocks
    lists, cnt = dkv_blocks.maps_block_reference(flag, T)
    lists = jnp.where(jnp.arange(T)[None, :] < cnt[:, None], lists, JUNK)
    assert [o.shape for o in out_shape] == [lists.shape, cnt.shape] and grid == (cnt.shape[0],)
    return lists, cnt


def _emulated_call(*args, kernel, **kw):
    from csa_jax.kernels.gluon import dkv, dkv_blocks, small_heads_dq
    f = {dkv.csa_dkv_reduce_kernel: _emulated_reduce_kernel,
         small_heads_dq.csa_dq_small_heads_kernel: _emulated_dq_small_heads,
         dkv_blocks.csa_dkv_blocks_kernel: _emulated_dkv_blocks,
         dkv_blocks.csa_dkv_maps_token_kernel: _emulated_maps_token,
         dkv_blocks.csa_dkv_maps_block_kernel: _emulated_maps_block}.get(kernel,
                                                                          _emulated_dq_kernel)
    return f(*args, kernel=kernel, **kw)


@pytest.mark.parametrize("H,D,K,bk,amd", [
    (20, 24, 40, 16, None), (64, 64, 70, 32, None), (130, 24, 40, 16, None),
    (130, 24, 140, 32, None), (70, 40, 75, 32, "gfx950")])
def test_wrapper_against_dense_oracle(rng, monkeypatch, H, D, K, bk, amd):
    """bwd.backward's plumbing with the kernels emulated: padding (3 head blocks at H = 130,
    D to 64, K to the tile), the dq kernel's dsp / [q; dO] layout and its delta, the per-slot
    GEMM, the inverse map and the Gluon reduce (NVIDIA), dsink; amd: the ROCm route
    (amd_bwd.csa_dq_amd_kernel, same contract; the Pallas Triton GEMM + reduce in its
    interpreter; never run on a GPU)."""
    monkeypatch.setattr(adapter, "gluon_call", _emulated_call)
    _check_against_oracle(rng, H, D, K, lambda *a, scale: bwd.backward(
        *a, scale=scale, block_k=bk, stages=2, amd=amd, interpret_reduce=True))


def _check_against_oracle(rng, H, D, K, backward, no_repeats=False):
    """backward(q, kv, idx, sink, o, lse, do, dlse, scale=) on a random float32 problem (T = 10,
    two empty tokens, sanitized -1 slots, both cotangents; no_repeats: a row's second listing
    in a token made -1) against the float64 dense oracle; then the jit caches are cleared (an
    emulated kernel must not stay in a backward's cache)."""
    from csa_jax.common import sanitize_indices
    q, kv, idx, sink = random_problem(rng, T=10, H=H, D=D, K=K, dtype=jnp.float32, empty_rows=2)
    idx = sanitize_indices(idx, kv.shape[1])
    if no_repeats:
        from benchmarks.gluon_check import drop_repeats
        idx = drop_repeats(idx)
    scale = 0.7 * D ** -0.5
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    o, lse = dense_oracle(q, kv, idx, sink, scale)
    o, lse = jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)
    dq, dkv, dsink = backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale)
    _, _, rdq, rdkv, rdsink = dense_oracle(q, kv, idx, sink, scale, do, dlse)
    for what, got, want in (("dq", dq, rdq), ("dkv", dkv, rdkv), ("dsink", dsink, rdsink)):
        assert got.shape == want.shape, (what, got.shape, want.shape)
        assert_close(got, want, jnp.float32, factor=10, what=what)
    jax.clear_caches()
    assert np.isfinite(np.asarray(dkv)).all()


@pytest.mark.parametrize("H,D,K,dkv", [(5, 24, 40, "slots"), (16, 64, 70, "slots"),
                                      (24, 40, 130, "slots"), (5, 24, 40, "blocks"),
                                      (16, 64, 70, "blocks"), (24, 40, 130, "blocks")])
def test_small_heads_wrapper_against_dense_oracle(rng, monkeypatch, H, D, K, dkv):
    """small_heads_dq.backward's plumbing with the kernels emulated: q / dO / lse unpadded in
    heads (H < HN = 16 / 32), D padded to 64, K to the 64-row tile, the slot-major dsp, delta
    in XLA, dsink; dkv "slots": the per-slot GEMM, the inverse map and the Gluon reduce;
    "blocks": dkv_blocks' maps, kernel and split sum, on lists without repeats (with one,
    lax.cond takes the per-slot path: the test after the next)."""
    from csa_jax.kernels.gluon import small_heads_dq
    from csa_jax.kernels.gluon.dims import small_heads_block
    monkeypatch.setattr(adapter, "gluon_call", _emulated_call)
    _check_against_oracle(rng, H, D, K, lambda *a, scale: small_heads_dq.backward(
        *a, scale=scale, HN=small_heads_block(H), stages=2, dkv=dkv), no_repeats=dkv == "blocks")


def test_small_heads_blocks_path_takes_slots_on_repeats(rng, monkeypatch):
    """dkv="blocks" on random_problem's lists, which repeat rows within tokens (dup_frac):
    lax.cond's per-slot branch, still the oracle's gradients (each listing counts,
    csa_spec.md)."""
    from csa_jax.kernels.gluon import small_heads_dq
    monkeypatch.setattr(adapter, "gluon_call", _emulated_call)
    _check_against_oracle(rng, 16, 64, 40, lambda *a, scale: small_heads_dq.backward(
        *a, scale=scale, HN=16, stages=2, dkv="blocks"))


@pytest.mark.parametrize("H,D,N,K", [(16, 64, 300, 70), (8, 64, 700, 130), (32, 128, 129, 64)])
def test_dkv_blocks_against_per_slot_sum(rng, monkeypatch, H, D, N, K):
    """dkv_blocks.dkv_blocks (kernel emulated) against the per-slot sum in float64 on lists
    without repeats (dup False: the path a call takes): -1 slots anywhere, an empty token,
    ids in several 128-row blocks, the last block partial (N = 129, 300, 700)."""
    from csa_jax.kernels.gluon import dkv_blocks
    monkeypatch.setattr(adapter, "gluon_call", _emulated_call)
    B, T = 2, 9
    idx = np.stack([np.stack([rng.permutation(N)[:K] for _ in range(T)]) for _ in range(B)])
    idx = np.where(rng.random(idx.shape) < 0.3, -1, idx).astype(np.int32)
    idx[0, 3] = -1                                                     # an empty token
    Kp = -(-K // 64) * 64
    idx_p = np.pad(idx, ((0, 0), (0, 0), (0, Kp - K)), constant_values=-1)
    dsp = rng.standard_normal((B, T, Kp, 2, H)).astype(np.float32)
    q, do = rng.standard_normal((2, B, T, H, D)).astype(np.float32)
    maps, dup = dkv_blocks.block_maps(jnp.asarray(idx_p), N)
    assert not bool(dup)
    got = dkv_blocks.dkv_blocks(jnp.asarray(dsp), jnp.asarray(q), jnp.asarray(do), maps, N)
    want = np.zeros((B, N, D))
    for b, t, k in zip(*np.nonzero(idx_p >= 0)):
        want[b, idx_p[b, t, k]] += dsp[b, t, k].reshape(-1) @ np.concatenate([q[b, t], do[b, t]])
    assert got.shape == want.shape
    assert_close(got, want, jnp.float32, factor=10, what="dkv")
    jax.clear_caches()


def test_dkv_blocks_fits_bounds_bytes():
    """The per-slot path takes over where posg would pass 2 GiB."""
    from csa_jax.kernels.gluon import dkv_blocks
    assert dkv_blocks.fits(1, 16384, 20480)                  # Pro cr4: 1.34 GB
    assert not dkv_blocks.fits(1, 32768, 40960)              # 5.4 GB of posg
    assert dkv_blocks.fits(1, 2 ** 22, 128)                  # 2 GiB of posg
    assert not dkv_blocks.fits(1, 2 ** 22 + 1, 128)
    assert dkv_blocks.fits(1, 2 ** 20, 128)


def test_dkv_blocks_maps_reference():
    """The maps kernels' XLA twins (the GPU check compares the kernels against them): flag,
    posg by token and slot, dup on a repeated row, lists in token order and counts."""
    from csa_jax.kernels.gluon import dkv_blocks
    idx = jnp.asarray([[3, 200, -1, 5], [7, 7, 1, -1]], jnp.int32)     # B = 1, T = 2
    flag, posg, dup = dkv_blocks.maps_token_reference(idx, 2, 3)
    assert dup.tolist() == [0, 1] and flag.tolist() == [[1, 1, 0], [1, 0, 0]]
    flag, posg, dup = dkv_blocks.maps_token_reference(idx.at[1, 1].set(8), 2, 3)
    assert dup.tolist() == [0, 0]
    assert posg[1, 0, 200 - 128] == 1 and posg[0, 1, 8] == 1 and posg[0, 0, 5] == 3
    assert posg[0, 0, 4] == -1 and (posg[1, 1] == -1).all()
    lists, cnt = dkv_blocks.maps_block_reference(flag, 2)
    assert cnt.tolist() == [2, 1, 0] and lists[0].tolist() == [0, 1] and lists[1, 0] == 0


@pytest.mark.parametrize("H,D", [(16, 512), (8, 512), (32, 512), (24, 512), (16, 128),
                                 (5, 128)])
def test_dkv_blocks_kernel_compiles_sm90(H, D):
    """The block dkv kernel: 12 warps, inside shared memory, no spills, its products
    m64n(min(256, D))k16; A's posg read once per 16-byte vector where 2 H is a multiple of 8
    (H = 5: once per element)."""
    from csa_jax.kernels.gluon import dkv_blocks
    c = adapter.compile_kernel(
        dkv_blocks.csa_dkv_blocks_kernel, dkv_blocks.arg_types(),
        dkv_blocks.constexprs(T=64, NB=10, B=2, H=H, Kp=1152, DP=D), target="sm_90a",
        num_warps=dkv_blocks.NUM_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None and r["num_warps"] == 12, r
    assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0, r
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", c.asm["ptx"]))
    assert shapes == {str(min(256, D))}, shapes
    loads = len(re.findall(r"ld\.global", c.asm["ptx"]))
    assert (loads <= 64) == (H % 4 == 0), loads


def test_dkv_maps_kernels_compile_sm90():
    """The two maps kernels at Pro cr4's shapes: no spills; the token kernel's phases ordered
    by barriers and its slots placed by atomic exchange; the block kernel's scan."""
    from csa_jax.kernels.gluon import dkv_blocks as d
    for kernel, types, consts in (
            (d.csa_dkv_maps_token_kernel, d.MAPS_TOKEN_ARG_TYPES,
             d.maps_token_constexprs(T=16384, Kp=1152, NB=160)),
            (d.csa_dkv_maps_block_kernel, d.MAPS_BLOCK_ARG_TYPES,
             d.maps_block_constexprs(T=16384, NB=160))):
        c = adapter.compile_kernel(kernel, list(types), consts, target="sm_90a",
                                   num_warps=d.MAPS_WARPS.value)
        r = adapter.resources(c, "sm_90a")
        assert r["launch_problem"] is None and r.get("spill_stores", 0) == 0, r
        ptx = c.asm["ptx"]
        if kernel is d.csa_dkv_maps_token_kernel:
            assert "atom.global" in ptx and "exch" in ptx and ptx.count("bar.sync") >= 3
        else:
            assert "shfl.sync" in ptx                                  # the scan


@pytest.mark.parametrize("HN,H,D", [(16, 16, 512), (32, 32, 512), (16, 8, 512), (32, 24, 512),
                                    (16, 16, 128)])
def test_small_heads_dq_kernel_compiles_sm90(HN, H, D):
    """The few-heads dq kernel at its default rings (3 stages at HN = 16, 2 at 32 for D = 512):
    inside shared memory (the estimate within 1 KiB), no spills, [S^T | dP^T] as one
    m64n(2 HN) wgmma and dq^T as m64n(HN), no layout conversion through shared memory."""
    from csa_jax.kernels.gluon import small_heads_dq
    from csa_jax.kernels.gluon.dims import small_heads_shared_bytes, small_heads_stages
    cfg = gluon.default_config((1, 64, H, D), None, None, jnp.bfloat16)
    stages = small_heads_stages(D, HN, planes=2)
    assert (cfg.bwd, cfg.bwd_block_k, cfg.bwd_stages) == ("gluon", 64, stages)
    if D == 512:
        assert stages == {16: 3, 32: 2}[HN]
    c = adapter.compile_kernel(
        small_heads_dq.csa_dq_small_heads_kernel, small_heads_dq.arg_types(),
        small_heads_dq.constexprs(T=64, N=300, HN=HN, D=D, K=1152, stages=stages,
                                  scale=D ** -0.5, H=H),
        target="sm_90a", num_warps=small_heads_dq.NUM_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None, r
    est = small_heads_shared_bytes(D, HN, stages, planes=2)
    assert est <= r["shared"] <= min(est + 1024, adapter.SHARED_LIMIT["sm_90a"]), (r, est)
    assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0, r
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", c.asm["ptx"]))
    assert shapes == {str(2 * HN), str(HN)}, shapes
    assert "convert_layout" not in c.asm["ttgir"]


def test_small_heads_dq_tiles_are_checked_by_name():
    """bwd_block_k / bwd_stages the few-heads dq kernel cannot take are refused naming them."""
    from csa_jax.kernels.gluon.config import Config
    with pytest.raises(ValueError, match="bwd_block_k=32: the few-heads dq kernel"):
        gluon._check_small_heads((1, 4, 16, 512), 16, Config(bwd_block_k=32), dq=True)
    with pytest.raises(ValueError, match="bwd_stages=4: the few-heads dq kernel at D=512"):
        gluon._check_small_heads((1, 4, 16, 512), 16, Config(bwd_block_k=64, bwd_stages=4),
                                 dq=True)
