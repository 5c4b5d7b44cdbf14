"""Context parallelism (csa_jax/context_parallel.py): the op with q / kv / idx split over T on 8
simulated devices equals one device (values and gradients w.r.t. q, kv, pool, sink), for every
layer type, with Explicit and Auto axes, shards shorter than the window halo, split and
replicated pools; the compiled program moves no q, o or whole-sequence kv; bad splits raise.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import csa_jax
from conftest import assert_close
from csa_jax.context_parallel import plan, sparse_attention_cp

pytestmark = pytest.mark.usefixtures("eight_devices")

B, H, D = 2, 2, 16


def _problem(rng, T, ratio, window, topk=12):
    """Random q, token rows, pool rows, sink and the layer's [window | pool] lists (cr4: random
    visible pool ids with -1 and duplicates)."""
    Pn = T // ratio if ratio else 0
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, kv = f(B, T, H, D), f(B, T, D)
    pool = f(B, Pn, D) if Pn else None
    if ratio == 4:
        vis = (np.arange(T) + 1) // ratio                               # rows visible to t
        ids = rng.integers(0, np.maximum(vis, 1)[None, :, None], size=(B, T, topk))
        ids = np.where(ids < vis[None, :, None], ids, -1)
        ids = np.where(rng.random(ids.shape) < 0.2, -1, ids)
        ids[..., 1] = ids[..., 0]                                       # a duplicate row
        idx = csa_jax.build_indices(T, ratio, window=window, pool_topk=jnp.asarray(ids))
    else:
        idx = jnp.broadcast_to(csa_jax.build_indices(T, ratio, window=window),
                               (B, T, window + Pn))
    return q, kv, pool, jnp.asarray(idx, jnp.int32), f(H)


def _loss_one_device(q, kv, pool, idx, sink, do, dlse):
    full = kv if pool is None else jnp.concatenate([kv, pool], axis=1)
    o, lse = csa_jax.sparse_attention(q, full, idx, sink, impl="xla")
    return jnp.sum(o * do) + jnp.sum(lse * dlse), (o, lse)


@pytest.mark.parametrize("ratio,window,overlap,axis_type", [
    (0, 48, "none", AxisType.Explicit),      # cr0; L = 32 < 47 halo rows: two hops
    (0, 16, "xla", AxisType.Auto),
    (4, 16, "ring", AxisType.Explicit),      # cr4: 64 pool rows, 8 per shard
    (4, 48, "bidirectional", AxisType.Auto),     # 4-row halves
    (16, 48, "xla", AxisType.Explicit),      # HCA-like: 16 pool rows, 2 per shard
    (16, 16, "bidirectional", AxisType.Auto),    # 1-row halves of 2-row blocks
    (12, 16, "ring", AxisType.Explicit),     # 21 pool rows: not divisible by 8, replicated
], ids=lambda v: getattr(v, "name", str(v)))
def test_cp_matches_one_device(ratio, window, overlap, axis_type, rng):
    T = 256
    q, kv, pool, idx, sink = _problem(rng, T, ratio, window)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    grad = jax.grad(_loss_one_device, argnums=(0, 1, 2, 4), has_aux=True)
    want_g, (want_o, want_lse) = grad(q, kv, pool, idx, sink, do, dlse)

    mesh = jax.make_mesh((8,), ("cp",), axis_types=(axis_type,))
    put = lambda x, s: None if x is None else jax.device_put(x, NamedSharding(mesh, s))  # noqa
    seq = P(None, "cp")

    def loss(q, kv, pool, idx, sink):
        o, lse = sparse_attention_cp(q, kv, pool, idx, sink, axis="cp", window=window,
                                     overlap=overlap, impl="xla", mesh=mesh)
        return jnp.sum(o * do) + jnp.sum(lse * dlse), (o, lse)

    pool_spec = seq if pool is not None and pool.shape[1] % 8 == 0 else P()
    args = (put(q, seq), put(kv, seq), put(pool, pool_spec), put(idx, seq), put(sink, P()))
    got_g, (o, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4), has_aux=True))(*args)
    assert_close(o, want_o, jnp.float32, what="o")
    assert_close(lse, want_lse, jnp.float32, what="lse")
    for name, g, w in zip(("dq", "dkv", "dpool", "dsink"), got_g, want_g):
        if w is not None:
            assert_close(g, w, jnp.float32, what=name)


@pytest.mark.parametrize("overlap", ["none", "ring"])
def test_cp_composes_with_batch_and_heads(overlap, rng):
    """A (batch 2) x (sequence 2) x (heads 2) Explicit mesh: each device holds one batch row,
    half the tokens and one head; values and gradients equal one device's and keep the inputs'
    shardings; nothing T-long or q-shaped moves. The reference runs its token-chunk loop
    (chunk_tokens=16 of a shard's 64), whose carry must be typed varying inside the shard_map."""
    T, window = 128, 16
    q, kv, pool, idx, sink = _problem(rng, T, 4, window)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    want_g, (want_o, want_lse) = jax.grad(_loss_one_device, argnums=(0, 1, 2, 4), has_aux=True)(
        q, kv, pool, idx, sink, do, dlse)
    mesh = jax.make_mesh((2, 2, 2), ("b", "cp", "h"), axis_types=(AxisType.Explicit,) * 3)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731

    def loss(q, kv, pool, idx, sink):
        o, lse = sparse_attention_cp(q, kv, pool, idx, sink, axis="cp", window=window,
                                     overlap=overlap, impl="xla",
                                     config=csa_jax.reference.Config(chunk_tokens=16))
        return jnp.sum(o * do) + jnp.sum(lse * dlse), (o, lse)

    args = (put(q, P("b", "cp", "h")), put(kv, P("b", "cp")), put(pool, P("b", "cp")),
            put(idx, P("b", "cp")), put(sink, P("h")))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4), has_aux=True)).lower(*args).compile()
    (dq, dkv, dpool, dsink), (o, lse) = step(*args)
    for name, g, w in zip(("o", "lse", "dq", "dkv", "dpool", "dsink"),
                          (o, lse, dq, dkv, dpool, dsink), (want_o, want_lse, *want_g)):
        assert_close(g, w, jnp.float32, what=name)
    assert o.sharding.spec[:3] == dq.sharding.spec[:3] == ("b", "cp", "h")
    assert dkv.sharding.spec[:2] == ("b", "cp") and dsink.sharding.spec == P("h")
    bad = [s for s in _moved_shapes(step.as_text()) if T in s or len(s) >= 4]
    assert not bad, sorted(set(bad))


