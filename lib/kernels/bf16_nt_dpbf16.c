/* The bf16 NT kernels on AVX-512 BF16 (vdpbf16ps): y = x w^T (see bf16_gemm.h).
 *
 *
 * The vector kernels are compiled with target attributes (the library needs no -m flags) and
 * chosen per call from the CPU features; without AVX-512 BF16 (or with KT_CPU=portable) the
 * scalar reference runs. vdpbf16ps multiplies pairs of bf16 values and adds both products to
 * an f32 lane (denormal inputs and results are flushed to zero, as the instruction defines).
 *
 * Summation order. Every output element is computed by one fixed sequence of operations that
 * depends only on the length of the reduced dimension, never on the block of the output a
 * call computes or on the element's position in a register tile (edge tiles run the same
 * code with fewer rows; masked lanes add exact zeros), so any split over threads gives
 * bitwise identical results:
 *  - NT: 16 lanes each accumulate the pairs k = 32c + 2l, 32c + 2l + 1 over chunks c in
 *    order (the K remainder is a zero-padded chunk), then the 16 lanes are added by a fixed
 *    tree (reduce16).
 *  - NN / TN: one lane per output element accumulates the pairs (n, n+1) of the reduced
 *    dimension in order, the odd remainder as a final pair with a zero partner.
 *
 * Kernels (register tiles, accumulators in zmm registers over a whole reduction or chunk):
 *  - NT y = x w^T: a tile of up to 4 rows of x by 6 rows of w, 24 accumulators, 4 + 6 loads
 *    per 24 vdpbf16ps; x is walked in row chunks that stay in L2, and w in blocks of 6 rows
 *    that stay in L1 while all x rows of the chunk pass, so at small M each w row is read
 *    from memory once for all M rows (6 rows streaming at once). Up to 4 rows of x (nt_rows)
 *    w is read one row at a time instead, in address order (up to 2 rows of x, as two halves
 *    side by side), the products of 16 / M rows of w reduced together.
 * Rows of w (and x for TN) that are 4 KiB apart all fall in one L1 set; where a kernel walks
 * a column block down many rows it prefetches what comes next into L2 (the next chunk's
 * rows, or along the row). The kernels use up to 128 KiB of stack (the NN rows path). They
 * are fastest with 64-byte aligned operands and leading dimensions that are multiples of 32
 * elements (rows then start on cache lines). */
#include <string.h>

#include "lib/core/cpu_internal.h"
#include "lib/kernels/bf16_dpbf16.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/lane_mask.h"

#ifdef KT__DPBF16_COMPILED

/* ---- NT ------------------------------------------------------------------------------------ */

/* x rows per chunk: a chunk of x (rows x K bf16) stays within about 640 KiB of the 1 MiB L2
 * (the w block being read and the next one being prefetched take the rest). */
#define NT_X_CHUNK_BYTES (640 * 1024)
#define NT_COLS 6      /* w rows per block */
#define NT_PF_AHEAD 12 /* w rows from a block to the ones its tile prefetches at 5-32 rows */

BF_INLINE __m512i load_k(const uint16_t *p, __mmask32 m, const int full)
{
    return full ? _mm512_loadu_si512((const void *)p) : _mm512_maskz_loadu_epi16(m, p);
}

/* One 32-wide step of k for the tile: w rows first, then each x row against them. */
#define NT_ROW(i)                                                                                  \
    if (mr > i) {                                                                                  \
        const __m512i xv = load_k(x + i * ldx + k, km, full);                                      \
        if (nr > 0)                                                                                \
            a##i##0 = dp(a##i##0, xv, w0);                                                         \
        if (nr > 1)                                                                                \
            a##i##1 = dp(a##i##1, xv, w1);                                                         \
        if (nr > 2)                                                                                \
            a##i##2 = dp(a##i##2, xv, w2);                                                         \
        if (nr > 3)                                                                                \
            a##i##3 = dp(a##i##3, xv, w3);                                                         \
        if (nr > 4)                                                                                \
            a##i##4 = dp(a##i##4, xv, w4);                                                         \
        if (nr > 5)                                                                                \
            a##i##5 = dp(a##i##5, xv, w5);                                                         \
    }
