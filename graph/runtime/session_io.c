/* Saving and loading a session as one safetensors file: the parameters, the state of its
 * stateful ops (their save hooks' items and metadata), and with the optimizer state that of
 * both.
 * One file is one unit: it is written whole or not at all (kt_st_save), and a load checks
 * every tensor it would read before it changes any, so parameters never meet the op state of
 * another save. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/runtime/session_internal.h"
#include "kt/io.h"

#define NAME_BYTES 160
#define META_BYTES 1024 /* a stateful op's metadata value */
#define MAX_META 4      /* metadata pairs besides the step and the optimizer */

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

/* The optimizer state k of a stateful op's span, one flat f32 tensor. */
static kt_tensor span_state_tensor(const kt__state_span *t, int k)
{
    kt_tensor v;
    kt_tensor_init(&v, t->state[k], KT_F32, 1, (int64_t[]){t->n});
    return v;
}

/* ---- saving ------------------------------------------------------------------------------ */

typedef struct unit_list {
    kt_st_item *items;
    char *names; /* NAME_BYTES each, for the optimizer-state names */
    char *op_names; /* the stateful ops' names, each op's save_count bytes */
    size_t n;
} unit_list;

static size_t count_items(const kt_session *s, int states, size_t *name_bytes)
{
    size_t n = (size_t)s->p->n_entries[KT_ROLE_PARAM] * (1 + (size_t)states);
    *name_bytes = 0;
    for (int e = 0; e < s->n_stateful; e++) {
        const kt__stateful *st = &s->stateful[e];
        size_t bytes = 0;
        if (st->hooks->save_count != NULL)
            n += st->hooks->save_count(st->state, &bytes);
        *name_bytes += bytes;
        n += (size_t)st->n_spans * (size_t)states;
    }
    return n;
}

static kt_status list_items(const kt_session *s, int states, unit_list *u)
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
    char *names = u->op_names;
    for (int e = 0; e < s->n_stateful; e++) {
        const kt__stateful *st = &s->stateful[e];
        if (st->hooks->save_count == NULL)
            continue;
        size_t bytes = 0, n = st->hooks->save_count(st->state, &bytes);
        KT__TRY(st->hooks->save_items(st->state, u->items + u->n, names));
        u->n += n;
        names += bytes;
    }
    for (int k = 0; k < states; k++)
        for (int e = 0; e < s->n_stateful; e++)
            for (int i = 0; i < s->stateful[e].n_spans; i++) {
                const kt__state_span *t = &s->stateful[e].spans[i];
                char *name = u->names + at++ * NAME_BYTES;
                snprintf(name, NAME_BYTES, "%s%s", state_prefix[kind][k], t->name);
                u->items[u->n++] = (kt_st_item){name, span_state_tensor(t, k)};
            }
    return KT_OK;
}

/* The stateful ops' metadata pairs into meta from *m on (values in values, META_BYTES each). */
static kt_status list_meta(const kt_session *s, const char **meta, int *m, char *values)
{
    int pairs = 0;
    for (int e = 0; e < s->n_stateful; e++) {
        const kt__stateful *st = &s->stateful[e];
        if (st->hooks->save_meta == NULL)
            continue;
        if (pairs == MAX_META)
            return kt__error(KT_EINTERNAL, "save: more than %d stateful ops with metadata",
                             MAX_META);
        char *v = values + (size_t)pairs * META_BYTES;
        KT__TRY(st->hooks->save_meta(st->state, v, META_BYTES));
        if (v[0] == '\0')
            continue;
        meta[(*m)++] = st->hooks->meta_key, meta[(*m)++] = v;
        pairs++;
    }
    return KT_OK;
}

