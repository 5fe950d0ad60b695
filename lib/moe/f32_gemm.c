/* f32 GEMMs for the MoE layer (see f32_gemm.h): the choice of path and the scalar references;
 * the kernels are fma_gemm.c's. */
#include <math.h>
#include <string.h>

#include "core/cpu_internal.h"
#include "moe/f32_gemm.h"
#include "moe/fma_gemm.h"

int kt__f32_gemm_tiled(void)
{
#ifdef KT__FMA_GEMM
    return kt__cpu_has_avx512() && !kt__cpu_f32_on_blas();
#else
    return 0;
#endif
}

static int use_rows(int64_t M) { return M <= KT__FMA_ROWS_MAX_M; }

/* From the rows path up to UNPACKED_MAX_M rows, NT and NN read w in place (fma_unpacked.c)
 * instead of packing panels: one thread, dsv2lite's gate/up (1408 x 2048, x W^T in 96-column
 * calls) and down (2048 x 1408, g W) from memory, ms, tiles -> in place: nt 8 rows 1.46-1.51 ->
 * 0.92, 12 rows 1.63-1.67 -> 1.26, 24 rows 2.04-2.06 -> 1.76; nn 8 rows 1.30-1.46 -> 1.14,
 * 12 rows 1.42-1.45 -> 1.15, 16 rows 1.53-1.59 -> 1.39-1.41; at 32 rows the tiles were faster
 * (nt 2.33 against 4.47, before the fetches covered both lines of a step; nn 2.01 against
 * 2.66). Measured on Intel; assumed alike elsewhere. */
#define UNPACKED_MAX_M 24

static int use_unpacked(int64_t M) { return M > KT__FMA_ROWS_MAX_M && M <= UNPACKED_MAX_M; }

/* nn reads w in place from one row: a decoding step's input gradient streams the weights once,
 * where the tiles copy each weight into a panel first. dsv2lite frozen f32, 2 threads, fwd+bwd
 * (alternating runs): qlen 1 18.7 -> 15.0-15.4 ms (down_grad 3.6 -> 2.7-2.9, gate_up_grad
 * 8.2 -> 5.6-6.5), qlen 16 170-174 -> 138-145. */
static int use_nn_direct(int64_t M) { return M <= UNPACKED_MAX_M; }

const char *kt__f32_gemm_path(const char *kind, int64_t M)
{
    if (!kt__f32_gemm_tiled())
        return "scalar";
    if (strcmp(kind, "nt") == 0)
        return use_rows(M) ? "fma_rows" : use_unpacked(M) ? "fma_dots" : "fma";
    return "fma"; /* nn in place sums as the tiles do */
}

/* ---- the references --------------------------------------------------------------------- */

/* s + sum a[i * sa] b[i * sb] over i < n, one fmaf per step in index order. (Built for
 * baseline x86-64, which has no FMA instruction, the compiler cannot contract the separate
 * multiply and add of TN's finish into one.) */
static float dot_ref(float s, const float *a, int64_t sa, const float *b, int64_t sb, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        s = fmaf(a[i * sa], b[i * sb], s);
    return s;
}

void kt__f32_gemm_nt_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++)
            y[m * ldy + n] =
                dot_ref(accumulate ? y[m * ldy + n] : 0.0f, x + m * ldx, 1, w + n * ldw, 1, K);
}

void kt__f32_gemm_nn_ref(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g, int64_t ldg,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = k0; k < k1; k++)
            y[m * ldy + k] =
                dot_ref(accumulate ? y[m * ldy + k] : 0.0f, g + m * ldg, 1, w + k, ldw, N);
}

void kt__f32_gemm_tn_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                         const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                         int accumulate)
{
    for (int64_t n = n0; n < n1; n++)
        for (int64_t k = 0; k < K; k++) {
            const float v = scale * dot_ref(0.0f, g + n, ldg, x + k, ldx, M);
            dw[n * lddw + k] = accumulate ? dw[n * lddw + k] + v : v;
        }
}

/* ---- dispatch --------------------------------------------------------------------------- */

void kt__f32_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                     const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0 || n1 <= n0)
        return;
#ifdef KT__FMA_GEMM
    if (kt__f32_gemm_tiled()) {
        if (use_rows(M))
            kt__fma_nt_rows_f32(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        else if (use_unpacked(M))
            kt__fma_nt_dots(KT__FMA_F32, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        else
            kt__fma_nt(KT__FMA_F32, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        return;
    }
#endif
    kt__f32_gemm_nt_ref(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

/* y = (accumulate ? y : 0) + g0 w0 (+ g1 w1 when g1 is not NULL) over columns [k0, k1): nn and
 * nn2 alike. */
static void nn_sources(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,
                       const float *w0, const float *g1, const float *w1, int64_t ldg, int64_t ldw,
                       float *y, int64_t ldy, int accumulate)
{
    if (M <= 0 || k1 <= k0)
        return;
#ifdef KT__FMA_GEMM
    if (kt__f32_gemm_tiled()) {
        (use_nn_direct(M) ? kt__fma_nn_direct : kt__fma_nn)(KT__FMA_F32, M, N, k0, k1, g0, w0, g1,
                                                            w1, ldg, ldw, y, ldy, accumulate);
        return;
    }
#endif
    kt__f32_gemm_nn_ref(M, N, k0, k1, g0, ldg, w0, ldw, y, ldy, accumulate);
    if (g1 != NULL)
        kt__f32_gemm_nn_ref(M, N, k0, k1, g1, ldg, w1, ldw, y, ldy, 1);
}

void kt__f32_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g, int64_t ldg,
                     const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    nn_sources(M, N, k0, k1, g, w, NULL, NULL, ldg, ldw, y, ldy, accumulate);
}

void kt__f32_gemm_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,
                      const float *w0, const float *g1, const float *w1, int64_t ldg, int64_t ldw,
                      float *y, int64_t ldy)
{
    nn_sources(M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, 0);
}

size_t kt__f32_gemm_tn_work_bytes(int64_t M)
{
#ifdef KT__FMA_GEMM
    return kt__fma_tn_work_bytes(M);
#else
    (void)M;
    return 0;
#endif
}

void kt__f32_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                     const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate, void *work)
{
    if (n1 <= n0 || K <= 0)
        return;
#ifdef KT__FMA_GEMM
    if (kt__f32_gemm_tiled()) {
        kt__fma_tn(KT__FMA_F32, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);
        return;
    }
#endif
    (void)work;
    kt__f32_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}
