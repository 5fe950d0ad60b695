/* bf16 GEMM dispatch and the AVX-512 BF16 kernels (vdpbf16ps; see bf16_gemm.h).
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
#include <math.h>
#include <string.h>

#include "core/cpu_internal.h"
#include "kt/tensor.h"
#include "moe/amx_gemm.h"
#include "moe/bf16_gemm.h"
#include "moe/fma_gemm.h"
#include "moe/lane_mask.h"
#include "moe/prefetch.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BF_HAVE_AVX512 1
#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF_INLINE                                                                                  \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

/* ---- NT ------------------------------------------------------------------------------------ */

/* x rows per chunk: a chunk of x (rows x K bf16) stays within about 640 KiB of the 1 MiB L2
 * (the w block being read and the next one being prefetched take the rest). */
#define NT_X_CHUNK_BYTES (640 * 1024)
#define NT_COLS 6      /* w rows per block */
#define NT_PF_AHEAD 12 /* w rows from a block to the ones its tile prefetches at 5-32 rows */

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
 * lanes l and l+8 first, then the two halves of each group of 8, then 4 -> 2 -> 1. (Passed
 * as values, not an array, so that nothing is kept in memory.) */
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
 * apart are more than the hardware prefetchers follow well; measured when this tile also ran
 * one row, before nt_rows: one block ahead left every load waiting, dsv2lite qlen 1 2.36-2.56
 * -> 2.27-2.37 ms). Into L2, not L1: at a dozen rows (qlen 128) that streamed the weights about
 * 5 % faster (more lines in flight). Addresses past the last row are only prefetched, never
 * loaded. (Fetching the next block in address order into L1 instead was 7-10 % slower at two
 * or more row tiles a block.) */
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

/* Tile t of `rows` rows cut into as many tiles as tiles of at most `max` rows need, their
 * heights as equal as possible: NT's 4-row tiles (97 rows: 22 x 4 + 3 x 3, not 24 x 4 + 1,
 * since a short tile loads its 6 rows of w for few products; measured, kt-bench gemm nt, 1
 * thread, dsv2lite's gate shape, at 96-100 rows: 0.90, 0.83, 0.85, 0.86, 0.87 of the peak with
 * 4/2/1 tiles), and the pair kernels' 12-row ones (90 rows: 6 x 11 + 2 x 12, not 7 x 12 + 4 +
 * 2: a short tile has too few independent accumulators to keep vdpbf16ps busy). Heights never
 * change an element's operations, so the bits are those of any other tiling. */
static int balanced_height(int64_t rows, int64_t max, int64_t t)
{
    const int64_t tiles = (rows + max - 1) / max;
    return (int)(rows / tiles + (t < rows % tiles));
}

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
 * best.
 * The tile's 6 rows of w 4 KiB apart at the same k, even with the next block fetched in
 * address order into L1, read memory more slowly: a loop over 923 MB of 1408 x 2048 weights,
 * 2 threads, in the VM's fast state: 6-row tile with that fetch 54-67 GB/s, one row at a time
 * 72-75, a plain read 75-83 (two rows 4 KiB apart at a time: 58). kt-bench gemm nt, dsv2lite
 * gate shape, 1 thread, from memory: 1 row 35.9 -> 38.6-38.9 GB/s, 2 rows 34-36 -> 38.0-38.6,
 * 4 rows 30.4-31.7 -> 33.5-33.6 (2 threads, in the slow state: 47-49 -> 48-52). */
#define NT_ROWS_MAX_M KT__BF16_NT_ROWS_MAX_M

