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

``capture(model, contributions="norm" | "globenc" | "alti")`` records value-aware
token-mixing matrices instead (:func:`attnflow.contributions`): each attention block (a
layer or model whose direct sublayers are one ``MultiHeadAttention`` and one or two
``LayerNormalization``, pre-LN or post-LN) has its ``call`` and those of its layers
wrapped to collect its input, the attention's input and weights (and GlobEnc's second
LayerNorm input); the core turns them into the block's ``n x n`` matrix when it returns,
after checking that the decomposition rebuilds the block's actual output; see
``attnflow.adapters._keras_contributions``.

:func:`attention_gradients` differentiates a scalar of the model's output with respect
to the attention weights (each backend's own autodiff, through zero "delta" tensors
added to the weights that multiply the values), aligned with the captured attentions.
:func:`input_gradients` differentiates a classifier's target score with respect to the
output of its embedding layer, the same way, for input-gradient token importances.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import keras
import numpy as np

import attnflow
from attnflow._methods import method_spec

from ._common import (
    CaptureBlock,
    CaptureHeads,
    Contributions,
    Method,
    Reduction,
    Score,
    TargetScore,
    capture_heads,
    check_class_values,
    check_contributions,
    check_method,
    check_no_target,
    check_reduce_output,
    check_scalar_shape,
    check_scalar_target,
    check_target_score,
    check_target_type,
    explain_contributions,
    explain_gradients,
    explain_weights,
    fuses_while_capturing,
    is_class_index,
    reject_heads,
    score_values,
)
from ._keras_contributions import BlockPieces, BlockRecorder, find_blocks

__all__ = ["Capture", "attention_gradients", "capture", "explain", "input_gradients"]

_MHA = keras.layers.MultiHeadAttention


