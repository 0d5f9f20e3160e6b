r"""Record what value-aware token mixing needs from PyTorch attention blocks.

:func:`attnflow.adapters.torch.capture` with ``contributions=`` uses this module to find
the model's attention blocks (recognised by their structure, not their class names) and,
while one runs, to collect the pieces :func:`attnflow.contributions` needs: the block input
(the residual stream), the attention's input (after the first LayerNorm in pre-LN
blocks), the attention weights, and for GlobEnc on post-LN blocks the input of the second
LayerNorm. When the block returns, its matrix is computed by the core and the pieces are
dropped, so per-head tensors never outlive their layer. Only forward hooks that return
nothing are used: the model computes exactly what it computes without them.

What the model has computed is not computed again: where the value projection is an
``nn.Linear`` called once in the block, its hook hands over the values
:math:`z W_V + b_V`; in blocks recognised by their class (BERT-like, DistilBERT, ViT), the
output projection's hook hands over the attention's output (plus :math:`b_O`), so the
heads' contexts are not recomputed from the weights. Blocks recognised by convention
(fused query-key-value, Llama-family) still rebuild the attention's output from the
weights and values, since their check compares it with what the model summed. On CPU
tensors of float32 or float64, the core's per-token work (LayerNorm statistics, the
rebuilt output, ALTI's row sums) runs on NumPy views: single-threaded operations of a
few hundred microseconds each, none of them a parallel region that waits for torch's
other intra-op threads to be scheduled on a loaded machine (the compiled kernel still
runs on those threads).

Supported blocks:

* Hugging Face BERT-like encoder layers (``BertLayer``, ``RobertaLayer``, MiniLM...):
  ``attention.self.{query,key,value}``, ``attention.output.{dense,LayerNorm}`` and
  ``output.LayerNorm``; post-LN.
* Hugging Face DistilBERT blocks (``TransformerBlock``): ``attention.{q,k,v,out}_lin``,
  ``sa_layer_norm``, ``output_layer_norm``; post-LN.
* Hugging Face GPT-2 blocks (``GPT2Block``): ``ln_1``, ``attn.c_attn`` (fused q, k, v
  ``Conv1D``), ``attn.c_proj``, ``ln_2``; pre-LN.
* Hugging Face ViT layers (``ViTLayer``): ``layernorm_before``, the value and output
  projections (``attention.attention.value`` and ``attention.output.dense`` in
  transformers 4, ``attention.v_proj`` and ``attention.o_proj`` in transformers 5),
  ``layernorm_after``; pre-LN.
* ``torch.nn.TransformerEncoderLayer`` (``self_attn`` an ``nn.MultiheadAttention``,
  ``norm1``, ``norm2``), ``norm_first`` True (pre-LN) or False (post-LN).
* Pre-LN blocks with a fused query-key-value ``nn.Linear`` (nanoGPT's ``ln_1``,
  ``attn.c_attn``, ``attn.c_proj``, ``ln_2``; also ``norm1``/``norm2`` and
  ``attn.qkv``/``attn.proj``, as in timm's ViT without LayerScale and in the paper's
  agreement model). Their structure is a convention, not a
  class, so every call is checked: the rebuilt output must equal the block input plus
  what ``attn`` returned, or the capture fails.
* Llama-family decoder layers (Llama, Mistral, Qwen2 and others built the same way):
  ``input_layernorm`` (an RMSNorm, or a LayerNorm), ``self_attn.{q,k,v,o}_proj`` (biases
  optional) and ``post_attention_layernorm``; pre-norm. Grouped-query attention is
  supported: the value heads (``v_proj``, ``num_key_value_heads`` of them) are shared by
  consecutive groups of query heads (:func:`attnflow.head_values` with
  ``value_heads``). Rotary position embeddings (RoPE) rotate only queries and keys, so
  the captured weights hold them and the value path is ``v_proj`` then ``o_proj``. The
  decomposed output is the stream after the attention's residual sum,
  :math:`x + \mathrm{o\_proj}(\mathrm{Attn}(\mathrm{RMSNorm}(x)))`, which is the input of
  ``post_attention_layernorm``: every call is checked against it, so a layer that
  scales or normalises the attention's output before the sum (Gemma 2, Granite) fails
  the capture instead of giving wrong matrices. Layers with further norms around the
  attention (``pre_feedforward_layernorm``...) are not recognised.

In pre-norm blocks the first norm acts on each token alone and its output is what the
attention reads, so it sits inside the value vectors :math:`f^h(z_j)` and needs no
decomposition: LayerNorm and RMSNorm alike. Only the post-LN blocks' norms, applied to
the residual sum itself, are decomposed (by the core, once the std of the actual sum is
fixed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
from torch import nn

from attnflow._contributions import (
    Method,
    _fold_centring,
    contributions_and_outputs,
    folds_post_norms,
    head_values_and_attention_output,
    uses_second_norm,
)
from attnflow._contributions_fused import OpenMPTeam, openmp_team

from ._torch_hooks import Hooks, attention_modules, attention_sites

__all__ = ["SUPPORTED_BLOCKS", "BlockRecorder", "find_blocks"]

SUPPORTED_BLOCKS = (
    "Hugging Face BERT-like encoder layers (attention.self.{query,key,value}, "
    "attention.output.{dense,LayerNorm}, output.LayerNorm), DistilBERT blocks "
    "(attention.{q,k,v,out}_lin, sa_layer_norm, output_layer_norm), GPT-2 blocks (ln_1, "
    "attn.c_attn, attn.c_proj, ln_2), ViT layers (layernorm_before, value and output "
    "projections, layernorm_after), "
    "torch.nn.TransformerEncoderLayer (norm_first True or False), pre-LN blocks with a "
    "fused query-key-value nn.Linear (ln_1 or norm1, attn.c_attn or attn.qkv, attn.c_proj "
    "or attn.proj, ln_2 or norm2), and Llama, Mistral and Qwen2-style decoder layers "
    "(input_layernorm, self_attn.{q,k,v,o}_proj with grouped-query attention and RoPE, "
    "post_attention_layernorm)"
)

# A string, so that the docs build can import this module against a mocked torch.
LayerNormTuple: TypeAlias = "tuple[torch.Tensor | None, torch.Tensor | None, float]"


@dataclass(frozen=True)
class BlockSpec:
    """Where one attention block keeps its pieces."""

    name: str
    block: nn.Module
    kind: str
    value: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """``(W_V, b_V)`` with ``W_V`` of shape ``(d_in, H * d_head)`` (applied as ``z @ W_V``)."""
    output: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """``(W_O, b_O)`` with ``W_O`` of shape ``(H * d_head, d)``."""
    pre_norm: nn.Module | None
    """Pre-LN blocks: the LayerNorm (or RMSNorm) whose output the attention reads."""
    post_norm: nn.LayerNorm | None
    """Post-LN blocks: the LayerNorm after the residual sum."""
    second_norm: nn.LayerNorm | None
    """Post-LN blocks: the LayerNorm after the feed-forward network (GlobEnc)."""
    batch_first: bool = True
    checked: nn.Module | None = None
    """Pre-LN blocks recognised by convention: the attention module whose output, added
    to the block input, the rebuilt output must equal."""
    stream: nn.Module | None = None
    """Pre-norm blocks recognised by convention: the module whose input is the stream
    after the attention's residual sum, which the rebuilt output must equal."""
    value_module: nn.Module | None = None
    """The ``nn.Linear`` whose whole output is ``z W_V + b_V``, where the block calls it as
    a module: its forward hook hands the projected values over (not computed again)."""
    output_module: nn.Module | None = None
    """The ``nn.Linear`` whose output is the attention's output plus ``b_O``, handed over
    from its forward hook in blocks whose structure is known (no `checked` or `stream`)."""


