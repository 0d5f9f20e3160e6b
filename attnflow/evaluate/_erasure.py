"""Erasure metrics: remove what an explanation ranks highest and watch the prediction.

ERASER comprehensiveness and sufficiency at fixed fractions of the tokens (with AOPC, their
mean over the fractions), and deletion and insertion curves over every step, for token
sequences or image patches. All of them order the units (tokens or patches) by an
explanation's scores, replace a prefix of that order, and call the model on the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from attnflow._host import to_host
from attnflow._namespace import enter_boundary
from attnflow._typing import Array, Namespace
from attnflow._validation import describe

from ._predict import (
    ModelInputs,
    Predict,
    call_model,
    check_batch_size,
    check_replacement,
    read_inputs,
    read_token_ids,
    resolve_targets,
    result_array,
    row_batches,
    target_probabilities,
)

__all__ = [
    "ERASER_FRACTIONS",
    "PerturbationCurve",
    "comprehensiveness",
    "deletion",
    "insertion",
    "sufficiency",
]

ERASER_FRACTIONS = (0.01, 0.05, 0.1, 0.2, 0.5)
"""The bins of DeYoung et al. (2020): 1, 5, 10, 20 and 50 % of the tokens."""


@dataclass(frozen=True)
class PerturbationCurve:
    """A deletion or insertion curve per sample, and the area under it.

    Parameters
    ----------
    fractions : array of shape (S + 1,)
        The fraction of units (tokens or patches) deleted or inserted at each step,
        from 0 to 1.
    probabilities : array of shape (B, S + 1)
        The probability of the target class at each step.
    area : array of shape (B,)
        The area under the curve (trapezoidal rule over `fractions`): low is good for
        deletion, high is good for insertion.

    See Also
    --------
    deletion, insertion : Compute it.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> predict = lambda ids: np.stack([1 - (ids == 3).any(1), (ids == 3).any(1)], 1) * 1.0
    >>> curve = attnflow.evaluate.deletion(predict, np.array([[3, 1]]), np.array([[1.0, 0.0]]), replacement=0)
    >>> curve.fractions, curve.probabilities, curve.area
    (array([0. , 0.5, 1. ]), array([[1., 0., 0.]]), array([0.25]))
    """

    fractions: Array
    probabilities: Array
    area: Array


class _Units:
    """How the units of one input are replaced: tokens of a sequence, or image patches."""

    def __init__(
        self,
        inputs: ModelInputs,
        *,
        replacement: Any,
        patch_size: tuple[int, int] | None,
        channels: str,
    ) -> None:
        self.inputs = inputs
        self.replacement = replacement
        self.patch_size = patch_size
        host = inputs.host
        if patch_size is None:
            self.count = host.shape[1]
            self.grid: tuple[int, int] | None = None
            return
        if host.ndim != 4:
            msg = (
                "with `patch_size`, `inputs` must be images of shape (B, C, H, W) "
                f"(channels='first') or (B, H, W, C) (channels='last'); got shape {host.shape}."
            )
            raise ValueError(msg)
        height, width = host.shape[2:] if channels == "first" else host.shape[1:3]
        ph, pw = patch_size
        if height % ph or width % pw:
            msg = (
                f"`patch_size` {patch_size} must divide the image size ({height}, {width}); "
                "crop or pad the images, or pass the model's patch size."
            )
            raise ValueError(msg)
        self.grid = (height // ph, width // pw)
        self.count = self.grid[0] * self.grid[1]
        self.channels_first = channels == "first"
        self.replacement = np.broadcast_to(
            np.asarray(replacement, dtype=host.dtype), host.shape[1:]
        )

    def apply(self, rows: np.ndarray, replaced: np.ndarray) -> np.ndarray:
        """Return copies of input `rows` with the units where `replaced` is True replaced."""
        batch: np.ndarray = self.inputs.host[rows].copy()
        if self.grid is None:
            batch[replaced] = self.replacement
            return batch
        ph, pw = self.patch_size  # type: ignore[misc]
        pixels = np.repeat(np.repeat(replaced.reshape(-1, *self.grid), ph, axis=1), pw, axis=2)
        pixels = pixels[:, None] if self.channels_first else pixels[..., None]
        replaced_images: np.ndarray = np.where(pixels, self.replacement[None], batch)
        return replaced_images


def _read_scores(scores: Any, batch: int, units: int, name: str = "scores") -> np.ndarray:
    (converted,), _ = enter_boundary([scores], [name])
    if getattr(converted, "shape", None) is None:
        msg = f"`{name}` must be an array of shape (B, ..., {units}); got {describe(scores)}."
        raise TypeError(msg)
    shape = tuple(converted.shape)
    if len(shape) < 2 or shape[0] != batch or shape[-1] != units:
        msg = (
            f"`{name}` must have shape (B, ..., units) = ({batch}, ..., {units}): one score per "
            f"unit (token or patch) of each input; got shape {shape}. For a ViT, drop the "
            "[CLS] and register tokens first (e.g. `scores[..., 1:]`)."
        )
        raise ValueError(msg)
    return to_host(converted, name=name)


def _eligible(where: Any, mask: np.ndarray | None, batch: int, units: int) -> np.ndarray:
    eligible = np.ones((batch, units), dtype=bool) if mask is None else mask.copy()
    if where is None:
        return eligible
    (converted,), _ = enter_boundary([where], ["where"])
    if getattr(converted, "shape", None) is None or not _is_bool(converted):
        msg = f"`where` must be a boolean array of shape ({batch}, {units}); got {describe(where)}."
        raise TypeError(msg)
    host = to_host(converted, name="where", keep_dtype=True).astype(bool)
    try:
        allowed: np.ndarray = eligible & np.broadcast_to(host, (batch, units))
    except ValueError:
        msg = f"`where` must broadcast to ({batch}, {units}); got shape {host.shape}."
        raise ValueError(msg) from None
    return allowed


def _is_bool(x: Any) -> bool:
    from attnflow._namespace import array_namespace

    try:
        return bool(array_namespace(x).isdtype(x.dtype, "bool"))
    except TypeError:
        return False


def _orders(scores: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Units by decreasing score (ties: earlier unit first); ineligible units last."""
    expanded = np.broadcast_to(eligible[:, None, :], scores.shape)
    if np.isnan(scores[expanded]).any():
        msg = (
            "`scores` holds NaN at units that may be removed; exclude them with `where` or `mask`."
        )
        raise ValueError(msg)
    keyed = np.where(expanded, -scores, np.inf)
    return np.argsort(keyed, axis=-1, kind="stable")


