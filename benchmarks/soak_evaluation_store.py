"""Kill-and-resume soak of the evaluation store: ``kill -9`` at random moments, then resume.

What is checked
---------------
``attnflow.evaluate.faithfulness(..., output=FOLDER)`` writes one chunk file per chunk of
samples and resumes from the folder (``attnflow/evaluate/_store.py``). This script runs it
in a child process on a small, CPU-cheap classifier (NumPy: embeddings, position weights,
a tanh layer; attention from bilinear scores of the embeddings; raw, rollout and flow at
every layer, blank-out and input-gradient references, the ERASER metrics), and:

1. runs it once uninterrupted in a fresh folder: the reference report (its JSON, every
   figure but the wall time, and its Markdown table, byte for byte);
2. then, in another folder, starts the same evaluation and sends ``SIGKILL`` after a random
   delay (uniform over 0 to 1.2 times the reference run's wall time, start-up included, so
   kills land during imports, model calls, chunk writes and the report alike); each kill is
   followed by a resume (the next start on the same folder). A start that runs to the end
   must give the reference bytes; a start that fails (the folder not resumable) is a
   failure. When a run completes, the folder is removed and a new run begins, until
   ``--kills`` kills (default 50) have been sent; a last resume then runs to the end.

Each start's outcome is recorded: killed (with the chunk files present and whether a
temporary chunk file was being written at that moment), completed identical, completed
different, or failed. The script exits 1 on any difference or failure.

How to run
----------
From the repository root, with attnflow installed (NumPy only)::

    python benchmarks/soak_evaluation_store.py              # 50 kills, about 3 min on 2 cores
    python benchmarks/soak_evaluation_store.py --kills 200 --seed 1

The figures of the recorded run are in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SAMPLES, N, LAYERS, HEADS, VOCABULARY, WIDTH, CLASSES, UNK = 96, 8, 3, 2, 16, 6, 3, 0
CHUNK = 4


# -- the evaluation a child process runs -------------------------------------------------------
def _model() -> tuple[Any, Any, Any, Any]:
    """The toy classifier's functions and its dataset, the same in every process."""
    import numpy as np

    import attnflow

    rng = np.random.default_rng(40)
    embeddings = rng.normal(size=(VOCABULARY, WIDTH))
    position = rng.normal(size=(N, WIDTH))
    hidden = rng.normal(size=(WIDTH, WIDTH))
    output = rng.normal(size=(WIDTH, CLASSES))
    queries = rng.normal(size=(LAYERS, HEADS, WIDTH, WIDTH))
    ids = rng.integers(1, VOCABULARY, size=(SAMPLES, N))
    lengths = rng.integers(3, N + 1, size=SAMPLES)
    mask = np.arange(N)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, UNK)
    labels = rng.integers(0, CLASSES, size=SAMPLES)

    def predict(batch: Any, batch_mask: Any) -> Any:
        states = np.tanh(embeddings[batch] + position[: batch.shape[1]])
        if batch_mask is not None:
            states = states * batch_mask[..., None]
        logits = np.tanh(states.sum(axis=1) @ hidden) @ output
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)

    def attentions(batch: Any, batch_mask: Any) -> Any:
        states = embeddings[batch]
        logits = np.einsum("bid,lhde,bje->blhij", states, queries, states)
        if batch_mask is not None:
            logits = np.where(batch_mask[:, None, None, None, :], logits, -np.inf)
        logits -= logits.max(axis=-1, keepdims=True)
        weights = np.exp(logits)
        return weights / weights.sum(axis=-1, keepdims=True)

    def input_gradients(batch: Any, batch_mask: Any, targets: Any) -> Any:
        states = embeddings[batch]
        return np.abs(states @ output[:, 0]) + np.asarray(targets)[:, None]

    functions = attnflow.evaluate.ModelFunctions(
        predict, attentions, input_gradients, identity="soak-toy-classifier-v1"
    )
    return functions, ids, mask, labels


