/* matmul and the shared sgemm: forward against a float64 reference, backward against
 * finite differences for every transpose combination, bf16/f16 against f32, determinism,
 * the portable kernel on awkward shapes and strides (and against OpenBLAS when built with
 * it), and bad input. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"
#include "lib/core/cpu_internal.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/bf16_matmul.h"
#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/sgemm.h"

/* ---- float64 reference -------------------------------------------------------------------- */

static void ref_matmul(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out, int n_out)
{
    (void)n_in, (void)n_out;
    const gc_dt *a = &in[0], *b = &in[1];
    const int64_t M = at->trans_a ? a->shape[1] : a->shape[0];
    const int64_t K = at->trans_a ? a->shape[0] : a->shape[1];
    const int64_t N = at->trans_b ? b->shape[0] : b->shape[1];
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0.0;
            for (int64_t k = 0; k < K; k++) {
                double av = at->trans_a ? a->d[k * M + i] : a->d[i * K + k];
                double bv = at->trans_b ? b->d[j * K + k] : b->d[k * N + j];
                s += av * bv;
            }
            out[0].d[i * N + j] = s;
        }
}

/* a and b for op(a) [M,K], op(b) [K,N] in the stored layouts the flags ask for */
static void make_operands(kt_tensor in[2], int64_t M, int64_t K, int64_t N, int ta, int tb,
                          tu_rng *rng)
{
    in[0] = ta ? tu_new(KT_F32, K, M) : tu_new(KT_F32, M, K);
    in[1] = tb ? tu_new(KT_F32, N, K) : tu_new(KT_F32, K, N);
    tu_fill_uniform(&in[0], rng, -1, 1);
    tu_fill_uniform(&in[1], rng, -1, 1);
}

typedef struct mm_shape {
    int64_t M, K, N;
    int probes; /* 0: every element */
} mm_shape;

/* Odd sizes around the kernel's register and cache tiles (MR 4/6/12, NR 8/16, NC 48,
 * MC 96, KC 256), including a K that spans two K blocks. */
static const mm_shape shapes[] = {
    {1, 1, 1, 0},   {7, 33, 5, 0},  {33, 7, 65, 0}, {65, 130, 1, 0},
    {1, 65, 33, 0}, {13, 2, 130, 0}, {130, 300, 97, 12},
};

static void test_matmul_gradcheck(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 101);
    uint64_t seed = 1;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        for (int ta = 0; ta <= 1; ta++) {
            for (int tb = 0; tb <= 1; tb++) {
                kt_tensor in[2];
                make_operands(in, shapes[s].M, shapes[s].K, shapes[s].N, ta, tb, &rng);
                for (int threads = 0; threads <= 2; threads += 2) {
                    gc_case c = {.op = KT_OP_MATMUL,
                                 .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = ta, .trans_b = tb),
                                 .in = in,
                                 .n_in = 2,
                                 .ref = ref_matmul,
                                 .probes = shapes[s].probes,
                                 .threads = threads,
                                 .seed = seed++};
                    gc_check(&c);
                }
                tu_free(&in[0]);
                tu_free(&in[1]);
            }
        }
    }
}

/* Empty dimensions: K = 0 gives zeros, M = 0 an empty output. */
static void test_matmul_empty(void **state)
{
    (void)state;
    kt_tensor in[2] = {tu_new(KT_F32, 3, 0), tu_new(KT_F32, 0, 4)};
    kt_tensor out = tu_new(KT_F32, 3, 4);
    for (int i = 0; i < 12; i++)
        tu_set(&out, i, NAN);
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_OK);
    for (int i = 0; i < 12; i++)
        assert_true(tu_get(&out, i) == 0.0);
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&out);
    kt_tensor e[2] = {tu_new(KT_F32, 0, 5), tu_new(KT_F32, 5, 2)};
    kt_tensor eo = tu_new(KT_F32, 0, 2);
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, NULL, e, 2, &eo, 1, NULL), KT_OK);
    tu_free(&e[0]), tu_free(&e[1]), tu_free(&eo);
}

/* bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3), f16 11 (2^-12 = 2.4e-4). The
 * operands are rounded once, the f32 products summed, the result rounded once more: each
 * product carries at most 2u relative error with random signs, so the sum's error stays
 * within a few u of the output's scale, plus u for the final rounding. 1e-2 (bf16) and
 * 2e-3 (f16) leave about 3x margin over what these random inputs reach. */
