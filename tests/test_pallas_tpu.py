"""impl="pallas_tpu": explicit-DMA TPU-dialect kernels, run on CPU in interpret mode.

Numeric cases use plain interpret mode (fast, no asynchrony); race-detection cases use
pltpu.InterpretParams(detect_races=True), which simulates every DMA and semaphore (~1 ms per
DMA), so they stay tiny.
"""
from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import csa_jax
from csa_jax import blockmath as bm
from csa_jax.kernels import tpu as pt
from csa_jax.kernels.tpu.forward import _forward_impl
from csa_jax.common import sanitize_indices
from conftest import assert_close, dense_oracle, golden, random_problem
from contract import ImplContract, check_against_oracle, value_and_grads


def _check_against_oracle(rng, q, kv, idx, sink, *, scale, config):
    """Values and gradients of both outputs (random cotangents) against the float64 oracle."""
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    return check_against_oracle(q, kv, idx, sink, do, dlse, scale=scale, grad_factor=1.0,
                                impl="pallas_tpu", config=config)


@contextlib.contextmanager
def _race_report():
    """Collects what the TPU interpreter prints; it prints 'RACE DETECTED' for every race."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield buf


RACES = pltpu.InterpretParams(detect_races=True)


class TestContract(ImplContract):
    IMPL = "pallas_tpu"
    CONFIG = pt.Config(block_t=4, block_k=8, depth=3, block_r=8)


# ----------------------------------------------------------------------------- config

def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="depth=5"):
        pt.Config(depth=5)
    with pytest.raises(ValueError, match="block_k=12"):
        pt.Config(block_k=12)
    with pytest.raises(ValueError, match="token_chunk=6"):
        pt.Config(block_t=4, token_chunk=6)
    with pytest.raises(ValueError, match="layout='diagonal'"):
        pt.Config(layout="diagonal")
    hash(pt.Config())


def test_default_config_rule():
    c = pt.default_config((1, 4096, 64, 512), (1, 4096 + 1024, 512), (1, 4096, 640), jnp.bfloat16)
    assert (c.block_k, c.block_t, c.depth) == (128, 8, 3)
    assert c.token_chunk is not None and c.token_chunk % c.block_t == 0
    assert c.token_chunk * 640 * 512 * 4 <= 1 << 30 < (c.token_chunk + 8) * 640 * 512 * 4
    c = pt.default_config((2, 5, 4, 32), (2, 9, 32), (2, 5, 3), jnp.float32)
    assert (c.block_k, c.block_t, c.depth, c.token_chunk) == (8, 5, 3, None)
    c = pt.default_config((1, 4096, 8, 512), (1, 4128, 512), (1, 4096, 160), jnp.bfloat16,
                          layout="cr128", window=128, pool_ratio=128)
    assert (c.layout, c.block_t, c.block_k, c.window) == ("cr128", 32, 128, 128)


# ----------------------------------------------------------------------------- numerics

def _golden_structured_idx(g, name):
    """The golden case's index sets in this project's [window | pool] layout (csa_spec.md s. 4),
    and the Config that promises that layout. Asserts the sets equal the golden ones."""
    T, w = int(g["T"]), int(g["window"])
    idx = np.asarray(g["idx"])
    win = np.asarray(csa_jax.window_indices(T, w))
    if name == "cr8":
        new = np.broadcast_to(np.asarray(csa_jax.build_indices(T, 8, window=w)),
                              idx.shape[:2] + (w + T // 8,))
        cfg = dict(layout="cr128", window=w, pool_ratio=8)
    else:
        pool = np.where(idx >= T, idx, -1)
        pool = -np.sort(-pool, axis=-1)[..., :int(g["topk_k"])]          # pool ids first
        new = np.concatenate([np.broadcast_to(win, idx.shape[:2] + (w,)), pool], -1)
        cfg = dict(layout="cr4", window=w)
    for b in range(idx.shape[0]):
        for t in range(T):
            assert sorted(idx[b, t][idx[b, t] >= 0]) == sorted(new[b, t][new[b, t] >= 0])
    return jnp.asarray(new, jnp.int32), cfg


@pytest.mark.parametrize("name", ["cr4", "cr8"])
def test_golden_structured(name):
    """The structured layout (window reuse, closed-form dkv) on the golden index sets, laid out
    as [window | pool] (cr0's structured path is covered by the fuzzed structured tests)."""
    g = golden(name)
    q, kv, sink = (jnp.asarray(g[k]) for k in ("q", "kv", "sink"))
    scale = float(g["scale"])
    sidx, lay = _golden_structured_idx(g, name)
    cfg = pt.Config(block_t=8, block_k=16, depth=3, block_r=16, **lay)
    o, lse = pt.forward(q, kv, sidx, sink, scale=scale, interpret=True, config=cfg)
    dq, dkv, dsink = pt.backward(q, kv, sidx, sink, o, lse, jnp.asarray(g["dO"]),
                                 jnp.zeros(lse.shape, jnp.float32), scale=scale,
                                 interpret=True, config=cfg)
    for got, key in ((o, "o"), (dq, "dq"), (dkv, "dkv"), (dsink, "dsink")):
        assert_close(got, g[key], jnp.float32, what=f"{name} {lay['layout']} {key}")


FUZZ_CONFIGS = [
    pt.Config(block_t=8, block_k=8, depth=2, block_r=8),
    pt.Config(block_t=4, block_k=8, depth=3, block_r=16, token_chunk=8, fanin_split=3),
    pt.Config(block_t=3, block_k=16, depth=4, block_r=8),
]


@pytest.mark.parametrize("config,dtype", [
    (FUZZ_CONFIGS[0], jnp.float32), (FUZZ_CONFIGS[1], jnp.float32),
    (FUZZ_CONFIGS[2], jnp.bfloat16),
], ids=["d2-f32", "d3-chunked-f32", "d4-explicitT-bf16"])
def test_fuzz_against_oracle(rng, config, dtype):
    """-1 anywhere, duplicates, out-of-range ids, all-empty rows; T and K not tile multiples."""
    q, kv, idx, sink = random_problem(rng, B=2, T=13, H=4, D=32, K=19, dtype=dtype,
                                      empty_rows=2)
    _check_against_oracle(rng, q, kv, idx, sink, scale=0.2, config=config)


def test_matches_xla_reference_medium(rng):
    """A medium plain-interpret case (cr128-style lists, several programs) against the XLA
    reference, through the generic layout and through the cr128 window-reuse layout."""
    T, w, ratio = 64, 16, 8
    idx = jnp.asarray(np.asarray(csa_jax.build_indices(T, ratio, window=w)))[None]
    idx = jnp.concatenate([idx, idx], 0)
    N = T + T // ratio
    q, kv, _, sink = random_problem(rng, B=2, T=T, H=4, D=64, N=N, K=idx.shape[-1])
    w_o = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def run(impl, config):
        def loss(q, kv, sink):
            o, _ = csa_jax.sparse_attention(q, kv, idx, sink, scale=0.125, impl=impl,
                                            config=config)
            return jnp.sum(o * w_o), o
        (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, kv, sink)
        return (o,) + g

    want = run("xla", None)
    for cfg in (pt.Config(block_t=8, block_k=8, depth=3, block_r=32),
                pt.Config(block_t=16, block_k=16, depth=2, layout="cr128", window=w,
                          pool_ratio=ratio)):
        for got, ref, what in zip(run("pallas_tpu", cfg), want, ("o", "dq", "dkv", "dsink")):
            assert_close(got, ref, jnp.float32, what=f"{cfg.layout} {what}")


def _structured_problem(rng, layout, *, T=29, w=12, ratio=8, topk=5, B=2, H=4, D=32,
                        dtype=jnp.float32):
    """A [window | pool] problem with the slots of each part shuffled per token (a structured
    layout promises sets, not slot order), plus the Config promising it."""
    win = np.broadcast_to(np.asarray(csa_jax.window_indices(T, w)), (B, T, w))
    if layout == "cr0":
        parts, n, extra = [win, -np.ones((B, T, 3), np.int32)], T, {}
    elif layout == "cr128":
        pool = np.asarray(csa_jax.pool_indices(T, ratio))
        pool = np.broadcast_to(np.where(pool >= 0, pool + T, -1), (B, T, T // ratio))
        parts, n, extra = [win, pool], T + T // ratio, dict(pool_ratio=ratio)
    else:
        P = T // 4
        pool = rng.integers(-1, P, size=(B, T, topk))
        pool[:, :, 1] = pool[:, :, 0]                                   # duplicate rows
        parts, n, extra = [win, np.where(pool >= 0, pool + T, -1)], T + P, {}
    parts = [rng.permuted(np.array(x), axis=-1) for x in parts]
    idx = jnp.asarray(np.concatenate(parts, -1), jnp.int32)
    q, kv, _, sink = random_problem(rng, B=B, T=T, H=H, D=D, N=n, K=idx.shape[-1], dtype=dtype)
    return q, kv, idx, sink, dict(layout=layout, window=w, **extra)


@pytest.mark.parametrize("layout,dtype", [
    ("cr0", jnp.float32), ("cr4", jnp.float32), ("cr128", jnp.float32), ("cr4", jnp.bfloat16),
    ("cr0", jnp.bfloat16), ("cr128", jnp.bfloat16),
], ids=["cr0-f32", "cr4-f32", "cr128-f32", "cr4-bf16", "cr0-bf16", "cr128-bf16"])
def test_structured_layouts_against_oracle(rng, layout, dtype):
    """Window reuse (contiguous union / pool tiles, closed-form dkv) matches the oracle."""
    q, kv, idx, sink, lay = _structured_problem(rng, layout, dtype=dtype)
    cfg = (pt.Config(block_t=8, block_k=8, depth=3, block_r=16, **lay) if dtype == jnp.float32
           else pt.Config(block_t=5, block_k=16, depth=2, token_chunk=10, **lay))
    _check_against_oracle(rng, q, kv, idx, sink, scale=0.2, config=cfg)


def test_tile_alignment_rules(rng):
    """Contiguous tiles start at multiples of the kv dtype's sublane tile (8 f32, 16 bf16):
    window tiles at the union's start rounded down, cr128's pool at row round_up(T, 16) of the
    kv operand; a structured bf16 layout with block_k = 8 is refused with the reason."""
    from csa_jax.kernels.tpu.plan import _make_plan, kv_operand, win_start
    cfg = pt.Config(block_t=8, block_k=16, layout="cr128", window=12, pool_ratio=8)
    plan = _make_plan((1, 29, 4, 32), 29 + 3, 12 + 3, cfg, jnp.bfloat16)
    assert (plan.align, plan.pool_base, plan.rows_ring) == (16, 32, False)
    assert [win_start(8 * i, plan) for i in range(7)] == [0, 0, 0, 0, 16, 16, 32]   # max(8i - 11, 0)
    kv = jnp.arange(32 * 32, dtype=jnp.float32).reshape(1, 32, 32).astype(jnp.bfloat16)
    kp = kv_operand(kv, plan)
    assert kp.shape[1] == plan.n_pad and plan.n_pad % 16 == 0
    np.testing.assert_array_equal(np.asarray(kp[0, 32:35]), np.asarray(kv[0, 29:32]))
    np.testing.assert_array_equal(np.asarray(kp[0, 29:32], np.float32), 0)
    g = _make_plan((1, 29, 4, 32), 40, 20, pt.Config(block_k=8), jnp.bfloat16)
    assert (g.align, g.rows_ring, kv_operand(kv, g).ndim) == (1, True, 4)
    with pytest.raises(ValueError, match="block_k=8 to be a multiple of 16"):
        _make_plan((1, 29, 4, 32), 29, 12, pt.Config(block_k=8, layout="cr0", window=12),
                   jnp.bfloat16)


def test_check_layout_rejects_broken_promises(rng):
    q, kv, idx, sink, lay = _structured_problem(rng, "cr128", B=1)
    pt.check_layout(idx, kv.shape[1], pt.Config(**lay))
    bad = idx.at[0, 17, 3].set(-1)                     # a window row missing
    with pytest.raises(ValueError, match=r"idx\[0, 17, 0:12\]"):
        pt.forward(q, kv, bad, sink, scale=0.2, interpret=True, config=pt.Config(**lay))
    with pytest.raises(ValueError, match="layout='cr0'.*nothing after the window"):
        pt.check_layout(idx, kv.shape[1], pt.Config(layout="cr0", window=12))
    with pytest.raises(ValueError, match="visible pool"):
        pt.check_layout(idx.at[0, 28, 13].set(-1), kv.shape[1], pt.Config(**lay))
    with pytest.raises(ValueError, match="K >= window"):
        pt.check_layout(idx[:, :, :5], kv.shape[1], pt.Config(layout="cr4", window=12))


def test_dma_counts(rng):
    """Generic: exactly one DMA per non-empty slot (empty slots are never fetched).
    Window reuse: one DMA per contiguous tile, far fewer per token."""
    q, kv, idx, sink = random_problem(rng, B=1, T=16, H=2, D=16, K=12)
    idx = sanitize_indices(idx, kv.shape[1])
    *_, cnt = _forward_impl(q, kv, idx, sink, scale=0.2, interpret=True,
                               config=pt.Config(block_t=8, block_k=8), count_dmas=True)
    assert int(cnt.sum()) == int((idx >= 0).sum())
    T, w = 64, 16
    q, kv, idx, sink, lay = _structured_problem(rng, "cr0", T=T, w=w, B=1, H=2, D=16)
    *_, cnt = _forward_impl(q, kv, idx, sink, scale=0.2, interpret=True,
                               config=pt.Config(block_t=8, block_k=8, **lay), count_dmas=True)
    # block i streams the rows [max(8i - 15, 0), 8i + 8) in 8-row tiles
    want = [-(-(8 * i + 8 - max(8 * i - w + 1, 0)) // 8) for i in range(T // 8)]
    np.testing.assert_array_equal(np.asarray(cnt[0]), want)
    assert int(cnt.sum()) < int((idx >= 0).sum()) / 5


def test_fanin_split(rng):
    """split_map over the shared CSR inverse map (tests/test_blockmath.py checks the map)."""
    idx = jnp.asarray(rng.integers(-1, 5, size=(2, 30)), jnp.int32)
    idx = idx.at[1, :20].set(2)                                     # a hot row
    perm, key, offs = bm.inverse_map(idx, 5, 8)
    seg, seg_offs, row_of_seg, row_offs = pt.split_map(key, offs, 5, 4, 8)
    for b in range(2):
        for r in range(5):
            n_r = int(offs[b, r + 1] - offs[b, r])
            segs = range(int(row_offs[b, r]), int(row_offs[b, r + 1]))
            assert len(segs) == -(-n_r // 4)                # ceil(count / seg_len) segments
            covered = []
            for sg in segs:
                assert int(row_of_seg[b, sg]) == r
                lo, hi = int(seg_offs[b, sg]), int(seg_offs[b, sg + 1])
                assert 1 <= hi - lo <= 4
                covered += list(range(lo, hi))
            assert covered == list(range(int(offs[b, r]), int(offs[b, r + 1])))


def test_hot_row_split_across_programs(rng):
    """One kv row used by every slot (the cr128 pool-row-0 skew through the generic path):
    the fan-in is reduced in segments of 4 slots by many programs, and stays exact."""
    q, kv, idx, sink = random_problem(rng, B=1, T=16, H=2, D=16, K=8, empty_frac=0.1,
                                      oob_frac=0.0, empty_rows=0)
    idx = jnp.where(jnp.arange(8)[None, None] < 5, 3, idx)
    _check_against_oracle(rng, q, kv, idx, sink, scale=0.3,
                          config=pt.Config(block_t=8, block_k=8, block_r=8, fanin_split=4))


# ----------------------------------------------------------------------------- races

@pytest.mark.parametrize("layout", ["generic", "cr4", "cr128"])
def test_no_race_forward_backward(rng, layout):
    """Every kernel (forward, backward, CSR dkv reduce) under the race detector: no race, and
    the simulated-DMA results still match the oracle."""
    if layout == "generic":
        q, kv, idx, sink = random_problem(rng, B=1, T=8, H=2, D=16, N=12, K=12, dup_frac=0.3)
        lay = {}
    else:
        q, kv, idx, sink, lay = _structured_problem(rng, layout, T=16, w=6, ratio=4, topk=3,
                                                    B=1, H=2, D=16)
    cfg = pt.Config(block_t=4, block_k=8, depth=3, block_r=8, **lay)
    w_o = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    with _race_report() as rep:
        o, lse, (dq, dkv, _) = value_and_grads(q, kv, idx, sink, w_o, None, scale=0.25,
                                               impl="pallas_tpu", interpret=RACES, config=cfg)
        jax.block_until_ready((o, dq, dkv))
    assert "RACE DETECTED" not in rep.getvalue(), rep.getvalue()[:2000]
    ro, _, rdq, rdkv, _ = dense_oracle(q, kv, idx, sink, 0.25, w_o)
    assert_close(o, ro, jnp.float32, what="o")
    assert_close(dq, rdq, jnp.float32, what="dq")
    assert_close(dkv, rdkv, jnp.float32, what="dkv")
    if layout == "generic":
        # Bit-identical dkv across runs and program orders: the interpreter randomises the order
        # of 'parallel' grid points by seed; the CSR reduce adds in a fixed order regardless.
        again = pltpu.InterpretParams(detect_races=True, random_seed=int(rng.integers(1 << 30)))
        with _race_report() as rep:
            _, dkv2, _ = pt.backward(q, kv, sanitize_indices(idx, kv.shape[1]), sink, o, lse,
                                     w_o, jnp.zeros(lse.shape, jnp.float32), scale=0.25,
                                     interpret=again, config=cfg)
            jax.block_until_ready(dkv2)
        assert "RACE DETECTED" not in rep.getvalue(), rep.getvalue()[:2000]
        np.testing.assert_array_equal(np.asarray(dkv2).view(np.uint32),
                                      np.asarray(dkv).view(np.uint32))


@pytest.mark.parametrize("layout", ["generic", "cr128"])
def test_race_detector_catches_wait_after_read(rng, layout):
    """The check above can fail: reading a ring slot before waiting on its DMA is reported,
    for row-gather DMAs (generic) and contiguous-tile DMAs (cr128)."""
    if layout == "generic":
        q, kv, idx, sink = random_problem(rng, B=1, T=4, H=2, D=16, K=8, empty_frac=0.0,
                                          oob_frac=0.0, empty_rows=0)
        idx = sanitize_indices(idx, kv.shape[1])
        cfg = pt.Config(block_t=4, block_k=8, depth=2)
    else:
        q, kv, idx, sink, lay = _structured_problem(rng, layout, T=8, w=4, ratio=2, B=1, H=2,
                                                    D=16)
        cfg = pt.Config(block_t=4, block_k=8, depth=4, **lay)
    for broken in (True, False):
        raised = ""
        with _race_report() as rep:
            try:
                o, _ = _forward_impl(q, kv, idx, sink, scale=0.25, interpret=RACES,
                                        config=cfg, broken=broken)
                jax.block_until_ready(o)
            except Exception as e:  # jax >= 0.12 raises on a race (on_race="raise")
                raised = str(e)
        found = "RACE DETECTED" in rep.getvalue() or "RACE DETECTED" in raised
        if not broken and raised:
            raise AssertionError(f"unexpected error without a race: {raised[:2000]}")
        assert found == broken, (broken, rep.getvalue()[:2000], raised[:2000])


# ----------------------------------------------------------------------------- TPU lowering

@pytest.mark.parametrize("layout", ["generic", "cr4", "cr128"])
def test_lowers_for_tpu(layout):
    """Without a TPU, lower forward + backward to Mosaic for an abstract TPU v5e device: every
    primitive the kernels use has a TPU lowering (the Mosaic compiler itself runs on a TPU)."""
    B, T, H, D, w = 1, 64, 8, 128, 32
    n, k = {"generic": (80, 256), "cr4": (80, w + 128), "cr128": (T + 16, w + 16)}[layout]
    lay = {} if layout == "generic" else dict(layout=layout, window=w, pool_ratio=4)
    cfg = pt.Config(block_t=8, block_k=128, depth=3, **lay)

    def fwd_bwd(q, kv, idx, sink):
        o, lse = pt.forward(q, kv, idx, sink, scale=0.1, interpret=False, config=cfg)
        return pt.backward(q, kv, idx, sink, o, lse, o, lse, scale=0.1, interpret=False,
                           config=cfg)

    dev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    args = (jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, n, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, k), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.float32))
    with jax.sharding.use_abstract_mesh(mesh):
        exp = jax.export.export(jax.jit(fwd_bwd), platforms=["tpu"])(*args)
    text = exp.mlir_module()
    for name in ("csa_fwd_tpu", "csa_bwd_tpu"):
        assert name in text
