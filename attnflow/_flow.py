"""Attention flow: max-flow on the layered attention graph (Abnar & Zuidema 2020, §3)."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from ._deprecation import MISSING, Missing, renamed_keyword
from ._flow_cost import (
    PROFILE_SEQUENCES,
    SECONDS_PER_FUSED_ENTRY,
    SECONDS_PER_RAW_ENTRY,
    GraphProfile,
    dearest_profile,
    graph_profile,
    kernel_task_seconds,
    profile_rows,
)
from ._graph import layered_graph_edges
from ._heads import apply_head_fusion
from ._host import from_host, to_host
from ._lost_workers import WorkersLostError, lost_workers_message
from ._maxflow import FlowTask, flow_path, push_relabel_fits, solve_flow_task
from ._nonfinite import clear_non_finite
from ._prepare import CheckedArguments, PreparedAttention, check_arguments, prepare_attention
from ._pruning import prune
from ._real_rows import from_real_end, real_end_union
from ._receptive_field import normalize_attribution, uniform_causal_attention
from ._residual import mix_residual
from ._rows import Rows, take_rows
from ._typing import ArrayT, HeadFusion, LayerSelection, Namespace, RowSelection
from ._validation import AttentionLayout, check_n_jobs
from ._work_limit import DEFAULT_MAX_SECONDS, check_max_seconds, deprecated_max_work, refuse_above

__all__ = ["FlowCost", "flow", "flow_cost"]

SECONDS_PER_PAIR_TOKEN = 1.2e-10
"""Cost of one max-flow of the compiled solver, per squared token count and per layer: the
solver's flow reaches the upper bound in one blocking flow that touches a part of the
graph. Measured on a 2-core x86-64 machine (shared, loaded): 6-10e-11 s x n² x T on the
last row of SmolLM2 (30 layers, real text, n = 512 to 2,048, causal); random
bidirectional attention about 2e-10 (no token is pruned), all rows of MiniLM at n = 128
about 1e-9, and pairs solved to completion (strongly local attention) far more. A value
between them: within 2x on decoders, and tasks (cut at `TASK_SECONDS` by this estimate)
stay about a second long on bidirectional attention."""

SECONDS_PER_INPUT_ENTRY = 1.5e-8
"""Cost per attention weight of the input ``(*batch, L, H, n, n)``, once per call: checks,
head fusion, residual mixing and the host copy (same machine; a third of the call on
SmolLM2 at n = 1,024, most of it on a 12-head GPT-2-size decoder)."""

SECONDS_PER_SORTED_ENTRY = 5.0e-9
"""Cost per capacity of the preparation, once per sequence-layer problem: arc lists by a
linear counting sort, reachability intervals (same machine)."""

SECONDS_PER_BOUND_TERM = 1.0e-9
"""Cost of one ``min`` term of the vectorised upper bounds (same machine)."""

SECONDS_PER_CLOSED_FORM_TASK = 3.0e-5
"""Fixed cost of one sequence-layer task of one or two layers, solved in closed form
(same machine: 31 µs each over 20,000 sequences of 6 tokens)."""

SECONDS_PER_TASK = 1.5e-4
"""Fixed cost of one sequence-layer task: bounds, arc ordering and solver set-up calls
(same machine); what dominates at the paper's scale and below."""

TASK_SECONDS = 0.5
"""Largest estimated single-core time of one task: longer sequence-layer problems are split
over their input tokens, so that the progress bar moves and Ctrl-C takes effect within
about a second (a task runs to its end once started: the compiled solver holds no Python
frame to interrupt)."""

THREADS_FROM_SECONDS = 0.05
"""Estimated seconds from which ``n_jobs=None`` runs on every core: threads start in
microseconds, but splitting a task repeats its arc ordering."""

DEFAULT_MAX_WORK = 2.5e10
"""Edge visits (max-flows x edges) above which `flow` refused to start by default, when the
limit was `max_work` (deprecated; `max_seconds` replaces it)."""


@dataclass(frozen=True)
class FlowCost:
    """How much work attention flow would do, known before running it.

    Parameters
    ----------
    max_flows : int
        Number of max-flow problems (output position x input token, per sequence and
        reported layer).
    largest_graph_edges : int
        Edges of the largest graph solved (an upper bound: zero-capacity edges are
        dropped when the graph is built).
    edge_visits : float
        The sum over max-flows of the edges of their graph: the work.
    estimated_seconds : float
        A single-core estimate of the compiled engine's time, computed before any solving
        from the shapes and a profile of the attention (``attnflow._flow_cost``): per
        attention weight, preparing the input; per graph of ``T`` layers on ``n`` tokens,
        its arc lists and bounds (``T n²``); per (source, sink) pair, about
        ``1.2e-8 s x A^0.8`` where the first blocking flow reaches the upper bound, for
        ``A`` arcs that can carry the pair's flow (``(T-2) n²``; in causal attention the
        tokens between sink and source alone), and about ``3e-9 s x A T`` where it cannot
        (pairs farther from the source than strongly local attention carries flow whole,
        solved to completion). Calibrated on a 2-core x86-64 machine; within 0.6x to 1.4x
        of the measured CPU time on real encoders and decoders (MiniLM, SmolLM2 up to
        n = 2,048, a GPT-2-size decoder) and on strongly local attention, 2 to 4x above it
        on the head mean of synthetic random heads, which certifies faster
        (``benchmarks/scripts/bench_flow_cost.py``). Divide by the number of workers.

    See Also
    --------
    flow_cost : Computes it.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> cost = attnflow.flow_cost(np.full((6, 12, 32, 32), 1 / 32), rows=0)
    >>> cost.max_flows, cost.largest_graph_edges
    (32, 4160)
    """

    max_flows: int
    largest_graph_edges: int
    edge_visits: float
    estimated_seconds: float

    def __str__(self) -> str:
        return (
            f"{self.max_flows:,} max-flows on graphs of up to {self.largest_graph_edges:,} "
            f"edges ({self.edge_visits:.3g} edge visits, roughly "
            f"{_format_seconds(self.estimated_seconds)} on one core)"
        )


