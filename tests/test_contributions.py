"""Value-aware token mixing (norm-based, GlobEnc, ALTI) against the float64 loop oracle."""

from __future__ import annotations

import os
import select
import signal
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import (
    oracle_block_output,
    oracle_contributions,
    oracle_flow,
    oracle_head_values,
    oracle_rollout,
    oracle_terms,
    softmax_attention,
)

import attnflow
from attnflow import _contributions, _contributions_fused

BATCH, HEADS, N, D = 2, 3, 5, 6
EPS = 1e-5
METHODS = ("norm", "globenc", "alti")


@pytest.fixture(scope="module")
def block() -> dict[str, np.ndarray]:
    """One attention block's pieces, a batch of two sequences."""
    rng = np.random.default_rng(20261123)
    return {
        "alpha": softmax_attention(rng, (BATCH, HEADS, N, N), scale=1.5),
        "z": rng.normal(size=(BATCH, N, D)),
        "x": rng.normal(size=(BATCH, N, D)),
        "w_v": rng.normal(scale=0.5, size=(D, D)),
        "b_v": rng.normal(scale=0.5, size=D),
        "w_o": rng.normal(scale=0.5, size=(D, D)),
        "b_o": rng.normal(scale=0.5, size=D),
        "gamma": 1.0 + rng.normal(scale=0.3, size=D),
        "beta": rng.normal(scale=0.3, size=D),
        "gamma2": 1.0 + rng.normal(scale=0.3, size=D),
        "v2": rng.normal(scale=2.0, size=(BATCH, N, D)),
    }


def _call(backend: Variant, function: Callable[..., Any], arrays: list[Any]) -> Any:
    """Call ``function(*arrays)`` as this variant's users would (jit: every array traced)."""
    if backend.jit:
        return backend.modules["jax"].jit(function)(*arrays)
    first, rest = arrays[0], arrays[1:]
    return backend.run(lambda a: function(a, *rest), first)


def _native(backend: Variant, block: dict[str, np.ndarray], dtype_name: str) -> dict[str, Any]:
    return {key: backend.asarray(value, dtype_name) for key, value in block.items()}


def _values(block: dict[str, np.ndarray], z: np.ndarray) -> np.ndarray:
    return np.stack(
        [oracle_head_values(item, block["w_v"], block["b_v"], block["w_o"], HEADS) for item in z]
    )


def _exact(block: dict[str, np.ndarray], dtype_name: str) -> dict[str, np.ndarray]:
    """The inputs as the backend sees them (rounded to the dtype), in float64."""
    return {k: v.astype(dtype_name).astype(np.float64) for k, v in block.items()}


def test_head_values(backend: Variant, dtype_name: str, block: dict[str, np.ndarray]) -> None:
    native = _native(backend, block, dtype_name)

    def run(z: Any, w_v: Any, w_o: Any, b_v: Any) -> Any:
        return attnflow.head_values(z, w_v, w_o, heads=HEADS, value_bias=b_v)

    result = _call(backend, run, [native["z"], native["w_v"], native["w_o"], native["b_v"]])
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, HEADS, N, D))
    exact = _exact(block, dtype_name)
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, _values(exact, exact["z"]), rtol=tol, atol=tol)


def test_head_values_with_grouped_query_attention(backend: Variant, dtype_name: str) -> None:
    """Each value head serves a group of consecutive query heads (Hugging Face's repeat_kv).

    The oracle repeats the value projection's columns across each group, so that every
    query head owns a (copied) value head, and runs the per-head loop.
    """
    heads, value_heads, d_head = 6, 2, 2
    rng = np.random.default_rng(20261125)
    pieces = {
        "z": rng.normal(size=(BATCH, N, D)),
        "w_v": rng.normal(scale=0.5, size=(D, value_heads * d_head)),
        "w_o": rng.normal(scale=0.5, size=(heads * d_head, D)),
        "b_v": rng.normal(scale=0.5, size=value_heads * d_head),
    }
    native = _native(backend, pieces, dtype_name)

    def run(z: Any, w_v: Any, w_o: Any, b_v: Any) -> Any:
        return attnflow.head_values(
            z, w_v, w_o, heads=heads, value_heads=value_heads, value_bias=b_v
        )

    result = _call(backend, run, [native["z"], native["w_v"], native["w_o"], native["b_v"]])
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, heads, N, D))
    exact = _exact(pieces, dtype_name)
    group = heads // value_heads
    columns = [h // group * d_head + c for h in range(heads) for c in range(d_head)]
    w_v, b_v = exact["w_v"][:, columns], exact["b_v"][columns]
    expected = np.stack([oracle_head_values(z, w_v, b_v, exact["w_o"], heads) for z in exact["z"]])
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)
    # Query heads of one group read the same values through their own output rows.
    assert not np.allclose(values[:, 0], values[:, 1])


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_terms_sum_to_the_block_output(
    backend: Variant, dtype_name: str, block: dict[str, np.ndarray], placement: str
) -> None:
    """Completeness: Σ_j T_i(x_j) + b_i is the block's forward pass, and T is the oracle's."""
    exact = _exact(block, dtype_name)
    # Post-LN (BERT) reads the residual stream itself; pre-LN (GPT-2) a normalised copy.
    z = exact["x"] if placement == "post" else exact["z"]
    values = _values(exact, z)
    native = _native(backend, {**block, "f": values}, dtype_name)
    post = placement == "post"

    def run(alpha: Any, f: Any, x: Any, b_o: Any, gamma: Any, beta: Any) -> Any:
        norm = (gamma, beta, EPS) if post else None
        return attnflow.attention_terms(alpha, f, x, bias=b_o, norm=norm)

    arrays = [native[k] for k in ("alpha", "f", "x", "b_o", "gamma", "beta")]
    terms, offset = _call(backend, run, arrays)
    terms = backend.check(terms, dtype_name=dtype_name, shape=(BATCH, N, N, D))
    offset = backend.check(offset, dtype_name=dtype_name, shape=(BATCH, N, D))
    norm = (exact["gamma"], exact["beta"], EPS) if post else None
    tol = tolerance(dtype_name)
    for b in range(BATCH):
        expected = oracle_block_output(
            exact["alpha"][b],
            z[b],
            exact["x"][b],
            exact["w_v"],
            exact["b_v"],
            exact["w_o"],
            exact["b_o"],
            norm,
        )
        np.testing.assert_allclose(terms[b].sum(axis=-2) + offset[b], expected, rtol=tol, atol=tol)
        want_terms, want_offset, _ = oracle_terms(
            exact["alpha"][b], values[b], exact["x"][b], exact["b_o"], norm
        )
        np.testing.assert_allclose(terms[b], want_terms, rtol=tol, atol=tol)
        np.testing.assert_allclose(offset[b], want_offset, rtol=tol, atol=tol)


