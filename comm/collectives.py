"""Overlapped and hierarchical collectives, for use inside `jax.shard_map` bodies.

    y = all_gather_matmul(x, w_shard, axis_name, *, overlap="ring")
        x [..., K] this device's activations; w_shard [K/n, N] this device's rows of W
        -> x @ W  [..., N]          (W = lax.all_gather(w_shard, axis_name, tiled=True))
    z = matmul_reduce_scatter(a, b, axis_name, *, overlap="ring", scatter_dimension=0)
        a [M, Kc], b [Kc, N] per device -> lax.psum_scatter(a @ b, axis_name,
        scatter_dimension=scatter_dimension, tiled=True)   [M/n, N] or [M, N/n]
    g = hierarchical_all_gather(x, ("node", "local"), *, axis=0, num_chunks=1)
        == lax.all_gather(x, ("node", "local"), axis=axis, tiled=True)
    r = hierarchical_psum_scatter(x, ("node", "local"), *, scatter_dimension=0, num_chunks=1)
        == lax.psum_scatter(x, ("node", "local"), scatter_dimension=..., tiled=True)

`overlap` (the two matmul ops):
  "none"           the plain lax collective, then the matmul (XLA may still overlap it with
                   unrelated work);
  "ring"           n-1 `ppermute` steps around the axis; the matmul on the block a device holds
                   runs while the next block is in flight, so the weight is never gathered whole;
  "bidirectional"  the payload is split in two halves (along N for all_gather_matmul and for
                   scatter_dimension=0, along M for scatter_dimension=1) that travel two rings in
                   opposite directions, so each link carries half the bytes per step.

Both matmul ops are `custom_vjp`s whose residuals are only their own inputs (the shards): the
backward regathers the weight with the same schedule instead of keeping the gathered copy alive.
Gradients equal those of the plain lax version. Inputs that do not vary over `axis_name` are first
cast to varying (`lax.pcast`), outside the `custom_vjp`, so autodiff inserts the matching `psum`.

Shapes that do not divide: all_gather_matmul accepts any M and N (K must be n * w_shard.shape[0]);
matmul_reduce_scatter needs the scattered dimension divisible by n and raises a ValueError
otherwise (no silent padding: the tiled output shape would be ambiguous). The hierarchical ops
accept any chunk count up to the per-device size of the chunked dimension (chunks may be uneven).

Accumulation: ring matmuls sum the per-block partial products in f32 and cast once at the end;
the reduce-scatter ring passes its running sum in the output dtype, as NCCL does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "OVERLAPS",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "hierarchical_all_gather",
    "hierarchical_psum_scatter",
    "ring_all_gather",
    "ring_psum_scatter",
    "ring_blocks",
    "axis_size",
    "to_varying",
]

OVERLAPS = ("none", "ring", "bidirectional")


# --------------------------------------------------------------------------- checks and helpers


def axis_size(axis_name) -> int:
    """Size of a bound mesh axis (or the product over a tuple of axes); a clear error otherwise."""
    if not isinstance(axis_name, (str, tuple)) or (
        isinstance(axis_name, tuple) and not all(isinstance(a, str) for a in axis_name)
    ):
        raise ValueError(f"{axis_name=} must be a mesh axis name (str) or a tuple of names")
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"{axis_name=} is not an axis of the enclosing jax.shard_map mesh "
            "(comm ops must run inside a shard_map body over that axis)"
        ) from e


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.11
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older / newer spelling


def to_varying(x, axis_name):
    """`lax.pcast(x, ..., to="varying")` over the axes of `axis_name` that x does not vary over."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = tuple(a for a in names if a not in _varying_axes(x))
    if not missing:
        return x
    try:
        return lax.pcast(x, missing, to="varying")
    except ValueError:  # check_vma=False: nothing is typed varying and no cast is needed
        return x


def _check_overlap(overlap):
    if overlap not in OVERLAPS:
        raise ValueError(f"{overlap=} must be one of {OVERLAPS}")


def _ring_perm(n: int, shift: int):
    return [(j, (j + shift) % n) for j in range(n)]


