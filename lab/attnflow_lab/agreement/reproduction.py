"""The paper's Tables 1 and 2, reproduced offline on the synthetic agreement task.

Abnar & Zuidema (2020, §2 and Tables 1-2) train a 6-layer, 8-head Transformer encoder
(GPT-2 blocks without masking, hidden size 128, a ``[CLS]`` classifier) to predict the
number of a verb from the sentence before it (Linzen et al. 2016), and correlate raw
attention, rollout and flow of the ``[CLS]`` token at every layer with blank-out and
input-gradient importance on 2,000 test sentences. :func:`reproduce_agreement` does the
same on :mod:`attnflow_lab.agreement.agreement`'s synthetic data, with the paper's model
trained from scratch (:mod:`attnflow_lab.agreement.agreement_torch`), and
:data:`PAPER_TABLES` holds the published numbers to compare with.

This module imports PyTorch.
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

from attnflow.evaluate import ERASER_FRACTIONS, FaithfulnessReport, faithfulness
from attnflow_lab._atomic import write_atomically, write_folder_atomically
from attnflow_lab._markdown import markdown_table
from attnflow_lab._types import ContributionMethod, LastToken, Method, RankCorrelation
from attnflow_lab.agreement.agreement import AgreementData, agreement_split
from attnflow_lab.agreement.agreement_torch import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    accuracy,
    load_agreement_model,
    predict,
    save_agreement_model,
    train_agreement_model,
)

__all__ = [
    "DEFAULT_TRAIN_SENTENCES",
    "PAPER_TABLES",
    "comparison_markdown",
    "reproduce_agreement",
]

DEFAULT_TRAIN_SENTENCES = 30_000
"""Training sentences of the reproduction's model (the test set is disjoint)."""

PAPER_TABLES: dict[str, dict[str, tuple[tuple[float, float], ...]]] = {
    "blank_out": {  # Table 1: Spearman correlation with blank-out, 2,000 test sentences
        "raw": (
            (0.69, 0.27),
            (0.10, 0.43),
            (-0.11, 0.49),
            (-0.09, 0.52),
            (0.20, 0.45),
            (0.29, 0.39),
        ),
        "rollout": (
            (0.32, 0.26),
            (0.38, 0.27),
            (0.51, 0.26),
            (0.62, 0.26),
            (0.70, 0.25),
            (0.71, 0.24),
        ),
        "flow": (
            (0.32, 0.26),
            (0.44, 0.29),
            (0.70, 0.25),
            (0.70, 0.22),
            (0.71, 0.22),
            (0.70, 0.22),
        ),
    },
    "input_gradients": {  # Table 2: Spearman correlation with input gradients
        "raw": (
            (0.53, 0.33),
            (0.16, 0.38),
            (-0.06, 0.42),
            (0.00, 0.47),
            (0.24, 0.40),
            (0.46, 0.35),
        ),
        "rollout": (
            (0.22, 0.31),
            (0.27, 0.32),
            (0.39, 0.32),
            (0.47, 0.32),
            (0.53, 0.32),
            (0.54, 0.31),
        ),
        "flow": (
            (0.22, 0.31),
            (0.31, 0.34),
            (0.54, 0.32),
            (0.61, 0.28),
            (0.60, 0.28),
            (0.61, 0.28),
        ),
    },
}
"""Abnar & Zuidema (2020), Tables 1 and 2: (mean, sd) per method and layer L1-L6."""


def results_folder(contributions: ContributionMethod | None, row: object) -> str:
    """Name the folder of one evaluation's chunks: ``rows-<row>``, per matrix kind if any."""
    return f"rows-{row}" if contributions is None else f"{contributions}-rows-{row}"


TRAINING_RECORD = "training.json"
"""The training record, saved inside the model's folder (``folder/model``) with it."""


def _training_record(folder: Path) -> dict[str, Any] | None:
    """Return the record saved with the model (or beside it, in older folders), or None."""
    for path in (folder / "model" / TRAINING_RECORD, folder / TRAINING_RECORD):
        if path.exists():
            return dict(json.loads(path.read_text()))
    return None


