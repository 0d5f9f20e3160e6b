"""Calling the user's model on perturbed inputs, in batches, in the user's array library.

The evaluation metrics build their perturbed inputs on the host (token ids and image
patches are cheap to copy), hand them to the model in the library and on the device of
the caller's `inputs`, and read the class probabilities back to the host in float64.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnflow._host import to_host
from attnflow._namespace import Boundary, enter_boundary, resolve_namespace
from attnflow._typing import Array, Namespace
from attnflow._validation import describe

__all__ = [
    "ModelInputs",
    "Predict",
    "check_batch_size",
    "check_mask_for",
    "check_replacement",
    "read_inputs",
    "read_token_ids",
    "resolve_targets",
    "shared_predictions",
    "target_probabilities",
]

Predict = Callable[..., Any]
"""``predict(inputs)`` or ``predict(inputs, mask)``: a batch to probabilities ``(B, C)``."""

_PROBABILITY_TOLERANCE = 1e-3  # rows of float16/bfloat16 softmax outputs sum to 1 within this


@dataclass(frozen=True)
class ModelInputs:
    """The caller's inputs, copied to the host, and how to hand batches back to the model."""

    host: np.ndarray
    mask: np.ndarray | None
    """``(B, n)`` bool on the host, or None (every position is real)."""
    xp: Namespace
    device: Any
    boundary: Boundary
    like: Any
    """One of the caller's arrays: results take its library and device."""

    def to_model(self, batch: np.ndarray) -> Any:
        """Return a host batch as an array of the caller's library, on the caller's device."""
        array = self.xp.asarray(batch, device=self.device)
        return self.boundary.restore(array)


def read_inputs(
    inputs: Any,
    mask: Any,
    *,
    xp: Namespace | None,
    min_ndim: int,
    integer: bool,
    expected: str,
) -> ModelInputs:
    """Check the caller's inputs and mask and copy both to the host (before any model call)."""
    (array, mask_array), boundary = enter_boundary([inputs, mask], ["inputs", "mask"])
    namespace = resolve_namespace(array, mask_array, xp=xp, names=["inputs", "mask"])
    if getattr(array, "shape", None) is None or len(array.shape) < min_ndim:
        msg = f"`inputs` must be an array of shape {expected}; got {describe(array)}."
        raise ValueError(msg) if getattr(array, "shape", None) is not None else TypeError(msg)
    if any(d is None for d in array.shape) or 0 in array.shape[:2]:
        msg = f"`inputs` must have a known, non-empty shape {expected}; got {tuple(array.shape)}."
        raise ValueError(msg)
    kind = "integral" if integer else "real floating"
    if not namespace.isdtype(array.dtype, kind) and not (
        not integer and namespace.isdtype(array.dtype, "integral")
    ):
        msg = (
            f"`inputs` must hold {'token ids (an integer dtype)' if integer else 'numbers'}; "
            f"got dtype {array.dtype}."
        )
        raise TypeError(msg)
    from attnflow._namespace import array_device

    host = to_host(array, name="inputs", keep_dtype=True)
    host_mask = check_mask_for(mask_array, host.shape[:2], namespace)
    return ModelInputs(host, host_mask, namespace, array_device(array), boundary, array)


def read_token_ids(
    inputs: Any, mask: Any, *, xp: Namespace | None, batch: str = "batch"
) -> ModelInputs:
    """:func:`read_inputs` for token ids: an integer array of exactly two axes.

    `batch` names the first axis in the errors (``"batch"``, ``"samples"``).
    """
    expected = f"({batch}, tokens)"
    read = read_inputs(inputs, mask, xp=xp, min_ndim=2, integer=True, expected=expected)
    if read.host.ndim != 2:
        msg = f"`inputs` must have shape {expected}; got shape {read.host.shape}."
        raise ValueError(msg)
    return read


def check_mask_for(mask: Any, shape: tuple[int, ...], xp: Namespace) -> np.ndarray | None:
    """Check a ``(B, n)`` boolean padding mask and copy it to the host."""
    if mask is None:
        return None
    if getattr(mask, "shape", None) is None or not xp.isdtype(mask.dtype, "bool"):
        msg = f"`mask` must be a boolean array of shape {shape} (True = real token); got {describe(mask)}."
        raise TypeError(msg)
    if tuple(mask.shape) != tuple(shape):
        msg = (
            f"`mask` must have shape {tuple(shape)}, one entry per input position; got "
            f"shape {tuple(mask.shape)}."
        )
        raise ValueError(msg)
    return to_host(mask, name="mask", keep_dtype=True).astype(bool)


