"""Rollout of generated text against plain generation, on SmolLM2, measured in the same run.

    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_generation.py [--tokens 10 100]
        [--repeats 3] [--gradient]

For each number of new tokens T, times greedy ``model.generate`` (the baseline) and
``explain_generation(..., methods="rollout")`` and ``methods="raw"`` (the capture alone,
without the rollout cache) on the same prompt, alternating them in each repeat so that both
see the same machine load, and prints the median wall and CPU seconds and their ratio to
the baseline. The goal of issue 21 (item 4) is rollout at most 3x ``generate`` for T = 10
to 100. ``--gradient`` adds GAE for the smallest T (one forward and backward pass per
generated token, reported for information). Needs the SmolLM2 package (see
``tests/llm_models.py``); the model is converted once and cached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _measure(function: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gradient", action="store_true")
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"note: ignoring options this script does not take: {' '.join(unknown)}")

    import torch
    from llm_models import load_smollm2

    from attnflow.adapters.torch import explain_generation

    model, tokenizer = load_smollm2(attn_implementation="sdpa")
    encoded = tokenizer(PROMPT, return_tensors="pt")
    n_prompt = int(encoded["input_ids"].shape[1])
    print(
        f"SmolLM2-135M-Instruct (30 layers, sdpa, float32), prompt of {n_prompt} tokens, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
        f"{args.repeats} (wall s / CPU s)"
    )
    print("| T | generate | rollout | ratio wall | ratio CPU | raw (capture only) | ratio wall |")
    print("|---|---|---|---|---|---|---|")
    for steps in args.tokens:
        settings: dict[str, Any] = {"do_sample": False, "min_new_tokens": steps}

        def generate(steps: int = steps, settings: dict[str, Any] = settings) -> None:
            with torch.no_grad():
                out = model.generate(**encoded, max_new_tokens=steps, **settings)
            assert out.shape[1] == n_prompt + steps

        def rollout(steps: int = steps, settings: dict[str, Any] = settings) -> None:
            g = explain_generation(
                model,
                tokenizer,
                PROMPT,
                max_new_tokens=steps,
                methods="rollout",
                generate_kwargs=settings,
            )
            assert g.scores["rollout"].shape == (steps, n_prompt + steps - 1)

        def raw(steps: int = steps, settings: dict[str, Any] = settings) -> None:
            explain_generation(
                model,
                tokenizer,
                PROMPT,
                max_new_tokens=steps,
                methods="raw",
                generate_kwargs=settings,
            )

        generate()  # warm-up
        times: dict[str, list[tuple[float, float]]] = {"generate": [], "rollout": [], "raw": []}
        for _ in range(args.repeats):
            for name, function in (("generate", generate), ("rollout", rollout), ("raw", raw)):
                times[name].append(_measure(function))
        median = {
            name: (
                statistics.median(w for w, _ in values),
                statistics.median(c for _, c in values),
            )
            for name, values in times.items()
        }
        base_wall, base_cpu = median["generate"]
        wall, cpu = median["rollout"]
        raw_wall, raw_cpu = median["raw"]
        print(
            f"| {steps} | {base_wall:.2f} / {base_cpu:.2f} | {wall:.2f} / {cpu:.2f} | "
            f"{wall / base_wall:.2f} | {cpu / base_cpu:.2f} | {raw_wall:.2f} / {raw_cpu:.2f} | "
            f"{raw_wall / base_wall:.2f} |"
        )
    if args.gradient:
        steps = min(args.tokens)
        settings = {"do_sample": False, "min_new_tokens": steps}
        with torch.no_grad():
            base = _measure(lambda: model.generate(**encoded, max_new_tokens=steps, **settings))
        gae = _measure(
            lambda: explain_generation(
                model,
                tokenizer,
                PROMPT,
                max_new_tokens=steps,
                methods="gradient_rollout",
                generate_kwargs=settings,
            )
        )
        print(
            f"gradient_rollout, T = {steps}: {gae[0]:.2f} s wall / {gae[1]:.2f} s CPU against "
            f"generate {base[0]:.2f} / {base[1]:.2f} ({gae[0] / base[0]:.1f}x wall; one "
            "forward and backward pass per generated token)"
        )


if __name__ == "__main__":
    main()