class Capture(CaptureBlock):
    """The attention scores of one eager Keras model call, recorded by :func:`capture`.

    A context manager: ``with capture(model) as cap:`` patches the
    ``MultiHeadAttention`` layers of `model` (see the module docstring for how), records
    the scores of every attention call made inside the block and restores the layers
    when the block ends, also when the call raises. Read the results after the block,
    as tensors of the active Keras backend. Build it with :func:`capture`, which takes
    the same arguments and documents them in full. A capture records one ``with`` block
    (entering it again raises ``RuntimeError``); call the model once inside it, eagerly
    (``model(x)``, not ``model.predict(x)``).

    Parameters
    ----------
    model : keras.Layer
        The model (functional, sequential or subclassed) or layer to call inside the
        block, containing ``keras.layers.MultiHeadAttention`` layers.
    heads : {"each", "mean", "max", "min"}, default "each"
        Fuse the heads of each layer while capturing; ``"each"`` keeps every head
        (``None`` is its deprecated spelling).
    contributions : {"norm", "globenc", "alti"} or None, default None
        Record value-aware token-mixing matrices (`contributions` and `outputs`) instead
        of attention scores. Not with `heads`.

    Attributes
    ----------
    attentions : tensor
        ``(*batch, layers, heads, n, n)``, the layers in the order the model ran them;
        with `heads`, one fused head: ``(*batch, layers, 1, n, n)``.
    mask : tensor or None
        ``(*batch, n)`` bool padding mask, True for real tokens, or None.
    records : list of tensor
        The scores of each attention call, in call order, not stacked.
    contributions, outputs : tensor
        With `contributions`: the value-aware token-mixing matrices
        ``(*batch, layers, n, n)``, one per attention block call, rows = receiving token, and
        each block's output rebuilt from its decomposition, ``(*batch, layers, n, d)``.
    model : keras.Layer
        The model given.
    heads : {"each", "mean", "max", "min"}
        The `heads` argument.
    contribution_method : {"norm", "globenc", "alti"} or None
        The `contributions` argument.

    Raises
    ------
    TypeError
        If `model` is not a Keras layer or model.
    ValueError
        On a bad `heads` or `contributions`, or on both given.

    See Also
    --------
    capture : Builds it.
    attention_gradients : The scores and their gradients in one call.
    attnflow.rollout, attnflow.flow : Read `attentions` with `mask`.

    Notes
    -----
    Reading a result that the capture did not record raises an error that says what to
    read or pass instead, never an empty result: ``RuntimeError`` if nothing was
    captured, for `contributions` and `outputs` without ``contributions=`` and for
    `attentions` with it; ``ValueError`` for `attentions` when the calls' scores have
    different shapes (read `records`).

    Examples
    --------
    >>> import keras
    >>> import attnflow
    >>> from attnflow.adapters.keras import Capture, capture
    >>> ids = keras.Input((4,), dtype="int32")
    >>> hidden = keras.layers.Embedding(10, 8, mask_zero=True)(ids)  # 0 = padding
    >>> hidden = keras.layers.MultiHeadAttention(2, 4)(hidden, hidden)
    >>> hidden = keras.layers.MultiHeadAttention(2, 4)(hidden, hidden)
    >>> model = keras.Model(ids, hidden)
    >>> with capture(model) as cap:
    ...     y = model(keras.ops.convert_to_tensor([[3, 1, 4, 0]]))
    >>> isinstance(cap, Capture)
    True
    >>> tuple(cap.attentions.shape), len(cap.records)
    ((1, 2, 2, 4, 4), 2)
    >>> [bool(real) for real in cap.mask[0]]  # True = real token
    [True, True, True, False]
    >>> tuple(attnflow.rollout(cap.attentions, rows=0, mask=cap.mask).shape)
    (1, 4)
    """

    def __init__(
        self,
        model: keras.Layer,
        *,
        heads: CaptureHeads = "each",
        contributions: Contributions | None = None,
    ) -> None:
        given: object = model  # checked at run time: callers may not be type-checked
        if not isinstance(given, keras.Layer):
            msg = (
                "capture() expects a Keras model or layer (the model to call inside the "
                f"`with` block); got {type(given).__name__}."
            )
            raise TypeError(msg)
        heads = capture_heads(heads, caller="Capture")
        check_contributions(contributions, heads)
        self.model = model
        self.contribution_method: Contributions | None = contributions
        self._recorder: BlockRecorder | None = None
        self.heads: CaptureHeads = heads
        self._records: list[Any] = []
        self._masks: list[Any] = []
        self._layers: list[keras.layers.MultiHeadAttention] = []
        self._saved_flash: dict[int, Any] = {}
        self._active = False
        self._used = False

    # -- context manager (the protocol is CaptureBlock's) ---------------------------------
    _RECORDS = "attention scores"

    def _prepare(self) -> None:
        self._layers = list(_attention_layers(self.model))
        if not self._layers:
            msg = (
                f"{type(self.model).__name__} contains no keras.layers.MultiHeadAttention "
                "layer (nor a layer built on it), so attnflow has no attention scores to "
                "capture. Attention written inline (e.g. with keras.ops.softmax) or with "
                "keras.ops.dot_product_attention is not seen."
            )
            raise ValueError(msg)
        if self.contribution_method is not None:
            self._recorder = BlockRecorder(find_blocks(self.model), self.contribution_method)

    def _install_hooks(self) -> None:
        for layer in self._layers:
            self._install(layer)
        if self._recorder is not None:
            self._recorder.install()

    def _nothing_captured(self) -> str:
        return (
            f"No attention scores were captured from {type(self.model).__name__}: none "
            "of its MultiHeadAttention layers ran eagerly inside the `with` block. Call "
            "the model directly (model(x)), not through model.predict() or a compiled "
            "function, inside the block."
        )

    # -- results ------------------------------------------------------------------------
    @property
    def contributions(self) -> Any:
        """The value-aware token-mixing matrices ``(*batch, layers, n, n)``.

        One matrix per attention block call, in the order the blocks ran, rows = receiving
        token (see :func:`attnflow.contributions`), a tensor of the active backend; needs
        ``capture(model, contributions=...)``. Raises ``RuntimeError`` without it, before
        the model ran in the block, or when a block could not be decomposed.
        """
        return keras.ops.stack(self._recorded("contributions").matrices, axis=-3)

    @property
    def outputs(self) -> Any:
        """Each block's output rebuilt from its decomposition, ``(*batch, layers, n, d)``.

        ``Σ_j T_i(x_j) + b_i``, summed from the terms the matrices are read from: the
        output of the LayerNorm after the attention in a post-LN block, the residual
        stream ``x + MHA(LN(x))`` in a pre-LN one. The capture has already compared it
        with the model's own tensor (rows whose keys are all masked excepted). Raises as
        `contributions` does.
        """
        return keras.ops.stack(self._recorded("outputs").outputs, axis=-3)

    def _check_contributions(self, recorder: BlockRecorder) -> None:
        if recorder.errors:
            msg = (
                f"capture(contributions={self.contribution_method!r}) could not decompose "
                f"{type(self.model).__name__}: {recorder.errors[0]}. Supported are "
                "self-attention blocks x + MHA(LN(x)) and LN(x + MHA(x)) called eagerly, "
                "once per block call; capture the attention scores instead for other models."
            )
            raise RuntimeError(msg)
        if not recorder.matrices:
            msg = (
                f"No attention block of {type(self.model).__name__} ran eagerly inside the "
                "`with` block: call the model directly (model(x)), not through "
                "model.predict() or a compiled function."
            )
            raise RuntimeError(msg)

    @property
    def records(self) -> list[Any]:
        """The scores of each attention call, in call order, not stacked.

        One ``(*batch, [heads,] n_q, n_k)`` tensor of the active backend per call (one
        fused head with `heads`); empty before the call and with `contributions`. Every
        call in the block is kept: read it when the calls cannot be stacked into
        `attentions`.
        """
        return list(self._records)

    @property
    def attentions(self) -> Any:
        """The captured scores stacked to ``(*batch, layers, [heads,] n, n)``.

        The layers in the order the model ran them, a tensor of the active backend; with
        `heads`, one fused head. Raises ``RuntimeError`` if nothing was captured or the
        capture recorded `contributions`, and ``ValueError`` for calls of different
        shapes (cross-attention, several calls on inputs of different lengths: read
        `records`).
        """
        scores = self._records
        if not scores and self._recorder is not None:
            msg = (
                "This capture recorded value-aware contributions, not attention scores: read "
                "`contributions` (or capture(model) without contributions= for `attentions`)."
            )
            raise RuntimeError(msg)
        if not scores:
            msg = "Nothing was captured: read `attentions` after calling the model in the block."
            raise RuntimeError(msg)
        return _stack(scores, axis=-4)

    @property
    def mask(self) -> Any | None:
        """``(*batch, n)`` bool padding mask (True = real token), or None.

        Read from the attention mask of the first attention call that had one (an explicit
        ``attention_mask`` or a Keras mask propagated from ``mask_zero=True`` embeddings):
        a key is a real token when at least one query may attend to it. None when no
        attention call was masked or the mask does not match the scores.
        """
        if self._recorder is not None and self._recorder.matrices:
            sample = self._recorder.matrices[0]
            batch = tuple(sample.shape[:-2])
        elif not self._records:
            return None
        else:
            sample = self._records[0]
            batch = tuple(sample.shape[:-3])
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
        if self._recorder is not None:
            # The per-head scores go to the running block only, dropped when it returns.
            if not self._recorder.record(scores):
                self._recorder.errors.append("an attention call outside any recognised block")
        else:
            if self.heads != "each":
                # One fused head, its axis kept: the canonical layout.
                scores = keras.ops.expand_dims(
                    attnflow.fuse_heads(
                        keras.ops.stop_gradient(scores), heads=self.heads, validate=False
                    ),
                    -3,
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
        if self._recorder is not None:
            try:
                self._recorder.restore()
            except Exception as error:  # noqa: BLE001 - restore everything we can
                errors.append(error)
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


class _PiecesCapture(Capture):
    """A value-aware capture that also keeps each block's pieces (for ``_keras_logit``)."""

    def _prepare(self) -> None:
        super()._prepare()
        assert self._recorder is not None
        self._recorder.keep = True

    @property
    def pieces(self) -> list[BlockPieces]:
        """What each block call read, in call order (see :class:`BlockPieces`)."""
        return [] if self._recorder is None else list(self._recorder.pieces)


def capture(
    model: keras.Layer,
    *,
    heads: CaptureHeads = "each",
    contributions: Contributions | None = None,
) -> Capture:
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
    heads : {"each", "mean", "max", "min"}, default "each"
        Fuse the heads of each layer while capturing (:func:`attnflow.fuse_heads`), so
        that only ``layers x n x n`` values per sequence are kept; ``"each"`` keeps every
        head. (``None``, its old spelling, is deprecated: in rollout and flow
        ``heads=None`` means that the heads are already fused.)
        The fused weights keep a heads axis of length one, ``(*batch, layers, 1, n, n)``:
        the canonical layout, which every attnflow function reads as it is (with its
        default ``heads="mean"``, the mean of one head is that head).
    contributions : {"norm", "globenc", "alti"} or None, default None
        Record value-aware token-mixing matrices instead of attention scores (see
        :func:`attnflow.contributions`). Each attention block is recognised by its
        structure: a layer or model whose direct sublayers include exactly one
        ``MultiHeadAttention`` (called as self-attention, ``mha(h, h)``) and one or two
        ``LayerNormalization`` layers, pre-LN (``y = x + mha(LN1(x))``) or post-LN
        (``y = LN1(x + mha(x))``, with a second LayerNorm after the feed-forward network
        used by ``"globenc"``), told apart by the order in which its layers run. While a
        block runs, wrappers read its input (the residual stream), the attention's input
        and scores, and the LayerNorms' inputs and outputs; when it returns, attnflow
        computes its matrix from them and the layers' weights (value and output kernels
        reshaped to ``W_V (d_in, H * d_head)`` and ``W_O (H * d_head, d)``, LayerNorm
        gain, bias and epsilon), checks that the decomposition rebuilds the tensor the
        model computed, and drops the per-head tensors. Read ``cap.contributions``
        ``(*batch, layers, n, n)`` and ``cap.outputs``. Any ``MultiHeadAttention``
        outside such a block is refused. Not with `heads`.

    Returns
    -------
    Capture
        After the block: ``cap.attentions`` ``(*batch, layers, heads, n, n)`` (one fused
        head, ``(*batch, layers, 1, n, n)``, with `heads`), layers in the order the model ran them;
        ``cap.mask`` ``(*batch, n)`` bool (True = real token) read from the attention
        masks the layers received, or None; ``cap.records`` the scores of each call.
        With `contributions`: ``cap.contributions`` and ``cap.outputs`` instead of
        ``cap.attentions``.

    Raises
    ------
    TypeError
        If `model` is not a Keras layer or model.
    ValueError
        If `model` contains no ``MultiHeadAttention`` layer. With `contributions`: a bad
        value, a `heads` given too, or (on entering the block) a ``MultiHeadAttention``
        outside any recognised block, a quantized projection, an RMS-scaled LayerNorm or
        a compute dtype other than float32 and float64.
    RuntimeError
        If the block ends without any scores captured, or the model ran in a traced
        function (``predict``, ``tf.function``, ``jax.jit``). With `contributions`: a
        block could not be decomposed (cross-attention, attention that reads neither the
        block input nor a LayerNorm of it, a block output that the decomposition does not
        rebuild, e.g. with dropout active).

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

    Value-aware contributions (ALTI) of a pre-LN block, rolled out with the residual
    they already carry:

    >>> class Block(keras.layers.Layer):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norm = keras.layers.LayerNormalization()
    ...         self.attention = keras.layers.MultiHeadAttention(2, 4)
    ...
    ...     def call(self, x):
    ...         h = self.norm(x)
    ...         return x + self.attention(h, h)
    >>> model = keras.Sequential([keras.Input((5, 8)), Block(), Block()])
    >>> with capture(model, contributions="alti") as cap:
    ...     y = model(x)
    >>> tuple(cap.contributions.shape)
    (1, 2, 5, 5)
    >>> matrices = cap.contributions
    >>> tuple(attnflow.rollout(matrices, heads=None, residual=0.0, normalize_layers=True).shape)
    (1, 5, 5)
    """
    heads = capture_heads(heads, caller="capture")
    return Capture(model, heads=heads, contributions=contributions)


def explain(
    model: keras.Layer,
    inputs: Mapping[str, Any] | Sequence[Any] | Any,
    *,
    method: Method = "rollout",
    rows: int | Sequence[int] | None = 0,
    target: Any = None,
    target_score: TargetScore = "logit",
    **options: Any,
) -> Any:
    r"""Capture a Keras model's attention on `inputs` and return rollout, flow, GAE or value-aware maps.

    Calls ``model(inputs)`` eagerly inside :func:`capture` (a mapping, list or tuple is
    passed as one argument, as Keras models take their inputs), then applies
    :func:`attnflow.rollout` or :func:`attnflow.flow` with the captured padding mask.
    ``method="gradient_rollout"`` also differentiates the logit of the `target` class of
    each sample, or its log-probability (`target_score`), summed over the batch, with
    respect to every layer's attention weights
    (:func:`attention_gradients`, the backend's own autodiff) and applies
    :func:`attnflow.gradient_rollout` to the weights and gradients, paired layer by layer.

    Parameters
    ----------
    model : keras.Layer
        The model (see :func:`capture`).
    inputs : tensor, mapping or sequence
        The model's inputs.
    method : str, default "rollout"
        The attribution method: ``"rollout"``, ``"flow"``, ``"gradient_rollout"``,
        ``"norm"``, ``"globenc"``, ``"alti"``, ``"direct_logit"``, ``"alti_logit"`` or
        ``"ifr"``. The target-conditioned methods ``"direct_logit"``,
        ``"alti_logit"`` and ``"ifr"`` explain a causal LM's next-token prediction at
        `rows` (pre-LN GPT-2-style blocks, a final LayerNormalization or RMSNormalization
        and a linear or tied unembedding; see ``attnflow.adapters._keras_logit``): each
        head's value-aware contribution at the row, conditioned on the target, summed over
        layers; they take the torch adapter's options, `target` (a vocabulary id; default
        the argmax at each row), ``foil``, ``span`` (IFR), ``heads`` (``"sum"`` or
        ``"each"``) and ``layers`` (``"sum"``, ``"all"`` or ``"cumulative"``), and return
        ``(*batch, [layers,] [heads,] [r,] n)``. ``"norm"``, ``"globenc"`` and ``"alti"`` capture the
        value-aware token-mixing matrices (``capture(model, contributions=method)``) and
        return their rollout, with ``residual=0`` for GlobEnc and ALTI, whose matrices
        carry the residual connection, and the paper's ``0.5`` mix for the norm-based
        matrix, which has none. The norm-based and ALTI rows are renormalised
        (``normalize_layers=True``); GlobEnc follows its authors (Modarressi et al. 2022): the
        raw N-Enc matrices are multiplied without renormalising rows, so the values are
        not shares; ``normalize_layers=True`` gives the renormalised variant; `residual`
        in `options` overrides it. For flow over them, call :func:`attnflow.flow` on
        ``cap.contributions``.
    rows : int, sequence of int or None, default 0
        Output positions to explain; 0 is the first token, None gives the full ``n x n``
        map. Negative rows count from the end of each sequence's real tokens (the
        captured padding mask): ``rows=-1`` is every sequence's last real token.
    target : int, sequence of int, 1-d int tensor or None, default None
        ``"gradient_rollout"``: the class whose logit is explained (the model returns
        ``(batch, classes)`` logits), None for each sample's predicted class;
        ``"direct_logit"`` and ``"alti_logit"``: the vocabulary id whose logit is explained
        at each row (one, one per sample, or one per sample and row).
    target_score : {"logit", "log_probability"}, default "logit"
        ``"gradient_rollout"`` only: what is differentiated, the target's logit
        :math:`z_t` or its log-probability over the classes,
        :math:`\log \operatorname{softmax}(z)_t = z_t - \log \sum_v e^{z_v}`, whose
        gradient :math:`\nabla z_t - \sum_v p_v \nabla z_v` is what raises the target
        above the other classes (as in :func:`attnflow.adapters.torch.explain`). The
        default target (the argmax) is the same for both.
    **options
        Passed on to :func:`attnflow.rollout`, :func:`attnflow.flow` or
        :func:`attnflow.gradient_rollout` (``heads``, ``residual``, ``layers``, ``mask``,
        ``normalize_result``, ``rule``, ``exclude_self``...). A string `heads`
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
        On an unknown `method`, an unknown `target_score` (or one other than ``"logit"``
        with a method without gradients), before the model runs, or as raised by
        :func:`capture` and the method.

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
    check_method(method)
    check_target_score(target_score, method)
    spec = method_spec(method)
    if spec.target_conditioned:
        from ._keras_logit import explain_target_conditioned

        return explain_target_conditioned(
            model,
            inputs,
            method=method,
            rows=rows,
            target=target,
            capture=_PiecesCapture,
            **options,
        )
    if spec.value_aware and target is None:
        matrix = cast("Contributions", spec.matrix)
        return _explain_contributions(model, inputs, method=matrix, rows=rows, **options)
    if spec.gradients:
        check_target_type(target, _describe_target)
        with capture(model) as cap:
            logits = _logits(model(inputs))
        batch, n_classes = (int(d) for d in logits.shape)
        classes = keras.ops.convert_to_tensor(
            _target_classes(target, batch, n_classes, _to_numpy(logits))
        )
        attentions, gradients = attention_gradients(
            model, inputs, target=lambda y: _target_score(_logits(y), classes, target_score)
        )
        return explain_gradients(attentions, gradients, cap.mask, rows, options)
    check_no_target(method, target)
    heads = options.pop("heads", "mean")
    fuse_now = fuses_while_capturing(heads)
    with capture(model, heads=heads if fuse_now else "each") as cap:
        model(inputs)
    attentions = keras.ops.stop_gradient(cap.attentions)
    return explain_weights(attentions, cap.mask, method, rows, heads, options)


