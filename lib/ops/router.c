/* topk_router: per token, the k experts with the largest scores and their weights, in the
 * forms the MoE families use (include/kt/ops.h has the contract):
 *   Mixtral, Qwen-MoE, OLMoE: softmax scores, top-k, renormalised or not (norm_topk);
 *   DeepSeek-V2: softmax, group-limited (groups scored by their max), routed scaling;
 *   DeepSeek-V3: sigmoid, a selection-only bias, groups scored by their top-2 sum,
 *                renormalised (w / (sum + 1e-20)), routed scaling.
 * One op with attributes rather than one op per family: the families share the selection,
 * the weights and the backward, and differ only in the score function, the group limit and
 * two constants; today's calls (softmax, no groups, scaling 1) are the defaults.
 *
 * Selection compares keys: without a bias the logits themselves (softmax and sigmoid are
 * monotonic, and two close logits must not tie because exp or a saturated sigmoid rounds
 * them to one f32), with a bias the biased f32 scores. Ties go to the lower expert index, and
 * between groups to the lower group index. The ids and weights rows of the output double as
 * the insertion-sorted candidate list and its keys, so no buffer depends on E or k.
 *
 * Backward, with the selection fixed (the choice is piecewise constant: no gradient flows
 * through it, nor into the bias), g_i the weights' gradient, a = routed_scaling_factor and
 * s_i the chosen experts:
 *   softmax, plain: w_i = a p_{s_i}: dx_j = p_j ([j = s_i] a g_i - D), D = sum_i a g_i p_{s_i};
 *   softmax, norm:  w_i = a exp(x_{s_i}) / sum_l exp(x_{s_l}), a softmax over the chosen
 *                   logits alone: dx_{s_i} = u_i (a g_i - D), u_i = w_i / a, D = sum a g_i u_i,
 *                   dx_j = 0 for the others;
 *   sigmoid, plain: w_i = a σ(x_{s_i}): dx_{s_i} = a g_i σ'(x_{s_i});
 *   sigmoid, norm:  w_i = a σ_i / (S + 1e-20), S = sum_l σ_l:
 *                   dx_{s_i} = a (g_i - D) / (S + 1e-20) σ'(x_{s_i}), D = sum_l g_l σ_l / (S + 1e-20);
 * σ' = σ(x) σ(-x), which keeps its precision where σ(x) rounds to 1. */
#include <float.h>
#include <math.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

/* The group scores of a row live on the stack. */
#define ROUTER_MAX_GROUPS 1024

/* Groups the choice is made from (topk_group 0: all). */
static int kept_groups(const kt_op_attrs *at)
{
    return at->router_topk_group == 0 ? at->router_n_group : at->router_topk_group;
}

static kt_status infer_router(const kt_op_attrs *at, const kt_tensor *in, int n,
                              kt_tensor *out)
{
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
    if (n == 2) {
        KT__TRY(kt__check_f32("topk_router", "bias", &in[1]));
        KT__TRY(kt__check_rank("topk_router", "bias", &in[1], 1, 1));
        KT__TRY(kt__check_dim("topk_router", "bias", &in[1], 0, e));
    }
    const int groups = at->router_n_group;
    /* before the range checks, which follow the op's own: groups divides below */
    if (groups < 1 || groups > ROUTER_MAX_GROUPS)
        return kt__error(KT_EINVAL, "topk_router: n_group must be in 1..%d, got %d",
                         ROUTER_MAX_GROUPS, groups);
    if (at->router_topk_group < 0)
        return kt__error(KT_EINVAL, "topk_router: topk_group must be >= 0, got %d",
                         at->router_topk_group);
    if (e % groups != 0)
        return kt__error(KT_EINVAL,
                         "topk_router: n_group = %d does not divide the %lld experts into equal "
                         "groups",
                         groups, (long long)e);
    if (at->router_topk_group > groups)
        return kt__error(KT_EINVAL, "topk_router: topk_group = %d is more than n_group = %d",
                         at->router_topk_group, groups);
    const int64_t per_group = e / groups;
    if (at->router_group_score == KT_ROUTER_GROUP_TOP2_SUM && groups > 1 && per_group < 2)
        return kt__error(KT_EINVAL,
                         "topk_router: group_score = top2_sum needs groups of at least 2 "
                         "experts; n_group = %d makes groups of %lld",
                         groups, (long long)per_group);
    const int64_t reachable = per_group * kept_groups(at);
    if (at->k > reachable)
        return kt__error(KT_EINVAL,
                         "topk_router: k = %d is more than the %lld experts of the topk_group = "
                         "%d groups kept (n_group = %d)",
                         at->k, (long long)reachable, kept_groups(at), groups);
    const int64_t shape[2] = {logits->shape[0], at->k};
    kt__shape_out(&out[0], KT_I32, 2, shape);
    kt__shape_out(&out[1], KT_F32, 2, shape);
    return KT_OK;
}

