/* Quantized frozen weights: the formats, the quantizer, and the products the MoE layer runs on
 * them (quant_gemm.c chooses a kernel path for each from the registry, registry.h).
 *
 * A matrix [rows, cols] is quantized along cols (a projection's input dimension), each row on
 * its own:
 *   INT8  one int8 per value in [-127, 127], one scale per row (group = cols);
 *   INT4  two values per byte in [-8, 7] (stored as nibble - 8), one scale per group of 32, 64
 *         or 128 columns; each 64 columns are 32 bytes, byte j holding column j in its low
 *         nibble and column j + 32 in its high one (so a vector's low and high nibbles are two
 *         runs of consecutive columns).
 * Scales are bf16. The value a weight stands for, what every kernel path multiplies by
 * (the one float64 reference of the tests), is
 *     deq(r, c) = bf16(q(r, c) * scale(r, c / group))
 * rounded to nearest even: the bf16 a dequantising kernel feeds to vdpbf16ps or the bf16 tiles,
 * and which the FMA paths round to as well, so that every path sums the same products.
 * Quantizing: scale = bf16(absmax / qmax) (qmax 127 or 7), q = round-to-nearest(w / scale)
 * clamped to the range; a zero row gets scale 0. Re-quantizing dequantized weights gives the same
 * q and scales back (a checkpoint stores them dequantized; see lib/moe/store.c). */
#ifndef KT_KERNELS_QUANT_H
#define KT_KERNELS_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kt/status.h"
#include "kt/tensor.h"

typedef enum kt__qfmt { KT__Q_NONE = 0, KT__Q_INT8 = 1, KT__Q_INT4 = 2 } kt__qfmt;

/* INT4 stores columns in blocks of this many (32 bytes). */
#define KT__Q4_BLOCK 64

typedef struct kt__qmat {
    kt__qfmt fmt;
    int64_t rows, cols;
    int64_t group;   /* columns per scale: cols for INT8 */
    uint8_t *q;      /* INT8: int8 [rows][cols]; INT4: [rows][cols / 2] (the nibble layout above) */
    uint16_t *scale; /* bf16 [rows][cols / group] */
} kt__qmat;

/* Why a matrix of this many columns cannot take the format and group: into why, returning 0;
 * 1 when it can (INT8 takes any group argument, its group is cols). */
int kt__q_layout_ok(kt__qfmt fmt, int64_t cols, int64_t group, char *why, size_t size);
/* Bytes of the values and of the scales of a [rows, cols] matrix. */
size_t kt__q_value_bytes(kt__qfmt fmt, int64_t rows, int64_t cols);
size_t kt__q_scale_bytes(kt__qfmt fmt, int64_t rows, int64_t cols, int64_t group);
/* Points w at its values and scales in a block of kt__q_value_bytes + kt__q_scale_bytes. */
void kt__q_bind(kt__qmat *w, kt__qfmt fmt, int64_t rows, int64_t cols, int64_t group, void *base);

/* Quantizes src ([rows, cols] contiguous, KT_F32 or KT_BF16) into w. A NaN or Inf value, or a
 * row whose scale overflows bf16, is KT_EINVAL naming the row and column; w is then unchanged
 * (every row is checked before any is written). */
kt_status kt__q_quantize(kt__qmat *w, const void *src, kt_dtype src_dtype);

/* deq(r, c), the value the kernels multiply by (see the top). */
float kt__q_value(const kt__qmat *w, int64_t r, int64_t c);
/* deq of rows [r0, r1), columns [c0, c1) as bf16 into out (row stride ldo). */
void kt__q_dequant_bf16(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        uint16_t *out, int64_t ldo);

#endif
