r"""Attribution of generated text for PyTorch causal language models.

:func:`explain_generation` generates with the model's own ``generate`` (greedy by
default) inside :func:`attnflow.adapters.torch.capture`, and explains every generated
token at the position that predicted it:

- ``"rollout"``: a forward hook on the model reads, after every step, the attention rows
  that step computed (the prompt's ``P x P`` block at the first step, then one query row
  per layer: with a KV cache the model computes only the new token's row) and appends
  them to a causal rollout cache (:class:`attnflow._causal_cache.CausalRolloutCache`).
  In a causal model a rollout row never changes once computed, so the rows of all ``T``
  generated tokens cost :math:`O(L (P + T)^2)` per token on top of ``generate``, and the
  model runs once.
- ``"raw"``: the head-fused attention row of one layer (the last by default) at the
  predicting position, read from the same steps.
- ``"gradient_rollout"`` (Chefer et al. 2021, GAE): the gradient of the generated token's
  logit (or log-probability, ``target_score``) at the predicting position with respect to
  every attention weight needs one backward pass per token, so it runs the prefix of each
  generated token once more with autograd (:func:`attnflow.adapters.torch.explain` with the token as its vocabulary
  target) and rolls it out with :func:`attnflow.gradient_rollout`: ``T`` forward and
  backward passes.

Each row equals what :func:`attnflow.adapters.torch.explain` (or :func:`attnflow.rollout`
on the captured weights) gives on that token's prefix alone.
"""

from __future__ import annotations

import contextlib
import numbers
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import attnflow
from attnflow._causal_cache import CausalRolloutCache
from attnflow._methods import method_spec
from attnflow._sinks import drop_self, find_sinks
from attnflow._validation import (
    check_receptive_field,
    check_residual,
    check_validate,
    stored_precision,
)
from attnflow.generation import GenerationExplanation

from ._common import HEAD_REDUCTIONS, Method, check_target_score
from ._token_text import token_labels
from ._torch_hooks import Hooks

__all__ = ["GENERATION_METHODS", "explain_generation"]

#: The methods of :func:`explain_generation`.
GENERATION_METHODS = ("rollout", "gradient_rollout", "raw", "direct_logit", "alti_logit", "ifr")
#: The target-conditioned methods: every generated token's row from one more forward.
_TARGET_CONDITIONED = tuple(m for m in GENERATION_METHODS if method_spec(m).target_conditioned)

#: The options each method takes.
_OPTIONS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"heads", "residual", "layers", "receptive_field", "exclude", "validate"}),
    "raw": frozenset({"heads", "layers", "validate"}),
    "gradient_rollout": frozenset(
        {
            "rule",
            "target_score",
            "normalize_result",
            "normalize",  # its spelling until 0.1: attnflow.gradient_rollout warns
            "residual",
            "layers",
            "exclude_self",
            "receptive_field",
            "exclude",
            "validate",
        }
    ),
    **{method: frozenset() for method in _TARGET_CONDITIONED},
}
#: Options of the core methods that cannot apply to generation, and why.
_REFUSED = {
    "rows": (
        "each generated token is explained at the position that predicted it (row t of the "
        "result at position P + t - 1); drop `rows`"
    ),
    "mask": "the prompt is one sequence without padding; drop `mask`",
    "threshold": (
        "pruning is not offered for generated text; call attnflow.rollout on the captured "
        "weights of the whole sequence"
    ),
    "top_k": (
        "pruning is not offered for generated text; call attnflow.rollout on the captured "
        "weights of the whole sequence"
    ),
    "discard": (
        "discard prunes each layer as a whole, so a row would change as tokens arrive; call "
        "attnflow.rollout on the captured weights of the whole sequence"
    ),
    "normalize_layers": (
        "explain_generation rolls out attention probabilities; drop `normalize_layers`"
    ),
    "renormalize": "explain_generation rolls out attention probabilities; drop `renormalize`",
    "target": (
        "the target of generated token t is its own id (its logit at the position that "
        "predicted it); drop `target`"
    ),
}
#: Arguments of ``generate`` that explain_generation sets itself, or that follow more than
#: one sequence (the rows of one sequence could not be told apart).
_OWN_ARGUMENTS = ("input_ids", "inputs", "attention_mask", "max_new_tokens", "max_length")
_ONE_SEQUENCE = ("num_beams", "num_return_sequences")
_NO_DRAFTS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
#: Greedy decoding, whatever the model's generation config says.
_GREEDY: dict[str, Any] = {"do_sample": False, "num_beams": 1}


