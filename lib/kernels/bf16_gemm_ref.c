/* Scalar bf16 GEMMs (see bf16_gemm.h): the reference and the portable path. Products of two
 * bf16 values are exact in f32; sums run in f32 in index order. */
#include "kt/tensor.h"
#include "lib/kernels/bf16_gemm.h"

static float bf(uint16_t v) { return kt_bf16_to_f32_1(v); }

void kt__bf16_gemm_nt_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                          int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                          int accumulate)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s += bf(x[m * ldx + k]) * bf(w[n * ldw + k]);
            y[m * ldy + n] = accumulate ? y[m * ldy + n] + s : s;
        }
}

void kt__bf16_gemm_nn_ref(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,
                          int64_t ldg, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                          int accumulate)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = k0; k < k1; k++) {
            float s = 0.0f;
            for (int64_t n = 0; n < N; n++)
                s += bf(g[m * ldg + n]) * bf(w[n * ldw + k]);
            y[m * ldy + k] = accumulate ? y[m * ldy + k] + s : s;
        }
}

void kt__bf16_gemm_tn_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                          int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                          float scale, int accumulate)
{
    for (int64_t n = n0; n < n1; n++)
        for (int64_t k = 0; k < K; k++) {
            float s = 0.0f;
            for (int64_t m = 0; m < M; m++)
                s += bf(g[m * ldg + n]) * bf(x[m * ldx + k]);
            dw[n * lddw + k] = accumulate ? dw[n * lddw + k] + scale * s : scale * s;
        }
}

void kt__bf16_gemm_tn_acc_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                              int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                              float scale)
{
    kt__bf16_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, 1);
}

void kt__bf16_gemm_mm_ref(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1, int64_t K,
                          const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float *c,
                          int64_t ldc)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s += bf(trans_a ? a[k * lda + m] : a[m * lda + k]) *
                     bf(trans_b ? b[n * ldb + k] : b[k * ldb + n]);
            c[m * ldc + n] = s;
        }
}
