/* The fused pass of gradient-weighted rollout (attnflow/_gae_kernel.pyx).
 *
 * For one layer: out[b, r, :] = mean_h max(g[b, h, row_r, :] * a[b, h, row_r, :], 0),
 * reading each weight of `a` and `g` once. With `sums` (not NULL) the same pass reduces
 * the value checks: the row sums of every head, sums[b, h, r]; the smallest weight,
 * *low; the sum of the products, *total (finite exactly when the gradients are, the
 * attention being finite and in [0, 1]). Rows go in blocks whose output stays in L1
 * while the heads stream through it.
 *
 * Only the check reductions are reordered (`omp simd reduction`, with -fopenmp-simd);
 * the output is accumulated head by head, in order, and divided by the number of heads.
 * A NaN product stays NaN (`p < 0 ? 0 : p`), as the array-API path's maximum keeps it.
 */
#include <stddef.h>
#include <math.h>

#if defined(_MSC_VER) && !defined(__clang__)
#define restrict __restrict
#define ATTNFLOW_GAE_SIMD_REDUCE(clause)
#else
#define ATTNFLOW_GAE_SIMD_REDUCE(clause) _Pragma(clause)
#endif

#define ATTNFLOW_GAE_BLOCK_BYTES 1048576

/* x86-64 with GCC or Clang on ELF: an AVX2 clone chosen at load time (ifunc), SSE2 else. */
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define ATTNFLOW_GAE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ATTNFLOW_GAE_CLONES
#endif

/* The helpers must be inlined into each clone, to be compiled for its instruction set. */
#if defined(__GNUC__) || defined(__clang__)
#define ATTNFLOW_GAE_INLINE static inline __attribute__((always_inline))
#else
#define ATTNFLOW_GAE_INLINE static inline
#endif

/* One span of `len` weights (a row, or consecutive rows stored back to back): the
 * clipped products go to (first head) or are added to `o`; with `check`, the sum of the
 * products and the smallest weight are reduced into *t and *m. */
#define ATTNFLOW_GAE_SPAN(NAME, T)                                                          \
ATTNFLOW_GAE_INLINE void NAME(const T *restrict ar, const T *restrict gr, T *restrict o,          \
                        ptrdiff_t len, int first, int check, T *t, T *m)                    \
{                                                                                           \
    T tt = 0, mm = INFINITY;                                                                \
    if (!check && first) {                                                                  \
        for (ptrdiff_t j = 0; j < len; ++j) { T p = gr[j] * ar[j]; o[j] = p < 0 ? 0 : p; }  \
    } else if (!check) {                                                                    \
        for (ptrdiff_t j = 0; j < len; ++j) { T p = gr[j] * ar[j]; o[j] += p < 0 ? 0 : p; } \
    } else if (first) {                                                                     \
        ATTNFLOW_GAE_SIMD_REDUCE("omp simd reduction(+:tt) reduction(min:mm)")                               \
        for (ptrdiff_t j = 0; j < len; ++j) {                                               \
            T x = ar[j], p = gr[j] * x;                                                     \
            o[j] = p < 0 ? 0 : p; tt += p; mm = x < mm ? x : mm;                            \
        }                                                                                   \
    } else {                                                                                \
        ATTNFLOW_GAE_SIMD_REDUCE("omp simd reduction(+:tt) reduction(min:mm)")                               \
        for (ptrdiff_t j = 0; j < len; ++j) {                                               \
            T x = ar[j], p = gr[j] * x;                                                     \
            o[j] += p < 0 ? 0 : p; tt += p; mm = x < mm ? x : mm;                           \
        }                                                                                   \
    }                                                                                       \
    *t += tt;                                                                               \
    *m = mm < *m ? mm : *m;                                                                 \
}                                                                                           \
                                                                                            \
ATTNFLOW_GAE_INLINE T NAME##_sum(const T *restrict ar, ptrdiff_t n)                               \
{                                                                                           \
    T s = 0;                                                                                \
    ATTNFLOW_GAE_SIMD_REDUCE("omp simd reduction(+:s)")                                                      \
    for (ptrdiff_t j = 0; j < n; ++j) s += ar[j];                                           \
    return s;                                                                               \
}

/* The layer: batch by batch, rows in blocks whose output stays in L1 while every head
 * streams through it; consecutive rows stored back to back are one span. */
