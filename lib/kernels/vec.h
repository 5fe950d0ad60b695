/* Small f32 vector kernels for the LoRA adapters (rank r is small, so the adapter products are
 * dot products and axpys over the long dimension): AVX-512 where the CPU has it, else AVX2 +
 * FMA (the same sums: 16 lanes as two ymm), else plain loops with the same 16-lane order, so a
 * given build and CPU gives the same bits for any thread count. */
#ifndef KT_KERNELS_VEC_H
#define KT_KERNELS_VEC_H

#include <stdint.h>

/* sum a[i] b[i]: 16 lane sums over i = 16c + l in order, then a fixed tree. */
float kt__vec_dot(int64_t n, const float *a, const float *b);
/* y[i] += alpha x[i] */
void kt__vec_axpy(int64_t n, float alpha, const float *x, float *y);
/* out[r R + q] = kt__vec_dot(n, x's row r widened to f32, a_q) for rows r < nrows and ranks
 * q < R (the same bits), a_q[i] = a[q a_row + i a_col], x's rows ldx elements apart in the
 * compute dtype (bf16 when bf16, else f32): the x A^T of a block of rows, with each chunk of
 * a read once for a block of rows (row by row, a's r pieces came back from L2 for each). */
void kt__vec_rows_dots(int64_t n, int64_t nrows, const void *x, int64_t ldx, int bf16,
                       const float *a, int64_t a_row, int64_t a_col, int64_t R, float *out);
/* y[r ldy + i] += scale (sum over q < R in order of coef[r R + q] x[q ldx + i]) for rows
 * r < nrows and i < n: per row, the bits of R kt__vec_axpy calls into a zeroed buffer, then
 * one kt__vec_axpy of it (times scale) into y's row, with each column block of x read once
 * for all rows and y read and written once */
void kt__vec_rows_axpys(int64_t n, int64_t nrows, const float *coef, int64_t R, const float *x,
                        int64_t ldx, float scale, float *y, int64_t ldy);
/* acc[q lda + i] = sum over rows r < nrows in order of coef[r R + q] x[r][i], for q < R and
 * i < n, x's rows ldx elements apart in the compute dtype (bf16 when bf16, else f32): the bits
 * of zeroing acc and then, row by row, R kt__vec_axpy calls on the widened row; acc is
 * written once. */
void kt__vec_rank_update(int64_t n, int64_t nrows, const void *x, int64_t ldx, int bf16,
                         const float *coef, int64_t R, float *acc, int64_t lda);

#endif
