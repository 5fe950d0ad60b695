/* The bf16 NN kernels on AVX-512 BF16 (vdpbf16ps): y = g w (and NN2: two products, one sum)
 * (see bf16_gemm.h and, for the summation order, bf16_nt_dpbf16.c).
 *
 * Kernels (register tiles, accumulators in zmm registers over a whole reduction or chunk):
 *  - NN y = g w: the B operand pairs rows n, n+1 of w (unpacklo/hi_epi16, which leaves the
 *    32 columns of a block permuted within the two accumulators; undone at the store), the
 *    A operand is the 32-bit pair (g[m,n], g[m,n+1]) broadcast; up to 12 rows of g x 32
 *    columns per tile (24 accumulators). w's row pairs are interleaved into a stack buffer
 *    once per chunk of the reduction and used by every row tile; the accumulators are
 *    carried between chunks in a stack buffer. A chunk covers a group of up to 128 columns,
 *    each row of w read as one run ("rows" path, nn_rows_avx512), the next chunk's lines
 *    fetched during this one's tiles; a call takes up to 512 rows of g, more run in chunks
 *    of rows. Up to 16 rows of g ("stream" path, nn_stream) the kernel only streams w: each
 *    pair of rows is read whole in address order, the accumulators in a stack buffer (from 6
 *    rows kept in registers over groups of 8 pairs, above 12 rows as two tiles).
 * Rows of w (and x for TN) that are 4 KiB apart all fall in one L1 set; where a kernel walks
 * a column block down many rows it prefetches what comes next into L2 (the next chunk's
 * rows, or along the row). The kernels use up to 128 KiB of stack (the NN rows path). They
 * are fastest with 64-byte aligned operands and leading dimensions that are multiples of 32
 * elements (rows then start on cache lines). */
#include <string.h>

#include "lib/kernels/bf16_dpbf16.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/bf16_pair_dpbf16.h"
#include "lib/kernels/lane_mask.h"
#include "lib/kernels/prefetch.h"

#ifdef KT__DPBF16_COMPILED

/* The NN rows path's tiles over one chunk of pairs and one packed 32-column block: `tiles`
 * tiles of MR rows (tile t's rows of g from a + t MR a_row, its accumulators at
 * accbuf + t MR 32, its output rows from out + t MR ldo), each from zero (first) or its
 * accumulators, then back to them or, after the last chunk, out (through store_general). */
typedef void (*nn_run_fn)(int64_t np, int tail, const uint16_t *a, int64_t a_row, int64_t tiles,
                          const uint16_t *b, __mmask32 jm, pf_walk *pf, float *accbuf, int first,
                          int last, float *out, int64_t ldo, int mode);

BF_INLINE void nn_tiles(const int mr, const int first, int64_t np, int tail, const uint16_t *a,
                        int64_t a_row, int64_t tiles, const uint16_t *b, __mmask32 jm, pf_walk *pf,
                        float *accbuf, int last, float *out, int64_t ldo, int mode)
{
    for (int64_t t = 0; t < tiles; t++) {
        float *ab = accbuf + t * mr * 32;
        __m512 acc[PAIR_MR][2];
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2; h++)
                acc[i][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ab + 32 * i + 16 * h);
        pair_tile(mr, B_PACKED, np, tail, a + t * mr * a_row, a_row, 2, b, 0, jm, pf, acc);
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2; h++)
                _mm512_storeu_ps(ab + 32 * i + 16 * h, acc[i][h]);
        if (last)
            store_general(mr, 0, ab, jm, out + t * mr * ldo, ldo, mode, 1.0f);
    }
}

