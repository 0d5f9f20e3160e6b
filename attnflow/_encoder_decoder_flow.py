"""Encoder-decoder attention flow: max-flow on the graph of the encoder-decoder rollout model.

The graph is laid out as a layered graph (``attnflow._encoder_decoder_graph``) and solved by
the engine of :func:`attnflow.flow`: its compiled solver, its cost model (`FlowCost`) and
its runner (threads, an executor, the progress bar, lost workers).
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._deprecation import MISSING, Missing, renamed_keyword
from ._encoder_decoder import (
    EncoderDecoderAttribution,
    PreparedEncoderDecoder,
    prepare_encoder_decoder,
)
from ._encoder_decoder_graph import decoder_capacities, source_capacities
from ._flow import (
    SECONDS_PER_BOUND_TERM,
    SECONDS_PER_CLOSED_FORM_TASK,
    SECONDS_PER_INPUT_ENTRY,
    SECONDS_PER_PAIR_TOKEN,
    SECONDS_PER_SORTED_ENTRY,
    SECONDS_PER_TASK,
    TASK_SECONDS,
    THREADS_FROM_SECONDS,
    FlowCost,
    _check_flow_options,
    _profiled_sequences,
    _progress_bar,
    _run,
    _sampled_rows,
    _worker_count,
)
from ._flow_cost import (
    SECONDS_PER_FUSED_ENTRY,
    SECONDS_PER_RAW_ENTRY,
    GraphProfile,
    dearest_profile,
    graph_profile,
    kernel_task_seconds,
    profile_rows,
)
from ._host import from_host, to_host
from ._maxflow import FlowTask, flow_path
from ._real_rows import from_real_end
from ._typing import Array, HeadFusion, LayerSelection, Namespace, RowSelection
from ._work_limit import DEFAULT_MAX_SECONDS, deprecated_max_work, refuse_above

__all__ = ["encoder_decoder_flow"]


@from_real_end("target_mask", host=True)
def encoder_decoder_flow(
    encoder: Array,
    decoder: Array,
    cross: Array,
    /,
    *,
    heads: HeadFusion = "mean",
    residual: float = 0.5,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    source_mask: Any | None = None,
    target_mask: Any | None = None,
    normalize_result: bool = True,
    n_jobs: int | None = None,
    executor: Executor | None = None,
    progress: bool = False,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
    max_work: float | Missing | None = MISSING,
    validate: bool | Literal["heads"] = True,
    normalize: bool | Missing = MISSING,
    xp: Namespace | None = None,
) -> EncoderDecoderAttribution:
    r"""Attention flow through an encoder-decoder transformer, to source and target tokens.

    The graph is the one whose path products :func:`encoder_decoder_rollout` sums (the
    rollout model: heads fused, a residual of weight :math:`\alpha` in every sub-layer),
    and each value is a maximum flow on it, as :func:`flow` is to :func:`rollout`
    (Abnar & Zuidema 2020, §3). With :math:`E_k`, :math:`D_l`, :math:`C_l` the head-fused
    encoder self-, decoder self- and cross-attention, the nodes are the encoder layers
    :math:`e_0 .. e_{L_e}` (``S`` tokens each; :math:`e_0` the source tokens) and the
    decoder layers :math:`x_0 .. x_{L_d}` (``T`` positions each; :math:`x_0` the target
    prefix). The edges and their capacities are the rows of the rollout model's
    per-layer matrices:

    .. math::

        e_k[i] &\to e_{k-1}[j]: \quad (1-\alpha) E_k[i, j] + \alpha [i = j], \\
        x_l[t] &\to x_{l-1}[u]: \quad \alpha \bigl((1-\alpha) D_l[t, u]
            + \alpha [t = u]\bigr), \\
        x_l[t] &\to e_{L_e}[s]: \quad (1-\alpha) \, C_l[t, s],

    so every node's capacities out sum to one, and multiplying them along paths gives
    :func:`encoder_decoder_rollout`'s :math:`X_l = [\alpha \tilde D_l \mid (1-\alpha)
    C_l] \, [X_{l-1} ; R_\text{enc}]`. Every cross-attention layer reads the same top
    encoder layer. The flow of decoder position :math:`t` at layer :math:`l` is

    .. math::

        F^s_l[t, s] = \operatorname{maxflow}(x_l[t] \to e_0[s]), \qquad
        F^t_l[t, u] = \operatorname{maxflow}(x_l[t] \to x_0[u]),

    and with ``normalize_result=True`` (the paper's code) each row of :math:`[F^s \mid F^t]` is
    divided by its sum.

    Parameters
    ----------
    encoder, decoder, cross : array
        The three attention families, ``(*batch, L_e, heads, S, S)``,
        ``(*batch, L_d, heads, T, T)`` and ``(*batch, L_d, heads, T, S)`` (no heads axis
        with ``heads=None``), as for :func:`encoder_decoder_rollout`.
    heads : {"mean", "max", "min"}, callable, array_like or None, default "mean"
        Head fusion, the same for the three families (weights of shape ``(heads,)``).
    residual : float, default 0.5
        :math:`\alpha` of every sub-layer.
    rows : int, sequence of int or None, default None
        Decoder positions to explain (negative ones from each sequence's last real target
        token where `target_mask` is given). Each costs one max-flow per source and
        target token and reported layer.
    layers : {"last", "all"} or int, default "last"
        The decoder layer(s) whose flow is reported. Decoder layers above are never built.
    source_mask, target_mask : bool array, optional
        ``(*batch, S)`` and ``(*batch, T)``, True for real tokens: padded tokens leave the
        graph and get exactly zero flow; padded decoder rows are zero.
    normalize_result : bool, default True
        Divide each row of the result, ``[source | target]``, by its sum (``normalize``
        before 0.1). False returns the raw max-flow values, each at most 1.
    n_jobs : int, optional
        Threads on this machine, as for :func:`flow`: None chooses (all cores when the
        work is estimated above about 0.05 s, else one), -1 is one per core, 1 runs
        serially; more than the cores is capped at the cores.
    executor : concurrent.futures.Executor, optional
        Run the max-flow tasks on this executor instead, as for :func:`flow` (a Dask
        cluster's, or a ``ProcessPoolExecutor`` under ``if __name__ == "__main__":``).
    progress : bool, default False
        Show a progress bar (tqdm) over the max-flows.
    max_seconds : float or None, default 600
        Refuse to start, before any max-flow, when the estimated single-core time
        (``estimated_seconds`` of :class:`FlowCost`) exceeds this many seconds; None
        lifts the limit. The estimate is :func:`flow`'s cost model (shapes, masks and a
        profile of a sample of the attention's rows) applied to the two layered graphs.
    max_work : float or None, optional
        Deprecated (removed in 0.2): the old limit, in max-flows times edges of the
        graph (edge visits of the igraph engine); given, it replaces `max_seconds`, with
        a :class:`DeprecationWarning`.
    validate : bool or "heads", default True
        Check the attention values first, as for :func:`encoder_decoder_rollout`.
    normalize : bool, optional
        Deprecated spelling of `normalize_result`, kept for one release (a
        DeprecationWarning).
    xp : namespace, optional
        The array namespace; inferred from the inputs by default.

    Returns
    -------
    EncoderDecoderAttribution
        ``(source, target)``: ``(*batch, [layers,] T, S)`` and ``(*batch, [layers,] T,
        T)`` for ``rows=None`` (the ``T`` axis is dropped for an int row, ``r`` for a
        sequence of ``r``), in the library, dtype and device of `encoder`.

    Raises
    ------
    ValueError
        On inconsistent shapes, a bad option, bad values (with `validate`), or an
        estimate above `max_seconds`.
    TypeError
        On a non-floating dtype, mixed libraries, a non-boolean mask, a bad option type,
        or inputs traced by ``jax.jit`` (max-flow runs on the host).
    WorkersLostError
        If the worker processes of an `executor` die before finishing.
    IndexError
        If `rows` or `layers` is out of range.

    See Also
    --------
    encoder_decoder_rollout : The same graph, path products summed.
    flow : Attention flow of one self-attention stack.

    Notes
    -----
    The max-flows run on the host (float64) in the engine of :func:`flow`: its compiled
    solver (igraph where it was not built), its cost model and its runner. The graph is
    not layered (cross edges jump to :math:`e_{L_e}` from every decoder layer), so two
    layered graphs stand in for it. No path from :math:`x_l[t]` to a target token leaves
    the decoder: :math:`F^t_l` is :math:`\alpha` times the flow of the decoder's own graph
    :math:`(1-\alpha) D_k + \alpha I`, :math:`k \le l`. For the source tokens the graph is
    laid out in ``L_e + L_d`` layers of ``S + T`` tokens, layer :math:`L_e + l` holding
    :math:`x_l` and a copy of :math:`e_{L_e}` that passes what it receives one layer down
    along an edge no flow fills, so every max-flow is that of the graph above. A
    ``T``-position decoder over ``S`` source tokens costs ``T (S + T)`` max-flows per
    reported layer :math:`l`: ``T S`` on ``L_e S^2 + l (T^2 + T S + S)`` edges at most,
    ``T^2`` on ``l T^2``.

    Under the rollout model the source share is fixed (:math:`1 - \alpha^l` after
    :math:`l` decoder layers); flow has no such constraint: its source and target parts
    compete for the capacity out of :math:`x_l[t]`, and a bottleneck in the encoder
    lowers the source part alone.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    One encoder layer, one decoder layer, one head, S = T = 2:

    >>> import numpy as np
    >>> import attnflow
    >>> enc = np.array([[[[0.5, 0.5], [0.0, 1.0]]]])   # (L_e, H, S, S)
    >>> dec = np.array([[[[1.0, 0.0], [0.5, 0.5]]]])   # (L_d, H, T, T), causal
    >>> crs = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])   # (L_d, H, T, S)
    >>> source, target = attnflow.encoder_decoder_flow(enc, dec, crs, normalize_result=False)
    >>> source  # x_1[t] -> e_1[s] (capacity 0.5 C) -> e_0 (capacity 0.5 E + 0.5 I)
    array([[0.5 , 0.25],
           [0.  , 0.5 ]])
    >>> target  # x_1[t] -> x_0[u], capacity 0.5 (0.5 D + 0.5 I)
    array([[0.5  , 0.   ],
           [0.125, 0.375]])
    """
    normalize_result = renamed_keyword(
        "normalize", "normalize_result", normalize, normalize_result, default=True
    )
    max_work = deprecated_max_work(max_work, max_seconds)
    _check_flow_options(n_jobs, executor, progress, normalize_result, max_seconds, max_work)
    prepared = prepare_encoder_decoder(
        encoder,
        decoder,
        cross,
        rule="rollout",
        gradients=None,
        heads=heads,
        residual=residual,
        rows=rows,
        layers=layers,
        source_mask=source_mask,
        target_mask=target_mask,
        normalize=normalize_result,
        validate=validate,
        xp=xp,
    )
    enc, dec, crs = prepared.fused
    batch = tuple(int(d) for d in enc.shape[:-3])
    n_enc, n_dec = int(enc.shape[-3]), int(dec.shape[-3])
    n_src, n_tgt = int(enc.shape[-1]), int(dec.shape[-1])
    reported = list(range(n_dec)) if prepared.all_layers else [n_dec - 1]
    wanted = list(prepared.rows.positions(n_tgt))

    # The one host hop: the masks, then (once the cost is known) the fused attention.
    source_real, target_real = (
        np.ones((*batch, n), dtype=bool) if m is None else to_host(m, name=name, keep_dtype=True)
        for m, n, name in (
            (prepared.source_mask, n_src, "source_mask"),
            (prepared.target_mask, n_tgt, "target_mask"),
        )
    )
    shape = _Shape(n_enc, n_src, n_tgt, 1 if heads is None else int(encoder.shape[-3]))
    # The estimate decides refusing (above `max_seconds`) and threads, as in `flow`: priced
    # from a profile of the attention, unless the dearest attention of these shapes
    # already stays below both (small calls).
    limit = max_seconds if max_work is MISSING and max_seconds is not None else math.inf
    estimate = _cost_of(
        prepared,
        shape,
        reported,
        wanted,
        source_real,
        target_real,
        decided_below=min(limit, THREADS_FROM_SECONDS),
    )
    _refuse_above_limit(estimate, shape, batch, reported, wanted, max_seconds, max_work)

    alpha = prepared.alpha
    host_decoder = to_host(dec, name="decoder")
    graphs = _Graphs(
        source_capacities(
            to_host(enc, name="encoder"),
            host_decoder,
            to_host(crs, name="cross"),
            source_real,
            target_real,
            alpha=alpha,
        ),
        decoder_capacities(host_decoder, target_real, alpha=alpha),
    )
    # validate=False lets NaN through: such a sequence is NaN throughout, never a guess.
    undefined = ~np.isfinite(graphs.source).all(axis=(-3, -2, -1))

    workers = _worker_count(n_jobs, estimate)
    if executor is not None:
        workers = max(workers, 2)  # split work finely enough for the executor's workers
    tasks = _plan(
        graphs,
        shape,
        reported,
        wanted,
        source_real,
        target_real,
        undefined=undefined,
        targets=alpha > 0,  # with alpha = 0 no decoder edge carries anything
        workers=workers,
    )
    values = np.zeros((*batch, len(reported), len(wanted), n_src + n_tgt))
    bar = _progress_bar(progress, estimate.max_flows)
    try:
        for task, result in _run(tasks, workers, executor, bar):
            part, *index = task.index
            columns = task.sinks if part == SOURCE else n_src + task.sinks
            values[(*index, *np.ix_(task.positions, columns))] = result  # type: ignore[index]
    finally:
        if bar is not None:
            bar.close()
    values[..., n_src:] *= alpha  # the decoder graph's capacities are alpha D~
    values[undefined] = np.nan
    if normalize_result:
        totals = values.sum(axis=-1, keepdims=True)
        values = np.divide(values, totals, out=np.zeros_like(values), where=totals > 0)
        values[undefined] = np.nan  # NaN stays NaN
    if not prepared.all_layers:
        values = values[..., 0, :, :]
    values = prepared.rows.squeeze(values)
    source, target = values[..., :n_src], values[..., n_src:]
    like, namespace, boundary = enc, prepared.xp, prepared.boundary
    return EncoderDecoderAttribution(
        boundary.restore(from_host(np.ascontiguousarray(source), like=like, xp=namespace)),
        boundary.restore(from_host(np.ascontiguousarray(target), like=like, xp=namespace)),
    )


SOURCE, TARGET = 0, 1
"""The first entry of a task's `FlowTask.index`: which graph it solves, whose sinks are the
source tokens (`source_capacities`) or the target tokens (`decoder_capacities`)."""


@dataclass(frozen=True)
class _Graphs:
    """The two layered graphs of a call (``attnflow._encoder_decoder_graph``)."""

    source: np.ndarray
    """``(*batch, L_e + L_d, S + T, S + T)``: max-flows to the source tokens."""
    decoder: np.ndarray
    """``(*batch, L_d, T, T)``: max-flows to the target tokens, divided by alpha."""


@dataclass(frozen=True)
class _Shape:
    """What the cost of a call depends on, besides its rows, layers and masks."""

    n_enc: int
    """Encoder layers ``L_e``."""
    n_src: int
    """Source tokens ``S`` (padding included)."""
    n_tgt: int
    """Target positions ``T`` (padding included)."""
    n_heads: int
    """Heads of each attention family (1 for fused input)."""


def _source_edges(shape: _Shape, layer: int, n_src: np.ndarray, n_tgt: np.ndarray) -> np.ndarray:
    """Edges of the source tokens' graph up to decoder layer `layer` (1-based), zeros left out.

    An upper bound from the shapes alone: per encoder layer ``S²`` attention edges; per
    decoder layer ``T² + T S`` attention edges and ``S`` pass-through edges (`n_src`,
    `n_tgt`: real tokens, one entry per kind of sequence).
    """
    edges: np.ndarray = shape.n_enc * n_src * n_src + layer * (
        n_tgt * n_tgt + n_tgt * n_src + n_src
    )
    return edges


def _task_seconds(
    n_layers: int, n_rows: np.ndarray, n_valid: np.ndarray, edges: np.ndarray
) -> np.ndarray:
    """Rough single-core time of one sequence-layer task on a layered graph.

    Flow's cost model (``attnflow._flow._solve_seconds``), with the graph's edges in
    place of a dense graph's ``n² T``: the solver's time per max-flow is proportional to
    its edges; ordering the arcs and the top-down bounds read ``T`` matrices of the
    `n_valid` tokens.
    """
    squared = n_valid * n_valid
    if flow_path(n_layers) in ("one_layer", "two_layers"):
        closed: np.ndarray = (
            SECONDS_PER_CLOSED_FORM_TASK + n_rows * squared * SECONDS_PER_BOUND_TERM
        )
        return closed
    ordering = n_layers * squared * SECONDS_PER_SORTED_ENTRY
    bounds = n_layers * n_rows * squared * SECONDS_PER_BOUND_TERM
    solving = n_rows * n_valid * edges * SECONDS_PER_PAIR_TOKEN
    seconds: np.ndarray = SECONDS_PER_TASK + solving + ordering + bounds
    return seconds


def _problems(
    shape: _Shape, layer: int, n_src: np.ndarray, n_tgt: np.ndarray, n_rows: np.ndarray
) -> list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """Return the two problems of decoder layer `layer` (0-based) of one kind of sequence.

    ``(part, graph layers, sinks, edges, seconds)`` for the source tokens' graph and the
    decoder's graph, on real token counts (arrays, one entry per kind of sequence).
    """
    top = shape.n_enc + layer + 1
    edges = _source_edges(shape, layer + 1, n_src, n_tgt)
    decoder_edges = (layer + 1) * n_tgt * n_tgt
    return [
        (SOURCE, top, n_src, edges, _task_seconds(top, n_rows, n_src + n_tgt, edges)),
        (
            TARGET,
            layer + 1,
            n_tgt,
            decoder_edges,
            _task_seconds(layer + 1, n_rows, n_tgt, decoder_edges),
        ),
    ]


@dataclass(frozen=True)
class _Profiles:
    """What the cost model reads of the attention (``attnflow._flow_cost``), per graph."""

    source: GraphProfile
    """The source tokens' graph: ``L_e + L_d`` layers of ``S + T`` tokens."""
    decoder: GraphProfile
    """The decoder's graph: ``L_d`` layers of ``T`` tokens."""


def _cost(
    shape: _Shape,
    reported: list[int],
    wanted: list[int],
    source_real: np.ndarray,
    target_real: np.ndarray,
    profiles: _Profiles | None = None,
) -> FlowCost:
    """Count the work of a call from its shapes, rows, masks and attention profiles.

    Sequences with the same numbers of real source tokens, real target positions and
    real rows cost the same: each kind is counted once, times how often it occurs. With
    `profiles` (:func:`_profiles_of`), problems on the compiled solver are priced as
    `flow` prices them (``attnflow._flow_cost``); without (and on the closed forms and
    igraph), from shapes alone.
    """
    flat_s = source_real.reshape(-1, shape.n_src)
    flat_t = target_real.reshape(-1, shape.n_tgt)
    kinds = np.stack(
        [
            np.count_nonzero(flat_s, axis=1),
            np.count_nonzero(flat_t, axis=1),
            np.count_nonzero(flat_t[:, wanted], axis=1),
        ],
        axis=1,
    )
    kinds, counts = np.unique(kinds, axis=0, return_counts=True)
    n_src, n_tgt, n_rows = (kinds[:, i].astype(np.int64) for i in range(3))
    rows = np.asarray(wanted, dtype=np.intp)
    max_flows, largest, visits, seconds = 0, 0, 0.0, 0.0
    for layer in reported:
        for part, top, sinks, edges, by_shape in _problems(shape, layer, n_src, n_tgt, n_rows):
            per_task = by_shape
            if profiles is not None and flow_path(top) == "kernel":
                # The source tokens' graph is priced in the frame of its profile: target
                # position t over source token t, the sinks the first `s` tokens.
                profile = profiles.source if part == SOURCE else profiles.decoder
                tokens = n_src + n_tgt if part == SOURCE else n_tgt
                per_task = np.array(
                    [
                        SECONDS_PER_TASK
                        + kernel_task_seconds(
                            profile,
                            top,
                            np.minimum(rows[:r], max(t - 1, 0)),
                            int(n),
                            n_sinks=int(k),
                        )
                        for n, t, r, k in zip(tokens, n_tgt, n_rows, sinks, strict=True)
                    ]
                )
            pairs = n_rows * sinks
            max_flows += int(np.sum(pairs * counts))
            largest = max(largest, int(np.max(edges, initial=0)))
            visits += float(np.sum(pairs.astype(np.float64) * edges * counts))
            seconds += float(np.sum(np.where(pairs > 0, per_task, 0.0) * counts))
    used = max(reported) + 1
    entries = shape.n_enc * n_src**2 + used * (n_tgt**2 + n_tgt * n_src)
    if profiles is None:
        seconds += float(np.sum(entries * counts)) * shape.n_heads * SECONDS_PER_INPUT_ENTRY
    else:
        # Read once per head; the host copy and the two graphs' capacities per entry.
        graphs = (shape.n_enc + used) * (n_src + n_tgt) ** 2 + used * n_tgt**2
        per_sequence = (
            entries * shape.n_heads * SECONDS_PER_RAW_ENTRY + graphs * SECONDS_PER_FUSED_ENTRY
        )
        seconds += float(np.sum(per_sequence * counts))
    return FlowCost(max_flows, largest, visits, seconds)


def _cost_of(
    prepared: PreparedEncoderDecoder,
    shape: _Shape,
    reported: list[int],
    wanted: list[int],
    source_real: np.ndarray,
    target_real: np.ndarray,
    *,
    decided_below: float = 0.0,
) -> FlowCost:
    """Estimate a prepared call's work from profiles of its fused attention.

    As `flow`'s estimate: where the estimate for the dearest attention of these shapes
    (`dearest_profile`) is at most `decided_below`, that bound is returned instead,
    without a profile.
    """
    counts = (shape, reported, wanted, source_real, target_real)
    if decided_below > 0:
        used = max(reported) + 1
        dearest = _Profiles(dearest_profile(shape.n_enc + used), dearest_profile(used))
        estimate = _cost(*counts, profiles=dearest)
        if estimate.estimated_seconds <= decided_below:
            return estimate
    return _cost(*counts, profiles=_profiles_of(prepared))


def _profiles_of(prepared: PreparedEncoderDecoder) -> _Profiles:
    """Profile the two graphs of a call from a sample of the rows of its fused attention.

    The sampled rows (`profile_rows`) of a few sequences (`PROFILE_SEQUENCES`), as for
    `flow`. The decoder's graph is the decoder's attention. The source tokens' graph is
    read without its residuals and pass-through edges: its encoder layers are the
    encoder's rows, its decoder layers the rows ``[(1-α) C | α(1-α) D]`` of the target
    slots, each part's densities scaled by the share of the layer's rows it fills. Its
    drift is read where target position ``t`` sits over source token ``t`` (the cross
    attention's jump from the target slots to the source slots, made once on every
    path, is no distance), which is the frame `_cost` prices it in.
    """
    xp, alpha = prepared.xp, prepared.alpha
    enc, dec, crs = prepared.fused
    n_src, n_tgt = int(enc.shape[-1]), int(dec.shape[-1])
    n = n_src + n_tgt
    chosen = _profiled_sequences(tuple(int(d) for d in enc.shape[:-3]))

    def sampled(family: Any, sample: np.ndarray) -> np.ndarray:
        index = tuple(sample.tolist())
        rows = xp.stack([_sampled_rows(family[(*item, ...)], index, xp) for item in chosen])
        host: np.ndarray = np.nan_to_num(to_host(rows))  # (sequences, L, rows, keys)
        return host

    src_rows, tgt_rows = profile_rows(n_src), profile_rows(n_tgt)
    encoder_rows, decoder_rows = sampled(enc, src_rows), sampled(dec, tgt_rows)
    cross_rows = sampled(crs, tgt_rows)
    encoder_part, decoder = (
        graph_profile(encoder_rows, src_rows),
        graph_profile(decoder_rows, tgt_rows),
    )
    slots = graph_profile(
        np.concatenate([(1 - alpha) * cross_rows, alpha * (1 - alpha) * decoder_rows], axis=-1),
        n_src + tgt_rows,
    )
    aligned = np.zeros((*cross_rows.shape[:-1], max(n_src, n_tgt)))
    aligned[..., :n_src] = cross_rows
    cross = graph_profile(aligned, tgt_rows)
    # A path to a source token crosses once, then moves in the encoder layers: the cross
    # drift (mean over the layers) counts once. The decoder's self-attention, below the
    # cross attention in every row, adds no reach the engine's bounds see (measured: the
    # first pairs solved to completion lie beyond the encoder's and the cross drift).
    drift = np.concatenate([encoder_part.drift, np.zeros_like(decoder.drift)])
    drift[encoder_part.drift.size] = float(np.mean(cross.drift))
    # The encoder's densities are of S columns, the decoder rows' of S + T (or of the
    # lower triangle, which they fill): as shares of the (S + T)^2 capacities of a layer.
    source = GraphProfile(
        encoder_part.causal and decoder.causal and cross.causal,
        np.concatenate([encoder_part.density * (n_src / n) ** 2, slots.density * n_tgt / n]),
        drift,
    )
    return _Profiles(source, decoder)


def _plan(
    graphs: _Graphs,
    shape: _Shape,
    reported: list[int],
    wanted: list[int],
    source_real: np.ndarray,
    target_real: np.ndarray,
    *,
    undefined: np.ndarray,
    targets: bool,
    workers: int,
) -> list[FlowTask]:
    """Split the call into tasks: per sequence, reported layer and graph, sinks in chunks.

    As `flow` splits its problems: with more workers than problems, the sinks of each
    are split so that every worker has work; a problem estimated above `TASK_SECONDS`
    is split further, to about that size. A task's index is ``(part, *batch index,
    layer slot)``, `part` naming its graph (`SOURCE` or `TARGET`). Without `targets`
    the decoder's graph is left out (its flows are zero).
    """
    batch = source_real.shape[:-1]
    n_problems = math.prod(batch) * len(reported) * (2 if targets else 1)
    chunks = 1 if workers == 1 else max(1, math.ceil(2 * workers / max(n_problems, 1)))
    tasks: list[FlowTask] = []
    for item in np.ndindex(*batch):
        real_rows = [(i, t) for i, t in enumerate(wanted) if target_real[item][t]]
        if undefined[item] or not real_rows:
            continue  # NaN throughout, or padded rows only: they send nothing
        positions = np.array([i for i, _ in real_rows], dtype=np.int64)
        rows = np.array([t for _, t in real_rows], dtype=np.int64)
        sinks = {
            SOURCE: np.flatnonzero(source_real[item]),
            TARGET: np.flatnonzero(target_real[item]),
        }
        counts = (np.asarray(sinks[SOURCE].size), np.asarray(sinks[TARGET].size))
        for slot, layer in enumerate(reported):
            problems = _problems(shape, layer, *counts, np.asarray(rows.size))
            for part, top, _, _, seconds in problems[: 2 if targets else 1]:
                if sinks[part].size == 0:
                    continue
                if part == SOURCE:  # one array per problem: the engine prepares it once
                    graph, sources = graphs.source[(*item, slice(0, top))], shape.n_src + rows
                else:
                    graph, sources = graphs.decoder[(*item, slice(0, top))], rows
                pieces = max(chunks, math.ceil(float(seconds) / TASK_SECONDS))
                for part_sinks in np.array_split(sinks[part], min(pieces, sinks[part].size)):
                    index = (part, *item, slot)
                    tasks.append(FlowTask(index, graph, sources, positions, part_sinks))
    return tasks


def _refuse_above_limit(
    estimate: FlowCost,
    shape: _Shape,
    batch: tuple[int, ...],
    reported: list[int],
    wanted: list[int],
    max_seconds: float | None,
    max_work: float | Missing | None,
) -> None:
    """Raise if the call's estimate is above the limit the caller set (or the default)."""
    fix = (
        "Explain fewer decoder positions (`rows=`), stop at a lower decoder layer "
        "(`layers=`), spread the work over more cores (`n_jobs=`) or a cluster "
        "(`executor=`), or pass `max_seconds=None` to run it anyway."
    )
    if max_work is MISSING:
        what = "this encoder-decoder flow"
        refuse_above(estimate.estimated_seconds, str(estimate), max_seconds, what=what, fix=fix)
        return
    # The deprecated limit keeps its old meaning: max-flows x edges of the old graph.
    max_flows = math.prod(batch) * len(reported) * len(wanted) * (shape.n_src + shape.n_tgt)
    edges = shape.n_enc * shape.n_src**2 + (max(reported) + 1) * (
        shape.n_tgt**2 + shape.n_tgt * shape.n_src
    )
    work = float(max_flows) * float(edges)
    if max_work is not None and work > max_work:  # type: ignore[operator]
        msg = (
            f"this encoder-decoder flow would take {max_flows:,} max-flows on graphs of up "
            f"to {edges:,} edges ({work:.3g} edge visits), above `max_work`={max_work:.3g}. "
            f"{fix}"
        )
        raise ValueError(msg)