/* the scores (about 4 an element) and the selection's comparisons */
static double flops_router(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)n;
    return (4.0 + (double)at->k) * (double)kt_tensor_numel(&in[0]);
}

/* A NaN would make the selection meaningless and an Inf the softmax; either is reported by
 * its token (a bias by its expert). */
static kt_status check_finite(const kt_tensor *logits, const kt_tensor *bias)
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
    for (int64_t i = 0; bias != NULL && i < e; i++)
        if (!isfinite(((const float *)bias->data)[i]))
            return kt__error(KT_EINVAL, "topk_router: bias is not finite (%g at expert %lld)",
                             (double)((const float *)bias->data)[i], (long long)i);
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

static float sigmoid(float x)
{
    if (x >= 0.0f)
        return 1.0f / (1.0f + expf(-x));
    const float z = expf(x);
    return z / (1.0f + z);
}

typedef struct router_job {
    const float *x, *bias, *gw;
    int32_t *ids_w;
    const int32_t *ids;
    float *w, *dx;
    int64_t e, per_group;
    int k, norm, sigmoid, groups, keep_groups, top2;
    float scaling;
} router_job;

/* One row's scores: softmax needs the row's max and the reciprocal of its sum. */
typedef struct row_scores {
    const float *x, *bias;
    float m, inv;
    int sigmoid;
} row_scores;

static float score_of(const row_scores *rs, int64_t i)
{
    return rs->sigmoid ? sigmoid(rs->x[i]) : expf(rs->x[i] - rs->m) * rs->inv;
}

/* What the selection compares (see the top of the file). */
static float key_of(const row_scores *rs, int64_t i)
{
    return rs->bias != NULL ? score_of(rs, i) + rs->bias[i] : rs->x[i];
}

/* keep[g] = 1 for the keep_groups groups of the highest score (ties: lower group first). */
static void choose_groups(const router_job *j, const row_scores *rs, unsigned char *keep)
{
    float gscore[ROUTER_MAX_GROUPS];
    int order[ROUTER_MAX_GROUPS];
    for (int g = 0; g < j->groups; g++) {
        const int64_t first = (int64_t)g * j->per_group;
        if (j->top2) {
            /* the two largest biased scores (the scores themselves without a bias) */
            float best = -INFINITY, second = -INFINITY;
            for (int64_t i = first; i < first + j->per_group; i++) {
                const float v = rs->bias != NULL ? key_of(rs, i) : score_of(rs, i);
                if (v > best)
                    second = best, best = v;
                else if (v > second)
                    second = v;
            }
            gscore[g] = best + second;
        } else {
            float best = key_of(rs, first);
            for (int64_t i = first + 1; i < first + j->per_group; i++) {
                const float v = key_of(rs, i);
                best = v > best ? v : best;
            }
            gscore[g] = best;
        }
    }
    int have = 0;
    for (int g = 0; g < j->groups; g++) {
        keep[g] = 0;
        if (have == j->keep_groups && !(gscore[g] > gscore[order[have - 1]]))
            continue;
        int pos = have < j->keep_groups ? have++ : j->keep_groups - 1;
        while (pos > 0 && gscore[g] > gscore[order[pos - 1]]) {
            order[pos] = order[pos - 1];
            pos--;
        }
        order[pos] = g;
    }
    for (int i = 0; i < have; i++)
        keep[order[i]] = 1;
}

