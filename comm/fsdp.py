"""FSDP for Flax NNX models: parameters sharded over a mesh axis, two modes behind one switch.

    from comm import fsdp
    mesh = fsdp.make_mesh()                         # every device on one "fsdp" axis (Auto)
    step = fsdp.make_train_step(model, loss_fn, optax.adamw(1e-3), mesh, mode="explicit")
    state = step.init(model)                        # params + optimizer state, sharded
    state, loss = step(state, batch)                # one optimizer step; loss is the global mean
    model = step.model(state)                       # an nnx.Module again (gathered), for eval/saving

`loss_fn(model, batch) -> scalar` is the mean loss over the batch; `batch` is a pytree of arrays
whose leading (batch) dimension is split over the FSDP axis (data parallel), so it must divide
by the axis size. The same step on one device gives the same numbers within f32 rounding.

The step donates the state it is given (pass donate=False to keep using it); state mutations
made inside the model during the step (RNG counters, running statistics) are discarded.

Sharding rule, from the params' partition metadata: a model whose params carry logical axis
names (`nnx.with_partitioning`, as csa_jax.layers and train.model do) has each nnx.Param split
along the first of its dims whose name maps to the FSDP axis through `rules` ((logical name,
mesh axis) pairs; the alias "fsdp" stands for a hierarchical axis pair) and whose size the axis
size divides (`logical_to_mesh`); a param without such a dim, or without names, stays
replicated and its gradient is summed with a psum. A model with no partition metadata at all
falls back to the shape rule `shard_dim` (the largest dimension the axis size divides). Other
state (non-Param variables) is replicated, passed through unchanged and gets no gradient.

Modes (`mode=`, what the training CLI exposes as `--fsdp xla|explicit`):

  "xla"       params live as NamedSharding arrays and jit's partitioner inserts the all-gathers
              and reduce-scatters; compiled with the latency-hiding scheduler and collective
              pipelining on (comm.flags.FSDP_GPU_FLAGS as compile options; CPU ignores them).
  "explicit"  the step is a shard_map: parameters outside the layer stack are all-gathered once
              at the start; the layer stack (`model.<layers_attr>`, default `model.layers`) runs
              through one custom_vjp that gathers layer i+1's weights while layer i computes
              (an optimization barrier lets that gather start only once layer i's input exists,
              so no gather is hoisted to the start of the step), saves only the shards and
              each layer's input, regathers in the backward (prefetching layer i-1 while layer
              i's backward runs) and reduce-scatters each layer's gradient as soon as it exists.
              Peak memory stays about two layers' gathered weights however many layers.
              With axis=("node", "local") the gathers and reduce-scatters are the hierarchical
              ones (comm.hierarchical_all_gather / hierarchical_psum_scatter).

To get the per-layer schedule a model calls `fsdp.apply_layers(self.layers, x, *consts)`
instead of looping over its layers itself (outside an explicit step this is that plain loop).
Each layer is called as `x = layer(x, *consts)` and must return x's structure; `consts` (masks,
positions, ...) are passed to every layer and do get gradients. A model without a `layers`
attribute works too, with all its params gathered at the start (correct, memory not flat).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from comm import collectives, flags

__all__ = [
    "MODES",
    "FSDPState",
    "TrainStep",
    "apply_layers",
    "make_mesh",
    "has_partition_metadata",
    "logical_to_mesh",
    "make_train_step",
    "shard_dim",
    "shardings_from_metadata",
]

MODES = ("xla", "explicit")


# --------------------------------------------------------------------------- sharding rule


def shard_dim(shape: Sequence[int], n: int) -> int | None:
    """The dimension of a param of this shape split over n devices: the largest one n divides
    (the first when tied), or None (replicated)."""
    best = None
    for d, size in enumerate(shape):
        if size >= n and size % n == 0 and (best is None or size > shape[best]):
            best = d
    return best


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _names(x) -> tuple | None:
    """The logical axis names in a Variable's partition metadata, or None."""
    names = x.get_metadata().get("out_sharding") if _is_var(x) else None
    return tuple(names) if names else None


