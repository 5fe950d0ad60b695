/* The AMX bf16 GEMMs (lib/kernels/amx_gemm.h), in three layers:
 *
 *  1. The packing routines (AVX-512, no tile instructions) against plain loops that build the
 *     tile layouts element by element: every edge (rows, columns, odd and partial reductions,
 *     extra steps, extra tiles), and nothing written past the panel. Runs on any AVX-512 CPU.
 *  2. The kernels' loops (moe/amx_gemm_kernels.h, the code the library runs on the tiles)
 *     instantiated here over a tile emulator that follows the SDM: LDTILECFG checked field by
 *     field, TILELOADD/TILESTORED reading and writing exactly rows x colsb bytes at the given
 *     stride (so an out-of-bounds read of an operand shows under AddressSanitizer),
 *     TDPBF16PS with its shape checks (#UD conditions), pair order, one rounding per
 *     accumulation, input denormals as zero and denormal results flushed. Under those
 *     semantics each output element is the f32 sum of its products in index order, which is
 *     exactly what the scalar reference computes, so the emulated kernels must match
 *     kt__bf16_gemm_*_ref bitwise (inputs have no denormals), on every shape, block and
 *     accumulate / scale setting. Runs on any AVX-512 CPU.
 *  3. The real kernels against the reference, when kt__amx_usable(): within the bound below,
 *     the block-split and row-split invariance bitwise, cells outside the block untouched.
 *     Otherwise each of these tests prints a SKIP line and calls skip().
 *
 * The error bound for the hardware (layer 3). The reference sums the nred products of an
 * element in index order in f32; the hardware sums the same products in f32 but may group
 * the additions within one TDPBF16PS differently (pairs first, say). Any order of f32
 * additions of n terms is within (n - 1) u sum|terms| of the exact sum (u = 2^-24, to first
 * order), so the two differ by at most 2 (nred + 16) u sum|a b| (16 spare terms for the
 * grouping), times |scale| for tn; the final additions to y / dw (and tn's product by scale)
 * round once each on both sides, at most u (|y0| + |result|) apiece: allowing 2^-22 (|y0| +
 * |result|) covers both. Products of bf16 values are exact in f32 and no input or partial
 * sum here is near the denormal range, so flushing changes nothing. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <sys/mman.h>
#include <unistd.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/amx_gemm.h"
#include "lib/kernels/bf16_gemm.h"
#include "tests/support/test_util.h"

#ifdef KT_AMX_COMPILED
#include <immintrin.h>

/* ---- the tile emulator ------------------------------------------------------------------- */

static struct {
    int configured;
    unsigned colsb[8], rows[8];
    uint8_t t[8][16][64];
    long long cfgs, loads, stores, dps, releases;
} emu;

static void emu_cfg(const void *cfg)
{
    const uint8_t *b = cfg;
    assert_int_equal(b[0], 1); /* palette 1 */
    assert_int_equal(b[1], 0); /* start_row */
    for (int i = 2; i < 16; i++)
        assert_int_equal(b[i], 0);
    for (int i = 32; i < 48; i++)
        assert_int_equal(b[i], 0);
    for (int i = 56; i < 64; i++)
        assert_int_equal(b[i], 0);
    for (int t = 0; t < 8; t++) {
        emu.colsb[t] = (unsigned)b[16 + 2 * t] | (unsigned)b[17 + 2 * t] << 8;
        emu.rows[t] = b[48 + t];
        assert_true(emu.colsb[t] <= 64 && emu.rows[t] <= 16);
        assert_true((emu.colsb[t] == 0) == (emu.rows[t] == 0));
    }
    memset(emu.t, 0, sizeof emu.t); /* LDTILECFG zeroes the tile data */
    emu.configured = 1;
    emu.cfgs++;
}

static void emu_use(int t)
{
    assert_true(emu.configured);
    assert_true(t >= 0 && t < 8);
    assert_true(emu.rows[t] > 0);
}

static void emu_zero(int t)
{
    emu_use(t);
    memset(emu.t[t], 0, sizeof emu.t[t]);
}

static void emu_load(int t, const void *p, int64_t stride)
{
    emu_use(t);
    memset(emu.t[t], 0, sizeof emu.t[t]);
    for (unsigned r = 0; r < emu.rows[t]; r++)
        memcpy(emu.t[t][r], (const uint8_t *)p + (int64_t)r * stride, emu.colsb[t]);
    emu.loads++;
}

static void emu_store(int t, void *p, int64_t stride)
{
    emu_use(t);
    for (unsigned r = 0; r < emu.rows[t]; r++)
        memcpy((uint8_t *)p + (int64_t)r * stride, emu.t[t][r], emu.colsb[t]);
    emu.stores++;
}

