r"""Target-conditioned attributions of Flax causal LMs (linen and NNX) in one forward pass.

``explain_linen`` / ``explain_nnx(..., method="direct_logit" | "alti_logit" | "ifr")``
(:mod:`attnflow.adapters.jax`) land here. The maths (readout, direct logit terms, IFR
proximities, ALTI-Logit's propagation, the sums over heads and layers) is the core's,
:mod:`attnflow._logit_attribution`; this module gathers its pieces from the model's own
calls, followed as :mod:`attnflow.adapters._jax_contributions` follows them.

**Blocks read.** A decoder layer is the module that calls a
``flax.linen.MultiHeadDotProductAttention`` / ``flax.nnx.MultiHeadAttention`` (default
attention function, self-attention, no KV cache, deterministic), and it must be
**pre-LN**, GPT-2 style: the attention reads the output of a ``LayerNorm`` or ``RMSNorm``
the block called on its input :math:`x`, and the block adds the attention's output to
:math:`x` (checked against what the block computed):
:math:`h = x + \mathrm{Attn}(\mathrm{Norm}(x))`, whatever comes after (the MLP). The
attention weights are the model's own, so its mask (causal, padding) is the one it uses.
From each block: its input :math:`x` at the explained rows, the attention rows of the
explained positions per head, the value vectors :math:`\mathrm{Norm}(x_j) W_V^h + b_V^h`
of every token and the output projection.

**The readout.** The model must return its logits ``(batch, n, vocabulary)`` (an array,
or ``.logits``) as the *very array* returned by its unembedding: a ``Dense``
(``nnx.Linear``) called on the output of a ``LayerNorm`` or ``RMSNorm`` (the final norm),
or ``Embed.attend`` on it (tied weights). Anything between (a scale, a soft-cap, a second
projection) breaks that identity and is refused. The final norm's input at the explained
rows gives the readout (:func:`attnflow._logit_attribution.readout`), and every call
checks that the norm and the unembedding, read back from their parameters, give the
model's own logits at the explained rows.

**Before the model runs.** The call is first traced abstractly (:func:`jax.eval_shape`:
no arithmetic), which finds the blocks and the head and gives the vocabulary size; the
`target`/`foil` ids and the `rows` are checked then. Rows on padding are refused when the
first attention call shows its mask, before any block has run. The methods read concrete
values (the checks, the default target): run them eagerly, not under :func:`jax.jit`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnflow._logit_attribution import (
    FinalNorm,
    alti_logit_terms,
    direct_logit_terms,
    ifr_terms,
    readout,
    rollouts_below,
    sum_terms,
)
from attnflow._methods import MethodSpec

from ._common import Contributions, check_explained_rows, check_target_options
from ._jax_contributions import BlockTracker, StructureError, _Call, _Frame, _last_axis, _verified

__all__ = ["METHODS", "SUPPORTED_MODELS", "Model", "explain_target_conditioned"]

SUPPORTED_MODELS = (
    "pre-LN decoder blocks h = x + Attn(Norm(x)) (GPT-2 style: a LayerNorm or RMSNorm before a "
    "self-attention flax.linen.MultiHeadDotProductAttention / flax.nnx.MultiHeadAttention with "
    "its default attention function), and logits returned as Dense(Norm(h)) or "
    "Embed.attend(Norm(h))"
)
_OPTIONS = frozenset({"layers", "span"})
_NORMS = (nn.LayerNorm, nn.RMSNorm, nnx.LayerNorm, nnx.RMSNorm)
_RMS = (nn.RMSNorm, nnx.RMSNorm)
_LINEAR = (nn.Dense, nnx.Linear)
_EMBED = (nn.Embed, nnx.Embed)
#: The module methods followed: ``attend`` is the tied unembedding of ``Embed``.
METHODS = ("__call__", "attend")

#: ``(kind, scale, bias, eps)`` of a final norm.
_NormParameters = tuple[FinalNorm, Any, Any, float]


@dataclass
class _Layer:
    """What one decoder block gives the methods."""

    residual: Any
    """``(batch, r, d)``: the block's input at the explained rows."""
    weights: Any
    """``(batch, heads, r, n)``: the attention rows of the explained positions."""
    values: Any
    """``(batch, heads, n, head_dim)``, the value bias included."""
    output_weight: Any
    """``(heads * head_dim, d)``, applied as ``context @ W_O``."""
    output_bias: Any


