/* AVX-512 BF16 kernels of the quantized products (quant_avx512.h): dequantisation to bf16 in
 * registers, and the few-row NT product on it with vdpbf16ps.
 *
 * INT4 goes through a table: a group's 16 possible values bf16((nibble - 8) * scale) are
 * computed once per group, and vpermw turns 32 nibbles into their bf16 values in one
 * instruction (a 64-input block is 32 bytes: its low nibbles are inputs 0-31, its high ones
 * 32-63). INT8 converts and scales (vpmovsxbd, vcvtdq2ps, vmulps, vcvtne2ps2bf16: rounding as
 * kt_f32_to_bf16_1). Both give exactly kt__q_value's bf16. */
#include "lib/kernels/quant_avx512.h"

#include "kt/tensor.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define QA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The 16 values of a (bf16) scale's nibbles, twice (a 32-entry vpermw table). */
QA_TARGET static inline __m512i int4_table(uint16_t scale)
{
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 s = _mm512_castsi512_ps(_mm512_set1_epi32((int)((uint32_t)scale << 16)));
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(q, s));
    return _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
}

/* A 64-input INT4 block (32 bytes at b) as two vectors of 32 bf16, inputs 0-31 (table t0)
 * and 32-63 (t1: the same table unless the group is 32). */
QA_TARGET static inline void int4_block(const uint8_t *b, __m512i t0, __m512i t1, __m512i *lo,
                                        __m512i *hi)
{
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
    *lo = _mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(15)), t0);
    *hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), t1);
}

/* 32 INT8 inputs at q as 32 bf16, scaled by s. */
QA_TARGET static inline __m512i int8_block(const uint8_t *q, __m512 s)
{
    const __m512 a = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), s);
    const __m512 b = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
        s);
    return (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a is the low half */
}

/* log2 of a group size (32, 64 or 128) */
static inline int group_shift(int64_t group) { return group == 32 ? 5 : group == 64 ? 6 : 7; }

/* The tables of the 64-input block at c of a row whose scales are srow (groups of 1 << sh):
 * each half its own for groups of 32, else the group's, rebuilt when the group changes. */
QA_TARGET static inline void block_tables(const uint16_t *srow, int sh, int64_t c, int64_t *group,
                                          __m512i *t0, __m512i *t1)
{
    if (sh == 5) {
        *t0 = int4_table(srow[c >> 5]);
        *t1 = int4_table(srow[(c >> 5) + 1]);
    } else if (c >> sh != *group) {
        *group = c >> sh;
        *t0 = *t1 = int4_table(srow[*group]);
    }
}

QA_TARGET void kt__q_dequant_avx512(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0,
                                    int64_t c1, uint16_t *out, int64_t ldo)
{
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *o = out + (r - r0) * ldo - c0;
        int64_t c = c0;
        if (w->fmt == KT__Q_INT4) {
            const uint8_t *row = w->q + r * (w->cols / 2);
            const int sh = group_shift(w->group);
            const uint16_t *srow = w->scale + (r * w->cols >> sh);
            int64_t group = -1;
            __m512i t0 = _mm512_setzero_si512(), t1 = t0;
            for (; c < c1 && c % 16 != 0; c++) /* an unaligned head: one value at a time */
                o[c] = kt_f32_to_bf16_1(kt__q_value(w, r, c));
            while (c + 16 <= c1) {
                if (c % KT__Q4_BLOCK == 0 && c + KT__Q4_BLOCK <= c1) { /* a whole block */
                    block_tables(srow, sh, c, &group, &t0, &t1);
                    __m512i lo, hi;
                    int4_block(row + c / 2, t0, t1, &lo, &hi);
                    _mm512_storeu_si512((void *)(o + c), lo);
                    _mm512_storeu_si512((void *)(o + c + 32), hi);
                    c += KT__Q4_BLOCK;
                    continue;
                }
                /* 16 inputs of a block: 16 bytes, their low or high nibbles */
                const __m256i t = _mm512_castsi512_si256(int4_table(srow[c >> sh]));
                const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                    (const __m128i *)(row + c / KT__Q4_BLOCK * 32 + c % 32)));
                const __m256i nib = c % KT__Q4_BLOCK < 32
                                        ? _mm256_and_si256(b, _mm256_set1_epi16(15))
                                        : _mm256_srli_epi16(b, 4);
                _mm256_storeu_si256((__m256i *)(o + c), _mm256_permutexvar_epi16(nib, t));
                group = -1;
                c += 16;
            }
        } else {
            const __m512 s =
                _mm512_castsi512_ps(_mm512_set1_epi32((int)((uint32_t)w->scale[r] << 16)));
            for (; c + 32 <= c1; c += 32)
                _mm512_storeu_si512((void *)(o + c), int8_block(w->q + r * w->cols + c, s));
        }
        for (; c < c1; c++) /* the tail */
            o[c] = kt_f32_to_bf16_1(kt__q_value(w, r, c));
    }
}

