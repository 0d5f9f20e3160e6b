"""Attention rollout and the raw-attention baseline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from ._deprecation import MISSING, Missing, renamed_keyword
from ._namespace import array_device
from ._prepare import (
    FusedLayers,
    PreparedAttention,
    check_arguments,
    layer_of,
    prepare_attention,
    times_layer,
)
from ._pruning import prune
from ._real_rows import from_real_end
from ._receptive_field import normalize_attribution, uniform_causal_attention
from ._residual import mix_residual
from ._rows import identity_rows, take_rows
from ._typing import ArrayT, HeadFusion, LayerSelection, Namespace, RowSelection

__all__ = ["head_products", "raw", "rollout", "rollout_products"]


def _device(fused: Any) -> Any:
    return fused.device if isinstance(fused, FusedLayers) else array_device(fused)


def rollout_products(
    fused: Any,
    *,
    residual: float,
    rows: tuple[int, ...] | None,
    all_layers: bool,
    valid_keys: Any | None,
    xp: Namespace,
) -> Any:
    """Roll out head-fused attention ``(*batch, L, n, n)`` from the input upwards.

    Returns rows `rows` (all for None; the row axis is kept, ``(*batch, r, n)``) of
    ``R_L = Ã_L ··· Ã_1`` with ``Ã_l = (1 - α) A_l + α I`` or, with `all_layers`, of every
    ``R_l``, stacked on axis -3. The mixed matrices ``Ã_l``
    are never formed: a product with ``Ã_l`` is ``(1 - α) (A_l x) + α x``, which also
    holds with a padding mask because everything ``Ã_1`` touches is already zero on padded
    positions. Selected rows are chains of vector-matrix products started from the top
    layer, O(L n²) per row instead of the O(L n³) of full products. `fused` may be
    :class:`FusedLayers`: each layer is then read once, when the chain reaches it.
    """
    n_layers, n = fused.shape[-3], fused.shape[-1]
    alpha = residual
    padded_keys = None if valid_keys is None else valid_keys[..., 0, :, :]

    def mix(left: Any, product: Any) -> Any:
        """``left @ Ã`` from ``left @ A``, for row vectors `left` zero on padded tokens."""
        return product if alpha == 0.0 else (1.0 - alpha) * product + alpha * left

    def times_mixed(left: Any, matrix: Any) -> Any:
        """``left @ Ã`` for row vectors `left` that are zero on padded tokens."""
        return mix(left, xp.matmul(left, matrix))

    if rows is None:
        # R_1 = Ã_1 is the only mixed matrix formed, then R_l = (1 - α) A_l R + α R.
        product = mix_residual(layer_of(fused, 0), alpha, xp, valid_keys=padded_keys)
        products = [product]
        for i in range(1, n_layers):
            step = xp.matmul(layer_of(fused, i), product)
            product = step if alpha == 0.0 else (1.0 - alpha) * step + alpha * product
            products.append(product)
        return xp.stack(products, axis=-3) if all_layers else product

    index = rows
    n_rows = len(index)

    def mixed_rows(attention_rows: Any) -> Any:
        """Rows `index` of Ã from those of A: ``(1 - α) A[rows] + α I[rows]`` (real tokens)."""
        if alpha == 0.0:
            return attention_rows
        unit_rows = identity_rows(
            n, index, keys=padded_keys, dtype=fused.dtype, device=_device(fused), xp=xp
        )
        return (1.0 - alpha) * attention_rows + alpha * unit_rows

    if not all_layers:
        vectors = mixed_rows(layer_of(fused, n_layers - 1, index, xp))
        for i in range(n_layers - 2, -1, -1):
            vectors = mix(vectors, times_layer(vectors, fused, i, xp))
        return vectors

    # Every layer's rows. Row chains cost about r·L²/2 vector-matrix products against
    # L - 1 full matrix products; take whichever is cheaper.
    if n_rows * (n_layers + 1) > 2 * n:
        full = rollout_products(
            fused, residual=alpha, rows=None, all_layers=True, valid_keys=valid_keys, xp=xp
        )
        return take_rows(full, rows, xp)
    # Walk down from the top layer, carrying one block of row vectors per target layer:
    # the chain for layer l starts at layer l and is multiplied by every layer below it.
    chains = mixed_rows(layer_of(fused, n_layers - 1, index, xp))
    for i in range(n_layers - 2, -1, -1):
        matrix = layer_of(fused, i)
        unit = mixed_rows(take_rows(matrix, index, xp))
        chains = xp.concat([unit, times_mixed(chains, matrix)], axis=-2)
    batch = tuple(chains.shape[:-2])
    return xp.reshape(chains, (*batch, n_layers, n_rows, n))


def head_products(
    heads: Any,
    fused: Any,
    *,
    residual: float,
    rows: tuple[int, ...] | None,
    all_layers: bool,
    valid_keys: Any | None,
    xp: Namespace,
) -> Any:
    """Head-specific rollout (Abnar & Zuidema 2020, Appendix A.1).

    The map of head ``k`` at layer ``i`` is ``Ã_{i,k} R̄_{i-1}``, with
    ``Ã_{i,k} = (1 - α) W_{i,k} + α I`` and ``R̄`` the rollout of the head-fused layers
    below (``R̄_0 = I``). `heads` holds the reported layers' heads,
    ``(*batch, L or 1, H, n, n)``; `fused` every used layer, ``(*batch, L, n, n)``. Returns
    ``(*batch, [L,] H, ...)`` with the row selection of :func:`rollout_products`.
    """
    alpha = residual
    n_layers, n = fused.shape[-3], fused.shape[-1]
    index = rows

    def times_heads(below: Any, top: Any) -> Any:
        """``Ã_{i,k} R̄`` (rows `index`) for head matrices `top` ``(..., H, n, n)``."""
        below = below[..., None, :, :]
        product = xp.matmul(take_rows(top, index, xp), below)
        if alpha == 0.0:
            return product
        return (1.0 - alpha) * product + alpha * take_rows(below, index, xp)

    keys = None if valid_keys is None else valid_keys[..., 0, :, :]

    def identity() -> Any:
        """``R̄_0``: the identity on real tokens, ``(*batch | (), 1, n, n)``."""
        device = array_device(fused)
        eye = identity_rows(n, None, keys=keys, dtype=fused.dtype, device=device, xp=xp)
        return eye[..., None, :, :]

    if all_layers:
        below = identity()
        if n_layers > 1:
            rolled = rollout_products(
                fused[..., :-1, :, :],
                residual=alpha,
                rows=None,
                all_layers=True,
                valid_keys=valid_keys,
                xp=xp,
            )
            below = xp.concat(
                [xp.broadcast_to(below, (*rolled.shape[:-3], 1, n, n)), rolled], axis=-3
            )
        maps = times_heads(below, heads)
    elif index is not None:
        # Rows of the top layer's heads, then vector-matrix chains down the fused layers.
        top = heads[..., 0, :, :, :]
        vectors = take_rows(top, index, xp)
        if alpha != 0.0:
            units = identity_rows(
                n, index, keys=keys, dtype=fused.dtype, device=_device(fused), xp=xp
            )[..., None, :, :]
            vectors = (1.0 - alpha) * vectors + alpha * units
        for i in range(n_layers - 2, -1, -1):
            product = xp.matmul(vectors, fused[..., i, None, :, :])
            vectors = product if alpha == 0.0 else (1.0 - alpha) * product + alpha * vectors
        maps = vectors
    else:
        below = identity()[..., 0, :, :]
        if n_layers > 1:
            below = rollout_products(
                fused[..., :-1, :, :],
                residual=alpha,
                rows=None,
                all_layers=False,
                valid_keys=valid_keys,
                xp=xp,
            )
        maps = times_heads(below, heads[..., 0, :, :, :])
    return maps


def _compose(prepared: PreparedAttention) -> Any:
    """Rollout of prepared attention: pruned if asked, fused or head by head."""
    xp = prepared.xp
    fused, alpha = prune(
        prepared.fused,
        prepared.pruning,
        xp,
        residual=prepared.residual,
        valid_keys=prepared.valid_keys,
    )
    if prepared.per_head is None:
        return rollout_products(
            fused,
            residual=alpha,
            rows=prepared.rows.index,
            all_layers=prepared.all_layers,
            valid_keys=prepared.valid_keys,
            xp=xp,
        )
    heads, _ = prune(
        prepared.per_head,
        prepared.pruning,
        xp,
        residual=prepared.residual,
        valid_keys=prepared.head_keys,
    )
    return head_products(
        heads,
        fused,
        residual=alpha,
        rows=prepared.rows.index,
        all_layers=prepared.all_layers,
        valid_keys=prepared.valid_keys,
        xp=xp,
    )


def _decoder_normalise(prepared: PreparedAttention, result: Any) -> Any:
    """Apply `receptive_field` and `exclude` to a rollout result.

    Divide by the rollout of uniform causal attention (same residual, mask, rows, layers
    and pruning), drop the sink columns, renormalise rows.
    """
    xp = prepared.xp
    baseline = None
    if prepared.receptive_field:
        fused = prepared.fused
        uniform = uniform_causal_attention(
            fused.shape[-1],
            valid_keys=prepared.valid_keys,
            dtype=fused.dtype,
            device=_device(fused),
            xp=xp,
        )
        uniform = xp.broadcast_to(uniform, tuple(fused.shape))
        # Every head of uniform attention is the same matrix: the fused baseline serves
        # each head's map (heads="each") once a head axis is added.
        baseline = _compose(replace(prepared, fused=uniform, per_head=None))
        if prepared.per_head is not None:
            baseline = xp.expand_dims(baseline, axis=-3)  # before the (kept) row axis
    return normalize_attribution(result, baseline=baseline, exclude=prepared.exclude, xp=xp)


def _select(prepared: PreparedAttention, per_layer: Any) -> Any:
    """Rows of the reported layer(s) of per-layer matrices ``(*batch, L, n, n)``."""
    xp = prepared.xp
    matrices = per_layer if prepared.all_layers else per_layer[..., -1, :, :]
    return prepared.rows.select(matrices, xp)


@from_real_end()
def rollout(
    attentions: ArrayT | Sequence[ArrayT],
    /,
    *,
    heads: HeadFusion = "mean",
    residual: float = 0.5,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    mask: Any | None = None,
    threshold: float | None = None,
    top_k: int | None = None,
    discard: float | None = None,
    receptive_field: bool = False,
    exclude: int | Sequence[int] | None = None,
    normalize_layers: bool = False,
    validate: bool | Literal["heads"] = True,
    renormalize: bool | Missing = MISSING,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Attention rollout: how much each input token reaches each output position.

    Heads are fused, the residual connection is modelled by mixing in the identity, and the
    per-layer matrices are multiplied from the input upwards (Abnar & Zuidema 2020, eq. 1):

    .. math::

        \tilde A_l = (1 - \alpha) A_l + \alpha I, \qquad
        \tilde R_l = \tilde A_l \, \tilde A_{l-1} \cdots \tilde A_1 ,

    where :math:`A_l` is the head-fused attention of layer :math:`l` (rows = queries,
    columns = keys) and :math:`\tilde R_l[i, j]` is the share of input token :math:`j` in
    position :math:`i` at layer :math:`l`. Rows of :math:`\tilde R_l` sum to one.

    With ``heads="each"`` every head of a reported layer gets its own map (Abnar & Zuidema
    2020, Appendix A.1): head :math:`k` of layer :math:`i` is read through the head-fused
    (mean) rollout of the layers below it, so that heads are not assumed to stay apart
    below (they mix in the feed-forward network),

    .. math::

        \tilde R_{i,k} = \tilde A_{i,k} \, \bar R_{i-1}, \qquad
        \tilde A_{i,k} = (1 - \alpha) W_{i,k} + \alpha I, \qquad
        \bar R_{i-1} = \tilde A_{i-1} \cdots \tilde A_1, \; \bar R_0 = I .

    ``residual=0`` gives the paper's literal :math:`W_{i,k} \bar R_{i-1}`. The mean over
    heads of these maps is the rollout with ``heads="mean"``, exactly.

    `threshold`, `top_k` and `discard` prune every composed layer (the head matrices of
    ``heads="each"`` too) before the product, to follow the dominant paths; rows are then
    renormalised (a row left empty becomes a self-attention row):

    - ``threshold=t``: :math:`A_l[i, j] \mapsto A_l[i, j] \, [A_l[i, j] \ge t]`, on the
      fused attention, before the identity is mixed in;
    - ``discard=d`` (vit-explain's ``discard_ratio``): the :math:`\lfloor d \, m \rfloor`
      smallest of the :math:`m` eligible entries of each :math:`A_l` are set to zero,
      before the identity is mixed in. Eligible are the entries whose query and key are
      real tokens (padding never counts) and whose key is not position 0 (the CLS
      column, never discarded), for each sequence of the batch on its own:
      :math:`m = r^2 - r` for :math:`r` real tokens, :math:`r^2` if position 0 is padding;
    - ``top_k=k``: the :math:`k` largest entries of each row of the mixed
      :math:`\tilde A_l` are kept (with ``residual=0.5`` the diagonal, at least 0.5, is
      always one of them); ``k`` at or above ``n`` keeps every entry.

    Entries tied with a cut-off are kept, so fewer than :math:`\lfloor d \, m \rfloor`
    entries may be discarded and more than :math:`k` kept; the result does not depend on
    the sort. Threshold 0, discard 0 and ``k >= n`` return plain rollout exactly.

    For decoders (causal attention), ``receptive_field=True`` divides by the rollout
    :math:`B` of uniform causal attention (query :math:`i` attends equally to the real keys
    :math:`0..i`) with the same residual, mask, rows, layers and pruning, then
    renormalises rows (Abnar & Zuidema 2020, Conclusion: "we should first normalize based
    on the receptive field of attention"); `exclude` drops attention-sink columns (BOS)
    and renormalises rows over the remaining real tokens:

    .. math::

        \hat R[i, j] = \frac{[j \notin E] \, R[i, j] / B[i, j]}
        {\sum_{j'} [j' \notin E] \, R[i, j'] / B[i, j']}, \qquad \frac{x}{0} := 0 .

    Parameters
    ----------
    attentions : array or sequence of arrays
        Attention probabilities, ``(*batch, layers, heads, n, n)``, or a sequence of one
        ``(*batch, heads, n, n)`` array per layer (what Hugging Face returns with
        ``output_attentions=True``), first layer first. With ``heads=None`` the heads are
        already fused: ``(*batch, layers, n, n)`` or a sequence of ``(*batch, n, n)``.
    heads : {"mean", "max", "min", "each"}, callable, array_like or None, default "mean"
        Head fusion (see :func:`fuse_heads`): the paper's mean, the element-wise max or
        min (rows renormalised), weights of shape ``(heads,)`` or ``(layers, heads)``, a
        callable reducing axis -3, or None for fused input. ``"each"`` returns one map per
        head of the reported layer(s), the layers below fused by the mean (see above).
    residual : float, default 0.5
        The weight :math:`\alpha` of the identity; 0.5 is the paper's setting, 0 rolls out
        the attention alone.
    rows : int, sequence of int or None, default None
        Output positions to explain: None gives the full ``n x n`` matrix, an int one
        row, a sequence a block of rows. A negative row counts from the end: of each
        sequence's real tokens where `mask` is given (``-1`` is every sequence's last real
        token, also in a right-padded batch). Selected rows are computed as vector-matrix
        chains, O(L n²) per row.
    layers : {"last", "all"} or int, default "last"
        Report the rollout at the top layer, at every layer (stacked on a new axis after
        the batch axes, as in the paper's figures), or at one layer (an index into the
        layer axis, 0 = first; layers above it are never read).
    mask : bool array of shape ``(*batch, n)``, optional
        True for real tokens, False for padding. Padded positions get exactly zero
        attribution and carry none; the block of real tokens equals the rollout of the
        cropped sequence, each head's rows renormalised over the real keys. Whatever the
        framework put in padded query rows (zeros, uniform rows, NaN) is ignored.
    threshold : float, optional
        Drop the fused attention weights below this value (finite, >= 0) before the
        identity is mixed in, then renormalise rows.
    top_k : int, optional
        Keep the `top_k` (>= 1) largest entries of each row of every mixed layer
        :math:`\tilde A_l`, then renormalise rows.
    discard : float, optional
        Drop this fraction, in [0, 1), of each fused layer's lowest eligible weights
        (never column 0, never padding), before the identity is mixed in, then
        renormalise rows. At most one of `threshold`, `top_k` and `discard`.
    receptive_field : bool, default False
        Decoders: divide by the rollout of uniform causal attention (see above), then
        renormalise rows. Entries outside a position's receptive field (later or padded
        tokens) are 0. Refuses attention with weight on later keys (an encoder) when
        `validate` reads the values; otherwise the causal baseline is used as is.
    exclude : int or sequence of int, optional
        Input positions (negative counts from the end) left out of the attribution, such
        as an attention sink at 0 (BOS): their column is zero and rows are renormalised
        over the remaining real tokens. They still carry attention through the layers
        (only the output changes). A row with nothing left is zero.
    normalize_layers : bool, default False
        Divide each row of every layer's input matrix by its sum first (``renormalize``
        before 0.1), instead of requiring rows
        that sum to one: for non-negative token-mixing matrices such as the value-aware
        ones of :func:`contributions` (with ``heads=None``; ``residual=0`` when the
        matrices carry the residual connection themselves). `validate` then checks that
        the values are finite and non-negative; a row with no mass becomes a
        self-attention row.
    validate : bool or "heads", default True
        Check the attention values before the rollout: finite, non-negative, rows summing
        to one within a dtype-aware tolerance. True checks what the method consumes: the
        head-fused layers for a mean or weighted mean (NaN, infinities and bad row sums
        carry through a mean; reading 1/H of the data keeps rollout within reach of one
        pass over the input), and every head for max, min, a callable or a mask.
        ``"heads"`` checks every weight of every head (two more passes over the input);
        False checks nothing, for attention that is not row-stochastic on purpose. Value
        checks are skipped where values cannot be read cheaply (inside ``jax.jit``, on
        Dask graphs). For a mean or weighted mean without pruning, each layer is fused
        when the row chain reaches it and checked while it is in cache (the top layer of
        a row chain only in the rows asked, the rest cannot change the result; with a
        mask, every head of those rows, in the pass that renormalises and fuses them);
        the checks are decided before anything is returned. Memory beyond the input then
        stays about one fused layer.
    renormalize : bool, optional
        Deprecated spelling of `normalize_layers`, kept for one release (a
        DeprecationWarning).
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    array
        ``(*batch, [layers,] n, n)`` for ``rows=None``, ``(*batch, [layers,] n)`` for an
        int, ``(*batch, [layers,] r, n)`` for a sequence of ``r`` rows; the layers axis
        only with ``layers="all"``. With ``heads="each"`` a heads axis follows the layers
        axis: ``(*batch, [layers,] heads, ...)``. In the library, dtype and device of
        `attentions` (TensorFlow tensors come back as TensorFlow tensors).

    Raises
    ------
    ValueError
        On a bad shape, option or (with `validate`) attention values.
    TypeError
        On a non-floating dtype, a non-boolean mask or an unsupported array type.
    IndexError
        If `rows` or `layers` is out of range.

    See Also
    --------
    raw : The attention itself, the paper's baseline.
    fuse_heads, add_residual : The building blocks.

    Notes
    -----
    Everything runs in the namespace of the input (array API standard), on its device,
    with no host transfer, and is differentiable where the library is. Batched over all
    leading axes, with no Python loop over batch elements. Pruning uses sorts and
    comparisons only (no data-dependent shapes), so it runs under ``jax.jit`` and on Dask
    graphs.

    Unlike vit-explain [2]_, which mixes the identity in first and then renormalises
    (giving the identity the weight :math:`1 / (1 + s)` for a pruned row sum :math:`s`),
    attnflow renormalises the pruned attention first, so the identity keeps the weight
    :math:`\alpha`; and it discards in every sequence of a batch, over real tokens only.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928; Appendix A.1 for head-specific maps.
    .. [2] J. Gildenblat, "Explainability for Vision Transformers" (vit-explain),
       https://github.com/jacobgil/vit-explain: ``discard_ratio``.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> w = np.array([[[[0.5, 0.5], [0.0, 1.0]]], [[[1.0, 0.0], [0.5, 0.5]]]])  # L=2, H=1
    >>> attnflow.rollout(w)
    array([[0.75  , 0.25  ],
           [0.1875, 0.8125]])
    >>> attnflow.rollout(w, rows=1, layers="all")
    array([[0.    , 1.    ],
           [0.1875, 0.8125]])

    One map per head (Appendix A.1): the two heads of the top layer, each read through the
    first layer; their mean is the fused rollout:

    >>> w2 = np.array([[[[1.0, 0.0], [0.5, 0.5]], [[1.0, 0.0], [0.5, 0.5]]],
    ...                [[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]]])  # L=2, H=2
    >>> attnflow.rollout(w2, heads="each", rows=0, residual=0.0)  # (heads, n)
    array([[1. , 0. ],
           [0.5, 0.5]])
    >>> attnflow.rollout(w2, rows=0, residual=0.0)
    array([0.75, 0.25])

    Pruning: weights below 0.15 are dropped and rows renormalised (one layer, one head):

    >>> w3 = np.array([[[[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]]])
    >>> attnflow.rollout(w3, threshold=0.15, residual=0.0).round(4)
    array([[0.6667, 0.3333, 0.    ],
           [0.2   , 0.2   , 0.6   ],
           [0.    , 0.    , 1.    ]])
    >>> attnflow.rollout(w3, top_k=1, residual=0.0)
    array([[1., 0., 0.],
           [0., 0., 1.],
           [0., 0., 1.]])

    Decoders: rollout of uniform causal attention is not uniform (the first token is seen
    by every position, the query itself by the residual); divided by itself
    (``receptive_field=True``) it is uniform over each row's receptive field. A BOS sink
    is left out with ``exclude=0``:

    >>> u = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    >>> causal = np.stack([u, u])[:, None]  # L=2, H=1
    >>> attnflow.rollout(causal, rows=-1).round(4)
    array([0.3194, 0.2361, 0.4444])
    >>> attnflow.rollout(causal, rows=-1, receptive_field=True)
    array([0.33333333, 0.33333333, 0.33333333])
    >>> attnflow.rollout(causal, rows=-1, exclude=0).round(4)
    array([0.    , 0.3469, 0.6531])
    """
    normalize_layers = renamed_keyword(
        "renormalize", "normalize_layers", renormalize, normalize_layers, default=False
    )
    prepared = prepare_attention(
        check_arguments(
            attentions,
            heads=heads,
            residual=residual,
            rows=rows,
            layers=layers,
            mask=mask,
            validate=validate,
            xp=xp,
            allow_each=True,
            threshold=threshold,
            top_k=top_k,
            discard=discard,
            receptive_field=receptive_field,
            exclude=exclude,
            normalize_layers=normalize_layers,
        ),
        stream=True,
    )
    result = _compose(prepared)
    if prepared.receptive_field or prepared.exclude:
        result = _decoder_normalise(prepared, result)
    return prepared.boundary.restore(prepared.rows.squeeze(result))  # type: ignore[no-any-return]


