r"""Value-aware token-mixing rules on host memory, through the compiled kernel.

:func:`gram_norms` computes the norm-based and GlobEnc entries
:math:`\lVert c_i \sum_h \alpha^h_{ij} v^h_j \rVert_2` from each key's Gram matrix
:math:`G_j[h, h'] = v^h_j \cdot v^{h'}_j`, and :func:`distances`, for ALTI,

.. math::

    D_{ij} = \Big\lVert y_i - c_i \sum_h \alpha^h_{ij} v^h_j \Big\rVert_1

for every receiving token :math:`i` and key :math:`j` (Ferrando et al. 2022; exact
:math:`\lVert y_i - T_i(x_j) \rVert_1` off the diagonal, where the term has no residual)
without storing the :math:`n^2 d` terms: each is formed in registers and reduced at
once. Arrays whose memory NumPy can view without a copy (NumPy, PyTorch CPU tensors,
eager JAX on the CPU, array-api-strict: DLPack) go to the kernel; anything else (a GPU,
a lazy array, float16, a source checkout without the compiled kernel) gets None, and the
caller takes its array-API path.

The kernel releases the GIL and fills a given range of receiving rows, so a layer's rows
are split between `threads` threads (contiguous ranges of the flattened ``(batch, n)``
rows, one per thread, each written by one thread only): the values do not depend on the
split, so any number of threads gives the same bits as one. Small layers (fewer than
:data:`_THREADED_WORK` multiply-adds) run on the calling thread. Given an
:class:`OpenMPTeam` (:func:`openmp_team`; the torch adapter passes it where PyTorch's
intra-op threads are OpenMP's), the same ranges run as one parallel region of the calling
thread's OpenMP team instead of attnflow's pool: the threads that wait, spinning, between
the framework's own parallel operations take them, rather than sharing the cores with
them.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._gae_fused import _host_view
from ._namespace import array_device
from ._typing import Namespace

__all__ = [
    "KERNEL_AVAILABLE",
    "OpenMPTeam",
    "default_threads",
    "distances",
    "gram_norms",
    "openmp_team",
]


def _load_kernels() -> tuple[Callable[..., None], Callable[..., None]] | None:
    try:
        from ._contributions_kernel import distances as alti
        from ._contributions_kernel import gram_norms as euclidean
    except ImportError:  # pragma: no cover - a source checkout without the compiled kernel
        return None
    return alti, euclidean


_kernels = _load_kernels()

KERNEL_AVAILABLE = _kernels is not None

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: Multiply-adds of a layer below which its rows are not split between threads (a task's
#: hand-off costs tens of microseconds; MiniLM's 4 x 256-token layer is 10**9).
_THREADED_WORK = 1 << 22

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0
_pool_lock = threading.Lock()


def default_threads() -> int:
    """Count the CPUs this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(1, len(affinity(0)))
    return max(1, os.cpu_count() or 1)


def _executor(workers: int) -> ThreadPoolExecutor:
    """Return a process-wide pool with at least `workers` threads (grown if asked for more)."""
    global _pool, _pool_size, _pool_pid  # one pool for the process, made on first use
    with _pool_lock:
        if _pool_pid != os.getpid():  # a forked child inherits the pool but not its threads
            _pool, _pool_size, _pool_pid = None, 0, os.getpid()
        if _pool is None or _pool_size < workers:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(workers, "attnflow-contributions"), workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


@dataclass(frozen=True)
class OpenMPTeam:
    """The OpenMP runtime this process has loaded, to run the kernel on the caller's team.

    `parallel` is the address of the runtime's ``GOMP_parallel`` (GNU libgomp; LLVM's
    and Intel's runtimes export it too). The kernel's ranges of rows then run on the
    threads of the calling thread's team, those its framework's parallel operations use
    (PyTorch's intra-op threads), rather than on attnflow's own pool: between two
    operations those threads wait for the next one, spinning for a while (libgomp's
    default), so a pool of other threads would share the cores with them.
    """

    parallel: int


#: File names of OpenMP runtimes (GNU's, LLVM's, Intel's; ``libgomp-<hash>.so.1`` in wheels).
_OPENMP_RUNTIME = re.compile(r"lib(gomp|omp|iomp5)[-.]")

