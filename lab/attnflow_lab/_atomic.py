"""Writing a file atomically, never replacing one unless asked (a copy of attnflow's writer).

The bytes go to a temporary file in the target's folder, which then becomes the target,
so the target never holds a partial file. Without `replace` that last step is exclusive
(a hard link, else ``O_EXCL``): of two writers racing for one name exactly one wins. The
temporary file is removed on every path, errors and KeyboardInterrupt included.

:func:`write_folder_atomically` does the same for a folder of files that belong
together (a trained model and its training record).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomically", "write_folder_atomically"]


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
    return 0o666 & ~_umask()


def write_folder_atomically(
    path: str | os.PathLike[str],
    write: Callable[[Path], object],
    *,
    replace: bool,
    exists: Callable[[Path], Exception],
) -> Path:
    """Fill a folder through `write` and publish it whole; refuse one unless `replace`.

    `write` fills a temporary folder beside `path` (same parent, so the rename stays on
    one file system), which is then renamed to `path`: a reader, or a run after a kill,
    finds every file `write` wrote or no folder at all. With `replace`, an existing
    folder is first renamed aside and removed once the new one is in place; a kill
    between the two renames leaves no folder at `path` (and a hidden ``.NAME.*.old``
    folder), never a mix of the two.

    Parameters
    ----------
    path : str or os.PathLike
        The folder to publish.
    write : callable
        Writes the folder's files into the (empty, existing) folder it is given.
    replace : bool
        Replace an existing folder (or file) at `path` instead of refusing it.
    exists : callable
        Builds the error raised when `path` exists and `replace` is False; raised before
        `write` is called.

    Returns
    -------
    Path
        The folder written.
    """
    target = Path(path)
    if not replace and os.path.lexists(target):
        raise exists(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    aside: Path | None = None
    published = False
    try:
        write(staged)
        staged.chmod(0o777 & ~_umask())  # mkdtemp makes it private; mkdir would not
        if os.path.lexists(target):
            if not replace:  # appeared while `write` ran
                raise exists(target)
            aside = Path(
                tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent)
            )
            target.rename(aside / target.name)
        try:
            staged.rename(target)  # onto a free name: the folder appears whole
        except OSError as error:
            if isinstance(error, FileExistsError) or error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise exists(target) from None
            raise
        published = True
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # gone after the rename; else partial
        if aside is not None:
            if not published and not os.path.lexists(target):
                with contextlib.suppress(OSError):  # put the old folder back
                    (aside / target.name).rename(target)
            shutil.rmtree(aside, ignore_errors=True)
    return target


def _umask() -> int:
    """Return the process's umask (reading it means setting it: it is put back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask
