"""Checks shared by the integrations, run before any model call."""

from __future__ import annotations

import operator

__all__ = ["check_layer_choice"]


def check_layer_choice(layers: object) -> None:
    """Check a `layers` option that must give one map per position: "last" or one index.

    Parameters
    ----------
    layers : object
        The value to check.

    Raises
    ------
    ValueError
        For ``"all"`` or another string.
    TypeError
        For anything else that is not an integer.

    Examples
    --------
    >>> check_layer_choice("last")
    >>> check_layer_choice(-1)
    >>> check_layer_choice("all")
    Traceback (most recent call last):
    ...
    ValueError: `layers` must be "last" or one layer index; got 'all'. The integrations report one map per position: call them once per layer, or use attnflow.rollout(..., layers="all") directly.
    """
    fix = (
        "The integrations report one map per position: call them once per layer, or use "
        'attnflow.rollout(..., layers="all") directly.'
    )
    if isinstance(layers, str):
        if layers == "last":
            return
        msg = f'`layers` must be "last" or one layer index; got {layers!r}. {fix}'
        raise ValueError(msg)
    try:
        operator.index(layers)  # type: ignore[arg-type]
        is_index = not isinstance(layers, bool)
    except TypeError:
        is_index = False
    if not is_index:
        msg = (
            f'`layers` must be "last" or one layer index; got {layers!r} of type '
            f"{type(layers).__name__}. {fix}"
        )
        raise TypeError(msg)
