"""Token scores of a model call, and vision-transformer patch scores as pixel maps (torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from attnflow._methods import method_spec
from attnflow.adapters.torch import explain  # type: ignore[import-not-found,unused-ignore]

from ._options import check_layer_choice

__all__ = [
    "INTERPOLATIONS",
    "METHODS",
    "check_method",
    "pixel_maps",
    "prefix_tokens_of",
    "token_scores",
]

#: The registry's methods the toolkits' attribute calls offer: one map per input, from
#: the attention of one model call (and its gradients).
METHODS = ("rollout", "flow", "gradient_rollout")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


def check_method(method: object) -> None:
    """Refuse an unknown attribution method before the model runs (by the registry)."""
    method_spec(method, among=METHODS)


def token_scores(
    model: nn.Module,
    arguments: Sequence[Any],
    *,
    method: str,
    row: int,
    target: Any,
    options: dict[str, Any],
) -> torch.Tensor:
    """Score every token for the output position `row`: ``(batch, n)``, detached.

    Runs ``model(*arguments)`` once inside :func:`attnflow.adapters.torch.capture`
    (through :func:`attnflow.adapters.torch.explain`); `target` is used by
    ``"gradient_rollout"`` only, the class-agnostic methods ignore it.
    """
    check_method(method)
    check_layer_choice(options.get("layers", "last"))
    if isinstance(row, bool) or not isinstance(row, int):
        msg = (
            f"`row` must be one output position (an int, e.g. 0 for [CLS]); got {row!r}. "
            "Call once per row to explain several."
        )
        raise TypeError(msg)
    extra = {"target": target} if method == "gradient_rollout" else {}
    scores: torch.Tensor = explain(
        model, tuple(arguments), method=method, rows=row, **extra, **options
    )
    return scores.detach()


def prefix_tokens_of(model: nn.Module, given: object) -> int:
    """How many tokens precede the patches: given, timm's ``num_prefix_tokens``, or 1."""
    if given is None:
        # timm's VisionTransformer counts [CLS], register and distillation tokens here.
        found = getattr(model, "num_prefix_tokens", 1)
        given = found if isinstance(found, int) and not isinstance(found, bool) else 1
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        msg = (
            f"`prefix_tokens` must be the number of tokens before the patches (0 or more: "
            f"[CLS], registers, distillation); got {given!r}."
        )
        raise ValueError(msg)
    return given


def pixel_maps(
    scores: torch.Tensor, *, prefix_tokens: int, size: tuple[int, int], interpolate: str
) -> torch.Tensor:
    """Patch-token scores ``(batch, n)`` as pixel maps ``(batch, height, width)``.

    The first `prefix_tokens` columns ([CLS], registers, distillation) are dropped; the
    rest are the patches row by row, on a grid with the image's aspect ratio, upsampled
    to `size`. Values are kept as they are (each patch's share of the explained row).
    """
    if interpolate not in INTERPOLATIONS:
        msg = (
            f'`interpolate` must be "nearest", "bilinear" or "bicubic"; got {interpolate!r}. '
            'Use "nearest" for one constant value per patch.'
        )
        raise ValueError(msg)
    height, width = size
    patches = scores.shape[-1] - prefix_tokens
    rows = round(math.sqrt(patches * height / width)) if patches > 0 else 0
    if rows == 0 or patches % rows or height % rows or width % (patches // rows):
        msg = (
            f"The {scores.shape[-1]} tokens less `prefix_tokens`={prefix_tokens} leave "
            f"{patches} patches, which tile no grid of a {height}x{width} image. Pass the "
            "number of [CLS], register and distillation tokens as `prefix_tokens`."
        )
        raise ValueError(msg)
    grid = scores[..., prefix_tokens:].reshape(-1, 1, rows, patches // rows)
    # "nearest" keeps each patch's value on its own pixels; "bilinear" and "bicubic"
    # smooth across patch borders (bicubic can overshoot the patch values).
    maps = torch.nn.functional.interpolate(grid.float(), size=size, mode=interpolate)
    return maps[:, 0].to(scores.dtype)