def run_worker(folder: Path, result: Path) -> int:
    """Run (or resume) the evaluation in `folder`; write its report's bytes to `result`."""
    import attnflow

    functions, ids, mask, labels = _model()
    report = attnflow.evaluate.faithfulness(
        functions,
        ids,
        replacement=UNK,
        targets=labels,
        mask=mask,
        methods=("raw", "rollout", "flow"),
        chunk_size=CHUNK,
        output=folder,
        n_jobs=1,
    )
    # The report's table and every number, byte for byte; only its wall time ("seconds",
    # not compared by the report's own equality either) differs between runs.
    content = json.loads(report.to_json())
    content.pop("seconds")
    text = json.dumps(content, indent=2, sort_keys=True) + "\n" + report.to_markdown() + "\n"
    partial = result.with_name(result.name + ".tmp")
    partial.write_text(text, encoding="utf-8")
    partial.replace(result)
    return 0


# -- the soak -----------------------------------------------------------------------------------
def _start(folder: Path, result: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, __file__, "--worker", str(folder), str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def _chunks(folder: Path) -> tuple[int, bool]:
    if not folder.is_dir():
        return 0, False
    names = [p.name for p in folder.iterdir()]
    written = sum(1 for n in names if n.startswith("chunk-") and n.endswith(".npz"))
    writing = any(n.startswith(".chunk-") and n.endswith(".tmp") for n in names)
    return written, writing


def soak(kills: int, seed: int, workdir: Path) -> dict[str, Any]:
    """Run the soak; return its record."""
    rng = random.Random(seed)
    reference_folder, reference_file = workdir / "reference", workdir / "reference.txt"
    started = time.perf_counter()
    process = _start(reference_folder, reference_file)
    _, err = process.communicate()
    full = time.perf_counter() - started
    if process.returncode != 0:
        msg = f"the uninterrupted run failed:\n{err.decode(errors='replace')}"
        raise RuntimeError(msg)
    reference = reference_file.read_bytes()
    chunks_total = SAMPLES // CHUNK
    record: dict[str, Any] = {
        "seed": seed,
        "reference_seconds": round(full, 2),
        "chunks_per_run": chunks_total,
        "kills": 0,
        "kills_with_chunks_on_disk": 0,
        "kills_during_a_chunk_write": 0,
        "kills_after_every_chunk": 0,
        "resumes": 0,
        "completed_identical": 0,
        "completed_different": 0,
        "failed_starts": 0,
        "failures": [],
    }
    folder, result = workdir / "soak", workdir / "soak.txt"
    while True:
        last = record["kills"] >= kills
        result.unlink(missing_ok=True)
        resuming = folder.exists()
        record["resumes"] += int(resuming)
        process = _start(folder, result)
        if not last:
            delay = rng.uniform(0.0, 1.2 * full)
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                written, writing = _chunks(folder)
                process.send_signal(signal.SIGKILL)
                process.wait()
                record["kills"] += 1
                record["kills_with_chunks_on_disk"] += int(written > 0)
                record["kills_during_a_chunk_write"] += int(writing)
                record["kills_after_every_chunk"] += int(written == chunks_total)
                continue  # the next start on the same folder is the resume
        _, err = process.communicate()
        if process.returncode != 0:
            record["failed_starts"] += 1
            record["failures"].append(err.decode(errors="replace").strip().splitlines()[-1:])
            if last:
                break
            shutil.rmtree(folder, ignore_errors=True)
            continue
        same = result.read_bytes() == reference
        record["completed_identical" if same else "completed_different"] += 1
        if last:
            break
        shutil.rmtree(folder)  # a fresh run: more kills at early moments
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs to send (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    parser.add_argument("--keep", help="a folder to keep the runs' folders in (default: temp)")
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(Path(args.worker[0]), Path(args.worker[1]))
    if args.keep:
        workdir = Path(args.keep)
        workdir.mkdir(parents=True, exist_ok=False)
        record = soak(args.kills, args.seed, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="attnflow-soak-") as temporary:
            record = soak(args.kills, args.seed, Path(temporary))
    print(json.dumps(record, indent=2))
    bad = record["completed_different"] or record["failed_starts"]
    ok = not bad and record["completed_identical"] >= 1 and record["kills"] >= args.kills
    print("OK: every completed run was byte-identical, every folder resumable" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