def explain_generation(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Mapping[str, Any],
    *,
    max_new_tokens: int,
    methods: str | Sequence[str] | None = None,
    generate_kwargs: Mapping[str, Any] | None = None,
    exclude_self: bool = True,
    **options: Any,
) -> GenerationExplanation:
    r"""Generate text and attribute every generated token to the tokens before it.

    Runs ``model.generate`` on the tokenized `prompt` (greedy decoding by default) and
    explains each of the ``T`` generated tokens at the position that predicted it, the
    last position of its prefix: for a prompt of ``P`` tokens, generated token ``t`` is
    explained at position ``P + t - 1`` over the tokens ``0 .. P + t - 1``.

    - ``"rollout"`` (Abnar & Zuidema 2020): a causal rollout cache. While the model
      generates with its KV cache, a forward hook reads each step's attention rows (one
      query row per layer after the prompt) and appends one rollout row per layer,

      .. math::

          \tilde R_l[i, :] = (1 - \alpha) \, A_l[i, :] \, \tilde R_{l-1}
          + \alpha \, \tilde R_{l-1}[i, :], \qquad \tilde R_0 = I,

      exact because a causal model's rows never change once computed. The model runs
      once; the rows cost :math:`O(L (P + T)^2)` per token.
    - ``"raw"``: the head-fused attention of one layer (the last by default) at the
      predicting position, from the same run.
    - ``"gradient_rollout"`` (Chefer et al. 2021, GAE): with :math:`y` the logit of the
      generated token at the predicting position,
      :math:`\bar A_l = \operatorname{mean}_h((\nabla_{A_{l,h}} y \odot A_{l,h})^+)`,
      :math:`R \leftarrow R + \bar A_l R`; one forward and backward pass over each
      token's prefix (:func:`explain` with ``target`` the token), ``T`` in all.

    Each row equals what :func:`explain` gives on that token's prefix alone (rollout: the
    same as :func:`attnflow.rollout` on the prefix's captured weights, ``rows=-1``), with
    ``exclude_self=True`` by default: a generated token is attributed to the prompt and
    the text generated before it, never to the position that predicted it.

    The attention sinks of the text (the first position, and any position whose mean
    attention share from the queries after it, over layers and heads, is at least 0.3;
    one more forward pass over the text, its first 1,024 tokens at most, finds them) are
    kept in
    ``GenerationExplanation.sinks``: the views leave them out of the colour scale and of
    the strongest sources, and say so.

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face causal language model (``AutoModelForCausalLM``) loaded with
        ``attn_implementation="sdpa"`` (the default) or ``"eager"``, in eval mode.
    tokenizer : callable
        Its tokenizer: ``tokenizer(prompt, return_tensors="pt")``,
        ``convert_ids_to_tokens``, ``get_special_tokens_mask`` and ``decode``.
    prompt : str or mapping
        The prompt text, tokenized with the tokenizer's defaults (special tokens
        included), or an encoded prompt of one sequence: a mapping with ``input_ids`` of
        shape ``(1, P)`` and optionally an all-ones ``attention_mask``, e.g.
        ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
        return_dict=True, return_tensors="pt")``.
    max_new_tokens : int
        The most tokens to generate (``T``; fewer if the model ends the text).
    methods : str or sequence of str, optional
        Any of ``"rollout"``, ``"gradient_rollout"``, ``"raw"`` and the target-conditioned
        ``"direct_logit"``, ``"alti_logit"`` and ``"ifr"`` (each generated token's id its
        target; all rows from one more forward over the generated sequence, see
        :func:`explain`); by default ``("gradient_rollout", "rollout")``: the page opens
        on the first.
    generate_kwargs : mapping, optional
        The caller's generation arguments, passed to ``model.generate`` as they are (over
        the model's ``generation_config``): e.g. ``{"do_sample": True, "temperature":
        0.7, "top_p": 0.9}``, ``{"repetition_penalty": 1.2}`` or ``{"generation_config":
        config}``. None (the default) is greedy decoding (``do_sample=False,
        num_beams=1``) whatever the model's generation config says. Beam search, several
        sequences and assisted (draft-model) decoding are refused: they follow several
        sequences at once. The input, its mask and the length are set by this function.
        ``stop_strings`` work with any tokenizer: transformers' ``StopStringCriteria`` is
        built with the `tokenizer` where it can read its vocabulary, else generation stops
        once a stop string appears in the decoded generated text.
    exclude_self : bool, default True
        Set each row's score at the predicting position ``P + t - 1`` to 0, for every
        method: gradient rollout's own `exclude_self`; rollout and raw attention rows,
        which are shares, are then renormalised over the tokens before it. False keeps
        the rows exactly as :func:`explain` gives them on each prefix.
    **options
        Passed to the methods that take them:

        - ``heads``: ``"mean"`` (default), ``"max"``, ``"min"`` (fused while capturing),
          weights ``(heads,)`` or ``(layers, heads)``, or a callable reducing axis -3
          (:func:`attnflow.fuse_heads`); rollout and raw.
        - ``residual`` (default 0.5): rollout and gradient rollout.
        - ``layers``: ``"last"`` (default) or an int: the rollout up to that layer, or that
          layer's raw attention; all methods.
        - ``receptive_field``, ``exclude``: decoders (:func:`attnflow.rollout`), applied
          to each row: divide by the rollout of uniform causal attention over that row's
          prefix, and zero the `exclude` columns (non-negative positions, e.g. 0 for a BOS
          sink), then renormalise; rollout and gradient rollout.
        - ``rule``, ``normalize_result``, ``exclude_self``: gradient rollout
          (:func:`attnflow.gradient_rollout`).
        - ``target_score``: ``"logit"`` (default) or ``"log_probability"``, what gradient
          rollout differentiates for each generated token at the position that predicted
          it: its logit or its log-probability (:func:`explain`'s `target_score`).
        - ``validate``: check the attention values; all methods.

        An option that none of the chosen `methods` takes is refused, and so are
        ``rows``, ``mask``, ``target`` and the pruning options (a pruned layer is not
        the same row by row).

    Returns
    -------
    attnflow.generation.GenerationExplanation
        The ``P + T`` tokens, ``.generated_ids`` ``(T,)``, and ``.scores[method]`` of
        shape ``(T, P + T - 1)`` (float64): row ``t`` explains generated token ``t`` and
        is zero from column ``P + t`` on. ``.show()``, ``.to_html(path)``,
        ``.explanation(t)``, ``.save(path)``.

    Raises
    ------
    TypeError
        On a bad `model`, `prompt`, `methods`, `generate_kwargs` or option type, or an
        unknown option.
    ValueError
        On a bad value (before anything runs): an unknown method, ``max_new_tokens < 1``,
        a prompt and ``max_new_tokens`` beyond the model's ``max_position_embeddings`` or
        a rollout cache of that length beyond the memory available, malformed
        ``stop_strings``, an option no chosen method takes, a refused option or generation argument, a
        prompt of several sequences or with padding, an attention implementation whose
        weights cannot be read.
    RuntimeError
        For ``"gradient_rollout"`` under ``torch.inference_mode()`` or with every
        parameter frozen (checked before generating); if the model's steps cannot be
        followed (a custom ``generate`` that calls the model on several sequences).

    See Also
    --------
    explain : One output position of one input, any method.
    attnflow.generation.GenerationExplanation : The result.

    Notes
    -----
    The rollout cache holds ``L`` lower-triangular ``(P + T) x (P + T)`` states in the
    model's dtype, float32 for a half-precision model (120 MB for 30 layers at 1,000
    tokens in float32), and the prompt's
    ``P x P`` block is rolled out with full matrix products, :math:`O(L P^3)`: fine for
    prompts of hundreds of tokens. Under capture attention is computed explicitly, which
    holds one step's ``L x H x q x k`` weights: the prompt's ``H x P x P`` per layer at the
    first step (fused to ``P x P`` at once for a named `heads`).

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] H. Chefer, S. Gur and L. Wolf, "Generic Attention-model Explainability for
       Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021,
       https://arxiv.org/abs/2103.15679

    Examples
    --------
    On a small random Llama (the same call works on any Hugging Face causal LM):

    >>> import torch, transformers
    >>> from attnflow.adapters.torch import explain_generation
    >>> config = transformers.LlamaConfig(
    ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2,
    ...     bos_token_id=1, eos_token_id=None, pad_token_id=0,  # no end token: 4 new tokens
    ... )
    >>> _ = torch.manual_seed(0)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> class Tokenizer:  # a stand-in for a Hugging Face tokenizer
    ...     def __call__(self, text, return_tensors="pt"):
    ...         ids = torch.tensor([[1] + [2 + ord(c) % 30 for c in text]])
    ...         return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ...     def convert_ids_to_tokens(self, ids):
    ...         return [f"t{i}" for i in ids]
    ...     def get_special_tokens_mask(self, ids, already_has_special_tokens=True):
    ...         return [int(i == 1) for i in ids]
    ...     def decode(self, ids, **kwargs):
    ...         return " ".join(f"t{i}" for i in ids)
    >>> g = explain_generation(model, Tokenizer(), "abc", max_new_tokens=4)
    >>> g.scores["rollout"].shape, g.scores["gradient_rollout"].shape  # P = 4, T = 4
    ((4, 7), (4, 7))
    >>> bool((g.scores["rollout"][0, 4:] == 0).all())  # token 0 sees the prompt only
    True

    On SmolLM2, with the HTML page:

    >>> g = explain_generation(
    ...     model, tokenizer, "The capital of France is", max_new_tokens=5
    ... )  # doctest: +SKIP
    >>> g.show()  # doctest: +SKIP
    >>> g.to_html("generation.html")  # doctest: +SKIP
    """
    given: object = model
    if not isinstance(given, nn.Module):
        msg = f"explain_generation() expects a torch.nn.Module (a causal LM); got {type(given).__name__}."
        raise TypeError(msg)
    if not callable(getattr(model, "generate", None)):
        msg = (
            f"`model` must be a causal language model with a `generate` method (a Hugging "
            f"Face AutoModelForCausalLM); {type(model).__name__} has none."
        )
        raise TypeError(msg)
    from ._torch_explain import DECODER_LEADING_METHOD

    default = (DECODER_LEADING_METHOD, "gradient_rollout", "rollout")
    chosen = _check_methods(
        methods
        if methods is not None
        else [m for m in dict.fromkeys(default) if m in GENERATION_METHODS]
    )
    flag: object = exclude_self  # checked at run time: callers may not be type-checked
    if not isinstance(flag, bool):
        msg = f"`exclude_self` must be True or False; got {exclude_self!r}."
        raise TypeError(msg)
    steps = _check_max_new_tokens(max_new_tokens)
    settings = _check_options(options, chosen, model)
    settings["gradient_rollout"].setdefault("exclude_self", exclude_self)
    generation = _check_generate_kwargs(generate_kwargs, model)
    if "gradient_rollout" in chosen:
        _check_autograd(model)
    device = _device(model)
    inputs, prompt_text = _encode(tokenizer, prompt, device)
    n_prompt = int(inputs["input_ids"].shape[1])
    _check_fits(model, n_prompt, steps, rollout="rollout" in chosen)
    from ._torch_inputs import check_model_inputs

    check_model_inputs(model, inputs, where="explain_generation")
    _stop_strings(generation, tokenizer, n_prompt)
    exclude = settings["rollout"].get("exclude", settings["gradient_rollout"].get("exclude"))
    _check_exclude_range(exclude, n_prompt + steps - 1)

    follower = _StepFollower(model, chosen, settings)
    with torch.no_grad():
        sequences = follower.generate(inputs, steps, generation)
    ids = [int(i) for i in sequences]
    generated = ids[n_prompt:]
    n_generated = len(generated)
    if n_generated < 1:
        msg = "The model generated no token; nothing to explain."
        raise RuntimeError(msg)
    width = n_prompt + n_generated - 1
    scores: dict[str, np.ndarray] = {}
    for method in chosen:
        spec = method_spec(method)
        if spec.target_conditioned:
            scores[method] = _target_conditioned_rows(model, sequences, n_prompt, method, device)
        elif spec.gradients:
            scores[method] = _gradient_rows(model, sequences, n_prompt, settings[method], device)
        elif spec.composes_layers:  # rollout, followed step by step
            scores[method] = follower.rollout_rows(n_prompt, width)
        else:
            scores[method] = follower.raw_rows(n_prompt, width)
        if exclude_self and not spec.gradients:  # shares: renormalised (GAE drops its own)
            predicting = list(range(n_prompt - 1, width))
            scores[method] = drop_self(scores[method], predicting, renormalize=True)
    special = tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True)
    return GenerationExplanation(
        token_labels(tokenizer, ids),
        generated,
        scores,
        prompt_length=n_prompt,
        prompt_ids=ids[:n_prompt],
        special=[bool(s) for s in special],
        prompt=prompt_text,
        generated_text=str(tokenizer.decode(generated)),
        sinks=_sinks(model, sequences[:-1], device),
        self_excluded=exclude_self,
    )


