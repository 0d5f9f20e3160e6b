"""The residual connection: attention mixed with the identity."""

from __future__ import annotations

from typing import Any

from ._namespace import array_device, enter_boundary, resolve_namespace
from ._typing import ArrayT, Namespace
from ._validation import check_floating, check_residual

__all__ = ["add_residual", "mix_residual"]


def mix_residual(
    attention: Any, residual: float, xp: Namespace, *, valid_keys: Any | None = None
) -> Any:
    """Return ``(1 - residual) * attention + residual * I`` for checked input.

    With `valid_keys` (bool, broadcastable to ``(..., 1, n)``) the identity is restricted to
    real tokens, so padded tokens keep all-zero rows and columns.
    """
    if residual == 0.0:
        return attention
    n = attention.shape[-1]
    identity = xp.eye(n, dtype=attention.dtype, device=array_device(attention))
    if valid_keys is not None:
        identity = xp.where(valid_keys, identity, xp.zeros_like(identity))
    if residual == 1.0:
        return identity + xp.zeros_like(attention)
    return (1.0 - residual) * attention + residual * identity


def add_residual(
    attention: ArrayT, /, *, residual: float = 0.5, xp: Namespace | None = None
) -> ArrayT:
    r"""Mix attention with the identity to account for residual connections.

    .. math::

        \tilde A = (1 - \alpha) A + \alpha I

    The paper (Abnar & Zuidema 2020, §3) uses :math:`\alpha = 0.5`, i.e.
    :math:`0.5 A + 0.5 I`: half of each token's representation at the next layer comes
    from itself through the skip connection. Row-stochastic input stays row-stochastic.

    Parameters
    ----------
    attention : array, shape (..., n, n)
        Attention (usually with heads fused), rows = queries.
    residual : float, default 0.5
        The weight :math:`\alpha \in [0, 1]` of the identity; 0 leaves `attention` as is.
    xp : namespace, optional
        The array namespace; inferred from `attention` by default.

    Returns
    -------
    array, shape (..., n, n)
        In the library, dtype and device of `attention`.

    Raises
    ------
    ValueError
        If `attention` is not square in its last two axes or `residual` is outside [0, 1].
    TypeError
        If `attention` is not floating point or `residual` is not a real number.

    See Also
    --------
    fuse_heads, rollout

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> attnflow.add_residual(np.array([[0.0, 1.0], [1.0, 0.0]]), residual=0.25)
    array([[0.25, 0.75],
           [0.75, 0.25]])
    """
    (array,), boundary = enter_boundary([attention], ["attention"])
    namespace = resolve_namespace(array, xp=xp, names=["attention"])
    shape = tuple(array.shape)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        msg = (
            "`attention` must have shape (..., n, n), square in its last two axes; got "
            f"shape {shape}."
        )
        raise ValueError(msg)
    check_floating(array, namespace, name="attention")
    alpha = check_residual(residual)
    return boundary.restore(mix_residual(array, alpha, namespace))  # type: ignore[no-any-return]
