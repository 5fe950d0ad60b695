/* See vec.h. */
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "kt/tensor.h"
#include "lib/kernels/lane_mask.h"
#include "lib/kernels/vec.h"

/* The 16 lane sums added by a fixed tree: l + l[8..], then halves, then pairs. */
static float fold16(const float l[16])
{
    float s8[8];
    for (int j = 0; j < 8; j++)
        s8[j] = l[j] + l[j + 8];
    for (int j = 0; j < 4; j++)
        s8[j] += s8[j + 4];
    return (s8[0] + s8[2]) + (s8[1] + s8[3]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VEC_AVX512 1
#define VEC_TARGET __attribute__((target("avx512f")))
#define VEC_INLINE static inline __attribute__((always_inline, target("avx512f")))

VEC_TARGET static float dot_avx512(int64_t n, const float *a, const float *b)
{
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 k = kt__lanes16(n - i);
        acc =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
    }
    _Alignas(64) float l[16];
    _mm512_store_ps(l, acc);
    return fold16(l);
}

VEC_TARGET static void axpy_avx512(int64_t n, float alpha, const float *x, float *y)
{
    const __m512 va = _mm512_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i,
                         _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 k = kt__lanes16(n - i);
        _mm512_mask_storeu_ps(
            y + i, k,
            _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, y + i)));
    }
}

/* Ranks at a time in kt__vec_rows_dots: their accumulators stay in registers. */
#define DOTS_BLOCK 8

/* 16 columns by up to RANK_BLOCK ranks of accumulators at a time, down all the rows */
#define RANK_BLOCK 8

