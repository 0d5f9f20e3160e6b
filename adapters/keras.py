"""Capture attention scores from Keras 3 models (TensorFlow, JAX and torch backends).

``attnflow.adapters.keras`` records the attention probabilities of every
``keras.layers.MultiHeadAttention`` that runs during one eager model call and hands them
back in attnflow's canonical layout ``(*batch, layers, heads, n, n)`` with a padding mask,
as tensors of the active Keras backend (``tf.Tensor``, ``jax.Array`` or
``torch.Tensor``), ready for :func:`attnflow.rollout` and :func:`attnflow.flow`. It
imports keras and is imported only on demand (``import attnflow`` never imports it).

How the scores are captured, inside :func:`capture`: every ``MultiHeadAttention``
instance of the model (functional, sequential or subclassed, nested models included, as
well as keras-hub layers built on it) gets an instance attribute ``_compute_attention``
that calls the layer's own method with ``return_attention_scores=True``, records the
scores and hands the caller what it asked for. Without scores requested Keras computes
attention in a fused kernel that never materialises them, so the layer's flash-attention
setting is switched off during the block. The outputs of the model are unchanged.
Everything is restored when the block ends, also when the call raises.

The model must be called eagerly (``model(x)``), not through ``model.predict`` or a
compiled function: traced calls record symbolic tensors, which cannot be read.

:func:`attention_gradients` differentiates a scalar of the model's output with respect
to the attention weights (each backend's own autodiff, through zero "delta" tensors
added to the weights that multiply the values), aligned with the captured attentions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal, Self

import keras

import attnflow

__all__ = ["Capture", "attention_gradients", "capture", "explain"]

HeadReduction = Literal["mean", "max", "min"]

_MHA = keras.layers.MultiHeadAttention


class Capture:
    """The attention scores recorded by :func:`capture`.

    Use it as a context manager around one eager call of the model; the results are read
    after the ``with`` block.

    Attributes
    ----------
    attentions : tensor
        ``(*batch, layers, heads, n, n)`` (``(*batch, layers, n, n)`` when heads were
        fused while capturing), layers in the order the model ran them, as a tensor of
        the active Keras backend.
    mask : tensor or None
        ``(*batch, n)`` bool, True for real tokens, or None.
    records : list of tensor
        The scores of each attention call, in call order, not stacked.
    """

    def __init__(self, model: keras.Layer, *, heads: HeadReduction | None = None) -> None:
        given: object = model  # checked at run time: callers may not be type-checked
        if not isinstance(given, keras.Layer):
            msg = (
                "capture() expects a Keras model or layer (the model to call inside the "
                f"`with` block); got {type(given).__name__}."
            )
            raise TypeError(msg)
        if heads not in (None, "mean", "max", "min"):
            msg = f'`heads` must be None, "mean", "max" or "min"; got {heads!r}.'
            raise ValueError(msg)
        self.model = model
        self.heads: HeadReduction | None = heads
        self._records: list[Any] = []
        self._masks: list[Any] = []
        self._layers: list[keras.layers.MultiHeadAttention] = []
        self._saved_flash: dict[int, Any] = {}
        self._active = False
        self._used = False

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._used:
            msg = "A Capture records one `with` block; call capture(model) again for another."
            raise RuntimeError(msg)
        self._used = True
        self._layers = list(_attention_layers(self.model))
        if not self._layers:
            msg = (
                f"{type(self.model).__name__} contains no keras.layers.MultiHeadAttention "
                "layer (nor a layer built on it), so attnflow has no attention scores to "
                "capture. Attention written inline (e.g. with keras.ops.softmax) or with "
                "keras.ops.dot_product_attention is not seen."
            )
            raise ValueError(msg)
        try:
            for layer in self._layers:
                self._install(layer)
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._active = False
        self._restore()
        if exc_type is None and not self._records:
            msg = (
                f"No attention scores were captured from {type(self.model).__name__}: none "
                "of its MultiHeadAttention layers ran eagerly inside the `with` block. Call "
                "the model directly (model(x)), not through model.predict() or a compiled "
                "function, inside the block."
            )
            raise RuntimeError(msg)

    # -- results ------------------------------------------------------------------------
    @property
    def records(self) -> list[Any]:
        """The scores of each attention call, in call order."""
        return list(self._records)

    @property
    def attentions(self) -> Any:
        """The captured scores stacked to ``(*batch, layers, [heads,] n, n)``."""
        scores = self._records
        if not scores:
            msg = "Nothing was captured: read `attentions` after calling the model in the block."
            raise RuntimeError(msg)
        return _stack(scores, axis=-3 if self.heads is not None else -4)

    @property
    def mask(self) -> Any | None:
        """``(*batch, n)`` bool padding mask (True = real token), or None.

        Read from the attention mask of the first attention call that had one (an explicit
        ``attention_mask`` or a Keras mask propagated from ``mask_zero=True`` embeddings):
        a key is a real token when at least one query may attend to it. None when no
        attention call was masked or the mask does not match the scores.
        """
        if not self._records:
            return None
        sample = self._records[0]
        batch = tuple(sample.shape[: len(sample.shape) - (2 if self.heads is not None else 3)])
        for mask in self._masks:
            if mask is not None and tuple(mask.shape) == (*batch, sample.shape[-1]):
                return mask
        return None

    # -- recording ------------------------------------------------------------------------
    def _record(self, scores: Any, attention_mask: Any) -> None:
        if not self._active:
            return
        if not _is_concrete(scores):
            msg = (
                "attnflow recorded symbolic attention scores: the model ran in a traced "
                "function (model.predict(), jit_compile, tf.function or jax.jit). Call the "
                "model eagerly, model(x), inside the `with` block."
            )
            raise RuntimeError(msg)
        if self.heads is not None:
            scores = attnflow.fuse_heads(
                keras.ops.stop_gradient(scores), heads=self.heads, validate=False
            )
        self._records.append(scores)
        if attention_mask is None:
            self._masks.append(None)
        else:
            visible = keras.ops.cast(attention_mask, "bool")
            self._masks.append(keras.ops.any(visible, axis=-2))

    # -- installing and restoring --------------------------------------------------------
    def _install(self, layer: keras.layers.MultiHeadAttention) -> None:
        if "_compute_attention" in vars(layer):
            msg = (
                f"The MultiHeadAttention layer {layer.name!r} is already being captured: "
                "captures of the same model cannot be nested."
            )
            raise RuntimeError(msg)
        original: Callable[..., Any] = layer._compute_attention
        signature = inspect.signature(original)
        self._saved_flash[id(layer)] = getattr(layer, "_flash_attention", None)
        if hasattr(layer, "_flash_attention"):
            layer._flash_attention = False

        def _compute_attention(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments.get("return_attention_scores", False):
                result = original(*bound.args, **bound.kwargs)
                self._record(result[1], bound.arguments.get("attention_mask"))
                return result
            # The caller's own path gives the output: Keras' fused kernel and its explicit
            # softmax disagree on query rows whose keys are all masked (uniform weights
            # versus zeros), so the scores come from a second, explicit computation.
            result = original(*bound.args, **bound.kwargs)
            bound.arguments["return_attention_scores"] = True
            if "training" in bound.arguments:
                bound.arguments["training"] = False  # scores are taken before dropout
            _, scores = original(*bound.args, **bound.kwargs)
            self._record(scores, bound.arguments.get("attention_mask"))
            return result

        _compute_attention.__wrapped__ = original  # type: ignore[attr-defined]
        # An instance attribute shadows the class method; Keras' check for a custom
        # `_compute_attention` looks at the class, so the causal fast path is kept.
        layer._compute_attention = _compute_attention

    def _restore(self) -> None:
        errors: list[BaseException] = []
        for layer in self._layers:
            try:
                if "_compute_attention" in vars(layer):
                    del layer._compute_attention
                if id(layer) in self._saved_flash and hasattr(layer, "_flash_attention"):
                    layer._flash_attention = self._saved_flash.pop(id(layer))
            except Exception as error:  # noqa: BLE001 - restore everything we can
                errors.append(error)
        if errors:
            msg = "attnflow could not restore the model after capturing"
            raise RuntimeError(msg) from errors[0]


def capture(model: keras.Layer, *, heads: HeadReduction | None = None) -> Capture:
    """Record the attention scores of an eager Keras model call.

    Use the result as a context manager around one call of `model` (``model(x)``, not
    ``model.predict(x)``). Inside the block every ``keras.layers.MultiHeadAttention`` of
    the model records its scores (see the module docstring for how); when the block ends
    the layers are restored, also when the call raises. The model's outputs are those of
    an ordinary call, within float rounding. Works on the TensorFlow, JAX and torch
    backends of Keras 3; the results are tensors of the active backend.

    Parameters
    ----------
    model : keras.Layer
        The model: functional, sequential or subclassed, or a single layer, containing
        ``keras.layers.MultiHeadAttention`` layers (keras-hub backbones use them too).
    heads : {"mean", "max", "min"} or None, default None
        Fuse the heads of each layer while capturing (:func:`attnflow.fuse_heads`), so
        that only ``layers x n x n`` values per sequence are kept; None keeps every head.

    Returns
    -------
    Capture
        After the block: ``cap.attentions`` ``(*batch, layers, heads, n, n)`` (or
        ``(*batch, layers, n, n)`` with `heads`), layers in the order the model ran them;
        ``cap.mask`` ``(*batch, n)`` bool (True = real token) read from the attention
        masks the layers received, or None; ``cap.records`` the scores of each call.

    Raises
    ------
    TypeError
        If `model` is not a Keras layer or model.
    ValueError
        If `model` contains no ``MultiHeadAttention`` layer.
    RuntimeError
        If the block ends without any scores captured, or the model ran in a traced
        function (``predict``, ``tf.function``, ``jax.jit``).

    Notes
    -----
    The scores are the softmax probabilities before dropout. Every attention call in the
    block is recorded: call the model once. Keras gives a query row whose keys are all
    masked zero scores (not uniform ones); pass ``cap.mask`` to attnflow so that padded
    positions are ignored.

    When the caller did not ask for scores, the layer runs as usual (its output comes
    from Keras' own, possibly fused, path) and the scores are computed a second time,
    explicitly: attention costs twice as much inside the block, and the recorded scores
    are not on the autodiff path of the output. For gradients with respect to the
    attention weights use :func:`attention_gradients`.

    Examples
    --------
    >>> import keras
    >>> import attnflow
    >>> from attnflow.adapters.keras import capture
    >>> tokens = keras.Input((5, 8))
    >>> hidden = keras.layers.MultiHeadAttention(2, 4)(tokens, tokens)
    >>> hidden = keras.layers.MultiHeadAttention(2, 4)(hidden, hidden)
    >>> model = keras.Model(tokens, hidden)
    >>> x = keras.random.normal((1, 5, 8), seed=0)
    >>> with capture(model) as cap:
    ...     y = model(x)
    >>> tuple(cap.attentions.shape)
    (1, 2, 2, 5, 5)
    >>> tuple(attnflow.rollout(cap.attentions, rows=0).shape)
    (1, 5)
    """
    return Capture(model, heads=heads)


def explain(
    model: keras.Layer,
    inputs: Mapping[str, Any] | Sequence[Any] | Any,
    *,
    method: Literal["rollout", "flow"] = "rollout",
    rows: int | Sequence[int] | None = 0,
    **options: Any,
) -> Any:
    """Capture a Keras model's attention on `inputs` and return rollout or flow maps.

    Calls ``model(inputs)`` eagerly inside :func:`capture` (a mapping, list or tuple is
    passed as one argument, as Keras models take their inputs), then applies
    :func:`attnflow.rollout` or :func:`attnflow.flow` with the captured padding mask.

    Parameters
    ----------
    model : keras.Layer
        The model (see :func:`capture`).
    inputs : tensor, mapping or sequence
        The model's inputs.
    method : {"rollout", "flow"}, default "rollout"
        The attribution method.
    rows : int, sequence of int or None, default 0
        Output positions to explain; 0 is the first token, None gives the full ``n x n``
        map.
    **options
        Passed on to :func:`attnflow.rollout` or :func:`attnflow.flow` (``heads``,
        ``residual``, ``layers``, ``mask``, ``normalize``...). A string `heads`
        (``"mean"``, ``"max"``, ``"min"``) is applied while capturing, to save memory.
        ``mask`` overrides the captured mask (pass ``mask=None`` to ignore padding).

    Returns
    -------
    tensor
        ``(*batch, [layers,] n)`` for an int row, ``(*batch, [layers,] r, n)`` for ``r``
        rows, ``(*batch, [layers,] n, n)`` for all rows, a tensor of the active backend.

    Raises
    ------
    ValueError
        On an unknown `method` or as raised by :func:`capture` and the method.

    Examples
    --------
    >>> import keras
    >>> from attnflow.adapters.keras import explain
    >>> tokens = keras.Input((6, 8))
    >>> hidden = keras.layers.MultiHeadAttention(2, 4)(tokens, tokens)
    >>> model = keras.Model(tokens, keras.layers.MultiHeadAttention(2, 4)(hidden, hidden))
    >>> scores = explain(model, keras.random.normal((2, 6, 8), seed=1))
    >>> tuple(scores.shape)
    (2, 6)
    """
    if method not in ("rollout", "flow"):
        msg = f'`method` must be "rollout" or "flow"; got {method!r}.'
        raise ValueError(msg)
    heads = options.pop("heads", "mean")
    fuse_now = isinstance(heads, str) and heads in ("mean", "max", "min")
    with capture(model, heads=heads if fuse_now else None) as cap:
        model(inputs)
    options.setdefault("mask", cap.mask)
    attentions = keras.ops.stop_gradient(cap.attentions)
    function = attnflow.rollout if method == "rollout" else attnflow.flow
    return function(attentions, rows=rows, heads=None if fuse_now else heads, **options)


def attention_gradients(
    model: keras.Layer,
    inputs: Mapping[str, Any] | Sequence[Any] | Any,
    *,
    target: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """Gradients of a scalar of the model's output with respect to its attention weights.

    Differentiates ``target(model(inputs))`` with the active backend's own autodiff
    (``tf.GradientTape``, ``jax.grad`` or torch autograd) with respect to the attention
    weights of every ``keras.layers.MultiHeadAttention`` call, layer by layer, aligned
    with the attentions :func:`capture` records.

    How: inside the call, each attention layer computes its weights explicitly (softmax of
    the scaled dot products, as with ``return_attention_scores=True``) and a zero "delta"
    tensor is added to them just before they multiply the values; the gradient is taken
    with respect to the deltas, which is the gradient with respect to the weights that
    multiply V, each layer's weights treated as an independent input. Because the
    explicit path is used, a query row whose keys are all masked (a padded position) gets
    zero weights, as with ``return_attention_scores=True``, where Keras' fused kernel would
    give uniform ones: outputs on real tokens are unchanged, outputs on such padded rows
    follow the explicit path. The model runs in inference mode (no dropout), called
    eagerly twice: once to read the shapes and the attentions, once to differentiate.

    Parameters
    ----------
    model : keras.Layer
        The model (see :func:`capture`), called as ``model(inputs)``.
    inputs : tensor, mapping or sequence
        The model's inputs (a mapping, list or tuple is passed as one argument).
    target : callable
        Maps the model's outputs to a scalar (a 0-d tensor or one with a single element),
        e.g. ``lambda y: y[:, 0, 3].sum()``. Samples of a batch do not interact, so a sum
        over the batch gives each sample's own gradients.

    Returns
    -------
    attentions : tensor
        ``(*batch, layers, heads, n, n)``, as ``cap.attentions`` of :func:`capture`.
    gradients : tensor
        The same shape: ``d target / d attentions``, in the active backend's tensors.
        Zero for a layer whose weights do not reach the target.

    Raises
    ------
    TypeError
        If `model` is not a Keras layer or `target` is not callable.
    ValueError
        If `model` contains no ``MultiHeadAttention`` layer, the attention calls cannot
        be stacked, or `target` does not give a scalar.

    Examples
    --------
    >>> import keras
    >>> from attnflow.adapters.keras import attention_gradients
    >>> tokens = keras.Input((5, 8))
    >>> hidden = keras.layers.MultiHeadAttention(2, 4)(tokens, tokens)
    >>> model = keras.Model(tokens, keras.layers.MultiHeadAttention(2, 4)(hidden, hidden))
    >>> x = keras.random.normal((1, 5, 8), seed=0)
    >>> attentions, gradients = attention_gradients(
    ...     model, x, target=lambda y: keras.ops.sum(y[:, 0])
    ... )
    >>> tuple(gradients.shape) == tuple(attentions.shape) == (1, 2, 2, 5, 5)
    True
    """
    given: object = model
    if not isinstance(given, keras.Layer):
        msg = f"attention_gradients() expects a Keras model or layer; got {type(given).__name__}."
        raise TypeError(msg)
    given_target: object = target
    if not callable(given_target):
        msg = f"`target` must be a callable mapping the outputs to a scalar; got {target!r}."
        raise TypeError(msg)
    layers = list(_attention_layers(model))
    if not layers:
        msg = (
            f"{type(model).__name__} contains no keras.layers.MultiHeadAttention layer "
            "(nor a layer built on it): there are no attention weights to differentiate."
        )
        raise ValueError(msg)
    with _deltas_installed(layers) as state:
        model(inputs)
        records = [keras.ops.stop_gradient(r) for r in state.records]
        if not records:
            msg = f"No attention layer of {type(model).__name__} ran in model(inputs)."
            raise RuntimeError(msg)
        attentions = _stack(records, axis=-4)
        zeros = [keras.ops.zeros_like(r) for r in records]

        def objective(deltas: list[Any]) -> Any:
            state.deltas = deltas
            state.records = []
            try:
                value = target(model(inputs))
            finally:
                state.deltas = None
            if len(state.records) != len(deltas):
                msg = (
                    f"The model ran {len(state.records)} attention calls while "
                    f"differentiating and {len(deltas)} before: it must run the same calls."
                )
                raise RuntimeError(msg)
            return _scalar(value)

        gradients = _differentiate(objective, zeros)
    return attentions, _stack(gradients, axis=-4)


class _DeltaState:
    """What the layers patched by :func:`_deltas_installed` share during one model call."""

    def __init__(self) -> None:
        self.deltas: list[Any] | None = None
        self.records: list[Any] = []


@contextmanager
def _deltas_installed(layers: list[keras.layers.MultiHeadAttention]) -> Iterator[_DeltaState]:
    """Patch the layers to add ``state.deltas[k]`` to the k-th call's weights.

    Each layer computes its weights explicitly and records them; the delta is added
    before they multiply V.
    """
    state = _DeltaState()
    saved_flash: dict[int, Any] = {}
    installed: list[keras.layers.MultiHeadAttention] = []

    def patch(layer: keras.layers.MultiHeadAttention) -> None:
        if "_compute_attention" in vars(layer) or "_masked_softmax" in vars(layer):
            msg = (
                f"The MultiHeadAttention layer {layer.name!r} is already being captured: "
                "attention_gradients() cannot run inside capture() of the same model."
            )
            raise RuntimeError(msg)
        compute: Callable[..., Any] = layer._compute_attention
        softmax: Callable[..., Any] = layer._masked_softmax
        signature = inspect.signature(compute)

        def _compute_attention(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            wanted = bound.arguments.get("return_attention_scores", False)
            bound.arguments["return_attention_scores"] = True  # the explicit path
            output, scores = compute(*bound.args, **bound.kwargs)
            return output, scores if wanted else None

        def _masked_softmax(*args: Any, **kwargs: Any) -> Any:
            weights = softmax(*args, **kwargs)
            if state.deltas is not None:
                weights = weights + state.deltas[len(state.records)]
            state.records.append(weights)
            return weights

        saved_flash[id(layer)] = getattr(layer, "_flash_attention", None)
        installed.append(layer)
        if hasattr(layer, "_flash_attention"):
            layer._flash_attention = False
        layer._compute_attention = _compute_attention
        layer._masked_softmax = _masked_softmax

    try:
        for layer in layers:
            patch(layer)
        yield state
    finally:
        for layer in installed:
            for name in ("_compute_attention", "_masked_softmax"):
                if name in vars(layer):
                    delattr(layer, name)
            if hasattr(layer, "_flash_attention"):
                layer._flash_attention = saved_flash[id(layer)]


def _differentiate(objective: Callable[[list[Any]], Any], zeros: list[Any]) -> list[Any]:
    """Differentiate ``objective(deltas)`` at `zeros` with the backend's autodiff."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(zeros)
            value = objective(zeros)
        found = tape.gradient(value, zeros)
        return [tf.zeros_like(z) if g is None else g for z, g in zip(zeros, found, strict=True)]
    if backend == "jax":
        import jax

        return list(jax.grad(objective)(zeros))
    if backend == "torch":
        import torch

        deltas = [z.detach().requires_grad_(True) for z in zeros]
        with torch.enable_grad():
            value = objective(deltas)
            # None for a delta that does not reach the target (typed as never None).
        grads: Sequence[Any] = torch.autograd.grad(value, deltas, allow_unused=True)
        return [torch.zeros_like(d) if g is None else g for d, g in zip(deltas, grads, strict=True)]
    msg = f"attention_gradients() does not support the {backend!r} Keras backend."
    raise NotImplementedError(msg)


def _scalar(value: Any) -> Any:
    """`value` as a 0-d tensor, or a ValueError if it has more than one element."""
    value = keras.ops.convert_to_tensor(value)
    size = 1
    for dim in value.shape:
        size *= int(dim)
    if size != 1:
        msg = (
            "`target` must map the model's outputs to a scalar; got shape "
            f"{tuple(value.shape)} (e.g. sum over the batch: samples do not interact)."
        )
        raise ValueError(msg)
    return keras.ops.reshape(value, ())


def _stack(scores: list[Any], *, axis: int) -> Any:
    """Stack the per-call scores along the layer axis, or explain why they cannot be."""
    shapes = {tuple(s.shape) for s in scores}
    if len(shapes) > 1:
        msg = (
            f"The {len(scores)} attention calls have different shapes "
            f"{sorted(shapes)} and cannot be stacked into one (*batch, layers, heads, "
            "n, n) tensor. This happens with cross-attention (queries and keys of "
            "different lengths) or when the model was called several times on inputs "
            "of different lengths: read `records` and pick the calls of one stack."
        )
        raise ValueError(msg)
    return keras.ops.stack(scores, axis=axis)


# -- helpers ---------------------------------------------------------------------------------
def _attention_layers(model: keras.Layer) -> Iterator[keras.layers.MultiHeadAttention]:
    """Yield each MultiHeadAttention layer of `model` (itself included) once."""
    seen: set[int] = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, _MHA) and id(layer) not in seen:
            seen.add(id(layer))
            yield layer


def _is_concrete(x: Any) -> bool:
    """Whether `x` holds values (an eager tensor), not a symbolic or traced one."""
    if isinstance(x, keras.KerasTensor):
        return False
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.executing_eagerly()) and not isinstance(x, tf.__internal__.SymbolicTensor)
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True
