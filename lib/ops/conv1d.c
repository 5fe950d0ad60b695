/* conv1d: temporal convolution over x [T,Cin] or [B,T,Cin] with w [Cout,K,Cin], or
 * depthwise with w [C,K]; no bias.
 *
 *   y[b,t,o] = sum_j sum_c w[o,j,c] x[b, t - pad + j, c]   (x is zero outside [0,T))
 *
 * where pad (the left padding) is K-1 for causal, K/2 for same and 0 for valid. The full
 * convolution is one GEMM per tap over the rows where that tap lands inside x; taps are
 * accumulated in order, so every output is summed in a fixed order. bf16/f16 operands are
 * staged to f32 in scratch, as in matmul. */
#include <string.h>

#include "lib/kernels/sgemm.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

typedef struct conv_geom {
    int64_t B, T, Tout, Cin, Cout, K, pad;
    int depthwise;
} conv_geom;

/* Valid only after infer accepted the inputs (or for shapes of the right ranks). */
static conv_geom geom_of(const kt_op_attrs *at, const kt_tensor *in)
{
    const kt_tensor *x = &in[0], *w = &in[1];
    conv_geom g;
    g.depthwise = at->depthwise != 0;
    g.B = x->ndim == 3 ? x->shape[0] : 1;
    g.T = x->shape[x->ndim - 2];
    g.Cin = x->shape[x->ndim - 1];
    g.K = w->shape[1];
    g.Cout = g.depthwise ? g.Cin : w->shape[0];
    g.pad = at->conv_mode == KT_CONV_CAUSAL ? g.K - 1 : at->conv_mode == KT_CONV_SAME ? g.K / 2 : 0;
    g.Tout = at->conv_mode == KT_CONV_VALID ? g.T - g.K + 1 : g.T;
    return g;
}

static kt_status infer_conv1d(const kt_op_attrs *at, const kt_tensor *in, int n,
                              kt_tensor *out)
{
    (void)n;
    const kt_tensor *x = &in[0], *w = &in[1];
    char d[96];
    KT__TRY(kt__check_float("conv1d", "x", x));
    KT__TRY(kt__check_same_dtype("conv1d", "w", w, x));
    KT__TRY(kt__check_rank("conv1d", "x", x, 2, 3));
    if ((unsigned)at->conv_mode > (unsigned)KT_CONV_VALID)
        return kt__error(KT_EINVAL, "conv1d: attrs.conv_mode %d is not causal (0), same (1) "
                         "or valid (2)", (int)at->conv_mode);
    const int64_t cin = x->shape[x->ndim - 1];
    if (at->depthwise) {
        KT__TRY(kt__check_rank("conv1d", "w (depthwise, [C,K])", w, 2, 2));
        if (w->shape[0] != cin)
            return kt__error(KT_EINVAL, "conv1d: w (depthwise) dimension 0 must be %lld (x's "
                             "channels), got %s", (long long)cin,
                             kt_tensor_describe(w, d, sizeof d));
    } else {
        KT__TRY(kt__check_rank("conv1d", "w ([Cout,K,Cin])", w, 3, 3));
        if (w->shape[2] != cin)
            return kt__error(KT_EINVAL, "conv1d: w dimension 2 must be %lld (x's channels), "
                             "got %s", (long long)cin, kt_tensor_describe(w, d, sizeof d));
    }
    if (w->shape[1] < 1)
        return kt__error(KT_EINVAL, "conv1d: w dimension 1 (the kernel size) must be at "
                         "least 1, got %s", kt_tensor_describe(w, d, sizeof d));
    const conv_geom g = geom_of(at, in);
    if (at->conv_mode == KT_CONV_VALID && g.T < g.K)
        return kt__error(KT_EINVAL, "conv1d: x has %lld time steps, fewer than the kernel "
                         "size %lld that valid mode needs (x %s)", (long long)g.T,
                         (long long)g.K, kt_tensor_describe(x, d, sizeof d));
    int64_t shape[3] = {g.B, g.Tout, g.Cout};
    if (x->ndim == 3)
        kt__shape_out(&out[0], x->dtype, 3, shape);
    else
        kt__shape_out(&out[0], x->dtype, 2, shape + 1);
    return KT_OK;
}