/* On Intel the rows' lines are also fetched this many bytes ahead of the loads: the Emerald
 * Rapids VM's hardware prefetchers alone left the rows path at 0.76-0.80 of the memory
 * bandwidth (dsv2lite qlen 1 frozen forward, 3.99-4.36 ms), 2 KiB ahead took it to 0.92-0.96
 * (3.35-3.66 ms, alternating builds; 512 B 0.87, 1 KiB 0.88-0.94, 3-4 KiB as 2; qwen3moe
 * 0.76 -> 0.94). The AMD
 * Zen 5 VM reached 0.95-0.99 without it (thirteenth session) and has not run it: off there. */
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
 * one row of x leaves each row's vdpbf16ps one chain, which two streams double (kt-bench gemm
 * nt, dsv2lite's gate shape from memory, the VM's fast state, one thread / two: 1 row
 * 38.9-41.0 -> 40.8-43.2 / 72.4-75.3 -> 72.5-83.5 GB/s, 2 rows 37.1-37.7 -> 40.6-42.0 /
 * 70.5-71.8 -> 76.9-77.2; alternating builds, frozen forward: dsv2lite qlen 1 1.38 -> 1.27 ms,
 * qwen3moe qlen 1 1.11 -> 0.93, dsv2lite qlen 16 14.8 -> 14.3). At 3 and 4 rows two streams
 * were slower (3 rows: 34 -> 29 GB/s on one thread; 4 rows 33 -> 26). */
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
 * w once more). Measured (kt-bench gemm, 1 thread, dsv2lite's shapes, 600 to 1536 rows):
 * 0.71-0.83 of the peak with the former walk of one 32-column block down all the rows,
 * 0.78-0.82 and 0.89-0.93 chunked; chunks of 192 to 384 rows measured the same as 512. */
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
 * prefetchers behind: 17 GB/s on one thread where x W^T streams 33-36 (kt-bench gemm, dsv2lite's
 * gate shape, weights from memory). Here each pair of w's rows is read whole, over all the
 * call's columns (a pass takes as many as M x columns accumulators fit: NN_STREAM_ACC_FLOATS,
 * in L1, up to NN_GROUP_TILE rows, NN_GROUP_ACC_FLOATS, in L2, above), in address order, the
 * pair NN_STREAM_AHEAD_BYTES(M) on fetched into L1 as it goes. Below NN_GROUP_MIN_M rows the
 * accumulators are loaded and stored around each vdpbf16ps; from there they stay in
 * registers over a group of pairs (nn_stream_group). Every element still accumulates the pairs
 * of every source in order from zero, the tail last, so the bits are those of the rows path.
 * One thread / two, GB/s: M = 1 17 -> 29-30 / 32 -> 42-48, M = 4 17 -> 32-33 / 32 -> 53-54,
 * M = 6 15 -> 25-27 / 29 -> 41-45; from 6 rows the accumulators stay in registers over
 * groups of pairs (nn_stream_group), which took it to 12 rows, and as two row tiles a
 * column block to 16 (13 and 16 rows, one thread: 0.39-0.40 and 0.43-0.45 of the peak with
 * the rows path, 0.53 and 0.52-0.54 now; the tiles as two passes over the columns gave
 * 0.44-0.46 and 0.47-0.53; at 20 and 24 rows no faster than the rows path, which stays
 * above 16).
 * The distance (NN_STREAM_AHEAD_BYTES, at least one pair, at most NN_STREAM_AHEAD_MAX pairs):
 * at one row 4-8 KiB ahead was best, at four rows 16-32 KiB (more compute a pair); none at
 * all, 15 GB/s. */
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
 * loads and stores around every pair were the limit (kt-bench gemm nn at 8 rows: 0.31 of the peak,
 * hot or not); kept in registers over a group of 8 pairs (mr <= 12: 24 of them), 8 and 12 rows
 * from memory on one thread went 0.30 -> 0.47-0.50 and 0.32 (the rows path) -> 0.59-0.61
 * (4 pairs: 0.39-0.47 and 0.50-0.53). */
