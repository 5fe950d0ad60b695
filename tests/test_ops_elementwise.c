/* add, sub, mul (b broadcast into a), scale, silu, swiglu, sigmoid, clamp: forward against
 * float64 references, backward against finite differences, bf16/f16 against f32, broadcast
 * corner cases, determinism, and bad input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 references ----------------------------------------------------------------- */

/* The element of b that a's element i reads: b's dims aligned with a's from the end, a size-1
 * dim of b always at index 0 (numpy's broadcasting, written independently of the kernels). */
static int64_t b_index(const gc_dt *a, const gc_dt *b, int64_t i)
{
    int64_t bi = 0, stride = 1;
    for (int k = 0; k < a->ndim; k++) {
        const int da = a->ndim - 1 - k, db = b->ndim - 1 - k;
        const int64_t idx = i % a->shape[da];
        i /= a->shape[da];
        if (db >= 0) {
            if (b->shape[db] != 1)
                bi += idx * stride;
            stride *= b->shape[db];
        }
    }
    return bi;
}

static void ref_add(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = in[0].d[i] + in[1].d[b_index(&in[0], &in[1], i)];
}

static void ref_sub(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = in[0].d[i] - in[1].d[b_index(&in[0], &in[1], i)];
}

static void ref_mul(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = in[0].d[i] * in[1].d[b_index(&in[0], &in[1], i)];
}

/* 1 / (1 + e^-x) without overflow either way */
static double sigmoid64(double x) { return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }

static void ref_sigmoid(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = sigmoid64(in[0].d[i]);
}

static void ref_clamp(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    for (int64_t i = 0; i < out[0].n; i++)
        out[0].d[i] = fmin(fmax(in[0].d[i], (double)at->clamp_min), (double)at->clamp_max);
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

/* Every broadcast shape of b into a that numpy allows with b no wider than a, suffix or not:
 * per-row [T,1], a [1,H] row, middle and leading 1s, all-1 dims of any rank, a 4-d a. */
static void test_broadcast_shapes(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 21);
    const struct {
        int na, nb;
        int64_t a[4], b[4];
    } shapes[] = {
        {2, 2, {6, 33}, {6, 1}},          {2, 2, {6, 33}, {1, 33}},
        {2, 2, {6, 33}, {1, 1}},          {2, 3, {6, 33}, {1, 1, 33}},
        {2, 4, {6, 33}, {1, 1, 6, 1}},    {3, 3, {2, 5, 7}, {2, 1, 7}},
        {3, 3, {2, 5, 7}, {1, 5, 1}},     {3, 2, {2, 5, 7}, {5, 1}},
        {3, 3, {2, 5, 7}, {2, 1, 1}},     {4, 4, {2, 3, 4, 5}, {2, 1, 4, 1}},
        {4, 2, {2, 3, 4, 5}, {4, 1}},     {4, 4, {2, 3, 4, 5}, {1, 3, 1, 5}},
        {2, 2, {3, 1100}, {3, 1}},        {2, 2, {3, 1100}, {1, 1100}},
        {3, 3, {1, 4, 9}, {1, 4, 1}},     {2, 1, {5, 1}, {1}},
    };
    for (size_t o = 0; o < sizeof binaries / sizeof binaries[0]; o++)
        for (size_t v = 0; v < sizeof shapes / sizeof shapes[0]; v++) {
            kt_tensor in[2] = {tu_alloc(KT_F32, shapes[v].na, shapes[v].a),
                               tu_alloc(KT_F32, shapes[v].nb, shapes[v].b)};
            tu_fill_uniform(&in[0], &rng, -2, 2);
            tu_fill_uniform(&in[1], &rng, -2, 2);
            gc_case c = {.op = binaries[o].op, .in = in, .n_in = 2, .ref = binaries[o].ref,
                         .probes = 300, .threads = (int)(v % 3), .seed = (uint64_t)(o * 50 + v)};
            gc_check(&c);
            if (v % 4 == 0) {
                gc_check_lowp(&c, KT_BF16, 1e-2);
                gc_check_lowp(&c, KT_F16, 2e-3);
            }
            tu_free(&in[0]);
            tu_free(&in[1]);
        }
}

