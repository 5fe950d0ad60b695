/* The AVX2 dequantisation of the quantized panels (quant_avx2.h), for CPUs without AVX-512
 * BF16: the same bf16 values as kt__q_dequant_bf16.
 *
 * INT4: a scale's 16 values are split into their low and high bytes, two vpshufb tables;
 * 32 nibbles look both up and the bytes interleave into 32 bf16 (vpunpck works within 128-bit
 * lanes, so the nibbles are permuted once before). INT8: 8 values converted and
 * scaled in f32, then rounded to bf16 to nearest even by integer steps (AVX2 has no
 * vcvtneps2bf16): add 0x7fff plus the lowest kept bit, keep the high half. The products are
 * finite, so no NaN case arises. */
#include "lib/kernels/quant_avx2.h"

#include "kt/tensor.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define QV_TARGET __attribute__((target("avx2,fma,f16c")))

/* The low and the high bytes of a scale's 16 values bf16((nibble - 8) * scale), each table
 * twice (one per 128-bit lane). */
QV_TARGET static void int4_tables(uint16_t scale, __m256i *lo_bytes, __m256i *hi_bytes)
{
    uint8_t lo[16], hi[16];
    const float s = kt_bf16_to_f32_1(scale);
    for (int q = 0; q < 16; q++) {
        const uint16_t v = kt_f32_to_bf16_1((float)(q - 8) * s);
        lo[q] = (uint8_t)(v & 0xff), hi[q] = (uint8_t)(v >> 8);
    }
    *lo_bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lo));
    *hi_bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hi));
}

/* 32 nibble indices (bytes 0-15 in [0, 16), one input each, in input order) into 32 bf16. */
QV_TARGET static void int4_lookup(__m256i idx, __m256i lo_t, __m256i hi_t, uint16_t *out)
{
    /* inputs 0-7 and 16-23 in lane 0, 8-15 and 24-31 in lane 1: each lane's unpacklo then
     * gives inputs 0-7 and 8-15 (a: 0-15 in order), its unpackhi 16-23 and 24-31 */
    idx = _mm256_permute4x64_epi64(idx, 0xd8);
    const __m256i lo = _mm256_shuffle_epi8(lo_t, idx), hi = _mm256_shuffle_epi8(hi_t, idx);
    _mm256_storeu_si256((__m256i *)out, _mm256_unpacklo_epi8(lo, hi));
    _mm256_storeu_si256((__m256i *)(out + 16), _mm256_unpackhi_epi8(lo, hi));
}

/* 8 f32 rounded to bf16 (nearest even), as 8 halves in the low 128 bits. */
QV_TARGET static __m128i to_bf16(__m256 v)
{
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

QV_TARGET void kt__q_dequant_avx2(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0,
                                  int64_t c1, uint16_t *out, int64_t ldo)
{
    const int64_t groups = w->cols / w->group;
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *o = out + (r - r0) * ldo - c0;
        int64_t c = c0;
        if (w->fmt == KT__Q_INT4) {
            const uint8_t *row = w->q + r * (w->cols / 2);
            for (; c < c1 && c % 32 != 0; c++) /* an unaligned head: one value at a time */
                o[c] = kt_f32_to_bf16_1(kt__q_value(w, r, c));
            int64_t group = -1;
            __m256i lo_t = _mm256_setzero_si256(), hi_t = lo_t;
            for (; c + 32 <= c1; c += 32) { /* half a block: 32 bytes' low or high nibbles */
                if (c / w->group != group) {
                    group = c / w->group;
                    int4_tables(w->scale[r * groups + group], &lo_t, &hi_t);
                }
                const __m256i b =
                    _mm256_loadu_si256((const __m256i *)(row + c / KT__Q4_BLOCK * 32));
                const __m256i nib =
                    _mm256_and_si256(c % KT__Q4_BLOCK < 32 ? b : _mm256_srli_epi16(b, 4),
                                     _mm256_set1_epi8(15));
                int4_lookup(nib, lo_t, hi_t, o + c);
            }
        } else {
            const __m256 s = _mm256_set1_ps(kt_bf16_to_f32_1(w->scale[r]));
            const uint8_t *row = w->q + r * w->cols;
            for (; c + 8 <= c1; c += 8) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c)));
                _mm_storeu_si128((__m128i *)(o + c), to_bf16(_mm256_mul_ps(_mm256_cvtepi32_ps(q), s)));
            }
        }
        for (; c < c1; c++) /* the tail */
            o[c] = kt_f32_to_bf16_1(kt__q_value(w, r, c));
    }
}

#else

void kt__q_dequant_avx2(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        uint16_t *out, int64_t ldo)
{
    kt__q_dequant_bf16(w, r0, r1, c0, c1, out, ldo);
}

#endif