static double flops_conv1d(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (n != 2 || in[0].ndim < 2 || in[0].ndim > 3 || in[1].ndim < 2)
        return 0.0;
    const conv_geom g = geom_of(at, in);
    const double macs_per_out = g.depthwise ? (double)g.K : (double)g.K * (double)g.Cin;
    return 2.0 * (double)g.B * (double)g.Tout * (double)g.Cout * macs_per_out;
}

/* Scratch is only sized for inputs of the right ranks; infer rejects the rest before any
 * kernel runs. */
static int staged(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (n != 2 || (in[0].dtype != KT_BF16 && in[0].dtype != KT_F16))
        return 0;
    return (in[0].ndim == 2 || in[0].ndim == 3) && in[1].ndim == (at->depthwise ? 2 : 3);
}

static int64_t out_numel(const conv_geom *g) { return g->B * g->Tout * g->Cout; }

/* forward: x, w, y */
static size_t scratch_fwd_conv1d(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (!staged(at, in, n))
        return 0;
    const conv_geom g = geom_of(at, in);
    return kt__f32_scratch_bytes(kt_tensor_numel(&in[0])) +
           kt__f32_scratch_bytes(kt_tensor_numel(&in[1])) + kt__f32_scratch_bytes(out_numel(&g));
}

/* backward: x, w, grad y, dx, dw */
static size_t scratch_bwd_conv1d(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (!staged(at, in, n))
        return 0;
    const conv_geom g = geom_of(at, in);
    return 2 * kt__f32_scratch_bytes(kt_tensor_numel(&in[0])) +
           2 * kt__f32_scratch_bytes(kt_tensor_numel(&in[1])) +
           kt__f32_scratch_bytes(out_numel(&g));
}

/* The output rows [t0, t1) that tap j reads from inside x: 0 <= t - pad + j < T. */
static void tap_rows(const conv_geom *g, int64_t j, int64_t *t0, int64_t *t1)
{
    const int64_t lo = g->pad - j, hi = g->T + g->pad - j;
    *t0 = lo > 0 ? lo : 0;
    *t1 = hi < g->Tout ? hi : g->Tout;
}

/* ---- full convolution: one GEMM per (batch, tap) ------------------------------------------ */

static kt_status full_forward(kt_threadpool *pool, const conv_geom *g, const float *x,
                              const float *w, float *y)
{
    memset(y, 0, (size_t)out_numel(g) * sizeof *y);
    for (int64_t b = 0; b < g->B; b++) {
        const float *xb = x + b * g->T * g->Cin;
        float *yb = y + b * g->Tout * g->Cout;
        for (int64_t j = 0; j < g->K; j++) {
            int64_t t0, t1;
            tap_rows(g, j, &t0, &t1);
            if (t1 <= t0)
                continue;
            /* y[t0:t1] += x[t0-pad+j : t1-pad+j] w[:,j,:]^T */
            KT__TRY(kt__sgemm(pool, 0, 1, t1 - t0, g->Cout, g->Cin, 1.0f,
                              xb + (t0 - g->pad + j) * g->Cin, g->Cin, w + j * g->Cin,
                              g->K * g->Cin, 1.0f, yb + t0 * g->Cout, g->Cout));
        }
    }
    return KT_OK;
}

