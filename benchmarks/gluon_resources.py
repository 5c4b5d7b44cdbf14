"""Compile-time resources of every GPU kernel of the project for every target, on a plain CPU.

    python -m benchmarks.gluon_resources [--targets sm_90a,gfx942,gfx950,gfx1250]
        [--kernels gluon_nv,gluon_amd,triton] [--variants 'name:key=val,...;...']
        [--out resources.json]

Kernels (V4 shape: D = 512, K = 1152 slots, H = 128 = two 64-head blocks), each at its default
config for the target:
- gluon_nv: the NVIDIA Gluon forward (fwd.py; plus --variants of its Config), the dq kernel
  (bwd.py), the ring-gather probe; compiled for every target (the AMD targets refuse them:
  NVIDIA-only ops; the row says which op);
- gluon_amd: the AMD Gluon forward (amd_fwd.py) and dq kernel (amd_bwd.py) at
  dims.AMD_DEFAULTS / AMD_DQ_DEFAULTS on their three targets, and each with its
  transposed-operand switch (trans=1, issue 14) as a non-default row, and gfx1250's forward
  with kv rows by per-row TDM loads (tdm_rows, non-default);
- triton: the pallas_triton kernels (forward, dq, dkv reduce) lowered by Pallas for the target's
  platform with the impl's default config for that device kind, compiled by
  benchmarks/triton_compile.py.
Printed: warps, shared memory / LDS (metadata["shared"]) against the target's limit, sm_90a
registers and spills from the bundled `ptxas -v`, AMD VGPRs (arch + AGPR), spilled VGPRs and
occupancy (waves per SIMD) from the .amdgcn metadata. A kernel the target's compiler refuses
shows the first line of its error.

Exit 1 (the CI check, tests/test_gpu_resources.py) when a default-config kernel spills beyond
KNOWN_SPILLS or exceeds the target's shared memory / LDS, or when an AMD Gluon or
Triton-dialect kernel stops compiling for a target it is built for.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from benchmarks.common import parse_variants

ALL_TARGETS = ("sm_90a", "gfx942", "gfx950", "gfx1250")
# Spills a default config is known to have, with why it stays the default (bytes on sm_90a,
# VGPRs on AMD); any other spill of a default fails the check.
KNOWN_SPILLS = {
    # 40 B spill stores at 255 registers: the measured-fastest dq config on the H200
    # (docs/perf/triton_h200.md table 4); a compile-only report does not overrule a timing.
    ("csa_triton_dq", "sm_90a"): 40,
}
# Triton-dialect targets its defaults are meant for: gfx1250 (wave32) is reported, not
# checked: pallas_triton's AMD defaults are tuned for wave64 CDNA (docs/perf/gpu_resources.md).
TRITON_CHECKED = ("sm_90a", "gfx942", "gfx950")


@contextlib.contextmanager
def _stderr_to(path):
    """Redirect file descriptor 2 (where MLIR prints its diagnostics) into a file."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _error_line(e, diag=""):
    """The compiler's first `error:` message, without its source path."""
    for ln in (diag + "\n" + str(e)).splitlines():
        if "error:" in ln and "Failures have been detected" not in ln:
            return ln.split("error:", 1)[1].strip()[:200]
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]


def _gluon(fn, types, consts, warps):
    """A compile step for a Gluon kernel: target -> resources dict."""
    from csa_jax.kernels.gluon import adapter

    def run(target):
        r = adapter.resources(adapter.compile_kernel(fn, types, consts, target=target,
                                                     num_warps=warps), target)
        r.pop("ptxas", None)
        return r
    return run


