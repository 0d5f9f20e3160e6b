"""Writing a file atomically, never replacing one unless asked.

The one writer behind :func:`attnflow._arrayio.write_atomically` (the command line's
arrays, pages and figures), :meth:`attnflow.html.TokenView.save` (pages), the reports of
``attnflow evaluate`` (which replace the last run's), its resumable chunk store, and the
experiments' saved models. The bytes go to
a temporary file in the target's folder, which then becomes the target, so the target never
holds a partial file. Without `replace` that last step is exclusive (a hard link, else
``O_EXCL``): of two writers racing for one name exactly one wins. A symbolic link at the
target counts as a file even when dangling. The temporary file is removed on every path,
errors and KeyboardInterrupt included.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomically"]


def write_atomically(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    *,
    replace: bool,
    exists: Callable[[Path], Exception],
    mode: int | None = 0o644,
) -> Path:
    """Write a file through `write` atomically; refuse to replace a file unless `replace`.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write.
    write : callable
        Writes the content to the binary file it is given.
    replace : bool
        Replace an existing file (a plain rename) instead of refusing it.
    exists : callable
        Builds the error raised when the target exists and `replace` is False.
    mode : int or None, default 0o644
        The file's permissions: readable by everyone by default (pages, figures, reports);
        None gives the mode ``open()`` would, ``0o666`` less the umask (saved models).

    Returns
    -------
    Path
        The file written.
    """
    target = Path(path)
    if not replace and os.path.lexists(target):
        raise exists(target)
    descriptor, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    temporary = Path(name)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        temporary.chmod(_open_mode() if mode is None else mode)  # mkstemp makes it private
        if replace:
            temporary.replace(target)
        else:
            _publish_exclusively(temporary, target, exists)
    finally:
        # After a link the temporary name is left over; after a rename it is gone.
        temporary.unlink(missing_ok=True)
    return target


def _publish_exclusively(
    temporary: Path, target: Path, exists: Callable[[Path], Exception]
) -> None:
    """Give `temporary` the name `target` unless `target` exists (atomically, no race)."""
    try:
        os.link(temporary, target)  # fails if anything, a dangling link too, has the name
    except FileExistsError:
        raise exists(target) from None
    except OSError:
        pass  # no hard links here (some network or FAT file systems): claim with O_EXCL
    else:
        return
    try:
        claim = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise exists(target) from None
    os.close(claim)
    try:
        temporary.replace(target)  # over the empty file this writer just claimed
    except BaseException:
        with contextlib.suppress(OSError):
            target.unlink()
        raise


def _open_mode() -> int:
    """``0o666`` less the process's umask: the mode ``open()`` gives a new file."""
    umask = os.umask(0)  # reading the umask means setting it; put it back at once
    os.umask(umask)
    return 0o666 & ~umask
