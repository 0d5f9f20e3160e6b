"""A Quantus ``explain_func`` for vision transformers: attention maps as pixel maps.

Quantus metrics take an explanation function ``explain_func(model, inputs, targets,
**explain_func_kwargs)`` that returns one attribution map per image; they call it on the
original and on perturbed images. :func:`explain_func` computes attention rollout (or flow,
or gradient rollout for the target class) of a PyTorch vision transformer with attnflow,
takes the row of the [CLS] token and the columns of the patch tokens only ([CLS],
register and distillation tokens are left out), lays the patches on their grid and
upsamples the grid to the image::

    import quantus
    from attnflow.integrations.quantus import explain_func

    metric = quantus.MaxSensitivity(nr_samples=5)
    scores = metric(
        model=vit, x_batch=images, y_batch=labels, device="cpu",
        explain_func=explain_func, explain_func_kwargs={"method": "rollout"},
    )

Quantus is called, never vendored (it is LGPL-3); this module imports only PyTorch and
attnflow, so the function works without Quantus installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ._patches import pixel_maps, prefix_tokens_of, token_scores

__all__ = ["explain_func"]


def explain_func(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    method: str = "rollout",
    row: int = 0,
    prefix_tokens: int | None = None,
    interpolate: str = "nearest",
    device: str | torch.device | None = None,
    **options: Any,
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Attention maps of a vision transformer, upsampled to pixels, for Quantus.

    Parameters
    ----------
    model : torch.nn.Module
        The vision transformer, called as ``model(images)`` and returning logits.
    inputs : array_like
        Images ``(batch, channels, height, width)`` (NumPy, as Quantus passes them, or a
        Tensor), or ``(batch, height, width)`` for a model that takes grey images so.
    targets : array_like
        One class per image. Used by ``method="gradient_rollout"`` (the logit explained);
        rollout and flow do not depend on the class.
    method : {"rollout", "flow", "gradient_rollout"}, default "rollout"
        The attnflow method.
    row : int, default 0
        The token whose attention is followed down (0 = [CLS]; 1 for the distillation
        token of a DeiT).
    prefix_tokens : int, optional
        The tokens before the patches: [CLS], registers, distillation. Default: the
        model's ``num_prefix_tokens`` (timm) if it has one, else 1.
    interpolate : {"nearest", "bilinear", "bicubic"}, default "nearest"
        How the patch grid is upsampled to the image.
    device : str or torch.device, optional
        Where the images are sent (Quantus passes its own ``device``); default: the
        device of the model's first parameter, or the CPU.
    **options
        attnflow options: ``heads``, ``residual``, ``layers`` (``"last"`` or one index),
        ``normalize_result`` (flow), ``rule`` (gradient rollout) ...

    Returns
    -------
    numpy.ndarray
        float32 ``(batch, 1, height, width)`` (``(batch, height, width)`` for 3-d
        `inputs`): each pixel carries its patch's share of the explained row.

    Raises
    ------
    ValueError
        On images that are not 3-d or 4-d, a bad option, or a token count that tiles no
        patch grid of the image (before the model runs, where it can be told).

    Examples
    --------
    A two-layer ViT on 4x6 images cut into 2x2 patches (a 2 x 3 grid):

    >>> import numpy as np
    >>> import torch
    >>> from attnflow.integrations.quantus import explain_func
    >>> class ViT(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Conv2d(1, 8, kernel_size=2, stride=2)
    ...         self.cls = torch.nn.Parameter(torch.zeros(1, 1, 8))
    ...         layer = torch.nn.TransformerEncoderLayer(8, 2, batch_first=True)
    ...         self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ...         self.head = torch.nn.Linear(8, 3)
    ...
    ...     def forward(self, x):
    ...         patches = self.embed(x).flatten(2).transpose(1, 2)
    ...         tokens = torch.cat([self.cls.expand(len(x), -1, -1), patches], 1)
    ...         return self.head(self.encoder(tokens)[:, 0])
    >>> maps = explain_func(ViT().eval(), np.random.rand(2, 1, 4, 6), np.array([0, 2]))
    >>> maps.shape, maps.dtype
    ((2, 1, 4, 6), dtype('float32'))
    >>> bool((maps[:, :, :2, :2] == maps[:, :, :1, :1]).all())  # one value per patch
    True
    """
    images = torch.as_tensor(np.asarray(inputs) if not torch.is_tensor(inputs) else inputs)
    if images.ndim not in (3, 4):
        msg = (
            "`inputs` must be images (batch, channels, height, width) or (batch, height, "
            f"width); got shape {tuple(images.shape)}. Pass channels first."
        )
        raise ValueError(msg)
    prefix = prefix_tokens_of(model, prefix_tokens)
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    images = images.to(device=device, dtype=torch.float32)
    labels = None
    if method == "gradient_rollout":
        labels = torch.as_tensor(np.asarray(targets)).reshape(-1).to(torch.int64)
    scores = token_scores(model, [images], method=method, row=row, target=labels, options=options)
    maps = pixel_maps(
        scores,
        prefix_tokens=prefix,
        size=(images.shape[-2], images.shape[-1]),
        interpolate=interpolate,
    )
    if images.ndim == 4:
        maps = maps[:, None]
    return maps.cpu().numpy().astype(np.float32)
