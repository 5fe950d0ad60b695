/* The moe op's session hooks (ops/op_state.h): the layers of kt_session_options.moe_layers
 * are its state. Binding checks each moe node against its layer; a failed step poisons every
 * bound layer's forward cache and the next forward reports it; what the layers train (LoRA
 * adapters, f32 experts) is the session's to optimize; their experts and adapters go into
 * the session's file under the names the moe op's `names` says (kt_moe_tensor_name with the
 * op's layer: "moe.<b>.experts...", "model.layers.<b>.mlp.experts..."), with "kt.moe_layers"
 * listing the layers.
 *
 * state_recompute: a layer keeps its own intermediates for its backward, outside the plan:
 * the f32 gate and up activations, 2 k I floats a token (dsv2lite: 66 KiB, against 4 KiB of
 * its input). In a recomputed segment the checkpoint pass marks its forward step, and whoever
 * creates the layer (kt_program_moe's keep_activations, read by kt-train) creates it keeping
 * none, so that its backward recomputes them from the input it keeps. With
 * recompute_must_save and the forward cache off, gate and up then run three times (forward,
 * the clone, backward's recompute) where keeping them would run them twice: the price of the
 * layer's smaller buffers, which it holds for its whole life. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "kt/comm.h"
#include "kt/moe.h"
#include "lib/moe/trainable.h"
#include "lib/ops/moe_dist.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"

#define SPAN_NAME_BYTES 24

typedef struct moe_state {
    int retained; /* the layers hold a reference of this session's (see unbind_moe) */
    const kt__op_node *nodes;
    int n_nodes;
    kt_moe *const *layers;
    int n_layers;
    int n_spans;
    int *span_layer; /* per span: the layer it trains */
    char *span_names; /* SPAN_NAME_BYTES each: "moe.<b>" */
    char *rows;       /* several ranks: the rows this rank runs for the others (moe_dist.h) */
    size_t rows_bytes;
    kt__moe_placement **placement; /* per layer, expert parallelism: made at first use */
    int choice;                    /* kt_session_options.moe_parallel */
} moe_state;

/* An op's mode: its `parallel`, unless the session chooses for every op. */
static kt_moe_parallel mode_of(int choice, const kt_op_attrs *at)
{
    return choice == KT_MOE_PARALLEL_ALL_EP      ? KT_MOE_PARALLEL_EP
           : choice == KT_MOE_PARALLEL_ALL_RANK0 ? KT_MOE_PARALLEL_RANK0
                                                 : at->moe_parallel;
}

/* The mode of binding b's moe op (rank 0's when no op runs it). */
static kt_moe_parallel parallel_of(const kt__op_node *nodes, int n, int choice, int b)
{
    for (int i = 0; i < n; i++)
        if (nodes[i].attrs->binding == b)
            return mode_of(choice, nodes[i].attrs);
    return KT_MOE_PARALLEL_RANK0;
}

static int any_ep(const kt__op_node *nodes, int n, int choice)
{
    for (int i = 0; i < n; i++)
        if (mode_of(choice, nodes[i].attrs) == KT_MOE_PARALLEL_EP)
            return 1;
    return 0;
}

