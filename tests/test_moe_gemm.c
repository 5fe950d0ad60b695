/* The MoE bf16 GEMM kernels (lib/kernels/bf16_gemm.h): nt, nn and tn_acc against a float64
 * reference computed from the same bf16 values, within a bound relative to sum |a||b|, on
 * awkward sizes (1..100 in every dimension, and 768/1408/2048 with small ones), leading
 * dimensions wider than the rows, accumulate on and off, scale != 1; cells outside the
 * requested block (and the padding of every row) untouched; results bitwise independent of
 * how the output columns (rows for tn) are cut into blocks; the chunked reductions of nn
 * (N > 256, odd too) and tn (M > 2048). Run a second time with KT_CPU=portable, where the
 * dispatch must be exactly the scalar reference. Prints which path ran. */
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
#include "lib/kernels/amx_gemm.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/silu_epilogue.h"
#include "lib/kernels/fma_gemm.h"
#include "tests/support/test_util.h"

/* NT_DOTS: nt by kt__fma_nt_dots called directly (every row count, whichever path the
 * dispatch takes on this CPU) */
enum { NT = 0, NN = 1, TN = 2, NT_DOTS = 3 };
static const char *kind_name[4] = {"nt", "nn", "tn", "nt_dots"};

static int vector_path(void) { return kt__cpu_has_avx512() && kt__cpu_has_avx512_bf16(); }

/* Whether a product of M rows gives the scalar reference's bits: the portable path is the
 * reference itself, and the FMA paths (fma_gemm.h, and avx2_fma: avx2_gemm.h) sum in its
 * order, but for NT and NN add to y's value product by product where the reference adds the
 * sum. */
static int ref_bits(int64_t M, int kind, int accumulate)
{
    if (kind == NT_DOTS)
        return 0;
    const char *path = kt__bf16_gemm_kind_path(kind_name[kind], M);
    if (strcmp(path, "scalar") == 0)
        return 1;
    return (strcmp(path, "fma") == 0 || strcmp(path, "avx2_fma") == 0) &&
           (!accumulate || kind == TN);
}

/* One problem. Operands a [ar, lda], b [br, ldb], output c [cr, ldc] (c0 its initial value):
 *   nt: a = x [M,K], b = w [N,K], c = y [M,N], blocks over N, reduction K
 *   nn: a = g [M,N], b = w [N,K], c = y [M,K], blocks over K, reduction N
 *   tn: a = g [M,N], b = x [M,K], c = dw [N,K], blocks over N (rows of dw), reduction M */
typedef struct prob {
    int kind;
    int64_t M, N, K;
    int64_t lda, ldb, ldc;
    int64_t ar, br, cr, cc; /* rows of a, b, c; valid columns of c */
    uint16_t *a, *b;
    float *c0, *c;
    int accumulate;
    float scale;
    void *work; /* tn: the kernel's work buffer where it wants one (above 512 rows) */
} prob;

static int64_t split_size(const prob *p) { return p->kind == NN ? p->K : p->N; }

static int reduces_k(int kind) { return kind == NT || kind == NT_DOTS; }

static void prob_init(prob *p, int kind, int64_t M, int64_t N, int64_t K, tu_rng *rng)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->M = M, p->N = N, p->K = K;
    int64_t acols, bcols;
    switch (kind) {
    case NT:
    case NT_DOTS:
        p->ar = M, acols = K, p->br = N, bcols = K, p->cr = M, p->cc = N;
        break;
    case NN:
        p->ar = M, acols = N, p->br = N, bcols = K, p->cr = M, p->cc = K;
        break;
    default:
        p->ar = M, acols = N, p->br = M, bcols = K, p->cr = N, p->cc = K;
        break;
    }
    /* padded rows about half the time */
    p->lda = acols + (tu_rng_next(rng) % 2 ? (int64_t)(tu_rng_next(rng) % 5) : 0);
    p->ldb = bcols + (tu_rng_next(rng) % 2 ? (int64_t)(tu_rng_next(rng) % 5) : 0);
    p->ldc = p->cc + (tu_rng_next(rng) % 2 ? (int64_t)(tu_rng_next(rng) % 5) : 0);
    p->accumulate = (int)(tu_rng_next(rng) % 2);
    static const float scales[] = {1.0f, 0.75f, -1.5f, 3.0f};
    p->scale = scales[tu_rng_next(rng) % 4];
    const size_t na = (size_t)(p->ar * p->lda), nb = (size_t)(p->br * p->ldb),
                 nc = (size_t)(p->cr * p->ldc);
    p->a = malloc((na ? na : 1) * sizeof *p->a);
    p->b = malloc((nb ? nb : 1) * sizeof *p->b);
    /* 64-byte aligned outputs, as the layer's: rows whose stride is a multiple of 16 floats
     * then start on cache lines, which is where the streaming-store path (tn overwrite) runs */
    const size_t cbytes = ((nc ? nc : 1) * sizeof *p->c + 63) / 64 * 64;
    p->c0 = aligned_alloc(64, cbytes);
    p->c = aligned_alloc(64, cbytes);
    assert_non_null(p->a);
    assert_non_null(p->b);
    assert_non_null(p->c0);
    assert_non_null(p->c);
    const size_t wb = kind == TN ? kt__bf16_gemm_tn_work_bytes(M) : 0;
    if (wb > 0) {
        p->work = aligned_alloc(64, wb); /* a multiple of 64 */
        assert_non_null(p->work);
    }
    for (size_t i = 0; i < na; i++)
        p->a[i] = kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1));
    for (size_t i = 0; i < nb; i++)
        p->b[i] = kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1));
    for (size_t i = 0; i < nc; i++)
        p->c0[i] = (float)tu_rng_uniform(rng, -2, 2);
    /* overwriting calls must not read the output: NaN there would show in the result */
    if (!p->accumulate)
        for (int64_t r = 0; r < p->cr; r++)
            for (int64_t col = 0; col < p->cc; col++)
                p->c0[r * p->ldc + col] = NAN;
}

