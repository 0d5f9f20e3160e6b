# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled token-mixing rules (the loops are in ``_contributions_kernel.h``).

:func:`distances` fills ALTI's ``out[b, i, j] = ||y_i - c_i sum_h alpha^h_ij v^h_j||_1``
and :func:`gram_norms` the norm-based and GlobEnc ``||c_i sum_h alpha^h_ij v^h_j||_2``
from NumPy views of host memory, without forming the ``(n, n, d)`` terms. Used by
:mod:`attnflow._contributions_fused`.
"""

from cython cimport floating

cdef extern from "_contributions_kernel.h" nogil:
    int attnflow_alti_avx512(int allowed)
    int attnflow_alti_distances_f32(
        const float *alpha, const float *scale, const float *v, const float *y,
        const float *res, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t n, Py_ssize_t d, Py_ssize_t a_sb,
        Py_ssize_t a_sh, Py_ssize_t a_si, Py_ssize_t v_sb, Py_ssize_t v_sh, Py_ssize_t v_sj,
        float *out, float *totals, Py_ssize_t first, Py_ssize_t last)
    int attnflow_alti_distances_f64(
        const double *alpha, const double *scale, const double *v, const double *y,
        const double *res, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t n, Py_ssize_t d, Py_ssize_t a_sb,
        Py_ssize_t a_sh, Py_ssize_t a_si, Py_ssize_t v_sb, Py_ssize_t v_sh, Py_ssize_t v_sj,
        double *out, double *totals, Py_ssize_t first, Py_ssize_t last)
    int attnflow_gram_norms_f32(
        const float *alpha, const float *scale, const float *v, const float *res, Py_ssize_t nb,
        Py_ssize_t nh, Py_ssize_t n, Py_ssize_t d, Py_ssize_t a_sb, Py_ssize_t a_sh,
        Py_ssize_t a_si, Py_ssize_t v_sb, Py_ssize_t v_sh, Py_ssize_t v_sj, float *out,
        Py_ssize_t first, Py_ssize_t last)
    int attnflow_gram_norms_f64(
        const double *alpha, const double *scale, const double *v, const double *res,
        Py_ssize_t nb,
        Py_ssize_t nh, Py_ssize_t n, Py_ssize_t d, Py_ssize_t a_sb, Py_ssize_t a_sh,
        Py_ssize_t a_si, Py_ssize_t v_sb, Py_ssize_t v_sh, Py_ssize_t v_sj, double *out,
        Py_ssize_t first, Py_ssize_t last)


def gram_norms(
    const floating[:, :, :, :] alpha,
    const floating[:, ::1] scale,
    const floating[:, :, :, :] values,
    const floating[:, :, ::1] residual,
    floating[:, :, ::1] out,
    bint scaled,
    bint with_residual,
    Py_ssize_t first,
    Py_ssize_t last,
):
    """Fill rows of `out` ``(B, n, n)`` with ``||c_i sum_h alpha^h_ij v^h_j||_2``.

    The arguments are those of :func:`distances`, without `y` and `totals`; with
    `with_residual` the diagonal is ``||T_i(x_i)||_2``, the residual included.
    """
    cdef Py_ssize_t item = sizeof(floating)
    cdef Py_ssize_t nb = alpha.shape[0], nh = alpha.shape[1], n = alpha.shape[2]
    cdef Py_ssize_t d = values.shape[3]
    if alpha.strides[3] != item or values.strides[3] != item:
        raise ValueError("the last axis must have a unit stride")
    if with_residual and (residual.shape[0] != nb or residual.shape[1] != n
                          or residual.shape[2] != d):
        raise ValueError("the residual must have shape (B, n, d)")
    cdef Py_ssize_t a_sb = alpha.strides[0] // item, a_sh = alpha.strides[1] // item
    cdef Py_ssize_t a_si = alpha.strides[2] // item
    cdef Py_ssize_t v_sb = values.strides[0] // item, v_sh = values.strides[1] // item
    cdef Py_ssize_t v_sj = values.strides[2] // item
    cdef const floating *scale_ptr = &scale[0, 0] if scaled else NULL
    cdef const floating *res_ptr = &residual[0, 0, 0] if with_residual else NULL
    cdef int failed
    with nogil:
        if floating is float:
            failed = attnflow_gram_norms_f32(
                &alpha[0, 0, 0, 0], scale_ptr, &values[0, 0, 0, 0], res_ptr,
                nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj, &out[0, 0, 0],
                first, last,
            )
        else:
            failed = attnflow_gram_norms_f64(
                &alpha[0, 0, 0, 0], scale_ptr, &values[0, 0, 0, 0], res_ptr,
                nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj, &out[0, 0, 0],
                first, last,
            )
    if failed:
        raise MemoryError("no memory for the Gram matrices")


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
    Py_ssize_t first,
    Py_ssize_t last,
):
    """Fill rows of `out` ``(B, n, n)`` with ALTI's distances ``||y_i - T_i(x_j)||_1``.

    Only the receiving rows ``first <= b * n + i < last`` are written (of `out` and
    `totals`), without the GIL: threads given disjoint ranges fill one array, and each
    row's values do not depend on the ranges.

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
    if alpha.strides[3] != item or values.strides[3] != item:
        raise ValueError("the last axis must have a unit stride")
    if with_residual and (residual.shape[0] != nb or residual.shape[1] != n
                          or residual.shape[2] != d):
        raise ValueError("the residual must have shape (B, n, d)")
    cdef Py_ssize_t a_sb = alpha.strides[0] // item, a_sh = alpha.strides[1] // item
    cdef Py_ssize_t a_si = alpha.strides[2] // item
    cdef Py_ssize_t v_sb = values.strides[0] // item, v_sh = values.strides[1] // item
    cdef Py_ssize_t v_sj = values.strides[2] // item
    cdef const floating *scale_ptr = &scale[0, 0] if scaled else NULL
    cdef const floating *res_ptr = &residual[0, 0, 0] if with_residual else NULL
    cdef int failed
    with nogil:
        if floating is float:
            failed = attnflow_alti_distances_f32(
                &alpha[0, 0, 0, 0], scale_ptr, &values[0, 0, 0, 0], &y[0, 0, 0], res_ptr,
                nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj, &out[0, 0, 0],
                &totals[0, 0], first, last,
            )
        else:
            failed = attnflow_alti_distances_f64(
                &alpha[0, 0, 0, 0], scale_ptr, &values[0, 0, 0, 0], &y[0, 0, 0], res_ptr,
                nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj, &out[0, 0, 0],
                &totals[0, 0], first, last,
            )
    if failed:
        raise MemoryError("no memory for ALTI's block of weights")


def _allow_avx512(bint allowed):
    """Let ALTI's distances use their AVX-512 version where the CPU has it, or not (tests).

    Returns whether they used it before. Not thread-safe: for tests that compare the
    versions on one machine.
    """
    return bool(attnflow_alti_avx512(allowed))
