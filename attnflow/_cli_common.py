"""What every ``attnflow`` command shares.

The program's name, the paper it cites, the usage error, and the terminal's bars.

It sits below :mod:`attnflow._cli` and every subcommand module, so the subcommands never
import the dispatcher that loads them (no import cycle).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TextIO

__all__ = ["PAPER", "PROG", "UsageError", "bar", "can_encode", "has_module", "output_path"]

PROG = "attnflow"
PAPER = (
    'S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020, '
    "https://arxiv.org/abs/2005.00928"
)

_FULL_BLOCK = "\u2588"
_EIGHTH_BLOCKS = "\u258f\u258e\u258d\u258c\u258b\u258a\u2589"  # 1/8 ... 7/8


class UsageError(Exception):
    """A bad command line; reported in one line with exit status 2."""


def output_path(flag: str, value: str, suffix: str, *, force: bool) -> Path:
    """Check an output file option before any work: its suffix, no overwrite, its folder."""
    path = Path(value)
    if path.suffix.lower() != suffix:
        msg = f"{flag} must end in {suffix}; got {path.name!r}"
        raise UsageError(msg)
    if os.path.lexists(path) and not force:
        msg = f"{path} exists; pass --force to replace it"
        raise UsageError(msg)
    if not path.parent.is_dir():
        msg = f"{flag} {value}: folder {path.parent} does not exist; create it first"
        raise UsageError(msg)
    return path


def has_module(name: str) -> bool:
    """Whether `name` can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


def bar(fraction: float, width: int, *, unicode: bool) -> str:
    """Draw a horizontal bar ``fraction * width`` characters long (eighths in Unicode)."""
    fraction = min(max(fraction, 0.0), 1.0)
    if not unicode:
        return "#" * round(fraction * width)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    return _FULL_BLOCK * full + (_EIGHTH_BLOCKS[rest - 1] if rest else "")


def can_encode(text: str, stream: TextIO) -> bool:
    """Whether `stream` can write `text` (block characters on a non-UTF-8 console)."""
    try:
        text.encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True
