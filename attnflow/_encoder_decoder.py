"""Encoder-decoder rollout: decoder positions attributed to source and target-prefix tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

import numpy as np

from ._deprecation import MISSING, Missing, renamed_keyword
from ._heads import apply_head_fusion
from ._namespace import (
    Boundary,
    array_device,
)
from ._normalize import normalize_rows
from ._prepare import enter_arrays
from ._real_rows import from_real_end
from ._rollout import rollout_products
from ._rows import Rows, identity_rows
from ._typing import Array, HeadFusion, LayerSelection, Namespace, RowSelection
from ._validation import (
    AttentionLayout,
    HeadFusionSpec,
    check_attention_values,
    check_floating,
    check_gradients_finite,
    check_head_fusion,
    check_layers,
    check_mask,
    check_residual,
    check_rows,
    check_validate,
    checks_every_head,
    describe,
)

__all__ = ["EncoderDecoderAttribution", "encoder_decoder_rollout"]

RULES = ("rollout", "gae")
_NAMES = ("encoder", "decoder", "cross")


class EncoderDecoderAttribution(NamedTuple):
    """What :func:`encoder_decoder_rollout` returns: a named ``(source, target)`` pair.

    It unpacks like a tuple, ``source, target = encoder_decoder_rollout(...)``.

    Parameters
    ----------
    source : array
        Attribution of each decoder position to the source (encoder input) tokens,
        ``(*batch, [layers,] T, S)`` (rows as selected by ``rows``).
    target : array
        Attribution of each decoder position to the target-prefix (decoder input)
        tokens, ``(*batch, [layers,] T, T)``.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> one = np.ones((1, 1, 1, 1))  # one layer, one head, S = T = 1
    >>> result = attnflow.encoder_decoder_rollout(one, one, one)
    >>> result.source, result.target
    (array([[0.5]]), array([[0.5]]))
    """

    source: Any
    target: Any


def _check_shapes(
    arrays: dict[str, Any], *, fused: bool
) -> tuple[tuple[int, ...], int, int, int | None, int, int]:
    """Check the three attention families against each other.

    Returns ``(batch, L_e, L_d, H, S, T)``.
    """
    core = 3 if fused else 4
    layouts = {
        "encoder": "(*batch, L_e, S, S)" if fused else "(*batch, L_e, heads, S, S)",
        "decoder": "(*batch, L_d, T, T)" if fused else "(*batch, L_d, heads, T, T)",
        "cross": "(*batch, L_d, T, S)" if fused else "(*batch, L_d, heads, T, S)",
    }
    hint = " (heads=None: heads already fused)" if fused else " (pass heads=None for fused input)"
    shapes: dict[str, tuple[int, ...]] = {}
    for name, array in arrays.items():
        shape = getattr(array, "shape", None)
        if shape is None:
            msg = f"`{name}` must be an array {layouts[name]}; got {describe(array)}."
            raise TypeError(msg)
        if any(d is None for d in shape):
            msg = (
                f"`{name}` must have a known shape; got {tuple(shape)}. Give Dask arrays "
                "known chunk sizes (`x.compute_chunk_sizes()`)."
            )
            raise ValueError(msg)
        if len(shape) < core or 0 in tuple(shape)[-core:]:
            msg = (
                f"`{name}` must have shape {layouts[name]}{hint}, with no empty axis; got "
                f"shape {tuple(shape)}. Check the axis order."
            )
            raise ValueError(msg)
        shapes[name] = tuple(int(d) for d in shape)
    enc, dec, crs = shapes["encoder"], shapes["decoder"], shapes["cross"]
    batch = enc[:-core]
    for name in ("decoder", "cross"):
        if shapes[name][:-core] != batch:
            msg = (
                f"`{name}` must have the batch shape {batch} of `encoder`; got batch shape "
                f"{shapes[name][:-core]} (shape {shapes[name]}). Pass the three attentions "
                "of one model call."
            )
            raise ValueError(msg)
    for name, length, side in (("encoder", "S", enc), ("decoder", "T", dec)):
        if side[-1] != side[-2]:
            msg = (
                f"`{name}` must be square, {layouts[name]}; got shape {side}. "
                f"{name.capitalize()} self-attention has {length} queries and {length} keys."
            )
            raise ValueError(msg)
    n_src, n_tgt = enc[-1], dec[-1]
    if crs[-core] != dec[-core]:
        msg = (
            f"`cross` must have one layer per decoder layer (L_d = {dec[-core]}); got "
            f"{crs[-core]} layers (shape {crs}). Pass the cross-attention of every decoder "
            "layer, in order."
        )
        raise ValueError(msg)
    for axis, what, size in (
        (-2, f"T = {n_tgt} query rows (decoder positions)", n_tgt),
        (-1, f"S = {n_src} key columns (source tokens)", n_src),
    ):
        if crs[axis] != size:
            counted = "rows" if axis == -2 else "columns"
            msg = (
                f"`cross` must have {what}, {layouts['cross']}; got {crs[axis]} {counted} "
                f"(shape {crs}). Rows are decoder queries, columns encoder keys."
            )
            raise ValueError(msg)
    n_heads = None
    if not fused:
        heads = {name: shape[-3] for name, shape in shapes.items()}
        if len(set(heads.values())) > 1:
            msg = (
                f"`encoder`, `decoder` and `cross` must have the same number of heads; got "
                f"{heads}. Pass heads=None with heads fused per family."
            )
            raise ValueError(msg)
        n_heads = enc[-3]
    return batch, enc[-core], dec[-core], n_heads, n_src, n_tgt


def _keep(rows_mask: Any | None, keys_mask: Any | None, extra: int, xp: Namespace) -> Any | None:
    """``(*batch, [1]*extra, q, k)`` bool: query and key both real; None without masks."""
    if rows_mask is None and keys_mask is None:
        return None
    keep = None
    if rows_mask is not None:
        shape = (*rows_mask.shape[:-1], *([1] * extra), rows_mask.shape[-1], 1)
        keep = xp.reshape(rows_mask, shape)
    if keys_mask is not None:
        shape = (*keys_mask.shape[:-1], *([1] * extra), 1, keys_mask.shape[-1])
        keys = xp.reshape(keys_mask, shape)
        keep = keys if keep is None else keep & keys
    return keep


def _masked(attention: Any, keep: Any | None, valid_rows: Any | None, xp: Namespace) -> Any:
    """Drop padded queries and keys, renormalise each row over the real keys."""
    if keep is None:
        return attention
    attention = xp.where(keep, attention, xp.zeros_like(attention))
    return normalize_rows(attention, xp, valid_rows=valid_rows)


def _eye(n: int, mask: Any | None, like: Any, xp: Namespace) -> Any:
    """``(*batch | (), n, n)`` identity, zero on padded tokens."""
    keys = None if mask is None else mask[..., None, :]
    device = array_device(like)
    return identity_rows(n, None, keys=keys, dtype=like.dtype, device=device, xp=xp)


def _gae_heads(attention: Any, gradient: Any, xp: Namespace) -> Any:
    """Chefer's rule 5: ``mean_h((∇A ⊙ A)^+)`` over axis -3."""
    weighted = gradient * attention
    return xp.mean(xp.where(weighted > 0, weighted, xp.zeros_like(weighted)), axis=-3)


