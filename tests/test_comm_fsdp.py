"""comm.fsdp (both modes) against a single-device step, on 8 simulated CPU devices; comm.flags
against the installed jaxlib.

Needs the 8 simulated CPU devices that tests/conftest.py asks for (fixture eight_devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from comm import flags, fsdp
from mlp_stack import MLPStack, mse_loss

# f32 rounding: the sharded step sums gradients in another order
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("eight_devices")


@pytest.fixture
def seed():
    s = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed={s}")  # shown on failure
    return s


def _model(seed, layers=3, d=32, hidden=64):
    return MLPStack(12, d, hidden, 5, layers, rngs=nnx.Rngs(seed))


def _batch(seed, b=16):
    rng = np.random.default_rng(seed + 1)
    return {"x": rng.standard_normal((b, 12)).astype(np.float32),
            "y": rng.standard_normal((b, 5)).astype(np.float32)}


def single_device_steps(model, batch, tx, steps):
    """The reference: the same loss and optimizer on one device, no sharding."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: mse_loss(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return params, losses


def _check_against_single_device(seed, mesh, mode, axis, layers_attr="layers"):
    tx = optax.sgd(0.1, momentum=0.9)  # not Adam: its first step g/|g| amplifies rounding of tiny grads
    batch = _batch(seed)
    want_params, want_losses = single_device_steps(_model(seed), batch, tx, steps=2)
    step = fsdp.make_train_step(_model(seed), mse_loss, tx, mesh, mode=mode, axis=axis, layers_attr=layers_attr)
    state = step.init(_model(seed))
    sharded = step.shard_batch(batch)
    losses = []
    for _ in range(2):
        state, loss = step(state, sharded)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=1e-4),
                 state.params, want_params)
    # the parameters really are sharded: the up-projection kernel [32, 64] is split along 64
    kernel = state.params["layers"][0]["up"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (32, 64 // 8)
    return step, state


@pytest.mark.parametrize("mode", fsdp.MODES)
def test_fsdp_step_matches_single_device(seed, mode):
    _check_against_single_device(seed, fsdp.make_mesh(8), mode, "fsdp")


def test_fsdp_explicit_without_layer_stack_and_explicit_mesh(seed):
    """layers_attr=None gathers everything up front; a jax.make_mesh (Explicit axes) mesh works."""
    mesh = jax.make_mesh((8,), ("data",))
    step, state = _check_against_single_device(seed, mesh, "explicit", "data", layers_attr=None)
    assert isinstance(step.model(state), MLPStack)


def test_fsdp_hierarchical_explicit(seed):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
    _check_against_single_device(seed, mesh, "explicit", ("node", "local"))


def test_fsdp_explicit_memory_stays_flat():
    """Per-device compiled temp memory of one explicit step, in units of one layer's gathered
    weights, for 2, 4 and 8 layers: constant in the number of layers."""
    d, hidden = 128, 512
    layer_bytes = (2 * d * hidden + hidden + 3 * d) * 4
    batch = {"x": np.ones((16, d), np.float32), "y": np.ones((16, d), np.float32)}
    temp = {}
    for layers in (2, 4, 8):
        model = MLPStack(d, d, hidden, d, layers, rngs=nnx.Rngs(0))
        step = fsdp.make_train_step(model, mse_loss, optax.sgd(0.1), fsdp.make_mesh(8), mode="explicit")
        state = step.init(model)
        stats = step.lower(state, step.shard_batch(batch)).compile().memory_analysis()
        temp[layers] = stats.temp_size_in_bytes / layer_bytes
    print(f"explicit FSDP temp memory in gathered layers: {temp}")
    # two gathered layers (current + prefetched) + one layer's full weight gradient before its
    # reduce-scatter + the params outside the stack; does not grow with the number of layers
    assert temp[8] - temp[2] < 0.5, temp
    assert temp[8] < 4.5, temp


class _Buffer(nnx.Variable):
    pass


class _ScaledBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.scale = _Buffer(jnp.full((16,), 0.5))  # non-Param state: replicated, no gradient

    def __call__(self, x, bias):
        return x + jnp.tanh(self.lin(x)) * self.scale[...] + bias


class _Relu(nnx.Module):  # a layer without parameters
    def __call__(self, x, bias):
        return jax.nn.relu(x)


class _ConstsModel(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([_ScaledBlock(rngs), _Relu(), _ScaledBlock(rngs)])
        self.b = nnx.Param(jnp.full((16,), 0.1))

    def __call__(self, x):
        return fsdp.apply_layers(self.layers, x, self.b * 2.0)  # a const derived from a param


def test_fsdp_explicit_consts_buffers_and_paramless_layers(seed):
    """apply_layers' consts get gradients; non-Param state and parameter-less layers work."""
    batch = {"x": np.random.default_rng(seed).standard_normal((16, 16)).astype(np.float32)}

    def loss(m, b):
        return jnp.mean((m(b["x"]) - 1.0) ** 2)

    tx = optax.sgd(0.5)
    graphdef, params, rest = nnx.split(_ConstsModel(nnx.Rngs(seed)), nnx.Param, ...)
    grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), batch))(params)
    want = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    step = fsdp.make_train_step(_ConstsModel(nnx.Rngs(seed)), loss, tx, fsdp.make_mesh(8), mode="explicit")
    state, _ = step(step.init(_ConstsModel(nnx.Rngs(seed))), step.shard_batch(batch))
    assert float(jnp.abs(want["b"][...] - 0.1).max()) > 1e-3  # b did move
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=1e-4),
                 state.params, want)


