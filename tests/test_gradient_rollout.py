"""Gradient-weighted rollout (GAE and gradient-weighted rollout) against the NumPy oracle."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import (
    oracle_decoder_normalise,
    oracle_gradient_rollout,
    oracle_rollout,
    oracle_uniform_causal,
    pick_rows,
    softmax_attention,
)

import attnflow

SHAPE = (3, 4, 3, 7, 7)  # batch, layers, heads, n, n
LENGTHS = [7, 5, 2]


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20261123)
    weights = softmax_attention(rng, SHAPE)
    # Gradients of both signs and of the scale of a class score's gradient (~1/n).
    gradients = rng.normal(scale=2.0, size=SHAPE)
    return weights, gradients


def _run(backend: Variant, weights: Any, gradients: Any, **options: Any) -> Any:
    """Call gradient_rollout the way this variant's users would (jit: both arrays traced)."""
    if backend.jit:
        jax = backend.modules["jax"]
        mask = options.pop("mask", None)

        def call(a: Any, g: Any, m: Any) -> Any:
            return attnflow.gradient_rollout(a, g, mask=m, **options)

        return jax.jit(call)(weights, gradients, mask)
    return backend.run(
        lambda a, **o: attnflow.gradient_rollout(a, gradients, **o), weights, **options
    )


def _expected_shape(options: dict[str, Any]) -> tuple[int, ...]:
    shape: tuple[int, ...] = (SHAPE[0],)
    if options.get("layers") == "all":
        shape += (SHAPE[1],)
    rows = options.get("rows")
    if rows is None:
        shape += (SHAPE[-1], SHAPE[-1])
    elif isinstance(rows, int):
        shape += (SHAPE[-1],)
    else:
        shape += (len(rows), SHAPE[-1])
    return shape