def _shape(x) -> tuple:
    return tuple(jnp.shape(x[...] if _is_var(x) else x))


def _resolve(names, shape, sizes, rules) -> list:
    """Per dim: the mesh axis it is split over, or None (see logical_to_mesh)."""
    rules = dict(rules or {})
    used, out = set(), []
    for name, size in zip(names, shape):
        axis = rules.get(name, name) if name is not None else None
        if axis is None or axis not in sizes or axis in used or size % sizes[axis]:
            out.append(None)
        else:
            out.append(axis)
            used.add(axis)
    return out


def logical_to_mesh(names, shape, mesh: Mesh, rules=None) -> P:
    """The PartitionSpec of a param of this shape whose dims carry logical axis `names`
    (nnx.with_partitioning metadata, read with nnx.get_partition_spec). Each name maps to a mesh
    axis through `rules` (a dict or (logical, mesh axis) pairs; a name without a rule is taken as
    a mesh axis itself, None as unsplit); a dim keeps that axis only if the mesh has it, no
    earlier dim of the param took it, and its size divides the dim."""
    return P(*_resolve(names, shape, dict(mesh.shape), rules))


def _map_params(f, tree):
    """f(x) for every param of tree, x being the nnx.Variable (so that its metadata is seen) or a
    plain array; the result keeps tree's structure (a Variable holds f's value)."""
    return jax.tree.map(lambda x: x.replace(f(x)) if _is_var(x) else f(x), tree, is_leaf=_is_var)


def shardings_from_metadata(tree, mesh: Mesh, rules=None):
    """NamedShardings for every param of an nnx.State from its partition metadata (for jit /
    device_put, e.g. FSDP x tensor parallelism on a ("fsdp", "tensor") mesh); params without
    metadata and plain arrays are replicated."""
    def sharding(x):
        names = _names(x)
        spec = logical_to_mesh(names, _shape(x), mesh, rules) if names else P()
        return NamedSharding(mesh, spec)
    return _map_params(sharding, tree)


def has_partition_metadata(tree) -> bool:
    """Whether any Variable of the tree carries logical axis names."""
    return any(_names(x) for x in jax.tree.leaves(tree, is_leaf=_is_var) if _is_var(x))


def _fsdp_dim(x, n: int, axis, rules, annotated: bool) -> int:
    """The dim of param x split over the FSDP axis of size n, or -1 (replicated)."""
    if not annotated:
        d = shard_dim(_shape(x), n)
        return -1 if d is None else d
    names = _names(x)
    if not names:
        return -1
    target = axis if isinstance(axis, str) else "fsdp"
    resolved = _resolve(names, _shape(x), {target: n}, rules)
    return resolved.index(target) if target in resolved else -1


def _dim_spec(d: int, axis) -> P:
    return P() if d < 0 else P(*([None] * d + [axis]))


def make_mesh(num_devices: int | None = None, axis: str = "fsdp", *, devices=None) -> Mesh:
    """A 1-D mesh over the first num_devices devices (all by default), with an Auto axis."""
    devices = list(jax.devices() if devices is None else devices)
    num_devices = len(devices) if num_devices is None else num_devices
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"{num_devices=} must be in [1, {len(devices)}] (the devices available)")
    return Mesh(np.array(devices[:num_devices]), (axis,), axis_types=(AxisType.Auto,))


def _auto_mesh(mesh: Mesh) -> Mesh:
    # jax.make_mesh defaults to Explicit axes (sharding in types); FSDP wants the partitioner
    # to place collectives, so use the same devices with Auto axes.
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _axis_tuple(axis) -> tuple[str, ...]:
    return axis if isinstance(axis, tuple) else (axis,)


# --------------------------------------------------------------------------- gather / scatter


def _gather(s, d: int, axis):
    if d < 0:
        return s
    if isinstance(axis, tuple):
        return collectives.hierarchical_all_gather(s, axis, axis=d)
    return lax.all_gather(s, axis, axis=d, tiled=True)


