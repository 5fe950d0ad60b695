/* The quantized products (quant_gemm.h): the dispatch through the registry (KT__KP_NT_Q,
 * KT__KP_NN_Q), the scalar references, and the panel path: a block of the weight is dequantised to bf16
 * (the exact values kt__q_value gives) in the work buffer, sized to stay in L2, and the bf16
 * kernels of the registry multiply it (AMX, vdpbf16ps, the FMA or AVX2 paths, or scalar, as
 * they choose by M). The dequantisation is vectorised with AVX-512 BF16 (quant_avx512.c, where
 * NT of a few rows runs on the weights in place too) or AVX2 (quant_avx2.c), scalar elsewhere. */
#include "lib/kernels/quant_gemm.h"

#include "kt/tensor.h"
#include "lib/core/cpu_internal.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/quant_avx2.h"
#include "lib/kernels/quant_avx512.h"
#include "lib/kernels/registry.h"


/* Panel bytes aimed at: half of a 2 MiB L2, so that x (or g) and y's block stay beside it. */
#define PANEL_BYTES (128u * 1024u)
#define PANEL_ALIGN 16 /* rows or columns of a panel come in multiples of this */

/* NT's rows of w per panel, NN's columns per panel (each of the one or two weights). */
static int64_t nt_rows(int64_t cols)
{
    const int64_t r = (int64_t)(PANEL_BYTES / 2) / (cols > 0 ? cols : 1);
    return r < PANEL_ALIGN ? PANEL_ALIGN : r / PANEL_ALIGN * PANEL_ALIGN;
}
static int64_t nn_cols(int64_t rows)
{
    const int64_t c = nt_rows(rows);
    return c < KT__Q4_BLOCK ? KT__Q4_BLOCK : c / KT__Q4_BLOCK * KT__Q4_BLOCK; /* whole blocks */
}

size_t kt__q_gemm_work_bytes(int64_t rows, int64_t cols, int64_t max_m)
{
    (void)max_m;
    const size_t nt = (size_t)nt_rows(cols) * (size_t)cols * 2;
    const size_t nn = 2 * (size_t)rows * (size_t)nn_cols(rows) * 2;
    return (nt > nn ? nt : nn) + 64;
}

static uint16_t *panel_at(void *work, size_t offset)
{
    return (uint16_t *)(void *)((unsigned char *)work + offset);
}

/* Rows [r0, r1), columns [c0, c1) of deq(w) as bf16 into out (row stride ldo). */
static void dequant(const kt__qmat *w, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                    uint16_t *out, int64_t ldo)
{
    if (kt__cpu_has_avx512_bf16())
        kt__q_dequant_avx512(w, r0, r1, c0, c1, out, ldo);
    else if (kt__cpu_has_avx2())
        kt__q_dequant_avx2(w, r0, r1, c0, c1, out, ldo);
    else
        kt__q_dequant_bf16(w, r0, r1, c0, c1, out, ldo);
}

void kt__q_panel_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                    const kt__qmat *w, float *y, int64_t ldy, void *work)
{
    const int64_t K = w->cols, step = nt_rows(K);
    uint16_t *panel = panel_at(work, 0);
    for (int64_t n = n0; n < n1; n += step) {
        const int64_t rows = n1 - n < step ? n1 - n : step;
        dequant(w, n, n + rows, 0, K, panel, K);
        kt__bf16_gemm_nt(M, 0, rows, K, x, ldx, panel, K, y + n, ldy, 0);
    }
}

void kt__q_panel_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                    const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                    void *work)
{
    const int64_t N = w0->rows, step = nn_cols(N);
    uint16_t *p0 = panel_at(work, 0);
    uint16_t *p1 = panel_at(work, (size_t)N * (size_t)step * 2);
    for (int64_t c = c0; c < c1; c += step) {
        const int64_t cols = c1 - c < step ? c1 - c : step;
        dequant(w0, 0, N, c, c + cols, p0, cols);
        if (g1 == NULL) {
            kt__bf16_gemm_nn(M, N, 0, cols, g0, ldg, p0, cols, y + (c - c0), ldy, 0);
            continue;
        }
        dequant(w1, 0, N, c, c + cols, p1, cols);
        kt__bf16_gemm_nn2(M, N, 0, cols, g0, p0, g1, p1, ldg, cols, y + (c - c0), ldy, 0);
    }
}

static float bf(uint16_t v) { return kt_bf16_to_f32_1(v); }

void kt__q_ref_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                  const kt__qmat *w, float *y, int64_t ldy, void *work)
{
    (void)work;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < w->cols; k++)
                s += bf(x[m * ldx + k]) * kt__q_value(w, n, k);
            y[m * ldy + n] = s;
        }
}

void kt__q_ref_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                  const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                  void *work)
{
    (void)work;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = c0; c < c1; c++) {
            float s = 0.0f;
            for (int64_t n = 0; n < w0->rows; n++)
                s += bf(g0[m * ldg + n]) * kt__q_value(w0, n, c);
            for (int64_t n = 0; g1 != NULL && n < w1->rows; n++)
                s += bf(g1[m * ldg + n]) * kt__q_value(w1, n, c);
            y[m * ldy + (c - c0)] = s;
        }
}

void kt__q_gemm_nt(int64_t M, int64_t n0, int64_t n1, const uint16_t *x, int64_t ldx,
                   const kt__qmat *w, float *y, int64_t ldy, void *work)
{
    kt__kpath_pick(KT__KP_NT_Q, M)->nt_q(M, n0, n1, x, ldx, w, y, ldy, work);
}

void kt__q_gemm_nn(int64_t M, int64_t c0, int64_t c1, const uint16_t *g0, const kt__qmat *w0,
                   const uint16_t *g1, const kt__qmat *w1, int64_t ldg, float *y, int64_t ldy,
                   void *work)
{
    kt__kpath_pick(KT__KP_NN_Q, M)->nn_q(M, c0, c1, g0, w0, g1, w1, ldg, y, ldy, work);
}

const char *kt__q_gemm_path(int nn, int64_t M)
{
    return kt__kpath_pick(nn ? KT__KP_NN_Q : KT__KP_NT_Q, M)->name;
}
