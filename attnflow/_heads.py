"""Head fusion: one attention matrix per layer from the heads of that layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ._namespace import (
    array_device,
    enter_boundary,
    is_jax_array,
    is_numpy_array,
    resolve_namespace,
    values_are_inspectable,
)
from ._normalize import normalize_rows
from ._typing import ArrayT, HeadFusion, Namespace
from ._validation import (
    AttentionLayout,
    HeadFusionSpec,
    check_attention_values,
    check_floating,
    check_head_fusion,
    check_validate,
    checks_every_head,
)

__all__ = ["apply_head_fusion", "fuse_heads", "head_mean", "masked_head_mean"]


def head_mean(attentions: Any, xp: Namespace, weights: Any | None = None) -> Any:
    """Mean (or, with `weights` ``(..., heads, 1, 1)``, weighted sum) over axis -3.

    Inside ``jax.jit`` the heads are added one by one, first to last, then divided by
    their number (weights: each head scaled as it is added): XLA fuses such a chain of
    elementwise operations into one pass that reads every weight once, but on the CPU it
    does not fuse a reduction over a non-minor axis of a slice (one layer of the stacked
    input) with the slice, and that reduction ran at a fifth of the speed of a head mean
    of the whole array. Elsewhere the library's own reduction.
    """
    if is_jax_array(attentions) and not values_are_inspectable(attentions):
        n_heads = attentions.shape[-3]
        if n_heads > 0:
            total = _head_term(attentions, weights, 0)
            for h in range(1, n_heads):
                total = total + _head_term(attentions, weights, h)
            return total if weights is not None else total / float(n_heads)
    if weights is None:
        return xp.mean(attentions, axis=-3)
    return xp.sum(attentions * weights, axis=-3)


def masked_head_mean(
    heads: Any,
    xp: Namespace,
    *,
    real_rows: Any,
    real_keys: Any,
    positions: Any,
    weights: Any | None = None,
    exact_sums: bool = True,
) -> Any:
    r"""Fuse heads ``(..., H, r, n)``, each renormalised over the real keys, in one pass.

    The masked preparation (:func:`attnflow._prepare.prepare_attention`) zeroes padded
    queries and keys of every head, divides each head's rows by their mass on the real
    keys, :math:`s_{h,q} = \sum_{k \text{ real}} W_{h,q,k}`, then averages the heads.
    The head mean does not commute with that renormalisation (each head has its own
    :math:`s_{h,q}`), but the renormalisation is a scale per head and row, so the masked
    mean is a head sum with per-row weights, masked once afterwards:

    .. math::

        A_{q,k} = [q, k \text{ real}] \Big( \sum_h \frac{w_h}{\tilde s_{h,q}} W_{h,q,k}
        + \delta_{qk} \sum_h w_h [s_{h,q} = 0] \Big),

    with :math:`w_h = 1/H` (or the normalised head weights), :math:`\tilde s = s` where
    positive and 1 elsewhere (an empty or NaN row is left as it is), and a real query's
    empty head contributing its unit row, as :func:`attnflow._normalize.normalize_rows`
    makes it. No masked or renormalised copy of the heads is formed: the sums read them
    once, the weighted head sum once, and what is masked is the fused block, 1/H of the
    data. Padded entries (NaN included) come out exactly zero.

    Parameters
    ----------
    heads : array, shape (..., H, r, n)
        Rows `positions` of a layer's heads.
    real_rows : bool array, broadcastable to (..., 1, r, 1)
        True where the query is a real token.
    real_keys : bool array, broadcastable to (..., 1, 1, n)
        True where the key is a real token.
    positions : int array, shape (r, 1)
        The rows' positions among the n queries (for the unit rows of empty rows).
    weights : array, shape (H, 1, 1), optional
        Head weights summing to one; None for the mean.
    exact_sums : bool
        Sum over the real keys with a `where`, so that NaN or infinities on padded keys
        of a real row stay out of its sum. False sums with a matrix product against the
        key mask, faster, for callers whose value checks refuse such rows anyway, and
        inside ``jax.jit``, where a `where` over every weight costs five head means on
        the CPU: there, NaN or infinite weights on padded keys of a real query's row
        make that row NaN (frameworks give padded keys zero weight; padded queries,
        NaN or not, are still dropped).

    Returns
    -------
    array, shape (..., r, n)
        The fused rows, zero in padded rows and columns.
    """
    n_heads, n = heads.shape[-3], heads.shape[-1]
    dtype = heads.dtype
    if exact_sums:
        zero = xp.zeros((), dtype=dtype, device=array_device(heads))
        sums = xp.sum(xp.where(real_keys, heads, zero), axis=-1, keepdims=True)
    else:
        key_weights = xp.matrix_transpose(xp.astype(real_keys, dtype))  # (..., 1, n, 1)
        sums = xp.matmul(heads, key_weights)
    share = (
        xp.full((n_heads, 1, 1), 1.0 / n_heads, dtype=dtype, device=array_device(heads))
        if weights is None
        else weights
    )
    scale = share / xp.where(sums > 0, sums, xp.ones_like(sums))  # (..., H, r, 1)
    if not exact_sums:
        # A NaN or infinite weight on a padded key entered the product: that row is NaN,
        # never silently left unnormalised (NaN) or zeroed (infinite).
        scale = xp.where(xp.isfinite(sums), scale, xp.full_like(scale, xp.nan))
    empty = (sums == 0) & real_rows  # a NaN sum is not empty
    fused = _weighted_head_sum(heads, scale, xp)
    units = _head_sum(xp.where(empty, share, xp.zeros_like(scale)), xp)  # (..., r, 1)
    own = xp.astype(positions == xp.arange(n, device=array_device(heads)), dtype)
    fused = fused + units * own
    keep = real_rows[..., 0, :, :] & real_keys[..., 0, :, :]
    return xp.where(keep, fused, xp.zeros_like(fused))


def _weighted_head_sum(heads: Any, scale: Any, xp: Namespace) -> Any:
    """``sum_h scale[..., h, q, 0] * heads[..., h, q, :]`` over axis -3.

    NumPy: one matrix product per row, ``(1, H) @ (H, n)`` with the head axis moved in
    front of the keys (a view), BLAS reading each weight once; no scaled copy of the
    heads. A ``jax.jit`` trace: the head-by-head sum XLA fuses (:func:`head_mean`).
    Elsewhere the product and the sum (the library fuses or blocks them itself).
    """
    if is_numpy_array(heads):
        nb = heads.ndim - 3
        by_row = xp.permute_dims(heads, (*range(nb), nb + 1, nb, nb + 2))  # (..., r, H, n)
        row_scale = xp.permute_dims(scale, (*range(nb), nb + 1, nb + 2, nb))  # (..., r, 1, H)
        return xp.matmul(row_scale, by_row)[..., 0, :]
    return head_mean(heads, xp, scale)


def _head_sum(values: Any, xp: Namespace) -> Any:
    """Sum over axis -3; head by head inside ``jax.jit`` (see :func:`head_mean`).

    There, XLA on the CPU fused a reduction over the heads of these per-row numbers into
    the elementwise pass over the fused layer, recomputing it for every weight: the
    padded rollout ran at a sixth of its speed.
    """
    if is_jax_array(values) and not values_are_inspectable(values) and values.shape[-3] > 0:
        total = values[..., 0, :, :]
        for h in range(1, values.shape[-3]):
            total = total + values[..., h, :, :]
        return total
    return xp.sum(values, axis=-3)


def _head_term(attentions: Any, weights: Any | None, h: int) -> Any:
    term = attentions[..., h, :, :]
    return term if weights is None else term * weights[..., h, :, :]


def apply_head_fusion(
    attentions: Any,
    spec: HeadFusionSpec,
    xp: Namespace,
    *,
    valid_rows: Any | None = None,
    check: bool = True,
) -> Any:
    """Fuse axis -3 of checked attentions ``(..., heads, n, n)`` into ``(..., n, n)``.

    Mean and weighted means of row-stochastic heads stay row-stochastic. Fusions that
    break row sums (max, min, a callable) are followed by a row renormalisation. With
    `check`, what a callable returns must be finite and non-negative in real rows (the
    renormalisation would otherwise hide it); without, NaN passes through as NaN.
    """
    if spec.kind == "none":
        return attentions
    if spec.kind in {"mean", "each"}:  # "each": the layers below the head are fused by the mean
        if attentions.shape[-3] == 1:
            # The mean of one head is that head, exactly (x / 1 == x): a view, no pass
            # over the (large) array. Callers that write in place check `owndata`.
            return attentions[..., 0, :, :]
        return head_mean(attentions, xp)
    if spec.kind == "weights":
        weights = spec.weights
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
        if weights.ndim == 2:  # (layers, heads): only the layers in use
            weights = weights[: attentions.shape[-4], ...]
        weights = xp.reshape(weights, (*weights.shape, 1, 1))
        return head_mean(attentions, xp, weights)
    if spec.kind == "max":
        fused = xp.max(attentions, axis=-3)
    elif spec.kind == "min":
        fused = xp.min(attentions, axis=-3)
    else:
        fused = _call_fusion(spec.function, attentions)
        if check:
            _check_fusion_output(fused, xp, valid_rows=valid_rows)
    return normalize_rows(fused, xp, valid_rows=valid_rows)


def _call_fusion(function: Callable[[Any], Any] | None, attentions: Any) -> Any:
    assert function is not None  # guaranteed by HeadFusionSpec("callable")
    fused = function(attentions)
    expected = (*attentions.shape[:-3], *attentions.shape[-2:])
    shape = tuple(getattr(fused, "shape", ()))
    if shape != tuple(expected):
        msg = (
            f"`heads` callable must reduce the heads axis (-3) of an array of shape "
            f"{tuple(attentions.shape)} to shape {tuple(expected)}; it returned "
            f"{type(fused).__qualname__} of shape {shape}. For example "
            "`lambda w: xp.median(w, axis=-3)`."
        )
        raise ValueError(msg)
    return fused


def _check_fusion_output(fused: Any, xp: Namespace, *, valid_rows: Any | None) -> None:
    """Refuse NaN, infinite or negative weights from a `heads` callable (real rows only)."""
    if not values_are_inspectable(fused):
        return
    bad = ~xp.isfinite(fused) | (fused < 0)
    if valid_rows is not None:
        bad = bad & valid_rows  # padded queries may hold anything: they are dropped
    if not bool(xp.any(bad)):
        return
    non_finite = ~xp.isfinite(fused)
    negative = fused < 0
    if valid_rows is not None:
        non_finite, negative = non_finite & valid_rows, negative & valid_rows
    msg = (
        "`heads` callable must return finite, non-negative weights (it fuses attention "
        f"probabilities); it returned {int(xp.count_nonzero(non_finite))} NaN or infinite "
        f"and {int(xp.count_nonzero(negative))} negative value(s) in rows of real tokens. "
        "Fix the callable (for example `lambda w: xp.median(w, axis=-3)`), or pass "
        "`validate=False` to carry NaN through to the result."
    )
    raise ValueError(msg)


def fuse_heads(
    attentions: ArrayT,
    /,
    *,
    heads: HeadFusion = "mean",
    validate: bool | Literal["heads"] = True,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Fuse the attention heads of each layer into one attention matrix.

    .. math::

        A_l = \frac{1}{H} \sum_{h=1}^{H} W_{l,h}

    for the paper's mean fusion (Abnar & Zuidema 2020). ``"max"`` and ``"min"`` take the
    element-wise maximum or minimum over heads; weights :math:`w_{l,h}` give
    :math:`A_l = \sum_h w_{l,h} W_{l,h} / \sum_h w_{l,h}`. After max, min or a callable,
    rows are renormalised to sum to one; a row left with no mass becomes a self-attention
    row (in cross-attention, where there is no self, it stays zero).

    Parameters
    ----------
    attentions : array, shape (..., heads, n, n)
        Attention probabilities; rows (axis -2) are queries, columns (axis -1) keys.
        Queries and keys may differ in number (cross-attention, ``(..., heads, q, k)``).
        Weights of shape ``(layers, heads)`` need the layer axis at -4:
        ``(..., layers, heads, n, n)``.
    heads : {"mean", "max", "min"}, callable or array_like, default "mean"
        The fusion. A callable receives the whole array and must reduce axis -3.
        Weights have shape ``(heads,)`` or ``(layers, heads)``, are non-negative and are
        normalised to sum to one per layer (zero weights discard heads).
    validate : bool or "heads", default True
        Check that the attention is finite, non-negative and row-stochastic: True checks
        the fused result of a mean or weighted mean (which carries NaN, infinities and row
        sums through, at 1/H of the cost) and every head for max, min or a callable;
        ``"heads"`` always checks every head; False checks nothing.
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    array, shape (..., n, n)
        The fused attention, in the library, dtype and device of `attentions`.

    Raises
    ------
    ValueError
        On a bad shape, an unknown fusion, or (with `validate`) invalid weights.
    TypeError
        On a non-floating dtype or an unsupported array type.

    See Also
    --------
    rollout : Attention rollout, which fuses heads first.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> w = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]])  # 2 heads
    >>> attnflow.fuse_heads(w)
    array([[0.5, 0.5],
           [0.5, 0.5]])
    >>> attnflow.fuse_heads(w, heads=[3.0, 1.0])
    array([[0.75, 0.25],
           [0.5 , 0.5 ]])
    """
    (array,), boundary = enter_boundary([attentions], ["attentions"])
    namespace = resolve_namespace(array, xp=xp, names=["attentions"])
    shape = tuple(array.shape)
    if len(shape) < 3 or 0 in shape[-3:]:
        msg = (
            "`attentions` must have shape (..., heads, queries, keys) with at least one "
            f"head, query and key; got shape {shape}."
        )
        raise ValueError(msg)
    # Queries and keys may differ here (cross-attention): fusion works matrix by matrix.
    layout = AttentionLayout(shape[:-4], shape[-4] if len(shape) >= 4 else 1, shape[-3], shape[-1])
    check_floating(array, namespace)
    do_validate = check_validate(validate)
    spec = check_head_fusion(
        heads, layout, namespace, dtype=array.dtype, device=array_device(array)
    )
    if spec.weights is not None and spec.weights.ndim == 2 and len(shape) < 4:
        msg = (
            f"`heads` weights of shape {tuple(spec.weights.shape)} need a layer axis: pass "
            f"attentions of shape (..., layers, heads, n, n); got shape {shape}."
        )
        raise ValueError(msg)
    every_head = checks_every_head(do_validate, spec.kind, masked=False)
    if do_validate and every_head:
        check_attention_values(array, namespace, valid_rows=None)
    fused = apply_head_fusion(array, spec, namespace, check=bool(do_validate))
    if do_validate and not every_head:
        check_attention_values(fused, namespace, valid_rows=None, heads_fused=True)
    return boundary.restore(fused)  # type: ignore[no-any-return]
