"""Issue 14's transposed-operand tables from `bench_csa --check default` JSON files.

    python -m benchmarks.xpose_table RUN.json [RUN2.json ...]

Each input is a `bench_csa --impls gluon --modes fwd,bwd,step --check default --variants
'lt:bwd_dq_operand=ldsm_trans;mm:...'` output: a default row and variant rows per config, each
variant with `rel_err_vs_default`. Prints (markdown) one row per config and mode with fwd / bwd /
step ms, the largest error against the default, and default-over-mode ratios; then the geometric
means over the configs where every mode was timed, of the default over each mode and of the
transpose-load (`lt`) over the register transpose (`mm`) and the strided reads (`st`), the
paper's Table 10 / 11 comparison. A config measured in more than one file keeps the last file's
rows. Rows of other variant names are listed and checked too, not averaged. Exit status 1 when
a variant's outputs differ from the default's by more than --tol, or a row has no time (it
failed to build or run).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

MODES = {"default": "desc (default)", "da": "desc_a", "lt": "ldsm_trans", "mm": "movmatrix (a)",
         "st": "strided (b)"}


def load(paths, failed=None):
    """{config name: {variant: row}}, in first-seen config order; a later file's config replaces.
    Rows without a step time (a variant that failed to build or run) are left out of the table
    and, with `failed` a list, appended to it as (config, variant, error)."""
    table = {}
    for p in paths:
        with open(p) as f:
            rows = json.load(f)["rows"]
        seen = {}
        for r in rows:
            name = f"{r['family']}-cr{r['ratio']}-T{r['T']}"
            if not all(r.get(f"{k}_ms") for k in ("fwd", "bwd", "step")):
                if failed is not None:
                    failed.append((name, r.get("variant"), r.get("error", "no fwd / bwd / step time")))
                continue
            seen.setdefault(name, {})[r["variant"]] = r
        for name, by_variant in seen.items():
            table.pop(name, None)
            table[name] = by_variant
    return table


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(table, modes=("da", "lt", "mm", "st")):
    """Geomeans over the configs with every mode timed: default / mode (bwd, step) and lt / mm, lt / st."""
    full = [c for c, v in table.items() if all(m in v for m in ("default",) + tuple(modes))]
    out = {"configs": full}
    for m in modes:
        for k in ("bwd", "step"):
            out[f"default_over_{m}_{k}"] = geomean(
                [table[c][m][f"{k}_ms"] / table[c]["default"][f"{k}_ms"] for c in full])
    for other in ("mm", "st"):
        if "lt" in modes and other in modes:
            out[f"lt_over_{other}_step"] = geomean(
                [table[c][other]["step_ms"] / table[c]["lt"]["step_ms"] for c in full])
    return out


def max_err(row):
    errs = row.get("rel_err_vs_default") or {}
    return max(errs.values()) if errs else None


def render(table, tol):
    lines = ["| config | mode | fwd ms | bwd ms | step ms | max err vs default | bwd: default / mode | step: default / mode |",
             "|---|---|---|---|---|---|---|---|"]
    bad = []
    for c, by_variant in table.items():
        base = by_variant.get("default")
        for v in [m for m in MODES if m in by_variant] + [m for m in by_variant if m not in MODES]:
            r = by_variant[v]
            e = max_err(r)
            if v != "default" and (e is None or not e <= tol):
                bad.append((c, v, e))
            ratio = (lambda k: f"{r[k + '_ms'] / base[k + '_ms']:.3f}") if base else (lambda k: "-")
            lines.append(f"| {c} | {MODES.get(v, v)} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['step_ms']:.2f} | "
                         f"{'-' if v == 'default' else e} | {ratio('bwd')} | {ratio('step')} |")
    groups = {"all": table, **{f"cr{r}": {c: v for c, v in table.items() if f"-cr{r}-" in c} for r in (4, 0, 128)}}
    sums = {g: summarize(t) for g, t in groups.items() if t}
    lines += ["", "Geometric means of default / mode (> 1: the default faster) and of ldsm_trans over (a) / (b), "
              "over the configs with every mode timed:", "",
              "| configs | n | " + " | ".join(f"{MODES[m]} bwd / step" for m in ("da", "lt", "mm", "st"))
              + " | ldsm_trans over (a), step | over (b), step |",
              "|---|---|" + "---|" * 6]
    for g, s in sums.items():
        lines.append(f"| {g} | {len(s['configs'])} | " + " | ".join(
            f"{s[f'default_over_{m}_bwd']:.3f} / {s[f'default_over_{m}_step']:.3f}" for m in ("da", "lt", "mm", "st"))
            + f" | {s['lt_over_mm_step']:.3f} | {s['lt_over_st_step']:.3f} |")
    # The forward has no operand switch: its rows are one kernel timed once per mode, so their spread is the noise.
    spread = {c: max(r["fwd_ms"] for r in v.values()) / min(r["fwd_ms"] for r in v.values()) for c, v in table.items()}
    lines += ["", "Forward spread max / min over the modes (one kernel in every mode: the run-to-run noise of that config's run): "
              + ", ".join(f"{c} {x:.3f}" for c, x in spread.items())]
    return "\n".join(lines), bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("files", nargs="+", help="bench_csa --out JSON files")
    ap.add_argument("--tol", type=float, default=0.0,
                    help="largest error a variant may have against the default (default 0: bit-equal)")
    args = ap.parse_args(argv)
    failed = []
    text, bad = render(load(args.files, failed), args.tol)
    print(text)
    for c, v, e in bad:
        print(f"# FAIL {c} {v}: max error vs default {e} > {args.tol}", file=sys.stderr)
    for c, v, e in failed:
        print(f"# FAIL {c} {v}: not timed: {str(e)[:200]}", file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
