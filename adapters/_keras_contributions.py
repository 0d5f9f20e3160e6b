"""Record what value-aware token mixing needs from Keras 3 attention blocks.

:func:`attnflow.adapters.keras.capture` with ``contributions=`` uses this module to find
the model's attention blocks and, while one runs, to collect the pieces
:func:`attnflow.contributions` needs: the block input (the residual stream), the
attention's input, the attention weights and, for GlobEnc on post-LN blocks, the input of
the second LayerNorm. When the block returns, its matrix is computed by the core and the
pieces are dropped, so per-head tensors never outlive their layer.

A block is recognised by its structure: a Keras layer or model whose **direct** sublayers
include exactly one ``keras.layers.MultiHeadAttention`` and one or two
``keras.layers.LayerNormalization`` layers (a subclassed block holding them as
attributes, a functional model built for one block, or keras-hub's
``TransformerEncoder``). Where its LayerNorms sit is read from the order in which they
run during the block's call:

* **pre-LN** (``y = x + MHA(LN1(x))``): a LayerNorm runs on the block input before the
  attention, and the attention reads its output;
* **post-LN** (``y = LN1(x + MHA(x))``): the attention reads the block input itself and
  the first LayerNorm after it normalises the residual sum; a second LayerNorm after that
  one (after the feed-forward network, ``LN2(h + FFN(h))``) is GlobEnc's second norm,
  unless it normalises ``h`` itself (the FFN's input), in which case there is none.

Nothing is taken on trust: every block's rebuilt output ``Σ_j T_i(x_j) + b_i`` is
compared with the tensor the model actually computed (the post-LN LayerNorm's output, or
in a pre-LN block the input of the LayerNorm after the attention, else the block's
output), and a block that does not match (a scaled residual, dropout active, anything
else in between) is an error, never a silent wrong matrix. Only the layers' ``call`` is
wrapped, and the wrappers return what the original returns: the model's outputs are
bitwise unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras

from attnflow._contributions import (
    Method,
    contributions_and_outputs,
    head_values,
    uses_second_norm,
)

__all__ = ["SUPPORTED_BLOCKS", "BlockPieces", "BlockRecorder", "BlockSpec", "find_blocks"]

_MHA = keras.layers.MultiHeadAttention
_LN = keras.layers.LayerNormalization

SUPPORTED_BLOCKS = (
    "self-attention blocks: a Keras layer or model whose direct sublayers include exactly "
    "one keras.layers.MultiHeadAttention and one or two keras.layers.LayerNormalization "
    "(pre-LN, y = x + MHA(LN(x)), or post-LN, y = LN(x + MHA(x)))"
)

#: The largest difference allowed between a rebuilt block output and the model's own,
#: relative to max(1, max |output|), by dtype. The check is structural (a missing or
#: scaled residual is off by O(1)); Keras 3.15's LayerNormalization on the torch and JAX
#: backends is about 3e-7 off the exact formula in float64, so float64 allows 1e-6.
_TOLERANCE = {"float32": 1e-4, "float64": 1e-6}


@dataclass(frozen=True)
class BlockSpec:
    """One attention block: the layer and its direct attention and LayerNorm layers."""

    name: str
    block: keras.Layer
    attention: keras.layers.MultiHeadAttention
    norms: tuple[keras.layers.LayerNormalization, ...]


def _unique(layers: Any) -> list[keras.Layer]:
    seen: set[int] = set()
    found: list[keras.Layer] = []
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    return found


def _children(layer: keras.Layer) -> list[keras.Layer]:
    return _unique(layer._flatten_layers(include_self=False, recursive=False))


def _check_attention(spec: BlockSpec) -> None:
    """Refuse attention layers whose projections attnflow cannot read."""
    layer = spec.attention
    dtype = keras.backend.standardize_dtype(layer.dtype_policy.compute_dtype)
    if dtype not in _TOLERANCE:
        msg = (
            f"capture(contributions=...) needs float32 or float64 attention; the layer "
            f"{layer.name!r} of block {spec.name!r} computes in {dtype} (dtype policy "
            f"{layer.dtype_policy.name!r}). Build the model with a float32 or float64 policy "
            "to explain it."
        )
        raise ValueError(msg)
    for part in ("_value_dense", "_output_dense"):
        dense = getattr(layer, part, None)
        if dense is not None and getattr(dense, "quantization_mode", None) is not None:
            msg = (
                f"capture(contributions=...) reads the value and output projections of "
                f"{layer.name!r}, but its {part} is quantized "
                f"({dense.quantization_mode!r}), so its kernel is not the weight applied. "
                "Explain the unquantized model."
            )
            raise ValueError(msg)
    for norm in spec.norms:
        axis = norm.axis if isinstance(norm.axis, list | tuple) else [norm.axis]
        if len(axis) != 1 or getattr(norm, "rms_scaling", False):
            msg = (
                f"capture(contributions=...) needs LayerNormalization over the last axis "
                f"with mean centring; {norm.name!r} in block {spec.name!r} has axis="
                f"{norm.axis!r}, rms_scaling={getattr(norm, 'rms_scaling', False)!r}. Use "
                "LayerNormalization(axis=-1) without rms_scaling."
            )
            raise ValueError(msg)


def find_blocks(model: keras.Layer) -> list[BlockSpec]:
    """Recognise the model's attention blocks; refuse attention outside any of them.

    Raises
    ------
    ValueError
        If no block is found, a ``MultiHeadAttention`` lies outside every block (its
        contribution could not be decomposed), or a block has a projection or LayerNorm
        attnflow cannot read (quantized, RMS-scaled, not float32 or float64).
    """
    layers = _unique(model._flatten_layers(include_self=True, recursive=True))
    blocks: list[BlockSpec] = []
    for layer in layers:
        if isinstance(layer, _MHA):
            continue
        children = _children(layer)
        attention = [c for c in children if isinstance(c, _MHA)]
        norms = tuple(c for c in children if isinstance(c, _LN))
        if len(attention) == 1 and 1 <= len(norms) <= 2:
            blocks.append(BlockSpec(layer.name, layer, attention[0], norms))
    inside = {id(spec.attention) for spec in blocks}
    stray = [layer.name for layer in layers if isinstance(layer, _MHA) and id(layer) not in inside]
    if stray or not blocks:
        where = (
            f"MultiHeadAttention outside any recognised block: {', '.join(stray[:3])}"
            if stray
            else "no MultiHeadAttention layer"
        )
        msg = (
            f"capture(contributions=...) found {where} in {type(model).__name__}; "
            f"value-aware contributions are computed for {SUPPORTED_BLOCKS}. Wrap each "
            "attention block (its MultiHeadAttention, LayerNorms and residual connection) "
            "in its own layer or functional model, or capture the attention weights "
            "instead (capture(model) without contributions=)."
        )
        raise ValueError(msg)
    for spec in blocks:
        _check_attention(spec)
    return blocks


@dataclass(frozen=True)
class BlockPieces:
    """What one block call read, kept with ``BlockRecorder(keep=True)``."""

    spec: BlockSpec
    pre_ln: bool
    """Whether the block is pre-LN, ``y = x + MHA(LN(x))`` (else post-LN)."""
    residual: Any
    """``(*batch, n, d)``: the block's input (the residual stream)."""
    query: Any
    """``(*batch, n, d)``: what the attention read (``LN(x)`` in a pre-LN block)."""
    weights: Any
    """``(*batch, heads, n, n)``: the attention weights."""