def _without_residual(hat: Any, eye: Any, xp: Namespace) -> Any:
    """Chefer's eq. 8-9: ``R̄ = R̂ / rowsum(R̂) + I`` for ``R̂ = R - I`` (empty rows: ``I``)."""
    sums = xp.sum(hat, axis=-1, keepdims=True)
    safe = xp.where(sums != 0, sums, xp.ones_like(sums))
    return hat / safe + eye


@from_real_end("target_mask")
def encoder_decoder_rollout(
    encoder: Array,
    decoder: Array,
    cross: Array,
    /,
    *,
    rule: Literal["rollout", "gae"] = "rollout",
    gradients: tuple[Array, Array, Array] | None = None,
    heads: HeadFusion = "mean",
    residual: float = 0.5,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    source_mask: Any | None = None,
    target_mask: Any | None = None,
    normalize_result: bool = False,
    validate: bool | Literal["heads"] = True,
    normalize: bool | Missing = MISSING,
    xp: Namespace | None = None,
) -> EncoderDecoderAttribution:
    r"""Attribute each decoder position to the source tokens and to the target prefix.

    The encoder self-attention chain, the cross-attention layers and the decoder
    self-attention chain of an encoder-decoder transformer (BART, T5, Marian,
    ``nn.Transformer``) are rolled out separately and composed end-to-end [1]_.

    ``rule="rollout"`` (the rollout model of Abnar & Zuidema [2]_: heads fused, a residual
    of weight :math:`\alpha` in every sub-layer, feed-forward layers ignored). With
    :math:`E_k`, :math:`D_l` and :math:`C_l` the head-fused encoder self-, decoder self-
    and cross-attention (rows = queries),

    .. math::

        R_\text{enc} = \tilde E_{L_e} \cdots \tilde E_1, \qquad
        \tilde E_k = (1-\alpha) E_k + \alpha I_S

    is the share of each source token in each encoder output (``S x S``). The state of
    decoder position :math:`t` is a row of :math:`X = [X^s \mid X^t]`, ``T x (S + T)``,
    its share of every source and every target-prefix token, starting from
    :math:`X_0 = [\,0 \mid I_T\,]`. Decoder layer :math:`l` applies its two sub-layers:

    .. math::

        \text{self-attention:}\quad & Y = \tilde D_l X_{l-1}, \qquad
            \tilde D_l = (1-\alpha) D_l + \alpha I_T, \\
        \text{cross-attention:}\quad & X_l = \alpha \, Y
            + (1-\alpha) \, [\, C_l R_\text{enc} \mid 0 \,],

    i.e. :math:`X^s_l = \alpha \tilde D_l X^s_{l-1} + (1-\alpha) C_l R_\text{enc}` and
    :math:`X^t_l = \alpha \tilde D_l X^t_{l-1}`. The cross-attention reads the encoder's
    final output, whose attribution is :math:`[R_\text{enc} \mid 0]`; its residual keeps
    :math:`\alpha` of the decoder state. Every factor is row-stochastic, so each row of
    :math:`[X^s_l \mid X^t_l]` sums to one; the result is :math:`(X^s, X^t)` of the top
    (or each) decoder layer.

    ``rule="gae"`` (Chefer et al. [3]_, eqs. 5-13, as their DETR code runs them), with
    :math:`\bar A = \operatorname{mean}_h\big((\nabla_A y \odot A)^+\big)` for each family:

    .. math::

        R^{ss} &\leftarrow R^{ss} + \bar A^{ss}_k R^{ss}
            \quad (\text{encoder layers}, R^{ss} = I), \\
        R^{tt} &\leftarrow R^{tt} + \bar A^{tt}_l R^{tt}, \quad
        R^{ts} \leftarrow R^{ts} + \bar A^{tt}_l R^{ts}
            \quad (\text{decoder self-attention}, R^{tt} = I, R^{ts} = 0), \\
        R^{ts} &\leftarrow R^{ts} + (\bar R^{tt})^\top \bar A^{ts}_l \bar R^{ss}
            \quad (\text{cross-attention, after the self-attention of layer } l),

    where :math:`\bar R^{xx} = \hat R^{xx} / (\hat R^{xx} \mathbf 1) + I` with
    :math:`\hat R^{xx} = R^{xx} - I` (eqs. 8-9: the self-attention aggregation without
    its identity, rows normalised). The result is :math:`(R^{ts}, R^{tt})`. Note the
    transpose: for a causal decoder, :math:`(\bar R^{tt})^\top` is upper triangular, so
    Chefer's rule lets later positions' cross-attention reach earlier rows.

    Parameters
    ----------
    encoder : array
        Encoder self-attention ``(*batch, L_e, heads, S, S)`` (``(*batch, L_e, S, S)``
        with ``heads=None``), first layer first.
    decoder : array
        Decoder self-attention ``(*batch, L_d, heads, T, T)`` (causal or not).
    cross : array
        Cross-attention ``(*batch, L_d, heads, T, S)``: rows = decoder queries, columns =
        encoder keys, one per decoder layer. ``attnflow.adapters.torch.capture`` returns
        the three as ``cap.encoder_attentions``, ``cap.decoder_attentions`` and
        ``cap.cross_attentions``.
    rule : {"rollout", "gae"}, default "rollout"
        The composition above.
    gradients : tuple of three arrays, optional
        ``rule="gae"`` only, required there: :math:`\partial y / \partial A` for
        ``(encoder, decoder, cross)``, each of its attention's shape (every head).
    heads : {"mean", "max", "min"}, callable, array_like or None, default "mean"
        Head fusion for ``rule="rollout"``, the same for the three families (see
        :func:`fuse_heads`; weights of shape ``(heads,)`` only). ``rule="gae"`` averages
        the gradient-weighted heads and needs ``"mean"``.
    residual : float, default 0.5
        :math:`\alpha` of every sub-layer (``rule="rollout"``; ignored by ``"gae"``).
    rows : int, sequence of int or None, default None
        Decoder positions to explain, as for :func:`rollout` (negative ones from each
        sequence's last real target token where `target_mask` is given).
    layers : {"last", "all"} or int, default "last"
        The decoder layer(s) to report (the encoder is always rolled out to its top).
    source_mask, target_mask : bool array, optional
        ``(*batch, S)`` and ``(*batch, T)``, True for real tokens. Padded tokens get
        exactly zero attribution and carry none; padded decoder rows are zero. Each
        head's rows are renormalised over the real keys before fusion.
    normalize_result : bool, default False
        Divide each row of the result, ``[source | target]``, by its sum (``normalize``
        before 0.1; meant for ``"gae"``, whose rows are not normalised; rollout rows
        already sum to one).
    validate : bool or "heads", default True
        Check attention values first (finite, non-negative, rows summing to one; the
        gradients finite), where values can be read cheaply, as for :func:`rollout`.
    normalize : bool, optional
        Deprecated spelling of `normalize_result`, kept for one release (a
        DeprecationWarning).
    xp : namespace, optional
        The array namespace; inferred from the inputs by default.

    Returns
    -------
    EncoderDecoderAttribution
        A named ``(source, target)`` pair: ``source`` ``(*batch, [layers,] T, S)`` and
        ``target`` ``(*batch, [layers,] T, T)`` for ``rows=None`` (the ``T`` axis is
        dropped for an int, ``r`` for a sequence), in the library, dtype and device of
        `encoder`. A pair rather than one ``T x (S + T)`` array because seq2seq
        explainers (inseq's ``source_attributions`` / ``target_attributions``) keep the
        two apart; note inseq stores them transposed, tokens x generated steps.

    Raises
    ------
    ValueError
        On inconsistent shapes (layer counts, ``S``, ``T``, heads, batch), a bad option
        or (with `validate`) bad values.
    TypeError
        On a non-floating dtype, mixed libraries, a non-boolean mask.
    IndexError
        If `rows` or `layers` is out of range.

    See Also
    --------
    rollout : Rollout of one self-attention stack.

    Notes
    -----
    Under the rollout model the total source share of every decoder position after
    :math:`l` decoder layers is :math:`1 - \alpha^l`, whatever the attention (each
    cross-attention sub-layer brings :math:`1-\alpha` of new source mass); the attention
    decides how the mass is spread within the source and within the target.

    For ``rule="gae"`` a row of :math:`\hat R^{xx}` summing to zero (a token no layer
    has added relevance to) is left as the identity row; Chefer's code divides 0/0 and
    then zeroes every NaN of the product, which drops that layer's whole cross-attention
    term. The two agree whenever no such row exists, and both give
    :math:`R^{ts} = 0`, :math:`R^{tt} = I` for zero gradients. :math:`\hat R = R - I` is
    carried through the recurrence rather than formed by subtraction: gradient-weighted
    attention is often tiny beside the identity (about 1e-4 on a small BART), and
    :math:`R - I` in float32 would cancel most of its digits (a 2% error measured).

    References
    ----------
    .. [1] "Attention rollout" explainer (seed 001): "Encoder-decoder rollout ... computed
       separately along the encoder self-attention chain, the cross-attention layers, and
       the decoder self-attention chain, and the matrices are composed end-to-end".
    .. [2] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928
    .. [3] H. Chefer, S. Gur and L. Wolf, "Generic Attention-model Explainability for
       Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021,
       https://arxiv.org/abs/2103.15679

    Examples
    --------
    One encoder layer, one decoder layer, one head, S = T = 2:

    >>> import numpy as np
    >>> import attnflow
    >>> enc = np.array([[[[0.5, 0.5], [0.0, 1.0]]]])   # (L_e, H, S, S)
    >>> dec = np.array([[[[1.0, 0.0], [0.5, 0.5]]]])   # (L_d, H, T, T), causal
    >>> crs = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])   # (L_d, H, T, S)
    >>> source, target = attnflow.encoder_decoder_rollout(enc, dec, crs)
    >>> source
    array([[0.375, 0.125],
           [0.   , 0.5  ]])
    >>> target
    array([[0.5  , 0.   ],
           [0.125, 0.375]])
    >>> (source.sum(-1) + target.sum(-1)).tolist()
    [1.0, 1.0]
    """
    normalize_result = renamed_keyword(
        "normalize", "normalize_result", normalize, normalize_result, default=False
    )
    prepared = prepare_encoder_decoder(
        encoder,
        decoder,
        cross,
        rule=rule,
        gradients=gradients,
        heads=heads,
        residual=residual,
        rows=rows,
        layers=layers,
        source_mask=source_mask,
        target_mask=target_mask,
        normalize=normalize_result,
        validate=validate,
        xp=xp,
    )
    xp_ = prepared.xp
    if rule == "gae":
        per_layer = _gae(prepared.fused, prepared.source_mask, prepared.target_mask, xp_)
    else:
        per_layer = _rollout(
            prepared.fused, prepared.alpha, prepared.source_mask, prepared.target_mask, xp_
        )
    source, target = per_layer  # (*batch, L_d, T, S) and (*batch, L_d, T, T)
    if normalize_result:
        total = xp_.sum(source, axis=-1, keepdims=True) + xp_.sum(target, axis=-1, keepdims=True)
        safe = xp_.where(total > 0, total, xp_.ones_like(total))
        source, target = source / safe, target / safe
    if not prepared.all_layers:
        source, target = source[..., -1, :, :], target[..., -1, :, :]
    source = prepared.rows.select(source, xp_)
    target = prepared.rows.select(target, xp_)
    return EncoderDecoderAttribution(
        prepared.boundary.restore(source), prepared.boundary.restore(target)
    )


