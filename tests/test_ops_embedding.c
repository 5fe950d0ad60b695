/* embedding and topk_router: forward against float64 references (router ids exactly),
 * backward against finite differences, bf16/f16 against f32 (embedding; the router is
 * f32-only), determinism (also across thread counts, since embedding's backward is a
 * scatter-add), router tie-breaking, and bad input. */
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

/* softmax over E, then k picks of the largest remaining probability (lowest index on ties) */
static void ref_router(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                       int n_out)
{
    (void)n_in, (void)n_out;
    const int64_t n = in[0].shape[0], e = in[0].shape[1];
    const int k = at->k;
    double *p = calloc((size_t)e, sizeof *p);
    char *taken = calloc((size_t)e, 1);
    assert_non_null(p);
    assert_non_null(taken);
    for (int64_t r = 0; r < n; r++) {
        const double *x = in[0].d + r * e;
        double m = -INFINITY, s = 0.0;
        for (int64_t i = 0; i < e; i++)
            m = fmax(m, x[i]);
        for (int64_t i = 0; i < e; i++)
            s += exp(x[i] - m);
        for (int64_t i = 0; i < e; i++) {
            p[i] = exp(x[i] - m) / s;
            taken[i] = 0;
        }
        double chosen = 0.0;
        for (int c = 0; c < k; c++) {
            int64_t best = -1;
            for (int64_t i = 0; i < e; i++)
                if (!taken[i] && (best < 0 || p[i] > p[best]))
                    best = i;
            taken[best] = 1;
            out[0].d[r * k + c] = (double)best;
            out[1].d[r * k + c] = p[best];
            chosen += p[best];
        }
        if (at->norm_topk)
            for (int c = 0; c < k; c++)
                out[1].d[r * k + c] /= chosen;
    }
    free(p);
    free(taken);
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

/* ---- topk_router ----------------------------------------------------------------------------- */

/* Each row a shuffled ladder of logits `step` apart: no ties and no near-ties, so the
 * finite differences (steps of ~1e-6) never change the selection. */
static kt_tensor router_logits(tu_rng *rng, int64_t n, int64_t e, double step)
{
    kt_tensor x = tu_new(KT_F32, n, e);
    int64_t *perm = malloc((size_t)e * sizeof *perm);
    assert_non_null(perm);
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i = 0; i < e; i++)
            perm[i] = i;
        for (int64_t i = e - 1; i > 0; i--) {
            int64_t j = (int64_t)(tu_rng_next(rng) % (uint64_t)(i + 1));
            int64_t t = perm[i];
            perm[i] = perm[j], perm[j] = t;
        }
        for (int64_t i = 0; i < e; i++)
            tu_set(&x, r * e + i,
                   step * ((double)perm[i] - 0.5 * (double)e) + tu_rng_uniform(rng, 0, 0.2 * step));
    }
    free(perm);
    return x;
}

/* k = 1, k = E, a single expert, 1000 experts; with and without renormalisation. */
static void test_router(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 6);
    const struct {
        int64_t n, e;
        int k;
        double step;
    } cases[] = {{5, 8, 2, 0.3}, {7, 64, 6, 0.1}, {3, 1, 1, 0.3},
                 {4, 13, 13, 0.3}, {6, 5, 1, 0.5}, {3, 1000, 4, 0.01}};
    for (size_t s = 0; s < sizeof cases / sizeof cases[0]; s++) {
        kt_tensor x = router_logits(&rng, cases[s].n, cases[s].e, cases[s].step);
        for (int norm = 0; norm <= 1; norm++)
            for (int threads = 0; threads <= 2; threads += 2) {
                gc_case c = {.op = KT_OP_TOPK_ROUTER,
                             .attrs =
                                 TU_ATTRS(KT_OP_TOPK_ROUTER, .k = cases[s].k, .norm_topk = norm),
                             .in = &x,
                             .n_in = 1,
                             .ref = ref_router,
                             .threads = threads,
                             .probes = 500,
                             .seed = (uint64_t)(100 * s + 10 * (size_t)norm + (size_t)threads)};
                gc_check(&c);
            }
        tu_free(&x);
    }
}

