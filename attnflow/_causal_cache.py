r"""A causal rollout cache: rollout rows of a decoder, one appended per new token.

In a causal model query :math:`i` sees keys :math:`0..i` only, so row :math:`i` of every
mixed layer :math:`\tilde A_l = (1 - \alpha) A_l + \alpha I` is zero beyond column
:math:`i`, and so is row :math:`i` of the rollout :math:`\tilde R_l = \tilde A_l \cdots
\tilde A_1`. That row depends only on rows :math:`0..i` of the layers below: it never
changes once computed, whatever tokens come after (Abnar & Zuidema 2020, eq. 1, read row
by row). Generation therefore appends one row per layer per new token, bottom-up:

.. math::

    \tilde R_l[t, :] = \tilde A_l[t, :] \, \tilde R_{l-1}
    = (1 - \alpha) \, A_l[t, :t+1] \, \tilde R_{l-1}[:t+1, :] + \alpha \, \tilde R_{l-1}[t, :],
    \qquad \tilde R_0 = I,

at a cost of :math:`O(L t^2)` for token :math:`t`, against :math:`O(L t^3)` for a rollout
of the whole prefix from scratch. :class:`CausalRolloutCache` holds the :math:`L`
lower-triangular states :math:`\tilde R_l` (``L x t x t`` numbers; 1.1 GB in float32 for
32 layers at 2,900 tokens). For ``receptive_field=True`` it also rolls out uniform causal
attention (the baseline :math:`B` of :func:`attnflow._receptive_field.normalize_attribution`),
whose rows never change either.

Written once against the array API: the states grow by concatenation (no in-place writes),
so the cache runs on every backend, JAX under ``jit`` and Dask graphs included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._namespace import (
    Boundary,
    array_device,
    enter_boundary,
    resolve_namespace,
    values_are_inspectable,
)
from ._receptive_field import normalize_attribution, uniform_causal_attention
from ._typing import Array, Namespace
from ._validation import (
    check_attention_values,
    check_floating,
    check_receptive_field,
    check_residual,
    describe,
    row_sum_tolerance,
)

__all__ = ["CausalRolloutCache"]


class CausalRolloutCache:
    r"""Rollout rows of a causal (decoder) model, appended as tokens arrive.

    Feed it, token by token or block by block, the head-fused attention rows of the new
    positions at every layer (what a decoder with a KV cache computes at each step); read
    any position's rollout row at any layer. Row :math:`t` of layer :math:`l` is

    .. math::

        \tilde R_l[t, :] = (1 - \alpha) \, A_l[t, :] \, \tilde R_{l-1}
        + \alpha \, \tilde R_{l-1}[t, :], \qquad \tilde R_0 = I,

    the row :func:`attnflow.rollout` gives on the attention of any sequence that starts
    with the same tokens (Abnar & Zuidema 2020, eq. 1; a causal model's rows never
    change once computed).

    Parameters
    ----------
    residual : float, default 0.5
        The weight :math:`\alpha` of the identity, as for :func:`attnflow.rollout`.
    receptive_field : bool, default False
        Also roll out uniform causal attention, so that :meth:`rows` can divide by it
        (``receptive_field=True`` of :func:`attnflow.rollout`). Doubles the work.
    validate : bool, default True
        Check each appended block: finite, non-negative rows summing to one, and no
        weight on later keys (causal). Skipped where values cannot be read cheaply
        (inside ``jax.jit``, on Dask graphs).

    Attributes
    ----------
    length : int
        The number of positions rolled out so far.
    n_layers : int or None
        The number of layers, fixed by the first block (None before it).

    See Also
    --------
    attnflow.rollout : The same rows, from the attention of the whole sequence.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> from attnflow._causal_cache import CausalRolloutCache
    >>> u = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    >>> layers = np.stack([u, u])  # (layers, n, n), heads fused
    >>> cache = CausalRolloutCache()
    >>> cache.append(layers[:, :2, :2])  # the prompt's two positions
    >>> cache.append(layers[:, 2:, :])  # one new token
    >>> cache.rows(2, 3)
    array([[0.2125, 0.225 , 0.5625]])
    >>> attnflow.rollout(layers, heads=None, rows=[2])
    array([[0.2125, 0.225 , 0.5625]])
    """

    def __init__(
        self, *, residual: float = 0.5, receptive_field: bool = False, validate: bool = True
    ) -> None:
        self.residual = check_residual(residual)
        self.receptive_field = check_receptive_field(receptive_field)
        given: object = validate  # checked at run time: callers may not be type-checked
        if not isinstance(given, bool):
            msg = f"`validate` must be True or False; got {validate!r}."
            raise TypeError(msg)
        self.validate = validate
        self.length = 0
        self.n_layers: int | None = None
        self._states: list[Array] = []
        self._baseline: list[Array] = []
        self._xp: Namespace | None = None
        self._boundary = Boundary()
        self._batch: tuple[int, ...] = ()
        self._dtype: Any = None

    def __repr__(self) -> str:
        return (
            f"CausalRolloutCache(length={self.length}, layers={self.n_layers}, "
            f"residual={self.residual}, receptive_field={self.receptive_field})"
        )

    # -- appending ------------------------------------------------------------------------
    def append(self, rows: Array, /) -> None:
        """Roll out the next positions: their head-fused attention rows at every layer.

        Parameters
        ----------
        rows : array, shape (*batch, layers, q, length + q)
            The attention of the ``q`` new positions (queries ``length .. length+q-1``)
            over every key so far, new ones included, at every layer (first layer first),
            heads fused: the first block is the prompt's ``(layers, P, P)`` attention, each
            later one a step's ``(layers, 1, t + 1)`` rows. Causal: no weight on a key
            after its query.

        Raises
        ------
        ValueError
            On a shape that does not continue the cache (layers, batch, keys), or (with
            `validate`) weights that are not finite, non-negative, row-stochastic and
            causal.
        TypeError
            On a non-floating dtype, another dtype or library than the first block's.
        """
        (array,), boundary = enter_boundary([rows], ["rows"])
        xp = resolve_namespace(array, xp=None, names=["rows"])
        self._check_block(array, xp)
        if self.length == 0:
            self._xp, self._boundary = xp, boundary
            self._batch, self._dtype = tuple(array.shape[:-3]), array.dtype
            self.n_layers = int(array.shape[-3])
        q = int(array.shape[-2])
        self._states = self._grown(self._states, array, xp)
        if self.receptive_field:
            uniform = uniform_causal_attention(
                self.length + q,
                valid_keys=None,
                dtype=array.dtype,
                device=array_device(array),
                xp=xp,
            )[self.length :, :]
            layers = xp.broadcast_to(uniform, (int(array.shape[-3]), q, self.length + q))
            self._baseline = self._grown(self._baseline, layers, xp)
        self.length += q

    def _check_block(self, array: Array, xp: Namespace) -> None:
        """Refuse a block that does not continue the cache, before any work."""
        shape = tuple(getattr(array, "shape", ()))
        if len(shape) < 3:
            msg = (
                "`rows` must have shape (*batch, layers, q, keys): the new positions' "
                f"head-fused attention at every layer; got {describe(array)}."
            )
            raise ValueError(msg)
        check_floating(array, xp, "rows")
        layers, q, keys = (int(d) for d in shape[-3:])
        if layers < 1 or q < 1:
            msg = f"`rows` must hold at least one layer and one new position; got shape {shape}."
            raise ValueError(msg)
        if keys != self.length + q:
            msg = (
                f"`rows` must have {self.length + q} keys: the {self.length} positions rolled "
                f"out so far and its {q} new one(s); got shape {shape}. Append every "
                "position once, in order."
            )
            raise ValueError(msg)
        if self.length:
            if layers != self.n_layers or shape[:-3] != self._batch:
                msg = (
                    f"`rows` must continue the cache's {self.n_layers} layers and batch shape "
                    f"{self._batch}; got shape {shape}."
                )
                raise ValueError(msg)
            if xp is not self._xp or array.dtype != self._dtype:
                msg = (
                    f"`rows` must have the library and dtype of the first block ({self._dtype}); "
                    f"got {describe(array)}. Convert it first."
                )
                raise TypeError(msg)
        if not (self.validate and values_are_inspectable(array)):
            return
        check_attention_values(array, xp, valid_rows=None, name="rows")
        queries = xp.arange(self.length, self.length + q, device=array_device(array))
        later = xp.arange(keys, device=array_device(array))[None, :] > queries[:, None]
        excess = xp.sum(xp.where(later, array, xp.zeros_like(array)), axis=-1)
        if bool(xp.any(excess > row_sum_tolerance(xp, array.dtype, keys))):
            msg = (
                "`rows` must be causal attention, query i seeing keys 0..i only (a "
                f"decoder); it puts up to {float(xp.max(excess)):.3g} of a row on later keys. "
                "A rollout cache is exact for causal models only: roll out the whole "
                "sequence with attnflow.rollout instead."
            )
            raise ValueError(msg)

    def _grown(self, states: list[Array], block: Array, xp: Namespace) -> list[Array]:
        """Each layer's state with the block's rows appended, bottom-up."""
        alpha, t = self.residual, self.length
        q, keys = int(block.shape[-2]), int(block.shape[-1])
        device = array_device(block)
        grown: list[Array] = []
        below: Array | None = None  # R_{l-1}, already grown to keys x keys
        for layer in range(int(block.shape[-3])):
            attention = block[..., layer, :, :]
            if below is None:  # R_0 = I: the new rows are Ã_1's own
                positions = xp.arange(keys, device=device)
                unit = xp.astype(
                    positions[None, :] == xp.arange(t, keys, device=device)[:, None], block.dtype
                )
                new = attention if alpha == 0.0 else (1.0 - alpha) * attention + alpha * unit
            else:
                product = xp.matmul(attention, below)
                new = (
                    product if alpha == 0.0 else (1.0 - alpha) * product + alpha * below[..., t:, :]
                )
            if t == 0:
                state = new
            else:
                old = states[layer]
                zeros = xp.zeros((*old.shape[:-1], q), dtype=old.dtype, device=device)
                new = xp.broadcast_to(new, (*old.shape[:-2], q, keys))
                state = xp.concat([xp.concat([old, zeros], axis=-1), new], axis=-2)
            grown.append(state)
            below = state
        return grown

    # -- reading --------------------------------------------------------------------------
    def _layer_index(self, layer: object) -> int:
        assert self.n_layers is not None
        if isinstance(layer, bool) or not isinstance(layer, int):
            msg = f"`layer` must be an int (a layer index); got {layer!r}."
            raise TypeError(msg)
        if not -self.n_layers <= layer < self.n_layers:
            msg = (
                f"`layer` must index the {self.n_layers} layers (0 to {self.n_layers - 1}, "
                f"or negative from the end); got {layer}."
            )
            raise IndexError(msg)
        return layer % self.n_layers

    def state(self, layer: int = -1) -> Array:
        """Return the rollout up to `layer`, ``(*batch, length, length)``, lower-triangular."""
        self._require_rows()
        return self._boundary.restore(self._states[self._layer_index(layer)])

    def rows(self, start: int, stop: int, *, layer: int = -1, exclude: Sequence[int] = ()) -> Array:
        """Rollout rows ``start .. stop-1`` at `layer`, ``(*batch, stop - start, length)``.

        Row ``i`` is zero beyond column ``i``. With ``receptive_field=True`` each row is
        divided by the rollout of uniform causal attention and renormalised; `exclude`
        (non-negative positions) zeroes those columns and renormalises, exactly as
        :func:`attnflow.rollout` does for those rows.
        """
        self._require_rows()
        if not (0 <= start < stop <= self.length):
            msg = (
                f"`start` and `stop` must select rows of the {self.length} positions rolled "
                f"out (0 <= start < stop <= {self.length}); got {start} and {stop}."
            )
            raise IndexError(msg)
        dropped = tuple(int(e) for e in exclude)
        if any(e < 0 for e in dropped):
            msg = f"`exclude` must hold non-negative positions; got {list(exclude)}."
            raise ValueError(msg)
        index = self._layer_index(layer)
        xp = self._xp
        assert xp is not None
        values = self._states[index][..., start:stop, :]
        if not self.receptive_field and not dropped:
            return self._boundary.restore(values)
        baseline = self._baseline[index][start:stop, :] if self.receptive_field else None
        result = normalize_attribution(values, baseline=baseline, exclude=dropped, xp=xp)
        return self._boundary.restore(result)

    def _require_rows(self) -> None:
        if self.length == 0:
            msg = "The cache is empty: append the prompt's attention rows first."
            raise RuntimeError(msg)