/* 16 values (the first `left` of them, the rest zero) widened to f32 (AVX-512F only) */
VEC_TARGET static __m512 load_row16(const void *x, int bf16, int64_t i, int64_t left)
{
    if (bf16) {
        __m256i h;
        if (left >= 16) {
            h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        } else {
            uint16_t t[16] = {0};
            memcpy(t, (const uint16_t *)x + i, (size_t)left * sizeof *t);
            h = _mm256_loadu_si256((const __m256i *)t);
        }
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const __mmask16 k = kt__lanes16(left);
    return _mm512_maskz_loadu_ps(k, (const float *)x + i);
}

/* kt__vec_rows_dots: blocks of rows whose partial lane sums (RD_ROWS x DOTS_BLOCK x 16 floats,
 * 32 KiB) are carried between chunks of RD_COLS columns, over which DOTS_BLOCK ranks' pieces
 * (16 KiB) stay in L1 while the block's rows pass two at a time (16 accumulators). */
#define RD_ROWS 64
#define RD_COLS 512

/* The lane sums of a row's ranks: the first nq to out (folded) after the last chunk, else all
 * of them kept in part (the next chunk loads all; past nq they are discarded sums of zeros). */
VEC_TARGET static void rd_finish(const __m512 *acc, int nq, int last, float *part, float *out)
{
    for (int j = 0; j < (last ? nq : DOTS_BLOCK); j++) {
        if (last) {
            _Alignas(64) float l[16];
            _mm512_store_ps(l, acc[j]);
            out[j] = fold16(l);
        } else {
            _mm512_store_ps(part + 16 * j, acc[j]);
        }
    }
}

/* acc0[j] += x0 row . ap[j], acc1[j] += x1 row . ap[j] over columns [c0, c0 + cw), 16 at a
 * time (j < DOTS_BLOCK). The accumulators are named locals over the loop: as arrays (passed
 * on to rd_finish) gcc stored all 16 to the stack every step. */
_Static_assert(DOTS_BLOCK == 8, "rd_two_rows names 8 accumulators a row");
VEC_INLINE void rd_two_rows(const unsigned char *x0, const unsigned char *x1, int bf16, int64_t c0,
                            int64_t cw, const float (*ap)[RD_COLS], const unsigned char *pf0,
                            const unsigned char *pf1, __m512 *acc0, __m512 *acc1)
{
    const size_t es = bf16 ? 2 : 4;
    __m512 a0 = acc0[0], a1 = acc0[1], a2 = acc0[2], a3 = acc0[3], a4 = acc0[4], a5 = acc0[5],
           a6 = acc0[6], a7 = acc0[7];
    __m512 b0 = acc1[0], b1 = acc1[1], b2 = acc1[2], b3 = acc1[3], b4 = acc1[4], b5 = acc1[5],
           b6 = acc1[6], b7 = acc1[7];
    for (int64_t i = 0; i < cw; i += 16) {
        if (pf0 != NULL) {
            _mm_prefetch((const char *)pf0 + (size_t)(c0 + i) * es, _MM_HINT_T0);
            _mm_prefetch((const char *)pf1 + (size_t)(c0 + i) * es, _MM_HINT_T0);
        }
        const __m512 xv0 = load_row16(x0, bf16, c0 + i, cw - i);
        const __m512 xv1 = load_row16(x1, bf16, c0 + i, cw - i);
#define RD_FMA(j)                                                                                  \
    {                                                                                              \
        const __m512 av = _mm512_load_ps(&ap[j][i]);                                               \
        a##j = _mm512_fmadd_ps(xv0, av, a##j);                                                     \
        b##j = _mm512_fmadd_ps(xv1, av, b##j);                                                     \
    }
        RD_FMA(0) RD_FMA(1) RD_FMA(2) RD_FMA(3) RD_FMA(4) RD_FMA(5) RD_FMA(6) RD_FMA(7)
#undef RD_FMA
    }
    acc0[0] = a0, acc0[1] = a1, acc0[2] = a2, acc0[3] = a3;
    acc0[4] = a4, acc0[5] = a5, acc0[6] = a6, acc0[7] = a7;
    acc1[0] = b0, acc1[1] = b1, acc1[2] = b2, acc1[3] = b3;
    acc1[4] = b4, acc1[5] = b5, acc1[6] = b6, acc1[7] = b7;
}

VEC_TARGET static void rows_dots_avx512(int64_t n, int64_t nrows, const void *x, int64_t ldx,
                                        int bf16, const float *a, int64_t a_row, int64_t a_col,
                                        int64_t R, float *out)
{
    _Alignas(64) float ap[DOTS_BLOCK][RD_COLS];
    _Alignas(64) float part[RD_ROWS][DOTS_BLOCK][16];
    const size_t es = bf16 ? 2 : 4;
    for (int64_t q0 = 0; q0 < R; q0 += DOTS_BLOCK) {
        const int nq = R - q0 < DOTS_BLOCK ? (int)(R - q0) : DOTS_BLOCK;
        for (int64_t r0 = 0; r0 < nrows; r0 += RD_ROWS) {
            const int64_t rb = nrows - r0 < RD_ROWS ? nrows - r0 : RD_ROWS;
            for (int64_t c0 = 0; c0 < n || c0 == 0; c0 += RD_COLS) {
                const int64_t cw = n - c0 < RD_COLS ? n - c0 : RD_COLS;
                const int last = c0 + RD_COLS >= n;
                /* this chunk of the block's ranks, zero past the ranks and the columns */
                for (int j = 0; j < DOTS_BLOCK; j++)
                    for (int64_t i = 0; i < (cw + 15) / 16 * 16; i++)
                        ap[j][i] = j < nq && i < cw ? a[(q0 + j) * a_row + (c0 + i) * a_col] : 0.0f;
                for (int64_t r = 0; r < rb; r += 2) {
                    const unsigned char *x0 =
                        (const unsigned char *)x + (size_t)((r0 + r) * ldx) * es;
                    const unsigned char *x1 = r + 1 < rb ? x0 + (size_t)ldx * es : x0;
                    __m512 acc0[DOTS_BLOCK], acc1[DOTS_BLOCK];
                    for (int j = 0; j < DOTS_BLOCK; j++) {
                        acc0[j] = c0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part[r][j]);
                        acc1[j] = c0 == 0 || r + 1 >= rb ? _mm512_setzero_ps()
                                                         : _mm512_load_ps(part[r + 1][j]);
                    }
                    /* the next pair's piece of the rows is fetched meanwhile: each row's piece is
                     * a short run, which the hardware prefetchers do not start on in time */
                    const unsigned char *pf0 = r + 2 < rb ? x1 + (size_t)ldx * es : NULL;
                    const unsigned char *pf1 = r + 3 < rb ? pf0 + (size_t)ldx * es : pf0;
                    rd_two_rows(x0, x1, bf16, c0, cw, (const float(*)[RD_COLS])ap, pf0, pf1, acc0,
                                acc1);
                    rd_finish(acc0, nq, last, part[r][0], out + (r0 + r) * R + q0);
                    if (r + 1 < rb)
                        rd_finish(acc1, nq, last, part[r + 1][0], out + (r0 + r + 1) * R + q0);
                }
            }
        }
    }
}

