"""Benchmark of attention flow: attnflow against the paper's code and a per-pair igraph loop.

What is measured
----------------
Random row-stochastic attention (softmax of standard-normal logits, float64) of shape
``(layers, heads, n, n)`` with 12 heads (``--heads``), mixed with the residual as in the
paper, ``Ã_l = 0.5 mean_h W_l + 0.5 I``. Every case computes the flow of the CLS token
(output position 0 at the top layer) to each of the ``n`` input tokens, except where the
full matrix is named. Two sizes: the paper's (``L=6``, ``n=32``) and a large one, by
default a ViT-B/16 at 224 px (``L=12``, ``n=197``: 196 patches and the CLS token;
``--layers``, ``--tokens``; ``--quick`` uses ``L=12``, ``n=64``).

Unlike the baselines, attnflow's time depends on the attention values, not only on the
shapes: where cheap bounds certify a max-flow it skips the full graph. Random softmax
attention is a favourable case for that; attention with strong bottlenecks inside the
graph costs more (up to the full-graph time). The figures are for this input only.

1. The paper's method against attnflow, at the paper's size. The paper's method is
   written here, independently of attnflow, after ``attention_graph_util.py`` of
   samiraabnar/attention_flow (``get_adjmat`` and ``compute_node_flow``): the full layered
   networkx ``DiGraph`` of ``(L+1) n`` nodes (every layer, every token) with capacities
   ``Ã_l``, then ``networkx.maximum_flow_value(G, u, v, flow_func=edmonds_karp)`` for
   each (CLS, input token) pair, then the row divided by its sum. The paper sets the
   capacities with one ``nx.set_edge_attributes`` call per matrix cell; here
   ``nx.from_numpy_array(..., edge_attr="capacity")`` builds the same graph faster, so
   the paper's method is timed slightly in its favour. It runs once (about 0.2 s per
   pair); ``--paper-pairs k`` times the first ``k`` pairs only and extrapolates the
   max-flow time linearly to all ``n`` pairs (the output says so). Against
   ``attnflow.flow(a, rows=0, n_jobs=1)``: the speed-up (goal: at least 1000x) and the
   largest difference between the two results (they must agree to 1e-8).
2. A plain per-pair igraph loop against attnflow, at both sizes: the full layered graph
   built once with igraph, the capacities as an edge attribute, and
   ``Graph.maxflow_value(u, v, capacity="capacity")`` per (CLS, input token) pair, with
   none of attnflow's reductions. Times, ratio and agreement.
3. attnflow alone: the ViT-B/16 CLS row serially (``n_jobs=1``), on worker processes
   (``n_jobs=2`` and ``n_jobs=-1``; each call starts its own pool, which is part of the
   time) and with the default ``n_jobs=None`` (attnflow chooses from its cost estimate),
   the paper-size CLS row and full matrix (``rows=None``), each next to the
   estimate of ``attnflow.flow_cost`` (a rough single-core figure). Goal: the ViT-B/16
   CLS row in at most 2 s on a 2-core machine.

Timing: :func:`time.perf_counter`. The paper-size cases are warmed up, then timed in
``--repeats`` interleaved rounds, each round running each case in a loop of at least
0.2 s; the ViT-size cases (seconds each) are not warmed up and run in interleaved rounds
until ``--repeats`` rounds or, after the first round, ``--budget`` seconds. Tables give
medians and minima. The first attnflow call of the process (which imports igraph) is
reported on its own. This script prints figures from one run and asserts nothing about
timings: on a shared or busy machine they are noisy.

How to run
----------
From the repository root, with attnflow, networkx and igraph installed::

    python benchmarks/scripts/bench_flow.py                  # about 2 minutes on 2 cores
    python benchmarks/scripts/bench_flow.py --quick          # small sizes, a smoke test for CI
    python benchmarks/scripts/bench_flow.py --paper-pairs 4  # time 4 networkx pairs, extrapolate
    python benchmarks/scripts/bench_flow.py --repeats 5 --budget 300

Options that only ``bench_rollout.py`` knows (``nox -s benchmark -- ...`` passes the same
ones to both scripts) are ignored with a note.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np

import attnflow

RESIDUAL = 0.5
ROW = 0  # the CLS token
AGREE = 1e-8
GOAL_SPEEDUP = 1000.0
GOAL_LARGE_SECONDS = 2.0
MIN_RUN_SECONDS = 0.2  # cheap cases run in a loop of at least this long per timing
JOB_LABELS = {"serial": "n_jobs=1", "two": "n_jobs=2", "all": "n_jobs=-1", "auto": "n_jobs=None"}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Config:
    """Sizes and options of one benchmark run."""

    heads: int
    paper_layers: int
    paper_tokens: int
    paper_pairs: int
    layers: int
    tokens: int
    repeats: int
    budget: float
    seed: int
    quick: bool

    @property
    def large_label(self) -> str:
        if (self.layers, self.tokens) == (12, 197):
            return "ViT-B/16"
        return f"L={self.layers}, n={self.tokens}"


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        description="Time attnflow.flow against the paper's networkx code and an igraph loop.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a CI smoke run")
    parser.add_argument(
        "--paper-pairs",
        type=int,
        help="(CLS, input) pairs of the paper's networkx method to time; fewer than n are "
        "extrapolated linearly to n (default: all 32; quick 2)",
    )
    parser.add_argument(
        "--layers", type=int, help="layers of the large case (default 12: ViT-B/16; quick 12)"
    )
    parser.add_argument(
        "--tokens", type=int, help="tokens of the large case (default 197: ViT-B/16; quick 64)"
    )
    parser.add_argument("--heads", type=int, default=12, help="heads H of every case (12)")
    parser.add_argument(
        "--repeats", type=int, help="timed rounds of the cases of each size (default 5; quick 3)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds of large-case rounds after which no new round starts; the first "
        "always runs (default 100; quick 10)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random attention")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"note: ignoring options this script does not take: {' '.join(unknown)}")

    paper_layers, paper_tokens = 6, 32
    defaults = (2, 12, 64, 3, 10.0) if args.quick else (paper_tokens, 12, 197, 5, 100.0)
    given = (args.paper_pairs, args.layers, args.tokens, args.repeats, args.budget)
    pairs, layers, tokens, repeats, budget = (
        d if g is None else g for g, d in zip(given, defaults, strict=True)
    )
    if min(pairs, layers, tokens, repeats, args.heads) < 1 or budget < 0:
        parser.error(
            "--paper-pairs, --layers, --tokens, --repeats and --heads must be >= 1 and "
            "--budget >= 0"
        )
    return Config(
        heads=args.heads,
        paper_layers=paper_layers,
        paper_tokens=paper_tokens,
        paper_pairs=min(int(pairs), paper_tokens),
        layers=int(layers),
        tokens=int(tokens),
        repeats=int(repeats),
        budget=float(budget),
        seed=args.seed,
        quick=args.quick,
    )


# --------------------------------------------------------------------------- data


def make_attention(layers: int, heads: int, tokens: int, seed: int) -> np.ndarray:
    """Row-stochastic float64 attention ``(L, H, n, n)``: softmax of standard-normal logits."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((layers, heads, tokens, tokens))
    logits -= logits.max(axis=-1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=-1, keepdims=True)
    return logits


