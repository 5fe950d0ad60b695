/* The backward, phase by phase (rows sorted by expert as in forward), row (t, j) with
 * routing weight w = w[t, j]:
 *   gap = gy[t] Wd  (+ LoRA),  grad_w[t, j] = <gy[t], d_(t,j)> = <gap, a>,
 *   ga = w gap,  gg = ga u silu'(g),  gu = ga silu(g)
 *   gx = gg Wg + gu Wu  (+ LoRA),  grad_x[t] = sum_j gx_(t,j) in slot order
 * and by mode the LoRA gradients or dWd += s gd^T a (gd = w gy[t]), dWg += s gg^T x,
 * dWu += s gu^T x. Taking the routing gradient as <gap, a> (a = silu(g) u, rebuilt where the
 * SiLU derivative reads g and u anyway) means forward keeps no expert outputs d, and a
 * recompute skips the down GEMM. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/silu_epilogue.h"
#include "lib/moe/moe_internal.h"
#include "lib/kernels/prefetch.h"
#include "lib/kernels/sgemm.h"

typedef struct bwd_ctx {
    kt_moe *m;
    const kt_tensor *gy;
    kt_tensor *gxo;
    float scale;
    /* full mode, first micro-batch of a step: the weight-gradient GEMMs store instead of
     * adding (experts without tokens are zeroed instead) */
    int dw_overwrite;
    /* the SiLU derivative also stores act (LoRA and full mode with kept activations) */
    int write_ac;
} bwd_ctx;

/* Per token: grad_y into each of its slots' rows in the compute dtype (grad_y_rows; the down
 * input gradient's input), with LoRA and full also weighted by the slot's routing weight
 * (grad_y_weighted; their weight gradients' input), and each row's routing weight. A bf16 gy row is
 * widened piece by piece (once per token when H fits one piece). */
static void gy_rows_part(void *vctx, int64_t t0, int64_t t1, int thread)
{
    (void)thread;
    bwd_ctx *c = vctx;
    kt_moe *m = c->m;
    int gbf = m->cfg.act_dtype == KT_BF16;
    _Alignas(64) float buf[KT__MOE_ROW_CHUNK];
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *gyb = (const uint16_t *)c->gy->data + t * m->dim.H;
        const float *gyf = (const float *)c->gy->data + t * m->dim.H;
        if (gbf && m->dim.H <= KT__MOE_ROW_CHUNK)
            kt_bf16_to_f32(buf, gyb, (size_t)m->dim.H);
        for (int64_t j = 0; j < m->dim.K; j++) {
            const int64_t s = t * m->dim.K + j, r = m->route.slot_row[s];
            m->bwd.row_weight[r] = m->route.slot_weight[s];
            for (int64_t h0 = 0; h0 < m->dim.H; h0 += KT__MOE_ROW_CHUNK) {
                const int64_t n =
                    m->dim.H - h0 < KT__MOE_ROW_CHUNK ? m->dim.H - h0 : KT__MOE_ROW_CHUNK;
                if (gbf && m->dim.H > KT__MOE_ROW_CHUNK)
                    kt_bf16_to_f32(buf, gyb + h0, (size_t)n);
                const float *src = gbf ? buf : gyf + h0;
                kt__moe_scale_store(n, src, 1.0f,
                                    kt__moe_cdt_at(m, m->bwd.grad_y_rows, r * m->dim.ld_h + h0),
                                    m->dim.bf16);
                if (m->bwd.grad_y_weighted != NULL)
                    kt__moe_scale_store(
                        n, src, m->route.slot_weight[s],
                        kt__moe_cdt_at(m, m->bwd.grad_y_weighted, r * m->dim.ld_h + h0),
                        m->dim.bf16);
            }
        }
    }
}

/* The routing gradient of each slot of tokens [t0, t1): its row's 16-column pieces of
 * <grad_y down, a> (from the SiLU derivative's pass) summed in order. */