#define NN_RUN_VARIANT(MR)                                                                         \
    BF_TARGET static void nn_run_##MR(int64_t np, int tail, const uint16_t *a, int64_t a_row,      \
                                      int64_t tiles, const uint16_t *b, __mmask32 jm, pf_walk *pf, \
                                      float *accbuf, int first, int last, float *out, int64_t ldo, \
                                      int mode)                                                    \
    {                                                                                              \
        if (first)                                                                                 \
            nn_tiles(MR, 1, np, tail, a, a_row, tiles, b, jm, pf, accbuf, last, out, ldo, mode);   \
        else                                                                                       \
            nn_tiles(MR, 0, np, tail, a, a_row, tiles, b, jm, pf, accbuf, last, out, ldo, mode);   \
    }
EACH_TILE_HEIGHT(NN_RUN_VARIANT)

static const nn_run_fn nn_run_fns[PAIR_MR + 1] = TILE_HEIGHT_TABLE(nn_run_);

/* NN "by rows": the reduction runs in chunks of row pairs, and a chunk's pairs
 * are packed for a whole group of columns at once, each row of w read as one contiguous run
 * of the group's width (nn_pack_rows), the lines of the next pack fetched while the tiles
 * of this one run (nn_next_pack); the group's accumulators are carried between chunks in
 * accbuf. One call takes up to NN_ROWS_MAX_M rows (the accumulators of a 32-column group fit
 * accbuf); more are cut into chunks of rows (nn_rows_chunked). */
#define NN_ROWS_PAIRS 128        /* row pairs per chunk (half that below NN_SHORT_M rows) */
#define NN_SHORT_M 24            /* weight-streaming sizes: shorter chunks */
#define NN_ROWS_WIDTH 128        /* columns per group, at most */
#define NN_ROWS_ACC_FLOATS 16384 /* 64 KiB: M x width accumulators */
#define NN_ROWS_MAX_M (NN_ROWS_ACC_FLOATS / 32)

/* Pairs [p0, p0 + cnt) of w's rows over columns [0, cols) (cols <= NN_ROWS_WIDTH), row by
 * row: block b's pair q at bp + (b NN_ROWS_PAIRS + q) 64. */
BF_TARGET static void nn_pack_rows(const uint16_t *w, int64_t ldw, int64_t N, int64_t p0,
                                   int64_t cnt, int64_t cols, uint16_t *bp)
{
    for (int64_t q = 0; q < cnt; q++) {
        const int64_t n = 2 * (p0 + q);
        const uint16_t *r0p = w + n * ldw, *r1p = w + (n + 1) * ldw;
        for (int64_t b = 0; b * 32 < cols; b++) {
            const __mmask32 jm = kt__lanes32(cols - b * 32);
            const __m512i r0 = _mm512_maskz_loadu_epi16(jm, r0p + 32 * b);
            const __m512i r1 =
                n + 1 < N ? _mm512_maskz_loadu_epi16(jm, r1p + 32 * b) : _mm512_setzero_si512();
            uint16_t *o = bp + 64 * (b * NN_ROWS_PAIRS + q);
            _mm512_store_si512((void *)o, _mm512_unpacklo_epi16(r0, r1));
            _mm512_store_si512((void *)(o + 32), _mm512_unpackhi_epi16(r0, r1));
        }
    }
}

/* The walk over the lines of the rows the next pack reads (this group's next chunk of pairs,
 * or the next group's first; rows past N are not fetched), spread over `steps` pair steps. */
static pf_walk nn_next_pack(const uint16_t *w, int64_t ldw, int64_t N, int64_t r0, int64_t rows,
                            int64_t c0, int64_t cols, int64_t steps)
{
    pf_walk pf = {w + r0 * ldw + c0, ldw, (cols + 31) / 32, 0, 0, 1};
    rows = r0 + rows > N ? N - r0 : rows;
    pf.left = cols > 0 && rows > 0 ? rows * pf.per_row : 0;
    pf.every = pf.left > 0 && steps / pf.left > 1 ? steps / pf.left : 1;
    return pf;
}

/* The NN "rows" path over one or two operand pairs: y = g0 w0 (+ g1 w1), the second pair's
 * chunks continuing the first's accumulators, so y is written once. */
