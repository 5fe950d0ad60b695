/* Argument checks, grouping (token, slot) pairs by expert, and splitting GEMM phases into
 * equal-cost tasks. */
#include <math.h>
#include <string.h>

#include "core/error.h"
#include "moe/moe_internal.h"

int64_t kt__moe_get_id(const kt_tensor *ids, int64_t i)
{
    return ids->dtype == KT_I32 ? (int64_t)((const int32_t *)ids->data)[i]
                                : ((const int64_t *)ids->data)[i];
}

/* A contiguous CPU 2-D tensor of `dtype` (or any of two dtypes) with the expected shape. */
static kt_status check_2d(const kt_moe *m, const char *what, const kt_tensor *t, kt_dtype d1,
                          kt_dtype d2, int64_t rows, int64_t cols, int allow_null_data)
{
    char buf[64];
    if (t == NULL)
        return kt__error(KT_EINVAL, "moe '%s': %s is NULL", m->name, what);
    if (t->data == NULL && !allow_null_data && t->ndim == 2 && t->shape[0] * t->shape[1] > 0)
        return kt__error(KT_EINVAL, "moe '%s': %s has no data", m->name, what);
    if (t->dtype != d1 && t->dtype != d2)
        return kt__error(KT_EINVAL, "moe '%s': %s must be %s%s%s, got %s", m->name, what,
                         kt_dtype_name(d1), d1 != d2 ? " or " : "",
                         d1 != d2 ? kt_dtype_name(d2) : "", kt_tensor_describe(t, buf, sizeof buf));
    if (t->device.type != KT_DEVICE_CPU)
        return kt__error(KT_EINVAL, "moe '%s': %s must be on the CPU", m->name, what);
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return kt__error(KT_EINVAL, "moe '%s': %s must have shape [%lld,%lld], got %s", m->name,
                         what, (long long)rows, (long long)cols,
                         kt_tensor_describe(t, buf, sizeof buf));
    if (!kt_tensor_is_contiguous(t))
        return kt__error(KT_EINVAL, "moe '%s': %s must be contiguous", m->name, what);
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
                         (long long)m->H, x->ndim);
    int64_t qlen = x->shape[0];
    if (qlen > m->T)
        return kt__error(KT_ERANGE, "moe '%s': qlen %lld exceeds max_tokens %lld", m->name,
                         (long long)qlen, (long long)m->T);
    KT__TRY(check_2d(m, "x", x, ad, ad, qlen, m->H, 0));
    KT__TRY(check_2d(m, "ids", ids, KT_I32, KT_I64, qlen, m->K, 0));
    KT__TRY(check_2d(m, "weights", w, KT_F32, KT_F32, qlen, m->K, 0));
    KT__TRY(check_2d(m, "y", y, ad, ad, qlen, m->H, 0));
    for (int64_t t = 0; t < qlen; t++)
        for (int64_t j = 0; j < m->K; j++) {
            int64_t e = kt__moe_get_id(ids, t * m->K + j);
            if (e < 0 || e >= m->E)
                return kt__error(KT_ERANGE,
                                 "moe '%s': token %lld slot %lld: expert id %lld out of range "
                                 "[0, %lld)",
                                 m->name, (long long)t, (long long)j, (long long)e,
                                 (long long)m->E);
            /* k is small: a quadratic scan beats a per-call bitmap. */
            for (int64_t i = 0; i < j; i++)
                if (kt__moe_get_id(ids, t * m->K + i) == e)
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
    int64_t n = job->qlen * m->K;
    const float *w = job->w->data;
    memset(m->off, 0, (size_t)(m->E + 1) * sizeof *m->off);
    for (int64_t s = 0; s < n; s++) {
        int64_t e = kt__moe_get_id(job->ids, s);
        if (e < 0 || e >= m->E || m->off[e + 1] == job->qlen)
            return kt__error(KT_EINVAL,
                             "moe '%s': token %lld slot %lld: expert id %lld is out of range or "
                             "repeated (ids changed after they were submitted?)",
                             m->name, (long long)(s / m->K), (long long)(s % m->K), (long long)e);
        m->slot_expert[s] = (int32_t)e;
        m->slot_w[s] = w[s];
        m->off[e + 1]++;
    }
    for (int64_t e = 0; e < m->E; e++) {
        m->off[e + 1] += m->off[e];
        m->cursor[e] = m->off[e];
    }
    for (int64_t s = 0; s < n; s++) {
        int64_t e = m->slot_expert[s];
        int64_t r = m->cursor[e]++;
        m->slot_row[s] = (int32_t)r;
        m->row_expert[r] = (int32_t)e;
    }
    m->qlen = job->qlen;
    return KT_OK;
}

static int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

/* Column blocks per expert sized so that rows * width is about the same in every task: the
 * static partition hands each thread a contiguous run of tasks, so equal costs mean equal
 * work. About four tasks per thread leave room for the rounding to 16 columns. */
