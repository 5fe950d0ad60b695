/* The forward: gather the input rows per expert, gate/up GEMMs with the SiLU product, down
 * GEMM, then the per-token weighted sum in slot order. kt__moe_compute is shared with backward,
 * which reruns it to recompute what forward did not keep. */
#include <math.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/kernels/silu_epilogue.h"
#include "lib/kernels/fma_gemm.h"
#include "lib/moe/moe_internal.h"
#include "lib/kernels/sgemm.h"

typedef struct fwd_ctx {
    kt_moe *m;
    const kt__moe_job *job;
    int load_x;
    /* with check_finite: the first token whose output has a NaN or Inf (qlen: none) */
    _Atomic int64_t bad_token;
} fwd_ctx;

/* Row copy between f32/bf16 buffers. */
static void convert_row(void *dst, int dst_bf16, const void *src, int src_bf16, int64_t n)
{
    if (dst_bf16 == src_bf16)
        memcpy(dst, src, (size_t)n * (dst_bf16 ? 2 : 4));
    else if (dst_bf16)
        kt_f32_to_bf16(dst, src, (size_t)n);
    else
        kt_bf16_to_f32(dst, src, (size_t)n);
}

/* Tokens: the caller's x into the saved copy (compute dtype), then one copy per slot into
 * the expert-sorted rows. */
static void gather_part(void *vctx, int64_t t0, int64_t t1, int thread)
{
    (void)thread;
    fwd_ctx *c = vctx;
    kt_moe *m = c->m;
    size_t cs = m->dim.cdt_bytes;
    int xbf = m->cfg.act_dtype == KT_BF16;
    for (int64_t t = t0; t < t1; t++) {
        unsigned char *saved = (unsigned char *)m->fwd.x_saved + (size_t)(t * m->dim.H) * cs;
        if (c->load_x) {
            const unsigned char *x = c->job->x->data;
            convert_row(saved, m->dim.bf16, x + (size_t)(t * m->dim.H) * (xbf ? 2 : 4), xbf,
                        m->dim.H);
        }
        for (int64_t j = 0; j < m->dim.K; j++) {
            int64_t r = m->route.slot_row[t * m->dim.K + j];
            memcpy((unsigned char *)m->fwd.x_rows + (size_t)(r * m->dim.ld_h) * cs, saved,
                   (size_t)m->dim.H * cs);
        }
    }
}

void kt__moe_gather(kt_moe *m, const kt__moe_job *job, int load_x)
{
    fwd_ctx c = {m, job, load_x, 0};
    kt_parallel_for(m->pool, m->route.qlen, 1, gather_part, &c);
}

/* Columns of gate/up computed together before their SiLU product: the g and u blocks of an
 * expert (rows x 96 f32 each) are still in L2 when the product reads them, where a whole
 * expert's [rows, I] pair would already be on its way out. 96 = 16 tiles of 6 columns.
 * An expert of at most stream_rows_max rows (where nt only streams the weights: bf16's
 * KT__BF16_NT_ROWS_MAX_M, f32's KT__FMA_ROWS_MAX_M) takes its task's columns at once instead:
 * its g and u rows are a few KiB, and the kernel then only streams the weights, which it
 * does best in long runs (each switch between gate and up starts a new stream;
 * docs/moe-measurements.md has the figures). */
#define GU_SUB_COLS 96

static int64_t stream_rows_max(const kt_moe *m)
{
    return m->dim.bf16 ? KT__BF16_NT_ROWS_MAX_M : KT__FMA_ROWS_MAX_M;
}