def _tensor(module: object, name: str) -> torch.Tensor | None:
    """Read a parameter that may be None (a bias-free layer), detached."""
    value = getattr(module, name, None)
    return value.detach() if isinstance(value, torch.Tensor) else None


def _linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read a ``torch.nn.Linear`` as ``(W, b)`` applied as ``x @ W + b``."""
    assert isinstance(module, nn.Linear)
    return module.weight.detach().T, _tensor(module, "bias")


def _is_linear(module: object) -> bool:
    return isinstance(module, nn.Linear)


def _is_layer_norm(module: object) -> bool:
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1


def _is_rms_norm(module: object) -> bool:
    """``torch.nn.RMSNorm`` or a model's own (``LlamaRMSNorm``...) over the last axis."""
    if isinstance(module, nn.RMSNorm):
        return len(module.normalized_shape) == 1
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Module)
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 1
    )


def _is_conv1d(module: object) -> bool:
    """Hugging Face's ``Conv1D``: a linear layer stored as ``(in, out)``, ``x @ W + b``."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Module)
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and getattr(module, "nf", None) == weight.shape[1]
    )


def _get(module: nn.Module, path: str) -> Any:
    found: Any = module
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def _bert(name: str, block: nn.Module) -> BlockSpec | None:
    parts = [_get(block, f"attention.self.{p}") for p in ("query", "key", "value")]
    dense = _get(block, "attention.output.dense")
    norm1 = _get(block, "attention.output.LayerNorm")
    norm2 = _get(block, "output.LayerNorm")
    if not (all(_is_linear(p) for p in parts) and _is_linear(dense)):
        return None
    if not (_is_layer_norm(norm1) and _is_layer_norm(norm2)):
        return None
    if getattr(block, "crossattention", None) is not None:
        return None
    return BlockSpec(
        name,
        block,
        "BERT-like (post-LN)",
        value=lambda: _linear(parts[2]),
        output=lambda: _linear(dense),
        pre_norm=None,
        post_norm=norm1,
        second_norm=norm2,
        value_module=parts[2],
        output_module=dense,
    )


def _distilbert(name: str, block: nn.Module) -> BlockSpec | None:
    parts = [_get(block, f"attention.{p}") for p in ("q_lin", "k_lin", "v_lin", "out_lin")]
    norm1, norm2 = _get(block, "sa_layer_norm"), _get(block, "output_layer_norm")
    if not (all(_is_linear(p) for p in parts) and _is_layer_norm(norm1)):
        return None
    if not _is_layer_norm(norm2):
        return None
    return BlockSpec(
        name,
        block,
        "DistilBERT (post-LN)",
        value=lambda: _linear(parts[2]),
        output=lambda: _linear(parts[3]),
        pre_norm=None,
        post_norm=norm1,
        second_norm=norm2,
        value_module=parts[2],
        output_module=parts[3],
    )


def _gpt2(name: str, block: nn.Module) -> BlockSpec | None:
    ln_1, ln_2 = _get(block, "ln_1"), _get(block, "ln_2")
    c_attn, c_proj = _get(block, "attn.c_attn"), _get(block, "attn.c_proj")
    if not (_is_layer_norm(ln_1) and _is_layer_norm(ln_2)):
        return None
    if not (_is_conv1d(c_attn) and _is_conv1d(c_proj)):
        return None
    if getattr(block, "crossattention", None) is not None:
        return None

    def value() -> tuple[torch.Tensor, torch.Tensor | None]:
        # c_attn computes [q | k | v] = x @ W + b; the values are the last third.
        width = c_attn.weight.shape[1] // 3
        weight = c_attn.weight.detach()[:, 2 * width :]
        bias = _tensor(c_attn, "bias")
        return weight, None if bias is None else bias[2 * width :]

    def output() -> tuple[torch.Tensor, torch.Tensor | None]:
        return c_proj.weight.detach(), _tensor(c_proj, "bias")

    return BlockSpec(
        name,
        block,
        "GPT-2 (pre-LN)",
        value,
        output,
        pre_norm=ln_1,
        post_norm=None,
        second_norm=None,
    )


def _vit(name: str, block: nn.Module) -> BlockSpec | None:
    # transformers 4 nests the projections (attention.attention.value,
    # attention.output.dense); transformers 5 flattens them (attention.v_proj, o_proj).
    for value_path, output_path in (
        ("attention.attention.value", "attention.output.dense"),
        ("attention.v_proj", "attention.o_proj"),
    ):
        value, dense = _get(block, value_path), _get(block, output_path)
        if _is_linear(value) and _is_linear(dense):
            break
    else:
        return None
    before, after = _get(block, "layernorm_before"), _get(block, "layernorm_after")
    if not (_is_layer_norm(before) and _is_layer_norm(after)):
        return None
    return BlockSpec(
        name,
        block,
        "ViT (pre-LN)",
        value=lambda: _linear(value),
        output=lambda: _linear(dense),
        pre_norm=before,
        post_norm=None,
        second_norm=None,
        value_module=value,
        output_module=dense,
    )


def _encoder_layer(name: str, block: nn.Module) -> BlockSpec | None:
    if not isinstance(block, nn.TransformerEncoderLayer):
        return None
    attention = block.self_attn
    norm1, norm2 = block.norm1, block.norm2
    if not (_is_layer_norm(norm1) and _is_layer_norm(norm2)):
        return None

    def value() -> tuple[torch.Tensor, torch.Tensor | None]:
        d = attention.embed_dim
        packed = _tensor(attention, "in_proj_weight")  # None when q, k, v widths differ
        separate = _tensor(attention, "v_proj_weight")
        weight = packed[2 * d :] if packed is not None else separate
        assert weight is not None
        bias = _tensor(attention, "in_proj_bias")
        return weight.T, None if bias is None else bias[2 * d :]

    def output() -> tuple[torch.Tensor, torch.Tensor | None]:
        return _linear(attention.out_proj)

    first = bool(block.norm_first)
    return BlockSpec(
        name,
        block,
        "nn.TransformerEncoderLayer (" + ("pre-LN)" if first else "post-LN)"),
        value,
        output,
        pre_norm=norm1 if first else None,
        post_norm=None if first else norm1,
        second_norm=None if first else norm2,
        batch_first=bool(attention.batch_first),
    )


def _fused_pre_ln(name: str, block: nn.Module) -> BlockSpec | None:
    attention = _get(block, "attn")
    if not isinstance(attention, nn.Module):
        return None
    for first, second in (("ln_1", "ln_2"), ("norm1", "norm2")):
        before, after = _get(block, first), _get(block, second)
        if _is_layer_norm(before) and _is_layer_norm(after):
            break
    else:
        return None
    for fused_name, output_name in (("c_attn", "c_proj"), ("qkv", "proj")):
        fused, dense = _get(attention, fused_name), _get(attention, output_name)
        if _is_linear(fused) and _is_linear(dense):
            break
    else:
        return None
    width = fused.in_features
    if fused.out_features != 3 * width or dense.out_features != width:
        return None
    layer_scale = _get(block, "ls1")
    if layer_scale is not None and not isinstance(layer_scale, nn.Identity):
        return None  # a LayerScale multiplies the attention output: not decomposed here

    def value() -> tuple[torch.Tensor, torch.Tensor | None]:
        # The fused layer computes [q | k | v] = x @ W.T + b; the values are the last third.
        weight, bias = _linear(fused)
        return weight[:, 2 * width :], None if bias is None else bias[2 * width :]

    return BlockSpec(
        name,
        block,
        "pre-LN, fused query-key-value",
        value,
        output=lambda: _linear(dense),
        pre_norm=before,
        post_norm=None,
        second_norm=None,
        checked=attention,
    )


#: A Llama-family decoder layer's norm before its attention and the one after its residual sum.
_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")


def _llama(name: str, block: nn.Module) -> BlockSpec | None:
    before, after = (_get(block, part) for part in _LLAMA_NORMS)
    if not all(_is_rms_norm(norm) or _is_layer_norm(norm) for norm in (before, after)):
        return None
    projections = [_get(block, f"self_attn.{p}_proj") for p in "qkvo"]
    if not all(_is_linear(p) for p in projections):
        return None
    value, dense = projections[2], projections[3]
    if dense.out_features != value.in_features:  # o_proj writes back to the stream
        return None
    # Gemma 2 and 3 normalise the attention's output before the residual sum (and the
    # MLP's around it): more than attention and a residual, not decomposed here.
    extra_norms = [
        child
        for part, child in block.named_children()
        if part not in _LLAMA_NORMS and "norm" in type(child).__name__.lower()
    ]
    if extra_norms:
        return None
    return BlockSpec(
        name,
        block,
        "Llama-family (RMSNorm pre-norm)",
        value=lambda: _linear(value),
        output=lambda: _linear(dense),
        pre_norm=before,
        post_norm=None,
        second_norm=None,
        stream=after,
        value_module=value,
    )


_RECOGNISERS = (_encoder_layer, _bert, _distilbert, _gpt2, _vit, _fused_pre_ln, _llama)


def _drops_out(module: nn.Module) -> bool:
    """Tell an ``nn.Dropout``, or an attention dropping weights itself in training mode.

    Hugging Face attentions apply their ``attention_dropout`` rate functionally.
    """
    if isinstance(module, nn.Dropout):
        return module.p > 0
    rate = getattr(module, "attention_dropout", None)
    return isinstance(rate, float | int) and not isinstance(rate, bool) and rate > 0


def find_blocks(model: nn.Module) -> list[BlockSpec]:
    """Recognise the model's attention blocks; refuse attention outside any of them.

    Raises
    ------
    ValueError
        If no supported block is found, an attention module lies outside every
        supported block (its contribution could not be decomposed), or dropout is active
        inside a block (training mode).
    """
    blocks: list[BlockSpec] = []
    inside: set[int] = set()
    # The blocks are those holding the model's attention sites (the one rule of
    # _torch_hooks); each is recognised by its structure.
    for site in attention_sites(model):
        if site.block is None or site.block_name is None or id(site.block) in inside:
            continue
        for recognise in _RECOGNISERS:
            spec = recognise(site.block_name, site.block)
            if spec is not None:
                blocks.append(spec)
                inside.update(id(m) for m in site.block.modules())
                break
    stray = [
        f"{name or '(the model)'} ({type(module).__name__})"
        for name, module in attention_modules(model)
        if id(module) not in inside
    ]
    training = [
        f"{spec.name}.{name}" if name else spec.name
        for spec in blocks
        for name, module in spec.block.named_modules()
        if module.training and _drops_out(module)
    ]
    if training:
        msg = (
            f"capture(contributions=...) needs the model in eval mode: dropout is active in "
            f"{training[0]} (training mode), so the block's output is not the sum of its "
            "token terms. Call model.eval() first."
        )
        raise ValueError(msg)
    if stray or not blocks:
        where = (
            f"attention outside any supported block: {', '.join(stray[:3])}"
            if stray
            else "no supported attention block"
        )
        msg = (
            f"capture(contributions=...) found {where} in {type(model).__name__}; "
            f"value-aware contributions are computed for {SUPPORTED_BLOCKS}. Capture the "
            "attention weights instead (capture(model) without contributions=)."
        )
        raise ValueError(msg)
    return blocks


def _first_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    for name in ("hidden_states", "src", "x"):
        if name in kwargs:
            return kwargs[name]
    return None


@dataclass
class _Running:
    """The pieces of the block being run."""

    spec: BlockSpec
    residual: torch.Tensor | None = None
    attention_input: torch.Tensor | None = None
    weights: list[torch.Tensor] = field(default_factory=list)
    second_input: torch.Tensor | None = None
    expected: torch.Tensor | None = None
    """What the rebuilt output must equal (blocks recognised by convention)."""
    projected: list[torch.Tensor] = field(default_factory=list)
    """The value projection's outputs (`BlockSpec.value_module`)."""
    projections: list[torch.Tensor] = field(default_factory=list)
    """The output projection's outputs (`BlockSpec.output_module`)."""


