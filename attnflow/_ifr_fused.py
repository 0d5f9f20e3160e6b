r"""IFR's proximities on host memory, through the compiled kernel.

:func:`proximities` computes, for every head :math:`h`, explained row :math:`i` and key
:math:`j`,

.. math::

    p^h_{ij} = \max\bigl(\lVert y_i\rVert_1 - \lVert y_i - A^h_{ij} f^h_j\rVert_1,\; 0\bigr)

(Ferrando & Voita 2024) without storing the ``(heads, rows, keys, d)`` parts: each is
formed in registers and reduced at once, and a key without weight (the causal triangle of
generated text's rows, a masked token) is skipped, its proximity exactly 0. Arrays whose
memory NumPy can view without a copy (NumPy, PyTorch CPU tensors, eager JAX on the CPU,
array-api-strict: DLPack) go to the kernel; anything else (a GPU, a lazy array, float16,
a source checkout without the compiled kernel) gets None, and the caller
(:func:`attnflow._logit_attribution.ifr_terms`) takes its array-API path.

The explained rows are split between `threads` threads (contiguous ranges of the
flattened ``(batch, rows)``, each written by one thread only): a row's values do not
depend on the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ._contributions_fused import _in_threads, default_threads
from ._gae_fused import _host_view
from ._namespace import array_device
from ._typing import Namespace

__all__ = ["KERNEL_AVAILABLE", "proximities"]


def _load_kernel() -> Callable[..., None] | None:
    try:
        from ._ifr_kernel import proximities as kernel
    except ImportError:  # pragma: no cover - a source checkout without the compiled kernel
        return None
    return kernel


_kernel = _load_kernel()

KERNEL_AVAILABLE = _kernel is not None

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def proximities(
    weights: Any, transformed: Any, whole: Any, xp: Namespace, threads: int | None = None
) -> Any | None:
    r""":math:`p^h_{ij}` ``(*batch, H, r, n)`` in `xp` on `weights`' device, or None.

    `weights` is ``(*batch, H, r, n)``, `transformed` :math:`f^h_j` ``(*batch, H, n, d)``,
    `whole` :math:`y_i` ``(*batch, r, d)``, all of one dtype (float32 or float64) and of
    these exact shapes (no broadcasting). `threads` (None: the CPUs this process may run
    on) share the rows; the result does not depend on how many.
    """
    kernel = _kernel
    if kernel is None:
        return None
    views: list[np.ndarray] = []
    for array in (weights, transformed, whole):
        view = _host_view(array)
        if view is None or view.dtype not in _DTYPES or (views and view.dtype != views[0].dtype):
            return None
        views.append(view)
    w, f, y = views
    if w.ndim < 3 or f.ndim != w.ndim or y.ndim != w.ndim - 1:
        return None
    *batch, heads, rows, n = w.shape
    d = f.shape[-1]
    if tuple(f.shape) != (*batch, heads, n, d) or tuple(y.shape) != (*batch, rows, d):
        return None
    count = math.prod(batch)
    if 0 in (count, heads, rows, n, d):
        return None
    w = np.ascontiguousarray(w.reshape(count, heads, rows, n))
    f = np.ascontiguousarray(f.reshape(count, heads, n, d))
    y = np.ascontiguousarray(y.reshape(count, rows, d))
    out = np.empty((count, heads, rows, n), dtype=w.dtype)
    _in_threads(
        lambda bounds, parallel, parts: kernel(w, f, y, out, int(bounds[0]), int(bounds[-1])),  # noqa: ARG005
        count * rows,
        count * rows * heads * n * d,
        default_threads() if threads is None else threads,
        None,
    )
    return xp.asarray(out.reshape(*batch, heads, rows, n), device=array_device(weights))
