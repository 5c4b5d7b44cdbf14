"""`--profile-steps A:B`: a jax.profiler trace of steps A..B of a run, with the step's compiled HLO.

The trace goes to `<workdir>/profile/` (`plugins/profile/<time>/*.xplane.pb`, plus a Perfetto
`*.trace.json.gz`): open it with TensorBoard's profile plugin (`tensorboard --logdir
<workdir>/profile`) or https://ui.perfetto.dev, or turn it into a table by op family with
`python -m benchmarks.trace_breakdown <workdir>/profile`. The compiled HLO of the step
(`train_step.hlo.txt`) is written beside it: it maps each kernel to its HLO op's named scope.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from train.config import ConfigError

__all__ = ["StepProfiler", "parse_profile_steps"]


def parse_profile_steps(text: str | None, total_steps: int | None = None):
    """'A:B' (steps A..B, 1-based, inclusive, as logged) or 'A' (one step) -> (A, B) or None."""
    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        first = int(a)
        last = int(b) if sep else first
    except ValueError:
        raise ConfigError(f"--profile-steps {text!r} must be A:B (two step numbers, e.g. 5:7) "
                          f"or one step number") from None
    if not 1 <= first <= last:
        raise ConfigError(f"--profile-steps {text!r} must satisfy 1 <= A <= B")
    if total_steps is not None and last > total_steps:
        raise ConfigError(f"--profile-steps {text!r} ends after the run's last step "
                          f"{total_steps} (--steps)")
    return first, last


class StepProfiler:
    """Starts the trace before step A, stops it after step B (having waited for the device), and
    annotates every traced step as `train` with its step number (the breakdown counts them).
    With steps=None it does nothing."""

    def __init__(self, steps, out_dir, log=print):
        self.steps = steps
        self.dir = Path(out_dir)
        self.log = log
        self.active = False

    def annotation(self, step_num: int):
        """Context manager around the call of step `step_num`."""
        if self.steps and not self.active and self.steps[0] <= step_num <= self.steps[1]:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True
        if self.active:
            return jax.profiler.StepTraceAnnotation("train", step_num=step_num)
        return contextlib.nullcontext()

    def after(self, step_num: int, state, runner=None, batch=None):
        """After step `step_num` returned: at step B wait for the device, stop, and write the
        step's compiled HLO (runner.hlo_text(state, batch), where the runner has one)."""
        if not (self.active and step_num >= self.steps[1]):
            return
        jax.block_until_ready(state)
        self.stop()
        if hasattr(runner, "hlo_text"):
            (self.dir / "train_step.hlo.txt").write_text(runner.hlo_text(state, batch))
        self.log(f"profile of steps {self.steps[0]}..{step_num} in {self.dir} (table: python "
                 f"-m benchmarks.trace_breakdown {self.dir})")

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