static void prob_free(prob *p)
{
    free(p->a);
    free(p->b);
    free(p->c0);
    free(p->c);
    free(p->work);
}

static void reset_c(prob *p) { memcpy(p->c, p->c0, (size_t)(p->cr * p->ldc) * sizeof *p->c); }

static void call_block(const prob *p, int64_t s0, int64_t s1, float *c)
{
    switch (p->kind) {
    case NT:
        kt__bf16_gemm_nt(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->accumulate);
        break;
    case NT_DOTS:
#ifdef KT__FMA_GEMM
        kt__fma_nt_dots(KT__FMA_BF16, p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc,
                        p->accumulate);
#endif
        break;
    case NN:
        kt__bf16_gemm_nn(p->M, p->N, s0, s1, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->accumulate);
        break;
    default:
        kt__bf16_gemm_tn(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->scale,
                         p->accumulate, p->work);
        break;
    }
}

static void call_ref(const prob *p, int64_t s0, int64_t s1, float *c)
{
    switch (p->kind) {
    case NT:
        kt__bf16_gemm_nt_ref(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc,
                             p->accumulate);
        break;
    case NN:
        kt__bf16_gemm_nn_ref(p->M, p->N, s0, s1, p->a, p->lda, p->b, p->ldb, c, p->ldc,
                             p->accumulate);
        break;
    default:
        kt__bf16_gemm_tn_ref(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->scale,
                             p->accumulate);
        break;
    }
}

static double bf(uint16_t v) { return (double)kt_bf16_to_f32_1(v); }

/* The float64 value of output (r, col) and the error allowed for it. */
static double ref_elem(const prob *p, int64_t r, int64_t col, double *tol)
{
    double s = 0.0, sabs = 0.0;
    int64_t nred;
    switch (p->kind) {
    case NT:
    case NT_DOTS:
        nred = p->K;
        for (int64_t k = 0; k < p->K; k++) {
            const double t = bf(p->a[r * p->lda + k]) * bf(p->b[col * p->ldb + k]);
            s += t, sabs += fabs(t);
        }
        break;
    case NN:
        nred = p->N;
        for (int64_t n = 0; n < p->N; n++) {
            const double t = bf(p->a[r * p->lda + n]) * bf(p->b[n * p->ldb + col]);
            s += t, sabs += fabs(t);
        }
        break;
    default:
        nred = p->M;
        for (int64_t m = 0; m < p->M; m++) {
            const double t = bf(p->a[m * p->lda + r]) * bf(p->b[m * p->ldb + col]);
            s += t, sabs += fabs(t);
        }
        break;
    }
    const double c0 = p->accumulate ? p->c0[r * p->ldc + col] : 0.0;
    double v;
    if (p->kind == TN) {
        v = c0 + (double)p->scale * s;
        sabs *= fabs((double)p->scale);
    } else {
        v = c0 + s;
    }
    /* f32 sums of nred products (in any order): (nred + a few tree levels) units of
     * rounding of sum |a||b|, plus the final scale/add roundings. */
    *tol = ((double)nred + 16.0) * ldexp(sabs, -24) + ldexp(fabs(c0) + fabs(v), -23) + 1e-30;
    return v;
}

static int64_t g_checked, g_cases;
/* row counts whose product takes another path than the rows it is compared with (NN's stream
 * path, NT's rows path) */
static int64_t g_path_skips, g_nt_path_skips;

/* Runs the whole block once and checks it: every element when small, else a sample. */
static void check_prob(prob *p, tu_rng *rng)
{
    const int64_t S = split_size(p);
    reset_c(p);
    call_block(p, 0, S, p->c);
    const int64_t nred = reduces_k(p->kind) ? p->K : p->kind == NN ? p->N : p->M;
    const double work = (double)p->cr * (double)p->cc * (double)(nred + 1);
    const int all = work <= 2e6;
    const int64_t samples = all ? p->cr * p->cc : 400;
    for (int64_t t = 0; t < samples; t++) {
        int64_t r, col;
        if (all) {
            r = t / p->cc, col = t % p->cc;
        } else if (t < 4) { /* corners */
            r = (t & 1) ? p->cr - 1 : 0, col = (t & 2) ? p->cc - 1 : 0;
        } else {
            r = (int64_t)(tu_rng_next(rng) % (uint64_t)p->cr);
            col = (int64_t)(tu_rng_next(rng) % (uint64_t)p->cc);
        }
        double tol;
        const double want = ref_elem(p, r, col, &tol);
        const double got = p->c[r * p->ldc + col];
        if (!(fabs(got - want) <= tol)) {
            print_error("%s M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld acc=%d scale=%g: "
                        "element (%lld, %lld) = %.9g, want %.9g (tol %.3g)\n",
                        kind_name[p->kind], (long long)p->M, (long long)p->N, (long long)p->K,
                        (long long)p->lda, (long long)p->ldb, (long long)p->ldc, p->accumulate,
                        (double)p->scale, (long long)r, (long long)col, got, want, tol);
            fail();
        }
        g_checked++;
    }
    /* the padding of each row is never written */
    for (int64_t r = 0; r < p->cr; r++)
        for (int64_t col = p->cc; col < p->ldc; col++)
            assert_memory_equal(&p->c[r * p->ldc + col], &p->c0[r * p->ldc + col], sizeof(float));
    if (ref_bits(p->M, p->kind, p->accumulate)) {
        float *c2 = malloc((size_t)(p->cr * p->ldc) * sizeof *c2 + 1);
        assert_non_null(c2);
        memcpy(c2, p->c0, (size_t)(p->cr * p->ldc) * sizeof *c2);
        call_ref(p, 0, S, c2);
        assert_memory_equal(c2, p->c, (size_t)(p->cr * p->ldc) * sizeof *c2);
        free(c2);
    }
    g_cases++;
}

