/* The quantized formats and products (lib/kernels/quant*.h): the quantizer's rounding, its
 * refusals and its layouts; the AVX-512 dequantisation against the scalar one (bitwise); and
 * the products NT and NN (one weight and two), INT8 and INT4 of each group size, at row counts
 * that reach every path (the few-row in-place NT, the panels over each bf16 kernel the
 * registry picks by M), with odd column ranges and strides, against a float64 product of the
 * dequantised values (kt__q_value): the numbers every path is meant to sum. Run again under
 * KT_CPU=portable (ctest), where the scalar dequantisation and the portable bf16 kernels run. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/quant_avx2.h"
#include "lib/kernels/quant_avx512.h"
#include "lib/kernels/quant_gemm.h"
#include "lib/kernels/registry.h"
#include "tests/support/test_util.h"

typedef struct qcase {
    kt__qfmt fmt;
    int64_t group;
} qcase;
static const qcase cases[] = {{KT__Q_INT8, 0}, {KT__Q_INT4, 32}, {KT__Q_INT4, 64}, {KT__Q_INT4, 128}};

static const char *case_name(qcase c)
{
    return c.fmt == KT__Q_INT8 ? "int8" : c.group == 32 ? "int4 g32" : c.group == 64 ? "int4 g64" : "int4 g128";
}

/* A quantized [rows, cols] matrix of uniform weights (some rows scaled down, one all zero). */
static kt__qmat make(qcase c, int64_t rows, int64_t cols, uint64_t seed, void **mem)
{
    kt__qmat w;
    const size_t bytes = kt__q_value_bytes(c.fmt, rows, cols) +
                         kt__q_scale_bytes(c.fmt, rows, cols, c.fmt == KT__Q_INT8 ? cols : c.group);
    *mem = calloc(1, bytes + 64);
    kt__q_bind(&w, c.fmt, rows, cols, c.fmt == KT__Q_INT8 ? cols : c.group, *mem);
    float *src = malloc((size_t)(rows * cols) * sizeof *src);
    tu_rng r;
    tu_rng_seed(&r, seed);
    for (int64_t i = 0; i < rows * cols; i++) {
        const int64_t row = i / cols;
        src[i] = (float)(tu_rng_uniform(&r, -1.0, 1.0) * (row % 3 == 1 ? 0.01 : 0.2));
        if (row == rows / 2)
            src[i] = 0.0f;
    }
    OK(kt__q_quantize(&w, src, KT_F32));
    free(src);
    return w;
}

static uint16_t *bf16_matrix(int64_t rows, int64_t ld, uint64_t seed)
{
    uint16_t *x = malloc((size_t)(rows * ld) * sizeof *x + 64);
    tu_rng r;
    tu_rng_seed(&r, seed);
    for (int64_t i = 0; i < rows * ld; i++)
        x[i] = kt_f32_to_bf16_1((float)tu_rng_uniform(&r, -1.0, 1.0));
    return x;
}

/* |got - sum| within tol of the sum of |terms| (f32 accumulation of bf16 products) */
static void expect_close(double got, double sum, double abs_sum, const char *what, int64_t m,
                         int64_t n)
{
    if (!(fabs(got - sum) <= 2e-5 * abs_sum + 1e-30))
        fail_msg("%s: [%lld, %lld] is %.9g, float64 %.9g (sum of |terms| %.3g)", what,
                 (long long)m, (long long)n, got, sum, abs_sum);
}

static void check_nt(const kt__kpath *p, qcase c, int64_t M, int64_t N, int64_t K, int64_t n0,
                     int64_t n1)
{
    void *mem;
    kt__qmat w = make(c, N, K, 7 + (uint64_t)M, &mem);
    const int64_t ldx = K + 3, ldy = N + 5;
    uint16_t *x = bf16_matrix(M, ldx, 11);
    float *y = calloc((size_t)(M * ldy), sizeof *y);
    void *work = aligned_alloc(64, (kt__q_gemm_work_bytes(N, K, M) + 63) / 64 * 64);
    p->nt_q(M, n0, n1, x, ldx, &w, y, ldy, work);
    char what[96];
    snprintf(what, sizeof what, "%s NT M %lld (path %s)", case_name(c), (long long)M, p->name);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < K; k++) {
                const double t = (double)kt_bf16_to_f32_1(x[m * ldx + k]) * kt__q_value(&w, n, k);
                s += t, a += fabs(t);
            }
            expect_close(y[m * ldy + n], s, a, what, m, n);
        }
    free(work), free(y), free(x), free(mem);
}

