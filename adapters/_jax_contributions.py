r"""Record what value-aware token mixing needs from Flax attention blocks.

:func:`attnflow.adapters.jax.capture_linen` and :func:`~attnflow.adapters.jax.capture_nnx`
with ``contributions=`` use this module. Flax has no standard encoder layer, so a block
is recognised by how the model's own call runs, not by class names:

* The **block** of an attention call is the module that calls the attention
  (``flax.linen.MultiHeadDotProductAttention`` or ``flax.nnx.MultiHeadAttention``)
  directly. Its input (the first array argument of its ``__call__``) is the residual
  stream :math:`x`.
* **Post-LN** (BERT: :math:`y = \mathrm{LN}(x + \mathrm{Attn}(x))`): the attention reads
  the block's input itself (the same array object). The LayerNorm is the first
  ``LayerNorm`` the block calls directly after the attention returned, and GlobEnc's
  second LayerNorm the next one. With no LayerNorm after the attention the block is
  :math:`y = x + \mathrm{Attn}(x)`.
* **Pre-LN** (GPT-2, ViT: :math:`y = x + \mathrm{Attn}(\mathrm{LN}(x))`): the attention
  reads the output of a ``LayerNorm`` or ``RMSNorm`` that the block called directly on its
  input (the same array objects). The norm acts on each token alone, so it is inside
  :math:`f^h` and its parameters are not needed.

A block that normalises only before its feed-forward network
(:math:`h = x + \mathrm{Attn}(x)`, then :math:`h + \mathrm{FFN}(\mathrm{LN}(h))`) makes
the same calls as a post-LN block and is read as one: its matrices describe
:math:`\mathrm{LN}(h)`.

These are checks of identity, done while the model is traced, so they hold under
:func:`jax.jit`. The residual connection itself is an addition, which no module call
shows: after the block returns, its output rebuilt from the decomposition is compared
with the arrays the block computed after its attention (the LayerNorm output of a post-LN
block; the inputs and outputs of the modules it called after the attention, and its
return value, for the others). With concrete arrays a mismatch raises; under a JAX
transformation it cannot, and the block's matrix and rebuilt output become NaN instead.

While a block runs its pieces are kept: its input, the attention's input and weights, and
for GlobEnc on post-LN blocks the second LayerNorm's input. When the block returns, its
matrix is computed by the core and the pieces are dropped, so per-head tensors do not
outlive their layer. The model computes what it computes without the capture: calls are
observed, their arguments and results passed on untouched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import attention as linen_attention
from flax.nnx.nn import attention as nnx_attention

import attnflow
from attnflow._contributions import (
    LayerNormParameters,
    Method,
    contributions_and_outputs,
    uses_second_norm,
)

__all__ = ["BlockTracker", "linen_tracking", "nnx_tracking"]

_ATTENTION = (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention)
_LAYER_NORM = (nn.LayerNorm, nnx.LayerNorm)
_PRE_NORMS = (nn.LayerNorm, nn.RMSNorm, nnx.LayerNorm, nnx.RMSNorm)
_DROPOUT = (nn.Dropout, nnx.Dropout)

_STRUCTURE = (
    "Value-aware contributions need each attention module called by its own block module "
    "as y = LN(x + Attn(x)) (post-LN) or y = x + Attn(LN(x)) (pre-LN), x being the "
    "block's first argument; see the `contributions` parameter of capture_linen."
)


class StructureError(ValueError):
    """A model whose attention blocks cannot be decomposed."""


def _fail(message: str) -> StructureError:
    return StructureError(f"{message} {_STRUCTURE}")


def _first_array(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, jax.Array):
            return value
    return None


@dataclass
class _Call:
    """One module call inside a block: the module and its first input and output."""

    module: Any
    name: str
    inputs: Any
    output: Any = None


@dataclass
class _Frame:
    """A running module call; a block once an attention call is made inside it."""

    call: _Call
    parent: _Frame | None
    attention: _Call | None = None
    weights: list[jax.Array] = field(default_factory=list)
    attention_done: bool = False
    before: list[_Call] = field(default_factory=list)
    """Direct child calls finished before the attention (a pre-LN norm is one)."""
    after: list[_Call] = field(default_factory=list)
    """Direct child calls finished after the attention (post-LN norms)."""
    seen: list[Any] = field(default_factory=list)
    """Arrays computed in the block after the attention (to find its output)."""
    pass_through: bool = False
    """A second frame of the same module (``super().__call__``): not a call of its own."""


class BlockTracker:
    """Follows module calls; one matrix (and rebuilt output) per block call."""

    def __init__(
        self,
        method: Method,
        read_attention: Callable[[Any], tuple[Any, Any, Any, Any]],
        read_norm: Callable[[Any], LayerNormParameters],
    ) -> None:
        self.method: Method = method
        self.read_attention = read_attention
        self.read_norm = read_norm
        self.matrices: list[jax.Array] = []
        self.outputs: list[jax.Array] = []
        self.masks: list[Any] = []
        self._stack: list[_Frame] = []

    # -- calls --------------------------------------------------------------------------------
    def enter(self, module: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Open the frame of a module call that starts."""
        top = self._stack[-1] if self._stack else None
        frame = _Frame(_Call(module, name, _first_array(args, kwargs)), top)
        self._stack.append(frame)
        if top is not None and top.call.module is module:
            frame.pass_through = True  # super().__call__ of the same module
            return
        if isinstance(module, _DROPOUT):
            self._check_dropout(module, name, args, kwargs)
        if isinstance(module, _ATTENTION):
            self._attention(frame, args, kwargs)

    def leave(self, output: Any) -> None:
        """Close the running module call, which returned `output`."""
        frame = self._stack.pop()
        if frame.pass_through:
            return
        frame.call.output = output
        parent = frame.parent
        if isinstance(frame.call.module, _ATTENTION):
            assert parent is not None  # checked on entering
            parent.weights = frame.weights
            parent.attention_done = True
            return
        for running in self._stack:
            if running.attention_done:
                running.seen.extend(a for a in (frame.call.inputs, output) if _is_array(a))
        if parent is not None:
            (parent.after if parent.attention_done else parent.before).append(frame.call)
        if frame.attention is not None:
            if _is_array(output):
                frame.seen.append(output)
            try:
                self._finish(frame)
            finally:
                frame.weights.clear()  # the per-head tensors go with their layer
                frame.seen.clear()

    def abandon(self) -> None:
        """Forget the running call, which raised."""
        if self._stack:
            self._stack.pop()

    def record_weights(self, weights: jax.Array) -> None:
        """Attention weights computed inside the running attention call."""
        for frame in reversed(self._stack):
            if isinstance(frame.call.module, _ATTENTION) and not frame.pass_through:
                frame.weights.append(weights)
                return

    # -- checks -------------------------------------------------------------------------------
    @staticmethod
    def _check_dropout(
        module: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        rate = float(getattr(module, "rate", 0.0))
        given = kwargs.get("deterministic", args[1] if len(args) > 1 else None)
        deterministic = module.deterministic if given is None else given
        if rate > 0.0 and not deterministic:
            msg = (
                f"capture(contributions=...) needs the model run deterministically: the dropout "
                f"at {name!r} (rate {rate}) is active, so the block's output is not the sum of "
                "its token terms. Pass deterministic=True (or train=False) to the model call."
            )
            raise ValueError(msg)

    def check_attention_dropout(self, rate: float, deterministic: bool) -> None:
        """Refuse active dropout inside the attention function."""
        if rate > 0.0 and not deterministic:
            name = next(
                (
                    f.call.name
                    for f in reversed(self._stack)
                    if isinstance(f.call.module, _ATTENTION)
                ),
                "?",
            )
            msg = (
                "capture(contributions=...) needs the model run deterministically: the "
                f"attention dropout of {name!r} (rate {rate}) is active. Pass "
                "deterministic=True to the model call."
            )
            raise ValueError(msg)

    def _attention(self, frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        module, name = frame.call.module, frame.call.name
        query = args[0] if args else kwargs.get("inputs_q")
        others = [*args[1:3], kwargs.get("inputs_k"), kwargs.get("inputs_v")]
        others.append(kwargs.get("inputs_kv"))
        if any(other is not None and other is not query for other in others):
            msg = (
                f"The attention at {name!r} is cross-attention (its keys or values are not its "
                "queries); only self-attention blocks can be decomposed."
            )
            raise _fail(msg)
        decode = kwargs.get("decode")
        if decode or (decode is None and getattr(module, "decode", False)):
            msg = (
                f"The attention at {name!r} decodes with a KV cache (decode=True); call the "
                "model on whole sequences."
            )
            raise _fail(msg)
        parent = frame.parent
        if parent is None:
            msg = (
                f"The model itself is the attention module {name!r}: there is no block around "
                "it (no residual connection). Call it inside a block module."
            )
            raise _fail(msg)
        if parent.attention is not None:
            msg = (
                f"The block {parent.call.name or '(the model)'!r} calls two attention modules "
                f"({parent.attention.name!r} and {name!r}); put each layer in a module of its "
                "own."
            )
            raise _fail(msg)
        parent.attention = _Call(module, name, query)
        mask = kwargs.get("mask")
        self.masks.append(mask)

    # -- the matrix of one block --------------------------------------------------------------
    def _layout(self, frame: _Frame) -> tuple[Any, Any | None, Any | None]:
        """``(attention input, post-LN norm, second norm)`` of a block, or an error."""
        attention = frame.attention
        assert attention is not None
        x = frame.call.inputs
        where = frame.call.name or "(the model)"
        if not _is_array(x):
            msg = f"The block {where!r} was called without an array argument."
            raise _fail(msg)
        if attention.inputs is x:
            norms = [c for c in frame.after if isinstance(c.module, _LAYER_NORM)]
            post = norms[0] if norms else None
            second = norms[1] if len(norms) > 1 else None
            for found in (post, second):
                if found is not None and not _last_axis(found.module):
                    msg = (
                        f"The LayerNorm {found.name!r} of block {where!r} does not normalise "
                        "over the last axis alone."
                    )
                    raise _fail(msg)
            return x, post, second
        for call in frame.before:
            if call.output is attention.inputs and call.inputs is x:
                if not isinstance(call.module, _PRE_NORMS):
                    msg = (
                        f"The attention {attention.name!r} of block {where!r} reads the output "
                        f"of {call.name!r} ({type(call.module).__name__}), not a LayerNorm or "
                        "RMSNorm of the block's input."
                    )
                    raise _fail(msg)
                return attention.inputs, None, None
        msg = (
            f"The attention {attention.name!r} of block {where!r} reads neither the block's "
            "input nor a LayerNorm of it called by the block (a layer written inline in a "
            "model that loops over layers gives this: put each layer in a block module)."
        )
        raise _fail(msg)

    def _finish(self, frame: _Frame) -> None:
        attention = frame.attention
        assert attention is not None
        z, post, second = self._layout(frame)
        x = frame.call.inputs
        where = frame.call.name or "(the model)"
        if len(frame.weights) != 1:
            msg = (
                f"The attention {attention.name!r} of block {where!r} computed its weights "
                f"{len(frame.weights)} times (expected once, through the default attention "
                "function)."
            )
            raise _fail(msg)
        weights = frame.weights[0]
        if weights.shape[:-3] != x.shape[:-2] or weights.shape[-2:] != (x.shape[-2],) * 2:
            msg = (
                f"The attention weights of {attention.name!r} have shape {tuple(weights.shape)} "
                f"for a block input of shape {tuple(x.shape)}."
            )
            raise _fail(msg)
        value_weight, value_bias, output_weight, output_bias = self.read_attention(attention.module)
        globenc_second = second if uses_second_norm(self.method) else None
        norm = None if post is None else self.read_norm(post.module)
        second_norm = None if globenc_second is None else self.read_norm(globenc_second.module)
        # Flax promotes inputs and parameters to one dtype before computing (float32
        # parameters under float64 inputs with jax_enable_x64): do as the model did.
        dtype = jnp.result_type(z, x, weights, value_weight, output_weight)
        z, x, weights, value_weight, output_weight = (
            jnp.asarray(a, dtype=dtype) for a in (z, x, weights, value_weight, output_weight)
        )
        if value_bias is not None:
            value_bias = jnp.asarray(value_bias, dtype=dtype)
        if output_bias is not None:
            output_bias = jnp.asarray(output_bias, dtype=dtype)
        values = attnflow.head_values(
            z, value_weight, output_weight, heads=weights.shape[-3], value_bias=value_bias
        )
        matrix, output = contributions_and_outputs(
            weights,
            values,
            x,
            method=self.method,
            bias=output_bias,
            norm=_promoted_norm(norm, dtype),
            second_norm=_promoted_norm(second_norm, dtype),
            second_norm_input=None
            if globenc_second is None
            else jnp.asarray(globenc_second.inputs, dtype=dtype),
        )
        targets = [post.output] if post is not None else frame.seen
        matrix, output = _verified(matrix, output, targets, where, post is not None)
        self.matrices.append(matrix)
        self.outputs.append(output)


def _promoted_norm(norm: LayerNormParameters | None, dtype: Any) -> LayerNormParameters | None:
    if norm is None:
        return None
    weight, bias, eps = norm
    return (
        None if weight is None else jnp.asarray(weight, dtype=dtype),
        None if bias is None else jnp.asarray(bias, dtype=dtype),
        eps,
    )


def _is_array(value: object) -> bool:
    return isinstance(value, jax.Array)


def _last_axis(norm: Any) -> bool:
    axes = [getattr(norm, "reduction_axes", -1), getattr(norm, "feature_axes", -1)]
    return all(a in (-1, (-1,)) for a in axes)


def _verified(
    matrix: jax.Array, output: jax.Array, targets: list[Any], where: str, post: bool
) -> tuple[jax.Array, jax.Array]:
    """Check the rebuilt block output against what the block computed.

    Concrete arrays: raise on a mismatch. Traced ones: NaN matrix and output instead.
    """
    # Loose on purpose: this catches a structure that is not x + Attn (errors of the size
    # of the stream), not rounding. The model's own attention may run at a lower precision
    # than its dtype (jax.nn.dot_product_attention on CPU).
    tolerance = max(1e-3, 32.0 * float(np.finfo(output.dtype).eps))
    checks = []
    for target in targets:
        if not _is_array(target) or tuple(target.shape) != tuple(output.shape):
            continue
        target_ = jnp.asarray(target, output.dtype)
        scale = 1.0 + jnp.max(jnp.abs(target_))
        checks.append(jnp.max(jnp.abs(target_ - output)) <= tolerance * scale)
    ok = jnp.any(jnp.stack(checks)) if checks else jnp.asarray(False)
    if isinstance(ok, jax.core.Tracer):
        return jnp.where(ok, matrix, jnp.nan), jnp.where(ok, output, jnp.nan)
    if not bool(ok):
        seen = "its LayerNorm's output" if post else "anything the block computed after it"
        msg = (
            f"The output of block {where!r} rebuilt as x + Attn(...) (+ LayerNorm) matches "
            f"{seen}: the block does not add the attention to its input as assumed (no "
            "residual connection, a scaled or gated residual, or active dropout)."
        )
        raise _fail(msg)
    return matrix, output


# -- linen ------------------------------------------------------------------------------------
def _linen_name(module: nn.Module) -> str:
    return "/".join(module.scope.path) if module.scope is not None else ""


def _linen_attention(module: nn.Module) -> tuple[Any, Any, Any, Any]:
    params = module.variables["params"]
    value, out = params["value"], params["out"]
    kernel = value["kernel"]  # (d_in, H, d_head)
    value_weight = jnp.reshape(kernel, (kernel.shape[0], -1))
    value_bias = None if "bias" not in value else jnp.reshape(value["bias"], (-1,))
    out_kernel = out["kernel"]  # (H, d_head, d)
    output_weight = jnp.reshape(out_kernel, (-1, out_kernel.shape[-1]))
    return value_weight, value_bias, output_weight, out.get("bias")


def _linen_norm(module: nn.Module) -> LayerNormParameters:
    params = module.variables.get("params", {})
    return params.get("scale"), params.get("bias"), float(module.epsilon)


@contextlib.contextmanager
def linen_tracking(
    tracker: BlockTracker, methods: tuple[str, ...] = ("__call__",)
) -> Iterator[None]:
    """Follow every linen module call and record the attention weights.

    `methods`: the module methods followed (``"attend"`` too, for a tied unembedding).
    """
    original = linen_attention.dot_product_attention_weights
    signature = inspect.signature(original)

    def dot_product_attention_weights(*args: Any, **kwargs: Any) -> jax.Array:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        tracker.check_attention_dropout(
            float(arguments["dropout_rate"]), bool(arguments["deterministic"])
        )
        weights: jax.Array = original(*args, **kwargs)
        tracker.record_weights(weights)
        return weights

    def intercept(
        next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        if context.method_name not in methods:
            return next_fun(*args, **kwargs)
        module = context.module
        tracker.enter(module, _linen_name(module), args, kwargs)
        try:
            output = next_fun(*args, **kwargs)
        except BaseException:
            tracker.abandon()
            raise
        tracker.leave(output)
        return output

    linen_attention.dot_product_attention_weights = dot_product_attention_weights
    try:
        with nn.intercept_methods(intercept):
            yield
    finally:
        linen_attention.dot_product_attention_weights = original


# -- NNX ----------------------------------------------------------------------------------------
def _array(variable: Any) -> Any:
    return None if variable is None else variable[...]


def _nnx_attention(module: nnx.MultiHeadAttention) -> tuple[Any, Any, Any, Any]:
    kernel = _array(module.value.kernel)  # (d_in, H, d_head)
    value_weight = jnp.reshape(kernel, (kernel.shape[0], -1))
    bias = _array(getattr(module.value, "bias", None))
    value_bias = None if bias is None else jnp.reshape(bias, (-1,))
    out_kernel = _array(module.out.kernel)  # (H, d_head, d)
    output_weight = jnp.reshape(out_kernel, (-1, out_kernel.shape[-1]))
    return value_weight, value_bias, output_weight, _array(getattr(module.out, "bias", None))


def _nnx_norm(module: nnx.LayerNorm) -> LayerNormParameters:
    return _array(module.scale), _array(module.bias), float(module.epsilon)


@contextlib.contextmanager
def nnx_tracking(
    tracker: BlockTracker, model: nnx.Module, methods: tuple[str, ...] = ("__call__",)
) -> Iterator[None]:
    """Follow the calls of `model`'s modules and record the attention weights.

    Each module class's ``__call__`` (and the other `methods` it has, e.g. ``"attend"``)
    is wrapped for the duration (acting on the model's own instances only), and each
    ``MultiHeadAttention``'s ``attention_fn`` is wrapped by one that calls it unchanged
    and computes the weights beside it.
    """
    names: dict[int, str] = {}
    attentions: list[nnx.MultiHeadAttention] = []
    for path, sub in nnx.iter_modules(model):
        names.setdefault(id(sub), "/".join(str(p) for p in path))
        if isinstance(sub, nnx.MultiHeadAttention) and sub not in attentions:
            attentions.append(sub)
    classes = list(dict.fromkeys(type(m) for _, m in nnx.iter_modules(model)))
    originals = {
        (cls, name): (cls.__dict__.get(name), getattr(cls, name))
        for cls in classes
        for name in methods
        if callable(getattr(cls, name, None))
    }

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if id(self) not in names:
                return original(self, *args, **kwargs)
            tracker.enter(self, names[id(self)], args, kwargs)
            try:
                output = original(self, *args, **kwargs)
            except BaseException:
                tracker.abandon()
                raise
            tracker.leave(output)
            return output

        return __call__

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(nnx_attention.dot_product_attention)

        def attention_fn(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            tracker.check_attention_dropout(float(a["dropout_rate"]), bool(a["deterministic"]))
            output = original(*args, **kwargs)
            query, key, _ = a["promote_dtype"]((a["query"], a["key"], a["value"]), dtype=a["dtype"])
            weights = nnx_attention.dot_product_attention_weights(
                query,
                key,
                a["bias"],
                a["mask"],
                dtype=query.dtype,
                precision=a["precision"],
                promote_dtype=a["promote_dtype"],
                is_causal=a["is_causal"],
                deterministic=True,
            )
            tracker.record_weights(weights)
            return output

        return attention_fn

    custom = [
        names[id(m)]
        for m in attentions
        if m.attention_fn is not nnx.dot_product_attention
        and m.attention_fn is not nnx_attention.dot_product_attention
    ]
    if custom:
        msg = (
            f"The attention {custom[0]!r} has a custom attention_fn; value-aware "
            "contributions read the weights of the default nnx.dot_product_attention."
        )
        raise _fail(msg)
    functions = [m.attention_fn for m in attentions]
    try:
        for (cls, name), (_, inherited) in originals.items():
            setattr(cls, name, wrap(inherited))
        for m in attentions:
            # object.__setattr__: attention_fn is static, and NNX refuses attribute writes
            # from inside a JAX trace.
            object.__setattr__(m, "attention_fn", recording(m.attention_fn))
        yield
    finally:
        for m, function in zip(attentions, functions, strict=True):
            object.__setattr__(m, "attention_fn", function)
        for (cls, name), (own, _) in originals.items():
            if own is not None:
                setattr(cls, name, own)
            else:
                delattr(cls, name)


def read_linen() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """Return the parameter readers for linen blocks."""
    return _linen_attention, _linen_norm


def read_nnx() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """Return the parameter readers for NNX blocks."""
    return _nnx_attention, _nnx_norm
