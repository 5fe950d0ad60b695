/* add, sub, mul (with b broadcast over a's leading dims) and scale. */
#include <float.h>

#include "lib/ops/map.h"
#include "lib/ops/op_util.h"

/* ---- shape inference ----------------------------------------------------------------- */

/* b must have a's shape or a suffix of it (b repeats along a's leading dims). */
static kt_status infer_binary(const char *op, const kt_tensor *in, kt_tensor *out)
{
    const kt_tensor *a = &in[0], *b = &in[1];
    KT__TRY(kt__check_float(op, "a", a));
    KT__TRY(kt__check_same_dtype(op, "b", b, a));
    int suffix = b->ndim <= a->ndim;
    for (int d = 0; suffix && d < b->ndim; d++)
        suffix = b->shape[b->ndim - 1 - d] == a->shape[a->ndim - 1 - d];
    if (!suffix) {
        char da[96], db[96];
        return kt__error(KT_EINVAL, "%s: b %s must have a's shape %s or a suffix of it", op,
                         kt_tensor_describe(b, db, sizeof db),
                         kt_tensor_describe(a, da, sizeof da));
    }
    kt__like(&out[0], a);
    return KT_OK;
}

static kt_status infer_add(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    return infer_binary("add", in, out);
}

static kt_status infer_sub(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    return infer_binary("sub", in, out);
}

static kt_status infer_mul(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    return infer_binary("mul", in, out);
}

static kt_status infer_scale(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    KT__TRY(kt__check_float("scale", "x", &in[0]));
    kt__like(&out[0], &in[0]);
    return KT_OK;
}

static double flops_numel(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return (double)kt_tensor_numel(&in[0]);
}

/* ---- chunk functions ------------------------------------------------------------------ */

static void f_add(float *o, const float *a, const float *b, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = a[i] + b[i];
}

static void f_sub(float *o, const float *a, const float *b, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = a[i] - b[i];
}

static void f_mul(float *o, const float *a, const float *b, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = a[i] * b[i];
}

void kt__map_scale(float *o, const float *a, int64_t n, const kt_op_attrs *at)
{
    const float s = at->alpha;
    for (int64_t i = 0; i < n; i++)
        o[i] = s * a[i];
}

static void f_copy(float *o, const float *a, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = a[i];
}

static void f_neg(float *o, const float *a, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = -a[i];
}

/* reduce_rows callbacks: the per-element contribution to a broadcast operand's gradient */
static void r_grad(float *o, const float *g, const float *a, int64_t n, const kt_op_attrs *at)
{
    (void)a, (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = g[i];
}

static void r_neg_grad(float *o, const float *g, const float *a, int64_t n,
                       const kt_op_attrs *at)
{
    (void)a, (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = -g[i];
}

/* ---- kernels ---------------------------------------------------------------------------- */

static kt_status fwd_add(const kt__op_call *c)
{
    kt__map2(c->pool, &c->out_w[0], &c->in[0], &c->in[1], f_add, c->attrs);
    return KT_OK;
}

static kt_status fwd_sub(const kt__op_call *c)
{
    kt__map2(c->pool, &c->out_w[0], &c->in[0], &c->in[1], f_sub, c->attrs);
    return KT_OK;
}

static kt_status fwd_mul(const kt__op_call *c)
{
    kt__map2(c->pool, &c->out_w[0], &c->in[0], &c->in[1], f_mul, c->attrs);
    return KT_OK;
}

static kt_status fwd_scale(const kt__op_call *c)
{
    kt__map1(c->pool, &c->out_w[0], &c->in[0], kt__map_scale, c->attrs);
    return KT_OK;
}

static int broadcast(const kt__op_call *c) { return !kt_tensor_same_shape(&c->in[0], &c->in[1]); }

/* d(a +- b): da = g; db = +-g, summed over the broadcast rows. */
static kt_status bwd_add_sub(const kt__op_call *c, int negate_b)
{
    if (c->gin[0].data)
        kt__map1(c->pool, &c->gin[0], &c->gout[0], f_copy, c->attrs);
    if (c->gin[1].data) {
        if (broadcast(c))
            kt__reduce_rows(c->pool, &c->gin[1], &c->gout[0], NULL,
                            negate_b ? r_neg_grad : r_grad, c->attrs);
        else
            kt__map1(c->pool, &c->gin[1], &c->gout[0], negate_b ? f_neg : f_copy, c->attrs);
    }
    return KT_OK;
}

static kt_status bwd_add(const kt__op_call *c) { return bwd_add_sub(c, 0); }

static kt_status bwd_sub(const kt__op_call *c) { return bwd_add_sub(c, 1); }

/* d(a * b): da = g * b (b broadcast), db = g * a (summed over broadcast rows). */
static kt_status bwd_mul(const kt__op_call *c)
{
    if (c->gin[0].data)
        kt__map2(c->pool, &c->gin[0], &c->gout[0], &c->in[1], f_mul, c->attrs);
    if (c->gin[1].data) {
        if (broadcast(c))
            kt__reduce_rows(c->pool, &c->gin[1], &c->gout[0], &c->in[0], f_mul, c->attrs);
        else
            kt__map2(c->pool, &c->gin[1], &c->gout[0], &c->in[0], f_mul, c->attrs);
    }
    return KT_OK;
}

static kt_status bwd_scale(const kt__op_call *c)
{
    if (c->gin[0].data)
        kt__map1(c->pool, &c->gin[0], &c->gout[0], kt__map_scale, c->attrs);
    return KT_OK;
}

/* ---- table rows -------------------------------------------------------------------------- */

/* No default: a scale by 0 or 1 no model means silently. */
static const kt__attr_desc scale_attrs[] = {
    KT__A_FLOAT_REQ("alpha", alpha, -FLT_MAX, FLT_MAX, "the factor"),
};

const kt__op_desc kt__op_add = {
    .name = "add", .min_in = 2, .max_in = 2, .n_out = 1, .inplace_in = 1u,
    .infer = infer_add, .flops = flops_numel, .forward = fwd_add, .backward = bwd_add};

const kt__op_desc kt__op_sub = {
    .name = "sub", .min_in = 2, .max_in = 2, .n_out = 1, .inplace_in = 1u,
    .infer = infer_sub, .flops = flops_numel, .forward = fwd_sub, .backward = bwd_sub};

const kt__op_desc kt__op_mul = {
    .name = "mul", .min_in = 2, .max_in = 2, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_in = 3u, .infer = infer_mul, .flops = flops_numel, .forward = fwd_mul,
    .backward = bwd_mul};

const kt__op_desc kt__op_scale = {
    .name = "scale", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .infer = infer_scale, .flops = flops_numel, .forward = fwd_scale, .backward = bwd_scale,
    KT__ATTR_LIST(scale_attrs)};