@dataclass
class _Running:
    """The pieces of the block being run, in the order its layers returned."""

    spec: BlockSpec
    residual: Any
    norms: list[tuple[keras.layers.LayerNormalization, Any, Any]] = field(default_factory=list)
    """``(layer, input, output)`` of each LayerNorm call of the block, in order."""
    attention: list[tuple[int, Any, Any, Any]] = field(default_factory=list)
    """``(norms seen before, query, value, key)`` of each attention call."""
    weights: list[Any] = field(default_factory=list)


def _first_argument(signature: inspect.Signature, args: Any, kwargs: Any) -> Any:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args[0] if args else None
    values = list(bound.arguments.values())
    return values[0] if values else None


def _tensor(x: Any) -> Any:
    return keras.ops.stop_gradient(keras.ops.convert_to_tensor(x))


def _largest(x: Any) -> float:
    # float() of a 0-d tensor works on every backend (NumPy conversion warns on torch).
    return float(keras.ops.max(keras.ops.abs(x)))


def _same(a: Any, b: Any) -> bool:
    """Whether two tensors are the same values (the same object, or equal elementwise)."""
    if a is b:
        return True
    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return False
    return bool(keras.ops.all(keras.ops.equal(a, b)))


class BlockRecorder:
    """Wrappers on the blocks' layers; one matrix (and rebuilt output) per block call."""

    def __init__(self, blocks: list[BlockSpec], method: Method, *, keep: bool = False) -> None:
        self.blocks = blocks
        self.method: Method = method
        self.keep = keep
        """Whether each block's pieces are kept in `pieces` (the target-conditioned methods)."""
        self.pieces: list[BlockPieces] = []
        self.matrices: list[Any] = []
        self.outputs: list[Any] = []
        self.errors: list[str] = []
        self._running: _Running | None = None
        self._wrapped: list[keras.Layer] = []

    # -- installing and restoring ------------------------------------------------------
    def install(self) -> None:
        """Wrap the ``call`` of each block, its attention and its LayerNorms."""
        for spec in self.blocks:
            self._wrap(spec.block, self._block_call(spec))
            self._wrap(spec.attention, self._attention_call(spec))
            for norm in spec.norms:
                self._wrap(norm, self._norm_call(spec, norm))

    def restore(self) -> None:
        """Remove every wrapper (those installed so far)."""
        for layer in self._wrapped:
            if "call" in vars(layer):
                del layer.call
        self._wrapped.clear()
        self._running = None

    def _wrap(self, layer: keras.Layer, make: Callable[[Callable[..., Any]], Any]) -> None:
        if "call" in vars(layer):
            msg = (
                f"The layer {layer.name!r} already has its own `call` attribute (is it being "
                "captured or explained already?): capture(contributions=...) cannot wrap it."
            )
            raise RuntimeError(msg)
        original: Callable[..., Any] = layer.call
        wrapped = make(original)
        wrapped.__wrapped__ = original
        # An instance attribute shadows the class method; Keras looks `call` up on the
        # instance when the layer is called (the signature was read at construction).
        layer.call = wrapped
        self._wrapped.append(layer)

    # -- wrappers -------------------------------------------------------------------------
    def _block_call(self, spec: BlockSpec) -> Callable[[Callable[..., Any]], Any]:
        def make(original: Callable[..., Any]) -> Any:
            signature = inspect.signature(original)

            def call(*args: Any, **kwargs: Any) -> Any:
                if self._running is not None:
                    self.errors.append(
                        f"block {spec.name!r} ran inside block {self._running.spec.name!r}"
                    )
                    return original(*args, **kwargs)
                residual = _first_argument(signature, args, kwargs)
                if not keras.ops.is_tensor(residual) and not hasattr(residual, "shape"):
                    self.errors.append(f"block {spec.name!r}: its input is not one tensor")
                    return original(*args, **kwargs)
                running = _Running(spec, residual=_tensor(residual))
                self._running = running
                try:
                    output = original(*args, **kwargs)
                finally:
                    self._running = None
                try:
                    self._finish(running, output)
                except (ValueError, TypeError) as error:  # the core refused the pieces
                    self.errors.append(f"block {spec.name!r}: {error}")
                finally:
                    running.weights.clear()  # the per-head tensors go with their layer
                    running.attention.clear()
                return output

            return call

        return make

    def _attention_call(self, spec: BlockSpec) -> Callable[[Callable[..., Any]], Any]:
        def make(original: Callable[..., Any]) -> Any:
            signature = inspect.signature(original)

            def call(*args: Any, **kwargs: Any) -> Any:
                output = original(*args, **kwargs)
                running = self._running
                if running is None or running.spec.attention is not spec.attention:
                    self.errors.append(
                        f"{spec.attention.name!r} ran outside its block {spec.name!r}"
                    )
                    return output
                bound = signature.bind(*args, **kwargs)
                arguments = bound.arguments
                running.attention.append(
                    (
                        len(running.norms),
                        _tensor(arguments["query"]),
                        _tensor(arguments["value"]),
                        None if arguments.get("key") is None else _tensor(arguments["key"]),
                    )
                )
                return output

            return call

        return make

    def _norm_call(
        self, spec: BlockSpec, norm: keras.layers.LayerNormalization
    ) -> Callable[[Callable[..., Any]], Any]:
        def make(original: Callable[..., Any]) -> Any:
            signature = inspect.signature(original)

            def call(*args: Any, **kwargs: Any) -> Any:
                output = original(*args, **kwargs)
                running = self._running
                if running is not None and running.spec is spec:
                    given = _first_argument(signature, args, kwargs)
                    running.norms.append((norm, _tensor(given), _tensor(output)))
                return output

            return call

        return make

    def record(self, weights: Any) -> bool:
        """Take the attention weights of the running block; False if no block runs."""
        if self._running is None:
            return False
        self._running.weights.append(_tensor(weights))
        return True

    def clear(self) -> None:
        """Forget what was recorded."""
        self.matrices.clear()
        self.outputs.clear()
        self.pieces.clear()
        self.errors.clear()

    # -- the matrix of one block ----------------------------------------------------------
    def _finish(self, running: _Running, block_output: Any) -> None:
        spec = running.spec
        if len(running.attention) != 1 or len(running.weights) != 1:
            self.errors.append(
                f"block {spec.name!r}: {len(running.attention)} attention calls in one block "
                "call (expected exactly one self-attention)"
            )
            return
        before, query, value, key = running.attention[0]
        if not _same(query, value) or (key is not None and not _same(key, value)):
            self.errors.append(
                f"block {spec.name!r}: {spec.attention.name!r} is cross-attention (its query, "
                "key and value differ); only self-attention, attention(x, x), is decomposed"
            )
            return
        if len(query.shape) != 3:
            self.errors.append(
                f"block {spec.name!r}: the attention's input has shape {tuple(query.shape)}; "
                "only sequences (batch, n, d) are decomposed"
            )
            return
        residual = running.residual
        if before > 1:
            self.errors.append(f"block {spec.name!r}: {before} LayerNorms ran before attention")
            return
        if before == 1:  # pre-LN: y = x + MHA(LN1(x))
            _, norm_input, norm_output = running.norms[0]
            if not (_same(norm_input, residual) and _same(norm_output, query)):
                self.errors.append(
                    f"block {spec.name!r}: the LayerNorm before the attention does not map the "
                    "block's input to the attention's input (expected y = x + MHA(LN(x)))"
                )
                return
            post_norm = second = None
            after = running.norms[1:]
            observed = after[0][1] if after else _tensor(block_output)
            where = "the input of the LayerNorm after the attention" if after else "its output"
        else:  # post-LN: y = LN1(x + MHA(x))
            if not _same(query, residual):
                self.errors.append(
                    f"block {spec.name!r}: the attention reads neither the block's input nor a "
                    "LayerNorm of it (expected x + MHA(LN(x)) or LN(x + MHA(x)))"
                )
                return
            if not running.norms:
                self.errors.append(f"block {spec.name!r}: no LayerNorm ran after the attention")
                return
            post_norm, _, observed = running.norms[0]
            where = "the output of the LayerNorm after the attention"
            second = running.norms[1] if len(running.norms) > 1 else None
            if second is not None and _same(second[1], observed):
                # A LayerNorm of the FFN's input, not of the residual stream after it: the
                # stream is not normalised again, so GlobEnc has no second norm.
                second = None
        use_second = second if uses_second_norm(self.method) else None
        weights = running.weights[0]
        kernels = (spec.attention._value_dense.kernel, spec.attention._output_dense.kernel)
        if any(len(kernel.shape) != 3 for kernel in kernels):
            self.errors.append(
                f"block {spec.name!r}: {spec.attention.name!r} has value and output kernels "
                f"of shapes {[tuple(k.shape) for k in kernels]}; expected (d_in, heads, "
                "d_head) and (heads, d_head, d) (a custom output_shape is not supported)"
            )
            return
        value_weight, value_bias, output_weight, output_bias = _projections(spec.attention)
        values = head_values(
            query,
            value_weight,
            output_weight,
            heads=int(weights.shape[-3]),
            value_bias=value_bias,
        )
        matrix, rebuilt = contributions_and_outputs(
            weights,
            values,
            residual,
            method=self.method,
            bias=output_bias,
            norm=None if post_norm is None else _parameters(post_norm),
            second_norm=None if use_second is None else _parameters(use_second[0]),
            second_norm_input=None if use_second is None else use_second[1],
        )
        del values
        if not self._matches(spec, rebuilt, observed, weights, where):
            return
        self.matrices.append(matrix)
        self.outputs.append(rebuilt)
        if self.keep:
            self.pieces.append(BlockPieces(spec, post_norm is None, residual, query, weights))

    def _matches(
        self, spec: BlockSpec, rebuilt: Any, observed: Any, weights: Any, where: str
    ) -> bool:
        """Check the rebuilt output against the model's on rows with visible keys."""
        if tuple(rebuilt.shape) != tuple(observed.shape):
            self.errors.append(
                f"block {spec.name!r}: {where} has shape {tuple(observed.shape)}, not the "
                f"residual stream's {tuple(rebuilt.shape)}"
            )
            return False
        # Keras' fused kernel gives a query row whose keys are all masked uniform weights,
        # the recorded (explicit) weights zeros: such padded rows are not compared.
        visible = keras.ops.sum(weights, axis=(-3, -1)) > 0  # (batch, n)
        difference = keras.ops.where(
            visible[..., None], keras.ops.abs(keras.ops.cast(observed, rebuilt.dtype) - rebuilt), 0
        )
        dtype = keras.backend.standardize_dtype(rebuilt.dtype)
        limit = _TOLERANCE.get(dtype, 1e-4) * max(1.0, _largest(observed))
        error = _largest(difference)
        if error <= limit:
            return True
        self.errors.append(
            f"block {spec.name!r}: its decomposition does not rebuild {where} (largest "
            f"difference {error:.3g}, allowed {limit:.3g}); the block is not x + MHA(LN(x)) or "
            "LN(x + MHA(x)) as written (a scaled residual, a layer between the attention and "
            "the sum, or dropout active: call the model with training=False)"
        )
        return False