static void gw_part(void *vctx, int64_t t0, int64_t t1, int thread)
{
    (void)thread;
    kt_moe *m = ((bwd_ctx *)vctx)->m;
    const int64_t nb = kt__moe_gw_pieces(m);
    for (int64_t s = t0 * m->dim.K; s < t1 * m->dim.K; s++) {
        const float *p = m->bwd.grad_w_pieces + (int64_t)m->route.slot_row[s] * nb;
        double acc = 0.0;
        for (int64_t b = 0; b < nb; b++)
            acc += (double)p[b];
        m->bwd.grad_w_slots[s] = (float)acc;
    }
}

/* ga (grad_act: the down projection's input gradient) is read back by the SiLU derivative a step of
 * columns at a time. In tiled layers with few enough threads, ga never leaves its step: each
 * thread has one block of rows x step columns (the step's width as row stride), at most
 * GA_BLOCK_FLOATS, that stays in L2, instead of an [N, I] array whose lines would be fetched
 * from memory only to be overwritten, then written back, then read once (f32 through
 * kt__sgemm computes all of ga first, and with many threads the blocks would outgrow the
 * array, so those keep it). Steps are GA_SUB_COLS wide, or under GA_SMALL_M rows a task's columns
 * in one step. */
#define GA_SUB_COLS 128
#define GA_SMALL_M 12
#define GA_BLOCK_FLOATS 65536 /* 256 KiB */
/* Above this many rows an expert's steps go in chunks of rows, so that a step of
 * GA_SUB_COLS columns fits the block: narrower steps (80 columns at 768 rows, as it was) read
 * each row of the weights as a shorter run, once per chunk of NN's rows. */
#define GA_MAX_ROWS (GA_BLOCK_FLOATS / GA_SUB_COLS)
/* The derivative's rows this far ahead have their pieces of the kept g and u (read) and of
 * gg and gu (written) fetched early: pieces of a few hundred bytes out of rows kilobytes
 * apart, from memory, which the hardware prefetchers do not follow. */
#define ACT_PREFETCH_ROWS 4

/* The routing gradient's pieces are indexed by column / 16: every task and step starts on
 * a multiple of 16 (plan_parts cuts at KT__MOE_COL_ALIGN, ga_step's widths are multiples of
 * 16). */
_Static_assert(KT__MOE_COL_ALIGN % 16 == 0, "column cuts must fall on 16-column pieces");

/* Columns per step for a chunk of `rows` rows (at most GA_MAX_ROWS). The NN kernel's results
 * do not depend on how the columns are cut, so neither do the gradients. */
static int64_t ga_step(int64_t rows, int64_t task_cols)
{
    return rows < GA_SMALL_M ? task_cols : GA_SUB_COLS;
}

size_t kt__moe_ga_floats(const kt_moe *m)
{
    /* a step: at most GA_MAX_ROWS x GA_SUB_COLS, or under GA_SMALL_M rows a whole task */
    size_t f = GA_BLOCK_FLOATS;
    if ((size_t)(GA_SMALL_M - 1) * (size_t)m->dim.I > f)
        f = (size_t)(GA_SMALL_M - 1) * (size_t)m->dim.I;
    return (f + 15) / 16 * 16; /* whole cache lines: no block shares one with the next */
}

/* This thread's TN work buffer (sized for T rows, the most an expert has), or NULL (T <= 512,
 * or f32 through kt__sgemm: the kernels need none) */
static void *tn_work(const kt_moe *m, int thread)
{
    return m->bwd.tn_work != NULL
               ? m->bwd.tn_work + (size_t)thread * kt__moe_gemm_tn_work_bytes(m, m->dim.T)
               : NULL;
}

int kt__moe_ga_per_thread(const kt_moe *m)
{
    return m->dim.tiled &&
           (size_t)m->n_threads * kt__moe_ga_floats(m) < (size_t)m->dim.N * (size_t)m->dim.I;
}

