/* The MoE GEMMs on the f32 FMA units, for operands in either weight dtype: bf16 widened to f32
 * as the panels are packed (exact: a bf16 value is the top half of an f32), f32 copied as is.
 * Products and sums by vfmadd231ps.
 *
 * Why bf16 goes here: on an Emerald Rapids core (measured: 1.34 G vdpbf16ps/s against
 * 5.4 G vfmadd231ps/s) vdpbf16ps issues at a quarter of the FMA rate, so with 32 products per
 * vdpbf16ps and 16 per FMA the FMA units multiply bf16 twice as fast. Other Intel cores with
 * AVX-512 BF16 are assumed alike (not measured here); AMD Zen 4/5 keep vdpbf16ps, whose
 * products reached about twice this FMA rate on the Zen 5 VM of earlier sessions. CPUs with
 * AVX-512F but no AVX-512 BF16 get this path too instead of the scalar one (bf16_gemm.c).
 * Why f32 goes here: the layer's own threads then split every product by blocks, as for bf16,
 * instead of one OpenBLAS call per expert; and Debian's OpenBLAS 0.3.21 does not know every
 * AVX-512 core (on the Emerald Rapids VM it runs its SSE3 "Prescott" kernels). f32_gemm.c
 * chooses; kt-bench moe compares with OpenBLAS on the same shapes.
 * Only x86-64 builds with GCC-compatible compilers have these kernels (KT__FMA_GEMM).
 *
 * Same contracts as bf16_gemm.h (block of the output per call, single-threaded, results
 * independent of the block split). Summation order: every output element is one f32 sum in
 * index order of the reduced dimension, each product added by an FMA (one rounding per step).
 * For bf16 the products are exact in f32, so each step is the scalar reference's `s += a * b`
 * and without accumulate the bits are kt__bf16_gemm_*_ref's for normal numbers; for f32 they
 * are those of `s = fmaf(a, b, s)` in index order (kt__f32_gemm_*_ref). With accumulate, NT
 * and NN add the products to y's value in order (((y + p0) + p1) ...); TN adds scale * sum.
 * bf16 runs with denormals flushed to zero (as vdpbf16ps does; denormal operands would
 * otherwise cost microcode assists); f32 keeps the caller's floating-point mode, as sgemm.
 *
 * Tiles: 12 rows x 32 columns of f32 accumulators (24 zmm), one operand broadcast per row and
 * step, the other two zmm of a packed panel [step][32] that stays in L1:
 *  - NN y = g w: the panel is w's rows (contiguous); g's rows of a chunk of the reduction are
 *    converted once and broadcast from there.
 *  - NT y = x w^T: the panel is w transposed (16 x 16 blocks); x's rows converted per chunk.
 *  - TN dw = scale g^T x: the panel is x's rows; g's 12 columns of a tile packed [m][12]; the
 *    reduction (M) whole in registers.
 * The buffers are on the stack (up to about 200 KiB); TN above 512 rows wants the caller's work
 * buffer (kt__fma_tn_work_bytes), as the vdpbf16ps kernel does. */
#ifndef KT_KERNELS_FMA_GEMM_H
#define KT_KERNELS_FMA_GEMM_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define KT__FMA_GEMM 1
#endif

/* The operands' element type (weights and activations alike). f16 only in the dense matmul's
 * mixed product (kt__fma_packed_mm_mixed). */
typedef enum kt__fma_src { KT__FMA_BF16 = 0, KT__FMA_F32 = 1, KT__FMA_F16 = 2 } kt__fma_src;

