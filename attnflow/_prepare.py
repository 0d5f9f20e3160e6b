"""Everything before the method: from the caller's input to one attention matrix per layer.

`rollout`, `raw`, `flow`, `flow_cost` and `gradient_rollout` (with its gradients, a second
input of the same layout) share this path, so that they accept the same input forms,
validate them the same way and apply masks and head fusion identically. The
encoder-decoder pair enters its arrays here too (:func:`enter_arrays`) and checks its masks
and gradients with the same checks; only its three families' shapes are its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._gae_fused import fuse_masked_mean, host_stacks
from ._heads import apply_head_fusion, masked_head_mean
from ._namespace import (
    Boundary,
    array_device,
    enter_boundary,
    is_jax_array,
    lives_in_host_memory,
    resolve_namespace,
    values_are_inspectable,
)
from ._normalize import normalize_rows
from ._rows import Rows, take_rows
from ._typing import Namespace
from ._validation import (
    AttentionLayout,
    HeadFusionSpec,
    PruningSpec,
    check_attention_layout,
    check_attention_values,
    check_causal,
    check_exclude,
    check_floating,
    check_head_fusion,
    check_layers,
    check_mask,
    check_pruning,
    check_receptive_field,
    check_residual,
    check_row_statistics,
    check_rows,
    check_validate,
    checks_every_head,
    describe,
    row_sum_tolerance,
    sum_rows,
)

__all__ = [
    "CheckedArguments",
    "FusedLayers",
    "PreparedAttention",
    "check_arguments",
    "enter_arrays",
    "layer_of",
    "prepare_attention",
    "times_layer",
]

STREAM_BLOCK_BYTES = 1 << 20
"""Bytes of fused attention per block of rows when a fused layer is streamed into a row
chain (:meth:`FusedLayers.times`): memory beyond the input stays one block."""

STREAM_LAYER_BYTES = 8 << 20
"""Fused layers up to this size are fused whole: each block costs a few small array
calls, which shorter inputs would feel."""

STREAM_BLOCK_SHARE = 0.005
"""On an accelerator, blocks of rows are also at least this share of the input: half of
the 1 % of the input that a selected row may cost beyond it. There every array call is a
kernel launch: 1 MiB blocks of a 26 GB input were 1,536 blocks a call, 4 % of an H100's
bandwidth; blocks of 0.25 % of it, 60-67 %, and of 0.5 % (a whole layer there), 71 %.
In host memory blocks stay at 1 MiB: larger ones grew PyTorch's CPU heap to up to 2.5 %
of the input."""

STREAM_GROUP_BYTES = 64 << 20
"""On an accelerator, short fused layers are fused this many bytes at a time: one head
fusion and one set of checks for a group of consecutive layers instead of one per
layer. There the calls, not the reading, bound a short input: row 0 of a ``(32, 12, 12,
197, 197)`` stack took 2.6 ms on an H100, eight times as long as reading the stack."""


class FusedLayers:
    """Head-fused layers ``(*batch, L, n, n)``, each computed when a method first asks for it.

    Rollout's chains read every layer once, in an order of their own (top-down for
    selected rows): computing each layer there, and dropping it after use, keeps the
    memory beyond the input to about one fused layer instead of all of them. Value
    checks are reduced block by block while the data is in cache and decided by
    `check`, which runs by itself once every layer has been computed, before the method
    can return: a bad value raises the error of the eager checks, with the same rules.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        device: Any,
        xp: Namespace,
        compute: Callable[[int, tuple[int, ...] | None], Any],
        check: Callable[[], None],
        blocks: Callable[[int], Iterator[tuple[int, int, Any]]] | None = None,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.xp = xp
        self._compute = compute
        self._check = check
        self._blocks = blocks
        self._pending = set(range(shape[-3]))

    @property
    def ndim(self) -> int:
        """The number of axes of the stacked layers."""
        return len(self.shape)

    def layer(self, i: int, rows: tuple[int, ...] | None = None) -> Any:
        """Layer `i` (0 = first), ``(*batch, n, n)``, or its rows `rows`, ``(*batch, r, n)``.

        A chain that reads only some rows of a layer (the top one, for selected rows)
        asks for those: the rest of that layer is neither fused nor checked, as it
        cannot influence the result. Every check is decided after the last layer.
        """
        fused = self._compute(i, rows)
        self._pending.discard(i)
        if not self._pending:
            self.check()
        return fused

    def times(self, left: Any, i: int) -> Any:
        """``left @ layer(i)`` for row vectors `left` ``(*batch, r, n)``.

        Where the layers come in blocks of rows (a long input), the product is summed
        block by block, ``Σ_k left[..., k] @ layer(i)[k, :]``, and no whole fused layer
        is held: memory beyond the input stays one block.
        """
        if self._blocks is None:
            return self.xp.matmul(left, self.layer(i))
        total = None
        for start, stop, block in self._blocks(i):
            part = self.xp.matmul(left[..., start:stop], block)
            del block  # freed before the next block is fused: one block at a time
            total = part if total is None else total + part
        self._pending.discard(i)
        if not self._pending:
            self.check()
        return total

    def check(self) -> None:
        """Decide the value checks of every layer computed so far (once)."""
        check, self._check = self._check, _nothing
        check()

    def renormalized(self, valid_rows: Any | None) -> FusedLayers:
        """Return the same layers with each row divided by its sum (:func:`normalize_rows`).

        `valid_rows` (bool ``(*batch, n, 1)``, True = real query, or None) as there: an
        empty real row becomes a self-attention row. Rows that a chain reads (the top
        layer's selected rows) are renormalised as read; a product ``left @ layer(i)``
        (:meth:`times`) never forms the renormalised layer, it scales the row vectors
        instead, which is n times less work.
        """
        return _RenormalizedLayers(self, valid_rows)


