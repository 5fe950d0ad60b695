/* The quantized formats (quant.h): layout checks, sizes, the quantizer and the dequantized
 * values every kernel path is measured against. */
#include "lib/kernels/quant.h"

#include <math.h>
#include <stdio.h>

#include "lib/core/error.h"

static const char *fmt_name(kt__qfmt fmt) { return fmt == KT__Q_INT8 ? "int8" : "int4"; }

int kt__q_layout_ok(kt__qfmt fmt, int64_t cols, int64_t group, char *why, size_t size)
{
    if (fmt == KT__Q_INT8)
        return 1;
    if (fmt != KT__Q_INT4) {
        snprintf(why, size, "unknown quantized format %d", (int)fmt);
        return 0;
    }
    if (group != 32 && group != 64 && group != 128) {
        snprintf(why, size, "int4 group size %lld is not 32, 64 or 128", (long long)group);
        return 0;
    }
    if (cols % group != 0) {
        snprintf(why, size, "int4 group size %lld does not divide the input size %lld",
                 (long long)group, (long long)cols);
        return 0;
    }
    if (cols % KT__Q4_BLOCK != 0) {
        snprintf(why, size, "int4 needs an input size that is a multiple of %d (got %lld)",
                 KT__Q4_BLOCK, (long long)cols);
        return 0;
    }
    return 1;
}

static int64_t groups_of(kt__qfmt fmt, int64_t cols, int64_t group)
{
    return fmt == KT__Q_INT8 ? 1 : cols / group;
}

size_t kt__q_value_bytes(kt__qfmt fmt, int64_t rows, int64_t cols)
{
    return (size_t)rows * (size_t)(fmt == KT__Q_INT8 ? cols : cols / 2);
}

size_t kt__q_scale_bytes(kt__qfmt fmt, int64_t rows, int64_t cols, int64_t group)
{
    return (size_t)rows * (size_t)groups_of(fmt, cols, group) * sizeof(uint16_t);
}

void kt__q_bind(kt__qmat *w, kt__qfmt fmt, int64_t rows, int64_t cols, int64_t group, void *base)
{
    w->fmt = fmt;
    w->rows = rows;
    w->cols = cols;
    w->group = fmt == KT__Q_INT8 ? cols : group;
    w->q = base;
    w->scale = (uint16_t *)(void *)((unsigned char *)base + kt__q_value_bytes(fmt, rows, cols));
}

/* The stored code of (r, c): int8, or the nibble minus 8. */
static int q_code(const kt__qmat *w, int64_t r, int64_t c)
{
    if (w->fmt == KT__Q_INT8)
        return (int8_t)w->q[r * w->cols + c];
    const uint8_t b = w->q[r * (w->cols / 2) + c / KT__Q4_BLOCK * 32 + c % 32];
    return (c % KT__Q4_BLOCK < 32 ? (b & 15) : (b >> 4)) - 8;
}

static void put_code(kt__qmat *w, int64_t r, int64_t c, int code)
{
    if (w->fmt == KT__Q_INT8) {
        w->q[r * w->cols + c] = (uint8_t)(int8_t)code;
        return;
    }
    uint8_t *b = &w->q[r * (w->cols / 2) + c / KT__Q4_BLOCK * 32 + c % 32];
    const unsigned nib = (unsigned)(code + 8) & 15u;
    *b = c % KT__Q4_BLOCK < 32 ? (uint8_t)((*b & 0xf0u) | nib) : (uint8_t)((*b & 0x0fu) | nib << 4);
}

float kt__q_value(const kt__qmat *w, int64_t r, int64_t c)
{
    const float s = kt_bf16_to_f32_1(w->scale[r * groups_of(w->fmt, w->cols, w->group) +
                                              c / w->group]);
    return kt_bf16_to_f32_1(kt_f32_to_bf16_1((float)q_code(w, r, c) * s));
}

void kt__q_dequant_bf16(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        uint16_t *out, int64_t ldo)
{
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++)
            out[(r - r0) * ldo + (c - c0)] = kt_f32_to_bf16_1(kt__q_value(w, r, c));
}

static float src_at(const void *src, kt_dtype dt, int64_t i)
{
    return dt == KT_BF16 ? kt_bf16_to_f32_1(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

/* The scale of src's values [i0, i0 + n): bf16(absmax / qmax), 0 for all zeros. */
static uint16_t group_scale(const void *src, kt_dtype dt, int64_t i0, int64_t n, int qmax)
{
    float amax = 0.0f;
    for (int64_t i = i0; i < i0 + n; i++)
        amax = fmaxf(amax, fabsf(src_at(src, dt, i)));
    return kt_f32_to_bf16_1(amax / (float)qmax);
}

kt_status kt__q_quantize(kt__qmat *w, const void *src, kt_dtype src_dtype)
{
    if (src_dtype != KT_F32 && src_dtype != KT_BF16)
        return kt__error(KT_EINVAL, "quantize %s: the weights are %s, not f32 or bf16",
                         fmt_name(w->fmt), kt_dtype_name(src_dtype));
    const int64_t ng = groups_of(w->fmt, w->cols, w->group);
    const int qmax = w->fmt == KT__Q_INT8 ? 127 : 7, qmin = w->fmt == KT__Q_INT8 ? -127 : -8;
    for (int64_t i = 0; i < w->rows * w->cols; i++)
        if (!isfinite(src_at(src, src_dtype, i)))
            return kt__error(KT_EINVAL, "quantize %s: weight [%lld, %lld] is %g (not finite)",
                             fmt_name(w->fmt), (long long)(i / w->cols), (long long)(i % w->cols),
                             (double)src_at(src, src_dtype, i));
    for (int64_t r = 0; r < w->rows; r++)
        for (int64_t g = 0; g < ng; g++) {
            const uint16_t s = group_scale(src, src_dtype, r * w->cols + g * w->group, w->group, qmax);
            if (!isfinite(kt_bf16_to_f32_1(s)))
                return kt__error(KT_EINVAL,
                                 "quantize %s: row %lld, columns from %lld: the scale overflows "
                                 "bf16",
                                 fmt_name(w->fmt), (long long)r, (long long)(g * w->group));
        }
    for (int64_t r = 0; r < w->rows; r++)
        for (int64_t g = 0; g < ng; g++) {
            const int64_t i0 = r * w->cols + g * w->group;
            const uint16_t s = group_scale(src, src_dtype, i0, w->group, qmax);
            const float sf = kt_bf16_to_f32_1(s);
            w->scale[r * ng + g] = s;
            for (int64_t c = 0; c < w->group; c++) {
                float v = sf > 0.0f ? rintf(src_at(src, src_dtype, i0 + c) / sf) : 0.0f;
                v = fminf(fmaxf(v, (float)qmin), (float)qmax);
                put_code(w, r, g * w->group + c, (int)v);
            }
        }
    return KT_OK;
}
