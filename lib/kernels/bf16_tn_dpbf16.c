/* The bf16 TN kernels on AVX-512 BF16 (vdpbf16ps): dw (+)= scale g^T x
 * (see bf16_gemm.h and, for the summation order, bf16_nt_dpbf16.c).
 *
 * Kernels (register tiles, accumulators in zmm registers over a whole reduction or chunk):
 *  - TN dw += scale g^T x: the pair tile (bf16_pair_dpbf16.h) with x's row pairs as B and the pairs (g[m,n],
 *    g[m+1,n]) as A, packed per tile of 12 rows n (x's pairs are also packed once per column
 *    block, shared by up to 64 row tiles); the buffers are on the stack up to 512 rows of x,
 *    on the heap above.
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
