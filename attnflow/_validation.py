"""The checks that more than one entry point runs on what callers pass in.

Checks that belong to one concept stay with it and raise where they check (head fusion in
``_heads``, the residual in ``_residual``, namespaces in ``_namespace``, flow's options in
``_flow``), as array-api-extra does. Every message, here or there, names the parameter, says
what was expected and what was given, and how to fix it. Checks on metadata (shapes, dtypes, options) always run before any work. Checks on
values (finite, non-negative, rows summing to one) run when the values can be read cheaply
(not inside ``jax.jit``, not on a Dask graph) and can be switched off with ``validate=False``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

from ._namespace import array_device, is_numpy_array, values_are_inspectable
from ._rows import Rows
from ._typing import Array, Namespace

__all__ = [
    "AttentionLayout",
    "HeadFusionSpec",
    "PruningSpec",
    "check_attention_layout",
    "check_attention_values",
    "check_causal",
    "check_exclude",
    "check_floating",
    "check_gradients_finite",
    "check_head_fusion",
    "check_layers",
    "check_mask",
    "check_pruning",
    "check_receptive_field",
    "check_residual",
    "check_row_statistics",
    "check_rows",
    "check_validate",
    "checks_every_head",
    "describe",
    "row_sum_tolerance",
    "stored_precision",
    "sum_rows",
]

NAMED_FUSIONS = ("mean", "max", "min")


def describe(x: Any) -> str:
    """Describe an array for an error message: its type, shape and dtype."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return f"{type(x).__qualname__} {x!r}"
    return (
        f"{type(x).__module__}.{type(x).__qualname__} of shape {tuple(shape)} and dtype {x.dtype}"
    )


@dataclass(frozen=True)
class AttentionLayout:
    """Shape facts of a validated attention stack ``(*batch, layers, [heads,] n, n)``."""

    batch_shape: tuple[int, ...]
    n_layers: int
    n_heads: int | None
    n_tokens: int

    @property
    def layer_axis(self) -> int:
        """Axis of the layers, counted from the end."""
        return -3 if self.n_heads is None else -4


def check_attention_layout(
    shape: tuple[int | None, ...], *, fused: bool, name: str = "attentions"
) -> AttentionLayout:
    """Check the shape of an attention stack and return its layout."""
    expected = "(*batch, layers, n, n)" if fused else "(*batch, layers, heads, n, n)"
    min_ndim = 3 if fused else 4
    hint = (
        " With `heads=None` the heads must already be fused; pass `heads='mean'` for "
        "per-head input."
        if fused
        else " For input whose heads are already fused, pass `heads=None`."
    )
    if len(shape) < min_ndim:
        msg = (
            f"`{name}` must have shape {expected}, at least {min_ndim} dimensions; got "
            f"shape {shape} ({len(shape)} dimensions).{hint}"
        )
        raise ValueError(msg)
    if any(d is None for d in shape):
        msg = (
            f"`{name}` must have a known shape; got {shape}. Give Dask arrays known chunk "
            "sizes (`x.compute_chunk_sizes()`)."
        )
        raise ValueError(msg)
    dims = tuple(int(d) for d in shape if d is not None)
    if dims[-1] != dims[-2]:
        msg = (
            f"`{name}` must be square in its last two axes (queries x keys), {expected}; got "
            f"shape {dims} with {dims[-2]} queries and {dims[-1]} keys. attnflow follows "
            "attention across layers of one sequence, so self-attention is required."
        )
        raise ValueError(msg)
    if dims[-1] == 0 or dims[-3 if fused else -4] == 0:
        msg = f"`{name}` must hold at least one layer and one token; got shape {dims}."
        raise ValueError(msg)
    if fused:
        return AttentionLayout(dims[:-3], dims[-3], None, dims[-1])
    if dims[-3] == 0:
        msg = f"`{name}` must hold at least one head; got shape {dims}, {expected}."
        raise ValueError(msg)
    return AttentionLayout(dims[:-4], dims[-4], dims[-3], dims[-1])