#define NT_STEP()                                                                                  \
    do {                                                                                           \
        const __m512i z = _mm512_setzero_si512();                                                  \
        if (pf == NT_PF_AHEAD2)                                                                    \
            for (int p_ = 0; p_ < 6; p_++)                                                         \
                _mm_prefetch((const char *)(w + (NT_PF_AHEAD + p_) * ldw + k), _MM_HINT_T1);       \
        if (pf == NT_PF_LINES && pfrow && ((k >> 5) & pfmask) == 0 &&                              \
            (k >> 5 >> pfshift) < pfcount)                                                         \
            _mm_prefetch((const char *)(pfrow + ((k >> 5 >> pfshift) << 5)), _MM_HINT_T1);         \
        const __m512i w0 = nr > 0 ? load_k(w + k, km, full) : z;                                   \
        const __m512i w1 = nr > 1 ? load_k(w + ldw + k, km, full) : z;                             \
        const __m512i w2 = nr > 2 ? load_k(w + 2 * ldw + k, km, full) : z;                         \
        const __m512i w3 = nr > 3 ? load_k(w + 3 * ldw + k, km, full) : z;                         \
        const __m512i w4 = nr > 4 ? load_k(w + 4 * ldw + k, km, full) : z;                         \
        const __m512i w5 = nr > 5 ? load_k(w + 5 * ldw + k, km, full) : z;                         \
        NT_ROW(0) NT_ROW(1) NT_ROW(2) NT_ROW(3)                                                    \
    } while (0)

/* What a tile fetches while it runs:
 *  - NT_PF_LINES: the run of lines in its nt_pf (NULL: none), into L2;
 *  - NT_PF_AHEAD2: the 6 rows of w NT_PF_AHEAD rows on, at the same k, into L2. */
enum { NT_PF_LINES = 0, NT_PF_AHEAD2 = 1 };

/* What to fetch while a tile runs (NT_PF_LINES): count lines from row, one every 2^shift k
 * steps. */
typedef struct nt_pf {
    const uint16_t *row;
    int shift;
    int64_t count;
} nt_pf;

/* y[0..mr) x [0..nr) (+)= x[0..mr) . w[0..nr)^T over K, mr <= 4, nr <= 6 (compile-time):
 * up to 24 accumulators in named registers; the w rows (NT_COLS of them) stay in L1 while
 * the x rows pass, so 4 x loads (from L2) and 6 w loads feed 24 vdpbf16ps. Output (i, j) is
 * reduced in slot 6 i + j (reduce16 treats every slot alike). */
BF_INLINE void nt_tile(const int mr, const int nr, const int pf, int64_t K, const uint16_t *x,
                       int64_t ldx, const uint16_t *w, int64_t ldw, const nt_pf *lines, float *y,
                       int64_t ldy, int accumulate)
{
    const uint16_t *pfrow = lines ? lines->row : NULL;
    const int pfshift = lines ? lines->shift : 0;
    const int64_t pfmask = ((int64_t)1 << pfshift) - 1, pfcount = lines ? lines->count : 0;
    const __m512 zf = _mm512_setzero_ps();
    __m512 a00 = zf, a01 = zf, a02 = zf, a03 = zf, a04 = zf, a05 = zf;
    __m512 a10 = zf, a11 = zf, a12 = zf, a13 = zf, a14 = zf, a15 = zf;
    __m512 a20 = zf, a21 = zf, a22 = zf, a23 = zf, a24 = zf, a25 = zf;
    __m512 a30 = zf, a31 = zf, a32 = zf, a33 = zf, a34 = zf, a35 = zf;
    int64_t k = 0;
    {
        const int full = 1;
        const __mmask32 km = 0xffffffffu;
        for (; k + 32 <= K; k += 32)
            NT_STEP();
    }
    if (k < K) {
        const int full = 0;
        const __mmask32 km = kt__lanes32(K - k);
        NT_STEP();
    }
    _Alignas(64) float s[32];
    _mm512_store_ps(s, reduce16(a00, a01, a02, a03, a04, a05, a10, a11, a12, a13, a14, a15, a20,
                                a21, a22, a23));
    if (mr > 2)
        _mm512_store_ps(s + 16, reduce16(a24, a25, a30, a31, a32, a33, a34, a35, zf, zf, zf, zf, zf,
                                         zf, zf, zf));
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float *o = y + i * ldy + j;
            *o = accumulate ? *o + s[6 * i + j] : s[6 * i + j];
        }
}
#undef NT_STEP
#undef NT_ROW

