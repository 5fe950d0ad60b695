/* The compiler driver: graph -> program.
 *
 *   CSE + DCE -> forward schedule (graph order is already topological) -> autodiff appends
 *   the backward schedule -> lifetimes and in-place sharing -> greedy memory plan -> checks.
 */
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/compiler/compiler.h"
#include "graph/plan.h"
#include "lib/ops/op_desc.h"

static kt_status grow(void **array, int32_t *cap, int32_t count, size_t elem)
{
    return kt__grow_array(array, cap, count, elem, "compile");
}

kt_status kt__compiler_add_buf(kt__compiler *c, const kt_tensor *meta, int32_t region,
                               int32_t *id_out)
{
    /* copy first: meta may point into c->bufs (a gradient shaped like an existing buffer),
     * which growing moves */
    kt__cbuf b = {.meta = *meta, .region = region, .bytes = kt_tensor_nbytes(meta),
                  .first = -1, .last = -1, .storage = c->n_bufs};
    b.meta.data = NULL;
    KT__TRY(grow((void **)&c->bufs, &c->cap_bufs, c->n_bufs, sizeof *c->bufs));
    c->bufs[c->n_bufs] = b;
    *id_out = c->n_bufs++;
    return KT_OK;
}

static void step_metas(const kt__compiler *c, const int32_t *ids, int32_t n, kt_tensor *metas)
{
    for (int32_t i = 0; i < n; i++)
        metas[i] = c->bufs[ids[i]].meta;
}

kt_status kt__compiler_add_step(kt__compiler *c, const kt__pstep *step)
{
    kt__pstep s = *step;
    s.scratch = -1;
    if (s.kind == KT__STEP_FORWARD || s.kind == KT__STEP_BACKWARD) {
        kt_tensor metas[KT_OP_MAX_IN];
        step_metas(c, s.in, s.n_in, metas);
        size_t need = kt_op_scratch_bytes(s.op, &s.attrs, metas, s.n_in,
                                          s.kind == KT__STEP_BACKWARD);
        if (need > 0) {
            kt_tensor m;
            kt__scratch_meta(&m, need);
            KT__TRY(kt__compiler_add_buf(c, &m, KT__REGION_ACT, &s.scratch));
        }
        double f = kt_op_flops(s.op, &s.attrs, metas, s.n_in);
        s.flops = s.kind == KT__STEP_BACKWARD ? 2.0 * f : f;
    }
    KT__TRY(grow((void **)&c->steps, &c->cap_steps, c->n_steps, sizeof *c->steps));
    c->steps[c->n_steps++] = s;
    return KT_OK;
}

kt_status kt__compiler_name(kt__compiler *c, int32_t graph_name, int32_t *name_out)
{
    if (graph_name < 0) {
        *name_out = -1;
        return KT_OK;
    }
    return kt__strings_add(&c->strings, kt__strings_get(&c->g->strings, graph_name), name_out);
}

/* Buffers for every input and parameter (the caller fills them even if no op reads them)
 * and for the outputs of kept nodes. */
static kt_status make_value_buffers(kt__compiler *c)
{
    const kt_graph *g = c->g;
    for (int32_t v = 0; v < g->n_values; v++) {
        c->value_buf[v] = -1;
        c->grad_buf[v] = -1;
        const kt__gvalue *gv = &g->values[v];
        if (gv->kind == KT__VALUE_NODE && (!c->node_live[gv->node] || c->remap[v] != v))
            continue;
        int32_t region = gv->kind == KT__VALUE_PARAM || gv->kind == KT__VALUE_CONST_PARAM
                             ? KT__REGION_PARAM
                             : KT__REGION_ACT;
        KT__TRY(kt__compiler_add_buf(c, &gv->meta, region, &c->value_buf[v]));
        c->bufs[c->value_buf[v]].is_input = gv->kind == KT__VALUE_INPUT;
        /* (a parameter's gradient buffer comes with its first gradient, in autodiff: one
         * that the loss does not reach has none and is not updated, as PyTorch skips a
         * parameter whose .grad is None) */
    }
    return KT_OK;
}

