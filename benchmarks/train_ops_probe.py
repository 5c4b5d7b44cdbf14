"""Device time of the XLA-side pieces of a training step, alone, at a preset's shapes (issue 17).

    python -m benchmarks.train_ops_probe --preset small --seq-len 8192 --out probe.json

Each probe is one jitted function on random inputs of the preset's cr4 layer at T tokens
(B = 1, bf16 activations), timed as the median of --reps runs after a warm one
(benchmarks.common.time_fn). Pairs of probes compare a candidate change with what the step runs
today, on the same inputs:

    inverse_map_s32 / _s16   the dkv inverse map of a cr4 index list (stable argsort of T*K kv
                             row ids: int32 keys, or int16 keys = csa_jax.blockmath narrow=True;
                             _s16_scan: the offsets' binary search as a while loop, not unrolled)
    topk_prefix / topk_full  csa_jax.indexer_topk, select="prefix" (default) / "top_k": the
                             indexer scores and the selection of one cr4 layer
    scores_full              csa_jax.indexer_scores alone (all P rows)
    scores_kernel[_noskip]   the fused Triton scores kernel (csa_jax/kernels/triton/indexer.py;
                             noskip: also the wholly invisible tiles)
    topk_prefix_kernel       indexer_topk(select="prefix", scores="kernel") (ids checked equal to
                             the XLA path's)
    topk_select_kernel       indexer_topk(select="kernel", scores="kernel"): the Triton
                             threshold select (csa_jax/kernels/triton/topk.py) and one sort of
                             the k selected (ids checked equal to topk_prefix_kernel's)
    select_<variant>         the select kernel alone on the scores kernel's [1, T, P] output:
                             r<rows>w<warps> ordered (with the sort), _unordered (kernel only),
                             _stable (the k ordered by a stable one-key sort);
                             select_ties: scores rounded to 1/8 (many ties), ids checked equal
                             to lax.top_k's
    sort_rows_k              lax.top_k of [T/8, P] scores (one band's selection, no scoring)
    mlp_<mode>               one SwiGLU MLP's forward + backward (x and weight gradients) at the
                             preset's widths, [1, T, C] bf16, ModelConfig.swiglu = mode (xla,
                             act, gemm); outputs checked against mlp_xla's
    norm_<mode>              one block RMSNorm's forward + backward, [1, T, C] bf16 in, bf16
                             out, ModelConfig.norm = mode (nnx, fused); checked against nnx's
    optimizer[_stacked|_flat] AdamW + clipping of the preset's parameters (train.loop's
                             optimizer); _stacked / _flat: the same update over the same-shape
                             arrays stacked / one flat vector (a what-if for the layout: fewer,
                             larger kernels; see optimizer_probe)
    attn_cr<r>_<variant>_fwd / _bwd
                             --attn-impl's forward / backward (both cotangents) at the preset's
                             layer shapes (csa_jax.problems, causal cr4 lists), its default
                             config and each --attn-variants override (benchmarks.common specs);
                             the outputs are checked against the default config's, and with
                             --attn-check xla also against impl="xla" on the same inputs
                             (rel_err_vs_xla: max over the outputs of max-abs error / max-abs
                             of the xla output; the xla run is not timed)

--budget-s stops starting probes once that many seconds have passed (the JSON is rewritten after
every probe, so a time limit still leaves what ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import csa_jax
from benchmarks.common import parse_variants, timed_probe
from csa_jax import blockmath, problems, registry
from train.config import get_preset


def _cr4_inputs(a, T, seed=0):
    """Indexer inputs and an index list of a cr4 layer (random, bf16)."""
    P, Hi, Di = T // 4, a.index_heads, a.index_dim
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (1, T, Hi, Di), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, P, Di), jnp.bfloat16)
    w = jax.random.normal(ks[2], (1, T, Hi), jnp.float32) * (Di ** -0.5 * Hi ** -0.5)
    return q, k, w


def probes(preset, T):
    cfg = get_preset(preset, seq_len=T)
    a = cfg.model.attention
    q, k, w = _cr4_inputs(a, T)
    topk = csa_jax.indexer_topk(q, k, w, ratio=4, topk=a.topk)
    idx = csa_jax.build_indices(T, 4, window=a.window, pool_topk=topk)       # [1, T, K]
    N = T + T // 4
    flat = idx.reshape(1, -1)
    from csa_jax.kernels.triton import indexer as tki

    def select_fn(scores, select="prefix"):
        return jax.jit(lambda q, k, w: csa_jax.indexer_topk(
            q, k, w, ratio=4, topk=a.topk, select=select, scores=scores))

    band = jax.random.normal(jax.random.key(3), (T // 8, T // 4), jnp.float32)
    from csa_jax.kernels.triton import topk as tkt

    kk = min(a.topk, T // 4)
    full = tki.indexer_scores(q, k, w, ratio=4) if tki.supported(q.shape, k.shape, q.dtype) \
        is None else csa_jax.indexer_scores(q, k, w, ratio=4)
    ties = jnp.round(full * 8) / 8

    def sel(rows=1, warps=4, ordered=True, sort="pair"):
        return jax.jit(lambda s: tkt.select_topk(s, kk, rows=rows, num_warps=warps,
                                                 ordered=ordered, sort=sort))
    # most informative pairs first (a time budget may stop the list)
    return {
        "topk_prefix": (select_fn("xla"), (q, k, w)),
        "topk_prefix_kernel": (select_fn("kernel"), (q, k, w)),
        "topk_select_kernel": (select_fn("kernel", "kernel"), (q, k, w)),
        "select_r1w4": (sel(), (full,)),
        "select_r1w4_unordered": (sel(ordered=False), (full,)),
        "select_r1w4_stable": (sel(sort="stable"), (full,)),
        "select_r2w4": (sel(2), (full,)),
        "select_r1w8": (sel(1, 8), (full,)),
        "select_r4w8": (sel(4, 8), (full,)),
        "select_ties": (sel(), (ties,)),
        "lax_topk_ties": (jax.jit(lambda s: jnp.where(*(lambda v, i: (v > -jnp.inf, i))(
            *jax.lax.top_k(s, kk)), -1)), (ties,)),
        "scores_full": (jax.jit(lambda q, k, w: csa_jax.indexer_scores(q, k, w, ratio=4)),
                        (q, k, w)),
        "scores_kernel": (jax.jit(lambda q, k, w: tki.indexer_scores(q, k, w, ratio=4)),
                          (q, k, w)),
        "inverse_map_s32": (jax.jit(lambda i: blockmath.inverse_map(i, N, N, narrow=False)),
                            (flat,)),
        "inverse_map_s16": (jax.jit(lambda i: blockmath.inverse_map(i, N, N, narrow=True)),
                            (flat,)),
        "inverse_map_s16_scan": (jax.jit(lambda i: blockmath.inverse_map(
            i, N, N, narrow=True, search="scan")), (flat,)),
        "topk_full": (select_fn("xla", "top_k"), (q, k, w)),
        "scores_kernel_noskip": (jax.jit(lambda q, k, w: tki.indexer_scores(
            q, k, w, ratio=4, skip=False)), (q, k, w)),
        "sort_rows_k": (jax.jit(lambda s: jax.lax.top_k(s, min(a.topk, T // 4))), (band,)),
    }


def mlp_probes(preset, T):
    """{mlp_<mode>: (fn, args, ref key)}: value and gradients of sum(mlp(x)^2) per SwiGLU mode."""
    from flax import nnx

    from train.model import SWIGLU_MODES, SwiGLU

    cfg = get_preset(preset, seq_len=T).model
    x = jax.random.normal(jax.random.key(4), (1, T, cfg.d_model), jnp.bfloat16)
    out = {}
    for mode in SWIGLU_MODES:
        mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden, dtype=jnp.bfloat16, mode=mode,
                     rngs=nnx.Rngs(0))
        graph, params = nnx.split(mlp)
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

        def loss(p, x, graph=graph):
            return jnp.sum(nnx.merge(graph, p)(x).astype(jnp.float32) ** 2)

        out[f"mlp_{mode}"] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x),
                              "mlp")
    return out


def norm_probes(preset, T):
    """{norm_<mode>: (fn, args, ref key)}: value and gradients of sum(norm(x)^2) (the output cast
    to bf16, as a block uses it) per ModelConfig.norm mode."""
    from flax import nnx

    from train.model import norm_layer

    cfg = get_preset(preset, seq_len=T).model
    x = jax.random.normal(jax.random.key(5), (1, T, cfg.d_model), jnp.bfloat16)
    out = {}
    for mode in ("nnx", "fused"):
        graph, params = nnx.split(norm_layer(cfg.d_model, eps=cfg.norm_eps,
                                             param_dtype=jnp.float32, mode=mode))

        def loss(p, x, graph=graph):
            y = nnx.merge(graph, p)(x).astype(jnp.bfloat16)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        out[f"norm_{mode}"] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x),
                               "norm")
    return out


def attention_probes(preset, T, impl, ratios, variants, xla_refs=None):
    """{name: (fn, args)} of the forward and backward per layer ratio and config variant; the
    last element of each name's tuple is a reference key for the output check. xla_refs (a
    dict) receives {reference key: (fn, args)} of impl="xla" on the same inputs."""
    cfg = get_preset(preset, seq_len=T)
    imp = registry.get(impl)
    out = {}
    for r in ratios:
        pr = problems.make_problem(cfg.model.layer(r), T, index_mode="causal", seed=r)
        if xla_refs is not None:
            xattn = lambda q, kv, idx, sink: csa_jax.sparse_attention(  # noqa: E731
                q, kv, idx, sink, impl="xla")
            xla_refs[f"cr{r}_fwd"] = (jax.jit(lambda *a: xattn(*a)[0]),
                                      (pr.q, pr.kv, pr.idx, pr.sink))
            xla_refs[f"cr{r}_bwd"] = (jax.jit(jax.grad(problems.loss_fn(xattn), argnums=(0, 1))),
                                      (pr.q, pr.kv, pr.sink, pr.idx, pr.do, pr.dlse))
        base = imp.default_config(pr.q.shape, pr.kv.shape, pr.idx.shape, pr.q.dtype)
        for name, over in parse_variants(variants):
            conf = dataclasses.replace(base, **over)
            attn = lambda q, kv, idx, sink, conf=conf: csa_jax.sparse_attention(  # noqa: E731
                q, kv, idx, sink, impl=impl, config=conf)
            loss = problems.loss_fn(attn)
            fwd = jax.jit(lambda q, kv, idx, sink, attn=attn: attn(q, kv, idx, sink)[0])
            bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
            out[f"attn_cr{r}_{name}_fwd"] = (fwd, (pr.q, pr.kv, pr.idx, pr.sink), f"cr{r}_fwd")
            out[f"attn_cr{r}_{name}_bwd"] = (bwd, (pr.q, pr.kv, pr.sink, pr.idx, pr.do, pr.dlse),
                                             f"cr{r}_bwd")
    return out


def optimizer_probe(preset, T, layout="leaves"):
    """The optimizer update of the preset's parameters. layout (a timing what-if for the
    parameter and state layout; the step keeps "leaves"): "leaves" (the model's 229 arrays for
    `small`), "stacked" (the arrays of one shape stacked into one: 12 layers' copies of a
    weight become one array), "flat" (all parameters in one f32 vector). The stacked / flat
    updates do the same per-element work (weight decay then also reaches the stacked vectors)."""
    from train.loop import init_state, make_optimizer

    cfg = get_preset(preset, seq_len=T)
    _, state, tx, _ = init_state(cfg)
    if layout != "leaves":
        leaves = jax.tree.leaves(state["params"])
        if layout == "flat":
            params = {"flat": jnp.concatenate([p.reshape(-1) for p in leaves])}
        else:
            groups = {}
            for p in leaves:
                groups.setdefault(f"{p.shape}", []).append(p)
            params = {name: jnp.stack(ps) for name, ps in groups.items()}
        tx = make_optimizer(cfg)[0]
        state = {"params": params, "opt_state": tx.init(params)}
        del leaves
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), state["params"])

    def update(params, opt_state, grads):
        import optax
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update), (state["params"], state["opt_state"], grads)


def _trace(fn, fargs, out):
    """2 traced calls of fn into out/, and its compiled HLO as out/probe.hlo.txt."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.hlo.txt").write_text(fn.lower(*fargs).compile().as_text())
    with jax.profiler.trace(str(out)):
        for _ in range(2):
            jax.block_until_ready(fn(*fargs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--time-cap", type=float, default=2.0, help="seconds of timed runs per probe")
    p.add_argument("--only", default="",
                   help="comma list of probe names, run in that order (default: all)")
    p.add_argument("--no-ops", action="store_true", help="only the attention probes")
    p.add_argument("--optimizer", action="store_true", help="also time the optimizer update")
    p.add_argument("--attn-impl", default="", help="e.g. pallas_triton (default: none)")
    p.add_argument("--attn-ratios", default="4,128,0")
    p.add_argument("--attn-variants", default="", help="'NAME:k=v,k=v; ...' config overrides")
    p.add_argument("--attn-check", choices=["none", "xla"], default="none",
                   help="xla: also check every attention probe's outputs against impl='xla'")
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--profile", metavar="DIR", help="trace 2 more calls of each --profile-probes "
                   "probe into DIR/<probe> with its compiled HLO (benchmarks.trace_breakdown "
                   "DIR/<probe> --hlo DIR/<probe>/probe.hlo.txt --steps 2)")
    p.add_argument("--profile-probes", default="", help="comma list of probe names to trace")
    p.add_argument("--out", default="train_ops_probe.json")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    only = set(filter(None, args.only.split(",")))
    todo, xla_refs, xla_out = {}, {}, {}
    if not args.no_ops:
        todo.update({k: v + (None,) for k, v in probes(args.preset, args.seq_len).items()})
        todo.update(mlp_probes(args.preset, args.seq_len))
        todo.update(norm_probes(args.preset, args.seq_len))
    if args.attn_impl:
        ratios = [int(r) for r in args.attn_ratios.split(",") if r]
        todo.update(attention_probes(args.preset, args.seq_len, args.attn_impl, ratios,
                                     args.attn_variants,
                                     xla_refs if args.attn_check == "xla" else None))
    names = list(todo) + (["optimizer", "optimizer_stacked", "optimizer_flat"]
                          if args.optimizer else [])
    if only:   # in the order given (a time budget stops the tail of the list)
        names = [n for n in args.only.split(",") if n in names]
    rows, refs, outs, checks = [], {}, {}, {}
    # pairs whose outputs (top-k ids) must be equal, checked as soon as both have run
    pairs = [("topk_prefix", "topk_full"), ("topk_prefix", "topk_prefix_kernel"),
             ("topk_prefix", "topk_select_kernel"), ("topk_prefix_kernel", "topk_select_kernel"),
             ("select_r1w4", "select_r2w4"), ("select_r1w4", "select_r1w4_stable"),
             ("select_r1w4", "select_r1w8"), ("select_r1w4", "select_r4w8"),
             ("lax_topk_ties", "select_ties")]
    paired = {n for pair in pairs for n in pair}
    meta = dict(device=str(jax.devices()[0].device_kind), preset=args.preset,
                seq_len=args.seq_len, jax=jax.__version__, attn_impl=args.attn_impl,
                attn_variants=args.attn_variants)
    for name in names:
        if only and name not in only:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget of {args.budget_s} s spent: {name} and later probes not run")
            break
        if name.startswith("optimizer"):
            layout = name.partition("_")[2] or "leaves"
            make, ref = (lambda layout=layout: optimizer_probe(args.preset, args.seq_len,
                                                                layout)), None
        else:
            make, ref = (lambda name=name: todo[name][:2]), todo[name][2]
        row, res, built = timed_probe(name, make, args.reps, args.time_cap)
        if res is None:
            rows.append(row)
            continue
        ms, n, first = row["ms"], row["reps"], row["first_s"]
        fn, fargs = built
        if args.profile and name in args.profile_probes.split(","):
            _trace(fn, fargs, Path(args.profile) / name)
        if ref is not None:   # the first config of a ratio is the reference of the others
            if ref in refs:
                row["rel_err_vs_default"] = max(problems.rel_err(a, b) for a, b in zip(
                    jax.tree.leaves(res), jax.tree.leaves(refs[ref])))
            else:
                refs[ref] = res
        if ref in xla_refs:
            try:
                if ref not in xla_out:
                    fn_x, args_x = xla_refs[ref]
                    xla_out[ref] = jax.block_until_ready(fn_x(*args_x))
                row["rel_err_vs_xla"] = max(problems.rel_err(a, b) for a, b in zip(
                    jax.tree.leaves(res), jax.tree.leaves(xla_out[ref])))
            except Exception as e:  # report and go on
                row["xla_check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        if name in paired:
            outs[name] = res
            for one, other in pairs:
                if name in (one, other) and one in outs and other in outs:
                    a, b = np.asarray(outs[one]), np.asarray(outs[other])
                    checks[f"{one}|{other}"] = dict(same=bool(np.array_equal(a, b)),
                                                    tokens_differing=int((a != b).any(-1).sum()))
                    print(f"{one} vs {other}: {checks[f'{one}|{other}']}")
        err = f" | err {row['rel_err_vs_default']:.1e}" if "rel_err_vs_default" in row else ""
        if "rel_err_vs_xla" in row:
            err += f" | vs xla {row['rel_err_vs_xla']:.1e}"
        print(f"| {name} | {ms:.3f} ms | {n} reps | first call {first:.1f} s{err} |", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows, checks=checks), indent=2))
    timed = {r["probe"] for r in rows if "ms" in r}
    if {"scores_full", "scores_kernel"} <= timed:
        a = np.asarray(todo["scores_full"][0](*todo["scores_full"][1]))
        b = np.asarray(todo["scores_kernel"][0](*todo["scores_full"][1]))
        fin = np.isfinite(a)
        checks["scores_kernel"] = dict(
            same_inf=bool(np.array_equal(np.isneginf(a), np.isneginf(b))),
            rel_err=float(np.abs(a[fin] - b[fin]).max() / max(np.abs(a[fin]).max(), 1e-30)))
        print(f"scores_kernel vs scores_full: {checks['scores_kernel']}")
    Path(args.out).write_text(json.dumps(dict(meta, rows=rows, checks=checks), indent=2))
    return rows


if __name__ == "__main__":
    main()