static float emu_bf16(const uint8_t *q)
{
    uint32_t u = ((uint32_t)q[0] | (uint32_t)q[1] << 8) << 16;
    if ((u & 0x7f800000u) == 0) /* denormal inputs are zero */
        u &= 0x80000000u;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float emu_ftz(float v) { return fabsf(v) < FLT_MIN ? copysignf(0.0f, v) : v; }

/* TDPBF16PS c, a, b as the SDM defines it: for each row m of c, each pair k of a's row m, each
 * column n of c: c[m][n] += a[m].bf16[2k] b[k].bf16[2n], then += a[m].bf16[2k+1] b[k].bf16[2n+1],
 * each accumulation rounded once (the products of two bf16 values are exact in f32). */
static void emu_dp(int c, int a, int b)
{
    emu_use(c);
    emu_use(a);
    emu_use(b);
    assert_true(c != a && c != b && a != b);
    /* the shape conditions under which the instruction raises #UD */
    assert_int_equal(emu.rows[c], emu.rows[a]);
    assert_int_equal(emu.colsb[c], emu.colsb[b]);
    assert_int_equal(emu.colsb[a], 4 * emu.rows[b]);
    assert_int_equal(emu.colsb[c] % 4, 0);
    const unsigned M = emu.rows[c], N = emu.colsb[c] / 4, Kp = emu.colsb[a] / 4;
    float A[16][32], B[16][32];
    for (unsigned m = 0; m < M; m++)
        for (unsigned j = 0; j < 2 * Kp; j++)
            A[m][j] = emu_bf16(&emu.t[a][m][2 * j]);
    for (unsigned k = 0; k < Kp; k++)
        for (unsigned j = 0; j < 2 * N; j++)
            B[k][j] = emu_bf16(&emu.t[b][k][2 * j]);
    for (unsigned m = 0; m < M; m++)
        for (unsigned n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, &emu.t[c][m][4 * n], sizeof acc);
            for (unsigned k = 0; k < Kp; k++) {
                acc = emu_ftz(acc + A[m][2 * k] * B[k][2 * n]);
                acc = emu_ftz(acc + A[m][2 * k + 1] * B[k][2 * n + 1]);
            }
            memcpy(&emu.t[c][m][4 * n], &acc, sizeof acc);
        }
    emu.dps++;
}

static void emu_release(void)
{
    assert_true(emu.configured);
    emu.configured = 0;
    emu.releases++;
}

#define AMXK_FN(name) emu_k_##name
#define AMXK_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AMXK_CFG(cfg) emu_cfg(cfg)
#define AMXK_ZERO(t) emu_zero(t)
#define AMXK_LOAD(t, p, bytes) emu_load(t, p, bytes)
#define AMXK_STORE(t, p, bytes) emu_store(t, p, bytes)
#define AMXK_DP(c, a, b) emu_dp(c, a, b)
#define AMXK_RELEASE() emu_release()
#include "lib/kernels/amx_gemm_kernels.h"

static void emu_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                   const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    emu_k_gemm_ab(1, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
    assert_false(emu.configured); /* released on the way out */
}

static void emu_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                   const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    emu_k_gemm_ab(0, M, k0, k1, N, g, ldg, w, ldw, y, ldy, accumulate);
    assert_false(emu.configured);
}

static void emu_tn_mode(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                        int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                        float scale, int accumulate)
{
    emu_k_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
    assert_false(emu.configured);
}

static void emu_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                   const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale)
{
    emu_tn_mode(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, 1);
}
#endif /* KT_AMX_COMPILED */

/* ---- skipping ------------------------------------------------------------------------------ */

static int have_avx512_packers(void)
{
#ifdef KT_AMX_COMPILED
    if (kt__cpu_has_avx512())
        return 1;
    print_message("SKIP: this CPU has no AVX-512 F/BW (the AMX packers and the emulated kernels "
                  "need it)\n");
#else
    print_message("SKIP: the AMX kernels are not compiled for this target\n");
#endif
    return 0;
}

static int have_amx(void)
{
    if (kt__amx_state() < 0)
        fail_msg("this CPU has AMX, but the AMX kernels failed their self-test against the "
                 "scalar reference (kt__amx_selftest), so libkt does not use them");
    if (kt__amx_usable())
        return 1;
#ifdef KT_AMX_COMPILED
    print_message("SKIP: this CPU has no AMX-BF16 (AMX kernels compiled but not run)\n");
#else
    print_message("SKIP: the AMX kernels are not compiled for this target\n");
#endif
    return 0;
}

#define REQUIRE(cond)                                                                              \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            skip();                                                                                \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* Operands end exactly at a page that may not be read (PROT_NONE): a kernel that reads past
 * the last element it may touch faults, with or without AddressSanitizer. */
typedef struct guarded {
    void *base;
    size_t len; /* bytes before the guard page */
} guarded;

