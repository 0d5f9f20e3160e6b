"""blank_out against a hand-written loop over positions, on every backend and dtype."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from backends import Variant
from evaluation_models import TokenClassifier, predict_for

import attnflow

VOCABULARY, BATCH, N, UNK = 12, 3, 7, 0


@pytest.fixture(scope="module")
def model() -> TokenClassifier:
    return TokenClassifier(vocabulary=VOCABULARY, seed=4)


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    return np.random.default_rng(9).integers(1, VOCABULARY, size=(BATCH, N))


def _margin(p: np.ndarray, target: int) -> float:
    others = np.delete(p, target)
    return float(p[target] - others.max())


def loop_blank_out(
    model: TokenClassifier,
    ids: np.ndarray,
    *,
    score: str = "drop",
    target: Any = None,
    positions: Any = None,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """The definition, one sequence and one position at a time."""
    out = np.full(ids.shape, np.nan)
    for b in range(ids.shape[0]):
        row_mask = None if mask is None else mask[b : b + 1]
        p = model.probabilities(ids[b : b + 1], row_mask)[0]
        t = int(np.argmax(p)) if target is None else (target if np.isscalar(target) else target[b])
        chosen = range(N) if positions is None else [q % N for q in np.atleast_1d(positions)]
        for i in chosen:
            if mask is not None and not mask[b, i]:
                continue
            copy = ids[b : b + 1].copy()
            copy[0, i] = UNK
            q = model.probabilities(copy, row_mask)[0]
            change = p[t] - q[t] if score in ("drop", "abs") else _margin(p, t) - _margin(q, t)
            out[b, i] = abs(change) if score.startswith("abs") else change
    return out


def _tolerance(dtype_name: str) -> float:
    return 1e-6 if dtype_name == "float64" else 2e-5


@pytest.mark.parametrize("score", ["drop", "abs", "margin", "abs_margin"])
def test_equals_loop_over_positions(
    backend: Variant, dtype_name: str, model: TokenClassifier, ids: np.ndarray, score: str
) -> None:
    calls: list[Any] = []
    predict = predict_for(backend, model, dtype_name, calls=calls)
    result = attnflow.evaluate.blank_out(
        predict, backend.asarray(ids), replacement=UNK, score=score
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, N))
    expected = loop_blank_out(model, ids, score=score)
    np.testing.assert_allclose(values, expected, rtol=0, atol=_tolerance(dtype_name))
    assert np.abs(expected).max() > 1e-2  # the model is sensitive to its tokens
    assert len(calls) == 2  # the originals, then every copy at once: no call per token


@pytest.mark.parametrize(
    "options",
    [
        {"target": 2},
        {"target": [0, 1, 2]},
        {"positions": [0, -1, 3]},
        {"positions": 2, "target": 1},
        {"batch_size": 4},
    ],
    ids=["target-int", "target-per-row", "positions", "position-int", "batched"],
)
def test_options_equal_loop(
    backend: Variant, model: TokenClassifier, ids: np.ndarray, options: dict[str, Any]
) -> None:
    predict = predict_for(backend, model, "float64")
    given = dict(options)
    if isinstance(given.get("target"), list):
        given["target"] = backend.asarray(np.array(given["target"]))
    result = attnflow.evaluate.blank_out(predict, backend.asarray(ids), replacement=UNK, **given)
    values = backend.check(result, dtype_name="float64", shape=(BATCH, N))
    reference = {k: v for k, v in options.items() if k != "batch_size"}
    expected = loop_blank_out(model, ids, **reference)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)
    assert np.isnan(values).sum() == np.isnan(expected).sum()


def test_mask_skips_padding_and_reaches_predict(
    backend: Variant, model: TokenClassifier, ids: np.ndarray
) -> None:
    mask = np.arange(N)[None, :] < np.array([7, 4, 2])[:, None]
    calls: list[Any] = []
    predict = predict_for(backend, model, "float64", calls=calls)
    result = attnflow.evaluate.blank_out(
        predict, backend.asarray(ids), replacement=UNK, mask=backend.asarray(mask), batch_size=5
    )
    values = backend.check(result, dtype_name="float64", shape=(BATCH, N))
    expected = loop_blank_out(model, ids, mask=mask)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)
    assert np.isnan(values[~mask]).all()
    assert np.isfinite(values[mask]).all()
    # 3 originals in one batch, 13 real positions in batches of 5: 1 + 3 calls, each
    # with the rows of the mask that belong to its sequences.
    assert len(calls) == 4
    assert all(call[1] is not None for call in calls)
    assert sum(backend.to_numpy(call[1]).shape[0] for call in calls) == 3 + 13


def test_last_token_zero_is_the_paper_codes_eos(
    backend: Variant, dtype_name: str, model: TokenClassifier, ids: np.ndarray
) -> None:
    # The paper's code blanks out positions 0..n-2 of each sentence and appends 0 for its
    # final <eos>: the last *real* token, wherever padding starts.
    lengths = np.array([7, 4, 2])
    mask = np.arange(N)[None, :] < lengths[:, None]
    calls: list[Any] = []
    predict = predict_for(backend, model, dtype_name, calls=calls)
    result = attnflow.evaluate.blank_out(
        predict,
        backend.asarray(ids),
        replacement=UNK,
        target=backend.asarray(np.array([0, 1, 2])),
        score="abs",
        mask=backend.asarray(mask),
        last_token="zero",
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, N))
    expected = loop_blank_out(model, ids, score="abs", target=[0, 1, 2], mask=mask)
    last = lengths - 1
    assert np.abs(expected[np.arange(BATCH), last]).min() > 1e-4  # zeroing changes something
    expected[np.arange(BATCH), last] = 0.0
    np.testing.assert_allclose(values, expected, rtol=0, atol=_tolerance(dtype_name))
    assert np.isnan(values[~mask]).all()
    # The last tokens were never evaluated: 3 originals, then 13 - 3 copies.
    assert sum(backend.to_numpy(call[0]).shape[0] for call in calls) == 3 + 10


def test_last_token_option_is_checked(model: TokenClassifier, ids: np.ndarray) -> None:
    with pytest.raises(ValueError, match="`last_token` must be one of"):
        attnflow.evaluate.blank_out(model.probabilities, ids, replacement=UNK, last_token="drop")  # type: ignore[arg-type]


def test_logits_are_refused_with_a_hint(model: TokenClassifier, ids: np.ndarray) -> None:
    def logits(batch: np.ndarray) -> np.ndarray:
        return np.log(model.probabilities(batch)) + 3.0

    with pytest.raises(ValueError, match="apply a softmax"):
        attnflow.evaluate.blank_out(logits, ids, replacement=UNK)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"replacement": 0.5}, TypeError, "`replacement` must be the integer id"),
        ({"score": "ratio"}, ValueError, "`score` must be one of"),
        ({"positions": [N]}, ValueError, "`positions` must lie in"),
        ({"positions": [True]}, TypeError, "`positions` must hold ints"),
        ({"target": 3}, ValueError, r"class index in \[0, 3\)"),
        ({"target": [0, 1]}, ValueError, r"one integer class index per sample, shape \(3,\)"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be a positive int"),
        ({"mask": np.ones((BATCH, N))}, TypeError, "`mask` must be a boolean array"),
        ({"mask": np.ones((BATCH, N + 1), dtype=bool)}, ValueError, "`mask` must have shape"),
    ],
)
def test_bad_arguments_fail_before_predict(
    model: TokenClassifier,
    ids: np.ndarray,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    calls: list[Any] = []

    def predict(batch: np.ndarray, mask: Any = None) -> np.ndarray:
        calls.append(batch)
        return model.probabilities(batch)

    options = {"replacement": UNK, **kwargs}
    with pytest.raises(error, match=match):
        attnflow.evaluate.blank_out(predict, ids, **options)
    # Target errors need the number of classes: only the originals were predicted.
    assert len(calls) <= (1 if "target" in kwargs else 0)


def test_float_inputs_and_wrong_outputs_are_refused(
    model: TokenClassifier, ids: np.ndarray
) -> None:
    with pytest.raises(TypeError, match="token ids"):
        attnflow.evaluate.blank_out(model.probabilities, ids.astype(float), replacement=UNK)
    with pytest.raises(ValueError, match=r"shape \(batch, classes\)"):
        attnflow.evaluate.blank_out(lambda b: model.probabilities(b)[:1], ids, replacement=UNK)
    with pytest.raises(TypeError, match="must be callable"):
        attnflow.evaluate.blank_out("model", ids, replacement=UNK)  # type: ignore[arg-type]