static kt_status make_forward_steps(kt__compiler *c)
{
    const kt_graph *g = c->g;
    for (int32_t n = 0; n < g->n_nodes; n++) {
        if (!c->node_live[n])
            continue;
        const kt__gnode *gn = &g->nodes[n];
        kt__pstep s;
        memset(&s, 0, sizeof s);
        s.kind = KT__STEP_FORWARD;
        s.node = n;
        s.op = gn->op;
        s.attrs = gn->attrs;
        s.n_in = gn->n_in;
        s.n_out = gn->n_out;
        for (int32_t i = 0; i < gn->n_in; i++)
            s.in[i] = c->value_buf[c->remap[gn->in[i]]];
        for (int32_t i = 0; i < gn->n_out; i++)
            s.out[i] = c->value_buf[gn->out[i]];
        for (int32_t i = 0; i < KT_OP_MAX_OUT; i++)
            s.gout[i] = -1;
        for (int32_t i = 0; i < KT_OP_MAX_IN; i++)
            s.gin[i] = -1;
        KT__TRY(kt__compiler_name(c, gn->name, &s.name));
        KT__TRY(kt__compiler_add_step(c, &s));
    }
    c->n_forward = c->n_steps;
    return KT_OK;
}

static kt_status make_entries(kt__compiler *c, kt_program *p)
{
    const kt_graph *g = c->g;
    int32_t counts[3] = {0, 0, g->n_outputs};
    for (int32_t v = 0; v < g->n_values; v++) {
        if (g->values[v].kind == KT__VALUE_INPUT)
            counts[KT_ROLE_INPUT]++;
        else if (g->values[v].kind != KT__VALUE_NODE)
            counts[KT_ROLE_PARAM]++;
    }
    for (int r = 0; r < 3; r++) {
        p->entries[r] = calloc((size_t)counts[r] + 1, sizeof *p->entries[r]);
        if (p->entries[r] == NULL)
            return kt__error(KT_ENOMEM, "compile: out of memory");
    }
    for (int32_t v = 0; v < g->n_values; v++) {
        const kt__gvalue *gv = &g->values[v];
        if (gv->kind == KT__VALUE_NODE)
            continue;
        int role = gv->kind == KT__VALUE_INPUT ? KT_ROLE_INPUT : KT_ROLE_PARAM;
        kt__pentry *e = &p->entries[role][p->n_entries[role]++];
        KT__TRY(kt__compiler_name(c, gv->name, &e->name));
        e->buf = c->value_buf[v];
        e->grad_buf = c->grad_buf[v];
        e->init = gv->init;
        e->shard_dim = g->shard_dim != NULL && v < g->cap_shard ? g->shard_dim[v] : -1;
    }
    for (int32_t o = 0; o < g->n_outputs; o++) {
        kt__pentry *e = &p->entries[KT_ROLE_OUTPUT][p->n_entries[KT_ROLE_OUTPUT]++];
        KT__TRY(kt__compiler_name(c, g->outputs[o].name, &e->name));
        e->buf = c->value_buf[c->remap[g->outputs[o].value]];
        e->grad_buf = -1;
        e->shard_dim = -1;
    }
    return KT_OK;
}

/* Offsets: the activation region by the greedy plan over shared storages; the parameter
 * and gradient regions back to back. */
