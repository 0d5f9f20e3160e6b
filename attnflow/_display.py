"""What the display functions accept: scores and tokens checked and copied to the host.

Shared by :mod:`attnflow.plot` (matplotlib figures) and :mod:`attnflow.html` (pages with
no plotting library), so that the HTML view never imports the matplotlib module. Scores
may come from any array library attnflow supports, TensorFlow included; they are copied to
the host as float64 NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._host import to_host
from ._namespace import (
    _tensorflow_to_numpy,
    is_array_api_obj,
    is_dask_array,
    is_tensorflow_tensor,
    values_are_inspectable,
)

__all__ = ["FloatArray", "as_numpy", "check_finite", "check_patch_grid", "check_tokens"]

FloatArray = NDArray[np.float64]


def as_numpy(x: Any, name: str) -> FloatArray:
    """Copy `x` (any supported array library, or nested sequences) to float64 NumPy."""
    if isinstance(x, np.ndarray):
        values: Any = x
    elif is_tensorflow_tensor(x):
        values = _tensorflow_to_numpy(x, name)
    elif is_array_api_obj(x):
        if not values_are_inspectable(x) and not is_dask_array(x):
            msg = (
                f"`{name}` has no values here (it is traced, e.g. inside `jax.jit`); "
                "plotting needs concrete values. Plot outside the compiled function."
            )
            raise TypeError(msg)
        return to_host(x, name=name)
    else:
        values = x
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        msg = f"`{name}` must be an array of numbers; got {type(x).__name__}: {exc}"
        raise TypeError(msg) from exc


def check_finite(values: FloatArray, name: str) -> None:
    """Refuse NaN and infinite values in `values`, the array called `name`."""
    if not np.isfinite(values).all():
        bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
        msg = f"`{name}` must be finite; it has {bad} NaN or infinite value(s)."
        raise ValueError(msg)


def check_tokens(tokens: Sequence[str], n: int, what: str) -> list[str]:
    """`tokens` as a list of `n` strings; `what` names the array whose last axis has n."""
    given: object = tokens  # checked at run time whatever the annotation says
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        msg = (
            f"`tokens` must be a sequence of {n} strings (one per token); got "
            f"{type(given).__name__}."
        )
        raise TypeError(msg)
    labels: list[str] = []
    for index, token in enumerate(given):
        if not isinstance(token, str):
            msg = f"`tokens` must hold strings; tokens[{index}] is {type(token).__name__}."
            raise TypeError(msg)
        labels.append(token)
    if len(labels) != n:
        msg = (
            f"`tokens` has {len(labels)} entries but `{what}` has {n} tokens on its last axis; "
            "pass one label per token (padding included, or slice both)."
        )
        raise ValueError(msg)
    return labels


def check_patch_grid(grid: object) -> tuple[int, int]:
    """`grid`, an image's patch grid ``(rows, cols)``, as two positive Python ints.

    The one check of the shape of a grid, for figures, views and explanations; each
    checks the number of cells against its own scores.
    """
    if (
        isinstance(grid, str | bytes)
        or not isinstance(grid, Sequence)
        or len(grid) != 2
        or not all(
            isinstance(side, int | np.integer) and not isinstance(side, bool) and side > 0
            for side in grid
        )
    ):
        msg = (
            "`grid` must be a pair of positive ints (rows, cols): the image's height and "
            "width over the patch size, e.g. grid=(14, 14) for a ViT-B/16 at 224 px; got "
            f"{grid!r}."
        )
        raise ValueError(msg)
    return int(grid[0]), int(grid[1])
