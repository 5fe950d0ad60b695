/* topk_router (every variant: softmax / sigmoid scores, norm_topk, routed scaling, a
 * selection-only bias, group-limited choice by group max or top-2 sum) and load_balance_loss:
 * forward against float64 references written here (router ids exactly), backward against
 * float64 finite differences, hand-worked cases where the group limit or the bias changes the
 * choice, tie-breaking, determinism across runs and thread counts, bad input with its
 * message, and the auxiliary loss over the concatenated rows of two layers through .ktg, the
 * graph's loss statement and a session. The router is f32-only (its logits come from a small
 * f32 gate, and the choice should not depend on bf16 rounding), so there is no bf16/f16
 * comparison; those dtypes are refused by name instead. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/support/gradcheck.h"

#define MAX_E 1024

/* ---- float64 references ----------------------------------------------------------------- */

/* The index of the largest v[i] among the allowed ones (lowest index on ties), or -1. */
static int64_t argmax_allowed(const double *v, const char *allowed, int64_t n)
{
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (allowed[i] && (best < 0 || v[i] > v[best]))
            best = i;
    return best;
}

/* One row of the router, as transformers describes it: scores (softmax or sigmoid), biased
 * choice scores c, the group limit (groups scored by max c or the sum of their top-2 c, the
 * best topk_group kept), k picks of the largest remaining c, weights = the unbiased scores,
 * renormalised (sigmoid: / (sum + 1e-20)) and scaled. */
static void ref_router_row(const kt_op_attrs *at, const double *x, const double *bias,
                           int64_t e, double *ids, double *w)
{
    double score[MAX_E], c[MAX_E], gs[MAX_E];
    char allowed[MAX_E], gallowed[MAX_E];
    assert_true(e <= MAX_E);
    const int k = at->k, sigmoid = at->router_scoring == KT_ROUTER_SIGMOID;
    double m = -INFINITY, s = 0.0;
    for (int64_t i = 0; i < e; i++)
        m = fmax(m, x[i]);
    for (int64_t i = 0; i < e; i++)
        s += exp(x[i] - m);
    for (int64_t i = 0; i < e; i++) {
        score[i] = sigmoid ? 1.0 / (1.0 + exp(-x[i])) : exp(x[i] - m) / s;
        c[i] = score[i] + (bias != NULL ? bias[i] : 0.0);
        allowed[i] = 1;
    }
    const int64_t groups = at->router_n_group, per = e / groups;
    const int64_t keep = at->router_topk_group == 0 ? groups : at->router_topk_group;
    if (keep < groups) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t a = argmax_allowed(c + g * per, allowed + g * per, per);
            gs[g] = c[g * per + a];
            if (at->router_group_score == KT_ROUTER_GROUP_TOP2_SUM) {
                char rest[MAX_E];
                for (int64_t i = 0; i < per; i++)
                    rest[i] = i != a;
                gs[g] += c[g * per + argmax_allowed(c + g * per, rest, per)];
            }
            gallowed[g] = 1;
        }
        char kept[MAX_E] = {0};
        for (int64_t t = 0; t < keep; t++) {
            const int64_t g = argmax_allowed(gs, gallowed, groups);
            kept[g] = 1;
            gallowed[g] = 0;
        }
        for (int64_t i = 0; i < e; i++)
            allowed[i] = kept[i / per];
    }
    double sum = 0.0;
    for (int j = 0; j < k; j++) {
        const int64_t best = argmax_allowed(c, allowed, e);
        allowed[best] = 0;
        ids[j] = (double)best;
        w[j] = score[best];
        sum += score[best];
    }
    for (int j = 0; j < k; j++) {
        if (at->norm_topk)
            w[j] /= sigmoid ? sum + 1e-20 : sum;
        w[j] *= at->router_scaling;
    }
}

static void ref_router(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                       int n_out)
{
    (void)n_out;
    const int64_t n = in[0].shape[0], e = in[0].shape[1];
    for (int64_t r = 0; r < n; r++)
        ref_router_row(at, in[0].d + r * e, n_in == 2 ? in[1].d : NULL, e,
                       out[0].d + r * at->k, out[1].d + r * at->k);
}

/* E * sum_e f_e P_e: f_e = choices of e / R, P_e = mean over rows of softmax(logits)_e */
static double ref_aux(const double *x, const double *ids, int64_t r, int64_t e, int64_t k)
{
    double f[MAX_E] = {0}, p[MAX_E] = {0};
    assert_true(e <= MAX_E);
    for (int64_t i = 0; i < r * k; i++)
        f[(int64_t)ids[i]] += 1.0 / (double)r;
    for (int64_t row = 0; row < r; row++) {
        double m = -INFINITY, s = 0.0;
        for (int64_t i = 0; i < e; i++)
            m = fmax(m, x[row * e + i]);
        for (int64_t i = 0; i < e; i++)
            s += exp(x[row * e + i] - m);
        for (int64_t i = 0; i < e; i++)
            p[i] += exp(x[row * e + i] - m) / s / (double)r;
    }
    double aux = 0.0;
    for (int64_t i = 0; i < e; i++)
        aux += f[i] * p[i];
    return (double)e * aux;
}

static void ref_load_balance(const kt_op_attrs *at, const gc_dt *in, int n_in, gc_dt *out,
                             int n_out)
{
    (void)at, (void)n_in, (void)n_out;
    out[0].d[0] = ref_aux(in[0].d, in[1].d, in[0].shape[0], in[0].shape[1], in[1].shape[1]);
}

/* ---- inputs --------------------------------------------------------------------------------- */

/* Each row a shuffled ladder of logits `step` apart: no ties and no near-ties. */
static kt_tensor router_logits(tu_rng *rng, int64_t n, int64_t e, double step)
{
    kt_tensor x = tu_new(KT_F32, n, e);
    int64_t *perm = malloc((size_t)e * sizeof *perm);
    assert_non_null(perm);
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i = 0; i < e; i++)
            perm[i] = i;
        for (int64_t i = e - 1; i > 0; i--) {
            int64_t j = (int64_t)(tu_rng_next(rng) % (uint64_t)(i + 1));
            int64_t t = perm[i];
            perm[i] = perm[j], perm[j] = t;
        }
        for (int64_t i = 0; i < e; i++)
            tu_set(&x, r * e + i,
                   step * ((double)perm[i] - 0.5 * (double)e) + tu_rng_uniform(rng, 0, 0.2 * step));
    }
    free(perm);
    return x;
}

/* Sorts v[0..n) descending (insertion; n is small). */
static void sort_desc(double *v, int64_t n)
{
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = i; j > 0 && v[j] > v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1], v[j - 1] = t;
        }
}