/* lines: what to prefetch while the tile runs (NULL: nothing) */
typedef void (*nt_fn)(int64_t K, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                      const nt_pf *lines, float *y, int64_t ldy, int accumulate);

#define NT_VARIANT(MR, NR)                                                                         \
    BF_TARGET static void nt_##MR##x##NR(int64_t K, const uint16_t *x, int64_t ldx,                \
                                         const uint16_t *w, int64_t ldw, const nt_pf *lines,       \
                                         float *y, int64_t ldy, int accumulate)                    \
    {                                                                                              \
        nt_tile(MR, NR, 0, K, x, ldx, w, ldw, lines, y, ldy, accumulate);                          \
    }
NT_VARIANT(4, 6)
NT_VARIANT(4, 4)
NT_VARIANT(4, 2)
NT_VARIANT(4, 1)
NT_VARIANT(3, 6)
NT_VARIANT(3, 4)
NT_VARIANT(3, 2)
NT_VARIANT(3, 1)
NT_VARIANT(2, 6)
NT_VARIANT(2, 4)
NT_VARIANT(2, 2)
NT_VARIANT(2, 1)
NT_VARIANT(1, 6)
NT_VARIANT(1, 4)
NT_VARIANT(1, 2)
NT_VARIANT(1, 1)

/* [row size index][col size index]; rows 4/3/2/1, columns 6/4/2/1. clang (14) spills some of
 * the 24 accumulators of the 4 x 6 tile, so there the widest tile is 4 x 4. */
#ifndef NT_WIDE
#ifdef __clang__
#define NT_WIDE 0
#else
#define NT_WIDE 1
#endif
#endif
/* The first row tile over a block of 6 w rows at 5 to 32 rows of x: it also prefetches the 6
 * rows of the block after next at the same k (NT_PF_AHEAD rows on), so they are on their way
 * two blocks before they are used (with few rows the tile is memory-bound, and 6 streams 4 KiB
 * apart are more than the hardware prefetchers follow well; one block ahead left every load
 * waiting). Into L2, not L1: more lines in flight. Addresses past the last row are only
 * prefetched, never loaded. (Fetching the next block in address order into L1 instead was
 * slower at two or more row tiles a block.) */
#define NT_PF_MAX_M 32
/* nt_<MR>x6<SUFFIX>: the 6-column tile of MR rows that fetches as KIND does */
#define NT_TILE_FETCHING(MR, SUFFIX, KIND)                                                         \
    BF_TARGET static void nt_##MR##x6##SUFFIX(int64_t K, const uint16_t *x, int64_t ldx,           \
                                              const uint16_t *w, int64_t ldw, const nt_pf *lines,  \
                                              float *y, int64_t ldy, int accumulate)               \
    {                                                                                              \
        nt_tile(MR, 6, KIND, K, x, ldx, w, ldw, lines, y, ldy, accumulate);                        \
    }
NT_TILE_FETCHING(4, pf, NT_PF_AHEAD2)
NT_TILE_FETCHING(3, pf, NT_PF_AHEAD2)
NT_TILE_FETCHING(2, pf, NT_PF_AHEAD2)
NT_TILE_FETCHING(1, pf, NT_PF_AHEAD2)
/* [row size index] */
static const nt_fn nt_table_pf[4] = {nt_4x6pf, nt_3x6pf, nt_2x6pf, nt_1x6pf};

static const nt_fn nt_table[4][4] = {{nt_4x6, nt_4x4, nt_4x2, nt_4x1},
                                     {nt_3x6, nt_3x4, nt_3x2, nt_3x1},
                                     {nt_2x6, nt_2x4, nt_2x2, nt_2x1},
                                     {nt_1x6, nt_1x4, nt_1x2, nt_1x1}};