def mix(attention: np.ndarray) -> np.ndarray:
    """The paper's capacities ``Ã_l = 0.5 mean_h W_l + 0.5 I``, shape ``(L, n, n)``."""
    n = attention.shape[-1]
    mixed: np.ndarray = (1 - RESIDUAL) * attention.mean(axis=1) + RESIDUAL * np.eye(n)
    return mixed


def normalise(values: np.ndarray) -> np.ndarray:
    """Each row divided by its sum, as the paper's code does."""
    normalised: np.ndarray = values / values.sum(axis=-1, keepdims=True)
    return normalised


# --------------------------------------------------------------------------- baselines


def paper_graph(mixed: np.ndarray) -> Any:
    """The paper's layered graph: ``(L+1) n`` nodes, every layer and token (``get_adjmat``).

    Node ``l n + k`` is token ``k`` of layer ``l`` (layer 0: the input tokens); an edge runs
    from token ``k`` of layer ``l`` to token ``m`` of layer ``l - 1`` with capacity
    ``Ã_l[k, m]``.
    """
    import networkx as nx

    layers, n, _ = mixed.shape
    size = (layers + 1) * n
    adjacency = np.zeros((size, size))
    for layer in range(1, layers + 1):
        adjacency[layer * n : (layer + 1) * n, (layer - 1) * n : layer * n] = mixed[layer - 1]
    return nx.from_numpy_array(adjacency, create_using=nx.DiGraph, edge_attr="capacity")


