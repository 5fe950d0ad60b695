/* The table of GEMM kernel paths (registry.h) and the choice from it. The wrappers below only
 * adapt a kernel's signature to its product's (the operand type of the FMA kernels, the
 * arguments a path has no use for); the choice is made once per call, never per tile. */
#include "lib/kernels/registry.h"

#include <math.h>
#include <pthread.h>

#include "kt/tensor.h"
#include "lib/core/cpu_internal.h"
#include "lib/kernels/amx_gemm.h"
#include "lib/kernels/avx2_gemm.h"
#include "lib/kernels/bf16_dpbf16.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/f32_gemm.h"
#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/quant_avx512.h"
#include "lib/kernels/quant_gemm.h"

const char *const kt__kinsn_names[KT__KINSN_COUNT] = {"scalar", "vfmadd231ps", "vdpbf16ps",
                                                      "tdpbf16ps"};

/* The bits are computed once: the CPU's features, KT_CPU and the AMX self-test are each settled
 * once per process (lib/core/cpu.c, amx_gemm.c), and every call of every GEMM reads them. */
static pthread_once_t features_once = PTHREAD_ONCE_INIT;
static unsigned features_bits;

static void features_init(void)
{
    unsigned f = 0;
    if (kt__cpu_has_avx512()) {
        f |= KT__KF_AVX512;
        if (kt__cpu_has_avx512_bf16())
            f |= KT__KF_AVX512_BF16;
    }
    if (kt__cpu_has_avx2())
        f |= KT__KF_AVX2;
    if (kt__amx_usable())
        f |= KT__KF_AMX;
    if (kt__cpu_bf16_on_fma())
        f |= KT__KF_BF16_ON_FMA;
    if (!kt__cpu_f32_on_blas())
        f |= KT__KF_F32_OWN;
    features_bits = f;
}

unsigned kt__kernel_features(void)
{
    pthread_once(&features_once, features_init);
    return features_bits;
}

/* ---- AMX ---------------------------------------------------------------------------------- */

static void amx_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                   const uint16_t *w, int64_t ldw, const uint16_t *next, float *y, int64_t ldy,
                   int accumulate)
{
    (void)next;
    kt__amx_gemm_nt(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

/* two tile products, the second adding to the first (the tiles have no two-source kernel) */
static void amx_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                    const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                    int64_t ldw, float *y, int64_t ldy, int stream)
{
    (void)stream;
    kt__amx_gemm_nn(M, N, k0, k1, g0, ldg, w0, ldw, y, ldy, 0);
    kt__amx_gemm_nn(M, N, k0, k1, g1, ldg, w1, ldw, y, ldy, 1);
}

static void amx_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                   const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                   int accumulate, void *work)
{
    (void)work;
    kt__amx_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}

/* ---- the quantized products --------------------------------------------------------------- */

static void q_rows_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                      const kt__qmat *w, float *y, int64_t ldy, void *work)
{
    (void)work;
    kt__q_nt_rows_avx512(M, n0, n1, x, ldx, w, y, ldy);
}

/* ---- typed entry points of the dtype-generic kernels ---------------------------------------- */

/* The descriptors' functions are typed per product kind and element; each kernel family has
 * one function per kind that takes the element (kt__fma_src) first. These make the typed entry
 * points PREFIX_nt_bf16 / _nt_f32, PREFIX_nn_bf16 / _nn2_bf16 / _nn_f32 and PREFIX_tn_bf16 /
 * _tn_f32 of a family's FN. */
#define NT_ENTRIES(prefix, fn)                                                                     \
    static void prefix##_nt_bf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,  \
                                 int64_t ldx, const uint16_t *w, int64_t ldw,                     \
                                 const uint16_t *next, float *y, int64_t ldy, int accumulate)     \
    {                                                                                              \
        (void)next;                                                                                \
        fn(KT__FMA_BF16, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);                        \
    }                                                                                              \
    static void prefix##_nt_f32(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x,      \
                                int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,   \
                                int accumulate)                                                    \
    {                                                                                              \
        fn(KT__FMA_F32, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);                         \
    }

