/* NT for a few rows of x as dot products along w's rows (avx2_gemm.h): a product of a few
 * rows only streams the weights, and w read in place saves the panel's transpose. */
#include "lib/kernels/avx2_gemm.h"

#ifdef KT__AVX2_GEMM
#include "lib/kernels/avx2_util.h"

#define ROWS_W 4 /* rows of w side by side */

/* the 8 lanes added in a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the two */
V_INLINE float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[0:MRX, 0:nw) for nw <= ROWS_W rows of w */
V_INLINE void dots_step(const int MRX, kt__fma_src src, int64_t nw, int64_t K, const void *x,
                        int64_t ldx, const void *w, int64_t ldw, float *y, int64_t ldy,
                        int accumulate)
{
    __m256 acc[KT__AVX2_DOTS_MAX_M][ROWS_W];
    for (int i = 0; i < MRX; i++)
        for (int j = 0; j < ROWS_W; j++)
            acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[ROWS_W];
        for (int j = 0; j < ROWS_W; j++)
            wv[j] = j < nw ? v_load8(v_elem(w, j * ldw + k, src), 8, src) : _mm256_setzero_ps();
        for (int i = 0; i < MRX; i++) {
            const __m256 xv = v_load8(v_elem(x, i * ldx + k, src), 8, src);
            for (int j = 0; j < ROWS_W; j++)
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {
        __m256 wv[ROWS_W];
        for (int j = 0; j < ROWS_W; j++)
            wv[j] = j < nw ? v_load8(v_elem(w, j * ldw + k, src), K - k, src) : _mm256_setzero_ps();
        for (int i = 0; i < MRX; i++) {
            const __m256 xv = v_load8(v_elem(x, i * ldx + k, src), K - k, src);
            for (int j = 0; j < ROWS_W; j++)
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MRX; i++)
        for (int j = 0; j < nw; j++) {
            const float v = hsum8(acc[i][j]);
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + v : v;
        }
}

#define DOTS_CASE(R)                                                                               \
    case R:                                                                                        \
        for (int64_t n = n0; n < n1; n += ROWS_W)                                                  \
            dots_step(R, src, n1 - n < ROWS_W ? n1 - n : ROWS_W, K, xr, ldx,                       \
                      v_elem(w, n * ldw, src), ldw, yr + n, ldy, accumulate);                      \
        break;
_Static_assert(KT__AVX2_DOTS_MAX_M == 4, "kt__avx2_nt_dots has one case per row count");

V_TARGET void kt__avx2_nt_dots(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                               const void *x, int64_t ldx, const void *w, int64_t ldw, float *y,
                               int64_t ldy, int accumulate)
{
    if (M <= 0 || n1 <= n0)
        return;
    const unsigned csr = v_flush_denormals(src == KT__FMA_BF16);
    /* rows in groups of up to 4, each group over all of w */
    for (int64_t m0 = 0; m0 < M; m0 += KT__AVX2_DOTS_MAX_M) {
        const int64_t mr = M - m0 < KT__AVX2_DOTS_MAX_M ? M - m0 : KT__AVX2_DOTS_MAX_M;
        const void *xr = v_elem(x, m0 * ldx, src);
        float *yr = y + m0 * ldy;
        switch (mr) {
            DOTS_CASE(1)
            DOTS_CASE(2)
            DOTS_CASE(3)
            DOTS_CASE(4)
        default:
            break;
        }
    }
    _mm_setcsr(csr);
}
#undef DOTS_CASE
#endif