CASES: dict[str, dict[str, Any]] = {
    "gae": {},
    "gae,normalize_result": {"normalize_result": True},
    "gae,rows=0": {"rows": 0},
    "gae,rows=0,exclude_self,normalize_result": {
        "rows": 0,
        "exclude_self": True,
        "normalize_result": True,
    },
    "gae,rows=[0,3],layers=all": {"rows": [0, 3], "layers": "all"},
    "gae,rows=[0,3,5,1,2,6],layers=all": {"rows": [0, 3, 5, 1, 2, 6], "layers": "all"},
    "gae,layers=all": {"layers": "all"},
    "gae,rows=-1,layers=all,exclude_self": {"rows": -1, "layers": "all", "exclude_self": True},
    "gae,layers=1,rows=2": {"layers": 1, "rows": 2},
    "weighted": {"rule": "weighted"},
    "weighted,rows=0,layers=all": {"rule": "weighted", "rows": 0, "layers": "all"},
    "weighted,residual=0": {"rule": "weighted", "residual": 0.0},
    "weighted,residual=0.3,rows=[1,4]": {"rule": "weighted", "residual": 0.3, "rows": [1, 4]},
    "weighted,layers=-2,exclude_self,normalize_result": {
        "rule": "weighted",
        "layers": -2,
        "exclude_self": True,
        "normalize_result": True,
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle(
    backend: Variant, dtype_name: str, data: tuple[np.ndarray, np.ndarray], case: str
) -> None:
    options = CASES[case]
    weights, gradients = (x.astype(dtype_name) for x in data)
    result = _run(backend, backend.asarray(weights), backend.asarray(gradients), **dict(options))
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    expected = oracle_gradient_rollout(weights, gradients, **options)
    tol = tolerance(dtype_name)
    # GAE relevance grows with depth (entries up to ~10 here): compare relative to scale.
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol * scale)


def _padded(
    data: tuple[np.ndarray, np.ndarray], fill: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequences of lengths 7, 5 and 2, padded as frameworks pad them (gradients too)."""
    weights, gradients = data
    rng = np.random.default_rng(11)
    mask = np.arange(SHAPE[-1])[None, :] < np.array(LENGTHS)[:, None]
    padded = np.where(mask[:, None, None, None, :], weights, 0.0)
    padded /= padded.sum(axis=-1, keepdims=True)
    padded_rows = ~mask[:, None, None, :, None]
    fills = {
        "zeros": np.zeros_like(padded),
        "uniform": np.full_like(padded, 1.0 / SHAPE[-1]),
        "nan": np.full_like(padded, np.nan),
        "normal": softmax_attention(rng, SHAPE),
    }
    padded = np.where(padded_rows, fills[fill], padded)
    # Gradients at padded keys and queries are whatever the framework computed.
    junk = np.full_like(gradients, np.nan) if fill == "nan" else rng.normal(size=SHAPE)
    grads = np.where(padded_rows | ~mask[:, None, None, None, :], junk, gradients)
    return padded, grads, mask


@pytest.mark.parametrize("fill", ["zeros", "uniform", "nan", "normal"])
@pytest.mark.parametrize(
    "options",
    [{}, {"rows": 0, "layers": "all", "exclude_self": True}, {"rule": "weighted", "rows": [0, 4]}],
    ids=["gae-full", "gae-cls-all-layers", "weighted-rows"],
)
def test_mask_equals_cropped_sequence(
    backend: Variant,
    dtype_name: str,
    data: tuple[np.ndarray, np.ndarray],
    fill: str,
    options: dict[str, Any],
) -> None:
    weights, gradients, mask = _padded(data, fill)
    weights, gradients = weights.astype(dtype_name), gradients.astype(dtype_name)
    result = _run(
        backend,
        backend.asarray(weights),
        backend.asarray(gradients),
        mask=backend.asarray(mask),
        **options,
    )
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    expected = oracle_gradient_rollout(weights, gradients, mask=mask, **options)
    tol = tolerance(dtype_name)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol * scale)
    for item, length in enumerate(LENGTHS):
        assert np.all(values[item, ..., length:] == 0)
        if "rows" not in options:
            assert np.all(values[item, ..., length:, :] == 0)
    assert np.all(np.isfinite(values))


@pytest.mark.parametrize("rule", ["gae", "weighted"])
def test_per_layer_sequences_equal_stacked(
    backend: Variant, data: tuple[np.ndarray, np.ndarray], rule: str
) -> None:
    # (A Python list of arrays is no jit argument: the jit variant runs this eagerly.)
    weights, gradients = data
    sequence_a = [backend.asarray(weights[:, layer]) for layer in range(SHAPE[1])]
    sequence_g = [backend.asarray(gradients[:, layer]) for layer in range(SHAPE[1])]
    result = attnflow.gradient_rollout(sequence_a, sequence_g, rule=rule, rows=[0, 2])
    values = backend.check(result, dtype_name="float64", shape=(3, 2, 7))
    expected = oracle_gradient_rollout(weights, gradients, rule=rule, rows=[0, 2])
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-10)


# -- properties ----------------------------------------------------------------------------
def test_gae_with_zero_gradients_is_identity(
    backend: Variant, dtype_name: str, data: tuple[np.ndarray, np.ndarray]
) -> None:
    weights = data[0].astype(dtype_name)
    zeros = np.zeros_like(weights)
    result = _run(backend, backend.asarray(weights), backend.asarray(zeros), layers="all")
    values = backend.check(result, dtype_name=dtype_name, shape=(3, 4, 7, 7))
    np.testing.assert_array_equal(values, np.broadcast_to(np.eye(7), values.shape))


@pytest.mark.parametrize("residual", [0.0, 0.5, 0.8])
def test_weighted_with_unit_gradients_is_rollout(
    backend: Variant, dtype_name: str, data: tuple[np.ndarray, np.ndarray], residual: float
) -> None:
    weights = data[0].astype(dtype_name)
    ones = np.ones_like(weights)
    options = {"rule": "weighted", "residual": residual, "rows": [0, 5], "layers": "all"}
    result = _run(backend, backend.asarray(weights), backend.asarray(ones), **options)
    values = backend.check(result, dtype_name=dtype_name, shape=(3, 4, 2, 7))
    expected = oracle_rollout(weights, residual=residual, rows=[0, 5], layers="all")
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)
    plain = attnflow.rollout(weights, residual=residual, rows=[0, 5], layers="all")
    np.testing.assert_allclose(values, plain, rtol=tol, atol=tol)


@pytest.mark.parametrize("rule", ["gae", "weighted"])
def test_head_order_does_not_matter(data: tuple[np.ndarray, np.ndarray], rule: str) -> None:
    weights, gradients = data
    order = [2, 0, 1]
    permuted = attnflow.gradient_rollout(
        weights[:, :, order], gradients[:, :, order], rule=rule, layers="all"
    )
    np.testing.assert_allclose(
        permuted,
        attnflow.gradient_rollout(weights, gradients, rule=rule, layers="all"),
        rtol=1e-12,
        atol=1e-12,
    )


def test_gradients_are_paired_with_their_own_layer(data: tuple[np.ndarray, np.ndarray]) -> None:
    # vit-explain#6: the gradient list was reversed against the attention list. With a
    # gradient only at layer k, the exact GAE result is I + Ā_k, Ā_k from layer k alone,
    # so pairing gradients with any other layer gives a different map.
    weights, gradients = data
    n_layers = SHAPE[1]
    for k in range(n_layers):
        only_k = np.zeros_like(gradients)
        only_k[:, k] = gradients[:, k]
        fused = np.clip(gradients[:, k] * weights[:, k], 0, None).mean(axis=1)
        expected = np.eye(7) + fused @ np.eye(7)
        result = attnflow.gradient_rollout(weights, only_k)
        np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-12)
        per_layer = [only_k[:, i] for i in range(n_layers)]
        reversed_pairing = attnflow.gradient_rollout(
            [weights[:, i] for i in range(n_layers)], per_layer[::-1]
        )
        assert not np.allclose(reversed_pairing, expected, atol=1e-3)
    # The full chain against the oracle, and the reversed one is not it.
    reference = oracle_gradient_rollout(weights, gradients)
    np.testing.assert_allclose(
        attnflow.gradient_rollout(weights, gradients), reference, rtol=1e-12, atol=1e-12
    )
    reversed_result = attnflow.gradient_rollout(weights, gradients[:, ::-1])
    assert not np.allclose(reversed_result, reference, atol=1e-3)


def test_weighted_rows_that_clip_to_zero_become_identity_rows() -> None:
    # One layer, one head; row 1's gradient is negative everywhere: no positive relevance.
    weights = np.array([[[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]]]])
    gradients = np.array([[[[1.0, 3.0, 1.0], [-1.0, -1.0, -1.0], [0.0, 1.0, 2.0]]]])
    result = attnflow.gradient_rollout(weights, gradients, rule="weighted", residual=0.0)
    np.testing.assert_allclose(
        result, [[0.25, 0.75, 0.0], [0.0, 1.0, 0.0], [0.0, 1 / 3, 2 / 3]], rtol=1e-14
    )
    # GAE leaves such a row at the identity too (nothing is added to it).
    gae = attnflow.gradient_rollout(weights, gradients)
    np.testing.assert_allclose(gae[1], [0.0, 1.0, 0.0])


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("rows", [0, [3, 2, 5]], ids=["row", "rows"])
def test_weighted_row_chain_through_rows_that_clip_to_zero(
    backend: Variant, dtype_name: str, masked: bool, rows: Any
) -> None:
    """The row chain scales its vectors instead of renormalising the layers below the top:
    rows that clip to zero there (identity rows) and padded queries come out as the oracle's."""
    rng = np.random.default_rng(8)
    weights = softmax_attention(rng, (2, 3, 2, 6, 6))
    gradients = rng.normal(size=weights.shape)
    gradients[:, 1, :, 2, :] = -1.0  # layer 1, query 2: every head's relevance clips to 0
    gradients[0, 0, :, 4, :] = -1.0  # layer 0, query 4 of the first item
    mask = np.ones((2, 6), dtype=bool)
    mask[1, 4:] = False
    options: dict[str, Any] = {"rule": "weighted", "rows": rows}
    if masked:
        options["mask"] = backend.asarray(mask)
    weights, gradients = weights.astype(dtype_name), gradients.astype(dtype_name)
    result = _run(backend, backend.asarray(weights), backend.asarray(gradients), **options)
    shape = (2, 6) if isinstance(rows, int) else (2, len(rows), 6)
    values = backend.check(result, dtype_name=dtype_name, shape=shape)
    expected = oracle_gradient_rollout(
        weights, gradients, rule="weighted", rows=rows, mask=mask if masked else None
    )
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


def test_gae_equals_the_recurrence_by_hand() -> None:
    rng = np.random.default_rng(3)
    weights = softmax_attention(rng, (5, 2, 6, 6))
    gradients = rng.normal(size=(5, 2, 6, 6))
    relevance = np.eye(6)
    for a, g in zip(weights, gradients, strict=True):
        relevance = relevance + np.maximum(g * a, 0).mean(axis=0) @ relevance
    np.testing.assert_allclose(
        attnflow.gradient_rollout(weights, gradients), relevance, rtol=1e-12, atol=1e-12
    )
    cls = attnflow.gradient_rollout(weights, gradients, rows=0, exclude_self=True)
    np.testing.assert_allclose(cls[1:], relevance[0, 1:], rtol=1e-12)
    assert cls[0] == 0


def test_float32_stays_float32(data: tuple[np.ndarray, np.ndarray]) -> None:
    weights, gradients = (x.astype(np.float32) for x in data)
    for options in ({}, {"rule": "weighted", "residual": 0.3}, {"layers": "all", "rows": 0}):
        assert attnflow.gradient_rollout(weights, gradients, **options).dtype == np.float32


def test_differentiable_in_torch(data: tuple[np.ndarray, np.ndarray]) -> None:
    torch = pytest.importorskip("torch")
    weights = torch.asarray(data[0], requires_grad=True)
    result = attnflow.gradient_rollout(weights, torch.asarray(data[1]), rows=0)
    result[:, 3].sum().backward()
    assert weights.grad is not None
    assert bool(torch.all(torch.isfinite(weights.grad)))


# -- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make_gradients", "match"),
    [
        (
            lambda g: g[:, :3],
            r"`gradients` must have the shape of `attentions`.*4 layers.*3 layers",
        ),
        (lambda g: g[:, :, :2], r"3 heads.*2 heads"),
        (lambda g: g[:2], r"batch \(3,\).*batch \(2,\)"),
        (lambda g: g[..., :6, :6], r"7 tokens.*6 tokens"),
        (lambda g: g[0, 0], r"`gradients` must have shape .* at least 4 dimensions"),
    ],
    ids=["layers", "heads", "batch", "tokens", "ndim"],
)
def test_gradients_must_line_up(
    data: tuple[np.ndarray, np.ndarray], make_gradients: Any, match: str
) -> None:
    weights, gradients = data
    with pytest.raises(ValueError, match=match):
        attnflow.gradient_rollout(weights, make_gradients(gradients))


def test_gradient_sequence_of_wrong_length(data: tuple[np.ndarray, np.ndarray]) -> None:
    weights, gradients = data
    with pytest.raises(ValueError, match=r"4 layers.*3 layers"):
        attnflow.gradient_rollout(weights, [gradients[:, i] for i in range(3)])


def test_bad_values_and_options(data: tuple[np.ndarray, np.ndarray]) -> None:
    weights, gradients = data
    bad = gradients.copy()
    bad[0, 1, 2, 3, 4] = np.nan
    with pytest.raises(ValueError, match="`gradients` must be finite; found 1 NaN"):
        attnflow.gradient_rollout(weights, bad)
    attnflow.gradient_rollout(weights, bad, validate=False)  # no check, no error
    with pytest.raises(ValueError, match="`attentions` rows must sum to 1"):
        attnflow.gradient_rollout(weights * 2, gradients)
    with pytest.raises(TypeError, match="`gradients` must have the dtype of `attentions`"):
        attnflow.gradient_rollout(weights, gradients.astype(np.float32))
    with pytest.raises(TypeError, match="`gradients` must have a real floating dtype"):
        attnflow.gradient_rollout(weights, gradients.astype(np.int64))
    with pytest.raises(ValueError, match=r"`rule` must be 'gae'.*or 'weighted'"):
        attnflow.gradient_rollout(weights, gradients, rule="chefer")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`exclude_self` must be True or False"):
        attnflow.gradient_rollout(weights, gradients, exclude_self=1)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="`rows`"):
        attnflow.gradient_rollout(weights, gradients, rows=7)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        attnflow.gradient_rollout(weights, gradients, mask=np.ones((3, 6), dtype=bool))


