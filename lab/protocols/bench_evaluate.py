"""Benchmark of the faithfulness evaluation at the paper's size: sentences per second.

What is measured
----------------
The whole protocol of ``attnflow.evaluate.faithfulness`` on the synthetic subject-verb agreement
task with the paper's model (6 layers, 8 heads, hidden 128; PyTorch, CPU): per sentence
the prediction, the captured attention, raw attention, rollout and **flow at every
layer** for the ``[CLS]`` row, blank-out (one model call per chunk for all copies),
input gradients, the rank correlations and ERASER comprehensiveness and sufficiency at
every layer (each chunk's distinct inputs predicted once, shared by blank-out and the
ERASER metrics of every method). It runs on ``--sentences`` test sentences (default 2,000, the paper's
Tables 1-2), once serially (``n_jobs=1``) and once with flow on 2 worker processes
(``n_jobs=2``), in memory (no output folder), and once serially without the ERASER
metrics (``fractions=None``), which gives ERASER's share of the time. Then, with the AOPC metrics switched off
(``fractions=None``), the same with ``rows="max"``, which needs flow from every output
position (the paper's code's aggregation), on ``--max-sentences`` sentences.

Baseline, measured in the same run: the paper's own flow (networkx Edmonds-Karp on the
full layered graph, one max-flow per (CLS, token) pair, written independently after
``attention_graph_util.py``) at every layer on ``--paper-sentences`` sentences,
extrapolated linearly to ``--sentences``; the table gives attnflow's speed-up on flow.

The model: ``--model DIR`` (a folder from ``lab/scripts/train_agreement.py``); without it a
small model is trained first (3,000 sentences, 2 epochs; the timings of the evaluation
barely depend on how well it is trained, flow's a little through the attention's shape).

Wall time from :func:`time.perf_counter`; CPU time is this process's plus its finished
children's (the flow workers), from :func:`resource.getrusage`. Figures from one run;
nothing is asserted: on a shared machine they are noisy.

How to run
----------
From the repository root, with attnflow, torch and networkx installed::

    python lab/protocols/bench_evaluate.py --model agreement-model   # about 10 min on 2 cores
    python lab/protocols/bench_evaluate.py --quick                   # 200 sentences, smoke test

Options that only the other benchmark scripts know are ignored with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(function: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), _cpu()
    result = function()
    return result, time.perf_counter() - wall, _cpu() - cpu


def _paper_flow_row(mixed: np.ndarray, top: int) -> np.ndarray:
    """The paper's method: networkx Edmonds-Karp per (CLS, token) pair on the full graph."""
    import networkx as nx
    from networkx.algorithms.flow import edmonds_karp

    n = mixed.shape[-1]
    size = (top + 1) * n
    adjacency = np.zeros((size, size))
    for layer in range(1, top + 1):  # node (l, k) -> node (l - 1, m), capacity Ã_l[k, m]
        adjacency[layer * n : (layer + 1) * n, (layer - 1) * n : layer * n] = mixed[layer - 1]
    graph = nx.from_numpy_array(adjacency, create_using=nx.DiGraph, edge_attr="capacity")
    source = top * n
    values = np.array(
        [nx.maximum_flow_value(graph, source, m, flow_func=edmonds_karp) for m in range(n)]
    )
    return values / values.sum()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="folder from lab/scripts/train_agreement.py")
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--max-sentences", type=int, default=500)
    parser.add_argument("--paper-sentences", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="200 sentences: a smoke test")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"note: ignoring options for the other benchmarks: {' '.join(unknown)}")
    if args.quick:
        args.sentences, args.max_sentences, args.paper_sentences = 200, 50, 2

    import torch

    import attnflow
    from attnflow.adapters.torch import model_functions
    from attnflow_lab.agreement.agreement import agreement_split
    from attnflow_lab.agreement.agreement_torch import load_agreement_model, train_agreement_model

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), numpy {np.__version__}, attnflow {attnflow.__version__}"
    )
    if args.model is None:
        train, test = agreement_split(3000, args.sentences, seed=0)
        model, seconds, _ = _timed(
            lambda: train_agreement_model(train, seed=0, epochs=2, progress=False)
        )
        print(f"model: trained here on 3,000 sentences, 2 epochs ({seconds:.0f} s)")
    else:
        config = json.loads((Path(args.model) / "config.json").read_text())
        data = config["metadata"]["data"]
        train, test = agreement_split(data["n_train"], args.sentences, seed=data["seed"])
        model = load_agreement_model(args.model)
        print(f"model: {args.model} (trained on {data['n_train']:,} sentences)")
    functions = model_functions(model, reduce="sum_abs")
    lengths = test.mask.sum(axis=1)
    print(
        f"data: {args.sentences:,} test sentences, {lengths.mean():.1f} tokens on average "
        f"(max {lengths.max()}, padded to {test.ids.shape[1]})\n"
    )

    def evaluate(count: int, **options: Any) -> Any:
        return attnflow.evaluate.faithfulness(
            functions,
            test.ids[:count],
            replacement=test.replacement,
            targets=test.labels[:count],
            mask=test.mask[:count],
            **options,
        )

    rows = []
    serial, wall, cpu = _timed(lambda: evaluate(args.sentences, n_jobs=1))
    rows.append(("whole protocol, [CLS] row, serial", args.sentences, wall, cpu))
    parallel, wall2, cpu2 = _timed(lambda: evaluate(args.sentences, n_jobs=2))
    rows.append(("whole protocol, [CLS] row, flow on 2 processes", args.sentences, wall2, cpu2))
    same = all(
        np.array_equal(serial.samples[k], parallel.samples[k], equal_nan=True)
        for k in serial.samples
    )
    _, wall_rest, cpu_rest = _timed(lambda: evaluate(args.sentences, n_jobs=1, fractions=None))
    rows.append(
        (
            "whole protocol without ERASER (fractions=None), serial",
            args.sentences,
            wall_rest,
            cpu_rest,
        )
    )
    flow_only, wall3, cpu3 = _timed(
        lambda: evaluate(
            args.sentences, methods=["flow"], references=["blank_out"], fractions=None, n_jobs=1
        )
    )
    rows.append(("flow + blank-out only, [CLS] row, serial", args.sentences, wall3, cpu3))
    _, wall4, cpu4 = _timed(
        lambda: evaluate(args.max_sentences, rows="max", fractions=None, n_jobs=2)
    )
    rows.append(
        (
            'correlations only, rows="max" (flow from every row), 2 processes',
            args.max_sentences,
            wall4,
            cpu4,
        )
    )

    attentions = functions.attentions(
        test.ids[: args.paper_sentences], test.mask[: args.paper_sentences]
    )
    fused = attnflow.fuse_heads(attentions).numpy()
    paper_wall = time.perf_counter()
    for index in range(args.paper_sentences):
        n = int(test.mask[index].sum())
        mixed = 0.5 * fused[index, :, :n, :n] + 0.5 * np.eye(n)
        mixed /= mixed.sum(axis=-1, keepdims=True)
        for top in range(1, mixed.shape[0] + 1):
            expected = _paper_flow_row(mixed, top)
            got = flow_only.samples["scores.flow"][index, top - 1, :n]
            assert np.allclose(got, expected, atol=1e-8), (index, top)
    paper_seconds = (time.perf_counter() - paper_wall) / args.paper_sentences * args.sentences

    print(f"{'case':<68} {'sentences':>9} {'wall s':>8} {'CPU s':>8} {'sent/s':>8}")
    for name, count, w, c in rows:
        print(f"{name:<68} {count:>9,} {w:>8.1f} {c:>8.1f} {count / w:>8.1f}")
    print(
        f"{'paper: networkx flow at every layer (extrapolated from ' + str(args.paper_sentences) + ')':<68}"
        f" {args.sentences:>9,} {paper_seconds:>8.0f} {'':>8} {args.sentences / paper_seconds:>8.2f}"
    )
    print(
        f"\n2 processes / serial, wall: {wall2 / wall:.2f}; identical results: {same}. The "
        f"{args.sentences:,}-sentence table with flow at every layer: {wall2 / 60:.1f} min "
        f"(goal: under 10 min on 2 cores). Flow agrees with networkx to 1e-8 on "
        f"{args.paper_sentences} sentences x 6 layers; attnflow's flow + blank-out pass is "
        f"{paper_seconds / wall3:.0f}x faster than the paper's flow alone. ERASER "
        f"(comprehensiveness and sufficiency) costs {(cpu - cpu_rest) / cpu_rest:.2f}x the rest "
        f"of the serial run in CPU time, {(wall - wall_rest) / wall_rest:.2f}x in wall time "
        "(goal: at most 2x)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