#define ATTNFLOW_GAE_FUSE(NAME, SPAN, T)                                                    \
ATTNFLOW_GAE_CLONES static void NAME(                                                       \
    const T *a, const T *g, ptrdiff_t nb, ptrdiff_t nh, ptrdiff_t nr, ptrdiff_t n,          \
    ptrdiff_t a_sb, ptrdiff_t a_sh, ptrdiff_t a_sr, ptrdiff_t g_sb, ptrdiff_t g_sh,         \
    ptrdiff_t g_sr, const ptrdiff_t *rows, T *out, T *sums, T *low, T *total)               \
{                                                                                           \
    ptrdiff_t block = ATTNFLOW_GAE_BLOCK_BYTES / (n * (ptrdiff_t)sizeof(T));                \
    int check = sums != NULL;                                                               \
    T lowest = INFINITY, all = 0, heads = (T)nh;                                            \
    if (block < 1) block = 1;                                                               \
    for (ptrdiff_t b = 0; b < nb; ++b) {                                                    \
        for (ptrdiff_t r0 = 0; r0 < nr; r0 += block) {                                      \
            ptrdiff_t r1 = r0 + block < nr ? r0 + block : nr;                               \
            int flat = a_sr == n && g_sr == n && rows[r1 - 1] - rows[r0] == r1 - 1 - r0;    \
            for (ptrdiff_t r = r0 + 1; flat && r < r1; ++r) flat = rows[r] == rows[r - 1] + 1; \
            for (ptrdiff_t h = 0; h < nh; ++h) {                                            \
                const T *ab = a + b * a_sb + h * a_sh, *gb = g + b * g_sb + h * g_sh;       \
                T *ob = out + b * nr * n;                                                   \
                if (flat) {                                                                 \
                    SPAN(ab + rows[r0] * a_sr, gb + rows[r0] * g_sr, ob + r0 * n,           \
                         (r1 - r0) * n, h == 0, check, &all, &lowest);                      \
                } else {                                                                    \
                    for (ptrdiff_t r = r0; r < r1; ++r)                                     \
                        SPAN(ab + rows[r] * a_sr, gb + rows[r] * g_sr, ob + r * n, n,       \
                             h == 0, check, &all, &lowest);                                 \
                }                                                                           \
                if (check)                                                                  \
                    for (ptrdiff_t r = r0; r < r1; ++r)                                     \
                        sums[(b * nh + h) * nr + r] = SPAN##_sum(ab + rows[r] * a_sr, n);   \
            }                                                                               \
            for (ptrdiff_t j = r0 * n; j < r1 * n; ++j) out[b * nr * n + j] /= heads;       \
        }                                                                                   \
    }                                                                                       \
    if (check) { *low = lowest; *total = all; }                                             \
}

ATTNFLOW_GAE_SPAN(attnflow_gae_span_f32, float)
ATTNFLOW_GAE_SPAN(attnflow_gae_span_f64, double)
ATTNFLOW_GAE_FUSE(attnflow_gae_fuse_f32, attnflow_gae_span_f32, float)
ATTNFLOW_GAE_FUSE(attnflow_gae_fuse_f64, attnflow_gae_span_f64, double)

/* A real query's row `ar` of a padded layer (`kb`: `keys` below): its sum over the real
 * keys, returned; with `check`, in the same pass, its sum over every key in *full and
 * its smallest weight folded into *m. */
#define ATTNFLOW_GAE_REAL_SUM(NAME, T)                                                      \
ATTNFLOW_GAE_INLINE T NAME(const T *restrict ar, const T *restrict kb, ptrdiff_t n, int check, \
                           T *full, T *m)                                                   \
{                                                                                           \
    T s = 0;                                                                                \
    if (check) {                                                                            \
        T ss = 0, mm = INFINITY;                                                            \
        ATTNFLOW_GAE_SIMD_REDUCE("omp simd reduction(+:s,ss) reduction(min:mm)")            \
        for (ptrdiff_t j = 0; j < n; ++j) {                                                 \
            T x = ar[j];                                                                    \
            s += kb[j] != 0 ? x : 0; ss += x; mm = x < mm ? x : mm;                         \
        }                                                                                   \
        *full = ss;                                                                         \
        *m = mm < *m ? mm : *m;                                                             \
    } else {                                                                                \
        ATTNFLOW_GAE_SIMD_REDUCE("omp simd reduction(+:s)")                                 \
        for (ptrdiff_t j = 0; j < n; ++j) { T x = ar[j]; s += kb[j] != 0 ? x : 0; }         \
    }                                                                                       \
    return s;                                                                               \
}

ATTNFLOW_GAE_REAL_SUM(attnflow_gae_real_sum_f32, float)
ATTNFLOW_GAE_REAL_SUM(attnflow_gae_real_sum_f64, double)

