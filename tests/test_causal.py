"""Decoders (issue 9, item 5): ``receptive_field=`` and ``exclude=`` on rollout and flow.

Against the independent oracle of ``oracle.py`` (``oracle_decoder``: the definitions with
loops, the method on a hand-built uniform causal input) on every backend of the matrix
(rollout under ``jax.jit`` too, Dask without computing), with right- and left-padding
masks, batches, rows and ``layers="all"``; then the properties and one test per message.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import oracle_decoder, oracle_uniform_causal

import attnflow
from attnflow._cli import EXIT_FAILURE, EXIT_USAGE, main

SHAPE = (3, 3, 4, 7, 7)  # batch, layers, heads, n, n
MASK = np.array(
    [
        [True] * 7,
        [True] * 5 + [False] * 2,  # right padding
        [False] * 2 + [True] * 5,  # left padding (a decoder's batch for generation)
    ]
)


def causal_softmax(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 2.0) -> Any:
    """Random causal attention: a softmax of Gaussian logits over keys ``0..i``."""
    n = shape[-1]
    logits = rng.normal(scale=scale, size=shape)
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


@functools.cache
def _weights(dtype_name: str) -> np.ndarray:
    return causal_softmax(np.random.default_rng(20261123), SHAPE).astype(dtype_name)


def _shape(options: dict[str, Any]) -> tuple[int, ...]:
    shape: tuple[int, ...] = (SHAPE[0],)
    if options.get("layers") == "all":
        shape += (SHAPE[1],)
    if options.get("heads") == "each":
        shape += (SHAPE[2],)
    rows = options.get("rows")
    if rows is None:
        return (*shape, SHAPE[-1], SHAPE[-1])
    if isinstance(rows, int):
        return (*shape, SHAPE[-1])
    return (*shape, len(rows), SHAPE[-1])


RF = {"receptive_field": True}
ROLLOUT_CASES: dict[str, dict[str, Any]] = {
    "rf": RF,
    "rf,rows=-1": {**RF, "rows": -1},
    "rf,rows=[6,2],layers=all": {**RF, "rows": [6, 2], "layers": "all"},
    "rf,layers=all,residual=0": {**RF, "layers": "all", "residual": 0.0},
    "rf,layers=1,residual=0.3": {**RF, "layers": 1, "residual": 0.3},
    "exclude=0": {"exclude": 0},
    "exclude=[0,-1],rows=-1,layers=all": {"exclude": [0, -1], "rows": -1, "layers": "all"},
    "rf,exclude=0": {**RF, "exclude": 0},
    "rf,exclude=(0,1),rows=[-1]": {**RF, "exclude": (0, 1), "rows": [-1]},
    "rf,each": {**RF, "heads": "each"},
    "rf,each,rows=-1,layers=all": {**RF, "heads": "each", "rows": -1, "layers": "all"},
    "rf,top_k=2": {**RF, "top_k": 2},
    "rf,threshold=0.1,rows=-1": {**RF, "threshold": 0.1, "rows": -1},
    "rf,discard=0.5,layers=all,exclude=0": {
        **RF,
        "discard": 0.5,
        "layers": "all",
        "exclude": 0,
    },
}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("case", list(ROLLOUT_CASES))
def test_rollout_matches_the_oracle(
    backend: Variant, dtype_name: str, case: str, masked: bool
) -> None:
    options = ROLLOUT_CASES[case]
    data = _weights(dtype_name)
    extra = {"mask": backend.asarray(MASK)} if masked else {}
    result = backend.run(attnflow.rollout, backend.asarray(data), **options, **extra)
    values = backend.check(result, dtype_name=dtype_name, shape=_shape(options))
    expected = oracle_decoder("rollout", data, mask=MASK if masked else None, **options)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)
    if masked:
        assert np.all(values[1, ..., 5:] == 0)
        assert np.all(values[2, ..., :2] == 0)


FLOW_CASES: dict[str, dict[str, Any]] = {
    "rf,rows=-1,layers=all": {**RF, "rows": -1, "layers": "all"},
    "rf,exclude=0,rows=[6,3]": {**RF, "exclude": 0, "rows": [6, 3]},
    "exclude=[0,1],normalize_result=False": {
        "exclude": [0, 1],
        "rows": [4, 6],
        "normalize_result": False,
    },
    "rf,each,rows=6": {**RF, "heads": "each", "rows": 6},
    "rf,top_k=2,rows=[5,6]": {**RF, "top_k": 2, "rows": [5, 6]},
}


@functools.cache
def _flow_oracle(case: str, dtype_name: str) -> np.ndarray:
    options = {k: v for k, v in FLOW_CASES[case].items() if k != "normalize_result"}
    return oracle_decoder("flow", _weights(dtype_name), mask=MASK, **options)


@pytest.mark.parametrize("case", list(FLOW_CASES))
def test_flow_matches_the_oracle(backend: Variant, dtype_name: str, case: str) -> None:
    options = FLOW_CASES[case]
    native = backend.asarray(_weights(dtype_name))
    mask = backend.asarray(MASK)
    if backend.refuses_jit("flow", native, mask=mask, **options):
        return
    result = attnflow.flow(native, mask=mask, n_jobs=1, **options)
    values = backend.check(result, dtype_name=dtype_name, shape=_shape(options))
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, _flow_oracle(case, dtype_name), rtol=tol, atol=tol)


# -- properties ---------------------------------------------------------------------------


def _receptive_fields(mask: np.ndarray) -> np.ndarray:
    """Uniform rows over each real query's real keys ``j <= i`` (zero rows for padding)."""
    n = mask.shape[-1]
    out = np.zeros((*mask.shape, n))
    for b in range(mask.shape[0]):
        for i in range(n):
            if mask[b, i]:
                seen = [j for j in range(i + 1) if mask[b, j]]
                out[b, i, seen] = 1.0 / len(seen)
    return out


