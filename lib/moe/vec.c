/* See vec.h. */
#include <string.h>

#include "core/cpu_internal.h"
#include "kt/tensor.h"
#include "moe/vec.h"

/* The 16 lane sums added by a fixed tree: l + l[8..], then halves, then pairs. */
static float fold16(const float l[16])
{
    float s8[8];
    for (int j = 0; j < 8; j++)
        s8[j] = l[j] + l[j + 8];
    for (int j = 0; j < 4; j++)
        s8[j] += s8[j + 4];
    return (s8[0] + s8[2]) + (s8[1] + s8[3]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VEC_AVX512 1
#define VEC_TARGET __attribute__((target("avx512f")))

VEC_TARGET static float dot_avx512(int64_t n, const float *a, const float *b)
{
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i),
                              acc);
    }
    _Alignas(64) float l[16];
    _mm512_store_ps(l, acc);
    return fold16(l);
}

VEC_TARGET static void axpy_avx512(int64_t n, float alpha, const float *x, float *y)
{
    const __m512 va = _mm512_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, k,
                              _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, x + i),
                                              _mm512_maskz_loadu_ps(k, y + i)));
    }
}
#endif

/* The portable order: lane l sums i = 16c + l (fused multiply-add as fmaf would round once;
 * plain a*b+acc here, so the portable and AVX-512 bits may differ in the last place). */
static float dot_plain(int64_t n, const float *a, const float *b)
{
    float l[16] = {0};
    for (int64_t i = 0; i < n; i++)
        l[i & 15] += a[i] * b[i];
    return fold16(l);
}

float kt__vec_dot(int64_t n, const float *a, const float *b)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512())
        return dot_avx512(n, a, b);
#endif
    return dot_plain(n, a, b);
}

void kt__vec_axpy(int64_t n, float alpha, const float *x, float *y)
{
#ifdef VEC_AVX512
    if (kt__cpu_has_avx512()) {
        axpy_avx512(n, alpha, x, y);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        y[i] += alpha * x[i];
}

void kt__vec_load_cdt(float *dst, const void *src, int bf16, int64_t n)
{
    if (bf16)
        kt_bf16_to_f32(dst, src, (size_t)n);
    else
        memcpy(dst, src, (size_t)n * sizeof *dst);
}