typedef struct nn_src {
    const uint16_t *g, *w;
} nn_src;

static void nn_rows_avx512(int64_t M, int64_t N, int64_t k0, int64_t k1, const nn_src *src,
                           int nsrc, int64_t ldg, int64_t ldw, float *y, int64_t ldy, int mode)
{
    _Alignas(64) float accbuf[NN_ROWS_ACC_FLOATS];
    _Alignas(64) uint16_t bpack[NN_ROWS_WIDTH / 32 * NN_ROWS_PAIRS * 64];
    const int64_t pairs = (N + 1) / 2;
    const int64_t chunk_pairs = M < NN_SHORT_M ? NN_ROWS_PAIRS / 2 : NN_ROWS_PAIRS;
    const int64_t chunks = (pairs + chunk_pairs - 1) / chunk_pairs;
    const int64_t steps = nsrc * (chunks > 0 ? chunks : 1);
    int64_t width = (NN_ROWS_ACC_FLOATS / M) & ~(int64_t)31; /* M <= NN_ROWS_MAX_M: >= 32 */
    width = width > NN_ROWS_WIDTH ? NN_ROWS_WIDTH : width;
    for (int64_t j0 = k0; j0 < k1; j0 += width) {
        const int64_t cols = k1 - j0 < width ? k1 - j0 : width;
        for (int64_t sc = 0; sc < steps; sc++) {
            const int s = (int)(sc / (steps / nsrc));
            const int64_t c = sc % (steps / nsrc);
            const uint16_t *g = src[s].g, *w = src[s].w;
            const int64_t p0 = c * chunk_pairs;
            const int64_t cnt = pairs - p0 < chunk_pairs ? pairs - p0 : chunk_pairs;
            const int last_of_src = c + 1 >= chunks, last = sc + 1 >= steps;
            const int tail = last_of_src && (N & 1);
            nn_pack_rows(w + j0, ldw, N, p0, cnt, cols, bpack);
            /* the next pack: this source's next chunk, the next source's first, or the next
             * column group's first (after the last group, the columns after k1: a caller
             * walking w in column steps, as the layer's ga does, reads them next) */
            const uint16_t *nx_w = last_of_src ? src[last ? 0 : s + 1].w : w;
            const int64_t nx_c0 = last ? j0 + width : j0;
            const int64_t nx_cols = last ? width : cols;
            pf_walk pf = nn_next_pack(
                nx_w, ldw, N, last_of_src ? 0 : 2 * (p0 + cnt), 2 * chunk_pairs, nx_c0, nx_cols,
                (cnt - tail) * ((cols + 31) / 32) * ((M + PAIR_MR - 1) / PAIR_MR));
            for (int64_t b = 0; b * 32 < cols; b++) {
                const __mmask32 jm = kt__lanes32(cols - b * 32);
                float *acc = accbuf + b * 32 * M;
                /* the tiles as runs of equal height (balanced heights: at most two) */
                for (int64_t m = 0, i = 0; m < M;) {
                    const int mr = tile_height(M, i);
                    int64_t run = 1;
                    while (m + run * mr < M && tile_height(M, i + run) == mr)
                        run++;
                    nn_run_fns[mr](cnt - tail, tail, g + m * ldg + 2 * p0, ldg, run,
                                   bpack + 64 * b * NN_ROWS_PAIRS, jm, &pf, acc + m * 32, sc == 0,
                                   last, y + m * ldy + j0 + 32 * b, ldy, mode);
                    m += run * mr;
                    i += run;
                }
            }
            while (pf.left > 0)
                pf_walk_next(&pf);
        }
    }
}

/* More than NN_ROWS_MAX_M rows go through the rows path in balanced chunks of rows (a row's
 * sums do not depend on the other rows, so the bits are those of one call; each chunk streams
 * w once more), faster than walking one 32-column block down all the rows. */