def test_shard_dim_rule():
    assert fsdp.shard_dim((32, 64), 8) == 1
    assert fsdp.shard_dim((64, 64), 8) == 0
    assert fsdp.shard_dim((5,), 8) is None
    assert fsdp.shard_dim((32, 5), 8) == 0
    assert fsdp.shard_dim((4, 12), 8) is None


class _NoApplyLayers(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:  # not through fsdp.apply_layers
            x = layer(x)
        return x


def test_fsdp_errors():
    mesh = fsdp.make_mesh(8)
    tx = optax.sgd(0.1)
    model = _model(0)
    with pytest.raises(ValueError, match=r"\['model'\] not in the mesh's axes \('fsdp',\)"):
        fsdp.make_train_step(model, mse_loss, tx, mesh, axis="model")
    with pytest.raises(ValueError, match="mode='zero3' must be one of"):
        fsdp.make_train_step(model, mse_loss, tx, mesh, mode="zero3")
    step = fsdp.make_train_step(model, mse_loss, tx, mesh, mode="explicit")
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] with shape \(12, 12\).*divide by the size 8"):
        step.shard_batch(_batch(0, b=12))
    bad = _NoApplyLayers(nnx.Rngs(0))

    def loss(m, b):
        return jnp.mean(m(b["x"]) ** 2)

    step = fsdp.make_train_step(bad, loss, tx, mesh, mode="explicit")
    with pytest.raises(ValueError, match=r"did not call comm.fsdp.apply_layers\(self.layers"):
        step(step.init(bad), step.shard_batch({"x": np.ones((8, 8), np.float32)}))


# --------------------------------------------------------------------------- flags


def test_flags_known_to_installed_jaxlib():
    wanted = flags.FSDP_GPU_FLAGS + (flags.MEMCPY_P2P_FLAG,)
    report = flags.check_flags(wanted)
    assert all(report[f] is None for f in wanted), report
    # the check can fail: a flag from older recipes that this jaxlib no longer knows
    bad = "--xla_gpu_enable_async_all_gather=true"
    assert "xla_gpu_enable_async_all_gather" in flags.check_flags([bad])[bad]
    # and the same flags as per-compilation options (what the "xla" mode passes to jax.jit)
    opts = flags.compiler_options(wanted)
    jax.jit(lambda a: a + 1, compiler_options=opts).lower(jnp.ones(3)).compile()
    with pytest.raises(Exception, match="xla_gpu_enable_async_all_gather"):
        jax.jit(lambda a: a + 1, compiler_options=flags.compiler_options(
            ["--xla_gpu_enable_async_all_gather=true"])).lower(jnp.ones(3)).compile()


def test_set_xla_flags_appends_once():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    flags.set_xla_flags(flags.FSDP_GPU_FLAGS, environ=env)
    out = flags.set_xla_flags([flags.MEMCPY_P2P_FLAG, flags.FSDP_GPU_FLAGS[0]], environ=env)
    assert out.split() == ["--xla_force_host_platform_device_count=8", *flags.FSDP_GPU_FLAGS, flags.MEMCPY_P2P_FLAG]
