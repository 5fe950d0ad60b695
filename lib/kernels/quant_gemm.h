/* The products of the MoE layer on quantized frozen weights (quant.h), each choosing a kernel
 * path from the registry by its rows M (registry.h: KT__KP_NT_Q, KT__KP_NN_Q). x and g are
 * bf16, sums accumulate in f32, and every path multiplies by the same dequantized values
 * (kt__q_value), so paths differ only in summation order. */
#ifndef KT_KERNELS_QUANT_GEMM_H
#define KT_KERNELS_QUANT_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "lib/kernels/quant.h"

/* NT (forward): y[m, n] = sum_k x[m, k] deq(w)(n, k) for m in [0, M), n in [n0, n1);
 * x [M, w->cols] (row stride ldx), y f32 (row stride ldy), overwritten. */
void kt__q_gemm_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                   const kt__qmat *w, float *y, int64_t ldy, void *work);

/* NN (input gradients): y[m, c - c0] = sum_n g0[m, n] deq(w0)(n, c), plus the same of g1 and w1
 * where g1 is not NULL (one sum: the gate and up input gradients), for c in [c0, c1) and n over
 * the weights' rows; g0, g1 [M, w->rows] (row stride ldg); y overwritten from its column 0. */
void kt__q_gemm_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                   const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                   void *work);

/* The work buffer (64-byte aligned) one thread's calls of either product need, for weights of
 * at most `rows` rows and `cols` columns and at most max_m rows of x or g. */
size_t kt__q_gemm_work_bytes(int64_t rows, int64_t cols, int64_t max_m);

/* The name of the path NT (nn 0) or NN (nn 1) of M rows takes on this CPU. */
const char *kt__q_gemm_path(int nn, int64_t M);

/* The registry's kernels of these products (registry.c): panels of the weight dequantised to
 * bf16 in the work buffer and multiplied by the bf16 kernels (every CPU), and the scalar
 * references (quant.h's values summed in index order). */
void kt__q_panel_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                    const kt__qmat *w, float *y, int64_t ldy, void *work);
void kt__q_panel_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                    const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                    void *work);
void kt__q_ref_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                  const kt__qmat *w, float *y, int64_t ldy, void *work);
void kt__q_ref_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                  const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                  void *work);

#endif