static void nn_rows_chunked(int64_t M, int64_t N, int64_t k0, int64_t k1, const nn_src *src,
                            int nsrc, int64_t ldg, int64_t ldw, float *y, int64_t ldy, int mode)
{
    const int64_t chunks = (M + NN_ROWS_MAX_M - 1) / NN_ROWS_MAX_M;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * M / chunks, r1 = (c + 1) * M / chunks;
        nn_src part[2];
        for (int s = 0; s < nsrc; s++)
            part[s] = (nn_src){src[s].g + r0 * ldg, src[s].w};
        nn_rows_avx512(r1 - r0, N, k0, k1, part, nsrc, ldg, ldw, y + r0 * ldy, ldy, mode);
    }
}

/* NN at a few rows ("stream" path): with M <= NN_STREAM_MAX_M the kernel only streams w, and
 * the rows path's walk (a group of up to 128 columns down every row, rows 4 KiB apart) left the
 * prefetchers behind (half the rate at which x W^T streams the same weights). Here each pair of w's rows is read whole, over all the
 * call's columns (a pass takes as many as M x columns accumulators fit: NN_STREAM_ACC_FLOATS,
 * in L1, up to NN_GROUP_TILE rows, NN_GROUP_ACC_FLOATS, in L2, above), in address order, the
 * pair NN_STREAM_AHEAD_BYTES(M) on fetched into L1 as it goes. Below NN_GROUP_MIN_M rows the
 * accumulators are loaded and stored around each vdpbf16ps; from there they stay in
 * registers over a group of pairs (nn_stream_group). Every element still accumulates the pairs
 * of every source in order from zero, the tail last, so the bits are those of the rows path.
 * Up to 16 rows it beats the rows path (two row tiles a column block above 12); above, it does
 * not. The fetch distance (NN_STREAM_AHEAD_BYTES, at least one pair, at most
 * NN_STREAM_AHEAD_MAX pairs) grows with the rows: more compute a pair. */
#define NN_STREAM_MAX_M KT__BF16_NN_STREAM_MAX_M
#define NN_STREAM_ACC_FLOATS 6144 /* 24 KiB */
#define NN_STREAM_AHEAD_BYTES(mr) (4096 * ((mr) + 1))
#define NN_STREAM_AHEAD_MAX 32 /* pairs: narrow calls fetch no further than 64 rows on */

/* The rows of global pair q (the pairs of src[0], then of src[1]) that a fetch ahead reads:
 * NULL past the last source; *r1 NULL where the pair is the tail (one row). */
static const uint16_t *nn_stream_pair_rows(const nn_src *src, int nsrc, int64_t N, int64_t ldw,
                                           int64_t q, const uint16_t **r1)
{
    const int64_t per_src = (N + 1) / 2;
    const int64_t s = q / per_src, p = q % per_src;
    if (s >= nsrc) {
        *r1 = NULL;
        return NULL;
    }
    const uint16_t *r0 = src[s].w + 2 * p * ldw;
    *r1 = 2 * p + 1 < N ? r0 + ldw : NULL;
    return r0;
}

/* acc (block b's rows at acc + 32 (b mr + i)) += pair (r0, r1; r1 NULL: a zero partner) for
 * columns [0, cols), A operands av; the same columns of rows f0, f1 fetched (NULL: none). */