/* The widest column tile for `left` columns: its size, and its index in nt_table */
static int col_index(int64_t left, int *size)
{
    *size = left >= 6 && NT_WIDE ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    return *size == 6 ? 0 : *size == 4 ? 1 : *size == 2 ? 2 : 3;
}

/* Tile t of `tiles` over a block: its share of the lines of the next NT_COLS rows of w
 * (rows 4 KiB apart defeat the hardware prefetchers), as one run within a row, spread
 * evenly over its k steps (a burst of fetches would wait on the miss buffers). */
static nt_pf nt_next_lines(const uint16_t *next, int64_t ldw, int64_t K, int64_t t, int64_t tiles)
{
    const int64_t per_row = (K + 31) / 32, lines = NT_COLS * per_row;
    if (lines == 0 || tiles == 0)
        return (nt_pf){next, 0, 0};
    const int64_t s = t * lines / tiles, row = s / per_row;
    int64_t e = (t + 1) * lines / tiles;
    e = e > (row + 1) * per_row ? (row + 1) * per_row : e;
    nt_pf pf = {next + row * ldw + (s % per_row) * 32, 0, e - s};
    while (pf.count > 0 && ((int64_t)2 << pf.shift) * pf.count <= per_row)
        pf.shift++;
    return pf;
}

/* ---- NT at up to 4 rows of x: one row of w at a time ---------------------------------------- */

/* Up to this many rows of x, nt reads w one row at a time (nt_rows): the kernel then only
 * streams w, and rows read whole in address order are what the hardware prefetchers follow
 * best; the tile's 6 rows of w 4 KiB apart at the same k read memory more slowly, even with
 * the next block fetched in address order. */
#define NT_ROWS_MAX_M KT__BF16_NT_ROWS_MAX_M

/* On Intel the rows' lines are also fetched this many bytes ahead of the loads: the hardware
 * prefetchers alone left the rows path well short of the memory bandwidth (AMD Zen 5 was not,
 * and has not run the fetch: off there). */
#define NT_ROWS_FETCH_BYTES 2048

/* o[i] (o[mr + i]) = the 16-lane sums of x row i . w row wa (wb; NULL: none) over K (i < mr),
 * one accumulator each, the chunks of k in order: the tile's operations, so the tile's bits. */
#define NT_ROW_DP(i, load)                                                                         \
    if (mr > i) {                                                                                  \
        const __m512i xv = load(x + i * ldx + k);                                                  \
        a##i = dp(a##i, xv, wva);                                                                  \
        if (two)                                                                                   \
            b##i = dp(b##i, xv, wvb);                                                              \
    }
#define NT_ROW_STEP(load)                                                                          \
    {                                                                                              \
        if (fetch) {                                                                               \
            _mm_prefetch((const char *)(wa + k) + NT_ROWS_FETCH_BYTES, _MM_HINT_T0);               \
            if (two)                                                                               \
                _mm_prefetch((const char *)(wb + k) + NT_ROWS_FETCH_BYTES, _MM_HINT_T0);           \
        }                                                                                          \
        const __m512i wva = load(wa + k), wvb = two ? load(wb + k) : wva;                          \
        NT_ROW_DP(0, load) NT_ROW_DP(1, load) NT_ROW_DP(2, load) NT_ROW_DP(3, load)                \
    }