def ring_blocks(shard, axis_name, *, shift: int = 1) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Yields (block index, block) for the n blocks of a ring all-gather of `shard` over
    `axis_name` (a traced index: the block of device (i - shift * step) % n), each block's
    transfer issued before the previous block is handed out, so whatever the caller computes on
    a block overlaps the next one's transfer. Differentiable by autodiff (ppermute transposes to
    the reverse ring)."""
    return _ring_blocks(to_varying(shard, axis_name), axis_name, axis_size(axis_name), shift)


def _ring_blocks(shard, axis_name, n: int, shift: int) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Yields (block index, block) for the n blocks of a ring all-gather.

    Each device sends what it holds to device (i + shift) % n, so at step s device i holds block
    (i - shift * s) % n. The send of step s is issued before the block is yielded: the consumer's
    matmul on it does not depend on the transfer, so the two can overlap.
    """
    idx = lax.axis_index(axis_name)
    perm = _ring_perm(n, shift)
    cur = shard
    for s in range(n):
        nxt = lax.ppermute(cur, axis_name, perm) if s < n - 1 else None
        yield (idx - shift * s) % n, cur
        cur = nxt


def _ring_reduce_scatter(partial, axis_name, n: int, shift: int, dtype):
    """sum over devices of partial(i) lands on device i, via n-1 `ppermute` steps.

    The running sum that device i holds at step s is for block (i - shift * (s + 1)) % n, and it
    goes to device i + shift, which adds its own partial for the same block next step; at the
    last step every device adds its partial for its own block. partial(blk) never depends on
    the incoming sum, so each step's matmul overlaps the transfer.
    """
    idx = lax.axis_index(axis_name)
    perm = _ring_perm(n, shift)
    acc = partial((idx - shift) % n).astype(dtype)
    for s in range(1, n):
        p = partial((idx - shift * (s + 1)) % n)
        acc = (lax.ppermute(acc, axis_name, perm).astype(jnp.float32) + p).astype(dtype)
    return acc


def _dot(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _split_half(size: int) -> int:
    return size - size // 2  # first half gets the extra element when odd


# --------------------------------------------------------------------------- all_gather_matmul


def _agmm_ring_fwd(x, w, axis_name, n, shift):
    kn = w.shape[0]
    acc = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)  # [M, N]
    for blk, wb in _ring_blocks(w, axis_name, n, shift):
        acc = acc + _dot(lax.dynamic_slice_in_dim(x, blk * kn, kn, axis=1), wb)
    return acc


def _agmm_ring_bwd(x, w, dy, axis_name, n, shift):
    kn = w.shape[0]
    dx = jnp.zeros(x.shape, jnp.float32)  # [M, K]: one K/n column block per ring step
    for blk, wb in _ring_blocks(w, axis_name, n, shift):
        dx = lax.dynamic_update_slice_in_dim(dx, _dot(dy, wb.T), blk * kn, axis=1)
    dw = _ring_reduce_scatter(  # [K/n, N] = psum_scatter(x^T dy) over K
        lambda blk: _dot(lax.dynamic_slice_in_dim(x, blk * kn, kn, axis=1).T, dy),
        axis_name, n, -shift, w.dtype)
    return dx, dw


def _agmm_fwd_impl(x, w, axis_name, schedule):
    # x [M, K]; w [K/n, N]. Tying the weight to this call's input keeps the transfers of a
    # multi-layer program from all being hoisted to its start (they depend only on weights).
    w, x = lax.optimization_barrier((w, x))
    n = axis_size(axis_name)
    if schedule == "none":
        y = _dot(x, lax.all_gather(w, axis_name, axis=0, tiled=True))
    elif schedule == "ring":
        y = _agmm_ring_fwd(x, w, axis_name, n, +1)
    else:  # two rings, each carrying half of W's columns
        h = _split_half(w.shape[1])
        y = jnp.concatenate([_agmm_ring_fwd(x, w[:, :h], axis_name, n, +1),
                             _agmm_ring_fwd(x, w[:, h:], axis_name, n, -1)], axis=1)
    return y.astype(jnp.result_type(x, w))


def _agmm_bwd_impl(axis_name, schedule, res, dy):
    x, w = res  # the shards only: W is regathered below, never saved
    w, dy = lax.optimization_barrier((w, dy))
    n = axis_size(axis_name)
    if schedule == "none":
        dx = _dot(dy, lax.all_gather(w, axis_name, axis=0, tiled=True).T)
        dw = lax.psum_scatter(_dot(x.T, dy).astype(w.dtype), axis_name, scatter_dimension=0, tiled=True)
    elif schedule == "ring":
        dx, dw = _agmm_ring_bwd(x, w, dy, axis_name, n, +1)
    else:
        h = _split_half(w.shape[1])
        dx_a, dw_a = _agmm_ring_bwd(x, w[:, :h], dy[:, :h], axis_name, n, +1)
        dx_b, dw_b = _agmm_ring_bwd(x, w[:, h:], dy[:, h:], axis_name, n, -1)
        dx, dw = dx_a + dx_b, jnp.concatenate([dw_a, dw_b], axis=1)
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _agmm_core(x, w, axis_name: Hashable, schedule: str):
    return _agmm_fwd_impl(x, w, axis_name, schedule)