#define NN_ENTRIES(prefix, fn)                                                                     \
    static void prefix##_nn_bf16(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,  \
                                 int64_t ldg, const uint16_t *w, int64_t ldw, float *y,           \
                                 int64_t ldy, int accumulate)                                      \
    {                                                                                              \
        fn(KT__FMA_BF16, M, N, k0, k1, g, w, NULL, NULL, ldg, ldw, y, ldy, accumulate);            \
    }                                                                                              \
    static void prefix##_nn2_bf16(int64_t M, int64_t N, int64_t k0, int64_t k1,                    \
                                  const uint16_t *g0, const uint16_t *w0, const uint16_t *g1,     \
                                  const uint16_t *w1, int64_t ldg, int64_t ldw, float *y,         \
                                  int64_t ldy, int stream)                                         \
    {                                                                                              \
        (void)stream;                                                                              \
        fn(KT__FMA_BF16, M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, 0);                       \
    }                                                                                              \
    static void prefix##_nn_f32(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,     \
                                const float *w0, const float *g1, const float *w1, int64_t ldg,    \
                                int64_t ldw, float *y, int64_t ldy, int accumulate)               \
    {                                                                                              \
        fn(KT__FMA_F32, M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, accumulate);               \
    }

#define TN_ENTRIES(prefix, fn)                                                                     \
    static void prefix##_tn_bf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,  \
                                 int64_t ldg, const uint16_t *x, int64_t ldx, float *dw,          \
                                 int64_t lddw, float scale, int accumulate, void *work)           \
    {                                                                                              \
        fn(KT__FMA_BF16, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);         \
    }                                                                                              \
    static void prefix##_tn_f32(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g,      \
                                int64_t ldg, const float *x, int64_t ldx, float *dw, int64_t lddw, \
                                float scale, int accumulate, void *work)                           \
    {                                                                                              \
        fn(KT__FMA_F32, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);          \
    }

static inline kt__fma_src src_of(kt__kelem e)
{
    return e == KT__KE_F32 ? KT__FMA_F32 : e == KT__KE_BF16 ? KT__FMA_BF16 : KT__FMA_F16;
}

/* ---- the FMA kernels (fma_gemm.h, fma_unpacked.c) ---------------------------------------- */

#ifdef KT__FMA_GEMM
NT_ENTRIES(fma, kt__fma_nt)
NT_ENTRIES(dots, kt__fma_nt_dots)
NN_ENTRIES(fma, kt__fma_nn)
NN_ENTRIES(direct, kt__fma_nn_direct)
TN_ENTRIES(fma, kt__fma_tn)

static void fma_packed_mixed(kt__kelem ea, kt__kelem eb, int trans_a, int trans_b, int64_t M,
                             int64_t n0, int64_t n1, int64_t K, const void *a, int64_t lda,
                             const void *b, int64_t ldb, float *c, int64_t ldc, void *work)
{
    kt__fma_packed_mm_mixed(src_of(ea), src_of(eb), trans_a, trans_b, M, n0, n1, K, a,
                            lda, b, ldb, c, ldc, work);
}
#define FMA_FN(f) f
#else
#define FMA_FN(f) NULL
#endif

#ifdef KT__DPBF16_COMPILED
#define DP_FN(f) f
#else
#define DP_FN(f) NULL
#endif

/* ---- the AVX2 kernels (avx2_gemm.h) ------------------------------------------------------ */

#ifdef KT__AVX2_GEMM
static kt__avx2_op av_op(const void *p, int64_t ld, int trans, kt__fma_src src)
{
    const kt__avx2_op o = {p, ld, trans, src};
    return o;
}

