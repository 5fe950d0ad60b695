/* silu, swiglu (silu(g) * u, the gated activation of SwiGLU MLPs and MoE experts) and sigmoid
 * (Qwen2-MoE's shared-expert gate). */
#include <math.h>

#include "lib/ops/map.h"
#include "lib/ops/op_util.h"

static kt_status infer_silu(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    KT__TRY(kt__check_float("silu", "x", &in[0]));
    kt__like(&out[0], &in[0]);
    return KT_OK;
}

static kt_status infer_sigmoid(const kt_op_attrs *at, const kt_tensor *in, int n,
                               kt_tensor *out)
{
    (void)at, (void)n;
    KT__TRY(kt__check_float("sigmoid", "x", &in[0]));
    kt__like(&out[0], &in[0]);
    return KT_OK;
}

static kt_status infer_swiglu(const kt_op_attrs *at, const kt_tensor *in, int n,
                              kt_tensor *out)
{
    (void)at, (void)n;
    KT__TRY(kt__check_float("swiglu", "g", &in[0]));
    KT__TRY(kt__check_same_dtype("swiglu", "u", &in[1], &in[0]));
    KT__TRY(kt__check_same_shape("swiglu", "u", &in[1], &in[0]));
    kt__like(&out[0], &in[0]);
    return KT_OK;
}

/* silu costs about 4 flops an element (exp counted as one); swiglu one more */
static double flops_silu(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return 4.0 * (double)kt_tensor_numel(&in[0]);
}

static double flops_swiglu(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return 5.0 * (double)kt_tensor_numel(&in[0]);
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* exp of a non-positive number only, so neither side overflows and a very negative x keeps
 * its tiny value instead of 1 / (1 + inf) */
static void f_sigmoid(float *o, const float *x, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] >= 0.0f) {
            o[i] = 1.0f / (1.0f + expf(-x[i]));
        } else {
            const float e = expf(x[i]);
            o[i] = e / (1.0f + e);
        }
    }
}

/* d sigmoid(x)/dx = y (1 - y), from the output y; here multiplied by the incoming g */
static void f_sigmoid_grad(float *o, const float *g, const float *y, int64_t n,
                           const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = g[i] * y[i] * (1.0f - y[i]);
}

static void f_silu(float *o, const float *x, int64_t n, const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = x[i] * sigmoid(x[i]);
}

/* d silu(x)/dx = s (1 + x (1 - s)), s = sigmoid(x); here multiplied by the incoming g */
static void f_silu_grad(float *o, const float *g, const float *x, int64_t n,
                        const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++) {
        float s = sigmoid(x[i]);
        o[i] = g[i] * s * (1.0f + x[i] * (1.0f - s));
    }
}

static void f_swiglu(float *o, const float *g, const float *u, int64_t n,
                     const kt_op_attrs *at)
{
    (void)at;
    for (int64_t i = 0; i < n; i++)
        o[i] = g[i] * sigmoid(g[i]) * u[i];
}

static kt_status fwd_silu(const kt__op_call *c)
{
    kt__map1(c->pool, &c->out_w[0], &c->in[0], f_silu, c->attrs);
    return KT_OK;
}

static kt_status bwd_silu(const kt__op_call *c)
{
    if (c->gin[0].data)
        kt__map2(c->pool, &c->gin[0], &c->gout[0], &c->in[0], f_silu_grad, c->attrs);
    return KT_OK;
}

static kt_status fwd_sigmoid(const kt__op_call *c)
{
    kt__map1(c->pool, &c->out_w[0], &c->in[0], f_sigmoid, c->attrs);
    return KT_OK;
}

static kt_status bwd_sigmoid(const kt__op_call *c)
{
    if (c->gin[0].data)
        kt__map2(c->pool, &c->gin[0], &c->gout[0], &c->out[0], f_sigmoid_grad, c->attrs);
    return KT_OK;
}

static kt_status fwd_swiglu(const kt__op_call *c)
{
    kt__map2(c->pool, &c->out_w[0], &c->in[0], &c->in[1], f_swiglu, c->attrs);
    return KT_OK;
}

/* swiglu has three operands (dy, g, u), one more than the map drivers carry, so its
 * backward walks the chunks itself. */
typedef struct swiglu_bwd_job {
    const kt_tensor *dy, *g, *u;
    kt_tensor *dg, *du;
} swiglu_bwd_job;

static void swiglu_bwd_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const swiglu_bwd_job *j = ctx;
    float ybuf[KT__CHUNK], gbuf[KT__CHUNK], ubuf[KT__CHUNK], dgbuf[KT__CHUNK], dubuf[KT__CHUNK];
    for (int64_t i = begin; i < end; i += KT__CHUNK) {
        int64_t n = end - i < KT__CHUNK ? end - i : KT__CHUNK;
        const float *dy = kt__load_f32(j->dy, i, n, ybuf);
        const float *g = kt__load_f32(j->g, i, n, gbuf);
        const float *u = kt__load_f32(j->u, i, n, ubuf);
        float *dg = j->dg ? kt__store_ptr(j->dg, i, dgbuf) : NULL;
        float *du = j->du ? kt__store_ptr(j->du, i, dubuf) : NULL;
        for (int64_t k = 0; k < n; k++) {
            float s = sigmoid(g[k]);
            float silu = g[k] * s;
            if (dg)
                dg[k] = dy[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            if (du)
                du[k] = dy[k] * silu;
        }
        if (dg)
            kt__store_commit(j->dg, i, n, dgbuf);
        if (du)
            kt__store_commit(j->du, i, n, dubuf);
    }
}

static kt_status bwd_swiglu(const kt__op_call *c)
{
    swiglu_bwd_job j = {.dy = &c->gout[0], .g = &c->in[0], .u = &c->in[1],
                        .dg = c->gin[0].data ? &c->gin[0] : NULL,
                        .du = c->gin[1].data ? &c->gin[1] : NULL};
    if (j.dg || j.du)
        kt_parallel_for(c->pool, kt_tensor_numel(&c->in[0]), 8192, swiglu_bwd_range, &j);
    return KT_OK;
}

const kt__op_desc kt__op_silu = {
    .name = "silu", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_in = 1u, .infer = infer_silu, .flops = flops_silu, .forward = fwd_silu,
    .backward = bwd_silu};

const kt__op_desc kt__op_swiglu = {
    .name = "swiglu", .min_in = 2, .max_in = 2, .n_out = 1, .inplace_in = 3u,
    .bwd_reads_in = 3u, .infer = infer_swiglu, .flops = flops_swiglu, .forward = fwd_swiglu,
    .backward = bwd_swiglu};

/* The backward reads only the output, so the forward may overwrite its input. */
const kt__op_desc kt__op_sigmoid = {
    .name = "sigmoid", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .bwd_reads_out = 1u, .infer = infer_sigmoid, .flops = flops_silu, .forward = fwd_sigmoid,
    .backward = bwd_sigmoid};
