/* Argument checks, grouping (token, slot) pairs by expert, and splitting GEMM phases into
 * equal-cost tasks. */
#include <math.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/kernels/bf16_gemm.h"
#include "lib/moe/moe_internal.h"

int64_t kt__moe_get_id(const kt_tensor *ids, int64_t i)
{
    return ids->dtype == KT_I32 ? (int64_t)((const int32_t *)ids->data)[i]
                                : ((const int64_t *)ids->data)[i];
}

/* A contiguous CPU 2-D tensor of `dtype` (or any of two dtypes) with the expected shape; the
 * message says every way it differs. */
static kt_status check_2d(const kt_moe *m, const char *what, const kt_tensor *t, kt_dtype d1,
                          kt_dtype d2, int64_t rows, int64_t cols, int allow_null_data)
{
    if (t == NULL)
        return kt__error(KT_EINVAL, "moe '%s': %s is NULL", m->name, what);
    if (t->data == NULL && !allow_null_data && t->ndim == 2 && t->shape[0] * t->shape[1] > 0)
        return kt__error(KT_EINVAL, "moe '%s': %s has no data", m->name, what);
    const int64_t shape[2] = {rows, cols};
    char why[256], want[64], got[64];
    if (!kt__moe_tensor_fits(t, d1, d2, 2, shape, why, sizeof why))
        return kt__error(KT_EINVAL, "moe '%s': %s must be a contiguous CPU %s, got %s: %s", m->name,
                         what, kt__moe_tensor_wanted(d1, d2, 2, shape, want, sizeof want),
                         kt_tensor_describe(t, got, sizeof got), why);
    return KT_OK;
}

kt_status kt__moe_check_forward(kt_moe *m, const kt_tensor *x, const kt_tensor *ids,
                                const kt_tensor *w, const kt_tensor *y, kt__moe_job *job)
{
    kt_dtype ad = m->cfg.act_dtype;
    if (x == NULL || ids == NULL || w == NULL || y == NULL)
        return kt__error(KT_EINVAL, "moe '%s': forward: NULL tensor argument", m->name);
    if (x->ndim != 2)
        return kt__error(KT_EINVAL, "moe '%s': x must be 2-D [qlen, %lld], got %d-D", m->name,
                         (long long)m->dim.H, x->ndim);
    int64_t qlen = x->shape[0];
    if (qlen < 0)
        return kt__error(KT_EINVAL, "moe '%s': x has a negative token count (%lld)", m->name,
                         (long long)qlen);
    if (qlen > m->dim.T)
        return kt__error(KT_ERANGE, "moe '%s': qlen %lld exceeds max_tokens %lld", m->name,
                         (long long)qlen, (long long)m->dim.T);
    KT__TRY(check_2d(m, "x", x, ad, ad, qlen, m->dim.H, 0));
    KT__TRY(check_2d(m, "ids", ids, KT_I32, KT_I64, qlen, m->dim.K, 0));
    KT__TRY(check_2d(m, "weights", w, KT_F32, KT_F32, qlen, m->dim.K, 0));
    KT__TRY(check_2d(m, "y", y, ad, ad, qlen, m->dim.H, 0));
    for (int64_t t = 0; t < qlen; t++)
        for (int64_t j = 0; j < m->dim.K; j++) {
            int64_t e = kt__moe_get_id(ids, t * m->dim.K + j);
            if (e < 0 || e >= m->dim.E)
                return kt__error(KT_ERANGE,
                                 "moe '%s': token %lld slot %lld: expert id %lld out of range "
                                 "[0, %lld)",
                                 m->name, (long long)t, (long long)j, (long long)e,
                                 (long long)m->dim.E);
            /* k is small: a quadratic scan beats a per-call bitmap. */
            for (int64_t i = 0; i < j; i++)
                if (kt__moe_get_id(ids, t * m->dim.K + i) == e)
                    return kt__error(KT_EINVAL,
                                     "moe '%s': token %lld: expert %lld appears twice (slots "
                                     "%lld and %lld)",
                                     m->name, (long long)t, (long long)e, (long long)i,
                                     (long long)j);
        }
    memset(job, 0, sizeof *job);
    job->xs = *x;
    job->idss = *ids;
    job->ws = *w;
    job->ys = *y;
    job->x = &job->xs;
    job->ids = &job->idss;
    job->w = &job->ws;
    job->y = &job->ys;
    job->qlen = qlen;
    return KT_OK;
}

