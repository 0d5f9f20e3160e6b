"""Checks of a model's inputs before it runs: what would otherwise fail deep inside it.

An empty sequence, a token id beyond the vocabulary, a KV cache handed to a whole-sequence
explanation, a sequence longer than the model's positions and an attention kernel that is
not installed each fail inside the model with a message about its internals ("cannot
reshape tensor of 0 elements", "index out of range in self", a shape of the attention,
transformers' ``kernels`` ImportError), or, for the length, not at all. Each is refused
here, before the model runs, with one line naming the input and the fix.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["check_model_inputs"]

#: Arguments that hand the model a KV cache of earlier tokens (transformers 4 and 5).
_CACHES = ("past_key_values", "cache", "cache_params")
_FLASH = {
    "flash_attention_2": "is_flash_attn_2_available",
    "flash_attention_3": "is_flash_attn_3_available",
}


def _input_ids(inputs: object) -> torch.Tensor | None:
    if isinstance(inputs, torch.Tensor):
        return inputs if not inputs.is_floating_point() else None
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        return ids if isinstance(ids, torch.Tensor) else None
    return None


def _vocabulary(model: nn.Module) -> int | None:
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        try:
            layer = embeddings()
        except (NotImplementedError, AttributeError):
            layer = None
        if isinstance(layer, nn.Embedding):
            return int(layer.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _positions(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _missing_kernel(model: nn.Module) -> str | None:
    """Return the flash-attention implementation named whose kernels are not installed."""
    implementations = {
        getattr(getattr(module, "config", None), "_attn_implementation", None)
        for module in model.modules()
    }
    implementations.add(getattr(getattr(model, "config", None), "_attn_implementation", None))
    for name, probe in _FLASH.items():
        if name in implementations and not _kernels_installed(probe):
            return name
    return None


def _kernels_installed(probe: str) -> bool:
    """Whether flash-attn (transformers' `probe`) or the `kernels` package is installed."""
    try:
        import transformers.utils as hf_utils

        if bool(getattr(hf_utils, probe, lambda: False)()):
            return True
    except ImportError:
        pass
    return importlib.util.find_spec("kernels") is not None


def check_model_inputs(model: nn.Module, inputs: object, *, where: str = "explain") -> None:
    """Refuse, before the model runs, inputs that would fail inside it or run out of range.

    Parameters
    ----------
    model : torch.nn.Module
        The model about to run.
    inputs : mapping, sequence or tensor
        What it runs on; only ``input_ids`` (or an integer tensor) and cache arguments are
        looked at.
    where : str
        The function checking, named in the errors.

    Raises
    ------
    ValueError
        On an empty sequence, token ids outside the vocabulary, a KV cache in the inputs,
        a sequence longer than the model's positions (``max_position_embeddings``), or a
        flash-attention implementation whose kernels are not installed.

    Examples
    --------
    >>> import torch
    >>> from attnflow.adapters._torch_inputs import check_model_inputs
    >>> model = torch.nn.Embedding(10, 4)
    >>> check_model_inputs(model, torch.tensor([[1, 2, 3]]))
    >>> check_model_inputs(model, torch.zeros(1, 0, dtype=torch.long))
    Traceback (most recent call last):
    ...
    ValueError: `inputs` holds no token: input_ids of shape (1, 0); explain() needs one token at least.
    """
    if isinstance(inputs, Mapping):
        given = [name for name in _CACHES if inputs.get(name) is not None]
        if given:
            msg = (
                f"`inputs` holds {given[0]!r}: {where}() runs the whole sequence and reads its "
                "attention from the first token, which a KV cache of earlier tokens would hide. "
                "Drop it and pass every token's input_ids (explain_generation follows "
                "generation step by step)."
            )
            raise ValueError(msg)
    ids = _input_ids(inputs)
    if ids is not None:
        if ids.ndim == 0 or ids.numel() == 0 or ids.shape[-1] == 0:
            msg = (
                f"`inputs` holds no token: input_ids of shape {tuple(ids.shape)}; {where}() "
                "needs one token at least."
            )
            raise ValueError(msg)
        vocabulary = _vocabulary(model)
        if vocabulary is not None and ids.device.type != "meta":
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocabulary:
                bad = low if low < 0 else high
                msg = (
                    f"`inputs` holds token id {bad}, outside the model's vocabulary of "
                    f"{vocabulary} (ids 0 to {vocabulary - 1}); encode the text with the "
                    "model's own tokenizer."
                )
                raise ValueError(msg)
        limit = _positions(model)
        if limit is not None and ids.shape[-1] > limit:
            msg = (
                f"`inputs` has {ids.shape[-1]} tokens, more than the model's {limit} positions "
                "(max_position_embeddings): it was never trained on positions past them. "
                f"Shorten the input to {limit} tokens (a tokenizer's truncation=True, "
                f"max_length={limit})."
            )
            raise ValueError(msg)
    kernel = _missing_kernel(model)
    if kernel is not None:
        msg = (
            f"{type(model).__name__} uses attn_implementation={kernel!r}, whose kernels are not "
            "installed here (neither flash-attn nor the `kernels` package). Load the model "
            "with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa')), "
            "which attnflow can read."
        )
        raise ValueError(msg)