static uint16_t *guarded_alloc(guarded *gd, size_t n)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = n * sizeof(uint16_t);
    gd->len = (bytes + page - 1) / page * page;
    assert_int_equal(posix_memalign(&gd->base, page, gd->len + page), 0);
    assert_int_equal(mprotect((char *)gd->base + gd->len, page, PROT_NONE), 0);
    return (uint16_t *)(void *)((char *)gd->base + gd->len - bytes);
}

static void guarded_free(guarded *gd)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    assert_int_equal(mprotect((char *)gd->base + gd->len, page, PROT_READ | PROT_WRITE), 0);
    free(gd->base);
}

/* ---- 1. packing ---------------------------------------------------------------------------- */

#ifdef KT_AMX_COMPILED
#define TE KT_AMX_TILE_ELEMS
#define CANARY 0xabcd

/* n random elements, ending at a guard page (see guarded_alloc) */
static uint16_t *rand_bf16(guarded *gd, size_t n, tu_rng *rng)
{
    uint16_t *p = guarded_alloc(gd, n);
    for (size_t i = 0; i < n; i++) /* any bit pattern but 0 and the canary: the packers copy */
        do
            p[i] = (uint16_t)tu_rng_next(rng);
        while (p[i] == 0 || p[i] == CANARY);
    return p;
}

/* A panel buffer of `tiles_total` tiles followed by one tile of canary. */
static uint16_t *panel_alloc(int64_t tiles_total)
{
    const size_t n = (size_t)(tiles_total + 1) * TE;
    uint16_t *p = malloc(n * sizeof *p);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = CANARY;
    return p;
}

static void panel_check(const uint16_t *got, const uint16_t *want, int64_t tiles_total,
                        const char *what)
{
    for (int64_t i = 0; i < tiles_total * TE; i++)
        if (got[i] != want[i]) {
            print_error("%s: element %lld (tile %lld, offset %lld) = 0x%04x, want 0x%04x\n", what,
                        (long long)i, (long long)(i / TE), (long long)(i % TE), got[i], want[i]);
            fail();
        }
    for (int64_t i = tiles_total * TE; i < (tiles_total + 1) * TE; i++)
        if (got[i] != CANARY) {
            print_error("%s: wrote past the panel (element %lld)\n", what, (long long)i);
            fail();
        }
}

static void test_pack_a(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    tu_rng rng;
    tu_rng_seed(&rng, 11);
    static const int64_t colss[] = {0, 1, 2, 15, 16, 17, 31, 32, 33, 70};
    for (int64_t rows = 0; rows <= 16; rows++)
        for (size_t ci = 0; ci < sizeof colss / sizeof colss[0]; ci++) {
            const int64_t cols = colss[ci], ld = cols + 3;
            /* exactly the elements it may read: rows - 1 full rows and min(cols, 32) */
            const int64_t keep = cols < 32 ? cols : 32;
            const size_t n = rows ? (size_t)((rows - 1) * ld + keep) : 0;
            guarded gd;
            uint16_t *src = rand_bf16(&gd, n, &rng), *got = panel_alloc(1), want[TE];
            for (int64_t r = 0; r < 16; r++)
                for (int64_t j = 0; j < 32; j++)
                    want[r * 32 + j] = r < rows && j < keep ? src[r * ld + j] : 0;
            kt__amx_pack_a(src, ld, rows, cols, got);
            char what[96];
            snprintf(what, sizeof what, "pack_a rows=%lld cols=%lld", (long long)rows,
                     (long long)cols);
            panel_check(got, want, 1, what);
            guarded_free(&gd);
            free(got);
        }
}

static const int64_t pack_nreds[] = {0, 1, 2, 3, 30, 31, 32, 33, 63, 64, 65, 100};
#define N_PACK_NREDS ((int)(sizeof pack_nreds / sizeof pack_nreds[0]))

/* pack_b_nt (w [ncols, nred], the reduction along a row) and pack_b_pairs (src [nred, ncols],
 * the reduction down the rows) build the same panels from transposed layouts: element (i, col)
 * of the reduction i and column col sits at i * si + col * sc. */
