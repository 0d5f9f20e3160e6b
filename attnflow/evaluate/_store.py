"""A folder of per-chunk results: what makes a long evaluation resumable.

An evaluation writes one ``chunk-NNNNNN.npz`` per chunk of samples, next to a manifest
(``evaluation.json``) that records the settings, a fingerprint of the data, the identity
of the model and of each method's function. A rerun with the same manifest skips the
chunks already there; a rerun that differs in anything is refused, naming what differs,
rather than mixing results (``force=True`` discards them instead). Each chunk carries its
own identity (the manifest's digest, its number, its samples), its row count and a
SHA-256 of its arrays, all checked when it is read: a chunk copied over another, cut or
otherwise changed is refused by name, never counted. Each file appears whole or not at
all (a temporary file, then an exclusive hard link), an existing file is never replaced
unless forced, and a lock on the folder keeps two runs from writing into it at once.
Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from attnflow._atomic import write_atomically

__all__ = ["ChunkStore", "EvaluationFolderError", "fingerprint"]

MANIFEST = "evaluation.json"
STORE_VERSION = 2
"""Version of the folder's layout, recorded in the manifest as ``"store"``: 2 added the
model's and the methods' identities and the chunks' checksums."""
_LOCK = ".evaluation.lock"
_CHUNK = re.compile(r"^chunk-(\d{6})\.npz$")
_IDENTITY = "__chunk__"
"""The array of a chunk file holding its identity and checksum (a JSON string)."""


class EvaluationFolderError(RuntimeError):
    """The output folder cannot take this evaluation; the message says why and what to do."""


def fingerprint(*arrays: np.ndarray | None) -> str:
    """Return a SHA-256 of the arrays' shapes, dtypes and bytes (None counts as absent)."""
    digest = hashlib.sha256()
    for array in arrays:
        _update(digest, array)
    return digest.hexdigest()


def _update(digest: Any, array: np.ndarray | None) -> None:
    if array is None:
        digest.update(b"none;")
        return
    contiguous = np.ascontiguousarray(array)
    digest.update(f"{contiguous.dtype.str}{contiguous.shape};".encode())
    digest.update(contiguous.tobytes())


