r"""Target-conditioned attributions of Keras 3 causal LMs in one eager forward pass.

``explain(model, inputs, method="direct_logit" | "alti_logit" | "ifr", rows=-1)``
(:func:`attnflow.adapters.keras.explain`) lands here. The model runs once, eagerly,
inside a value-aware capture (:mod:`attnflow.adapters._keras_contributions`), which keeps
for every attention block the block's input (the residual stream), what its attention
read (``LN(x)``) and its attention weights, after checking that ``x + MHA(LN(x))``
rebuilds the block's own output. The maths (readout, direct logit terms, IFR
proximities, ALTI-Logit's propagation, the sums over heads and layers) is the core's,
:mod:`attnflow._logit_attribution`; this module gathers the pieces:

* the explained rows of each block's attention weights, ``(batch, heads, r, n)``;
* each head's values, computed by the attention's own value projection
  (``_value_dense``), ``(batch, heads, n, head_dim)``, and its output projection
  ``(heads * head_dim, d)`` with its bias;
* the final norm's input at the explained rows, the final norm's parameters and the
  target's unembedding row.

Which models are read
---------------------
* **Blocks**: pre-LN GPT-2-style self-attention blocks, ``h = x + MHA(LN1(x))`` then
  ``h + MLP(LN2(h))``: a Keras layer or model whose direct sublayers are one
  ``keras.layers.MultiHeadAttention`` and one or two ``keras.layers.LayerNormalization``
  (see :data:`~attnflow.adapters._keras_contributions.SUPPORTED_BLOCKS`), the attention
  called as ``MHA(z, z)`` with ``use_causal_mask=True`` or a causal ``attention_mask``.
  Post-LN blocks are refused: their residual stream is renormalised after every block,
  so no term of it reaches the logit unchanged.
* **Final norm**: the last ``keras.layers.LayerNormalization`` (over the last axis,
  without ``rms_scaling``) or ``keras.layers.RMSNormalization`` that runs outside the
  attention blocks.
* **Unembedding**, looked for outside the blocks in this order: the one ``Dense`` layer
  whose kernel is ``(d, vocabulary)`` (``d`` the blocks' width, its bias read as well);
  else the one ``ReversibleEmbedding`` (its ``embeddings`` transposed when
  ``tie_weights``, else its ``reverse_embeddings``); else the ``Embedding`` of width
  ``d`` with the largest vocabulary (tied weights, ``logits = h @ E^T``; a position
  table is shorter than the vocabulary). Two candidates of one kind are refused.

A model not built yet (never called) is called once on `inputs` first, to create the
weights the head is found by. Nothing is taken on trust: the model's own logits at the explained rows must equal the
unembedding applied to the final norm's output (else the head does more than a norm and
a linear map, e.g. a soft cap, and is refused), and the linearised final norm must read
the target's logit back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import keras
import numpy as np

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
from ._keras_contributions import BlockPieces, BlockSpec, find_blocks

__all__ = ["explain_target_conditioned"]

_LN = keras.layers.LayerNormalization
_RMS: type | None = getattr(keras.layers, "RMSNormalization", None)
_NORMS: tuple[type, ...] = (_LN,) if _RMS is None else (_LN, _RMS)
_REVERSIBLE: type | None = getattr(keras.layers, "ReversibleEmbedding", None)

#: The largest difference allowed between a recomputed logit and the model's own,
#: relative to max(1, max |logit|), by dtype (Keras' norms are about 3e-7 off the exact
#: formula in float64 on the torch and JAX backends).
_TOLERANCE = {"float32": 1e-4, "float64": 1e-6}


@dataclass(frozen=True)
class _Head:
    """The unembedding: ``logits = z @ matrix + bias``, ``matrix (d, V)``."""

    layer: keras.Layer
    matrix: Any
    bias: Any | None

    @property
    def vocabulary(self) -> int:
        return int(self.matrix.shape[-1])


def _tensor(x: Any) -> Any:
    return keras.ops.stop_gradient(keras.ops.convert_to_tensor(x))


def _unique(layers: Any) -> list[keras.Layer]:
    seen: set[int] = set()
    found = []
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    return found


def _outside(model: keras.Layer, blocks: list[BlockSpec]) -> list[keras.Layer]:
    """Return the layers of `model` outside every attention block, in Keras' order."""
    inside = {
        id(layer)
        for spec in blocks
        for layer in spec.block._flatten_layers(include_self=True, recursive=True)
    }
    everything = model._flatten_layers(include_self=True, recursive=True)
    return [layer for layer in _unique(everything) if id(layer) not in inside]