#: The sinks of a generation are found on its first tokens at most (bounded memory: the
#: fused weights of this many tokens; a sink is an early position).
SINK_WINDOW = 1024


def _sinks(model: nn.Module, text: torch.Tensor, device: torch.device) -> tuple[int, ...]:
    """Find the text's attention sinks in one forward pass over it (heads fused by the mean).

    Over the first :data:`SINK_WINDOW` tokens of a longer text, so that the fused weights
    held stay bounded (``4 L w^2`` bytes).
    """
    from ._torch_capture import capture

    ids = text[None, :SINK_WINDOW].to(device)
    with torch.no_grad(), capture(model, heads="mean") as cap:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return find_sinks(cap.attentions[0].double())


# -- checks, before any work --------------------------------------------------------------
def _check_methods(methods: object) -> list[str]:
    listed = [methods] if isinstance(methods, str) else methods
    if not isinstance(listed, Sequence):
        msg = (
            f"`methods` must be a str or a sequence of str among {list(GENERATION_METHODS)}; "
            f"got {type(methods).__name__}."
        )
        raise TypeError(msg)
    chosen = list(listed)
    unknown = [m for m in chosen if m not in GENERATION_METHODS]
    if not chosen or unknown or len(set(chosen)) != len(chosen):
        msg = f"`methods` must name some of {list(GENERATION_METHODS)}, each once; got {chosen!r}."
        raise ValueError(msg)
    return [str(m) for m in chosen]