static void sweep_pack_b(int pairs, uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    static const int64_t ncolss[] = {1, 2, 7, 15, 16, 17, 31, 32};
    for (size_t ci = 0; ci < sizeof ncolss / sizeof ncolss[0]; ci++)
        for (int ri = 0; ri < N_PACK_NREDS; ri++)
            for (int extra = 0; extra < 2; extra++)
                for (int tiles = ncolss[ci] > 16 ? 2 : 1; tiles <= 2; tiles++) {
                    const int64_t ncols = ncolss[ci], nred = pack_nreds[ri];
                    const int64_t steps = (nred + 31) / 32 + extra;
                    const int64_t ld = pairs ? ncols + 3 : nred + 5;
                    const int64_t si = pairs ? ld : 1, sc = pairs ? 1 : ld;
                    const size_t n = nred ? (size_t)((nred - 1) * si + (ncols - 1) * sc + 1) : 0;
                    guarded gd;
                    uint16_t *src = rand_bf16(&gd, n, &rng);
                    const int64_t total = steps * tiles;
                    uint16_t *got = panel_alloc(total), *want = panel_alloc(total);
                    for (int64_t s = 0; s < steps; s++)
                        for (int t = 0; t < tiles; t++)
                            for (int p = 0; p < 16; p++)
                                for (int c = 0; c < 16; c++)
                                    for (int h = 0; h < 2; h++) {
                                        const int64_t i = 32 * s + 2 * p + h, col = 16 * t + c;
                                        want[(s * tiles + t) * TE + p * 32 + 2 * c + h] =
                                            i < nred && col < ncols ? src[i * si + col * sc] : 0;
                                    }
                    if (pairs)
                        kt__amx_pack_b_pairs(src, ld, nred, ncols, steps, tiles, got);
                    else
                        kt__amx_pack_b_nt(src, ld, ncols, nred, steps, tiles, got);
                    char what[128];
                    snprintf(what, sizeof what, "%s ncols=%lld nred=%lld steps=%lld tiles=%d",
                             pairs ? "pack_b_pairs" : "pack_b_nt", (long long)ncols,
                             (long long)nred, (long long)steps, tiles);
                    panel_check(got, want, total, what);
                    guarded_free(&gd);
                    free(got);
                    free(want);
                }
}

static void test_pack_b_nt(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    sweep_pack_b(0, 12);
}

static void test_pack_b_pairs(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    sweep_pack_b(1, 13);
}

static void test_pack_a_tn(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    tu_rng rng;
    tu_rng_seed(&rng, 14);
    static const int64_t nrowss[] = {1, 2, 15, 16, 17, 33, 48, 63, 64};
    for (size_t ci = 0; ci < sizeof nrowss / sizeof nrowss[0]; ci++)
        for (int ri = 0; ri < N_PACK_NREDS; ri++)
            for (int extra = 0; extra < 2; extra++)
                for (int tiles = (int)((nrowss[ci] + 15) / 16); tiles <= 4; tiles++) {
                    const int64_t nrows = nrowss[ci], nred = pack_nreds[ri];
                    const int64_t steps = (nred + 31) / 32 + extra, ldg = nrows + 2;
                    const size_t n = nred ? (size_t)((nred - 1) * ldg + nrows) : 0;
                    guarded gd;
                    uint16_t *g = rand_bf16(&gd, n, &rng);
                    const int64_t total = steps * tiles;
                    uint16_t *got = panel_alloc(total), *want = panel_alloc(total);
                    for (int64_t s = 0; s < steps; s++)
                        for (int t = 0; t < tiles; t++)
                            for (int r = 0; r < 16; r++)
                                for (int j = 0; j < 32; j++) {
                                    const int64_t m = 32 * s + j, row = 16 * t + r;
                                    want[(s * tiles + t) * TE + r * 32 + j] =
                                        m < nred && row < nrows ? g[m * ldg + row] : 0;
                                }
                    kt__amx_pack_a_tn(g, ldg, nred, nrows, steps, tiles, got);
                    char what[128];
                    snprintf(what, sizeof what, "pack_a_tn nrows=%lld nred=%lld steps=%lld tiles=%d",
                             (long long)nrows, (long long)nred, (long long)steps, tiles);
                    panel_check(got, want, total, what);
                    guarded_free(&gd);
                    free(got);
                    free(want);
                }
}
#else
static void test_pack_a(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
}
#define test_pack_b_nt test_pack_a
#define test_pack_b_pairs test_pack_a
#define test_pack_a_tn test_pack_a
#endif

/* ---- problems ------------------------------------------------------------------------------ */

enum { NT = 0, NN = 1, TN = 2 };
static const char *kind_name[3] = {"nt", "nn", "tn"};

typedef void (*ab_fn)(int64_t, int64_t, int64_t, int64_t, const uint16_t *, int64_t,
                      const uint16_t *, int64_t, float *, int64_t, int);
typedef void (*tn_fn)(int64_t, int64_t, int64_t, int64_t, const uint16_t *, int64_t,
                      const uint16_t *, int64_t, float *, int64_t, float);

typedef struct impl {
    const char *name;
    ab_fn nt, nn;
    tn_fn tn;
    int exact; /* bitwise equal to the reference */
} impl;

static const impl ref_impl = {"ref", kt__bf16_gemm_nt_ref, kt__bf16_gemm_nn_ref,
                              kt__bf16_gemm_tn_acc_ref, 1};
#ifdef KT_AMX_COMPILED
static const impl emu_impl = {"emulated tiles", emu_nt, emu_nn, emu_tn, 1};
#endif
static const impl hw_impl = {"amx", kt__amx_gemm_nt, kt__amx_gemm_nn, kt__amx_gemm_tn_acc, 0};

