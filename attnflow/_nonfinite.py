"""Unvalidated attention flow on NaN input: NaN out where rollout would give NaN.

Max-flow cannot use a NaN or infinite capacity (igraph reads it as no edge, which
silently gives zeros; the compiled kernel's bounds and comparisons are meaningless on
NaN). With ``validate=False`` flow therefore solves on the finite
capacities (the bad ones zeroed) and then marks as NaN every result that the bad values
reach, by the rule that matrix products follow in rollout: ``(A B)[i, j]`` is NaN when row
``i`` of ``A`` or column ``j`` of ``B`` holds one. Validated input never gets here.
"""

from __future__ import annotations

import numpy as np

__all__ = ["clear_non_finite"]


def _reached(layers: np.ndarray) -> np.ndarray:
    """NaN pattern of the rollout of ``(..., L, n, n)`` boolean "bad" matrices, per layer."""
    below = layers[..., 0, :, :]
    patterns = [below]
    for layer in range(1, layers.shape[-3]):
        below = _bad_row_or_column(layers[..., layer, :, :], below)
        patterns.append(below)
    return np.stack(patterns, axis=-3)


def _on_top(below: np.ndarray | None, top: np.ndarray) -> np.ndarray:
    """NaN pattern of ``top @ rollout_below`` (`below` None: `top` is the first layer)."""
    if below is None:
        return top
    return _bad_row_or_column(top, below)


def _bad_row_or_column(top: np.ndarray, below: np.ndarray) -> np.ndarray:
    """``(top @ below)[i, j]`` is NaN when row ``i`` of `top` or column ``j`` of `below` is."""
    rows = np.any(top, axis=-1, keepdims=True)  # (..., n, 1)
    columns = np.any(below, axis=-2, keepdims=True)  # (..., 1, n)
    return np.asarray(rows | columns)


def clear_non_finite(
    mixed: np.ndarray,
    mixed_heads: np.ndarray | None,
    *,
    rows: tuple[int, ...] | None,
    all_layers: bool,
    whole_rows: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Zero non-finite capacities; say which results they reach.

    Parameters
    ----------
    mixed : ndarray, shape (*batch, L, n, n)
        Host capacities of the used layers (residual mixed, masked).
    mixed_heads : ndarray, shape (*batch, R, H, n, n), or None
        With ``heads="each"``: the reported layers' heads (R = L with `all_layers`, else 1).
    rows : tuple of int or None
        The checked output rows (``Rows.index``; None for all).
    all_layers : bool
        Whether every used layer is reported.
    whole_rows : bool
        Whether output rows are renormalised (a NaN anywhere in a row spreads to all of it).

    Returns
    -------
    mixed, mixed_heads : ndarray
        The capacities with every NaN or infinity replaced by zero (unchanged when finite).
    nan_out : ndarray of bool or None
        True where the result is NaN, in flow's output shape with its row axis:
        ``(*batch, [L,] [H,] r, n)``; None when every capacity is finite.
    """
    # A sum is finite exactly when every term is and it does not overflow: one pass and
    # no (L, n, n) temporary for the common case; an overflow only takes the long way.
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.isfinite(np.sum(mixed)) and (
            mixed_heads is None or np.isfinite(np.sum(mixed_heads))
        )
    if finite:
        return mixed, mixed_heads, None
    bad: np.ndarray = ~np.isfinite(mixed)
    bad_heads: np.ndarray | None = None
    if mixed_heads is not None:
        bad_heads = ~np.isfinite(mixed_heads)
    if not bad.any() and (bad_heads is None or not bad_heads.any()):
        return mixed, mixed_heads, None
    per_layer = _reached(bad)  # (*batch, L, n, n)
    if bad_heads is None:
        pattern = per_layer if all_layers else per_layer[..., -1:, :, :]
    else:
        n_used = mixed.shape[-3]
        tops = range(1, n_used + 1) if all_layers else [n_used]
        stacked = []
        for slot, top in enumerate(tops):
            below = None if top == 1 else per_layer[..., top - 2, None, :, :]
            stacked.append(_on_top(below, bad_heads[..., slot, :, :, :]))
        pattern = np.stack(stacked, axis=-4)  # (*batch, R, H, n, n)
    if not all_layers:
        pattern = pattern[..., 0, :, :] if bad_heads is None else pattern[..., 0, :, :, :]
    if rows is not None:
        pattern = pattern[..., list(rows), :]
    if whole_rows:
        pattern = np.broadcast_to(pattern.any(axis=-1, keepdims=True), pattern.shape)
    clean = np.where(bad, 0.0, mixed)
    clean_heads = None
    if mixed_heads is not None and bad_heads is not None:
        clean_heads = np.where(bad_heads, 0.0, mixed_heads)
    return clean, clean_heads, pattern
