"""A folder of per-chunk results: what makes a long evaluation resumable.

An evaluation writes one ``chunk-NNNNNN.npz`` per chunk of samples, next to a manifest
(``evaluation.json``) that records the settings and a fingerprint of the data. A rerun
with the same settings and data skips the chunks already there; a rerun with different
ones is refused rather than mixing results. Each file appears whole or not at all (a
temporary file, then an exclusive hard link), an existing file is never replaced, and a
lock on the folder keeps two runs from writing into it at once. Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from attnflow._atomic import write_atomically

__all__ = ["ChunkStore", "EvaluationFolderError", "fingerprint"]

MANIFEST = "evaluation.json"
_LOCK = ".evaluation.lock"
_CHUNK = re.compile(r"^chunk-(\d{6})\.npz$")


class EvaluationFolderError(RuntimeError):
    """The output folder cannot take this evaluation; the message says why and what to do."""


def fingerprint(*arrays: np.ndarray | None) -> str:
    """Return a SHA-256 of the arrays' shapes, dtypes and bytes (None counts as absent)."""
    digest = hashlib.sha256()
    for array in arrays:
        if array is None:
            digest.update(b"none;")
            continue
        contiguous = np.ascontiguousarray(array)
        digest.update(f"{contiguous.dtype.str}{contiguous.shape};".encode())
        digest.update(contiguous.tobytes())
    return digest.hexdigest()


def write_exclusively(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` whole (temporary file, then an exclusive rename), mode 0o644.

    Raises
    ------
    FileExistsError
        If `path` exists (a dangling symbolic link included).
    """
    write_atomically(path, write, replace=False, exists=_exists)


def _exists(path: Path) -> FileExistsError:
    return FileExistsError(errno.EEXIST, "File exists", str(path))


class ChunkStore:
    """Per-chunk results of one evaluation in `folder` (created if missing).

    Parameters
    ----------
    folder : path
        Where the results go.
    settings : mapping
        JSON-serialisable settings and data fingerprint; a folder holding another
        evaluation's results is refused.
    """

    def __init__(self, folder: str | os.PathLike[str], settings: Mapping[str, Any]) -> None:
        self.folder = Path(folder)
        self.settings = json.loads(json.dumps(dict(settings)))  # normalised, JSON-only
        self._lock_file: IO[bytes] | None = None

    @contextlib.contextmanager
    def open(self) -> Iterator[ChunkStore]:
        """Lock the folder and check (or write) its manifest; unlock when done."""
        if self.folder.exists() and not self.folder.is_dir():
            msg = f"output {self.folder} exists and is not a folder; choose another path."
            raise EvaluationFolderError(msg)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._check_manifest()
            for stale in self.folder.glob(".chunk-*.tmp"):
                stale.unlink(missing_ok=True)  # left by a run that was killed mid-write
            yield self
        finally:
            self._unlock()

    def done(self) -> set[int]:
        """Return the numbers of the chunks already written."""
        return {int(m.group(1)) for p in self.folder.iterdir() if (m := _CHUNK.match(p.name))}

    def write(self, number: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Write one chunk's arrays (never over an existing chunk)."""
        path = self.folder / f"chunk-{number:06d}.npz"
        try:
            write_exclusively(path, lambda file: np.savez(file, **arrays))  # type: ignore[arg-type]
        except FileExistsError:
            msg = f"{path} appeared while this run held the folder's lock; it was left as is."
            raise EvaluationFolderError(msg) from None

    def read(self, number: int) -> dict[str, np.ndarray]:
        """Read one chunk's arrays (never unpickling)."""
        path = self.folder / f"chunk-{number:06d}.npz"
        try:
            with np.load(path, allow_pickle=False) as loaded:
                return {name: np.asarray(loaded[name]) for name in loaded.files}
        except (OSError, ValueError) as error:
            msg = (
                f"{path} cannot be read ({error}); it was not written by attnflow or was "
                "damaged. Move it away and rerun: only that chunk is computed again."
            )
            raise EvaluationFolderError(msg) from None

    # -- internals ------------------------------------------------------------------------
    def _lock(self) -> None:
        import fcntl  # POSIX; imported here so that the module imports everywhere

        handle = (self.folder / _LOCK).open("ab")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            handle.close()
            if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                msg = (
                    f"another evaluation is writing to {self.folder} right now; wait for it "
                    "to finish (its chunks are then reused) or choose another folder."
                )
                raise EvaluationFolderError(msg) from None
            raise
        self._lock_file = handle

    def _unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the lock, also when the process dies
            self._lock_file = None

    def _check_manifest(self) -> None:
        manifest = self.folder / MANIFEST
        if manifest.exists():
            try:
                recorded = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError) as error:
                msg = f"{manifest} is not an attnflow evaluation manifest ({error})."
                raise EvaluationFolderError(msg) from None
            if recorded != self.settings:
                changed = sorted(
                    key
                    for key in set(recorded) | set(self.settings)
                    if recorded.get(key) != self.settings.get(key)
                )
                msg = (
                    f"{self.folder} holds the results of another evaluation (it differs in "
                    f"{', '.join(changed)}); resuming would mix them. Use a new folder, or "
                    "rerun with the settings and data recorded in its evaluation.json."
                )
                raise EvaluationFolderError(msg)
            return
        unexpected = sorted(p.name for p in self.folder.iterdir() if not p.name.startswith("."))
        if unexpected:
            msg = (
                f"{self.folder} is not empty ({', '.join(unexpected[:3])}"
                f"{', ...' if len(unexpected) > 3 else ''}) and holds no evaluation; choose "
                "a new or empty folder so that nothing in it is overwritten or mixed in."
            )
            raise EvaluationFolderError(msg)
        text = json.dumps(self.settings, indent=2, sort_keys=True) + "\n"
        write_exclusively(manifest, lambda file: file.write(text.encode()))
