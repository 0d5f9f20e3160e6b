"""Properties of gradient-weighted rollout for every valid attention tensor and gradient."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from oracle import oracle_gradient_rollout
from strategies import attention_tensors, masks_for

import attnflow

ATOL = 1e-9


def _gradients(weights: np.ndarray) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float64, weights.shape, elements=st.floats(-5, 5, width=32))


@given(attention_tensors(), st.data())
def test_gae_with_zero_gradients_is_the_identity(weights: np.ndarray, data: st.DataObject) -> None:
    mask = data.draw(st.none() | masks_for(weights.shape[:-4], weights.shape[-1]))
    result = attnflow.gradient_rollout(weights, np.zeros_like(weights), layers="all", mask=mask)
    eye = np.eye(weights.shape[-1])
    if mask is not None:
        eye = eye * mask[..., None, None, :]
    np.testing.assert_array_equal(result, np.broadcast_to(eye, result.shape))


@given(attention_tensors(), st.floats(0.0, 1.0))
def test_weighted_with_unit_gradients_is_rollout(weights: np.ndarray, residual: float) -> None:
    result = attnflow.gradient_rollout(
        weights, np.ones_like(weights), rule="weighted", residual=residual, layers="all"
    )
    expected = attnflow.rollout(weights, residual=residual, layers="all")
    np.testing.assert_allclose(result, expected, atol=ATOL)


@given(attention_tensors(), st.data())
def test_matches_the_oracle_and_weighted_rows_sum_to_one(
    weights: np.ndarray, data: st.DataObject
) -> None:
    gradients = data.draw(_gradients(weights))
    mask = data.draw(st.none() | masks_for(weights.shape[:-4], weights.shape[-1]))
    for rule in ("gae", "weighted"):
        result = attnflow.gradient_rollout(weights, gradients, rule=rule, layers="all", mask=mask)
        expected = oracle_gradient_rollout(weights, gradients, rule=rule, layers="all", mask=mask)
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(result, expected, atol=ATOL * scale, rtol=1e-9)
        assert np.all(result >= 0)
    sums = result.sum(axis=-1)  # the weighted rule: rows of real tokens sum to one
    real = np.ones_like(sums) if mask is None else np.broadcast_to(mask[..., None, :], sums.shape)
    np.testing.assert_allclose(sums, real.astype(float), atol=ATOL)
