"""Checkpoints with orbax: atomic (orbax writes a temporary directory and renames it), the last
few kept, the train state as a pytree plus a JSON record (config, data position, fingerprint).

Integrity: every save records a SHA-256 of each array (dtype, shape and bytes) in the JSON
record, and every restore recomputes them, so a checkpoint whose bytes changed after it was
written (bit rot, a bad copy, a truncated file) is refused instead of silently resumed.
`restore_newest` walks the checkpoints newest first and resumes from the first that reads and
verifies; nothing is ever deleted (refused checkpoints that a resumed run would overwrite are
moved to `corrupt_checkpoints/` beside `checkpoints/`).

Saves are asynchronous: `save` returns once the arrays are copied to host memory and orbax
writes them in a background thread while training goes on; the next save, any restore and
`close` wait for it. In a multi-process run every process calls save / restore (orbax writes
each process's shards, process 0 the metadata) and `reached_preemption` is orbax's preemption
check: once any process got SIGTERM, every process reaches the same agreed step to save at.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from train.workdir import free_bytes

__all__ = ["CheckpointError", "Checkpointer", "checksums"]

CORRUPT_DIR = "corrupt_checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run (shown without a traceback)."""


def checksums(state) -> dict[str, str]:
    """{tree path: sha256 of dtype, shape and bytes} of every array of `state` (gathered to the
    host, so the value does not depend on the sharding it lives in). Arrays that this process
    cannot see whole (a multi-process run's shards) are not covered."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            continue
        a = np.ascontiguousarray(jax.device_get(leaf))
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


def _os_error(e: BaseException) -> str | None:
    """The OS error inside an orbax / TensorStore failure ("No space left on device"), which
    TensorStore puts at the end of a long message as [os_error_code='28'], or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno)} [errno {e.errno}]"
        m = re.search(r"os_error_code='?(\d+)", str(e))
        if m:
            return f"{os.strerror(int(m.group(1)))} [errno {m.group(1)}]"
        e = e.__cause__ or e.__context__
    return None


