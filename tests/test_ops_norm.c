/* rmsnorm, softmax, log_softmax: forward against float64 references, backward against
 * finite differences, rmsnorm at an RMS past f32's range for x^2 and rstd^3 (scale
 * invariance), bf16/f16 against f32, determinism (also across thread counts, since
 * rmsnorm's dw is a reduction over rows), in-place forward, and bad input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 references ----------------------------------------------------------------- */

static int64_t last_dim(const gc_dt *t) { return t->shape[t->ndim - 1]; }

static void ref_rmsnorm(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                        int n_out)
{
    (void)n_in, (void)n_out;
    const double eps = at->eps == 0.0f ? 1e-6 : (double)at->eps;
    const int64_t h = last_dim(&in[0]), rows = in[0].n / h;
    for (int64_t r = 0; r < rows; r++) {
        const double *x = in[0].d + r * h;
        double ss = 0.0;
        for (int64_t i = 0; i < h; i++)
            ss += x[i] * x[i];
        const double rstd = 1.0 / sqrt(ss / (double)h + eps);
        for (int64_t i = 0; i < h; i++)
            out[0].d[r * h + i] = x[i] * rstd * in[1].d[i];
    }
}

/* log-sum-exp of a row, shifted by its maximum */
static double lse64(const double *x, int64_t v)
{
    double m = -INFINITY, s = 0.0;
    for (int64_t i = 0; i < v; i++)
        m = fmax(m, x[i]);
    for (int64_t i = 0; i < v; i++)
        s += exp(x[i] - m);
    return m + log(s);
}

static void ref_softmax(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                        int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    const int64_t v = last_dim(&in[0]);
    for (int64_t r = 0; r < in[0].n / v; r++) {
        const double lse = lse64(in[0].d + r * v, v);
        for (int64_t i = 0; i < v; i++)
            out[0].d[r * v + i] = exp(in[0].d[r * v + i] - lse);
    }
}

