/* sum, mean and expand: forward against float64 references, backward against finite
 * differences, every dim (negative ones too) with and without keepdim, bf16/f16 against f32,
 * determinism and thread invariance (the reductions' order is fixed), empty dims, and bad
 * input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 references ----------------------------------------------------------------- */

/* x as [outer, n, inner] around dim d */
static void split_at(const gc_dt *x, int d, int64_t *outer, int64_t *n, int64_t *inner)
{
    *outer = 1, *inner = 1;
    for (int k = 0; k < d; k++)
        *outer *= x->shape[k];
    for (int k = d + 1; k < x->ndim; k++)
        *inner *= x->shape[k];
    *n = x->shape[d];
}

static int resolved(const kt_op_attrs *at, int ndim) { return at->dim < 0 ? at->dim + ndim : at->dim; }

static void ref_reduce(const kt_op_attrs *at, const gc_dt *in, gc_dt *out, int mean)
{
    int64_t outer, n, inner;
    split_at(&in[0], resolved(at, in[0].ndim), &outer, &n, &inner);
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) {
            double s = 0.0;
            for (int64_t k = 0; k < n; k++)
                s += in[0].d[(o * n + k) * inner + i];
            out[0].d[o * inner + i] = mean ? s / (double)n : s;
        }
}

static void ref_sum(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    ref_reduce(at, in, out, 0);
}

static void ref_mean(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    ref_reduce(at, in, out, 1);
}

static void ref_expand(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    int64_t outer, n, inner;
    split_at(&out[0], resolved(at, out[0].ndim), &outer, &n, &inner);
    for (int64_t o = 0; o < outer; o++)
        for (int64_t k = 0; k < n; k++)
            for (int64_t i = 0; i < inner; i++)
                out[0].d[(o * n + k) * inner + i] = in[0].d[o * inner + i];
}

/* ---- cases ---------------------------------------------------------------------------------- */

static void test_sum_mean_every_dim(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    kt_tensor x = tu_new(KT_F32, 3, 4, 5, 6);
    tu_fill_uniform(&x, &rng, -2, 2);
    const kt_op ops[2] = {KT_OP_SUM, KT_OP_MEAN};
    const gc_ref_fn refs[2] = {ref_sum, ref_mean};
    for (int o = 0; o < 2; o++)
        for (int dim = -4; dim < 4; dim++)
            for (int keep = 0; keep <= 1; keep++) {
                gc_case c = {.op = ops[o],
                             .attrs = TU_ATTRS(ops[o], .dim = dim, .reduce_keepdim = keep),
                             .in = &x, .n_in = 1, .ref = refs[o], .threads = (dim & 1) * 2,
                             .seed = (uint64_t)(o * 100 + dim * 10 + keep + 50)};
                gc_check(&c);
                /* the output's shape: dim gone, or kept as 1 */
                kt_tensor y;
                assert_int_equal(kt_op_infer(ops[o], &c.attrs, &x, 1, &y, 1), KT_OK);
                const int d = dim < 0 ? dim + 4 : dim;
                assert_int_equal(y.ndim, keep ? 4 : 3);
                if (keep)
                    assert_int_equal(y.shape[d], 1);
                else
                    assert_int_equal(kt_tensor_numel(&y), 3 * 4 * 5 * 6 / x.shape[d]);
            }
    tu_free(&x);
}

/* rows longer than a chunk and inner widths past a chunk, a 1-d input reduced to a scalar */
static void test_sum_mean_long(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    kt_tensor x = tu_new(KT_F32, 3, 1100), v = tu_new(KT_F32, 1500);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&v, &rng, -1, 1);
    for (int dim = 0; dim < 2; dim++) {
        gc_case c = {.op = KT_OP_SUM, .attrs = TU_ATTRS(KT_OP_SUM, .dim = dim), .in = &x,
                     .n_in = 1, .ref = ref_sum, .probes = 200, .threads = 2, .seed = 3};
        gc_check(&c);
        c.op = KT_OP_MEAN, c.ref = ref_mean;
        c.attrs = TU_ATTRS(KT_OP_MEAN, .dim = dim);
        gc_check(&c);
    }
    gc_case s = {.op = KT_OP_MEAN, .attrs = TU_ATTRS(KT_OP_MEAN, .dim = -1), .in = &v, .n_in = 1,
                 .ref = ref_mean, .probes = 100, .seed = 4};
    gc_check(&s);
    kt_tensor y;
    assert_int_equal(kt_op_infer(KT_OP_MEAN, &s.attrs, &v, 1, &y, 1), KT_OK);
    assert_int_equal(y.ndim, 0);
    tu_free(&x), tu_free(&v);
}