/* grad_gate_pre, grad_up_pre = the SiLU derivative of rows [r0, r1) over columns [c0, c1),
 * grad_act's row r at ga + (r - r0) * ldga */
static void act_bwd_rows(kt_moe *m, int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float *ga,
                         int64_t ldga, int write_ac)
{
    const size_t n = (size_t)(c1 - c0);
    for (int64_t r = r0; r < r1; r++) {
        if (r + ACT_PREFETCH_ROWS < r1) {
            const int64_t k = (r + ACT_PREFETCH_ROWS) * m->dim.I + c0;
            kt__prefetch_range(m->fwd.gate_pre + k, n * sizeof(float), KT__PF_READ);
            kt__prefetch_range(m->fwd.up_pre + k, n * sizeof(float), KT__PF_READ);
            kt__prefetch_range(kt__moe_cdt_at(m, m->bwd.grad_gate_pre, k), n * m->dim.cdt_bytes,
                               KT__PF_WRITE);
            kt__prefetch_range(kt__moe_cdt_at(m, m->bwd.grad_up_pre, k), n * m->dim.cdt_bytes,
                               KT__PF_WRITE);
        }
        const int64_t k = r * m->dim.I + c0;
        kt__moe_act_bwd(c1 - c0, m->fwd.gate_pre + k, m->fwd.up_pre + k, ga + (r - r0) * ldga,
                        m->bwd.row_weight[r], kt__moe_cdt_at(m, m->bwd.grad_gate_pre, k),
                        kt__moe_cdt_at(m, m->bwd.grad_up_pre, k),
                        write_ac ? kt__moe_cdt_at(m, m->fwd.act, k) : NULL,
                        m->bwd.grad_w_pieces + r * kt__moe_gw_pieces(m) + c0 / 16, m->dim.bf16);
    }
}

static void ga_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    const bwd_ctx *c = vctx;
    kt_moe *m = c->m;
    float *own =
        kt__moe_ga_per_thread(m) ? m->bwd.grad_act + (size_t)thread * kt__moe_ga_floats(m) : NULL;
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        const int64_t row0 = m->route.row_start[t->e], rows_e = m->route.row_start[t->e + 1] - row0;
        /* an expert's rows in balanced chunks of at most GA_MAX_ROWS (the columns of a step
         * then stay GA_SUB_COLS wide) */
        const int64_t chunks = (rows_e + GA_MAX_ROWS - 1) / GA_MAX_ROWS;
        for (int64_t rc = 0; rc < chunks; rc++) {
            const int64_t r0 = row0 + rc * rows_e / chunks, r1 = row0 + (rc + 1) * rows_e / chunks;
            const int64_t rows = r1 - r0, sub = ga_step(rows, t->c1 - t->c0);
            for (int64_t c0 = t->c0; c0 < t->c1; c0 += sub) {
                const kt__moe_task st = {t->e, c0, t->c1 - c0 < sub ? t->c1 : c0 + sub};
                float *ga = own ? own : m->bwd.grad_act + r0 * m->dim.I + c0;
                const int64_t ldga = own ? st.c1 - st.c0 : m->dim.I;
                if (m->dim
                        .tiled) { /* the weights from column c0 on, so that ga starts at column 0 */
                    const void *wd = kt__moe_weight_ptr(m, t->e, KT_MOE_DOWN);
                    kt__moe_gemm_nn(m, thread, rows, m->dim.H, st.c0, st.c1,
                                    kt__moe_cdt_at(m, m->bwd.grad_y_rows, r0 * m->dim.ld_h),
                                    m->dim.ld_h, wd, m->dim.I, ga, ldga);
                }
                if (m->cfg.mode == KT_MOE_LORA)
                    kt__moe_lora_gin_add(m, KT_MOE_DOWN, &st, r0, r1, ga, ldga);
                act_bwd_rows(m, r0, r1, st.c0, st.c1, ga, ldga, c->write_ac);
            }
        }
    }
}