_agmm = jax.custom_vjp(_agmm_core, nondiff_argnums=(2, 3))
_agmm.defvjp(lambda x, w, axis_name, schedule: (_agmm_fwd_impl(x, w, axis_name, schedule), (x, w)),
             _agmm_bwd_impl)


def _schedule(overlap: str, n: int, split_size: int) -> str:
    if n == 1 or overlap == "none":
        return "none"
    if overlap == "bidirectional" and split_size < 2:  # nothing to split in two
        return "ring"
    return overlap


def all_gather_matmul(x, w_shard, axis_name, *, overlap: str = "ring"):
    """x @ all_gather(w_shard, axis_name, axis=0, tiled=True), without materializing the gather
    when overlap is "ring" or "bidirectional". x [..., K]; w_shard [K/n, N] -> [..., N]."""
    _check_overlap(overlap)
    n = axis_size(axis_name)
    if w_shard.ndim != 2 or x.ndim < 1:
        raise ValueError(f"w_shard must be 2-D [K/n, N] and x [..., K]; got {x.shape=} {w_shard.shape=}")
    kn, nn = w_shard.shape
    if x.shape[-1] != n * kn:
        raise ValueError(
            f"x.shape[-1]={x.shape[-1]} must equal the axis size {n} of {axis_name!r} times "
            f"w_shard.shape[0]={kn} (x holds the full K, w_shard this device's K/n rows)"
        )
    lead = x.shape[:-1]
    x2 = to_varying(x.reshape(-1, x.shape[-1]), axis_name)  # [M, K]
    w = to_varying(w_shard, axis_name)
    y = _agmm(x2, w, axis_name, _schedule(overlap, n, nn))
    return y.reshape(*lead, nn)


# --------------------------------------------------------------------------- matmul_reduce_scatter


def _mrs_ring_fwd(a, b, axis_name, n, shift, sd, dtype):
    if sd == 0:
        mb = a.shape[0] // n
        partial = lambda blk: _dot(lax.dynamic_slice_in_dim(a, blk * mb, mb, axis=0), b)  # noqa: E731
    else:
        nb = b.shape[1] // n
        partial = lambda blk: _dot(a, lax.dynamic_slice_in_dim(b, blk * nb, nb, axis=1))  # noqa: E731
    return _ring_reduce_scatter(partial, axis_name, n, shift, dtype)


def _mrs_ring_bwd(a, b, dz, axis_name, n, shift, sd):
    # The cotangent of a @ b is all_gather(dz): ring-gather dz's blocks instead.
    da = jnp.zeros(a.shape, jnp.float32)
    db = jnp.zeros(b.shape, jnp.float32)
    if sd == 0:
        mb = dz.shape[0]
        for blk, g in _ring_blocks(dz, axis_name, n, shift):  # g [M/n, N]
            da = lax.dynamic_update_slice_in_dim(da, _dot(g, b.T), blk * mb, axis=0)
            db = db + _dot(lax.dynamic_slice_in_dim(a, blk * mb, mb, axis=0).T, g)
    else:
        nb = dz.shape[1]
        for blk, g in _ring_blocks(dz, axis_name, n, shift):  # g [M, N/n]
            da = da + _dot(g, lax.dynamic_slice_in_dim(b, blk * nb, nb, axis=1).T)
            db = lax.dynamic_update_slice_in_dim(db, _dot(a.T, g), blk * nb, axis=1)
    return da, db


def _mrs_fwd_impl(a, b, axis_name, schedule, sd):
    a, b = lax.optimization_barrier((a, b))
    n = axis_size(axis_name)
    dtype = jnp.result_type(a, b)
    if schedule == "none":
        return lax.psum_scatter(_dot(a, b).astype(dtype), axis_name, scatter_dimension=sd, tiled=True)
    if schedule == "ring":
        return _mrs_ring_fwd(a, b, axis_name, n, -1, sd, dtype)
    if sd == 0:  # halves of N travel opposite rings
        h = _split_half(b.shape[1])
        return jnp.concatenate([_mrs_ring_fwd(a, b[:, :h], axis_name, n, -1, 0, dtype),
                                _mrs_ring_fwd(a, b[:, h:], axis_name, n, +1, 0, dtype)], axis=1)
    h = _split_half(a.shape[0])  # halves of M
    return jnp.concatenate([_mrs_ring_fwd(a[:h], b, axis_name, n, -1, 1, dtype),
                            _mrs_ring_fwd(a[h:], b, axis_name, n, +1, 1, dtype)], axis=0)


