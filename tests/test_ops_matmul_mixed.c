/* matmul's mixed product: an f32 a with a bf16 or f16 b (a LoRA fine-tune's activations times its
 * frozen base weights) -> f32.
 *
 * What it must compute is the f32 product of a with b widened (exact), so every result is
 * checked three ways:
 *   - bit for bit against the kernel it runs (kt__mixed_matmul_path): fma_packed's sums are one
 *     fmaf chain per element in index order (the scalar reference below); the fallback
 *     (portable_sgemm, as under KT_CPU=portable) is kt__sgemm_portable on the widened b;
 *   - against the f32 matmul op on b widened by hand: bit for bit where both run the portable
 *     f32 kernel, else within f32 rounding (|error| <= 2 K 2^-24 sum_k |a_k b_k| per element,
 *     whatever the summation order);
 *   - the gradients against float64 finite differences (gradcheck), every trans combination and
 *     batch layouts, b trainable, its gradient the f32 one rounded to b's dtype.
 * And the pool never changes a bit; dtype pairs that are not the mixed product are refused
 * naming matmul and the argument. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kt/kt.h"
#include "lib/kernels/mixed_matmul.h"
#include "lib/kernels/registry.h"
#include "lib/kernels/sgemm.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_util.h"

static kt_op_attrs mm_attrs(int ta, int tb)
{
    kt_op_attrs a = kt_op_defaults(KT_OP_MATMUL);
    a.trans_a = ta, a.trans_b = tb;
    return a;
}

static void *scratch_for(const kt_op_attrs *at, const kt_tensor *in, int backward, size_t *bytes)
{
    *bytes = kt_op_scratch_bytes(KT_OP_MATMUL, at, in, 2, backward);
    void *p = NULL;
    if (*bytes > 0)
        assert_int_equal(posix_memalign(&p, 64, *bytes), 0);
    return p;
}

static kt_tensor forward(const kt_op_attrs *at, const kt_tensor *a, const kt_tensor *b,
                         kt_threadpool *pool)
{
    const kt_tensor in[2] = {*a, *b};
    kt_tensor y;
    OK(kt_op_infer(KT_OP_MATMUL, at, in, 2, &y, 1));
    assert_int_equal(y.dtype, KT_F32);
    y = tu_alloc(y.dtype, y.ndim, y.shape);
    kt_exec ex = {.pool = pool};
    ex.scratch = scratch_for(at, in, 0, &ex.scratch_bytes);
    OK(kt_op_forward(KT_OP_MATMUL, at, in, 2, &y, 1, &ex));
    free(ex.scratch);
    return y;
}

/* da, db (db in b's dtype) for the output gradient g */
static void backward(const kt_op_attrs *at, const kt_tensor *a, const kt_tensor *b,
                     const kt_tensor *y, const kt_tensor *g, kt_threadpool *pool, kt_tensor *da,
                     kt_tensor *db)
{
    const kt_tensor in[2] = {*a, *b};
    *da = tu_alloc(a->dtype, a->ndim, a->shape);
    *db = tu_alloc(b->dtype, b->ndim, b->shape);
    kt_tensor gin[2] = {*da, *db};
    kt_exec ex = {.pool = pool};
    ex.scratch = scratch_for(at, in, 1, &ex.scratch_bytes);
    OK(kt_op_backward(KT_OP_MATMUL, at, in, 2, y, 1, g, gin, &ex));
    free(ex.scratch);
}

/* C [rows, cols] = op(X) op(Y) over `inner`: one fmaf chain per element in index order, the
 * sums fma_packed computes; X and Y read as values (widened) */
static void ref_chain(int tx, int ty, int64_t rows, int64_t cols, int64_t inner, const kt_tensor *X,
                      const kt_tensor *Y, float *C)
{
    const int64_t ldx = tx ? rows : inner, ldy = ty ? inner : cols;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t n = 0; n < cols; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < inner; k++)
                s = fmaf((float)tu_get(X, tx ? k * ldx + m : m * ldx + k),
                         (float)tu_get(Y, ty ? n * ldy + k : k * ldy + n), s);
            C[m * cols + n] = s;
        }
}

