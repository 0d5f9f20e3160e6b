"""Type aliases shared by the core.

Arrays are opaque here: attnflow accepts any array-API array (NumPy, PyTorch, JAX, Dask,
CuPy, array-api-strict) and TensorFlow tensors, and none of them share a static base type.
A type variable keeps the caller's array type through the public functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, TypeAlias, TypeVar

__all__ = ["Array", "ArrayT", "HeadFusion", "LayerSelection", "Namespace", "RowSelection"]

Array: TypeAlias = Any
"""Any array-API array or TensorFlow tensor."""

ArrayT = TypeVar("ArrayT")
"""The caller's array type, returned unchanged by the public functions."""

Namespace: TypeAlias = ModuleType
"""An array-API namespace, such as ``array_api_compat.numpy`` or ``jax.numpy``."""

HeadFusion: TypeAlias = (
    Literal["mean", "max", "min", "each"] | Callable[[Any], Any] | Sequence[float] | Array | None
)
"""How heads are fused: a name, a callable reducing axis -3, weights, or None (already fused).

``"each"`` (rollout and flow only) keeps every head of the reported layers."""

RowSelection: TypeAlias = int | Sequence[int] | None
"""Which output positions to explain."""

LayerSelection: TypeAlias = Literal["last", "all"] | int
"""Which layer(s) to report."""
