/* The dense matmul's bf16 product on the f32 FMA units, blocked and packed (fma_gemm.h,
 * kt__fma_packed_mm), and its mixed product (an f32 operand with a bf16 or f16 one,
 * kt__fma_packed_mm_mixed), the same code with each operand widened from its own type. Per call (a block of columns [n0, n1), all M rows), for each PNB columns
 * and PKC steps of the reduction:
 *  - B's block is widened to f32 once, as panels [step][32] in the caller's work buffer (in L2;
 *    one panel stays in L1 while every tile of PMC rows runs over it);
 *  - A's rows are widened up to PMC at a time, once per block: as rows [row][PAR] when A is stored
 *    [M, K], as each tile's panel [step][12] when A is stored [K, M] (then the packing reads A's
 *    rows in place: 12 neighbours of a row are the 12 rows of a tile at one step);
 *  - a register tile of up to 12 rows x 32 columns (24 zmm of sums, one broadcast per row and
 *    step, as fma_gemm.c's tile) runs over the block's steps, starting from C's partial sums
 *    after the first block, and fetches the next tile's rows of C meanwhile.
 * So every element of C is one f32 sum in index order of k, each product added by an FMA: the
 * sums (and bits) of the fma path's NT and NN (fma_gemm.h), whatever the blocks and the split
 * of the columns. bf16 products are exact in f32; denormals are flushed as there. */
#include <string.h>

#include "lib/kernels/fma_gemm.h"
#include "lib/kernels/fma_util.h"
#include "lib/kernels/lane_mask.h"
#include "lib/kernels/prefetch.h"

#ifdef KT__FMA_GEMM

#define PR 12   /* rows of a tile */
#define PC 32   /* columns of a tile and of a panel */
#define PKC 256 /* reduction steps of a block: a panel [256][32] f32 is 32 KiB, L1 holds it */
#define PMC 128 /* rows of A widened at once at most: [128][272] f32, 136 KiB on the stack,
                 * in L2; M is cut into blocks of equal heights (128 rows: one pass over B) */
#define PNB 512 /* columns of B widened at once: 512 KiB of panels, in L2 */
#define PAR (PKC + 16) /* A's widened rows lie this far apart: 12 rows 1 KiB apart would share
                        * 4 of L1's 64 sets */

/* c[i, 0:ncols] (i < MR; MR a constant where inlined) = (load ? c : 0) + the kc steps'
 * a(i, k) * b[k][0:32], a(i, k) at a[i * AROW + k * AK]. The next tile's rows of C (rows of
 * 32 values ldc apart, NULL: none) are fetched first: nothing else brings them in. */
