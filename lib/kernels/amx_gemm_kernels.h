/* The loops of the AMX GEMMs (see amx_gemm.h), written once over a small set of tile
 * operations so that the same code runs on the real tiles (lib/kernels/amx_gemm.c) and on a tile
 * emulator in the tests (tests/test_amx_gemm.c), which is how the blocking, the edges and
 * the order of summation are checked on machines without AMX.
 *
 * Not an ordinary header: no include guard, included once by each of those two files after
 * <immintrin.h>, kernels/amx_gemm.h and these definitions:
 *   AMXK_FN(name)          the name of each generated (static) function
 *   AMXK_TARGET            their attributes (at least AVX-512 F/BW: the stores use it)
 *   AMXK_CFG(cfg)          load the tile configuration (64 bytes)
 *   AMXK_ZERO(t)           tile t = 0
 *   AMXK_LOAD(t, p, bytes) tile t = its rows from p, rows `bytes` apart
 *   AMXK_STORE(t, p, bytes)
 *   AMXK_DP(c, a, b)       tdpbf16ps: C += A . B (tile numbers are literal constants)
 *   AMXK_RELEASE()         tilerelease
 * Every function configures the tiles on entry and releases them before returning.
 *
 * Tiles: C (16 x 16 f32) in tmm0..3 as C[i][j] = tmm(2i + j) for two row tiles i and two
 * column tiles j (a 32 x 32 block of the output), A in tmm4, tmm5, B in tmm6, tmm7: per step
 * 2 A + 2 B loads feed 4 TDPBF16PS. */

#include <string.h>

typedef struct amxk_tilecfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved0[14];
    uint16_t colsb[16]; /* tiles 0..7; 8..15 reserved (zero) */
    uint8_t rows[16];   /* tiles 0..7; 8..15 reserved (zero) */
} amxk_tilecfg;

_Static_assert(sizeof(amxk_tilecfg) == 64, "the tile configuration is 64 bytes");

/* Palette 1, all 8 tiles 16 rows x 64 bytes. */
static const _Alignas(64) amxk_tilecfg amxk_cfg = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

#define AMXK_TE KT_AMX_TILE_ELEMS

/* NT / NN: output rows per chunk of partial sums (a multiple of 32), reduction per packed
 * chunk of B (a multiple of 32). Stack: B panel 16 steps x 2 tiles = 32 KiB, partial sums
 * 128 x 32 f32 = 16 KiB, edge A tiles 2 KiB. */
#define AMXK_AB_ROWS 128
#define AMXK_AB_RED 512

/* TN: rows of dw per block (4 A tiles), reduction per packed chunk, columns of dw per chunk
 * of partial sums (multiples of 32). Stack: A panel 8 steps x 4 tiles = 32 KiB, B panel
 * 8 steps x 2 tiles = 16 KiB, partial sums 64 x 64 f32 = 16 KiB. */
#define AMXK_TN_ROWS 64
#define AMXK_TN_RED 256
#define AMXK_TN_COLS 64

static inline int64_t AMXK_FN(min)(int64_t a, int64_t b) { return a < b ? a : b; }

/* The C tiles of a block (nat row tiles x nbt column tiles; tile (i, j) at cp + 16 i ld + 16 j,
 * rows ld floats apart): zeroed at the start of a reduction, else reloaded from the partial
 * sums. */
static inline AMXK_TARGET void AMXK_FN(c_begin)(int zero, float *cp, int64_t ld, int nat, int nbt)
{
    if (zero) {
        AMXK_ZERO(0);
        if (nbt > 1)
            AMXK_ZERO(1);
        if (nat > 1) {
            AMXK_ZERO(2);
            if (nbt > 1)
                AMXK_ZERO(3);
        }
        return;
    }
    AMXK_LOAD(0, cp, 4 * ld);
    if (nbt > 1)
        AMXK_LOAD(1, cp + 16, 4 * ld);
    if (nat > 1) {
        AMXK_LOAD(2, cp + 16 * ld, 4 * ld);
        if (nbt > 1)
            AMXK_LOAD(3, cp + 16 * ld + 16, 4 * ld);
    }
}

/* The C tiles back to the partial sums (the layout of c_begin). */
static inline AMXK_TARGET void AMXK_FN(c_end)(float *cp, int64_t ld, int nat, int nbt)
{
    AMXK_STORE(0, cp, 4 * ld);
    if (nbt > 1)
        AMXK_STORE(1, cp + 16, 4 * ld);
    if (nat > 1) {
        AMXK_STORE(2, cp + 16 * ld, 4 * ld);
        if (nbt > 1)
            AMXK_STORE(3, cp + 16 * ld + 16, 4 * ld);
    }
}