/* The bits the kernel must give for one 2-D product: its reference by path. */
static kt_tensor expected_2d(int tx, int ty, int64_t rows, int64_t cols, int64_t inner,
                             const kt_tensor *X, const kt_tensor *Y)
{
    kt_tensor c = tu_new(KT_F32, rows, cols);
    if (strcmp(kt__mixed_matmul_path(rows), "fma_packed") == 0 ||
        strcmp(kt__mixed_matmul_path(rows), "avx2_fma") == 0) { /* the same sums */
        ref_chain(tx, ty, rows, cols, inner, X, Y, c.data);
    } else {
        assert_string_equal(kt__mixed_matmul_path(rows), "portable_sgemm");
        kt_tensor xf = tu_convert(X, KT_F32), yf = tu_convert(Y, KT_F32);
        OK(kt__sgemm_portable(NULL, tx, ty, rows, cols, inner, 1.0f, xf.data, tx ? rows : inner,
                              yf.data, ty ? inner : cols, 0.0f, c.data, cols));
        tu_free(&xf), tu_free(&yf);
    }
    return c;
}

static void expect_bits(const kt_tensor *got, const kt_tensor *want, const char *what)
{
    assert_int_equal(kt_tensor_numel(got), kt_tensor_numel(want));
    if (memcmp(got->data, want->data, kt_tensor_nbytes(want)) != 0) {
        for (int64_t i = 0; i < kt_tensor_numel(want); i++)
            if (tu_get(got, i) != tu_get(want, i))
                fail_msg("%s: element %lld is %.9g, the kernel's reference %.9g (path %s)", what,
                         (long long)i, tu_get(got, i), tu_get(want, i),
                         kt__mixed_matmul_path(1024));
        fail_msg("%s: bits differ (NaN or signed zero)", what);
    }
}

/* got against the f32 result f: bit for bit when `same` (the same kernel ran both), else
 * within f32 rounding of each element (bound[i] = sum_k |x_k y_k|, float64) */
static void expect_like_f32(const kt_tensor *got, const kt_tensor *f, const double *bound, int64_t K,
                            int same, const char *what)
{
    if (same) {
        expect_bits(got, f, what);
        return;
    }
    for (int64_t i = 0; i < kt_tensor_numel(f); i++) {
        const double tol = 2.0 * (double)K * 0x1p-24 * bound[i] + 1e-30;
        if (fabs(tu_get(got, i) - tu_get(f, i)) > tol)
            fail_msg("%s: element %lld is %.9g, the f32 matmul's %.9g (beyond f32 rounding %.3g)",
                     what, (long long)i, tu_get(got, i), tu_get(f, i), tol);
    }
}

/* sum_k |op(X)[m,k] op(Y)[k,n]| for every element */
static double *abs_bound(int tx, int ty, int64_t rows, int64_t cols, int64_t inner,
                         const kt_tensor *X, const kt_tensor *Y)
{
    double *b = calloc((size_t)(rows * cols), sizeof *b);
    const int64_t ldx = tx ? rows : inner, ldy = ty ? inner : cols;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < inner; k++) {
            const double x = fabs(tu_get(X, tx ? k * ldx + m : m * ldx + k));
            for (int64_t n = 0; n < cols; n++)
                b[m * cols + n] += x * fabs(tu_get(Y, ty ? n * ldy + k : k * ldy + n));
        }
    return b;
}

/* whether the f32 matmul runs the portable kernel, as the fallback does */
static int f32_same_kernel(int64_t M)
{
    return strcmp(kt__mixed_matmul_path(M), "portable_sgemm") == 0 && !kt__sgemm_is_openblas();
}

/* 2-D products, every trans combination, both narrow dtypes: forward and both gradients bit for
 * bit against the kernels' references, like the f32 matmul on the widened b, and the same for
 * any pool. The shapes cross fma_packed's blocks (256 steps, 12-row tiles, 32-column panels)
 * and the fallback's; the last one cuts b's gradient into blocks of rows. */
