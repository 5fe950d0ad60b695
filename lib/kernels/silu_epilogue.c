/* The MoE layer's SiLU epilogues (silu_epilogue.h): elementwise steps fused with the
 * conversions to the compute dtype, vectorised on AVX-512 BF16 (its vcvtneps2bf16) where the
 * GEMMs are, scalar elsewhere. They live with the kernels because they share the kernels'
 * target, conversions and reduction tree (reduce8, bf16_dpbf16.h) and are chosen with them. */
#include <math.h>
#include <stdint.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/bf16_dpbf16.h"
#include "lib/kernels/lane_mask.h"
#include "lib/kernels/silu_epilogue.h"
#include "kt/tensor.h"

#ifdef KT__DPBF16_COMPILED

/* f32 -> bf16 by the instruction (vcvtneps2bf16): kt_f32_to_bf16_1's bits (round to nearest
 * even, NaN quieted), except that f32 denormals (below 2^-126) become zeros of their sign,
 * as the vdpbf16ps that reads them would take them anyway (checked on 20M random patterns:
 * no other difference). The integer sequence it replaces took a third of the SiLU derivative's
 * time. */
BF_INLINE __m256i cvt_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* Stores 16 (or the masked first of them) values in the compute dtype. */
BF_INLINE void st_cdt(void *p, int64_t i, __m512 v, int bf16, __mmask16 km)
{
    if (bf16)
        _mm512_mask_storeu_epi16((uint16_t *)p + i, (__mmask32)km,
                                 _mm512_castsi256_si512(cvt_bf16(v)));
    else
        _mm512_mask_storeu_ps((float *)p + i, km, v);
}

/* exp(x): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (error
 * below 1e-8 relative there), times 2^n by scalef, which gives inf / 0 past the float range
 * without any clamping (a clamp by min/max would turn NaN into a number). */
BF_INLINE __m512 exp_ps(__m512 x)
{
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* sigmoid(g) = 1 / (1 + exp(-g)) */
BF_INLINE __m512 sigmoid_ps(__m512 g)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

BF_TARGET static void act_fwd_avx512(int64_t n, const float *g, const float *u, void *ac, int bf16)
{
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 km = kt__lanes16(n - i);
        const __m512 gv = _mm512_maskz_loadu_ps(km, g + i), uv = _mm512_maskz_loadu_ps(km, u + i);
        st_cdt(ac, i, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid_ps(gv)), uv), bf16, km);
    }
}

/* ac as act_fwd stores it (rounded to bf16 when bf16), back in f32 */
BF_INLINE __m512 cdt_round(__m512 v, int bf16)
{
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16(v)), 16))
                : v;
}

/* The SiLU derivative of 16 values (the masked first of them) from i on, stored; returns the
 * terms of their routing gradient piece, gap * ac (ac as act_fwd stores it) */
BF_INLINE __m512 act_bwd16(int64_t i, __mmask16 km, const float *g, const float *u,
                           const float *gap, __m512 wv, void *ggc, void *guc, void *ac_out,
                           int bf16)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 gv = _mm512_maskz_loadu_ps(km, g + i), uv = _mm512_maskz_loadu_ps(km, u + i);
    const __m512 pv = _mm512_maskz_loadu_ps(km, gap + i), sig = sigmoid_ps(gv);
    const __m512 av = _mm512_mul_ps(wv, pv), silu = _mm512_mul_ps(gv, sig);
    const __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sig), one));
    st_cdt(ggc, i, _mm512_mul_ps(_mm512_mul_ps(av, uv), dsilu), bf16, km);
    st_cdt(guc, i, _mm512_mul_ps(av, silu), bf16, km);
    const __m512 acv = _mm512_mul_ps(silu, uv);
    if (ac_out != NULL)
        st_cdt(ac_out, i, acv, bf16, km);
    return _mm512_maskz_mul_ps(km, pv, cdt_round(acv, bf16));
}

/* Each 16 values' routing gradient piece is the sum of its 16 terms by reduce16's tree, the
 * tree _mm512_reduce_add_ps has: 8 pieces at a time by reduce8 (a third of the operations of
 * 8 reductions, which took about a third of this loop's time). */
