/* add, sub, mul, scale, silu, swiglu: forward against float64 references, backward against
 * finite differences, bf16/f16 against f32, determinism, and bad input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 references ----------------------------------------------------------------- */

/* binary ops broadcast b over a's leading dims: b repeats every b.n elements */
static void ref_add(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = in[0].d[i] + in[1].d[i % in[1].n];
}

static void ref_sub(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = in[0].d[i] - in[1].d[i % in[1].n];
}

static void ref_mul(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = in[0].d[i] * in[1].d[i % in[1].n];
}

static void ref_scale(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = (double)at->alpha * in[0].d[i];
}

static double silu64(double x) { return x / (1.0 + exp(-x)); }

static void ref_silu(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = silu64(in[0].d[i]);
}

static void ref_swiglu(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                       int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = silu64(in[0].d[i]) * in[1].d[i];
}

/* ---- cases ---------------------------------------------------------------------------------- */

typedef struct binary_case {
    kt_op op;
    gc_ref_fn ref;
} binary_case;

static const binary_case binaries[] = {
    {KT_OP_ADD, ref_add}, {KT_OP_SUB, ref_sub}, {KT_OP_MUL, ref_mul}};

/* Same shapes, a row-vector broadcast and a scalar broadcast, each with 1 and 2 threads. */
static void test_binary_ops(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    const int64_t b_shapes[3][2] = {{7, 33}, {33, 0}, {0, 0}};
    const int b_ndims[3] = {2, 1, 0};
    for (size_t o = 0; o < sizeof binaries / sizeof binaries[0]; o++) {
        for (int v = 0; v < 3; v++) {
            kt_tensor in[2] = {tu_new(KT_F32, 7, 33), tu_alloc(KT_F32, b_ndims[v], b_shapes[v])};
            tu_fill_uniform(&in[0], &rng, -2, 2);
            tu_fill_uniform(&in[1], &rng, -2, 2);
            for (int threads = 0; threads <= 2; threads += 2) {
                gc_case c = {.op = binaries[o].op, .in = in, .n_in = 2, .ref = binaries[o].ref,
                             .threads = threads, .seed = (uint64_t)(o * 10 + v)};
                gc_check(&c);
            }
            tu_free(&in[0]);
            tu_free(&in[1]);
        }
    }
}

static void test_unary_ops(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    kt_tensor x = tu_new(KT_F32, 3, 5, 41);
    tu_fill_uniform(&x, &rng, -6, 6);
    gc_case scale = {.op = KT_OP_SCALE,
                     .attrs = TU_ATTRS(KT_OP_SCALE, .alpha = -1.75f),
                     .in = &x,
                     .n_in = 1,
                     .ref = ref_scale,
                     .seed = 3};
    gc_check(&scale);
    gc_case silu = {.op = KT_OP_SILU, .in = &x, .n_in = 1, .ref = ref_silu, .seed = 4};
    gc_check(&silu);
    silu.threads = 2;
    gc_check(&silu);
    tu_free(&x);
}

static void test_swiglu(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    kt_tensor in[2] = {tu_new(KT_F32, 9, 70), tu_new(KT_F32, 9, 70)};
    tu_fill_uniform(&in[0], &rng, -5, 5);
    tu_fill_uniform(&in[1], &rng, -2, 2);
    gc_case c = {.op = KT_OP_SWIGLU, .in = in, .n_in = 2, .ref = ref_swiglu, .seed = 6};
    gc_check(&c);
    c.threads = 2;
    gc_check(&c);
    tu_free(&in[0]);
    tu_free(&in[1]);
}

/* bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 2e-3 per value); f16 keeps 11. A
 * couple of roundings (inputs, output) bound the error by ~1e-2 and ~2e-3 of the scale. */
static void test_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    kt_tensor in[2] = {tu_new(KT_F32, 4, 300), tu_new(KT_F32, 4, 300)};
    tu_fill_uniform(&in[0], &rng, -3, 3);
    tu_fill_uniform(&in[1], &rng, -3, 3);
    const kt_op ops[] = {KT_OP_ADD, KT_OP_SUB, KT_OP_MUL, KT_OP_SWIGLU};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        gc_case c = {.op = ops[i], .in = in, .n_in = 2, .seed = 8};
        gc_check_lowp(&c, KT_BF16, 1e-2);
        gc_check_lowp(&c, KT_F16, 2e-3);
    }
    gc_case s = {.op = KT_OP_SILU, .in = in, .n_in = 1, .seed = 9};
    gc_check_lowp(&s, KT_BF16, 1e-2);
    gc_check_lowp(&s, KT_F16, 2e-3);
    tu_free(&in[0]);
    tu_free(&in[1]);
}

static void test_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 10);
    /* large enough to be split over threads, with a broadcast b reduced in backward */
    kt_tensor in[2] = {tu_new(KT_F32, 512, 96), tu_new(KT_F32, 96)};
    tu_fill_uniform(&in[0], &rng, -1, 1);
    tu_fill_uniform(&in[1], &rng, -1, 1);
    gc_case c = {.op = KT_OP_MUL, .in = in, .n_in = 2, .seed = 11};
    gc_check_deterministic(&c, 2);
    gc_check_deterministic(&c, 3);
    tu_free(&in[0]);
    tu_free(&in[1]);
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 4, 5), b = tu_new(KT_F32, 5, 4), bi = tu_new(KT_I32, 4, 5);
    kt_tensor bf = tu_new(KT_BF16, 4, 5), out = tu_new(KT_F32, 4, 5);
    kt_tensor in[2] = {a, b};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ADD, NULL, in, 2, &out, 1, NULL), KT_EINVAL, "add", "b",
                    "f32[5,4]", "does not broadcast into a f32[4,5]");
    in[1] = bi;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL, "mul", "b",
                    "i32");
    in[1] = bf;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUB, NULL, in, 2, &out, 1, NULL), KT_EINVAL, "sub", "b",
                    "bf16");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SWIGLU, NULL, in, 1, &out, 1, NULL), KT_EINVAL,
                    "swiglu", "2 inputs");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SILU, NULL, &bi, 1, &out, 1, NULL), KT_EINVAL, "silu",
                    "x", "i32");
    /* the output must have the inferred shape */
    kt_tensor wrong = tu_new(KT_F32, 5, 4);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SILU, NULL, &a, 1, &wrong, 1, NULL), KT_EINVAL, "silu",
                    "output 0", "f32[4,5]", "f32[5,4]");
    /* a gradient of the wrong shape */
    kt_tensor g[2] = {wrong, {0}};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_SILU, NULL, &a, 1, &out, 1, &out, g, NULL), KT_EINVAL,
                    "silu", "input gradient 0");
    /* a view that is not contiguous */
    kt_tensor tr;
    assert_int_equal(kt_tensor_transpose(&a, 0, 1, &tr), KT_OK);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SILU, NULL, &tr, 1, &wrong, 1, NULL), KT_EINVAL,
                    "contiguous");
    tu_free(&a), tu_free(&b), tu_free(&bi), tu_free(&bf), tu_free(&out), tu_free(&wrong);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_binary_ops),     cmocka_unit_test(test_unary_ops),
        cmocka_unit_test(test_swiglu),         cmocka_unit_test(test_low_precision),
        cmocka_unit_test(test_deterministic),  cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