static kt_status plan_memory(kt__compiler *c, kt_program *p)
{
    kt_status status = KT_OK;
    int32_t n = c->n_bufs;
    kt__plan_item *items = calloc((size_t)n + 1, sizeof *items);
    uint64_t *offsets = calloc((size_t)n + 1, sizeof *offsets);
    if (items == NULL || offsets == NULL) {
        status = kt__error(KT_ENOMEM, "compile: out of memory");
        goto out;
    }
    /* one item per storage root (calloc'ed to zero): its lifetime is the union of the
     * buffers sharing it */
    for (int32_t i = 0; i < n; i++) {
        const kt__cbuf *b = &c->bufs[i];
        if (b->region != KT__REGION_ACT)
            continue;
        kt__plan_item *it = &items[b->storage];
        if (it->bytes == 0 && b->bytes > 0) {
            it->first = b->first;
            it->last = b->last;
        }
        if (b->bytes > it->bytes)
            it->bytes = b->bytes;
        if (b->first < it->first)
            it->first = b->first;
        if (b->last > it->last)
            it->last = b->last;
    }
    status = kt__plan_greedy(items, n, offsets, &p->region_bytes[KT__REGION_ACT]);
    if (status != KT_OK)
        goto out;
    /* (the plan itself is checked with the rest of the program: kt__program_validate at the
     * end of compile_once sweeps the same lifetimes, so no sweep of its own here) */
    p->lower_bound = kt__plan_lower_bound(items, n);
    for (int32_t i = 0; i < n; i++) {
        const kt__cbuf *b = &c->bufs[i];
        kt__pbuf *pb = &p->bufs[i];
        pb->meta = b->meta;
        pb->region = b->region;
        pb->bytes = b->bytes;
        pb->first = b->first;
        pb->last = b->last;
        pb->storage = b->storage;
        if (b->region == KT__REGION_ACT) {
            pb->offset = offsets[b->storage];
        } else {
            pb->offset = p->region_bytes[b->region];
            p->region_bytes[b->region] +=
                (b->bytes + KT__PLAN_ALIGN - 1) / KT__PLAN_ALIGN * KT__PLAN_ALIGN;
            pb->first = pb->last = -1;
        }
    }
out:
    free(items);
    free(offsets);
    return status;
}

static void compiler_free(kt__compiler *c)
{
    free(c->bufs);
    free(c->steps);
    free(c->remap);
    free(c->node_live);
    free(c->value_buf);
    free(c->grad_buf);
    kt__strings_free(&c->strings);
}

/* One compilation with checkpoint segments of `group` units (-1: as the policy says, 0: none).
 * *n_units_out receives the number of checkpointable units. */
static kt_status compile_once(const kt_graph *g, const kt_compile_options *opt,
                              const kt_checkpoint_policy *policy, int32_t group,
                              kt_program **program_out, int32_t *n_units_out)
{
    kt__compiler c;
    memset(&c, 0, sizeof c);
    c.g = g;
    c.opt = *opt;
    c.policy = *policy;
    kt_status status = KT_OK;
    kt_program *p = calloc(1, sizeof *p);
    size_t nv = (size_t)g->n_values + 1, nn = (size_t)g->n_nodes + 1;
    c.remap = malloc(nv * sizeof *c.remap);
    c.node_live = calloc(nn, 1);
    c.value_buf = malloc(nv * sizeof *c.value_buf);
    c.grad_buf = malloc(nv * sizeof *c.grad_buf);
    if (p == NULL || !c.remap || !c.node_live || !c.value_buf || !c.grad_buf) {
        status = kt__error(KT_ENOMEM, "compile: out of memory");
        goto fail;
    }
    p->loss_buf = -1;
    if ((status = kt__pass_cse_dce(&c)) != KT_OK || (status = make_value_buffers(&c)) != KT_OK ||
        (status = make_forward_steps(&c)) != KT_OK)
        goto fail;
    int32_t n_units = kt__checkpoint_unit_count(&c);
    if (n_units_out != NULL)
        *n_units_out = n_units;
    if (group < 0)
        group = kt__checkpoint_group_size(&c, n_units);
    if (c.opt.training && ((status = kt__pass_autodiff(&c)) != KT_OK ||
                           (status = kt__pass_checkpoint(&c, group)) != KT_OK))
        goto fail;
    if ((status = kt__pass_lifetimes(&c)) != KT_OK)
        goto fail;
    p->bufs = calloc((size_t)c.n_bufs + 1, sizeof *p->bufs);
    if (p->bufs == NULL) {
        status = kt__error(KT_ENOMEM, "compile: out of memory");
        goto fail;
    }
    p->n_bufs = c.n_bufs;
    if ((status = plan_memory(&c, p)) != KT_OK || (status = make_entries(&c, p)) != KT_OK)
        goto fail;
    if (g->loss >= 0)
        p->loss_buf = c.value_buf[c.remap[g->loss]];
    for (int32_t i = 0; i < c.n_steps; i++)
        c.steps[i].node = -1; /* compile-time only: a loaded program has none either */
    p->steps = c.steps;
    p->n_steps = c.n_steps;
    p->n_forward = c.n_forward;
    p->strings = c.strings;
    c.steps = NULL;
    memset(&c.strings, 0, sizeof c.strings);
    if ((status = kt__program_validate(p)) != KT_OK) {
        kt__error_context(status, "compile: the compiled program is inconsistent (a compiler "
                          "bug)");
        goto fail;
    }
    compiler_free(&c);
    *program_out = p;
    return KT_OK;

fail:
    compiler_free(&c);
    if (p != NULL)
        kt__program_free(p);
    return status;
}

