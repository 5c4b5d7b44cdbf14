"""Byte-level data: no download, no tokenizer files.

Tokens are the bytes of the text (vocab 256); byte 0 ends every document. The default corpus is
the Python standard library's own source files, found at run time (every machine with Python has
them); `--data` takes the user's files, directories or globs instead: directories and globs skip hidden
folders and files (.git, .venv, ...). The model reads bytes, so any file without NUL bytes is
trainable: a file named on its own is taken whenever it has none (a Latin-1 text, say); in what
directories and globs find, binary files (NUL bytes) are skipped and, with the default
encoding "utf-8", so are files that are not UTF-8 (encoding "any", `--data-encoding any`,
takes them). `ByteDataset.summary()` says what was taken, what was skipped and why.

Determinism: the file list is sorted, the document order is a permutation seeded by `seed`, the
stream is packed into fixed windows of seq_len + 1 bytes, the last `eval_fraction` of the windows
is held out for eval, and the training windows are visited in a fresh seeded permutation every
epoch. Batch number s is a pure function of (corpus, seed, s), so the position in the data is
just the number of batches consumed, which the checkpoint stores.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

__all__ = ["ByteDataset", "DataError", "ENCODINGS", "default_corpus_files", "is_text",
           "resolve_files", "scan"]

EOS = 0  # document separator byte
ENCODINGS = ("utf-8", "any")  # which files that directories and globs find count as text


class DataError(ValueError):
    """A user-facing data problem (missing path, empty corpus, corpus too small)."""


def default_corpus_files() -> list[Path]:
    """Every .py file of this interpreter's standard library (not site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not files:
        raise DataError(f"no .py files found under the standard library at {root}; pass --data")
    return sorted(files)


