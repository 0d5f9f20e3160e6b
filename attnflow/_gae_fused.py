r"""The fused pass of gradient-weighted rollout on host memory, through the compiled kernel.

:func:`fuse_layer` forms one layer of :math:`\bar A = \operatorname{mean}_h (g \odot a)^+`
(Chefer et al. 2021) for arrays whose memory NumPy can view without a copy (NumPy,
PyTorch CPU tensors, eager JAX on the CPU, array-api-strict: DLPack), reading each
weight once, and hands the result back in the caller's namespace and device. Anything
else (a GPU, a lazy array, autograd-tracked tensors, float16, a source checkout without
the compiled kernel) gets None, and the caller takes its array-API path. A padding mask
goes into the same pass: padded queries and keys are dropped and each head's rows
renormalised over the real keys, as the array-API path does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._namespace import (
    array_device,
    is_dask_array,
    is_jax_array,
    is_numpy_array,
    values_are_inspectable,
)
from ._typing import Namespace


def _load_kernel(name: str) -> Callable[..., None] | None:
    """Return the compiled pass `name` of ``_gae_kernel``, or None where it is not built."""
    try:
        from . import _gae_kernel
    except ImportError:  # pragma: no cover - a source checkout without the compiled kernel
        return None
    function: Callable[..., None] = getattr(_gae_kernel, name)
    return function


_fuse = _load_kernel("fuse")
_masked_mean = _load_kernel("masked_mean")

__all__ = [
    "KERNEL_AVAILABLE",
    "FusedRows",
    "fuse_dask_layer",
    "fuse_layer",
    "fuse_masked_mean",
    "host_stacks",
]

KERNEL_AVAILABLE = _fuse is not None

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class FusedRows:
    """One fused layer and, when asked for, the statistics of its value checks.

    `fused` is ``(*batch, r, n)``; `sums` ``(*batch, H, r)`` holds the row sums of every
    head, `low` ``(1,)`` the smallest weight and `total` (0-d) the sum of the products,
    all in the caller's namespace (None without checks).
    """

    fused: Any
    sums: Any | None
    low: Any | None
    total: Any | None


def _host_view(x: Any) -> np.ndarray | None:
    """Return a NumPy view of `x`'s memory, without a copy, or None where there is none."""
    if is_numpy_array(x):
        return np.asarray(x)
    # Lazy arrays have no memory to view. (Not `values_are_inspectable`: its generic
    # test reshapes the array, which copies a strided layer of array-api-strict.)
    if is_dask_array(x) or (is_jax_array(x) and not values_are_inspectable(x)):
        return None
    try:
        # BufferError off the CPU; RuntimeError for tensors that require gradients.
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError, AttributeError):
        return None


def host_stacks(*arrays: Any) -> list[np.ndarray] | None:
    """NumPy views of whole stacked inputs (all of them), or None where one has none.

    Taken once per call, so that each layer is a NumPy view: eager JAX copies every
    slice of an array (a layer of attention and of gradients, each time).
    """
    if _fuse is None:
        return None
    views = [_host_view(x) for x in arrays]
    if any(v is None for v in views):
        return None
    return views  # type: ignore[return-value]


