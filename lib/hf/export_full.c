/* kt_hf_export_full: the run's tensors as a checkpoint in the source's layout: the same shard
 * files holding the same tensors in the same order, each in its source dtype, with the LoRA
 * deltas folded in when asked. Everything is checked before the first byte is written. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"

#define CHUNK 65536 /* elements converted per write when a tensor has no adapter */

/* Copied beside the weights when the source has them (config.json must be there). */
static const char *const side_files[] = {
    "generation_config.json", "tokenizer.json",     "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model",   "vocab.json",
    "merges.txt",              "added_tokens.json", "chat_template.jinja",
    "chat_template.json",      NULL};

static int is_float(kt_dtype d) { return d == KT_F32 || d == KT_BF16 || d == KT_F16; }

/* "<module>.weight" -> its adapter, or NULL. */
static const kt__adapter *adapter_of(const kt__adapters *ad, const char *name)
{
    size_t n = strlen(name);
    if (ad->n == 0 || n < 7 || n - 7 >= KT__HF_NAME_BYTES || strcmp(name + n - 7, ".weight") != 0)
        return NULL;
    char module[KT__HF_NAME_BYTES];
    memcpy(module, name, n - 7);
    module[n - 7] = '\0';
    return kt__adapters_lookup(ad, module);
}

/* One source tensor against the run: present, same shape, a dtype that converts; its adapter
 * (if any) fits it. */
static kt_status check_tensor(const kt_st_file *run, const char *run_path, const char *name,
                              const kt_tensor *src, const kt__adapter *a)
{
    kt_tensor have;
    char d1[96], d2[96];
    if (kt_st_find(run, name, &have) != KT_OK) {
        kt_clear_error();
        return kt__error(KT_EINVAL, "%s: no tensor '%s' (the source checkpoint has it)",
                         run_path, name);
    }
    if (!kt_tensor_same_shape(&have, src))
        return kt__error(KT_EINVAL, "%s: tensor '%s' is %s, the source checkpoint's is %s",
                         run_path, name, kt_tensor_describe(&have, d1, sizeof d1),
                         kt_tensor_describe(src, d2, sizeof d2));
    if (have.dtype != src->dtype && !(is_float(have.dtype) && is_float(src->dtype)))
        return kt__error(KT_EINVAL, "%s: tensor '%s' is %s, which does not convert to the "
                                    "source's %s",
                         run_path, name, kt_dtype_name(have.dtype), kt_dtype_name(src->dtype));
    if (a != NULL && (src->ndim != 2 || !is_float(src->dtype) || a->a.shape[1] != src->shape[1] ||
                      a->b.shape[0] != src->shape[0]))
        return kt__error(KT_EINVAL, "%s: adapter '%s' (A %s, B %s) does not fit weight %s",
                         run_path, a->module, kt_tensor_describe(&a->a, d1, sizeof d1),
                         kt_tensor_describe(&a->b, d2, sizeof d2), name);
    return KT_OK;
}

static kt_status check_all(const kt__source *src, const kt_st_file *run, const char *run_path,
                           const kt__adapters *ad)
{
    size_t folded = 0;
    for (size_t k = 0; k < src->n_shards; k++)
        for (size_t i = 0; i < kt_st_count(src->shards[k]); i++) {
            const char *name;
            kt_tensor view;
            KT__TRY(kt_st_entry(src->shards[k], i, &name, &view));
            const kt__adapter *a = adapter_of(ad, name);
            KT__TRY(check_tensor(run, run_path, name, &view, a));
            folded += a != NULL;
        }
    if (folded != ad->n)
        for (size_t i = 0; i < ad->n; i++) {
            char name[KT__HF_NAME_BYTES + 8];
            kt_tensor view;
            snprintf(name, sizeof name, "%s.weight", ad->items[i].module);
            if (kt__source_find(src, name, &view) != KT_OK)
                return kt__error(KT_EINVAL, "%s: adapter '%s' has no weight '%s' in the source "
                                            "checkpoint to fold into",
                                 run_path, ad->items[i].module, name);
        }
    return KT_OK;
}

