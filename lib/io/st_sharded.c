/* A sharded checkpoint: Hugging Face's `*.safetensors.index.json` and the shards it names,
 * opened as one kt_st_file.
 *
 * The index is trusted no more than a header: it is read by the bounded JSON parser, a shard
 * name must stay inside the index's directory, every shard passes the one-file reader's
 * checks, and the index and the shards must agree tensor for tensor (a tensor listed but
 * absent, present but not listed, or in two shards is refused), so what loads is exactly
 * what the index describes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt/io.h"
#include "lib/core/error.h"
#include "lib/core/read_upto.h"
#include "lib/io/json.h"
#include "lib/io/st_internal.h"

#define SHOWN KT__ST_NAME_SHOWN

static int compare_member_keys(const void *a, const void *b)
{
    return strcmp((*(const kt__json_value *const *)a)->key,
                  (*(const kt__json_value *const *)b)->key);
}

static int compare_strings(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The object member named `key`, NULL when absent; KT_EFORMAT when it appears twice. */
static kt_status member(const char *label, const kt__json_value *obj, const char *key,
                        const kt__json_value **out)
{
    *out = NULL;
    for (size_t i = 0; i < obj->u.list.count; i++) {
        const kt__json_value *m = &obj->u.list.items[i];
        if (m->key_len != strlen(key) || strcmp(m->key, key) != 0)
            continue;
        if (*out != NULL)
            return kt__error(KT_EFORMAT, "%s: \"%s\" appears twice in the index", label, key);
        *out = m;
    }
    return KT_OK;
}

/* A shard name must name a file under the index's directory: relative, no ".." component,
 * no NUL. */
static kt_status check_shard_name(const char *label, const kt__json_value *m)
{
    if (m->type != KT__JSON_STRING)
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': its shard is a JSON %s, not a string",
                         label, SHOWN, m->key, kt__json_type_name(m->type));
    const char *s = m->u.string.s;
    if (strlen(s) != m->u.string.len || s[0] == '\0')
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': the shard name is empty or contains a "
                         "NUL character", label, SHOWN, m->key);
    if (s[0] == '/')
        return kt__error(KT_EFORMAT, "%s: tensor '%.*s': shard '%.*s' is an absolute path; a "
                         "shard must be in the index's directory", label, SHOWN, m->key, SHOWN, s);
    for (const char *c = s; *c != '\0';) {
        size_t n = strcspn(c, "/");
        if (n == 2 && c[0] == '.' && c[1] == '.')
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s': shard '%.*s' leaves the index's "
                             "directory ('..')", label, SHOWN, m->key, SHOWN, s);
        c += n;
        c += *c == '/';
    }
    return KT_OK;
}

/* The index's "metadata": string values as they are, integers as decimal text; others
 * (nested objects, null, booleans) are not visible through kt_st_metadata. */
static kt_status keep_metadata(kt_st_file *f, const kt__json_value *meta)
{
    if (meta == NULL)
        return KT_OK;
    if (meta->type != KT__JSON_OBJECT)
        return kt__error(KT_EFORMAT, "%s: \"metadata\" is a JSON %s, not an object", f->label,
                         kt__json_type_name(meta->type));
    size_t n = meta->u.list.count;
    f->index_meta = calloc(2 * n + 1, sizeof *f->index_meta);
    f->index_meta_text = calloc(n ? n : 1, 24);
    if (f->index_meta == NULL || f->index_meta_text == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->label);
    for (size_t i = 0; i < n; i++) {
        const kt__json_value *v = &meta->u.list.items[i];
        const char *value = NULL;
        if (strlen(v->key) != v->key_len)
            continue;
        if (v->type == KT__JSON_STRING && strlen(v->u.string.s) == v->u.string.len) {
            value = v->u.string.s;
        } else if (v->type == KT__JSON_INT) {
            char *t = f->index_meta_text + 24 * i;
            snprintf(t, 24, "%s%llu", v->u.integer.negative ? "-" : "",
                     (unsigned long long)v->u.integer.magnitude);
            value = t;
        }
        if (value == NULL)
            continue;
        f->index_meta[2 * f->index_meta_count] = v->key;
        f->index_meta[2 * f->index_meta_count + 1] = value;
        f->index_meta_count++;
    }
    return KT_OK;
}

/* The distinct shard names of the weight map, sorted. */
static kt_status list_shards(kt_st_file *f, const kt__json_value **members, size_t n,
                             const char ***names_out, size_t *count_out)
{
    const char **names = malloc((n ? n : 1) * sizeof *names);
    if (names == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->label);
    for (size_t i = 0; i < n; i++)
        names[i] = members[i]->u.string.s;
    qsort(names, n, sizeof *names, compare_strings);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (k == 0 || strcmp(names[k - 1], names[i]) != 0)
            names[k++] = names[i];
    *names_out = names;
    *count_out = k;
    return KT_OK;
}

static kt_status open_shards(kt_st_file *f, const char *dir, const char **names, size_t n)
{
    f->shards = calloc(n ? n : 1, sizeof *f->shards);
    if (f->shards == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->label);
    size_t dir_len = strlen(dir);
    int slash = dir_len > 0 && dir[dir_len - 1] != '/';
    for (size_t k = 0; k < n; k++) {
        size_t len = dir_len + (size_t)slash + strlen(names[k]) + 1;
        char *path = malloc(len);
        if (path == NULL)
            return kt__error(KT_ENOMEM, "%s: out of memory", f->label);
        snprintf(path, len, "%s%s%s", dir, slash ? "/" : "", names[k]);
        kt_status s = kt__st_shard_open(path, &f->shards[k]);
        free(path);
        if (s != KT_OK)
            return kt__error_context(s, "%s: shard '%.*s'", f->label, SHOWN, names[k]);
        f->shards[k].name = names[k]; /* the index's string: lives with f->index */
        f->n_shards++;
    }
    return KT_OK;
}

