/* cast and shift_labels: values (round to nearest even, the shift and its last position),
 * gradients against float64 finite differences (cast), the errors naming the op and the
 * argument, and both in a compiled model as an imported Hugging Face model uses them: a bf16
 * embedding table read with i64 ids and cast to f32, labels shifted into cross_entropy's
 * targets (some -100), and the index bounds a data loader reads. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kt/kt.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_util.h"

static kt_op_attrs cast_to(kt_dtype dt)
{
    kt_op_attrs a = kt_op_defaults(KT_OP_CAST);
    a.cast_dtype = dt;
    return a;
}

static kt_tensor cast_fwd(const kt_tensor *x, kt_dtype dt)
{
    const kt_op_attrs a = cast_to(dt);
    kt_tensor y;
    OK(kt_op_infer(KT_OP_CAST, &a, x, 1, &y, 1));
    assert_int_equal(y.dtype, dt);
    assert_true(kt_tensor_same_shape(&y, x));
    y = tu_alloc(y.dtype, y.ndim, y.shape);
    OK(kt_op_forward(KT_OP_CAST, &a, x, 1, &y, 1, NULL));
    return y;
}

/* Each element is the library's one-value conversion (round to nearest even), ties included. */
static void test_cast_values(void **state)
{
    (void)state;
    /* 1 + 2^-8 is halfway between two bf16 values: the even one (1.0) wins; 1 + 3 * 2^-8 goes
     * up to 1 + 2^-6; 2^-133 is a bf16 denormal; overflow goes to inf; a NaN stays one */
    const float vals[] = {1.0f + 0x1p-8f, 1.0f + 0x3p-8f, -1.0f - 0x1p-8f, 0x1p-133f, 3.4e38f,
                          65519.0f, 65520.0f, 1e-8f, -0.0f, NAN, 0.3f, 12345.678f};
    const int n = (int)(sizeof vals / sizeof vals[0]);
    kt_tensor x = tu_new(KT_F32, n);
    memcpy(x.data, vals, sizeof vals);
    kt_tensor b = cast_fwd(&x, KT_BF16), h = cast_fwd(&x, KT_F16);
    for (int i = 0; i < n; i++) {
        assert_int_equal(((uint16_t *)b.data)[i], kt_f32_to_bf16_1(vals[i]));
        assert_int_equal(((uint16_t *)h.data)[i], kt_f32_to_f16_1(vals[i]));
    }
    assert_int_equal(((uint16_t *)b.data)[0], 0x3f80); /* the tie to even */
    assert_int_equal(((uint16_t *)b.data)[1], 0x3f82);
    assert_true(isinf(tu_get(&h, 6)));                  /* 65520 rounds past f16's max */
    assert_true(isnan(tu_get(&b, 9)) && isnan(tu_get(&h, 9)));
    /* back to f32: exact; bf16 -> f16 rounds the widened value once */
    kt_tensor bf = cast_fwd(&b, KT_F32), bh = cast_fwd(&b, KT_F16);
    for (int i = 0; i < n; i++) {
        const float w = kt_bf16_to_f32_1(((uint16_t *)b.data)[i]);
        if (!isnan(w)) {
            assert_true(((float *)bf.data)[i] == w);
            assert_int_equal(((uint16_t *)bh.data)[i], kt_f32_to_f16_1(w));
        }
    }
    /* the same dtype: a copy, bit for bit */
    kt_tensor same = cast_fwd(&b, KT_BF16);
    assert_true(tu_bitwise_equal(&same, &b));
    /* in place over its input (bf16 -> f16 have the same size) */
    kt_tensor ip = tu_clone(&b);
    const kt_op_attrs a = cast_to(KT_F16);
    kt_tensor view = ip;
    view.dtype = KT_F16;
    OK(kt_op_forward(KT_OP_CAST, &a, &ip, 1, &view, 1, NULL));
    assert_memory_equal(view.data, bh.data, kt_tensor_nbytes(&bh));
    tu_free(&x), tu_free(&b), tu_free(&h), tu_free(&bf), tu_free(&bh), tu_free(&same);
    tu_free(&ip);
}

/* cast is the identity in float64; the kernel rounds to the output's dtype */
static void ref_identity(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    memcpy(out[0].d, in[0].d, (size_t)in[0].n * sizeof(double));
}

static void test_cast_gradcheck(void **state)
{
    (void)state;
    static const struct {
        kt_dtype from, to;
        double tol; /* the narrower dtype's rounding */
    } pairs[] = {{KT_F32, KT_BF16, 4e-3}, {KT_BF16, KT_F32, 4e-3}, {KT_F32, KT_F16, 5e-4},
                 {KT_F16, KT_F32, 5e-4},  {KT_F32, KT_F32, 1e-7},  {KT_BF16, KT_F16, 4e-3},
                 {KT_F16, KT_BF16, 4e-3}, {KT_BF16, KT_BF16, 4e-3}};
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++)
        for (int threads = 0; threads <= 2; threads += 2) {
            kt_tensor x32 = tu_new(KT_F32, 3, 40, 50);
            tu_fill_uniform(&x32, &rng, -3, 3);
            kt_tensor x = tu_convert(&x32, pairs[k].from);
            gc_case c = {.op = KT_OP_CAST, .attrs = cast_to(pairs[k].to), .in = &x, .n_in = 1,
                         .ref = ref_identity, .fwd_tol = pairs[k].tol,
                         .grad_tol = pairs[k].tol, .probes = 64, .threads = threads,
                         .seed = 11 + k};
            gc_check(&c);
            gc_check_thread_invariant(&c, 0, 2);
            tu_free(&x32), tu_free(&x);
        }
}

