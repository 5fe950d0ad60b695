/* The AVX2 kernel paths of the registry (avx2_fma, avx2_dots: lib/kernels/avx2_gemm.h), called
 * through their descriptors on any CPU with AVX2 + FMA + F16C, also one whose AVX-512 paths
 * serve the products (the dispatch never picks them there): every product kind (NT, NN, NN2,
 * TN in bf16 and f32; MM on bf16; MM_MIXED on f32 x bf16, f32 x f16, bf16 x f32, with every
 * transpose pair) on sizes around the register tiles (6 rows x 16 columns) and the cache blocks
 * (256 steps, 128 columns, 96 rows), N below 8, K odd and of 1, padded rows, column blocks that
 * start past 0:
 *  - avx2_fma bit for bit against one fmaf chain per element in index order of the reduction
 *    (from y's value for NT / NN with accumulate; TN's dw + scale * sum), the sums it promises;
 *  - avx2_dots against a float64 reference within the rounding of an f32 sum;
 *  - cells outside the block untouched, overwriting calls never reading the output (NaN
 *    there before).
 * Skips (and says so) where the CPU or the build lacks the kernels. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kt/tensor.h"
#include "lib/core/cpu_internal.h"
#include "lib/kernels/avx2_gemm.h"
#include "lib/kernels/registry.h"
#include "tests/support/test_util.h"

static const kt__kpath *path_named(const char *name)
{
    for (int i = 0; i < kt__kpath_count; i++)
        if (strcmp(kt__kpaths[i].name, name) == 0)
            return &kt__kpaths[i];
    return NULL;
}

static int g_runnable = -1;
static int64_t g_cases, g_elems;

/* Whether the kernels can run here; the first call says why not. */
static int runnable(void)
{
    if (g_runnable < 0) {
#ifdef KT__AVX2_GEMM
        g_runnable = kt__cpu_has_avx2();
#else
        g_runnable = 0;
#endif
        if (!g_runnable)
            print_message("AVX2 kernels skipped: %s\n",
#ifdef KT__AVX2_GEMM
                          "this CPU lacks AVX2, FMA or F16C (or KT_CPU=portable hides them)"
#else
                          "not in this build (x86-64 with a GCC-compatible compiler only)"
#endif
            );
    }
    return g_runnable;
}

/* A matrix of `rows` x `cols` values (row stride ld) exact in `e`, and its encoding. */
typedef struct mat {
    kt__kelem e;
    int64_t rows, cols, ld;
    float *v;  /* the values */
    void *enc; /* as e */
} mat;

static mat mat_new(kt__kelem e, int64_t rows, int64_t cols, int64_t pad, tu_rng *rng)
{
    mat m = {e, rows, cols, cols + pad, NULL, NULL};
    const size_t n = (size_t)(rows * m.ld) + 1;
    m.v = malloc(n * sizeof(float));
    m.enc = malloc(n * 4);
    assert_true(m.v && m.enc);
    for (size_t i = 0; i < n; i++) {
        const float x = (float)tu_rng_uniform(rng, -1, 1);
        if (e == KT__KE_F32) {
            m.v[i] = x;
            ((float *)m.enc)[i] = x;
        } else if (e == KT__KE_BF16) {
            const uint16_t h = kt_f32_to_bf16_1(x);
            m.v[i] = kt_bf16_to_f32_1(h);
            ((uint16_t *)m.enc)[i] = h;
        } else {
            const uint16_t h = kt_f32_to_f16_1(x);
            m.v[i] = kt_f16_to_f32_1(h);
            ((uint16_t *)m.enc)[i] = h;
        }
    }
    return m;
}

static void mat_free(mat *m) { free(m->v), free(m->enc); }

/* element (i, j) of op(m): m[i, j], or m[j, i] when trans */
static float at(const mat *m, int trans, int64_t i, int64_t j)
{
    return trans ? m->v[j * m->ld + i] : m->v[i * m->ld + j];
}

/* The output: rows x cols (row stride ldc), its start c0 (NaN inside the block [n0, n1) when
 * the call overwrites, so a read would show), the kernel's c and the expected bits. */
typedef struct out {
    int64_t rows, cols, ldc;
    float *c0, *c, *want;
} out;

