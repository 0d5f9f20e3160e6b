"""A command's output files, all written or none: staged, then published together.

A command that writes several files (a page and its data, a demo's page and figures) must
not leave some of them behind when it fails half-way, or is interrupted. :class:`Staged`
writes each file to a temporary name beside its target, and only once every file is
written gives them their names; on any failure before that (KeyboardInterrupt included)
the temporary files are removed, and so are files already published by this run and any
folder it created. Without `force` each name is claimed exclusively
(:func:`attnflow._atomic._publish_exclusively`): an existing file is never replaced.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

from ._atomic import _publish_exclusively

__all__ = ["Staged"]


class Staged:
    """Files staged under temporary names and published together, or not at all.

    Parameters
    ----------
    force : bool
        Replace existing files; otherwise an existing name is refused by `exists`.
    exists : callable
        Builds the error raised for a target that exists (without `force`).

    Examples
    --------
    >>> import pathlib, tempfile
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> with Staged(force=False, exists=FileExistsError) as staged:
    ...     _ = staged.write(folder / "a.txt", lambda file: file.write(b"a"))
    ...     published = staged.publish()
    >>> sorted(p.name for p in folder.iterdir())
    ['a.txt']
    >>> with Staged(force=False, exists=FileExistsError) as staged:
    ...     _ = staged.write(folder / "b.txt", lambda file: file.write(b"b"))
    ...     raise RuntimeError("failed")
    Traceback (most recent call last):
    RuntimeError: failed
    >>> sorted(p.name for p in folder.iterdir())  # nothing of the failed run is left
    ['a.txt']
    """

    def __init__(self, *, force: bool, exists: Callable[[Path], Exception]) -> None:
        self._force = force
        self._exists = exists
        self._staged: list[tuple[Path, Path]] = []
        self._published: list[Path] = []
        self._folders: list[Path] = []
        self._done = False

    def folder(self, path: Path) -> None:
        """Create `path` (and missing parents); removed again if the run fails, when empty."""
        missing = []
        for folder in (path, *path.parents):
            if folder.exists():
                break
            missing.append(folder)
        path.mkdir(parents=True, exist_ok=True)
        self._folders += missing  # deepest first

    def path(self, target: Path) -> Path:
        """Create an empty temporary file beside `target` (same suffix), to write by name."""
        if not self._force and os.path.lexists(target):
            raise self._exists(target)
        descriptor, name = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=f".tmp{target.suffix}"[:16], dir=target.parent
        )
        os.close(descriptor)
        temporary = Path(name)
        self._staged.append((temporary, target))
        return temporary

    def write(self, target: Path, write: Callable[[BinaryIO], object]) -> Path:
        """Stage `target`'s content, written through `write`; return the temporary file."""
        temporary = self.path(target)
        with temporary.open("wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        return temporary

    def publish(self) -> list[Path]:
        """Give every staged file its name; on failure undo what this run published."""
        for temporary, target in self._staged:
            temporary.chmod(0o644)  # mkstemp makes it private
            if self._force:
                temporary.replace(target)
            else:
                _publish_exclusively(temporary, target, self._exists)
            self._published.append(target)
        self._done = True
        return [target for _, target in self._staged]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for temporary, _ in self._staged:
            temporary.unlink(missing_ok=True)  # after a hard link the temporary name is left
        if self._done:
            return
        for target in self._published:
            with contextlib.suppress(OSError):
                target.unlink()
        for folder in self._folders:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