/* Every moe node has a layer that fits it, and each layer serves one moe node. */
static kt_status check_nodes(const kt__op_bind *bd)
{
    const int several = bd->comm != NULL && kt_comm_size(bd->comm) > 1;
    kt_moe *const *layers = (kt_moe *const *)bd->bindings;
    for (int i = 0; i < bd->n_nodes; i++) {
        const kt__op_node *nd = &bd->nodes[i];
        int b = nd->attrs->binding;
        const int ep = several && mode_of(bd->moe_parallel, nd->attrs) == KT_MOE_PARALLEL_EP;
        const int held = b < bd->n_bindings && layers != NULL && layers[b] != NULL;
        if (several && !ep && kt_comm_rank(bd->comm) != 0)
            continue; /* rank 0 owns the experts */
        if (ep && !held)
            continue; /* a rank may hold none of an expert-parallel layer's experts */
        if (!held)
            return kt__error(KT_EINVAL, "session: moe node '%s' runs MoE layer %d, but %d "
                             "layer%s given (kt_session_options.moe_layers)", nd->name, b,
                             bd->n_bindings, bd->n_bindings == 1 ? " is" : "s are");
        for (int o = 0; o < i; o++)
            if (bd->nodes[o].attrs->binding == b)
                return kt__error(KT_EINVAL, "session: moe node '%s' (step %d) runs MoE layer "
                                 "%d, which moe node '%s' (step %d) runs already; each layer "
                                 "keeps one forward for its backward: give each moe op a "
                                 "layer of its own", nd->name, nd->step, b, bd->nodes[o].name,
                                 bd->nodes[o].step);
        const kt_moe_config *cfg = kt_moe_get_config(layers[b]);
        const kt_tensor *x = &nd->in[0], *ids = &nd->in[1];
        const int64_t inter = nd->attrs->moe_intermediate;
        if (inter > 0 && cfg->intermediate != inter)
            return kt__error(KT_EINVAL, "session: moe node '%s' is written for experts of "
                             "intermediate size %lld, but MoE layer %d has %lld", nd->name,
                             (long long)inter, b, (long long)cfg->intermediate);
        /* ranks may bring different row counts: the ranks' rows together are checked
         * against max_tokens at each call; an expert-parallel share runs single pairs */
        const int64_t k = ep ? 1 : ids->shape[1];
        if (cfg->hidden != x->shape[1] || cfg->top_k != k ||
            cfg->max_tokens < (ep ? 0 : x->shape[0]) || cfg->act_dtype != x->dtype)
            return kt__error(KT_EINVAL, "session: moe node '%s'%s (x %s[%lld,%lld], k=%lld) does "
                             "not fit MoE layer %d (H=%lld, k=%lld, max_tokens=%lld, act %s)",
                             ep ? " (expert parallel: its layers' top_k is 1)" : "",
                             nd->name, kt_dtype_name(x->dtype), (long long)x->shape[0],
                             (long long)x->shape[1], (long long)ids->shape[1], b,
                             (long long)cfg->hidden, (long long)cfg->top_k,
                             (long long)cfg->max_tokens, kt_dtype_name(cfg->act_dtype));
    }
    return KT_OK;
}

static void unbind_moe(void *state)
{
    moe_state *m = state;
    if (m == NULL)
        return;
    for (int b = 0; m->retained && b < m->n_layers; b++)
        kt_moe_destroy(m->layers[b]); /* drops the session's reference; the last one frees */
    for (int b = 0; m->placement != NULL && b < m->n_layers; b++)
        if (m->placement[b] != NULL) {
            free(m->placement[b]->owner);
            free(m->placement[b]->local);
            free(m->placement[b]);
        }
    free(m->placement);
    free(m->rows);
    free(m->span_layer);
    free(m->span_names);
    free(m);
}