def _check_max_new_tokens(max_new_tokens: object) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        msg = (
            "`max_new_tokens` must be an int >= 1 (the most tokens to generate); got "
            f"{max_new_tokens!r}."
        )
        raise TypeError(msg)
    if max_new_tokens < 1:
        msg = f"`max_new_tokens` must be >= 1 (the most tokens to generate); got {max_new_tokens}."
        raise ValueError(msg)
    return int(max_new_tokens)


def _check_fits(model: nn.Module, n_prompt: int, steps: int, *, rollout: bool) -> None:
    """Refuse, before generating, a length the model cannot take or the cache cannot hold.

    The prompt and `steps` new tokens must fit the model's positions
    (``max_position_embeddings``, GPT-2's ``n_positions``), and the rollout cache of the
    longest sequence (layers x n x n numbers, at least float32) the memory available: a
    model that never stops would otherwise run until killed.
    """
    from attnflow._arrayio import _available_memory

    config = getattr(model, "config", None)
    limit = next(
        (
            value
            for name in ("max_position_embeddings", "n_positions")
            if isinstance(value := getattr(config, name, None), int) and value > 0
        ),
        None,
    )
    if limit is not None and n_prompt + steps > limit:
        if n_prompt >= limit:
            msg = (
                f"`prompt` has {n_prompt} tokens, as many as the model's {limit} positions "
                "(max_position_embeddings) or more: no token can be generated after it. "
                "Shorten the prompt."
            )
        else:
            msg = (
                f"`max_new_tokens` must be at most {limit - n_prompt} for this model and "
                f"prompt: {n_prompt} prompt tokens and {steps} new ones exceed its {limit} "
                "positions (max_position_embeddings); got "
                f"{steps}."
            )
        raise ValueError(msg)
    n_layers = getattr(config, "num_hidden_layers", None)
    available = _available_memory()
    if rollout and isinstance(n_layers, int) and available is not None:
        length = n_prompt + steps
        itemsize = max(4, torch.finfo(_dtype(model)).bits // 8)
        needed = n_layers * length * length * itemsize
        if needed > available:
            msg = (
                f"`max_new_tokens` of {steps} after {n_prompt} prompt tokens could need a "
                f"rollout cache of {needed / 2**30:.3g} GiB ({n_layers} layers x {length} x "
                f"{length} numbers), more than the {available / 2**30:.3g} GiB of memory "
                "available; lower `max_new_tokens`."
            )
            raise ValueError(msg)


def _dtype(model: nn.Module) -> torch.dtype:
    parameter = next(model.parameters(), None)
    return (
        parameter.dtype
        if parameter is not None and parameter.is_floating_point()
        else torch.float32
    )


def _stop_strings(generation: dict[str, Any], tokenizer: Any, n_prompt: int) -> None:
    """Turn ``stop_strings`` into a stopping criterion that `generate` can use.

    transformers needs the tokenizer for them (``generate(tokenizer=...)``) and reads the
    tokenizer's whole vocabulary, which fails on some tokenizers ("substring not found").
    The criterion is built here, before any work: transformers' own
    (``StopStringCriteria``) where the tokenizer allows it, else one that decodes the
    generated tokens after each step and stops once a stop string appears in them.
    """
    stop = generation.pop("stop_strings", None)
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(strings, Sequence)
        or not strings
        or not all(isinstance(s, str) and s for s in strings)
    ):
        msg = (
            "`generate_kwargs['stop_strings']` must be a non-empty str or a sequence of "
            f"them; got {stop!r}."
        )
        raise TypeError(msg)
    import transformers

    criterion: Any
    try:
        criterion = transformers.StopStringCriteria(tokenizer, list(strings))
    except (ValueError, AttributeError, TypeError, KeyError, IndexError, NotImplementedError):
        criterion = _DecodedStopStrings(tokenizer, tuple(strings), n_prompt)
    given = generation.get("stopping_criteria")
    criteria = transformers.StoppingCriteriaList(list(given) if given is not None else [])
    criteria.append(criterion)
    generation["stopping_criteria"] = criteria


