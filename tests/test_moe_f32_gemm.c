/* The MoE layer's f32 GEMM kernels (lib/kernels/f32_gemm.h): nt, nn, nn2 and tn on awkward sizes
 * (every row count of the row-dot path and the tiles' edges, reductions past the 128-step
 * chunks, tn past its 512 stack rows with and without a work buffer), leading dimensions wider
 * than the rows, accumulate on and off, scale != 1:
 *  - against a float64 reference, within a bound relative to sum |a||b|;
 *  - the tile path ("fma") bitwise against the scalar fmaf reference (kt__f32_gemm_*_ref);
 *  - bitwise independent of how the output is cut into blocks, cells outside a block and the
 *    rows' padding untouched, and tn's overwrite never reading dw (NaN there before);
 *  - denormal products kept (the bf16 kernels flush them; f32 keeps the caller's mode).
 * Run a second time with KT_CPU=portable, where every call is the scalar reference. Prints
 * which paths ran. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/f32_gemm.h"
#include "lib/kernels/fma_gemm.h"
#include "tests/support/test_util.h"

enum { NT = 0, NN = 1, NN2 = 2, TN = 3 };
static const char *kind_name[4] = {"nt", "nn", "nn2", "tn"};

/* One product: a (x for nt, g otherwise), b (w, or x for tn), and a second g/w pair for nn2;
 * c [cr, cc] with row stride ldc. The split dimension (blocks of one call) is c's columns for
 * nt and nn, c's rows for tn. */
typedef struct prob {
    int kind, accumulate;
    int64_t M, N, K, lda, ldb, ldc, cr, cc;
    float scale;
    float *a, *b, *a2, *b2, *c0;
} prob;

static int64_t g_cases, g_checked, g_bitwise;

static float *rand_matrix(int64_t rows, int64_t ld, tu_rng *rng)
{
    float *m = malloc((size_t)(rows * ld + 1) * sizeof *m);
    assert_non_null(m);
    for (int64_t i = 0; i < rows * ld; i++)
        m[i] = (float)tu_rng_uniform(rng, -1.0, 1.0);
    return m;
}

static void prob_init(prob *p, int kind, int64_t M, int64_t N, int64_t K, int accumulate,
                      tu_rng *rng)
{
    memset(p, 0, sizeof *p);
    p->kind = kind, p->M = M, p->N = N, p->K = K, p->accumulate = accumulate;
    p->scale = kind == TN ? 0.75f : 1.0f;
    const int64_t pad = (int64_t)(tu_rng_next(rng) % 3) * 5;
    /* nt: a [M, K] b [N, K] c [M, N]; nn: a [M, N] b [N, K] c [M, K]; tn: a [M, N] b [M, K]
     * c [N, K] */
    const int64_t arow = kind == NT ? K : N, brow = kind == NT ? N : kind == TN ? M : N;
    const int64_t bcol = kind == NT ? K : K;
    p->lda = arow + pad, p->ldb = bcol + pad;
    p->cr = kind == TN ? N : M, p->cc = kind == NT ? N : K;
    p->ldc = p->cc + pad + 1;
    p->a = rand_matrix(M, p->lda, rng);
    p->b = rand_matrix(brow, p->ldb, rng);
    if (kind == NN2) {
        p->a2 = rand_matrix(M, p->lda, rng);
        p->b2 = rand_matrix(brow, p->ldb, rng);
    }
    p->c0 = rand_matrix(p->cr, p->ldc, rng);
}

static void prob_free(prob *p) { free(p->a), free(p->b), free(p->a2), free(p->b2), free(p->c0); }

static int64_t split_size(const prob *p) { return p->kind == TN ? p->N : p->cc; }

/* c's start for a block: tn and the overwriting ones find NaN in the block (never read) */
static float *fresh_c(const prob *p)
{
    float *c = malloc((size_t)(p->cr * p->ldc + 1) * sizeof *c);
    assert_non_null(c);
    memcpy(c, p->c0, (size_t)(p->cr * p->ldc) * sizeof *c);
    if (!p->accumulate)
        for (int64_t r = 0; r < p->cr; r++)
            for (int64_t j = 0; j < p->cc; j++)
                c[r * p->ldc + j] = NAN;
    return c;
}