static out out_new(int64_t rows, int64_t cols, int64_t c_lo, int64_t c_hi, int nan_inside,
                   tu_rng *rng)
{
    out o = {rows, cols, cols + 3, NULL, NULL, NULL};
    const size_t n = (size_t)(rows * o.ldc);
    o.c0 = malloc(n * sizeof(float));
    o.c = malloc(n * sizeof(float));
    o.want = malloc(n * sizeof(float));
    assert_true(o.c0 && o.c && o.want);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < o.ldc; j++)
            o.c0[r * o.ldc + j] =
                nan_inside && j >= c_lo && j < c_hi ? NAN : (float)tu_rng_uniform(rng, -2, 2);
    memcpy(o.c, o.c0, n * sizeof(float));
    memcpy(o.want, o.c0, n * sizeof(float));
    return o;
}

/* every element bit for bit (outside the block: c0's) */
static void expect_bits(const out *o, const char *what)
{
    for (int64_t i = 0; i < o->rows * o->ldc; i++)
        if (memcmp(&o->c[i], &o->want[i], sizeof(float)) != 0)
            fail_msg("%s: c[%lld, %lld] = %.9g, want %.9g", what, (long long)(i / o->ldc),
                     (long long)(i % o->ldc), o->c[i], o->want[i]);
    g_elems += o->rows * o->ldc;
    g_cases++;
}

static void out_free(out *o) { free(o->c0), free(o->c), free(o->want); }

/* s continued over k < K by fmaf(op(a)[m, k], op(b)[k, n], s) */
static float chain(float s, const mat *a, int ta, const mat *b, int tb, int64_t m, int64_t n,
                   int64_t K)
{
    for (int64_t k = 0; k < K; k++)
        s = fmaf(at(a, ta, m, k), at(b, tb, k, n), s);
    return s;
}

/* NT / NN / NN2 on one dtype through avx2_fma: y[:, n0:n1) of M rows, reduction R */
static void check_nt_nn(const kt__kpath *p, int kind, kt__kelem e, int64_t M, int64_t R,
                        int64_t cols, int64_t n0, int64_t n1, int acc, tu_rng *rng)
{
    const int nt = kind == KT__KP_NT_BF16 || kind == KT__KP_NT_F32;
    const int two = kind == KT__KP_NN2_BF16 || kind == KT__KP_NN2_F32;
    if (two)
        acc = 0; /* nn2 overwrites */
    /* nt: x [M, R], w [cols, R]; nn: g [M, R], w [R, cols] (a second pair for nn2) */
    mat a = mat_new(e, M, R, (int64_t)(tu_rng_next(rng) % 4), rng);
    mat b = nt ? mat_new(e, cols, R, (int64_t)(tu_rng_next(rng) % 4), rng)
               : mat_new(e, R, cols, (int64_t)(tu_rng_next(rng) % 4), rng);
    mat a1 = {0}, b1 = {0}; /* nn2's second pair: the same row strides */
    if (two)
        a1 = mat_new(e, M, R, a.ld - R, rng), b1 = mat_new(e, R, cols, b.ld - cols, rng);
    out o = out_new(M, cols, n0, n1, !acc, rng);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = chain(acc ? o.c0[m * o.ldc + n] : 0.0f, &a, 0, &b, nt, m, n, R);
            if (two)
                s = chain(s, &a1, 0, &b1, 0, m, n, R);
            o.want[m * o.ldc + n] = s;
        }
    const int bf = e == KT__KE_BF16;
    if (nt && bf)
        p->nt_bf16(M, n0, n1, R, a.enc, a.ld, b.enc, b.ld, NULL, o.c, o.ldc, acc);
    else if (nt)
        p->nt_f32(M, n0, n1, R, a.enc, a.ld, b.enc, b.ld, o.c, o.ldc, acc);
    else if (bf && two)
        p->nn2_bf16(M, R, n0, n1, a.enc, b.enc, a1.enc, b1.enc, a.ld, b.ld, o.c, o.ldc, 0);
    else if (bf)
        p->nn_bf16(M, R, n0, n1, a.enc, a.ld, b.enc, b.ld, o.c, o.ldc, acc);
    else
        p->nn_f32(M, R, n0, n1, a.enc, b.enc, two ? a1.enc : NULL, two ? b1.enc : NULL, a.ld, b.ld,
                  o.c, o.ldc, acc);
    char what[160];
    snprintf(what, sizeof what, "%s %s M %lld R %lld cols [%lld, %lld) acc %d", p->name,
             nt    ? "nt"
             : two ? "nn2"
                   : "nn",
             (long long)M, (long long)R, (long long)n0, (long long)n1, acc);
    expect_bits(&o, what);
    mat_free(&a), mat_free(&b), mat_free(&a1), mat_free(&b1), out_free(&o);
}

