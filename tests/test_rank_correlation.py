"""rank_correlation against scipy.stats, row by row, on every backend and dtype."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from backends import Variant
from scipy import stats

import attnflow

BATCH, LAYERS, N = 4, 3, 11


def _tied_data(dtype_name: str, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer scores and a reference with many ties (small integer values)."""
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, size=(BATCH, LAYERS, N)).astype(dtype_name)
    scores[0, 0] = rng.random(N)  # one row without ties
    reference = rng.integers(0, 5, size=(BATCH, 1, N)).astype(dtype_name)
    return scores, reference


def _scipy(method: str, x: np.ndarray, y: np.ndarray) -> float:
    if method == "spearman":
        return float(stats.spearmanr(x, y).statistic)
    return float(stats.kendalltau(x, y).statistic)


def _expected(
    method: str, scores: np.ndarray, reference: np.ndarray, where: Any, nan: str
) -> np.ndarray:
    shape = np.broadcast_shapes(scores.shape, reference.shape)
    x = np.broadcast_to(scores, shape).astype(np.float64)
    y = np.broadcast_to(reference, shape).astype(np.float64)
    keep = np.ones(shape, dtype=bool) if where is None else np.broadcast_to(where, shape)
    out = np.empty(shape[:-1])
    for index in np.ndindex(*shape[:-1]):
        sel = keep[index]
        xs, ys = x[index][sel], y[index][sel]
        if len(xs) < 2 or np.all(xs == xs[0]) or np.all(ys == ys[0]):
            value = np.nan
        else:
            value = _scipy(method, xs, ys)
        out[index] = 0.0 if (np.isnan(value) and nan == "zero") else value
    return out


def _tolerance(dtype_name: str) -> float:
    return 1e-12 if dtype_name == "float64" else 1e-5


@pytest.mark.parametrize("method", ["spearman", "kendall"])
def test_equals_scipy_per_row_with_ties(backend: Variant, dtype_name: str, method: str) -> None:
    scores, reference = _tied_data(dtype_name)
    ref = backend.asarray(reference)
    result = backend.run(
        lambda s: attnflow.evaluate.rank_correlation(s, ref, method=method), backend.asarray(scores)
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, LAYERS))
    expected = _expected(method, scores, reference, None, "zero")
    np.testing.assert_allclose(values, expected, rtol=0, atol=_tolerance(dtype_name))
    assert np.abs(expected).max() > 0.2  # the data are not all degenerate


@pytest.mark.parametrize("method", ["spearman", "kendall"])
@pytest.mark.parametrize("nan", ["zero", "omit"])
def test_where_excludes_positions_and_degenerate_rows(
    backend: Variant, dtype_name: str, method: str, nan: str
) -> None:
    scores, reference = _tied_data(dtype_name, seed=8)
    where = np.ones((BATCH, 1, N), dtype=bool)
    where[:, :, 0] = False  # e.g. [CLS]
    where[1, :, 7:] = False  # padding
    where[2, :, 2:] = False  # two positions left
    where[3, :, 1:] = False  # one position: undefined
    scores[2, 1, :2] = 5.0  # constant over the included positions: undefined
    result = backend.run(
        lambda s, r, w: attnflow.evaluate.rank_correlation(s, r, where=w, method=method, nan=nan),
        backend.asarray(scores),
        r=backend.asarray(reference),
        w=backend.asarray(where),
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, LAYERS))
    expected = _expected(method, scores, reference, where, nan)
    np.testing.assert_allclose(values, expected, rtol=0, atol=_tolerance(dtype_name))
    if nan == "omit":
        assert np.isnan(values[3]).all()
        assert np.isnan(values[2, 1])
    else:
        assert (values[3] == 0).all()
        assert values[2, 1] == 0


def test_axis_and_broadcasting() -> None:
    scores, reference = _tied_data("float64", seed=11)
    moved = np.moveaxis(scores, -1, 0)  # tokens first
    result = attnflow.evaluate.rank_correlation(moved, np.moveaxis(reference, -1, 0), axis=0)
    np.testing.assert_allclose(result, _expected("spearman", scores, reference, None, "zero"))


def test_float32_and_float64_mix_to_float64() -> None:
    scores, reference = _tied_data("float32")
    assert (
        attnflow.evaluate.rank_correlation(scores, reference.astype(np.float64)).dtype == np.float64
    )