static void test_expand(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    /* MLA's k_pe [B,S,1,dr] over the heads, and every other position of the size-1 dim */
    kt_tensor kpe = tu_new(KT_F32, 2, 3, 1, 4), row = tu_new(KT_F32, 1, 700),
              col = tu_new(KT_F32, 9, 1);
    tu_fill_uniform(&kpe, &rng, -1, 1);
    tu_fill_uniform(&row, &rng, -1, 1);
    tu_fill_uniform(&col, &rng, -1, 1);
    const struct {
        kt_tensor *x;
        int dim;
        int64_t size;
    } cases[] = {{&kpe, 2, 5}, {&kpe, -2, 1}, {&row, 0, 7}, {&row, -2, 30}, {&col, 1, 600},
                 {&col, -1, 3}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gc_case c = {.op = KT_OP_EXPAND,
                     .attrs = TU_ATTRS(KT_OP_EXPAND, .dim = cases[i].dim,
                                       .expand_size = cases[i].size),
                     .in = cases[i].x, .n_in = 1, .ref = ref_expand, .threads = (int)(i % 2) * 2,
                     .seed = 6 + i};
        gc_check(&c);
    }
    /* forward is a copy: bf16 values move exactly */
    kt_tensor b = tu_convert(&kpe, KT_BF16), out = tu_new(KT_BF16, 2, 3, 5, 4);
    kt_op_attrs at = TU_ATTRS(KT_OP_EXPAND, .dim = 2, .expand_size = 5);
    assert_int_equal(kt_op_forward(KT_OP_EXPAND, &at, &b, 1, &out, 1, NULL), KT_OK);
    for (int64_t i = 0; i < kt_tensor_numel(&out); i++) {
        const int64_t d = i % 4, s = i / 20;
        assert_true(((uint16_t *)out.data)[i] == ((uint16_t *)b.data)[s * 4 + d]);
    }
    tu_free(&b), tu_free(&out);
    tu_free(&kpe), tu_free(&row), tu_free(&col);
}

/* bf16 keeps 8 mantissa bits; a sum of n values rounds once on store (f32 accumulation) */
static void test_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 8);
    kt_tensor x = tu_new(KT_F32, 6, 40, 9), one = tu_new(KT_F32, 6, 1, 9);
    tu_fill_uniform(&x, &rng, 0.5, 2);
    tu_fill_uniform(&one, &rng, -2, 2);
    for (int dim = -3; dim < 3; dim++) {
        gc_case c = {.op = KT_OP_SUM, .attrs = TU_ATTRS(KT_OP_SUM, .dim = dim), .in = &x,
                     .n_in = 1, .seed = 9};
        gc_check_lowp(&c, KT_BF16, 1e-2);
        gc_check_lowp(&c, KT_F16, 2e-3);
        c.op = KT_OP_MEAN, c.attrs = TU_ATTRS(KT_OP_MEAN, .dim = dim, .reduce_keepdim = 1);
        gc_check_lowp(&c, KT_BF16, 1e-2);
        gc_check_lowp(&c, KT_F16, 2e-3);
    }
    gc_case e = {.op = KT_OP_EXPAND, .attrs = TU_ATTRS(KT_OP_EXPAND, .dim = 1, .expand_size = 33),
                 .in = &one, .n_in = 1, .seed = 10};
    gc_check_lowp(&e, KT_BF16, 1e-2);
    gc_check_lowp(&e, KT_F16, 2e-3);
    tu_free(&x), tu_free(&one);
}

static void test_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 11);
    kt_tensor x = tu_new(KT_F32, 64, 300, 5), one = tu_new(KT_F32, 300, 1, 64);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&one, &rng, -1, 1);
    for (int dim = 0; dim < 3; dim++) {
        gc_case c = {.op = KT_OP_SUM, .attrs = TU_ATTRS(KT_OP_SUM, .dim = dim), .in = &x,
                     .n_in = 1, .seed = 12};
        gc_check_deterministic(&c, 2);
        gc_check_thread_invariant(&c, 0, 3);
        c.op = KT_OP_MEAN, c.attrs = TU_ATTRS(KT_OP_MEAN, .dim = dim);
        gc_check_thread_invariant(&c, 0, 2);
    }
    gc_case e = {.op = KT_OP_EXPAND, .attrs = TU_ATTRS(KT_OP_EXPAND, .dim = 1, .expand_size = 40),
                 .in = &one, .n_in = 1, .seed = 13};
    gc_check_deterministic(&e, 3);
    gc_check_thread_invariant(&e, 0, 2);
    tu_free(&x), tu_free(&one);
}

/* Summing nothing gives 0, its mean NaN; expanding to size 0 gives an empty tensor whose
 * gradient into x is 0. */
