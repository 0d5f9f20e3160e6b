/* The proximities of information flow routes (attnflow/_ifr_kernel.pyx).
 *
 * For every batch item b, head h, explained row i and key j:
 *
 *     out[b, h, i, j] = max(||y_bi||_1 - ||y_bi - w[b, h, i, j] * f[b, h, j]||_1, 0)
 *
 * the proximity of the part z = A^h_ij f^h(x_j) to the layer's output y_i (Ferrando &
 * Voita 2024). The (heads, rows, keys, d) parts are never stored: each is formed in
 * registers and reduced at once. A key without weight (the causal triangle of the rows of
 * generated text, masked tokens) is a zero part: its proximity is 0 exactly, and skipped.
 *
 * No -ffast-math: the sums over d go lane by lane (``omp simd`` reductions) and the lanes
 * are added at the end; ||y_i||_1 is summed by the same loop as the distances.
 */
#include <stddef.h>
#include <math.h>

#if defined(_MSC_VER) && !defined(__clang__)
#define ATTNFLOW_IFR_SIMD(clause)
#else
#define ATTNFLOW_IFR_SIMD(clause) _Pragma(clause)
#endif

/* Rows first <= b * nr + i < last of `out`, arrays contiguous: w and out (nb, nh, nr, n),
 * f (nb, nh, n, d), y (nb, nr, d). NaN propagates (max(NaN, 0) is NaN, as in the array
 * path's clip). */
#define ATTNFLOW_IFR_DEFINE(NAME, T, ABS)                                                   \
static void NAME(                                                                           \
    const T *w, const T *f, const T *y, T *out, ptrdiff_t nh, ptrdiff_t nr, ptrdiff_t n,    \
    ptrdiff_t d, ptrdiff_t first, ptrdiff_t last)                                           \
{                                                                                           \
    for (ptrdiff_t q = first; q < last; ++q) {                                              \
        const ptrdiff_t b = q / nr, i = q % nr;                                             \
        const T *yi = y + q * d;                                                            \
        T norm = 0;                                                                         \
        ATTNFLOW_IFR_SIMD("omp simd reduction(+:norm)")                                     \
        for (ptrdiff_t k = 0; k < d; ++k) norm += ABS(yi[k]);                                \
        for (ptrdiff_t h = 0; h < nh; ++h) {                                                \
            const ptrdiff_t head = (b * nh + h) * nr + i;                                   \
            const T *wi = w + head * n;                                                     \
            const T *fh = f + (b * nh + h) * n * d;                                         \
            T *oi = out + head * n;                                                         \
            for (ptrdiff_t j = 0; j < n; ++j) {                                             \
                const T a = wi[j];                                                          \
                if (a == 0) { oi[j] = 0; continue; }                                        \
                const T *fj = fh + j * d;                                                   \
                T distance = 0;                                                             \
                ATTNFLOW_IFR_SIMD("omp simd reduction(+:distance)")                         \
                for (ptrdiff_t k = 0; k < d; ++k) distance += ABS(yi[k] - a * fj[k]);       \
                const T p = norm - distance;                                                \
                oi[j] = p < 0 ? (T)0 : p;                                                   \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

ATTNFLOW_IFR_DEFINE(attnflow_ifr_float, float, fabsf)
ATTNFLOW_IFR_DEFINE(attnflow_ifr_double, double, fabs)
