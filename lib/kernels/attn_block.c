/* See attn_block.h. */
#include <math.h>
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/attn_block.h"
#include "lib/kernels/attn_block_avx2.h"
#include "lib/kernels/lane_mask.h"

/* ---- plain C ---------------------------------------------------------------------------- */

static void gemm_plain(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                       int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                       int accumulate)
{
    for (int64_t m = 0; m < M; m++) {
        float *c = C + m * ldc;
        if (!accumulate)
            memset(c, 0, (size_t)N * sizeof *c);
        /* row by row of B: each c[n] still sums its k in order */
        for (int64_t k = 0; k < K; k++) {
            const float a = A[m * sam + k * sak];
            const float *b = B + k * ldb;
            for (int64_t n = 0; n < N; n++)
                c[n] += a * b[n];
        }
    }
}

static void transpose_plain(int64_t rows, int64_t cols, const float *src, int64_t lds, float f,
                            float *dst, int64_t ldd)
{
    for (int64_t c = 0; c < cols; c++) {
        for (int64_t r = 0; r < rows; r++)
            dst[c * ldd + r] = f * src[r * lds + c];
        for (int64_t r = rows; r < ldd; r++)
            dst[c * ldd + r] = 0.0f;
    }
}

static void softcap_plain(int64_t rows, int64_t cols, float *x, int64_t ld, float cap)
{
    const float inv = 1.0f / cap;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            x[r * ld + c] = cap * tanhf(x[r * ld + c] * inv);
}

static void online_plain(int64_t rows, int64_t cols, float *s, int64_t ld, float *m, float *l,
                         float *alpha)
{
    for (int64_t c = 0; c < cols; c++) {
        float mx = m[c];
        for (int64_t r = 0; r < rows; r++)
            mx = s[r * ld + c] > mx ? s[r * ld + c] : mx;
        const float use = mx == -INFINITY ? 0.0f : mx; /* all masked: exp(-inf) = 0 */
        float sum = 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            const float p = expf(s[r * ld + c] - use);
            s[r * ld + c] = p;
            sum += p;
        }
        alpha[c] = expf(m[c] - use);
        l[c] = l[c] * alpha[c] + sum;
        m[c] = mx;
    }
}

static void probs_grad_plain(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                             int64_t ldp, const float *lse, const float *di, int per_col,
                             float cap)
{
    const float inv = cap > 0.0f ? 1.0f / cap : 0.0f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = per_col ? c : r;
            const float x = s[r * lds + c];
            const float p = expf(x - lse[i]);
            float ds = p * (dp[r * ldp + c] - di[i]);
            if (cap > 0.0f) {
                const float y = (x > -cap ? x : -cap) * inv; /* masked: factor 0, not -inf */
                ds *= 1.0f - y * y;
            }
            s[r * lds + c] = p;
            dp[r * ldp + c] = ds;
        }
}

/* ---- AVX-512 ------------------------------------------------------------------------------ */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ATTN_AVX512 1
#define A_TARGET __attribute__((target("avx512f")))
#define A_INLINE static inline __attribute__((always_inline, target("avx512f")))

/* exp with a degree-7 polynomial on [-ln2/2, ln2/2] after 2^n is split off (about 2 ulp);
 * -inf and anything below -150 give exactly 0, NaN stays NaN. */
