/* The bf16 NN and TN kernels on AVX-512 BF16 (vdpbf16ps): y = g w and dw += scale g^T x
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
 *  - TN dw += scale g^T x: the same tile with x's row pairs as B and the pairs (g[m,n],
 *    g[m+1,n]) as A, packed per tile of 12 rows n (x's pairs are also packed once per column
 *    block, shared by up to 64 row tiles); the buffers are on the stack up to 512 rows of x,
 *    on the heap above.
 * Rows of w (and x for TN) that are 4 KiB apart all fall in one L1 set; where a kernel walks
 * a column block down many rows it prefetches what comes next into L2 (the next chunk's
 * rows, or along the row). The kernels use up to 128 KiB of stack (the NN rows path). They
 * are fastest with 64-byte aligned operands and leading dimensions that are multiples of 32
 * elements (rows then start on cache lines). */
#include <string.h>

#include "kernels/bf16_dpbf16.h"
#include "kernels/bf16_gemm.h"
#include "kernels/fma_gemm.h"
#include "kernels/lane_mask.h"
#include "kernels/prefetch.h"

#ifdef KT__DPBF16_COMPILED

/* ---- NN and TN: pairs along the reduced dimension ------------------------------------------- */

#define PAIR_MR 12
/* The pair kernels come in one variant per tile height 1..PAIR_MR (the height fixes the
 * accumulators' count at compile time); these instantiate them and list them by height. */
#define EACH_TILE_HEIGHT(VARIANT)                                                                  \
    VARIANT(12)                                                                                    \
    VARIANT(11)                                                                                    \
    VARIANT(10)                                                                                    \
    VARIANT(9)                                                                                     \
    VARIANT(8) VARIANT(7) VARIANT(6) VARIANT(5) VARIANT(4) VARIANT(3) VARIANT(2) VARIANT(1)
#define TILE_HEIGHT_TABLE(prefix)                                                                  \
    {                                                                                              \
        NULL, prefix##1, prefix##2, prefix##3, prefix##4, prefix##5, prefix##6, prefix##7,         \
            prefix##8, prefix##9, prefix##10, prefix##11, prefix##12                               \
    }
#define TN_PAIRS_PER_CHUNK 1024 /* 12 x 1024 packed pairs = 48 KiB of stack */