static kt_status full_backward(kt_threadpool *pool, const conv_geom *g, const float *x,
                               const float *w, const float *gy, float *dx, float *dw)
{
    if (dx) {
        memset(dx, 0, (size_t)(g->B * g->T * g->Cin) * sizeof *dx);
        for (int64_t b = 0; b < g->B; b++) {
            const float *gb = gy + b * g->Tout * g->Cout;
            float *dxb = dx + b * g->T * g->Cin;
            for (int64_t j = 0; j < g->K; j++) {
                int64_t t0, t1;
                tap_rows(g, j, &t0, &t1);
                if (t1 <= t0)
                    continue;
                /* dx[t0-pad+j : t1-pad+j] += gy[t0:t1] w[:,j,:] */
                KT__TRY(kt__sgemm(pool, 0, 0, t1 - t0, g->Cin, g->Cout, 1.0f,
                                  gb + t0 * g->Cout, g->Cout, w + j * g->Cin, g->K * g->Cin,
                                  1.0f, dxb + (t0 - g->pad + j) * g->Cin, g->Cin));
            }
        }
    }
    if (dw) {
        memset(dw, 0, (size_t)(g->Cout * g->K * g->Cin) * sizeof *dw);
        for (int64_t j = 0; j < g->K; j++) {
            int64_t t0, t1;
            tap_rows(g, j, &t0, &t1);
            if (t1 <= t0)
                continue;
            /* batches in order: the sum over (b, t) is fixed whatever the pool */
            for (int64_t b = 0; b < g->B; b++)
                KT__TRY(kt__sgemm(pool, 1, 0, g->Cout, g->Cin, t1 - t0, 1.0f,
                                  gy + (b * g->Tout + t0) * g->Cout, g->Cout,
                                  x + (b * g->T + t0 - g->pad + j) * g->Cin, g->Cin, 1.0f,
                                  dw + j * g->Cin, g->K * g->Cin));
        }
    }
    return KT_OK;
}

/* ---- depthwise convolution: each channel on its own, w [C,K] -------------------------------- */

typedef struct dw_job {
    const conv_geom *g;
    const float *x, *w, *gy;
    float *y, *dx, *dw;
} dw_job;

/* rows of y = (b, t) pairs; taps in order for each output */
static void dw_forward_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const dw_job *J = ctx;
    const conv_geom *g = J->g;
    const int64_t C = g->Cin, K = g->K;
    for (int64_t r = begin; r < end; r++) {
        const int64_t b = r / g->Tout, t = r % g->Tout;
        float *y = J->y + r * C;
        for (int64_t c = 0; c < C; c++)
            y[c] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t s = t - g->pad + j;
            if (s < 0 || s >= g->T)
                continue;
            const float *x = J->x + (b * g->T + s) * C;
            for (int64_t c = 0; c < C; c++)
                y[c] += J->w[c * K + j] * x[c];
        }
    }
}

/* rows of dx = (b, s) pairs: dx[b,s,c] = sum_j w[c,j] gy[b, s + pad - j, c] */
static void dw_backward_x_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const dw_job *J = ctx;
    const conv_geom *g = J->g;
    const int64_t C = g->Cin, K = g->K;
    for (int64_t r = begin; r < end; r++) {
        const int64_t b = r / g->T, s = r % g->T;
        float *dx = J->dx + r * C;
        for (int64_t c = 0; c < C; c++)
            dx[c] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t t = s + g->pad - j;
            if (t < 0 || t >= g->Tout)
                continue;
            const float *gy = J->gy + (b * g->Tout + t) * C;
            for (int64_t c = 0; c < C; c++)
                dx[c] += J->w[c * K + j] * gy[c];
        }
    }
}

/* a range of channels: dw[c,j] = sum over (b, t) in order of gy[b,t,c] x[b, t-pad+j, c],
 * so each weight has one owner and one summation order whatever the pool */
static void dw_backward_w_channels(void *ctx, int64_t c0, int64_t c1, int thread)
{
    (void)thread;
    const dw_job *J = ctx;
    const conv_geom *g = J->g;
    const int64_t C = g->Cin, K = g->K;
    for (int64_t c = c0; c < c1; c++)
        for (int64_t j = 0; j < K; j++)
            J->dw[c * K + j] = 0.0f;
    for (int64_t b = 0; b < g->B; b++) {
        for (int64_t t = 0; t < g->Tout; t++) {
            const float *gy = J->gy + (b * g->Tout + t) * C;
            for (int64_t j = 0; j < K; j++) {
                const int64_t s = t - g->pad + j;
                if (s < 0 || s >= g->T)
                    continue;
                const float *x = J->x + (b * g->T + s) * C;
                for (int64_t c = c0; c < c1; c++)
                    J->dw[c * K + j] += gy[c] * x[c];
            }
        }
    }
}

