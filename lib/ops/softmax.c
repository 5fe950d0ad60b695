/* softmax and log_softmax over the last dim.
 *
 * Each row is made stable by subtracting its maximum before exp, and is walked in KT__CHUNK
 * pieces (max, sum of exp, write), so rows of any length need only fixed stack buffers. The
 * last pass reads each chunk before writing the same chunk of the output, which makes the
 * forward safe in place. Both backwards need only the output:
 *   softmax:     dx = y (g - sum(g y))
 *   log_softmax: dx = g - exp(y) sum(g) */
#include <math.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static kt_status infer_rowwise(const char *op, const kt_tensor *in, kt_tensor *out)
{
    KT__TRY(kt__check_float(op, "x", &in[0]));
    KT__TRY(kt__check_rank(op, "x", &in[0], 1, KT_MAX_DIMS));
    kt__like(&out[0], &in[0]);
    return KT_OK;
}

static kt_status infer_softmax(const kt_op_attrs *at, const kt_tensor *in, int n,
                               kt_tensor *out)
{
    (void)at, (void)n;
    return infer_rowwise("softmax", in, out);
}

static kt_status infer_log_softmax(const kt_op_attrs *at, const kt_tensor *in, int n,
                                   kt_tensor *out)
{
    (void)at, (void)n;
    return infer_rowwise("log_softmax", in, out);
}

/* max, subtract, exp, add, and a divide or subtract: about 5 an element */
static double flops_softmax(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return 5.0 * (double)kt_tensor_numel(&in[0]);
}

typedef struct softmax_job {
    const kt_tensor *x, *y, *g;
    kt_tensor *o; /* forward: y; backward: dx */
    int64_t v;
    int log;
} softmax_job;

static int64_t chunk_len(int64_t v, int64_t i) { return v - i < KT__CHUNK ? v - i : KT__CHUNK; }

static void fwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const softmax_job *j = ctx;
    float xbuf[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t r = begin; r < end; r++) {
        const int64_t off = r * j->v;
        float m = -INFINITY;
        for (int64_t i = 0; i < j->v; i += KT__CHUNK) {
            int64_t n = chunk_len(j->v, i);
            const float *xs = kt__load_f32(j->x, off + i, n, xbuf);
            for (int64_t k = 0; k < n; k++)
                m = xs[k] > m ? xs[k] : m;
        }
        float s = 0.0f;
        for (int64_t i = 0; i < j->v; i += KT__CHUNK) {
            int64_t n = chunk_len(j->v, i);
            const float *xs = kt__load_f32(j->x, off + i, n, xbuf);
            for (int64_t k = 0; k < n; k++)
                s += expf(xs[k] - m);
        }
        const float inv = 1.0f / s, shift = m + logf(s);
        for (int64_t i = 0; i < j->v; i += KT__CHUNK) {
            int64_t n = chunk_len(j->v, i);
            const float *xs = kt__load_f32(j->x, off + i, n, xbuf);
            float *os = kt__store_ptr(j->o, off + i, obuf);
            if (j->log)
                for (int64_t k = 0; k < n; k++)
                    os[k] = xs[k] - shift;
            else
                for (int64_t k = 0; k < n; k++)
                    os[k] = expf(xs[k] - m) * inv;
            kt__store_commit(j->o, off + i, n, obuf);
        }
    }
}

static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const softmax_job *j = ctx;
    float ybuf[KT__CHUNK], gbuf[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t r = begin; r < end; r++) {
        const int64_t off = r * j->v;
        /* softmax: sum(g y); log_softmax: sum(g) */
        float dot = 0.0f;
        for (int64_t i = 0; i < j->v; i += KT__CHUNK) {
            int64_t n = chunk_len(j->v, i);
            const float *gs = kt__load_f32(j->g, off + i, n, gbuf);
            if (j->log) {
                for (int64_t k = 0; k < n; k++)
                    dot += gs[k];
            } else {
                const float *ys = kt__load_f32(j->y, off + i, n, ybuf);
                for (int64_t k = 0; k < n; k++)
                    dot += gs[k] * ys[k];
            }
        }
        for (int64_t i = 0; i < j->v; i += KT__CHUNK) {
            int64_t n = chunk_len(j->v, i);
            const float *gs = kt__load_f32(j->g, off + i, n, gbuf);
            const float *ys = kt__load_f32(j->y, off + i, n, ybuf);
            float *os = kt__store_ptr(j->o, off + i, obuf);
            if (j->log)
                for (int64_t k = 0; k < n; k++)
                    os[k] = gs[k] - expf(ys[k]) * dot;
            else
                for (int64_t k = 0; k < n; k++)
                    os[k] = ys[k] * (gs[k] - dot);
            kt__store_commit(j->o, off + i, n, obuf);
        }
    }
}

static kt_status run_fwd(const kt__op_call *c, int log)
{
    softmax_job j = {.x = &c->in[0], .o = &c->out_w[0], .v = kt__row_len(&c->in[0]),
                     .log = log};
    kt_parallel_for(c->pool, kt__rows(&c->in[0]), kt__rows_grain(j.v), fwd_rows, &j);
    return KT_OK;
}

static kt_status run_bwd(const kt__op_call *c, int log)
{
    if (c->gin[0].data == NULL)
        return KT_OK;
    softmax_job j = {.y = &c->out[0], .g = &c->gout[0], .o = &c->gin[0],
                     .v = kt__row_len(&c->in[0]), .log = log};
    kt_parallel_for(c->pool, kt__rows(&c->in[0]), kt__rows_grain(j.v), bwd_rows, &j);
    return KT_OK;
}

static kt_status fwd_softmax(const kt__op_call *c) { return run_fwd(c, 0); }
static kt_status fwd_log_softmax(const kt__op_call *c) { return run_fwd(c, 1); }
static kt_status bwd_softmax(const kt__op_call *c) { return run_bwd(c, 0); }
static kt_status bwd_log_softmax(const kt__op_call *c) { return run_bwd(c, 1); }

const kt__op_desc kt__op_softmax = {
    .name = "softmax", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_out = 1u, .infer = infer_softmax, .flops = flops_softmax,
    .forward = fwd_softmax, .backward = bwd_softmax};

const kt__op_desc kt__op_log_softmax = {
    .name = "log_softmax", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_out = 1u, .infer = infer_log_softmax, .flops = flops_softmax,
    .forward = fwd_log_softmax, .backward = bwd_log_softmax};