def test_mixed_libraries_are_refused(data: tuple[np.ndarray, np.ndarray]) -> None:
    torch = pytest.importorskip("torch")
    weights, gradients = data
    with pytest.raises(TypeError, match="all arrays must come from one array library"):
        attnflow.gradient_rollout(weights, torch.asarray(gradients))


# -- decoders: receptive field and attention sinks ------------------------------------------
def _causal(data: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The fixture's attention made causal (rows renormalised over keys 0..i)."""
    weights = np.tril(data[0])
    return weights / weights.sum(axis=-1, keepdims=True)


DECODER_CASES: dict[str, dict[str, Any]] = {
    "gae,receptive_field": {"receptive_field": True},
    "gae,rows=-1,layers=all,receptive_field,exclude=0": {
        "rows": -1,
        "layers": "all",
        "receptive_field": True,
        "exclude": 0,
    },
    "weighted,rows=[2,6],receptive_field": {
        "rule": "weighted",
        "rows": [2, 6],
        "receptive_field": True,
    },
    "gae,rows=[0,3],exclude=[0,-1]": {"rows": [0, 3], "exclude": [0, -1]},
}


@pytest.mark.parametrize("case", list(DECODER_CASES))
@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
def test_receptive_field_and_exclude_match_oracle(
    backend: Variant,
    dtype_name: str,
    data: tuple[np.ndarray, np.ndarray],
    case: str,
    masked: bool,
) -> None:
    # The definition: the same rule on uniform causal attention with unit gradients is the
    # baseline, R / B (0 where B = 0), excluded columns zero, rows renormalised.
    options = dict(DECODER_CASES[case])
    receptive_field = bool(options.pop("receptive_field", False))
    exclude = options.pop("exclude", None)
    weights = _causal(data).astype(dtype_name)
    gradients = data[1].astype(dtype_name)
    mask = np.arange(SHAPE[-1])[None, :] < np.array(LENGTHS)[:, None] if masked else None
    if mask is not None:
        options["mask"] = mask
    result = _run(
        backend,
        backend.asarray(weights),
        backend.asarray(gradients),
        **{
            **options,
            "mask": None if mask is None else backend.asarray(mask),
            "receptive_field": receptive_field,
            "exclude": exclude,
        },
    )
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    attribution = oracle_gradient_rollout(weights, gradients, **options)
    baseline = None
    if receptive_field:
        uniform = oracle_uniform_causal(SHAPE)
        baseline = oracle_gradient_rollout(uniform, np.ones(SHAPE), **options)
    dropped = [] if exclude is None else [exclude] if isinstance(exclude, int) else exclude
    expected = oracle_decoder_normalise(attribution, baseline, dropped)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("rule", ["gae", "weighted"])
def test_receptive_field_of_uniform_causal_attention_is_uniform(rule: str) -> None:
    # Uniform causal attention with unit gradients is the baseline itself: every row ends
    # uniform over the real keys 0..i (its receptive field), at every layer.
    mask = np.arange(SHAPE[-1])[None, :] < np.array(LENGTHS)[:, None]
    uniform = oracle_uniform_causal(SHAPE)
    result = attnflow.gradient_rollout(
        uniform, np.ones(SHAPE), rule=rule, mask=mask, layers="all", receptive_field=True
    )
    for b, length in enumerate(LENGTHS):
        for i in range(SHAPE[-1]):
            expected = np.zeros(SHAPE[-1])
            if i < length:
                expected[: i + 1] = 1.0 / (i + 1)
            np.testing.assert_allclose(
                result[b, :, i], np.broadcast_to(expected, (4, 7)), atol=1e-12
            )
    # ... while without it the composition favours the first tokens.
    plain = attnflow.gradient_rollout(
        uniform, np.ones(SHAPE), rule=rule, rows=-1, normalize_result=True
    )
    assert plain[0, 0] > 1.5 / SHAPE[-1]


def test_receptive_field_refuses_encoder_attention(data: tuple[np.ndarray, np.ndarray]) -> None:
    with pytest.raises(ValueError, match="is for causal"):
        attnflow.gradient_rollout(*data, receptive_field=True)
    with pytest.raises(TypeError, match="receptive_field"):
        attnflow.gradient_rollout(*data, receptive_field=1)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="`exclude` must index"):
        attnflow.gradient_rollout(*data, exclude=7)