static void call(const prob *p, int64_t s0, int64_t s1, float *c, void *work)
{
    switch (p->kind) {
    case NT:
        kt__f32_gemm_nt(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->accumulate);
        break;
    case NN:
        kt__f32_gemm_nn(p->M, p->N, s0, s1, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->accumulate);
        break;
    case NN2:
        kt__f32_gemm_nn2(p->M, p->N, s0, s1, p->a, p->b, p->a2, p->b2, p->lda, p->ldb, c, p->ldc);
        break;
    default:
        kt__f32_gemm_tn(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->scale,
                        p->accumulate, work);
        break;
    }
}

/* Element (r, col) of the product in float64, and a bound on its error: each of the f32 sums
 * of |terms| rounds at most 2^-24 relative per step. */
static double ref_elem(const prob *p, int64_t r, int64_t col, double *tol)
{
    double s = 0.0, mag = 0.0;
    int64_t n = 0;
    for (int src = 0; src < (p->kind == NN2 ? 2 : 1); src++) {
        const float *a = src ? p->a2 : p->a, *b = src ? p->b2 : p->b;
        if (p->kind == NT)
            for (int64_t k = 0; k < p->K; k++, n++) {
                double t = (double)a[r * p->lda + k] * (double)b[col * p->ldb + k];
                s += t, mag += fabs(t);
            }
        else if (p->kind == TN)
            for (int64_t m = 0; m < p->M; m++, n++) {
                double t = (double)a[m * p->lda + r] * (double)b[m * p->ldb + col];
                s += t, mag += fabs(t);
            }
        else
            for (int64_t k = 0; k < p->N; k++, n++) {
                double t = (double)a[r * p->lda + k] * (double)b[k * p->ldb + col];
                s += t, mag += fabs(t);
            }
    }
    s *= p->scale, mag *= fabs((double)p->scale);
    const double c0 = p->c0[r * p->ldc + col];
    if (p->accumulate)
        s += c0, mag += fabs(c0);
    *tol = (double)(n + 2) * 0x1p-24 * mag + 1e-30;
    return s;
}

/* Element (r, col) by the scalar reference alone (a block of one element: operands offset to
 * it), from c0's value when accumulating. */
static float ref_one(const prob *p, int64_t r, int64_t col)
{
    float v = p->c0[r * p->ldc + col];
    switch (p->kind) {
    case NT:
        kt__f32_gemm_nt_ref(1, 0, 1, p->K, p->a + r * p->lda, p->lda, p->b + col * p->ldb, p->ldb,
                            &v, 1, p->accumulate);
        break;
    case NN:
        kt__f32_gemm_nn_ref(1, p->N, 0, 1, p->a + r * p->lda, p->lda, p->b + col, p->ldb, &v, 1,
                            p->accumulate);
        break;
    case NN2:
        kt__f32_gemm_nn_ref(1, p->N, 0, 1, p->a + r * p->lda, p->lda, p->b + col, p->ldb, &v, 1, 0);
        kt__f32_gemm_nn_ref(1, p->N, 0, 1, p->a2 + r * p->lda, p->lda, p->b2 + col, p->ldb, &v, 1,
                            1);
        break;
    default:
        kt__f32_gemm_tn_ref(p->M, 0, 1, 1, p->a + r, p->lda, p->b + col, p->ldb, &v, 1, p->scale,
                            p->accumulate);
        break;
    }
    return v;
}

static int tile_path(const prob *p)
{
    const char *path = kt__f32_gemm_path(p->kind == NT ? "nt" : p->kind == TN ? "tn" : "nn", p->M);
    return strcmp(path, "fma") == 0 || strcmp(path, "avx2_fma") == 0; /* the same sums */
}

/* One call over the whole output against float64 (every element when small, else a sample),
 * on the tile path (and where every call is the reference) bitwise the scalar reference too,
 * and the padding untouched. */
