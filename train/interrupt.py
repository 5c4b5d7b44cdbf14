"""Ctrl-C / SIGTERM during a run: the first stops the loop at the next step boundary (it saves a
checkpoint first), saying so at once; a second one stops the process at once, saying what is
saved.

Python runs signal handlers in the main thread between bytecodes, so while the main thread
waits inside XLA (a step) or orbax (a save) a handler waits too, and two Ctrl-C that arrive
meanwhile are seen as one. The C-level handler, though, writes one byte per signal to the
wakeup fd at once: a watcher thread reads those bytes, so the second signal is acted on
immediately, whatever the main thread is doing.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import jax

__all__ = ["StopFlag"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Context manager: `signum` is set by the first SIGINT / SIGTERM; the second one writes
    `describe()` (what is saved) to stderr and exits with 128 + its number, at once.

    The loop keeps `saving` (the step being saved, or None) and `last_saved` up to date;
    `describe` reads them. Outside the main thread it installs nothing (signum stays None).
    """

    def __init__(self, where: str = ""):
        self.where = where
        self.signum = None
        self.saving: int | None = None
        self.last_saved: int | None = None
        self._old, self._old_fd, self._thread, self._count = {}, None, None, 0

    def describe(self) -> str:
        saving, last_saved = self.saving, self.last_saved
        last = (f"the last complete checkpoint is step {last_saved}{self.where}; rerun "
                f"the same command to resume from it" if last_saved is not None else
                "no checkpoint was saved by this run or an earlier one")
        if saving is not None:
            return (f"the save of step {saving} was cut short and will not be used "
                    f"(orbax commits a checkpoint only once it is complete); {last}")
        return f"nothing more was saved; {last}"

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        self._r, self._w = socket.socketpair()
        self._w.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        # In a multi-process run SIGTERM is left to jax.distributed's preemption notifier: the
        # loop asks Checkpointer.reached_preemption, so every process stops at the same step.
        sigs = (signal.SIGINT,) if jax.process_count() > 1 else _SIGNALS
        for sig in sigs:
            self._old[sig] = signal.signal(sig, self._handle)
        self._thread = threading.Thread(target=self._watch, name="train-stop-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def _handle(self, signum, frame):  # main thread, possibly late: the watcher counts
        if self.signum is None:
            self.signum = signum

    def _watch(self):
        while True:
            try:
                data = self._r.recv(64)
            except OSError:
                return
            if not data:
                return
            for sig in data:
                if sig not in _SIGNALS:
                    continue
                self._count += 1
                if self.signum is None:
                    self.signum = sig
                if self._count >= 2:
                    self._hard_stop(sig)
                self._received(sig)  # the first one

    def _received(self, sig):
        """Said at once (the main thread may be inside a long step or its compilation)."""
        name = signal.Signals(sig).name
        os.write(2, f"\n{name} received: the run stops after the step in progress (the "
                    f"first step also compiles, which can take minutes) and saves a checkpoint "
                    f"of it; {name} again stops at once without saving\n".encode())

    def _hard_stop(self, sig):
        name = signal.Signals(sig).name
        try:
            os.write(2, f"\n{name} again: stopped at once; {self.describe()}\n".encode())
        finally:
            os._exit(128 + sig)

    def __exit__(self, *exc):
        if self._thread is None:
            return
        signal.set_wakeup_fd(self._old_fd)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._w.close()  # ends the watcher's recv
        self._thread.join(timeout=5)
        self._r.close()
