r"""Faithfulness of value-aware rollout and flow on the two offline tasks.

Evaluates, with :func:`attnflow.evaluate.faithfulness`, every explanation attnflow computes for a
classifier: raw attention, rollout, flow and gradient rollout over the attention weights,
and raw, rollout and flow over the three value-aware token-mixing matrices
(:func:`attnflow.contributions`: Kobayashi et al.'s norm, GlobEnc and ALTI). The tasks
are the paper's two reproductions: subject-verb agreement
(:func:`~attnflow_lab.agreement.reproduction.reproduce_agreement`, the paper's 6-layer
model of GPT-2 blocks) and sentiment with the shipped pretrained MiniLM fine-tuned
offline (:func:`~attnflow_lab.sentiment.reproduction_sentiment.reproduce_sentiment`).
Every method explains the ``[CLS]`` row, which both classifiers read.

How each matrix is composed across layers:

* attention weights: as attnflow's methods do by default (heads averaged, the residual
  as :math:`0.5 I + 0.5 A`);
* norm-based: its rows renormalised, mixed with the identity like attention (the norm
  of the attention output alone has no residual);
* ALTI: its rows renormalised and taken as they are (``residual=0``), since it already
  holds the residual connection's share;
* GlobEnc: as its authors aggregate it (``mohsenfayyaz/GlobEnc``,
  ``src/attention_rollout.py``), the raw :math:`N_{\mathrm{Enc}}` matrices multiplied
  without renormalising rows and with no residual mixed in
  (:func:`attnflow_lab._globenc.compose_unnormalized`); flow over the raw norms as
  capacities, its rows normalised at the end as the authors' max-flow does. The
  renormalised variant (attnflow's earlier composition) is evaluated beside it
  as ``rollout_renormalized`` and ``flow_renormalized``.

Running the evaluation imports PyTorch and transformers (importing this module does not).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attnflow
from attnflow.evaluate import FaithfulnessReport
from attnflow_lab._globenc import compose_unnormalized
from attnflow_lab._markdown import markdown_table
from attnflow_lab._types import ContributionMethod, Method

__all__ = [
    "MATRICES",
    "evaluate_value_aware",
    "matrix_methods",
    "value_aware_markdown",
]

Task = Literal["sentiment", "agreement"]
Matrix = Literal["attention", "norm", "globenc", "alti"]

MATRICES: tuple[Matrix, ...] = ("attention", "norm", "globenc", "alti")
"""The per-layer matrices evaluated: attention weights, then the value-aware ones."""

# The methods over the attention weights, and each value-aware matrix's residual weight
# and row renormalisation, as attnflow's registry (``attnflow explain --method``) has them.
_ATTENTION_METHODS: dict[str, Method] = {
    "raw": attnflow.raw,
    "rollout": attnflow.rollout,
    "flow": attnflow.flow,
    "gradient_rollout": attnflow.gradient_rollout,
}
_RULES: dict[str, tuple[float, bool]] = {
    "norm": (0.5, True),
    "globenc": (0.0, False),
    "alti": (0.0, True),
}
_LABELS = {"attention": "", "norm": "norm-based", "globenc": "GlobEnc", "alti": "ALTI"}


def matrix_methods(matrix: Matrix) -> dict[str, Method]:
    """Return the methods evaluated over one kind of per-layer matrix.

    Parameters
    ----------
    matrix : {"attention", "norm", "globenc", "alti"}
        The attention weights, or a value-aware token-mixing matrix.

    Returns
    -------
    dict
        Method name to a function with :func:`attnflow.rollout`'s signature:
        ``raw``, ``rollout``, ``flow`` (and ``gradient_rollout`` for attention; and
        ``rollout_renormalized``, ``flow_renormalized`` for GlobEnc, whose ``rollout``
        and ``flow`` follow its authors and never renormalise rows).

    Examples
    --------
    >>> from attnflow_lab.value_aware import matrix_methods
    >>> sorted(matrix_methods("alti"))
    ['flow', 'raw', 'rollout']
    >>> list(matrix_methods("globenc"))
    ['raw', 'rollout', 'flow', 'rollout_renormalized', 'flow_renormalized']
    """
    if matrix == "attention":
        return dict(_ATTENTION_METHODS)
    if matrix not in ("norm", "globenc", "alti"):
        msg = f"`matrix` must be one of {list(MATRICES)}; got {matrix!r}."
        raise ValueError(msg)
    residual, normalize_layers = _RULES[matrix]
    renormalized: dict[str, Method] = {
        "rollout": functools.partial(attnflow.rollout, residual=residual, normalize_layers=True),
        "flow": functools.partial(attnflow.flow, residual=residual, normalize_layers=True),
    }
    # Rows of norm-based and GlobEnc matrices are not normalised; ranking a row is
    # unchanged by scaling it, so the raw matrix is read as it is.
    raw: Method = functools.partial(attnflow.raw, validate=False)
    if normalize_layers:
        return {"raw": raw, **renormalized}
    return {
        "raw": raw,
        "rollout": functools.partial(compose_unnormalized, attnflow.rollout),
        "flow": functools.partial(compose_unnormalized, attnflow.flow),
        "rollout_renormalized": renormalized["rollout"],
        "flow_renormalized": renormalized["flow"],
    }


def evaluate_value_aware(
    folder: str | Path,
    /,
    *,
    task: Task,
    sentences: int = 300,
    matrices: Sequence[Matrix] = MATRICES,
    model: str | Path | None = None,
    train_sentences: int | None = None,
    seed: int = 0,
    n_jobs: int | None = None,
    progress: bool = True,
) -> tuple[dict[str, FaithfulnessReport], dict[str, Any]]:
    r"""Evaluate raw, rollout, flow (and gradient rollout) over every matrix kind on a task.

    Runs :func:`~attnflow_lab.agreement.reproduction.reproduce_agreement` or
    :func:`~attnflow_lab.sentiment.reproduction_sentiment.reproduce_sentiment` once per
    matrix kind on the same test sentences and classifier, explaining the ``[CLS]`` row,
    with blank-out, input gradients (the agreement reproduction's
    :math:`\lvert\sum_d g_d\rvert`, the sentiment reproduction's :math:`\lVert g
    \rVert_2`) and the ERASER metrics. Results are saved in resumable chunks under
    `folder` (``<matrix>-rows-0`` or ``rows-0``), the classifier in ``folder/model``
    when none is given.

    Parameters
    ----------
    folder : path
        Where the classifier, the records and the per-chunk results go.
    task : {"sentiment", "agreement"}
        The offline task.
    sentences : int, default 300
        Test sentences.
    matrices : sequence, default :data:`MATRICES`
        The per-layer matrices to evaluate.
    model : path, optional
        A classifier saved by ``lab/scripts/train_sentiment.py`` or
        ``lab/scripts/train_agreement.py`` with the default seed and sizes.
    train_sentences : int, optional
        Training sentences of the classifier, as for the reproductions.
    seed : int, default 0
        Seed of the data and of the training.
    n_jobs : int, optional
        Threads for attention flow.
    progress : bool, default True
        Show progress bars.

    Returns
    -------
    reports : dict
        One :class:`~attnflow.evaluate.FaithfulnessReport` per matrix kind.
    record : dict
        The classifier's record (training time, test accuracy) and the evaluation time
        per matrix kind.

    Raises
    ------
    ValueError
        On an unknown task or matrix kind, before any work.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020.
    .. [2] G. Kobayashi et al., "Attention is Not Only a Weight: Analyzing Transformers
       with Vector Norms", EMNLP 2020.
    .. [3] A. Modarressi et al., "GlobEnc: Quantifying Global Token Attribution by
       Incorporating the Whole Encoder Layer in Transformers", NAACL 2022.
    .. [4] J. Ferrando et al., "Measuring the Mixing of Contextual Information in the
       Transformer", EMNLP 2022.

    Examples
    --------
    >>> import tempfile
    >>> from attnflow_lab.value_aware import evaluate_value_aware
    >>> reports, record = evaluate_value_aware(
    ...     tempfile.mkdtemp(), task="sentiment", sentences=4, train_sentences=32,
    ...     matrices=("alti",), progress=False)
    >>> reports["alti"].methods
    ('raw', 'rollout', 'flow')
    """
    if task not in ("sentiment", "agreement"):
        msg = f'`task` must be "sentiment" or "agreement"; got {task!r}.'
        raise ValueError(msg)
    unknown = [m for m in matrices if m not in MATRICES]
    if unknown or not matrices:
        msg = f"`matrices` must be some of {list(MATRICES)}; got {list(matrices)}."
        raise ValueError(msg)
    reports: dict[str, FaithfulnessReport] = {}
    record: dict[str, Any] = {"task": task, "sentences": sentences, "seconds": {}}
    for matrix in matrices:
        contributions: ContributionMethod | None = None if matrix == "attention" else matrix
        options: dict[str, Any] = {
            "sentences": sentences,
            "train_sentences": train_sentences,
            "seed": seed,
            "rows": (0,),
            "methods": matrix_methods(matrix),
            "n_jobs": n_jobs,
            "progress": progress,
            "model": model,
            "contributions": contributions,
        }
        if task == "sentiment":
            from attnflow_lab.sentiment.reproduction_sentiment import reproduce_sentiment

            by_row, run = reproduce_sentiment(folder, reductions=("l2",), **options)
            report = by_row["0-l2"]
        else:
            from attnflow_lab.agreement.reproduction import reproduce_agreement

            by_row_agreement, run = reproduce_agreement(folder, **options)
            report = by_row_agreement[0]
        reports[matrix] = report
        record["seconds"][matrix] = report.seconds
        record["classifier"] = {
            k: v for k, v in run.items() if k not in ("evaluation_seconds", "seconds")
        }
    return reports, record


def _cell(mean: float, std: float) -> str:
    return f"{mean:.2f} ± {std:.2f}"


def value_aware_markdown(reports: Mapping[str, FaithfulnessReport], *, layer: int = -1) -> str:
    """Return one Markdown table of every method's faithfulness at one layer.

    Parameters
    ----------
    reports : mapping
        Matrix kind to report, as :func:`evaluate_value_aware` returns.
    layer : int, default -1
        The layer whose explanations are compared (the last by default).

    Returns
    -------
    str
        One row per matrix kind and method: Spearman's rho with blank-out and with input
        gradients, comprehensiveness AOPC (higher is more faithful) and sufficiency AOPC
        (lower is more faithful), as mean ± sd over the test sentences.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import FaithfulnessReport
    >>> from attnflow_lab.value_aware import value_aware_markdown
    >>> samples = {
    ...     "correlation.rollout.blank_out": np.array([[0.2, 0.4], [0.4, 0.6]]),
    ...     "correlation.rollout.input_gradients": np.array([[0.1, 0.3], [0.3, 0.5]]),
    ... }
    >>> report = FaithfulnessReport(
    ...     samples, ("rollout",), ("blank_out", "input_gradients"), "spearman", "drop", 0)
    >>> print(value_aware_markdown({"alti": report}).splitlines()[2])
    | ALTI rollout | 0.50 ± 0.10 | 0.40 ± 0.10       | n/a                 | n/a           |
    """
    header = [
        "method",
        "ρ blank-out",
        "ρ input gradients",
        "comprehensiveness ↑",
        "sufficiency ↓",
    ]
    body = []
    for matrix, report in reports.items():
        for method in report.methods:
            name = f"{_LABELS.get(matrix, matrix)} {method.replace('_', ' ')}".strip()
            cells = [name]
            for reference in ("blank_out", "input_gradients"):
                if reference in report.references:
                    mean = report.correlation_mean(method, reference)[layer]
                    std = report.correlation_std(method, reference)[layer]
                    cells.append(_cell(float(mean), float(std)))
                else:
                    cells.append("n/a")
            for metric in ("comprehensiveness", "sufficiency"):
                if f"{metric}.{method}" in report.samples:
                    mean_aopc, std_aopc = report.aopc(method, metric)
                    cells.append(_cell(float(mean_aopc[layer]), float(std_aopc[layer])))
                else:
                    cells.append("n/a")
            body.append(cells)
    if not body:
        msg = "`reports` holds no method to tabulate."
        raise ValueError(msg)
    return markdown_table(header, body)