static void test_matmul_low_precision(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 102);
    for (int ta = 0; ta <= 1; ta++) {
        for (int tb = 0; tb <= 1; tb++) {
            kt_tensor in[2];
            make_operands(in, 37, 70, 29, ta, tb, &rng);
            gc_case c = {.op = KT_OP_MATMUL,
                         .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_a = ta, .trans_b = tb),
                         .in = in,
                         .n_in = 2,
                         .threads = 2,
                         .seed = 20u + (unsigned)(2 * ta + tb)};
            gc_check_lowp(&c, KT_BF16, 1e-2);
            gc_check_lowp(&c, KT_F16, 2e-3);
            tu_free(&in[0]);
            tu_free(&in[1]);
        }
    }
}

static void test_matmul_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 103);
    kt_tensor in[2];
    make_operands(in, 200, 300, 150, 0, 1, &rng);
    gc_case c = {.op = KT_OP_MATMUL,
                 .attrs = TU_ATTRS(KT_OP_MATMUL, .trans_b = 1),
                 .in = in,
                 .n_in = 2,
                 .seed = 30};
    gc_check_deterministic(&c, 2);
    gc_check_deterministic(&c, 3);
    tu_free(&in[0]);
    tu_free(&in[1]);
}

static void test_matmul_flops_scratch(void **state)
{
    (void)state;
    kt_tensor in[2] = {tu_new(KT_F32, 6, 5), tu_new(KT_F32, 7, 5)};
    kt_op_attrs at = TU_ATTRS(KT_OP_MATMUL, .trans_b = 1);
    assert_true(kt_op_flops(KT_OP_MATMUL, &at, in, 2) == 2.0 * 6 * 7 * 5);
    assert_int_equal(kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 0), 0);
    assert_int_equal(kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 1), 0);
    kt_tensor lp[2] = {tu_convert(&in[0], KT_BF16), tu_convert(&in[1], KT_BF16)};
    assert_true(kt_op_scratch_bytes(KT_OP_MATMUL, &at, lp, 2, 0) >= (6 * 5 + 7 * 5 + 6 * 7) * 4);
    assert_true(kt_op_scratch_bytes(KT_OP_MATMUL, &at, lp, 2, 1) >= (6 * 5 + 7 * 5 + 6 * 7) * 4);
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&lp[0]), tu_free(&lp[1]);
}

/* ---- bf16 on the kernel registry's bf16 kernels, against float64 -------------------------- */

/* op(a)[m, k] and op(b)[k, n] of stored tensors, as doubles (bf16 values are exact there) */
static double op_a(const kt_tensor *a, int ta, int64_t M, int64_t K, int64_t m, int64_t k)
{
    return tu_get(a, ta ? k * M + m : m * K + k);
}

static double op_b(const kt_tensor *b, int tb, int64_t K, int64_t N, int64_t k, int64_t n)
{
    return tu_get(b, tb ? n * K + k : k * N + n);
}

/* got against the exact sum `ref` of terms whose magnitudes add to `mag`, over `len` terms:
 * f32 accumulation of exact bf16 products (at most len roundings of 2^-24 of the running
 * magnitude) and one final rounding to bf16 (2^-9 of the result, 2^-8 to leave room). */
static void check_close(double got, double ref, double mag, int64_t len, const char *what,
                        int64_t i, int64_t j)
{
    const double bound = ldexp(fabs(ref), -8) + (double)(len + 2) * ldexp(mag, -23) + 1e-30;
    if (!(fabs(got - ref) <= bound))
        fail_msg("%s [%lld, %lld]: %.9g, float64 %.9g (bound %.3g)", what, (long long)i,
                 (long long)j, got, ref, bound);
}

