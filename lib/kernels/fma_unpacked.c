/* GEMMs on the FMA units that read w in place instead of packing it into panels (see
 * fma_gemm.h): for the middling row counts where the panels cost more than they save.
 *
 * Every step takes 32 values of a row of w as two f32 vectors, its "halves". bf16: one 64-byte
 * load holds 16 pairs; the even values become f32 by a shift (<< 16), the odd ones by a mask
 * (& 0xffff0000), two integer ops per 32 weights where the tiles' panels convert, store and
 * load again (and NT's transposes 16 x 16 blocks). f32: two loads, values 0-15 and 16-31.
 *
 * NT (kt__fma_nt_dots): dot products along w's rows. x's rows are split like w's once
 * per chunk, so the lanes pair up: for bf16 lane j of a sum sees the values 32 s + 2 j and
 * 32 s + 2 j + 1 for s = 0, 1, ... in order, for f32 32 s + j and 32 s + 16 + j. Loop order: chunks
 * of the reduction (x's split rows of a chunk stay in L1), then groups of C rows of w, then blocks
 * of up to 8 rows of x against the group. A group is fetched into L2 FETCH_GROUPS groups ahead, so
 * the weights stream in while the blocks compute (without the fetches, far slower).
 *
 * NN (kt__fma_nn_direct): 32 output columns at a time as w's two halves, each product added in the
 * reduction's order: the FMA tiles' sums, bit for bit. Loop order: chunks of w's rows (g's columns
 * of a chunk as f32 in L1, broadcast from there), then groups of 32 columns, then blocks of up to
 * 12 rows of g; the next chunk's rows of w are fetched into L2 in address order while this one
 * computes. */
#include <string.h>

#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/fma_util.h"
#include "lib/kernels/lane_mask.h"
#include "lib/kernels/prefetch.h"

#ifdef KT__FMA_GEMM

/* Rows per pass over w: NT's chunks of the reduction get shorter as rows are added (more sums
 * per chunk), NN's too (g's chunk as f32), so a call of more rows runs as several passes. */
#define PASS_M 32

/* Half h of the 32 values at p (the first of `lanes`; zeros past them): bf16 one load, its
 * even values (h = 0) or its odd ones; f32 values 16 h to 16 h + 15. */
W_INLINE __m512 load_half(const kt__fma_src src, const char *p, __mmask32 lanes, const int h)
{
    if (src == KT__FMA_F32)
        return _mm512_maskz_loadu_ps((__mmask16)(h ? lanes >> 16 : lanes), p + 64 * h);
    return pair_half(_mm512_maskz_loadu_epi16(lanes, p), h);
}

/* Both halves (bf16: the two halves' loads are the same one). */
W_INLINE void load_halves(const kt__fma_src src, const char *p, __mmask32 lanes, __m512 *h0,
                          __m512 *h1)
{
    *h0 = load_half(src, p, lanes, 0);
    *h1 = load_half(src, p, lanes, 1);
}

/* Whether a call over rows [0, M), columns [c0, c1) of y and a reduction of length `red` is
 * done without a kernel: no rows or columns, or no products (y then the empty sum, or left as
 * it is when accumulating; a negative length leaves it too, as the tiles do). */
static int nothing_to_sum(int64_t M, int64_t c0, int64_t c1, int64_t red, float *y, int64_t ldy,
                          int accumulate)
{
    if (M <= 0 || c1 <= c0)
        return 1;
    if (red > 0)
        return 0;
    if (red == 0 && !accumulate)
        for (int64_t m = 0; m < M; m++)
            memset(y + m * ldy + c0, 0, (size_t)(c1 - c0) * sizeof *y);
    return 1;
}

/* ---- NT ------------------------------------------------------------------------------------ */

#define DOT_R 8        /* rows of x per block at most */
#define DOT_ACC 16     /* sums per block: R x C <= 16, reduced together into one vector */
#define FETCH_GROUPS 2 /* groups of w rows fetched ahead */
/* x's halves of a chunk: 32 KiB, kept in L1; rows kcp + XP_PAD floats apart (rows exactly
 * 4 KiB apart would share L1 sets and alias each other's addresses in the load unit) */
