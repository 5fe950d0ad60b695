/* Building graphs: every call validates its arguments and the op's shapes at once, so a bad
 * model is reported where it is written, with the node named. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/graph_internal.h"
#include "lib/ops/attrs.h"

#define KT__NAME_MAX 127

kt_status kt_graph_create(kt_graph **graph_out)
{
    if (graph_out != NULL)
        *graph_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (graph_out == NULL)
        return kt__error(KT_EINVAL, "kt_graph_create: graph_out is NULL");
    kt_graph *g = calloc(1, sizeof *g);
    if (g == NULL)
        return kt__error(KT_ENOMEM, "kt_graph_create: out of memory");
    g->loss = -1;
    g->open_segment = -1;
    *graph_out = g;
    return KT_OK;
}

void kt_graph_destroy(kt_graph *g)
{
    if (g == NULL)
        return;
    free(g->values);
    free(g->nodes);
    free(g->outputs);
    free(g->segments);
    free(g->shard_dim);
    kt__strings_free(&g->strings);
    free(g);
}

kt_status kt__grow_array(void **array, int32_t *cap, int32_t count, size_t elem,
                         const char *what)
{
    if (count < *cap)
        return KT_OK;
    if (*cap >= INT32_MAX / 2)
        return kt__error(KT_ENOMEM, "%s: too large", what);
    int32_t ncap = *cap ? *cap * 2 : 64;
    void *p = realloc(*array, (size_t)ncap * elem);
    if (p == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", what);
    *array = p;
    *cap = ncap;
    return KT_OK;
}

static kt_status reserve(void **array, int32_t *cap, int32_t count, size_t elem)
{
    return kt__grow_array(array, cap, count, elem, "graph");
}

static kt_status check_name(const char *what, const char *name)
{
    if (name == NULL || name[0] == '\0')
        return kt__error(KT_EINVAL, "%s: a name is required", what);
    if (strlen(name) > KT__NAME_MAX)
        return kt__error(KT_EINVAL, "%s '%.40s...': name longer than %d bytes", what, name,
                         KT__NAME_MAX);
    return KT_OK;
}

static int leaf_named(const kt_graph *g, const char *name)
{
    for (int32_t i = 0; i < g->n_values; i++)
        if (g->values[i].name >= 0 && strcmp(kt__strings_get(&g->strings, g->values[i].name),
                                             name) == 0)
            return 1;
    return 0;
}

static kt_status add_leaf(kt_graph *g, const char *what, const char *name, kt__value_kind kind,
                          kt_dtype dtype, int ndim, const int64_t *shape, kt_init init,
                          kt_value *value_out)
{
    if (g == NULL || value_out == NULL)
        return kt__error(KT_EINVAL, "%s: NULL argument", what);
    KT__TRY(check_name(what, name));
    if (leaf_named(g, name))
        return kt__error(KT_EINVAL, "%s '%s': the name is already taken", what, name);
    kt_tensor meta;
    if (kt_tensor_init(&meta, NULL, dtype, ndim, shape) != KT_OK)
        return kt__error_context(KT_EINVAL, "%s '%s'", what, name);
    if (kind == KT__VALUE_PARAM && dtype != KT_F32)
        return kt__error(KT_EINVAL, "%s '%s': trainable parameters are f32 (their own master "
                         "copy), got %s; use kt_graph_const_param for frozen weights", what, name,
                         kt_dtype_name(dtype));
    if (kind != KT__VALUE_INPUT && ((unsigned)init.kind > KT_INIT_LOADED ||
                                    (init.kind == KT_INIT_NORMAL && !(init.a >= 0)) ||
                                    (init.kind == KT_INIT_UNIFORM && !(init.a < init.b))))
        return kt__error(KT_EINVAL, "%s '%s': invalid initialiser", what, name);
    if (kind != KT__VALUE_INPUT && init.kind != KT_INIT_LOADED && init.kind != KT_INIT_ZEROS &&
        dtype != KT_F32 && dtype != KT_BF16 && dtype != KT_F16)
        return kt__error(KT_EINVAL, "%s '%s': only zeros or loaded values suit dtype %s", what,
                         name, kt_dtype_name(dtype));
    KT__TRY(reserve((void **)&g->values, &g->cap_values, g->n_values, sizeof *g->values));
    kt__gvalue v = {.meta = meta, .kind = kind, .node = -1, .init = init};
    KT__TRY(kt__strings_add(&g->strings, name, &v.name));
    g->values[g->n_values] = v;
    value_out->id = g->n_values++;
    return KT_OK;
}

kt_status kt_graph_input(kt_graph *g, const char *name, kt_dtype dtype, int ndim,
                         const int64_t *shape, kt_value *value_out)
{
    return add_leaf(g, "input", name, KT__VALUE_INPUT, dtype, ndim, shape, kt_init_zeros(),
                    value_out);
}

kt_status kt_graph_param(kt_graph *g, const char *name, kt_dtype dtype, int ndim,
                         const int64_t *shape, kt_init init, kt_value *value_out)
{
    return add_leaf(g, "param", name, KT__VALUE_PARAM, dtype, ndim, shape, init, value_out);
}

kt_status kt_graph_const_param(kt_graph *g, const char *name, kt_dtype dtype, int ndim,
                               const int64_t *shape, kt_init init, kt_value *value_out)
{
    return add_leaf(g, "param", name, KT__VALUE_CONST_PARAM, dtype, ndim, shape, init,
                    value_out);
}

static int valid_value(const kt_graph *g, kt_value v) { return v.id >= 0 && v.id < g->n_values; }

kt_status kt_graph_op(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs,
                      const kt_value *in, int n_in, kt_value *outs)
{
    if (g == NULL || outs == NULL || (n_in > 0 && in == NULL))
        return kt__error(KT_EINVAL, "kt_graph_op: NULL argument");
    int32_t index = g->n_nodes;
    char label[192];
    if (name != NULL && name[0] != '\0')
        snprintf(label, sizeof label, "node %d (%s '%s')", index, kt_op_name(op), name);
    else
        snprintf(label, sizeof label, "node %d (%s)", index, kt_op_name(op));
    if (name != NULL && strlen(name) > KT__NAME_MAX)
        return kt__error(KT_EINVAL, "%s: name longer than %d bytes", label, KT__NAME_MAX);
    int min_in, max_in, n_out;
    if (kt_op_arity(op, &min_in, &max_in, &n_out) != KT_OK)
        return kt__error(KT_EINVAL, "node %d: invalid op %d", index, (int)op);
    if (n_in < 0 || n_in > KT_OP_MAX_IN)
        return kt__error(KT_EINVAL, "%s: %d inputs", label, n_in);
    kt_tensor metas[KT_OP_MAX_IN];
    for (int i = 0; i < n_in; i++) {
        if (!valid_value(g, in[i]))
            return kt__error(KT_EINVAL, "%s: input %d is not a value of this graph (id %d)",
                             label, i, in[i].id);
        metas[i] = g->values[in[i].id].meta;
    }
    /* the table's defaults for NULL; a struct not made by kt_op_defaults(op) is refused */
    kt_op_attrs a;
    if (kt__attrs_resolve(op, attrs, &a) != KT_OK)
        return kt__error_context(KT_EINVAL, "%s", label);
    kt_tensor out_meta[KT_OP_MAX_OUT];
    if (kt_op_infer(op, &a, metas, n_in, out_meta, n_out) != KT_OK)
        return kt__error_context(KT_EINVAL, "%s", label);
    KT__TRY(reserve((void **)&g->nodes, &g->cap_nodes, g->n_nodes, sizeof *g->nodes));
    for (int i = 0; i < n_out; i++)
        KT__TRY(reserve((void **)&g->values, &g->cap_values, g->n_values + i,
                        sizeof *g->values));
    kt__gnode node = {.op = op, .attrs = a, .n_in = n_in, .n_out = n_out, .name = -1};
    if (name != NULL && name[0] != '\0')
        KT__TRY(kt__strings_add(&g->strings, name, &node.name));
    for (int i = 0; i < n_in; i++)
        node.in[i] = in[i].id;
    for (int i = 0; i < n_out; i++) {
        kt__gvalue v = {.meta = out_meta[i], .kind = KT__VALUE_NODE, .name = -1, .node = index,
                        .out_index = i};
        node.out[i] = g->n_values;
        g->values[g->n_values++] = v;
    }
    g->nodes[g->n_nodes++] = node;
    for (int i = 0; i < n_out; i++)
        outs[i].id = node.out[i];
    return KT_OK;
}

