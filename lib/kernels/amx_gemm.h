/* AMX (Advanced Matrix Extensions) versions of the MoE layer's bf16 GEMMs: the same three
 * products, signatures and semantics as kt__bf16_gemm_nt / _nn / _tn (kernels/bf16_gemm.h),
 * for CPUs with AMX-TILE and AMX-BF16 (Intel Sapphire Rapids and later).
 *
 *   kt__amx_gemm_nt     y[m, n] = (accumulate ? y[m, n] : 0) + sum_k x[m, k] w[n, k]
 *                       m in [0, M), n in [n0, n1)
 *   kt__amx_gemm_nn     y[m, k] = (accumulate ? y[m, k] : 0) + sum_n g[m, n] w[n, k]
 *                       m in [0, M), k in [k0, k1)
 *   kt__amx_gemm_tn     dw[n, k] = (accumulate ? dw[n, k] : 0) + scale * sum_m g[m, n] x[m, k]
 *                       n in [n0, n1), k in [0, K) (kt__amx_gemm_tn_acc: accumulate 1)
 *
 * Call them only when kt__amx_usable() is 1: on any other x86-64 CPU the tile instructions
 * fault (SIGILL). Where the AMX kernels are not compiled (KT_AMX_COMPILED undefined: not
 * x86-64, or a compiler without the AMX intrinsics) kt__amx_usable() is 0 and the three names
 * run the scalar reference, so callers link on every target. Each call is single-threaded,
 * computes its whole output block, loads the tile configuration on entry and releases the
 * tiles (TILERELEASE) before it returns, so no AMX state is left live between calls.
 *
 * ---- The hardware (Intel SDM, LDTILECFG / TDPBF16PS) --------------------------------------
 * Palette 1 has 8 tile registers tmm0..7 of up to 16 rows x 64 bytes, shaped by a 64-byte
 * configuration: byte 0 palette (1), byte 1 start_row (0), bytes 16 + 2t the bytes per row of
 * tile t, byte 48 + t its rows, every other byte zero. The kernels use one constant
 * configuration: all 8 tiles 16 rows x 64 bytes. TDPBF16PS C, A, B computes, for every row m
 * and column c of C (16 x 16 f32) and every pair p = 0..15,
 *     C[m][c] += A[m][2p] * B[p][2c] + A[m][2p+1] * B[p][2c+1]      (bf16 products, f32 sums)
 * so A is 16 rows x 32 bf16 of the reduced dimension, and B is in the "VNNI" pair layout:
 * B's row p holds, for each of the 16 output columns c, the two consecutive reduced elements
 * 2p, 2p+1 as one 32-bit pair. The reduction advances 32 elements per instruction (one
 * "step"). Inputs and outputs that are denormal are flushed to zero, as with vdpbf16ps.
 *
 * ---- Tile layouts in memory (uint16_t units; a tile is 512 of them, 1 KiB, 64-byte rows) --
 *   A tile:  element (r, j) at r * 32 + j          row r = output row, j = reduced index
 *   B tile:  element (p, c, h) at p * 32 + 2c + h  reduced index 2p + h, output column c
 *   panel:   `steps` steps of `tiles` tiles each, tile t of step s at (s * tiles + t) * 512;
 *            out-of-range rows, columns and reduced indices are zeros (exact: 0 * 0 adds 0),
 *            so a reduced dimension of any length, odd included, runs in whole steps.
 *
 * ---- Packing, and why ---------------------------------------------------------------------
 * The weights stay in the Hugging Face row-major [out, in] layout (the layer keeps one copy;
 * see bf16_gemm.h), so each kernel packs the operand whose memory order is not the tile's,
 * just in time, into stack buffers:
 *  - NT: A = rows of x, already A tiles in place (row stride ldx): loaded directly. B = w^T:
 *    for a block of 32 rows of w (32 output columns) and a chunk of K, B row p is the 32-bit
 *    pair p of each of 16 rows of w: a 16 x 16 transpose of 32-bit pairs per tile
 *    (kt__amx_pack_b_nt).
 *  - NN: A = rows of g, loaded directly. B = w's rows n, n+1 interleaved element by element
 *    for 16 columns per tile (kt__amx_pack_b_pairs).
 *  - TN: A = g^T: 16 columns of g by 32 rows m, transposed (rows m, m+1 interleaved into
 *    pairs, then a 16 x 16 transpose of the pairs; kt__amx_pack_a_tn). B = x's rows m, m+1
 *    interleaved, as w's in NN (kt__amx_pack_b_pairs).
 * A tiles read in place that would cross the edge of the operand (the last rows of x or g,
 * or the last, partial step of the reduction) are copied into a zero-padded tile first
 * (kt__amx_pack_a): the tile instructions read whole rows of 64 bytes.
 *
 * ---- Order of summation -------------------------------------------------------------------
 * Every output element is the f32 sum, started at zero, of the products of its row and
 * column in the reduced index order, step after step (the reduction is cut into chunks that
 * bound the stack buffers; between chunks the partial sums are stored to and reloaded from a
 * stack buffer as f32, which is exact); the sum is then added to y (or scaled and added to
 * dw) in f32. That sequence depends only on the length of the reduction, never on n0/n1, M,
 * or where the element falls in a tile, so splitting the output over threads gives identical
 * bytes. Under the SDM's definition (each accumulation rounded to nearest even) it is also
 * exactly the order of the scalar reference, so the two agree bitwise (tests/test_amx_gemm.c
 * checks this with a tile emulator); hardware may group the additions inside an instruction
 * differently, which stays within the usual f32 bound and is still the same for every
 * element. The AVX-512 kernels sum in another order, so a dispatcher must pick AMX or AVX-512
 * for a whole product (from the CPU, or from the shape of the whole product), never per block
 * or per thread, or the bytes would depend on the split.
 *
 * Stack use: about 50 KiB (NT, NN) and 64 KiB (TN) per call. */
