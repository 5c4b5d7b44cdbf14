"""comm.collectives against the unsharded computation on 8 simulated CPU devices.

Needs the 8 simulated CPU devices that tests/conftest.py asks for (fixture eight_devices).
"""

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import comm

# rtol, and atol as a fraction of the largest reference magnitude (bf16 rounds outputs to 8 bits)
TOL = {jnp.float32: (2e-5, 2e-6), jnp.bfloat16: (2e-2, 1e-2)}


pytestmark = pytest.mark.usefixtures("eight_devices")


@pytest.fixture
def rng(request):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed={seed}")  # shown on failure
    return np.random.default_rng(seed)


def _mesh1():
    return Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(AxisType.Auto,))


def _mesh2():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def _close(got, want, dtype=jnp.float32):
    want = np.asarray(want, np.float32)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol,
                               atol=atol * max(1.0, float(np.abs(want).max(initial=0.0))))


def _value_and_grads(fn, args, cot):
    """fn(*args) and the gradients of sum(fn(*args) * cot), in one jit."""

    @jax.jit
    def run(args, cot):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(cot.astype(y.dtype))

    return run(args, cot)


# --------------------------------------------------------------------------- all_gather_matmul


@pytest.mark.parametrize("overlap", comm.OVERLAPS)
@pytest.mark.parametrize("m,k,nn,dtype", [(16, 32, 24, jnp.float32), (5, 16, 7, jnp.float32),
                                          (3, 8, 1, jnp.float32), (8, 64, 16, jnp.bfloat16)])
def test_all_gather_matmul(rng, overlap, m, k, nn, dtype):
    mesh = _mesh1()
    x = rng.standard_normal((8 * m, k)).astype(np.float32)  # device d holds rows [d*m, (d+1)*m)
    w = rng.standard_normal((k, nn)).astype(np.float32)  # device d holds rows [d*k/8, ...)
    cot = rng.standard_normal((8 * m, nn)).astype(np.float32)
    fn = jax.shard_map(functools.partial(comm.all_gather_matmul, axis_name="x", overlap=overlap),
                       mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    args = (_put(mesh, jnp.asarray(x, dtype), P("x")), _put(mesh, jnp.asarray(w, dtype), P("x")))
    y, (dx, dw) = _value_and_grads(fn, args, jnp.asarray(cot))
    xr, wr = (np.asarray(jnp.asarray(a, dtype), np.float32) for a in (x, w))
    cr = np.asarray(jnp.asarray(cot, dtype), np.float32)
    assert y.shape == (8 * m, nn) and y.dtype == dtype
    _close(y, xr @ wr, dtype)
    _close(dx, cr @ wr.T, dtype)
    _close(dw, xr.T @ cr, dtype)


@pytest.mark.parametrize("overlap", ["ring", "bidirectional"])
def test_all_gather_matmul_replicated_x_and_leading_dims(rng, overlap):
    """x not varying over the axis (in_specs P()): its gradient is the sum over devices."""
    mesh = _mesh1()
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w = rng.standard_normal((16, 6)).astype(np.float32)
    cot = rng.standard_normal((8 * 2, 3, 6)).astype(np.float32)
    fn = jax.shard_map(functools.partial(comm.all_gather_matmul, axis_name="x", overlap=overlap),
                       mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))
    y, (dx, dw) = _value_and_grads(fn, (_put(mesh, x, P()), _put(mesh, w, P("x"))), jnp.asarray(cot))
    _close(y, np.tile(x @ w, (8, 1, 1)))
    c = cot.reshape(8, 2, 3, 6)
    _close(dx, np.einsum("dabn,kn->abk", c, w))
    _close(dw, np.einsum("abk,dabn->kn", x, c))


# --------------------------------------------------------------------------- matmul_reduce_scatter


@pytest.mark.parametrize("overlap", comm.OVERLAPS)
@pytest.mark.parametrize("m,kc,nn,sd,dtype", [(16, 4, 24, 0, jnp.float32), (16, 3, 5, 0, jnp.float32),
                                              (5, 3, 16, 1, jnp.float32),
                                              (16, 8, 8, 0, jnp.bfloat16)])