/* Streams the run's tensor `name` converted to dtype, W + scale B A when a is given. */
static kt_status write_tensor(kt_out_file *f, const kt_st_file *run, const char *name,
                              kt_dtype dtype, const kt__adapter *a, double scale)
{
    kt_tensor w;
    KT__TRY(kt_st_find(run, name, &w));
    size_t n = (size_t)kt_tensor_numel(&w), esize = kt_dtype_size(dtype);
    if (a == NULL && w.dtype == dtype)
        return kt_out_write(f, w.data, n * esize);
    size_t row = a != NULL ? (size_t)w.shape[1] : CHUNK;
    unsigned char *buf = malloc(row * esize);
    double *ab = NULL;
    kt_status status = buf == NULL ? kt__error(KT_ENOMEM, "'%s': out of memory", name) : KT_OK;
    if (status == KT_OK && a != NULL)
        status = kt__adapter_values(a, &ab);
    const size_t r = a != NULL ? (size_t)a->a.shape[0] : 0;
    for (size_t at = 0; status == KT_OK && at < n; at += row) {
        size_t m = n - at < row ? n - at : row;
        for (size_t i = 0; i < m; i++) {
            double x = kt__elem_get(&w, at + i);
            if (a != NULL) { /* row o = at / row of W: + scale * sum_j B[o, j] A[j, i] */
                const double *brow = ab + r * row + (at / row) * r;
                double d = 0.0;
                for (size_t j = 0; j < r; j++)
                    d += brow[j] * ab[j * row + i];
                x += scale * d;
            }
            kt__elem_put(x, dtype, buf + i * esize);
        }
        status = kt_out_write(f, buf, m * esize);
    }
    free(ab);
    free(buf);
    return status;
}

static kt_status write_shard(const kt__xdir *d, const kt__source *src, size_t k,
                             const kt_st_file *run, const kt__adapters *ad, double scale,
                             uint64_t *bytes, uint64_t *params)
{
    const kt_st_file *shard = src->shards[k];
    size_t n = kt_st_count(shard);
    char path[KT_HF_EXPORT_PATH_BYTES];
    KT__TRY(kt__xdir_path(d, src->shard_names[k], path, sizeof path));
    kt__st_header_item *items = calloc(n + 1, sizeof *items);
    if (items == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++) {
        kt_tensor view;
        (void)kt_st_entry(shard, i, &items[i].name, &view);
        items[i].dtype = view.dtype, items[i].ndim = view.ndim;
        memcpy(items[i].shape, view.shape, sizeof view.shape);
        *bytes += kt_tensor_nbytes(&view);
        *params += (uint64_t)kt_tensor_numel(&view);
    }
    kt_out_file *f = NULL;
    kt_status status = kt_out_open(path, &f);
    if (status == KT_OK)
        status = kt__st_write_header(f, items, n, path);
    for (size_t i = 0; i < n && status == KT_OK; i++)
        status = write_tensor(f, run, items[i].name, items[i].dtype,
                              adapter_of(ad, items[i].name), scale);
    if (status == KT_OK) {
        status = kt_out_commit(f);
        f = NULL;
    }
    kt_out_discard(f);
    free(items);
    return status;
}

