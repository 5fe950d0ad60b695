/* The AVX2 + FMA tiles (avx2_gemm.h): one blocked product for every kind, the kinds' entry
 * points adapting their operands to it. */
#include "lib/kernels/avx2_gemm.h"

#ifdef KT__AVX2_GEMM
#include "lib/kernels/avx2_util.h"

/* The blocks: KC steps of the reduction by NC columns of B (128 KiB of panel, in L2), MC rows
 * of A (96 KiB widened); register tiles of up to MR rows by one strip of 16 columns. */
#define KC 256
#define NC 128
#define MC 96
#define MR 6

/* The panel: B's block widened, in strips of 16 columns, each [kc][16] (zeros past nc). */

/* B row-major (B(k, n) at p[k ld + n]): row by row, 16 values a strip */
V_INLINE void pack_b_rows(float *bp, const void *p, int64_t ld, kt__fma_src src, int64_t kc,
                          int64_t nc)
{
    const int64_t strips = (nc + 15) / 16;
    for (int64_t k = 0; k < kc; k++) {
        const char *row = v_elem(p, k * ld, src);
        for (int64_t s = 0; s < strips; s++) {
            float *d = bp + s * kc * 16 + k * 16;
            const int64_t n = nc - 16 * s;
            _mm256_store_ps(d, v_load8(v_elem(row, 16 * s, src), n, src));
            _mm256_store_ps(d + 8, v_load8(v_elem(row, 16 * s + 8, src), n - 8, src));
        }
    }
}

/* 16 bf16 values from p as 8 dwords of pairs (the first n values; zeros after) */
V_INLINE __m256 load_pairs(const uint16_t *p, int64_t n)
{
    if (n >= 16)
        return _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)p));
    uint16_t t[16] = {0};
    if (n > 0)
        memcpy(t, p, (size_t)n * 2);
    return _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)t));
}

/* pack_b_cols for bf16: 8 columns by 16 steps at a time, read as dwords each holding two
 * neighbouring steps and transposed as dwords, so that r[t] lane j holds steps 2t and 2t + 1
 * of column j; a shift widens the first, a mask the second (half the shuffles of transposing
 * the values widened, as fma_util.h's pack_pairs_transposed) */
V_INLINE void pack_b_cols_bf16(float *bp, const uint16_t *p, int64_t ld, int64_t kc, int64_t nc)
{
    const int64_t strips = (nc + 15) / 16;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t s = 0; s < strips; s++)
        for (int h = 0; h < 2; h++) {
            const int64_t n0 = 16 * s + 8 * h;
            for (int64_t k0 = 0; k0 < kc; k0 += 16) {
                __m256 r[8];
                for (int j = 0; j < 8; j++)
                    r[j] = n0 + j < nc ? load_pairs(p + (n0 + j) * ld + k0, kc - k0)
                                       : _mm256_setzero_ps();
                transpose8(r);
                const int64_t kn = kc - k0 < 16 ? kc - k0 : 16;
                float *d = bp + s * kc * 16 + k0 * 16 + 8 * h;
                for (int64_t t = 0; 2 * t < kn; t++) {
                    const __m256i v = _mm256_castps_si256(r[t]);
                    _mm256_store_ps(d + 2 * t * 16, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
                    if (2 * t + 1 < kn)
                        _mm256_store_ps(d + (2 * t + 1) * 16,
                                        _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
                }
            }
        }
}

/* B transposed (B(k, n) at p[n ld + k], NT's w): 8 columns by 8 steps at a time, transposed */
V_INLINE void pack_b_cols(float *bp, const void *p, int64_t ld, kt__fma_src src, int64_t kc,
                          int64_t nc)
{
    if (src == KT__FMA_BF16) {
        pack_b_cols_bf16(bp, p, ld, kc, nc);
        return;
    }
    const int64_t strips = (nc + 15) / 16;
    for (int64_t s = 0; s < strips; s++)
        for (int h = 0; h < 2; h++) {
            const int64_t n0 = 16 * s + 8 * h;
            for (int64_t k0 = 0; k0 < kc; k0 += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; j++)
                    r[j] = n0 + j < nc ? v_load8(v_elem(p, (n0 + j) * ld + k0, src), kc - k0, src)
                                       : _mm256_setzero_ps();
                transpose8(r);
                const int64_t kn = kc - k0 < 8 ? kc - k0 : 8;
                float *d = bp + s * kc * 16 + k0 * 16 + 8 * h;
                for (int64_t t = 0; t < kn; t++)
                    _mm256_store_ps(d + t * 16, r[t]);
            }
        }
}

/* A's block widened in its own layout: rows of `rows` source rows, each `cols` values (the
 * rows lda apart), into rows ldd apart. */
V_INLINE void widen_block(float *d, int64_t ldd, const void *p, int64_t ld, kt__fma_src src,
                          int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        const char *row = v_elem(p, r * ld, src);
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8)
            _mm256_storeu_ps(d + r * ldd + j, v_load8(v_elem(row, j, src), 8, src));
        if (j < cols)
            _mm256_maskstore_ps(d + r * ldd + j, v_lanes8(cols - j),
                                v_load8(v_elem(row, j, src), cols - j, src));
    }
}

