"""Properties of attention flow that hold for every valid attention tensor (design card)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import AttentionCase, attention_cases, masks_for

import attnflow

SMALL = {"max_layers": 3, "max_heads": 2, "max_tokens": 5}
ATOL = 1e-9


@settings(max_examples=40)
@given(attention_cases(**SMALL))
def test_first_layer_flow_equals_rollout_equals_mixed_attention(case: AttentionCase) -> None:
    options = {"heads": case.heads, "residual": case.residual, "layers": 0}
    first_flow = attnflow.flow(case.weights, normalize_result=False, n_jobs=1, **options)
    first_rollout = attnflow.rollout(case.weights, **options)
    fused = attnflow.fuse_heads(case.weights, heads=case.heads)[..., 0, :, :]
    mixed = (1 - case.residual) * fused + case.residual * np.eye(fused.shape[-1])
    np.testing.assert_allclose(first_flow, mixed, atol=ATOL)
    np.testing.assert_allclose(first_rollout, mixed, atol=ATOL)


@settings(max_examples=40)
@given(attention_cases(**SMALL), st.data())
def test_normalised_flow_rows_are_non_negative_and_sum_to_one(
    case: AttentionCase, data: st.DataObject
) -> None:
    batch, n = case.weights.shape[:-4], case.weights.shape[-1]
    mask = data.draw(st.none() | masks_for(batch, n))
    result = attnflow.flow(
        case.weights, heads=case.heads, residual=case.residual, layers="all", mask=mask, n_jobs=1
    )
    assert np.all(result >= 0)
    expected = np.ones(result.shape[:-1])
    if mask is not None:
        expected = np.broadcast_to(mask[..., None, :], expected.shape).astype(float)
    np.testing.assert_allclose(result.sum(axis=-1), expected, atol=ATOL)


@settings(max_examples=40)
@given(attention_cases(**SMALL))
def test_raw_flow_is_bounded_by_one_and_by_the_capacity_into_its_sink(
    case: AttentionCase,
) -> None:
    options = {"heads": case.heads, "residual": case.residual, "layers": "all"}
    raw = attnflow.flow(case.weights, normalize_result=False, n_jobs=1, **options)
    assert np.all(raw <= 1 + ATOL)
    first = attnflow.rollout(case.weights, heads=case.heads, residual=case.residual, layers=0)
    into_sink = first.sum(axis=-2)  # all capacity entering input token m
    assert np.all(raw <= into_sink[..., None, None, :] + ATOL)
    # Rollout routes flow proportionally, which is one feasible flow: max-flow is no less.
    assert np.all(raw >= attnflow.rollout(case.weights, **options) - ATOL)


@settings(max_examples=30)
@given(attention_cases(**SMALL), st.data())
def test_flow_is_invariant_to_token_permutation(case: AttentionCase, data: st.DataObject) -> None:
    n = case.weights.shape[-1]
    order = np.array(data.draw(st.permutations(range(n))))
    permuted = case.weights[..., order, :][..., order]
    options = {
        "heads": case.heads,
        "residual": case.residual,
        "normalize_result": False,
        "n_jobs": 1,
    }
    result = attnflow.flow(case.weights, **options)
    result_permuted = attnflow.flow(permuted, **options)
    np.testing.assert_allclose(result_permuted, result[..., order, :][..., order], atol=ATOL)
