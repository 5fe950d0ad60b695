/* The MoE GEMMs on the f32 FMA units, bf16 or f32 operands (see fma_gemm.h for why and for the
 * summation order).
 *
 * One register tile serves the three products: up to 12 rows x 32 columns of f32 sums; per
 * step of the reduction two zmm of a packed panel [step][32] (in L1) and one broadcast per
 * row, 24 FMAs. The broadcast operand is either rows of a converted chunk ([row][WK], NN and
 * NT: element (i, k) at i * WK + k) or a packed panel ([step][12], TN: at k * 12 + i); both
 * strides are compile-time constants, so every address in the loop is a displacement. */
#include <string.h>

#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/fma_util.h"
#include "lib/kernels/lane_mask.h"
#include "lib/kernels/prefetch.h"

#define WR 12       /* rows of a tile */
#define WC 32       /* columns of a tile and of a panel */
#define WK 128      /* reduction chunk of NN and NT: a panel [WK][32] f32 is 16 KiB */
#define WM 128      /* rows of g / x converted at once (NN, NT): [WM][WK] f32 is 64 KiB */
#define NN_PANELS 4 /* NN packs 4 panels (128 columns: 256 bytes of each weight row) at once */

#ifdef KT__FMA_GEMM

/* ---- the tile ------------------------------------------------------------------------------ */

/* How a tile starts and ends. */
typedef struct tile_io {
    int load;         /* start from c's values (a later chunk, or accumulate) instead of zero */
    int finish;       /* TN's end: c = (add ? c : 0) + scale * sums */
    int add;          /* with finish; without add, whole aligned rows are stored past the
                       * caches (TN's first micro-batch: gigabytes read next by the optimizer) */
    float scale;      /* with finish */
    const float *src; /* with load: start from src (row stride ldsrc) instead of c */
    int64_t ldsrc;
} tile_io;

/* c[i, 0:ncols] for i < MR (MR a constant where inlined), sums over kc steps of
 * a(i, k) * b[k][0:32]. fetch (or NULL): a line of it every `period` steps. */