def _given_model(
    model_folder: Path, test: AgreementData, *, seed: int, n_train: int
) -> tuple[Any, dict[str, Any]]:
    """Load a model saved by ``lab/scripts/train_agreement.py``, checking its training data."""
    config = json.loads((model_folder / "config.json").read_text())
    data = config.get("metadata", {}).get("data", {})
    if (data.get("seed"), data.get("n_train")) != (seed, n_train):
        msg = (
            f"the model in {model_folder} was trained on {data.get('n_train')} sentences "
            f"with seed {data.get('seed')}; this run's test set is disjoint from {n_train} "
            f"training sentences of seed {seed}. Pass the matching --seed and "
            "--train-sentences, or let the run train its own model."
        )
        raise ValueError(msg)
    model = load_agreement_model(model_folder)
    training = config.get("metadata", {}).get("training", {})
    predicted = predict(model, test)
    record = {
        "seed": seed,
        "train_sentences": n_train,
        "model": str(model_folder),
        "test_sentences": len(test),
        "train_seconds": training.get("seconds", float("nan")),
        "test_accuracy": float(np.mean(predicted == test.labels)),
        "test_accuracy_by_attractors": _by_attractors(predicted, test),
    }
    return model, record


def _by_attractors(predicted: np.ndarray, test: AgreementData) -> dict[str, float]:
    return {
        str(k): float(np.mean(predicted[test.attractors == k] == test.labels[test.attractors == k]))
        for k in np.unique(test.attractors)
    }