def paper_max_flows(graph: Any, layers: int, n: int, row: int, tokens: range) -> np.ndarray:
    """``compute_node_flow``: one Edmonds-Karp max-flow per (output, input token) pair."""
    import networkx as nx

    edmonds_karp = nx.algorithms.flow.edmonds_karp
    source = layers * n + row
    return np.array(
        [nx.maximum_flow_value(graph, source, v, flow_func=edmonds_karp) for v in tokens]
    )


def igraph_loop(mixed: np.ndarray, row: int) -> np.ndarray:
    """Raw flows from ``row`` at the top layer to every input: full igraph graph, one call a pair."""
    import igraph

    layers, n, _ = mixed.shape
    layer, k, m = np.nonzero(mixed > 0)
    edges = np.stack([(layer + 1) * n + k, layer * n + m], axis=1)
    graph = igraph.Graph(n=(layers + 1) * n, edges=edges.tolist(), directed=True)
    graph.es["capacity"] = mixed[layer, k, m].tolist()
    source = layers * n + row
    return np.array([graph.maxflow_value(source, token, capacity="capacity") for token in range(n)])


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    fn: Callable[[], np.ndarray]


@dataclass(frozen=True)
class Timing:
    """Median and minimum seconds per call, timed runs, and calls per timed run."""

    median: float
    minimum: float
    runs: int
    calls: int


def _run(fn: Callable[[], np.ndarray], calls: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    result = fn()
    for _ in range(calls - 1):
        result = fn()
    return (time.perf_counter() - start) / calls, result


def time_cases(
    cases: Sequence[Case], *, repeats: int, budget: float, warm_up: bool
) -> tuple[dict[str, Timing], dict[str, np.ndarray]]:
    """Time `cases` in interleaved rounds; return timings and each case's last result.

    With `warm_up`, each case runs once first, and cases faster than `MIN_RUN_SECONDS`
    are then timed as a loop of calls at least that long. Without it (cases of seconds),
    each timed run is one call. After the first round, no new round starts once `budget`
    seconds have gone by.
    """
    results: dict[str, np.ndarray] = {}
    calls = dict.fromkeys((case.key for case in cases), 1)
    if warm_up:
        for case in cases:
            elapsed, results[case.key] = _run(case.fn, 1)
            calls[case.key] = min(1000, max(1, math.ceil(MIN_RUN_SECONDS / max(elapsed, 1e-6))))
    times: dict[str, list[float]] = {case.key: [] for case in cases}
    start = time.perf_counter()
    for round_ in range(repeats):
        if round_ >= 1 and time.perf_counter() - start > budget:
            break
        for case in cases:
            elapsed, results[case.key] = _run(case.fn, calls[case.key])
            times[case.key].append(elapsed)
    timings = {
        key: Timing(statistics.median(runs), min(runs), len(runs), calls[key])
        for key, runs in times.items()
    }
    return timings, results


def fmt_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b)))


def verdict(diff: float) -> str:
    return f"agree, < {AGREE:g}" if diff < AGREE else f"DISAGREE, >= {AGREE:g}"


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class PaperRun:
    """The paper's networkx method on the first `pairs` pairs, timed once."""

    build: float
    flows: float
    pairs: int
    n: int
    edges: int
    raw: np.ndarray

    @property
    def flows_all(self) -> float:
        """Max-flow time for all `n` pairs (extrapolated linearly if fewer were run)."""
        return self.flows * self.n / self.pairs

    @property
    def total(self) -> float:
        return self.build + self.flows_all

    @property
    def extrapolated(self) -> bool:
        return self.pairs < self.n