static void check_whole(const prob *p, tu_rng *rng, void *work)
{
    const int64_t S = split_size(p);
    float *c = fresh_c(p);
    call(p, 0, S, c, work);
    const int64_t nred = p->kind == NT ? p->K : p->kind == TN ? p->M : p->N;
    const int all = (double)p->cr * (double)p->cc * (double)(nred + 1) <= 4e6;
    const int64_t samples = all ? p->cr * p->cc : 500;
    const int bitwise = tile_path(p) || !kt__f32_gemm_tiled();
    for (int64_t t = 0; t < samples; t++) {
        int64_t r, col;
        if (all) {
            r = t / p->cc, col = t % p->cc;
        } else {
            r = (int64_t)(tu_rng_next(rng) % (uint64_t)p->cr);
            col = (int64_t)(tu_rng_next(rng) % (uint64_t)p->cc);
        }
        double tol;
        const double want = ref_elem(p, r, col, &tol), got = c[r * p->ldc + col];
        if (!(fabs(got - want) <= tol)) {
            print_error("%s M=%lld N=%lld K=%lld acc=%d: (%lld, %lld) = %.9g, want %.9g "
                        "(tol %.3g)\n",
                        kind_name[p->kind], (long long)p->M, (long long)p->N, (long long)p->K,
                        p->accumulate, (long long)r, (long long)col, got, want, tol);
            fail();
        }
        if (bitwise) {
            const float want_bits = ref_one(p, r, col);
            assert_memory_equal(&want_bits, &c[r * p->ldc + col], sizeof(float));
            g_bitwise++;
        }
        g_checked++;
    }
    for (int64_t r = 0; r < p->cr; r++)
        for (int64_t col = p->cc; col < p->ldc; col++)
            assert_memory_equal(&c[r * p->ldc + col], &p->c0[r * p->ldc + col], sizeof(float));
    free(c);
    g_cases++;
}

/* 1..5 blocks cut at random points: bitwise one call's result, and each block leaves the cells
 * outside it as they were. */
static void check_split(const prob *p, tu_rng *rng, void *work)
{
    const int64_t S = split_size(p);
    if (S < 2)
        return;
    float *whole = fresh_c(p), *parts = fresh_c(p);
    call(p, 0, S, whole, work);
    int64_t cuts[6] = {0};
    const int nb = 1 + (int)(tu_rng_next(rng) % 5);
    for (int i = 1; i < nb; i++)
        cuts[i] = (int64_t)(tu_rng_next(rng) % (uint64_t)S);
    cuts[nb] = S;
    for (int i = 1; i < nb; i++) /* sort the cut points */
        for (int j = i; j > 0 && cuts[j] < cuts[j - 1]; j--) {
            int64_t t = cuts[j];
            cuts[j] = cuts[j - 1], cuts[j - 1] = t;
        }
    for (int i = 0; i < nb; i++) {
        float *before = fresh_c(p);
        memcpy(before, parts, (size_t)(p->cr * p->ldc) * sizeof *before);
        call(p, cuts[i], cuts[i + 1], parts, work);
        for (int64_t r = 0; r < p->cr; r++)
            for (int64_t col = 0; col < p->ldc; col++) {
                const int64_t s = p->kind == TN ? r : col;
                if (s < cuts[i] || s >= cuts[i + 1] || col >= p->cc)
                    assert_memory_equal(&parts[r * p->ldc + col], &before[r * p->ldc + col],
                                        sizeof(float));
            }
        free(before);
    }
    assert_memory_equal(whole, parts, (size_t)(p->cr * p->ldc) * sizeof *whole);
    free(whole), free(parts);
}

static void run_case(int kind, int64_t M, int64_t N, int64_t K, tu_rng *rng)
{

    for (int acc = 0; acc < 2; acc++) {
        if (kind == NN2 && acc) /* nn2 always overwrites */
            continue;
        prob p;
        prob_init(&p, kind, M, N, K, acc, rng);
        check_whole(&p, rng, NULL);
        check_split(&p, rng, NULL);
        prob_free(&p);
    }
}

