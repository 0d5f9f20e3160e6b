"""Encoder-decoder rollout and Chefer's encoder-decoder GAE rules (issue 9, item 4)
against the independent float64 oracle of ``oracle.py``, on every backend of the matrix
(under ``jax.jit`` too, Dask without computing), with masks and batches; properties of
the composition; validation messages."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import oracle_encoder_decoder, softmax_attention

import attnflow

BATCH, L_E, L_D, H, S, T = 3, 2, 3, 2, 6, 5
SOURCE_MASK = np.array([[True] * S, [True] * 4 + [False] * 2, [False] + [True] * 5])
TARGET_MASK = np.array([[True] * T, [True] * 3 + [False] * 2, [True] * T])


def _causal(weights: np.ndarray) -> np.ndarray:
    lower = np.tril(np.ones(weights.shape[-2:], bool))
    weights = np.where(lower, weights, 0.0)
    return weights / weights.sum(axis=-1, keepdims=True)


@functools.cache
def _inputs(dtype_name: str) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(20261123)
    encoder = softmax_attention(rng, (BATCH, L_E, H, S, S), scale=2.0)
    decoder = _causal(softmax_attention(rng, (BATCH, L_D, H, T, T), scale=2.0))
    cross = softmax_attention(rng, (BATCH, L_D, H, T, S), scale=2.0)
    grads = [rng.normal(size=x.shape) for x in (encoder, decoder, cross)]
    return tuple(x.astype(dtype_name) for x in (encoder, decoder, cross, *grads))


def _call(backend: Variant, arrays: list[Any], options: dict[str, Any]) -> Any:
    """Call the function as this variant's users would (jit, Dask without computing)."""
    names = ["encoder", "decoder", "cross", "g0", "g1", "g2", "source_mask", "target_mask"]
    given = {n: a for n, a in zip(names, arrays, strict=True) if a is not None}

    def function(**kw: Any) -> Any:
        grads = (kw["g0"], kw["g1"], kw["g2"]) if "g0" in kw else None
        extra = {"gradients": grads} if grads is not None else {}
        return attnflow.encoder_decoder_rollout(
            kw["encoder"],
            kw["decoder"],
            kw["cross"],
            **extra,
            source_mask=kw.get("source_mask"),
            target_mask=kw.get("target_mask"),
            **options,
        )

    if backend.jit:
        jax = backend.modules["jax"]
        return tuple(jax.jit(lambda kw: tuple(function(**kw)))(given))
    if backend.library == "dask":
        import dask
        from backends import _forbid_compute

        with dask.config.set(scheduler=_forbid_compute):
            return function(**given)
    return function(**given)


def _shapes(options: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lead: tuple[int, ...] = (BATCH, L_D) if options.get("layers") == "all" else (BATCH,)
    rows = options.get("rows")
    middle: tuple[int, ...] = (
        (T,) if rows is None else () if isinstance(rows, int) else (len(rows),)
    )
    return (*lead, *middle, S), (*lead, *middle, T)


CASES: dict[str, dict[str, Any]] = {
    "rollout": {},
    "rollout,rows=0": {"rows": 0},
    "rollout,rows=[4,1],layers=all": {"rows": [4, 1], "layers": "all"},
    "rollout,layers=1": {"layers": 1},
    "rollout,residual=0.2,layers=all": {"residual": 0.2, "layers": "all"},
    "rollout,residual=0": {"residual": 0.0},
    "gae": {"rule": "gae"},
    "gae,layers=all,rows=[2]": {"rule": "gae", "layers": "all", "rows": [2]},
    "gae,normalize_result": {"rule": "gae", "normalize_result": True, "rows": -1},
}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_oracle(backend: Variant, dtype_name: str, case: str, masked: bool) -> None:
    options = CASES[case]
    encoder, decoder, cross, *grads = _inputs(dtype_name)
    gae = options.get("rule") == "gae"
    arrays = [
        *(backend.asarray(x) for x in (encoder, decoder, cross)),
        *((backend.asarray(g) for g in grads) if gae else (None,) * 3),
        *((backend.asarray(SOURCE_MASK), backend.asarray(TARGET_MASK)) if masked else (None,) * 2),
    ]
    source, target = _call(backend, arrays, options)
    source_shape, target_shape = _shapes(options)
    got_s = backend.check(source, dtype_name=dtype_name, shape=source_shape)
    got_t = backend.check(target, dtype_name=dtype_name, shape=target_shape)
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK} if masked else {}
    want_s, want_t = oracle_encoder_decoder(
        encoder, decoder, cross, gradients=tuple(grads) if gae else None, **masks, **options
    )
    tol = tolerance(dtype_name)
    for got, want in ((got_s, want_s), (got_t, want_t)):
        # GAE relevance is not bounded by one: the absolute tolerance scales with it.
        scale = max(float(np.abs(want).max()), 1e-3)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    if masked and "rows" not in options:  # padding gets nothing and carries nothing
        assert np.all(got_s[1, ..., 4:] == 0)
        assert np.all(got_s[2, ..., 0] == 0)
        assert np.all(got_s[1, ..., 3:, :] == 0)
        assert np.all(got_t[1, ..., 3:, :] == 0)
        assert np.all(got_t[1, ..., 3:] == 0)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_rows_sum_to_one_over_source_and_target(masked: bool) -> None:
    encoder, decoder, cross, *_ = _inputs("float64")
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK} if masked else {}
    for residual in (0.0, 0.3, 0.5, 0.9):
        source, target = attnflow.encoder_decoder_rollout(
            encoder, decoder, cross, residual=residual, layers="all", **masks
        )
        totals = source.sum(-1) + target.sum(-1)  # (batch, L_d, T)
        real = np.broadcast_to(TARGET_MASK[:, None, :] if masked else True, totals.shape)
        np.testing.assert_allclose(totals[real], 1.0, atol=1e-12)
        assert np.all(totals[~real] == 0)
        # the split is fixed by the rollout model: source share 1 - alpha^l after l layers
        for layer in range(L_D):
            np.testing.assert_allclose(
                source[:, layer].sum(-1)[real[:, layer]], 1 - residual ** (layer + 1), atol=1e-12
            )