/* The budget policy: among all group sizes (and no checkpointing at all), the program whose
 * planned peak fits the budget with the fewest recomputed FLOPs (then the smallest peak). */
static kt_status compile_for_budget(const kt_graph *g, const kt_compile_options *opt,
                                    const kt_checkpoint_policy *policy, kt_program **out)
{
    kt_program *best = NULL, *candidate = NULL;
    int32_t n_units = 0;
    KT__TRY(compile_once(g, opt, policy, 0, &candidate, &n_units));
    uint64_t smallest = UINT64_MAX;
    for (int32_t group = 0; group <= n_units; group = group == 0 ? 1 : group + 1) {
        if (group > 0) {
            kt_status s = compile_once(g, opt, policy, group, &candidate, NULL);
            if (s != KT_OK) {
                kt_program_destroy(best);
                return s;
            }
        }
        kt_program_stats cs, bs;
        kt_program_get_stats(candidate, &cs);
        uint64_t peak = cs.arena_bytes;
        if (peak < smallest)
            smallest = peak;
        int better = 0;
        if (peak <= policy->budget_bytes) {
            if (best == NULL)
                better = 1;
            else {
                kt_program_get_stats(best, &bs);
                better = cs.recompute_flops < bs.recompute_flops ||
                         (cs.recompute_flops == bs.recompute_flops && peak < bs.arena_bytes);
            }
        }
        if (better) {
            kt_program_destroy(best);
            best = candidate;
        } else {
            kt_program_destroy(candidate);
        }
        candidate = NULL;
    }
    if (best == NULL)
        return kt__error(KT_EINVAL, "checkpoint: no segmentation fits the budget of %llu bytes; "
                         "the smallest planned peak reachable is %llu bytes",
                         (unsigned long long)policy->budget_bytes, (unsigned long long)smallest);
    *out = best;
    return KT_OK;
}

kt_status kt_compile(const kt_graph *g, const kt_compile_options *options,
                     kt_program **program_out)
{
    if (program_out != NULL)
        *program_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (g == NULL || program_out == NULL)
        return kt__error(KT_EINVAL, "kt_compile: NULL argument");
    kt_compile_options opt;
    memset(&opt, 0, sizeof opt);
    if (options != NULL)
        opt = *options;
    else
        opt.training = g->loss >= 0;
    if (opt.training && g->loss < 0)
        return kt__error(KT_EINVAL, "compile: training needs a loss (kt_graph_set_loss)");
    if (g->n_outputs == 0 && g->loss < 0)
        return kt__error(KT_EINVAL, "compile: the graph has no outputs and no loss");
    if (g->open_segment >= 0)
        return kt__error(KT_EINVAL, "compile: a checkpoint segment opened at node %d is not "
                         "closed", g->open_segment);
    kt_checkpoint_policy policy = opt.override_checkpoint ? opt.checkpoint : g->policy;
    /* blocks without a policy of their graph's mean themselves; an explicit NONE (a policy
     * line "none", or kt_graph_set_checkpoint_policy) keeps them inert */
    if (policy.kind == KT_CHECKPOINT_NONE && !opt.override_checkpoint && !g->policy_set &&
        g->n_segments > 0)
        policy.kind = KT_CHECKPOINT_SEGMENTS;
    if (policy.kind == KT_CHECKPOINT_BUDGET && opt.training)
        return compile_for_budget(g, &opt, &policy, program_out);
    return compile_once(g, &opt, &policy, -1, program_out, NULL);
}