/* gx is stored past the caches when it is this large (it is read back once, by the
 * per-token sum, after every expert's rows are written). Only the bf16 vdpbf16ps kernel
 * streams; the FMA tiles and the in-place kernels (bf16 on Intel, f32) store plainly. */
#define GX_STREAM_BYTES (8u << 20)

static int stream_gx(const kt_moe *m)
{
    /* LoRA adds its adapters' part to gx right after (kt__moe_lora_gin_add) */
    return m->cfg.mode != KT_MOE_LORA &&
           (size_t)m->route.row_start[m->dim.E] * (size_t)m->dim.H * sizeof(float) >=
               GX_STREAM_BYTES;
}

/* LoRA's adapters add to a block of gx right after the GEMM has written it, while it is still
 * in L2: added after a whole task's columns, gx came back from L3 or memory. A block is
 * GX_LORA_BLOCK_BYTES of gx, at least GX_LORA_COLS columns: with 128 columns at every row
 * count, an expert of a dozen rows walked the weights 256 bytes a row per call. */
#define GX_LORA_COLS 128
#define GX_LORA_BLOCK_BYTES (256 * 1024)

static int64_t gx_lora_step(int64_t rows)
{
    const int64_t cols = GX_LORA_BLOCK_BYTES / ((rows > 0 ? rows : 1) * (int64_t)sizeof(float));
    return cols > GX_LORA_COLS ? cols / KT__MOE_COL_ALIGN * KT__MOE_COL_ALIGN : GX_LORA_COLS;
}

static void gx_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    kt_moe *m = ((bwd_ctx *)vctx)->m;
    const int lora = m->cfg.mode == KT_MOE_LORA;
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        const int64_t row0 = m->route.row_start[t->e], rows_e = m->route.row_start[t->e + 1] - row0;
        const int64_t step = lora ? gx_lora_step(rows_e) : t->c1 - t->c0;
        for (int64_t c0 = t->c0; c0 < t->c1; c0 += step) {
            const kt__moe_task st = {t->e, c0, t->c1 - c0 < step ? t->c1 : c0 + step};
            if (m->dim.tiled) {
                kt__moe_gemm_nn2(m, thread, rows_e, m->dim.I, st.c0, st.c1,
                                 kt__moe_cdt_at(m, m->bwd.grad_gate_pre, row0 * m->dim.I),
                                 kt__moe_weight_ptr(m, t->e, KT_MOE_GATE),
                                 kt__moe_cdt_at(m, m->bwd.grad_up_pre, row0 * m->dim.I),
                                 kt__moe_weight_ptr(m, t->e, KT_MOE_UP), m->dim.I, m->dim.H,
                                 m->bwd.grad_x_rows + row0 * m->dim.H, m->dim.H, stream_gx(m));
            }
            if (lora) {
                float *gx = m->bwd.grad_x_rows + row0 * m->dim.H + st.c0;
                kt__moe_lora_gin_add(m, KT_MOE_GATE, &st, row0, row0 + rows_e, gx, m->dim.H);
                kt__moe_lora_gin_add(m, KT_MOE_UP, &st, row0, row0 + rows_e, gx, m->dim.H);
            }
        }
    }
}

/* Full mode, tiled: rows [c0, c1) of dW for each task's expert. */
static void dwd_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    bwd_ctx *c = vctx;
    kt_moe *m = c->m;
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        int64_t row0 = m->route.row_start[t->e], rows_e = m->route.row_start[t->e + 1] - row0;
        float *dw = m->train.weight_grad + (t->e * 3 + KT_MOE_DOWN) * m->dim.H * m->dim.I;
        kt__moe_gemm_tn(m, rows_e, t->c0, t->c1, m->dim.I,
                        kt__moe_cdt_at(m, m->bwd.grad_y_weighted, row0 * m->dim.ld_h), m->dim.ld_h,
                        kt__moe_cdt_at(m, m->fwd.act, row0 * m->dim.I), m->dim.I, dw, m->dim.I,
                        c->scale, !c->dw_overwrite, tn_work(m, thread));
    }
}

