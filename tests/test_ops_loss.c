/* cross_entropy: forward against a float64 reference, backward against finite differences,
 * ignore_index (a sentinel, a valid class id, the zeroed default, every token ignored),
 * bf16/f16 against f32, determinism (also across thread counts, since the loss is a sum over
 * tokens), and bad input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 reference -------------------------------------------------------------------- */

static void ref_ce(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    const int64_t n = in[0].shape[0], v = in[0].shape[1];
    double sum = 0.0;
    int64_t count = 0;
    for (int64_t r = 0; r < n; r++) {
        const int64_t t = (int64_t)in[1].d[r];
        if (t == at->ignore_index)
            continue;
        const double *x = in[0].d + r * v;
        double m = -INFINITY, s = 0.0;
        for (int64_t i = 0; i < v; i++)
            m = fmax(m, x[i]);
        for (int64_t i = 0; i < v; i++)
            s += exp(x[i] - m);
        sum += m + log(s) - x[t];
        count++;
    }
    out[0].d[0] = count ? sum / (double)count : 0.0;
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* logits [n, v] uniform in [lo, hi); targets [n] uniform classes, every `every`-th token (if
 * every > 0) set to `ignore` */
static void make_case(tu_rng *rng, kt_tensor *in, int64_t n, int64_t v, kt_dtype tdtype,
                      double lo, double hi, int every, int64_t ignore)
{
    in[0] = tu_new(KT_F32, n, v);
    in[1] = tu_new(tdtype, n);
    tu_fill_uniform(&in[0], rng, lo, hi);
    tu_fill_uniform(&in[1], rng, 0, (double)v);
    for (int64_t i = 0; every > 0 && i < n; i += every)
        tu_set(&in[1], i, (double)ignore);
}

/* Forward + backward with `threads` threads; gradient of the loss 1.5. */
static void run_fb(const kt_op_attrs *at, const kt_tensor *in, int threads, kt_tensor *loss,
                   kt_tensor *dlogits)
{
    *loss = tu_alloc(KT_F32, 0, NULL);
    *dlogits = tu_alloc(in[0].dtype, 2, in[0].shape);
    kt_tensor gout = tu_alloc(KT_F32, 0, NULL), gin[2] = {*dlogits, {0}};
    tu_set(&gout, 0, 1.5);
    kt_threadpool *pool = NULL;
    if (threads > 0)
        assert_int_equal(kt_threadpool_create(threads, &pool), KT_OK);
    kt_exec ex = {.pool = pool,
                  .scratch_bytes = kt_op_scratch_bytes(KT_OP_CROSS_ENTROPY, at, in, 2, 0)};
    if (ex.scratch_bytes)
        assert_int_equal(posix_memalign(&ex.scratch, 64, ex.scratch_bytes), 0);
    assert_int_equal(kt_op_forward(KT_OP_CROSS_ENTROPY, at, in, 2, loss, 1, &ex), KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_CROSS_ENTROPY, at, in, 2, loss, 1, &gout, gin, &ex),
                     KT_OK);
    free(ex.scratch);
    kt_threadpool_destroy(pool);
    tu_free(&gout);
}

/* ---- tests ----------------------------------------------------------------------------------- */

/* Odd sizes, a vocabulary of 1037 (three kernel chunks), i32 and i64 targets, ignored
 * tokens with the conventional -100, with no pool and with 2 threads. */
static void test_cross_entropy(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    const int64_t sizes[4][2] = {{6, 11}, {5, 1037}, {9, 3}, {1, 1}};
    for (int s = 0; s < 4; s++) {
        kt_tensor in[2];
        make_case(&rng, in, sizes[s][0], sizes[s][1], s % 2 ? KT_I64 : KT_I32, -4, 4, 3, -100);
        for (int threads = 0; threads <= 2; threads += 2) {
            gc_case c = {.op = KT_OP_CROSS_ENTROPY,
                         .attrs = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100),
                         .in = in,
                         .n_in = 2,
                         .ref = ref_ce,
                         .threads = threads,
                         .probes = 500,
                         .seed = (uint64_t)(10 * s + threads)};
            gc_check(&c);
        }
        tu_free(&in[0]), tu_free(&in[1]);
    }
}