kt_status kt_session_save(kt_session *s, const char *path, int with_optimizer)
{
    if (s == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_session_save: NULL argument");
    KT__TRY(kt__session_fault_save(s));
    const int states = with_optimizer ? n_states(s) : 0;
    size_t name_bytes, cap = count_items(s, states, &name_bytes);
    unit_list u = {.items = calloc(cap + 1, sizeof *u.items),
                   .names = calloc(cap + 1, NAME_BYTES),
                   .op_names = calloc(name_bytes + 1, 1)};
    char *values = malloc((size_t)MAX_META * META_BYTES);
    kt_status status = KT_OK;
    if (u.items == NULL || u.names == NULL || u.op_names == NULL || values == NULL) {
        status = kt__error(KT_ENOMEM, "save: out of memory");
        goto out;
    }
    if ((status = list_items(s, states, &u)) != KT_OK)
        goto out;
    char step[32];
    snprintf(step, sizeof step, "%lld", (long long)s->steps_done);
    const char *meta[2 * MAX_META + 6];
    int m = 0;
    if (with_optimizer) {
        meta[m++] = "kt.step", meta[m++] = step;
        meta[m++] = "kt.optimizer", meta[m++] = adamw(s)                                         ? "adamw"
                                       : s->opt.optimizer.kind == KT_OPTIM_NONE ? "none"
                                                                                : "sgd";
    }
    if ((status = list_meta(s, meta, &m, values)) != KT_OK)
        goto out;
    meta[m] = NULL;
    status = kt_st_save(path, u.items, u.n, m > 0 ? meta : NULL);
out:
    free(u.items);
    free(u.names);
    free(u.op_names);
    free(values);
    return status;
}

/* ---- loading ----------------------------------------------------------------------------- */

/* Checks (dry_run) or copies one tensor of the file into dst, converting between float
 * dtypes (a bf16 checkpoint into f32 master weights, an f32 one into a bf16 frozen base). */
static kt_status load_one(const kt_st_file *f, const char *name, kt_tensor *dst, int dry_run,
                          int allow_missing, const char *path)
{
    size_t at;
    if (kt_st_lookup(f, name, &at) != KT_OK) {
        kt_clear_error();
        if (allow_missing)
            return KT_OK;
        return kt__error(KT_EINVAL, "%s: no tensor named '%s' (the program needs it)", path, name);
    }
    return dry_run ? kt_st_check_convert(f, name, dst) : kt_st_read_convert(f, name, dst);
}

static kt_status load_params(kt_session *s, const kt_st_file *f, unsigned flags, int dry_run,
                             const char *path)
{
    const int kind = adamw(s);
    int marks_loaded = 0; /* the program says which parameters a checkpoint holds */
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++)
        marks_loaded |= s->p->entries[KT_ROLE_PARAM][i].init.kind == KT_INIT_LOADED;
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        const char *pname = kt__strings_get(&s->p->strings, e->name);
        const int allow = (flags & KT_LOAD_ALLOW_MISSING) != 0 ||
                          ((flags & KT_LOAD_ALLOW_INITIALISED) != 0 && marks_loaded &&
                           e->init.kind != KT_INIT_LOADED);
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

/* A stateful op's state, when the file holds it (else it is left as it is), and with it the
 * optimizer state of its spans. */
static kt_status load_op_state(kt_session *s, const kt__stateful *st, const kt_st_file *f,
                               unsigned flags, int dry_run, const char *path)
{
    const int kind = adamw(s);
    if (st->hooks->file_holds == NULL || !st->hooks->file_holds(st->state, f))
        return KT_OK;
    if (st->hooks->load != NULL)
        KT__TRY(st->hooks->load(st->state, f, dry_run, path));
    /* Without the optimizer, the spans' state is not checked either: its size is the training
     * mode's (a full run's experts, a LoRA run's adapters), so a LoRA fine-tune may start from
     * a full run's checkpoint. */
    if (!(flags & KT_LOAD_OPTIMIZER))
        return KT_OK;
    for (int k = 0; k < n_states(s); k++) /* checked when present, as load_params does */
        for (int i = 0; i < st->n_spans; i++) {
            char name[NAME_BYTES];
            snprintf(name, sizeof name, "%s%s", state_prefix[kind][k], st->spans[i].name);
            kt_tensor t = span_state_tensor(&st->spans[i], k);
            KT__TRY(load_one(f, name, &t, dry_run, !(flags & KT_LOAD_OPTIMIZER), path));
        }
    return KT_OK;
}

/* Whether `name` is a parameter of the program, a tensor of one of its stateful ops (its
 * knows hook), or an optimizer state of either (under any optimizer's prefix: a checkpoint
 * saved with state loads as weights alone too). */
static int known_name(const kt_session *s, const char *name)
{
    const char *pname = name;
    for (int kind = 0; kind < 2; kind++)
        for (int k = 0; k < 2; k++) {
            const char *pre = state_prefix[kind][k];
            if (pre != NULL && strncmp(name, pre, strlen(pre)) == 0)
                pname = name + strlen(pre);
        }
    for (int e = 0; e < s->n_stateful; e++)
        if (s->stateful[e].hooks->knows != NULL &&
            s->stateful[e].hooks->knows(s->stateful[e].state, pname, pname != name))
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
 * part. A stateful op's own loader refuses state it does not have. */
static kt_status check_unused(const kt_session *s, const kt_st_file *f, unsigned flags,
                              const char *path)
{
    if (flags & KT_LOAD_ALLOW_UNUSED)
        return KT_OK;
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name = NULL;
        KT__TRY(kt_st_entry(f, i, &name, NULL));
        if (!known_name(s, name))
            return kt__error(KT_EINVAL, "%s: tensor '%s' is not a parameter of the program (a "
                             "checkpoint of another model?)", path, name);
    }
    return KT_OK;
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
    /* check everything first, so a bad file changes nothing */
    for (int dry = 1; dry >= 0 && status == KT_OK; dry--) {
        if (dry && (status = check_unused(s, f, flags, path)) != KT_OK)
            break;
        status = load_params(s, f, flags, dry, path);
        for (int e = 0; e < s->n_stateful && status == KT_OK; e++)
            status = load_op_state(s, &s->stateful[e], f, flags, dry, path);
    }
    if (status == KT_OK && (flags & KT_LOAD_OPTIMIZER))
        s->steps_done = step;
out:
    kt_st_close(f);
    return status;
}