/* Fills the stack below the caller with NaN bytes, so that a kernel reading a stack buffer it
 * never wrote (partial sums that were never zeroed, say) poisons its result. */
static void __attribute__((noinline)) dirty_stack(void)
{
    volatile unsigned char buf[96 * 1024];
    memset((void *)buf, 0xff, sizeof buf);
}

/* Operands a [ar, lda], b [br, ldb], output c [cr, ldc]:
 *   nt: a = x [M,K], b = w [N,K], c = y [M,N], blocks over N, reduction K
 *   nn: a = g [M,N], b = w [N,K], c = y [M,K], blocks over K, reduction N
 *   tn: a = g [M,N], b = x [M,K], c = dw [N,K], blocks over N (rows of dw), reduction M */
typedef struct prob {
    int kind;
    int64_t M, N, K;
    int64_t lda, ldb, ldc;
    int64_t ar, br, cr, cc;
    uint16_t *a, *b;
    guarded ga, gb;
    float *c0;
    int accumulate;
    float scale;
} prob;

static int64_t split_size(const prob *p) { return p->kind == NN ? p->K : p->N; }
static int64_t red_size(const prob *p) { return p->kind == NT ? p->K : p->kind == NN ? p->N : p->M; }
static size_t c_bytes(const prob *p) { return (size_t)(p->cr * p->ldc) * sizeof(float); }

static void prob_init(prob *p, int kind, int64_t M, int64_t N, int64_t K, tu_rng *rng)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->M = M, p->N = N, p->K = K;
    int64_t acols, bcols;
    switch (kind) {
    case NT:
        p->ar = M, acols = K, p->br = N, bcols = K, p->cr = M, p->cc = N;
        break;
    case NN:
        p->ar = M, acols = N, p->br = N, bcols = K, p->cr = M, p->cc = K;
        break;
    default:
        p->ar = M, acols = N, p->br = M, bcols = K, p->cr = N, p->cc = K;
        break;
    }
    /* leading dimensions wider than the rows about half the time */
    p->lda = acols + (tu_rng_next(rng) % 2 ? (int64_t)(tu_rng_next(rng) % 9) : 0);
    p->ldb = bcols + (tu_rng_next(rng) % 2 ? (int64_t)(tu_rng_next(rng) % 9) : 0);
    p->ldc = p->cc + (tu_rng_next(rng) % 2 ? (int64_t)(tu_rng_next(rng) % 5) : 0);
    p->accumulate = (int)(tu_rng_next(rng) % 2);
    static const float scales[] = {1.0f, 0.75f, -1.5f, 3.0f};
    p->scale = scales[tu_rng_next(rng) % 4];
    /* exactly as long as the last row needs, so an over-read shows under ASan */
    const size_t na = p->ar ? (size_t)((p->ar - 1) * p->lda + acols) : 0,
                 nb = p->br ? (size_t)((p->br - 1) * p->ldb + bcols) : 0,
                 nc = (size_t)(p->cr * p->ldc);
    p->a = guarded_alloc(&p->ga, na);
    p->b = guarded_alloc(&p->gb, nb);
    p->c0 = malloc((nc ? nc : 1) * sizeof *p->c0);
    assert_non_null(p->c0);
    /* the padding of each row is NaN: a kernel that reads it (times a zero of the other
     * operand's padding, say) poisons the result */
    for (size_t i = 0; i < na; i++)
        p->a[i] = (int64_t)i % p->lda < acols
                      ? kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1))
                      : (uint16_t)0x7fc0;
    for (size_t i = 0; i < nb; i++)
        p->b[i] = (int64_t)i % p->ldb < bcols
                      ? kt_f32_to_bf16_1((float)tu_rng_uniform(rng, -1, 1))
                      : (uint16_t)0x7fc0;
    for (size_t i = 0; i < nc; i++)
        p->c0[i] = (float)tu_rng_uniform(rng, -2, 2);
}

static void prob_free(prob *p)
{
    guarded_free(&p->ga);
    guarded_free(&p->gb);
    free(p->c0);
}

static float *c_copy(const prob *p)
{
    float *c = malloc(c_bytes(p) + 4);
    assert_non_null(c);
    memcpy(c, p->c0, c_bytes(p));
    return c;
}

/* Columns (rows for tn) [s0, s1) of rows [r0, r1) of the output (r: rows of y; all of tn's). */
static void call_rows(const impl *f, const prob *p, int64_t r0, int64_t r1, int64_t s0, int64_t s1,
                      float *c)
{
    dirty_stack();
    switch (p->kind) {
    case NT:
        f->nt(r1 - r0, s0, s1, p->K, p->a + r0 * p->lda, p->lda, p->b, p->ldb, c + r0 * p->ldc,
              p->ldc, p->accumulate);
        break;
    case NN:
        f->nn(r1 - r0, p->N, s0, s1, p->a + r0 * p->lda, p->lda, p->b, p->ldb, c + r0 * p->ldc,
              p->ldc, p->accumulate);
        break;
    default:
        f->tn(p->M, s0, s1, p->K, p->a, p->lda, p->b, p->ldb, c, p->ldc, p->scale);
        break;
    }
}

