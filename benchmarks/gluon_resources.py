"""Compile-time resources of every GPU kernel of the project for every target, on a plain CPU.

    python -m benchmarks.gluon_resources [--targets sm_90a,gfx942,gfx950,gfx1250]
        [--kernels gluon_nv,gluon_amd,triton] [--variants 'name:key=val,...;...']
        [--out resources.json]

Kernels (V4 Pro shape: D = 512, K = 1152 slots, H = 128 = two 64-head blocks, T = 4096), each at
its default config for its target, on the targets it is built for:
- gluon_nv (sm_90a): the NVIDIA Gluon forward (fwd.py) and dq kernel (bwd.py) at
  gluon.default_config, plus a row per --variants entry (gluon Config fields: block_k, stages
  for the forward, bwd_block_k, bwd_stages for the dq kernel) that changes that kernel's
  tiles; the Gluon dkv reduce (dkv.py); the few-heads forward (small_heads.py) at 16 and 32
  heads, and the few-heads dq kernel (small_heads_dq.py) likewise; the cr0 window kernel
  (window.py) at Pro and at Flash (H = 64: one head block);
- gluon_amd (gfx942, gfx950, gfx1250): the AMD Gluon forward (amd_fwd.py) and dq kernel
  (amd_bwd.py) at dims.AMD_DEFAULTS / AMD_DQ_DEFAULTS on their three targets, and each with its
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
KNOWN_SPILLS or exceeds the target's shared memory / LDS, or when a default NVIDIA Gluon
kernel, an AMD Gluon kernel or a Triton-dialect kernel stops compiling for a target it is
built for.
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
# Spills a default config is known to have, by row (kernel) name and target, with why it stays
# the default (bytes on sm_90a, VGPRs on AMD); any other spill of a default fails the check.
KNOWN_SPILLS = {
    # 40 B spill stores at 255 registers: the measured-fastest dq config on the H200
    # (docs/perf/triton_h200.md table 4); a compile-only report does not overrule a timing.
    ("csa_triton_dq", "sm_90a"): 40,
    # 100 B at Flash cr0 T = 4096 (H = 64: G = 132 programs per head block; Pro's G = 66 spills
    # none), CPU compile at d23a12a (2026-12-02), the same as 14a1614's window_xchg kernel,
    # the code timed faster than the gather kernel at Flash cr0 T = 4096
    # (docs/perf/gluon_window_h200.md).
    ("csa_window[cr0,flash]", "sm_90a"): 100,
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
    """A compile step for a Gluon kernel: target -> resources dict. consts: the constexprs, or
    a function returning them (evaluated in the step: a refused value is that row's error)."""
    from csa_jax.kernels.gluon import adapter

    def run(target):
        c = consts() if callable(consts) else consts
        r = adapter.resources(adapter.compile_kernel(fn, types, c, target=target,
                                                     num_warps=warps), target)
        r.pop("ptxas", None)
        return r
    return run


# The V4 Pro shape of the report (D = 512, K = 1152 slots, H = 128 = two 64-head blocks, T = 4096,
# N = T + T / 4 rows); Flash (H = 64: one head block) where a kernel's code depends on it.
PRO = dict(T=4096, N=5120, NHB=2, D=512, K=1152, scale=512 ** -0.5)


def impl_default(H):
    """gluon's default Config at the report's Pro shape with H heads."""
    from csa_jax.kernels import gluon as impl
    return impl.default_config((1, PRO["T"], H, PRO["D"]), (1, PRO["N"], PRO["D"]),
                               (1, PRO["T"], PRO["K"]), "bfloat16")


def nv_configs(variants):
    """[(name, gluon Config)] of --variants on top of the default at the report's shape
    (ValueError naming a field the Config lacks or a value it refuses)."""
    from benchmarks.common import apply_overrides
    from csa_jax.kernels import gluon as impl
    base = impl_default(128)
    out = []
    for name, over in variants:
        try:
            out.append((name, apply_overrides(impl, base, None, over)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"--variants {name}: {e}") from None
    return out


def gluon_nv_kernels(configs):
    """(name, is_default, targets, compile step) of the NVIDIA Gluon kernels, for sm_90a (the
    one target they are built for): the forward (fwd.py) and the dq kernel (bwd.py) at each of
    `configs` (nv_configs; a variant's row only where it changes that kernel's tiles), the dkv
    reduce (dkv.py, reduce_rows' defaults), the few-heads forward (small_heads.py), dq
    kernel (small_heads_dq.py) and row-block dkv (dkv_blocks.py) at 16 and 32 heads, and the
    cr0 window kernel (window.py) at Pro and Flash."""
    from csa_jax.kernels.gluon import bwd, dkv, fwd, ring, window
    sm90 = ("sm_90a",)
    base = configs[0][1]
    for name, cfg in configs:
        if name == "default" or (cfg.block_k, cfg.stages) != (base.block_k, base.stages):
            yield (f"csa_fwd[{name}]", name == "default", sm90,
                   _gluon(fwd.csa_fwd_kernel, ring.arg_types(),
                          lambda cfg=cfg: fwd.constexprs(BK=cfg.block_k, stages=cfg.stages,
                                                         **PRO), fwd.NUM_WARPS))
        if name == "default" or ((cfg.bwd_block_k, cfg.bwd_stages)
                                 != (base.bwd_block_k, base.bwd_stages)):
            yield (f"csa_dq[{name}]", name == "default", sm90,
                   _gluon(bwd.csa_dq_kernel, bwd.arg_types(),
                          lambda cfg=cfg: bwd.constexprs(BK=cfg.bwd_block_k,
                                                         stages=cfg.bwd_stages, **PRO),
                          ring.CONSUMER_WARPS))
    # the reduce over the Pro problem's T * K slot rows (K padded to the dq kernel's tile: 1152)
    yield ("csa_dkv_reduce[default]", True, sm90,
           _gluon(dkv.csa_dkv_reduce_kernel, dkv.arg_types(),
                  lambda: dkv.constexprs(N=PRO["N"], E=PRO["T"] * PRO["K"], D=PRO["D"], R=16),
                  4))
    # the few-heads forward (small_heads.py) at its default rings for 16 and 32 heads
    from csa_jax.kernels.gluon import small_heads
    for hn in (16, 32):
        cfg = impl_default(hn)
        yield (f"csa_fwd_small_heads[h{hn}]", True, sm90,
               _gluon(small_heads.csa_fwd_small_heads_kernel, ring.arg_types(),
                      lambda hn=hn, cfg=cfg: small_heads.constexprs(
                          T=PRO["T"], N=PRO["N"], HN=hn, D=PRO["D"], K=PRO["K"], BK=cfg.block_k,
                          stages=cfg.stages, scale=PRO["scale"], consumers=cfg.fwd_consumers),
                      small_heads.NUM_WARPS))
    # the few-heads dq kernel (small_heads_dq.py) at its default rings for 16 and 32 heads
    from csa_jax.kernels.gluon import small_heads_dq
    for hn in (16, 32):
        cfg = impl_default(hn)
        yield (f"csa_dq_small_heads[h{hn}]", True, sm90,
               _gluon(small_heads_dq.csa_dq_small_heads_kernel, small_heads_dq.arg_types(),
                      lambda hn=hn, cfg=cfg: small_heads_dq.constexprs(
                          T=PRO["T"], N=PRO["N"], HN=hn, D=PRO["D"], K=PRO["K"],
                          stages=cfg.bwd_stages, scale=PRO["scale"]),
                      small_heads_dq.NUM_WARPS))
    # the few-heads backward's dkv by kv row blocks (dkv_blocks.py) at 16 and 32 heads, and
    # its two maps kernels
    from csa_jax.kernels.gluon import dkv_blocks
    for hn in (16, 32):
        yield (f"csa_dkv_blocks[h{hn}]", True, sm90,
               _gluon(dkv_blocks.csa_dkv_blocks_kernel, dkv_blocks.arg_types(),
                      lambda hn=hn: dkv_blocks.constexprs(
                          T=PRO["T"], NB=dkv_blocks.num_blocks(PRO["N"]), B=1, H=hn,
                          Kp=PRO["K"], DP=PRO["D"]),
                      dkv_blocks.NUM_WARPS))
    yield ("csa_dkv_maps_token", True, sm90,
           _gluon(dkv_blocks.csa_dkv_maps_token_kernel, list(dkv_blocks.MAPS_TOKEN_ARG_TYPES),
                  lambda: dkv_blocks.maps_token_constexprs(
                      T=PRO["T"], Kp=PRO["K"], NB=dkv_blocks.num_blocks(PRO["N"])),
                  dkv_blocks.MAPS_WARPS.value))
    yield ("csa_dkv_maps_block", True, sm90,
           _gluon(dkv_blocks.csa_dkv_maps_block_kernel, list(dkv_blocks.MAPS_BLOCK_ARG_TYPES),
                  lambda: dkv_blocks.maps_block_constexprs(
                      T=PRO["T"], NB=dkv_blocks.num_blocks(PRO["N"])),
                  dkv_blocks.MAPS_WARPS.value))
    # the cr0 window kernel (window 128; N = T: cr0 has no pool rows) at Pro (two head blocks)
    # and Flash (one: G, the programs per head block, doubles, and the code changes)
    for tag, nhb in (("cr0", 2), ("cr0,flash", 1)):
        T = PRO["T"]
        yield (f"csa_window[{tag}]", True, sm90,
               _gluon(window.csa_window_kernel, window.arg_types(),
                      lambda nhb=nhb, T=T: window.constexprs(
                          T=T, N=T, NHB=nhb, D=PRO["D"], window=128,
                          G=window.programs(1, T, nhb), scale=PRO["scale"]),
                      window.NUM_WARPS))


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
    allowed = KNOWN_SPILLS.get((row.get("kernel", row["name"]), row["target"]), 0)
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
        try:
            configs = nv_configs(parse_variants(args.variants))
        except ValueError as e:
            ap.error(str(e))
        jobs += [(k, "gluon_nv") for k in gluon_nv_kernels(configs)]
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
