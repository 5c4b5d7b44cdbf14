"""Compile-time resources of the Gluon kernels for every target, on a plain CPU (no GPU needed).

    python -m benchmarks.gluon_resources [--targets sm_90a,gfx942,gfx950,gfx1250]
        [--variants 'name:key=val,...;...'] [--out resources.json]

Compiles the CSA forward (V4 shape: D = 512, K = 1152, two head blocks) at the default Config and
each variant, and the ring-gather probe, with triton.compile for each target; prints warps,
shared memory (metadata["shared"]) against the target's limit, and for sm_90a registers and
spills from the bundled `ptxas -v` (AMD: VGPRs, spills, scratch, occupancy from the .amdgcn
metadata). A kernel the target's compiler refuses shows the first line of its error. Exits 1 if a
default-config kernel spills or exceeds shared memory on a target where it compiles.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from benchmarks.common import parse_variants


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


def kernels(variants):
    import dataclasses
    from csa_jax.kernels import gluon as impl
    from csa_jax.kernels.gluon import fwd
    from csa_jax.kernels.gluon.probe import ring_gather_kernel
    base = impl.default_config((1, 4096, 128, 512), (1, 5120, 512), (1, 4096, 1152), "bfloat16")
    for name, over in variants:
        cfg = dataclasses.replace(base, **over)
        consts = fwd.constexprs(T=4096, N=5120, NHB=2, D=512, K=1152, BK=cfg.block_k,
                                stages=cfg.stages, scale=512 ** -0.5,
                                producer_regs=cfg.producer_regs, pipeline=cfg.pipeline,
                                smem_epilogue=cfg.smem_epilogue, prefetch=cfg.prefetch,
                                ablate=cfg.ablate)
        yield (f"csa_fwd[{name}]", name == "default", fwd.csa_fwd_kernel, fwd.arg_types(),
               consts, fwd.CONSUMER_WARPS)
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
        yield (f"csa_window[{layout}]", False, window.csa_window_kernel, window.arg_types(),
               consts, window.CONSUMER_WARPS)
    yield ("ring_gather_probe", False, ring_gather_kernel, ["*bf16", "*i32", "*bf16"],
           dict(NT=4, BK=16, D=512, STAGES=2), 4)


def main(argv=None):
    from csa_jax.kernels.gluon import adapter
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="sm_90a,gfx942,gfx950,gfx1250")
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    why = adapter.missing()
    if why:
        print(f"skipped: {why}")
        return 0
    rows, bad = [], []
    for name, is_default, fn, types, consts, warps in kernels(parse_variants(args.variants)):
        for target in args.targets.split(","):
            row = dict(kernel=name, target=target)
            diag = os.path.join(tempfile.gettempdir(), f"gluon_resources_{os.getpid()}.log")
            try:
                with _stderr_to(diag):
                    c = adapter.compile_kernel(fn, types, consts, target=target, num_warps=warps)
                r = adapter.resources(c, target)
                r.pop("ptxas", None)
                row.update(r)
                over = r["shared"] > r.get("shared_limit", r["shared"])
                spills = r.get("spill_stores", 0) or r.get("vgpr_spill", 0)
                if is_default and (over or spills):
                    bad.append(row)
            except Exception as e:  # noqa: BLE001
                with open(diag) as f:
                    row["error"] = _error_line(e, f.read())
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| kernel | target | warps | shared B (limit) | regs | spills (st/ld B) | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['target']} | - | - | - | - | does not compile: "
                  f"{r['error'][:110]} |")
            continue
        regs = r.get("registers", r.get("vgpr", "-"))
        sp = (f"{r.get('spill_stores', '-')}/{r.get('spill_loads', '-')}" if "registers" in r
              else str(r.get("vgpr_spill", "-")))
        print(f"| {r['kernel']} | {r['target']} | {r['num_warps']} | {r['shared']} "
              f"({r.get('shared_limit', '-')}) | {regs} | {sp} | {r['launch_problem'] or ''} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if bad:
        print(f"FAIL: default-config kernels over shared memory or spilling: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