static void fwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const router_job *j = ctx;
    const int k = j->k;
    unsigned char keep[ROUTER_MAX_GROUPS];
    const int limited = j->keep_groups < j->groups;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * j->e;
        row_scores rs = {.x = x, .bias = j->bias, .sigmoid = j->sigmoid};
        float s = 1.0f;
        if (!j->sigmoid) {
            row_stats(x, j->e, &rs.m, &s);
            rs.inv = 1.0f / s;
        }
        if (limited)
            choose_groups(j, &rs, keep);
        int32_t *ids = j->ids_w + r * k;
        float *w = j->w + r * k, *keys = w; /* the weights row holds the list's keys first */
        /* strictly greater moves an expert up, so equal keys keep index order */
        int have = 0;
        for (int64_t i = 0; i < j->e; i++) {
            if (limited && !keep[i / j->per_group])
                continue;
            const float key = key_of(&rs, i);
            if (have == k && !(key > keys[k - 1]))
                continue;
            int pos = have < k ? have++ : k - 1;
            while (pos > 0 && key > keys[pos - 1]) {
                ids[pos] = ids[pos - 1];
                keys[pos] = keys[pos - 1];
                pos--;
            }
            ids[pos] = (int32_t)i;
            keys[pos] = key;
        }
        if (!j->sigmoid) {
            /* the denominator: the softmax sum, or the chosen experts' share of it */
            float den = s;
            if (j->norm) {
                den = 0.0f;
                for (int i = 0; i < k; i++)
                    den += expf(x[ids[i]] - rs.m);
            }
            const float inv = 1.0f / den;
            for (int i = 0; i < k; i++)
                w[i] = expf(x[ids[i]] - rs.m) * inv;
        } else {
            float sum = 0.0f;
            for (int i = 0; i < k; i++)
                sum += w[i] = sigmoid(x[ids[i]]);
            if (j->norm)
                for (int i = 0; i < k; i++)
                    w[i] /= sum + 1e-20f;
        }
        if (j->scaling != 1.0f)
            for (int i = 0; i < k; i++)
                w[i] *= j->scaling;
    }
}

static router_job job_for(const kt__op_call *c)
{
    const kt_op_attrs *at = c->attrs;
    const int64_t e = c->in[0].shape[1];
    return (router_job){.x = c->in[0].data, .e = e, .k = at->k, .norm = at->norm_topk != 0,
                        .sigmoid = at->router_scoring == KT_ROUTER_SIGMOID,
                        .groups = at->router_n_group, .keep_groups = kept_groups(at),
                        .per_group = e / at->router_n_group,
                        .top2 = at->router_group_score == KT_ROUTER_GROUP_TOP2_SUM,
                        .scaling = at->router_scaling};
}

static kt_status fwd_router(const kt__op_call *c)
{
    const kt_tensor *logits = &c->in[0], *bias = c->n_in == 2 ? &c->in[1] : NULL;
    KT__TRY(check_finite(logits, bias));
    router_job j = job_for(c);
    j.bias = bias != NULL ? bias->data : NULL;
    j.ids_w = c->out_w[0].data;
    j.w = c->out_w[1].data;
    kt_parallel_for(c->pool, logits->shape[0], kt__rows_grain(j.e), fwd_rows, &j);
    return KT_OK;
}