def _walk(root: Path, hidden: list[Path]) -> list[Path]:
    """Files below `root`, not entering hidden folders nor taking hidden files (names starting
    with '.': .git, .venv, .cache, ...), which are appended to `hidden`. Links to folders are
    not followed."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in sorted(dirnames):
            if d.startswith("."):
                hidden.append(here / d)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            (hidden if f.startswith(".") else out).append(here / f)
    return [p for p in out if p.is_file()]


def scan(specs, named: set | None = None) -> tuple[list[Path], list[Path]]:
    """(files, hidden): the files named by `specs` (files, directories, glob patterns) and the
    hidden folders and files that directories passed over. A file named explicitly is taken
    even if hidden (and added to `named` when given). Raises DataError naming the first spec
    that matches nothing."""
    out: set[Path] = set()
    hidden: list[Path] = []
    for spec in specs:
        if not str(spec).strip():
            raise DataError(f"--data {spec!r}: empty path")
        path = Path(os.path.expanduser(spec))
        if path.is_file():
            out.add(path)
            if named is not None:
                named.add(path)
        elif path.is_dir():
            found = _walk(path, hidden)
            if not found:
                raise DataError(f"--data {spec!r}: directory has no files"
                                + (f" (only hidden ones: {len(hidden)})" if hidden else ""))
            out.update(found)
        else:
            # glob's wildcards do not match names starting with '.' (only a pattern that
            # spells the dot does), so globs skip hidden folders and files by themselves.
            found = [Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)]
            found = [p for p in found if p.is_file()]
            if not found:
                raise DataError(f"--data {spec!r}: no such file, directory or matching glob")
            out.update(found)
    return sorted(out), sorted(set(hidden))


def resolve_files(specs) -> list[Path]:
    """Files named by `specs` (see scan)."""
    return scan(specs)[0]


def is_text(data: bytes, encoding: str = "utf-8") -> bool:
    """No NUL bytes (binary files: objects, images, .so, .pyc, ...) and, for encoding "utf-8",
    valid UTF-8."""
    if b"\0" in data:
        return False
    if encoding == "any":
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _names(paths, n=3) -> str:
    shown = ", ".join(p.name for p in paths[:n])
    return shown + (f", ... ({len(paths) - n} more)" if len(paths) > n else "")


class ByteDataset:
    """Packed byte windows with a deterministic train order and a held-out eval split.

    batch(s) -> (inputs, targets), each int32 [batch_size, seq_len]; eval_batches() -> a list of
    such pairs. `fingerprint` identifies the packed corpus (checked when a run resumes).
    """

    def __init__(self, specs=(), *, seq_len: int, batch_size: int, seed: int = 0,
                 max_bytes: int = 16 * 2**20, eval_fraction: float = 0.02,
                 encoding: str = "utf-8"):
        if encoding not in ENCODINGS:
            raise DataError(f"encoding {encoding!r} must be one of {', '.join(ENCODINGS)}")
        named: set[Path] = set()
        if specs:
            files, self.hidden = scan(specs, named)
        else:
            files, self.hidden = default_corpus_files(), []
        self.binary: list[Path] = []  # files of --data with NUL bytes, skipped
        self.not_utf8: list[Path] = []  # found by a directory or glob, not UTF-8: skipped
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        order = np.random.default_rng([seed, 0x5EED]).permutation(len(files))
        chunks, total, digest = [], 0, hashlib.sha256()
        self.n_unread = 0
        for n_seen, i in enumerate(order):
            if total >= max_bytes:
                self.n_unread = len(order) - n_seen
                break
            try:
                data = files[i].read_bytes()
            except OSError as e:
                if specs:
                    raise DataError(f"--data file {str(files[i])!r} is unreadable: {e}") from None
                continue  # the default corpus is best effort
            if specs and not is_text(data, "any"):
                self.binary.append(files[i])
                continue
            if specs and files[i] not in named and not is_text(data, encoding):
                self.not_utf8.append(files[i])
                continue
            data = data[: max_bytes - total] + bytes([EOS])
            chunks.append(data)
            total += len(data)
            digest.update(len(data).to_bytes(8, "little") + data)
        self.binary.sort()
        self.not_utf8.sort()
        if not chunks:
            raise DataError(f"--data {' '.join(map(str, specs))!r}: no text files; skipped "
                            + "; ".join(self._skipped()))
        stream = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        window = seq_len + 1
        n = (len(stream) - 1) // seq_len  # windows overlap by one byte (last target = next input)
        n_eval = max(1, int(n * eval_fraction))
        if n - n_eval < batch_size:
            need = (batch_size + n_eval) * seq_len + 1
            raise DataError(
                f"the corpus has {len(stream)} bytes in {len(chunks)} files: too small for "
                f"{batch_size=} x {seq_len=} plus a held-out split (needs about {need} bytes)")
        starts = np.arange(n) * seq_len
        self._windows = stream[starts[:, None] + np.arange(window)]  # [n, seq_len + 1] uint8
        self.n_train, self.n_eval = n - n_eval, n_eval
        self.n_files, self.n_bytes = len(chunks), len(stream)
        digest.update(f"{seq_len}:{seed}:{n}".encode())
        self.fingerprint = digest.hexdigest()[:16]
        self._perm_epoch, self._perm = -1, None

    def summary(self) -> str:
        """What was taken and what was skipped, in one line."""
        out = f"took {self.n_files} files, {self.n_bytes / 1e6:.1f} MB"
        skipped = self._skipped()
        if skipped:
            out += "; skipped " + " and ".join(skipped)
        if self.n_unread:
            out += f"; {self.n_unread} more files not read (the --max-corpus-mb limit)"
        return out

    def _skipped(self) -> list[str]:
        out = []
        if self.hidden:
            out.append(f"{len(self.hidden)} hidden ({_names(self.hidden)})")
        if self.binary:
            out.append(f"{len(self.binary)} binary (NUL bytes: {_names(self.binary)})")
        if self.not_utf8:
            out.append(f"{len(self.not_utf8)} not UTF-8 ({_names(self.not_utf8)}; "
                       f"--data-encoding any takes them)")
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
            self._perm_epoch = epoch
        return self._perm

    def batch(self, step: int, part: slice = slice(None)):
        """The batch of update number `step` (0-based); `part`: only these of its rows (one
        process's share of a multi-process run, train.distributed), read alone."""
        rows = []
        for p in range(step * self.batch_size, (step + 1) * self.batch_size)[part]:
            epoch, within = divmod(p, self.n_train)
            rows.append(self._order(epoch)[within])
        return self._split(self._windows[np.asarray(rows)])

    def eval_batches(self, count: int, part: slice = slice(None)):
        """`count` fixed held-out batches (the held-out windows, cycled if there are few);
        `part`: only these rows of each."""
        out = []
        for b in range(count):
            rows = (np.arange(self.batch_size)[part] + b * self.batch_size) % self.n_eval + self.n_train
            out.append(self._split(self._windows[rows]))
        return out

    @staticmethod
    def _split(w):
        w = w.astype(np.int32)
        return w[:, :-1], w[:, 1:]