/* The smallest margin the choice of a row has: between consecutive experts among the top
 * k + 1 allowed choice scores (an order that flips changes the weights' order), and between
 * the last kept group and the first dropped one. Finite differences move scores by ~1e-6,
 * f32 rounds them by ~1e-7; a margin far above both keeps kernel, reference and probes on one
 * side of every decision. */
static double choice_margin(const kt_op_attrs *at, const kt_tensor *x, const kt_tensor *bias)
{
    const int64_t n = x->shape[0], e = x->shape[1];
    double worst = INFINITY;
    for (int64_t r = 0; r < n; r++) {
        double xr[MAX_E], b[MAX_E], c[MAX_E], gs[MAX_E];
        for (int64_t i = 0; i < e; i++) {
            xr[i] = tu_get(x, r * e + i);
            b[i] = bias != NULL ? tu_get(bias, i) : 0.0;
        }
        const int sigmoid = at->router_scoring == KT_ROUTER_SIGMOID;
        double m = -INFINITY, s = 0.0;
        for (int64_t i = 0; i < e; i++)
            m = fmax(m, xr[i]);
        for (int64_t i = 0; i < e; i++)
            s += exp(xr[i] - m);
        for (int64_t i = 0; i < e; i++)
            c[i] = (sigmoid ? 1.0 / (1.0 + exp(-xr[i])) : exp(xr[i] - m) / s) + b[i];
        const int64_t groups = at->router_n_group, per = e / groups;
        const int64_t keep = at->router_topk_group == 0 ? groups : at->router_topk_group;
        char kept[MAX_E];
        memset(kept, 1, sizeof kept);
        if (keep < groups) {
            for (int64_t g = 0; g < groups; g++) {
                double v[MAX_E];
                memcpy(v, c + g * per, (size_t)per * sizeof *v);
                sort_desc(v, per);
                gs[g] = at->router_group_score == KT_ROUTER_GROUP_TOP2_SUM ? v[0] + v[1] : v[0];
            }
            /* a loop, not memcpy: gcc's bound check reads the int64 count as maybe negative */
            double sorted[MAX_E] = {0};
            for (int64_t g = 0; g < groups; g++)
                sorted[g] = gs[g];
            sort_desc(sorted, groups);
            worst = fmin(worst, sorted[keep - 1] - sorted[keep]);
            for (int64_t g = 0; g < groups; g++)
                kept[g] = gs[g] >= sorted[keep - 1];
        }
        double allowed[MAX_E];
        int64_t na = 0;
        for (int64_t i = 0; i < e; i++)
            if (kept[i / per])
                allowed[na++] = c[i];
        sort_desc(allowed, na);
        for (int64_t i = 0; i + 1 < na && i < at->k; i++)
            worst = fmin(worst, allowed[i] - allowed[i + 1]);
    }
    return worst;
}

/* ---- helpers ------------------------------------------------------------------------------- */

typedef struct variant {
    const char *name;
    int64_t n, e;
    int k, norm;
    kt_router_scoring scoring;
    int n_group, topk_group;
    kt_router_group_score group_score;
    float scaling;
    int bias;
} variant;

static kt_op_attrs variant_attrs(const variant *v)
{
    kt_op_attrs a = kt_op_defaults(KT_OP_TOPK_ROUTER);
    a.k = v->k;
    a.norm_topk = v->norm;
    a.router_scoring = v->scoring;
    a.router_n_group = v->n_group;
    a.router_topk_group = v->topk_group;
    a.router_group_score = v->group_score;
    a.router_scaling = v->scaling;
    return a;
}

/* Logits (and a bias) whose choice has a margin of at least 1e-4 everywhere. */
static void variant_inputs(const variant *v, tu_rng *rng, kt_tensor *in)
{
    const kt_op_attrs at = variant_attrs(v);
    for (int attempt = 0; attempt < 200; attempt++) {
        in[0] = router_logits(rng, v->n, v->e, v->scoring == KT_ROUTER_SIGMOID ? 0.15 : 0.3);
        if (v->bias) {
            in[1] = tu_new(KT_F32, v->e);
            tu_fill_uniform(&in[1], rng, -0.3, 0.3);
        }
        if (choice_margin(&at, &in[0], v->bias ? &in[1] : NULL) > 1e-4)
            return;
        tu_free(&in[0]);
        if (v->bias)
            tu_free(&in[1]);
    }
    fail_msg("%s: no inputs with a clear choice in 200 tries", v->name);
}

/* Runs the forward; returns the ids and weights (caller frees). */
static void route(const kt_op_attrs *at, const kt_tensor *in, int n_in, kt_tensor *out)
{
    kt_tensor shapes[2];
    assert_int_equal(kt_op_infer(KT_OP_TOPK_ROUTER, at, in, n_in, shapes, 2), KT_OK);
    out[0] = tu_alloc(KT_I32, 2, shapes[0].shape);
    out[1] = tu_alloc(KT_F32, 2, shapes[1].shape);
    kt_status st = kt_op_forward(KT_OP_TOPK_ROUTER, at, in, n_in, out, 2, NULL);
    if (st != KT_OK)
        fail_msg("topk_router: %s", kt_last_error());
}

/* ---- topk_router: the original form --------------------------------------------------------- */

/* k = 1, k = E, a single expert, 1000 experts; with and without renormalisation. */
static void test_router(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 6);
    const struct {
        int64_t n, e;
        int k;
        double step;
    } cases[] = {{5, 8, 2, 0.3}, {7, 64, 6, 0.1}, {3, 1, 1, 0.3},
                 {4, 13, 13, 0.3}, {6, 5, 1, 0.5}, {3, 1000, 4, 0.01}};
    for (size_t s = 0; s < sizeof cases / sizeof cases[0]; s++) {
        kt_tensor x = router_logits(&rng, cases[s].n, cases[s].e, cases[s].step);
        for (int norm = 0; norm <= 1; norm++)
            for (int threads = 0; threads <= 2; threads += 2) {
                gc_case c = {.op = KT_OP_TOPK_ROUTER,
                             .attrs =
                                 TU_ATTRS(KT_OP_TOPK_ROUTER, .k = cases[s].k, .norm_topk = norm),
                             .in = &x,
                             .n_in = 1,
                             .ref = ref_router,
                             .threads = threads,
                             .probes = 500,
                             .seed = (uint64_t)(100 * s + 10 * (size_t)norm + (size_t)threads)};
                gc_check(&c);
            }
        tu_free(&x);
    }
}