static void check_bf16_case(int64_t M, int64_t K, int64_t N, int ta, int tb, int threads,
                            tu_rng *rng)
{
    kt_tensor f[2];
    make_operands(f, M, K, N, ta, tb, rng);
    kt_tensor in[2] = {tu_convert(&f[0], KT_BF16), tu_convert(&f[1], KT_BF16)};
    kt_tensor gf = tu_new(KT_F32, M, N);
    tu_fill_uniform(&gf, rng, -1, 1);
    kt_tensor g = tu_convert(&gf, KT_BF16);
    const kt_op_attrs at = TU_ATTRS(KT_OP_MATMUL, .trans_a = ta, .trans_b = tb);
    kt_tensor y = tu_new(KT_BF16, M, N), ga = tu_clone(&in[0]), gb = tu_clone(&in[1]);
    kt_threadpool *pool = NULL;
    if (threads > 1)
        assert_int_equal(kt_threadpool_create(threads, &pool), KT_OK);
    const size_t sf = kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 0);
    const size_t sb = kt_op_scratch_bytes(KT_OP_MATMUL, &at, in, 2, 1);
    kt_exec ex = {.pool = pool, .scratch_bytes = sf > sb ? sf : sb};
    assert_int_equal(posix_memalign(&ex.scratch, 64, ex.scratch_bytes + 64), 0);
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, &at, in, 2, &y, 1, &ex), KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_MATMUL, &at, in, 2, &y, 1, &g, (kt_tensor[]){ga, gb},
                                    &ex),
                     KT_OK);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double r = 0.0, mag = 0.0;
            for (int64_t k = 0; k < K; k++) {
                const double t = op_a(&in[0], ta, M, K, m, k) * op_b(&in[1], tb, K, N, k, n);
                r += t, mag += fabs(t);
            }
            check_close(tu_get(&y, m * N + n), r, mag, K, "y", m, n);
        }
    for (int64_t m = 0; m < M; m++) /* d op(a)[m, k] = sum_n g[m, n] op(b)[k, n] */
        for (int64_t k = 0; k < K; k++) {
            double r = 0.0, mag = 0.0;
            for (int64_t n = 0; n < N; n++) {
                const double t = tu_get(&g, m * N + n) * op_b(&in[1], tb, K, N, k, n);
                r += t, mag += fabs(t);
            }
            check_close(tu_get(&ga, ta ? k * M + m : m * K + k), r, mag, N, "grad a", m, k);
        }
    for (int64_t k = 0; k < K; k++) /* d op(b)[k, n] = sum_m op(a)[m, k] g[m, n] */
        for (int64_t n = 0; n < N; n++) {
            double r = 0.0, mag = 0.0;
            for (int64_t m = 0; m < M; m++) {
                const double t = op_a(&in[0], ta, M, K, m, k) * tu_get(&g, m * N + n);
                r += t, mag += fabs(t);
            }
            check_close(tu_get(&gb, tb ? n * K + k : k * N + n), r, mag, M, "grad b", k, n);
        }
    free(ex.scratch);
    kt_threadpool_destroy(pool);
    tu_free(&f[0]), tu_free(&f[1]), tu_free(&in[0]), tu_free(&in[1]), tu_free(&gf), tu_free(&g);
    tu_free(&y), tu_free(&ga), tu_free(&gb);
}

/* Row counts that reach every path the registry has for bf16 NT, NN and MM on this CPU (KT_CPU
 * picks others: tests/CMakeLists.txt runs this suite under portable, dpbf16 and widen too),
 * odd K and N around the tiles, every transpose pair, 1 and 3 threads. */
static void test_matmul_bf16_f64(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 104);
    static const int64_t ms[] = {1, 2, 3, 4, 5, 7, 12, 16, 21, 33, KT__FMA_PACKED_MIN_M};
    static const int64_t kn[][2] = {{1, 1}, {7, 5}, {33, 97}, {70, 29}, {130, 13}};
    char seen[256] = " ", token[64];
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
        for (int tb = 0; tb <= 1; tb++) {
            snprintf(token, sizeof token, " %s ", kt__bf16_matmul_path(tb, ms[i])->name);
            if (strstr(seen, token) == NULL && strlen(seen) + strlen(token) < sizeof seen)
                strcat(seen, token + 1);
        }
        for (size_t j = 0; j < sizeof kn / sizeof kn[0]; j++)
            for (int ta = 0; ta <= 1; ta++)
                for (int tb = 0; tb <= 1; tb++)
                    check_bf16_case(ms[i], kn[j][0], kn[j][1], ta, tb, 1 + 2 * (int)(j % 2),
                                    &rng);
    }
    print_message("bf16 matmul paths checked:%s\n", seen);
}

/* The edges of fma_packed's blocks through the op (12-row tiles, up to 128 rows of A and 512
 * columns of B widened at once, 256 steps of K a block): rows at and around its first row count
 * and one past a block of rows, K of 1, one past a block and of several blocks, N of 1 and past a
 * block of columns; every transpose pair, 1 and 2 threads. */
