/* Row-major sgemm: OpenBLAS when available, else a cache-blocked portable kernel.
 *
 * The portable kernel follows the usual packed-panel scheme. C is cut into fixed
 * GEMM_MC x GEMM_NC work tiles that the pool shares out statically; a thread walks K in
 * GEMM_KC blocks, packs the B block of its tile (KC x NC, in NR-wide panels) and one
 * MR-row panel of A at a time, and a register-tiled microkernel computes MR x NR products
 * from the packed panels. Each C element is therefore the sum of its KC blocks in K order,
 * each block summed k by k in one microkernel, which no thread count changes.
 *
 * Edge tiles are computed by the same microkernel on zero-padded panels (and only the
 * valid part written back), so every element of C goes through identical arithmetic.
 * Packing buffers live on the stack (under 64 KiB a thread), so nothing is allocated.
 *
 * The microkernel is chosen once per call from the CPU features: AVX-512 or AVX2+FMA on
 * x86-64 (compiled with target attributes, so the library itself needs no -m flags), else
 * a portable one in generic vector types; KT_CPU=portable forces the latter. Results are
 * bitwise reproducible for a given microkernel, not across them (FMA rounds once). */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "lib/core/error.h"
#include "kt/runtime.h"
#include "lib/kernels/sgemm.h"
#include "lib/ops/op_util.h"

#ifdef KT_HAVE_OPENBLAS
#include <cblas.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* KC * NC floats of packed B (48 KiB) + MR_MAX * KC of packed A (12 KiB) + one tile stay
 * under the 64 KiB stack budget. NC and MC are multiples of every variant's NR and MR. */
#define GEMM_KC 256
#define GEMM_NC 48
#define GEMM_MC 96
#define GEMM_MR_MAX 12
#define GEMM_NR_MAX 16

/* A tile needs at least this many multiply-adds before it is worth a thread wake-up. */
#define GEMM_MIN_WORK_PER_PART (1 << 17)

/* tile[MR][NR] = sum over k < kc of ap[k][i] * bp[k][j] (panels packed k-major). */
typedef void (*gemm_ukernel_fn)(int64_t kc, const float *ap, const float *bp, float *tile);

typedef struct gemm_kernel {
    int mr, nr;
    gemm_ukernel_fn fn;
} gemm_kernel;

/* The portable microkernel: 4 x 8 floats of accumulators in GCC/clang vector types of
 * 4 lanes (SSE2, NEON or scalar code, whatever the target has), mul + add. */
typedef float gemm_v4 __attribute__((vector_size(16)));
#define PORTABLE_MR 4
#define PORTABLE_NR 8