def test_matmul_reduce_scatter(rng, overlap, m, kc, nn, sd, dtype):
    mesh = _mesh1()
    a = rng.standard_normal((m, 8 * kc)).astype(np.float32)  # device d holds columns [d*kc, ...)
    b = rng.standard_normal((8 * kc, nn)).astype(np.float32)
    cot = rng.standard_normal((m, nn)).astype(np.float32)
    out_spec = P("x") if sd == 0 else P(None, "x")
    fn = jax.shard_map(
        functools.partial(comm.matmul_reduce_scatter, axis_name="x", overlap=overlap, scatter_dimension=sd),
        mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=out_spec)
    args = (_put(mesh, jnp.asarray(a, dtype), P(None, "x")), _put(mesh, jnp.asarray(b, dtype), P("x")))
    z, (da, db) = _value_and_grads(fn, args, jnp.asarray(cot))
    ar, br = (np.asarray(jnp.asarray(v, dtype), np.float32) for v in (a, b))
    cr = np.asarray(jnp.asarray(cot, dtype), np.float32)
    assert z.shape == (m, nn) and z.dtype == dtype
    _close(z, ar @ br, dtype)
    _close(da, cr @ br.T, dtype)
    _close(db, ar.T @ cr, dtype)


def test_matmul_reduce_scatter_indivisible_raises():
    mesh = _mesh1()
    fn = jax.shard_map(functools.partial(comm.matmul_reduce_scatter, axis_name="x"),
                       mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"))
    with pytest.raises(ValueError, match=r"M=12.*divisible by the size 8"):
        jax.jit(fn).lower(jnp.ones((12, 16)), jnp.ones((16, 8)))


# --------------------------------------------------------------------------- lowering and memory


def _hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("overlap", ["ring", "bidirectional"])
def test_ring_lowers_to_collective_permutes(overlap):
    mesh = _mesh1()

    def step(x, w, a, b):
        y, vjp = jax.vjp(lambda x, w: comm.all_gather_matmul(x, w, "x", overlap=overlap), x, w)
        z, vjp2 = jax.vjp(lambda a, b: comm.matmul_reduce_scatter(a, b, "x", overlap=overlap), a, b)
        return y, vjp(y), z, vjp2(z)

    fn = jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P("x"), P(None, "x"), P("x")),
                       out_specs=(P("x"), (P("x"), P("x")), P("x"), (P(None, "x"), P("x"))))
    hlo = _hlo(fn, jnp.ones((32, 64)), jnp.ones((64, 16)), jnp.ones((16, 32)), jnp.ones((32, 8)))
    assert "collective-permute" in hlo
    for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
        assert op not in hlo, f"{op} found in the {overlap} schedule"
    plain = _hlo(jax.shard_map(lambda x, w: comm.all_gather_matmul(x, w, "x", overlap="none"), mesh=mesh,
                               in_specs=(P("x"), P("x")), out_specs=P("x")),
                 jnp.ones((32, 64)), jnp.ones((64, 16)))
    assert "all-gather" in plain and "collective-permute" not in plain


def test_gathered_weight_not_saved_for_backward():
    """A stack of L layers: plain autodiff keeps every gathered W for the backward, the custom_vjp
    keeps only the shards. Measured with the compiled (per-device) temp memory."""
    mesh, L, m, k = _mesh1(), 6, 8, 256

    def loss(overlap, x, ws):
        def body(x, ws):
            for w in ws:
                if overlap == "plain":
                    x = jnp.tanh(x @ lax.all_gather(w, "x", axis=0, tiled=True))
                else:
                    x = jnp.tanh(comm.all_gather_matmul(x, w, "x", overlap=overlap))
            return lax.psum(jnp.sum(x), "x")

        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P())(x, ws)

    x = jnp.ones((8 * m, k))
    ws = [jnp.full((k, k), 0.01) for _ in range(L)]
    gathered = k * k * 4  # bytes of one gathered W on one device
    temp = {o: jax.jit(jax.grad(functools.partial(loss, o), argnums=(0, 1))).lower(x, ws)
            .compile().memory_analysis().temp_size_in_bytes / gathered for o in ("plain",) + comm.OVERLAPS}
    print(f"temp memory in gathered-W units, {L} layers: {temp}")
    assert temp["plain"] >= L - 0.5
    for o in comm.OVERLAPS:
        assert temp[o] < 2.5, (o, temp)