def check_floating(x: Array, xp: Namespace, name: str = "attentions") -> None:
    """Check that `x` has a real floating dtype."""
    if not xp.isdtype(x.dtype, "real floating"):
        msg = (
            f"`{name}` must have a real floating dtype (float32 or float64); got {x.dtype}. "
            f"Attention weights are probabilities: cast with `{name}.astype(float32)` or "
            "the equivalent in your library (attnflow does not cast silently)."
        )
        raise TypeError(msg)
    refuse_meta(x, name)


def refuse_meta(x: object, name: str) -> None:
    """Refuse a PyTorch tensor on the 'meta' device (a shape, no values), naming it."""
    if getattr(x, "is_meta", False) is True:
        msg = (
            f"`{name}` is a PyTorch tensor on the 'meta' device: it has a shape but no values, "
            "so nothing can be computed from it. Pass a tensor with values (on 'cpu' or "
            "'cuda'): load the model's weights (for example `model.to_empty(device=...)` and "
            "`load_state_dict`) before capturing its attention."
        )
        raise ValueError(msg)


def check_n_jobs(n_jobs: object) -> int | None:
    """Check `n_jobs` (None, a positive integer or -1) and return it as an int or None.

    Any integer scalar is accepted (``numbers.Integral``: ``np.int64(2)`` too), but not a
    bool, which is an int to Python and never a number of workers.
    """
    if n_jobs is None:
        return None
    if (
        isinstance(n_jobs, bool)
        or not isinstance(n_jobs, numbers.Integral)
        or (int(n_jobs) < 1 and int(n_jobs) != -1)
    ):
        msg = (
            "`n_jobs` must be None (automatic), a positive number of threads or -1 (one "
            f"per CPU core); got {n_jobs!r}."
        )
        raise ValueError(msg)
    return int(n_jobs)


def check_residual(residual: object) -> float:
    """Check the residual weight alpha and return it as a float in [0, 1]."""
    if isinstance(residual, bool) or not isinstance(residual, numbers.Real):
        msg = (
            "`residual` must be a real number in [0, 1], the weight of the identity in "
            f"(1 - residual) * A + residual * I; got {residual!r} of type "
            f"{type(residual).__name__}. Use 0.5 for the paper's setting, 0 to disable it."
        )
        raise TypeError(msg)
    value = float(residual)
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        msg = (
            "`residual` must be in [0, 1], the weight of the identity in "
            f"(1 - residual) * A + residual * I; got {residual!r}. Use 0.5 for the paper's "
            "setting, 0 to disable it."
        )
        raise ValueError(msg)
    return value


def _as_index(value: object, name: str) -> int:
    if isinstance(value, bool):
        msg = f"`{name}` must hold integer token positions; got the boolean {value!r}."
        raise TypeError(msg)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        msg = (
            f"`{name}` must be None, an integer position or a sequence of integer positions; "
            f"got {value!r} of type {type(value).__name__}."
        )
        raise TypeError(msg) from None


