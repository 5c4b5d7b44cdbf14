"""Where the Gluon backward's dkv time goes (issue 14): each piece of the dkv path timed alone.

    python -m benchmarks.gluon_dkv_parts [--shapes pro:4:4096,pro:4:16384] [--out f.json]
        [--reduce-variants 16:4,64:4,32:8] [--bwd-variants 'qdo:bwd_qdo=true;...']
        [--pieces ...] [--dry-run]

Pieces (each its own jax.jit on ready inputs; median ms of --reps runs after a warm run; `gb` =
the device-memory bytes a perfect kernel would move, `gb_s` = gb / time):
  stack      jnp.stack([q, dO], 2) [B, T, 2, Hp, Dp] (the interm GEMM's operand)
  gemm       interm [B, T, Kp, Dp] = dsp^T [q; dO] (XLA batched dot, bf16 out, f32 accumulation)
             on the stacked operand; gemm_qdo: the same on Config.bwd_qdo's head-block-major
             layout (the dq kernel writes the operand, no stack); ginterm_OP: the Gluon interm
             GEMM (Config.bwd_interm="gluon", GPU only) per A-operand way OP (--interm-operands),
             checked against gemm and bit-identical across two runs
  invmap     the CSR inverse map (stable argsort of [B, T*Kp] keys + searchsorted);
             invmap16: int16 keys (Config.bwd_narrow_keys)
  reduce     the gather-reduce kernel (Pallas Triton) alone on a ready map; reduce_R_W: with
             block_r R and W warps (Config.bwd_block_r / bwd_reduce_warps); greduce_R_W: the
             Gluon reduce (Config.bwd_reduce="gluon", GPU only), checked against reduce (its
             summation order differs) and bit-identical across two runs
  read_floor jnp.sum(interm in f32, (0, 1)): reads interm once (the reduce's byte floor)
  dkv        stack + gemm + invmap + reduce in one jit (what `bwd - dq` measured)
  bwd        the whole Gluon backward (GPU only) per --bwd-variants: ms (and dq_ms: only dq
             kept, so XLA drops the dkv work; dkv_ms = the difference), and each variant's
             dq / dkv / dsink against the default's (max-abs error / max-abs) and bit-identity
             of two runs of the same variant; --step: also the step (value and grad of
             sum(o dO) + sum(lse dlse) through sparse_attention(impl="gluon", config=...))
  grad       (part, GPU only) every --grad-variants config (the default if none) against impl="xla"
             at two small cases of gluon_bwd_check (-1 and out-of-range slots, duplicates,
             empty tokens, both cotangents; H 128 / K 130 and H 16 / D 64 padded), bit-identical
             across two runs
dsp is random (the pieces' times do not depend on its values); idx is the problem's (Pro cr4:
random, every slot valid). --dry-run: tiny shapes on a CPU (reduce in the Pallas interpreter),
to check the script before a GPU call. One JSON line per row.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import parse_variants, time_fn
from benchmarks.gluon_check import grad_check, parse_shapes, report, report_failure, run_parts

_DIMS = (((2, 3), (2, 3)), ((0, 1), (0, 1)))


@jax.jit
def _rel_dev(a, b):
    """max|a - b| / max|b| on the device (the arrays here are up to 19 GB: no host copy);
    NaN if a has a NaN."""
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    err = jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)
    return jnp.where(jnp.any(jnp.isnan(a)), jnp.nan, err)


def rel(a, b):
    return float(_rel_dev(a, b))


def _ms(fn, args, reps):
    return time_fn(fn, args, reps, float("inf"))[0]


def _inputs(family, ratio, T, seed):
    from csa_jax import problems
    from csa_jax.config import preset
    from csa_jax.kernels.gluon.dims import padded_dims
    from csa_jax.kernels.triton.plan import _Dims, _pad_to, _prep_idx
    c = preset(family, ratio)
    pr = problems.make_problem(c, T, B=1, seed=seed,
                               index_mode="random" if ratio == 4 else "causal")
    B, T, H, D = pr.q.shape
    N, K = pr.kv.shape[1], pr.idx.shape[2]
    Hp, Dp, Kp = padded_dims(H, D, K, 32)
    d = _Dims(B, T, H, D, N, K, Hp, Dp, Kp)
    idx_p, _ = _prep_idx(pr.idx, d)
    q_p = _pad_to(_pad_to(pr.q, 3, Dp), 2, Hp)
    do_p = _pad_to(_pad_to(pr.do, 3, Dp), 2, Hp)
    dsp = (jax.random.normal(jax.random.PRNGKey(seed + 5), (B, T, 2, Hp, Kp), jnp.float32)
           * 0.01).astype(q_p.dtype)
    return c, pr, d, idx_p, q_p, do_p, dsp


def part_pieces(shapes, seed, reps, reduce_variants, gluon_reduce_variants, interm_operands,
                pieces, interpret):
    from csa_jax.kernels import triton as pt
    from csa_jax.kernels.triton import testing as tt
    for family, ratio, T in shapes:
        c, pr, d, idx_p, q_p, do_p, dsp = _inputs(family, ratio, T, seed)
        B, Hp, Dp, Kp, N = d.B, d.Hp, d.Dp, d.Kp, d.N
        E = B * T * Kp
        isz = q_p.dtype.itemsize
        gb_qdo = 2 * B * T * Hp * Dp * isz / 1e9          # [q; dO]
        gb_dsp = 2 * B * T * Hp * Kp * isz / 1e9
        gb_int = E * Dp * isz / 1e9
        ptc = pt.default_config(pr.q.shape, pr.kv.shape, pr.idx.shape, pr.q.dtype)
        base = dict(part="pieces", family=family, ratio=ratio, T=T, B=B, Hp=Hp, Dp=Dp, Kp=Kp,
                    N=N, entries=E)

        def row(name, fn, args, gb=None, flops=None, **extra):
            if pieces and name.split("_")[0] not in pieces:
                return
            try:
                ms = _ms(jax.jit(fn), args, reps)
                r = dict(base, piece=name, ms=ms, **extra)
                if gb is not None:
                    r.update(gb=gb, gb_s=gb / ms * 1e3)
                if flops is not None:
                    r["tflops"] = flops / ms / 1e9
                report(**r)
            except Exception as e:  # noqa: BLE001
                report_failure(e, 400, **base, piece=name)

        stack = lambda a, b: jnp.stack([a, b], axis=2)
        qdo = jax.block_until_ready(jax.jit(stack)(q_p, do_p))
        gemm = lambda s, x: lax.dot_general(s, x, _DIMS, preferred_element_type=s.dtype)
        fl = 2.0 * B * T * Kp * Dp * 2 * Hp
        row("stack", stack, (q_p, do_p), gb=2 * gb_qdo)
        row("gemm", gemm, (dsp, qdo), gb=gb_dsp + gb_qdo + gb_int, flops=fl)
        if not interpret and (not pieces or "ginterm" in pieces):
            # The Gluon interm GEMM (Config.bwd_interm="gluon"): q and dO in place, no stack.
            from csa_jax.kernels.gluon import interm as gim
            gemm_j = jax.jit(gemm)
            dsp_flat = dsp.reshape(B * T, 2, Hp, Kp)
            for op in interm_operands:          # "desc_pipe": desc, pipelined
                fn = lambda s, a, b, op=op: gim.interm(s, a, b, operand=op.split("_pipe")[0],
                                                       pipeline=op.endswith("_pipe"))
                row(f"ginterm_{op}", fn, (dsp_flat, q_p, do_p), gb=gb_dsp + gb_qdo + gb_int,
                    flops=fl, operand=op)
                try:
                    # one 19 GB interm at a time besides u: the reference, then the rerun
                    u = jax.jit(fn)(dsp_flat, q_p, do_p)
                    err = rel(u, gemm_j(dsp, qdo))
                    v = jax.jit(fn)(dsp_flat, q_p, do_p)
                    same = bool(jnp.array_equal(u, v))
                    report(**base, piece=f"ginterm_{op}_check", err_vs_gemm=err,
                           bit_identical=same, ok=same and err <= 1e-2)
                    del u, v
                except Exception as e:  # noqa: BLE001
                    report(**base, piece=f"ginterm_{op}_check", ok=False,
                           error=f"{type(e).__name__}: {e}"[:400])
            del dsp_flat
        # Config.bwd_qdo's layout: both operands head block first ([B, T, 2*Hp, .]).
        nhb = Hp // 64
        dsp_hb = dsp.reshape(B, T, 2, nhb, 64, Kp).transpose(0, 1, 3, 2, 4, 5).reshape(
            B, T, 2 * Hp, Kp)
        qdo_hb = qdo.reshape(B, T, 2, nhb, 64, Dp).transpose(0, 1, 3, 2, 4, 5).reshape(
            B, T, 2 * Hp, Dp)
        gemm_hb = lambda s, x: lax.dot_general(s, x, (((2,), (2,)), ((0, 1), (0, 1))),
                                               preferred_element_type=s.dtype)
        row("gemm_qdo", gemm_hb, (dsp_hb, qdo_hb), gb=gb_dsp + gb_qdo + gb_int, flops=fl)
        del dsp_hb, qdo_hb
        gb_idx = E * 4 / 1e9
        row("invmap", lambda i: tt.inverse_map(i, N), (idx_p,), gb=gb_idx)
        row("invmap16", lambda i: tt.inverse_map(i, N, narrow_keys=True), (idx_p,), gb=gb_idx)
        a = jax.jit(lambda i: tt.inverse_map(i, N))(idx_p)
        b = jax.jit(lambda i: tt.inverse_map(i, N, narrow_keys=True))(idx_p)
        report(**base, piece="invmap16_same", ok=bool(jnp.array_equal(a[0], b[0])
                                                      and jnp.array_equal(a[1], b[1])))
        offsets, perm = a
        interm = jax.block_until_ready(jax.jit(gemm)(dsp, qdo))
        gb_red = gb_int + E * 4 / 1e9 + B * N * Dp * isz / 1e9
        red = {}
        for br, nw in [(ptc.block_r, ptc.num_warps_reduce)] + list(reduce_variants):
            cfg = dataclasses.replace(ptc, block_r=br, num_warps_reduce=nw)
            name = "reduce" if (br, nw) == (ptc.block_r, ptc.num_warps_reduce) else \
                f"reduce_{br}_{nw}"
            fn = lambda o, p, x, cfg=cfg: tt.reduce_rows(d, cfg, interpret, o, p, x, pr.kv.dtype)
            row(name, fn, (offsets, perm, interm), gb=gb_red, block_r=br, warps=nw)
            if not pieces or "reduce" in pieces:
                red[name] = jax.jit(fn)(offsets, perm, interm)
        for name, v in red.items():
            # Information, not a check: another warp count changes the order of the kernel's
            # in-block sum (each config is deterministic on its own).
            if name != "reduce":
                report(**base, piece=name + "_vs_default", same_bits=bool(
                    jnp.array_equal(v, red["reduce"])), err_vs_reduce=rel(v, red["reduce"]))
        if not interpret:                    # the Gluon reduce (kernels/gluon/dkv.py): GPU only
            from csa_jax.kernels.gluon import dkv as gdkv
            for br, nw in gluon_reduce_variants:
                name = f"greduce_{br}_{nw}"
                fn = lambda o, p, x, br=br, nw=nw: gdkv.reduce_rows(
                    o, p, x.reshape(B, E // B, Dp), pr.kv.dtype, block_r=br, num_warps=nw)
                row(name, fn, (offsets, perm, interm), gb=gb_red, block_r=br, warps=nw)
                if (not pieces or "greduce" in pieces) and "reduce" in red:
                    u = jax.jit(fn)(offsets, perm, interm)
                    v = jax.jit(fn)(offsets, perm, interm)
                    report(**base, piece=name + "_check", err_vs_reduce=rel(u, red["reduce"]),
                           bit_identical=bool(jnp.array_equal(u, v)),
                           ok=bool(jnp.array_equal(u, v)) and rel(u, red["reduce"]) <= 1e-2)
                    del u, v
        del red
        row("read", lambda x: jnp.sum(x.astype(jnp.float32), axis=(0, 1)), (interm,),
            gb=gb_int, what="read_floor")
        del interm

        def dkv(s, a, b, i):
            x = tt.interm_gemm(s, a, b, None, s.dtype)
            return pt_reduce(d, ptc, interpret, i, x, pr.kv.dtype)

        from csa_jax.kernels.triton.backward import _reduce_call as pt_reduce
        row("dkv", dkv, (dsp, q_p, do_p, idx_p), gb=2 * gb_qdo + gb_dsp + gb_qdo + gb_int
            + gb_red + gb_idx)
        del qdo, dsp, q_p, do_p


def part_bwd(shapes, seed, reps, variants, dq_time=True, step=False):
    """The whole Gluon backward per variant; each checked against the default and twice run."""
    from csa_jax import registry
    g = registry.get("gluon")
    for family, ratio, T in shapes:
        c, pr, *_ = _inputs(family, ratio, T, seed)
        base_cfg = g.default_config(pr.q.shape, pr.kv.shape, pr.idx.shape, pr.q.dtype)
        o, lse = g.forward(pr.q, pr.kv, pr.idx, pr.sink, scale=c.scale, interpret=False,
                           config=base_cfg)
        args = (pr.q, pr.kv, pr.idx, pr.sink, o, lse, pr.do, pr.dlse)
        nominal, _ = pr.flops()
        ref = None
        for name, kw in variants:
            try:
                cfg = dataclasses.replace(base_cfg, **kw)
                f = jax.jit(lambda *a, cfg=cfg: g.backward(*a, scale=c.scale, interpret=False,
                                                           config=cfg))
                ms = _ms(f, args, reps)
                # dq alone: XLA drops the dkv work (the dq kernel, delta, padding)
                fdq = jax.jit(lambda *a, cfg=cfg: g.backward(*a, scale=c.scale,
                                                             interpret=False, config=cfg)[0])
                dq_ms = _ms(fdq, args, reps) if dq_time else float("nan")
                out1 = jax.block_until_ready(f(*args))
                out2 = jax.block_until_ready(f(*args))
                r = dict(part="bwd", family=family, ratio=ratio, T=T, variant=name, config=kw,
                         bwd_ms=ms, bwd_tflops_nominal=2.5 * nominal / ms / 1e9, dq_ms=dq_ms,
                         dkv_ms=ms - dq_ms,
                         bit_identical={n: bool(jnp.array_equal(u, v)) for n, u, v in
                                        zip(("dq", "dkv", "dsink"), out1, out2)})
                if step:      # value and grad of the loss through sparse_attention, this config
                    import csa_jax
                    from csa_jax import problems
                    loss = problems.loss_fn(lambda q, kv, idx, s, cfg=cfg: csa_jax.sparse_attention(
                        q, kv, idx, s, scale=c.scale, impl="gluon", config=cfg))
                    st = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
                    r["step_ms"] = _ms(st, (pr.q, pr.kv, pr.sink, pr.idx, pr.do, pr.dlse), reps)
                    r["step_tflops_nominal"] = 3.5 * nominal / r["step_ms"] / 1e9
                ok = all(r["bit_identical"].values())
                if ref is None:
                    ref = out1
                else:
                    r["err_vs_default"] = {n: rel(u, v) for n, u, v in
                                           zip(("dq", "dkv", "dsink"), out1, ref)}
                    ok = ok and all(e <= 2e-2 for e in r["err_vs_default"].values())
                report(**r, ok=ok)
                del out1, out2
            except Exception as e:  # noqa: BLE001
                report_failure(e, 400, part="bwd", family=family, ratio=ratio, T=T, variant=name)
        del ref, args, o, lse, pr


GRAD_CASES = ("h128_d512_bf16_nosink_k130", "h16_d64_bf16_sink_pad")


def part_grad(seed, variants, cases=GRAD_CASES):
    """The new dkv variants against impl="xla"'s backward at small shapes (gluon_bwd_check's
    cases: -1 slots, out-of-range ids, duplicate rows, all-empty tokens, both cotangents), and
    each variant's backward bit-identical across two runs."""
    from benchmarks import gluon_bwd_check as gbc
    g, x = gbc._mods()
    # The default was checked on its own (gluon_bwd_check); with variants named, only they run.
    variants = [v for v in variants if v[0] != "default"] or variants
    key = jax.random.PRNGKey(seed + 11)
    for name, B, T, H, D, N, K, dt, sink in gbc.CASES:
        key, k = jax.random.split(key)
        if name not in cases:
            continue
        q, kv, idx, s, do, dlse = gbc._bwd_inputs(k, B, T, H, D, N, K, dt, sink)
        scale = D ** -0.5
        o, lse = x.forward(q, kv, idx, s, scale=scale, interpret=False, config=x.Config())
        args = (q, kv, idx, s, o, lse, do, dlse)
        ref = gbc._run_bwd(x, x.Config(), args, scale)
        base = g.default_config(q.shape, kv.shape, idx.shape, q.dtype)
        for vname, kw in variants:
            try:
                cfg = dataclasses.replace(base, **kw)
                f = jax.jit(lambda *a, cfg=cfg: g.backward(*a, scale=scale, interpret=False,
                                                           config=cfg))
                got = jax.block_until_ready(f(*args))
                again = jax.block_until_ready(f(*args))
            except Exception as e:  # noqa: BLE001
                report_failure(e, part="grad", case=name, variant=vname)
                continue
            errs, ok = grad_check(got, ref, sink, dt, rel)
            same = {n: bool(jnp.array_equal(a, b)) for n, a, b in
                    zip(("dq", "dkv", "dsink"), got, again)}
            report(part="grad", case=name, variant=vname, config=kw, errs=errs,
                   bit_identical=same, ok=ok and all(same.values()))