static void check_nn(const kt__kpath *p, qcase c, int64_t M, int64_t N, int64_t K, int64_t c0,
                     int64_t c1, int two)
{
    void *m0, *m1;
    kt__qmat w0 = make(c, N, K, 5, &m0), w1 = make(c, N, K, 6, &m1);
    const int64_t ldg = N + 2, ldy = (c1 - c0) + 7;
    uint16_t *g0 = bf16_matrix(M, ldg, 21), *g1 = bf16_matrix(M, ldg, 22);
    float *y = calloc((size_t)(M * ldy), sizeof *y);
    void *work = aligned_alloc(64, (kt__q_gemm_work_bytes(N, K, M) + 63) / 64 * 64);
    p->nn_q(M, c0, c1, g0, &w0, two ? g1 : NULL, two ? &w1 : NULL, ldg, y, ldy, work);
    char what[96];
    snprintf(what, sizeof what, "%s NN%s M %lld (path %s)", case_name(c), two ? "2" : "",
             (long long)M, p->name);
    for (int64_t m = 0; m < M; m++)
        for (int64_t col = c0; col < c1; col++) {
            double s = 0, a = 0;
            for (int64_t n = 0; n < N; n++) {
                double t = (double)kt_bf16_to_f32_1(g0[m * ldg + n]) * kt__q_value(&w0, n, col);
                s += t, a += fabs(t);
                if (two) {
                    t = (double)kt_bf16_to_f32_1(g1[m * ldg + n]) * kt__q_value(&w1, n, col);
                    s += t, a += fabs(t);
                }
            }
            expect_close(y[m * ldy + (col - c0)], s, a, what, m, col);
        }
    free(work), free(y), free(g0), free(g1), free(m0), free(m1);
}

/* Whether this CPU runs path p's kernel of prod at M rows (p's features, its rows). */
static int runs(const kt__kpath *p, kt__kprod prod, int64_t M)
{
    const unsigned have = kt__kernel_features();
    const int has = prod == KT__KP_NT_Q ? p->nt_q != NULL : p->nn_q != NULL;
    return has && (have & p->needs) == p->needs && (have & p->unless) == 0 &&
           M >= p->rows[prod].min_m && M <= p->rows[prod].max_m;
}

/* Every registry path of the quantized products this CPU has, at every row count it serves. */
static void test_products(void **state)
{
    (void)state;
    const int64_t rows[] = {1, 2, 3, 4, 5, 8, 16, 17, 33, 100};
    int ran[64] = {0};
    for (int i = 0; i < kt__kpath_count; i++) {
        const kt__kpath *p = &kt__kpaths[i];
        for (size_t f = 0; f < sizeof cases / sizeof cases[0]; f++)
            for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
                const int64_t M = rows[r];
                if (runs(p, KT__KP_NT_Q, M)) {
                    check_nt(p, cases[f], M, 40, 256, 3, 37);
                    check_nt(p, cases[f], M, 24, 384, 0, 24);
                    ran[i] = 1;
                }
                if (runs(p, KT__KP_NN_Q, M)) {
                    check_nn(p, cases[f], M, 48, 256, 16, 208, 0);
                    check_nn(p, cases[f], M, 40, 384, 0, 384, 1);
                    check_nn(p, cases[f], M, 33, 256, 48, 80, 1); /* within one block */
                    ran[i] = 1;
                }
            }
    }
    printf("paths checked:");
    for (int i = 0; i < kt__kpath_count; i++)
        if (ran[i])
            printf(" %s", kt__kpaths[i].name);
    printf("; chosen: NT %s (1 row), %s (16 rows); NN %s (1 row), %s (100 rows)\n",
           kt__q_gemm_path(0, 1), kt__q_gemm_path(0, 16), kt__q_gemm_path(1, 1),
           kt__q_gemm_path(1, 100));
    assert_true(ran[kt__kpath_count - 1]); /* the scalar references */
}

/* The vector dequantisations (AVX-512 BF16, AVX2) give the scalar one's bits, at aligned
 * and odd ranges. */
