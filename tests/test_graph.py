"""The reduced layered graph (attnflow._graph) against a construction written from its
definition: one loop per layer, token and key, nodes named by (layer, token)."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow._graph import LayeredGraph, build_layered_graph, layered_graph_edges


def _by_definition(
    mixed: np.ndarray, rows: list[int], *, keep_zero_edges: bool
) -> dict[tuple[object, object], float]:
    """Edges of the reduced graph with their capacities, keyed by named nodes.

    Token ``k`` at layer ``l`` has an edge to token ``m`` at layer ``l - 1`` with capacity
    ``mixed[l - 1][k, m]``. Only the requested rows exist at the top layer; layer 0 is one
    sink, whose edges carry the capacity towards input token 0.
    """
    n_layers, n = mixed.shape[0], mixed.shape[-1]
    edges: dict[tuple[object, object], float] = {}

    def add(start: object, end: object, capacity: float) -> None:
        if keep_zero_edges or capacity > 0:
            edges[start, end] = capacity

    for k in range(n):  # layer 1 into the sink, if token k reaches any input
        if keep_zero_edges or any(mixed[0][k, m] > 0 for m in range(n)):
            edges[("token", 1, k), "sink"] = float(mixed[0][k, 0])
    for i, row in enumerate(rows):  # the sources at the top layer
        for m in range(n):
            add(("source", i), ("token", n_layers - 1, m), float(mixed[n_layers - 1][row, m]))
    for layer in range(2, n_layers):
        for k in range(n):
            for m in range(n):
                add(("token", layer, k), ("token", layer - 1, m), float(mixed[layer - 1][k, m]))
    return edges


def _named(graph: LayeredGraph, n_layers: int, n: int) -> dict[tuple[object, object], float]:
    """The built graph's edges, node ids translated back to names (documented numbering)."""

    def name(node: int) -> object:
        if node == graph.sink:
            return "sink"
        if node >= (n_layers - 1) * n:
            return ("source", node - (n_layers - 1) * n)
        return ("token", node // n + 1, node % n)

    edges = graph.edges.tolist()
    capacities = graph.capacities.tolist()
    named = {(name(a), name(b)): c for (a, b), c in zip(edges, capacities, strict=True)}
    assert len(named) == len(edges), "an edge is repeated"
    return named


def _mixed(rng: np.random.Generator, n_layers: int, n: int, padded: int) -> np.ndarray:
    """Row-stochastic layers with exact zeros, the last `padded` tokens all zero."""
    a = rng.random((n_layers, n, n)) * (rng.random((n_layers, n, n)) < 0.6)
    a[:, :, 0] += 0.05  # every real row keeps some weight
    a[:, n - padded :, :] = 0.0
    a[:, :, n - padded :] = 0.0
    sums = a.sum(axis=-1, keepdims=True)
    return np.divide(a, sums, out=np.zeros_like(a), where=sums > 0)


@pytest.mark.parametrize("keep_zero_edges", [False, True])
@pytest.mark.parametrize(
    ("n_layers", "n", "padded", "rows"),
    [(2, 3, 0, [0]), (3, 5, 1, [0, 2]), (4, 6, 2, [3, 0, 1]), (5, 4, 0, [0, 1, 2, 3])],
)
def test_build_layered_graph_matches_its_definition(
    n_layers: int, n: int, padded: int, rows: list[int], keep_zero_edges: bool
) -> None:
    rng = np.random.default_rng(n_layers * 100 + n)
    mixed = _mixed(rng, n_layers, n, padded)
    graph = build_layered_graph(mixed, np.asarray(rows), keep_zero_edges=keep_zero_edges)

    expected = _by_definition(mixed, rows, keep_zero_edges=keep_zero_edges)
    assert _named(graph, n_layers, n) == expected
    assert graph.edges.dtype == np.int64
    assert graph.capacities.dtype == np.float64
    assert graph.n_nodes == (n_layers - 1) * n + len(rows) + 1
    assert graph.sink == graph.n_nodes - 1
    np.testing.assert_array_equal(graph.sources, (n_layers - 1) * n + np.arange(len(rows)))
    # The sink edges come first, one per feeding layer-1 token, in token order.
    feeders = sorted(start[2] for start, end in expected if end == "sink")  # type: ignore[index]
    np.testing.assert_array_equal(graph.sink_feeders, feeders)
    assert (graph.edges[: graph.n_sink_edges, 1] == graph.sink).all()
    assert (graph.edges[graph.n_sink_edges :, 1] != graph.sink).all()
    np.testing.assert_array_equal(graph.edges[: graph.n_sink_edges, 0], feeders)
    if not keep_zero_edges:
        assert (graph.capacities[graph.n_sink_edges :] > 0).all()
        # Padded tokens carry nothing: no edge touches them.
        for start, end in expected:
            for node in (start, end):
                if isinstance(node, tuple) and node[0] == "token":
                    assert node[2] < n - padded


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5])
@pytest.mark.parametrize("n_valid", [4, 7])
def test_the_cost_models_edge_count_is_the_built_graphs(n_layers: int, n_valid: int) -> None:
    # flow_cost counts edges from shapes alone; the built graph of positive attention
    # (padding at the end) has exactly that many.
    rng = np.random.default_rng(n_layers * 10 + n_valid)
    n = 7
    mixed = np.zeros((n_layers, n, n))
    mixed[:, :n_valid, :n_valid] = rng.uniform(0.1, 1.0, (n_layers, n_valid, n_valid))
    rows = np.arange(min(3, n_valid))
    counted = layered_graph_edges(n_layers, np.array([rows.size]), np.array([n_valid]))
    if n_layers == 1:
        assert counted.tolist() == [0]  # a closed form: no graph
        return
    graph = build_layered_graph(mixed, rows)
    assert counted.tolist() == [graph.edges.shape[0]]