static const void *av_at(const void *p, int64_t i, kt__fma_src src)
{
    return (const char *)p + i * (src == KT__FMA_F32 ? 4 : 2);
}

/* y[:, n0:n1) (+)= x w^T: A = x, B = w^T (w's rows read as B's columns) */
static void av_nt(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *x,
                  int64_t ldx, const void *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    kt__avx2_gemm(M, n1 - n0, K, av_op(x, ldx, 0, src), av_op(av_at(w, n0 * ldw, src), ldw, 1, src),
                  y + n0, ldy, accumulate ? KT__AVX2_CHAIN : KT__AVX2_OVERWRITE, 1.0f);
}

/* y[:, k0:k1) (+)= g0 w0 (+ g1 w1, the same sum continued) */
static void av_nn(kt__fma_src src, int64_t M, int64_t N, int64_t k0, int64_t k1, const void *g0,
                  const void *w0, const void *g1, const void *w1, int64_t ldg, int64_t ldw,
                  float *y, int64_t ldy, int accumulate)
{
    kt__avx2_gemm(M, k1 - k0, N, av_op(g0, ldg, 0, src), av_op(av_at(w0, k0, src), ldw, 0, src),
                  y + k0, ldy, accumulate ? KT__AVX2_CHAIN : KT__AVX2_OVERWRITE, 1.0f);
    if (g1 != NULL)
        kt__avx2_gemm(M, k1 - k0, N, av_op(g1, ldg, 0, src),
                      av_op(av_at(w1, k0, src), ldw, 0, src), y + k0, ldy, KT__AVX2_CHAIN, 1.0f);
}

/* dw[n0:n1, :] (+)= scale g[:, n0:n1)^T x: A = g^T, B = x */
static void av_tn(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *g,
                  int64_t ldg, const void *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                  int accumulate, void *work)
{
    (void)work; /* the product packs into its own blocks */
    kt__avx2_gemm(n1 - n0, K, M, av_op(av_at(g, n0, src), ldg, 1, src), av_op(x, ldx, 0, src),
                  dw + n0 * lddw, lddw, accumulate ? KT__AVX2_SCALED_ADD : KT__AVX2_SCALED, scale);
}

NT_ENTRIES(av, av_nt)
NT_ENTRIES(av_dots, kt__avx2_nt_dots)
NN_ENTRIES(av, av_nn)
TN_ENTRIES(av, av_tn)

/* c[:, n0:n1) = op(a) op(b): b's columns from n0 (its rows when trans_b) */
static void av_mm_mixed(kt__kelem ea, kt__kelem eb, int trans_a, int trans_b, int64_t M,
                        int64_t n0, int64_t n1, int64_t K, const void *a, int64_t lda,
                        const void *b, int64_t ldb, float *c, int64_t ldc, void *work)
{
    (void)work;
    const kt__fma_src sa = src_of(ea), sb = src_of(eb);
    kt__avx2_gemm(M, n1 - n0, K, av_op(a, lda, trans_a, sa),
                  av_op(av_at(b, trans_b ? n0 * ldb : n0, sb), ldb, trans_b, sb), c + n0, ldc,
                  KT__AVX2_OVERWRITE, 1.0f);
}

static void av_mm_bf16(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1, int64_t K,
                       const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float *c,
                       int64_t ldc, void *work)
{
    av_mm_mixed(KT__KE_BF16, KT__KE_BF16, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c, ldc,
                work);
}
#define AV_FN(f) f
#else
#define AV_FN(f) NULL
#endif

/* ---- the scalar references --------------------------------------------------------------- */