#define NN_GROUP_PAIRS 8
#define NN_GROUP_MIN_M 6
#define NN_GROUP_TILE 12 /* rows of accumulators in registers; more run as two tiles */
/* Accumulators above NN_GROUP_TILE rows: 64 KiB (in L2; loaded and stored once a group), so
 * that a pass is still a few hundred columns wide; at most 12 rows 24 KiB (in L1) measured
 * faster (12 rows, one thread: 0.60-0.61 of the peak against 0.56 with 64 KiB). */
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
 * pairs are packed again for every group, and with a group of 21 tiles (48 KiB of panels at
 * dsv2lite's 48 pairs) tn_pack_x took 3 % of the kernel's time; 64 tiles (144 KiB, the panels
 * then read from L2) took dsv2lite qlen 1024 full's weight_grad from 113.0 to 110.7 ms
 * (alternating builds, 5 runs each), and 128 tiles were no faster. */
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
 * cache miss each that the hardware prefetchers do not follow: at dsv2lite qlen 1024 the
 * packing waited on them for 3.5 % of the kernel's time, 1.3 % with the rows fetched (a
 * CPU-clock profile; the weight_grad phase 110.0 -> 108.7 ms, alternating builds, within its
 * noise). */
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
 * with this little arithmetic per element of dw, it lost to oneDNN's GEMM on one thread
 * (0.40-0.81 of its speed at 1-8 rows). Measured (kt-bench gemm tn, dsv2lite's gate,
 * alternating builds, medians of 5, one thread / two): 1 row 1.46 -> 1.08 / 0.69 -> 0.53 ms,
 * 8 rows 1.48 -> 1.29 / 0.74 -> 0.61, 12 rows 2.00 -> 1.45 / 1.12 -> 1.02, 15 rows
 * 2.48 -> 1.80 / 1.21 -> 1.26; against oneDNN in the same runs 1.14-1.62 on one thread,
 * 1.17-2.23 on two, on both shapes' products. Overwriting dw (streaming stores, a training
 * step's first micro-batch) stays on the packed path: there the layer's weight_grad at
 * dsv2lite qlen 128 took 83-102 ms this way against 82-90 (6 alternating runs each). The
 * same operations on each element, so the same bits. apack: one tile's panel
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

/* ---- elementwise epilogues of the layer -------------------------------------------------- */

/* f32 -> bf16 by the instruction (vcvtneps2bf16): kt_f32_to_bf16_1's bits (round to nearest
 * even, NaN quieted), except that f32 denormals (below 2^-126) become zeros of their sign,
 * as the vdpbf16ps that reads them would take them anyway (checked on 20M random patterns:
 * no other difference). The integer sequence it replaces took a third of the SiLU derivative's
 * time (alone: 0.80 -> 0.55 ns a value; the product 0.33 -> 0.21). */
BF_INLINE __m256i cvt_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* Stores 16 (or the masked first of them) values in the compute dtype. */
BF_INLINE void st_cdt(void *p, int64_t i, __m512 v, int bf16, __mmask16 km)
{
    if (bf16)
        _mm512_mask_storeu_epi16((uint16_t *)p + i, (__mmask32)km,
                                 _mm512_castsi256_si512(cvt_bf16(v)));
    else
        _mm512_mask_storeu_ps((float *)p + i, km, v);
}

/* exp(x): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (error
 * below 1e-8 relative there), times 2^n by scalef, which gives inf / 0 past the float range
 * without any clamping (a clamp by min/max would turn NaN into a number). */
BF_INLINE __m512 exp_ps(__m512 x)
{
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* sigmoid(g) = 1 / (1 + exp(-g)) */
BF_INLINE __m512 sigmoid_ps(__m512 g)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

BF_TARGET static void act_fwd_avx512(int64_t n, const float *g, const float *u, void *ac, int bf16)
{
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 km = kt__lanes16(n - i);
        const __m512 gv = _mm512_maskz_loadu_ps(km, g + i), uv = _mm512_maskz_loadu_ps(km, u + i);
        st_cdt(ac, i, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid_ps(gv)), uv), bf16, km);
    }
}