static kt_status bind_moe(const kt__op_bind *bd, void **state_out)
{
    *state_out = NULL;
    KT__TRY(check_nodes(bd));
    int any = 0;
    for (int b = 0; b < bd->n_bindings && bd->bindings != NULL; b++)
        any |= bd->bindings[b] != NULL;
    if (bd->n_nodes == 0 && !any)
        return KT_OK;
    moe_state *m = calloc(1, sizeof *m);
    int n = bd->n_bindings > 0 ? bd->n_bindings : 0;
    if (m == NULL || (m->span_layer = calloc((size_t)n + 1, sizeof(int))) == NULL ||
        (m->span_names = calloc((size_t)n + 1, SPAN_NAME_BYTES)) == NULL) {
        unbind_moe(m);
        return kt__error(KT_ENOMEM, "session: out of memory");
    }
    m->nodes = bd->nodes;
    m->n_nodes = bd->n_nodes;
    m->choice = bd->moe_parallel;
    m->layers = (kt_moe *const *)bd->bindings;
    m->n_layers = bd->bindings != NULL ? n : 0;
    for (int b = 0; b < m->n_layers; b++) {
        kt_moe *l = m->layers[b];
        if (l == NULL)
            continue;
        float *param, *grad;
        int64_t count = kt__moe_trainable(l, &param, &grad);
        if (count < 0) {
            const char *name = kt_moe_get_config(l)->name;
            unbind_moe(m);
            return kt__error(KT_EUNSUPPORTED, "session: MoE layer %d ('%s') trains bf16 expert "
                             "weights, which need f32 master copies: use f32 weights or LoRA",
                             b, name ? name : "");
        }
        if (count == 0)
            continue;
        snprintf(m->span_names + (size_t)m->n_spans * SPAN_NAME_BYTES, SPAN_NAME_BYTES, "moe.%d",
                 b);
        m->span_layer[m->n_spans++] = b;
    }
    /* several ranks: the rows this rank runs for the others, sized for its largest layer */
    const int several = bd->comm != NULL && kt_comm_size(bd->comm) > 1;
    for (int b = 0; several && b < m->n_layers; b++) {
        if (m->layers[b] == NULL)
            continue;
        const kt_moe_config *cfg = kt_moe_get_config(m->layers[b]);
        size_t need = parallel_of(bd->nodes, bd->n_nodes, bd->moe_parallel, b) ==
                              KT_MOE_PARALLEL_EP
                          ? kt__moe_ep_rows_bytes(cfg)
                          : kt__moe_rank0_rows_bytes(cfg);
        m->rows_bytes = need > m->rows_bytes ? need : m->rows_bytes;
    }
    if (several && m->n_nodes > 0 && m->rows_bytes < 4096)
        m->rows_bytes = 4096; /* a rank running no rows still carves its (empty) tensors */
    if ((m->rows_bytes > 0 && posix_memalign((void **)&m->rows, 64, m->rows_bytes) != 0) ||
        (several && any_ep(bd->nodes, bd->n_nodes, bd->moe_parallel) &&
         (m->placement = calloc((size_t)m->n_layers + 1, sizeof *m->placement)) == NULL)) {
        m->rows = NULL;
        unbind_moe(m);
        return kt__error(KT_ENOMEM, "session: out of memory for the MoE layers' exchange "
                         "buffers");
    }
    /* the session keeps its layers alive: kt_moe_destroy before kt_session_destroy is safe */
    for (int b = 0; b < m->n_layers; b++)
        if (m->layers[b] != NULL)
            kt__moe_retain(m->layers[b]);
    m->retained = 1;
    *state_out = m;
    return KT_OK;
}

static int64_t span_floats_moe(const kt__op_bind *bd)
{
    int64_t total = 0;
    for (int b = 0; b < bd->n_bindings && bd->bindings != NULL; b++) {
        float *param, *grad;
        int64_t n = bd->bindings[b] != NULL ? kt__moe_trainable(bd->bindings[b], &param, &grad)
                                            : 0;
        total += n > 0 ? n : 0;
    }
    return total;
}

static int spans_moe(void *state, kt__op_span *out, int cap)
{
    const moe_state *m = state;
    for (int i = 0; i < m->n_spans && i < cap && out != NULL; i++) {
        out[i].n = kt__moe_trainable(m->layers[m->span_layer[i]], &out[i].param, &out[i].grad);
        out[i].name = m->span_names + (size_t)i * SPAN_NAME_BYTES;
    }
    return m->n_spans;
}

kt_moe *kt__moe_bound(const kt__op_call *c)
{
    int b = c->attrs->binding;
    return c->bindings != NULL && b >= 0 && b < c->n_bindings ? c->bindings[b] : NULL;
}