static kt_status write_index(const kt__xdir *d, const kt__source *src, uint64_t total,
                             uint64_t params)
{
    char path[KT_HF_EXPORT_PATH_BYTES];
    KT__TRY(kt__xdir_path(d, "model.safetensors.index.json", path, sizeof path));
    kt_out_file *f = NULL;
    KT__TRY(kt_out_open(path, &f));
    kt_status st = kt_out_printf(f, "{\n  \"metadata\": {\n    \"total_parameters\": %llu,\n"
                                    "    \"total_size\": %llu\n  },\n  \"weight_map\": {",
                                 (unsigned long long)params, (unsigned long long)total);
    for (size_t i = 0; i < src->n_mapped && st == KT_OK; i++) {
        st = kt_out_printf(f, "%s\n    ", i ? "," : "");
        if (st == KT_OK)
            st = kt__out_json_string(f, src->mapped_names[i]);
        if (st == KT_OK)
            st = kt_out_printf(f, ": ");
        if (st == KT_OK)
            st = kt__out_json_string(f, src->shard_names[src->mapped_shard[i]]);
    }
    if (st == KT_OK)
        st = kt_out_printf(f, "\n  }\n}\n");
    if (st != KT_OK) {
        kt_out_discard(f);
        return st;
    }
    return kt_out_commit(f);
}

static kt_status copy_side_files(const kt__xdir *d, const char *source_dir)
{
    char from[KT_HF_EXPORT_PATH_BYTES], to[KT_HF_EXPORT_PATH_BYTES];
    KT__TRY(kt__path_join(from, sizeof from, source_dir, "config.json"));
    if (!kt__path_exists(from))
        return kt__error(KT_EIO, "%s: no config.json", source_dir);
    KT__TRY(kt__xdir_path(d, "config.json", to, sizeof to));
    KT__TRY(kt__copy_file(from, to));
    for (const char *const *name = side_files; *name; name++) {
        KT__TRY(kt__path_join(from, sizeof from, source_dir, *name));
        if (!kt__path_exists(from))
            continue;
        KT__TRY(kt__xdir_path(d, *name, to, sizeof to));
        KT__TRY(kt__copy_file(from, to));
    }
    return KT_OK;
}

kt_status kt_hf_export_full(const char *run_path, const kt_hf_export_options *options,
                            const char *out_dir)
{
    if (run_path == NULL || options == NULL || options->source_dir == NULL || out_dir == NULL)
        return kt__error(KT_EINVAL, "kt_hf_export_full: NULL argument");
    kt_st_file *run = NULL;
    kt__source src = {0};
    kt__adapters ad = {0};
    kt__xdir d = {0};
    /* the cheap refusal first, before the checks read the files */
    kt_status status = kt__path_exists(out_dir)
                           ? kt__error(KT_EINVAL, "%s: already exists (the export writes a new "
                                                  "directory; remove it or choose another)",
                                       out_dir)
                           : kt_st_open(run_path, &run);
    if (status == KT_OK)
        status = kt__source_open(options->source_dir, &src);
    if (status == KT_OK)
        status = kt__adapters_find(run, run_path, options, &ad);
    if (status == KT_OK && ad.n > 0 && !options->merged)
        status = kt__error(KT_EINVAL,
                           "%s: the run holds LoRA adapters ('%s', ...): a plain export would "
                           "drop them; fold them in (merged) or export a PEFT adapter",
                           run_path, ad.items[0].module);
    if (status == KT_OK && ad.n > 0 && !(options->lora_alpha > 0))
        status = kt__error(KT_EINVAL, "%s: the run holds LoRA adapters: their alpha is needed "
                                      "to fold them in",
                           run_path);
    if (status == KT_OK)
        status = check_all(&src, run, run_path, &ad);
    if (status == KT_OK)
        status = kt__xdir_begin(&d, out_dir);
    const double scale = ad.n > 0 ? options->lora_alpha / (double)ad.rank : 0.0;
    uint64_t total = 0, params = 0;
    for (size_t k = 0; k < src.n_shards && status == KT_OK; k++)
        status = write_shard(&d, &src, k, run, &ad, scale, &total, &params);
    if (status == KT_OK && src.indexed)
        status = write_index(&d, &src, total, params);
    if (status == KT_OK)
        status = copy_side_files(&d, options->source_dir);
    if (status == KT_OK)
        status = kt__xdir_commit(&d);
    kt__xdir_abort(&d);
    kt__adapters_free(&ad);
    kt__source_close(&src);
    kt_st_close(run);
    return status;
}
