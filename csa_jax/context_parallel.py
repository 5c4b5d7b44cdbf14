"""Context parallelism: sparse attention with the sequence (T) split over a mesh axis.

    o, lse = sparse_attention_cp(q, kv, pool, idx, sink=None, *, axis, window,
                                 overlap="none", scale=None, impl="auto", interpret=None,
                                 config=None, window_slots=None, mesh=None,
                                 batch_axes=None, head_axes=None)

Global view (as under jit): the token rows and the pool rows come as two arrays, so that each
can be split its own way:

    q     [B, T, H, D]  split over T on mesh axis `axis` (n devices, L = T / n tokens each)
    kv    [B, T, D]     the token rows, split like q (row t lives with token t)
    pool  [B, P, D] or None   the pool rows; split over P on `axis` when n divides P (each
                        device holds P / n consecutive rows), else replicated
    idx   [B, T, K]     split like q; GLOBAL ids into the concatenation [kv ; pool], exactly as
                        `csa_jax.sparse_attention(q, concat([kv, pool], 1), idx, sink)` reads
                        them: 0..T-1 token rows, T..T+P-1 pool rows, -1 (or anything outside
                        [0, T + P)) an empty slot
    sink  [H] or None   replicated

and the result equals that single-device call (values and gradients w.r.t. q, kv, pool, sink).
`window` is the promise that makes the split cheap: a token id g in token t's list satisfies
t - window + 1 <= g < (end of t's shard); so device s needs only its own L rows plus a halo of
the window - 1 rows before them. An id that breaks the promise is checked eagerly (ValueError
naming the slot) when idx is concrete; under jit it cannot be checked and reads as an empty
slot, so the caller (the layer's index builders) must keep it.

Batch and heads may be split over other mesh axes at the same time (batch x sequence x heads):
read from q's Explicit type, or `batch_axes` / `head_axes`; on Auto axes the batch is taken as
split over the other axes when they divide B. Inside one `jax.shard_map` manual over every mesh
axis, device s:
  1. receives the halo: the last window - 1 token rows before its shard, by `ppermute` from the
     device(s) before it (one hop when L >= window - 1; a shard shorter than the halo takes
     ceil((window - 1) / L) hops, each one `ppermute`), zeros before the sequence start;
  2. gets every pool row (all-gathered when split);
  3. remaps idx from global ids to its local buffer [halo | own | pool] and runs the impl
     (`auto` picks it on the local shapes) on its shards;
  4. attends. q, o, idx and the token rows never move; the backward (autodiff of the collectives)
     sends the halo's dkv back by the inverse `ppermute` and reduce-scatters the pool's dkv.

`overlap` says how the pool's collective meets the attention:
  "none"  lax.all_gather of the pool, then ONE attention call over [halo | own | pool] (one
          softmax, as on one device). The plain-XLA baseline.
  "xla"   the window part (the first `window_slots` slots, default `window`, attended over
          [halo | own] with the sink) and the pool part (the other slots, over the gathered pool,
          no sink) are two calls merged by their lse; the pool's lax.all_gather does not feed the
          window call, so XLA's async collectives can run it during the window part.
  "ring"  as "xla", but the pool travels a ring of n - 1 `ppermute`s (comm.collectives.
          ring_blocks) and each arriving block of P / n rows is attended (the slots pointing
          elsewhere masked) while the next is in flight; the backward's autodiff is the reverse
          ring, i.e. a ring reduce-scatter of the pool dkv. Each block's call reads all pool
          slots (masked), so its pool work is n x that of "xla": it suits structured pool lists
          (cr128) at small n; it exists to measure the overlap (benchmarks/bench_cp.py).
  "bidirectional"  as "ring", with each block's rows in two halves that travel opposite rings
          (comm's bidirectional schedule): half the bytes per link and step, twice the calls.
The merged forms equal the single call to rounding (f32: ~1e-6 relative); the split needs the
layout [window | pool] (window slots first: `window_slots` of them), which the layer's lists
have. With a replicated pool (n does not divide P) there is nothing to gather and "ring" /
"bidirectional" run as "xla". The hierarchical (node, local) schedule needs the sequence split
over two mesh axes, which this module does not take yet.

Errors: T not divisible by n, a kernel config with a structured layout (its promise is about
global positions, the local buffer breaks it), window < 1, and an idx breaking the window
promise when concrete.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from csa_jax.sharding import _axes, _entry    # PartitionSpec entry <-> mesh axis names

__all__ = ["sparse_attention_cp", "OVERLAPS", "halo_rows", "plan"]

OVERLAPS = ("none", "xla", "ring", "bidirectional")


def halo_rows(window: int) -> int:
    """Token rows a shard needs from the shards before it: window - 1."""
    return window - 1


def plan(T: int, n: int, window: int, P: int = 0) -> dict:
    """The static facts of a split (ValueError naming the values when it cannot be done):
    L tokens per shard, the halo rows, the ppermute hops they take, whether the pool is split."""
    if n < 1:
        raise ValueError(f"context-parallel axis size n={n} must be >= 1")
    if T % n:
        raise ValueError(f"context parallelism needs the sequence length T={T} divisible by the "
                         f"size n={n} of the context-parallel axis (T % n = {T % n})")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window={window!r} must be an int >= 1")
    L = T // n
    halo = halo_rows(int(window))
    hops = -(-halo // L) if halo else 0
    return dict(L=L, halo=halo, hops=min(hops, n - 1), pool_split=P > 0 and P % n == 0 and n > 1)


def _mesh_of(x, mesh):
    sharding = getattr(jax.typeof(x), "sharding", None)
    m = getattr(sharding, "mesh", None)
    if mesh is not None:
        return mesh
    if m is not None and not m.empty:
        return m
    m = jax.sharding.get_abstract_mesh()
    if m is None or m.empty:
        raise ValueError("sparse_attention_cp needs a mesh: pass mesh=, call it under "
                         "jax.set_mesh(mesh), or give q a NamedSharding")
    return m


def _check_window_promise(idx, T, L, window):
    """Eager: every token id g of token t has t - window + 1 <= g < (t // L + 1) * L."""
    arr = np.asarray(idx)
    t = np.arange(T)[None, :, None]
    tok = (arr >= 0) & (arr < T)
    bad = tok & ((arr < t - window + 1) | (arr >= (t // L + 1) * L))
    if bad.any():
        b, tt, j = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(
            f"idx[{b}, {tt}, {j}] = {int(arr[b, tt, j])} breaks the context-parallel window "
            f"promise: token {tt}'s token rows must lie in [{tt - window + 1}, "
            f"{(tt // L + 1) * L}) (window={window}, shard length L={L}); "
            f"{int(bad.sum())} such slot(s)")


def _halo(kv, axis, n, L, halo, hops):
    """[B, halo, D]: the `halo` token rows before this shard (zeros before the sequence)."""
    B, _, D = kv.shape
    if halo == 0:
        return kv[:, :0]
    parts = []
    for k in range(hops, 0, -1):           # farthest shard first: rows in sequence order
        rows = min(L, halo - (k - 1) * L)  # the far hop sends only the tail it must
        perm = [(j, j + k) for j in range(n - k)]
        parts.append(lax.ppermute(kv[:, L - rows:], axis, perm))
    got = sum(p.shape[1] for p in parts)
    if got < halo:                          # rows before the sequence start: never read
        parts.insert(0, jnp.zeros((B, halo - got, D), kv.dtype))
    return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _local_ids(idx, s, T, L, halo, pool_base, P):
    """Global ids -> local buffer ids: token rows [s*L - halo, s*L + L) -> [0, halo + L), pool
    row p (id T + p, p < P) -> pool_base + p; everything else -> -1."""
    first = s * L - halo
    tok = (idx >= 0) & (idx >= first) & (idx < s * L + L) & (idx < T)
    pool = (idx >= T) & (idx < T + P)
    return jnp.where(tok, idx - first, jnp.where(pool, idx - T + pool_base, -1)).astype(jnp.int32)


def _merge(parts, dtype):
    """One (o, lse) from partial softmaxes over disjoint slot sets: lse = logsumexp of the parts',
    o = sum of each part's o weighted by exp(lse_part - lse). Empty parts (o = 0, finite lse
    EMPTY_LSE) weigh 0; all empty gives o = 0, lse = EMPTY_LSE."""
    lses = jnp.stack([l for _, l in parts])                      # [n, B, T, H]
    lse = jax.nn.logsumexp(lses, axis=0)
    o = sum(op.astype(jnp.float32) * jnp.exp(l - lse)[..., None] for op, l in parts)
    return o.astype(dtype), lse


def sparse_attention_cp(q, kv, pool, idx, sink=None, *, axis, window, overlap="none",
                        scale=None, impl="auto", interpret=None, config=None,
                        window_slots=None, mesh=None, batch_axes=None, head_axes=None):
    """csa_jax.sparse_attention(q, concat([kv, pool], 1), idx, sink) with T split over mesh
    axis `axis`: see the module docstring. Returns (o [B, T, H, D], lse [B, T, H]).
    batch_axes / head_axes: mesh axes splitting B / H besides (None: q's Explicit ones)."""
    from csa_jax import api
    from comm.collectives import to_varying

    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r} must be one of {OVERLAPS}")
    if q.ndim != 4 or kv.ndim != 3 or idx.ndim != 3:
        raise ValueError(f"q [B,T,H,D], kv [B,T,D], idx [B,T,K] expected, got {q.shape}, "
                         f"{kv.shape}, {idx.shape}")
    B, T, H, D = q.shape
    if kv.shape != (B, T, D):
        raise ValueError(f"kv (the token rows) must be [B, T, D] = {(B, T, D)}, got {kv.shape}")
    if pool is not None and (pool.ndim != 3 or pool.shape[0] != B or pool.shape[2] != D):
        raise ValueError(f"pool must be [B, P, D={D}] or None, got {pool.shape}")
    Pn = 0 if pool is None else pool.shape[1]
    K = idx.shape[-1]
    ws = window if window_slots is None else window_slots
    if overlap != "none" and not 0 < ws <= K:
        raise ValueError(f"overlap={overlap!r} splits the slots at window_slots={ws}, which must "
                         f"be in [1, K={K}]")
    if config is not None and getattr(config, "layout", "generic") != "generic":
        raise ValueError(f"config.layout={config.layout!r}: a structured layout promises "
                         "positions in the whole sequence, which a shard's local buffer does not "
                         "keep; use layout='generic' under context parallelism")
    mesh = _mesh_of(q, mesh)
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
    n = mesh.shape[axis]
    pl = plan(T, n, window, Pn)
    L, halo, hops, pool_split = pl["L"], pl["halo"], pl["hops"], pl["pool_split"]
    if not isinstance(idx, jax.core.Tracer):
        _check_window_promise(idx, T, L, window)
    if scale is None:
        scale = float(D) ** -0.5
    call = functools.partial(api.sparse_attention, scale=scale, impl=impl, interpret=interpret,
                             config=config)
    has_pool = Pn > 0        # (a zero-size array through shard_map crashes XLA:CPU, 0.11.2)
    has_sink = sink is not None
    sink_arr = jnp.zeros((H,), jnp.float32) if sink is None else sink
    if overlap in ("ring", "bidirectional") and not pool_split:
        overlap = "xla"

    def body(q, kv, idx, sink, pool=None):
        s = lax.axis_index(axis)
        sink = to_varying(sink, axis) if has_sink else None
        if pool is not None:
            pool = to_varying(pool, axis)
        kv = to_varying(kv, axis)
        hal = _halo(kv, axis, n, L, halo, hops)                  # [B, halo, D]
        tok = jnp.concatenate([hal, kv], axis=1)                 # [B, halo + L, D]
        if overlap == "none":
            buf = tok
            if pool is not None:
                full = lax.all_gather(pool, axis, axis=1, tiled=True) if pool_split else pool
                buf = jnp.concatenate([tok, full], axis=1)       # [B, halo + L + P, D]
            ids = _local_ids(idx, s, T, L, halo, halo + L, Pn)
            return call(q, buf, ids, sink)
        # window part (with the sink) over [halo | own], pool part(s) without
        ids_w = _local_ids(idx[..., :ws], s, T, L, halo, halo + L, 0)
        parts = [call(q, tok, ids_w, sink)]
        if ws < K and pool is not None:
            ip = idx[..., ws:]
            if overlap == "xla":
                full = lax.all_gather(pool, axis, axis=1, tiled=True) if pool_split else pool
                parts.append(call(q, full, _local_ids(ip, s, T, 0, 0, 0, Pn)))
            else:  # ring: block `blk` holds pool rows [blk * Pb, (blk + 1) * Pb)
                from comm.collectives import ring_blocks
                Pb = pool.shape[1]
                # bidirectional: the first h rows of every block travel one way, the rest the
                # other, so each link carries half the bytes per step
                h = Pb - Pb // 2 if overlap == "bidirectional" and Pb > 1 else Pb
                rings = [(ring_blocks(pool[:, :h], axis, shift=1), 0)]
                if h < Pb:
                    rings.append((ring_blocks(pool[:, h:], axis, shift=-1), h))
                for steps in zip(*(r for r, _ in rings)):
                    for (blk, rows), (_, lo) in zip(steps, rings):
                        rel = ip - T - blk * Pb - lo
                        ids = jnp.where((ip >= T) & (rel >= 0) & (rel < rows.shape[1]), rel, -1)
                        parts.append(call(q, rows, ids.astype(jnp.int32)))
        if len(parts) == 1:
            return parts[0]
        return _merge(parts, q.dtype)

    b, h = _batch_head_axes(q, mesh, axis, batch_axes, head_axes)
    bt, ht = _entry(b), _entry(h)
    sq, skv = P(bt, axis, ht), P(bt, axis)
    spool = P(bt, axis) if pool_split else P(bt)
    in_specs = (sq, skv, skv, P(ht)) + ((spool,) if has_pool else ())
    args = _place(mesh, axis, (q, kv, idx, sink_arr) + ((pool,) if has_pool else ()), in_specs)
    # Manual over every mesh axis: the impl runs on plain local shards (a shard_map manual over
    # `axis` only, with other Explicit axes left to csa_jax/sharding.py, trips jax 0.11.2's
    # all_gather transpose). check_vma=False: Pallas kernels cannot type their outputs' variance
    # (pallas_call asks for it under check_vma=True); without it shard_map's transpose sums the
    # cotangent of each input over the axes its spec leaves out (kv's dkv over the head axes,
    # the sink's over batch and sequence, a replicated pool's over the sequence), and the
    # collectives' transposes (all_gather -> psum_scatter, ppermute -> inverse) are exact.
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(sq, sq), check_vma=False)
    return fn(*args)


def _explicit_names(mesh):
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)


def _batch_head_axes(q, mesh, axis, batch_axes=None, head_axes=None):
    """(batch axes, head axes) of q [B, T, H, D] (or [B, T, ...] for head-less arrays): given,
    or read from q's Explicit type; on a mesh of Auto axes (no spec in the types) the batch
    split over every other axis and the heads whole. Each kept only if it divides its dimension
    (else that dimension is whole on every device: correct, not free)."""
    spec = tuple(getattr(getattr(jax.typeof(q), "sharding", None), "spec", None) or ())
    spec = spec + (None,) * (q.ndim - len(spec))
    explicit = _explicit_names(mesh)

    def pick(given, entry, size, auto=()):
        if given is not None:
            axes = given
        elif explicit:
            axes = tuple(a for a in _axes(entry) if a != axis and a in explicit)
        else:
            axes = auto
        axes = tuple(axes)
        if axis in axes:
            raise ValueError(f"the context axis {axis!r} cannot also split batch or heads")
        n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        return axes if size % n == 0 else ()

    # Auto axes carry no spec: the batch is taken as split over every other mesh axis (a data /
    # FSDP layout), when they divide B
    others = tuple(a for a in mesh.axis_names if a != axis and mesh.shape[a] > 1)
    b = pick(batch_axes, spec[0], q.shape[0], auto=others)
    h = pick(head_axes, spec[2], q.shape[2]) if q.ndim == 4 else ()
    return b, h


def _place(mesh, axis, args, specs):
    """reshard each input to its spec under Explicit axes (Auto: shard_map's in_specs ask)."""
    if not _explicit_names(mesh):
        return args
    return tuple(jax.sharding.reshard(x, NamedSharding(mesh, sp)) for x, sp in zip(args, specs))


# ----------------------------------------------------------------------------- the layer's pieces
# The V4 layer (csa_jax/layers.py) under context parallelism: x [B, T, C] split over T. Its
# projections, norms and RoPE are per token and run as they are; these three are the pieces that
# look across tokens. Each is a shard_map over `axis` only.


def _seq_mesh(x, axis, mesh=None):
    mesh = _mesh_of(x, mesh)
    if axis not in mesh.axis_names:
        raise ValueError(f"context axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    return mesh, mesh.shape[axis]


def compress_cp(x, w_kv, w_gate, ape, norm_scale, *, ratio, axis, eps=1e-6, mesh=None):
    """csa_jax.compress with x [B, T, C] split over T on `axis`: pool rows [B, T // ratio, d],
    split over P on `axis` (device s computes the rows of its own groups). Needs the shard length
    L = T / n to be a multiple of ratio (groups never straddle shards; ValueError naming both
    otherwise). ratio 4's overlapping rows take the first halves of the previous shard's last
    group by one `ppermute` (none before the sequence start), so the rows equal one device's."""
    from csa_jax import compressor

    mesh, n = _seq_mesh(x, axis, mesh)
    B, T, C = x.shape
    if T % n:
        raise ValueError(f"context parallelism needs T={T} divisible by the size n={n} of "
                         f"axis {axis!r}")
    L = T // n
    if L % ratio and n > 1:
        raise ValueError(
            f"context-parallel compressor: the shard length L = T / n = {T} / {n} = {L} must be "
            f"a multiple of ratio={ratio} (a compressor group may not straddle two shards); "
            f"use fewer devices on {axis!r} or a longer sequence (T a multiple of {n * ratio})")

    def body(x, w_kv, w_gate, ape, norm_scale):
        if n == 1:  # one device holds the sequence: the plain compressor, nothing to exchange
            return compressor.compress(x, w_kv, w_gate, ape, norm_scale, ratio=ratio, eps=eps)
        c, z = compressor._project(x, w_kv, w_gate, ape, ratio)     # [B, L/m, m, coff*d]
        prev = None
        if ratio == 4:
            last = jnp.concatenate([c[:, -1:], z[:, -1:]], axis=-1)  # [B, 1, 4, 2*coff*d]
            if n > 1:
                got = lax.ppermute(last, axis, [(j, j + 1) for j in range(n - 1)])
            else:
                got = jnp.zeros_like(last)
            w = c.shape[-1]
            first = lax.axis_index(axis) == 0                        # nothing before row 0
            prev = (got[..., :w], jnp.where(first, -jnp.inf, got[..., w:]))
        return compressor._pool_rows(c, z, norm_scale, ratio=ratio, eps=eps, prev=prev)

    bt = _entry(_batch_head_axes(x, mesh, axis)[0])
    specs = (P(bt, axis), P(), P(), P(), P())
    args = _place(mesh, axis, (x, w_kv, w_gate, ape, norm_scale), specs)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(bt, axis),
                         check_vma=True)(*args)


def indexer_topk_cp(q_idx, k_idx, weights, *, ratio, topk, axis, mesh=None, select="top_k",
                    scores="xla"):
    """csa_jax.indexer_topk (select="top_k" ids, XLA scores) with q_idx [B, T, Hi, Di] and
    weights [B, T, Hi] split over T and k_idx [B, P, Di] split over P on `axis`: each device
    all-gathers the indexer keys (P x Di, no gradient) and ranks them for its own tokens at
    their global positions, so the causal visibility is one device's. int32 [B, T, min(topk, P)]
    split over T. select / scores: used on an axis of one device (indexer_topk itself)."""
    from csa_jax import compressor

    mesh, n = _seq_mesh(q_idx, axis, mesh)
    T = q_idx.shape[1]
    L = T // n

    def body(q_idx, k_idx, weights):
        if n == 1:  # one device: csa_jax.indexer_topk itself, with its select / scores kernels
            return compressor.indexer_topk(q_idx, k_idx, weights, ratio=ratio, topk=topk,
                                           select=select, scores=scores)
        keys = lax.all_gather(k_idx, axis, axis=1, tiled=True)
        return compressor.topk_at_offset(q_idx, keys, weights, ratio=ratio, topk=topk,
                                         offset=lax.axis_index(axis) * L)

    bt = _entry(_batch_head_axes(q_idx, mesh, axis)[0])
    specs = (P(bt, axis), P(bt, axis), P(bt, axis))
    args = _place(mesh, axis, tuple(jax.lax.stop_gradient(a) for a in (q_idx, k_idx, weights)),
                  specs)
    # check_vma off for one device: indexer_topk's Triton kernels cannot type their outputs
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(bt, axis),
                         check_vma=n > 1)(*args)