static void ref_nt_bf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                        int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                        float *y, int64_t ldy, int accumulate)
{
    (void)next;
    kt__bf16_gemm_nt_ref(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

static void ref_nn2_bf16(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                         const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                         int64_t ldw, float *y, int64_t ldy, int stream)
{
    (void)stream;
    kt__bf16_gemm_nn_ref(M, N, k0, k1, g0, ldg, w0, ldw, y, ldy, 0);
    kt__bf16_gemm_nn_ref(M, N, k0, k1, g1, ldg, w1, ldw, y, ldy, 1);
}

static void ref_tn_bf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                        int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                        float scale, int accumulate, void *work)
{
    (void)work;
    kt__bf16_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}

static void ref_nn_f32(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,
                       const float *w0, const float *g1, const float *w1, int64_t ldg, int64_t ldw,
                       float *y, int64_t ldy, int accumulate)
{
    kt__f32_gemm_nn_ref(M, N, k0, k1, g0, ldg, w0, ldw, y, ldy, accumulate);
    if (g1 != NULL)
        kt__f32_gemm_nn_ref(M, N, k0, k1, g1, ldg, w1, ldw, y, ldy, 1);
}

static void ref_tn_f32(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                       const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                       int accumulate, void *work)
{
    (void)work;
    kt__f32_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}

static void ref_mm_bf16(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1, int64_t K,
                        const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float *c,
                        int64_t ldc, void *work)
{
    (void)work;
    kt__bf16_gemm_mm_ref(trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c, ldc);
}

/* operand element i of a mixed product, widened (exact) */
static float mixed_at(const void *p, int64_t i, kt__kelem e)
{
    if (e == KT__KE_F32)
        return ((const float *)p)[i];
    const uint16_t v = ((const uint16_t *)p)[i];
    return e == KT__KE_BF16 ? kt_bf16_to_f32_1(v) : kt_f16_to_f32_1(v);
}

/* c[m, n] = one fmaf chain in index order of k from 0: the sums fma_packed computes */
static void ref_mm_mixed(kt__kelem ea, kt__kelem eb, int trans_a, int trans_b, int64_t M,
                         int64_t n0, int64_t n1, int64_t K, const void *a, int64_t lda,
                         const void *b, int64_t ldb, float *c, int64_t ldc, void *work)
{
    (void)work;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s = fmaf(mixed_at(a, trans_a ? k * lda + m : m * lda + k, ea),
                         mixed_at(b, trans_b ? n * ldb + k : k * ldb + n, eb), s);
            c[m * ldc + n] = s;
        }
}

/* ---- the table ------------------------------------------------------------------------------ */

#define ALL INT64_MAX
enum {
    P_AMX,
    P_FMA_PACKED,
    P_FMA_ROWS,
    P_FMA_DOTS,
    P_FMA_DIRECT,
    P_FMA,
    P_DPBF16,
    P_AVX2_DOTS,
    P_AVX2,
    P_Q_ROWS,
    P_Q_PANEL,
    P_SCALAR
};

/* Why the row ranges are where they are (the measurements are in docs/moe.md):
 *  - amx from one full tile of rows (16): below, the tiles are mostly padding.
 *  - fma_packed (the dense matmul's MM from 32 rows where bf16 multiplies faster widened): B's
 *    block widened once and reused over every row, which below about 32 rows costs more than
 *    the fma and fma_dots kernels' panels (the dense matmul takes whichever of MM's and
 *    NT's / NN's paths comes first in this table, so fewer rows run those). MM_MIXED at every
 *    row count: no other path has it (few rows only stream B, read at half f32's bytes).
 *  - fma_rows (f32 NT up to 4 rows): dot products along w's rows, w streamed in long runs.
 *  - fma_dots (NT of 5-20 bf16 / 5-24 f32 rows): w read in place, where the tiles' packed panel
 *    costs more than it saves.
 *  - fma_direct (NN of 6-15 bf16 / 1-24 f32 rows): w's rows widened in registers, the tiles'
 *    sums without their panels.
 *  - fma from 16 bf16 rows where bf16 multiplies faster widened (below, vdpbf16ps streams the
 *    weights as fast), every row count where the CPU lacks vdpbf16ps.
 *  - avx512_bf16 at every row count it is reached for.
 *  - avx2_dots and avx2_fma only where the CPU has AVX2 + FMA + F16C but no AVX-512 (the paths
 *    above serve every product there): avx2_dots for NT of up to KT__AVX2_DOTS_MAX_M rows
 *    (w streamed in place; the tiles' transposed panel costs more than it saves there),
 *    avx2_fma for every other product and row count (docs/moe-measurements.md, "AVX2
 *    machines"). */
