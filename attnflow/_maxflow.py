"""Solving the max-flow problems of attention flow with igraph (host only).

A `FlowTask` is one sequence, one top layer, some output positions and some input tokens:
everything one worker needs, small enough to pickle to another process or a Dask worker.
The graph is built once per task and reused for every (source, sink) pair in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._graph import build_layered_graph

__all__ = ["FlowTask", "solve_flow_task"]


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


def solve_flow_task(task: FlowTask) -> np.ndarray:
    """Max-flow values ``(len(rows), len(sinks))`` for one task (runs in any process)."""
    import igraph

    mixed, rows, sinks = task.mixed, task.rows, task.sinks
    if mixed.shape[0] == 1:
        # One layer: the only path from row r to input m is the edge Ã_1[r, m].
        return np.asarray(mixed[0][np.ix_(rows, sinks)])
    graph = build_layered_graph(mixed, rows)
    solver = igraph.Graph(n=graph.n_nodes, edges=graph.edges, directed=True)
    capacities = graph.capacities.tolist()
    n_feeders = graph.n_sink_edges
    flows = np.zeros((rows.shape[0], sinks.shape[0]))
    source_capacity = mixed[-1][rows].sum(axis=1)
    for j, token in enumerate(sinks.tolist()):
        into_sink = mixed[0][graph.sink_feeders, token]
        if not np.any(into_sink > 0):
            continue  # nothing reaches this input token (padding)
        capacities[:n_feeders] = into_sink.tolist()
        for i in range(rows.shape[0]):
            if source_capacity[i] > 0:
                flows[i, j] = solver.maxflow_value(
                    int(graph.sources[i]), graph.sink, capacity=capacities
                )
    return flows
