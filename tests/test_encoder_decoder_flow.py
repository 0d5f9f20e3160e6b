"""Encoder-decoder attention flow (issue 9, item 4, "with flow wherever the variant is
defined on a graph") against the independent networkx oracle of ``oracle.py``, on every
backend of the matrix, with masks and batches; closed forms and properties; messages."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import oracle_encoder_decoder_flow, softmax_attention

import attnflow

BATCH, L_E, L_D, H, S, T = 2, 2, 2, 2, 5, 4
SOURCE_MASK = np.array([[True] * S, [False] + [True] * 3 + [False]])
TARGET_MASK = np.array([[True] * T, [True] * 3 + [False]])


def _causal(weights: np.ndarray) -> np.ndarray:
    lower = np.tril(np.ones(weights.shape[-2:], bool))
    weights = np.where(lower, weights, 0.0)
    return weights / weights.sum(axis=-1, keepdims=True)


@functools.cache
def _inputs(dtype_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20261124)
    encoder = softmax_attention(rng, (BATCH, L_E, H, S, S), scale=2.0)
    decoder = _causal(softmax_attention(rng, (BATCH, L_D, H, T, T), scale=2.0))
    cross = softmax_attention(rng, (BATCH, L_D, H, T, S), scale=2.0)
    return encoder.astype(dtype_name), decoder.astype(dtype_name), cross.astype(dtype_name)


def _shapes(options: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lead: tuple[int, ...] = (BATCH, L_D) if options.get("layers") == "all" else (BATCH,)
    rows = options.get("rows")
    middle: tuple[int, ...] = (
        (T,) if rows is None else () if isinstance(rows, int) else (len(rows),)
    )
    return (*lead, *middle, S), (*lead, *middle, T)


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "raw": {"normalize": False},
    "rows=0,layers=all": {"rows": 0, "layers": "all"},
    "rows=[3,1],raw": {"rows": [3, 1], "normalize": False},
    "layers=0,residual=0.2": {"layers": 0, "residual": 0.2, "normalize": False},
}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_networkx_oracle(
    backend: Variant, dtype_name: str, case: str, masked: bool
) -> None:
    options = CASES[case]
    arrays = _inputs(dtype_name)
    native = [backend.asarray(x) for x in arrays]
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK} if masked else {}
    native_masks = {name: backend.asarray(m) for name, m in masks.items()}
    if backend.jit:
        jax = backend.modules["jax"]
        with pytest.raises(TypeError, match=r"outside `jax\.jit`"):
            jax.jit(lambda *a: tuple(attnflow.encoder_decoder_flow(*a, **options)))(*native)
        return
    source, target = attnflow.encoder_decoder_flow(*native, **native_masks, **options)
    source_shape, target_shape = _shapes(options)
    got_s = backend.check(source, dtype_name=dtype_name, shape=source_shape)
    got_t = backend.check(target, dtype_name=dtype_name, shape=target_shape)
    want_s, want_t = oracle_encoder_decoder_flow(
        *(x.astype(np.float64) for x in arrays), **masks, **options
    )
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(got_s, want_s, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_t, want_t, rtol=tol, atol=tol)
    if masked and "rows" not in options:  # padding gets nothing and carries nothing
        assert np.all(got_s[1, ..., 0] == 0)
        assert np.all(got_s[1, ..., 4] == 0)
        assert np.all(got_s[1, ..., 3, :] == 0)
        assert np.all(got_t[1, ..., 3, :] == 0)
        assert np.all(got_t[1, ..., 3] == 0)


def test_one_layer_each_is_the_closed_form() -> None:
    # x_1[t] -> x_0[u] is one edge; x_1[t] -> e_1[s'] -> e_0[s] are parallel paths.
    encoder, decoder, cross = (x[0, :1] for x in _inputs("float64"))
    for alpha in (0.0, 0.3, 0.5, 1.0):
        source, target = attnflow.encoder_decoder_flow(
            encoder, decoder, cross, residual=alpha, normalize=False
        )
        e = (1 - alpha) * encoder[0].mean(0) + alpha * np.eye(S)
        d = alpha * ((1 - alpha) * decoder[0].mean(0) + alpha * np.eye(T))
        c = (1 - alpha) * cross[0].mean(0)
        paths = np.minimum(c[:, :, None], e[None, :, :]).sum(axis=1)  # (T, S)
        np.testing.assert_allclose(source, paths, atol=1e-14)
        np.testing.assert_allclose(target, d, atol=1e-14)


def test_full_residual_attributes_each_position_to_itself() -> None:
    source, target = attnflow.encoder_decoder_flow(*_inputs("float64"), residual=1.0)
    assert np.all(source == 0)
    np.testing.assert_array_equal(target, np.broadcast_to(np.eye(T), target.shape))


def test_raw_flow_is_at_most_one_and_layers_all_repeats_each_layer() -> None:
    arrays = _inputs("float64")
    every = attnflow.encoder_decoder_flow(*arrays, layers="all", normalize=False)
    # Each max-flow is at most the capacity out of x_l[t], which is one (each token is
    # its own problem: the values of a row are not shares of one unit).
    assert np.all(every.source <= 1 + 1e-12)
    assert np.all(every.target <= 1 + 1e-12)
    assert np.all(every.source >= 0)
    assert np.all(every.target >= 0)
    for layer in range(L_D):
        one = attnflow.encoder_decoder_flow(*arrays, layers=layer, normalize=False)
        np.testing.assert_array_equal(one.source, every.source[:, layer])
        np.testing.assert_array_equal(one.target, every.target[:, layer])


def test_causal_decoder_flows_only_to_earlier_positions() -> None:
    _, target = attnflow.encoder_decoder_flow(*_inputs("float64"), layers="all")
    upper = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(target[..., upper] == 0)


def test_fused_input_equals_the_mean_over_heads() -> None:
    arrays = _inputs("float64")
    fused = attnflow.encoder_decoder_flow(*(x.mean(axis=-3) for x in arrays), heads=None)
    plain = attnflow.encoder_decoder_flow(*arrays)
    for got, expected in zip(fused, plain, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-14)


def test_nan_input_without_validation_gives_nan_not_a_guess() -> None:
    encoder, decoder, cross = (x.copy() for x in _inputs("float64"))
    encoder[1, 0, 0, 2, 2] = np.nan
    source, target = attnflow.encoder_decoder_flow(encoder, decoder, cross, validate=False)
    assert np.all(np.isnan(source[1]))
    assert np.all(np.isnan(target[1]))
    assert np.all(np.isfinite(source[0]))
    assert np.all(np.isfinite(target[0]))


def test_progress_bar_counts_every_max_flow(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    attnflow.encoder_decoder_flow(*_inputs("float64"), rows=[0, 1], progress=True)
    assert f"{BATCH * 2 * (S + T)}/{BATCH * 2 * (S + T)}" in capsys.readouterr().err


ERRORS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "max_work": ({"max_work": 10.0}, ValueError, r"above `max_work`=10.*`rows=`"),
    "max_work nan": ({"max_work": float("nan")}, ValueError, "`max_work` must be a positive"),
    "progress": ({"progress": "yes"}, TypeError, "`progress` must be True or False"),
    "normalize": ({"normalize": 1}, TypeError, "`normalize` must be True or False"),
    "rows": ({"rows": T}, IndexError, "`rows` must index"),
    "layers": ({"layers": L_D}, IndexError, "`layers` must index"),
    "shapes": ({"cross": np.ones((L_D, H, T, S + 1))}, ValueError, "S = 5 key columns"),
    "row sums": ({"cross": np.ones((L_D, H, T, S))}, ValueError, "rows must sum to 1"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_validation_messages(case: str) -> None:
    options, error, match = ERRORS[case]
    encoder, decoder, cross = (x[0] for x in _inputs("float64"))
    cross = options.pop("cross", cross)
    with pytest.raises(error, match=match):
        attnflow.encoder_decoder_flow(encoder, decoder, cross, **options)