A_INLINE __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(88.7f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 p = _mm512_set1_ps(1.98412698e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.38888889e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.33333333e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.16666667e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.66666667e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One register tile: R rows of C by NV vectors of 16 columns (the last under `last`). R and
 * NV are constants where it is inlined, so the accumulators stay in registers. */
A_INLINE void tile(const int R, const int NV, __mmask16 last, int64_t K, const float *A,
                   int64_t sam, int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                   int accumulate, const float *fc)
{
    __m512 c[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            c[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * ldb;
        const float *a = A + k * sak;
        __m512 bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, b + 16 * v)
                                : _mm512_loadu_ps(b + 16 * v);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512 av = _mm512_set1_ps(a[r * sam]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                c[r][v] = _mm512_fmadd_ps(av, bv[v], c[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            float *p = C + r * ldc + 16 * v;
            const __mmask16 k = v == NV - 1 ? last : (__mmask16)0xffff;
            __m512 x = c[r][v];
            if (fc)
                x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, p),
                                    _mm512_maskz_loadu_ps(k, fc + 16 * v), x);
            else if (accumulate)
                x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, p));
            _mm512_mask_storeu_ps(p, k, x);
        }
}

#define TILE_CASE(R, NV)                                                                     \
    case (R) * 8 + (NV):                                                                     \
        tile(R, NV, last, K, A, sam, sak, B, ldb, C, ldc, accumulate, fc);                   \
        return;

A_TARGET static void tile_any(int R, int NV, __mmask16 last, int64_t K, const float *A,
                              int64_t sam, int64_t sak, const float *B, int64_t ldb, float *C,
                              int64_t ldc, int accumulate, const float *fc)
{
    switch (R * 8 + NV) {
        TILE_CASE(6, 4) TILE_CASE(6, 3) TILE_CASE(6, 2) TILE_CASE(6, 1)
        TILE_CASE(5, 4) TILE_CASE(5, 3) TILE_CASE(5, 2) TILE_CASE(5, 1)
        TILE_CASE(4, 4) TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
        TILE_CASE(3, 4) TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
        TILE_CASE(2, 4) TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
        TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
    default:
        return;
    }
}

/* Columns in pieces of 64 (B's piece stays in L1 over all rows), rows in tiles of 6. */
A_TARGET static void gemm_avx512(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                                 int64_t sak, const float *B, int64_t ldb, float *C,
                                 int64_t ldc, int accumulate, const float *fc)
{
    for (int64_t n0 = 0; n0 < N; n0 += 64) {
        const int64_t nn = N - n0 < 64 ? N - n0 : 64;
        const int nv = (int)((nn + 15) / 16);
        const __mmask16 last = kt__lanes16(nn - 16 * (nv - 1));
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            const int R = M - m0 < 6 ? (int)(M - m0) : 6;
            tile_any(R, nv, last, K, A + m0 * sam, sam, sak, B + n0, ldb, C + m0 * ldc + n0,
                     ldc, accumulate, fc ? fc + n0 : NULL);
        }
    }
}

/* 16 rows of a column at a time by a gather (the rows lds apart) */
A_TARGET static void transpose_avx512(int64_t rows, int64_t cols, const float *src,
                                      int64_t lds, float f, float *dst, int64_t ldd)
{
    const __m512 vf = _mm512_set1_ps(f);
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                            5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)lds));
    for (int64_t r0 = 0; r0 < ldd; r0 += 16) {
        const __mmask16 in = kt__lanes16(rows - r0), out = kt__lanes16(ldd - r0);
        const float *s = src + (r0 < rows ? r0 : 0) * lds;
        for (int64_t c = 0; c < cols; c++) {
            const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, idx, s + c, 4);
            _mm512_mask_storeu_ps(dst + c * ldd + r0, out, _mm512_mul_ps(v, vf));
        }
    }
}

/* tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) */
A_TARGET static void softcap_avx512(int64_t rows, int64_t cols, float *x, int64_t ld, float cap)
{
    const __m512 vc = _mm512_set1_ps(cap), inv = _mm512_set1_ps(-2.0f / cap);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c += 16) {
            const __m512 v = _mm512_loadu_ps(x + r * ld + c);
            const __m512 a = _mm512_abs_ps(v);
            const __m512 e = exp16(_mm512_mul_ps(a, inv));
            const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
            const __m512i s = _mm512_and_si512(_mm512_castps_si512(v), sign);
            const __m512 st = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), s));
            _mm512_storeu_ps(x + r * ld + c, _mm512_mul_ps(vc, st));
        }
}

A_TARGET static void online_avx512(int64_t rows, int64_t cols, float *s, int64_t ld, float *m,
                                   float *l, float *alpha)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < cols; c += 16) {
        const __m512 m_old = _mm512_loadu_ps(m + c);
        __m512 mx = m_old;
        for (int64_t r = 0; r < rows; r++)
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + r * ld + c));
        const __mmask16 empty = _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ);
        const __m512 use = _mm512_mask_mov_ps(mx, empty, _mm512_setzero_ps());
        __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            const __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + r * ld + c), use));
            const __m512 p1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (r + 1) * ld + c), use));
            _mm512_storeu_ps(s + r * ld + c, p0);
            _mm512_storeu_ps(s + (r + 1) * ld + c, p1);
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
        }
        if (r < rows) {
            const __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + r * ld + c), use));
            _mm512_storeu_ps(s + r * ld + c, p0);
            sum0 = _mm512_add_ps(sum0, p0);
        }
        const __m512 a = exp16(_mm512_sub_ps(m_old, use));
        _mm512_storeu_ps(alpha + c, a);
        _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), a,
                                                _mm512_add_ps(sum0, sum1)));
        _mm512_storeu_ps(m + c, mx);
    }
}

A_TARGET static void scale_cols_avx512(int64_t rows, int64_t cols, float *x, int64_t ld,
                                       const float *f)
{
    for (int64_t c = 0; c < cols; c += 16) {
        const __m512 v = _mm512_loadu_ps(f + c);
        for (int64_t r = 0; r < rows; r++)
            _mm512_storeu_ps(x + r * ld + c, _mm512_mul_ps(_mm512_loadu_ps(x + r * ld + c), v));
    }
}

