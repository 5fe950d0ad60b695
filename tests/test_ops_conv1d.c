/* conv1d: causal, same and valid modes, full and depthwise, with and without a batch dim,
 * kernel sizes 1..5: forward against a float64 reference, backward against finite
 * differences, bf16/f16 against f32, determinism, and bad input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 reference -------------------------------------------------------------------- */

/* y[b,t,o] = sum_j sum_c w[o,j,c] x[b, t + j - left, c], x zero outside [0,T), with the
 * left padding each mode implies; depthwise: w[c,j] x[b, t + j - left, c]. */
static void ref_conv1d(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                       int n_out)
{
    (void)n_in, (void)n_out;
    const gc_dt *x = &in[0], *w = &in[1];
    const int64_t B = x->ndim == 3 ? x->shape[0] : 1;
    const int64_t T = x->shape[x->ndim - 2], C = x->shape[x->ndim - 1];
    const int64_t K = w->shape[1];
    const int64_t Cout = at->depthwise ? C : w->shape[0];
    int64_t left = 0, Tout = T;
    if (at->conv_mode == KT_CONV_CAUSAL)
        left = K - 1;
    else if (at->conv_mode == KT_CONV_SAME)
        left = K / 2;
    else
        Tout = T - K + 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < Tout; t++)
            for (int64_t o = 0; o < Cout; o++) {
                double s = 0.0;
                for (int64_t j = 0; j < K; j++) {
                    int64_t src = t + j - left;
                    if (src < 0 || src >= T)
                        continue;
                    const double *xr = x->d + (b * T + src) * C;
                    if (at->depthwise) {
                        s += w->d[o * K + j] * xr[o];
                    } else {
                        for (int64_t c = 0; c < C; c++)
                            s += w->d[(o * K + j) * C + c] * xr[c];
                    }
                }
                out[0].d[(b * Tout + t) * Cout + o] = s;
            }
}

typedef struct conv_shape {
    int64_t B; /* 0: no batch dim */
    int64_t T, Cin, Cout, K;
    int depthwise;
    kt_conv_mode mode;
} conv_shape;

/* x and w for a shape, random in [-1, 1) */
static void make_inputs(kt_tensor in[2], const conv_shape *s, tu_rng *rng)
{
    in[0] = s->B ? tu_new(KT_F32, s->B, s->T, s->Cin) : tu_new(KT_F32, s->T, s->Cin);
    in[1] = s->depthwise ? tu_new(KT_F32, s->Cin, s->K) : tu_new(KT_F32, s->Cout, s->K, s->Cin);
    tu_fill_uniform(&in[0], rng, -1, 1);
    tu_fill_uniform(&in[1], rng, -1, 1);
}

static const kt_conv_mode modes[3] = {KT_CONV_CAUSAL, KT_CONV_SAME, KT_CONV_VALID};

/* every mode x kernel size 1..5 x full/depthwise x batch or not, with 0 and 2 threads */
static void test_conv1d_gradcheck(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 201);
    uint64_t seed = 1;
    for (int m = 0; m < 3; m++)
        for (int64_t K = 1; K <= 5; K++)
            for (int dw = 0; dw <= 1; dw++)
                for (int64_t B = 0; B <= 2; B += 2) {
                    conv_shape s = {.B = B, .T = 7, .Cin = 3, .Cout = 4, .K = K,
                                    .depthwise = dw, .mode = modes[m]};
                    kt_tensor in[2];
                    make_inputs(in, &s, &rng);
                    for (int threads = 0; threads <= 2; threads += 2) {
                        gc_case c = {
                            .op = KT_OP_CONV1D,
                            .attrs = TU_ATTRS(KT_OP_CONV1D, .depthwise = dw, .conv_mode = modes[m]),
                            .in = in,
                            .n_in = 2,
                            .ref = ref_conv1d,
                            .threads = threads,
                            .seed = seed++};
                        gc_check(&c);
                    }
                    tu_free(&in[0]);
                    tu_free(&in[1]);
                }
}

/* Edges: one time step, T equal to K in valid mode (one output), a kernel longer than the
 * sequence, and channel counts that span several GEMM tiles. */
