/* ALTI's Manhattan distances of one attention block (attnflow/_contributions_kernel.pyx).
 *
 * For every batch item b, receiving token i and key j:
 *
 *     out[b, i, j] = sum_d | y[b, i, d] - c[b, i] * sum_h alpha[b, h, i, j] * v[b, h, j, d] |
 *
 * the distance ||y_i - T_i(x_j)||_1 of Ferrando et al. (2022) with T_i(x_j) the term of
 * key j without the residual (exact off the diagonal); given the residual r, the diagonal
 * is then replaced by ||y_i - c_i (sum_h alpha[b, h, i, i] v[b, h, i, :] + r_i)||_1.
 * The (n, n, d) terms are never stored: each is formed in registers, d lanes at a time,
 * for four receiving tokens that share the loads of one key's head vectors, and reduced
 * at once. The weights of a block of keys are first gathered key-major (times c_i), so
 * the head-major attention is read once, a cache line at a time.
 *
 * No -ffast-math: each term is accumulated head by head, in order (fused multiply-adds
 * in the AVX2 clone), as a matmul would; the sum over d goes lane by lane (W lanes) and
 * the lanes are added at the end, a pairwise-like order.
 */
#include <stddef.h>
#include <stdlib.h>
#include <math.h>

#if defined(_MSC_VER) && !defined(__clang__)
#define ATTNFLOW_CONTRIB_SIMD_REDUCE(clause)
#else
#define ATTNFLOW_CONTRIB_SIMD_REDUCE(clause) _Pragma(clause)
#endif

/* x86-64 with GCC or Clang on ELF: an AVX+FMA clone chosen at load time (ifunc), SSE2
 * else. ("arch=haswell" would dispatch on the CPU model, not its features.) */
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define ATTNFLOW_ALTI_CLONES __attribute__((target_clones("fma", "default")))
/* ALTI's distances also have an AVX-512 version (32 registers of 16 floats or 8 doubles:
 * the 8 rows' accumulators and sums stay in registers), chosen at run time. */
#define ATTNFLOW_ALTI_AVX512 1
#define ATTNFLOW_ALTI_AVX512_TARGET __attribute__((target("avx512f")))
#else
#define ATTNFLOW_ALTI_CLONES
#define ATTNFLOW_ALTI_AVX512 0
#endif

#define ATTNFLOW_ALTI_ROWS 8  /* receiving tokens sharing one key's loads (8 FMA chains) */
#define ATTNFLOW_ALTI_LANES 8 /* coordinates per step (16 floats in the AVX-512 version) */
#define ATTNFLOW_ALTI_KEYS 16 /* keys per gathered block of weights */

#if defined(__GNUC__) || defined(__clang__)
#include <string.h>
#include <stdint.h>
/* Eight lanes as one vector (GCC and Clang vector extensions): one register of AVX2
 * floats, two of doubles; the abs clears the sign bit. */
typedef float attnflow_alti_vf __attribute__((vector_size(32)));
typedef int32_t attnflow_alti_vfi __attribute__((vector_size(32)));
typedef double attnflow_alti_vd __attribute__((vector_size(64)));
typedef int64_t attnflow_alti_vdi __attribute__((vector_size(64)));
/* Sixteen floats: one AVX-512 register. */
typedef float attnflow_alti_vf16 __attribute__((vector_size(64)));
typedef int32_t attnflow_alti_vfi16 __attribute__((vector_size(64)));
#define ATTNFLOW_ALTI_VECTORS 1
#else
#define ATTNFLOW_ALTI_VECTORS 0
#endif

/* One block of R receiving tokens against key j: tot[r] = sum_d |y_r - sum_h a_rh v_h|.
 * The vector version keeps the R accumulators of W lanes in registers. */