static const int64_t rows_sizes[] = {1, 2, 3, 4, 5, 11, 12, 13, 25, 37, 129};
static const int64_t dims[] = {1, 15, 16, 33, 130, 257};

/* One kind's sweep; the kind comes as the test's state (main's kinds[]). */
static void test_sweep(void **state)
{
    const int kind = *(const int *)*state;
    tu_rng rng;
    tu_rng_seed(&rng, 0x5eed0000u + (uint64_t)kind);
    for (size_t i = 0; i < sizeof rows_sizes / sizeof *rows_sizes; i++)
        for (size_t j = 0; j < sizeof dims / sizeof *dims; j++) {
            const int64_t a = dims[j], b = dims[(j + i) % (sizeof dims / sizeof *dims)];
            run_case(kind, rows_sizes[i], a, b, &rng);
        }
}

/* The in-place kernels (fma_unpacked.c) called directly at row counts the dispatch gives the
 * tiles, where they run as passes of 32 rows: nt against float64, nn and nn2 bitwise the
 * tiles' sums (kt__fma_nn), overwriting and adding. */
static void test_unpacked_passes(void **state)
{
    (void)state;
#ifdef KT__FMA_GEMM
    if (kt__cpu_has_avx512()) {
        tu_rng rng;
        tu_rng_seed(&rng, 0x5eed1111u);
        const int64_t ms[] = {25, 33, 45, 70};
        for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
            for (int acc = 0; acc < 2; acc++) {
                prob p;
                prob_init(&p, NT, ms[i], 37, 300, acc, &rng);
                float *c = fresh_c(&p);
                kt__fma_nt_dots(KT__FMA_F32, p.M, 0, p.N, p.K, p.a, p.lda, p.b, p.ldb, c, p.ldc,
                                p.accumulate);
                for (int64_t r = 0; r < p.cr; r++)
                    for (int64_t j = 0; j < p.cc; j++) {
                        double tol;
                        const double want = ref_elem(&p, r, j, &tol);
                        assert_true(fabs(c[r * p.ldc + j] - want) <= tol);
                    }
                g_checked += p.cr * p.cc;
                free(c);
                prob_free(&p);
                for (int kind = NN; kind <= NN2; kind++) {
                    prob_init(&p, kind, ms[i], 300, 70, acc, &rng);
                    float *ct = fresh_c(&p), *cd = fresh_c(&p);
                    const float *a2 = kind == NN2 ? p.a2 : NULL, *b2 = kind == NN2 ? p.b2 : NULL;
                    kt__fma_nn(KT__FMA_F32, p.M, p.N, 0, p.K, p.a, p.b, a2, b2, p.lda, p.ldb, ct,
                               p.ldc, p.accumulate);
                    kt__fma_nn_direct(KT__FMA_F32, p.M, p.N, 0, p.K, p.a, p.b, a2, b2, p.lda, p.ldb,
                                      cd, p.ldc, p.accumulate);
                    assert_memory_equal(ct, cd, (size_t)(p.cr * p.ldc) * sizeof *ct);
                    g_bitwise += p.cr * p.cc;
                    free(ct), free(cd);
                    prob_free(&p);
                }
                g_cases += 3;
            }
        return;
    }
#endif
    print_message("in-place kernels skipped: no AVX-512 (F and BW) on this CPU or in this "
                  "build\n");
}

/* The layer's shapes at a few row counts (dsv2lite's gate/up and down), sampled. */
static void test_layer_shapes(void **state)
{
    (void)state;
    if (!kt__f32_gemm_tiled()) { /* (fmaf in software: minutes at these sizes) */
        print_message("layer shapes skipped: every call is the scalar reference here, which the "
                      "sweeps check\n");
        return;
    }
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    const int64_t ms[] = {1, 4, 96, 200};
    for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
        run_case(NT, ms[i], 1408, 2048, &rng);
        run_case(NT, ms[i], 2048, 1408, &rng);
        run_case(NN, ms[i], 2048, 1408, &rng);
        run_case(TN, ms[i], 1408, 2048, &rng);
    }
}