/* Equal logits go to the lower expert index first, and get equal weights. */
static void test_router_ties(void **state)
{
    (void)state;
    const float logits[4][5] = {
        {1, 3, 3, 0, 3}, {0, 0, 0, 0, 0}, {5, -1, 5, 5, 7}, {-2, -2, 9, -2, -2}};
    const int32_t want[4][3] = {{1, 2, 4}, {0, 1, 2}, {4, 0, 2}, {2, 0, 1}};
    kt_tensor x = tu_new(KT_F32, 4, 5);
    memcpy(x.data, logits, sizeof logits);
    for (int norm = 0; norm <= 1; norm++) {
        const kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 3, .norm_topk = norm);
        kt_tensor out[2];
        route(&at, &x, 1, out);
        const int32_t *ids = out[0].data;
        const float *w = out[1].data;
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 3; c++)
                assert_int_equal(ids[r * 3 + c], want[r][c]);
        /* row 0's three equal logits, all of row 1 */
        assert_true(w[0] == w[1] && w[1] == w[2]);
        assert_true(w[3] == w[4] && w[4] == w[5]);
        assert_float_equal(w[3], norm ? 1.0 / 3.0 : 0.2, 1e-7);
        /* the float64 reference, which the other router tests trust, breaks ties alike */
        double xd[20], idd[12], wd[12];
        for (int i = 0; i < 20; i++)
            xd[i] = logits[i / 5][i % 5];
        gc_dt din = {.d = xd, .ndim = 2, .shape = {4, 5}, .n = 20};
        gc_dt dout[2] = {{.d = idd, .ndim = 2, .shape = {4, 3}, .n = 12},
                         {.d = wd, .ndim = 2, .shape = {4, 3}, .n = 12}};
        ref_router(&at, &din, 1, dout, 2);
        for (int i = 0; i < 12; i++) {
            assert_true(idd[i] == (double)want[i / 3][i % 3]);
            assert_float_equal(wd[i], w[i], 1e-6);
        }
        tu_free(&out[0]), tu_free(&out[1]);
    }
    tu_free(&x);
}

/* ---- topk_router: every variant against the reference and finite differences --------------- */

static const variant variants[] = {
    /* Mixtral: softmax, always renormalised */
    {"mixtral", 9, 8, 2, 1, KT_ROUTER_SOFTMAX, 1, 0, KT_ROUTER_GROUP_MAX, 1.0f, 0},
    /* Qwen / OLMoE: softmax, norm_topk_prob off */
    {"qwen", 7, 60, 4, 0, KT_ROUTER_SOFTMAX, 1, 0, KT_ROUTER_GROUP_MAX, 1.0f, 0},
    /* DeepSeek-V2 greedy and group-limited greedy: softmax, scaled, not renormalised */
    {"v2 greedy", 6, 16, 3, 0, KT_ROUTER_SOFTMAX, 1, 0, KT_ROUTER_GROUP_MAX, 16.0f, 0},
    {"v2 group-limited", 11, 32, 6, 0, KT_ROUTER_SOFTMAX, 8, 3, KT_ROUTER_GROUP_MAX, 16.0f, 0},
    {"v2 one group kept", 5, 12, 3, 0, KT_ROUTER_SOFTMAX, 4, 1, KT_ROUTER_GROUP_MAX, 1.0f, 0},
    /* DeepSeek-V3: sigmoid, bias, groups by top-2 sum, renormalised, scaled */
    {"v3", 10, 32, 8, 1, KT_ROUTER_SIGMOID, 8, 4, KT_ROUTER_GROUP_TOP2_SUM, 2.5f, 1},
    {"v3 plain", 6, 16, 4, 0, KT_ROUTER_SIGMOID, 4, 2, KT_ROUTER_GROUP_TOP2_SUM, 2.5f, 1},
    {"v3 no groups", 6, 16, 4, 1, KT_ROUTER_SIGMOID, 1, 0, KT_ROUTER_GROUP_MAX, 1.0f, 1},
    {"v3 groups of two", 5, 16, 3, 1, KT_ROUTER_SIGMOID, 8, 2, KT_ROUTER_GROUP_TOP2_SUM, 2.5f, 1},
    /* the mixed forms the attributes allow */
    {"sigmoid no bias", 6, 16, 4, 1, KT_ROUTER_SIGMOID, 4, 2, KT_ROUTER_GROUP_TOP2_SUM, 1.0f, 0},
    {"softmax bias", 6, 16, 4, 1, KT_ROUTER_SOFTMAX, 1, 0, KT_ROUTER_GROUP_MAX, 1.0f, 1},
    {"softmax top2 groups", 6, 24, 5, 0, KT_ROUTER_SOFTMAX, 6, 2, KT_ROUTER_GROUP_TOP2_SUM, 2.0f,
     0},
    {"sigmoid max groups bias", 6, 24, 5, 1, KT_ROUTER_SIGMOID, 6, 3, KT_ROUTER_GROUP_MAX, 1.0f,
     1},
    {"k = kept experts", 4, 12, 6, 1, KT_ROUTER_SIGMOID, 4, 2, KT_ROUTER_GROUP_TOP2_SUM, 1.0f, 1},
    {"all groups kept", 4, 12, 3, 1, KT_ROUTER_SOFTMAX, 4, 4, KT_ROUTER_GROUP_MAX, 1.0f, 0},
};
enum { N_VARIANTS = sizeof variants / sizeof variants[0] };

static void test_router_variants(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 20);
    for (int vi = 0; vi < N_VARIANTS; vi++) {
        const variant *v = &variants[vi];
        kt_tensor in[2];
        variant_inputs(v, &rng, in);
        for (int threads = 0; threads <= 2; threads += 2) {
            gc_case c = {.op = KT_OP_TOPK_ROUTER,
                         .attrs = variant_attrs(v),
                         .in = in,
                         .n_in = v->bias ? 2 : 1,
                         .ref = ref_router,
                         .threads = threads,
                         .probes = 400,
                         .seed = (uint64_t)(10 * vi + threads)};
            gc_check(&c);
        }
        tu_free(&in[0]);
        if (v->bias)
            tu_free(&in[1]);
    }
}