class _RenormalizedLayers(FusedLayers):
    r"""Layers whose rows are divided by their sums, formed only where rows are read.

    With :math:`s_q` the sum of row :math:`q` of a layer :math:`A`, the renormalised
    layer :math:`\hat A` has rows :math:`A_q / s_q`, or the unit row :math:`e_q` where a
    real query's row is empty (:math:`s_q = 0`); rows whose sum is not positive
    otherwise (NaN, a padded query) are divided by one, as :func:`normalize_rows` does.
    For row vectors :math:`v` (zero on padded tokens),

    .. math::

        v \hat A = \sum_{q \,\text{not empty}} \frac{v_q}{s_q} A_q
        + \sum_{q \,\text{empty}} v_q e_q
        = (v \oslash \tilde s) A + v \odot [\text{empty}],

    with :math:`\tilde s_q = s_q` where positive, 1 elsewhere, and the scaled
    :math:`v_q / \tilde s_q` set to zero on empty rows (whose entries are finite, their
    sum being 0): an O(r n) scaling of the vectors instead of O(n²) passes over the layer.
    """

    def __init__(self, base: FusedLayers, valid_rows: Any | None) -> None:
        xp = base.xp

        def compute(i: int, rows: tuple[int, ...] | None) -> Any:
            ok = None if valid_rows is None else take_rows(valid_rows, rows, xp)
            return normalize_rows(base.layer(i, rows), xp, valid_rows=ok, rows=rows)

        super().__init__(base.shape, base.dtype, base.device, xp, compute, base.check)
        self._base = base
        self._real_columns = None if valid_rows is None else xp.matrix_transpose(valid_rows)

    def times(self, left: Any, i: int) -> Any:
        """``left @ renormalised layer(i)``, by scaling `left` (see the class)."""
        xp = self.xp
        layer = self._base.layer(i)
        sums = xp.matrix_transpose(sum_rows(layer, xp)[..., None])  # (*batch, 1, n)
        safe = xp.where(sums > 0, sums, xp.ones_like(sums))
        empty = sums == 0  # not `<= 0`: a NaN sum is not an empty row
        if self._real_columns is not None:
            empty = empty & self._real_columns
        zero = xp.zeros_like(left)
        scaled = xp.where(empty, zero, left / safe)
        product = xp.matmul(scaled, layer) + xp.where(empty, left, zero)
        self._pending.discard(i)
        if not self._pending:
            self.check()
        return product


def _nothing() -> None:
    return None


def times_layer(left: Any, fused: Any, i: int, xp: Namespace) -> Any:
    """``left @ fused[..., i, :, :]`` for fused layers (an array or :class:`FusedLayers`)."""
    if isinstance(fused, FusedLayers):
        return fused.times(left, i)
    return xp.matmul(left, fused[..., i, :, :])


def layer_of(fused: Any, i: int, rows: tuple[int, ...] | None = None, xp: Any = None) -> Any:
    """Layer `i` of fused layers ``(*batch, L, n, n)`` (an array or :class:`FusedLayers`).

    With `rows`, only those rows, ``(*batch, r, n)``.
    """
    if isinstance(fused, FusedLayers):
        return fused.layer(i, rows)
    return take_rows(fused[..., i, :, :], rows, xp)


@dataclass(frozen=True)
class CheckedArguments:
    """Every argument of a call checked against the input's shapes; nothing computed yet."""

    xp: Namespace
    boundary: Boundary
    layout: AttentionLayout
    arrays: list[Any] | None
    """The per-layer arrays, for a sequence input (not stacked yet), else None."""
    stacked: Any
    """The input array, for an array input, else None."""
    first: Any
    """The first array: its dtype and device are the call's."""
    mask: Any | None
    residual: float
    rows: Rows
    used_layers: int
    all_layers: bool
    validate: bool | Literal["heads"]
    spec: HeadFusionSpec
    pruning: PruningSpec | None
    receptive_field: bool
    exclude: tuple[int, ...]
    normalize_layers: bool
    gradient_arrays: list[Any] | None = None
    """The per-layer gradients, for a sequence of gradients, else None."""
    gradient_stacked: Any = None
    """The gradients array, for an array of gradients, else None."""

    def layer(self, i: int) -> Any:
        """Layer `i` of the input: ``(*batch, [heads,] n, n)``, never a stack of every layer."""
        if self.arrays is not None:
            return self.arrays[i]
        return (
            self.stacked[..., i, :, :]
            if self.layout.n_heads is None
            else self.stacked[..., i, :, :, :]
        )

    def gradient(self, i: int) -> Any:
        """Layer `i` of the gradients, ``(*batch, heads, n, n)`` (gradient methods only)."""
        if self.gradient_arrays is not None:
            return self.gradient_arrays[i]
        return self.gradient_stacked[..., i, :, :, :]


