/* A session's stateful ops: at creation, every op whose table row has lifecycle hooks
 * (ops/op_state.h) is bound with its nodes of the program, and what it trains gets optimizer
 * state here. The session keeps the list, so steps call hooks only for these ops. */
#include <stdlib.h>

#include "lib/core/error.h"
#include "graph/runtime/session_internal.h"

int kt__optimizer_states(const kt_optimizer_config *o)
{
    return o->kind == KT_OPTIM_ADAMW ? 2 : o->kind == KT_OPTIM_SGD && o->momentum != 0;
}

/* The op's forward steps, or *n_out 0. */
static kt_status collect_nodes(const kt_program *p, kt_op op, kt__op_node **out, int *n_out)
{
    int n = 0;
    for (int32_t at = 0; at < p->n_forward; at++)
        n += p->steps[at].kind == KT__STEP_FORWARD && p->steps[at].op == op;
    *out = NULL;
    *n_out = 0;
    if (n == 0)
        return KT_OK;
    kt__op_node *nodes = calloc((size_t)n, sizeof *nodes);
    if (nodes == NULL)
        return kt__error(KT_ENOMEM, "session: out of memory");
    int k = 0;
    for (int32_t at = 0; at < p->n_forward; at++) {
        const kt__pstep *ps = &p->steps[at];
        if (ps->kind != KT__STEP_FORWARD || ps->op != op)
            continue;
        kt__op_node *nd = &nodes[k++];
        nd->step = at;
        nd->name = kt__strings_get(&p->strings, ps->name);
        nd->attrs = &ps->attrs;
        nd->n_in = ps->n_in;
        for (int32_t i = 0; i < ps->n_in; i++)
            nd->in[i] = p->bufs[ps->in[i]].meta;
    }
    *out = nodes;
    *n_out = n;
    return KT_OK;
}

void *const *kt__session_bindings(const kt_session_options *o, int *n_out)
{
    /* the public options name the one kind of object bound today; ops see a generic list */
    *n_out = o->moe_layers != NULL ? o->n_moe_layers : 0;
    return (void *const *)o->moe_layers;
}

kt_status kt__session_keep_bindings(kt_session *s)
{
    int n = 0;
    void *const *given = kt__session_bindings(&s->opt, &n);
    if (given == NULL)
        return KT_OK;
    s->bindings = calloc((size_t)n + 1, sizeof *s->bindings);
    if (s->bindings == NULL)
        return kt__error(KT_ENOMEM, "session: out of memory");
    for (int i = 0; i < n; i++)
        s->bindings[i] = given[i];
    s->opt.moe_layers = (void *)s->bindings;
    return KT_OK;
}

void kt__session_drop_bindings(kt_session *s)
{
    free(s->bindings);
    s->bindings = NULL;
}

static kt__op_bind bind_args(const kt_session_options *o, const kt__op_node *nodes, int n)
{
    kt__op_bind b = {.nodes = nodes, .n_nodes = n, .comm = o->comm,
                     .moe_parallel = (int)o->moe_parallel};
    b.bindings = kt__session_bindings(o, &b.n_bindings);
    return b;
}

kt_status kt__session_state_bytes(const kt_program *p, const kt_session_options *o, int states,
                                  uint64_t *bytes_out)
{
    uint64_t total = 0;
    for (int op = 0; op < KT_OP_COUNT; op++) {
        const kt__op_state *h = kt__op_get((kt_op)op)->state;
        if (h == NULL || h->span_floats == NULL)
            continue;
        kt__op_node *nodes = NULL;
        int n = 0;
        KT__TRY(collect_nodes(p, (kt_op)op, &nodes, &n));
        kt__op_bind b = bind_args(o, nodes, n);
        total += (uint64_t)h->span_floats(&b) * sizeof(float) * (uint64_t)states;
        free(nodes);
    }
    *bytes_out = total;
    return KT_OK;
}

/* The spans of entry e, each with its optimizer state. */
static kt_status alloc_spans(kt__stateful *e, int states)
{
    int n = e->hooks->spans != NULL ? e->hooks->spans(e->state, NULL, 0) : 0;
    if (n <= 0)
        return KT_OK;
    kt__op_span *spans = calloc((size_t)n, sizeof *spans);
    e->spans = calloc((size_t)n, sizeof *e->spans);
    if (spans == NULL || e->spans == NULL) {
        free(spans);
        return kt__error(KT_ENOMEM, "session: out of memory");
    }
    e->hooks->spans(e->state, spans, n);
    kt_status st = KT_OK;
    for (int i = 0; i < n && st == KT_OK; i++) {
        kt__state_span *t = &e->spans[e->n_spans++]; /* counted first: unbind frees it */
        *t = (kt__state_span){.param = spans[i].param, .grad = spans[i].grad, .n = spans[i].n,
                              .name = spans[i].name};
        for (int k = 0; k < states && st == KT_OK; k++)
            if ((t->state[k] = calloc((size_t)t->n + 1, sizeof(float))) == NULL)
                st = kt__error(KT_ENOMEM, "session: out of memory for the optimizer state of "
                               "'%s'", t->name);
    }
    free(spans);
    return st;
}

kt_status kt__session_bind_state(kt_session *s)
{
    s->stateful = calloc(KT_OP_COUNT, sizeof *s->stateful);
    if (s->stateful == NULL)
        return kt__error(KT_ENOMEM, "session: out of memory");
    const int states = kt__optimizer_states(&s->opt.optimizer);
    for (int op = 0; op < KT_OP_COUNT; op++) {
        const kt__op_desc *d = kt__op_get((kt_op)op);
        if (d->state == NULL)
            continue;
        kt__stateful *e = &s->stateful[s->n_stateful];
        e->op = (kt_op)op;
        e->hooks = d->state;
        KT__TRY(collect_nodes(s->p, (kt_op)op, &e->nodes, &e->n_nodes));
        kt__op_bind b = bind_args(&s->opt, e->nodes, e->n_nodes);
        kt_status st = d->state->bind(&b, &e->state);
        if (st == KT_OK && e->state == NULL && e->n_nodes > 0)
            st = kt__error(KT_EINTERNAL, "session: op %s bound no state for its %d nodes",
                           d->name, e->n_nodes);
        if (st != KT_OK || e->state == NULL) {
            free(e->nodes);
            *e = (kt__stateful){0};
            if (st != KT_OK)
                return st;
            continue;
        }
        s->n_stateful++; /* counted first: unbind frees what was made */
        KT__TRY(alloc_spans(e, states));
    }
    return KT_OK;
}

void kt__session_unbind_state(kt_session *s)
{
    for (int i = 0; i < s->n_stateful; i++) {
        kt__stateful *e = &s->stateful[i];
        for (int k = 0; k < e->n_spans; k++)
            free(e->spans[k].state[0]), free(e->spans[k].state[1]);
        free(e->spans);
        if (e->hooks->unbind != NULL)
            e->hooks->unbind(e->state);
        free(e->nodes);
    }
    free(s->stateful);
    s->stateful = NULL;
    s->n_stateful = 0;
}