static void test_matmul_bf16_blocks(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 106);
    static const int64_t mkn[][3] = {
        {KT__FMA_PACKED_MIN_M - 1, 40, 33},
        {KT__FMA_PACKED_MIN_M, 1, 1},
        {KT__FMA_PACKED_MIN_M, 257, 97},
        {129, 31, 200},
        {KT__FMA_PACKED_MIN_M + 1, 1100, 40},
        {193, 260, 65},
        {70, 37, 600},
    };
    for (size_t i = 0; i < sizeof mkn / sizeof mkn[0]; i++)
        for (int ta = 0; ta <= 1; ta++)
            for (int tb = 0; tb <= 1; tb++)
                check_bf16_case(mkn[i][0], mkn[i][1], mkn[i][2], ta, tb, 1 + (int)(i % 2), &rng);
}

/* bf16 values, a row stride `pad` past the row */
static uint16_t *bf16_rows(tu_rng *rng, int64_t rows, int64_t cols, int64_t pad)
{
    uint16_t *p = malloc((size_t)(rows * (cols + pad) + 1) * sizeof *p);
    assert_non_null(p);
    for (int64_t i = 0; i < rows * (cols + pad); i++)
        p[i] = kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1));
    return p;
}

#ifdef KT__FMA_GEMM
/* fma_packed's sums are the fma path's (its descriptor's sums_as): kt__fma_packed_mm against
 * kt__fma_nt (trans_b) and kt__fma_nn on the same operands, op(a) transposed copied out as rows
 * for them, bit for bit; padded strides, a block of columns [n0, n1) that is not the whole of
 * N, and C's elements outside it untouched. */
static void test_fma_packed_bits(void **state)
{
    (void)state;
    if (!kt__cpu_has_avx512())
        skip();
    tu_rng rng;
    tu_rng_seed(&rng, 107);
    static const int64_t mkn[][3] = {{1, 1, 1},     {12, 256, 32},  {13, 257, 96},
                                     {96, 31, 97},  {129, 600, 130}, {200, 513, 200},
                                     {5, 1, 100},   {40, 70, 1100}};
    for (size_t i = 0; i < sizeof mkn / sizeof mkn[0]; i++)
        for (int ta = 0; ta <= 1; ta++)
            for (int tb = 0; tb <= 1; tb++) {
                const int64_t M = mkn[i][0], K = mkn[i][1], N = mkn[i][2];
                const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
                const int64_t n0 = N > 40 ? 7 : 0, n1 = N > 40 ? N - 3 : N;
                uint16_t *a = bf16_rows(&rng, ta ? K : M, ta ? M : K, 3);
                uint16_t *b = bf16_rows(&rng, tb ? N : K, tb ? K : N, 5);
                uint16_t *rows = malloc((size_t)(M * K + 1) * sizeof *rows);
                float *c = malloc((size_t)(M * ldc) * sizeof *c);
                float *want = malloc((size_t)(M * ldc) * sizeof *want);
                assert_true(rows && c && want);
                for (int64_t m = 0; m < M; m++)
                    for (int64_t k = 0; k < K; k++)
                        rows[m * K + k] = ta ? a[k * lda + m] : a[m * lda + k];
                for (int64_t e = 0; e < M * ldc; e++)
                    c[e] = want[e] = (float)e;
                void *work = NULL;
                assert_int_equal(posix_memalign(&work, 64, kt__fma_packed_mm_work_bytes(n1 - n0)),
                                 0);
                kt__fma_packed_mm(ta, tb, M, n0, n1, K, a, lda, b, ldb, c, ldc, work);
                free(work);
                if (tb)
                    kt__fma_nt(KT__FMA_BF16, M, n0, n1, K, rows, K, b, ldb, want, ldc, 0);
                else
                    kt__fma_nn(KT__FMA_BF16, M, K, n0, n1, rows, b, NULL, NULL, K, ldb, want,
                               ldc, 0);
                for (int64_t e = 0; e < M * ldc; e++)
                    if (memcmp(&c[e], &want[e], sizeof c[e]) != 0)
                        fail_msg("M %lld K %lld N %lld ta %d tb %d: c[%lld, %lld] %.9g, fma %.9g",
                                 (long long)M, (long long)K, (long long)N, ta, tb,
                                 (long long)(e / ldc), (long long)(e % ldc), c[e], want[e]);
                free(a), free(b), free(rows), free(c), free(want);
            }
}
#endif