@dataclass(frozen=True)
class PreparedEncoderDecoder:
    """The three attention families of one call, checked, masked and head-fused."""

    fused: list[Any]
    """``[encoder, decoder, cross]``, ``(*batch, L, q, k)``: head-fused (the rollout
    model) or gradient-weighted (``rule="gae"``); padded queries and keys zeroed, rows
    renormalised over the real keys; decoder layers above the reported one dropped."""
    alpha: float
    source_mask: Any | None
    target_mask: Any | None
    rows: Rows
    all_layers: bool
    boundary: Boundary
    xp: Namespace


def _check_encoder_decoder(
    encoder: Array,
    decoder: Array,
    cross: Array,
    *,
    rule: str,
    gradients: object,
    heads: HeadFusion,
    residual: float,
    rows: RowSelection,
    layers: LayerSelection,
    source_mask: Any | None,
    target_mask: Any | None,
    normalize: object,
    validate: bool | Literal["heads"],
    xp: Namespace | None,
) -> _CheckedEncoderDecoder:
    """Check every argument of an encoder-decoder call against the shapes; compute nothing."""
    families = [encoder, decoder, cross]
    grads = None
    given: object = gradients  # checked at run time: callers may not be type-checked
    if given is not None:
        if not isinstance(given, tuple | list) or len(given) != 3:
            msg = (
                "`gradients` must be a tuple (encoder, decoder, cross) of three arrays; got "
                f"{describe(gradients)}. Pass the gradient of each attention family."
            )
            raise TypeError(msg)
        grads = list(given)
    names = [*_NAMES, *(f"gradients[{i}]" for i in range(len(grads or [])))]
    converted, namespace, boundary = enter_arrays(
        [*families, *(grads or []), source_mask, target_mask],
        [*names, "source_mask", "target_mask"],
        xp,
    )
    *arrays, source_mask, target_mask = converted
    families, grads = arrays[:3], (arrays[3:] or None)

    if rule not in RULES:
        msg = (
            f"`rule` must be 'rollout' or 'gae'; got {rule!r}. 'gae' needs "
            "gradients=(encoder, decoder, cross)."
        )
        raise ValueError(msg)
    fused_input = heads is None
    batch, n_enc, n_dec, n_heads, n_src, n_tgt = _check_shapes(
        dict(zip(_NAMES, families, strict=True)), fused=fused_input
    )
    if rule == "gae":
        if grads is None:
            msg = (
                "`gradients` must be given for rule='gae'; got None. Pass "
                "gradients=(encoder_gradients, decoder_gradients, cross_gradients)."
            )
            raise ValueError(msg)
        if not (isinstance(heads, str) and heads == "mean"):
            msg = (
                "`heads` must be 'mean' for rule='gae' (Chefer's rule averages "
                f"gradient-weighted heads); got {heads!r}. Drop `heads`."
            )
            raise ValueError(msg)
    elif grads is not None:
        msg = "`gradients` must be None for rule='rollout'; got three arrays. Pass rule='gae' to use gradients."
        raise ValueError(msg)
    dtype = families[0].dtype
    for name, array in zip(names, [*families, *(grads or [])], strict=True):
        check_floating(array, namespace, name=name)
        if array.dtype != dtype:
            msg = (
                f"`{name}` must have the dtype of `encoder` ({dtype}); got {array.dtype}. "
                "Cast all inputs to one dtype (attnflow does not cast silently)."
            )
            raise TypeError(msg)
    if grads is not None:
        for name, array, grad in zip(_NAMES, families, grads, strict=True):
            if tuple(grad.shape) != tuple(array.shape):
                msg = (
                    f"`gradients[{_NAMES.index(name)}]` must have the shape of `{name}` "
                    f"{tuple(array.shape)} (same layer order); got shape {tuple(grad.shape)}. "
                    f"Pass cap.{name}_gradients for `{name}`."
                )
                raise ValueError(msg)
    alpha = check_residual(residual)
    selected_rows = check_rows(rows, n_tgt)
    used_layers, all_layers = check_layers(layers, n_dec)
    do_validate = check_validate(validate)
    if not isinstance(normalize, bool):
        msg = f"`normalize_result` must be True or False; got {normalize!r}."
        raise TypeError(msg)
    device = array_device(families[0])
    layout = AttentionLayout(batch, n_enc, n_heads, n_src)
    named = isinstance(heads, str) or heads is None or callable(heads)
    # (layers, heads) weights cannot fit both L_e and L_d: only (heads,) is accepted.
    weights_shape = None if named else getattr(heads, "shape", None) or np.shape(cast("Any", heads))
    if weights_shape is not None and len(tuple(weights_shape)) != 1:
        msg = (
            f"`heads` must be per-head weights of shape ({n_heads},) (one set for all "
            f"families); got shape {tuple(weights_shape)}. Fuse each family yourself and "
            "pass heads=None."
        )
        raise ValueError(msg)
    spec = check_head_fusion(heads, layout, namespace, dtype=dtype, device=device)
    for name, family_mask, n_tokens, against in (
        ("source_mask", source_mask, n_src, "`encoder`"),
        ("target_mask", target_mask, n_tgt, "`decoder`"),
    ):
        check_mask(
            family_mask, namespace, batch_shape=batch, n_tokens=n_tokens, name=name, against=against
        )

    return _CheckedEncoderDecoder(
        families=families,
        gradients=grads,
        source_mask=source_mask,
        target_mask=target_mask,
        xp=namespace,
        boundary=boundary,
        rule=rule,
        fused_input=fused_input,
        spec=spec,
        alpha=alpha,
        rows=selected_rows,
        used_layers=used_layers,
        all_layers=all_layers,
        validate=do_validate,
    )