static void dwgu_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    bwd_ctx *c = vctx;
    kt_moe *m = c->m;
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        int64_t row0 = m->route.row_start[t->e], rows_e = m->route.row_start[t->e + 1] - row0;
        const void *x = kt__moe_cdt_at(m, m->fwd.x_rows, row0 * m->dim.ld_h);
        float *dwg = m->train.weight_grad + (t->e * 3 + KT_MOE_GATE) * m->dim.H * m->dim.I;
        float *dwu = m->train.weight_grad + (t->e * 3 + KT_MOE_UP) * m->dim.H * m->dim.I;
        kt__moe_gemm_tn(m, rows_e, t->c0, t->c1, m->dim.H,
                        kt__moe_cdt_at(m, m->bwd.grad_gate_pre, row0 * m->dim.I), m->dim.I, x,
                        m->dim.ld_h, dwg, m->dim.H, c->scale, !c->dw_overwrite, tn_work(m, thread));
        kt__moe_gemm_tn(m, rows_e, t->c0, t->c1, m->dim.H,
                        kt__moe_cdt_at(m, m->bwd.grad_up_pre, row0 * m->dim.I), m->dim.I, x,
                        m->dim.ld_h, dwu, m->dim.H, c->scale, !c->dw_overwrite, tn_work(m, thread));
    }
}

/* Token t's grad_x columns [h0, h0 + n): its slots' rows summed in slot order (also what
 * check_finite tests before anything is written) */
static void gx_token_sum(const kt_moe *m, int64_t t, int64_t h0, int64_t n, float *s)
{
    for (int64_t h = 0; h < n; h++)
        s[h] = 0.0f;
    for (int64_t j = 0; j < m->dim.K; j++) {
        const float *g =
            m->bwd.grad_x_rows + (int64_t)m->route.slot_row[t * m->dim.K + j] * m->dim.H + h0;
        kt__moe_prefetch_next_slot_row(m, m->bwd.grad_x_rows, t, j, h0, n);
        for (int64_t h = 0; h < n; h++)
            s[h] += g[h];
    }
}

/* grad_x[t] = sum_j gx_(t,j), slots in order, a row piece at a time. */
static void gx_combine_part(void *vctx, int64_t t0, int64_t t1, int thread)
{
    (void)thread;
    bwd_ctx *c = vctx;
    kt_moe *m = c->m;
    int xbf = m->cfg.act_dtype == KT_BF16;
    _Alignas(64) float buf[KT__MOE_ROW_CHUNK];
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h0 = 0; h0 < m->dim.H; h0 += KT__MOE_ROW_CHUNK) {
            const int64_t n = m->dim.H - h0 < KT__MOE_ROW_CHUNK ? m->dim.H - h0 : KT__MOE_ROW_CHUNK;
            float *s = xbf ? buf : (float *)c->gxo->data + t * m->dim.H + h0;
            gx_token_sum(m, t, h0, n, s);
            if (xbf)
                kt_f32_to_bf16((uint16_t *)c->gxo->data + t * m->dim.H + h0, buf, (size_t)n);
        }
}

/* Experts [b, end): their gradients zeroed, except (dw_overwrite) those with tokens, whose
 * GEMMs store every element anyway. */
static void zero_part(void *vctx, int64_t b, int64_t end, int thread)
{
    (void)thread;
    const bwd_ctx *c = vctx;
    kt_moe *m = c->m;
    float *base = m->train.weight_grad ? m->train.weight_grad : m->train.lora_grad;
    int64_t per =
        m->train.weight_grad ? 3 * m->dim.H * m->dim.I : 3 * m->dim.R * (m->dim.H + m->dim.I);
    for (int64_t e = b; e < end; e++)
        if (!c->dw_overwrite || m->route.row_start[e + 1] == m->route.row_start[e])
            memset(base + e * per, 0, (size_t)per * sizeof(float));
}

