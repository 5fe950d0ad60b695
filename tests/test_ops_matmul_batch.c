/* matmul with leading batch dims: forward against a float64 reference and backward against
 * finite differences for every transpose pair and broadcast pattern (a batched, b plain; both
 * batched; a plain, b batched; 1s broadcasting either way; 4-d), bf16/f16 against f32, each
 * item bitwise the 2-D product of its matrices, determinism and thread invariance (items
 * shared over the pool or run one by one give the same bits), empty batches, flops. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

/* ---- float64 reference -------------------------------------------------------------------- */

/* t's batch dim k of 2, padded with 1s in front */
static int64_t bdim(const gc_dt *t, int k)
{
    const int nb = t->ndim - 2, from_end = 1 - k;
    return from_end < nb ? t->shape[nb - 1 - from_end] : 1;
}

static void ref_bmm(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    const gc_dt *a = &in[0], *b = &in[1];
    const int na = a->ndim, nb = b->ndim;
    const int64_t M = at->trans_a ? a->shape[na - 1] : a->shape[na - 2];
    const int64_t K = at->trans_a ? a->shape[na - 2] : a->shape[na - 1];
    const int64_t N = at->trans_b ? b->shape[nb - 2] : b->shape[nb - 1];
    int64_t ob[2];
    for (int k = 0; k < 2; k++)
        ob[k] = bdim(a, k) == 1 ? bdim(b, k) : bdim(a, k);
    for (int64_t o0 = 0; o0 < ob[0]; o0++)
        for (int64_t o1 = 0; o1 < ob[1]; o1++) {
            const int64_t ai = (bdim(a, 0) == 1 ? 0 : o0) * bdim(a, 1) + (bdim(a, 1) == 1 ? 0 : o1);
            const int64_t bi = (bdim(b, 0) == 1 ? 0 : o0) * bdim(b, 1) + (bdim(b, 1) == 1 ? 0 : o1);
            const double *A = a->d + ai * M * K, *B = b->d + bi * K * N;
            double *C = out[0].d + (o0 * ob[1] + o1) * M * N;
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) {
                    double s = 0.0;
                    for (int64_t k = 0; k < K; k++)
                        s += (at->trans_a ? A[k * M + i] : A[i * K + k]) *
                             (at->trans_b ? B[j * K + k] : B[k * N + j]);
                    C[i * N + j] = s;
                }
        }
}

/* ---- cases -------------------------------------------------------------------------------- */

typedef struct batch_shape {
    int na, nb;        /* batch ranks */
    int64_t ab[2], bb[2]; /* batch dims */
} batch_shape;

static const batch_shape patterns[] = {
    {1, 0, {3}, {0}},       /* a batched, b one matrix (flat unless trans_a) */
    {1, 1, {3}, {3}},       /* both batched */
    {0, 1, {0}, {3}},       /* a one matrix, b batched */
    {2, 1, {2, 3}, {3}},    /* 4-d a, 3-d b */
    {2, 2, {2, 1}, {1, 3}}, /* 1s broadcasting both ways: 6 items */
    {1, 1, {1}, {4}},       /* a's leading 1 */
    {2, 2, {2, 3}, {1, 1}}, /* b's batch all 1 (flat unless trans_a) */
    {0, 2, {0}, {2, 3}},    /* a one matrix, 4-d b */
    {2, 0, {1, 1}, {0}},    /* all-1 batch dims */
};
enum { N_PATTERNS = sizeof patterns / sizeof patterns[0] };

static kt_tensor operand(int nbatch, const int64_t *batch, int64_t r, int64_t c, tu_rng *rng)
{
    int64_t shape[4];
    for (int k = 0; k < nbatch; k++)
        shape[k] = batch[k];
    shape[nbatch] = r, shape[nbatch + 1] = c;
    kt_tensor t = tu_alloc(KT_F32, nbatch + 2, shape);
    tu_fill_uniform(&t, rng, -1, 1);
    return t;
}

static void make_batch(kt_tensor in[2], const batch_shape *p, int64_t M, int64_t K, int64_t N,
                       int ta, int tb, tu_rng *rng)
{
    in[0] = ta ? operand(p->na, p->ab, K, M, rng) : operand(p->na, p->ab, M, K, rng);
    in[1] = tb ? operand(p->nb, p->bb, N, K, rng) : operand(p->nb, p->bb, K, N, rng);
}

static void test_batch_gradcheck(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 201);
    uint64_t seed = 1;
    for (int p = 0; p < N_PATTERNS; p++)
        for (int ta = 0; ta <= 1; ta++)
            for (int tb = 0; tb <= 1; tb++) {
                kt_tensor in[2];
                make_batch(in, &patterns[p], 5, 7, 6, ta, tb, &rng);
                for (int threads = 0; threads <= 2; threads += 2) {
                    gc_case c = {.op = KT_OP_MATMUL,
                                 .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = ta, .trans_b = tb),
                                 .in = in, .n_in = 2, .ref = ref_bmm, .threads = threads,
                                 .seed = seed++};
                    gc_check(&c);
                }
                tu_free(&in[0]), tu_free(&in[1]);
            }
}

