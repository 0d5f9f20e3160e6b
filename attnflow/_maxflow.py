"""Solving the max-flow problems of attention flow (host only).

A `FlowTask` is one sequence, one top layer, some output positions and some input tokens:
everything one worker needs, small enough to pickle to another process or a Dask worker.

Every value returned is exact (to floating-point rounding). One or two layers have closed
forms. Deeper graphs go to the compiled solver of ``attnflow._maxflow_kernel``, which knows
its target: each (source, sink) pair comes with an upper bound ``U`` on its max-flow,
computed here for all pairs at once from unfolding the graph into trees (where nothing is
shared, max-flow is a sum of minima):

- top-down, what each token can receive from the source:
  ``u_{T-1}[j] = Ã_T[s, j]``, ``u_{l-1}[k] = min(Σ_m Ã_{l-1}[k, m], Σ_j min(u_l[j],
  Ã_l[j, k]))`` (a token forwards at most its row sum: 1 or 0 for attention), and the
  bound ``Σ_k min(u_1[k], Ã_1[k, m])``; O(T n²) per source;
- the capacity into the sink, ``Σ_k Ã_1[k, m]``.

The solver (Dinic's blocking flows) stops as soon as its flow reaches ``U`` within
`TARGET_TOLERANCE`, so that ``U`` is the max-flow; otherwise it tightens ``U`` with the
bottom-up tree bound of the sink and, failing that, runs to completion, when its flow is the
max-flow. On attention from real models (MiniLM, attention sinks, low-rank patterns) and on
random softmax attention we measured the bound to be reached for nearly every pair, by the
first blocking flow, which touches a small part of the graph. On small graphs of local
attention, where most pairs miss it, those pairs go to push-relabel instead of Dinic's
later phases (`PUSH_RELABEL_ENTRIES`, ``solve_push_relabel``).

Without the compiled solver (a source checkout that was not built) every pair is solved
with igraph on the whole reduced graph: the reference, slower by one to two orders of
magnitude. ``ENGINE = "igraph"`` selects it explicitly (the tests do).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._flow_cost import graph_profile, profile_rows
from ._graph import LayeredGraph, build_layered_graph


def _load_kernel() -> tuple[Callable[..., Any], ...] | None:
    try:
        from ._maxflow_kernel import (
            build_arcs,
            build_backward_arcs,
            fill_residuals,
            scan_layers,
            solve,
            solve_push_relabel,
        )
    except ImportError:  # pragma: no cover - a source checkout without the compiled kernel
        return None
    return solve, build_arcs, build_backward_arcs, scan_layers, fill_residuals, solve_push_relabel


_kernel = _load_kernel()
_kernel_solve = None if _kernel is None else _kernel[0]
_kernel_build_arcs = None if _kernel is None else _kernel[1]

__all__ = [
    "KERNEL_AVAILABLE",
    "FlowPath",
    "FlowTask",
    "flow_path",
    "push_relabel_fits",
    "solve_flow_task",
    "solve_flow_task_with_status",
]

KERNEL_AVAILABLE = _kernel_solve is not None
"""Whether the compiled solver was built (it is in every wheel and ``pip install``)."""

ENGINE: Literal["kernel", "igraph"] = "kernel" if KERNEL_AVAILABLE else "igraph"
"""Which solver deep graphs go to: the compiled one, or igraph on the whole graph."""

TARGET_TOLERANCE = 1e-13
"""How close the flow must come to the upper bound for the bound to be reported (flows are
at most 1; rounding in either is a few units of 1e-16, so certified values are within this
of the max-flow, and a pair that misses it by rounding alone is solved to completion)."""

DENSE_GRAPH_ZEROS = 0.25
"""Up to this share of zero capacities, the igraph path keeps zero edges and reuses an igraph
graph built once per shape (building one costs about 0.6 µs an edge); sparser attention
(causal, heavy padding) gets a graph of its non-zero edges."""

DENSE_LAYERS = 12
"""Layers ``2 .. D + 1`` whose arcs first blocking flows read dense, through bit sets of the
tokens below that may still carry flow (most of the search happens near the sink, where
tokens block as their arcs into the sink fill): ``D n²`` more float64 residuals. Graphs
where most tokens reach the last input token (bidirectional attention) use one."""

DENSE_BYTES = 512 * 2**20
"""At most this much memory for the dense layers (at least one layer): 16 layers at
n = 2,048, 4 at 4,096."""

DEFERRAL_CHUNK = 16
"""Sinks whose pairs the first pass (forward arcs alone) solves at a time. Once more than
half the pairs of a chunk were left for backward arcs (strongly local attention), the
later sinks are solved with them from the start, instead of twice."""

ARC_CAPACITIES_BYTES = 64 * 2**20
"""Up to this size (8 bytes an arc) the arcs keep a copy of their capacities, read by arc
where backward arcs and the bottom-up bound need them (locally strong attention, which
needs many); larger graphs read them from the matrices, and spare the memory (on a first
call, fresh memory costs about 1 ms of system time a MB)."""

REVERSED_ENTRIES = 2**23
"""Graphs up to this many capacities (``T n²``, 64 MB) may solve some sinks on the reversed
graph (`_Prepared.reverse_sinks`), a copy of the matrices."""

REVERSE_BELOW = 0.95
"""Sinks whose capacity in is below this share of the largest source's capacity out are
solved on the reversed graph (on graphs that qualify, see `_Prepared.reverse_sinks`)."""

PUSH_RELABEL_ENTRIES = 2**19
"""Graphs whose middle matrices hold up to this many capacities (``(T-2) n²``, 4 MB) and
whose flow does not cross the sequence (`PUSH_RELABEL_REACH`) solve every pair by
push-relabel on dense residuals (``solve_push_relabel``) instead of Dinic's first blocking
flows and then phases with backward arcs: on the banded ViT-B/16-size row, its 154 loose
pairs in about 0.4 instead of 1.75 CPU s, the whole row 0.47 instead of 0.52 s without the
first blocking flows. It copies the middle matrices, transposed, once per graph, and both
residual copies once per pair."""

PUSH_RELABEL_REACH = 1.0
"""Push-relabel only on graphs whose flow moves less than this share of the sequence (the
cost model's reach, `flow_cost`, below ``n - 1``: local attention)."""

BOUND_BLOCK_ELEMENTS = 4_000_000
"""Elements of the ``rows x n x sinks`` temporary of one vectorised upper-bound step."""

CLOSED_FORM, CERTIFIED, SOLVED, DEFERRED = 0, 1, 2, 3
"""Status of a pair: closed form (or nothing to carry), flow reached the bound, or solved
to completion (by the kernel, or by igraph); `DEFERRED` is internal to the kernel path (a
pair the first blocking flow left, solved again with backward arcs) and never returned."""


FlowPath = Literal["one_layer", "two_layers", "kernel", "igraph"]
"""How a task is solved: a closed form (one or two layers) or a max-flow solver."""


def push_relabel_fits(n_layers: int, n: int) -> bool:
    """Whether a graph of `n_layers` layers on `n` tokens is small enough for push-relabel.

    Its loose pairs then go to push-relabel where its flow does not cross the sequence
    (`_Prepared.push_relabel`; the cost model prices them so).
    """
    return (n_layers - 2) * n * n <= PUSH_RELABEL_ENTRIES


def flow_path(n_layers: int) -> FlowPath:
    """How the engine solves a task whose graph has `n_layers` layers.

    The one place where the path is chosen: `solve_flow_task_with_status` follows it, and
    the cost model (``attnflow._flow``) prices each task by it.
    """
    if n_layers == 1:
        return "one_layer"
    if n_layers == 2:
        return "two_layers"
    return "kernel" if ENGINE == "kernel" and KERNEL_AVAILABLE else "igraph"


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


def _reach(mixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest input token each token of layers ``1 .. T-1`` reaches: ``(T-1, n)``.

    Every input token a node reaches lies in ``[lo, hi]`` (an interval around the set, so a
    node outside it for sink ``m`` carries none of ``m``'s flow: exact pruning). Causal
    attention gives ``hi = j`` for token ``j``; a node with no path down gets ``lo > hi``.
    """
    return _scan(mixed)[:2]


def _scan(mixed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`_reach`, and the arcs of each row of the middle matrices (None without the kernel).

    One pass of the compiled kernel (``scan_layers``) over float64 C-contiguous input;
    numpy otherwise.
    """
    return _scan_layers(mixed)[:3]


def _self_strongest(middle: np.ndarray) -> bool:
    """Whether every row of `middle` with a non-zero entry has its largest on the diagonal."""
    if middle.shape[0] == 0:
        return True
    diagonal = np.diagonal(middle, axis1=1, axis2=2)
    strongest = middle.max(axis=-1)
    return bool(np.all((strongest <= 0) | (diagonal >= strongest)))


def _scan_layers(
    mixed: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]:
    """`_scan`, and whether each middle token's self arc is its strongest (`_self_strongest`)."""
    n_layers, n = mixed.shape[0], mixed.shape[-1]
    if _kernel is not None and mixed.dtype == np.float64 and mixed.flags.c_contiguous:
        lo = np.empty((n_layers - 1, n), dtype=np.int32)
        hi = np.empty((n_layers - 1, n), dtype=np.int32)
        counts = np.empty((max(n_layers - 2, 0), n), dtype=np.int64)
        strongest = True
        if n_layers >= 2:
            strongest = bool(_kernel[3](mixed, lo, hi, counts))
        return lo, hi, counts, strongest
    lo = np.empty((n_layers - 1, n), dtype=np.int32)
    hi = np.empty((n_layers - 1, n), dtype=np.int32)
    tokens = np.arange(n, dtype=np.int32)
    below_lo, below_hi = tokens, tokens  # layer 0: token k reaches itself
    for layer in range(n_layers - 1):
        present = mixed[layer] > 0
        lo[layer] = np.where(present, below_lo[None, :], n).min(axis=1)
        hi[layer] = np.where(present, below_hi[None, :], -1).max(axis=1)
        below_lo, below_hi = lo[layer], hi[layer]
    return lo, hi, None, _self_strongest(mixed[1:-1])


def _source_cut(top: np.ndarray, lo: np.ndarray, hi: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """``Σ_k Ã_T[r, k] [lo_k <= m <= hi_k]`` ``(rows, sinks)``: a cut of every path to ``m``.

    The source arcs into tokens that may reach ``m``: every path from row ``r`` to ``m``
    leaves the source on one of them.
    """
    n = top.shape[-1]
    spans = np.zeros((top.shape[0], n + 1))
    keep = lo <= hi
    np.add.at(spans.T, lo[keep], top[:, keep].T)
    np.add.at(spans.T, hi[keep] + 1, -top[:, keep].T)
    return np.asarray(np.cumsum(spans, axis=1)[:, sinks])


def _top_down(mixed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``u_1``: what each token of layer 1 can receive from each of `rows`, tree-unfolded."""
    inflow = mixed[-1][rows]
    for layer in range(mixed.shape[0] - 2, 0, -1):
        # A token forwards at most its out-capacity, its row sum one layer down: 1 or 0 for
        # attention, more for capacities passed with validate=False.
        inflow = np.minimum(_parallel_paths(inflow, mixed[layer]), mixed[layer - 1].sum(axis=-1))
    return np.asarray(inflow)


def _upper_bounds(
    mixed: np.ndarray,
    rows: np.ndarray,
    sinks: np.ndarray,
    reach: tuple[np.ndarray, np.ndarray] | None = None,
    inflow: np.ndarray | None = None,
) -> np.ndarray:
    """Upper bounds ``(rows, sinks)`` on the max-flows.

    The top-down tree bound (`inflow`, computed if not given), the capacity into the sink
    and (with `reach`) the source arcs into the tokens that may reach the sink.
    """
    if inflow is None:
        inflow = _top_down(mixed, rows)
    bound = _parallel_paths(inflow, mixed[0][:, sinks])
    bound = np.minimum(bound, mixed[0][:, sinks].sum(axis=0)[None, :])
    if reach is not None:
        bound = np.minimum(bound, _source_cut(mixed[-1][rows], reach[0][-1], reach[1][-1], sinks))
    return np.asarray(bound)


def _strongest_first(matrices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column indices of each row, largest capacity first, and each row's non-zero count."""
    # The solver tries a node's arcs in this order: wide arcs first carry most of the flow
    # in few augmentations, and zero arcs (sorted last) are never looked at.
    order = np.argsort(-matrices, axis=-1).astype(np.int32)  # any order of ties is exact
    count = np.count_nonzero(matrices > 0, axis=-1).astype(np.int32)
    return order, count


@dataclass(frozen=True)
class _Arcs:
    """The middle layers' non-zero arcs, each token's contiguous, strongest first."""

    start: np.ndarray
    """``(T-2, n+1)`` int64: token ``j`` of matrix ``i`` has arcs ``start[i, j] ..
    start[i, j+1]``."""
    head: np.ndarray
    """``(arcs,)`` uint16: the token each arc enters (its capacity is the matrix's entry:
    no copy is kept, see `capacities`)."""
    counts: np.ndarray
    """``(T-2, n)``: arcs of each token."""
    bucket_end: np.ndarray
    """``(T-2, n, 64)`` int32: where each power of two's arcs of a token end (heads
    descend within one)."""
    self_base: int = -1
    """Where the self arcs begin (``head`` ends with one per row, token-major: token ``j``'s
    in matrix ``i`` is ``self_base + j (T-2) + i``, out of the lists), or -1 where every
    arc is listed."""
    capacity: np.ndarray | None = None
    """``(arcs,)`` float64, the capacities by arc, on graphs up to `ARC_CAPACITIES_BYTES`."""

    def capacities(self, middle: np.ndarray) -> np.ndarray:
        """Return each arc's capacity ``(arcs,)``, read from the matrices `middle` they list."""
        n_mats, n = self.start.shape[0], self.start.shape[1] - 1
        listed = np.diff(self.start, axis=1).ravel()
        matrix = np.repeat(np.arange(n_mats), n)
        tail = np.tile(np.arange(n), n_mats)
        end = int(self.start[-1, -1]) if n_mats else 0
        out = np.empty(self.head.shape[0])
        heads = self.head[:end].astype(np.int64)
        out[:end] = middle[np.repeat(matrix, listed), np.repeat(tail, listed), heads]
        if self.self_base >= 0:
            own = np.arange(n)
            out[self.self_base :] = middle[:, own, own].T.ravel()
        return out


def _arcs(middle: np.ndarray, self_arcs: bool = False) -> _Arcs:
    """Arc lists of the middle matrices ``Ã_2 .. Ã_{T-1}`` (zero capacities dropped)."""
    counts = np.count_nonzero(middle > 0, axis=-1)
    return _arcs_and_residuals(middle, counts, None, self_arcs)[0]


def _arcs_and_residuals(
    middle: np.ndarray, counts: np.ndarray, dense_layers: int | None, self_arcs: bool = False
) -> tuple[_Arcs, np.ndarray | None]:
    """Build the arc lists and (with `dense_layers`) the solver's first residual buffer.

    `counts` ``(T-2, n)`` holds the non-zero entries of each row. The buffer (see
    `_Prepared.take_buffer`) is written by the same pass as the arcs, with the arcs of the
    first `dense_layers` matrices left unwritten (`_Prepared.complete` writes them when a
    solve first needs backward arcs). With `self_arcs`, every row's diagonal entry is set
    apart (`_Arcs.self_base`): `counts` still counts it, where it is non-zero.
    """
    assert _kernel_build_arcs is not None  # the caller checked
    n_mats, n = middle.shape[0], middle.shape[1]
    listed = counts
    if self_arcs:
        listed = counts - (np.diagonal(middle, axis1=1, axis2=2) > 0)
    offsets = np.zeros(n_mats * n + 1, dtype=np.int64)
    np.cumsum(listed.ravel(), out=offsets[1:])
    start = np.empty((n_mats, n + 1), dtype=np.int64)
    start[:, :n] = offsets[:-1].reshape(n_mats, n)
    start[:, n] = offsets[n::n]
    size = int(offsets[-1]) + (n_mats * n if self_arcs else 0)
    self_base = int(offsets[-1]) if self_arcs else -1
    head = np.empty(size, dtype=np.uint16)
    bucket_end = np.empty((n_mats, n, 64), dtype=np.int32)
    capacity = np.empty(size) if 8 * size <= ARC_CAPACITIES_BYTES else None
    if dense_layers is None:
        _kernel_build_arcs(middle, start, head, bucket_end, None, 0, self_arcs, capacity)
        return _Arcs(start, head, counts, bucket_end, self_base, capacity), None
    # np.empty: the pages of the arcs left unwritten are not even mapped until written.
    residual = np.empty(head.shape[0] + 2 * n + dense_layers * n * n)
    _kernel_build_arcs(middle, start, head, bucket_end, residual, dense_layers, self_arcs, capacity)
    return _Arcs(start, head, counts, bucket_end, self_base, capacity), residual


def _last_heads(arcs: _Arcs, layers: int) -> np.ndarray:
    """Return the largest head of each token's arcs in the first `layers` middle matrices.

    ``(layers, n)`` int32: each row's last non-zero column, -1 for a row without arcs.
    """
    n = arcs.counts.shape[-1]
    if layers == 0:
        return np.empty((0, n), dtype=np.int32)
    counts = np.diff(arcs.start[:layers], axis=1).ravel()  # listed arcs
    top = np.full(counts.shape, -1, dtype=np.int32)
    present = counts > 0
    if present.any():
        # Rows with arcs, each to the next one's first arc (rows between have none).
        heads = arcs.head[: arcs.start[layers - 1, -1]]
        top[present] = np.maximum.reduceat(heads, arcs.start[:layers, :-1].ravel()[present])
    last = top.reshape(layers, n)
    if arcs.self_base >= 0:
        # The self arcs, apart from the lists: token j's own column where it is non-zero
        # (counted in `counts`, not listed).
        own = arcs.counts[:layers] > np.diff(arcs.start[:layers], axis=1)
        tokens = np.broadcast_to(np.arange(n, dtype=np.int32), (layers, n))
        last = np.where(own, np.maximum(last, tokens), last)
    return last


def _backward_arcs(
    arcs: _Arcs, reach: tuple[np.ndarray, np.ndarray], low: int, high: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """List the arcs into each token: ``(start, arc ids, tails)``, see `build_backward_arcs`.

    The ids are relative to their matrix's first arc, self arcs marked (`_arc_ids` reads
    them): uint32 and uint16 tails, 6 bytes an arc instead of 12.

    Only into the tokens that may reach an input token in ``[low, high]`` (their interval
    ``[lo, hi]`` of `_reach` meets it): the solver never enters the others while it solves
    for a sink in that range, so their backward arcs are never read (in causal attention,
    the tokens before the sink; for a sink near the end, most of the graph).
    """
    assert _kernel is not None  # the caller checked
    lo, hi = reach
    # Matrix i (Ã_{i+2}) has its heads at layer i + 1: row i of `reach`.
    keep = ((lo[:-1] <= high) & (hi[:-1] >= low)).astype(np.uint8)
    start = np.empty_like(arcs.start)
    # Arc ids less their matrix's first, and tokens: uint32 and uint16 (see `_arc_ids`).
    ids = np.empty(arcs.head.shape[0], dtype=np.uint32)
    tails = np.empty(arcs.head.shape[0], dtype=np.uint16)
    _kernel[2](arcs.start, arcs.head, keep, start, ids, tails, arcs.self_base)
    return start, ids, tails


MAX_TOKENS = 2**16 - 1
"""Tokens a sequence at most for the compiled solver (uint16 tokens, uint32 arc ids within a
matrix, below `SELF_ARC`)."""

SELF_ARC = 2**32 - 1
"""A backward list's entry for a self arc set apart (`_Arcs.self_base`)."""


def _arc_ids(arcs: _Arcs, matrix: int, entries: np.ndarray, tails: np.ndarray) -> np.ndarray:
    """Return the arc ids of backward list entries of `matrix` (relative in `_backward_arcs`)."""
    ids: np.ndarray = arcs.start[matrix, 0] + entries.astype(np.int64)
    own = entries == SELF_ARC
    ids[own] = arcs.self_base + tails[own].astype(np.int64) * arcs.start.shape[0] + matrix
    return ids


def _sorted_heads(hi: np.ndarray) -> np.ndarray:
    """``(T-2,)`` uint8: 1 for each middle matrix whose heads reach no further as they descend.

    Matrix ``Ã_{i+2}`` has its heads at layer ``i + 1``; where the largest input token
    that those tokens reach never decreases with the token (causal attention, banded
    attention), a head that cannot reach the sink from below is followed, within its
    strength class (heads descending), by heads that cannot either: the solver skips them.
    """
    return np.asarray((np.diff(hi[:-1], axis=1) >= 0).all(axis=1), dtype=np.uint8)


@dataclass
class _Residuals:
    """A residual buffer of the solver and whether the arcs of its dense layers are in it."""

    array: np.ndarray
    complete: bool


class _Prepared:
    """What every task on one graph shares: arcs, reachability, residual buffers.

    Built once per sequence-layer problem, however many tasks its input tokens were split
    into (`attnflow._flow` splits long problems so that the progress bar moves).
    """

    def __init__(self, mixed: np.ndarray) -> None:
        self.source = weakref.ref(mixed)  # the entry lives as long as its array
        self.n = mixed.shape[-1]
        if self.n > MAX_TOKENS:
            message = (
                f"attention flow's solver takes at most {MAX_TOKENS:,} tokens a sequence, got "
                f"{self.n:,}: pass shorter sequences (its arcs hold tokens as 16-bit integers)"
            )
            raise ValueError(message)
        lo, hi, counts, self_strongest = _scan_layers(mixed)
        self.reach = lo, hi
        self.sorted_heads = _sorted_heads(self.reach[1])
        # Causal (and banded) graphs block many tokens near the sink; elsewhere the
        # strongest-first arc lists find wide paths sooner from the third layer up.
        ordered = self.sorted_heads.all() and np.mean(self.reach[1][:-1] < self.n - 1) > 0.5
        # Input tokens that take less than a source can give (the capacity into them, a
        # column sum of Ã_1, below the largest row sum of Ã_T: on attention, every token
        # but those that draw attention, as [CLS] and [SEP] do), on graphs whose flow
        # moves across the whole sequence (the cost model's reach, `flow_cost`: where it
        # does, first blocking flows certify): their pairs are solved on the reversed
        # graph (see `_solve_with_kernel`). Not where attention is local (banded).
        self.reverse_sinks: np.ndarray | None = None
        # The pairs that first blocking flows leave go to push-relabel on small graphs
        # whose flow does not cross the sequence (local attention: there most pairs are
        # left, and Dinic needs many phases); elsewhere the few pairs left take a phase or
        # two of Dinic's, cheaper (MiniLM n = 128 every row: 267 pairs, 0.18 CPU s by
        # push-relabel).
        small = push_relabel_fits(mixed.shape[0], self.n)
        self.push_relabel = False
        if (small or not ordered) and mixed.size <= REVERSED_ENTRIES:
            sampled = profile_rows(self.n)
            reach = graph_profile(mixed[:, sampled], sampled).reach(mixed.shape[0])
            self.push_relabel = small and reach < PUSH_RELABEL_REACH * (self.n - 1)
            if not ordered and reach >= self.n - 1:
                top = REVERSE_BELOW * mixed[-1].sum(axis=1).max()
                self.reverse_sinks = mixed[0].sum(axis=0) < top
        self._reversed: np.ndarray | None = None
        self._middle_t: np.ndarray | None = None
        dense = DENSE_LAYERS if ordered else min(DENSE_LAYERS, 1)
        affordable = max(1, DENSE_BYTES // (8 * self.n * self.n))
        self.dense_layers = min(dense, affordable, mixed.shape[0] - 2)
        if counts is None:
            counts = np.count_nonzero(mixed[1:-1] > 0, axis=-1)
        # The arcs and the first residual buffer in one pass (the solver's residuals of
        # the arcs of the dense layers are written only when backward arcs need them).
        # Where every middle token's strongest arc is its own (a residual of 0.5 or more),
        # the self arcs go apart, token-major: straight descents, half of all advances on
        # causal attention, then read a small block instead of two large arrays.
        self.arcs, first = _arcs_and_residuals(
            mixed[1:-1], counts, self.dense_layers, self_strongest
        )
        assert first is not None
        self.self_apart = self.arcs.self_base >= 0
        # Where the arcs of the dense layers end: the residuals a first pass never reads.
        self.lower_end = int(self.arcs.start[self.dense_layers - 1, -1])
        self.dense_top = _last_heads(self.arcs, self.dense_layers)
        # Ã_1 transposed: the capacities into each sink, contiguous (copied for every pair).
        self.sink_columns = np.ascontiguousarray(mixed[0].T)
        self._lock = threading.Lock()
        self._backward: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._backward_sinks = (0, -1)  # the input tokens `_backward` serves
        self._inflow: dict[bytes, np.ndarray] = {}
        self._buffers: list[_Residuals] = [_Residuals(first, complete=False)]

    def backward(self, sinks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Backward arcs that serve every input token of `sinks` (built when first needed).

        Listed for a range of input tokens, widened (and rebuilt) when a later pair needs
        a token outside it.
        """
        low, high = int(sinks.min()), int(sinks.max())
        with self._lock:
            covered_low, covered_high = self._backward_sinks
            if self._backward is None or low < covered_low or high > covered_high:
                if self._backward is not None:
                    low, high = min(low, covered_low), max(high, covered_high)
                self._backward = None  # free the old lists before the new ones are built
                self._backward = _backward_arcs(self.arcs, self.reach, low, high)
                self._backward_sinks = (low, high)
            return self._backward

    def reversed(self, mixed: np.ndarray) -> np.ndarray:
        """Return the reversed graph of `mixed` (built once): ``Ã'_l = Ã_{T+1-l}ᵀ``.

        Its max-flow from output position ``m`` (layer ``T``) to input token ``s`` is the
        max-flow of `mixed` from ``s`` to ``m``: every arc turned around.
        """
        with self._lock:
            if self._reversed is None:
                self._reversed = np.ascontiguousarray(mixed[::-1].transpose(0, 2, 1))
            return self._reversed

    def middle_t(self, mixed: np.ndarray) -> np.ndarray:
        """Return ``Ã_2 .. Ã_{T-1}`` of `mixed`, each transposed (built once; push-relabel)."""
        with self._lock:
            if self._middle_t is None:
                self._middle_t = np.ascontiguousarray(mixed[1:-1].transpose(0, 2, 1))
            return self._middle_t

    def inflow(self, mixed: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Return the top-down tree bound at layer 1 of `rows` (see `_upper_bounds`)."""
        key = rows.tobytes()
        with self._lock:
            found = self._inflow.get(key)
        if found is None:
            found = _top_down(mixed, rows)
            with self._lock:
                self._inflow[key] = found
        return found

    def take_buffer(self, mixed: np.ndarray) -> _Residuals:
        """Residuals: every middle arc at its capacity, then ``Ã_2 .. Ã_{D+1}`` dense.

        One per call (the first one was written with the arcs). A buffer may come without
        the residuals of the dense layers' arcs: `complete` writes them.
        """
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
        arcs = self.arcs.head.shape[0]
        buffer = np.empty(arcs + 2 * self.n + self.dense_layers * self.n * self.n)
        self._fill(mixed, buffer, self.dense_layers, mixed.shape[0] - 2)
        buffer[arcs + 2 * self.n :] = mixed[1 : self.dense_layers + 1].ravel()
        return _Residuals(buffer, complete=False)

    def _fill(self, mixed: np.ndarray, buffer: np.ndarray, low: int, high: int) -> None:
        """Write the arcs of the middle matrices ``low .. high-1`` at their capacities."""
        assert _kernel is not None  # the caller checked
        _kernel[4](mixed[1:-1], self.arcs.start, self.arcs.head, buffer, low, high, self.self_apart)

    def complete(self, residuals: _Residuals) -> np.ndarray:
        """Return the buffer with every middle arc at its capacity (backward arcs need it)."""
        if not residuals.complete:
            mixed = self.source()
            assert mixed is not None  # the caller holds it
            self._fill(mixed, residuals.array, 0, self.dense_layers)
            residuals.complete = True
        return residuals.array

    def give_back(self, buffer: _Residuals) -> None:
        with self._lock:
            self._buffers.append(buffer)


_PREPARED: list[_Prepared] = []
_PREPARED_LOCK = threading.Lock()
PREPARED_KEPT = 4
"""Graphs kept prepared, the latest ones (each only while its array lives): enough for the
tasks of one sequence in a row, and for a few threads on a few sequences."""


def _forget(entry: _Prepared) -> None:
    with _PREPARED_LOCK:
        if entry in _PREPARED:
            _PREPARED.remove(entry)


def _prepared(mixed: np.ndarray) -> _Prepared:
    """Return the prepared graph of `mixed` (the array object of an earlier task) or a new one."""
    with _PREPARED_LOCK:
        for entry in _PREPARED:
            if entry.source() is mixed:
                return entry
    entry = _Prepared(mixed)
    weakref.finalize(mixed, _forget, entry)
    with _PREPARED_LOCK:
        _PREPARED.insert(0, entry)
        del _PREPARED[PREPARED_KEPT:]
    return entry


def _solve_with_kernel(
    mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Max-flows and statuses ``(rows, sinks)`` from the compiled solver (``T >= 3``).

    The pairs of the sinks in `_Prepared.reverse_sinks` are solved on the reversed graph,
    from the sink to the row. A first blocking flow works hardest near its far end, where
    the last paths must find the arcs that are still open: on bidirectional attention,
    where most input tokens take less than a row gives, those are the arcs into the sink,
    and the reversed graph puts them next to its source, where the search starts (on
    MiniLM every row, 1.2 to 1.9x less time for those sinks). Each pair's way depends on
    its sink, the graph and the number of rows asked, never on how the sinks were split
    into tasks.
    """
    assert _kernel_solve is not None  # the caller checked
    if not (mixed.dtype == np.float64 and mixed.flags.c_contiguous):
        mixed = np.ascontiguousarray(mixed, dtype=np.float64)
    graph = _prepared(mixed)
    reverse = graph.reverse_sinks
    # Not for fewer rows than such sinks: the reversed graph's bounds cost as much per
    # sink as the graph's per row (on one row of a long sequence, many times the solve).
    if reverse is None or rows.shape[0] < np.count_nonzero(reverse) or not reverse[sinks].any():
        return _solve_one_way(mixed, graph, rows, sinks)
    flip = reverse[sinks]
    values = np.zeros((rows.shape[0], sinks.shape[0]))
    status = np.zeros(values.shape, dtype=np.int8)
    if not flip.all():
        values[:, ~flip], status[:, ~flip] = _solve_one_way(mixed, graph, rows, sinks[~flip])
    reversed_graph = graph.reversed(mixed)
    turned = _solve_one_way(reversed_graph, _prepared(reversed_graph), sinks[flip], rows)
    values[:, flip], status[:, flip] = turned[0].T, turned[1].T
    return values, status


def _solve_one_way(
    mixed: np.ndarray, graph: _Prepared, rows: np.ndarray, sinks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`_solve_with_kernel` on `mixed` as it is (`graph`, its preparation).

    First with the forward arcs alone (the first blocking flow needs no more; on real
    attention it nearly always reaches the bound), then the pairs it left (status
    `DEFERRED`) again with the backward arcs as well. The first pass takes
    `DEFERRAL_CHUNK` sinks at a time; once most pairs of a chunk were deferred (strongly
    local attention), the later sinks are solved with backward arcs from the start. Graphs
    up to `PUSH_RELABEL_ENTRIES` (`_Prepared.push_relabel`) send every pair to push-relabel
    instead (`_push_relabel`), without first blocking flows: there, most pairs are left by
    them (on the banded ViT-size row 154 of 197), and push-relabel reports the same bound,
    to the bit, for those that reach it.
    """
    assert _kernel_solve is not None  # the caller checked
    arcs, reach = graph.arcs, graph.reach
    from_source, source_count = _strongest_first(mixed[-1][rows])
    upper = np.ascontiguousarray(
        _upper_bounds(mixed, rows, sinks, reach, graph.inflow(mixed, rows))
    )
    if graph.push_relabel:
        return _push_relabel(mixed, graph, rows, sinks, upper)
    values = np.zeros((rows.shape[0], sinks.shape[0]))
    status = np.zeros(values.shape, dtype=np.int8)
    forward = (arcs.start, arcs.head)
    none = (np.zeros((1, 1), dtype=np.int64), np.zeros(0, np.uint32), np.zeros(0, np.uint16))
    buffer = graph.take_buffer(mixed)
    direct = False
    for start in range(0, sinks.shape[0], DEFERRAL_CHUNK):
        chunk = slice(start, start + DEFERRAL_CHUNK)
        part_values = np.zeros((rows.shape[0], sinks[chunk].shape[0]))
        part_status = np.zeros(part_values.shape, dtype=np.int8)
        # Where most pairs of the last chunk needed backward arcs, the next chunks go
        # straight to the solver with them (arcs listed once for every sink left).
        backward = graph.backward(sinks[start:]) if direct else none
        residual = graph.complete(buffer) if direct else buffer.array
        _kernel_solve(
            mixed, graph.sink_columns, rows.astype(np.int64), sinks[chunk].astype(np.int64),
            np.ascontiguousarray(upper[:, chunk]), *forward, *backward, arcs.bucket_end, graph.sorted_heads,
            graph.dense_top, from_source, source_count, *reach, direct, TARGET_TOLERANCE, residual, part_values, part_status,
            arcs.self_base, arcs.capacity,
        )  # fmt: skip
        values[:, chunk] = part_values
        status[:, chunk] = part_status
        direct = direct or bool(2 * np.count_nonzero(part_status == DEFERRED) > part_status.size)
    left = np.flatnonzero((status == DEFERRED).any(axis=1))
    for i in left:
        columns = np.flatnonzero(status[i] == DEFERRED)
        part_values = np.zeros((1, columns.size))
        part_status = np.zeros((1, columns.size), dtype=np.int8)
        _kernel_solve(
            mixed, graph.sink_columns, rows[i : i + 1].astype(np.int64), sinks[columns].astype(np.int64),
            np.ascontiguousarray(upper[i : i + 1, columns]), *forward, *graph.backward(sinks[columns]),
            arcs.bucket_end, graph.sorted_heads, graph.dense_top, from_source[i : i + 1], source_count[i : i + 1], *reach, True,
            TARGET_TOLERANCE, graph.complete(buffer), part_values, part_status, arcs.self_base,
            arcs.capacity,
        )  # fmt: skip
        values[i, columns] = part_values[0]
        status[i, columns] = part_status[0]
    graph.give_back(buffer)  # not on an error: its residuals may be left half-used
    return values, status


def _push_relabel(
    mixed: np.ndarray, graph: _Prepared, rows: np.ndarray, sinks: np.ndarray, upper: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Max-flows and statuses ``(rows, sinks)`` by push-relabel (``solve_push_relabel``).

    Each pair on dense residuals of the middle matrices, from their capacities: the values
    and statuses of the kernel's Dinic with backward arcs (the bound where the max-flow
    reaches it within `TARGET_TOLERANCE`, tightened by the sink's bottom-up tree bound
    where the max-flow misses it, else the max-flow), to rounding.
    """
    assert _kernel is not None  # the caller checked
    values = np.zeros((rows.shape[0], sinks.shape[0]))
    status = np.zeros(values.shape, dtype=np.int8)
    arcs = graph.arcs
    _kernel[5](
        mixed, graph.middle_t(mixed), graph.sink_columns, rows.astype(np.int64),
        sinks.astype(np.int64), np.ascontiguousarray(upper), arcs.start, arcs.head,
        arcs.bucket_end, graph.sorted_heads, *graph.reach, TARGET_TOLERANCE, values, status,
        arcs.self_base, arcs.capacity,
    )  # fmt: skip
    return values, status


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


def _solve_with_igraph(
    mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray, reachable: np.ndarray
) -> np.ndarray:
    """Max-flows ``(rows, sinks)`` of the `reachable` pairs, each on the whole reduced graph."""
    dense = bool(np.count_nonzero(mixed == 0) <= DENSE_GRAPH_ZEROS * mixed.size)
    graph = build_layered_graph(mixed, rows, keep_zero_edges=dense)
    solver = _dense_solver(*mixed.shape[:2], rows.shape[0]) if dense else None
    pairs = [(int(i), int(j)) for i, j in zip(*np.nonzero(reachable), strict=True)]
    flows = np.zeros(reachable.shape)
    for (i, j), value in _solve_pairs(graph, mixed, pairs, sinks, solver).items():
        flows[i, j] = value
    return flows


def solve_flow_task_with_status(task: FlowTask) -> tuple[np.ndarray, np.ndarray]:
    """Max-flows ``(len(rows), len(sinks))`` of one task, and how each was found.

    The status is `CLOSED_FORM` (one or two layers, or a padded row or token), `CERTIFIED`
    (the solver's flow reached the upper bound) or `SOLVED` (solved to completion).
    """
    mixed, rows, sinks = task.mixed, task.rows, task.sinks
    path = flow_path(mixed.shape[0])
    status = np.zeros((rows.shape[0], sinks.shape[0]), dtype=np.int8)
    if path == "one_layer":
        # The only path from row r to input m is the edge Ã_1[r, m].
        return np.asarray(mixed[0][np.ix_(rows, sinks)]), status
    if path == "two_layers":
        # Paths r -> k -> m share no edge: the max-flow is their sum.
        return _parallel_paths(mixed[1][rows], mixed[0][:, sinks]), status
    if path == "kernel":
        return _solve_with_kernel(mixed, rows, sinks)
    has_out = mixed[-1][rows].sum(axis=1) > 0  # padded rows send nothing
    has_in = mixed[0][:, sinks].sum(axis=0) > 0  # padded tokens receive nothing
    reachable = has_out[:, None] & has_in[None, :]
    status[reachable] = SOLVED
    return _solve_with_igraph(mixed, rows, sinks, reachable), status


def solve_flow_task(task: FlowTask) -> np.ndarray:
    """Max-flow values ``(len(rows), len(sinks))`` for one task (runs in any thread or process)."""
    return solve_flow_task_with_status(task)[0]