def _scatter(g, d: int, axis):
    if d < 0:  # replicated: the psum comes from the transpose of the pcast to varying
        return g
    if isinstance(axis, tuple):
        return collectives.hierarchical_psum_scatter(g, axis, scatter_dimension=d)
    return lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True)


# --------------------------------------------------------------------------- the layer stack


@dataclasses.dataclass
class _Explicit:
    axis: Any
    n: int
    layer_dims: list  # per layer: {param path inside the layer: sharded dim or -1}
    used: bool = False


_CTX: contextvars.ContextVar[_Explicit | None] = contextvars.ContextVar("comm_fsdp_explicit", default=None)


def _path_key(path) -> tuple:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
        else:
            out.append(str(k))
    return tuple(out)


def _flat_dims(tree, dims_of) -> list[tuple[tuple, int]]:
    return [(_path_key(p), dims_of(p, leaf)) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def apply_layers(layers, x, *consts):
    """x = layer(x, *consts) for each layer in order. Inside an explicit FSDP step, the layers'
    weights are gathered one layer ahead and never saved for the backward (see module doc)."""
    ctx = _CTX.get()
    if ctx is None:
        for layer in layers:
            x = layer(x, *consts)
        return x
    layers = list(layers)
    if len(layers) != len(ctx.layer_dims):
        raise ValueError(f"apply_layers got {len(layers)} layers but the model's layer stack has "
                         f"{len(ctx.layer_dims)}: pass the same sequence (model.layers)")
    ctx.used = True
    parts = [nnx.split(layer, nnx.Param, ...) for layer in layers]
    graphdefs = [p[0] for p in parts]
    shards = [p[1] for p in parts]  # the local shards the step merged into the model
    rests = [p[2] for p in parts]
    dims = []
    for i, s in enumerate(shards):
        table = ctx.layer_dims[i]
        leaves, treedef = jax.tree_util.tree_flatten_with_path(s)
        dims.append(jax.tree_util.tree_unflatten(treedef, [table[_path_key(p)] for p, _ in leaves]))
    return _layer_stack(graphdefs, rests, dims, ctx.axis)(shards, x, consts)


def _layer_stack(graphdefs, rests, dims, axis):
    """custom_vjp over the whole stack: residuals are the shards and each layer's input."""
    num = len(graphdefs)

    def layer_fn(i):
        def f(params, x, consts):
            return nnx.merge(graphdefs[i], params, rests[i])(x, *consts)
        return f

    def gather(i, shard):
        return jax.tree.map(lambda s, d: _gather(s, d, axis), shard, dims[i])

    def fwd(shards, x, consts):
        xs = []
        g = gather(0, shards[0])
        for i in range(num):
            if i + 1 < num:
                # Prefetch: layer i+1's gather may start as soon as layer i's input exists (and
                # not before: the barrier keeps the scheduler from hoisting every gather to the
                # start of the step), so it is in flight while layer i computes.
                s_next, x = lax.optimization_barrier((shards[i + 1], x))
                g_next = gather(i + 1, s_next)
            xs.append(x)
            x = layer_fn(i)(g, x, consts)
            if i + 1 < num:
                g = g_next
        return x, (shards, xs, consts)

    def bwd(res, dy):
        shards, xs, consts = res
        dshards = [None] * num
        dconsts = jax.tree.map(jnp.zeros_like, consts)
        g = gather(num - 1, shards[num - 1])
        for i in reversed(range(num)):
            if i > 0:  # prefetch layer i-1 while layer i's backward runs
                s_prev, dy = lax.optimization_barrier((shards[i - 1], dy))
                g_prev = gather(i - 1, s_prev)
            _, vjp = jax.vjp(layer_fn(i), g, xs[i], consts)  # recomputes layer i's forward
            dg, dy, dc = vjp(dy)
            dshards[i] = jax.tree.map(lambda t, d: _scatter(t, d, axis), dg, dims[i])
            dconsts = jax.tree.map(jnp.add, dconsts, dc)
            if i > 0:
                g = g_prev
        return dshards, dy, dconsts

    @jax.custom_vjp
    def stack(shards, x, consts):
        return fwd(shards, x, consts)[0]

    stack.defvjp(fwd, bwd)
    return stack


# --------------------------------------------------------------------------- train step


class FSDPState(NamedTuple):
    params: Any  # nnx.State of nnx.Param, sharded
    opt_state: Any
    rest: Any  # nnx.State of every other variable, replicated


@dataclasses.dataclass
class TrainStep:
    """What make_train_step returns; call it as `state, loss = step(state, batch)`."""

    graphdef: Any
    loss_fn: Callable
    tx: optax.GradientTransformation
    mesh: Mesh
    mode: str
    axis: Any
    layers_attr: str | None
    n: int
    num_layers: int
    donate: bool = True
    rules: Any = None  # logical axis name -> mesh axis (see logical_to_mesh)
    annotated: bool = False  # the model's params carry partition metadata
    _jitted: Callable = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        opts = flags.compiler_options(flags.FSDP_GPU_FLAGS) if self.mode == "xla" else None
        self._jitted = jax.jit(self._step, compiler_options=opts, donate_argnums=(0,) if self.donate else ())

    # ---- placement
    def dims(self, tree):
        """Per param of tree (params, or optimizer state mirroring them): the sharded dim or -1."""
        return _map_params(lambda x: _fsdp_dim(x, self.n, self.axis, self.rules, self.annotated), tree)

    def param_sharding(self, params):
        return jax.tree.map(lambda d: NamedSharding(self.mesh, _dim_spec(d, self.axis)), self.dims(params))

    def batch_sharding(self, batch):
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P(self.axis)), batch)

    def init(self, model) -> FSDPState:
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params = jax.device_put(params, self.param_sharding(params))
        rest = jax.device_put(rest, NamedSharding(self.mesh, P()))
        opt_state = jax.jit(self.tx.init)(params)
        return FSDPState(params, opt_state, rest)

    def shard_batch(self, batch):
        """Places a host / single-device batch with its leading dimension split over the axis."""
        self._check_batch(batch)
        return jax.device_put(batch, self.batch_sharding(batch))

    def model(self, state: FSDPState):
        """The model with the state's parameters (arrays stay sharded; jit gathers on use)."""
        return nnx.merge(self.graphdef, state.params, state.rest)

    def __call__(self, state: FSDPState, batch):
        self._check_batch(batch)
        return self._jitted(state, batch)

    def lower(self, state: FSDPState, batch):
        """jax.jit(...).lower for the step, e.g. for `.compile().memory_analysis()`."""
        return self._jitted.lower(state, batch)

    # ---- the step
    def _check_batch(self, batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % self.n:
                raise ValueError(
                    f"batch leaf {jax.tree_util.keystr(path)} with shape {np.shape(leaf)}: the leading "
                    f"(batch) dimension must divide by the size {self.n} of FSDP axis {self.axis!r}")

    def _step(self, state: FSDPState, batch):
        params, opt_state, rest = state
        if self.mode == "xla":
            loss, grads = self._xla_grads(params, rest, batch)
        else:
            loss, grads = self._explicit_grads(params, rest, batch)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = jax.lax.with_sharding_constraint(params, self.param_sharding(params))
        # the optimizer state keeps its params' layout (else XLA may split the moments of a
        # replicated param)
        opt_state = jax.lax.with_sharding_constraint(opt_state, self.param_sharding(opt_state))
        return FSDPState(params, opt_state, rest), loss

    def _xla_grads(self, params, rest, batch):
        batch = jax.lax.with_sharding_constraint(batch, self.batch_sharding(batch))

        def loss(params):
            return self.loss_fn(nnx.merge(self.graphdef, params, rest), batch)

        return jax.value_and_grad(loss)(params)

    def _layer_dims(self, params):
        if self.layers_attr is None or self.layers_attr not in params:
            return None
        stack = self.dims(params)[self.layers_attr]
        # a layer without params (an activation, say) has no entry in the state
        return [dict(_flat_dims(stack[i], lambda p, d: d)) if i in stack else {}
                for i in range(self.num_layers)]

    def _explicit_grads(self, params, rest, batch):
        axis, n = self.axis, self.n
        dims = self.dims(params)
        specs = jax.tree.map(lambda d: _dim_spec(d, axis), dims)
        layer_dims = self._layer_dims(params)
        in_layers = self._in_layers_mask(params) if layer_dims is not None else jax.tree.map(lambda _: False, params)

        def body(params, rest, batch):
            def local_loss(params):
                params = jax.tree.map(lambda p: collectives.to_varying(p, axis), params)
                # outer params gathered now; layer params stay shards for apply_layers
                full = jax.tree.map(lambda p, d, lay: p if lay else _gather(p, d, axis), params, dims, in_layers)
                model = nnx.merge(self.graphdef, full, rest)
                ctx = _Explicit(axis, n, layer_dims) if layer_dims is not None else None
                token = _CTX.set(ctx)
                try:
                    loss = self.loss_fn(model, batch)
                except Exception as e:
                    if ctx is not None and not ctx.used:
                        raise ValueError(
                            f"the model has a layer stack model.{self.layers_attr} but did not call "
                            f"comm.fsdp.apply_layers(self.{self.layers_attr}, x, ...), which explicit "
                            f"FSDP needs (or pass layers_attr=None): {e}") from e
                    raise
                finally:
                    _CTX.reset(token)
                return loss / n

            loss, grads = jax.value_and_grad(local_loss)(params)
            return lax.psum(loss, axis), grads

        batch_specs = jax.tree.map(lambda _: P(axis), batch)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(), batch_specs), out_specs=(P(), specs))
        return fn(params, rest, batch)

    def _in_layers_mask(self, params):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        mask = [bool(_path_key(p)) and _path_key(p)[0] == self.layers_attr for p, _ in leaves]
        return jax.tree_util.tree_unflatten(treedef, mask)


