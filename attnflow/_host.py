"""The one place where arrays cross between their device and the host.

Attention flow solves max-flow problems on the CPU on NumPy data (the compiled kernel, or
igraph);
the evaluation (`attnflow.evaluate`) builds perturbed inputs and reads model outputs on
the host. Rollout never leaves the caller's device.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._namespace import (
    _tensorflow_to_numpy,
    array_device,
    array_namespace,
    is_array_api_strict_namespace,
    is_cupy_array,
    is_dask_array,
    is_jax_array,
    is_numpy_array,
    is_tensorflow_tensor,
    is_torch_array,
    to_device,
    values_are_inspectable,
)
from ._typing import Array, Namespace

__all__ = ["from_host", "to_host"]


def to_host(x: Array, *, name: str = "attentions", keep_dtype: bool = False) -> np.ndarray:
    """Copy `x` to a float64 NumPy array on the host (Dask graphs are computed).

    With `keep_dtype`, the array keeps its dtype (token ids, masks) instead.

    Raises
    ------
    TypeError
        For arrays without values (traced inside ``jax.jit``).
    """
    if is_tensorflow_tensor(x):
        host = _tensorflow_to_numpy(x, name)
    elif is_dask_array(x):
        host = np.asarray(x)  # computes the graph: flow needs the values
    elif not values_are_inspectable(x):
        msg = (
            f"`{name}` has no values here (it is traced, e.g. inside `jax.jit`); this "
            "attnflow function works on the host and cannot be traced (attention flow "
            "solves max-flow problems; the evaluation calls a model). Call it outside "
            "`jax.jit`."
        )
        raise TypeError(msg)
    elif is_numpy_array(x):
        host = x
    elif is_torch_array(x):
        # Flow is not differentiable: the graph is detached on purpose. NumPy has no
        # bfloat16: such tensors are widened to float32, which holds them exactly.
        x = x.detach().cpu()
        host = (x.float() if x.dtype == sys.modules["torch"].bfloat16 else x).numpy()
    elif is_cupy_array(x):
        host = x.get()
    elif is_jax_array(x):
        host = np.asarray(x)  # copies from any device
    elif is_array_api_strict_namespace(array_namespace(x)):
        strict = array_namespace(x)
        host = np.asarray(strict.asarray(x, device=strict.Device("CPU_DEVICE")))
    else:
        host = np.from_dlpack(to_device(x, "cpu"))
    return np.asarray(host) if keep_dtype else np.asarray(host, dtype=np.float64)


def from_host(values: np.ndarray, *, like: Array, xp: Namespace) -> Any:
    """Hand host `values` back in the namespace, dtype and device of `like`."""
    device = array_device(like)
    if is_dask_array(like):
        return xp.asarray(values.astype(like.dtype))
    return xp.asarray(values, dtype=like.dtype, device=device)