/* f32 weights, not tiled, full mode: dW_e (+)= scale * g^T in, one kt__sgemm per active
 * expert (g's rows ldg apart, in's ldin). */
static kt_status sgemm_dw(kt_moe *m, int proj, const float *g, int64_t gw, int64_t ldg,
                          const float *in, int64_t inw, int64_t ldin, float scale, int overwrite)
{
    for (int64_t e = 0; e < m->dim.E; e++) {
        int64_t row0 = m->route.row_start[e], rows_e = m->route.row_start[e + 1] - row0;
        if (rows_e == 0)
            continue;
        float *dw = m->train.weight_grad + (e * 3 + proj) * m->dim.H * m->dim.I;
        KT__TRY(kt__sgemm(m->pool, 1, 0, gw, inw, rows_e, scale, g + row0 * ldg, ldg,
                          in + row0 * ldin, ldin, overwrite ? 0.0f : 1.0f, dw, inw));
    }
    return KT_OK;
}

/* f32 weights, not tiled: out (+)= g W for each active expert (W [gw, outw] in its stored
 * layout; g's rows ldg apart). */
static kt_status sgemm_nn(kt_moe *m, int proj, const float *g, int64_t gw, int64_t ldg, float *out,
                          int64_t outw, float beta)
{
    for (int64_t e = 0; e < m->dim.E; e++) {
        int64_t row0 = m->route.row_start[e], rows_e = m->route.row_start[e + 1] - row0;
        if (rows_e == 0)
            continue;
        KT__TRY(kt__sgemm(m->pool, 0, 0, rows_e, outw, gw, 1.0f, g + row0 * ldg, ldg,
                          kt__moe_weight_ptr(m, e, proj), outw, beta, out + row0 * outw, outw));
    }
    return KT_OK;
}

static kt_status nonfinite_error(const kt_moe *m, const char *what, int64_t t, int64_t j)
{
    return kt__error(KT_ERANGE,
                     "moe '%s': non-finite %s in backward at token %lld (expert %lld, slot %lld)",
                     m->name, what, (long long)t, (long long)m->route.slot_expert[t * m->dim.K + j],
                     (long long)j);
}

/* With check_finite, before anything reaches the caller: names the first non-finite input
 * gradient by token, slot and the expert whose rows brought it (grad_x per row), or the first
 * non-finite routing-weight gradient; then the first token whose grad_x sum over its slots
 * overflows (or would, once rounded to bf16), naming the slot of largest magnitude there. */
static kt_status check_finite_grads(const kt_moe *m)
{
    for (int64_t t = 0; t < m->route.qlen; t++)
        for (int64_t j = 0; j < m->dim.K; j++) {
            const int64_t slot = t * m->dim.K + j;
            const float *gx = m->bwd.grad_x_rows + (int64_t)m->route.slot_row[slot] * m->dim.H;
            int64_t h = 0;
            while (h < m->dim.H && isfinite(gx[h]))
                h++;
            if (h < m->dim.H)
                return nonfinite_error(m, "grad_x", t, j);
            if (!isfinite(m->bwd.grad_w_slots[slot]))
                return nonfinite_error(m, "grad_weights", t, j);
        }
    const int xbf = m->cfg.act_dtype == KT_BF16;
    _Alignas(64) float sum[KT__MOE_ROW_CHUNK];
    for (int64_t t = 0; t < m->route.qlen; t++)
        for (int64_t h0 = 0; h0 < m->dim.H; h0 += KT__MOE_ROW_CHUNK) {
            const int64_t n = m->dim.H - h0 < KT__MOE_ROW_CHUNK ? m->dim.H - h0 : KT__MOE_ROW_CHUNK;
            gx_token_sum(m, t, h0, n, sum);
            int64_t h = 0;
            while (h < n && kt__moe_out_ok(sum[h], xbf))
                h++;
            if (h == n)
                continue;
            int64_t largest = 0;
            for (int64_t j = 1; j < m->dim.K; j++) {
                const float *row =
                    m->bwd.grad_x_rows + (int64_t)m->route.slot_row[t * m->dim.K + j] * m->dim.H;
                const float *best = m->bwd.grad_x_rows +
                                    (int64_t)m->route.slot_row[t * m->dim.K + largest] * m->dim.H;
                if (fabsf(row[h0 + h]) > fabsf(best[h0 + h]))
                    largest = j;
            }
            return nonfinite_error(m, "grad_x (the sum over the token's slots)", t, largest);
        }
    return KT_OK;
}