/* TN through avx2_fma: dw[n0:n1, :K] (+)= scale g[:, n0:n1)^T x over M rows */
static void check_tn(const kt__kpath *p, kt__kelem e, int64_t M, int64_t N, int64_t K, int64_t n0,
                     int64_t n1, int acc, float scale, tu_rng *rng)
{
    mat g = mat_new(e, M, N, (int64_t)(tu_rng_next(rng) % 4), rng);
    mat x = mat_new(e, M, K, (int64_t)(tu_rng_next(rng) % 4), rng);
    /* dw's rows n0..n1 are the block; its columns all written */
    out o = out_new(N, K, 0, K, 0, rng);
    for (int64_t n = n0; n < n1; n++)
        for (int64_t k = 0; k < K; k++) {
            if (!acc)
                o.c0[n * o.ldc + k] = o.c[n * o.ldc + k] = NAN;
            const float v = scale * chain(0.0f, &g, 1, &x, 0, n, k, M);
            o.want[n * o.ldc + k] = acc ? o.c0[n * o.ldc + k] + v : v;
        }
    if (e == KT__KE_BF16)
        p->tn_bf16(M, n0, n1, K, g.enc, g.ld, x.enc, x.ld, o.c, o.ldc, scale, acc, NULL);
    else
        p->tn_f32(M, n0, n1, K, g.enc, g.ld, x.enc, x.ld, o.c, o.ldc, scale, acc, NULL);
    char what[160];
    snprintf(what, sizeof what, "%s tn %s M %lld N [%lld, %lld) K %lld acc %d", p->name,
             e == KT__KE_BF16 ? "bf16" : "f32", (long long)M, (long long)n0, (long long)n1,
             (long long)K, acc);
    expect_bits(&o, what);
    mat_free(&g), mat_free(&x), out_free(&o);
}

/* MM / MM_MIXED through avx2_fma: c[:, n0:n1) = op(a) op(b), overwritten */
static void check_mm(const kt__kpath *p, kt__kelem ea, kt__kelem eb, int ta, int tb, int64_t M,
                     int64_t N, int64_t K, int64_t n0, int64_t n1, tu_rng *rng)
{
    mat a = ta ? mat_new(ea, K, M, 3, rng) : mat_new(ea, M, K, 3, rng);
    mat b = tb ? mat_new(eb, N, K, 1, rng) : mat_new(eb, K, N, 1, rng);
    out o = out_new(M, N, n0, n1, 1, rng);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++)
            o.want[m * o.ldc + n] = chain(0.0f, &a, ta, &b, tb, m, n, K);
    if (ea == KT__KE_BF16 && eb == KT__KE_BF16)
        p->mm_bf16(ta, tb, M, n0, n1, K, a.enc, a.ld, b.enc, b.ld, o.c, o.ldc, NULL);
    else
        p->mm_mixed(ea, eb, ta, tb, M, n0, n1, K, a.enc, a.ld, b.enc, b.ld, o.c, o.ldc, NULL);
    static const char *names[] = {"f32", "bf16", "f16"};
    char what[160];
    snprintf(what, sizeof what, "%s mm %s x %s ta %d tb %d M %lld N [%lld, %lld) K %lld", p->name,
             names[ea], names[eb], ta, tb, (long long)M, (long long)n0, (long long)n1,
             (long long)K);
    expect_bits(&o, what);
    mat_free(&a), mat_free(&b), out_free(&o);
}

