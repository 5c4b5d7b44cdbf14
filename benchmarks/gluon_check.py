"""GPU check of impl="gluon" (run on an NVIDIA Hopper GPU; Gluon has no CPU interpreter).

    python -m benchmarks.gluon_check [--parts random,golden,grad,maps,time,window]
        [--golden-dir DIR] [--out check.json] [--seed S] [--config key=val,...]
        [--cases name,...]

--config overrides fields of the gluon Config (block_k, stages, bwd, bwd_block_k, bwd_stages;
e.g. bwd=pallas_triton) for every gluon call; the layout promise is the window part's (layout,
window and pool_ratio are refused here). --cases runs only the named random cases (the same
inputs as in a full run with that seed); for the window part, the cases whose names contain
one of the given strings.

Parts:
  random  the forward vs impl="xla" on fresh random inputs: -1 slots anywhere, out-of-range ids,
          duplicate rows, all-empty rows, with and without sink, H in {1, 8, 16, 24, 32} (the
          few-heads forward, padded to 16 / 32) and {64, 128}, D in {64, 128, 512}, K not a
          multiple of the tile, bf16 and f16; o by max-abs error over
          max-abs reference, lse by the same on non-empty rows, and empty rows exactly
          (o == 0, lse == sink or EMPTY_LSE);
  golden  the three golden cases (tests/golden, cast to bf16) through sparse_attention;
  grad    jax.grad through sparse_attention(impl="gluon") (forward Gluon, backward per
          Config.bwd: the Gluon dq kernel, at H <= 32 the few-heads one) vs impl="xla", both
          cotangents (dO and dlse), H in {64, 32, 24, 16, 8}, f16 at D = 128; the gradients
          bit-identical across two runs;
  maps    the block dkv's maps kernels (dkv_blocks.py) against their XLA twins: flag, dup,
          counts and lists exactly, posg at every pair of a token without repeats;
  time    forward ms of xla, pallas_triton, gluon at a few V4 shapes (checked vs xla);
  window  the cr0 window kernel (window.py, window 128, H > 32), as the NNX layer runs it:
          sparse_attention(..., layout="cr0") vs impl="xla" on fresh random q / kv with
          csa_jax.build_indices' cr0 lists (causal start tokens with -1 slots, T not a multiple
          of the 16-token block, slots shuffled inside the window; padded heads and D = 64 in
          one case); under jax.jit with one token's list broken (that token NaN, the others
          unchanged); one cr128 case (layout="cr128": the gather kernel, the promise checked);
          the ms of the traced promise check alone (layouts.violations, without --config).
Every check prints one JSON line; the script exits non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import apply_overrides, parse_overrides, time_fn

TOL = {"bfloat16": 2e-2, "float16": 5e-3}
RESULTS = []
OVERRIDES = {}
CASES = set()          # --cases: run only these random cases (empty = all)


def gluon_config(q, kv, idx, layout=None):
    """The gluon Config of a call: default_config for the shapes and the layout promise (a
    csa_jax.Layout or None), with the --config overrides."""
    from csa_jax import registry
    mod = registry.get("gluon")
    base = mod.default_config(q.shape, kv.shape, idx.shape, q.dtype, layout)
    return apply_overrides(mod, base, q.shape, OVERRIDES)


def report(**row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def rel(a, b, mask=None):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if mask is not None:
        a, b = a[mask], b[mask]
    if np.isnan(a).any():
        return float("nan")
    den = max(np.abs(b).max(initial=0.0), 1e-30)
    return float(np.abs(a - b).max(initial=0.0) / den)


def report_failure(e, limit=500, **row):
    """In an except block: e's traceback (4 frames from the try) to stderr, then the row
    reported as failed (**row, ok=False, error="Type: message" cut to `limit` characters)."""
    traceback.print_exc(limit=4)
    report(**row, ok=False, error=f"{type(e).__name__}: {e}"[:limit])


def grad_check(got, ref, sink, dtype, rel_fn=rel):
    """(errs, ok) of a backward's (dq, dkv, dsink) against a reference's: rel_fn error of
    each (no dsink without a sink: the vjp zeroes it), ok if every error is within TOL of
    the dtype (a NaN is not)."""
    errs = {n: rel_fn(a, b) for n, a, b in zip(("dq", "dkv", "dsink"), got, ref)}
    if not sink:
        errs.pop("dsink")
    return errs, all(e <= TOL[jnp.dtype(dtype).name] for e in errs.values())


# ----------------------------------------------------------------------------- forward checks


def random_case(key, B, T, H, D, N, K, dtype, sink, empty_rows=True):
    kq, kkv, ki, km, ks = jax.random.split(key, 5)
    q = jax.random.normal(kq, (B, T, H, D), dtype)
    kv = jax.random.normal(kkv, (B, N, D), dtype)
    idx = jax.random.randint(ki, (B, T, K), 0, N, dtype=jnp.int32)
    u = jax.random.uniform(km, (B, T, K))
    idx = jnp.where(u < 0.2, -1, idx)                          # -1 anywhere
    idx = jnp.where(u > 0.97, N + 5, idx)                      # out of range -> empty
    idx = idx.at[:, :, 1].set(idx[:, :, 0])                    # duplicates
    if empty_rows:
        idx = idx.at[:, 0].set(-1)                             # all-empty tokens
        idx = idx.at[:, T // 2].set(-1)
    s = jax.random.normal(ks, (H,), jnp.float32) if sink else None
    return q, kv, idx, s


def drop_repeats(idx):
    """idx with every second (third, ...) listing of a row within a token made -1."""
    order = jnp.argsort(idx, axis=-1, stable=True)
    s = jnp.take_along_axis(idx, order, axis=-1)
    again = jnp.concatenate([jnp.zeros_like(s[..., :1], bool),
                             (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)], axis=-1)
    return jnp.where(jnp.take_along_axis(again, jnp.argsort(order, axis=-1), axis=-1), -1, idx)


def check_forward(name, q, kv, idx, sink, *, scale=None, ref_o=None, layout=None):
    """One forward check row; layout: the promise (a csa_jax.Layout) passed to
    sparse_attention(impl="gluon") (the row's `kernel` says which kernel it ran)."""
    import csa_jax
    from csa_jax.common import EMPTY_LSE
    dt = jnp.dtype(q.dtype).name
    kernel = None
    try:
        cfg = gluon_config(q, kv, idx, layout)
        kernel = "window" if cfg.runs_window_kernel(q.shape[2]) else "gather"
        o, lse = csa_jax.sparse_attention(q, kv, idx, sink, scale=scale, impl="gluon",
                                          config=cfg, layout=layout)
        xo, xl = csa_jax.sparse_attention(q, kv, idx, sink, scale=scale, impl="xla")
        jax.block_until_ready((o, lse))
    except Exception as e:  # noqa: BLE001
        report_failure(e, part="forward", case=name, kernel=kernel)
        return
    valid = (idx >= 0) & (idx < kv.shape[1])
    empty = ~valid.any(-1)                                     # [B, T]
    nonempty = np.asarray(jnp.broadcast_to(~empty[..., None], lse.shape))
    e_o = rel(o, xo)
    e_lse = rel(lse, xl, nonempty)
    empty_ok = True
    if bool(empty.any()):
        want = (EMPTY_LSE if sink is None else jnp.broadcast_to(sink, lse.shape))
        want = jnp.broadcast_to(want, lse.shape)
        m = np.asarray(jnp.broadcast_to(empty[..., None], lse.shape))
        empty_ok = (bool(jnp.all(jnp.where(empty[..., None, None], o == 0, True)))
                    and np.allclose(np.asarray(lse)[m], np.asarray(want)[m], rtol=1e-6))
    row = dict(part="forward", case=name, kernel=kernel, shape=list(q.shape), K=idx.shape[-1],
               dtype=dt, sink=sink is not None, err_o=e_o, err_lse=e_lse, empty_rows_ok=empty_ok)
    tol = TOL[dt]
    ok = e_o <= tol and e_lse <= tol and empty_ok
    if ref_o is not None:
        row["err_o_golden"] = rel(o, ref_o)
        ok = ok and row["err_o_golden"] <= tol
    row["ok"] = bool(ok)
    report(**row)


def part_random(seed):
    key = jax.random.PRNGKey(seed + 1)
    cases = [        # the longest list (18 tiles) first: a pipeline hang shows up at once
        ("h128_d512_bf16_k1152", 1, 64, 128, 512, 2000, 1152, jnp.bfloat16, True),
        ("h64_d512_bf16_sink", 1, 192, 64, 512, 320, 192, jnp.bfloat16, True),
        ("h128_d512_bf16_nosink_k130", 2, 96, 128, 512, 200, 130, jnp.bfloat16, False),
        ("h16_d64_bf16_sink_pad", 1, 64, 16, 64, 100, 40, jnp.bfloat16, True),
        ("h64_d512_f16_sink", 1, 64, 64, 512, 150, 100, jnp.float16, True),
        # the few-heads forward (small_heads.py): 16 / 32 padded heads, 64-row tiles
        ("h16_d512_bf16_k1152", 1, 64, 16, 512, 2000, 1152, jnp.bfloat16, True),
        ("h32_d512_bf16_nosink_k130", 2, 96, 32, 512, 200, 130, jnp.bfloat16, False),
        ("h8_d512_f16_sink", 1, 64, 8, 512, 150, 100, jnp.float16, True),
        ("h24_d128_bf16_sink_pad", 1, 80, 24, 128, 300, 200, jnp.bfloat16, True),
        ("h1_d512_bf16_sink", 1, 32, 1, 512, 100, 70, jnp.bfloat16, True),
    ]
    unknown = CASES - {c[0] for c in cases}
    if unknown:
        raise ValueError(f"--cases {sorted(unknown)}: not random cases ({[c[0] for c in cases]})")
    for name, B, T, H, D, N, K, dt, sink in cases:
        key, k = jax.random.split(key)
        if CASES and name not in CASES:
            continue
        check_forward(name, *random_case(k, B, T, H, D, N, K, dt, sink))


def part_golden(golden_dir):
    for f in sorted(os.listdir(golden_dir)):
        if not f.endswith(".npz"):
            continue
        z = np.load(os.path.join(golden_dir, f))
        cast = lambda x: jnp.asarray(x, jnp.bfloat16)
        check_forward("golden:" + f, cast(z["q"]), cast(z["kv"]), jnp.asarray(z["idx"]),
                      jnp.asarray(z["sink"], jnp.float32), scale=float(z["scale"]),
                      ref_o=jnp.asarray(z["o"]))


def part_grad(seed):
    """jax.grad through sparse_attention(impl="gluon") vs impl="xla", both cotangents, -1 and
    out-of-range slots, all-empty tokens: H = 64 (the 64-head kernels), 32 / 24 / 16 / 8 (the
    few-heads forward and dq kernel; 24 and 8 mask their padded heads), one f16 case without
    sink at D = 128; the Gluon gradients computed twice must be bit-identical (det). Rows
    "norep": the same lists with repeated rows dropped (drop_repeats; under
    Config.bwd_dkv="blocks" only those run the block dkv kernel, the others its per-slot
    fallback)."""
    import csa_jax
    from csa_jax import problems
    key = jax.random.PRNGKey(seed + 2)
    cases = [(64, 512, jnp.bfloat16, True, True), (32, 512, jnp.bfloat16, True, True),
             (24, 512, jnp.bfloat16, True, True), (16, 512, jnp.bfloat16, True, True),
             (8, 512, jnp.bfloat16, True, True), (16, 128, jnp.float16, False, True),
             (32, 512, jnp.bfloat16, True, False), (16, 512, jnp.bfloat16, True, False),
             (8, 512, jnp.bfloat16, True, False), (16, 128, jnp.float16, False, False)]
    for H, D, dtype, sink, repeats in cases:
        key, k = jax.random.split(key)
        q, kv, idx, s = random_case(k, 1, 128, H, D, 256, 160, dtype, sink)
        if not repeats:
            idx = drop_repeats(idx)
        s = jnp.full((H,), -jnp.inf) if s is None else s   # no sink: -inf logits (dsink 0)
        kd, kl = jax.random.split(k)
        do = jax.random.normal(kd, q.shape, q.dtype)
        dlse = jax.random.normal(kl, q.shape[:3], jnp.float32) * 0.1
        row = dict(part="grad", H=H, D=D, dtype=jnp.dtype(dtype).name,
                   lists="repeats" if repeats else "norep")
        try:
            cfg = gluon_config(q, kv, idx)
            grads = {}
            for impl, c in (("gluon", cfg), ("xla", None)):
                loss = problems.loss_fn(lambda q, kv, idx, s, impl=impl, c=c:
                                        csa_jax.sparse_attention(q, kv, idx, s, impl=impl,
                                                                 config=c))
                g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                grads[impl] = g(q, kv, s, idx, do, dlse)
                if impl == "gluon":
                    again = g(q, kv, s, idx, do, dlse)
                    det = all(bool(jnp.array_equal(a, b)) for a, b in zip(grads[impl], again))
        except Exception as e:  # noqa: BLE001
            report_failure(e, **row)
            continue
        errs = {n: rel(a, b)
                for n, a, b in zip(("dq", "dkv", "dsink"), grads["gluon"], grads["xla"])}
        report(**row, bwd=cfg.bwd, errs=errs, det=det,
               ok=det and all(e <= 2e-2 for e in errs.values()))


def part_maps(seed):
    """The block dkv's maps kernels (dkv_blocks.block_maps) against their XLA twins
    (maps_token_reference / maps_block_reference): flag, dup per token, counts and lists
    exactly; posg exactly at every (block, token) pair of a token without repeats (the kernel
    writes nothing elsewhere; at a repeated row either slot may win). Cases: random lists
    with repeats, -1 slots and empty tokens (B = 2, T not a multiple of the scan step, the
    last block partial), the same without repeats, and Pro cr4 causal lists at T = 16384."""
    import csa_jax
    from csa_jax import problems
    from csa_jax.common import sanitize_indices
    from csa_jax.kernels.gluon import dkv_blocks as d
    key = jax.random.PRNGKey(seed + 5)
    cases = []
    for name, repeats in (("random", True), ("norep", False)):
        key, k = jax.random.split(key)
        _, kv, idx, _ = random_case(k, 2, 1000, 1, 64, 3000, 300, jnp.bfloat16, False)
        idx = sanitize_indices(idx, kv.shape[1])
        cases.append((name, idx if repeats else drop_repeats(idx), 3000))
    cfg = csa_jax.preset("pro", 4)
    key, k = jax.random.split(key)
    N = cfg.num_kv(16384)
    idx = problems.make_indices(cfg, 16384, 1, "causal", k)
    cases.append(("pro-cr4-causal-T16384", sanitize_indices(idx, N), N))
    for name, idx, N in cases:
        row = dict(part="maps", case=name, shape=list(idx.shape))
        try:
            B, T, Kp = idx.shape
            NB = d.num_blocks(N)
            (posg, lists, cnt, _), dup = jax.jit(d.block_maps, static_argnums=1)(idx, N)
            rflag, rposg, rdup = d.maps_token_reference(idx.reshape(B * T, Kp), T, NB)
            rlists, rcnt = d.maps_block_reference(rflag, T)
            pair = d.flag_by_block(rflag, T) > 0
            clean = jnp.repeat((rdup.reshape(B, T) == 0)[:, None], NB, axis=1).reshape(B * NB, T)
            live = jnp.arange(T)[None, :] < rcnt[:, None]
            checks = dict(
                dup=bool(dup) == bool(jnp.any(rdup > 0)),
                cnt=bool(jnp.array_equal(cnt, rcnt)),
                lists=bool(jnp.all(jnp.where(live, lists == rlists, True))),
                posg=bool(jnp.all(jnp.where((pair & clean)[..., None], posg == rposg, True))))
        except Exception as e:  # noqa: BLE001
            report_failure(e, **row)
            continue
        report(**row, dup=bool(jnp.any(rdup > 0)), pairs=int(jnp.sum(rcnt)), checks=checks,
               ok=all(checks.values()))


# ----------------------------------------------------------------------------- timing


def part_time(seed, shapes):
    """Forward ms of xla, pallas_triton and gluon per shape; at cr0 also gluon under the cr0
    promise (the window kernel, as the NNX layer runs it: "gluon[cr0]")."""
    import csa_jax
    from csa_jax import problems
    from csa_jax.config import preset
    from csa_jax import registry
    for family, ratio, T in shapes:
        cfg = preset(family, ratio)
        pr = problems.make_problem(cfg, T, B=1, seed=seed,
                                   index_mode="random" if ratio == 4 else "causal")
        nominal, valid = pr.flops()
        outs = {}
        runs = ["xla", "pallas_triton", "gluon"] + (["gluon[cr0]"] if ratio == 0 else [])
        for name in runs:
            try:
                impl = name.split("[")[0]
                mod = registry.get(impl)
                if impl == "gluon":
                    promise = (csa_jax.Layout("cr0", window=cfg.window)
                               if name == "gluon[cr0]" else None)
                    c = gluon_config(pr.q, pr.kv, pr.idx, promise)
                else:
                    c = mod.default_config(pr.q.shape, pr.kv.shape, pr.idx.shape, pr.q.dtype)
                f = jax.jit(lambda q, kv, i, s, mod=mod, c=c: mod.forward(
                    q, kv, i, s, scale=cfg.scale, interpret=False, config=c))
                ms, _, _, outs[name] = time_fn(f, (pr.q, pr.kv, pr.idx, pr.sink), 20, 5.0)
                row = dict(part="time", family=family, ratio=ratio, T=T, impl=name, fwd_ms=ms,
                           tflops_nominal=nominal / ms / 1e9, tflops_valid=valid / ms / 1e9)
                if name != "xla":
                    row["err_o"] = rel(outs[name][0], outs["xla"][0])
                    row["ok"] = row["err_o"] <= 2e-2
                report(**row)
            except Exception as e:  # noqa: BLE001
                report_failure(e, 400, part="time", family=family, ratio=ratio, T=T, impl=name)
        del pr, outs


WINDOW_CASES = [  # name, layout, B, T, H, D, sink (window 128, pool ratio 128)
    ("cr0_w128_h64_t300_sink", "cr0", 1, 300, 64, 512, True),
    # several 16-token blocks per program (span reloads, barrier phases across blocks), two
    # head blocks, two sequences
    ("cr0_w128_h128_b2_t2500", "cr0", 2, 2500, 128, 512, False),
    # padded heads (40 -> 64) and D = 64: shapes the layer does not run, the op accepts (at
    # H <= 32 the few-heads forward runs instead: Config.runs_window_kernel)
    ("cr0_w128_h40_d64_t100_sink", "cr0", 1, 100, 40, 64, True),
    # cr128's promise: the gather kernel (no window kernel), the promise checked eagerly
    ("cr128_w128_h128_b2_t300", "cr128", 2, 300, 128, 512, False),
]


def part_window(seed, only=""):
    """only: comma-separated substrings of the case names to run (all if empty)."""
    import csa_jax
    from csa_jax.indices import build_indices
    key = jax.random.PRNGKey(seed + 3)
    w = 128
    for name, layout, B, T, H, D, sink in WINDOW_CASES:
        key, kq, kkv, ks, kp = jax.random.split(key, 5)
        if only and not any(o in name for o in only.split(",")):
            continue
        ratio = 0 if layout == "cr0" else 128
        idx = build_indices(T, ratio, window=w)
        idx = jnp.broadcast_to(idx, (B,) + idx.shape)
        kw_, kp_ = jax.random.split(kp)          # any order inside the window / the pool slots
        perm = jnp.concatenate([jax.random.permutation(kw_, w),
                                w + jax.random.permutation(kp_, idx.shape[-1] - w)])
        idx = idx[..., perm]
        N = T + (T // ratio if ratio else 0)
        q = jax.random.normal(kq, (B, T, H, D), jnp.bfloat16)
        kv = jax.random.normal(kkv, (B, N, D), jnp.bfloat16)
        s = jax.random.normal(ks, (H,), jnp.float32) if sink else None
        promise = csa_jax.Layout(layout, window=w, pool_ratio=128)
        try:
            check_forward("window:" + name, q, kv, idx, s, layout=promise)
            if layout == "cr0":
                _window_poison(name, q, kv, idx, s, promise)
        except Exception as e:  # noqa: BLE001
            report_failure(e, part="window", case=name)
    _violations_cost()


def _violations_cost():
    """ms of the traced promise check alone (csa_jax/layouts.py), part of every window forward
    under jit (timed by the run without --config overrides only)."""
    if OVERRIDES:
        return
    from csa_jax import layouts
    from csa_jax.indices import build_indices
    for T in (4096, 16384):
        idx = build_indices(T, 0)[None]
        f = jax.jit(lambda i: layouts.violations(i, "cr0", 128, 128))
        ms = time_fn(f, (idx,), 10, 1.0)[0]
        report(part="window", case=f"violations_ms:cr0:T{T}", ms=ms)


def _window_poison(name, q, kv, idx, sink, promise):
    """Under jit (traced idx) a token whose list breaks the promise gets NaN o and lse, the
    others the same bits as with the intact list (sparse_attention(layout=...), as the layer
    calls it)."""
    import csa_jax
    cfg = gluon_config(q, kv, idx, promise)
    if not cfg.runs_window_kernel(q.shape[2]):
        raise ValueError(f"{name}: {promise} does not run the window kernel ({cfg})")
    f = jax.jit(lambda q, kv, i, s: csa_jax.sparse_attention(q, kv, i, s, impl="gluon",
                                                             config=cfg, layout=promise))
    t = q.shape[1] - 1
    j = int(jnp.argmax(idx[0, t] >= 0))          # a slot of t's window (row t is in it)
    broken = idx.at[0, t, j].set(-1)
    o, lse = f(q, kv, idx, sink)
    ob, lb = f(q, kv, broken, sink)
    nan_ok = bool(jnp.isnan(ob[0, t]).all() and jnp.isnan(lb[0, t]).all())
    same = lambda a, b: bool(jnp.array_equal(a[0, :t], b[0, :t])
                             and jnp.array_equal(a[1:], b[1:]))     # every other token
    rest_ok = (same(ob, o) and same(lb, lse) and not bool(jnp.isnan(o).any())
               and not bool(jnp.isnan(lse).any()))
    report(part="window", case="poison:" + name, nan_ok=nan_ok, rest_ok=rest_ok,
           ok=nan_ok and rest_ok)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="random,golden,grad,maps,time,window")
    ap.add_argument("--golden-dir", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                         "golden"))
    ap.add_argument("--shapes", default="pro:4:4096,flash:4:4096,pro:0:4096")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--config", default="", help="gluon Config overrides: key=val,... (block_k, "
                    "stages, bwd, bwd_block_k, bwd_stages)")
    ap.add_argument("--cases", default="", help="random part: only these case names; window "
                    "part: case-name substrings (name,name)")
    args = ap.parse_args(argv)
    OVERRIDES.clear()            # (module state: a second main() in one process starts anew)
    CASES.clear()
    OVERRIDES.update(parse_overrides(args.config))     # ints, strings (bwd=pallas_triton)
    promise = sorted({"layout", "window", "pool_ratio"} & set(OVERRIDES))
    if promise:
        ap.error(f"--config {', '.join(promise)}: the layout promise is the window part's "
                 f"(sparse_attention(layout=...)), not an override")
    try:
        from csa_jax.kernels.gluon.config import Config
        apply_overrides(None, Config(), None, OVERRIDES)
    except (TypeError, ValueError) as e:
        ap.error(f"--config {args.config!r}: {e}")
    CASES.update(filter(None, args.cases.split(",")))
    parts = args.parts.split(",")
    print(f"# device {jax.devices()[0].device_kind}, jax {jax.__version__}, seed {args.seed}, "
          f"gluon config overrides {OVERRIDES}", flush=True)
    def golden():
        if os.path.isdir(args.golden_dir):
            part_golden(args.golden_dir)
        else:
            report(part="golden", ok=False, error=f"no golden dir {args.golden_dir}")

    return run_parts(parts, {
        "random": lambda: part_random(args.seed),
        "golden": golden,
        "grad": lambda: part_grad(args.seed),
        "maps": lambda: part_maps(args.seed),
        "time": lambda: part_time(args.seed, parse_shapes(args.shapes)),
        "window": lambda: part_window(args.seed, args.cases),
    }, seed=args.seed, out=args.out)


def parse_shapes(spec):
    """'pro:4:4096,flash:0:8192' -> [(family, ratio, T), ...]."""
    return [(f, int(r), int(t)) for f, r, t in (s.split(":") for s in spec.split(","))]


def run_parts(parts, handlers, *, seed, out):
    """Run each named part (a failure is reported as a failed check, and the next part still
    runs), rewrite the JSON after each, print the tally; exit code 1 if any check of this run
    failed."""
    start = len(RESULTS)
    for part in parts:
        try:
            if part not in handlers:
                raise ValueError(f"unknown part {part!r}")
            handlers[part]()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=6)
            report(part=part, ok=False, error=f"{type(e).__name__}: {e}"[:500])
        if out:
            with open(out, "w") as f:
                json.dump(dict(seed=seed, results=RESULTS[start:]), f, indent=1)
    rows = RESULTS[start:]
    bad = [r for r in rows if r.get("ok") is False]
    print(f"# {len(rows)} checks, {len(bad)} failed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
