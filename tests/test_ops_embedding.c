/* embedding: forward against a float64 reference, backward against finite differences,
 * bf16/f16 against f32, determinism (also across thread counts, since the backward is a
 * scatter-add), and bad input. The router's tests are in test_ops_router.c. */
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

static void ref_embedding(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                          int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    const int64_t h = in[0].shape[1];
    for (int64_t i = 0; i < in[1].n; i++)
        for (int64_t k = 0; k < h; k++)
            out[0].d[i * h + k] = in[0].d[(int64_t)in[1].d[i] * h + k];
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* Forward + backward with t1 and t2 threads: bitwise the same. */
static void check_thread_invariant(kt_op op, const kt_op_attrs *at, const kt_tensor *in,
                                   int n_in, int t1, int t2)
{
    gc_case c = {.op = op, .attrs = *at, .in = in, .n_in = n_in, .seed = 99};
    gc_check_thread_invariant(&c, t1, t2);
}

/* ---- embedding ------------------------------------------------------------------------------ */

/* Ids of rank 0 to 3 (the output reaching 4 dims), i32 and i64, rows longer than a kernel
 * chunk, a 1200-row table, and few distinct ids so that the scatter-add sums repeats. */
static void test_embedding(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    typedef struct {
        int64_t v, h;
        int ids_ndim;
        int64_t ids_shape[3];
        kt_dtype ids_dtype;
        int64_t distinct;
    } emb_case;
    const emb_case cases[] = {
        {17, 9, 1, {5}, KT_I32, 17},        {50, 33, 3, {2, 3, 4}, KT_I64, 10},
        {1200, 6, 2, {3, 40}, KT_I32, 1200}, {4, 7, 0, {0}, KT_I64, 4},
        {5, 3, 3, {2, 2, 2}, KT_I32, 5},     {3, 600, 1, {4}, KT_I64, 2},
    };
    for (size_t s = 0; s < sizeof cases / sizeof cases[0]; s++) {
        const emb_case *e = &cases[s];
        kt_tensor in[2] = {tu_new(KT_F32, e->v, e->h),
                           tu_alloc(e->ids_dtype, e->ids_ndim, e->ids_shape)};
        tu_fill_uniform(&in[0], &rng, -2, 2);
        tu_fill_uniform(&in[1], &rng, 0, (double)e->distinct);
        for (int threads = 0; threads <= 2; threads += 2) {
            gc_case c = {.op = KT_OP_EMBEDDING, .in = in, .n_in = 2, .ref = ref_embedding,
                         .threads = threads, .probes = 500,
                         .seed = (uint64_t)(10 * s + (size_t)threads)};
            gc_check(&c);
        }
        tu_free(&in[0]), tu_free(&in[1]);
    }
}

/* bf16 keeps 8 significant bits (rounding 2^-9 ~ 2e-3), f16 11 (2^-12 ~ 2.4e-4). The forward
 * copies rounded table rows, so its error is one rounding of the table. The backward sums
 * rounded output gradients in f32 and rounds once on store: with a handful of tokens per
 * row the sum's error stays near two roundings. Measured over six seeds: forward exactly
 * one rounding (1.95e-3, 2.4e-4), backward up to 4.2e-3 (bf16) and 4.9e-4 (f16); the
 * bounds, 8e-3 and 1e-3, leave about 2x. */
static void test_embedding_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    kt_tensor in[2] = {tu_new(KT_F32, 40, 700), tu_new(KT_I32, 6, 30)};
    tu_fill_uniform(&in[0], &rng, -2, 2);
    tu_fill_uniform(&in[1], &rng, 0, 40);
    gc_case c = {.op = KT_OP_EMBEDDING, .in = in, .n_in = 2, .threads = 2, .seed = 3};
    gc_check_lowp(&c, KT_BF16, 8e-3);
    gc_check_lowp(&c, KT_F16, 1e-3);
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_embedding_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    /* many repeats of each id, enough rows and tokens to be split over 3 threads */
    kt_tensor in[2] = {tu_new(KT_F32, 300, 64), tu_new(KT_I64, 4000)};
    tu_fill_uniform(&in[0], &rng, -1, 1);
    tu_fill_uniform(&in[1], &rng, 0, 300);
    gc_case c = {.op = KT_OP_EMBEDDING, .in = in, .n_in = 2, .seed = 5};
    gc_check_deterministic(&c, 2);
    gc_check_deterministic(&c, 3);
    check_thread_invariant(KT_OP_EMBEDDING, &c.attrs, in, 2, 0, 3);
    kt_tensor lp[2] = {tu_convert(&in[0], KT_BF16), tu_clone(&in[1])};
    check_thread_invariant(KT_OP_EMBEDDING, &c.attrs, lp, 2, 0, 3);
    tu_free(&lp[0]), tu_free(&lp[1]);
    tu_free(&in[0]), tu_free(&in[1]);
}