/* Cuts [0, S) into 1..5 blocks at random points (no alignment), computes each block by its
 * own call, checks the result bitwise against one call, and that a block leaves the cells
 * outside it untouched. */
static void check_split(prob *p, tu_rng *rng)
{
    const int64_t S = split_size(p);
    if (S < 2)
        return;
    reset_c(p);
    call_block(p, 0, S, p->c);
    const size_t bytes = (size_t)(p->cr * p->ldc) * sizeof(float);
    float *c2 = malloc(bytes + 1);
    assert_non_null(c2);
    for (int trial = 0; trial < 3; trial++) {
        memcpy(c2, p->c0, bytes);
        int64_t s0 = 0;
        while (s0 < S) {
            int64_t len = 1 + (int64_t)(tu_rng_next(rng) % (uint64_t)(S / 2 + 1));
            int64_t s1 = s0 + len > S ? S : s0 + len;
            call_block(p, s0, s1, c2);
            /* cells after the block: untouched so far */
            for (int64_t r = 0; r < p->cr; r++)
                for (int64_t col = 0; col < p->cc; col++) {
                    const int64_t pos = p->kind == TN ? r : col;
                    if (pos >= s1)
                        assert_memory_equal(&c2[r * p->ldc + col], &p->c0[r * p->ldc + col],
                                            sizeof(float));
                }
            s0 = s1;
        }
        if (memcmp(c2, p->c, bytes) != 0) {
            print_error("%s M=%lld N=%lld K=%lld: block split changes the result\n",
                        kind_name[p->kind], (long long)p->M, (long long)p->N, (long long)p->K);
            fail();
        }
    }
    free(c2);
}

static const int64_t small_sizes[] = {1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 100};
#define N_SMALL ((int)(sizeof small_sizes / sizeof small_sizes[0]))

static void sweep_small(int kind)
{
    tu_rng rng;
    tu_rng_seed(&rng, 1234 + (uint64_t)kind);
    for (int i = 0; i < N_SMALL; i++)
        for (int j = 0; j < N_SMALL; j++)
            for (int l = 0; l < N_SMALL; l++) {
                const int64_t M = small_sizes[i], N = small_sizes[j], K = small_sizes[l];
                if (M * N * K > 120000)
                    continue;
                prob p;
                prob_init(&p, kind, M, N, K, &rng);
                check_prob(&p, &rng);
                if ((i + j + l) % 3 == 0)
                    check_split(&p, &rng);
                prob_free(&p);
            }
}

static void test_nt_small(void **state)
{
    (void)state;
    sweep_small(NT);
}

static void test_nn_small(void **state)
{
    (void)state;
    sweep_small(NN);
}

static void test_tn_small(void **state)
{
    (void)state;
    sweep_small(TN);
}

/* The NT dot-product kernel called directly, on any CPU with AVX-512: every block height and
 * group width (1 to 8 rows a block, groups of 2 to 4 rows of w and their ragged ends), several
 * passes of 32 rows, reductions with a masked tail, of one chunk and of several (chunks shrink
 * as rows are added). */
static void test_nt_dots(void **state)
{
    (void)state;
#ifdef KT__FMA_GEMM
    if (kt__cpu_has_avx512()) {
        static const int64_t rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 21, 31, 32, 33, 40, 70};
        static const int64_t nk[][2] = {{1, 1}, {3, 31}, {5, 33}, {37, 300}, {13, 2100}, {6, 4100}};
        tu_rng rng;
        tu_rng_seed(&rng, 4321);
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
            for (size_t j = 0; j < sizeof nk / sizeof nk[0]; j++) {
                prob p;
                prob_init(&p, NT_DOTS, rows[i], nk[j][0], nk[j][1], &rng);
                check_prob(&p, &rng);
                check_split(&p, &rng);
                prob_free(&p);
            }
        return;
    }
#endif
    print_message("nt dots kernel skipped: no AVX-512 (F and BW) on this CPU or in this build\n");
}

/* Operands of nn and nn2 for up to `rows` rows: two stacked sources (g then g1, rows ldg
 * apart; w then w1, N rows ldw apart) of bf16 values in [-1, 1], a random initial y0 and two
 * outputs of the same size to compare. */
typedef struct nn_operands {
    uint16_t *g, *w;
    const uint16_t *g1, *w1;
    float *y0, *ya, *yb;
    size_t ybytes;
} nn_operands;