/* The scalar MM against the nt and nn references it shares its sums with, bit for bit. */
static void test_mm_ref_bits(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 108);
    const int64_t M = 9, K = 70, N = 37, n0 = 3, n1 = 35;
    for (int ta = 0; ta <= 1; ta++)
        for (int tb = 0; tb <= 1; tb++) {
            uint16_t *a = bf16_rows(&rng, ta ? K : M, ta ? M : K, 0);
            uint16_t *b = bf16_rows(&rng, tb ? N : K, tb ? K : N, 0);
            uint16_t *rows = malloc((size_t)(M * K) * sizeof *rows);
            float c[9 * 37], want[9 * 37];
            assert_non_null(rows);
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = 0; k < K; k++)
                    rows[m * K + k] = ta ? a[k * M + m] : a[m * K + k];
            for (int64_t e = 0; e < M * N; e++)
                c[e] = want[e] = (float)e;
            kt__bf16_gemm_mm_ref(ta, tb, M, n0, n1, K, a, ta ? M : K, b, tb ? K : N, c, N);
            if (tb)
                kt__bf16_gemm_nt_ref(M, n0, n1, K, rows, K, b, K, want, N, 0);
            else
                kt__bf16_gemm_nn_ref(M, K, n0, n1, rows, K, b, N, want, N, 0);
            assert_memory_equal(c, want, sizeof c);
            free(a), free(b), free(rows);
        }
}

/* The bf16 result is the same bits on any pool size (the kernels' fixed sums, any split). */
static void test_matmul_bf16_thread_invariant(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 105);
    for (int tb = 0; tb <= 1; tb++) {
        kt_tensor f[2];
        make_operands(f, 40, 300, 1000, 0, tb, &rng);
        kt_tensor in[2] = {tu_convert(&f[0], KT_BF16), tu_convert(&f[1], KT_BF16)};
        gc_case c = {.op = KT_OP_MATMUL, .attrs = {.trans_b = tb}, .in = in, .n_in = 2,
                     .seed = 40u + (unsigned)tb};
        gc_check_thread_invariant(&c, 1, 3);
        tu_free(&f[0]), tu_free(&f[1]), tu_free(&in[0]), tu_free(&in[1]);
    }
    /* rows where MM runs (fma_packed here), its pieces cut at other columns on 3 threads */
    for (int ta = 0; ta <= 1; ta++)
        for (int tb = 0; tb <= 1; tb++) {
            kt_tensor f[2];
            make_operands(f, KT__FMA_PACKED_MIN_M + 36, 300, 1000, ta, tb, &rng);
            kt_tensor in[2] = {tu_convert(&f[0], KT_BF16), tu_convert(&f[1], KT_BF16)};
            gc_case c = {.op = KT_OP_MATMUL, .attrs = {.trans_a = ta, .trans_b = tb}, .in = in,
                         .n_in = 2, .seed = 50u + 2u * (unsigned)ta + (unsigned)tb};
            gc_check_thread_invariant(&c, 1, 3);
            tu_free(&f[0]), tu_free(&f[1]), tu_free(&in[0]), tu_free(&in[1]);
        }
}

/* ---- the sgemm kernels directly ----------------------------------------------------------- */

typedef struct gemm_args {
    int ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    float alpha, beta;
    float *A, *B, *C0; /* C0: C before the call */
} gemm_args;

static float *rand_floats(tu_rng *rng, int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    assert_non_null(p);
    for (int64_t i = 0; i < n; i++)
        p[i] = (float)tu_rng_uniform(rng, -1, 1);
    return p;
}

/* Strides pad each row by a few elements that must be neither read into the result nor
 * written. */
static gemm_args make_gemm(tu_rng *rng, int ta, int tb, int64_t M, int64_t N, int64_t K,
                           float alpha, float beta)
{
    gemm_args g = {.ta = ta, .tb = tb, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta};
    g.lda = (ta ? M : K) + 3;
    g.ldb = (tb ? K : N) + 5;
    g.ldc = N + 2;
    g.A = rand_floats(rng, (ta ? K : M) * g.lda);
    g.B = rand_floats(rng, (tb ? N : K) * g.ldb);
    g.C0 = rand_floats(rng, M * g.ldc);
    return g;
}

static void free_gemm(gemm_args *g) { free(g->A), free(g->B), free(g->C0); }

typedef kt_status (*sgemm_fn)(kt_threadpool *, int, int, int64_t, int64_t, int64_t, float,
                              const float *, int64_t, const float *, int64_t, float, float *,
                              int64_t);

/* Runs fn on a copy of C0 (with NaN where beta is 0, which must not leak through). */
static float *run_gemm(const gemm_args *g, sgemm_fn fn, kt_threadpool *pool)
{
    float *C = malloc((size_t)(g->M * g->ldc > 0 ? g->M * g->ldc : 1) * sizeof *C);
    assert_non_null(C);
    for (int64_t i = 0; i < g->M * g->ldc; i++)
        C[i] = g->beta == 0.0f && i % g->ldc < g->N ? NAN : g->C0[i];
    kt_status s = fn(pool, g->ta, g->tb, g->M, g->N, g->K, g->alpha, g->A, g->lda, g->B, g->ldb,
                     g->beta, C, g->ldc);
    if (s != KT_OK)
        fail_msg("sgemm: %s", kt_last_error());
    return C;
}