kt_status kt_graph_output(kt_graph *g, kt_value v, const char *name)
{
    if (g == NULL)
        return kt__error(KT_EINVAL, "kt_graph_output: graph is NULL");
    KT__TRY(check_name("output", name));
    if (!valid_value(g, v))
        return kt__error(KT_EINVAL, "output '%s': not a value of this graph (id %d)", name, v.id);
    for (int32_t i = 0; i < g->n_outputs; i++)
        if (strcmp(kt__strings_get(&g->strings, g->outputs[i].name), name) == 0)
            return kt__error(KT_EINVAL, "output '%s': the name is already taken", name);
    KT__TRY(reserve((void **)&g->outputs, &g->cap_outputs, g->n_outputs, sizeof *g->outputs));
    kt__goutput o = {.value = v.id};
    KT__TRY(kt__strings_add(&g->strings, name, &o.name));
    g->outputs[g->n_outputs++] = o;
    return KT_OK;
}

kt_status kt_graph_set_loss(kt_graph *g, kt_value v)
{
    if (g == NULL)
        return kt__error(KT_EINVAL, "kt_graph_set_loss: graph is NULL");
    if (!valid_value(g, v))
        return kt__error(KT_EINVAL, "loss: not a value of this graph (id %d)", v.id);
    const kt_tensor *m = &g->values[v.id].meta;
    if (m->dtype != KT_F32 || kt_tensor_numel(m) != 1) {
        char d[96];
        return kt__error(KT_EINVAL, "loss: must be a scalar f32, got %s",
                         kt_tensor_describe(m, d, sizeof d));
    }
    if (g->values[v.id].kind != KT__VALUE_NODE)
        return kt__error(KT_EINVAL, "loss: must be computed by an op, not an input or parameter");
    g->loss = v.id;
    return KT_OK;
}