def _checksum(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of named arrays: each name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(f"{name};".encode())
        _update(digest, arrays[name])
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
        JSON-serialisable settings, data fingerprint and identities of the model and the
        methods; a folder holding another evaluation's results is refused.
    chunks : sequence of (start, stop)
        The samples of each chunk, by number: what each chunk file must hold.
    force : bool, default False
        Discard the folder's results instead of refusing them when its manifest differs,
        and discard damaged chunks (they are computed again). Files that are not the
        store's own are never removed.
    not_resumable : str, optional
        Why the folder's results cannot be trusted even where its manifest equals
        `settings` (e.g. a model without an identity): an existing evaluation is then
        refused, naming this reason, or discarded with `force`.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        settings: Mapping[str, Any],
        chunks: Sequence[tuple[int, int]],
        *,
        force: bool = False,
        not_resumable: str | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.not_resumable = not_resumable
        self.settings = json.loads(json.dumps({"store": STORE_VERSION, **settings}))
        self.chunks = [(int(start), int(stop)) for start, stop in chunks]
        self.force = force
        text = json.dumps(self.settings, sort_keys=True, separators=(",", ":"))
        self.digest = hashlib.sha256(text.encode()).hexdigest()
        self._lock_file: IO[bytes] | None = None
        self._done: set[int] = set()

    @contextlib.contextmanager
    def open(self) -> Iterator[ChunkStore]:
        """Lock the folder, check (or write) its manifest and its chunks; unlock when done."""
        if self.folder.exists() and not self.folder.is_dir():
            msg = f"output {self.folder} exists and is not a folder; choose another path."
            raise EvaluationFolderError(msg)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._check_manifest()
            for stale in self.folder.glob(".chunk-*.tmp"):
                stale.unlink(missing_ok=True)  # left by a run that was killed mid-write
            self._done = self._check_chunks()
            yield self
        finally:
            self._unlock()

    def done(self) -> set[int]:
        """Return the numbers of the chunks already written (and found intact)."""
        return set(self._done)

    def write(self, number: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Write one chunk's arrays with its identity and checksum (never over a chunk)."""
        path = self._path(number)
        start, stop = self.chunks[number]
        rows = stop - start
        for name, array in arrays.items():
            if np.ndim(array) == 0 or np.shape(array)[0] != rows:
                msg = (
                    f"chunk {number} (samples {start}-{stop - 1}) result {name!r} has shape "
                    f"{np.shape(array)}; expected {rows} rows."
                )
                raise ValueError(msg)
        identity = {
            "evaluation": self.digest,
            "number": number,
            "start": start,
            "stop": stop,
            "rows": rows,
            "sha256": _checksum(arrays),
        }
        saved = {**arrays, _IDENTITY: np.array(json.dumps(identity, sort_keys=True))}
        try:
            write_exclusively(path, lambda file: np.savez(file, **saved))  # type: ignore[arg-type]
        except FileExistsError:
            msg = f"{path} appeared while this run held the folder's lock; it was left as is."
            raise EvaluationFolderError(msg) from None
        self._done.add(number)

    def read(self, number: int) -> dict[str, np.ndarray]:
        """Read one chunk's arrays (never unpickling), checking its identity and checksum.

        Raises
        ------
        EvaluationFolderError
            If the file cannot be read, is another chunk's (or another evaluation's),
            holds another number of rows, or its arrays changed since they were written.
        """
        arrays, problem = self._load(number)
        if problem is not None:
            msg = (
                f"{self._path(number)} {problem}. Move it away (or delete it) and rerun: only "
                "that chunk is computed again; or pass `force=True` to recompute damaged chunks."
            )
            raise EvaluationFolderError(msg)
        return arrays

    # -- internals ------------------------------------------------------------------------
    def _path(self, number: int) -> Path:
        return self.folder / f"chunk-{number:06d}.npz"

    def _load(self, number: int) -> tuple[dict[str, np.ndarray], str | None]:
        """Return the chunk's arrays and None, or what is wrong with it."""
        path = self._path(number)
        if not 0 <= number < len(self.chunks):
            return {}, f"is not one of this evaluation's {len(self.chunks)} chunks"
        from attnflow._arrayio import ArrayFileError, read_arrays
        from attnflow._json_limits import JSONLimitError, load_json

        try:
            # Every header first, then the budget (memory, split bombs), then the data.
            arrays = read_arrays(path)
        except (ArrayFileError, OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            return {}, f"cannot be read ({error}): it was not written by attnflow or was damaged"
        recorded = arrays.pop(_IDENTITY, None)
        try:
            identity = load_json(str(recorded), path, "identity") if recorded is not None else None
        except JSONLimitError:
            identity = None
        if not isinstance(identity, dict):
            return {}, "carries no identity or checksum: it was not written by this store"
        start, stop = self.chunks[number]
        if identity.get("evaluation") != self.digest:
            return {}, "belongs to another evaluation (copied from another folder?)"
        if (identity.get("number"), identity.get("start"), identity.get("stop")) != (
            number,
            start,
            stop,
        ):
            return {}, (
                f"holds chunk {identity.get('number')} (samples {identity.get('start')}-"
                f"{_last(identity.get('stop'))}), not chunk {number} (samples {start}-{stop - 1}):"
                " it was copied over"
            )
        rows = {
            name: np.shape(array)[0] if np.ndim(array) else None for name, array in arrays.items()
        }
        short = sorted(name for name, count in rows.items() if count != stop - start)
        if identity.get("rows") != stop - start or short:
            counts = sorted({str(rows[name]) for name in short}) or [str(identity.get("rows"))]
            return {}, (
                f"holds {'/'.join(counts)} rows where chunk {number} has {stop - start} "
                f"(samples {start}-{stop - 1}): it was cut or changed"
            )
        if _checksum(arrays) != identity.get("sha256"):
            return {}, "does not match its checksum: its arrays changed after it was written"
        return arrays, None

    def _check_chunks(self) -> set[int]:
        """Return the intact chunks; refuse damaged ones, or remove them with `force`."""
        done = set()
        for path in sorted(self.folder.iterdir()):
            match = _CHUNK.match(path.name)
            if match is None:
                continue
            number = int(match.group(1))
            _, problem = self._load(number)
            if problem is None:
                done.add(number)
            elif self.force:
                path.unlink()
            else:
                self.read(number)  # raises, naming the problem
        return done

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
            problem: str | None
            same = False
            try:
                recorded = _read_manifest(manifest)
            except (OSError, UnicodeDecodeError, ValueError) as error:
                problem = f"{manifest} is not an attnflow evaluation manifest ({error})"
            else:
                same = recorded == self.settings
                problem = self.not_resumable if same else _difference(recorded, self.settings)
            if problem is None:
                return
            if same and not self.force:
                msg = (
                    f"{self.folder} holds results that cannot be resumed: {problem}. Pass "
                    "an identity (ModelFunctions(..., identity=...), e.g. a hash of the "
                    "checkpoint) to both runs, use a new folder, or pass `force=True` to "
                    "discard its results."
                )
                raise EvaluationFolderError(msg)
            if not self.force:
                msg = (
                    f"{self.folder} holds the results of another evaluation: {problem}; "
                    "resuming would mix them. Use a new folder, rerun with what its "
                    f"{MANIFEST} records, or pass `force=True` to discard its results."
                )
                raise EvaluationFolderError(msg)
            self._discard()
        unexpected = sorted(p.name for p in self.folder.iterdir() if not p.name.startswith("."))
        if unexpected:
            msg = (
                f"{self.folder} is not empty ({', '.join(unexpected[:3])}"
                f"{', ...' if len(unexpected) > 3 else ''}) and holds no evaluation; choose "
                "a new or empty folder so that nothing in it is overwritten or mixed in."
            )
            raise EvaluationFolderError(msg)
        text = json.dumps(self.settings, indent=2, sort_keys=True) + "\n"
        write_exclusively(self.folder / MANIFEST, lambda file: file.write(text.encode()))

    def _discard(self) -> None:
        """Remove the store's own files (chunks, then the manifest); nothing else."""
        for path in self.folder.iterdir():
            if _CHUNK.match(path.name):
                path.unlink()
        (self.folder / MANIFEST).unlink()


def _last(stop: object) -> object:
    return stop - 1 if isinstance(stop, int) else stop


def _difference(recorded: object, current: Mapping[str, Any]) -> str:
    """Say how a recorded manifest differs from this run's, item by item."""
    if not isinstance(recorded, dict):
        return "its manifest is not a JSON object"
    if recorded.get("store") != current.get("store"):
        return (
            f"it was written by another version of attnflow (folder layout "
            f"{recorded.get('store', 1)}; this one writes {current.get('store')}, which records "
            "the model, the methods' functions and checksums), so its results cannot be "
            "checked against this run"
        )
    parts = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            parts += [
                f"{key} {name!r} ({_pair(old.get(name), new.get(name))})"
                for name in sorted(set(old) | set(new))
                if old.get(name) != new.get(name)
            ]
        else:
            parts.append(f"{key} ({_pair(old, new)})")
    return "it differs in " + "; in ".join(parts)


def _pair(old: object, new: object) -> str:
    """Show a recorded and a current value, from just before where they differ."""
    before, after = _text(old), _text(new)
    limit = 100
    if len(before) > limit or len(after) > limit:
        common = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
            min(len(before), len(after)),
        )
        start = 0 if common < limit - 20 else common - 30  # show where they differ
        before, after = (_cut(text, start, limit) for text in (before, after))
    return f"the folder's: {before}; this run's: {after}"


def _text(value: object) -> str:
    return "none" if value is None else value if isinstance(value, str) else json.dumps(value)


def _cut(text: str, start: int, limit: int) -> str:
    head = "..." if start else ""
    tail = "..." if len(text) > start + limit else ""
    return f"{head}{text[start : start + limit]}{tail}"


def _read_manifest(manifest: Path) -> Any:
    """Return the manifest's JSON, read bounded in size and depth (a hostile folder's is not)."""
    from attnflow._json_limits import MAX_JSON_CHARS, load_json

    with manifest.open("rb") as file:
        raw = file.read(4 * MAX_JSON_CHARS + 1)
    return load_json(raw.decode("utf-8"), manifest, "manifest")