static void test_dequant_bitwise(void **state)
{
    (void)state;
    const int avx512 = kt__cpu_has_avx512_bf16(), avx2 = kt__cpu_has_avx2();
    if (!avx512)
        print_message("no AVX-512 BF16 on this CPU (or KT_CPU): its dequantisation not run\n");
    if (!avx2) {
        print_message("skipped: this CPU (or KT_CPU) has no AVX2 either\n");
        skip();
    }
    const int64_t ranges[][2] = {{0, 256}, {16, 240}, {32, 96}, {5, 77}, {48, 64}, {64, 256}};
    for (size_t f = 0; f < sizeof cases / sizeof cases[0]; f++) {
        void *mem;
        kt__qmat w = make(cases[f], 9, 256, 3, &mem);
        uint16_t a[9 * 256], b[9 * 256];
        for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
            const int64_t c0 = ranges[i][0], c1 = ranges[i][1];
            for (int v = avx512 ? 0 : 1; v < 2; v++) {
                memset(a, 0, sizeof a), memset(b, 0, sizeof b);
                if (v == 0)
                    kt__q_dequant_avx512(&w, 1, 9, c0, c1, a, 256);
                else
                    kt__q_dequant_avx2(&w, 1, 9, c0, c1, a, 256);
                kt__q_dequant_bf16(&w, 1, 9, c0, c1, b, 256);
                if (memcmp(a, b, sizeof a) != 0)
                    fail_msg("%s: columns [%lld, %lld): the %s dequantisation differs",
                             case_name(cases[f]), (long long)c0, (long long)c1,
                             v ? "AVX2" : "AVX-512");
            }
        }
        free(mem);
    }
}

/* Round to nearest: each value within half a step of its weight (plus the bf16 rounding of
 * the value), the group's largest at its code's end; a zero row is zeros. */
static void test_quantizer(void **state)
{
    (void)state;
    for (size_t f = 0; f < sizeof cases / sizeof cases[0]; f++) {
        const qcase c = cases[f];
        const int64_t rows = 6, cols = 256, g = c.fmt == KT__Q_INT8 ? cols : c.group;
        void *mem;
        kt__qmat w;
        mem = calloc(1, kt__q_value_bytes(c.fmt, rows, cols) +
                            kt__q_scale_bytes(c.fmt, rows, cols, g) + 64);
        kt__q_bind(&w, c.fmt, rows, cols, g, mem);
        float src[6 * 256];
        tu_rng r;
        tu_rng_seed(&r, 17);
        for (int64_t i = 0; i < rows * cols; i++)
            src[i] = i / cols == 4 ? 0.0f : (float)tu_rng_uniform(&r, -3.0, 3.0);
        OK(kt__q_quantize(&w, src, KT_F32));
        const double qmax = c.fmt == KT__Q_INT8 ? 127 : 7;
        double worst = 0;
        for (int64_t i = 0; i < rows * cols; i++) {
            const int64_t row = i / cols, col = i % cols;
            const double s = kt_bf16_to_f32_1(w.scale[row * (cols / g) + col / g]);
            const double d = kt__q_value(&w, row, col);
            if (row == 4)
                assert_true(d == 0.0);
            /* half a step, the scale's own bf16 rounding at the range's end, and d's */
            const double bound = 0.5 * s + qmax * s / 256 + fabs(d) / 256;
            worst = fmax(worst, fabs(d - src[i]) / (s > 0 ? s : 1));
            if (fabs(d - src[i]) > bound)
                fail_msg("%s: [%lld, %lld]: %.6g quantized to %.6g (scale %.4g)", case_name(c),
                         (long long)row, (long long)col, (double)src[i], d, s);
        }
        printf("%s: largest |w - deq| %.3f of a step\n", case_name(c), worst);
        src[3 * cols + 9] = NAN;
        TU_EXPECT_ERROR(kt__q_quantize(&w, src, KT_F32), KT_EINVAL, "[3, 9]", "not finite");
        src[3 * cols + 9] = -INFINITY;
        TU_EXPECT_ERROR(kt__q_quantize(&w, src, KT_F32), KT_EINVAL, "[3, 9]");
        free(mem);
    }
    char why[160];
    assert_false(kt__q_layout_ok(KT__Q_INT4, 192, 128, why, sizeof why));
    assert_non_null(strstr(why, "does not divide the input size 192"));
    assert_false(kt__q_layout_ok(KT__Q_INT4, 96, 32, why, sizeof why));
    assert_non_null(strstr(why, "multiple of 64"));
    assert_false(kt__q_layout_ok(KT__Q_INT4, 256, 16, why, sizeof why));
    assert_non_null(strstr(why, "not 32, 64 or 128"));
    assert_true(kt__q_layout_ok(KT__Q_INT8, 45, 0, why, sizeof why));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantizer),
        cmocka_unit_test(test_dequant_bitwise),
        cmocka_unit_test(test_products),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
