"""Recording attention weights while a PyTorch model runs: :func:`capture` and :class:`Capture`.

How the weights are found (SDPA, eager attention, ``nn.MultiheadAttention``) and how
encoder, decoder and cross-attention are told apart is described in
:mod:`attnflow.adapters.torch`, the public module that re-exports these names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

import attnflow
import attnflow.explanation

from ._common import (
    CaptureBlock,
    CaptureHeads,
    Contributions,
    HeadReduction,
    capture_heads,
    check_contribution_method,
)
from ._torch_contributions import BlockRecorder, find_blocks
from ._torch_hooks import Hooks, attention_modules, sdpa_with_weights

__all__ = ["Capture", "capture", "sdpa_with_weights"]

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


@dataclass
class _Record:
    """One attention call: its weights and, when asked for, their gradient."""

    weights: torch.Tensor
    tracked: bool = False
    role: Role | None = None


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
        Needs autograd on during the call and ``heads="each"``.
    heads : {"each", "mean", "max", "min"}, default "each"
        Fuse the heads of each layer while capturing; ``"each"`` keeps every head
        (``None`` is its deprecated spelling).
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
    heads : {"each", "mean", "max", "min"}
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
        heads: CaptureHeads = "each",
        contributions: Contributions | None = None,
    ) -> None:
        given: object = model  # checked at run time: callers may not be type-checked
        if not isinstance(given, nn.Module):
            msg = (
                "capture() expects a torch.nn.Module (the model to call inside the `with` "
                f"block); got {type(given).__name__}."
            )
            raise TypeError(msg)
        heads = capture_heads(heads, caller="Capture")
        if gradients and heads != "each":
            msg = (
                "gradients=True needs the weights of every head (gradient-weighted rollout "
                'multiplies each head\'s weights by their gradient): pass heads="each" (the '
                "default) and fuse afterwards."
            )
            raise ValueError(msg)
        check_contribution_method(contributions)
        if contributions is not None and (gradients or heads != "each"):
            msg = (
                f"contributions={contributions!r} records one token-mixing matrix per layer, "
                "not attention weights: drop `gradients` and `heads` (got "
                f"gradients={gradients!r}, heads={heads!r})."
            )
            raise ValueError(msg)
        self.model = model
        self.contribution_method: Contributions | None = contributions
        self._recorder: BlockRecorder | None = None
        self.heads: CaptureHeads = heads
        self.track_gradients = gradients
        self._records: list[_Record] = []
        self._mask: torch.Tensor | None = None
        self._decoder_mask: torch.Tensor | None = None
        self._seq2seq = False
        self._running: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]] = []
        self._hooks = Hooks()
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
        if self.heads != "each":
            if weights.ndim < 3:
                msg = (
                    f"Cannot fuse heads of attention weights of shape {tuple(weights.shape)}: "
                    "expected (..., heads, n, n)."
                )
                raise ValueError(msg)
            # One fused head, its axis kept: the result is in the canonical layout, so
            # the default heads="mean" of rollout and flow reads it right.
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

    # -- installing and restoring --------------------------------------------------------
    def _install(self) -> None:
        hooks = self._hooks
        hooks.on_weights(self.model, self._record)
        hooks.mha_fastpath_off()

        hooks.before(self.model, self._on_model_call, with_kwargs=True)
        if self._recorder is not None:
            self._recorder.install(hooks)
        self._seq2seq = _is_encoder_decoder(self.model)
        if self._seq2seq:
            for name, module in self.model.named_modules():
                if module is self.model:
                    continue
                hooks.before(module, self._entering(name), with_kwargs=True, prepend=True)
                hooks.after(module, self._leaving, always_call=True)
        for _, module in attention_modules(self.model):
            if isinstance(module, nn.MultiheadAttention):
                hooks.before(module, self._before_mha, with_kwargs=True)
                hooks.after(module, self._after_mha, with_kwargs=True)

    def _restore(self) -> None:
        try:
            self._hooks.remove("attnflow could not restore the model after capturing")
        finally:
            self._mha_calls.clear()
            self._running.clear()
            self._last_weights = None

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
    heads: CaptureHeads = "each",
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
        call and ``heads="each"``.
    heads : {"each", "mean", "max", "min"}, default "each"
        Fuse the heads of each layer while capturing (:func:`attnflow.fuse_heads`), so
        that only ``layers x n x n`` values per sequence are kept; ``"each"`` keeps every
        head. (``None``, its old spelling, is deprecated: in rollout and flow
        ``heads=None`` means that the heads are already fused.)
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
    >>> attnflow.rollout(cap.contributions, heads=None, residual=0.0, normalize_layers=True).shape
    torch.Size([1, 5, 5])
    """
    heads = capture_heads(heads, caller="capture")
    return Capture(model, gradients=gradients, heads=heads, contributions=contributions)


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