kt_status kt__moe_rows(const kt__op_call *c, size_t need, char **out)
{
    const moe_state *m = c->state;
    if (m == NULL || m->rows == NULL || need > m->rows_bytes)
        return kt__error(KT_ERANGE, "moe: rank %d needs %zu bytes for the rows it runs for the "
                         "ranks, its MoE layers' buffers hold %zu", kt_comm_rank(c->comm), need,
                         m ? m->rows_bytes : 0);
    *out = m->rows;
    return KT_OK;
}

kt_moe_parallel kt__moe_mode(const kt__op_call *c)
{
    const moe_state *m = c->state;
    return mode_of(m ? m->choice : KT_MOE_PARALLEL_PROGRAM, c->attrs);
}

kt__moe_placement **kt__moe_placement_slot(void *state, int binding)
{
    moe_state *m = state;
    if (m == NULL || m->placement == NULL || binding < 0 || binding >= m->n_layers)
        return NULL;
    return &m->placement[binding];
}

/* A poisoned cache is reported once, naming the layer, and cleared (with those after it). */
static kt_status forward_begin_moe(void *state, int report)
{
    const moe_state *m = state;
    for (int i = 0; i < m->n_layers; i++) {
        kt_moe *l = m->layers[i];
        if (l == NULL || kt_moe_cache_get_state(l) != KT_MOE_CACHE_POISONED)
            continue;
        kt_status st = report ? kt__moe_session_check(l, "forward") : KT_OK;
        for (int k = i; k < m->n_layers; k++)
            if (m->layers[k] != NULL)
                kt_moe_cache_clear(m->layers[k]);
        return st;
    }
    return KT_OK;
}

/* A new accumulation: the layers' weight gradients start over. */
static void backward_begin_moe(void *state)
{
    const moe_state *m = state;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i] != NULL)
            kt_moe_zero_grad(m->layers[i]);
}

/* A failed step may leave a layer's cached forward output stale: poison every bound layer's
 * cache, so it can never be reused (the failure's message is kept). */
static void poison_moe(void *state)
{
    const moe_state *m = state;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i] != NULL)
            kt__moe_session_poison(m->layers[i]);
}

/* How layer b's tensors are named in the session's file: by its moe op's `names` (a layer no
 * op runs keeps the moe scheme). */
static kt__moe_naming naming_of(const moe_state *m, int b)
{
    kt__moe_naming nm = {.prefix = NULL, .names = KT_MOE_NAMES_MOE, .layer = b};
    for (int i = 0; i < m->n_nodes; i++)
        if (m->nodes[i].attrs->binding == b)
            nm.names = m->nodes[i].attrs->moe_names;
    return nm;
}

static size_t save_count_moe(void *state, size_t *name_bytes)
{
    const moe_state *m = state;
    size_t n = 0;
    for (int b = 0; b < m->n_layers; b++)
        if (m->layers[b] != NULL)
            n += kt__moe_st_count(m->layers[b]);
    *name_bytes = n * KT__MOE_NAME_BYTES;
    return n;
}

static kt_status save_items_moe(void *state, kt_st_item *items, char *names)
{
    const moe_state *m = state;
    size_t at = 0;
    for (int b = 0; b < m->n_layers; b++) {
        const kt_moe *l = m->layers[b];
        if (l == NULL)
            continue;
        kt__moe_naming nm = naming_of(m, b);
        KT__TRY(kt__moe_st_items(l, &nm, items + at, names + at * KT__MOE_NAME_BYTES));
        at += kt__moe_st_count(l);
    }
    return KT_OK;
}

/* The layers the file holds, e.g. "0,2". */
static kt_status save_meta_moe(void *state, char *value, size_t cap)
{
    const moe_state *m = state;
    size_t len = 0;
    value[0] = '\0';
    for (int b = 0; b < m->n_layers; b++) {
        if (m->layers[b] == NULL)
            continue;
        len += (size_t)snprintf(value + len, cap - len, "%s%d", len ? "," : "", b);
        if (len >= cap)
            return kt__error(KT_EINVAL, "save: too many MoE layers to list");
    }
    return KT_OK;
}