def test_full_residual_attributes_each_position_to_itself() -> None:
    encoder, decoder, cross, *_ = _inputs("float64")
    source, target = attnflow.encoder_decoder_rollout(encoder, decoder, cross, residual=1.0)
    assert np.all(source == 0)
    np.testing.assert_array_equal(target, np.broadcast_to(np.eye(T), target.shape))


def test_one_layer_each_equals_the_hand_computed_example() -> None:
    # S = 3, T = 2, alpha = 0.5, one head.
    enc = np.array([[[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.25, 0.25, 0.5]]]])
    dec = np.array([[[[1.0, 0.0], [0.5, 0.5]]]])
    crs = np.array([[[[0.0, 0.0, 1.0], [0.5, 0.5, 0.0]]]])
    source, target = attnflow.encoder_decoder_rollout(enc, dec, crs)
    # R_enc = 0.5 E + 0.5 I; D~ = 0.5 D + 0.5 I; X^s = 0.5 C R_enc; X^t = 0.5 D~.
    r_enc = np.array([[0.75, 0.25, 0.0], [0.0, 1.0, 0.0], [0.125, 0.125, 0.75]])
    np.testing.assert_allclose(r_enc, 0.5 * enc[0, 0] + 0.5 * np.eye(3))
    expected_source = 0.5 * np.array([[0.125, 0.125, 0.75], [0.375, 0.625, 0.0]])
    expected_target = 0.5 * np.array([[1.0, 0.0], [0.25, 0.75]])
    np.testing.assert_allclose(source, expected_source, atol=1e-15)
    np.testing.assert_allclose(target, expected_target, atol=1e-15)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_gae_with_zero_gradients_is_the_identity(masked: bool) -> None:
    encoder, decoder, cross, *grads = _inputs("float64")
    zeros = tuple(np.zeros_like(g) for g in grads)
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK} if masked else {}
    source, target = attnflow.encoder_decoder_rollout(
        encoder, decoder, cross, rule="gae", gradients=zeros, layers="all", **masks
    )
    assert np.all(source == 0)
    eye = np.broadcast_to(np.eye(T), target.shape)
    if masked:
        eye = eye * TARGET_MASK[:, None, None, :]
    np.testing.assert_array_equal(target, eye)


def test_gae_matches_chefer_when_no_row_is_empty() -> None:
    """With positive weights everywhere, our 0/0 handling never triggers: equal to a
    literal transcription of Chefer's DETR loop (one item, torch-free)."""
    encoder, decoder, cross, *_ = _inputs("float64")
    grads = tuple(np.ones_like(x) for x in (encoder, decoder, cross))
    source, target = attnflow.encoder_decoder_rollout(
        encoder[0], decoder[0], cross[0], rule="gae", gradients=grads_of(grads)
    )

    def cam(a: np.ndarray) -> np.ndarray:
        return np.clip(a, 0, None).mean(axis=0)

    def handle_residual(r: np.ndarray) -> np.ndarray:
        r = r - np.eye(len(r))
        return r / r.sum(-1, keepdims=True) + np.eye(len(r))

    r_ii, r_qq, r_qi = np.eye(S), np.eye(T), np.zeros((T, S))
    for blk in encoder[0]:
        r_ii = r_ii + cam(blk) @ r_ii
    for self_attn, cross_attn in zip(decoder[0], cross[0], strict=True):
        c = cam(self_attn)
        r_qq, r_qi = r_qq + c @ r_qq, r_qi + c @ r_qi
        r_qi = r_qi + handle_residual(r_qq).T @ (cam(cross_attn) @ handle_residual(r_ii))
    np.testing.assert_allclose(source, r_qi, rtol=1e-12)
    np.testing.assert_allclose(target, r_qq, rtol=1e-12)


