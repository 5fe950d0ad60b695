/* add, sub, mul (b broadcast into a), scale and clamp.
 *
 * A b whose shape, without its leading 1s, is a suffix of a's repeats every numel(b) elements
 * of a and runs the flat drivers (map2, reduce_rows); any other broadcast (a per-row scale
 * [T,1] of [T,H], a [1,H] of [T,H] ...) runs the strided ones (map2_bcast, reduce_bcast). */
#include <float.h>

#include "lib/ops/map.h"
#include "lib/ops/op_util.h"

/* ---- shape inference ----------------------------------------------------------------- */

/* b broadcasts into a by numpy's rules, the output keeping a's shape: b's dims, aligned from
 * the end, are each 1 or a's, and b has no more dims than a but for leading 1s. */
static kt_status infer_binary(const char *op, const kt_tensor *in, kt_tensor *out)
{
    const kt_tensor *a = &in[0], *b = &in[1];
    KT__TRY(kt__check_float(op, "a", a));
    KT__TRY(kt__check_same_dtype(op, "b", b, a));
    if (!kt__bcast_ok(a, b)) {
        char da[96], db[96];
        return kt__error(KT_EINVAL,
                         "%s: b %s does not broadcast into a %s: each dim of b, aligned from "
                         "the end, must be 1 or a's (the output has a's shape)",
                         op, kt_tensor_describe(b, db, sizeof db),
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

static kt_status infer_clamp(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    KT__TRY(kt__check_float("clamp", "x", &in[0]));
    if (!(at->clamp_min <= at->clamp_max))
        return kt__error(KT_EINVAL, "clamp: min %g is above max %g", (double)at->clamp_min,
                         (double)at->clamp_max);
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

/* NaN stays NaN (both comparisons are false) */
static void f_clamp(float *o, const float *x, int64_t n, const kt_op_attrs *at)
{
    const float lo = at->clamp_min, hi = at->clamp_max;
    for (int64_t i = 0; i < n; i++)
        o[i] = x[i] < lo ? lo : x[i] > hi ? hi : x[i];
}

/* the gradient passes where x is inside [min, max], bounds included */
static void f_clamp_grad(float *o, const float *g, const float *x, int64_t n,
                         const kt_op_attrs *at)
{
    const float lo = at->clamp_min, hi = at->clamp_max;
    for (int64_t i = 0; i < n; i++)
        o[i] = x[i] >= lo && x[i] <= hi ? g[i] : 0.0f;
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

/* o = f(x, b) with b broadcast into x (x has a's shape) */
static void map2_b(const kt__op_call *c, kt_tensor *o, const kt_tensor *x, kt__map2_fn f)
{
    if (kt__bcast_flat(&c->in[0], &c->in[1]))
        kt__map2(c->pool, o, x, &c->in[1], f, c->attrs);
    else
        kt__map2_bcast(c->pool, o, x, &c->in[1], f, c->attrs);
}

/* db = the sum of f(g, x) over the elements of a that each element of b broadcast to */
static void reduce_b(const kt__op_call *c, const kt_tensor *x, kt__map2_fn f)
{
    if (kt__bcast_flat(&c->in[0], &c->in[1]))
        kt__reduce_rows(c->pool, &c->gin[1], &c->gout[0], x, f, c->attrs);
    else
        kt__reduce_bcast(c->pool, &c->gin[1], &c->gout[0], x, f, c->attrs);
}

static kt_status fwd_add(const kt__op_call *c)
{
    map2_b(c, &c->out_w[0], &c->in[0], f_add);
    return KT_OK;
}

static kt_status fwd_sub(const kt__op_call *c)
{
    map2_b(c, &c->out_w[0], &c->in[0], f_sub);
    return KT_OK;
}

static kt_status fwd_mul(const kt__op_call *c)
{
    map2_b(c, &c->out_w[0], &c->in[0], f_mul);
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
            reduce_b(c, NULL, negate_b ? r_neg_grad : r_grad);
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
        map2_b(c, &c->gin[0], &c->gout[0], f_mul);
    if (c->gin[1].data) {
        if (broadcast(c))
            reduce_b(c, &c->in[0], f_mul);
        else
            kt__map2(c->pool, &c->gin[1], &c->gout[0], &c->in[0], f_mul, c->attrs);
    }
    return KT_OK;
}

static kt_status fwd_clamp(const kt__op_call *c)
{
    kt__map1(c->pool, &c->out_w[0], &c->in[0], f_clamp, c->attrs);
    return KT_OK;
}

static kt_status bwd_clamp(const kt__op_call *c)
{
    if (c->gin[0].data)
        kt__map2(c->pool, &c->gin[0], &c->gout[0], &c->in[0], f_clamp_grad, c->attrs);
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

/* Unbounded by default: OLMoE's clip_qkv sets both (min = -clip, max = clip). */
static const kt__attr_desc clamp_attrs[] = {
    KT__A_FLOAT("min", clamp_min, -FLT_MAX, -FLT_MAX, FLT_MAX, "the lower bound (the default: none)"),
    KT__A_FLOAT("max", clamp_max, FLT_MAX, -FLT_MAX, FLT_MAX, "the upper bound (the default: none)"),
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

const kt__op_desc kt__op_clamp = {
    .name = "clamp", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_in = 1u, .infer = infer_clamp, .flops = flops_numel, .forward = fwd_clamp,
    .backward = bwd_clamp,
    KT__ATTR_LIST(clamp_attrs)};