def _explain_contributions(
    model: keras.Layer,
    inputs: Mapping[str, Any] | Sequence[Any] | Any,
    *,
    method: Contributions,
    rows: int | Sequence[int] | None,
    **options: Any,
) -> Any:
    """explain(method="norm" | "globenc" | "alti"): rollout over value-aware matrices."""
    heads = options.pop("heads", None)
    if heads is not None:
        reject_heads(method, heads)
    with capture(model, contributions=method) as cap:
        model(inputs)
    return explain_contributions(cap.contributions, cap.mask, method, rows, options)


def attention_gradients(
    model: keras.Layer,
    inputs: Mapping[str, Any] | Sequence[Any] | Any,
    *,
    target: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """Differentiate a scalar of the model's output by its attention weights.

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
    check_scalar_target(target)
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
    check_scalar_shape(tuple(value.shape))
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


# -- input gradients ---------------------------------------------------------------------------
def input_gradients(
    model: keras.Layer,
    inputs: Mapping[str, Any] | Sequence[Any] | Any,
    *,
    target: int | Sequence[int] | Any | None = None,
    embeddings: keras.Layer | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
) -> Any:
    r"""Input-gradient importance of each token for a Keras classifier's prediction.

    The gradient of the target class's score with respect to the output of the
    embedding layer, reduced over the hidden axis to one number per token: the
    input-gradient attribution that Abnar & Zuidema (2020) compare attention rollout and
    attention flow with. For sample :math:`b` with target class :math:`t_b`, model
    outputs :math:`z_b` (taken as logits) and token embeddings
    :math:`e_{b,i} \in \mathbb{R}^d` (the embedding layer's output),

    .. math::

        s_b = \operatorname{softmax}(z_b)_{t_b} \ \text{(or } z_{b,t_b}\text{)}, \qquad
        g_{b,i} = \frac{\partial s_b}{\partial e_{b,i}},

    and the importance of token :math:`i` is :math:`\lVert g_{b,i} \rVert_2`
    (``"l2"``), :math:`\lvert \sum_k g_{b,i,k} \rvert` (``"sum_abs"``, as in the paper's
    code) or :math:`\lvert \sum_k g_{b,i,k}\, e_{b,i,k} \rvert` (``"x_input"``,
    gradient times input).

    How: while the model runs, the embedding layer's ``call`` is wrapped (on that
    instance, restored afterwards, also when the call raises) so that a zero tensor is
    added to its output, and the active backend's own autodiff (``tf.GradientTape``,
    ``jax.grad`` or ``torch.autograd.grad``) differentiates the summed target scores
    with respect to that zero, as :func:`attention_gradients` does. Samples of a batch
    are independent, so each gets its own gradient. The model is called eagerly twice:
    once for the shapes and the predicted classes, once to differentiate.

    Parameters
    ----------
    model : keras.Layer
        A classifier whose output is ``(batch, classes)``, called as ``model(inputs)``
        in inference mode (no dropout). **Its output is taken as logits**: with
        ``output="probability"`` a softmax is applied to it. A model that already ends
        with a softmax gives probabilities: pass ``output="logit"`` to differentiate
        them as they are (a warning says so when the outputs look like probabilities).
    inputs : tensor, mapping or sequence
        The model's inputs (a mapping, list or tuple is passed as one argument), e.g.
        token ids ``(batch, n)``.
    target : int, sequence of int, 1-d int tensor or None, default None
        The class to explain: None for each sample's predicted class (argmax of the
        outputs), an int for every sample, or one class per sample.
    embeddings : keras.Layer, optional
        The layer of `model` whose output is differentiated; by default the model's
        only ``keras.layers.Embedding``. It must run exactly once and return
        ``(batch, n, d)``.
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        How the hidden axis is reduced (see above).
    output : {"probability", "logit"}, default "probability"
        Differentiate the softmax of the outputs at the target class, or the output at
        the target class as it is.

    Returns
    -------
    tensor
        ``(batch, n)`` importances, a tensor of the active backend in the floating dtype
        of the embeddings. Zero where the outputs do not depend on the embeddings.

    Raises
    ------
    TypeError
        If `model` or `embeddings` is not a Keras layer, `target` has the wrong type, or
        the model does not return ``(batch, classes)`` outputs.
    ValueError
        On a bad `reduce` or `output`, a target out of range or of the wrong length, an
        `embeddings` layer that is not part of `model` or whose output is not
        ``(batch, n, d)``, or, with `embeddings` not given, no or several ``Embedding``
        layers.
    RuntimeError
        If the embedding layer does not run exactly once, or the model ran in a traced
        function.

    Warns
    -----
    UserWarning
        With ``output="probability"``, when the outputs look like probabilities (every
        row in [0, 1], summing to 1).

    Notes
    -----
    ``"sum_abs"`` is zero, up to rounding, when the embedding output reaches the rest of
    the model only through a LayerNorm of a sum (BERT-like models: token + position
    embeddings, then LayerNorm), since LayerNorm ignores a shift of all coordinates;
    use ``"l2"`` or ``"x_input"`` there.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] K. Simonyan, A. Vedaldi and A. Zisserman, "Deep Inside Convolutional Networks:
       Visualising Image Classification Models and Saliency Maps", ICLR Workshop 2014,
       https://arxiv.org/abs/1312.6034

    Examples
    --------
    >>> import keras
    >>> import numpy as np
    >>> from attnflow.adapters.keras import input_gradients
    >>> ids = keras.Input((5,), dtype="int32")
    >>> x = keras.layers.Embedding(10, 8)(ids)
    >>> x = x + keras.layers.MultiHeadAttention(2, 4)(x, x)
    >>> logits = keras.layers.Dense(3)(x[:, 0])
    >>> model = keras.Model(ids, logits)
    >>> tokens = np.array([[1, 4, 2, 7, 5], [3, 3, 5, 9, 8]])
    >>> tuple(input_gradients(model, tokens).shape)
    (2, 5)
    >>> tuple(input_gradients(model, tokens, target=[0, 2], reduce="x_input").shape)
    (2, 5)
    """
    given: object = model
    if not isinstance(given, keras.Layer):
        msg = f"input_gradients() expects a Keras model or layer; got {type(given).__name__}."
        raise TypeError(msg)
    check_reduce_output(reduce, output, of="outputs")
    check_target_type(target, _describe_target)
    layer = _embedding_layer(model, embeddings)
    with _output_perturbed(layer) as state:
        logits = _logits(model(inputs))
        found = list(state.outputs)
        if len(found) != 1:
            msg = (
                f"The embedding layer {layer.name!r} ran {len(found)} times in model(inputs); "
                "input_gradients() needs it to run exactly once: pass `embeddings=` the "
                "layer that embeds the input tokens."
            )
            raise RuntimeError(msg)
        embedded = keras.ops.stop_gradient(found[0])
        if not _is_concrete(embedded):
            msg = (
                "input_gradients() saw symbolic tensors: the model ran in a traced function. "
                "Call it with eager inputs (not inside tf.function, jax.jit or predict())."
            )
            raise RuntimeError(msg)
        batch, classes = (int(d) for d in logits.shape)
        if len(embedded.shape) != 3 or int(embedded.shape[0]) != batch:
            msg = (
                f"The output of the embedding layer {layer.name!r} has shape "
                f"{tuple(embedded.shape)}; input_gradients() needs (batch, n, d) with batch = "
                f"{batch} as in the outputs: pass `embeddings=` the token embedding layer."
            )
            raise ValueError(msg)
        values = _to_numpy(logits)
        if output == "probability":
            _warn_if_probabilities(values)
        indices = keras.ops.convert_to_tensor(
            _target_classes(target, batch, classes, values), dtype="int32"
        )

        def objective(deltas: list[Any]) -> Any:
            state.delta = deltas[0]
            state.outputs = []
            try:
                value = _target_score(_logits(model(inputs)), indices, output)
            finally:
                state.delta = None
            if len(state.outputs) != 1:
                msg = (
                    f"The embedding layer {layer.name!r} ran {len(state.outputs)} times while "
                    "differentiating and once before: the model must run the same way."
                )
                raise RuntimeError(msg)
            return value

        (grad,) = _differentiate(objective, [keras.ops.zeros_like(embedded)])
    return _reduce_hidden(grad, embedded, reduce)


class _OutputState:
    """What the wrapped embedding layer shares with input_gradients() during a call."""

    def __init__(self) -> None:
        self.delta: Any | None = None
        self.outputs: list[Any] = []


@contextmanager
def _output_perturbed(layer: keras.Layer) -> Iterator[_OutputState]:
    """Record the outputs of `layer` and add ``state.delta`` to them (this instance only)."""
    # Keras runs `quantized_call` instead of `call` for a quantized layer.
    name = "quantized_call" if getattr(layer, "quantization_mode", None) is not None else "call"
    if name in vars(layer):
        msg = (
            f"The layer {layer.name!r} already has its own `{name}` attribute (is it being "
            "explained already?): input_gradients() cannot wrap it."
        )
        raise RuntimeError(msg)
    original: Callable[..., Any] = getattr(layer, name)
    state = _OutputState()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        state.outputs.append(result)
        if state.delta is not None and len(state.outputs) == 1:
            return result + state.delta
        return result

    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    # An instance attribute shadows the class method; Keras looks `call` up on the
    # instance when the layer is called (the signature was read at construction).
    setattr(layer, name, wrapped)
    try:
        yield state
    finally:
        delattr(layer, name)


def _describe_target(target: object) -> tuple[bool, str] | None:
    """Read a tensor `target` for check_target_type: a valid one is 0-d or 1-d integer."""
    if not (isinstance(target, np.ndarray) or keras.ops.is_tensor(target)):
        return None
    tensor: Any = target
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    return "int" in dtype and len(
        tensor.shape
    ) <= 1, f"a {dtype} tensor of shape {tuple(tensor.shape)}"


def _target_classes(target: Any, batch: int, classes: int, logits: np.ndarray) -> np.ndarray:
    """Resolve `target` to ``(batch,)`` classes, validated against the outputs' shape."""
    if target is None:
        predicted: np.ndarray = np.argmax(logits, axis=-1).astype("int32")
        return predicted
    if is_class_index(target):
        values = [int(target)] * batch
    elif isinstance(target, Sequence):
        values = [int(v) for v in target]
    else:
        array = _to_numpy(target)
        values = [int(v) for v in (np.full(batch, array) if array.ndim == 0 else array)]
    check_class_values(values, batch, classes, of="outputs")
    return np.asarray(values, dtype="int32")