def _check_common(predict: object, channels: object, patch_size: object) -> tuple[int, int] | None:
    if not callable(predict):
        msg = f"`predict` must be callable (inputs -> probabilities); got {type(predict).__name__}."
        raise TypeError(msg)
    if channels not in ("first", "last"):
        msg = f'`channels` must be "first" (B, C, H, W) or "last" (B, H, W, C); got {channels!r}.'
        raise ValueError(msg)
    if patch_size is None:
        return None
    if isinstance(patch_size, int) and not isinstance(patch_size, bool):
        patch_size = (patch_size, patch_size)
    if (
        not isinstance(patch_size, tuple)
        or len(patch_size) != 2
        or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in patch_size)
    ):
        msg = f"`patch_size` must be None (tokens), an int or a pair of positive ints; got {patch_size!r}."
        raise ValueError(msg)
    return patch_size


def _deleted_batches(
    units: _Units, jobs: list[tuple[int, np.ndarray]], order: np.ndarray, batch_size: int | None
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Yield the jobs in `order` with their removed tokens (and padding) deleted.

    Batches hold one length each, so no padding is added (all-True masks when the caller
    gave one).
    """
    host, mask = units.inputs.host, units.inputs.mask
    kept = [~replaced if mask is None else ~replaced & mask[row] for row, replaced in jobs]
    step = len(jobs) if batch_size is None else batch_size
    start = 0
    while start < len(order):
        length = int(kept[order[start]].sum())
        stop = start
        while stop < len(order) and stop - start < step and kept[order[stop]].sum() == length:
            stop += 1
        ids = np.stack([host[jobs[j][0]][kept[j]] for j in order[start:stop]])
        yield ids, None if mask is None else np.ones(ids.shape, dtype=bool)
        start = stop


def _evaluate(
    predict: Predict,
    units: _Units,
    targets_given: object,
    jobs: list[tuple[int, np.ndarray]],
    batch_size: int | None,
    *,
    delete: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.dtype[Any]]:
    """Target probabilities of the originals and of each job (row, replaced units).

    With `delete` the replaced tokens are removed instead (the sequence gets shorter).
    """
    inputs = units.inputs
    batch = inputs.host.shape[0]
    mask = inputs.mask

    def originals(start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        return inputs.host[start:stop], None if mask is None else mask[start:stop]

    base, dtype = call_model(predict, row_batches(batch, batch_size, originals), inputs, batch)
    targets = resolve_targets(targets_given, np.argmax(base, axis=1), base.shape[1])
    rows = np.array([row for row, _ in jobs], dtype=np.int64)

    def perturbed(start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        replaced = np.stack([jobs[i][1] for i in range(start, stop)])
        chosen = rows[start:stop]
        return units.apply(chosen, replaced), None if mask is None else mask[chosen]

    after = np.zeros(0)
    if jobs and delete:
        lengths = np.array([int((~r if mask is None else ~r & mask[i]).sum()) for i, r in jobs])
        order = np.argsort(lengths, kind="stable")
        probabilities, _ = call_model(
            predict, _deleted_batches(units, jobs, order, batch_size), inputs, len(jobs)
        )
        unsorted = np.empty_like(probabilities)
        unsorted[order] = probabilities
        after = target_probabilities(unsorted, targets[rows])
    elif jobs:
        probabilities, _ = call_model(
            predict, row_batches(len(jobs), batch_size, perturbed), inputs, len(jobs)
        )
        after = target_probabilities(probabilities, targets[rows])
    return target_probabilities(base, targets), after, dtype


def _erasure(
    kind: Literal["comprehensiveness", "sufficiency"],
    predict: Predict,
    inputs: Array,
    scores: Array,
    *,
    replacement: int | None,
    target: object,
    fractions: Sequence[float],
    mask: Array | None,
    where: Array | None,
    batch_size: int | None,
    xp: Namespace | None,
) -> Array:
    _check_common(predict, "first", None)
    delete = replacement is None
    replacement = 0 if delete else check_replacement(replacement, integer=True)
    batch_size = check_batch_size(batch_size)
    bins = _check_fractions(fractions)
    model_inputs = read_token_ids(inputs, mask, xp=xp)
    batch, n = model_inputs.host.shape
    host_scores = _read_scores(scores, batch, n)
    extra = host_scores.shape[1:-1]
    flat = host_scores.reshape(batch, -1, n)
    eligible = _eligible(where, model_inputs.mask, batch, n)
    orders = _orders(flat, eligible)
    counts = eligible.sum(axis=1)
    units = _Units(model_inputs, replacement=replacement, patch_size=None, channels="first")

    # One model call per distinct (row, explanation, k): short sequences repeat k often.
    jobs: list[tuple[int, np.ndarray]] = []
    slots = np.full((batch, flat.shape[1], len(bins)), -1, dtype=np.int64)
    for row in range(batch):
        ks = [min(counts[row], max(1, math.ceil(f * counts[row]))) for f in bins]
        for explanation in range(flat.shape[1]):
            seen: dict[int, int] = {}
            for position, k in enumerate(ks):
                if counts[row] == 0:
                    continue
                if k not in seen:
                    replaced = np.zeros(n, dtype=bool)
                    replaced[orders[row, explanation, :k]] = True
                    if kind == "sufficiency":
                        replaced = eligible[row] & ~replaced
                    seen[k] = len(jobs)
                    jobs.append((row, replaced))
                slots[row, explanation, position] = seen[k]
    if delete:
        real = model_inputs.mask
        empty = [row for row, r in jobs if not (~r if real is None else ~r & real[row]).any()]
        if empty:
            msg = (
                f"with replacement=None (deletion), input {empty[0]} would lose every token; "
                "keep some tokens out of `where` (e.g. [CLS] and [SEP]) or lower `fractions`."
            )
            raise ValueError(msg)
    before, after, dtype = _evaluate(predict, units, target, jobs, batch_size, delete=delete)
    values = np.full(slots.shape, np.nan)
    filled = slots >= 0
    values[filled] = (
        np.broadcast_to(before[:, None, None], slots.shape)[filled] - after[slots[filled]]
    )
    return result_array(values.reshape(batch, *extra, len(bins)), model_inputs, dtype)


def _check_fractions(fractions: object) -> tuple[float, ...]:
    if not isinstance(fractions, Sequence) or isinstance(fractions, str) or not fractions:
        msg = f"`fractions` must be a non-empty sequence of numbers in (0, 1]; got {fractions!r}."
        raise TypeError(msg)
    bins = []
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            msg = f"`fractions` must hold numbers in (0, 1] (e.g. 0.2 for 20 %); got {f!r}."
            raise ValueError(msg)
        bins.append(float(f))
    return tuple(bins)


_ERASURE_DOC_PARAMETERS = """
    Parameters
    ----------
    predict : callable
        ``predict(ids)`` (or ``predict(ids, mask)`` with `mask`) maps a batch of token ids
        ``(B, n)``, arrays of the library and device of `inputs`, to class probabilities
        ``(B, C)``, as for :func:`blank_out`.
    inputs : array of int, shape (B, n)
        Token ids.
    scores : array of shape (B, ..., n)
        The explanation: one importance per token (higher = more important), e.g. one
        row of rollout, or ``(B, layers, n)`` for every layer at once. Any array library.
    replacement : int or None
        The id of the token that replaces removed tokens (e.g. the mask token), or None
        to delete them: the sequence gets shorter, as in DeYoung et al.'s ERASER and in
        ALTI's AUPC evaluation (Ferrando et al. 2022). Deleted inputs are batched by
        length, without padding (with `mask`, `predict` gets all-True masks).
    target : int, sequence or array of int, optional
        The class to explain; None (default) takes the predicted class of each input.
    fractions : sequence of float, default (0.01, 0.05, 0.1, 0.2, 0.5)
        The fractions of the removable tokens in the rationale: ERASER's bins. Each is
        rounded up to a whole token (at least one).
    mask : bool array of shape (B, n), optional
        True = real token. Padding is never removed, and is passed to `predict`.
    where : bool array broadcastable to (B, n), optional
        The tokens that may be removed (e.g. everything but ``[CLS]`` and ``[SEP]``);
        by default every real token.
    batch_size : int, optional
        Sequences per call of `predict`; None makes one call for all.
    xp : namespace, optional
        The array namespace of `inputs`; inferred by default.

    Returns
    -------
    array of shape (B, ..., K)
        One value per input, explanation and fraction, in the library and on the device of
        `inputs`; NaN for an input without removable tokens. Average over the last axis
        for the AOPC.
"""


def comprehensiveness(
    predict: Predict,
    inputs: Array,
    scores: Array,
    /,
    *,
    replacement: int | None,
    target: int | Sequence[int] | Array | None = None,
    fractions: Sequence[float] = ERASER_FRACTIONS,
    mask: Array | None = None,
    where: Array | None = None,
    batch_size: int | None = None,
    xp: Namespace | None = None,
) -> Array:
    r"""ERASER comprehensiveness: the drop when the top-ranked tokens are removed.

    For each fraction :math:`f`, the rationale :math:`r_f` holds the
    :math:`\lceil f m \rceil` tokens with the highest scores among the :math:`m`
    removable ones, and

    .. math::

        \text{comprehensiveness}_f = p_t(x) - p_t(x \setminus r_f),
        \qquad \text{AOPC} = \frac{1}{|F|} \sum_{f \in F} \text{comprehensiveness}_f ,

    where removing means replacing by `replacement`, or deleting the tokens with
    ``replacement=None``. Higher is more faithful: the explanation found what the
    prediction rests on. DeYoung et al. (2020) and ALTI's evaluation delete the tokens;
    replacing them by the mask token (DecompX) keeps positions and lengths.
    """
    return _erasure(
        "comprehensiveness",
        predict,
        inputs,
        scores,
        replacement=replacement,
        target=target,
        fractions=fractions,
        mask=mask,
        where=where,
        batch_size=batch_size,
        xp=xp,
    )


def sufficiency(
    predict: Predict,
    inputs: Array,
    scores: Array,
    /,
    *,
    replacement: int | None,
    target: int | Sequence[int] | Array | None = None,
    fractions: Sequence[float] = ERASER_FRACTIONS,
    mask: Array | None = None,
    where: Array | None = None,
    batch_size: int | None = None,
    xp: Namespace | None = None,
) -> Array:
    r"""ERASER sufficiency: the drop when only the top-ranked tokens are kept.

    With the rationale :math:`r_f` as for :func:`comprehensiveness`,

    .. math::

        \text{sufficiency}_f = p_t(x) - p_t(r_f),

    where every removable token outside :math:`r_f` is replaced by `replacement`. Lower
    is more faithful: the rationale alone supports the prediction. AOPC is the mean over
    the fractions.
    """
    return _erasure(
        "sufficiency",
        predict,
        inputs,
        scores,
        replacement=replacement,
        target=target,
        fractions=fractions,
        mask=mask,
        where=where,
        batch_size=batch_size,
        xp=xp,
    )


_REFERENCES = """
    See Also
    --------
    blank_out : One token at a time.
    deletion, insertion : Every step of the order, for images or tokens.

    References
    ----------
    .. [1] J. DeYoung et al., "ERASER: A Benchmark to Evaluate Rationalized NLP Models",
       ACL 2020, https://arxiv.org/abs/1911.03429
    .. [2] W. Samek et al., "Evaluating the visualization of what a deep neural network has
       learned", IEEE TNNLS 28(11), 2017 (AOPC).

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> def predict(ids):  # the class rests on token 3
    ...     p = np.where((ids == 3).any(axis=1), 0.9, 0.2)
    ...     return np.stack([1 - p, p], axis=1)
    >>> ids = np.array([[1, 3, 2, 2, 2]])
    >>> good = np.array([[0.1, 0.9, 0.0, 0.0, 0.0]])  # ranks token 3 first
    >>> bad = np.array([[0.9, 0.0, 0.1, 0.1, 0.1]])
    >>> attnflow.evaluate.comprehensiveness(predict, ids, good, replacement=0, fractions=[0.2, 0.4])
    array([[0.7, 0.7]])
    >>> attnflow.evaluate.comprehensiveness(predict, ids, bad, replacement=0, fractions=[0.2, 0.4])
    array([[0., 0.]])
    >>> attnflow.evaluate.sufficiency(predict, ids, good, replacement=0, fractions=[0.2, 0.4])
    array([[0., 0.]])
"""

comprehensiveness.__doc__ = (
    (comprehensiveness.__doc__ or "") + _ERASURE_DOC_PARAMETERS + _REFERENCES
)
sufficiency.__doc__ = (sufficiency.__doc__ or "") + _ERASURE_DOC_PARAMETERS + _REFERENCES


def _curve(
    kind: Literal["deletion", "insertion"],
    predict: Predict,
    inputs: Array,
    scores: Array,
    *,
    replacement: Any,
    patch_size: object,
    channels: str,
    target: object,
    steps: int | None,
    mask: Array | None,
    batch_size: int | None,
    xp: Namespace | None,
) -> PerturbationCurve:
    patch = _check_common(predict, channels, patch_size)
    batch_size = check_batch_size(batch_size)
    given_steps: object = steps
    if given_steps is not None and (
        isinstance(given_steps, bool) or not isinstance(given_steps, int) or given_steps < 1
    ):
        msg = f"`steps` must be None (one unit per step) or a positive int; got {steps!r}."
        raise ValueError(msg)
    tokens = patch is None
    replacement = check_replacement(replacement, integer=tokens)
    model_inputs = read_inputs(
        inputs,
        mask if tokens else None,
        xp=xp,
        min_ndim=2 if tokens else 4,
        integer=tokens,
        expected="(batch, tokens)" if tokens else "(B, C, H, W) or (B, H, W, C)",
    )
    if mask is not None and not tokens:
        msg = "`mask` applies to token inputs; images have no padding (omit `mask`)."
        raise ValueError(msg)
    units = _Units(model_inputs, replacement=replacement, patch_size=patch, channels=channels)
    batch = model_inputs.host.shape[0]
    host_scores = _read_scores(scores, batch, units.count)
    if host_scores.ndim != 2:
        msg = f"`scores` must have shape (B, units) = ({batch}, {units.count}); got {host_scores.shape}."
        raise ValueError(msg)
    eligible = _eligible(None, model_inputs.mask if tokens else None, batch, units.count)
    orders = _orders(host_scores[:, None, :], eligible)[:, 0]
    counts = eligible.sum(axis=1)
    n_steps = int(counts.max()) if steps is None else steps
    fractions = np.arange(n_steps + 1) / n_steps
    jobs: list[tuple[int, np.ndarray]] = []
    for row in range(batch):
        for fraction in fractions:
            k = round(fraction * counts[row])
            chosen = np.zeros(units.count, dtype=bool)
            chosen[orders[row, :k]] = True
            replaced = chosen if kind == "deletion" else eligible[row] & ~chosen
            jobs.append((row, replaced))
    _, after, dtype = _evaluate(predict, units, target, jobs, batch_size)
    probabilities = after.reshape(batch, n_steps + 1)
    # The trapezoidal rule, written out: np.trapezoid needs NumPy 2.
    area = ((probabilities[:, 1:] + probabilities[:, :-1]) / 2 * np.diff(fractions)).sum(axis=1)
    return PerturbationCurve(
        fractions=result_array(fractions, model_inputs, dtype),
        probabilities=result_array(probabilities, model_inputs, dtype),
        area=result_array(area, model_inputs, dtype),
    )


_CURVE_DOC = """
    Parameters
    ----------
    predict : callable
        Maps a batch of inputs (arrays of the library and device of `inputs`) to class
        probabilities ``(B, C)``; with `mask`, called as ``predict(ids, mask)``.
    inputs : array
        Token ids ``(B, n)``, or images ``(B, C, H, W)`` (``channels="first"``) or
        ``(B, H, W, C)`` (``channels="last"``) with `patch_size`.
    scores : array of shape (B, units)
        One importance per token, or per patch in row-major order of the patch grid (a
        ViT's patch tokens without ``[CLS]``).
    replacement : int, float or array
        What a removed unit becomes: a token id, or for images a value or an image
        broadcastable to one input (e.g. a blurred copy, or the dataset mean).
    patch_size : int or (int, int), optional
        The patch size in pixels for images; None for token inputs.
    channels : {"first", "last"}, default "first"
        Where the image channels are.
    target : int, sequence or array of int, optional
        The class to explain; None takes the predicted class of each input.
    steps : int, optional
        The number of steps from 0 to all units (rounded to whole units); None moves one
        unit per step.
    mask : bool array of shape (B, n), optional
        For tokens: True = real token; padding is never touched.
    batch_size : int, optional
        Inputs per call of `predict`; None makes one call for all.
    xp : namespace, optional
        The array namespace of `inputs`; inferred by default.

    Returns
    -------
    PerturbationCurve
        ``fractions`` ``(S + 1,)``, ``probabilities`` ``(B, S + 1)`` of the target class
        and the ``area`` under each curve ``(B,)``, in the library of `inputs`.

    See Also
    --------
    comprehensiveness, sufficiency : The ERASER metrics at a few fractions.

    References
    ----------
    .. [1] V. Petsiuk, A. Das and K. Saenko, "RISE: Randomized Input Sampling for
       Explanation of Black-box Models", BMVC 2018, https://arxiv.org/abs/1806.07421

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> def predict(images):  # the class rests on the top-left 2x2 patch being bright
    ...     p = 0.1 + 0.8 * images[:, 0, :2, :2].mean(axis=(1, 2))
    ...     return np.stack([1 - p, p], axis=1)
    >>> images = np.zeros((1, 1, 4, 4))
    >>> images[0, 0, :2, :2] = 1.0
    >>> scores = np.array([[1.0, 0.0, 0.0, 0.0]])  # 4 patches of 2x2, top-left first
    >>> curve = attnflow.evaluate.deletion(predict, images, scores, replacement=0.0, patch_size=2)
    >>> curve.probabilities
    array([[0.9, 0.1, 0.1, 0.1, 0.1]])
    >>> curve.area.round(3)
    array([0.2])
    >>> attnflow.evaluate.insertion(predict, images, scores, replacement=0.0, patch_size=2).area
    array([0.8])
"""


def deletion(
    predict: Predict,
    inputs: Array,
    scores: Array,
    /,
    *,
    replacement: Any,
    patch_size: int | tuple[int, int] | None = None,
    channels: Literal["first", "last"] = "first",
    target: int | Sequence[int] | Array | None = None,
    steps: int | None = None,
    mask: Array | None = None,
    batch_size: int | None = None,
    xp: Namespace | None = None,
) -> PerturbationCurve:
    r"""Measure the deletion curve: remove units from the most to the least important.

    Step :math:`s` of :math:`S` replaces the :math:`\operatorname{round}(s m / S)`
    highest-scoring of the :math:`m` units and records :math:`p_t`; the area under the
    curve (AUC, over the fraction removed) is low when the explanation puts first what
    the prediction rests on (Petsiuk et al. 2018).
    """
    return _curve(
        "deletion",
        predict,
        inputs,
        scores,
        replacement=replacement,
        patch_size=patch_size,
        channels=channels,
        target=target,
        steps=steps,
        mask=mask,
        batch_size=batch_size,
        xp=xp,
    )


def insertion(
    predict: Predict,
    inputs: Array,
    scores: Array,
    /,
    *,
    replacement: Any,
    patch_size: int | tuple[int, int] | None = None,
    channels: Literal["first", "last"] = "first",
    target: int | Sequence[int] | Array | None = None,
    steps: int | None = None,
    mask: Array | None = None,
    batch_size: int | None = None,
    xp: Namespace | None = None,
) -> PerturbationCurve:
    r"""Measure the insertion curve: restore units, the most important first.

    Step :math:`s` of :math:`S` restores the :math:`\operatorname{round}(s m / S)`
    highest-scoring units (every other unit replaced) and records :math:`p_t`; a high
    area under the curve means the explanation's first units suffice for the prediction
    (Petsiuk et al. 2018).
    """
    return _curve(
        "insertion",
        predict,
        inputs,
        scores,
        replacement=replacement,
        patch_size=patch_size,
        channels=channels,
        target=target,
        steps=steps,
        mask=mask,
        batch_size=batch_size,
        xp=xp,
    )


deletion.__doc__ = (deletion.__doc__ or "") + _CURVE_DOC
insertion.__doc__ = (insertion.__doc__ or "") + _CURVE_DOC
