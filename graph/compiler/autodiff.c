/* Reverse-mode autodiff: appends the backward schedule to the forward one.
 *
 * Each forward node whose outputs have a gradient and whose inputs want one becomes one
 * backward step that runs the op's backward kernel (every op in the table has one). A value
 * used by several nodes receives several partial gradients; they are summed with add steps
 * as they appear, so each partial dies as soon as it is added. Gradients of trainable
 * parameters end in an accumulate step into the parameter's gradient buffer (which is what
 * lets micro-batches accumulate), placed as soon as the gradient is complete. */
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/compiler/compiler.h"
#include "lib/ops/op_desc.h"

typedef struct autodiff {
    kt__compiler *c;
    char *requires_grad; /* canonical value depends on a trainable parameter */
    int32_t *grad_of;    /* canonical value -> buffer holding its gradient so far, or -1 */
    int32_t *first_use;  /* parameter value -> earliest live node reading it, or -1 */
} autodiff;

static int is_float(kt_dtype d) { return d == KT_F32 || d == KT_BF16 || d == KT_F16; }

static void blank_step(kt__pstep *s, int32_t kind)
{
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->name = -1;
    s->node = -1;
    s->scratch = -1;
    for (int i = 0; i < KT_OP_MAX_IN; i++)
        s->in[i] = s->gin[i] = -1;
    for (int i = 0; i < KT_OP_MAX_OUT; i++)
        s->out[i] = s->gout[i] = -1;
}

/* A new buffer filled with `value` (the loss seed, or zeros for an unused output). */
static kt_status fill_buffer(kt__compiler *c, const kt_tensor *meta, float value, int32_t *id)
{
    KT__TRY(kt__compiler_add_buf(c, meta, KT__REGION_ACT, id));
    kt__pstep s;
    blank_step(&s, KT__STEP_FILL);
    s.n_out = 1;
    s.out[0] = *id;
    s.attrs.alpha = value;
    return kt__compiler_add_step(c, &s);
}

static kt_status accumulate(autodiff *ad, int32_t value, int32_t partial)
{
    kt__compiler *c = ad->c;
    if (ad->grad_of[value] < 0) {
        ad->grad_of[value] = partial;
        return KT_OK;
    }
    int32_t sum;
    KT__TRY(kt__compiler_add_buf(c, &c->bufs[partial].meta, KT__REGION_ACT, &sum));
    kt__pstep s;
    blank_step(&s, KT__STEP_FORWARD);
    s.op = KT_OP_ADD;
    s.n_in = 2;
    s.n_out = 1;
    s.in[0] = ad->grad_of[value];
    s.in[1] = partial;
    s.out[0] = sum;
    KT__TRY(kt__compiler_add_step(c, &s));
    ad->grad_of[value] = sum;
    return KT_OK;
}

static void mark_requires_grad(autodiff *ad)
{
    const kt_graph *g = ad->c->g;
    for (int32_t v = 0; v < g->n_values; v++)
        ad->requires_grad[v] = g->values[v].kind == KT__VALUE_PARAM;
    for (int32_t n = 0; n < g->n_nodes; n++) {
        if (!ad->c->node_live[n])
            continue;
        const kt__gnode *node = &g->nodes[n];
        unsigned no_grad = kt__op_get(node->op)->no_grad_in;
        int any = 0;
        for (int32_t i = 0; i < node->n_in; i++)
            if (!(no_grad & (1u << i)))
                any |= ad->requires_grad[ad->c->remap[node->in[i]]];
        for (int32_t o = 0; o < node->n_out; o++)
            ad->requires_grad[node->out[o]] = any && is_float(g->values[node->out[o]].meta.dtype);
    }
}

/* Moves a trainable parameter's finished gradient into its gradient buffer. Emitted right
 * after the backward of the parameter's earliest consumer (the last to contribute), so the
 * partial gradient dies there instead of living to the end of the backward pass. */
static kt_status accumulate_param(autodiff *ad, int32_t v)
{
    kt__compiler *c = ad->c;
    if (c->grad_buf[v] < 0) /* its first (and only) accumulation: the buffer comes now */
        KT__TRY(kt__compiler_add_buf(c, &c->g->values[v].meta, KT__REGION_GRAD,
                                     &c->grad_buf[v]));
    kt__pstep s;
    blank_step(&s, KT__STEP_ACCUM_GRAD);
    s.n_in = 1;
    s.n_out = 1;
    s.in[0] = ad->grad_of[v];
    s.out[0] = c->grad_buf[v];
    KT__TRY(kt__compiler_name(c, c->g->values[v].name, &s.name));
    KT__TRY(kt__compiler_add_step(c, &s));
    ad->first_use[v] = -1; /* done: a parameter read twice by one node is moved once */
    return KT_OK;
}