static void nn_operands_init(nn_operands *o, tu_rng *rng, int64_t rows, int64_t N, int64_t ldg,
                             int64_t ldw, int64_t ldy)
{
    o->g = malloc((size_t)(2 * rows * ldg) * sizeof *o->g);
    o->w = malloc((size_t)(2 * N * ldw) * sizeof *o->w);
    o->ybytes = (size_t)(rows * ldy) * sizeof(float);
    o->y0 = malloc(o->ybytes);
    o->ya = malloc(o->ybytes);
    o->yb = malloc(o->ybytes);
    assert_true(o->g && o->w && o->y0 && o->ya && o->yb);
    for (int64_t j = 0; j < 2 * rows * ldg; j++)
        o->g[j] = kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1));
    for (int64_t j = 0; j < 2 * N * ldw; j++)
        o->w[j] = kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1));
    for (int64_t j = 0; j < rows * ldy; j++)
        o->y0[j] = (float)tu_rng_uniform(rng, -2, 2);
    o->g1 = o->g + rows * ldg;
    o->w1 = o->w + N * ldw;
}

static void nn_operands_free(nn_operands *o)
{
    free(o->g), free(o->w), free(o->y0), free(o->ya), free(o->yb);
}

/* The NN kernel that widens w's rows in registers, called directly on any CPU with AVX-512:
 * bitwise the FMA tiles' sums (kt__fma_nn), for nn and nn2, overwriting and adding, on every
 * block height (1 to 12 rows, passes of 32), reductions cut into chunks by the buffer of g (up
 * to 325 rows) and by the 512 KiB of w a chunk may hold (wide column ranges), ragged column
 * ends, and w's rows 4 KiB apart. */
static void test_nn_direct(void **state)
{
    (void)state;
#ifdef KT__FMA_GEMM
    if (kt__cpu_has_avx512()) {
        static const int64_t rows[] = {1, 3, 6, 8, 11, 12, 13, 15, 24, 33, 45};
        static const int64_t shapes[][4] = {/* N, ldw, k0, k1 */
                                            {1, 40, 0, 33},
                                            {700, 130, 3, 127},
                                            {300, 2048, 0, 2048},
                                            {40, 3000, 17, 2900}};
        tu_rng rng;
        tu_rng_seed(&rng, 4322);
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            const int64_t N = shapes[i][0], ldw = shapes[i][1], k0 = shapes[i][2];
            const int64_t k1 = shapes[i][3], ldg = N + 5, ldy = ldw + 3, big = 45;
            nn_operands o;
            nn_operands_init(&o, &rng, big, N, ldg, ldw, ldy);
            for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
                for (int kind = 0; kind < 3; kind++) { /* nn, nn adding, nn2 */
                    const int64_t M = rows[r];
                    const int add = kind == 1;
                    memcpy(o.ya, o.y0, o.ybytes);
                    memcpy(o.yb, o.y0, o.ybytes);
                    kt__fma_nn(KT__FMA_BF16, M, N, k0, k1, o.g, o.w, kind == 2 ? o.g1 : NULL,
                               kind == 2 ? o.w1 : NULL, ldg, ldw, o.ya, ldy, add);
                    kt__fma_nn_direct(KT__FMA_BF16, M, N, k0, k1, o.g, o.w, kind == 2 ? o.g1 : NULL,
                                      kind == 2 ? o.w1 : NULL, ldg, ldw, o.yb, ldy, add);
                    if (memcmp(o.ya, o.yb, o.ybytes) != 0) {
                        print_error("nn_direct M=%lld N=%lld k=[%lld, %lld) kind %d: not the "
                                    "tiles' bits\n",
                                    (long long)M, (long long)N, (long long)k0, (long long)k1, kind);
                        fail();
                    }
                    g_cases++;
                    g_checked += M * (k1 - k0);
                }
            nn_operands_free(&o);
        }
        return;
    }
#endif
    print_message("nn direct kernel skipped: no AVX-512 (F and BW) on this CPU or in this "
                  "build\n");
}

/* Model-sized dimensions (768, 1408, 2048) with small and odd ones, per kind. */
typedef struct big_shape {
    int kind;
    int64_t M, N, K;
} big_shape;

static const big_shape big_shapes[] = {
    {NT, 1, 1408, 2048}, {NT, 3, 768, 2048},  {NT, 17, 100, 1408}, {NT, 33, 63, 2048},
    {NT, 7, 2048, 768},  {NT, 100, 31, 1408}, {NN, 1, 1408, 2048}, {NN, 3, 2048, 768},
    {NN, 17, 1408, 100}, {NN, 33, 768, 63},   {NN, 15, 63, 2048},  {NN, 100, 1408, 31},
    {NN, 5, 1025, 40},   {NN, 13, 513, 33},   {NN, 131, 1027, 70}, {NN, 40, 1025, 70},
    {TN, 1, 1408, 2048}, {TN, 7, 768, 2048},  {TN, 17, 100, 1408}, {TN, 33, 2048, 63},
    {TN, 768, 15, 33},   {TN, 1408, 7, 100},  {TN, 2048, 3, 32},
};

static void test_big_shapes(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 99);
    for (size_t i = 0; i < sizeof big_shapes / sizeof big_shapes[0]; i++) {
        const big_shape *s = &big_shapes[i];
        prob p;
        prob_init(&p, s->kind, s->M, s->N, s->K, &rng);
        check_prob(&p, &rng);
        check_split(&p, &rng);
        prob_free(&p);
    }
}