static void test_2d_exact(void **state)
{
    (void)state;
    static const int64_t shapes[][3] = {{1, 5, 7}, {13, 33, 17}, {70, 40, 300}, {130, 600, 70},
                                        {8, 1000, 1100}};
    const kt_dtype narrow[2] = {KT_BF16, KT_F16};
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    tu_rng rng;
    tu_rng_seed(&rng, 1);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int nd = 0; nd < 2; nd++)
            for (int t = 0; t < 4; t++) {
                const int ta = t & 1, tb = t >> 1;
                const int64_t M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
                if (si == 4 && (ta || nd)) /* the large one: b's gradient blocks, twice */
                    continue;
                char what[128];
                snprintf(what, sizeof what, "M=%lld N=%lld K=%lld trans_a=%d trans_b=%d b %s",
                         (long long)M, (long long)N, (long long)K, ta, tb,
                         kt_dtype_name(narrow[nd]));
                kt_tensor a = ta ? tu_new(KT_F32, K, M) : tu_new(KT_F32, M, K);
                kt_tensor b32 = tb ? tu_new(KT_F32, N, K) : tu_new(KT_F32, K, N);
                tu_fill_uniform(&a, &rng, -2, 2);
                tu_fill_uniform(&b32, &rng, -2, 2);
                kt_tensor b = tu_convert(&b32, narrow[nd]), bw = tu_convert(&b, KT_F32);
                const kt_op_attrs at = mm_attrs(ta, tb);
                kt_tensor y = forward(&at, &a, &b, NULL), yp = forward(&at, &a, &b, pool);
                expect_bits(&yp, &y, "forward with a pool of 2");
                kt_tensor want = expected_2d(ta, tb, M, N, K, &a, &b);
                expect_bits(&y, &want, what);
                if (si < 3) { /* the registry's scalar reference: the same fmaf chains */
                    kt_tensor r = tu_new(KT_F32, M, N), c = tu_new(KT_F32, M, N);
                    kt__kpaths[kt__kpath_count - 1].mm_mixed(
                        KT__KE_F32, nd ? KT__KE_F16 : KT__KE_BF16, ta, tb, M, 0, N, K, a.data,
                        ta ? M : K, b.data, tb ? K : N, r.data, N, NULL);
                    ref_chain(ta, tb, M, N, K, &a, &b, c.data);
                    expect_bits(&r, &c, "the registry's scalar MM_MIXED reference");
                    tu_free(&r), tu_free(&c);
                }
                kt_tensor yf = forward(&at, &a, &bw, NULL);
                double *bound = abs_bound(ta, tb, M, N, K, &a, &bw);
                expect_like_f32(&y, &yf, bound, K, f32_same_kernel(M), what);
                free(bound);

                kt_tensor g = tu_new(KT_F32, M, N);
                tu_fill_uniform(&g, &rng, -1, 1);
                kt_tensor da, db, dap, dbp, daf, dbf;
                backward(&at, &a, &b, &y, &g, NULL, &da, &db);
                backward(&at, &a, &b, &y, &g, pool, &dap, &dbp);
                expect_bits(&dap, &da, "a's gradient with a pool of 2");
                expect_bits(&dbp, &db, "b's gradient with a pool of 2");
                /* da: the mixed products of bwd_matmul, by the kernel's reference */
                kt_tensor wda = !ta ? expected_2d(0, !tb, M, K, N, &g, &b)
                                    : expected_2d(tb, 1, K, M, N, &b, &g);
                expect_bits(&da, &wda, "a's gradient");
                backward(&at, &a, &bw, &yf, &g, NULL, &daf, &dbf);
                double *gbound = !ta ? abs_bound(0, !tb, M, K, N, &g, &bw)
                                     : abs_bound(tb, 1, K, M, N, &bw, &g);
                expect_like_f32(&da, &daf, gbound, N, f32_same_kernel(!ta ? M : K),
                                "a's gradient against the f32 matmul's");
                free(gbound);
                /* db: the f32 matmul's gradient (kt__sgemm, blocks of rows change no sum),
                 * rounded to b's dtype */
                kt_tensor wdb = tu_convert(&dbf, narrow[nd]);
                if (!kt__sgemm_is_openblas()) {
                    expect_bits(&db, &wdb, "b's gradient (the f32 one rounded)");
                } else {
                    for (int64_t i = 0; i < kt_tensor_numel(&db); i++)
                        assert_true(fabs(tu_get(&db, i) - tu_get(&dbf, i)) <=
                                    0x1p-7 * fabs(tu_get(&dbf, i)) + 1e-6);
                }
                tu_free(&a), tu_free(&b32), tu_free(&b), tu_free(&bw), tu_free(&y);
                tu_free(&yp), tu_free(&want), tu_free(&yf), tu_free(&g), tu_free(&da);
                tu_free(&db), tu_free(&dap), tu_free(&dbp), tu_free(&daf), tu_free(&dbf);
                tu_free(&wda), tu_free(&wdb);
            }
    kt_threadpool_destroy(pool);
}

/* Batch layouts (a's stacked rows; per item; broadcast either way): like the f32 matmul on the
 * widened b within f32 rounding (each item is one 2-D product above), the gradients too, and
 * the same bits for any pool. */