#define NT_FULL_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define NT_TAIL_LOAD(p) _mm512_maskz_loadu_epi16(km, (p))
BF_INLINE void nt_row_dots(const int mr, const int two, int fetch, int64_t K, const uint16_t *x,
                           int64_t ldx, const uint16_t *wa, const uint16_t *wb, __m512 *o)
{
    const __m512 zf = _mm512_setzero_ps();
    __m512 a0 = zf, a1 = zf, a2 = zf, a3 = zf, b0 = zf, b1 = zf, b2 = zf, b3 = zf;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
        NT_ROW_STEP(NT_FULL_LOAD)
    if (k < K) {
        const __mmask32 km = kt__lanes32(K - k);
        NT_ROW_STEP(NT_TAIL_LOAD)
    }
    const __m512 all[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    for (int i = 0; i < mr; i++) {
        o[i] = all[i];
        if (two)
            o[mr + i] = all[4 + i];
    }
}
#undef NT_ROW_STEP
#undef NT_ROW_DP
#undef NT_FULL_LOAD
#undef NT_TAIL_LOAD

/* Rows of w at a time: y[0..mr) x [0..nw) (+)= x . wa^T (nw <= 16 / mr) and, with two, the same
 * for nw rows of wb into yb (nw <= 8 / mr); each row read whole before the next (in address
 * order, which the hardware prefetchers follow; the tile's 6 rows 4 KiB apart at the same k
 * left them behind), row j of wa and of wb side by side, their dot products in slots
 * (1 + two) mr j + i and, of wb, 2 mr j + mr + i, all 16 reduced together by the tile's tree. */
BF_INLINE void nt_rows_block(const int mr, const int two, int fetch, int64_t K, const uint16_t *x,
                             int64_t ldx, const uint16_t *wa, const uint16_t *wb, int64_t ldw,
                             int nw, float *ya, float *yb, int64_t ldy, int accumulate)
{
    const __m512 zf = _mm512_setzero_ps();
    __m512 s[16];
    for (int i = 0; i < 16; i++)
        s[i] = zf;
    for (int j = 0; j < 16 / (1 + two) / mr; j++)
        if (j < nw)
            nt_row_dots(mr, two, fetch, K, x, ldx, wa + j * ldw, two ? wb + j * ldw : NULL,
                        s + (1 + two) * mr * j);
    _Alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10],
                                s[11], s[12], s[13], s[14], s[15]));
    for (int h = 0; h < 1 + two; h++) {
        float *y = h ? yb : ya;
        for (int j = 0; j < nw; j++)
            for (int i = 0; i < mr; i++) {
                float *o = y + i * ldy + j;
                const float v = r[(1 + two) * mr * j + h * mr + i];
                *o = accumulate ? *o + v : v;
            }
    }
}

typedef void (*nt_rows_fn)(int fetch, int64_t K, const uint16_t *x, int64_t ldx, const uint16_t *wa,
                           const uint16_t *wb, int64_t ldw, int nw, float *ya, float *yb,
                           int64_t ldy, int accumulate);
#define NT_ROWS_VARIANT(MR, TWO, NAME)                                                             \
    BF_TARGET static void NAME(int fetch, int64_t K, const uint16_t *x, int64_t ldx,               \
                               const uint16_t *wa, const uint16_t *wb, int64_t ldw, int nw,        \
                               float *ya, float *yb, int64_t ldy, int accumulate)                  \
    {                                                                                              \
        nt_rows_block(MR, TWO, fetch, K, x, ldx, wa, wb, ldw, nw, ya, yb, ldy, accumulate);        \
    }
NT_ROWS_VARIANT(1, 0, nt_rows_1)
NT_ROWS_VARIANT(2, 0, nt_rows_2)
NT_ROWS_VARIANT(3, 0, nt_rows_3)
NT_ROWS_VARIANT(4, 0, nt_rows_4)
NT_ROWS_VARIANT(1, 1, nt_rows2_1)
NT_ROWS_VARIANT(2, 1, nt_rows2_2)
/* [two streams][rows of x] (two streams up to NT_TWO_STREAMS_MAX_M rows) */
static const nt_rows_fn nt_rows_table[2][NT_ROWS_MAX_M + 1] = {
    {NULL, nt_rows_1, nt_rows_2, nt_rows_3, nt_rows_4}, {NULL, nt_rows2_1, nt_rows2_2, NULL, NULL}};

/* nt_row_dots keeps 4 accumulators a stream; M >= 1 (kt__bf16_gemm_nt_next returns before for
 * M <= 0) */
_Static_assert(NT_ROWS_MAX_M == 4, "nt_rows has variants and accumulators for 1 to 4 rows");