static uint32_t ld32(const uint16_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* OUT_SCALE_STREAM: scale, then store bypassing the caches where a block is whole and aligned
 * (weight gradients: megabytes per expert written once and next read by the optimizer; a
 * plain store would first read every line in) */
enum { OUT_STORE = 0, OUT_ADD = 1, OUT_SCALE_ADD = 2, OUT_SCALE_STREAM = 3 };
/* where the B pairs come from: two rows of b (all 32 columns, or masked), or a buffer of
 * interleaved pairs (64 bf16 a pair: the unpacklo half, then the unpackhi half) */
enum { B_ROWS_MASKED = 0, B_ROWS_FULL = 1, B_PACKED = 2 };
#define B_PREFETCH 128  /* elements ahead along a row of b (4 cache lines) */
#define OUT_PREFETCH 32 /* floats ahead along an output row (read-modify-write kinds) */

/* acc[i][0..1] += sum over the pairs p < np (and the tail, a pair with a zero partner) of
 * A(i, p) . interleave(b row 2p, b row 2p+1), for 32 columns of b (masked by jm).
 * A(i, p) is the 32-bit pair at a + i * a_row + p * a_pair (in bf16 elements); the tail's
 * single value is the 16-bit one at a + i * a_row + np * a_pair. With B_PACKED, b is the
 * buffer of interleaved pairs (the tail's included). acc[i][0] holds columns
 * 0-3, 8-11, 16-19, 24-27 of the block, acc[i][1] the others (0-15 and 16-31 where b was
 * packed in column order, as tn_pack_x does). */
BF_INLINE void pair_step(const int mr, const int bmode, int64_t p, const uint16_t *a, int64_t a_row,
                         int64_t a_pair, const uint16_t *b, int64_t ldb, __mmask32 jm,
                         __m512 acc[PAIR_MR][2])
{
    {
        __m512i lo, hi;
        if (bmode == B_PACKED) {
            lo = _mm512_load_si512((const void *)(b + 64 * p));
            hi = _mm512_load_si512((const void *)(b + 64 * p + 32));
        } else {
            const uint16_t *b0 = b + 2 * p * ldb;
            __m512i r0, r1;
            if (bmode == B_ROWS_FULL) {
                /* the next column blocks of these rows: callers walk the columns of a pair
                 * of rows block after block, and the rows may be 4 KiB apart */
                _mm_prefetch((const char *)(b0 + B_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(b0 + ldb + B_PREFETCH), _MM_HINT_T0);
                r0 = _mm512_loadu_si512((const void *)b0);
                r1 = _mm512_loadu_si512((const void *)(b0 + ldb));
            } else {
                r0 = _mm512_maskz_loadu_epi16(jm, b0);
                r1 = _mm512_maskz_loadu_epi16(jm, b0 + ldb);
            }
            lo = _mm512_unpacklo_epi16(r0, r1);
            hi = _mm512_unpackhi_epi16(r0, r1);
        }
        const uint16_t *ap = a + p * a_pair;
        for (int i = 0; i < mr; i++) {
            const __m512i av = _mm512_set1_epi32((int)ld32(ap + i * a_row));
            acc[i][0] = dp(acc[i][0], av, lo);
            acc[i][1] = dp(acc[i][1], av, hi);
        }
    }
}

/* Lines of w that a later pack will read, fetched into L2 a line every `every` pair steps of
 * the tiles before it: spread over their compute, since a burst of fetches waits on the miss
 * buffers, and rows 4 KiB apart defeat the hardware prefetchers. */
typedef struct pf_walk {
    const uint16_t *row; /* the next line's row, at the first column */
    int64_t ld;          /* w's row stride */
    int64_t per_row;     /* lines per row */
    int64_t col;         /* the next line within its row */
    int64_t left;        /* lines still to fetch */
    int64_t every;       /* pair steps per line */
} pf_walk;

static inline void pf_walk_next(pf_walk *pf)
{
    _mm_prefetch((const char *)(pf->row + 32 * pf->col), _MM_HINT_T1);
    if (++pf->col == pf->per_row) {
        pf->col = 0;
        pf->row += pf->ld;
    }
    pf->left--;
}

BF_INLINE void pair_tile(const int mr, const int bmode, int64_t np, int tail, const uint16_t *a,
                         int64_t a_row, int64_t a_pair, const uint16_t *b, int64_t ldb,
                         __mmask32 jm, pf_walk *pf, __m512 acc[PAIR_MR][2])
{
    int64_t p = 0;
    if (pf != NULL && pf->left > 0) {
        /* pf_walk_next written out on locals: through a (copied) struct the compiler kept the
         * walk on the stack and the NN phase of the layer ran about 2 % slower */
        const uint16_t *row = pf->row;
        int64_t col = pf->col, left = pf->left;
        const int64_t per_row = pf->per_row, ld = pf->ld, every = pf->every;
        while (p < np && left > 0) {
            _mm_prefetch((const char *)(row + 32 * col), _MM_HINT_T1);
            if (++col == per_row) {
                col = 0;
                row += ld;
            }
            left--;
            const int64_t pe = p + every < np ? p + every : np;
            for (; p < pe; p++)
                pair_step(mr, bmode, p, a, a_row, a_pair, b, ldb, jm, acc);
        }
        pf->row = row;
        pf->col = col;
        pf->left = left;
    }
    for (; p < np; p++)
        pair_step(mr, bmode, p, a, a_row, a_pair, b, ldb, jm, acc);
    if (tail) {
        __m512i lo, hi;
        if (bmode == B_PACKED) {
            lo = _mm512_load_si512((const void *)(b + 64 * np));
            hi = _mm512_load_si512((const void *)(b + 64 * np + 32));
        } else {
            const __m512i r0 = _mm512_maskz_loadu_epi16(jm, b + 2 * np * ldb);
            const __m512i z = _mm512_setzero_si512();
            lo = _mm512_unpacklo_epi16(r0, z);
            hi = _mm512_unpackhi_epi16(r0, z);
        }
        const uint16_t *ap = a + np * a_pair;
        for (int i = 0; i < mr; i++) {
            const __m512i av = _mm512_set1_epi32((int)ap[i * a_row]);
            acc[i][0] = dp(acc[i][0], av, lo);
            acc[i][1] = dp(acc[i][1], av, hi);
        }
    }
}

/* Columns back in order (unless the pairs were packed in order: `ordered`), then out rows
 * [0, mr) x 32 columns (masked by jm) by mode. */
BF_INLINE void pair_store(const int mr, const int ordered, __m512 acc[PAIR_MR][2], __mmask32 jm,
                          float *out, int64_t ldo, int mode, float scale)
{
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __mmask16 m0 = (__mmask16)(jm & 0xffffu), m1 = (__mmask16)(jm >> 16);
    const __m512 vs = _mm512_set1_ps(scale);
    for (int i = 0; i < mr; i++) {
        __m512 s0 = ordered ? acc[i][0] : _mm512_permutex2var_ps(acc[i][0], idx0, acc[i][1]);
        __m512 s1 = ordered ? acc[i][1] : _mm512_permutex2var_ps(acc[i][0], idx1, acc[i][1]);
        float *o = out + i * ldo;
        if (mode == OUT_SCALE_ADD || mode == OUT_SCALE_STREAM) {
            s0 = _mm512_mul_ps(vs, s0);
            s1 = _mm512_mul_ps(vs, s1);
        }
        if (mode == OUT_SCALE_STREAM && jm == 0xffffffffu && ((uintptr_t)o & 63) == 0) {
            _mm512_stream_ps(o, s0);
            _mm512_stream_ps(o + 16, s1);
            continue;
        }
        if (mode == OUT_ADD || mode == OUT_SCALE_ADD) {
            /* callers walk the column blocks of these rows in order: the next block's lines
             * (without this, read-modify-write rows 8 KiB apart stream at half speed) */
            _mm_prefetch((const char *)(o + OUT_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(o + OUT_PREFETCH + 16), _MM_HINT_T0);
            s0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), s0);
            s1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), s1);
        }
        _mm512_mask_storeu_ps(o, m0, s0);
        _mm512_mask_storeu_ps(o + 16, m1, s1);
    }
}

