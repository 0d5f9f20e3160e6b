"""Negative rows from each sequence's real end, wherever the mask is known.

The core functions (rollout, raw, flow, gradient_rollout, the encoder-decoder ones and
flow_cost) resolve them themselves, eagerly or, for a traced or lazy mask, with array
operations. The adapters' shared step (``adapters._common.explain_weights``, ``explain_gradients``,
``explain_contributions``, used by the JAX and Keras adapters and the torch adapter's
materialised path) resolves ``rows=-1`` on a right-padded batch to each sequence's last
real token. The reference is each sequence alone, its padding cut off, through the core
function directly; NumPy arrays, no framework.
"""

from __future__ import annotations

import numpy as np
import pytest
from backends import tolerance

import attnflow
from attnflow._methods import METHODS
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


# -- the core functions themselves, on every backend of the matrix ---------------------


def _core(method: str, gradients: object = None):
    if method == "gradient_rollout":
        return lambda attentions, **options: attnflow.gradient_rollout(
            attentions, gradients, **options
        )
    return getattr(attnflow, method)


@pytest.mark.parametrize("method", ["rollout", "raw", "flow", "gradient_rollout"])
@pytest.mark.parametrize("rows", [-1, [0, -2, -1]])
def test_core_functions_count_negative_rows_from_each_sequences_real_end(
    right_padded, backend, dtype_name, method, rows
):
    batch, mask, long, short = right_padded
    gradients = np.random.default_rng(2).normal(size=batch.shape)
    gradients[1][..., SHORT:, :] = 0.0
    gradients[1][..., :, SHORT:] = 0.0
    native = backend.asarray(batch, dtype_name)
    options = {"rows": rows, "mask": backend.asarray(mask)}
    if backend.refuses_jit(method, native, **options):
        return
    function = _core(method, backend.asarray(gradients, dtype_name))
    width = 1 if isinstance(rows, int) else len(rows)
    shape = (2, N) if isinstance(rows, int) else (2, width, N)
    # Max-flow runs on the host, so it reads a Dask graph (the mask too) by design; the
    # others must build a lazy graph, which backend.run checks.
    host = backend.library == "dask" and METHODS[method].host_only
    result = function(native, **options) if host else backend.run(function, native, **options)
    got = backend.check(result, dtype_name=dtype_name, shape=shape)
    # The references: each sequence alone, its padding cut off, in float64 NumPy.
    reference = _core(method, gradients[0])
    np.testing.assert_allclose(got[0], reference(long, rows=rows), atol=tolerance(dtype_name))
    reference = _core(method, gradients[1][..., :SHORT, :SHORT])
    expected = reference(short, rows=rows)
    np.testing.assert_allclose(got[1][..., :SHORT], expected, atol=tolerance(dtype_name))
    assert not got[1][..., SHORT:].any()


def test_several_batch_axes_every_layer_and_the_cost_estimate(right_padded):
    batch, mask, _, short = right_padded
    two = np.stack([batch, batch[::-1]])  # (2, 2, L, H, n, n)
    masks = np.stack([mask, mask[::-1]])
    got = attnflow.rollout(two, mask=masks, rows=[-1], layers="all")
    assert got.shape == (2, 2, LAYERS, 1, N)
    expected = attnflow.rollout(short, rows=[-1], layers="all")
    np.testing.assert_allclose(got[0, 1][..., :SHORT], expected, atol=1e-12)
    np.testing.assert_allclose(got[1, 0][..., :SHORT], expected, atol=1e-12)
    # flow_cost prices what flow solves: the last real rows of both sequences.
    assert attnflow.flow_cost(batch, mask=mask, rows=-1) == attnflow.flow_cost(
        batch, mask=mask, rows=[SHORT - 1, N - 1]
    )


def test_encoder_decoder_rows_count_from_the_targets_real_end():
    rng = np.random.default_rng(3)
    source_n, layers = 5, 2
    encoder = _causal(rng, source_n, (2, layers, HEADS))
    cross = rng.random((2, layers, HEADS, N, source_n))
    cross /= cross.sum(-1, keepdims=True)
    decoder = _causal(rng, N, (2, layers, HEADS))
    target_mask = np.array([[True] * N, [True] * SHORT + [False] * (N - SHORT)])
    got = attnflow.encoder_decoder_rollout(
        encoder, decoder, cross, rows=-1, target_mask=target_mask
    )
    alone = attnflow.encoder_decoder_rollout(
        encoder[1], decoder[1][..., :SHORT, :SHORT], cross[1][..., :SHORT, :], rows=-1
    )
    np.testing.assert_allclose(got.source[1], alone.source, atol=1e-12)
    np.testing.assert_allclose(got.target[1][:SHORT], alone.target, atol=1e-12)
