"""Reliability under hostile input (issue 11): each bad input gets a clear error or an
honest result, never silent garbage, a clobbered file or a runaway process.

The fault-injection tests (concurrent writers, decompression bombs) are fast and bounded:
each runs in well under a second of work on a noisy 2-core machine.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from backends import Variant
from oracle import softmax_attention

import attnflow

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="a PyTorch-specific input"
)


def _attention(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return softmax_attention(np.random.default_rng(seed), shape)


# -- silent garbage (item 6) ------------------------------------------------------------


@pytest.mark.parametrize("method", [attnflow.rollout, attnflow.flow, attnflow.fuse_heads])
@pytest.mark.parametrize(
    ("bad", "what"),
    [(lambda w: w.mean(axis=-3) * np.nan, "NaN"), (lambda w: w.mean(axis=-3) - 0.5, "negative")],
    ids=["nan", "negative"],
)
def test_a_heads_callable_returning_bad_weights_is_refused(
    method: Any, bad: Any, what: str
) -> None:
    with pytest.raises(ValueError, match=r"`heads` callable must return finite, non-negative"):
        method(_attention((2, 3, 4, 4)), heads=bad)


def test_an_unvalidated_nan_from_a_heads_callable_stays_nan() -> None:
    # Not an identity row: the bad values show in the result.
    result = attnflow.rollout(
        _attention((2, 3, 4, 4)), heads=lambda w: w.mean(axis=-3) * np.nan, validate=False
    )
    assert np.isnan(result).all()


def test_boolean_rows_are_refused_from_every_library(backend: Variant) -> None:
    weights = backend.asarray(_attention((2, 2, 3, 3)))
    selected = backend.asarray(np.array([True, False, True]))
    with pytest.raises(TypeError, match=r"`rows` must hold integer token positions, not a boolean"):
        attnflow.rollout(weights, rows=selected)
    with pytest.raises(TypeError, match=r"`exclude` must hold integer token positions"):
        attnflow.rollout(weights, exclude=selected)


@needs_torch
def test_a_torch_boolean_rows_tensor_is_not_read_as_positions() -> None:
    import torch

    weights = torch.asarray(_attention((2, 2, 3, 3)))
    with pytest.raises(TypeError, match="boolean mask"):
        attnflow.flow(weights, rows=torch.tensor([True, False]))


@pytest.mark.parametrize(
    "options",
    [
        {"normalize": False},
        {"normalize": False, "layers": "all"},
        {"normalize": False, "rows": [3, 1]},
        {"normalize": False, "heads": "each"},
        {"normalize": False, "rows": 2, "layers": "all"},
    ],
)
def test_unvalidated_flow_gives_nan_where_rollout_does(options: dict[str, Any]) -> None:
    weights = _attention((2, 3, 2, 4, 4))
    weights[0, 0, 1, 1, 1] = np.nan  # first sequence, first layer, second head
    rollout_options = {k: v for k, v in options.items() if k != "normalize"}
    expected = np.isnan(attnflow.rollout(weights, validate=False, **rollout_options))
    result = attnflow.flow(weights, validate=False, **options)
    np.testing.assert_array_equal(np.isnan(result), expected)
    assert expected.any()
    # The other sequence is untouched and equals its validated flow.
    np.testing.assert_allclose(result[1], attnflow.flow(weights[1:], **options)[0], atol=1e-12)


def test_unvalidated_flow_with_normalised_rows_gives_nan_rows() -> None:
    weights = _attention((3, 2, 4, 4))
    weights[0, 0, 2, :] = np.nan
    result = attnflow.flow(weights, validate=False)
    assert np.isnan(result).any()
    assert np.all(np.isnan(result).all(axis=-1) | ~np.isnan(result).any(axis=-1))  # whole rows


@pytest.mark.parametrize("max_work", [float("nan"), 0.0, -1.0, "1e9", True])
def test_a_bad_max_work_is_refused(max_work: object) -> None:
    with pytest.raises(ValueError, match=r"`max_work` must be a positive number"):
        attnflow.flow(_attention((2, 2, 3, 3)), max_work=max_work)  # type: ignore[arg-type]


def test_an_infinite_max_work_removes_the_limit() -> None:
    assert attnflow.flow(_attention((2, 2, 3, 3)), max_work=float("inf")).shape == (3, 3)


# -- weak messages (item 7, library) ----------------------------------------------------


@pytest.mark.parametrize(
    "method", [attnflow.rollout, attnflow.flow, attnflow.raw, attnflow.fuse_heads]
)
def test_none_is_named_as_the_missing_attention(method: Any) -> None:
    with pytest.raises(TypeError, match=r"^`attentions` must be an array .* got None\."):
        method(None)


# -- bfloat16 (item 4, library) ---------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("method", [attnflow.rollout, attnflow.raw, attnflow.flow])
def test_bfloat16_tensors_are_accepted_and_returned_as_bfloat16(method: Any) -> None:
    import torch

    weights = torch.asarray(_attention((2, 3, 2, 5, 5))).to(torch.bfloat16)
    result = method(weights, rows=0)
    assert result.dtype == torch.bfloat16
    # The same values widened: float32 checks would refuse bf16 rounding of the row sums.
    expected = method(weights.float(), rows=0, validate=False)
    torch.testing.assert_close(result.float(), expected, atol=2e-2, rtol=2e-2)