/* pair_store out of line, from a copy of the accumulators (acc[i][h] at accs + 32 i + 16 h):
 * TN's tiles whose output is not whole blocks streamed or added to, and the NN rows path's
 * last chunk and stream path (their accumulators are in a buffer anyway). Inlined (or given
 * acc's address), its branches kept every tile's accumulators on the stack: TN ran at 0.80 of
 * the peak against 0.91 without (1 thread, dsv2lite's down shape). */
BF_TARGET __attribute__((noinline)) static void store_general(int mr, int ordered,
                                                              const float *accs, __mmask32 jm,
                                                              float *out, int64_t ldo, int mode,
                                                              float scale)
{
    __m512 acc[PAIR_MR][2];
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++)
            acc[i][h] = _mm512_load_ps(accs + 32 * i + 16 * h);
    pair_store(mr, ordered, acc, jm, out, ldo, mode, scale);
}

typedef void (*pair_fn)(int64_t np, int tail, const uint16_t *a, int64_t a_row, int64_t a_pair,
                        const uint16_t *b, int64_t ldb, __mmask32 jm, float *accbuf, int first,
                        int last, float *out, int64_t ldo, int mode, float scale);

/* One tile over one range of pairs: acc from zero (first) or accbuf, then to out (last) or
 * back to accbuf (mr x 32 floats), so a reduction split in chunks sums exactly as one. */
#define PAIR_VARIANT(MR)                                                                           \
    BF_TARGET static void pair_##MR(int64_t np, int tail, const uint16_t *a, int64_t a_row,        \
                                    int64_t a_pair, const uint16_t *b, int64_t ldb, __mmask32 jm,  \
                                    float *accbuf, int first, int last, float *out, int64_t ldo,   \
                                    int mode, float scale)                                         \
    {                                                                                              \
        __m512 acc[PAIR_MR][2];                                                                    \
        for (int i = 0; i < MR; i++)                                                               \
            for (int h = 0; h < 2; h++)                                                            \
                acc[i][h] =                                                                        \
                    first ? _mm512_setzero_ps() : _mm512_loadu_ps(accbuf + 32 * i + 16 * h);       \
        if (jm == 0xffffffffu)                                                                     \
            pair_tile(MR, B_ROWS_FULL, np, tail, a, a_row, a_pair, b, ldb, jm, NULL, acc);         \
        else                                                                                       \
            pair_tile(MR, B_ROWS_MASKED, np, tail, a, a_row, a_pair, b, ldb, jm, NULL, acc);       \
        if (last) {                                                                                \
            pair_store(MR, 0, acc, jm, out, ldo, mode, scale);                                     \
        } else {                                                                                   \
            for (int i = 0; i < MR; i++)                                                           \
                for (int h = 0; h < 2; h++)                                                        \
                    _mm512_storeu_ps(accbuf + 32 * i + 16 * h, acc[i][h]);                         \
        }                                                                                          \
    }