#if ATTNFLOW_ALTI_VECTORS
#define ATTNFLOW_ALTI_BLOCK(NAME, T, V, VI, SIGN, ABS, LANES, TARGET)                       \
TARGET static void NAME(                                                                    \
    const T *const *yr, const T *const *cr, const T *vj, ptrdiff_t nh, ptrdiff_t d,         \
    ptrdiff_t v_sh, T *tot)                                                                 \
{                                                                                           \
    enum { R = ATTNFLOW_ALTI_ROWS, W = LANES };                                             \
    const VI keep = (VI){0} + (SIGN);                                                       \
    V sum[R], acc[R];                                                                       \
    ptrdiff_t full = d - d % W;                                                             \
    for (int r = 0; r < R; ++r) { sum[r] = (V){0}; tot[r] = 0; }                            \
    for (ptrdiff_t e = 0; e < full; e += W) {                                               \
        for (int r = 0; r < R; ++r) memcpy(&acc[r], yr[r] + e, sizeof(V));                  \
        for (ptrdiff_t h = 0; h < nh; ++h) {                                                \
            V x;                                                                            \
            memcpy(&x, vj + h * v_sh + e, sizeof(V));                                       \
            for (int r = 0; r < R; ++r) acc[r] -= cr[r][h] * x;                             \
        }                                                                                   \
        for (int r = 0; r < R; ++r) sum[r] += (V)((VI)acc[r] & keep);                       \
    }                                                                                       \
    for (int r = 0; r < R; ++r) {                                                           \
        for (int w = 0; w < W; ++w) tot[r] += sum[r][w];                                    \
        for (ptrdiff_t e = full; e < d; ++e) {                                              \
            T s = yr[r][e];                                                                 \
            for (ptrdiff_t h = 0; h < nh; ++h) s -= cr[r][h] * vj[h * v_sh + e];            \
            tot[r] += ABS(s);                                                               \
        }                                                                                   \
    }                                                                                       \
}
#else
#define ATTNFLOW_ALTI_BLOCK(NAME, T, V, VI, SIGN, ABS, LANES, TARGET)                       \
static inline void NAME(                                                                    \
    const T *const *yr, const T *const *cr, const T *vj, ptrdiff_t nh, ptrdiff_t d,         \
    ptrdiff_t v_sh, T *tot)                                                                 \
{                                                                                           \
    for (int r = 0; r < ATTNFLOW_ALTI_ROWS; ++r) {                                          \
        tot[r] = 0;                                                                         \
        for (ptrdiff_t e = 0; e < d; ++e) {                                                 \
            T s = yr[r][e];                                                                 \
            for (ptrdiff_t h = 0; h < nh; ++h) s -= cr[r][h] * vj[h * v_sh + e];            \
            tot[r] += ABS(s);                                                               \
        }                                                                                   \
    }                                                                                       \
}
#endif

/* The diagonal term, the only one with the residual r_i (when `res` is not NULL):
 * t[e] = c_i (sum_h alpha[b, h, i, i] v[b, h, i, e] + r[b, i, e]), heads in order. */
#define ATTNFLOW_OWN_TERM(NAME, T)                                                          \
static void NAME(                                                                           \
    const T *ai, ptrdiff_t a_sh, const T *vi, ptrdiff_t v_sh, const T *ri, T c, ptrdiff_t nh, \
    ptrdiff_t d, T *t)                                                                      \
{                                                                                           \
    for (ptrdiff_t e = 0; e < d; ++e) t[e] = 0;                                             \
    for (ptrdiff_t h = 0; h < nh; ++h) {                                                    \
        T a = ai[h * a_sh];                                                                 \
        const T *vh = vi + h * v_sh;                                                        \
        for (ptrdiff_t e = 0; e < d; ++e) t[e] += a * vh[e];                                \
    }                                                                                       \
    for (ptrdiff_t e = 0; e < d; ++e) t[e] = (t[e] + ri[e]) * c;                            \
}
ATTNFLOW_OWN_TERM(attnflow_own_term_f32, float)
ATTNFLOW_OWN_TERM(attnflow_own_term_f64, double)

