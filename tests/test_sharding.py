"""sparse_attention under a mesh (csa_jax/sharding.py): shard by shard for every impl, with Auto
and Explicit axes; the compiled HLO moves no q / kv / idx between devices, the outputs and
gradients keep the inputs' sharding and equal the dense oracle. Also the FSDP training step.

Needs the 8 simulated CPU devices that tests/conftest.py asks for (fixture eight_devices).
At 812c491 (before csa_jax/sharding.py) the 9 tests of the op under a mesh failed: all-gathers /
all-to-alls of q, kv, idx in the HLO (even xla with head sharding), ShardingTypeError or "sharded
ref" errors under Explicit axes, and the FSDP step's kernels on all 8 batch rows.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import csa_jax
from conftest import assert_close, dense_oracle, random_problem

pytestmark = pytest.mark.usefixtures("eight_devices")

IMPLS = ("xla", "pallas_triton", "pallas_tpu")
# Collectives that would move activations between devices; the backward's all-reduce (psum of
# dkv over head shards, dsink over batch shards) is expected and allowed.
MOVES = ("all-gather", "all-to-all", "collective-permute")


def _mesh(axis_type):
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    return Mesh(devices, ("b", "h"), axis_types=(axis_type, axis_type))


def _moves(hlo):
    return [line.strip()[:160] for line in hlo.splitlines()
            if any(re.search(rf"\b{m}(-start)?\(", line) for m in MOVES)]


def _spec(x):
    """A NamedSharding's spec with trailing Nones dropped (P('b', None) == P('b'))."""
    spec = list(x.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("impl", IMPLS)
def test_batch_and_head_sharded(impl, axis_type, rng):
    q, kv, idx, sink = random_problem(rng, B=4, T=8, H=4, D=16, N=12, K=8)
    scale = 16 ** -0.5
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    mesh = _mesh(axis_type)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(q, P("b", None, "h")), put(kv, P("b")), put(idx, P("b")), put(sink, P("h")))

    @jax.jit
    def step(q, kv, idx, sink):
        (o, lse), vjp = jax.vjp(
            lambda q, kv, sink: csa_jax.sparse_attention(q, kv, idx, sink, impl=impl), q, kv, sink)
        return o, lse, *vjp((do, dlse))

    hlo = step.lower(*args).compile().as_text()
    assert _moves(hlo) == [], f"{impl}: the compiled step moves data between devices"
    o, lse, dq, dkv, dsink = step(*args)
    assert _spec(o) == _spec(dq) == ("b", None, "h"), (o.sharding, dq.sharding)
    assert _spec(lse) == ("b", None, "h"), lse.sharding
    assert _spec(dkv) == ("b",), dkv.sharding
    assert _spec(dsink) == ("h",), dsink.sharding

    want = dense_oracle(q, kv, idx, sink, scale, do, dlse)
    for name, got, exp in zip(("o", "lse", "dq", "dkv", "dsink"), (o, lse, dq, dkv, dsink), want):
        assert_close(got, exp, jnp.float32, factor=4, what=f"{impl} {name}")


@pytest.mark.parametrize("impl", ["xla", "pallas_triton"])
def test_explicit_batch_only_and_relayout(impl, rng):
    """Explicit axes, a 1-D mesh: q split over batch only, kv replicated and no sink: still no
    gather (each device slices its own rows of kv), outputs batch-sharded."""
    q, kv, idx, _ = random_problem(rng, B=8, T=8, H=2, D=16, N=12, K=8, sink=False)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Explicit,))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(q, P("data")), put(kv, P()), put(idx, P("data")))
    fwd = jax.jit(lambda q, kv, idx: csa_jax.sparse_attention(q, kv, idx, impl=impl))
    assert _moves(fwd.lower(*args).compile().as_text()) == []
    o, lse = fwd(*args)
    assert _spec(o) == _spec(lse) == ("data",)
    want_o, want_lse = dense_oracle(q, kv, idx, None, 16 ** -0.5)
    assert_close(o, want_o, jnp.float32, what="o")
    assert_close(lse, want_lse, jnp.float32, what="lse")