def grads_of(grads: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return tuple(g[0] for g in grads)


ERRORS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "layer counts": ({"cross": np.ones((1, H, T, S)) / S}, ValueError, "one layer per decoder"),
    "T": ({"cross": np.ones((L_D, H, T + 1, S)) / S}, ValueError, "T = 5 query rows"),
    "S": ({"cross": np.ones((L_D, H, T, S - 1)) / (S - 1)}, ValueError, "S = 6 key columns"),
    "heads": ({"decoder": np.ones((L_D, H + 1, T, T)) / T}, ValueError, "same number of heads"),
    "square": ({"encoder": np.ones((L_E, H, S, S + 1)) / S}, ValueError, "be square"),
    "row sums": ({"cross": np.ones((L_D, H, T, S))}, ValueError, "rows must sum to 1"),
    "rule": ({"rule": "chefer"}, ValueError, "`rule` must be"),
    "gae without gradients": ({"rule": "gae"}, ValueError, "`gradients` must be given"),
    "gradients for rollout": ({"gradients": "three"}, TypeError, "`gradients` must be a tuple"),
    "gradient shape": (
        {
            "rule": "gae",
            "gradients": (
                np.ones((L_E, H, S, S)),
                np.ones((L_D, H, T, T)),
                np.ones((L_D, H, T, S - 1)),
            ),
        },
        ValueError,
        "shape of `cross`",
    ),
    "gae heads": (
        {"rule": "gae", "heads": "max", "gradients": "zeros"},
        ValueError,
        "`heads` must be 'mean'",
    ),
    "source mask": ({"source_mask": np.ones(T, bool)}, ValueError, "`source_mask` must have shape"),
    "target mask": ({"target_mask": np.ones(T)}, TypeError, "`target_mask` must have a boolean"),
    "rows": ({"rows": T}, IndexError, "`rows` must index"),
    "layers": ({"layers": L_D}, IndexError, "`layers` must index"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_validation_messages(case: str) -> None:
    options, error, match = ERRORS[case]
    encoder, decoder, cross, *grads = (x[0] for x in _inputs("float64"))
    arrays = {"encoder": encoder, "decoder": decoder, "cross": cross}
    for name in list(arrays):
        if name in options:
            arrays[name] = options.pop(name)
    if options.get("gradients") == "zeros":
        options["gradients"] = tuple(grads)
    with pytest.raises(error, match=match):
        attnflow.encoder_decoder_rollout(*arrays.values(), **options)


def test_fused_input_and_head_weights() -> None:
    encoder, decoder, cross, *_ = _inputs("float64")
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK}
    want = attnflow.encoder_decoder_rollout(encoder, decoder, cross, **masks)
    fused = attnflow.encoder_decoder_rollout(
        *(x.mean(axis=-3) for x in (encoder, decoder, cross)), heads=None
    )
    plain = attnflow.encoder_decoder_rollout(encoder, decoder, cross)
    for got, expected in zip(fused, plain, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-14)
    weighted = attnflow.encoder_decoder_rollout(encoder, decoder, cross, heads=[1.0, 1.0], **masks)
    for got, expected in zip(weighted, want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-14)
    with pytest.raises(ValueError, match=r"shape \(2,\) \(one set for all families\)"):
        attnflow.encoder_decoder_rollout(encoder, decoder, cross, heads=np.ones((L_D, H)))


def test_gae_refuses_head_weights_clearly() -> None:
    encoder, decoder, cross, *grads = (x[0] for x in _inputs("float64"))
    with pytest.raises(ValueError, match="`heads` must be 'mean' for rule='gae'"):
        attnflow.encoder_decoder_rollout(
            encoder, decoder, cross, rule="gae", gradients=tuple(grads), heads=np.ones(H)
        )


def test_masks_and_gradients_are_checked_by_the_shared_checks() -> None:
    encoder, decoder, cross, *grads = _inputs("float64")
    bad = [g.copy() for g in grads]
    bad[2][1, 0, 0, 4, 5] = np.inf  # decoder position 4 of sequence 1 is padding
    options: dict[str, Any] = {"rule": "gae", "gradients": tuple(bad)}
    with pytest.raises(ValueError, match=r"`gradients\[2\]` must be finite; found 1 NaN or inf"):
        attnflow.encoder_decoder_rollout(encoder, decoder, cross, **options)
    # Between padded tokens anything goes; the same holds for rollout's attention rows.
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK}
    source, target = attnflow.encoder_decoder_rollout(encoder, decoder, cross, **options, **masks)
    assert np.all(np.isfinite(source))
    assert np.all(np.isfinite(target))
    # The masks: the messages of `rollout`'s mask, naming the family each one masks.
    with pytest.raises(ValueError, match=r"`target_mask` must have shape .* to match `decoder`"):
        attnflow.encoder_decoder_rollout(encoder, decoder, cross, target_mask=SOURCE_MASK)
    empty = SOURCE_MASK.copy()
    empty[1] = False
    with pytest.raises(ValueError, match="`source_mask` masks every token of at least one"):
        attnflow.encoder_decoder_rollout(encoder, decoder, cross, source_mask=empty)