# -- the blocked pass (issue 24): rows, blocks and the checks it reduces -----------------


@pytest.mark.parametrize("block_bytes", [1, 1 << 40], ids=["row-blocks", "whole-layers"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize(
    "options",
    [{}, {"rule": "weighted"}, {"layers": "all"}, {"rule": "weighted", "layers": -2}],
    ids=["gae", "weighted", "gae-all-layers", "weighted-layer"],
)
def test_selected_rows_equal_the_full_maps_rows(
    backend: Variant,
    dtype_name: str,
    data: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
    block_bytes: int,
    masked: bool,
    options: dict[str, Any],
) -> None:
    """Rows computed alone (the top layer fused only there) are the full map's rows."""
    from attnflow import _gradient_rollout

    monkeypatch.setattr(_gradient_rollout, "BLOCK_BYTES", block_bytes)
    weights, gradients = data
    extra: dict[str, Any] = {}
    data_mask = None
    if masked:
        weights, gradients, data_mask = _padded(data, "nan")
        extra["mask"] = data_mask
    weights, gradients = weights.astype(dtype_name), gradients.astype(dtype_name)
    expected = oracle_gradient_rollout(weights, gradients, **options, **extra)
    if masked:
        extra["mask"] = backend.asarray(extra["mask"])
    a, g = backend.asarray(weights), backend.asarray(gradients)
    full_options = {**options, **extra}
    full = backend.check(
        _run(backend, a, g, **full_options), dtype_name=dtype_name, shape=_expected_shape(options)
    )
    tol = tolerance(dtype_name)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(full, expected, rtol=tol, atol=tol * scale)
    for rows in (0, -1, [4, 1]):
        row_options = {**options, "rows": rows}
        part = backend.check(
            _run(backend, a, g, **row_options, **extra),
            dtype_name=dtype_name,
            shape=_expected_shape(row_options),
        )
        # Negative rows count from each sequence's last real token where a mask is given.
        picked = pick_rows(full, rows, data_mask)
        np.testing.assert_allclose(part, picked, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("block_bytes", [1, 1 << 40], ids=["row-blocks", "whole-layers"])
def test_real_rows_emptied_by_the_mask_become_their_own_identity_rows(
    monkeypatch: pytest.MonkeyPatch, dtype_name: str, block_bytes: int
) -> None:
    """A real query whose weight is all on padded keys attends to itself, in any block."""
    from attnflow import _gradient_rollout

    monkeypatch.setattr(_gradient_rollout, "BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(5)
    weights = softmax_attention(rng, (2, 2, 2, 6, 6))
    mask = np.ones((2, 6), dtype=bool)
    mask[1, 4:] = False
    weights[1, :, :, 3, :] = 0.0
    weights[1, :, :, 3, 5] = 1.0  # query 3 of item 1 looks only at a padded key
    gradients = rng.normal(size=weights.shape)
    weights, gradients = weights.astype(dtype_name), gradients.astype(dtype_name)
    for rule in ("gae", "weighted"):
        result = attnflow.gradient_rollout(weights, gradients, mask=mask, rule=rule)
        expected = oracle_gradient_rollout(weights, gradients, mask=mask, rule=rule)
        tol = tolerance(dtype_name)
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(result, expected, rtol=tol, atol=tol * scale)
        # Both layers' row 3 is the identity row before the gradient weighting.
        assert result[1, 3, 3] > 0


@pytest.mark.parametrize("block_bytes", [1, 1 << 40], ids=["row-blocks", "whole-layers"])
def test_checks_in_the_blocked_pass_keep_every_verdict(
    data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch, block_bytes: int
) -> None:
    """Every head and every gradient is still checked, whatever the blocks."""
    from attnflow import _gradient_rollout

    monkeypatch.setattr(_gradient_rollout, "BLOCK_BYTES", block_bytes)
    weights, gradients = data
    # -inf where the attention is positive: the clip (·)^+ would turn it into 0.
    bad = gradients.copy()
    bad[1, 0, 2, 3, 4] = -np.inf
    assert weights[1, 0, 2, 3, 4] > 0
    with pytest.raises(ValueError, match="`gradients` must be finite; found 1 NaN or infinite"):
        attnflow.gradient_rollout(weights, bad, rows=0)
    # A negative weight in one head, made up for in another: the head mean looks fine.
    shifted = weights.copy()
    shifted[2, 1, 0, 5, :2] += [-0.5, 0.5]
    shifted[2, 1, 1, 5, :2] += [0.5, -0.5]
    shifted[2, 1, 1, 5, :2] = np.abs(shifted[2, 1, 1, 5, :2])
    shifted[2, 1, 1, 5] /= shifted[2, 1, 1, 5].sum()
    with pytest.raises(ValueError, match="`attentions` must be non-negative"):
        attnflow.gradient_rollout(shifted, gradients, rows=0)
    # Row sums off by +-0.1 in two heads: their mean sums to one.
    off = weights.copy()
    off[0, 2, 0, 1, :] *= 1.1
    off[0, 2, 1, 1, :] *= 0.9
    with pytest.raises(ValueError, match="`attentions` rows must sum to 1"):
        attnflow.gradient_rollout(off, gradients, rule="weighted")
    nan = weights.copy()
    nan[0, 3, 2, 6, 0] = np.nan
    with pytest.raises(ValueError, match="`attentions` must be finite"):
        attnflow.gradient_rollout(nan, gradients, rows=[0, 6], layers="all")
    # Finite gradients whose products overflow a float32 sum are accepted.
    huge = np.full(SHAPE, 3e38, dtype=np.float32)
    with np.errstate(all="ignore"):  # NumPy warns of the overflowing sum (and chain)
        result = attnflow.gradient_rollout(weights.astype(np.float32), huge, rows=0)
    assert result.shape == (SHAPE[0], SHAPE[-1])


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the compiled fused pass (`_gae_fused._fuse`)."""
    from attnflow import _gae_fused

    assert _gae_fused.KERNEL_AVAILABLE, "the compiled GAE kernel is not built"
    calls = [0]
    kernel = _gae_fused._fuse

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return kernel(*args)

    monkeypatch.setattr(_gae_fused, "_fuse", counted)
    return calls


def _array_api_pass(function: Any) -> Any:
    """Run `function` with the compiled pass switched off (the array-API path)."""
    from attnflow import _gae_fused

    kernel, _gae_fused._fuse = _gae_fused._fuse, None
    try:
        return function()
    finally:
        _gae_fused._fuse = kernel


@pytest.mark.parametrize(
    "options",
    [{}, {"rows": 0}, {"rows": [4, 1], "layers": "all"}, {"rule": "weighted", "rows": -1}],
    ids=["gae", "gae-row", "gae-rows-all-layers", "weighted-row"],
)
def test_compiled_pass_equals_the_array_api_pass(
    backend: Variant,
    dtype_name: str,
    data: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
    options: dict[str, Any],
) -> None:
    """Host arrays go through the compiled pass, with the array-API pass's result."""
    weights, gradients = (x.astype(dtype_name) for x in data)
    a, g = backend.asarray(weights), backend.asarray(gradients)
    calls = _count_kernel_calls(monkeypatch)
    compiled = backend.to_numpy(_run(backend, a, g, **options))
    host = backend.library in {"numpy", "array_api_strict", "tensorflow", "dask"} or (
        backend.library == "torch" and str(backend.device).startswith("cpu")
    )  # (Dask: block by block of the batch, when the graph is computed)
    if host and not backend.jit:
        assert calls[0] > 0, "host arrays must take the compiled pass"
    reference = backend.to_numpy(_array_api_pass(lambda: _run(backend, a, g, **options)))
    expected = oracle_gradient_rollout(weights, gradients, **options)
    tol = tolerance(dtype_name)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(compiled, reference, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(compiled, expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_compiled_pass_reads_any_strides(
    dtype_name: str, data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-layer views with padded rows, a moved batch axis or broadcast gradients."""
    weights, gradients = (x.astype(dtype_name) for x in data)
    calls = _count_kernel_calls(monkeypatch)
    expected = oracle_gradient_rollout(weights, gradients)
    n = SHAPE[-1]
    wide = np.zeros((*SHAPE[:-1], n + 3), dtype=dtype_name)  # rows not back to back
    wide[..., :n] = weights
    moved = np.ascontiguousarray(np.moveaxis(gradients, 0, 2))  # batch axis in the middle
    per_layer_a = [wide[:, i, :, :, :n] for i in range(SHAPE[1])]
    per_layer_g = [np.moveaxis(moved[i], 1, 0) for i in range(SHAPE[1])]
    result = attnflow.gradient_rollout(per_layer_a, per_layer_g)
    tol = tolerance(dtype_name)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(result, expected, rtol=tol, atol=tol * scale)
    assert calls[0] == SHAPE[1]
    # One gradient for every item of the batch (stride 0), rows 0 and 3.
    shared = np.broadcast_to(gradients[:1], SHAPE)
    result = attnflow.gradient_rollout(weights, shared, rows=[0, 3])
    expected = oracle_gradient_rollout(weights, np.array(shared), rows=[0, 3])
    np.testing.assert_allclose(result, expected, rtol=tol, atol=tol * scale)


def test_compiled_pass_keeps_nan_without_validation(
    data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate=False: a NaN product stays NaN (the clip keeps it), in both passes."""
    weights, gradients = data
    bad = gradients.copy()
    bad[0, 1, 2, 3, 4] = np.nan
    calls = _count_kernel_calls(monkeypatch)
    compiled = attnflow.gradient_rollout(weights, bad, validate=False)
    assert calls[0] > 0
    reference = _array_api_pass(lambda: attnflow.gradient_rollout(weights, bad, validate=False))
    np.testing.assert_array_equal(np.isnan(compiled), np.isnan(reference))
    assert np.isnan(compiled[0]).any()
    assert not np.isnan(compiled[1:]).any()
    with pytest.raises(ValueError, match="`gradients` must be finite; found 1 NaN"):
        attnflow.gradient_rollout(weights, bad)


def test_gradients_are_checked_with_the_attentions_on_one_path(
    data: tuple[np.ndarray, np.ndarray],
) -> None:
    weights, gradients = data
    with pytest.raises(TypeError, match=r"`gradients` must be an array .*got None"):
        attnflow.gradient_rollout(weights, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`gradients` must hold at least one layer"):
        attnflow.gradient_rollout(weights, [])
    layers = [gradients[:, i] for i in range(gradients.shape[1])]
    layers[2] = layers[2][..., :5, :5]
    with pytest.raises(ValueError, match=r"every layer in `gradients`.*`gradients\[2\]`"):
        attnflow.gradient_rollout(weights, layers)
    with pytest.raises(TypeError, match=r"`gradients\[1\]` must be an array"):
        attnflow.gradient_rollout(weights, [gradients[:, 0], "dy/dA"])
    # A sequence of gradients beside stacked attentions (and the reverse) is the same call.
    stacked = attnflow.gradient_rollout(weights, gradients, rows=[0, 2], layers="all")
    as_layers = [gradients[:, i] for i in range(gradients.shape[1])]
    mixed = attnflow.gradient_rollout(weights, as_layers, rows=[0, 2], layers="all")
    np.testing.assert_array_equal(mixed, stacked)
    reverse = attnflow.gradient_rollout(
        [weights[:, i] for i in range(weights.shape[1])], gradients, rows=[0, 2], layers="all"
    )
    np.testing.assert_array_equal(reverse, stacked)


@pytest.mark.parametrize("fill", ["zeros", "nan", "normal"])
@pytest.mark.parametrize(
    "options",
    [{}, {"rows": [0, 4], "layers": "all"}, {"rule": "weighted", "rows": 0}],
    ids=["gae", "gae-rows-all-layers", "weighted-row"],
)
def test_compiled_pass_with_a_mask_equals_the_array_api_pass(
    backend: Variant,
    dtype_name: str,
    data: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
    fill: str,
    options: dict[str, Any],
) -> None:
    """Padded host arrays take the compiled pass too, with the array-API pass's result."""
    weights, gradients, mask = _padded(data, fill)
    weights, gradients = weights.astype(dtype_name), gradients.astype(dtype_name)
    # A real query of item 1 with all its weight on padded keys: its own identity row.
    weights[1, :, :, 3, :] = 0.0
    weights[1, :, :, 3, 6] = 1.0
    a, g, m = backend.asarray(weights), backend.asarray(gradients), backend.asarray(mask)
    calls = _count_kernel_calls(monkeypatch)
    compiled = backend.to_numpy(_run(backend, a, g, mask=m, **options))
    host = backend.library in {"numpy", "array_api_strict", "tensorflow", "dask"} or (
        backend.library == "torch" and str(backend.device).startswith("cpu")
    )  # (Dask: block by block of the batch, when the graph is computed)
    if host and not backend.jit:
        assert calls[0] > 0, "padded host arrays must take the compiled pass"
    reference = backend.to_numpy(_array_api_pass(lambda: _run(backend, a, g, mask=m, **options)))
    expected = oracle_gradient_rollout(weights, gradients, mask=mask, **options)
    tol = tolerance(dtype_name)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(compiled, reference, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(compiled, expected, rtol=tol, atol=tol * scale)


def test_compiled_pass_with_a_mask_keeps_every_verdict(
    data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real rows and real gradients are judged, padding is not, in the compiled pass."""
    weights, gradients, mask = _padded(data, "nan")  # NaN in every padded row and gradient
    calls = _count_kernel_calls(monkeypatch)
    attnflow.gradient_rollout(weights, gradients, mask=mask, rows=0)
    assert calls[0] > 0
    cases: list[tuple[np.ndarray, np.ndarray, str]] = []
    negative = weights.copy()
    negative[1, 2, 0, 4, 1] = -0.25  # a real row of item 1 (5 real tokens)
    negative[1, 2, 0, 4, 2] += 0.25
    cases.append((negative, gradients, "non-negative"))
    off = weights.copy()
    off[2, 0, 1, 1, 0] += 0.5  # a real row of item 2 that no longer sums to one
    cases.append((off, gradients, "sum to 1"))
    bad = gradients.copy()
    bad[0, 3, 2, 6, 5] = np.inf  # item 0 is all real
    cases.append((weights, bad, "`gradients` must be finite"))
    for attention, gradient, message in cases:
        with pytest.raises(ValueError, match=message):
            attnflow.gradient_rollout(attention, gradient, mask=mask)
        with pytest.raises(ValueError, match=message):
            _array_api_pass(
                lambda a=attention, g=gradient: attnflow.gradient_rollout(a, g, mask=mask)
            )
