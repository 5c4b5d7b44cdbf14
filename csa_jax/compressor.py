"""The compressor (pool rows) and the lightning indexer (top-k pool rows), csa_spec.md section 5.

Plain JAX (XLA) code. The compressor is differentiable; top-k passes no gradient.

Precision: the matrix products take their operands in the dtype of the activations they are
given and always accumulate in f32. f32 inputs (tests, golden cases, CPU runs) get true-f32
products (Precision.HIGHEST), exactly as before; bf16 inputs (a bf16 training step) get bf16
tensor-core products with f32 accumulation instead of f32 GEMMs on CUDA cores. Everything after
the products (the compressor's per-channel softmax, weighted sum and RMSNorm; the indexer's ReLU,
head-weighted sum, masking and selection) is f32 for every input dtype.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from csa_jax.config import check_ratio


def _shape_error(name, arr, want):
    return ValueError(f"{name} must have shape {want}, got {tuple(arr.shape)}")


def _mm_dtype(dtype):
    """Operand dtype of a product whose activations are `dtype`: bf16/f16 stay, the rest is f32."""
    dtype = jnp.dtype(dtype)
    low = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return dtype if dtype in low else jnp.dtype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_lowp(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_lowp_fwd(spec, a, b):
    return _einsum_lowp(spec, a, b), (a, b)


def _einsum_lowp_bwd(spec, res, g):
    # The cotangent in the operands' dtype, as for every other bf16 product of the model: the
    # transposed products are bf16 x bf16 too (autodiff of the f32 output would upcast the other
    # operand and run them as f32 GEMMs).
    a, b = res
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
    return vjp(g.astype(a.dtype))


_einsum_lowp.defvjp(_einsum_lowp_fwd, _einsum_lowp_bwd)


def einsum_f32acc(spec, a, b):
    """jnp.einsum with f32 accumulation and an f32 result. Operands of one dtype: f32 -> true f32
    products (HIGHEST); bf16 / f16 -> native low-precision products, whose backward products
    are low precision as well (the f32 cotangent is rounded to the operand dtype first)."""
    if a.dtype != b.dtype:
        raise TypeError(f"einsum_f32acc needs operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == jnp.float32:
        return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
    return _einsum_lowp(spec, a, b)


def compress(x, w_kv, w_gate, ape, norm_scale, *, ratio, eps=1e-6):
    """Pool rows before RoPE: [B, T // ratio, d] f32.

    x [B, T, C]; w_kv, w_gate [C, coff*d] (coff = 2 when ratio == 4, else 1); ape [ratio, coff*d];
    norm_scale [d]. Each pool row is a per-channel softmax-weighted sum over its tokens (gate z,
    value c), then RMSNorm with norm_scale. ratio 4 overlaps: pool row i pools the first halves
    ([:d]) of group i-1 and the second halves ([d:]) of group i (8 slots; none from before row 0).
    Leftover tokens (T mod ratio) are not pooled: T < ratio gives an empty pool [B, 0, d].
    The projections W_kv x and W_gate x take x's dtype (bf16 x: bf16 operands, weights cast to
    it, f32 accumulation; f32 x: f32 HIGHEST); the pooling (softmax over the group, weighted
    sum, RMSNorm) is f32 (csa_spec.md section 5).
    """
    check_ratio(ratio, allow_zero=False)
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    _check_nonempty("x", x.shape, "BTC")
    B, T, C = x.shape
    coff = 2 if ratio == 4 else 1
    if w_kv.ndim != 2 or w_kv.shape[0] != C or w_kv.shape[1] % coff:
        raise ValueError(f"w_kv must be [C={C}, {coff}*d], got shape {tuple(w_kv.shape)}")
    width = w_kv.shape[1]
    d = width // coff
    if w_gate.shape != (C, width):
        raise _shape_error("w_gate", w_gate, (C, width))
    if ape.shape != (ratio, width):
        raise _shape_error("ape", ape, (ratio, width))
    if norm_scale.shape != (d,):
        raise _shape_error("norm_scale", norm_scale, (d,))
    if d == 0:
        raise ValueError(f"w_kv has width {width}: the pool row width d must be >= 1")
    P = T // ratio
    if P == 0:
        return jnp.zeros((B, 0, d), jnp.float32)
    c, z = _project(x[:, : P * ratio], w_kv, w_gate, ape, ratio)
    return _pool_rows(c, z, norm_scale, ratio=ratio, eps=eps)


def _project(x, w_kv, w_gate, ape, ratio):
    """c, z [B, P, ratio, coff*d] f32 of the tokens x [B, P*ratio, C] (whole groups)."""
    B, TP, _ = x.shape
    width = w_kv.shape[1]
    mm = _mm_dtype(x.dtype)
    xs = x.astype(mm)
    c = einsum_f32acc("btc,cw->btw", xs, w_kv.astype(mm))                       # [B, P*m, coff*d]
    z = einsum_f32acc("btc,cw->btw", xs, w_gate.astype(mm))
    c = c.reshape(B, TP // ratio, ratio, width)
    z = z.reshape(B, TP // ratio, ratio, width) + ape.astype(jnp.float32)[None, None]
    return c, z


def _pool_rows(c, z, norm_scale, *, ratio, eps, prev=None):
    """Pool rows [B, P, d] from the groups' c, z [B, P, ratio, coff*d]. ratio 4: row i also
    pools the first halves of group i-1; `prev` = (c, z) [B, 1, 4, coff*d] of the group before
    row 0 (a context-parallel shard's halo; z = -inf where there is none), None: row 0 has none."""
    f32 = jnp.float32
    d = norm_scale.shape[0]
    if ratio == 4:
        # slots of row i: first halves of group i-1 (empty for i = 0), second halves of group i
        if prev is None:
            prev_c = jnp.pad(c[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_z = jnp.pad(z[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)),
                             constant_values=-jnp.inf)
        else:
            prev_c = jnp.concatenate([prev[0][..., :d], c[:, :-1, :, :d]], axis=1)
            prev_z = jnp.concatenate([prev[1][..., :d], z[:, :-1, :, :d]], axis=1)
        c = jnp.concatenate([prev_c, c[:, :, :, d:]], axis=2)                  # [B, P, 8, d]
        z = jnp.concatenate([prev_z, z[:, :, :, d:]], axis=2)
    w = jax.nn.softmax(z, axis=2)                                               # per channel
    pooled = jnp.sum(w * c, axis=2)                                             # [B, P, d]
    rms = jax.lax.rsqrt(jnp.mean(pooled * pooled, axis=-1, keepdims=True) + eps)
    return pooled * rms * norm_scale.astype(f32)


def _check_nonempty(name, shape, letters):
    if 0 in shape:
        dims = ", ".join(f"{a}={n}" for a, n in zip(letters, shape))
        raise ValueError(f"{name} has an empty dimension ({dims}): every one must be >= 1")


def _check_indexer(q_idx, k_idx, weights, ratio):
    check_ratio(ratio, allow_zero=False)
    if q_idx.ndim != 4:
        raise ValueError(f"q_idx must be [B, T, Hi, Di], got shape {tuple(q_idx.shape)}")
    _check_nonempty("q_idx", q_idx.shape, ("B", "T", "Hi", "Di"))    # P = T // ratio may be 0
    B, T, Hi, Di = q_idx.shape
    if k_idx.ndim != 3 or k_idx.shape[0] != B or k_idx.shape[2] != Di:
        raise ValueError(f"k_idx must be [B={B}, P, Di={Di}], got shape {tuple(k_idx.shape)}")
    if weights.shape != (B, T, Hi):
        raise _shape_error("weights", weights, (B, T, Hi))
    if k_idx.shape[1] != T // ratio:
        raise ValueError(f"k_idx has P={k_idx.shape[1]} rows but T // ratio = {T // ratio} "
                         f"(T={T}, ratio={ratio})")


def _chunk_len(T, per_token_elems, budget=2 ** 26, min_chunks=1):
    """Tokens per chunk: a divisor of T with one chunk's largest intermediate under budget and at
    least min_chunks chunks (when T allows)."""
    chunk = max(1, min(T, budget // max(per_token_elems, 1), -(-T // min_chunks)))
    while T % chunk:
        chunk -= 1
    return chunk


def _chunked_over_tokens(fn, T, per_token_elems, budget=2 ** 26):
    """Split [0, T) into equal chunks so one chunk's largest intermediate stays under budget."""
    chunk = _chunk_len(T, per_token_elems, budget)
    if chunk == T:
        return fn(0, T)
    outs = [fn(s, chunk) for s in range(0, T, chunk)] if T // chunk <= 8 else None
    if outs is not None:
        return jnp.concatenate(outs, axis=1)
    starts = jnp.arange(0, T, chunk)
    res = jax.lax.map(lambda s: fn(s, chunk), starts)                          # [n, B, chunk, ...]
    res = jnp.moveaxis(res, 0, 1)
    return res.reshape(res.shape[0], T, *res.shape[3:])


def _scores_block(q_idx, k_idx, weights, ratio, start, size, rows=None, offset=0):
    """Scores of tokens [start, start + size) against pool rows [0, rows) (default all P);
    `offset` is the position of token 0 in the sequence (a context-parallel shard's start)."""
    rows = k_idx.shape[1] if rows is None else rows
    mm = _mm_dtype(q_idx.dtype)
    q = jax.lax.dynamic_slice_in_dim(q_idx, start, size, axis=1).astype(mm)
    w = jax.lax.dynamic_slice_in_dim(weights, start, size, axis=1).astype(jnp.float32)
    with jax.named_scope("indexer_scores"):
        dots = einsum_f32acc("bthd,bsd->bths", q, k_idx[:, :rows].astype(mm))  # [B, c, Hi, rows]
        if mm == jnp.float32:   # as it always was (CPU, tests): a batched matrix-vector product
            score = jnp.einsum("bth,bths->bts", w, jax.nn.relu(dots),
                               precision=jax.lax.Precision.HIGHEST)             # [B, c, rows]
        else:  # bf16 products: the head-weighted sum as one f32 multiply-reduce fusion, which
            # a GPU runs at memory speed (an f32 batched GEMV would run on CUDA cores)
            score = jnp.sum(w[..., None] * jax.nn.relu(dots), axis=2)
    t = offset + start + jnp.arange(size)[:, None]
    s = jnp.arange(rows)[None, :]
    return jnp.where((s < (t + 1) // ratio)[None], score, -jnp.inf)


def topk_at_offset(q_idx, k_idx, weights, *, ratio, topk, offset):
    """indexer_topk's ids (select="top_k", XLA scores) for tokens at positions offset + t of a
    longer sequence: q_idx [B, L, Hi, Di], weights [B, L, Hi] of those tokens, k_idx [B, P, Di]
    every pool row (a context-parallel shard's view). int32 [B, L, min(topk, P)]."""
    B, L, Hi, _ = q_idx.shape
    P = k_idx.shape[1]
    k = min(topk, P)
    q_idx, k_idx, weights = (jax.lax.stop_gradient(a) for a in (q_idx, k_idx, weights))

    def pick(start, size):
        score = _scores_block(q_idx, k_idx, weights, ratio, start, size, offset=offset)
        with jax.named_scope("indexer_topk"):
            vals, ids = jax.lax.top_k(score, k)
            return jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)

    return _chunked_over_tokens(pick, L, B * Hi * P)


def indexer_scores(q_idx, k_idx, weights, *, ratio):
    """[B, T, P] f32: score[t,s] = sum_h weights[t,h] * relu(q_idx[t,h] . k_idx[s]); -inf if invisible.

    The q . k products take q_idx's dtype (k_idx is cast to it) and accumulate in f32; the ReLU
    and the weighted sum are f32.
    """
    _check_indexer(q_idx, k_idx, weights, ratio)
    B, T, Hi, _ = q_idx.shape
    P = k_idx.shape[1]
    return _chunked_over_tokens(
        lambda s, n: _scores_block(q_idx, k_idx, weights, ratio, s, n), T, B * Hi * P)


SELECT_MODES = ("auto", "prefix", "top_k", "kernel", "approx")
# select="auto" runs the Triton threshold-select kernel (csa_jax/kernels/triton/topk.py) where it
# applies: NVIDIA GPUs, rows of at most 8192 scores (P padded to a power of two), at most 2**28
# scores held at once (the kernel reads the whole [B, T, P]), and scores from the scores kernel
# (scores="auto"/"kernel" taking the problem); elsewhere "prefix". The same ids as
# "prefix" / "top_k". Measured on the H200 (`small`, T = 8192, docs/perf/train_h200.md,
# branch train4b at 311d332, 2026-12-01):
# the step's top-k 2.42 -> 2.04 ms (select kernel 0.83, XLA's sort of the k selected 1.12).
_AUTO_KERNEL_SELECT = True
# Below this many [B, T, P] scores "prefix" runs as "top_k" (same ids): small problems (the CPU
# default run has 2**17) gain nothing from skipping invisible rows and pay for 8x the ops.
_PREFIX_MIN_SCORES = 2 ** 22


SCORE_IMPLS = ("auto", "xla", "kernel")
# scores="auto" in indexer_topk runs the fused Triton kernel (csa_jax/kernels/triton/indexer.py)
# where it applies: NVIDIA GPUs, bf16 / f16 inputs, its block multiples, B*T*P <= 2**26 scores
# held at once, and at most _AUTO_MAX_INDEX_HEADS indexer heads: where it was measured faster
# (H200, `small`'s 16 x 64 indexer at T = 8192: scores 0.22 ms against 1.04 ms per cr4 layer,
# the same top-k ids; docs/perf/train_h200.md). Wider indexers (V4's 64 x 128) are not measured
# yet and keep the XLA products. False: auto always runs the XLA products.
_AUTO_KERNEL_SCORES = True
_AUTO_MAX_INDEX_HEADS = 16


def _kernel_scores(scores, q_idx, k_idx):
    """Whether indexer_topk's scores come from the Triton kernel (scores: SCORE_IMPLS)."""
    if scores not in SCORE_IMPLS:
        raise ValueError(f"scores={scores!r} must be one of {SCORE_IMPLS}")
    if scores == "xla" or (scores == "auto" and not _AUTO_KERNEL_SCORES):
        return False
    from csa_jax.kernels import triton as tk
    from csa_jax.kernels.triton import indexer as tki

    why = tki.supported(q_idx.shape, k_idx.shape, q_idx.dtype)
    if scores == "kernel":
        if why:
            raise ValueError(f"scores='kernel': {why}")
        return True
    B, T, Hi, Di = q_idx.shape
    return (why is None and B * T * k_idx.shape[1] <= 2 ** 26 and Hi <= _AUTO_MAX_INDEX_HEADS
            and tk.unsupported(q_idx.shape, k_idx.shape, (B, T, 1), q_idx.dtype) is None)


def _kernel_select(select, shape, k):
    """Whether indexer_topk selects with the Triton kernel (select: SELECT_MODES)."""
    if select not in ("auto", "kernel"):
        return False
    from csa_jax.kernels.triton import topk as tkt

    why = tkt.supported(shape, k)
    if select == "kernel":
        if why:
            raise ValueError(f"select='kernel': {why}")
        return True
    if not _AUTO_KERNEL_SELECT or why or math.prod(shape) > 2 ** 28:
        return False
    return tkt.on_nvidia()


def indexer_topk(q_idx, k_idx, weights, *, ratio, topk, select="auto", recall_target=0.95,
                 scores="auto"):
    """int32 [B, T, min(topk, P)]: pool-local ids by descending score, -1 where none is visible.

    q_idx [B,T,Hi,Di] (rotated), k_idx [B,P,Di], weights [B,T,Hi] with every scale folded in.
    No gradient flows through the selection. select:
      "auto"   (default): "kernel" where _kernel_select allows it (NVIDIA GPUs) and the scores
               come from the scores kernel (all P rows), else "prefix";
      "kernel" (exact): the scores of all P rows, then the Triton threshold select of
               csa_jax/kernels/triton/topk.py (interpreted off-GPU) and one sort of the k
               selected per token;
      "prefix" (exact): tokens are walked in chunks (in at most 8 bands) and each band
               scores and sorts only the pool rows visible to its last token, so most of the
               invisible half of [T, P] is neither scored nor sorted (problems with fewer than
               2**22 scores run as "top_k");
      "top_k"  (exact): one lax.top_k over all P rows per token;
      "approx": lax.approx_max_k (recall_target) over all P rows: the TPU's approximate
               selection; on CPU and GPU XLA lowers it to an exact sort.
    "prefix", "top_k" and "kernel" return the same ids (ties keep the lower id first; -0.0
    ranks below +0.0, as in lax.top_k).
    scores: "xla" (the XLA products of indexer_scores), "kernel" (the fused Triton kernel of
    csa_jax/kernels/triton/indexer.py, interpreted off-GPU: same scores to f32 rounding, so
    the same ids but where two scores tie within rounding), "auto" (the kernel where
    _kernel_scores allows it).
    """
    _check_indexer(q_idx, k_idx, weights, ratio)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got topk={topk!r}")
    if select not in SELECT_MODES:
        raise ValueError(f"select={select!r} must be one of {SELECT_MODES}")
    B, T, Hi, _ = q_idx.shape
    P = k_idx.shape[1]
    k = min(topk, P)
    if k == 0:
        return jnp.zeros((B, T, 0), jnp.int32)
    q_idx, k_idx, weights = (jax.lax.stop_gradient(a) for a in (q_idx, k_idx, weights))
    kernel_scores = _kernel_scores(scores, q_idx, k_idx)
    # auto selects with the kernel only where the scores kernel writes all P rows anyway (with
    # XLA's scores the prefix bands score only ~56% of them: not measured against the kernel)
    use_kernel = _kernel_select(select, (B, T, P), k) and (select != "auto" or kernel_scores)
    if select == "auto":
        select = "kernel" if use_kernel else "prefix"
    if kernel_scores:
        from csa_jax.kernels.triton import indexer as tki

        full = tki.indexer_scores(q_idx, k_idx, weights, ratio=ratio)          # [B, T, P]

        def block(start, size, rows=None):
            rows = P if rows is None else rows
            return jax.lax.dynamic_slice_in_dim(full, start, size, axis=1)[:, :, :rows]
    else:
        def block(start, size, rows=None):
            return _scores_block(q_idx, k_idx, weights, ratio, start, size, rows)

    if use_kernel:
        from csa_jax.kernels.triton import topk as tkt

        if not kernel_scores:   # all P rows of every token (chunked XLA products)
            full = indexer_scores(q_idx, k_idx, weights, ratio=ratio)
        with jax.named_scope("indexer_topk"):
            return tkt.select_topk(full, k)

    def pick(score, kk):
        with jax.named_scope("indexer_topk"):
            if select == "approx":
                vals, ids = jax.lax.approx_max_k(score, kk, recall_target=recall_target)
            else:
                vals, ids = jax.lax.top_k(score, kk)
            return jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)

    if select != "prefix" or B * T * P < _PREFIX_MIN_SCORES:
        return _chunked_over_tokens(lambda s, n: pick(block(s, n), k), T, B * Hi * P)

    # At least 8 chunks, each under the memory budget, grouped in at most 8 bands of consecutive
    # chunks; a band scores and sorts the rows visible to its last token (a static width), so the
    # sorted area is about (1 + 1/8) / 2 of [T, P].
    chunk = _chunk_len(T, B * Hi * P, min_chunks=8)
    n = T // chunk
    nb = min(n, 8)
    bands = [(n * i // nb, n * (i + 1) // nb) for i in range(nb)]
    outs = []
    for a, b in bands:
        rows = min(P, (b * chunk) // ratio)        # rows visible to the band's last token
        kk = min(k, rows)
        if kk == 0:
            outs.append(jnp.full((B, (b - a) * chunk, k), -1, jnp.int32))
            continue

        def one(s, rows=rows, kk=kk):
            ids = pick(block(s, chunk, rows), kk)
            return jnp.pad(ids, ((0, 0), (0, 0), (0, k - kk)), constant_values=-1)

        if b - a == 1:
            outs.append(one(a * chunk))
        else:
            res = jax.lax.map(one, jnp.arange(a, b) * chunk)                   # [b-a, B, chunk, k]
            outs.append(jnp.moveaxis(res, 0, 1).reshape(B, (b - a) * chunk, k))
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
