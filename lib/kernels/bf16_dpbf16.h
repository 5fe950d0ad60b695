/* Shared pieces of the AVX-512 BF16 (vdpbf16ps) kernels: the target attributes, the
 * multiply-add and the fixed reduction trees, the tile heights, and the kernels' entry points
 * (bf16_nt_dpbf16.c, bf16_nn_dpbf16.c, bf16_tn_dpbf16.c; the registry, kernels/registry.c, calls them).
 * Their contracts are bf16_gemm.h's. */
#ifndef KT_KERNELS_BF16_DPBF16_H
#define KT_KERNELS_BF16_DPBF16_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KT__DPBF16_COMPILED 1
#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF_INLINE                                                                                  \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

BF_INLINE __m512 dp(__m512 acc, __m512i a, __m512i b)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Steps of reduce16, each applied alike to every input: the 256-bit halves of a and b
 * added (a's sums in the low half), the pairs of 128-bit lanes, then the 32-bit lanes. */
BF_INLINE __m512 red_l1(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

BF_INLINE __m512 red_l2(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

BF_INLINE __m512 red_l3(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* Lane o of the result = the sum of the 16 lanes of input o, by the same tree for every o:
 * lanes l and l+8 first, then the two halves of each group of 8, then of 4, then of 2.
 * (Passed as values, not an array, so that nothing is kept in memory.) */
BF_INLINE __m512 reduce16(__m512 i0, __m512 i1, __m512 i2, __m512 i3, __m512 i4, __m512 i5,
                          __m512 i6, __m512 i7, __m512 i8, __m512 i9, __m512 i10, __m512 i11,
                          __m512 i12, __m512 i13, __m512 i14, __m512 i15)
{
    const __m512 t0 = red_l1(i0, i4), t1 = red_l1(i8, i12), t2 = red_l1(i2, i6),
                 t3 = red_l1(i10, i14), t4 = red_l1(i1, i5), t5 = red_l1(i9, i13),
                 t6 = red_l1(i3, i7), t7 = red_l1(i11, i15);
    const __m512 u0 = red_l2(t0, t1), u1 = red_l2(t2, t3), u2 = red_l2(t4, t5), u3 = red_l2(t6, t7);
    return red_l3(red_l3(u0, u1), red_l3(u2, u3));
}

/* The same tree for 8 inputs: the sum of input o's lanes in lane o of the result (o < 8; the
 * lanes above hold copies). */
BF_INLINE __m512 reduce8(__m512 i0, __m512 i1, __m512 i2, __m512 i3, __m512 i4, __m512 i5,
                         __m512 i6, __m512 i7)
{
    const __m512 t0 = red_l1(i0, i4), t1 = red_l1(i1, i5), t2 = red_l1(i2, i6), t3 = red_l1(i3, i7);
    /* [i0, i4, i2, i6] and [i1, i5, i3, i7], then in each 128-bit lane the two inputs' pairs
     * of sums: lanes (i0, i1), (i4, i5), (i2, i3), (i6, i7), each total added last */
    const __m512 v = red_l3(red_l2(t0, t2), red_l2(t1, t3));
    const __m512 s = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    return _mm512_permutexvar_ps(
        _mm512_set_epi32(13, 12, 5, 4, 9, 8, 1, 0, 13, 12, 5, 4, 9, 8, 1, 0), s);
}

#endif

/* Tile t of `rows` rows cut into as many tiles as tiles of at most `max` rows need, their
 * heights as equal as possible (a short tile loads its operands for few products). Heights
 * never change an element's operations, so the bits are those of any other tiling. */
static inline int balanced_height(int64_t rows, int64_t max, int64_t t)
{
    const int64_t tiles = (rows + max - 1) / max;
    return (int)(rows / tiles + (t < rows % tiles));
}

#ifdef KT__DPBF16_COMPILED
/* The entry points: bf16_gemm.h's nt_next, nn, nn2 and tn on vdpbf16ps (the caller checked
 * the CPU; M >= 1 for nt, nn and nn2). */
void kt__bf16_nt_dpbf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                        int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                        float *y, int64_t ldy, int accumulate);
void kt__bf16_nn_dpbf16(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,
                        int64_t ldg, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                        int accumulate);
void kt__bf16_nn2_dpbf16(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                         const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                         int64_t ldw, float *y, int64_t ldy, int stream);
void kt__bf16_tn_dpbf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                        int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                        float scale, int accumulate, void *work);
/* The work buffer the vdpbf16ps TN wants at M rows (0 up to its stack rows). */
size_t kt__bf16_tn_dpbf16_work_bytes(int64_t M);
#endif

#endif