EACH_TILE_HEIGHT(PAIR_VARIANT)

static const pair_fn pair_fns[PAIR_MR + 1] = TILE_HEIGHT_TABLE(pair_);

/* tn's packed path: `steps` tiles of MR rows by 32 columns in one call, step t's pairs at
 * a + t * a_step, its packed block of x at b + t * b_step and its output from
 * out + t * out_step: down the rows over one block of x (a_step a tile's panel, b_step 0,
 * out_step MR rows), or along one tile's rows over consecutive blocks (a_step 0, b_step a
 * block, out_step 32 columns). With the few pairs of a typical expert (48 for 96 tokens) a
 * call per tile cost as much as a tenth of the tile's work. */
typedef struct tn_walk {
    int64_t a_step, b_step, out_step;
} tn_walk;

typedef void (*tn_run_fn)(int64_t np, int tail, const uint16_t *a, const uint16_t *b, tn_walk walk,
                          int64_t steps, __mmask32 jm, float *out, int64_t ldo, int mode,
                          float scale);

/* How a run's tiles leave: whole blocks go straight from the accumulators (streamed where
 * aligned, or added to), others through store_general. (NN's pair_N keeps pair_store inline:
 * written there, these stores and the permute's constants took registers from the loop, which
 * then kept B on the stack and ran at half speed.) */
enum { TN_GENERAL = 0, TN_STREAM = 1, TN_ADD = 2 };

/* Rows [0, mr) of whole 32-column blocks packed in order, scaled by vs (unless `scaled` is 0:
 * a scale of 1, exact without the multiplies, which take the vdpbf16ps ports): streamed
 * (TN_STREAM: out 64-byte aligned, ldo a multiple of 16) or added to (TN_ADD, as pair_store's
 * OUT_SCALE_ADD, its prefetch included). */
BF_INLINE void tn_store_whole(const int mr, const int kind, const int scaled,
                              __m512 acc[PAIR_MR][2], float *out, int64_t ldo, __m512 vs)
{
    for (int i = 0; i < mr; i++) {
        float *r = out + i * ldo;
        const __m512 s0 = scaled ? _mm512_mul_ps(vs, acc[i][0]) : acc[i][0];
        const __m512 s1 = scaled ? _mm512_mul_ps(vs, acc[i][1]) : acc[i][1];
        if (kind == TN_STREAM) {
            _mm512_stream_ps(r, s0);
            _mm512_stream_ps(r + 16, s1);
        } else {
            _mm_prefetch((const char *)(r + OUT_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(r + OUT_PREFETCH + 16), _MM_HINT_T0);
            _mm512_storeu_ps(r, _mm512_add_ps(_mm512_loadu_ps(r), s0));
            _mm512_storeu_ps(r + 16, _mm512_add_ps(_mm512_loadu_ps(r + 16), s1));
        }
    }
}

BF_INLINE void tn_tiles(const int mr, const int kind, const int scaled, int64_t np, int tail,
                        const uint16_t *a, const uint16_t *b, tn_walk walk, int64_t steps,
                        __mmask32 jm, float *out, int64_t ldo, int mode, float scale)
{
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < steps; t++) {
        __m512 acc[PAIR_MR][2];
        for (int i = 0; i < mr; i++)
            acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        pair_tile(mr, B_PACKED, np, tail, a + t * walk.a_step, 2, 2 * mr, b + t * walk.b_step, 0,
                  jm, NULL, acc);
        float *o = out + t * walk.out_step;
        if (kind == TN_GENERAL) {
            _Alignas(64) float accs[PAIR_MR * 32];
            for (int i = 0; i < mr; i++)
                for (int h = 0; h < 2; h++)
                    _mm512_store_ps(accs + 32 * i + 16 * h, acc[i][h]);
            store_general(mr, 1, accs, jm, o, ldo, mode, scale);
        } else {
            tn_store_whole(mr, kind, scaled, acc, o, ldo, vs);
        }
    }
}