def make_train_step(model, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, *,
                    mode: str = "xla", axis="fsdp", layers_attr: str | None = "layers",
                    donate: bool = True, rules=None) -> TrainStep:
    """An FSDP train step for this NNX model's structure (see the module docstring).

    axis: the mesh axis to shard over, or a pair ("node", "local") for hierarchical collectives
    (explicit mode) / a 2-D split (xla mode). layers_attr: the model attribute holding the layer
    stack that explicit mode gathers layer by layer, or None to gather everything up front.
    donate: the step donates the state passed in (its buffers are reused for the new state).
    rules: (logical axis name, mesh axis) pairs for params with partition metadata, e.g.
    csa_jax.layers.LOGICAL_AXIS_RULES; the FSDP axis is `axis` (or "fsdp" for a pair)."""
    if mode not in MODES:
        raise ValueError(f"{mode=} must be one of {MODES}")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = _axis_tuple(axis)
    if isinstance(axis, tuple) and len(axis) != 2:
        raise ValueError(f"{axis=} must be one mesh axis name or a pair (outer, inner)")
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"FSDP {axis=}: {missing} not in the mesh's axes {mesh.axis_names}")
    mesh = _auto_mesh(mesh)
    n = int(np.prod([mesh.shape[a] for a in names]))
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    num_layers = 0
    if layers_attr is not None and layers_attr in params:
        stack = getattr(model, layers_attr, None)
        if not isinstance(stack, Sequence) or not all(isinstance(m, nnx.Module) for m in stack):
            raise ValueError(f"model.{layers_attr} must be a sequence of nnx.Module (e.g. nnx.List), "
                             f"got {type(stack).__name__}; or pass layers_attr=None")
        num_layers = len(stack)
    return TrainStep(graphdef, loss_fn, tx, mesh, mode, axis, layers_attr, n, num_layers, donate,
                     rules=rules, annotated=has_partition_metadata(params))