/* Whether `name` starts with the experts' names of a layer one of the program's moe ops runs
 * (under that op's names); the layer in *layer_out. */
static int names_op_layer(const moe_state *m, const char *name, int *layer_out)
{
    for (int i = 0; i < m->n_nodes; i++) {
        const kt_op_attrs *at = m->nodes[i].attrs;
        char prefix[128];
        if (kt__moe_names_prefix(at->moe_names, at->binding, prefix, sizeof prefix) != KT_OK)
            continue;
        if (strncmp(name, prefix, strlen(prefix)) == 0) {
            *layer_out = at->binding;
            return 1;
        }
    }
    kt_clear_error();
    return 0;
}

/* Whether the file holds MoE experts: a session saved with its layers, or a checkpoint with a
 * tensor under one of the moe ops' names (a file of parameters alone, as saved before
 * sessions saved their layers, leaves them as they are). */
static int file_holds_moe(void *state, const kt_st_file *f)
{
    const moe_state *m = state;
    if (kt_st_metadata(f, "kt.moe_layers") != NULL)
        return 1;
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name = NULL;
        int layer;
        /* no view: a checkpoint's F64 or F8 tensors have none, and only the name counts */
        if (kt_st_entry(f, i, &name, NULL) == KT_OK &&
            (strncmp(name, "moe.", 4) == 0 || names_op_layer(m, name, &layer)))
            return 1;
    }
    return 0;
}

/* Every bound layer's, whole, under its op's names. */
static kt_status load_moe(void *state, const kt_st_file *f, int dry_run, const char *path)
{
    const moe_state *m = state;
    for (int b = 0; b < m->n_layers; b++) {
        kt_moe *l = m->layers[b];
        if (l == NULL)
            continue;
        kt__moe_naming nm = naming_of(m, b);
        kt_status st = kt__moe_load_named(l, f, &nm, dry_run);
        if (st != KT_OK)
            return kt__error_context(st, "%s: MoE layer %d", path, b);
    }
    return KT_OK;
}

/* A tensor of a layer the program runs: one of its experts' (or adapters') under its op's
 * names (exactly, where this rank holds the layer: expert < E, adapters in LoRA mode; by the
 * names' start elsewhere), or, with an optimizer prefix, "moe.<b>" (the span). */
static int knows_moe(void *state, const char *name, int is_state)
{
    const moe_state *m = state;
    int b = -1, used = -1;
    if (names_op_layer(m, name, &b)) {
        /* an expert-parallel share knows its own experts; the others' are other ranks' */
        if (b >= m->n_layers || m->layers[b] == NULL ||
            parallel_of(m->nodes, m->n_nodes, m->choice, b) == KT_MOE_PARALLEL_EP)
            return 1;
        kt__moe_naming nm = naming_of(m, b);
        return kt__moe_names_tensor(m->layers[b], &nm, name);
    }
    if (!is_state || sscanf(name, "moe.%d%n", &b, &used) != 1 || b < 0 || name[used] != '\0')
        return 0;
    int runs = 0;
    for (int i = 0; i < m->n_nodes; i++)
        runs |= m->nodes[i].attrs->binding == b;
    return runs;
}

const kt__op_state kt__moe_state = {
    .state_recompute = 1, .spans_sharded = 1,
    .bind = bind_moe, .unbind = unbind_moe, .span_floats = span_floats_moe, .spans = spans_moe,
    .forward_begin = forward_begin_moe, .backward_begin = backward_begin_moe,
    .poison = poison_moe,
    .save_count = save_count_moe, .save_items = save_items_moe,
    .meta_key = "kt.moe_layers", .save_meta = save_meta_moe,
    .file_holds = file_holds_moe, .load = load_moe, .knows = knows_moe};