#define TN_RUN_VARIANT(MR)                                                                         \
    BF_TARGET static void tn_run_##MR(int64_t np, int tail, const uint16_t *a, const uint16_t *b,  \
                                      tn_walk walk, int64_t steps, __mmask32 jm, float *out,       \
                                      int64_t ldo, int mode, float scale)                          \
    {                                                                                              \
        const int whole = jm == 0xffffffffu;                                                       \
        if (whole && mode == OUT_SCALE_STREAM && ((uintptr_t)out & 63) == 0 && (ldo & 15) == 0) {  \
            if (scale == 1.0f)                                                                     \
                tn_tiles(MR, TN_STREAM, 0, np, tail, a, b, walk, steps, jm, out, ldo, mode,        \
                         scale);                                                                   \
            else                                                                                   \
                tn_tiles(MR, TN_STREAM, 1, np, tail, a, b, walk, steps, jm, out, ldo, mode,        \
                         scale);                                                                   \
        } else if (whole && mode == OUT_SCALE_ADD) {                                               \
            tn_tiles(MR, TN_ADD, 1, np, tail, a, b, walk, steps, jm, out, ldo, mode, scale);       \
        } else {                                                                                   \
            tn_tiles(MR, TN_GENERAL, 1, np, tail, a, b, walk, steps, jm, out, ldo, mode, scale);   \
        }                                                                                          \
    }
EACH_TILE_HEIGHT(TN_RUN_VARIANT)

static const tn_run_fn tn_run_fns[PAIR_MR + 1] = TILE_HEIGHT_TABLE(tn_run_);

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

/* Tile i of `rows` rows of the pair kernels (balanced_height) */
static int tile_height(int64_t rows, int64_t i) { return balanced_height(rows, PAIR_MR, i); }

/* Pairs [p0, p0 + cnt) of w's rows (TN: x's) for one block of 32 columns (masked by jm), the
 * partner of row N-1 zero when N is odd, packed in column order (0-15 in the first half,
 * 16-31 in the second), so that a tile's accumulators are stored without a permute:
 * quadword j of a row holds columns 4j..4j+3, and after the [0,4,1,5,2,6,3,7] quadword
 * shuffle the in-lane unpacks take columns 4L..4L+3 (lo) and 16+4L.. (hi) into lane L. */
BF_TARGET static void tn_pack_x(const uint16_t *w, int64_t ldw, int64_t N, int64_t p0, int64_t cnt,
                                __mmask32 jm, uint16_t *bp)
{
    const __m512i qidx = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t q = 0; q < cnt; q++) {
        const int64_t n = 2 * (p0 + q);
        /* the next column block of these rows, packed after this block's tiles: into L2
         * now, as rows 4 KiB apart defeat the hardware prefetchers */
        _mm_prefetch((const char *)(w + n * ldw + 32), _MM_HINT_T1);
        if (n + 1 < N)
            _mm_prefetch((const char *)(w + (n + 1) * ldw + 32), _MM_HINT_T1);
        __m512i r0 = _mm512_maskz_loadu_epi16(jm, w + n * ldw);
        __m512i r1 =
            n + 1 < N ? _mm512_maskz_loadu_epi16(jm, w + (n + 1) * ldw) : _mm512_setzero_si512();
        r0 = _mm512_permutexvar_epi64(qidx, r0);
        r1 = _mm512_permutexvar_epi64(qidx, r1);
        _mm512_store_si512((void *)(bp + 64 * q), _mm512_unpacklo_epi16(r0, r1));
        _mm512_store_si512((void *)(bp + 64 * q + 32), _mm512_unpackhi_epi16(r0, r1));
    }
}

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

/* apack[q * mr + i] = (g[2(p0+q), n0+i], g[2(p0+q)+1, n0+i]) for q < cnt, the partner of row
 * M-1 zero when M is odd. */