static void test_router_variants_deterministic(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 21);
    const variant big[] = {
        {"v2 many rows", 900, 64, 6, 0, KT_ROUTER_SOFTMAX, 8, 3, KT_ROUTER_GROUP_MAX, 16.0f, 0},
        {"v3 many rows", 900, 64, 8, 1, KT_ROUTER_SIGMOID, 8, 4, KT_ROUTER_GROUP_TOP2_SUM, 2.5f,
         1},
    };
    for (int vi = 0; vi < 2; vi++) {
        kt_tensor in[2] = {router_logits(&rng, big[vi].n, big[vi].e, 0.05),
                           tu_new(KT_F32, big[vi].e)};
        tu_fill_uniform(&in[1], &rng, -0.3, 0.3);
        gc_case c = {.op = KT_OP_TOPK_ROUTER,
                     .attrs = variant_attrs(&big[vi]),
                     .in = in,
                     .n_in = big[vi].bias ? 2 : 1,
                     .seed = 8};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        gc_check_thread_invariant(&c, 0, 3);
        tu_free(&in[0]), tu_free(&in[1]);
    }
    /* the original form too */
    kt_tensor x = router_logits(&rng, 600, 64, 0.05);
    for (int norm = 0; norm <= 1; norm++) {
        gc_case c = {.op = KT_OP_TOPK_ROUTER,
                     .attrs = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 4, .norm_topk = norm),
                     .in = &x,
                     .n_in = 1,
                     .seed = 8};
        gc_check_deterministic(&c, 2);
        gc_check_deterministic(&c, 3);
        gc_check_thread_invariant(&c, 0, 3);
    }
    tu_free(&x);
}

/* ---- topk_router: cases worked by hand -------------------------------------------------------- */

static void expect_ids(const kt_tensor *ids, const int32_t *want, int n, const char *what)
{
    for (int i = 0; i < n; i++)
        if (((const int32_t *)ids->data)[i] != want[i])
            fail_msg("%s: ids[%d] = %d, expected %d", what, i, ((const int32_t *)ids->data)[i],
                     want[i]);
}

/* Eight experts in four groups of two: {0,1} {2,3} {4,5} {6,7}. The plain top-3 is 0, 4, 2.
 * By group max (3, 2.5, 2.6, -1) the kept two are groups 0 and 2, so the choice is 0, 4, 1.
 * By sigmoid top-2 sum (1.2215, 1.8409, 1.1998, 0.5379) they are groups 1 and 0: 0, 2, 3. */
static void test_router_group_limited(void **state)
{
    (void)state;
    const float logits[8] = {3.0f, -1.0f, 2.5f, 2.4f, 2.6f, -1.0f, -1.0f, -1.0f};
    kt_tensor x = tu_new(KT_F32, 1, 8), out[2];
    memcpy(x.data, logits, sizeof logits);
    double xd[8];
    for (int i = 0; i < 8; i++)
        xd[i] = logits[i];
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 3);
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 4, 2}, 3, "plain softmax");
    tu_free(&out[0]), tu_free(&out[1]);

    at.router_n_group = 4, at.router_topk_group = 2;
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 4, 1}, 3, "softmax, groups by max");
    /* the weights are the plain softmax probabilities of the chosen experts */
    double m = 3.0, s = 0.0;
    for (int i = 0; i < 8; i++)
        s += exp(xd[i] - m);
    const int chosen[3] = {0, 4, 1};
    for (int i = 0; i < 3; i++)
        assert_float_equal(((float *)out[1].data)[i], exp(xd[chosen[i]] - m) / s, 1e-6);
    tu_free(&out[0]), tu_free(&out[1]);

    at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 3, .router_scoring = KT_ROUTER_SIGMOID);
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 4, 2}, 3, "plain sigmoid");
    tu_free(&out[0]), tu_free(&out[1]);
    at.router_n_group = 4, at.router_topk_group = 2;
    at.router_group_score = KT_ROUTER_GROUP_TOP2_SUM;
    at.norm_topk = 1, at.router_scaling = 2.5f;
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 2, 3}, 3, "sigmoid, groups by top-2 sum");
    const int v3[3] = {0, 2, 3};
    double sum = 0.0;
    for (int i = 0; i < 3; i++)
        sum += 1.0 / (1.0 + exp(-xd[v3[i]]));
    for (int i = 0; i < 3; i++)
        assert_float_equal(((float *)out[1].data)[i],
                           2.5 * (1.0 / (1.0 + exp(-xd[v3[i]]))) / sum, 1e-6);
    tu_free(&out[0]), tu_free(&out[1]);
    /* by group max instead, the same sigmoid scores keep groups 0 and 2, as softmax did */
    at.router_group_score = KT_ROUTER_GROUP_MAX;
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 4, 1}, 3, "sigmoid, groups by max");
    tu_free(&out[0]), tu_free(&out[1]);
    tu_free(&x);
}

/* The bias moves the choice and never the weights: expert 3's sigmoid (0.269) plus 1 beats
 * every unbiased score, so it is chosen first; expert 0 is chosen either way with the same
 * weight, bit for bit, and every weight is 2.5 sigmoid(logit) of its expert. */
static void test_router_bias_moves_choice_only(void **state)
{
    (void)state;
    const float logits[6] = {2.0f, 1.0f, 0.0f, -1.0f, 0.5f, 1.5f};
    kt_tensor in[2] = {tu_new(KT_F32, 1, 6), tu_new(KT_F32, 6)}, plain[2], biased[2];
    memcpy(in[0].data, logits, sizeof logits);
    tu_set(&in[1], 3, 1.0);
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 2, .router_scoring = KT_ROUTER_SIGMOID,
                              .router_scaling = 2.5f);
    route(&at, in, 1, plain);
    route(&at, in, 2, biased);
    expect_ids(&plain[0], (const int32_t[]){0, 5}, 2, "without the bias");
    expect_ids(&biased[0], (const int32_t[]){3, 0}, 2, "with the bias");
    const float *wp = plain[1].data, *wb = biased[1].data;
    assert_memory_equal(&wp[0], &wb[1], sizeof(float));
    assert_float_equal(wb[0], 2.5 / (1.0 + exp(1.0)), 1e-6);
    assert_float_equal(wb[1], 2.5 / (1.0 + exp(-2.0)), 1e-6);
    /* a uniform bias changes nothing at all */
    for (int i = 0; i < 6; i++)
        tu_set(&in[1], i, 0.25);
    kt_tensor shifted[2];
    route(&at, in, 2, shifted);
    assert_true(tu_bitwise_equal(&shifted[0], &plain[0]));
    assert_true(tu_bitwise_equal(&shifted[1], &plain[1]));
    /* and the backward reads no bias: with or without it, the same gradient for the same
     * choice (the weights' gradient only ever reaches the logits) */
    kt_tensor g = tu_new(KT_F32, 1, 2), gx1 = tu_new(KT_F32, 1, 6), gx2 = tu_new(KT_F32, 1, 6);
    tu_set(&g, 0, 0.7), tu_set(&g, 1, -1.3);
    kt_tensor gout[2] = {{.dtype = KT_I32, .ndim = 2, .shape = {1, 2}}, g};
    kt_tensor gin2[2] = {gx2, in[1]};
    gin2[1].data = NULL;
    assert_int_equal(kt_op_backward(KT_OP_TOPK_ROUTER, &at, in, 1, plain, 2, gout, &gx1, NULL),
                     KT_OK);
    assert_int_equal(kt_op_backward(KT_OP_TOPK_ROUTER, &at, in, 2, shifted, 2, gout, gin2, NULL),
                     KT_OK);
    assert_true(tu_bitwise_equal(&gx1, &gx2));
    /* dw_i/dx_{id_i} = 2.5 sigmoid'(x); nothing reaches the others */
    for (int i = 0; i < 6; i++) {
        const double sg = 1.0 / (1.0 + exp(-(double)logits[i]));
        const double want = i == 0 ? 0.7 * 2.5 * sg * (1 - sg) : i == 5 ? -1.3 * 2.5 * sg * (1 - sg) : 0;
        assert_float_equal(tu_get(&gx1, i), want, 1e-6);
    }
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&g), tu_free(&gx1), tu_free(&gx2);
    for (int i = 0; i < 2; i++)
        tu_free(&plain[i]), tu_free(&biased[i]), tu_free(&shifted[i]);
}

