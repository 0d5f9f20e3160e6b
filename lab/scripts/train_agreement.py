"""Train the verb number model of Abnar & Zuidema (2020) on synthetic agreement data.

The paper (§2) trains a 6-layer, 8-head Transformer encoder of GPT-2 blocks (width 128,
no causal mask, a classifier on [CLS]) on the subject-verb agreement data of Linzen et
al. (2016) and reports an accuracy of 0.96. That data cannot be downloaded here, so this
script generates a synthetic stand-in (:mod:`attnflow_lab.agreement.agreement`), trains the
paper's model on it (:mod:`attnflow_lab.agreement.agreement_torch`), prints the training
time and the test accuracy overall and by number of agreement attractors, and saves the
model (``weights.npz`` without pickle, and ``config.json``, which also records the data,
the training settings and the accuracies).

Requirements (none of them is a dependency of attnflow)::

    pip install torch==2.13.0 numpy
    pip install -e .   # attnflow itself

Usage, from the repository root::

    python lab/scripts/train_agreement.py [--output /path/to/model] [--seed 0] [--force]

The test set never repeats a training sentence verbatim. Load the model with
``attnflow_lab.agreement.agreement_torch.load_agreement_model(folder)`` and regenerate
the same test set with ``agreement_split(n_train, n_test, seed=seed)``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from numpy.typing import NDArray

from attnflow_lab.agreement.agreement import MAX_ATTRACTORS, STRUCTURES, agreement_split
from attnflow_lab.agreement.agreement_torch import (
    AgreementConfig,
    predict,
    save_agreement_model,
    train_agreement_model,
)

DEFAULT_TRAIN = 30_000
DEFAULT_TEST = 5_000
DEFAULT_EPOCHS = 5
DEFAULT_OUTPUT = Path("agreement-model")


def _report(name: str, correct: NDArray[np.bool_]) -> dict[str, float | int | None]:
    """Print one row of an accuracy table and return it (accuracy None if empty)."""
    share = float(correct.mean()) if correct.size else None
    shown = "-" if share is None else f"{share:.4f}"
    print(f"  {name:>10s}  {correct.size:9d}  {shown:>8s}")
    return {"sentences": int(correct.size), "accuracy": share}


def main(argv: Sequence[str] | None = None) -> int:
    """Generate the data, train, report and save.

    Parameters
    ----------
    argv : sequence of str, optional
        Command-line arguments; ``sys.argv[1:]`` by default.

    Returns
    -------
    int
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the training")
    parser.add_argument("--train", type=int, default=DEFAULT_TRAIN, help="training sentences")
    parser.add_argument("--test", type=int, default=DEFAULT_TEST, help="test sentences")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="model folder")
    parser.add_argument("--force", action="store_true", help="overwrite a saved model")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    output: Path = args.output
    if not args.force and any((output / name).exists() for name in ("weights.npz", "config.json")):
        parser.error(f"{output} already holds a model; pass --force to overwrite it")

    started = time.perf_counter()
    train, test = agreement_split(args.train, args.test, seed=args.seed)
    generated = time.perf_counter() - started
    print(
        f"data: {len(train)} training and {len(test)} test sentences in {generated:.1f} s; "
        f"mean length {train.lengths.mean():.1f} tokens ([CLS] included), longest "
        f"{int(train.lengths.max())}"
    )
    config = AgreementConfig(
        vocab_size=len(train.vocabulary),
        n_layers=args.layers,
        n_heads=args.heads,
        hidden=args.hidden,
        dropout=args.dropout,
    )
    started = time.perf_counter()
    model = train_agreement_model(
        train,
        seed=args.seed,
        config=config,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        device=args.device,
        progress=not args.quiet,
    )
    train_seconds = time.perf_counter() - started
    print(
        f"trained {args.epochs} epochs in {train_seconds:.1f} s "
        f"({torch.get_num_threads()} torch threads, {platform.processor() or platform.machine()})"
    )

    correct = predict(model, test) == test.labels
    train_accuracy = float((predict(model, train) == train.labels).mean())
    print(f"training accuracy {train_accuracy:.4f}")
    print(f"test accuracy {correct.mean():.4f} on {len(test)} sentences")
    print("  attractors  sentences  accuracy")
    by_attractors = {
        str(k): _report(str(k), correct[test.attractors == k]) for k in range(MAX_ATTRACTORS + 1)
    }
    print("  structure   sentences  accuracy")
    by_structure = {tag: _report(tag, correct[test.structure == tag]) for tag in STRUCTURES}

    metadata = {
        "data": {
            "generator": "attnflow_lab.agreement.agreement.agreement_split",
            "seed": args.seed,
            "n_train": args.train,
            "n_test": args.test,
        },
        "training": {
            "seed": args.seed,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seconds": round(train_seconds, 1),
            "threads": torch.get_num_threads(),
            "device": str(args.device),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "accuracy": {
            "train": train_accuracy,
            "test": float(correct.mean()),
            "test_by_attractors": by_attractors,
            "test_by_structure": by_structure,
        },
        "recorded": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "script": "lab/scripts/train_agreement.py",
    }
    folder = save_agreement_model(
        model, output, vocabulary=train.vocabulary, metadata=metadata, force=args.force
    )
    print(f"saved the model to {folder.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