static void gate_up_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    fwd_ctx *c = vctx;
    kt_moe *m = c->m;
    int lora = m->cfg.mode == KT_MOE_LORA;
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        int64_t row0 = m->route.row_start[t->e], rows_e = m->route.row_start[t->e + 1] - row0;
        const void *x = kt__moe_cdt_at(m, m->fwd.x_rows, row0 * m->dim.ld_h);
        const int64_t sub = rows_e <= stream_rows_max(m) ? t->c1 - t->c0 : GU_SUB_COLS;
        for (int64_t c0 = t->c0; c0 < t->c1; c0 += sub) {
            const kt__moe_task st = {t->e, c0, t->c1 - c0 < sub ? t->c1 : c0 + sub};
            if (m->dim.tiled) {
                /* gate's block, then up's, then gate's next: above 32 rows the bf16 calls
                 * fetch the next one's first rows ahead */
                const void *wg = kt__moe_weight_ptr(m, t->e, KT_MOE_GATE);
                const void *wu = kt__moe_weight_ptr(m, t->e, KT_MOE_UP);
                const int q = m->dim.quant != KT__Q_NONE;
                kt__moe_gemm_nt(m, thread, rows_e, st.c0, st.c1, m->dim.H, x, m->dim.ld_h, wg,
                                m->dim.H, q ? NULL : kt__moe_cdt_at(m, wu, st.c0 * m->dim.H),
                                m->fwd.gate_pre + row0 * m->dim.I, m->dim.I);
                kt__moe_gemm_nt(m, thread, rows_e, st.c0, st.c1, m->dim.H, x, m->dim.ld_h, wu,
                                m->dim.H, q ? NULL : kt__moe_cdt_at(m, wg, st.c1 * m->dim.H),
                                m->fwd.up_pre + row0 * m->dim.I, m->dim.I);
            }
            if (lora) {
                kt__moe_lora_add(m, KT_MOE_GATE, &st, m->fwd.gate_pre);
                kt__moe_lora_add(m, KT_MOE_UP, &st, m->fwd.up_pre);
            }
            for (int64_t r = row0; r < row0 + rows_e; r++) {
                const int64_t k = r * m->dim.I + st.c0;
                kt__moe_act_fwd(st.c1 - st.c0, m->fwd.gate_pre + k, m->fwd.up_pre + k,
                                kt__moe_cdt_at(m, m->fwd.act, k), m->dim.bf16);
            }
        }
    }
}

static void down_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    fwd_ctx *c = vctx;
    kt_moe *m = c->m;
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        int64_t row0 = m->route.row_start[t->e], rows_e = m->route.row_start[t->e + 1] - row0;
        if (m->dim.tiled)
            kt__moe_gemm_nt(m, thread, rows_e, t->c0, t->c1, m->dim.I,
                            kt__moe_cdt_at(m, m->fwd.act, row0 * m->dim.I), m->dim.I,
                            kt__moe_weight_ptr(m, t->e, KT_MOE_DOWN), m->dim.I, NULL,
                            m->fwd.expert_out + row0 * m->dim.H, m->dim.H);
        if (m->cfg.mode == KT_MOE_LORA)
            kt__moe_lora_add(m, KT_MOE_DOWN, t, m->fwd.expert_out);
    }
}

/* f32 weights without the layer's own kernels: one kt__sgemm per active expert (on the pool,
 * or OpenBLAS's own threads), out = in * W^T. */
static kt_status sgemm_experts(kt_moe *m, int proj, const float *in, int64_t K, int64_t ldin,
                               float *out, int64_t N)
{
    for (int64_t e = 0; e < m->dim.E; e++) {
        int64_t row0 = m->route.row_start[e], rows_e = m->route.row_start[e + 1] - row0;
        if (rows_e == 0)
            continue;
        KT__TRY(kt__sgemm(m->pool, 0, 1, rows_e, N, K, 1.0f, in + row0 * ldin, ldin,
                          kt__moe_weight_ptr(m, e, proj), K, 0.0f, out + row0 * N, N));
    }
    return KT_OK;
}

/* With x_rows gathered: gate_pre g, up_pre u (+ LoRA), act = silu(g) * u, expert_out (+ LoRA).
 * in_backward: backward's recompute without kept activations (the same code, so recomputed values
 * are bitwise the kept ones; no down GEMM: backward needs no expert outputs; timed as its
 * recompute). */