def test_vmap_under_an_auto_mesh(rng):
    """custom_partitioning has no batching rule: under jax.vmap the op runs whole (and stays
    differentiable); values and gradients equal the oracle."""
    q, kv, idx, sink = random_problem(rng, B=4, T=8, H=2, D=16, N=12, K=8)
    mesh = _mesh(AxisType.Auto)
    stack = lambda x: jnp.stack([x, x[::-1]])                       # a vmapped axis of 2
    qs, kvs, ids = stack(q), stack(kv), stack(idx)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    f = lambda q, kv: jax.vmap(lambda q, kv, i: csa_jax.sparse_attention(
        q, kv, i, sink, impl="xla"))(q, kv, ids)
    (o, lse), vjp = jax.vjp(jax.jit(f), put(qs, P(None, "b", None, "h")), put(kvs, P(None, "b")))
    dq, dkv = vjp((jnp.ones_like(o), jnp.zeros_like(lse)))
    for v in range(2):
        want = dense_oracle(qs[v], kvs[v], ids[v], sink, 16 ** -0.5, np.ones(q.shape), None)
        for got, exp in zip((o[v], lse[v], dq[v], dkv[v]), want[:4]):
            assert_close(got, exp, jnp.float32, factor=4)


def test_plan_axes_drops_what_does_not_divide():
    from csa_jax.sharding import plan_axes
    mesh = _mesh(AxisType.Auto)
    assert plan_axes(mesh, P("b", None, "h"), (4, 8, 4, 16)) == (("b",), ("h",))
    assert plan_axes(mesh, P("b", None, "h"), (6, 8, 3, 16)) == ((), ())       # 6 % 4, 3 % 2
    assert plan_axes(mesh, P(("b", "h")), (8, 8, 4, 16)) == (("b", "h"), ())
    assert plan_axes(mesh, P("b", "h"), (4, 8, 4, 16)) == (("b",), ())          # T never split
    assert plan_axes(mesh, P("b", None, "h"), (4, 8, 4, 16), allowed=("h",)) == ((), ("h",))


def _shapes(lines):
    """(leading dims) of every array an HLO instruction in `lines` produces."""
    out = []
    for line in lines:
        m = re.search(r"= [a-z0-9]+\[([0-9,]+)\]", line)
        if m:
            out.append(tuple(int(v) for v in m.group(1).split(",")))
    return out


@pytest.mark.slow
def test_fsdp_step_attends_only_local_rows():
    """train/parallel.py's FSDP step (mode xla: jit's partitioner places the collectives) with
    the pallas_triton kernel (interpret mode): each device attends only its own batch row."""
    from train.config import get_preset
    from train.loop import init_state
    from train.parallel import make_runner

    B, T, D, K = 8, 16, 8, 4
    model = dict(d_model=16, layer_ratios=(0,), num_heads=2, head_dim=D, rope_dim=4, q_rank=16,
                 o_groups=2, o_rank=8, window=K, topk=4, index_heads=1, index_dim=8,
                 mlp_hidden=16, impl="pallas_triton")
    cfg = get_preset("tiny", model=model, data=("unused",), batch_size=B, seq_len=T,
                     fsdp="xla", warmup_steps=0)
    graphdef, state, tx, schedule = init_state(cfg)
    runner = make_runner(cfg, graphdef, state["params"], tx, schedule)
    tokens = np.random.default_rng(0).integers(0, 256, (B, T + 1)).astype(np.int32)
    batch = runner.batch((tokens[:, :-1], tokens[:, 1:]))
    hlo = runner._step.lower(runner.put(state)["fsdp"], batch).compile().as_text()
    lines = hlo.splitlines()
    assert any(re.search(r"all-gather(-start)?\(", l) for l in lines), "FSDP gathers params"
    # Every array the op computes (forward, kernels, backward: "jit(attention)" in its metadata)
    # holds one batch row; at 812c491 the kernels ran on all B rows after all-gathers of q / kv.
    op = [s for s in _shapes(l for l in lines if "jit(attention)" in l) if len(s) >= 3]
    assert op and all(s[0] != B for s in op), f"the op's arrays: {sorted(set(op))}"
    assert any(s[0] == 1 for s in op)