def _format_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


@dataclass(frozen=True)
class _Plan:
    """The max-flow problems of one call, before any of them is solved."""

    tasks: list[FlowTask]
    output_shape: tuple[int, ...]


def _solve_seconds(n_layers: int, n_rows: int, n_valid: int) -> float:
    """Rough single-core time of one sequence-layer task, on the path the engine takes.

    The solver's costs are the compiled kernel's; igraph (a build without it) is slower.
    """
    pairs = n_rows * n_valid
    squared = n_valid * n_valid
    if flow_path(n_layers) in ("one_layer", "two_layers"):
        return SECONDS_PER_CLOSED_FORM_TASK + pairs * n_valid * SECONDS_PER_BOUND_TERM
    ordering = n_layers * squared * SECONDS_PER_SORTED_ENTRY
    bounds = n_layers * n_rows * squared * SECONDS_PER_BOUND_TERM  # top-down, all sinks
    solving = pairs * squared * n_layers * SECONDS_PER_PAIR_TOKEN
    return SECONDS_PER_TASK + solving + ordering + bounds


def _plan(
    prepared: PreparedAttention,
    mixed: np.ndarray,
    mask: np.ndarray | None,
    *,
    mixed_heads: np.ndarray | None = None,
    workers: int = 1,
) -> _Plan:
    """Split the call into tasks: one per sequence and top layer, sinks split in chunks.

    With ``heads="each"`` there is one task per head as well: its graph is the fused
    layers below the top layer and that head's matrix at the top (`mixed_heads`,
    ``(*batch, reported_layers, H, n, n)``). `mask` is the host mask ``(*batch, n)`` of
    :func:`_host_mask`, or None. With `workers` and fewer sequence-layer pairs
    than workers, the input tokens of each pair are split so that every worker has work;
    each chunk orders its graph's arcs again, so there are no more chunks than that. A
    problem estimated above `TASK_SECONDS` is split further, to about that size.
    """
    layout = prepared.layout
    n = layout.n_tokens
    n_used = prepared.fused.shape[-3]
    row_list = prepared.rows.positions(n)
    tops = list(range(1, n_used + 1)) if prepared.all_layers else [n_used]
    each_head = prepared.per_head is not None
    head_list: list[int | None] = list(range(layout.n_heads or 1)) if each_head else [None]
    n_pairs = math.prod(layout.batch_shape) * len(tops) * len(head_list)
    chunks = 1 if workers == 1 else max(1, math.ceil(2 * workers / n_pairs))
    out_shape: tuple[int, ...] = (
        *layout.batch_shape,
        *((n_used,) if prepared.all_layers else ()),
        *((len(head_list),) if each_head else ()),
        len(row_list),
        n,
    )
    tasks: list[FlowTask] = []
    for item in np.ndindex(*layout.batch_shape):
        keep = np.ones(n, dtype=bool) if mask is None else mask[item]
        tokens = np.flatnonzero(keep)
        item_rows = np.array([r for r in row_list if keep[r]], dtype=np.int64)
        positions = np.array([i for i, r in enumerate(row_list) if keep[r]], dtype=np.int64)
        for top in tops:
            for head in head_list:
                if len(item_rows) * len(tokens) == 0:
                    continue
                slot: tuple[int, ...] = (*item, top - 1) if prepared.all_layers else item
                sequence = mixed[(*item, slice(0, top))]
                if head is not None:
                    assert mixed_heads is not None  # given with heads="each"
                    slot = (*slot, head)
                    reported = top - 1 if prepared.all_layers else 0
                    top_matrix = mixed_heads[(*item, reported, head)]
                    sequence = np.concatenate([sequence[:-1], top_matrix[None]])
                task_seconds = _solve_seconds(top, len(item_rows), len(tokens))
                pieces = max(chunks, math.ceil(task_seconds / TASK_SECONDS))
                for sinks in np.array_split(tokens, min(pieces, len(tokens))):
                    tasks.append(FlowTask(slot, sequence, item_rows, positions, sinks))
    return _Plan(tasks, out_shape)