/* Ties between groups go to the lower group, ties between biased scores to the lower expert;
 * the reference agrees. */
static void test_router_group_ties(void **state)
{
    (void)state;
    /* group maxima 1, 1, 1, 0: groups 0 and 1 are kept; inside them 0 and 3 (both 1), then
     * 1 and 2 tie at 0 and the lower goes first. The plain choice takes 4 instead of 1. */
    const float logits[2][8] = {{1, 0, 0, 1, 1, 0.5f, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0}};
    kt_tensor x = tu_new(KT_F32, 2, 8), out[2];
    memcpy(x.data, logits, sizeof logits);
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 3, .router_n_group = 4,
                              .router_topk_group = 2);
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 3, 1, 0, 1, 2}, 6, "group max ties");
    double xd[16], idd[6], wd[6];
    for (int i = 0; i < 16; i++)
        xd[i] = logits[i / 8][i % 8];
    gc_dt din = {.d = xd, .ndim = 2, .shape = {2, 8}, .n = 16};
    gc_dt dout[2] = {{.d = idd, .ndim = 2, .shape = {2, 3}, .n = 6},
                     {.d = wd, .ndim = 2, .shape = {2, 3}, .n = 6}};
    ref_router(&at, &din, 1, dout, 2);
    for (int i = 0; i < 6; i++) {
        assert_true(idd[i] == (double)((int32_t *)out[0].data)[i]);
        assert_float_equal(wd[i], ((float *)out[1].data)[i], 1e-6);
    }
    tu_free(&out[0]), tu_free(&out[1]);
    at.router_topk_group = 0;
    route(&at, &x, 1, out);
    expect_ids(&out[0], (const int32_t[]){0, 3, 4, 0, 1, 2}, 6, "all groups");
    tu_free(&out[0]), tu_free(&out[1]);
    /* V3 with equal top-2 sums everywhere, a bias equal on experts 5 and 6 and higher than
     * the others: those two are chosen in index order, then the lowest unbiased expert */
    kt_tensor in[2] = {tu_new(KT_F32, 1, 8), tu_new(KT_F32, 8)};
    tu_set(&in[1], 5, 0.5), tu_set(&in[1], 6, 0.5);
    at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 3, .router_scoring = KT_ROUTER_SIGMOID,
                  .router_n_group = 4, .router_topk_group = 3,
                  .router_group_score = KT_ROUTER_GROUP_TOP2_SUM, .norm_topk = 1);
    route(&at, in, 2, out);
    /* group sums: g0 1.0, g1 1.0, g2 1.5, g3 1.5: keep 2, 3 and (tie) 0 */
    expect_ids(&out[0], (const int32_t[]){5, 6, 0}, 3, "biased ties");
    for (int i = 0; i < 3; i++)
        assert_float_equal(((float *)out[1].data)[i], 1.0 / 3.0, 1e-7);
    tu_free(&out[0]), tu_free(&out[1]);
    tu_free(&x), tu_free(&in[0]), tu_free(&in[1]);
}