static void ukernel_portable(int64_t kc, const float *restrict ap, const float *restrict bp,
                             float *restrict tile)
{
    gemm_v4 acc[PORTABLE_MR][2] = {{{0}}};
    for (int64_t k = 0; k < kc; k++) {
        gemm_v4 b0, b1;
        memcpy(&b0, bp + k * PORTABLE_NR, sizeof b0);
        memcpy(&b1, bp + k * PORTABLE_NR + 4, sizeof b1);
        for (int i = 0; i < PORTABLE_MR; i++) {
            const float a = ap[k * PORTABLE_MR + i];
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    memcpy(tile, acc, sizeof acc);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define GEMM_HAVE_X86_VARIANTS 1

/* AVX2: 6 rows x 2 ymm = 12 accumulators of the 16 registers, leaving room for the two B
 * vectors and the broadcast A value. */
__attribute__((target("avx2,fma"))) static void
ukernel_avx2(int64_t kc, const float *restrict ap, const float *restrict bp,
             float *restrict tile)
{
    __m256 acc[6][2];
    for (int i = 0; i < 6; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(bp + k * 16), b1 = _mm256_load_ps(bp + k * 16 + 8);
        for (int i = 0; i < 6; i++) {
            const __m256 a = _mm256_broadcast_ss(ap + k * 6 + i);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < 6; i++) {
        _mm256_store_ps(tile + i * 16, acc[i][0]);
        _mm256_store_ps(tile + i * 16 + 8, acc[i][1]);
    }
}

/* AVX-512: 12 rows x 1 zmm; enough independent FMA chains to cover their latency. */
__attribute__((target("avx512f"))) static void
ukernel_avx512(int64_t kc, const float *restrict ap, const float *restrict bp,
               float *restrict tile)
{
    __m512 acc[12];
    for (int i = 0; i < 12; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b = _mm512_load_ps(bp + k * 16);
        for (int i = 0; i < 12; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ap[k * 12 + i]), b, acc[i]);
    }
    for (int i = 0; i < 12; i++)
        _mm512_store_ps(tile + i * 16, acc[i]);
}
#endif

static const gemm_kernel kernel_portable = {PORTABLE_MR, PORTABLE_NR, ukernel_portable};
#ifdef GEMM_HAVE_X86_VARIANTS
static const gemm_kernel kernel_avx2 = {6, 16, ukernel_avx2};
static const gemm_kernel kernel_avx512 = {12, 16, ukernel_avx512};
#endif

/* KT_CPU=portable clears the features, which selects the baseline kernel here too. */
static const gemm_kernel *pick_kernel(void)
{
#ifdef GEMM_HAVE_X86_VARIANTS
    if (kt__cpu_has_avx512())
        return &kernel_avx512;
    if (kt_cpu_get_features()->avx2)
        return &kernel_avx2;
#endif
    return &kernel_portable;
}

typedef struct gemm_job {
    const gemm_kernel *kern;
    int trans_a, trans_b;
    int64_t M, N, K;
    float alpha, beta;
    const float *A, *B;
    int64_t lda, ldb;
    float *C;
    int64_t ldc;
    int64_t tiles_n; /* work tiles along N */
    /* kt__sgemm_mixed: operands of these dtypes (A and B then point at them as they are),
     * widened as they are packed; KT_F32 for both in every other call */
    kt_dtype a_dt, b_dt;
} gemm_job;

/* element i of a bf16 or f16 operand, widened (exact) */
static inline float widened(const void *p, int64_t i, kt_dtype dt)
{
    const uint16_t v = ((const uint16_t *)p)[i];
    if (dt == KT_F16)
        return kt_f16_to_f32_1(v);
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* pack_a / pack_b on an operand of a narrow dtype: the same panels, values widened */
static void pack_a_widened(const gemm_job *j, int64_t i0, int rows, int64_t p0, int64_t kc,
                           float *ap)
{
    const int mr = j->kern->mr;
    for (int64_t k = 0; k < kc; k++)
        for (int i = 0; i < mr; i++)
            ap[k * mr + i] = i >= rows ? 0.0f
                             : j->trans_a
                                 ? widened(j->A, (p0 + k) * j->lda + i0 + i, j->a_dt)
                                 : widened(j->A, (i0 + i) * j->lda + p0 + k, j->a_dt);
}

static void pack_b_widened(const gemm_job *j, int64_t j0, int64_t cols, int64_t p0, int64_t kc,
                           float *bp)
{
    const int nr = j->kern->nr;
    for (int64_t jp = 0; jp < cols; jp += nr) {
        const int w = cols - jp < nr ? (int)(cols - jp) : nr;
        float *panel = bp + (jp / nr) * kc * nr;
        for (int64_t k = 0; k < kc; k++)
            for (int c = 0; c < nr; c++)
                panel[k * nr + c] =
                    c >= w ? 0.0f
                    : j->trans_b ? widened(j->B, (j0 + jp + c) * j->ldb + p0 + k, j->b_dt)
                                 : widened(j->B, (p0 + k) * j->ldb + j0 + jp + c, j->b_dt);
    }
}

/* Rows [i0, i0 + rows) x k in [p0, p0 + kc) of op(A) into ap[k][0..mr), zero-padded. */
static void pack_a(const gemm_job *j, int64_t i0, int rows, int64_t p0, int64_t kc, float *ap)
{
    const int mr = j->kern->mr;
    if (j->a_dt != KT_F32) {
        pack_a_widened(j, i0, rows, p0, kc, ap);
        return;
    }
    if (j->trans_a) {
        for (int64_t k = 0; k < kc; k++) {
            const float *src = j->A + (p0 + k) * j->lda + i0;
            float *dst = ap + k * mr;
            for (int i = 0; i < rows; i++)
                dst[i] = src[i];
            for (int i = rows; i < mr; i++)
                dst[i] = 0.0f;
        }
        return;
    }
    for (int i = 0; i < rows; i++) {
        const float *src = j->A + (i0 + i) * j->lda + p0;
        for (int64_t k = 0; k < kc; k++)
            ap[k * mr + i] = src[k];
    }
    for (int i = rows; i < mr; i++)
        for (int64_t k = 0; k < kc; k++)
            ap[k * mr + i] = 0.0f;
}

/* Columns [j0, j0 + cols) x k in [p0, p0 + kc) of op(B) into NR-wide panels, each
 * bp[panel][k][0..nr), the last one zero-padded. */
static void pack_b(const gemm_job *j, int64_t j0, int64_t cols, int64_t p0, int64_t kc,
                   float *bp)
{
    const int nr = j->kern->nr;
    if (j->b_dt != KT_F32) {
        pack_b_widened(j, j0, cols, p0, kc, bp);
        return;
    }
    for (int64_t jp = 0; jp < cols; jp += nr) {
        int w = cols - jp < nr ? (int)(cols - jp) : nr;
        float *panel = bp + (jp / nr) * kc * nr;
        if (j->trans_b) {
            for (int c = 0; c < w; c++) {
                const float *src = j->B + (j0 + jp + c) * j->ldb + p0;
                for (int64_t k = 0; k < kc; k++)
                    panel[k * nr + c] = src[k];
            }
        } else {
            for (int64_t k = 0; k < kc; k++) {
                const float *src = j->B + (p0 + k) * j->ldb + j0 + jp;
                for (int c = 0; c < w; c++)
                    panel[k * nr + c] = src[c];
            }
        }
        for (int64_t k = 0; k < kc; k++)
            for (int c = w; c < nr; c++)
                panel[k * nr + c] = 0.0f;
    }
}

/* C block += alpha * tile; the first K block also applies beta (and does not read C when
 * beta is 0). */
static void write_tile(const gemm_job *j, const float *tile, int64_t i0, int rows, int64_t j0,
                       int cols, int first)
{
    const int nr = j->kern->nr;
    const float alpha = j->alpha, beta = j->beta;
    for (int i = 0; i < rows; i++) {
        float *c = j->C + (i0 + i) * j->ldc + j0;
        const float *t = tile + i * nr;
        if (!first)
            for (int x = 0; x < cols; x++)
                c[x] += alpha * t[x];
        else if (beta == 0.0f)
            for (int x = 0; x < cols; x++)
                c[x] = alpha * t[x];
        else
            for (int x = 0; x < cols; x++)
                c[x] = alpha * t[x] + beta * c[x];
    }
}

static void gemm_tiles(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const gemm_job *j = ctx;
    const int mr = j->kern->mr, nr = j->kern->nr;
    _Alignas(64) float bp[GEMM_KC * GEMM_NC];
    _Alignas(64) float ap[GEMM_MR_MAX * GEMM_KC];
    _Alignas(64) float tile[GEMM_MR_MAX * GEMM_NR_MAX];
    for (int64_t t = begin; t < end; t++) {
        const int64_t i0 = (t / j->tiles_n) * GEMM_MC, j0 = (t % j->tiles_n) * GEMM_NC;
        const int64_t mc = j->M - i0 < GEMM_MC ? j->M - i0 : GEMM_MC;
        const int64_t nc = j->N - j0 < GEMM_NC ? j->N - j0 : GEMM_NC;
        for (int64_t p0 = 0; p0 < j->K; p0 += GEMM_KC) {
            const int64_t kc = j->K - p0 < GEMM_KC ? j->K - p0 : GEMM_KC;
            pack_b(j, j0, nc, p0, kc, bp);
            for (int64_t ir = 0; ir < mc; ir += mr) {
                const int rows = mc - ir < mr ? (int)(mc - ir) : mr;
                pack_a(j, i0 + ir, rows, p0, kc, ap);
                for (int64_t jr = 0; jr < nc; jr += nr) {
                    const int cols = nc - jr < nr ? (int)(nc - jr) : nr;
                    j->kern->fn(kc, ap, bp + (jr / nr) * kc * nr, tile);
                    write_tile(j, tile, i0 + ir, rows, j0 + jr, cols, p0 == 0);
                }
            }
        }
    }
}

/* C = beta * C, for K == 0 or alpha == 0 where no products contribute. */
static void scale_c(int64_t M, int64_t N, float beta, float *C, int64_t ldc)
{
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        if (beta == 0.0f)
            memset(c, 0, (size_t)N * sizeof *c);
        else
            for (int64_t x = 0; x < N; x++)
                c[x] *= beta;
    }
}

/* Checks the arguments; *done = 1 when nothing is left to compute (empty or C scaled). */
static kt_status check_args(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                            float alpha, const float *A, int64_t lda, const float *B,
                            int64_t ldb, float beta, float *C, int64_t ldc, int *done)
{
    *done = 1;
    if (M < 0 || N < 0 || K < 0)
        return kt__error(KT_EINVAL, "sgemm: negative size M=%lld N=%lld K=%lld", (long long)M,
                         (long long)N, (long long)K);
    if (M == 0 || N == 0)
        return KT_OK;
    if (C == NULL || ldc < N)
        return kt__error(KT_EINVAL, "sgemm: C is NULL or ldc %lld is less than N=%lld",
                         (long long)ldc, (long long)N);
    if (K == 0 || alpha == 0.0f) {
        scale_c(M, N, beta, C, ldc);
        return KT_OK;
    }
    const int64_t a_row = trans_a ? M : K, b_row = trans_b ? K : N;
    if (A == NULL || lda < a_row)
        return kt__error(KT_EINVAL, "sgemm: A is NULL or lda %lld is less than its row "
                         "length %lld", (long long)lda, (long long)a_row);
    if (B == NULL || ldb < b_row)
        return kt__error(KT_EINVAL, "sgemm: B is NULL or ldb %lld is less than its row "
                         "length %lld", (long long)ldb, (long long)b_row);
    *done = 0;
    return KT_OK;
}

/* The blocked kernel on a checked job. */
static void run_portable(kt_threadpool *pool, gemm_job *j)
{
    const int64_t M = j->M, N = j->N, K = j->K;
    j->kern = pick_kernel();
    j->tiles_n = (N + GEMM_NC - 1) / GEMM_NC;
    const int64_t tiles = ((M + GEMM_MC - 1) / GEMM_MC) * j->tiles_n;
    /* The grain only decides how many threads share the tiles, never the tiling itself. */
    const double work_per_tile = (double)(M < GEMM_MC ? M : GEMM_MC) *
                                 (double)(N < GEMM_NC ? N : GEMM_NC) * (double)K;
    int64_t grain = (int64_t)ceil(GEMM_MIN_WORK_PER_PART / work_per_tile);
    kt_parallel_for(pool, tiles, grain < 1 ? 1 : grain, gemm_tiles, j);
}

kt_status kt__sgemm_portable(kt_threadpool *pool, int trans_a, int trans_b, int64_t M,
                             int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                             const float *B, int64_t ldb, float beta, float *C, int64_t ldc)
{
    int done;
    KT__TRY(check_args(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, &done));
    if (done)
        return KT_OK;
    gemm_job j = {.trans_a = trans_a, .trans_b = trans_b, .M = M, .N = N, .K = K,
                  .alpha = alpha, .beta = beta, .A = A, .B = B, .lda = lda, .ldb = ldb, .C = C,
                  .ldc = ldc, .a_dt = KT_F32, .b_dt = KT_F32};
    run_portable(pool, &j);
    return KT_OK;
}

kt_status kt__sgemm_mixed(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                          int64_t K, const void *A, kt_dtype a_dtype, int64_t lda, const void *B,
                          kt_dtype b_dtype, int64_t ldb, float *C, int64_t ldc)
{
    const int ok_a = a_dtype == KT_F32 || a_dtype == KT_BF16 || a_dtype == KT_F16;
    const int ok_b = b_dtype == KT_F32 || b_dtype == KT_BF16 || b_dtype == KT_F16;
    if (!ok_a || !ok_b)
        return kt__error(KT_EINVAL, "sgemm: operands of dtypes %s and %s", kt_dtype_name(a_dtype),
                         kt_dtype_name(b_dtype));
    int done;
    /* (the pointers are only compared with NULL there) */
    KT__TRY(check_args(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, &done));
    if (done)
        return KT_OK;
    gemm_job j = {.trans_a = trans_a, .trans_b = trans_b, .M = M, .N = N, .K = K, .alpha = 1.0f,
                  .beta = 0.0f, .A = A, .B = B, .lda = lda, .ldb = ldb, .C = C, .ldc = ldc,
                  .a_dt = a_dtype, .b_dt = b_dtype};
    run_portable(pool, &j);
    return KT_OK;
}

#ifdef KT_HAVE_OPENBLAS
char *openblas_get_corename(void); /* OpenBLAS's own; not in every cblas.h */

/* OpenBLAS's kernel sets with AVX2 and FMA or more (0.3.21's DYNAMIC_ARCH names). */
static const char *const openblas_avx2_cores[] = {
    "Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "Excavator"};

static int use_openblas;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

/* OpenBLAS, unless its kernel set predates the CPU's vector units: a DYNAMIC_ARCH build picks
 * the set from the CPU model at load and falls back to an old one for models it does not know
 * (Debian's 0.3.21 runs "Prescott", SSE3, on Emerald Rapids). On a CPU with AVX2 and FMA
 * whose OpenBLAS set has neither, the blocked kernel here (AVX-512 or AVX2 microkernels, on
 * the caller's pool) is used instead: the example model's training (examples/train_conv_lm.sh, 200
 * steps, 2 threads, the MoE on its own kernels) took 25.5 s with OpenBLAS's Prescott kernels,
 * 17.6-20.3 s with this kernel and 20.0 s with OpenBLAS forced to its SkylakeX kernels.
 * KT_CPU=blas keeps OpenBLAS. Where OpenBLAS has AVX2 kernels it stays, also on AVX-512 CPUs
 * (not compared there). */
static void choose_backend(void)
{
    const char *core = openblas_get_corename();
    const kt_cpu_features *f = kt_cpu_get_features();
    int current = core == NULL || !f->avx2 || kt__cpu_f32_on_blas();
    for (size_t i = 0; core != NULL && i < sizeof openblas_avx2_cores / sizeof *openblas_avx2_cores;
         i++)
        current |= strcmp(core, openblas_avx2_cores[i]) == 0;
    use_openblas = current;
}
#endif

int kt__sgemm_is_openblas(void)
{
#ifdef KT_HAVE_OPENBLAS
    pthread_once(&choose_once, choose_backend);
    return use_openblas;
#else
    return 0;
#endif
}

const char *kt__sgemm_core_name(void)
{
#ifdef KT_HAVE_OPENBLAS
    const char *name = openblas_get_corename();
    return name != NULL ? name : "unknown";
#else
    return "portable";
#endif
}

/* Products of at most this many multiply-adds (M N K) stay on the portable kernel: OpenBLAS's
 * small-matrix kernels, which it takes up to 10^6 on AVX-512 CPUs (SkylakeX and later),
 * allocate on every call, and a training step allocates nothing (test_program's count). At
 * that size a call is microseconds either way. */
#define SGEMM_SMALL_MNK 1000000.0

kt_status kt__sgemm(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                    int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float beta, float *C, int64_t ldc)
{
    if (kt__sgemm_is_openblas() && (double)M * (double)N * (double)K > SGEMM_SMALL_MNK)
        return kt__sgemm_openblas(pool, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C,
                                  ldc);
    return kt__sgemm_portable(pool, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

kt_status kt__sgemm_openblas(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                             int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                             int64_t ldb, float beta, float *C, int64_t ldc)
{
#ifdef KT_HAVE_OPENBLAS
    (void)pool;
    int done;
    /* Checked here too: OpenBLAS reports bad arguments by printing (xerbla). */
    KT__TRY(check_args(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, &done));
    if (done)
        return KT_OK;
    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || lda > INT32_MAX ||
        ldb > INT32_MAX || ldc > INT32_MAX)
        return kt__sgemm_portable(pool, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb,
                                  beta, C, ldc); /* beyond cblas's int sizes */
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, alpha, A,
                (int)lda, B, (int)ldb, beta, C, (int)ldc);
    return KT_OK;
#else
    return kt__sgemm_portable(pool, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C,
                              ldc);
#endif
}

/* ---- f32 staging ------------------------------------------------------------------------ */

size_t kt__f32_scratch_bytes(int64_t n)
{
    size_t bytes = (size_t)(n > 0 ? n : 0) * sizeof(float);
    return (bytes + 63) & ~(size_t)63;
}

typedef struct stage_job {
    const kt_tensor *src;
    kt_tensor *dst;
    float *f32;
    const float *cf32;
} stage_job;

static void stage_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const stage_job *s = ctx;
    for (int64_t i = begin; i < end; i += KT__CHUNK) {
        int64_t n = end - i < KT__CHUNK ? end - i : KT__CHUNK;
        const float *p = kt__load_f32(s->src, i, n, s->f32 + i);
        if (p != s->f32 + i) /* f32 source: load returned a pointer into it */
            memcpy(s->f32 + i, p, (size_t)n * sizeof *p);
    }
}

static void unstage_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const stage_job *s = ctx;
    if (s->dst->dtype == KT_F32) {
        memcpy((float *)s->dst->data + begin, s->cf32 + begin,
               (size_t)(end - begin) * sizeof(float));
        return;
    }
    kt__store_commit(s->dst, begin, end - begin, s->cf32 + begin);
}

void kt__stage_f32(kt_threadpool *pool, float *dst, const kt_tensor *src)
{
    stage_job s = {.src = src, .f32 = dst};
    kt_parallel_for(pool, kt_tensor_numel(src), 1 << 15, stage_range, &s);
}

void kt__unstage_f32(kt_threadpool *pool, kt_tensor *dst, const float *src)
{
    stage_job s = {.dst = dst, .cf32 = src};
    kt_parallel_for(pool, kt_tensor_numel(dst), 1 << 15, unstage_range, &s);
}

float *kt__scratch_take(char **cursor, int64_t n)
{
    float *p = (float *)*cursor;
    *cursor += kt__f32_scratch_bytes(n);
    return p;
}

const float *kt__stage_operand(kt_threadpool *pool, const kt_tensor *t, char **cursor)
{
    if (t->dtype == KT_F32)
        return t->data;
    float *p = kt__scratch_take(cursor, kt_tensor_numel(t));
    kt__stage_f32(pool, p, t);
    return p;
}
