/* The AVX2 dequantisation of the quantized products (quant_avx2.c): callers check
 * kt__cpu_has_avx2() first. */
#ifndef KT_KERNELS_QUANT_AVX2_H
#define KT_KERNELS_QUANT_AVX2_H

#include <stdint.h>

#include "lib/kernels/quant.h"

/* kt__q_dequant_bf16's values (rows [r0, r1), columns [c0, c1) into out, row stride ldo). */
void kt__q_dequant_avx2(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        uint16_t *out, int64_t ldo);

#endif