def check_replacement(replacement: object, *, integer: bool) -> Any:
    """Check the replacement token id (or, for images, a number or an array)."""
    if integer:
        if isinstance(replacement, bool) or not isinstance(replacement, numbers.Integral):
            msg = (
                "`replacement` must be the integer id of the token that replaces a blanked "
                "token (the paper: UNK; its code: the mask token, e.g. "
                f"`tokenizer.mask_token_id`); got {replacement!r}."
            )
            raise TypeError(msg)
        return int(replacement)
    return replacement


def check_batch_size(batch_size: object) -> int | None:
    """Check `batch_size`: None (one call) or a positive int."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        msg = f"`batch_size` must be a positive int or None (one call); got {batch_size!r}."
        raise ValueError(msg)
    return batch_size


@dataclass
class PredictionCache:
    """The probabilities of every row one `predict` has seen, by row digest.

    :func:`call_model` reads and fills it while :func:`shared_predictions` is active for
    the same `predict`, so the metrics of one evaluation chunk (blank-out,
    comprehensiveness and sufficiency of every method) predict each distinct input once:
    the unperturbed sequences above all, which each of them needs.
    """

    predict: Predict
    known: dict[bytes, np.ndarray] = field(default_factory=dict)
    dtype: np.dtype[Any] | None = None
    """The dtype `predict` returned (the metrics answer in it)."""
    classes: int | None = None
    predicted: int = 0
    """Rows handed to `predict` so far."""


_SHARED: ContextVar[PredictionCache | None] = ContextVar("attnflow_predictions", default=None)


@contextmanager
def shared_predictions(predict: Predict) -> Iterator[PredictionCache]:
    """Share predictions of `predict` between the :func:`call_model` calls in this block."""
    cache = PredictionCache(predict)
    token = _SHARED.set(cache)
    try:
        yield cache
    finally:
        _SHARED.reset(token)


def call_model(
    predict: Predict,
    batches: Iterator[tuple[np.ndarray, np.ndarray | None]],
    inputs: ModelInputs,
    total: int,
) -> tuple[np.ndarray, np.dtype[Any]]:
    """Run `predict` on every host batch: probabilities ``(total, C)`` and their dtype.

    A perturbed input that occurs more than once in one call (the same tokens removed for
    two layers, two fractions or two positions) is predicted once: erasure curves repeat
    most of their inputs, and the model calls are the cost. The batches are still made
    one at a time, so lazily built image perturbations never all sit in memory. Inside
    :func:`shared_predictions` for the same `predict`, rows predicted by earlier calls are
    not predicted again.
    """
    shared = _SHARED.get()
    if shared is None or shared.predict is not predict:
        shared = PredictionCache(predict)  # this call's rows only
    outputs: list[np.ndarray] = []
    known = shared.known  # digest of (row, mask row) -> its probabilities
    dtype: np.dtype[Any] = np.dtype(np.float64) if shared.dtype is None else shared.dtype
    classes = shared.classes
    done = predicted = 0
    for batch, batch_mask in batches:
        keys = _row_digests(batch, batch_mask)
        fresh: dict[bytes, int] = {}
        for index, key in enumerate(keys):
            if key not in known and key not in fresh:
                fresh[key] = index
        if fresh:
            pick = np.fromiter(fresh.values(), dtype=np.intp, count=len(fresh))
            arguments = [inputs.to_model(batch[pick])]
            if batch_mask is not None:
                arguments.append(inputs.to_model(batch_mask[pick]))
            probabilities, dtype = _read_probabilities(predict(*arguments), len(pick), predicted)
            if classes is not None and probabilities.shape[1] != classes:
                msg = (
                    f"`predict` returned {probabilities.shape[1]} classes for one batch and "
                    f"{classes} for another; it must always return (batch, classes)."
                )
                raise ValueError(msg)
            classes = shared.classes = probabilities.shape[1]
            shared.dtype = dtype
            known.update(zip(fresh, probabilities, strict=True))
            predicted += len(pick)
            shared.predicted += len(pick)
        outputs.append(np.stack([known[key] for key in keys]))
        done += len(batch)
    if done != total:  # pragma: no cover - the batch generators are internal
        msg = f"internal error: {done} rows predicted, {total} expected"
        raise AssertionError(msg)
    return np.concatenate(outputs, axis=0), dtype


def _row_digests(batch: np.ndarray, mask: np.ndarray | None) -> list[bytes]:
    """Return a 128-bit digest of each row and its mask row: equal rows, equal digests."""
    rows = np.ascontiguousarray(batch).reshape(len(batch), -1)
    masks = None if mask is None else np.ascontiguousarray(mask).reshape(len(mask), -1)
    prefix = f"{rows.dtype.str}{rows.shape[1:]}".encode()
    digests = []
    for index in range(len(rows)):
        digest = hashlib.blake2b(prefix, digest_size=16)
        digest.update(rows[index].tobytes())
        if masks is not None:
            digest.update(masks[index].tobytes())
        digests.append(digest.digest())
    return digests


def _read_probabilities(output: Any, rows: int, offset: int) -> tuple[np.ndarray, np.dtype[Any]]:
    (output,), _ = enter_boundary([output], ["predict(...)"])
    if getattr(output, "shape", None) is None:
        msg = f"`predict` must return an array of class probabilities (batch, classes); got {describe(output)}."
        raise TypeError(msg)
    native = to_host(output, name="predict(...)", keep_dtype=True)
    if native.dtype.kind != "f":
        msg = f"`predict` must return floating class probabilities; got dtype {native.dtype}."
        raise TypeError(msg)
    values = native.astype(np.float64)
    if values.shape != (rows, values.shape[-1]) or values.ndim != 2 or values.shape[1] < 1:
        msg = (
            f"`predict` must return class probabilities of shape (batch, classes) = "
            f"({rows}, C) for a batch of {rows}; got shape {values.shape}."
        )
        raise ValueError(msg)
    finite = np.isfinite(values).all()
    sums = values.sum(axis=1)
    if (
        not finite
        or (values < -_PROBABILITY_TOLERANCE).any()
        or (np.abs(sums - 1) > _PROBABILITY_TOLERANCE).any()
    ):
        row = int(np.argmax(np.abs(np.nan_to_num(sums, nan=np.inf) - 1)))
        msg = (
            "`predict` must return class probabilities (non-negative rows summing to 1); "
            f"row {offset + row} of its output sums to {sums[row]:.6g}. If your model "
            "returns logits, apply a softmax in `predict`."
        )
        raise ValueError(msg)
    return values, native.dtype


def resolve_targets(target: object, predicted: np.ndarray, n_classes: int) -> np.ndarray:
    """Return the class to explain for each sample: given, or the predicted one when None."""
    batch = len(predicted)
    if target is None:
        return predicted
    if isinstance(target, bool):
        msg = f"`target` must be None, a class index or one index per sample; got {target!r}."
        raise TypeError(msg)
    if isinstance(target, numbers.Integral):
        targets = np.full(batch, int(target), dtype=np.int64)
    else:
        if isinstance(target, Sequence):
            host = np.asarray(target)
        else:
            (converted,), _ = enter_boundary([target], ["target"])
            if getattr(converted, "shape", None) is None:
                msg = f"`target` must be None, a class index or one index per sample; got {describe(target)}."
                raise TypeError(msg)
            host = to_host(converted, name="target", keep_dtype=True)
        if host.dtype.kind not in "iu" or host.shape != (batch,):
            msg = (
                f"`target` must hold one integer class index per sample, shape ({batch},); "
                f"got an array of shape {host.shape} and dtype {host.dtype}."
            )
            raise ValueError(msg) if host.dtype.kind in "iu" else TypeError(msg)
        targets = host.astype(np.int64)
    bad = (targets < 0) | (targets >= n_classes)
    if bad.any():
        msg = (
            f"`target` must be a class index in [0, {n_classes}) (the model returns "
            f"{n_classes} classes); got {int(targets[np.argmax(bad)])}."
        )
        raise ValueError(msg)
    return targets


def target_probabilities(
    probabilities: np.ndarray, targets: np.ndarray, *, margin: bool = False
) -> np.ndarray:
    """``p[target]``, or with `margin` the target's lead over the best other class."""
    chosen = np.take_along_axis(probabilities, targets[:, None], axis=1)[:, 0]
    if not margin:
        return chosen
    others = probabilities.copy()
    np.put_along_axis(others, targets[:, None], -math.inf, axis=1)
    lead: np.ndarray = chosen - others.max(axis=1)
    return lead


def row_batches(
    total: int,
    batch_size: int | None,
    make: Callable[[int, int], tuple[np.ndarray, np.ndarray | None]],
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Yield ``make(start, stop)`` for consecutive ranges of at most `batch_size` rows."""
    step = total if batch_size is None else batch_size
    for start in range(0, total, max(step, 1)):
        yield make(start, min(total, start + step))


def result_array(values: np.ndarray, inputs: ModelInputs, dtype: Any) -> Array:
    """Host results in the library and on the device of the caller's inputs."""
    xp = inputs.xp
    return inputs.boundary.restore(xp.asarray(values.astype(dtype), device=inputs.device))