kt_status kt_graph_value_meta(const kt_graph *g, kt_value v, kt_tensor *meta_out)
{
    if (g == NULL || meta_out == NULL || !valid_value(g, v))
        return kt__error(KT_EINVAL, "kt_graph_value_meta: invalid graph or value");
    *meta_out = g->values[v.id].meta;
    return KT_OK;
}

int kt_graph_node_count(const kt_graph *g) { return g ? g->n_nodes : 0; }

int kt_graph_has_loss(const kt_graph *g) { return g != NULL && g->loss >= 0; }

kt_status kt_graph_checkpoint_begin(kt_graph *g)
{
    if (g == NULL)
        return kt__error(KT_EINVAL, "checkpoint: graph is NULL");
    if (g->open_segment >= 0)
        return kt__error(KT_EINVAL, "checkpoint: a segment is already open (from node %d); "
                         "segments do not nest", g->open_segment);
    g->open_segment = g->n_nodes;
    return KT_OK;
}

kt_status kt_graph_checkpoint_end(kt_graph *g)
{
    if (g == NULL)
        return kt__error(KT_EINVAL, "checkpoint: graph is NULL");
    if (g->open_segment < 0)
        return kt__error(KT_EINVAL, "checkpoint: no segment is open");
    KT__TRY(reserve((void **)&g->segments, &g->cap_segments, g->n_segments,
                    sizeof *g->segments));
    g->segments[g->n_segments++] = (kt__gsegment){g->open_segment, g->n_nodes};
    g->open_segment = -1;
    return KT_OK;
}

kt_status kt_graph_set_checkpoint_policy(kt_graph *g, const kt_checkpoint_policy *policy)
{
    if (g == NULL || policy == NULL)
        return kt__error(KT_EINVAL, "checkpoint policy: NULL argument");
    if ((unsigned)policy->kind > KT_CHECKPOINT_BUDGET)
        return kt__error(KT_EINVAL, "checkpoint policy: unknown kind %d", (int)policy->kind);
    if (policy->kind == KT_CHECKPOINT_EVERY_K && policy->k < 1)
        return kt__error(KT_EINVAL, "checkpoint policy: every-k needs k >= 1, got %lld",
                         (long long)policy->k);
    if (policy->kind == KT_CHECKPOINT_BUDGET && policy->budget_bytes == 0)
        return kt__error(KT_EINVAL, "checkpoint policy: the budget must be positive");
    g->policy = *policy;
    g->policy_set = 1;
    return KT_OK;
}

kt_status kt_graph_shard_input(kt_graph *g, kt_value input, int dim)
{
    if (g == NULL)
        return kt__error(KT_EINVAL, "shard: graph is NULL");
    if (!valid_value(g, input) || g->values[input.id].kind != KT__VALUE_INPUT)
        return kt__error(KT_EINVAL, "shard: value %d is not an input", input.id);
    const kt__gvalue *v = &g->values[input.id];
    if (dim < 0 || dim >= v->meta.ndim)
        return kt__error(KT_EINVAL, "shard: input '%s' has %d dimensions, dim %d does not exist",
                         kt__strings_get(&g->strings, v->name), v->meta.ndim, dim);
    while (g->cap_shard < g->n_values) {
        int32_t cap = g->cap_shard ? g->cap_shard * 2 : 64;
        int32_t *p = realloc(g->shard_dim, (size_t)cap * sizeof *p);
        if (p == NULL)
            return kt__error(KT_ENOMEM, "shard: out of memory");
        for (int32_t i = g->cap_shard; i < cap; i++)
            p[i] = -1;
        g->shard_dim = p;
        g->cap_shard = cap;
    }
    g->shard_dim[input.id] = dim;
    return KT_OK;
}

kt_status kt_graph_mark_save(kt_graph *g, kt_value v)
{
    if (g == NULL)
        return kt__error(KT_EINVAL, "save-list: graph is NULL");
    if (!valid_value(g, v) || g->values[v.id].kind != KT__VALUE_NODE)
        return kt__error(KT_EINVAL, "save-list: value %d is not computed by an op", v.id);
    g->nodes[g->values[v.id].node].must_save = 1;
    return KT_OK;
}