/* Up to this many rows of x nt_rows reads the columns' rows of w as two halves side by side:
 * one row of x leaves each row's vdpbf16ps one chain, which two streams double. At 3 and 4
 * rows two streams were slower. */
#define NT_TWO_STREAMS_MAX_M 2
_Static_assert(NT_TWO_STREAMS_MAX_M <= 2, "nt_rows_table has two-stream variants for 1 and 2 rows");

/* w's rows [n0, n1): at up to NT_TWO_STREAMS_MAX_M rows of x as two halves side by side (the
 * odd one left last, alone), else one after the other. */
static void nt_rows(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                    const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    const int fetch = kt__cpu_is_intel(); /* NT_ROWS_FETCH_BYTES */
    const int64_t h = M <= NT_TWO_STREAMS_MAX_M ? (n1 - n0) / 2 : 0;
    for (int64_t j = 0, step = 8 / M; j < h; j += step) { /* 16 slots: step rows of each half */
        const int nw = h - j < step ? (int)(h - j) : (int)step;
        nt_rows_table[1][M](fetch, K, x, ldx, w + (n0 + j) * ldw, w + (n0 + h + j) * ldw, ldw, nw,
                            y + n0 + j, y + n0 + h + j, ldy, accumulate);
    }
    const int per = 16 / (int)M;
    for (int64_t n = n0 + 2 * h; n < n1; n += per) {
        const int nw = n1 - n < per ? (int)(n1 - n) : per;
        nt_rows_table[0][M](fetch, K, x, ldx, w + n * ldw, NULL, ldw, nw, y + n, NULL, ldy,
                            accumulate);
    }
}

static void nt_avx512(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                      const uint16_t *w, int64_t ldw, const uint16_t *next, float *y, int64_t ldy,
                      int accumulate)
{
    if (M <= NT_ROWS_MAX_M) {
        nt_rows(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        return;
    }
    /* x in as few row chunks of equal size as fit NT_X_CHUNK_BYTES: each chunk streams all
     * of w once more, so splitting 96 rows as 64 + 32 would read w twice for nothing */
    int64_t mc = K > 0 ? NT_X_CHUNK_BYTES / (2 * K) : M;
    mc = mc < 4 ? 4 : mc;
    const int64_t nchunks = (M + mc - 1) / mc;
    mc = (M + nchunks - 1) / nchunks;
    mc = (mc + 3) & ~(int64_t)3;
    const int small = M <= NT_PF_MAX_M;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m1 = M - m0 < mc ? M : m0 + mc;
        const int64_t len = m1 - m0, tiles = (len + 3) / 4;
        for (int64_t n = n0; n < n1;) {
            int nr;
            const int ci = col_index(n1 - n, &nr);
            int64_t t = 0;
            for (int64_t m = m0; m < m1; t++) {
                const int mr = balanced_height(len, 4, t);
                const int ri = 4 - mr;
                const nt_fn fn = ci == 0 && m == m0 && small ? nt_table_pf[ri] : nt_table[ri][ci];
                /* Above 32 rows the next block's rows of w come in over this block's row
                 * tiles, into L2: after the last block, the first of the next row chunk, or
                 * the rows the caller reads next (addresses past the end of w are only
                 * prefetched). From 5 to 32 rows the first tile fetches two blocks ahead on
                 * its own (nt_table_pf). */
                const uint16_t *nx = n + nr < n1 ? w + (n + nr) * ldw
                                     : m1 < M    ? w + n0 * ldw
                                                 : next;
                const nt_pf lines =
                    small ? (nt_pf){NULL, 0, 0} : nt_next_lines(nx, ldw, K, t, tiles);
                fn(K, x + m * ldx, ldx, w + n * ldw, ldw, small ? NULL : &lines, y + m * ldy + n,
                   ldy, accumulate);
                m += mr;
            }
            n += nr;
        }
    }
}

void kt__bf16_nt_dpbf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                        int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                        float *y, int64_t ldy, int accumulate)
{
    nt_avx512(M, n0, n1, K, x, ldx, w, ldw, next ? next : w + n1 * ldw, y, ldy, accumulate);
}

#endif