/* Columns [i, i + 16) of ranks [q0, q0 + nq) down all the rows. nq is a constant where it is
 * inlined (rank_update_avx512's switch): with a run-time count gcc kept the accumulators in
 * memory, each row's multiply-adds then waiting on the previous row's stores (about five
 * times slower: a third of LoRA's weight_grad phase). */
VEC_INLINE void rank_block(const int nq, int64_t n, int64_t i, int64_t nrows, const void *x,
                           int64_t ldx, int bf16, const float *coef, int64_t R, int64_t q0,
                           float *acc, int64_t lda)
{
    const size_t es = bf16 ? 2 : 4;
    __m512 a[RANK_BLOCK];
    for (int q = 0; q < nq; q++)
        a[q] = _mm512_setzero_ps();
    for (int64_t r = 0; r < nrows; r++) {
        const void *row = (const unsigned char *)x + (size_t)(r * ldx) * es;
        const __m512 xv = load_row16(row, bf16, i, n - i);
        const float *c = coef + r * R + q0;
        for (int q = 0; q < nq; q++)
            a[q] = _mm512_fmadd_ps(_mm512_set1_ps(c[q]), xv, a[q]);
    }
    const __mmask16 k = kt__lanes16(n - i);
    for (int q = 0; q < nq; q++)
        _mm512_mask_storeu_ps(acc + (q0 + q) * lda + i, k, a[q]);
}

VEC_TARGET static void rank_update_avx512(int64_t n, int64_t nrows, const void *x, int64_t ldx,
                                          int bf16, const float *coef, int64_t R, float *acc,
                                          int64_t lda)
{
    _Static_assert(RANK_BLOCK == 8, "rank_update_avx512's switch lists 1..8 ranks");
    for (int64_t i = 0; i < n; i += 16)
        for (int64_t q0 = 0; q0 < R; q0 += RANK_BLOCK) {
            const int nq = R - q0 < RANK_BLOCK ? (int)(R - q0) : RANK_BLOCK;
#define RANK_CASE(NQ)                                                                              \
    case NQ:                                                                                       \
        rank_block(NQ, n, i, nrows, x, ldx, bf16, coef, R, q0, acc, lda);                          \
        break;
            switch (nq) {
                RANK_CASE(1)
                RANK_CASE(2)
                RANK_CASE(3)
                RANK_CASE(4)
                RANK_CASE(5)
                RANK_CASE(6)
                RANK_CASE(7)
                RANK_CASE(8)
            }
#undef RANK_CASE
        }
}

/* Rows r < nrows of y: a 16-column block of x's R rows is read once from memory for all
 * rows (it stays in L1), each y element read and written once. */
VEC_TARGET static void rows_axpys_avx512(int64_t n, int64_t nrows, const float *coef, int64_t R,
                                         const float *x, int64_t ldx, float scale, float *y,
                                         int64_t ldy)
{
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = kt__lanes16(n - i);
        for (int64_t r = 0; r < nrows; r++) {
            const float *c = coef + r * R;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t q = 0; q < R; q++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(c[q]),
                                      _mm512_maskz_loadu_ps(k, x + q * ldx + i), acc);
            float *yr = y + r * ldy + i;
            _mm512_mask_storeu_ps(yr, k, _mm512_fmadd_ps(vs, acc, _mm512_maskz_loadu_ps(k, yr)));
        }
    }
}

