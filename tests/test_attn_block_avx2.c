/* The attention block kernels on AVX2 (lib/kernels/attn_block_avx2.h), called directly on any
 * CPU with AVX2 and FMA (test_ops_attention reaches them through the op only where the CPU has
 * no AVX-512): the block product and its rescale against float64 within f32 rounding, on tails
 * of both widths (N not a multiple of 8, M not of 6), transposed A, accumulate; the transpose
 * bit for bit, padding zero; exp-based kernels (online softmax, probs grad, softcap) within a
 * few ulp of expf / tanhf, masked scores (-inf) giving exactly 0 and NaN staying NaN. Skips
 * where the CPU or the build lacks the kernels. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/attn_block_avx2.h"
#include "tests/support/test_util.h"

static int runnable(void)
{
#ifdef KT__ATTN_AVX2
    if (kt__cpu_has_avx2())
        return 1;
    print_message("AVX2 attention kernels skipped: this CPU lacks AVX2 or FMA (or KT_CPU hides "
                  "them)\n");
#else
    print_message("AVX2 attention kernels skipped: not in this build\n");
#endif
    return 0;
}

#ifdef KT__ATTN_AVX2
static float *rand_buf(int64_t n, tu_rng *rng, double lo, double hi)
{
    float *p = malloc((size_t)(n + 1) * sizeof *p);
    assert_non_null(p);
    for (int64_t i = 0; i < n; i++)
        p[i] = (float)tu_rng_uniform(rng, lo, hi);
    return p;
}

/* |got - want| within a few units of rounding of |want| (and an absolute floor) */
static void near(float got, double want, double ulps, const char *what, int64_t i)
{
    const double tol = ulps * ldexp(fabs(want), -23) + 1e-30;
    if (!(fabs(got - want) <= tol))
        fail_msg("%s[%lld] = %.9g, want %.9g", what, (long long)i, got, want);
}
#endif

static void test_gemm(void **state)
{
    (void)state;
    if (!runnable())
        skip();
#ifdef KT__ATTN_AVX2
    tu_rng rng;
    tu_rng_seed(&rng, 31);
    static const int64_t mnk[][3] = {{1, 1, 1},   {6, 16, 8},  {7, 17, 9},   {13, 40, 64},
                                     {5, 3, 100}, {12, 8, 33}, {64, 64, 64}, {2, 23, 5}};
    for (size_t i = 0; i < sizeof mnk / sizeof mnk[0]; i++)
        for (int ta = 0; ta <= 1; ta++)
            for (int mode = 0; mode < 3; mode++) { /* overwrite, accumulate, rescale */
                const int64_t M = mnk[i][0], N = mnk[i][1], K = mnk[i][2];
                const int64_t ldb = N + 3, ldc = N + 5;
                const int64_t sam = ta ? 1 : K + 2, sak = ta ? M + 2 : 1;
                float *A = rand_buf((ta ? K * (M + 2) : M * (K + 2)), &rng, -1, 1);
                float *B = rand_buf(K * ldb, &rng, -1, 1);
                float *C = rand_buf(M * ldc, &rng, -2, 2);
                float *f = rand_buf(N, &rng, 0, 1);
                float *C0 = malloc((size_t)(M * ldc + 1) * sizeof *C0);
                assert_non_null(C0);
                memcpy(C0, C, (size_t)(M * ldc) * sizeof *C);
                kt__attn_gemm_avx2(M, N, K, A, sam, sak, B, ldb, C, ldc, mode == 1,
                                   mode == 2 ? f : NULL);
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = 0; n < ldc; n++) {
                        const int64_t e = m * ldc + n;
                        if (n >= N) { /* outside the block: untouched */
                            assert_memory_equal(&C[e], &C0[e], sizeof C[e]);
                            continue;
                        }
                        double s = 0.0, sabs = 0.0;
                        for (int64_t k = 0; k < K; k++) {
                            const double t = (double)A[m * sam + k * sak] * B[k * ldb + n];
                            s += t, sabs += fabs(t);
                        }
                        const double c0 = mode == 1 ? C0[e] : mode == 2 ? (double)f[n] * C0[e] : 0;
                        const double want = c0 + s;
                        const double tol = ((double)K + 2) * ldexp(sabs, -24) +
                                           ldexp(fabs(c0) + fabs(want), -23) + 1e-30;
                        if (!(fabs(C[e] - want) <= tol))
                            fail_msg("gemm M %lld N %lld K %lld ta %d mode %d: C[%lld, %lld] = "
                                     "%.9g, float64 %.9g",
                                     (long long)M, (long long)N, (long long)K, ta, mode,
                                     (long long)m, (long long)n, C[e], want);
                    }
                free(A), free(B), free(C), free(f), free(C0);
            }
#endif
}

static void test_transpose(void **state)
{
    (void)state;
    if (!runnable())
        skip();
#ifdef KT__ATTN_AVX2
    tu_rng rng;
    tu_rng_seed(&rng, 32);
    static const int64_t shapes[][3] = {
        {1, 1, 16}, {7, 9, 16}, {16, 16, 16}, {33, 70, 48}, {5, 64, 8}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int64_t rows = shapes[i][0], cols = shapes[i][1], ldd = shapes[i][2];
        const int64_t lds = cols + 3;
        float *src = rand_buf(rows * lds, &rng, -1, 1);
        float *dst = rand_buf(cols * ldd, &rng, 5, 6);
        kt__attn_transpose_avx2(rows, cols, src, lds, 0.5f, dst, ldd);
        for (int64_t c = 0; c < cols; c++)
            for (int64_t r = 0; r < ldd; r++) {
                const float want = r < rows ? 0.5f * src[r * lds + c] : 0.0f;
                assert_memory_equal(&dst[c * ldd + r], &want, sizeof want);
            }
        free(src), free(dst);
    }
#endif
}

