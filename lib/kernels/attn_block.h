/* The block kernels of the attention op (lib/ops/attention.c): one f32 block product and the
 * softmax pieces of flash attention, AVX-512 where the CPU has it (kt__cpu_has_avx512, so
 * KT_CPU=portable picks the plain loops), else AVX2 + FMA (attn_block_avx2.h), else plain C.
 * Each path gives the same bits for any thread count; the paths differ in rounding (the vector exp and the order of a product's
 * sums are their own). They are not registry paths: they serve one op, at block sizes the op
 * fixes, with no row ranges to choose between.
 *
 * "Column" kernels take blocks whose rows are cols floats long, cols a multiple of 16, rows
 * ld floats apart (a multiple of 16 too). A score of -inf is a masked pair: its probability is
 * exactly 0. */
#ifndef KT_KERNELS_ATTN_BLOCK_H
#define KT_KERNELS_ATTN_BLOCK_H

#include <stdint.h>

/* C[m][n] (+)= sum over k < K, in order, of A[m sam + k sak] B[k ldb + n], for m < M, n < N
 * (accumulate: added to C, else C is overwritten). A may be read transposed (sam = 1). */
void kt__attn_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam, int64_t sak,
                   const float *B, int64_t ldb, float *C, int64_t ldc, int accumulate);

/* The same with C rescaled by columns first: C[m][n] = f[n] C[m][n] + the sum (the online
 * softmax's correction of what was summed before, in the product's last pass over C; on the
 * AVX-512 path one rounding, f C + sum by an FMA). */
void kt__attn_gemm_rescale(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                           int64_t sak, const float *B, int64_t ldb, float *C, int64_t ldc,
                           const float *f);

/* dst[c ldd + r] = f src[r lds + c] for r < rows, c < cols, and 0 for rows <= r < ldd (the
 * padding columns of a transposed block). */
void kt__attn_transpose(int64_t rows, int64_t cols, const float *src, int64_t lds, float f,
                        float *dst, int64_t ldd);

/* x[r ld + c] = cap tanh(x / cap) for r < rows, c < cols. */
void kt__attn_softcap(int64_t rows, int64_t cols, float *x, int64_t ld, float cap);

/* One step of the online softmax down the columns of s (rows = keys, columns = queries): with
 * mx = max(m, the column's maximum), s becomes exp(s - mx), l becomes l alpha + the column's
 * sum, m becomes mx and alpha = exp(m_old - mx) (the factor for what was summed before).
 * A column that has seen only masked scores keeps m = -inf, l = 0, alpha = 0. */
void kt__attn_online_cols(int64_t rows, int64_t cols, float *s, int64_t ld, float *m, float *l,
                          float *alpha);

/* x[r ld + c] *= f[c] */
void kt__attn_scale_cols(int64_t rows, int64_t cols, float *x, int64_t ld, const float *f);

/* The backward's block: with s the capped, masked scores and dp = dO V^T, s becomes
 * p = exp(s - lse) and dp becomes ds = p (dp - di), times 1 - (s / cap)^2 when cap > 0 (the
 * softcap's derivative), so ds is the gradient of the uncapped scaled scores. lse and di are
 * per column (per_col) or per row. */
void kt__attn_probs_grad(int64_t rows, int64_t cols, float *s, int64_t lds, float *dp,
                         int64_t ldp, const float *lse, const float *di, int per_col, float cap);

#endif