/* tn past its stack rows: with a work buffer, and without (the in-place walk), the same bits */
static void test_tn_long(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 99);
    const int64_t ms[] = {513, 1100};
    for (size_t i = 0; i < 2; i++)
        for (int acc = 0; acc < 2; acc++) {
            prob p;
            prob_init(&p, TN, ms[i], 37, 70, acc, &rng);
            const size_t wb = kt__f32_gemm_tn_work_bytes(p.M);
            void *work = wb ? aligned_alloc(64, wb) : NULL;
            check_whole(&p, &rng, work);
            check_split(&p, &rng, work);
            float *with = fresh_c(&p), *without = fresh_c(&p);
            kt__f32_gemm_tn(p.M, 0, p.N, p.K, p.a, p.lda, p.b, p.ldb, with, p.ldc, p.scale, acc,
                            work);
            kt__f32_gemm_tn(p.M, 0, p.N, p.K, p.a, p.lda, p.b, p.ldb, without, p.ldc, p.scale, acc,
                            NULL);
            assert_memory_equal(with, without, (size_t)(p.cr * p.ldc) * sizeof *with);
            free(with), free(without), free(work);
            prob_free(&p);
        }
}

/* Products in the denormal range come out as IEEE f32 computes them, not flushed. */
static void test_denormals_kept(void **state)
{
    (void)state;
    enum { M = 24, N = 40, K = 20 };
    float x[M * K], w[N * K], y[M * N], yr[M * N];
    for (int i = 0; i < M * K; i++)
        x[i] = 0x1p-70f * (float)(1 + i % 7);
    for (int i = 0; i < N * K; i++)
        w[i] = 0x1p-70f * (float)(1 + i % 5);
    const int64_t ms[] = {2, M};
    for (int i = 0; i < 2; i++) {
        kt__f32_gemm_nt(ms[i], 0, N, K, x, K, w, K, y, N, 0);
        kt__f32_gemm_nt_ref(ms[i], 0, N, K, x, K, w, K, yr, N, 0);
        for (int64_t j = 0; j < ms[i] * N; j++) {
            assert_true(y[j] > 0.0f && y[j] < 0x1p-126f); /* denormal, not zero */
            assert_true(fabsf(y[j] - yr[j]) <= 0x1p-149f * K);
        }
    }
}

/* tn overwriting whole 32-column tiles of a 64-byte-aligned dw whose row stride is a multiple
 * of 16 floats: the tiles' streaming stores (the layer's case), bitwise the reference. */
static void test_tn_streaming_store(void **state)
{
    (void)state;
    enum { M = 40, N = 30, K = 96, LD = 112 };
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    float *g = rand_matrix(M, N, &rng), *x = rand_matrix(M, K, &rng);
    float *dw = aligned_alloc(64, (size_t)N * LD * sizeof *dw);
    float *want = malloc((size_t)N * LD * sizeof *want);
    assert_non_null(dw);
    assert_non_null(want);
    for (int64_t i = 0; i < (int64_t)N * LD; i++)
        dw[i] = want[i] = NAN;
    kt__f32_gemm_tn(M, 0, N, K, g, N, x, K, dw, LD, 0.5f, 0, NULL);
    kt__f32_gemm_tn_ref(M, 0, N, K, g, N, x, K, want, LD, 0.5f, 0);
    for (int64_t n = 0; n < N; n++) {
        assert_memory_equal(dw + n * LD, want + n * LD, (size_t)K * sizeof *dw);
        for (int64_t k = K; k < LD; k++) /* the padding untouched */
            assert_true(isnan(dw[n * LD + k]));
    }
    free(g), free(x), free(dw), free(want);
}

/* Empty products: no rows (tn: dw = 0, or unchanged when adding), an empty reduction (nt, nn:
 * y = 0, or unchanged when adding), an empty block (nothing written). */
