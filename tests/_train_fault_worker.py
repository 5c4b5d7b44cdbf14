"""Helpers of tests/test_train_faults.py: a runner whose steps cost nothing, and a `python -m
train` stand-in that delivers signals at chosen moments (run as a subprocess: a second signal
ends the process with os._exit, which must not happen to pytest).

    python tests/_train_fault_worker.py MODE ARGV...
    # MODE: step | save (two SIGINTs), fake (no signal), unchecked-space (fake, and the save's
    # free-space check sees unlimited room), hold (fake, step 1 sleeps 60 s: holds the
    # workdir), first-sigint (one SIGINT during a step 1 that takes 4 s, like a compile)
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax.numpy as jnp


class FakeRunner:
    """Stands in for train.parallel's runner without compiling anything: a step only counts,
    its loss is `loss(step)`; `on_step(step)` runs inside each step (e.g. to send a signal)."""

    def __init__(self, real, loss=lambda step: 1.0, on_step=None):
        self._real, self._loss, self._on_step = real, loss, on_step

    def shardings(self, state):
        return self._real.shardings(state)

    def put(self, state):
        return state

    def get(self, state):
        return state

    def batch(self, batch):
        return batch

    def eval(self, state, batch):
        return 1.0

    def step(self, state, batch):
        step = int(state["step"]) + 1
        if self._on_step is not None:
            self._on_step(step)
        state = {**state, "step": jnp.asarray(step, jnp.int32)}
        return state, {"loss": self._loss(step), "aux_loss": 0.0, "grad_norm": 0.0, "lr": 0.0}


def fake_runners(monkeypatch_setattr, **kw):
    """Make train.loop build FakeRunners (monkeypatch_setattr(obj, name, value))."""
    from train import loop

    real = loop.make_runner
    monkeypatch_setattr(loop, "make_runner", lambda *a: FakeRunner(real(*a), **kw))


def two_sigints():
    """Two Ctrl-C 50 ms apart."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)


def main(mode, argv):
    """mode "step": both signals during step 3. mode "save": the first during step 3, the second
    during the save of step 3 that the first one asked for. The step or save then takes 20 s
    more (a long one on a GPU), which the second signal must cut short."""
    from train import checkpoint
    from train.cli import main as cli_main

    if mode in ("fake", "unchecked-space", "hold", "first-sigint"):
        if mode == "unchecked-space":
            from train import loop

            checkpoint.free_bytes = loop.free_bytes = lambda path: 1 << 60
        on_step = None
        if mode == "hold":
            on_step = lambda step: time.sleep(60) if step == 1 else None  # noqa: E731
        if mode == "first-sigint":
            def on_step(step):
                if step == 1:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(4)
                    print("step 1 ends", file=sys.stderr, flush=True)
        fake_runners(setattr, on_step=on_step)
        return cli_main(argv)
    if mode == "step":
        def on_step(step):
            if step == 3:
                two_sigints()
                time.sleep(20)
    else:
        on_step = lambda step: os.kill(os.getpid(), signal.SIGINT) if step == 3 else None  # noqa: E731
        real_save = checkpoint.Checkpointer.save

        def save(self, step, state, meta):
            if step == 3:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(20)
            return real_save(self, step, state, meta)

        checkpoint.Checkpointer.save = save
    fake_runners(setattr, on_step=on_step)
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