/* ---- AVX2 + FMA (CPUs without AVX-512): the AVX-512 loops' sums at 8 lanes, the 16 lanes of
 * a dot product as two ymm (so the bits are the AVX-512 path's) ---------------------------- */

#define V2_TARGET __attribute__((target("avx2,fma")))
#define V2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

V2_INLINE __m256i lanes8(int64_t n)
{
    static const int32_t tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_loadu_si256((const __m256i *)(tab + 8 - n));
}

/* 8 values (the first `left`, the rest zero) widened to f32 */
V2_INLINE __m256 load_row8(const void *x, int bf16, int64_t i, int64_t left)
{
    if (bf16) {
        __m128i h;
        if (left >= 8) {
            h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        } else {
            uint16_t t[8] = {0};
            if (left > 0)
                memcpy(t, (const uint16_t *)x + i, (size_t)left * sizeof *t);
            h = _mm_loadu_si128((const __m128i *)t);
        }
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return left >= 8 ? _mm256_loadu_ps((const float *)x + i)
                     : _mm256_maskload_ps((const float *)x + i, lanes8(left));
}

V2_TARGET static float dot_avx2(int64_t n, const float *a, const float *b)
{
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    for (int64_t i = 0; i < n; i += 16) {
        lo = _mm256_fmadd_ps(load_row8(a, 0, i, n - i), load_row8(b, 0, i, n - i), lo);
        hi = _mm256_fmadd_ps(load_row8(a, 0, i + 8, n - i - 8), load_row8(b, 0, i + 8, n - i - 8),
                             hi);
    }
    float l[16];
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(l + 8, hi);
    return fold16(l);
}

V2_TARGET static void axpy_avx2(int64_t n, float alpha, const float *x, float *y)
{
    const __m256 va = _mm256_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    if (i < n) {
        const __m256i k = lanes8(n - i);
        _mm256_maskstore_ps(
            y + i, k,
            _mm256_fmadd_ps(va, _mm256_maskload_ps(x + i, k), _mm256_maskload_ps(y + i, k)));
    }
}

/* Ranks at a time in rows_dots_avx2: 4 ranks x 16 lanes = 8 ymm accumulators. */
#define DOTS2_BLOCK 4

/* rows_dots_avx512's blocking with one row at a time: ranks' chunks of RD_COLS columns packed
 * (a's columns may be strided), lane sums carried between chunks in part */
V2_TARGET static void rows_dots_avx2(int64_t n, int64_t nrows, const void *x, int64_t ldx, int bf16,
                                     const float *a, int64_t a_row, int64_t a_col, int64_t R,
                                     float *out)
{
    _Alignas(32) float ap[DOTS2_BLOCK][RD_COLS];
    _Alignas(32) float part[RD_ROWS][DOTS2_BLOCK][16];
    const size_t es = bf16 ? 2 : 4;
    for (int64_t q0 = 0; q0 < R; q0 += DOTS2_BLOCK) {
        const int nq = R - q0 < DOTS2_BLOCK ? (int)(R - q0) : DOTS2_BLOCK;
        for (int64_t r0 = 0; r0 < nrows; r0 += RD_ROWS) {
            const int64_t rb = nrows - r0 < RD_ROWS ? nrows - r0 : RD_ROWS;
            for (int64_t c0 = 0; c0 < n || c0 == 0; c0 += RD_COLS) {
                const int64_t cw = n - c0 < RD_COLS ? n - c0 : RD_COLS;
                const int last = c0 + RD_COLS >= n;
                for (int j = 0; j < DOTS2_BLOCK; j++)
                    for (int64_t i = 0; i < (cw + 15) / 16 * 16; i++)
                        ap[j][i] = j < nq && i < cw ? a[(q0 + j) * a_row + (c0 + i) * a_col] : 0.0f;
                for (int64_t r = 0; r < rb; r++) {
                    const unsigned char *xr =
                        (const unsigned char *)x + (size_t)((r0 + r) * ldx) * es;
                    __m256 acc[DOTS2_BLOCK][2];
                    for (int j = 0; j < DOTS2_BLOCK; j++)
                        for (int h = 0; h < 2; h++)
                            acc[j][h] =
                                c0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(&part[r][j][8 * h]);
                    for (int64_t i = 0; i < cw; i += 16) {
                        const __m256 x0 = load_row8(xr, bf16, c0 + i, cw - i);
                        const __m256 x1 = load_row8(xr, bf16, c0 + i + 8, cw - i - 8);
                        for (int j = 0; j < DOTS2_BLOCK; j++) {
                            acc[j][0] = _mm256_fmadd_ps(x0, _mm256_load_ps(&ap[j][i]), acc[j][0]);
                            acc[j][1] =
                                _mm256_fmadd_ps(x1, _mm256_load_ps(&ap[j][i + 8]), acc[j][1]);
                        }
                    }
                    for (int j = 0; j < (last ? nq : DOTS2_BLOCK); j++) {
                        _mm256_store_ps(&part[r][j][0], acc[j][0]);
                        _mm256_store_ps(&part[r][j][8], acc[j][1]);
                        if (last)
                            out[(r0 + r) * R + q0 + j] = fold16(part[r][j]);
                    }
                }
            }
        }
    }
}

/* 8 columns [i, i + 8) of ranks [q0, q0 + nq) down all the rows (nq a constant where inlined,
 * so the accumulators stay in registers: rank_block's reason) */
V2_INLINE void rank_block8(const int nq, int64_t n, int64_t i, int64_t nrows, const void *x,
                           int64_t ldx, int bf16, const float *coef, int64_t R, int64_t q0,
                           float *acc, int64_t lda)
{
    const size_t es = bf16 ? 2 : 4;
    __m256 a[RANK_BLOCK];
    for (int q = 0; q < nq; q++)
        a[q] = _mm256_setzero_ps();
    for (int64_t r = 0; r < nrows; r++) {
        const void *row = (const unsigned char *)x + (size_t)(r * ldx) * es;
        const __m256 xv = load_row8(row, bf16, i, n - i);
        const float *c = coef + r * R + q0;
        for (int q = 0; q < nq; q++)
            a[q] = _mm256_fmadd_ps(_mm256_set1_ps(c[q]), xv, a[q]);
    }
    const __m256i k = lanes8(n - i);
    for (int q = 0; q < nq; q++)
        _mm256_maskstore_ps(acc + (q0 + q) * lda + i, k, a[q]);
}

V2_TARGET static void rank_update_avx2(int64_t n, int64_t nrows, const void *x, int64_t ldx,
                                       int bf16, const float *coef, int64_t R, float *acc,
                                       int64_t lda)
{
    for (int64_t i = 0; i < n; i += 8)
        for (int64_t q0 = 0; q0 < R; q0 += RANK_BLOCK) {
            const int nq = R - q0 < RANK_BLOCK ? (int)(R - q0) : RANK_BLOCK;
#define RANK_CASE(NQ)                                                                              \
    case NQ:                                                                                       \
        rank_block8(NQ, n, i, nrows, x, ldx, bf16, coef, R, q0, acc, lda);                         \
        break;
            switch (nq) {
                RANK_CASE(1)
                RANK_CASE(2)
                RANK_CASE(3)
                RANK_CASE(4)
                RANK_CASE(5)
                RANK_CASE(6)
                RANK_CASE(7)
                RANK_CASE(8)
            }
#undef RANK_CASE
        }
}

V2_TARGET static void rows_axpys_avx2(int64_t n, int64_t nrows, const float *coef, int64_t R,
                                      const float *x, int64_t ldx, float scale, float *y,
                                      int64_t ldy)
{
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i k = lanes8(n - i);
        for (int64_t r = 0; r < nrows; r++) {
            const float *c = coef + r * R;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t q = 0; q < R; q++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(c[q]), _mm256_maskload_ps(x + q * ldx + i, k),
                                      acc);
            float *yr = y + r * ldy + i;
            _mm256_maskstore_ps(yr, k, _mm256_fmadd_ps(vs, acc, _mm256_maskload_ps(yr, k)));
        }
    }
}
#endif