static void call_block(const impl *f, const prob *p, int64_t s0, int64_t s1, float *c)
{
    call_rows(f, p, 0, p->kind == TN ? 0 : p->M, s0, s1, c);
}

static double bfd(uint16_t v) { return (double)kt_bf16_to_f32_1(v); }

/* sum |a||b| over the reduction of output (r, col), times |scale| for tn */
static double abs_sum(const prob *p, int64_t r, int64_t col)
{
    double s = 0.0;
    switch (p->kind) {
    case NT:
        for (int64_t k = 0; k < p->K; k++)
            s += fabs(bfd(p->a[r * p->lda + k]) * bfd(p->b[col * p->ldb + k]));
        return s;
    case NN:
        for (int64_t n = 0; n < p->N; n++)
            s += fabs(bfd(p->a[r * p->lda + n]) * bfd(p->b[n * p->ldb + col]));
        return s;
    default:
        for (int64_t m = 0; m < p->M; m++)
            s += fabs(bfd(p->a[m * p->lda + r]) * bfd(p->b[m * p->ldb + col]));
        return s * fabs((double)p->scale);
    }
}

static void describe(const prob *p, const impl *f, char *buf, size_t n)
{
    snprintf(buf, n, "%s %s M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld acc=%d scale=%g",
             f->name, kind_name[p->kind], (long long)p->M, (long long)p->N, (long long)p->K,
             (long long)p->lda, (long long)p->ldb, (long long)p->ldc, p->accumulate,
             (double)p->scale);
}

static int64_t g_cases, g_elems, g_splits;

/* The whole block against the reference (bitwise, or within the bound), then the same bytes
 * from the block cut at random points into 1..4 calls (cells past each call untouched so
 * far), and for nt / nn from the rows cut in two. */
static void check_prob(const impl *f, prob *p, tu_rng *rng, int splits)
{
    char what[200];
    describe(p, f, what, sizeof what);
    const int64_t S = split_size(p), nred = red_size(p);
    float *want = c_copy(p), *got = c_copy(p);
    call_block(&ref_impl, p, 0, S, want);
    call_block(f, p, 0, S, got);
    if (f->exact) {
        for (int64_t i = 0; i < p->cr * p->ldc; i++)
            if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
                uint32_t gb, wb;
                memcpy(&gb, &got[i], sizeof gb);
                memcpy(&wb, &want[i], sizeof wb);
                print_error("%s: element (%lld, %lld) = %.9g (0x%08x), reference %.9g (0x%08x)\n",
                            what, (long long)(i / p->ldc), (long long)(i % p->ldc),
                            (double)got[i], (unsigned)gb, (double)want[i], (unsigned)wb);
                fail();
            }
    } else {
        for (int64_t r = 0; r < p->cr; r++)
            for (int64_t col = 0; col < p->ldc; col++) {
                const int64_t i = r * p->ldc + col;
                if (col >= p->cc) { /* the padding of each row is never written */
                    assert_memory_equal(&got[i], &p->c0[i], sizeof(float));
                    continue;
                }
                const double c0 = p->kind == TN || p->accumulate ? p->c0[i] : 0.0;
                const double v = want[i];
                const double tol = 2.0 * (double)(nred + 16) * ldexp(abs_sum(p, r, col), -24) +
                                   ldexp(fabs(c0) + fabs(v), -22) + 1e-30;
                if (!(fabs((double)got[i] - v) <= tol)) {
                    print_error("%s: element (%lld, %lld) = %.9g, reference %.9g (tol %.3g)\n",
                                what, (long long)r, (long long)col, (double)got[i], v, tol);
                    fail();
                }
            }
    }
    g_elems += p->cr * p->cc;
    g_cases++;
    if (splits && S >= 2) {
        float *c2 = malloc(c_bytes(p) + 4);
        assert_non_null(c2);
        for (int trial = 0; trial < 2; trial++) {
            memcpy(c2, p->c0, c_bytes(p));
            int64_t s0 = 0;
            while (s0 < S) {
                const int64_t len = 1 + (int64_t)(tu_rng_next(rng) % (uint64_t)(S / 2 + 1));
                const int64_t s1 = s0 + len > S ? S : s0 + len;
                call_block(f, p, s0, s1, c2);
                for (int64_t r = 0; r < p->cr; r++)
                    for (int64_t col = 0; col < p->ldc; col++) {
                        const int64_t pos = p->kind == TN ? r : col;
                        if (pos >= s1)
                            assert_memory_equal(&c2[r * p->ldc + col], &p->c0[r * p->ldc + col],
                                                sizeof(float));
                    }
                s0 = s1;
            }
            if (memcmp(c2, got, c_bytes(p)) != 0) {
                print_error("%s: cutting the block into calls changes the result\n", what);
                fail();
            }
            g_splits++;
        }
        if (p->kind != TN && p->M >= 2) {
            const int64_t m1 = 1 + (int64_t)(tu_rng_next(rng) % (uint64_t)(p->M - 1));
            memcpy(c2, p->c0, c_bytes(p));
            call_rows(f, p, 0, m1, 0, S, c2);
            call_rows(f, p, m1, p->M, 0, S, c2);
            if (memcmp(c2, got, c_bytes(p)) != 0) {
                print_error("%s: cutting the rows at %lld changes the result\n", what,
                            (long long)m1);
                fail();
            }
            g_splits++;
        }
        free(c2);
    }
    free(want);
    free(got);
}