W_INLINE void tile_run(const int MR, const int AROW, const int AK, const float *a, const float *b,
                       int64_t kc, float *c, int64_t ldc, int64_t ncols, const tile_io *io,
                       kt__line_cursor *fetch, int64_t period)
{
    int64_t countdown = period;
    const __mmask16 m0 = kt__lanes16(ncols), m1 = kt__lanes16(ncols - 16);
    __m512 acc[WR][2];
    const float *cin = io->src != NULL ? io->src : c;
    const int64_t ldin = io->src != NULL ? io->ldsrc : ldc;
    for (int i = 0; i < MR; i++) {
        if (io->load) {
            acc[i][0] = _mm512_maskz_loadu_ps(m0, cin + i * ldin);
            acc[i][1] = _mm512_maskz_loadu_ps(m1, cin + i * ldin + 16);
        } else {
            acc[i][0] = _mm512_setzero_ps();
            acc[i][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_load_ps(b + k * WC), b1 = _mm512_load_ps(b + k * WC + 16);
        if (fetch != NULL && --countdown == 0) {
            countdown = period;
            kt__cursor_step(fetch);
        }
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            const __m512 ai = _mm512_set1_ps(a[i * AROW + k * AK]);
            acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
    if (!io->finish) {
        for (int i = 0; i < MR; i++) {
            _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
            _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
        }
        return;
    }
    /* round-mode forms: a plain multiply then add could be contracted into one FMA, which
     * rounds once where the reference rounds twice */
    const __m512 s = _mm512_set1_ps(io->scale);
    const int stream = !io->add && ncols == WC && ((uintptr_t)c & 63) == 0 && (ldc & 15) == 0;
    for (int i = 0; i < MR; i++) {
        for (int h = 0; h < 2; h++) {
            const __mmask16 mk = h ? m1 : m0;
            float *ci = c + i * ldc + 16 * h;
            __m512 v = _mm512_mul_round_ps(acc[i][h], s, _MM_FROUND_CUR_DIRECTION);
            if (io->add)
                v = _mm512_add_round_ps(_mm512_maskz_loadu_ps(mk, ci), v, _MM_FROUND_CUR_DIRECTION);
            if (stream)
                _mm512_stream_ps(ci, v);
            else
                _mm512_mask_storeu_ps(ci, mk, v);
        }
    }
}

#define TILE_CASE(MR)                                                                              \
    case MR:                                                                                       \
        if (packed)                                                                                \
            tile_run(MR, 1, WR, a, b, kc, c, ldc, ncols, io, fetch, period);                       \
        else                                                                                       \
            tile_run(MR, WK, 1, a, b, kc, c, ldc, ncols, io, fetch, period);                       \
        break;

/* A tile of mr rows (1..12): the switch makes each height a constant, so the 24 accumulators
 * stay in registers. packed: a is [kc][12] (TN), else rows [mr][WK]. */
W_TARGET static void tile(int mr, int packed, const float *a, const float *b, int64_t kc, float *c,
                          int64_t ldc, int64_t ncols, const tile_io *io, kt__line_cursor *fetch,
                          int64_t period)
{
    switch (mr) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
        TILE_CASE(5)
        TILE_CASE(6)
        TILE_CASE(7)
        TILE_CASE(8)
        TILE_CASE(9)
        TILE_CASE(10)
        TILE_CASE(11)
        TILE_CASE(12)
    default:
        break;
    }
}

/* ---- loading operands ---------------------------------------------------------------------- */

/* NT's panel: p[k][j] = w[j, k] for j < nrows (zeros above, up to WC = 32), k < kc. */
W_TARGET static void pack_transposed(float *p, const void *w, int64_t ldw, int64_t nrows,
                                     int64_t kc, kt__fma_src src)
{
    if (src == KT__FMA_BF16)
        pack_pairs_transposed(p, w, ldw, nrows, kc);
    else
        pack_widened_transposed(p, w, ldw, nrows, kc, src);
}

/* NN's and TN's panel: p[r][0:32] = rows r < nrows of src from column 0, ncols wide (zeros
 * past ncols). */
W_TARGET static void pack_rows(float *p, const void *m, int64_t ld, int64_t nrows, int64_t ncols,
                               kt__fma_src src)
{
    for (int64_t r = 0; r < nrows; r++)
        load_row(p + r * WC, elem(m, r * ld, src), ncols, WC, src);
}

/* ---- row dots: x w^T for a few rows of x ------------------------------------------------- */

/* Weight rows per step: with MR rows of x, MR x 4 accumulators. */
#define ROWS_W 4

/* y[m, 0 .. nw) for nw <= 4 rows of w: 16 lanes of sums along k, then the lanes added in
 * _mm512_reduce_add_ps's fixed tree. The 4 rows of w are read side by side, front to back.
 * (bf16 keeps the vdpbf16ps rows kernel, bf16_nt_dpbf16.c: this loop with the rows widened
 * was slower there.) */
W_INLINE void rows_step(const int MR, int64_t nw, int64_t K, const float *x, int64_t ldx,
                        const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    __m512 acc[KT__FMA_ROWS_MAX_M][ROWS_W];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < ROWS_W; j++)
            acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = kt__lanes16(K - k);
        __m512 wv[ROWS_W];
        for (int j = 0; j < ROWS_W; j++)
            wv[j] = j < nw ? _mm512_maskz_loadu_ps(mk, w + j * ldw + k) : _mm512_setzero_ps();
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mk, x + i * ldx + k);
            for (int j = 0; j < ROWS_W; j++)
                acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < nw; j++) {
            const float v = _mm512_reduce_add_ps(acc[i][j]);
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + v : v;
        }
}

#define ROWS_CASE(MR)                                                                              \
    case MR:                                                                                       \
        for (int64_t n = n0; n < n1; n += ROWS_W)                                                  \
            rows_step(MR, n1 - n < ROWS_W ? n1 - n : ROWS_W, K, x, ldx, w + n * ldw, ldw, y + n,   \
                      ldy, accumulate);                                                            \
        break;
