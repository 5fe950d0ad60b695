/* x w^T for bf16 x and w as dot products along the reduction (see fma_gemm.h,
 * kt__fma_nt_dots_bf16): no transposed panel; each weight row is read from memory once per
 * call and used at once by every row of x.
 *
 * A 64-byte load of a bf16 row holds 32 values as 16 pairs; the even values become f32 by a
 * shift (<< 16), the odd ones by a mask (& 0xffff0000): two integer ops per 32 weights, where
 * the tiles' panel transposes 16 x 16 blocks and stores it. x's rows are split the same way
 * once per chunk (lanes 0-15 the even values of 32, 16-31 the odd ones), so lane j of a sum
 * sees the pairs (32 s + 2 j, 32 s + 2 j + 1) for s = 0, 1, ... in order.
 *
 * Loop order: chunks of the reduction (x's split rows of a chunk stay in L1), then groups of C
 * rows of w, then blocks of up to 8 rows of x against the group. A group is fetched into L2
 * FETCH_GROUPS groups ahead, so the weights stream in while the blocks compute (without the
 * fetches, 8 rows against dsv2lite's gate took 1.0 ms a thread against 0.65 with them). */
#include "moe/fma_gemm.h"
#include "moe/lane_mask.h"

#ifdef KT__FMA_GEMM
#include <immintrin.h>

#define W_TARGET __attribute__((target("avx512f,avx512bw")))
#define W_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw")))

#define DOT_R 8        /* rows of x per block at most */
#define DOT_ACC 16     /* sums per block: R x C <= 16, reduced together into one vector */
#define FETCH_GROUPS 2 /* groups of w rows fetched ahead */
/* x's split rows of a chunk: 32 KiB, kept in L1; rows kcp + XP_PAD floats apart (rows
 * exactly 4 KiB apart would share L1 sets and alias each other's addresses in the load unit) */
#define XP_FLOATS (8 * 1024)
#define XP_PAD 16
/* Rows of x per pass over w: the chunks of the reduction get shorter as rows are added (more
 * sums per chunk), so a call of more rows runs as several passes. */
#define PASS_M 32

/* Bits of a bf16 pair's odd value in its 32-bit word. */
#define ODD_BITS ((int)0xffff0000u)

/* xp[r][0:kcp] = x[r][0:kc] split by pairs per 32 values, zeros past kc (kcp: kc rounded up
 * to 32); rows ldxp apart. */
W_TARGET static void pack_split(float *xp, int64_t ldxp, const uint16_t *x, int64_t ldx, int rows,
                                int64_t kc)
{
    const __m512i odd = _mm512_set1_epi32(ODD_BITS);
    for (int r = 0; r < rows; r++)
        for (int64_t k = 0; k < kc; k += 32) {
            const __m512i v = _mm512_maskz_loadu_epi16(kt__lanes32(kc - k), x + r * ldx + k);
            _mm512_store_ps(xp + r * ldxp + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_store_ps(xp + r * ldxp + k + 16, _mm512_castsi512_ps(_mm512_and_si512(v, odd)));
        }
}

/* Lane i of the result: the sum of a[i]'s 16 lanes, in a fixed tree. 45 shuffles and adds for
 * 16 sums, where one _mm512_reduce_add_ps each takes 8. */
W_INLINE __m512 reduce16(const __m512 a[DOT_ACC])
{
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane q: the q-th quarter sums of 4 inputs */
        const __m512d p = _mm512_castps_pd(s[2 * i]), q = _mm512_castps_pd(s[2 * i + 1]);
        t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
    }
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                         _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
}

/* One step of 32 values: acc[r * C + c] += x's split rows (xs) times w's C rows (wc[c] at value
 * k, the first `lanes` of 32 read). */
W_INLINE void dots_step(const int R, const int C, __m512 acc[DOT_ACC], const float *xs,
                        int64_t ldxp, const uint16_t *const wc[4], int64_t k, __mmask32 lanes,
                        int64_t fetch)
{
    if (fetch) /* a later group's rows (fetch values on) at k, into L2 */
        for (int c = 0; c < C; c++)
            _mm_prefetch((const char *)(wc[c] + fetch + k), _MM_HINT_T1);
    const __m512i odd = _mm512_set1_epi32(ODD_BITS);
    for (int h = 0; h < 2; h++) {
        __m512 wv[4];
        for (int c = 0; c < C; c++) {
            const __m512i v = _mm512_maskz_loadu_epi16(lanes, wc[c] + k);
            wv[c] = _mm512_castsi512_ps(h ? _mm512_and_si512(v, odd) : _mm512_slli_epi32(v, 16));
        }
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_load_ps(xs + r * ldxp + 16 * h);
            for (int c = 0; c < C; c++)
                acc[r * C + c] = _mm512_fmadd_ps(xv, wv[c], acc[r * C + c]);
        }
    }
}

