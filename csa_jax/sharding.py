"""Shard-by-shard execution of an impl's forward and backward under jit (batch and head sharding).

The op is independent across batch rows and across heads given the batch row's whole kv and idx,
so every impl runs on local shards: q [B, T, H, D] split over batch and heads, kv [B, N, D] and
idx [B, T, K] over batch only (each head shard needs every kv row of its batch rows), sink [H]
over heads. The backward adds the head shards' dkv (a psum over the head axes) and the batch
shards' dsink (a psum over the batch axes). No impl ever sees a sharded array.

Which mesh axes shard batch and heads is read from q:
- Explicit mesh axes (sharding in types, `jax.make_mesh`'s default): from `jax.typeof(q).sharding`;
  the op is a `jax.shard_map` over those axes (a mesh that mixes Explicit and Auto axes: over
  its Explicit ones only; untested). Inputs that are laid out otherwise (kv or idx not
  split like q's batch, sink not split like q's heads, q split over T or D) are resharded to that
  layout first (`jax.sharding.reshard`): correct, at the cost of the collective it implies.
- Auto mesh axes (the types carry no spec): the partitioner decides the layout, so the op is a
  `custom_partitioning` call whose partition rule reads the sharding XLA propagated to q and asks
  for the layout above (the partitioner inserts whatever moves the other inputs need).
- No mesh, one device, or inside a shard_map over every axis: the impl is called directly; so
  it is under jax.vmap with Auto axes (custom_partitioning has no batching rule): correct, but
  partitioned as XLA sees fit.

A batch (head) sharding that does not divide B (H) is dropped (that dimension is gathered): still
correct, never silently wrong. Sequence (T) sharding is not done here: a q split over T is
gathered first (correct, not free), because a token's kv rows are found by global ids. The
sequence split is csa_jax/context_parallel.py (sparse_attention_cp and the layer's
CSAConfig.context_axis): a halo ppermute and a pool all-gather instead of gathering T.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["forward", "backward", "plan_axes"]

_FWD_RULE = "b t h d, b n d, b t k, h -> b t h d, b t h"
_BWD_RULE = ("b t h d, b n d, b t k, h, b t h d, b t h, b t h d, b t h "
             "-> b t h d, b n d, h")
# Only batch and heads are split; everything else stays whole on each device.
_REPLICATED_FACTORS = ("t", "d", "n", "k")


def _axes(entry):
    """One PartitionSpec entry -> a tuple of mesh axis names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes):
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def plan_axes(mesh, spec, shape, allowed=None):
    """(batch axes, head axes) of a q [B, T, H, D] with this spec: q's own batch / head axes,
    restricted to `allowed` (None: every axis), each kept only if the product of its axes'
    sizes divides that dimension (else that dimension is gathered)."""
    spec = tuple(spec) + (None,) * (4 - len(tuple(spec)))

    def keep(entry, size):
        axes = tuple(a for a in _axes(entry) if allowed is None or a in allowed)
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        return axes if axes and size % n == 0 else ()

    return keep(spec[0], shape[0]), keep(spec[2], shape[2])


def _specs(b, h):
    """PartitionSpecs of (q-like, kv-like / idx, lse-like, sink) for batch axes b, head axes h."""
    bt, ht = _entry(b), _entry(h)
    return P(bt, None, ht, None), P(bt, None, None), P(bt, None, ht), P(ht)


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _local_forward(mod, scale, interpret, config):
    def f(q, kv, idx, sink):
        return mod.forward(q, kv, idx, sink, scale=scale, interpret=interpret, config=config)
    return f


def _local_backward(mod, scale, interpret, config, b, h):
    def f(q, kv, idx, sink, o, lse, do, dlse):
        dq, dkv, dsink = mod.backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale,
                                      interpret=interpret, config=config)
        # kv is shared by every head: the head shards' contributions add up; sink is shared by
        # every batch row: the batch shards' contributions add up.
        return dq, _psum(dkv, h), _psum(dsink, b)
    return f