def fuse_layer(
    attention: Any,
    gradient: Any,
    rows: tuple[int, ...] | None,
    xp: Namespace,
    *,
    check: bool,
    mask: Any | None = None,
    device: Any | None = None,
) -> FusedRows | None:
    r"""Layer :math:`\bar A_l` (its rows `rows`) by the compiled kernel, or None.

    `attention` and `gradient` are one layer, ``(*batch, H, n, n)``, of one dtype;
    `rows` are non-negative row positions (None: every row); `mask` the boolean
    ``(*batch, n)`` padding mask (True for real tokens) or None. With a mask, the row
    sums in `sums` are 1 for padded queries and the smallest weight is over real rows.
    """
    if _fuse is None:
        return None
    a, g = _host_view(attention), _host_view(gradient)
    if a is None or g is None or a.dtype not in _DTYPES or g.dtype != a.dtype:
        return None
    *batch, heads, n, _ = a.shape
    if math.prod(batch) == 0 or heads == 0 or n == 0:
        return None
    a = a.reshape(-1, heads, n, n)
    g = g.reshape(-1, heads, n, n)
    if n > 1 and (a.strides[-1] != a.itemsize or g.strides[-1] != g.itemsize):
        return None
    keys: np.ndarray | None = None
    if mask is not None:
        m = _host_view(mask)
        if m is None or m.dtype != np.bool_:
            return None
        keys = _key_weights(m, batch, n, a.dtype)
    picked, out, sums = _outputs(a, rows, check=check)
    stats = np.empty(2, dtype=a.dtype)
    _fuse(a, g, picked, keys, out, sums, stats, check)
    device = array_device(attention) if device is None else device
    return _fused_rows(out, sums, stats, batch, xp, device, check=check)