/* The shapes that broadcast before (b a suffix of a) keep the flat path's bits: a b with
 * leading 1s added gives the same bytes, forward and backward, as without them. */
static void test_broadcast_leading_ones_same_bits(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 22);
    kt_tensor a = tu_new(KT_F32, 64, 300), b = tu_new(KT_F32, 300), b1 = tu_new(KT_F32, 1, 300);
    kt_tensor g = tu_new(KT_F32, 64, 300);
    tu_fill_uniform(&a, &rng, -1, 1);
    tu_fill_uniform(&b, &rng, -1, 1);
    tu_fill_uniform(&g, &rng, -1, 1);
    memcpy(b1.data, b.data, 300 * sizeof(float));
    kt_threadpool *pool;
    assert_int_equal(kt_threadpool_create(2, &pool), KT_OK);
    kt_exec ex = {.pool = pool};
    for (size_t o = 0; o < sizeof binaries / sizeof binaries[0]; o++) {
        kt_tensor y0 = tu_new(KT_F32, 64, 300), y1 = tu_new(KT_F32, 64, 300);
        kt_tensor ga0 = tu_new(KT_F32, 64, 300), ga1 = tu_new(KT_F32, 64, 300);
        kt_tensor gb0 = tu_new(KT_F32, 300), gb1 = tu_new(KT_F32, 1, 300);
        kt_tensor in0[2] = {a, b}, in1[2] = {a, b1}, gi0[2] = {ga0, gb0}, gi1[2] = {ga1, gb1};
        assert_int_equal(kt_op_forward(binaries[o].op, NULL, in0, 2, &y0, 1, &ex), KT_OK);
        assert_int_equal(kt_op_forward(binaries[o].op, NULL, in1, 2, &y1, 1, &ex), KT_OK);
        assert_int_equal(kt_op_backward(binaries[o].op, NULL, in0, 2, &y0, 1, &g, gi0, &ex), KT_OK);
        assert_int_equal(kt_op_backward(binaries[o].op, NULL, in1, 2, &y1, 1, &g, gi1, &ex), KT_OK);
        assert_memory_equal(y0.data, y1.data, 64 * 300 * sizeof(float));
        assert_memory_equal(ga0.data, ga1.data, 64 * 300 * sizeof(float));
        assert_memory_equal(gb0.data, gb1.data, 300 * sizeof(float));
        tu_free(&y0), tu_free(&y1), tu_free(&ga0), tu_free(&ga1), tu_free(&gb0), tu_free(&gb1);
    }
    kt_threadpool_destroy(pool);
    tu_free(&a), tu_free(&b), tu_free(&b1), tu_free(&g);
}

/* An a with a zero dim where b has 1: nothing to compute, and b's gradient is all zeros. */
static void test_broadcast_empty(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 0, 4), b = tu_new(KT_F32, 1, 4), y = tu_new(KT_F32, 0, 4);
    kt_tensor ga = tu_new(KT_F32, 0, 4), gb = tu_new(KT_F32, 1, 4);
    kt_tensor a2 = tu_new(KT_F32, 3, 0), b2 = tu_new(KT_F32, 3, 1), y2 = tu_new(KT_F32, 3, 0);
    kt_tensor ga2 = tu_new(KT_F32, 3, 0), gb2 = tu_new(KT_F32, 3, 1);
    for (size_t o = 0; o < sizeof binaries / sizeof binaries[0]; o++) {
        for (int64_t i = 0; i < 4; i++)
            tu_set(&gb, i, 9.0);
        for (int64_t i = 0; i < 3; i++)
            tu_set(&gb2, i, 9.0);
        kt_tensor in[2] = {a, b}, gi[2] = {ga, gb}, in2[2] = {a2, b2}, gi2[2] = {ga2, gb2};
        assert_int_equal(kt_op_forward(binaries[o].op, NULL, in, 2, &y, 1, NULL), KT_OK);
        assert_int_equal(kt_op_backward(binaries[o].op, NULL, in, 2, &y, 1, &y, gi, NULL), KT_OK);
        assert_int_equal(kt_op_forward(binaries[o].op, NULL, in2, 2, &y2, 1, NULL), KT_OK);
        assert_int_equal(kt_op_backward(binaries[o].op, NULL, in2, 2, &y2, 1, &y2, gi2, NULL),
                         KT_OK);
        for (int64_t i = 0; i < 4; i++)
            assert_true(tu_get(&gb, i) == 0.0);
        for (int64_t i = 0; i < 3; i++)
            assert_true(tu_get(&gb2, i) == 0.0);
    }
    tu_free(&a), tu_free(&b), tu_free(&y), tu_free(&ga), tu_free(&gb);
    tu_free(&a2), tu_free(&b2), tu_free(&y2), tu_free(&ga2), tu_free(&gb2);
}