/* sizes around the tiles and blocks */
static const int64_t rows_set[] = {1, 2, 3, 5, 6, 7, 12, 13, 95, 97, 193};
static const int64_t red_set[] = {1, 2, 7, 8, 9, 31, 256, 257, 600};
static const int64_t col_set[] = {1, 3, 7, 8, 9, 16, 17, 40, 128, 130, 300};

static int64_t pick(const int64_t *set, size_t n, tu_rng *rng) { return set[tu_rng_next(rng) % n]; }
#define PICK(set) pick(set, sizeof set / sizeof set[0], &rng)

/* the block [n0, n1) of cols: the whole, or one starting past 0 */
static void block_of(int64_t cols, tu_rng *rng, int64_t *n0, int64_t *n1)
{
    *n0 = 0, *n1 = cols;
    if (cols > 4 && tu_rng_next(rng) % 2) {
        *n0 = 1 + (int64_t)(tu_rng_next(rng) % 3);
        *n1 = cols - (int64_t)(tu_rng_next(rng) % 2);
    }
}

static void test_tiles_nt_nn(void **state)
{
    (void)state;
    if (!runnable())
        skip();
    const kt__kpath *p = path_named("avx2_fma");
    assert_non_null(p);
    tu_rng rng;
    tu_rng_seed(&rng, 2024);
    static const int kinds[] = {KT__KP_NT_BF16, KT__KP_NN_BF16, KT__KP_NN2_BF16,
                                KT__KP_NT_F32,  KT__KP_NN_F32,  KT__KP_NN2_F32};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        const kt__kelem e = kinds[k] >= KT__KP_NT_F32 ? KT__KE_F32 : KT__KE_BF16;
        /* every row count of a tile and its edges once, then random sizes */
        for (int64_t M = 1; M <= 13; M++)
            check_nt_nn(p, kinds[k], e, M, 9, 17, 0, 17, (int)(M % 2), &rng);
        for (int t = 0; t < 40; t++) {
            const int64_t cols = PICK(col_set);
            int64_t n0, n1;
            block_of(cols, &rng, &n0, &n1);
            check_nt_nn(p, kinds[k], e, PICK(rows_set), PICK(red_set), cols, n0, n1,
                        (int)(tu_rng_next(&rng) % 2), &rng);
        }
    }
}

static void test_tiles_tn(void **state)
{
    (void)state;
    if (!runnable())
        skip();
    const kt__kpath *p = path_named("avx2_fma");
    assert_non_null(p);
    tu_rng rng;
    tu_rng_seed(&rng, 2025);
    static const float scales[] = {1.0f, 0.75f, -1.5f};
    for (int e = 0; e < 2; e++)
        for (int t = 0; t < 40; t++) {
            const int64_t N = PICK(rows_set) + 1, K = PICK(col_set);
            int64_t n0, n1;
            block_of(N, &rng, &n0, &n1);
            check_tn(p, e ? KT__KE_F32 : KT__KE_BF16, PICK(red_set), N, K, n0, n1,
                     (int)(tu_rng_next(&rng) % 2), scales[tu_rng_next(&rng) % 3], &rng);
        }
}

