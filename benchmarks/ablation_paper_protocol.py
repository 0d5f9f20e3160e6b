"""From attnflow's reproduction protocol to the paper code's, one factor at a time.

Abnar & Zuidema's Tables 1-2 were computed by a notebook of ``samiraabnar/Reflect``
(commit ``d28ddd5``) whose protocol differs from the paper's text and from
``docs/reproduction.md``'s. This script trains the models it needs (each saved
atomically in ``OUTPUT/models/<name>`` and reused by a rerun), evaluates raw attention,
rollout and flow of the ``[CLS]`` row at every layer against blank-out and input
gradients (resumable chunks in ``OUTPUT/eval-<name>``), and prints one table per step
of the path below, with the random-score floor of the step beside it:

0. today: the model trained on the labels, no ``<eos>``, signed drop of p_gold,
   scipy's Spearman (average ranks), 2,000 test sentences, ``[CLS]`` ranked;
1. + ``<eos>`` at the verb position (a model trained on that input; blank-out scores it 0);
2. + the model: a student distilled online from an LSTM teacher (the paper code's);
3. + blank-out as ``|p_gold(x) - p_gold(x~_i)|``;
4. + Spearman through dense ranks and the no-ties formula;
5. + 100 sentences (the paper's code ran on 100 validation sentences): the whole protocol;
6. the whole protocol with ``[CLS]`` left out of the ranking (the CLS factor: every other
   step ranks it, as the paper's code does).

Usage (2 threads of a shared machine; see ``docs/reproduction.md`` for the run)::

    python benchmarks/ablation_paper_protocol.py train today   -o runs/paper-ablation &
    python benchmarks/ablation_paper_protocol.py train eos     -o runs/paper-ablation &
    python benchmarks/ablation_paper_protocol.py train distilled -o runs/paper-ablation
    python benchmarks/ablation_paper_protocol.py evaluate -o runs/paper-ablation

(``evaluate-model NAME`` evaluates one model as soon as it is trained; ``evaluate`` then
reads its saved chunks.)

The training sizes are fixed before the run (``--train-sentences``, ``--epochs``), the
same for the three models.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import attnflow
from attnflow._atomic import write_folder_atomically
from attnflow._experiments.agreement import (
    AgreementData,
    agreement_data,
    agreement_split,
    with_end_token,
)
from attnflow._experiments.agreement_distill import train_distilled_agreement_model
from attnflow._experiments.agreement_torch import (
    accuracy,
    load_agreement_model,
    save_agreement_model,
    train_agreement_model,
)
from attnflow._experiments.reproduction import PAPER_TABLES
from attnflow.evaluate import blank_out, faithfulness

MODELS = ("today", "eos", "distilled", "distilled_long")
# The second distilled student's size, fixed before its run from a timing of the recipe
# on 2,000 sentences (3.2 s CPU per 1,000 sentence-epochs, 1 thread) and the time left
# on a shared machine: 200,000 sentence-epochs, 3.3 times the first run's 60,000.
DISTILLED_LONG_SENTENCES = 40_000
DISTILLED_LONG_EPOCHS = 5
# Each model's training (sentences, epochs), fixed before its run. The first three are
# the first run's (cut to fit a shared 2-core machine); "distilled_long" is the second
# attempt at the authors' student, after the first one stopped at 0.815 test accuracy
# with its loss still falling: the same recipe (the authors' 0.9 / 0.1 distillation,
# temperature 1, dropout 0.4 / 0.6 / 0.2, a 2 x 256 LSTM teacher), trained longer on
# more sentences. Its training sentences exclude the shared test set, which stays the
# first run's (so every step is measured on the same 2,000 sentences).
RECIPES: dict[str, tuple[int, int]] = {
    "today": (20_000, 3),
    "eos": (20_000, 3),
    "distilled": (20_000, 3),
    "distilled_long": (DISTILLED_LONG_SENTENCES, DISTILLED_LONG_EPOCHS),
}
TEST_SPLIT_TRAIN_SENTENCES = 20_000  # the first run's split, which fixes the test set
METHODS = ("raw", "rollout", "flow")
REFERENCES = ("blank_out", "input_gradients")
# step: (model, blank-out score, correlation, first n sentences or None, CLS ranked)
STEPS: dict[str, tuple[str, str, str, int | None, bool]] = {
    "0 today": ("today", "drop", "spearman", None, True),
    "1 + <eos>": ("eos", "drop", "spearman", None, True),
    "2 + distilled model": ("distilled", "drop", "spearman", None, True),
    "3 + |Δp|": ("distilled", "abs", "spearman", None, True),
    "4 + dense-rank formula": ("distilled", "abs", "spearman_dense", None, True),
    "5 + 100 sentences (paper code)": ("distilled", "abs", "spearman_dense", 100, True),
    "6 paper code without CLS": ("distilled", "abs", "spearman_dense", 100, False),
}
FLOOR_DRAWS = 50


def _data(args: argparse.Namespace, model: str) -> tuple[AgreementData, AgreementData]:
    train, test = agreement_split(TEST_SPLIT_TRAIN_SENTENCES, args.sentences, seed=args.seed)
    sentences, _ = _recipe(args, model)
    if sentences != len(train):
        train = agreement_data(sentences, seed=args.seed, exclude=test)
    if model != "today":
        train, test = with_end_token(train), with_end_token(test)
    return train, test


def _recipe(args: argparse.Namespace, model: str) -> tuple[int, int]:
    """(training sentences, epochs) of `model`: its fixed recipe unless overridden."""
    sentences, epochs = RECIPES[model]
    return (
        sentences if args.train_sentences is None else args.train_sentences,
        epochs if args.epochs is None else args.epochs,
    )


def _usage() -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": own.ru_utime + own.ru_stime, "load": os.getloadavg()[0]}


def train(args: argparse.Namespace) -> None:
    """Train one model and save it with its record, atomically; skip it if saved."""
    folder = args.output / "models" / args.model
    if (folder / "training.json").exists():
        print(f"{folder} exists: {(folder / 'training.json').read_text()}")
        return
    train_set, test = _data(args, args.model)
    _, epochs = _recipe(args, args.model)
    validation = test.take(np.arange(min(500, len(test))))
    wall, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    teacher_accuracy = None
    if args.model.startswith("distilled"):
        model, teacher = train_distilled_agreement_model(
            train_set, seed=args.seed, epochs=epochs, validation=validation, progress=True
        )
        with torch.no_grad():
            ids, mask = torch.tensor(test.ids), torch.tensor(test.mask)
            teacher_accuracy = float((teacher(ids, mask).argmax(-1).numpy() == test.labels).mean())
    else:
        model = train_agreement_model(
            train_set, seed=args.seed, epochs=epochs, validation=validation, progress=True
        )
    record = {
        "model": args.model,
        "seed": args.seed,
        "train_sentences": len(train_set),
        "epochs": epochs,
        "train_wall_s": round(time.perf_counter() - wall, 1),
        "train_cpu_s": round(time.process_time() - cpu, 1),
        "load_at_start": load,
        "load_at_end": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "test_sentences": len(test),
        "test_accuracy": accuracy(model, test),
        "teacher_test_accuracy": teacher_accuracy,
    }
    text = json.dumps(record, indent=2) + "\n"

    def write(staged: Path) -> None:
        save_agreement_model(model, staged, vocabulary=train_set.vocabulary, metadata=record)
        (staged / "training.json").write_text(text)

    folder.parent.mkdir(parents=True, exist_ok=True)
    write_folder_atomically(folder, write, replace=False, exists=FileExistsError)
    print(text)


def _evaluate_model(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from attnflow.adapters.torch import (  # type: ignore[import-not-found,unused-ignore]
        model_functions,
    )

    _, test = _data(args, name)
    model = load_agreement_model(args.output / "models" / name)
    functions = model_functions(model, heads="mean", reduce="sum_abs", output="probability")
    started, cpu = time.perf_counter(), time.process_time()
    report = faithfulness(
        functions,
        test.ids,
        replacement=test.replacement,
        targets=test.labels,
        mask=test.mask,
        methods=METHODS,
        rows=0,
        blank_out_score="drop",
        fractions=None,
        output=args.output / f"eval-{name}",
        n_jobs=args.jobs,
        progress=True,
    )
    probability = report.samples["probability"]
    out: dict[str, Any] = {
        "report": report,
        "test": test,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,
        "accuracy": float(np.mean(report.samples["predicted"] == test.labels)),
        "median_p_gold": float(np.median(probability)),
        "share_p_gold_above_0.99": float(np.mean(probability > 0.99)),
    }
    if name != "today":
        # The library's own option on the first sentences must give what this script
        # derives from the evaluation's signed drop (|drop|, <eos> set to 0).
        k = min(100, len(test))
        direct = blank_out(
            lambda ids, mask: torch.softmax(model(ids, mask), -1),
            torch.tensor(test.ids[:k]),
            replacement=test.replacement,
            target=test.labels[:k],
            score="abs",
            mask=torch.tensor(test.mask[:k]),
            last_token="zero",
        ).numpy()
        derived = _blank_out(report.samples["reference.blank_out"][:k], test.mask[:k], "abs", True)
        real = test.mask[:k]
        out["direct_blank_out_max_diff"] = float(np.max(np.abs(direct - derived)[real]))
    return out


def _blank_out(values: np.ndarray, mask: np.ndarray, score: str, eos: bool) -> np.ndarray:
    values = np.abs(values) if score == "abs" else values.copy()
    if eos:
        last = mask.sum(axis=1) - 1
        values[np.arange(len(values)), last] = 0.0
    return values


def _floor(lengths: np.ndarray, *, cls: bool, eos: bool, method: str, seed: int) -> float:
    """Mean correlation of random scores whose only structure is CLS top / <eos> bottom."""
    rng = np.random.default_rng(seed)
    values = []
    for m in lengths.tolist():
        a = rng.random((FLOOR_DRAWS, m))
        b = rng.random((FLOOR_DRAWS, m))
        if cls:
            a[:, 0] = b[:, 0] = 2.0
        if eos:
            a[:, -1] = b[:, -1] = -1.0
        rho = attnflow.evaluate.rank_correlation(a, b, method=method)  # type: ignore[arg-type]
        values.append(float(np.mean(rho)))
    return float(np.mean(values))


def evaluate(args: argparse.Namespace) -> None:
    """Evaluate the three models and print every step's table."""
    evaluated = {name: _evaluate_model(args, name) for name in MODELS}
    results: dict[str, Any] = {"models": {}, "steps": {}}
    for name, ev in evaluated.items():
        results["models"][name] = {k: v for k, v in ev.items() if k not in ("report", "test")}
        print(f"model {name}: {json.dumps(results['models'][name])}")
    lines = []
    for step, (name, score, method, first, cls) in STEPS.items():
        ev = evaluated[name]
        samples, test = ev["report"].samples, ev["test"]
        count = len(test) if first is None else min(first, len(test))
        mask = test.mask[:count]
        eos = name != "today"
        references = {
            "blank_out": _blank_out(samples["reference.blank_out"][:count], mask, score, eos),
            "input_gradients": samples["reference.input_gradients"][:count],
        }
        where = mask.copy()
        if not cls:
            where[:, 0] = False
        lengths = where.sum(axis=1)
        floor = (
            _floor(lengths, cls=False, eos=eos, method=method, seed=args.seed)
            if not cls
            else _floor(lengths, cls=True, eos=eos, method=method, seed=args.seed)
        )
        table: dict[str, dict[str, list[list[float]]]] = {}
        for reference, values in references.items():
            table[reference] = {}
            for m in METHODS:
                rho = attnflow.evaluate.rank_correlation(
                    samples[f"scores.{m}"][:count],
                    values[:, None, :],
                    where=where[:, None, :],
                    method=method,  # type: ignore[arg-type]
                )
                table[reference][m] = [
                    [float(mu), float(sd)]
                    for mu, sd in zip(rho.mean(axis=0), rho.std(axis=0), strict=True)
                ]
        results["steps"][step] = {"floor": floor, "sentences": count, "table": table}
        lines.append(f"\n### Step {step} (floor {floor:.2f}, {count} sentences)\n")
        lines.append("| reference | method | L1 | L2 | L3 | L4 | L5 | L6 |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for reference in REFERENCES:
            for m in METHODS:
                cells = " | ".join(f"{mu:.2f}" for mu, _ in table[reference][m])
                lines.append(f"| {reference} | {m} | {cells} |")
    final = results["steps"]["5 + 100 sentences (paper code)"]["table"]
    lines.append("\n### The paper code's protocol against the paper: ours (paper) Δ\n")
    lines.append("| reference | method | L1 | L2 | L3 | L4 | L5 | L6 |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for reference in REFERENCES:
        for m in METHODS:
            row = []
            for (mu, sd), (p, q) in zip(
                final[reference][m], PAPER_TABLES[reference][m], strict=True
            ):
                flag = "" if abs(mu - p) <= 0.1 else " **"
                row.append(f"{mu:.2f}±{sd:.2f} ({p:.2f}±{q:.2f}) {mu - p:+.2f}{flag}")
            lines.append(f"| {reference} | {m} | {' | '.join(row)} |")
    text = "\n".join(lines)
    print(text)
    results["usage"] = _usage()
    (args.output / "ablation.md").write_text(text + "\n")
    (args.output / "ablation.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["usage"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("train", "evaluate", "evaluate-model"))
    parser.add_argument("model", nargs="?", choices=MODELS)
    parser.add_argument("-o", "--output", type=Path, default=Path("runs/paper-ablation"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-sentences", type=int, default=None, help="override the model's recipe"
    )
    parser.add_argument("--epochs", type=int, default=None, help="override the model's recipe")
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    args.output.mkdir(parents=True, exist_ok=True)
    if args.command in ("train", "evaluate-model") and args.model is None:
        parser.error(f"{args.command} needs a model: one of " + ", ".join(MODELS))
    if args.command == "train":
        train(args)
    elif args.command == "evaluate-model":  # fills the model's resumable chunks early
        result = _evaluate_model(args, args.model)
        print(json.dumps({k: v for k, v in result.items() if k not in ("report", "test")}))
    else:
        evaluate(args)


if __name__ == "__main__":
    main()