/* NN's rows path whatever w's row stride (the layer's gate/up, rows 4 KiB apart, and its
 * down projection, 2816 B apart): its narrower column groups (width 128 down to 32) up to 512
 * rows, and above, its chunks of rows (513: 256 + 257; 1100: three), against the reference
 * and split. */
static void test_nn_rows_path(void **state)
{
    (void)state;
    static const int64_t Ms[] = {24, 96, 300, 512, 513, 1100};
    static const int64_t lds[] = {2048, 1408};
    for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++)
        for (size_t l = 0; l < sizeof lds / sizeof lds[0]; l++) {
            prob p;
            uint64_t seed = 31;
            do { /* a draw without row padding, so that ldb is the stride wanted */
                tu_rng rng;
                tu_rng_seed(&rng, seed++);
                prob_init(&p, NN, Ms[i], 37, lds[l], &rng);
                if (p.ldb != lds[l]) {
                    prob_free(&p);
                    continue;
                }
                check_prob(&p, &rng);
                check_split(&p, &rng);
                prob_free(&p);
                break;
            } while (seed < 100);
            assert_true(seed < 100);
        }
}

/* nn2 (y = g0 w0 + g1 w1, one pass): against the float64 sum of both products within the
 * bound of a 2N-term f32 sum, bitwise independent of the column split and of streaming the
 * stores, and on the portable path (where it is defined as them) the two nn calls. Sizes span the
 * stream path (M = 1 and 13), the rows path (odd N, N over a chunk of 256 rows, M from 24 to
 * 100) and its chunks of rows
 * (M above 512). */
static void test_nn2(void **state)
{
    (void)state;
    static const int64_t shapes[][3] = {{1, 37, 45},    {13, 300, 160}, {24, 7, 33},
                                        {96, 513, 130}, {100, 64, 300}, {530, 41, 40}};
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int64_t M = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
        const int64_t ldg = N + 3, ldw = K + 1, ldy = K + 2;
        uint16_t *g = malloc((size_t)(2 * M * ldg) * sizeof *g);
        uint16_t *w = malloc((size_t)(2 * N * ldw) * sizeof *w);
        float *y = malloc((size_t)(M * ldy) * sizeof *y),
              *y2 = malloc((size_t)(M * ldy) * sizeof *y2);
        assert_true(g && w && y && y2);
        for (int64_t j = 0; j < 2 * M * ldg; j++)
            g[j] = kt_f32_to_bf16_1((float)tu_rng_uniform(&rng, -1, 1));
        for (int64_t j = 0; j < 2 * N * ldw; j++)
            w[j] = kt_f32_to_bf16_1((float)tu_rng_uniform(&rng, -1, 1));
        const uint16_t *g0 = g, *g1 = g + M * ldg, *w0 = w, *w1 = w + N * ldw;
        for (int64_t j = 0; j < M * ldy; j++)
            y[j] = y2[j] = NAN; /* overwritten, never read */
        kt__bf16_gemm_nn2(M, N, 0, K, g0, w0, g1, w1, ldg, ldw, y, ldy, 0);
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < K; c++) {
                double sum = 0.0, sabs = 0.0;
                for (int64_t n = 0; n < N; n++) {
                    const double t0 = bf(g0[r * ldg + n]) * bf(w0[n * ldw + c]);
                    const double t1 = bf(g1[r * ldg + n]) * bf(w1[n * ldw + c]);
                    sum += t0 + t1, sabs += fabs(t0) + fabs(t1);
                }
                const double tol = (2.0 * (double)N + 16.0) * ldexp(sabs, -24) + 1e-30;
                if (!(fabs(y[r * ldy + c] - sum) <= tol)) {
                    print_error("nn2 M=%lld N=%lld K=%lld: (%lld, %lld) = %.9g, want %.9g\n",
                                (long long)M, (long long)N, (long long)K, (long long)r,
                                (long long)c, (double)y[r * ldy + c], sum);
                    fail();
                }
            }
        for (int64_t r = 0; r < M; r++) /* the row padding untouched */
            for (int64_t c = K; c < ldy; c++)
                assert_true(isnan(y[r * ldy + c]));
        for (int64_t c0 = 0; c0 < K;) { /* random column blocks */
            int64_t c1 = c0 + 1 + (int64_t)(tu_rng_next(&rng) % (uint64_t)(K / 2 + 1));
            c1 = c1 > K ? K : c1;
            kt__bf16_gemm_nn2(M, N, c0, c1, g0, w0, g1, w1, ldg, ldw, y2, ldy, 0);
            c0 = c1;
        }
        assert_memory_equal(y, y2, (size_t)(M * ldy) * sizeof *y);
        { /* stored past the caches (64-byte aligned rows, so whole blocks stream): same bits */
            const int64_t lda = (K + 15) / 16 * 16;
            float *ya = aligned_alloc(64, (size_t)(M * lda) * sizeof *ya);
            float *yb = aligned_alloc(64, (size_t)(M * lda) * sizeof *yb);
            assert_true(ya && yb);
            kt__bf16_gemm_nn2(M, N, 0, K, g0, w0, g1, w1, ldg, ldw, ya, lda, 0);
            kt__bf16_gemm_nn2(M, N, 0, K, g0, w0, g1, w1, ldg, ldw, yb, lda, 1);
            for (int64_t r = 0; r < M; r++) {
                assert_memory_equal(ya + r * lda, yb + r * lda, (size_t)K * sizeof *ya);
                assert_memory_equal(ya + r * lda, y + r * ldy, (size_t)K * sizeof *ya);
            }
            free(ya), free(yb);
        }
        if (strcmp(kt__bf16_gemm_kind_path("nn", M), "scalar") == 0) {
            kt__bf16_gemm_nn_ref(M, N, 0, K, g0, ldg, w0, ldw, y2, ldy, 0);
            kt__bf16_gemm_nn_ref(M, N, 0, K, g1, ldg, w1, ldw, y2, ldy, 1);
            assert_memory_equal(y, y2, (size_t)(M * ldy) * sizeof *y);
        }
        g_cases++;
        g_checked += M * K;
        free(g), free(w), free(y), free(y2);
    }
}