kt_status kt__moe_compute(kt_moe *m, int in_backward)
{
    int lora = m->cfg.mode == KT_MOE_LORA;
    int64_t rows = m->route.row_start[m->dim.E];
    fwd_ctx c = {m, NULL, 0, 0};
    if (lora) {
        kt__moe_lora_z(m, KT_MOE_GATE, m->fwd.x_rows, m->dim.ld_h);
        kt__moe_lora_z(m, KT_MOE_UP, m->fwd.x_rows, m->dim.ld_h);
    }
    if (!m->dim.tiled) {
        KT__TRY(sgemm_experts(m, KT_MOE_GATE, m->fwd.x_rows, m->dim.H, m->dim.ld_h, m->fwd.gate_pre,
                              m->dim.I));
        KT__TRY(sgemm_experts(m, KT_MOE_UP, m->fwd.x_rows, m->dim.H, m->dim.ld_h, m->fwd.up_pre,
                              m->dim.I));
    }
    kt__moe_plan_parts(m, m->dim.I, KT__MOE_CUT_ANY);
    kt__moe_run_parts(m, gate_up_tasks, &c);
    kt__moe_phase_end(m, in_backward ? KT_MOE_PHASE_RECOMPUTE : KT_MOE_PHASE_GATE_UP);
    if (lora)
        kt__moe_lora_z(m, KT_MOE_DOWN, m->fwd.act, m->dim.I);
    if (!in_backward) {
        if (!m->dim.tiled)
            KT__TRY(sgemm_experts(m, KT_MOE_DOWN, m->fwd.act, m->dim.I, m->dim.I, m->fwd.expert_out,
                                  m->dim.H));
        if (m->dim.tiled || lora) {
            kt__moe_plan_parts(m, m->dim.H, KT__MOE_CUT_ANY);
            kt__moe_run_parts(m, down_tasks, &c);
        }
        m->timing.flops += (uint64_t)(2 * rows * m->dim.H * m->dim.I);
    }
    m->timing.flops += (uint64_t)(4 * rows * m->dim.H * m->dim.I);
    kt__moe_phase_end(m, in_backward ? KT_MOE_PHASE_RECOMPUTE : KT_MOE_PHASE_DOWN);
    return KT_OK;
}

/* out[0, n) = sum_j w[t, j] * d[row(t, j)][h0, h0 + n), in slot order */
static void combine_piece(const kt_moe *m, int64_t t, int64_t h0, int64_t n, float *out)
{
    for (int64_t j = 0; j < m->dim.K; j++) {
        const float w = m->route.slot_weight[t * m->dim.K + j];
        const float *d =
            m->fwd.expert_out + (int64_t)m->route.slot_row[t * m->dim.K + j] * m->dim.H + h0;
        kt__moe_prefetch_next_slot_row(m, m->fwd.expert_out, t, j, h0, n);
        if (j == 0)
            for (int64_t h = 0; h < n; h++)
                out[h] = w * d[h];
        else
            for (int64_t h = 0; h < n; h++)
                out[h] += w * d[h];
    }
}

/* The index of the first of v[0, n) that does not survive its store (n: none) */
static int64_t first_bad(const float *v, int64_t n, int bf16)
{
    int64_t h = 0;
    while (h < n && kt__moe_out_ok(v[h], bf16))
        h++;
    return h;
}

/* The output is staged in f32 (m->fwd.y_staged) when the cache is on (it is the cached output) or
 * with check_finite (y is left unchanged when the check fails), and written out after; otherwise
 * combine writes it straight into the caller's y. */
static int output_staged(const kt_moe *m) { return m->cache.on || m->cfg.check_finite; }

/* The output rows of tokens [t0, t1): staged, or straight into the caller's y (f32) or a
 * piece at a time through the stack (bf16). */
static void combine_part(void *vctx, int64_t t0, int64_t t1, int thread)
{
    (void)thread;
    fwd_ctx *c = vctx;
    const kt_moe *m = c->m;
    const int staged = output_staged(m), ybf = m->cfg.act_dtype == KT_BF16;
    unsigned char *y = c->job->y->data;
    _Alignas(64) float buf[KT__MOE_ROW_CHUNK];
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h0 = 0; h0 < m->dim.H; h0 += KT__MOE_ROW_CHUNK) {
            const int64_t n = m->dim.H - h0 < KT__MOE_ROW_CHUNK ? m->dim.H - h0 : KT__MOE_ROW_CHUNK;
            float *s = staged ? m->fwd.y_staged + t * m->dim.H + h0
                       : ybf  ? buf
                              : (float *)y + t * m->dim.H + h0;
            combine_piece(m, t, h0, n, s);
            if (m->cfg.check_finite && first_bad(s, n, ybf) < n) {
                int64_t first = atomic_load(&c->bad_token);
                while (t < first && !atomic_compare_exchange_weak(&c->bad_token, &first, t)) {
                }
            }
            if (!staged && ybf)
                kt_f32_to_bf16((uint16_t *)y + t * m->dim.H + h0, buf, (size_t)n);
        }
}