def _model(
    folder: Path,
    train: AgreementData,
    test: AgreementData,
    *,
    seed: int,
    progress: bool,
    force: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """Load the model trained by an earlier run in `folder`, or train and save it.

    The model, its configuration and its training record are published together
    (:func:`attnflow._atomic.write_folder_atomically`): ``folder/model`` holds all three
    or does not exist, so a run killed while saving trains again, and never finds a model
    without its record. A model folder that cannot be used (another seed or size, or a
    damaged one left by an older version) is refused before any training, unless `force`.
    """
    model_folder = folder / "model"
    wanted = {"seed": seed, "train_sentences": len(train)}
    if os.path.lexists(model_folder):
        problem = _unusable(folder, wanted)
        if problem is None:
            record = _training_record(folder)
            assert record is not None
            try:
                return load_agreement_model(model_folder), record
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
                problem = f"holds a model that cannot be loaded ({error})"
        if not force:
            msg = (
                f"{folder} {problem}. Use a new folder, or pass `force=True` to train a "
                "new model in its place."
            )
            raise ValueError(msg)
    started = time.perf_counter()
    cpu = time.process_time()
    model = train_agreement_model(train, seed=seed, progress=progress)
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu
    by_attractors = _by_attractors(predict(model, test), test)
    record = {
        **wanted,
        "test_sentences": len(test),
        "train_seconds": seconds,
        "train_cpu_seconds": cpu_seconds,
        "test_accuracy": accuracy(model, test),
        "test_accuracy_by_attractors": by_attractors,
        "test_sentences_by_attractors": {
            str(k): int(np.sum(test.attractors == k)) for k in np.unique(test.attractors)
        },
    }
    text = json.dumps(record, indent=2) + "\n"

    def write(staged: Path) -> None:
        save_agreement_model(model, staged)
        write_atomically(
            staged / TRAINING_RECORD,
            lambda file: file.write(text.encode()),
            replace=False,
            exists=FileExistsError,
            mode=None,
        )

    write_folder_atomically(model_folder, write, replace=force, exists=_model_exists)
    (folder / TRAINING_RECORD).unlink(missing_ok=True)  # an older run's, beside the model
    return model, record


def _unusable(folder: Path, wanted: Mapping[str, Any]) -> str | None:
    """Why ``folder/model`` cannot be reused for a run that wants `wanted`; None if it can."""
    model_folder = folder / "model"
    missing = [name for name in (WEIGHTS_FILE, CONFIG_FILE) if not (model_folder / name).is_file()]
    try:
        record = _training_record(folder)
    except (OSError, ValueError) as error:
        return f"holds a model whose {TRAINING_RECORD} cannot be read ({error})"
    if record is None or missing:
        missing += [TRAINING_RECORD] if record is None else []
        return (
            f"holds an incomplete model (no {', '.join(missing)}): an earlier run was "
            "stopped while saving it"
        )
    if {k: record.get(k) for k in wanted} != dict(wanted):
        return (
            f"holds a model trained with {record.get('train_sentences')} sentences and seed "
            f"{record.get('seed')}; this run asks for {wanted['train_sentences']} and "
            f"{wanted['seed']}"
        )
    return None


def _model_exists(target: Path) -> FileExistsError:
    return FileExistsError(
        f"{target} appeared while the model was being trained; use a new folder, or pass "
        "`force=True` to replace it."
    )


def reproduce_agreement(
    folder: str | Path,
    /,
    *,
    sentences: int = 2000,
    train_sentences: int | None = None,
    seed: int = 0,
    rows: Sequence[int | Literal["max", "mean"]] = (0, "max"),
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
) -> tuple[dict[int | str, FaithfulnessReport], dict[str, Any]]:
    r"""Reproduce Tables 1 and 2 of Abnar & Zuidema (2020) on synthetic agreement data.

    Generates disjoint training and test sets (:func:`~attnflow_lab.agreement.agreement.
    agreement_split`), trains the paper's model on the first (or loads the one an
    earlier run saved in ``folder/model``, which holds its training record
    ``training.json`` too), and evaluates raw attention, rollout and flow at every layer on the test sentences with :func:`attnflow.evaluate.faithfulness`:
    blank-out replaces a token by ``[UNK]`` and takes the drop of the probability of the
    correct class (the paper's text), input gradients are
    :math:`\lvert \sum_d \partial p_\text{correct} / \partial e_{i,d} \rvert` at the
    token embeddings (the paper's code). Every correlation is taken over all tokens,
    ``[CLS]`` included, as in the paper's code. Each explained row is evaluated into
    ``folder/rows-<row>`` in resumable chunks.

    Parameters
    ----------
    folder : path
        Where the model, the training record and the per-chunk results go.
    sentences : int, default 2000
        Test sentences (the paper: 2,000).
    train_sentences : int, optional
        Training sentences; :data:`DEFAULT_TRAIN_SENTENCES` by default.
    seed : int, default 0
        Seed of the data and of the training.
    rows : sequence, default (0, "max")
        The explained output rows: 0 is ``[CLS]`` (the paper's Tables 1-2), ``"max"`` the
        maximum over rows (the paper's code for DistilBERT).
    methods, correlation, blank_out_last_token, fractions, chunk_size, n_jobs, progress
        As for :func:`attnflow.evaluate.faithfulness` (``correlation="spearman_dense"`` and
        ``blank_out_last_token="zero"`` are the authors' code's conventions).
    model : path, optional
        A model folder saved by ``lab/scripts/train_agreement.py`` with the same seed and
        training size, used instead of training one.
    contributions : {"norm", "globenc", "alti"}, optional
        Evaluate the methods over value-aware token-mixing matrices instead of the
        attention weights (:func:`attnflow.adapters.torch.model_functions`); the results
        go to ``folder/<contributions>-rows-<row>``.
    force : bool, default False
        Replace what `folder` holds instead of refusing it: a saved model that is
        incomplete or of another seed or size (a new one is trained), and results of
        another evaluation or damaged chunks (as ``faithfulness(force=True)``).

    Returns
    -------
    reports : dict
        One :class:`~attnflow.evaluate.FaithfulnessReport` per row.
    record : dict
        The training record (seed, sizes, training time, test accuracy overall and by
        number of agreement attractors) and the evaluation time.

    Raises
    ------
    ValueError
        If `folder` (or `model`) holds a model trained with another seed or size, or
        `folder` an incomplete one, and `force` is False.
    EvaluationFolderError
        If a results folder holds another evaluation (another model included) or a
        damaged chunk, and `force` is False.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] T. Linzen, E. Dupoux and Y. Goldberg, "Assessing the Ability of LSTMs to Learn
       Syntax-Sensitive Dependencies", TACL 4, 2016.

    Examples
    --------
    >>> from attnflow_lab.agreement.reproduction import reproduce_agreement
    >>> reports, record = reproduce_agreement("runs/agreement")  # doctest: +SKIP
    >>> print(reports[0].to_markdown())  # doctest: +SKIP
    """
    # The adapters install as attnflow.adapters (setuptools package-dir), which mypy
    # checks as the top-level package `adapters`.
    from attnflow.adapters.torch import (  # type: ignore[import-not-found,unused-ignore]
        model_functions,
    )

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    n_train = DEFAULT_TRAIN_SENTENCES if train_sentences is None else train_sentences
    train, test = agreement_split(n_train, sentences, seed=seed)
    if model is None:
        classifier, record = _model(root, train, test, seed=seed, progress=progress, force=force)
    else:
        classifier, record = _given_model(Path(model), test, seed=seed, n_train=n_train)
    functions = model_functions(
        classifier,
        heads="mean",
        reduce="sum_abs",
        output="probability",
        contributions=contributions,
    )
    reports: dict[int | str, FaithfulnessReport] = {}
    started = time.perf_counter()
    for row in rows:
        reports[row] = faithfulness(
            functions,
            test.ids,
            replacement=test.replacement,
            targets=test.labels,
            mask=test.mask,
            methods=methods,
            rows=row,
            correlation=correlation,
            blank_out_last_token=blank_out_last_token,
            fractions=fractions,
            chunk_size=chunk_size,
            output=root / results_folder(contributions, row),
            force=force,
            n_jobs=n_jobs,
            progress=progress,
        )
    record = {**record, "evaluation_seconds": time.perf_counter() - started}
    return reports, record


def comparison_markdown(report: FaithfulnessReport, reference: str) -> str:
    """Return a Markdown table of `report`'s correlations beside the paper's.

    Parameters
    ----------
    report : FaithfulnessReport
        A report of the ``[CLS]`` row (``rows=0``) on the agreement task.
    reference : {"blank_out", "input_gradients"}
        Table 1 or Table 2.

    Returns
    -------
    str
        One row per method present in both, one column per layer: ``ours (paper)``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import FaithfulnessReport
    >>> from attnflow_lab.agreement.reproduction import comparison_markdown
    >>> samples = {"correlation.flow.blank_out": np.full((4, 6), 0.5)}
    >>> report = FaithfulnessReport(samples, ("flow",), ("blank_out",), "spearman", "drop", 0)
    >>> print(comparison_markdown(report, "blank_out").splitlines()[2])
    | flow   | 0.50 ± 0.00 (0.32 ± 0.26) | 0.50 ± 0.00 (0.44 ± 0.29) | 0.50 ± 0.00 (0.70 ± 0.25) | 0.50 ± 0.00 (0.70 ± 0.22) | 0.50 ± 0.00 (0.71 ± 0.22) | 0.50 ± 0.00 (0.70 ± 0.22) |
    """
    paper = PAPER_TABLES[reference]
    layers = report.n_layers
    header = ["method", *(f"L{layer + 1}" for layer in range(layers))]
    body = []
    for method in report.methods:
        if method not in paper:
            continue
        mean = report.correlation_mean(method, reference)
        std = report.correlation_std(method, reference)
        cells = [
            f"{m:.2f} ± {s:.2f} ({p:.2f} ± {q:.2f})"
            for m, s, (p, q) in zip(mean, std, paper[method][:layers], strict=False)
        ]
        body.append([method, *cells])
    return markdown_table(header, body)


def paper_means(reference: str) -> Mapping[str, list[float]]:
    """Return the paper's per-layer means for `reference`, for the figures."""
    return {method: [m for m, _ in values] for method, values in PAPER_TABLES[reference].items()}
