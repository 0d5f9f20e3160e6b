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

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RowGroup", "by_real_end", "group_by_real_end", "trailing_padding"]


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


def by_real_end(compute: Callable[[Any], Any], mask: Any, rows: Any) -> Any:
    """``compute(rows)``, negative `rows` counted from each sequence's last real token.

    With a ``(batch, n)`` padding `mask` whose sequences end in padding (right padding),
    ``rows=-1`` would name the padding position ``n - 1`` of the shorter sequences. The
    rows each sequence means are resolved (:func:`group_by_real_end`),
    the batch computed once for all of them, and each sequence's own rows taken from the
    result. Without a mask, negative rows, or padding after the last real token, and with
    a traced mask (inside ``jax.jit``, whose values are unknown), ``compute(rows)`` as it
    is.
    """
    if mask is None or rows is None:
        return compute(rows)
    import numpy as np

    from ._host import to_host
    from ._namespace import values_are_inspectable

    if not values_are_inspectable(mask):
        # Traced (inside jax.jit): where each sequence ends is not known until it runs, so
        # negative rows stay positions of the padded length, as documented.
        return compute(rows)
    host = np.asarray(to_host(mask, name="mask", keep_dtype=True)).astype(bool)
    if host.ndim != 2:
        return compute(rows)
    listed = host.tolist()
    groups = group_by_real_end(
        rows, trailing_padding(listed), host.shape[1], real=[sum(r) for r in listed]
    )
    if groups is None:
        return compute(rows)
    single = isinstance(groups[0].rows, int)
    wanted: dict[int, tuple[int, ...]] = {}
    for group in groups:
        positions = (group.rows,) if isinstance(group.rows, int) else group.rows
        wanted.update(dict.fromkeys(group.indices, positions))
    union = sorted({r for positions in wanted.values() for r in positions})
    from ._namespace import array_namespace, enter_boundary

    # A TensorFlow result is taken apart on the host and handed back as TensorFlow.
    (full,), boundary = enter_boundary([compute(union)], ["result"])
    join = array_namespace(full).stack
    per_sequence = []
    for index in range(host.shape[0]):
        picked = [full[index][..., union.index(r), :] for r in wanted[index]]
        per_sequence.append(picked[0] if single else join(picked, axis=-2))
    return boundary.restore(join(per_sequence, axis=0))
