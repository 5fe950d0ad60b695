/* What avx2_gemm.c, avx2_dots.c and attn_block_avx2.c share: loading 8 values of any operand type as f32 (bf16
 * and f16 widened exactly), the lane masks of 256-bit vectors, an 8 x 8 register transpose and the
 * floating-point mode.
 * Only for builds with the AVX2 kernels (KT__AVX2_GEMM). */
#ifndef KT_KERNELS_AVX2_UTIL_H
#define KT_KERNELS_AVX2_UTIL_H

#include <stdint.h>
#include <string.h>

#include "lib/kernels/avx2_gemm.h"

#ifdef KT__AVX2_GEMM
#include <immintrin.h>

#define V_TARGET __attribute__((target("avx2,fma,f16c")))
#define V_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

static inline int64_t v_bytes_of(int64_t n, kt__fma_src src)
{
    return n * (src == KT__FMA_F32 ? 4 : 2);
}

static inline const char *v_elem(const void *base, int64_t i, kt__fma_src src)
{
    return (const char *)base + v_bytes_of(i, src);
}

/* the first n lanes of a ymm (all from 8 on, none at 0 or below), for maskload / maskstore */
V_INLINE __m256i v_lanes8(int64_t n)
{
    static const int32_t tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_loadu_si256((const __m256i *)(tab + 8 - n));
}

/* 8 x 8 transpose in registers: r[i] lane j -> r[j] lane i */
V_INLINE void transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

/* 8 halves widened: bf16 by a shift into the high half, f16 by vcvtph2ps */
V_INLINE __m256 v_widen8(__m128i v, kt__fma_src src)
{
    if (src == KT__FMA_F16)
        return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* 8 values from p as f32: the first n (the rest zeros); nothing past the n-th is read. */
V_INLINE __m256 v_load8(const void *p, int64_t n, kt__fma_src src)
{
    if (n >= 8)
        return src == KT__FMA_F32 ? _mm256_loadu_ps((const float *)p)
                                  : v_widen8(_mm_loadu_si128((const __m128i *)p), src);
    if (n <= 0)
        return _mm256_setzero_ps();
    if (src == KT__FMA_F32)
        return _mm256_maskload_ps((const float *)p, v_lanes8(n));
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)n * 2);
    return v_widen8(_mm_loadu_si128((const __m128i *)t), src);
}

/* FTZ and DAZ on where both operands are bf16 (as the AVX-512 kernels: denormal operands
 * would cost microcode assists); the old mode returned for _mm_setcsr. */
V_INLINE unsigned v_flush_denormals(int both_bf16)
{
    const unsigned old = _mm_getcsr();
    if (both_bf16)
        _mm_setcsr(old | 0x8040);
    return old;
}

#endif
#endif
