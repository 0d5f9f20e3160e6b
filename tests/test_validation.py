"""Bad input fails early, with a message naming the parameter, expected and actual value."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from oracle import softmax_attention

import attnflow


@pytest.fixture
def good() -> np.ndarray:
    return softmax_attention(np.random.default_rng(0), (2, 3, 2, 5, 5))


def _with(array: np.ndarray, index: tuple[Any, ...], value: float) -> np.ndarray:
    out = array.copy()
    out[index] = value
    return out


# fmt: off
BAD_INPUTS = [
    (lambda a: a[0, 0, 0], {}, ValueError, r"`attentions` must have shape .* at least 4"),
    (lambda a: a[0, 0, 0], {"heads": None}, ValueError, r"at least 3 dimensions"),
    (lambda a: a[..., :4], {}, ValueError, r"square in its last two axes.*5 queries and 4 keys"),
    (lambda a: a[:, :0], {}, ValueError, r"at least one layer"),
    (lambda a: (a * 10).astype(np.int64), {}, TypeError, r"real floating dtype.*int64"),
    (lambda a: a.astype(np.complex128), {}, TypeError, r"real floating dtype"),
    (lambda a: _with(a, (0, 1, 1, 2, 3), np.nan), {}, ValueError, r"must be finite"),
    (lambda a: _with(a, (1, 2, 0, 4, 0), np.inf), {}, ValueError, r"must be finite"),
    (lambda a: _with(a, (0, 0, slice(None), 0, 0), -0.1), {}, ValueError, r"averaged over heads, must be non-negative.*-0.1"),
    (lambda a: _with(a, (0, 0, 0, 0, 0), -0.1), {"validate": "heads"}, ValueError, r"`attentions` must be non-negative.*-0.1"),
    (lambda a: _with(a, (0, 0, 0, 0, 0), -0.1), {"heads": "max"}, ValueError, r"`attentions` must be non-negative"),
    (lambda a: a * 1.01, {}, ValueError, r"rows must sum to 1.*deviation is 0.01"),
    (lambda a: np.swapaxes(a * [1, 2, 3, 4, 5], -1, -2), {}, ValueError, r"rows must sum to 1"),
    (lambda a: a, {"rows": 5}, IndexError, r"`rows` must index the 5 output positions.*got 5"),
    (lambda a: a, {"rows": [0, -6]}, IndexError, r"`rows`.*got -6"),
    (lambda a: a, {"rows": []}, ValueError, r"`rows` must name at least one"),
    (lambda a: a, {"rows": 1.0}, TypeError, r"`rows` must be None, an integer"),
    (lambda a: a, {"rows": True}, TypeError, r"`rows` must hold integer"),
    (lambda a: a, {"rows": "0"}, TypeError, r"`rows`"),
    (lambda a: a, {"layers": "first"}, ValueError, r"`layers` must be 'last', 'all'.*'first'"),
    (lambda a: a, {"layers": 3}, IndexError, r"`layers` must index the 3 layers.*got 3"),
    (lambda a: a, {"layers": 1.5}, TypeError, r"`layers`"),
    (lambda a: a, {"heads": "median"}, ValueError, r"`heads` must be one of 'mean', 'max', 'min'.*'median'"),
    (lambda a: a, {"heads": [1.0, 2.0, 3.0]}, ValueError, r"`heads` weights must have shape \(2,\) or \(3, 2\).*\(3,\)"),
    (lambda a: a, {"heads": [1.0, -1.0]}, ValueError, r"finite and non-negative"),
    (lambda a: a, {"heads": [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]}, ValueError, r"positive total weight"),
    (lambda a: a, {"heads": object()}, TypeError, r"`heads` must be"),
    (lambda a: a, {"residual": 1.5}, ValueError, r"`residual` must be in \[0, 1\].*1.5"),
    (lambda a: a, {"residual": -0.1}, ValueError, r"`residual` must be in \[0, 1\]"),
    (lambda a: a, {"residual": float("nan")}, ValueError, r"`residual`"),
    (lambda a: a, {"residual": "0.5"}, TypeError, r"`residual` must be a real number"),
    (lambda a: a, {"residual": True}, TypeError, r"`residual` must be a real number"),
    (lambda a: a, {"validate": 1}, TypeError, r"`validate` must be True .*'heads'.* or False; got 1"),
    (lambda a: a, {"validate": "yes"}, TypeError, r"`validate` must be True"),
    (lambda a: a, {"mask": np.ones((2, 4), bool)}, ValueError, r"`mask` must have shape \(\*batch, n\) = \(2, 5\).*\(2, 4\)"),
    (lambda a: a, {"mask": np.ones((2, 5))}, TypeError, r"`mask` must have a boolean dtype.*float64"),
    (lambda a: a, {"mask": [[True] * 5] * 2}, TypeError, r"`mask` must be an array"),
    (lambda a: a, {"mask": np.array([[True] * 5, [False] * 5])}, ValueError, r"`mask` masks every token"),
    (lambda a: [a[:, 0], a[:, 1, :, :4, :4]], {}, ValueError, r"every layer in `attentions` must have the same shape.*`attentions\[1\]`"),
    (lambda a: [a[:, 0], a[:, 1].astype(np.float32)], {}, ValueError, r"same shape .* and dtype"),
    (lambda a: [], {}, ValueError, r"at least one layer; got an empty sequence"),
    (lambda a: a.tolist(), {}, TypeError, r"`attentions\[0\]` must be an array|array-API library"),
    (lambda a: "attention", {}, TypeError, r"`attentions` must be an array of an array-API library"),
]
# fmt: on


@pytest.mark.parametrize(("make", "options", "error", "match"), BAD_INPUTS)
def test_bad_input_is_rejected_with_a_clear_message(
    good: np.ndarray, make: Any, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        attnflow.rollout(make(good), **options)


def test_validate_false_accepts_non_stochastic_rows(good: np.ndarray) -> None:
    scaled = good * 1.01
    result = attnflow.rollout(scaled, rows=0, validate=False, residual=0.0)
    layers = scaled.mean(axis=2)
    expected = (layers[:, 2] @ layers[:, 1] @ layers[:, 0])[:, 0]
    np.testing.assert_allclose(result, expected, rtol=1e-12)


def test_float32_softmax_cast_to_float64_passes_validation() -> None:
    rng = np.random.default_rng(1)
    weights = softmax_attention(rng, (2, 4, 3, 197, 197)).astype(np.float32).astype(np.float64)
    attnflow.rollout(weights, rows=0)  # must not raise


def test_checks_run_before_any_work(good: np.ndarray) -> None:
    calls: list[object] = []

    def spy(weights: Any) -> Any:
        calls.append(weights)
        return weights.mean(axis=-3)

    with pytest.raises(ValueError, match="`mask`"):
        attnflow.rollout(good, heads=spy, mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="rows must sum to 1"):
        attnflow.rollout(good * 2, heads=spy)
    assert calls == []


def test_callable_returning_wrong_shape(good: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"`heads` callable must reduce the heads axis"):
        attnflow.rollout(good, heads=lambda w: w)


def test_mixed_libraries_are_refused(good: np.ndarray) -> None:
    strict = pytest.importorskip("array_api_strict")
    with pytest.raises(TypeError, match="one array library"):
        attnflow.rollout(strict.asarray(good), mask=np.ones((2, 5), bool))


def test_padded_rows_may_hold_nan_only_with_a_mask(good: np.ndarray) -> None:
    padded = _with(good, (0, slice(None), slice(None), 4, slice(None)), np.nan)
    with pytest.raises(ValueError, match="Pass the padding `mask`"):
        attnflow.rollout(padded)
    mask = np.ones((2, 5), bool)
    mask[0, 4] = False
    assert np.all(np.isfinite(attnflow.rollout(padded, mask=mask)))


def test_inputs_are_not_modified(good: np.ndarray) -> None:
    data = _with(good, (1, slice(None), slice(None), 3, slice(None)), np.nan)
    mask = np.ones((2, 5), bool)
    mask[1, 3] = False
    before, mask_before = data.copy(), mask.copy()
    attnflow.rollout(data, mask=mask, heads="max", layers="all")
    attnflow.raw(data, mask=mask)
    np.testing.assert_array_equal(data, before)
    np.testing.assert_array_equal(mask, mask_before)


def test_building_block_errors() -> None:
    with pytest.raises(ValueError, match=r"`attention` must have shape \(\.\.\., n, n\)"):
        attnflow.add_residual(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="`residual`"):
        attnflow.add_residual(np.eye(3), residual=2.0)
    with pytest.raises(
        ValueError, match=r"`attentions` must have shape \(\.\.\., heads, queries, keys\)"
    ):
        attnflow.fuse_heads(np.eye(3))
    with pytest.raises(ValueError, match="need a layer axis"):
        attnflow.fuse_heads(np.ones((2, 3, 3)) / 3, heads=[[1.0, 1.0]])


def test_default_checks_the_fused_layers_and_heads_checks_every_head(good: np.ndarray) -> None:
    # Two heads whose row sums err in opposite directions: their mean is row-stochastic,
    # so the default (which checks what rollout consumes) accepts it; "heads" does not.
    skewed = good.copy()
    skewed[..., 0, :, :] *= 1.1
    skewed[..., 1, :, :] *= 0.9
    attnflow.rollout(skewed)
    with pytest.raises(ValueError, match=r"`attentions` rows must sum to 1"):
        attnflow.rollout(skewed, validate="heads")
    with pytest.raises(ValueError, match=r"`attentions` rows must sum to 1"):
        attnflow.rollout(skewed, heads="max")  # renormalising fusions check every head
