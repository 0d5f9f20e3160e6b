"""The target-conditioned rules of attnflow._logit_attribution against loop oracles.

Every rule is written here again from its paper, one head, row and token at a time in
float64 NumPy (direct logit: Ferrando et al. 2023's Logit; IFR: Ferrando & Voita 2024,
FlashTrace's span aggregate; ALTI-Logit's carry-down), and compared on every backend of
the matrix in float32 and float64. The readout is checked against the norm it linearises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance

from attnflow import _logit_attribution as rules

BATCH, HEADS, VALUE_HEADS, ROWS, N, HEAD_DIM, D = 2, 4, 2, 3, 6, 3, 5


@pytest.fixture(scope="module")
def layer() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261129)
    weights = rng.dirichlet(np.ones(N), size=(BATCH, HEADS, ROWS))
    return {
        "weights": weights,
        "values": rng.normal(size=(BATCH, VALUE_HEADS, N, HEAD_DIM)),
        "output_weight": rng.normal(scale=0.5, size=(HEADS * HEAD_DIM, D)),
        "output_bias": rng.normal(scale=0.5, size=D),
        "residual": rng.normal(size=(BATCH, ROWS, D)),
        "readout": rng.normal(size=(BATCH, ROWS, D)),
        "final_hidden": rng.normal(size=(BATCH, ROWS, D)),
        "unembedding": rng.normal(size=(BATCH, ROWS, D)),
        "gamma": 1.0 + rng.normal(scale=0.3, size=D),
        "beta": rng.normal(scale=0.3, size=D),
        "rollouts": rng.dirichlet(np.ones(N), size=(BATCH, 2, N)),
        "terms": rng.normal(size=(BATCH, 2, HEADS, ROWS, N)),
    }


def _head_output(layer: dict[str, np.ndarray], b: int, h: int, j: int) -> np.ndarray:
    """f^h(x_j) = v^{g(h)}_j W_O^h, head h reading value head h // (H / Hv)."""
    group = HEADS // VALUE_HEADS
    v = layer["values"][b, h // group, j]
    w_o = layer["output_weight"][h * HEAD_DIM : (h + 1) * HEAD_DIM]
    return v @ w_o


def _oracle_direct(layer: dict[str, np.ndarray]) -> np.ndarray:
    out = np.zeros((BATCH, HEADS, ROWS, N))
    for b in range(BATCH):
        for h in range(HEADS):
            for r in range(ROWS):
                for j in range(N):
                    f = _head_output(layer, b, h, j)
                    out[b, h, r, j] = layer["weights"][b, h, r, j] * f @ layer["readout"][b, r]
    return out


def _l1(x: np.ndarray) -> float:
    return float(np.abs(x).sum())


def _oracle_ifr(layer: dict[str, np.ndarray], *, span: bool) -> tuple[np.ndarray, np.ndarray]:
    groups = [list(range(ROWS))] if span else [[r] for r in range(ROWS)]
    shares = np.zeros((BATCH, HEADS, len(groups), N))
    kept = np.zeros((BATCH, len(groups)))
    for b in range(BATCH):
        for g, rows in enumerate(groups):
            parts = {
                (h, j): sum(layer["weights"][b, h, r, j] for r in rows)
                * _head_output(layer, b, h, j)
                for h in range(HEADS)
                for j in range(N)
            }
            residual = sum(layer["residual"][b, r] for r in rows)
            whole = residual + sum(parts.values()) + len(rows) * layer["output_bias"]
            proximity = {k: max(_l1(whole) - _l1(whole - z), 0.0) for k, z in parts.items()}
            own = max(_l1(whole) - _l1(whole - residual), 0.0)
            total = sum(proximity.values()) + own
            for (h, j), p in proximity.items():
                shares[b, h, g, j] = p / total
            kept[b, g] = own / total
    return shares, kept


def _native(backend: Variant, arrays: dict[str, np.ndarray], dtype_name: str) -> dict[str, Any]:
    return {k: backend.asarray(v, dtype_name) for k, v in arrays.items()}


def _run(backend: Variant, function: Any, first: Any) -> Any:
    return backend.run(function, first)


def test_direct_logit_terms_equal_the_loop_oracle(
    backend: Variant, dtype_name: str, layer: dict[str, np.ndarray]
) -> None:
    a = _native(backend, layer, dtype_name)
    result = _run(
        backend,
        lambda w: rules.direct_logit_terms(w, a["values"], a["output_weight"], a["readout"]),
        a["weights"],
    )
    got = backend.check(result, dtype_name=dtype_name, shape=(BATCH, HEADS, ROWS, N))
    scale = float(np.abs(_oracle_direct(layer)).max())
    np.testing.assert_allclose(got, _oracle_direct(layer), atol=tolerance(dtype_name) * 10 * scale)


@pytest.mark.parametrize("span", [False, True], ids=["rows", "span"])
def test_ifr_terms_equal_the_loop_oracle(
    backend: Variant, dtype_name: str, layer: dict[str, np.ndarray], span: bool
) -> None:
    a = _native(backend, layer, dtype_name)
    shares, kept = _oracle_ifr(layer, span=span)

    def ifr(w: Any) -> Any:
        terms, own = rules.ifr_terms(
            w,
            a["values"],
            a["output_weight"],
            a["residual"],
            output_bias=a["output_bias"],
            span=span,
        )
        return terms, own

    if backend.jit:
        got_terms, got_kept = backend.modules["jax"].jit(ifr)(a["weights"])
    else:
        got_terms, got_kept = backend.run(ifr, a["weights"])
    rows = 1 if span else ROWS
    got = backend.check(got_terms, dtype_name=dtype_name, shape=(BATCH, HEADS, rows, N))
    own = backend.check(got_kept, dtype_name=dtype_name, shape=(BATCH, rows))
    np.testing.assert_allclose(got, shares, atol=tolerance(dtype_name) * 10)
    np.testing.assert_allclose(own, kept, atol=tolerance(dtype_name) * 10)
    # Shares of one layer's output: the parts and the residual sum to one.
    np.testing.assert_allclose(got.sum(axis=(1, 3)) + own, 1.0, atol=tolerance(dtype_name) * 10)


@pytest.fixture(scope="module")
def causal_layer(layer: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The layer with the rows of generated text: row r reads the keys up to N - ROWS + r.

    The other keys have weight exactly 0 (the causal triangle the kernel skips).
    """
    weights = layer["weights"].copy()
    for r in range(ROWS):
        weights[..., r, N - ROWS + r + 1 :] = 0.0
    weights /= weights.sum(axis=-1, keepdims=True)
    return {**layer, "weights": weights}


@pytest.mark.parametrize("path", ["kernel", "array"])
def test_ifr_causal_rows_equal_the_loop_oracle_on_both_paths(
    backend: Variant,
    dtype_name: str,
    causal_layer: dict[str, np.ndarray],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled kernel (host memory) and the array-API path give the oracle's shares.

    The keys without weight get a share of exactly 0 on the kernel's path (skipped).
    """
    from attnflow import _ifr_fused

    if path == "array":
        monkeypatch.setattr(_ifr_fused, "_kernel", None)
    elif not _ifr_fused.KERNEL_AVAILABLE:
        pytest.fail("the compiled IFR kernel is not built (pip install -e . builds it)")
    a = _native(backend, causal_layer, dtype_name)
    shares, kept = _oracle_ifr(causal_layer, span=False)

    def ifr(w: Any) -> Any:
        return rules.ifr_terms(
            w, a["values"], a["output_weight"], a["residual"], output_bias=a["output_bias"]
        )

    if backend.jit:
        got_terms, got_kept = backend.modules["jax"].jit(ifr)(a["weights"])
    else:
        got_terms, got_kept = backend.run(ifr, a["weights"])
    got = backend.check(got_terms, dtype_name=dtype_name, shape=(BATCH, HEADS, ROWS, N))
    own = backend.check(got_kept, dtype_name=dtype_name, shape=(BATCH, ROWS))
    np.testing.assert_allclose(got, shares, atol=tolerance(dtype_name) * 10)
    np.testing.assert_allclose(own, kept, atol=tolerance(dtype_name) * 10)
    if path == "kernel" and backend.library in ("numpy", "torch") and not backend.jit:
        assert (got[causal_layer["weights"] == 0] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ifr_kernel_forms_the_parts_of_host_arrays(dtype: type) -> None:
    """NumPy and PyTorch CPU arrays take the kernel; its rows do not depend on the threads."""
    from attnflow import _ifr_fused

    rng = np.random.default_rng(7)
    weights = rng.dirichlet(np.ones(9), size=(2, 3, 5)).astype(dtype)
    weights[..., 7:] = 0.0
    transformed = rng.normal(size=(2, 3, 9, 11)).astype(dtype)
    whole = rng.normal(size=(2, 5, 11)).astype(dtype)
    one = _ifr_fused.proximities(weights, transformed, whole, np, threads=1)
    assert one is not None, "NumPy arrays on the host must take the compiled kernel"
    several = _ifr_fused.proximities(weights, transformed, whole, np, threads=3)
    np.testing.assert_array_equal(one, several)
    parts = weights[..., None] * transformed[:, :, None]  # (b, h, r, j, d)
    norms = np.abs(whole).sum(-1)[:, None, :, None]
    expected = np.maximum(norms - np.abs(whole[:, None, :, None] - parts).sum(-1), 0.0)
    np.testing.assert_allclose(one, expected, rtol=0, atol=50 * np.finfo(dtype).eps * norms.max())
    assert (one[..., 7:] == 0).all()
    torch = pytest.importorskip("torch")
    tensors = [torch.from_numpy(x) for x in (weights, transformed, whole)]
    import array_api_compat

    got = _ifr_fused.proximities(*tensors, array_api_compat.array_namespace(tensors[0]))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), one)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_readout_reads_the_logit_through_the_norm(
    backend: Variant, dtype_name: str, layer: dict[str, np.ndarray], norm: str
) -> None:
    """<x, u> + c is the logit of the normed x: the norm written out here, not linearised."""
    x, w, gamma, beta, eps = (
        layer["final_hidden"],
        layer["unembedding"],
        layer["gamma"],
        layer["beta"],
        1e-5,
    )
    if norm == "rms":
        normed = gamma * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)
    else:
        centred = x - x.mean(axis=-1, keepdims=True)
        normed = gamma * centred / np.sqrt(np.var(x, axis=-1, keepdims=True) + eps) + beta
    logits = (normed * w).sum(axis=-1)
    a = _native(backend, layer, dtype_name)
    bias = None if norm == "rms" else a["beta"]

    def read(h: Any) -> Any:
        return rules.readout(h, a["unembedding"], norm=norm, weight=a["gamma"], bias=bias, eps=eps)

    if backend.jit:
        direction, constant = backend.modules["jax"].jit(read)(a["final_hidden"])
    else:
        direction, constant = backend.run(read, a["final_hidden"])
    u = backend.check(direction, dtype_name=dtype_name, shape=(BATCH, ROWS, D))
    c = backend.check(constant, dtype_name=dtype_name, shape=(BATCH, ROWS))
    np.testing.assert_allclose((x * u).sum(-1) + c, logits, atol=tolerance(dtype_name) * 100)
    # A component's share is linear: the parts of x share the logit (less c) exactly.
    parts = np.stack([x * 0.25, x * 0.75])
    np.testing.assert_allclose(
        ((parts * u).sum(-1)).sum(0), logits - c, atol=tolerance(dtype_name) * 100
    )