/* sigmoid at |x| up to 100 (exp(100) overflows f32): finite, exact at the ends, and the
 * gradient y (1 - y) from the output; clamp's bounds and its gradient's mask. */
static void test_sigmoid_clamp(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 23);
    kt_tensor x = tu_new(KT_F32, 7, 61);
    tu_fill_uniform(&x, &rng, -12, 12);
    gc_case s = {.op = KT_OP_SIGMOID, .in = &x, .n_in = 1, .ref = ref_sigmoid, .seed = 24};
    gc_check(&s);
    s.threads = 2;
    gc_check(&s);
    /* low precision where rounding x moves y by about as much as rounding y (|x| <= 4) */
    kt_tensor xl = tu_new(KT_F32, 7, 61);
    tu_fill_uniform(&xl, &rng, -4, 4);
    gc_case sl = {.op = KT_OP_SIGMOID, .in = &xl, .n_in = 1, .seed = 24};
    gc_check_lowp(&sl, KT_BF16, 1e-2);
    gc_check_lowp(&sl, KT_F16, 2e-3);
    tu_free(&xl);
    kt_tensor big = tu_new(KT_F32, 6), y = tu_new(KT_F32, 6);
    const double xs[6] = {-100, -88, -30, 30, 88, 100};
    for (int i = 0; i < 6; i++)
        tu_set(&big, i, xs[i]);
    assert_int_equal(kt_op_forward(KT_OP_SIGMOID, NULL, &big, 1, &y, 1, NULL), KT_OK);
    for (int i = 0; i < 6; i++) {
        const double got = tu_get(&y, i), want = sigmoid64(xs[i]);
        assert_true(isfinite(got));
        assert_true(fabs(got - want) <= 1e-6 * want + 1e-45);
    }
    assert_true(tu_get(&y, 0) > 0.0); /* e^-100 is 3.7e-44, a denormal, not 0 */
    assert_true(tu_get(&y, 5) == 1.0);

    /* clamp: the probes stay away from the bounds, where the derivative jumps */
    kt_tensor c = tu_new(KT_F32, 5, 40);
    for (int64_t i = 0; i < 200; i++) {
        double v = tu_rng_uniform(&rng, -3, 3);
        if (fabs(fabs(v) - 1.5) < 0.01)
            v += 0.05;
        tu_set(&c, i, v);
    }
    gc_case cl = {.op = KT_OP_CLAMP, .attrs = TU_ATTRS(KT_OP_CLAMP, .clamp_min = -1.5f, .clamp_max = 1.5f),
                  .in = &c, .n_in = 1, .ref = ref_clamp, .seed = 25};
    gc_check(&cl);
    gc_check_lowp(&cl, KT_BF16, 1e-2);
    /* the defaults bound nothing; a bound itself passes the gradient; NaN stays NaN */
    kt_tensor e = tu_new(KT_F32, 4), ey = tu_new(KT_F32, 4), eg = tu_new(KT_F32, 4),
              egx = tu_new(KT_F32, 4);
    const double es[4] = {-1.5, 1.5, 3e38, NAN};
    for (int i = 0; i < 4; i++)
        tu_set(&e, i, es[i]), tu_set(&eg, i, 1.0);
    assert_int_equal(kt_op_forward(KT_OP_CLAMP, NULL, &e, 1, &ey, 1, NULL), KT_OK);
    assert_true(tu_get(&ey, 2) == (double)3e38f);
    kt_op_attrs ca = TU_ATTRS(KT_OP_CLAMP, .clamp_min = -1.5f, .clamp_max = 1.5f);
    assert_int_equal(kt_op_forward(KT_OP_CLAMP, &ca, &e, 1, &ey, 1, NULL), KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_CLAMP, &ca, &e, 1, &ey, 1, &eg, &egx, NULL), KT_OK);
    assert_true(tu_get(&ey, 2) == 1.5 && isnan(tu_get(&ey, 3)));
    assert_true(tu_get(&egx, 0) == 1.0 && tu_get(&egx, 1) == 1.0 && tu_get(&egx, 2) == 0.0);
    tu_free(&x), tu_free(&big), tu_free(&y), tu_free(&c), tu_free(&e), tu_free(&ey);
    tu_free(&eg), tu_free(&egx);
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