@pytest.mark.parametrize("impl,overlap", [("pallas_triton", "xla"), ("pallas_tpu", "ring")])
def test_cp_kernel_impls(impl, overlap, rng):
    """The Pallas impls (interpret mode on CPU) run per shard inside the context-parallel
    shard_map: cr4 over 4 devices, values and gradients equal one device's reference."""
    T, window = 64, 8
    q, kv, pool, idx, sink = _problem(rng, T, 4, window, topk=4)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    want_g, (want_o, want_lse) = jax.grad(_loss_one_device, argnums=(0, 1, 2, 4), has_aux=True)(
        q, kv, pool, idx, sink, do, dlse)
    mesh = jax.make_mesh((4,), ("cp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731

    def loss(q, kv, pool, idx, sink):
        o, lse = sparse_attention_cp(q, kv, pool, idx, sink, axis="cp", window=window,
                                     overlap=overlap, impl=impl)
        return jnp.sum(o * do) + jnp.sum(lse * dlse), (o, lse)

    seq = P(None, "cp")
    args = (put(q, seq), put(kv, seq), put(pool, seq), put(idx, seq), put(sink, P()))
    (dq, dkv, dpool, dsink), (o, lse) = jax.jit(
        jax.grad(loss, argnums=(0, 1, 2, 4), has_aux=True))(*args)
    for name, g, w in zip(("o", "lse", "dq", "dkv", "dpool", "dsink"),
                          (o, lse, dq, dkv, dpool, dsink), (want_o, want_lse, *want_g)):
        assert_close(g, w, jnp.float32, factor=4, what=f"{impl} {name}")


def test_cp_on_one_device_axis_equals_no_cp(rng):
    """A context-parallel axis of size 1: the same op (the halo is empty of neighbours)."""
    T, window = 64, 16
    q, kv, pool, idx, sink = _problem(rng, T, 4, window)
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    o, lse = jax.jit(lambda *a: sparse_attention_cp(*a, axis="cp", window=window, impl="xla",
                                                    mesh=mesh))(q, kv, pool, idx, sink)
    _, (want_o, want_lse) = _loss_one_device(q, kv, pool, idx, sink, 0.0, 0.0)
    assert_close(o, want_o, jnp.float32, what="o")
    assert_close(lse, want_lse, jnp.float32, what="lse")


_MOVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")


def _moved_shapes(hlo):
    out = []
    for line in hlo.splitlines():
        if any(re.search(rf"\b{m}(-start)?\(", line) for m in _MOVES):
            for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", line.split("=", 1)[1].split("(")[0]):
                out.append(tuple(int(v) for v in dims.split(",") if v))
    return out


@pytest.mark.parametrize("overlap", ["none", "ring"])
def test_cp_moves_no_q_o_or_sequence_kv(overlap, rng):
    """The compiled step's collectives carry only halo rows, pool rows and the sink's
    [H] sum: no array with a T-long or rank-4 (q / o / dq) shape."""
    T, window, ratio = 512, 16, 4
    q, kv, pool, idx, sink = _problem(rng, T, ratio, window)
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Explicit,))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    seq = P(None, "cp")

    def step(q, kv, pool, idx, sink):
        f = lambda q, kv, pool, sink: sparse_attention_cp(  # noqa: E731
            q, kv, pool, idx, sink, axis="cp", window=window, overlap=overlap, impl="xla")
        (o, lse), vjp = jax.vjp(f, q, kv, pool, sink)
        return o, lse, *vjp((o, lse))

    args = (put(q, seq), put(kv, seq), put(pool, seq), put(idx, seq), put(sink, P()))
    hlo = jax.jit(step).lower(*args).compile().as_text()
    moved = _moved_shapes(hlo)
    assert moved, "expected the halo ppermute and the pool gather"
    bad = [s for s in moved if len(s) >= 4 or T in s or T + T // ratio in s]
    assert not bad, f"collectives move q/o or whole-sequence kv: {sorted(set(bad))}"
    elems = max(int(np.prod(s)) for s in moved)
    assert elems <= B * (T // ratio) * D, f"largest collective {elems} elements > the pool's"


def test_cp_errors_name_the_values(rng):
    with pytest.raises(ValueError, match=r"T=100 divisible by the size n=8"):
        plan(100, 8, 16)
    with pytest.raises(ValueError, match=r"window=0"):
        plan(64, 8, 0)
    p = plan(64, 8, 48)   # shard of 8 tokens, 47 halo rows: 6 hops (supported, not an error)
    assert (p["L"], p["halo"], p["hops"]) == (8, 47, 6)
    T, window = 64, 16
    q, kv, pool, idx, sink = _problem(rng, T, 4, window)
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Explicit,))
    bad = idx.at[0, 40, 0].set(3)          # a token row far outside token 40's window
    with pytest.raises(ValueError, match=r"idx\[0, 40, 0\] = 3 breaks the context-parallel"):
        sparse_attention_cp(q, kv, pool, bad, sink, axis="cp", window=window, mesh=mesh)
    with pytest.raises(ValueError, match=r"axis='seq' is not an axis"):
        sparse_attention_cp(q, kv, pool, idx, sink, axis="seq", window=window, mesh=mesh)
    with pytest.raises(ValueError, match=r"overlap='fast'"):
        sparse_attention_cp(q, kv, pool, idx, sink, axis="cp", window=window, overlap="fast",
                            mesh=mesh)


# ----------------------------------------------------------------------------- the NNX layer


def _layer_pair(ratio, seed, **kw):
    from test_layers import make_layer, small_cfg
    base = dict(window=48, topk=5, impl="xla")
    one = make_layer(small_cfg(ratio, **base), seed)
    cp = make_layer(small_cfg(ratio, **base, **kw), seed)
    return one, cp


def _layer_loss(graphdef, dy):
    from flax import nnx

    def f(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * dy), y       # y compared, not the scalar (a sum that cancels)
    return f


@pytest.mark.parametrize("ratio,axis_type,overlap,n", [
    (0, AxisType.Explicit, "none", 8),
    (4, AxisType.Explicit, "xla", 8),
    (16, AxisType.Explicit, "none", 8),
    (4, AxisType.Auto, "none", 8),
    (4, AxisType.Explicit, "none", 1),      # an axis of one device: the same layer
], ids=lambda v: getattr(v, "name", str(v)))
def test_layer_cp_matches_one_device(ratio, axis_type, overlap, n, rng):
    """CSAAttention with x split over T on 8 devices (shard of 32 tokens, window 48: a
    two-hop halo; cr4: 8 pool rows per shard; ratio 16: 2): the loss and the gradients w.r.t.
    every parameter and x equal one device's. Explicit axes find the axis in x's type; Auto
    axes name it (context_axis). At 14a1614 the Explicit runs raised (ShardingTypeError; cr0:
    the custom_vjp's bwd output type)."""
    from flax import nnx
    T = 256
    seed = int(rng.integers(1 << 30))
    kw = dict(context_overlap=overlap)
    if axis_type == AxisType.Auto:
        kw["context_axis"] = "cp"
    one, cp = _layer_pair(ratio, seed, **kw)
    x = jnp.asarray(rng.standard_normal((2, T, 32)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((2, T, 32)), jnp.float32)
    g1, s1 = nnx.split(one)
    want_g, want_y = jax.jit(jax.grad(_layer_loss(g1, dy), argnums=(0, 1), has_aux=True))(s1, x)

    mesh = jax.make_mesh((n,), ("cp",), axis_types=(axis_type,), devices=jax.devices()[:n])
    g2, s2 = nnx.split(cp)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
    s2 = jax.device_put(s2, NamedSharding(mesh, P()))
    step = jax.jit(jax.grad(_layer_loss(g2, dy), argnums=(0, 1), has_aux=True))
    with jax.set_mesh(mesh):
        compiled = step.lower(s2, xs).compile()     # one compile: run it and read its HLO
        got_g, got_y = compiled(s2, xs)
    hlo = compiled.as_text()
    assert_close(got_y, want_y, jnp.float32, factor=4, what=f"cr{ratio} y")
    flat_want = jax.tree_util.tree_flatten_with_path(want_g)[0]
    for a, (path, b) in zip(jax.tree.leaves(got_g), flat_want):
        assert_close(a, b, jnp.float32, factor=4,
                     what=f"cr{ratio} d{jax.tree_util.keystr(path)}")
    if axis_type == AxisType.Explicit:
        # nothing T long, nothing as large as one device's q shard [2, 32, 4, 32] (the ratio-4
        # compressor's one-group halo [2, 1, 4, 2d] and the pool gather are far smaller)
        q_shard = 2 * (T // n) * cp.cfg.num_heads * cp.cfg.head_dim
        bad = [s for s in _moved_shapes(hlo) if T in s or int(np.prod(s)) >= q_shard]
        assert not bad, f"the layer's collectives move q-sized or T-long arrays: {sorted(set(bad))}"


def test_layer_cp_groups_must_not_straddle_shards(rng):
    """ratio 128 at T = 512 over 8 devices: shards of 64 tokens cut the compressor's groups."""
    from flax import nnx
    from test_layers import small_cfg
    layer = CSAAttention_(small_cfg(128, window=16, impl="xla"))
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.zeros((1, 512, 32)), NamedSharding(mesh, P(None, "cp")))
    with pytest.raises(ValueError, match=r"L = T / n = 512 / 8 = 64 must be a multiple of "
                                         r"ratio=128"):
        g, s = nnx.split(layer)
        jax.jit(lambda s, x: nnx.merge(g, s)(x))(s, x)


def CSAAttention_(cfg):
    from flax import nnx

    from csa_jax.layers import CSAAttention
    return CSAAttention(cfg, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- the trainer


@pytest.mark.slow   # ~40 s on 2 cores: two compiles of a three-layer model
def test_trainer_context_parallel_matches_one_device():
    """--context-parallel 4 on 8 devices (2 data groups x 4 sequence shards): two Adam steps
    and an eval give one device's losses."""
    from train.config import get_preset
    from train.loop import init_state
    from train.parallel import ContextParallelRunner, make_runner

    def run(cp):
        cfg = get_preset("tiny", model=dict(impl="xla", layer_ratios=(0, 4, 16), mlp_hidden=64),
                         data=("unused",), batch_size=2, seq_len=128, warmup_steps=0,
                         context_parallel=cp)
        graphdef, state, tx, schedule = init_state(cfg)
        runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
        toks = np.random.default_rng(0).integers(0, 256, (2, 129)).astype(np.int32)
        batch = runner.batch((toks[:, :-1], toks[:, 1:]))
        dstate, losses = runner.put(state), []
        for _ in range(2):
            dstate, metrics = runner.step(dstate, batch)
            losses.append(float(metrics["loss"]))
        return losses + [float(runner.eval(dstate, batch))], runner, batch

    want, _, _ = run(1)
    got, runner, batch = run(4)
    assert isinstance(runner, ContextParallelRunner) and runner.mesh.shape["cp"] == 4
    assert batch[0].sharding.spec == P("data", "cp")
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_trainer_context_parallel_errors():
    from train.config import ConfigError, get_preset
    from train.parallel import check_parallel
    with pytest.raises(ConfigError, match=r"seq_len=96 must be a multiple of 64"):
        get_preset("tiny", model=dict(layer_ratios=(0, 4, 16)), seq_len=96, context_parallel=4)
    with pytest.raises(ConfigError, match=r"--context-parallel 3 must divide the 8 devices"):
        check_parallel(get_preset("tiny", model=dict(layer_ratios=(0,)), seq_len=96,
                                  context_parallel=3))
    with pytest.raises(ConfigError, match=r"with --fsdp explicit is not implemented"):
        get_preset("tiny", seq_len=256, context_parallel=4, fsdp="explicit")
    cfg = get_preset("tiny", seq_len=256, context_parallel=4)
    assert cfg.model.attention.context_axis == "cp"
    assert get_preset("tiny").model.attention.context_axis is None