static const int64_t sweep_sizes[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 70};
#define N_SWEEP ((int)(sizeof sweep_sizes / sizeof sweep_sizes[0]))

static void sweep(const impl *f, int kind)
{
    tu_rng rng;
    tu_rng_seed(&rng, 4321 + (uint64_t)kind);
    for (int i = 0; i < N_SWEEP; i++)
        for (int j = 0; j < N_SWEEP; j++)
            for (int l = 0; l < N_SWEEP; l++) {
                prob p;
                prob_init(&p, kind, sweep_sizes[i], sweep_sizes[j], sweep_sizes[l], &rng);
                check_prob(f, &p, &rng, (i + j + l) % 3 == 0);
                prob_free(&p);
            }
}

/* Shapes across the kernels' chunk boundaries: nt / nn reduction chunks of 512 and row
 * chunks of 128; tn row blocks of 64, column chunks of 64 and reduction chunks of 256 (with
 * g^T packed once per row block when M <= 256). */
typedef struct shape {
    int kind;
    int64_t M, N, K;
} shape;

static const shape big_shapes[] = {
    {NT, 130, 40, 1100}, {NT, 257, 33, 513},  {NT, 5, 70, 1024},   {NT, 129, 17, 1025},
    {NT, 1, 100, 2048},  {NT, 128, 64, 512},  {NN, 130, 1100, 40}, {NN, 257, 513, 33},
    {NN, 3, 1025, 70},   {NN, 129, 1024, 17}, {NN, 1, 2048, 100},  {NN, 128, 512, 64},
    {TN, 300, 100, 130}, {TN, 513, 70, 65},   {TN, 257, 129, 33},  {TN, 1, 65, 200},
    {TN, 256, 64, 64},   {TN, 255, 200, 129}, {TN, 600, 17, 300},  {TN, 2049, 5, 40},
};

static void run_big(const impl *f)
{
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    for (size_t i = 0; i < sizeof big_shapes / sizeof big_shapes[0]; i++) {
        const shape *s = &big_shapes[i];
        prob p;
        prob_init(&p, s->kind, s->M, s->N, s->K, &rng);
        check_prob(f, &p, &rng, 1);
        prob_free(&p);
    }
}

/* Zero-length reductions (the sums are zero: y = y0 + 0 or 0, dw = dw + scale * 0), empty
 * blocks and no rows: nothing but those cells is written. */
static void run_empty(const impl *f)
{
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    static const shape shapes[] = {{NT, 3, 5, 0},  {NN, 4, 0, 9},  {TN, 0, 6, 9},
                                   {NT, 0, 5, 7},  {NN, 0, 6, 9},  {TN, 5, 6, 0},
                                   {NT, 40, 33, 0}, {NN, 17, 0, 40}, {TN, 0, 70, 65}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        prob p;
        prob_init(&p, shapes[i].kind, shapes[i].M, shapes[i].N, shapes[i].K, &rng);
        check_prob(f, &p, &rng, 1);
        float *c = c_copy(&p);
        const int64_t S = split_size(&p);
        call_block(f, &p, S / 2, S / 2, c); /* an empty block */
        assert_memory_equal(c, p.c0, c_bytes(&p));
        free(c);
        prob_free(&p);
    }
}

/* ---- 2. the kernels on emulated tiles ------------------------------------------------------ */

/* The start-up self-test accepts correct kernels (the reference itself, the emulated tiles)
 * and refuses a kernel that is off in one element. */
static void nt_off_by_one(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                          int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                          int accumulate)
{
    kt__bf16_gemm_nt_ref(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
    y[(M - 1) * ldy + n1 - 1] += 1.0f; /* the last corner: an edge-tile slip */
}

/* ... and one that adds to y when told to overwrite it */
static void nn_always_adds(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,
                           int64_t ldg, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                           int accumulate)
{
    (void)accumulate;
    kt__bf16_gemm_nn_ref(M, N, k0, k1, g, ldg, w, ldw, y, ldy, 1);
}

static void tn_dropped_scale(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                             int64_t ldg, const uint16_t *x, int64_t ldx, float *dw,
                             int64_t lddw, float scale, int accumulate)
{
    (void)scale;
    kt__bf16_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, 1.0f, accumulate);
}