def run_paper(mixed: np.ndarray, pairs: int) -> PaperRun:
    layers, n, _ = mixed.shape
    start = time.perf_counter()
    graph = paper_graph(mixed)
    built = time.perf_counter()
    raw = paper_max_flows(graph, layers, n, ROW, range(pairs))
    done = time.perf_counter()
    return PaperRun(built - start, done - built, pairs, n, graph.number_of_edges(), raw)


def print_paper_section(
    config: Config,
    paper: PaperRun,
    ours: Timing,
    first_call: float,
    raw_ours: np.ndarray,
    normalised_ours: np.ndarray,
) -> None:
    layers, n = config.paper_layers, config.paper_tokens
    print(
        f"\n1. The paper's method against attnflow: L={layers}, n={n}, H={config.heads}, "
        f"CLS row, residual {RESIDUAL}"
    )
    print(
        f"paper's method: networkx {metadata.version('networkx')} DiGraph of "
        f"{(layers + 1) * n} nodes and {paper.edges:,} edges, Edmonds-Karp per pair"
    )
    print(f"  graph build                            {fmt_seconds(paper.build):>10}")
    if paper.extrapolated:
        print(
            f"  {n} max-flows (EXTRAPOLATED)            {fmt_seconds(paper.flows_all):>10}"
            f"   linearly from {paper.pairs} of {n} pairs, measured "
            f"{fmt_seconds(paper.flows)} ({fmt_seconds(paper.flows / paper.pairs)} a pair)"
        )
    else:
        print(
            f"  {n} max-flows (measured, once)          {fmt_seconds(paper.flows_all):>10}"
            f"   ({fmt_seconds(paper.flows / paper.pairs)} a pair)"
        )
    total_note = "  (extrapolated)" if paper.extrapolated else ""
    print(f"  total                                  {fmt_seconds(paper.total):>10}{total_note}")
    print(
        f"attnflow.flow(a, rows=0, n_jobs=1): median {fmt_seconds(ours.median)}, "
        f"min {fmt_seconds(ours.minimum)} ({ours.runs} runs of {ours.calls} calls); "
        f"first call of the process {fmt_seconds(first_call)} (imports igraph)"
    )
    speedup = paper.total / ours.median
    status = "met" if speedup >= GOAL_SPEEDUP else "NOT met"
    basis = "extrapolated " if paper.extrapolated else ""
    print(
        f"speed-up: {speedup:,.0f}x ({basis}paper total / attnflow median; by minimum "
        f"{paper.total / ours.minimum:,.0f}x); goal >= {GOAL_SPEEDUP:,.0f}x: {status}"
    )
    raw_diff = max_diff(paper.raw, raw_ours[: paper.pairs])
    if paper.extrapolated:
        print(
            f"agreement: max |paper - attnflow| = {raw_diff:.1e} on the raw flows of the "
            f"{paper.pairs} pairs run ({verdict(raw_diff)}); the normalised row needs all "
            f"{n} pairs"
        )
    else:
        norm_diff = max_diff(normalise(paper.raw), normalised_ours)
        print(
            f"agreement: max |paper - attnflow| = {norm_diff:.1e} on the normalised row "
            f"({verdict(norm_diff)}), {raw_diff:.1e} on the raw flows"
        )


@dataclass(frozen=True)
class LoopRow:
    label: str
    layers: int
    n: int
    edges: int
    loop: Timing
    ours: Timing
    raw_diff: float
    norm_diff: float


def print_loop_section(rows: Sequence[LoopRow]) -> None:
    print("\n2. A plain per-pair igraph loop against attnflow.flow(a, rows=0, n_jobs=1), CLS row")
    print(
        "   (loop: full (L+1)n-node graph built once, capacities as an edge attribute, "
        "one maxflow_value per pair)"
    )
    header = (
        f"{'size':<16} {'L':>3} {'n':>4} {'graph edges':>11} {'max-flows':>9}  "
        f"{'loop median':>11} {'attnflow median':>15} {'loop/attnflow':>13}  "
        f"{'max |diff| raw':>14} {'normalised':>10} {'runs':>4}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.label:<16} {row.layers:>3} {row.n:>4} {row.edges:>11,} {row.n:>9}  "
            f"{fmt_seconds(row.loop.median):>11} {fmt_seconds(row.ours.median):>15} "
            f"{row.loop.median / row.ours.median:>12.2f}x  {row.raw_diff:>14.1e} "
            f"{row.norm_diff:>10.1e} {row.loop.runs:>4}"
        )
    worst = max(max(row.raw_diff, row.norm_diff) for row in rows)
    print(f"(loop/attnflow > 1: attnflow is faster; agreement: {verdict(worst)})")