/* Counting sort of the (token, slot) pairs by expert; stable, so an expert's rows are in
 * token order whatever the thread count. The ids were validated at submit, but they are the
 * caller's memory, read again here on the driver thread: ids changed in between are refused
 * rather than trusted (the buffers are sized for at most one row per token and expert). */
kt_status kt__moe_route(kt_moe *m, const kt__moe_job *job)
{
    int64_t n = job->qlen * m->dim.K;
    const float *w = job->w->data;
    memset(m->route.row_start, 0, (size_t)(m->dim.E + 1) * sizeof *m->route.row_start);
    for (int64_t s = 0; s < n; s++) {
        int64_t e = kt__moe_get_id(job->ids, s);
        if (e < 0 || e >= m->dim.E || m->route.row_start[e + 1] == job->qlen)
            return kt__error(KT_EINVAL,
                             "moe '%s': token %lld slot %lld: expert id %lld is out of range or "
                             "repeated (ids changed after they were submitted?)",
                             m->name, (long long)(s / m->dim.K), (long long)(s % m->dim.K),
                             (long long)e);
        m->route.slot_expert[s] = (int32_t)e;
        m->route.slot_weight[s] = w[s];
        m->route.row_start[e + 1]++;
    }
    for (int64_t e = 0; e < m->dim.E; e++) {
        m->route.row_start[e + 1] += m->route.row_start[e];
        m->route.sort_cursor[e] = m->route.row_start[e];
    }
    for (int64_t s = 0; s < n; s++) {
        int64_t e = m->route.slot_expert[s];
        int64_t r = m->route.sort_cursor[e]++;
        m->route.slot_row[s] = (int32_t)r;
        m->route.row_expert[r] = (int32_t)e;
    }
    m->route.qlen = job->qlen;
    return KT_OK;
}

static int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

/* Column blocks per expert sized so that rows * width is about the same in every task: the
 * static partition hands each thread a contiguous run of tasks, so equal costs mean equal
 * work. About four tasks per thread leave room for the rounding to 16 columns. */
int64_t kt__moe_plan(kt_moe *m, int64_t cols)
{
    int64_t rows = m->route.row_start[m->dim.E];
    int64_t n = 0;
    if (rows == 0)
        return 0;
    int64_t target = rows * cols / (4 * (int64_t)m->n_threads);
    if (target < 1)
        target = 1;
    for (int64_t e = 0; e < m->dim.E; e++) {
        int64_t rows_e = m->route.row_start[e + 1] - m->route.row_start[e];
        if (rows_e == 0)
            continue;
        int64_t width = align_up((target + rows_e - 1) / rows_e, KT__MOE_COL_ALIGN);
        if (width > cols)
            width = cols;
        for (int64_t c = 0; c < cols; c += width) {
            m->route.tasks[n].e = e;
            m->route.tasks[n].c0 = c;
            m->route.tasks[n].c1 = c + width < cols ? c + width : cols;
            n++;
        }
    }
    return n;
}

/* One contiguous share of the phase's cost (rows * columns) per thread, balanced up to the
 * 16-column rounding of the cut points: thread p owns the cost range [p C / P, (p + 1) C / P),
 * walked in (expert, column) order, where expert e's column c sits at row_start[e] * cols + rows_e
 * * c. A share becomes one task per expert it touches, so a thread streams each weight block it
 * needs once, in long runs (one token: a few experts cut into P slices; a thousand tokens: P
 * runs of whole experts). Each output element is still computed whole by one task, in a fixed
 * order, so which thread runs a task never changes a bit.
 *
 * Equal costs are not equal times: experts with fewer rows stream their weights for fewer
 * products, and a virtual CPU can be slowed by its neighbours, so one thread would idle at the
 * end of every phase waiting for the other. So the last
 * SHARE_TAIL_DIV-th of each share is cut into SHARE_PIECES pieces, which the threads that
 * finish first take from the back (kt__moe_run_parts): the wait at the end is at most about a
 * piece, 1/32 of a share. */