def _record_local_heads(monkeypatch, impl):
    """Wrap the impl module's forward and backward so that each call records (part, its q's
    head count): the per-shard program's kernel calls, seen as the impl sees them."""
    from csa_jax import registry
    mod = registry.get(impl).mod
    seen = []
    for part in ("forward", "backward"):
        real = getattr(mod, part)

        def rec(q, *a, _real=real, _part=part, **kw):
            seen.append((_part, q.shape[2]))
            return _real(q, *a, **kw)

        monkeypatch.setattr(mod, part, rec)
    return seen


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("impl", ["xla", "pallas_triton"])
def test_tensor_parallel_heads_128_over_8(impl, axis_type, rng, monkeypatch):
    """A TP mesh axis over heads (8 devices, H = 128 -> 16 per device, kv / idx replicated):
    o, lse and the gradients of a loss on both outputs equal the single-device run of the same
    impl (and the dense oracle); the compiled program moves no activations and holds no
    128-head array; the impl's kernels are called at H = 16 only."""
    B, T, H, D, N, K = 1, 8, 128, 16, 12, 8
    q, kv, idx, sink = random_problem(rng, B=B, T=T, H=H, D=D, N=N, K=K)
    w_o = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    w_l = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)

    def step(q, kv, idx, sink, w_o, w_l):
        def loss(q, kv, sink):
            o, lse = csa_jax.sparse_attention(q, kv, idx, sink, impl=impl)
            return jnp.sum(o * w_o) + jnp.sum(lse * w_l), (o, lse)
        (_, (o, lse)), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, kv, sink)
        return (o, lse, *g)

    single = jax.jit(step)(q, kv, idx, sink, w_o, w_l)

    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",), axis_types=(axis_type,))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(q, P(None, None, "tp")), put(kv, P()), put(idx, P()), put(sink, P("tp")),
            put(w_o, P(None, None, "tp")), put(w_l, P(None, None, "tp")))
    jax.clear_caches()            # a cached trace would not call the recording wrappers
    seen = _record_local_heads(monkeypatch, impl)
    lowered = jax.jit(step).lower(*args)
    if axis_type == AxisType.Auto:
        # custom_partitioning traces the op at its global shape for the shapes of its result;
        # the per-shard program is built when XLA's partitioner calls the partition rule
        del seen[:]
    compiled = lowered.compile()
    assert sorted(set(seen)) == [("backward", 16), ("forward", 16)], seen
    hlo = compiled.as_text()
    assert _moves(hlo) == [], f"{impl}: the compiled step moves data between devices"
    assert not re.search(rf"\[{B},{T},{H},{D}\]", hlo), "a 128-head q-like array per device"
    assert re.search(rf"\[{B},{T},{H // 8},{D}\]", hlo)

    got = compiled(*args)
    assert _spec(got[0]) == _spec(got[2]) == (None, None, "tp"), got[0].sharding
    assert _spec(got[4]) == ("tp",), got[4].sharding
    names = ("o", "lse", "dq", "dkv", "dsink")
    for name, a, b in zip(names, got, single):
        assert_close(a, b, jnp.float32, factor=4, what=f"{impl} {name} vs one device")
    want = dense_oracle(q, kv, idx, sink, D ** -0.5, w_o, w_l)
    for name, a, b in zip(names, got, want):
        assert_close(a, b, jnp.float32, factor=4, what=f"{impl} {name} vs oracle")