static void test_conv1d_shapes(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 202);
    const conv_shape shapes[] = {
        {0, 1, 5, 3, 5, 0, KT_CONV_CAUSAL}, {2, 1, 5, 3, 4, 1, KT_CONV_SAME},
        {0, 5, 2, 7, 5, 0, KT_CONV_VALID},  {3, 4, 6, 6, 4, 1, KT_CONV_VALID},
        {0, 3, 4, 2, 5, 0, KT_CONV_SAME},   {2, 130, 33, 65, 3, 0, KT_CONV_CAUSAL},
        {2, 65, 130, 0, 4, 1, KT_CONV_SAME}, {1, 33, 7, 1, 2, 0, KT_CONV_VALID},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        kt_tensor in[2];
        make_inputs(in, &shapes[i], &rng);
        gc_case c = {.op = KT_OP_CONV1D,
                     .attrs = TU_ATTRS(KT_OP_CONV1D, .depthwise = shapes[i].depthwise,
                                       .conv_mode = shapes[i].mode),
                     .in = in,
                     .n_in = 2,
                     .ref = ref_conv1d,
                     .probes = 40,
                     .threads = 2,
                     .seed = 50 + i};
        gc_check(&c);
        tu_free(&in[0]);
        tu_free(&in[1]);
    }
}

/* bf16 keeps 8 significant bits (u = 2^-9), f16 11 (u = 2^-12). x and w are rounded once,
 * the products summed in f32 (K * Cin terms of random sign), the result rounded again, so
 * the error stays within a few u of each tensor's scale; 1e-2 and 2e-3 leave ~3x margin.
 * The weight gradient sums over B * T' products the same way. */
static void test_conv1d_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 203);
    const conv_shape shapes[] = {{2, 40, 12, 9, 4, 0, KT_CONV_CAUSAL},
                                 {2, 40, 24, 0, 3, 1, KT_CONV_SAME},
                                 {0, 30, 8, 5, 5, 0, KT_CONV_VALID}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        kt_tensor in[2];
        make_inputs(in, &shapes[i], &rng);
        gc_case c = {.op = KT_OP_CONV1D,
                     .attrs = TU_ATTRS(KT_OP_CONV1D, .depthwise = shapes[i].depthwise,
                                       .conv_mode = shapes[i].mode),
                     .in = in,
                     .n_in = 2,
                     .threads = 2,
                     .seed = 60 + i};
        gc_check_lowp(&c, KT_BF16, 1e-2);
        gc_check_lowp(&c, KT_F16, 2e-3);
        tu_free(&in[0]);
        tu_free(&in[1]);
    }
}

static void test_conv1d_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 204);
    const conv_shape shapes[] = {{3, 200, 40, 48, 4, 0, KT_CONV_CAUSAL},
                                 {3, 200, 64, 0, 4, 1, KT_CONV_SAME}};
    for (size_t i = 0; i < 2; i++) {
        kt_tensor in[2];
        make_inputs(in, &shapes[i], &rng);
        gc_case c = {.op = KT_OP_CONV1D,
                     .attrs = TU_ATTRS(KT_OP_CONV1D, .depthwise = shapes[i].depthwise,
                                       .conv_mode = shapes[i].mode),
                     .in = in,
                     .n_in = 2,
                     .seed = 70 + i};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        tu_free(&in[0]);
        tu_free(&in[1]);
    }
}

static void test_conv1d_flops(void **state)
{
    (void)state;
    kt_tensor in[2] = {tu_new(KT_F32, 2, 10, 3), tu_new(KT_F32, 4, 3, 3)};
    kt_op_attrs at = TU_ATTRS(KT_OP_CONV1D, .conv_mode = KT_CONV_VALID);
    assert_true(kt_op_flops(KT_OP_CONV1D, &at, in, 2) == 2.0 * 2 * 8 * 4 * 3 * 3);
    assert_int_equal(kt_op_scratch_bytes(KT_OP_CONV1D, &at, in, 2, 0), 0);
    assert_int_equal(kt_op_scratch_bytes(KT_OP_CONV1D, &at, in, 2, 1), 0);
    tu_free(&in[0]), tu_free(&in[1]);
}

/* ---- bad input ------------------------------------------------------------------------------ */