/* ignore_index is a plain value compared with each target: a valid class id works (those
 * tokens neither count nor get gradient), and the zeroed default 0 skips class 0. */
static void test_ignore_index(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    kt_tensor in[2];
    make_case(&rng, in, 40, 7, KT_I64, -3, 3, 0, 0);
    for (int64_t i = 0; i < 40; i += 4)
        tu_set(&in[1], i, 2); /* some tokens of class 2 for sure */
    for (int64_t i = 1; i < 40; i += 5)
        tu_set(&in[1], i, 0);
    const kt_op_attrs variants[2] = {TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = 2),
                                     TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = 0)};
    for (int v = 0; v < 2; v++) {
        gc_case c = {.op = KT_OP_CROSS_ENTROPY, .attrs = variants[v], .in = in, .n_in = 2,
                     .ref = ref_ce, .seed = (uint64_t)(3 + v)};
        gc_check(&c);
        kt_tensor loss, d;
        run_fb(&variants[v], in, 0, &loss, &d);
        for (int64_t r = 0; r < 40; r++) {
            if (tu_get(&in[1], r) != (double)variants[v].ignore_index)
                continue;
            for (int64_t k = 0; k < 7; k++)
                assert_true(tu_get(&d, r * 7 + k) == 0.0);
        }
        tu_free(&loss), tu_free(&d);
    }
    tu_free(&in[0]), tu_free(&in[1]);
}

/* No token counts: the loss is 0 and every gradient is 0 (not NaN from 0 / 0). */
static void test_all_ignored(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    kt_tensor in[2];
    make_case(&rng, in, 5, 9, KT_I32, -3, 3, 1, -100);
    const kt_op_attrs at = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100);
    kt_tensor loss, d;
    run_fb(&at, in, 2, &loss, &d);
    assert_true(tu_get(&loss, 0) == 0.0);
    for (int64_t k = 0; k < 45; k++)
        assert_true(tu_get(&d, k) == 0.0);
    tu_free(&loss), tu_free(&d);
    gc_case c = {.op = KT_OP_CROSS_ENTROPY, .attrs = at, .in = in, .n_in = 2, .ref = ref_ce,
                 .seed = 5};
    gc_check(&c);
    tu_free(&in[0]), tu_free(&in[1]);
    /* no tokens at all */
    kt_tensor none[2] = {tu_new(KT_F32, 0, 4), tu_new(KT_I32, 0)};
    c.in = none;
    gc_check(&c);
    tu_free(&none[0]), tu_free(&none[1]);
}

/* Logits near +-1000 overflow exp unless each row's maximum is subtracted first. */
static void test_stable(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 6);
    kt_tensor in[2];
    make_case(&rng, in, 4, 30, KT_I32, -3, 3, 0, 0);
    for (int64_t i = 0; i < 60; i++)
        tu_set(&in[0], i, tu_get(&in[0], i) + (i < 30 ? 1000.0 : -1000.0));
    gc_case c = {.op = KT_OP_CROSS_ENTROPY,
                 .attrs = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100),
                 .in = in,
                 .n_in = 2,
                 .ref = ref_ce,
                 .seed = 7};
    gc_check(&c);
    tu_free(&in[0]), tu_free(&in[1]);
}

/* bf16 keeps 8 significant bits (rounding 2^-9 ~ 2e-3), f16 11 (2^-12 ~ 2.4e-4). The loss
 * is computed in f32 from rounded logits; their rounding errors are independent and mostly
 * cancel in the mean over tokens (measured up to 1.6e-4 bf16, 2.3e-5 f16). The gradient's
 * largest entries are the targets' (p - 1) / count, whose store rounds them once, plus
 * exp's response to the rounded logits (measured up to 2.7e-3 bf16, 3.4e-4 f16 over six
 * seeds). The bounds, 8e-3 and 1e-3, leave about 3x. */