# --------------------------------------------------------------------------- hierarchical


@pytest.mark.parametrize("axis,num_chunks,shape", [(0, 1, (4, 3)), (0, 3, (4, 3)), (1, 2, (2, 5)), (-1, 5, (2, 5))])
def test_hierarchical_all_gather(rng, axis, num_chunks, shape):
    mesh = _mesh2()
    ax = ("node", "local")
    x = rng.standard_normal((8 * shape[0],) + shape[1:]).astype(np.float32)
    cot_h = rng.standard_normal((8 * 8 * shape[0],) + shape[1:]).astype(np.float32) if axis == 0 else \
        rng.standard_normal((8 * shape[0], 8 * shape[1])).astype(np.float32)

    def both(x):
        return (comm.hierarchical_all_gather(x, ax, axis=axis, num_chunks=num_chunks),
                lax.all_gather(x, ax, axis=axis, tiled=True))

    fn = jax.shard_map(both, mesh=mesh, in_specs=P(ax), out_specs=(P(ax), P(ax)))
    g, flat, dh, df = _both_with_grads(fn, _put(mesh, x, P(ax)), jnp.asarray(cot_h))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(flat))
    _close(dh, df)  # the transposes agree too


def _both_with_grads(fn, x, cot):
    """(hierarchical, flat) outputs of fn and the gradient of each against cot, in one jit."""

    @jax.jit
    def run(x, cot):
        (h, flat), vjp = jax.vjp(fn, x)
        (dh,) = vjp((cot, jnp.zeros_like(flat)))
        (df,) = vjp((jnp.zeros_like(h), cot))
        return h, flat, dh, df

    return run(x, cot)