static void test_empty(void **state)
{
    (void)state;
    float a[64], b[64], y[16];
    for (int i = 0; i < 64; i++)
        a[i] = b[i] = 1.0f;
    for (int acc = 0; acc < 2; acc++) {
        for (int i = 0; i < 16; i++)
            y[i] = 3.0f;
        kt__f32_gemm_tn(0, 0, 2, 8, a, 8, b, 8, y, 8, 1.0f, acc, NULL);
        for (int i = 0; i < 16; i++)
            assert_true(y[i] == (acc ? 3.0f : 0.0f));
        for (int64_t M = 1; M <= 6; M += 5) { /* the row-dot path and the tiles */
            for (int i = 0; i < 16; i++)
                y[i] = 3.0f;
            kt__f32_gemm_nt(M, 0, 2, 0, a, 8, b, 8, y, 2, acc);
            for (int i = 0; i < 2 * M; i++)
                assert_true(y[i] == (acc ? 3.0f : 0.0f));
            for (int i = 0; i < 16; i++)
                y[i] = 3.0f;
            kt__f32_gemm_nn(M, 0, 0, 2, a, 8, b, 8, y, 2, acc);
            for (int i = 0; i < 2 * M; i++)
                assert_true(y[i] == (acc ? 3.0f : 0.0f));
        }
    }
    for (int i = 0; i < 16; i++)
        y[i] = 3.0f;
    kt__f32_gemm_nt(2, 1, 1, 8, a, 8, b, 8, y, 8, 0);
    kt__f32_gemm_nn(2, 8, 1, 1, a, 8, b, 8, y, 8, 0);
    kt__f32_gemm_nn2(2, 8, 1, 1, a, b, a, b, 8, 8, y, 8);
    kt__f32_gemm_tn(2, 1, 1, 8, a, 8, b, 8, y, 8, 1.0f, 0, NULL);
    kt__f32_gemm_nt(0, 0, 2, 8, a, 8, b, 8, y, 8, 0);
    for (int i = 0; i < 16; i++)
        assert_true(y[i] == 3.0f);
}

static void test_report(void **state)
{
    (void)state;
    const char *forced = getenv("KT_CPU");
    print_message("f32 gemm paths: nt %s at 1 row, %s at %d rows; nn and tn %s (cpu: %s%s%s); "
                  "%lld cases, %lld elements checked, %lld compared bitwise with the reference\n",
                  kt__f32_gemm_path("nt", 1), kt__f32_gemm_path("nt", KT__FMA_ROWS_MAX_M + 1),
                  KT__FMA_ROWS_MAX_M + 1, kt__f32_gemm_path("nn", 1), kt_cpu_describe(),
                  forced ? ", KT_CPU=" : "", forced ? forced : "", (long long)g_cases,
                  (long long)g_checked, (long long)g_bitwise);
    if (forced != NULL && strcmp(forced, "portable") == 0)
        assert_string_equal(kt__f32_gemm_path("nn", 64), "scalar");
    if (forced == NULL && kt__cpu_has_avx512())
        assert_string_equal(kt__f32_gemm_path("nn", 64), "fma");
    if (forced == NULL && !kt__cpu_has_avx512() && kt__cpu_has_avx2())
        assert_string_equal(kt__f32_gemm_path("nn", 64), "avx2_fma");
}

int main(void)
{
    static int kinds[4] = {NT, NN, NN2, TN};
    const struct CMUnitTest tests[] = {
        /* (cmocka_unit_test_prestate's fields, with a name per kind) */
        {"test_nt", test_sweep, NULL, NULL, &kinds[NT]},
        {"test_nn", test_sweep, NULL, NULL, &kinds[NN]},
        {"test_nn2", test_sweep, NULL, NULL, &kinds[NN2]},
        {"test_tn", test_sweep, NULL, NULL, &kinds[TN]},
        cmocka_unit_test(test_unpacked_passes),
        cmocka_unit_test(test_layer_shapes),
        cmocka_unit_test(test_tn_long),
        cmocka_unit_test(test_denormals_kept),
        cmocka_unit_test(test_tn_streaming_store),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
