r"""Target-conditioned attributions of PyTorch causal LMs in one forward pass.

``explain(model, inputs, method="direct_logit" | "alti_logit" | "ifr", rows=-1)``
(:func:`attnflow.adapters.torch.explain`) lands here. One ordinary forward of the model
runs with its own attention kernel; forward pre-hooks keep, for every layer, only what
the explained rows need:

* the block's input (the residual stream) at the explained rows, ``(batch, r, d)``;
* the attention rows of the explained positions, ``(batch, heads, r, n)``, recomputed
  from the layer's queries at those rows and its keys (RoPE applied as the model applies
  it, causal, padding and sliding-window masks): never an ``(n, n)`` array;
* the value vectors of every token, ``(batch, kv_heads, n, head_dim)`` (for the direct
  logit and ALTI-Logit, whose readout is known only once the last layer has run).

The last hidden state at the explained rows and the final norm give the readout of the
target's logit. The maths (readout, direct logit terms, IFR proximities, ALTI-Logit's
propagation, the sums over heads and layers) is the core's,
:mod:`attnflow._logit_attribution`; this module gathers the pieces. Every call checks
that the readout reproduces the model's own logit of the target at each explained row,
so a model whose head does more than a norm and a linear map is refused, not explained.

Supported: the attention classes of :data:`SUPPORTED_ATTENTION` inside decoder layers
with ``input_layernorm`` (Llama, Mistral, Qwen2, SmolLM2: separate ``q/k/v/o_proj``,
grouped-query attention, RoPE, causal or sliding-window masks), with a final RMSNorm or
LayerNorm before the output embeddings.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from attnflow._logit_attribution import (
    FinalNorm,
    alti_logit_terms,
    direct_logit_terms,
    ifr_terms,
    readout,
    rollouts_below,
    sum_terms,
)
from attnflow._methods import method_spec

from ._common import check_explained_rows, check_target_options
from ._torch_blockwise import SUPPORTED_ATTENTION, _call_kwargs, _run, _window
from ._torch_capture import _padding_mask, capture
from ._torch_hooks import Hooks, attention_sites

__all__ = ["TargetGatherer", "explain_target_conditioned", "unsupported_reason"]

_OPTIONS = frozenset({"heads", "layers", "mask"})


@dataclass(frozen=True)
class _Family:
    """How one kind of decoder layer keeps its attention's pieces."""

    attention: str
    """The attribute of the decoder layer holding its attention module."""
    classes: frozenset[str]
    """The attention modules' class names."""
    norm: str
    """The decoder layer's norm before its attention."""
    output: str
    """The attention's output projection, an ``nn.Linear`` (or GPT-2's ``Conv1D``)."""
    rotary: bool
    """Whether queries and keys are rotated by ``position_embeddings`` (RoPE)."""


_FAMILIES = (
    _Family("self_attn", SUPPORTED_ATTENTION, "input_layernorm", "o_proj", rotary=True),
    _Family("attn", frozenset({"GPT2Attention"}), "ln_1", "c_proj", rotary=False),
)


@dataclass
class _Layer:
    """One decoder layer's modules and what its hooks kept."""

    block: nn.Module
    attention: Any
    family: _Family
    index: int
    window: int | None
    residual: torch.Tensor | None = None
    """``(batch, r, d)``: the block's input at the explained rows."""
    weights: torch.Tensor | None = None
    """``(batch, heads, r, n)``: the attention rows of the explained positions."""
    values: torch.Tensor | None = None
    """``(batch, kv_heads, n, head_dim)``, the value bias included."""
    ifr: torch.Tensor | None = None
    """``(batch, heads, r, n)``: IFR's shares, computed as soon as the layer has run."""


@dataclass
class _Run:
    """The state of one explained forward."""

    layers: list[_Layer]
    rows: Sequence[int]
    keep_values: bool
    compute_ifr: bool
    span: bool = False
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    """``(batch, r)``: the explained positions of each sample."""
    final_hidden: torch.Tensor | None = None
    """``(batch, n, d)``: the final norm's input, every position (what the head reads)."""
    errors: list[str] = field(default_factory=list)