/* The float64 value of C(i,j) and the textbook bound for a K-term f32 dot product around
 * it: |err| <= (K + 2) u (|alpha| sum_k |a b| + |beta c|), u = 2^-24. */
static double gemm_ref(const gemm_args *g, int64_t i, int64_t j, double *bound)
{
    const double c0 = g->C0[i * g->ldc + j];
    double s = 0.0, mag = 0.0;
    for (int64_t k = 0; k < g->K; k++) {
        double a = g->ta ? g->A[k * g->lda + i] : g->A[i * g->lda + k];
        double b = g->tb ? g->B[j * g->ldb + k] : g->B[k * g->ldb + j];
        s += a * b;
        mag += fabs(a * b);
    }
    const double cterm = g->beta != 0.0f ? g->beta * c0 : 0.0;
    *bound = (double)(g->K + 2) * ldexp(1.0, -24) * (fabs(g->alpha) * mag + fabs(cterm)) + 1e-30;
    return g->alpha * s + cterm;
}

/* Every element within the bound, and the padding columns of C untouched. */
static void check_gemm(const gemm_args *g, const float *C, const char *what)
{
    for (int64_t i = 0; i < g->M; i++) {
        for (int64_t j = 0; j < g->ldc; j++) {
            const double got = C[i * g->ldc + j];
            if (j >= g->N) {
                if (got != g->C0[i * g->ldc + j])
                    fail_msg("%s: C padding at (%lld,%lld) was written", what, (long long)i,
                             (long long)j);
                continue;
            }
            double bound, ref = gemm_ref(g, i, j, &bound);
            if (!(fabs(got - ref) <= bound))
                fail_msg("%s: ta=%d tb=%d M=%lld N=%lld K=%lld: C(%lld,%lld) = %.9g, float64 "
                         "%.9g (bound %.3g)", what, g->ta, g->tb, (long long)g->M,
                         (long long)g->N, (long long)g->K, (long long)i, (long long)j, got,
                         ref, bound);
        }
    }
}

typedef struct gemm_shape {
    int64_t M, N, K;
} gemm_shape;

/* around MR (4, 6, 12), NR (8, 16), NC 48, MC 96 and KC 256 */
static const gemm_shape gemm_shapes[] = {
    {1, 1, 1}, {7, 33, 5}, {13, 1, 300}, {97, 49, 257}, {130, 65, 7}, {5, 200, 513},
    {193, 97, 33}, {12, 16, 256},
};

/* The portable kernel against float64, alpha/beta variations, strided operands, and the
 * same bits for 1, 2 and 3 threads. */
static void test_sgemm_portable(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 104);
    kt_threadpool *p2, *p3;
    assert_int_equal(kt_threadpool_create(2, &p2), KT_OK);
    assert_int_equal(kt_threadpool_create(3, &p3), KT_OK);
    const float ab[3][2] = {{1.0f, 0.0f}, {0.75f, -1.5f}, {-2.0f, 1.0f}};
    for (size_t s = 0; s < sizeof gemm_shapes / sizeof gemm_shapes[0]; s++) {
        for (int t = 0; t < 4; t++) {
            const float *alpha_beta = ab[(s + (size_t)t) % 3];
            gemm_args g = make_gemm(&rng, t & 1, t >> 1, gemm_shapes[s].M, gemm_shapes[s].N,
                                    gemm_shapes[s].K, alpha_beta[0], alpha_beta[1]);
            float *c1 = run_gemm(&g, kt__sgemm_portable, NULL);
            float *c2 = run_gemm(&g, kt__sgemm_portable, p2);
            float *c3 = run_gemm(&g, kt__sgemm_portable, p3);
            check_gemm(&g, c1, "portable sgemm");
            size_t bytes = (size_t)(g.M * g.ldc) * sizeof(float);
            assert_memory_equal(c1, c2, bytes);
            assert_memory_equal(c1, c3, bytes);
            free(c1), free(c2), free(c3);
            free_gemm(&g);
        }
    }
    kt_threadpool_destroy(p2);
    kt_threadpool_destroy(p3);
}

