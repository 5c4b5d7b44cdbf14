"""Checkpoints with orbax: atomic (orbax writes a temporary directory and renames it), the last
few kept, the train state as a pytree plus a JSON record (config, data position, fingerprint).

Saves are asynchronous: `save` returns once the arrays are copied to host memory and orbax
writes them in a background thread while training goes on; the next save, any restore and
`close` wait for it. In a multi-process run every process calls save / restore (orbax writes
each process's shards, process 0 the metadata) and `reached_preemption` is orbax's preemption
check: once any process got SIGTERM, every process reaches the same agreed step to save at."""

from __future__ import annotations

import logging
from pathlib import Path

import orbax.checkpoint as ocp

__all__ = ["CheckpointError", "Checkpointer"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run (shown without a traceback)."""


class Checkpointer:
    """Save / restore `{workdir}/checkpoints/<step>/{state,meta}` with orbax."""

    def __init__(self, directory, *, keep: int):
        self.directory = Path(directory).absolute()
        # orbax logs every save at INFO/WARNING through absl; the progress bar is enough.
        logging.getLogger("absl").setLevel(logging.ERROR)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # e.g. the path exists and is a file, or is not writable
            raise CheckpointError(f"cannot use checkpoint directory {str(self.directory)!r}: "
                                  f"{type(e).__name__}: {e}") from None

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Block until the last save is on disk."""
        self._mgr.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        """True at the step where every process of a multi-process run saves for a preemption
        (jax.distributed's preemption sync point); always False in a single process."""
        return self._mgr.reached_preemption(step)

    def read_meta(self, step: int) -> dict:
        """The JSON record of checkpoint `step` alone (cheap; checked before the state loads)."""
        self.wait()
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return dict(out["meta"])
        except Exception as e:
            raise self._error(step, e) from None

    def _error(self, step, e):
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return CheckpointError(
            f"checkpoint {str(self.directory / str(step))!r} cannot be restored "
            f"({type(e).__name__}: {msg}). Nothing was deleted. To resume from an earlier "
            f"checkpoint, move that directory away; to start over, pick a new --workdir.")

    def restore(self, step: int, abstract_state):
        """(state, meta) of checkpoint `step`; abstract_state gives the tree, shapes and dtypes."""
        self.wait()
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            return out["state"], dict(out["meta"])
        except Exception as e:
            raise self._error(step, e) from None

    def close(self) -> None:
        self._mgr.close()