BF_INLINE void nn_stream_step(const int mr, const uint16_t *r0, const uint16_t *r1,
                              const uint16_t *f0, const uint16_t *f1, const __m512i *av,
                              int64_t cols, float *acc)
{
    for (int64_t b = 0; b * 32 < cols; b++) {
        const __mmask32 jm = cols - 32 * b >= 32 ? 0xffffffffu : kt__lanes32(cols - 32 * b);
        if (f0 != NULL)
            _mm_prefetch((const char *)(f0 + 32 * b), _MM_HINT_T0);
        if (f1 != NULL)
            _mm_prefetch((const char *)(f1 + 32 * b), _MM_HINT_T0);
        const __m512i w0 = _mm512_maskz_loadu_epi16(jm, r0 + 32 * b);
        const __m512i w1 =
            r1 != NULL ? _mm512_maskz_loadu_epi16(jm, r1 + 32 * b) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(w0, w1), hi = _mm512_unpackhi_epi16(w0, w1);
        float *ab = acc + 32 * b * mr;
        for (int i = 0; i < mr; i++) {
            _mm512_store_ps(ab + 32 * i, dp(_mm512_load_ps(ab + 32 * i), av[i], lo));
            _mm512_store_ps(ab + 32 * i + 16, dp(_mm512_load_ps(ab + 32 * i + 16), av[i], hi));
        }
    }
}

/* Groups of pairs (nn_group_block, nn_stream_group). From NN_GROUP_MIN_M rows the accumulators'
 * loads and stores around every pair were the limit, hot or not; they are kept in registers over
 * a group of 8 pairs (mr <= 12: 24 of them; 4 pairs a group were slower). */
#define NN_GROUP_PAIRS 8
#define NN_GROUP_MIN_M 6
#define NN_GROUP_TILE 12 /* rows of accumulators in registers; more run as two tiles */
/* Accumulators above NN_GROUP_TILE rows: 64 KiB (in L2; loaded and stored once a group), so
 * that a pass is still a few hundred columns wide; at most 12 rows 24 KiB (in L1) is faster. */
#define NN_GROUP_ACC_FLOATS 16384
/* One tile of th <= NN_GROUP_TILE rows over one 32-column block (masked by jm) of the group's
 * pairs of rows from rb (row n at rb + n ldw): accumulators from ab (row i at ab + 32 i), in
 * registers over the group, back to ab. */
BF_INLINE void nn_group_block(const int th, const uint16_t *rb, int64_t ldw, const uint16_t *g,
                              int64_t ldg, __mmask32 jm, float *ab)
{
    __m512 a[2 * NN_GROUP_TILE];
    for (int i = 0; i < th; i++) {
        a[2 * i] = _mm512_load_ps(ab + 32 * i);
        a[2 * i + 1] = _mm512_load_ps(ab + 32 * i + 16);
    }
    for (int q = 0; q < NN_GROUP_PAIRS; q++) {
        const uint16_t *rq = rb + 2 * q * ldw;
        const __m512i w0 = _mm512_maskz_loadu_epi16(jm, rq);
        const __m512i w1 = _mm512_maskz_loadu_epi16(jm, rq + ldw);
        const __m512i lo = _mm512_unpacklo_epi16(w0, w1), hi = _mm512_unpackhi_epi16(w0, w1);
        for (int i = 0; i < th; i++) {
            const __m512i av = _mm512_set1_epi32((int)ld32(g + i * ldg + 2 * q));
            a[2 * i] = dp(a[2 * i], av, lo);
            a[2 * i + 1] = dp(a[2 * i + 1], av, hi);
        }
    }
    for (int i = 0; i < th; i++) {
        _mm512_store_ps(ab + 32 * i, a[2 * i]);
        _mm512_store_ps(ab + 32 * i + 16, a[2 * i + 1]);
    }
}

/* acc (as nn_stream_step) += NN_GROUP_PAIRS pairs of full rows from r0, their A operands the
 * 32-bit pairs at g + i ldg + 2 q; the same columns of rows f[0..2 NN_GROUP_PAIRS) fetched
 * (f or an entry NULL: none). Above NN_GROUP_TILE rows, two tiles a block, the second reading
 * the block's lines of the group's rows from L1 right after the first. */
