/* attn_block.h's kernels on AVX2 + FMA (attn_block_avx2.c), which attn_block.c dispatches to
 * where the CPU has AVX2 and FMA but no AVX-512 (kt__cpu_has_avx2, so KT_CPU=portable picks the
 * plain loops). Same contracts as attn_block.h's; the "column" kernels' cols a multiple of 8.
 * kt__attn_gemm_avx2 is kt__attn_gemm (fc NULL) and kt__attn_gemm_rescale (fc: C = fc C + sum,
 * one rounding) in one. Only x86-64 builds with GCC-compatible compilers (KT__ATTN_AVX2). */
#ifndef KT_KERNELS_ATTN_BLOCK_AVX2_H
#define KT_KERNELS_ATTN_BLOCK_AVX2_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define KT__ATTN_AVX2 1

void kt__attn_gemm_avx2(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam, int64_t sak,
                        const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate,
                        const float *fc);
void kt__attn_transpose_avx2(int64_t rows, int64_t cols, const float *src, int64_t lds, float f,
                             float *dst, int64_t ldd);
void kt__attn_softcap_avx2(int64_t rows, int64_t cols, float *x, int64_t ld, float cap);
void kt__attn_online_avx2(int64_t rows, int64_t cols, float *s, int64_t ld, float *m, float *l,
                          float *alpha);
void kt__attn_scale_cols_avx2(int64_t rows, int64_t cols, float *x, int64_t ld, const float *f);
void kt__attn_probs_grad_avx2(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                              int64_t ldp, const float *lse, const float *di, int per_col,
                              float cap);
#endif

#endif