static void ref_log_softmax(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                            int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    const int64_t v = last_dim(&in[0]);
    for (int64_t r = 0; r < in[0].n / v; r++) {
        const double lse = lse64(in[0].d + r * v, v);
        for (int64_t i = 0; i < v; i++)
            out[0].d[r * v + i] = in[0].d[r * v + i] - lse;
    }
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* Forward + backward with t1 and t2 threads: bitwise the same. */
static void check_thread_invariant(kt_op op, const kt_op_attrs *at, const kt_tensor *in,
                                   int n_in, int t1, int t2)
{
    gc_case c = {.op = op, .attrs = *at, .in = in, .n_in = n_in, .seed = 99};
    gc_check_thread_invariant(&c, t1, t2);
}

/* The forward into its own input must give what it gives into a separate output. */
static void check_inplace(kt_op op, const kt_op_attrs *at, const kt_tensor *in, int n_in)
{
    kt_tensor sep = tu_clone(&in[0]);
    assert_int_equal(kt_op_forward(op, at, in, n_in, &sep, 1, NULL), KT_OK);
    kt_tensor x[2] = {tu_clone(&in[0])};
    if (n_in > 1)
        x[1] = in[1];
    assert_int_equal(kt_op_forward(op, at, x, n_in, &x[0], 1, NULL), KT_OK);
    if (!tu_bitwise_equal(&x[0], &sep))
        fail_msg("%s %s: in-place forward differs", kt_op_name(op), kt_dtype_name(in[0].dtype));
    tu_free(&sep), tu_free(&x[0]);
}

/* ---- rmsnorm ------------------------------------------------------------------------------ */

/* Odd sizes, rows longer than the kernel's 512-element chunks, rank 1 and 3, default and
 * explicit eps, each with no pool and with 2 threads. */
static void test_rmsnorm(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    const int64_t shapes[4][3] = {{3, 5, 41}, {7, 1031, 0}, {13, 0, 0}, {2, 1, 1}};
    const int ndims[4] = {3, 2, 1, 3};
    const float epss[4] = {0.0f, 1e-3f, 0.0f, 0.5f};
    for (int s = 0; s < 4; s++) {
        const int64_t h = shapes[s][ndims[s] - 1];
        kt_tensor in[2] = {tu_alloc(KT_F32, ndims[s], shapes[s]), tu_new(KT_F32, h)};
        tu_fill_uniform(&in[0], &rng, -2, 2);
        tu_fill_uniform(&in[1], &rng, 0.5, 1.5);
        for (int threads = 0; threads <= 2; threads += 2) {
            gc_case c = {.op = KT_OP_RMSNORM,
                         .attrs = epss[s] == 0.0f ? kt_op_defaults(KT_OP_RMSNORM)
                                                  : TU_ATTRS(KT_OP_RMSNORM, .eps = epss[s]),
                         .in = in,
                         .n_in = 2,
                         .ref = ref_rmsnorm,
                         .threads = threads,
                         .probes = 400,
                         .seed = (uint64_t)(10 * s + threads)};
            gc_check(&c);
        }
        tu_free(&in[0]), tu_free(&in[1]);
    }
}

/* Rows at RMS 1e18 (x^2 past f32's range) and 1e14 (rstd^3 below it): scale-invariance, so
 * y(s x) = y(x) and s dx(s x) = dx(x) up to rounding (eps is negligible against both). */
static void test_rmsnorm_extreme_scale(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 21);
    const int64_t rows = 3, h = 700;
    kt_tensor x = tu_new(KT_F32, rows, h), w = tu_new(KT_F32, h), g = tu_new(KT_F32, rows, h);
    tu_fill_uniform(&x, &rng, -2, 2);
    tu_fill_uniform(&w, &rng, 0.5, 1.5);
    tu_fill_uniform(&g, &rng, -1, 1);
    const kt_op_attrs at = TU_ATTRS(KT_OP_RMSNORM, .eps = 1e-30f);
    kt_tensor y0 = tu_new(KT_F32, rows, h), dx0 = tu_new(KT_F32, rows, h);
    kt_tensor dw0 = tu_new(KT_F32, h);
    kt_tensor in0[2] = {x, w}, gin0[2] = {dx0, dw0};
    _Alignas(64) float scratch[64]; /* the backward's rstd per row */
    kt_exec ex = {.scratch = scratch, .scratch_bytes = sizeof scratch};
    assert_true(kt_op_scratch_bytes(KT_OP_RMSNORM, &at, in0, 2, 1) <= sizeof scratch);
    assert_int_equal(kt_op_forward(KT_OP_RMSNORM, &at, in0, 2, &y0, 1, NULL), KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_RMSNORM, &at, in0, 2, &y0, 1, &g, gin0, &ex), KT_OK);
    const float scales[2] = {1e18f, 1e14f};
    for (int si = 0; si < 2; si++) {
        const float s = scales[si];
        kt_tensor xs = tu_clone(&x), y = tu_new(KT_F32, rows, h), dx = tu_new(KT_F32, rows, h);
        kt_tensor dw = tu_new(KT_F32, h);
        float *xd = xs.data;
        for (int64_t i = 0; i < rows * h; i++)
            xd[i] *= s;
        kt_tensor in[2] = {xs, w}, gin[2] = {dx, dw};
        assert_int_equal(kt_op_forward(KT_OP_RMSNORM, &at, in, 2, &y, 1, NULL), KT_OK);
        assert_int_equal(kt_op_backward(KT_OP_RMSNORM, &at, in, 2, &y, 1, &g, gin, &ex), KT_OK);
        const float *yd = y.data, *y0d = y0.data, *dxd = dx.data, *dx0d = dx0.data;
        const float *dwd = dw.data, *dw0d = dw0.data;
        for (int64_t i = 0; i < rows * h; i++) {
            if (!(fabsf(yd[i] - y0d[i]) <= 1e-5f * (1.0f + fabsf(y0d[i]))))
                fail_msg("scale %g: y[%lld] = %g, want %g", (double)s, (long long)i,
                         (double)yd[i], (double)y0d[i]);
            const double sdx = (double)dxd[i] * (double)s;
            if (!(fabs(sdx - dx0d[i]) <= 1e-4 * (1.0 + fabs(dx0d[i]))))
                fail_msg("scale %g: s dx[%lld] = %g, want %g", (double)s, (long long)i, sdx,
                         (double)dx0d[i]);
        }
        for (int64_t i = 0; i < h; i++) /* dw = sum g x rstd: scale-free */
            if (!(fabsf(dwd[i] - dw0d[i]) <= 1e-5f * (1.0f + fabsf(dw0d[i]))))
                fail_msg("scale %g: dw[%lld] = %g, want %g", (double)s, (long long)i,
                         (double)dwd[i], (double)dw0d[i]);
        tu_free(&xs), tu_free(&y), tu_free(&dx), tu_free(&dw);
    }
    tu_free(&x), tu_free(&w), tu_free(&g), tu_free(&y0), tu_free(&dx0), tu_free(&dw0);
}

