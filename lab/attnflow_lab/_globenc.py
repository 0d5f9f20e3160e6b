"""GlobEnc's matrices aggregated as its authors do: rows never renormalised.

The lab's own copy of the aggregation that ``attnflow.explain(..., method="globenc")``
uses inside attnflow (the lab imports no private attnflow name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from array_api_compat import array_namespace

__all__ = ["compose_unnormalized"]


def compose_unnormalized(
    function: Callable[..., Any], matrices: Any, /, *, mask: Any | None = None, **options: Any
) -> Any:
    r"""Roll out (or flow through) raw token-mixing matrices, rows never renormalised.

    :math:`R_L = C_L \cdots C_1` over the raw matrices (Modarressi et al. 2022), with no
    residual and no row divided by its sum: ``function(matrices, residual=0,
    validate=False, **options)``, the padded rows and columns zeroed here (a mask given
    to :func:`attnflow.rollout` would renormalise the rows over the real keys).

    Parameters
    ----------
    function : callable
        :func:`attnflow.rollout` or :func:`attnflow.flow`.
    matrices : array of shape ``(*batch, layers, [1,] n, n)``
        The raw matrices.
    mask : bool array of shape ``(*batch, n)``, optional
        True for real tokens.
    **options
        Passed on to `function`.

    Returns
    -------
    array
        What `function` returns.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> from attnflow_lab._globenc import compose_unnormalized
    >>> c = np.array([[[2.0, 1.0], [0.0, 3.0]], [[1.0, 1.0], [1.0, 0.0]]])  # (L, n, n)
    >>> compose_unnormalized(attnflow.rollout, c, heads=None)
    array([[2., 4.],
           [2., 1.]])
    """
    if "mask" in options:
        msg = "`mask` is given twice; pass it once, as `mask`."
        raise ValueError(msg)
    options.setdefault("residual", 0.0)
    options.setdefault("validate", False)
    if mask is None:
        return function(matrices, mask=None, **options)
    xp = array_namespace(matrices, mask)
    shape = tuple(matrices.shape)
    batch = mask.ndim - 1
    if mask.dtype != xp.bool or batch < 0 or tuple(mask.shape) != (*shape[:batch], shape[-1]):
        msg = f"`mask` must be a boolean array of shape (*batch, n) for matrices of {shape}."
        raise ValueError(msg)
    extra = len(shape) - batch - 2  # the layers (and heads) axes
    keys = xp.reshape(mask, (*shape[:batch], *([1] * extra), 1, shape[-1]))
    queries = xp.reshape(mask, (*shape[:batch], *([1] * extra), shape[-1], 1))
    zeroed = xp.where(keys & queries, matrices, xp.zeros_like(matrices))
    return function(zeroed, mask=None, **options)