@dataclass(frozen=True)
class PreparedAttention:
    """Checked input, reduced to one attention matrix per used layer."""

    xp: Namespace
    boundary: Boundary
    layout: AttentionLayout
    fused: Any
    """Head-fused, masked attention ``(*batch, used_layers, n, n)``; rows sum to 1 or 0.
    A :class:`FusedLayers` where :func:`prepare_attention` was asked to stream."""
    residual: float
    rows: Rows
    all_layers: bool
    mask: Any | None
    """The checked padding mask ``(*batch, n)`` (True = real token), or None: the one
    copy the call holds (flow copies it to the host once; the maths reads `valid_keys`)."""
    per_head: Any | None = None
    """With ``heads="each"``: the masked heads of the reported layers,
    ``(*batch, reported_layers, heads, n, n)`` (every used layer with ``layers="all"``, else
    the top one); None otherwise."""
    pruning: PruningSpec | None = None
    """The checked `threshold`/`top_k`/`discard` option, or None."""
    receptive_field: bool = False
    """Normalise by the method's result on uniform causal attention (decoders)."""
    exclude: tuple[int, ...] = ()
    """Input positions left out of the attribution (attention sinks), non-negative."""

    @property
    def valid_keys(self) -> Any | None:
        """`mask` over the keys, ``(*batch, 1, 1, n)``: broadcasts against the fused layers."""
        if self.mask is None:
            return None
        batch, n = self.layout.batch_shape, self.layout.n_tokens
        return self.xp.reshape(self.mask, (*batch, 1, 1, n))

    @property
    def head_keys(self) -> Any | None:
        """`valid_keys` broadcastable against `per_head`: ``(*batch, 1, 1, 1, n)``."""
        return None if self.valid_keys is None else self.valid_keys[..., None, :, :]


def enter_arrays(
    values: Sequence[Any], names: Sequence[str], xp: Namespace | None
) -> tuple[list[Any], Namespace, Boundary]:
    """Enter a call's arrays: TensorFlow tensors converted, one namespace for all of them.

    `values` are every array the call was given, the first one the attention whose
    library the results go back to (None entries pass through); `names` their parameter
    names, for the messages. Every method starts here.
    """
    converted, boundary = enter_boundary(values, names)
    return converted, resolve_namespace(*converted, xp=xp, names=names), boundary


def _listed(value: Any, name: str, per_layer: str) -> tuple[list[Any], list[str], bool]:
    """One input as a list of arrays and their names; whether it was a per-layer sequence."""
    if not isinstance(value, list | tuple):
        return [value], [name], False
    if len(value) == 0:
        msg = (
            f"`{name}` must hold at least one layer; got an empty sequence. Pass one "
            f"{per_layer} array per layer, first layer first, as Hugging Face's "
            "`output_attentions` returns them."
        )
        raise ValueError(msg)
    return list(value), [f"{name}[{i}]" for i in range(len(value))], True


def _layout_of(
    arrays: list[Any], names: list[str], sequence: bool, *, fused: bool
) -> AttentionLayout:
    """Check one converted input (an array, or the layers of a sequence); return its layout.

    A sequence's layers must agree in shape and dtype; its layout is that of their stack.
    """
    first, name = arrays[0], names[0]
    if getattr(first, "shape", None) is None:
        msg = f"`{name}` must be an array; got {describe(first)}."
        raise TypeError(msg)
    if not sequence:
        return check_attention_layout(tuple(first.shape), fused=fused, name=name)
    stem = name.partition("[")[0]
    per_layer = "(*batch, n, n)" if fused else "(*batch, heads, n, n)"
    for layer_name, array in zip(names, arrays, strict=True):
        if getattr(array, "shape", None) is None:
            msg = f"`{layer_name}` must be an array; got {describe(array)}."
            raise TypeError(msg)
        if tuple(array.shape) != tuple(first.shape) or array.dtype != first.dtype:
            msg = (
                f"every layer in `{stem}` must have the same shape {per_layer} and "
                f"dtype; `{name}` is {describe(first)} but `{layer_name}` is "
                f"{describe(array)}."
            )
            raise ValueError(msg)
    stacked_shape = list(first.shape)
    stacked_shape.insert(len(stacked_shape) + (-3 if fused else -4) + 1, len(arrays))
    return check_attention_layout(tuple(stacked_shape), fused=fused, name=stem)