BF_TARGET static void tn_pack_a(int64_t M, int64_t p0, int64_t cnt, int mr, const uint16_t *g,
                                int64_t ldg, uint32_t *apack)
{
    const __mmask32 lm = kt__lanes32(mr);
    const __mmask16 sm = kt__lanes16(mr);
    for (int64_t q = 0; q < cnt; q++) {
        const int64_t m = 2 * (p0 + q);
        const __m512i r0 = _mm512_maskz_loadu_epi16(lm, g + m * ldg);
        const __m512i r1 =
            m + 1 < M ? _mm512_maskz_loadu_epi16(lm, g + (m + 1) * ldg) : _mm512_setzero_si512();
        const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(r0));
        const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(r1)), 16);
        _mm512_mask_storeu_epi32(apack + q * mr, sm, _mm512_or_si512(lo, hi));
    }
}

/* x rows x columns of a column group: within about 512 KiB of L2, reused by all row tiles. */
#define TN_X_GROUP_BYTES (512 * 1024)

/* TN's packed path: x's pairs for one block of 32 columns are interleaved once (tn_pack_x)
 * and used by a group of row tiles of dw whose A panels were packed up front, where the
 * general path reads and interleaves x's rows in place for every tile (rows 4 KiB apart, all
 * in one L1 set). Same operations per element as the general path, so the same bits. Up to
 * TN_PACKED_MAX_PAIRS row pairs of x (the usual tokens per expert) its buffers are on the
 * stack (144 + 32 KiB); above, in the caller's work buffer (tn_work_bytes), the group's A
 * panels within TN_WORK_APACK_BYTES.
 * The group is as many tiles as TN_APACK_WORDS holds the panels of, at most TN_GROUP_MAX: x's
 * pairs are packed again for every group, so a group of 64 tiles (panels read from L2) packs x
 * less often than one that fits L1; 128 tiles were no faster. */
#define TN_PACKED_MAX_PAIRS 256
#define TN_GROUP_MAX 64
#define TN_APACK_PAIRS 48 /* the pairs of the usual expert's 96 rows (dsv2lite qlen 1024) */
#define TN_APACK_WORDS (PAIR_MR * TN_APACK_PAIRS * TN_GROUP_MAX)
#define TN_WORK_APACK_BYTES (768 * 1024)

/* Above TN_PACKED_MAX_PAIRS pairs: the tiles per group (their A panels within
 * TN_WORK_APACK_BYTES, at least one), and the work buffer's layout: the panels, then x's
 * pairs from a cache line on (tn_pack_x's aligned stores). */
static int64_t tn_work_group(int64_t pairs)
{
    const int64_t g = TN_WORK_APACK_BYTES / (PAIR_MR * pairs * 4);
    return g < 1 ? 1 : g > TN_GROUP_MAX ? TN_GROUP_MAX : g;
}

static size_t tn_work_xpack_offset(int64_t pairs)
{
    return ((size_t)(tn_work_group(pairs) * PAIR_MR * pairs) * 4 + 63) / 64 * 64;
}

/* Where a group of `group` tiles from row n ends (or n1), tile heights from tile `tile` on */
static int64_t tn_group_end(int64_t n, int64_t n0, int64_t n1, int64_t tile, int64_t group)
{
    for (int64_t t = 0; t < group && n < n1; t++)
        n += tile_height(n1 - n0, tile + t);
    return n;
}

/* Fetches rows [r0, r1) of g over columns [c0, c1) (what a group's A panels are packed from),
 * row by row along the columns. Packed tile by tile, the panels' loads walk down g's rows, a
 * cache miss each that the hardware prefetchers do not follow. */
static void tn_fetch_a(const uint16_t *g, int64_t ldg, int64_t r0, int64_t r1, int64_t c0,
                       int64_t c1)
{
    for (int64_t m = r0; m < r1; m++)
        kt__prefetch_range(g + m * ldg + c0, (size_t)(c1 - c0) * sizeof *g, KT__PF_READ_L2);
}