const kt__kpath kt__kpaths[] = {
    [P_AMX] = {.name = "amx",
               .sums_as = P_AMX,
               .insn = KT__KINSN_AMX,
               .needs = KT__KF_AMX,
               .rows = {[KT__KP_NT_BF16] = {16, ALL},
                        [KT__KP_NN_BF16] = {16, ALL},
                        [KT__KP_NN2_BF16] = {16, ALL},
                        [KT__KP_TN_BF16] = {16, ALL}},
               .nt_bf16 = amx_nt,
               .nn_bf16 = kt__amx_gemm_nn,
               .nn2_bf16 = amx_nn2,
               .tn_bf16 = amx_tn},
    [P_FMA_PACKED] = {.name = "fma_packed",
                      .sums_as = P_FMA,
                      .insn = KT__KINSN_FMA,
                      .bits = 512,
                      .needs = KT__KF_AVX512,
                      .needs_bf16 = KT__KF_BF16_ON_FMA,
                      .rows = {[KT__KP_MM_BF16] = {KT__FMA_PACKED_MIN_M, ALL},
                               [KT__KP_MM_MIXED] = {0, ALL}},
                      .mm_bf16 = FMA_FN(kt__fma_packed_mm),
                      .mm_mixed = FMA_FN(fma_packed_mixed),
                      .mm_work_bytes = FMA_FN(kt__fma_packed_mm_work_bytes)},
    [P_FMA_ROWS] = {.name = "fma_rows",
                    .sums_as = P_FMA_ROWS,
                    .insn = KT__KINSN_FMA,
                    .bits = 512,
                    .needs = KT__KF_AVX512,
                    .needs_f32 = KT__KF_F32_OWN,
                    .rows = {[KT__KP_NT_F32] = {1, KT__FMA_ROWS_MAX_M}},
                    .nt_f32 = FMA_FN(kt__fma_nt_rows_f32)},
    [P_FMA_DOTS] = {.name = "fma_dots",
                    .sums_as = P_FMA_DOTS,
                    .insn = KT__KINSN_FMA,
                    .bits = 512,
                    .needs = KT__KF_AVX512,
                    .needs_bf16 = KT__KF_BF16_ON_FMA,
                    .needs_f32 = KT__KF_F32_OWN,
                    .rows = {[KT__KP_NT_BF16] = {KT__BF16_NT_ROWS_MAX_M + 1, 20},
                             [KT__KP_NT_F32] = {KT__FMA_ROWS_MAX_M + 1, 24}},
                    .nt_bf16 = FMA_FN(dots_nt_bf16),
                    .nt_f32 = FMA_FN(dots_nt_f32)},
    [P_FMA_DIRECT] = {.name = "fma_direct",
                      .sums_as = P_FMA,
                      .insn = KT__KINSN_FMA,
                      .bits = 512,
                      .needs = KT__KF_AVX512,
                      .needs_bf16 = KT__KF_BF16_ON_FMA,
                      .needs_f32 = KT__KF_F32_OWN,
                      .rows = {[KT__KP_NN_BF16] = {6, 15},
                               [KT__KP_NN2_BF16] = {6, 15},
                               [KT__KP_NN_F32] = {1, 24},
                               [KT__KP_NN2_F32] = {1, 24}},
                      .nn_bf16 = FMA_FN(direct_nn_bf16),
                      .nn2_bf16 = FMA_FN(direct_nn2_bf16),
                      .nn_f32 = FMA_FN(direct_nn_f32)},
    [P_FMA] = {.name = "fma",
               .sums_as = P_FMA,
               .insn = KT__KINSN_FMA,
               .bits = 512,
               .needs = KT__KF_AVX512,
               .needs_bf16 = KT__KF_BF16_ON_FMA,
               .needs_f32 = KT__KF_F32_OWN,
               .all_rows_without = KT__KF_AVX512_BF16,
               .rows = {[KT__KP_NT_BF16] = {16, ALL},
                        [KT__KP_NN_BF16] = {16, ALL},
                        [KT__KP_NN2_BF16] = {16, ALL},
                        [KT__KP_TN_BF16] = {16, ALL},
                        [KT__KP_NT_F32] = {0, ALL},
                        [KT__KP_NN_F32] = {0, ALL},
                        [KT__KP_NN2_F32] = {0, ALL},
                        [KT__KP_TN_F32] = {0, ALL}},
               .nt_bf16 = FMA_FN(fma_nt_bf16),
               .nn_bf16 = FMA_FN(fma_nn_bf16),
               .nn2_bf16 = FMA_FN(fma_nn2_bf16),
               .tn_bf16 = FMA_FN(fma_tn_bf16),
               .nt_f32 = FMA_FN(fma_nt_f32),
               .nn_f32 = FMA_FN(fma_nn_f32),
               .tn_f32 = FMA_FN(fma_tn_f32),
               .tn_work_bytes = FMA_FN(kt__fma_tn_work_bytes)},
    [P_DPBF16] = {.name = "avx512_bf16",
                  .sums_as = P_DPBF16,
                  .insn = KT__KINSN_DPBF16,
                  .bits = 512,
                  .needs = KT__KF_AVX512 | KT__KF_AVX512_BF16,
                  .rows = {[KT__KP_NT_BF16] = {0, ALL},
                           [KT__KP_NN_BF16] = {0, ALL},
                           [KT__KP_NN2_BF16] = {0, ALL},
                           [KT__KP_TN_BF16] = {0, ALL}},
                  .nt_bf16 = DP_FN(kt__bf16_nt_dpbf16),
                  .nn_bf16 = DP_FN(kt__bf16_nn_dpbf16),
                  .nn2_bf16 = DP_FN(kt__bf16_nn2_dpbf16),
                  .tn_bf16 = DP_FN(kt__bf16_tn_dpbf16),
                  .tn_work_bytes = DP_FN(kt__bf16_tn_dpbf16_work_bytes)},
    [P_AVX2_DOTS] = {.name = "avx2_dots",
                     .sums_as = P_AVX2_DOTS,
                     .insn = KT__KINSN_FMA,
                     .bits = 256,
                     .needs = KT__KF_AVX2,
                     .needs_f32 = KT__KF_F32_OWN,
                     .unless = KT__KF_AVX512,
                     .rows = {[KT__KP_NT_BF16] = {1, KT__AVX2_DOTS_MAX_M},
                              [KT__KP_NT_F32] = {1, KT__AVX2_DOTS_MAX_M}},
                     .nt_bf16 = AV_FN(av_dots_nt_bf16),
                     .nt_f32 = AV_FN(av_dots_nt_f32)},
    [P_AVX2] = {.name = "avx2_fma",
                .sums_as = P_AVX2,
                .insn = KT__KINSN_FMA,
                .bits = 256,
                .needs = KT__KF_AVX2,
                .needs_f32 = KT__KF_F32_OWN,
                .unless = KT__KF_AVX512,
                .rows = {[KT__KP_NT_BF16] = {0, ALL},
                         [KT__KP_NN_BF16] = {0, ALL},
                         [KT__KP_NN2_BF16] = {0, ALL},
                         [KT__KP_TN_BF16] = {0, ALL},
                         [KT__KP_NT_F32] = {0, ALL},
                         [KT__KP_NN_F32] = {0, ALL},
                         [KT__KP_NN2_F32] = {0, ALL},
                         [KT__KP_TN_F32] = {0, ALL},
                         [KT__KP_MM_BF16] = {0, ALL},
                         [KT__KP_MM_MIXED] = {0, ALL}},
                .nt_bf16 = AV_FN(av_nt_bf16),
                .nn_bf16 = AV_FN(av_nn_bf16),
                .nn2_bf16 = AV_FN(av_nn2_bf16),
                .tn_bf16 = AV_FN(av_tn_bf16),
                .nt_f32 = AV_FN(av_nt_f32),
                .nn_f32 = AV_FN(av_nn_f32),
                .tn_f32 = AV_FN(av_tn_f32),
                .mm_bf16 = AV_FN(av_mm_bf16),
                .mm_mixed = AV_FN(av_mm_mixed)},
    /* the quantized products (quant_gemm.h): NT of a few rows on the weights in place, and
     * panels dequantised to bf16 for everything else (on every CPU: the panel's product is
     * the bf16 path the registry picks for its rows, whose instruction its peak is) */
    [P_Q_ROWS] = {.name = "q_rows_avx512_bf16",
                  .sums_as = P_Q_ROWS,
                  .insn = KT__KINSN_DPBF16,
                  .bits = 512,
                  .needs = KT__KF_AVX512 | KT__KF_AVX512_BF16,
                  .rows = {[KT__KP_NT_Q] = {1, KT__Q_NT_ROWS_MAX_M}},
                  .nt_q = q_rows_nt},
    [P_Q_PANEL] = {.name = "q_panel",
                   .sums_as = P_Q_PANEL,
                   .insn = KT__KINSN_SCALAR,
                   .rows = {[KT__KP_NT_Q] = {0, ALL}, [KT__KP_NN_Q] = {0, ALL}},
                   .nt_q = kt__q_panel_nt,
                   .nn_q = kt__q_panel_nn},
    [P_SCALAR] = {.name = "scalar",
                  .sums_as = P_SCALAR,
                  .insn = KT__KINSN_SCALAR,
                  .rows = {[KT__KP_NT_BF16] = {0, ALL},
                           [KT__KP_NN_BF16] = {0, ALL},
                           [KT__KP_NN2_BF16] = {0, ALL},
                           [KT__KP_TN_BF16] = {0, ALL},
                           [KT__KP_NT_F32] = {0, ALL},
                           [KT__KP_NN_F32] = {0, ALL},
                           [KT__KP_NN2_F32] = {0, ALL},
                           [KT__KP_TN_F32] = {0, ALL},
                           [KT__KP_MM_BF16] = {0, ALL},
                           [KT__KP_MM_MIXED] = {0, ALL},
                           [KT__KP_NT_Q] = {0, ALL},
                           [KT__KP_NN_Q] = {0, ALL}},
                  .nt_bf16 = ref_nt_bf16,
                  .nn_bf16 = kt__bf16_gemm_nn_ref,
                  .nn2_bf16 = ref_nn2_bf16,
                  .tn_bf16 = ref_tn_bf16,
                  .nt_f32 = kt__f32_gemm_nt_ref,
                  .nn_f32 = ref_nn_f32,
                  .tn_f32 = ref_tn_f32,
                  .mm_bf16 = ref_mm_bf16,
                  .mm_mixed = ref_mm_mixed,
                  .nt_q = kt__q_ref_nt,
                  .nn_q = kt__q_ref_nn},
};
const int kt__kpath_count = (int)(sizeof kt__kpaths / sizeof kt__kpaths[0]);
#define MAX_PATHS 12
_Static_assert(sizeof kt__kpaths / sizeof kt__kpaths[0] <= MAX_PATHS, "usable's e[] holds every path");