static void test_router_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 4, 6), ids = tu_new(KT_I32, 4, 2), w = tu_new(KT_F32, 4, 2);
    kt_tensor xb = tu_new(KT_BF16, 4, 6), x3 = tu_new(KT_F32, 1, 4, 6);
    kt_tensor out[2] = {ids, w};
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = 2);
    /* k outside 1..E */
    at.k = 0;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "k must be in 1..6", "got 0");
    at.k = 7;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "k must be in 1..6", "got 7");
    at.k = 2;
    /* non-finite logits, named by token */
    tu_set(&x, 2 * 6 + 3, NAN);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 2", "expert 3");
    at.router_scoring = KT_ROUTER_SIGMOID; /* sigmoid would take a NaN quietly: refused too */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 2", "not finite");
    at.router_scoring = KT_ROUTER_SOFTMAX;
    tu_set(&x, 2 * 6 + 3, 0);
    tu_set(&x, 1 * 6 + 5, INFINITY);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 1", "not finite");
    tu_set(&x, 1 * 6 + 5, -INFINITY);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "token 1");
    tu_set(&x, 1 * 6 + 5, 0);
    /* dtypes and ranks */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &xb, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "logits", "must be f32", "bf16");
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x3, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "logits", "2 dimensions");
    /* the bias: f32 [E], finite */
    kt_tensor bias = tu_new(KT_F32, 6), b7 = tu_new(KT_F32, 7), b2 = tu_new(KT_F32, 1, 6);
    kt_tensor bb = tu_new(KT_BF16, 6);
    kt_tensor in[2] = {x, b7};
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, in, 2, out, 2, NULL), KT_EINVAL,
                    "topk_router", "bias");
    in[1] = b2;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, in, 2, out, 2, NULL), KT_EINVAL,
                    "topk_router", "bias", "1 dimension");
    in[1] = bb;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, in, 2, out, 2, NULL), KT_EINVAL,
                    "topk_router", "bias", "must be f32", "bf16");
    in[1] = bias;
    tu_set(&bias, 4, NAN);
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &at, in, 2, out, 2, NULL), KT_EINVAL,
                    "topk_router", "bias is not finite", "expert 4");
    tu_set(&bias, 4, 0);
    assert_int_equal(kt_op_forward(KT_OP_TOPK_ROUTER, &at, in, 2, out, 2, NULL), KT_OK);
    /* the group attributes */
    kt_op_attrs g = at;
    g.router_n_group = 4;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "n_group = 4", "6 experts");
    g.router_n_group = 3, g.router_topk_group = 4;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "topk_group = 4", "n_group = 3");
    g.router_topk_group = 1, g.k = 3; /* one group of two experts kept */
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "k = 3", "2 experts", "topk_group = 1");
    g = at;
    g.router_n_group = 6, g.router_topk_group = 3;
    g.router_group_score = KT_ROUTER_GROUP_TOP2_SUM;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "top2_sum", "groups of 1");
    /* ranges the attribute table checks */
    g = at;
    g.router_n_group = 0;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "n_group");
    g = at;
    g.router_scaling = -1.0f;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "routed_scaling_factor");
    g = at;
    g.router_scoring = (kt_router_scoring)2;
    TU_EXPECT_ERROR(kt_op_forward(KT_OP_TOPK_ROUTER, &g, &x, 1, out, 2, NULL), KT_EINVAL,
                    "topk_router", "scoring");
    /* backward: ids carry no gradient, nor does the bias, and ids that did not come from the
     * forward are refused before they index the logits */
    assert_int_equal(kt_op_forward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, NULL), KT_OK);
    kt_tensor gw = tu_new(KT_F32, 4, 2), gx = tu_new(KT_F32, 4, 6), gi = tu_new(KT_I32, 4, 2);
    kt_tensor gb = tu_new(KT_F32, 6);
    kt_tensor gout[2] = {gi, gw};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, gout, &gx, NULL),
                    KT_EINVAL, "topk_router", "output 0", "no gradient");
    gout[0] = (kt_tensor){0};
    gout[0].dtype = KT_I32, gout[0].ndim = 2, gout[0].shape[0] = 4, gout[0].shape[1] = 2;
    assert_int_equal(kt_op_backward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, gout, &gx, NULL),
                     KT_OK);
    kt_tensor gin[2] = {gx, gb};
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_TOPK_ROUTER, &at, in, 2, out, 2, gout, gin, NULL),
                    KT_EINVAL, "topk_router", "input 1", "no gradient");
    tu_set(&ids, 5, 6);
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_TOPK_ROUTER, &at, &x, 1, out, 2, gout, &gx, NULL),
                    KT_ERANGE, "topk_router", "ids[5] = 6");
    tu_free(&x), tu_free(&ids), tu_free(&w), tu_free(&xb), tu_free(&x3);
    tu_free(&bias), tu_free(&b7), tu_free(&b2), tu_free(&bb);
    tu_free(&gw), tu_free(&gx), tu_free(&gi), tu_free(&gb);
}

/* ---- load_balance_loss ----------------------------------------------------------------------- */

/* ids: a router's choice (distinct per row) or uniform random ones (repeats allowed). */
static kt_tensor lb_ids(tu_rng *rng, const kt_tensor *logits, int k, kt_dtype dtype, int routed)
{
    const int64_t r = logits->shape[0], e = logits->shape[1];
    kt_tensor ids = tu_alloc(dtype, 2, TU_SHAPE(r, k));
    if (!routed) {
        tu_fill_uniform(&ids, rng, 0, (double)e);
        return ids;
    }
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = k);
    kt_tensor out[2];
    route(&at, logits, 1, out);
    for (int64_t i = 0; i < r * k; i++)
        tu_set(&ids, i, tu_get(&out[0], i));
    tu_free(&out[0]), tu_free(&out[1]);
    return ids;
}

static void test_load_balance(void **state)
{
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, 30);
    const struct {
        int64_t r, e;
        int k;
        kt_dtype dtype;
        int routed;
    } cases[] = {{1, 1, 1, KT_I32, 1},    {12, 8, 2, KT_I32, 1},   {40, 60, 4, KT_I64, 1},
                 {9, 16, 3, KT_I32, 0},   {1300, 8, 2, KT_I32, 1}, {5, 300, 6, KT_I64, 0}};
    for (size_t s = 0; s < sizeof cases / sizeof cases[0]; s++) {
        kt_tensor in[2];
        in[0] = tu_new(KT_F32, cases[s].r, cases[s].e);
        tu_fill_uniform(&in[0], &rng, -3, 3);
        in[1] = lb_ids(&rng, &in[0], cases[s].k, cases[s].dtype, cases[s].routed);
        for (int threads = 0; threads <= 2; threads += 2) {
            gc_case c = {.op = KT_OP_LOAD_BALANCE_LOSS, .in = in, .n_in = 2,
                         .ref = ref_load_balance, .threads = threads, .probes = 300,
                         .seed = (uint64_t)(10 * s + (size_t)threads)};
            gc_check(&c);
        }
        gc_case c = {.op = KT_OP_LOAD_BALANCE_LOSS, .in = in, .n_in = 2, .seed = 3};
        gc_check_deterministic(&c, 3);
        gc_check_thread_invariant(&c, 0, 3);
        tu_free(&in[0]), tu_free(&in[1]);
    }
}

/* Direct calls with the scratch the op asks for (the counts f live there). */
static kt_status lb_forward(const kt_tensor *in, kt_tensor *loss)
{
    size_t bytes = kt_op_scratch_bytes(KT_OP_LOAD_BALANCE_LOSS, NULL, in, 2, 0);
    kt_exec ex = {.scratch_bytes = bytes};
    assert_int_equal(posix_memalign(&ex.scratch, 64, bytes ? bytes : 64), 0);
    kt_status st = kt_op_forward(KT_OP_LOAD_BALANCE_LOSS, NULL, in, 2, loss, 1, &ex);
    free(ex.scratch);
    return st;
}

static kt_status lb_backward(const kt_tensor *in, const kt_tensor *loss, const kt_tensor *g,
                             kt_tensor *gin)
{
    size_t bytes = kt_op_scratch_bytes(KT_OP_LOAD_BALANCE_LOSS, NULL, in, 2, 1);
    kt_exec ex = {.scratch_bytes = bytes};
    assert_int_equal(posix_memalign(&ex.scratch, 64, bytes ? bytes : 64), 0);
    kt_status st = kt_op_backward(KT_OP_LOAD_BALANCE_LOSS, NULL, in, 2, loss, 1, g, gin, &ex);
    free(ex.scratch);
    return st;
}

/* The Switch form's fixed points: uniform probabilities with perfectly balanced choices give
 * aux = k (f_e = k/E, P_e = 1/E); every token sending all its choices' weight where it goes
 * (one expert takes everything) gives E * k * 1. */
