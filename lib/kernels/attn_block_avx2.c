/* The attention block kernels (attn_block.h) on AVX2 + FMA, for CPUs without AVX-512:
 * attn_block.c's AVX-512 loops at 8 lanes, with the same exp polynomial (2^n applied in two
 * halves, as AVX2 has no vscalefps: the same values wherever they are normal), 8 x 8 register
 * transposes where AVX-512 gathers, and register tiles of 6 rows x 16 columns (12 of the 16
 * ymm registers) where AVX-512 has 6 x 64. */
#include "lib/kernels/attn_block_avx2.h"

#ifdef KT__ATTN_AVX2
#include <immintrin.h>
#include <math.h>

#include "lib/kernels/avx2_util.h" /* v_lanes8, transpose8 */

#define Y_TARGET V_TARGET
#define Y_INLINE V_INLINE

/* 2^n for integral n in [-254, 254] (two factors, each a normal power of two) */
Y_INLINE __m256 scale2(__m256 p, __m256 n)
{
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* exp16's polynomial (attn_block.c) on 8 lanes; -inf and anything below -150 give exactly 0,
 * NaN stays NaN */
Y_INLINE __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(-150.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.7f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), f);
    __m256 p = _mm256_set1_ps(1.98412698e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.38888889e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.33333333e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.16666667e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.66666667e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    /* NaN: n converts to INT_MIN, and p is NaN whatever the factors */
    return scale2(p, n);
}

/* One register tile: R rows of C by NV vectors of 8 columns (the last under `last`). */
Y_INLINE void tile(const int R, const int NV, __m256i last, int full, int64_t K, const float *A,
                   int64_t sam, int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                   int accumulate, const float *fc)
{
    __m256 c[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            c[r][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * ldb;
        const float *a = A + k * sak;
        __m256 bv[2];
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            bv[v] = v == NV - 1 && !full ? _mm256_maskload_ps(b + 8 * v, last)
                                         : _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 av = _mm256_broadcast_ss(a + r * sam);
#pragma GCC unroll 2
            for (int v = 0; v < NV; v++)
                c[r][v] = _mm256_fmadd_ps(av, bv[v], c[r][v]);
        }
    }
    const __m256i all = _mm256_set1_epi32(-1);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) {
            float *p = C + r * ldc + 8 * v;
            const __m256i k = v == NV - 1 && !full ? last : all;
            __m256 x = c[r][v];
            if (fc)
                x = _mm256_fmadd_ps(_mm256_maskload_ps(p, k), _mm256_maskload_ps(fc + 8 * v, k), x);
            else if (accumulate)
                x = _mm256_add_ps(x, _mm256_maskload_ps(p, k));
            _mm256_maskstore_ps(p, k, x);
        }
}

#define TILE_CASE(R, NV)                                                                           \
    case (R)*4 + (NV):                                                                             \
        tile(R, NV, last, full, K, A, sam, sak, B, ldb, C, ldc, accumulate, fc);                   \
        return;

Y_TARGET static void tile_any(int R, int NV, __m256i last, int full, int64_t K, const float *A,
                              int64_t sam, int64_t sak, const float *B, int64_t ldb, float *C,
                              int64_t ldc, int accumulate, const float *fc)
{
    switch (R * 4 + NV) {
        TILE_CASE(6, 2)
        TILE_CASE(6, 1) TILE_CASE(5, 2) TILE_CASE(5, 1) TILE_CASE(4, 2) TILE_CASE(4, 1)
            TILE_CASE(3, 2) TILE_CASE(3, 1) TILE_CASE(2, 2) TILE_CASE(2, 1) TILE_CASE(1, 2)
                TILE_CASE(1, 1) default : return;
    }
}
#undef TILE_CASE

/* Columns in pieces of 16 (B's piece stays in L1 over all rows), rows in tiles of 6. */
Y_TARGET void kt__attn_gemm_avx2(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                                 int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                                 int accumulate, const float *fc)
{
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t nn = N - n0 < 16 ? N - n0 : 16;
        const int nv = nn > 8 ? 2 : 1;
        const int64_t tail = nn - 8 * (nv - 1);
        const __m256i last = v_lanes8(tail);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            const int R = M - m0 < 6 ? (int)(M - m0) : 6;
            tile_any(R, nv, last, tail == 8, K, A + m0 * sam, sam, sak, B + n0, ldb,
                     C + m0 * ldc + n0, ldc, accumulate, fc ? fc + n0 : NULL);
        }
    }
}

