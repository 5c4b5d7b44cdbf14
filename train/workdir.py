"""The workdir of a run: created and checked before any work, locked while the run lives, and
removed again when a run that created it fails before writing anything.

The lock is an exclusive `flock` on `<workdir>/.lock` (`.lock.<i>` for process i > 0 of a
multi-process run), holding the owner's pid, host and start time. The kernel drops a flock when
its process ends, however it ends, so a crashed run never leaves the workdir stuck: the next run
finds the file still naming the dead process, takes the lock over and says so. A run that ends
normally removes the file. (flock works across hosts on NFSv4 and most cluster file systems;
where the file system refuses locks, the pid in the file is checked instead on the same host.)
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import tempfile
from pathlib import Path

from train.config import ConfigError

__all__ = ["WorkdirBusy", "WorkdirLock", "free_bytes", "prepare_workdir", "remove_if_unused"]


class WorkdirBusy(ConfigError):
    """Another run holds the workdir (the CLI prints it as one `error:` line)."""


def free_bytes(path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def prepare_workdir(workdir) -> tuple[Path, list[Path]]:
    """Create `workdir` and check that it is writable, before any work (ConfigError if not).
    Returns the path and the directories this call created (outermost first)."""
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {str(workdir)!r} exists and is not a directory")
    created = []
    p = workdir.absolute()
    while not p.exists() and p != p.parent:
        created.insert(0, p)
        p = p.parent
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--workdir {str(workdir)!r} cannot be created: "
                          f"{e.strerror or e}") from None
    try:
        with tempfile.TemporaryFile(dir=workdir, prefix=".write-test-"):
            pass
    except OSError as e:
        remove_if_unused(created)
        raise ConfigError(f"--workdir {str(workdir)!r} is not writable: {e.strerror or e}") from None
    return workdir, created


def remove_if_unused(created, names=()) -> None:
    """Remove the files `names` (inside the innermost created directory) and then every
    directory of `created` that is empty, innermost first: what a failed start leaves behind.
    Only ever removes empty directories and the named files."""
    if not created:
        return
    for name in names:
        try:
            (created[-1] / name).unlink()
        except OSError:
            pass
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return  # not empty (or gone): leave it and its parents


def _describe(owner: dict) -> str:
    return (f"process {owner.get('pid', '?')} on host {owner.get('host', '?')} (started "
            f"{owner.get('started', '?')})")


def _alive_here(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell: another host
    try:
        os.kill(int(owner.get("pid", -1)), 0)
    except (OSError, ValueError):
        return False
    return True


class WorkdirLock:
    """`with WorkdirLock(workdir) as lock:` holds the workdir; WorkdirBusy if another run holds
    it. `lock.note` says when a stale lock of a crashed run was taken over (else None)."""

    def __init__(self, workdir, process_index: int = 0):
        self.workdir = Path(workdir)
        self.name = ".lock" if process_index == 0 else f".lock.{process_index}"
        self.path = self.workdir / self.name
        self.note: str | None = None
        self._fd: int | None = None

    def _read(self, fd) -> dict:
        try:
            raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            return json.loads(raw) if raw else {}
        except (OSError, ValueError):
            return {"pid": "?", "host": "?"}

    def _open_locked(self) -> int:
        """An fd of the lock file holding its flock (WorkdirBusy if another process has it).
        The owner removes the file when it ends, so a file opened just before that removal is
        not the lock any more: retried until the locked fd is the file at the path."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                owner = self._read(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) \
                        or (owner and _alive_here(owner)):
                    os.close(fd)
                    raise WorkdirBusy(
                        f"--workdir {str(self.workdir)!r} is in use by {_describe(owner)}: "
                        f"two runs would overwrite each other's checkpoints and metrics; wait "
                        f"for it to end, stop it, or use another --workdir") from None
                # the file system refuses locks and the recorded owner is gone: go on
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def acquire(self) -> "WorkdirLock":
        fd = self._open_locked()
        try:
            owner = self._read(fd)
            if owner:
                self.note = (f"note: took over the lock of --workdir {str(self.workdir)!r} from "
                             f"{_describe(owner)}, which ended without releasing it (a crash "
                             f"or a kill)")
            me = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            except OSError:  # a full disk: the lock holds all the same, its owner goes unnamed
                pass
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # ended normally: no lock file (removed while still locked)
        except OSError:
            pass
        finally:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