/* The bf16 pairs' dot products of a row of x with a block of 32 dequantised inputs. */
#define DP(acc, xrow, k, wv)                                                                       \
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)((xrow) + (k))),         \
                           (__m512bh)(wv))

QA_TARGET void kt__q_nt_rows_avx512(int64_t M, int64_t n0, int64_t n1, const uint16_t *x,
                                    int64_t ldx, const kt__qmat *w, float *y, int64_t ldy)
{
    const int64_t K = w->cols;
    for (int64_t n = n0; n < n1; n++) {
        /* two sums per row of x (inputs 0-31 and 32-63 of each block), so that the products
         * of a block do not wait on each other; above 8 rows the rows' own sums are enough
         * chains, and the second sum stays zero (32 sums would not fit the registers) */
        __m512 a0[KT__Q_NT_ROWS_MAX_M], a1[KT__Q_NT_ROWS_MAX_M];
        for (int64_t m = 0; m < M; m++)
            a0[m] = a1[m] = _mm512_setzero_ps();
        const int split = M <= 8;
        int64_t c = 0;
        if (w->fmt == KT__Q_INT4) {
            const uint8_t *row = w->q + n * (K / 2);
            const int sh = group_shift(w->group);
            const uint16_t *srow = w->scale + (n * K >> sh);
            int64_t group = -1;
            __m512i t0 = _mm512_setzero_si512(), t1 = t0;
            for (; c < K; c += KT__Q4_BLOCK) {
                block_tables(srow, sh, c, &group, &t0, &t1);
                __m512i lo, hi;
                int4_block(row + c / 2, t0, t1, &lo, &hi);
                for (int64_t m = 0; m < M; m++) {
                    DP(a0[m], x + m * ldx, c, lo);
                    if (split)
                        DP(a1[m], x + m * ldx, c + 32, hi);
                    else
                        DP(a0[m], x + m * ldx, c + 32, hi);
                }
            }
        } else {
            const __m512 s =
                _mm512_castsi512_ps(_mm512_set1_epi32((int)((uint32_t)w->scale[n] << 16)));
            const uint8_t *row = w->q + n * K;
            for (; c + 64 <= K; c += 64) {
                const __m512i v0 = int8_block(row + c, s), v1 = int8_block(row + c + 32, s);
                for (int64_t m = 0; m < M; m++) {
                    DP(a0[m], x + m * ldx, c, v0);
                    if (split)
                        DP(a1[m], x + m * ldx, c + 32, v1);
                    else
                        DP(a0[m], x + m * ldx, c + 32, v1);
                }
            }
            for (; c + 32 <= K; c += 32) {
                const __m512i v = int8_block(row + c, s);
                for (int64_t m = 0; m < M; m++)
                    DP(a0[m], x + m * ldx, c, v);
            }
        }
        for (int64_t m = 0; m < M; m++) { /* K % 32 inputs left (INT8): scalar, in order */
            float t = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
            for (int64_t k = c; k < K; k++)
                t += kt_bf16_to_f32_1(x[m * ldx + k]) * kt__q_value(w, n, k);
            y[m * ldy + n] = t;
        }
    }
}
#undef DP

#else

void kt__q_dequant_avx512(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                          uint16_t *out, int64_t ldo)
{
    kt__q_dequant_bf16(w, r0, r1, c0, c1, out, ldo);
}

void kt__q_nt_rows_avx512(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                          const kt__qmat *w, float *y, int64_t ldy)
{
    (void)M, (void)n0, (void)n1, (void)x, (void)ldx, (void)w, (void)y, (void)ldy;
}

#endif
