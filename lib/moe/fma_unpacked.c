/* bf16 GEMMs on the FMA units that widen w in registers instead of packing it into panels
 * (see fma_gemm.h): for the middling row counts where the panels cost more than they save.
 *
 * A 64-byte load of a bf16 row holds 32 values as 16 pairs; the even values become f32 by a
 * shift (<< 16), the odd ones by a mask (& 0xffff0000): two integer ops per 32 weights, where
 * the tiles' panels convert, store and load again (and NT's transposes 16 x 16 blocks).
 *
 * NT (kt__fma_nt_dots_bf16): dot products along w's rows. x's rows are split like w's once
 * per chunk (lanes 0-15 the even values of 32, 16-31 the odd ones), so lane j of a sum sees
 * the pairs (32 s + 2 j, 32 s + 2 j + 1) for s = 0, 1, ... in order. Loop order: chunks of
 * the reduction (x's split rows of a chunk stay in L1), then groups of C rows of w, then
 * blocks of up to 8 rows of x against the group. A group is fetched into L2 FETCH_GROUPS
 * groups ahead, so the weights stream in while the blocks compute (without the fetches, 8
 * rows against dsv2lite's gate took 1.0 ms a thread against 0.65 with them).
 *
 * NN (kt__fma_nn_direct_bf16): 32 output columns at a time as two vectors (even and odd
 * columns), each product added in the reduction's order: the FMA tiles' sums, bit for bit.
 * Loop order: chunks of w's rows (g's columns of a chunk as f32 in L1, broadcast from there),
 * then groups of 32 columns, then blocks of up to 12 rows of g; the next chunk's rows of w are
 * fetched into L2 in address order while this one computes. */
#include "moe/fma_gemm.h"
#include "moe/lane_mask.h"

#ifdef KT__FMA_GEMM
#include <immintrin.h>

#define W_TARGET __attribute__((target("avx512f,avx512bw")))
#define W_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw")))

/* Bits of a bf16 pair's odd value in its 32-bit word. */
#define ODD_BITS ((int)0xffff0000u)
/* Rows per pass over w: NT's chunks of the reduction get shorter as rows are added (more sums
 * per chunk), NN's too (g's chunk as f32), so a call of more rows runs as several passes. */
#define PASS_M 32

/* ---- NT ------------------------------------------------------------------------------------ */

#define DOT_R 8        /* rows of x per block at most */
#define DOT_ACC 16     /* sums per block: R x C <= 16, reduced together into one vector */
#define FETCH_GROUPS 2 /* groups of w rows fetched ahead */
/* x's split rows of a chunk: 32 KiB, kept in L1; rows kcp + XP_PAD floats apart (rows
 * exactly 4 KiB apart would share L1 sets and alias each other's addresses in the load unit) */
#define XP_FLOATS (8 * 1024)
#define XP_PAD 16

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

/* ---- NN ------------------------------------------------------------------------------------ */

#define NN_R 12 /* rows of g per block: 24 sums */
/* g's rows of a chunk of the reduction as f32: 16 KiB, in L1 beside the lines of w a block
 * reads, broadcast from there */
#define GF_FLOATS (4 * 1024)
/* w's rows of a chunk at most: this chunk and the next one fetched stay in L2 */
#define W_CHUNK_BYTES (512 * 1024)

