"""The compiled flow engine's cost, from a profile of the attention read before any solving.

Where the time of :func:`attnflow.flow` goes, on the compiled engine (``attnflow._maxflow``):

- preparing the input (head fusion, residual mixing, the host copy): per attention weight;
- per sequence-layer graph: arc lists and reachability, linear in the capacities ``T n²``;
  the vectorised upper bounds, ``T r n²`` for `r` output positions;
- per (source, sink) pair whose first blocking flow reaches its upper bound (certified):
  a search that touches part of the arcs that can carry the pair's flow, about
  ``A^0.8`` for ``A`` such arcs (real attention; the head mean of synthetic random
  heads certifies 3 to 4 times faster; causal attention, half that: `CAUSAL_SHARE`);
- per pair whose bound is loose (solved to completion): a few Dinic phases, each a search
  over most of those arcs, about ``A T``; on small graphs push-relabel, about a third of
  that.

Which pairs are loose is the one thing a shape cannot say. On strongly local attention
(each token attending to a narrow window), the flow from an output position reaches a
sink at distance ``d`` whole only while ``d`` is within the distance the flow can travel:
each layer moves it by about the offset beyond which a share `DRIFT_MASS` of each row's
attention still lies. Beyond the sum of those drifts
over the graph's layers the tree bounds are loose and the pair is solved to completion
(strongly local ViT-size attention: 78 to 83 % of a CLS row's pairs). Attention with any
global component (attention sinks, [CLS]/[SEP], uniform causal attention) drifts across
the whole sequence in one layer, and every pair is priced as certified.

The profile reads a sample of rows of the head-fused attention (`PROFILE_ROWS` per layer
of `PROFILE_SEQUENCES` sequences):
whether it is causal, the share of non-zero capacities per layer, and each layer's drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CAUSAL_SHARE",
    "CERTIFIED_EXPONENT",
    "DRIFT_MASS",
    "PROFILE_ROWS",
    "PROFILE_SEQUENCES",
    "SECONDS_PER_PUSH_RELABEL_ARC",
    "GraphProfile",
    "dearest_profile",
    "graph_profile",
    "kernel_task_seconds",
    "profile_rows",
]

PROFILE_ROWS = 16
"""Rows of each layer read for the profile (evenly spaced, the first and last included)."""

PROFILE_SEQUENCES = 8
"""Sequences of a batch read for the profile (evenly spaced): its cost stays that of a few
hundred rows however large the batch; the batch is priced by their pooled profile."""

DRIFT_MASS = 0.16
"""Share of a row's attention that defines a layer's drift: the largest offset ``d`` such
that the mean row still holds this much at offsets ``>= d``. Calibrated with flow's
default residual (0.5) on strongly local synthetic attention (8 layers, n = 128, logits
``N(0, 1) - λ |i - j|``, λ = 0.5 and 0.15): the first sink solved to completion lies at
23 and 117 tokens. A larger residual shortens the real reach (λ = 0.15 with α = 0.9: 4
tokens), which the profile does not follow: there local attention is underestimated;
attention with a global component stays certified at any residual."""

CERTIFIED_EXPONENT = 0.8
"""A certified pair costs about ``A^0.8`` for ``A`` live arcs (fit over n = 64 to 1,024,
6 to 30 layers, causal and bidirectional real attention; 0.72 fits up to 1,024 as well
and falls to 0.5x at 2,048, where the graph no longer fits in cache)."""

SECONDS_PER_LIVE_ARC = 1.24e-8
"""Seconds per ``A^CERTIFIED_EXPONENT`` of a certified pair (calibration set of
``benchmarks/scripts/bench_flow_cost.py``)."""

CAUSAL_SHARE = 0.5
"""A causal pair's share of that figure: the solver's breadth-first layerings and bottom-up
bounds skip the tokens before the sink (measured against `flow`, same run: GPT-2 size,
n = 1,024, and SmolLM2 at 2,048, last rows)."""

SECONDS_PER_LOOSE_ARC = 3.0e-9
"""Seconds per live arc and layer of a pair solved to completion (same calibration)."""

SECONDS_PER_PUSH_RELABEL_ARC = 1.0e-9
"""The same where push-relabel solves such pairs (small graphs, see
``attnflow._maxflow.PUSH_RELABEL_ENTRIES``): banded ViT-B/16-size attention, CLS row, 154
loose pairs in about 0.4 CPU s (0.56e-9), the whole call 0.5 s (estimated 0.73 s); on
smaller graphs each pair's fixed costs weigh more (8 layers, n = 96, CLS row: 0.033 s
estimated for 0.032 s measured)."""

SECONDS_PER_GRAPH_ENTRY = 1.0e-8
"""Arc lists, reachability and residual buffers: per capacity ``T n²`` of one graph."""

SECONDS_PER_BOUND_TERM = 1.0e-9
"""One ``min`` term of the vectorised upper bounds."""

SECONDS_PER_RAW_ENTRY = 1.5e-9
"""Reading the input once: per attention weight ``(*batch, L, H, n, n)``."""

SECONDS_PER_FUSED_ENTRY = 1.2e-8
"""Residual mixing, the float64 host copy and their checks: per fused weight
``(*batch, L, n, n)``."""


@dataclass(frozen=True)
class GraphProfile:
    """What the cost model reads of the attention itself (pooled over the batch)."""

    causal: bool
    """No capacity above the diagonal in any sampled row: a decoder's attention."""
    density: np.ndarray
    """``(L,)``: share of non-zero capacities of each layer (of the lower triangle when
    `causal`)."""
    drift: np.ndarray
    """``(L,)``: tokens the flow can move through each layer (see `DRIFT_MASS`)."""

    def reach(self, n_layers: int) -> float:
        """Distance from a source at which a graph of `n_layers` layers stops certifying."""
        return float(np.sum(self.drift[:n_layers]))


