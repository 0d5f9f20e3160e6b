"""The layered attention graph of Abnar & Zuidema (2020), built in NumPy.

Nodes are the tokens at each layer; an edge runs from token ``k`` at layer ``l`` to token
``m`` at layer ``l - 1`` with capacity ``Ã_l[k, m]``. For the flow from output positions at
layer ``T`` to input token ``m`` the graph is reduced exactly:

- layers above ``T`` are never built, and at layer ``T`` only the requested output
  positions exist (they are the sources);
- the other input tokens are dead ends (no flow that enters them reaches ``m``), so layer
  0 collapses into one sink fed by every layer-1 token: the graph is the same for every
  input token, only the capacities of the ``n`` edges into the sink change;
- zero-capacity edges (padding, exact zeros) are dropped.

Everything is vectorised; there is no Python loop over edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LayeredGraph", "build_layered_graph", "layered_graph_edges"]


@dataclass(frozen=True)
class LayeredGraph:
    """Edges and capacities of a reduced layered graph with one sink."""

    n_nodes: int
    edges: np.ndarray
    """``(E, 2)`` int64 node pairs; the first `n_sink_edges` edges enter the sink."""
    capacities: np.ndarray
    """``(E,)`` float64; sink-edge capacities are those of input token 0 until replaced."""
    sources: np.ndarray
    """Node id of each output position (source), in the order requested."""
    sink: int
    sink_feeders: np.ndarray
    """Layer-1 token of each sink edge."""

    @property
    def n_sink_edges(self) -> int:
        """Number of edges into the sink (one per layer-1 token that carries flow)."""
        return int(self.sink_feeders.shape[0])


def build_layered_graph(
    mixed: np.ndarray, rows: np.ndarray, *, keep_zero_edges: bool = False
) -> LayeredGraph:
    """Build the reduced graph for flow from `rows` at the top layer to one input token.

    Parameters
    ----------
    mixed : ndarray, shape (T, n, n)
        Residual-mixed attention ``Ã_1 ... Ã_T`` of one sequence, float64; ``T >= 2``.
        Padded tokens have all-zero rows and columns.
    rows : ndarray of int, shape (r,)
        Output positions at layer ``T``.
    keep_zero_edges : bool, default False
        Keep zero-capacity edges (they carry nothing), so that the edges depend on the
        shape alone and one igraph graph serves every sequence of that shape.

    Returns
    -------
    LayeredGraph
        Node ids: token ``k`` of layer ``l`` (``1 <= l < T``) is ``(l - 1) * n + k``;
        source ``i`` is ``(T - 1) * n + i``; the sink comes last.
    """
    n_layers, n = mixed.shape[0], mixed.shape[-1]
    n_rows = rows.shape[0]
    first_source = (n_layers - 1) * n
    sink = first_source + n_rows

    present = (lambda a: np.ones(a.shape, dtype=bool)) if keep_zero_edges else (lambda a: a > 0)

    # Layer-1 tokens with any capacity towards the inputs feed the sink (padded ones never).
    feeders = np.flatnonzero(np.any(present(mixed[0]), axis=1))
    sink_edges = np.stack([feeders, np.full_like(feeders, sink)], axis=1)

    # Sources: the requested rows of the top layer, into layer T - 1.
    top = mixed[n_layers - 1][rows]
    source, target = np.nonzero(present(top))
    source_edges = np.stack([first_source + source, (n_layers - 2) * n + target], axis=1)
    source_capacities = top[source, target]

    # Layers 2 .. T-1: token k of layer l into token m of layer l - 1.
    middle = mixed[1 : n_layers - 1]
    layer, k, m = np.nonzero(present(middle))  # layer index 0 is l = 2
    middle_edges = np.stack([(layer + 1) * n + k, layer * n + m], axis=1)

    edges = np.concatenate([sink_edges, source_edges, middle_edges]).astype(np.int64)
    capacities = np.concatenate([mixed[0][feeders, 0], source_capacities, middle[layer, k, m]])
    return LayeredGraph(
        n_nodes=sink + 1,
        edges=edges,
        capacities=capacities,
        sources=first_source + np.arange(n_rows),
        sink=sink,
        sink_feeders=feeders,
    )


def layered_graph_edges(n_layers: int, n_rows: np.ndarray, n_valid: np.ndarray) -> np.ndarray:
    """Edges of :func:`build_layered_graph`'s graph with every capacity non-zero.

    An upper bound of any sequence's edges (zero capacities are dropped), counted from
    the shapes alone: `n_valid` sink edges, ``n_rows * n_valid`` source edges and
    ``n_valid**2`` per middle layer; none for one layer (a closed form, no graph).
    `n_rows` and `n_valid` are int64 arrays (one entry per kind of sequence). The cost
    model (``flow_cost``) reads it; a test checks it against the built graph.
    """
    if n_layers == 1:
        return np.zeros_like(n_rows)
    edges: np.ndarray = n_valid + n_rows * n_valid + (n_layers - 2) * n_valid * n_valid
    return edges