/* K = 0 and alpha = 0 only scale C by beta; beta = 0 clears it (NaN included). */
static void test_sgemm_degenerate(void **state)
{
    (void)state;
    sgemm_fn fns[3] = {kt__sgemm_portable, kt__sgemm, kt__sgemm_openblas};
    for (int f = 0; f < 3; f++) {
        float C[6] = {1, 2, 3, 4, 5, NAN}, A[6] = {1, 1, 1, 1, 1, 1};
        assert_int_equal(fns[f](NULL, 0, 0, 2, 3, 0, 1.0f, NULL, 0, NULL, 0, 2.0f, C, 3), KT_OK);
        assert_true(C[0] == 2 && C[4] == 10 && isnan(C[5]));
        assert_int_equal(fns[f](NULL, 0, 0, 2, 3, 1, 0.0f, A, 1, A, 3, 0.0f, C, 3), KT_OK);
        for (int i = 0; i < 6; i++)
            assert_true(C[i] == 0.0f);
        assert_int_equal(fns[f](NULL, 0, 0, 0, 3, 4, 1.0f, NULL, 0, NULL, 0, 0.0f, NULL, 0),
                         KT_OK);
        TU_EXPECT_ERROR(fns[f](NULL, 0, 0, 2, 3, 4, 1.0f, A, 2, A, 3, 0.0f, C, 3), KT_EINVAL,
                        "sgemm", "lda");
        TU_EXPECT_ERROR(fns[f](NULL, 0, 1, 2, 3, 1, 1.0f, A, 1, A, 0, 0.0f, C, 3), KT_EINVAL,
                        "sgemm", "ldb");
        TU_EXPECT_ERROR(fns[f](NULL, 0, 0, 2, 3, 1, 1.0f, A, 1, A, 3, 0.0f, C, 2), KT_EINVAL,
                        "sgemm", "ldc");
        TU_EXPECT_ERROR(fns[f](NULL, 0, 0, -1, 3, 1, 1.0f, A, 1, A, 3, 0.0f, C, 3), KT_EINVAL,
                        "sgemm", "negative");
    }
}

/* OpenBLAS (kt__sgemm_openblas, in builds that have it), kt__sgemm (whichever it chose) and
 * the portable kernel agree within the float64 bound each is held to; without OpenBLAS all
 * are the portable kernel. */
static void test_sgemm_openblas_agreement(void **state)
{
    (void)state;
    print_message("kt__sgemm runs %s here (OpenBLAS's kernel set: %s)\n",
                  kt__sgemm_is_openblas() ? "OpenBLAS" : "the blocked kernel",
                  kt__sgemm_core_name());
    tu_rng rng;
    tu_rng_seed(&rng, 105);
    for (size_t s = 0; s < sizeof gemm_shapes / sizeof gemm_shapes[0]; s++) {
        for (int t = 0; t < 4; t++) {
            gemm_args g = make_gemm(&rng, t & 1, t >> 1, gemm_shapes[s].M, gemm_shapes[s].N,
                                    gemm_shapes[s].K, 1.25f, t == 3 ? 0.5f : 0.0f);
            float *cb = run_gemm(&g, kt__sgemm_openblas, NULL);
            float *cs = run_gemm(&g, kt__sgemm, NULL);
            check_gemm(&g, cs, "kt__sgemm");
            free(cs);
            float *cp = run_gemm(&g, kt__sgemm_portable, NULL);
            check_gemm(&g, cb, "OpenBLAS sgemm");
            check_gemm(&g, cp, "portable sgemm");
            /* two results within the bound of float64 are within twice it of each other */
            for (int64_t i = 0; i < g.M; i++)
                for (int64_t j = 0; j < g.N; j++) {
                    double bound;
                    (void)gemm_ref(&g, i, j, &bound);
                    double x = cb[i * g.ldc + j], y = cp[i * g.ldc + j];
                    if (!(fabs(x - y) <= 2.0 * bound))
                        fail_msg("sgemm vs portable: C(%lld,%lld) %.9g vs %.9g (bound %.3g)",
                                 (long long)i, (long long)j, x, y, 2.0 * bound);
                }
            free(cb), free(cp);
            free_gemm(&g);
        }
    }
}

/* ---- bad input ------------------------------------------------------------------------------ */

