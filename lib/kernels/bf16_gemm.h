/* bf16 GEMM kernels for the MoE layer and the dense matmul: bf16 operands, f32 accumulation
 * and output.
 *
 * All three read the weights in their original row-major layout (Hugging Face's [out, in]),
 * so the layer holds each expert's weights once, with no transposed copy for backward. Each
 * call is single-threaded and computes one block of the output; the MoE layer spreads blocks
 * of all experts over its thread pool. Summation order over the reduced dimension is fixed
 * (independent of the block split), so results do not depend on the thread count.
 *
 * Matrices are row-major with leading dimensions in elements; bf16 is uint16_t.
 */
#ifndef KT_KERNELS_BF16_GEMM_H
#define KT_KERNELS_BF16_GEMM_H

#include <stddef.h>
#include <stdint.h>

/* Forward and weight-side products ("NT"): for rows m in [0, M) and columns n in [n0, n1),
 *   y[m, n] = (accumulate ? y[m, n] : 0) + sum_k x[m, k] * w[n, k]
 * x [M, K], w [N, K] (a projection's weight), y [M, N] f32. */
void kt__bf16_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                      const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* Up to this many rows of x, nt only streams w, one row at a time in address order. */
#define KT__BF16_NT_ROWS_MAX_M 4

/* nt, where the caller reads the rows of a weight at `next` after this call (NULL: w's rows
 * after n1): above 32 rows of x the kernel fetches them ahead while its last block runs
 * (below, it only streams w, and its fetches run ahead along w's own rows). */
void kt__bf16_gemm_nt_next(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                           int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                           float *y, int64_t ldy, int accumulate);

/* Input gradients ("NN"): for rows m in [0, M) and columns k in [k0, k1),
 *   y[m, k] = (accumulate ? y[m, k] : 0) + sum_n g[m, n] * w[n, k]
 * g [M, N] (output gradient), w [N, K], y [M, K] f32. */
void kt__bf16_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                      const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* At most this many rows of g, nn and nn2 stream w (each pair of its rows read whole over the
 * call's columns); above, they walk groups of columns down the rows. Callers that cut the
 * columns into pieces keep such products whole (a narrow piece streams badly). */
#define KT__BF16_NN_STREAM_MAX_M 16

/* y[m, k] = sum_n g0[m, n] w0[n, k] + sum_n g1[m, n] w1[n, k] over columns [k0, k1) (the
 * gate and up input gradients): one pass that writes y once. stream: y's whole aligned
 * blocks are stored past the caches (an output of many megabytes, read back only later: a
 * plain store would first read every line in); the same bits either way. */
void kt__bf16_gemm_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                       const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                       int64_t ldw, float *y, int64_t ldy, int stream);

/* Weight gradients ("TN"): for rows n in [n0, n1) and all k in [0, K),
 *   dw[n, k] = (accumulate ? dw[n, k] : 0) + scale * sum_m g[m, n] * x[m, k]
 * g [M, N], x [M, K], dw [N, K] f32. Overwriting never reads dw, and stores whole aligned
 * blocks past the caches (the first micro-batch of a step writes every expert's gradient:
 * gigabytes, read next by the optimizer, not by this layer). tn_acc is tn with accumulate.
 * Above 512 rows the AVX-512 kernel wants a work buffer (64-byte aligned, at least
 * kt__bf16_gemm_tn_work_bytes(M) bytes: a multiple of 64, enough for any M' <= M): its
 * packing buffers, on the stack up to 512 rows. With work NULL it walks x's rows in place instead
 * (the same bits, at about half the speed): the kernels never allocate. */
void kt__bf16_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                      const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                      int accumulate, void *work);
size_t kt__bf16_gemm_tn_work_bytes(int64_t M);
void kt__bf16_gemm_tn_acc(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                          int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                          float scale, void *work);

/* The name of the path (registry.h) whose sums a TN product of M rows computes on this CPU (a
 * function of M alone; each sums in its own order): "amx", "fma" (fma_gemm.h), "avx512_bf16"
 * (vdpbf16ps) or "scalar". */
const char *kt__bf16_gemm_path(int64_t M);
/* The same for one kind of product ("nt", "nn" (nn2 too) or "tn"): "fma_dots" for NT's
 * middling row counts, "fma" where NN reads w in place (fma_direct, the tiles' sums). */
const char *kt__bf16_gemm_kind_path(const char *kind, int64_t M);

/* The plain scalar versions: the reference the fast kernels are tested against, and the
 * portable path when the CPU lacks AVX-512 BF16. */
void kt__bf16_gemm_nt_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                          int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                          int accumulate);
void kt__bf16_gemm_nn_ref(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,
                          int64_t ldg, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                          int accumulate);
void kt__bf16_gemm_tn_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                          int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                          float scale, int accumulate);
/* The dense matmul's product (registry.h's KT__KP_MM_BF16), scalar: c[m, n] for n in [n0, n1)
 * = sum_k op(a)[m, k] op(b)[k, n] (a [M, K] or, trans_a, [K, M]; b [K, N] or, trans_b,
 * [N, K]), overwritten; the sums of the nt and nn references. */
void kt__bf16_gemm_mm_ref(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1, int64_t K,
                          const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float *c,
                          int64_t ldc);
void kt__bf16_gemm_tn_acc_ref(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                              int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                              float scale);

#endif