def test_alti_logit_carries_terms_through_the_rollout_below(
    backend: Variant, dtype_name: str, layer: dict[str, np.ndarray]
) -> None:
    terms, rollouts = layer["terms"], layer["rollouts"]
    expected = np.zeros_like(terms)
    for b in range(BATCH):
        for l in range(2):
            for h in range(HEADS):
                for r in range(ROWS):
                    for j in range(N):
                        expected[b, l, h, r, j] = sum(
                            terms[b, l, h, r, k] * rollouts[b, l, k, j] for k in range(N)
                        )
    a = _native(backend, layer, dtype_name)
    result = _run(backend, lambda t: rules.alti_logit_terms(t, a["rollouts"]), a["terms"])
    got = backend.check(result, dtype_name=dtype_name, shape=terms.shape)
    np.testing.assert_allclose(got, expected, atol=tolerance(dtype_name) * 10 * N)


def test_rollouts_below_are_the_renormalised_products_of_the_layers_below(
    backend: Variant, dtype_name: str
) -> None:
    # ALTI-Logit's R^{l-1}: the identity below the first layer, then C^{l-1} ... C^1, each
    # layer's rows renormalised to sum to one (the adapters feed it ALTI's matrices).
    matrices = np.random.default_rng(7).uniform(0.1, 1.0, size=(BATCH, 3, N, N))
    expected = np.zeros_like(matrices)
    for b in range(BATCH):
        below = np.eye(N)
        for l in range(3):
            expected[b, l] = below
            below = (matrices[b, l] / matrices[b, l].sum(-1, keepdims=True)) @ below
    result = _run(backend, rules.rollouts_below, backend.asarray(matrices, dtype_name))
    got = backend.check(result, dtype_name=dtype_name, shape=matrices.shape)
    np.testing.assert_allclose(got, expected, atol=tolerance(dtype_name) * 10 * N)