def _cost(
    layout: AttentionLayout,
    *,
    used_layers: int,
    all_layers: bool,
    rows: Rows,
    each_head: bool,
    mask: np.ndarray | None,
    profile: GraphProfile | None = None,
) -> FlowCost:
    """Count the work of a call from its shapes, rows, host mask and attention profile.

    Vectorised over the batch: sequences with the same number of real tokens and real
    rows cost the same, so each distinct pair is counted once, times how often it occurs.
    With `profile` (:func:`_profile_of`, read from a sample of the attention's rows),
    problems on the compiled solver are priced by ``attnflow._flow_cost``; without it (and
    on the closed forms and igraph), from shapes alone.
    """
    n = layout.n_tokens
    row_list = np.asarray(rows.positions(n), dtype=np.intp)
    if mask is None:
        n_valid = np.array([n], dtype=np.int64)
        n_rows = np.array([row_list.size], dtype=np.int64)
        counts = np.array([math.prod(layout.batch_shape)], dtype=np.int64)
    else:
        flat = mask.reshape(-1, n)
        # (real tokens, real rows) of each sequence as one code, counted by bincount.
        codes = np.count_nonzero(flat, axis=1) * (row_list.size + 1)
        codes += np.count_nonzero(flat[:, row_list], axis=1)
        tally = np.bincount(codes)
        present = np.flatnonzero(tally)
        counts = tally[present].astype(np.int64)
        n_valid, n_rows = np.divmod(present.astype(np.int64), row_list.size + 1)
    copies = counts * ((layout.n_heads or 1) if each_head else 1)
    tops = range(1, used_layers + 1) if all_layers else [used_layers]
    max_flows, largest, visits, seconds = 0, 0, 0.0, 0.0
    for top in tops:
        pairs = n_rows * n_valid
        edges = layered_graph_edges(top, n_rows, n_valid)
        if profile is not None and flow_path(top) == "kernel":
            per_task = np.array(
                [
                    SECONDS_PER_TASK
                    + kernel_task_seconds(
                        profile,
                        top,
                        np.minimum(row_list[:r], max(v - 1, 0)),
                        int(v),
                        push_relabel=push_relabel_fits(top, int(v)),
                    )
                    for r, v in zip(n_rows.tolist(), n_valid.tolist(), strict=True)
                ]
            )
        else:
            per_task = np.asarray(_solve_seconds(top, n_rows, n_valid), dtype=np.float64)  # type: ignore[arg-type]
        max_flows += int(np.sum(pairs * copies))
        largest = max(largest, int(edges.max(initial=0)))
        visits += float(np.sum(pairs.astype(np.float64) * edges * copies))
        seconds += float(np.sum(np.where(pairs > 0, per_task, 0.0) * copies))
    entries = float(np.sum(counts * n_valid.astype(np.float64) ** 2)) * used_layers
    if profile is None:
        seconds += entries * (layout.n_heads or 1) * SECONDS_PER_INPUT_ENTRY
    else:
        raw = (layout.n_heads or 1) * SECONDS_PER_RAW_ENTRY
        seconds += entries * (raw + SECONDS_PER_FUSED_ENTRY)
    return FlowCost(max_flows, largest, visits, seconds)


def _cost_of(
    prepared: PreparedAttention, mask: np.ndarray | None, *, decided_below: float = 0.0
) -> FlowCost:
    """Estimate a prepared call's work from a profile of its fused attention.

    Where the estimate for the dearest attention of these shapes (every pair solved to
    completion, `DEAREST`) is at most `decided_below`, that bound is returned instead,
    without a profile: a caller that only compares the estimate with thresholds at or
    above it decides the same.
    """
    options: dict[str, Any] = {
        "used_layers": prepared.fused.shape[-3],
        "all_layers": prepared.all_layers,
        "rows": prepared.rows,
        "each_head": prepared.per_head is not None,
        "mask": mask,
    }
    if decided_below > 0:
        dearest = _cost(prepared.layout, **options, profile=dearest_profile(options["used_layers"]))
        if dearest.estimated_seconds <= decided_below:
            return dearest
    n = prepared.layout.n_tokens
    sample = profile_rows(n)
    chosen = _profiled_sequences(prepared.layout.batch_shape)
    xp = prepared.xp
    index = tuple(sample.tolist())
    # (sequences, L, rows, n): rows taken before anything is stacked.
    rows_of = xp.stack([_sampled_rows(prepared.fused[(*item, ...)], index, xp) for item in chosen])
    profile = graph_profile(to_host(rows_of), sample)
    return _cost(prepared.layout, **options, profile=profile)


def _sampled_rows(matrices: Any, index: tuple[int, ...], xp: Namespace) -> Any:
    """Rows `index` (axis -2) of ``(..., n, n)`` matrices: one gather for NumPy input."""
    if isinstance(matrices, np.ndarray):
        return matrices[..., list(index), :]
    return take_rows(matrices, index, xp)