A_TARGET static void probs_grad_avx512(int64_t rows, int64_t cols, float *s, int64_t lds,
                                       float *dp, int64_t ldp, const float *lse,
                                       const float *di, int per_col, float cap)
{
    const __m512 one = _mm512_set1_ps(1.0f), ncap = _mm512_set1_ps(-cap);
    const __m512 inv = _mm512_set1_ps(cap > 0.0f ? 1.0f / cap : 0.0f);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 lr = _mm512_set1_ps(per_col ? 0.0f : lse[r]);
        const __m512 dr = _mm512_set1_ps(per_col ? 0.0f : di[r]);
        for (int64_t c = 0; c < cols; c += 16) {
            const __m512 lv = per_col ? _mm512_loadu_ps(lse + c) : lr;
            const __m512 dv = per_col ? _mm512_loadu_ps(di + c) : dr;
            const __m512 x = _mm512_loadu_ps(s + r * lds + c);
            const __m512 p = exp16(_mm512_sub_ps(x, lv));
            __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dp + r * ldp + c), dv));
            if (cap > 0.0f) {
                const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, ncap), inv);
                ds = _mm512_mul_ps(ds, _mm512_fnmadd_ps(y, y, one));
            }
            _mm512_storeu_ps(s + r * lds + c, p);
            _mm512_storeu_ps(dp + r * ldp + c, ds);
        }
    }
}
#endif

/* ---- dispatch ------------------------------------------------------------------------------ */

void kt__attn_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam, int64_t sak,
                   const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate)
{
    if (M <= 0 || N <= 0)
        return;
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512()) {
        gemm_avx512(M, N, K, A, sam, sak, B, ldb, C, ldc, accumulate, NULL);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_gemm_avx2(M, N, K, A, sam, sak, B, ldb, C, ldc, accumulate, NULL);
        return;
    }
#endif
    gemm_plain(M, N, K, A, sam, sak, B, ldb, C, ldc, accumulate);
}

void kt__attn_gemm_rescale(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                           int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                           const float *f)
{
    if (M <= 0 || N <= 0)
        return;
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512()) {
        gemm_avx512(M, N, K, A, sam, sak, B, ldb, C, ldc, 1, f);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_gemm_avx2(M, N, K, A, sam, sak, B, ldb, C, ldc, 1, f);
        return;
    }
#endif
    kt__attn_scale_cols(M, N, C, ldc, f);
    gemm_plain(M, N, K, A, sam, sak, B, ldb, C, ldc, 1);
}

void kt__attn_transpose(int64_t rows, int64_t cols, const float *src, int64_t lds, float f,
                        float *dst, int64_t ldd)
{
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512() && lds * 15 <= INT32_MAX) {
        transpose_avx512(rows, cols, src, lds, f, dst, ldd);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_transpose_avx2(rows, cols, src, lds, f, dst, ldd);
        return;
    }
#endif
    transpose_plain(rows, cols, src, lds, f, dst, ldd);
}

void kt__attn_softcap(int64_t rows, int64_t cols, float *x, int64_t ld, float cap)
{
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512()) {
        softcap_avx512(rows, cols, x, ld, cap);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_softcap_avx2(rows, cols, x, ld, cap);
        return;
    }
#endif
    softcap_plain(rows, cols, x, ld, cap);
}

void kt__attn_online_cols(int64_t rows, int64_t cols, float *s, int64_t ld, float *m, float *l,
                          float *alpha)
{
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512()) {
        online_avx512(rows, cols, s, ld, m, l, alpha);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_online_avx2(rows, cols, s, ld, m, l, alpha);
        return;
    }
#endif
    online_plain(rows, cols, s, ld, m, l, alpha);
}

void kt__attn_scale_cols(int64_t rows, int64_t cols, float *x, int64_t ld, const float *f)
{
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512()) {
        scale_cols_avx512(rows, cols, x, ld, f);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_scale_cols_avx2(rows, cols, x, ld, f);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            x[r * ld + c] *= f[c];
}

void kt__attn_probs_grad(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                         int64_t ldp, const float *lse, const float *di, int per_col, float cap)
{
#ifdef ATTN_AVX512
    if (kt__cpu_has_avx512()) {
        probs_grad_avx512(rows, cols, s, lds, dp, ldp, lse, di, per_col, cap);
        return;
    }
#endif
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2()) {
        kt__attn_probs_grad_avx2(rows, cols, s, lds, dp, ldp, lse, di, per_col, cap);
        return;
    }
#endif
    probs_grad_plain(rows, cols, s, lds, dp, ldp, lse, di, per_col, cap);
}
