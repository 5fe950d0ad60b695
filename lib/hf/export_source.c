/* The source checkpoint of an export: one model.safetensors, or the shards
 * model.safetensors.index.json names, kept open so the export copies the source's shard files
 * and tensor order exactly. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"
#include "lib/io/json.h"

#define INDEX_NAME "model.safetensors.index.json"
#define INDEX_MAX_BYTES (64u << 20)

/* A shard name is a plain file name in the directory: no path, no hidden file. */
static int plain_file_name(const char *s, size_t len)
{
    return len > 0 && len < KT__HF_SHARD_NAME_BYTES && s[0] != '.' && memchr(s, '/', len) == NULL &&
           memchr(s, '\0', len) == NULL;
}

static kt_status add_shard(kt__source *s, const char *name, size_t len, size_t *index_out)
{
    for (size_t i = 0; i < s->n_shards; i++)
        if (strlen(s->shard_names[i]) == len && memcmp(s->shard_names[i], name, len) == 0) {
            *index_out = i;
            return KT_OK;
        }
    memcpy(s->shard_names[s->n_shards], name, len);
    s->shard_names[s->n_shards][len] = '\0';
    *index_out = s->n_shards++;
    return KT_OK;
}

static kt_status read_index(kt__source *s, const char *path)
{
    char *text = NULL;
    size_t len = 0;
    KT__TRY(kt__read_text(path, INDEX_MAX_BYTES, &text, &len));
    kt__json_doc *doc = NULL;
    kt_status status = kt__json_parse(text, len, &doc);
    const kt__json_value *map = NULL;
    if (status != KT_OK) {
        status = kt__error_context(status, "%s", path);
        goto out;
    }
    map = kt__json_member(kt__json_root(doc), "weight_map");
    if (map == NULL || map->type != KT__JSON_OBJECT || map->u.list.count == 0) {
        status = kt__error(KT_EFORMAT, "%s: no \"weight_map\" object of tensor names", path);
        goto out;
    }
    size_t n = map->u.list.count;
    s->shard_names = calloc(n, sizeof *s->shard_names);
    s->mapped_names = calloc(n, sizeof *s->mapped_names);
    s->mapped_shard = calloc(n, sizeof *s->mapped_shard);
    if (s->shard_names == NULL || s->mapped_names == NULL || s->mapped_shard == NULL) {
        status = kt__error(KT_ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const kt__json_value *v = &map->u.list.items[i];
        if (v->type != KT__JSON_STRING || !plain_file_name(v->u.string.s, v->u.string.len)) {
            status = kt__error(KT_EFORMAT, "%s: weight_map[\"%s\"] is not a shard file name",
                               path, v->key);
            goto out;
        }
        if ((s->mapped_names[i] = malloc(v->key_len + 1)) == NULL) {
            status = kt__error(KT_ENOMEM, "%s: out of memory", path);
            goto out;
        }
        memcpy(s->mapped_names[i], v->key, v->key_len + 1);
        s->n_mapped = i + 1;
        if ((status = add_shard(s, v->u.string.s, v->u.string.len, &s->mapped_shard[i])) != KT_OK)
            goto out;
    }
out:
    kt__json_free(doc);
    free(text);
    return status;
}

/* Every tensor of a shard mapped to it and every mapped tensor in its shard: the index and
 * the files describe the same checkpoint. */
static kt_status check_index(const kt__source *s)
{
    size_t in_shards = 0;
    for (size_t k = 0; k < s->n_shards; k++)
        in_shards += kt_st_count(s->shards[k]);
    for (size_t i = 0; i < s->n_mapped; i++) {
        kt_tensor view;
        size_t k = s->mapped_shard[i];
        if (kt_st_find(s->shards[k], s->mapped_names[i], &view) != KT_OK) {
            kt_clear_error();
            return kt__error(KT_EFORMAT, "%s/%s: the index maps tensor '%s' to shard %s, which "
                                         "does not hold it",
                             s->dir, INDEX_NAME, s->mapped_names[i], s->shard_names[k]);
        }
    }
    if (in_shards != s->n_mapped) {
        for (size_t k = 0; k < s->n_shards; k++)
            for (size_t j = 0; j < kt_st_count(s->shards[k]); j++) {
                const char *name;
                KT__TRY(kt_st_entry(s->shards[k], j, &name, NULL));
                size_t i = 0;
                while (i < s->n_mapped &&
                       !(s->mapped_shard[i] == k && strcmp(s->mapped_names[i], name) == 0))
                    i++;
                if (i == s->n_mapped)
                    return kt__error(KT_EFORMAT,
                                     "%s/%s: tensor '%s' is in shard %s but not in the index",
                                     s->dir, INDEX_NAME, name, s->shard_names[k]);
            }
    }
    return KT_OK;
}

kt_status kt__source_open(const char *dir, kt__source *out)
{
    memset(out, 0, sizeof *out);
    kt__source s = {.dir = dir};
    char path[KT_HF_EXPORT_PATH_BYTES];
    kt_status status = kt__path_join(path, sizeof path, dir, INDEX_NAME);
    if (status != KT_OK)
        return status;
    if (kt__path_exists(path)) {
        s.indexed = 1;
        status = read_index(&s, path);
    } else {
        s.shard_names = calloc(1, sizeof *s.shard_names);
        if (s.shard_names == NULL)
            status = kt__error(KT_ENOMEM, "%s: out of memory", dir);
        else {
            strcpy(s.shard_names[0], "model.safetensors");
            s.n_shards = 1;
            if (kt__path_join(path, sizeof path, dir, "model.safetensors") == KT_OK &&
                !kt__path_exists(path))
                status = kt__error(KT_EIO, "%s: neither %s nor model.safetensors is there", dir,
                                   INDEX_NAME);
        }
    }
    if (status == KT_OK && (s.shards = calloc(s.n_shards, sizeof *s.shards)) == NULL)
        status = kt__error(KT_ENOMEM, "%s: out of memory", dir);
    for (size_t k = 0; status == KT_OK && k < s.n_shards; k++) {
        status = kt__path_join(path, sizeof path, dir, s.shard_names[k]);
        if (status == KT_OK)
            status = kt_st_open(path, &s.shards[k]);
    }
    if (status == KT_OK && s.indexed)
        status = check_index(&s);
    if (status != KT_OK) {
        kt__source_close(&s);
        return status;
    }
    *out = s;
    return KT_OK;
}

void kt__source_close(kt__source *s)
{
    for (size_t k = 0; s->shards != NULL && k < s->n_shards; k++)
        kt_st_close(s->shards[k]);
    for (size_t i = 0; s->mapped_names != NULL && i < s->n_mapped; i++)
        free(s->mapped_names[i]);
    free(s->shards);
    free(s->shard_names);
    free(s->mapped_names);
    free(s->mapped_shard);
    memset(s, 0, sizeof *s);
}

kt_status kt__source_find(const kt__source *s, const char *name, kt_tensor *view_out)
{
    for (size_t k = 0; k < s->n_shards; k++)
        if (kt_st_find(s->shards[k], name, view_out) == KT_OK)
            return KT_OK;
    kt_clear_error();
    return kt__error(KT_EINVAL, "%s: the source checkpoint has no tensor '%s'", s->dir, name);
}

kt_status kt__out_json_string(kt_out_file *f, const char *s)
{
    /* kt_out_printf buffers, so runs of plain characters go out as one piece */
    KT__TRY(kt_out_printf(f, "\""));
    while (*s) {
        size_t plain = 0;
        while (s[plain] && s[plain] != '"' && s[plain] != '\\' && (unsigned char)s[plain] >= 0x20)
            plain++;
        if (plain > 0) {
            KT__TRY(kt_out_printf(f, "%.*s", (int)plain, s));
            s += plain;
        } else if (*s == '"' || *s == '\\') {
            KT__TRY(kt_out_printf(f, "\\%c", *s++));
        } else {
            KT__TRY(kt_out_printf(f, "\\u%04x", (unsigned)(unsigned char)*s++));
        }
    }
    return kt_out_printf(f, "\"");
}
