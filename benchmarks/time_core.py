"""The core's timed functions (NumPy): rollout, flow, GAE, contributions, encoder-decoder flow.

Each is timed against an independent baseline in the same run (``conftest.compare``),
after checking that both give the same numbers: a hand-written NumPy chain for rollout
and GAE (Chefer et al.'s loop), igraph's max-flow on the full layered graph, one pair at a
time (the paper's method with a C solver) for flow, the terms tensor written out for
ALTI, and encoder-decoder rollout for encoder-decoder flow.
"""

from __future__ import annotations

import igraph
import numpy as np

import attnflow

RNG = np.random.default_rng(0)


def _attention(batch: int, layers: int, heads: int, n: int, temperature: float = 1.0) -> np.ndarray:
    logits = RNG.normal(size=(batch, layers, heads, n, n)) / temperature
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def _mixed(attentions: np.ndarray) -> np.ndarray:
    """Head mean and the residual mix of rollout and flow: ``0.5 A + 0.5 I`` per layer."""
    fused = attentions.mean(axis=-3)
    return 0.5 * fused + 0.5 * np.eye(fused.shape[-1])


def _chain_row(attentions: np.ndarray, row: int) -> np.ndarray:
    """Rollout of one row by hand: the row vector through the layers, last layer first."""
    mixed = _mixed(attentions)  # (B, L, n, n)
    out = []
    for sample in mixed:
        vector = np.zeros(sample.shape[-1])
        vector[row] = 1.0
        for layer in sample[::-1]:
            vector = vector @ layer
        out.append(vector)
    return np.stack(out)


def _chain(attentions: np.ndarray) -> np.ndarray:
    """Rollout by hand, every row: ``A_L ... A_1`` as a batched matrix product."""
    mixed = _mixed(attentions)
    result = mixed[:, 0]
    for layer in range(1, mixed.shape[1]):
        result = mixed[:, layer] @ result
    return result


def test_rollout_cls_row(compare) -> None:
    a = _attention(8, 12, 12, 197).astype(np.float32)  # ViT-B/16 size, 8 images
    got, expected = compare(
        lambda: attnflow.rollout(a, rows=0), lambda: _chain_row(a, 0), label="hand row chain"
    )
    np.testing.assert_allclose(got[:, 0] if got.ndim == 3 else got, expected, rtol=1e-4, atol=1e-6)


def test_rollout_all_rows(compare) -> None:
    a = _attention(4, 12, 12, 128)
    got, expected = compare(
        lambda: attnflow.rollout(a), lambda: _chain(a), label="hand matmul chain"
    )
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def _flow_graph(attentions: np.ndarray) -> tuple[igraph.Graph, list[float], int, int]:
    """The paper's layered graph of one sequence: node (l, i), arcs (l+1, i) -> (l, j)."""
    mixed = _mixed(attentions[None])[0]  # (L, n, n)
    layers, n = mixed.shape[0], mixed.shape[-1]
    edges, capacity = [], []
    for layer in range(layers):
        rows, cols = np.nonzero(mixed[layer] > 0)
        edges += list(zip((layer + 1) * n + rows, layer * n + cols, strict=True))
        capacity += list(mixed[layer][rows, cols])
    graph = igraph.Graph(n=(layers + 1) * n, edges=edges, directed=True)
    return graph, [float(c) for c in capacity], layers, n


def _igraph_flow(attentions: np.ndarray, rows: list[int]) -> np.ndarray:
    graph, capacity, layers, n = _flow_graph(attentions)
    return np.array(
        [[graph.maxflow_value(layers * n + i, j, capacity) for j in range(n)] for i in rows]
    )


def test_flow_cls_row(compare) -> None:
    a = _attention(1, 6, 12, 32)  # the paper's scale: 6 layers, 32 tokens
    got, expected = compare(
        lambda: attnflow.flow(a[0], rows=0, normalize_result=False),
        lambda: _igraph_flow(a[0], [0]),
        label="igraph per pair, full graph",
        rounds=3,
    )
    np.testing.assert_allclose(np.reshape(got, (1, -1)), expected, rtol=1e-9, atol=1e-12)


def test_flow_all_rows(compare) -> None:
    a = _attention(1, 4, 8, 16)
    got, expected = compare(
        lambda: attnflow.flow(a[0], normalize_result=False),
        lambda: _igraph_flow(a[0], list(range(16))),
        label="igraph per pair, full graph",
        rounds=3,
    )
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


def _chefer(attentions: np.ndarray, gradients: np.ndarray, row: int) -> np.ndarray:
    """Chefer et al.'s loop: ``R = R + mean_h((g * a)^+) @ R`` from the identity."""
    out = []
    for a, g in zip(attentions, gradients, strict=True):
        relevance = np.eye(a.shape[-1])
        for layer in range(a.shape[0]):
            bar = np.maximum(g[layer] * a[layer], 0).mean(axis=0)
            relevance = relevance + bar @ relevance
        out.append(relevance[row])
    return np.stack(out)


def test_gradient_rollout_cls_row(compare) -> None:
    a = _attention(4, 12, 12, 128)
    g = RNG.normal(size=a.shape)
    got, expected = compare(
        lambda: attnflow.gradient_rollout(a, g, rows=0),
        lambda: _chefer(a, g, 0),
        label="Chefer loop",
    )
    np.testing.assert_allclose(np.reshape(got, expected.shape), expected, rtol=1e-9, atol=1e-12)


def _alti(weights: np.ndarray, values: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """ALTI by hand: every term ``t_ij`` written out as an ``(n, n, d)`` tensor."""
    terms = np.einsum("hij,hjd->ijd", weights, values)
    n = terms.shape[0]
    terms[np.arange(n), np.arange(n)] += residual
    output = terms.sum(axis=1)  # y_i
    norm = np.abs(output).sum(axis=-1)
    scores = np.maximum(0, norm[:, None] - np.abs(output[:, None] - terms).sum(axis=-1))
    return scores / scores.sum(axis=-1, keepdims=True)


def test_contributions_alti(compare) -> None:
    n, heads, width = 128, 12, 384  # one MiniLM layer at 128 tokens
    weights = _attention(1, 1, heads, n)[0, 0]
    values = RNG.normal(size=(heads, n, width))
    residual = RNG.normal(size=(n, width))
    got, expected = compare(
        lambda: attnflow.contributions(weights, values, residual, method="alti"),
        lambda: _alti(weights, values, residual),
        label="terms tensor by hand",
    )
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


def test_encoder_decoder_flow(compare) -> None:
    source, target, layers, heads = 24, 24, 6, 8
    encoder = _attention(1, layers, heads, source)[0]
    decoder = np.tril(_attention(1, layers, heads, target)[0])
    decoder /= decoder.sum(axis=-1, keepdims=True)
    cross = RNG.random(size=(layers, heads, target, source))
    cross /= cross.sum(axis=-1, keepdims=True)
    got, expected = compare(
        lambda: attnflow.encoder_decoder_flow(encoder, decoder, cross, rows=-1),
        lambda: attnflow.encoder_decoder_rollout(encoder, decoder, cross, rows=-1),
        label="encoder-decoder rollout",
        rounds=3,
    )
    assert np.shape(got[0]) == np.shape(expected[0])
    np.testing.assert_allclose(np.sum(got[0]) + np.sum(got[1]), 1.0, rtol=1e-9)