#define XP_FLOATS (8 * 1024)
#define XP_PAD 16

/* xp[r][0:kcp] = x[r][0:kc] as halves per 32 values, zeros past kc (kcp: kc rounded up to
 * 32); rows ldxp apart. */
W_INLINE void pack_halves(const kt__fma_src src, float *xp, int64_t ldxp, const void *x,
                          int64_t ldx, int rows, int64_t kc)
{
    for (int r = 0; r < rows; r++)
        for (int64_t k = 0; k < kc; k += 32) {
            __m512 h0, h1;
            load_halves(src, elem(x, r * ldx + k, src), kt__lanes32(kc - k), &h0, &h1);
            _mm512_store_ps(xp + r * ldxp + k, h0);
            _mm512_store_ps(xp + r * ldxp + k + 16, h1);
        }
}

W_TARGET static void pack_halves_any(kt__fma_src src, float *xp, int64_t ldxp, const void *x,
                                     int64_t ldx, int rows, int64_t kc)
{
    if (src == KT__FMA_F32)
        pack_halves(KT__FMA_F32, xp, ldxp, x, ldx, rows, kc);
    else
        pack_halves(KT__FMA_BF16, xp, ldxp, x, ldx, rows, kc);
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

/* One step of 32 values: acc[r * C + c] += x's halves (xs) times the halves of w's C rows (wc[c]
 * at value k, the first `lanes` of 32 read). fetch: bytes on from each row fetched into L2 (or
 * 0). */
W_INLINE void dots_step(const kt__fma_src src, const int R, const int C, __m512 acc[DOT_ACC],
                        const float *xs, int64_t ldxp, const char *const wc[4], int64_t k,
                        __mmask32 lanes, int64_t fetch)
{
    if (fetch) /* the step's lines of a later group: one for bf16, two for f32 */
        for (int c = 0; c < C; c++)
            for (int64_t o = 0; o < bytes_of(32, src); o += 64)
                _mm_prefetch(elem(wc[c], k, src) + fetch + o, _MM_HINT_T1);
    /* one half at a time (with both halves of every row loaded first GCC kept acc in memory) */
    for (int h = 0; h < 2; h++) {
        __m512 wv[4];
        for (int c = 0; c < C; c++)
            wv[c] = load_half(src, elem(wc[c], k, src), lanes, h);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_load_ps(xs + r * ldxp + 16 * h);
            for (int c = 0; c < C; c++)
                acc[r * C + c] = _mm512_fmadd_ps(xv, wv[c], acc[r * C + c]);
        }
    }
}

/* y[r, c] (+)= sum over the chunk of xp[r] . w[c] for r < R, c < nw <= C. Rows of w past nw
 * read row 0 again (their sums are dropped). */
W_INLINE void dots_block(const kt__fma_src src, const int R, const int C, int64_t nw, int64_t kc,
                         const float *xp, int64_t ldxp, const void *w, int64_t ldw, float *y,
                         int64_t ldy, int add, int64_t fetch)
{
    __m512 acc[DOT_ACC];
    const char *wc[4];
    for (int c = 0; c < C; c++)
        wc[c] = elem(w, (c < nw ? c : 0) * ldw, src);
    for (int i = 0; i < DOT_ACC; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32)
        dots_step(src, R, C, acc, xp + k, ldxp, wc, k, 0xffffffffu, fetch);
    if (k < kc)
        dots_step(src, R, C, acc, xp + k, ldxp, wc, k, kt__lanes32(kc - k), fetch);
    float sums[DOT_ACC];
    _mm512_storeu_ps(sums, reduce16(acc));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nw; c++)
            y[r * ldy + c] = add ? y[r * ldy + c] + sums[r * C + c] : sums[r * C + c];
}

/* Rows of w per block: R x C sums at most 16, so that they, C rows' halves and one row of x
 * stay in registers (with R = 8 and C = 3 GCC ran out and read x from L1 for every FMA). For
 * bf16, two integer ops per 32 weights against 2 R FMAs: the more rows the better. */
