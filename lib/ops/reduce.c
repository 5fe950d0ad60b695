/* sum and mean over one dim, and expand (a size-1 dim repeated): each other's backward.
 *
 * x is seen as [outer, n, inner] around the dim. A reduction sums the n slabs of one output
 * element in index order, in f32, and rounds once; the work is cut over output elements
 * (rows of outer and KT__CHUNK pieces of inner), never over n, so the order is fixed for any
 * pool. Spreading (expand, and the reductions' backward) writes each of the n slabs from the
 * one it repeats. */
#include <math.h>
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

/* ---- shapes ------------------------------------------------------------------------------- */

/* dim (negative: from the end) as an index into x's dims */
static kt_status resolve_dim(const char *op, const kt_tensor *x, int dim, int *out)
{
    KT__TRY(kt__check_rank(op, "x", x, 1, KT_MAX_DIMS));
    const int d = dim < 0 ? dim + x->ndim : dim;
    if (d < 0 || d >= x->ndim) {
        char desc[96];
        return kt__error(KT_EINVAL, "%s: dim %d outside -%d..%d for x %s", op, dim, x->ndim,
                         x->ndim - 1, kt_tensor_describe(x, desc, sizeof desc));
    }
    *out = d;
    return KT_OK;
}

/* Valid once infer accepted the attributes for x. */
static int dim_of(const kt_op_attrs *at, const kt_tensor *x)
{
    return at->dim < 0 ? at->dim + x->ndim : at->dim;
}

static kt_status infer_reduce(const char *op, const kt_op_attrs *at, const kt_tensor *in,
                              kt_tensor *out)
{
    const kt_tensor *x = &in[0];
    KT__TRY(kt__check_float(op, "x", x));
    int d = 0;
    KT__TRY(resolve_dim(op, x, at->dim, &d));
    int64_t shape[KT_MAX_DIMS];
    int nd = 0;
    for (int k = 0; k < x->ndim; k++) {
        if (k != d)
            shape[nd++] = x->shape[k];
        else if (at->reduce_keepdim)
            shape[nd++] = 1;
    }
    kt__shape_out(&out[0], x->dtype, nd, shape);
    return KT_OK;
}

static kt_status infer_sum(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    return infer_reduce("sum", at, in, out);
}

static kt_status infer_mean(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    return infer_reduce("mean", at, in, out);
}