def _key_weights(mask: np.ndarray, batch: list[int], n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """Return the padding mask ``(*batch, n)`` as the kernels read it, ``(count, n)``."""
    return np.broadcast_to(mask, (*batch, n)).reshape(-1, n).astype(dtype)


def _outputs(
    a: np.ndarray, rows: tuple[int, ...] | None, *, check: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the rows to fuse of heads `a` ``(count, H, n, n)`` and the kernel's outputs.

    Returns the row positions, the fused rows ``(count, r, n)`` and every head's row sums
    ``(count, H, r)`` (a placeholder without checks).
    """
    count, heads, n = a.shape[0], a.shape[1], a.shape[-1]
    picked = np.arange(n, dtype=np.intp) if rows is None else np.asarray(rows, dtype=np.intp)
    out = np.empty((count, picked.size, n), dtype=a.dtype)
    sums = np.empty((count, heads, picked.size) if check else (1, 1, 1), dtype=a.dtype)
    return picked, out, sums


def _fused_rows(
    out: np.ndarray,
    sums: np.ndarray,
    stats: np.ndarray,
    batch: list[int],
    xp: Namespace,
    device: Any,
    *,
    check: bool,
) -> FusedRows:
    """Return a kernel's outputs in the caller's namespace and device, batch axes back.

    `stats` holds the smallest weight, then (the gradient pass) the sum of the products.
    """

    def back(values: np.ndarray) -> Any:
        return xp.asarray(values, device=device)

    _, r, n = out.shape
    fused = back(out.reshape(*batch, r, n))
    if not check:
        return FusedRows(fused, None, None, None)
    total = back(stats[1]) if stats.size > 1 else None
    return FusedRows(fused, back(sums.reshape(*batch, sums.shape[1], r)), back(stats[:1]), total)


def fuse_masked_mean(
    attention: Any,
    rows: tuple[int, ...] | None,
    xp: Namespace,
    *,
    mask: Any,
    weights: Any | None = None,
    device: Any | None = None,
    check: bool = True,
) -> FusedRows | None:
    r"""Return a padded layer's (weighted) head mean, heads renormalised over real keys.

    Rows `rows` (None: all) of :math:`\sum_h w_h \hat W_h` for one layer ``(*batch, H,
    n, n)``, with :math:`\hat W_h` head :math:`h` with padded queries and keys dropped and
    its rows divided by their sums over the real keys (the unit row where a real query
    has none), as the array-API preparation forms it (:func:`attnflow._heads.
    masked_head_mean`), by the compiled pass: every weight read once, and with `check`
    every head's row sums and the smallest weight of the real rows reduced in the same
    pass (`sums` ``(*batch, H, r)``, 1 for padded queries; `low` ``(1,)``). `weights`
    ``(H,)`` sum to one (None: the mean). None where the compiled pass does not apply.
    """
    if _masked_mean is None:
        return None
    a = _host_view(attention)
    m = _host_view(mask)
    if a is None or m is None or a.dtype not in _DTYPES or m.dtype != np.bool_ or a.ndim < 3:
        return None
    *batch, heads, n, _ = a.shape
    if math.prod(batch) == 0 or heads == 0 or n == 0:
        return None
    a = a.reshape(-1, heads, n, n)
    if n > 1 and a.strides[-1] != a.itemsize:
        return None
    if weights is None:
        w = np.full(heads, 1.0 / heads, dtype=a.dtype)
    else:
        host = _host_view(weights)
        if host is None:
            return None
        w = np.ascontiguousarray(np.asarray(host, dtype=a.dtype).reshape(heads))
    keys = _key_weights(m, batch, n, a.dtype)
    picked, out, sums = _outputs(a, rows, check=check)
    stats = np.empty(1, dtype=a.dtype)
    _masked_mean(a, picked, keys, w, out, sums, stats, check)
    device = array_device(attention) if device is None else device
    return _fused_rows(out, sums, stats, batch, xp, device, check=check)


def fuse_dask_layer(
    attention: Any, gradient: Any, rows: tuple[int, ...] | None, mask: Any | None
) -> Any | None:
    r"""Layer :math:`\bar A_l` of Dask arrays as a lazy map of the compiled pass, or None.

    Each block of the batch is fused by :func:`fuse_layer` when the graph is computed
    (no checks: Dask values are not inspected), so Dask gets the one-read pass too. None
    where it does not apply: no compiled kernel, other dtypes, heads or tokens split
    into several chunks, chunks that are not NumPy arrays.
    """
    if _fuse is None or not (is_dask_array(attention) and is_dask_array(gradient)):
        return None
    a, g = attention, gradient
    if a.dtype not in _DTYPES or g.dtype != a.dtype or a.ndim < 4:
        return None
    if not isinstance(a._meta, np.ndarray) or not isinstance(g._meta, np.ndarray):
        return None
    if any(len(c) != 1 for c in (*a.chunks[-3:], *g.chunks[-3:])):
        return None
    import dask.array as da

    if g.chunks != a.chunks:
        g = g.rechunk(a.chunks)  # type: ignore[no-untyped-call,unused-ignore]
    batch_chunks = a.chunks[:-3]
    n = a.shape[-1]
    r = n if rows is None else len(rows)
    keys = None
    if mask is not None:
        if not is_dask_array(mask) or mask.dtype != np.bool_:
            return None
        # As many axes as the attention, so that map_blocks pairs the blocks of the batch.
        keys = mask.reshape((*a.shape[:-3], 1, 1, n))  # type: ignore[no-untyped-call,unused-ignore]
        keys = keys.rechunk((*batch_chunks, (1,), (1,), (n,)))
    import array_api_compat.numpy as xp_numpy

    def block(a_block: np.ndarray, g_block: np.ndarray, *k: np.ndarray) -> np.ndarray:
        m = k[0].reshape(*k[0].shape[:-3], n) if k else None
        fused = fuse_layer(a_block, g_block, rows, xp_numpy, check=False, mask=m)
        if fused is None:  # an empty block: nothing to fuse
            return np.zeros((*a_block.shape[:-3], 1, r, n), dtype=a_block.dtype)
        return np.asarray(fused.fused)[..., None, :, :]

    # The head axis is kept (length 1) and dropped afterwards: a dropped axis would make
    # map_blocks concatenate (copy) every input block first.
    args = [a, g] if keys is None else [a, g, keys]
    fused = da.map_blocks(  # type: ignore[no-untyped-call,unused-ignore]
        block,
        *args,
        chunks=(*batch_chunks, (1,), (r,), (n,)),
        dtype=a.dtype,
        meta=np.empty((0,) * a.ndim, dtype=a.dtype),
    )
    return fused[..., 0, :, :]