static int cols_for(int64_t rmax) { return rmax <= 4 ? 4 : rmax == 5 ? 3 : 2; }
/* block_bf16/block_f32 have a case for every (R, C) this gives up to DOT_R rows (R or R - 1
 * rows a block, C from the larger), and a pass's chunk holds at least one step of 32 */
_Static_assert(DOT_R == 8 && DOT_R * 2 <= DOT_ACC, "one block case per (R, C) up to 8 rows");
_Static_assert(XP_FLOATS / PASS_M - XP_PAD >= 32, "a chunk of x for PASS_M rows fits xp");

#define BLOCK_CASE(S, R, C)                                                                        \
    case R * 8 + C:                                                                                \
        dots_block(S, R, C, nw, kc, xp, ldxp, w, ldw, y, ldy, add, fetch);                         \
        break;

/* One function per dtype: with both in one, GCC kept the sums in memory. */
#define BLOCK_ANY(NAME, S)                                                                         \
    W_INLINE void NAME(int R, int C, int64_t nw, int64_t kc, const float *xp, int64_t ldxp,        \
                       const void *w, int64_t ldw, float *y, int64_t ldy, int add, int64_t fetch)  \
    {                                                                                              \
        switch (R * 8 + C) {                                                                       \
            BLOCK_CASE(S, 1, 4)                                                                    \
            BLOCK_CASE(S, 2, 4)                                                                    \
            BLOCK_CASE(S, 3, 4)                                                                    \
            BLOCK_CASE(S, 4, 4)                                                                    \
            BLOCK_CASE(S, 4, 3)                                                                    \
            BLOCK_CASE(S, 5, 3)                                                                    \
            BLOCK_CASE(S, 5, 2)                                                                    \
            BLOCK_CASE(S, 6, 2)                                                                    \
            BLOCK_CASE(S, 7, 2)                                                                    \
            BLOCK_CASE(S, 8, 2)                                                                    \
        default:                                                                                   \
            break;                                                                                 \
        }                                                                                          \
    }

BLOCK_ANY(block_bf16, KT__FMA_BF16)
BLOCK_ANY(block_f32, KT__FMA_F32)
#undef BLOCK_ANY
#undef BLOCK_CASE

/* Rows [0, M) of x (M <= PASS_M) against w's rows [n0, n1). */
W_TARGET static void dots_pass(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                               const void *x, int64_t ldx, const void *w, int64_t ldw, float *y,
                               int64_t ldy, int accumulate, float *xp)
{
    const tiling tl = tiles_of(M, DOT_R);
    const int C = cols_for(tile_height(&tl, 0));
    /* chunks of the reduction: as few as fit xp, of equal whole steps of 32; a function of M and
     * K only, so every block split of n sums alike */
    const int64_t kfit = (XP_FLOATS / M - XP_PAD) & ~(int64_t)31;
    const int64_t nchunk = (K + kfit - 1) / kfit;
    const int64_t kstep = ((K + nchunk - 1) / nchunk + 31) & ~(int64_t)31;
    const int64_t fetch = bytes_of(FETCH_GROUPS * C * ldw, src);
    for (int64_t k0 = 0; k0 < K; k0 += kstep) {
        const int64_t kc = K - k0 < kstep ? K - k0 : kstep;
        const int64_t ldxp = ((kc + 31) & ~(int64_t)31) + XP_PAD;
        pack_halves_any(src, xp, ldxp, elem(x, k0, src), ldx, (int)M, kc);
        for (int64_t n = n0; n < n1; n += C) {
            const int64_t nw = n1 - n < C ? n1 - n : C;
            for (int64_t b = 0; b < tl.n; b++) {
                const int64_t r0 = tile_start(&tl, b);
                const int R = tile_height(&tl, b);
                const float *xb = xp + r0 * ldxp;
                const void *wb = elem(w, n * ldw + k0, src);
                float *yb = y + r0 * ldy + n;
                const int add = accumulate || k0 > 0;
                if (src == KT__FMA_F32)
                    block_f32(R, C, nw, kc, xb, ldxp, wb, ldw, yb, ldy, add, b == 0 ? fetch : 0);
                else
                    block_bf16(R, C, nw, kc, xb, ldxp, wb, ldw, yb, ldy, add, b == 0 ? fetch : 0);
            }
        }
    }
}