static void bwd_softmax_row(const router_job *j, const float *x, const float *g,
                            const int32_t *ids, float *dx)
{
    const int k = j->k;
    float m, s;
    row_stats(x, j->e, &m, &s);
    float den = s;
    if (j->norm) {
        den = 0.0f;
        for (int i = 0; i < k; i++)
            den += expf(x[ids[i]] - m);
    }
    const float inv = 1.0f / den;
    float d = 0.0f;
    for (int i = 0; i < k; i++)
        d += j->scaling * g[i] * expf(x[ids[i]] - m) * inv;
    /* q: p for plain weights (every expert), u for renormalised ones (chosen only) */
    for (int64_t i = 0; i < j->e; i++)
        dx[i] = j->norm ? 0.0f : -expf(x[i] - m) * inv * d;
    for (int i = 0; i < k; i++)
        dx[ids[i]] = expf(x[ids[i]] - m) * inv * (j->scaling * g[i] - d);
}

static void bwd_sigmoid_row(const router_job *j, const float *x, const float *g,
                            const int32_t *ids, float *dx)
{
    const int k = j->k;
    for (int64_t i = 0; i < j->e; i++)
        dx[i] = 0.0f;
    float inv = 1.0f, d = 0.0f;
    if (j->norm) {
        float sum = 0.0f;
        for (int i = 0; i < k; i++)
            sum += sigmoid(x[ids[i]]);
        inv = 1.0f / (sum + 1e-20f);
        for (int i = 0; i < k; i++)
            d += g[i] * sigmoid(x[ids[i]]) * inv;
    }
    for (int i = 0; i < k; i++) {
        const float xi = x[ids[i]];
        dx[ids[i]] = j->scaling * (g[i] - d) * inv * (sigmoid(xi) * sigmoid(-xi));
    }
}

static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const router_job *j = ctx;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * j->e, *g = j->gw + r * j->k;
        const int32_t *ids = j->ids + r * j->k;
        float *dx = j->dx + r * j->e;
        if (j->sigmoid)
            bwd_sigmoid_row(j, x, g, ids, dx);
        else
            bwd_softmax_row(j, x, g, ids, dx);
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
    router_job j = job_for(c);
    j.gw = c->gout[1].data;
    j.ids = ids->data;
    j.dx = c->gin[0].data;
    kt_parallel_for(c->pool, logits->shape[0], kt__rows_grain(e), bwd_rows, &j);
    return KT_OK;
}

static const char *const router_scorings[] = {"softmax", "sigmoid"};
static const char *const router_group_scores[] = {"max", "top2_sum"};

static const kt__attr_desc router_attrs[] = {
    KT__A_INT_REQ("k", k, 1, 1 << 30, "experts per token (at most the expert count)"),
    KT__A_BOOL("norm_topk", norm_topk, 0, "renormalise the chosen weights to sum 1"),
    KT__A_ENUM("scoring", router_scoring, KT_ROUTER_SOFTMAX, router_scorings,
               "expert scores: softmax over the experts, or sigmoid each (kt_router_scoring)"),
    KT__A_INT("n_group", router_n_group, 1, 1, ROUTER_MAX_GROUPS,
              "equal groups of experts for group-limited selection (1: none)"),
    KT__A_INT("topk_group", router_topk_group, 0, 0, ROUTER_MAX_GROUPS,
              "groups the k experts are chosen from (0: all n_group)"),
    KT__A_ENUM("group_score", router_group_score, KT_ROUTER_GROUP_MAX, router_group_scores,
               "a group's score: its best (biased) score, or the sum of its best two"),
    KT__A_FLOAT("routed_scaling_factor", router_scaling, 1.0, 1e-6, FLT_MAX,
                "the weights' factor, after any renormalisation"),
};

/* The bias (input 1) only moves the choice, which is piecewise constant in it: no gradient. */
const kt__op_desc kt__op_topk_router = {
    .name = "topk_router", .min_in = 1, .max_in = 2, .n_out = 2, .bwd_reads_in = 1u,
    .bwd_reads_out = 1u, .no_grad_in = 2u, .must_save = 1, .infer = infer_router,
    .flops = flops_router, .forward = fwd_router, .backward = bwd_router,
    KT__ATTR_LIST(router_attrs)};