static void test_load_balance_values(void **state)
{
    (void)state;
    const int64_t r = 16, e = 8;
    const int k = 2;
    kt_tensor in[2] = {tu_new(KT_F32, r, e), tu_new(KT_I32, r, k)}, loss = tu_alloc(KT_F32, 0, NULL);
    for (int64_t i = 0; i < r * k; i++)
        tu_set(&in[1], i, (double)(i % e));
    assert_int_equal(lb_forward(in, &loss), KT_OK);
    assert_float_equal(tu_get(&loss, 0), (double)k, 1e-6);
    /* the gradient at the balanced point is zero: f_j = q_r for every row */
    kt_tensor g = tu_alloc(KT_F32, 0, NULL), gin[2] = {tu_new(KT_F32, r, e), in[1]};
    gin[1].data = NULL;
    tu_set(&g, 0, 1.0);
    assert_int_equal(lb_backward(in, &loss, &g, gin), KT_OK);
    for (int64_t i = 0; i < r * e; i++)
        assert_float_equal(tu_get(&gin[0], i), 0.0, 1e-7);
    /* all on expert 3, which holds nearly all the probability */
    for (int64_t i = 0; i < r * e; i++)
        tu_set(&in[0], i, i % e == 3 ? 40.0 : 0.0);
    for (int64_t i = 0; i < r * k; i++)
        tu_set(&in[1], i, 3);
    assert_int_equal(lb_forward(in, &loss), KT_OK);
    assert_float_equal(tu_get(&loss, 0), (double)(e * k), 1e-4);
    tu_free(&in[0]), tu_free(&in[1]), tu_free(&loss), tu_free(&g), tu_free(&gin[0]);
}

static void test_load_balance_bad_input(void **state)
{
    (void)state;
    kt_tensor x = tu_new(KT_F32, 4, 6), ids = tu_new(KT_I32, 4, 2), loss = tu_alloc(KT_F32, 0, NULL);
    kt_tensor xb = tu_new(KT_BF16, 4, 6), ids3 = tu_new(KT_I32, 3, 2), idsf = tu_new(KT_F32, 4, 2);
    kt_tensor ids1 = tu_new(KT_I64, 4);
    kt_tensor in[2] = {x, ids};
    tu_set(&ids, 5, 6);
    TU_EXPECT_ERROR(lb_forward(in, &loss),
                    KT_ERANGE, "load_balance_loss", "ids[5] = 6", "[0, 6)");
    tu_set(&ids, 5, -1);
    kt_tensor g = tu_alloc(KT_F32, 0, NULL), gx = tu_new(KT_F32, 4, 6);
    kt_tensor gin[2] = {gx, ids};
    gin[1].data = NULL;
    TU_EXPECT_ERROR(lb_backward(in, &loss, &g, gin),
                    KT_ERANGE, "load_balance_loss backward", "ids[5] = -1");
    tu_set(&ids, 5, 0);
    tu_set(&x, 7, NAN);
    TU_EXPECT_ERROR(lb_forward(in, &loss),
                    KT_EINVAL, "load_balance_loss", "row 1", "not finite");
    tu_set(&x, 7, 0);
    gin[1] = ids;
    TU_EXPECT_ERROR(lb_backward(in, &loss, &g, gin),
                    KT_EINVAL, "load_balance_loss", "input 1", "no gradient");
    in[1] = ids3;
    TU_EXPECT_ERROR(lb_forward(in, &loss),
                    KT_EINVAL, "load_balance_loss", "ids");
    in[1] = idsf;
    TU_EXPECT_ERROR(lb_forward(in, &loss),
                    KT_EINVAL, "load_balance_loss", "ids", "i32 or i64");
    in[1] = ids1;
    TU_EXPECT_ERROR(lb_forward(in, &loss),
                    KT_EINVAL, "load_balance_loss", "ids", "2 dimensions");
    in[0] = xb, in[1] = ids;
    TU_EXPECT_ERROR(lb_forward(in, &loss),
                    KT_EINVAL, "load_balance_loss", "logits", "must be f32", "bf16");
    tu_free(&x), tu_free(&ids), tu_free(&loss), tu_free(&xb), tu_free(&ids3), tu_free(&idsf);
    tu_free(&ids1), tu_free(&g), tu_free(&gx);
}

/* ---- the auxiliary loss through .ktg, the graph and a session --------------------------------- */

enum { GT = 12, GH = 6, GE = 8, GK = 2, GV = 5, GL = 2 };
#define COEF 0.02

/* Two router layers on one hidden state (the second on a transformed one), a head trained by
 * cross-entropy, and loss = ce + COEF * aux over the rows of both layers concatenated, as
 * transformers computes it. */
static const char aux_src[] =
    "const T = 12\nconst H = 6\nconst E = 8\nconst K = 2\nconst V = 5\n"
    "input x: f32[T, H]\n"
    "input y: i32[T]\n"
    "param head: f32[H, V] = normal(0.3)\n"
    "param mix: f32[H, H] = normal(0.3)\n"
    "h = x\n"
    "repeat l in 0..2 {\n"
    "    param router{l}: f32[H, E] = normal(0.5)\n"
    "    logits{l} = matmul(h, router{l})\n"
    "    ids{l}, w{l} = topk_router(logits{l}, k = K, norm_topk = 1)\n"
    "    h = matmul(h, mix)\n"
    "}\n"
    "out = matmul(x, head)\n"
    "ce = cross_entropy(out, y)\n"
    "all_logits = concat(logits0, logits1, dim = 0)\n"
    "all_ids = concat(ids0, ids1, dim = 0)\n"
    "aux = load_balance_loss(all_logits, all_ids)\n"
    "scaled = scale(aux, alpha = 0.02)\n"
    "loss = add(ce, scaled)\n"
    "output aux\n"
    "loss loss\n";

typedef struct aux_params {
    double x[GT * GH], head[GH * GV], mix[GH * GH], router[GL][GH * GE];
    int y[GT];
} aux_params;

static void mm(const double *a, const double *b, int m, int k, int n, double *c)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int t = 0; t < k; t++)
                s += a[i * k + t] * b[t * n + j];
            c[i * n + j] = s;
        }
}

/* The model in float64; aux_out gets the concatenated-rows aux, sum_out the sum of the two
 * layers' own aux losses (what transformers does not compute). */
