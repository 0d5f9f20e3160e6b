"""Reading and writing arrays for the command line: ``.npy``, ``.npz``, ``.safetensors``.

Nothing here ever unpickles. Every array's header is read first (shape, dtype, size) and
checked, against what the caller accepts and against the memory available, before its data
is read, so a decompression bomb is refused without being inflated. Outputs are written
atomically (a temporary file in the target folder, then a rename) and never replace an
existing file, a dangling symbolic link included, unless asked to: without `force` the
last step is exclusive (a hard link, else ``O_EXCL``), so of two writers exactly one wins.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from . import _array_headers, _atomic
from ._array_headers import ArrayEntry, ArrayFileError, ArrayHeader, open_entries

__all__ = [
    "ArrayFileError",
    "ArrayHeader",
    "check_budget",
    "read_array",
    "read_arrays",
    "read_header",
    "read_selected",
    "write_atomically",
    "write_npz",
]

Accept = Callable[[ArrayHeader], None]
"""Raises (ArrayFileError, ValueError, TypeError) for an array the caller cannot use."""


def _available_memory() -> int | None:
    """Bytes of memory available to a new allocation, or None where it cannot be told."""
    try:
        with Path("/proc/meminfo").open(encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_header(path: Path, header: ArrayHeader, accept: Accept | None) -> None:
    """Check a header before its data is read: what the caller accepts."""
    if accept is not None:
        try:
            accept(header)
        except ArrayFileError:
            raise
        except (ValueError, TypeError, IndexError) as error:
            msg = f"{path}: array {header.name!r} of shape {header.shape}: {error}"
            raise ArrayFileError(msg) from None


def check_budget(path: str | os.PathLike[str], headers: Collection[ArrayHeader]) -> None:
    """Refuse, from their headers alone, arrays that would not fit once inflated.

    The one budget every ``.npy``/``.npz``/``.safetensors`` reader of attnflow applies to
    the arrays it is about to read, after reading all their headers and before inflating
    any of them:

    * each array, and all of them together, must fit in the memory available now
      (``MemAvailable``);
    * no compressed ``.npz`` member may inflate to more than
      :data:`~attnflow._array_headers.BOMB_SIZE` bytes at more than
      :data:`~attnflow._array_headers.BOMB_RATIO` times its compressed size, and neither
      may the compressed members together: a bomb split into many members each under the
      limit (8 members of 250 MiB of zeros, 2 MB on disk) is refused as one.

    Parameters
    ----------
    path : path
        The file, named in the error.
    headers : collection of ArrayHeader
        The arrays to be read.

    Raises
    ------
    ArrayFileError
        One line naming the file, the array (or "all arrays together"), its size and the
        budget it exceeds.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._arrayio import ArrayHeader, check_budget
    >>> small = ArrayHeader("a", (2, 3), np.dtype("f4"), "float32")
    >>> check_budget("a.npz", [small])
    >>> bomb = ArrayHeader("b", (2**28,), np.dtype("f8"), "float64", compressed=2**20)
    >>> check_budget("b.npz", [bomb])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    attnflow._array_headers.ArrayFileError: b.npz: array 'b' declares ...
    """
    file = Path(path)
    available = _available_memory()
    total = sum(header.nbytes for header in headers)
    for header in headers:
        if available is not None and header.nbytes > available:
            msg = (
                f"{file}: array {header.name!r} declares shape {header.shape} and dtype "
                f"{header.dtype}, {header.nbytes / 2**30:.3g} GiB once loaded, more than the "
                f"{available / 2**30:.3g} GiB of memory available; split the input into "
                "smaller files"
            )
            raise ArrayFileError(msg)
        header.check_inflation(file)
    if len(headers) < 2:
        return
    if available is not None and total > available:
        msg = (
            f"{file}: its {len(headers)} arrays together declare {total / 2**30:.3g} GiB once "
            f"loaded, more than the {available / 2**30:.3g} GiB of memory available; split the "
            "input into smaller files"
        )
        raise ArrayFileError(msg)
    packed = [header for header in headers if header.compressed is not None]
    inflated = sum(header.nbytes for header in packed)
    compressed = sum(header.compressed or 0 for header in packed)
    if inflated > _array_headers.BOMB_SIZE and inflated > _array_headers.BOMB_RATIO * compressed:
        msg = (
            f"{file}: its {len(packed)} compressed arrays together inflate to "
            f"{inflated / 2**20:,.0f} MiB from {compressed / 2**20:,.2g} MiB "
            f"({inflated // max(compressed, 1):,} times): refused as a likely decompression "
            "bomb split into members. If the arrays are genuine, save them uncompressed "
            "(numpy.savez, not savez_compressed)"
        )
        raise ArrayFileError(msg)


def _pick(entries: Mapping[str, ArrayEntry], key: str | None, path: Path, default: str) -> str:
    names = sorted(entries)
    if path.suffix.lower() == ".npy":
        if key is not None:
            msg = f"{path} holds one array: --key applies to .npz and .safetensors"
            raise ArrayFileError(msg)
        return "array"
    if key is not None:
        if key not in entries:
            msg = f"{path} has no array named {key!r}; it holds {names}"
            raise ArrayFileError(msg)
        return key
    if default in entries:
        return default
    if len(names) == 1:
        return names[0]
    msg = f"{path} holds several arrays {names}; choose one with --key"
    raise ArrayFileError(msg)


def read_header(path: str | os.PathLike[str], *, key: str | None, default: str) -> ArrayHeader:
    """Read what one array of a file declares (shape, dtype, stored dtype), not its data.

    Parameters
    ----------
    path : path
        The ``.npy``, ``.npz`` or ``.safetensors`` file.
    key, default : str or None, str
        Which array, as for :func:`read_array`.

    Returns
    -------
    ArrayHeader

    Raises
    ------
    ArrayFileError
        On a missing, unreadable, malformed, pickled or ambiguous file.
    """
    file = Path(path)
    entries = open_entries(file)
    return entries[_pick(entries, key, file, default)].header


def read_arrays(
    path: str | os.PathLike[str], *, accept: Accept | None = None
) -> dict[str, np.ndarray]:
    """Read every array of a ``.npz`` or ``.safetensors`` file (``.npy``: one, "array").

    Every header is checked (by `accept`, then against the memory available) before any
    data is read.

    Parameters
    ----------
    path : path
        The file.
    accept : callable, optional
        Called with each array's :class:`ArrayHeader`; raises for an array the caller
        cannot use.

    Returns
    -------
    dict of str to ndarray

    Raises
    ------
    ArrayFileError
        On a missing, unreadable, malformed, pickled or refused file.
    """
    file = Path(path)
    entries = open_entries(file)
    for entry in entries.values():
        _check_header(file, entry.header, accept)
    check_budget(file, [entry.header for entry in entries.values()])
    return {name: entry.load() for name, entry in entries.items()}


def read_array(
    path: str | os.PathLike[str],
    *,
    key: str | None,
    default: str,
    accept: Accept | None = None,
) -> np.ndarray:
    """Read one array from a ``.npy``, ``.npz`` or ``.safetensors`` file, never unpickling.

    Its header is checked (by `accept`, then against the memory available) before its data
    is read; the file's other arrays are not read.

    Parameters
    ----------
    path : path
        The file.
    key : str or None
        The array's name in an ``.npz`` or ``.safetensors`` file; by default `default`
        if present, else the only array.
    default : str
        The name looked for when `key` is None.
    accept : callable, optional
        Called with the array's :class:`ArrayHeader`; raises for an array the caller
        cannot use.

    Returns
    -------
    ndarray

    Raises
    ------
    ArrayFileError
        On a missing, unreadable, malformed, pickled, ambiguous or refused file.
    """
    file = Path(path)
    entries = open_entries(file)
    entry = entries[_pick(entries, key, file, default)]
    _check_header(file, entry.header, accept)
    check_budget(file, [entry.header])
    return entry.load()


def read_selected(
    path: str | os.PathLike[str],
    *,
    required: Collection[str],
    optional: Collection[str] = (),
    check: Callable[[Mapping[str, ArrayHeader]], None] | None = None,
    why: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Read some named arrays of a ``.npz`` or ``.safetensors`` file, headers checked first.

    Every header is read, the required names looked for, and the headers of the arrays
    wanted (`required` and those of `optional` present) checked together by `check`
    (shapes against each other: a mask against its attention), then their total size
    against the memory available, before a byte of data is read. Other arrays in the file
    are never read.

    Parameters
    ----------
    path : path
        The file.
    required, optional : collection of str
        The names that must be in the file, and those read if present.
    check : callable, optional
        Called with the wanted headers by name; raises ``ValueError`` or ``TypeError``
        for arrays the caller cannot use.
    why : mapping of str to str, optional
        What a required array is for, said when it is missing.

    Returns
    -------
    dict of str to ndarray
        The wanted arrays by name.

    Raises
    ------
    ArrayFileError
        On a missing, unreadable, malformed, pickled or refused file, or a required array
        it lacks; one line naming the file.
    """
    file = Path(path)
    entries = open_entries(file)
    missing = [name for name in required if name not in entries]
    if missing:
        name = missing[0]
        reason = f" ({why[name]})" if why and name in why else ""
        msg = f"{file} has no array named {name!r}{reason}; it holds {sorted(entries)}"
        raise ArrayFileError(msg)
    wanted = [*required, *(name for name in optional if name in entries)]
    headers = {name: entries[name].header for name in wanted}
    if check is not None:
        try:
            check(headers)
        except (ValueError, TypeError, IndexError) as error:
            msg = f"{file}: {error}"
            raise ArrayFileError(msg) from None
    check_budget(file, list(headers.values()))
    return {name: entries[name].load() for name in wanted}


