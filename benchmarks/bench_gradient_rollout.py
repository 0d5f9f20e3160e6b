"""Gradient-weighted rollout (GAE) against plain rollout and hand-written GAE, in one run.

    python benchmarks/bench_gradient_rollout.py [--backend numpy,torch,jax,dask,strict]
        [--shape B L H n] [--repeats R] [--quick]

Random float32 attention (softmax of standard-normal logits) and standard-normal
gradients of shape ``(B, L, H, n, n)``, by default ``(8, 12, 12, 197, 197)`` (a ViT-B/16
batch). Every case runs once to warm up, then ``--repeats`` rounds of all cases,
interleaved so that slow spells of a shared machine hit every case alike. The table gives
the median wall time and the median CPU time (:func:`time.process_time`, all threads of
the process) per call, and both ratios to ``rollout(a, rows=0)`` of the same rounds.

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

Results are checked against the hand-written ones once per backend (printed). Backends:
``numpy``, ``torch`` (CPU), ``jax`` (eager, CPU), ``dask`` (the graph and its compute,
single-threaded scheduler) and ``strict`` (array-api-strict). Threads: set
``OMP_NUM_THREADS`` etc. before Python starts for steadier figures on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
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


def _chefer_loop(a: Any, g: Any, xp: Any) -> Any:
    """GAE, CLS row, per sample and per layer with full matrices (Chefer et al.'s loop)."""
    batch, layers, n = a.shape[0], a.shape[1], a.shape[-1]
    zero = xp.zeros((), dtype=a.dtype)
    eye = xp.eye(n, dtype=a.dtype)
    rows = []
    for b in range(batch):
        relevance = eye
        for i in range(layers):
            cam = xp.mean(xp.maximum(g[b, i, ...] * a[b, i, ...], zero), axis=0)
            relevance = relevance + xp.matmul(cam, relevance)
        rows.append(relevance[0, :])
    return xp.stack(rows, axis=0)


def _backend(name: str, a: np.ndarray, g: np.ndarray) -> tuple[Any, Any, Any, Callable[[Any], Any]]:
    """(attention, gradient, namespace, finish) in library `name`; finish forces a result."""
    if name == "numpy":
        import array_api_compat.numpy as xp

        return a, g, xp, lambda x: x
    if name == "torch":
        import array_api_compat.torch as xp
        import torch

        return torch.from_numpy(a), torch.from_numpy(g), xp, lambda x: x
    if name == "jax":
        import jax
        import jax.numpy as jnp

        def ready(x: Any) -> Any:
            return jax.block_until_ready(x)

        return jnp.asarray(a), jnp.asarray(g), jnp, ready
    if name == "dask":
        import array_api_compat.dask.array as xp
        import dask
        import dask.array as da

        dask.config.set(scheduler="synchronous")
        chunks = (1, 1, *a.shape[2:])
        return da.from_array(a, chunks=chunks), da.from_array(g, chunks=chunks), xp, da.compute
    if name == "strict":
        import array_api_strict as xp

        return xp.asarray(a), xp.asarray(g), xp, lambda x: x
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


def _without_kernel(function: Callable[[], Any]) -> Callable[[], Any]:
    """`function` with attnflow's compiled GAE kernel switched off (the array-API path)."""
    from attnflow import _gae_fused

    def run() -> Any:
        kernel, _gae_fused._fuse = _gae_fused._fuse, None
        try:
            return function()
        finally:
            _gae_fused._fuse = kernel

    return run


def _cases(a: Any, g: Any, xp: Any) -> dict[str, Callable[[], Any]]:
    return {
        "rollout(a, rows=0)": lambda: attnflow.rollout(a, rows=0),
        "hand batched GAE, row 0": lambda: _hand_batched(a, g, xp),
        "Chefer loop, row 0": lambda: _chefer_loop(a, g, xp),
        "gradient_rollout(a, g, rows=0)": lambda: attnflow.gradient_rollout(a, g, rows=0),
        "gradient_rollout(a, g, rows=0, validate=False)": lambda: attnflow.gradient_rollout(
            a, g, rows=0, validate=False
        ),
        'gradient_rollout(a, g, rows=0, rule="weighted")': lambda: attnflow.gradient_rollout(
            a, g, rows=0, rule="weighted"
        ),
        "gradient_rollout(a, g)": lambda: attnflow.gradient_rollout(a, g),
        "array-API path: gradient_rollout(a, g, rows=0)": _without_kernel(
            lambda: attnflow.gradient_rollout(a, g, rows=0)
        ),
        "array-API path: gradient_rollout(a, g, rows=0, validate=False)": _without_kernel(
            lambda: attnflow.gradient_rollout(a, g, rows=0, validate=False)
        ),
    }


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "compute"):
        x = x.compute()
    return np.asarray(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy,torch")
    parser.add_argument("--shape", type=int, nargs=4, help="B L H n (default 8 12 12 197)")
    parser.add_argument("--quick", action="store_true", help="shape 2 4 4 50: a smoke test")
    parser.add_argument("--repeats", type=int, default=5)
    # `nox -s benchmark -- ...` hands the same options to every script.
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"note: ignoring options this script does not take: {' '.join(unknown)}")
    default_shape = [2, 4, 4, 50] if args.quick else [8, 12, 12, 197]
    batch, layers, heads, n = args.shape or default_shape
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(batch, layers, heads, n, n)).astype(np.float32)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    del logits
    gradients = rng.normal(size=weights.shape).astype(np.float32)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    threads = os.environ.get("OMP_NUM_THREADS", "library default")
    print(
        f"shape {(batch, layers, heads, n, n)}, float32, {weights.nbytes / 1e6:.0f} MB per "
        f"array; {args.repeats} rounds; load average {load}; OMP_NUM_THREADS={threads}"
    )
    for name in args.backend.split(","):
        try:
            a, g, xp, finish = _backend(name, weights, gradients)
        except ImportError as exc:
            print(f"\n{name}: not installed ({exc}); skipped")
            continue
        except ValueError as exc:
            print(f"\n{name}: {exc}; skipped (numpy, torch, jax, dask or strict)")
            continue
        cases = _cases(a, g, xp)
        if name == "dask" or (name in {"strict", "jax"} and batch * n > 2000):
            del cases["Chefer loop, row 0"]  # per-sample graphs / copies: minutes, not figures
        ours = _to_numpy(attnflow.gradient_rollout(a, g, rows=0)).astype(np.float64)
        hand = _to_numpy(_hand_batched(a, g, xp)).astype(np.float64)
        scale = float(np.max(np.abs(hand)))
        diff = float(np.max(np.abs(ours - hand))) / scale
        timings = _time(cases, finish, args.repeats)
        base_wall, base_cpu = timings["rollout(a, rows=0)"]
        print(f"\n{name}: max |GAE - hand batched| / max |hand| = {diff:.1e}")
        print("| case | wall ms | x rollout | CPU ms | x rollout |")
        print("|---|---|---|---|---|")
        for key, (wall, cpu) in timings.items():
            print(
                f"| `{key}` | {1e3 * wall:.1f} | {wall / base_wall:.2f} | "
                f"{1e3 * cpu:.1f} | {cpu / base_cpu:.2f} |"
            )


if __name__ == "__main__":
    main()
