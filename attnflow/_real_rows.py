"""Negative `rows` count from the end of each sequence's real tokens, where a mask is known.

``rows=-1`` means "the last token" to every user. In a left-padded (or unpadded) batch that
is position ``n - 1`` of every sequence; in a right-padded batch the shorter sequences end
earlier, and position ``n - 1`` is padding: its row is all zeros for rollout, a silently
wrong answer. The entry points that know the padding mask (the adapters' ``explain``, the
command line's ``--mask``) resolve negative rows per sequence here: the sequences are
grouped by how many padding tokens follow their last real token, and each group is
explained with its negative rows shifted by that many, so ``-1`` names its last real token.
Non-negative rows are positions, as before.

:func:`group_by_real_end` works on Python integers (the trailing padding counts read from
the mask); :func:`by_real_end` runs a method once for the rows of every group and takes
each sequence's own rows from the result, on any array library.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._host import to_host
from ._namespace import (
    array_device,
    array_namespace,
    enter_boundary,
    is_dask_array,
    values_are_inspectable,
)

__all__ = [
    "RowGroup",
    "by_real_end",
    "from_real_end",
    "group_by_real_end",
    "has_negative_rows",
    "real_end_union",
    "trailing_padding",
]

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RowGroup:
    """Sequences of a batch that share their trailing padding, and their rows.

    Attributes
    ----------
    indices : tuple of int
        The sequences' positions in the batch, in order.
    rows : int or tuple of int
        The rows to explain for them, as non-negative positions: the caller's, negative ones
        counted from the group's last real token (an int stays an int).
    """

    indices: tuple[int, ...]
    rows: int | tuple[int, ...]


def trailing_padding(mask_rows: Sequence[Sequence[bool]]) -> list[int]:
    """Return, per sequence, how many padding tokens follow its last real token.

    Examples
    --------
    >>> from attnflow._real_rows import trailing_padding
    >>> trailing_padding([[True, True, False], [False, True, True], [True, True, True]])
    [1, 0, 0]
    """
    counts = []
    for row in mask_rows:
        real = [i for i, keep in enumerate(row) if keep]
        counts.append(len(row) - 1 - real[-1] if real else 0)
    return counts


def group_by_real_end(
    rows: object, trailing: Sequence[int], n_tokens: int, real: Sequence[int] | None = None
) -> list[RowGroup] | None:
    """Group a batch's sequences so that negative `rows` count from their real tokens' end.

    Parameters
    ----------
    rows : int, sequence of int or None
        The caller's rows (already of a valid type).
    trailing : sequence of int
        Per sequence, the padding tokens after its last real token (:func:`trailing_padding`).
    n_tokens : int
        The batch's sequence length, padding included.
    real : sequence of int, optional
        Per sequence, its real tokens, to refuse a negative row before its first one.

    Returns
    -------
    list of RowGroup or None
        None where nothing changes (no negative row, or no sequence ends in padding): the
        caller explains the batch as it is.

    Raises
    ------
    IndexError
        If a negative row reaches before a sequence's first real token.

    Examples
    --------
    >>> from attnflow._real_rows import group_by_real_end
    >>> group_by_real_end(-1, [0, 2, 0], 5)
    [RowGroup(indices=(0, 2), rows=4), RowGroup(indices=(1,), rows=2)]
    >>> group_by_real_end([0, -1], [1, 1], 5)
    [RowGroup(indices=(0, 1), rows=(0, 3))]
    >>> group_by_real_end(-1, [0, 0], 5) is None  # left padding: -1 is already the last token
    True
    """
    if rows is None:
        return None
    single = isinstance(rows, numbers.Integral) or getattr(rows, "ndim", None) == 0
    try:
        listed = [int(rows)] if single else [int(r) for r in rows]  # type: ignore[call-overload, attr-defined]
    except (TypeError, ValueError):
        return None  # not rows at all: the method's own check names what is wrong
    if isinstance(rows, bool) or any(isinstance(r, bool) for r in ([] if single else rows)):  # type: ignore[attr-defined]
        return None
    if not any(r < 0 for r in listed) or not any(trailing):
        return None
    if real is not None:
        for index, count in enumerate(real):
            for row in listed:
                if row < 0 and -row > count:
                    msg = (
                        f"`rows` {row} counts from the end of the real tokens, but sequence "
                        f"{index} of the batch has {count}; give rows within them."
                    )
                    raise IndexError(msg)
    groups: dict[int, list[int]] = {}
    for index, count in enumerate(trailing):
        groups.setdefault(int(count), []).append(index)
    result = []
    for count, indices in groups.items():
        shifted = tuple(n_tokens + r - count if r < 0 else r for r in listed)
        result.append(RowGroup(tuple(indices), shifted[0] if single else shifted))
    return result


def has_negative_rows(rows: object) -> bool:
    """Return whether `rows` (an int, a sequence of ints or None) holds a negative row.

    Anything else (a bool, a float, an array of another kind) is False: the method's own
    check of `rows` names what is wrong.
    """
    if rows is None or isinstance(rows, bool | str):
        return False
    if isinstance(rows, numbers.Integral) or getattr(rows, "ndim", None) == 0:
        try:
            return bool(int(rows) < 0)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return False
    if not isinstance(rows, Iterable):
        return False
    try:
        return any(_is_negative_int(r) for r in rows)
    except TypeError:
        return False


def _is_negative_int(row: object) -> bool:
    if isinstance(row, bool) or not isinstance(row, numbers.Integral):
        return False
    return int(row) < 0


def by_real_end(compute: Callable[[Any], Any], mask: Any, rows: Any, *, host: bool = False) -> Any:
    """``compute(rows)``, negative `rows` counted from each sequence's last real token.

    With a ``(*batch, n)`` padding `mask` whose sequences end in padding (right padding),
    ``rows=-1`` would name the padding position ``n - 1`` of the shorter sequences. The
    rows each sequence means are resolved (:func:`group_by_real_end`), the batch computed
    once for all of them, and each sequence's own rows taken from the result (an array
    ``(*batch, ..., r, n)``, or a tuple of them such as a named pair). Without a mask,
    negative rows, or padding after the last real token, ``compute(rows)`` as it is.

    A mask whose values cannot be read now (a JAX tracer inside ``jax.jit``, a Dask
    array) is resolved with array operations instead: every row is computed
    (``compute(None)``) and each sequence's rows gathered by a one-hot product, so the
    result equals the eager one at the cost of ``rows=None``. There, a negative row
    before a sequence's first real token gives a row of zeros (no error can be raised on
    values that are not known yet). A `host` method (max-flow), which reads the mask on
    the host anyway, reads a Dask mask here too, and is left to refuse ``jax.jit`` itself.
    """
    if mask is None or not has_negative_rows(rows):
        return compute(rows)
    if getattr(mask, "ndim", 0) < 1:
        return compute(rows)  # not a mask: the method's own check refuses it
    if not values_are_inspectable(mask):
        if not host:
            return _gathered_lazily(compute, mask, rows)
        if not is_dask_array(mask):
            return compute(rows)  # traced: the host method refuses jax.jit itself
    host_mask = np.asarray(to_host(mask, name="mask", keep_dtype=True)).astype(bool)
    batch_shape, n = host_mask.shape[:-1], host_mask.shape[-1]
    listed = host_mask.reshape(-1, n).tolist()
    groups = group_by_real_end(rows, trailing_padding(listed), n, real=[sum(r) for r in listed])
    if groups is None:
        return compute(rows)
    single = isinstance(groups[0].rows, int)
    wanted: dict[int, tuple[int, ...]] = {}
    for group in groups:
        positions = (group.rows,) if isinstance(group.rows, int) else group.rows
        wanted.update(dict.fromkeys(group.indices, positions))
    union = sorted({r for positions in wanted.values() for r in positions})
    picks = [[union.index(r) for r in wanted[index]] for index in range(len(listed))]
    return _each_result(compute(union), lambda full: _picked(full, batch_shape, picks, single))


def _each_result(result: Any, pick: Callable[[Any], Any]) -> Any:
    """Apply `pick` to a result array, or to each array of a tuple (a named pair)."""

    def one(array: Any) -> Any:
        # A TensorFlow result is taken apart on the host and handed back as TensorFlow.
        (converted,), boundary = enter_boundary([array], ["result"])
        return boundary.restore(pick(converted))

    if isinstance(result, tuple):
        return type(result)(*(one(array) for array in result))
    return one(result)


def _picked(full: Any, batch_shape: tuple[int, ...], picks: list[list[int]], single: bool) -> Any:
    """Each sequence's rows of ``full`` ``(*batch, ..., r, n)``, flat index `picks`."""
    xp = array_namespace(full)
    flat = xp.reshape(full, (len(picks), *full.shape[len(batch_shape) :]))
    per_sequence = []
    for index, chosen in enumerate(picks):
        rows = [flat[index, ...][..., position, :] for position in chosen]
        per_sequence.append(rows[0] if single else xp.stack(rows, axis=-2))
    stacked = xp.stack(per_sequence, axis=0)
    return xp.reshape(stacked, (*batch_shape, *stacked.shape[1:]))