/* How a tile meets its output: init, start from c's value; else from zero, and with scaled,
 * c = scale * sum (add: c + scale * sum, two roundings as the reference's). */
typedef struct epilogue {
    int init, scaled, add;
    float scale;
} epilogue;

/* One register tile: R rows by NV vectors of 8 columns (ncols of them valid), over kc steps;
 * a's element (r, k) at a[r ars + k aks], b the strip [kc][16]; with init the sums start
 * from in's values (row stride ldi: c itself, or partial sums elsewhere). */
V_INLINE void tile(const int R, const int NV, int64_t kc, const float *a, int64_t ars, int64_t aks,
                   const float *b, const float *in, int64_t ldi, float *c, int64_t ldc,
                   int64_t ncols, const epilogue *ep)
{
    const int init = ep->init;
    __m256 acc[MR][2];
    const int full = ncols >= 8 * NV;
    const __m256i mk[2] = {v_lanes8(ncols), v_lanes8(ncols - 8)};
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            acc[r][v] = !init  ? _mm256_setzero_ps()
                        : full ? _mm256_loadu_ps(in + r * ldi + 8 * v)
                               : _mm256_maskload_ps(in + r * ldi + 8 * v, mk[v]);
    for (int64_t k = 0; k < kc; k++) {
        __m256 bv[2];
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            bv[v] = _mm256_load_ps(b + k * 16 + 8 * v);
        const float *ak = a + k * aks;
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 av = _mm256_broadcast_ss(ak + r * ars);
#pragma GCC unroll 2
            for (int v = 0; v < NV; v++)
                acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
    const __m256 vs = _mm256_set1_ps(ep->scale);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) {
            float *p = c + r * ldc + 8 * v;
            __m256 x = acc[r][v];
            if (ep->scaled) {
                x = _mm256_mul_ps(vs, x);
                if (ep->add)
                    x = _mm256_add_ps(full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mk[v]), x);
            }
            if (full)
                _mm256_storeu_ps(p, x);
            else
                _mm256_maskstore_ps(p, mk[v], x);
        }
}

#define TILE_CASE(R, NV)                                                                           \
    case (R)*4 + (NV):                                                                             \
        tile(R, NV, kc, a, ars, aks, b, in, ldi, c, ldc, ncols, ep);                               \
        return;

V_TARGET static void tile_any(int R, int64_t kc, const float *a, int64_t ars, int64_t aks,
                              const float *b, const float *in, int64_t ldi, float *c, int64_t ldc,
                              int64_t ncols, const epilogue *ep)
{
    const int nv = ncols > 8 ? 2 : 1;
    switch (R * 4 + nv) {
        TILE_CASE(6, 2)
        TILE_CASE(6, 1) TILE_CASE(5, 2) TILE_CASE(5, 1) TILE_CASE(4, 2) TILE_CASE(4, 1)
            TILE_CASE(3, 2) TILE_CASE(3, 1) TILE_CASE(2, 2) TILE_CASE(2, 1) TILE_CASE(1, 2)
                TILE_CASE(1, 1) default : return;
    }
}
#undef TILE_CASE

/* rows [0, mc) in tiles of at most MR rows, of heights as equal as possible, against every
 * strip of the panel; out (row stride ldo) gets the sums as ep says, those that start from
 * values from in's (row stride ldi) */
V_TARGET static void block_product_from(int64_t mc, int64_t kc, int64_t nc, const float *ap,
                                        int64_t ars, int64_t aks, const float *bp, const float *in,
                                        int64_t ldi, float *out, int64_t ldo, const epilogue *ep)
{
    const int64_t tiles = (mc + MR - 1) / MR, base = mc / tiles, extra = mc % tiles;
    for (int64_t s = 0; s * 16 < nc; s++) {
        const int64_t ncols = nc - 16 * s < 16 ? nc - 16 * s : 16;
        for (int64_t t = 0, r = 0; t < tiles; t++) {
            const int h = (int)(base + (t < extra));
            tile_any(h, kc, ap + r * ars, ars, aks, bp + s * kc * 16, in + r * ldi + 16 * s, ldi,
                     out + r * ldo + 16 * s, ldo, ncols, ep);
            r += h;
        }
    }
}

/* the same with the sums continuing from out's own values */
V_TARGET static void block_product(int64_t mc, int64_t kc, int64_t nc, const float *ap, int64_t ars,
                                   int64_t aks, const float *bp, float *out, int64_t ldo,
                                   const epilogue *ep)
{
    block_product_from(mc, kc, nc, ap, ars, aks, bp, out, ldo, out, ldo, ep);
}