@pytest.mark.parametrize(
    ("heads", "layers", "axes"),
    [
        ("sum", "sum", (1, 2)),
        ("each", "sum", (1,)),
        ("sum", "all", (2,)),
        ("each", "all", ()),
        ("sum", "cumulative", (2,)),
        ("each", "cumulative", ()),
    ],
)
def test_sum_terms_keeps_the_axes_asked_for(
    backend: Variant,
    dtype_name: str,
    layer: dict[str, np.ndarray],
    heads: str,
    layers: str,
    axes: tuple[int, ...],
) -> None:
    terms = layer["terms"]
    expected = terms.sum(axis=axes) if axes else terms
    if layers == "cumulative":
        expected = np.cumsum(expected, axis=1)  # layer l: the layers up to it
    a = _native(backend, layer, dtype_name)
    result = _run(backend, lambda t: rules.sum_terms(t, heads=heads, layers=layers), a["terms"])
    got = backend.check(result, dtype_name=dtype_name, shape=expected.shape)
    np.testing.assert_allclose(got, expected, atol=tolerance(dtype_name) * 10 * HEADS)


def test_grouped_query_heads_must_divide() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="multiple of the number of value heads"):
        rules.direct_logit_terms(
            rng.dirichlet(np.ones(4), size=(1, 3, 1)),
            rng.normal(size=(1, 2, 4, 2)),
            rng.normal(size=(6, 5)),
            rng.normal(size=(1, 1, 5)),
        )
