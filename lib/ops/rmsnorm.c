/* rmsnorm: y = x * rstd * w over the last dim H, rstd = 1 / sqrt(mean(x^2) + eps).
 *
 * Rows are independent and split over the pool; each row is walked in KT__CHUNK pieces so
 * rows of any length need only fixed stack buffers. A row's sums (of x^2, and backward's of
 * g w x) and its rstd are kept in double: in f32, x^2 overflows from |x| ~ 1.8e19 (rstd 0,
 * y 0) and the backward's rstd^3 underflows from an RMS of ~1e13 (dx's second term lost).
 * The weight gradient sums over rows: the backward first stores every row's rstd in scratch,
 * then splits dw's columns (never its rows) over the threads, so each column is summed in row
 * order whatever the thread count. */
#include <float.h>
#include <math.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static kt_status infer_rmsnorm(const kt_op_attrs *at, const kt_tensor *in, int n,
                               kt_tensor *out)
{
    (void)n;
    const kt_tensor *x = &in[0], *w = &in[1];
    KT__TRY(kt__check_float("rmsnorm", "x", x));
    KT__TRY(kt__check_rank("rmsnorm", "x", x, 1, KT_MAX_DIMS));
    KT__TRY(kt__check_same_dtype("rmsnorm", "w", w, x));
    KT__TRY(kt__check_rank("rmsnorm", "w", w, 1, 1));
    KT__TRY(kt__check_dim("rmsnorm", "w", w, 0, x->shape[x->ndim - 1]));
    if (!(at->eps >= 0.0f) || isinf(at->eps))
        return kt__error(KT_EINVAL, "rmsnorm: eps must be finite and >= 0, got %g",
                         (double)at->eps);
    kt__like(&out[0], x);
    return KT_OK;
}

/* the forward's square-add, two multiplies and the backward's rstd */
static double flops_rmsnorm(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return 4.0 * (double)kt_tensor_numel(&in[0]);
}

/* Backward scratch: one rstd per row. */
static size_t scratch_rmsnorm_bwd(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return (size_t)kt__rows(&in[0]) * sizeof(float);
}

/* rstd of the row that starts at element `off` */
static double row_rstd(const kt_tensor *x, int64_t off, int64_t h, float eps)
{
    float buf[KT__CHUNK];
    double ss = 0.0;
    for (int64_t i = 0; i < h; i += KT__CHUNK) {
        int64_t n = h - i < KT__CHUNK ? h - i : KT__CHUNK;
        const float *xs = kt__load_f32(x, off + i, n, buf);
        for (int64_t k = 0; k < n; k++)
            ss += (double)xs[k] * (double)xs[k];
    }
    return 1.0 / sqrt(ss / (double)h + (double)eps);
}

typedef struct norm_job {
    const kt_tensor *x, *w, *g;
    kt_tensor *y, *dx, *dw;
    float *rstd; /* backward: one per row */
    int64_t h, rows;
    float eps;
} norm_job;

static void fwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const norm_job *j = ctx;
    float xbuf[KT__CHUNK], wbuf[KT__CHUNK], ybuf[KT__CHUNK];
    for (int64_t r = begin; r < end; r++) {
        int64_t off = r * j->h;
        const float rs = (float)row_rstd(j->x, off, j->h, j->eps);
        /* each chunk is read before its output is written: safe when y aliases x */
        for (int64_t i = 0; i < j->h; i += KT__CHUNK) {
            int64_t n = j->h - i < KT__CHUNK ? j->h - i : KT__CHUNK;
            const float *xs = kt__load_f32(j->x, off + i, n, xbuf);
            const float *ws = kt__load_f32(j->w, i, n, wbuf);
            float *ys = kt__store_ptr(j->y, off + i, ybuf);
            for (int64_t k = 0; k < n; k++)
                ys[k] = xs[k] * rs * ws[k];
            kt__store_commit(j->y, off + i, n, ybuf);
        }
    }
}

static kt_status fwd_rmsnorm(const kt__op_call *c)
{
    norm_job j = {.x = &c->in[0], .w = &c->in[1], .y = &c->out_w[0],
                  .h = kt__row_len(&c->in[0]), .rows = kt__rows(&c->in[0]),
                  .eps = c->attrs->eps};
    kt_parallel_for(c->pool, j.rows, kt__rows_grain(j.h), fwd_rows, &j);
    return KT_OK;
}

/* With y = x r w and r = (mean(x^2) + eps)^-1/2, dr/dx = -r^3 x / H, so
 *   dx = r (g w) - x r^3 / H * sum(g w x).
 * Every row's r also goes to scratch for dw. */