def _explicit_axes(x):
    """(mesh, its Explicit axes) of an array's type, or (None, ()) without any."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None, ()
    names = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
    return mesh, names


# ----------------------------------------------------------------------------- Explicit axes

def _shard_map_call(local, mesh, names, args, in_specs, out_specs):
    """reshard every input to its spec, then shard_map `local` over the Explicit axes."""
    args = [jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs)]
    fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                       axis_names=frozenset(names), check_vma=False)
    return fn(*args)


# ----------------------------------------------------------------------------- Auto axes

def _q_axes(mesh, arg_shapes):
    q = arg_shapes[0]
    sharding = q.sharding
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    return plan_axes(mesh, spec, q.shape)


def _fwd_partition(mod, scale, interpret, config, mesh, arg_shapes, result_shape):
    del result_shape
    b, h = _q_axes(mesh, arg_shapes)
    sq, skv, slse, ss = (NamedSharding(mesh, s) for s in _specs(b, h))
    return (mesh, _local_forward(mod, scale, interpret, config), (sq, slse),
            (sq, skv, skv, ss))


def _bwd_partition(mod, scale, interpret, config, mesh, arg_shapes, result_shape):
    del result_shape
    b, h = _q_axes(mesh, arg_shapes)
    sq, skv, slse, ss = (NamedSharding(mesh, s) for s in _specs(b, h))
    return (mesh, _local_backward(mod, scale, interpret, config, b, h), (sq, skv, ss),
            (sq, skv, skv, ss, sq, slse, sq, slse))


@functools.partial(custom_partitioning, static_argnums=(0, 1, 2, 3))
def _cp_forward(mod, scale, interpret, config, q, kv, idx, sink):
    return _local_forward(mod, scale, interpret, config)(q, kv, idx, sink)


@functools.partial(custom_partitioning, static_argnums=(0, 1, 2, 3))
def _cp_backward(mod, scale, interpret, config, *args):
    return _local_backward(mod, scale, interpret, config, (), ())(*args)


_cp_forward.def_partition(_fwd_partition, sharding_rule=_FWD_RULE,
                          need_replication_factors=_REPLICATED_FACTORS)
_cp_backward.def_partition(_bwd_partition, sharding_rule=_BWD_RULE,
                           need_replication_factors=_REPLICATED_FACTORS)


def _auto_mesh(q):
    sharding = getattr(jax.typeof(q), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    if all(t == AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh


def _partitioned(cp_fn, whole_fn, static, args):
    """cp_fn(*static, *args), with a vmap rule: custom_partitioning has no batching rule, so
    under jax.vmap the impl runs whole on the batched arrays (whole_fn vmapped, as without
    this module: correct, partitioned as XLA sees fit)."""
    @jax.custom_batching.custom_vmap
    def op(*args):
        return tuple(cp_fn(*static, *args))

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size
        out = jax.vmap(whole_fn, in_axes=[0 if b else None for b in in_batched])(*args)
        return tuple(out), (True,) * len(out)

    return op(*args)


# ----------------------------------------------------------------------------- entry points

def forward(mod, q, kv, idx, sink, *, scale, interpret, config):
    """mod.forward shard by shard (see the module docstring): (o, lse)."""
    mesh, names = _explicit_axes(q)
    if names:
        b, h = plan_axes(mesh, jax.typeof(q).sharding.spec, q.shape, allowed=names)
        sq, skv, slse, ss = _specs(b, h)
        return _shard_map_call(_local_forward(mod, scale, interpret, config), mesh, names,
                               (q, kv, idx, sink), (sq, skv, skv, ss), (sq, slse))
    if _auto_mesh(q) is not None:
        return _partitioned(_cp_forward, _local_forward(mod, scale, interpret, config),
                            (mod, scale, interpret, config), (q, kv, idx, sink))
    return _local_forward(mod, scale, interpret, config)(q, kv, idx, sink)


def backward(mod, q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
    """mod.backward shard by shard, the shards' dkv / dsink added up: (dq, dkv, dsink)."""
    mesh, names = _explicit_axes(q)
    args = (q, kv, idx, sink, o, lse, do, dlse)
    if names:
        b, h = plan_axes(mesh, jax.typeof(q).sharding.spec, q.shape, allowed=names)
        sq, skv, slse, ss = _specs(b, h)
        return _shard_map_call(_local_backward(mod, scale, interpret, config, b, h), mesh,
                               names, args, (sq, skv, skv, ss, sq, slse, sq, slse),
                               (sq, skv, ss))
    if _auto_mesh(q) is not None:
        return _partitioned(_cp_backward,
                            _local_backward(mod, scale, interpret, config, (), ()),
                            (mod, scale, interpret, config), args)
    return _local_backward(mod, scale, interpret, config, (), ())(*args)