/* 32 columns of a row of y (the first of `lanes`) as its 16 even and 16 odd columns. */
W_INLINE void split_row(const float *y, __mmask32 lanes, __m512 *even, __m512 *odd)
{
    const __m512 a = _mm512_maskz_loadu_ps((__mmask16)lanes, y);
    const __m512 b = _mm512_maskz_loadu_ps((__mmask16)(lanes >> 16), y + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
}

/* split_row's inverse: the even and odd columns stored interleaved. */
W_INLINE void join_row(float *y, __mmask32 lanes, __m512 even, __m512 odd)
{
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    _mm512_mask_storeu_ps(y, (__mmask16)lanes, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_mask_storeu_ps(y + 16, (__mmask16)(lanes >> 16), _mm512_permutex2var_ps(even, hi, odd));
}

/* Lines fetched into L2 in address order, one per step: the next chunk's rows of w while this
 * chunk computes (its column groups walk 64-byte pieces of rows kilobytes apart, which the
 * hardware prefetchers do not follow). */
typedef struct line_cursor {
    const char *base;
    int64_t ld_bytes, rows, row_bytes, row, off;
} line_cursor;

W_INLINE void cursor_step(line_cursor *f)
{
    if (f->row >= f->rows)
        return;
    _mm_prefetch(f->base + f->row * f->ld_bytes + f->off, _MM_HINT_T1);
    f->off += 64;
    if (f->off >= f->row_bytes)
        f->off = 0, f->row++;
}

/* y[r, 0:ncols] = (load ? y : 0) + sum over n < nc of gf[r][n] w[n, 0:ncols] for r < R,
 * ncols <= 32, each product added in n's order. fetch: a line of it per step (or NULL). */
W_INLINE void nn_block(const int R, int64_t nc, const float *gf, int64_t ldgf, const uint16_t *w,
                       int64_t ldw, int64_t ncols, float *y, int64_t ldy, int load,
                       line_cursor *fetch)
{
    const __mmask32 lanes = kt__lanes32(ncols);
    const __m512i odd = _mm512_set1_epi32(ODD_BITS);
    __m512 acc[NN_R][2];
    for (int r = 0; r < R; r++) {
        if (load) {
            split_row(y + r * ldy, lanes, &acc[r][0], &acc[r][1]);
        } else {
            acc[r][0] = _mm512_setzero_ps();
            acc[r][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t n = 0; n < nc; n++) {
        const __m512i v = _mm512_maskz_loadu_epi16(lanes, w + n * ldw);
        if (fetch)
            cursor_step(fetch);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
        for (int r = 0; r < R; r++) {
            const __m512 gb = _mm512_set1_ps(gf[r * ldgf + n]);
            acc[r][0] = _mm512_fmadd_ps(gb, we, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(gb, wo, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        join_row(y + r * ldy, lanes, acc[r][0], acc[r][1]);
}

#define NN_CASE(R)                                                                                 \
    case R:                                                                                        \
        nn_block(R, nc, gf, ldgf, w, ldw, ncols, y, ldy, load, fetch);                             \
        break;

W_TARGET static void nn_block_any(int R, int64_t nc, const float *gf, int64_t ldgf,
                                  const uint16_t *w, int64_t ldw, int64_t ncols, float *y,
                                  int64_t ldy, int load, line_cursor *fetch)
{
    switch (R) {
        NN_CASE(1)
        NN_CASE(2)
        NN_CASE(3)
        NN_CASE(4)
        NN_CASE(5)
        NN_CASE(6)
        NN_CASE(7)
        NN_CASE(8)
        NN_CASE(9)
        NN_CASE(10)
        NN_CASE(11)
        NN_CASE(12)
    default:
        break;
    }
}
#undef NN_CASE

/* gf[r][0:nc] = g[r][0:nc] as f32, rows ldgf apart. */
W_TARGET static void widen_rows(float *gf, int64_t ldgf, const uint16_t *g, int64_t ldg,
                                int64_t rows, int64_t nc)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = 0; n < nc; n += 16) {
            const __m256i v = _mm512_castsi512_si256(
                _mm512_maskz_loadu_epi16(kt__lanes16(nc - n), g + r * ldg + n));
            _mm512_storeu_ps(gf + r * ldgf + n,
                             _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
        }
}

/* Rows [0, M) of g (M <= PASS_M). */
W_TARGET static void nn_pass(int64_t M, int64_t N, int64_t k0, int64_t k1,
                             const uint16_t *const gs[2], const uint16_t *const ws[2], int nsrc,
                             int64_t ldg, int64_t ldw, float *y, int64_t ldy, int accumulate,
                             float *gf)
{
    const int64_t blocks = (M + NN_R - 1) / NN_R;
    int64_t ncmax = (GF_FLOATS / M - 16) & ~(int64_t)15;
    const int64_t wrows = W_CHUNK_BYTES / ((k1 - k0) * 2);
    if (ncmax > wrows)
        ncmax = wrows < 16 ? 16 : wrows & ~(int64_t)15;
    int started = accumulate;
    for (int s = 0; s < nsrc; s++)
        for (int64_t n0 = 0; n0 < N; n0 += ncmax) {
            const int64_t nc = N - n0 < ncmax ? N - n0 : ncmax;
            const int64_t ldgf = ((nc + 15) & ~(int64_t)15) + 16;
            widen_rows(gf, ldgf, gs[s] + n0, ldg, M, nc);
            /* the next chunk: this source's next rows, or the next source's first */
            line_cursor next = {NULL, ldw * 2, 0, (k1 - k0) * 2, 0, 0};
            if (n0 + nc < N)
                next.base = (const char *)(ws[s] + (n0 + nc) * ldw + k0),
                next.rows = N - n0 - nc < ncmax ? N - n0 - nc : ncmax;
            else if (s + 1 < nsrc)
                next.base = (const char *)(ws[s + 1] + k0), next.rows = N < ncmax ? N : ncmax;
            for (int64_t c = k0; c < k1; c += 32)
                for (int64_t b = 0; b < blocks; b++) {
                    const int64_t r0 = b * (M / blocks) + (b < M % blocks ? b : M % blocks);
                    const int R = (int)(M / blocks + (b < M % blocks));
                    nn_block_any(R, nc, gf + r0 * ldgf, ldgf, ws[s] + n0 * ldw + c, ldw,
                                 k1 - c < 32 ? k1 - c : 32, y + r0 * ldy + c, ldy, started,
                                 b == 0 ? &next : NULL);
                }
            started = 1;
        }
}

W_TARGET void kt__fma_nn_direct_bf16(int64_t M, int64_t N, int64_t k0, int64_t k1,
                                     const uint16_t *g0, const uint16_t *w0, const uint16_t *g1,
                                     const uint16_t *w1, int64_t ldg, int64_t ldw, float *y,
                                     int64_t ldy, int accumulate)
{
    if (M <= 0 || k1 <= k0)
        return;
    if (N <= 0) {
        if (!accumulate)
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = k0; k < k1; k++)
                    y[m * ldy + k] = 0.0f;
        return;
    }
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ and DAZ, as the other bf16 kernels run */
    float gf[GF_FLOATS] __attribute__((aligned(64)));
    const uint16_t *ws[2] = {w0, w1};
    for (int64_t m0 = 0; m0 < M; m0 += PASS_M) {
        const uint16_t *gs[2] = {g0 + m0 * ldg, g1 != NULL ? g1 + m0 * ldg : NULL};
        nn_pass(M - m0 < PASS_M ? M - m0 : PASS_M, N, k0, k1, gs, ws, g1 != NULL ? 2 : 1, ldg, ldw,
                y + m0 * ldy, ldy, accumulate, gf);
    }
    _mm_setcsr(csr);
}

#endif
