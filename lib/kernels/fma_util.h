/* What fma_gemm.c (the packed tiles) and fma_unpacked.c (w read in place) share: addressing
 * operands of either dtype, widening rows to f32, the floating-point mode, and cutting rows
 * into blocks of equal heights. Only for x86-64 builds with the FMA kernels (KT__FMA_GEMM). */
#ifndef KT_KERNELS_FMA_UTIL_H
#define KT_KERNELS_FMA_UTIL_H

#include <stdint.h>

#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/lane_mask.h"

#ifdef KT__FMA_GEMM
#include <immintrin.h>

#define W_TARGET __attribute__((target("avx512f,avx512bw")))
#define W_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw")))

/* Operands are addressed as bytes with the element size of their source dtype (2 or 4). */
static inline int64_t bytes_of(int64_t n, kt__fma_src src)
{
    return n * (src == KT__FMA_F32 ? 4 : 2);
}

static inline const char *elem(const void *base, int64_t i, kt__fma_src src)
{
    return (const char *)base + bytes_of(i, src);
}

/* 16 values from p (the first n; the rest zeros) as f32: bf16 widened, f32 as is. */
W_INLINE __m512 load16(const void *p, int64_t n, kt__fma_src src)
{
    if (src == KT__FMA_F32)
        return _mm512_maskz_loadu_ps(kt__lanes16(n), p);
    const __m256i v = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(kt__lanes16(n), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* 16 dwords each holding two bf16 values (a pair of neighbours in a row): the first values
 * as f32 (h = 0: a shift) or the second ones (h = 1: a mask); no shuffles. */
W_INLINE __m512 pair_half(__m512i v, const int h)
{
    return _mm512_castsi512_ps(h ? _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))
                                 : _mm512_slli_epi32(v, 16));
}

/* dst[0:n] = src[0:n] as f32, then zeros up to `width` (a multiple of 16). */
W_INLINE void load_row(float *dst, const void *row, int64_t n, int64_t width, kt__fma_src src)
{
    for (int64_t j = 0; j < width; j += 16)
        _mm512_storeu_ps(dst + j, load16(elem(row, j, src), n - j, src));
}

/* rows x n of a matrix (row stride ld elements) as f32 rows lddst apart, each zero-padded to
 * a multiple of 16 values. */
W_INLINE void widen_rows(float *dst, int64_t lddst, const void *m, int64_t ld, int64_t rows,
                         int64_t n, kt__fma_src src)
{
    for (int64_t r = 0; r < rows; r++)
        load_row(dst + r * lddst, elem(m, r * ld, src), n, (n + 15) & ~(int64_t)15, src);
}

/* bf16: the FTZ and DAZ bits on for a kernel's duration (as vdpbf16ps flushes; denormal
 * operands would otherwise cost microcode assists), restored by the caller with the value
 * returned; f32 keeps the caller's mode, as sgemm. */
W_INLINE unsigned flush_denormals(kt__fma_src src)
{
    const unsigned old = _mm_getcsr();
    if (src == KT__FMA_BF16)
        _mm_setcsr(old | 0x8040);
    return old;
}

/* Rows [0, rows) cut into as few blocks as hold at most `max` rows each, of as equal heights as
 * possible: block t starts at tile_start(t) and has tile_height(t) rows (block 0 the tallest). */
typedef struct tiling {
    int64_t n, base, extra;
} tiling;

static inline tiling tiles_of(int64_t rows, int64_t max)
{
    tiling t;
    t.n = (rows + max - 1) / max;
    t.base = t.n ? rows / t.n : 0;
    t.extra = t.n ? rows % t.n : 0;
    return t;
}

static inline int64_t tile_start(const tiling *t, int64_t i)
{
    return i * t->base + (i < t->extra ? i : t->extra);
}

static inline int tile_height(const tiling *t, int64_t i)
{
    return (int)(t->base + (i < t->extra));
}

#endif
#endif
