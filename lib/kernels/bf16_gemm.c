/* The bf16 GEMM entry points (bf16_gemm.h): each picks its path once from the registry
 * (registry.h) and runs it. The kernels are bf16_nt_dpbf16.c, bf16_nn_dpbf16.c, bf16_tn_dpbf16.c (vdpbf16ps),
 * fma_gemm.c and fma_unpacked.c (bf16 widened to f32), amx_gemm.c and bf16_gemm_ref.c. */
#include "lib/kernels/bf16_gemm.h"

#include "lib/kernels/registry.h"

const char *kt__bf16_gemm_path(int64_t M) { return kt__kpath_sums_name(KT__KP_TN_BF16, M); }

const char *kt__bf16_gemm_kind_path(const char *kind, int64_t M)
{
    const kt__kprod prod = kind[0] == 'n' && kind[1] == 't'   ? KT__KP_NT_BF16
                           : kind[0] == 'n' && kind[1] == 'n' ? KT__KP_NN_BF16
                                                              : KT__KP_TN_BF16;
    return kt__kpath_sums_name(prod, M);
}

void kt__bf16_gemm_nt_next(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                           int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                           float *y, int64_t ldy, int accumulate)
{
    if (M <= 0)
        return; /* no rows */
    kt__kpath_pick(KT__KP_NT_BF16, M)->nt_bf16(M, n0, n1, K, x, ldx, w, ldw, next, y, ldy,
                                               accumulate);
}

void kt__bf16_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                      const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    kt__bf16_gemm_nt_next(M, n0, n1, K, x, ldx, w, ldw, NULL, y, ldy, accumulate);
}

void kt__bf16_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                      const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0)
        return; /* no rows */
    kt__kpath_pick(KT__KP_NN_BF16, M)->nn_bf16(M, N, k0, k1, g, ldg, w, ldw, y, ldy, accumulate);
}

void kt__bf16_gemm_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                       const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                       int64_t ldw, float *y, int64_t ldy, int stream)
{
    if (M <= 0)
        return; /* no rows */
    kt__kpath_pick(KT__KP_NN2_BF16, M)->nn2_bf16(M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy,
                                                 stream);
}

/* The largest buffer of any path's TN (the path is chosen per product, the buffer per layer). */
size_t kt__bf16_gemm_tn_work_bytes(int64_t M)
{
    return kt__kpath_tn_work_bytes(KT__KP_TN_BF16, M);
}

void kt__bf16_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                      const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                      int accumulate, void *work)
{
    kt__kpath_pick(KT__KP_TN_BF16, M)->tn_bf16(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale,
                                               accumulate, work);
}

void kt__bf16_gemm_tn_acc(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                          int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                          float scale, void *work)
{
    kt__bf16_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, 1, work);
}