int64_t kt__moe_plan(kt_moe *m, int64_t cols)
{
    int64_t rows = m->off[m->E];
    int64_t n = 0;
    if (rows == 0)
        return 0;
    int64_t target = rows * cols / (4 * (int64_t)m->n_threads);
    if (target < 1)
        target = 1;
    for (int64_t e = 0; e < m->E; e++) {
        int64_t me = m->off[e + 1] - m->off[e];
        if (me == 0)
            continue;
        int64_t width = align_up((target + me - 1) / me, KT__MOE_COL_ALIGN);
        if (width > cols)
            width = cols;
        for (int64_t c = 0; c < cols; c += width) {
            m->tasks[n].e = e;
            m->tasks[n].c0 = c;
            m->tasks[n].c1 = c + width < cols ? c + width : cols;
            n++;
        }
    }
    return n;
}

/* One contiguous share of the phase's cost (rows * columns) per thread, exactly balanced up to
 * the 16-column rounding of the split points: thread p owns the cost range
 * [p C / P, (p + 1) C / P), walked in (expert, column) order, where expert e's column c sits at
 * off[e] * cols + me * c. A share becomes one task per expert it touches, so a thread streams
 * each weight block it needs once, in long runs (one token: a few experts cut into P slices;
 * a thousand tokens: P runs of whole experts), and no thread waits on another's leftovers.
 * Each output element is still computed whole by one task, in a fixed order. */
/* The shares of threads [p0, p1) over experts [e0, e1), tasks appended from index n;
 * returns the new task count. */
static int64_t plan_range(kt_moe *m, int64_t cols, int64_t e0, int64_t e1, int64_t p0, int64_t p1,
                          int64_t n)
{
    const int64_t P = p1 - p0, base = m->off[e0], rows = m->off[e1] - base;
    int64_t e = e0, c = 0;
    for (int64_t p = 0; p < P; p++) {
        /* the split point ending share p, as (es, cs): column cs of expert es */
        int64_t es = e1, cs = 0;
        if (p + 1 < P && rows > 0) {
            const int64_t b = (p + 1) * rows / P * cols + ((p + 1) * rows % P) * cols / P;
            es = e0;
            while (es < e1 && (m->off[es + 1] - base) * cols <= b)
                es++;
            if (es < e1) {
                const int64_t me = m->off[es + 1] - m->off[es];
                cs = (b - (m->off[es] - base) * cols + me / 2) / me;
                cs = (cs + KT__MOE_COL_ALIGN / 2) / KT__MOE_COL_ALIGN * KT__MOE_COL_ALIGN;
                if (cs >= cols) {
                    es++;
                    cs = 0;
                }
            }
            /* never behind the previous split */
            if (es < e || (es == e && cs < c)) {
                es = e;
                cs = c;
            }
        }
        for (; e < es || (e == es && c < cs); e++, c = 0) {
            const int64_t end = e == es ? cs : cols;
            if (m->off[e + 1] == m->off[e] || end <= c)
                continue;
            m->tasks[n].e = e;
            m->tasks[n].c0 = c;
            m->tasks[n].c1 = end;
            n++;
            if (e == es)
                break;
        }
        e = es;
        c = cs;
        m->part[p0 + p + 1] = n;
    }
    return n;
}

int64_t kt__moe_plan_parts(kt_moe *m, int64_t cols)
{
    /* NUMA split: each node group's experts go to that group's threads only */
    int64_t n = 0;
    m->part[0] = 0;
    for (int g = 0; g < m->n_groups; g++)
        n = plan_range(m, cols, m->group_e[g], m->group_e[g + 1], m->group_t[g], m->group_t[g + 1],
                       n);
    return n;
}

void kt__moe_run_parts(kt_moe *m, kt_range_fn fn, void *ctx)
{
    if (m->part[m->n_threads] > 0)
        kt_parallel_for(m->pool, m->n_threads, 1, fn, ctx);
}

kt_status kt__moe_check_backward(kt_moe *m, const kt_tensor *gy, const kt_tensor *gx,
                                 const kt_tensor *gw, float scale)
{
    kt_dtype ad = m->cfg.act_dtype;
    KT__TRY(check_2d(m, "grad_y", gy, ad, ad, m->qlen, m->H, 0));
    if (gx != NULL && gx->data != NULL)
        KT__TRY(check_2d(m, "grad_x", gx, ad, ad, m->qlen, m->H, 0));
    if (gw != NULL && gw->data != NULL)
        KT__TRY(check_2d(m, "grad_weights", gw, KT_F32, KT_F32, m->qlen, m->K, 0));
    if (!isfinite(scale))
        return kt__error(KT_EINVAL, "moe '%s': weight_grad_scale is not finite", m->name);
    return KT_OK;
}
