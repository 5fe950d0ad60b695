/* The dense bf16 GEMM behind matmul: C = op(A) op(B) with bf16 operands, f32 accumulation and an
 * f32 C, on the registry's bf16 kernels (bf16_gemm.h), split over a pool.
 *
 * Row-major as kt__sgemm (sgemm.h): op(A) is M x K (A is M x K with row stride lda, or K x M when
 * trans_a), op(B) is K x N (B is K x N, or N x K when trans_b), C is M x N with row stride ldc,
 * overwritten; `work` holds kt__bf16_matmul_work_bytes. It runs the registry's MM product (both
 * operands read in place) where MM's path comes no later in the table than that of the
 * kernels' NT (B transposed, y = x w^T) or NN (B plain, y = g w); else NT or NN, op(A)
 * transposed first copied out as M x K rows into `work` (moving bf16 values is exact). Every
 * element is one of the kernels' sums over K, whatever the split: results are bitwise the same
 * for any pool size. */
#ifndef KT_KERNELS_BF16_MATMUL_H
#define KT_KERNELS_BF16_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "lib/kernels/registry.h"
#include "kt/runtime.h"

void kt__bf16_matmul(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                     int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                     float *C, int64_t ldc, void *work);

/* The bytes `work` needs (64-byte aligned): MM's buffer (registry.h's mm_work_bytes), else
 * op(A)'s rows when trans_a. */
size_t kt__bf16_matmul_work_bytes(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K);

/* The registry's descriptor the product of M rows runs on (MM's, or NT's when trans_b, else
 * NN's). */
const kt__kpath *kt__bf16_matmul_path(int trans_b, int64_t M);

#endif
