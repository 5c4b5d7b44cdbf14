"""What the three compile-dump tools share (gluon_asm_diff, triton_asm_diff, tpu_mlir_diff): the
row-by-row comparison of two dumps ({"meta": {"commit": ...}, "kernels": {key: row}}).

Only their `compare` uses it, importing it when called: their `dump` also runs against an older
checkout (`PYTHONPATH=OLD_TREE python benchmarks/<tool>.py dump ...`), where `benchmarks` is the
old tree's and may not have this module."""
from __future__ import annotations

import json
import re


def load_pair(a_path, b_path):
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    return a, b


def row_diffs(a, b, a_path, b_path, fields, only=None):
    """Compare the two dumps' rows key by key (sorted; `only`: a regex the keys must match),
    printing a line for a key in one dump only and for a row whose `fields(ra, rb)` differ.
    Returns (keys, bad, both): bad counts the printed keys, both lists (key, ra, diff) for the
    keys in both dumps (diff: the differing field names)."""
    keys = sorted(k for k in set(a["kernels"]) | set(b["kernels"])
                  if not only or re.search(only, k))
    bad, both = 0, []
    for key in keys:
        ra, rb = a["kernels"].get(key), b["kernels"].get(key)
        if ra is None or rb is None:
            bad += 1
            print(f"{key}: only in {a_path if rb is None else b_path}")
            continue
        diff = [k for k in fields(ra, rb) if ra.get(k) != rb.get(k)]
        if diff:
            bad += 1
            print(f"{key}: differs in {', '.join(diff)}")
        both.append((key, ra, diff))
    return keys, bad, both


def tally(both, group, header):
    """Print a markdown table of rows and identical rows per group(key, row) (a pair of
    strings), under `header` (its two group column names and the last column's name)."""
    counts = {}
    for key, ra, diff in both:
        c = counts.setdefault(group(key, ra), [0, 0])
        c[0] += 1
        c[1] += not diff
    g1, g2, last = header
    print(f"| {g1} | {g2} | rows | {last} |\n|---|---|---|---|")
    for (x, y), (n, same) in sorted(counts.items()):
        print(f"| {x} | {y} | {n} | {same} |")


def compare_tally(a_path, b_path, fields, group, header):
    """row_diffs over all keys with fixed fields, then tally's table and a summary line: 1 if
    any row differs or is missing, else 0 (the triton and tpu tools' compare)."""
    a, b = load_pair(a_path, b_path)
    keys, bad, both = row_diffs(a, b, a_path, b_path, lambda ra, rb: fields)
    tally(both, group, header)
    print(f"{a['meta']['commit']} vs {b['meta']['commit']}: {len(keys)} rows, {bad} differ")
    return 1 if bad else 0