static int has_kernel(const kt__kpath *p, kt__kprod prod);

size_t kt__kpath_tn_work_bytes(kt__kprod prod, int64_t M)
{
    size_t most = 0;
    for (int i = 0; i < kt__kpath_count; i++) {
        const kt__kpath *p = &kt__kpaths[i];
        if (has_kernel(p, prod) && p->tn_work_bytes != NULL && p->tn_work_bytes(M) > most)
            most = p->tn_work_bytes(M);
    }
    return most;
}

static int has_kernel(const kt__kpath *p, kt__kprod prod)
{
    switch (prod) {
    case KT__KP_NT_BF16: return p->nt_bf16 != NULL;
    case KT__KP_NN_BF16: return p->nn_bf16 != NULL;
    case KT__KP_NN2_BF16: return p->nn2_bf16 != NULL;
    case KT__KP_TN_BF16: return p->tn_bf16 != NULL;
    case KT__KP_NT_F32: return p->nt_f32 != NULL;
    case KT__KP_NN_F32:
    case KT__KP_NN2_F32: return p->nn_f32 != NULL;
    case KT__KP_TN_F32: return p->tn_f32 != NULL;
    case KT__KP_MM_BF16: return p->mm_bf16 != NULL;
    case KT__KP_MM_MIXED: return p->mm_mixed != NULL;
    case KT__KP_NT_Q: return p->nt_q != NULL;
    case KT__KP_NN_Q: return p->nn_q != NULL;
    default: return 0;
    }
}

