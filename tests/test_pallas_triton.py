"""The Triton-dialect impl ("pallas_triton") in interpret mode on CPU: the contract
(tests/contract.py) with small tiles, and what is specific to it: the two per-slot intermediate
paths and both dq score forms on a structured list, its config rules, the dq kernel's dS/P buffer,
and an ahead-of-time lowering to Triton IR for an NVIDIA (H200) and an AMD (gfx942) target
whose ops are checked kernel by kernel (no GPU needed)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import triton as pltriton

import csa_jax
from benchmarks import triton_ir
from csa_jax import blockmath
from csa_jax.kernels import triton as pallas_triton
from csa_jax.kernels.triton import testing as tt
from conftest import assert_close, dense_oracle, random_problem
from contract import ImplContract, value_and_grads

# Small tiles so that the tiny problems below still walk several tiles and head blocks.
SMALL = pallas_triton.Config(block_k=16, block_h=16, block_k_dq=16, block_h_dq=16, block_r=4,
                             num_stages=2, slot_major_dq=False)


class TestContract(ImplContract):
    IMPL = "pallas_triton"
    CONFIG = SMALL


@pytest.mark.parametrize("interm,slot_major", [("gemm", False), ("gemm", True), ("dq", True)])
def test_structured_layout_matches_reference(rng, interm, slot_major):
    """A window + causal pool list (the shape the benchmark runs) against the XLA impl, with the
    per-slot intermediate from the GEMM path and from the dq kernel itself ("dq"); slot_major:
    the dq kernel's scores formed as (rows q^T)^T (slot_major_dq, NVIDIA's default)."""
    T, P, H, D = 48, 12, 16, 32
    idx = jnp.broadcast_to(csa_jax.build_indices(T, 4, window=16,
                                                 pool_topk=csa_jax.pool_indices(T, 4)), (1, T, 28))
    q = jnp.asarray(rng.standard_normal((1, T, H, D)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, T + P, D)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.zeros(q.shape[:3], jnp.float32)
    cfg = dataclasses.replace(SMALL, interm=interm, slot_major_dq=slot_major)
    o, lse, grads = value_and_grads(q, kv, idx, sink, do, dlse, scale=D ** -0.5,
                                    impl="pallas_triton", interpret=True, config=cfg)

    def loss(q, kv, sink):
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, impl="xla")
        return jnp.sum(o.astype(jnp.float32) * do), (o, lse)

    ref_grads, (o_x, lse_x) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, kv, sink)
    assert_close(o, o_x, jnp.bfloat16, what="o")
    assert_close(lse, lse_x, jnp.bfloat16, what="lse")
    for name, got, ref in zip(("dq", "dkv", "dsink"), grads, ref_grads):
        assert_close(got, ref, jnp.bfloat16, factor=2.0, what=name)


def test_config_validation_and_defaults():
    with pytest.raises(ValueError, match="block_k=48"):
        pallas_triton.Config(block_k=48)
    with pytest.raises(ValueError, match="block_h=8"):
        pallas_triton.Config(block_h=8)
    with pytest.raises(ValueError, match="num_warps=3"):
        pallas_triton.Config(num_warps=3)
    with pytest.raises(ValueError, match="num_stages=0"):
        pallas_triton.Config(num_stages=0)
    with pytest.raises(ValueError, match="num_warps_reduce=3"):
        pallas_triton.Config(num_warps_reduce=3)
    with pytest.raises(ValueError, match="block_r=24"):
        pallas_triton.Config(block_r=24)
    for bad in ("scatter", "kernel"):     # "kernel": the removed interm kernel
        with pytest.raises(ValueError, match=f"interm='{bad}'"):
            pallas_triton.Config(interm=bad)
    for gone in ("block_k_dkv", "dkv_split_d", "slot_major", "qdo", "dq_delta", "narrow_keys",
                 "interm_f32"):
        with pytest.raises(TypeError, match=gone):
            pallas_triton.Config(**{gone: 1})
    with pytest.raises(ValueError, match=r"interm='dq' needs all heads in one dq program: H=32"):
        q, kv, idx, sink = random_problem(np.random.default_rng(0), B=1, T=4, H=32, D=16, K=16)
        lse = jnp.zeros(q.shape[:3], jnp.float32)
        pallas_triton.backward(q, kv, jnp.maximum(idx, -1), sink, q, lse, q, lse, scale=0.25,
                               interpret=True, config=dataclasses.replace(SMALL, interm="dq"))
    with pytest.raises(ValueError, match="slot_major_dq=1"):
        pallas_triton.Config(slot_major_dq=1)
    with pytest.raises(ValueError, match="reduce_split=24"):
        pallas_triton.Config(reduce_split=24)
    with pytest.raises(ValueError, match="reduce_split=-4"):
        pallas_triton.Config(reduce_split=-4)
    cfg = pallas_triton.default_config((1, 4096, 128, 512), (1, 5120, 512), (1, 4096, 1152),
                                       jnp.bfloat16)
    assert cfg.block_k <= 64 and cfg.num_stages >= 2 and cfg.block_h <= 64
    tiny = pallas_triton.default_config((2, 40, 4, 128), (2, 50, 128), (2, 40, 20), jnp.float32)
    assert tiny.block_k == 32 and tiny.block_h == 16      # K = 20 -> one tile of 32 slots
    # small's layers (H = 16): 4 forward warps, 64-slot dq tiles, interm="dq",
    # 64-entry reduce steps; the reduce split only where
    # every pool row is in every list (cr128: P = 64 <= K = 192; cr4: P = 2048 > K = 640)
    bf = jnp.bfloat16
    cr128 = pallas_triton.default_config((1, 8192, 16, 128), (1, 8256, 128), (1, 8192, 192), bf)
    cr4 = pallas_triton.default_config((1, 8192, 16, 128), (1, 10240, 128), (1, 8192, 640), bf)
    cr0 = pallas_triton.default_config((1, 8192, 16, 128), (1, 8192, 128), (1, 8192, 128), bf)
    knobs = lambda c: (c.num_warps, c.block_k_dq, c.reduce_split, c.interm, c.block_r)  # noqa
    assert knobs(cr128) == (4, 64, 128, "dq", 64)
    assert knobs(cr4) == (4, 64, 0, "dq", 64)
    assert cr0.reduce_split == 0
    # Pro cr4 at T = 4096 (H = 128, D = 512): the V4 defaults; hot rows (P = 1024 <= K = 1152)
    # but D = 512, where the split is not measured
    assert knobs(cfg) == (8, 32, 0, "gemm", 32)


# ----------------------------------------------------------------------------- lowering

# Per kernel: the tt.dot ops of its tile loop (all of them sit inside the loop).
KERNEL_DOTS = {"csa_triton_fwd": 2,          # q rows^T, p rows
               "csa_triton_dq": 3,           # q rows^T, dO rows^T, ds rows
               "csa_triton_dkv_reduce": 0}   # a gather-sum, no products


def _lower(fn, args, kind, platform):
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    mesh = AbstractMesh((1,), ("x",),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=None,
                                                       platform=platform))
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _ir_problems(kernels, want):
    """What is wrong with lowered kernels ({name: triton_ir.OpCounts}) against the expected
    set of kernels and KERNEL_DOTS: [] when every kernel has its products in its tile loop and
    gathers (tt.load) there."""
    bad = [f"kernels {sorted(kernels)} != {sorted(want)}"] if set(kernels) != set(want) else []
    for name, ops in kernels.items():
        dots = KERNEL_DOTS.get(name)
        if ops.total["tt.dot"] != dots or ops.in_loop["tt.dot"] != dots:
            bad.append(f"{name}: {ops.total['tt.dot']} tt.dot ({ops.in_loop['tt.dot']} in a "
                       f"loop), expected {dots}")
        if not ops.in_loop["tt.load"] or not ops.total["tt.store"]:
            bad.append(f"{name}: no tt.load in its loop or no tt.store")
    return bad


# pytest resets warning filters per test, so the module's own filter does not apply here.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind,platform", [("NVIDIA H200", "cuda"), ("gfx942", "rocm")])
def test_lowers_to_triton_ir(kind, platform):
    """Forward and backward lower to Triton IR for a GPU target without any GPU (AOT), and the
    IR of every kernel holds its products (tt.dot) inside its tile loop, gathers and stores."""
    S = jax.ShapeDtypeStruct
    B, T, H, D, P, K = 1, 64, 128, 512, 16, 80
    q, kv = S((B, T, H, D), jnp.bfloat16), S((B, T + P, D), jnp.bfloat16)
    idx, sink, lse = S((B, T, K), jnp.int32), S((H,), jnp.float32), S((B, T, H), jnp.float32)
    # both dq score forms (slot-major: NVIDIA's default, head-major: AMD's)
    for cfg in (pallas_triton.Config(num_stages=2),
                pallas_triton.Config(num_stages=2, slot_major_dq=False)):
        want = ("csa_triton_fwd", "csa_triton_dq", "csa_triton_dkv_reduce")
        fwd = lambda *a, c=cfg: pallas_triton.forward(*a, scale=0.05, interpret=False, config=c)
        bwd = lambda *a, c=cfg: pallas_triton.backward(*a, scale=0.05, interpret=False, config=c)
        kernels = {**triton_ir.kernel_ops(_lower(fwd, (q, kv, idx, sink), kind, platform)),
                   **triton_ir.kernel_ops(_lower(bwd, (q, kv, idx, sink, q, lse, q, lse), kind,
                                                 platform))}
        assert _ir_problems(kernels, want) == [], (cfg, kernels)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_fused_interm_lowers_with_its_products_in_the_loop():
    """interm="dq" at small's widths (H = 16, D = 128) lowers for the H200 to two kernels: the dq
    kernel with all five products in its tile loop (its own q rows^T, dO rows^T, ds rows, and
    the intermediate's ds^T q, p^T dO) and the reduce; no per-slot GEMM outside them."""
    S = jax.ShapeDtypeStruct
    q, kv = S((1, 64, 16, 128), jnp.bfloat16), S((1, 80, 128), jnp.bfloat16)
    idx, sink, lse = S((1, 64, 640), jnp.int32), S((16,), jnp.float32), S((1, 64, 16), jnp.float32)
    cfg = pallas_triton.Config(block_k_dq=64, block_h_dq=16, block_h=16, num_stages=2,
                               interm="dq")
    bwd = lambda *a: pallas_triton.backward(*a, scale=0.05, interpret=False, config=cfg)
    text = _lower(bwd, (q, kv, idx, sink, q, lse, q, lse), "NVIDIA H200", "cuda")
    kernels = triton_ir.kernel_ops(text)
    assert set(kernels) == {"csa_triton_dq", "csa_triton_dkv_reduce"}, sorted(kernels)
    dq = kernels["csa_triton_dq"]
    assert dq.total["tt.dot"] == dq.in_loop["tt.dot"] == 5, dq.total
    assert "stablehlo.dot_general" not in text      # the GEMM path's per-slot product is gone


def _fwd_without_pv(ntiles_ref, idx_ref, q_ref, kv_ref, sink_ref, o_ref, lse_ref, *, scale, bk,
                    precision):
    """The forward kernel with its p @ rows product left out: lowers fine, computes nonsense."""
    q = q_ref[...]

    def body(i, carry):
        m, l, acc = carry
        rows, valid = tt.gather_tile(idx_ref, kv_ref, i * bk, bk)
        s = pltriton.dot(q, rows, trans_b=True, precision=precision) * scale
        m, l, _, alpha = blockmath.softmax_update(m, l, s, valid[None, :])
        return m, l, alpha * acc

    m, l, acc = lax.fori_loop(0, ntiles_ref[...], body, blockmath.init_state(q.shape[:1],
                                                                             q.shape[1]))
    tt.fwd_store(o_ref, lse_ref, sink_ref, m, l, acc)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_lowering_and_oracle_checks_catch_a_broken_kernel(rng):
    """The two checks above can fail: a forward without its PV product is flagged by the IR
    check, and its output does not match the oracle in interpret mode."""
    S = jax.ShapeDtypeStruct
    args = (S((1, 16, 16, 32), jnp.bfloat16), S((1, 20, 32), jnp.bfloat16),
            S((1, 16, 24), jnp.int32), S((16,), jnp.float32))
    broken = lambda *a: tt.forward_with_kernel(*a, scale=0.1, interpret=False, config=SMALL,
                                               kernel=_fwd_without_pv)
    kernels = triton_ir.kernel_ops(_lower(broken, args, "NVIDIA H200", "cuda"))
    assert _ir_problems(kernels, ["csa_triton_fwd"]) == [
        "csa_triton_fwd: 1 tt.dot (1 in a loop), expected 2"]
    q, kv, idx, sink = random_problem(rng, B=1, T=6, H=4, D=16, K=8)
    o, _ = tt.forward_with_kernel(q, kv, jnp.maximum(idx, -1), sink, scale=0.25, interpret=True,
                                  config=SMALL, kernel=_fwd_without_pv)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(o, dense_oracle(q, kv, idx, sink, 0.25)[0], jnp.float32, what="o")


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


@pytest.mark.parametrize("split", [8, 16])
def test_reduce_split_sums_hot_rows_exactly_once(rng, split):
    """config.reduce_split: a hot row (every token's slot 0, as a cr128 pool row) is summed over
    several chunk programs and then its partials: the same dkv as the f64 sum of each row's
    entries, as one program per row (to f32 rounding), bit-identical run to run; a row with no
    entry is exactly 0."""
    T, K, N, D = 40, 6, 40, 16
    idx = rng.integers(-1, N - 2, (1, T, K)).astype(np.int32)     # rows N-2, N-1 get nothing
    idx[0, :, 0] = 3                                                # hot row: T entries
    idx[0, ::2, 1] = 5                                              # warm row: T / 2 entries
    cfg = dataclasses.replace(SMALL, reduce_split=split)
    q = jnp.zeros((1, T, 16, D), jnp.float32)
    d = tt.dims(q, jnp.zeros((1, N, D), jnp.float32), jnp.asarray(idx), cfg)
    idx_p, _ = tt.prep_idx(jnp.asarray(idx), d)
    interm = rng.standard_normal((1, T, d.Kp, d.Dp)).astype(np.float32)
    offsets, perm = tt.inverse_map(idx_p, N)
    want = np.zeros((N, d.Dp))
    ip = np.asarray(idx_p)[0]
    for t in range(T):
        for j in range(d.Kp):
            if ip[t, j] >= 0:
                want[ip[t, j]] += interm[0, t, j]
    run = lambda c: np.asarray(jax.jit(lambda o, p, x: tt.reduce_rows(
        d, c, True, o, p, x, jnp.float32))(offsets, perm, jnp.asarray(interm)))[0]
    got, again, one = run(cfg), run(cfg), run(SMALL)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got, again)
    assert np.all(got[N - 2:] == 0.0)
    assert (np.asarray(offsets)[0, 3, 1] - np.asarray(offsets)[0, 3, 0]) > 2 * split


@pytest.mark.parametrize("split,interm", [(8, "gemm"), (0, "dq"), (8, "dq")])
def test_reduce_split_gradients_match_reference(rng, split, interm):
    """The whole op with reduce_split and/or the dq kernel's own per-slot intermediate
    (interm="dq") on a window + HCA list (pool row 0 seen by every later token, early tokens'
    tail tiles empty), both outputs' cotangents: gradients as the XLA impl's."""
    T, P, H, D = 64, 4, 16, 32
    idx = csa_jax.build_indices(T, 16, window=16)
    idx = jnp.broadcast_to(idx, (1,) + idx.shape[-2:])
    q = jnp.asarray(rng.standard_normal((1, T, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, T + P, D)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    cfg = dataclasses.replace(SMALL, reduce_split=split, interm=interm)
    _, _, grads = value_and_grads(q, kv, idx, sink, do, dlse, scale=D ** -0.5,
                                  impl="pallas_triton", interpret=True, config=cfg)
    _, _, ref = value_and_grads(q, kv, idx, sink, do, dlse, scale=D ** -0.5, impl="xla")
    for name, got, want in zip(("dq", "dkv", "dsink"), grads, ref):
        assert_close(got, want, jnp.float32, what=name)