def dearest_profile(n_layers: int) -> GraphProfile:
    """Return the profile that prices every pair highest: dense, bidirectional, no drift.

    Every pair but a token's own is then solved to completion, which costs more than a
    certified pair on any graph of three tokens or more: an upper bound of the estimate.
    """
    return GraphProfile(False, np.ones(n_layers), np.zeros(n_layers))


def profile_rows(n: int) -> np.ndarray:
    """Return the rows the profile reads: `PROFILE_ROWS` evenly spaced, 0 and ``n - 1`` in."""
    return np.unique(np.linspace(0, n - 1, min(n, PROFILE_ROWS)).round().astype(np.intp))


def graph_profile(sampled: np.ndarray, rows: np.ndarray) -> GraphProfile:
    """Profile head-fused attention (no residual) from its sampled rows ``(*batch, L, k, n)``.

    `rows` ``(k,)`` are the sampled rows' positions.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._flow_cost import graph_profile, profile_rows
    >>> n = 64
    >>> causal = np.tril(np.ones((2, n, n))) / np.arange(1, n + 1)[:, None]
    >>> rows = profile_rows(n)
    >>> profile = graph_profile(causal[:, rows], rows)
    >>> bool(profile.causal), profile.reach(2) > n
    (True, True)
    """
    n = sampled.shape[-1]
    n_layers = sampled.shape[-3]
    pooled = np.abs(np.asarray(sampled, dtype=np.float64)).reshape(-1, n_layers, len(rows), n)
    offsets = np.arange(n)[None, :] - rows[:, None]  # (k, n): key - query
    causal = not bool(np.any(pooled[..., offsets > 0]))
    present = pooled > 0
    if causal:
        lower = int(np.count_nonzero(offsets <= 0))
        density = present.sum(axis=(0, 2, 3)) / (pooled.shape[0] * max(lower, 1))
    else:
        density = present.mean(axis=(0, 2, 3))
    # Each row's attention beyond offset d (both sides, d >= 1), normalised per row: from
    # running sums of the row from either end. Averaged over the batch, then over the rows
    # that have room for offset d (a causal row j reaches back j tokens at most).
    totals = pooled.sum(axis=-1, keepdims=True)
    shares = np.divide(pooled, totals, out=np.zeros_like(pooled), where=totals > 0)
    shares = shares.mean(axis=0)  # (L, k, n)
    from_left = np.cumsum(shares, axis=-1)  # [..., x]: keys <= x
    from_right = np.cumsum(shares[..., ::-1], axis=-1)[..., ::-1]  # [..., x]: keys >= x
    offset = np.arange(1, n)[None, :]
    left = rows[:, None] - offset  # (k, n-1): the key at offset d to the left
    right = rows[:, None] + offset
    tails = np.where(
        left >= 0, np.take_along_axis(from_left, np.clip(left, 0, n - 1)[None], axis=-1), 0.0
    ) + np.where(
        right < n, np.take_along_axis(from_right, np.clip(right, 0, n - 1)[None], axis=-1), 0.0
    )  # (L, k, n-1)
    room = rows if causal else np.maximum(rows, n - 1 - rows)
    has_room = offset <= room[:, None]  # (k, n-1)
    counted = np.maximum(has_room.sum(axis=0), 1)
    tail = np.where(has_room, tails, 0.0).sum(axis=1) / counted  # (L, n-1)
    drift = np.count_nonzero(tail >= DRIFT_MASS, axis=-1).astype(np.float64)
    return GraphProfile(causal, np.asarray(density, dtype=np.float64), drift)