W_TARGET void kt__fma_nt_dots(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                              const void *x, int64_t ldx, const void *w, int64_t ldw, float *y,
                              int64_t ldy, int accumulate)
{
    if (nothing_to_sum(M, n0, n1, K, y, ldy, accumulate))
        return;
    const unsigned csr = flush_denormals(src);
    float xp[XP_FLOATS] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += PASS_M)
        dots_pass(src, M - m0 < PASS_M ? M - m0 : PASS_M, n0, n1, K, elem(x, m0 * ldx, src), ldx, w,
                  ldw, y + m0 * ldy, ldy, accumulate, xp);
    _mm_setcsr(csr);
}

/* ---- NN ------------------------------------------------------------------------------------ */

#define NN_R 12 /* rows of g per block: 24 sums */
/* g's rows of a chunk of the reduction as f32: 16 KiB, in L1 beside the lines of w a block
 * reads, broadcast from there */
#define GF_FLOATS (4 * 1024)
/* w's rows of a chunk at most: this chunk and the next one fetched stay in L2 */
#define W_CHUNK_BYTES (512 * 1024)

/* 32 columns of a row of y (the first of `lanes`) as w's halves have them: for bf16 the even
 * and the odd columns, for f32 columns 0-15 and 16-31. */
W_INLINE void load_y_halves(const kt__fma_src src, const float *y, __mmask32 lanes, __m512 *h0,
                            __m512 *h1)
{
    const __m512 a = _mm512_maskz_loadu_ps((__mmask16)lanes, y);
    const __m512 b = _mm512_maskz_loadu_ps((__mmask16)(lanes >> 16), y + 16);
    if (src == KT__FMA_F32) {
        *h0 = a, *h1 = b;
        return;
    }
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *h0 = _mm512_permutex2var_ps(a, ie, b);
    *h1 = _mm512_permutex2var_ps(a, io, b);
}

/* load_y_halves' inverse. */
W_INLINE void store_y_halves(const kt__fma_src src, float *y, __mmask32 lanes, __m512 h0, __m512 h1)
{
    __m512 a = h0, b = h1;
    if (src == KT__FMA_BF16) {
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi =
            _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        a = _mm512_permutex2var_ps(h0, lo, h1);
        b = _mm512_permutex2var_ps(h0, hi, h1);
    }
    _mm512_mask_storeu_ps(y, (__mmask16)lanes, a);
    _mm512_mask_storeu_ps(y + 16, (__mmask16)(lanes >> 16), b);
}

/* y[r, 0:ncols] = (load ? y : 0) + sum over n < nc of gf[r][n] w[n, 0:ncols] for r < R,
 * ncols <= 32, each product added in n's order. fetch: a line of it per step (or NULL). */