static void tn_always_adds(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                           int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                           float scale, int accumulate)
{
    (void)accumulate;
    kt__bf16_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, 1);
}

static void test_selftest(void **state)
{
    (void)state;
    assert_int_equal(kt__amx_selftest(kt__bf16_gemm_nt_ref, kt__bf16_gemm_nn_ref,
                                      kt__bf16_gemm_tn_ref), 1);
    assert_int_equal(kt__amx_selftest(nt_off_by_one, kt__bf16_gemm_nn_ref,
                                      kt__bf16_gemm_tn_ref), 0);
    assert_int_equal(kt__amx_selftest(kt__bf16_gemm_nt_ref, kt__bf16_gemm_nn_ref,
                                      tn_dropped_scale), 0);
    assert_int_equal(kt__amx_selftest(kt__bf16_gemm_nt_ref, nn_always_adds,
                                      kt__bf16_gemm_tn_ref), 0);
    assert_int_equal(kt__amx_selftest(kt__bf16_gemm_nt_ref, kt__bf16_gemm_nn_ref,
                                      tn_always_adds), 0);
#ifdef KT_AMX_COMPILED
    if (have_avx512_packers())
        assert_int_equal(kt__amx_selftest(emu_nt, emu_nn, emu_tn_mode), 1);
#endif
}

#ifdef KT_AMX_COMPILED
static void test_emu_nt(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    sweep(&emu_impl, NT);
}

static void test_emu_nn(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    sweep(&emu_impl, NN);
}

static void test_emu_tn(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    sweep(&emu_impl, TN);
}

static void test_emu_big(void **state)
{
    (void)state;
    REQUIRE(have_avx512_packers());
    run_big(&emu_impl);
    run_empty(&emu_impl);
}
#else
#define test_emu_nt test_pack_a
#define test_emu_nn test_pack_a
#define test_emu_tn test_pack_a
#define test_emu_big test_pack_a
#endif

/* ---- 3. the kernels on the real tiles ------------------------------------------------------ */

static void test_amx_nt(void **state)
{
    (void)state;
    REQUIRE(have_amx());
    sweep(&hw_impl, NT);
}

static void test_amx_nn(void **state)
{
    (void)state;
    REQUIRE(have_amx());
    sweep(&hw_impl, NN);
}

static void test_amx_tn(void **state)
{
    (void)state;
    REQUIRE(have_amx());
    sweep(&hw_impl, TN);
}

static void test_amx_big(void **state)
{
    (void)state;
    REQUIRE(have_amx());
    run_big(&hw_impl);
    run_empty(&hw_impl);
}

static void test_report(void **state)
{
    (void)state;
    const char *forced = getenv("KT_CPU");
    print_message("amx: %s (cpu: %s%s%s); %lld cases, %lld elements, %lld block/row splits "
                  "checked\n",
                  kt__amx_usable() ? "usable, real tiles tested" : "not usable",
                  kt_cpu_describe(), forced ? ", KT_CPU=" : "", forced ? forced : "",
                  (long long)g_cases, (long long)g_elems, (long long)g_splits);
#ifdef KT_AMX_COMPILED
    print_message("emulated tiles: %lld configs, %lld loads, %lld stores, %lld tdpbf16ps, "
                  "%lld releases\n",
                  emu.cfgs, emu.loads, emu.stores, emu.dps, emu.releases);
    assert_int_equal(emu.cfgs, emu.releases);
#endif
    if (forced != NULL && strcmp(forced, "portable") == 0)
        assert_false(kt__amx_usable());
    if (forced != NULL && strcmp(forced, "noamx") == 0) { /* AMX hidden, nothing else */
        const kt_cpu_features *f = kt_cpu_get_features();
        assert_false(kt__amx_usable());
        assert_false(f->amx_tile || f->amx_bf16 || f->amx_usable);
    }
    if (kt__amx_usable()) {
        const kt_cpu_features *f = kt_cpu_get_features();
        assert_true(f->amx_tile && f->amx_bf16 && f->amx_usable);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pack_a),    cmocka_unit_test(test_pack_b_nt),
        cmocka_unit_test(test_pack_b_pairs), cmocka_unit_test(test_pack_a_tn),
        cmocka_unit_test(test_emu_nt),    cmocka_unit_test(test_emu_nn),
        cmocka_unit_test(test_emu_tn),    cmocka_unit_test(test_emu_big),
        cmocka_unit_test(test_amx_nt),    cmocka_unit_test(test_amx_nn),
        cmocka_unit_test(test_amx_tn),    cmocka_unit_test(test_amx_big),
        cmocka_unit_test(test_selftest), cmocka_unit_test(test_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
