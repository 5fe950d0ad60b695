/* Saving and loading a session as one safetensors file: the parameters, the experts (and
 * LoRA adapters) of the MoE layers bound to it, and with the optimizer state that of both.
 * One file is one unit: it is written whole or not at all (kt_st_save), and a load checks
 * every tensor it would read before it changes any, so parameters never meet the experts of
 * another save. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "graph/runtime/session_internal.h"
#include "kt/io.h"
#include "moe/trainable.h"

#define NAME_BYTES 160

/* The metadata key listing the MoE layers a file holds, e.g. "0,2" */
#define MOE_LAYERS_KEY "kt.moe_layers"

static const char *const state_prefix[2][2] = {
    {"optimizer.momentum.", NULL}, /* SGD */
    {"optimizer.m.", "optimizer.v."} /* AdamW */};

static int n_states(const kt_session *s) { return (s->opt_state[0] != NULL) + (s->opt_state[1] != NULL); }

static int adamw(const kt_session *s) { return s->opt.optimizer.kind == KT_OPTIM_ADAMW; }

/* The optimizer state k of a trainable parameter entry, as a tensor. */
static kt_tensor state_tensor(const kt_session *s, const kt__pentry *e, int k)
{
    const kt__pbuf *gb = &s->p->bufs[e->grad_buf];
    kt_tensor t = gb->meta;
    t.data = (unsigned char *)s->opt_state[k] + gb->offset;
    return t;
}

/* The optimizer state k of a MoE layer's trainable values, one flat f32 tensor. */
static kt_tensor moe_state_tensor(const kt__moe_train *t, int k)
{
    kt_tensor v;
    kt_tensor_init(&v, t->state[k], KT_F32, 1, (int64_t[]){t->n});
    return v;
}

static kt_moe *bound_layer(const kt_session *s, int b)
{
    return s->opt.moe_layers != NULL && b < s->opt.n_moe_layers ? s->opt.moe_layers[b] : NULL;
}

/* ---- saving ------------------------------------------------------------------------------ */

typedef struct unit_list {
    kt_st_item *items;
    char *names; /* NAME_BYTES each, for the optimizer-state names */
    char *moe_names; /* KT__MOE_NAME_BYTES each */
    size_t n, n_moe_names;
} unit_list;

static size_t count_items(const kt_session *s, int states, size_t *moe_items)
{
    size_t n = (size_t)s->p->n_entries[KT_ROLE_PARAM] * (1 + (size_t)states);
    *moe_items = 0;
    for (int b = 0; b < s->opt.n_moe_layers; b++)
        if (bound_layer(s, b) != NULL)
            *moe_items += kt__moe_st_count(bound_layer(s, b));
    return n + *moe_items + (size_t)s->n_moe_train * (size_t)states;
}

static kt_status list_items(const kt_session *s, int states, unit_list *u, char *layers_meta,
                            size_t meta_size)
{
    const int kind = adamw(s);
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        u->items[u->n++] = (kt_st_item){kt__strings_get(&s->p->strings, e->name), s->tensors[e->buf]};
    }
    size_t at = 0;
    for (int k = 0; k < states; k++)
        for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
            const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
            if (e->grad_buf < 0)
                continue;
            char *name = u->names + at++ * NAME_BYTES;
            snprintf(name, NAME_BYTES, "%s%s", state_prefix[kind][k],
                     kt__strings_get(&s->p->strings, e->name));
            u->items[u->n++] = (kt_st_item){name, state_tensor(s, e, k)};
        }
    size_t moe_at = 0, meta_len = 0;
    layers_meta[0] = '\0';
    for (int b = 0; b < s->opt.n_moe_layers; b++) {
        const kt_moe *m = bound_layer(s, b);
        if (m == NULL)
            continue;
        char prefix[32];
        snprintf(prefix, sizeof prefix, "moe.%d.", b);
        KT__TRY(kt__moe_st_items(m, prefix, u->items + u->n, u->moe_names + moe_at * KT__MOE_NAME_BYTES));
        u->n += kt__moe_st_count(m);
        moe_at += kt__moe_st_count(m);
        meta_len += (size_t)snprintf(layers_meta + meta_len, meta_size - meta_len, "%s%d",
                                     meta_len ? "," : "", b);
        if (meta_len >= meta_size)
            return kt__error(KT_EINVAL, "save: too many MoE layers to list");
    }
    for (int k = 0; k < states; k++)
        for (int i = 0; i < s->n_moe_train; i++) {
            char *name = u->names + at++ * NAME_BYTES;
            snprintf(name, NAME_BYTES, "%smoe.%d", state_prefix[kind][k], s->moe_train[i].binding);
            u->items[u->n++] = (kt_st_item){name, moe_state_tensor(&s->moe_train[i], k)};
        }
    return KT_OK;
}