static void test_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 8);
    kt_tensor in[2];
    make_case(&rng, in, 24, 700, KT_I32, -4, 4, 5, -100);
    gc_case c = {.op = KT_OP_CROSS_ENTROPY,
                 .attrs = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100),
                 .in = in,
                 .n_in = 2,
                 .threads = 2,
                 .seed = 9};
    gc_check_lowp(&c, KT_BF16, 8e-3);
    gc_check_lowp(&c, KT_F16, 1e-3);
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 10);
    kt_tensor in[2];
    make_case(&rng, in, 700, 160, KT_I64, -5, 5, 7, -100);
    gc_case c = {.op = KT_OP_CROSS_ENTROPY,
                 .attrs = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100),
                 .in = in,
                 .n_in = 2,
                 .seed = 11};
    gc_check_deterministic(&c, 2);
    gc_check_deterministic(&c, 3);
    /* the loss sums the tokens in order whatever the split: bitwise the same for any count */
    kt_tensor l0, d0, l3, d3;
    run_fb(&c.attrs, in, 0, &l0, &d0);
    run_fb(&c.attrs, in, 3, &l3, &d3);
    assert_true(tu_bitwise_equal(&l0, &l3));
    assert_true(tu_bitwise_equal(&d0, &d3));
    tu_free(&l0), tu_free(&d0), tu_free(&l3), tu_free(&d3);
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor lg = tu_new(KT_F32, 5, 11), t = tu_new(KT_I32, 5), t64 = tu_new(KT_I64, 5);
    kt_tensor loss = tu_alloc(KT_F32, 0, NULL), gl = tu_new(KT_F32, 5, 11);
    kt_tensor lg3 = tu_new(KT_F32, 1, 5, 11), lgi = tu_new(KT_I32, 5, 11);
    kt_tensor t6 = tu_new(KT_I32, 6), tf = tu_new(KT_F32, 5), t2 = tu_new(KT_I32, 5, 1);
    const kt_op_attrs at = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = -100);
    kt_tensor in[2] = {lg, t};
    /* out-of-range targets: reported with their position and value, forward and backward */
    tu_set(&t, 3, 11);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_ERANGE,
                    "cross_entropy", "targets[3] = 11", "[0, 11)");
    kt_tensor gin[2] = {gl, {0}};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, &loss, gin, NULL),
                    KT_ERANGE, "cross_entropy", "targets[3] = 11");
    tu_set(&t, 3, 0);
    tu_set(&t, 1, -1);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_ERANGE,
                    "cross_entropy", "targets[1] = -1");
    /* -100 is only a sentinel when ignore_index says so: with ignore_index 0 it is a target */
    tu_set(&t64, 4, -100);
    in[1] = t64;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY,
                                  &TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = 0), in, 2, &loss,
                                  1, NULL),
                    KT_ERANGE, "cross_entropy", "targets[4] = -100", "ignore_index (0)");
    assert_int_equal(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_OK);
    /* ranks, shapes, dtypes */
    in[0] = lg3, in[1] = t;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_EINVAL,
                    "cross_entropy", "logits", "2 dimensions");
    in[0] = lgi;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_EINVAL,
                    "cross_entropy", "logits", "i32");
    in[0] = lg, in[1] = t6;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_EINVAL,
                    "cross_entropy", "targets", "dimension 0 must be 5");
    in[1] = tf;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_EINVAL,
                    "cross_entropy", "targets", "i32 or i64", "f32");
    in[1] = t2;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, NULL), KT_EINVAL,
                    "cross_entropy", "targets", "1 dimension");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 1, &loss, 1, NULL), KT_EINVAL,
                    "cross_entropy", "2 inputs");
    /* the output is a scalar */
    in[1] = t;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CROSS_ENTROPY, &at, in, 2, &gl, 1, NULL), KT_EINVAL,
                    "cross_entropy", "output 0");
    /* targets take no gradient */
    kt_tensor tg = tu_new(KT_I32, 5);
    gin[1] = tg;
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_CROSS_ENTROPY, &at, in, 2, &loss, 1, &loss, gin, NULL),
                    KT_EINVAL, "cross_entropy", "input 1", "no gradient");
    tu_free(&lg), tu_free(&t), tu_free(&t64), tu_free(&loss), tu_free(&gl), tu_free(&lg3);
    tu_free(&lgi), tu_free(&t6), tu_free(&tf), tu_free(&t2), tu_free(&tg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cross_entropy), cmocka_unit_test(test_ignore_index),
        cmocka_unit_test(test_all_ignored),   cmocka_unit_test(test_stable),
        cmocka_unit_test(test_low_precision), cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