@from_real_end()
def raw(
    attentions: ArrayT | Sequence[ArrayT],
    /,
    *,
    heads: HeadFusion = "mean",
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    mask: Any | None = None,
    validate: bool | Literal["heads"] = True,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Raw attention: the head-fused attention of each layer, the paper's baseline.

    .. math::

        A_l = \operatorname{fuse}_h W_{l,h}

    Raw attention shows what a layer attends to among its own inputs, which beyond the
    first layer are already mixtures of tokens; rollout and flow follow the mixing down to
    the input (Abnar & Zuidema 2020, §2-3).

    Parameters
    ----------
    attentions : array or sequence of arrays
        As for :func:`rollout`.
    heads : {"mean", "max", "min"}, callable, array_like or None, default "mean"
        Head fusion, as for :func:`rollout`.
    rows : int, sequence of int or None, default None
        Output positions, as for :func:`rollout`.
    layers : {"last", "all"} or int, default "last"
        The layer(s) to report, as for :func:`rollout`.
    mask : bool array of shape ``(*batch, n)``, optional
        Padding mask, as for :func:`rollout`: padded rows and columns are zero and rows of
        real tokens are renormalised over real keys.
    validate : bool or "heads", default True
        Check the attention values first, as for :func:`rollout`.
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    array
        Same shapes as :func:`rollout`, in the caller's library, dtype and device.

    Raises
    ------
    ValueError, TypeError, IndexError
        As for :func:`rollout`.

    See Also
    --------
    rollout

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> w = np.array([[[[0.5, 0.5], [0.0, 1.0]]], [[[1.0, 0.0], [0.5, 0.5]]]])  # L=2, H=1
    >>> attnflow.raw(w, rows=0, layers="all")
    array([[0.5, 0.5],
           [1. , 0. ]])
    """
    prepared = prepare_attention(
        check_arguments(
            attentions,
            heads=heads,
            residual=0.0,
            rows=rows,
            layers=layers,
            mask=mask,
            validate=validate,
            xp=xp,
        )
    )
    return prepared.boundary.restore(_select(prepared, prepared.fused))  # type: ignore[no-any-return]
