/* The LoRA adapters' vector kernels (lib/moe/vec.h): dot against a float64 sum, and the
 * multi-rank forms (dots, axpys) bitwise against the single ones they replace, at lengths
 * around the 16-lane width and the rank blocks. Also run with KT_CPU=portable. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "moe/vec.h"
#include "test_util.h"

static const int64_t lengths[] = {0, 1, 2, 15, 16, 17, 31, 33, 100, 1632};
static const int64_t ranks[] = {1, 3, 7, 8, 9, 16, 17, 64, 256};
#define MAX_RANK 256

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
        assert_true(fabs(got - want) <= 1e-5 * mag + 1e-30);
        free(a);
        free(b);
    }
}

static void test_dots_bitwise(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 6);
    for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
        for (size_t k = 0; k < sizeof ranks / sizeof ranks[0]; k++) {
            const int64_t n = lengths[l], R = ranks[k], lda = n + 5;
            float *x = random_floats(&rng, n), *a = random_floats(&rng, R * lda);
            float out[MAX_RANK + 1];
            out[R] = 12345.0f; /* nothing past R is written */
            kt__vec_dots(n, x, a, lda, R, out);
            assert_true(out[R] == 12345.0f);
            for (int64_t q = 0; q < R; q++) {
                const float one = kt__vec_dot(n, x, a + q * lda);
                if (memcmp(&one, &out[q], sizeof one) != 0)
                    fail_msg("dots n=%lld R=%lld q=%lld: %.9g, dot %.9g", (long long)n,
                             (long long)R, (long long)q, out[q], one);
            }
            free(x);
            free(a);
        }
}

static void test_axpys_bitwise(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
        for (size_t k = 0; k < sizeof ranks / sizeof ranks[0]; k++) {
            const int64_t n = lengths[l], R = ranks[k], ldx = n + 3;
            float *x = random_floats(&rng, R * ldx), *alpha = random_floats(&rng, R);
            float *y = random_floats(&rng, n + 1), *want = malloc((size_t)(n + 1) * sizeof *want);
            assert_non_null(want);
            memcpy(want, y, (size_t)(n + 1) * sizeof *y);
            for (int64_t q = 0; q < R; q++)
                kt__vec_axpy(n, alpha[q], x + q * ldx, want);
            kt__vec_axpys(n, alpha, x, ldx, R, y);
            if (memcmp(y, want, (size_t)(n + 1) * sizeof *y) != 0)
                fail_msg("axpys n=%lld R=%lld differs from %lld axpys", (long long)n,
                         (long long)R, (long long)R);
            free(x);
            free(alpha);
            free(y);
            free(want);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dot_reference),
        cmocka_unit_test(test_dots_bitwise),
        cmocka_unit_test(test_axpys_bitwise),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
