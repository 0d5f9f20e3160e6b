"""Blank-out: the importance of a token is the change of the prediction when it is replaced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from attnflow._typing import Array, Namespace

from ._predict import (
    Predict,
    call_model,
    check_batch_size,
    check_replacement,
    read_token_ids,
    resolve_targets,
    result_array,
    row_batches,
    target_probabilities,
)

__all__ = ["BLANK_OUT_SCORES", "LAST_TOKENS", "BlankOutScore", "LastToken", "blank_out"]

BlankOutScore = Literal["drop", "abs", "margin", "abs_margin"]
BLANK_OUT_SCORES: tuple[BlankOutScore, ...] = get_args(BlankOutScore)
LastToken = Literal["blank", "zero"]
LAST_TOKENS: tuple[LastToken, ...] = get_args(LastToken)


def blank_out(
    predict: Predict,
    inputs: Array,
    /,
    *,
    replacement: int,
    target: int | Sequence[int] | Array | None = None,
    positions: int | Sequence[int] | None = None,
    score: BlankOutScore = "drop",
    mask: Array | None = None,
    batch_size: int | None = None,
    last_token: LastToken = "blank",
    xp: Namespace | None = None,
) -> Array:
    r"""Blank-out importance: how much the prediction changes when one token is replaced.

    Each evaluated position :math:`i` of each sequence :math:`x` is replaced by
    `replacement`, one at a time, giving :math:`x^{(i)}`; the importance of token
    :math:`i` for the target class :math:`t` is

    .. math::

        s_i = p_t(x) - p_t(x^{(i)}) \quad (\texttt{"drop"}), \qquad
        s_i = m_t(x) - m_t(x^{(i)}) \quad (\texttt{"margin"}),

    with :math:`m_t = p_t - \max_{c \ne t} p_c` the lead of the target over the best other
    class; ``"abs"`` and ``"abs_margin"`` take absolute values. Abnar & Zuidema (2020, §2)
    replace tokens by UNK and use the probability of the correct class; their code uses
    the mask token and :math:`|\Delta (p_\text{correct} - p_\text{wrong})|`, which is
    ``"abs_margin"`` for two classes.

    Parameters
    ----------
    predict : callable
        ``predict(ids)`` maps a batch of token ids ``(B, n)`` (arrays of the library and
        device of `inputs`) to class probabilities ``(B, C)``, of any array library.
        With `mask`, it is called as ``predict(ids, mask)`` with the matching rows of the
        mask. The copies of all sequences go through it in batches of `batch_size`.
    inputs : array of int, shape (B, n)
        Token ids.
    replacement : int
        The id of the token that replaces each blanked token (UNK, or the mask token).
    target : int, sequence or array of int, optional
        The class to explain, one for all or one per sequence; None (default) takes the
        class the model predicts for each unperturbed sequence.
    positions : int or sequence of int, optional
        The positions to evaluate (negative counts from the end); None evaluates every
        real position.
    score : {"drop", "abs", "margin", "abs_margin"}, default "drop"
        The importance, as above.
    mask : bool array of shape (B, n), optional
        True = real token. Padded positions are not evaluated.
    batch_size : int, optional
        Sequences per call of `predict`; None puts every copy in one call.
    last_token : {"blank", "zero"}, default "blank"
        The last real token of each sequence (the first one before padding): blanked out
        like the others (``"blank"``), or given the score 0 without being evaluated
        (``"zero"``). Abnar & Zuidema's code for Tables 1-2 ends each input with
        ``<eos>`` at the verb position, blanks out positions 0 to n-2 only and appends 0
        for ``<eos>``: ``score="abs"``, the gold class as `target` and
        ``last_token="zero"``.
    xp : namespace, optional
        The array namespace of `inputs`; inferred by default.

    Returns
    -------
    array of shape (B, n)
        The importance of each position, in the library and on the device of `inputs`,
        in the floating dtype `predict` returns. Positions not evaluated (padding, or
        outside `positions`) are NaN.

    Raises
    ------
    ValueError, TypeError
        On bad arguments (before `predict` is called), or when `predict` does not return
        probabilities of shape ``(B, C)``.

    See Also
    --------
    rank_correlation : Compare explanations with these scores.
    comprehensiveness, sufficiency : Remove the most important tokens together.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    A bag-of-words classifier in which token 3 decides the class:

    >>> import numpy as np
    >>> import attnflow
    >>> def predict(ids):
    ...     evidence = 4.0 * (ids == 3).sum(axis=1)
    ...     p = 1 / (1 + np.exp(-evidence + 2))
    ...     return np.stack([1 - p, p], axis=1)
    >>> ids = np.array([[1, 3, 2, 2]])
    >>> attnflow.evaluate.blank_out(predict, ids, replacement=0).round(3)
    array([[0.   , 0.762, 0.   , 0.   ]])
    >>> attnflow.evaluate.blank_out(predict, ids, replacement=0, positions=[1, 2]).round(3)
    array([[  nan, 0.762, 0.   ,   nan]])
    >>> attnflow.evaluate.blank_out(predict, ids, replacement=0, last_token="zero").round(3)
    array([[0.   , 0.762, 0.   , 0.   ]])
    """
    if score not in BLANK_OUT_SCORES:
        msg = f"`score` must be one of {BLANK_OUT_SCORES}; got {score!r}."
        raise ValueError(msg)
    if last_token not in LAST_TOKENS:
        msg = (
            f"`last_token` must be one of {LAST_TOKENS} (blank the last real token out like "
            f"the others, or score it 0 as the paper's code scores `<eos>`); got {last_token!r}."
        )
        raise ValueError(msg)
    given_predict: object = predict
    if not callable(given_predict):
        msg = f"`predict` must be callable (ids -> probabilities); got {type(predict).__name__}."
        raise TypeError(msg)
    replacement = check_replacement(replacement, integer=True)
    batch_size = check_batch_size(batch_size)
    model_inputs = read_token_ids(inputs, mask, xp=xp)
    ids = model_inputs.host
    batch, n = ids.shape
    evaluated = _evaluated_positions(positions, n, batch, model_inputs.mask)
    last = _last_real(n, batch, model_inputs.mask)
    if last_token == "zero":
        evaluated[last] = False
    rows, columns = np.nonzero(evaluated)
    host_mask = model_inputs.mask

    def originals(start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        return ids[start:stop], None if host_mask is None else host_mask[start:stop]

    def blanked(start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        copies = ids[rows[start:stop]].copy()
        copies[np.arange(stop - start), columns[start:stop]] = replacement
        return copies, None if host_mask is None else host_mask[rows[start:stop]]

    base, dtype = call_model(
        predict, row_batches(batch, batch_size, originals), model_inputs, batch
    )
    targets = resolve_targets(target, np.argmax(base, axis=1), base.shape[1])
    values = np.full((batch, n), np.nan)
    if len(rows):
        blanked_probabilities, _ = call_model(
            predict, row_batches(len(rows), batch_size, blanked), model_inputs, len(rows)
        )
        margin = score in ("margin", "abs_margin")
        before = target_probabilities(base, targets, margin=margin)
        after = target_probabilities(blanked_probabilities, targets[rows], margin=margin)
        change = before[rows] - after
        values[rows, columns] = np.abs(change) if score.startswith("abs") else change
    if last_token == "zero":
        values[last] = 0.0
    return result_array(values, model_inputs, dtype)


def _last_real(n: int, batch: int, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows with a real token, and the position of the last real token of each."""
    if mask is None:
        return np.arange(batch if n else 0), np.full(batch if n else 0, n - 1, dtype=np.intp)
    rows = np.flatnonzero(mask.any(axis=1))
    return rows, (n - 1 - np.argmax(mask[rows, ::-1], axis=1)).astype(np.intp)


def _evaluated_positions(
    positions: object, n: int, batch: int, mask: np.ndarray | None
) -> np.ndarray:
    """``(B, n)`` bool: the positions to blank out, real tokens among `positions`."""
    chosen = np.ones(n, dtype=bool)
    if positions is not None:
        items = [positions] if isinstance(positions, int | np.integer) else positions
        if isinstance(positions, bool) or not isinstance(items, Sequence | np.ndarray):
            msg = f"`positions` must be None, an int or a sequence of ints; got {positions!r}."
            raise TypeError(msg)
        chosen = np.zeros(n, dtype=bool)
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int | np.integer):
                msg = f"`positions` must hold ints; got {item!r} in {positions!r}."
                raise TypeError(msg)
            if not -n <= item < n:
                msg = (
                    f"`positions` must lie in [{-n}, {n}) for sequences of {n} tokens; got {item}."
                )
                raise ValueError(msg)
            chosen[item] = True
    evaluated: np.ndarray = np.broadcast_to(chosen, (batch, n))
    return evaluated & mask if mask is not None else evaluated.copy()