def _mrs_bwd_impl(axis_name, schedule, sd, res, dz):
    a, b = res  # the shards only
    a, b, dz = lax.optimization_barrier((a, b, dz))
    n = axis_size(axis_name)
    if schedule == "none":
        g = lax.all_gather(dz, axis_name, axis=sd, tiled=True)  # [M, N]
        da, db = _dot(g, b.T), _dot(a.T, g)
    elif schedule == "ring":
        da, db = _mrs_ring_bwd(a, b, dz, axis_name, n, +1, sd)
    elif sd == 0:
        h = _split_half(b.shape[1])
        da_a, db_a = _mrs_ring_bwd(a, b[:, :h], dz[:, :h], axis_name, n, +1, 0)
        da_b, db_b = _mrs_ring_bwd(a, b[:, h:], dz[:, h:], axis_name, n, -1, 0)
        da, db = da_a + da_b, jnp.concatenate([db_a, db_b], axis=1)
    else:
        h = _split_half(a.shape[0])
        da_a, db_a = _mrs_ring_bwd(a[:h], b, dz[:h], axis_name, n, +1, 1)
        da_b, db_b = _mrs_ring_bwd(a[h:], b, dz[h:], axis_name, n, -1, 1)
        da, db = jnp.concatenate([da_a, da_b], axis=0), db_a + db_b
    return da.astype(a.dtype), db.astype(b.dtype)


def _mrs_core(a, b, axis_name, schedule, scatter_dimension):
    return _mrs_fwd_impl(a, b, axis_name, schedule, scatter_dimension)


_mrs = jax.custom_vjp(_mrs_core, nondiff_argnums=(2, 3, 4))
_mrs.defvjp(
    lambda a, b, axis_name, schedule, sd: (_mrs_fwd_impl(a, b, axis_name, schedule, sd), (a, b)),
    _mrs_bwd_impl,
)


def matmul_reduce_scatter(a, b, axis_name, *, overlap: str = "ring", scatter_dimension: int = 0):
    """lax.psum_scatter(a @ b, axis_name, scatter_dimension=..., tiled=True) with the matmul of
    each output block overlapped with the transfer of the running sum (ring schedules).
    a [M, Kc], b [Kc, N] -> [M/n, N] (scatter_dimension=0) or [M, N/n] (scatter_dimension=1)."""
    _check_overlap(overlap)
    n = axis_size(axis_name)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, Kc] and b [Kc, N] must be 2-D with matching Kc; got {a.shape=} {b.shape=}")
    if scatter_dimension not in (0, 1):
        raise ValueError(f"{scatter_dimension=} must be 0 or 1")
    m, nn = a.shape[0], b.shape[1]
    size = (m, nn)[scatter_dimension]
    if size % n:
        raise ValueError(
            f"the scattered dimension ({'M' if scatter_dimension == 0 else 'N'}={size}, "
            f"{scatter_dimension=}) must be divisible by the size {n} of axis {axis_name!r}; "
            "pad it to a multiple first"
        )
    a = to_varying(a, axis_name)
    b = to_varying(b, axis_name)
    schedule = _schedule(overlap, n, (nn, m)[scatter_dimension])
    return _mrs(a, b, axis_name, schedule, scatter_dimension)


# --------------------------------------------------------------------------- plain rings


def ring_all_gather(x, axis_name, *, axis: int = 0):
    """lax.all_gather(x, axis_name, axis=axis, tiled=True) as n-1 `ppermute` steps (no matmul):
    the collective-permute flavour of an all-gather, e.g. to run on copy engines with
    --xla_gpu_use_memcpy_local_p2p. Differentiable by autodiff."""
    n = axis_size(axis_name)
    d = _norm_axis(axis, x.ndim, "axis")
    out = jnp.zeros(x.shape[:d] + (n * x.shape[d],) + x.shape[d + 1:], x.dtype)
    for blk, xb in _ring_blocks(to_varying(x, axis_name), axis_name, n, +1):
        out = lax.dynamic_update_slice_in_dim(out, xb, blk * x.shape[d], axis=d)
    return out


