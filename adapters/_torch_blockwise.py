r"""Exact rollout and GAE rows of Llama-family causal LMs without materialising attention.

``explain(model, inputs, rows=..., blockwise=True)`` (:func:`attnflow.adapters.torch.explain`)
lands here. One ordinary forward of the model runs with its own attention kernel (SDPA,
flash, ...); forward pre-hooks on each attention module keep what is needed to recompute
that layer's queries, keys and values: its input hidden states ``(batch, n, d)`` and the
rotary ``(cos, sin)`` the model passes. The rows are then chains of weighted column sums,
top-down (docs/maths.md, "Rollout rows without the attention matrix"):

.. math::

    r_L = e_i, \qquad r_{l-1}^\top = r_l^\top \tilde A_l, \qquad
    \tilde A_l = (1 - \alpha) \operatorname{fuse}_h A_{l,h} + \alpha I ,

and for Chefer et al.'s GAE :math:`r_{l-1}^\top = r_l^\top (I + \bar A_l)` with
:math:`\bar A_l = \operatorname{mean}_h (\nabla A_{l,h} \odot A_{l,h})^+` and
:math:`\nabla A_{l,h} = dO_{l,h} V_{l,h}^\top`, :math:`dO` the gradient of the target logit at
the attention output before ``o_proj`` (read during the backward pass, layer by layer,
top-down, and used at once). :math:`r^\top A_{l,h}` is computed in blocks of query rows,
``softmax(q_blk Kᵀ/√d + mask)`` weighted by ``r_blk`` and summed over the rows, one key-value
head's keys serving its group of query heads (no ``repeat_kv``): nothing of shape
``(heads, n, n)`` or ``(n, n)`` is ever held, only ``(heads, block, n)`` scores.

For a head fusion that is linear (the mean, given weights) the step is also the ``dV`` of a
fused attention backward with ``dO`` set to the rows (``engine="sdpa"``, the default on
CUDA): ``out = A V'`` with ``dO = Rᵀ`` gives ``dV' = Aᵀ Rᵀ``.

Supported: the attention classes in :data:`SUPPORTED_ATTENTION` (Llama, Mistral, Qwen2:
separate ``q/k/v/o_proj``, grouped-query attention, RoPE, causal or sliding-window masks).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import array_api_compat.torch as xp_torch
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from attnflow._deprecation import MISSING, renamed_keyword
from attnflow._methods import METHODS as METHOD_SPECS
from attnflow._methods import method_spec
from attnflow._receptive_field import normalize_attribution
from attnflow._validation import (
    AttentionLayout,
    HeadFusionSpec,
    check_exclude,
    check_head_fusion,
    check_layers,
    check_receptive_field,
    check_residual,
    check_rows,
    check_validate,
)

from ._common import TargetScore, check_no_target, check_target_score, check_target_type
from ._torch_hooks import Hooks, attention_sites

__all__ = [
    "SUPPORTED_ATTENTION",
    "explain_rows",
    "materialised_bytes",
    "unsupported_reason",
    "use_blockwise",
]

#: Attention classes whose queries and keys the blockwise path recomputes exactly.
SUPPORTED_ATTENTION = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention"})
#: The methods with a blockwise path (:attr:`attnflow._methods.MethodSpec.blockwise`).
METHODS = tuple(name for name, spec in METHOD_SPECS.items() if spec.blockwise)
_ROLLOUT_OPTIONS = frozenset(
    {"heads", "residual", "layers", "mask", "receptive_field", "exclude", "validate", "engine"}
)
_GRADIENT_OPTIONS = frozenset(
    {
        "rule",
        "normalize_result",
        "normalize",  # its spelling until 0.1, with a DeprecationWarning
        "residual",
        "layers",
        "mask",
        "exclude_self",
        "receptive_field",
        "exclude",
        "validate",
    }
)
#: Bytes of one block of scores ``(batch, heads, block, keys)``, float32.
BLOCK_BYTES = 32 * 2**20
#: Materialised attention above this share of the available memory goes blockwise.
MEMORY_SHARE = 0.25


# -- which models ---------------------------------------------------------------------------
def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Return the model's supported attention modules, in layer order."""
    return [
        site.attention
        for site in attention_sites(model)
        if type(site.attention).__name__ in SUPPORTED_ATTENTION
    ]


def unsupported_reason(model: nn.Module, method: object) -> str | None:
    """Why the blockwise path cannot explain `model` with `method`, or None if it can."""
    if not isinstance(method, str) or method not in METHODS:
        listed = " and ".join(f'method="{name}"' for name in METHODS)
        return f"blockwise=True computes {listed} rows; got method={method!r}"
    modules = _attention_modules(model)
    if not modules:
        names = sorted(SUPPORTED_ATTENTION)
        return (
            f"{type(model).__name__} has none of the attention modules the blockwise path "
            f"recomputes ({', '.join(names)}: Llama, Mistral and Qwen2-style causal LMs)"
        )
    for module in modules:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(module, name, None), nn.Linear):
                return f"{type(module).__name__} has no linear `{name}`"
        config = getattr(module, "config", None)
        if getattr(config, "is_causal", True) is False or not getattr(module, "is_causal", True):
            return f"{type(module).__name__} is not causal"
    return None


def _window(module: Any) -> int | None:
    """Return the sliding window of one attention layer (None: full causal attention)."""
    if hasattr(module, "sliding_window"):  # Qwen2: per layer
        value = module.sliding_window
    else:  # Mistral: one for the model
        value = getattr(getattr(module, "config", None), "sliding_window", None)
    return None if value is None else int(value)