/* The strided reduction of b's gradient ([T,1] per row; [1,H] over rows; middle 1s), with 2
 * and 3 threads, and across thread counts: its order is fixed. */
static void test_broadcast_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 26);
    const int64_t bs[3][3] = {{512, 1, 1}, {1, 1, 96}, {8, 1, 96}};
    for (int v = 0; v < 3; v++) {
        kt_tensor in[2] = {tu_new(KT_F32, 8, 64, 96), tu_alloc(KT_F32, 3, bs[v])};
        if (v == 0)
            in[0] = (tu_free(&in[0]), tu_new(KT_F32, 512, 64, 96));
        tu_fill_uniform(&in[0], &rng, -1, 1);
        tu_fill_uniform(&in[1], &rng, -1, 1);
        gc_case c = {.op = KT_OP_MUL, .in = in, .n_in = 2, .seed = 27};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        gc_check_thread_invariant(&c, 0, 3);
        tu_free(&in[0]);
        tu_free(&in[1]);
    }
}

static void test_bad_input(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 4, 5), b = tu_new(KT_F32, 5, 4), bi = tu_new(KT_I32, 4, 5);
    kt_tensor bf = tu_new(KT_BF16, 4, 5), out = tu_new(KT_F32, 4, 5);
    kt_tensor in[2] = {a, b};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_ADD, NULL, in, 2, &out, 1, NULL), KT_EINVAL, "add", "b",
                    "f32[5,4]", "does not broadcast into a f32[4,5]");
    /* b wider than a, or a dim of b neither 1 nor a's */
    kt_tensor wide = tu_new(KT_F32, 2, 4, 5), one_off = tu_new(KT_F32, 2, 5);
    in[1] = wide;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL, "mul",
                    "b f32[2,4,5]", "does not broadcast");
    in[1] = one_off;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SUB, NULL, in, 2, &out, 1, NULL), KT_EINVAL, "sub",
                    "b f32[2,5]", "1 or a's");
    tu_free(&wide), tu_free(&one_off);
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
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_SIGMOID, NULL, &bi, 1, &out, 1, NULL), KT_EINVAL,
                    "sigmoid", "x", "i32");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CLAMP, NULL, &bi, 1, &out, 1, NULL), KT_EINVAL, "clamp",
                    "x", "i32");
    kt_op_attrs inverted = TU_ATTRS(KT_OP_CLAMP, .clamp_min = 2.0f, .clamp_max = 1.0f);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_CLAMP, &inverted, &a, 1, &out, 1, NULL), KT_EINVAL,
                    "clamp", "min 2 is above max 1");
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
        cmocka_unit_test(test_broadcast_shapes), cmocka_unit_test(test_broadcast_leading_ones_same_bits),
        cmocka_unit_test(test_broadcast_empty), cmocka_unit_test(test_sigmoid_clamp),
        cmocka_unit_test(test_broadcast_deterministic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