static kt_status backward_node(autodiff *ad, int32_t n)
{
    kt__compiler *c = ad->c;
    const kt_graph *g = c->g;
    const kt__gnode *node = &g->nodes[n];
    const kt__op_desc *desc = kt__op_get(node->op);
    int has_gout = 0, wants = 0;
    for (int32_t o = 0; o < node->n_out; o++)
        has_gout |= ad->grad_of[node->out[o]] >= 0;
    for (int32_t i = 0; i < node->n_in; i++)
        wants |= !(desc->no_grad_in & (1u << i)) && ad->requires_grad[c->remap[node->in[i]]];
    if (!has_gout || !wants)
        return KT_OK;

    kt__pstep s;
    blank_step(&s, KT__STEP_BACKWARD);
    s.node = n;
    s.op = node->op;
    s.attrs = node->attrs;
    s.n_in = node->n_in;
    s.n_out = node->n_out;
    KT__TRY(kt__compiler_name(c, node->name, &s.name));
    for (int32_t i = 0; i < node->n_in; i++)
        s.in[i] = c->value_buf[c->remap[node->in[i]]];
    for (int32_t o = 0; o < node->n_out; o++) {
        int32_t v = node->out[o];
        s.out[o] = c->value_buf[v];
        if (ad->grad_of[v] >= 0)
            s.gout[o] = ad->grad_of[v];
        else if (is_float(g->values[v].meta.dtype)) /* an output nothing downstream used */
            KT__TRY(fill_buffer(c, &g->values[v].meta, 0.0f, &s.gout[o]));
    }
    for (int32_t i = 0; i < node->n_in; i++) {
        int32_t v = c->remap[node->in[i]];
        if (!(desc->no_grad_in & (1u << i)) && ad->requires_grad[v])
            KT__TRY(kt__compiler_add_buf(c, &g->values[v].meta, KT__REGION_ACT, &s.gin[i]));
    }
    KT__TRY(kt__compiler_add_step(c, &s));
    for (int32_t i = 0; i < node->n_in; i++)
        if (s.gin[i] >= 0)
            KT__TRY(accumulate(ad, c->remap[node->in[i]], s.gin[i]));
    for (int32_t i = 0; i < node->n_in; i++) {
        int32_t v = c->remap[node->in[i]];
        if (g->values[v].kind == KT__VALUE_PARAM && ad->first_use[v] == n &&
            ad->grad_of[v] >= 0)
            KT__TRY(accumulate_param(ad, v));
    }
    return KT_OK;
}

kt_status kt__pass_autodiff(kt__compiler *c)
{
    const kt_graph *g = c->g;
    autodiff ad = {.c = c};
    ad.requires_grad = calloc((size_t)g->n_values + 1, 1);
    ad.grad_of = malloc(((size_t)g->n_values + 1) * sizeof *ad.grad_of);
    ad.first_use = malloc(((size_t)g->n_values + 1) * sizeof *ad.first_use);
    kt_status status = KT_OK;
    if (ad.requires_grad == NULL || ad.grad_of == NULL || ad.first_use == NULL) {
        status = kt__error(KT_ENOMEM, "compile: out of memory");
        goto out;
    }
    for (int32_t v = 0; v < g->n_values; v++)
        ad.grad_of[v] = ad.first_use[v] = -1;
    for (int32_t n = g->n_nodes - 1; n >= 0; n--)
        for (int32_t i = 0; c->node_live[n] && i < g->nodes[n].n_in; i++)
            ad.first_use[c->remap[g->nodes[n].in[i]]] = n;
    mark_requires_grad(&ad);

    int32_t loss = c->remap[g->loss];
    if (!ad.requires_grad[loss]) {
        status = kt__error(KT_EINVAL, "compile: the loss does not depend on any trainable "
                           "parameter");
        goto out;
    }
    if ((status = fill_buffer(c, &g->values[loss].meta, 1.0f, &ad.grad_of[loss])) != KT_OK)
        goto out;
    for (int32_t n = g->n_nodes - 1; n >= 0; n--)
        if (c->node_live[n] && (status = backward_node(&ad, n)) != KT_OK)
            goto out;
    /* a parameter whose earliest consumer had no backward (its outputs do not reach the
     * loss) but which another consumer gave a gradient */
    for (int32_t v = 0; v < g->n_values; v++)
        if (g->values[v].kind == KT__VALUE_PARAM && ad.grad_of[v] >= 0 && ad.first_use[v] >= 0 &&
            (status = accumulate_param(&ad, v)) != KT_OK)
            goto out;
out:
    free(ad.requires_grad);
    free(ad.grad_of);
    free(ad.first_use);
    return status;
}