@dataclass(frozen=True)
class _CheckedEncoderDecoder:
    """Every argument of an encoder-decoder call, checked; nothing computed yet."""

    families: list[Any]
    """``[encoder, decoder, cross]`` as given (TensorFlow tensors converted)."""
    gradients: list[Any] | None
    source_mask: Any | None
    target_mask: Any | None
    xp: Namespace
    boundary: Boundary
    rule: str
    fused_input: bool
    spec: HeadFusionSpec
    alpha: float
    rows: Rows
    used_layers: int
    all_layers: bool
    validate: bool | Literal["heads"]


def prepare_encoder_decoder(
    encoder: Array,
    decoder: Array,
    cross: Array,
    *,
    rule: str,
    gradients: object,
    heads: HeadFusion,
    residual: float,
    rows: RowSelection,
    layers: LayerSelection,
    source_mask: Any | None,
    target_mask: Any | None,
    normalize: object,
    validate: bool | Literal["heads"],
    xp: Namespace | None,
) -> PreparedEncoderDecoder:
    """Check every argument (before any work), then mask and fuse the three families."""
    checked = _check_encoder_decoder(
        encoder,
        decoder,
        cross,
        rule=rule,
        gradients=gradients,
        heads=heads,
        residual=residual,
        rows=rows,
        layers=layers,
        source_mask=source_mask,
        target_mask=target_mask,
        normalize=normalize,
        validate=validate,
        xp=xp,
    )
    xp_, spec, fused_input = checked.xp, checked.spec, checked.fused_input
    source_mask, target_mask = checked.source_mask, checked.target_mask
    used_layers, do_validate, grads = checked.used_layers, checked.validate, checked.gradients
    enc, dec, crs = checked.families
    dec = dec[..., :used_layers, :, :] if fused_input else dec[..., :used_layers, :, :, :]
    crs = crs[..., :used_layers, :, :] if fused_input else crs[..., :used_layers, :, :, :]
    if grads is not None:
        grads = [
            grads[0],
            grads[1][..., :used_layers, :, :, :],
            grads[2][..., :used_layers, :, :, :],
        ]
    extra = 1 if fused_input else 2
    keeps = [
        _keep(source_mask, source_mask, extra, xp_),
        _keep(target_mask, target_mask, extra, xp_),
        _keep(target_mask, source_mask, extra, xp_),
    ]
    row_masks = [source_mask, target_mask, target_mask]
    valid = [
        None if m is None else xp_.reshape(m, (*m.shape[:-1], *([1] * extra), m.shape[-1], 1))
        for m in row_masks
    ]
    masked_any = source_mask is not None or target_mask is not None
    gae = checked.rule == "gae"
    every_head = checks_every_head(do_validate, spec.kind, masked=masked_any) or gae
    inputs = [enc, dec, crs]
    if do_validate and every_head:
        for name, array, rows_ok in zip(_NAMES, inputs, valid, strict=True):
            check_attention_values(array, xp_, valid_rows=rows_ok, name=name)
    if grads is not None and do_validate:
        for i, (grad, keep) in enumerate(zip(grads, keeps, strict=True)):
            check_gradients_finite(grad, xp_, keep=keep, name=f"gradients[{i}]", masks="the masks")
    inputs = [_masked(a, k, v, xp_) for a, k, v in zip(inputs, keeps, valid, strict=True)]

    if gae:
        assert grads is not None
        grads = [
            g if k is None else xp_.where(k, g, xp_.zeros_like(g))
            for g, k in zip(grads, keeps, strict=True)
        ]
        fused = [_gae_heads(a, g, xp_) for a, g in zip(inputs, grads, strict=True)]
    else:
        if not fused_input:
            valid = [None if v is None else v[..., 0, :, :] for v in valid]
        fused = [
            apply_head_fusion(a, spec, xp_, valid_rows=v)
            for a, v in zip(inputs, valid, strict=True)
        ]
        if do_validate and not every_head:
            for name, array in zip(_NAMES, fused, strict=True):
                check_attention_values(array, xp_, valid_rows=None, name=name, heads_fused=True)
    return PreparedEncoderDecoder(
        fused=fused,
        alpha=checked.alpha,
        source_mask=source_mask,
        target_mask=target_mask,
        rows=checked.rows,
        all_layers=checked.all_layers,
        boundary=checked.boundary,
        xp=xp_,
    )