def _embedding_layer(model: keras.Layer, embeddings: object) -> keras.Layer:
    """Find the layer whose output input_gradients() differentiates (part of `model`)."""
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    if embeddings is not None:
        if not isinstance(embeddings, keras.Layer):
            msg = (
                "`embeddings` must be the Keras layer of the model that returns the token "
                f"embeddings (e.g. a keras.layers.Embedding); got {type(embeddings).__name__}."
            )
            raise TypeError(msg)
        if not any(layer is embeddings for layer in layers):
            msg = (
                f"`embeddings` (layer {embeddings.name!r}) is not a layer of "
                f"{type(model).__name__}, so it never runs in model(inputs): pass one of its "
                "layers, e.g. model.get_layer(name)."
            )
            raise ValueError(msg)
        return embeddings
    found: list[keras.Layer] = []
    for layer in layers:
        if isinstance(layer, keras.layers.Embedding) and all(layer is not f for f in found):
            found.append(layer)
    if len(found) == 1:
        return found[0]
    names = ", ".join(repr(layer.name) for layer in found)
    msg = (
        f"{type(model).__name__} has {'no' if not found else 'several'} "
        f"keras.layers.Embedding layers{': ' + names if found else ''}, so the token "
        "embeddings are not known: pass `embeddings=` the layer to differentiate (e.g. "
        "embeddings=model.get_layer(name))."
    )
    raise ValueError(msg)


