"""Row normalisation, the one place where attention rows are made to sum to one."""

from __future__ import annotations

from ._namespace import array_device
from ._typing import Array, Namespace

__all__ = ["normalize_rows"]


def normalize_rows(
    attention: Array,
    xp: Namespace,
    *,
    valid_rows: Array | None = None,
    first_row: int | None = None,
    rows: tuple[int, ...] | None = None,
) -> Array:
    """Divide each row of `attention` by its sum, over the last axis, keeping dimensions.

    A row with no mass cannot be normalised. When its query is a real token it becomes a
    self-attention row (the token attends to itself, which is what the residual path
    carries); when its query is padded (`valid_rows` False) it stays all zero, so padded
    positions carry no attribution. A row whose sum is NaN (unvalidated input) stays NaN:
    it is not empty, and turning it into self-attention would hide the bad values.

    Parameters
    ----------
    attention : array, shape (..., n, n)
        Non-negative weights, rows = queries.
    xp : namespace
        The array namespace of `attention`.
    valid_rows : array of bool, shape broadcastable to (..., n, 1), optional
        True where the query is a real token. None means every query is real.
    first_row : int, optional
        `attention` is the block of rows ``first_row, first_row + 1, ...`` of square
        ``(..., n, n)`` matrices (a block of a blocked pass): an empty real row becomes
        its own position's self-attention row. None: `attention` holds whole matrices.
    rows : tuple of int, optional
        `attention` holds rows ``rows`` (in that order) of square ``(..., n, n)``
        matrices (the rows a row chain reads); as `first_row`, for any positions.

    Returns
    -------
    array, shape (..., n, n)
        Rows summing to one (real tokens) or zero (padded tokens), same dtype and device.
    """
    sums = xp.sum(attention, axis=-1, keepdims=True)
    has_mass = sums > 0
    # Divide by 1 where the row is empty so that no 0/0 NaN is ever produced.
    safe = xp.where(has_mass, sums, xp.ones_like(sums))
    normalised = attention / safe
    n_rows, n = attention.shape[-2], attention.shape[-1]
    whole = first_row is None and rows is None
    if whole and n_rows != n:
        return normalised  # cross-attention has no self to fall back on: empty rows stay 0
    empty = sums == 0  # not `~has_mass`: a NaN sum is not an empty row
    empty = empty if valid_rows is None else (empty & valid_rows)
    device = array_device(attention)
    if whole:
        eye = xp.eye(n, dtype=attention.dtype, device=device)
    else:  # those rows of the identity (not `eye(k=...)`: Dask loses its chunks)
        if rows is not None:
            own = xp.reshape(xp.asarray(rows, device=device), (-1, 1))
        else:
            assert first_row is not None  # `whole` is False
            own = xp.arange(first_row, first_row + n_rows, device=device)[:, None]
        eye = xp.astype(own == xp.arange(n, device=device)[None, :], attention.dtype)
    return xp.where(empty, eye, normalised)