_Static_assert(KT__FMA_ROWS_MAX_M == 4, "kt__fma_nt_rows_f32 has one case per row count");

W_TARGET void kt__fma_nt_rows_f32(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x,
                                  int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                                  int accumulate)
{
    if (n1 <= n0)
        return;
    switch (M) {
        ROWS_CASE(1)
        ROWS_CASE(2)
        ROWS_CASE(3)
        ROWS_CASE(4)
    default:
        break;
    }
}
#undef ROWS_CASE

/* ---- NT ------------------------------------------------------------------------------------ */

W_TARGET void kt__fma_nt(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                         const void *x, int64_t ldx, const void *w, int64_t ldw, float *y,
                         int64_t ldy, int accumulate)
{
    if (M <= 0 || n1 <= n0)
        return;
    const unsigned csr = flush_denormals(src);
    float xf[WM * WK] __attribute__((aligned(64)));
    float panel[WK * WC] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += WM) {
        const int64_t mc = M - m0 < WM ? M - m0 : WM;
        const tiling tl = tiles_of(mc, WR);
        if (K == 0 && !accumulate)
            for (int64_t m = m0; m < m0 + mc; m++)
                memset(y + m * ldy + n0, 0, (size_t)(n1 - n0) * sizeof(float));
        for (int64_t k0 = 0; k0 < K; k0 += WK) {
            const int64_t kc = K - k0 < WK ? K - k0 : WK;
            widen_rows(xf, WK, elem(x, m0 * ldx + k0, src), ldx, mc, kc, src);
            const tile_io io = {k0 > 0 || accumulate, 0, 0, 1.0f, NULL, 0};
            for (int64_t nb = n0; nb < n1; nb += WC) {
                const int64_t nc = n1 - nb < WC ? n1 - nb : WC;
                pack_transposed(panel, elem(w, nb * ldw + k0, src), ldw, nc, kc, src);
                kt__line_cursor f; /* these rows' next chunk, over the tiles' steps */
                kt__cursor_init(&f, k0 + WK < K ? elem(w, nb * ldw + k0 + WK, src) : NULL,
                                bytes_of(ldw, src), nc,
                                bytes_of(K - k0 - WK < WK ? K - k0 - WK : WK, src));
                const int64_t period = kt__cursor_period(&f, tl.n * kc);
                for (int64_t t = 0; t < tl.n; t++) {
                    const int64_t r = tile_start(&tl, t);
                    tile(tile_height(&tl, t), 0, xf + r * WK, panel, kc, y + (m0 + r) * ldy + nb,
                         ldy, nc, &io, &f, period);
                }
            }
        }
    }
    _mm_setcsr(csr);
}

/* ---- NN ------------------------------------------------------------------------------------ */

