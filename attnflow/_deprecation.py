"""Renamed keywords and attributes.

The old spelling keeps working for one release, with a :class:`DeprecationWarning` that
names the new one.
"""

from __future__ import annotations

import warnings
from typing import Final, TypeVar

__all__ = [
    "MISSING",
    "REMOVED_IN",
    "Missing",
    "renamed_keyword",
    "warn_deprecated",
    "warn_renamed",
]

T = TypeVar("T")

#: The release that removes the old spellings.
REMOVED_IN: Final = "0.2"


class Missing:
    """The default of a deprecated keyword: tells "not passed" from every real value."""

    def __repr__(self) -> str:
        return "<not given>"


MISSING: Final = Missing()


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is now spelled `new` (same meaning), at the caller's caller."""
    msg = (
        f"`{old}` is renamed `{new}` (same meaning); `{old}` will be removed in attnflow "
        f"{REMOVED_IN}."
    )
    warnings.warn(msg, DeprecationWarning, stacklevel=stacklevel)


def warn_deprecated(old: str, instead: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` goes in the next release, saying what to write `instead`.

    For a spelling that is not a plain rename (another return value, another value of
    the same keyword), where :func:`warn_renamed`'s "same meaning" would not be true.

    Examples
    --------
    >>> import warnings
    >>> from attnflow._deprecation import warn_deprecated
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_deprecated("f()", "call g(), which returns the same pair")
    >>> print(caught[0].message)
    `f()` is deprecated and will be removed in attnflow 0.2: call g(), which returns the same pair.
    """
    msg = f"`{old}` is deprecated and will be removed in attnflow {REMOVED_IN}: {instead}."
    warnings.warn(msg, DeprecationWarning, stacklevel=stacklevel)


def renamed_keyword(old: str, new: str, old_value: object, new_value: T, *, default: T) -> T:
    """Return the value of keyword `new`, taking `old`'s (with a warning) when it was given.

    Passing both, with different values, is refused: one of them would be lost.

    Examples
    --------
    >>> import warnings
    >>> from attnflow._deprecation import MISSING, renamed_keyword
    >>> renamed_keyword("row", "rows", MISSING, 3, default=0)
    3
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     renamed_keyword("row", "rows", 2, 0, default=0)
    2
    >>> print(caught[0].message)
    `row` is renamed `rows` (same meaning); `row` will be removed in attnflow 0.2.
    """
    if old_value is MISSING:
        return new_value
    if new_value not in (default, old_value):
        msg = (
            f"pass `{new}` only (`{old}` is its old name); got {new}={new_value!r} and "
            f"{old}={old_value!r}."
        )
        raise TypeError(msg)
    warn_renamed(old, new, stacklevel=4)
    return old_value  # type: ignore[return-value]  # the caller's type check follows