class _DecodedStopStrings:
    """Stop once a stop string appears in the decoded generated tokens (one sequence)."""

    def __init__(self, tokenizer: Any, strings: tuple[str, ...], n_prompt: int) -> None:
        self.tokenizer = tokenizer
        self.strings = strings
        self.n_prompt = n_prompt

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ARG002
        text = str(self.tokenizer.decode([int(i) for i in input_ids[0, self.n_prompt :]]))
        done = any(s in text for s in self.strings)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _check_options(
    options: Mapping[str, Any], chosen: Sequence[str], model: nn.Module
) -> dict[str, dict[str, Any]]:
    """Split `options` by method, checking names and the values checked at no cost."""
    known = frozenset().union(*_OPTIONS.values())
    for name in options:
        if name in _REFUSED:
            msg = f"explain_generation() does not take `{name}`: {_REFUSED[name]}."
            raise ValueError(msg)
        if name not in known:
            msg = (
                f"explain_generation() got an unknown option `{name}`; the options are "
                f"{sorted(known)}."
            )
            raise TypeError(msg)
        takers = [m for m in chosen if name in _OPTIONS[m]]
        if not takers:
            owners = [m for m in GENERATION_METHODS if name in _OPTIONS[m]]
            msg = (
                f"`{name}` applies to {owners}, none of the methods chosen ({list(chosen)}); "
                "drop it or add one of those methods."
            )
            raise ValueError(msg)
    if "residual" in options:
        check_residual(options["residual"])
    if "target_score" in options:
        check_target_score(options["target_score"])
    if "receptive_field" in options:
        check_receptive_field(options["receptive_field"])
    heads = options.get("heads", "mean")
    if isinstance(heads, str) and heads not in HEAD_REDUCTIONS:
        msg = (
            f'`heads` must be "mean", "max", "min", weights or a callable; got {heads!r} '
            '("each" gives one map per head, not one row per generated token).'
        )
        raise ValueError(msg)
    config = getattr(model, "config", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    n_heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, str) and isinstance(n_layers, int) and isinstance(n_heads, int):
        # Weights or a callable: tried on uniform rows of the model's shape, before it runs.
        uniform = torch.ones(n_layers, n_heads, 1, 1, dtype=torch.float64)
        attnflow.fuse_heads(uniform, heads=heads)
    if "validate" in options:
        check_validate(options["validate"])
    layers = options.get("layers", "last")
    if layers != "last":
        if isinstance(layers, bool) or not isinstance(layers, numbers.Integral):
            msg = (
                "`layers` must be 'last' or an int layer index (one row per generated token, "
                f"at one layer); got {layers!r}."
            )
            raise TypeError(msg) if not isinstance(layers, str) else ValueError(msg)
        if isinstance(n_layers, int) and not -n_layers <= int(layers) < n_layers:
            msg = (
                f"`layers` must index the model's {n_layers} layers (0 to {n_layers - 1}, "
                f"or negative from the end); got {layers}."
            )
            raise IndexError(msg)
    exclude = options.get("exclude")
    if exclude is not None:
        positions = [exclude] if isinstance(exclude, numbers.Integral) else exclude
        if (
            isinstance(positions, str)
            or not isinstance(positions, Sequence)
            or not positions
            or not all(
                isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in positions
            )
        ):
            msg = f"`exclude` must be a token position or a sequence of them; got {exclude!r}."
            raise TypeError(msg)
        if any(int(p) < 0 for p in positions):
            msg = (
                "`exclude` must hold non-negative positions (0 is the first prompt token): "
                "each generated token has a prefix of its own length, so a position counted "
                f"from the end would name a different token in each row; got {exclude!r}."
            )
            raise ValueError(msg)
    return {
        method: {k: v for k, v in options.items() if k in _OPTIONS[method]}
        for method in GENERATION_METHODS
    }