static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const norm_job *j = ctx;
    float xbuf[KT__CHUNK], wbuf[KT__CHUNK], gbuf[KT__CHUNK], dbuf[KT__CHUNK];
    for (int64_t r = begin; r < end; r++) {
        int64_t off = r * j->h;
        const double rsd = row_rstd(j->x, off, j->h, j->eps);
        const float rs = (float)rsd;
        j->rstd[r] = rs;
        if (j->dx == NULL)
            continue;
        double dot = 0.0;
        for (int64_t i = 0; i < j->h; i += KT__CHUNK) {
            int64_t n = j->h - i < KT__CHUNK ? j->h - i : KT__CHUNK;
            const float *xs = kt__load_f32(j->x, off + i, n, xbuf);
            const float *ws = kt__load_f32(j->w, i, n, wbuf);
            const float *gs = kt__load_f32(j->g, off + i, n, gbuf);
            for (int64_t k = 0; k < n; k++)
                dot += (double)(gs[k] * ws[k]) * (double)xs[k];
        }
        const float coef = (float)(rsd * rsd * rsd * dot / (double)j->h);
        for (int64_t i = 0; i < j->h; i += KT__CHUNK) {
            int64_t n = j->h - i < KT__CHUNK ? j->h - i : KT__CHUNK;
            const float *xs = kt__load_f32(j->x, off + i, n, xbuf);
            const float *ws = kt__load_f32(j->w, i, n, wbuf);
            const float *gs = kt__load_f32(j->g, off + i, n, gbuf);
            float *ds = kt__store_ptr(j->dx, off + i, dbuf);
            for (int64_t k = 0; k < n; k++)
                ds[k] = rs * gs[k] * ws[k] - coef * xs[k];
            kt__store_commit(j->dx, off + i, n, dbuf);
        }
    }
}

/* dw[c] = sum over rows of g[r,c] x[r,c] rstd[r], over a range of columns */
static void dw_cols(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const norm_job *j = ctx;
    float xbuf[KT__CHUNK], gbuf[KT__CHUNK], acc[KT__CHUNK];
    for (int64_t c = begin; c < end; c += KT__CHUNK) {
        int64_t n = end - c < KT__CHUNK ? end - c : KT__CHUNK;
        for (int64_t k = 0; k < n; k++)
            acc[k] = 0.0f;
        for (int64_t r = 0; r < j->rows; r++) {
            const float *xs = kt__load_f32(j->x, r * j->h + c, n, xbuf);
            const float *gs = kt__load_f32(j->g, r * j->h + c, n, gbuf);
            const float rs = j->rstd[r];
            for (int64_t k = 0; k < n; k++)
                acc[k] += gs[k] * xs[k] * rs;
        }
        float obuf[KT__CHUNK];
        float *o = kt__store_ptr(j->dw, c, obuf);
        for (int64_t k = 0; k < n; k++)
            o[k] = acc[k];
        kt__store_commit(j->dw, c, n, obuf);
    }
}

static kt_status bwd_rmsnorm(const kt__op_call *c)
{
    kt_tensor *dx = c->gin[0].data ? &c->gin[0] : NULL;
    kt_tensor *dw = c->gin[1].data ? &c->gin[1] : NULL;
    if (dx == NULL && dw == NULL)
        return KT_OK;
    norm_job j = {.x = &c->in[0], .w = &c->in[1], .g = &c->gout[0], .dx = dx, .dw = dw,
                  .rstd = c->scratch, .h = kt__row_len(&c->in[0]), .rows = kt__rows(&c->in[0]),
                  .eps = c->attrs->eps};
    kt_parallel_for(c->pool, j.rows, kt__rows_grain(j.h), bwd_rows, &j);
    if (dw)
        kt_parallel_for(c->pool, j.h, kt__cols_grain(j.rows), dw_cols, &j);
    return KT_OK;
}

static const kt__attr_desc rmsnorm_attrs[] = {
    KT__A_FLOAT("eps", eps, 1e-6, 0.0, FLT_MAX, "added to mean(x^2) before the root"),
};

const kt__op_desc kt__op_rmsnorm = {
    .name = "rmsnorm", .min_in = 2, .max_in = 2, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_in = 3u, .infer = infer_rmsnorm, .scratch_bwd = scratch_rmsnorm_bwd,
    .flops = flops_rmsnorm, .forward = fwd_rmsnorm, .backward = bwd_rmsnorm,
    KT__ATTR_LIST(rmsnorm_attrs)};