def test_nan_at_included_positions_is_refused() -> None:
    scores, reference = _tied_data("float64")
    reference[0, 0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN at positions included"):
        attnflow.evaluate.rank_correlation(scores, reference)
    where = ~np.isnan(reference)
    result = attnflow.evaluate.rank_correlation(scores, reference, where=where)
    assert np.isfinite(result).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"method": "pearson"}, ValueError, "`method` must be one of"),
        ({"nan": "drop"}, ValueError, "`nan` must be one of"),
        ({"axis": 3}, ValueError, "`axis` must be an int"),
        ({"where": np.ones((BATCH, 1, N))}, TypeError, "`where` must be a boolean array"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    scores, reference = _tied_data("float64")
    with pytest.raises(error, match=match):
        attnflow.evaluate.rank_correlation(scores, reference, **kwargs)


def test_bad_arrays() -> None:
    scores, reference = _tied_data("float64")
    with pytest.raises(ValueError, match="broadcast together"):
        attnflow.evaluate.rank_correlation(scores, reference[..., :5])
    with pytest.raises(TypeError, match="real floating dtype"):
        attnflow.evaluate.rank_correlation(scores.astype(np.int64), reference)
    with pytest.raises(TypeError, match="must be an array"):
        attnflow.evaluate.rank_correlation([1.0, 2.0], reference)


def test_long_rows_are_processed_in_blocks() -> None:
    # 64 rows of 1024 tokens: more comparisons than one block holds.
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 50, size=(64, 1024)).astype(np.float64)
    reference = scores + rng.integers(0, 30, size=(64, 1024))
    result = attnflow.evaluate.rank_correlation(scores, reference)
    expected = [stats.spearmanr(a, b).statistic for a, b in zip(scores, reference, strict=True)]
    np.testing.assert_allclose(result, expected, rtol=0, atol=1e-12)


# -- "spearman_dense": the paper code's formula --------------------------------------------------
def _dense_oracle(x: np.ndarray, y: np.ndarray) -> float:
    """pandas ``rank(method="dense")`` and ``1 - 6 sum d^2 / (m (m^2 - 1))``, by hand."""
    m = len(x)
    if m < 2:
        return 0.0  # the paper's code: NaN (0/0) counts as 0

    def dense(values: np.ndarray) -> np.ndarray:
        distinct = sorted(set(values.tolist()))
        return np.array([distinct.index(v) + 1 for v in values.tolist()], dtype=np.float64)

    d = dense(x) - dense(y)
    return float(1 - 6 * np.sum(d * d) / (m * (m * m - 1)))


def test_spearman_dense_equals_hand_oracle_with_ties(backend: Variant, dtype_name: str) -> None:
    scores, reference = _tied_data(dtype_name, seed=5)
    where = np.ones((BATCH, 1, N), dtype=bool)
    where[1, :, 6:] = False  # padding
    where[3, :, 1:] = False  # one position: NaN in the paper's code, counted as 0
    result = backend.run(
        lambda s, r, w: attnflow.evaluate.rank_correlation(s, r, where=w, method="spearman_dense"),
        backend.asarray(scores),
        r=backend.asarray(reference),
        w=backend.asarray(where),
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, LAYERS))
    expected = np.empty((BATCH, LAYERS))
    for b, layer in np.ndindex(BATCH, LAYERS):
        keep = where[b, 0]
        expected[b, layer] = _dense_oracle(scores[b, layer][keep], reference[b, 0][keep])
    np.testing.assert_allclose(values, expected, rtol=0, atol=_tolerance(dtype_name))
    # Under ties it is not scipy's Spearman (average ranks, tie-corrected).
    assert np.abs(expected - _expected("spearman", scores, reference, where, "zero")).max() > 0.05
    assert (values[3] == 0).all()


def test_spearman_dense_without_ties_equals_scipy(dtype_name: str) -> None:
    rng = np.random.default_rng(21)
    scores = rng.random((BATCH, LAYERS, N)).astype(dtype_name)
    reference = rng.random((BATCH, 1, N)).astype(dtype_name)
    result = attnflow.evaluate.rank_correlation(scores, reference, method="spearman_dense")
    expected = _expected("spearman", scores, reference, None, "zero")
    np.testing.assert_allclose(result, expected, rtol=0, atol=_tolerance(dtype_name))
    assert result.dtype == np.dtype(dtype_name)


def test_spearman_dense_of_a_constant_row_is_not_undefined() -> None:
    # Dense ranks of a constant row are all 1: the formula gives (2 - m) / (m + 1), as
    # the paper's code did, where scipy's Spearman is undefined.
    m = 7
    result = attnflow.evaluate.rank_correlation(
        np.ones(m), np.arange(m, dtype=np.float64), method="spearman_dense", nan="omit"
    )
    np.testing.assert_allclose(result, (2 - m) / (m + 1), rtol=0, atol=1e-12)