class BlockRecorder:
    """Hooks on the supported blocks; one matrix (and rebuilt output) per block call."""

    def __init__(self, blocks: list[BlockSpec], method: Method) -> None:
        self.blocks = blocks
        self.method: Method = method
        self.matrices: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.errors: list[str] = []
        self._running: _Running | None = None

    def install(self, hooks: Hooks) -> None:
        """Register the hooks on the blocks through `hooks`, which removes them."""
        for spec in self.blocks:
            hooks.before(spec.block, self._entering(spec), with_kwargs=True)
            hooks.after(spec.block, self._leaving, always_call=True)
            if spec.pre_norm is not None:
                hooks.after(spec.pre_norm, self._normalised)
            if spec.second_norm is not None and uses_second_norm(self.method):
                hooks.before(spec.second_norm, self._second)
            if spec.checked is not None:
                hooks.after(spec.checked, self._attended)
            if spec.stream is not None:
                hooks.before(spec.stream, self._summed)
            if spec.value_module is not None:
                hooks.after(spec.value_module, self._projected)
            if spec.output_module is not None and spec.checked is None and spec.stream is None:
                hooks.after(spec.output_module, self._projection)

    def clear(self) -> None:
        """Forget earlier model calls (the capture keeps the last one)."""
        self.matrices.clear()
        self.outputs.clear()
        self.errors.clear()
        self._running = None

    # -- hooks ----------------------------------------------------------------------------
    def _entering(self, spec: BlockSpec) -> Callable[..., None]:
        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: ARG001
            residual = _first_argument(args, kwargs)
            if not isinstance(residual, torch.Tensor):
                self.errors.append(f"{spec.name}: no hidden-state tensor in the block's call")
                self._running = None
                return
            self._running = _Running(spec, residual=self._batch_first(spec, residual.detach()))

        return enter

    def _normalised(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:  # noqa: ARG002
        if self._running is not None and isinstance(output, torch.Tensor):
            self._running.attention_input = self._batch_first(self._running.spec, output.detach())

    def _second(self, module: nn.Module, args: tuple[Any, ...]) -> None:  # noqa: ARG002
        if self._running is not None and args and isinstance(args[0], torch.Tensor):
            self._running.second_input = self._batch_first(self._running.spec, args[0].detach())

    def _attended(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:  # noqa: ARG002
        if isinstance(output, tuple | list) and output:
            output = output[0]
        running = self._running
        if (
            running is not None
            and running.residual is not None
            and isinstance(output, torch.Tensor)
        ):
            attended = self._batch_first(running.spec, output.detach())
            running.expected = running.residual + attended

    def _summed(self, module: nn.Module, args: tuple[Any, ...]) -> None:  # noqa: ARG002
        if self._running is not None and args and isinstance(args[0], torch.Tensor):
            self._running.expected = self._batch_first(self._running.spec, args[0].detach())

    def _projected(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:  # noqa: ARG002
        if self._running is not None and isinstance(output, torch.Tensor):
            self._running.projected.append(output.detach())

    def _projection(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:  # noqa: ARG002
        if self._running is not None and isinstance(output, torch.Tensor):
            self._running.projections.append(output.detach())

    def record(self, weights: torch.Tensor) -> bool:
        """Take the attention weights of the running block; False if no block runs."""
        if self._running is None:
            return False
        self._running.weights.append(weights.detach())
        return True

    def _leaving(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:  # noqa: ARG002
        running, self._running = self._running, None
        if running is None:
            return
        try:
            self._finish(running)
        finally:
            running.weights.clear()  # the per-head tensors go with their layer
            running.projected.clear()
            running.projections.clear()

    # -- the matrix of one block ------------------------------------------------------------
    @staticmethod
    def _batch_first(spec: BlockSpec, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim == 2:  # an unbatched call of nn.TransformerEncoderLayer
            return tensor[None]
        return tensor if spec.batch_first else tensor.transpose(0, 1)

    def _finish(self, running: _Running) -> None:
        spec = running.spec
        if len(running.weights) != 1:
            self.errors.append(
                f"{spec.name}: {len(running.weights)} attention calls in one block (expected "
                "exactly one self-attention)"
            )
            return
        residual = running.residual
        attention_input = residual if spec.pre_norm is None else running.attention_input
        if residual is None or attention_input is None:
            self.errors.append(f"{spec.name}: the attention's input was not seen")
            return
        weights = running.weights[0]
        if weights.ndim == 3:
            weights = weights[None]
        value_weight, value_bias = spec.value()
        output_weight, output_bias = spec.output()
        heads = weights.shape[-3]
        # Grouped-query attention: fewer value heads than query heads, of the same width.
        value_width, output_width = value_weight.shape[1], output_weight.shape[0]
        value_heads = None
        if value_width != output_width:
            if (heads * value_width) % output_width != 0:
                self.errors.append(
                    f"{spec.name}: {heads} query heads write {output_width} values into the "
                    f"output projection, but the value projection has {value_width}, not a "
                    "whole number of heads of that width"
                )
                return
            value_heads = heads * value_width // output_width
        second = spec.second_norm if uses_second_norm(self.method) else None
        # Post-LN blocks: GlobEnc's and ALTI's terms read the values after the LayerNorms'
        # centring and gains, folded into the output projection (the norm-based rule reads
        # the values before them).
        folded = folds_post_norms(self.method) and spec.post_norm is not None
        norms = (spec.post_norm, second) if folded else ()
        centred_by = [_tensor(norm, "weight") for norm in norms if norm is not None]
        # What the model's own projections computed, handed over by their hooks where they
        # ran once in this block: the values z W_V + b_V, and (blocks of known structure)
        # the attention's output plus b_O.
        projected = _only(running.projected, (*attention_input.shape[:-1], value_width))
        handed = _only(running.projections, tuple(residual.shape))
        inputs = attention_input if projected is None else projected
        pathway: dict[str, Any] = {
            "heads": heads,
            "value_heads": value_heads,
            "value_bias": value_bias if projected is None else None,
            "projected": projected is not None,
        }
        with torch.no_grad():
            if handed is None:
                # The heads' contexts projected once, not the sum over the values in d
                # dimensions; the values projected once for both.
                values, attended = head_values_and_attention_output(
                    weights, inputs, value_weight, output_weight, centred_by=centred_by, **pathway
                )
                bias = output_bias
            else:
                # The model's attention output, its bias included: the bias enters only the
                # rebuilt output, summed with the attention's, so the core takes none.
                host = _host_fold(output_weight, centred_by)
                values, _ = head_values_and_attention_output(
                    None,
                    inputs,
                    value_weight,
                    output_weight if host is None else host,
                    centred_by=centred_by if host is None else (),
                    **pathway,
                )
                attended, bias = handed, None
            pieces = [weights, values, residual, bias, attended, running.second_input]
            norm_pieces = [_parameters(spec.post_norm), _parameters(second)]
            # On host memory the core's per-token work runs in NumPy (one thread, no
            # parallel operation waiting for torch's second thread to be scheduled); its
            # kernel still runs on torch's threads.
            on_host = _on_host(pieces, norm_pieces)
            if on_host:
                pieces = [None if t is None else t.numpy() for t in pieces]
                norm_pieces = [_host_norm(p) for p in norm_pieces]
            alpha, values, residual, bias, attended, second_input = pieces
            matrix, output = contributions_and_outputs(
                alpha,
                values,
                residual,
                method=self.method,
                bias=bias,
                norm=norm_pieces[0],
                second_norm=norm_pieces[1],
                second_norm_input=None if second is None else second_input,
                attended=attended,
                normalised_values=folded,
                threads=torch.get_num_threads(),  # the kernel's share of the cores: torch's
                team=_intra_op_team(),  # and torch's own threads, where they are OpenMP's
            )
            if on_host:
                matrix, output = torch.from_numpy(matrix), torch.from_numpy(output)
        checked = spec.checked is not None or spec.stream is not None
        if checked and not self._matches(running, output):
            return
        self.matrices.append(matrix)
        self.outputs.append(output)

    def _matches(self, running: _Running, rebuilt: torch.Tensor) -> bool:
        """Whether the rebuilt output is what the model summed (see `BlockSpec.stream`)."""
        spec = running.spec
        expected = running.expected
        if expected is None:
            self.errors.append(f"{spec.name}: {_reference(spec)} was not seen")
            return False
        if expected.shape != rebuilt.shape:
            self.errors.append(
                f"{spec.name}: {_reference(spec)} has shape {tuple(expected.shape)}, the "
                f"rebuilt output {tuple(rebuilt.shape)}"
            )
            return False
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        error = float((rebuilt - expected).abs().max()) if expected.numel() else 0.0
        eps = float(torch.finfo(rebuilt.dtype).eps) if rebuilt.is_floating_point() else 0.0
        # A few hundred roundings of the largest value; a missed term is far larger.
        if error > 1024 * eps * max(scale, 1.0):
            self.errors.append(
                f"{spec.name}: the token terms sum to within {error:.3g} of "
                f"{_reference(spec)} (largest value {scale:.3g}); the block does more than "
                "attention and a residual (e.g. a LayerScale, a gate or a norm on the "
                "attention's output)"
            )
            return False
        return True


def _intra_op_team() -> OpenMPTeam | None:
    """PyTorch's intra-op threads as an OpenMP team, or None where torch does not use OpenMP.

    Between two parallel operations, the threads of libgomp's team spin for a while
    before they sleep; the value-aware kernel run on attnflow's own threads between two
    layers would share the cores with them. Run on the team itself, the kernel's ranges
    go to threads that are already waiting.
    """
    if torch.get_num_threads() < 2 or "parallel backend: OpenMP" not in _parallel_info():
        return None
    return openmp_team(within=Path(torch.__file__).parent)  # torch/lib/libgomp.so.1 (wheels)


_PARALLEL_INFO: list[str] = []


def _parallel_info() -> str:
    """``torch.__config__.parallel_info()``, read once (it does not change in a process)."""
    if not _PARALLEL_INFO:
        _PARALLEL_INFO.append(torch.__config__.parallel_info())
    return _PARALLEL_INFO[0]


def _reference(spec: BlockSpec) -> str:
    """Name what a block recognised by convention is checked against."""
    seen = spec.stream if spec.stream is not None else spec.checked
    part = next((p for p, m in spec.block.named_modules() if m is seen), "")
    where = f"{spec.name}.{part}" if part else spec.name
    if spec.stream is not None:
        return f"the input of {where}"
    return f"the block input plus {where}'s output"


def _only(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """Return the one tensor a hook saw in this block, if of the given shape, else None."""
    if len(tensors) != 1 or tuple(tensors[0].shape) != shape:
        return None
    return tensors[0]


_HOST_DTYPES = (torch.float32, torch.float64)


def _on_host(tensors: list[torch.Tensor | None], norms: list[Any]) -> bool:
    """Whether every piece is a CPU tensor of one float32 or float64 dtype (NumPy views)."""
    every = [t for t in tensors if t is not None]
    every += [t for norm in norms if norm is not None for t in norm[:2] if t is not None]
    return all(
        t.device.type == "cpu"
        and t.dtype == every[0].dtype
        and t.dtype in _HOST_DTYPES
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
        and t.layout == torch.strided
        for t in every
    )


def _host_norm(norm: Any) -> Any:
    if norm is None:
        return None
    weight, bias, eps = norm
    return (
        None if weight is None else weight.numpy(),
        None if bias is None else bias.numpy(),
        eps,
    )


def _host_fold(weight: torch.Tensor, gains: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``W_O C Γ_1 ⋯`` folded in NumPy on host memory (no parallel operations), or None.

    The LayerNorms' centring and gains folded into the output projection
    (:func:`attnflow._contributions.head_values_and_attention_output`, `centred_by`),
    a ``(H d_head, d)`` matrix: a fraction of a millisecond of work that would be three
    parallel operations per LayerNorm in torch. None off the CPU (the core folds it there).
    """
    if not gains or not _on_host([weight, *gains], []):
        return None
    arrays = [None if g is None else g.numpy() for g in gains]
    return torch.from_numpy(_fold_centring(weight.numpy(), arrays, np))


def _parameters(norm: nn.LayerNorm | None) -> LayerNormTuple | None:
    if norm is None:
        return None
    return _tensor(norm, "weight"), _tensor(norm, "bias"), float(norm.eps)
