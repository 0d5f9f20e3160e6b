"""Gradient-weighted rollout against plain rollout, measured in the same run.

    python benchmarks/bench_gradient_rollout.py [--backend numpy|torch] [--shape B L H n]
        [--repeats R]

Prints median milliseconds per call of ``attnflow.rollout`` and
``attnflow.gradient_rollout`` (GAE and the weighted rule) on the same random float32
attention and gradients, for the [CLS] row and for the full map. Gradient rollout reads
two arrays (attention and gradient) and forms their product per head, so it is expected
to cost about twice to three times the CLS rollout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import attnflow


def _median_ms(function: Callable[[], Any], repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 12, 12, 197])
    parser.add_argument("--repeats", type=int, default=5)
    # `nox -s benchmark -- ...` hands the same options to every script.
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"note: ignoring options this script does not take: {' '.join(unknown)}")
    batch, layers, heads, n = args.shape
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(batch, layers, heads, n, n)).astype(np.float32)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    gradients = rng.normal(size=weights.shape).astype(np.float32)
    if args.backend == "torch":
        import torch

        weights, gradients = torch.from_numpy(weights), torch.from_numpy(gradients)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("rollout(a, rows=0)", lambda: attnflow.rollout(weights, rows=0)),
        (
            "gradient_rollout(a, g, rows=0)",
            lambda: attnflow.gradient_rollout(weights, gradients, rows=0),
        ),
        (
            'gradient_rollout(a, g, rows=0, rule="weighted")',
            lambda: attnflow.gradient_rollout(weights, gradients, rows=0, rule="weighted"),
        ),
        ("rollout(a)", lambda: attnflow.rollout(weights)),
        ("gradient_rollout(a, g)", lambda: attnflow.gradient_rollout(weights, gradients)),
    ]
    print(f"backend {args.backend}, shape {tuple(args.shape[:3])} x {n} x {n}, float32")
    base = None
    for name, function in cases:
        ms = _median_ms(function, args.repeats)
        base = ms if base is None else base
        print(f"| `{name}` | {ms:.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
