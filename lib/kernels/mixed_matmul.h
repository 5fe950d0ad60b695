/* The dense matmul's mixed product: C = op(A) op(B) with one operand f32 and the other bf16 or
 * f16 (a LoRA fine-tune's f32 activations times its frozen bf16 weights, and the products of
 * their backward), f32 accumulation, an f32 C; the narrow operand widened exactly as it is
 * packed, so no f32 copy of it is ever made. Row-major as kt__sgemm (sgemm.h); C overwritten;
 * `work` holds kt__mixed_matmul_work_bytes.
 *
 * The registry's MM_MIXED path runs it (fma_packed: the 12 x 32 AVX-512 tiles of the dense bf16
 * matmul, each element one f32 sum in index order of k by FMA, the columns cut over the pool);
 * where the registry has only its scalar reference (no AVX-512, or KT_CPU=portable), the
 * portable blocked f32 kernel does, with the narrow operand widened in its packing
 * (kt__sgemm_mixed: the bits of the f32 matmul's portable kernel on the widened operand).
 * Either way every element's bits are the same for any pool size. */
#ifndef KT_KERNELS_MIXED_MATMUL_H
#define KT_KERNELS_MIXED_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "kt/runtime.h"
#include "kt/tensor.h"

kt_status kt__mixed_matmul(kt_threadpool *pool, int trans_a, int trans_b, int64_t M, int64_t N,
                           int64_t K, const void *A, kt_dtype a_dtype, int64_t lda, const void *B,
                           kt_dtype b_dtype, int64_t ldb, float *C, int64_t ldc, void *work);

/* The bytes `work` needs for a product of M rows and N columns (64-byte aligned). */
size_t kt__mixed_matmul_work_bytes(int64_t M, int64_t N);

/* Which kernel a product of M rows runs: the registry path's name ("fma_packed"), or
 * "portable_sgemm" for the fallback. */
const char *kt__mixed_matmul_path(int64_t M);

#endif