static void test_batch_like_f32(void **state)
{
    (void)state;
    static const struct {
        int ta, tb, na, nb;
        int64_t as[4], bs[4];
    } cases[] = {
        {0, 1, 3, 2, {2, 5, 7}, {6, 7}},            /* flat: a's rows stacked */
        {0, 0, 3, 3, {3, 5, 7}, {3, 7, 6}},         /* per item */
        {1, 0, 3, 2, {3, 7, 5}, {7, 6}},            /* a transposed, one b */
        {0, 1, 2, 4, {5, 7}, {2, 3, 6, 7}},         /* a broadcast */
        {1, 1, 4, 3, {2, 1, 7, 5}, {3, 6, 7}},      /* both broadcast */
        {0, 0, 3, 3, {8, 40, 30}, {8, 30, 50}},     /* many items */
    };
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    tu_rng rng;
    tu_rng_seed(&rng, 2);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (int nd = 0; nd < 2; nd++) {
            const kt_dtype dt = nd ? KT_F16 : KT_BF16;
            kt_tensor a = tu_alloc(KT_F32, cases[ci].na, cases[ci].as);
            kt_tensor b32 = tu_alloc(KT_F32, cases[ci].nb, cases[ci].bs);
            tu_fill_uniform(&a, &rng, -2, 2);
            tu_fill_uniform(&b32, &rng, -2, 2);
            kt_tensor b = tu_convert(&b32, dt), bw = tu_convert(&b, KT_F32);
            const kt_op_attrs at = mm_attrs(cases[ci].ta, cases[ci].tb);
            kt_tensor y = forward(&at, &a, &b, NULL), yp = forward(&at, &a, &b, pool);
            kt_tensor yf = forward(&at, &a, &bw, NULL);
            expect_bits(&yp, &y, "batch forward with a pool of 2");
            const double err = tu_rel_err(&y, &yf, 1e-6);
            if (err > 1e-6)
                fail_msg("batch case %zu (%s): forward %.3g from the f32 matmul's", ci,
                         kt_dtype_name(dt), err);
            kt_tensor g = tu_alloc(KT_F32, y.ndim, y.shape);
            tu_fill_uniform(&g, &rng, -1, 1);
            kt_tensor da, db, dap, dbp, daf, dbf;
            backward(&at, &a, &b, &y, &g, NULL, &da, &db);
            backward(&at, &a, &b, &y, &g, pool, &dap, &dbp);
            backward(&at, &a, &bw, &yf, &g, NULL, &daf, &dbf);
            expect_bits(&dap, &da, "batch da with a pool of 2");
            expect_bits(&dbp, &db, "batch db with a pool of 2");
            if (tu_rel_err(&da, &daf, 1e-6) > 1e-6)
                fail_msg("batch case %zu: a's gradient off the f32 matmul's", ci);
            kt_tensor wdb = tu_convert(&dbf, dt);
            if (tu_rel_err(&db, &wdb, 1e-6) > (nd ? 1e-3 : 8e-3))
                fail_msg("batch case %zu: b's gradient off the f32 one rounded", ci);
            tu_free(&a), tu_free(&b32), tu_free(&b), tu_free(&bw), tu_free(&y), tu_free(&yp);
            tu_free(&yf), tu_free(&g), tu_free(&da), tu_free(&db), tu_free(&dap);
            tu_free(&dbp), tu_free(&daf), tu_free(&dbf), tu_free(&wdb);
        }
    kt_threadpool_destroy(pool);
}

/* float64 matmul with numpy-style batch broadcast (the same rules as test_ops_matmul_batch) */
static int64_t bdim(const gc_dt *t, int d)
{
    const int from_end = 1 - d, nb = t->ndim - 2; /* two batch dims at most here */
    return from_end < nb ? t->shape[nb - 1 - from_end] : 1;
}