/* One step: with the A tiles in tmm4 (and tmm5 when nat > 1), the B tiles of the step at bp
 * into tmm6 (and tmm7), and the 4 products. */
static inline AMXK_TARGET void AMXK_FN(c_step)(const uint16_t *bp, int nat, int nbt)
{
    AMXK_LOAD(6, bp, 64);
    AMXK_DP(0, 4, 6);
    if (nat > 1)
        AMXK_DP(2, 5, 6);
    if (nbt > 1) {
        AMXK_LOAD(7, bp + AMXK_TE, 64);
        AMXK_DP(1, 4, 7);
        if (nat > 1)
            AMXK_DP(3, 5, 7);
    }
}

static inline __mmask16 AMXK_FN(mask16)(int64_t n)
{
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* The finished sums of a block of NT / NN: y[r, 0..nc) (+)= s[r * 32 + 0..nc), r < rows. */
AMXK_TARGET static void AMXK_FN(store_ab)(const float *s, int64_t rows, int64_t nc, float *y,
                                          int64_t ldy, int accumulate)
{
    const __mmask16 m0 = AMXK_FN(mask16)(nc), m1 = AMXK_FN(mask16)(nc - 16);
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        __m512 v0 = _mm512_loadu_ps(s + r * 32), v1 = _mm512_loadu_ps(s + r * 32 + 16);
        if (accumulate) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yr), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yr + 16), v1);
        }
        _mm512_mask_storeu_ps(yr, m0, v0);
        if (m1)
            _mm512_mask_storeu_ps(yr + 16, m1, v1);
    }
}

/* The finished sums of a block of TN: dw[r, 0..kw) (+)= scale * s[r * AMXK_TN_COLS + ...]
 * (overwriting never reads dw). */
AMXK_TARGET static void AMXK_FN(store_tn)(const float *s, int64_t rows, int64_t kw, float *dw,
                                          int64_t lddw, float scale, int accumulate)
{
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < kw; j += 16) {
            const __mmask16 m = AMXK_FN(mask16)(kw - j);
            float *d = dw + r * lddw + j;
            __m512 v = _mm512_mul_ps(sc, _mm512_loadu_ps(s + r * AMXK_TN_COLS + j));
            if (accumulate)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, d), v);
            _mm512_mask_storeu_ps(d, m, v);
        }
}

/* NT (nt = 1) and NN (nt = 0): y[M, c0..c1) (+)= a[M, L] . B, where a is row-major with the
 * reduced dimension L contiguous (x for NT, g for NN; its A tiles are read in place) and B
 * comes from w: rows c of w for NT (w^T), rows of the reduced dimension for NN.
 * Loops: a block of 32 output columns; a chunk of up to 128 rows of a; chunks of 512 of the
 * reduction, B packed once per chunk and used by every 32-row block of the rows' chunk. */
AMXK_TARGET static void AMXK_FN(gemm_ab)(const int nt, int64_t M, int64_t c0, int64_t c1, int64_t L,
                                         const uint16_t *a, int64_t lda, const uint16_t *w,
                                         int64_t ldw, float *y, int64_t ldy, int accumulate)
{
    if (M <= 0 || c1 <= c0)
        return;
    _Alignas(64) uint16_t bpan[AMXK_AB_RED / 32 * 2 * AMXK_TE];
    _Alignas(64) float part[AMXK_AB_ROWS * 32];
    _Alignas(64) uint16_t aedge[2 * AMXK_TE];
    AMXK_CFG(&amxk_cfg);
    for (int64_t c = c0; c < c1; c += 32) {
        const int64_t nc = AMXK_FN(min)(32, c1 - c);
        const int nbt = nc > 16 ? 2 : 1;
        for (int64_t mc = 0; mc < M; mc += AMXK_AB_ROWS) {
            const int64_t mr = AMXK_FN(min)(AMXK_AB_ROWS, M - mc);
            if (L <= 0)
                memset(part, 0, sizeof part);
            for (int64_t l = 0; l < L; l += AMXK_AB_RED) {
                const int64_t ll = AMXK_FN(min)(AMXK_AB_RED, L - l);
                const int64_t steps = (ll + 31) / 32;
                if (nt)
                    kt__amx_pack_b_nt(w + c * ldw + l, ldw, nc, ll, steps, nbt, bpan);
                else
                    kt__amx_pack_b_pairs(w + l * ldw + c, ldw, ll, nc, steps, nbt, bpan);
                for (int64_t m = mc; m < mc + mr; m += 32) {
                    const int64_t r0 = AMXK_FN(min)(16, M - m), r1 = AMXK_FN(min)(16, M - m - 16);
                    const int nat = r1 > 0 ? 2 : 1;
                    float *cp = part + (m - mc) * 32; /* rows 128 bytes apart */
                    AMXK_FN(c_begin)(l == 0, cp, 32, nat, nbt);
                    for (int64_t s = 0; s < steps; s++) {
                        const int64_t k = l + 32 * s;
                        const int kfull = k + 32 <= L;
                        const uint16_t *ap = a + m * lda + k;
                        if (r0 == 16 && kfull) {
                            AMXK_LOAD(4, ap, 2 * lda);
                        } else {
                            kt__amx_pack_a(ap, lda, r0, L - k, aedge);
                            AMXK_LOAD(4, aedge, 64);
                        }
                        if (nat > 1) {
                            if (r1 == 16 && kfull) {
                                AMXK_LOAD(5, ap + 16 * lda, 2 * lda);
                            } else {
                                kt__amx_pack_a(ap + 16 * lda, lda, r1, L - k, aedge + AMXK_TE);
                                AMXK_LOAD(5, aedge + AMXK_TE, 64);
                            }
                        }
                        AMXK_FN(c_step)(bpan + s * nbt * AMXK_TE, nat, nbt);
                    }
                    AMXK_FN(c_end)(cp, 32, nat, nbt);
                }
            }
            AMXK_FN(store_ab)(part, mr, nc, y + mc * ldy + c, ldy, accumulate);
        }
    }
    AMXK_RELEASE();
}