BF_TARGET static void act_bwd_avx512(int64_t n, const float *g, const float *u, const float *gap,
                                     float w, void *ggc, void *guc, void *ac_out, float *part,
                                     int bf16)
{
    const __m512 wv = _mm512_set1_ps(w);
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
#define ACT_BWD_FULL(q) act_bwd16(i + 16 * (q), 0xffff, g, u, gap, wv, ggc, guc, ac_out, bf16)
        const __m512 p0 = ACT_BWD_FULL(0), p1 = ACT_BWD_FULL(1), p2 = ACT_BWD_FULL(2),
                     p3 = ACT_BWD_FULL(3), p4 = ACT_BWD_FULL(4), p5 = ACT_BWD_FULL(5),
                     p6 = ACT_BWD_FULL(6), p7 = ACT_BWD_FULL(7);
#undef ACT_BWD_FULL
        _mm512_mask_storeu_ps(part + i / 16, 0xff, reduce8(p0, p1, p2, p3, p4, p5, p6, p7));
    }
    for (; i < n; i += 16) {
        const __mmask16 km = kt__lanes16(n - i);
        part[i / 16] =
            _mm512_reduce_add_ps(act_bwd16(i, km, g, u, gap, wv, ggc, guc, ac_out, bf16));
    }
}

/* dst = s * src in the compute dtype. bf16 rows from a cache line on are stored past the
 * caches a line at a time (the backward's per-slot copies of grad_y: tens of megabytes, read
 * next by a later phase; a plain store would first read every line in). */
BF_TARGET static void scale_store_avx512(int64_t n, const float *src, float s, void *dst, int bf16)
{
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    if (bf16 && ((uintptr_t)dst & 63) == 0 && n >= 32) {
        for (; i + 32 <= n; i += 32) {
            const __m512 lo = _mm512_mul_ps(vs, _mm512_loadu_ps(src + i));
            const __m512 hi = _mm512_mul_ps(vs, _mm512_loadu_ps(src + i + 16));
            _mm512_stream_si512(
                (void *)((uint16_t *)dst + i),
                _mm512_inserti64x4(_mm512_castsi256_si512(cvt_bf16(lo)), cvt_bf16(hi), 1));
        }
        _mm_sfence(); /* visible to whichever thread reads them next */
    }
    for (; i < n; i += 16) {
        const __mmask16 km = kt__lanes16(n - i);
        st_cdt(dst, i, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(km, src + i)), bf16, km);
    }
}

static int use_avx512(void) { return kt__cpu_has_avx512() && kt__cpu_has_avx512_bf16(); }
#endif

static float silu_sig(float g) { return 1.0f / (1.0f + expf(-g)); }

static void st1(void *p, int bf16, int64_t i, float v)
{
    if (bf16)
        ((uint16_t *)p)[i] = kt_f32_to_bf16_1(v);
    else
        ((float *)p)[i] = v;
}

void kt__moe_act_fwd(int64_t n, const float *g, const float *u, void *ac, int bf16)
{
#ifdef KT__DPBF16_COMPILED
    if (use_avx512()) {
        act_fwd_avx512(n, g, u, ac, bf16);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        st1(ac, bf16, i, g[i] * silu_sig(g[i]) * u[i]);
}

void kt__moe_act_bwd(int64_t n, const float *g, const float *u, const float *gap, float w,
                     void *ggc, void *guc, void *ac_out, float *part, int bf16)
{
#ifdef KT__DPBF16_COMPILED
    if (use_avx512()) {
        act_bwd_avx512(n, g, u, gap, w, ggc, guc, ac_out, part, bf16);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        const float sig = silu_sig(g[i]), ga = w * gap[i];
        st1(ggc, bf16, i, ga * u[i] * (sig * (1.0f + g[i] * (1.0f - sig))));
        st1(guc, bf16, i, ga * (g[i] * sig));
        float ac = g[i] * sig * u[i]; /* as act_fwd stores it */
        if (ac_out != NULL)
            st1(ac_out, bf16, i, ac);
        if (bf16)
            ac = kt_bf16_to_f32_1(kt_f32_to_bf16_1(ac));
        if (i % 16 == 0)
            part[i / 16] = 0.0f;
        part[i / 16] += gap[i] * ac;
    }
}

void kt__moe_scale_store(int64_t n, const float *src, float s, void *dst, int bf16)
{
#ifdef KT__DPBF16_COMPILED
    if (use_avx512()) {
        scale_store_avx512(n, src, s, dst, bf16);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        st1(dst, bf16, i, s * src[i]);
}