def _rollout(
    fused: list[Any],
    alpha: float,
    source_mask: Any | None,
    target_mask: Any | None,
    xp: Namespace,
) -> tuple[Any, Any]:
    """Compose by the rollout model; return every decoder layer's ``(X^s, X^t)``."""
    enc, dec, crs = fused
    valid_keys = None if source_mask is None else source_mask[..., None, None, :]
    r_enc = rollout_products(
        enc, residual=alpha, rows=None, all_layers=False, valid_keys=valid_keys, xp=xp
    )
    n_tgt, n_src = crs.shape[-2], crs.shape[-1]
    state_t = _eye(n_tgt, target_mask, crs, xp)
    state_s = xp.zeros((*crs.shape[:-3], n_tgt, n_src), dtype=crs.dtype, device=array_device(crs))
    sources, targets = [], []
    for layer in range(dec.shape[-3]):
        d = dec[..., layer, :, :]
        state_t = (1.0 - alpha) * xp.matmul(d, state_t) + alpha * state_t
        state_s = (1.0 - alpha) * xp.matmul(d, state_s) + alpha * state_s
        read = xp.matmul(crs[..., layer, :, :], r_enc)
        state_s = alpha * state_s + (1.0 - alpha) * read
        state_t = alpha * state_t
        sources.append(state_s)
        targets.append(state_t)
    return xp.stack(sources, axis=-3), xp.stack(targets, axis=-3)


