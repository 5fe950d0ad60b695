/* AVX-512 BF16 kernels of the quantized products (quant_avx512.c): callers check
 * kt__cpu_has_avx512_bf16() first. */
#ifndef KT_KERNELS_QUANT_AVX512_H
#define KT_KERNELS_QUANT_AVX512_H

#include <stdint.h>

#include "lib/kernels/quant.h"

/* Up to this many rows of x, NT runs on the weights in place (kt__q_nt_rows_avx512): each
 * block dequantised once in registers for every row; from 16 rows a dequantised panel goes to
 * the bf16 kernels (the AMX tiles where the CPU has them). */
#define KT__Q_NT_ROWS_MAX_M 15

/* kt__q_dequant_bf16's values (rows [r0, r1), columns [c0, c1) into out, row stride ldo). */
void kt__q_dequant_avx512(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                          uint16_t *out, int64_t ldo);
/* NT for M <= KT__Q_NT_ROWS_MAX_M rows: y[m, n] = sum_k x[m, k] deq(w)(n, k), n in [n0, n1). */
void kt__q_nt_rows_avx512(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                          const kt__qmat *w, float *y, int64_t ldy);

#endif