static kt_status backward_body(kt_moe *m, const kt_tensor *gy, kt_tensor *gxo, kt_tensor *gwo,
                               float scale);

kt_status kt__moe_backward_exec(kt_moe *m, const kt_tensor *gy, kt_tensor *gxo, kt_tensor *gwo,
                                float scale)
{
    KT__TRY(kt__moe_scratch_acquire(m));
    kt_status st = backward_body(m, gy, gxo, gwo, scale);
    kt__moe_scratch_release(m);
    return st;
}

static kt_status backward_body(kt_moe *m, const kt_tensor *gy, kt_tensor *gxo, kt_tensor *gwo,
                               float scale)
{
    int lora = m->cfg.mode == KT_MOE_LORA, full = m->cfg.mode == KT_MOE_FULL;
    bwd_ctx c = {m, gy, gxo, scale, full && m->train.grad_overwrite, 0};
    int64_t rows = m->route.row_start[m->dim.E];
    kt__moe_phase_start(m);
    /* Without kept activations this reruns the gate/up GEMMs (from the gathered input). With
     * them, LoRA and full mode only gather x (an input of their weight or adapter gradients):
     * the SiLU derivative writes ac on its way, before the down projection's gradients need
     * it, and LoRA's z are kept; frozen mode reads only the kept g and u. */
    const int ac_in_derivative = (full || lora) && m->cfg.keep_activations;
    if (lora || full || !m->cfg.keep_activations) {
        kt__moe_gather(m, NULL, 0);
        if (!m->cfg.keep_activations)
            KT__TRY(kt__moe_compute(m, 1));
        kt__moe_phase_end(m, KT_MOE_PHASE_RECOMPUTE);
    }
    kt_parallel_for(m->pool, m->route.qlen, 1, gy_rows_part, &c);
    kt__moe_phase_end(m, KT_MOE_PHASE_ROUTING_GRAD);
    if ((lora || full) && m->train.grad_overwrite)
        kt_parallel_for(m->pool, m->dim.E, 1, zero_part, &c);

    if (lora || full)
        kt__moe_phase_end(m, KT_MOE_PHASE_WEIGHT_GRAD);
    if (lora) /* the input gradient below is for grad_y itself (the routing weight comes in
               * the SiLU derivative), so the adapter's part of it too */
        kt__moe_lora_gz(m, KT_MOE_DOWN, m->bwd.grad_y_rows, m->dim.ld_h);
    if (!m->dim.tiled)
        KT__TRY(sgemm_nn(m, KT_MOE_DOWN, m->bwd.grad_y_rows, m->dim.H, m->dim.ld_h, m->bwd.grad_act,
                         m->dim.I, 0.0f));
    kt__moe_plan_parts(m, m->dim.I, KT__MOE_CUT_KEEP_SMALL);
    c.write_ac = ac_in_derivative;
    kt__moe_run_parts(m, ga_tasks, &c);
    kt_parallel_for(m->pool, m->route.qlen, 1, gw_part, &c);
    kt__moe_phase_end(m, KT_MOE_PHASE_DOWN_GRAD);

    if (lora) { /* after the derivative: it may have written act */
        kt__moe_lora_gz(m, KT_MOE_DOWN, m->bwd.grad_y_weighted, m->dim.ld_h);
        kt__moe_lora_grads(m, KT_MOE_DOWN, m->bwd.grad_y_weighted, m->dim.ld_h, m->fwd.act,
                           m->dim.I, scale);
    }

    if (full) {
        if (m->dim.tiled) {
            kt__moe_plan_parts(m, m->dim.H, KT__MOE_CUT_ANY);
            kt__moe_run_parts(m, dwd_tasks, &c);
        } else {
            KT__TRY(sgemm_dw(m, KT_MOE_DOWN, m->bwd.grad_y_weighted, m->dim.H, m->dim.ld_h,
                             m->fwd.act, m->dim.I, m->dim.I, scale, c.dw_overwrite));
        }
    }

    if (lora) {
        kt__moe_lora_gz(m, KT_MOE_GATE, m->bwd.grad_gate_pre, m->dim.I);
        kt__moe_lora_gz(m, KT_MOE_UP, m->bwd.grad_up_pre, m->dim.I);
        kt__moe_lora_grads(m, KT_MOE_GATE, m->bwd.grad_gate_pre, m->dim.I, m->fwd.x_rows,
                           m->dim.ld_h, scale);
        kt__moe_lora_grads(m, KT_MOE_UP, m->bwd.grad_up_pre, m->dim.I, m->fwd.x_rows, m->dim.ld_h,
                           scale);
    }
    if (full) {
        if (m->dim.tiled) {
            kt__moe_plan_parts(m, m->dim.I, KT__MOE_CUT_ANY);
            kt__moe_run_parts(m, dwgu_tasks, &c);
        } else {
            KT__TRY(sgemm_dw(m, KT_MOE_GATE, m->bwd.grad_gate_pre, m->dim.I, m->dim.I,
                             m->fwd.x_rows, m->dim.H, m->dim.ld_h, scale, c.dw_overwrite));
            KT__TRY(sgemm_dw(m, KT_MOE_UP, m->bwd.grad_up_pre, m->dim.I, m->dim.I, m->fwd.x_rows,
                             m->dim.H, m->dim.ld_h, scale, c.dw_overwrite));
        }
        m->timing.flops += (uint64_t)(6 * rows * m->dim.H * m->dim.I);
    }
    if (lora || full)
        kt__moe_phase_end(m, KT_MOE_PHASE_WEIGHT_GRAD);
    if (!m->dim.tiled) {
        KT__TRY(sgemm_nn(m, KT_MOE_GATE, m->bwd.grad_gate_pre, m->dim.I, m->dim.I,
                         m->bwd.grad_x_rows, m->dim.H, 0.0f));
        KT__TRY(sgemm_nn(m, KT_MOE_UP, m->bwd.grad_up_pre, m->dim.I, m->dim.I, m->bwd.grad_x_rows,
                         m->dim.H, 1.0f));
    }
    if (m->dim.tiled || lora) {
        kt__moe_plan_parts(m, m->dim.H, KT__MOE_CUT_KEEP_SMALL);
        kt__moe_run_parts(m, gx_tasks, &c);
    }
    m->timing.flops += (uint64_t)(6 * rows * m->dim.H * m->dim.I);
    kt__moe_phase_end(m, KT_MOE_PHASE_GATE_UP_GRAD);
    if (m->cfg.check_finite)
        KT__TRY(check_finite_grads(m));

    if (gxo != NULL && gxo->data != NULL)
        kt_parallel_for(m->pool, m->route.qlen, 1, gx_combine_part, &c);
    if (gwo != NULL && gwo->data != NULL && m->route.qlen > 0)
        memcpy(gwo->data, m->bwd.grad_w_slots, (size_t)(m->route.qlen * m->dim.K) * sizeof(float));
    if (lora || full)
        m->train.grad_overwrite = 0;
    kt__moe_phase_end(m, KT_MOE_PHASE_INPUT_COMBINE);
    m->timing.phases.backward_calls++;
    return KT_OK;
}