#ifndef KT_KERNELS_AMX_GEMM_H
#define KT_KERNELS_AMX_GEMM_H

#include <stdint.h>

/* x86-64 with gcc >= 11 or clang >= 12 (their AMX intrinsics; gcc's also need binutils >=
 * 2.34 to assemble). -DKT_NO_AMX compiles the kernels out. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KT_NO_AMX) &&                             \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define KT_AMX_COMPILED 1
#endif

/* 1 when the AMX kernels are compiled in, the CPU has AMX-TILE, AMX-BF16 and AVX-512
 * F/BW/BF16, palette 1 offers 8 tiles of 16 rows x 64 bytes, Linux granted this process
 * the tile data state (the arch_prctl request made by kt_cpu_get_features()), and the
 * kernels pass kt__amx_selftest on this CPU. 0 with KT_CPU=portable. Cached after the first
 * call. */
int kt__amx_usable(void);
/* 1 usable; 0 not there (or not compiled, or KT_CPU=portable); -1 there but the kernels
 * failed kt__amx_selftest on this CPU (so they are not used). */
int kt__amx_state(void);

/* The three products on a fixed small problem with ragged edges (every kind of edge tile),
 * accumulate on and off, against the scalar reference: 1 when all agree within 1e-3 of the
 * largest magnitude. The AMX kernels must pass it before they are used (they were written
 * and checked on an emulator, not on AMX hardware): a CPU on which they go wrong gets the
 * AVX-512 kernels instead of wrong numbers. */
typedef void (*kt__gemm_nt_fn)(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
                               int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                               int accumulate);
typedef void (*kt__gemm_tn_fn)(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                               int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                               float scale, int accumulate);
int kt__amx_selftest(kt__gemm_nt_fn nt, kt__gemm_nt_fn nn, kt__gemm_tn_fn tn);

void kt__amx_gemm_nt(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *x, int64_t ldx,
                     const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate);
void kt__amx_gemm_nn(int64_t M, int64_t N, int64_t k0, int64_t k1, const uint16_t *g, int64_t ldg,
                     const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int accumulate);
void kt__amx_gemm_tn(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g, int64_t ldg,
                     const uint16_t *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                     int accumulate);
void kt__amx_gemm_tn_acc(int64_t M, int64_t n0, int64_t n1, int64_t K, const uint16_t *g,
                         int64_t ldg, const uint16_t *x, int64_t ldx, float *dw, int64_t lddw,
                         float scale);

#ifdef KT_AMX_COMPILED
/* ---- The packing routines (AVX-512 F/BW, no tile instructions) ----------------------------
 * Exposed for the tests, which check them against plain loops on any AVX-512 CPU. Each
 * writes exactly steps * tiles tiles (or one tile) and reads only the elements it keeps.
 * Counts may be 0 or negative (nothing valid: zeros are written). */
#define KT_AMX_TILE_ELEMS 512 /* uint16_t per tile */

/* One A tile from a row-major operand: tile[r*32 + j] = src[r*ld + j] for r < rows (<= 16),
 * j < min(cols, 32); zero elsewhere. */
void kt__amx_pack_a(const uint16_t *src, int64_t ld, int64_t rows, int64_t cols, uint16_t *tile);

/* NT's B panel from rows of w (src = &w[n, k]): column c of tile t, reduced index
 * i = 32s + 2p + h holds w[(16t + c) * ldw + i] when 16t + c < ncols (<= 16 * tiles) and
 * i < nred; zero elsewhere. tiles is 1 or 2. */
void kt__amx_pack_b_nt(const uint16_t *w, int64_t ldw, int64_t ncols, int64_t nred, int64_t steps,
                       int tiles, uint16_t *panel);

/* B panel from pairs of rows (NN: src = &w[n, k]; TN: src = &x[m, k]): column c of tile t,
 * reduced index i = 32s + 2p + h holds src[i * ld + 16t + c] when i < nred and
 * 16t + c < ncols (<= 16 * tiles); zero elsewhere. tiles is 1 or 2. */
void kt__amx_pack_b_pairs(const uint16_t *src, int64_t ld, int64_t nred, int64_t ncols,
                          int64_t steps, int tiles, uint16_t *panel);

/* TN's A panel, g transposed (g = &g[m, n]): row r of tile t, reduced index j of step s holds
 * g[(32s + j) * ldg + 16t + r] when 32s + j < nred and 16t + r < nrows (<= 16 * tiles);
 * zero elsewhere. tiles is 1 to 4. */
void kt__amx_pack_a_tn(const uint16_t *g, int64_t ldg, int64_t nred, int64_t nrows, int64_t steps,
                       int tiles, uint16_t *panel);
#endif

#endif