static kt_status infer_expand(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    const kt_tensor *x = &in[0];
    KT__TRY(kt__check_float("expand", "x", x));
    int d = 0;
    KT__TRY(resolve_dim("expand", x, at->dim, &d));
    if (x->shape[d] != 1) {
        char desc[96];
        return kt__error(KT_EINVAL, "expand: x dimension %d must be 1 to be repeated, got %s", d,
                         kt_tensor_describe(x, desc, sizeof desc));
    }
    if (at->expand_size < 0)
        return kt__error(KT_EINVAL, "expand: size %lld must be >= 0",
                         (long long)at->expand_size);
    int64_t shape[KT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[d] = at->expand_size;
    kt__shape_out(&out[0], x->dtype, x->ndim, shape);
    return KT_OK;
}

static double flops_reduce(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return (double)kt_tensor_numel(&in[0]);
}

/* ---- kernels ------------------------------------------------------------------------------ */

typedef struct slab_job {
    kt_tensor *o;
    const kt_tensor *x;
    int64_t outer, n, inner, pieces;
    float divisor; /* 0: none (sum, expand); mean divides by n */
} slab_job;

static int64_t piece_len(int64_t inner, int64_t c0)
{
    return inner - c0 < KT__CHUNK ? inner - c0 : KT__CHUNK;
}

/* o[r, i] = sum over k of x[r, k, i], for items r * pieces + piece */
static void reduce_items(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const slab_job *j = ctx;
    float xbuf[KT__CHUNK], acc[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t w = begin; w < end; w++) {
        const int64_t r = w / j->pieces;
        if (j->inner == 1) { /* a contiguous row of n, summed in order */
            float s = 0.0f;
            for (int64_t k = 0; k < j->n; k += KT__CHUNK) {
                const int64_t len = piece_len(j->n, k);
                const float *x = kt__load_f32(j->x, r * j->n + k, len, xbuf);
                for (int64_t e = 0; e < len; e++)
                    s += x[e];
            }
            acc[0] = j->divisor != 0.0f ? s / j->divisor : s;
            float *o = kt__store_ptr(j->o, r, obuf);
            o[0] = acc[0];
            kt__store_commit(j->o, r, 1, obuf);
            continue;
        }
        const int64_t c0 = w % j->pieces * KT__CHUNK, len = piece_len(j->inner, c0);
        for (int64_t e = 0; e < len; e++)
            acc[e] = 0.0f;
        for (int64_t k = 0; k < j->n; k++) {
            const float *x = kt__load_f32(j->x, (r * j->n + k) * j->inner + c0, len, xbuf);
            for (int64_t e = 0; e < len; e++)
                acc[e] += x[e];
        }
        float *o = kt__store_ptr(j->o, r * j->inner + c0, obuf);
        for (int64_t e = 0; e < len; e++)
            o[e] = j->divisor != 0.0f ? acc[e] / j->divisor : acc[e];
        kt__store_commit(j->o, r * j->inner + c0, len, obuf);
    }
}

/* o[r, k, i] = x[r, i] (divided by divisor), for items r * pieces + piece */
static void spread_items(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const slab_job *j = ctx;
    float xbuf[KT__CHUNK], vbuf[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t w = begin; w < end; w++) {
        const int64_t r = w / j->pieces;
        if (j->inner == 1) { /* one value into a contiguous row of n */
            float v = *kt__load_f32(j->x, r, 1, xbuf);
            if (j->divisor != 0.0f)
                v /= j->divisor;
            for (int64_t k = 0; k < j->n; k += KT__CHUNK) {
                const int64_t len = piece_len(j->n, k);
                float *o = kt__store_ptr(j->o, r * j->n + k, obuf);
                for (int64_t e = 0; e < len; e++)
                    o[e] = v;
                kt__store_commit(j->o, r * j->n + k, len, obuf);
            }
            continue;
        }
        const int64_t c0 = w % j->pieces * KT__CHUNK, len = piece_len(j->inner, c0);
        const float *x = kt__load_f32(j->x, r * j->inner + c0, len, xbuf);
        for (int64_t e = 0; e < len; e++)
            vbuf[e] = j->divisor != 0.0f ? x[e] / j->divisor : x[e];
        for (int64_t k = 0; k < j->n; k++) {
            const int64_t at = (r * j->n + k) * j->inner + c0;
            float *o = kt__store_ptr(j->o, at, obuf);
            memcpy(o, vbuf, (size_t)len * sizeof *o);
            kt__store_commit(j->o, at, len, obuf);
        }
    }
}

/* big = [outer, n, inner] around dim d of `big`; small is [outer, inner] (any rank) */
static void run_slabs(kt_threadpool *pool, int spread, kt_tensor *o, const kt_tensor *x,
                      const kt_tensor *big, int d, float divisor)
{
    slab_job j = {.o = o, .x = x, .outer = kt__dims_product(big, 0, d), .n = big->shape[d],
                  .inner = kt__dims_product(big, d + 1, big->ndim), .divisor = divisor};
    if (j.outer == 0 || j.inner == 0)
        return;
    if (spread && j.n == 0)
        return;
    j.pieces = j.inner == 1 ? 1 : (j.inner + KT__CHUNK - 1) / KT__CHUNK;
    const int64_t per = j.n * (j.inner == 1 ? 1 : KT__CHUNK); /* elements an item touches */
    const int64_t grain = per > 0 && per < KT__GRAIN_ELEMS ? KT__GRAIN_ELEMS / per : 1;
    kt_parallel_for(pool, j.outer * j.pieces, grain, spread ? spread_items : reduce_items, &j);
}

static float mean_divisor(const kt_tensor *x, int d)
{
    return (float)x->shape[d];
}

static kt_status fwd_sum(const kt__op_call *c)
{
    run_slabs(c->pool, 0, &c->out_w[0], &c->in[0], &c->in[0], dim_of(c->attrs, &c->in[0]), 0.0f);
    return KT_OK;
}

/* An empty dim gives 0 / 0 = NaN, the mean of nothing. */
static kt_status fwd_mean(const kt__op_call *c)
{
    const int d = dim_of(c->attrs, &c->in[0]);
    const float n = mean_divisor(&c->in[0], d);
    if (n == 0.0f) {
        kt_tensor *o = &c->out_w[0];
        float buf[KT__CHUNK];
        for (int64_t i = 0; i < kt_tensor_numel(o); i += KT__CHUNK) {
            const int64_t len = piece_len(kt_tensor_numel(o), i);
            float *p = kt__store_ptr(o, i, buf);
            for (int64_t e = 0; e < len; e++)
                p[e] = NAN;
            kt__store_commit(o, i, len, buf);
        }
        return KT_OK;
    }
    run_slabs(c->pool, 0, &c->out_w[0], &c->in[0], &c->in[0], d, n);
    return KT_OK;
}

static kt_status bwd_sum(const kt__op_call *c)
{
    if (c->gin[0].data)
        run_slabs(c->pool, 1, &c->gin[0], &c->gout[0], &c->in[0], dim_of(c->attrs, &c->in[0]),
                  0.0f);
    return KT_OK;
}

static kt_status bwd_mean(const kt__op_call *c)
{
    const int d = dim_of(c->attrs, &c->in[0]);
    if (c->gin[0].data)
        run_slabs(c->pool, 1, &c->gin[0], &c->gout[0], &c->in[0], d, mean_divisor(&c->in[0], d));
    return KT_OK;
}

static kt_status fwd_expand(const kt__op_call *c)
{
    run_slabs(c->pool, 1, &c->out_w[0], &c->in[0], &c->out[0], dim_of(c->attrs, &c->in[0]),
              0.0f);
    return KT_OK;
}

static kt_status bwd_expand(const kt__op_call *c)
{
    if (c->gin[0].data)
        run_slabs(c->pool, 0, &c->gin[0], &c->gout[0], &c->gout[0],
                  dim_of(c->attrs, &c->in[0]), 0.0f);
    return KT_OK;
}

/* ---- table rows ----------------------------------------------------------------------------- */

static const kt__attr_desc reduce_attrs[] = {
    KT__A_INT_REQ("dim", dim, -KT_MAX_DIMS, KT_MAX_DIMS - 1,
                  "the dimension to reduce (negative: from the end)"),
    KT__A_BOOL("keepdim", reduce_keepdim, 0, "keep it as a dimension of size 1"),
};
static const kt__attr_desc expand_attrs[] = {
    KT__A_INT_REQ("dim", dim, -KT_MAX_DIMS, KT_MAX_DIMS - 1,
                  "the size-1 dimension to repeat (negative: from the end)"),
    KT__A_I64_REQ("size", expand_size, 0, INT64_MAX, "its new size"),
};

/* No backward reads a forward tensor's data: the shapes come from the inputs' descriptions. */
const kt__op_desc kt__op_sum = {
    .name = "sum", .min_in = 1, .max_in = 1, .n_out = 1, .infer = infer_sum,
    .flops = flops_reduce, .forward = fwd_sum, .backward = bwd_sum,
    KT__ATTR_LIST(reduce_attrs)};

const kt__op_desc kt__op_mean = {
    .name = "mean", .min_in = 1, .max_in = 1, .n_out = 1, .infer = infer_mean,
    .flops = flops_reduce, .forward = fwd_mean, .backward = bwd_mean,
    KT__ATTR_LIST(reduce_attrs)};

const kt__op_desc kt__op_expand = {
    .name = "expand", .min_in = 1, .max_in = 1, .n_out = 1, .infer = infer_expand,
    .forward = fwd_expand, .backward = bwd_expand,
    KT__ATTR_LIST(expand_attrs)};
