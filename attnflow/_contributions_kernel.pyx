# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled token-mixing rules (the loops are in ``_contributions_kernel.h``).

:func:`distances` fills ALTI's ``out[b, i, j] = ||y_i - c_i sum_h alpha^h_ij v^h_j||_1``
and :func:`gram_norms` the norm-based and GlobEnc ``||c_i sum_h alpha^h_ij v^h_j||_2``
from NumPy views of host memory, without forming the ``(n, n, d)`` terms. Each call fills
the receiving rows of the ranges ``bounds[k] <= b * n + i < bounds[k + 1]``, in turn on
the calling thread, or on `threads` threads of its OpenMP team when `parallel` is the
address of the process's OpenMP runtime's ``GOMP_parallel`` (each range written by one
thread; a row's values do not depend on the ranges nor on the thread). Used by
:mod:`attnflow._contributions_fused`.
"""

from cython cimport floating

cdef extern from "_contributions_kernel.h" nogil:
    int attnflow_alti_avx512(int allowed)
    ctypedef struct attnflow_team_task:
        int kind
        const void *alpha
        const void *scale
        const void *v
        const void *y
        const void *res
        Py_ssize_t nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj
        void *out
        void *totals
        const Py_ssize_t *bounds
        Py_ssize_t parts
        int shares
    int attnflow_team(void *parallel, attnflow_team_task *task, unsigned threads)


cdef Py_ssize_t[::1] _checked_bounds(Py_ssize_t[::1] bounds, Py_ssize_t rows) except *:
    cdef Py_ssize_t k
    if bounds.shape[0] < 2:
        raise ValueError("bounds must hold at least two row bounds")
    for k in range(bounds.shape[0]):
        if bounds[k] < 0 or bounds[k] > rows or (k and bounds[k] < bounds[k - 1]):
            raise ValueError("bounds must increase within [0, B * n]")
    return bounds


cdef int _check_layout(
    Py_ssize_t item,
    Py_ssize_t alpha_stride,
    Py_ssize_t values_stride,
    bint with_residual,
    Py_ssize_t rb, Py_ssize_t rn, Py_ssize_t rd,
    Py_ssize_t nb, Py_ssize_t n, Py_ssize_t d,
) except -1:
    """Refuse a last axis without a unit stride, or a residual that is not ``(B, n, d)``."""
    if alpha_stride != item or values_stride != item:
        raise ValueError("the last axis must have a unit stride")
    if with_residual and (rb != nb or rn != n or rd != d):
        raise ValueError("the residual must have shape (B, n, d)")
    return 0


cdef int _run(
    int kind,
    const void *alpha,
    const void *scale,
    const void *values,
    const void *y,
    const void *residual,
    Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t n, Py_ssize_t d,
    Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_si,
    Py_ssize_t v_sb, Py_ssize_t v_sh, Py_ssize_t v_sj,
    void *out,
    void *totals,
    Py_ssize_t[::1] bounds,
    size_t parallel,
    unsigned threads,
    bint shares,
) except -1:
    cdef attnflow_team_task task
    cdef int failed
    bounds = _checked_bounds(bounds, nb * n)
    task.kind = kind
    task.alpha, task.scale, task.v, task.y, task.res = alpha, scale, values, y, residual
    task.nb, task.nh, task.n, task.d = nb, nh, n, d
    task.a_sb, task.a_sh, task.a_si = a_sb, a_sh, a_si
    task.v_sb, task.v_sh, task.v_sj = v_sb, v_sh, v_sj
    task.out, task.totals = out, totals
    task.bounds, task.parts = &bounds[0], bounds.shape[0] - 1
    task.shares = shares
    with nogil:
        failed = attnflow_team(<void *>parallel, &task, threads if threads > 0 else 1)
    if failed:
        raise MemoryError("no memory for the kernel's scratch buffer")
    return 0


def gram_norms(
    const floating[:, :, :, :] alpha,
    const floating[:, ::1] scale,
    const floating[:, :, :, :] values,
    const floating[:, :, ::1] residual,
    floating[:, :, ::1] out,
    bint scaled,
    bint with_residual,
    Py_ssize_t[::1] bounds,
    size_t parallel=0,
    unsigned threads=1,
):
    """Fill rows of `out` ``(B, n, n)`` with ``||c_i sum_h alpha^h_ij v^h_j||_2``.

    The arguments are those of :func:`distances`, without `y` and `totals`; with
    `with_residual` the diagonal is ``||T_i(x_i)||_2``, the residual included.
    """
    cdef Py_ssize_t item = sizeof(floating)
    cdef Py_ssize_t nb = alpha.shape[0], nh = alpha.shape[1], n = alpha.shape[2]
    cdef Py_ssize_t d = values.shape[3]
    _check_layout(item, alpha.strides[3], values.strides[3], with_residual,
                  residual.shape[0], residual.shape[1], residual.shape[2], nb, n, d)
    _run(
        0 if floating is float else 1,
        &alpha[0, 0, 0, 0],
        &scale[0, 0] if scaled else NULL,
        &values[0, 0, 0, 0],
        NULL,
        &residual[0, 0, 0] if with_residual else NULL,
        nb, nh, n, d,
        alpha.strides[0] // item, alpha.strides[1] // item, alpha.strides[2] // item,
        values.strides[0] // item, values.strides[1] // item, values.strides[2] // item,
        &out[0, 0, 0],
        NULL,
        bounds,
        parallel,
        threads,
        False,
    )


def distances(
    const floating[:, :, :, :] alpha,
    const floating[:, ::1] scale,
    const floating[:, :, :, :] values,
    const floating[:, :, ::1] y,
    const floating[:, :, ::1] residual,
    floating[:, :, ::1] out,
    floating[:, ::1] totals,
    bint scaled,
    bint with_residual,
    Py_ssize_t[::1] bounds,
    size_t parallel=0,
    unsigned threads=1,
    bint shares=False,
):
    """Fill rows of `out` ``(B, n, n)`` with ALTI's distances ``||y_i - T_i(x_j)||_1``.

    Only the receiving rows of the ranges ``bounds[k] <= b * n + i < bounds[k + 1]`` are
    written (of `out` and `totals`), without the GIL: threads given disjoint ranges fill
    one array, and each row's values do not depend on the ranges. With `parallel` (the
    address of ``GOMP_parallel``), `threads` threads of the calling thread's OpenMP team
    take the ranges; with 0 the calling thread runs them in turn. With `shares`, each
    row is then turned into ALTI's unnormalised shares ``max(||y_i||_1 - D_ij, 0)`` (as
    ``maximum(totals - out, 0)`` computes them).

    `totals` ``(B, n)`` receives ``||y_i||_1``, summed in the order of the distances.
    `alpha` ``(B, H, n, n)`` and `values` ``(B, H, n, d)`` have a unit stride on their
    last axis; `y` is ``(B, n, d)``; `scale` ``(B, n)`` holds ``c_i`` when `scaled` (any
    non-empty array otherwise). With `with_residual`, `residual` ``(B, n, d)`` holds
    :math:`r_i` and the diagonal is ALTI's own distance ``||y_i - T_i(x_i)||_1`` with
    ``T_i(x_i) = c_i (sum_h alpha^h_ii v^h_i + r_i)``; without, any non-empty array. All
    of one dtype, float32 or float64, B, H, n, d >= 1.
    """
    cdef Py_ssize_t item = sizeof(floating)
    cdef Py_ssize_t nb = alpha.shape[0], nh = alpha.shape[1], n = alpha.shape[2]
    cdef Py_ssize_t d = values.shape[3]
    _check_layout(item, alpha.strides[3], values.strides[3], with_residual,
                  residual.shape[0], residual.shape[1], residual.shape[2], nb, n, d)
    _run(
        2 if floating is float else 3,
        &alpha[0, 0, 0, 0],
        &scale[0, 0] if scaled else NULL,
        &values[0, 0, 0, 0],
        &y[0, 0, 0],
        &residual[0, 0, 0] if with_residual else NULL,
        nb, nh, n, d,
        alpha.strides[0] // item, alpha.strides[1] // item, alpha.strides[2] // item,
        values.strides[0] // item, values.strides[1] // item, values.strides[2] // item,
        &out[0, 0, 0],
        &totals[0, 0],
        bounds,
        parallel,
        threads,
        shares,
    )


def _allow_avx512(bint allowed):
    """Let ALTI's distances use their AVX-512 version where the CPU has it, or not (tests).

    Returns whether they used it before. Not thread-safe: for tests that compare the
    versions on one machine.
    """
    return bool(attnflow_alti_avx512(allowed))
