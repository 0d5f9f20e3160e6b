"""Solving the max-flow problems of attention flow with igraph (host only).

A `FlowTask` is one sequence, one top layer, some output positions and some input tokens:
everything one worker needs, small enough to pickle to another process or a Dask worker.

Every value returned is exact (to floating-point rounding): it is either a closed form
(one or two layers), or a flow value certified by a matching upper bound, or the max-flow
of the whole reduced graph. The certified path is what makes flow fast:

1. A lower bound: the max-flow on the subgraph that keeps, in every layer strictly
   between source and sink, only the strongest edges of each row and of each column.
   Any flow on a subgraph is a flow on the graph.
2. Upper bounds, vectorised over all pairs, from unfolding the graph into trees (where
   nothing is shared, max-flow is a sum of minima):

   - top-down, what each token can receive from the source:
     ``u_{T-1}[j] = Ã_T[s, j]``, ``u_{l-1}[k] = min(1, Σ_j min(u_l[j], Ã_l[j, k]))``,
     and the bound ``Σ_k min(u_1[k], Ã_1[k, m])``; cheap, O(T n²) per source;
   - bottom-up, what each token can deliver to the sink:
     ``d_1[k] = Ã_1[k, m]``, ``d_l[j] = Σ_k min(Ã_l[j, k], d_{l-1}[k])``, and the bound
     ``d_T[s]``; tighter in our measurements, O(T n²) per sink, so only computed for the
     sinks the first bound leaves open;
   - the capacity into the sink, ``Σ_k Ã_1[k, m]``.
3. Where a lower and an upper bound agree (within `CERTIFY_TOLERANCE`) the max-flow is
   known. Elsewhere the whole graph is solved.

On softmax attention of ViT-B/16 size the subgraph holds about a twentieth of the edges,
and the bounds certified every pair we measured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._graph import LayeredGraph, build_layered_graph

__all__ = ["FlowTask", "solve_flow_task"]

STRONGEST_EDGES = (8, 16, 32)
"""Edges kept per row and per column of each middle layer in the certifying subgraphs,
tried in turn on the pairs still open.

Measured on softmax attention (L=12, n=197): with logits of standard deviation 2 or more,
8 edges certified every pair; with standard deviation 1 (flatter rows), 8 certified 3%
of pairs and 16 all of them. A subgraph of 8 costs about a twentieth of the whole graph,
one of 32 about a third; pairs that no subgraph certifies are solved on the whole graph.
"""

CERTIFY_TOLERANCE = 1e-12
"""Largest gap between the bounds taken as equal (flows are at most 1; the gap on
certified pairs is a few units of rounding, about 1e-15)."""

DENSE_GRAPH_ZEROS = 0.25
"""Up to this share of zero capacities, the whole graph keeps its zero edges and reuses
an igraph graph built once per shape (building one costs about 0.6 µs an edge); sparser
attention (causal, heavy padding) gets a graph of its non-zero edges."""

BOUND_BLOCK_ELEMENTS = 4_000_000
"""Elements of the ``rows x n x sinks`` temporary of one vectorised upper-bound step."""


@dataclass(frozen=True)
class FlowTask:
    """Max-flows from `rows` at layer ``T = mixed.shape[0]`` to each token of `sinks`."""

    index: tuple[int, ...]
    """Where the result goes: the batch index, then the layer slot if every layer is kept."""
    mixed: np.ndarray
    """Residual-mixed attention ``Ã_1 .. Ã_T`` of one sequence, float64, ``(T, n, n)``."""
    rows: np.ndarray
    """Output positions (sources) at layer ``T``."""
    positions: np.ndarray
    """Where each row goes on the output's rows axis."""
    sinks: np.ndarray
    """Input tokens (sinks)."""

    @property
    def n_maxflows(self) -> int:
        """Number of (source, sink) pairs in the task."""
        return int(self.rows.shape[0] * self.sinks.shape[0])