def _refuse_boolean_array(value: object, name: str) -> None:
    """Refuse a boolean array of positions, from any library, before it is iterated.

    Iterating a torch bool tensor yields 0-d tensors that `operator.index` reads as 1 and
    0, so a mask would silently become positions; NumPy's booleans are refused. Refusing
    every boolean dtype makes all libraries behave alike.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None or "bool" not in str(dtype).lower():
        return
    shape = tuple(getattr(value, "shape", ()))
    msg = (
        f"`{name}` must hold integer token positions, not a boolean mask; got a boolean "
        f"array of shape {shape}. Pass the positions of the True entries instead, for "
        "example `numpy.flatnonzero(selected)` or `torch.nonzero(selected).flatten()`."
    )
    raise TypeError(msg)


def check_rows(rows: object, n_tokens: int) -> Rows:
    """Check `rows` against the sequence length; return them as :class:`Rows`.

    The positions become non-negative; an int is remembered as one row whose axis the
    result drops (the only place the library asks whether `rows` is an int).
    """
    if rows is None:
        return Rows()

    def normalise(position: int) -> int:
        if not -n_tokens <= position < n_tokens:
            msg = (
                f"`rows` must index the {n_tokens} output positions (0 to {n_tokens - 1}, "
                f"or negative from the end); got {position}."
            )
            raise IndexError(msg)
        return position % n_tokens

    _refuse_boolean_array(rows, "rows")
    if isinstance(rows, str | bytes):
        _as_index(rows, "rows")
    if isinstance(rows, Sequence) or getattr(rows, "ndim", 0) == 1:
        positions = list(rows)  # type: ignore[call-overload]
        if not positions:
            msg = "`rows` must name at least one output position; got an empty sequence."
            raise ValueError(msg)
        return Rows(tuple(normalise(_as_index(r, "rows")) for r in positions))
    return Rows((normalise(_as_index(rows, "rows")),), single=True)


def check_exclude(exclude: object, n_tokens: int) -> tuple[int, ...]:
    """Check `exclude` (attention sinks); return sorted, distinct, non-negative positions."""
    if exclude is None:
        return ()

    def normalise(position: int) -> int:
        if not -n_tokens <= position < n_tokens:
            msg = (
                f"`exclude` must index the {n_tokens} input tokens (0 to {n_tokens - 1}, "
                f"or negative from the end); got {position}."
            )
            raise IndexError(msg)
        return position % n_tokens

    _refuse_boolean_array(exclude, "exclude")
    if isinstance(exclude, str | bytes):
        _as_index(exclude, "exclude")
    if isinstance(exclude, Sequence) or getattr(exclude, "ndim", 0) == 1:
        positions = list(exclude)  # type: ignore[call-overload]
        if not positions:
            msg = (
                "`exclude` must name at least one token position (for example 0, a BOS "
                "sink); got an empty sequence. Pass None to exclude nothing."
            )
            raise ValueError(msg)
        return tuple(sorted({normalise(_as_index(p, "exclude")) for p in positions}))
    return (normalise(_as_index(exclude, "exclude")),)


def check_receptive_field(receptive_field: object) -> bool:
    """Check the `receptive_field` switch."""
    if not isinstance(receptive_field, bool):
        msg = f"`receptive_field` must be True or False; got {receptive_field!r}."
        raise TypeError(msg)
    return receptive_field


def check_causal(fused: Array, xp: Namespace) -> None:
    """Refuse non-causal attention for ``receptive_field=True`` (values permitting).

    `fused` is the masked, head-fused attention ``(..., n, n)``: padded rows and columns
    are already zero. The weight a query puts on later keys (above the diagonal) must be
    within the row-sum tolerance of zero. Skipped where values cannot be read cheaply.
    """
    if not values_are_inspectable(fused):
        return
    n = fused.shape[-1]
    rows = xp.arange(n, device=_device_of(fused))
    later = rows[None, :] > rows[:, None]
    excess = xp.where(later, fused, xp.zeros_like(fused))
    tolerance = row_sum_tolerance(xp, fused.dtype, n)
    if bool(xp.any(xp.sum(excess, axis=-1) > tolerance)):
        largest = float(xp.max(xp.sum(excess, axis=-1)))
        msg = (
            "`receptive_field=True` is for causal (decoder) attention, where query i sees "
            f"keys 0..i only; this attention puts up to {largest:.3g} of a row on later "
            "keys. Encoder attention has no causal bias to correct: drop "
            "`receptive_field`, or pass `validate=False` to normalise by the causal "
            "baseline anyway."
        )
        raise ValueError(msg)


def _device_of(x: Array) -> Any:
    from ._namespace import array_device

    return array_device(x)


def check_layers(layers: object, n_layers: int) -> tuple[int, bool]:
    """Check `layers`; return how many layers are used and whether every layer is reported."""
    if isinstance(layers, str):
        if layers == "last":
            return n_layers, False
        if layers == "all":
            return n_layers, True
        msg = f"`layers` must be 'last', 'all' or an integer layer index; got {layers!r}."
        raise ValueError(msg)
    if isinstance(layers, bool):
        msg = f"`layers` must be 'last', 'all' or an integer layer index; got {layers!r}."
        raise TypeError(msg)
    try:
        index = operator.index(layers)  # type: ignore[arg-type]
    except TypeError:
        msg = (
            f"`layers` must be 'last', 'all' or an integer layer index; got {layers!r} of "
            f"type {type(layers).__name__}."
        )
        raise TypeError(msg) from None
    if not -n_layers <= index < n_layers:
        msg = (
            f"`layers` must index the {n_layers} layers (0 to {n_layers - 1}, or negative "
            f"from the end); got {index}."
        )
        raise IndexError(msg)
    return index % n_layers + 1, False


def check_validate(validate: object) -> bool | Literal["heads"]:
    """Check the `validate` option: True, False or "heads"."""
    if validate is True or validate is False or validate == "heads":
        return validate
    msg = (
        "`validate` must be True (check the attention each layer feeds the method), "
        f"'heads' (check every head's weights) or False; got {validate!r}."
    )
    raise TypeError(msg)


def checks_every_head(validate: bool | Literal["heads"], fusion: str, *, masked: bool) -> bool:
    """Whether value checks must read every head rather than the head-fused layers.

    The mean and weighted means pass NaN and infinities through, and keep row sums and
    (for non-negative input) signs, so checking the fused layers checks what the method
    consumes while reading 1/H of the data. Fusions that renormalise (max, min, a
    callable) and masks (each head renormalised over real keys) would hide bad rows, so
    those check every head, as does ``validate="heads"``.
    """
    return validate == "heads" or masked or fusion in {"max", "min", "callable", "each"}


@dataclass(frozen=True)
class HeadFusionSpec:
    """A checked head-fusion choice."""

    kind: Literal["none", "mean", "max", "min", "weights", "callable", "each"]
    """``"each"`` keeps every head of the reported layers and fuses the layers below them
    with the mean (head-specific rollout and flow)."""
    weights: Array | None = None
    function: Callable[[Any], Any] | None = None


def check_head_fusion(
    heads: object,
    layout: AttentionLayout,
    xp: Namespace,
    *,
    dtype: Any,
    device: Any,
    allow_each: bool = False,
) -> HeadFusionSpec:
    """Check the `heads` option against the attention layout.

    ``"each"`` (head-specific maps) is accepted only where `allow_each` says the method
    supports it (rollout and flow).
    """
    if heads is None:
        return HeadFusionSpec("none")
    if isinstance(heads, str):
        if heads == "each" and allow_each:
            return HeadFusionSpec("each")
        if heads == "each":
            msg = (
                "`heads='each'` (one map per head, Abnar & Zuidema 2020, Appendix A.1) is an "
                "option of `rollout` and `flow`; this function fuses heads. Pass 'mean', "
                "'max', 'min', weights or a callable here, or index the heads axis (-3) of "
                "the input for one head's own attention."
            )
            raise ValueError(msg)
        named = (*NAMED_FUSIONS, "each") if allow_each else NAMED_FUSIONS
        if heads not in named:
            msg = (
                f"`heads` must be one of {', '.join(repr(f) for f in named)}, a "
                "callable, per-head weights of shape (heads,) or (layers, heads), or None "
                f"for input whose heads are already fused; got {heads!r}."
            )
            raise ValueError(msg)
        return HeadFusionSpec(heads)  # type: ignore[arg-type]
    if callable(heads) and not hasattr(heads, "shape"):
        return HeadFusionSpec("callable", function=heads)
    try:
        weights = xp.asarray(heads, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        msg = (
            "`heads` must be 'mean', 'max', 'min', a callable, per-head weights of shape "
            f"(heads,) or (layers, heads), or None; got {heads!r} ({exc})."
        )
        raise TypeError(msg) from None
    n_heads = layout.n_heads
    allowed = ((n_heads,), (layout.n_layers, n_heads))
    if tuple(weights.shape) not in allowed:
        msg = (
            f"`heads` weights must have shape ({n_heads},) or ({layout.n_layers}, {n_heads}) "
            f"for attentions with {layout.n_layers} layers and {n_heads} heads; got shape "
            f"{tuple(weights.shape)}."
        )
        raise ValueError(msg)
    if values_are_inspectable(weights):
        finite_nonneg = bool(xp.all(xp.isfinite(weights))) and bool(xp.all(weights >= 0))
        if not finite_nonneg:
            msg = f"`heads` weights must be finite and non-negative; got {heads!r}."
            raise ValueError(msg)
        if not bool(xp.all(xp.sum(weights, axis=-1) > 0)):
            msg = (
                "`heads` weights must give each layer a positive total weight; got "
                f"{heads!r}, whose weights are all zero in some layer."
            )
            raise ValueError(msg)
    return HeadFusionSpec("weights", weights=weights)


@dataclass(frozen=True)
class PruningSpec:
    """A checked pruning choice: at most one of threshold, top-k and discard."""

    kind: Literal["threshold", "top_k", "discard"]
    value: float | int


def check_pruning(threshold: object, top_k: object, discard: object) -> PruningSpec | None:
    """Check the pruning options of rollout and flow; None when nothing is pruned."""
    given = {
        name: value
        for name, value in (("threshold", threshold), ("top_k", top_k), ("discard", discard))
        if value is not None
    }
    if len(given) > 1:
        listed = ", ".join(f"{name}={value!r}" for name, value in given.items())
        msg = (
            "pass at most one of `threshold`, `top_k` and `discard`: each prunes the "
            f"attention its own way and their order would be arbitrary; got {listed}. "
            "Keep the one you want and drop the others."
        )
        raise ValueError(msg)
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            msg = (
                "`threshold` must be a real number, the smallest fused attention weight "
                f"kept; got {threshold!r} of type {type(threshold).__name__}. Pass for "
                "example `threshold=0.01`, or None to keep every weight."
            )
            raise TypeError(msg)
        value = float(threshold)
        if not (math.isfinite(value) and value >= 0.0):
            msg = (
                "`threshold` must be finite and non-negative, the smallest fused attention "
                f"weight kept; got {threshold!r}. Pass for example `threshold=0.01` (0 "
                "keeps every weight)."
            )
            raise ValueError(msg)
        return PruningSpec("threshold", value)
    if top_k is not None:
        if isinstance(top_k, bool):
            k: int | None = None
        else:
            try:
                k = operator.index(top_k)  # type: ignore[arg-type]
            except TypeError:
                k = None
        if k is None:
            msg = (
                "`top_k` must be an integer, the number of entries kept per row; got "
                f"{top_k!r} of type {type(top_k).__name__}. Pass for example `top_k=5`."
            )
            raise TypeError(msg)
        if k < 1:
            msg = (
                "`top_k` must be at least 1, the number of entries kept per row of each "
                f"layer; got {k}. Pass for example `top_k=5`, or None to keep every entry."
            )
            raise ValueError(msg)
        return PruningSpec("top_k", k)
    if discard is not None:
        if isinstance(discard, bool) or not isinstance(discard, numbers.Real):
            msg = (
                "`discard` must be a real number in [0, 1), the fraction of each layer's "
                f"lowest attention weights dropped; got {discard!r} of type "
                f"{type(discard).__name__}. Pass for example `discard=0.9`."
            )
            raise TypeError(msg)
        fraction = float(discard)
        if not 0.0 <= fraction < 1.0:
            msg = (
                "`discard` must be in [0, 1), the fraction of each layer's lowest attention "
                f"weights dropped; got {discard!r}. Pass for example `discard=0.9` (0 drops "
                "nothing; 1 would drop every weight but the first column)."
            )
            raise ValueError(msg)
        return PruningSpec("discard", fraction)
    return None


def check_mask(
    mask: Array | None,
    xp: Namespace,
    *,
    batch_shape: tuple[int, ...],
    n_tokens: int,
    name: str = "mask",
    against: str = "attentions",
) -> None:
    """Check a boolean padding mask of shape ``(*batch, n)``.

    `against` names the input whose tokens it masks (``encoder`` for a source mask).
    """
    if mask is None:
        return
    expected = (*batch_shape, n_tokens)
    shape = getattr(mask, "shape", None)
    if shape is None or getattr(mask, "dtype", None) is None:
        msg = (
            f"`{name}` must be a boolean array of shape {expected} (True = real token); got "
            f"{describe(mask)}."
        )
        raise TypeError(msg)
    if not xp.isdtype(mask.dtype, "bool"):
        msg = (
            f"`{name}` must have a boolean dtype (True = real token); got {mask.dtype}. "
            f"Convert an integer attention mask with `{name} == 1`."
        )
        raise TypeError(msg)
    if tuple(shape) != expected:
        msg = (
            f"`{name}` must have shape (*batch, n) = {expected} to match {against} with "
            f"batch shape {batch_shape} and {n_tokens} tokens; got shape {tuple(shape)}. "
            "Pass one entry per token of each sequence."
        )
        raise ValueError(msg)
    refuse_meta(mask, name)
    if values_are_inspectable(mask) and not bool(xp.all(xp.any(mask, axis=-1))):
        msg = (
            f"`{name}` masks every token of at least one sequence; each sequence needs at "
            "least one real token (True) to be explained. Drop that sequence from the batch."
        )
        raise ValueError(msg)


def check_gradients_finite(
    gradients: Array,
    xp: Namespace,
    *,
    keep: Array | None = None,
    name: str = "gradients",
    masks: str = "the padding `mask`",
) -> None:
    """Check that gradients are finite between real tokens (values permitting).

    `keep` (bool, broadcastable to `gradients`) marks the entries whose query and key are
    both real: padded ones may hold anything. One reduction decides (NaN and infinities
    reach the sum); the exact count is read only to word the error.
    """
    if not values_are_inspectable(gradients):
        return
    if keep is not None:
        zero = xp.zeros((), dtype=gradients.dtype, device=array_device(gradients))
        gradients = xp.where(keep, gradients, zero)
    if bool(xp.isfinite(xp.sum(gradients))):
        return
    finite = xp.isfinite(gradients)
    if not bool(xp.all(finite)):  # else finite values whose sum overflowed
        count = int(xp.count_nonzero(~finite))
        msg = (
            f"`{name}` must be finite; found {count} NaN or infinite value(s) between real "
            "tokens. Check the backward pass (a loss that overflowed, or NaN attention), "
            f"and pass {masks} if these are padded positions."
        )
        raise ValueError(msg)


_STORED_PRECISION: ContextVar[tuple[str, float] | None] = ContextVar(
    "attnflow_stored_precision", default=None
)


@contextmanager
def stored_precision(name: str, eps: float) -> Iterator[None]:
    """Within this block, attention values were stored as `name` (machine epsilon `eps`).

    A file's bfloat16 weights reach the library widened to float32: their rows deviate
    from one by bfloat16 rounding, which float32's tolerance would refuse. The tolerance
    follows the coarser of the array's dtype and the stored one.
    """
    token = _STORED_PRECISION.set((name, eps))
    try:
        yield
    finally:
        _STORED_PRECISION.reset(token)


def _precision(xp: Namespace, dtype: Any) -> tuple[str, float]:
    """Return the name and machine epsilon that bound the rounding of `dtype` values."""
    own = (str(dtype), float(xp.finfo(dtype).eps))
    stored = _STORED_PRECISION.get()
    return stored if stored is not None and stored[1] > own[1] else own


def row_sum_tolerance(xp: Namespace, dtype: Any, n_tokens: int) -> float:
    """Tolerance on |row sum - 1| for attention of `n_tokens` keys stored as `dtype`.

    Ten times the typical rounding error of a softmax row summed in `dtype` (or in the
    coarser dtype the values were stored in, see :func:`stored_precision`), and never
    below 1e-5, so that float32 attention cast up to float64 still passes.
    """
    _, eps = _precision(xp, dtype)
    return max(1e-5, 10.0 * math.sqrt(n_tokens) * eps)


def check_attention_values(
    attentions: Array,
    xp: Namespace,
    *,
    valid_rows: Array | None,
    name: str = "attentions",
    heads_fused: bool = False,
    row_sums: bool = True,
) -> None:
    """Check that attention weights are finite, non-negative and row-stochastic.

    Two reductions over the tensor: the row sums (a NaN or an infinity anywhere in a row
    makes its sum non-finite) and the row minima. Rows whose query is padded
    (`valid_rows` False) may hold anything: frameworks fill them with zeros, uniform rows
    or NaN. With `heads_fused` the tensor is the head-fused attention and the messages
    say so. ``row_sums=False`` skips the row-sum check (matrices renormalised afterwards).
    """
    if not values_are_inspectable(attentions):
        return
    check_row_statistics(
        sum_rows(attentions, xp),
        xp.min(attentions, axis=-1),
        xp,
        valid_rows=None if valid_rows is None else valid_rows[..., 0],
        dtype=attentions.dtype,
        n_tokens=attentions.shape[-1],
        name=name,
        heads_fused=heads_fused,
        row_sums=row_sums,
    )


def sum_rows(x: Array, xp: Namespace) -> Array:
    """Sum `x` over its last axis, for the value checks.

    NumPy gets a matrix-vector product with a vector of ones: BLAS reads strided blocks
    2-3 times faster than NumPy's reduction along a short last axis (measured on the
    blocks of :func:`attnflow.gradient_rollout`); NaN and infinities carry through it
    alike. Every other library reduces.
    """
    if is_numpy_array(x):
        ones = xp.ones((x.shape[-1], 1), dtype=x.dtype, device=array_device(x))
        return xp.matmul(x, ones)[..., 0]
    return xp.sum(x, axis=-1)


def check_row_statistics(
    sums: Array,
    minima: Array,
    xp: Namespace,
    *,
    valid_rows: Array | None,
    dtype: Any,
    n_tokens: int,
    name: str = "attentions",
    heads_fused: bool = False,
    row_sums: bool = True,
) -> None:
    """Judge attention from its row sums and row minima (what :func:`check_attention_values` reads).

    Lets a caller that already streams over the attention (block by block, layer by
    layer) reduce each block while it is in cache and decide once, with the same rules
    and messages. `sums` and `minima` have one entry per row, ``(..., rows)``;
    `valid_rows` (bool, broadcastable to them) marks the rows of real queries.
    """
    subject = f"`{name}`, averaged over heads," if heads_fused else f"`{name}`"
    if valid_rows is not None:
        sums = xp.where(valid_rows, sums, xp.ones_like(sums))
        minima = xp.where(valid_rows, minima, xp.zeros_like(minima))
    # Decide on the device with `bool`; read numbers (`float`) only to word an error.
    finite = xp.isfinite(sums)
    if not bool(xp.all(finite)):
        msg = (
            f"{subject} must be finite; found NaN or infinite weights in "
            f"{int(xp.count_nonzero(~finite))} row(s) of real tokens. Pass the "
            "padding `mask` if these are padded positions."
        )
        raise ValueError(msg)
    if bool(xp.any(minima < 0)):
        lowest = float(xp.min(minima))
        msg = (
            f"{subject} must be non-negative (attention probabilities); the smallest weight "
            f"is {lowest:.3g}. Pass softmax outputs, not scores or gradients."
        )
        raise ValueError(msg)
    if not row_sums:
        return
    tolerance = row_sum_tolerance(xp, dtype, n_tokens)
    deviations = xp.abs(sums - 1)
    if bool(xp.any(deviations > tolerance)):
        deviation = float(xp.max(deviations))
        msg = (
            f"{subject} rows must sum to 1 over the keys (softmax outputs, rows = queries); "
            f"the largest deviation is {deviation:.3g}, above the tolerance {tolerance:.3g} "
            f"for {_precision(xp, dtype)[0]}. Check the axis order (*batch, layers, heads, queries, "
            "keys), pass the padding `mask` for padded sequences, or pass `validate=False` "
            "for weights that are not row-stochastic on purpose."
        )
        raise ValueError(msg)
