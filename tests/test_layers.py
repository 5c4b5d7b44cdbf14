"""csa_jax.layers: the NNX attention layer against the golden cases, a dense oracle, causality."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, golden
from flax import nnx

import csa_jax
from csa_jax.config import CSAConfig
from csa_jax.layers import Compressor, CSAAttention, apply_rope, rms_norm

F32 = jnp.float32


def small_cfg(ratio=0, **kw):
    base = dict(d_model=32, num_heads=4, head_dim=32, ratio=ratio, window=8, rope_dim=16,
                q_rank=24, o_groups=2, o_rank=16, topk=3, index_heads=2, index_dim=16)
    return CSAConfig(**{**base, **kw})


def make_layer(cfg, seed, *, randomize=True):
    """A layer with random params everywhere (including sink, norm scales and ape, which init
    to constants) so that the checks see every parameter."""
    layer = CSAAttention(cfg, rngs=nnx.Rngs(seed))
    if randomize:
        graphdef, state = nnx.split(layer)
        key = jax.random.key(seed + 1)
        leaves, tree = jax.tree.flatten(nnx.to_pure_dict(state))
        keys = jax.random.split(key, len(leaves))
        leaves = [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
        layer = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
    return layer


# ----------------------------------------------------------------------------- golden cases


@pytest.mark.parametrize("name", ["cr4", "cr8"])
def test_compressor_matches_golden(name):
    g = golden(name)
    ratio, C = int(g["ratio"]), g["x"].shape[-1]
    comp = Compressor(C, g["norm_scale"].shape[0], ratio, rngs=nnx.Rngs(0))
    for field in ("w_kv", "w_gate", "ape", "norm_scale"):
        getattr(comp, field)[...] = jnp.asarray(g[field])
    assert_close(comp(jnp.asarray(g["x"])), g["pool_prerope"], F32, what=f"{name} pool_prerope")
    if name == "cr4":  # the indexer's own compressor (d = index head dim)
        icomp = Compressor(C, g["inorm_scale"].shape[0], ratio, rngs=nnx.Rngs(0))
        for field in ("w_kv", "w_gate", "ape", "norm_scale"):
            getattr(icomp, field)[...] = jnp.asarray(g["i" + field])
        assert_close(icomp(jnp.asarray(g["x"])), g["ikey_prerope"], F32, what="indexer keys")


@pytest.mark.parametrize("name", ["cr0", "cr4", "cr8"])
def test_attention_core_matches_golden(name):
    """The layer's own index lists (window 16, golden ratio) fed with the golden q/kv/sink give
    the golden output: the [window | pool] lists see exactly the rows the reference model saw."""
    g = golden(name)
    B, T, H, D = g["q"].shape
    cfg = CSAConfig(d_model=g["x"].shape[-1], num_heads=H, head_dim=D, ratio=int(g["ratio"]),
                    window=int(g["window"]), q_rank=32, o_groups=2, o_rank=16,
                    topk=int(g.get("topk_k", 4)), index_heads=4, index_dim=64)
    layer = CSAAttention(cfg, rngs=nnx.Rngs(0))
    topk = jnp.asarray(g["topk"]) if "topk" in g else None
    idx = np.asarray(layer.index_lists(B, T, topk))
    for b in range(B):  # as sets: the reference lists are ascending, ours are [window | pool]
        for t in range(T):
            assert sorted(set(idx[b, t]) - {-1}) == sorted(set(g["idx"][b, t]) - {-1}), (b, t)
    o, _ = csa_jax.sparse_attention(jnp.asarray(g["q"]), jnp.asarray(g["kv"]), jnp.asarray(idx),
                                    jnp.asarray(g["sink"]), impl="xla")
    assert float(g["scale"]) == pytest.approx(D ** -0.5)  # the layer uses the default scale
    assert_close(o, g["o"], F32, what=f"{name} o")


# ----------------------------------------------------------------------------- RoPE


def test_rope_interleaved_pairs_and_inverse(rng):
    x = jnp.asarray(rng.standard_normal((5, 3, 24)), F32)  # [T, H, D], rope on the last 16
    pos = jnp.arange(5)[:, None]
    y = apply_rope(x, pos, base=100.0, rope_dim=16)
    np.testing.assert_array_equal(y[..., :8], x[..., :8])  # non-rotated channels untouched
    # pair i of the rotated part = complex multiplication by exp(1j * t * base**(-2i/16))
    z = np.asarray(x[..., 8::2]) + 1j * np.asarray(x[..., 9::2])
    ang = np.arange(5)[:, None, None] * 100.0 ** (-np.arange(0, 16, 2) / 16)
    zr = z * np.exp(1j * ang)
    np.testing.assert_allclose(y[..., 8::2], zr.real, atol=1e-5)
    np.testing.assert_allclose(y[..., 9::2], zr.imag, atol=1e-5)
    back = apply_rope(y, pos, base=100.0, rope_dim=16, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5)


def test_rope_scores_depend_on_relative_position(rng):
    q = jnp.asarray(rng.standard_normal(16), F32)
    k = jnp.asarray(rng.standard_normal(16), F32)
    rot = lambda v, p: apply_rope(v, jnp.asarray(p), base=10000.0, rope_dim=16)  # noqa: E731
    s1 = float(rot(q, 7) @ rot(k, 3))
    s2 = float(rot(q, 20) @ rot(k, 16))
    assert s1 == pytest.approx(s2, rel=1e-4)


# ----------------------------------------------------------------------------- the whole layer


def dense_layer(layer, x):
    """The layer written densely (no index lists, no sparse_attention): a masked softmax over
    [token rows ; pool rows] with the sink, from the same parameters. cr0 and HCA layers."""
    cfg = layer.cfg
    B, T, _ = x.shape
    H, D, m, w = cfg.num_heads, cfg.head_dim, cfg.ratio, cfg.window
    p = lambda a: np.asarray(a[...], np.float64)  # noqa: E731
    xn = np.asarray(x, np.float64)

    def norm(v, scale=None):
        v = v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.norm_eps)
        return v if scale is None else v * scale

    def rope(v, pos, sign=1.0):
        r = cfg.rope_dim
        ang = sign * pos[..., None] * cfg.rope_base ** (-np.arange(0, r, 2) / r)
        z = (v[..., -r::2] + 1j * v[..., -r + 1::2]) * np.exp(1j * ang)
        out = v.copy()
        out[..., -r::2], out[..., -r + 1::2] = z.real, z.imag
        return out

    t = np.arange(T)
    q = (norm(xn @ p(layer.wq_a), p(layer.q_norm.scale)) @ p(layer.wq_b)).reshape(B, T, H, D)
    q = rope(norm(q), t[:, None].astype(float))
    kv = rope(norm(xn @ p(layer.wkv), p(layer.kv_norm.scale)), t.astype(float))
    mask = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < w)  # [T, T]
    if m:
        pool = np.asarray(layer.compressor(x), np.float64)
        P = pool.shape[1]
        pool = rope(pool, (np.arange(P) * m).astype(float))
        kv = np.concatenate([kv, pool], 1)
        mask = np.concatenate([mask, np.arange(P)[None, :] < (t[:, None] + 1) // m], 1)
    s = np.einsum("bthd,bnd->bthn", q, kv) * D ** -0.5
    s = np.where(mask[None, :, None, :], s, -np.inf)
    sink = np.broadcast_to(p(layer.sink)[None, None, :, None], (B, T, H, 1))
    s = np.concatenate([s, sink], -1)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob = prob / prob.sum(-1, keepdims=True)
    o = np.einsum("bthn,bnd->bthd", prob[..., :-1], kv)
    o = rope(o, t[:, None].astype(float), sign=-1.0)
    G = cfg.o_groups
    y = np.einsum("btgk,gkr->btgr", o.reshape(B, T, G, -1), p(layer.wo_a))
    return y.reshape(B, T, -1) @ p(layer.wo_b)


@pytest.mark.parametrize("ratio", [0, 8])
def test_layer_matches_dense_oracle(ratio, rng):
    seed = int(rng.integers(1 << 30))
    layer = make_layer(small_cfg(ratio), seed)
    x = jnp.asarray(rng.standard_normal((2, 32, 32)), F32)
    y, aux = layer(x)
    assert float(aux) == 0.0
    assert_close(y, dense_layer(layer, x), F32, factor=10, what=f"cr{ratio} layer vs dense")


@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_layer_is_causal(ratio, rng):
    """Changing token t0 changes no output before t0 (pool visibility, overlapping cr4 groups,
    the indexer's selection); it does change the output at t0."""
    seed = int(rng.integers(1 << 30))
    layer = make_layer(small_cfg(ratio), seed)
    x = jnp.asarray(rng.standard_normal((1, 32, 32)), F32)
    t0 = int(rng.integers(4, 28))
    x2 = x.at[:, t0].add(3.0)
    y1, y2 = layer(x)[0], layer(x2)[0]
    np.testing.assert_array_equal(np.asarray(y1[:, :t0]), np.asarray(y2[:, :t0]))
    assert not np.allclose(y1[:, t0], y2[:, t0])


def test_indexer_aux_loss_trains_only_the_indexer(rng):
    seed = int(rng.integers(1 << 30))
    cfg = small_cfg(4, indexer_loss_coef=1.0)
    layer = make_layer(cfg, seed)
    x = jnp.asarray(rng.standard_normal((2, 32, 32)), F32)
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)

    aux = lambda prm: nnx.merge(graphdef, prm)(x)[1]  # noqa: E731
    main = lambda prm: jnp.sum(nnx.merge(graphdef, prm)(x)[0] ** 2)  # noqa: E731
    (a, g_aux), g_main = jax.jit(lambda prm: (jax.value_and_grad(aux)(prm), jax.grad(main)(prm)))(params)
    assert np.isfinite(float(a)) and float(a) > 0
    nonzero = lambda tree: any(float(jnp.abs(v).max()) > 0 for v in jax.tree.leaves(tree))  # noqa: E731
    assert nonzero(g_aux["indexer"])
    assert not nonzero({k: v for k, v in g_aux.items() if k != "indexer"})
    assert not nonzero(g_main["indexer"])  # top-k passes no gradient
    assert nonzero(g_main["compressor"]) and nonzero(g_main["sink"])

    # coefficient 0 (the default): no auxiliary loss at all
    graphdef0 = nnx.split(CSAAttention(dataclasses.replace(cfg, indexer_loss_coef=0.0),
                                       rngs=nnx.Rngs(0)))[0]
    assert float(jax.jit(lambda prm: nnx.merge(graphdef0, prm)(x)[1])(params)) == 0.0


def test_layer_bf16_runs_and_tracks_f32(rng):
    # HCA: no discrete top-k choice that bf16 rounding could flip
    seed = int(rng.integers(1 << 30))
    layer = make_layer(small_cfg(8), seed)
    x = jnp.asarray(rng.standard_normal((1, 32, 32)), F32)
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    bf = jax.tree.map(lambda p: p.astype(jnp.bfloat16) if p.ndim >= 2 else p, params)
    y32 = layer(x)[0]
    y16 = nnx.merge(graphdef, bf)(x.astype(jnp.bfloat16))[0]
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, y32, jnp.bfloat16, factor=5, what="bf16 layer")


@pytest.mark.parametrize("bad, match", [
    (dict(rope_dim=48), "rope_dim=48 must be <= head_dim=32"),
    (dict(o_groups=3), "o_groups=3 must divide num_heads=4"),
    (dict(ratio=1), "ratio=1"),
    (dict(rope_dim=7), "rope_dim=7"),
])
def test_config_errors_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        small_cfg(**bad)


def test_rms_norm_unweighted():
    x = jnp.asarray([[3.0, 4.0]], F32)
    np.testing.assert_allclose(rms_norm(x, eps=0.0), x / np.sqrt(12.5), rtol=1e-6)