/* ---- kernels ----------------------------------------------------------------------------- */

/* Where to compute a result of t's size: t itself for f32, else scratch (NULL t: none). */
static float *result(kt_tensor *t, char **cursor)
{
    if (t == NULL)
        return NULL;
    return t->dtype == KT_F32 ? t->data : kt__scratch_take(cursor, kt_tensor_numel(t));
}

static kt_status fwd_conv1d(const kt__op_call *c)
{
    const conv_geom g = geom_of(c->attrs, c->in);
    char *cursor = c->scratch;
    const float *x = kt__stage_operand(c->pool, &c->in[0], &cursor);
    const float *w = kt__stage_operand(c->pool, &c->in[1], &cursor);
    kt_tensor *yt = &c->out_w[0];
    float *y = result(yt, &cursor);
    if (g.depthwise) {
        dw_job J = {.g = &g, .x = x, .w = w, .y = y};
        kt_parallel_for(c->pool, g.B * g.Tout, kt__rows_grain(g.Cin * g.K), dw_forward_rows, &J);
    } else {
        KT__TRY(full_forward(c->pool, &g, x, w, y));
    }
    if (yt->dtype != KT_F32)
        kt__unstage_f32(c->pool, yt, y);
    return KT_OK;
}

static kt_status bwd_conv1d(const kt__op_call *c)
{
    const conv_geom g = geom_of(c->attrs, c->in);
    kt_tensor *dxt = c->gin[0].data ? &c->gin[0] : NULL;
    kt_tensor *dwt = c->gin[1].data ? &c->gin[1] : NULL;
    if (!dxt && !dwt)
        return KT_OK;
    char *cursor = c->scratch;
    const float *x = kt__stage_operand(c->pool, &c->in[0], &cursor);
    const float *w = kt__stage_operand(c->pool, &c->in[1], &cursor);
    const float *gy = kt__stage_operand(c->pool, &c->gout[0], &cursor);
    float *dx = result(dxt, &cursor);
    float *dw = result(dwt, &cursor);
    if (g.depthwise) {
        dw_job J = {.g = &g, .x = x, .w = w, .gy = gy, .dx = dx, .dw = dw};
        if (dx)
            kt_parallel_for(c->pool, g.B * g.T, kt__rows_grain(g.Cin * g.K), dw_backward_x_rows, &J);
        if (dw)
            kt_parallel_for(c->pool, g.Cin, kt__rows_grain(g.B * g.Tout * g.K),
                            dw_backward_w_channels, &J);
    } else {
        KT__TRY(full_backward(c->pool, &g, x, w, gy, dx, dw));
    }
    if (dxt && dxt->dtype != KT_F32)
        kt__unstage_f32(c->pool, dxt, dx);
    if (dwt && dwt->dtype != KT_F32)
        kt__unstage_f32(c->pool, dwt, dw);
    return KT_OK;
}

static const char *const conv_modes[] = {"causal", "same", "valid"}; /* kt_conv_mode order */
_Static_assert(sizeof(kt_conv_mode) == sizeof(int), "an enum attribute is stored as an int");
static const kt__attr_desc conv1d_attrs[] = {
    KT__A_ENUM("mode", conv_mode, KT_CONV_CAUSAL, conv_modes, "padding (kt_conv_mode)"),
    KT__A_BOOL("depthwise", depthwise, 0, "w is [C,K], one filter per channel"),
};

const kt__op_desc kt__op_conv1d = {
    .name = "conv1d", .min_in = 2, .max_in = 2, .n_out = 1, .bwd_reads_in = 3u,
    .infer = infer_conv1d, .scratch_fwd = scratch_fwd_conv1d,
    .scratch_bwd = scratch_bwd_conv1d, .flops = flops_conv1d, .forward = fwd_conv1d,
    .backward = bwd_conv1d,
    KT__ATTR_LIST(conv1d_attrs)};