/* An M-row call's output `few` against a call of big_m rows (`big`), both from y0 (rows ldy
 * apart): its M rows are the big call's bits (a row's sums do not depend on the other rows),
 * and the rest of the buffer is untouched. cols: the columns each row computed. */
static void check_first_rows(const float *few, const float *big, const float *y0, int64_t M,
                             int64_t big_m, int64_t ldy, int64_t cols)
{
    assert_memory_equal(few, big, (size_t)(M * ldy) * sizeof *few);
    assert_memory_equal(few + M * ldy, y0 + M * ldy, (size_t)((big_m - M) * ldy) * sizeof *few);
    g_cases++;
    g_checked += M * cols;
}

/* NN's stream path (M <= 16 rows; from 6, groups of 8 pairs; above 12, two row tiles) against
 * its rows path (more rows): a row's sums do not depend on the other rows, so the first M rows of
 * an 18-row call must be the M-row call's bits, for nn (overwrite and add) and nn2, on an odd
 * reduction, padded rows, column ranges wider than one pass of the stream path's accumulators
 * (6144 / M columns up to 12 rows, 16384 / M above; 6500 for one row) and ragged edges. */
static void test_nn_stream_path(void **state)
{
    (void)state;
    enum { BIG_M = KT__BF16_NN_STREAM_MAX_M + 2 };
    static const int64_t shapes[][4] = {/* N, K, k0, k1 */
                                        {1409, 2100, 0, 2100},
                                        {37, 2100, 5, 1999},
                                        {2048, 1408, 96, 1408},
                                        {1, 40, 0, 33},
                                        {5, 6500, 0, 6500}};
    tu_rng rng;
    tu_rng_seed(&rng, 79);
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int64_t N = shapes[i][0], K = shapes[i][1], k0 = shapes[i][2], k1 = shapes[i][3];
        const int64_t ldg = N + 3, ldw = K + 5, ldy = K + 2;
        nn_operands o;
        nn_operands_init(&o, &rng, BIG_M, N, ldg, ldw, ldy);
        const uint16_t *g = o.g, *w = o.w, *g1 = o.g1, *w1 = o.w1;
        const float *y0 = o.y0;
        float *big = o.ya, *few = o.yb;
        for (int kind = 0; kind < 3; kind++) { /* nn, nn adding, nn2 */
            memcpy(big, y0, (size_t)(BIG_M * ldy) * sizeof *big);
            if (kind < 2)
                kt__bf16_gemm_nn(BIG_M, N, k0, k1, g, ldg, w, ldw, big, ldy, kind);
            else
                kt__bf16_gemm_nn2(BIG_M, N, k0, k1, g, w, g1, w1, ldg, ldw, big, ldy, 0);
            for (int64_t M = 1; M <= KT__BF16_NN_STREAM_MAX_M; M++) {
                if (strcmp(kt__bf16_gemm_kind_path("nn", M),
                           kt__bf16_gemm_kind_path("nn", BIG_M)) != 0) {
                    g_path_skips++; /* other sums; checked against the reference elsewhere */
                    continue;
                }
                memcpy(few, y0, (size_t)(BIG_M * ldy) * sizeof *few);
                if (kind < 2)
                    kt__bf16_gemm_nn(M, N, k0, k1, g, ldg, w, ldw, few, ldy, kind);
                else
                    kt__bf16_gemm_nn2(M, N, k0, k1, g, w, g1, w1, ldg, ldw, few, ldy, 0);
                check_first_rows(few, big, y0, M, BIG_M, ldy, k1 - k0);
            }
        }
        nn_operands_free(&o);
    }
}

/* NT's rows path (up to KT__BF16_NT_ROWS_MAX_M rows of x: w one row at a time, up to 2 rows of
 * x as two halves side by side, the odd row alone) against its tiles (more rows): a row's sums
 * do not depend on the other rows, so the first M rows of a call of 5 rows more must be the
 * M-row call's bits, overwriting and adding, over even and odd column ranges with ragged ends on
 * both sides, on reductions with a masked tail, of one chunk, and long, with padded rows. */