def _width(blocks: list[BlockSpec]) -> int:
    return int(blocks[0].attention._output_dense.kernel.shape[-1])


def _names(layers: Sequence[keras.Layer]) -> str:
    return ", ".join(repr(layer.name) for layer in layers)


def _find_head(outside: list[keras.Layer], d: int) -> _Head:
    """Find the unembedding by the module docstring's rule (refused when ambiguous or absent)."""
    dense = [
        layer
        for layer in outside
        if isinstance(layer, keras.layers.Dense)
        and len(layer.kernel.shape) == 2
        and int(layer.kernel.shape[0]) == d
    ]
    if len(dense) > 1:
        msg = (
            f"the target-conditioned methods read the head as the final norm and one linear "
            f"map, but several Dense layers outside the attention blocks map the width {d}: "
            f"{_names(dense)}. Keep only the unembedding (Dense(vocabulary)) after the final "
            "norm, outside the blocks."
        )
        raise ValueError(msg)
    if dense:
        layer = dense[0]
        bias = getattr(layer, "bias", None)
        return _Head(layer, _tensor(layer.kernel), None if bias is None else _tensor(bias))
    reversible = [
        layer for layer in outside if _REVERSIBLE is not None and isinstance(layer, _REVERSIBLE)
    ]
    if len(reversible) > 1:
        msg = (
            f"several ReversibleEmbedding layers outside the attention blocks: "
            f"{_names(reversible)}; the target-conditioned methods need one unembedding."
        )
        raise ValueError(msg)
    if reversible:
        table: Any = reversible[0]
        matrix = (
            keras.ops.transpose(table.embeddings)
            if getattr(table, "tie_weights", True)
            else table.reverse_embeddings
        )
        return _Head(table, _tensor(matrix), None)
    tables = [
        layer
        for layer in outside
        if isinstance(layer, keras.layers.Embedding) and int(layer.output_dim) == d
    ]
    if tables:
        largest = max(int(layer.input_dim) for layer in tables)
        chosen = [layer for layer in tables if int(layer.input_dim) == largest]
        if len(chosen) == 1:
            return _Head(chosen[0], _tensor(keras.ops.transpose(chosen[0].embeddings)), None)
        msg = (
            f"several Embedding tables of width {d} and {largest} rows could be the tied "
            f"unembedding: {_names(chosen)}. Unembed with a Dense layer or a "
            "keras.layers.ReversibleEmbedding."
        )
        raise ValueError(msg)
    msg = (
        f"no unembedding found outside the attention blocks: a Dense layer with a ({d}, "
        f"vocabulary) kernel, a ReversibleEmbedding, or an Embedding of width {d} whose "
        "matrix gives the logits (tied weights)."
    )
    raise ValueError(msg)


def _norm_parameters(
    norm: keras.Layer, rank: int
) -> tuple[FinalNorm, Any | None, Any | None, float]:
    """``(kind, gain, bias, eps)`` of the final norm, refusing a norm the readout cannot read."""
    axis = getattr(norm, "axis", -1)
    axes = list(axis) if isinstance(axis, list | tuple) else [axis]
    if len(axes) != 1 or axes[0] not in (-1, rank - 1):
        msg = (
            f"the final norm {norm.name!r} normalises over axis={axis!r}; the "
            "target-conditioned methods read a norm over the last (hidden) axis only."
        )
        raise ValueError(msg)
    if isinstance(norm, _LN):
        if getattr(norm, "rms_scaling", False):
            msg = (
                f"the final norm {norm.name!r} is a LayerNormalization with rms_scaling=True, "
                "whose readout is not linearised here: use keras.layers.RMSNormalization or "
                "a plain LayerNormalization."
            )
            raise ValueError(msg)
        gamma = getattr(norm, "gamma", None)
        beta = getattr(norm, "beta", None)
        return (
            "layer",
            None if gamma is None else _tensor(gamma),
            None if beta is None else _tensor(beta),
            float(norm.epsilon),
        )
    return "rms", _tensor(norm.scale), None, float(norm.epsilon)