def _profiled_sequences(batch_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Batch indices of the sequences the profile reads: `PROFILE_SEQUENCES`, evenly spaced."""
    total = math.prod(batch_shape)
    flat = np.unique(np.linspace(0, total - 1, min(total, PROFILE_SEQUENCES)).round())
    return [tuple(int(i) for i in np.unravel_index(int(f), batch_shape)) for f in flat]


def _profile_of(checked: CheckedArguments) -> GraphProfile:
    """Profile the attention of checked arguments from a sample of its rows.

    No whole layer is fused: the sampled rows of each used layer of a few sequences
    (`PROFILE_SEQUENCES`), masked and with heads fused as the call fuses them (a callable
    fusion is profiled by the mean).
    """
    xp = checked.xp
    n = checked.layout.n_tokens
    sample = profile_rows(n)
    index = tuple(sample.tolist())
    chosen = _profiled_sequences(checked.layout.batch_shape)
    # (sequences, L, [H,] rows, n): the batch reduced to the chosen sequences.
    layers = [
        xp.stack([_sampled_rows(checked.layer(i)[(*item, ...)], index, xp) for item in chosen])
        for i in range(checked.used_layers)
    ]
    stacked = xp.stack(layers, axis=1)
    if checked.mask is not None:
        # Padded keys and queries carry nothing, as in the prepared layers.
        mask = xp.stack([checked.mask[(*item, ...)] for item in chosen])  # (sequences, n)
        extra = [1] * (stacked.ndim - 3)  # layers (and heads) between batch and tokens
        keys = xp.reshape(mask, (len(chosen), *extra, 1, n))
        sampled_mask = xp.stack([mask[:, row] for row in index], axis=-1)
        queries = xp.reshape(sampled_mask, (len(chosen), *extra, len(index), 1))
        stacked = xp.where(keys & queries, stacked, xp.zeros_like(stacked))
    spec = checked.spec
    if spec.kind not in {"none", "mean", "each", "weights", "max", "min"}:
        spec = replace(spec, kind="mean")
    fused = apply_head_fusion(stacked, spec, xp, check=False)
    return graph_profile(np.nan_to_num(to_host(fused)), sample)


def _check_flow_options(
    n_jobs: object,
    executor: object,
    progress: object,
    normalize_result: object,
    max_seconds: object,
    max_work: object,
) -> None:
    if not isinstance(normalize_result, bool):
        msg = f"`normalize_result` must be True or False; got {normalize_result!r}."
        raise TypeError(msg)
    if max_work is MISSING:
        check_max_seconds(max_seconds)
    elif max_work is not None and (
        # `not > 0`, not `<= 0`: NaN compares false both ways and would disable the limit.
        isinstance(max_work, bool) or not isinstance(max_work, int | float) or not max_work > 0
    ):
        msg = (
            "`max_work` must be a positive number or None (edge visits; inf or None for no "
            f"limit); got {max_work!r}."
        )
        raise ValueError(msg)
    if executor is not None and n_jobs is not None:
        msg = (
            f"pass either `executor` or `n_jobs`, not both; got n_jobs={n_jobs!r} and an "
            "executor. The executor decides how many workers run."
        )
        raise ValueError(msg)
    if executor is not None and not isinstance(executor, Executor):
        msg = (
            "`executor` must be a concurrent.futures.Executor (a ProcessPoolExecutor, or "
            "`distributed.Client(...).get_executor()` for a Dask cluster); got "
            f"{type(executor).__name__}."
        )
        raise TypeError(msg)
    check_n_jobs(n_jobs)  # any integer scalar (np.int64 too), not a bool
    if not isinstance(progress, bool):
        msg = f"`progress` must be True or False; got {progress!r}."
        raise TypeError(msg)
    if progress and importlib.util.find_spec("tqdm") is None:
        msg = "`progress=True` needs tqdm: `pip install tqdm` (or `attnflow[progress]`)."
        raise ImportError(msg)


def _worker_count(n_jobs: int | None, cost: FlowCost) -> int:
    cores = os.cpu_count() or 1
    if n_jobs == -1:
        return cores
    if n_jobs is None:
        # Threads start in microseconds, but splitting a task repeats its arc ordering:
        # worth it from a few tens of milliseconds of work.
        return cores if cost.estimated_seconds > THREADS_FROM_SECONDS else 1
    # The work is CPU-bound: threads beyond the cores only compete for them.
    return min(n_jobs, cores)


def _progress_bar(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm  # available: checked with the other options

    return tqdm(total=total, unit="max-flow", desc="attention flow")


def _collect(values: np.ndarray, results: Iterator[tuple[FlowTask, np.ndarray]]) -> None:
    """Write each task's max-flows into `values`, where the task says they go."""
    for task, result in results:
        where = (*task.index, *np.ix_(task.positions, task.sinks))
        values[where] = result  # type: ignore[index]


def _run(
    tasks: Sequence[FlowTask], workers: int, executor: Executor | None, bar: Any
) -> Iterator[tuple[FlowTask, np.ndarray]]:
    """Solve every task, serially or on an executor, yielding results as they come."""
    if executor is None and workers == 1:
        for task in tasks:
            result = solve_flow_task(task)
            if bar is not None:
                bar.update(task.n_maxflows)
            yield task, result
        return
    own = executor is None
    if executor is None:
        # The compiled solver releases the GIL: threads share the work without starting
        # processes or copying the attention (the igraph fallback holds the GIL, so it
        # gains nothing from them, and loses nothing either).
        executor = ThreadPoolExecutor(
            max_workers=max(1, min(workers, len(tasks))), thread_name_prefix="attnflow"
        )
    try:
        futures: dict[Future[np.ndarray], FlowTask] = {
            executor.submit(solve_flow_task, task): task for task in tasks
        }
        for future in as_completed(futures):
            task = futures[future]
            if bar is not None:
                bar.update(task.n_maxflows)
            try:
                result = future.result()
            except BrokenProcessPool:
                msg = lost_workers_message(
                    "attention flow", serial_hint="pass `n_jobs` instead of a process pool"
                )
                raise WorkersLostError(msg) from None
            yield task, result
    finally:
        if own:
            executor.shutdown(cancel_futures=True)


def flow_cost(
    attentions: Any,
    /,
    *,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    mask: Any | None = None,
    heads: HeadFusion = "mean",
    xp: Namespace | None = None,
) -> FlowCost:
    """Estimate the work of :func:`flow` on these arguments, without solving anything.

    Parameters
    ----------
    attentions : array or sequence of arrays
        As for :func:`flow`. Besides the shapes, a sample of rows of each used layer is
        read (16, evenly spaced, of up to 8 sequences; heads fused as :func:`flow` fuses them): whether the
        attention is causal, how dense it is and how far each layer moves flow, which
        decides how hard the max-flows are. Nothing else is computed.
    rows : int, sequence of int or None, default None
        Output positions, as for :func:`flow`.
    layers : {"last", "all"} or int, default "last"
        Reported layer(s), as for :func:`flow`.
    mask : bool array of shape ``(*batch, n)``, optional
        Padding mask, as for :func:`flow`: padded tokens need no max-flow.
    heads : {"mean", "max", "min", "each"}, callable, array_like or None, default "mean"
        Head fusion, as for :func:`flow` (None for fused input, which changes the layout;
        ``"each"`` solves every problem once per head). Pruning (`threshold`, `top_k`,
        `discard` of :func:`flow`) only removes edges, so the estimate bounds it too.
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    FlowCost
        The number of max-flow problems, the largest graph, the total edge visits and a
        single-core time: the estimate that :func:`flow`'s `max_seconds` reads.

    See Also
    --------
    flow : Runs it.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> w = np.full((12, 12, 197, 197), 1 / 197)  # a ViT-B/16: 12 layers, 12 heads
    >>> cost = attnflow.flow_cost(w, rows=0)
    >>> cost.max_flows, cost.largest_graph_edges
    (197, 388484)
    """
    checked = check_arguments(
        attentions,
        heads=heads,
        residual=0.5,
        rows=real_end_union(mask, rows),  # the rows flow solves for this batch
        layers=layers,
        mask=mask,
        validate=False,
        xp=xp,
        allow_each=True,
    )
    return _cost(
        checked.layout,
        used_layers=checked.used_layers,
        all_layers=checked.all_layers,
        rows=checked.rows,
        each_head=checked.spec.kind == "each",
        mask=_host_mask(checked.mask),
        profile=_profile_of(checked),
    )


@from_real_end(host=True)
def flow(
    attentions: ArrayT | Sequence[ArrayT],
    /,
    *,
    heads: HeadFusion = "mean",
    residual: float = 0.5,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    mask: Any | None = None,
    threshold: float | None = None,
    top_k: int | None = None,
    discard: float | None = None,
    receptive_field: bool = False,
    exclude: int | Sequence[int] | None = None,
    normalize_result: bool = True,
    normalize_layers: bool = False,
    n_jobs: int | None = None,
    executor: Executor | None = None,
    progress: bool = False,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
    validate: bool | Literal["heads"] = True,
    normalize: bool | Missing = MISSING,
    renormalize: bool | Missing = MISSING,
    max_work: float | Missing | None = MISSING,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Attention flow: the max-flow from each output position to each input token.

    The attention graph has a node per token and layer; an edge runs from token
    :math:`k` at layer :math:`l` to token :math:`m` at layer :math:`l - 1` with capacity
    :math:`\tilde A_l[k, m]`, where :math:`\tilde A_l = (1 - \alpha) A_l + \alpha I` is the
    residual-mixed, head-fused attention (Abnar & Zuidema 2020, §3). The flow of output
    position :math:`i` at layer :math:`l` to input token :math:`j` is the value of the
    maximum flow from node :math:`(l, i)` to node :math:`(0, j)`:

    .. math::

        F_l[i, j] = \operatorname{maxflow}\bigl((l, i) \to (0, j)\bigr), \qquad
        \hat F_l[i, j] = F_l[i, j] \,/\, \textstyle\sum_{j'} F_l[i, j'] .

    With ``normalize_result=True`` (the paper's code) each output row is divided by its sum. At
    the first layer flow equals rollout equals :math:`\tilde A_1`.

    With ``heads="each"`` (Abnar & Zuidema 2020, Appendix A.1) head :math:`k` of layer
    :math:`i` gets its own graph: layers :math:`1 .. i-1` are the head-fused (mean) layers
    :math:`\tilde A_l`, layer :math:`i` is :math:`\tilde A_{i,k} = (1 - \alpha) W_{i,k} +
    \alpha I` alone. Max-flow is concave in the capacities (a minimum over cuts of
    capacity sums), so the mean over heads of the raw head flows is at most the fused raw
    flow, with equality at the first layer, where each head's flow is
    :math:`\tilde A_{1,k}`.

    `threshold`, `top_k` and `discard` prune the capacities exactly as :func:`rollout`
    prunes its layers (rows renormalised, so every row of capacities still sums to one);
    pruned edges leave the graph.

    For decoders, ``receptive_field=True`` divides by the flow :math:`B` of uniform causal
    attention (same residual, mask, rows, layers and pruning; solved once per distinct
    mask pattern of the batch) and `exclude` drops attention-sink columns, rows then
    renormalised, exactly as for :func:`rollout` (Abnar & Zuidema 2020, Conclusion):
    :math:`\hat F[i, j] \propto [j \notin E] \, F[i, j] / B[i, j]`, with :math:`x / 0 := 0`.

    Parameters
    ----------
    attentions : array or sequence of arrays
        Attention probabilities, as for :func:`rollout`.
    heads : {"mean", "max", "min", "each"}, callable, array_like or None, default "mean"
        Head fusion, as for :func:`rollout`; ``"each"`` gives one flow per head of the
        reported layer(s), the layers below fused by the mean (see above).
    residual : float, default 0.5
        The weight :math:`\alpha` of the identity, as for :func:`rollout`.
    rows : int, sequence of int or None, default None
        Output positions to explain (None: all, the full matrix); negative ones count from
        each sequence's last real token where `mask` is given, as for :func:`rollout`.
        Each position costs one max-flow per input token.
    layers : {"last", "all"} or int, default "last"
        The layer(s) whose flow is reported, as for :func:`rollout`. Layers above are
        never built.
    mask : bool array of shape ``(*batch, n)``, optional
        Padding mask, as for :func:`rollout`: padded tokens are removed from the graph and
        get exactly zero flow.
    threshold : float, optional
        Drop fused attention weights below this value, as for :func:`rollout`.
    top_k : int, optional
        Keep the `top_k` largest capacities of each row of every layer, as for
        :func:`rollout`.
    discard : float, optional
        Drop this fraction of each fused layer's lowest eligible weights (never column 0,
        never padding), as for :func:`rollout`. At most one of `threshold`, `top_k` and
        `discard`.
    receptive_field : bool, default False
        Decoders: divide by the flow of uniform causal attention, then renormalise rows,
        as for :func:`rollout`. The baseline costs one more flow per distinct mask
        pattern (not counted by `max_work`).
    exclude : int or sequence of int, optional
        Input positions left out of the attribution (attention sinks), rows renormalised,
        as for :func:`rollout`; they stay in the graph.
    normalize_result : bool, default True
        Divide each row of the result (each output position's attribution) by its sum, as
        the paper's code does (``normalize`` before 0.1). False returns the raw max-flow
        values, each at most 1. With `receptive_field` or `exclude` rows are
        always renormalised (the row scale cancels in the division).
    normalize_layers : bool, default False
        Divide each row of every layer's input matrix by its sum before building the
        graph (``renormalize`` before 0.1),
        instead of requiring rows that sum to one, as for :func:`rollout` (value-aware
        token-mixing matrices from :func:`contributions`, ``heads=None``).
    n_jobs : int, optional
        Threads on this machine: None chooses (all cores when the work is estimated
        above about 0.05 s, else one), -1 is one per core, 1 runs serially; more than the
        cores is capped at the cores. The compiled solver releases the GIL, so threads
        run side by side with no process to start and nothing to copy. Problems are cut
        into tasks of about half a second at most, so the progress bar moves and Ctrl-C
        stops a run within about a second.
    executor : concurrent.futures.Executor, optional
        Run the max-flow tasks on this executor instead, for example a Dask cluster's
        (``distributed.Client(...).get_executor()``) or a ``ProcessPoolExecutor`` (in
        scripts, call flow under ``if __name__ == "__main__":``, as for any process
        pool). Tasks hold one sequence each.
    progress : bool, default False
        Show a progress bar (tqdm) counting max-flows.
    max_seconds : float or None, default 600
        Refuse to start when the estimated single-core time of the compiled engine
        (:func:`flow_cost`'s ``estimated_seconds``) is larger; None removes the limit.
    validate : bool or "heads", default True
        Check the attention values first, as for :func:`rollout`.
    normalize, renormalize : bool, optional
        Deprecated spellings of `normalize_result` and `normalize_layers`, kept for one
        release (a DeprecationWarning).
    max_work : float or None, optional
        Deprecated: the limit in edge visits (max-flows times graph edges) of the old
        igraph engine, kept with its meaning for one release (a DeprecationWarning); given,
        it replaces `max_seconds`.
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    array
        Same shapes as :func:`rollout` (a heads axis after the layers axis with
        ``heads="each"``), in the library, dtype and device of `attentions`.

    Raises
    ------
    ValueError
        On bad input (as for :func:`rollout`), or when the work exceeds `max_work`.
    TypeError
        On bad option types, or attentions without values (inside ``jax.jit``).

    See Also
    --------
    rollout : The same question answered by products of matrices, in microseconds.
    flow_cost : The work of a call, before running it.

    Notes
    -----
    Flow runs on the host: the head-fused attention is copied to the CPU once (float64),
    the max-flow problems are solved by attnflow's compiled solver (igraph where it was
    not built), and the result is copied back to the caller's library, dtype and device. It is not differentiable (torch tensors are
    detached) and cannot run inside ``jax.jit``.

    The graph is reduced exactly: layers above the requested one are never built, and
    for a given input token the other input tokens (dead ends) collapse into one sink,
    so one graph per sequence and layer serves every (source, sink) pair. Each max-flow
    is found by augmenting paths (Dinic's blocking flows, strongest arcs first) that stop
    as soon as the flow reaches an upper bound from the graph unfolded into trees, within
    1e-13: the bound is then the max-flow. Where the bound is not reached the solver runs
    to completion, and its flow is the max-flow. Every value is therefore exact to
    floating-point rounding; on real attention nearly every pair stops at the bound after
    one blocking flow. Pruning runs on the host too, in float64, after the one copy.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928; Appendix A.1 for head-specific maps.
    .. [2] J. Gildenblat, "Explainability for Vision Transformers" (vit-explain),
       https://github.com/jacobgil/vit-explain: ``discard_ratio``.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> w = np.array([[[[0.5, 0.5], [0.0, 1.0]]], [[[1.0, 0.0], [0.5, 0.5]]]])  # L=2, H=1
    >>> attnflow.flow(w, normalize_result=False)
    array([[0.75, 0.25],
           [0.25, 1.  ]])
    >>> attnflow.flow(w)
    array([[0.75, 0.25],
           [0.2 , 0.8 ]])

    One flow per head of the top layer (here one head: the fused flow itself), and
    capacities pruned to the largest of each row:

    >>> attnflow.flow(w, heads="each", rows=1)
    array([[0.2, 0.8]])
    >>> attnflow.flow(w, top_k=1)
    array([[1., 0.],
           [0., 1.]])

    Decoders: flow of uniform causal attention, divided by itself, is uniform over each
    row's receptive field; a BOS sink is left out with ``exclude=0``:

    >>> u = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    >>> causal = np.stack([u, u])[:, None]  # L=2, H=1
    >>> attnflow.flow(causal, rows=-1).round(4)
    array([0.3333, 0.2222, 0.4444])
    >>> attnflow.flow(causal, rows=-1, receptive_field=True)
    array([0.33333333, 0.33333333, 0.33333333])
    >>> attnflow.flow(causal, rows=-1, receptive_field=True, exclude=0)
    array([0. , 0.5, 0.5])
    """
    normalize_result = renamed_keyword(
        "normalize", "normalize_result", normalize, normalize_result, default=True
    )
    normalize_layers = renamed_keyword(
        "renormalize", "normalize_layers", renormalize, normalize_layers, default=False
    )
    max_work = deprecated_max_work(max_work, max_seconds)
    _check_flow_options(n_jobs, executor, progress, normalize_result, max_seconds, max_work)
    prepared = prepare_attention(
        check_arguments(
            attentions,
            heads=heads,
            residual=residual,
            rows=rows,
            layers=layers,
            mask=mask,
            validate=validate,
            xp=xp,
            allow_each=True,
            threshold=threshold,
            top_k=top_k,
            discard=discard,
            receptive_field=receptive_field,
            exclude=exclude,
            normalize_layers=normalize_layers,
        )
    )
    # The mask's one copy to the host, (*batch, n) bool: from here on `mask` is this copy,
    # read by the cost, the capacities, the plan and the causal baseline.
    mask = _host_mask(prepared.mask)
    # The estimate decides two things: refusing (above `max_seconds`) and threads (above
    # `THREADS_FROM_SECONDS`). Where even the dearest attention of these shapes stays
    # below both, the decisions are known without profiling it (small calls).
    limit = max_seconds if max_work is MISSING and max_seconds is not None else math.inf
    estimate = _cost_of(prepared, mask, decided_below=min(limit, THREADS_FROM_SECONDS))
    fix = (
        "Explain fewer output positions (`rows=0` for a CLS token), stop at a lower layer "
        "(`layers=`), spread the work over a cluster (`executor=`), or pass "
    )
    if max_work is MISSING:
        refuse_above(
            estimate.estimated_seconds,
            str(estimate),
            max_seconds,
            what="this attention flow",
            fix=fix + "`max_seconds=None` to run it anyway.",
        )
    elif isinstance(max_work, int | float) and estimate.edge_visits > max_work:
        msg = (
            f"this attention flow would take {estimate}, above `max_work`={max_work:.3g}. "
            + fix
            + "`max_work=None` to run it anyway."
        )
        raise ValueError(msg)

    # The one host hop: fused attention (and the reported heads) to float64 NumPy,
    # pruned and mixed there; results back at the end.
    host = to_host(prepared.fused)
    # Head fusion computed `prepared.fused` afresh (a mean, a weighted sum or renormalised
    # rows: never the caller's array), and only its shape and kind are read after this: the
    # residual may be mixed into it in place (one (L, n, n) float64 array fewer).
    # One head fused by the mean is a view of the caller's head (see `apply_head_fusion`):
    # owned only where the host array holds its own data.
    owned = (
        prepared.layout.n_heads is not None
        and host.flags.writeable
        and (prepared.layout.n_heads > 1 or host.flags.owndata)
    )
    mixed = _capacities(prepared, host, mask, head_axis=False, in_place=owned)
    mixed_heads = None
    if prepared.per_head is not None:
        heads_on_host = to_host(prepared.per_head)
        mixed_heads = _capacities(prepared, heads_on_host, mask, head_axis=True)
    # Unvalidated NaN or infinite capacities: solve on the finite ones, NaN out after.
    mixed, mixed_heads, nan_out = clear_non_finite(
        mixed,
        mixed_heads,
        rows=prepared.rows.index,
        all_layers=prepared.all_layers,
        whole_rows=normalize_result or prepared.receptive_field or bool(prepared.exclude),
    )

    workers = _worker_count(n_jobs, estimate)
    if executor is not None:
        workers = max(workers, 2)  # split work finely enough for the executor's workers
    plan = _plan(prepared, mixed, mask, mixed_heads=mixed_heads, workers=workers)
    values = np.zeros(plan.output_shape)
    bar = _progress_bar(progress, estimate.max_flows)
    try:
        _collect(values, _run(plan.tasks, workers, executor, bar))
    finally:
        if bar is not None:
            bar.close()
    if prepared.receptive_field or prepared.exclude:
        baseline = None
        if prepared.receptive_field:
            baseline = _causal_baseline(prepared, mask, workers, executor)
            if prepared.per_head is not None:
                baseline = baseline[..., None, :, :]  # every head of uniform attention alike
        values = np.asarray(
            normalize_attribution(
                values, baseline=baseline, exclude=prepared.exclude, xp=_numpy_namespace()
            )
        )
    elif normalize_result:
        totals = values.sum(axis=-1, keepdims=True)
        values = np.divide(values, totals, out=np.zeros_like(values), where=totals > 0)
    if nan_out is not None:
        values = np.where(nan_out, np.nan, values)
    values = prepared.rows.squeeze(values)
    result = from_host(values, like=prepared.fused, xp=prepared.xp)
    return prepared.boundary.restore(result)  # type: ignore[no-any-return]


def _capacities(
    prepared: PreparedAttention,
    host: np.ndarray,
    mask: np.ndarray | None,
    *,
    head_axis: bool,
    in_place: bool = False,
) -> np.ndarray:
    """Edge capacities ``Ã_l`` on the host: pruned as asked, residual mixed in.

    `mask` is the host mask ``(*batch, n)``, or None. With `in_place`, `host` is the
    caller's to overwrite (the result may be `host` itself).
    """
    keys = None  # the mask over keys, broadcast over layers, [heads,] and queries
    if mask is not None:
        keys = mask[..., None, None, None, :] if head_axis else mask[..., None, None, :]
    xp = _numpy_namespace()
    pruned, alpha = prune(host, prepared.pruning, xp, residual=prepared.residual, valid_keys=keys)
    if alpha in (0.0, 1.0):
        return np.asarray(mix_residual(pruned, alpha, xp, valid_keys=keys))
    # mix_residual's (1 - α) Ã + α I with one temporary instead of three (the graph of a
    # long context is large): the same float operations, so the same values.
    # Pruning returns a new array or `host` itself (nothing pruned).
    writable = in_place if pruned is host else True
    mixed = np.multiply(pruned, 1.0 - alpha, out=pruned if writable else None)
    diagonal = np.einsum("...ii->...i", mixed)  # a writeable view
    identity = np.float64(alpha) if keys is None else np.where(keys[..., 0, :], alpha, 0.0)
    diagonal += identity
    return np.asarray(mixed)


def _causal_baseline(
    prepared: PreparedAttention,
    mask: np.ndarray | None,
    workers: int,
    executor: Executor | None,
) -> np.ndarray:
    """Raw flow of uniform causal attention, ``(*batch, [L,] r, n)``, for `receptive_field`.

    Same residual, rows, layers and pruning as the call; solved once per distinct mask
    of the batch (once in all without a mask), on the call's workers, then spread
    back. `mask` is the host mask ``(*batch, n)``, or None.
    """
    layout = prepared.layout
    n = layout.n_tokens
    # The baseline's batch: one sequence per distinct mask, its mask then (count, n).
    if mask is None:
        count = 1
        inverse = np.zeros(layout.batch_shape, dtype=np.int64)
    else:
        mask, inverse = np.unique(mask.reshape(-1, n), axis=0, return_inverse=True)
        count = len(mask)
        inverse = inverse.reshape(layout.batch_shape)
    uniform = np.asarray(
        uniform_causal_attention(
            n,
            valid_keys=None if mask is None else mask[:, None, None, :],
            dtype=np.float64,
            device="cpu",
            xp=_numpy_namespace(),
        )
    )
    uniform = np.broadcast_to(uniform, (count, prepared.fused.shape[-3], n, n))
    plain = replace(
        prepared,
        layout=replace(layout, batch_shape=(count,)),
        fused=uniform,
        per_head=None,
        mask=None,
    )
    mixed = _capacities(plain, uniform, mask, head_axis=False)
    plan = _plan(plain, mixed, mask, workers=workers)
    values = np.zeros(plan.output_shape)
    _collect(values, _run(plan.tasks, workers, executor, None))
    return values[inverse]


def _host_mask(mask: Any | None) -> np.ndarray | None:
    """Copy the checked padding mask ``(*batch, n)`` to a bool NumPy array (None stays None).

    Flow's one copy of the mask to the host: the cost, the capacities, the plan and the
    causal baseline all read this array.
    """
    if mask is None:
        return None
    return to_host(mask, name="mask", keep_dtype=True).astype(bool, copy=False)


def _numpy_namespace() -> Namespace:
    from ._namespace import numpy_namespace

    return numpy_namespace()
