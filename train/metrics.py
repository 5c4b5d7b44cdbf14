"""Run metrics: one JSON line per logged step, TensorBoard events, a progress bar, a loss PNG."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

__all__ = ["MetricsWriter", "OutputError", "plain_line", "plot_losses", "read_metrics"]


class OutputError(RuntimeError):
    """metrics.jsonl or loss.png cannot be written (a full disk, say): one line, no traceback."""


def _cannot_write(path, e: OSError) -> OutputError:
    return OutputError(f"cannot write {str(path)!r}: {e.strerror or e}")


def _quiet_tensorboardx_threads():
    """tensorboardX writes events in a thread of its own; on a full disk that thread dies with a
    traceback (the run reports the disk itself, in one line): drop OSErrors raised there."""
    import threading
    import traceback

    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboardx", False):
        return

    def hook(args):
        files = [f.filename for f in traceback.extract_tb(args.exc_traceback)]
        if not (issubclass(args.exc_type, OSError) and any("tensorboardX" in f for f in files)):
            previous(args)

    hook.quiet_tensorboardx = True
    threading.excepthook = hook


def read_metrics(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: drop it
    return out


def _finite_or_null(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def to_json_line(record: dict) -> str:
    """One strict JSON line: NaN and infinities (a diverged step) become null."""
    return json.dumps({k: _finite_or_null(v) for k, v in record.items()}, allow_nan=False) + "\n"


def plain_line(record: dict, total_steps: int) -> str:
    """`step 20/200: loss 2.4813, grad_norm 0.41, lr 0.003, 5123 tok/s` (or `eval loss ...`)."""
    parts = []
    for key, fmt in (("loss", "loss {:.4f}"), ("eval_loss", "eval loss {:.4f}"),
                     ("grad_norm", "grad_norm {:.3g}"), ("lr", "lr {:.3g}"),
                     ("tokens_per_sec", "{:.0f} tok/s")):
        v = record.get(key)
        if isinstance(v, (int, float)):
            parts.append(fmt.format(v))
    return f"step {record['step']}/{total_steps}: " + ", ".join(parts)


class MetricsWriter:
    """metrics.jsonl + TensorBoard (`{workdir}/tb`) + tqdm progress bar.

    start_step: the step the run starts from; lines of a previous attempt past it (written
    after its last checkpoint) are dropped so that a resumed run's file reads like an
    uninterrupted one.
    """

    def __init__(self, workdir, *, start_step: int, total_steps: int, progress: bool = True):
        from tqdm import tqdm

        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # metrics.jsonl is the record; TensorBoard is a view of it
            SummaryWriter = None

        self.workdir = Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(to_json_line(r) for r in kept))
            os.replace(tmp, self.path)  # atomic
            self._file = open(self.path, "a")
        except OSError as e:
            raise _cannot_write(self.path, e) from None
        _quiet_tensorboardx_threads()
        self._tb = None if SummaryWriter is None else SummaryWriter(str(self.workdir / "tb"),
                                                                      purge_step=start_step + 1)
        self._post: dict = {}
        self._total, self._plain = total_steps, not progress
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=not progress, file=sys.stderr)
        if self._tb is None:
            self.message(f"tensorboardX is not installed: no TensorBoard log in {self.workdir / 'tb'} "
                         f"(metrics.jsonl is written; pip install 'csa_jax[train]' for both)")

    def write(self, record: dict) -> None:
        try:
            self._file.write(to_json_line(record))
            self._file.flush()
        except OSError as e:
            raise _cannot_write(self.path, e) from None
        step = record["step"]
        for k, v in record.items():
            if self._tb is not None and k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k, v, step)
        self._post.update({k: f"{record[k]:.4g}" for k in ("loss", "eval_loss") if k in record})
        if "tokens_per_sec" in record:
            self._post["tok/s"] = f"{record['tokens_per_sec']:.0f}"
        self._bar.set_postfix(self._post, refresh=False)
        if self._plain:  # no bar: one log line per logged step instead
            self.message(plain_line(record, self._total))

    def advance(self, n: int = 1) -> None:
        self._bar.update(n)

    def message(self, text: str) -> None:
        self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._file.closed:
            return
        self._bar.close()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:  # a full disk (reported by whatever failed first)
                # tensorboardX's atexit hook would try again and print the same error
                writers = list((getattr(self._tb, "all_writers", None) or {}).values())
                for fw in writers + [getattr(self._tb, "file_writer", None)]:
                    ev = getattr(fw, "event_writer", None)
                    if ev is not None:
                        ev._closed = True
        try:
            self._file.close()
        except OSError:
            pass


def plot_losses(workdir) -> Path | None:
    """Write {workdir}/loss.png from metrics.jsonl (train loss and eval loss vs step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(workdir) / "metrics.jsonl")
    ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v)  # noqa: E731 (null = diverged)
    train = [(r["step"], r["loss"]) for r in rows if ok(r.get("loss"))]
    evals = [(r["step"], r["eval_loss"]) for r in rows if ok(r.get("eval_loss"))]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (held out)")
    bad = [r["step"] for r in rows if "loss" in r and not ok(r["loss"])]
    if bad:
        ax.axvline(bad[0], color="red", ls="--", label=f"loss not finite (step {bad[0]})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(workdir) / "loss.png"
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise _cannot_write(out, e) from None
    finally:
        plt.close(fig)
    return out
