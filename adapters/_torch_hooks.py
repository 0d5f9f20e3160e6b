"""The torch adapter's one way of finding the attention and its one hook layer.

Every part of the adapter that watches a model run goes through this module: weights
capture and gradient capture (:mod:`._torch_capture`), value-aware recording
(:mod:`._torch_contributions`), the blockwise rows' query and key recording
(:mod:`._torch_blockwise`), the target-conditioned methods' gathering of attention
pieces (:mod:`._torch_logit`), the generation step follower
(:mod:`._torch_generation`), the input gradients' embedding hook
(:mod:`._torch_gradients`) and the diagnosis (:mod:`._torch_diagnose`). No other
module registers a hook or patches a function or a ``forward``: a test reads the
adapter's sources and fails if one does.

Finding the attention
---------------------
:func:`attention_sites` finds the attention of a model once, by one rule: an attention
module is an ``nn.MultiheadAttention`` or a module whose class name contains
``"Attention"`` (:func:`is_attention`), and a *site* is an attention module that no other
attention module holds (Hugging Face's ``BertAttention`` holding ``BertSelfAttention``
is one site). The module holding a site is its *block* (the decoder layer, the encoder
layer); the norms and projections each consumer needs are read from the site's block
and attention module: value-aware capture recognises each block's structure
(:func:`._torch_contributions.find_blocks`), the blockwise rows keep the sites of the
attention classes they recompute, the logit gatherer the sites of its layer families.

The hook layer
--------------
:class:`Hooks` installs forward pre-hooks (:meth:`Hooks.before`), forward hooks
(:meth:`Hooks.after`), tensor gradient hooks (:meth:`Hooks.on_gradient`) and patches of
attributes, module functions and ``forward`` methods alike (:meth:`Hooks.patch`), and
takes each one off again in :meth:`Hooks.remove`, last installed first, also when the
model raised mid-forward: use it as a context manager, or call :meth:`Hooks.remove` in a
``finally``. A removal that fails does not stop the others; the first failure is raised
after all were tried.

The attention weights of a forward reach their consumers through one tap,
:meth:`Hooks.on_weights`: ``torch.nn.functional.scaled_dot_product_attention`` (and the
copies the model's modules imported) is replaced by one function computing the weights
explicitly (:func:`sdpa_with_weights`, re-exported by
:mod:`attnflow.adapters.torch`), and Hugging Face's
``eager_attention_forward`` by a wrapper reading the weights it returns; every
subscribed listener receives each call's weights, in subscription order. The tap is
installed by the first subscriber and stays while any subscriber is left (the last one
restores the originals), so the subscribers of nested ``with`` blocks share it rather
than stacking.

Several consumers, one forward
------------------------------
Because every consumer subscribes to the same tap and hooks, several of them can watch
one model call. Enter them in one ``with`` statement and call the model once inside::

    with capture(model, gradients=True) as weights, capture(
        model, contributions="alti"
    ) as mixing:
        output = model(**inputs)  # one (autograd) forward
    output.logits[0, -1, target].backward()
    weights.attentions, weights.gradients  # raw, rollout, flow, gradient rollout
    mixing.contributions  # the value-aware methods

Each capture reads every attention call of that forward (the tap hands the same weights
to both); a gradient capture needs autograd on, which the value-aware recording does not
mind (it detaches what it keeps). Consumers that are not captures subscribe to a
:class:`Hooks` of the same forward. The target-conditioned gatherer of a causal LM
(:class:`._torch_logit.TargetGatherer`, which checks its arguments when built) does::

    gatherer = TargetGatherer(model, inputs, method="direct_logit", rows=-1)
    with Hooks() as hooks, capture(model, gradients=True) as weights:
        gatherer.subscribe(hooks)
        output = model(**inputs)
    scores = gatherer.finish(output)  # the direct logit scores of that forward

(``method="alti_logit"`` also needs ``capture(model, contributions="alti")`` in the same
``with`` and its ``contributions`` passed to ``finish``.) Everything is removed when the
``with`` ends, in reverse order, also when the model raises.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Hooks",
    "Site",
    "attention_modules",
    "attention_sites",
    "is_attention",
    "sdpa_with_weights",
]

#: The function the tap replaces, as torch defines it.
ORIGINAL_SDPA: Callable[..., torch.Tensor] = F.scaled_dot_product_attention
#: Marks a function installed by the tap (so that a second subscriber finds it in place).
_TAP = "__attnflow_tap__"

Listener = Callable[[torch.Tensor], None]


# -- finding the attention ----------------------------------------------------------------------
def is_attention(module: nn.Module) -> bool:
    """Whether `module` is attention: ``nn.MultiheadAttention`` or a class named ``*Attention*``."""
    return isinstance(module, nn.MultiheadAttention) or "Attention" in type(module).__name__


@dataclass(frozen=True)
class Site:
    """One attention module of a model and the block that holds it."""

    name: str
    """The attention module's qualified name in the model (``""``: the model itself)."""
    attention: nn.Module
    """The attention module (the outermost one: no attention module holds it)."""
    block_name: str | None
    """The block's qualified name, or None when the attention is the model itself."""
    block: nn.Module | None
    """The module holding the attention (a decoder or encoder layer), or None."""


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return every attention module of `model` with its qualified name, nested ones included.

    The sites (:func:`attention_sites`) are the outermost of these.
    """
    return [(name, module) for name, module in model.named_modules() if is_attention(module)]


def attention_sites(model: nn.Module) -> list[Site]:
    """Return the attention sites of `model` in module order (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters._torch_hooks import attention_sites
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> [(site.name, site.block_name) for site in attention_sites(model)]
    [('layers.0.self_attn', 'layers.0'), ('layers.1.self_attn', 'layers.1')]
    """
    modules = dict(model.named_modules())
    sites: list[Site] = []
    inside: set[int] = set()
    for name, module in modules.items():
        if id(module) in inside or not is_attention(module):
            continue
        inside.update(id(m) for m in module.modules())
        if module is model:
            sites.append(Site(name, module, None, None))
            continue
        block_name = name.rpartition(".")[0]
        sites.append(Site(name, module, block_name, modules[block_name]))
    return sites


# -- the tap on attention weights ----------------------------------------------------------------
def sdpa_with_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention computed explicitly, returning the weights too.

    Same semantics as :func:`torch.nn.functional.scaled_dot_product_attention`: a boolean
    `attn_mask` keeps the positions that are True, a float one is added to the scores,
    `is_causal` keeps the lower triangle aligned top-left, `scale` defaults to
    ``1 / sqrt(E)``, `enable_gqa` repeats key and value heads, `dropout_p` drops
    attention weights. Masking uses ``torch.finfo(dtype).min`` rather than ``-inf``, and a
    query row whose keys are all masked (by a boolean mask, `is_causal` or ``-inf``) gets
    zero weights and a zero output, exactly as PyTorch's SDPA gives, never NaN.

    Parameters
    ----------
    query : Tensor, shape (..., heads, L, E)
        Queries.
    key : Tensor, shape (..., kv_heads, S, E)
        Keys.
    value : Tensor, shape (..., kv_heads, S, Ev)
        Values.
    attn_mask : Tensor, optional
        Boolean (True = attend) or additive float mask broadcastable to ``(..., L, S)``.
    dropout_p : float, default 0.0
        Dropout probability on the weights (SDPA applies it whenever it is positive).
    is_causal : bool, default False
        Causal (lower-triangular, top-left aligned) masking.
    scale : float, optional
        Scale of the scores; ``1 / sqrt(E)`` by default.
    enable_gqa : bool, default False
        Grouped-query attention: ``heads`` a multiple of ``kv_heads``.

    Returns
    -------
    output : Tensor, shape (..., heads, L, Ev)
        The attention output.
    weights : Tensor, shape (..., heads, L, S)
        The attention probabilities (before dropout), on the autograd path to `output`.

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import sdpa_with_weights
    >>> q, k, v = torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.eye(2, 4)[None, None]
    >>> out, w = sdpa_with_weights(q, k, v, is_causal=True)
    >>> w
    tensor([[[[1.0000, 0.0000],
              [0.5000, 0.5000]]]])
    """
    if enable_gqa and query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    lowest = torch.finfo(scores.dtype).min
    n_queries, n_keys = scores.shape[-2], scores.shape[-1]
    keep: torch.Tensor | None = None
    if is_causal:
        keep = torch.ones(n_queries, n_keys, dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            scores = scores + attn_mask
            finite = scores != -math.inf
            if not bool(finite.all()):
                keep = finite if keep is None else keep & finite
    if keep is not None:
        scores = scores.masked_fill(~keep, lowest)
    weights = torch.softmax(scores, dim=-1)
    if keep is not None:
        dead = ~keep.any(dim=-1, keepdim=True)
        if bool(dead.any()):
            weights = weights.masked_fill(dead, 0.0)
    used = F.dropout(weights, p=dropout_p, training=True) if dropout_p > 0.0 else weights
    return torch.matmul(used, value), weights


_listeners: list[Listener] = []
#: What the tap holds in place (its replacements, the MHA fast-path flag):
#: ``key -> [restore, holders]``.
_held: dict[Hashable, list[Any]] = {}


def _tapped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    output, weights = sdpa_with_weights(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    _hand_over(weights)
    return output


setattr(_tapped_sdpa, _TAP, True)


def _hand_over(weights: torch.Tensor) -> None:
    for listener in _listeners:
        listener(weights)


def _wrap_eager(original: Callable[..., Any]) -> Callable[..., Any]:
    def eager_attention_forward(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if (
            isinstance(result, tuple)
            and len(result) >= 2
            and isinstance(result[1], torch.Tensor)
            and result[1].ndim >= 3
        ):
            _hand_over(result[1])
        return result

    eager_attention_forward.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(eager_attention_forward, _TAP, True)
    return eager_attention_forward


def _namespaces(model: nn.Module) -> list[ModuleType]:
    """List the Python modules defining the model's classes (attention functions live there)."""
    names: set[str] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            names.add(cls.__module__)
    names.add("transformers.integrations.sdpa_attention")
    namespaces = []
    for name in sorted(names):
        namespace = sys.modules.get(name)
        if isinstance(namespace, ModuleType):
            namespaces.append(namespace)
    return namespaces


# -- the hook layer ---------------------------------------------------------------------------
class Hooks:
    """Hooks and patches on one forward, each taken off again by :meth:`remove`.

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters._torch_hooks import Hooks
    >>> model = torch.nn.Linear(2, 2)
    >>> seen = []
    >>> with Hooks() as hooks:
    ...     hooks.after(model, lambda module, args, output: seen.append(output.shape))
    ...     _ = model(torch.ones(3, 2))
    >>> seen, len(model._forward_hooks)
    ([torch.Size([3, 2])], 0)
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()

    def undo(self, step: Callable[[], None]) -> None:
        """Run `step` on :meth:`remove` (in reverse order of installation)."""
        self._undo.append(step)

    def before(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
    ) -> None:
        """Register a forward pre-hook on `module` (``register_forward_pre_hook``)."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs, prepend=prepend)
        self._undo.append(handle.remove)

    def after(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> None:
        """Register a forward hook on `module` (``register_forward_hook``)."""
        handle = module.register_forward_hook(
            hook, with_kwargs=with_kwargs, always_call=always_call
        )
        self._undo.append(handle.remove)

    def on_gradient(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
        """Register a hook on the gradient of `tensor` (``Tensor.register_hook``)."""
        handle = tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        self._undo.append(handle.remove)

    def patch(self, owner: object, name: str, value: object) -> None:
        """Set ``owner.name = value``; :meth:`remove` restores it (or deletes it if it was not own).

        `owner` is a Python module (a function in it), an ``nn.Module`` (its ``forward``)
        or any object.
        """
        own = vars(owner)
        had = name in own
        original = own.get(name)
        setattr(owner, name, value)

        def restore() -> None:
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._undo.append(restore)

    def on_weights(self, model: nn.Module, listener: Listener) -> None:
        """Hand `listener` the attention weights of every attention call (see the module docstring).

        Holds the tap on ``F.scaled_dot_product_attention``, on the copies in the model's
        modules and on their ``eager_attention_forward``: installed by the first holder,
        restored when the last one lets go (in any order).
        """
        _listeners.append(listener)
        self._undo.append(lambda: _listeners.remove(listener))
        self._hold(F, "scaled_dot_product_attention", _tapped_sdpa)
        wrapped: dict[int, Callable[..., Any]] = {}
        for namespace in _namespaces(model):
            if namespace is F:
                continue
            for name, value in list(namespace.__dict__.items()):
                if value is ORIGINAL_SDPA or value is _tapped_sdpa:
                    self._hold(namespace, name, _tapped_sdpa)
                elif name == "eager_attention_forward" and callable(value):
                    wrapper = wrapped.get(id(value))
                    if wrapper is None:
                        tapped = getattr(value, _TAP, False)
                        wrapper = wrapped[id(value)] = value if tapped else _wrap_eager(value)
                    self._hold(namespace, name, wrapper)

    def mha_fastpath_off(self) -> None:
        """Turn ``torch.backends.mha``'s fast path off (it never materialises the weights).

        Held like the tap: the last holder to let go restores the flag as it found it.
        """

        def install() -> Callable[[], None]:
            previous = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            return lambda: torch.backends.mha.set_fastpath_enabled(previous)

        self._held_while(("torch.backends.mha", "fastpath"), install)

    def _hold(self, namespace: ModuleType, name: str, tap: object) -> None:
        """Put `tap` in place of ``namespace.name`` unless held already."""

        def install() -> Callable[[], None]:
            original = namespace.__dict__[name]
            setattr(namespace, name, tap)
            return lambda: setattr(namespace, name, original)

        self._held_while((id(namespace), name), install)

    def _held_while(self, key: Hashable, install: Callable[[], Callable[[], None]]) -> None:
        """Run `install` for the first holder of `key`; its restore after the last one."""
        held = _held.get(key)
        if held is None:
            held = _held[key] = [install(), 0]
        held[1] += 1

        def release() -> None:
            held[1] -= 1
            if held[1] == 0:
                del _held[key]
                held[0]()

        self._undo.append(release)

    def remove(
        self, failure: str = "attnflow could not restore the model after hooking it"
    ) -> None:
        """Take off every hook and patch, last first; raise the first failure after all.

        The failure is raised as a ``RuntimeError`` with the message `failure`.
        """
        errors: list[BaseException] = []
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except Exception as error:  # noqa: BLE001 - restore everything we can
                errors.append(error)
        if errors:
            raise RuntimeError(failure) from errors[0]