/* Whether the product's operands are bf16 (the descriptors' needs_bf16 apply), else f32 (MM_MIXED
 * too: an f32 operand never multiplies on vdpbf16ps, so BF16_ON_FMA is not its question). */
static int prod_bf16(kt__kprod prod)
{
    return prod <= KT__KP_TN_BF16 || prod == KT__KP_MM_BF16 || prod == KT__KP_NT_Q ||
           prod == KT__KP_NN_Q;
}

/* Per product, the paths this CPU can run for it in table order with their effective rows:
 * built once from the table (as the feature bits), so a pick is a walk over a few ranges. */
typedef struct usable {
    int n;
    struct {
        int64_t lo, hi;
        const kt__kpath *path;
    } e[MAX_PATHS];
} usable;
static pthread_once_t usable_once = PTHREAD_ONCE_INIT;
static usable usable_by_prod[KT__KPROD_COUNT];

static void usable_init(void)
{
    const unsigned have = kt__kernel_features();
    for (int prod = 0; prod < KT__KPROD_COUNT; prod++) {
        usable *u = &usable_by_prod[prod];
        const int bf16 = prod_bf16((kt__kprod)prod);
        for (int i = 0; i < kt__kpath_count && u->n < MAX_PATHS; i++) {
            const kt__kpath *p = &kt__kpaths[i];
            const unsigned needs = p->needs | (bf16 ? p->needs_bf16 : p->needs_f32);
            const kt__krows r = p->rows[prod];
            if (r.max_m == 0 || !has_kernel(p, (kt__kprod)prod) || (have & needs) != needs ||
                (have & p->unless) != 0)
                continue;
            u->e[u->n].lo = (p->all_rows_without & ~have) ? 0 : r.min_m;
            u->e[u->n].hi = r.max_m;
            u->e[u->n].path = p;
            u->n++;
        }
    }
}

const kt__kpath *kt__kpath_pick(kt__kprod prod, int64_t M)
{
    pthread_once(&usable_once, usable_init);
    const usable *u = &usable_by_prod[prod];
    for (int i = 0; i < u->n; i++)
        if (M >= u->e[i].lo && M <= u->e[i].hi)
            return u->e[i].path;
    return &kt__kpaths[kt__kpath_count - 1];
}

const char *kt__kpath_sums_name(kt__kprod prod, int64_t M)
{
    return kt__kpaths[kt__kpath_pick(prod, M)->sums_as].name;
}