def _gae(
    fused: list[Any], source_mask: Any | None, target_mask: Any | None, xp: Namespace
) -> tuple[Any, Any]:
    """Run Chefer's encoder-decoder rules; return every decoder layer's ``(R^ts, R^tt)``."""
    enc, dec, crs = fused
    n_tgt, n_src = crs.shape[-2], crs.shape[-1]
    eye_s = _eye(n_src, source_mask, enc, xp)
    eye_t = _eye(n_tgt, target_mask, dec, xp)
    # R = I + R̂ is carried as R̂: gradient-weighted attention is often tiny next to the
    # identity, and forming R - I in float32 would cancel most of its digits. The
    # updates R ← R + Ā R read R̂ ← R̂ + Ā + Ā R̂.
    hat_ss = xp.zeros_like(enc[..., 0, :, :]) + xp.zeros_like(eye_s)
    for layer in range(enc.shape[-3]):
        e = enc[..., layer, :, :]
        hat_ss = hat_ss + e + xp.matmul(e, hat_ss)
    r_ss_bar = _without_residual(hat_ss, eye_s, xp)
    hat_tt = xp.zeros_like(dec[..., 0, :, :]) + xp.zeros_like(eye_t)
    r_ts = xp.zeros_like(crs[..., 0, :, :])
    sources, targets = [], []
    for layer in range(dec.shape[-3]):
        d = dec[..., layer, :, :]
        hat_tt, r_ts = hat_tt + d + xp.matmul(d, hat_tt), r_ts + xp.matmul(d, r_ts)
        r_tt_bar = _without_residual(hat_tt, eye_t, xp)
        term = xp.matmul(xp.matrix_transpose(r_tt_bar), xp.matmul(crs[..., layer, :, :], r_ss_bar))
        r_ts = r_ts + term
        sources.append(r_ts)
        targets.append(eye_t + hat_tt)
    return xp.stack(sources, axis=-3), xp.stack(targets, axis=-3)
