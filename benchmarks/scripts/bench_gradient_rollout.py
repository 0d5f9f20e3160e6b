"""Gradient-weighted rollout (GAE) against plain rollout and hand-written GAE, in one run.

    python benchmarks/scripts/bench_gradient_rollout.py
        [--backend numpy,torch,jax,jax-jit,dask,strict,tensorflow]
        [--shape B L H n] [--repeats R] [--quick] [--no-mask]

Random float32 attention (softmax of standard-normal logits) and standard-normal
gradients of shape ``(B, L, H, n, n)``, by default ``(8, 12, 12, 197, 197)`` (a ViT-B/16
batch). Every case runs once to warm up (and, under ``jax.jit``, to compile), then
``--repeats`` rounds of all cases, interleaved so that slow spells of a shared machine
hit every case alike. The table gives the median wall time and the median CPU time
(:func:`time.process_time`, all threads of the process) per call, and the CPU-time
ratios to ``rollout(a, rows=0)`` and to Chefer et al.'s loop of the same rounds.

Cases
-----
rollout            ``attnflow.rollout(a, rows=0)``, validated: the goal is GAE within 2x.
hand batched       Chefer et al.'s rule written with whole-tensor operations:
                   ``mean_h max(g * a, 0)`` for every layer at once, then the row chain
                   ``v (I + Ā_l)`` top-down, no checks.
Chefer loop        Chefer et al.'s per-sample, per-layer loop (their ``generate_relevance``):
                   ``cam = mean_h (g * a)^+``, ``R = R + cam @ R`` with full ``n x n``
                   matrices, then row 0; no checks. The naive baseline GAE must not trail.
GAE                ``attnflow.gradient_rollout(a, g, rows=0)`` (validated), the weighted
                   rule, and the full map (``rows=None``).
array-API path     The same call with the compiled kernel switched off: what arrays off
                   the host (a GPU), lazy arrays and autograd-tracked tensors get, and
                   what every backend ran before the kernel (the same-run "before").
masked             A padded batch (each item's last 0-25 % of tokens padded; attention a
                   softmax over the real keys, gradients nonzero everywhere) with its
                   mask: ``rollout(a, rows=0, mask=m)`` is that group's baseline, and its
                   naive loop crops each item to its real tokens first.

Results are checked against the hand-written ones once per backend (printed). Backends:
``numpy``, ``torch`` (CPU), ``jax`` (eager, CPU), ``jax-jit`` (every case, the hand-written
ones included, compiled by ``jax.jit``; values are not checked under a trace), ``dask``
(chunked over the batch, single-threaded scheduler; each call builds the graph and
computes it), ``strict`` (array-api-strict) and ``tensorflow`` (CPU; attnflow hands
TensorFlow tensors to NumPy at its boundary, the hand-written cases run in TensorFlow).
Threads: set ``OMP_NUM_THREADS`` etc. before Python starts for steadier figures on a
busy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import attnflow


def _hand_batched(a: Any, g: Any, xp: Any) -> Any:
    """GAE, CLS row, with whole-tensor elementwise passes (the pre-issue-24 formulation)."""
    zero = xp.zeros((), dtype=a.dtype)
    fused = xp.mean(xp.maximum(g * a, zero), axis=-3)  # (B, L, n, n)
    layers = fused.shape[-3]
    vector = fused[..., layers - 1, 0, :]
    vector = xp.concat([vector[..., :1] + 1.0, vector[..., 1:]], axis=-1)  # row 0 of I + Ā_L
    for i in range(layers - 2, -1, -1):
        vector = vector + xp.matmul(vector[..., None, :], fused[..., i, :, :])[..., 0, :]
    return vector


def _chefer_loop(a: Any, g: Any, xp: Any, lengths: tuple[int, ...] | None = None) -> Any:
    """GAE, CLS row, per sample and per layer with full matrices (Chefer et al.'s loop).

    With `lengths`, each sample is first cropped to its real tokens (what one does by
    hand with a padded batch) and its row is padded back with zeros.
    """
    batch, layers, n = a.shape[0], a.shape[1], a.shape[-1]
    zero = xp.zeros((), dtype=a.dtype)
    rows = []
    for b in range(batch):
        size = n if lengths is None else lengths[b]
        relevance = xp.eye(size, dtype=a.dtype)
        for i in range(layers):
            product = g[b, i, :, :size, :size] * a[b, i, :, :size, :size]
            cam = xp.mean(xp.maximum(product, zero), axis=0)
            relevance = relevance + xp.matmul(cam, relevance)
        row = relevance[0, :]
        if size < n:
            row = xp.concat([row, xp.zeros((n - size,), dtype=a.dtype)], axis=0)
        rows.append(row)
    return xp.stack(rows, axis=0)


class _TensorFlowNamespace:
    """The few array functions the hand-written cases use, in TensorFlow."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf

    def zeros(self, shape: Any, dtype: Any) -> Any:
        return self.tf.zeros(shape, dtype=dtype)

    def eye(self, n: int, dtype: Any) -> Any:
        return self.tf.eye(n, dtype=dtype)

    def mean(self, x: Any, axis: int) -> Any:
        return self.tf.reduce_mean(x, axis=axis)

    def maximum(self, x: Any, y: Any) -> Any:
        return self.tf.maximum(x, y)

    def matmul(self, x: Any, y: Any) -> Any:
        return self.tf.matmul(x, y)

    def concat(self, xs: list[Any], axis: int) -> Any:
        return self.tf.concat(xs, axis=axis)

    def stack(self, xs: list[Any], axis: int) -> Any:
        return self.tf.stack(xs, axis=axis)


@dataclass
class _Backend:
    """One library: its arrays, the namespace of the hand-written cases, how to run."""

    convert: Callable[[np.ndarray], Any]
    xp: Any
    finish: Callable[[Any], Any]
    jit: bool = False
    host: bool = True  # the compiled kernel can apply (the array-API-path cases)


def _backend(name: str) -> _Backend:
    """The backend `name`."""
    if name == "numpy":
        import array_api_compat.numpy as xp

        return _Backend(lambda x: x, xp, lambda x: x)
    if name == "torch":
        import array_api_compat.torch as xp
        import torch

        return _Backend(torch.from_numpy, xp, lambda x: x)
    if name in {"jax", "jax-jit"}:
        import jax
        import jax.numpy as jnp

        return _Backend(jnp.asarray, jnp, jax.block_until_ready, jit=name == "jax-jit")
    if name == "dask":
        import array_api_compat.dask.array as xp
        import dask
        import dask.array as da

        dask.config.set(scheduler="synchronous")

        def convert(x: np.ndarray) -> Any:
            return da.from_array(x, chunks=(1,) + (-1,) * (x.ndim - 1))

        return _Backend(convert, xp, lambda x: da.compute(x)[0], host=False)
    if name == "strict":
        import array_api_strict as xp

        return _Backend(xp.asarray, xp, lambda x: x)
    if name == "tensorflow":
        import tensorflow as tf

        return _Backend(tf.constant, _TensorFlowNamespace(), lambda x: x)
    msg = f"unknown backend {name!r}"
    raise ValueError(msg)


def _time(
    cases: dict[str, Callable[[], Any]], finish: Callable[[Any], Any], repeats: int
) -> dict[str, tuple[float, float]]:
    for function in cases.values():
        finish(function())
    wall: dict[str, list[float]] = {key: [] for key in cases}
    cpu: dict[str, list[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key, function in cases.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            finish(function())
            wall[key].append(time.perf_counter() - start)
            cpu[key].append(time.process_time() - start_cpu)
    return {key: (statistics.median(wall[key]), statistics.median(cpu[key])) for key in cases}


def _without_kernel(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with attnflow's compiled GAE kernel switched off (the array-API path)."""
    from attnflow import _gae_fused

    def run(*args: Any) -> Any:
        kernel, _gae_fused._fuse = _gae_fused._fuse, None
        try:
            return function(*args)
        finally:
            _gae_fused._fuse = kernel

    return run


ROLLOUT = "rollout(a, rows=0)"
LOOP = "Chefer loop, row 0"
MASKED_ROLLOUT = "masked: rollout(a, rows=0, mask=m)"
MASKED_LOOP = "masked: Chefer loop on cropped items, row 0"
GAE = "gradient_rollout(a, g, rows=0)"
MASKED_GAE = "masked: gradient_rollout(a, g, rows=0, mask=m)"


def _cases(
    backend: _Backend, a: Any, g: Any, m: Any, lengths: tuple[int, ...] | None
) -> dict[str, Callable[[], Any]]:
    """The timed calls. Each function takes (a, g, m); under jit it is compiled."""
    xp = backend.xp
    functions: dict[str, Callable[[Any, Any, Any], Any]] = {
        ROLLOUT: lambda a, _g, _m: attnflow.rollout(a, rows=0),
        "hand batched GAE, row 0": lambda a, g, _m: _hand_batched(a, g, xp),
        LOOP: lambda a, g, _m: _chefer_loop(a, g, xp),
        GAE: lambda a, g, _m: attnflow.gradient_rollout(a, g, rows=0),
        "gradient_rollout(a, g, rows=0, validate=False)": lambda a, g, _m: (
            attnflow.gradient_rollout(a, g, rows=0, validate=False)
        ),
        'gradient_rollout(a, g, rows=0, rule="weighted")': lambda a, g, _m: (
            attnflow.gradient_rollout(a, g, rows=0, rule="weighted")
        ),
        "gradient_rollout(a, g)": lambda a, g, _m: attnflow.gradient_rollout(a, g),
    }
    if backend.host and not backend.jit:
        functions["array-API path: gradient_rollout(a, g, rows=0)"] = _without_kernel(
            lambda a, g, _m: attnflow.gradient_rollout(a, g, rows=0)
        )
        functions["array-API path: gradient_rollout(a, g, rows=0, validate=False)"] = (
            _without_kernel(
                lambda a, g, _m: attnflow.gradient_rollout(a, g, rows=0, validate=False)
            )
        )
    if m is not None:
        functions[MASKED_ROLLOUT] = lambda a, _g, m: attnflow.rollout(a, rows=0, mask=m)
        functions[MASKED_LOOP] = lambda a, g, _m: _chefer_loop(a, g, xp, lengths)
        functions[MASKED_GAE] = lambda a, g, m: attnflow.gradient_rollout(a, g, rows=0, mask=m)
        functions["masked: gradient_rollout(a, g, rows=0, mask=m, validate=False)"] = (
            lambda a, g, m: attnflow.gradient_rollout(a, g, rows=0, mask=m, validate=False)
        )
    if backend.jit:
        import jax

        # Python ints (the crop lengths) stay static: they are closed over, not traced.
        compiled = {key: jax.jit(f) for key, f in functions.items()}
        return {key: (lambda f=f: f(a, g, m)) for key, f in compiled.items()}
    return {key: (lambda f=f: f(a, g, m)) for key, f in functions.items()}


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "compute"):
        x = x.compute()
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        try:
            return np.asarray(x.numpy())
        except (TypeError, AttributeError):
            pass
    return np.asarray(x)


def _data(
    batch: int, layers: int, heads: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
    """Attention, gradients, and a padded batch (attention, mask, real lengths)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(batch, layers, heads, n, n)).astype(np.float32)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    # Padded: the first item is full, the others lose up to a quarter of their tokens.
    lengths = tuple(n if b == 0 else n - int(rng.integers(0, n // 4 + 1)) for b in range(batch))
    mask = np.arange(n)[None, :] < np.array(lengths)[:, None]
    keys = mask[:, None, None, None, :]
    np.copyto(logits, np.float32(-np.inf), where=~keys)
    padded = np.exp(logits - logits.max(-1, keepdims=True))
    padded /= padded.sum(-1, keepdims=True)
    del logits
    gradients = rng.normal(size=weights.shape).astype(np.float32)
    return weights, gradients, padded, mask, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy,torch")
    parser.add_argument("--shape", type=int, nargs=4, help="B L H n (default 8 12 12 197)")
    parser.add_argument("--quick", action="store_true", help="shape 2 4 4 50: a smoke test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-mask", action="store_true", help="leave out the masked cases")
    # `nox -s benchmark -- ...` hands the same options to every script.
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"note: ignoring options this script does not take: {' '.join(unknown)}")
    default_shape = [2, 4, 4, 50] if args.quick else [8, 12, 12, 197]
    batch, layers, heads, n = args.shape or default_shape
    weights, gradients, padded, mask, lengths = _data(batch, layers, heads, n)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    threads = os.environ.get("OMP_NUM_THREADS", "library default")
    print(
        f"shape {(batch, layers, heads, n, n)}, float32, {weights.nbytes / 1e6:.0f} MB per "
        f"array; {args.repeats} rounds; load average {load}; OMP_NUM_THREADS={threads}"
    )
    for name in args.backend.split(","):
        try:
            backend = _backend(name)
        except ImportError as exc:
            print(f"\n{name}: not installed ({exc}); skipped")
            continue
        except ValueError as exc:
            print(
                f"\n{name}: {exc}; skipped (numpy, torch, jax, jax-jit, dask, strict, tensorflow)"
            )
            continue
        a, g = backend.convert(weights), backend.convert(gradients)
        cases = _cases(backend, a, g, None, None)
        ours = _to_numpy(backend.finish(cases[GAE]())).astype(np.float64)
        hand = _to_numpy(backend.finish(_hand_batched(a, g, backend.xp))).astype(np.float64)
        diff = float(np.max(np.abs(ours - hand))) / float(np.max(np.abs(hand)))
        print(f"\n{name}: max |GAE - hand batched| / max |hand| = {diff:.1e}", end="")
        if not args.no_mask:
            a_masked, m = backend.convert(padded), backend.convert(mask)
            masked_cases = _cases(backend, a_masked, g, m, lengths)
            cases.update({key: f for key, f in masked_cases.items() if key.startswith("masked")})
            ours = _to_numpy(backend.finish(cases[MASKED_GAE]())).astype(np.float64)
            loop = _to_numpy(backend.finish(cases[MASKED_LOOP]())).astype(np.float64)
            diff = float(np.max(np.abs(ours - loop))) / float(np.max(np.abs(loop)))
            print(f"; masked: max |GAE - cropped loop| / max |loop| = {diff:.1e}", end="")
        print()
        timings = _time(cases, backend.finish, args.repeats)
        print(
            f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}\n"
            "| case | wall ms | CPU ms | x rollout (CPU) | x Chefer loop (CPU) |\n"
            "|---|---:|---:|---:|---:|"
        )
        for key, (wall, cpu) in timings.items():
            masked = key.startswith("masked")
            base = timings[MASKED_ROLLOUT if masked else ROLLOUT][1]
            loop_cpu = timings[MASKED_LOOP if masked else LOOP][1]
            print(
                f"| `{key}` | {1e3 * wall:.1f} | {1e3 * cpu:.1f} | {cpu / base:.2f} | "
                f"{cpu / loop_cpu:.2f} |"
            )


if __name__ == "__main__":
    main()