/* TN: dw[n0..n1, 0..K) += scale * g^T x. Loops: a block of 64 rows of dw (4 A tiles); a chunk
 * of 64 columns of dw; chunks of 256 of the reduction m, g^T packed per chunk (once per row
 * block when M fits in one chunk, reused by every column chunk) and x's pairs packed per 32
 * columns, used by the 2 x 2 tile blocks of all 64 rows. */
AMXK_TARGET static void AMXK_FN(gemm_tn)(int64_t M, int64_t n0, int64_t n1, int64_t K,
                                         const uint16_t *g, int64_t ldg, const uint16_t *x,
                                         int64_t ldx, float *dw, int64_t lddw, float scale,
                                         int accumulate)
{
    if (n1 <= n0 || K <= 0)
        return;
    _Alignas(64) uint16_t apan[AMXK_TN_RED / 32 * 4 * AMXK_TE];
    _Alignas(64) uint16_t bpan[AMXK_TN_RED / 32 * 2 * AMXK_TE];
    _Alignas(64) float part[AMXK_TN_ROWS * AMXK_TN_COLS];
    AMXK_CFG(&amxk_cfg);
    for (int64_t n = n0; n < n1; n += AMXK_TN_ROWS) {
        const int64_t nr = AMXK_FN(min)(AMXK_TN_ROWS, n1 - n);
        const int ant = (int)((nr + 15) / 16);
        for (int64_t kg = 0; kg < K; kg += AMXK_TN_COLS) {
            const int64_t kw = AMXK_FN(min)(AMXK_TN_COLS, K - kg);
            if (M <= 0)
                memset(part, 0, sizeof part);
            for (int64_t mc = 0; mc < M; mc += AMXK_TN_RED) {
                const int64_t ml = AMXK_FN(min)(AMXK_TN_RED, M - mc);
                const int64_t steps = (ml + 31) / 32;
                if (kg == 0 || M > AMXK_TN_RED)
                    kt__amx_pack_a_tn(g + mc * ldg + n, ldg, ml, nr, steps, ant, apan);
                for (int64_t k = kg; k < kg + kw; k += 32) {
                    const int64_t nc = AMXK_FN(min)(32, kg + kw - k);
                    const int nbt = nc > 16 ? 2 : 1;
                    kt__amx_pack_b_pairs(x + mc * ldx + k, ldx, ml, nc, steps, nbt, bpan);
                    for (int i = 0; i < ant; i += 2) {
                        const int nat = ant - i > 1 ? 2 : 1;
                        float *cp = part + (int64_t)i * 16 * AMXK_TN_COLS + (k - kg);
                        AMXK_FN(c_begin)(mc == 0, cp, AMXK_TN_COLS, nat, nbt);
                        for (int64_t s = 0; s < steps; s++) {
                            const uint16_t *ap = apan + (s * ant + i) * AMXK_TE;
                            AMXK_LOAD(4, ap, 64);
                            if (nat > 1)
                                AMXK_LOAD(5, ap + AMXK_TE, 64);
                            AMXK_FN(c_step)(bpan + s * nbt * AMXK_TE, nat, nbt);
                        }
                        AMXK_FN(c_end)(cp, AMXK_TN_COLS, nat, nbt);
                    }
                }
            }
            AMXK_FN(store_tn)(part, nr, kw, dw + n * lddw + kg, lddw, scale, accumulate);
        }
    }
    AMXK_RELEASE();
}

#undef AMXK_TE
