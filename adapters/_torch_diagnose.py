"""``diagnose``: a model report of a PyTorch causal LM on a built-in copying probe.

Runs the model on in-context copying items (``attnflow.evaluate``'s copying task: a list
of words, then the list again; the next word's source is its earlier occurrence) and
gathers, per item, what :class:`attnflow.diagnosis.ModelReport` reduces: the attention
weights of every head (:func:`capture`), each head's output at the explained row (the
input of the output projection, read by a hook, times the head's slice of it), the direct
logit terms of every head (:func:`explain`, ``method="direct_logit"``), and the scores
of the methods compared. The maths is the core's; this module only runs the model.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import attnflow
from attnflow._methods import method_spec
from attnflow.diagnosis import ModelReport, copying_scores, output_shares, sink_mass
from attnflow.evaluate._llm_ranks import source_ranks
from attnflow.evaluate._llm_tasks import copying_task, locate_source

from ._common import Method
from ._torch_capture import capture
from ._torch_explain import explain
from ._torch_hooks import Hooks
from ._torch_logit import _decoder_layers, unsupported_reason

__all__ = ["DIAGNOSE_METHODS", "diagnose"]

#: The methods whose hit@1 the report gives, in its table's order.
DIAGNOSE_METHODS = ("rollout", "flow", "direct_logit", "alti_logit", "ifr")
#: The method whose per-head terms give the copying scores: computed once per item, and
#: its hit@1 read from the same terms.
COPYING_METHOD: Method = "direct_logit"
#: What the diagnosis sets beyond a method's defaults: flow leaves the first token (the
#: usual sink, which saturates every path) out.
_OPTIONS: dict[str, dict[str, Any]] = {"flow": {"exclude": 0}}


def _tokenize(tokenizer: Any) -> Any:
    def tokenize(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = tokenizer(text, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    return tokenize


def diagnose(
    model: nn.Module,
    tokenizer: Any,
    /,
    *,
    items: int = 6,
    seed: int = 0,
    methods: Sequence[str] = DIAGNOSE_METHODS,
    name: str | None = None,
) -> ModelReport:
    """Report a causal LM's sinks, inactive heads, copying heads and which methods localise.

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face causal LM of Llama, Mistral, Qwen2 or GPT-2 style, in eval mode.
    tokenizer : callable
        Its (fast) tokenizer: ``tokenizer(text, return_offsets_mapping=True)``.
    items : int, default 6
        The number of copying items of the probe (1 to 200).
    seed : int, default 0
        The probe's seed.
    methods : sequence of str
        The methods whose hit@1 is reported, among :data:`DIAGNOSE_METHODS`.
    name : str, optional
        The model's name on the report (default: its class).

    Returns
    -------
    attnflow.diagnosis.ModelReport
        ``.show()``, ``.summary()``, ``.to_html(path)``.

    Raises
    ------
    ValueError
        If the model's blocks are not supported, `items` is out of range or a method is
        unknown (before any work).

    Examples
    --------
    On the pretrained SmolLM2 (``attnflow diagnose --model FOLDER`` does the same):

    >>> report = diagnose(model, tokenizer, items=6)  # doctest: +SKIP
    >>> report.show()  # doctest: +SKIP
    >>> report.to_html("report.html")  # doctest: +SKIP
    """
    reason = unsupported_reason(model)
    if reason is not None:
        msg = f"diagnose() cannot read this model: {reason}."
        raise ValueError(msg)
    given: object = items
    if isinstance(given, bool) or not isinstance(given, int) or not 1 <= given <= 200:
        msg = f"`items` must be an int from 1 to 200 (copying items of the probe); got {items!r}."
        raise ValueError(msg)
    unknown = [m for m in methods if m not in DIAGNOSE_METHODS]
    if unknown or not methods:
        msg = f"`methods` must name some of {list(DIAGNOSE_METHODS)}; got {list(methods)!r}."
        raise ValueError(msg)
    start = time.perf_counter()
    tokenize = _tokenize(tokenizer)
    probe = [locate_source(item, tokenize) for item in copying_task(items, seed=seed)]
    layers = _decoder_layers(model)
    sinks, shares, copies, first, correct = [], [], [], [], 0
    ranks: dict[str, list[int]] = {m: [] for m in methods}
    for item in probe:
        ids = torch.as_tensor(np.asarray(item.ids), dtype=torch.long)[None]
        inputs = {"input_ids": ids.to(_device(model))}
        contexts: list[torch.Tensor] = []
        with Hooks() as hooks:
            for _, attention, family in layers:
                hooks.before(getattr(attention, family.output), _keep_last_row(contexts))
            with torch.no_grad(), capture(model) as cap:
                logits = model(**inputs).logits
        weights = cap.attentions[0].double().cpu()  # (L, H, n, n)
        sinks.append(sink_mass(weights).numpy())
        shares.append(output_shares(_head_norms(layers, contexts)[..., None]).numpy())
        first.append(attnflow.rollout(weights, rows=-1, layers="all")[:, 0].numpy())
        if int(logits[0, -1].argmax()) != item.answer_id:
            continue
        correct += 1
        terms = (
            explain(
                model,
                inputs,
                method=COPYING_METHOD,
                rows=-1,
                target=item.answer_id,
                heads="each",
                layers="all",
            )[0]
            .double()
            .cpu()
        )
        copies.append(copying_scores(terms, item.source).numpy())
        for method in methods:
            scores = _scores(method, model, inputs, weights, terms, item.answer_id)
            rank = source_ranks(scores[None], [item.source], contexts=[item.context])
            ranks[method].append(int(np.asarray(rank)[0]))
    layer_count, heads = sinks[0].shape
    return ModelReport(
        model=name or type(model).__name__,
        sink_mass=np.mean(sinks, axis=0),
        output_share=np.mean(shares, axis=0),
        copying_score=np.mean(copies, axis=0) if copies else np.zeros((layer_count, heads)),
        rollout_first=np.mean(first, axis=0),
        hit_rate={
            m: float(np.mean(np.asarray(r) == 1)) if r else float("nan") for m, r in ranks.items()
        },
        accuracy=correct / len(probe),
        items=len(probe),
        seconds=time.perf_counter() - start,
    )


def _keep_last_row(contexts: list[torch.Tensor]) -> Any:
    """Return a pre-hook for an output projection that keeps its input's last row."""

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:  # noqa: ARG001
        contexts.append(args[0].detach()[0, -1])

    return hook


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _head_norms(layers: list[Any], contexts: list[torch.Tensor]) -> torch.Tensor:
    """``(L, H)``: the norm of each head's output at the explained row."""
    from ._torch_logit import _Layer, _output_projection

    norms = []
    for index, ((block, attention, family), context) in enumerate(
        zip(layers, contexts, strict=True)
    ):
        weight, _ = _output_projection(_Layer(block, attention, family, index, None))
        heads = int(attention.config.num_attention_heads)
        per_head = context.reshape(heads, -1)  # (H, dh)
        outputs = torch.einsum("hk,hkd->hd", per_head, weight.reshape(heads, -1, weight.shape[-1]))
        norms.append(torch.linalg.vector_norm(outputs.double(), dim=-1))
    return torch.stack(norms).cpu()


def _scores(
    method: str,
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    weights: torch.Tensor,
    terms: torch.Tensor,
    target: int,
) -> np.ndarray:
    """One method's scores of the last row ``(n,)``.

    Over the attention weights, on those captured already; the copying method, from its
    terms; any other, from its own call of :func:`explain`.
    """
    spec = method_spec(method)
    if method == COPYING_METHOD:  # the terms computed for the copying scores
        return terms.sum(dim=(0, 1)).numpy()
    if not (spec.value_aware or spec.gradients or spec.target_conditioned):
        function = spec.function()
        return function(weights, rows=-1, **_OPTIONS.get(method, {})).numpy()  # type: ignore[no-any-return]
    scores = explain(
        model,
        inputs,
        method=typing.cast("Method", method),
        rows=-1,
        target=target if spec.uses_target else None,
    )
    values: np.ndarray = scores[0].double().cpu().numpy()
    return values