W_TARGET void kt__fma_nn(kt__fma_src src, int64_t M, int64_t N, int64_t k0, int64_t k1,
                         const void *g0, const void *w0, const void *g1, const void *w1,
                         int64_t ldg, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0 || k1 <= k0)
        return;
    const unsigned csr = flush_denormals(src);
    float gf[WM * WK] __attribute__((aligned(64)));
    float panels[NN_PANELS * WK * WC] __attribute__((aligned(64)));
    const void *gs[2] = {g0, g1}, *ws[2] = {w0, w1};
    const int64_t ldw_bytes = bytes_of(ldw, src);
    const int nsrc = g1 != NULL ? 2 : 1;
    const int64_t group = NN_PANELS * WC;
    for (int64_t m0 = 0; m0 < M; m0 += WM) {
        const int64_t mc = M - m0 < WM ? M - m0 : WM;
        const tiling tl = tiles_of(mc, WR);
        int started = accumulate;
        if (N == 0 && !accumulate)
            for (int64_t m = m0; m < m0 + mc; m++)
                memset(y + m * ldy + k0, 0, (size_t)(k1 - k0) * sizeof(float));
        for (int s = 0; s < nsrc; s++)
            for (int64_t r0 = 0; r0 < N; r0 += WK) {
                const int64_t kc = N - r0 < WK ? N - r0 : WK;
                widen_rows(gf, WK, elem(gs[s], m0 * ldg + r0, src), ldg, mc, kc, src);
                const tile_io io = {started, 0, 0, 1.0f, NULL, 0};
                const char *wr = elem(ws[s], r0 * ldw, src);
                for (int64_t c0 = k0; c0 < k1; c0 += group) {
                    const int64_t gc = k1 - c0 < group ? k1 - c0 : group;
                    const int np = (int)((gc + WC - 1) / WC);
                    for (int p = 0; p < np; p++)
                        pack_rows(panels + p * WK * WC, elem(wr, c0 + p * WC, src), ldw, kc,
                                  gc - p * WC < WC ? gc - p * WC : WC, src);
                    /* what the next pack reads: this chunk's next group of columns, else
                     * the first group of the next chunk of rows (or of the next source) */
                    const char *next = NULL;
                    int64_t next_rows = 0, next_c0 = c0 + group;
                    if (next_c0 < k1) {
                        next = wr, next_rows = kc;
                    } else if (r0 + WK < N || s + 1 < nsrc) {
                        const int64_t nr0 = r0 + WK < N ? r0 + WK : 0;
                        next = elem(r0 + WK < N ? ws[s] : ws[s + 1], nr0 * ldw, src);
                        next_rows = N - nr0 < WK ? N - nr0 : WK;
                        next_c0 = k0;
                    }
                    const int64_t next_cols = k1 - next_c0 < group ? k1 - next_c0 : group;
                    kt__line_cursor f;
                    kt__cursor_init(&f, next != NULL ? elem(next, next_c0, src) : NULL, ldw_bytes,
                                    next_rows, bytes_of(next_cols, src));
                    const int64_t period = kt__cursor_period(&f, np * tl.n * kc);
                    for (int p = 0; p < np; p++) {
                        const int64_t nc = gc - p * WC < WC ? gc - p * WC : WC;
                        for (int64_t t = 0; t < tl.n; t++) {
                            const int64_t r = tile_start(&tl, t);
                            tile(tile_height(&tl, t), 0, gf + r * WK, panels + p * WK * WC, kc,
                                 y + (m0 + r) * ldy + c0 + p * WC, ldy, nc, &io, &f, period);
                        }
                    }
                }
                started = 1;
            }
    }
    _mm_setcsr(csr);
}

/* ---- TN ------------------------------------------------------------------------------------ */

/* TN's buffers: x's panel [M][32] and the A panels ([M][12]) of a group of up to TN_GROUP
 * tiles, TN_APACK_BYTES at most unless one tile's is larger. */
#define TN_GROUP 16
#define TN_APACK_BYTES (96 * 1024)

static int64_t tn_group(int64_t M)
{
    if (M <= 0)
        return TN_GROUP;
    const int64_t g = TN_APACK_BYTES / (M * WR * 4);
    return g < 1 ? 1 : g > TN_GROUP ? TN_GROUP : g;
}

size_t kt__fma_tn_work_bytes(int64_t M)
{
    if (M <= KT__FMA_TN_STACK_ROWS)
        return 0;
    /* tn_group falls with M, but never below 1: the bound for M covers every smaller M above
     * the stack rows (M * (128 + 48 * group) grows with M once group is 1; below, group * M is
     * at most TN_APACK_BYTES / 48) */
    const size_t cap = (size_t)M * WC * 4 + (size_t)TN_APACK_BYTES + (size_t)M * WR * 4 + 64;
    return (cap + 63) / 64 * 64;
}

/* A panel of a tile: ap[m][i] = g[m, n + i] for i < nr (zeros up to 12). */
W_TARGET static void pack_g_columns(float *ap, const void *g, int64_t ldg, int64_t M, int64_t nr,
                                    kt__fma_src src)
{
    for (int64_t m = 0; m < M; m++) /* lanes from nr on are zeros: load16 loads nr values */
        _mm512_mask_storeu_ps(ap + m * WR, 0x0fff, load16(elem(g, m * ldg, src), nr, src));
}