def _expected(
    exact: dict[str, np.ndarray], values: np.ndarray, method: str, *, post: bool, second: bool
) -> np.ndarray:
    norm = (exact["gamma"], exact["beta"], EPS) if post else None
    return np.stack(
        [
            oracle_contributions(
                exact["alpha"][b],
                values[b],
                exact["x"][b],
                exact["b_o"],
                norm,
                method,
                (exact["gamma2"], EPS, exact["v2"][b]) if second else None,
            )
            for b in range(BATCH)
        ]
    )


def _contributions_of(
    backend: Variant, native: dict[str, Any], method: str, *, post: bool, second: bool
) -> Any:
    def run(alpha: Any, f: Any, x: Any, b_o: Any, gamma: Any, beta: Any, g2: Any, v2: Any) -> Any:
        return attnflow.contributions(
            alpha,
            f,
            x,
            method=method,  # type: ignore[arg-type]
            bias=b_o,
            norm=(gamma, beta, EPS) if post else None,
            second_norm=(g2, None, EPS) if second else None,
            second_norm_input=v2 if second else None,
        )

    keys = ("alpha", "f", "x", "b_o", "gamma", "beta", "gamma2", "v2")
    return _call(backend, run, [native[k] for k in keys])


CASES = [(m, p) for m in METHODS for p in ("post", "pre")] + [("globenc", "post+ln2")]


