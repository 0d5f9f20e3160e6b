r"""Rank a known source position among the prompt's positions: the ground truth's measure.

For prompts whose answer has a known source position (:mod:`._llm_tasks`), an attribution of
the answer (a score per prompt token for the last position) should rank that position
first. :func:`competing_positions` says which positions compete; :func:`source_ranks`
computes the rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnflow._host import to_host
from attnflow._namespace import array_device, array_namespace, enter_boundary
from attnflow._typing import Array
from attnflow._validation import describe

__all__ = ["competing_positions", "source_ranks"]


def competing_positions(
    n: int, /, *, explained: int = -1, context: tuple[int, int] | None = None
) -> np.ndarray:
    """Mark the prompt positions that compete for rank 1: all but the first and the explained.

    Position 0 is left out because a causal LM uses its first token as an attention sink
    (SmolLM2's tokenizer adds no BOS, so the first word plays that part), and a source is
    never there by construction; the explained position (the last, whose next token is
    the answer) is left out because attributions give it its own residual stream. With
    `context`, only the context's positions compete: the query after the context (the
    repeated words, the asked key, the question) says *which* context token to use and is
    not a candidate source, as in context attribution (ContextCite, Cohen-Wang et al.
    2024, arXiv 2409.00729).

    Parameters
    ----------
    n : int
        Number of prompt tokens (>= 3).
    explained : int, default -1
        The explained position (negative counts from the end).
    context : tuple of int, optional
        ``(start, stop)``: only positions ``start <= j < stop`` compete (``TaskTokens.context``).

    Returns
    -------
    ndarray of bool, shape (n,)
        True for the positions that compete for the first rank.

    Examples
    --------
    >>> from attnflow.evaluate._llm_ranks import competing_positions
    >>> competing_positions(5)
    array([False,  True,  True,  True, False])
    >>> competing_positions(5, context=(0, 3))
    array([False,  True,  True, False, False])
    """
    size: object = n
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 3:
        msg = f"`n` must be an int >= 3 (a first token, a candidate and the explained one); got {n!r}."
        raise ValueError(msg)
    position: object = explained
    if isinstance(position, bool) or not isinstance(position, int | np.integer):
        msg = f"`explained` must be an int position; got {explained!r}."
        raise TypeError(msg)
    if not -n <= explained < n:
        msg = f"`explained` must be a position in [-{n}, {n}); got {explained}."
        raise IndexError(msg)
    competing = np.ones(n, dtype=bool)
    if context is not None:
        bounds = tuple(context)
        if len(bounds) != 2 or not all(isinstance(b, int | np.integer) for b in bounds):
            msg = f"`context` must be (start, stop) ints or None; got {context!r}."
            raise TypeError(msg)
        if not 0 <= bounds[0] < bounds[1] <= n:
            msg = f"`context` must satisfy 0 <= start < stop <= n = {n}; got {context!r}."
            raise ValueError(msg)
        competing[: bounds[0]] = False
        competing[bounds[1] :] = False
    competing[0] = False
    competing[explained % n] = False
    return competing


def source_ranks(
    scores: Array,
    sources: np.ndarray | Sequence[int],
    /,
    *,
    explained: int = -1,
    contexts: Sequence[tuple[int, int] | None] | None = None,
) -> Array:
    r"""Rank of each item's source position in its scores, among the competing positions.

    .. math::

        \operatorname{rank} = 1 + \#\{\, j \in C,\ j \ne s : x_j \ge x_s \,\},

    with :math:`x` the scores, :math:`s` the source and :math:`C` the competing positions
    (:func:`competing_positions`: all but the first and the explained). Ties count against
    the source, so a constant score never ranks it first. hit@1 is ``rank == 1``.

    Parameters
    ----------
    scores : array of shape (B, ..., n)
        Attributions, one per prompt token (e.g. one rollout row, or one per layer with
        ``(B, layers, n)``). Any array library; NaN is refused.
    sources : array or sequence of int, shape (B,)
        The source position of each item, a competing position.
    explained : int, default -1
        The explained position, left out of the competition.
    contexts : sequence of (start, stop) or None, optional
        Per item, the context positions that compete (``TaskTokens.context``); None (or a
        None entry): the whole prompt.

    Returns
    -------
    array of int64, shape (B, ...)
        Ranks from 1 (best) to ``n - 2``, in the namespace and on the device of `scores`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate._llm_ranks import source_ranks
    >>> scores = np.array([[0.9, 0.1, 0.5, 0.2, 0.8], [0.3, 0.3, 0.3, 0.1, 0.0]])
    >>> source_ranks(scores, [2, 1])
    array([1, 2])

    Only the context competes with ``contexts``: position 3 (a query token) outranks the
    source 2 over the whole prompt, not within the context ``(0, 3)``:

    >>> scores = np.array([[0.9, 0.1, 0.5, 0.7, 0.8]])
    >>> source_ranks(scores, [2]), source_ranks(scores, [2], contexts=[(0, 3)])
    (array([2]), array([1]))
    """
    (converted,), boundary = enter_boundary([scores], ["scores"])
    if getattr(converted, "shape", None) is None or len(converted.shape) < 2:
        msg = f"`scores` must be an array of shape (B, ..., n); got {describe(scores)}."
        raise ValueError(msg)
    host = to_host(converted, name="scores").astype(np.float64)
    if np.isnan(host).any():
        msg = "`scores` holds NaN; a rank is undefined."
        raise ValueError(msg)
    batch, n = host.shape[0], host.shape[-1]
    spans = [None] * batch if contexts is None else list(contexts)
    if len(spans) != batch:
        msg = (
            f"`contexts` must hold one (start, stop) or None per item ({batch}); got {len(spans)}."
        )
        raise ValueError(msg)
    competing = np.stack([competing_positions(n, explained=explained, context=c) for c in spans])
    positions = np.asarray(sources)
    if positions.shape != (batch,) or positions.dtype.kind not in "iu":
        msg = f"`sources` must hold one int position per item, shape ({batch},); got {describe(sources)}."
        raise ValueError(msg)
    clipped = np.clip(positions, 0, n - 1)
    if not competing[np.arange(batch), clipped].all() or (positions >= n).any():
        msg = (
            f"`sources` must be competing positions (1 .. n - 2 = {n - 2}, inside the context, "
            f"not the explained one); got {positions.tolist()}."
        )
        raise ValueError(msg)
    flat = host.reshape(batch, -1, n)
    own = np.take_along_axis(flat, positions[:, None, None], axis=-1)
    others = competing[:, None, :] & (np.arange(n) != positions[:, None, None])
    ranks = 1 + np.sum(others & (flat >= own), axis=-1)
    result = ranks.reshape(host.shape[:-1]).astype(np.int64)
    # Counted on the host; handed back in the caller's namespace and device, as int64.
    xp = array_namespace(converted)
    back = xp.asarray(result, device=array_device(converted))
    return boundary.restore(back)
