"""Negative rows from each sequence's real end, where the adapters know the mask (issue 40).

The adapters' shared step (``adapters._common.explain_weights``, ``explain_gradients``,
``explain_contributions``, used by the JAX and Keras adapters and the torch adapter's
materialised path) resolves ``rows=-1`` on a right-padded batch to each sequence's last
real token. The reference is each sequence alone, its padding cut off, through the core
function directly; NumPy arrays, no framework.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnflow
from attnflow._real_rows import group_by_real_end, trailing_padding
from attnflow.adapters._common import explain_contributions, explain_gradients, explain_weights

N, LAYERS, HEADS, SHORT = 6, 3, 2, 4


def _causal(rng: np.random.Generator, n: int, shape: tuple[int, ...]) -> np.ndarray:
    weights = rng.random((*shape, n, n)) * np.tril(np.ones((n, n)))
    return weights / weights.sum(-1, keepdims=True)


@pytest.fixture
def right_padded() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A batch of two: one of N tokens, one of SHORT then padding; and the short one alone."""
    rng = np.random.default_rng(40)
    long = _causal(rng, N, (LAYERS, HEADS))
    short = _causal(rng, SHORT, (LAYERS, HEADS))
    padded = np.zeros((LAYERS, HEADS, N, N))
    padded[..., :SHORT, :SHORT] = short
    padded[..., SHORT:, :] = 1.0 / N  # the padding rows: any valid rows
    mask = np.array([[True] * N, [True] * SHORT + [False] * (N - SHORT)])
    return np.stack([long, padded]), mask, long, short


@pytest.mark.parametrize("method", ["rollout", "raw", "flow"])
@pytest.mark.parametrize("rows", [-1, [-2, -1]])
def test_explain_weights_takes_each_sequences_last_real_token(right_padded, method, rows):
    batch, mask, long, short = right_padded
    got = np.asarray(explain_weights(batch, mask, method, rows, "mean", None))
    function = getattr(attnflow, method)
    np.testing.assert_allclose(got[0], function(long, rows=rows), atol=1e-12)
    np.testing.assert_allclose(got[1][..., :SHORT], function(short, rows=rows), atol=1e-12)
    assert not got[1][..., SHORT:].any()


def test_explain_gradients_takes_each_sequences_last_real_token(right_padded):
    batch, mask, _, short = right_padded
    rng = np.random.default_rng(1)
    gradients = rng.normal(size=batch.shape)
    gradients[1][..., SHORT:, :] = 0.0
    gradients[1][..., :, SHORT:] = 0.0
    got = np.asarray(explain_gradients(batch, gradients, mask, -1, None))
    expected = attnflow.gradient_rollout(short, gradients[1][..., :SHORT, :SHORT], rows=-1)
    np.testing.assert_allclose(got[1][:SHORT], expected, atol=1e-12)


def test_explain_contributions_takes_each_sequences_last_real_token(right_padded):
    batch, mask, _, short = right_padded
    fused = batch.mean(axis=2)  # (B, L, n, n) non-negative mixing matrices
    got = np.asarray(explain_contributions(fused, mask, "alti", -1, None))
    expected = explain_contributions(short.mean(axis=1)[None], None, "alti", -1, None)[0]
    np.testing.assert_allclose(got[1][:SHORT], expected, atol=1e-12)


def test_left_padding_and_non_negative_rows_are_unchanged(right_padded):
    batch, mask, _, _ = right_padded
    left = mask[:, ::-1].copy()
    assert trailing_padding(left.tolist()) == [0, 0]
    assert group_by_real_end(-1, [0, 0], N) is None
    assert group_by_real_end([0, 2], [0, 2], N) is None
    got = explain_weights(batch, mask, "rollout", 0, "mean", None)
    np.testing.assert_array_equal(got, attnflow.rollout(batch, rows=0, mask=mask))


def test_a_row_before_the_first_real_token_is_refused():
    with pytest.raises(IndexError, match=r"sequence 1 of the batch has 4"):
        group_by_real_end(-5, [0, 2], 6, real=[6, 4])


@pytest.mark.parametrize("method", ["rollout", "raw", "flow"])
def test_the_cli_takes_each_sequences_last_real_token_with_a_mask(
    right_padded, method, tmp_path, monkeypatch
):
    from attnflow._cli import main

    batch, mask, long, short = right_padded
    monkeypatch.chdir(tmp_path)
    np.save("attn.npy", batch)
    np.save("mask.npy", mask)
    argv = [method, "attn.npy", "--mask", "mask.npy", "--rows", "-1", "-o", "r.npz"]
    assert main([*argv, *(["--no-progress"] if method == "flow" else [])]) == 0
    with np.load("r.npz") as saved:
        got = saved[method]
    function = getattr(attnflow, method)
    np.testing.assert_allclose(got[0], function(long, rows=-1), atol=1e-12)
    np.testing.assert_allclose(got[1][:SHORT], function(short, rows=-1), atol=1e-12)