SUPPORTED_MODELS = (
    "decoder layers of Llama, Mistral and Qwen2 style (input_layernorm, self_attn.{q,k,v,o}_proj, "
    "grouped-query attention, RoPE, causal or sliding-window masks) and GPT-2 blocks (ln_1, "
    "attn.c_attn, attn.c_proj), with a final RMSNorm or LayerNorm and a linear lm_head"
)


def _decoder_layers(model: nn.Module) -> list[tuple[nn.Module, Any, _Family]]:
    """Return ``(decoder layer, its attention, its family)`` of every layer, in order.

    The layers are the blocks of the model's attention sites (:mod:`._torch_hooks`) that
    hold their attention under a family's attribute, next to the family's norm.
    """
    found = []
    for site in attention_sites(model):
        module = site.block
        if module is None:
            continue
        for family in _FAMILIES:
            attention = getattr(module, family.attention, None)
            if (
                attention is site.attention
                and type(attention).__name__ in family.classes
                and isinstance(getattr(module, family.norm, None), nn.Module)
                and not getattr(attention, "is_cross_attention", False)
            ):
                found.append((module, attention, family))
    return found


def _final_norm(model: nn.Module) -> nn.Module | None:
    get_decoder: Any = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    for name in ("norm", "ln_f"):
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """Half precision in float32: a softmax and sums over thousands of terms need it."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _output_projection(layer: _Layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W_O, b_O)`` with ``W_O`` of shape ``(H * dh, d)``, applied as ``context @ W_O``."""
    module = getattr(layer.attention, layer.family.output)
    weight = _wide(module.weight.detach())
    bias = None if module.bias is None else _wide(module.bias.detach())
    return (weight.T if isinstance(module, nn.Linear) else weight), bias


def _output_embedding(model: nn.Module) -> Any:
    get: Any = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the target-conditioned methods cannot explain `model`, or None if they can."""
    layers = _decoder_layers(model)
    if not layers:
        return f"{type(model).__name__} has none of the supported blocks ({SUPPORTED_MODELS})"
    for _, attention, family in layers:
        names = ("q_proj", "k_proj", "v_proj", family.output) if family.rotary else ("c_attn",)
        for name in names:
            if not hasattr(getattr(attention, name, None), "weight"):
                return f"{type(attention).__name__} has no linear `{name}`"
        if getattr(attention, "reorder_and_upcast_attn", False):
            return f"{type(attention).__name__} reorders and upcasts its attention"
    if _final_norm(model) is None:
        return f"{type(model).__name__} has no final norm (`get_decoder().norm` or `.ln_f`)"
    if not isinstance(_output_embedding(model), nn.Linear):
        return f"{type(model).__name__} has no linear output embedding (lm_head)"
    return None


def _positions(rows: Sequence[int], mask: torch.Tensor) -> torch.Tensor:
    """``(batch, r)`` positions: negative rows count from the end of each sample's real tokens."""
    lengths = mask.sum(dim=-1)  # (batch,)
    n = mask.shape[-1]
    # The position after each sample's last real token (right or left padding alike).
    ends = n - torch.argmax(mask.flip(-1).to(torch.int8), dim=-1)
    out = [ends + row if row < 0 else torch.full_like(ends, row) for row in rows]
    positions = torch.stack(out, dim=-1)
    bad = (positions < 0) | (positions >= n)
    if not bad.any():
        real = torch.gather(mask, 1, positions.clamp(0, n - 1))
        bad = ~real
    if bool(bad.any()):
        sample, which = (int(i) for i in bad.nonzero()[0])
        msg = (
            f"`rows` asks for position {rows[which]} of sample {sample}, which is not one of "
            f"its {int(lengths[sample])} real tokens (of {n} positions, padding excluded): "
            "pass a row inside the text (-1 is the last real token)."
        )
        raise ValueError(msg)
    return positions