/* 8 x 8 blocks through registers (zeros loaded past the rows, so the padding comes out 0) */
Y_TARGET void kt__attn_transpose_avx2(int64_t rows, int64_t cols, const float *src, int64_t lds,
                                      float f, float *dst, int64_t ldd)
{
    const __m256 vf = _mm256_set1_ps(f);
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
        const __m256i in = v_lanes8(cols - c0);
        const int64_t cn = cols - c0 < 8 ? cols - c0 : 8;
        for (int64_t r0 = 0; r0 < ldd; r0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = r0 + i < rows ? _mm256_maskload_ps(src + (r0 + i) * lds + c0, in)
                                     : _mm256_setzero_ps();
            transpose8(r);
            const __m256i out = v_lanes8(ldd - r0);
            for (int64_t j = 0; j < cn; j++)
                _mm256_maskstore_ps(dst + (c0 + j) * ldd + r0, out, _mm256_mul_ps(r[j], vf));
        }
    }
}

/* tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) */
Y_TARGET void kt__attn_softcap_avx2(int64_t rows, int64_t cols, float *x, int64_t ld, float cap)
{
    const __m256 vc = _mm256_set1_ps(cap), inv = _mm256_set1_ps(-2.0f / cap);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c += 8) {
            const __m256 v = _mm256_loadu_ps(x + r * ld + c);
            const __m256 a = _mm256_andnot_ps(sign, v);
            const __m256 e = exp8(_mm256_mul_ps(a, inv));
            const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            const __m256 st = _mm256_or_ps(t, _mm256_and_ps(v, sign));
            _mm256_storeu_ps(x + r * ld + c, _mm256_mul_ps(vc, st));
        }
}

Y_TARGET void kt__attn_online_avx2(int64_t rows, int64_t cols, float *s, int64_t ld, float *m,
                                   float *l, float *alpha)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < cols; c += 8) {
        const __m256 m_old = _mm256_loadu_ps(m + c);
        __m256 mx = m_old;
        for (int64_t r = 0; r < rows; r++)
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + r * ld + c));
        const __m256 empty = _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ);
        const __m256 use = _mm256_blendv_ps(mx, _mm256_setzero_ps(), empty);
        __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            const __m256 p0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + r * ld + c), use));
            const __m256 p1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + (r + 1) * ld + c), use));
            _mm256_storeu_ps(s + r * ld + c, p0);
            _mm256_storeu_ps(s + (r + 1) * ld + c, p1);
            sum0 = _mm256_add_ps(sum0, p0);
            sum1 = _mm256_add_ps(sum1, p1);
        }
        if (r < rows) {
            const __m256 p0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + r * ld + c), use));
            _mm256_storeu_ps(s + r * ld + c, p0);
            sum0 = _mm256_add_ps(sum0, p0);
        }
        const __m256 a = exp8(_mm256_sub_ps(m_old, use));
        _mm256_storeu_ps(alpha + c, a);
        _mm256_storeu_ps(l + c,
                         _mm256_fmadd_ps(_mm256_loadu_ps(l + c), a, _mm256_add_ps(sum0, sum1)));
        _mm256_storeu_ps(m + c, mx);
    }
}

Y_TARGET void kt__attn_scale_cols_avx2(int64_t rows, int64_t cols, float *x, int64_t ld,
                                       const float *f)
{
    for (int64_t c = 0; c < cols; c += 8) {
        const __m256 v = _mm256_loadu_ps(f + c);
        for (int64_t r = 0; r < rows; r++)
            _mm256_storeu_ps(x + r * ld + c, _mm256_mul_ps(_mm256_loadu_ps(x + r * ld + c), v));
    }
}

Y_TARGET void kt__attn_probs_grad_avx2(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                                       int64_t ldp, const float *lse, const float *di, int per_col,
                                       float cap)
{
    const __m256 one = _mm256_set1_ps(1.0f), ncap = _mm256_set1_ps(-cap);
    const __m256 inv = _mm256_set1_ps(cap > 0.0f ? 1.0f / cap : 0.0f);
    for (int64_t r = 0; r < rows; r++) {
        const __m256 lr = _mm256_set1_ps(per_col ? 0.0f : lse[r]);
        const __m256 dr = _mm256_set1_ps(per_col ? 0.0f : di[r]);
        for (int64_t c = 0; c < cols; c += 8) {
            const __m256 lv = per_col ? _mm256_loadu_ps(lse + c) : lr;
            const __m256 dv = per_col ? _mm256_loadu_ps(di + c) : dr;
            const __m256 x = _mm256_loadu_ps(s + r * lds + c);
            const __m256 p = exp8(_mm256_sub_ps(x, lv));
            __m256 ds = _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dp + r * ldp + c), dv));
            if (cap > 0.0f) {
                const __m256 y = _mm256_mul_ps(_mm256_max_ps(x, ncap), inv);
                ds = _mm256_mul_ps(ds, _mm256_fnmadd_ps(y, y, one));
            }
            _mm256_storeu_ps(s + r * lds + c, p);
            _mm256_storeu_ps(dp + r * ldp + c, ds);
        }
    }
}
#endif