def index_lists_cp(B, T, ratio, *, window, axis, topk=None, mesh=None, like=None):
    """csa_jax.build_indices's [B, T, K] lists (global ids), built shard by shard: split over T
    on `axis`, no device ever holding all T rows. topk: the indexer's pool-local ids [B, T, k]
    split over T (ratio 4 only). `like`: an array whose type carries the mesh."""
    like = like if like is not None else topk
    mesh = _mesh_of(like, mesh)
    n = mesh.shape[axis]
    L = T // n
    Pn = T // ratio if ratio else 0
    b = _batch_head_axes(like, mesh, axis)[0]
    bt = _entry(b)
    B = B // (int(np.prod([mesh.shape[a] for a in b])) if b else 1)      # per device

    def lists(s, top=None):
        t = s * L + jnp.arange(L, dtype=jnp.int32)[:, None]                     # [L, 1]
        win = t - window + 1 + jnp.arange(window, dtype=jnp.int32)[None, :]
        parts = [jnp.broadcast_to(jnp.where(win >= 0, win, -1), (B, L, window))]
        if ratio == 4:
            parts.append(jnp.where(top >= 0, top + T, -1))
        elif ratio:
            p = jnp.arange(Pn, dtype=jnp.int32)[None, :]
            parts.append(jnp.broadcast_to(jnp.where(p < (t + 1) // ratio, p + T, -1),
                                          (B, L, Pn)))
        return jnp.concatenate(parts, axis=-1).astype(jnp.int32)

    if ratio == 4:
        (top,) = _place(mesh, axis, (topk,), (P(bt, axis),))
        return jax.shard_map(lambda top: lists(lax.axis_index(axis), top), mesh=mesh,
                             in_specs=P(bt, axis), out_specs=P(bt, axis), check_vma=True)(top)

    def no_input():
        out = lists(lax.axis_index(axis))
        return lax.pcast(out, b, to="varying") if b else out   # the same lists on every row shard

    return jax.shard_map(no_input, mesh=mesh, in_specs=(), out_specs=P(bt, axis),
                         check_vma=True)()