#define SHARE_TAIL_DIV 4
#define SHARE_PIECES 8
/* With KT__MOE_CUT_KEEP_SMALL the pieces leave experts of at most this many rows whole: NN's
 * stream path reads each of w's rows over the task's columns, so a piece of a hundred columns
 * is 200-byte runs 4 KiB apart, which stream badly. (f32 and bf16 on the FMA tiles have no
 * stream path; whole is harmless there.) */
#define SHARE_WHOLE_MAX_ROWS KT__BF16_NN_STREAM_MAX_M

/* The (expert, column) at cost position b within experts [e0, e1): the column rounded to
 * KT__MOE_COL_ALIGN, (e1, 0) at or past the end. */
static void cost_point(const kt_moe *m, int64_t cols, int64_t e0, int64_t e1, int64_t b,
                       int64_t *es_out, int64_t *cs_out)
{
    const int64_t base = m->route.row_start[e0];
    int64_t es = e0, cs = 0;
    while (es < e1 && (m->route.row_start[es + 1] - base) * cols <= b)
        es++;
    if (es < e1) {
        const int64_t rows_e = m->route.row_start[es + 1] - m->route.row_start[es];
        cs = (b - (m->route.row_start[es] - base) * cols + rows_e / 2) / rows_e;
        cs = (cs + KT__MOE_COL_ALIGN / 2) / KT__MOE_COL_ALIGN * KT__MOE_COL_ALIGN;
        if (cs >= cols) {
            es++;
            cs = 0;
        }
    }
    *es_out = es;
    *cs_out = cs;
}

/* Tasks from (*e, *c) up to (es, cs), one per expert with rows, appended from index n;
 * returns the new count and leaves (*e, *c) at (es, cs) (never moving it back). */
static int64_t emit_tasks(kt_moe *m, int64_t cols, int64_t *e, int64_t *c, int64_t es, int64_t cs,
                          int64_t n)
{
    if (es < *e || (es == *e && cs < *c))
        return n;
    for (int64_t x = *e, c0 = *c; x < es || (x == es && c0 < cs); x++, c0 = 0) {
        const int64_t end = x == es ? cs : cols;
        if (m->route.row_start[x + 1] != m->route.row_start[x] && end > c0) {
            m->route.tasks[n].e = x;
            m->route.tasks[n].c0 = c0;
            m->route.tasks[n].c1 = end;
            n++;
        }
        if (x == es)
            break;
    }
    *e = es;
    *c = cs;
    return n;
}

/* The shares of threads [p0, p1) over experts [e0, e1), tasks appended from index n;
 * returns the new task count. */
static int64_t plan_range(kt_moe *m, int64_t cols, int cut, int64_t e0, int64_t e1, int64_t p0,
                          int64_t p1, int64_t n)
{
    const int64_t P = p1 - p0, rows = m->route.row_start[e1] - m->route.row_start[e0];
    int64_t e = e0, c = 0, a = 0;
    for (int64_t p = 0; p < P; p++) {
        /* the cost position ending share p (exact: (p + 1) rows cols / P) */
        const int64_t b = (p + 1) * rows / P * cols + ((p + 1) * rows % P) * cols / P;
        const int64_t piece = (b - a) / (SHARE_TAIL_DIV * SHARE_PIECES);
        for (int k = SHARE_PIECES; k >= 0; k--) {
            int64_t es = e1, cs = 0;
            if (p + 1 < P || k > 0)
                cost_point(m, cols, e0, e1, b - k * piece, &es, &cs);
            /* a piece's end inside a small expert moves to the expert's start */
            if (k > 0 && cut == KT__MOE_CUT_KEEP_SMALL && es < e1 &&
                m->route.row_start[es + 1] - m->route.row_start[es] <= SHARE_WHOLE_MAX_ROWS)
                cs = 0;
            n = emit_tasks(m, cols, &e, &c, es, cs, n);
        }
        a = b;
        m->route.share[p0 + p + 1] = n;
    }
    return n;
}