/* Items past the kernels' tiles, sampled */
static void test_batch_gradcheck_large(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 202);
    const int picks[3] = {1, 3, 4};
    for (int i = 0; i < 3; i++)
        for (int t = 0; t < 4; t++) {
            kt_tensor in[2];
            make_batch(in, &patterns[picks[i]], 33, 65, 40, t & 1, t >> 1, &rng);
            gc_case c = {.op = KT_OP_MATMUL,
                         .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = t & 1, .trans_b = t >> 1),
                         .in = in, .n_in = 2, .ref = ref_bmm, .probes = 40, .threads = 2,
                         .seed = 100u + (unsigned)(i * 4 + t)};
            gc_check(&c);
            tu_free(&in[0]), tu_free(&in[1]);
        }
}

/* bounds as test_ops_matmul's low-precision case */
static void test_batch_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 203);
    for (int p = 0; p < N_PATTERNS; p++)
        for (int t = 0; t < 4; t++) {
            kt_tensor in[2];
            make_batch(in, &patterns[p], 13, 40, 11, t & 1, t >> 1, &rng);
            gc_case c = {.op = KT_OP_MATMUL,
                         .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = t & 1, .trans_b = t >> 1),
                         .in = in, .n_in = 2, .threads = p % 2 * 2, .seed = 50u + (unsigned)t};
            gc_check_lowp(&c, KT_BF16, 1e-2);
            gc_check_lowp(&c, KT_F16, 2e-3);
            tu_free(&in[0]), tu_free(&in[1]);
        }
}

/* Each item's output is bitwise the 2-D op on that item's matrices (one kernel call an item,
 * each with its own part of the work), whether the items are shared over the pool or not; the
 * same for bf16. */
static void test_batch_items_are_2d_products(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 204);
    kt_threadpool *pool;
    assert_int_equal(kt_threadpool_create(3, &pool), KT_OK);
    const kt_dtype dts[2] = {KT_F32, KT_BF16};
    for (int di = 0; di < 2; di++)
        for (int t = 0; t < 8; t++) { /* M 70: bf16 items on the dense matmul's MM path */
            const int ta = t & 1, tb = (t >> 1) & 1;
            const int64_t B = 5, M = t < 4 ? 9 : 70, K = 20, N = 70;
            kt_tensor f[2];
            f[0] = ta ? tu_new(KT_F32, B, K, M) : tu_new(KT_F32, B, M, K);
            f[1] = tb ? tu_new(KT_F32, B, N, K) : tu_new(KT_F32, B, K, N);
            tu_fill_uniform(&f[0], &rng, -1, 1);
            tu_fill_uniform(&f[1], &rng, -1, 1);
            kt_tensor in[2] = {tu_convert(&f[0], dts[di]), tu_convert(&f[1], dts[di])};
            const kt_op_attrs at = TU_ATTRS(KT_OP_MATMUL, .trans_a = ta, .trans_b = tb);
            kt_tensor y = tu_alloc(dts[di], 3, (const int64_t[]){B, M, N});
            kt_exec ex = {.pool = pool, .scratch_bytes = kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 0)};
            if (ex.scratch_bytes)
                assert_int_equal(posix_memalign(&ex.scratch, 64, ex.scratch_bytes), 0);
            assert_int_equal(kt_op_forward(KT_OP_MATMUL, &at, in, 2, &y, 1, &ex), KT_OK);
            free(ex.scratch);
            const size_t es = kt_dtype_size(dts[di]);
            for (int64_t i = 0; i < B; i++) {
                kt_tensor a1, b1, y1 = tu_alloc(dts[di], 2, (const int64_t[]){M, N});
                assert_int_equal(kt_tensor_init(&a1, (char *)in[0].data + i * M * K * es, dts[di], 2,
                                                ta ? (const int64_t[]){K, M} : (const int64_t[]){M, K}),
                                 KT_OK);
                assert_int_equal(kt_tensor_init(&b1, (char *)in[1].data + i * K * N * es, dts[di], 2,
                                                tb ? (const int64_t[]){N, K} : (const int64_t[]){K, N}),
                                 KT_OK);
                kt_tensor p2[2] = {a1, b1};
                kt_exec e1 = {.scratch_bytes = kt_op_scratch_bytes(KT_OP_MATMUL, &at, p2, 2, 0)};
                if (e1.scratch_bytes)
                    assert_int_equal(posix_memalign(&e1.scratch, 64, e1.scratch_bytes), 0);
                assert_int_equal(kt_op_forward(KT_OP_MATMUL, &at, p2, 2, &y1, 1, &e1), KT_OK);
                free(e1.scratch);
                if (memcmp((char *)y.data + i * M * N * es, y1.data, (size_t)(M * N) * es) != 0)
                    fail_msg("%s item %lld (trans %d %d) differs from its 2-D product",
                             kt_dtype_name(dts[di]), (long long)i, ta, tb);
                tu_free(&y1);
            }
            tu_free(&f[0]), tu_free(&f[1]), tu_free(&in[0]), tu_free(&in[1]), tu_free(&y);
        }
    kt_threadpool_destroy(pool);
}