def _check_gradients_match(
    layout: AttentionLayout, gradient_layout: AttentionLayout, first: Any, first_gradient: Any
) -> None:
    """Gradients line up with the attentions: one per weight, same layer order and dtype."""
    if gradient_layout != layout:
        msg = (
            "`gradients` must have the shape of `attentions`, (*batch, layers, heads, n, n), "
            f"one gradient per attention weight: expected batch {layout.batch_shape}, "
            f"{layout.n_layers} layers, {layout.n_heads} heads, {layout.n_tokens} tokens; got "
            f"batch {gradient_layout.batch_shape}, {gradient_layout.n_layers} layers, "
            f"{gradient_layout.n_heads} heads, {gradient_layout.n_tokens} tokens. Pass dy/dA "
            "of every head of every layer, in the same layer order as the attentions (first "
            "layer first)."
        )
        raise ValueError(msg)
    if first_gradient.dtype != first.dtype:
        msg = (
            f"`gradients` must have the dtype of `attentions` ({first.dtype}); got "
            f"{first_gradient.dtype}. Cast one of them (attnflow does not cast silently)."
        )
        raise TypeError(msg)


def check_arguments(
    attentions: Any,
    *,
    heads: object,
    residual: object,
    rows: object,
    layers: object,
    mask: Any,
    validate: object,
    xp: Namespace | None,
    allow_each: bool = False,
    threshold: object = None,
    top_k: object = None,
    discard: object = None,
    receptive_field: object = False,
    exclude: object = None,
    normalize_layers: object = False,
    gradients: Any = None,
) -> CheckedArguments:
    """Check every argument against the input's shapes and dtypes; compute nothing.

    TensorFlow tensors are converted at the boundary (the only copy); everything else is
    read from shapes, dtypes and the options themselves. `gradients` (gradient-weighted
    methods) is a second input of the attentions' per-head layout, in the same form (an
    array or a per-layer sequence), checked with them.
    """
    fused_input = heads is None
    per_layer = "(*batch, n, n)" if fused_input else "(*batch, heads, n, n)"
    given, names, sequence = _listed(attentions, "attentions", per_layer)
    given_gradients: list[Any] = []
    gradient_names: list[str] = []
    gradient_sequence = False
    if gradients is not None:
        given_gradients, gradient_names, gradient_sequence = _listed(
            gradients, "gradients", per_layer
        )
    converted, namespace, boundary = enter_arrays(
        [*given, *given_gradients, mask], [*names, *gradient_names, "mask"], xp
    )
    *inputs, mask = converted
    arrays, gradient_arrays = inputs[: len(given)], inputs[len(given) :]
    layout = _layout_of(arrays, names, sequence, fused=fused_input)
    first = arrays[0]
    if gradient_arrays:
        gradient_layout = _layout_of(
            gradient_arrays, gradient_names, gradient_sequence, fused=fused_input
        )
        check_floating(first, namespace)
        check_floating(gradient_arrays[0], namespace, name="gradients")
        _check_gradients_match(layout, gradient_layout, first, gradient_arrays[0])
    else:
        check_floating(first, namespace)
    alpha = check_residual(residual)
    selected_rows = check_rows(rows, layout.n_tokens)
    used_layers, all_layers = check_layers(layers, layout.n_layers)
    do_validate = check_validate(validate)
    device = array_device(first)
    spec = check_head_fusion(
        heads, layout, namespace, dtype=first.dtype, device=device, allow_each=allow_each
    )
    pruning = check_pruning(threshold, top_k, discard)
    normalise_field = check_receptive_field(receptive_field)
    excluded = check_exclude(exclude, layout.n_tokens)
    check_mask(mask, namespace, batch_shape=layout.batch_shape, n_tokens=layout.n_tokens)
    if not isinstance(normalize_layers, bool):
        msg = (
            "`normalize_layers` must be True (divide each row of the input matrices by its sum, "
            "for non-negative token-mixing matrices such as attnflow.contributions) or "
            f"False (attention probabilities, rows summing to 1); got {normalize_layers!r}."
        )
        raise TypeError(msg)

    return CheckedArguments(
        xp=namespace,
        boundary=boundary,
        layout=layout,
        arrays=arrays if sequence else None,
        stacked=None if sequence else first,
        first=first,
        mask=mask,
        residual=alpha,
        rows=selected_rows,
        used_layers=used_layers,
        all_layers=all_layers,
        validate=do_validate,
        spec=spec,
        pruning=pruning,
        receptive_field=normalise_field,
        exclude=excluded,
        normalize_layers=normalize_layers,
        gradient_arrays=(gradient_arrays if gradient_sequence else None),
        gradient_stacked=(None if gradient_sequence or not gradient_arrays else gradient_arrays[0]),
    )


def _sums_by_product(heads: Any, *, checked: bool) -> bool:
    """Whether :func:`masked_head_mean` may sum over the real keys by a matrix product.

    Where the rows are checked: NaN on a padded key of a real row would enter such a sum,
    but that row fails the checks (its full row sum is not finite). And inside
    ``jax.jit``, which cannot check, where a `where` over every weight costs five head
    means on the CPU. Elsewhere (unchecked host or eager arrays) the sums are exact.
    """
    traced = is_jax_array(heads) and not values_are_inspectable(heads)
    return (checked and values_are_inspectable(heads)) or traced