/* y[m, n] = (accumulate ? y : 0) + sum_k x[m, k] w[n, k] for n in [n0, n1) */
void kt__fma_nt(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *x,
                int64_t ldx, const void *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* nt for 1 to KT__FMA_ROWS_MAX_M rows of f32 x as dot products along w's rows: 4 rows of w
 * read side by side, front to back (a product of a few rows only streams the weights), 16 lanes
 * of partial sums in index order each, added in a fixed tree at the end (not the tiles'
 * order). Denormals as the caller's mode has them. */
#define KT__FMA_ROWS_MAX_M 4
void kt__fma_nt_rows_f32(int64_t M, int64_t n0, int64_t n1, int64_t K, const float *x, int64_t ldx,
                         const float *w, int64_t ldw, float *y, int64_t ldy, int accumulate);

/* y[m, k] = (accumulate ? y : 0) + sum_n g0[m, n] w0[n, k] (+ sum_n g1[m, n] w1[n, k] when g1
 * is not NULL, continuing the same sum) over columns [k0, k1). */
void kt__fma_nn(kt__fma_src src, int64_t M, int64_t N, int64_t k0, int64_t k1, const void *g0,
                const void *w0, const void *g1, const void *w1, int64_t ldg, int64_t ldw, float *y,
                int64_t ldy, int accumulate);

/* For middling row counts, nt and nn with w read in place (fma_unpacked.c, no packed panels).
 *
 * kt__fma_nt_dots: kt__fma_nt's product as dot products along k. Passes of up to 32 rows of x,
 * blocks of up to 8 rows against 2-4 rows of w at a time, 16 lanes of partial sums per output
 * (for bf16 lane j sums the values 32 s + 2 j and 32 s + 2 j + 1 in order, for f32 32 s + j and
 * 32 s + 16 + j), the lanes added in a fixed tree at the end of each chunk of k, the chunks'
 * sums added to y in order. The chunks depend on the pass's rows and K: a row's sums depend on
 * M (call it with the product's rows whole), not on the split of [n0, n1).
 *
 * kt__fma_nn_direct: kt__fma_nn's product, with its sums in its order, bit for bit. */
void kt__fma_nt_dots(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *x,
                     int64_t ldx, const void *w, int64_t ldw, float *y, int64_t ldy,
                     int accumulate);
void kt__fma_nn_direct(kt__fma_src src, int64_t M, int64_t N, int64_t k0, int64_t k1,
                       const void *g0, const void *w0, const void *g1, const void *w1, int64_t ldg,
                       int64_t ldw, float *y, int64_t ldy, int accumulate);

/* The dense matmul's product (fma_packed.c), bf16 only: for rows m in [0, M) and columns n in
 * [n0, n1), c[m, n] = sum_k op(a)[m, k] op(b)[k, n], overwritten. a is [M, K] (row stride lda),
 * or [K, M] when trans_a; b is [K, N], or [N, K] when trans_b: both read in place. Blocked and
 * packed for the caches: B widened once, 512 columns x 256 steps at a time, into `work`
 * (64-byte aligned, kt__fma_packed_mm_work_bytes(n1 - n0) bytes: a multiple of 64 for a
 * multiple of 32 columns, so calls on neighbouring blocks can share a buffer cut at their
 * columns), A's rows widened once for each such block into 136 KiB of stack. The sums are those of
 * kt__fma_nt / kt__fma_nn without accumulate, bit for bit. */
void kt__fma_packed_mm(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1, int64_t K,
                       const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float *c,
                       int64_t ldc, void *work);
size_t kt__fma_packed_mm_work_bytes(int64_t cols);
/* The same product with operands of their own element types (one f32, the other bf16 or f16,
 * widened exactly as they are packed), the same buffers and the same sums: every element of c
 * one f32 sum in index order of k, each product added by an FMA, from zero (the bits of
 * `s = fmaf(a, b, s)` in index order on the widened values). Unless both are bf16, it keeps
 * the caller's floating-point mode (denormals as IEEE has them, as sgemm). */
void kt__fma_packed_mm_mixed(kt__fma_src src_a, kt__fma_src src_b, int trans_a, int trans_b,
                             int64_t M, int64_t n0, int64_t n1, int64_t K, const void *a,
                             int64_t lda, const void *b, int64_t ldb, float *c, int64_t ldc,
                             void *work);
/* Rows from which it serves the dense matmul (registry.c says why). */
#define KT__FMA_PACKED_MIN_M 64

/* dw[n, k] = (accumulate ? dw : 0) + scale sum_m g[m, n] x[m, k] for n in [n0, n1) */
void kt__fma_tn(kt__fma_src src, int64_t M, int64_t n0, int64_t n1, int64_t K, const void *g,
                int64_t ldg, const void *x, int64_t ldx, float *dw, int64_t lddw, float scale,
                int accumulate, void *work);
/* The work buffer TN wants at M rows (0 up to 512 rows; enough for any M' <= M). */
size_t kt__fma_tn_work_bytes(int64_t M);
/* Rows up to which TN keeps its buffers on the stack. */
#define KT__FMA_TN_STACK_ROWS 512

#endif