int64_t kt__moe_plan_parts(kt_moe *m, int64_t cols, int cut)
{
    /* NUMA split: each node group's experts go to that group's threads only */
    int64_t n = 0;
    m->route.share[0] = 0;
    for (int g = 0; g < m->numa.n_groups; g++)
        n = plan_range(m, cols, cut, m->numa.expert_start[g], m->numa.expert_start[g + 1],
                       m->numa.thread_start[g], m->numa.thread_start[g + 1], n);
    return n;
}

/* The next task of queue q, from its front (its own thread) or its back (a helper); -1 when
 * none is left. */
static int64_t take_task(kt__moe_queue *q, int from_back)
{
    uint64_t span = atomic_load_explicit(&q->span, memory_order_acquire);
    for (;;) {
        const uint64_t front = span >> 32, back = span & 0xffffffffu;
        if (front >= back)
            return -1;
        const uint64_t next = from_back ? (front << 32) | (back - 1) : ((front + 1) << 32) | back;
        if (atomic_compare_exchange_weak_explicit(&q->span, &span, next, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

typedef struct parts_run {
    kt_moe *m;
    kt_range_fn fn;
    void *ctx;
} parts_run;

/* Thread p: its own share in order, then the last tasks of the share with the most left
 * among its node group's threads, until none is left. */
static void run_share(void *vctx, int64_t p0, int64_t p1, int thread)
{
    const parts_run *r = vctx;
    kt_moe *m = r->m;
    for (int64_t p = p0; p < p1; p++)
        for (int64_t i; (i = take_task(&m->route.share_left[p], 0)) >= 0;)
            r->fn(r->ctx, i, i + 1, thread);
    int g = 0;
    while (g + 1 < m->numa.n_groups && m->numa.thread_start[g + 1] <= p0)
        g++;
    for (;;) {
        int64_t victim = -1, most = 0;
        for (int64_t q = m->numa.thread_start[g]; q < m->numa.thread_start[g + 1]; q++) {
            const uint64_t span =
                atomic_load_explicit(&m->route.share_left[q].span, memory_order_relaxed);
            const int64_t left = (int64_t)(span & 0xffffffffu) - (int64_t)(span >> 32);
            if (left > most) {
                most = left;
                victim = q;
            }
        }
        if (victim < 0)
            return;
        const int64_t i = take_task(&m->route.share_left[victim], 1);
        if (i >= 0)
            r->fn(r->ctx, i, i + 1, thread);
    }
}

void kt__moe_run_parts(kt_moe *m, kt_range_fn fn, void *ctx)
{
    if (m->route.share[m->n_threads] == 0)
        return;
    for (int p = 0; p < m->n_threads; p++)
        atomic_store_explicit(&m->route.share_left[p].span,
                              (uint64_t)m->route.share[p] << 32 | (uint64_t)m->route.share[p + 1],
                              memory_order_relaxed);
    parts_run r = {m, fn, ctx};
    kt_parallel_for(m->pool, m->n_threads, 1, run_share, &r);
}

kt_status kt__moe_check_backward(kt_moe *m, const kt_tensor *gy, const kt_tensor *gx,
                                 const kt_tensor *gw, float scale)
{
    kt_dtype ad = m->cfg.act_dtype;
    KT__TRY(check_2d(m, "grad_y", gy, ad, ad, m->route.qlen, m->dim.H, 0));
    if (gx != NULL && gx->data != NULL)
        KT__TRY(check_2d(m, "grad_x", gx, ad, ad, m->route.qlen, m->dim.H, 0));
    if (gw != NULL && gw->data != NULL)
        KT__TRY(check_2d(m, "grad_weights", gw, KT_F32, KT_F32, m->route.qlen, m->dim.K, 0));
    if (!isfinite(scale))
        return kt__error(KT_EINVAL, "moe '%s': weight_grad_scale is not finite", m->name);
    return KT_OK;
}