static void test_softmax_pieces(void **state)
{
    (void)state;
    if (!runnable())
        skip();
#ifdef KT__ATTN_AVX2
    tu_rng rng;
    tu_rng_seed(&rng, 33);
    const int64_t rows = 11, cols = 16, ld = 24;
    /* online softmax: scores in [-30, 10], one column wholly masked, one with a masked pair */
    float *s = rand_buf(rows * ld, &rng, -30, 10), *s0 = malloc(sizeof(float) * rows * ld);
    float m[16], l[16], alpha[16], m0[16], l0[16];
    assert_non_null(s0);
    for (int64_t r = 0; r < rows; r++) {
        s[r * ld + 3] = -INFINITY;
        if (r == 4)
            s[r * ld + 7] = -INFINITY;
    }
    for (int c = 0; c < 16; c++) {
        m[c] = m0[c] = c == 3 ? -INFINITY : (float)tu_rng_uniform(&rng, -5, 5);
        l[c] = l0[c] = c == 3 ? 0.0f : (float)tu_rng_uniform(&rng, 0, 3);
    }
    memcpy(s0, s, sizeof(float) * rows * ld);
    kt__attn_online_avx2(rows, cols, s, ld, m, l, alpha);
    for (int64_t c = 0; c < cols; c++) {
        double mx = m0[c];
        for (int64_t r = 0; r < rows; r++)
            mx = s0[r * ld + c] > mx ? s0[r * ld + c] : mx;
        const double use = mx == -INFINITY ? 0.0 : mx;
        double sum = 0.0;
        for (int64_t r = 0; r < rows; r++) {
            /* the kernels subtract in f32 (as the plain loops): that rounding is theirs */
            const double p = exp((double)(s0[r * ld + c] - (float)use));
            if (s0[r * ld + c] == -INFINITY)
                assert_true(s[r * ld + c] == 0.0f);
            near(s[r * ld + c], p, 8, "online p", r * ld + c);
            sum += p;
        }
        const double a = exp((double)(m0[c] - (float)use));
        near(alpha[c], a, 8, "alpha", c);
        near(l[c], l0[c] * a + sum, 16 + 2 * rows, "l", c);
        assert_true(m[c] == (float)mx);
    }
    /* probs grad, per column and per row, with and without a cap */
    for (int per_col = 0; per_col <= 1; per_col++)
        for (int capped = 0; capped <= 1; capped++) {
            const float cap = capped ? 30.0f : 0.0f;
            float *x = rand_buf(rows * ld, &rng, -20, 0), *dp = rand_buf(rows * ld, &rng, -1, 1);
            float *x0 = malloc(sizeof(float) * rows * ld), *dp0 = malloc(sizeof(float) * rows * ld);
            float lse[16], di[16];
            assert_true(x0 && dp0);
            x[2 * ld + 5] = -INFINITY;
            for (int i = 0; i < 16; i++)
                lse[i] = (float)tu_rng_uniform(&rng, -1, 1),
                di[i] = (float)tu_rng_uniform(&rng, -1, 1);
            memcpy(x0, x, sizeof(float) * rows * ld);
            memcpy(dp0, dp, sizeof(float) * rows * ld);
            kt__attn_probs_grad_avx2(rows, cols, x, ld, dp, ld, lse, di, per_col, cap);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) {
                    const int64_t e = r * ld + c, i = per_col ? c : r;
                    const double p = exp((double)(x0[e] - lse[i]));
                    double ds = p * ((double)dp0[e] - di[i]);
                    if (capped) {
                        const double y = (x0[e] > -cap ? x0[e] : -cap) / cap;
                        ds *= 1.0 - y * y;
                    }
                    near(x[e], p, 8, "probs p", e);
                    if (!(fabs(dp[e] - ds) <=
                          16 * ldexp(fabs(p) * (fabs(dp0[e]) + fabs(di[i])), -23) + 1e-30))
                        fail_msg("probs ds[%lld] = %.9g, want %.9g", (long long)e, dp[e], ds);
                }
            free(x), free(dp), free(x0), free(dp0);
        }
    /* softcap: cap tanh(x / cap), NaN stays NaN */
    float *x = rand_buf(rows * ld, &rng, -80, 80), *x0 = malloc(sizeof(float) * rows * ld);
    assert_non_null(x0);
    x[ld + 2] = NAN;
    memcpy(x0, x, sizeof(float) * rows * ld);
    kt__attn_softcap_avx2(rows, cols, x, ld, 20.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t e = r * ld + c;
            if (isnan(x0[e])) {
                assert_true(isnan(x[e]));
                continue;
            }
            const double want = 20.0 * tanh((double)x0[e] / 20.0);
            if (!(fabs(x[e] - want) <= 16 * ldexp(20.0, -23)))
                fail_msg("softcap[%lld] = %.9g, want %.9g", (long long)e, x[e], want);
        }
    free(x), free(x0), free(s), free(s0);
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm),
        cmocka_unit_test(test_transpose),
        cmocka_unit_test(test_softmax_pieces),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