/* The portable order: lane l sums i = 16c + l (fused multiply-add as fmaf would round once;
 * plain a*b+acc here, so the portable and AVX-512 bits may differ in the last place). */
static float dot_plain(int64_t n, const float *a, const float *b)
{
    float l[16] = {0};
    for (int64_t i = 0; i < n; i++)
        l[i & 15] += a[i] * b[i];
    return fold16(l);
}

float kt__vec_dot(int64_t n, const float *a, const float *b)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512())
        return dot_avx512(n, a, b);
    if (kt__cpu_has_avx2())
        return dot_avx2(n, a, b);
#endif
    return dot_plain(n, a, b);
}

void kt__vec_axpy(int64_t n, float alpha, const float *x, float *y)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512()) {
        axpy_avx512(n, alpha, x, y);
        return;
    }
    if (kt__cpu_has_avx2()) {
        axpy_avx2(n, alpha, x, y);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        y[i] += alpha * x[i];
}

void kt__vec_rows_axpys(int64_t n, int64_t nrows, const float *coef, int64_t R, const float *x,
                        int64_t ldx, float scale, float *y, int64_t ldy)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512()) {
        rows_axpys_avx512(n, nrows, coef, R, x, ldx, scale, y, ldy);
        return;
    }
    if (kt__cpu_has_avx2()) {
        rows_axpys_avx2(n, nrows, coef, R, x, ldx, scale, y, ldy);
        return;
    }