def ring_psum_scatter(x, axis_name, *, scatter_dimension: int = 0):
    """lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True) as n-1 `ppermute`
    steps, each adding this device's block to the running sum it passes on."""
    n = axis_size(axis_name)
    d = _norm_axis(scatter_dimension, x.ndim, "scatter_dimension")
    if x.shape[d] % n:
        raise ValueError(f"x.shape[{d}]={x.shape[d]} must be divisible by the size {n} of axis {axis_name!r}")
    b = x.shape[d] // n
    x = to_varying(x, axis_name)
    return _ring_reduce_scatter(lambda blk: lax.dynamic_slice_in_dim(x, blk * b, b, axis=d).astype(jnp.float32),
                                axis_name, n, -1, x.dtype)


# --------------------------------------------------------------------------- hierarchical


def _check_axis_pair(axis_names):
    if (not isinstance(axis_names, tuple) or len(axis_names) != 2
            or not all(isinstance(a, str) for a in axis_names) or axis_names[0] == axis_names[1]):
        raise ValueError(f"{axis_names=} must be a pair of distinct axis names (outer, inner), "
                         "e.g. ('node', 'local')")
    return axis_size(axis_names[0]), axis_size(axis_names[1])


def _chunks(size: int, num_chunks: int, what: str):
    if not isinstance(num_chunks, int) or num_chunks < 1 or num_chunks > max(size, 1):
        raise ValueError(f"{num_chunks=} must be an int in [1, {size}] ({what}={size})")
    bounds = np.linspace(0, size, num_chunks + 1).round().astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _norm_axis(axis: int, ndim: int, name: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def _two_stage_pipeline(spans, first, second, *, concat_axis):
    """second(first(chunk)) for every chunk span, concatenated along concat_axis. Chunk c+1's
    first stage is issued before chunk c's second stage, so the two can overlap."""
    pieces = []
    pending = first(*spans[0])
    for c in range(len(spans)):
        cur = pending
        if c + 1 < len(spans):
            pending = first(*spans[c + 1])
        pieces.append(second(cur))
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=concat_axis)


def hierarchical_all_gather(x, axis_names, *, axis: int = 0, num_chunks: int = 1):
    """lax.all_gather(x, axis_names, axis=axis, tiled=True), as two stages: across the outer
    axis (the rail: same local rank on every node) on the small shard first, then inside the
    inner axis on the node-gathered block. x is cut into num_chunks chunks along `axis`; chunk
    c+1's outer stage is issued before chunk c's inner stage and the two are independent, so
    XLA's async collectives run them at the same time."""
    _check_axis_pair(axis_names)
    outer, inner = axis_names
    d = _norm_axis(axis, x.ndim, "axis")
    spans = _chunks(x.shape[d], num_chunks, f"x.shape[{d}]")

    def outer_stage(lo, hi):  # [..., No, c, ...]
        return lax.all_gather(lax.slice_in_dim(x, lo, hi, axis=d), outer, axis=d, tiled=False)

    def inner_stage(part):  # [..., No, Ni, c, ...]
        return lax.all_gather(part, inner, axis=d + 1, tiled=False)

    g = _two_stage_pipeline(spans, outer_stage, inner_stage, concat_axis=d + 2)
    shape = x.shape[:d] + (-1,) + x.shape[d + 1:]
    return g.reshape(shape)


def hierarchical_psum_scatter(x, axis_names, *, scatter_dimension: int = 0, num_chunks: int = 1):
    """lax.psum_scatter(x, axis_names, scatter_dimension=..., tiled=True), as two stages: a
    reduce-scatter inside the inner axis first (the full-size payload stays in the node), then
    across the outer axis on 1/inner of it. Chunked like hierarchical_all_gather: chunk c+1's
    inner stage is issued before chunk c's outer stage, and the two are independent."""
    no, ni = _check_axis_pair(axis_names)
    outer, inner = axis_names
    d = _norm_axis(scatter_dimension, x.ndim, "scatter_dimension")
    size = x.shape[d]
    if size % (no * ni):
        raise ValueError(f"x.shape[{d}]={size} must be divisible by the number of devices "
                         f"{no * ni} of axes {axis_names!r} ({scatter_dimension=})")
    s = size // (no * ni)
    xr = x.reshape(x.shape[:d] + (no, ni, s) + x.shape[d + 1:])  # block k*ni + l -> [k, l]
    spans = _chunks(s, num_chunks, "per-device block")

    def inner_stage(lo, hi):  # [..., No, c, ...] summed over the node
        c = lax.slice_in_dim(xr, lo, hi, axis=d + 2)
        return lax.psum_scatter(c, inner, scatter_dimension=d + 1, tiled=False)

    def outer_stage(part):  # [..., c, ...]
        return lax.psum_scatter(part, outer, scatter_dimension=d, tiled=False)

    return _two_stage_pipeline(spans, inner_stage, outer_stage, concat_axis=d)