static void ref_matmul(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    const gc_dt *a = &in[0], *b = &in[1];
    const int na = a->ndim, nb = b->ndim;
    const int64_t m = at->trans_a ? a->shape[na - 1] : a->shape[na - 2];
    const int64_t K = at->trans_a ? a->shape[na - 2] : a->shape[na - 1];
    const int64_t N = at->trans_b ? b->shape[nb - 2] : b->shape[nb - 1];
    const int64_t o0 = bdim(a, 0) > bdim(b, 0) ? bdim(a, 0) : bdim(b, 0);
    const int64_t o1 = bdim(a, 1) > bdim(b, 1) ? bdim(a, 1) : bdim(b, 1);
    for (int64_t i0 = 0; i0 < o0; i0++)
        for (int64_t i1 = 0; i1 < o1; i1++) {
            const int64_t ia = (bdim(a, 0) == 1 ? 0 : i0) * bdim(a, 1) + (bdim(a, 1) == 1 ? 0 : i1);
            const int64_t ib = (bdim(b, 0) == 1 ? 0 : i0) * bdim(b, 1) + (bdim(b, 1) == 1 ? 0 : i1);
            const double *A = a->d + ia * m * K, *B = b->d + ib * K * N;
            double *Y = out[0].d + (i0 * o1 + i1) * m * N;
            for (int64_t r = 0; r < m; r++)
                for (int64_t c = 0; c < N; c++) {
                    double s = 0.0;
                    for (int64_t k = 0; k < K; k++)
                        s += (at->trans_a ? A[k * m + r] : A[r * K + k]) *
                             (at->trans_b ? B[c * K + k] : B[k * N + c]);
                    Y[r * N + c] = s;
                }
        }
}

/* a's and b's gradients (b trainable) against float64 finite differences: every trans
 * combination, 2-D and batch layouts, bf16 and f16 b (b's gradient rounded to its dtype). */
static void test_gradcheck(void **state)
{
    (void)state;
    static const struct {
        int na, nb;
        int64_t as[4], bs[4]; /* untransposed shapes: a [..., m, K], b [..., K, N] */
    } layouts[] = {
        {2, 2, {9, 13}, {13, 11}},
        {3, 2, {2, 9, 13}, {13, 11}},
        {3, 3, {3, 6, 8}, {3, 8, 5}},
        {2, 4, {6, 8}, {2, 3, 8, 5}},
        {4, 3, {2, 1, 6, 8}, {3, 8, 5}},
    };
    tu_rng rng;
    tu_rng_seed(&rng, 3);
    for (size_t li = 0; li < sizeof layouts / sizeof layouts[0]; li++)
        for (int t = 0; t < 4; t++)
            for (int nd = 0; nd < 2; nd++) {
                const int ta = t & 1, tb = t >> 1;
                int64_t as[4], bs[4];
                memcpy(as, layouts[li].as, sizeof as);
                memcpy(bs, layouts[li].bs, sizeof bs);
                const int na = layouts[li].na, nb = layouts[li].nb;
                if (ta) {
                    const int64_t x = as[na - 1];
                    as[na - 1] = as[na - 2], as[na - 2] = x;
                }
                if (tb) {
                    const int64_t x = bs[nb - 1];
                    bs[nb - 1] = bs[nb - 2], bs[nb - 2] = x;
                }
                kt_tensor in[2] = {tu_alloc(KT_F32, na, as), tu_alloc(KT_F32, nb, bs)};
                tu_fill_uniform(&in[0], &rng, -1, 1);
                tu_fill_uniform(&in[1], &rng, -1, 1);
                kt_tensor b = tu_convert(&in[1], nd ? KT_F16 : KT_BF16);
                tu_free(&in[1]);
                in[1] = b;
                gc_case c = {.op = KT_OP_MATMUL, .attrs = mm_attrs(ta, tb), .in = in, .n_in = 2,
                             .ref = ref_matmul, .fwd_tol = 1e-6,
                             .grad_tol = nd ? 1e-3 : 8e-3, .probes = 40, .threads = t % 2 ? 2 : 0,
                             .seed = 100 + li * 8 + (size_t)t * 2 + (size_t)nd};
                gc_check(&c);
                tu_free(&in[0]), tu_free(&in[1]);
            }
}

static void test_errors(void **state)
{
    (void)state;
    const kt_op_attrs at = mm_attrs(0, 0);
    kt_tensor af = tu_new(KT_F32, 3, 4), ab = tu_new(KT_BF16, 3, 4), ah = tu_new(KT_F16, 3, 4);
    kt_tensor ai = tu_new(KT_I32, 3, 4);
    kt_tensor bf = tu_new(KT_F32, 4, 5), bb = tu_new(KT_BF16, 4, 5), bi = tu_new(KT_I64, 4, 5);
    kt_tensor y;
    /* a bf16 with b f32: the mixed product is an f32 a only */
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_MATMUL, &at, (kt_tensor[]){ab, bf}, 2, &y, 1), KT_EINVAL,
                    "matmul", "b must be bf16 like a", "got f32", "f32 a with a bf16 or f16 b");
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_MATMUL, &at, (kt_tensor[]){ah, bb}, 2, &y, 1), KT_EINVAL,
                    "matmul", "b must be f16 like a", "got bf16");
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_MATMUL, &at, (kt_tensor[]){af, bi}, 2, &y, 1), KT_EINVAL,
                    "matmul", "b must be f32, bf16 or f16", "got i64");
    TU_EXPECT_ERROR(kt_op_infer(KT_OP_MATMUL, &at, (kt_tensor[]){ai, bf}, 2, &y, 1), KT_EINVAL,
                    "matmul", "a must be f32, bf16 or f16", "got i32");
    /* the supported pairs */
    OK(kt_op_infer(KT_OP_MATMUL, &at, (kt_tensor[]){af, bb}, 2, &y, 1));
    assert_int_equal(y.dtype, KT_F32);
    OK(kt_op_infer(KT_OP_MATMUL, &at, (kt_tensor[]){ab, bb}, 2, &y, 1));
    assert_int_equal(y.dtype, KT_BF16);
    tu_free(&af), tu_free(&ab), tu_free(&ah), tu_free(&ai), tu_free(&bf), tu_free(&bb);
    tu_free(&bi);
}