/* ac as act_fwd stores it (rounded to bf16 when bf16), back in f32 */
BF_INLINE __m512 cdt_round(__m512 v, int bf16)
{
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16(v)), 16))
                : v;
}

/* The SiLU derivative of 16 values (the masked first of them) from i on, stored; returns the
 * terms of their routing gradient piece, gap * ac (ac as act_fwd stores it) */
BF_INLINE __m512 act_bwd16(int64_t i, __mmask16 km, const float *g, const float *u,
                           const float *gap, __m512 wv, void *ggc, void *guc, void *ac_out,
                           int bf16)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 gv = _mm512_maskz_loadu_ps(km, g + i), uv = _mm512_maskz_loadu_ps(km, u + i);
    const __m512 pv = _mm512_maskz_loadu_ps(km, gap + i), sig = sigmoid_ps(gv);
    const __m512 av = _mm512_mul_ps(wv, pv), silu = _mm512_mul_ps(gv, sig);
    const __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sig), one));
    st_cdt(ggc, i, _mm512_mul_ps(_mm512_mul_ps(av, uv), dsilu), bf16, km);
    st_cdt(guc, i, _mm512_mul_ps(av, silu), bf16, km);
    const __m512 acv = _mm512_mul_ps(silu, uv);
    if (ac_out != NULL)
        st_cdt(ac_out, i, acv, bf16, km);
    return _mm512_maskz_mul_ps(km, pv, cdt_round(acv, bf16));
}

/* Each 16 values' routing gradient piece is the sum of its 16 terms by reduce16's tree, the
 * tree _mm512_reduce_add_ps has: 8 pieces at a time by reduce8 (a third of the operations of
 * 8 reductions, which took about a third of this loop's time). */
BF_TARGET static void act_bwd_avx512(int64_t n, const float *g, const float *u, const float *gap,
                                     float w, void *ggc, void *guc, void *ac_out, float *part,
                                     int bf16)
{
    const __m512 wv = _mm512_set1_ps(w);
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
#define ACT_BWD_FULL(q) act_bwd16(i + 16 * (q), 0xffff, g, u, gap, wv, ggc, guc, ac_out, bf16)
        const __m512 p0 = ACT_BWD_FULL(0), p1 = ACT_BWD_FULL(1), p2 = ACT_BWD_FULL(2),
                     p3 = ACT_BWD_FULL(3), p4 = ACT_BWD_FULL(4), p5 = ACT_BWD_FULL(5),
                     p6 = ACT_BWD_FULL(6), p7 = ACT_BWD_FULL(7);
#undef ACT_BWD_FULL
        _mm512_mask_storeu_ps(part + i / 16, 0xff, reduce8(p0, p1, p2, p3, p4, p5, p6, p7));
    }
    for (; i < n; i += 16) {
        const __mmask16 km = kt__lanes16(n - i);
        part[i / 16] =
            _mm512_reduce_add_ps(act_bwd16(i, km, g, u, gap, wv, ggc, guc, ac_out, bf16));
    }
}

/* dst = s * src in the compute dtype. bf16 rows from a cache line on are stored past the
 * caches a line at a time (the backward's per-slot copies of grad_y: tens of megabytes, read
 * next by a later phase; a plain store would first read every line in). */
BF_TARGET static void scale_store_avx512(int64_t n, const float *src, float s, void *dst, int bf16)
{
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    if (bf16 && ((uintptr_t)dst & 63) == 0 && n >= 32) {
        for (; i + 32 <= n; i += 32) {
            const __m512 lo = _mm512_mul_ps(vs, _mm512_loadu_ps(src + i));
            const __m512 hi = _mm512_mul_ps(vs, _mm512_loadu_ps(src + i + 16));
            _mm512_stream_si512(
                (void *)((uint16_t *)dst + i),
                _mm512_inserti64x4(_mm512_castsi256_si512(cvt_bf16(lo)), cvt_bf16(hi), 1));
        }
        _mm_sfence(); /* visible to whichever thread reads them next */
    }
    for (; i < n; i += 16) {
        const __mmask16 km = kt__lanes16(n - i);
        st_cdt(dst, i, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(km, src + i)), bf16, km);
    }
}

