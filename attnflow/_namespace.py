"""Which array library the caller uses, and the TensorFlow boundary.

The maths in attnflow is written once against the array API standard. This module is the
only place that works out which namespace a call runs in, and the only place that knows
about TensorFlow, which is not an array-API library: its tensors are converted to NumPy on
the way in (zero-copy through DLPack on the CPU) and back to TensorFlow tensors, on the
device they came from, on the way out.

No deep-learning framework is imported here: a framework is only looked up in
``sys.modules``, so if the caller holds one of its tensors it is already imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import array_api_compat
from array_api_compat import (
    array_namespace,
    is_array_api_obj,
    is_array_api_strict_namespace,
    is_cupy_array,
    is_dask_array,
    is_jax_array,
    is_numpy_array,
    is_torch_array,
    to_device,
)
from array_api_compat import device as array_device

from ._typing import Array, Namespace

__all__ = [
    "Boundary",
    "array_device",
    "array_namespace",
    "enter_boundary",
    "is_array_api_obj",
    "is_array_api_strict_namespace",
    "is_cupy_array",
    "is_dask_array",
    "is_jax_array",
    "is_numpy_array",
    "is_tensorflow_tensor",
    "is_torch_array",
    "lives_in_host_memory",
    "numpy_namespace",
    "resolve_namespace",
    "to_device",
    "values_are_inspectable",
]


def numpy_namespace() -> Namespace:
    """Return ``array_api_compat.numpy``, NumPy's array-API namespace (imported on first use)."""
    import array_api_compat.numpy

    return array_api_compat.numpy


def is_tensorflow_tensor(x: object) -> bool:
    """Return whether `x` is a TensorFlow tensor or variable, without importing TensorFlow."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return False
    return isinstance(x, tf.Tensor | tf.Variable)


def _tensorflow_to_numpy(x: Any, name: str) -> Any:
    import numpy as np

    try:
        # Zero-copy for CPU tensors; GPU tensors are copied to the host by ``numpy()``.
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError, AttributeError):
        pass
    try:
        return x.numpy()
    except (AttributeError, NotImplementedError) as exc:
        msg = (
            f"`{name}` is a symbolic TensorFlow tensor ({type(x).__name__}) with no values; "
            "attnflow needs concrete values. Call it eagerly (outside `tf.function`), or pass "
            "`tensor.numpy()`."
        )
        raise TypeError(msg) from exc


@dataclass(frozen=True)
class Boundary:
    """The caller's library, remembered so that results can be handed back in it."""

    tensorflow_device: str | None = None
    """Device of the caller's TensorFlow tensor, or None when the caller did not use TensorFlow."""

    def restore(self, result: Array) -> Array:
        """Return `result` in the caller's library (a TensorFlow tensor if it came as one)."""
        if self.tensorflow_device is None:
            return result
        import tensorflow as tf

        with tf.device(self.tensorflow_device):
            return tf.identity(tf.convert_to_tensor(result))


def enter_boundary(arrays: Sequence[Any], names: Sequence[str]) -> tuple[list[Any], Boundary]:
    """Convert any TensorFlow tensors among `arrays` to NumPy and remember where they lived.

    Parameters
    ----------
    arrays : sequence
        The caller's arrays (None entries pass through untouched).
    names : sequence of str
        The parameter name of each array, for error messages.

    Returns
    -------
    converted : list
        `arrays`, with TensorFlow tensors replaced by NumPy arrays.
    boundary : Boundary
        Hands results back as TensorFlow tensors if the first array (the attention) was one.
    """
    device: str | None = None
    converted: list[Any] = []
    for position, (array, name) in enumerate(zip(arrays, names, strict=True)):
        if is_tensorflow_tensor(array):
            if position == 0:
                device = str(array.device) or "/CPU:0"
            converted.append(_tensorflow_to_numpy(array, name))
        else:
            converted.append(array)
    return converted, Boundary(tensorflow_device=device)


def resolve_namespace(*arrays: Any, xp: Namespace | None, names: Sequence[str]) -> Namespace:
    """Return the array-API namespace of `arrays`, or `xp` when the caller gave one.

    Raises
    ------
    TypeError
        If an array is of no supported library, or the arrays mix libraries.
    """
    if xp is not None:
        return xp
    present = [(a, n) for a, n in zip(arrays, names, strict=True) if a is not None]
    if not present:
        # No array at all (`rollout(None)`): name the one the caller had to pass.
        msg = (
            f"`{names[0]}` must be an array of an array-API library (NumPy, PyTorch, JAX, "
            "Dask, CuPy, array-api-strict) or a TensorFlow tensor; got None. Pass the "
            "array itself (for attention, a model's `outputs.attentions`)."
        )
        raise TypeError(msg)
    for array, name in present:
        try:
            array_api_compat.array_namespace(array)
        except TypeError:
            msg = (
                f"`{name}` must be an array of an array-API library (NumPy, PyTorch, JAX, "
                f"Dask, CuPy, array-api-strict) or a TensorFlow tensor; got "
                f"{type(array).__module__}.{type(array).__qualname__}. Convert it, for "
                "example with `numpy.asarray(...)`."
            )
            raise TypeError(msg) from None
    try:
        return array_api_compat.array_namespace(*(a for a, _ in present))
    except TypeError:
        kinds = ", ".join(
            f"`{n}` is {type(a).__module__}.{type(a).__qualname__}" for a, n in present
        )
        msg = (
            f"all arrays must come from one array library; got {kinds}. Convert them to one "
            "library first (for a PyTorch model, `torch.as_tensor(mask, device=...)`)."
        )
        raise TypeError(msg) from None


def values_are_inspectable(x: Array) -> bool:
    """Return whether reading the values of `x` is possible and cheap.

    False for Dask arrays (reading them computes the graph) and for JAX tracers (inside
    ``jax.jit`` there are no values). Eager JAX arrays are inspectable, unlike what
    ``array_api_compat.is_lazy_array`` assumes for every JAX array.
    """
    if array_api_compat.is_dask_array(x):
        return False
    if array_api_compat.is_jax_array(x):
        jax = sys.modules["jax"]
        return not isinstance(x, jax.core.Tracer)
    return not array_api_compat.is_lazy_array(x)


def lives_in_host_memory(x: Array) -> bool:
    """Return whether `x` is held in the host's memory (a CPU array), not an accelerator's.

    Torch and JAX name a device's kind (``device.type``, ``device.platform``); CuPy arrays
    are always on a GPU; every other library here (NumPy, array-api-strict, Dask) holds
    host memory.
    """
    if array_api_compat.is_cupy_array(x):
        return False
    device = array_device(x)
    kind = getattr(device, "type", None) or getattr(device, "platform", None)
    return kind is None or kind == "cpu"
