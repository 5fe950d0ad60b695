/* topk_router: per token, the k experts with the largest softmax probabilities and their
 * weights (renormalised over the chosen k when attrs.norm_topk).
 *
 * softmax is monotonic, so the chosen experts are the k largest logits; comparing logits
 * rather than f32 probabilities keeps two close logits from tying after exp rounds them.
 * Ties between equal logits go to the lower expert index. The ids row of the output doubles
 * as the insertion-sorted candidate list, so no buffer depends on E or k.
 *
 * Backward, with the selection fixed, p = softmax(x), D = sum_i g_i w_i, and s_i the chosen
 * experts:
 *   plain:      w_i = p_{s_i}, so dx_j = p_j ([j = s_i] g_i - D) for every expert j;
 *   norm_topk:  w_i = exp(x_{s_i}) / sum_l exp(x_{s_l}), a softmax over the chosen logits
 *               alone, so dx_{s_i} = w_i (g_i - D) and dx_j = 0 for the others. */
#include <math.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static kt_status infer_router(const kt_op_attrs *at, const kt_tensor *in, int n,
                              kt_tensor *out)
{
    (void)n;
    const kt_tensor *logits = &in[0];
    KT__TRY(kt__check_f32("topk_router", "logits", logits));
    KT__TRY(kt__check_rank("topk_router", "logits", logits, 2, 2));
    const int64_t e = logits->shape[1];
    if (e > INT32_MAX)
        return kt__error(KT_EINVAL, "topk_router: logits has %lld experts; ids are i32",
                         (long long)e);
    if (at->k < 1 || at->k > e)
        return kt__error(KT_EINVAL, "topk_router: k must be in 1..%lld (the expert count), got %d",
                         (long long)e, at->k);
    const int64_t shape[2] = {logits->shape[0], at->k};
    kt__shape_out(&out[0], KT_I32, 2, shape);
    kt__shape_out(&out[1], KT_F32, 2, shape);
    return KT_OK;
}

/* the softmax (about 4 an element) and the selection's comparisons */
static double flops_router(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)n;
    return (4.0 + (double)at->k) * (double)kt_tensor_numel(&in[0]);
}

/* A NaN would make the selection meaningless and an Inf the softmax; either is reported by
 * its token. */
static kt_status check_finite(const kt_tensor *logits)
{
    const float *x = logits->data;
    const int64_t n = logits->shape[0], e = logits->shape[1];
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < e; i++)
            if (!isfinite(x[r * e + i]))
                return kt__error(KT_EINVAL,
                                 "topk_router: logits of token %lld are not finite (%g at "
                                 "expert %lld)",
                                 (long long)r, (double)x[r * e + i], (long long)i);
    return KT_OK;
}

static void row_stats(const float *x, int64_t e, float *max, float *sum)
{
    float m = x[0], s = 0.0f;
    for (int64_t i = 1; i < e; i++)
        m = x[i] > m ? x[i] : m;
    for (int64_t i = 0; i < e; i++)
        s += expf(x[i] - m);
    *max = m;
    *sum = s;
}

/* The denominator of a row's weights: the full softmax sum, or the chosen experts' share of
 * it when renormalising. */
static float weight_denominator(const float *x, const int32_t *ids, int k, float m, float s,
                                int norm)
{
    if (!norm)
        return s;
    float chosen = 0.0f;
    for (int i = 0; i < k; i++)
        chosen += expf(x[ids[i]] - m);
    return chosen;
}

typedef struct router_job {
    const float *x, *gw;
    int32_t *ids_w;
    const int32_t *ids;
    float *w, *dx;
    int64_t e;
    int k, norm;
} router_job;

static void fwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const router_job *j = ctx;
    const int k = j->k;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * j->e;
        int32_t *ids = j->ids_w + r * k;
        /* strictly greater moves an expert up, so equal logits keep index order */
        int have = 0;
        for (int64_t i = 0; i < j->e; i++) {
            if (have == k && !(x[i] > x[ids[k - 1]]))
                continue;
            int pos = have < k ? have++ : k - 1;
            while (pos > 0 && x[i] > x[ids[pos - 1]]) {
                ids[pos] = ids[pos - 1];
                pos--;
            }
            ids[pos] = (int32_t)i;
        }
        float m, s;
        row_stats(x, j->e, &m, &s);
        const float inv = 1.0f / weight_denominator(x, ids, k, m, s, j->norm);
        float *w = j->w + r * k;
        for (int i = 0; i < k; i++)
            w[i] = expf(x[ids[i]] - m) * inv;
    }
}

static kt_status fwd_router(const kt__op_call *c)
{
    const kt_tensor *logits = &c->in[0];
    KT__TRY(check_finite(logits));
    router_job j = {.x = logits->data, .ids_w = c->out_w[0].data, .w = c->out_w[1].data,
                    .e = logits->shape[1], .k = c->attrs->k, .norm = c->attrs->norm_topk != 0};
    kt_parallel_for(c->pool, logits->shape[0], kt__rows_grain(j.e), fwd_rows, &j);
    return KT_OK;
}

static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const router_job *j = ctx;
    const int k = j->k;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * j->e, *g = j->gw + r * k;
        const int32_t *ids = j->ids + r * k;
        float *dx = j->dx + r * j->e;
        float m, s;
        row_stats(x, j->e, &m, &s);
        const float inv = 1.0f / weight_denominator(x, ids, k, m, s, j->norm);
        float d = 0.0f;
        for (int i = 0; i < k; i++)
            d += g[i] * expf(x[ids[i]] - m) * inv;
        /* q: p for plain weights (every expert), w for renormalised ones (chosen only) */
        for (int64_t i = 0; i < j->e; i++)
            dx[i] = j->norm ? 0.0f : -expf(x[i] - m) * inv * d;
        for (int i = 0; i < k; i++)
            dx[ids[i]] = expf(x[ids[i]] - m) * inv * (g[i] - d);
    }
}

static kt_status bwd_router(const kt__op_call *c)
{
    if (c->gin[0].data == NULL)
        return KT_OK;
    const kt_tensor *logits = &c->in[0], *ids = &c->out[0];
    const int64_t e = logits->shape[1];
    /* the ids index the logits below, so ones that did not come from the forward must not
     * reach memory */
    const int64_t n_ids = kt_tensor_numel(ids);
    for (int64_t i = 0; i < n_ids; i++) {
        int32_t id = ((const int32_t *)ids->data)[i];
        if (id < 0 || id >= e)
            return kt__error(KT_ERANGE,
                             "topk_router backward: ids[%lld] = %d is outside [0, %lld)",
                             (long long)i, (int)id, (long long)e);
    }
    router_job j = {.x = logits->data, .gw = c->gout[1].data, .ids = ids->data,
                    .dx = c->gin[0].data, .e = e, .k = c->attrs->k,
                    .norm = c->attrs->norm_topk != 0};
    kt_parallel_for(c->pool, logits->shape[0], kt__rows_grain(e), bwd_rows, &j);
    return KT_OK;
}

static const kt__attr_desc router_attrs[] = {
    KT__A_INT_REQ("k", k, 1, 1 << 30, "experts per token (at most the expert count)"),
    KT__A_BOOL("norm_topk", norm_topk, 0, "renormalise the chosen weights to sum 1"),
};

const kt__op_desc kt__op_topk_router = {
    .name = "topk_router", .min_in = 1, .max_in = 1, .n_out = 2, .bwd_reads_in = 1u,
    .bwd_reads_out = 1u, .must_save = 1, .infer = infer_router, .flops = flops_router,
    .forward = fwd_router, .backward = bwd_router,
    KT__ATTR_LIST(router_attrs)};
