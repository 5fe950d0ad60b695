/* The shared row-major single-precision GEMM behind matmul, conv1d and the MoE layer, and
 * the f32 staging of bf16/f16 operands for kernels that compute through it.
 *
 * C = alpha * op(A) * op(B) + beta * C, all row-major: op(A) is M x K (A is M x K with
 * row stride lda, or K x M when trans_a), op(B) is K x N (B is K x N with row stride ldb,
 * or N x K when trans_b), C is M x N with row stride ldc. beta == 0 overwrites C without
 * reading it (NaN in C does not propagate), as in BLAS.
 *
 * kt__sgemm uses OpenBLAS when libkt is built with it (OpenBLAS then runs its own threads
 * and `pool` is not used), else the portable kernel. The portable kernel splits the output
 * over the pool in a fixed tiling and sums every C element over K in the same order
 * whatever the thread count, so its results are bitwise identical for any pool size.
 * Neither allocates. Bad sizes or strides return KT_EINVAL ("sgemm: ..."). */
#ifndef KT_KERNELS_SGEMM_H
#define KT_KERNELS_SGEMM_H

#include <stddef.h>
#include <stdint.h>

#include "kt/runtime.h"
#include "kt/tensor.h"

kt_status kt__sgemm(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                    int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float beta, float *C, int64_t ldc);

/* The portable kernel, whatever the build (so it can be tested against OpenBLAS). */
kt_status kt__sgemm_portable(kt_threadpool *pool, int trans_a, int trans_b, int64_t M,
                             int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                             const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

/* The portable kernel (alpha 1, beta 0) on operands of any float dtype (A and B point at
 * elements of a_dtype / b_dtype), bf16 and f16 widened exactly as the blocks are packed, so no
 * f32 copy of either is made: bitwise kt__sgemm_portable on the widened operands. */
kt_status kt__sgemm_mixed(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                          int64_t K, const void *A, kt_dtype a_dtype, int64_t lda, const void *B,
                          kt_dtype b_dtype, int64_t ldb, float *C, int64_t ldc);

/* 1 when kt__sgemm runs OpenBLAS (which threads itself and ignores the pool): in builds
 * with it, unless its kernel set predates the CPU's AVX2 (sgemm.c) or KT_CPU=blas says so. */
int kt__sgemm_is_openblas(void);
/* OpenBLAS's sgemm in builds that have it (whatever kt__sgemm chooses), else the portable
 * kernel: for the tests and kt-bench's library peer. */
kt_status kt__sgemm_openblas(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                             int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                             int64_t ldb, float beta, float *C, int64_t ldc);
/* OpenBLAS's kernel set ("SkylakeX", "Haswell", ...; a DYNAMIC_ARCH build picks it at load
 * from the CPU model and falls back to an older one for models it does not know: Debian's
 * 0.3.21 runs "Prescott" (SSE3) on Emerald Rapids), or "portable" in builds without it. */
const char *kt__sgemm_core_name(void);

/* ---- f32 staging for bf16/f16 operands -------------------------------------------------- */

/* Bytes that n floats take in scratch, rounded up so that the next region stays 64-byte
 * aligned. */
size_t kt__f32_scratch_bytes(int64_t n);
/* dst[0..numel) = src as f32 (src contiguous, any float dtype), split over the pool. */
void kt__stage_f32(kt_threadpool *pool, float *dst, const kt_tensor *src);
/* dst (contiguous, any float dtype) = src rounded to dst's dtype, split over the pool. */
void kt__unstage_f32(kt_threadpool *pool, kt_tensor *dst, const float *src);
/* Takes n floats off the front of a scratch cursor. */
float *kt__scratch_take(char **cursor, int64_t n);
/* t as f32: its own data when it is f32, else staged into scratch taken from the cursor. */
const float *kt__stage_operand(kt_threadpool *pool, const kt_tensor *t, char **cursor);

#endif
