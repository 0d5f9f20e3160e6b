"""Gradients from PyTorch models, of attention weights and of the embedding output.

:func:`attention_gradients` and :func:`input_gradients` differentiate a classifier's class
or a causal LM's vocabulary id at chosen rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from attnflow._rows import Rows
from attnflow._validation import check_rows

from ._common import (
    Reduction,
    Score,
    TargetScore,
    check_class_values,
    check_reduce_output,
    check_scalar_shape,
    check_scalar_target,
    check_target_type,
    score_values,
)
from ._torch_capture import capture
from ._torch_hooks import Hooks

__all__ = ["attention_gradients", "input_gradients"]


def _weights_and_gradients(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    target: int | Sequence[int] | torch.Tensor | None,
    rows: int | Sequence[int] | None = None,
    target_score: TargetScore = "logit",
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, Rows | None]:
    """Return the weights of one call, d score / d A per score, the mask, LM rows.

    A classifier (logits ``(batch, classes)``) gives one gradient stack and no rows. A
    causal LM (logits ``(batch, n, vocab)``) gives one gradient stack per explained row
    (all ``n`` for `rows` None): that of the `target` token's score at that row, and the
    rows as non-negative positions. The score is the logit or the log-probability
    (`target_score`, :func:`_target_score`).
    """
    check_target_type(target, _describe_target)
    explained: Rows | None = None

    def scores(logits: torch.Tensor) -> list[torch.Tensor]:
        nonlocal explained
        if logits.ndim == 2:
            return [_target_score(logits, target, target_score)]
        explained = _lm_rows(rows, int(logits.shape[1]))
        return [
            _target_score(logits[:, row, :], target, target_score)
            for row in explained.positions(int(logits.shape[1]))
        ]

    weights, gradients, mask = _differentiate_each(
        model, inputs, _lm_or_classifier_logits, scores, 'explain(method="gradient_rollout")'
    )
    return weights, gradients, mask, explained


def _target_score(
    logits: torch.Tensor,
    target: int | Sequence[int] | torch.Tensor | None,
    target_score: TargetScore,
) -> torch.Tensor:
    r"""Return the explained score of `logits` ``(batch, classes)``, summed over the batch.

    ``"logit"``: :math:`\sum_b z_{b, t_b}`; ``"log_probability"``: :math:`\sum_b
    \log \operatorname{softmax}(z_b)_{t_b} = \sum_b \big(z_{b, t_b} - \log \sum_v
    e^{z_{b, v}}\big)`, whose gradient is :math:`\nabla z_{t} - \sum_v p_v \nabla z_v`.
    The target :math:`t_b` is `target` (None: the argmax, the same for both scores).
    Samples are independent, so the sum's gradient gives each sample's own.
    """
    classes = _target_classes(target, logits.shape[0], logits.shape[-1], logits.detach())
    values = _class_values(logits, target_score)
    return values.gather(-1, classes.to(logits.device)[:, None]).sum()


def _class_values(logits: torch.Tensor, output: Score | TargetScore) -> torch.Tensor:
    """Probabilities, log-probabilities or the logits themselves (:func:`score_values`)."""
    values: torch.Tensor = score_values(
        logits,
        output,
        lambda z: torch.softmax(z, dim=-1),
        lambda z: torch.log_softmax(z, dim=-1),
    )
    return values


def _lm_rows(rows: int | Sequence[int] | None, n: int) -> Rows:
    """Return the explained positions of a causal LM, checked on `n`, every one listed."""
    try:
        checked = check_rows(rows, n)
    except (TypeError, ValueError, IndexError):
        msg = (
            f"`rows` must be positions of the {n} tokens (an int, a non-empty sequence of "
            f"ints, or None for all); got {rows!r}. Use rows=-1 for the next-token "
            "prediction of the last position."
        )
        raise ValueError(msg) from None
    return Rows(checked.positions(n), single=checked.single)


def _lm_or_classifier_logits(result: Any) -> torch.Tensor:
    """Read logits ``(batch, classes)`` or a causal LM's ``(batch, n, vocab)``."""
    logits = result if isinstance(result, torch.Tensor) else getattr(result, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.is_floating_point():
        return logits
    return _logits(result)


def _differentiate(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    read: Callable[[Any], Any],
    score: Callable[[Any], torch.Tensor],
    caller: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the model once, `read` its result, and differentiate ``score(read(result))``.

    Return the attention weights (detached), the score's gradients with respect to them
    (zero for a layer the score does not depend on) and the padding mask; `caller` names
    the public function in the errors.
    """
    weights, gradients, mask = _differentiate_each(
        model, inputs, read, lambda result: [score(result)], caller
    )
    return weights, gradients[0], mask


def _refuse_inference_mode(caller: str) -> None:
    """Raise a RuntimeError under ``torch.inference_mode()``: `caller` needs autograd.

    Checked before any work: inside inference mode no tensor can be differentiated, not
    even under ``torch.enable_grad()``.
    """
    if torch.is_inference_mode_enabled():
        msg = (
            f"{caller} needs autograd, which torch.inference_mode() switches off for good "
            "(tensors made inside cannot be differentiated); call it outside the "
            "inference_mode block (an outer torch.no_grad() is fine)."
        )
        raise RuntimeError(msg)


def _differentiate_each(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    read: Callable[[Any], Any],
    scores: Callable[[Any], Sequence[torch.Tensor]],
    caller: str,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """:func:`_differentiate` for several scalars of one forward pass, one backward each."""
    _refuse_inference_mode(caller)
    with torch.enable_grad():
        with capture(model) as cap:
            result = read(_call(model, inputs))
        weights = cap.attentions  # checks that one stack of layers was captured
        gradients = gradients_of(list(scores(result)), cap.records, caller)
    return weights.detach(), gradients, cap.mask


def gradients_of(
    values: Sequence[torch.Tensor], records: Sequence[torch.Tensor], caller: str
) -> list[torch.Tensor]:
    """Differentiate each scalar of `values` with respect to the captured weights `records`.

    One backward pass per value; the gradients of each are stacked as the weights are,
    ``(*batch, layers, heads, n, n)``, zero for a layer the value does not depend on.
    `caller` names the public function in the error raised when the weights are not on
    the autograd graph.
    """
    if not all(v.requires_grad for v in values) or not all(w.requires_grad for w in records):
        msg = (
            "The attention weights are not on the autograd graph, so no gradient can "
            f"reach them: {caller} needs parameters (or inputs) "
            "that require grad upstream of the attention; unfreeze the model "
            "(model.requires_grad_(True)) for the call."
        )
        raise RuntimeError(msg)
    # A layer the score does not depend on gets None (allow_unused): its gradient is 0.
    gradients = []
    for index, value in enumerate(values):
        grads: Sequence[torch.Tensor | None] = torch.autograd.grad(
            value, list(records), allow_unused=True, retain_graph=index < len(values) - 1
        )
        gradients.append(
            torch.stack(
                [
                    torch.zeros_like(w) if g is None else g
                    for w, g in zip(records, grads, strict=True)
                ],
                dim=-4,
            )
        )
    return gradients


def attention_gradients(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    target: Callable[[Any], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiate a scalar of the model's output by its attention weights.

    The one-call form of ``capture(model, gradients=True)`` plus a backward pass, named
    as in the Keras adapter (:func:`attnflow.adapters.keras.attention_gradients`): runs
    ``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)`` (as :func:`explain`)
    inside :func:`capture` with autograd on, maps the output to a scalar with `target` and
    differentiates it with ``torch.autograd.grad``, so the parameters' ``.grad`` are left
    untouched. Feed the result to :func:`attnflow.gradient_rollout`.

    Parameters
    ----------
    model : torch.nn.Module
        The model (see :func:`capture`), in eval mode for deterministic gradients (its
        mode is not changed here).
    inputs : mapping, sequence or Tensor
        The model's inputs.
    target : callable
        Maps the model's output to a scalar tensor (one element), e.g.
        ``lambda out: out.logits[:, 3].sum()``. Samples of a batch do not interact, so a
        sum over the batch gives each sample's own gradients.

    Returns
    -------
    attentions : Tensor
        ``(*batch, layers, heads, n, n)``, as ``cap.attentions`` of :func:`capture`,
        detached.
    gradients : Tensor
        The same shape: ``d target / d attentions``. Zero for a layer whose weights do not
        reach the target.

    Raises
    ------
    TypeError
        If `model` is not a module, `target` is not callable or does not return a tensor.
    ValueError
        If `target` does not give a scalar, or as raised by :func:`capture` (e.g. the
        attention calls cannot be stacked: an encoder-decoder model).
    RuntimeError
        Under ``torch.inference_mode()``, or when the attention weights are not on the
        autograd graph (every parameter frozen).

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import attention_gradients
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> attentions, gradients = attention_gradients(
    ...     model.eval(), torch.randn(1, 5, 8), target=lambda y: y[:, 0].sum()
    ... )
    >>> tuple(gradients.shape) == tuple(attentions.shape) == (1, 2, 2, 5, 5)
    True
    """
    given: object = model
    if not isinstance(given, nn.Module):
        msg = f"attention_gradients() expects a torch.nn.Module; got {type(given).__name__}."
        raise TypeError(msg)
    check_scalar_target(target)

    def score(outputs: Any) -> torch.Tensor:
        value: object = target(outputs)
        if not isinstance(value, torch.Tensor):
            msg = (
                "`target` must map the model's outputs to a scalar tensor; got a "
                f"{type(value).__name__}."
            )
            raise TypeError(msg)
        check_scalar_shape(tuple(value.shape))
        return value.reshape(())

    weights, gradients, _ = _differentiate(
        model, inputs, lambda result: result, score, "attention_gradients()"
    )
    return weights, gradients


def input_gradients(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    target: int | Sequence[int] | torch.Tensor | None = None,
    embeddings: nn.Module | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
) -> torch.Tensor:
    r"""Input-gradient importance of each token for a classifier's prediction.

    The gradient of the target class's score with respect to the output of the
    embedding module, reduced over the hidden axis to one number per token: the
    input-gradient attribution that Abnar & Zuidema (2020) compare attention rollout and
    attention flow with. For sample :math:`b` with target class :math:`t_b`, logits
    :math:`z_b` and token embeddings :math:`e_{b,i} \in \mathbb{R}^d` (the embedding
    module's output),

    .. math::

        s_b = \operatorname{softmax}(z_b)_{t_b} \ \text{(or } z_{b,t_b}\text{)}, \qquad
        g_{b,i} = \frac{\partial s_b}{\partial e_{b,i}},

    and the importance of token :math:`i` is :math:`\lVert g_{b,i} \rVert_2`
    (``"l2"``), :math:`\lvert \sum_k g_{b,i,k} \rvert` (``"sum_abs"``, as in the paper's
    code) or :math:`\lvert \sum_k g_{b,i,k}\, e_{b,i,k} \rvert` (``"x_input"``,
    gradient times input).

    The model runs once on the whole batch and is differentiated once, with respect to
    a zero tensor that a forward hook adds to the embedding module's output (so the
    gradient exists even when no parameter requires grad); the hook is removed when the
    call ends, also when it raises. Samples of a batch are independent, so the gradient
    of the sum of their scores is each sample's own gradient. Autograd is switched on
    inside (it works under an outer ``torch.no_grad()``, not under
    ``torch.inference_mode()``); parameters' ``.grad`` are left untouched.

    Parameters
    ----------
    model : torch.nn.Module
        A classifier: it returns logits of shape ``(batch, classes)``, as a tensor or as
        the ``logits`` attribute of its output (a Hugging Face ``ModelOutput``, e.g. of
        ``BertForSequenceClassification``). Put it in eval mode first (dropout would
        make the gradient random); this function does not change its mode.
    inputs : mapping, sequence or Tensor
        The model's inputs: ``model(**inputs)`` for a mapping (a tokenizer's output),
        ``model(*inputs)`` for a tuple or list, ``model(inputs)`` for a tensor, as for
        :func:`explain`.
    target : int, sequence of int, 1-d int Tensor or None, default None
        The class to explain: None for each sample's predicted class (argmax of its
        logits), an int for the same class in every sample, or one class per sample.
    embeddings : torch.nn.Module, optional
        The submodule of `model` whose output is differentiated, ``(batch, n, d)``;
        by default ``model.get_input_embeddings()`` (the Hugging Face convention: the
        token embedding table, before position embeddings and normalisation). It must
        run exactly once per model call.
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        How the hidden axis is reduced (see above).
    output : {"probability", "logit"}, default "probability"
        Differentiate the softmax probability of the target class or its logit.

    Returns
    -------
    Tensor
        ``(batch, n)`` importances, detached, on the model's device, in the floating
        dtype of the embeddings.

    Raises
    ------
    TypeError
        If `model` or `embeddings` is not a module, `target` has the wrong type, the
        model does not return ``(batch, classes)`` logits, or the embedding output is not
        a floating tensor.
    ValueError
        On a bad `reduce` or `output`, a target class out of range or a target of the
        wrong length, an `embeddings` module that is not part of `model` or whose output
        is not ``(batch, n, d)``, or a model without ``get_input_embeddings()`` when
        `embeddings` is not given.
    RuntimeError
        Under ``torch.inference_mode()``, when the embedding module did not run exactly
        once, or when the output does not depend on it.

    See Also
    --------
    explain : Attention rollout or flow of the same model, to compare with.

    Notes
    -----
    ``"sum_abs"`` is zero, up to rounding, when the embedding output reaches the rest of
    the model only through a LayerNorm of a sum, as in BERT, DistilBERT and MiniLM (word
    + position (+ type) embeddings, then LayerNorm): LayerNorm ignores a shift of all
    coordinates, so :math:`\sum_k g_{b,i,k} = 0`. Use ``"l2"`` or ``"x_input"`` there.

    Padded tokens may get a gradient too (through padded query rows): mask them with the
    attention mask before comparing with attention-based scores.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] K. Simonyan, A. Vedaldi and A. Zisserman, "Deep Inside Convolutional Networks:
       Visualising Image Classification Models and Saliency Maps", ICLR Workshop 2014,
       https://arxiv.org/abs/1312.6034

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import input_gradients
    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 8)
    ...         layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    ...         self.encoder = torch.nn.TransformerEncoder(
    ...             layer, num_layers=2, enable_nested_tensor=False
    ...         )
    ...         self.head = torch.nn.Linear(8, 3)
    ...
    ...     def get_input_embeddings(self):
    ...         return self.embed
    ...
    ...     def forward(self, input_ids):
    ...         return self.head(self.encoder(self.embed(input_ids))[:, 0])
    >>> model = Classifier().eval()
    >>> ids = torch.tensor([[1, 4, 2, 7, 5], [3, 3, 5, 9, 8]])
    >>> input_gradients(model, ids).shape
    torch.Size([2, 5])
    >>> input_gradients(model, ids, target=[0, 2], reduce="x_input", output="logit").shape
    torch.Size([2, 5])
    """
    given: object = model  # checked at run time: callers may not be type-checked
    if not isinstance(given, nn.Module):
        msg = (
            "input_gradients() expects a torch.nn.Module (the classifier); got "
            f"{type(given).__name__}."
        )
        raise TypeError(msg)
    check_reduce_output(reduce, output)
    check_target_type(target, _describe_target)
    _refuse_inference_mode("input_gradients()")
    layer = _embedding_module(model, embeddings)

    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add_zero(module: nn.Module, args: tuple[Any, ...], out: Any) -> torch.Tensor:  # noqa: ARG001
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            found = type(out).__name__
            if isinstance(out, torch.Tensor):
                found = f"a {out.dtype} tensor"
            msg = (
                f"The embedding module {type(module).__name__} returned {found}; "
                "input_gradients() differentiates a floating tensor (batch, n, d). Pass "
                "`embeddings=` the module that returns the token embeddings."
            )
            raise TypeError(msg)
        # A zero added to the output puts it on the autograd graph even when nothing
        # upstream requires grad, and the gradient w.r.t. the zero is the gradient w.r.t.
        # the embeddings; the model's own tensors are left as they are.
        zero = torch.zeros_like(out, requires_grad=True)
        calls.append((out.detach(), zero))
        return out + zero

    with Hooks() as hooks, torch.enable_grad():
        hooks.after(layer, add_zero)
        if isinstance(inputs, torch.Tensor):
            result = model(inputs)
        elif isinstance(inputs, Mapping):
            result = model(**inputs)
        else:
            result = model(*inputs)

    logits = _logits(result)
    if len(calls) != 1:
        msg = (
            f"The embedding module {type(layer).__name__} ran {len(calls)} times in one model "
            "call; input_gradients() needs it to run exactly once. "
            + (
                "Pass token ids (not inputs_embeds), or pass `embeddings=` the module that "
                "embeds them."
                if not calls
                else "Pass `embeddings=` a module that runs once (e.g. the encoder's own)."
            )
        )
        raise RuntimeError(msg)
    embedded, zero = calls[0]
    if embedded.ndim != 3 or embedded.shape[0] != logits.shape[0]:
        msg = (
            f"The embedding output has shape {tuple(embedded.shape)}; input_gradients() "
            f"needs (batch, n, d) with batch = {logits.shape[0]} as in the logits. Pass "
            "`embeddings=` the batch-first token embedding module."
        )
        raise ValueError(msg)
    classes = _target_classes(target, logits.shape[0], logits.shape[1], logits.detach())
    with torch.enable_grad():
        scores = _class_values(logits, output)
        chosen = scores.gather(-1, classes.to(scores.device)[:, None]).sum()
        grads: Sequence[torch.Tensor | None] = (
            torch.autograd.grad(chosen, zero, allow_unused=True) if chosen.requires_grad else [None]
        )
    grad = grads[0]
    if grad is None:
        msg = (
            f"The model's logits do not depend on the output of {type(layer).__name__}, so "
            "there is no input gradient: pass `embeddings=` the module that embeds the "
            "tokens the classifier reads, and do not detach its output inside the model."
        )
        raise RuntimeError(msg)
    return _reduce_hidden(grad, embedded, reduce).detach()


def _call(model: nn.Module, inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


# -- input gradients ---------------------------------------------------------------------------
def _describe_target(target: object) -> tuple[bool, str] | None:
    """Read a tensor `target` for check_target_type: a valid one is 0-d or 1-d integer."""
    if not isinstance(target, torch.Tensor):
        return None
    valid = target.ndim <= 1 and not (
        target.is_floating_point() or target.is_complex() or target.dtype == torch.bool
    )
    return valid, f"a {target.dtype} tensor of shape {tuple(target.shape)}"


def _target_classes(
    target: int | Sequence[int] | torch.Tensor | None,
    batch: int,
    classes: int,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Resolve `target` to ``(batch,)`` classes, validated against the logits' shape."""
    if target is None:
        return logits.argmax(dim=-1)
    if isinstance(target, torch.Tensor):
        values = [int(v) for v in target.detach().reshape(-1).tolist()]
        if target.ndim == 0:
            values = values * batch
    elif isinstance(target, Sequence):
        values = [int(v) for v in target]
    else:
        values = [int(target)] * batch
    check_class_values(values, batch, classes)
    return torch.tensor(values, dtype=torch.long, device=logits.device)


def _embedding_module(model: nn.Module, embeddings: nn.Module | None) -> nn.Module:
    """Find the module whose output input_gradients() differentiates (part of `model`)."""
    if embeddings is None:
        getter = getattr(model, "get_input_embeddings", None)
        found: object = None
        if callable(getter):
            try:
                found = getter()
            except NotImplementedError:
                found = None
        if not isinstance(found, nn.Module):
            msg = (
                f"{type(model).__name__} has no get_input_embeddings() returning a module "
                "(the Hugging Face convention), so input_gradients() does not know where the "
                "token embeddings are: pass `embeddings=` the module that returns them, e.g. "
                "embeddings=model.embed."
            )
            raise ValueError(msg)
        return found
    given: object = embeddings
    if not isinstance(given, nn.Module):
        msg = (
            "`embeddings` must be the torch.nn.Module of the model that returns the token "
            f"embeddings (e.g. model.embed); got {type(given).__name__}."
        )
        raise TypeError(msg)
    if not any(module is embeddings for module in model.modules()):
        msg = (
            f"`embeddings` ({type(embeddings).__name__}) is not a submodule of "
            f"{type(model).__name__}, so it never runs in the model call: pass one of "
            "model.modules(), e.g. embeddings=model.embed."
        )
        raise ValueError(msg)
    return embeddings


def _logits(result: Any) -> torch.Tensor:
    """Read the ``(batch, classes)`` logits of a model call: a tensor or ``result.logits``."""
    logits = result if isinstance(result, torch.Tensor) else getattr(result, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.ndim == 2 and logits.is_floating_point():
        return logits
    if isinstance(logits, torch.Tensor):
        what = "a tensor" if logits is result else "logits"
        found = f"{what} of shape {tuple(logits.shape)} ({logits.dtype})"
    else:
        found = f"a {type(result).__name__} without a `logits` tensor"
    msg = (
        "input_gradients() needs a classifier: a model returning floating logits of shape "
        "(batch, classes), as a tensor or as `.logits` (a Hugging Face ModelOutput); got "
        f"{found}. Wrap the model in a module that returns them, e.g. a linear head on the "
        "[CLS] state."
    )
    raise TypeError(msg)


def _reduce_hidden(grad: torch.Tensor, embedded: torch.Tensor, reduce: Reduction) -> torch.Tensor:
    """Reduce ``(batch, n, d)`` gradients over the hidden axis to ``(batch, n)``."""
    if reduce == "l2":
        norm: torch.Tensor = torch.linalg.vector_norm(grad, dim=-1)
        return norm
    if reduce == "sum_abs":
        return grad.sum(dim=-1).abs()
    return (grad * embedded).sum(dim=-1).abs()
