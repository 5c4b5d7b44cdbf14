"""An xdist worker ignores SIGINT once its tests are done (imported by tests/conftest.py).

When the controller shuts a worker down, execnet gives the worker 5 s to end its session and then
SIGINTs it (execnet/gateway_base.py, `_terminate_execution`). After its last test a worker
still runs pytest's unconfigure, which collects garbage (pytest's unraisable-exception plugin
calls gc.collect() twice); over this suite's jax heap, on 2 loaded cores, that can take longer.
The SIGINT then lands in whichever gc callback runs first (jax's, or hypothesis's, which puts
itself first) and is printed as "PytestUnraisableExceptionWarning ... gc_callback ...
KeyboardInterrupt" at the end of a passing run. Nothing is left to interrupt at that point, so
the worker ignores SIGINT from its session's end on; execnet still ends a worker that has not
exited 10 s later (os._exit), so a stuck worker cannot hang the run.
"""
from __future__ import annotations

import signal


def pytest_sessionfinish(session):
    """Runs before xdist reports the worker finished (its own hook wraps this one)."""
    if hasattr(session.config, "workerinput"):  # an xdist worker, not the controller
        signal.signal(signal.SIGINT, signal.SIG_IGN)