def gluon_nv_kernels(variants):
    """(name, is_default, targets (None = all), compile step) of the NVIDIA Gluon kernels."""
    import dataclasses
    from csa_jax.kernels import gluon as impl
    from csa_jax.kernels.gluon import bwd, fwd
    from csa_jax.kernels.gluon.probe import ring_gather_kernel
    base = impl.default_config((1, 4096, 128, 512), (1, 5120, 512), (1, 4096, 1152), "bfloat16")
    for name, over in variants:
        cfg = dataclasses.replace(base, **over)
        dims = dict(T=4096, N=5120, NHB=2, D=512, K=1152, BK=cfg.block_k, stages=cfg.stages,
                    scale=512 ** -0.5, prefetch=cfg.prefetch)
        if cfg.resolved_schedule == "alternate":
            from csa_jax.kernels.gluon import fwd_alt
            yield (f"csa_fwd[{name}]", name == "default", None,
                   _gluon(fwd_alt.csa_fwd_alt_kernel, fwd.arg_types(),
                          fwd_alt.config_constexprs(cfg, **dims), fwd_alt.NUM_WARPS))
            continue
        consts = fwd.constexprs(**dims, producer_regs=cfg.producer_regs, pipeline=cfg.pipeline,
                                smem_epilogue=cfg.smem_epilogue, ablate=cfg.ablate)
        yield (f"csa_fwd[{name}]", name == "default", None,
               _gluon(fwd.csa_fwd_kernel, fwd.arg_types(), consts, fwd.CONSUMER_WARPS))
    # the dq kernel at the default Config and with the other value of Config.bwd_pair
    for pair in (base.bwd_pair, not base.bwd_pair):
        consts = bwd.constexprs(T=4096, N=5120, NHB=2, D=512, K=1152, BK=base.bwd_block_k,
                                stages=base.bwd_stages, scale=512 ** -0.5,
                                producer_regs=base.producer_regs, prefetch=base.bwd_prefetch,
                                qdo=base.bwd_qdo, dq_operand=base.bwd_dq_operand, pair=pair,
                                fuse_delta=base.bwd_fuse_delta)
        yield ("csa_dq[default]" if pair == base.bwd_pair else f"csa_dq[bwd_pair={pair}]",
               pair == base.bwd_pair, None,
               _gluon(bwd.csa_dq_kernel, bwd.arg_types(), consts, bwd.CONSUMER_WARPS))
    # the alternating dq kernel (Config.bwd_schedule="alternate"; reported, not the default)
    from csa_jax.kernels.gluon import bwd_alt
    consts = bwd_alt.constexprs(T=4096, N=5120, NHB=2, D=512, K=1152, BK=32, stages=2,
                                scale=512 ** -0.5, consumer_regs=base.bwd_alt_regs,
                                qdo=base.bwd_qdo, fuse_delta=base.bwd_fuse_delta)
    yield ("csa_dq[bwd_schedule=alternate]", False, None,
           _gluon(bwd_alt.csa_dq_alt_kernel, bwd.arg_types(), consts, bwd_alt.NUM_WARPS))
    # bwd_pipe's blocked kernel with bwd_scores_ahead, 3 stages (reported, not the default;
    # bwd_pipeline alone and the blocked kernel without it: tests/test_gluon_bwd.py)
    from csa_jax.kernels.gluon import bwd_pipe
    consts = bwd.constexprs(T=4096, N=5120, NHB=2, D=512, K=1152, BK=32, stages=3,
                            scale=512 ** -0.5, producer_regs=40, qdo=base.bwd_qdo, pair=True,
                            fuse_delta=base.bwd_fuse_delta, pipeline=True, qdo_regs=1,
                            scores_ahead=True)
    yield ("csa_dq[bwd_scores_ahead]", False, None,
           _gluon(bwd_pipe.csa_dq_blk_kernel, bwd.arg_types(), consts, bwd.CONSUMER_WARPS))
    from csa_jax.kernels.gluon import window
    for layout, ratio in (("cr0", 0), ("cr128", 128)):
        # the window-reuse kernel at Pro T = 4096 (reported, not gating: a few loop scalars
        # spill; docs/perf/gluon_h200.md, window reuse)
        cfg = dataclasses.replace(base, layout=layout)
        consts = window.constexprs(T=4096, N=4096 + (4096 // ratio if ratio else 0), NHB=2, D=512,
                                   window=cfg.window, G=window.programs(1, 4096, 2),
                                   ratio=ratio, pool_tile=cfg.pool_tile,
                                   pool_stages=cfg.pool_stages, scale=512 ** -0.5,
                                   producer_regs=cfg.win_producer_regs, p_smem=cfg.win_p_smem)
        yield (f"csa_window[{layout}]", False, None,
               _gluon(window.csa_window_kernel, window.arg_types(), consts,
                      window.CONSUMER_WARPS))
    from csa_jax.kernels.gluon import window_xchg
    # cr0's exchange schedule (win_schedule="exchange"): gating, 0 spills
    consts = window_xchg.constexprs(T=4096, N=4096, NHB=2, D=512, window=base.window,
                                    G=window.programs(1, 4096, 2), scale=512 ** -0.5,
                                    consumer_regs=base.win_regs)
    yield ("csa_window[cr0,exchange]", True, None,
           _gluon(window_xchg.csa_window_xchg_kernel, window.arg_types(), consts,
                  window_xchg.NUM_WARPS))
    # the overlap variant (win_schedule="overlap", reported, not gating: 4 B spill)
    yield ("csa_window[cr0,overlap]", False, None,
           _gluon(window_xchg.csa_window_xchg_kernel, window.arg_types(),
                  {**consts, "OVERLAP": True, "CONSUMER_REGS": 224}, window_xchg.NUM_WARPS))
    # the cr0 window dq kernel (Config.bwd_win, opt-in): gating, 0 spills
    from csa_jax.kernels.gluon import bwd_win
    consts = bwd_win.constexprs(T=4096, N=4096, NH2=4, D=512, window=base.window,
                                G=window.programs(1, 4096, 4), scale=512 ** -0.5,
                                producer_regs=base.bwd_win_producer_regs, qdo=base.bwd_qdo,
                                fuse_delta=base.bwd_fuse_delta)
    yield ("csa_dq[bwd_win,cr0]", True, None,
           _gluon(bwd_win.csa_dq_win_kernel, bwd_win.arg_types(), consts,
                  bwd_win.CONSUMER_WARPS))
    yield ("ring_gather_probe", False, None,
           _gluon(ring_gather_kernel, ["*bf16", "*i32", "*bf16"],
                  dict(NT=4, BK=16, D=512, STAGES=2), 4))


def gluon_amd_kernels():
    """The AMD forward and dq kernels at their per-target defaults, and each with trans=1."""
    from csa_jax.kernels.gluon import amd_bwd, amd_fwd
    shape = dict(T=4096, N=5120, NHB=2, D=512, K=1152, scale=512 ** -0.5)
    for trans in (0, 1):
        tag = "default" if trans == 0 else "trans=1"
        for target, d in amd_fwd.TARGET_DEFAULTS.items():
            consts = amd_fwd.constexprs(target=target, BK=d["block_k"], stages=d["stages"],
                                        trans=trans, **shape)
            yield (f"csa_fwd_amd[{tag}]", trans == 0, (target,),
                   _gluon(amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(), consts, d["warps"]))
        if trans == 0:        # gfx1250's kv rows by per-row TDM loads (32 rows x 2 stages)
            consts = amd_fwd.constexprs(target="gfx1250", BK=32, stages=2, tdm_rows=True,
                                        **shape)
            yield ("csa_fwd_amd[tdm_rows]", False, ("gfx1250",),
                   _gluon(amd_fwd.csa_fwd_amd_kernel, amd_fwd.arg_types(), consts, 8))
        for target, d in amd_bwd.DQ_DEFAULTS.items():
            consts = amd_bwd.constexprs(target=target, BK=d["block_k"], stages=d["stages"],
                                        qdo=d["qdo"], trans=trans, **shape)
            yield (f"csa_dq_amd[{tag}]", trans == 0, (target,),
                   _gluon(amd_bwd.csa_dq_amd_kernel, amd_bwd.arg_types(), consts, d["warps"]))


def triton_kernels(targets):
    """pallas_triton's kernels, lowered once per target (the lowering is per platform/kind)."""
    from benchmarks import triton_compile as tcm
    from csa_jax.kernels.gluon import adapter
    for target in targets:
        lowered = tcm.lowered_kernels(target, tcm.default_config(target))
        for name, (text, nw, ns) in lowered.items():
            def run(t, text=text, nw=nw, ns=ns, name=name):
                md, asm = tcm.compile_ttir(text, t, nw, ns)
                r = adapter.asm_resources(asm, t, name=name, num_warps=nw, shared=md["shared"],
                                          launch_problem=None)
                r.pop("ptxas", None)
                return r
            yield (name, True, (target,), run)


def occupancy(r):
    """AMD: waves per SIMD (.amdgcn); sm_90a: CTAs per SM from registers and shared memory
    (65,536 registers and 233,472 B of shared memory per SM, warp-granular registers)."""
    if "occupancy" in r:
        return r["occupancy"]
    if "registers" in r:
        threads = 32 * r["num_warps"]
        by_regs = 65536 // max(1, r["registers"] * threads)
        by_smem = 233_472 // max(1, r["shared"])
        return min(by_regs, by_smem)
    return None


def check(row, is_default, must_compile):
    """Why this row fails the CI check (None = it passes)."""
    if "error" in row:
        return f"does not compile: {row['error']}" if must_compile else None
    if not is_default:
        return None
    if row["shared"] > row.get("shared_limit", row["shared"]):
        return f"{row['shared']} B shared > {row['shared_limit']}"
    spills = row.get("spill_stores", 0) or row.get("vgpr_spill", 0)
    allowed = KNOWN_SPILLS.get((row["name"], row["target"]), 0)
    if spills > allowed:
        return f"spills {spills} (allowed {allowed})"
    return None


def main(argv=None):
    from csa_jax.kernels.gluon import adapter
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(ALL_TARGETS))
    ap.add_argument("--kernels", default="gluon_nv,gluon_amd,triton")
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    why = adapter.missing()
    if why:
        print(f"skipped: {why}")
        return 0
    targets = args.targets.split(",")
    families = args.kernels.split(",")
    jobs = []
    if "gluon_nv" in families:
        jobs += [(k, "gluon_nv") for k in gluon_nv_kernels(parse_variants(args.variants))]
    if "gluon_amd" in families:
        jobs += [(k, "gluon_amd") for k in gluon_amd_kernels()]
    if "triton" in families:
        jobs += [(k, "triton") for k in triton_kernels(targets)]
    rows, bad = [], []
    diag = os.path.join(tempfile.gettempdir(), f"gluon_resources_{os.getpid()}.log")
    for (name, is_default, only, run), family in jobs:
        for target in (t for t in targets if only is None or t in only):
            row = dict(kernel=name, family=family, target=target)
            try:
                with _stderr_to(diag):
                    row.update(run(target))
                row["occupancy"] = occupancy(row)
            except Exception as e:  # noqa: BLE001
                with open(diag) as f:
                    row["error"] = _error_line(e, f.read())
            must = (family == "gluon_amd" or (family == "triton" and target in TRITON_CHECKED)
                    or (family == "gluon_nv" and target == "sm_90a" and is_default))
            why = check(row, is_default, must) if (family != "triton"
                                                   or target in TRITON_CHECKED) else None
            if why:
                bad.append(f"{name} on {target}: {why}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if bad:
        print("FAIL: " + "; ".join(bad))
        return 1
    return 0


def print_table(rows):
    print("\n| kernel | target | warps | shared / LDS B (limit) | regs / VGPRs | spills | "
          "occupancy | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['target']} | - | - | - | - | - | does not compile: "
                  f"{r['error'][:110]} |")
            continue
        regs = r.get("registers", r.get("vgpr", "-"))
        sp = (f"{r.get('spill_stores', '-')}/{r.get('spill_loads', '-')} B" if "registers" in r
              else f"{r.get('vgpr_spill', '-')} VGPRs")
        occ = r.get("occupancy")
        occ = "-" if occ is None else (f"{occ} waves/SIMD" if "vgpr" in r else f"{occ} CTA/SM")
        print(f"| {r['kernel']} | {r['target']} | {r['num_warps']} | {r['shared']:,} "
              f"({r.get('shared_limit', 0):,}) | {regs} | {sp} | {occ} | "
              f"{r.get('launch_problem') or ''} |")


if __name__ == "__main__":
    sys.exit(main())