def _value(variable: Any) -> Any:
    return None if variable is None else _tensor(variable)


def _projections(layer: keras.layers.MultiHeadAttention) -> tuple[Any, Any, Any, Any]:
    """``(W_V, b_V, W_O, b_O)`` with ``W_V (d_in, H * d_head)`` and ``W_O (H * d_head, d)``.

    Keras keeps the value kernel as ``(d_in, H, d_head)`` (``abc,cde->abde``) and the
    output kernel as ``(H, d_head, d)`` (``abcd,cde->abe``); head h owns columns
    ``h * d_head : (h + 1) * d_head`` of the reshaped ``W_V`` and the same rows of ``W_O``.
    """
    value, output = layer._value_dense, layer._output_dense
    w_v, w_o = _tensor(value.kernel), _tensor(output.kernel)
    d_in, heads, d_head = (int(s) for s in w_v.shape)
    w_v = keras.ops.reshape(w_v, (d_in, heads * d_head))
    w_o = keras.ops.reshape(w_o, (heads * d_head, int(w_o.shape[-1])))
    b_v = _value(getattr(value, "bias", None))
    if b_v is not None:
        b_v = keras.ops.reshape(b_v, (heads * d_head,))
    return w_v, b_v, w_o, _value(getattr(output, "bias", None))


def _parameters(norm: keras.layers.LayerNormalization) -> tuple[Any, Any, float]:
    return _value(norm.gamma), _value(norm.beta), float(norm.epsilon)