def _queries_keys_values(
    layer: _Layer, hidden: torch.Tensor, embeddings: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q (B, H, n, hd)``, ``k`` and ``v (B, KV, n, hd)`` as the layer computes them."""
    attention = layer.attention
    head_dim = int(attention.head_dim)
    batch, n, _ = hidden.shape
    if layer.family.rotary:
        q, k, v = (
            getattr(attention, f"{p}_proj")(hidden).view(batch, n, -1, head_dim).transpose(1, 2)
            for p in "qkv"
        )
        cos, sin = (e.detach() for e in embeddings)
        rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        q, k = rotary(q, k, cos, sin)
        return q, k, v
    q, k, v = attention.c_attn(hidden).split(attention.split_size, dim=2)
    q, k, v = (t.view(batch, n, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    return q, k, v


def _attention_rows(
    layer: _Layer, hidden: torch.Tensor, embeddings: Any, run: _Run
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the explained rows' attention ``(B, H, r, n)`` and the values ``(B, KV, n, hd)``."""
    q, k, v = (_wide(t) for t in _queries_keys_values(layer, hidden, embeddings))
    positions = run.positions
    assert positions is not None
    batch, heads, n, head_dim = q.shape
    kv_heads = k.shape[1]
    index = positions[:, None, :, None].expand(batch, heads, positions.shape[1], head_dim)
    q_rows = torch.gather(q, 2, index)  # (B, H, r, hd)
    grouped = q_rows.reshape(batch, kv_heads, -1, head_dim)  # a key head's group of query heads
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * float(layer.attention.scaling)
    scores = scores.view(batch, heads, -1, n)
    keys = torch.arange(n, device=hidden.device)
    allowed = keys[None, None, :] <= positions[:, :, None]  # (B, r, n): causal
    if layer.window is not None:
        allowed = allowed & (keys[None, None, :] > positions[:, :, None] - layer.window)
    if run.mask is not None:
        allowed = allowed & run.mask[:, None, :]
    scores = scores.masked_fill(~allowed[:, None], -math.inf)
    return torch.softmax(scores, dim=-1), v


def _install(hooks: Hooks, model: nn.Module, run: _Run, final: nn.Module) -> None:
    hooks.before(model, _on_model_call(run), with_kwargs=True)
    for layer in run.layers:
        hooks.before(layer.block, _entering_block(layer, run), with_kwargs=True)
        hooks.before(layer.attention, _entering_attention(layer, run), with_kwargs=True)

    def last_hidden(module: nn.Module, args: tuple[Any, ...]) -> None:  # noqa: ARG001
        if args and isinstance(args[0], torch.Tensor) and run.positions is not None:
            run.final_hidden = args[0].detach()

    hooks.before(final, last_hidden)


def _at_rows(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    index = positions[..., None].expand(*positions.shape, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def _read_call(run: _Run, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Read the call's mask and place the explained rows (raises on rows outside the text)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.ndim < 2 or ids.shape[1] < 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        msg = (
            "the model must be called with input_ids (or inputs_embeds) of shape (batch, n), "
            f"n >= 1; got {shape}."
        )
        raise ValueError(msg)
    padding = _padding_mask(module, args, kwargs)
    shape = tuple(ids.shape[:2])
    mask = torch.ones(shape, dtype=torch.bool, device=ids.device) if padding is None else padding
    if mask.ndim != 2 or tuple(mask.shape) != shape:
        msg = f"the padding mask has shape {tuple(mask.shape)}; expected {shape} (batch, n)."
        raise ValueError(msg)
    run.mask = mask.to(torch.bool)
    run.positions = _positions(run.rows, run.mask)


def _on_model_call(run: _Run) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _read_call(run, module, args, kwargs)

    return hook


def _entering_block(layer: _Layer, run: _Run) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: ARG001
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, torch.Tensor) and run.positions is not None:
            layer.residual = _wide(_at_rows(hidden.detach(), run.positions))

    return hook


def _entering_attention(layer: _Layer, run: _Run) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: ARG001
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if not isinstance(hidden, torch.Tensor) or (layer.family.rotary and embeddings is None):
            msg = (
                f"{type(layer.attention).__name__} (layer {layer.index}) was called without "
                "hidden_states (and position_embeddings, for RoPE), which the "
                "target-conditioned methods read."
            )
            raise ValueError(msg)
        if kwargs.get("encoder_hidden_states") is not None:
            return
        with torch.no_grad():
            weights, values = _attention_rows(layer, hidden.detach(), embeddings, run)
            layer.weights = weights
            if run.keep_values:
                layer.values = values
            if run.compute_ifr:
                assert layer.residual is not None
                output_weight, output_bias = _output_projection(layer)
                layer.ifr, _ = ifr_terms(
                    weights,
                    values,
                    output_weight,
                    layer.residual,
                    output_bias=output_bias,
                    span=run.span,
                )

    return hook


def _norm_kind(
    norm: nn.Module,
) -> tuple[FinalNorm, torch.Tensor | None, torch.Tensor | None, float]:
    if isinstance(norm, nn.LayerNorm):
        return "layer", norm.weight, norm.bias, float(norm.eps)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if "RMSNorm" not in type(norm).__name__ or eps is None:
        msg = (
            f"the final norm {type(norm).__name__} is neither an nn.LayerNorm nor an RMSNorm "
            "with `variance_epsilon` (or `eps`): its readout is not known."
        )
        raise ValueError(msg)
    weight = getattr(norm, "weight", None)
    return "rms", weight, None, float(eps)


def _logits(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", output[0] if isinstance(output, tuple) else output)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        msg = "the model must return logits of shape (batch, n, vocabulary) (or `.logits`)."
        raise TypeError(msg)
    return logits


def _check_target_ids(target: object, vocabulary: int, name: str = "target") -> torch.Tensor | None:
    """Check `target` (or `foil`) before any work: vocabulary ids, at most ``(batch, r)``."""
    if target is None:
        return None
    given = target.detach().cpu() if isinstance(target, torch.Tensor) else target
    try:
        chosen = torch.as_tensor(given)
    except (TypeError, ValueError, RuntimeError):
        chosen = torch.tensor(0.5)  # not numbers: refused below
    if (
        chosen.is_floating_point()
        or chosen.is_complex()
        or chosen.dtype == torch.bool
        or chosen.ndim > 2
    ):
        msg = (
            f"`{name}` must be a vocabulary id (int), one per sample, or one per sample and "
            f"row; got {target!r}."
        )
        raise TypeError(msg)
    if bool(((chosen < 0) | (chosen >= vocabulary)).any()):
        msg = f"`{name}` must be vocabulary ids in [0, {vocabulary}); got {target!r}."
        raise ValueError(msg)
    return chosen.to(torch.long)


def _targets(chosen: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """``(batch, r)`` vocabulary ids: the argmax at each explained row by default."""
    batch, rows, _ = logits.shape
    if chosen is None:
        return logits.argmax(dim=-1)
    chosen = chosen.to(logits.device)
    chosen = chosen.reshape(-1, 1) if chosen.ndim == 1 else chosen
    try:
        return torch.broadcast_to(chosen, (batch, rows))
    except RuntimeError:
        msg = (
            f"`target` must hold one id, one per sample ({batch}) or one per sample and row "
            f"({batch}, {rows}); got shape {tuple(chosen.shape)}."
        )
        raise ValueError(msg) from None


def explain_target_conditioned(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    method: str,
    rows: int | Sequence[int] | None,
    target: object = None,
    foil: object = None,
    span: object = False,
    heads: Literal["sum", "each"] = "sum",
    layers: Literal["sum", "all", "cumulative"] = "sum",
    mask: object = None,
) -> torch.Tensor:
    """Direct logit, ALTI-Logit or IFR scores of `rows` (see the module docstring)."""
    gatherer = TargetGatherer(
        model,
        inputs,
        method=method,
        rows=rows,
        target=target,
        foil=foil,
        span=span,
        heads=heads,
        layers=layers,
        mask=mask,
    )
    matrices = None
    with Hooks() as hooks, torch.no_grad():
        gatherer.subscribe(hooks)
        if gatherer.needs_contributions:
            with capture(model, contributions="alti") as cap:
                output = _run(model, inputs, gatherer.lean)
            matrices = cap.contributions
        else:
            output = _run(model, inputs, gatherer.lean)
    return gatherer.finish(output, matrices)


class TargetGatherer:
    """The pieces of one forward that a target-conditioned method reads, and its scores.

    Built with :func:`explain_target_conditioned`'s arguments, which it checks before any
    work (bad rows in a mapping of inputs included). :meth:`subscribe` installs its hooks
    on a :class:`._torch_hooks.Hooks` of the forward to watch, which other consumers may
    share (a weights or gradient capture); after that forward, :meth:`finish` turns what
    was gathered and the model's output into the scores. ``method="alti_logit"`` also
    needs the ALTI contributions of the same forward
    (``capture(model, contributions="alti")`` entered around it,
    :attr:`needs_contributions`). :attr:`lean` holds the keyword arguments that keep the
    forward lean (the logits of the last position only, no KV cache), for a caller that
    needs nothing else from it.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
        *,
        method: str,
        rows: int | Sequence[int] | None,
        target: object = None,
        foil: object = None,
        span: object = False,
        heads: Literal["sum", "each"] = "sum",
        layers: Literal["sum", "all", "cumulative"] = "sum",
        mask: object = None,
    ) -> None:
        spec = method_spec(method)
        check_target_options(spec, heads, layers, span)
        if mask is not None:
            msg = (
                f'method="{method}" reads the padding mask from the model call (attention_mask); '
                "pass it in `inputs`, not as `mask`."
            )
            raise ValueError(msg)
        if spec.composes == "ifr" and (target is not None or foil is not None):
            msg = (
                'method="ifr" is conditioned on the explained rows, not on a vocabulary id: drop '
                '`target`/`foil` (or use method="direct_logit" or "alti_logit").'
            )
            raise ValueError(msg)
        reason = unsupported_reason(model)
        if reason is not None:
            msg = f'method="{method}" cannot explain this model: {reason}.'
            raise ValueError(msg)
        vocabulary = int(_output_embedding(model).weight.shape[0])
        target_ids = _check_target_ids(target, vocabulary)
        foil_ids = _check_target_ids(foil, vocabulary, "foil")
        chosen = check_explained_rows(-1 if rows is None else rows)
        single = isinstance(rows, int) or rows is None
        final = _final_norm(model)
        assert final is not None
        kind, norm_weight, norm_bias, eps = _norm_kind(final)
        run = _Run(
            layers=[
                _Layer(block, attention, family, index, _window(attention))
                for index, (block, attention, family) in enumerate(_decoder_layers(model))
            ],
            rows=chosen,
            keep_values=spec.composes != "ifr",
            compute_ifr=spec.composes == "ifr",
            span=bool(span),
        )
        # The logits of the last position only, no KV cache: the explained rows' logits are
        # read from the final norm's input below (at 8,192 tokens all logits are 1.6 GB).
        lean = _call_kwargs(model, inputs, {"logits_to_keep": 1, "use_cache": False})
        if isinstance(inputs, Mapping):
            _read_call(run, model, (), dict(inputs))  # bad rows refused before the model runs
        self.lean = lean
        self.model = model
        self.method = method
        self.spec = spec
        self.run = run
        self.final = final
        self.norm = (kind, norm_weight, norm_bias, eps)
        self.targets = (target_ids, foil_ids)
        self.single = single
        self.span = bool(span)
        self.heads: Literal["sum", "each"] = heads
        self.layers: Literal["sum", "all", "cumulative"] = layers
        self.needs_contributions = spec.composes == "alti_logit"

    def subscribe(self, hooks: Hooks) -> None:
        """Install the gathering hooks on the model through `hooks` (see the class)."""
        _install(hooks, self.model, self.run, self.final)

    def finish(self, output: Any, matrices: torch.Tensor | None = None) -> torch.Tensor:
        """Return the scores from the watched forward's `output` (and ALTI `matrices`)."""
        model, run, final, spec = self.model, self.run, self.final, self.spec
        kind, norm_weight, norm_bias, eps = self.norm
        target_ids, foil_ids = self.targets
        heads, layers, single, span = self.heads, self.layers, self.single, self.span
        if self.needs_contributions and matrices is None:
            msg = (
                f'method="{self.method}" needs the ALTI contributions of the same forward: '
                'capture(model, contributions="alti") around it, its `contributions` here.'
            )
            raise ValueError(msg)
        positions, last_hidden = run.positions, run.final_hidden
        if (
            positions is None
            or last_hidden is None
            or any(layer.weights is None for layer in run.layers)
        ):
            msg = "the model's forward did not run through its decoder layers and final norm."
            raise RuntimeError(msg)
        head = _output_embedding(model)
        with torch.no_grad():
            hidden = _at_rows(last_hidden, positions)
            logits = head(final(hidden))  # (B, r, V): what the model computes at the rows
            _check_head(_logits(output)[:, -1], head(final(last_hidden[:, -1])))
        if spec.composes == "ifr":
            stacked = torch.stack(
                [layer.ifr for layer in run.layers if layer.ifr is not None], dim=1
            )
        else:
            targets = _targets(target_ids, logits)
            gain = None if norm_weight is None else _wide(norm_weight.detach())
            shift = None if norm_bias is None else _wide(norm_bias.detach())
            wide_hidden = _wide(hidden)

            def read(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                rows = _wide(head.weight.detach()[ids])
                return readout(wide_hidden, rows, norm=kind, weight=gain, bias=shift, eps=eps)

            with torch.no_grad():
                direction, constant = read(targets)
                _check_readout(logits, targets, wide_hidden, direction, constant, head)
                if foil_ids is not None:
                    # A contrast is linear in the readout: u_target - u_foil.
                    direction = direction - read(_targets(foil_ids, logits))[0]
                terms = [
                    direct_logit_terms(
                        layer.weights, layer.values, _output_projection(layer)[0], direction
                    )
                    for layer in run.layers
                ]
                stacked = torch.stack(terms, dim=1)  # (B, L, H, r, n)
                if self.needs_contributions:
                    assert matrices is not None  # refused above
                    stacked = alti_logit_terms(stacked, rollouts_below(matrices))
        result: torch.Tensor = sum_terms(stacked, heads=heads, layers=layers)
        return result[..., 0, :] if single or span else result


def _tolerance(logits: torch.Tensor) -> float:
    """How far a recomputed logit may be from the model's.

    RMSNorms of Llama-family models compute in float32 whatever the model's dtype: a few
    thousand float32 roundings of the largest logit.
    """
    eps = max(float(torch.finfo(logits.dtype).eps), float(torch.finfo(torch.float32).eps))
    scale = float(logits.abs().amax()) if logits.numel() else 1.0
    return 4096 * eps * max(scale, 1.0)


def _check_head(model_logits: torch.Tensor, recomputed: torch.Tensor) -> None:
    """Refuse a model whose logits are more than its final norm and output embedding."""
    error = float((model_logits - recomputed).abs().max())
    if error > _tolerance(model_logits):
        msg = (
            "the final norm and the output embedding applied to the last hidden state give "
            f"the model's last logits within {error:.3g} only: the model's head does more "
            "than a norm and a linear map (logit scaling or soft-capping), which the "
            "target-conditioned methods do not decompose."
        )
        raise ValueError(msg)


def _check_readout(
    logits: torch.Tensor,
    targets: torch.Tensor,
    hidden: torch.Tensor,
    direction: torch.Tensor,
    constant: torch.Tensor,
    head: Any,
) -> None:
    """Refuse a readout that does not give the target's logit (a norm it misreads)."""
    model_logit = torch.gather(logits, 2, targets[..., None])[..., 0]
    bias = 0.0 if head.bias is None else head.bias.detach()[targets]
    read = (hidden * direction).sum(dim=-1) + constant + bias
    error = float((read - model_logit).abs().max())
    if error > _tolerance(logits):
        msg = (
            f"the linearised final norm reads the target's logit within {error:.3g} only: the "
            "final norm is not the RMSNorm or LayerNorm it was taken for."
        )
        raise ValueError(msg)