def prepare_attention(checked: CheckedArguments, *, stream: bool = False) -> PreparedAttention:
    """Mask, normalise and fuse the used layers of a call whose arguments are checked.

    Every check on shapes, dtypes and options has run (:func:`check_arguments`, with
    ``allow_each=True`` for rollout and flow, which keeps the heads of the reported layers
    for ``heads="each"``); value checks follow here, on the layers that are used; only then
    is anything computed. The pruning, `receptive_field` and `exclude` options were checked
    there and are applied by the method. With `normalize_layers` the rows of every input
    matrix are divided by their sum instead of required to sum to one (value-aware
    token-mixing matrices); the values are then checked to be finite and non-negative only.

    With `stream` (a method that reads each fused layer once, in its own order: rollout
    without pruning or head maps) the common case, a mean or weighted mean of unmasked
    heads, returns :class:`FusedLayers`: each layer is fused and its values reduced for
    the checks when the method asks for it, so no stack of every fused layer is ever
    held.
    """
    normalize_layers = checked.normalize_layers
    namespace, layout, mask = checked.xp, checked.layout, checked.mask
    fused_input = layout.n_heads is None  # heads=None: the input's heads are fused
    arrays, stacked, spec = checked.arrays, checked.stacked, checked.spec
    used_layers, all_layers = checked.used_layers, checked.all_layers
    do_validate, normalise_field = checked.validate, checked.receptive_field
    boundary, alpha, selected_rows = checked.boundary, checked.residual, checked.rows
    pruning, excluded = checked.pruning, checked.exclude

    def prepared(fused: Any, per_head: Any | None = None) -> PreparedAttention:
        """Return the call's prepared attention: `fused` layers (and the heads of ``"each"``)."""
        return PreparedAttention(
            xp=namespace,
            boundary=boundary,
            layout=layout,
            fused=fused,
            residual=alpha,
            rows=selected_rows,
            all_layers=all_layers,
            mask=mask,
            per_head=per_head,
            pruning=pruning,
            receptive_field=normalise_field,
            exclude=excluded,
        )

    # Unmasked (weighted) means are checked on the fused layers; with a stream, each
    # layer is fused (and reduced for the checks) only when the method reads it. Masked
    # ones check every head, in the same pass that fuses it (:func:`masked_head_mean`).
    validate_fused_only = not do_validate or not (
        normalise_field or checks_every_head(do_validate, spec.kind, masked=False)
    )
    # Masked lazy arrays are fused whole: under jax.jit a reduction of one layer's slice
    # runs at a tenth of the speed of the same reduction over the whole stack.
    streamable = (
        validate_fused_only
        if mask is None
        else values_are_inspectable(checked.first) and not (do_validate and normalise_field)
    )
    if (
        stream
        and not normalize_layers
        and pruning is None
        and spec.kind in {"mean", "weights"}
        and streamable
    ):
        fused_layers = _stream_fused(checked, check=bool(do_validate))
        return prepared(fused_layers)

    # Layers above the requested one never influence it: they are neither stacked nor read.
    if arrays is not None:
        stacked = namespace.stack(arrays[:used_layers], axis=layout.layer_axis)
    elif used_layers < layout.n_layers:
        stacked = (
            stacked[..., :used_layers, :, :, :]
            if not fused_input
            else stacked[..., :used_layers, :, :]
        )

    extra_axes = 1 if fused_input else 2  # layers (and heads) between batch and tokens
    valid_rows: Any = None
    valid_keys: Any = None
    if mask is not None:
        shape = (*layout.batch_shape, *([1] * extra_axes), layout.n_tokens)
        valid_keys = namespace.reshape(mask, shape)[..., None, :]
        valid_rows = namespace.reshape(mask, shape)[..., :, None]

    # Renormalised input is checked as given, before its rows are rescaled.
    every_head = checks_every_head(
        do_validate, spec.kind, masked=mask is not None or normalize_layers
    )
    if do_validate and every_head:
        check_attention_values(
            stacked, namespace, valid_rows=valid_rows, row_sums=not normalize_layers
        )

    if mask is not None and spec.kind in {"mean", "weights"} and not normalize_layers:
        # Each head renormalised over the real keys and fused in one pass, the padded
        # queries and keys dropped from the fused layers (:func:`masked_head_mean`).
        weights = None
        if spec.kind == "weights" and spec.weights is not None:
            weights = spec.weights / namespace.sum(spec.weights, axis=-1, keepdims=True)
            if weights.ndim == 2:  # (layers, heads): only the layers in use
                weights = weights[: stacked.shape[-4], ...]
            weights = namespace.reshape(weights, (*weights.shape, 1, 1))
        device = array_device(stacked)
        fused = None
        if values_are_inspectable(stacked):
            # The compiled pass, layer by layer, as the streamed rollout fuses them (the
            # same numbers: pruning that prunes nothing is plain rollout exactly).
            fused = _compiled_masked_layers(stacked, mask, weights, namespace, device)
        if fused is None:
            fused = masked_head_mean(
                stacked,
                namespace,
                real_rows=valid_rows,
                real_keys=valid_keys,
                positions=namespace.arange(layout.n_tokens, device=device)[:, None],
                weights=weights,
                exact_sums=not _sums_by_product(stacked, checked=bool(do_validate)),
            )
        if do_validate and normalise_field:
            check_causal(fused, namespace)
        return prepared(fused)

    if mask is not None:
        # Drop padded queries and keys (whatever the framework left there, NaN included)
        # and renormalise each head's rows over the real keys: the result is then exactly
        # the attention of the cropped sequence, padded with zeros.
        keep = valid_rows & valid_keys
        stacked = namespace.where(keep, stacked, namespace.zeros_like(stacked))
        stacked = normalize_rows(stacked, namespace, valid_rows=valid_rows)
    elif normalize_layers:
        stacked = normalize_rows(stacked, namespace)

    per_head = None
    if spec.kind == "each":
        per_head = stacked if all_layers else stacked[..., -1:, :, :, :]
    if mask is not None and not fused_input:  # the heads axis goes with the fusion
        valid_rows = valid_rows[..., 0, :, :]
    fused = apply_head_fusion(
        stacked, spec, namespace, valid_rows=valid_rows, check=bool(do_validate)
    )
    if do_validate and not every_head:
        # What the method consumes, at 1/H of the cost; still before any of the method.
        check_attention_values(fused, namespace, valid_rows=None, heads_fused=not fused_input)
    if do_validate and normalise_field:
        check_causal(fused, namespace)
    return prepared(fused, per_head=per_head)


