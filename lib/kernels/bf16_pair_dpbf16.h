/* The pair kernels shared by the vdpbf16ps NN and TN paths (bf16_nn_dpbf16.c,
 * bf16_tn_dpbf16.c): a register tile of up to 12 rows by 32 columns that accumulates pairs along
 * the reduced dimension, its steps, its stores and the fetch walk that runs beside it. */
#ifndef KT_KERNELS_BF16_PAIR_DPBF16_H
#define KT_KERNELS_BF16_PAIR_DPBF16_H

#include <string.h>

#include "lib/kernels/bf16_dpbf16.h"
#include "lib/kernels/lane_mask.h"

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
/* Tile i of `rows` rows of the pair kernels (balanced_height) */
static inline int tile_height(int64_t rows, int64_t i) { return balanced_height(rows, PAIR_MR, i); }

#endif

#endif