/* Equal logits go to the lower expert index first, and get equal weights. */
static void test_router_ties(void **state)
{
    (void)state;
    const float logits[4][5] = {
        {1, 3, 3, 0, 3}, {0, 0, 0, 0, 0}, {5, -1, 5, 5, 7}, {-2, -2, 9, -2, -2}};
    const int32_t want[4][3] = {{1, 2, 4}, {0, 1, 2}, {4, 0, 2}, {2, 0, 1}};
    kt_tensor x = tu_new(KT_F32, 4, 5);
    memcpy(x.data, logits, sizeof logits);
    for (int norm = 0; norm <= 1; norm++) {
        const kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 3, .norm_topk = norm);
        kt_tensor out[2] = {tu_new(KT_I32, 4, 3), tu_new(KT_F32, 4, 3)};
        assert_int_equal(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_OK);
        const int32_t *ids = out[0].data;
        const float *w = out[1].data;
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 3; c++)
                assert_int_equal(ids[r * 3 + c], want[r][c]);
        /* row 0's three equal logits, all of row 1 */
        assert_true(w[0] == w[1] && w[1] == w[2]);
        assert_true(w[3] == w[4] && w[4] == w[5]);
        assert_float_equal(w[3], norm ? 1.0 / 3.0 : 0.2, 1e-7);
        /* the float64 reference, which the other router tests trust, breaks ties alike */
        double xd[20], idd[12], wd[12];
        for (int i = 0; i < 20; i++)
            xd[i] = logits[i / 5][i % 5];
        gc_dt din = {.d = xd, .ndim = 2, .shape = {4, 5}, .n = 20};
        gc_dt dout[2] = {{.d = idd, .ndim = 2, .shape = {4, 3}, .n = 12},
                         {.d = wd, .ndim = 2, .shape = {4, 3}, .n = 12}};
        ref_router(&at, &din, 1, dout, 2);
        for (int i = 0; i < 12; i++) {
            assert_true(idd[i] == (double)want[i / 3][i % 3]);
            assert_float_equal(wd[i], w[i], 1e-6);
        }
        tu_free(&out[0]), tu_free(&out[1]);
    }
    tu_free(&x);
}

static void test_router_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    kt_tensor x = router_logits(&rng, 600, 64, 0.05);
    for (int norm = 0; norm <= 1; norm++) {
        gc_case c = {.op = KT_OP_TOPK_ROUTER,
                     .attrs = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 4, .norm_topk = norm),
                     .in = &x,
                     .n_in = 1,
                     .seed = 8};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        check_thread_invariant(KT_OP_TOPK_ROUTER, &c.attrs, &x, 1, 0, 3);
    }
    tu_free(&x);
}

/* The router is f32-only (its logits come from a small f32 gate, and the selection should
 * not depend on bf16 rounding), so there is no bf16/f16 comparison; those dtypes must be
 * refused by name instead. */
static void test_router_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 4, 6), ids = tu_new(KT_I32, 4, 2), w = tu_new(KT_F32, 4, 2);
    kt_tensor xb = tu_new(KT_BF16, 4, 6), x3 = tu_new(KT_F32, 1, 4, 6);
    kt_tensor out[2] = {ids, w};
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 2);
    /* k outside 1..E */
    at.k = 0;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "k must be in 1..6", "got 0");
    at.k = 7;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "k must be in 1..6", "got 7");
    at.k = 2;
    /* non-finite logits, named by token */
    tu_set(&x, 2 * 6 + 3, NAN);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 2", "expert 3");
    tu_set(&x, 2 * 6 + 3, 0);
    tu_set(&x, 1 * 6 + 5, INFINITY);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 1", "not finite");
    tu_set(&x, 1 * 6 + 5, -INFINITY);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 1");
    tu_set(&x, 1 * 6 + 5, 0);
    /* dtypes and ranks */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &xb, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "logits", "must be f32", "bf16");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x3, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "logits", "2 dimensions");
    /* backward: ids carry no gradient, and ids that did not come from the forward are
     * refused before they index the logits */
    assert_int_equal(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_OK);
    kt_tensor gw = tu_new(KT_F32, 4, 2), gx = tu_new(KT_F32, 4, 6), gi = tu_new(KT_I32, 4, 2);
    kt_tensor gout[2] = {gi, gw};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, gout, &gx, NULL),
                    KT_EINVAL, "topk_router", "output 0", "no gradient");
    gout[0] = (kt_tensor){0};
    gout[0].dtype = KT_I32, gout[0].ndim = 2, gout[0].shape[0] = 4, gout[0].shape[1] = 2;
    assert_int_equal(kt_op_backward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, gout, &gx, NULL),
                     KT_OK);
    tu_set(&ids, 5, 6);
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, gout, &gx, NULL),
                    KT_ERANGE, "topk_router", "ids[5] = 6");
    tu_free(&x), tu_free(&ids), tu_free(&w), tu_free(&xb), tu_free(&x3);
    tu_free(&gw), tu_free(&gx), tu_free(&gi);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_embedding_low_precision),
        cmocka_unit_test(test_embedding_deterministic),
        cmocka_unit_test(test_embedding_bad_input),
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_router_ties),
        cmocka_unit_test(test_router_deterministic),
        cmocka_unit_test(test_router_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