def _reason(e: BaseException) -> str:
    """A one-line cause of a read or write failure: the OS error if there is one, else the
    innermost exception's first line (TensorStore wraps its error in an outer one whose text
    dumps a pybind repr of the whole spec)."""
    os_error = _os_error(e)
    if os_error is not None:
        return os_error
    inner, seen = e, set()
    while (inner.__cause__ or inner.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    for x in (inner, e):
        text = str(x).split(" See full TensorStore details", 1)[0].strip()
        if text:
            return f"{type(x).__name__}: {text.splitlines()[0][:300]}"
    return type(e).__name__


@contextlib.contextmanager
def _quiet_orbax_unraisable():
    """A failed read leaves orbax's per-array read coroutines to be collected later, and Python
    prints each one's exception as "Exception ignored in ...": a traceback after the one-line
    error. Drop those (only those raised inside orbax) while a restore runs and is collected."""
    old = sys.unraisablehook

    def hook(u):
        files = [f.filename for f in traceback.extract_tb(u.exc_traceback)]
        if not any("orbax" in f for f in files):
            old(u)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = old


def _from_orbax(tb) -> bool:
    return any(_ORBAX_DIR in f.filename for f in traceback.extract_tb(tb))


_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


class _OrbaxNoise(logging.Filter):
    """Holds back orbax's own error logs (a failed write logs a traceback per thread; the
    failure reaches us as an exception too: one `error:` line) and asyncio's "exception was
    never retrieved" for orbax's gathered writes: those whose traceback passes through orbax,
    and those that name the checkpoint directory (TensorStore's write errors come back with no
    orbax frame: "Error writing ... at local file '<directory>/...'"). Checkpointer.close drops
    them if a failed save was reported, and logs them then otherwise, so nothing is lost."""

    def __init__(self, directory=None):
        super().__init__()
        self.directory = str(directory) if directory is not None else None
        self.held: list[logging.LogRecord] = []
        self.drop = False      # after a reported failure: drop orbax's records, hold none

    def _ours(self, record) -> bool:
        if _ORBAX_DIR in record.pathname:
            return True
        if record.name != "asyncio":
            return False
        if record.exc_info and _from_orbax(record.exc_info[2]):
            return True
        if self.directory is None:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return self.directory in record.getMessage() or self.directory in str(exc or "")

    def filter(self, record):
        if self._ours(record):
            if not self.drop:
                self.held.append(record)
            return False
        return True


def _write_noise_hook(previous):
    """An unraisablehook that drops what a failed orbax write leaves behind: TensorStore
    callbacks that reach an asyncio loop orbax already closed ("Event loop is closed"), and
    exceptions raised inside orbax; everything else goes to `previous`."""

    def hook(u):
        closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == \
            "Event loop is closed"
        if not (closed or _from_orbax(u.exc_traceback)):
            previous(u)

    hook.previous = previous
    return hook


def _bytes_to_write(state) -> int:
    """Uncompressed bytes of the arrays this process writes (its primary shards)."""
    n = 0
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            n += sum(s.data.nbytes for s in leaf.addressable_shards if s.replica_id == 0)
        else:
            n += np.asarray(leaf).nbytes
    return n


_SLACK = 256 * 1024  # orbax's metadata files and the file system's blocks


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


class Checkpointer:
    """Save / restore `{workdir}/checkpoints/<step>/{state,meta}` with orbax."""

    def __init__(self, directory, *, keep: int):
        self.directory = Path(directory).absolute()
        self._saving: int | None = None  # the step of the save in flight
        self._reported = False  # a failed save was raised as a CheckpointError
        # orbax logs every save at INFO/WARNING through absl; the progress bar is enough. Its
        # errors come back as exceptions (one line each, below), not as per-thread tracebacks.
        logging.getLogger("absl").setLevel(logging.ERROR)
        self._noise = _OrbaxNoise(self.directory)
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(self._noise)
        self._hook = _write_noise_hook(sys.unraisablehook)
        sys.unraisablehook = self._hook
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # e.g. the path exists and is a file, or is not writable
            self._unhook()
            raise CheckpointError(f"cannot use checkpoint directory {str(self.directory)!r}: "
                                  f"{_reason(e)}") from None

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` and `meta` (plus the arrays' checksums, computed now from the
        values being saved) as checkpoint `step`; orbax finishes the write in the background."""
        meta = {**meta, "checksums": checksums(state)}
        self.wait()  # the previous save, so its failure is reported before a new one starts
        self._saving = step
        # Refuse up front when the disk cannot hold it: a write that fails half-way leaves
        # orbax's threads failing one by one (the except clauses below clean up after them).
        need = _bytes_to_write(state) + len(json.dumps(meta)) + _SLACK
        try:
            free = free_bytes(self.directory)
        except OSError:
            free = None
        if free is not None and free < need:
            self._saving = None
            raise CheckpointError(
                f"cannot save checkpoint {step} in {str(self.directory)!r}: no space left on "
                f"the device (the checkpoint needs about {_size(need)}, {_size(free)} are free)")
        try:
            self._mgr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # disk full, directory gone, ...
            raise self._save_error(step, e) from None

    def _save_error(self, step, e) -> CheckpointError:
        """The error of a failed save, after removing its partial directory (orbax writes into
        `<step>.orbax-checkpoint-tmp*` and renames it only once complete: nothing else is
        touched)."""
        self._saving = None
        if step is not None:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        self._reported = True  # orbax's own logs of it are redundant
        what = "a checkpoint" if step is None else f"checkpoint {step}"
        return CheckpointError(f"cannot save {what} in {str(self.directory)!r}: {_reason(e)}")

    def wait(self) -> None:
        """Block until the last save is on disk (CheckpointError if it failed)."""
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # disk full, directory gone, ...
            raise self._save_error(self._saving, e) from None
        self._saving = None

    def reached_preemption(self, step: int) -> bool:
        """True at the step where every process of a multi-process run saves for a preemption
        (jax.distributed's preemption sync point); always False in a single process."""
        return self._mgr.reached_preemption(step)

    def read_meta(self, step: int) -> dict:
        """The JSON record of checkpoint `step` alone (cheap; checked before the state loads)."""
        self.wait()
        try:
            with _quiet_orbax_unraisable():
                out = self._mgr.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))
            meta = dict(out["meta"])
        except Exception as e:
            raise self._error(step, _reason(e)) from None
        if not isinstance(meta.get("checksums", {}), dict):
            raise self._error(step, "its record of checksums is malformed")
        return meta

    def _error(self, step, reason):
        self._reported = True  # a failed read is reported too: orbax's own logs of it are redundant
        return CheckpointError(f"checkpoint {str(self.path(step))!r} cannot be restored "
                               f"({reason})")

    def restore(self, step: int, abstract_state):
        """(state, meta) of checkpoint `step`; abstract_state gives the tree, shapes and dtypes.
        Raises CheckpointError if it cannot be read or an array differs from its checksum."""
        self.wait()
        try:
            with _quiet_orbax_unraisable():
                out = self._mgr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    meta=ocp.args.JsonRestore()))
            state, meta = out["state"], dict(out["meta"])
        except Exception as e:
            raise self._error(step, _reason(e)) from None
        saved = meta.get("checksums")
        if saved is not None:  # checkpoints written before checksums existed have none
            now = checksums(state)
            bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            if bad:
                raise self._error(step, f"checksum mismatch in {len(bad)} of {len(saved)} "
                                        f"arrays, first {bad[0]}: the data changed after it "
                                        f"was saved")
        return state, meta

    def restore_newest(self, abstract_state, *, check_meta=None, log=print):
        """Resume point: (step, state, meta) of the newest checkpoint that reads and verifies,
        or None when there are no checkpoints.

        check_meta(step, meta) may raise (e.g. ConfigError for a run with other settings: that
        propagates; CheckpointError: that checkpoint is refused). Each refused checkpoint gets
        one log line. Refused checkpoints newer than the one returned are moved to
        `corrupt_checkpoints/` (the run will save those steps again); if none verifies, a
        CheckpointError lists them and nothing is moved.
        """
        refused = []
        for step in sorted(self._mgr.all_steps(), reverse=True):
            try:
                meta = self.read_meta(step)
                if check_meta is not None:
                    check_meta(step, meta)
                state, meta = self.restore(step, abstract_state)
            except CheckpointError as e:
                log(f"refused: {e}")
                refused.append((step, e))
                continue
            if "checksums" not in meta:
                log(f"note: checkpoint {str(self.path(step))!r} has no checksums (saved by an "
                    f"older version): restored unverified")
            for bad, _ in refused:
                log(f"moved the refused checkpoint {str(self.path(bad))!r} to "
                    f"{str(self._quarantine(bad))!r} (nothing deleted)")
            if refused:
                log(f"resuming from step {step}, the newest checkpoint that verifies")
            return step, state, meta
        if refused:
            raise CheckpointError(
                f"no checkpoint in {str(self.directory)!r} can be restored: "
                + "; ".join(str(e) for _, e in refused)
                + ". Nothing was deleted; to start over, pick a new --workdir.")
        return None

    def _quarantine(self, step: int) -> Path:
        """Move checkpoint `step` out of orbax's sight (beside `checkpoints/`, never deleted)."""
        root = self.directory.parent / CORRUPT_DIR
        root.mkdir(exist_ok=True)
        dest, n = root / str(step), 0
        while dest.exists():
            n += 1
            dest = root / f"{step}.{n}"
        shutil.move(str(self.path(step)), str(dest))
        self._mgr.reload()
        return dest

    def close(self) -> None:
        try:
            self._mgr.close()
        except Exception:  # a save that failed was reported by wait()
            pass
        finally:
            self._unhook()

    def _unhook(self) -> None:
        gc.collect()  # what a failed write left to be collected, still under the filter
        if self._reported:
            # A failed save was reported (one `error:` line): its orbax tasks can still be
            # collected later (asyncio's "exception was never retrieved" at the next collection
            # or at exit), so the filter and the hook stay installed, dropping only orbax's
            # records of that failure, as while the checkpointer was open.
            self._noise.held.clear()
            self._noise.drop = True
            return
        if sys.unraisablehook is self._hook:
            sys.unraisablehook = self._hook.previous
        for name in ("absl", "asyncio"):
            logging.getLogger(name).removeFilter(self._noise)
        for record in self._noise.held:  # orbax errors that no exception of ours reported
            logging.getLogger(record.name).handle(record)
        self._noise.held.clear()