@pytest.mark.parametrize("residual", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("heads", ["mean", "each"])
def test_receptive_field_of_uniform_causal_attention_is_uniform(
    backend: Variant, residual: float, heads: str
) -> None:
    # The result: normalising uniform causal attention by its own baseline leaves
    # every row uniform over its receptive field (rollout, every layer, every head).
    uniform = oracle_uniform_causal(SHAPE)
    expected = _receptive_fields(MASK)[:, None]  # a layers axis
    if heads == "each":
        expected = expected[:, :, None]
    result = backend.run(
        attnflow.rollout,
        backend.asarray(uniform),
        mask=backend.asarray(MASK),
        residual=residual,
        layers="all",
        heads=heads,
        receptive_field=True,
    )
    values = backend.to_numpy(result)
    np.testing.assert_allclose(values, np.broadcast_to(expected, values.shape), atol=1e-12)
    # ... while plain rollout of the same attention is biased toward the first tokens.
    plain = attnflow.rollout(uniform, mask=MASK, residual=residual, rows=-1)
    if residual < 0.9:
        assert plain[0, 0] > 1.5 / 7


@pytest.mark.parametrize("residual", [0.0, 0.5])
def test_flow_receptive_field_of_uniform_causal_attention_is_uniform(residual: float) -> None:
    uniform = oracle_uniform_causal(SHAPE)
    values = attnflow.flow(
        uniform, mask=MASK, residual=residual, layers="all", receptive_field=True
    )
    expected = np.broadcast_to(_receptive_fields(MASK)[:, None], values.shape)
    np.testing.assert_allclose(values, expected, atol=1e-12)


@pytest.mark.parametrize("method", ["rollout", "flow"])
@pytest.mark.parametrize("exclude", [0, [0, 3], -1])
def test_exclude_removes_the_column_and_rows_sum_to_one(method: str, exclude: Any) -> None:
    function = getattr(attnflow, method)
    values = function(_weights("float64"), mask=MASK, exclude=exclude, rows=[4, 6, 2])
    for column in [exclude] if isinstance(exclude, int) else exclude:
        assert np.all(values[..., column] == 0)
    sums = values.sum(axis=-1)
    assert np.all((np.abs(sums - 1) < 1e-12) | (sums == 0))
    # Only rows with nothing left are empty: padded rows and rows whose field is excluded.
    assert np.all(values[0].sum(axis=-1) > 0.99)


def test_exclude_is_the_plain_result_without_the_column_renormalised() -> None:
    weights = _weights("float64")
    plain = attnflow.rollout(weights, mask=MASK, rows=4)
    kept = np.where(np.arange(7) == 0, 0.0, plain)
    expected = kept / kept.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(
        attnflow.rollout(weights, mask=MASK, rows=4, exclude=0), expected, atol=1e-15
    )


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_exclude_and_receptive_field_compose(method: str) -> None:
    # Excluding after normalising = normalising and excluding at once: both end in the
    # same row renormalisation.
    function = getattr(attnflow, method)
    weights = _weights("float64")
    normalised = function(weights, mask=MASK, rows=[6, 4], receptive_field=True)
    kept = np.where(np.arange(7) == 0, 0.0, normalised)
    totals = kept.sum(axis=-1, keepdims=True)
    expected = np.divide(kept, totals, out=np.zeros_like(kept), where=totals > 0)
    both = function(weights, mask=MASK, rows=[6, 4], receptive_field=True, exclude=0)
    np.testing.assert_allclose(both, expected, atol=1e-14)


def test_flow_baseline_is_shared_by_sequences_with_the_same_mask() -> None:
    weights = np.concatenate([_weights("float64")] * 2)
    mask = np.concatenate([MASK, MASK[::-1]])
    batched = attnflow.flow(weights, mask=mask, rows=-1, receptive_field=True)
    one_by_one = [
        attnflow.flow(w, mask=m, rows=-1, receptive_field=True)
        for w, m in zip(weights, mask, strict=True)
    ]
    np.testing.assert_allclose(batched, np.stack(one_by_one), atol=1e-15)


def test_receptive_field_lowers_the_first_token_of_rollout() -> None:
    # Uniform causal rollout is U-shaped over the keys of the last row: the first token
    # (seen by every query) and the query itself (the residual) are the baseline's peaks.
    weights = _weights("float64")
    plain = attnflow.rollout(weights, rows=-1)
    normalised = attnflow.rollout(weights, rows=-1, receptive_field=True)
    assert np.all(normalised[:, 0] < plain[:, 0])


# -- bad input: one test per message ------------------------------------------------------


def test_receptive_field_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="`receptive_field` must be True or False; got 1"):
        attnflow.rollout(_weights("float64"), receptive_field=1)  # type: ignore[arg-type]