static void test_empty(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 3, 0, 2), y = tu_new(KT_F32, 3, 2), gy = tu_new(KT_F32, 3, 2);
    kt_tensor gx = tu_new(KT_F32, 3, 0, 2);
    kt_op_attrs at = TU_ATTRS(KT_OP_SUM, .dim = 1);
    for (int64_t i = 0; i < 6; i++)
        tu_set(&y, i, 5.0);
    assert_int_equal(kt_op_forward(KT_OP_SUM, &at, &x, 1, &y, 1, NULL), KT_OK);
    for (int64_t i = 0; i < 6; i++)
        assert_true(tu_get(&y, i) == 0.0);
    assert_int_equal(kt_op_backward(KT_OP_SUM, &at, &x, 1, &y, 1, &gy, &gx, NULL), KT_OK);
    at = TU_ATTRS(KT_OP_MEAN, .dim = 1);
    assert_int_equal(kt_op_forward(KT_OP_MEAN, &at, &x, 1, &y, 1, NULL), KT_OK);
    for (int64_t i = 0; i < 6; i++)
        assert_true(isnan(tu_get(&y, i)));
    kt_tensor one = tu_new(KT_F32, 3, 1, 2), none = tu_new(KT_F32, 3, 0, 2),
              g1 = tu_new(KT_F32, 3, 1, 2);
    for (int64_t i = 0; i < 6; i++)
        tu_set(&g1, i, 7.0);
    at = TU_ATTRS(KT_OP_EXPAND, .dim = 1, .expand_size = 0);
    assert_int_equal(kt_op_forward(KT_OP_EXPAND, &at, &one, 1, &none, 1, NULL), KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_EXPAND, &at, &one, 1, &none, 1, &none, &g1, NULL), KT_OK);
    for (int64_t i = 0; i < 6; i++)
        assert_true(tu_get(&g1, i) == 0.0);
    tu_free(&x), tu_free(&y), tu_free(&gy), tu_free(&gx), tu_free(&one), tu_free(&none);
    tu_free(&g1);
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 4, 5), xi = tu_new(KT_I32, 4, 5), s = tu_new(KT_F32, 4);
    kt_tensor sc = tu_alloc(KT_F32, 0, NULL), big = tu_new(KT_F32, 4, 5, 3);
    kt_op_attrs at = TU_ATTRS(KT_OP_SUM, .dim = 2);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUM, &at, &x, 1, &s, 1, NULL), KT_EINVAL, "sum",
                    "dim 2 outside -2..1", "f32[4,5]");
    at = TU_ATTRS(KT_OP_MEAN, .dim = -3);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MEAN, &at, &x, 1, &s, 1, NULL), KT_EINVAL, "mean",
                    "dim -3 outside -2..1");
    at = TU_ATTRS(KT_OP_SUM, .dim = 1);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUM, &at, &xi, 1, &s, 1, NULL), KT_EINVAL, "sum", "x",
                    "i32");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUM, &at, &sc, 1, &s, 1, NULL), KT_EINVAL, "sum", "x",
                    "1 to 4 dimensions");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUM, NULL, &x, 1, &s, 1, NULL), KT_EINVAL, "sum",
                    "dim");
    /* the output's shape follows keepdim */
    at = TU_ATTRS(KT_OP_SUM, .dim = 1, .reduce_keepdim = 1);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUM, &at, &x, 1, &s, 1, NULL), KT_EINVAL, "sum",
                    "output 0", "f32[4,1]");
    at = TU_ATTRS(KT_OP_EXPAND, .dim = 1, .expand_size = 3);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EXPAND, &at, &x, 1, &big, 1, NULL), KT_EINVAL, "expand",
                    "x dimension 1 must be 1", "f32[4,5]");
    at = TU_ATTRS(KT_OP_EXPAND, .dim = 4, .expand_size = 3);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EXPAND, &at, &x, 1, &big, 1, NULL), KT_EINVAL, "expand",
                    "dim");
    kt_tensor x1 = tu_new(KT_F32, 4, 1);
    at = TU_ATTRS(KT_OP_EXPAND, .dim = 1, .expand_size = -1);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EXPAND, &at, &x1, 1, &big, 1, NULL), KT_EINVAL,
                    "expand", "size -1");
    tu_free(&x1);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EXPAND, NULL, &x, 1, &big, 1, NULL), KT_EINVAL, "expand",
                    "dim");
    tu_free(&x), tu_free(&xi), tu_free(&s), tu_free(&sc), tu_free(&big);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sum_mean_every_dim), cmocka_unit_test(test_sum_mean_long),
        cmocka_unit_test(test_expand),             cmocka_unit_test(test_low_precision),
        cmocka_unit_test(test_deterministic),      cmocka_unit_test(test_empty),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