W_INLINE void ptile_run(const int MR, const int AROW, const int AK, const float *a,
                        const float *b, int64_t kc, float *c, int64_t ldc, int64_t ncols, int load,
                        const float *next, int next_rows)
{
    for (int i = 0; next != NULL && i < next_rows; i++) {
        kt__prefetch_line(next + i * ldc, KT__PF_WRITE);
        kt__prefetch_line(next + i * ldc + 16, KT__PF_WRITE);
    }
    const __mmask16 m0 = kt__lanes16(ncols), m1 = kt__lanes16(ncols - 16);
    __m512 acc[PR][2];
    for (int i = 0; i < MR; i++) {
        acc[i][0] = load ? _mm512_maskz_loadu_ps(m0, c + i * ldc) : _mm512_setzero_ps();
        acc[i][1] = load ? _mm512_maskz_loadu_ps(m1, c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_load_ps(b + k * PC), b1 = _mm512_load_ps(b + k * PC + 16);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            const __m512 ai = _mm512_set1_ps(a[i * AROW + k * AK]);
            acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
        _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
    }
}

#define PTILE_CASE(MR)                                                                             \
    case MR:                                                                                       \
        if (panel)                                                                                 \
            ptile_run(MR, 1, PR, a, b, kc, c, ldc, ncols, load, next, next_rows);                  \
        else                                                                                       \
            ptile_run(MR, PAR, 1, a, b, kc, c, ldc, ncols, load, next, next_rows);                 \
        break;

/* A tile of mr rows (1..12), each height a constant so the sums stay in registers. panel: a is
 * the tile's [kc][12], else rows [mr][PAR]. */
W_TARGET static void ptile(int mr, int panel, const float *a, const float *b, int64_t kc, float *c,
                           int64_t ldc, int64_t ncols, int load, const float *next, int next_rows)
{
    switch (mr) {
        PTILE_CASE(1)
        PTILE_CASE(2)
        PTILE_CASE(3)
        PTILE_CASE(4)
        PTILE_CASE(5)
        PTILE_CASE(6)
        PTILE_CASE(7)
        PTILE_CASE(8)
        PTILE_CASE(9)
        PTILE_CASE(10)
        PTILE_CASE(11)
        PTILE_CASE(12)
    default:
        break;
    }
}
#undef PTILE_CASE

/* B's block as panels: bp[p][k][0:32] = op(B)[kb + k, nb + 32 p + j] for k < kc, zeros past
 * the block's nc columns. trans_b: B is [N, K] (a transposed pack), else [K, N] (rows). */
W_TARGET static void pack_b(float *bp, kt__fma_src src, int trans_b, const void *b, int64_t ldb,
                            int64_t kb, int64_t kc, int64_t nb, int64_t nc)
{
    for (int64_t p = 0; p * PC < nc; p++) {
        float *dst = bp + p * PKC * PC;
        const int64_t cols = nc - p * PC < PC ? nc - p * PC : PC;
        if (trans_b && src == KT__FMA_BF16)
            pack_pairs_transposed(dst, (const uint16_t *)b + (nb + p * PC) * ldb + kb, ldb, cols,
                                  kc);
        else if (trans_b)
            pack_widened_transposed(dst, elem(b, (nb + p * PC) * ldb + kb, src), ldb, cols, kc,
                                    src);
        else
            for (int64_t k = 0; k < kc; k++)
                load_row(dst + k * PC, elem(b, (kb + k) * ldb + nb + p * PC, src), cols, PC, src);
    }
}

/* A's rows [mb, mb + mc) over steps [kb, kb + kc) for the tiles of tl. Rows (A [M, K]):
 * ap[i][k], PAR apart. Panels (A [K, M]): tile t's ap[t * PKC * 12 + k * 12 + i]; each step's
 * store writes 16 lanes, the 4 past the tile's 12 overwritten by the next step (or landing in
 * the slack after the last). */
W_TARGET static void pack_a(float *ap, kt__fma_src src, int trans_a, const void *a, int64_t lda,
                            int64_t kb, int64_t kc, int64_t mb, int64_t mc, const tiling *tl)
{
    if (!trans_a) {
        widen_rows(ap, PAR, elem(a, mb * lda + kb, src), lda, mc, kc, src);
        return;
    }
    for (int64_t t = 0; t < tl->n; t++) {
        float *dst = ap + t * PKC * PR;
        const char *from = elem(a, kb * lda + mb + tile_start(tl, t), src);
        const int h = tile_height(tl, t);
        for (int64_t k = 0; k < kc; k++)
            _mm512_storeu_ps(dst + k * PR, load16(from + bytes_of(k * lda, src), h, src));
    }
}

size_t kt__fma_packed_mm_work_bytes(int64_t cols)
{
    return cols <= 0 ? 0 : (size_t)((cols + PC - 1) / PC) * PKC * PC * sizeof(float);
}

/* The product on operands of types sa and sb (inlined for each pair the entry points pass, so
 * the packing's type tests fold away). */
W_INLINE void packed_mm(kt__fma_src sa, kt__fma_src sb, int trans_a, int trans_b, int64_t M,
                        int64_t n0, int64_t n1, int64_t K, const void *a, int64_t lda,
                        const void *b, int64_t ldb, float *c, int64_t ldc, void *work)
{
    if (M <= 0 || n1 <= n0)
        return;
    if (K <= 0) {
        for (int64_t m = 0; m < M; m++)
            memset(c + m * ldc + n0, 0, (size_t)(n1 - n0) * sizeof(float));
        return;
    }
    const unsigned csr =
        flush_denormals(sa == KT__FMA_BF16 && sb == KT__FMA_BF16 ? KT__FMA_BF16 : KT__FMA_F32);
    const tiling blocks = tiles_of(M, PMC);
    float *bp = work;
    float ap[PMC * PAR] __attribute__((aligned(64)));
    for (int64_t nb = n0; nb < n1; nb += PNB) {
        const int64_t nc = n1 - nb < PNB ? n1 - nb : PNB, panels = (nc + PC - 1) / PC;
        for (int64_t kb = 0; kb < K; kb += PKC) {
            const int64_t kc = K - kb < PKC ? K - kb : PKC;
            pack_b(bp, sb, trans_b, b, ldb, kb, kc, nb, nc);
            for (int64_t bi = 0; bi < blocks.n; bi++) {
                const int64_t mb = tile_start(&blocks, bi), mc = tile_height(&blocks, bi);
                const tiling tl = tiles_of(mc, PR);
                pack_a(ap, sa, trans_a, a, lda, kb, kc, mb, mc, &tl);
                for (int64_t p = 0; p < panels; p++) {
                    const int64_t cols = nc - p * PC < PC ? nc - p * PC : PC;
                    float *cp = c + mb * ldc + nb + p * PC;
                    for (int64_t t = 0; t < tl.n; t++) {
                        const int64_t r = tile_start(&tl, t);
                        const float *at = trans_a ? ap + t * PKC * PR : ap + r * PAR;
                        /* the next tile: this panel's next rows, else the next panel's first */
                        const float *next = t + 1 < tl.n    ? cp + tile_start(&tl, t + 1) * ldc
                                            : p + 1 < panels ? cp + PC
                                                             : NULL;
                        const int next_rows = tile_height(&tl, t + 1 < tl.n ? t + 1 : 0);
                        ptile(tile_height(&tl, t), trans_a, at, bp + p * PKC * PC, kc,
                              cp + r * ldc, ldc, cols, kb > 0, next, next_rows);
                    }
                }
            }
        }
    }
    _mm_setcsr(csr);
}

W_TARGET void kt__fma_packed_mm(int trans_a, int trans_b, int64_t M, int64_t n0, int64_t n1,
                                int64_t K, const uint16_t *a, int64_t lda, const uint16_t *b,
                                int64_t ldb, float *c, int64_t ldc, void *work)
{
    packed_mm(KT__FMA_BF16, KT__FMA_BF16, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c, ldc,
              work);
}

W_TARGET void kt__fma_packed_mm_mixed(kt__fma_src src_a, kt__fma_src src_b, int trans_a,
                                      int trans_b, int64_t M, int64_t n0, int64_t n1, int64_t K,
                                      const void *a, int64_t lda, const void *b, int64_t ldb,
                                      float *c, int64_t ldc, void *work)
{
    if (src_a == KT__FMA_F32 && src_b == KT__FMA_BF16)
        packed_mm(KT__FMA_F32, KT__FMA_BF16, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c,
                  ldc, work);
    else if (src_a == KT__FMA_F32 && src_b == KT__FMA_F16)
        packed_mm(KT__FMA_F32, KT__FMA_F16, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c,
                  ldc, work);
    else if (src_a == KT__FMA_BF16 && src_b == KT__FMA_F32)
        packed_mm(KT__FMA_BF16, KT__FMA_F32, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c,
                  ldc, work);
    else if (src_a == KT__FMA_F16 && src_b == KT__FMA_F32)
        packed_mm(KT__FMA_F16, KT__FMA_F32, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c,
                  ldc, work);
    else
        packed_mm(src_a, src_b, trans_a, trans_b, M, n0, n1, K, a, lda, b, ldb, c, ldc, work);
}

#endif