@pytest.mark.parametrize("sd,num_chunks,shape", [(0, 1, (16, 3)), (0, 2, (32, 3)), (1, 3, (2, 24))])
def test_hierarchical_psum_scatter(rng, sd, num_chunks, shape):
    mesh = _mesh2()
    ax = ("node", "local")
    x = rng.standard_normal((8 * shape[0],) + shape[1:]).astype(np.float32)
    out_rows = shape[0] // 8 if sd == 0 else shape[0]
    cot = rng.standard_normal((8 * out_rows,) + ((shape[1],) if sd == 0 else (shape[1] // 8,))).astype(np.float32)

    def both(x):
        return (comm.hierarchical_psum_scatter(x, ax, scatter_dimension=sd, num_chunks=num_chunks),
                lax.psum_scatter(x, ax, scatter_dimension=sd, tiled=True))

    fn = jax.shard_map(both, mesh=mesh, in_specs=P(ax), out_specs=(P(ax), P(ax)))
    r, flat, dh, df = _both_with_grads(fn, _put(mesh, x, P(ax)), jnp.asarray(cot))
    _close(r, flat)
    _close(dh, df)
    # and against the unsharded sum over the 8 per-device blocks
    want = x.reshape((8,) + shape).sum(0)
    want = want if sd == 0 else np.concatenate(np.split(want, 8, axis=1), axis=0)
    _close(r, want)


def test_plain_rings_equal_lax(rng):
    """ring_all_gather / ring_psum_scatter (the benchmark's ppermute flavour) == lax, with grads."""
    mesh = _mesh1()
    x = rng.standard_normal((8 * 4, 3)).astype(np.float32)
    cot = rng.standard_normal((8 * 32, 3)).astype(np.float32)

    def gathers(x):
        return comm.ring_all_gather(x, "x", axis=0), lax.all_gather(x, "x", axis=0, tiled=True)

    def scatters(x):
        return comm.ring_psum_scatter(x, "x"), lax.psum_scatter(x, "x", tiled=True)

    fn = jax.shard_map(gathers, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")))
    g, flat, dh, df = _both_with_grads(fn, _put(mesh, x, P("x")), jnp.asarray(cot))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(flat))
    _close(dh, df)
    x = rng.standard_normal((8 * 16, 3)).astype(np.float32)  # 16 rows per device -> 2
    fn = jax.shard_map(scatters, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")))
    r, flat, dh, df = _both_with_grads(fn, _put(mesh, x, P("x")), jnp.asarray(cot[:16]))
    _close(r, flat)
    _close(dh, df)


def test_bench_trace_stats():
    """The benchmark's overlap arithmetic on hand-made kernel intervals (no device needed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_comm

    events = [("nvjet_gemm_1", 0.0, 10.0), ("ncclDevKernel_AllGather", 5.0, 15.0),
              ("ncclDevKernel_AllGather", 12.0, 20.0), ("sm90_xmma_gemm", 18.0, 19.0), ("elementwise", 0.0, 30.0)]
    st = bench_comm.trace_stats(events, iters=1)
    assert st["gemm_us"] == 11.0 and st["coll_us"] == 15.0
    assert st["overlap"] == pytest.approx(6.0 / 15.0)


def test_bench_runs_on_cpu(tmp_path, capsys):
    """benchmarks/bench_comm.py end to end on the 8 CPU devices, one small shape, and says what
    it cannot measure here."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_comm

    out = tmp_path / "table13.json"
    bench_comm.main(["--small", "--iters", "1", "--shapes", "1", "--flavours", "xla,ring",
                     "--json", str(out), "--trace-dir", str(tmp_path / "traces")])
    res = json.loads(out.read_text())
    assert {(r["flavour"], r["collective"]) for r in res["rows"]} == {
        (f, c) for f in ("xla", "ring") for c in ("ag", "rs")}
    assert all(r["wall_gemm_us"] > 0 and "gemm_slowdown_pct" in r for r in res["rows"])
    assert any("CPU" in n for n in res["notes"])
    assert "8kx4kx4k" in capsys.readouterr().out


# --------------------------------------------------------------------------- errors


def _trace(body, mesh, in_specs, *args):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P())).trace(*args)


def test_bad_axis_names_and_options():
    m1, m2 = _mesh1(), _mesh2()
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    with pytest.raises(ValueError, match="'bogus' is not an axis"):
        _trace(lambda x, w: comm.all_gather_matmul(x, w, "bogus"), m1, (P(), P("x")), x, w)
    with pytest.raises(ValueError, match="overlap='spiral'"):
        _trace(lambda x, w: comm.all_gather_matmul(x, w, "x", overlap="spiral"), m1, (P(), P("x")), x, w)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=16 must equal the axis size 8"):
        _trace(lambda x, w: comm.all_gather_matmul(x, w, "x"), m1, (P(), P()), x, w)
    with pytest.raises(ValueError, match="pair of distinct axis names"):
        _trace(lambda x: comm.hierarchical_all_gather(x, ("node",)), m2, P(), x)
    with pytest.raises(ValueError, match="'rack' is not an axis"):
        _trace(lambda x: comm.hierarchical_psum_scatter(x, ("rack", "local")), m2, P(), x)
    with pytest.raises(ValueError, match="num_chunks=9"):
        _trace(lambda x: comm.hierarchical_all_gather(x, ("node", "local"), num_chunks=9), m2, P(), x)
    with pytest.raises(ValueError, match=r"x.shape\[1\]=3 must be divisible by the number of devices 8"):
        _trace(lambda x: comm.hierarchical_psum_scatter(x[:, :3], ("node", "local"), scatter_dimension=1),
               m2, P(), x)