def _gathered_lazily(compute: Callable[[Any], Any], mask: Any, rows: Any) -> Any:
    """:func:`by_real_end` for a mask whose values are not known yet (traced or lazy)."""
    xp = array_namespace(mask)
    n = mask.shape[-1]
    single = not isinstance(rows, Iterable)
    listed = [int(rows)] if single else [int(r) for r in rows]
    positions = xp.arange(n, device=array_device(mask))
    real = xp.astype(mask, xp.bool)
    last = xp.max(xp.where(real, positions, xp.full_like(positions, -1)), axis=-1)
    wanted = xp.stack(
        [last + (1 + r) if r < 0 else xp.full_like(last, r) for r in listed], axis=-1
    )  # (*batch, r)
    batch_ndim = mask.ndim - 1

    def pick(full: Any) -> Any:
        inner = array_namespace(full)
        one_hot = inner.astype(wanted[..., None] == positions, full.dtype)  # (*batch, r, n)
        extra = full.ndim - batch_ndim - 2  # a layer axis between batch and rows
        one_hot = inner.reshape(one_hot, (*one_hot.shape[:-2], *(1,) * extra, *one_hot.shape[-2:]))
        chosen = inner.matmul(one_hot, full)
        return chosen[..., 0, :] if single else chosen

    return _each_result(compute(None), pick)


