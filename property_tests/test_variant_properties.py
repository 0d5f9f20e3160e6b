"""Properties of head-specific (``heads="each"``) and pruned rollout and flow (issue 9)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from oracle import oracle_rollout_variant
from strategies import attention_tensors, masks_for

import attnflow

ATOL = 1e-9

pruning_options = st.one_of(
    st.builds(lambda t: {"threshold": t}, st.floats(0.0, 0.6)),
    st.builds(lambda k: {"top_k": k}, st.integers(1, 7)),
    st.builds(lambda d: {"discard": d}, st.floats(0.0, 0.95)),
)
residuals = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0.0, 1.0)


def _mask(data: st.DataObject, weights: np.ndarray) -> np.ndarray | None:
    drawn: np.ndarray | None = data.draw(
        st.none() | masks_for(weights.shape[:-4], weights.shape[-1])
    )
    return drawn


@given(attention_tensors(), residuals, st.data())
def test_head_maps_averaged_over_heads_equal_the_fused_rollout(
    weights: np.ndarray, residual: float, data: st.DataObject
) -> None:
    mask = _mask(data, weights)
    each = attnflow.rollout(weights, heads="each", residual=residual, layers="all", mask=mask)
    fused = attnflow.rollout(weights, residual=residual, layers="all", mask=mask)
    np.testing.assert_allclose(each.mean(axis=-3), fused, atol=ATOL)


@given(
    attention_tensors(), residuals, pruning_options, st.sampled_from(["mean", "each"]), st.data()
)
def test_pruned_rollout_rows_sum_to_one_and_match_the_oracle(
    weights: np.ndarray, residual: float, pruning: dict[str, Any], heads: str, data: st.DataObject
) -> None:
    mask = _mask(data, weights)
    result = attnflow.rollout(
        weights, heads=heads, residual=residual, layers="all", mask=mask, **pruning
    )
    assert np.all(result >= 0)
    sums = result.sum(axis=-1)
    real = np.ones(weights.shape[:-4] + weights.shape[-1:]) if mask is None else mask
    shape = (*weights.shape[:-4], *([1] * (sums.ndim - len(weights.shape[:-4]) - 1)), -1)
    np.testing.assert_allclose(sums, np.broadcast_to(real.reshape(shape), sums.shape), atol=ATOL)
    expected = oracle_rollout_variant(
        weights, heads=heads, residual=residual, layers="all", mask=mask, **pruning
    )
    np.testing.assert_allclose(result, expected, atol=ATOL)


@given(attention_tensors(), residuals, st.sampled_from(["mean", "each"]), st.data())
def test_pruning_that_drops_nothing_is_plain_rollout(
    weights: np.ndarray, residual: float, heads: str, data: st.DataObject
) -> None:
    mask = _mask(data, weights)
    options = {"heads": heads, "residual": residual, "layers": "all", "mask": mask}
    plain = attnflow.rollout(weights, **options)
    n = weights.shape[-1]
    for nothing in ({"threshold": 0.0}, {"discard": 0.0}, {"top_k": n}, {"top_k": n + 3}):
        np.testing.assert_array_equal(attnflow.rollout(weights, **options, **nothing), plain)


@given(attention_tensors(max_layers=3, max_heads=3, max_tokens=5), residuals, st.data())
def test_head_flows_averaged_are_at_most_the_fused_flow(
    weights: np.ndarray, residual: float, data: st.DataObject
) -> None:
    mask = _mask(data, weights)
    options = {"residual": residual, "layers": "all", "mask": mask, "normalize_result": False}
    each = attnflow.flow(weights, heads="each", n_jobs=1, **options)
    fused = attnflow.flow(weights, n_jobs=1, **options)
    assert np.all(each.mean(axis=-3) <= fused + ATOL)
    np.testing.assert_allclose(each.mean(axis=-3)[..., 0, :, :], fused[..., 0, :, :], atol=ATOL)


@given(attention_tensors(max_layers=2), residuals, pruning_options)
def test_pruned_flow_equals_pruned_rollout_at_the_first_layer(
    weights: np.ndarray, residual: float, pruning: dict[str, Any]
) -> None:
    for heads in ("mean", "each"):
        options = {"heads": heads, "residual": residual, "layers": 0, **pruning}
        np.testing.assert_allclose(
            attnflow.flow(weights, normalize_result=False, n_jobs=1, **options),
            attnflow.rollout(weights, **options),
            atol=ATOL,
        )