/* apack: room for `apack_words` words (at least one tile's panel), xpack for x's pairs */
static void tn_packed_avx512(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                             int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                             float scale, int mode, uint32_t *apack, int64_t apack_words,
                             uint16_t *xpack)
{
    const int64_t pairs = (M + 1) / 2;
    const int tail = (int)(M & 1);
    const int64_t per_tile = PAIR_MR * pairs;
    int64_t group = per_tile > 0 ? apack_words / per_tile : TN_GROUP_MAX;
    group = group > TN_GROUP_MAX ? TN_GROUP_MAX : group;
    const int64_t blocks = (K + 31) / 32;
    int64_t tile = 0;
    /* the first group's rows of g fetched at once; each next group's a slice of rows after
     * each column block of the group before */
    tn_fetch_a(g, ldg, 0, M, n0, tn_group_end(n0, n0, n1, 0, group));
    for (int64_t n = n0; n < n1;) {
        /* the group's tiles as runs of equal height (balanced heights: at most two runs) */
        int run_mr[TN_GROUP_MAX];
        int64_t run_row[TN_GROUP_MAX], run_first[TN_GROUP_MAX], run_len[TN_GROUP_MAX];
        int64_t tiles = 0, runs = 0;
        for (; tiles < group && n < n1; tiles++) {
            const int mr = tile_height(n1 - n0, tile++);
            if (runs == 0 || run_mr[runs - 1] != mr) {
                run_mr[runs] = mr, run_row[runs] = n, run_first[runs] = tiles, run_len[runs] = 0;
                runs++;
            }
            run_len[runs - 1]++;
            tn_pack_a(M, 0, pairs, mr, g + n, ldg, apack + tiles * per_tile);
            n += mr;
        }
        const int64_t next_end = tn_group_end(n, n0, n1, tile, group);
        for (int64_t jb = 0, b = 0; jb < K; jb += 32, b++) {
            const __mmask32 jm = kt__lanes32(K - jb);
            tn_pack_x(x + jb, ldx, M, 0, pairs, jm, xpack);
            for (int64_t r = 0; r < runs; r++)
                tn_run_fns[run_mr[r]](pairs - tail, tail,
                                      (const uint16_t *)(apack + run_first[r] * per_tile), xpack,
                                      (tn_walk){2 * per_tile, 0, run_mr[r] * lddw}, run_len[r], jm,
                                      dw + run_row[r] * lddw + jb, lddw, mode, scale);
            if (next_end > n)
                tn_fetch_a(g, ldg, b * M / blocks, (b + 1) * M / blocks, n, next_end);
        }
    }
}

/* TN adding to dw for few rows of g and x (up to TN_ROWS_MAX_PAIRS pairs): x's pairs packed
 * once for every 32-column block (pairs * K * 4 bytes, read from L2 by every tile), then each
 * tile of dw's rows walks along its rows block after block. The packed path's order (down a
 * group of tiles for each block) reads two cache lines of a row, then the next row's 8 KiB on;
 * with this little arithmetic per element of dw, it lost to oneDNN's GEMM at 1-8 rows; this
 * walk is faster there. Overwriting dw (streaming stores, a training step's first
 * micro-batch) stays on the packed path, which was as fast or faster for it. The same
 * operations on each element, so the same bits. apack: one tile's panel
 * (PAIR_MR * pairs words), xall: the packed x. */
#define TN_ROWS_MAX_PAIRS 8
static void tn_rows_avx512(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                           int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                           float scale, int mode, uint32_t *apack, uint16_t *xall)
{
    const int64_t pairs = (M + 1) / 2;
    const int tail = (int)(M & 1);
    const int64_t whole = K / 32, block = 64 * pairs; /* a block's packed pairs, uint16_t */
    for (int64_t b = 0; 32 * b < K; b++)
        tn_pack_x(x + 32 * b, ldx, M, 0, pairs, kt__lanes32(K - 32 * b), xall + b * block);
    const uint16_t *a = (const uint16_t *)apack;
    for (int64_t n = n0, i = 0; n < n1; i++) {
        const int mr = tile_height(n1 - n0, i);
        const tn_run_fn run = tn_run_fns[mr];
        tn_pack_a(M, 0, pairs, mr, g + n, ldg, apack);
        if (whole > 0)
            run(pairs - tail, tail, a, xall, (tn_walk){0, block, 32}, whole, 0xffffffffu,
                dw + n * lddw, lddw, mode, scale);
        if (K % 32 != 0)
            run(pairs - tail, tail, a, xall + whole * block, (tn_walk){0, 0, 0}, 1,
                kt__lanes32(K % 32), dw + n * lddw + 32 * whole, lddw, mode, scale);
        n += mr;
    }
}

