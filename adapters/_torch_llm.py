"""The ground truth of LLM attributions on a PyTorch causal LM: :func:`ground_truth`.

:func:`attnflow.evaluate.ground_truth` takes the model and the methods as plain callables;
here :func:`next_token_log_probabilities` runs the model and :func:`registry_method` turns
a name of attnflow's method registry into the callable ``(ids, target) -> scores`` that
the evaluation takes, through :func:`attnflow.adapters.torch.explain`. Nothing is decided
from a method's name: what a method needs (a target to explain) is read from its registry
entry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from attnflow._methods import MethodSpec, method_spec

if TYPE_CHECKING:
    from attnflow.evaluate import GroundTruthReport

__all__ = [
    "DEFAULT_METHODS",
    "ground_truth",
    "next_token_log_probabilities",
    "registry_method",
    "takes_target",
]

DEFAULT_METHODS = ("raw", "rollout", "flow", "gradient_rollout", "norm", "alti")
"""The registry methods :func:`ground_truth` scores by default (GlobEnc's rollout gives NaN
on the 30 layers of SmolLM2)."""


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        msg = f"`model` must be a torch.nn.Module (a causal LM); got {type(model).__name__}."
        raise TypeError(msg)
    return model


def next_token_log_probabilities(
    model: nn.Module, /, *, batch_size: int = 16
) -> Callable[[Any], np.ndarray]:
    """``ids (B, n) -> (B, vocab)``: log-softmax of the logits at the last position.

    Runs `model` without gradients in batches of `batch_size` sequences, in float64 on
    the host.

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> from attnflow.adapters._torch_llm import next_token_log_probabilities
    >>> class Bigram(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.table = torch.nn.Embedding(5, 5)
    ...
    ...     def forward(self, ids):
    ...         return type("Output", (), {"logits": self.table(ids)})()
    >>> log_p = next_token_log_probabilities(Bigram())(np.array([[1, 2], [3, 4]]))
    >>> log_p.shape, bool(np.allclose(np.exp(log_p).sum(-1), 1.0))
    ((2, 5), True)
    """
    model = _check_model(model)
    size: object = batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"`batch_size` must be a positive int; got {batch_size!r}."
        raise ValueError(msg)
    device = next(model.parameters()).device
    # Hugging Face causal LMs can skip the vocabulary projection of all but the last position.
    keep = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )

    def log_probabilities(ids: Any) -> np.ndarray:
        tokens = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=device)
        parts = []
        with torch.no_grad():
            for start in range(0, tokens.shape[0], batch_size):
                logits = model(tokens[start : start + batch_size], **keep).logits[:, -1]
                parts.append(torch.log_softmax(logits.double(), dim=-1).cpu().numpy())
        return np.concatenate(parts)

    return log_probabilities


def takes_target(spec: MethodSpec) -> bool:
    """Whether a method explains a target token (it differentiates or projects on its score).

    The registry's word (``MethodSpec.uses_target``): gradient rollout and the
    logit-conditioned methods take the answer as ``target``; IFR, conditioned on the row
    alone, does not.
    """
    return spec.uses_target


def registry_method(
    model: nn.Module, name: str, options: Mapping[str, Any] | None = None, /
) -> Callable[[np.ndarray, int], np.ndarray]:
    """``(ids, target) -> scores (layers, n)``: a registry method on one prompt's last row.

    Calls :func:`attnflow.adapters.torch.explain` on ``{"input_ids": ids[None]}`` with
    ``method=name, rows=-1, layers="all"`` (`options` add to or override these keywords),
    and ``target=target`` for the methods that explain a target (:func:`takes_target`).
    Returns float64 NumPy scores, one row per layer.

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> from attnflow.adapters._torch_llm import registry_method
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    >>> class Tiny(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.encoder = torch.nn.Embedding(10, 8), encoder
    ...
    ...     def forward(self, input_ids):
    ...         return self.encoder(self.embed(input_ids))
    >>> rollout = registry_method(Tiny(), "rollout")
    >>> rollout(np.array([1, 2, 3, 4]), 5).shape  # (layers, n)
    (2, 4)
    """
    model = _check_model(model)
    spec = method_spec(name)
    # The target-conditioned methods' layers add up: row l the sum up to layer l, so the
    # top row (the one ranked) is the method itself, as rollout's top row is.
    layers = "cumulative" if spec.target_conditioned else "all"
    keywords: dict[str, Any] = {"rows": -1, "layers": layers, **dict(options or {})}
    targeted = takes_target(spec)

    def scores(ids: np.ndarray, target: int) -> np.ndarray:
        from ._torch_explain import explain

        device = next(model.parameters()).device
        tokens = torch.as_tensor(np.asarray(ids)[None], dtype=torch.long, device=device)
        chosen: dict[str, Any] = {"target": int(target)} if targeted else {}
        method: Any = spec.name  # a registry name, checked above
        result = explain(model, {"input_ids": tokens}, method=method, **chosen, **keywords)
        return np.asarray(result[0].detach().double().cpu().numpy())

    return scores


def ground_truth(
    model: nn.Module,
    tokenizer: Any,
    /,
    *,
    task: str = "copying",
    methods: Sequence[str] | Mapping[str, Any] = DEFAULT_METHODS,
    n_items: int = 40,
    seed: int = 0,
    size: int | None = None,
    chat: bool | Callable[[str], str] | None = None,
    replacement: int | None = None,
) -> GroundTruthReport:
    """Score attribution methods of a PyTorch causal LM on prompts with a known source token.

    :func:`attnflow.evaluate.ground_truth` on `model`: the model's next-token
    log-probabilities (:func:`next_token_log_probabilities`) and the methods, each
    explaining the answer token at the last position (:func:`registry_method`). See
    :func:`attnflow.evaluate.ground_truth` for the tasks, the measure and the report.

    Parameters
    ----------
    model : torch.nn.Module
        A causal LM in eval mode whose output has ``.logits`` ``(batch, n, vocab)`` (a
        Hugging Face ``...ForCausalLM``).
    tokenizer : tokenizer or callable
        Its Hugging Face fast tokenizer, or a callable ``text -> (ids, offsets)``.
    task : str, default "copying"
        One of :data:`attnflow.evaluate.GROUND_TRUTH_TASKS`.
    methods : sequence of str or mapping, default DEFAULT_METHODS
        Names of attnflow's method registry (``"rollout"``, ``"gradient_rollout"``,
        ``"alti"``...), each run through :func:`attnflow.adapters.torch.explain` with
        ``rows=-1, layers="all"`` and the answer as the target of the methods that
        explain one; or a mapping of labels to such a name, to a mapping of ``explain``
        keywords with its ``"method"`` (``{"method": "flow", "exclude": 0}``), or to a
        callable ``(ids, target) -> scores`` (``(layers, n)`` or ``(n,)``).
    n_items, seed, size, chat, replacement : see attnflow.evaluate.ground_truth
        The number of items, their seed, their size, the chat template and the erasure
        metrics' replacement token, as in :func:`attnflow.evaluate.ground_truth`.

    Returns
    -------
    attnflow.evaluate.GroundTruthReport
        Accuracy, the source's rank per method and layer, each method's time.

    Raises
    ------
    ValueError
        Before any work: an unknown method name (the registry's are listed), or as
        :func:`attnflow.evaluate.ground_truth` raises.

    Examples
    --------
    A two-layer causal LM built from a config, and a tokenizer of one id per word:

    >>> import re
    >>> import torch
    >>> import transformers
    >>> from attnflow.adapters.torch import ground_truth
    >>> config = transformers.LlamaConfig(
    ...     vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...     num_attention_heads=2, num_key_value_heads=1,
    ... )
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> vocabulary = {}
    >>> def tokenize(text):
    ...     spans = [m.span() for m in re.finditer(r" ?[^ ,.:]+|[,.:]", text)]
    ...     return [vocabulary.setdefault(text[a:b], len(vocabulary)) for a, b in spans], spans
    >>> report = ground_truth(
    ...     model, tokenize, methods=["rollout", "gradient_rollout"], n_items=2, size=4
    ... )
    >>> report.ranks["gradient_rollout"].shape  # items, layers
    (2, 2)
    """
    model = _check_model(model)
    from attnflow.evaluate import ground_truth as evaluate

    callables = _method_callables(model, methods)
    return evaluate(
        next_token_log_probabilities(model),
        tokenizer,
        task=task,
        methods=callables,
        n_items=n_items,
        seed=seed,
        size=size,
        chat=chat,
        replacement=replacement,
    )


def _method_callables(
    model: nn.Module, methods: object
) -> dict[str, Callable[[np.ndarray, int], Any]]:
    """Labels to callables: registry names (with explain keywords) through :func:`registry_method`."""
    if isinstance(methods, str) or not isinstance(methods, Sequence | Mapping) or not methods:
        msg = (
            "`methods` must be a non-empty sequence of method names or a mapping of labels "
            f"to names, explain keywords or callables; got {methods!r}."
        )
        raise TypeError(msg)
    entries = methods.items() if isinstance(methods, Mapping) else [(m, m) for m in methods]
    callables: dict[str, Callable[[np.ndarray, int], Any]] = {}
    for label, how in entries:
        if not isinstance(label, str):
            msg = f"`methods` labels must be strings; got {label!r}."
            raise TypeError(msg)
        if callable(how):
            callables[label] = how
            continue
        keywords = dict(how) if isinstance(how, Mapping) else {"method": how}
        name = keywords.pop("method", None)
        method_spec(name, parameter=f"`methods[{label!r}]`")
        callables[label] = registry_method(model, str(name), keywords)
    return callables
