/* f32 GEMM kernels for the MoE layer: the contracts of bf16_gemm.h (one block of the output per
 * call, single-threaded, results independent of the block split and of the thread count) with
 * f32 operands. The layer runs its f32 products through them on its own thread pool where
 * kt__f32_gemm_tiled() says so (x86-64 with AVX-512, unless KT_CPU=blas), and otherwise calls
 * kt__sgemm (OpenBLAS, or the portable kernel) once per expert.
 *
 * Paths, chosen by the product's rows M alone (each sums in its own order):
 *  - "fma": fma_gemm.h's 12 x 32 register tiles; every element one f32 sum in index order,
 *    one FMA per step: bitwise kt__f32_gemm_*_ref without accumulate.
 *  - "fma_rows" (nt up to KT__FMA_ROWS_MAX_M rows): x w^T as dot products along w's rows
 *    (kt__fma_nt_rows_f32), w streamed in long runs (a decoding step's product only reads the
 *    weights).
 *  - "fma_dots" (nt of KT__FMA_ROWS_MAX_M + 1 to 24 rows): dot products along w's rows
 *    (kt__fma_nt_dots), w read in place. nn of 1 to 24 rows reads w in place too
 *    (kt__fma_nn_direct), with the tiles' sums ("fma").
 *  - "scalar": the references, where the kernels are not built or the CPU lacks AVX-512. */
#ifndef KT_KERNELS_F32_GEMM_H
#define KT_KERNELS_F32_GEMM_H

#include <stddef.h>
#include <stdint.h>

/* Whether the layer's f32 products go through these kernels. */
int kt__f32_gemm_tiled(void);

/* The path a product of M rows takes with `kind` one of "nt", "nn", "tn". */
const char *kt__f32_gemm_path(const char *kind, int64_t M);

/* y[m, n] = (accumulate ? y : 0) + sum_k x[m, k] w[n, k], n in [n0, n1) */
void kt__f32_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                     const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* y[m, k] = (accumulate ? y : 0) + sum_n g[m, n] w[n, k], k in [k0, k1) */
void kt__f32_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g, int64_t ldg,
                     const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* y[m, k] = sum_n g0[m, n] w0[n, k] + sum_n g1[m, n] w1[n, k], one sum, k in [k0, k1) */
void kt__f32_gemm_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g0,
                      const float *w0, const float *g1, const float *w1, int64_t ldg, int64_t ldw,
                      float *y, int64_t ldy);

/* dw[n, k] = (accumulate ? dw : 0) + scale sum_m g[m, n] x[m, k], n in [n0, n1), all k.
 * work: as kt__bf16_gemm_tn's (kt__f32_gemm_tn_work_bytes(M) bytes, 64-byte aligned, or NULL
 * for the slower in-place walk above 512 rows). Overwriting stores whole aligned blocks past
 * the caches and never reads dw. */
void kt__f32_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                     const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate, void *work);
size_t kt__f32_gemm_tn_work_bytes(int64_t M);

/* The scalar references: every element one sum in index order, s = fmaf(a, b, s). */
void kt__f32_gemm_nt_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate);
void kt__f32_gemm_nn_ref(int64_t M, int64_t N, int64_t k0, int64_t k1, const float *g, int64_t ldg,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate);
void kt__f32_gemm_tn_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *g, int64_t ldg,
                         const float *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                         int accumulate);

#endif