def write_atomically(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, force: bool
) -> Path:
    """Write a file through `write` atomically; refuse to replace a file unless `force`.

    The bytes go to a temporary file in the target's folder, which then becomes the
    target, so the target never holds a partial file. Without `force` that last step is
    exclusive: of two writers racing for one name exactly one wins, and the other gets the
    "exists" error. A symbolic link at the target counts as a file even when dangling. The
    temporary file is removed on every path, errors and KeyboardInterrupt included (the
    writer is :func:`attnflow._atomic.write_atomically`).

    Returns
    -------
    Path
        The file written.

    Raises
    ------
    ArrayFileError
        If the file exists and `force` is False, or its folder does not exist.
    """
    target = Path(path)
    if not force and os.path.lexists(target):
        raise _exists(target)
    if not target.parent.is_dir():
        msg = f"folder {target.parent} does not exist"
        raise ArrayFileError(msg)
    return _atomic.write_atomically(target, write, replace=force, exists=_exists)


def _exists(target: Path) -> ArrayFileError:
    return ArrayFileError(f"{target} exists; pass --force to replace it")


def write_npz(
    path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], *, force: bool
) -> Path:
    """Write `arrays` to an ``.npz`` file atomically; refuse to replace a file unless `force`.

    Returns
    -------
    Path
        The file written.

    Raises
    ------
    ArrayFileError
        If the name does not end in ``.npz``, the file exists and `force` is False, or
        its folder does not exist.
    """
    target = Path(path)
    if target.suffix.lower() != ".npz":
        msg = f"output {target} must end in .npz"
        raise ArrayFileError(msg)
    return write_atomically(
        target,
        lambda file: np.savez(file, **arrays),  # type: ignore[arg-type]
        force=force,
    )
