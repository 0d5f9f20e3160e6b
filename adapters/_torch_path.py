"""``explain(..., blockwise=None)``: which path runs, from a cost and memory estimate.

The estimate, for a causal LM of ``L`` attention layers with ``H`` query heads each,
hidden size ``D`` and MLP size ``M``, on ``b`` sequences of ``n`` tokens, in float32 bytes:

- materialised peak: the captured weights ``4 b L H n^2`` (rollout and flow fuse heads while
  capturing: ``4 b L n^2``), twice that for gradient rollout (weights and their
  gradients), plus one layer's scores ``4 b H n^2`` in flight;
- blockwise peak: each layer's saved input ``4 b L n D`` plus one block of scores (at
  most ``BLOCK_BYTES``); gradient rollout adds the model's own backward, about ``4 b L n (2D +
  M)``.

The rule:

1. A path whose estimated peak exceeds the memory left (``available_bytes``) is never
   taken: the materialised path needs its peak within :data:`MEMORY_SHARE` of it, and when
   the blockwise path does not fit either (its own finer estimate) the call is refused
   before the model runs.
2. Otherwise the cheaper one: on a CUDA device the materialised path (capture costs about
   1.1 times a forward there, the blockwise rows 1.7 to 2.9 times: docs/llms.md); on a CPU
   the blockwise path from :data:`CPU_BLOCKWISE_FROM` tokens on (measured on SmolLM2, one
   thread: equal at 128 and 384 tokens, blockwise 1.4 times faster for rollout and 1.3
   times for gradient rollout at 1,024), the materialised one below.

The decision and its figures are logged (logger ``attnflow``, level INFO).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from attnflow._methods import method_spec

__all__ = ["CPU_BLOCKWISE_FROM", "MEMORY_SHARE", "PathEstimate", "choose_path", "estimate"]

#: On a CPU, the blockwise path runs from this many tokens on.
CPU_BLOCKWISE_FROM = 512
#: The materialised path runs only while its estimated peak is within this share of the
#: memory left.
MEMORY_SHARE = 0.25
#: Bytes of one block of scores (the blockwise path's working set), as _torch_blockwise.
BLOCK_BYTES = 32 * 2**20

LOGGER = logging.getLogger("attnflow")


@dataclass(frozen=True)
class PathEstimate:
    """Estimated peaks (bytes) of both paths, the memory left and the decision."""

    materialised: int
    blockwise: int
    available: int
    blockwise_chosen: bool
    reason: str


def _sizes(model: nn.Module) -> tuple[int, int, int, int]:
    """``(layers, query heads per layer, hidden size, MLP size)`` from the model's config."""
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    config = get() if callable(get) else config
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    mlp = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    return layers, heads, hidden, mlp


def estimate(
    model: nn.Module, method: str, batch: int, n: int, available: int, *, device_type: str
) -> PathEstimate:
    """Estimate both paths' peaks and choose by the rule of this module's docstring.

    Examples
    --------
    >>> import transformers
    >>> config = transformers.LlamaConfig(
    ...     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    ...     hidden_size=576, intermediate_size=1536, vocab_size=32,
    ... )
    >>> model = transformers.LlamaForCausalLM(config)
    >>> e = estimate(model, "gradient_rollout", 1, 1024, 16 * 2**30, device_type="cpu")
    >>> round(e.materialised / 2**30, 2), round(e.blockwise / 2**30, 2), e.blockwise_chosen
    (2.14, 0.4, True)
    >>> estimate(model, "rollout", 1, 256, 16 * 2**30, device_type="cpu").blockwise_chosen
    False
    """
    layers, heads, hidden, mlp = _sizes(model)
    square = 4 * batch * n * n
    block = min(BLOCK_BYTES, heads * square)
    if method_spec(method).gradients:  # the weights, their gradients and the graph
        materialised = 2 * layers * heads * square + heads * square
        blockwise = 4 * batch * layers * n * (hidden + 2 * hidden + mlp) + block
    else:
        materialised = layers * square + heads * square
        blockwise = 4 * batch * layers * n * hidden + block
    if materialised > MEMORY_SHARE * available:
        chosen, reason = True, "the materialised peak would exceed a quarter of the memory left"
    elif device_type == "cuda":
        chosen, reason = False, "on a GPU capturing is cheaper and fits"
    elif n >= CPU_BLOCKWISE_FROM:
        chosen, reason = True, f"on a CPU from {CPU_BLOCKWISE_FROM} tokens blockwise is cheaper"
    else:
        chosen, reason = False, f"on a CPU below {CPU_BLOCKWISE_FROM} tokens capturing is cheaper"
    return PathEstimate(materialised, blockwise, available, chosen, reason)


def choose_path(
    model: nn.Module, method: str, batch: int, n: int, available: int, *, device_type: str
) -> bool:
    """Return True for the blockwise path, and log the choice with its figures.

    When the materialised path does not fit, the blockwise one is chosen; its own, finer
    estimate (``_torch_blockwise``) refuses the call before the model runs if it does not
    fit either.
    """
    found = estimate(model, method, batch, n, available, device_type=device_type)
    gib = 2**30
    figures = (
        f"estimated peaks: materialised {found.materialised / gib:.3g} GiB, blockwise "
        f"{found.blockwise / gib:.3g} GiB; memory left {found.available / gib:.3g} GiB"
    )
    path = "blockwise" if found.blockwise_chosen else "materialised (captured weights)"
    LOGGER.info(
        "explain(method=%r, blockwise=None) on %d x %d tokens: the %s path, %s (%s)",
        method,
        batch,
        n,
        path,
        found.reason,
        figures,
    )
    return found.blockwise_chosen