@dataclass
class _Head:
    """The final norm and the unembedding that produce the model's logits."""

    norm: _Call
    unembedding: _Call


class _Tracker(BlockTracker):
    """Follows the model's calls; keeps each pre-LN block's pieces at the explained rows."""

    def __init__(
        self,
        read: tuple[Callable[[Any], Any], Callable[[Any], Any]],
        *,
        rows: Sequence[int],
        matrices: Contributions | None,
        concrete: bool,
    ) -> None:
        super().__init__("alti" if matrices is None else matrices, *read)
        self.rows = rows
        self.keep_matrices = matrices is not None
        self.concrete = concrete
        self.positions: Any = None
        self.layers: list[_Layer] = []
        self.calls: list[_Call] = []
        """The norms, linear maps and embeddings finished since the last block (the head)."""
        self.parameters: dict[int, Any] = {}
        """Each of those calls' parameters, read while its module was bound."""

    def leave(self, output: Any) -> None:
        frame = self._stack[-1]
        super().leave(output)
        module = frame.call.module
        if not frame.pass_through and isinstance(module, (*_NORMS, *_LINEAR, *_EMBED)):
            self.calls.append(frame.call)
            self.parameters[id(frame.call)] = _parameters(module)

    def _attention(self, frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super()._attention(frame, args, kwargs)
        if self.positions is None:
            query = args[0] if args else kwargs.get("inputs_q")
            self.positions = _positions(self.rows, kwargs.get("mask"), query, self.concrete)

    def _finish(self, frame: _Frame) -> None:
        attention = frame.attention
        assert attention is not None
        where = frame.call.name or "(the model)"
        # The head runs after the last block: what ran before this block's end is not it.
        self.calls.clear()
        self.parameters.clear()
        z, _, _ = self._layout(frame)
        x = frame.call.inputs
        if z is x:
            msg = (
                f"The attention {attention.name!r} of block {where!r} reads the block's input "
                "itself: the target-conditioned methods read pre-LN blocks, "
                "h = x + Attn(Norm(x)) with a LayerNorm or RMSNorm called by the block on x "
                "(a post-LN block's norm after the attention is not linear in the tokens)."
            )
            raise StructureError(msg)
        if len(frame.weights) != 1:
            msg = (
                f"The attention {attention.name!r} of block {where!r} computed its weights "
                f"{len(frame.weights)} times (expected once, through the default attention "
                "function)."
            )
            raise StructureError(msg)
        weights = frame.weights[0]
        value_weight, value_bias, output_weight, output_bias = self.read_attention(attention.module)
        dtype = jnp.result_type(z, x, weights, value_weight, output_weight)
        z, x, weights, value_weight, output_weight = (
            jnp.asarray(a, dtype=dtype) for a in (z, x, weights, value_weight, output_weight)
        )
        heads = int(weights.shape[-3])
        values = jnp.matmul(z, value_weight)  # (batch, n, H * dh)
        if value_bias is not None:
            values = values + jnp.asarray(value_bias, dtype=dtype)
        values = jnp.swapaxes(
            jnp.reshape(values, (*values.shape[:-1], heads, -1)), -2, -3
        )  # (batch, H, n, dh)
        if output_bias is not None:
            output_bias = jnp.asarray(output_bias, dtype=dtype)
        # The block must add the attention's output to x: rebuild h and compare it with
        # what the block computed after the attention (raises on concrete arrays).
        context = jnp.matmul(weights, values)  # (batch, H, n, dh)
        context = jnp.reshape(jnp.swapaxes(context, -2, -3), (*x.shape[:-1], -1))
        rebuilt = x + jnp.matmul(context, output_weight)
        if output_bias is not None:
            rebuilt = rebuilt + output_bias
        _verified(values, rebuilt, frame.seen, where, False)
        positions = self.positions
        self.layers.append(
            _Layer(
                residual=_at_rows(x, positions, axis=-2),
                weights=_at_rows(weights, positions[:, None, :], axis=-2),
                values=values,
                output_weight=output_weight,
                output_bias=output_bias,
            )
        )
        if self.keep_matrices:
            super()._finish(frame)  # the block's token-mixing matrix (ALTI-Logit's rollout)


def _parameters(module: Any) -> dict[str, Any]:
    """Return the parameters of a norm, a linear map or an embedding (linen or NNX), by name."""
    if isinstance(module, nn.Module):
        return dict(module.variables.get("params", {}))
    found = {}
    for name in ("scale", "bias", "kernel", "embedding"):
        variable = getattr(module, name, None)
        if variable is not None:
            found[name] = variable[...]
    return found


def _at_rows(array: Any, positions: Any, *, axis: int) -> Any:
    """Take the explained positions ``(batch, r)`` (broadcast) along `axis` of `array`."""
    index = jnp.expand_dims(positions, -1) if axis == -2 else positions
    return jnp.take_along_axis(array, index, axis=axis)


def _real_tokens(mask: Any, batch: int, n: int) -> np.ndarray:
    """``(batch, n)`` bool: a key is real when some query may attend to it."""
    if mask is None:
        return np.ones((batch, n), dtype=bool)
    keep: Any = np.asarray(mask).astype(bool)
    while keep.ndim > 2:
        keep = keep.any(axis=-2)  # over the queries, then the heads
    return np.broadcast_to(keep, (batch, n))


def _positions(rows: Sequence[int], mask: Any, query: Any, concrete: bool) -> Any:
    """``(batch, r)`` positions: negative rows count from each sample's last real token.

    Abstract (the first pass): every token is taken as real, so only rows outside the
    sequence are refused; concrete: rows on padding too.
    """
    if query is None or query.ndim != 3:
        shape = None if query is None else tuple(query.shape)
        msg = (
            "the target-conditioned methods explain inputs of shape (batch, n): the attention's "
            f"queries must be (batch, n, features); got {shape}."
        )
        raise ValueError(msg)
    batch, n = int(query.shape[0]), int(query.shape[1])
    real = _real_tokens(mask if concrete else None, batch, n)
    ends = n - np.argmax(real[:, ::-1], axis=-1)  # after each sample's last real token
    positions = np.stack([ends + r if r < 0 else np.full(batch, r) for r in rows], axis=-1)
    for sample in range(batch):
        for which, position in enumerate(positions[sample]):
            if not 0 <= position < n or not real[sample, position]:
                msg = (
                    f"`rows` asks for position {rows[which]} of sample {sample}, which is not "
                    f"one of its {int(real[sample].sum())} real tokens (of {n} positions, "
                    "padding excluded): pass a row inside the text (-1 is the last real token)."
                )
                raise ValueError(msg)
    return jnp.asarray(positions)


def _logits(outputs: Any) -> Any:
    logits = outputs if isinstance(outputs, jax.Array) else getattr(outputs, "logits", None)
    if not isinstance(logits, jax.Array) or logits.ndim != 3:
        found = (
            f"an array of shape {tuple(logits.shape)}"
            if isinstance(logits, jax.Array)
            else f"a {type(outputs).__name__}"
        )
        msg = (
            "the target-conditioned methods explain a causal LM: the model must return its "
            f"logits of shape (batch, n, vocabulary), as an array or as `.logits`; got {found}."
        )
        raise TypeError(msg)
    return logits


def _find_head(tracker: _Tracker, logits: Any) -> _Head:
    """Return the final norm and the unembedding whose call returned `logits` (by identity)."""
    producer = next((c for c in reversed(tracker.calls) if c.output is logits), None)
    rule = (
        "the target-conditioned methods read logits = Dense(Norm(h)) or Embed.attend(Norm(h)) "
        "(tied weights), the unembedding's output returned as the model's logits, with nothing "
        "after it (no scaling, soft-capping or second projection)"
    )
    if producer is None or not isinstance(producer.module, (*_LINEAR, *_EMBED)):
        found = (
            "no module call of the model"
            if producer is None
            else f"{producer.name!r} ({type(producer.module).__name__})"
        )
        msg = (
            f"the model's logits are the output of {found}, not of a Dense (nnx.Linear) or "
            f"Embed.attend: {rule}. Return the unembedding's output itself."
        )
        raise ValueError(msg)
    norm = next((c for c in reversed(tracker.calls) if c.output is producer.inputs), None)
    if norm is None or not isinstance(norm.module, _NORMS):
        found = (
            "no module call" if norm is None else f"{norm.name!r} ({type(norm.module).__name__})"
        )
        msg = (
            f"the unembedding {producer.name!r} reads the output of {found}, not of a "
            f"LayerNorm or RMSNorm (the final norm): {rule}."
        )
        raise ValueError(msg)
    if not _last_axis(norm.module):
        msg = f"the final norm {norm.name!r} does not normalise over the last axis alone."
        raise ValueError(msg)
    return _Head(norm, producer)


def _norm(tracker: _Tracker, call: _Call) -> _NormParameters:
    found = tracker.parameters[id(call)]
    module = call.module
    kind: FinalNorm = "rms" if isinstance(module, _RMS) else "layer"
    return kind, found.get("scale"), found.get("bias"), float(module.epsilon)


def _unembedding(tracker: _Tracker, call: _Call) -> tuple[Any, Any]:
    """``(W (vocabulary, d), bias (vocabulary,) or None)`` of the head."""
    found = tracker.parameters[id(call)]
    if isinstance(call.module, _EMBED):
        return found["embedding"], None
    return jnp.swapaxes(found["kernel"], 0, 1), found.get("bias")


def check_ids(value: object, name: str) -> np.ndarray | None:
    """Check a `target` / `foil` before any work: integer ids, at most ``(batch, r)``."""
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        msg = f"`{name}` must be concrete ids: run the target-conditioned methods outside jax.jit."
        raise TypeError(msg)
    try:
        chosen = np.asarray(value)
    except (TypeError, ValueError):
        chosen = np.asarray(0.5)
    if chosen.dtype == bool or not np.issubdtype(chosen.dtype, np.integer) or chosen.ndim > 2:
        msg = (
            f"`{name}` must be a vocabulary id (int), one per sample, or one per sample and "
            f"row; got {value!r}."
        )
        raise TypeError(msg)
    return chosen


def _check_vocabulary(ids: np.ndarray, vocabulary: int, name: str) -> None:
    if bool(((ids < 0) | (ids >= vocabulary)).any()):
        msg = f"`{name}` must be vocabulary ids in [0, {vocabulary}); got {ids.tolist()!r}."
        raise ValueError(msg)


def _broadcast_ids(ids: np.ndarray, batch: int, rows: int, name: str) -> Any:
    shaped = ids.reshape(-1, 1) if ids.ndim == 1 else ids
    try:
        return jnp.asarray(np.broadcast_to(shaped, (batch, rows)))
    except ValueError:
        msg = (
            f"`{name}` must hold one id, one per sample ({batch}) or one per sample and row "
            f"({batch}, {rows}); got shape {ids.shape}."
        )
        raise ValueError(msg) from None


def _tolerance(logits: Any) -> float:
    """How far a recomputed logit may be from the model's: rounding of its dtype."""
    eps = float(jnp.finfo(logits.dtype).eps)
    scale = float(jnp.max(jnp.abs(logits))) if logits.size else 1.0
    return 256 * eps * max(scale, 1.0)


def _normalised(hidden: Any, norm: _NormParameters) -> Any:
    kind, scale, bias, eps = norm
    if kind == "layer":
        hidden = hidden - jnp.mean(hidden, axis=-1, keepdims=True)
    out = hidden / jnp.sqrt(jnp.mean(hidden * hidden, axis=-1, keepdims=True) + eps)
    if scale is not None:
        out = out * scale
    return out if bias is None else out + bias


def _check_head(model_logits: Any, hidden: Any, norm: _NormParameters, head: Any) -> None:
    """Refuse a head whose parameters do not give the model's logits at the explained rows."""
    weight, bias = head
    recomputed = jnp.matmul(_normalised(hidden, norm), jnp.swapaxes(weight, 0, 1))
    if bias is not None:
        recomputed = recomputed + bias
    error = float(jnp.max(jnp.abs(recomputed - model_logits)))
    if error > _tolerance(model_logits):
        msg = (
            "the final norm and the unembedding, read from their parameters, give the model's "
            f"logits at the explained rows within {error:.3g} only: the head does more than a "
            "norm and a linear map (or its norm is not the LayerNorm or RMSNorm it was taken "
            "for), which the target-conditioned methods do not decompose."
        )
        raise ValueError(msg)


def check_options(
    spec: MethodSpec, heads: object, options: Mapping[str, Any] | None
) -> tuple[Literal["sum", "each"], Literal["sum", "all", "cumulative"], bool]:
    """``(heads, layers, span)`` of a target-conditioned method, checked before any work."""
    method = spec.name
    given = dict(options or {})
    unknown = sorted(set(given) - _OPTIONS)
    if unknown:
        msg = (
            f'method="{method}" takes the options "layers" and "span" only; got {unknown}'
            + (
                " (the padding mask is read from the model's attention calls)"
                if "mask" in unknown
                else ""
            )
            + "."
        )
        raise ValueError(msg)
    layers = given.get("layers", "sum")
    span = given.get("span", False)
    check_target_options(spec, heads, layers, span)  # refuses anything else
    return (
        cast(Literal["sum", "each"], heads),
        cast(Literal["sum", "all", "cumulative"], layers),
        bool(span),
    )


@dataclass
class Model:
    """How to call one Flax model with its calls followed."""

    call: Callable[[], Any]
    """Runs the model on its inputs and returns its outputs."""
    tracking: Callable[[BlockTracker], contextlib.AbstractContextManager[None]]
    """Follows the model's module calls (``METHODS``) into a tracker."""
    read: tuple[Callable[[Any], Any], Callable[[Any], Any]]
    """The attention and norm parameter readers."""
    lock: Any = field(default_factory=contextlib.nullcontext)
    inputs: Any = None
    """Every array the call reads (inputs, variables): traced ones are refused."""


def _run(model: Model, tracker: _Tracker) -> tuple[Any, _Head]:
    with model.lock, model.tracking(tracker):
        outputs = model.call()
    logits = _logits(outputs)
    if not tracker.layers:
        msg = f"the model ran no attention block that the target-conditioned methods read ({SUPPORTED_MODELS})."
        raise ValueError(msg)
    return logits, _find_head(tracker, logits)


def explain_target_conditioned(
    model: Model,
    *,
    spec: MethodSpec,
    rows: int | Sequence[int] | None,
    target: object,
    foil: object,
    heads: object,
    options: Mapping[str, Any] | None,
) -> jax.Array:
    """Direct logit, ALTI-Logit or IFR scores of `rows` (see the module docstring)."""
    method = spec.name
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(model.inputs)):
        msg = (
            f'method="{method}" reads concrete values (the rows and the padding mask, the '
            "default target, the check of the head against the model's logits): call it "
            "outside jax.jit and other JAX transformations."
        )
        raise TypeError(msg)
    head_mode, layer_mode, span = check_options(spec, heads, options)
    if not spec.uses_target and (target is not None or foil is not None):
        msg = (
            f'method="{method}" is conditioned on the explained rows, not on a vocabulary id: '
            'drop `target`/`foil` (or use method="direct_logit" or "alti_logit").'
        )
        raise ValueError(msg)
    target_ids = check_ids(target, "target")
    foil_ids = check_ids(foil, "foil")
    chosen = check_explained_rows(-1 if rows is None else rows)
    single = rows is None or isinstance(rows, int)
    # A method over value-aware matrices (ALTI-Logit) carries its terms through their rollout.
    matrices = cast(Contributions, spec.matrix) if spec.value_aware else None

    # 1. Abstractly (no arithmetic): the blocks, the head, the vocabulary, rows in range.
    def probe() -> Any:
        tracker = _Tracker(model.read, rows=chosen, matrices=None, concrete=False)
        return _run(model, tracker)[0]

    shape = jax.eval_shape(probe)
    batch, vocabulary = int(shape.shape[0]), int(shape.shape[-1])
    for ids, name in ((target_ids, "target"), (foil_ids, "foil")):
        if ids is not None:
            _check_vocabulary(ids, vocabulary, name)
            _broadcast_ids(ids, batch, len(chosen), name)

    # 2. The forward, keeping each block's pieces at the explained rows.
    tracker = _Tracker(model.read, rows=chosen, matrices=matrices, concrete=True)
    logits, head = _run(model, tracker)
    positions = tracker.positions
    r = int(positions.shape[1])
    row_logits = _at_rows(logits, positions, axis=-2)  # (batch, r, vocabulary)
    hidden = _at_rows(head.norm.inputs, positions, axis=-2)  # (batch, r, d)
    norm = _norm(tracker, head.norm)
    weight, bias = _unembedding(tracker, head.unembedding)
    dtype = jnp.result_type(hidden, weight, row_logits)
    hidden, weight = jnp.asarray(hidden, dtype), jnp.asarray(weight, dtype)
    kind, scale, shift, eps = norm
    scale = None if scale is None else jnp.asarray(scale, dtype)
    shift = None if shift is None else jnp.asarray(shift, dtype)
    _check_head(row_logits, hidden, (kind, scale, shift, eps), (weight, bias))
    layers = tracker.layers
    if not spec.uses_target:
        stacked = jnp.stack(
            [
                ifr_terms(
                    layer.weights,
                    layer.values,
                    layer.output_weight,
                    layer.residual,
                    output_bias=layer.output_bias,
                    span=span,
                )[0]
                for layer in layers
            ],
            axis=1,
        )
    else:
        targets = (
            jnp.argmax(row_logits, axis=-1)
            if target_ids is None
            else _broadcast_ids(target_ids, batch, r, "target")
        )

        def read(ids: Any) -> tuple[Any, Any]:
            return readout(
                hidden, jnp.take(weight, ids, axis=0), norm=kind, weight=scale, bias=shift, eps=eps
            )

        direction, constant = read(targets)
        _check_readout(row_logits, targets, hidden, direction, constant, bias)
        if foil_ids is not None:
            # A contrast is linear in the readout: u_target - u_foil.
            direction = direction - read(_broadcast_ids(foil_ids, batch, r, "foil"))[0]
        stacked = jnp.stack(
            [
                direct_logit_terms(layer.weights, layer.values, layer.output_weight, direction)
                for layer in layers
            ],
            axis=1,
        )  # (batch, L, H, r, n)
        if matrices is not None:
            stacked = alti_logit_terms(stacked, rollouts_below(jnp.stack(tracker.matrices, axis=1)))
    result: jax.Array = sum_terms(stacked, heads=head_mode, layers=layer_mode)
    return result[..., 0, :] if single or span else result


def _check_readout(
    logits: Any, targets: Any, hidden: Any, direction: Any, constant: Any, bias: Any
) -> None:
    """Refuse a readout that does not give the target's logit (a norm it misreads)."""
    model_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    read = jnp.sum(hidden * direction, axis=-1) + constant
    if bias is not None:
        read = read + jnp.take(bias, targets)
    error = float(jnp.max(jnp.abs(read - model_logit)))
    if error > _tolerance(logits):
        msg = (
            f"the linearised final norm reads the target's logit within {error:.3g} only: the "
            "final norm is not the LayerNorm or RMSNorm it was taken for."
        )
        raise ValueError(msg)