BF_INLINE void nn_stream_group(const int mr, const uint16_t *r0, int64_t ldw, const uint16_t *g,
                               int64_t ldg, const uint16_t *const *f, int64_t cols, float *acc)
{
    const int h = mr <= NN_GROUP_TILE ? mr : (mr + 1) / 2;
    for (int64_t b = 0; b * 32 < cols; b++) {
        const __mmask32 jm = cols - 32 * b >= 32 ? 0xffffffffu : kt__lanes32(cols - 32 * b);
        for (int r = 0; f != NULL && r < 2 * NN_GROUP_PAIRS; r++)
            if (f[r] != NULL)
                _mm_prefetch((const char *)(f[r] + 32 * b), _MM_HINT_T0);
        float *ab = acc + 32 * b * mr;
        nn_group_block(h, r0 + 32 * b, ldw, g, ldg, jm, ab);
        if (mr > h)
            nn_group_block(mr - h, r0 + 32 * b, ldw, g + h * ldg, ldg, jm, ab + 32 * h);
    }
}

BF_INLINE void nn_stream(const int mr, int64_t N, int64_t k0, int64_t k1, const nn_src *src,
                         int nsrc, int64_t ldg, int64_t ldw, float *y, int64_t ldy, int mode)
{
    _Alignas(64) float acc[NN_GROUP_ACC_FLOATS];
    /* columns a pass: as few passes as the accumulators allow, of equal widths */
    const int64_t acc_floats = mr <= NN_GROUP_TILE ? NN_STREAM_ACC_FLOATS : NN_GROUP_ACC_FLOATS;
    const int64_t max_width = (acc_floats / mr) & ~(int64_t)31;
    const int64_t passes = (k1 - k0 + max_width - 1) / max_width;
    const int64_t width = passes > 0 ? ((k1 - k0 + passes - 1) / passes + 31) & ~(int64_t)31 : 1;
    const int64_t per_src = (N + 1) / 2;
    for (int64_t j0 = k0; j0 < k1; j0 += width) {
        const int64_t cols = k1 - j0 < width ? k1 - j0 : width;
        memset(acc, 0, (size_t)((cols + 31) / 32 * 32 * mr) * sizeof *acc);
        /* pairs ahead: the bytes ahead over a pair's (two rows of cols bf16) */
        int64_t ahead = NN_STREAM_AHEAD_BYTES(mr) / (4 * cols);
        ahead = ahead < 1 ? 1 : ahead > NN_STREAM_AHEAD_MAX ? NN_STREAM_AHEAD_MAX : ahead;
        for (int64_t q = 0; q < nsrc * per_src; q++) {
            const int s = (int)(q / per_src);
            const int64_t p = q % per_src;
            const uint16_t *g = src[s].g;
            if (mr >= NN_GROUP_MIN_M && p + NN_GROUP_PAIRS <= N / 2) { /* a group of full pairs */
                const uint16_t *f[2 * NN_GROUP_PAIRS];
                for (int j = 0; j < NN_GROUP_PAIRS; j++) {
                    const uint16_t *f1;
                    const uint16_t *f0 = nn_stream_pair_rows(src, nsrc, N, ldw, q + ahead + j, &f1);
                    f[2 * j] = f0 != NULL ? f0 + j0 : NULL;
                    f[2 * j + 1] = f1 != NULL ? f1 + j0 : NULL;
                }
                nn_stream_group(mr, src[s].w + 2 * p * ldw + j0, ldw, g + 2 * p, ldg, f, cols, acc);
                q += NN_GROUP_PAIRS - 1;
                continue;
            }
            __m512i av[NN_STREAM_MAX_M];
            for (int i = 0; i < mr; i++) /* the tail's single value: a pair with a zero partner */
                av[i] = _mm512_set1_epi32(2 * p + 1 < N ? (int)ld32(g + i * ldg + 2 * p)
                                                        : (int)g[i * ldg + 2 * p]);
            const uint16_t *r1, *f1;
            const uint16_t *r0 = nn_stream_pair_rows(src, nsrc, N, ldw, q, &r1);
            const uint16_t *f0 = nn_stream_pair_rows(src, nsrc, N, ldw, q + ahead, &f1);
            nn_stream_step(mr, r0 + j0, r1 != NULL ? r1 + j0 : NULL, f0 != NULL ? f0 + j0 : NULL,
                           f1 != NULL ? f1 + j0 : NULL, av, cols, acc);
        }
        for (int64_t b = 0; b * 32 < cols; b++) /* store_general takes up to PAIR_MR rows */
            for (int i0 = 0; i0 < mr; i0 += PAIR_MR)
                store_general(mr - i0 < PAIR_MR ? mr - i0 : PAIR_MR, 0, acc + 32 * (b * mr + i0),
                              kt__lanes32(cols - 32 * b), y + i0 * ldy + j0 + 32 * b, ldy, mode,
                              1.0f);
    }
}