/* The index and the shards agree: each listed tensor is in its shard, each tensor of a shard
 * is listed for it (members sorted by name). */
static kt_status check_agreement(const kt_st_file *f, const kt__json_value **members, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const kt__json_value *m = members[i];
        const kt__st_entry *e = kt__st_find_entry(f, m->key);
        if (e == NULL)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s': the index maps it to shard '%.*s', "
                             "which does not hold it", f->label, SHOWN, m->key, SHOWN,
                             m->u.string.s);
        if (strcmp(f->shards[e->shard].name, m->u.string.s) != 0)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s': the index maps it to shard '%.*s' "
                             "but it is in %s", f->label, SHOWN, m->key, SHOWN, m->u.string.s,
                             f->shards[e->shard].path);
    }
    for (size_t i = 0; i < f->count; i++) {
        const kt__st_entry *e = &f->entries[i];
        kt__json_value probe = {.key = e->name};
        const kt__json_value *pp = &probe;
        if (bsearch(&pp, members, n, sizeof *members, compare_member_keys) == NULL)
            return kt__error(KT_EFORMAT, "%s: tensor '%.*s' is in %s but the index does not "
                             "list it", f->label, SHOWN, e->name, f->shards[e->shard].path);
    }
    return KT_OK;
}

static kt_status open_index(kt_st_file *f, const char *text, size_t len, const char *dir)
{
    const kt__json_value **members = NULL;
    const char **names = NULL;
    size_t n = 0, n_shards = 0;
    kt_status s = kt__json_parse(text, len, &f->index);
    if (s != KT_OK)
        return kt__error_context(s, "%s: the index is not JSON", f->label);
    const kt__json_value *root = kt__json_root(f->index), *map = NULL, *meta = NULL;
    if (root->type != KT__JSON_OBJECT)
        return kt__error(KT_EFORMAT, "%s: the index is a JSON %s, not an object", f->label,
                         kt__json_type_name(root->type));
    KT__TRY(member(f->label, root, "weight_map", &map));
    KT__TRY(member(f->label, root, "metadata", &meta));
    if (map == NULL)
        return kt__error(KT_EFORMAT, "%s: the index has no \"weight_map\" (not a safetensors "
                         "index?)", f->label);
    if (map->type != KT__JSON_OBJECT)
        return kt__error(KT_EFORMAT, "%s: \"weight_map\" is a JSON %s, not an object", f->label,
                         kt__json_type_name(map->type));
    KT__TRY(keep_metadata(f, meta));
    n = map->u.list.count;
    members = malloc((n ? n : 1) * sizeof *members);
    if (members == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", f->label);
    for (size_t i = 0; i < n && s == KT_OK; i++) {
        const kt__json_value *m = &map->u.list.items[i];
        members[i] = m;
        if (strlen(m->key) != m->key_len)
            s = kt__error(KT_EFORMAT, "%s: a tensor name in \"weight_map\" contains a NUL "
                          "character", f->label);
        else
            s = check_shard_name(f->label, m);
    }
    if (s == KT_OK) {
        qsort(members, n, sizeof *members, compare_member_keys);
        for (size_t i = 1; i < n && s == KT_OK; i++)
            if (strcmp(members[i - 1]->key, members[i]->key) == 0)
                s = kt__error(KT_EFORMAT, "%s: tensor '%.*s' appears twice in \"weight_map\"",
                              f->label, SHOWN, members[i]->key);
    }
    if (s == KT_OK)
        s = list_shards(f, members, n, &names, &n_shards);
    if (s == KT_OK)
        s = open_shards(f, dir, names, n_shards);
    if (s == KT_OK)
        s = kt__st_assemble(f);
    if (s == KT_OK)
        s = check_agreement(f, members, n);
    free(members);
    free(names);
    return s;
}

kt_status kt__st_open_index_text(const char *text, size_t len, const char *label,
                                 const char *dir, kt_st_file **file_out)
{
    *file_out = NULL;
    kt_st_file *f = calloc(1, sizeof *f);
    if (f == NULL || (f->label = malloc(strlen(label) + 1)) == NULL) {
        free(f);
        return kt__error(KT_ENOMEM, "%s: out of memory", label);
    }
    strcpy(f->label, label);
    f->sharded = 1;
    kt_status s = open_index(f, text, len, dir);
    if (s != KT_OK) {
        kt_st_close(f);
        return s;
    }
    *file_out = f;
    return KT_OK;
}

kt_status kt__st_open_index(const char *index_path, kt_st_file **file_out)
{
    int fd = -1;
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    char *dir = NULL;
    kt_status s = kt_in_open(index_path, &fd, NULL);
    if (s == KT_OK)
        s = kt__read_upto(fd, index_path, &buf, &len, &cap, (size_t)KT_ST_MAX_HEADER + 1);
    if (s == KT_OK && len > KT_ST_MAX_HEADER)
        s = kt__error(KT_EFORMAT, "%s: the index is larger than %u bytes", index_path,
                      KT_ST_MAX_HEADER);
    if (s == KT_OK) {
        const char *slash = strrchr(index_path, '/');
        size_t n = slash != NULL ? (size_t)(slash - index_path) + 1 : 0;
        if ((dir = malloc(n + 1)) == NULL)
            s = kt__error(KT_ENOMEM, "%s: out of memory", index_path);
        else {
            memcpy(dir, index_path, n);
            dir[n] = '\0';
        }
    }
    if (s == KT_OK)
        s = kt__st_open_index_text((const char *)buf, len, index_path, dir, file_out);
    if (fd >= 0)
        close(fd);
    free(buf);
    free(dir);
    return s;
}
