/* The GEMM kernels for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel client and
 * older Xeon cores): every product kind of the registry (registry.h) on 256-bit vfmadd231ps,
 * bf16 widened to f32 in registers (a shift of the u16 into the high half, exact), f16 by
 * vcvtph2ps (F16C), f32 as is. Compiled with a target attribute, so the build stays portable;
 * the registry reaches them only where kt__cpu_has_avx2() and not kt__cpu_has_avx512().
 * Only x86-64 builds with GCC-compatible compilers have them (KT__AVX2_GEMM).
 *
 * kt__avx2_gemm (avx2_gemm.c): C = op(A) op(B) blocked for the caches, 256 steps of the
 * reduction by 128 columns of B widened into a panel of 16-column strips, A's block widened
 * in its own layout, register tiles of up to 6 rows x 16 columns (12 ymm accumulators). Every
 * element of C is one f32 sum in index order of the reduction, each product added by an FMA:
 * the sums of the AVX-512 tiles (fma_gemm.h), so the bits of the scalar references for
 * bf16 without accumulate and for f32 (kt__f32_gemm_*_ref's fmaf chain); with accumulate the
 * sum starts at C's value (NT, NN) or C gets scale * sum added (TN). bf16 x bf16 runs with
 * denormals flushed (as the AVX-512 kernels), other types keep the caller's mode.
 *
 * kt__avx2_nt_dots (avx2_dots.c): NT for a few rows of x, w's rows read in place (no panel),
 * 4 rows of w side by side: 8 lanes of partial sums along k each (lane j the k = j mod 8),
 * added in a fixed tree at the end, then added to y. Its own sums, not the tiles'. */
#ifndef KT_KERNELS_AVX2_GEMM_H
#define KT_KERNELS_AVX2_GEMM_H

#include <stdint.h>

#include "lib/kernels/fma_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define KT__AVX2_GEMM 1
#endif

/* One operand: element (i, j) of the logical matrix at p[i ld + j], or p[j ld + i] when
 * trans, of element type src. */
typedef struct kt__avx2_op {
    const void *p;
    int64_t ld;
    int trans;
    kt__fma_src src;
} kt__avx2_op;

/* How the sums meet C. */
typedef enum kt__avx2_out {
    KT__AVX2_OVERWRITE, /* C = sum */
    KT__AVX2_CHAIN,     /* C = ((C + p0) + p1) ...: the sum continues from C's value */
    KT__AVX2_SCALED,    /* C = scale * sum (TN overwriting) */
    KT__AVX2_SCALED_ADD /* C = C + scale * sum (TN accumulating) */
} kt__avx2_out;

/* C[m, n] for m < M, n < N (row stride ldc) from A [M, K] and B [K, N]. */
void kt__avx2_gemm(int64_t M, int64_t N, int64_t K, kt__avx2_op a, kt__avx2_op b, float *c,
                   int64_t ldc, kt__avx2_out out, float scale);

/* y[m, n] = (accumulate ? y : 0) + sum_k x[m, k] w[n, k] for m < M, n in [n0, n1); bf16 or
 * f32 operands. Meant for M up to KT__AVX2_DOTS_MAX_M (any M works). */
#define KT__AVX2_DOTS_MAX_M 4
void kt__avx2_nt_dots(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *x,
                      int64_t ldx, const void *w, int64_t ldw, float *y, int64_t ldy,
                      int accumulate);

#endif
