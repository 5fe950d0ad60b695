/* The LoRA adapters' vector kernels (lib/kernels/vec.h): dot against a float64 sum, and the
 * multi-rank and multi-row forms (rank_update, rows_axpys, rows_dots) bitwise
 * against the single ones they replace, at lengths around the 16-lane width and the rank and
 * row blocks. Also run with KT_CPU=portable. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kt/tensor.h"
#include "lib/kernels/vec.h"
#include "tests/support/test_util.h"

static const int64_t lengths[] = {0, 1, 2, 15, 16, 17, 31, 33, 100, 1632};
static const int64_t ranks[] = {1, 3, 7, 8, 9, 16, 17, 64, 256};

static float *random_floats(tu_rng *rng, int64_t n)
{
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    assert_non_null(p);
    for (int64_t i = 0; i < n; i++)
        p[i] = (float)tu_rng_uniform(rng, -1.0, 1.0);
    return p;
}

static void test_dot_reference(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++) {
        const int64_t n = lengths[l];
        float *a = random_floats(&rng, n), *b = random_floats(&rng, n);
        double want = 0.0, mag = 0.0;
        for (int64_t i = 0; i < n; i++) {
            want += (double)a[i] * b[i];
            mag += fabs((double)a[i] * b[i]);
        }
        const float got = kt__vec_dot(n, a, b);
        assert_true(fabs(got - want) <= 1e-6 * mag + 1e-30);
        free(a);
        free(b);
    }
}

/* n compute-dtype values widened to f32 */
static void widen(float *dst, const void *src, int bf16, int64_t n)
{
    if (bf16)
        kt_bf16_to_f32(dst, src, (size_t)n);
    else
        memcpy(dst, src, (size_t)n * sizeof *dst);
}

/* rank_update against zeroing, then per row: widen, R axpys; bf16 and f32 rows */
static void test_rank_update_bitwise(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 8);
    static const int64_t row_counts[] = {0, 1, 5, 96};
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
            for (size_t k = 0; k < 5; k++) /* ranks up to 9 */
                for (size_t h = 0; h < sizeof row_counts / sizeof row_counts[0]; h++) {
                    const int64_t n = lengths[l], R = ranks[k], rows = row_counts[h];
                    const int64_t ldx = n + 7, lda = n + 2;
                    float *xf = random_floats(&rng, rows * ldx + 1);
                    uint16_t *xb = malloc((size_t)(rows * ldx + 1) * sizeof *xb);
                    float *coef = random_floats(&rng, rows * R + 1);
                    float *got = malloc((size_t)(R * lda) * sizeof *got);
                    float *want = calloc((size_t)(R * lda), sizeof *want);
                    float *row = malloc((size_t)(n + 1) * sizeof *row);
                    assert_true(xb && got && want && row);
                    for (int64_t i = 0; i < rows * ldx; i++)
                        xb[i] = kt_f32_to_bf16_1(xf[i]);
                    const void *x = bf16 ? (const void *)xb : (const void *)xf;
                    for (int64_t i = 0; i < R * lda; i++)
                        got[i] = 7.0f; /* every written element overwritten */
                    for (int64_t q = 0; q < R; q++)
                        for (int64_t i = n; i < lda; i++)
                            want[q * lda + i] = 7.0f; /* the gaps left alone */
                    for (int64_t r = 0; r < rows; r++) {
                        widen(row,
                              bf16 ? (const void *)(xb + r * ldx) : (const void *)(xf + r * ldx),
                              bf16, n);
                        for (int64_t q = 0; q < R; q++)
                            kt__vec_axpy(n, coef[r * R + q], row, want + q * lda);
                    }
                    kt__vec_rank_update(n, rows, x, ldx, bf16, coef, R, got, lda);
                    if (memcmp(got, want, (size_t)(R * lda) * sizeof *got) != 0)
                        fail_msg("rank_update bf16=%d n=%lld R=%lld rows=%lld differs", bf16,
                                 (long long)n, (long long)R, (long long)rows);
                    free(xf), free(xb), free(coef), free(got), free(want), free(row);
                }
}

/* rows_axpys against, per row, R axpys into a zeroed buffer then one axpy of it (times the
 * scale) into the row; scale 1 (the input gradients) and not */
