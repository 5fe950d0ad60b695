/* What the export needs to know besides the run file: OUT/import.json, written by kt-import
 * (the source directory, model_type, dtype, the LoRA rank, alpha and targets). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"
#include "lib/io/json.h"

#define IMPORT_MAX_BYTES (1u << 20)

static kt_status need(const kt__json_value *root, const char *key, kt__json_type type,
                      const char *path, const kt__json_value **out)
{
    const kt__json_value *v = kt__json_member(root, key);
    if (v == NULL)
        return kt__error(KT_EFORMAT, "%s: no key \"%s\" (kt-import writes it)", path, key);
    if (v->type != type)
        return kt__error(KT_EFORMAT, "%s: \"%s\" is %s, expected %s", path, key,
                         kt__json_type_name(v->type), kt__json_type_name(type));
    *out = v;
    return KT_OK;
}

static kt_status copy_string(const kt__json_value *v, char *dst, size_t size, const char *path,
                             const char *key)
{
    if (v->u.string.len >= size || memchr(v->u.string.s, '\0', v->u.string.len) != NULL)
        return kt__error(KT_EFORMAT, "%s: \"%s\" is too long or holds a NUL", path, key);
    memcpy(dst, v->u.string.s, v->u.string.len);
    dst[v->u.string.len] = '\0';
    return KT_OK;
}

static kt_status get_string(const kt__json_value *root, const char *key, char *dst, size_t size,
                            const char *path)
{
    const kt__json_value *v = NULL;
    KT__TRY(need(root, key, KT__JSON_STRING, path, &v));
    return copy_string(v, dst, size, path, key);
}

static kt_status get_int(const kt__json_value *root, const char *key, int64_t lo, int64_t hi,
                         int64_t *out, const char *path)
{
    const kt__json_value *v = NULL;
    KT__TRY(need(root, key, KT__JSON_INT, path, &v));
    if (v->u.integer.magnitude > (uint64_t)INT64_MAX)
        return kt__error(KT_EFORMAT, "%s: \"%s\" is out of range", path, key);
    int64_t x = v->u.integer.negative ? -(int64_t)v->u.integer.magnitude
                                      : (int64_t)v->u.integer.magnitude;
    if (x < lo || x > hi)
        return kt__error(KT_EFORMAT, "%s: \"%s\" is %lld, expected %lld to %lld", path, key,
                         (long long)x, (long long)lo, (long long)hi);
    *out = x;
    return KT_OK;
}

/* lora_alpha: an integer or a fraction (kt-import --lora-alpha 0.5). */
static kt_status get_alpha(const kt__json_value *root, const char *path, double *out)
{
    const kt__json_value *v = kt__json_member(root, "lora_alpha");
    if (v != NULL && v->type == KT__JSON_FLOAT) {
        if (!(v->u.number >= 0.0 && v->u.number <= (double)(1 << 30)))
            return kt__error(KT_EFORMAT, "%s: \"lora_alpha\" is %g, expected 0 to %d", path,
                             v->u.number, 1 << 30);
        *out = v->u.number;
        return KT_OK;
    }
    int64_t alpha = 0;
    KT__TRY(get_int(root, "lora_alpha", 0, 1 << 30, &alpha, path));
    *out = (double)alpha;
    return KT_OK;
}

static kt_status read_record(const kt__json_value *root, const char *path,
                             kt_hf_import_record *r)
{
    if (root->type != KT__JSON_OBJECT)
        return kt__error(KT_EFORMAT, "%s: not a JSON object", path);
    KT__TRY(get_string(root, "source", r->source_dir, sizeof r->source_dir, path));
    KT__TRY(get_string(root, "model_type", r->model_type, sizeof r->model_type, path));
    KT__TRY(get_string(root, "dtype", r->dtype, sizeof r->dtype, path));
    KT__TRY(get_int(root, "lora_rank", 0, 1 << 20, &r->lora_rank, path));
    KT__TRY(get_alpha(root, path, &r->lora_alpha));
    const kt__json_value *targets = NULL;
    KT__TRY(need(root, "lora_targets", KT__JSON_ARRAY, path, &targets));
    if (targets->u.list.count > KT_HF_EXPORT_MAX_TARGETS)
        return kt__error(KT_EFORMAT, "%s: more than %d \"lora_targets\"", path,
                         KT_HF_EXPORT_MAX_TARGETS);
    for (size_t i = 0; i < targets->u.list.count; i++) {
        const kt__json_value *t = &targets->u.list.items[i];
        if (t->type != KT__JSON_STRING)
            return kt__error(KT_EFORMAT, "%s: \"lora_targets\"[%zu] is %s, expected a string",
                             path, i, kt__json_type_name(t->type));
        KT__TRY(copy_string(t, r->targets[i], sizeof r->targets[i], path, "lora_targets"));
    }
    r->n_targets = (int)targets->u.list.count; /* target_list points into the copy made out */
    return KT_OK;
}

kt_status kt_hf_read_import_record(const char *path, kt_hf_import_record *record_out)
{
    if (path == NULL || record_out == NULL)
        return kt__error(KT_EINVAL, "kt_hf_read_import_record: NULL argument");
    char *text = NULL;
    size_t len = 0;
    KT__TRY(kt__read_text(path, IMPORT_MAX_BYTES, &text, &len));
    kt__json_doc *doc = NULL;
    kt_status status = kt__json_parse_numbers(text, len, &doc); /* aux coefficient, alpha */
    if (status != KT_OK) {
        status = kt__error_context(status, "%s", path);
        goto out;
    }
    kt_hf_import_record tmp; /* copied out on success only */
    memset(&tmp, 0, sizeof tmp);
    status = read_record(kt__json_root(doc), path, &tmp);
    if (status == KT_OK) {
        *record_out = tmp;
        for (int i = 0; i < record_out->n_targets; i++)
            record_out->target_list[i] = record_out->targets[i];
        record_out->target_list[record_out->n_targets] = NULL;
    }
out:
    kt__json_free(doc);
    free(text);
    return status;
}

void kt_hf_export_options_from_record(const kt_hf_import_record *record,
                                      kt_hf_export_options *options_out)
{
    memset(options_out, 0, sizeof *options_out);
    options_out->source_dir = record->source_dir;
    options_out->model_type = record->model_type[0] ? record->model_type : NULL;
    options_out->lora_rank = record->lora_rank;
    options_out->lora_alpha = record->lora_alpha;
    options_out->targets = record->lora_rank > 0 ? record->target_list : NULL;
}