static void test_cast_errors(void **state)
{
    (void)state;
    kt_tensor ids = tu_new(KT_I64, 4), x = tu_new(KT_F32, 4), y;
    kt_op_attrs a = cast_to(KT_BF16);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CAST, &a, &ids, 1, &y, 1), KT_EINVAL, "cast", "x",
                    "f32, bf16 or f16", "i64");
    a.cast_dtype = KT_I32;
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_CAST, &a, &x, 1, &y, 1), KT_EINVAL, "cast", "dtype");
    tu_free(&ids), tu_free(&x);
}

static kt_op_attrs shift_attrs(int64_t ignore)
{
    kt_op_attrs a = kt_op_defaults(KT_OP_SHIFT_LABELS);
    a.ignore_index = ignore;
    return a;
}

static void test_shift_labels(void **state)
{
    (void)state;
    const kt_dtype dts[2] = {KT_I64, KT_I32};
    for (int d = 0; d < 2; d++)
        for (int threads = 0; threads <= 2; threads += 2) {
            kt_threadpool *pool = NULL;
            if (threads)
                OK(kt_threadpool_create(threads, &pool));
            const kt_exec ex = {pool, NULL, 0};
            const int64_t B = 3, S = 700; /* rows long enough to split over the pool */
            kt_tensor l = tu_new(dts[d], B, S), out = tu_new(dts[d], B, S);
            for (int64_t i = 0; i < B * S; i++)
                tu_set(&l, i, (double)((i * 7919) % 1000));
            tu_set(&l, 5, -100); /* an ignored label moves with the others */
            kt_op_attrs a = kt_op_defaults(KT_OP_SHIFT_LABELS);
            assert_int_equal(a.ignore_index, -100); /* the default, as transformers' */
            kt_tensor meta;
            OK(kt_op_infer(KT_OP_SHIFT_LABELS, &a, &l, 1, &meta, 1));
            assert_int_equal(meta.dtype, dts[d]);
            assert_true(kt_tensor_same_shape(&meta, &l));
            OK(kt_op_forward(KT_OP_SHIFT_LABELS, &a, &l, 1, &out, 1, &ex));
            for (int64_t b = 0; b < B; b++)
                for (int64_t t = 0; t < S; t++)
                    assert_true(tu_get(&out, b * S + t) ==
                                (t + 1 < S ? tu_get(&l, b * S + t + 1) : -100.0));
            /* in place, and another ignore_index */
            a = shift_attrs(-1);
            kt_tensor ip = tu_clone(&l);
            OK(kt_op_forward(KT_OP_SHIFT_LABELS, &a, &ip, 1, &ip, 1, &ex));
            for (int64_t i = 0; i < B * S; i++)
                assert_true(tu_get(&ip, i) == (i % S == S - 1 ? -1.0 : tu_get(&out, i)));
            tu_free(&l), tu_free(&out), tu_free(&ip);
            kt_threadpool_destroy(pool);
        }
    /* S = 1: only the ignored position; rank 1 */
    kt_tensor one = tu_new(KT_I64, 1), o1 = tu_new(KT_I64, 1);
    tu_set(&one, 0, 42);
    kt_op_attrs a = shift_attrs(-100);
    OK(kt_op_forward(KT_OP_SHIFT_LABELS, &a, &one, 1, &o1, 1, NULL));
    assert_true(tu_get(&o1, 0) == -100.0);

    /* errors name the op and the argument */
    kt_tensor f = tu_new(KT_F32, 2, 3), i32 = tu_new(KT_I32, 2, 3), s0, y;
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_SHIFT_LABELS, &a, &f, 1, &y, 1), KT_EINVAL,
                    "shift_labels", "labels", "i32 or i64");
    OK(kt_tensor_init(&s0, NULL, KT_I64, 0, NULL));
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_SHIFT_LABELS, &a, &s0, 1, &y, 1), KT_EINVAL,
                    "shift_labels", "labels", "dimension");
    a = shift_attrs((int64_t)INT32_MAX + 1);
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_SHIFT_LABELS, &a, &i32, 1, &y, 1), KT_EINVAL,
                    "shift_labels", "ignore_index", "i32");
    /* no gradient: a request is refused */
    a = shift_attrs(-100);
    kt_tensor out = tu_new(KT_I32, 2, 3), gin = tu_new(KT_I32, 2, 3), gout = out;
    gout.data = NULL;
    OK(kt_op_forward(KT_OP_SHIFT_LABELS, &a, &i32, 1, &out, 1, NULL));
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_SHIFT_LABELS, &a, &i32, 1, &out, 1, &gout, &gin, NULL),
                    KT_EINVAL, "shift_labels", "takes no gradient");
    tu_free(&one), tu_free(&o1), tu_free(&f), tu_free(&i32), tu_free(&out), tu_free(&gin);
}