static void test_rows_axpys_bitwise(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 9);
    static const int64_t row_counts[] = {0, 1, 3, 20};
    for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
        for (size_t k = 0; k < 7; k++) /* ranks up to 17 */
            for (size_t h = 0; h < sizeof row_counts / sizeof row_counts[0]; h++) {
                const int64_t n = lengths[l], R = ranks[k], rows = row_counts[h];
                const int64_t ldx = n + 5, ldy = n + 3;
                float *x = random_floats(&rng, R * ldx), *coef = random_floats(&rng, rows * R + 1);
                float *y = random_floats(&rng, rows * ldy + 1);
                float *want = malloc((size_t)(rows * ldy + 1) * sizeof *want);
                float *acc = malloc((size_t)(n + 1) * sizeof *acc);
                assert_true(want && acc);
                memcpy(want, y, (size_t)(rows * ldy + 1) * sizeof *y);
                const float scale = h % 2 ? 1.0f : 0.375f;
                for (int64_t r = 0; r < rows; r++) {
                    memset(acc, 0, (size_t)(n + 1) * sizeof *acc);
                    for (int64_t q = 0; q < R; q++)
                        kt__vec_axpy(n, coef[r * R + q], x + q * ldx, acc);
                    kt__vec_axpy(n, scale, acc, want + r * ldy);
                }
                kt__vec_rows_axpys(n, rows, coef, R, x, ldx, scale, y, ldy);
                if (memcmp(y, want, (size_t)(rows * ldy + 1) * sizeof *y) != 0)
                    fail_msg("rows_axpys n=%lld R=%lld rows=%lld differs", (long long)n,
                             (long long)R, (long long)rows);
                free(x), free(coef), free(y), free(want), free(acc);
            }
}

/* rows_dots against kt__vec_dot of each widened row with each rank's row, for a given as rows
 * (A [R, n]) and as columns (B [n, R]); bf16 and f32 rows; row counts around its blocks of 64
 * rows and pairs, lengths around its 512-column chunks. */
static void test_rows_dots_bitwise(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 10);
    static const int64_t row_counts[] = {0, 1, 3, 65, 130};
    static const int64_t rd_ranks[] = {1, 7, 8, 9, 17};
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (int cols = 0; cols < 2; cols++)
            for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
                for (size_t k = 0; k < sizeof rd_ranks / sizeof rd_ranks[0]; k++)
                    for (size_t h = 0; h < sizeof row_counts / sizeof row_counts[0]; h++) {
                        const int64_t n = lengths[l], R = rd_ranks[k], rows = row_counts[h];
                        const int64_t ldx = n + 6;
                        float *xf = random_floats(&rng, rows * ldx + 1);
                        uint16_t *xb = malloc((size_t)(rows * ldx + 1) * sizeof *xb);
                        float *a = random_floats(&rng, R * n + 1);
                        float *got = malloc((size_t)(rows * R + 1) * sizeof *got);
                        float *row = malloc((size_t)(n + 1) * sizeof *row);
                        float *aq = malloc((size_t)(n + 1) * sizeof *aq);
                        assert_true(xb && got && row && aq);
                        for (int64_t i = 0; i < rows * ldx; i++)
                            xb[i] = kt_f32_to_bf16_1(xf[i]);
                        const void *x = bf16 ? (const void *)xb : (const void *)xf;
                        const int64_t a_row = cols ? 1 : n, a_col = cols ? R : 1;
                        got[rows * R] = 12345.0f; /* nothing past the rows is written */
                        kt__vec_rows_dots(n, rows, x, ldx, bf16, a, a_row, a_col, R, got);
                        assert_true(got[rows * R] == 12345.0f);
                        for (int64_t r = 0; r < rows; r++) {
                            widen(row,
                                  bf16 ? (const void *)(xb + r * ldx)
                                       : (const void *)(xf + r * ldx),
                                  bf16, n);
                            for (int64_t q = 0; q < R; q++) {
                                for (int64_t i = 0; i < n; i++)
                                    aq[i] = a[q * a_row + i * a_col];
                                const float want = kt__vec_dot(n, row, aq);
                                if (memcmp(&got[r * R + q], &want, sizeof want) != 0)
                                    fail_msg("rows_dots bf16=%d cols=%d n=%lld R=%lld rows=%lld: "
                                             "(%lld, %lld) = %.9g, dot %.9g",
                                             bf16, cols, (long long)n, (long long)R,
                                             (long long)rows, (long long)r, (long long)q,
                                             (double)got[r * R + q], (double)want);
                            }
                        }
                        free(xf), free(xb), free(a), free(got), free(row), free(aq);
                    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dot_reference),
        cmocka_unit_test(test_rank_update_bitwise),
        cmocka_unit_test(test_rows_axpys_bitwise),
        cmocka_unit_test(test_rows_dots_bitwise),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
