"""``explain(..., rows=-1)`` on a right-padded batch: each sequence's last real token.

The padding mask (``inputs["attention_mask"]`` or the `mask` option) tells where each
sequence's real tokens end; :func:`attnflow._real_rows.group_by_real_end` groups the
sequences by the padding after them, and each group is explained on its own sub-batch
(the same padded length, so the same values as in the whole batch) with its rows as
positions. The results are put back in the batch's order. Left-padded and unpadded batches,
and non-negative rows, are explained as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from attnflow._real_rows import group_by_real_end, trailing_padding

__all__ = ["explain_by_real_end"]


def _mask_of(inputs: object, options: Mapping[str, Any]) -> torch.Tensor | None:
    mask = options.get("mask")
    if mask is None and isinstance(inputs, Mapping):
        mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return None
    return mask.bool()


def _take(value: Any, index: torch.Tensor, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == batch:
        return value.index_select(0, index.to(value.device))
    return value


def explain_by_real_end(
    explain: Callable[..., torch.Tensor],
    inputs: Any,
    rows: Any,
    target: Any,
    options: Mapping[str, Any],
) -> torch.Tensor | None:
    """Explain a right-padded batch group by group; None where the batch needs no split.

    `explain` is called as ``explain(sub_inputs, rows=..., target=..., **sub_options)``
    on each group.
    """
    if rows is None or isinstance(rows, bool):
        return None
    mask = _mask_of(inputs, options)
    if mask is None:
        return None
    batch, n = int(mask.shape[0]), int(mask.shape[1])
    rows_list = mask.cpu().tolist()
    groups = group_by_real_end(
        rows, trailing_padding(rows_list), n, real=[sum(r) for r in rows_list]
    )
    if groups is None:
        return None
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for group in groups:
        index = torch.tensor(group.indices)
        sub_inputs: Any = inputs
        if isinstance(inputs, Mapping):
            sub_inputs = {k: _take(v, index, batch) for k, v in inputs.items()}
        sub_target = target
        if isinstance(target, torch.Tensor) and target.ndim == 1:
            sub_target = _take(target, index, batch)
        elif isinstance(target, Sequence) and len(target) == batch:
            sub_target = [target[i] for i in group.indices]
        # Only the mask option is per sequence (head weights may have `batch` rows too).
        sub_options = {k: _take(v, index, batch) if k == "mask" else v for k, v in options.items()}
        rows_given = group.rows if isinstance(group.rows, int) else list(group.rows)
        parts.append(explain(sub_inputs, rows=rows_given, target=sub_target, **sub_options))
        order.extend(group.indices)
    result = torch.cat(parts)
    inverse = torch.argsort(torch.tensor(order, device=result.device))
    return result.index_select(0, inverse)
