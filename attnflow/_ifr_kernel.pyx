# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled proximities of information flow routes (the loop is in ``_ifr_kernel.h``).

:func:`proximities` fills ``out[b, h, i, j] = max(||y_bi||_1 - ||y_bi - w_bhij f_bhj||_1, 0)``
from NumPy views of host memory, without forming the ``(heads, rows, keys, d)`` parts.
Used by :mod:`attnflow._ifr_fused`.
"""

from cython cimport floating

cdef extern from "_ifr_kernel.h" nogil:
    void attnflow_ifr_float(
        const float *w, const float *f, const float *y, float *out,
        Py_ssize_t nh, Py_ssize_t nr, Py_ssize_t n, Py_ssize_t d,
        Py_ssize_t first, Py_ssize_t last)
    void attnflow_ifr_double(
        const double *w, const double *f, const double *y, double *out,
        Py_ssize_t nh, Py_ssize_t nr, Py_ssize_t n, Py_ssize_t d,
        Py_ssize_t first, Py_ssize_t last)


def proximities(
    const floating[:, :, :, ::1] weights,
    const floating[:, :, :, ::1] transformed,
    const floating[:, :, ::1] whole,
    floating[:, :, :, ::1] out,
    Py_ssize_t first,
    Py_ssize_t last,
):
    """Fill the rows ``first <= b * r + i < last`` of `out` ``(B, H, r, n)``, without the GIL.

    `weights` ``(B, H, r, n)``, `transformed` ``(B, H, n, d)`` and `whole` ``(B, r, d)``
    are C-contiguous, of one dtype (float32 or float64), B, H, r, n, d >= 1. Each row's
    values do not depend on the range, so threads given disjoint ranges fill one array.
    """
    cdef Py_ssize_t nb = weights.shape[0], nh = weights.shape[1]
    cdef Py_ssize_t nr = weights.shape[2], n = weights.shape[3], d = transformed.shape[3]
    if (
        transformed.shape[0] != nb or transformed.shape[1] != nh or transformed.shape[2] != n
        or whole.shape[0] != nb or whole.shape[1] != nr or whole.shape[2] != d
        or out.shape[0] != nb or out.shape[1] != nh or out.shape[2] != nr or out.shape[3] != n
    ):
        raise ValueError("weights (B, H, r, n), transformed (B, H, n, d), whole (B, r, d), "
                         "out (B, H, r, n) do not match")
    if first < 0 or last > nb * nr or first > last:
        raise ValueError("the rows must satisfy 0 <= first <= last <= B * r")
    if first == last:
        return
    with nogil:
        if floating is float:
            attnflow_ifr_float(&weights[0, 0, 0, 0], &transformed[0, 0, 0, 0], &whole[0, 0, 0],
                               &out[0, 0, 0, 0], nh, nr, n, d, first, last)
        else:
            attnflow_ifr_double(&weights[0, 0, 0, 0], &transformed[0, 0, 0, 0], &whole[0, 0, 0],
                                &out[0, 0, 0, 0], nh, nr, n, d, first, last)