static void test_matmul_bad_input(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 8, 64), b = tu_new(KT_F32, 32, 16), out = tu_new(KT_F32, 8, 16);
    kt_tensor a3 = tu_new(KT_F32, 2, 8, 64), bi = tu_new(KT_I32, 64, 16);
    kt_tensor ai = tu_new(KT_I64, 8, 64);
    kt_tensor bbf = tu_new(KT_BF16, 64, 16), bok = tu_new(KT_F32, 64, 16);
    kt_tensor in[2] = {a, b};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul: b dimension 0 must be 64 (a's K), got f32[32,16]");
    kt_op_attrs tb = TU_ATTRS(KT_OP_MATMUL, .trans_b = 1);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, &tb, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "b dimension 1", "64");
    kt_op_attrs ta = TU_ATTRS(KT_OP_MATMUL, .trans_a = 1);
    in[1] = bok;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, &ta, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "b dimension 0", "must be 8");
    /* ranks 2..4; batch dims that neither match nor are 1 */
    kt_tensor v1 = tu_new(KT_F32, 64), b3 = tu_new(KT_F32, 3, 64, 16);
    in[0] = v1;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "a", "2 to 4 dimensions", "f32[64]");
    in[0] = a, in[1] = v1;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "b", "2 to 4 dimensions");
    in[0] = a3, in[1] = b3;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "batch dims of b f32[3,64,16]", "a's f32[2,8,64]", "equal or 1");
    tu_free(&v1), tu_free(&b3);
    /* a bf16 a with an f32 b (the mixed product is an f32 a with a bf16 or f16 b,
     * test_ops_matmul_mixed) */
    kt_tensor abf = tu_new(KT_BF16, 8, 64);
    in[0] = abf;
    in[1] = bok;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "b", "bf16", "f32");
    tu_free(&abf);
    in[0] = a;
    in[1] = bi;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "b", "i32");
    in[0] = ai;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &out, 1, NULL), KT_EINVAL,
                    "matmul", "a", "i64");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 1, &out, 1, NULL), KT_EINVAL,
                    "matmul", "2 inputs");
    /* the output must be [M,N] */
    in[0] = a, in[1] = bok;
    kt_tensor wrong = tu_new(KT_F32, 16, 8);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &wrong, 1, NULL), KT_EINVAL,
                    "matmul", "output 0", "f32[8,16]");

    /* bf16 needs scratch to stage its operands: none, or too little, is refused */
    kt_tensor lp[2] = {tu_convert(&a, KT_BF16), tu_convert(&bok, KT_BF16)};
    kt_tensor lpo = tu_new(KT_BF16, 8, 16);
    size_t need = kt_op_scratch_bytes(KT_OP_MATMUL, NULL, lp, 2, 0);
    assert_true(need > 0);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, lp, 2, &lpo, 1, NULL), KT_EINVAL,
                    "matmul", "scratch");
    void *scratch = NULL;
    assert_int_equal(posix_memalign(&scratch, 64, need), 0);
    kt_exec ex = {.scratch = scratch, .scratch_bytes = need - 1};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_MATMUL, NULL, lp, 2, &lpo, 1, &ex), KT_EINVAL,
                    "matmul", "scratch");
    ex.scratch_bytes = need;
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, NULL, lp, 2, &lpo, 1, &ex), KT_OK);
    /* backward needs more than forward */
    kt_tensor glp[2] = {tu_new(KT_BF16, 8, 64), tu_new(KT_BF16, 64, 16)};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_MATMUL, NULL, lp, 2, &lpo, 1, &lpo, glp, &ex),
                    KT_EINVAL, "matmul", "scratch");
    free(scratch);
    tu_free(&a), tu_free(&b), tu_free(&out), tu_free(&a3), tu_free(&bi), tu_free(&ai);
    tu_free(&bbf), tu_free(&bok), tu_free(&wrong), tu_free(&lp[0]), tu_free(&lp[1]);
    tu_free(&lpo), tu_free(&glp[0]), tu_free(&glp[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_gradcheck),
        cmocka_unit_test(test_matmul_empty),
        cmocka_unit_test(test_matmul_low_precision),
        cmocka_unit_test(test_matmul_deterministic),
        cmocka_unit_test(test_matmul_bf16_f64),
        cmocka_unit_test(test_matmul_bf16_blocks),
        cmocka_unit_test(test_matmul_bf16_thread_invariant),
#ifdef KT__FMA_GEMM
        cmocka_unit_test(test_fma_packed_bits),
#endif
        cmocka_unit_test(test_mm_ref_bits),
        cmocka_unit_test(test_matmul_flops_scratch),
        cmocka_unit_test(test_sgemm_portable),
        cmocka_unit_test(test_sgemm_degenerate),
        cmocka_unit_test(test_sgemm_openblas_agreement),
        cmocka_unit_test(test_matmul_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