static void test_conv1d_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 2, 6, 4), w = tu_new(KT_F32, 5, 3, 4);
    kt_tensor y = tu_new(KT_F32, 2, 6, 5);
    kt_tensor in[2] = {x, w};
    assert_int_equal(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_OK);

    kt_tensor x1 = tu_new(KT_F32, 6), x4 = tu_new(KT_F32, 1, 2, 6, 4);
    in[0] = x1;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "x", "2 to 3 dimensions");
    in[0] = x4;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "x", "f32[1,2,6,4]");
    /* full weights: rank 3, channels matching x */
    kt_tensor w2 = tu_new(KT_F32, 4, 3), wc = tu_new(KT_F32, 5, 3, 3), w0 = tu_new(KT_F32, 5, 0, 4);
    in[0] = x, in[1] = w2;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "w", "3 dimensions");
    in[1] = wc;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "w dimension 2 must be 4", "f32[5,3,3]");
    in[1] = w0;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "w", "kernel size");
    /* depthwise weights: [C,K] with C = x's channels */
    kt_op_attrs dwa = TU_ATTRS(KT_OP_CONV1D, .depthwise = 1);
    kt_tensor wd_bad = tu_new(KT_F32, 5, 3);
    in[1] = wd_bad;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, &dwa, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "w (depthwise)", "dimension 0 must be 4", "f32[5,3]");
    in[1] = w;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, &dwa, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "w (depthwise", "2 dimensions");
    /* valid mode needs T >= K */
    kt_tensor xs = tu_new(KT_F32, 2, 2, 4);
    kt_op_attrs va = TU_ATTRS(KT_OP_CONV1D, .conv_mode = KT_CONV_VALID);
    in[0] = xs, in[1] = w;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, &va, in, 2, &y, 1, NULL), KT_EINVAL, "conv1d",
                    "x", "2 time steps", "kernel size 3", "valid");
    kt_op_attrs bad_mode = TU_ATTRS(KT_OP_CONV1D, .conv_mode = (kt_conv_mode)7);
    in[0] = x;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, &bad_mode, in, 2, &y, 1, NULL), KT_EINVAL,
                    "conv1d", "conv_mode");
    /* dtypes: one float dtype for both, no integers */
    kt_tensor wbf = tu_convert(&w, KT_BF16), xi = tu_new(KT_I32, 2, 6, 4);
    in[1] = wbf;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL, "conv1d",
                    "w", "f32", "bf16");
    in[0] = xi, in[1] = w;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &y, 1, NULL), KT_EINVAL, "conv1d",
                    "x", "i32");
    /* the output must have the inferred shape */
    kt_tensor ywrong = tu_new(KT_F32, 2, 6, 4);
    in[0] = x;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, in, 2, &ywrong, 1, NULL), KT_EINVAL,
                    "conv1d", "output 0", "f32[2,6,5]");
    /* bf16 stages through scratch: too little is refused, forward and backward */
    kt_tensor lp[2] = {tu_convert(&x, KT_BF16), wbf}, ylp = tu_new(KT_BF16, 2, 6, 5);
    size_t need = kt_op_scratch_bytes(KT_OP_CONV1D, NULL, lp, 2, 0);
    assert_true(need > 0);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, lp, 2, &ylp, 1, NULL), KT_EINVAL,
                    "conv1d", "scratch");
    void *scratch = NULL;
    assert_int_equal(posix_memalign(&scratch, 64, need), 0);
    kt_exec ex = {.scratch = scratch, .scratch_bytes = need / 2};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CONV1D, NULL, lp, 2, &ylp, 1, &ex), KT_EINVAL,
                    "conv1d", "scratch");
    ex.scratch_bytes = need;
    assert_int_equal(kt_op_forward(KT_OP_CONV1D, NULL, lp, 2, &ylp, 1, &ex), KT_OK);
    kt_tensor glp[2] = {tu_new(KT_BF16, 2, 6, 4), tu_new(KT_BF16, 5, 3, 4)};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_CONV1D, NULL, lp, 2, &ylp, 1, &ylp, glp, &ex),
                    KT_EINVAL, "conv1d", "scratch");
    free(scratch);
    tu_free(&x), tu_free(&w), tu_free(&y), tu_free(&x1), tu_free(&x4), tu_free(&w2);
    tu_free(&wc), tu_free(&w0), tu_free(&wd_bad), tu_free(&xs), tu_free(&wbf), tu_free(&xi);
    tu_free(&ywrong), tu_free(&lp[0]), tu_free(&ylp), tu_free(&glp[0]), tu_free(&glp[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv1d_gradcheck),    cmocka_unit_test(test_conv1d_shapes),
        cmocka_unit_test(test_conv1d_low_precision), cmocka_unit_test(test_conv1d_deterministic),
        cmocka_unit_test(test_conv1d_flops),        cmocka_unit_test(test_conv1d_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