# By process id (a forked child looks again) and directory.
_teams: dict[tuple[int, str | None], OpenMPTeam | None] = {}


def _mapped_libraries() -> set[str]:
    """List the shared libraries mapped into this process (``/proc/self/maps``, or none)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    paths = set()
    for line in maps:
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and ".so" in Path(fields[5]).name:
            paths.add(os.path.realpath(fields[5]))
    return paths


def openmp_team(within: str | os.PathLike[str] | None = None) -> OpenMPTeam | None:
    """Find the OpenMP runtime mapped into this process (Linux), or None.

    The one runtime mapped, or where several are (a wheel's own ``libgomp-<hash>.so.1``
    beside the framework's), the one under the directory `within` (the framework's
    package, whose libraries load their runtime from there). None where that leaves no
    runtime or several (which one the framework uses is then unknown), where
    ``/proc/self/maps`` does not exist (not Linux), or where the runtime has no
    ``GOMP_parallel``. Looked up once per process and `within` (a forked child looks
    again).
    """
    key = (os.getpid(), None if within is None else os.path.realpath(within))
    if key in _teams:
        return _teams[key]
    found: OpenMPTeam | None = None
    runtimes = {path for path in _mapped_libraries() if _OPENMP_RUNTIME.match(Path(path).name)}
    if len(runtimes) > 1 and key[1] is not None:
        runtimes = {path for path in runtimes if Path(path).is_relative_to(key[1])}
    if len(runtimes) == 1:
        try:
            # Already loaded: RTLD_NOLOAD opens the process's copy, never a second one.
            flags = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
            library = ctypes.CDLL(runtimes.pop(), mode=flags)
            address = ctypes.cast(library.GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            address = None
        if address:
            found = OpenMPTeam(address)
    _teams[key] = found
    return found


def _row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """`rows` split into at most `parts` contiguous ranges of near-equal size."""
    parts = max(1, min(parts, rows))
    bounds = [rows * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts) if bounds[k] < bounds[k + 1]]


def _in_threads(
    kernel: Callable[[np.ndarray, int, int], None],
    rows: int,
    work: int,
    threads: int,
    team: OpenMPTeam | None,
) -> None:
    """Run ``kernel(bounds, parallel, threads)`` over the rows, split between `threads`.

    On `team` (its ``GOMP_parallel``) when one is given, else on the calling thread and
    attnflow's own pool. The ranges are the same either way.
    """
    ranges = _row_ranges(rows, threads if work >= _THREADED_WORK else 1)
    if len(ranges) > 1 and team is not None:
        bounds = np.array([first for first, _ in ranges] + [ranges[-1][1]], dtype=np.intp)
        kernel(bounds, team.parallel, len(ranges))
        return
    if len(ranges) == 1:
        kernel(np.array(ranges[0], dtype=np.intp), 0, 1)
        return
    pool = _executor(len(ranges) - 1)
    # The calling thread takes the first range itself; the pool the others.
    futures = [pool.submit(kernel, np.array(r, dtype=np.intp), 0, 1) for r in ranges[1:]]
    try:
        kernel(np.array(ranges[0], dtype=np.intp), 0, 1)
    finally:
        for future in futures:
            future.result()


def _host_dtype(views: list[np.ndarray], view: np.ndarray) -> np.dtype[Any]:
    """Return the dtype every view must share: the first one's."""
    return views[0].dtype if views else view.dtype


