"""Where a training step's time goes: a jax.profiler trace -> a table by op family.

    python -m train --preset small --steps 8 --profile-steps 5:7 --workdir runs/prof
    python -m benchmarks.trace_breakdown runs/prof/profile            # markdown table
    python -m benchmarks.trace_breakdown runs/prof/profile --json out.json --top 20

Input: a directory holding the `*.xplane.pb` that `jax.profiler` wrote (the newest one is read)
and the compiled HLO of the step (`train_step.hlo.txt`, which `--profile-steps` writes beside
it; `--hlo` names another). Each device event (GPU kernel, or on CPU the XLA thunk) carries the
HLO instruction that launched it; the HLO text gives that instruction's `op_name`, whose named
scopes (csa_jax/layers.py, train/model.py, train/parallel.py) say which part of the model it
belongs to, and whether it is a matrix product. Families, by the innermost known scope:

    CSA attention forward / backward   scope csa_attention (backward: op_name has transpose(...))
    indexer scores                     scopes indexer, indexer_scores (the indexer's projections,
                                       q . k products, ReLU and head-weighted sum)
    indexer top-k                      scope indexer_topk
    compressor                         scope compressor (projections, pooling, pool RoPE)
    index lists                        scope index_lists
    dense matmuls                      any other matrix product (q/kv/out projections, MLP, head)
    norms and RoPE                     scopes norm, rope (outside the scopes above)
    optimizer                          scope optimizer (clipping, AdamW, the update)
    loss and embedding                 scopes loss, embed
    other XLA ops                      the rest (residual adds, activations, copies, ...)
    host gaps                          device idle time inside the profiled steps' span

Times are per step: the sum of each event's own time (nested events subtracted) over the
profiled steps, divided by the number of steps (the `train` StepTraceAnnotation events, or
--steps). On CPU several thunks run at once on different threads, so the families can add up to
more than the wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import warnings
from pathlib import Path

FAMILIES = ("CSA attention forward", "CSA attention backward", "indexer scores", "indexer top-k",
            "compressor", "index lists", "dense matmuls", "norms and RoPE", "optimizer",
            "loss and embedding", "other XLA ops", "host gaps")

_SCOPES = {"csa_attention": "CSA attention", "indexer_topk": "indexer top-k",
           "indexer_scores": "indexer scores", "indexer": "indexer scores",
           "compressor": "compressor", "index_lists": "index lists", "norm": "norms and RoPE",
           "rope": "norms and RoPE", "optimizer": "optimizer", "loss": "loss and embedding",
           "embed": "loss and embedding"}

_COMP_START = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\(.*?\)|\S+) ([\w\-]+)\((.*)$")
_MATMUL_TARGET = re.compile(r"gemm|matmul|cublas", re.I)


def _instructions(text):
    """(computation, instruction, opcode, rest of the line) of every instruction, in text order
    (a scheduled module lists each computation's instructions in execution order)."""
    comp = None
    for line in text.splitlines():
        cm = _COMP_START.match(line)
        if cm:
            comp = cm.group(1)
            continue
        im = _INSTR.match(line)
        if im and comp is not None:
            yield (comp, *im.groups())


def parse_hlo(text):
    """(module name, {instruction: (op_name, opcode, is_matmul)}) of an HLO module's text.
    (`KernelLocator(text)` maps the kernels of command buffers back to these instructions.)"""
    m = re.search(r"^HloModule ([\w.\-]+)", text, re.M)
    module = m.group(1) if m else ""
    comps = collections.defaultdict(list)  # computation -> [(instr, opcode, calls, target)]
    info = {}
    for comp, name, opcode, rest in _instructions(text):
        calls = re.findall(r"calls=%?([\w.\-]+)", rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        comps[comp].append((name, opcode, calls, target.group(1) if target else ""))
        info[name] = [op_name.group(1) if op_name else "", opcode, calls,
                      target.group(1) if target else ""]

    memo = {}

    def has_dot(c, depth=0):
        if c not in memo:
            memo[c] = False
            memo[c] = depth < 20 and any(
                op in ("dot", "convolution") or (op == "custom-call" and _MATMUL_TARGET.search(t))
                or any(has_dot(x, depth + 1) for x in calls)
                for _, op, calls, t in comps.get(c, ()))
        return memo[c]

    out = {}
    for name, (op_name, opcode, calls, target) in info.items():
        mm = (opcode in ("dot", "convolution")
              or (opcode == "custom-call" and bool(_MATMUL_TARGET.search(target)))
              or (opcode == "fusion" and any(has_dot(c) for c in calls)))
        out[name] = (op_name, opcode, mm)
    return module, out


_GEMM_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass|cublas", re.I)
_CUB_KERNEL = re.compile(r"cub(?!las)|RadixSort|Onesweep", re.I)
_GEMM_TAIL = re.compile(r"splitK|reduce", re.I)


def _norm(name):
    return re.sub(r"[.\-]", "_", name)


def _kind(kernel_or_target):
    """What launched a kernel that no instruction is named after: gemm / cub / triton / None."""
    if _CUB_KERNEL.search(kernel_or_target):
        return "cub"
    if _GEMM_KERNEL.search(kernel_or_target) or "matmul" in kernel_or_target:
        return "gemm"
    if "triton" in kernel_or_target:
        return "triton"
    return None


class KernelLocator:
    """The HLO instruction behind a kernel that ran inside an XLA GPU command buffer (a CUDA
    graph): the trace names only the command buffer (hlo_op `command_buffer_N`) and the kernel.

    A fusion's kernel is named after its instruction ('.' and '-' as '_'): that is an exact
    match. Library kernels (cuBLAS / nvjet GEMMs, cub sorts) and Pallas Triton kernels are not;
    they are matched by position: such a kernel belongs to the custom-call of its kind (GEMM,
    cub, triton) located the fewest times so far (each runs once per step) and, among those,
    nearest in the scheduled HLO to the instruction of the kernel that ran before it (a CUDA
    graph may run independent branches out of text order). An approximation: the scopes of
    neighbouring GEMMs usually agree, their shapes are not checked. cub's sort launches several kernels: consecutive cub kernels stay on one call,
    as does a cuBLAS split-K reduction kernel on its GEMM.
    `locate(kernel)` must be called in execution order (events sorted by start time), and
    `seen(instr)` for the kernels that name their instruction themselves."""

    def __init__(self, text):
        self.by_name = {}
        self.seq = {}       # computation -> [(instr, kind of custom-call target or None)]
        self.where = {}     # instr -> (computation, position)
        for comp, name, opcode, rest in _instructions(text):
            self.seq.setdefault(comp, [])
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            kind = _kind(target.group(1)) if opcode == "custom-call" and target else None
            self.where[name] = (comp, len(self.seq[comp]))
            self.seq[comp].append((name, kind))
            self.by_name[_norm(name)] = name
        self.uses = collections.Counter()
        m = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M)
        self.entry = m.group(1) if m else None
        self.cursor = None  # instruction of the last located kernel

    def seen(self, instr):
        if instr in self.where:
            self.cursor = instr

    def locate(self, kernel):
        """The instruction name of `kernel` (None when neither rule finds one)."""
        name = self.by_name.get(_norm(kernel))
        if name is None:
            kind = _kind(kernel)
            if kind is None:
                return None
            # several kernels of one call: cub's sort passes, cuBLAS's split-K reduction
            follow = kind == "cub" or (kind == "gemm" and _GEMM_TAIL.search(kernel))
            if follow and self.cursor is not None and \
                    self.seq[self.where[self.cursor][0]][self.where[self.cursor][1]][1] == kind:
                return self.cursor
            comp, pos = self.where.get(self.cursor, (self.entry, 0))
            cands = [(i, n) for i, (n, k) in enumerate(self.seq.get(comp, [])) if k == kind]
            if not cands:
                return None
            # the least-located call of its kind (each runs once per step), nearest the cursor:
            # a CUDA graph runs independent branches in its own order, so "the next one in the
            # text" is often a neighbour, not the one that ran
            _, name = min(cands, key=lambda c: (self.uses[c[1]], abs(c[0] - pos), c[0]))
            self.uses[name] += 1
        self.cursor = name
        return name


def _scope_names(op_name):
    """Scope names of an op_name path, outermost first, wrappers (jvp(...), ...) removed."""
    names = []
    for part in op_name.split("/"):
        while True:
            m = re.match(r"^[\w\-]+\((.*)\)$", part)
            if not m:
                break
            part = m.group(1)
        names.append(part)
    return names


def classify(op_name, is_matmul):
    """(family, is_backward) of one HLO op."""
    backward = "transpose(" in op_name
    for name in reversed(_scope_names(op_name)):
        fam = _SCOPES.get(name)
        if fam == "CSA attention":
            return fam + (" backward" if backward else " forward"), backward
        if fam is not None and not (is_matmul and fam in ("norms and RoPE", "loss and embedding")):
            return fam, backward
    return ("dense matmuls" if is_matmul else "other XLA ops"), backward


def load_events(profile_dir):
    """(events [(start_ns, self_ns, dur_ns, kernel name, hlo_op, hlo_module)], steps, planes).

    Device planes (/device:GPU:*, TPU) when the trace has any with XLA ops, else the host plane's
    XLA thunks (CPU). An event's own time excludes the events nested inside it on its line."""
    from jax.profiler import ProfileData

    files = sorted(Path(profile_dir).glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {profile_dir}")
    data = ProfileData.from_file(str(files[-1]))
    planes = list(data.planes)
    step_ids = set()
    per_plane = {}
    for plane in planes:
        evs = []
        lines = list(plane.lines)
        # A device plane with an "XLA Ops" line (TPU) has one event per op there; its other lines
        # repeat that time at other levels. GPU planes have one line per stream.
        ops_lines = [ln for ln in lines if ln.name == "XLA Ops"]
        for line in ops_lines or lines:
            raw = []
            for e in line.events:
                with warnings.catch_warnings():  # a pybind type without __module__
                    warnings.simplefilter("ignore", DeprecationWarning)
                    st = dict(e.stats)
                if plane.name.startswith("/host") and e.name == "train":
                    # the StepTraceAnnotation of a step, on the thread that called it (its line
                    # is named after the thread: "python" here, "python3" elsewhere)
                    step_ids.add(st.get("step_num", (line.name, e.start_ns)))
                if "hlo_op" in st:
                    raw.append((e.start_ns, e.duration_ns, e.name, str(st["hlo_op"]),
                                str(st.get("hlo_module", ""))))
            evs += _self_times(raw)
        if evs:
            per_plane[plane.name] = evs
    device = [n for n in per_plane if not n.startswith("/host")]
    chosen = device or list(per_plane)
    return [e for n in chosen for e in per_plane[n]], len(step_ids), chosen


def _self_times(raw):
    """Own time of each event: its duration less the events nested inside it on its line. Only an
    event wholly inside another counts as nested: kernels of a CUDA graph may run concurrently and
    overlap on one stream's line without nesting (each keeps its whole duration then, so the
    families can add up to more than the busy time)."""
    raw.sort(key=lambda e: (e[0], -e[1]))
    out, stack = [], []  # stack of indices into out (open events)
    for start, dur, name, op, mod in raw:
        while stack and out[stack[-1]][0] + out[stack[-1]][2] <= start:
            stack.pop()
        if stack and start + dur <= out[stack[-1]][0] + out[stack[-1]][2]:
            out[stack[-1]][1] -= dur
            out.append([start, dur, dur, name, op, mod])
            stack.append(len(out) - 1)
        else:  # no open event, or one it only overlaps: not nested
            out.append([start, dur, dur, name, op, mod])
            if not stack:
                stack.append(len(out) - 1)
    return [tuple(e) for e in out]


def _busy_union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def breakdown(events, hlo, module, steps, top=15, locator=None):
    """dict: per-family ms/step (total, forward, backward), step span, top ops. locator: a
    KernelLocator of the same HLO, for the kernels of command buffers."""
    fam = {f: [0.0, 0.0, 0.0] for f in FAMILIES}
    ops = collections.defaultdict(lambda: [0.0, 0, "", ""])
    mine = [e for e in events if not module or not e[5] or e[5] == module
            or e[5].startswith(module + ".")]
    if not mine:
        raise ValueError(f"no event of HLO module {module!r} in the trace (modules seen: "
                         f"{sorted({e[5] for e in events})[:8]})")
    mine.sort(key=lambda e: e[0])
    located = [0, 0]  # command-buffer kernels: found, not found
    for start, self_ns, dur, kname, op, _ in mine:
        if op not in hlo and locator is not None and op.startswith("command_buffer"):
            found = locator.locate(kname)
            located[found is None] += 1
            op = found or op
        elif locator is not None:
            locator.seen(op)
        op_name, _, mm = hlo.get(op, ("", "", False))
        if not op_name:
            mm = mm or bool(_MATMUL_TARGET.search(kname))
        f, bwd = classify(op_name, mm)
        fam[f][0] += self_ns
        fam[f][2 if bwd else 1] += self_ns
        o = ops[(op, kname)]
        o[0] += self_ns
        o[1] += 1
        o[2], o[3] = f, op_name
    span = max(s + d for s, _, d, *_ in mine) - min(s for s, *_ in mine)
    busy = _busy_union([(s, s + d) for s, _, d, *_ in mine])
    fam["host gaps"][0] = fam["host gaps"][1] = max(span - busy, 0.0)
    n = max(steps, 1)
    to_ms = lambda ns: ns / 1e6 / n  # noqa: E731
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": n, "span_ms_per_step": to_ms(span), "busy_ms_per_step": to_ms(busy),
        "command_buffer_kernels": {"located": located[0], "not_located": located[1]},
        "families": {f: {"ms": to_ms(v[0]), "fwd_ms": to_ms(v[1]), "bwd_ms": to_ms(v[2])}
                     for f, v in fam.items()},
        "top_ops": [{"hlo_op": op, "kernel": k, "ms": to_ms(v[0]), "calls_per_step": v[1] / n,
                     "family": v[2], "op_name": v[3]} for (op, k), v in top_ops],
    }


def format_table(res):
    fams = res["families"]
    total = sum(v["ms"] for v in fams.values())
    cb = res.get("command_buffer_kernels", {})
    lines = [f"{res['steps']} step(s); span {res['span_ms_per_step']:.2f} ms/step, device busy "
             f"{res['busy_ms_per_step']:.2f} ms/step"
             + (f"; command-buffer kernels located {cb['located']}, not {cb['not_located']}"
                if sum(cb.values()) else "") + "\n",
             "| family | ms/step | share | forward | backward |", "|---|---|---|---|---|"]
    for f in FAMILIES:
        v = fams[f]
        share = 100 * v["ms"] / total if total else 0.0
        lines.append(f"| {f} | {v['ms']:.3f} | {share:.1f}% | {v['fwd_ms']:.3f} | "
                     f"{v['bwd_ms']:.3f} |")
    lines.append(f"| total | {total:.3f} | 100% | | |")
    if res["top_ops"]:
        lines += ["", "| top ops | ms/step | calls/step | family | op_name |",
                  "|---|---|---|---|---|"]
        for o in res["top_ops"]:
            name = o["hlo_op"]
            if o["kernel"] != name:
                name += f" ({o['kernel'][:60]})"
            lines.append(f"| {name} | {o['ms']:.3f} | {o['calls_per_step']:g} | {o['family']} | "
                         f"{o['op_name'][-90:]} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile_dir", help="directory with the *.xplane.pb (e.g. <workdir>/profile)")
    p.add_argument("--hlo", help="compiled HLO text of the step (default: <profile_dir>/"
                                 "train_step.hlo.txt)")
    p.add_argument("--steps", type=int, help="steps in the trace (default: counted)")
    p.add_argument("--top", type=int, default=15, help="top ops listed (0: none)")
    p.add_argument("--json", help="also write the result as JSON here")
    args = p.parse_args(argv)
    hlo_path = Path(args.hlo or Path(args.profile_dir) / "train_step.hlo.txt")
    if not hlo_path.exists():
        sys.exit(f"error: no HLO text at {hlo_path} (pass --hlo)")
    text = hlo_path.read_text()
    module, hlo = parse_hlo(text)
    events, steps, planes = load_events(args.profile_dir)
    res = breakdown(events, hlo, module, args.steps or steps, top=args.top,
                    locator=KernelLocator(text))
    res["planes"] = planes
    print(format_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