#define NN_STREAM_VARIANT(MR)                                                                      \
    BF_TARGET static void nn_stream_##MR(int64_t N, int64_t k0, int64_t k1, const nn_src *src,     \
                                         int nsrc, int64_t ldg, int64_t ldw, float *y,             \
                                         int64_t ldy, int mode)                                    \
    {                                                                                              \
        nn_stream(MR, N, k0, k1, src, nsrc, ldg, ldw, y, ldy, mode);                               \
    }
NN_STREAM_VARIANT(1)
NN_STREAM_VARIANT(2)
NN_STREAM_VARIANT(3)
NN_STREAM_VARIANT(4)
NN_STREAM_VARIANT(5)
NN_STREAM_VARIANT(6)
NN_STREAM_VARIANT(7)
NN_STREAM_VARIANT(8)
NN_STREAM_VARIANT(9)
NN_STREAM_VARIANT(10)
NN_STREAM_VARIANT(11)
NN_STREAM_VARIANT(12)
NN_STREAM_VARIANT(13)
NN_STREAM_VARIANT(14)
NN_STREAM_VARIANT(15)
NN_STREAM_VARIANT(16)

/* NN over one or two operand pairs: the stream path at a few rows, else the rows path. */
static void nn_avx512(int64_t M, int64_t N, int64_t k0, int64_t k1, const nn_src *src, int nsrc,
                      int64_t ldg, int64_t ldw, float *y, int64_t ldy, int mode)
{
    typedef void (*stream_fn)(int64_t, int64_t, int64_t, const nn_src *, int, int64_t, int64_t,
                              float *, int64_t, int);
    static const stream_fn streams[NN_STREAM_MAX_M + 1] = {
        NULL,         nn_stream_1,  nn_stream_2,  nn_stream_3,  nn_stream_4,  nn_stream_5,
        nn_stream_6,  nn_stream_7,  nn_stream_8,  nn_stream_9,  nn_stream_10, nn_stream_11,
        nn_stream_12, nn_stream_13, nn_stream_14, nn_stream_15, nn_stream_16};
    if (M <= NN_STREAM_MAX_M)
        streams[M](N, k0, k1, src, nsrc, ldg, ldw, y, ldy, mode);
    else
        nn_rows_chunked(M, N, k0, k1, src, nsrc, ldg, ldw, y, ldy, mode);
}

void kt__bf16_nn_dpbf16(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g,
                        int64_t ldg, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                        int accumulate)
{
    const nn_src src = {g, w};
    nn_avx512(M, N, k0, k1, &src, 1, ldg, ldw, y, ldy, accumulate ? OUT_ADD : OUT_STORE);
}

void kt__bf16_nn2_dpbf16(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                         const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                         int64_t ldw, float *y, int64_t ldy, int stream)
{
    const nn_src src[2] = {{g0, w0}, {g1, w1}};
    /* scaling by 1 is exact: the stored bits are those of a plain store */
    nn_avx512(M, N, k0, k1, src, 2, ldg, ldw, y, ldy, stream ? OUT_SCALE_STREAM : OUT_STORE);
    if (stream) /* the streamed lines visible to the next reader, as tn does */
        _mm_sfence();
}

#endif