/* Many small items (shared over the pool) and few large ones (each split by its kernel), a
 * broadcast operand's gradient summed over items: the same bits twice, and for any pool. */
static void test_batch_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 205);
    const batch_shape many = {2, 0, {4, 16}, {0}}, few = {1, 1, {1}, {3}};
    for (int t = 0; t < 4; t++) {
        kt_tensor in[2];
        make_batch(in, &many, 16, 24, 20, 1, t >> 1, &rng); /* trans_a: per item */
        gc_case c = {.op = KT_OP_MATMUL,
                     .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = 1, .trans_b = t >> 1),
                     .in = in, .n_in = 2, .seed = 60u + (unsigned)t};
        gc_check_deterministic(&c, 3);
        gc_check_thread_invariant(&c, 0, 3);
        kt_tensor lp[2] = {tu_convert(&in[0], KT_BF16), tu_convert(&in[1], KT_BF16)};
        gc_case cl = c;
        cl.in = lp;
        gc_check_thread_invariant(&cl, 0, 2);
        tu_free(&in[0]), tu_free(&in[1]), tu_free(&lp[0]), tu_free(&lp[1]);
        make_batch(in, &few, 150, 200, 170, t & 1, t >> 1, &rng);
        c.attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = t & 1, .trans_b = t >> 1);
        c.in = in;
        gc_check_deterministic(&c, 2);
        gc_check_thread_invariant(&c, 0, 2);
        tu_free(&in[0]), tu_free(&in[1]);
    }
}

/* No items (a zero batch dim against b's 1): an empty output, and b's gradient all zeros. */
static void test_batch_empty(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 0, 4, 3), b = tu_new(KT_F32, 1, 4, 5);
    kt_tensor y = tu_new(KT_F32, 0, 3, 5), ga = tu_new(KT_F32, 0, 4, 3), gb = tu_new(KT_F32, 1, 4, 5);
    for (int i = 0; i < 20; i++)
        tu_set(&gb, i, NAN);
    const kt_op_attrs at = TU_ATTRS(KT_OP_MATMUL, .trans_a = 1);
    kt_tensor in[2] = {a, b}, gi[2] = {ga, gb};
    kt_exec ex = {.scratch_bytes = kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 1) + 64};
    assert_int_equal(posix_memalign(&ex.scratch, 64, ex.scratch_bytes), 0);
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, &at, in, 2, &y, 1, &ex), KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_MATMUL, &at, in, 2, &y, 1, &y, gi, &ex), KT_OK);
    for (int i = 0; i < 20; i++)
        assert_true(tu_get(&gb, i) == 0.0);
    /* K = 0 in every item: zeros */
    kt_tensor a0 = tu_new(KT_F32, 2, 0, 3), b0 = tu_new(KT_F32, 2, 0, 5), y0 = tu_new(KT_F32, 2, 3, 5);
    for (int i = 0; i < 30; i++)
        tu_set(&y0, i, NAN);
    kt_tensor in0[2] = {a0, b0};
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, &at, in0, 2, &y0, 1, &ex), KT_OK);
    for (int i = 0; i < 30; i++)
        assert_true(tu_get(&y0, i) == 0.0);
    free(ex.scratch);
    tu_free(&a), tu_free(&b), tu_free(&y), tu_free(&ga), tu_free(&gb);
    tu_free(&a0), tu_free(&b0), tu_free(&y0);
}

static void test_batch_shapes_flops(void **state)
{
    (void)state;
    kt_tensor in[2] = {tu_new(KT_F32, 2, 1, 7, 5), tu_new(KT_F32, 3, 6, 7)};
    const kt_op_attrs at = TU_ATTRS(KT_OP_MATMUL, .trans_a = 1, .trans_b = 1);
    kt_tensor y;
    assert_int_equal(kt_op_infer(KT_OP_MATMUL, &at, in, 2, &y, 1), KT_OK);
    assert_int_equal(y.ndim, 4);
    assert_true(y.shape[0] == 2 && y.shape[1] == 3 && y.shape[2] == 5 && y.shape[3] == 6);
    assert_true(kt_op_flops(KT_OP_MATMUL, &at, in, 2) == 2.0 * 6 * 5 * 6 * 7);
    /* a plain a against a 3-d b: the output takes b's batch */
    kt_tensor p[2] = {tu_new(KT_F32, 5, 7), tu_new(KT_F32, 4, 7, 6)};
    assert_int_equal(kt_op_infer(KT_OP_MATMUL, NULL, p, 2, &y, 1), KT_OK);
    assert_true(y.ndim == 3 && y.shape[0] == 4 && y.shape[1] == 5 && y.shape[2] == 6);
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&p[0]), tu_free(&p[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_gradcheck),
        cmocka_unit_test(test_batch_gradcheck_large),
        cmocka_unit_test(test_batch_low_precision),
        cmocka_unit_test(test_batch_items_are_2d_products),
        cmocka_unit_test(test_batch_deterministic),
        cmocka_unit_test(test_batch_empty),
        cmocka_unit_test(test_batch_shapes_flops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
