/* f32 <-> bf16 and f32 <-> f16 conversion, round-to-nearest-even.
 *
 * The vector paths use integer arithmetic (bf16) and F16C/AVX-512F conversions (f16) that
 * give exactly the scalar bits, denormals and NaNs included: vcvtneps2bf16 is avoided on
 * purpose because it flushes denormals, which would make the result depend on the CPU.
 */
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "kt/runtime.h"
#include "kt/tensor.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KT__X86 1
#endif

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t kt_f32_to_bf16_1(float x)
{
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u); /* quiet the NaN, keep sign and payload */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float kt_bf16_to_f32_1(uint16_t x) { return bits_f32((uint32_t)x << 16); }

uint16_t kt_f32_to_f16_1(float x)
{
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    if (u >= 0x477ff000u) /* 65520 and above round to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (u < 0x38800000u) {
        /* Subnormal (or zero) half: adding 0.5 puts the value's 2^-24 units in the low
         * mantissa bits of a float whose ulp is exactly 2^-24, rounded to nearest even. */
        float f = bits_f32(u) + 0.5f;
        return (uint16_t)(sign | (f32_bits(f) - 0x3f000000u));
    }
    uint32_t odd = (u >> 13) & 1u;
    u += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
    return (uint16_t)(sign | (u >> 13));
}

float kt_f16_to_f32_1(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;
    if (exp == 0x1f) /* a NaN comes out quiet, as F16C's vcvtph2ps makes it */
        return bits_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float f = (float)mant * (1.0f / 16777216.0f);
        return bits_f32(sign | f32_bits(f));
    }
    return bits_f32(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

#ifdef KT__X86
__attribute__((target("avx512f,avx512bw"))) static size_t
f32_to_bf16_avx512(uint16_t *dst, const float *src, size_t n)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i bias = _mm512_set1_epi32(0x7fff);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i quiet = _mm512_set1_epi32(0x0040);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_loadu_si512((const void *)(src + i));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
        __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), quiet);
        r = _mm512_mask_mov_epi32(r, nan, q);
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(r));
    }
    return i;
}

__attribute__((target("avx512f"))) static size_t
bf16_to_f32_avx512(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        _mm512_storeu_si512((void *)(dst + i), u);
    }
    return i;
}

__attribute__((target("avx2,f16c"))) static size_t
f32_to_f16_f16c(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + i), h);
    }
    return i;
}

__attribute__((target("avx2,f16c"))) static size_t
f16_to_f32_f16c(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    return i;
}
#endif

void kt_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
#ifdef KT__X86
    if (kt__cpu_has_avx512())
        i = f32_to_bf16_avx512(dst, src, n);
#endif
    for (; i < n; i++)
        dst[i] = kt_f32_to_bf16_1(src[i]);
}

void kt_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
#ifdef KT__X86
    if (kt__cpu_has_avx512())
        i = bf16_to_f32_avx512(dst, src, n);
#endif
    for (; i < n; i++)
        dst[i] = kt_bf16_to_f32_1(src[i]);
}

void kt_f32_to_f16(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
#ifdef KT__X86
    if (kt__cpu_has_f16c())
        i = f32_to_f16_f16c(dst, src, n);
#endif
    for (; i < n; i++)
        dst[i] = kt_f32_to_f16_1(src[i]);
}

void kt_f16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
#ifdef KT__X86
    if (kt__cpu_has_f16c())
        i = f16_to_f32_f16c(dst, src, n);
#endif
    for (; i < n; i++)
        dst[i] = kt_f16_to_f32_1(src[i]);
}
