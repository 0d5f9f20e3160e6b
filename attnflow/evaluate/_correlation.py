"""Rank correlation between explanations and reference importance scores, per sample."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from attnflow._namespace import enter_boundary, resolve_namespace, values_are_inspectable
from attnflow._typing import Array, Namespace
from attnflow._validation import describe

__all__ = ["NAN_POLICIES", "RANK_CORRELATIONS", "NanPolicy", "RankCorrelation", "rank_correlation"]

RankCorrelation = Literal["spearman", "kendall", "spearman_dense"]
RANK_CORRELATIONS: tuple[RankCorrelation, ...] = get_args(RankCorrelation)
#: What an undefined correlation (a constant sample) counts as.
NanPolicy = Literal["zero", "omit"]
NAN_POLICIES: tuple[NanPolicy, ...] = get_args(NanPolicy)
# Pairwise comparisons hold (rows, n, n) booleans; rows are processed in blocks of at most
# this many comparisons so that memory stays bounded for long sequences and big batches.
_BLOCK_ELEMENTS = 1 << 24


def rank_correlation(
    scores: Array,
    reference: Array,
    /,
    *,
    method: RankCorrelation = "spearman",
    axis: int = -1,
    where: Array | None = None,
    nan: NanPolicy = "zero",
    xp: Namespace | None = None,
) -> Array:
    r"""Rank correlation of each sample's scores with a reference, along one axis.

    For every position of the other axes, correlates the values of `scores` and
    `reference` along `axis`, over the positions where `where` is True:

    * ``"spearman"``: Spearman's :math:`\rho`, the Pearson correlation of the ranks,
      ties given their average rank (as :func:`scipy.stats.spearmanr`);
    * ``"kendall"``: Kendall's :math:`\tau_b` (as :func:`scipy.stats.kendalltau`),

      .. math::

          \tau_b = \frac{n_c - n_d}{\sqrt{(n_0 - n_1)(n_0 - n_2)}},

      with :math:`n_c, n_d` the concordant and discordant pairs, :math:`n_0 = m(m-1)/2`
      the pairs of :math:`m` positions and :math:`n_1, n_2` the pairs tied in each input;
    * ``"spearman_dense"``: the formula Abnar & Zuidema's code used for Tables 1-2
      (``pandas`` ``rank(method="dense")`` and then the no-ties formula),

      .. math::

          \rho_\text{dense} = 1 - \frac{6 \sum_i (r_i - s_i)^2}{m (m^2 - 1)},

      with :math:`r_i, s_i` the dense ranks (tied values share a rank, and the next
      distinct value gets the next integer). Without ties it equals ``"spearman"``; with
      ties it is not a correlation: a constant input against distinct values gives
      :math:`(2 - m)/(m + 1)`, not an undefined value. Only fewer than two positions are
      degenerate (NaN, or 0 with ``nan="zero"`` as in the paper's code).

    This is how Abnar & Zuidema (2020, Tables 1-3) compare attention-based importance
    with blank-out and input-gradient importance, one sentence at a time.

    Parameters
    ----------
    scores, reference : array
        Real floating arrays of one library whose shapes broadcast together, e.g.
        explanations ``(batch, layers, n)`` and a reference ``(batch, 1, n)``.
    method : {"spearman", "kendall", "spearman_dense"}, default "spearman"
        The coefficient; ``"spearman_dense"`` reproduces the paper's code.
    axis : int, default -1
        The axis along which samples are ranked (the tokens).
    where : bool array, optional
        Broadcastable to the same shape: only positions where it is True take part
        (e.g. real tokens, or everything but ``[CLS]``). None uses every position.
    nan : {"zero", "omit"}, default "zero"
        What a degenerate sample gives (a constant input, or fewer than two positions),
        where the coefficient is undefined: 0 (``"zero"``, as the paper's code counts it)
        or NaN (``"omit"``, so that ``nanmean`` and friends leave it out).

    xp : namespace, optional
        The array namespace; inferred from the inputs by default.

    Returns
    -------
    array
        The broadcast shape without `axis`, in the library, device and floating dtype of
        the inputs. A sample whose included positions hold NaN gives NaN (for arrays
        whose values can be read, NaN there is refused instead).

    Raises
    ------
    ValueError
        On an unknown `method` or `nan`, shapes that do not broadcast, a bad `axis`,
        or NaN at included positions.
    TypeError
        On non-floating inputs, a non-boolean `where`, or arrays of several libraries.

    See Also
    --------
    blank_out : Reference importance by replacing one token at a time.

    Notes
    -----
    Ranks are computed by pairwise comparison, :math:`O(n^2)` per sample (in blocks, so
    memory stays bounded): exact under ties, with no loop over samples, on any array
    library, inside ``jax.jit`` and lazily on Dask.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [2] M. G. Kendall, "The treatment of ties in ranking problems", Biometrika 33(3),
       1945.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> scores = np.array([[0.1, 0.5, 0.2, 0.2], [1.0, 2.0, 3.0, 4.0]])
    >>> reference = np.array([[1.0, 3.0, 2.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    >>> attnflow.evaluate.rank_correlation(scores, reference)
    array([ 1., -1.])
    >>> attnflow.evaluate.rank_correlation(scores, reference, method="kendall")
    array([ 1., -1.])

    Dense ranks and the no-ties formula (the paper's code) differ under ties only:

    >>> tied = np.array([[0.1, 0.2, 0.2, 0.3]])
    >>> attnflow.evaluate.rank_correlation(tied, np.array([[1.0, 2.0, 3.0, 4.0]])).round(4)
    array([0.9487])
    >>> attnflow.evaluate.rank_correlation(tied, np.array([[1.0, 2.0, 3.0, 4.0]]), method="spearman_dense")
    array([0.8])
    >>> keep = np.array([True, True, True, False])
    >>> attnflow.evaluate.rank_correlation(scores, np.ones(4), where=keep, nan="omit")
    array([nan, nan])
    """
    if method not in RANK_CORRELATIONS:
        msg = f"`method` must be one of {RANK_CORRELATIONS}; got {method!r}."
        raise ValueError(msg)
    if nan not in NAN_POLICIES:
        msg = (
            f"`nan` must be one of {NAN_POLICIES} (what a constant sample gives: 0 as in "
            f"the paper's code, or NaN to leave it out); got {nan!r}."
        )
        raise ValueError(msg)
    (scores, reference, where), boundary = enter_boundary(
        [scores, reference, where], ["scores", "reference", "where"]
    )
    namespace = resolve_namespace(
        scores, reference, where, xp=xp, names=["scores", "reference", "where"]
    )
    for name, array in (("scores", scores), ("reference", reference)):
        if getattr(array, "shape", None) is None:
            msg = f"`{name}` must be an array; got {describe(array)}."
            raise TypeError(msg)
        if not namespace.isdtype(array.dtype, "real floating"):
            msg = (
                f"`{name}` must have a real floating dtype; got {array.dtype}. Cast it "
                "first (attnflow does not cast silently)."
            )
            raise TypeError(msg)
    if where is not None and (
        getattr(where, "shape", None) is None or not namespace.isdtype(where.dtype, "bool")
    ):
        msg = f"`where` must be a boolean array (True = position included); got {describe(where)}."
        raise TypeError(msg)
    arrays = [scores, reference] + ([] if where is None else [where])
    try:
        shape = _broadcast_shape([tuple(a.shape) for a in arrays])
    except ValueError:
        shapes = ", ".join(f"`{n}` {tuple(a.shape)}" for n, a in zip(_NAMES, arrays, strict=False))
        msg = (
            f"`scores`, `reference` and `where` must have shapes that broadcast together; "
            f"got {shapes}. Add size-1 axes where one of them has fewer (e.g. "
            "`reference[:, None, :]` against per-layer scores)."
        )
        raise ValueError(msg) from None
    if not shape:
        msg = "`scores` and `reference` must have at least one axis (the tokens); got scalars."
        raise ValueError(msg)
    given_axis: object = axis
    if (
        isinstance(given_axis, bool)
        or not isinstance(given_axis, int)
        or not -len(shape) <= given_axis < len(shape)
    ):
        msg = f"`axis` must be an int in [{-len(shape)}, {len(shape)}) for shape {shape}; got {axis!r}."
        raise ValueError(msg)

    dtype = namespace.result_type(scores.dtype, reference.dtype)
    x = _to_last(namespace.broadcast_to(namespace.astype(scores, dtype), shape), axis, namespace)
    y = _to_last(namespace.broadcast_to(namespace.astype(reference, dtype), shape), axis, namespace)
    if where is None:
        valid = namespace.ones(x.shape, dtype=namespace.bool, device=_device(x))
    else:
        valid = _to_last(namespace.broadcast_to(where, shape), axis, namespace)
    has_nan = namespace.any((namespace.isnan(x) | namespace.isnan(y)) & valid, axis=-1)
    if values_are_inspectable(has_nan) and bool(namespace.any(has_nan)):
        msg = (
            "`scores` or `reference` holds NaN at positions included by `where` (blank-out "
            "gives NaN where it did not evaluate, e.g. padding); exclude them, e.g. "
            "`where=~isnan(reference)`."
        )
        raise ValueError(msg)

    batch_shape = x.shape[:-1]
    n = x.shape[-1]
    rows = math.prod(batch_shape)
    x2, y2, v2 = (namespace.reshape(a, (rows, n)) for a in (x, y, valid))
    block = max(1, _BLOCK_ELEMENTS // max(1, n * n))
    compute = {"spearman": _spearman, "kendall": _kendall, "spearman_dense": _spearman_dense}[
        method
    ]
    parts = []
    for start in range(0, rows, block):
        stop = min(rows, start + block)  # in-bounds slices: the standard leaves others open
        part = (x2[start:stop, ...], y2[start:stop, ...], v2[start:stop, ...])
        parts.append(compute(*part, namespace))
    if len(parts) == 1:
        value, degenerate = parts[0]
    else:
        value = namespace.concat([p[0] for p in parts], axis=0)
        degenerate = namespace.concat([p[1] for p in parts], axis=0)
    fill = namespace.zeros_like(value) if nan == "zero" else namespace.full_like(value, math.nan)
    value = namespace.where(degenerate, fill, value)
    value = namespace.where(
        namespace.reshape(has_nan, (rows,)), namespace.full_like(value, math.nan), value
    )
    return boundary.restore(namespace.reshape(value, batch_shape))


_NAMES = ("scores", "reference", "where")


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max(len(s) for s in shapes)
    result = []
    for dims in zip(*(((1,) * (ndim - len(s))) + s for s in shapes), strict=True):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ValueError(dims)
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def _to_last(x: Array, axis: int, xp: Namespace) -> Array:
    return x if axis in (-1, x.ndim - 1) else xp.moveaxis(x, axis, -1)


def _device(x: Array) -> Any:
    from attnflow._namespace import array_device as device

    return device(x)


def _average_ranks(x: Array, valid: Array, xp: Namespace) -> Array:
    """1-based ranks among the valid positions, ties given their average rank."""
    others = xp.astype(valid[..., None, :], x.dtype)
    below = xp.sum(xp.astype(x[..., None, :] < x[..., :, None], x.dtype) * others, axis=-1)
    tied = xp.sum(xp.astype(x[..., None, :] == x[..., :, None], x.dtype) * others, axis=-1)
    return below + (tied + 1) / 2


def _spearman(x: Array, y: Array, valid: Array, xp: Namespace) -> tuple[Array, Array]:
    weight = xp.astype(valid, x.dtype)
    count = xp.sum(weight, axis=-1)
    safe_count = xp.where(count > 0, count, xp.ones_like(count))
    rx = _average_ranks(x, valid, xp)
    ry = _average_ranks(y, valid, xp)
    dx = (rx - (xp.sum(rx * weight, axis=-1) / safe_count)[..., None]) * weight
    dy = (ry - (xp.sum(ry * weight, axis=-1) / safe_count)[..., None]) * weight
    sxx = xp.sum(dx * dx, axis=-1)
    syy = xp.sum(dy * dy, axis=-1)
    sxy = xp.sum(dx * dy, axis=-1)
    degenerate = (count < 2) | (sxx == 0) | (syy == 0)
    denominator = xp.where(degenerate, xp.ones_like(sxx), xp.sqrt(sxx * syy))
    rho = xp.clip(sxy / denominator, -1.0, 1.0)
    return rho, degenerate


def _dense_ranks(x: Array, valid: Array, xp: Namespace) -> Array:
    """1-based dense ranks among the valid positions: 1 + the distinct values below."""
    others = xp.astype(valid[..., None, :], x.dtype)
    tied = xp.sum(xp.astype(x[..., None, :] == x[..., :, None], x.dtype) * others, axis=-1)
    # Each value j below x_i counts 1 / (its multiplicity), so a group of ties counts once.
    share = others / xp.where(tied > 0, tied, xp.ones_like(tied))[..., None, :]
    below = xp.sum(xp.astype(x[..., :, None] > x[..., None, :], x.dtype) * share, axis=-1)
    return xp.round(below) + 1


def _spearman_dense(x: Array, y: Array, valid: Array, xp: Namespace) -> tuple[Array, Array]:
    weight = xp.astype(valid, x.dtype)
    count = xp.sum(weight, axis=-1)
    difference = (_dense_ranks(x, valid, xp) - _dense_ranks(y, valid, xp)) * weight
    degenerate = count < 2
    denominator = xp.where(degenerate, xp.ones_like(count), count * (count * count - 1))
    return 1 - 6 * xp.sum(difference * difference, axis=-1) / denominator, degenerate


def _kendall(x: Array, y: Array, valid: Array, xp: Namespace) -> tuple[Array, Array]:
    pair = xp.astype(valid[..., :, None] & valid[..., None, :], x.dtype)
    sign_x = xp.sign(x[..., :, None] - x[..., None, :])
    sign_y = xp.sign(y[..., :, None] - y[..., None, :])
    # Over ordered pairs i != j each unordered pair counts twice; the diagonal adds 0.
    difference = xp.sum(sign_x * sign_y * pair, axis=(-2, -1)) / 2
    count = xp.sum(xp.astype(valid, x.dtype), axis=-1)
    pairs = count * (count - 1) / 2
    untied_x = xp.sum(xp.abs(sign_x) * pair, axis=(-2, -1)) / 2
    untied_y = xp.sum(xp.abs(sign_y) * pair, axis=(-2, -1)) / 2
    degenerate = (pairs == 0) | (untied_x == 0) | (untied_y == 0)
    denominator = xp.where(degenerate, xp.ones_like(untied_x), xp.sqrt(untied_x * untied_y))
    tau = xp.clip(difference / denominator, -1.0, 1.0)
    return tau, degenerate