def _distance_counts(rows: np.ndarray, n: int, n_sinks: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (row, sink) of each distance ``d = |row - sink|``, sinks below and above.

    The sinks are tokens ``0 .. n_sinks - 1``. ``(n,)`` each: ``below[d]`` counts sinks
    ``row - d`` (d = 0 included), ``above[d]`` sinks ``row + d`` (d >= 1).
    """
    rows = np.clip(rows, 0, n - 1)
    before = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])  # rows < x
    d = np.arange(n)
    below = before[np.minimum(d + n_sinks, n)] - before[d]  # d <= row < d + n_sinks
    above = before[np.clip(n_sinks - d, 0, n)]  # row <= n_sinks - 1 - d
    above[0] = 0
    return below, above


def kernel_task_seconds(
    profile: GraphProfile,
    n_layers: int,
    rows: np.ndarray,
    n: int,
    *,
    n_sinks: int | None = None,
    push_relabel: bool = False,
) -> float:
    """Single-core seconds of one sequence-layer problem on the compiled solver (T >= 3).

    `rows` are the output positions (sources) at layer `n_layers` and the sinks are the
    first `n_sinks` of the `n` tokens (None: every token). With `push_relabel` (the graph
    is small enough for it, ``attnflow._maxflow.push_relabel_fits``), loose pairs are
    priced at `SECONDS_PER_PUSH_RELABEL_ARC`.
    """
    middle = profile.density[1 : n_layers - 1]
    below, above = _distance_counts(
        np.asarray(rows, dtype=np.intp), n, n if n_sinks is None else n_sinks
    )
    distance = np.arange(n, dtype=np.float64)
    if profile.causal:
        # Flow from row s reaches sink m <= s through tokens m .. s alone.
        live = np.sum(middle) * (distance + 1) * (distance + 2) / 2
        weights = below.astype(np.float64)
    else:
        live = np.full(n, np.sum(middle) * n * n, dtype=np.float64)
        weights = (below + above).astype(np.float64)
    loose = distance > profile.reach(n_layers)
    certified = np.sum(weights * np.where(loose, 0.0, live**CERTIFIED_EXPONENT))
    if profile.causal:
        certified *= CAUSAL_SHARE
    solved = np.sum(weights * np.where(loose, live * n_layers, 0.0))
    graph = n_layers * n * n * SECONDS_PER_GRAPH_ENTRY
    bounds = (n_layers * len(rows) * n * n + len(rows) * n * n) * SECONDS_PER_BOUND_TERM
    loose_arc = SECONDS_PER_PUSH_RELABEL_ARC if push_relabel else SECONDS_PER_LOOSE_ARC
    return float(graph + bounds + certified * SECONDS_PER_LIVE_ARC + solved * loose_arc)
