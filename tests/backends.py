"""The cross-backend test matrix, shared by ``tests/`` and ``property_tests/``.

Backends are chosen with ``ATTNFLOW_TEST_BACKENDS`` (a comma list of numpy,
array_api_strict, torch, jax, dask, tensorflow, or "all"; default
"numpy,array_api_strict"). A requested backend that is not installed fails the run:
a matrix cell must never turn green by being skipped. ``ATTNFLOW_TEST_DEVICE=cuda``
adds the GPU variants of torch and JAX.

Each backend variant knows how to make a native array from NumPy, bring one back, run a
function (under ``jax.jit`` for the ``jax-jit`` variant; with computing forbidden for
Dask, so the library must build a lazy graph), and check that a result is of the
caller's library, dtype and device.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

ALL_BACKENDS = ("numpy", "array_api_strict", "torch", "jax", "dask", "tensorflow")
DEFAULT_BACKENDS = ("numpy", "array_api_strict")

__all__ = ["ALL_BACKENDS", "Variant", "selected_variants", "tolerance"]


def tolerance(dtype_name: str) -> float:
    """Agreement with the float64 oracle: 1e-10 in float64, 1e-5 in float32."""
    return 1e-10 if dtype_name == "float64" else 1e-5


@dataclass(frozen=True)
class Variant:
    """One cell of the backend matrix: a library on one device, eager or compiled."""

    id: str
    library: str
    device: Any = None
    jit: bool = False
    modules: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- conversion ------------------------------------------------------------------
    def asarray(self, array: np.ndarray, dtype_name: str | None = None) -> Any:
        """A native array (on this variant's device) holding `array`."""
        array = np.asarray(array)
        if dtype_name is not None:
            array = array.astype(dtype_name)
        m = self.modules
        if self.library == "numpy":
            return array
        if self.library == "array_api_strict":
            return m["xp"].asarray(array, device=self.device)
        if self.library == "torch":
            return m["torch"].asarray(array, device=self.device)
        if self.library == "jax":
            return m["jax"].device_put(m["jnp"].asarray(array), self.device)
        if self.library == "dask":
            return m["da"].from_array(array, chunks=array.shape[:1] + (-1,) * (array.ndim - 1))
        if self.library == "tensorflow":
            with m["tf"].device(self.device):
                return m["tf"].constant(array)
        raise AssertionError(self.library)

    def to_numpy(self, x: Any) -> np.ndarray:
        """The values of a native array as NumPy."""
        if self.library == "array_api_strict":
            x = self.modules["xp"].asarray(x, device=self.modules["xp"].Device("CPU_DEVICE"))
            return np.asarray(x)
        if self.library == "torch":
            return x.detach().cpu().numpy()
        if self.library == "dask":
            return np.asarray(x.compute())
        if self.library == "tensorflow":
            return np.asarray(x.numpy())
        return np.asarray(x)

    # -- running -----------------------------------------------------------------------
    def run(self, function: Callable[..., Any], attentions: Any, **options: Any) -> Any:
        """Call ``function(attentions, **options)`` the way this variant's users would."""
        if self.jit:
            jax = self.modules["jax"]
            if "mask" not in options:
                return jax.jit(lambda a: function(a, **options))(attentions)
            mask = options.pop("mask")
            return jax.jit(lambda a, m: function(a, mask=m, **options))(attentions, mask)
        if self.library == "dask":
            import dask

            # Computing anything while building the result is a defect: it would run the
            # user's graph several times. Make it fail loudly.
            with dask.config.set(scheduler=_forbid_compute):
                return function(attentions, **options)
        return function(attentions, **options)

    def refuses_jit(self, method: str, attentions: Any, **options: Any) -> bool:
        """Under ``jax.jit``, check that a host-only method refuses clearly; else False.

        Which methods run on the host (max-flow) is the method registry's word
        (``attnflow._methods``), so a new host-only method gets this check for free.
        """
        from attnflow._methods import METHODS

        spec = METHODS[method]
        if not (self.jit and spec.host_only):
            return False
        with pytest.raises(TypeError, match=r"outside `jax\.jit`"):
            self.run(spec.function(), attentions, **options)  # traced, the mask too
        return True

    # -- checking ---------------------------------------------------------------------
    def check(self, result: Any, *, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Assert library, dtype, shape and device of `result`; return its values."""
        m = self.modules
        assert tuple(result.shape) == shape, (tuple(result.shape), shape)
        if self.library == "numpy":
            assert type(result) is np.ndarray, type(result)
            assert result.dtype == np.dtype(dtype_name)
        elif self.library == "array_api_strict":
            # array_api_strict exports no `Array` name: compare with the class of one of its
            # own arrays, so that a NumPy array (or anything else) fails here.
            strict_array = type(m["xp"].asarray(0.0))
            assert type(result) is strict_array, type(result)
            assert result.dtype == getattr(m["xp"], dtype_name)
            assert result.device == self.device, (result.device, self.device)
        elif self.library == "torch":
            assert isinstance(result, m["torch"].Tensor), type(result)
            assert result.dtype == getattr(m["torch"], dtype_name)
            # "cuda" names the current CUDA device; results report it as "cuda:0".
            expected = m["torch"].empty(0, device=self.device).device
            assert result.device == expected, (result.device, expected)
        elif self.library == "jax":
            assert isinstance(result, m["jax"].Array), type(result)
            assert result.dtype == np.dtype(dtype_name)
            assert result.devices() == {self.device}, result.devices()
        elif self.library == "dask":
            assert isinstance(result, m["da"].Array), type(result)
            assert result.dtype == np.dtype(dtype_name)
        elif self.library == "tensorflow":
            assert isinstance(result, m["tf"].Tensor), type(result)
            assert result.dtype == getattr(m["tf"], dtype_name)
            assert self.device in result.device, (result.device, self.device)
        return self.to_numpy(result)


def _forbid_compute(*args: object, **kwargs: object) -> object:
    msg = "attnflow computed a Dask graph while building its result"
    raise AssertionError(msg)


def _requested() -> tuple[str, ...]:
    raw = os.environ.get("ATTNFLOW_TEST_BACKENDS", "").strip()
    if not raw:
        return DEFAULT_BACKENDS
    if raw == "all":
        return ALL_BACKENDS
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    unknown = sorted(set(names) - set(ALL_BACKENDS))
    if unknown:
        msg = f"ATTNFLOW_TEST_BACKENDS names unknown backends {unknown}; known: {ALL_BACKENDS}"
        raise pytest.UsageError(msg)
    return names


def _load(library: str, gpu: bool) -> list[Variant]:
    try:
        if library == "numpy":
            return [Variant("numpy", "numpy")]
        if library == "array_api_strict":
            xp = importlib.import_module("array_api_strict")
            xp.set_array_api_strict_flags(data_dependent_shapes=False)
            modules = {"xp": xp}
            return [
                Variant("array_api_strict", library, xp.Device("CPU_DEVICE"), modules=modules),
                Variant("array_api_strict-device1", library, xp.Device("device1"), modules=modules),
            ]
        if library == "torch":
            torch = importlib.import_module("torch")
            devices = ["cpu"] + (["cuda"] if gpu else [])
            if gpu and not torch.cuda.is_available():
                msg = "ATTNFLOW_TEST_DEVICE=cuda but torch sees no CUDA device"
                raise pytest.UsageError(msg)
            return [Variant(f"torch-{d}", library, d, modules={"torch": torch}) for d in devices]
        if library == "jax":
            jax = importlib.import_module("jax")
            jax.config.update("jax_enable_x64", True)  # float64 cells need it
            modules = {"jax": jax, "jnp": importlib.import_module("jax.numpy")}
            devices = [jax.devices("cpu")[0]] + ([jax.devices("gpu")[0]] if gpu else [])
            if gpu:
                # JAX computes float32 matmuls on GPUs in TF32 by default (about 3 decimal
                # digits); the oracle comparisons are of the library's maths at full float32.
                jax.config.update("jax_default_matmul_precision", "highest")
            out = []
            for device in devices:
                tag = device.platform
                out.append(Variant(f"jax-{tag}", library, device, modules=modules))
                out.append(Variant(f"jax-{tag}-jit", library, device, jit=True, modules=modules))
            return out
        if library == "dask":
            modules = {"da": importlib.import_module("dask.array")}
            return [Variant("dask", library, modules=modules)]
        if library == "tensorflow":
            tf = importlib.import_module("tensorflow")
            return [Variant("tensorflow", library, "CPU:0", modules={"tf": tf})]
    except ImportError as exc:
        msg = (
            f"backend {library!r} was requested (ATTNFLOW_TEST_BACKENDS) but cannot be "
            f"imported: {exc}. Install it, or do not request it."
        )
        raise pytest.UsageError(msg) from exc
    raise AssertionError(library)


_VARIANTS: list[Variant] | None = None


def selected_variants() -> list[Variant]:
    """Every variant of the requested backends (imported once per session)."""
    global _VARIANTS  # noqa: PLW0603 - a per-session cache of imported frameworks
    if _VARIANTS is None:
        gpu = os.environ.get("ATTNFLOW_TEST_DEVICE", "cpu") == "cuda"
        _VARIANTS = [v for library in _requested() for v in _load(library, gpu)]
    return _VARIANTS
