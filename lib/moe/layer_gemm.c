/* The layer's GEMMs on its own thread pool, one block per call, in the weight dtype: the bf16
 * kernels (bf16_gemm.h), the f32 ones (f32_gemm.h), or for quantized experts the quantized
 * products (quant_gemm.h) with the calling thread's work buffer. Only for layers with
 * m->dim.tiled; the others call kt__sgemm once per expert (forward.c, backward.c). */
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/f32_gemm.h"
#include "lib/kernels/quant_gemm.h"
#include "lib/moe/moe_internal.h"

static void *q_work(const kt_moe *m, int thread)
{
    return m->store.q_work + (size_t)thread * m->store.q_work_bytes;
}

void kt__moe_gemm_nt(const kt_moe *m, int thread, int64_t M, int64_t n0, int64_t n1, int64_t K,
                     const void *x, int64_t ldx, const void *w, int64_t ldw, const void *next,
                     float *y, int64_t ldy)
{
    if (m->dim.quant)
        kt__q_gemm_nt(M, n0, n1, x, ldx, w, y, ldy, q_work(m, thread));
    else if (m->dim.bf16)
        kt__bf16_gemm_nt_next(M, n0, n1, K, x, ldx, w, ldw, next, y, ldy, 0);
    else
        kt__f32_gemm_nt(M, n0, n1, K, x, ldx, w, ldw, y, ldy, 0);
}

void kt__moe_gemm_nn(const kt_moe *m, int thread, int64_t M, int64_t N, int64_t k0, int64_t k1,
                     const void *g, int64_t ldg, const void *w, int64_t ldw, float *y, int64_t ldy)
{
    if (m->dim.quant)
        kt__q_gemm_nn(M, k0, k1, g, w, NULL, NULL, ldg, y, ldy, q_work(m, thread));
    else if (m->dim.bf16)
        kt__bf16_gemm_nn(M, N, 0, k1 - k0, g, ldg, kt__moe_cdt_at(m, w, k0), ldw, y, ldy, 0);
    else
        kt__f32_gemm_nn(M, N, 0, k1 - k0, g, ldg, kt__moe_cdt_at(m, w, k0), ldw, y, ldy, 0);
}

void kt__moe_gemm_nn2(const kt_moe *m, int thread, int64_t M, int64_t N, int64_t k0, int64_t k1,
                      const void *g0, const void *w0, const void *g1, const void *w1, int64_t ldg,
                      int64_t ldw, float *y, int64_t ldy, int stream)
{
    if (m->dim.quant)
        kt__q_gemm_nn(M, k0, k1, g0, w0, g1, w1, ldg, y + k0, ldy, q_work(m, thread));
    else if (m->dim.bf16)
        kt__bf16_gemm_nn2(M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, stream);
    else
        kt__f32_gemm_nn2(M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy);
}

void kt__moe_gemm_tn(const kt_moe *m, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *g,
                     int64_t ldg, const void *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate, void *work)
{
    if (m->dim.bf16)
        kt__bf16_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);
    else
        kt__f32_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);
}

size_t kt__moe_gemm_tn_work_bytes(const kt_moe *m, int64_t M)
{
    return m->dim.bf16 ? kt__bf16_gemm_tn_work_bytes(M) : kt__f32_gemm_tn_work_bytes(M);
}
