"""Which output rows a call explains, decided once at the entry and carried as one value.

A caller's `rows` is None (every output position), an int (one position, whose result
has no row axis) or a sequence of ints (a block of rows). :func:`check_rows` (in
``_validation``) reads it once into :class:`Rows`. The maths below the entry keeps the row
axis throughout, reading only :attr:`Rows.index`, and the result takes its public shape
once, at the end, with :meth:`Rows.squeeze`: no function in between asks again whether the
caller gave an int.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._typing import Namespace

__all__ = ["Rows", "identity_rows", "take_rows"]


@dataclass(frozen=True)
class Rows:
    """The checked `rows` of a call.

    Parameters
    ----------
    index : tuple of int or None
        The output positions, non-negative, in the caller's order; None for every position.
    single : bool
        The caller gave one int: the result has no row axis (``(..., n)``, not
        ``(..., 1, n)``).

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._rows import Rows
    >>> matrices = np.arange(9.0).reshape(3, 3)
    >>> Rows((2,), single=True).select(matrices, np)
    array([6., 7., 8.])
    >>> Rows((2, 0)).select(matrices, np)
    array([[6., 7., 8.],
           [0., 1., 2.]])
    >>> Rows().positions(3)
    (0, 1, 2)
    """

    index: tuple[int, ...] | None = None
    single: bool = False

    def positions(self, n: int) -> tuple[int, ...]:
        """Return the explained positions of `n` tokens, in output order."""
        return tuple(range(n)) if self.index is None else self.index

    def take(self, matrices: Any, xp: Namespace) -> Any:
        """Take the selected rows (axis -2) of ``(..., n, n)`` matrices, keeping the row axis."""
        return take_rows(matrices, self.index, xp)

    def squeeze(self, result: Any) -> Any:
        """Give a result ``(..., r, n)`` its public shape: ``(..., n)`` for one int."""
        return result[..., 0, :] if self.single else result

    def select(self, matrices: Any, xp: Namespace) -> Any:
        """Take the selected rows of ``(..., n, n)`` matrices, in the public shape."""
        if self.single and self.index is not None:
            return matrices[..., self.index[0], :]
        return self.take(matrices, xp)


def take_rows(matrices: Any, index: tuple[int, ...] | None, xp: Namespace) -> Any:
    """Rows `index` (axis -2) of ``(..., n, n)`` matrices, ``(..., r, n)``; all for None."""
    if index is None:
        return matrices
    if len(index) == 1:
        return matrices[..., index[0] : index[0] + 1, :]
    # Basic indexing and a stack, not `take`: Dask's `take` with an array index reports
    # wrong chunk shapes, and the rows are few.
    return xp.stack([matrices[..., row, :] for row in index], axis=-2)


def identity_rows(
    n: int,
    index: tuple[int, ...] | None,
    *,
    keys: Any | None,
    dtype: Any,
    device: Any,
    xp: Namespace,
) -> Any:
    """Rows `index` of the ``n x n`` identity (every row for None), zero on padded tokens.

    What the residual path carries: each position keeps itself. `keys` (bool, True = real
    token, broadcastable to ``(*batch, 1, n)``) zeroes the padded tokens' columns; the
    result is ``(*batch | (), r, n)``.
    """
    if index is None:
        unit_rows = xp.eye(n, dtype=dtype, device=device)
    else:
        # Compared with the positions, not rows of `eye(n)`: no n x n matrix for a few rows.
        wanted = xp.reshape(xp.asarray(index, device=device), (-1, 1))
        unit_rows = xp.astype(wanted == xp.arange(n, device=device), dtype)
    if keys is None:
        return unit_rows
    return xp.where(keys, unit_rows, xp.zeros_like(unit_rows))