def _logits(outputs: Any) -> Any:
    """Check that a model call gave ``(batch, classes)`` floating outputs."""
    if keras.ops.is_tensor(outputs) and len(outputs.shape) == 2:
        dtype = keras.backend.standardize_dtype(outputs.dtype)
        if "float" in dtype:
            return outputs
    if keras.ops.is_tensor(outputs):
        found = f"a tensor of shape {tuple(outputs.shape)} ({outputs.dtype})"
    else:
        found = f"a {type(outputs).__name__}"
    msg = (
        "input_gradients() needs a classifier: a model returning floating outputs of shape "
        f"(batch, classes); got {found}. Build a model that returns them, e.g. a Dense head "
        "on the first token's state."
    )
    raise TypeError(msg)


def _warn_if_probabilities(values: np.ndarray) -> None:
    if (
        values.shape[-1] >= 2
        and np.all((values >= 0) & (values <= 1))
        and np.allclose(values.sum(axis=-1), 1.0, rtol=0, atol=1e-5)
    ):
        warnings.warn(
            "The model's outputs look like probabilities (every row in [0, 1], summing to "
            "1); input_gradients() takes them as logits and applies a softmax for output="
            '"probability". If the model ends with a softmax, pass output="logit" to '
            "differentiate its probabilities as they are.",
            UserWarning,
            stacklevel=3,
        )


def _target_score(logits: Any, classes: Any, output: Score | TargetScore) -> Any:
    """Sum over the batch of each sample's target probability, log-probability or logit."""
    scores = score_values(
        logits,
        output,
        lambda z: keras.ops.softmax(z, axis=-1),
        lambda z: keras.ops.log_softmax(z, axis=-1),
    )
    picked = keras.ops.take_along_axis(scores, keras.ops.expand_dims(classes, -1), axis=-1)
    return keras.ops.sum(picked)


def _reduce_hidden(grad: Any, embedded: Any, reduce: Reduction) -> Any:
    """Reduce ``(batch, n, d)`` gradients over the hidden axis to ``(batch, n)``."""
    if reduce == "l2":
        return keras.ops.sqrt(keras.ops.sum(keras.ops.square(grad), axis=-1))
    if reduce == "sum_abs":
        return keras.ops.abs(keras.ops.sum(grad, axis=-1))
    return keras.ops.abs(keras.ops.sum(grad * embedded, axis=-1))


def _to_numpy(x: Any) -> np.ndarray:
    """Copy a backend tensor to a host NumPy array (a torch tensor is detached first)."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(keras.ops.convert_to_numpy(x))