def materialised_bytes(model: nn.Module, batch: int, n: int) -> int:
    """Bytes of every layer's ``(batch, heads, n, n)`` float32 weights (what capture holds)."""
    modules = _attention_modules(model)
    heads = sum(int(getattr(m.config, "num_attention_heads", 1)) for m in modules)
    return 4 * batch * heads * n * n


def available_bytes(device: torch.device) -> int:
    """Free memory on `device`: ``torch.cuda.mem_get_info`` or /proc/meminfo's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with Path("/proc/meminfo").open(encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62  # unknown: nothing is refused on a guess


def check_matrices_fit(model: nn.Module, inputs: Any, method: str, *, copies: int = 1) -> None:
    """Refuse, before the model runs, value-aware matrices that the memory cannot hold.

    Value-aware capture keeps every layer's ``(batch, n, n)`` token-mixing matrix (float32
    at least) and the rollout composes them: `copies` of ``layers x n x n`` numbers are
    needed, 2 at the least; ALTI-Logit measured 11.6 (1.46 GB over the forward for
    SmolLM2's 30 layers at 1,024 tokens: the capture, every layer's rollout, the rollouts
    below each layer). Unlike the attention rows of rollout or the target-conditioned
    ``direct_logit`` and ``ifr``, they have no blockwise form: ALTI's matrix needs every
    pair of tokens.
    """
    shape = _shape_of(inputs)
    if shape is None:
        return
    batch, n = shape
    layers = len(_attention_modules(model))
    needed = copies * 4 * batch * layers * n * n
    available = available_bytes(next(model.parameters()).device)
    if needed > available:
        msg = (
            f'method="{method}" holds every layer\'s {n} x {n} token-mixing matrix: about '
            f"{needed / 2**30:.3g} GiB for {batch} x {n} tokens and {layers} layers, more than "
            f"the {available / 2**30:.3g} GiB available. Shorten the input, or use "
            'method="direct_logit" or "ifr", which read only the explained rows and reach '
            "long contexts."
        )
        raise MemoryError(msg)


def _shape_of(inputs: Any) -> tuple[int, int] | None:
    """``(batch, n)`` of the token ids in `inputs`, if they can be read."""
    ids: Any = inputs
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    elif isinstance(inputs, Sequence) and inputs:
        ids = inputs[0]
    if isinstance(ids, torch.Tensor) and ids.ndim >= 2:
        return int(ids.shape[0]), int(ids.shape[1])
    return None


def use_blockwise(
    model: nn.Module, inputs: Any, method: object, blockwise: object, options: Mapping[str, Any]
) -> bool:
    """Decide explain()'s path; raise if `blockwise=True` cannot be honoured.

    ``blockwise=None`` goes blockwise for a supported model and method when the model's
    attention implementation cannot be captured, or as :mod:`._torch_path` estimates
    (cost and memory of both paths; the choice is logged).
    """
    if blockwise is not None and not isinstance(blockwise, bool):
        msg = (
            "`blockwise` must be True (rows from queries and keys, blockwise), False (capture "
            f"the attention weights) or None (choose from a memory estimate); got {blockwise!r}."
        )
        raise TypeError(msg)
    if blockwise is False:
        return False
    reason = unsupported_reason(model, method)
    if blockwise is True:
        if reason is not None:
            msg = (
                f"explain(..., blockwise=True) cannot run here: {reason}. It supports "
                'method="rollout" and method="gradient_rollout" on causal LMs built of '
                f"{', '.join(sorted(SUPPORTED_ATTENTION))} modules; pass blockwise=False "
                "(or None) to capture the attention weights instead."
            )
            raise ValueError(msg)
        return True
    if reason is not None or "engine" in options:
        return reason is None
    implementations = {
        getattr(m.config, "_attn_implementation", "sdpa") for m in _attention_modules(model)
    }
    if not implementations <= {"eager", "sdpa", None}:
        return True  # flash / flex kernels: capture cannot read them
    shape = _shape_of(inputs)
    if shape is None:
        return False
    device = next(model.parameters()).device
    from ._torch_path import choose_path  # the documented cost and memory estimate

    return choose_path(model, str(method), *shape, available_bytes(device), device_type=device.type)


# -- options ----------------------------------------------------------------------------------
@dataclass
class _Settings:
    """The checked options of one call."""

    method: str
    rows: tuple[int, ...]
    single_row: bool
    used_layers: int
    all_layers: bool
    residual: float
    fusion: HeadFusionSpec
    receptive_field: bool
    exclude: tuple[int, ...]
    mask: torch.Tensor | None
    engine: str
    rule: str = "gae"
    normalize: bool = False
    exclude_self: bool = False

    @property
    def gradients(self) -> bool:
        """Whether the method weighs the attention by its gradients (GAE's rows)."""
        return method_spec(self.method).gradients


def _check_options(
    method: str,
    options: Mapping[str, Any],
    rows: object,
    *,
    batch: int,
    n: int,
    n_layers: int,
    n_heads: int,
    device: torch.device,
    dtype: torch.dtype,
) -> _Settings:
    gradients = method_spec(method).gradients
    allowed = _GRADIENT_OPTIONS if gradients else _ROLLOUT_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        msg = (
            f"explain(method={method!r}, blockwise=True) takes the options "
            f"{', '.join(sorted(allowed))}; got {', '.join(unknown)}. Pruning "
            "(threshold, top_k, discard) and heads='each' or callables need the materialised "
            "weights: pass blockwise=False for them."
        )
        raise ValueError(msg)
    if rows is None:
        msg = (
            "explain(..., blockwise=True) computes selected rows: pass `rows` (an int or a "
            "sequence of output positions, e.g. rows=-1 for the last token); rows=None (every "
            "row, an n x n map) is what blockwise avoids, use blockwise=False for it."
        )
        raise ValueError(msg)
    selected = check_rows(rows, n)
    used, all_layers = check_layers(options.get("layers", "last"), n_layers)
    residual = check_residual(options.get("residual", 0.5))
    check_validate(options.get("validate", True))
    heads = options.get("heads", "mean")
    if gradients and "heads" in options:
        msg = "`heads` is not an option of gradient_rollout (GAE averages the heads)."
        raise ValueError(msg)
    each = isinstance(heads, str) and heads == "each"
    if each or (callable(heads) and not hasattr(heads, "shape")):
        msg = (
            f"explain(..., blockwise=True) fuses heads row by row: `heads` must be 'mean', "
            f"'max', 'min' or per-head weights of shape ({n_heads},) or ({n_layers}, "
            f"{n_heads}); got {heads!r}. Pass blockwise=False for heads='each' or a callable."
        )
        raise ValueError(msg)
    layout = AttentionLayout((batch,), n_layers, n_heads, n)
    fusion = check_head_fusion(heads, layout, xp_torch, dtype=dtype, device=device)
    mask = options.get("mask", _UNSET)
    checked_mask: torch.Tensor | None = None
    if mask is not _UNSET and mask is not None:
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
            msg = f"`mask` must be a bool tensor of shape ({batch}, {n}); got {mask!r}."
            raise TypeError(msg)
        if tuple(mask.shape) != (batch, n):
            msg = f"`mask` must have shape ({batch}, {n}); got {tuple(mask.shape)}."
            raise ValueError(msg)
        checked_mask = mask.to(device)
    engine = options.get("engine", "sdpa" if device.type == "cuda" else "matmul")
    if engine not in ("matmul", "sdpa"):
        msg = (
            "`engine` must be 'matmul' (blocks of softmax(q Kᵀ) weighted by the rows) or "
            f"'sdpa' (the dV of a fused attention backward); got {engine!r}."
        )
        raise ValueError(msg)
    if engine == "sdpa" and (gradients or fusion.kind not in ("mean", "weights")):
        engine = "matmul"  # max, min and GAE's clamp are not linear in the weights
    settings = _Settings(
        method=method,
        rows=selected.positions(n),
        single_row=selected.single,
        used_layers=used,
        all_layers=all_layers,
        residual=residual,
        fusion=fusion,
        receptive_field=check_receptive_field(options.get("receptive_field", False)),
        exclude=check_exclude(options.get("exclude"), n),
        mask=checked_mask,
        engine=engine,
    )
    if gradients:
        rule = options.get("rule", "gae")
        if rule not in ("gae", "weighted"):
            msg = (
                f"`rule` must be 'gae' (Chefer et al.'s additive recurrence) or 'weighted' "
                f"(gradient-weighted attention rollout); got {rule!r}."
            )
            raise ValueError(msg)
        settings.rule = rule
        flags = {
            "normalize_result": renamed_keyword(
                "normalize",
                "normalize_result",
                options.get("normalize", MISSING),
                options.get("normalize_result", False),
                default=False,
            ),
            "exclude_self": options.get("exclude_self", False),
        }
        for name, value in flags.items():
            if not isinstance(value, bool):
                msg = f"`{name}` must be True or False; got {value!r}."
                raise TypeError(msg)
        settings.normalize = flags["normalize_result"]
        settings.exclude_self = flags["exclude_self"]
    return settings


class _Unset:
    pass


_UNSET: Any = _Unset()


# -- recording --------------------------------------------------------------------------------
@dataclass
class _Layer:
    """What one attention layer needs to recompute its queries, keys and values."""

    module: Any
    """The attention module (an ``nn.Module``; typed Any for its model-specific attributes)."""
    index: int
    window: int | None
    hidden: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


@dataclass
class _Recorder:
    layers: list[_Layer]
    padding: torch.Tensor | None = None

    def install(self, hooks: Hooks, model: nn.Module, upto: int) -> None:
        hooks.before(model, self._on_model_call, with_kwargs=True)
        for layer in self.layers[:upto]:
            hooks.before(layer.module, self._entering(layer), with_kwargs=True)

    def _on_model_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        from ._torch_capture import _padding_mask

        self.padding = _padding_mask(module, args, kwargs)

    def _entering(self, layer: _Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            if not isinstance(hidden, torch.Tensor) or embeddings is None:
                msg = (
                    f"{type(module).__name__} (layer {layer.index}) was called without "
                    "hidden_states and position_embeddings, which the blockwise path reads; "
                    "pass blockwise=False."
                )
                raise ValueError(msg)
            layer.hidden = hidden.detach()
            layer.cos, layer.sin = (e.detach() for e in embeddings)

        return hook


def _call_kwargs(model: nn.Module, inputs: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments to add to the model call: only those its forward accepts."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    given = inputs if isinstance(inputs, Mapping) else {}
    return {k: v for k, v in extra.items() if k in parameters and k not in given}


def _run(model: nn.Module, inputs: Any, extra: dict[str, Any]) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs, **extra)
    if isinstance(inputs, Mapping):
        return model(**inputs, **extra)
    return model(*inputs, **extra)


# -- one layer's queries, keys, values ---------------------------------------------------------
def _projections(
    layer: _Layer, length: int, dtype: torch.dtype, *, values: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return post-RoPE ``q (B, H, m, hd)`` (scaled), ``k (B, KV, m, hd)``, ``v``: `length` tokens."""
    module, hidden = layer.module, layer.hidden
    assert hidden is not None
    assert layer.cos is not None
    assert layer.sin is not None
    head_dim = int(module.head_dim)
    batch = hidden.shape[0]
    h = hidden[:, :length]
    q = module.q_proj(h).view(batch, length, -1, head_dim).transpose(1, 2)
    k = module.k_proj(h).view(batch, length, -1, head_dim).transpose(1, 2)
    rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
    q, k = rotary(q, k, layer.cos[:, :length], layer.sin[:, :length])
    q = q.to(dtype) * float(module.scaling)
    v = None
    if values:
        v = module.v_proj(h).view(batch, length, -1, head_dim).transpose(1, 2).to(dtype)
    return q, k.to(dtype), v


def _allowed(
    start: int, stop: int, first_key: int, valid: torch.Tensor, window: int | None
) -> torch.Tensor:
    """``(B, 1, b, kk)``: query ``start..stop-1`` may attend key ``first_key..stop-1``.

    Causal, real keys, the sliding window; a padded query row may attend every key (its
    probabilities are finite and its row weight is zero).
    """
    device = valid.device
    queries = torch.arange(start, stop, device=device)[:, None]
    keys = torch.arange(first_key, stop, device=device)[None, :]
    allowed = keys <= queries
    if window is not None:
        allowed = allowed & (keys > queries - window)
    allowed = allowed[None] & valid[:, None, first_key:stop]
    allowed = allowed | ~valid[:, start:stop, None]
    return allowed[:, None]


def _block_rows(batch: int, heads: int, keys: int) -> int:
    return max(16, BLOCK_BYTES // max(1, 4 * batch * heads * keys))


def _exponentials(
    q: torch.Tensor,
    k: torch.Tensor,
    start: int,
    stop: int,
    first_key: int,
    valid: torch.Tensor,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``exp(s - max s)`` ``(B, H, b, kk)`` of queries ``start..stop-1`` and its row sums.

    The softmax weights are the first divided by the second (``(B, H, b)``); callers fold
    the division into their row weights where they can. Grouped-query aware: each key-value
    head's keys meet its group of query heads in one matmul.
    """
    batch, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    b = stop - start
    grouped = q[:, :, start:stop].reshape(batch, kv_heads, group * b, head_dim)
    scores = torch.matmul(grouped, k[:, :, first_key:stop].transpose(-1, -2))
    scores = scores.view(batch, heads, b, stop - first_key)
    if window is None and bool(valid[:, :stop].all()):
        # Every earlier key is allowed: only the diagonal square needs the causal mask.
        diagonal = scores[..., start - first_key :]
        diagonal.masked_fill_(~_allowed(start, stop, start, valid, None), -math.inf)
    else:
        scores.masked_fill_(~_allowed(start, stop, first_key, valid, window), -math.inf)
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    return scores, scores.sum(dim=-1)


def _first_key(start: int, window: int | None) -> int:
    return 0 if window is None else max(0, start - window + 1)


def _renormalise(
    fused: torch.Tensor, start: int, first_key: int, valid: torch.Tensor
) -> torch.Tensor:
    """Rows of a fused block ``(B, b, kk)`` divided by their sums; an empty real row becomes self."""
    sums = fused.sum(dim=-1, keepdim=True)
    fused = fused / torch.where(sums > 0, sums, torch.ones_like(sums))
    b, kk = fused.shape[-2:]
    empty = (sums[..., 0] == 0) & valid[:, start : start + b]
    if bool(empty.any()):
        eye = torch.zeros(b, kk, dtype=torch.bool, device=fused.device)
        rows = torch.arange(b, device=fused.device)
        eye[rows, rows + start - first_key] = True
        fused = torch.where(empty[..., None] & eye, torch.ones_like(fused), fused)
    return fused


def _fuse(
    probabilities: torch.Tensor,
    fusion: HeadFusionSpec,
    layer: int,
    start: int,
    first_key: int,
    valid: torch.Tensor,
) -> torch.Tensor:
    """Fuse the heads of a block ``(B, H, b, kk)`` into ``(B, b, kk)`` as attnflow.fuse_heads does."""
    if fusion.kind == "mean":
        return probabilities.mean(dim=1)
    if fusion.kind == "weights":
        weights = _head_weights(fusion, layer, probabilities.dtype)
        return torch.einsum("bhik,h->bik", probabilities, weights)
    fused = probabilities.amax(dim=1) if fusion.kind == "max" else probabilities.amin(dim=1)
    return _renormalise(fused, start, first_key, valid)


def _head_weights(fusion: HeadFusionSpec, layer: int, dtype: torch.dtype) -> torch.Tensor:
    weights: torch.Tensor | None = fusion.weights
    assert weights is not None
    if weights.ndim == 2:
        weights = weights[layer]
    weights = weights.to(dtype)
    return weights / weights.sum()


# -- one step of the chains --------------------------------------------------------------------
def _weighted_column_sums(
    layer: _Layer,
    chains: torch.Tensor,
    valid: torch.Tensor,
    settings: _Settings,
    grad_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``chains (B, C, n) @ F_l`` with ``F_l`` the layer's fused rows, block by block."""
    batch = chains.shape[0]
    dtype = chains.dtype
    support = chains.abs().sum(dim=(0, 1)).nonzero()
    result = torch.zeros_like(chains)
    if support.numel() == 0:
        return result
    length = int(support.max()) + 1  # rows beyond the last nonzero weight do not matter
    gradient = grad_out is not None
    q, k, v = _projections(layer, length, dtype, values=gradient)
    heads = q.shape[1]
    if settings.engine == "sdpa":
        return _sdpa_column_sums(layer, q, k, chains, valid, settings, length)
    rows_per_block = _block_rows(batch, heads, length)
    dO = None
    if grad_out is not None:
        dO = grad_out[:, :length].reshape(batch, length, heads, -1).transpose(1, 2).to(dtype)
    linear = settings.fusion.kind in ("mean", "weights")
    if settings.gradients:
        linear = settings.rule == "gae"
    head_weights = (
        _head_weights(settings.fusion, layer.index, dtype)
        if settings.fusion.kind == "weights" and not settings.gradients
        else torch.full((heads,), 1.0 / heads, dtype=dtype, device=chains.device)
    )
    for start in range(0, length, rows_per_block):
        stop = min(start + rows_per_block, length)
        weights = chains[:, :, start:stop]
        if not bool(weights.any()):
            continue
        first = _first_key(start, layer.window)
        e, sums = _exponentials(q, k, start, stop, first, valid, layer.window)
        if dO is not None and v is not None:
            e = _gradient_times(e, dO, v, start, stop, first)  # (∇A ⊙ exp)^+: sums > 0
        if linear:
            # Σ_h w_h Σ_i r_i e[h, i] / sums[h, i]: the softmax division folded into the
            # row weights, one (C x H b) @ (H b x kk) product.
            scale = head_weights[None, :, None] / sums  # (B, H, b)
            row_weights = weights[:, :, None, :] * scale[:, None]  # (B, C, H, b)
            columns = torch.bmm(
                row_weights.reshape(batch, -1, heads * (stop - start)),
                e.view(batch, heads * (stop - start), stop - first),
            )
        else:
            p = e.div_(sums[..., None])
            if dO is not None:  # rule="weighted": the GAE mean, rows renormalised
                fused = _renormalise(p.mean(dim=1), start, first, valid)
            else:
                fused = _fuse(p, settings.fusion, layer.index, start, first, valid)
            columns = torch.bmm(weights, fused)
        del e
        result[:, :, first:stop] += columns
    return result


def _gradient_times(
    e: torch.Tensor, dO: torch.Tensor, v: torch.Tensor, start: int, stop: int, first: int
) -> torch.Tensor:
    """Return ``(∇A ⊙ e)^+`` of a block, ``∇A = dO Vᵀ`` (one key-value head per group)."""
    batch, heads, b, kk = e.shape
    kv_heads, head_dim = v.shape[1], v.shape[-1]
    grouped = dO[:, :, start:stop].reshape(batch, kv_heads, (heads // kv_heads) * b, head_dim)
    grad = torch.matmul(grouped, v[:, :, first:stop].transpose(-1, -2)).view(batch, heads, b, kk)
    return grad.mul_(e).clamp_(min=0)


def _sdpa_column_sums(
    layer: _Layer,
    q: torch.Tensor,
    k: torch.Tensor,
    chains: torch.Tensor,
    valid: torch.Tensor,
    settings: _Settings,
    length: int,
) -> torch.Tensor:
    """Compute the same weighted column sums as the ``dV`` of SDPA's backward, ``dO = Rᵀ``.

    ``out = A V'`` for a dummy ``V'`` (``(B, H, kk, c)``, ``c`` >= the chains, at least 8)
    has ``dV' = Aᵀ dO``; with ``dO[h, i, c] = w_h r_c[i]`` the sum of ``dV'`` over the heads
    is ``Σ_h w_h r_cᵀ A_h``. The keys are repeated over each query group, ``(B, H, kk, hd)``
    (O(n) memory): the memory-efficient CUDA kernel, the one that takes float32 and a mask,
    has no grouped-query mode, and SDPA would otherwise fall back to its math kernel, which
    materialises the weights.
    """
    batch, chains_count = chains.shape[:2]
    heads, head_dim = q.shape[1], q.shape[-1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)  # head h reads key-value head h // G
    width = max(8, -(-chains_count // 8) * 8)
    if q.device.type == "cuda" and chains_count <= head_dim:
        width = head_dim  # flash kernels want equal head dims
    if settings.fusion.kind == "mean":
        head_weights = torch.full((heads,), 1.0 / heads, dtype=q.dtype, device=q.device)
    else:
        head_weights = _head_weights(settings.fusion, layer.index, q.dtype)
    result = torch.zeros_like(chains)
    unpadded = bool(valid[:, :length].all()) and layer.window is None
    rows_per_block = (
        length if (unpadded and q.device.type == "cuda") else _block_rows(batch, heads, length)
    )
    for start in range(0, length, rows_per_block):
        stop = min(start + rows_per_block, length)
        weights = chains[:, :, start:stop]  # (B, C, b)
        if not bool(weights.any()):
            continue
        first = _first_key(start, layer.window)
        dummy = torch.zeros(
            batch,
            heads,
            stop - first,
            width,
            dtype=q.dtype,
            device=q.device,
            requires_grad=True,
        )
        grad_out = torch.zeros(batch, heads, stop - start, width, dtype=q.dtype, device=q.device)
        grad_out[..., :chains_count] = (
            weights.transpose(1, 2)[:, None] * head_weights[None, :, None, None]
        )
        with torch.enable_grad():
            if start == 0 and first == 0 and unpadded:
                out = F.scaled_dot_product_attention(
                    q[:, :, start:stop],
                    k[:, :, :stop],
                    dummy,
                    is_causal=True,
                    scale=1.0,
                )
            else:
                mask = _allowed(start, stop, first, valid, layer.window)
                out = F.scaled_dot_product_attention(
                    q[:, :, start:stop],
                    k[:, :, first:stop],
                    dummy,
                    attn_mask=mask,
                    scale=1.0,
                )
            (grad_dummy,) = torch.autograd.grad(out, dummy, grad_outputs=grad_out)
        columns = grad_dummy.sum(dim=1)[..., :chains_count]  # (B, kk, C)
        result[:, :, first:stop] += columns.transpose(1, 2)
    return result


def _uniform_column_sums(chains: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``chains @ U`` for uniform causal attention over real keys, in O(n) per chain.

    ``U[i, j] = [j <= i] m_i m_j / c_i`` with ``c_i`` the real tokens up to ``i``, so
    ``(rᵀU)[j] = m_j Σ_{i >= j} r_i m_i / c_i``: a reverse cumulative sum.
    """
    real = valid.to(chains.dtype)[:, None, :]
    counts = torch.cumsum(real, dim=-1)
    share = torch.where(counts > 0, chains * real / torch.clamp(counts, min=1), 0.0)
    tail = torch.flip(torch.cumsum(torch.flip(share, dims=(-1,)), dim=-1), dims=(-1,))
    return tail * real


def _step(product: torch.Tensor, chains: torch.Tensor, settings: _Settings) -> torch.Tensor:
    """Mix a step's column sums with the identity: rollout's α, GAE's ``I +``."""
    if settings.gradients and settings.rule == "gae":
        return chains + product
    alpha = settings.residual
    return product if alpha == 0.0 else (1.0 - alpha) * product + alpha * chains


# -- the chains, top-down ----------------------------------------------------------------------
@dataclass
class _Chains:
    """Row chains of every reported layer, walked top-down; the baseline alongside."""

    settings: _Settings
    valid: torch.Tensor
    n: int
    dtype: torch.dtype
    chains: torch.Tensor | None = None
    uniform: torch.Tensor | None = None
    done: list[torch.Tensor] = field(default_factory=list)

    def starts(self) -> torch.Tensor:
        """Return unit rows of the explained positions, zero on padded ones: ``(B, r, n)``."""
        batch = self.valid.shape[0]
        units = torch.zeros(
            batch, len(self.settings.rows), self.n, dtype=self.dtype, device=self.valid.device
        )
        for c, row in enumerate(self.settings.rows):
            units[:, c, row] = self.valid[:, row].to(self.dtype)
        return units

    def enter(self, layer: int) -> None:
        """Start the chains of `layer` where it is reported (every layer with "all")."""
        top = self.settings.used_layers - 1
        if layer == top or (self.settings.all_layers and layer < top):
            units = self.starts()
            self.chains = units if self.chains is None else torch.cat([units, self.chains], 1)
            if self.settings.receptive_field:
                self.uniform = (
                    units if self.uniform is None else torch.cat([units.clone(), self.uniform], 1)
                )

    def advance(self, layer: _Layer, grad_out: torch.Tensor | None = None) -> None:
        assert self.chains is not None
        product = _weighted_column_sums(layer, self.chains, self.valid, self.settings, grad_out)
        self.chains = _step(product, self.chains, self.settings)
        if self.uniform is not None:
            uniform = _uniform_column_sums(self.uniform, self.valid)
            self.uniform = _step(uniform, self.uniform, self.settings)

    def result(self) -> torch.Tensor:
        """``(B, [L,] r, n)`` (``(B, [L,] n)`` for one row), the method's normalisations applied."""
        assert self.chains is not None
        settings = self.settings
        r = len(settings.rows)
        batch = self.chains.shape[0]

        def shaped(chains: torch.Tensor) -> torch.Tensor:
            if settings.all_layers:
                chains = chains.reshape(batch, settings.used_layers, r, self.n)
            return chains[..., 0, :] if settings.single_row else chains

        result = shaped(self.chains)
        if settings.gradients and settings.exclude_self:
            own = torch.zeros(r, self.n, dtype=torch.bool, device=result.device)
            own[torch.arange(r), torch.tensor(settings.rows)] = True
            own = own[0] if settings.single_row else own
            result = torch.where(own, torch.zeros_like(result), result)
        if settings.receptive_field or settings.exclude:
            baseline = None if self.uniform is None else shaped(self.uniform)
            return normalize_attribution(  # type: ignore[no-any-return]
                result, baseline=baseline, exclude=settings.exclude, xp=xp_torch
            )
        if settings.gradients and settings.normalize:
            sums = result.sum(dim=-1, keepdim=True)
            result = result / torch.where(sums > 0, sums, torch.ones_like(sums))
        return result


# -- the entry point ---------------------------------------------------------------------------
def explain_rows(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    method: str,
    rows: int | Sequence[int] | None,
    target: int | Sequence[int] | torch.Tensor | None = None,
    target_score: TargetScore = "logit",
    **options: Any,
) -> torch.Tensor:
    r"""Rollout or GAE rows of a causal LM from its queries and keys, blockwise.

    The private engine of ``explain(..., blockwise=True)``; see the module docstring for
    the formulas. Equal to the materialised path (capture, then :func:`attnflow.rollout`
    or :func:`attnflow.gradient_rollout`) up to rounding. For ``"gradient_rollout"`` each
    explained row ``i`` gets its own backward pass, of ``logits[b, i, target_b]`` summed
    over the batch (`target`: None for the argmax at that row, an int for every sample, or
    one vocabulary id per sample), or of its log-probability
    (``target_score="log_probability"``: ``log_softmax(logits[b, i])[target_b]``).

    Options are those of the method, with three differences: the padding is the model's
    own (its call's ``attention_mask``), and a `mask` given in the options is combined with
    it (None: the model's padding alone); `validate` is accepted and has nothing to check
    (the weights are softmax rows by construction); and ``engine`` chooses ``"matmul"``
    (blocks of ``softmax(q Kᵀ)``) or ``"sdpa"`` (the ``dV`` of SDPA's backward; linear head
    fusions of rollout only, the default on CUDA; equal to the materialised path to 6e-15 in
    float64 on an H200).

    Examples
    --------
    >>> import torch, transformers
    >>> from attnflow.adapters.torch import explain
    >>> config = transformers.LlamaConfig(
    ...     vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> ids = torch.randint(50, (1, 12))
    >>> row = explain(model, {"input_ids": ids}, rows=-1, blockwise=True)
    >>> row.shape
    torch.Size([1, 12])
    >>> torch.allclose(row, explain(model, {"input_ids": ids}, rows=-1, blockwise=False))
    True
    """
    reason = unsupported_reason(model, method)
    if reason is not None:
        msg = f"explain(..., blockwise=True) cannot run here: {reason}."
        raise ValueError(msg)
    check_target_score(target_score, method)
    if not method_spec(method).gradients:
        check_no_target(method, target)
    else:
        from ._torch_gradients import _describe_target

        check_target_type(target, _describe_target)
    shape = _shape_of(inputs)
    if shape is None:
        msg = (
            "explain(..., blockwise=True) needs the token ids (batch, n) in `inputs`: a "
            "mapping with `input_ids` (a tokenizer's output), a tensor, or a sequence whose "
            f"first item is the ids; got {type(inputs).__name__}."
        )
        raise TypeError(msg)
    batch, n = shape
    if isinstance(inputs, Mapping) and inputs.get("past_key_values") is not None:
        msg = (
            "explain(..., blockwise=True) explains one whole sequence: `inputs` must not "
            "carry past_key_values (the cached prefix's hidden states are not seen); pass "
            "the full token ids instead."
        )
        raise ValueError(msg)
    modules: list[Any] = _attention_modules(model)
    parameter = next(model.parameters())
    device = parameter.device
    dtype = torch.float64 if parameter.dtype == torch.float64 else torch.float32
    heads = int(modules[0].config.num_attention_heads)
    settings = _check_options(
        method,
        options,
        rows,
        batch=batch,
        n=n,
        n_layers=len(modules),
        n_heads=heads,
        device=device,
        dtype=dtype,
    )
    _check_memory(modules, settings, batch, n, device, parameter.element_size())
    layers = [_Layer(m, i, _window(m)) for i, m in enumerate(modules)]
    recorder = _Recorder(layers)
    if not settings.gradients:
        return _rollout_rows(model, inputs, recorder, settings, n, dtype)
    return _gae_rows(model, inputs, recorder, settings, n, dtype, target, target_score)


def _check_memory(
    modules: list[Any],
    settings: _Settings,
    batch: int,
    n: int,
    device: torch.device,
    itemsize: int,
) -> None:
    """Refuse, before any work, a context whose recorded states cannot fit.

    The attention inputs of the used layers, one layer's queries, keys and values, and
    about three blocks of scores (the block, its mask, a temporary).
    """
    hidden = int(modules[0].q_proj.in_features)
    heads = int(modules[0].config.num_attention_heads)
    states = settings.used_layers * batch * n * hidden * itemsize
    rows = min(n, _block_rows(batch, heads, n))
    block = 4 * batch * heads * rows * n
    projections = 4 * batch * n * heads * int(modules[0].head_dim) * 3
    needed = states + 3 * block + projections
    available = available_bytes(device)
    if needed > available:
        msg = (
            f"explain(..., blockwise=True) on {batch} x {n} tokens keeps the attention inputs "
            f"of {settings.used_layers} layers ({_mib(states)}) plus blocks of scores, about "
            f"{_mib(needed)} in all, but {_mib(available)} are available on {device}. "
            "Shorten the context, explain a lower layer (layers=int) or free memory."
        )
        raise MemoryError(msg)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.2f} MiB"


def _valid(
    recorder: _Recorder, settings: _Settings, batch: int, n: int, device: torch.device
) -> torch.Tensor:
    valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    if recorder.padding is not None:
        valid = valid & recorder.padding.to(device).bool()
    if settings.mask is not None:
        valid = valid & settings.mask
    return valid


def _rollout_rows(
    model: nn.Module,
    inputs: Any,
    recorder: _Recorder,
    settings: _Settings,
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    extra = _call_kwargs(model, inputs, {"use_cache": False, "logits_to_keep": 1})
    with Hooks() as hooks, torch.no_grad():
        recorder.install(hooks, model, settings.used_layers)
        _run(model, inputs, extra)
    layers = recorder.layers[: settings.used_layers]
    device = next(model.parameters()).device
    batch = _shape_of(inputs)[0]  # type: ignore[index]
    chains = _Chains(settings, _valid(recorder, settings, batch, n, device), n, dtype)
    with torch.no_grad():
        for layer in reversed(layers):
            chains.enter(layer.index)
            chains.advance(layer)
            layer.hidden = layer.cos = layer.sin = None  # free as we go
        return chains.result()


def _gae_rows(
    model: nn.Module,
    inputs: Any,
    recorder: _Recorder,
    settings: _Settings,
    n: int,
    dtype: torch.dtype,
    target: Any,
    target_score: TargetScore = "logit",
) -> torch.Tensor:
    from ._torch_gradients import _refuse_inference_mode, _target_score

    _refuse_inference_mode('explain(method="gradient_rollout", blockwise=True)')
    device = next(model.parameters()).device
    keep = torch.tensor(settings.rows, device=device)
    extra = _call_kwargs(model, inputs, {"use_cache": False, "logits_to_keep": keep})
    kept = "logits_to_keep" in extra
    outputs: dict[int, torch.Tensor] = {}  # layer -> the o_proj input of this call

    def on_o_proj(layer: _Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:  # noqa: ARG001
            outputs[layer.index] = args[0]

        return hook

    layers = recorder.layers[: settings.used_layers]
    batch = _shape_of(inputs)[0]  # type: ignore[index]
    results = []
    with Hooks() as checkpoints, Hooks() as recording:
        recorder.install(recording, model, settings.used_layers)
        for layer in layers:
            recording.before(layer.module.o_proj, on_o_proj(layer))
        _checkpoint_blocks(checkpoints, model, [layer.module for layer in recorder.layers])
        with torch.enable_grad():
            output = _run(model, inputs, extra)
            # Recomputing checkpointed blocks in the backward pass must not record again.
            recording.remove()
            logits = output if isinstance(output, torch.Tensor) else output.logits
            if not all(outputs[l.index].requires_grad for l in layers):
                msg = (
                    "The attention outputs are not on the autograd graph, so no gradient can "
                    'reach them: explain(method="gradient_rollout", blockwise=True) needs '
                    "parameters that require grad; unfreeze the model "
                    "(model.requires_grad_(True)) for the call."
                )
                raise RuntimeError(msg)
            valid = _valid(recorder, settings, batch, n, device)
            for c, row in enumerate(settings.rows):
                row_logits = logits[:, c] if kept else logits[:, row]
                score = _target_score(row_logits, target, target_score)
                one = _Settings(
                    **{
                        **settings.__dict__,
                        "rows": (row,),
                        "single_row": False,
                        "receptive_field": False,
                        "exclude": (),
                        "exclude_self": False,
                        "normalize": False,
                    }
                )
                chains = _Chains(one, valid, n, dtype)
                with Hooks() as gradients:
                    for layer in reversed(layers):

                        def on_grad(
                            grad: torch.Tensor, layer: _Layer = layer, chains: _Chains = chains
                        ) -> None:
                            with torch.no_grad():
                                chains.enter(layer.index)
                                chains.advance(layer, grad.detach())

                        gradients.on_gradient(outputs[layer.index], on_grad)
                    # Only the lowest layer's gradient is returned; the hooks see every
                    # layer's as the backward pass reaches it, top-down, and drop it.
                    torch.autograd.grad(
                        score,
                        [outputs[layers[0].index]],
                        retain_graph=c < len(settings.rows) - 1,
                        allow_unused=True,
                    )
                if chains.chains is None:  # the score reached no attention layer
                    chains.enter(settings.used_layers - 1)
                results.append(chains.chains)
    return _assemble(results, settings, valid, n, dtype)


def _checkpoint_blocks(hooks: Hooks, model: nn.Module, attention: list[nn.Module]) -> None:
    """Checkpoint each block that holds one of the `attention` modules, through `hooks`.

    GAE needs only the gradient at each attention output, not the parameters': the
    backward pass then keeps each block's input instead of all its activations and
    recomputes one block at a time (``torch.utils.checkpoint``, non-reentrant, so the
    hooks on the first forward's tensors still fire). At 4,096 tokens on SmolLM2 that is
    about 0.3 GB of block inputs instead of several GB of activations.
    """
    wanted = {id(module) for module in attention}
    blocks: dict[int, nn.Module] = {}
    for site in attention_sites(model):
        if site.block is not None and id(site.attention) in wanted:
            blocks.setdefault(id(site.block), site.block)
    for block in blocks.values():
        original = block.forward

        def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(
                _original, *args, use_reentrant=False, **kwargs
            )

        hooks.patch(block, "forward", forward)


def _assemble(
    per_row: list[torch.Tensor | None],
    settings: _Settings,
    valid: torch.Tensor,
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Put the chains of each row (``(B, L_reported, n)``, newest layer first) together."""
    batch = valid.shape[0]
    reported = settings.used_layers if settings.all_layers else 1
    stacked = torch.stack([c for c in per_row if c is not None], dim=2)  # (B, reported, r, n)
    chains = _Chains(settings, valid, n, dtype)
    chains.chains = stacked.reshape(batch, reported * len(settings.rows), n)
    if settings.receptive_field:
        baseline = _Chains(settings, valid, n, dtype)
        for layer in range(settings.used_layers - 1, -1, -1):
            baseline.enter(layer)
            assert baseline.chains is not None
            uniform = _uniform_column_sums(baseline.chains, valid)
            baseline.chains = _step(uniform, baseline.chains, settings)
        chains.uniform = baseline.chains
    return chains.result()