def _check_exclude_range(exclude: Any, width: int) -> None:
    if exclude is None:
        return
    positions = [exclude] if isinstance(exclude, numbers.Integral) else list(exclude)
    outside = [int(p) for p in positions if int(p) >= width]
    if outside:
        msg = (
            f"`exclude` must name positions before the last generated token (0 to "
            f"{width - 1} for this prompt and max_new_tokens); got {outside}."
        )
        raise IndexError(msg)


def _check_generate_kwargs(generate_kwargs: object, model: nn.Module) -> dict[str, Any]:
    if generate_kwargs is None:
        return dict(_GREEDY)
    if not isinstance(generate_kwargs, Mapping) or not all(
        isinstance(k, str) for k in generate_kwargs
    ):
        msg = (
            "`generate_kwargs` must be None (greedy decoding) or a mapping of "
            f"model.generate's keyword arguments; got {type(generate_kwargs).__name__}."
        )
        raise TypeError(msg)
    for name in _OWN_ARGUMENTS:
        if name in generate_kwargs:
            msg = (
                f"`generate_kwargs` must not set {name!r}: explain_generation passes the "
                "prompt, its mask and `max_new_tokens` itself."
            )
            raise ValueError(msg)
    config = generate_kwargs.get("generation_config", getattr(model, "generation_config", None))
    for name in _ONE_SEQUENCE:
        value = generate_kwargs.get(name, getattr(config, name, 1))
        if value not in (None, 1):
            msg = (
                f"`generate_kwargs` asks for {name}={value!r}: explain_generation follows one "
                "sequence (its attention rows at every step); beam search and several "
                "returned sequences are not supported. Use greedy decoding or sampling."
            )
            raise ValueError(msg)
    for name in _NO_DRAFTS:
        if generate_kwargs.get(name) is not None:
            msg = (
                f"`generate_kwargs` asks for assisted decoding ({name}): drafted tokens that "
                "are rejected would leave rows in the rollout cache; not supported."
            )
            raise ValueError(msg)
    return dict(generate_kwargs)