static double aux_model(const aux_params *p, double *aux_out, double *sum_out)
{
    double h[GT * GH], h2[GT * GH], logits[GL * GT * GE], ids[GL * GT * GK], out[GT * GV];
    memcpy(h, p->x, sizeof h);
    kt_op_attrs at = TU_ATTRS(KT_OP_TOPK_ROUTER, .k = GK, .norm_topk = 1);
    double sum = 0.0;
    for (int l = 0; l < GL; l++) {
        mm(h, p->router[l], GT, GH, GE, logits + l * GT * GE);
        double w[GK];
        for (int t = 0; t < GT; t++)
            ref_router_row(&at, logits + (l * GT + t) * GE, NULL, GE, ids + (l * GT + t) * GK, w);
        sum += ref_aux(logits + l * GT * GE, ids + l * GT * GK, GT, GE, GK);
        mm(h, p->mix, GT, GH, GH, h2);
        memcpy(h, h2, sizeof h);
    }
    mm(p->x, p->head, GT, GH, GV, out);
    double ce = 0.0;
    for (int t = 0; t < GT; t++) {
        double m = -INFINITY, s = 0.0;
        for (int v = 0; v < GV; v++)
            m = fmax(m, out[t * GV + v]);
        for (int v = 0; v < GV; v++)
            s += exp(out[t * GV + v] - m);
        ce += m + log(s) - out[t * GV + p->y[t]];
    }
    ce /= GT;
    const double aux = ref_aux(logits, ids, GL * GT, GE, GK);
    if (aux_out)
        *aux_out = aux;
    if (sum_out)
        *sum_out = sum;
    return ce + COEF * aux;
}

static kt_tensor session_tensor(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    if (kt_session_tensor(s, role, name, &t) != KT_OK)
        fail_msg("%s: %s", name, kt_last_error());
    return t;
}

static void put(kt_session *s, kt_tensor_role role, const char *name, const double *v, int n)
{
    kt_tensor t = session_tensor(s, role, name);
    assert_int_equal(kt_tensor_numel(&t), n);
    for (int i = 0; i < n; i++) {
        ((float *)t.data)[i] = (float)v[i];
    }
}

/* The session's loss and its gradients against the float64 model (its gradients by central
 * differences); the concatenated aux differs from the per-layer sum, so the graph computes
 * the former. */
static void test_aux_loss_in_graph(void **state)
{
    (void)state;
    kt_graph *g = NULL;
    char diag[2048];
    if (kt_ktg_parse(aux_src, strlen(aux_src), "aux.ktg", NULL, 0, &g, diag, sizeof diag,
                     NULL) != KT_OK)
        fail_msg("aux.ktg:\n%s", diag);
    kt_program *prog = NULL;
    if (kt_compile(g, NULL, &prog) != KT_OK)
        fail_msg("compile: %s", kt_last_error());
    kt_session_options opt = {.threads = 2};
    kt_session *s = NULL;
    if (kt_session_create(prog, &opt, &s) != KT_OK)
        fail_msg("session: %s", kt_last_error());

    aux_params p;
    tu_rng rng;
    tu_rng_seed(&rng, 40);
    /* values rounded to f32 first, so the session and the model see the same numbers */
    double *all[] = {p.x, p.head, p.mix, p.router[0], p.router[1]};
    const int sizes[] = {GT * GH, GH * GV, GH * GH, GH * GE, GH * GE};
    const double spread[] = {1.0, 0.5, 0.4, 0.8, 0.8};
    for (int a = 0; a < 5; a++)
        for (int i = 0; i < sizes[a]; i++)
            all[a][i] = (double)(float)(spread[a] * tu_rng_normal(&rng));
    for (int t = 0; t < GT; t++)
        p.y[t] = (int)(tu_rng_next(&rng) % GV);
    put(s, KT_ROLE_INPUT, "x", p.x, GT * GH);
    kt_tensor yt = session_tensor(s, KT_ROLE_INPUT, "y");
    for (int t = 0; t < GT; t++)
        ((int32_t *)yt.data)[t] = p.y[t];
    put(s, KT_ROLE_PARAM, "head", p.head, GH * GV);
    put(s, KT_ROLE_PARAM, "mix", p.mix, GH * GH);
    put(s, KT_ROLE_PARAM, "router0", p.router[0], GH * GE);
    put(s, KT_ROLE_PARAM, "router1", p.router[1], GH * GE);
    if (kt_session_forward(s) != KT_OK || kt_session_backward(s) != KT_OK)
        fail_msg("run: %s", kt_last_error());

    double aux, per_layer_sum;
    const double want = aux_model(&p, &aux, &per_layer_sum);
    assert_float_equal(kt_session_loss(s), want, 1e-5 * fabs(want));
    kt_tensor aux_t = session_tensor(s, KT_ROLE_OUTPUT, "aux");
    assert_float_equal(tu_get(&aux_t, 0), aux, 1e-5 * aux);
    /* not the sum (nor the mean) of the per-layer losses */
    assert_true(fabs(aux - per_layer_sum) > 0.2 * aux);
    assert_true(fabs(aux - per_layer_sum / GL) > 1e-3 * aux);

    /* every gradient (the routers' come from the aux term alone, mix's from the second
     * layer's logits) against central differences of the float64 model */
    const char *names[] = {"head", "mix", "router0", "router1"};
    for (int a = 1; a < 5; a++) {
        kt_tensor gt = session_tensor(s, KT_ROLE_GRAD, names[a - 1]);
        double scale = 1e-3, err = 0.0;
        for (int i = 0; i < sizes[a]; i++) {
            const double v = all[a][i], h = 1e-6;
            all[a][i] = v + h;
            const double lp = aux_model(&p, NULL, NULL);
            all[a][i] = v - h;
            const double lm = aux_model(&p, NULL, NULL);
            all[a][i] = v;
            const double fd = (lp - lm) / (2 * h);
            scale = fmax(scale, fabs(fd));
            err = fmax(err, fabs(fd - tu_get(&gt, i)));
        }
        if (err / scale > 1e-4)
            fail_msg("gradient of %s: relative error %.3g against finite differences",
                     names[a - 1], err / scale);
        if (a >= 3 && scale <= 1e-3)
            fail_msg("gradient of %s is too small to test (%.3g)", names[a - 1], scale);
    }
    kt_session_destroy(s);
    kt_program_destroy(prog);
    kt_graph_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_router_ties),
        cmocka_unit_test(test_router_variants),
        cmocka_unit_test(test_router_variants_deterministic),
        cmocka_unit_test(test_router_group_limited),
        cmocka_unit_test(test_router_bias_moves_choice_only),
        cmocka_unit_test(test_router_group_ties),
        cmocka_unit_test(test_router_bad_input),
        cmocka_unit_test(test_load_balance),
        cmocka_unit_test(test_load_balance_values),
        cmocka_unit_test(test_load_balance_bad_input),
        cmocka_unit_test(test_aux_loss_in_graph),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