kt_status kt_session_save(kt_session *s, const char *path, int with_optimizer)
{
    if (s == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_session_save: NULL argument");
    const int states = with_optimizer ? n_states(s) : 0;
    size_t moe_items, cap = count_items(s, states, &moe_items);
    unit_list u = {.items = calloc(cap + 1, sizeof *u.items),
                   .names = calloc(cap + 1, NAME_BYTES),
                   .moe_names = calloc(moe_items + 1, KT__MOE_NAME_BYTES)};
    char *layers_meta = malloc(8 * (size_t)s->opt.n_moe_layers + 16);
    kt_status status = KT_OK;
    if (u.items == NULL || u.names == NULL || u.moe_names == NULL || layers_meta == NULL) {
        status = kt__error(KT_ENOMEM, "save: out of memory");
        goto out;
    }
    if ((status = list_items(s, states, &u, layers_meta, 8 * (size_t)s->opt.n_moe_layers + 16)) !=
        KT_OK)
        goto out;
    char step[32];
    snprintf(step, sizeof step, "%lld", (long long)s->steps_done);
    const char *meta[8];
    int m = 0;
    if (with_optimizer) {
        meta[m++] = "kt.step", meta[m++] = step;
        meta[m++] = "kt.optimizer", meta[m++] = adamw(s) ? "adamw" : "sgd";
    }
    if (layers_meta[0] != '\0')
        meta[m++] = MOE_LAYERS_KEY, meta[m++] = layers_meta;
    meta[m] = NULL;
    status = kt_st_save(path, u.items, u.n, m > 0 ? meta : NULL);
out:
    free(u.items);
    free(u.names);
    free(u.moe_names);
    free(layers_meta);
    return status;
}

/* ---- loading ----------------------------------------------------------------------------- */

/* Checks (dry_run) or copies one tensor of the file into dst. */
static kt_status load_one(const kt_st_file *f, const char *name, kt_tensor *dst, int dry_run,
                          int allow_missing, const char *path)
{
    kt_tensor view;
    if (kt_st_find(f, name, &view) != KT_OK) {
        if (allow_missing)
            return KT_OK;
        return kt__error(KT_EINVAL, "%s: no tensor named '%s' (the program needs it)", path, name);
    }
    if (view.dtype != dst->dtype || !kt_tensor_same_shape(&view, dst)) {
        char a[96], b[96];
        return kt__error(KT_EINVAL, "%s: tensor '%s' is %s, the program needs %s", path, name,
                         kt_tensor_describe(&view, a, sizeof a),
                         kt_tensor_describe(dst, b, sizeof b));
    }
    return dry_run ? KT_OK : kt_st_read(f, name, dst);
}

static kt_status load_params(kt_session *s, const kt_st_file *f, unsigned flags, int dry_run,
                             const char *path)
{
    const int allow = (flags & KT_LOAD_ALLOW_MISSING) != 0;
    const int kind = adamw(s);
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        const char *pname = kt__strings_get(&s->p->strings, e->name);
        KT__TRY(load_one(f, pname, &s->tensors[e->buf], dry_run, allow, path));
        if (e->grad_buf < 0 || (!dry_run && !(flags & KT_LOAD_OPTIMIZER)))
            continue;
        /* state in the file is checked even when not loaded: a file is good whole or not */
        for (int k = 0; k < n_states(s); k++) {
            char name[NAME_BYTES];
            snprintf(name, sizeof name, "%s%s", state_prefix[kind][k], pname);
            kt_tensor t = state_tensor(s, e, k);
            KT__TRY(load_one(f, name, &t, dry_run, !(flags & KT_LOAD_OPTIMIZER), path));
        }
    }
    return KT_OK;
}

/* The bound MoE layers, when the file holds experts: every layer's, whole (a file of
 * parameters alone, as saved before sessions saved their layers, leaves them as they are). */
