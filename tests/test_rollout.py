"""Rollout and raw attention against the NumPy oracle, on every backend and dtype."""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np
import pytest
from backends import Variant, selected_variants, tolerance
from oracle import oracle_raw, oracle_rollout, softmax_attention

import attnflow

SHAPE = (3, 5, 4, 9, 9)  # batch, layers, heads, n, n


@pytest.fixture(scope="module")
def weights() -> np.ndarray:
    return softmax_attention(np.random.default_rng(20260522), SHAPE)


def _max_fusion(w: Any) -> Any:
    xp = array_api_compat.array_namespace(w)
    return xp.max(w, axis=-3)


# (options passed to attnflow.rollout, options for the oracle where they differ)
CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "rows=0": {"rows": 0},
    "rows=-1": {"rows": -1},
    "rows=[0,4],layers=all": {"rows": [0, 4], "layers": "all"},
    "rows=[0,4,2,7,1],layers=all": {"rows": [0, 4, 2, 7, 1], "layers": "all"},
    "layers=all": {"layers": "all"},
    "layers=2,rows=3": {"layers": 2, "rows": 3},
    "layers=-2": {"layers": -2},
    "heads=max": {"heads": "max"},
    "heads=min": {"heads": "min"},
    "heads=min,rows=[1,2]": {"heads": "min", "rows": [1, 2]},
    "residual=0.3": {"residual": 0.3},
    "residual=0": {"residual": 0.0},
    "residual=1": {"residual": 1.0},
    "heads=weights(H)": {"heads": [0.1, 0.2, 0.3, 0.4]},
    "heads=weights(L,H)": {"heads": np.arange(1.0, 21.0).reshape(5, 4).tolist()},
}


def _oracle_options(options: dict[str, Any]) -> dict[str, Any]:
    return {
        key: (np.array(value) if key == "heads" and isinstance(value, list) else value)
        for key, value in options.items()
    }


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


@pytest.mark.parametrize("case", list(CASES))
def test_rollout_matches_oracle(
    backend: Variant, dtype_name: str, weights: np.ndarray, case: str
) -> None:
    options = CASES[case]
    data = weights.astype(dtype_name)
    result = backend.run(attnflow.rollout, backend.asarray(data), **options)
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    expected = oracle_rollout(data, **_oracle_options(options))
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


def test_rollout_callable_fusion(backend: Variant, dtype_name: str, weights: np.ndarray) -> None:
    data = weights.astype(dtype_name)
    result = backend.run(attnflow.rollout, backend.asarray(data), heads=_max_fusion, rows=0)
    values = backend.check(result, dtype_name=dtype_name, shape=(SHAPE[0], SHAPE[-1]))
    expected = oracle_rollout(data, heads="max", rows=0)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("layers", ["last", "all"])
def test_per_layer_sequence_equals_stacked(
    backend: Variant, dtype_name: str, weights: np.ndarray, layers: str
) -> None:
    if backend.jit:
        pytest.skip("a Python list of arrays is not a jit argument; covered eagerly")
    data = weights.astype(dtype_name)
    sequence = [backend.asarray(data[:, layer]) for layer in range(SHAPE[1])]
    result = backend.run(attnflow.rollout, sequence, rows=[0, 4], layers=layers)
    shape = _expected_shape({"rows": [0, 4], "layers": layers})
    values = backend.check(result, dtype_name=dtype_name, shape=shape)
    expected = oracle_rollout(data, rows=[0, 4], layers=layers)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


def test_fused_input(backend: Variant, dtype_name: str, weights: np.ndarray) -> None:
    data = weights.mean(axis=2).astype(dtype_name)
    result = backend.run(attnflow.rollout, backend.asarray(data), heads=None, layers="all")
    values = backend.check(result, dtype_name=dtype_name, shape=(3, 5, 9, 9))
    expected = oracle_rollout(data, heads=None, layers="all")
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "case", ["default", "rows=[0,4],layers=all", "heads=max", "layers=2,rows=3"]
)
def test_raw_matches_oracle(
    backend: Variant, dtype_name: str, weights: np.ndarray, case: str
) -> None:
    options = CASES[case]
    data = weights.astype(dtype_name)
    result = backend.run(attnflow.raw, backend.asarray(data), **options)
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    expected = oracle_raw(data, **_oracle_options(options))
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