static void write_part(void *vctx, int64_t t0, int64_t t1, int thread)
{
    (void)thread;
    fwd_ctx *c = vctx;
    kt_moe *m = c->m;
    int ybf = m->cfg.act_dtype == KT_BF16;
    unsigned char *y = c->job->y->data;
    for (int64_t t = t0; t < t1; t++)
        convert_row(y + (size_t)(t * m->dim.H) * (ybf ? 2 : 4), ybf, m->fwd.y_staged + t * m->dim.H,
                    0, m->dim.H);
}

/* Names token t's first output column that is non-finite (or would be once rounded to bf16)
 * and the slot that brought it: the first whose weight or expert output row is non-finite,
 * else the first whose weighted value there overflows, else (the sum overflowed) the one of
 * largest magnitude there. */
static kt_status finite_error(const kt_moe *m, int64_t t)
{
    const int ybf = m->cfg.act_dtype == KT_BF16;
    int64_t h = 0;
    for (float v = 0.0f; h < m->dim.H; h++) { /* (set: gcc cannot see that K >= 1) */
        combine_piece(m, t, h, 1, &v);
        if (!kt__moe_out_ok(v, ybf))
            break;
    }
    h = h < m->dim.H ? h : 0;
    int64_t slot = -1, largest = 0;
    float largest_abs = -1.0f;
    for (int64_t j = 0; j < m->dim.K && slot < 0; j++) {
        const float w = m->route.slot_weight[t * m->dim.K + j];
        const float *d =
            m->fwd.expert_out + (int64_t)m->route.slot_row[t * m->dim.K + j] * m->dim.H;
        if (!isfinite(w) || first_bad(d, m->dim.H, 0) < m->dim.H || !kt__moe_out_ok(w * d[h], ybf))
            slot = j;
        if (fabsf(w * d[h]) > largest_abs)
            largest_abs = fabsf(w * d[h]), largest = j;
    }
    slot = slot >= 0 ? slot : largest;
    return kt__error(KT_ERANGE,
                     "moe '%s': non-finite output at token %lld, column %lld (expert %lld, "
                     "slot %lld)",
                     m->name, (long long)t, (long long)h,
                     (long long)m->route.slot_expert[t * m->dim.K + slot], (long long)slot);
}

static kt_status forward_body(kt_moe *m, kt__moe_job *job);

kt_status kt__moe_forward_exec(kt_moe *m, kt__moe_job *job)
{
    kt_status st = kt__moe_scratch_acquire(m);
    if (st != KT_OK) {
        m->fwd.valid = 0;
        kt__moe_poison(m);
        return st;
    }
    st = forward_body(m, job);
    kt__moe_scratch_release(m);
    return st;
}

static kt_status forward_body(kt_moe *m, kt__moe_job *job)
{
    fwd_ctx c = {m, job, 1, job->qlen};
    kt_status st = KT_OK;
    if (job->cache_hit) {
        kt_parallel_for(m->pool, job->qlen, 1, write_part, &c);
        return KT_OK;
    }
    m->fwd.valid = 0;
    kt__moe_phase_start(m);
    st = kt__moe_route(m, job);
    if (st != KT_OK)
        goto fail;
    kt__moe_phase_end(m, KT_MOE_PHASE_ROUTE);
    kt__moe_gather(m, job, 1);
    kt__moe_phase_end(m, KT_MOE_PHASE_GATHER);
    st = kt__moe_compute(m, 0);
    if (st != KT_OK)
        goto fail;
    kt_parallel_for(m->pool, m->route.qlen, 1, combine_part, &c);
    const int64_t bad = atomic_load(&c.bad_token);
    if (bad < m->route.qlen) {
        st = finite_error(m, bad);
        goto fail;
    }
    if (output_staged(m))
        kt_parallel_for(m->pool, m->route.qlen, 1, write_part, &c);
    kt__moe_phase_end(m, KT_MOE_PHASE_COMBINE);
    m->timing.phases.forward_calls++;
    m->fwd.valid = 1;
    if (m->cache.on)
        atomic_store(&m->cache.state, KT_MOE_CACHE_READY);
    return KT_OK;

fail:
    kt__moe_poison(m);
    return st;
}
