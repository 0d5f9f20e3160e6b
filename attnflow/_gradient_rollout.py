"""Gradient-weighted rollout: Chefer et al.'s GAE rule and gradient-weighted attention rollout."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._deprecation import MISSING, Missing, renamed_keyword
from ._gae_fused import FusedRows, fuse_dask_layer, fuse_layer, host_stacks
from ._namespace import array_device, is_dask_array, is_jax_array, values_are_inspectable
from ._normalize import normalize_rows
from ._prepare import CheckedArguments, FusedLayers, check_arguments
from ._real_rows import from_real_end
from ._receptive_field import normalize_attribution, uniform_causal_attention
from ._rollout import rollout_products
from ._rows import identity_rows
from ._typing import ArrayT, LayerSelection, Namespace, RowSelection
from ._validation import (
    AttentionLayout,
    check_attention_values,
    check_causal,
    check_gradients_finite,
    check_row_statistics,
    sum_rows,
)

__all__ = ["gradient_rollout"]

RULES = ("gae", "weighted")


@from_real_end()
def gradient_rollout(
    attentions: ArrayT | Sequence[ArrayT],
    gradients: ArrayT | Sequence[ArrayT],
    /,
    *,
    rule: Literal["gae", "weighted"] = "gae",
    normalize_result: bool = False,
    residual: float = 0.5,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    mask: Any | None = None,
    exclude_self: bool = False,
    receptive_field: bool = False,
    exclude: int | Sequence[int] | None = None,
    validate: bool | Literal["heads"] = True,
    normalize: bool | Missing = MISSING,
    xp: Namespace | None = None,
) -> ArrayT:
    r"""Gradient-weighted rollout: class-specific relevance of each input token.

    Each head's attention is weighted by the gradient of the explained output :math:`y`
    (a class score) with respect to it, negative contributions are dropped and heads are
    averaged:

    .. math::

        \bar A_l = \operatorname{mean}_h \big( (\nabla_{A_{l,h}} y \odot A_{l,h})^+ \big).

    ``rule="gae"`` (Chefer et al. 2021, "GAE", the rules for self-attention) accumulates relevance additively,
    starting from the identity:

    .. math::

        R_0 = I, \qquad R_l = R_{l-1} + \bar A_l R_{l-1}
        \quad\big(= (I + \bar A_l) \cdots (I + \bar A_1)\big).

    ``rule="weighted"`` runs attention rollout (:func:`rollout`) on the gradient-weighted
    attention, renormalised per row, with the residual mixed in as in rollout:

    .. math::

        \hat A_l = \frac{\bar A_l}{\bar A_l \mathbf 1}, \qquad
        \tilde R_l = \big((1-\alpha) \hat A_l + \alpha I\big) \cdots
        \big((1-\alpha) \hat A_1 + \alpha I\big).

    A row of :math:`\bar A_l` that clips to all zero (no head has a positive
    gradient-times-attention for that query) becomes the identity row: the token keeps
    its own representation, which is what the residual path carries.

    Parameters
    ----------
    attentions : array or sequence of arrays
        Attention probabilities ``(*batch, layers, heads, n, n)`` or a sequence of one
        ``(*batch, heads, n, n)`` array per layer, first layer first, as for
        :func:`rollout`. Every head is needed (no fused input).
    gradients : array or sequence of arrays
        :math:`\partial y / \partial A_{l,h}`, of exactly the same shape and layer order
        as `attentions` (layer ``l`` of `gradients` is the gradient of layer ``l`` of
        `attentions`); same library and dtype.
    rule : {"gae", "weighted"}, default "gae"
        Chefer et al.'s additive GAE recurrence, or gradient-weighted attention rollout.
    normalize_result : bool, default False
        Divide each row of the result by its sum (``normalize`` before 0.1; GAE rows are not normalised otherwise;
        ``rule="weighted"`` rows already sum to one unless `exclude_self` drops mass).
    residual : float, default 0.5
        ``rule="weighted"`` only: the weight :math:`\alpha` of the identity, as in
        :func:`rollout`. Ignored by ``rule="gae"``, whose identity enters additively.
    rows : int, sequence of int or None, default None
        Output positions to explain, as for :func:`rollout`.
    layers : {"last", "all"} or int, default "last"
        Report :math:`R_L`, every :math:`R_l` (stacked after the batch axes), or one layer.
    mask : bool array of shape ``(*batch, n)``, optional
        True for real tokens. Padded tokens get exactly zero relevance and carry none:
        padded rows and columns of attention and gradient are dropped and each head's
        attention rows are renormalised over the real keys, so the real block equals the
        result on the cropped sequence.
    exclude_self : bool, default False
        Set each output row's entry for its own position to zero (before `normalize_result`).
        With ``rows=0`` this is the [CLS] row without [CLS] that Chefer et al. report,
        ``R[0, 1:]``, at its token positions (the entry at 0 is zero).
    receptive_field : bool, default False
        For decoders (causal attention; Abnar & Zuidema 2020, Conclusion): divide by what
        the same rule gives to uniform causal attention with unit gradients (every weight
        equally relevant; same mask, residual, rows and layers), as for
        :func:`attnflow.rollout`, then renormalise rows; 0 outside each position's
        receptive field. Non-causal attention is refused (values permitting). Rows then
        sum to one whatever `normalize_result` says.
    exclude : int or sequence of int, optional
        Input positions left out of the attribution (attention sinks such as BOS; negative
        from the end), rows renormalised over the remaining real tokens, as for
        :func:`attnflow.rollout`.
    validate : bool or "heads", default True
        Check the values: attention finite, non-negative, rows summing to one (every
        head); gradients finite; in every weight the result reads (with `rows`, the top
        layer only in those rows). The checks are reduced in the same pass that weights
        the attention and decided before anything is returned, with the same messages.
        Skipped where values cannot be read cheaply (inside ``jax.jit``, on Dask
        graphs). Shapes are always checked.
    normalize : bool, optional
        Deprecated spelling of `normalize_result`, kept for one release (a
        DeprecationWarning).
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    array
        ``(*batch, [layers,] n, n)`` for ``rows=None``, ``(*batch, [layers,] n)`` for an
        int, ``(*batch, [layers,] r, n)`` for ``r`` rows; in the library, dtype and
        device of `attentions`.

    Raises
    ------
    ValueError
        On a bad shape or option, gradients that do not line up with the attentions,
        or (with `validate`) bad values.
    TypeError
        On a non-floating dtype, mixed libraries or dtypes, or a non-boolean mask.
    IndexError
        If `rows` or `layers` is out of range.

    See Also
    --------
    rollout : The same product without gradients.

    Notes
    -----
    The gradients must be paired with the attention of the same layer: a reversed list
    (vit-explain issue #6) gives a different, wrong map, and cannot be detected from the
    values, so only the shapes are checked.

    :math:`\bar A_l` is formed one layer at a time. Arrays in host memory that NumPy can
    view without a copy (NumPy, PyTorch CPU tensors that do not require gradients, eager
    JAX on the CPU, array-api-strict, and TensorFlow after its conversion) go through a
    compiled pass that reads each weight and gradient once, padding mask included,
    reducing the value checks in the same pass; the result comes back in the caller's
    library. Other arrays take array-API blocks of query rows of about 2 MiB, so that
    the product, its clip and the head mean of a block stay in cache and no temporary
    of the input's size is allocated. A row chain reads only its rows of the top layer.
    Dask arrays (float32 or float64 NumPy chunks, heads and tokens in one chunk) get the
    compiled pass too, lazily, block by block of the batch (``map_blocks``). Under
    ``jax.jit`` each layer is whole and the head mean is an in-order sum of the clipped
    products, which XLA fuses into one pass. The GAE product is computed as
    :math:`2^l` times the rollout of :math:`\bar A` with :math:`\alpha = 0.5`, which is
    exact (a power of two) and reuses rollout's row chains, O(L n²) per selected row.

    References
    ----------
    .. [1] H. Chefer, S. Gur and L. Wolf, "Generic Attention-model Explainability for
       Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021,
       https://arxiv.org/abs/2103.15679
    .. [2] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> w = np.array([[[[0.5, 0.5], [0.0, 1.0]]], [[[1.0, 0.0], [0.5, 0.5]]]])  # L=2, H=1
    >>> g = np.array([[[[1.0, 2.0], [0.0, 1.0]]], [[[2.0, 0.0], [-1.0, 1.0]]]])
    >>> attnflow.gradient_rollout(w, g)
    array([[4.5, 3. ],
           [0. , 3. ]])
    >>> attnflow.gradient_rollout(w, np.zeros_like(g))  # no gradient: the identity
    array([[1., 0.],
           [0., 1.]])

    The [CLS] row without [CLS], as Chefer et al. report it, in one call:

    >>> attnflow.gradient_rollout(w, g, rows=0, exclude_self=True)
    array([0., 3.])

    Gradient-weighted attention rollout (rows sum to one):

    >>> attnflow.gradient_rollout(w, g, rule="weighted")
    array([[0.66666667, 0.33333333],
           [0.        , 1.        ]])
    """
    if rule not in RULES:
        msg = (
            f"`rule` must be 'gae' (Chefer et al.'s additive recurrence) or 'weighted' "
            f"(gradient-weighted attention rollout); got {rule!r}."
        )
        raise ValueError(msg)
    normalize_result = renamed_keyword(
        "normalize", "normalize_result", normalize, normalize_result, default=False
    )
    flags: tuple[tuple[str, object], ...] = (
        ("normalize_result", normalize_result),
        ("exclude_self", exclude_self),
    )  # checked at run time: callers may not be type-checked
    for flag_name, flag in flags:
        if not isinstance(flag, bool):
            msg = f"`{flag_name}` must be True or False; got {flag!r}."
            raise TypeError(msg)

    if gradients is None:
        msg = (
            "`gradients` must be an array (*batch, layers, heads, n, n) or a sequence of "
            "per-layer arrays, dy/dA of every attention weight; got None. Capture them with "
            "an adapter (`capture(model, gradients=True)`), or call `rollout` for rollout "
            "without gradients."
        )
        raise TypeError(msg)
    checked = check_arguments(
        attentions,
        heads="mean",  # every head is needed: GAE averages the gradient-weighted heads
        residual=residual,
        rows=rows,
        layers=layers,
        mask=mask,
        validate=validate,
        xp=xp,
        receptive_field=receptive_field,
        exclude=exclude,
        gradients=gradients,
    )
    namespace, layout, mask, boundary = checked.xp, checked.layout, checked.mask, checked.boundary
    alpha, selected_rows, excluded = checked.residual, checked.rows, checked.exclude
    used_layers, all_layers = checked.used_layers, checked.all_layers
    do_validate, normalise_field = checked.validate, checked.receptive_field

    streamed = _gradient_weighted_layers(checked, check=bool(do_validate) and not normalise_field)
    if do_validate and normalise_field:
        # Every check up front, in the order the messages assume (attention, gradients,
        # causality): the causal check needs the head-mean attention anyway.
        _check_eagerly(streamed, layout, mask, namespace)
    valid_rows: Any = None
    valid_keys: Any = None
    if mask is not None:
        valid_rows = namespace.reshape(mask, (*layout.batch_shape, 1, layout.n_tokens, 1))
        valid_keys = namespace.reshape(mask, (*layout.batch_shape, 1, 1, layout.n_tokens))
    fused = streamed.layers

    def compose(fused: Any) -> Any:
        if rule == "weighted":
            if isinstance(fused, FusedLayers):
                fused = fused.renormalized(None if mask is None else valid_rows[..., 0, :, :])
            else:
                fused = normalize_rows(fused, namespace, valid_rows=valid_rows)
            return rollout_products(
                fused,
                residual=alpha,
                rows=selected_rows.index,
                all_layers=all_layers,
                valid_keys=valid_keys,
                xp=namespace,
            )
        # R_l = (I + Ā_l) R_{l-1} = 2^l · ((Ā_l + I)/2) ··· ((Ā_1 + I)/2): rollout with
        # α = 0.5, scaled by a power of two (exact in floating point).
        rolled = rollout_products(
            fused,
            residual=0.5,
            rows=selected_rows.index,
            all_layers=all_layers,
            valid_keys=valid_keys,
            xp=namespace,
        )
        return _scale_by_depth(rolled, used_layers, all_layers, namespace)

    result = compose(fused)
    if exclude_self:
        result = _drop_self(result, selected_rows.index, layout.n_tokens, namespace)
    if normalise_field or excluded:
        baseline = None
        if normalise_field:
            # The same rule on uniform causal attention with unit gradients (every weight
            # equally relevant): what composing causal layers alone gives each token.
            uniform = uniform_causal_attention(
                layout.n_tokens,
                valid_keys=valid_keys,
                dtype=fused.dtype,
                device=fused.device,
                xp=namespace,
            )
            baseline = compose(namespace.broadcast_to(uniform, tuple(fused.shape)))
        result = normalize_attribution(result, baseline=baseline, exclude=excluded, xp=namespace)
    elif normalize_result:
        sums = namespace.sum(result, axis=-1, keepdims=True)
        result = result / namespace.where(sums > 0, sums, namespace.ones_like(sums))
    return boundary.restore(selected_rows.squeeze(result))  # type: ignore[no-any-return]


BLOCK_BYTES = 1 << 21
"""Bytes of attention per block of the fused pass: the block, its gradient and the
product stay in cache while the heads are clipped and averaged (measured best among
0.5-8 MiB on a 2-core EPYC with 1 MiB of L2 per core)."""


@dataclass
class _Streamed:
    """The gradient-weighted layers of one call, and what reading them needs."""

    layers: FusedLayers
    attention: Callable[[int], Any]
    gradient: Callable[[int], Any]


def _gradient_weighted_layers(checked: CheckedArguments, *, check: bool) -> _Streamed:
    r"""Stream the layers :math:`\bar A_l = \operatorname{mean}_h (\nabla_{A_{l,h}} y \odot A_{l,h})^+`.

    One pass over each layer, block of query rows by block: the product, its clip and
    the head mean of a block are formed while the block is in cache, so that no
    temporary of the input's size is allocated. With `check`, the same pass reduces each
    block of attention to its row sums and minima and each product to its sum (finite
    exactly when the gradients are, attention being finite and in [0, 1]); they are
    judged once every layer is read, with the eager checks' rules and messages.
    """
    xp, layout, mask, first_a = checked.xp, checked.layout, checked.mask, checked.first
    used_layers = checked.used_layers
    batch, n = layout.batch_shape, layout.n_tokens
    attention, gradient = checked.layer, checked.gradient

    rows_ok = keys_ok = None
    if mask is not None:
        rows_ok = xp.reshape(mask, (*batch, 1, n, 1))
        keys_ok = xp.reshape(mask, (*batch, 1, 1, n))
    zero = xp.zeros((), dtype=first_a.dtype, device=array_device(first_a))
    sums: list[Any] = []
    minima: list[Any] = []
    real: list[Any] = []
    totals: list[Any] = []
    per_row = math.prod(batch) * (layout.n_heads or 1) * n * (xp.finfo(first_a.dtype).bits // 8)

    empty_batch = math.prod(batch) == 0  # nothing to check (and no minimum to take)
    device = array_device(first_a)
    # Stacked host input: NumPy views of the whole stacks, taken once, so that each layer
    # the kernel reads is a view (eager JAX copies every slice it is asked for).
    stacks = None
    if checked.stacked is not None and checked.gradient_stacked is not None:
        stacks = host_stacks(checked.stacked, checked.gradient_stacked)
    if stacks is not None and mask is not None:
        host_mask = host_stacks(mask)
        stacks = None if host_mask is None else [*stacks, host_mask[0]]

    def kernel_layer(i: int, rows: tuple[int, ...] | None, checking: bool) -> Any:
        """Run the compiled pass on layer `i`; None where it does not apply."""
        if is_dask_array(first_a):  # lazily, block by block of the batch (no checks)
            fused = fuse_dask_layer(attention(i), gradient(i), rows, mask)
            return None if fused is None else FusedRows(fused, None, None, None)
        if stacks is None:
            return fuse_layer(attention(i), gradient(i), rows, xp, check=checking, mask=mask)
        a, g = stacks[0][..., i, :, :, :], stacks[1][..., i, :, :, :]
        keys = stacks[2] if mask is not None else None
        return fuse_layer(a, g, rows, xp, check=checking, mask=keys, device=device)

    def compute(i: int, rows: tuple[int, ...] | None) -> Any:
        checking = check and not empty_batch
        # Host memory: the compiled kernel reads each weight once, checks and padding
        # included (its row sums are 1 for padded queries, its minimum over real rows).
        kernel = kernel_layer(i, rows, checking)
        if kernel is not None:
            if checking and kernel.sums is not None:  # (Dask: no checks)
                sums.append(kernel.sums)
                minima.append(kernel.low)
                totals.append(kernel.total)
            return kernel.fused
        weights, grads = attention(i), gradient(i)
        inspectable = values_are_inspectable(weights)
        # Lazy arrays (a jit trace, a Dask graph) get the layer whole: their compiler fuses.
        step = max(1, BLOCK_BYTES // per_row) if inspectable else n
        spans = (
            [(r, r + 1) for r in rows]
            if rows is not None
            else [(start, min(n, start + step)) for start in range(0, n, step)]
        )
        blocks = []
        for start, stop in spans:
            a, g = weights[..., start:stop, :], grads[..., start:stop, :]
            block_rows = None if rows_ok is None else rows_ok[..., start:stop, :]
            if check and inspectable and not empty_batch:
                sums.append(sum_rows(a, xp))
                if block_rows is None:
                    # One minimum per block: cheaper than per row, and the same verdict.
                    minima.append(xp.reshape(xp.min(a), (1,)))
                else:  # padded rows may hold anything: per row, to leave them out
                    row_minima = xp.min(a, axis=-1)
                    real_rows = xp.broadcast_to(block_rows[..., 0], tuple(row_minima.shape))
                    real_rows = xp.reshape(real_rows, (-1,))
                    minima.append(xp.reshape(row_minima, (-1,)))
                    real.append(real_rows)
            if block_rows is not None:
                keep = block_rows & keys_ok
                a = xp.where(keep, a, zero)
                a = normalize_rows(a, xp, valid_rows=block_rows, first_row=start)
                g = xp.where(keep, g, zero)
            if not inspectable and is_jax_array(a):  # a jit trace (Dask: the mean is better)
                blocks.append(_clipped_head_mean(a, g, zero, xp))
                continue
            product = g * a
            if check and not empty_batch:
                totals.append(xp.sum(sum_rows(product, xp)))
            # (·)^+ as a maximum with a 0-d zero: one pass (a `where` on a comparison is slower).
            blocks.append(xp.mean(xp.maximum(product, zero), axis=-3))
        return blocks[0] if len(blocks) == 1 else xp.concat(blocks, axis=-2)

    def decide() -> None:
        if not sums:
            return
        row_sums, low = xp.concat(sums, axis=-1), xp.concat(minima)
        if real:  # padded queries may hold anything: only real rows are judged
            row_sums, valid = xp.concat([xp.reshape(x, (-1,)) for x in sums]), xp.concat(real)
            row_sums = xp.where(valid, row_sums, xp.ones_like(row_sums))
            low = xp.where(valid, low, xp.zeros_like(low))
        check_row_statistics(
            row_sums,
            low,
            xp,
            valid_rows=None,
            dtype=first_a.dtype,
            n_tokens=n,
        )
        total = xp.sum(xp.stack(totals))
        for gathered in (sums, minima, real, totals):
            gathered.clear()
        if not bool(xp.isfinite(total)):
            # Non-finite gradients, or finite ones whose products overflowed the sum:
            # the exact check decides (and counts for the message).
            for i in range(used_layers):
                keep = None if rows_ok is None else rows_ok & keys_ok
                check_gradients_finite(gradient(i), xp, keep=keep)

    shape = (*batch, used_layers, n, n)
    layers = FusedLayers(shape, first_a.dtype, array_device(first_a), xp, compute, decide)
    return _Streamed(layers, attention, gradient)


def _clipped_head_mean(attention: Any, gradient: Any, zero: Any, xp: Namespace) -> Any:
    r"""``mean_h max(g_h * a_h, 0)`` over axis -3, as one sum of elementwise terms.

    For ``jax.jit`` traces: XLA fuses a chain of elementwise operations into one pass
    over `attention` and `gradient`, but not a product into a reduction over a non-minor
    axis (under ``jax.jit`` on the CPU the product is formed whole and the reduction over
    the heads is 8x slower than this sum). The heads are added in order, then divided by
    their number, as the compiled pass does. (Dask computes the mean faster: each term
    would be a task of its own.)
    """
    heads = attention.shape[-3]
    if heads == 0:  # no terms: the mean's own answer (NaN) for an empty axis
        return xp.mean(xp.maximum(gradient * attention, zero), axis=-3)
    total = xp.maximum(gradient[..., 0, :, :] * attention[..., 0, :, :], zero)
    for h in range(1, heads):
        total = total + xp.maximum(gradient[..., h, :, :] * attention[..., h, :, :], zero)
    return total / float(heads)


def _check_eagerly(
    streamed: _Streamed, layout: AttentionLayout, mask: Any | None, xp: Namespace
) -> None:
    """Every value check before any work, layer by layer, in the order of the messages.

    For ``receptive_field=True``, whose causal check reads the head-mean attention.
    """
    n, batch = layout.n_tokens, layout.batch_shape
    used = streamed.layers.shape[-3]
    rows_ok = keys_ok = keep = None
    if mask is not None:
        rows_ok = xp.reshape(mask, (*batch, 1, n, 1))
        keys_ok = xp.reshape(mask, (*batch, 1, 1, n))
        keep = rows_ok & keys_ok
    for i in range(used):
        check_attention_values(streamed.attention(i), xp, valid_rows=rows_ok)
    for i in range(used):
        check_gradients_finite(streamed.gradient(i), xp, keep=keep)
    for i in range(used):
        fused_attention = xp.mean(streamed.attention(i), axis=-3)
        if keep is not None:
            fused_attention = xp.where(
                keep[..., 0, :, :], fused_attention, xp.zeros_like(fused_attention)
            )
        check_causal(fused_attention, xp)


def _scale_by_depth(result: Any, used_layers: int, all_layers: bool, xp: Namespace) -> Any:
    """Multiply the layer-``l`` result ``(*batch, [L,] r, n)`` by ``2**l`` (counted from 1)."""
    if not all_layers:
        return result * float(2**used_layers)
    scales = xp.asarray(
        [float(2 ** (i + 1)) for i in range(used_layers)],
        dtype=result.dtype,
        device=array_device(result),
    )
    return result * xp.reshape(scales, (used_layers, 1, 1))  # the layer axis is -3


def _drop_self(result: Any, rows: tuple[int, ...] | None, n: int, xp: Namespace) -> Any:
    """Zero each output row's entry for its own position (`result` ``(..., r, n)``)."""
    device = array_device(result)
    own = identity_rows(n, rows, keys=None, dtype=result.dtype, device=device, xp=xp) > 0
    return xp.where(own, xp.zeros_like(result), result)
