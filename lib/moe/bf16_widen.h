/* bf16 GEMMs on the f32 FMA units: the operands widened to f32 as they are packed (exact: a
 * bf16 value is the top half of an f32), products and sums by vfmadd231ps.
 *
 * Why a second AVX-512 path: on an Emerald Rapids core (measured: 1.34 G vdpbf16ps/s against
 * 5.4 G vfmadd231ps/s) vdpbf16ps issues at a quarter of the FMA rate, so with 32 products per
 * vdpbf16ps and 16 per FMA the FMA units multiply bf16 twice as fast. Other Intel cores with
 * AVX-512 BF16 are assumed alike (not measured here); AMD Zen 4/5 keep vdpbf16ps, whose
 * products reached about twice this FMA rate on the Zen 5 VM of earlier sessions. CPUs with
 * AVX-512F but no AVX-512 BF16 get this path too instead of the scalar one.
 * Only x86-64 builds with GCC-compatible compilers have it (bf16_gemm.c's BF_HAVE_AVX512).
 *
 * Same contracts as bf16_gemm.h (block of the output per call, single-threaded, results
 * independent of the block split). Summation order: every output element is one f32 sum in
 * index order of the reduced dimension, each product added by an FMA (products of two bf16
 * values are exact in f32, so each step is the scalar reference's `s += a * b`): without
 * accumulate the bits are kt__bf16_gemm_*_ref's for normal numbers. With accumulate, NT and NN
 * add the products to y's value in order (((y + p0) + p1) ...) where the reference adds their
 * sum; TN adds scale * sum, as the reference. The kernels run with denormals flushed to zero
 * (as vdpbf16ps does; denormal operands would otherwise cost microcode assists).
 *
 * Tiles: 12 rows x 32 columns of f32 accumulators (24 zmm), one operand broadcast per row and
 * step, the other two zmm of a packed panel [step][32] that stays in L1:
 *  - NN y = g w: the panel is w's rows widened (contiguous); g's rows of a chunk of the
 *    reduction are widened once and broadcast from there.
 *  - NT y = x w^T: the panel is w transposed (16 x 16 blocks); x's rows widened per chunk.
 *  - TN dw = scale g^T x: the panel is x's rows widened; g's 12 columns of a tile packed
 *    [m][12]; the reduction (M) whole in registers.
 * The buffers are on the stack (up to about 200 KiB); TN above 512 rows wants the caller's work
 * buffer (kt__bf16w_tn_work_bytes), as the vdpbf16ps kernel does. */
#ifndef KT_MOE_BF16_WIDEN_H
#define KT_MOE_BF16_WIDEN_H

#include <stddef.h>
#include <stdint.h>

void kt__bf16w_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                  const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* y[m, k] = (accumulate ? y : 0) + sum_n g0[m, n] w0[n, k] (+ sum_n g1[m, n] w1[n, k] when g1
 * is not NULL, continuing the same sum) over columns [k0, k1). */
void kt__bf16w_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                  const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                  int64_t ldw, float *y, int64_t ldy, int accumulate);

void kt__bf16w_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                  const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                  int accumulate, void *work);
/* The work buffer TN wants at M rows (0 up to 512 rows; enough for any M' <= M). */
size_t kt__bf16w_tn_work_bytes(int64_t M);
/* Rows up to which TN keeps its buffers on the stack. */
#define KT__BF16W_TN_STACK_ROWS 512

#endif
