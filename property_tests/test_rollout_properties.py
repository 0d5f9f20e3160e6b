"""Properties of rollout that hold for every valid attention tensor (design card)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from oracle import oracle_raw, oracle_rollout
from strategies import AttentionCase, attention_cases, attention_tensors, masks_for

import attnflow

ATOL = 1e-9


@given(attention_cases(), st.data())
def test_rows_are_non_negative_and_sum_to_one(case: AttentionCase, data: st.DataObject) -> None:
    batch = case.weights.shape[:-4]
    n = case.weights.shape[-1]
    mask = data.draw(st.none() | masks_for(batch, n))
    result = attnflow.rollout(
        case.weights, heads=case.heads, residual=case.residual, layers="all", mask=mask
    )
    assert np.all(result >= 0)
    sums = result.sum(axis=-1)
    expected = np.ones_like(sums)
    if mask is not None:
        expected = np.broadcast_to(mask[..., None, :], sums.shape).astype(float)
    np.testing.assert_allclose(sums, expected, atol=ATOL)
    raw_sums = attnflow.raw(case.weights, heads=case.heads, layers="all", mask=mask).sum(-1)
    np.testing.assert_allclose(raw_sums, expected, atol=ATOL)


@given(attention_cases(max_layers=1))
def test_one_layer_rollout_is_the_residual_mixed_attention(case: AttentionCase) -> None:
    result = attnflow.rollout(case.weights, heads=case.heads, residual=case.residual)
    fused = attnflow.fuse_heads(case.weights, heads=case.heads)[..., 0, :, :]
    n = fused.shape[-1]
    np.testing.assert_allclose(
        result, (1 - case.residual) * fused + case.residual * np.eye(n), atol=ATOL
    )


@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 6),
    st.floats(0, 1),
    st.sampled_from(["mean", "max", "min"]),
)
def test_identity_attention_gives_identity(
    n_layers: int, n_heads: int, n: int, residual: float, heads: str
) -> None:
    identity = np.broadcast_to(np.eye(n), (n_layers, n_heads, n, n))
    result = attnflow.rollout(identity, heads=heads, residual=residual, layers="all")
    np.testing.assert_array_equal(result, np.broadcast_to(np.eye(n), (n_layers, n, n)))


@given(attention_cases(min_layers=2, max_layers=5), st.data())
def test_rollout_composes_across_a_layer_split(case: AttentionCase, data: st.DataObject) -> None:
    # Two layers at least: a one-layer draw has no split to check.
    n_layers = case.weights.shape[-4]
    assert n_layers >= 2, n_layers
    k = data.draw(st.integers(1, n_layers - 1))
    options = {"heads": case.heads, "residual": case.residual}
    bottom = attnflow.rollout(case.weights[..., :k, :, :, :], **options)
    top = attnflow.rollout(case.weights[..., k:, :, :, :], **options)
    full = attnflow.rollout(case.weights, **options)
    np.testing.assert_allclose(full, top @ bottom, atol=ATOL)
    # The same split through `layers`: the rollout at layer k-1 is the bottom part.
    np.testing.assert_allclose(
        attnflow.rollout(case.weights, layers=k - 1, **options), bottom, atol=ATOL
    )


@given(attention_cases(), st.data())
def test_permuting_tokens_permutes_the_result(case: AttentionCase, data: st.DataObject) -> None:
    n = case.weights.shape[-1]
    order = np.array(data.draw(st.permutations(range(n))))
    permuted = case.weights[..., order, :][..., order]
    options = {"heads": case.heads, "residual": case.residual, "layers": "all"}
    result = attnflow.rollout(case.weights, **options)
    result_permuted = attnflow.rollout(permuted, **options)
    np.testing.assert_allclose(result_permuted, result[..., order, :][..., order], atol=ATOL)
    rows = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))
    selected = attnflow.rollout(permuted, rows=rows, **options)
    np.testing.assert_allclose(selected, result[..., order[rows], :][..., order], atol=ATOL)


@given(attention_tensors(batch=(3,)), st.data())
def test_batched_equals_stacked_per_item(weights: np.ndarray, data: st.DataObject) -> None:
    n = weights.shape[-1]
    mask = data.draw(st.none() | masks_for((3,), n))
    rows = data.draw(
        st.none() | st.integers(0, n - 1) | st.lists(st.integers(0, n - 1), min_size=1, max_size=4)
    )
    layers = data.draw(st.sampled_from(["last", "all", 0]))
    batched = attnflow.rollout(weights, rows=rows, layers=layers, mask=mask)
    items = [
        attnflow.rollout(
            weights[i], rows=rows, layers=layers, mask=None if mask is None else mask[i]
        )
        for i in range(3)
    ]
    np.testing.assert_allclose(batched, np.stack(items), atol=1e-12)


@given(attention_cases(), st.data())
def test_matches_the_oracle(case: AttentionCase, data: st.DataObject) -> None:
    batch = case.weights.shape[:-4]
    n = case.weights.shape[-1]
    mask = data.draw(st.none() | masks_for(batch, n))
    rows = data.draw(st.none() | st.lists(st.integers(0, n - 1), min_size=1, max_size=3))
    options = {"heads": case.heads, "rows": rows, "layers": "all", "mask": mask}
    result = attnflow.rollout(case.weights, residual=case.residual, **options)
    np.testing.assert_allclose(
        result, oracle_rollout(case.weights, residual=case.residual, **options), atol=ATOL
    )
    np.testing.assert_allclose(
        attnflow.raw(case.weights, **options), oracle_raw(case.weights, **options), atol=ATOL
    )