static void test_embedding_bad_input(void **state)
{
    (void)state;
    kt_tensor tab = tu_new(KT_F32, 17, 4), ids = tu_new(KT_I32, 6), out = tu_new(KT_F32, 6, 4);
    kt_tensor ids64 = tu_new(KT_I64, 2, 3), out64 = tu_new(KT_F32, 2, 3, 4);
    kt_tensor ids4 = tu_new(KT_I32, 1, 1, 2, 3), idsf = tu_new(KT_F32, 6);
    kt_tensor tab1 = tu_new(KT_F32, 17), tabi = tu_new(KT_I64, 17, 4);
    kt_tensor in[2] = {tab, ids};
    /* out-of-range ids: position and value named, nothing written */
    for (int64_t i = 0; i < 24; i++)
        tu_set(&out, i, 7.0);
    tu_set(&ids, 4, 17);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EMBEDDING, NULL, in, 2, &out, 1, NULL), KT_ERANGE,
                    "embedding", "ids[4] = 17", "[0, 17)");
    for (int64_t i = 0; i < 24; i++)
        assert_true(tu_get(&out, i) == 7.0);
    tu_set(&ids, 4, 0);
    tu_set(&ids64, 5, -3);
    in[1] = ids64;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EMBEDDING, NULL, in, 2, &out64, 1, NULL), KT_ERANGE,
                    "embedding", "ids[5] = -3");
    /* the backward groups tokens by id in scratch and checks the ids again first */
    kt_tensor gin[2] = {tu_new(KT_F32, 17, 4), {0}};
    size_t bytes = kt_op_scratch_bytes(KT_OP_EMBEDDING, NULL, in, 2, 1);
    assert_true(bytes > 0);
    kt_exec ex = {.scratch_bytes = bytes};
    assert_int_equal(posix_memalign(&ex.scratch, 64, bytes), 0);
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_EMBEDDING, NULL, in, 2, &out64, 1, &out64, gin, &ex),
                    KT_ERANGE, "embedding", "ids[5] = -3");
    free(ex.scratch);
    /* ranks and dtypes */
    in[1] = ids4;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EMBEDDING, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "embedding", "ids", "0 to 3 dimensions");
    in[1] = idsf;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EMBEDDING, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "embedding", "ids", "i32 or i64");
    in[0] = tab1, in[1] = ids;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EMBEDDING, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "embedding", "table", "2 dimensions");
    in[0] = tabi;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_EMBEDDING, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "embedding", "table", "i64");
    /* ids take no gradient */
    in[0] = tab;
    gin[1] = ids;
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_EMBEDDING, NULL, in, 2, &out, 1, &out, gin, NULL),
                    KT_EINVAL, "embedding", "input 1", "no gradient");
    tu_free(&tab), tu_free(&ids), tu_free(&out), tu_free(&ids64), tu_free(&out64);
    tu_free(&ids4), tu_free(&idsf), tu_free(&tab1), tu_free(&tabi), tu_free(&gin[0]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_embedding_low_precision),
        cmocka_unit_test(test_embedding_deterministic),
        cmocka_unit_test(test_embedding_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