def _padded(weights: np.ndarray, fill: str, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Attention of sequences of lengths 9, 6 and 3, padded as frameworks pad them."""
    rng = np.random.default_rng(seed)
    lengths = [9, 6, 3]
    mask = np.arange(SHAPE[-1])[None, :] < np.array(lengths)[:, None]
    data = weights.copy()
    data = np.where(mask[:, None, None, None, :], data, 0.0)  # padded keys get no weight
    data /= data.sum(axis=-1, keepdims=True)
    padded_rows = ~mask[:, None, None, :, None]
    fills = {
        "zeros": np.zeros_like(data),
        "uniform": np.full_like(data, 1.0 / SHAPE[-1]),
        "nan": np.full_like(data, np.nan),
        "normal": softmax_attention(rng, SHAPE),
    }
    return np.where(padded_rows, fills[fill], data), mask


@pytest.mark.parametrize("fill", ["zeros", "uniform", "nan", "normal"])
@pytest.mark.parametrize(
    "options",
    [{}, {"rows": 0, "layers": "all"}, {"heads": "max", "rows": [0, 2]}],
    ids=["full", "cls-all-layers", "max-rows"],
)
def test_mask_equals_cropped_sequence(
    backend: Variant, dtype_name: str, weights: np.ndarray, fill: str, options: dict[str, Any]
) -> None:
    data, mask = _padded(weights, fill)
    data = data.astype(dtype_name)
    result = backend.run(
        attnflow.rollout, backend.asarray(data), mask=backend.asarray(mask), **options
    )
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    expected = oracle_rollout(data, mask=mask, **options)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)
    # Padded positions: exactly zero, in (columns) and, for full matrices, out (rows).
    for item, length in enumerate([9, 6, 3]):
        assert np.all(values[item, ..., length:] == 0)
        if "rows" not in options:
            assert np.all(values[item, ..., length:, :] == 0)
    assert np.all(np.isfinite(values))


def test_mask_on_sequence_input_with_fused_heads(backend: Variant, weights: np.ndarray) -> None:
    if backend.jit:
        pytest.skip("a Python list of arrays is not a jit argument; covered eagerly")
    data, mask = _padded(weights, "nan")
    fused = data.mean(axis=2)  # padded query rows stay NaN
    sequence = [backend.asarray(fused[:, layer]) for layer in range(SHAPE[1])]
    result = backend.run(attnflow.rollout, sequence, heads=None, rows=0, mask=backend.asarray(mask))
    values = backend.check(result, dtype_name="float64", shape=(3, 9))
    expected = oracle_rollout(fused, heads=None, rows=0, mask=mask)
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-10)


def test_building_blocks(backend: Variant, dtype_name: str, weights: np.ndarray) -> None:
    data = weights.astype(dtype_name)
    tol = tolerance(dtype_name)
    fused = backend.run(attnflow.fuse_heads, backend.asarray(data), heads="max")
    fused_values = backend.check(fused, dtype_name=dtype_name, shape=(3, 5, 9, 9))
    expected_fused = oracle_raw(data, heads="max", layers="all")
    np.testing.assert_allclose(fused_values, expected_fused, rtol=tol, atol=tol)
    mixed = backend.run(attnflow.add_residual, fused, residual=0.25)
    mixed_values = backend.check(mixed, dtype_name=dtype_name, shape=(3, 5, 9, 9))
    np.testing.assert_allclose(
        mixed_values, 0.75 * expected_fused + 0.25 * np.eye(9), rtol=tol, atol=tol
    )


class _RecordingNamespace:
    """A namespace that delegates to another and records which functions were used."""

    def __init__(self, xp: Any) -> None:
        self._xp = xp
        self.used: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.used.add(name)
        return getattr(self._xp, name)


def test_xp_override(weights: np.ndarray) -> None:
    # The override is not the namespace attnflow would infer: only its own record can
    # show that rollout computed with it.
    xp = _RecordingNamespace(array_api_compat.array_namespace(weights))
    result = attnflow.rollout(weights, rows=0, xp=xp)
    np.testing.assert_allclose(result, oracle_rollout(weights, rows=0), rtol=1e-12, atol=1e-12)
    assert "matmul" in xp.used or "vecdot" in xp.used, sorted(xp.used)


def test_python_float_options_keep_float32_output(weights: np.ndarray) -> None:
    # Python float options (residual, weights) must not promote float32 input.
    data = weights.astype(np.float32)
    for options in ({"residual": 0.3}, {"heads": [1.0, 2.0, 3.0, 4.0]}, {"heads": "min"}):
        assert attnflow.rollout(data, rows=[0, 1], **options).dtype == np.float32


def test_rows_left_empty_by_min_fusion_become_self_attention() -> None:
    # Two heads attending to disjoint keys: their minimum has no mass in rows 0 and 1.
    weights = np.array(
        [
            [
                [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0]],
                [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.25, 0.25]],
            ]
        ]
    )
    fused = attnflow.fuse_heads(weights, heads="min")
    np.testing.assert_array_equal(fused, [[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [2 / 3, 1 / 3, 0.0]]])
    np.testing.assert_allclose(attnflow.rollout(weights, heads="min", residual=0.0), fused[0])


@pytest.mark.with_backend("torch")
def test_torch_tensor_requiring_grad_is_differentiable_and_silent(weights: np.ndarray) -> None:
    # Validation must not read values in a way that warns (filterwarnings=error) or
    # breaks the autograd graph: rollout is differentiable on differentiable backends.
    torch = pytest.importorskip("torch")
    if "torch" not in {v.library for v in selected_variants()}:
        pytest.skip("torch is not in this session's backends")
    data = torch.asarray(weights, requires_grad=True)
    result = attnflow.rollout(data, rows=0, mask=torch.ones(3, 9, dtype=torch.bool))
    result[:, 3].sum().backward()
    assert data.grad is not None
    assert torch.all(torch.isfinite(data.grad))
    assert float(data.grad.abs().sum()) > 0


def test_fuse_heads_of_cross_attention() -> None:
    # Queries and keys differ in number (a decoder attending to an encoder): fusion works
    # matrix by matrix, and a row left empty by min stays empty (there is no self).
    rng = np.random.default_rng(5)
    weights = softmax_attention(rng, (2, 3, 4, 6))
    np.testing.assert_allclose(attnflow.fuse_heads(weights), weights.mean(axis=-3))
    fused_max = attnflow.fuse_heads(weights, heads="max")
    expected = weights.max(axis=-3)
    np.testing.assert_allclose(fused_max, expected / expected.sum(axis=-1, keepdims=True))
    disjoint = np.zeros((2, 1, 3))
    disjoint[0, 0, 0] = disjoint[1, 0, 2] = 1.0
    np.testing.assert_array_equal(attnflow.fuse_heads(disjoint, heads="min"), np.zeros((1, 3)))


# -- layers fused as the chain reads them (issue 24) -------------------------------------


STREAM_BLOCKS = pytest.mark.parametrize(
    "block_bytes", [1 << 40, 1, 0], ids=["whole-layers", "row-blocks", "layer-groups"]
)
GROUP_BYTES = 2 * SHAPE[0] * SHAPE[-1] ** 2 * 8
"""Two fused float64 layers (four float32): groups of the test stack end below the top."""


def _stream(monkeypatch: pytest.MonkeyPatch, block_bytes: int) -> None:
    """Stream whole layers one at a time, rows `block_bytes` at a time, or (0) layer groups.

    Layer groups are an accelerator's: the arrays are taken for a GPU's there, which also
    keeps the checks' numbers per piece instead of running.
    """
    from attnflow import _prepare

    if block_bytes == 0:
        monkeypatch.setattr(_prepare, "lives_in_host_memory", lambda x: False)
        monkeypatch.setattr(_prepare, "STREAM_GROUP_BYTES", GROUP_BYTES)
        return
    monkeypatch.setattr(_prepare, "STREAM_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(_prepare, "STREAM_LAYER_BYTES", 0)


def _count_head_fusions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the streamed head fusions (one per group, layer or block) in ``calls[0]``."""
    from attnflow import _prepare

    calls = [0]
    fusion = _prepare.apply_head_fusion

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return fusion(*args, **kwargs)

    monkeypatch.setattr(_prepare, "apply_head_fusion", counted)
    return calls


@STREAM_BLOCKS
@pytest.mark.parametrize("layers", ["last", "all", 2])
@pytest.mark.parametrize("heads", ["mean", "layer-weights"])
def test_streamed_rows_equal_the_full_maps_rows(
    backend: Variant,
    dtype_name: str,
    weights: np.ndarray,
    layers: object,
    heads: str,
    block_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of layers fused one at a time (top layer: only its rows) equal the full map's.

    With row blocks, each layer below the top one is fused and multiplied into the row
    chain one row at a time, as a long input is.
    """

    _stream(monkeypatch, block_bytes)
    data = weights.astype(dtype_name)
    fusion: Any = heads
    oracle_heads: Any = heads
    if heads == "layer-weights":
        oracle_heads = np.random.default_rng(3).random((SHAPE[1], SHAPE[2])) + 0.1
        fusion = oracle_heads.tolist()  # (layers, heads), as the CASES pass weights
    options: dict[str, Any] = {"layers": layers, "heads": fusion}
    shape_options = {"layers": layers}
    full = backend.check(
        backend.run(attnflow.rollout, backend.asarray(data), **options),
        dtype_name=dtype_name,
        shape=_expected_shape(shape_options),
    )
    expected = oracle_rollout(data, heads=oracle_heads, layers=layers)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(full, expected, rtol=tol, atol=tol)
    for rows in (0, -1, [4, 1]):
        part = backend.check(
            backend.run(attnflow.rollout, backend.asarray(data), rows=rows, **options),
            dtype_name=dtype_name,
            shape=_expected_shape({**shape_options, "rows": rows}),
        )
        index = rows if isinstance(rows, int) else np.asarray(rows)
        np.testing.assert_allclose(part, full[..., index, :], rtol=tol, atol=tol)
    if block_bytes in {0, 1} and layers == "last" and not backend.jit and backend.library != "dask":
        # The layers below the top one were fused a row at a time, or a group at a time:
        # [2, 4) then [0, 2) in float64, [0, 4) in float32 (the top layer only in its row).
        calls = _count_head_fusions(monkeypatch)
        backend.run(attnflow.rollout, backend.asarray(data), rows=0, **options)
        below = SHAPE[1] - 1
        group = GROUP_BYTES // (SHAPE[0] * SHAPE[-1] ** 2 * data.itemsize)
        assert calls[0] == 1 + (below * SHAPE[-1] if block_bytes else -(-below // group))


@STREAM_BLOCKS
def test_streamed_checks_read_every_layer_the_chain_reads(
    weights: np.ndarray, block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values are judged after the chain, with the eager checks' messages, in every layer."""

    _stream(monkeypatch, block_bytes)
    nan = weights.copy()
    nan[1, 0, 2, 6, 3] = np.nan  # the first layer, a row the chain multiplies through
    with pytest.raises(
        ValueError, match=r"averaged over heads, must be finite; found NaN.* in 1 row"
    ):
        attnflow.rollout(nan, rows=0)
    with pytest.raises(ValueError, match="averaged over heads, must be finite"):
        attnflow.rollout(list(np.moveaxis(nan, 1, 0)), rows=[0, 2], layers="all")
    negative = weights.copy()
    negative[0, 2, :, 4, 1] = -0.5
    negative[0, 2, :, 4, 2] += 0.5
    with pytest.raises(ValueError, match="must be non-negative"):
        attnflow.rollout(negative, rows=0)
    scaled = weights.copy()
    scaled[2, -1, :, 0, :] *= 1.01  # the top layer's row 0, the one row read there
    with pytest.raises(ValueError, match="rows must sum to 1"):
        attnflow.rollout(scaled, rows=0)
    attnflow.rollout(scaled, rows=0, validate=False)


def test_accelerator_blocks_are_a_share_of_the_input_in_equal_parts(
    weights: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an accelerator a long layer streams in blocks of at least a share of the input.

    A share of 4 rows' bytes gives 3 blocks of 3 rows for 9 rows (not 4, 4 and 1); in
    host memory the same settings stream a row at a time. The rows equal the oracle's.
    """
    from attnflow import _prepare

    monkeypatch.setattr(_prepare, "STREAM_BLOCK_BYTES", 1)
    monkeypatch.setattr(_prepare, "STREAM_LAYER_BYTES", 0)
    row_bytes = SHAPE[0] * SHAPE[-1] * weights.itemsize
    monkeypatch.setattr(_prepare, "STREAM_BLOCK_SHARE", 4 * row_bytes / weights.nbytes)
    calls = _count_head_fusions(monkeypatch)
    expected = oracle_rollout(weights, rows=0)
    below = SHAPE[1] - 1
    for accelerator, blocks in ((False, SHAPE[-1]), (True, 3)):
        monkeypatch.setattr(_prepare, "lives_in_host_memory", lambda x, a=accelerator: not a)
        calls[0] = 0
        result = attnflow.rollout(weights, rows=0)
        assert calls[0] == 1 + below * blocks
        np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-12)


def test_host_memory_is_told_from_an_accelerator(backend: Variant) -> None:
    """Arrays of every CPU cell live in host memory; CUDA ones and torch's meta do not."""
    from attnflow._namespace import lives_in_host_memory

    x = backend.asarray(np.zeros(2))
    if backend.library == "tensorflow":
        x = np.asarray(x)  # the core sees TensorFlow tensors as NumPy arrays (the boundary)
    kind = getattr(backend.device, "platform", None) or str(backend.device)
    on_gpu = kind.startswith(("cuda", "gpu"))
    assert lives_in_host_memory(x) is not on_gpu
    if backend.library == "torch":
        assert not lives_in_host_memory(backend.modules["torch"].zeros(2, device="meta"))


@STREAM_BLOCKS
def test_rows_of_the_top_layer_that_no_chain_reads_are_not_checked(
    weights: np.ndarray, block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`validate` checks what the method consumes: the top layer only in the rows asked."""

    _stream(monkeypatch, block_bytes)
    bad = weights.copy()
    bad[0, -1, 1, 5, :] = np.nan
    result = attnflow.rollout(bad, rows=[0, 1])
    assert np.all(np.isfinite(result))
    with pytest.raises(ValueError, match="must be finite"):
        attnflow.rollout(bad, rows=[0, 5])
    with pytest.raises(ValueError, match="must be finite"):
        attnflow.rollout(bad)


# -- padded rollout, heads renormalised and fused in one pass (issue 24) -----------------


def _leaky_padded(weights: np.ndarray, dtype_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Attention computed without the mask: real rows put weight on padded keys too.

    Each head then has its own mass on the real keys, so renormalising the heads and
    averaging them is not the same as averaging and renormalising; padded queries hold
    NaN (as fully masked softmax rows do).
    """
    mask = np.arange(SHAPE[-1])[None, :] < np.array([9, 6, 3])[:, None]
    data = np.where(~mask[:, None, None, :, None], np.nan, weights)
    return data.astype(dtype_name), mask


def test_unchecked_padded_keys_stay_out_of_the_sums(
    backend: Variant, dtype_name: str, weights: np.ndarray
) -> None:
    """With ``validate=False``, NaN on a padded key of a real row is left out of that row.

    On every backend, eager JAX included; inside ``jax.jit`` the sums are matrix products
    (:func:`attnflow._heads.masked_head_mean`) and that one row is NaN, the others exact.
    """
    data, mask = _leaky_padded(weights, dtype_name)
    nan_key = data.copy()
    nan_key[2, 1, 3, 1, 7] = np.nan  # a padded key of a real row (item 2 has 3 tokens)
    result = backend.run(
        attnflow.rollout,
        backend.asarray(nan_key),
        mask=backend.asarray(mask),
        rows=0,
        validate=False,
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(SHAPE[0], SHAPE[-1]))
    expected = oracle_rollout(data.astype(np.float64), mask=mask, rows=0)
    tol = tolerance(dtype_name)
    if backend.jit:
        assert np.isnan(values[2]).all()
        values, expected = values[:2], expected[:2]
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


PADDED_OPTIONS = pytest.mark.parametrize(
    "options",
    [
        {},
        {"rows": 0},
        {"rows": [4, 1], "layers": "all"},
        {"heads": [0.1, 0.2, 0.3, 0.4], "rows": -1},
        {"heads": np.arange(1.0, 21.0).reshape(5, 4).tolist(), "rows": [2, 0]},
        {"validate": False, "rows": 0},
    ],
    ids=["full", "cls", "rows-all-layers", "weights(H)", "weights(L,H)", "unvalidated"],
)


@STREAM_BLOCKS
@PADDED_OPTIONS
def test_padded_heads_are_renormalised_before_they_are_fused(
    backend: Variant,
    dtype_name: str,
    weights: np.ndarray,
    options: dict[str, Any],
    block_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each head's rows over the real keys, then the (weighted) mean: the unfused oracle."""

    _stream(monkeypatch, block_bytes)
    data, mask = _leaky_padded(weights, dtype_name)
    result = backend.run(
        attnflow.rollout, backend.asarray(data), mask=backend.asarray(mask), **options
    )
    values = backend.check(result, dtype_name=dtype_name, shape=_expected_shape(options))
    oracle_options = _oracle_options({k: v for k, v in options.items() if k != "validate"})
    expected = oracle_rollout(data, mask=mask, **oracle_options)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)
    # Averaging first and renormalising the mean is a different (wrong) answer here.
    fused = data.astype(np.float64).mean(axis=-3) if "heads" not in options else None
    if fused is not None:
        commuted = oracle_rollout(fused, heads=None, mask=mask, **oracle_options)
        assert not np.allclose(values, commuted, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("path", ["compiled", "array-api", "eager", "eager-array-api"])
@STREAM_BLOCKS
def test_padded_paths_agree_on_rows_without_real_weight(
    weights: np.ndarray,
    dtype_name: str,
    path: str,
    block_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head with no weight on a real key gives that query its unit row, on every path.

    The compiled pass, the array-API pass (:func:`masked_head_mean`), streamed or in the
    eager preparation (taken with pruning that prunes nothing), agree with the oracle.
    """
    from attnflow import _prepare

    _stream(monkeypatch, block_bytes)
    if path.endswith("array-api"):
        monkeypatch.setattr(_prepare, "fuse_masked_mean", lambda *a, **k: None)
    data, mask = _leaky_padded(weights, dtype_name)
    data[1, 2, 0, 4, :] = 0.0  # item 1 (6 real tokens), layer 2, head 0, query 4:
    data[1, 2, 0, 4, 7] = 1.0  # all of its weight on a padded key
    data[1, 0, :, 2, :] = 0.0  # layer 0, query 2: every head on padded keys
    data[1, 0, :, 2, 8] = 1.0
    options: dict[str, Any] = {"threshold": 0.0} if path.startswith("eager") else {}
    tol = tolerance(dtype_name)
    for rows in (None, 2, [4, 0]):
        result = attnflow.rollout(data, mask=mask, rows=rows, layers="all", **options)
        expected = oracle_rollout(data, mask=mask, rows=rows, layers="all")
        np.testing.assert_allclose(result, expected, rtol=tol, atol=tol)
    first = attnflow.raw(data, mask=mask, layers=0)
    np.testing.assert_array_equal(first[1, 2], np.eye(SHAPE[-1])[2])  # the identity row


@pytest.mark.parametrize("path", ["compiled", "array-api"])
@STREAM_BLOCKS
def test_padded_checks_keep_their_verdicts(
    weights: np.ndarray, path: str, block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every head of the rows read is checked, padded queries left out, as before."""
    from attnflow import _prepare

    _stream(monkeypatch, block_bytes)
    if path == "array-api":
        monkeypatch.setattr(_prepare, "fuse_masked_mean", lambda *a, **k: None)
    data, mask = _leaky_padded(weights, "float64")
    attnflow.rollout(data, mask=mask, rows=0)  # NaN in padded queries only: fine
    nan_key = data.copy()
    nan_key[2, 1, 3, 1, 7] = np.nan  # a padded key of a real row (item 2 has 3 tokens)
    with pytest.raises(ValueError, match=r"`attentions` must be finite; found NaN.* in 1 row"):
        attnflow.rollout(nan_key, mask=mask, rows=0)
    unvalidated = attnflow.rollout(nan_key, mask=mask, rows=0, validate=False)
    np.testing.assert_allclose(unvalidated, oracle_rollout(data, mask=mask, rows=0), atol=1e-12)
    negative = data.copy()
    negative[0, 3, 2, 5, 1] = -0.25  # one head of a real row, its sum kept at one
    negative[0, 3, 2, 5, 2] += 0.25
    with pytest.raises(ValueError, match="must be non-negative"):
        attnflow.rollout(negative, mask=mask, rows=0)
    scaled = data.copy()
    scaled[1, 0, 1, 5, :] *= 1.01  # one head's row: the renormalisation would hide it
    with pytest.raises(ValueError, match="rows must sum to 1"):
        attnflow.rollout(scaled, mask=mask, rows=0)
    attnflow.rollout(scaled, mask=mask, rows=0, validate=False)
