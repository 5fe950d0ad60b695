/* The quantized products (quant_gemm.h): for now the scalar reference on every CPU. */
#include "lib/kernels/quant_gemm.h"

#include "kt/tensor.h"

static float bf(uint16_t v) { return kt_bf16_to_f32_1(v); }

void kt__q_gemm_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                   const kt__qmat *w, float *y, int64_t ldy, void *work)
{
    (void)work;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < w->cols; k++)
                s += bf(x[m * ldx + k]) * kt__q_value(w, n, k);
            y[m * ldy + n] = s;
        }
}

void kt__q_gemm_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                   const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                   void *work)
{
    (void)work;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = c0; c < c1; c++) {
            float s = 0.0f;
            for (int64_t n = 0; n < w0->rows; n++)
                s += bf(g0[m * ldg + n]) * kt__q_value(w0, n, c);
            for (int64_t n = 0; g1 != NULL && n < w1->rows; n++)
                s += bf(g1[m * ldg + n]) * kt__q_value(w1, n, c);
            y[m * ldy + (c - c0)] = s;
        }
}

size_t kt__q_gemm_work_bytes(int64_t rows, int64_t cols, int64_t max_m)
{
    (void)rows, (void)cols, (void)max_m;
    return 0;
}

const char *kt__q_gemm_path(int nn, int64_t M)
{
    (void)nn, (void)M;
    return "scalar";
}