def _parallel_paths(upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """``Σ_k min(upper[r, k], lower[k, s])`` for every r, s: ``(r, s)``."""
    out = np.empty((upper.shape[0], lower.shape[1]))
    chunk = max(1, BOUND_BLOCK_ELEMENTS // (upper.shape[0] * upper.shape[1]))
    for start in range(0, lower.shape[1], chunk):
        block = lower[:, start : start + chunk]
        pairs = np.minimum(upper[:, :, None], block[None, :, :])
        out[:, start : start + chunk] = pairs.sum(axis=1)
    return out


def _top_down_bounds(mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Upper bounds ``(rows, sinks)`` from what each token can receive from the source."""
    inflow = mixed[-1][rows]
    for layer in range(mixed.shape[0] - 2, 0, -1):
        # A token forwards at most its out-capacity, 1 (rows of Ã sum to 1 or 0).
        inflow = np.minimum(_parallel_paths(inflow, mixed[layer]), 1.0)
    bound = _parallel_paths(inflow, mixed[0][:, sinks])
    return np.asarray(np.minimum(bound, mixed[0][:, sinks].sum(axis=0)[None, :]))


def _bottom_up_bounds(mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Upper bounds ``(rows, sinks)`` from what each token can deliver to the sink."""
    deliverable = mixed[0][:, sinks]  # what each layer-1 token can pass to each sink
    for layer in range(1, mixed.shape[0] - 1):
        deliverable = _parallel_paths(mixed[layer], deliverable)
    bound = _parallel_paths(mixed[-1][rows], deliverable)
    return np.asarray(np.minimum(bound, mixed[0][:, sinks].sum(axis=0)[None, :]))


def _strongest_edges(mixed: np.ndarray, keep: int) -> np.ndarray:
    """`mixed` with only the `keep` strongest edges per row and column of middle layers."""
    sparse = mixed.copy()
    middle = mixed[1:-1]
    if middle.shape[0] == 0:
        return sparse
    by_row = np.argpartition(-middle, keep - 1, axis=-1)[..., :keep]
    by_column = np.argpartition(-middle, keep - 1, axis=-2)[..., :keep, :]
    chosen = np.zeros(middle.shape, dtype=bool)
    np.put_along_axis(chosen, by_row, True, axis=-1)
    np.put_along_axis(chosen, by_column, True, axis=-2)
    sparse[1:-1] = np.where(chosen, middle, 0.0)
    return sparse


@functools.lru_cache(maxsize=4)
def _dense_solver(n_layers: int, n: int, n_rows: int) -> Any:
    """Build (once per shape) an igraph graph with every edge of the layered graph."""
    import igraph

    structure = build_layered_graph(
        np.ones((n_layers, n, n)), np.arange(n_rows), keep_zero_edges=True
    )
    return igraph.Graph(n=structure.n_nodes, edges=structure.edges, directed=True)


def _solve_pairs(
    graph: LayeredGraph,
    mixed: np.ndarray,
    pairs: list[tuple[int, int]],
    sinks: np.ndarray,
    solver: Any = None,
) -> dict[tuple[int, int], float]:
    """Max-flow values (igraph) of (source index, sink index) pairs on `graph`."""
    if solver is None:
        import igraph

        solver = igraph.Graph(n=graph.n_nodes, edges=graph.edges, directed=True)
    capacities = graph.capacities.tolist()
    n_feeders = graph.n_sink_edges
    sources_of: dict[int, list[int]] = {}
    for i, j in pairs:
        sources_of.setdefault(j, []).append(i)
    values = {}
    for j, sources in sources_of.items():
        # Only the capacities into the sink change from one input token to the next.
        capacities[:n_feeders] = mixed[0][graph.sink_feeders, sinks[j]].tolist()
        for i in sources:
            source = int(graph.sources[i])
            values[i, j] = solver.maxflow_value(source, graph.sink, capacity=capacities)
    return values


def _solve_on_whole_graph(
    mixed: np.ndarray, rows: np.ndarray, pairs: list[tuple[int, int]], sinks: np.ndarray
) -> dict[tuple[int, int], float]:
    """Max-flow values of `pairs` on the whole reduced graph."""
    dense = bool(np.count_nonzero(mixed == 0) <= DENSE_GRAPH_ZEROS * mixed.size)
    graph = build_layered_graph(mixed, rows, keep_zero_edges=dense)
    solver = _dense_solver(*mixed.shape[:2], rows.shape[0]) if dense else None
    return _solve_pairs(graph, mixed, pairs, sinks, solver)


def solve_flow_task(task: FlowTask) -> np.ndarray:
    """Max-flow values ``(len(rows), len(sinks))`` for one task (runs in any process)."""
    mixed, rows, sinks = task.mixed, task.rows, task.sinks
    n_layers, n = mixed.shape[0], mixed.shape[-1]
    if n_layers == 1:
        # The only path from row r to input m is the edge Ã_1[r, m].
        return np.asarray(mixed[0][np.ix_(rows, sinks)])
    if n_layers == 2:
        # Paths r -> k -> m share no edge: the max-flow is their sum.
        return _parallel_paths(mixed[1][rows], mixed[0][:, sinks])

    flows = np.zeros((rows.shape[0], sinks.shape[0]))
    has_out = mixed[-1][rows].sum(axis=1) > 0  # padded rows send nothing
    has_in = mixed[0][:, sinks].sum(axis=0) > 0  # padded tokens receive nothing
    reachable = has_out[:, None] & has_in[None, :]
    pending = [(int(i), int(j)) for i, j in zip(*np.nonzero(reachable), strict=True)]
    upper: np.ndarray | None = None
    refined = np.zeros(sinks.shape[0], dtype=bool)  # sinks with the bottom-up bound too
    for keep in STRONGEST_EDGES:
        if not pending or n <= 4 * keep:
            break
        subgraph = build_layered_graph(_strongest_edges(mixed, keep), rows)
        lower = _solve_pairs(subgraph, mixed, pending, sinks)
        if upper is None:
            upper = _top_down_bounds(mixed, rows, sinks)
        gaps = {pair: upper[pair] - value for pair, value in lower.items()}
        open_sinks = np.unique(
            np.array([j for (_, j), gap in gaps.items() if gap > CERTIFY_TOLERANCE], np.intp)
        )
        open_sinks = open_sinks[~refined[open_sinks]]
        if open_sinks.size:  # the tighter, costlier bound, only where still needed
            upper[:, open_sinks] = np.minimum(
                upper[:, open_sinks], _bottom_up_bounds(mixed, rows, sinks[open_sinks])
            )
            refined[open_sinks] = True
        pending = []
        for pair, value in lower.items():
            if upper[pair] - value <= CERTIFY_TOLERANCE:
                flows[pair] = value
            else:
                pending.append(pair)
    if pending:
        for (i, j), value in _solve_on_whole_graph(mixed, rows, pending, sinks).items():
            flows[i, j] = value
    return flows