def test_receptive_field_refuses_encoder_attention() -> None:
    encoder = np.full((2, 1, 4, 4), 0.25)
    with pytest.raises(ValueError, match=r"is for causal \(decoder\) attention.*0\.75"):
        attnflow.rollout(encoder, receptive_field=True)
    with pytest.raises(ValueError, match="causal"):
        attnflow.flow(encoder, receptive_field=True)
    # ... but normalises by the causal baseline when told not to validate.
    values = attnflow.rollout(encoder, receptive_field=True, validate=False, rows=-1)
    assert np.isclose(values.sum(), 1.0)


def test_receptive_field_accepts_padded_causal_attention() -> None:
    # Left padding: frameworks may leave weight on padded (later, for no query) keys;
    # only real keys after the query count.
    weights = _weights("float64").copy()
    weights[2, ..., 0, :] = 1 / 7  # a padded query row, attending everywhere
    attnflow.rollout(weights, mask=MASK, receptive_field=True)


def test_exclude_out_of_range() -> None:
    with pytest.raises(IndexError, match=r"`exclude` must index the 7 input tokens .* got 7"):
        attnflow.rollout(_weights("float64"), exclude=7)
    with pytest.raises(IndexError, match="got -8"):
        attnflow.flow(_weights("float64"), exclude=[0, -8])


def test_exclude_empty() -> None:
    with pytest.raises(ValueError, match="`exclude` must name at least one token position"):
        attnflow.rollout(_weights("float64"), exclude=[])


def test_exclude_boolean() -> None:
    with pytest.raises(TypeError, match="`exclude` must hold integer token positions"):
        attnflow.rollout(_weights("float64"), exclude=True)  # type: ignore[arg-type]


def test_exclude_not_an_integer() -> None:
    with pytest.raises(TypeError, match="`exclude` must be None, an integer position"):
        attnflow.rollout(_weights("float64"), exclude="0")  # type: ignore[arg-type]


def test_bad_options_are_refused_before_any_work() -> None:
    # A check on options runs before values are read: NaN attention is not reported.
    bad = np.full(SHAPE, np.nan)
    with pytest.raises(IndexError, match="`exclude`"):
        attnflow.rollout(bad, exclude=99)


# -- command line -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_cli_options_equal_the_library(
    tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = _weights("float32")
    source = tmp_path / "x.npz"
    np.savez(source, attentions=weights, mask=MASK)
    out = tmp_path / "out.npz"
    argv = [method, str(source), "-o", str(out), "--mask", str(source), "--mask-key", "mask"]
    argv += ["--rows", "6,4", "--receptive-field", "--exclude", "0,-1"]
    assert main(argv) == 0
    expected = getattr(attnflow, method)(
        weights, mask=MASK, rows=[6, 4], receptive_field=True, exclude=[0, -1]
    )
    np.testing.assert_array_equal(np.load(out)[method], expected)
    assert f"{method}:" in capsys.readouterr().out


def test_cli_exclude_must_be_integers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "x.npy"
    np.save(source, _weights("float32"))
    assert main(["rollout", str(source), "--exclude", "bos"]) == EXIT_USAGE
    assert "--exclude must be an integer token position" in capsys.readouterr().err
    assert not (tmp_path / "x.rollout.npz").exists()


def test_cli_exclude_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "x.npy"
    np.save(source, _weights("float32"))
    # A bad option value: a usage error, in the CLI's words (issue 11).
    assert main(["flow", str(source), "--exclude", "9"]) == EXIT_USAGE
    assert "--exclude must index the 7 input tokens" in capsys.readouterr().err


def test_cli_receptive_field_on_encoder_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "x.npy"
    np.save(source, np.full((1, 2, 4, 4), 0.25, dtype=np.float32))
    assert main(["rollout", str(source), "--receptive-field"]) == EXIT_FAILURE
    assert "causal (decoder) attention" in capsys.readouterr().err


def test_cli_raw_has_no_decoder_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "x.npy"
    np.save(source, _weights("float32"))
    assert main(["raw", str(source), "--receptive-field"]) == EXIT_USAGE


def test_flow_baseline_on_worker_processes_equals_serial() -> None:
    weights = _weights("float64")
    options = {"mask": MASK, "rows": [6, 4], "receptive_field": True, "exclude": 0}
    np.testing.assert_array_equal(
        attnflow.flow(weights, n_jobs=2, **options), attnflow.flow(weights, n_jobs=1, **options)
    )