static void tn_avx512(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                      const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                      int accumulate, void *work)
{
    const int mode = accumulate ? OUT_SCALE_ADD : OUT_SCALE_STREAM;
    if ((M + 1) / 2 <= TN_PACKED_MAX_PAIRS) {
        _Alignas(64) uint32_t apack[TN_APACK_WORDS];
        _Alignas(64) uint16_t xpack[TN_PACKED_MAX_PAIRS * 64];
        /* the rows path keeps one tile's panel in apack's first 512 bytes, x after them */
        const int64_t pairs = (M + 1) / 2, panel_words = 128;
        if (mode == OUT_SCALE_ADD && pairs <= TN_ROWS_MAX_PAIRS &&
            64 * pairs * ((K + 31) / 32) <= 2 * (TN_APACK_WORDS - panel_words)) {
            tn_rows_avx512(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, mode, apack,
                           (uint16_t *)(apack + panel_words));
            return;
        }
        tn_packed_avx512(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, mode, apack, TN_APACK_WORDS,
                         xpack);
        return;
    }
    /* More rows: the packed path in the caller's work buffer. Measured (kt-bench gemm tn,
     * 1 thread, dsv2lite's gate shape, adding to dw) at 768 and 1536 rows: 0.57 and 0.39 of
     * the peak on the general path below (without work), 0.81-0.83 and 0.80-0.82 packed. */
    if (work != NULL) {
        const int64_t pairs = (M + 1) / 2;
        tn_packed_avx512(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, mode, work,
                         tn_work_group(pairs) * PAIR_MR * pairs,
                         (uint16_t *)((unsigned char *)work + tn_work_xpack_offset(pairs)));
        return;
    }
    _Alignas(64) uint32_t apack[PAIR_MR * TN_PAIRS_PER_CHUNK];
    _Alignas(64) float accbuf[PAIR_MR * 32];
    const int64_t pairs = (M + 1) / 2; /* with the tail */
    const int64_t chunks = (pairs + TN_PAIRS_PER_CHUNK - 1) / TN_PAIRS_PER_CHUNK;
    int64_t js = M > 0 ? TN_X_GROUP_BYTES / (2 * M) : K;
    js = js < 32 ? 32 : js - js % 32;
    for (int64_t j0 = 0; j0 < K; j0 += js) {
        const int64_t j1 = K - j0 < js ? K : j0 + js;
        for (int64_t n = n0, i = 0; n < n1; i++) {
            const int mr = tile_height(n1 - n0, i);
            const pair_fn fn = pair_fns[mr];
            if (chunks == 1)
                tn_pack_a(M, 0, pairs, mr, g + n, ldg, apack);
            for (int64_t jb = j0; jb < j1; jb += 32) {
                const __mmask32 jm = kt__lanes32(j1 - jb);
                for (int64_t c = 0; c < chunks || c == 0; c++) {
                    const int64_t p0 = c * TN_PAIRS_PER_CHUNK;
                    const int64_t cnt =
                        pairs - p0 < TN_PAIRS_PER_CHUNK ? pairs - p0 : TN_PAIRS_PER_CHUNK;
                    const int last = c + 1 >= chunks;
                    const int tail = last && (M & 1);
                    if (chunks > 1)
                        tn_pack_a(M, p0, cnt, mr, g + n, ldg, apack);
                    fn(cnt - tail, tail, (const uint16_t *)apack, 2, 2 * (int64_t)mr,
                       x + 2 * p0 * ldx + jb, ldx, jm, accbuf, c == 0, last, dw + n * lddw + jb,
                       lddw, mode, scale);
                }
            }
            n += mr;
        }
    }
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

void kt__bf16_tn_dpbf16(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                        int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                        float scale, int accumulate, void *work)
{
    tn_avx512(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);
    if (!accumulate)
        _mm_sfence(); /* the streamed rows are visible to whichever thread reads them next */
}

size_t kt__bf16_tn_dpbf16_work_bytes(int64_t M)
{
    const int64_t pairs = (M + 1) / 2;
    if (pairs <= TN_PACKED_MAX_PAIRS)
        return 0;
    /* the panels take at most max(TN_WORK_APACK_BYTES, one tile's) bytes, so this bound
     * grows with M and covers every smaller M */
    const size_t panels = (size_t)TN_WORK_APACK_BYTES + (size_t)(PAIR_MR * pairs) * 4;
    return (panels + 63) / 64 * 64 + (size_t)pairs * 128;
}

#endif