static void test_nt_rows_path(void **state)
{
    (void)state;
    enum { BIG_M = KT__BF16_NT_ROWS_MAX_M + 5 };
    static const int64_t shapes[][4] = {/* N, K, n0, n1 */
                                        {50, 300, 0, 50}, {50, 300, 3, 47}, {1408, 2048, 5, 1408},
                                        {17, 31, 0, 17},  {40, 1, 2, 39},   {33, 4100, 1, 33},
                                        {16, 32, 0, 16}};
    tu_rng rng;
    tu_rng_seed(&rng, 80);
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int64_t N = shapes[i][0], K = shapes[i][1], n0 = shapes[i][2], n1 = shapes[i][3];
        const int64_t ldx = K + 3, ldw = K + (int64_t)(i % 2) * 5, ldy = N + 2;
        uint16_t *x = malloc((size_t)(BIG_M * ldx) * sizeof *x);
        uint16_t *w = malloc((size_t)(N * ldw) * sizeof *w);
        float *y0 = malloc((size_t)(BIG_M * ldy) * sizeof *y0);
        float *big = malloc((size_t)(BIG_M * ldy) * sizeof *big);
        float *few = malloc((size_t)(BIG_M * ldy) * sizeof *few);
        assert_true(x && w && y0 && big && few);
        for (int64_t j = 0; j < BIG_M * ldx; j++)
            x[j] = kt_f32_to_bf16_1((float)tu_rng_uniform(&rng, -1, 1));
        for (int64_t j = 0; j < N * ldw; j++)
            w[j] = kt_f32_to_bf16_1((float)tu_rng_uniform(&rng, -1, 1));
        for (int64_t j = 0; j < BIG_M * ldy; j++)
            y0[j] = (float)tu_rng_uniform(&rng, -2, 2);
        for (int acc = 0; acc < 2; acc++) {
            memcpy(big, y0, (size_t)(BIG_M * ldy) * sizeof *big);
            kt__bf16_gemm_nt(BIG_M, n0, n1, K, x, ldx, w, ldw, big, ldy, acc);
            for (int64_t M = 1; M <= KT__BF16_NT_ROWS_MAX_M; M++) {
                if (strcmp(kt__bf16_gemm_kind_path("nt", M),
                           kt__bf16_gemm_kind_path("nt", BIG_M)) != 0) {
                    g_nt_path_skips++; /* other sums; checked against the reference elsewhere */
                    continue;
                }
                memcpy(few, y0, (size_t)(BIG_M * ldy) * sizeof *few);
                kt__bf16_gemm_nt(M, n0, n1, K, x, ldx, w, ldw, few, ldy, acc);
                check_first_rows(few, big, y0, M, BIG_M, ldy, n1 - n0);
            }
        }
        free(x), free(w), free(y0), free(big), free(few);
    }
}

/* nt_next only fetches ahead: the same bits as nt, whatever `next` points at (another
 * matrix, or NULL), whichever way the kernel fetches: none of its own (up to 4 rows, K short
 * and over 2048), two blocks ahead (5 to 32 rows), or spread over the tiles (above 32). */
static void test_nt_next(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 78);
    static const int64_t cases[][2] = {{1, 300}, {4, 300},  {2, 4100},
                                       {5, 300}, {33, 300}, {96, 300}}; /* M, K */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        prob p;
        prob_init(&p, NT, cases[i][0], 50, cases[i][1], &rng);
        reset_c(&p);
        call_block(&p, 0, p.N, p.c);
        float *c2 = malloc((size_t)(p.cr * p.ldc) * sizeof *c2);
        assert_non_null(c2);
        const uint16_t *nexts[2] = {p.a, NULL};
        for (int k = 0; k < 2; k++) {
            memcpy(c2, p.c0, (size_t)(p.cr * p.ldc) * sizeof *c2);
            kt__bf16_gemm_nt_next(p.M, 0, p.N, p.K, p.a, p.lda, p.b, p.ldb, nexts[k], c2, p.ldc,
                                  p.accumulate);
            assert_memory_equal(c2, p.c, (size_t)(p.cr * p.ldc) * sizeof *c2);
        }
        free(c2);
        prob_free(&p);
    }
}

/* tn above 512 rows: the packed path in its work buffer, and (without one) the walk over x's
 * rows in place, whose reduction runs in chunks of 1024 packed pairs above 2048 rows: each
 * against the reference and split, and the two bitwise equal. dw's 13 rows are two tiles:
 * one group of tiles up to 4097 rows, and at 16385 rows (384 KiB panels, of the 768 KiB the
 * work buffer gives them) a group each. */
static void test_tn_long_reduction(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    static const int64_t Ms[] = {513, 1025, 2048, 2049, 2050, 2051, 4097, 16385};
    for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
        prob p;
        prob_init(&p, TN, Ms[i], 13, 45, &rng);
        assert_non_null(p.work);
        check_prob(&p, &rng);
        check_split(&p, &rng);
        float *packed = malloc((size_t)(p.cr * p.ldc) * sizeof *packed);
        assert_non_null(packed);
        memcpy(packed, p.c, (size_t)(p.cr * p.ldc) * sizeof *packed);
        void *work = p.work;
        p.work = NULL;
        check_prob(&p, &rng);
        check_split(&p, &rng);
        p.work = work;
        assert_memory_equal(packed, p.c, (size_t)(p.cr * p.ldc) * sizeof *packed);
        free(packed);
        prob_free(&p);
    }
}