/* y[r, c] (+)= sum over the chunk of xp[r] . w[c] for r < R, c < nw <= C. Rows of w past nw
 * read row 0 again (their sums are dropped). */
W_INLINE void dots_block(const int R, const int C, int64_t nw, int64_t kc, const float *xp,
                         int64_t ldxp, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                         int add, int64_t fetch)
{
    __m512 acc[DOT_ACC];
    const uint16_t *wc[4];
    for (int c = 0; c < C; c++)
        wc[c] = w + (c < nw ? c : 0) * ldw;
    for (int i = 0; i < DOT_ACC; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32)
        dots_step(R, C, acc, xp + k, ldxp, wc, k, 0xffffffffu, fetch);
    if (k < kc)
        dots_step(R, C, acc, xp + k, ldxp, wc, k, kt__lanes32(kc - k), fetch);
    float sums[DOT_ACC];
    _mm512_storeu_ps(sums, reduce16(acc));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nw; c++)
            y[r * ldy + c] = add ? y[r * ldy + c] + sums[r * C + c] : sums[r * C + c];
}

/* Rows of w per block: R x C sums at most 16, so that they, C weight vectors and one row of x
 * stay in registers (with R = 8 and C = 3 GCC ran out and read x from L1 for every FMA). Two
 * integer ops per weight vector against 2 R FMAs: the more rows the better. */
static int cols_for(int64_t rmax) { return rmax <= 4 ? 4 : rmax == 5 ? 3 : 2; }

#define BLOCK_CASE(R, C)                                                                           \
    case R * 8 + C:                                                                                \
        dots_block(R, C, nw, kc, xp, ldxp, w, ldw, y, ldy, add, fetch);                            \
        break;

W_TARGET static void block_any(int R, int C, int64_t nw, int64_t kc, const float *xp, int64_t ldxp,
                               const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int add,
                               int64_t fetch)
{
    switch (R * 8 + C) {
        BLOCK_CASE(1, 4)
        BLOCK_CASE(2, 4)
        BLOCK_CASE(3, 4)
        BLOCK_CASE(4, 4)
        BLOCK_CASE(4, 3)
        BLOCK_CASE(5, 3)
        BLOCK_CASE(5, 2)
        BLOCK_CASE(6, 2)
        BLOCK_CASE(7, 2)
        BLOCK_CASE(8, 2)
    default:
        break;
    }
}
#undef BLOCK_CASE

/* Rows [0, M) of x (M <= PASS_M) against w's rows [n0, n1). */
W_TARGET static void dots_pass(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                               int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                               int accumulate, float *xp)
{
    const int64_t blocks = (M + DOT_R - 1) / DOT_R;
    const int C = cols_for((M + blocks - 1) / blocks);
    /* chunks of the reduction: as few as fit xp, of equal whole steps of 32; a function of M and
     * K only, so every block split of n sums alike */
    const int64_t kfit = (XP_FLOATS / M - XP_PAD) & ~(int64_t)31;
    const int64_t nchunk = (K + kfit - 1) / kfit;
    const int64_t kstep = ((K + nchunk - 1) / nchunk + 31) & ~(int64_t)31;
    for (int64_t k0 = 0; k0 < K; k0 += kstep) {
        const int64_t kc = K - k0 < kstep ? K - k0 : kstep;
        const int64_t ldxp = ((kc + 31) & ~(int64_t)31) + XP_PAD;
        pack_split(xp, ldxp, x + k0, ldx, (int)M, kc);
        for (int64_t n = n0; n < n1; n += C) {
            const int64_t nw = n1 - n < C ? n1 - n : C;
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t r0 = b * (M / blocks) + (b < M % blocks ? b : M % blocks);
                const int R = (int)(M / blocks + (b < M % blocks));
                block_any(R, C, nw, kc, xp + r0 * ldxp, ldxp, w + n * ldw + k0, ldw,
                          y + r0 * ldy + n, ldy, accumulate || k0 > 0,
                          b == 0 ? FETCH_GROUPS * C * ldw : 0);
            }
        }
    }
}

W_TARGET void kt__fma_nt_dots_bf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                                   int64_t ldx, const uint16_t *w, int64_t ldw, float *y,
                                   int64_t ldy, int accumulate)
{
    if (M <= 0 || n1 <= n0)
        return;
    if (K <= 0) {
        if (!accumulate)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < n1; n++)
                    y[m * ldy + n] = 0.0f;
        return;
    }
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ and DAZ, as the other bf16 kernels run */
    float xp[XP_FLOATS] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += PASS_M)
        dots_pass(M - m0 < PASS_M ? M - m0 : PASS_M, n0, n1, K, x + m0 * ldx, ldx, w, ldw,
                  y + m0 * ldy, ldy, accumulate, xp);
    _mm_setcsr(csr);
}

#endif
