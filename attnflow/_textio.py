"""Reading a small text file given on the command line, bounded and never blocking.

``--tokens /dev/zero`` would read until memory runs out, and a FIFO would block the command
forever. :func:`read_text_file` reads regular files only, refuses one larger than a limit
before reading it, and opens without blocking (a FIFO swapped in after the check is still
refused, by the open file's own status).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["TEXT_LIMIT", "TextFileError", "read_text_file"]

TEXT_LIMIT = 64 * 2**20
"""The largest text file read (64 MiB): a token list or a sentence, not a corpus."""


class TextFileError(ValueError):
    """A text file that cannot be read; its message is one line naming the file and option."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_text_file(path: str | os.PathLike[str], *, option: str, limit: int | None = None) -> str:
    """Read a UTF-8 text file of at most `limit` bytes; refuse anything but a regular file.

    Parameters
    ----------
    path : path
        The file.
    option : str
        The option that named it (``--tokens``), for the message.
    limit : int, optional
        The most bytes read; :data:`TEXT_LIMIT` by default.

    Returns
    -------
    str

    Raises
    ------
    TextFileError
        On a missing file, a FIFO, device, socket or folder, a file over `limit` bytes, or
        one that is not UTF-8; the message names the file and `option`.

    Examples
    --------
    >>> read_text_file("/dev/zero", option="--tokens")
    Traceback (most recent call last):
    ...
    attnflow._textio.TextFileError: --tokens: /dev/zero is a character device, not a text file; give a regular file
    """
    file = Path(path)
    limit = TEXT_LIMIT if limit is None else limit
    try:
        status = file.stat()  # never blocks, a FIFO included
    except OSError as error:
        msg = f"{option}: cannot read {file} ({error.strerror or error})"
        raise TextFileError(msg) from None
    if not stat.S_ISREG(status.st_mode):
        msg = f"{option}: {file} is {_kind(status.st_mode)}, not a text file; give a regular file"
        raise TextFileError(msg)
    if status.st_size > limit:
        msg = (
            f"{option}: {file} holds {status.st_size:,} bytes, more than the {limit:,} a text "
            "file here may hold; is it the right file?"
        )
        raise TextFileError(msg)
    try:
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        msg = f"{option}: cannot read {file} ({error.strerror or error})"
        raise TextFileError(msg) from None
    with os.fdopen(descriptor, "rb") as stream:
        if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):  # swapped since the check
            msg = f"{option}: {file} is not a regular file; give a regular file"
            raise TextFileError(msg)
        data = stream.read(limit + 1)
    if len(data) > limit:
        msg = f"{option}: {file} holds more than the {limit:,} bytes a text file here may hold"
        raise TextFileError(msg)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        msg = f"{option}: {file} is not UTF-8 text ({error.reason} at byte {error.start})"
        raise TextFileError(msg) from None