@pytest.fixture(params=["compiled", "array-api"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Host memory goes to the compiled kernel; "array-api" turns it off (the GPU's path)."""
    if request.param == "array-api":
        monkeypatch.setattr(_contributions_fused, "_kernels", None)
    elif not _contributions_fused.KERNEL_AVAILABLE:  # pragma: no cover - a source checkout
        pytest.fail("the compiled kernel is not built: pip install -e . builds it")
    return str(request.param)


@pytest.mark.parametrize(("method", "placement"), CASES)
def test_matrices_equal_the_oracle(
    backend: Variant,
    dtype_name: str,
    block: dict[str, np.ndarray],
    method: str,
    placement: str,
    path: str,  # the fixture picks the path
) -> None:
    # "post+ln2": GlobEnc with the second LayerNorm of a post-LN (BERT) layer.
    post, second = placement != "pre", placement == "post+ln2"
    exact = _exact(block, dtype_name)
    values = _values(exact, exact["x"] if post else exact["z"])
    native = _native(backend, {**block, "f": values}, dtype_name)
    result = _contributions_of(backend, native, method, post=post, second=second)
    matrices = backend.check(result, dtype_name=dtype_name, shape=(BATCH, N, N))
    tol = tolerance(dtype_name)
    expected = _expected(exact, values, method, post=post, second=second)
    np.testing.assert_allclose(matrices, expected, rtol=tol, atol=tol)
    assert (matrices >= 0).all()
    if method == "alti":  # rows sum to one, or are empty when no token gets closer to y_i
        sums = matrices.sum(-1)
        assert np.all((np.abs(sums - 1) < tol) | (sums == 0)), sums


def test_chunks_give_the_same_matrices(
    backend: Variant, block: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Receiving tokens taken two at a time (three blocks of rows) change nothing.

    The blocks are the array-API path's (the compiled kernel needs none).
    """
    monkeypatch.setattr(_contributions_fused, "_kernels", None)
    exact = _exact(block, "float64")
    values = _values(exact, exact["x"])
    native = _native(backend, {**block, "f": values}, "float64")
    monkeypatch.setattr(_contributions, "_CHUNK_ELEMENTS", 2 * BATCH * N * D)
    tol = tolerance("float64")
    for method in METHODS:
        result = _contributions_of(backend, native, method, post=True, second=False)
        matrices = backend.check(result, dtype_name="float64", shape=(BATCH, N, N))
        expected = _expected(exact, values, method, post=True, second=False)
        np.testing.assert_allclose(matrices, expected, rtol=tol, atol=tol)


@pytest.fixture(params=["avx512", "avx2"])
def vector_width(request: pytest.FixtureRequest) -> Iterator[str]:
    """ALTI's AVX-512 version where the CPU has one, or the AVX2 / SSE2 clones."""
    if not _contributions_fused.KERNEL_AVAILABLE:  # pragma: no cover - a source checkout
        pytest.fail("the compiled kernel is not built: pip install -e . builds it")
    from attnflow import _contributions_kernel

    before = _contributions_kernel._allow_avx512(request.param == "avx512")
    try:
        yield str(request.param)
    finally:
        _contributions_kernel._allow_avx512(before)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("placement", ["post", "post+ln2", "pre"])
def test_the_compiled_kernel_equals_the_array_api_path(
    dtype_name: str, placement: str, monkeypatch: pytest.MonkeyPatch, vector_width: str
) -> None:
    """The kernel's loops against the blocks of terms, on shapes with every remainder.

    n = 19 and d = 21 leave tails past the kernel's 8 receiving tokens, 8 or 16 lanes and
    16 keys; the weights are a view with rows n + 5 apart, 12 heads as in MiniLM, the
    batch two axes. Padded keys (no weight in any head) get exactly 0. Both versions of
    ALTI's distances run on a CPU with AVX-512 (`vector_width`).
    """
    rng = np.random.default_rng(20261126)
    batch, heads, n, d = (2, 1), 12, 19, 21
    weights = softmax_attention(rng, (*batch, heads, n, n - 3), scale=2.0)
    wide = np.zeros((*batch, heads, n, n + 5), dtype=dtype_name)
    wide[..., : n - 3] = weights  # the last three keys are padding
    alpha = wide[..., :n]  # rows n + 5 apart
    assert not alpha.flags.c_contiguous
    f = rng.normal(size=(*batch, heads, n, d)).astype(dtype_name)
    x = rng.normal(size=(*batch, n, d)).astype(dtype_name)
    b_o = rng.normal(size=d).astype(dtype_name)
    gamma = (1.0 + rng.normal(scale=0.3, size=d)).astype(dtype_name)
    options: dict[str, Any] = {"bias": b_o}
    if placement != "pre":
        options["norm"] = (gamma, rng.normal(size=d).astype(dtype_name), EPS)
    if placement == "post+ln2":
        options["second_norm"] = (gamma[::-1].copy(), None, EPS)
        options["second_norm_input"] = rng.normal(size=(*batch, n, d)).astype(dtype_name)
    tol = 1e-12 if dtype_name == "float64" else 1e-5
    for method in METHODS:
        if placement == "post+ln2" and method != "globenc":
            continue
        compiled = attnflow.contributions(alpha, f, x, method=method, **options)
        with monkeypatch.context() as patch:
            patch.setattr(_contributions_fused, "_kernels", None)
            reference = attnflow.contributions(alpha, f, x, method=method, **options)
        # Relative to each row's largest entry (ALTI's rows sum to one, norms do not).
        error = np.abs(compiled - reference) / np.abs(reference).max(axis=-1, keepdims=True)
        assert error.max() < tol, (method, error.max())
        assert compiled.dtype == np.dtype(dtype_name)
        assert (compiled[..., : n - 3, n - 3 :] == 0).all()  # real rows, padded keys


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("batch", [(1,), (3, 1)])
def test_threads_give_the_same_bits_as_one(
    dtype_name: str, batch: tuple[int, ...], monkeypatch: pytest.MonkeyPatch, vector_width: str
) -> None:
    """The kernel's rows split between 2, 3 or 7 threads: bit for bit the one-thread result.

    Ranges that cut a sequence in the middle (one batch item) and at odd rows (n = 19).
    """
    if not _contributions_fused.KERNEL_AVAILABLE:  # pragma: no cover - a source checkout
        pytest.fail("the compiled kernel is not built: pip install -e . builds it")
    monkeypatch.setattr(_contributions_fused, "_THREADED_WORK", 0)  # split even tiny layers
    rng = np.random.default_rng(20261128)
    heads, n, d = 5, 19, 21
    alpha = softmax_attention(rng, (*batch, heads, n, n), scale=2.0).astype(dtype_name)
    f = rng.normal(size=(*batch, heads, n, d)).astype(dtype_name)
    x = rng.normal(size=(*batch, n, d)).astype(dtype_name)
    norm = ((1.0 + rng.normal(scale=0.3, size=d)).astype(dtype_name), None, EPS)
    calls: list[tuple[int, int]] = []
    split = _contributions_fused._row_ranges

    def spy(rows: int, parts: int) -> list[tuple[int, int]]:
        ranges = split(rows, parts)
        calls.extend(ranges)
        return ranges

    monkeypatch.setattr(_contributions_fused, "_row_ranges", spy)
    for method in METHODS:
        one, one_out = _contributions.contributions_and_outputs(
            alpha, f, x, method=method, norm=norm, threads=1
        )
        for threads in (2, 3, 7):
            calls.clear()
            many, many_out = _contributions.contributions_and_outputs(
                alpha, f, x, method=method, norm=norm, threads=threads
            )
            assert len(calls) == threads  # the rows were split
            np.testing.assert_array_equal(many, one)
            np.testing.assert_array_equal(many_out, one_out)
    with pytest.raises(ValueError, match=r"`threads` must be a positive int; got 0"):
        _contributions.contributions_and_outputs(alpha, f, x, method="alti", threads=0)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_alti_shares_in_the_kernel_are_maximum_of_totals_minus_distances(
    dtype_name: str, monkeypatch: pytest.MonkeyPatch, vector_width: str
) -> None:
    """The kernel's ``max(‖y_i‖₁ − D_ij, 0)``: bit for bit what the array operations give.

    Split between 3 threads at odd rows; the last keys are padding (shares exactly 0).
    """
    if not _contributions_fused.KERNEL_AVAILABLE:  # pragma: no cover - a source checkout
        pytest.fail("the compiled kernel is not built: pip install -e . builds it")
    monkeypatch.setattr(_contributions_fused, "_THREADED_WORK", 0)
    rng = np.random.default_rng(20261131)
    heads, n, d = 5, 19, 21
    alpha = np.zeros((2, heads, n, n), dtype=dtype_name)
    alpha[..., : n - 2] = softmax_attention(rng, (2, heads, n, n - 2), scale=2.0)
    f = rng.normal(size=(2, heads, n, d)).astype(dtype_name)
    y = rng.normal(size=(2, n, d)).astype(dtype_name)
    r = rng.normal(size=(2, n, d)).astype(dtype_name)
    scale = rng.uniform(0.5, 2.0, size=(2, n, 1)).astype(dtype_name)
    distances = _contributions_fused.distances(alpha, f, scale, y, np, 3, r)
    shares = _contributions_fused.distances(alpha, f, scale, y, np, 3, r, shares=True)
    assert distances is not None
    assert shares is not None
    expected = np.maximum(distances[1] - distances[0], np.zeros_like(distances[0]))
    assert (expected > 0).any()  # both sides of the clip
    assert (expected == 0).any()
    np.testing.assert_array_equal(shares[0], expected)
    np.testing.assert_array_equal(shares[1], distances[1])
    assert (shares[0][..., n - 2 :] == 0).all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_threads_work_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after the pool was made gets a pool of its own (not a hang)."""
    if not _contributions_fused.KERNEL_AVAILABLE:  # pragma: no cover - a source checkout
        pytest.fail("the compiled kernel is not built: pip install -e . builds it")
    monkeypatch.setattr(_contributions_fused, "_THREADED_WORK", 0)
    rng = np.random.default_rng(20261129)
    alpha = softmax_attention(rng, (2, 3, 9, 9), scale=2.0)
    f, x = rng.normal(size=(2, 3, 9, 5)), rng.normal(size=(2, 9, 5))
    expected, _ = _contributions.contributions_and_outputs(alpha, f, x, method="alti", threads=3)
    read, write = os.pipe()
    with warnings.catch_warnings():  # fork() in a process with threads (Python 3.12+)
        warnings.simplefilter("ignore", DeprecationWarning)
        # JAX, when a run of several backends loaded it, warns from its fork handler
        # (the child here runs NumPy and the kernel only).
        warnings.simplefilter("ignore", RuntimeWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            matrix, _ = _contributions.contributions_and_outputs(
                alpha, f, x, method="alti", threads=3
            )
            os.write(write, np.ascontiguousarray(matrix).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    ready: list[int] = []
    try:
        ready, _, _ = select.select([read], [], [], 60)
        assert ready, "the forked child did not answer in 60 s (its thread pool hangs)"
        data = b""
        while chunk := os.read(read, 1 << 16):
            data += chunk
    finally:
        os.close(read)
        if not ready:
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    got = np.frombuffer(data, dtype=np.float64).reshape(expected.shape)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("value_heads", [None, 2])
def test_attention_output_is_the_sum_over_the_head_values(value_heads: int | None) -> None:
    """Head-space contexts projected once equal ``Σ_h α^h f^h`` (grouped-query too)."""
    heads, d_head = 6, 2
    kv = heads if value_heads is None else value_heads
    rng = np.random.default_rng(20261127)
    alpha = softmax_attention(rng, (BATCH, heads, N, N), scale=1.5)
    z = rng.normal(size=(BATCH, N, D))
    w_v = rng.normal(size=(D, kv * d_head))
    w_o = rng.normal(size=(heads * d_head, D))
    b_v = rng.normal(size=kv * d_head)
    options: dict[str, Any] = {"heads": heads, "value_heads": value_heads, "value_bias": b_v}
    f, got = _contributions.head_values_and_attention_output(alpha, z, w_v, w_o, **options)
    np.testing.assert_array_equal(f, attnflow.head_values(z, w_v, w_o, **options))
    expected = np.einsum("bhij,bhjd->bid", alpha, f)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    # And the matrices built with it are those built without.
    for method in METHODS:
        with_it, out_with = _contributions.contributions_and_outputs(
            alpha, f, z, method=method, attended=got
        )
        without, out_without = _contributions.contributions_and_outputs(alpha, f, z, method=method)
        np.testing.assert_allclose(with_it, without, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out_with, out_without, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("value_heads", [None, 2])
def test_values_projected_by_the_model_are_not_projected_again(value_heads: int | None) -> None:
    """``projected=True``: `inputs` are ``z W_V + b_V``, as a model's value projection gave.

    The values (and the attention's output) equal those projected from `z`; without
    weights the attention's output is skipped. A bias or a width that does not fit is
    refused before any work.
    """
    heads, d_head = 6, 2
    kv = heads if value_heads is None else value_heads
    rng = np.random.default_rng(20261126)
    alpha = softmax_attention(rng, (BATCH, heads, N, N), scale=1.5)
    z = rng.normal(size=(BATCH, N, D))
    w_v, w_o = rng.normal(size=(D, kv * d_head)), rng.normal(size=(heads * d_head, D))
    b_v = rng.normal(size=kv * d_head)
    gammas = [rng.normal(size=D)]
    options: dict[str, Any] = {"heads": heads, "value_heads": value_heads}
    f, attended = _contributions.head_values_and_attention_output(
        alpha, z, w_v, w_o, value_bias=b_v, centred_by=gammas, **options
    )
    projected = z @ w_v + b_v
    got, got_attended = _contributions.head_values_and_attention_output(
        alpha, projected, w_v, w_o, projected=True, centred_by=gammas, **options
    )
    np.testing.assert_allclose(got, f, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_attended, attended, rtol=1e-12, atol=1e-12)
    values, none = _contributions.head_values_and_attention_output(
        None, projected, w_v, w_o, projected=True, centred_by=gammas, **options
    )
    assert none is None
    np.testing.assert_array_equal(values, got)
    with pytest.raises(ValueError, match=r"`value_bias` must be None with projected=True"):
        _contributions.head_values_and_attention_output(
            None, projected, w_v, w_o, projected=True, value_bias=b_v, **options
        )
    with pytest.raises(ValueError, match=r"`value_weight` must have shape"):
        _contributions.head_values_and_attention_output(
            None, projected[..., :-1], w_v, w_o, projected=True, **options
        )


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize(
    ("method", "second"), [("alti", False), ("globenc", False), ("globenc", True)]
)
def test_layer_norms_folded_into_the_output_projection(
    block: dict[str, np.ndarray], dtype_name: str, method: str, second: bool, path: str
) -> None:
    """``W_O C Γ_1 (C Γ_2)`` gives the centred values, and the same matrices and outputs.

    The previous formulation (the core centring f^h and applying the gains) is the oracle,
    on the compiled and the array-API path; a LayerNorm without a gain (None) centres only.
    """
    exact = _exact(block, dtype_name)
    alpha, z = exact["alpha"].astype(dtype_name), exact["x"].astype(dtype_name)
    w_v, w_o, b_v = (exact[k].astype(dtype_name) for k in ("w_v", "w_o", "b_v"))
    gammas = [exact["gamma"].astype(dtype_name)]
    options: dict[str, Any] = {
        "bias": exact["b_o"].astype(dtype_name),
        "norm": (gammas[0], exact["beta"].astype(dtype_name), EPS),
    }
    if second:
        gammas.append(exact["gamma2"].astype(dtype_name))
        options["second_norm"] = (gammas[1], None, EPS)
        options["second_norm_input"] = exact["v2"].astype(dtype_name)
    tol = 1e-12 if dtype_name == "float64" else 1e-5
    for gains in (gammas, [None] * len(gammas)):
        pathway = {"heads": HEADS, "value_bias": b_v}
        f, attended = _contributions.head_values_and_attention_output(alpha, z, w_v, w_o, **pathway)
        folded, attended_folded = _contributions.head_values_and_attention_output(
            alpha, z, w_v, w_o, centred_by=gains, **pathway
        )
        np.testing.assert_array_equal(attended_folded, attended)  # from W_O itself
        expected_values = f.astype(np.float64)
        for gain in gains:
            expected_values = expected_values - expected_values.mean(-1, keepdims=True)
            expected_values = expected_values if gain is None else expected_values * gain
        scale = np.abs(expected_values).max()
        np.testing.assert_allclose(folded, expected_values, rtol=0, atol=tol * scale)
        run = dict(options)
        if gains[0] is None:
            run["norm"] = (None, run["norm"][1], EPS)
            if second:
                run["second_norm"] = (None, None, EPS)
        got, got_out = _contributions.contributions_and_outputs(
            alpha, folded, z, method=method, attended=attended, normalised_values=True, **run
        )
        want, want_out = _contributions.contributions_and_outputs(
            alpha, f, z, method=method, attended=attended, **run
        )
        assert got.dtype == np.dtype(dtype_name)
        largest = np.abs(want).max(axis=-1, keepdims=True)  # an ALTI row may be all zero
        error = np.abs(got - want) / np.where(largest > 0, largest, 1)
        assert error.max() < tol, (gains[0] is None, error.max())
        np.testing.assert_array_equal(got_out, want_out)


def test_folded_values_are_refused_where_they_do_not_apply(block: dict[str, np.ndarray]) -> None:
    alpha, z, f = block["alpha"], block["x"], _values(block, block["x"])
    norm = (block["gamma"], block["beta"], EPS)
    attended = np.einsum("bhij,bhjd->bid", alpha, f)
    with pytest.raises(ValueError, match=r"`normalised_values` must be False unless"):
        _contributions.contributions_and_outputs(
            alpha, f, z, method="norm", norm=norm, attended=attended, normalised_values=True
        )
    with pytest.raises(ValueError, match=r"`normalised_values` must .* norm=None"):
        _contributions.contributions_and_outputs(
            alpha, f, z, method="alti", attended=attended, normalised_values=True
        )
    with pytest.raises(ValueError, match=r"`attended` must be given with normalised_values"):
        _contributions.contributions_and_outputs(
            alpha, f, z, method="alti", norm=norm, normalised_values=True
        )
    with pytest.raises(ValueError, match=r"`centred_by\[1\]` must be None or a LayerNorm gain"):
        _contributions.head_values_and_attention_output(
            alpha, z, block["w_v"], block["w_o"], heads=HEADS, centred_by=[None, np.ones(D + 1)]
        )


def test_outputs_are_rebuilt_from_the_terms(block: dict[str, np.ndarray]) -> None:
    values = _values(block, block["x"])
    norm = (block["gamma"], block["beta"], EPS)
    _, outputs = _contributions.contributions_and_outputs(
        block["alpha"], values, block["x"], method="alti", bias=block["b_o"], norm=norm
    )
    for b in range(BATCH):
        expected = oracle_block_output(
            block["alpha"][b],
            block["x"][b],
            block["x"][b],
            block["w_v"],
            block["b_v"],
            block["w_o"],
            block["b_o"],
            norm,
        )
        np.testing.assert_allclose(outputs[b], expected, rtol=1e-12, atol=1e-12)


def test_padded_keys_get_nothing(block: dict[str, np.ndarray]) -> None:
    alpha = block["alpha"].copy()
    alpha[..., -1] = 0.0  # the last token is padding: no head attends to it
    alpha /= alpha.sum(-1, keepdims=True)
    values = _values(block, block["x"])
    norm = (block["gamma"], block["beta"], EPS)
    for method in METHODS:
        c = attnflow.contributions(alpha, values, block["x"], method=method, norm=norm)
        assert (c[:, :-1, -1] == 0).all(), method


@pytest.mark.parametrize("method", ["norm", "globenc"])
def test_gram_norms_equal_the_norms_of_the_terms(
    backend: Variant, dtype_name: str, method: str
) -> None:
    """The Gram path equals the norms of the terms built whole, at a model-like width.

    ``‖Σ_h α^h_ij v^h_j‖`` read from each key's Gram matrix of its head vectors, against
    :func:`attnflow.attention_terms` (the ``(n, n, d)`` tensor formed and its norms taken),
    with 12 heads of which two pairs nearly cancel and a padded key.
    """
    rng = np.random.default_rng(7)
    batch, heads, n, d = 2, 12, 9, 48
    alpha = softmax_attention(rng, (batch, heads, n, n), scale=2.0)
    alpha[..., -1] = 0.0  # a padded key
    alpha /= alpha.sum(-1, keepdims=True)
    values = rng.normal(size=(batch, heads, n, d))
    values[:, 1] = -values[:, 0] * (1 + 1e-3)  # heads whose sum almost cancels
    values[:, 3] = -values[:, 2]
    alpha[:, 1] = alpha[:, 0]
    alpha[:, 3] = alpha[:, 2]
    x = rng.normal(size=(batch, n, d))
    gamma, beta = 1.0 + rng.normal(scale=0.3, size=d), rng.normal(scale=0.3, size=d)
    arrays = {"alpha": alpha, "f": values, "x": x, "gamma": gamma, "beta": beta}
    exact = {k: v.astype(dtype_name).astype(np.float64) for k, v in arrays.items()}
    native = _native(backend, arrays, dtype_name)
    norm = (exact["gamma"], exact["beta"], EPS)
    if method == "norm":  # the attention alone: the terms of a block without residual
        zero = np.zeros_like(exact["x"])
        terms, _ = attnflow.attention_terms(exact["alpha"], exact["f"], zero)
    else:
        terms, _ = attnflow.attention_terms(exact["alpha"], exact["f"], exact["x"], norm=norm)
    expected = np.linalg.norm(terms, axis=-1)

    def run(alpha: Any, f: Any, x: Any, gamma: Any, beta: Any) -> Any:
        post = None if method == "norm" else (gamma, beta, EPS)
        return attnflow.contributions(alpha, f, x, method=method, norm=post)  # type: ignore[arg-type]

    result = _call(backend, run, [native[k] for k in ("alpha", "f", "x", "gamma", "beta")])
    got = backend.check(result, dtype_name=dtype_name, shape=(batch, n, n))
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * expected.max())
    assert (got[:, :-1, -1] == 0).all()


# -- rollout and flow over the matrices ---------------------------------------------------------
@pytest.fixture(scope="module")
def stacked(block: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Two layers' matrices of every method, ``(batch, L, n, n)``."""
    values = _values(block, block["x"])
    norm = (block["gamma"], block["beta"], EPS)
    layer = {
        m: attnflow.contributions(block["alpha"], values, block["x"], method=m, norm=norm)
        for m in METHODS
    }
    flipped = {
        m: attnflow.contributions(
            block["alpha"][..., ::-1, :], values, block["x"], method=m, norm=norm
        )
        for m in METHODS
    }
    return {m: np.stack([layer[m], flipped[m]], axis=1) for m in METHODS}


def _renormalised(matrices: np.ndarray) -> np.ndarray:
    out = np.zeros_like(matrices)
    for index in np.ndindex(*matrices.shape[:-1]):
        out[index] = matrices[index] / matrices[index].sum()
    return out


RESIDUAL = {"norm": 0.5, "globenc": 0.0, "alti": 0.0}


@pytest.mark.parametrize("method", METHODS)
def test_rollout_over_contributions(
    backend: Variant, dtype_name: str, stacked: dict[str, np.ndarray], method: str
) -> None:
    matrices = stacked[method].astype(dtype_name)
    residual = RESIDUAL[method]
    result = backend.run(
        lambda a: attnflow.rollout(a, heads=None, residual=residual, normalize_layers=True),
        backend.asarray(matrices, dtype_name),
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, N, N))
    expected = oracle_rollout(
        _renormalised(matrices.astype(np.float64)), heads=None, residual=residual
    )
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", METHODS)
def test_flow_over_contributions(
    backend: Variant, stacked: dict[str, np.ndarray], method: str
) -> None:
    # Called eagerly on every backend: max-flow runs on the host, outside any jax.jit.
    residual = RESIDUAL[method]
    result = attnflow.flow(
        backend.asarray(stacked[method], "float64"),
        heads=None,
        residual=residual,
        normalize_layers=True,
        rows=0,
    )
    values = backend.check(result, dtype_name="float64", shape=(BATCH, N))
    expected = oracle_flow(_renormalised(stacked[method]), heads=None, residual=residual, rows=0)
    np.testing.assert_allclose(values, expected, rtol=1e-9, atol=1e-9)


def test_renormalize_keeps_attention_validation_strict(stacked: dict[str, np.ndarray]) -> None:
    norms = stacked["globenc"]
    with pytest.raises(ValueError, match="rows must sum to 1"):
        attnflow.rollout(norms, heads=None)
    with pytest.raises(ValueError, match="non-negative"):
        attnflow.rollout(-norms, heads=None, normalize_layers=True)
    with pytest.raises(ValueError, match="finite"):
        attnflow.rollout(norms * np.nan, heads=None, normalize_layers=True)
    with pytest.raises(TypeError, match="`normalize_layers` must be True"):
        attnflow.rollout(norms, heads=None, normalize_layers="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`normalize_layers` must be True"):
        attnflow.flow(norms, heads=None, normalize_layers=1)  # type: ignore[arg-type]


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input_is_refused(block: dict[str, np.ndarray]) -> None:
    alpha, x = block["alpha"], block["x"]
    values = _values(block, x)
    with pytest.raises(ValueError, match="`method` must be"):
        attnflow.contributions(alpha, values, x, method="rollout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`weights` must have shape"):
        attnflow.contributions(alpha[..., :-1, :-1], values, x)
    with pytest.raises(ValueError, match="`values` must have shape"):
        attnflow.contributions(alpha, values[..., :-1], x)
    with pytest.raises(ValueError, match="`bias` must have shape"):
        attnflow.contributions(alpha, values, x, bias=np.zeros(D + 1))
    with pytest.raises(TypeError, match="`values` must have the dtype"):
        attnflow.contributions(alpha, values.astype(np.float32), x)
    with pytest.raises(TypeError, match="`norm` must be None or a tuple"):
        attnflow.contributions(alpha, values, x, norm=block["gamma"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps"):
        attnflow.contributions(alpha, values, x, norm=(None, None, -1.0))
    with pytest.raises(ValueError, match="`second_norm_input` must be given exactly"):
        attnflow.contributions(
            alpha, values, x, norm=(None, None, EPS), second_norm=(None, None, EPS)
        )
    with pytest.raises(ValueError, match="`second_norm` must be None for a pre-LN"):
        attnflow.contributions(alpha, values, x, second_norm=(None, None, EPS), second_norm_input=x)
    with pytest.raises(ValueError, match="`value_weight` must have shape"):
        attnflow.head_values(x, block["w_v"], block["w_o"], heads=4)
    with pytest.raises(ValueError, match="`heads` must be a positive int"):
        attnflow.head_values(x, block["w_v"], block["w_o"], heads=0)
    with pytest.raises(TypeError, match="`heads` must be a positive int"):
        attnflow.head_values(x, block["w_v"], block["w_o"], heads=2.0)  # type: ignore[arg-type]
    # Grouped-query attention: D = 6 columns of output projection, 3 heads of width 2.
    with pytest.raises(ValueError, match=r"`value_heads` must divide `heads` \(3\)"):
        attnflow.head_values(x, block["w_v"][:, :4], block["w_o"], heads=3, value_heads=2)
    with pytest.raises(ValueError, match="`value_heads` must be a positive int"):
        attnflow.head_values(x, block["w_v"], block["w_o"], heads=3, value_heads=0)
    with pytest.raises(TypeError, match="`value_heads` must be a positive int"):
        attnflow.head_values(x, block["w_v"], block["w_o"], heads=3, value_heads=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`value_weight` must have shape \(d_in, value_heads"):
        attnflow.head_values(x, block["w_v"], block["w_o"], heads=3, value_heads=1)
    with pytest.raises(ValueError, match=r"`value_bias` must have shape \(2,\)"):
        attnflow.head_values(
            x, block["w_v"][:, :2], block["w_o"], heads=3, value_heads=1, value_bias=block["b_v"]
        )


# -- GlobEnc as its authors aggregate it (issue 23) -----------------------------------------
def _authors_globenc(matrices: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Modarressi et al.'s rollout, from their description: ``J_1 = C_1``,
    ``J_l = C_l J_{l-1}`` over the raw N-Enc matrices, no residual, no row divided by its
    sum; each sentence on its real tokens (the authors run one unpadded sentence)."""
    out = np.zeros(matrices.shape[:1] + matrices.shape[2:])
    for b, real in enumerate(mask):
        joint = matrices[b, 0][np.ix_(real, real)]
        for layer in matrices[b, 1:]:
            joint = layer[np.ix_(real, real)] @ joint
        out[b][np.ix_(real, real)] = joint
    return out


def _authors_flow_row(matrices: np.ndarray, row: int) -> np.ndarray:
    """The authors' max flow (``src/attention_max_flow.py``, from its description): the raw
    matrices as capacities of the layered graph, one max-flow from output node `row` to
    each input node, the row then divided by its sum; networkx, float capacities."""
    import networkx as nx

    layers, n, _ = matrices.shape
    graph = nx.DiGraph()
    for layer in range(layers):
        for k in range(n):
            for j in range(n):
                if matrices[layer, k, j] > 0:
                    graph.add_edge((layer + 1, k), (layer, j), capacity=matrices[layer, k, j])
    flows = np.array([nx.maximum_flow_value(graph, (layers, row), (0, j)) for j in range(n)])
    return flows / flows.sum()


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_globenc_composed_as_its_authors_do(
    backend: Variant, dtype_name: str, stacked: dict[str, np.ndarray], padded: bool
) -> None:
    matrices = stacked["globenc"].astype(dtype_name).astype(np.float64)
    mask = np.ones((BATCH, N), dtype=bool)
    if padded:
        mask[1, -2:] = False
    compose = _contributions.compose_unnormalized
    result = backend.run(
        lambda a, mask=None: compose(attnflow.rollout, a, heads=None, mask=mask),
        backend.asarray(matrices, dtype_name),
        mask=backend.asarray(mask),
    )
    values = backend.check(result, dtype_name=dtype_name, shape=(BATCH, N, N))
    expected = _authors_globenc(matrices, mask)
    np.testing.assert_allclose(values, expected, rtol=tolerance(dtype_name))
    assert (values[1, :, ~mask[1]] == 0).all()
    assert (values[1, ~mask[1]] == 0).all()
    # The renormalised variant is another method, even once its rows are made shares.
    renormalised = oracle_rollout(_renormalised(matrices[:1]), heads=None, residual=0.0)[0]
    shares = expected[0] / expected[0].sum(-1, keepdims=True)
    assert np.abs(shares - renormalised).max() > 1e-3


def test_globenc_flow_as_its_authors_compute_it(stacked: dict[str, np.ndarray]) -> None:
    matrices = stacked["globenc"]
    mask = np.ones((BATCH, N), dtype=bool)
    got = _contributions.compose_unnormalized(attnflow.flow, matrices, heads=None, rows=0)
    for b in range(BATCH):
        np.testing.assert_allclose(got[b], _authors_flow_row(matrices[b], 0), rtol=1e-9)
    masked = mask.copy()
    masked[0, -1] = False
    got = _contributions.compose_unnormalized(
        attnflow.flow, matrices, heads=None, rows=0, mask=masked
    )
    cropped = matrices[0][:, : N - 1, : N - 1]
    np.testing.assert_allclose(got[0, : N - 1], _authors_flow_row(cropped, 0), rtol=1e-9)
    assert got[0, -1] == 0


def test_unnormalised_composition_refuses_what_reads_the_mask(
    stacked: dict[str, np.ndarray],
) -> None:
    matrices = stacked["globenc"]
    mask = np.ones((BATCH, N), dtype=bool)
    compose = _contributions.compose_unnormalized
    with pytest.raises(ValueError, match=r"`mask` must be a boolean array of shape \(\*batch"):
        compose(attnflow.rollout, matrices, heads=None, mask=mask[:, :-1])
    with pytest.raises(ValueError, match="`mask` must be a boolean"):
        compose(attnflow.rollout, matrices, heads=None, mask=mask.astype(int))
    mask[0, -1] = False
    with pytest.raises(ValueError, match="discard reads the padding mask"):
        compose(attnflow.rollout, matrices, heads=None, mask=mask, discard=0.5)
    # Without padding the mask is never read for renormalisation, so discard is fine.
    full = np.ones((BATCH, N), dtype=bool)
    assert compose(attnflow.rollout, matrices, heads=None, mask=full, discard=0.5).shape == (
        BATCH,
        N,
        N,
    )