/* ---- softmax, log_softmax ------------------------------------------------------------------ */

static const kt_op softmaxes[2] = {KT_OP_SOFTMAX, KT_OP_LOG_SOFTMAX};
static const gc_ref_fn softmax_refs[2] = {ref_softmax, ref_log_softmax};

/* Odd sizes and rows of 1030 (three chunks). */
static void test_softmax(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    const int64_t shapes[4][3] = {{4, 37, 0}, {2, 3, 1030}, {5, 0, 0}, {3, 1, 0}};
    const int ndims[4] = {2, 3, 1, 2};
    for (int s = 0; s < 4; s++) {
        kt_tensor x = tu_alloc(KT_F32, ndims[s], shapes[s]);
        tu_fill_uniform(&x, &rng, -8, 8);
        for (int o = 0; o < 2; o++)
            for (int threads = 0; threads <= 2; threads += 2) {
                gc_case c = {.op = softmaxes[o], .in = &x, .n_in = 1, .ref = softmax_refs[o],
                             .threads = threads, .probes = 400,
                             .seed = (uint64_t)(100 * s + 10 * o + threads)};
                gc_check(&c);
            }
        tu_free(&x);
    }
}

/* Logits near +-1000 overflow exp unless the row maximum is subtracted first. */
static void test_softmax_stable(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    kt_tensor x = tu_new(KT_F32, 4, 50);
    tu_fill_uniform(&x, &rng, -3, 3);
    for (int64_t i = 0; i < 100; i++)
        tu_set(&x, i, tu_get(&x, i) + 1000.0);
    for (int64_t i = 100; i < 200; i++)
        tu_set(&x, i, tu_get(&x, i) - 1000.0);
    for (int o = 0; o < 2; o++) {
        gc_case c = {.op = softmaxes[o], .in = &x, .n_in = 1, .ref = softmax_refs[o],
                     .seed = (uint64_t)o};
        gc_check(&c);
    }
    tu_free(&x);
}

/* ---- shared checks ------------------------------------------------------------------------ */

/* bf16 keeps 8 significant bits (rounding 2^-9 ~ 2e-3 relative), f16 11 (2^-12 ~ 2.4e-4).
 * Rounding an input x in [-3, 3] moves it by up to |x| 2^-9 absolute, which exp turns into
 * the same relative error of a softmax output (~6e-3 for bf16), and the result and the
 * gradients are rounded once more; rmsnorm's dx and softmax's backward subtract terms of
 * similar size, which can amplify this a little relative to the result's scale. Measured
 * worst cases over several seeds: bf16 1.2e-2, f16 1.2e-3; the bounds leave 2.5-3x. */
