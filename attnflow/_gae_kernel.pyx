# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled fused pass of gradient-weighted rollout (the loops are in ``_gae_kernel.h``).

:func:`fuse` forms one layer of ``mean_h max(g * a, 0)`` from NumPy views of host
memory, reading every weight once; with `sums` it reduces the value checks in the
same pass. Used by :mod:`attnflow._gae_fused`.
"""

from cython cimport floating

cdef extern from "_gae_kernel.h" nogil:
    void attnflow_gae_fuse_f32(
        const float *a, const float *g, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t nr,
        Py_ssize_t n, Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_sr,
        Py_ssize_t g_sb, Py_ssize_t g_sh, Py_ssize_t g_sr, const Py_ssize_t *rows,
        float *out, float *sums, float *low, float *total)
    void attnflow_gae_fuse_f64(
        const double *a, const double *g, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t nr,
        Py_ssize_t n, Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_sr,
        Py_ssize_t g_sb, Py_ssize_t g_sh, Py_ssize_t g_sr, const Py_ssize_t *rows,
        double *out, double *sums, double *low, double *total)
    void attnflow_gae_fuse_masked_f32(
        const float *a, const float *g, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t nr,
        Py_ssize_t n, Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_sr,
        Py_ssize_t g_sb, Py_ssize_t g_sh, Py_ssize_t g_sr, const Py_ssize_t *rows,
        const float *keys, float *out, float *sums, float *low, float *total)
    void attnflow_gae_fuse_masked_f64(
        const double *a, const double *g, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t nr,
        Py_ssize_t n, Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_sr,
        Py_ssize_t g_sb, Py_ssize_t g_sh, Py_ssize_t g_sr, const Py_ssize_t *rows,
        const double *keys, double *out, double *sums, double *low, double *total)
    void attnflow_masked_mean_f32(
        const float *a, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t nr, Py_ssize_t n,
        Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_sr, const Py_ssize_t *rows,
        const float *keys, const float *w, float *out, float *sums, float *low)
    void attnflow_masked_mean_f64(
        const double *a, Py_ssize_t nb, Py_ssize_t nh, Py_ssize_t nr, Py_ssize_t n,
        Py_ssize_t a_sb, Py_ssize_t a_sh, Py_ssize_t a_sr, const Py_ssize_t *rows,
        const double *keys, const double *w, double *out, double *sums, double *low)


def fuse(
    const floating[:, :, :, :] a,
    const floating[:, :, :, :] g,
    const Py_ssize_t[::1] rows,
    const floating[:, ::1] keys,
    floating[:, :, ::1] out,
    floating[:, :, ::1] sums,
    floating[::1] stats,
    bint check,
):
    """Fill `out` ``(B, r, n)`` with ``mean_h max(g * a, 0)`` of rows `rows` of each head.

    `a` and `g` are non-empty ``(B, H, n, n)`` arrays of one dtype (float32 or float64)
    with a unit stride on the last axis; `rows` holds ``r >= 1`` row indices in range.
    With `check`, the row sums of every head go to `sums` ``(B, H, r)`` and `stats`
    receives the smallest weight and the sum of the products. `keys` ``(B, n)`` (1 for
    a real token, 0 for padding, in the dtype of `a`) or None: with it, padded queries give zero rows, padded
    keys count as zero and each head's row is renormalised over the real keys.
    """
    cdef Py_ssize_t item = sizeof(floating)
    cdef Py_ssize_t nb = a.shape[0], nh = a.shape[1], n = a.shape[3], nr = rows.shape[0]
    cdef Py_ssize_t a_sb = a.strides[0] // item, a_sh = a.strides[1] // item
    cdef Py_ssize_t a_sr = a.strides[2] // item
    cdef Py_ssize_t g_sb = g.strides[0] // item, g_sh = g.strides[1] // item
    cdef Py_ssize_t g_sr = g.strides[2] // item
    if n > 1 and (a.strides[3] != item or g.strides[3] != item):
        raise ValueError("the last axis must have a unit stride")
    cdef floating *sum_ptr = &sums[0, 0, 0] if check else NULL
    cdef const floating *key_ptr = NULL
    if keys is not None:
        if keys.shape[0] != nb or keys.shape[1] != n:
            raise ValueError("`keys` must be (B, n)")
        key_ptr = &keys[0, 0]
    with nogil:
        if floating is float:
            if key_ptr != NULL:
                attnflow_gae_fuse_masked_f32(
                    &a[0, 0, 0, 0], &g[0, 0, 0, 0], nb, nh, nr, n,
                    a_sb, a_sh, a_sr, g_sb, g_sh, g_sr, &rows[0], key_ptr,
                    &out[0, 0, 0], sum_ptr, &stats[0], &stats[1],
                )
            else:
                attnflow_gae_fuse_f32(
                    &a[0, 0, 0, 0], &g[0, 0, 0, 0], nb, nh, nr, n,
                    a_sb, a_sh, a_sr, g_sb, g_sh, g_sr, &rows[0],
                    &out[0, 0, 0], sum_ptr, &stats[0], &stats[1],
                )
        else:
            if key_ptr != NULL:
                attnflow_gae_fuse_masked_f64(
                    &a[0, 0, 0, 0], &g[0, 0, 0, 0], nb, nh, nr, n,
                    a_sb, a_sh, a_sr, g_sb, g_sh, g_sr, &rows[0], key_ptr,
                    &out[0, 0, 0], sum_ptr, &stats[0], &stats[1],
                )
            else:
                attnflow_gae_fuse_f64(
                    &a[0, 0, 0, 0], &g[0, 0, 0, 0], nb, nh, nr, n,
                    a_sb, a_sh, a_sr, g_sb, g_sh, g_sr, &rows[0],
                    &out[0, 0, 0], sum_ptr, &stats[0], &stats[1],
                )


def masked_mean(
    const floating[:, :, :, :] a,
    const Py_ssize_t[::1] rows,
    const floating[:, ::1] keys,
    const floating[::1] weights,
    floating[:, :, ::1] out,
    floating[:, :, ::1] sums,
    floating[::1] stats,
    bint check,
):
    """Fill `out` ``(B, r, n)`` with the padded head mean of rows `rows` (rollout's).

    `a` is a non-empty ``(B, H, n, n)`` array (float32 or float64, unit stride on the
    last axis); `keys` ``(B, n)`` is 1 for a real token and 0 for padding; `weights`
    ``(H,)`` the head weights (summing to one). Each head's row is divided by its sum
    over the real keys (the unit row where that sum is 0), padded queries and keys give
    zeros. With `check`, every head's full row sums go to `sums` ``(B, H, r)`` (1 for a
    padded query) and `stats[0]` receives the smallest weight of the real rows.
    """
    cdef Py_ssize_t item = sizeof(floating)
    cdef Py_ssize_t nb = a.shape[0], nh = a.shape[1], n = a.shape[3], nr = rows.shape[0]
    cdef Py_ssize_t a_sb = a.strides[0] // item, a_sh = a.strides[1] // item
    cdef Py_ssize_t a_sr = a.strides[2] // item
    if n > 1 and a.strides[3] != item:
        raise ValueError("the last axis must have a unit stride")
    if keys.shape[0] != nb or keys.shape[1] != n or weights.shape[0] != nh:
        raise ValueError("`keys` must be (B, n) and `weights` (H,)")
    cdef floating *sum_ptr = &sums[0, 0, 0] if check else NULL
    with nogil:
        if floating is float:
            attnflow_masked_mean_f32(
                &a[0, 0, 0, 0], nb, nh, nr, n, a_sb, a_sh, a_sr, &rows[0], &keys[0, 0],
                &weights[0], &out[0, 0, 0], sum_ptr, &stats[0],
            )
        else:
            attnflow_masked_mean_f64(
                &a[0, 0, 0, 0], nb, nh, nr, n, a_sb, a_sh, a_sr, &rows[0], &keys[0, 0],
                &weights[0], &out[0, 0, 0], sum_ptr, &stats[0],
            )