static kt_status load_layers(kt_session *s, const kt_st_file *f, unsigned flags, int dry_run,
                             const char *path)
{
    const int kind = adamw(s);
    for (int b = 0; b < s->opt.n_moe_layers; b++) {
        kt_moe *m = bound_layer(s, b);
        if (m == NULL)
            continue;
        char prefix[32];
        snprintf(prefix, sizeof prefix, "moe.%d.", b);
        kt_status st = dry_run ? kt__moe_load_check(m, f, prefix) : kt_moe_load(m, f, prefix);
        if (st != KT_OK)
            return kt__error_context(st, "%s: MoE layer %d", path, b);
    }
    if (!dry_run && !(flags & KT_LOAD_OPTIMIZER))
        return KT_OK;
    for (int k = 0; k < n_states(s); k++) /* checked when present, as load_params does */
        for (int i = 0; i < s->n_moe_train; i++) {
            char name[NAME_BYTES];
            snprintf(name, sizeof name, "%smoe.%d", state_prefix[kind][k], s->moe_train[i].binding);
            kt_tensor t = moe_state_tensor(&s->moe_train[i], k);
            KT__TRY(load_one(f, name, &t, dry_run, !(flags & KT_LOAD_OPTIMIZER), path));
        }
    return KT_OK;
}

/* Whether the program runs MoE layer b (whether or not this rank holds it). */
static int program_layer(const kt_session *s, int b)
{
    for (int32_t at = 0; at < s->p->n_forward; at++)
        if (s->p->steps[at].op == KT_OP_MOE && s->p->steps[at].attrs.binding == b)
            return 1;
    return 0;
}

/* Whether `name` is a parameter of the program, a tensor of one of its MoE layers
 * ("moe.<b>.experts..."), or an optimizer state of either (under any optimizer's prefix: a
 * checkpoint saved with state loads as weights alone too). */
static int known_name(const kt_session *s, const char *name)
{
    const char *pname = name;
    for (int kind = 0; kind < 2; kind++)
        for (int k = 0; k < 2; k++) {
            const char *pre = state_prefix[kind][k];
            if (pre != NULL && strncmp(name, pre, strlen(pre)) == 0)
                pname = name + strlen(pre);
        }
    int b = -1, used = -1;
    if (sscanf(pname, "moe.%d%n", &b, &used) == 1 && b >= 0 && program_layer(s, b) &&
        (pname[used] == '\0' ? pname != name : strncmp(pname + used, ".experts.", 9) == 0))
        return 1;
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        if (strcmp(pname, kt__strings_get(&s->p->strings, e->name)) == 0)
            return 1;
    }
    return 0;
}

/* Unless KT_LOAD_ALLOW_UNUSED: every tensor of the file is one the program has, so that a
 * checkpoint of another model (more layers, other names) is refused instead of loaded in
 * part. A layer's own loader refuses experts it does not have. */
static kt_status check_unused(const kt_session *s, const kt_st_file *f, unsigned flags,
                              const char *path)
{
    if (flags & KT_LOAD_ALLOW_UNUSED)
        return KT_OK;
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name = NULL;
        kt_tensor view;
        KT__TRY(kt_st_entry(f, i, &name, &view));
        if (!known_name(s, name))
            return kt__error(KT_EINVAL, "%s: tensor '%s' is not a parameter of the program (a "
                             "checkpoint of another model?)", path, name);
    }
    return KT_OK;
}

/* Whether the file holds MoE experts (a session saved with its layers). */
static int holds_layers(const kt_st_file *f)
{
    if (kt_st_metadata(f, MOE_LAYERS_KEY) != NULL)
        return 1;
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name = NULL;
        kt_tensor view;
        if (kt_st_entry(f, i, &name, &view) == KT_OK && strncmp(name, "moe.", 4) == 0)
            return 1;
    }
    return 0;
}

kt_status kt_session_load(kt_session *s, const char *path, unsigned flags)
{
    if (s == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_session_load: NULL argument");
    kt_st_file *f;
    KT__TRY(kt_st_open(path, &f));
    long long step = 0;
    kt_status status = KT_OK;
    if (flags & KT_LOAD_OPTIMIZER) {
        const char *v = kt_st_metadata(f, "kt.step");
        char *end = NULL;
        if (v != NULL)
            step = strtoll(v, &end, 10);
        if (v == NULL || *end != '\0' || step < 0) {
            status = kt__error(KT_EFORMAT, "%s: no valid 'kt.step' in the metadata: not a file "
                               "saved with optimizer state", path);
            goto out;
        }
    }
    const int layers = holds_layers(f);
    /* check everything first, so a bad file changes nothing */
    for (int dry = 1; dry >= 0 && status == KT_OK; dry--) {
        if (dry && (status = check_unused(s, f, flags, path)) != KT_OK)
            break;
        if ((status = load_params(s, f, flags, dry, path)) == KT_OK && layers)
            status = load_layers(s, f, flags, dry, path);
    }
    if (status == KT_OK && (flags & KT_LOAD_OPTIMIZER))
        s->steps_done = step;
out:
    kt_st_close(f);
    return status;
}
