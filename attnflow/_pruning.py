"""Pruned and top-k attention: sparser layers before they are composed (rollout and flow).

Three rules, one per option, each followed by a row renormalisation:

- ``threshold=t`` keeps the weights of the fused attention ``A_l`` that are at least ``t``;
- ``discard=d`` drops the lowest fraction ``d`` of the eligible weights of each ``A_l``
  (vit-explain's ``discard_ratio``): entries whose query and key are real tokens and whose
  key is not position 0 (the CLS column);
- ``top_k=k`` keeps the ``k`` largest entries of each row of the mixed ``Ã_l``.

Threshold and discard act before the residual is mixed in, as vit-explain does, so the
identity still carries weight ``α`` afterwards; top-k acts on ``Ã_l`` itself, as the
method is defined. Ties at a cut-off are always kept, which makes every rule
deterministic and independent of the sort. Written once against the array API: sorts,
comparisons and ``where``, no data-dependent shapes, so it runs inside ``jax.jit`` and on
Dask graphs.
"""

from __future__ import annotations

import math
from typing import Any

from ._namespace import array_device
from ._normalize import normalize_rows
from ._residual import mix_residual
from ._typing import Namespace
from ._validation import PruningSpec

__all__ = ["prune"]


def prune(
    attention: Any,
    spec: PruningSpec | None,
    xp: Namespace,
    *,
    residual: float,
    valid_keys: Any | None,
) -> tuple[Any, float]:
    """Prune attention matrices ``(..., n, n)``; return them and the residual left to mix.

    Parameters
    ----------
    attention : array, shape (..., n, n)
        Fused (or one head's) attention, masked: padded rows and columns are zero and the
        rows of real tokens sum to one.
    spec : PruningSpec or None
        The checked option; None prunes nothing.
    residual : float
        The weight α of the identity.
    valid_keys : bool array broadcastable to ``(..., 1, n)``, optional
        True for real tokens; None when every token is real.

    Returns
    -------
    (array, float)
        For threshold and discard, the pruned ``A_l`` with rows renormalised and `residual`
        (the identity is still to be mixed in); for top-k, the pruned ``Ã_l`` with rows
        renormalised and 0.0 (the identity is already in). Without pruning, or when the
        option cannot drop anything (threshold 0, discard 0, k >= n), `attention` and
        `residual` unchanged.
    """
    if spec is None:
        return attention, residual
    n = attention.shape[-1]
    valid_rows = None if valid_keys is None else valid_keys[..., 0, :][..., :, None]
    if spec.kind == "threshold":
        if spec.value == 0.0:
            return attention, residual
        kept = xp.where(attention >= spec.value, attention, xp.zeros_like(attention))
        return normalize_rows(kept, xp, valid_rows=valid_rows), residual
    if spec.kind == "discard":
        if spec.value == 0.0:
            return attention, residual
        kept = _discard(attention, float(spec.value), xp, valid_keys=valid_keys)
        return normalize_rows(kept, xp, valid_rows=valid_rows), residual
    k = int(spec.value)
    if k >= n:
        return attention, residual
    mixed = mix_residual(attention, residual, xp, valid_keys=valid_keys)
    # The k-th largest entry of each row is the cut-off; every entry tied with it stays.
    cutoff = xp.sort(mixed, axis=-1, descending=True)[..., k - 1 : k]
    kept = xp.where(mixed >= cutoff, mixed, xp.zeros_like(mixed))
    return normalize_rows(kept, xp, valid_rows=valid_rows), 0.0


def _discard_count(n_real: int, first_is_real: bool, fraction: float) -> int:
    """How many eligible entries `discard` drops from one layer of `n_real` real tokens.

    Eligible are the ``m`` entries whose query and key are real and whose key is not
    position 0: ``m = r² - r`` when position 0 is a real token, ``r²`` when it is padding;
    ``⌊fraction · m⌋`` of them are dropped (double precision, as in Python).
    """
    eligible = n_real * n_real - (n_real if first_is_real else 0)
    return math.floor(fraction * eligible)


def _discard(attention: Any, fraction: float, xp: Namespace, *, valid_keys: Any | None) -> Any:
    """Zero the ``⌊fraction · m⌋`` smallest eligible entries of each matrix (ties kept)."""
    n = attention.shape[-1]
    device = array_device(attention)
    columns = xp.arange(n, device=device)
    eligible = xp.broadcast_to(columns != 0, (n, n))
    if valid_keys is not None:
        valid_rows = valid_keys[..., 0, :][..., :, None]
        eligible = eligible & valid_keys & valid_rows
    # Ineligible entries sort last, above every weight.
    inf = xp.asarray(math.inf, dtype=attention.dtype, device=device)
    flat = xp.reshape(xp.where(eligible, attention, inf), (*attention.shape[:-2], n * n))
    ascending = xp.sort(flat, axis=-1)
    if valid_keys is None:
        # The (c+1)-th smallest eligible weight: entries strictly below it are dropped.
        c = _discard_count(n, True, fraction)
        if c == 0:
            return attention
        cutoff = ascending[..., c]
    else:
        # The count depends on each sequence's real tokens: look it up (no float rounding
        # on the device) and pick the cut-off with a one-hot sum (no data-dependent index).
        index_dtype = columns.dtype
        sizes = xp.arange(n + 1, device=device)
        real = xp.sum(xp.astype(valid_keys, index_dtype), axis=-1)[..., 0]  # (...) like batch
        first_real = valid_keys[..., 0, 0]
        with_first = xp.asarray(
            [_discard_count(r, True, fraction) for r in range(n + 1)],
            dtype=index_dtype,
            device=device,
        )
        without_first = xp.asarray(
            [_discard_count(r, False, fraction) for r in range(n + 1)],
            dtype=index_dtype,
            device=device,
        )
        table = xp.where(first_real[..., None], with_first, without_first)
        zero = xp.zeros_like(table)
        c = xp.sum(xp.where(real[..., None] == sizes, table, zero), axis=-1)
        positions = xp.arange(n * n, device=device)
        picked = xp.where(positions == c[..., None], ascending, xp.zeros_like(ascending))
        cutoff = xp.sum(picked, axis=-1)
    drop = eligible & (attention < cutoff[..., None, None])
    return xp.where(drop, xp.zeros_like(attention), attention)
