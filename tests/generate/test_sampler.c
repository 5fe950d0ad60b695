/* kt-generate's sampler (tools/kt-generate/sample.c) on fixed logits: greedy is the argmax (the
 * first of equal ones); the draws follow softmax(logits / T) renormalised over what top-k and
 * then top-p keep, measured over many draws against the exact probabilities; a seed repeats its
 * draws and other seeds give others. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "tools/kt-generate/generate.h"

int gen_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    return 1;
}

#define V 4
#define DRAWS 200000

/* probabilities 1, 2, 4, 8 (over 15) at temperature 1 */
static const float LOGITS[V] = {0.0f, 0.69314718f, 1.38629436f, 2.07944154f};

/* The frequencies of DRAWS draws against want[] (renormalised), within 5 standard errors. */
static void check_draws(double temperature, int64_t top_k, double top_p, const double *want)
{
    gen_sampler s;
    assert_int_equal(gen_sampler_init(&s, 0, temperature, top_k, top_p, 42, V), 0);
    int64_t count[V] = {0};
    for (int i = 0; i < DRAWS; i++) {
        int64_t id = gen_sampler_pick(&s, LOGITS);
        assert_true(id >= 0 && id < V);
        count[id]++;
    }
    double total = 0.0;
    for (int i = 0; i < V; i++)
        total += want[i];
    for (int i = 0; i < V; i++) {
        const double p = want[i] / total, got = (double)count[i] / DRAWS;
        const double se = sqrt(p * (1.0 - p) / DRAWS);
        if (p == 0.0)
            assert_int_equal(count[i], 0);
        else if (fabs(got - p) > 5.0 * se + 1e-12)
            fail_msg("T %g top-k %lld top-p %g: id %d drawn %.5f of the time, want %.5f",
                     temperature, (long long)top_k, top_p, i, got, p);
    }
    gen_sampler_free(&s);
}

static void test_softmax(void **state)
{
    (void)state;
    const double plain[V] = {1, 2, 4, 8};
    check_draws(1.0, 0, 1.0, plain);
    /* T = 2: the square roots */
    const double warm[V] = {1, sqrt(2.0), 2, sqrt(8.0)};
    check_draws(2.0, 0, 1.0, warm);
}

static void test_top_k_then_top_p(void **state)
{
    (void)state;
    const double two[V] = {0, 0, 4, 8};
    check_draws(1.0, 2, 1.0, two);
    /* 8/15 < 0.6 <= 12/15: the two most probable */
    check_draws(1.0, 0, 0.6, two);
    /* 8/15 reaches 0.5: the most probable alone */
    const double one[V] = {0, 0, 0, 8};
    check_draws(1.0, 0, 0.5, one);
    /* top-k 3 keeps 2 + 4 + 8 = 14; top-p 0.7 of that: 8/14 < 0.7 <= 12/14 */
    check_draws(1.0, 3, 0.7, two);
    /* top-k larger than the vocabulary keeps all */
    const double all[V] = {1, 2, 4, 8};
    check_draws(1.0, 10, 1.0, all);
}

static void test_greedy(void **state)
{
    (void)state;
    const float ties[V] = {1.0f, 3.0f, 3.0f, -2.0f};
    gen_sampler s;
    assert_int_equal(gen_sampler_init(&s, 1, 1.0, 0, 1.0, 1, V), 0);
    assert_int_equal(gen_sampler_pick(&s, ties), 1);
    assert_int_equal(gen_sampler_pick(&s, LOGITS), 3);
    gen_sampler_free(&s);
    /* temperature 0 is greedy too */
    assert_int_equal(gen_sampler_init(&s, 0, 0.0, 0, 1.0, 1, V), 0);
    assert_int_equal(gen_sampler_pick(&s, ties), 1);
    gen_sampler_free(&s);
}

static void draw_sequence(uint64_t seed, int64_t *out, int n)
{
    gen_sampler s;
    assert_int_equal(gen_sampler_init(&s, 0, 1.0, 0, 1.0, seed, V), 0);
    for (int i = 0; i < n; i++)
        out[i] = gen_sampler_pick(&s, LOGITS);
    gen_sampler_free(&s);
}

static void test_seeds(void **state)
{
    (void)state;
    int64_t a[64], b[64], c[64];
    draw_sequence(7, a, 64);
    draw_sequence(7, b, 64);
    draw_sequence(8, c, 64);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_not_equal(a, c, sizeof a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax),
        cmocka_unit_test(test_top_k_then_top_p),
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_seeds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