/* Empty blocks and K = 0 / N = 0 / M = 0: the sums are zero. */
static void test_empty(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    prob p;
    prob_init(&p, NT, 3, 5, 0, &rng);
    check_prob(&p, &rng);
    reset_c(&p);
    call_block(&p, 2, 2, p.c); /* empty column range: nothing written */
    assert_memory_equal(p.c, p.c0, (size_t)(p.cr * p.ldc) * sizeof(float));
    prob_free(&p);
    prob_init(&p, NN, 4, 0, 9, &rng);
    check_prob(&p, &rng);
    prob_free(&p);
    /* the same at the row counts of the in-place kernels (fma_unpacked.c) where they run */
    prob_init(&p, NT, 9, 5, 0, &rng);
    check_prob(&p, &rng);
    prob_free(&p);
    prob_init(&p, NN, 9, 0, 9, &rng);
    check_prob(&p, &rng);
    prob_free(&p);
    prob_init(&p, TN, 0, 6, 9, &rng);
    check_prob(&p, &rng);
    prob_free(&p);
    /* no rows: nothing to compute or write (a 0 x N product) */
    for (int kind = NT; kind <= NN; kind++) {
        prob_init(&p, kind, 0, 7, 9, &rng);
        reset_c(&p);
        call_block(&p, 0, kind == NT ? 7 : 9, p.c);
        prob_free(&p);
    }
}

/* kt__moe_scale_store: dst = s * src rounded to bf16 (or f32), the same bits whether dst
 * starts on a cache line (bf16: whole lines stored past the caches) or not, for lengths
 * around the 32-value line and a row of 2048; nothing outside [dst, dst + n) written. */
static void test_scale_store(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 9);
    const int64_t ns[] = {1, 16, 31, 32, 33, 95, 2048};
    float *src = malloc(2048 * sizeof *src);
    for (int i = 0; i < 2048; i++)
        src[i] = (float)tu_rng_uniform(&rng, -1.0, 1.0);
    _Alignas(64) static uint16_t out[2 * 2048 + 64];
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int shift = 0; shift < 2; shift++) { /* dst on a cache line, or one value on */
                const int64_t n = ns[k];
                memset(out, 0xab, sizeof out);
                unsigned char *dst = (unsigned char *)out + shift * (bf16 ? 2 : 4);
                kt__moe_scale_store(n, src, 0.75f, dst, bf16);
                for (int64_t i = 0; i < n; i++) {
                    const float v = 0.75f * src[i];
                    if (bf16)
                        assert_int_equal(((uint16_t *)dst)[i], kt_f32_to_bf16_1(v));
                    else
                        assert_true(memcmp(dst + 4 * i, &v, 4) == 0);
                }
                for (const unsigned char *q = (unsigned char *)out; q < dst; q++)
                    assert_int_equal(*q, 0xab);
                const unsigned char *end = dst + n * (bf16 ? 2 : 4);
                for (const unsigned char *q = end; q < end + 64; q++)
                    assert_int_equal(*q, 0xab);
            }
    free(src);
}

static void test_report(void **state)
{
    (void)state;
    const char *forced = getenv("KT_CPU");
    print_message("bf16 gemm path: %s below 16 rows, %s from 16, nt of 8 rows %s, nn of 8 rows "
                  "%s (cpu: %s%s%s); %lld cases, %lld elements checked\n",
                  kt__bf16_gemm_path(1), kt__bf16_gemm_path(16), kt__bf16_gemm_kind_path("nt", 8),
                  kt__bf16_gemm_kind_path("nn", 8), kt_cpu_describe(), forced ? ", KT_CPU=" : "",
                  forced ? forced : "", (long long)g_cases, (long long)g_checked);
    if (g_path_skips)
        print_message("%lld stream-path comparisons skipped: those row counts take the %s path and "
                      "the compared calls the %s path (test_moe_gemm_dpbf16 runs them)\n",
                      (long long)g_path_skips, kt__bf16_gemm_path(1),
                      kt__bf16_gemm_path(KT__BF16_NN_STREAM_MAX_M + 2));
    if (g_nt_path_skips)
        print_message("%lld nt rows-path comparisons skipped: those row counts take the %s path "
                      "and the compared calls the %s path (test_moe_gemm_dpbf16 runs them)\n",
                      (long long)g_nt_path_skips, kt__bf16_gemm_kind_path("nt", 1),
                      kt__bf16_gemm_kind_path("nt", KT__BF16_NT_ROWS_MAX_M + 5));
    if (kt__amx_usable())
        print_message("AMX is usable: products of 16 rows and more ran on AMX tiles, so the "
                      "AVX-512 paths for them (NN's row chunks, TN's work buffer) were not "
                      "exercised here\n");
    if (forced != NULL && strcmp(forced, "portable") == 0)
        assert_string_equal(kt__bf16_gemm_path(16), "scalar");
    if (forced != NULL && strcmp(forced, "widen") == 0 && !kt__amx_usable() &&
        kt__cpu_has_avx512())
        assert_string_equal(kt__bf16_gemm_path(16), "fma");
    if (forced != NULL && strcmp(forced, "dpbf16") == 0 && !kt__amx_usable() && vector_path())
        assert_string_equal(kt__bf16_gemm_path(16), "avx512_bf16");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nt_small),
        cmocka_unit_test(test_nn_small),
        cmocka_unit_test(test_tn_small),
        cmocka_unit_test(test_nt_dots),
        cmocka_unit_test(test_nn_direct),
        cmocka_unit_test(test_big_shapes),
        cmocka_unit_test(test_tn_long_reduction),
        cmocka_unit_test(test_nn_rows_path),
        cmocka_unit_test(test_nn2),
        cmocka_unit_test(test_nn_stream_path),
        cmocka_unit_test(test_nt_rows_path),
        cmocka_unit_test(test_nt_next),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_scale_store),
        cmocka_unit_test(test_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