/* A's block [mb, mb + mc) x [kb, kb + kc) widened: *ars, *aks its strides */
V_INLINE void pack_a(float *ap, kt__avx2_op a, int64_t mb, int64_t mc, int64_t kb, int64_t kc,
                     int64_t *ars, int64_t *aks)
{
    if (!a.trans) { /* rows of A */
        widen_block(ap, KC, v_elem(a.p, mb * a.ld + kb, a.src), a.ld, a.src, mc, kc);
        *ars = KC, *aks = 1;
    } else { /* rows of A^T: the reduction's steps */
        widen_block(ap, MC, v_elem(a.p, kb * a.ld + mb, a.src), a.ld, a.src, kc, mc);
        *ars = 1, *aks = MC;
    }
}

V_INLINE void pack_b(float *bp, kt__avx2_op b, int64_t kb, int64_t kc, int64_t nb, int64_t nc)
{
    if (!b.trans)
        pack_b_rows(bp, v_elem(b.p, kb * b.ld + nb, b.src), b.ld, b.src, kc, nc);
    else
        pack_b_cols(bp, v_elem(b.p, nb * b.ld + kb, b.src), b.ld, b.src, kc, nc);
}

V_TARGET void kt__avx2_gemm(int64_t M, int64_t N, int64_t K, kt__avx2_op a, kt__avx2_op b, float *c,
                            int64_t ldc, kt__avx2_out out, float scale)
{
    if (M <= 0 || N <= 0)
        return;
    const int scaled = out == KT__AVX2_SCALED || out == KT__AVX2_SCALED_ADD;
    if (K <= 0) {
        if (out != KT__AVX2_CHAIN)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = 0; n < N; n++) {
                    const float z = scale * 0.0f;
                    c[m * ldc + n] = out == KT__AVX2_OVERWRITE ? 0.0f
                                     : out == KT__AVX2_SCALED  ? z
                                                               : c[m * ldc + n] + z;
                }
        return;
    }
    const unsigned csr = v_flush_denormals(a.src == KT__FMA_BF16 && b.src == KT__FMA_BF16);
    float bp[KC * NC] __attribute__((aligned(32)));
    float ap[MC * KC] __attribute__((aligned(32)));
    if (!scaled) {
        /* the sums continue in C from one block of the reduction to the next (exact: the
         * accumulators are f32), so each panel of B is widened once */
        for (int64_t nb = 0; nb < N; nb += NC) {
            const int64_t nc = N - nb < NC ? N - nb : NC;
            for (int64_t kb = 0; kb < K; kb += KC) {
                const int64_t kc = K - kb < KC ? K - kb : KC;
                pack_b(bp, b, kb, kc, nb, nc);
                const epilogue ep = {kb > 0 || out == KT__AVX2_CHAIN, 0, 0, 1.0f};
                for (int64_t mb = 0; mb < M; mb += MC) {
                    const int64_t mc = M - mb < MC ? M - mb : MC;
                    int64_t ars, aks;
                    pack_a(ap, a, mb, mc, kb, kc, &ars, &aks);
                    block_product(mc, kc, nc, ap, ars, aks, bp, c + mb * ldc + nb, ldc, &ep);
                }
            }
        }
    } else if (K <= KC) {
        /* TN whose reduction is one block: each tile's sums scaled into C as they leave the
         * registers, each panel of B widened once */
        const epilogue ep = {0, 1, out == KT__AVX2_SCALED_ADD, scale};
        for (int64_t nb = 0; nb < N; nb += NC) {
            const int64_t nc = N - nb < NC ? N - nb : NC;
            pack_b(bp, b, 0, K, nb, nc);
            for (int64_t mb = 0; mb < M; mb += MC) {
                const int64_t mc = M - mb < MC ? M - mb : MC;
                int64_t ars, aks;
                pack_a(ap, a, mb, mc, 0, K, &ars, &aks);
                block_product(mc, K, nc, ap, ars, aks, bp, c + mb * ldc + nb, ldc, &ep);
            }
        }
    } else {
        /* TN over longer reductions: the whole sum first (in a block of its own, continued
         * from one block of the reduction to the next), then scaled into C */
        float sum[MC * NC] __attribute__((aligned(32)));
        const epilogue last = {1, 1, out == KT__AVX2_SCALED_ADD, scale};
        for (int64_t nb = 0; nb < N; nb += NC) {
            const int64_t nc = N - nb < NC ? N - nb : NC;
            for (int64_t mb = 0; mb < M; mb += MC) {
                const int64_t mc = M - mb < MC ? M - mb : MC;
                for (int64_t kb = 0; kb < K; kb += KC) {
                    const int64_t kc = K - kb < KC ? K - kb : KC;
                    pack_b(bp, b, kb, kc, nb, nc);
                    int64_t ars, aks;
                    pack_a(ap, a, mb, mc, kb, kc, &ars, &aks);
                    if (kb + kc < K) {
                        const epilogue ep = {kb > 0, 0, 0, 1.0f};
                        block_product(mc, kc, nc, ap, ars, aks, bp, sum, NC, &ep);
                    } else { /* the last block: from the partial sums into C */
                        block_product_from(mc, kc, nc, ap, ars, aks, bp, sum, NC, c + mb * ldc + nb,
                                           ldc, &last);
                    }
                }
            }
        }
    }
    _mm_setcsr(csr);
}
#endif