def _check_autograd(model: nn.Module) -> None:
    """Refuse, before generating, what would stop gradient rollout after it."""
    from ._torch_gradients import _refuse_inference_mode

    _refuse_inference_mode('explain_generation(methods=[..., "gradient_rollout"])')
    if not any(p.requires_grad for p in model.parameters()):
        msg = (
            '"gradient_rollout" differentiates the generated token\'s logit by the attention '
            "weights, but every parameter of the model is frozen; unfreeze it "
            "(model.requires_grad_(True)) for the call, or drop the method."
        )
        raise RuntimeError(msg)


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _encode(
    tokenizer: Any, prompt: object, device: torch.device
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Encode the prompt: ``input_ids`` and ``attention_mask`` of shape ``(1, P)``, its text."""
    if isinstance(prompt, str):
        if not prompt:
            msg = "`prompt` is empty; give the text to continue."
            raise ValueError(msg)
        encoded = tokenizer(prompt, return_tensors="pt")
        text: str | None = prompt
    elif isinstance(prompt, Mapping):
        encoded = prompt
        text = None
    else:
        msg = (
            "`prompt` must be a str or an encoded prompt (a mapping with input_ids of shape "
            f"(1, P)); got {type(prompt).__name__}."
        )
        raise TypeError(msg)
    ids = encoded.get("input_ids") if isinstance(encoded, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        msg = (
            "`prompt` must encode one sequence: input_ids of shape (1, P), P >= 1; got "
            f"{shape}. Explain one prompt per call."
        )
        raise ValueError(msg)
    mask = encoded.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        msg = (
            "`prompt` has padding (zeros in its attention_mask); explain_generation takes one "
            "unpadded sequence: drop the padding tokens."
        )
        raise ValueError(msg)
    ids = ids.to(device)
    if text is None:
        text = str(tokenizer.decode([int(i) for i in ids[0]]))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, text


# -- following the model's steps --------------------------------------------------------------
class _StepFollower:
    """Runs ``generate`` under capture; after each model call, appends the new rows."""

    def __init__(
        self, model: nn.Module, chosen: Sequence[str], settings: Mapping[str, dict[str, Any]]
    ) -> None:
        self.model = model
        self.rollout = "rollout" in chosen
        self.raw = "raw" in chosen
        rollout, raw = settings["rollout"], settings["raw"]
        shared = rollout if self.rollout else raw
        self.heads = shared.get("heads", "mean")
        self.validate = shared.get("validate", True) is not False
        self.layers = {"rollout": rollout.get("layers", "last"), "raw": raw.get("layers", "last")}
        self.exclude = _positions(rollout.get("exclude"))
        self.cache = CausalRolloutCache(
            residual=rollout.get("residual", 0.5),
            receptive_field=rollout.get("receptive_field", False),
            validate=self.validate,
        )
        self.length = 0
        self.raw_steps: list[torch.Tensor] = []

    def generate(
        self, inputs: dict[str, torch.Tensor], steps: int, generation: dict[str, Any]
    ) -> torch.Tensor:
        """Run ``model.generate``; return the one sequence, prompt and generated tokens."""
        generate: Callable[..., Any] = self.model.generate  # type: ignore[assignment]
        if not (self.rollout or self.raw):
            output = generate(**inputs, max_new_tokens=steps, **generation)
            return self._sequence(output)
        from ._torch_capture import capture

        fuse_now = isinstance(self.heads, str)
        with (
            capture(self.model, heads=self.heads if fuse_now else "each") as cap,
            Hooks() as hooks,
        ):
            hooks.after(self.model, lambda *_: self._step(cap.records))
            output = generate(**inputs, max_new_tokens=steps, **generation)
        sequence = self._sequence(output)
        if self.length != sequence.shape[0] - 1:
            msg = (
                f"explain_generation followed {self.length} positions but the model generated "
                f"a sequence of {sequence.shape[0]} tokens (one more was expected): its "
                "generate() does not call the model once per token on one sequence."
            )
            raise RuntimeError(msg)
        return sequence

    @staticmethod
    def _sequence(output: Any) -> torch.Tensor:
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        return sequences[0].detach()

    def _step(self, records: list[torch.Tensor]) -> None:
        """Append the rows of the positions this model call saw first."""
        if not records:
            return  # nothing captured: capture raises when its block ends
        per_head = not isinstance(self.heads, str)
        # (B, L, H, q, k); one head, already fused, when capture fuses a named `heads`.
        block = torch.stack(records, dim=-4)
        if block.shape[0] != 1:
            msg = (
                f"The model was called on {block.shape[0]} sequences at once (beam search, "
                "several returned sequences, or a batched prompt); explain_generation "
                "follows one sequence."
            )
            raise RuntimeError(msg)
        q, keys = int(block.shape[-2]), int(block.shape[-1])
        new = keys - self.length
        if not 1 <= new <= q:
            msg = (
                f"The model's step attends over {keys} keys with {q} queries after "
                f"{self.length} positions: not the next token(s) of one sequence. "
                "explain_generation needs one model call per generated token."
            )
            raise RuntimeError(msg)
        block = block[0, ..., q - new :, :].detach()
        precision: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if block.dtype in (torch.float16, torch.bfloat16):
            # Products over every layer lose too much in half precision: roll out in
            # float32, checking the rows against the precision they were computed in.
            name = str(block.dtype).removeprefix("torch.")
            precision = stored_precision(name, torch.finfo(block.dtype).eps)
            block = block.float()
        with precision:
            if per_head:
                block = attnflow.fuse_heads(block, heads=self.heads, validate=self.validate)
            else:
                block = block[..., 0, :, :]
            if self.rollout:
                self.cache.append(block)
        if self.raw:
            layer = -1 if self.layers["raw"] == "last" else int(self.layers["raw"])
            self.raw_steps.append(block[layer, -1, :])
        self.length = keys

    def rollout_rows(self, n_prompt: int, width: int) -> np.ndarray:
        layer = -1 if self.layers["rollout"] == "last" else int(self.layers["rollout"])
        rows = self.cache.rows(n_prompt - 1, width, layer=layer, exclude=self.exclude)
        return rows.double().cpu().numpy()  # type: ignore[no-any-return]

    def raw_rows(self, n_prompt: int, width: int) -> np.ndarray:
        rows = np.zeros((width - n_prompt + 1, width))
        for index, row in enumerate(self.raw_steps):
            rows[index, : row.shape[0]] = row.double().cpu().numpy()
        return rows


def _positions(exclude: object) -> tuple[int, ...]:
    if exclude is None:
        return ()
    if isinstance(exclude, numbers.Integral):
        return (int(exclude),)
    assert isinstance(exclude, Sequence)
    return tuple(int(p) for p in exclude)


def _gradient_rows(
    model: nn.Module,
    sequence: torch.Tensor,
    n_prompt: int,
    options: Mapping[str, Any],
    device: torch.device,
) -> np.ndarray:
    """GAE rows: for each generated token, :func:`explain` on its prefix, its id the target.

    ``explain(method="gradient_rollout", rows=-1, target=token)`` differentiates the
    token's logit at the prefix's last position by every attention weight (one forward
    and one backward pass) and rolls the weights and gradients out.
    """
    from ._torch_explain import explain

    n_generated = int(sequence.shape[0]) - n_prompt
    width = n_prompt + n_generated - 1
    rows = np.zeros((n_generated, width))
    for index in range(n_generated):
        end = n_prompt + index
        prefix = sequence[:end][None].to(device)
        row = explain(
            model,
            {"input_ids": prefix, "attention_mask": torch.ones_like(prefix)},
            method="gradient_rollout",
            rows=-1,
            target=int(sequence[end]),
            **options,
        )
        rows[index, :end] = row[0].double().cpu().numpy()
    return rows


def _target_conditioned_rows(
    model: nn.Module, sequence: torch.Tensor, n_prompt: int, method: str, device: torch.device
) -> np.ndarray:
    """Direct logit, ALTI-Logit or IFR rows of every generated token, from one forward.

    Row ``t`` explains generated token ``t`` (its id the target) at the position that
    predicted it, ``P + t - 1``. In a causal model that row reads only its prefix, so all
    ``T`` rows come from one forward over the sequence without its last token, each equal
    to :func:`explain` on its own prefix.
    """
    from ._torch_explain import explain

    n_generated = int(sequence.shape[0]) - n_prompt
    width = n_prompt + n_generated - 1
    tokens = sequence[:width][None].to(device)
    rows = list(range(n_prompt - 1, width))
    targets = sequence[n_prompt:][None].to(device)
    result = explain(
        model,
        {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)},
        method=typing.cast("Method", method),
        rows=rows,
        target=targets if method_spec(method).uses_target else None,
    )
    rows_out: np.ndarray = result[0].double().cpu().numpy()
    return rows_out