static int use_avx512(void) { return kt__cpu_has_avx512() && kt__cpu_has_avx512_bf16(); }
#endif

static float silu_sig(float g) { return 1.0f / (1.0f + expf(-g)); }

static void st1(void *p, int bf16, int64_t i, float v)
{
    if (bf16)
        ((uint16_t *)p)[i] = kt_f32_to_bf16_1(v);
    else
        ((float *)p)[i] = v;
}

void kt__moe_act_fwd(int64_t n, const float *g, const float *u, void *ac, int bf16)
{
#ifdef BF_HAVE_AVX512
    if (use_avx512()) {
        act_fwd_avx512(n, g, u, ac, bf16);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        st1(ac, bf16, i, g[i] * silu_sig(g[i]) * u[i]);
}

void kt__moe_act_bwd(int64_t n, const float *g, const float *u, const float *gap, float w,
                     void *ggc, void *guc, void *ac_out, float *part, int bf16)
{
#ifdef BF_HAVE_AVX512
    if (use_avx512()) {
        act_bwd_avx512(n, g, u, gap, w, ggc, guc, ac_out, part, bf16);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        const float sig = silu_sig(g[i]), ga = w * gap[i];
        st1(ggc, bf16, i, ga * u[i] * (sig * (1.0f + g[i] * (1.0f - sig))));
        st1(guc, bf16, i, ga * (g[i] * sig));
        float ac = g[i] * sig * u[i]; /* as act_fwd stores it */
        if (ac_out != NULL)
            st1(ac_out, bf16, i, ac);
        if (bf16)
            ac = kt_bf16_to_f32_1(kt_f32_to_bf16_1(ac));
        if (i % 16 == 0)
            part[i / 16] = 0.0f;
        part[i / 16] += gap[i] * ac;
    }
}

void kt__moe_scale_store(int64_t n, const float *src, float s, void *dst, int bf16)
{
#ifdef BF_HAVE_AVX512
    if (use_avx512()) {
        scale_store_avx512(n, src, s, dst, bf16);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        st1(dst, bf16, i, s * src[i]);
}

/* AMX where the CPU has it, for products with at least one full tile of rows (M is the rows
 * of the product, the same for every block and thread of it: AMX and AVX-512 sum in different
 * orders, so the choice must never depend on the block a call computes). Below that the tiles
 * would be mostly padding and the AVX-512 kernels stream the weights as fast. */
#define AMX_MIN_M 16

static int use_amx(int64_t M) { return M >= AMX_MIN_M && kt__amx_usable(); }

/* The FMA path (fma_gemm.h) where the CPU multiplies bf16 faster widened, for products of at
 * least WIDEN_MIN_M rows (like AMX, a function of the product's rows only); below, the
 * vdpbf16ps kernels, which only stream the weights there, where the CPU has AVX-512 BF16. */
#define WIDEN_MIN_M 16

#ifdef BF_HAVE_AVX512
static int use_widen(int64_t M)
{
    return kt__cpu_bf16_on_fma() && (M >= WIDEN_MIN_M || !kt__cpu_has_avx512_bf16());
}
#endif

/* NT of KT__BF16_NT_ROWS_MAX_M + 1 to NT_DOTS_MAX_M rows, where the CPU multiplies bf16
 * faster widened: dot products along the rows of w (fma_unpacked.c). There the tiles' transposed
 * panel costs more than their FMAs save, and vdpbf16ps runs at a quarter of the FMA rate.
 * dsv2lite frozen forward, 2 threads (alternating runs): qlen 64 70 -> 54 ms, qlen 128 108
 * -> 82. The kernels alone (one thread, dsv2lite's gate from memory, 96-column calls) cross
 * at 20 rows since the tiles fetch their next panels spread over their steps (fma_gemm.c),
 * 2 runs each: 18 rows 1.15-1.18 ms against the tiles' 1.18-1.20, 20 rows 1.26-1.28 against
 * 1.23-1.31, 21 rows 1.31-1.33 against 1.21-1.26, 24 rows 1.47 against 1.36, 28 rows 1.83
 * against 1.42 (a chunk of x for more rows holds fewer values, and the lanes are added once
 * per chunk). Before that change they crossed at 24 rows. */
#define NT_DOTS_MAX_M 20

#ifdef BF_HAVE_AVX512
static int use_dots(int64_t M)
{
    return M > KT__BF16_NT_ROWS_MAX_M && M <= NT_DOTS_MAX_M && kt__cpu_bf16_on_fma() && !use_amx(M);
}
#endif

const char *kt__bf16_gemm_path(int64_t M)
{
    if (use_amx(M))
        return "amx";
#ifdef BF_HAVE_AVX512
    if (use_widen(M))
        return "fma";
    if (use_avx512())
        return "avx512_bf16";
#endif
    return "scalar";
}

/* NN of NN_DIRECT_MIN_M to WIDEN_MIN_M - 1 rows where the CPU multiplies bf16 faster widened:
 * w's rows widened in registers (kt__fma_nn_direct), the FMA path's sums without its
 * packed panels. One thread, dsv2lite's down (2048 x 1408) from memory, against vdpbf16ps:
 * 6 rows 0.78-0.81 -> 0.66-0.68 ms, 12 rows 1.26-1.40 -> 0.89-0.93; at 5 rows a tie, below
 * slower; from 16 the tiles are as fast. */
#define NN_DIRECT_MIN_M 6

#ifdef BF_HAVE_AVX512
static int use_nn_direct(int64_t M)
{
    return M >= NN_DIRECT_MIN_M && M < WIDEN_MIN_M && kt__cpu_bf16_on_fma() && !use_amx(M);
}
#endif

const char *kt__bf16_gemm_kind_path(const char *kind, int64_t M)
{
#ifdef BF_HAVE_AVX512
    if (strcmp(kind, "nt") == 0 && use_dots(M))
        return "fma_dots";
    if (strcmp(kind, "nn") == 0 && use_nn_direct(M))
        return "fma"; /* the tiles' sums */
#endif
    return kt__bf16_gemm_path(M);
}

void kt__bf16_gemm_nt_next(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                           int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *next,
                           float *y, int64_t ldy, int accumulate)
{
    if (M <= 0)
        return; /* no rows */
    if (use_amx(M)) {
        kt__amx_gemm_nt(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        return;
    }
#ifdef BF_HAVE_AVX512
    if (use_dots(M)) {
        kt__fma_nt_dots(KT__FMA_BF16, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        return;
    }
    if (use_widen(M)) {
        kt__fma_nt(KT__FMA_BF16, M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
        return;
    }
    if (use_avx512()) {
        nt_avx512(M, n0, n1, K, x, ldx, w, ldw, next ? next : w + n1 * ldw, y, ldy, accumulate);
        return;
    }
#endif
    (void)next;
    kt__bf16_gemm_nt_ref(M, n0, n1, K, x, ldx, w, ldw, y, ldy, accumulate);
}

void kt__bf16_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                      const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    kt__bf16_gemm_nt_next(M, n0, n1, K, x, ldx, w, ldw, NULL, y, ldy, accumulate);
}

void kt__bf16_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                      const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0)
        return; /* no rows */
    if (use_amx(M)) {
        kt__amx_gemm_nn(M, N, k0, k1, g, ldg, w, ldw, y, ldy, accumulate);
        return;
    }
#ifdef BF_HAVE_AVX512
    if (use_nn_direct(M)) {
        kt__fma_nn_direct(KT__FMA_BF16, M, N, k0, k1, g, w, NULL, NULL, ldg, ldw, y, ldy,
                          accumulate);
        return;
    }
    if (use_widen(M)) {
        kt__fma_nn(KT__FMA_BF16, M, N, k0, k1, g, w, NULL, NULL, ldg, ldw, y, ldy, accumulate);
        return;
    }
    if (use_avx512()) {
        const nn_src src = {g, w};
        nn_avx512(M, N, k0, k1, &src, 1, ldg, ldw, y, ldy, accumulate ? OUT_ADD : OUT_STORE);
        return;
    }
#endif
    kt__bf16_gemm_nn_ref(M, N, k0, k1, g, ldg, w, ldw, y, ldy, accumulate);
}

void kt__bf16_gemm_nn2(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g0,
                       const uint16_t *w0, const uint16_t *g1, const uint16_t *w1, int64_t ldg,
                       int64_t ldw, float *y, int64_t ldy, int stream)
{
#ifdef BF_HAVE_AVX512
    if (M > 0 && use_nn_direct(M)) {
        kt__fma_nn_direct(KT__FMA_BF16, M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, 0);
        return;
    }
    if (M > 0 && !use_amx(M) && use_widen(M)) {
        kt__fma_nn(KT__FMA_BF16, M, N, k0, k1, g0, w0, g1, w1, ldg, ldw, y, ldy, 0);
        return;
    }
    if (M > 0 && !use_amx(M) && use_avx512()) {
        const nn_src src[2] = {{g0, w0}, {g1, w1}};
        /* scaling by 1 is exact: the stored bits are those of a plain store */
        nn_avx512(M, N, k0, k1, src, 2, ldg, ldw, y, ldy, stream ? OUT_SCALE_STREAM : OUT_STORE);
        if (stream) /* the streamed lines visible to the next reader, as tn does */
            _mm_sfence();
        return;
    }
#endif
    (void)stream;
    kt__bf16_gemm_nn(M, N, k0, k1, g0, ldg, w0, ldw, y, ldy, 0);
    kt__bf16_gemm_nn(M, N, k0, k1, g1, ldg, w1, ldw, y, ldy, 1);
}

/* The larger of the two AVX-512 paths' buffers (the path is chosen per product). */
size_t kt__bf16_gemm_tn_work_bytes(int64_t M)
{
#ifdef BF_HAVE_AVX512
    const size_t widen = kt__fma_tn_work_bytes(M);
    const int64_t pairs = (M + 1) / 2;
    if (pairs <= TN_PACKED_MAX_PAIRS)
        return widen;
    /* the panels take at most max(TN_WORK_APACK_BYTES, one tile's) bytes, so this bound
     * grows with M and covers every smaller M */
    const size_t panels = (size_t)TN_WORK_APACK_BYTES + (size_t)(PAIR_MR * pairs) * 4;
    const size_t dp = (panels + 63) / 64 * 64 + (size_t)pairs * 128;
    return dp > widen ? dp : widen;
#else
    (void)M;
    return 0;
#endif
}

void kt__bf16_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                      const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                      int accumulate, void *work)
{
    if (use_amx(M)) {
        kt__amx_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
        return;
    }
#ifdef BF_HAVE_AVX512
    if (use_widen(M)) {
        kt__fma_tn(KT__FMA_BF16, M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);
        return;
    }
    if (use_avx512()) {
        tn_avx512(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate, work);
        if (!accumulate)
            _mm_sfence(); /* the streamed rows are visible to whichever thread reads them next */
        return;
    }
#endif
    (void)work;
    kt__bf16_gemm_tn_ref(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, accumulate);
}

void kt__bf16_gemm_tn_acc(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                          int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                          float scale, void *work)
{
    kt__bf16_gemm_tn(M, n0, n1, K, g, ldg, x, ldx, dw, lddw, scale, 1, work);
}
