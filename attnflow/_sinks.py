"""What a decoder's views leave out: its attention sinks and the explained position itself.

A causal LM parks the attention its heads do not need on a few positions, the *attention
sinks* (Xiao et al. 2023), nearly always the first one; every composed method then puts
most of its mass there, whatever the text says. The views of :func:`explain_text` and
:func:`explain_generation` leave the sinks and the explained (predicting) position out of
their colour scale and of every "strongest sources" list; the scores keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._namespace import array_namespace

__all__ = ["SINK_SHARE", "drop_self", "find_sinks", "sink_note", "sink_shares", "top_sources"]

#: A position is a sink when the attention it receives, averaged over layers, heads and
#: the queries after it, reaches this share (Gu et al. 2024, "When Attention Sink Emerges in
#: Language Models", take a head to sink on a token from a mean score of 0.3).
SINK_SHARE = 0.3


def sink_shares(attentions: Any, /) -> Any:
    r"""Mean attention share each position receives from the queries after it.

    .. math:: s_k = \frac{1}{L H (n - 1 - k)} \sum_{l, h} \sum_{i > k} A_{l,h}[i, k]

    (0 for the last position, which no later query sees).

    Parameters
    ----------
    attentions : array of shape (..., n, n)
        One sequence's attention weights, rows = queries: ``(layers, heads, n, n)``,
        ``(layers, n, n)`` with heads fused by their mean, or ``(n, n)``.

    Returns
    -------
    array of shape (n,)
        :math:`s_k`, in the input's namespace and floating dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._sinks import sink_shares
    >>> a = np.array([[1.0, 0.0, 0.0], [0.8, 0.2, 0.0], [0.6, 0.1, 0.3]])
    >>> sink_shares(a).round(3).tolist()
    [0.7, 0.1, 0.0]
    """
    xp = array_namespace(attentions)
    if attentions.ndim < 2 or attentions.shape[-1] != attentions.shape[-2]:
        msg = f"`attentions` must have shape (..., n, n); got {tuple(attentions.shape)}."
        raise ValueError(msg)
    n = int(attentions.shape[-1])
    fused = xp.reshape(attentions, (-1, n, n))
    mean = xp.mean(fused, axis=0)
    below = xp.sum(xp.tril(mean, k=-1), axis=0)  # the queries after each key
    counts = xp.astype(n - 1 - xp.arange(n, device=getattr(mean, "device", None)), mean.dtype)
    return xp.where(counts > 0, below / xp.where(counts > 0, counts, 1), 0)


def find_sinks(attentions: Any, /, *, threshold: float = SINK_SHARE) -> tuple[int, ...]:
    """Positions of one causal sequence that are attention sinks.

    The rule: the first position, and every position whose mean attention share from the
    queries after it (:func:`sink_shares`, over layers and heads) is at least `threshold`.
    The last position is never one (no query after it).

    Parameters
    ----------
    attentions : array of shape (..., n, n)
        One sequence's attention weights (see :func:`sink_shares`).
    threshold : float, default 0.3
        The mean share that marks a sink, in (0, 1].

    Returns
    -------
    tuple of int
        The sinks' positions, ascending; position 0 first.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._sinks import find_sinks
    >>> a = np.array(
    ...     [[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.6, 0.2, 0], [0.2, 0.5, 0.1, 0.2]]
    ... )
    >>> find_sinks(a)
    (0, 1)
    """
    given: object = threshold
    if isinstance(given, bool) or not isinstance(given, int | float) or not 0 < threshold <= 1:
        msg = f"`threshold` must be a share in (0, 1]; got {threshold!r}."
        raise ValueError(msg)
    shares = sink_shares(attentions)
    n = int(shares.shape[0])
    return tuple(k for k in range(n) if k == 0 or float(shares[k]) >= threshold)


def sink_note(tokens: Sequence[str], sinks: Sequence[int], threshold: float = SINK_SHARE) -> str:
    """Return the sentence a page shows to say which sinks it left out, and by which rule.

    Examples
    --------
    >>> from attnflow._sinks import sink_note
    >>> sink_note(["The", " cat"], [0])  # doctest: +ELLIPSIS
    "Attention sinks left out of the colour scale and of the strongest sources: 'The' (0). ..."
    """
    named = ", ".join(f"{tokens[k]!r} ({k})" for k in sinks if 0 <= k < len(tokens))
    return (
        f"Attention sinks left out of the colour scale and of the strongest sources: {named}. "
        "A sink is the first position, or a position that receives a mean attention share of "
        f"at least {threshold:g} from the queries after it (over layers and heads); its score "
        "is kept beside it."
    )


def top_sources(values: Any, /, *, count: int, leave_out: Sequence[int] = ()) -> list[int]:
    """Return the `count` positions with the largest values, leaving `leave_out` aside.

    Ties keep the earlier position first.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._sinks import top_sources
    >>> top_sources(np.array([0.9, 0.05, 0.03, 0.02]), count=2, leave_out=[0])
    [1, 2]
    """
    order = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))
    left = {int(i) for i in leave_out}
    return [i for i in order if i not in left][:count]


def drop_self(scores: Any, rows: int | Sequence[int] | None, /, *, renormalize: bool) -> Any:
    """Zero each explained row's score at its own position; optionally renormalise the rows.

    Parameters
    ----------
    scores : array
        ``(..., n)`` for an int `rows`, ``(..., r, n)`` for ``r`` rows, ``(..., n, n)``
        for None (all rows).
    rows : int, sequence of int or None
        The explained positions (negative from the end).
    renormalize : bool
        Divide each row by its sum over the other positions (for methods whose rows are
        shares: raw attention, rollout, flow, the value-aware rollouts), as ``exclude``
        does; rows that sum to zero are kept at zero.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._sinks import drop_self
    >>> drop_self(np.array([0.2, 0.3, 0.5]), -1, renormalize=True).tolist()
    [0.4, 0.6, 0.0]
    """
    xp = array_namespace(scores)
    n = int(scores.shape[-1])
    positions = xp.arange(n, device=getattr(scores, "device", None))
    if rows is None:
        own = positions[:, None] == positions[None, :]
    elif isinstance(rows, int):
        own = positions == rows % n
    else:
        chosen = xp.asarray([int(r) % n for r in rows], device=getattr(scores, "device", None))
        own = chosen[:, None] == positions[None, :]
    out = xp.where(own, xp.zeros_like(scores), scores)
    if renormalize:
        total = xp.sum(out, axis=-1, keepdims=True)
        out = xp.where(total > 0, out / xp.where(total > 0, total, 1), out)
    return out