def _run(
    alpha: Any,
    values: Any,
    scale: Any | None,
    y: Any | None,
    residual: Any | None,
    xp: Namespace,
    threads: int | None,
    team: OpenMPTeam | None = None,
    shares: bool = False,
) -> tuple[Any, Any | None] | None:
    """Run ALTI's kernel (with `y`) or the Gram norms' (without) on host views, or None.

    Returns the ``(*batch, n, n)`` matrix and, for ALTI, ``‖y_i‖₁`` ``(*batch, n, 1)``.
    """
    if _kernels is None:
        return None
    views: list[np.ndarray] = []
    for array in (alpha, values, y, residual, scale):
        if array is None:
            continue
        view = _host_view(array)
        if view is None or view.dtype not in _DTYPES or view.dtype != _host_dtype(views, view):
            return None
        views.append(view)
    a, v = views[:2]
    *batch, heads, n, _ = a.shape
    d = v.shape[-1]
    count = math.prod(batch)
    if count == 0 or heads == 0 or n == 0 or d == 0:
        return None
    a = a.reshape(count, heads, n, n)
    v = v.reshape(count, heads, n, d)
    if a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    if v.strides[-1] != v.itemsize:
        v = np.ascontiguousarray(v)
    scaled = scale is not None
    c = np.ascontiguousarray(views[-1].reshape(count, n)) if scaled else np.ones((1, 1), a.dtype)
    with_residual = residual is not None
    r = np.ones((1, 1, 1), a.dtype)
    if with_residual:
        r = np.ascontiguousarray(views[2 + (y is not None)].reshape(count, n, d))
    out = np.empty((count, n, n), dtype=a.dtype)
    alti, euclidean = _kernels
    device = array_device(alpha)
    matrix = out.reshape(*batch, n, n)
    workers = default_threads() if threads is None else threads
    rows = count * n
    if y is None:
        _in_threads(
            lambda bounds, parallel, parts: euclidean(
                a, c, v, r, out, scaled, with_residual, bounds, parallel, parts
            ),
            rows,
            rows * n * heads * (heads + 1) // 2,
            workers,
            team,
        )
        return xp.asarray(matrix, device=device), None
    totals = np.empty((count, n), dtype=a.dtype)
    target = np.ascontiguousarray(views[2].reshape(count, n, d))
    _in_threads(
        lambda bounds, parallel, parts: alti(
            a, c, v, target, r, out, totals, scaled, with_residual, bounds, parallel, parts, shares
        ),
        rows,
        rows * n * heads * d,
        workers,
        team,
    )
    return xp.asarray(matrix, device=device), xp.asarray(
        totals.reshape(*batch, n, 1), device=device
    )


def distances(
    alpha: Any,
    values: Any,
    scale: Any | None,
    y: Any,
    xp: Namespace,
    threads: int | None = None,
    residual: Any | None = None,
    team: OpenMPTeam | None = None,
    shares: bool = False,
) -> tuple[Any, Any] | None:
    r""":math:`D_{ij}` ``(*batch, n, n)`` and :math:`\lVert y_i \rVert_1` ``(*batch, n, 1)``, or None.

    `alpha` is ``(*batch, H, n, n)``, `values` :math:`v^h_j` ``(*batch, H, n, d)``,
    `scale` :math:`c_i` ``(*batch, n, 1)`` or None for 1, `y` ``(*batch, n, d)``; all of
    one dtype, the result in `xp` on `alpha`'s device. The norms are summed in the order
    of the distances, so that a key with no weight in any head has
    :math:`D_{ij} = \lVert y_i \rVert_1` exactly (its contribution exactly 0). `threads`
    (None: :func:`default_threads`) share the receiving rows; the result does not depend
    on how many. With `residual` :math:`r` ``(*batch, n, d)`` the diagonal is the own
    distance :math:`\lVert y_i - c_i (\sum_h \alpha^h_{ii} v^h_i + r_i) \rVert_1`.
    With `shares` the matrix holds ALTI's unnormalised shares
    :math:`\max(\lVert y_i \rVert_1 - D_{ij}, 0)` instead (computed by the kernel as
    ``maximum(totals - D, 0)`` would: the same bits, and no further passes).
    """
    return _run(alpha, values, scale, y, residual, xp, threads, team, shares)


def gram_norms(
    alpha: Any,
    values: Any,
    scale: Any | None,
    xp: Namespace,
    threads: int | None = None,
    residual: Any | None = None,
    team: OpenMPTeam | None = None,
) -> Any | None:
    r""":math:`\lVert c_i \sum_h \alpha^h_{ij} v^h_j \rVert_2`, ``(*batch, n, n)``, or None.

    From each key's Gram matrix of its head vectors (:math:`H^2` products per pair of
    tokens); the arguments are those of :func:`distances` without `y`. With `residual`
    the diagonal is :math:`\lVert c_i (\sum_h \alpha^h_{ii} v^h_i + r_i) \rVert_2`
    (GlobEnc's own term).
    """
    result = _run(alpha, values, scale, None, residual, xp, threads, team)
    return None if result is None else result[0]