/* Fills the receiving rows [first, last) of the flattened (b, i) range, b < nb: the
 * callers split the rows between threads (each output is written by one thread, and its
 * value does not depend on the split: every row has its own accumulators).
 * Returns 0, or -1 if the scratch buffer could not be allocated. */
#define ATTNFLOW_ALTI_DISTANCES(NAME, BLOCK, OWN, T, ABS, LANES, TARGET)                       \
TARGET static int NAME(                                                                     \
    const T *alpha, const T *scale, const T *v, const T *y, const T *res, ptrdiff_t nb,     \
    ptrdiff_t nh, ptrdiff_t n, ptrdiff_t d, ptrdiff_t a_sb, ptrdiff_t a_sh, ptrdiff_t a_si, \
    ptrdiff_t v_sb, ptrdiff_t v_sh, ptrdiff_t v_sj, T *out, T *totals, ptrdiff_t first,     \
    ptrdiff_t last)                                                                         \
{                                                                                           \
    enum { R = ATTNFLOW_ALTI_ROWS, K = ATTNFLOW_ALTI_KEYS, W = LANES };                     \
    T *coef;                                                                                \
    if (first < 0) first = 0;                                                               \
    if (last > nb * n) last = nb * n;                                                       \
    if (first >= last) return 0;                                                            \
    coef = (T *)malloc(sizeof(T) * (size_t)(K * n * nh + d));                               \
    if (coef == NULL) return -1;                                                            \
    for (ptrdiff_t b = first / n; b * n < last; ++b) {                                      \
        const T *ab = alpha + b * a_sb, *yb = y + b * n * d;                                \
        const T *cb = scale == NULL ? NULL : scale + b * n;                                 \
        ptrdiff_t lo = first > b * n ? first - b * n : 0;                                   \
        ptrdiff_t hi = last < (b + 1) * n ? last - b * n : n;                               \
        /* ||y_i||_1 summed in the order of the distances, so that a key with no weight */  \
        /* in any head is exactly as far as nothing (its share exactly 0). */               \
        for (ptrdiff_t i = lo; i < hi; ++i) {                                               \
            const T *yi = yb + i * d;                                                       \
            T lanes[W], s = 0;                                                              \
            ptrdiff_t full = d - d % W;                                                     \
            for (int w = 0; w < W; ++w) lanes[w] = 0;                                       \
            for (ptrdiff_t e = 0; e < full; e += W)                                         \
                for (int w = 0; w < W; ++w) lanes[w] += ABS(yi[e + w]);                    \
            for (int w = 0; w < W; ++w) s += lanes[w];                                      \
            for (ptrdiff_t e = full; e < d; ++e) s += ABS(yi[e]);                           \
            totals[b * n + i] = s;                                                          \
        }                                                                                   \
        for (ptrdiff_t j0 = 0; j0 < n; j0 += K) {                                           \
            ptrdiff_t kk = j0 + K < n ? K : n - j0;                                         \
            /* coef[k][i][h] = c_i alpha[b, h, i, j0 + k] */                                \
            for (ptrdiff_t h = 0; h < nh; ++h)                                              \
                for (ptrdiff_t i = lo; i < hi; ++i) {                                       \
                    const T *row = ab + h * a_sh + i * a_si + j0;                           \
                    T c = cb == NULL ? (T)1 : cb[i];                                        \
                    for (ptrdiff_t k = 0; k < kk; ++k)                                      \
                        coef[(k * n + i) * nh + h] = c * row[k];                            \
                }                                                                           \
            for (ptrdiff_t k = 0; k < kk; ++k) {                                            \
                ptrdiff_t j = j0 + k;                                                       \
                const T *vj = v + b * v_sb + j * v_sj;                                      \
                for (ptrdiff_t i0 = lo; i0 < hi; i0 += R) {                                 \
                    const T *yr[R];                                                         \
                    const T *cr[R];                                                         \
                    T tot[R];                                                               \
                    for (int r = 0; r < R; ++r) {                                           \
                        ptrdiff_t i = i0 + r < hi ? i0 + r : hi - 1;                        \
                        yr[r] = yb + i * d;                                                 \
                        cr[r] = coef + (k * n + i) * nh;                                    \
                    }                                                                       \
                    BLOCK(yr, cr, vj, nh, d, v_sh, tot);                                    \
                    for (int r = 0; r < R && i0 + r < hi; ++r)                              \
                        out[(b * n + i0 + r) * n + j] = tot[r];                             \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        /* The diagonal, ||y_i - T_i(x_i)||_1 with the residual, in place of the above. */  \
        for (ptrdiff_t i = lo; res != NULL && i < hi; ++i) {                                \
            T *t = coef + K * n * nh, lanes[W], s = 0;                                      \
            const T *yi = yb + i * d;                                                       \
            ptrdiff_t full = d - d % W;                                                     \
            OWN(ab + i * a_si + i, a_sh, v + b * v_sb + i * v_sj, v_sh, res + (b * n + i) * d, \
                cb == NULL ? (T)1 : cb[i], nh, d, t);                                       \
            for (int w = 0; w < W; ++w) lanes[w] = 0;                                       \
            for (ptrdiff_t e = 0; e < full; e += W)                                         \
                for (int w = 0; w < W; ++w) lanes[w] += ABS(yi[e + w] - t[e + w]);         \
            for (int w = 0; w < W; ++w) s += lanes[w];                                      \
            for (ptrdiff_t e = full; e < d; ++e) s += ABS(yi[e] - t[e]);                    \
            out[(b * n + i) * n + i] = s;                                                   \
        }                                                                                   \
    }                                                                                       \
    free(coef);                                                                             \
    return 0;                                                                               \
}

ATTNFLOW_ALTI_BLOCK(attnflow_alti_block_f32, float, attnflow_alti_vf, attnflow_alti_vfi,
                    0x7fffffff, fabsf, ATTNFLOW_ALTI_LANES, ATTNFLOW_ALTI_CLONES)
ATTNFLOW_ALTI_BLOCK(attnflow_alti_block_f64, double, attnflow_alti_vd, attnflow_alti_vdi,
                    0x7fffffffffffffffLL, fabs, ATTNFLOW_ALTI_LANES, ATTNFLOW_ALTI_CLONES)
ATTNFLOW_ALTI_DISTANCES(attnflow_alti_distances_f32_any, attnflow_alti_block_f32,
                        attnflow_own_term_f32, float, fabsf, ATTNFLOW_ALTI_LANES,
                        ATTNFLOW_ALTI_CLONES)
ATTNFLOW_ALTI_DISTANCES(attnflow_alti_distances_f64_any, attnflow_alti_block_f64,
                        attnflow_own_term_f64, double, fabs, ATTNFLOW_ALTI_LANES,
                        ATTNFLOW_ALTI_CLONES)

#define ATTNFLOW_ALTI_ARGUMENTS(T)                                                          \
    const T *alpha, const T *scale, const T *v, const T *y, const T *res, ptrdiff_t nb,     \
    ptrdiff_t nh, ptrdiff_t n, ptrdiff_t d, ptrdiff_t a_sb, ptrdiff_t a_sh, ptrdiff_t a_si,               \
    ptrdiff_t v_sb, ptrdiff_t v_sh, ptrdiff_t v_sj, T *out, T *totals, ptrdiff_t first,     \
    ptrdiff_t last
#define ATTNFLOW_ALTI_FORWARD                                                               \
    alpha, scale, v, y, res, nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj, out, totals, \
    first, last

#if ATTNFLOW_ALTI_AVX512
/* Floats 16 lanes at a time (the sum over d in that order), doubles 8 as elsewhere. */
ATTNFLOW_ALTI_BLOCK(attnflow_alti_block_f32_avx512, float, attnflow_alti_vf16,
                    attnflow_alti_vfi16, 0x7fffffff, fabsf, 16, ATTNFLOW_ALTI_AVX512_TARGET)
ATTNFLOW_ALTI_BLOCK(attnflow_alti_block_f64_avx512, double, attnflow_alti_vd, attnflow_alti_vdi,
                    0x7fffffffffffffffLL, fabs, 8, ATTNFLOW_ALTI_AVX512_TARGET)
ATTNFLOW_ALTI_DISTANCES(attnflow_alti_distances_f32_avx512, attnflow_alti_block_f32_avx512,
                        attnflow_own_term_f32, float, fabsf, 16, ATTNFLOW_ALTI_AVX512_TARGET)
ATTNFLOW_ALTI_DISTANCES(attnflow_alti_distances_f64_avx512, attnflow_alti_block_f64_avx512,
                        attnflow_own_term_f64, double, fabs, 8, ATTNFLOW_ALTI_AVX512_TARGET)

/* Set by the tests to run the other version on a CPU with AVX-512 (not thread-safe). */
static int attnflow_alti_avx512_off = 0;

static int attnflow_alti_has_avx512(void)
{
    static int known = -1; /* a benign race: every thread computes the same answer */
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return known && !attnflow_alti_avx512_off;
}
#define ATTNFLOW_ALTI_DISPATCH(T, SUFFIX)                                                   \
static int attnflow_alti_distances_##SUFFIX(ATTNFLOW_ALTI_ARGUMENTS(T))                     \
{                                                                                           \
    if (attnflow_alti_has_avx512())                                                         \
        return attnflow_alti_distances_##SUFFIX##_avx512(ATTNFLOW_ALTI_FORWARD);            \
    return attnflow_alti_distances_##SUFFIX##_any(ATTNFLOW_ALTI_FORWARD);                   \
}
static int attnflow_alti_avx512(int allowed)
{
    int before = attnflow_alti_has_avx512();
    attnflow_alti_avx512_off = !allowed;
    return before;
}
#else
static int attnflow_alti_avx512(int allowed)
{
    (void)allowed;
    return 0;
}
#define ATTNFLOW_ALTI_DISPATCH(T, SUFFIX)                                                   \
static int attnflow_alti_distances_##SUFFIX(ATTNFLOW_ALTI_ARGUMENTS(T))                     \
{                                                                                           \
    return attnflow_alti_distances_##SUFFIX##_any(ATTNFLOW_ALTI_FORWARD);                   \
}
#endif
ATTNFLOW_ALTI_DISPATCH(float, f32)
ATTNFLOW_ALTI_DISPATCH(double, f64)

/* The Euclidean rules (norm, GlobEnc) of one attention block:
 *
 *     out[b, i, j] = c[b, i] * sqrt(max(0, a^T G_j a)),  a_h = alpha[b, h, i, j],
 *     G_j[h, h'] = v[b, h, j, :] . v[b, h', j, :]
 *
 * = ||c_i sum_h alpha^h_ij v^h_j||_2 (Kobayashi et al. 2020, Modarressi et al. 2022)
 * from each key's Gram matrix of its head vectors, H^2 products per pair instead of H d.
 * Per batch item the upper triangles of the Gram matrices are stored head-pair-major,
 * gram[p][j] with the off-diagonal entries doubled, so that W consecutive keys of one
 * receiving row are reduced lane by lane. Rounding can leave a tiny negative square where
 * heads cancel: it is clipped to 0. */
#if ATTNFLOW_ALTI_VECTORS
#define ATTNFLOW_GRAM_ROW(NAME, T, V)                                                       \
ATTNFLOW_ALTI_CLONES static void NAME(                                                      \
    const T *ai, ptrdiff_t a_sh, const T *gram, ptrdiff_t nh, ptrdiff_t n, T *squares)      \
{                                                                                           \
    enum { W = ATTNFLOW_ALTI_LANES };                                                       \
    ptrdiff_t full = n - n % W;                                                             \
    for (ptrdiff_t j = 0; j < full; j += W) {                                               \
        V s = (V){0};                                                                       \
        const T *g = gram + j;                                                              \
        for (ptrdiff_t h = 0; h < nh; ++h) {                                                \
            V ah, t = (V){0};                                                               \
            memcpy(&ah, ai + h * a_sh + j, sizeof(V));                                      \
            for (ptrdiff_t k = h; k < nh; ++k, g += n) {                                    \
                V ak, gk;                                                                   \
                memcpy(&ak, ai + k * a_sh + j, sizeof(V));                                  \
                memcpy(&gk, g, sizeof(V));                                                  \
                t += gk * ak;                                                               \
            }                                                                               \
            s += ah * t;                                                                    \
        }                                                                                   \
        memcpy(squares + j, &s, sizeof(V));                                                 \
    }                                                                                       \
    for (ptrdiff_t j = full; j < n; ++j) {                                                  \
        T s = 0;                                                                            \
        const T *g = gram + j;                                                              \
        for (ptrdiff_t h = 0; h < nh; ++h) {                                                \
            T t = 0;                                                                        \
            for (ptrdiff_t k = h; k < nh; ++k, g += n) t += *g * ai[k * a_sh + j];          \
            s += ai[h * a_sh + j] * t;                                                      \
        }                                                                                   \
        squares[j] = s;                                                                     \
    }                                                                                       \
}
#else
#define ATTNFLOW_GRAM_ROW(NAME, T, V)                                                       \
static void NAME(                                                                           \
    const T *ai, ptrdiff_t a_sh, const T *gram, ptrdiff_t nh, ptrdiff_t n, T *squares)      \
{                                                                                           \
    for (ptrdiff_t j = 0; j < n; ++j) {                                                     \
        T s = 0;                                                                            \
        const T *g = gram + j;                                                              \
        for (ptrdiff_t h = 0; h < nh; ++h) {                                                \
            T t = 0;                                                                        \
            for (ptrdiff_t k = h; k < nh; ++k, g += n) t += *g * ai[k * a_sh + j];          \
            s += ai[h * a_sh + j] * t;                                                      \
        }                                                                                   \
        squares[j] = s;                                                                     \
    }                                                                                       \
}
#endif

/* Fills the receiving rows [first, last) of the flattened (b, i) range, as the distances
 * do (a thread whose rows share a batch item with another's builds its Gram matrices too).
 * Returns 0, or -1 if the Gram matrices could not be allocated. */
#define ATTNFLOW_GRAM_NORMS(NAME, ROW, OWN, T, SQRT)                                        \
ATTNFLOW_ALTI_CLONES static int NAME(                                                       \
    const T *alpha, const T *scale, const T *v, const T *res, ptrdiff_t nb, ptrdiff_t nh,   \
    ptrdiff_t n, ptrdiff_t d, ptrdiff_t a_sb, ptrdiff_t a_sh, ptrdiff_t a_si,               \
    ptrdiff_t v_sb, ptrdiff_t v_sh, ptrdiff_t v_sj, T *out, ptrdiff_t first, ptrdiff_t last) \
{                                                                                           \
    T *gram;                                                                                \
    if (first < 0) first = 0;                                                               \
    if (last > nb * n) last = nb * n;                                                       \
    if (first >= last) return 0;                                                            \
    gram = (T *)malloc(sizeof(T) * (size_t)(nh * (nh + 1) / 2 * n + d));                    \
    if (gram == NULL) return -1;                                                            \
    for (ptrdiff_t b = first / n; b * n < last; ++b) {                                      \
        const T *vb = v + b * v_sb;                                                         \
        ptrdiff_t lo = first > b * n ? first - b * n : 0;                                   \
        ptrdiff_t hi = last < (b + 1) * n ? last - b * n : n;                               \
        for (ptrdiff_t j = 0; j < n; ++j) {                                                 \
            T *g = gram + j;                                                                \
            for (ptrdiff_t h = 0; h < nh; ++h) {                                            \
                const T *vh = vb + h * v_sh + j * v_sj;                                     \
                for (ptrdiff_t k = h; k < nh; ++k, g += n) {                                \
                    const T *vk = vb + k * v_sh + j * v_sj;                                 \
                    T s = 0;                                                                \
                    ATTNFLOW_CONTRIB_SIMD_REDUCE("omp simd reduction(+:s)")                \
                    for (ptrdiff_t e = 0; e < d; ++e) s += vh[e] * vk[e];                   \
                    *g = k == h ? s : 2 * s;                                                \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (ptrdiff_t i = lo; i < hi; ++i) {                                               \
            T *row = out + (b * n + i) * n;                                                 \
            T c = scale == NULL ? (T)1 : scale[b * n + i];                                  \
            ROW(alpha + b * a_sb + i * a_si, a_sh, gram, nh, n, row);                       \
            for (ptrdiff_t j = 0; j < n; ++j) row[j] = c * SQRT(row[j] > 0 ? row[j] : 0);   \
            if (res != NULL) { /* the diagonal, ||T_i(x_i)||_2 with the residual */         \
                T *t = gram + nh * (nh + 1) / 2 * n, s = 0;                                 \
                OWN(alpha + b * a_sb + i * a_si + i, a_sh, vb + i * v_sj, v_sh,             \
                    res + (b * n + i) * d, c, nh, d, t);                                    \
                for (ptrdiff_t e = 0; e < d; ++e) s += t[e] * t[e];                         \
                row[i] = SQRT(s);                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    free(gram);                                                                             \
    return 0;                                                                               \
}

ATTNFLOW_GRAM_ROW(attnflow_gram_row_f32, float, attnflow_alti_vf)
ATTNFLOW_GRAM_ROW(attnflow_gram_row_f64, double, attnflow_alti_vd)
ATTNFLOW_GRAM_NORMS(attnflow_gram_norms_f32, attnflow_gram_row_f32, attnflow_own_term_f32,
                    float, sqrtf)
ATTNFLOW_GRAM_NORMS(attnflow_gram_norms_f64, attnflow_gram_row_f64, attnflow_own_term_f64,
                    double, sqrt)

/* A layer's ranges of receiving rows run by an OpenMP team: the one the calling thread
 * already has in the process's OpenMP runtime (PyTorch's intra-op threads), through that
 * runtime's GOMP_parallel entry point (GNU libgomp; LLVM's and Intel's runtimes export it
 * too), found by the caller at run time; this module links no OpenMP runtime itself.
 * The team's threads take the ranges in turn (an atomic counter), each range written by
 * the thread that took it: the same ranges as on the caller's own threads, the same bits.
 * Where the team's workers are waiting for the next parallel region (libgomp's spin
 * after each one), they take ranges at once instead of spinning beside the kernel. */
typedef void (*attnflow_team_body)(void *);
typedef void (*attnflow_gomp_parallel)(attnflow_team_body, void *, unsigned, unsigned);

typedef struct {
    int kind; /* 0: Gram norms, float; 1: Gram norms, double; 2: ALTI, float; 3: ALTI, double */
    const void *alpha, *scale, *v, *y, *res;
    ptrdiff_t nb, nh, n, d, a_sb, a_sh, a_si, v_sb, v_sh, v_sj;
    void *out, *totals;
    const ptrdiff_t *bounds; /* parts + 1 increasing row bounds */
    ptrdiff_t parts, next;
    int failed;
    int shares; /* ALTI: write max(||y_i||_1 - D_ij, 0) in place of D_ij */
} attnflow_team_task;

/* ALTI's shares of rows [lo, hi): max(||y_i||_1 - D_ij, 0) in place of D_ij, as
 * maximum(totals - out, 0) would compute them (no -0: ||y_i||_1 and D_ij are >= +0). */
#define ATTNFLOW_ALTI_SHARES(T)                                                                 {                                                                                               T *o = (T *)t->out;                                                                         const T *s = (const T *)t->totals;                                                          for (ptrdiff_t row = lo; row < hi; ++row)                                                       for (ptrdiff_t j = 0; j < t->n; ++j) {                                                          T x = s[row] - o[row * t->n + j];                                                           o[row * t->n + j] = x < 0 ? (T)0 : x;                                                   }                                                                                   }

#if defined(__GNUC__) || defined(__clang__)
#define ATTNFLOW_TEAM_TAKE(t) __atomic_fetch_add(&(t)->next, 1, __ATOMIC_RELAXED)
#define ATTNFLOW_TEAM_FAIL(t) __atomic_store_n(&(t)->failed, 1, __ATOMIC_RELAXED)
#define ATTNFLOW_TEAM 1
#else /* no atomics known here: the ranges run on the calling thread, in turn */
#define ATTNFLOW_TEAM_TAKE(t) ((t)->next++)
#define ATTNFLOW_TEAM_FAIL(t) ((t)->failed = 1)
#define ATTNFLOW_TEAM 0
#endif

static void attnflow_team_run(void *data)
{
    attnflow_team_task *t = (attnflow_team_task *)data;
    for (;;) {
        ptrdiff_t k = ATTNFLOW_TEAM_TAKE(t), lo, hi;
        int failed = 0;
        if (k >= t->parts) break;
        lo = t->bounds[k];
        hi = t->bounds[k + 1];
        switch (t->kind) {
        case 0:
            failed = attnflow_gram_norms_f32(
                (const float *)t->alpha, (const float *)t->scale, (const float *)t->v,
                (const float *)t->res, t->nb, t->nh, t->n, t->d, t->a_sb, t->a_sh, t->a_si,
                t->v_sb, t->v_sh, t->v_sj, (float *)t->out, lo, hi);
            break;
        case 1:
            failed = attnflow_gram_norms_f64(
                (const double *)t->alpha, (const double *)t->scale, (const double *)t->v,
                (const double *)t->res, t->nb, t->nh, t->n, t->d, t->a_sb, t->a_sh, t->a_si,
                t->v_sb, t->v_sh, t->v_sj, (double *)t->out, lo, hi);
            break;
        case 2:
            failed = attnflow_alti_distances_f32(
                (const float *)t->alpha, (const float *)t->scale, (const float *)t->v,
                (const float *)t->y, (const float *)t->res, t->nb, t->nh, t->n, t->d, t->a_sb,
                t->a_sh, t->a_si, t->v_sb, t->v_sh, t->v_sj, (float *)t->out,
                (float *)t->totals, lo, hi);
            if (!failed && t->shares) ATTNFLOW_ALTI_SHARES(float)
            break;
        default:
            failed = attnflow_alti_distances_f64(
                (const double *)t->alpha, (const double *)t->scale, (const double *)t->v,
                (const double *)t->y, (const double *)t->res, t->nb, t->nh, t->n, t->d,
                t->a_sb, t->a_sh, t->a_si, t->v_sb, t->v_sh, t->v_sj, (double *)t->out,
                (double *)t->totals, lo, hi);
            if (!failed && t->shares) ATTNFLOW_ALTI_SHARES(double)
        }
        if (failed) ATTNFLOW_TEAM_FAIL(t);
    }
}

/* Runs every range of `task` on `threads` threads of the calling thread's team through
 * `parallel` (a GOMP_parallel; NULL, or a compiler without atomics: on the calling thread);
 * returns 0, or -1 if a range's scratch buffer could not be allocated. */
static int attnflow_team(void *parallel, attnflow_team_task *task, unsigned threads)
{
    task->next = 0;
    task->failed = 0;
    if (parallel != NULL && ATTNFLOW_TEAM)
        ((attnflow_gomp_parallel)parallel)(attnflow_team_run, task, threads, 0);
    else
        attnflow_team_run(task);
    return task->failed ? -1 : 0;
}
