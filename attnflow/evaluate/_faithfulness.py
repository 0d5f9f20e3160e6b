"""The paper's faithfulness protocol over a whole dataset, in resumable chunks.

For every sample: the model's prediction, its attention, the explanations of every
method at every layer, the reference importance scores (blank-out, input gradients), the
rank correlation of each explanation with each reference, and the erasure metrics
(comprehensiveness and sufficiency). Samples are processed in chunks; with an output
folder each chunk's results are written as it finishes, and a rerun skips them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from attnflow._deprecation import MISSING
from attnflow._flow import _check_flow_options as check_flow_options
from attnflow._host import to_host
from attnflow._lost_workers import WorkersLostError
from attnflow._methods import ATTENTION_METHODS, METHODS, method_of_function
from attnflow._namespace import array_device, array_namespace, enter_boundary
from attnflow._typing import Array, Namespace
from attnflow._validation import describe

from ._blank_out import BLANK_OUT_SCORES, LAST_TOKENS, BlankOutScore, LastToken, blank_out
from ._correlation import (
    NAN_POLICIES,
    RANK_CORRELATIONS,
    NanPolicy,
    RankCorrelation,
    rank_correlation,
)
from ._erasure import ERASER_FRACTIONS, comprehensiveness, sufficiency
from ._identity import describe_function, identify_functions
from ._predict import (
    ModelInputs,
    call_model,
    check_batch_size,
    check_replacement,
    read_token_ids,
    resolve_targets,
    row_batches,
    shared_predictions,
)
from ._report import FaithfulnessReport
from ._store import ChunkStore, fingerprint

__all__ = ["ModelFunctions", "faithfulness"]

logger = logging.getLogger("attnflow.evaluate")

Method = Callable[..., Any]
"""``method(attentions, *, rows, layers, mask)``, as :func:`attnflow.rollout`."""

_REFERENCES = ("blank_out", "input_gradients")
_ROW_AGGREGATIONS = ("max", "mean")
_NAME = "abcdefghijklmnopqrstuvwxyz0123456789_"


@dataclass(frozen=True)
class ModelFunctions:
    """A classifier as the evaluation calls it: three functions of a batch.

    Each function receives arrays of the library and device of the dataset's `inputs`
    (what the adapters' builders expect), and may return arrays of any library.

    Parameters
    ----------
    predict : callable
        ``predict(ids, mask)`` maps token ids ``(B, n)`` and the padding mask ``(B, n)``
        (True = real token; None when the dataset has none) to class probabilities
        ``(B, C)``.
    attentions : callable
        ``attentions(ids, mask)`` returns the attention probabilities of the same call:
        ``(B, layers, heads, n, n)``, or one ``(B, heads, n, n)`` array per layer.
    input_gradients : callable, optional
        ``input_gradients(ids, mask, targets)`` returns one importance per token
        ``(B, n)`` for the classes ``targets`` ``(B,)`` (e.g. the norm of the gradient of
        the target's probability with respect to the input embeddings). None leaves the
        gradient reference out.
    attention_gradients : callable, optional
        ``attention_gradients(ids, mask, targets)`` returns the attention weights of one
        call and the gradients of the target classes' scores with respect to them, both
        ``(B, layers, heads, n, n)``: what gradient methods (``"gradient_rollout"``,
        :func:`attnflow.gradient_rollout`) explain with. None leaves them out.
    identity : str or callable, optional
        What tells this model apart from others: a text (a checkpoint's hash, a run id)
        or a function returning one, called only when an evaluation writes to an
        `output` folder. The folder records it and refuses a rerun or a resumed run
        whose model has another identity, so results of two models are never mixed.
        The adapters set it to a SHA-256 of the model's weights and their own options.
        None: the functions' own digest (their code, defaults, captured values and the
        module-level values they read; closures over other weights differ), where every
        such value can be read; where one cannot (a framework's module, a bound method),
        a folder is written but never resumed or reused: pass an identity to resume.

    See Also
    --------
    faithfulness : Uses it.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> def predict(ids, mask):  # class 1 when token 3 is present
    ...     p = np.where((ids == 3).any(axis=1), 0.9, 0.1)
    ...     return np.stack([1 - p, p], axis=1)
    >>> def attentions(ids, mask):  # two layers, one head, uniform attention
    ...     n = ids.shape[1]
    ...     return np.full((len(ids), 2, 1, n, n), 1 / n)
    >>> model = attnflow.evaluate.ModelFunctions(predict, attentions)
    >>> model.predict(np.array([[1, 3]]), None)
    array([[0.1, 0.9]])
    """

    predict: Callable[..., Any]
    attentions: Callable[..., Any]
    input_gradients: Callable[..., Any] | None = None
    attention_gradients: Callable[..., Any] | None = None
    identity: str | Callable[[], str] | None = None


@dataclass(frozen=True)
class _Settings:
    """Everything that decides the numbers, recorded in the output folder's manifest."""

    methods: tuple[str, ...]
    references: tuple[str, ...]
    rows: int | str
    replacement: int
    blank_out_score: str
    correlation: str
    nan: str
    fractions: tuple[float, ...] | None
    chunk_size: int
    blank_out_last_token: str = "blank"

    def to_dict(self) -> dict[str, Any]:
        recorded: dict[str, Any] = {
            "methods": list(self.methods),
            "references": list(self.references),
            "rows": self.rows,
            "replacement": self.replacement,
            "blank_out_score": self.blank_out_score,
            "correlation": self.correlation,
            "nan": self.nan,
            "fractions": None if self.fractions is None else list(self.fractions),
            "chunk_size": self.chunk_size,
        }
        # Recorded only when not the default, so folders written before the option
        # existed still resume.
        if self.blank_out_last_token != "blank":
            recorded["blank_out_last_token"] = self.blank_out_last_token
        return recorded


def faithfulness(
    model: ModelFunctions,
    inputs: Array,
    /,
    *,
    replacement: int,
    targets: Array | Sequence[int] | None = None,
    mask: Array | None = None,
    where: Array | None = None,
    methods: Sequence[str] | Mapping[str, Method] = ("raw", "rollout", "flow"),
    rows: int | Literal["max", "mean"] = 0,
    references: Sequence[str] = _REFERENCES,
    blank_out_score: BlankOutScore = "drop",
    blank_out_last_token: LastToken = "blank",
    correlation: RankCorrelation = "spearman",
    nan: NanPolicy = "zero",
    fractions: Sequence[float] | None = ERASER_FRACTIONS,
    chunk_size: int = 64,
    batch_size: int | None = None,
    output: str | Path | None = None,
    force: bool = False,
    n_jobs: int | None = None,
    executor: Executor | None = None,
    progress: bool = False,
    xp: Namespace | None = None,
) -> FaithfulnessReport:
    r"""Measure how faithful attention explanations are, layer by layer, over a dataset.

    The protocol of Abnar & Zuidema (2020, Tables 1-3), with the standard erasure
    metrics beside it. For every sample :math:`x` with target class :math:`t` and every
    method :math:`M` (raw attention, rollout, flow, or your own) at every layer
    :math:`l`, the explanation :math:`e_{M,l}(x)` (one output row, or the maximum or mean
    over rows, as the paper's code) is compared with

    * **blank-out** (:func:`blank_out`): the change of :math:`p_t` when one token is
      replaced by `replacement`;
    * **input gradients**: the model's ``input_gradients`` for :math:`t`,

    by their per-sample rank correlation :math:`\rho(e_{M,l}(x), r(x))`
    (:func:`rank_correlation`), reported as mean and standard deviation over samples.
    The explanations are also scored by ERASER comprehensiveness and sufficiency (AOPC
    over `fractions`, :func:`comprehensiveness`).

    Samples are processed in chunks of `chunk_size`. With `output`, each chunk's results
    are written to that folder as soon as it is done (``chunk-NNNNNN.npz``, no pickle,
    with the settings in ``evaluation.json``); a rerun with the same settings and data
    skips finished chunks and returns the identical report, so an interrupted run loses
    at most the chunk in progress. The folder records the model's identity
    (``model.identity``) and each method's function with its options; a run that differs
    in any of them, or in the settings or data, is refused rather than mixed in, and
    every chunk's identity, row count and checksum are checked when it is read. Attention
    flow, the costly part, runs on `n_jobs` threads or on `executor` (a Dask cluster's,
    for example).

    Parameters
    ----------
    model : ModelFunctions
        The classifier's ``predict``, ``attentions`` and (optionally) ``input_gradients``;
        the adapters build it (e.g. ``attnflow.adapters.torch.model_functions``).
    inputs : array of int, shape (N, n)
        Token ids of the whole dataset (padded), of any array library.
    replacement : int
        The token id that blank-out and the erasure metrics put in place of a token (the
        paper: UNK; BERT-like models: the mask token).
    targets : array or sequence of int, shape (N,), optional
        The class to explain for each sample, typically the gold label; None takes the
        predicted class. With targets, the report gives the model's accuracy.
    mask : bool array of shape (N, n), optional
        True = real token; padding is never evaluated.
    where : bool array of shape (N, n) or (n,), optional
        The positions that take part in the correlations and may be removed by the
        erasure metrics (e.g. everything but ``[CLS]``); by default every real token.
    methods : sequence of str or mapping, default ("raw", "rollout", "flow")
        Names of attnflow's methods (``"raw"``, ``"rollout"``, ``"flow"``,
        ``"gradient_rollout"``), or a mapping from a name (lowercase letters, digits
        and ``_``) to a function with :func:`attnflow.rollout`'s signature, e.g.
        ``{"rollout_03": functools.partial(attnflow.rollout, residual=0.3)}``. Every
        method is evaluated at every layer (``layers="all"``). Gradient rollout (or a
        partial of :func:`attnflow.gradient_rollout`) is given the weights and gradients
        from ``model.attention_gradients`` for the target classes; the others the
        output of ``model.attentions``, which may be value-aware token-mixing matrices
        (``model_functions(model, contributions="alti")``, rolled out with
        ``functools.partial(attnflow.rollout, residual=0.0, normalize_layers=True)``).
    rows : int or {"max", "mean"}, default 0
        The output row that explains the prediction: 0 for a ``[CLS]`` classifier (the
        paper's Tables 1-2), or the maximum or mean over the rows of real tokens (the
        paper's code for DistilBERT).
    references : sequence of str, default ("blank_out", "input_gradients")
        The reference scores to correlate with.
    blank_out_score : {"drop", "abs", "margin", "abs_margin"}, default "drop"
        The blank-out score (:func:`blank_out`): "drop" is the paper's text, "abs_margin"
        its code for DistilBERT, "abs" (with the gold class as `targets`) its code for
        Tables 1-2.
    blank_out_last_token : {"blank", "zero"}, default "blank"
        The last real token of each sequence: blanked out like the others, or given the
        blank-out score 0 without being evaluated (``last_token`` of :func:`blank_out`;
        the paper's code for Tables 1-2 scores its final ``<eos>`` so).
    correlation : {"spearman", "kendall", "spearman_dense"}, default "spearman"
        The rank correlation (:func:`rank_correlation`); ``"spearman_dense"`` is the
        paper code's dense ranks and no-ties formula.
    nan : {"zero", "omit"}, default "zero"
        What an undefined correlation (a constant explanation or reference) counts as:
        0 (the paper's code) or left out of the mean.
    fractions : sequence of float or None, default (0.01, 0.05, 0.1, 0.2, 0.5)
        The ERASER bins for comprehensiveness and sufficiency; None skips them (they
        call the model ``2 x methods x layers x bins`` times per sample, at most).
    chunk_size : int, default 64
        Samples per chunk: the unit of progress, of saved results and of lost work.
    batch_size : int, optional
        Sequences per call of ``predict`` (blank-out and erasure); None makes one call
        per chunk and metric.
    output : path, optional
        A folder for the per-chunk results (created if missing; it must be empty or hold
        this evaluation's earlier results). None keeps them in memory.
    force : bool, default False
        With `output`: discard the folder's results when they are of another evaluation
        (other settings, data, model or methods) and recompute damaged chunks, instead of
        refusing. Files the evaluation did not write are never removed.
    n_jobs : int, optional
        Threads for attention flow, as for :func:`attnflow.flow`.
    executor : concurrent.futures.Executor, optional
        Runs attention flow's tasks instead (e.g. ``distributed.Client().get_executor()``).
    progress : bool, default False
        Show a progress bar over samples (tqdm).
    xp : namespace, optional
        The array namespace of `inputs`; inferred by default.

    Returns
    -------
    FaithfulnessReport
        Mean and standard deviation of each correlation and AOPC per method and layer,
        the accuracy, and the per-sample values (``report.samples``).

    Raises
    ------
    ValueError, TypeError
        On bad arguments, before the model is called.
    EvaluationFolderError
        If `output` holds another evaluation (the message names what differs) or a
        damaged chunk (naming it and what is wrong), or another run is writing to it.

    See Also
    --------
    rank_correlation, blank_out, comprehensiveness, sufficiency : The pieces.

    Notes
    -----
    The standard deviation is the population one (``ddof=0``), as in the paper's code.
    Blank-out positions where the model was not evaluated (padding) and NaN gradients
    are left out of that sample's correlation.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] J. DeYoung et al., "ERASER: A Benchmark to Evaluate Rationalized NLP Models",
       ACL 2020, https://arxiv.org/abs/1911.03429

    Examples
    --------
    A model whose class rests on token 3, and whose (made-up) attention looks at it:

    >>> import numpy as np
    >>> import attnflow
    >>> def predict(ids, mask):
    ...     p = np.where((ids == 3).any(axis=1), 0.9, 0.1)
    ...     return np.stack([1 - p, p], axis=1)
    >>> def attentions(ids, mask):
    ...     w = np.full((len(ids), 2, 1, 4, 4), 0.1) + 0.6 * (ids == 3)[:, None, None, None, :]
    ...     return w / w.sum(axis=-1, keepdims=True)
    >>> ids = np.array([[1, 3, 2, 2], [3, 1, 1, 2], [2, 2, 3, 1]])
    >>> report = attnflow.evaluate.faithfulness(
    ...     attnflow.evaluate.ModelFunctions(predict, attentions),
    ...     ids,
    ...     replacement=0,
    ...     references=["blank_out"],
    ...     fractions=[0.25],
    ... )
    >>> report.correlation_mean("rollout", "blank_out").round(2)
    array([0.51, 0.88])
    >>> print(report.to_markdown(aopc=False))
    Spearman correlation with blank-out (mean ± sd over 3 samples)
    <BLANKLINE>
    | method  | L1          | L2          |
    |---------|-------------|-------------|
    | raw     | 1.00 ± 0.00 | 1.00 ± 0.00 |
    | rollout | 0.51 ± 0.34 | 0.88 ± 0.09 |
    | flow    | 0.51 ± 0.34 | 0.88 ± 0.09 |
    """
    started = time.perf_counter()
    _check_model(model)
    functions = _check_methods(methods)
    gradient_methods = [name for name, method in functions.items() if _uses_gradients(method)]
    if gradient_methods and model.attention_gradients is None:
        msg = (
            f"`methods` {gradient_methods} weight the attention by its gradients, but "
            "`model.attention_gradients` is None. Build the model functions with it (e.g. "
            "attnflow.adapters.torch.model_functions(model)) or drop these methods."
        )
        raise ValueError(msg)
    settings = _Settings(
        methods=tuple(functions),
        references=_check_references(references, model),
        rows=_check_rows(rows),
        replacement=check_replacement(replacement, integer=True),
        blank_out_score=_check_choice("blank_out_score", blank_out_score, BLANK_OUT_SCORES),
        correlation=_check_choice("correlation", correlation, RANK_CORRELATIONS),
        nan=_check_choice("nan", nan, NAN_POLICIES),
        fractions=None if fractions is None else _fractions(fractions),
        chunk_size=_check_positive("chunk_size", chunk_size),
        blank_out_last_token=_check_choice(
            "blank_out_last_token", blank_out_last_token, LAST_TOKENS
        ),
    )
    if settings.blank_out_last_token != "blank" and "blank_out" not in settings.references:
        msg = (
            f"`blank_out_last_token={blank_out_last_token!r}` sets how blank-out scores the "
            "last token, but `references` has no 'blank_out'; add it or leave the option out."
        )
        raise ValueError(msg)
    batch_size = check_batch_size(batch_size)
    _check_flag("progress", progress)
    _check_flag("force", force)
    dataset = read_token_ids(inputs, mask, xp=xp, batch="samples")
    n_samples, n_tokens = dataset.host.shape
    host_targets = _check_targets(targets, n_samples)
    host_where = _check_where(where, n_samples, n_tokens)
    flow_options = {"n_jobs": n_jobs, "executor": executor}
    check_flow_options(n_jobs, executor, False, True, None, MISSING)  # flow's own checks, up front
    run = functools.partial(
        _evaluate_chunk,
        model=model,
        functions=functions,
        dataset=dataset,
        targets=host_targets,
        where=host_where,
        settings=settings,
        batch_size=batch_size,
        flow_options=flow_options,
    )

    def recorded() -> dict[str, Any]:  # only with `output`: identities may take a while
        return {
            **settings.to_dict(),
            "samples": n_samples,
            "tokens": n_tokens,
            "data": fingerprint(dataset.host, dataset.mask, host_targets, host_where),
            "model": _model_identity(model),
            "functions": _function_identities(functions),
        }

    samples = _run_chunks(
        run, n_samples, settings.chunk_size, output, recorded, progress, force=force
    )
    return FaithfulnessReport(
        samples=samples,
        methods=settings.methods,
        references=settings.references,
        correlation=settings.correlation,
        blank_out_score=settings.blank_out_score,
        rows=settings.rows,
        fractions=settings.fractions,
        seconds=time.perf_counter() - started,
        blank_out_last_token=settings.blank_out_last_token,
    )


def _model_identity(model: ModelFunctions) -> str | None:
    """Return the model's identity as the output folder records it (None: none known).

    Without a given identity, the functions' own digest (:func:`identify_functions`: their
    code and every value they read), or None where they hold an object whose state
    cannot be read; a folder recorded without one is never resumed (`_run_chunks`).
    """
    identity: object = model.identity() if callable(model.identity) else model.identity
    if identity is None:
        functions = (
            model.predict,
            model.attentions,
            model.input_gradients,
            model.attention_gradients,
        )
        derived = identify_functions(*functions)
        return None if derived is None else f"functions {derived}"
    if not isinstance(identity, str):
        msg = f"`model.identity` must be a str or a function returning one; got {identity!r}."
        raise TypeError(msg)
    return identity


def _function_identities(functions: Mapping[str, Method]) -> dict[str, str]:
    """Each method's function and options, as text (``module.qualname(options)``)."""
    return {name: describe_function(function) for name, function in functions.items()}


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        msg = f"`{name}` must be True or False; got {value!r}."
        raise TypeError(msg)


def _run_chunks(
    run: Callable[[int, int], dict[str, np.ndarray]],
    n_samples: int,
    chunk_size: int,
    output: str | Path | None,
    recorded: Callable[[], Mapping[str, Any]],
    progress: bool,
    *,
    force: bool = False,
) -> dict[str, np.ndarray]:
    """Evaluate every chunk (skipping those already in `output`) and join the results."""
    chunks = [
        (start, min(n_samples, start + chunk_size)) for start in range(0, n_samples, chunk_size)
    ]
    run = functools.partial(_retrying, run)
    bar = _progress_bar(progress, n_samples)
    results: dict[int, dict[str, np.ndarray]] = {}
    try:
        if output is None:
            for number, (start, stop) in enumerate(chunks):
                results[number] = run(start, stop)
                if bar is not None:
                    bar.update(stop - start)
        else:
            settings = recorded()
            unknown = (
                None
                if "model" not in settings or settings["model"] is not None
                else (
                    "its model functions carry no identity and hold objects whose state "
                    "cannot be read (a framework's module, a bound method), so the folder "
                    "cannot tell whether its results are this model's"
                )
            )
            if unknown is not None:
                logger.warning(
                    "%s; these results are written but cannot be resumed or reused: pass "
                    "ModelFunctions(..., identity=...) (e.g. a hash of the checkpoint), as the "
                    "adapters' model_functions() do",
                    unknown,
                )
            store = ChunkStore(output, settings, chunks, force=force, not_resumable=unknown)
            with store.open():
                done = store.done()
                if bar is not None:
                    bar.update(sum(b - a for i, (a, b) in enumerate(chunks) if i in done))
                for number, (start, stop) in enumerate(chunks):
                    if number not in done:
                        store.write(number, run(start, stop))
                        if bar is not None:
                            bar.update(stop - start)
                # The report is built from what is on disk, so a resumed run and a
                # fresh one give the identical table.
                results = {number: store.read(number) for number in range(len(chunks))}
    finally:
        if bar is not None:
            bar.close()
    return {
        name: np.concatenate([results[i][name] for i in range(len(chunks))]) for name in results[0]
    }


def _evaluate_chunk(
    start: int,
    stop: int,
    *,
    model: ModelFunctions,
    functions: Mapping[str, Method],
    dataset: ModelInputs,
    targets: np.ndarray | None,
    where: np.ndarray | None,
    settings: _Settings,
    batch_size: int | None,
    flow_options: Mapping[str, Any],
) -> dict[str, np.ndarray]:
    """Every result of samples ``start:stop``, as host arrays keyed by name.

    The model sees each distinct input of the chunk once: the unperturbed sequences are
    predicted here, and blank-out, comprehensiveness and sufficiency of every method read
    them (and any perturbed copy another metric already made) from the chunk's cache.
    """
    host_mask = None if dataset.mask is None else dataset.mask[start:stop]
    predict = _with_mask(model.predict, has_mask=host_mask is not None)
    with shared_predictions(predict):
        return _evaluate_chunk_once(
            start,
            stop,
            predict,
            model=model,
            functions=functions,
            dataset=dataset,
            targets=targets,
            where=where,
            settings=settings,
            batch_size=batch_size,
            flow_options=flow_options,
        )


def _evaluate_chunk_once(
    start: int,
    stop: int,
    predict: Callable[..., Any],
    *,
    model: ModelFunctions,
    functions: Mapping[str, Method],
    dataset: ModelInputs,
    targets: np.ndarray | None,
    where: np.ndarray | None,
    settings: _Settings,
    batch_size: int | None,
    flow_options: Mapping[str, Any],
) -> dict[str, np.ndarray]:
    """:func:`_evaluate_chunk` with its prediction cache in place."""
    host_ids = dataset.host[start:stop]
    host_mask = None if dataset.mask is None else dataset.mask[start:stop]
    ids = dataset.to_model(host_ids)
    mask = None if host_mask is None else dataset.to_model(host_mask)

    def originals(begin: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        return host_ids[begin:end], None if host_mask is None else host_mask[begin:end]

    chunk_inputs = ModelInputs(
        host_ids, host_mask, dataset.xp, dataset.device, dataset.boundary, dataset.like
    )
    probabilities, _ = call_model(
        predict, row_batches(len(host_ids), batch_size, originals), chunk_inputs, len(host_ids)
    )
    predicted = np.argmax(probabilities, axis=1)
    chosen = resolve_targets(
        None if targets is None else targets[start:stop], predicted, probabilities.shape[1]
    )
    out: dict[str, np.ndarray] = {
        "index": np.arange(start, stop),
        "predicted": predicted,
        "target": chosen,
        "probability": probabilities[np.arange(len(chosen)), chosen],
    }
    if targets is not None:
        out["label"] = targets[start:stop]

    real = np.ones(host_ids.shape, dtype=bool) if host_mask is None else host_mask
    included = real if where is None else real & where[start:stop]
    attentions = model.attentions(ids, mask)
    weighted: tuple[Any, Any] | None = None
    if any(_uses_gradients(method) for method in functions.values()):
        assert model.attention_gradients is not None  # checked with the arguments
        weighted = _read_pair(model.attention_gradients(ids, mask, dataset.to_model(chosen)))
    for name, method in functions.items():
        inputs = weighted if _uses_gradients(method) else (attentions,)
        assert inputs is not None
        out[f"scores.{name}"] = _explain(
            method, name, inputs, host_mask, settings.rows, flow_options
        )
    reference_scores: dict[str, np.ndarray] = {}
    if "blank_out" in settings.references:
        reference_scores["blank_out"] = to_host(
            blank_out(
                predict,
                ids,
                replacement=settings.replacement,
                target=chosen,
                score=settings.blank_out_score,  # type: ignore[arg-type]
                mask=mask,
                batch_size=batch_size,
                last_token=settings.blank_out_last_token,  # type: ignore[arg-type]
            ),
            name="blank_out",
        )
    if "input_gradients" in settings.references:
        assert model.input_gradients is not None  # checked with the arguments
        gradients = model.input_gradients(ids, mask, dataset.to_model(chosen))
        reference_scores["input_gradients"] = _read_per_token(gradients, host_ids.shape)
    _correlate(out, reference_scores, included, functions, settings.correlation, settings.nan)
    if settings.fractions is not None:
        for name in functions:
            for metric, function in (
                ("comprehensiveness", comprehensiveness),
                ("sufficiency", sufficiency),
            ):
                out[f"{metric}.{name}"] = to_host(
                    function(
                        predict,
                        ids,
                        out[f"scores.{name}"],
                        replacement=settings.replacement,
                        target=chosen,
                        fractions=settings.fractions,
                        mask=mask,
                        where=included,
                        batch_size=batch_size,
                    )
                )
    return out


def _correlate(
    out: dict[str, np.ndarray],
    reference_scores: Mapping[str, np.ndarray],
    included: np.ndarray,
    functions: Mapping[str, Method],
    correlation: str,
    nan: str,
) -> None:
    """Add each method's per-layer rank correlation with each reference to `out`."""
    for reference, values in reference_scores.items():
        out[f"reference.{reference}"] = values
        usable = included & np.isfinite(values)
        for name in functions:
            out[f"correlation.{name}.{reference}"] = to_host(
                rank_correlation(
                    out[f"scores.{name}"],
                    values[:, None, :],
                    where=usable[:, None, :],
                    method=correlation,  # type: ignore[arg-type]
                    nan=nan,  # type: ignore[arg-type]
                )
            )


def faithfulness_from_outputs(
    attentions: Array,
    references: Mapping[str, Array],
    /,
    *,
    mask: Array | None = None,
    where: Array | None = None,
    predictions: Array | None = None,
    labels: Array | None = None,
    methods: Sequence[str] | Mapping[str, Method] = ("raw", "rollout", "flow"),
    rows: int | Literal["max", "mean"] = 0,
    correlation: RankCorrelation = "spearman",
    nan: NanPolicy = "zero",
    chunk_size: int = 64,
    output: str | Path | None = None,
    force: bool = False,
    n_jobs: int | None = None,
    executor: Executor | None = None,
    progress: bool = False,
) -> FaithfulnessReport:
    """Correlate explanations with reference scores already computed from a model.

    The correlation half of :func:`faithfulness`, for model outputs saved earlier (or
    computed by other tools): each method's explanation at every layer is compared with
    each reference by its per-sample rank correlation, in chunks, resumable with
    `output`. Erasure metrics need the model and are not computed.

    Parameters
    ----------
    attentions : array of shape (N, layers, heads, n, n) or (N, layers, n, n)
        The attention of every sample; a 4-d array is taken as already head-fused.
    references : mapping of str to array of shape (N, n)
        Reference importance per token, e.g. ``{"blank_out": ..., "input_gradients":
        ...}``; NaN marks positions that were not evaluated.
    mask : bool array of shape (N, n), optional
        True = real token.
    where : bool array of shape (N, n) or (n,), optional
        The positions that take part in the correlations (e.g. all but ``[CLS]``).
    predictions, labels : int array of shape (N,), optional
        The model's predicted classes and the gold labels, for the accuracy.
    methods, rows, correlation, nan, chunk_size, output, force, n_jobs, executor, progress
        As for :func:`faithfulness`.

    Returns
    -------
    FaithfulnessReport
        Correlations per method, reference and layer (no AOPC).

    Raises
    ------
    ValueError, TypeError
        On arrays whose shapes do not agree, or bad options.

    See Also
    --------
    faithfulness : The whole protocol, calling the model.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> rng = np.random.default_rng(0)
    >>> attentions = rng.dirichlet(np.ones(5), size=(8, 3, 5))  # 8 samples, 3 fused layers
    >>> blank = rng.random((8, 5))
    >>> report = attnflow.evaluate.faithfulness_from_outputs(attentions, {"blank_out": blank})
    >>> report.correlation_mean("flow", "blank_out").shape
    (3,)
    """
    functions = _check_methods(methods)
    gradient_methods = [name for name, method in functions.items() if _uses_gradients(method)]
    if gradient_methods:
        msg = (
            f"`methods` {gradient_methods} need the gradients of the attention, which "
            "faithfulness_from_outputs does not take; evaluate them with "
            "attnflow.evaluate.faithfulness and a model with `attention_gradients`."
        )
        raise ValueError(msg)
    row_choice = _check_rows(rows)
    correlation = _check_choice("correlation", correlation, RANK_CORRELATIONS)  # type: ignore[assignment]
    nan = _check_choice("nan", nan, NAN_POLICIES)  # type: ignore[assignment]
    chunk_size = _check_positive("chunk_size", chunk_size)
    _check_flag("progress", progress)
    _check_flag("force", force)
    check_flow_options(n_jobs, executor, False, True, None, MISSING)
    host = to_host(attentions, name="attentions")
    if host.ndim not in (4, 5) or host.shape[-1] != host.shape[-2]:
        msg = (
            "`attentions` must have shape (N, layers, heads, n, n), or (N, layers, n, n) "
            f"with the heads fused; got shape {host.shape}."
        )
        raise ValueError(msg)
    n_samples, n_tokens = host.shape[0], host.shape[-1]
    given_references: object = references
    if not isinstance(given_references, Mapping) or not given_references:
        msg = "`references` must be a non-empty mapping from a name to an (N, n) array."
        raise TypeError(msg)
    reference_scores = {}
    for name, values in given_references.items():
        if not isinstance(name, str) or not name or set(name) - set(_NAME):
            msg = f"reference names must be lowercase letters, digits and '_'; got {name!r}."
            raise ValueError(msg)
        reference_scores[name] = _read_per_token(values, (n_samples, n_tokens))
    host_mask = None
    if mask is not None:
        host_mask = to_host(mask, name="mask", keep_dtype=True)
        if host_mask.dtype != np.bool_ or host_mask.shape != (n_samples, n_tokens):
            msg = f"`mask` must be a boolean array of shape ({n_samples}, {n_tokens}); got {describe(mask)}."
            raise ValueError(msg)
    host_where = _check_where(where, n_samples, n_tokens)
    known: dict[str, np.ndarray] = {}
    for name, given in (("predictions", predictions), ("labels", labels)):
        checked = _check_targets(given, n_samples)
        if checked is not None:
            known[name] = checked
    heads = None if host.ndim == 4 else "mean"
    recorded = {
        "methods": list(functions),
        "references": sorted(reference_scores),
        "rows": row_choice,
        "correlation": correlation,
        "nan": nan,
        "chunk_size": chunk_size,
        "samples": n_samples,
        "tokens": n_tokens,
        "data": fingerprint(
            host,
            host_mask,
            host_where,
            *(reference_scores[k] for k in sorted(reference_scores)),
            known.get("predictions"),
            known.get("labels"),
        ),
        "functions": _function_identities(functions),
    }
    flow_options = {"n_jobs": n_jobs, "executor": executor}

    def run(start: int, stop: int) -> dict[str, np.ndarray]:
        chunk_mask = None if host_mask is None else host_mask[start:stop]
        out: dict[str, np.ndarray] = {"index": np.arange(start, stop)}
        for name, values in known.items():
            out["predicted" if name == "predictions" else "label"] = values[start:stop]
        for name, method in functions.items():
            method_with_heads = functools.partial(method, heads=heads)
            out[f"scores.{name}"] = _explain(
                method_with_heads,
                name,
                (host[start:stop],),
                chunk_mask,
                row_choice,
                flow_options,
                flow_like=_is_flow(method),
            )
        real = np.ones((stop - start, n_tokens), dtype=bool) if chunk_mask is None else chunk_mask
        included = real if host_where is None else real & host_where[start:stop]
        chunk_references = {k: v[start:stop] for k, v in reference_scores.items()}
        _correlate(out, chunk_references, included, functions, correlation, nan)
        return out

    samples = _run_chunks(
        run, n_samples, chunk_size, output, lambda: recorded, progress, force=force
    )
    return FaithfulnessReport(
        samples=samples,
        methods=tuple(functions),
        references=tuple(reference_scores),
        correlation=correlation,
        blank_out_score="given",
        rows=row_choice,
        fractions=None,
    )


def _retrying(
    run: Callable[[int, int], dict[str, np.ndarray]], start: int, stop: int
) -> dict[str, np.ndarray]:
    """Run one chunk; if flow's workers die (killed, out of memory), run it once more."""
    try:
        return run(start, stop)
    except Exception as error:
        if not _workers_lost(error):
            raise
        logger.warning(
            "workers died while evaluating samples %d-%d; running them again", start, stop - 1
        )
        return run(start, stop)


def _workers_lost(error: BaseException) -> bool:
    # Dask's distributed.KilledWorker is matched by name: distributed is optional.
    return isinstance(error, WorkersLostError) or type(error).__name__ == "KilledWorker"


def _with_mask(predict: Callable[..., Any], *, has_mask: bool) -> Callable[..., Any]:
    """``predict`` as the metrics call it: with the mask when there is one, else None."""
    if has_mask:
        return predict
    return lambda ids: predict(ids, None)


def _uses_gradients(method: Method) -> bool:
    """Whether `method` (or a partial of it) needs the gradients too, by the registry."""
    spec = method_of_function(method)
    return spec is not None and spec.gradients


def _is_flow(method: Method) -> bool:
    """Whether `method` (or a partial of it) runs on the host (max-flow), by the registry."""
    spec = method_of_function(method)
    return spec is not None and spec.host_only


def _read_pair(given: object) -> tuple[Any, Any]:
    if not (isinstance(given, tuple | list) and len(given) == 2):
        msg = (
            "`model.attention_gradients` must return a pair (attentions, gradients), each "
            f"(B, layers, heads, n, n); got {describe(given)}."
        )
        raise ValueError(msg)
    return given[0], given[1]


def _explain(
    method: Method,
    name: str,
    inputs: Sequence[Any],
    host_mask: np.ndarray | None,
    rows: int | str,
    flow_options: Mapping[str, Any],
    *,
    flow_like: bool | None = None,
) -> np.ndarray:
    """One method at every layer, reduced to one row per sample: ``(B, layers, n)``.

    `inputs` are the method's positional arguments: the attentions, and for gradient
    methods their gradients.
    """
    attentions = inputs[0]
    first = attentions[0] if isinstance(attentions, list | tuple) else attentions
    mask = None
    if host_mask is not None:
        (converted,), _ = enter_boundary([first], ["attentions"])
        xp = array_namespace(converted)
        mask = xp.asarray(host_mask, device=array_device(converted))
    options: dict[str, Any] = {"layers": "all", "mask": mask}
    if _is_flow(method) if flow_like is None else flow_like:
        options.update({k: v for k, v in flow_options.items() if v is not None})
    aggregate = isinstance(rows, str)  # "max" or "mean" (checked): every row, reduced below
    options["rows"] = None if aggregate else rows
    values = to_host(method(*inputs, **options), name=f"the {name} explanation")
    if aggregate:
        # (B, L, n, n): reduce over the output rows of real tokens (padded rows are 0).
        if values.ndim != 4:
            msg = f"method {name!r} returned shape {values.shape} for rows=None; expected (B, layers, n, n)."
            raise ValueError(msg)
        if rows == "max":
            values = values.max(axis=-2)
        else:
            real = values.shape[-1] if host_mask is None else host_mask.sum(axis=1)[:, None, None]
            values = values.sum(axis=-2) / real
    if values.ndim != 3:
        msg = f"method {name!r} returned shape {values.shape}; expected (batch, layers, tokens)."
        raise ValueError(msg)
    return values


def _read_per_token(values: Any, shape: tuple[int, ...]) -> np.ndarray:
    (converted,), _ = enter_boundary([values], ["input_gradients(...)"])
    if getattr(converted, "shape", None) is None or tuple(converted.shape) != tuple(shape):
        msg = (
            f"`model.input_gradients` must return one value per token, shape {tuple(shape)}; "
            f"got {describe(values)}."
        )
        raise ValueError(msg)
    return to_host(converted, name="input_gradients(...)")


# The methods known by name: the registry's methods over attention weights.
_KNOWN_METHODS: dict[str, Method] = {name: METHODS[name].function() for name in ATTENTION_METHODS}


def _check_model(model: object) -> None:
    if not isinstance(model, ModelFunctions):
        msg = (
            "`model` must be an attnflow.evaluate.ModelFunctions (predict, attentions, "
            f"input_gradients), e.g. from attnflow.adapters.torch.model_functions; got "
            f"{type(model).__name__}."
        )
        raise TypeError(msg)
    for field in ("predict", "attentions"):
        if not callable(getattr(model, field)):
            msg = f"`model.{field}` must be callable; got {getattr(model, field)!r}."
            raise TypeError(msg)


def _check_methods(methods: object) -> dict[str, Method]:
    known = _KNOWN_METHODS
    if isinstance(methods, Mapping):
        chosen = dict(methods)
    elif isinstance(methods, Sequence) and not isinstance(methods, str):
        unknown = [m for m in methods if m not in known]
        if unknown:
            msg = (
                f"`methods` names unknown methods {unknown}; known: {sorted(known)}. Pass a "
                "mapping from a name to a function for others."
            )
            raise ValueError(msg)
        chosen = {m: known[m] for m in methods}
    else:
        msg = (
            f"`methods` must be a sequence of names or a mapping name -> function; got {methods!r}."
        )
        raise TypeError(msg)
    if not chosen:
        msg = "`methods` must name at least one method."
        raise ValueError(msg)
    for name, function in chosen.items():
        if not isinstance(name, str) or not name or set(name) - set(_NAME):
            msg = f"method names must be lowercase letters, digits and '_' (they name files); got {name!r}."
            raise ValueError(msg)
        if not callable(function):
            msg = f"method {name!r} must be a function like attnflow.rollout; got {function!r}."
            raise TypeError(msg)
    return chosen


def _check_references(references: object, model: ModelFunctions) -> tuple[str, ...]:
    if isinstance(references, str) or not isinstance(references, Sequence):
        msg = f"`references` must be a sequence drawn from {_REFERENCES}; got {references!r}."
        raise TypeError(msg)
    unknown = [r for r in references if r not in _REFERENCES]
    if unknown or len(set(references)) != len(references):
        msg = f"`references` must be distinct names from {_REFERENCES}; got {list(references)}."
        raise ValueError(msg)
    if "input_gradients" in references and model.input_gradients is None:
        msg = (
            "`references` includes 'input_gradients' but `model.input_gradients` is None; "
            "build the model with an adapter (which takes gradients) or pass "
            "references=['blank_out']."
        )
        raise ValueError(msg)
    return tuple(references)


def _check_rows(rows: object) -> int | str:
    if isinstance(rows, str):
        return _check_choice("rows", rows, _ROW_AGGREGATIONS)
    if isinstance(rows, bool) or not isinstance(rows, int):
        msg = f'`rows` must be an output position (int) or "max" or "mean"; got {rows!r}.'
        raise TypeError(msg)
    return rows


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        msg = f"`{name}` must be one of {choices}; got {value!r}."
        raise ValueError(msg)
    return str(value)


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"`{name}` must be a positive int; got {value!r}."
        raise ValueError(msg)
    return value


def _fractions(fractions: object) -> tuple[float, ...]:
    from ._erasure import _check_fractions

    return _check_fractions(fractions)


def _check_targets(targets: object, n_samples: int) -> np.ndarray | None:
    if targets is None:
        return None
    if isinstance(targets, Sequence):
        host = np.asarray(targets)
    else:
        (converted,), _ = enter_boundary([targets], ["targets"])
        if getattr(converted, "shape", None) is None:
            msg = f"`targets` must be an array of class indices, shape ({n_samples},); got {describe(targets)}."
            raise TypeError(msg)
        host = to_host(converted, name="targets", keep_dtype=True)
    if host.shape != (n_samples,) or host.dtype.kind not in "iu" or (host < 0).any():
        msg = (
            f"`targets` must hold one non-negative integer class per sample, shape "
            f"({n_samples},); got shape {host.shape} and dtype {host.dtype}."
        )
        raise ValueError(msg)
    return host.astype(np.int64)


def _check_where(where: object, n_samples: int, n_tokens: int) -> np.ndarray | None:
    if where is None:
        return None
    (converted,), _ = enter_boundary([where], ["where"])
    if getattr(converted, "shape", None) is None:
        msg = f"`where` must be a boolean array of shape ({n_samples}, {n_tokens}) or ({n_tokens},); got {describe(where)}."
        raise TypeError(msg)
    host = to_host(converted, name="where", keep_dtype=True)
    if host.dtype != np.bool_ or host.shape not in ((n_tokens,), (n_samples, n_tokens)):
        msg = (
            f"`where` must be a boolean array of shape ({n_samples}, {n_tokens}) or "
            f"({n_tokens},); got shape {host.shape} and dtype {host.dtype}."
        )
        raise ValueError(msg)
    return np.broadcast_to(host, (n_samples, n_tokens)).copy()


def _progress_bar(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        msg = "`progress=True` needs tqdm: `pip install tqdm` (or `attnflow[progress]`)."
        raise ImportError(msg) from None
    return tqdm(total=total, unit="sample", desc="faithfulness")