def parse_reduce_variants(spec):
    """'16:4,64:8' -> [(16, 4), (64, 8)] (block_r : warps)."""
    out = []
    for item in filter(None, spec.split(",")):
        br, _, nw = item.partition(":")
        out.append((int(br), int(nw or 4)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="pieces,grad,bwd")
    ap.add_argument("--shapes", default="pro:4:4096,pro:4:16384")
    ap.add_argument("--bwd-shapes", default="pro:4:16384")
    ap.add_argument("--pieces", default="", help="comma list of piece names (default all)")
    ap.add_argument("--reduce-variants", default="16:4,64:4,32:8")
    ap.add_argument("--gluon-reduce-variants", default="16:4,32:8,8:4")
    ap.add_argument("--interm-operands", default="desc,desc_pipe,ldsm_trans,movmatrix")
    ap.add_argument("--bwd-variants", default="")
    ap.add_argument("--no-dq-time", action="store_true", help="bwd part: skip the dq-only time")
    ap.add_argument("--step", action="store_true", help="bwd part: also time the step")
    ap.add_argument("--grad-variants", default="")
    ap.add_argument("--grad-cases", default=",".join(GRAD_CASES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpreter")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(f"# device {jax.devices()[0].device_kind}, jax {jax.__version__}, seed {args.seed}",
          flush=True)
    pieces = set(filter(None, args.pieces.split(",")))
    handlers = {
        "pieces": lambda: part_pieces(parse_shapes(args.shapes), args.seed, args.reps,
                                      parse_reduce_variants(args.reduce_variants),
                                      parse_reduce_variants(args.gluon_reduce_variants),
                                      [o for o in args.interm_operands.split(",") if o],
                                      pieces, args.dry_run),
        "bwd": lambda: part_bwd(parse_shapes(args.bwd_shapes), args.seed, args.reps,
                                parse_variants(args.bwd_variants), not args.no_dq_time,
                                args.step),
        "grad": lambda: part_grad(args.seed, parse_variants(args.grad_variants),
                                  tuple(args.grad_cases.split(","))),
    }
    return run_parts(args.parts.split(","), handlers, seed=args.seed, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