class _NormRecorder:
    """Wraps the ``call`` of the norms outside the blocks; keeps the last call's tensors."""

    def __init__(self, norms: list[keras.Layer]) -> None:
        self.norms = norms
        self.last: tuple[keras.Layer, Any, Any] | None = None
        self._wrapped: list[keras.Layer] = []

    def install(self) -> None:
        for norm in self.norms:
            if "call" in vars(norm):
                msg = (
                    f"the layer {norm.name!r} already has its own `call` attribute (is it "
                    "being explained already?)."
                )
                raise RuntimeError(msg)
            norm.call = self._wrapper(norm, norm.call)
            self._wrapped.append(norm)

    def restore(self) -> None:
        for norm in self._wrapped:
            if "call" in vars(norm):
                del norm.call
        self._wrapped.clear()

    def _wrapper(self, norm: keras.Layer, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(inputs, *args, **kwargs)
            self.last = (norm, _tensor(inputs), _tensor(output))
            return output

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call


def _length(inputs: object) -> int | None:
    """Return the sequence length of `inputs` if it can be read before the model runs."""
    first = inputs
    if isinstance(inputs, Mapping):
        first = next(iter(inputs.values()), None)
    elif isinstance(inputs, list | tuple):
        first = inputs[0] if inputs else None
    shape = getattr(first, "shape", None)
    if shape is None or len(shape) < 2 or shape[1] is None:
        return None
    return int(shape[1])


def _check_rows_fit(rows: Sequence[int], n: int | None) -> None:
    if n is None:
        return
    for row in rows:
        if not -n <= row < n:
            msg = (
                f"`rows` asks for position {row}, outside the {n} positions of the inputs: pass "
                "a row inside the text (-1 is the last real token)."
            )
            raise ValueError(msg)


def _positions(rows: Sequence[int], mask: np.ndarray) -> np.ndarray:
    """``(batch, r)`` positions: negative rows count from the end of each sample's real tokens."""
    n = mask.shape[-1]
    ends = n - np.argmax(mask[:, ::-1], axis=-1)
    ends = np.where(mask.any(axis=-1), ends, 0)
    positions = np.stack([ends + row if row < 0 else np.full_like(ends, row) for row in rows], -1)
    bad = (positions < 0) | (positions >= n)
    if not bad.any():
        bad = ~np.take_along_axis(mask, positions, axis=1)
    if bad.any():
        sample, which = (int(i) for i in np.argwhere(bad)[0])
        msg = (
            f"`rows` asks for position {rows[which]} of sample {sample}, which is not one of "
            f"its {int(mask[sample].sum())} real tokens (of {n} positions, padding excluded): "
            "pass a row inside the text (-1 is the last real token)."
        )
        raise ValueError(msg)
    return positions.astype(np.int64)


def _check_ids(given: object, vocabulary: int, name: str) -> np.ndarray | None:
    """Check `target` (or `foil`) before any work: vocabulary ids, at most ``(batch, r)``."""
    if given is None:
        return None
    try:
        chosen = _numpy(given) if keras.ops.is_tensor(given) else np.asarray(given)
    except (TypeError, ValueError):
        chosen = np.asarray(0.5)
    if chosen.dtype.kind not in "iu" or chosen.ndim > 2:
        msg = (
            f"`{name}` must be a vocabulary id (int), one per sample, or one per sample and "
            f"row; got {given!r}."
        )
        raise TypeError(msg)
    if ((chosen < 0) | (chosen >= vocabulary)).any():
        msg = f"`{name}` must be vocabulary ids in [0, {vocabulary}); got {given!r}."
        raise ValueError(msg)
    return chosen.astype(np.int64)


def _ids(chosen: np.ndarray | None, logits: np.ndarray, name: str) -> np.ndarray:
    """``(batch, r)`` vocabulary ids: the argmax at each explained row by default."""
    batch, rows, _ = logits.shape
    if chosen is None:
        return np.asarray(np.argmax(logits, axis=-1))
    chosen = chosen.reshape(-1, 1) if chosen.ndim == 1 else chosen
    try:
        ids: np.ndarray = np.broadcast_to(chosen, (batch, rows)).copy()
    except ValueError:
        msg = (
            f"`{name}` must hold one id, one per sample ({batch}) or one per sample and row "
            f"({batch}, {rows}); got shape {chosen.shape}."
        )
        raise ValueError(msg) from None
    return ids


def _logits(output: Any) -> Any:
    logits = output[0] if isinstance(output, list | tuple) and output else output
    if isinstance(output, Mapping):
        logits = output.get("logits")
    if not keras.ops.is_tensor(logits) or len(logits.shape) != 3:
        msg = (
            "the target-conditioned methods need a model that returns logits of shape (batch, "
            f"n, vocabulary) (a tensor, or a mapping with 'logits'); got {type(output).__name__}."
        )
        raise TypeError(msg)
    return logits


def _at(tensor: Any, positions: Any, axis: int) -> Any:
    """Gather ``positions (batch, r)`` along `axis` of ``tensor (batch, ..., n, ...)``."""
    shape = [1] * len(tensor.shape)
    shape[0], shape[axis] = int(positions.shape[0]), int(positions.shape[1])
    index = keras.ops.reshape(positions, shape)
    target = list(tensor.shape)
    target[axis] = int(positions.shape[1])
    return keras.ops.take_along_axis(tensor, keras.ops.broadcast_to(index, target), axis=axis)


def _numpy(x: Any) -> np.ndarray:
    """Copy a backend tensor to a host NumPy array (a torch tensor is detached first)."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(keras.ops.convert_to_numpy(x))


def _tolerance(logits: np.ndarray) -> float:
    dtype = str(logits.dtype)
    return _TOLERANCE.get(dtype, 1e-4) * max(1.0, float(np.abs(logits).max(initial=0.0)))


def _values(piece: BlockPieces) -> tuple[Any, Any, Any | None]:
    """``values (B, H, n, dh)`` from the attention's own value projection, ``W_O``, ``b_O``."""
    attention = piece.spec.attention
    values = keras.ops.transpose(attention._value_dense(piece.query), (0, 2, 1, 3))
    kernel = _tensor(attention._output_dense.kernel)  # (H, dh, d)
    heads, head_dim, d = (int(s) for s in kernel.shape)
    bias = getattr(attention._output_dense, "bias", None)
    return (
        _tensor(values),
        keras.ops.reshape(kernel, (heads * head_dim, d)),
        None if bias is None else _tensor(bias),
    )


def explain_target_conditioned(
    model: keras.Layer,
    inputs: Any,
    *,
    method: str,
    rows: int | Sequence[int] | None,
    target: object = None,
    foil: object = None,
    span: object = False,
    heads: Literal["sum", "each"] = "sum",
    layers: Literal["sum", "all", "cumulative"] = "sum",
    mask: object = None,
    capture: Callable[..., Any],
) -> Any:
    """Direct logit, ALTI-Logit or IFR scores of `rows` (see the module docstring).

    `capture` builds the value-aware capture that keeps each block's pieces
    (``capture(model, contributions=...)``, with ``pieces`` once it has run).
    """
    spec = method_spec(method)
    check_target_options(spec, heads, layers, span)
    if mask is not None:
        msg = (
            f'method="{method}" reads the padding mask from the model\'s attention calls: '
            "pass it to the model in `inputs`, not as `mask`."
        )
        raise ValueError(msg)
    if not spec.uses_target and (target is not None or foil is not None):
        msg = (
            f'method="{method}" is conditioned on the explained rows, not on a vocabulary id: '
            'drop `target`/`foil` (or use method="direct_logit" or "alti_logit").'
        )
        raise ValueError(msg)
    chosen = check_explained_rows(-1 if rows is None else rows)
    _check_rows_fit(chosen, _length(inputs))
    _check_ids(target, 2**62, "target")  # the types; the vocabulary once the head is known
    _check_ids(foil, 2**62, "foil")
    blocks = find_blocks(model)
    if not model.built or not all(spec.attention.built for spec in blocks):
        model(inputs)  # an unbuilt model has no weights to find the head by: build it
    outside = _outside(model, blocks)
    norms = [layer for layer in outside if isinstance(layer, _NORMS)]
    if not norms:
        msg = (
            f'method="{method}" needs a final keras.layers.LayerNormalization or '
            f"RMSNormalization outside the attention blocks of {type(model).__name__}; found none."
        )
        raise ValueError(msg)
    head = _find_head(outside, _width(blocks))
    target_ids = _check_ids(target, head.vocabulary, "target")
    foil_ids = _check_ids(foil, head.vocabulary, "foil")
    single = isinstance(rows, int) or rows is None

    # The matrices also check each block's decomposition against its own output; ALTI's are
    # propagated by ALTI-Logit, the others' are the cheapest that check.
    contributions = spec.matrix if spec.value_aware else "norm"
    recorder = _NormRecorder(norms)
    cap = capture(model, contributions=contributions)
    recorder.install()
    try:
        with cap:
            output = model(inputs)
    finally:
        recorder.restore()
    matrices = cap.contributions  # raises if a block could not be decomposed
    pieces: list[BlockPieces] = cap.pieces
    post = [piece.spec.name for piece in pieces if not piece.pre_ln]
    if post:
        msg = (
            f'method="{method}" reads pre-LN blocks, y = x + MHA(LN(x)) (GPT-2 style); '
            f"the blocks {post} are post-LN, whose stream is renormalised after each block."
        )
        raise ValueError(msg)
    if recorder.last is None:
        msg = "the model's final norm did not run eagerly: call the model directly, model(x)."
        raise RuntimeError(msg)
    final, final_input, final_output = recorder.last
    logits = _logits(output)
    n = int(logits.shape[1])
    padding = cap.mask
    real = (
        np.ones((int(logits.shape[0]), n), dtype=bool)
        if padding is None
        else _numpy(padding).astype(bool)
    )
    places = _positions(chosen, real)
    positions = keras.ops.convert_to_tensor(places, dtype="int32")
    model_logits = _numpy(_at(logits, positions, 1))  # (B, r, V)
    normed = _at(final_output, positions, 1)
    recomputed = keras.ops.matmul(keras.ops.cast(normed, head.matrix.dtype), head.matrix)
    if head.bias is not None:
        recomputed = recomputed + head.bias
    error = float(np.abs(_numpy(recomputed) - model_logits).max())
    if error > _tolerance(model_logits):
        msg = (
            f"the unembedding {head.layer.name!r} applied to the output of the final norm "
            f"{final.name!r} gives the model's logits within {error:.3g} only: the model's "
            "head does more than a norm and a linear map (logit scaling or soft-capping, a "
            "layer between them), which the target-conditioned methods do not decompose. "
            "Explain a copy of the model whose logits are the unembedding of the final norm's "
            "output (e.g. ReversibleEmbedding(logit_soft_cap=None), no logit scale)."
        )
        raise ValueError(msg)
    if spec.uses_target:
        stacked = _direct_terms(
            pieces,
            positions,
            final,
            _at(final_input, positions, 1),
            head,
            model_logits,
            _ids(target_ids, model_logits, "target"),
            None if foil_ids is None else _ids(foil_ids, model_logits, "foil"),
        )
        if spec.value_aware:  # ALTI-Logit: carried down by the rollout of its matrices
            stacked = alti_logit_terms(stacked, rollouts_below(matrices))
    else:
        shares = []
        for piece in pieces:
            values, output_weight, output_bias = _values(piece)
            terms, _ = ifr_terms(
                _at(piece.weights, positions, 2),
                values,
                output_weight,
                _at(piece.residual, positions, 1),
                output_bias=output_bias,
                span=bool(span),
            )
            shares.append(terms)
        stacked = keras.ops.stack(shares, axis=1)
    result = keras.ops.stop_gradient(sum_terms(stacked, heads=heads, layers=layers))
    return result[..., 0, :] if single or span else result


def _direct_terms(
    pieces: list[BlockPieces],
    positions: Any,
    final: keras.Layer,
    hidden: Any,
    head: _Head,
    model_logits: np.ndarray,
    targets: np.ndarray,
    foils: np.ndarray | None,
) -> Any:
    """``(B, L, H, r, n)`` direct logit terms of every block, the readout checked first."""
    kind, gain, shift, eps = _norm_parameters(final, len(hidden.shape))
    dtype = hidden.dtype
    unembedding = keras.ops.transpose(head.matrix)  # (V, d)

    def read(ids: np.ndarray) -> tuple[Any, Any]:
        index = keras.ops.convert_to_tensor(ids, dtype="int32")
        rows = keras.ops.cast(keras.ops.take(unembedding, index, axis=0), dtype)  # (B, r, d)
        return readout(hidden, rows, norm=kind, weight=gain, bias=shift, eps=eps)

    direction, constant = read(targets)
    read_logit = _numpy(keras.ops.sum(hidden * direction, axis=-1) + constant)
    if head.bias is not None:
        read_logit = read_logit + _numpy(head.bias)[targets]
    model_logit = np.take_along_axis(model_logits, targets[..., None], axis=-1)[..., 0]
    error = float(np.abs(read_logit - model_logit).max())
    if error > _tolerance(model_logits):
        msg = (
            f"the linearised final norm {final.name!r} reads the target's logit within "
            f"{error:.3g} only: it is not the LayerNormalization or RMSNormalization it was "
            "taken for."
        )
        raise ValueError(msg)
    if foils is not None:
        # A contrast is linear in the readout: u_target - u_foil.
        direction = direction - read(foils)[0]
    terms = []
    for piece in pieces:
        values, output_weight, _ = _values(piece)
        weights = _at(piece.weights, positions, 2)
        terms.append(direct_logit_terms(weights, values, output_weight, direction))
    return keras.ops.stack(terms, axis=1)
