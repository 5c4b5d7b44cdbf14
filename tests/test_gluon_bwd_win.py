"""The cr0 window backward (Config.bwd_win, csa_jax/kernels/gluon/bwd_win.py) without a GPU.

- the window dq kernel compiles for sm_90a (CPU compile, bundled ptxas): launchable, inside the
  H200's shared memory as dims.dq_win_shared_bytes counts it, no spills, the wgmma shapes meant;
- the host wrapper (canonical window dsp, the dkv path on the canonical index list, dsink, the
  fused delta's dlse - delta, NaN for a traced idx that breaks the promise) against the float64
  dense oracle, the kernel replaced by a jnp emulation of its contract (Gluon has no
  interpreter; the kernel itself is checked on the H200 by benchmarks/gluon_bwd_win_check.py);
- the Config checks, the concrete-idx check and the AMD refusal.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, dense_oracle

pytest.importorskip("triton.experimental.gluon")

from csa_jax.kernels import gluon  # noqa: E402
from csa_jax.kernels.gluon import adapter, bwd_win, dims  # noqa: E402
from test_gluon_bwd import _emulated_reduce_kernel  # noqa: E402


@pytest.mark.parametrize("qdo,fuse,overlap,mm,blk", [
    (True, 1, True, False, False), (False, 0, True, False, False), (True, 2, True, True, True),
    (True, 1, False, False, False)])
def test_window_dq_kernel_compiles_sm90(qdo, fuse, overlap, mm, blk):
    consts = bwd_win.constexprs(T=4096, N=4096, NH2=4, D=512, window=128, G=33,
                                scale=512 ** -0.5, producer_regs=56, qdo=qdo, fuse_delta=fuse,
                                overlap=overlap, dq_mm=mm, dsp_block=blk)
    c = adapter.compile_kernel(bwd_win.csa_dq_win_kernel, bwd_win.arg_types("bf16"), consts,
                               target="sm_90a", num_warps=bwd_win.CONSUMER_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["launch_problem"] is None and r.get("spill_stores", 0) == 0, r
    est = dims.dq_win_shared_bytes(512, 128)
    assert est == 222_240 and 0 <= r["shared"] - est <= 1024, r     # + compiler scratch
    ptx = c.asm["ptx"]
    # scores: N = 128 / 16 split over the warpgroups (n64, n8); dq^T: n32 (32 heads)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)) == {
        "64", "8", "32"}
    # dq: 64 bf16 per thread, 2-byte stores, or (movmatrix) 32 4-byte stores after 32 movmatrix
    assert ptx.count("movmatrix") == (32 if mm else 0)
    # dsp: 36 shifted 2-byte stores, or ("block") win_a's 32 in 16 4-byte stores + win_b's 4
    assert ptx.count("st.global.b16") == (4 if blk else 36) + (0 if mm else 64)
    assert ptx.count("st.global.b32") == 4 * fuse // max(fuse, 1) + 32 * mm + 16 * blk


def _emulated_win_kernel(q, do, kv, lse, dc, o, *, kernel, out_shape, grid, num_warps, name,
                         T, N, NH2, D, W, G, QK_SCALE, SCALE, PRODUCER_REGS, QDO, FUSE,
                         ABLATE, OVERLAP, DQ_MM, DSP_BLOCK):
    assert ABLATE == 0 and OVERLAP in (True, False) and DQ_MM in (True, False)
    """What csa_dq_win_kernel computes, in jnp: per token its window rows t - W + 1 + j."""
    assert kernel is bwd_win.csa_dq_win_kernel
    Hp = NH2 * bwd_win.HEADS
    B = q.shape[0] // (T * Hp)
    assert grid == (B * G * NH2,)
    rows = bwd_win.slot_rows(T, W, "block" if DSP_BLOCK else "canonical")        # [T, W]
    valid = rows >= 0
    kvg = kv.reshape(B, N, D)[:, jnp.where(valid, rows, 0)] * valid[None, :, :, None]
    qh, doh, oh = (x.reshape(B, T, Hp, D) for x in (q, do, o))
    lse, dc = lse.reshape(B, T, Hp), dc.reshape(B, T, Hp)
    if FUSE:
        dc = dc - jnp.sum(oh * doh, axis=-1)
    s = jnp.einsum("bthd,btjd->bthj", qh, kvg) * SCALE
    p = jnp.where(valid[None, :, None, :], jnp.exp(s - lse[..., None]), 0.0)
    ds = p * (jnp.einsum("bthd,btjd->bthj", doh, kvg) + dc[..., None])
    dq = SCALE * jnp.einsum("bthj,btjd->bthd", ds, kvg)
    nhb = Hp // 64
    if QDO:
        blk = lambda x: x.reshape(B * T, nhb, 64, x.shape[-1])
        dsp = jnp.stack([blk(ds * SCALE), blk(p)], axis=2)
        qdo = jnp.stack([blk(qh), blk(doh)], axis=2)
    else:
        dsp = jnp.stack([(ds * SCALE).reshape(B * T, Hp, W), p.reshape(B * T, Hp, W)], axis=1)
        qdo = jnp.zeros((8,))
    dcout = dc.reshape(-1) if FUSE else jnp.zeros((8,))
    outs = (dq.reshape(B * T * Hp, D), dsp, qdo, dcout)
    for x, sd in zip(outs, out_shape):
        assert x.shape == sd.shape, (x.shape, sd.shape)
    return tuple(x.astype(sd.dtype) for x, sd in zip(outs, out_shape))


def _emulated_call(*args, kernel, **kw):
    f = _emulated_win_kernel if kernel is bwd_win.csa_dq_win_kernel else _emulated_reduce_kernel
    return f(*args, kernel=kernel, **kw)


def _cr0_problem(rng, B, T, H, D, W, K):
    """q, kv, a cr0 idx (window slots shuffled per token, -1 past the window), sink, dO, dlse."""
    from csa_jax.indices import window_indices
    win = np.asarray(window_indices(T, W))
    idx = np.full((B, T, K), -1, np.int32)
    for b in range(B):
        for t in range(T):
            idx[b, t, :W] = rng.permutation(win[t])
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return f(B, T, H, D), f(B, T + 3, D), jnp.asarray(idx), f(H), f(B, T, H, D), f(B, T, H)


@pytest.mark.parametrize("H,D,qdo,fuse,dsp", [(70, 24, True, "global", "canonical"),
                                              (20, 40, False, None, "block")])
def test_window_wrapper_against_dense_oracle(rng, monkeypatch, H, D, qdo, fuse, dsp):
    """bwd_win.backward with the kernel emulated: dq, dkv (the dkv path on the canonical window
    index list, whatever order idx holds the window in), dsink against the oracle on idx; a
    traced idx with a broken token gives NaN for its dq and finite dq elsewhere."""
    monkeypatch.setattr(adapter, "gluon_call", _emulated_call)
    B, T, W = 2, 75, 64
    q, kv, idx, sink, do, dlse = _cr0_problem(rng, B, T, H, D, W, W + 3)
    scale = 0.7 * D ** -0.5
    o, lse = (jnp.asarray(x, jnp.float32) for x in dense_oracle(q, kv, idx, sink, scale))
    cfg = gluon.Config(layout="cr0", window=W, bwd_win=True, bwd_qdo=qdo,
                       bwd_fuse_delta=fuse is not None, bwd_win_delta=fuse or "global",
                       bwd_reduce="gluon", bwd_win_dsp=dsp)
    f = jax.jit(lambda idx: bwd_win.checked_backward(q, kv, idx, sink, o, lse, do, dlse,
                                                     scale=scale, config=cfg))
    dq, dkv, dsink = f(idx)
    _, _, rdq, rdkv, rdsink = dense_oracle(q, kv, idx, sink, scale, do, dlse)
    for what, got, want in (("dq", dq, rdq), ("dkv", dkv, rdkv), ("dsink", dsink, rdsink)):
        assert_close(got, want, jnp.float32, factor=10, what=what)
    bad = idx.at[1, 70, 0].set(0)            # token 70's window is rows 7..70: row 0 breaks it
    dq_bad = np.asarray(f(bad)[0])
    assert np.isnan(dq_bad[1, 70]).all() and np.isfinite(dq_bad[1, :70]).all()
    with pytest.raises(ValueError, match=r"idx\[1, 70\]"):       # concrete idx: checked
        bwd_win.checked_backward(q, kv, bad, sink, o, lse, do, dlse, scale=scale, config=cfg)
    jax.clear_caches()          # the emulated kernel must not stay in the jit caches


def test_bwd_win_config_and_refusals():
    ok = gluon.Config(layout="cr0", bwd_win=True)
    assert ok.bwd_win and not gluon.Config().bwd_win            # off by default
    for kw, msg in ((dict(bwd_win=True), "needs layout='cr0'"),
                    (dict(layout="cr128", bwd_win=True), "cr128's pool slots"),
                    (dict(layout="cr0", bwd_win=1), "must be a bool"),
                    (dict(layout="cr0", bwd_win=True, bwd_interm="gluon"), "bwd_interm='xla'"),
                    (dict(layout="cr0", bwd_win=True, bwd_ablate=1), "bwd_ablate"),
                    (dict(bwd_win_producer_regs=50), "bwd_win_producer_regs=50"),
                    (dict(bwd_win_ablate=1), "bwd_win=True only"),
                    (dict(bwd_win_delta="x"), "bwd_win_delta='x'"),
                    (dict(bwd_win_overlap=1), "bwd_win_overlap=1"),
                    (dict(bwd_win_dq_movmatrix=1), "bwd_win_dq_movmatrix=1"),
                    (dict(bwd_win_dsp="x"), "bwd_win_dsp='x'"),
                    (dict(layout="cr0", bwd_win=True, bwd_win_ablate=4), "bwd_win_ablate=4")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            gluon.Config(**kw)
    z = jnp.zeros((1, 16, 64, 512), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="gfx950"):
        bwd_win.checked_backward(z, z[:, :, 0], jnp.zeros((1, 16, 128), jnp.int32),
                                 jnp.zeros(64), z, z[..., 0], z, z[..., 0], scale=0.1,
                                 config=ok, amd="gfx950")


def test_slot_orders_hold_the_same_window():
    """bwd_win.slot_rows: the "block" order holds each token's window rows, once each, as the
    canonical order does (a partial last block and tokens with rows < 0 included)."""
    from csa_jax.indices import window_indices
    T, W = 75, 64
    canon = np.asarray(bwd_win.slot_rows(T, W, "canonical"))
    block = np.asarray(bwd_win.slot_rows(T, W, "block"))
    assert (canon == np.asarray(window_indices(T, W))).all()
    for t in range(T):
        assert sorted(block[t]) == sorted(canon[t]), t
        assert block[t][t % 16] == t                     # slot i of token t0 + i: row t itself
