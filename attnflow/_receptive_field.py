r"""Decoders: receptive-field normalisation and attention sinks.

Causal attention lets query ``i`` see keys ``0..i`` only, so every method that composes
attention over layers piles mass onto early tokens even when nothing is learnt: rollout of
*uniform* causal attention is already far from uniform. Abnar & Zuidema (2020,
Conclusion): "to apply these methods on a Transformer decoder, we should first normalize
based on the receptive field of attention". attnflow defines it as

.. math::

    \hat R[i, j] = \frac{R[i, j] / B[i, j]}{\sum_{j'} R[i, j'] / B[i, j']}, \qquad
    B = \operatorname{method}(U), \quad
    U[i, j] = \frac{[j \le i]\,[j \text{ real}]}{\#\{j' \le i : j' \text{ real}\}},

the attribution divided by what the *same* method (same residual, mask, rows, layers and
pruning) gives to uniform causal attention ``U``, rows renormalised. Entries where ``B`` is
zero (outside the receptive field) are 0 (0/0 := 0). Attention sinks (a BOS token that
soaks up attention) are handled by `exclude`: those columns are set to zero before the
same renormalisation.

The functions are method-agnostic: any method computes its baseline from
:func:`uniform_causal_attention` and hands both to :func:`normalize_attribution`.
"""

from __future__ import annotations

from typing import Any

from ._namespace import array_device
from ._typing import Namespace

__all__ = ["normalize_attribution", "uniform_causal_attention"]


def uniform_causal_attention(
    n: int, *, valid_keys: Any | None, dtype: Any, device: Any, xp: Namespace
) -> Any:
    """Uniform causal attention: query ``i`` attends equally to the real keys ``0..i``.

    Parameters
    ----------
    n : int
        Sequence length.
    valid_keys : bool array broadcastable to ``(*batch, 1, 1, n)``, optional
        True for real tokens (as in ``PreparedAttention.valid_keys``); None: every token is
        real.
    dtype, device
        Of the result.
    xp : namespace

    Returns
    -------
    array, ``(n, n)`` without a mask, else ``(*batch, 1, n, n)``
        Rows of real queries sum to one over real keys ``j <= i``; padded rows and columns
        are zero. Broadcast it against the ``(*batch, L, n, n)`` fused layers.
    """
    positions = xp.arange(n, device=device)
    causal = positions[None, :] <= positions[:, None]
    if valid_keys is not None:
        valid_rows = xp.reshape(valid_keys, (*valid_keys.shape[:-2], n, 1))
        causal = causal & valid_keys & valid_rows
    ones = xp.astype(causal, dtype)
    counts = xp.sum(ones, axis=-1, keepdims=True)
    return ones / xp.where(counts > 0, counts, xp.ones_like(counts))


def normalize_attribution(
    attribution: Any,
    /,
    *,
    baseline: Any | None = None,
    exclude: tuple[int, ...] = (),
    xp: Namespace,
) -> Any:
    """Receptive-field normalisation and sink exclusion of any method's attribution.

    The contract, for every method (rollout, flow, gradient rollout):

    - `attribution` is the method's result, input tokens on the last axis (any leading
      axes: batch, layers, heads, rows); padded tokens already zero.
    - `baseline` is the *same* method applied to :func:`uniform_causal_attention` with
      the same mask, residual, rows, layers and pruning, broadcastable to `attribution`
      (None: no receptive-field normalisation). The method's own row normalisation does
      not matter: it cancels in the final renormalisation.
    - `exclude` holds non-negative input positions (checked) whose column is set to zero.

    Returns ``R / B`` (0 where ``B == 0``: outside the receptive field, and padding),
    excluded columns zero, each row divided by its sum over the remaining tokens; a row
    with nothing left (e.g. row 0 with ``exclude=0`` under causal attention, or a padded
    row) is all zero. Same namespace, dtype and device; differentiable where ``B > 0``.
    """
    values = attribution
    if baseline is not None:
        positive = baseline > 0
        safe = xp.where(positive, baseline, xp.ones_like(baseline))
        values = xp.where(positive, values / safe, xp.zeros_like(values))
    if exclude:
        n = values.shape[-1]
        positions = xp.arange(n, device=array_device(values))
        dropped = xp.zeros((n,), dtype=xp.bool, device=array_device(values))
        for position in exclude:
            dropped = dropped | (positions == position)
        values = xp.where(dropped, xp.zeros_like(values), values)
    sums = xp.sum(values, axis=-1, keepdims=True)
    has_mass = sums > 0
    return xp.where(
        has_mass, values / xp.where(has_mass, sums, xp.ones_like(sums)), xp.zeros_like(values)
    )
