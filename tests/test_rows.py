"""`rows` is decided once: an int is one row whose axis the result drops, in every method.

:func:`attnflow._validation.check_rows` reads the caller's `rows` into one
:class:`attnflow._rows.Rows`; the methods keep the row axis and squeeze it once at the end.
So ``rows=k`` must be exactly ``rows=[k]`` without its row axis, and both the row ``k`` of
the full result, whatever the method, the backend and the dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import softmax_attention

import attnflow
from attnflow._methods import METHODS
from attnflow._prepare import enter_arrays
from attnflow._rows import Rows, take_rows
from attnflow._validation import check_rows

SHAPE = (2, 3, 2, 6, 6)  # batch, layers, heads, n, n
ROW = 4


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261126)
    mask = np.ones((SHAPE[0], SHAPE[-1]), dtype=bool)
    mask[1, -1] = False  # the second sequence is padded: row ROW is real in both
    return {
        "weights": softmax_attention(rng, SHAPE),
        "gradients": rng.normal(size=SHAPE),
        "mask": mask,
    }


def _methods(gradients: Any) -> dict[str, tuple[str, Callable[..., Any], dict[str, Any]]]:
    """name -> (registry name, call(attentions, **options), options)."""
    return {
        "raw": ("raw", attnflow.raw, {}),
        "rollout": ("rollout", attnflow.rollout, {}),
        "rollout heads=each": ("rollout", attnflow.rollout, {"heads": "each"}),
        "flow": ("flow", attnflow.flow, {}),
        "flow heads=each": ("flow", attnflow.flow, {"heads": "each"}),
        "gradient_rollout": (
            "gradient_rollout",
            lambda a, **o: attnflow.gradient_rollout(a, gradients, **o),
            {"exclude_self": True},
        ),
    }


@pytest.mark.parametrize(
    "method",
    ["raw", "rollout", "rollout heads=each", "flow", "flow heads=each", "gradient_rollout"],
)
def test_one_int_row_is_the_block_of_that_row_without_its_axis(
    backend: Variant, dtype_name: str, data: dict[str, np.ndarray], method: str
) -> None:
    weights = backend.asarray(data["weights"], dtype_name)
    mask = backend.asarray(data["mask"])
    name, call, options = _methods(backend.asarray(data["gradients"], dtype_name))[method]
    options = {**options, "layers": "all", "mask": mask}
    if backend.refuses_jit(name, weights, **options):
        return

    def run(**chosen: object) -> object:
        if METHODS[name].host_only:  # max-flow computes a Dask graph by design
            return call(weights, **chosen, **options)
        return backend.run(call, weights, **chosen, **options)

    one = run(rows=ROW)
    block = run(rows=[ROW])
    full = run()
    block_values = backend.to_numpy(block)
    assert block_values.shape[-2] == 1
    shape = block_values.shape[:-2] + block_values.shape[-1:]
    one_values = backend.check(one, dtype_name=dtype_name, shape=shape)
    np.testing.assert_array_equal(one_values, block_values[..., 0, :])
    tol = tolerance(dtype_name)
    full_values = backend.to_numpy(full)
    np.testing.assert_allclose(one_values, full_values[..., ROW, :], rtol=tol, atol=tol)
    assert np.all(np.isfinite(one_values))
    assert np.any(one_values > 0)


def test_encoder_decoder_rows_are_decided_once() -> None:
    rng = np.random.default_rng(5)
    encoder = softmax_attention(rng, (2, 2, 4, 4))
    decoder = softmax_attention(rng, (2, 2, 3, 3))
    cross = softmax_attention(rng, (2, 2, 3, 4))
    for method in (attnflow.encoder_decoder_rollout, attnflow.encoder_decoder_flow):
        one = method(encoder, decoder, cross, rows=-1, layers="all")
        block = method(encoder, decoder, cross, rows=[2], layers="all")
        full = method(encoder, decoder, cross, layers="all")
        for got, stacked, every in zip(one, block, full, strict=True):
            assert got.shape == (2, every.shape[-1])
            np.testing.assert_array_equal(got, stacked[..., 0, :])
            np.testing.assert_allclose(got, every[..., 2, :], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (None, Rows()),
        (3, Rows((3,), single=True)),
        (np.int64(-1), Rows((4,), single=True)),
        ([0, -1, 2], Rows((0, 4, 2))),
        ([4], Rows((4,))),
        (np.array([1, 3]), Rows((1, 3))),
        ((2,), Rows((2,))),
    ],
)
def test_check_rows_reads_the_callers_rows_into_one_value(rows: object, expected: Rows) -> None:
    checked = check_rows(rows, 5)
    assert checked == expected
    assert checked.positions(5) == (tuple(range(5)) if rows is None else expected.index)


def test_rows_take_keeps_the_axis_and_select_gives_the_public_shape(backend: Variant) -> None:
    matrices = np.arange(2 * 5 * 5, dtype=np.float64).reshape(2, 5, 5)
    # The arrays as the maths sees them: TensorFlow tensors are converted at the boundary.
    (native,), xp, _ = enter_arrays([backend.asarray(matrices)], ["matrices"], None)

    def values(x: Any) -> np.ndarray:
        return np.asarray(x) if backend.library == "tensorflow" else backend.to_numpy(x)

    for rows, public in [
        (Rows((3,), single=True), matrices[:, 3]),
        (Rows((3,)), matrices[:, [3]]),
        (Rows((4, 0)), matrices[:, [4, 0]]),
        (Rows(), matrices),
    ]:
        np.testing.assert_array_equal(values(rows.select(native, xp)), public)
        taken = values(rows.take(native, xp))
        np.testing.assert_array_equal(taken, take_rows(matrices, rows.index, np))
        np.testing.assert_array_equal(values(rows.squeeze(rows.take(native, xp))), public)