W_INLINE void nn_block(const kt__fma_src src, const int R, int64_t nc, const float *gf,
                       int64_t ldgf, const void *w, int64_t ldw, int64_t ncols, float *y,
                       int64_t ldy, int load, kt__line_cursor *fetch)
{
    const __mmask32 lanes = kt__lanes32(ncols);
    __m512 acc[NN_R][2];
    for (int r = 0; r < R; r++) {
        if (load) {
            load_y_halves(src, y + r * ldy, lanes, &acc[r][0], &acc[r][1]);
        } else {
            acc[r][0] = _mm512_setzero_ps();
            acc[r][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t n = 0; n < nc; n++) {
        __m512 w0, w1;
        load_halves(src, elem(w, n * ldw, src), lanes, &w0, &w1);
        if (fetch) /* as many lines as the step reads: one for bf16, two for f32 */
            for (int64_t o = 0; o < bytes_of(32, src); o += 64)
                kt__cursor_step(fetch);
        for (int r = 0; r < R; r++) {
            const __m512 gb = _mm512_set1_ps(gf[r * ldgf + n]);
            acc[r][0] = _mm512_fmadd_ps(gb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(gb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        store_y_halves(src, y + r * ldy, lanes, acc[r][0], acc[r][1]);
}

_Static_assert(NN_R == 12, "nn_block_any has one case per height up to 12");
_Static_assert(GF_FLOATS / PASS_M - 16 >= 16, "a chunk of g for PASS_M rows fits gf");

#define NN_CASE(R)                                                                                 \
    case R:                                                                                        \
        if (src == KT__FMA_F32)                                                                    \
            nn_block(KT__FMA_F32, R, nc, gf, ldgf, w, ldw, ncols, y, ldy, load, fetch);            \
        else                                                                                       \
            nn_block(KT__FMA_BF16, R, nc, gf, ldgf, w, ldw, ncols, y, ldy, load, fetch);           \
        break;

W_TARGET static void nn_block_any(kt__fma_src src, int R, int64_t nc, const float *gf, int64_t ldgf,
                                  const void *w, int64_t ldw, int64_t ncols, float *y, int64_t ldy,
                                  int load, kt__line_cursor *fetch)
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

/* Rows [0, M) of g (M <= PASS_M). */
W_TARGET static void nn_pass(kt__fma_src src, int64_t M, int64_t N, int64_t k0, int64_t k1,
                             const void *const gs[2], const void *const ws[2], int nsrc,
                             int64_t ldg, int64_t ldw, float *y, int64_t ldy, int accumulate,
                             float *gf)
{
    const tiling tl = tiles_of(M, NN_R);
    const int64_t row_bytes = bytes_of(k1 - k0, src);
    int64_t ncmax = (GF_FLOATS / M - 16) & ~(int64_t)15;
    const int64_t wrows = W_CHUNK_BYTES / row_bytes;
    if (ncmax > wrows)
        ncmax = wrows < 16 ? 16 : wrows & ~(int64_t)15;
    int started = accumulate;
    for (int s = 0; s < nsrc; s++)
        for (int64_t n0 = 0; n0 < N; n0 += ncmax) {
            const int64_t nc = N - n0 < ncmax ? N - n0 : ncmax;
            const int64_t ldgf = ((nc + 15) & ~(int64_t)15) + 16;
            widen_rows(gf, ldgf, elem(gs[s], n0, src), ldg, M, nc, src);
            /* the next chunk: this source's next rows, or the next source's first */
            kt__line_cursor next;
            if (n0 + nc < N)
                kt__cursor_init(&next, elem(ws[s], (n0 + nc) * ldw + k0, src), bytes_of(ldw, src),
                                N - n0 - nc < ncmax ? N - n0 - nc : ncmax, row_bytes);
            else
                kt__cursor_init(&next, s + 1 < nsrc ? elem(ws[s + 1], k0, src) : NULL,
                                bytes_of(ldw, src), N < ncmax ? N : ncmax, row_bytes);
            for (int64_t c = k0; c < k1; c += 32)
                for (int64_t b = 0; b < tl.n; b++) {
                    const int64_t r0 = tile_start(&tl, b);
                    const int R = tile_height(&tl, b);
                    nn_block_any(src, R, nc, gf + r0 * ldgf, ldgf, elem(ws[s], n0 * ldw + c, src),
                                 ldw, k1 - c < 32 ? k1 - c : 32, y + r0 * ldy + c, ldy, started,
                                 b == 0 ? &next : NULL);
                }
            started = 1;
        }
}

W_TARGET void kt__fma_nn_direct(kt__fma_src src, int64_t M, int64_t N, int64_t k0, int64_t k1,
                                const void *g0, const void *w0, const void *g1, const void *w1,
                                int64_t ldg, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (nothing_to_sum(M, k0, k1, N, y, ldy, accumulate))
        return;
    const unsigned csr = flush_denormals(src);
    float gf[GF_FLOATS] __attribute__((aligned(64)));
    const void *ws[2] = {w0, w1};
    for (int64_t m0 = 0; m0 < M; m0 += PASS_M) {
        const void *gs[2] = {elem(g0, m0 * ldg, src), g1 != NULL ? elem(g1, m0 * ldg, src) : NULL};
        nn_pass(src, M - m0 < PASS_M ? M - m0 : PASS_M, N, k0, k1, gs, ws, g1 != NULL ? 2 : 1, ldg,
                ldw, y + m0 * ldy, ldy, accumulate, gf);
    }
    _mm_setcsr(csr);
}

#endif