/* In a model as kt-import writes one for a LoRA fine-tune: a frozen bf16 projection under f32
 * activations with a trained f32 adapter beside it; the session's gradient of the adapter
 * against central differences of its own loss, the frozen weight left alone by a step. */
static const char model[] =
    "input x: f32[6, 16]\n"
    "input y: i64[6]\n"
    "param frozen w: bf16[12, 16] = normal(0.3)\n"
    "param lora_a: f32[4, 16] = normal(0.3)\n"
    "param lora_b: f32[12, 4] = normal(0.3)\n"
    "h = matmul(x, w, trans_b = 1)\n"
    "d = matmul(x, lora_a, trans_b = 1)\n"
    "d = matmul(d, lora_b, trans_b = 1)\n"
    "h = add(h, d)\n"
    "loss = cross_entropy(h, y)\n"
    "loss loss\n";

static void test_in_a_model(void **state)
{
    (void)state;
    kt_program *p = tu_compile_ktg(model, "lora.ktg", 1);
    kt_session_options so = {.threads = 2, .seed = 5,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s = NULL;
    OK(kt_session_create(p, &so, &s));
    tu_rng rng;
    tu_rng_seed(&rng, 4);
    kt_tensor x, y, w;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &x));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &y));
    OK(kt_session_tensor(s, KT_ROLE_PARAM, "w", &w));
    assert_int_equal(w.dtype, KT_BF16);
    tu_fill_uniform(&x, &rng, -1, 1);
    for (int64_t i = 0; i < 6; i++)
        tu_set(&y, i, (double)(i * 5 % 12));
    kt_tensor w0 = tu_clone(&w);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    const char *const trained[2] = {"lora_a", "lora_b"};
    for (int i = 0; i < 2; i++) {
        kt_tensor pw, gw;
        OK(kt_session_tensor(s, KT_ROLE_PARAM, trained[i], &pw));
        OK(kt_session_tensor(s, KT_ROLE_GRAD, trained[i], &gw));
        kt_tensor grad = tu_clone(&gw);
        double scale = 1e-3, err = 0.0;
        for (int64_t k = 0; k < kt_tensor_numel(&pw); k++) {
            const float v = ((float *)pw.data)[k], h = 1e-2f;
            ((float *)pw.data)[k] = v + h;
            OK(kt_session_forward(s));
            const double lp = kt_session_loss(s);
            ((float *)pw.data)[k] = v - h;
            OK(kt_session_forward(s));
            const double lm = kt_session_loss(s);
            ((float *)pw.data)[k] = v;
            const double fd = (lp - lm) / (2.0 * (double)h);
            scale = fmax(scale, fabs(fd));
            err = fmax(err, fabs(fd - tu_get(&grad, k)));
        }
        if (err / scale > 1e-2)
            fail_msg("%s: gradient off by %.3g of its scale", trained[i], err / scale);
        tu_free(&grad);
    }
    OK(kt_session_step(s));
    assert_true(tu_bitwise_equal(&w, &w0)); /* frozen */
    tu_free(&w0);
    kt_session_destroy(s);
    kt_program_destroy(p);
}

int main(void)
{
    printf("mixed matmul path: %s at 1 row, %s at 1024 rows\n", kt__mixed_matmul_path(1),
           kt__mixed_matmul_path(1024));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_2d_exact),  cmocka_unit_test(test_batch_like_f32),
        cmocka_unit_test(test_gradcheck), cmocka_unit_test(test_errors),
        cmocka_unit_test(test_in_a_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
