/* Saving and loading a session's parameters and optimizer state as safetensors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "graph/runtime/session_internal.h"
#include "kt/io.h"

#define NAME_BYTES 160

static const char *const state_prefix[2][2] = {
    {"optimizer.momentum.", NULL}, /* SGD */
    {"optimizer.m.", "optimizer.v."} /* AdamW */};

static int n_states(const kt_session *s) { return (s->opt_state[0] != NULL) + (s->opt_state[1] != NULL); }

/* The optimizer state k of a trainable parameter entry, as a tensor. */
static kt_tensor state_tensor(const kt_session *s, const kt__pentry *e, int k)
{
    const kt__pbuf *gb = &s->p->bufs[e->grad_buf];
    kt_tensor t = gb->meta;
    t.data = (unsigned char *)s->opt_state[k] + gb->offset;
    return t;
}

kt_status kt_session_save(kt_session *s, const char *path, int with_optimizer)
{
    if (s == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_session_save: NULL argument");
    const int32_t n_params = s->p->n_entries[KT_ROLE_PARAM];
    const int states = with_optimizer ? n_states(s) : 0;
    const int kind = s->opt.optimizer.kind == KT_OPTIM_ADAMW;
    size_t cap = (size_t)n_params * (1 + (size_t)states);
    kt_st_item *items = calloc(cap + 1, sizeof *items);
    char *names = calloc(cap + 1, NAME_BYTES);
    kt_status status = KT_OK;
    if (items == NULL || names == NULL) {
        status = kt__error(KT_ENOMEM, "save: out of memory");
        goto out;
    }
    size_t n = 0;
    for (int32_t i = 0; i < n_params; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        items[n++] = (kt_st_item){kt__strings_get(&s->p->strings, e->name), s->tensors[e->buf]};
    }
    for (int k = 0; k < states; k++) {
        for (int32_t i = 0; i < n_params; i++) {
            const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
            if (e->grad_buf < 0)
                continue;
            char *name = names + n * NAME_BYTES;
            snprintf(name, NAME_BYTES, "%s%s", state_prefix[kind][k],
                     kt__strings_get(&s->p->strings, e->name));
            items[n++] = (kt_st_item){name, state_tensor(s, e, k)};
        }
    }
    char step[32];
    snprintf(step, sizeof step, "%lld", (long long)s->steps_done);
    const char *meta[] = {"kt.step", step, "kt.optimizer", kind ? "adamw" : "sgd", NULL};
    status = kt_st_save(path, items, n, with_optimizer ? meta : NULL);
out:
    free(items);
    free(names);
    return status;
}

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

static kt_status load_all(kt_session *s, const kt_st_file *f, unsigned flags, int dry_run,
                          const char *path)
{
    const int allow = (flags & KT_LOAD_ALLOW_MISSING) != 0;
    const int kind = s->opt.optimizer.kind == KT_OPTIM_ADAMW;
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        const char *pname = kt__strings_get(&s->p->strings, e->name);
        KT__TRY(load_one(f, pname, &s->tensors[e->buf], dry_run, allow, path));
        if (!(flags & KT_LOAD_OPTIMIZER) || e->grad_buf < 0)
            continue;
        for (int k = 0; k < n_states(s); k++) {
            char name[NAME_BYTES];
            snprintf(name, sizeof name, "%s%s", state_prefix[kind][k], pname);
            kt_tensor t = state_tensor(s, e, k);
            KT__TRY(load_one(f, name, &t, dry_run, 0, path));
        }
    }
    return KT_OK;
}

/* Whether `name` is a parameter of the program, or an optimizer state of one (under any
 * optimizer's prefix: a checkpoint saved with state loads as weights alone too). */
static int known_name(const kt_session *s, const char *name)
{
    const char *pname = name;
    for (int kind = 0; kind < 2; kind++)
        for (int k = 0; k < 2; k++) {
            const char *pre = state_prefix[kind][k];
            if (pre != NULL && strncmp(name, pre, strlen(pre)) == 0)
                pname = name + strlen(pre);
        }
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        if (strcmp(pname, kt__strings_get(&s->p->strings, e->name)) == 0)
            return 1;
    }
    return 0;
}

/* Unless KT_LOAD_ALLOW_UNUSED: every tensor of the file is one the program has, so that a
 * checkpoint of another model (more layers, other names) is refused instead of loaded in
 * part. */
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
    if ((status = check_unused(s, f, flags, path)) != KT_OK ||
        (status = load_all(s, f, flags, 1, path)) != KT_OK ||
        (status = load_all(s, f, flags, 0, path)) != KT_OK)
        goto out;
    if (flags & KT_LOAD_OPTIMIZER)
        s->steps_done = step;
out:
    kt_st_close(f);
    return status;
}
