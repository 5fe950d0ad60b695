/* The checkpoint against the model: exactly the tensors the program reads (names and
 * shapes), the experts under the moe op's names, nothing missing, nothing extra. Both lists
 * are sorted by name and merged, so a model with many thousands of expert tensors costs
 * n log n comparisons. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/hf_internal.h"

typedef struct have_entry {
    const char *name;
    kt_st_info info;
} have_entry;

static int cmp_want(const void *a, const void *b)
{
    return strcmp(((const kt__hf_tensor *)a)->name, ((const kt__hf_tensor *)b)->name);
}

static int cmp_have(const void *a, const void *b)
{
    return strcmp(((const have_entry *)a)->name, ((const have_entry *)b)->name);
}

static void dims(int ndim, const int64_t *shape, char *out, size_t size)
{
    size_t n = 0;
    out[0] = '\0';
    n += (size_t)snprintf(out, size, "[");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(out + n, size - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < size)
        snprintf(out + n, size - n, "]");
}

/* Tensors transformers itself skips on load: RoPE's inverse frequencies (older checkpoints
 * saved them) and DeepSeek-V3's multi-token-prediction layers after the last layer. */
static int ignored(const kt__hf_config *cfg, const char *name)
{
    const char *suffix = "rotary_emb.inv_freq";
    size_t n = strlen(name), k = strlen(suffix);
    if (n >= k && strcmp(name + n - k, suffix) == 0)
        return 1;
    long long l;
    int used = 0;
    if (cfg->mtp_layers > 0 && sscanf(name, "model.layers.%lld.%n", &l, &used) == 1 &&
        used > 0 && l >= cfg->layers && l < cfg->layers + cfg->mtp_layers)
        return 1;
    return 0;
}

/* the stored dtypes a session converts into a float parameter (kt_st_read_convert) */
static int is_float(const char *file_dtype)
{
    return strcmp(file_dtype, "F32") == 0 || strcmp(file_dtype, "BF16") == 0 ||
           strcmp(file_dtype, "F16") == 0 || strcmp(file_dtype, "F64") == 0;
}

kt_status kt__hf_check_tensors(const kt_st_file *ckpt, const char *path,
                               const kt__hf_config *cfg, const kt__hf_tensor *want_in, size_t n)
{
    size_t nh = kt_st_count(ckpt);
    kt__hf_tensor *want = malloc((n ? n : 1) * sizeof *want);
    have_entry *have = malloc((nh ? nh : 1) * sizeof *have);
    kt_status s = KT_OK;
    if (want == NULL || have == NULL) {
        s = kt__error(KT_ENOMEM, "%s: out of memory listing %zu tensors", path, n + nh);
        goto done;
    }
    memcpy(want, want_in, n * sizeof *want);
    for (size_t i = 0; i < nh; i++) {
        s = kt_st_entry_info(ckpt, i, &have[i].info);
        if (s != KT_OK)
            goto done;
        have[i].name = have[i].info.name;
    }
    qsort(want, n, sizeof *want, cmp_want);
    qsort(have, nh, sizeof *have, cmp_have);
    size_t problems = 0;
    char first[640] = "";
    size_t i = 0, j = 0;
    while (i < n || j < nh) {
        int c = i == n ? 1 : j == nh ? -1 : strcmp(want[i].name, have[j].name);
        char msg[640] = "", a[96], b[96];
        /* a tensor's own file: the shard that holds it, in a sharded checkpoint */
        const char *file = j < nh ? kt_st_shard_path(ckpt, have[j].info.shard) : NULL;
        if (file == NULL || c < 0)
            file = path;
        if (c < 0) {
            dims(want[i].ndim, want[i].shape, a, sizeof a);
            snprintf(msg, sizeof msg, "%s: tensor '%s' %s is missing (the model config.json "
                     "describes needs it)", path, want[i].name, a);
            i++;
        } else if (c > 0) {
            if (!ignored(cfg, have[j].name)) {
                dims(have[j].info.ndim, have[j].info.shape, a, sizeof a);
                snprintf(msg, sizeof msg, "%s: tensor '%s' %s is not part of the model "
                         "config.json describes (extra tensor)", file, have[j].name, a);
            }
            j++;
        } else {
            const kt_st_info *v = &have[j].info;
            int same = v->ndim == want[i].ndim;
            for (int d = 0; same && d < v->ndim; d++)
                same = v->shape[d] == want[i].shape[d];
            if (!same) {
                dims(v->ndim, v->shape, a, sizeof a);
                dims(want[i].ndim, want[i].shape, b, sizeof b);
                snprintf(msg, sizeof msg, "%s: tensor '%s' has shape %s, config.json's model "
                         "needs %s", file, want[i].name, a, b);
            } else if (!is_float(v->file_dtype)) {
                snprintf(msg, sizeof msg, "%s: tensor '%s' is %s, a weight must be F32, BF16, "
                         "F16 or F64", file, want[i].name, v->file_dtype);
            }
            i++;
            j++;
        }
        if (msg[0] != '\0' && problems++ == 0)
            snprintf(first, sizeof first, "%s", msg);
    }
    if (problems > 1)
        s = kt__error(KT_EFORMAT, "%s (and %zu more problems with the checkpoint's tensors)",
                      first, problems - 1);
    else if (problems == 1)
        s = kt__error(KT_EFORMAT, "%s", first);
done:
    free(want);
    free(have);
    return s;
}