@dataclass(frozen=True)
class AloneRow:
    label: str
    timing: Timing
    cost: attnflow.FlowCost


def print_alone_section(rows: Sequence[AloneRow]) -> None:
    print("\n3. attnflow alone, next to attnflow.flow_cost (a rough single-core estimate)")
    width = max(len(row.label) for row in rows)
    header = (
        f"{'case':<{width}}  {'median':>9} {'min':>9} {'runs':>4}  {'estimate':>9} "
        f"{'measured/est.':>13}  {'max-flows':>9} {'largest graph':>13} {'edge visits':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        t, cost = row.timing, row.cost
        print(
            f"{row.label:<{width}}  {fmt_seconds(t.median):>9} {fmt_seconds(t.minimum):>9} "
            f"{t.runs:>4}  {fmt_seconds(cost.estimated_seconds):>9} "
            f"{t.median / cost.estimated_seconds:>12.2f}x  {cost.max_flows:>9,} "
            f"{cost.largest_graph_edges:>13,} {cost.edge_visits:>11.3g}"
        )
    print("(largest graph: edges of attnflow's reduced graph, an upper bound; parallel calls")
    print(" include starting the worker processes; the estimate is for one core)")


# --------------------------------------------------------------------------- main


def print_machine(config: Config) -> None:
    print("attnflow flow benchmark")
    print(
        f"machine: {platform.platform()} ({platform.machine()}), "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    if hasattr(os, "getloadavg"):
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average (1, 5, 15 min): {load}  (timings are noisy on a busy machine)")
    threads = [f"{k}={os.environ[k]}" for k in THREAD_VARIABLES if k in os.environ]
    print("thread settings: " + (", ".join(threads) if threads else "library defaults"))
    versions = {
        "attnflow": attnflow.__version__,
        "numpy": np.__version__,
        "networkx": metadata.version("networkx"),
        "igraph": metadata.version("igraph"),
    }
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"attention: random softmax, float64, H={config.heads}, residual {RESIDUAL}, "
        f"CLS = output position {ROW}; paper size L={config.paper_layers}, "
        f"n={config.paper_tokens}; large size L={config.layers}, n={config.tokens}"
        + (" (ViT-B/16 at 224 px)" if config.large_label == "ViT-B/16" else "")
    )
    print(
        f"rounds: paper size up to {config.repeats} (warmed up, loops of >= "
        f"{MIN_RUN_SECONDS:g} s); large size up to {config.repeats}, no new round after "
        f"{config.budget:g} s"
    )
    if config.quick:
        print("quick mode: small sizes, for a smoke test; the goals refer to the full run")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    start = time.perf_counter()
    print_machine(config)

    # ---- paper size: the cold first call, then the cheap cases, then networkx once.
    small = make_attention(config.paper_layers, config.heads, config.paper_tokens, config.seed)
    small_mixed = mix(small)
    igraph_loaded = "igraph" in sys.modules
    first_call, _ = _run(lambda: attnflow.flow(small, rows=ROW, n_jobs=1), 1)
    if igraph_loaded:
        print("note: igraph was imported before the first flow call")
    small_cases = [
        Case("loop", "igraph loop", lambda: igraph_loop(small_mixed, ROW)),
        Case("cls", "attnflow CLS", lambda: attnflow.flow(small, rows=ROW, n_jobs=1)),
        Case(
            "cls-raw",
            "attnflow CLS raw",
            lambda: attnflow.flow(small, rows=ROW, n_jobs=1, normalize_result=False),
        ),
        Case("full", "attnflow full", lambda: attnflow.flow(small, n_jobs=1)),
    ]
    small_t, small_r = time_cases(
        small_cases, repeats=config.repeats, budget=math.inf, warm_up=True
    )
    print(
        f"\nrunning the paper's networkx method on {config.paper_pairs} of "
        f"{config.paper_tokens} pairs (once)...",
        flush=True,
    )
    paper = run_paper(small_mixed, config.paper_pairs)
    print_paper_section(
        config, paper, small_t["cls"], first_call, small_r["cls-raw"], small_r["cls"]
    )

    # ---- large size: seconds a case, interleaved rounds, no warm-up.
    large = make_attention(config.layers, config.heads, config.tokens, config.seed + 1)
    large_mixed = mix(large)
    cores = os.cpu_count() or 1
    large_cases = [
        Case("loop", "igraph loop", lambda: igraph_loop(large_mixed, ROW)),
        Case("serial", "n_jobs=1", lambda: attnflow.flow(large, rows=ROW, n_jobs=1)),
        Case("two", "n_jobs=2", lambda: attnflow.flow(large, rows=ROW, n_jobs=2)),
        Case("all", "n_jobs=-1", lambda: attnflow.flow(large, rows=ROW, n_jobs=-1)),
        Case("auto", "n_jobs=None", lambda: attnflow.flow(large, rows=ROW)),
    ]
    cost = attnflow.flow_cost(large, rows=ROW)
    print(
        f"\ntiming the {config.large_label} CLS row: igraph loop, attnflow n_jobs=1, 2, -1, None "
        f"(attnflow estimates {cost})...",
        flush=True,
    )
    large_t, large_r = time_cases(
        large_cases, repeats=config.repeats, budget=config.budget, warm_up=False
    )
    large_raw = attnflow.flow(large, rows=ROW, n_jobs=1, normalize_result=False)

    loop_rows = [
        LoopRow(
            "paper size",
            config.paper_layers,
            config.paper_tokens,
            int(np.count_nonzero(small_mixed)),
            small_t["loop"],
            small_t["cls"],
            max_diff(small_r["loop"], small_r["cls-raw"]),
            max_diff(normalise(small_r["loop"]), small_r["cls"]),
        ),
        LoopRow(
            config.large_label,
            config.layers,
            config.tokens,
            int(np.count_nonzero(large_mixed)),
            large_t["loop"],
            large_t["serial"],
            max_diff(large_r["loop"], large_raw),
            max_diff(normalise(large_r["loop"]), large_r["serial"]),
        ),
    ]
    print_loop_section(loop_rows)

    large_name = f"{config.large_label} CLS"
    alone = [
        AloneRow(f"{large_name}, n_jobs=1", large_t["serial"], cost),
        AloneRow(f"{large_name}, n_jobs=2", large_t["two"], cost),
        AloneRow(f"{large_name}, n_jobs=-1 ({cores} processes)", large_t["all"], cost),
        AloneRow(f"{large_name}, n_jobs=None (the default)", large_t["auto"], cost),
        AloneRow("paper size CLS, n_jobs=1", small_t["cls"], attnflow.flow_cost(small, rows=ROW)),
        AloneRow("paper size full matrix, n_jobs=1", small_t["full"], attnflow.flow_cost(small)),
    ]
    print_alone_section(alone)
    parallel_diff = max(max_diff(large_r[key], large_r["serial"]) for key in ("two", "all", "auto"))
    print(f"parallel against serial: max |diff| = {parallel_diff:.1e}")
    best_key = min(JOB_LABELS, key=lambda key: large_t[key].median)
    best = large_t[best_key].median
    status = "met" if best <= GOAL_LARGE_SECONDS else "NOT met"
    goal_note = "" if config.large_label == "ViT-B/16" else " (the goal is for ViT-B/16)"
    print(
        f"goal: {config.large_label} CLS row in <= {GOAL_LARGE_SECONDS:g} s on this "
        f"{cores}-core machine: best median {fmt_seconds(best)} "
        f"({JOB_LABELS[best_key]}): "
        f"{status}{goal_note}"
    )
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