#endif
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t i = 0; i < n; i++) {
            float acc = 0.0f;
            for (int64_t q = 0; q < R; q++)
                acc += coef[r * R + q] * x[q * ldx + i];
            y[r * ldy + i] += scale * acc;
        }
}

void kt__vec_rows_dots(int64_t n, int64_t nrows, const void *x, int64_t ldx, int bf16,
                       const float *a, int64_t a_row, int64_t a_col, int64_t R, float *out)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512()) {
        rows_dots_avx512(n, nrows, x, ldx, bf16, a, a_row, a_col, R, out);
        return;
    }
    if (kt__cpu_has_avx2()) {
        rows_dots_avx2(n, nrows, x, ldx, bf16, a, a_row, a_col, R, out);
        return;
    }
#endif
    const size_t es = bf16 ? 2 : 4;
    for (int64_t r = 0; r < nrows; r++) {
        const unsigned char *xr = (const unsigned char *)x + (size_t)(r * ldx) * es;
        for (int64_t q = 0; q < R; q++) {
            float l[16] = {0};
            for (int64_t i = 0; i < n; i++) {
                const float v =
                    bf16 ? kt_bf16_to_f32_1(((const uint16_t *)xr)[i]) : ((const float *)xr)[i];
                l[i & 15] += v * a[q * a_row + i * a_col];
            }
            out[r * R + q] = fold16(l);
        }
    }
}

void kt__vec_rank_update(int64_t n, int64_t nrows, const void *x, int64_t ldx, int bf16,
                         const float *coef, int64_t R, float *acc, int64_t lda)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512()) {
        rank_update_avx512(n, nrows, x, ldx, bf16, coef, R, acc, lda);
        return;
    }
    if (kt__cpu_has_avx2()) {
        rank_update_avx2(n, nrows, x, ldx, bf16, coef, R, acc, lda);
        return;
    }
#endif
    for (int64_t q = 0; q < R; q++)
        for (int64_t i = 0; i < n; i++)
            acc[q * lda + i] = 0.0f;
    /* each element widened once; every acc[q][i] still sums its rows in order */
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t i = 0; i < n; i++) {
            const size_t at = (size_t)(r * ldx + i);
            const float v =
                bf16 ? kt_bf16_to_f32_1(((const uint16_t *)x)[at]) : ((const float *)x)[at];
            for (int64_t q = 0; q < R; q++)
                acc[q * lda + i] += coef[r * R + q] * v;
        }
}