def real_end_union(mask: Any, rows: Any) -> Any:
    """Return the rows :func:`by_real_end` computes for the batch (`rows` where none change).

    For a cost estimate of the call :func:`by_real_end` makes: the union of every
    sequence's resolved rows, or `rows` as given where nothing is resolved (no mask, no
    negative row, no trailing padding, or a mask whose values are not known yet).
    """
    if mask is None or not has_negative_rows(rows) or getattr(mask, "ndim", 0) < 1:
        return rows
    if not values_are_inspectable(mask):
        return rows
    host = np.asarray(to_host(mask, name="mask", keep_dtype=True)).astype(bool)
    listed = host.reshape(-1, host.shape[-1]).tolist()
    groups = group_by_real_end(
        rows, trailing_padding(listed), host.shape[-1], real=[sum(r) for r in listed]
    )
    if groups is None:
        return rows
    resolved = [(g.rows,) if isinstance(g.rows, int) else g.rows for g in groups]
    return sorted({r for positions in resolved for r in positions})


def from_real_end(mask_parameter: str = "mask", *, host: bool = False) -> Callable[[_F], _F]:
    """Make a core function count negative `rows` from each sequence's real end.

    The decorated function is called with the rows each sequence means, resolved from
    its keyword `mask_parameter` by :func:`by_real_end` (`host`: a method that runs on
    the host); without a mask or a negative row, it is called as it is.
    """

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def resolved(*args: Any, **kwargs: Any) -> Any:
            rows, mask = kwargs.get("rows"), kwargs.get(mask_parameter)
            if mask is None or not has_negative_rows(rows):
                return function(*args, **kwargs)
            return by_real_end(
                lambda given: function(*args, **{**kwargs, "rows": given}), mask, rows, host=host
            )

        return resolved  # type: ignore[return-value]

    return decorate
