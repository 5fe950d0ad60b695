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

/* 16 values from p (the first n; the rest zeros) as f32: bf16 and f16 widened (exactly), f32 as
 * is. */
W_INLINE __m512 load16(const void *p, int64_t n, kt__fma_src src)
{
    if (src == KT__FMA_F32)
        return _mm512_maskz_loadu_ps(kt__lanes16(n), p);
    const __m256i v = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(kt__lanes16(n), p));
    if (src == KT__FMA_F16)
        return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* 16 dwords each holding two bf16 values (a pair of neighbours in a row): the first values
 * as f32 (h = 0: a shift) or the second ones (h = 1: a mask); no shuffles. */
W_INLINE __m512 pair_half(__m512i v, const int h)
{
    return _mm512_castsi512_ps(h ? _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))
                                 : _mm512_slli_epi32(v, 16));
}

/* 16 x 16 f32 transpose in registers: r[i] lane j -> r[j] lane i. */
W_INLINE void transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d b0 = _mm512_castps_pd(t[4 * i + 2]), b1 = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    /* r[4i + j] now holds, in each 128-bit lane q, rows 4i..4i+3 of column 4q + j */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            const __m512 a = r[8 * i + j], b = r[8 * i + 4 + j];
            t[8 * i + j] = _mm512_shuffle_f32x4(a, b, 0x88);     /* lanes q = 0, 2 */
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(a, b, 0xDD); /* lanes q = 1, 3 */
        }
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++) {
            const __m512 a = t[4 * h + j], b = t[8 + 4 * h + j];
            r[4 * (2 * 0 + h) + j] = _mm512_shuffle_f32x4(a, b, 0x88);
            r[4 * (2 * 1 + h) + j] = _mm512_shuffle_f32x4(a, b, 0xDD);
        }
}

/* A panel of 32 columns from bf16 rows: p[k][j] = w[j, k] as f32 for j < nrows (zeros up to
 * 32), k < kc. 16 rows of 32 values are read as 16 rows of 16 pairs (a dword each) and
 * transposed as dwords, so that r[s] lane j holds w[j, 2s] and w[j, 2s + 1]; a shift widens
 * the even one to f32, a mask the odd one: half the shuffles of transposing the values widened
 * (docs/moe-measurements.md, "NT's pair transpose"). */
W_INLINE void pack_pairs_transposed(float *p, const uint16_t *w, int64_t ldw, int64_t nrows,
                                    int64_t kc)
{
    for (int64_t j0 = 0; j0 < 32; j0 += 16)
        for (int64_t k0 = 0; k0 < kc; k0 += 32) {
            const __mmask32 mk = kt__lanes32(kc - k0);
            __m512 r[16];
            for (int64_t j = 0; j < 16; j++)
                r[j] =
                    j0 + j < nrows
                        ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mk, w + (j0 + j) * ldw + k0))
                        : _mm512_setzero_ps();
            transpose16(r);
            const int64_t kn = kc - k0 < 32 ? kc - k0 : 32;
            for (int64_t s = 0; 2 * s < kn; s++) {
                const __m512i v = _mm512_castps_si512(r[s]);
                _mm512_store_ps(p + (k0 + 2 * s) * 32 + j0, pair_half(v, 0));
                if (2 * s + 1 < kn)
                    _mm512_store_ps(p + (k0 + 2 * s + 1) * 32 + j0, pair_half(v, 1));
            }
        }
}

/* A panel of 32 columns from rows of any source type: p[k][j] = w[j, k] as f32 for j < nrows
 * (zeros up to 32), k < kc; 16 x 16 blocks widened by load16, then transposed. (bf16 has the
 * cheaper pack_pairs_transposed.) */
W_INLINE void pack_widened_transposed(float *p, const void *w, int64_t ldw, int64_t nrows,
                                      int64_t kc, kt__fma_src src)
{
    for (int64_t j0 = 0; j0 < 32; j0 += 16)
        for (int64_t k0 = 0; k0 < kc; k0 += 16) {
            __m512 r[16];
            for (int64_t j = 0; j < 16; j++)
                r[j] = j0 + j < nrows ? load16(elem(w, (j0 + j) * ldw + k0, src), kc - k0, src)
                                      : _mm512_setzero_ps();
            transpose16(r);
            const int64_t kn = kc - k0 < 16 ? kc - k0 : 16;
            for (int64_t s = 0; s < kn; s++)
                _mm512_store_ps(p + (k0 + s) * 32 + j0, r[s]);
        }
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