static void test_tiles_mm(void **state)
{
    (void)state;
    if (!runnable())
        skip();
    const kt__kpath *p = path_named("avx2_fma");
    assert_non_null(p);
    tu_rng rng;
    tu_rng_seed(&rng, 2026);
    static const kt__kelem pairs[][2] = {{KT__KE_BF16, KT__KE_BF16},
                                         {KT__KE_F32, KT__KE_BF16},
                                         {KT__KE_F32, KT__KE_F16},
                                         {KT__KE_BF16, KT__KE_F32}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        for (int ta = 0; ta <= 1; ta++)
            for (int tb = 0; tb <= 1; tb++)
                for (int t = 0; t < 6; t++) {
                    const int64_t N = PICK(col_set);
                    int64_t n0, n1;
                    block_of(N, &rng, &n0, &n1);
                    check_mm(p, pairs[i][0], pairs[i][1], ta, tb, PICK(rows_set), N, PICK(red_set),
                             n0, n1, &rng);
                }
}

/* avx2_dots against float64: every row count up to 9 (its groups of 4 and their ends), groups
 * of w's rows and their ragged ends, K below, at and past a vector, accumulate both ways */
static void test_dots(void **state)
{
    (void)state;
    if (!runnable())
        skip();
    const kt__kpath *p = path_named("avx2_dots");
    assert_non_null(p);
    tu_rng rng;
    tu_rng_seed(&rng, 2027);
    static const int64_t nk[][2] = {{1, 1}, {3, 7}, {5, 8}, {6, 9}, {13, 300}, {9, 2049}};
    for (int e = 0; e < 2; e++)
        for (int64_t M = 1; M <= 9; M++)
            for (size_t j = 0; j < sizeof nk / sizeof nk[0]; j++)
                for (int acc = 0; acc <= 1; acc++) {
                    const kt__kelem el = e ? KT__KE_F32 : KT__KE_BF16;
                    const int64_t N = nk[j][0], K = nk[j][1];
                    int64_t n0, n1;
                    block_of(N, &rng, &n0, &n1);
                    mat x = mat_new(el, M, K, 2, &rng), w = mat_new(el, N, K, 1, &rng);
                    out o = out_new(M, N, n0, n1, !acc, &rng);
                    if (e)
                        p->nt_f32(M, n0, n1, K, x.enc, x.ld, w.enc, w.ld, o.c, o.ldc, acc);
                    else
                        p->nt_bf16(M, n0, n1, K, x.enc, x.ld, w.enc, w.ld, NULL, o.c, o.ldc, acc);
                    for (int64_t m = 0; m < M; m++)
                        for (int64_t n = 0; n < o.ldc; n++) {
                            const float got = o.c[m * o.ldc + n], c0 = o.c0[m * o.ldc + n];
                            if (n < n0 || n >= n1) {
                                assert_memory_equal(&got, &c0, sizeof got);
                                continue;
                            }
                            double s = acc ? c0 : 0.0, sabs = fabs(s);
                            for (int64_t k = 0; k < K; k++) {
                                const double t = (double)x.v[m * x.ld + k] * w.v[n * w.ld + k];
                                s += t, sabs += fabs(t);
                            }
                            const double tol = ((double)K + 8.0) * ldexp(sabs, -24) + 1e-30;
                            if (!(fabs(got - s) <= tol))
                                fail_msg("avx2_dots %s M %lld N %lld K %lld acc %d: y[%lld, %lld]"
                                         " = %.9g, float64 %.9g",
                                         e ? "f32" : "bf16", (long long)M, (long long)N,
                                         (long long)K, acc, (long long)m, (long long)n, got, s);
                        }
                    g_cases++, g_elems += M * o.ldc;
                    mat_free(&x), mat_free(&w), out_free(&o);
                }
}

/* Where the CPU has AVX2 but no AVX-512, the dispatch takes these paths (and reports them). */
static void test_dispatch(void **state)
{
    (void)state;
    if (!runnable())
        skip();
    if (kt__cpu_has_avx512()) {
        print_message("AVX-512 here: the dispatch takes the AVX-512 paths, not these\n");
        assert_true(strncmp(kt__kpath_pick(KT__KP_NN_BF16, 64)->name, "avx2", 4) != 0);
        return;
    }
    assert_string_equal(kt__kpath_pick(KT__KP_NN_BF16, 1)->name, "avx2_fma");
    assert_string_equal(kt__kpath_pick(KT__KP_TN_BF16, 1000)->name, "avx2_fma");
    assert_string_equal(kt__kpath_pick(KT__KP_MM_MIXED, 3)->name, "avx2_fma");
    assert_string_equal(kt__kpath_pick(KT__KP_NT_BF16, 1)->name, "avx2_dots");
    assert_string_equal(kt__kpath_pick(KT__KP_NT_BF16, KT__AVX2_DOTS_MAX_M + 1)->name, "avx2_fma");
    assert_int_equal(kt__kpath_pick(KT__KP_NT_BF16, 1)->bits, 256);
    print_message("%lld cases, %lld elements checked\n", (long long)g_cases, (long long)g_elems);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiles_nt_nn), cmocka_unit_test(test_tiles_tn),
        cmocka_unit_test(test_tiles_mm),    cmocka_unit_test(test_dots),
        cmocka_unit_test(test_dispatch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