/* ---- in a model --------------------------------------------------------------------------- */

#define MB 2
#define MS 5
#define MH 8
#define MV 11

static const char model[] =
    "const B = 2\n"
    "const S = 5\n"
    "const H = 8\n"
    "const V = 11\n"
    "input input_ids: i64[B, S]\n"
    "input labels: i64[B, S]\n"
    "param frozen embed: bf16[V, H] = normal(0.5)\n"
    "param head: f32[V, H] = normal(0.4)\n"
    "e = embedding(embed, input_ids)\n"
    "h = cast(e, dtype = f32)\n"
    "h = reshape(h, shape = [B * S, H])\n"
    "logits = matmul(h, head, trans_b = 1)\n"
    "t = shift_labels(labels)\n"
    "t = reshape(t, shape = [B * S])\n"
    "loss = cross_entropy(logits, t)\n"
    "output logits\n"
    "output e\n"
    "loss loss\n";

static void test_in_a_model(void **state)
{
    (void)state;
    kt_program *p = tu_compile_ktg(model, "cast.ktg", 1);
    int64_t bound = 0;
    OK(kt_program_index_bound(p, "input_ids", &bound));
    assert_int_equal(bound, MV); /* the embedding's rows */
    OK(kt_program_index_bound(p, "labels", &bound));
    assert_int_equal(bound, MV); /* through shift_labels and reshape: cross_entropy's classes */
    kt_session_options so = {.threads = 2, .seed = 3, .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s = NULL;
    OK(kt_session_create(p, &so, &s));
    kt_tensor ids, labels, embed, head, e, logits, ghead;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "input_ids", &ids));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "labels", &labels));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "embed", &embed));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "head", &head));
    assert_int_equal(ids.dtype, KT_I64);
    assert_int_equal(embed.dtype, KT_BF16);
    tu_rng rng;
    tu_rng_seed(&rng, 9);
    for (int64_t i = 0; i < MB * MS; i++) {
        tu_set(&ids, i, (double)(tu_rng_next(&rng) % MV));
        tu_set(&labels, i, i % 3 == 1 ? -100.0 : (double)(tu_rng_next(&rng) % MV));
    }
    OK(kt_session_forward(s));
    OK(kt_session_tensor(s, KT_ROLE_OUTPUT, "e", &e));
    OK(kt_session_tensor(s, KT_ROLE_OUTPUT, "logits", &logits));
    assert_int_equal(e.dtype, KT_BF16); /* embedding keeps the table's dtype */
    assert_int_equal(e.ndim, 3);
    /* the reference in float64: rows of the table, logits, the shifted mean cross-entropy */
    double loss = 0.0;
    int counted = 0;
    for (int64_t r = 0; r < MB * MS; r++) {
        const int64_t id = (int64_t)tu_get(&ids, r);
        for (int64_t k = 0; k < MH; k++)
            assert_true(tu_get(&e, r * MH + k) == tu_get(&embed, id * MH + k));
        double z[MV], zmax = -INFINITY;
        for (int64_t v = 0; v < MV; v++) {
            z[v] = 0.0;
            for (int64_t k = 0; k < MH; k++)
                z[v] += tu_get(&embed, id * MH + k) * tu_get(&head, v * MH + k);
            assert_true(fabs(z[v] - tu_get(&logits, r * MV + v)) < 1e-5);
            zmax = fmax(zmax, z[v]);
        }
        const int64_t t = r % MS;
        const double target = t + 1 < MS ? tu_get(&labels, r + 1) : -100.0;
        if (target == -100.0)
            continue;
        double se = 0.0;
        for (int64_t v = 0; v < MV; v++)
            se += exp(z[v] - zmax);
        loss += zmax + log(se) - z[(int64_t)target];
        counted++;
    }
    assert_true(counted > 0 && counted < MB * (MS - 1));
    loss /= counted;
    assert_true(fabs(kt_session_loss(s) - loss) < 1e-5 * fmax(1.0, fabs(loss)));
    OK(kt_session_backward(s));
    OK(kt_session_tensor(s, KT_ROLE_GRAD, "head", &ghead));
    double gmax = 0.0;
    for (int64_t i = 0; i < kt_tensor_numel(&ghead); i++)
        gmax = fmax(gmax, fabs(tu_get(&ghead, i)));
    assert_true(gmax > 0.0);
    kt_session_destroy(s);
    kt_program_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cast_values),  cmocka_unit_test(test_cast_gradcheck),
        cmocka_unit_test(test_cast_errors),  cmocka_unit_test(test_shift_labels),
        cmocka_unit_test(test_in_a_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
