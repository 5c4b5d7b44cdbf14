"""The Triton-dialect impl ("pallas_triton") in interpret mode on CPU, against the golden cases and
the float64 dense oracle; plus its config rules and an ahead-of-time lowering to Triton IR for an
NVIDIA (H200) and an AMD (gfx942) target, which needs no GPU."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax.kernels import triton as pallas_triton
from csa_jax.kernels.triton import testing as tt
from csa_jax.common import EMPTY_LSE
from conftest import assert_close, dense_oracle, golden, random_problem

# Small tiles so that the tiny problems below still walk several tiles and head blocks.
SMALL = pallas_triton.Config(block_k=16, block_h=16, block_k_dq=16, block_h_dq=16, block_k_dkv=16,
                             block_h_dkv=16, block_r=4, num_stages=2, slot_major_dq=False)


def _run(q, kv, idx, sink, do, dlse, *, scale, config):
    """(o, lse) and the gradients of sum(o*do) + sum(lse*dlse) through the public op."""
    kw = dict(scale=scale, impl="pallas_triton", interpret=True, config=config)

    def loss(q, kv, sink):
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse * dlse), (o, lse)

    argnums = (0, 1, 2) if sink is not None else (0, 1)
    grads, (o, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, kv, sink)
    return o, lse, grads


@pytest.mark.parametrize("case", ["cr0", "cr4", "cr8"])
def test_golden(case):
    d = golden(case)
    q, kv, idx, sink = (jnp.asarray(d[k]) for k in ("q", "kv", "idx", "sink"))
    scale = float(d["scale"])
    do = jnp.asarray(d["dO"])
    o, lse, (dq, dkv, dsink) = _run(q, kv, idx, sink, do, jnp.zeros(q.shape[:3], jnp.float32),
                                    scale=scale, config=None)
    assert_close(o, d["o"], jnp.float32, what="o")
    assert_close(lse, dense_oracle(q, kv, idx, sink, scale)[1], jnp.float32, what="lse")
    for name, got in (("dq", dq), ("dkv", dkv), ("dsink", dsink)):
        assert_close(got, d[name], jnp.float32, what=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_sink", [True, False])
def test_against_dense_oracle(rng, dtype, with_sink):
    # with_sink=False also runs the slot-major score products (Config.slot_major*).
    # H = 20 pads to two head blocks of 16; K = 40 pads to three tiles of 16; D = 24 pads to 32.
    q, kv, idx, sink = random_problem(rng, T=10, H=20, D=24, K=40, dtype=dtype, sink=with_sink,
                                      empty_rows=2)
    scale = 0.7 * q.shape[-1] ** -0.5
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    cfg = SMALL if with_sink else dataclasses.replace(SMALL, slot_major=True, slot_major_dq=True)
    o, lse, grads = _run(q, kv, idx, sink, do, dlse, scale=scale, config=cfg)
    o_r, lse_r, dq_r, dkv_r, dsink_r = dense_oracle(q, kv, idx, sink, scale, do, dlse)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert_close(o, o_r, dtype, what="o")
    assert_close(lse, lse_r, dtype, what="lse")
    for name, got, ref in zip(("dq", "dkv", "dsink"), grads, (dq_r, dkv_r, dsink_r)):
        assert got.dtype == (jnp.float32 if name == "dsink" else dtype)
        assert_close(got, ref, dtype, factor=2.0, what=name)


@pytest.mark.parametrize("interm,split,slot_major", [("gemm", 1, False), ("kernel", 1, False),
                                                     ("kernel", 2, False), ("gemm", 1, True)])
def test_structured_layout_matches_reference(rng, interm, split, slot_major):
    """A window + causal pool list (the shape the benchmark runs) against the XLA impl, with the
    per-slot intermediate from the GEMM path and from the interm kernel (split=2: its
    accumulator's columns split over two programs); slot_major: the forward's and the dq
    kernel's scores formed as (rows q^T)^T."""
    T, P, H, D = 48, 12, 16, 32
    idx = jnp.broadcast_to(csa_jax.build_indices(T, 4, window=16,
                                                 pool_topk=csa_jax.pool_indices(T, 4)), (1, T, 28))
    q = jnp.asarray(rng.standard_normal((1, T, H, D)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, T + P, D)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.zeros(q.shape[:3], jnp.float32)
    cfg = dataclasses.replace(SMALL, dkv_split_d=split, interm=interm, slot_major=slot_major,
                              slot_major_dq=slot_major)
    o, lse, grads = _run(q, kv, idx, sink, do, dlse, scale=D ** -0.5, config=cfg)

    def loss(q, kv, sink):
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")
        return jnp.sum(o.astype(jnp.float32) * do), (o, lse)

    ref_grads, (o_x, lse_x) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, kv, sink)
    assert_close(o, o_x, jnp.bfloat16, what="o")
    assert_close(lse, lse_x, jnp.bfloat16, what="lse")
    for name, got, ref in zip(("dq", "dkv", "dsink"), grads, ref_grads):
        assert_close(got, ref, jnp.bfloat16, factor=2.0, what=name)


def test_empty_rows_and_determinism(rng):
    q, kv, idx, sink = random_problem(rng, T=8, H=4, D=16, K=20, dup_frac=0.5, empty_rows=0)
    idx = idx.at[0, 3].set(-1).at[1, 0].set(-1)
    o, lse, grads = _run(q, kv, idx, sink, jnp.ones(q.shape), jnp.ones(q.shape[:3]),
                         scale=0.25, config=SMALL)
    assert float(jnp.abs(o[0, 3]).max()) == 0.0 and float(jnp.abs(o[1, 0]).max()) == 0.0
    np.testing.assert_allclose(lse[0, 3], sink, rtol=1e-6)
    o2, lse2 = csa_jax.sparse_attention(q, kv, idx, None, impl="pallas_triton", interpret=True,
                                        config=SMALL)
    assert float(jnp.abs(o2[1, 0]).max()) == 0.0
    np.testing.assert_array_equal(np.asarray(lse2[1, 0]), np.full(4, EMPTY_LSE, np.float32))
    # dkv is built by a fixed-order gather-reduce: bit-identical run to run.
    _, _, grads2 = _run(q, kv, idx, sink, jnp.ones(q.shape), jnp.ones(q.shape[:3]),
                        scale=0.25, config=SMALL)
    np.testing.assert_array_equal(np.asarray(grads[1]), np.asarray(grads2[1]))


def test_config_validation_and_defaults():
    with pytest.raises(ValueError, match="block_k=48"):
        pallas_triton.Config(block_k=48)
    with pytest.raises(ValueError, match="block_h=8"):
        pallas_triton.Config(block_h=8)
    with pytest.raises(ValueError, match="num_warps=3"):
        pallas_triton.Config(num_warps=3)
    with pytest.raises(ValueError, match="num_stages=0"):
        pallas_triton.Config(num_stages=0)
    with pytest.raises(ValueError, match="dkv_split_d=3"):
        pallas_triton.Config(dkv_split_d=3)
    with pytest.raises(ValueError, match="interm='scatter'"):
        pallas_triton.Config(interm="scatter")
    with pytest.raises(ValueError, match="slot_major_dq=1"):
        pallas_triton.Config(slot_major_dq=1)
    cfg = pallas_triton.default_config((1, 4096, 128, 512), (1, 5120, 512), (1, 4096, 1152),
                                       jnp.bfloat16)
    assert cfg.block_k <= 64 and cfg.num_stages >= 2 and cfg.block_h <= 64
    tiny = pallas_triton.default_config((2, 40, 4, 128), (2, 50, 128), (2, 40, 20), jnp.float32)
    assert tiny.block_k == 32 and tiny.block_h == 16      # K = 20 -> one tile of 32 slots


# pytest resets warning filters per test, so the module's own filter does not apply here.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind,platform", [("NVIDIA H200", "cuda"), ("gfx942", "rocm")])
def test_lowers_to_triton_ir(kind, platform):
    """Forward and backward lower to Triton IR for a GPU target without any GPU (AOT)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    S = jax.ShapeDtypeStruct
    B, T, H, D, P, K = 1, 64, 128, 512, 16, 80
    q, kv = S((B, T, H, D), jnp.bfloat16), S((B, T + P, D), jnp.bfloat16)
    idx, sink, lse = S((B, T, K), jnp.int32), S((H,), jnp.float32), S((B, T, H), jnp.float32)
    mesh = AbstractMesh((1,), ("x",),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=None,
                                                       platform=platform))
    texts = []
    for cfg in (pallas_triton.Config(num_stages=2),
                pallas_triton.Config(num_stages=2, slot_major=True, slot_major_dq=True)):
        fwd = lambda *a, c=cfg: pallas_triton.forward(*a, scale=0.05, interpret=False, config=c)
        bwd = lambda *a, c=cfg: pallas_triton.backward(*a, scale=0.05, interpret=False, config=c)
        with use_abstract_mesh(mesh):
            texts += [jax.jit(fwd).trace(q, kv, idx, sink).lower(lowering_platforms=(platform,)),
                      jax.jit(bwd).trace(q, kv, idx, sink, q, lse, q, lse).lower(
                          lowering_platforms=(platform,))]
    for low in texts:
        assert "triton" in low.as_text().lower()


def test_gemm_path_buffer_is_exact_zero_past_last_tile(rng):
    """interm="gemm": the dq kernel's (scale * dS, P) buffer holds exact zeros at every empty slot,
    including whole tiles past a token's last non-empty one (which its loop never visits), so the
    batched GEMM never reads uninitialized memory."""
    q, kv, idx, sink = random_problem(rng, T=6, H=16, D=16, K=48, empty_rows=1)
    idx = idx.at[:, :, 20:].set(-1)                     # tiles 2 (slots 32..47) empty everywhere
    cfg = dataclasses.replace(SMALL, interm="gemm")
    d = tt.dims(q, kv, idx, cfg)
    idx_p, used = tt.prep_idx(idx, d)
    lse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)[..., None]
    _, dsp = tt.dq_call(d, cfg, 0.25, True, None, used, idx_p, q, q, lse, lse, lse, kv,
                          dsp_dtype=jnp.float32)
    empty = np.asarray(idx_p < 0)                                                  # [B, T, Kp]
    vals = np.asarray(dsp).transpose(0, 1, 4, 2, 3)[empty]                         # [n, 2, H]
    assert vals.size and np.all(vals == 0.0), "non-zero or NaN entries at empty slots"
    live = np.asarray(dsp).transpose(0, 1, 4, 2, 3)[~empty]
    assert np.isfinite(live).all() and np.abs(live[:, 1]).max() > 0      # P is not all zero