static void test_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    kt_tensor in[2] = {tu_new(KT_F32, 6, 600), tu_new(KT_F32, 600)};
    tu_fill_uniform(&in[0], &rng, -3, 3);
    tu_fill_uniform(&in[1], &rng, 0.5, 1.5);
    gc_case c = {.op = KT_OP_RMSNORM,
                 .attrs = kt_op_defaults(KT_OP_RMSNORM),
                 .in = in,
                 .n_in = 2,
                 .threads = 2,
                 .seed = 5};
    gc_check_lowp(&c, KT_BF16, 3e-2);
    gc_check_lowp(&c, KT_F16, 4e-3);
    for (int o = 0; o < 2; o++) {
        gc_case s = {.op = softmaxes[o], .in = in, .n_in = 1, .seed = (uint64_t)(6 + o)};
        gc_check_lowp(&s, KT_BF16, 3e-2);
        gc_check_lowp(&s, KT_F16, 4e-3);
    }
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 8);
    /* enough rows and columns to be split over 3 threads both ways */
    kt_tensor in[2] = {tu_new(KT_F32, 300, 200), tu_new(KT_F32, 200)};
    tu_fill_uniform(&in[0], &rng, -2, 2);
    tu_fill_uniform(&in[1], &rng, -2, 2);
    const kt_op ops[3] = {KT_OP_RMSNORM, KT_OP_SOFTMAX, KT_OP_LOG_SOFTMAX};
    for (int o = 0; o < 3; o++) {
        int n_in = ops[o] == KT_OP_RMSNORM ? 2 : 1;
        gc_case c = {.op = ops[o], .in = in, .n_in = n_in, .seed = (uint64_t)(9 + o)};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        check_thread_invariant(ops[o], &c.attrs, in, n_in, 0, 3);
        check_thread_invariant(ops[o], &c.attrs, in, n_in, 2, 3);
    }
    kt_tensor lp[2] = {tu_convert(&in[0], KT_BF16), tu_convert(&in[1], KT_BF16)};
    check_thread_invariant(KT_OP_RMSNORM, &(kt_op_attrs[]){kt_op_defaults(KT_OP_RMSNORM)}[0], lp, 2,
                           0, 3);
    tu_free(&lp[0]), tu_free(&lp[1]);
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_inplace(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 12);
    kt_tensor in[2] = {tu_new(KT_F32, 3, 1100), tu_new(KT_F32, 1100)};
    tu_fill_uniform(&in[0], &rng, -4, 4);
    tu_fill_uniform(&in[1], &rng, -2, 2);
    const kt_op_attrs at = kt_op_defaults(KT_OP_RMSNORM);
    for (int d = 0; d < 2; d++) {
        kt_tensor x[2] = {d ? tu_convert(&in[0], KT_BF16) : tu_clone(&in[0]),
                          d ? tu_convert(&in[1], KT_BF16) : tu_clone(&in[1])};
        check_inplace(KT_OP_RMSNORM, &at, x, 2);
        check_inplace(KT_OP_SOFTMAX, &at, x, 1);
        check_inplace(KT_OP_LOG_SOFTMAX, &at, x, 1);
        tu_free(&x[0]), tu_free(&x[1]);
    }
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 4, 6), w = tu_new(KT_F32, 6), w7 = tu_new(KT_F32, 7);
    kt_tensor wb = tu_new(KT_BF16, 6), w2 = tu_new(KT_F32, 1, 6), xi = tu_new(KT_I32, 4, 6);
    kt_tensor sc = tu_alloc(KT_F32, 0, NULL), out = tu_new(KT_F32, 4, 6);
    kt_tensor in[2] = {x, w7};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_RMSNORM, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "rmsnorm", "w", "dimension 0 must be 6", "f32[7]");
    in[1] = wb;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_RMSNORM, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "rmsnorm", "w", "bf16");
    in[1] = w2;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_RMSNORM, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "rmsnorm", "w", "1 dimension");
    in[0] = xi, in[1] = w;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_RMSNORM, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "rmsnorm", "x", "i32");
    in[0] = sc;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_RMSNORM, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "rmsnorm", "x", "dimensions");
    in[0] = x;
    TU_EXPECT_ERROR(
        kt_op_forward(KT_OP_RMSNORM, &TU_ATTRS(KT_OP_RMSNORM, .eps = -1e-5f), in, 2, &out, 1, NULL),
        KT_EINVAL, "rmsnorm", "eps");
    TU_EXPECT_ERROR(
        kt_op_forward(KT_OP_RMSNORM, &TU_ATTRS(KT_OP_RMSNORM, .eps = NAN), in, 2, &out, 1, NULL),
        KT_EINVAL, "rmsnorm", "eps");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_RMSNORM, NULL, in, 1, &out, 1, NULL), KT_EINVAL,
                    "rmsnorm", "2 inputs");
    /* the backward keeps each row's rstd in scratch and says so when none is given */
    kt_tensor g[2] = {tu_new(KT_F32, 4, 6), tu_new(KT_F32, 6)};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_RMSNORM, NULL, in, 2, &out, 1, &out, g, NULL),
                    KT_EINVAL, "rmsnorm", "scratch");
    for (int o = 0; o < 2; o++) {
        const char *name = kt_op_name(softmaxes[o]);
        TU_EXPECT_ERROR(kt_op_forward(softmaxes[o], NULL, &xi, 1, &out, 1, NULL), KT_EINVAL,
                        name, "x", "i32");
        TU_EXPECT_ERROR(kt_op_forward(softmaxes[o], NULL, &sc, 1, &out, 1, NULL), KT_EINVAL,
                        name, "x", "dimensions");
        TU_EXPECT_ERROR(kt_op_forward(softmaxes[o], NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                        name, "1 input");
    }
    tu_free(&x), tu_free(&w), tu_free(&w7), tu_free(&wb), tu_free(&w2), tu_free(&xi);
    tu_free(&sc), tu_free(&out), tu_free(&g[0]), tu_free(&g[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),       cmocka_unit_test(test_rmsnorm_extreme_scale),
        cmocka_unit_test(test_softmax),
        cmocka_unit_test(test_softmax_stable), cmocka_unit_test(test_low_precision),
        cmocka_unit_test(test_deterministic), cmocka_unit_test(test_inplace),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