def _compiled_masked_layers(
    stacked: Any, mask: Any, weights: Any | None, xp: Namespace, device: Any
) -> Any | None:
    """Fuse checked padded layers ``(*batch, L, H, n, n)`` by the compiled pass, or None.

    `weights` are the normalised head weights, ``(H, 1, 1)`` or ``(L, H, 1, 1)``, or None.
    """
    views = host_stacks(stacked, mask)
    if views is None:
        return None
    layers = []
    for i in range(stacked.shape[-4]):
        layer_weights = None
        if weights is not None:
            layer_weights = weights[i, ...] if weights.ndim == 4 else weights
            layer_weights = xp.reshape(layer_weights, (-1,))
        fused = fuse_masked_mean(
            views[0][..., i, :, :, :],
            None,
            xp,
            mask=views[1],
            weights=layer_weights,
            device=device,
            check=False,  # checked before, every head
        )
        if fused is None:
            return None
        layers.append(fused.fused)
    return xp.stack(layers, axis=-3)


def _stream_fused(checked: CheckedArguments, *, check: bool) -> FusedLayers:
    """Stream the used layers, fused by a (weighted) mean, one by one or a group at a time.

    A long layer is streamed into a row chain in blocks of rows (:meth:`FusedLayers.times`),
    so that no whole fused layer is held. On an accelerator, where every array call is a
    kernel launch, short layers of an unmasked stack are fused a group of consecutive
    layers at a time (`STREAM_GROUP_BYTES`) and long ones in blocks of at least a share
    of the input (`STREAM_BLOCK_SHARE`), so that a call costs a few launches per group or
    block rather than a dozen per layer or per 1 MiB.

    While each fused piece (a group, a layer or a block) is in cache it is reduced to
    three numbers in four array calls: its largest and smallest row sum and its smallest
    weight (NaN carries through each). An accelerator keeps every piece's numbers; host
    memory keeps running ones (three more calls, which a CPU does not feel): small arrays
    kept alive between fused blocks, like the per-row statistics before them, keep
    PyTorch's CPU allocator from reusing the freed blocks, and its heap grew. The numbers
    are judged once every layer is fused, the largest deviation of a row sum from one
    being ``max(largest - 1, 1 - smallest)``; only when they fail are the read rows
    fused again and judged row by row (:func:`check_row_statistics`), for the eager
    checks' message.

    With a padding mask each head is renormalised over the real keys as it is fused
    (:func:`masked_head_mean`), and the checks read every head, as the eager masked
    checks do: the row sums are those of the real queries' rows (padded ones count as
    one), the smallest weight that of every weight read (padded queries included, which
    may hold anything: when it fails, the exact check, which leaves them out, decides).
    """
    xp, layout, spec, mask = checked.xp, checked.layout, checked.spec, checked.mask
    used, batch, n = checked.used_layers, layout.batch_shape, layout.n_tokens
    dtype, device = checked.first.dtype, array_device(checked.first)
    pieces: dict[str, list[Any]] = {"largest": [], "smallest": [], "low": []}
    read_rows: dict[int, tuple[int, ...] | None] = {}
    tolerance = row_sum_tolerance(xp, dtype, n)
    real_keys = None if mask is None else xp.reshape(mask, (*batch, 1, 1, n))
    exact_sums = not _sums_by_product(checked.first, checked=check)

    def layer_spec(i: int) -> HeadFusionSpec:
        if spec.kind == "weights" and spec.weights is not None and spec.weights.ndim == 2:
            return HeadFusionSpec("weights", weights=spec.weights[i, ...])
        return spec

    stacked = checked.stacked
    row_bytes = math.prod(batch) * n * (xp.finfo(dtype).bits // 8)
    layer_bytes = n * row_bytes
    # On an accelerator every array call is a launch: short layers of a stacked, unmasked
    # array are fused in groups of consecutive layers (one slice of the stack, one head
    # fusion, one set of checks), long ones in larger blocks, and the checks' numbers are
    # kept without combining them piece by piece.
    accelerator = not lives_in_host_memory(checked.first)
    group_size = 1
    if (
        accelerator
        and stacked is not None
        and mask is None
        and 0 < layer_bytes <= STREAM_LAYER_BYTES
        and values_are_inspectable(checked.first)
    ):
        group_size = max(1, STREAM_GROUP_BYTES // layer_bytes)
    grouped: dict[int, Any] = {}  # fused layers of the current group not read yet

    def fuse(i: int, rows: tuple[int, ...] | None, block: slice | None = None) -> Any:
        """Fuse rows of layer `i` (`rows`, or the rows of `block`; all for neither).

        A stacked input's heads are read in one slice that keeps the layer axis,
        ``(*batch, 1, H, r, n)``, and the axis is dropped from the fused rows, 1/H of the
        data. Eager JAX has no views: there ``stacked[..., i, :, :, :]`` is a slice and a
        squeeze, two copies of the layer, and rows or blocks taken from it a third. The
        fused values are those of the heads without the axis, to the bit. A sequence
        input's layers are arrays of their own.
        """
        if stacked is None:
            heads = checked.layer(i)
            heads = heads[..., block, :] if block is not None else take_rows(heads, rows, xp)
        else:
            layer = slice(i, i + 1)
            if block is not None:
                heads = stacked[..., layer, :, block, :]
            elif rows is None:
                heads = stacked[..., layer, :, :, :]
            elif len(rows) == 1:
                heads = stacked[..., layer, :, rows[0] : rows[0] + 1, :]
            else:  # basic indexing and a stack, as `take_rows`
                heads = xp.stack([stacked[..., layer, :, row, :] for row in rows], axis=-2)
        fused = apply_head_fusion(heads, layer_spec(i), xp, check=check)
        return fused if stacked is None else fused[..., 0, :, :]

    def real_rows_of(start: int | None, rows: tuple[int, ...] | None, count: int) -> Any:
        """Return the mask of the queries read, ``(*batch, 1, r, 1)``."""
        assert mask is not None
        if rows is not None:
            picked = xp.stack([mask[..., row] for row in rows], axis=-1)
        else:
            picked = mask[..., start : start + count] if start is not None else mask
        return xp.reshape(picked, (*batch, 1, picked.shape[-1], 1))

    def fuse_masked(i: int, heads: Any, start: int | None, rows: tuple[int, ...] | None) -> Any:
        """Fuse rows of layer `i`'s heads with the mask, reducing them for the checks."""
        count = heads.shape[-2]
        real_rows = real_rows_of(start, rows, count)
        if rows is not None:
            positions = xp.reshape(xp.asarray(rows, device=device), (-1, 1))
        else:
            first = 0 if start is None else start
            positions = xp.arange(first, first + count, device=device)[:, None]
        weights = None
        layer = layer_spec(i)
        if layer.kind == "weights" and layer.weights is not None:
            weights = layer.weights / xp.sum(layer.weights)
            weights = xp.reshape(weights, (*weights.shape, 1, 1))
        reduce_heads(heads, real_rows)
        return masked_head_mean(
            heads,
            xp,
            real_rows=real_rows,
            real_keys=real_keys,
            positions=positions,
            weights=weights,
            exact_sums=exact_sums,
        )

    # Host memory: running numbers (with larger blocks, a list grew PyTorch's CPU heap to
    # 1.4-5.3 % of a 2.4 GB input; running, 0.3-2.5 %).
    running = not accelerator

    def update(sums: Any, low: Any) -> None:
        """Keep a piece's largest and smallest row sum and smallest weight (0-d arrays)."""
        values = {"largest": xp.max(sums), "smallest": xp.min(sums), "low": low}
        for name, value in values.items():
            kept = pieces[name]
            if running and kept:  # maximum and minimum carry NaN through
                kept[0] = (xp.maximum if name == "largest" else xp.minimum)(kept[0], value)
            else:
                kept.append(value)

    def reduce(fused: Any) -> None:
        if not (check and values_are_inspectable(fused) and math.prod(fused.shape) > 0):
            return
        update(sum_rows(fused, xp), xp.min(fused))

    def reduce_heads(heads: Any, real_rows: Any) -> None:
        if not (check and values_are_inspectable(heads) and math.prod(heads.shape) > 0):
            return
        sums = sum_rows(heads, xp)  # (*batch, H, r)
        real = real_rows[..., 0]
        update(xp.where(real, sums, xp.ones_like(sums)), xp.min(heads))

    heads_of = checked.layer
    # Host memory with a mask: the compiled pass reads every weight once, for the fusion
    # and the checks (NumPy views of whole stacks: eager JAX copies each slice).
    compiled = mask is not None and values_are_inspectable(checked.first)
    stacks = None
    if compiled and checked.stacked is not None:
        stacks = host_stacks(checked.stacked, mask)

    def fuse_compiled(i: int, rows: tuple[int, ...] | None) -> Any | None:
        if not compiled:
            return None
        layer = heads_of(i) if stacks is None else stacks[0][..., i, :, :, :]
        weights = layer_spec(i).weights
        if weights is not None:
            weights = weights / xp.sum(weights)
        kernel = fuse_masked_mean(
            layer,
            rows,
            xp,
            mask=mask if stacks is None else stacks[1],
            weights=weights,
            device=device,
            check=check,
        )
        if kernel is None:
            return None
        if kernel.sums is not None and kernel.low is not None:
            update(kernel.sums, xp.min(kernel.low))  # padded rows: 1
        return kernel.fused

    def fuse_unmasked(i: int, rows: tuple[int, ...] | None, block: slice | None = None) -> Any:
        fused = fuse(i, rows, block)
        reduce(fused)
        return fused

    def fuse_group(i: int) -> Any:
        """Fuse layer `i` with the unread layers beside it in its group; return layer `i`.

        Groups are fixed runs of `group_size` layers; a layer already read (the top
        layer, read in the chain's rows only) is left out, so a top-down chain fuses
        ``[first, i]`` and a bottom-up one ``[i, last)``, each as one slice of the stack.
        """
        first = i - i % group_size
        last = min(used, first + group_size)
        low, high = i, i + 1
        while low > first and low - 1 not in read_rows:
            low -= 1
        while high < last and high not in read_rows:
            high += 1
        group_spec = spec
        if spec.kind == "weights" and spec.weights is not None and spec.weights.ndim == 2:
            group_spec = HeadFusionSpec("weights", weights=spec.weights[low:high, ...])
        fused = apply_head_fusion(stacked[..., low:high, :, :, :], group_spec, xp, check=check)
        reduce(fused)
        for j in range(low, high):
            read_rows[j] = None
            grouped[j] = fused[..., j - low, :, :]
        return grouped.pop(i)

    def compute(i: int, rows: tuple[int, ...] | None) -> Any:
        if group_size > 1 and (i in grouped or rows is None):
            layer = grouped.pop(i) if i in grouped else fuse_group(i)
            return layer if rows is None else take_rows(layer, rows, xp)
        read_rows[i] = rows
        fused = fuse_compiled(i, rows)
        if fused is not None:
            return fused
        if mask is None:
            return fuse_unmasked(i, rows)
        return fuse_masked(i, take_rows(heads_of(i), rows, xp), None, rows)

    input_bytes = layer_bytes * (layout.n_heads or 1) * used
    block_bytes = STREAM_BLOCK_BYTES
    if accelerator:
        block_bytes = max(block_bytes, int(input_bytes * STREAM_BLOCK_SHARE))
    step = max(1, block_bytes // max(1, row_bytes))
    step = -(-n // -(-n // step))  # blocks of equal size: no short block at the end

    def blocks(i: int) -> Iterator[tuple[int, int, Any]]:
        read_rows[i] = None
        heads = None
        for start in range(0, n, step):
            stop = min(n, start + step)
            fused = fuse_compiled(i, tuple(range(start, stop)))
            if fused is None and mask is None:
                fused = fuse_unmasked(i, None, slice(start, stop))
            elif fused is None:
                heads = heads_of(i) if heads is None else heads
                fused = fuse_masked(i, heads[..., start:stop, :], start, None)
            yield start, stop, fused
            del fused  # the consumer's drop of a block frees it

    def decide() -> None:
        if not pieces["low"]:
            return
        largest, smallest, low = (xp.stack(pieces[name]) for name in pieces)
        for values in pieces.values():
            values.clear()
        deviation = xp.maximum(xp.max(largest) - 1, 1 - xp.min(smallest))
        if bool(xp.logical_and(deviation <= tolerance, xp.min(low) >= 0)):  # one device sync
            return
        # A bad value: read the rows that were read again, for the eager checks' verdict
        # and message (which rows, the smallest weight, the largest deviation).
        if mask is not None:
            for i, rows in sorted(read_rows.items()):
                heads = take_rows(heads_of(i), rows, xp)
                real_rows = real_rows_of(None, rows, heads.shape[-2])
                check_attention_values(heads, xp, valid_rows=real_rows)
            return
        sums, minima = [], []
        for i, rows in sorted(read_rows.items()):
            fused = fuse(i, rows)
            sums.append(xp.reshape(sum_rows(fused, xp), (-1,)))
            minima.append(xp.reshape(xp.min(fused), (-1,)))
        check_row_statistics(
            xp.concat(sums),
            xp.concat(minima),
            xp,
            valid_rows=None,
            dtype=dtype,
            n_tokens=n,
            heads_fused=True,
        )

    shape = (*batch, used, n, n)
    # Lazy arrays (a jit trace, a Dask graph) and layers of one block get whole layers.
    streamed = (
        layer_bytes > STREAM_LAYER_BYTES and step < n and values_are_inspectable(checked.first)
    )
    return FusedLayers(shape, dtype, device, xp, compute, decide, blocks if streamed else None)