W_TARGET static void tn_run(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                            const void *g, int64_t ldg, const void *x, int64_t ldx, float *dw,
                            int64_t lddw, float scale, int accumulate, float *xp, float *ap)
{
    const int64_t grp = tn_group(M);
    const tile_io io = {0, 1, accumulate, scale, NULL, 0};
    for (int64_t nt0 = n0; nt0 < n1; nt0 += grp * WR) {
        const int64_t gend = nt0 + grp * WR < n1 ? nt0 + grp * WR : n1;
        const tiling tl = tiles_of(gend - nt0, WR);
        for (int64_t t = 0; t < tl.n; t++)
            pack_g_columns(ap + t * M * WR, elem(g, nt0 + tile_start(&tl, t), src), ldg, M,
                           tile_height(&tl, t), src);
        for (int64_t kb = 0; kb < K; kb += WC) {
            const int64_t kc = K - kb < WC ? K - kb : WC;
            pack_rows(xp, elem(x, kb, src), ldx, M, kc, src);
            for (int64_t t = 0; t < tl.n; t++) {
                const int64_t r = nt0 + tile_start(&tl, t);
                tile(tile_height(&tl, t), 1, ap + t * M * WR, xp, M, dw + r * lddw + kb, lddw, kc,
                     &io, NULL, 1);
            }
        }
    }
}

/* Without a work buffer above the stack rows: the same sums, M in chunks of
 * KT__FMA_TN_STACK_ROWS rows, each tile's partial sums kept between chunks (slower: g's
 * columns are packed again for every column block). */
W_TARGET static void tn_run_chunked(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                                    const void *g, int64_t ldg, const void *x, int64_t ldx,
                                    float *dw, int64_t lddw, float scale, int accumulate)
{
    enum { CH = KT__FMA_TN_STACK_ROWS };
    float xp[CH * WC] __attribute__((aligned(64)));
    float ap[CH * WR] __attribute__((aligned(64)));
    float part[WR * WC] __attribute__((aligned(64)));
    const tiling tl = tiles_of(n1 - n0, WR);
    for (int64_t t = 0; t < tl.n; t++) {
        const int64_t r = n0 + tile_start(&tl, t);
        const int h = tile_height(&tl, t);
        for (int64_t kb = 0; kb < K; kb += WC) {
            const int64_t kc = K - kb < WC ? K - kb : WC;
            for (int64_t m0 = 0; m0 < M; m0 += CH) {
                const int64_t mc = M - m0 < CH ? M - m0 : CH;
                const int last = m0 + mc >= M;
                pack_g_columns(ap, elem(g, m0 * ldg + r, src), ldg, mc, h, src);
                pack_rows(xp, elem(x, m0 * ldx + kb, src), ldx, mc, kc, src);
                const tile_io io = {m0 > 0, last, accumulate, scale, part, WC};
                tile(h, 1, ap, xp, mc, last ? dw + r * lddw + kb : part, last ? lddw : WC, kc, &io,
                     NULL, 1);
            }
        }
    }
}

W_TARGET void kt__fma_tn(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K,
                         const void *g, int64_t ldg, const void *x, int64_t ldx, float *dw,
                         int64_t lddw, float scale, int accumulate, void *work)
{
    if (n1 <= n0 || K <= 0)
        return;
    const unsigned csr = flush_denormals(src);
    if (M <= KT__FMA_TN_STACK_ROWS) {
        unsigned char buf[KT__FMA_TN_STACK_ROWS * WC * 4 + TN_APACK_BYTES + 64]
            __attribute__((aligned(64)));
        float *xp = (float *)buf;
        tn_run(src, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, xp,
               xp + (M > 0 ? M : 1) * WC);
    } else if (work != NULL) {
        float *xp = work;
        tn_run(src, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, xp, xp + M * WC);
    } else {
        tn_run_chunked(src, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
    }
    if (!accumulate)
        _mm_sfence(); /* the streamed rows visible to whichever thread reads them next */
    _mm_setcsr(csr);
}

#endif
