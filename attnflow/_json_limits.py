"""JSON read from files attnflow did not write itself: bounded in size and in depth.

Python's :func:`json.loads` recurses once per level of nesting, so 100,000 nested brackets
(800 KB) raise a bare ``RecursionError``, and it holds any amount of text it is given (a
50-million-character prompt). Metadata read back from a file (an explanation's, a
generation's, an evaluation folder's manifest and chunk identities) is parsed here: its
size and its depth are checked first, without recursion, and a refusal is one line
naming the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_JSON_CHARS", "MAX_JSON_DEPTH", "JSONLimitError", "load_json"]

MAX_JSON_CHARS = 16 * 2**20
"""The most characters of metadata JSON read from a file (16 Mi: a 128k-token context's
tokens and text take about 2 Mi)."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of objects and lists accepted (attnflow writes 4 levels at most)."""

_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


class JSONLimitError(ValueError):
    """Metadata JSON that is too large, too deep or not JSON; its message is one line."""


def _depth(text: str) -> int:
    """Return the deepest nesting of brackets outside strings, counted without recursion."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    opening = (steps == ord("[")) | (steps == ord("{"))
    return int(np.cumsum(np.where(opening, 1, -1)).max())


def load_json(text: str, path: str | Path, what: str = "metadata") -> Any:
    """Parse `text`, JSON read from `path`, refusing it when too large or too deep.

    Parameters
    ----------
    text : str
        The JSON text.
    path : str or Path
        The file it came from, named in the error.
    what : str
        What the text is ("metadata", "manifest"), named in the error.

    Returns
    -------
    object
        The parsed value.

    Raises
    ------
    JSONLimitError
        If `text` has more than :data:`MAX_JSON_CHARS` characters, nests deeper than
        :data:`MAX_JSON_DEPTH` levels, or is not JSON: one line naming the file.

    Examples
    --------
    >>> from attnflow._json_limits import load_json
    >>> load_json('{"tokens": ["a", "b"]}', "e.npz")
    {'tokens': ['a', 'b']}
    >>> load_json("[" * 100_000 + "]" * 100_000, "e.npz")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    attnflow._json_limits.JSONLimitError: e.npz: its metadata nests 100,000 levels deep, ...
    """
    if len(text) > MAX_JSON_CHARS:
        msg = (
            f"{path}: its {what} is {len(text):,} characters of JSON, more than the "
            f"{MAX_JSON_CHARS:,} attnflow reads; it was not written by attnflow or was altered"
        )
        raise JSONLimitError(msg)
    depth = _depth(text)
    if depth > MAX_JSON_DEPTH:
        msg = (
            f"{path}: its {what} nests {depth:,} levels deep, more than the {MAX_JSON_DEPTH} "
            "attnflow reads; it was not written by attnflow or was altered"
        )
        raise JSONLimitError(msg)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        msg = f"{path}: its {what} is not JSON ({str(error).splitlines()[0]})"
        raise JSONLimitError(msg) from None
