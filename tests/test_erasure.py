"""Comprehensiveness, sufficiency, deletion and insertion against hand-written loops."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from backends import Variant
from evaluation_models import TokenClassifier, predict_for

import attnflow

VOCABULARY, BATCH, LAYERS, N, MASK_ID = 12, 3, 2, 8, 0
FRACTIONS = (0.1, 0.25, 0.5, 1.0)


@pytest.fixture(scope="module")
def model() -> TokenClassifier:
    return TokenClassifier(vocabulary=VOCABULARY, seed=6)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    ids = rng.integers(1, VOCABULARY, size=(BATCH, N))
    scores = rng.random((BATCH, LAYERS, N))
    scores[0, 0, 2] = scores[0, 0, 5]  # a tie: the earlier position goes first
    return ids, scores


def loop_erasure(
    model: TokenClassifier,
    ids: np.ndarray,
    scores: np.ndarray,
    kind: str,
    eligible: np.ndarray,
) -> np.ndarray:
    """The ERASER definitions, one sequence, explanation and fraction at a time."""
    out = np.full((*scores.shape[:-1], len(FRACTIONS)), np.nan)
    for b in range(ids.shape[0]):
        mask = eligible[b]
        p = model.probabilities(ids[b : b + 1])[0]
        t = int(np.argmax(p))
        candidates = [i for i in range(N) if mask[i]]
        for e in range(scores.shape[1]):
            ranked = sorted(candidates, key=lambda i: (-scores[b, e, i], i))
            for j, f in enumerate(FRACTIONS):
                k = max(1, math.ceil(f * len(candidates)))
                rationale = set(ranked[:k])
                copy = ids[b].copy()
                for i in candidates:
                    removed = i in rationale if kind == "comprehensiveness" else i not in rationale
                    if removed:
                        copy[i] = MASK_ID
                out[b, e, j] = p[t] - model.probabilities(copy[None])[0, t]
    return out


@pytest.mark.parametrize("kind", ["comprehensiveness", "sufficiency"])
def test_equals_definition(
    backend: Variant,
    dtype_name: str,
    model: TokenClassifier,
    data: tuple[np.ndarray, np.ndarray],
    kind: str,
) -> None:
    ids, scores = data
    function = getattr(attnflow.evaluate, kind)
    predict = predict_for(backend, model, dtype_name)
    result = function(
        predict,
        backend.asarray(ids),
        backend.asarray(scores),
        replacement=MASK_ID,
        fractions=FRACTIONS,
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, LAYERS, len(FRACTIONS)))
    expected = loop_erasure(model, ids, scores, kind, np.ones((BATCH, N), dtype=bool))
    tol = 1e-10 if dtype_name == "float64" else 2e-5
    np.testing.assert_allclose(values, expected, rtol=0, atol=tol)
    assert np.abs(expected).max() > 1e-2


def test_where_and_mask_limit_what_is_removed(
    model: TokenClassifier, data: tuple[np.ndarray, np.ndarray]
) -> None:
    ids, scores = data
    mask = np.arange(N)[None, :] < np.array([8, 5, 3])[:, None]
    where = np.ones(N, dtype=bool)
    where[0] = False  # [CLS] stays
    seen: list[np.ndarray] = []

    def predict(batch: np.ndarray, batch_mask: np.ndarray) -> np.ndarray:
        seen.append(batch[~batch_mask])
        return model.probabilities(batch)  # the test model ignores padding differently

    result = attnflow.evaluate.comprehensiveness(
        predict, ids, scores, replacement=MASK_ID, fractions=FRACTIONS, mask=mask, where=where
    )
    expected = loop_erasure(model, ids, scores, "comprehensiveness", mask & where)
    np.testing.assert_allclose(result, expected, rtol=0, atol=1e-12)
    # Padding is never replaced.
    assert all((padded != MASK_ID).all() for padded in seen)


def loop_deletion(
    model: TokenClassifier, ids: np.ndarray, scores: np.ndarray, kind: str, eligible: np.ndarray
) -> np.ndarray:
    """ERASER with the tokens deleted (DeYoung et al.; ALTI's aupc.py): the kept tokens, in
    their order, make a shorter sequence; padding (not eligible, not real) is dropped too."""
    out = np.full((*scores.shape[:-1], len(FRACTIONS)), np.nan)
    for b in range(ids.shape[0]):
        real = eligible[b] if kind == "padding" else np.ones(N, dtype=bool)
        p = model.probabilities(ids[b : b + 1])[0]
        t = int(np.argmax(p))
        candidates = [i for i in range(N) if eligible[b, i]]
        for e in range(scores.shape[1]):
            ranked = sorted(candidates, key=lambda i: (-scores[b, e, i], i))
            for j, f in enumerate(FRACTIONS):
                rationale = set(ranked[: max(1, math.ceil(f * len(candidates)))])
                kept = [
                    i
                    for i in range(N)
                    if real[i]
                    and not (
                        i in rationale
                        if kind == "comprehensiveness"
                        else (i in candidates and i not in rationale)
                    )
                ]
                out[b, e, j] = p[t] - model.probabilities(ids[b, kept][None])[0, t]
    return out


@pytest.mark.parametrize("kind", ["comprehensiveness", "sufficiency"])
def test_deletion_shortens_the_sequence(
    backend: Variant,
    dtype_name: str,
    model: TokenClassifier,
    data: tuple[np.ndarray, np.ndarray],
    kind: str,
) -> None:
    # replacement=None deletes the tokens (issue 23.4: ALTI's AUPC protocol); [CLS] and
    # the last token ([SEP]) stay, as ALTI keeps them.
    ids, scores = data
    where = np.ones((BATCH, N), dtype=bool)
    where[:, [0, -1]] = False
    result = getattr(attnflow.evaluate, kind)(
        predict_for(backend, model, dtype_name),
        backend.asarray(ids),
        backend.asarray(scores),
        replacement=None,
        fractions=FRACTIONS,
        where=backend.asarray(where),
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, LAYERS, len(FRACTIONS)))
    expected = loop_deletion(model, ids, scores, kind, where)
    tol = 1e-10 if dtype_name == "float64" else 2e-5
    np.testing.assert_allclose(values, expected, rtol=0, atol=tol)
    replaced = loop_erasure(model, ids, scores, kind, where)
    assert np.abs(expected - replaced).max() > 1e-2  # deleting is not masking


def test_deletion_drops_padding_and_refuses_empty_inputs(
    model: TokenClassifier, data: tuple[np.ndarray, np.ndarray]
) -> None:
    ids, scores = data
    mask = np.arange(N)[None, :] < np.array([8, 5, 3])[:, None]
    widths: list[tuple[int, bool]] = []

    def predict(batch: np.ndarray, batch_mask: np.ndarray) -> np.ndarray:
        widths.append((batch.shape[1], bool(batch_mask.all())))
        return model.probabilities(batch, batch_mask)

    result = attnflow.evaluate.comprehensiveness(
        predict, ids, scores, replacement=None, fractions=FRACTIONS[:3], mask=mask
    )
    # The originals are predicted with their padding and mask; deleted inputs are cropped.
    assert widths[0] == (N, False)
    assert all(full for _, full in widths[1:])
    for b, length in enumerate((8, 5, 3)):
        p = model.probabilities(ids[b : b + 1, :length])[0]
        t = int(np.argmax(p))
        ranked = sorted(range(length), key=lambda i: (-scores[b, 0, i], i))
        for j, f in enumerate(FRACTIONS[:3]):
            gone = set(ranked[: max(1, math.ceil(f * length))])
            kept = [i for i in range(length) if i not in gone]
            expected = p[t] - model.probabilities(ids[b, kept][None])[0, t]
            assert result[b, 0, j] == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match=r"replacement=None \(deletion\), input 0 would lose"):
        attnflow.evaluate.comprehensiveness(predict, ids, scores, replacement=None, fractions=[1.0])


def test_short_sequences_reuse_model_calls(model: TokenClassifier) -> None:
    ids = np.array([[3, 4, 5]])
    rows: list[int] = []

    def predict(batch: np.ndarray) -> np.ndarray:
        rows.append(len(batch))
        return model.probabilities(batch)

    attnflow.evaluate.comprehensiveness(
        predict, ids, np.array([[0.3, 0.2, 0.1]]), replacement=MASK_ID
    )
    # ERASER's 1, 5, 10 and 20 % all round up to one token of three; 50 % to two.
    assert rows == [1, 2]


def test_repeated_perturbations_are_predicted_once(model: TokenClassifier) -> None:
    # Three layers that rank the tokens alike remove the same tokens at every fraction:
    # the model sees each perturbed sequence once, and the results are unchanged.
    ids = np.array([[3, 4, 5, 6, 7, 8, 9, 10], [10, 9, 8, 7, 6, 5, 4, 3]])  # (2, N)
    ranking = np.stack([np.linspace(0.8, 0.1, N), np.linspace(0.1, 0.8, N)])
    scores = np.stack([ranking * scale for scale in (1.0, 2.0, 3.0)], axis=1)  # (2, 3, 6)

    def counting(rows: list[int]):
        def predict(batch: np.ndarray) -> np.ndarray:
            rows.append(len(batch))
            return model.probabilities(batch)

        return predict

    three: list[int] = []
    one: list[int] = []
    options = {"replacement": MASK_ID, "fractions": FRACTIONS}
    result = attnflow.evaluate.comprehensiveness(counting(three), ids, scores, **options)
    single = attnflow.evaluate.comprehensiveness(counting(one), ids, scores[:, :1], **options)
    np.testing.assert_array_equal(result, np.repeat(single, 3, axis=1))
    assert sum(three) == sum(one)
    expected = loop_erasure(model, ids, scores, "comprehensiveness", np.ones(ids.shape, bool))
    np.testing.assert_allclose(result, expected, rtol=0, atol=1e-12)


def loop_curve(
    model: TokenClassifier, images: np.ndarray, scores: np.ndarray, kind: str
) -> np.ndarray:
    out = []
    for b in range(images.shape[0]):
        order = sorted(range(scores.shape[1]), key=lambda i: (-scores[b, i], i))
        p = model_image_probabilities(model, images[b : b + 1])
        t = int(np.argmax(p))
        curve = []
        for k in range(len(order) + 1):
            image = images[b].copy() if kind == "deletion" else np.full_like(images[b], 0.25)
            for patch in order[:k]:
                r, c = divmod(patch, 3)
                source = (
                    0.25
                    if kind == "deletion"
                    else images[b, :, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2]
                )
                image[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2] = source
            curve.append(model_image_probabilities(model, image[None])[0, t])
        out.append(curve)
    return np.array(out)


def model_image_probabilities(model: TokenClassifier, images: np.ndarray) -> np.ndarray:
    """A fixed classifier of 2-channel 4x6 images (flattened into the token model's states)."""
    flat = images.reshape(images.shape[0], -1)
    logits = np.tanh(flat @ np.resize(model.embeddings.ravel(), (flat.shape[1], 3)))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["deletion", "insertion"])
def test_image_curves_equal_definition(model: TokenClassifier, kind: str) -> None:
    rng = np.random.default_rng(2)
    images = rng.random((2, 2, 4, 6))  # channels first; 2x2 patches: a 2x3 grid
    scores = rng.random((2, 6))
    curve = getattr(attnflow.evaluate, kind)(
        lambda x: model_image_probabilities(model, x),
        images,
        scores,
        replacement=0.25,
        patch_size=2,
    )
    expected = loop_curve(model, images, scores, kind)
    np.testing.assert_allclose(curve.probabilities, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(curve.fractions, np.arange(7) / 6)
    areas = [np.sum((e[1:] + e[:-1]) / 2) / 6 for e in expected]
    np.testing.assert_allclose(curve.area, areas, rtol=0, atol=1e-12)
    # Channels last gives the same curve.
    last = getattr(attnflow.evaluate, kind)(
        lambda x: model_image_probabilities(model, np.moveaxis(x, -1, 1)),
        np.moveaxis(images, 1, -1),
        scores,
        replacement=0.25,
        patch_size=(2, 2),
        channels="last",
    )
    np.testing.assert_allclose(last.probabilities, expected, rtol=0, atol=1e-12)


def test_token_deletion_in_steps(backend: Variant, model: TokenClassifier) -> None:
    ids = np.random.default_rng(4).integers(1, VOCABULARY, size=(2, 6))
    scores = np.random.default_rng(5).random((2, 6))
    predict = predict_for(backend, model, "float64")
    curve = attnflow.evaluate.deletion(
        predict, backend.asarray(ids), backend.asarray(scores), replacement=MASK_ID, steps=3
    )
    values = backend.check(curve.probabilities, dtype_name="float64", shape=(2, 4))
    for b in range(2):
        order = np.argsort(-scores[b], kind="stable")
        p = model.probabilities(ids[b : b + 1])[0]
        t = int(np.argmax(p))
        for step, k in enumerate([0, 2, 4, 6]):
            copy = ids[b].copy()
            copy[order[:k]] = MASK_ID
            assert values[b, step] == pytest.approx(
                model.probabilities(copy[None])[0, t], abs=1e-10
            )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fractions": [0.0]}, ValueError, r"numbers in \(0, 1\]"),
        ({"fractions": []}, TypeError, "non-empty sequence"),
        ({"scores": np.zeros((BATCH, N + 1))}, ValueError, "one score per unit"),
        ({"where": np.ones(N)}, TypeError, "`where` must be a boolean"),
    ],
)
def test_bad_arguments(
    model: TokenClassifier,
    data: tuple[np.ndarray, np.ndarray],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    ids, scores = data
    options = {"replacement": MASK_ID, **kwargs}
    given_scores = options.pop("scores", scores)
    with pytest.raises(error, match=match):
        attnflow.evaluate.comprehensiveness(model.probabilities, ids, given_scores, **options)


def test_bad_curve_arguments(model: TokenClassifier) -> None:
    images = np.zeros((1, 2, 4, 6))
    predict = lambda x: model_image_probabilities(model, x)
    with pytest.raises(ValueError, match="must divide the image size"):
        attnflow.evaluate.deletion(predict, images, np.zeros((1, 6)), replacement=0.0, patch_size=4)
    with pytest.raises(ValueError, match="`channels` must be"):
        attnflow.evaluate.insertion(
            predict, images, np.zeros((1, 6)), replacement=0.0, patch_size=2, channels="middle"
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`steps` must be"):
        attnflow.evaluate.deletion(
            predict, images, np.zeros((1, 6)), replacement=0.0, patch_size=2, steps=0
        )
    with pytest.raises(ValueError, match="one score per unit"):
        attnflow.evaluate.deletion(predict, images, np.zeros((1, 7)), replacement=0.0, patch_size=2)


def test_token_ids_of_more_than_two_axes_are_refused_alike_before_predicting() -> None:
    """blank_out, comprehensiveness, sufficiency and faithfulness read token ids alike."""
    ids = np.ones((2, 3, 4), dtype=np.int64)
    calls: list[object] = []

    def predict(batch: Any) -> np.ndarray:
        calls.append(batch)
        return np.full((len(batch), 2), 0.5)

    scores = np.zeros((2, 3, 4))
    evaluate = attnflow.evaluate
    for call in (
        lambda: evaluate.blank_out(predict, ids, replacement=MASK_ID),
        lambda: evaluate.comprehensiveness(predict, ids, scores, replacement=MASK_ID),
        lambda: evaluate.sufficiency(predict, ids, scores, replacement=MASK_ID),
    ):
        with pytest.raises(ValueError, match=r"must have shape \(batch, tokens\); got shape"):
            call()
    functions = evaluate.ModelFunctions(predict, lambda x, mask: None)
    with pytest.raises(ValueError, match=r"must have shape \(samples, tokens\); got shape"):
        evaluate.faithfulness(functions, ids, replacement=MASK_ID, references=["blank_out"])
    assert calls == []