/* The same layer with padding (`keys`, (nb, n), 1 for a real token and 0 for padding,
 * in the dtype of the weights so that the selections vectorise), as the array-API pass
 * forms it: padded queries give zero rows and are not read; a real query's weights on
 * padded keys, and the gradients there, count as zero (selected away, never multiplied:
 * they may hold anything); each head's row is scaled by the inverse of its sum over the
 * real keys (by one where that sum is negative or NaN, as `normalize_rows` leaves it),
 * and a row with none becomes the query's own identity row. The checks see every key of
 * each real row, raw (sums[b, h, r] is 1 for a padded query); the sum of products is
 * that of the masked, renormalised ones. */
#define ATTNFLOW_GAE_MASKED(NAME, REAL_SUM, T)                                              \
ATTNFLOW_GAE_CLONES static void NAME(                                                       \
    const T *a, const T *g, ptrdiff_t nb, ptrdiff_t nh, ptrdiff_t nr, ptrdiff_t n,          \
    ptrdiff_t a_sb, ptrdiff_t a_sh, ptrdiff_t a_sr, ptrdiff_t g_sb, ptrdiff_t g_sh,         \
    ptrdiff_t g_sr, const ptrdiff_t *rows, const T *keys, T *out, T *sums,                  \
    T *low, T *total)                                                                       \
{                                                                                           \
    ptrdiff_t block = ATTNFLOW_GAE_BLOCK_BYTES / (n * (ptrdiff_t)sizeof(T));                \
    int check = sums != NULL;                                                               \
    T lowest = INFINITY, all = 0, heads = (T)nh;                                            \
    if (block < 1) block = 1;                                                               \
    for (ptrdiff_t b = 0; b < nb; ++b) {                                                    \
        const T *restrict kb = keys + b * n;                                                \
        for (ptrdiff_t r0 = 0; r0 < nr; r0 += block) {                                      \
            ptrdiff_t r1 = r0 + block < nr ? r0 + block : nr;                               \
            for (ptrdiff_t h = 0; h < nh; ++h) {                                            \
                const T *ab = a + b * a_sb + h * a_sh, *gb = g + b * g_sb + h * g_sh;       \
                for (ptrdiff_t r = r0; r < r1; ++r) {                                       \
                    ptrdiff_t row = rows[r];                                                \
                    T *restrict o = out + (b * nr + r) * n;                                 \
                    if (kb[row] == 0) {                                                     \
                        if (check) sums[(b * nh + h) * nr + r] = 1;                         \
                        continue;                                                           \
                    }                                                                       \
                    const T *restrict ar = ab + row * a_sr, *restrict gr = gb + row * g_sr; \
                    T tt = 0, full = 0, s = REAL_SUM(ar, kb, n, check, &full, &lowest);     \
                    if (check) sums[(b * nh + h) * nr + r] = full;                          \
                    if (s == 0) { /* no weight on a real key: the identity row */           \
                        for (ptrdiff_t j = 0; j < n; ++j) {                                 \
                            T p = kb[j] != 0 ? gr[j] * (T)(j == row) : 0, c = p < 0 ? 0 : p; \
                            o[j] = h == 0 ? c : o[j] + c; tt += p;                          \
                        }                                                                   \
                        all += tt;                                                          \
                        continue;                                                           \
                    }                                                                       \
                    /* max(g a / s, 0) = max(g a, 0) / s for s > 0; padded keys are zeroed \
                     * once every head is in (they may hold anything, even NaN). */         \
                    T inv = 1 / (s > 0 ? s : 1);                                            \
                    if (check) {                                                            \
                        ATTNFLOW_GAE_SIMD_REDUCE("omp simd reduction(+:tt)")                \
                        for (ptrdiff_t j = 0; j < n; ++j) {                                 \
                            T p = gr[j] * ar[j], c = (p < 0 ? 0 : p) * inv;                 \
                            o[j] = h == 0 ? c : o[j] + c; tt += kb[j] != 0 ? p : 0;         \
                        }                                                                   \
                        all += tt * inv;                                                    \
                    } else if (h == 0) {                                                    \
                        ATTNFLOW_GAE_SIMD_REDUCE("omp simd")                                \
                        for (ptrdiff_t j = 0; j < n; ++j) {                                 \
                            T p = gr[j] * ar[j]; o[j] = (p < 0 ? 0 : p) * inv;              \
                        }                                                                   \
                    } else {                                                                \
                        ATTNFLOW_GAE_SIMD_REDUCE("omp simd")                                \
                        for (ptrdiff_t j = 0; j < n; ++j) {                                 \
                            T p = gr[j] * ar[j]; o[j] += (p < 0 ? 0 : p) * inv;             \
                        }                                                                   \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            for (ptrdiff_t r = r0; r < r1; ++r) {                                           \
                T *restrict o = out + (b * nr + r) * n;                                     \
                if (kb[rows[r]] == 0) {                                                     \
                    for (ptrdiff_t j = 0; j < n; ++j) o[j] = 0;                             \
                } else {                                                                    \
                    ATTNFLOW_GAE_SIMD_REDUCE("omp simd")                                    \
                    for (ptrdiff_t j = 0; j < n; ++j) o[j] = kb[j] != 0 ? o[j] / heads : 0; \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    if (check) { *low = lowest; *total = all; }                                             \
}

ATTNFLOW_GAE_MASKED(attnflow_gae_fuse_masked_f32, attnflow_gae_real_sum_f32, float)
ATTNFLOW_GAE_MASKED(attnflow_gae_fuse_masked_f64, attnflow_gae_real_sum_f64, double)

/* The padded head mean of rollout (attnflow._prepare, through _gae_fused.fuse_masked_mean):
 * out[b, r, :] = sum_h w[h] * a[b, h, row_r, :] / s, with s the row's sum over the real
 * keys (`keys` as above), reading each weight once. As `normalize_rows` does after the
 * masking: s <= 0 or NaN divides by one, except s == 0, which gives the unit row (weight
 * w[h] on the query itself); padded queries are not read and give zero rows; padded keys
 * may hold anything (selected away, never summed) and are zero in the result. Nothing
 * is clipped. With `sums` (not NULL) the same pass reduces the checks: every head's full
 * row sum, sums[b, h, r] (1 for a padded query), and the smallest weight of the real
 * rows, *low. */
#define ATTNFLOW_MASKED_MEAN(NAME, REAL_SUM, T)                                             \
ATTNFLOW_GAE_CLONES static void NAME(                                                       \
    const T *a, ptrdiff_t nb, ptrdiff_t nh, ptrdiff_t nr, ptrdiff_t n, ptrdiff_t a_sb,      \
    ptrdiff_t a_sh, ptrdiff_t a_sr, const ptrdiff_t *rows, const T *keys, const T *w,       \
    T *out, T *sums, T *low)                                                                \
{                                                                                           \
    ptrdiff_t block = ATTNFLOW_GAE_BLOCK_BYTES / (n * (ptrdiff_t)sizeof(T));                \
    int check = sums != NULL;                                                               \
    T lowest = INFINITY;                                                                    \
    if (block < 1) block = 1;                                                               \
    for (ptrdiff_t b = 0; b < nb; ++b) {                                                    \
        const T *restrict kb = keys + b * n;                                                \
        for (ptrdiff_t r0 = 0; r0 < nr; r0 += block) {                                      \
            ptrdiff_t r1 = r0 + block < nr ? r0 + block : nr;                               \
            for (ptrdiff_t j = (b * nr + r0) * n; j < (b * nr + r1) * n; ++j) out[j] = 0;   \
            for (ptrdiff_t h = 0; h < nh; ++h) {                                            \
                const T *ab = a + b * a_sb + h * a_sh;                                      \
                T wh = w[h];                                                                \
                for (ptrdiff_t r = r0; r < r1; ++r) {                                       \
                    ptrdiff_t row = rows[r];                                                \
                    T *restrict o = out + (b * nr + r) * n;                                 \
                    if (kb[row] == 0) {                                                     \
                        if (check) sums[(b * nh + h) * nr + r] = 1;                         \
                        continue;                                                           \
                    }                                                                       \
                    const T *restrict ar = ab + row * a_sr;                                 \
                    T full = 0, s = REAL_SUM(ar, kb, n, check, &full, &lowest);             \
                    if (check) sums[(b * nh + h) * nr + r] = full;                          \
                    if (s == 0) { o[row] += wh; continue; } /* the unit row */              \
                    T scale = wh / (s > 0 ? s : 1);                                         \
                    ATTNFLOW_GAE_SIMD_REDUCE("omp simd")                                    \
                    for (ptrdiff_t j = 0; j < n; ++j) o[j] += ar[j] * scale;                \
                }                                                                           \
            }                                                                               \
            for (ptrdiff_t r = r0; r < r1; ++r) {                                           \
                T *restrict o = out + (b * nr + r) * n;                                     \
                if (kb[rows[r]] == 0) {                                                     \
                    for (ptrdiff_t j = 0; j < n; ++j) o[j] = 0;                             \
                } else {                                                                    \
                    ATTNFLOW_GAE_SIMD_REDUCE("omp simd")                                    \
                    for (ptrdiff_t j = 0; j < n; ++j) o[j] = kb[j] != 0 ? o[j] : 0;         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    if (check) *low = lowest;                                                               \
}

ATTNFLOW_MASKED_MEAN(attnflow_masked_mean_f32, attnflow_gae_real_sum_f32, float)
ATTNFLOW_MASKED_MEAN(attnflow_masked_mean_f64, attnflow_gae_real_sum_f64, double)
