"""The limit on a flow call's work: estimated single-core seconds, checked before any solving.

`max_seconds` is compared with ``FlowCost.estimated_seconds``, the cost model of the compiled
engine (``attnflow._flow``). It replaces `max_work`, a count of edge visits (max-flows times
graph edges) from the igraph engine, which stays one release with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Final

from ._deprecation import MISSING, REMOVED_IN, Missing

__all__ = ["DEFAULT_MAX_SECONDS", "check_max_seconds", "deprecated_max_work", "refuse_above"]

DEFAULT_MAX_SECONDS: Final = 600.0
"""Estimated single-core seconds above which a flow call refuses to start by default: ten
minutes."""


def check_max_seconds(max_seconds: object) -> None:
    """Refuse a `max_seconds` that is not a positive number (inf) or None."""
    if max_seconds is not None and (
        # `not > 0`, not `<= 0`: NaN compares false both ways and would disable the limit.
        isinstance(max_seconds, bool)
        or not isinstance(max_seconds, int | float)
        or not max_seconds > 0
    ):
        msg = (
            "`max_seconds` must be a positive number of seconds or None (inf or None for "
            f"no limit); got {max_seconds!r}."
        )
        raise ValueError(msg)


def deprecated_max_work(
    max_work: float | Missing | None, max_seconds: float | None, *, stacklevel: int = 3
) -> float | Missing | None:
    """Return `max_work` when it was given (with a DeprecationWarning), else `MISSING`.

    Passing both, `max_seconds` other than its default, is refused: one would be lost.
    The warning points `stacklevel` frames up (3: the caller of the public function that
    calls this one).

    Examples
    --------
    >>> from attnflow._deprecation import MISSING
    >>> from attnflow._work_limit import deprecated_max_work
    >>> deprecated_max_work(MISSING, 600.0) is MISSING
    True
    """
    if max_work is MISSING:
        return MISSING
    if max_seconds != DEFAULT_MAX_SECONDS:
        msg = (
            "pass `max_seconds` only (`max_work`, in edge visits, is its deprecated "
            f"predecessor); got max_seconds={max_seconds!r} and max_work={max_work!r}."
        )
        raise TypeError(msg)
    msg = (
        "`max_work` (a limit in edge visits of the old igraph engine) is replaced by "
        "`max_seconds` (a limit on the estimated single-core time); `max_work` will be "
        f"removed in attnflow {REMOVED_IN}. `max_work=None` is `max_seconds=None`."
    )
    warnings.warn(msg, DeprecationWarning, stacklevel=stacklevel)
    return max_work


def refuse_above(
    seconds: float, described: str, max_seconds: float | None, *, what: str, fix: str
) -> None:
    """Raise ValueError if the estimate `seconds` is above `max_seconds` (None: no limit).

    `described` is the estimate in words (``str(FlowCost)``), `what` the call ("this
    attention flow"), `fix` the sentences that say what to change.
    """
    if max_seconds is not None and seconds > max_seconds:
        msg = f"{what} would take {described}, above `max_seconds`={max_seconds:.3g}. {fix}"
        raise ValueError(msg)
