/* The LoRA adapters a run file holds: every "<module>.lora_A.weight" with its ".lora_B.weight",
 * and which of them belong to routed experts (by the checkpoint names the moe op uses). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"

static const char SUFFIX_A[] = ".lora_A.weight";
static const char SUFFIX_B[] = ".lora_B.weight";

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* Parses a decimal index at *p (advancing it); -1 when there is none. */
static int64_t parse_index(const char **p)
{
    const char *s = *p;
    if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] >= '0' && s[1] <= '9'))
        return -1;
    int64_t v = 0;
    while (*s >= '0' && *s <= '9' && v < (int64_t)1 << 40)
        v = v * 10 + (*s++ - '0');
    *p = s;
    return v;
}

/* "model.layers.<l>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>" or Mixtral's
 * "model.layers.<l>.block_sparse_moe.experts.<e>.<w1|w3|w2>": 1 with the parts filled in. */
static int parse_expert(const char *module, kt__adapter *a)
{
    static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
    static const char *const mixtral[3] = {"w1", "w3", "w2"};
    const char *p = module;
    if (strncmp(p, "model.layers.", 13) != 0)
        return 0;
    p += 13;
    int64_t layer = parse_index(&p);
    if (layer < 0)
        return 0;
    int is_mixtral;
    if (strncmp(p, ".mlp.experts.", 13) == 0)
        is_mixtral = 0, p += 13;
    else if (strncmp(p, ".block_sparse_moe.experts.", 26) == 0)
        is_mixtral = 1, p += 26;
    else
        return 0;
    int64_t expert = parse_index(&p);
    if (expert < 0 || *p++ != '.')
        return 0;
    for (int k = 0; k < 3; k++)
        if (strcmp(p, (is_mixtral ? mixtral : hf)[k]) == 0) {
            a->layer = layer, a->expert = expert, a->proj = k, a->mixtral = is_mixtral;
            return 1;
        }
    return 0;
}

static const char *leaf_name(const char *module)
{
    const char *dot = strrchr(module, '.');
    return dot ? dot + 1 : module;
}

static kt_status check_pair(const kt__adapter *a, const char *run_path)
{
    char da[64], db[64];
    const kt_tensor *A = &a->a, *B = &a->b;
    if (A->dtype != KT_F32 || B->dtype != KT_F32 || A->ndim != 2 || B->ndim != 2 ||
        A->shape[0] != B->shape[1] || A->shape[0] < 1)
        return kt__error(KT_EINVAL,
                         "%s: adapter '%s': lora_A is %s and lora_B is %s; LoRA needs f32 "
                         "A [r, in] and B [out, r]",
                         run_path, a->module, kt_tensor_describe(A, da, sizeof da),
                         kt_tensor_describe(B, db, sizeof db));
    return KT_OK;
}

/* The target name that reaches an adapter: kt-import's (PEFT's) gate_proj / up_proj /
 * down_proj for the routed experts too, Mixtral's w1 / w3 / w2 included. */
static const char *target_of(const kt__adapter *a)
{
    static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
    return a->layer >= 0 ? hf[a->proj] : leaf_name(a->module);
}

static kt_status check_targets(const kt__adapters *set, const char *const *targets,
                               const char *run_path)
{
    for (size_t i = 0; i < set->n; i++) {
        const kt__adapter *a = &set->items[i];
        const char *leaf = target_of(a);
        int found = 0;
        for (const char *const *t = targets; *t && !found; t++)
            found = strcmp(*t, leaf) == 0 || (a->layer >= 0 && strcmp(*t, "experts") == 0);
        if (!found)
            return kt__error(KT_EINVAL,
                             "%s: adapter '%s': '%s' is not among the LoRA targets the run "
                             "was imported with",
                             run_path, a->module, leaf);
    }
    for (const char *const *t = targets; *t; t++) {
        int used = 0;
        for (size_t i = 0; i < set->n && !used; i++)
            used = strcmp(*t, target_of(&set->items[i])) == 0 ||
                   (set->items[i].layer >= 0 && strcmp(*t, "experts") == 0);
        if (!used)
            return kt__error(KT_EINVAL, "%s: LoRA target '%s' has no adapter in the run",
                             run_path, *t);
    }
    return KT_OK;
}

static int by_module(const void *x, const void *y)
{
    return strcmp(((const kt__adapter *)x)->module, ((const kt__adapter *)y)->module);
}

kt_status kt__adapters_find(const kt_st_file *run, const char *run_path,
                            const kt_hf_export_options *options, kt__adapters *out)
{
    memset(out, 0, sizeof *out);
    size_t count = kt_st_count(run), n = 0;
    kt__adapters set = {.items = calloc(count + 1, sizeof(kt__adapter))};
    if (set.items == NULL)
        return kt__error(KT_ENOMEM, "%s: out of memory", run_path);
    kt_status status = KT_OK;
    for (size_t i = 0; i < count && status == KT_OK; i++) {
        const char *name;
        kt_tensor view;
        if ((status = kt_st_entry(run, i, &name, &view)) != KT_OK)
            break;
        if (strncmp(name, "optimizer.", 10) == 0 || strncmp(name, "grad.", 5) == 0)
            continue; /* optimizer state, gradients (kt-run's output files) */
        int is_a = ends_with(name, SUFFIX_A), is_b = ends_with(name, SUFFIX_B);
        if (!is_a && !is_b)
            continue;
        size_t mlen = strlen(name) - (sizeof SUFFIX_A - 1);
        char other[KT__HF_NAME_BYTES + 32];
        if (mlen >= KT__HF_NAME_BYTES) {
            status = kt__error(KT_EINVAL, "%s: tensor name too long: '%s'", run_path, name);
            break;
        }
        snprintf(other, sizeof other, "%.*s%s", (int)mlen, name, is_a ? SUFFIX_B : SUFFIX_A);
        kt_tensor pair;
        if (kt_st_find(run, other, &pair) != KT_OK) {
            kt_clear_error();
            status = kt__error(KT_EINVAL, "%s: adapter tensor '%s' has no '%s'", run_path, name,
                               other);
            break;
        }
        if (is_b)
            continue; /* listed with its A */
        kt__adapter *a = &set.items[n];
        memcpy(a->module, name, mlen);
        a->module[mlen] = '\0';
        a->a = view, a->b = pair, a->layer = -1;
        (void)parse_expert(a->module, a);
        if ((status = check_pair(a, run_path)) != KT_OK)
            break;
        int64_t r = a->a.shape[0];
        int64_t want = options->lora_rank > 0 ? options->lora_rank : set.rank;
        if (want > 0 && r != want) {
            status = kt__error(KT_EINVAL, "%s: adapter '%s' has rank %lld, expected %lld%s",
                               run_path, a->module, (long long)r, (long long)want,
                               options->lora_rank > 0 ? " (the LoRA rank given)" : "");
            break;
        }
        set.rank = r;
        n++;
    }
    set.n = n;
    if (status == KT_OK)
        qsort(set.items, n, sizeof *set.items, by_module);
    if (status == KT_OK && options->targets != NULL && n > 0)
        status = check_targets(&set, options->targets, run_path);
    if (status != KT_OK) {
        kt__adapters_free(&set);
        return status;
    }
    *out = set;
    return KT_OK;
}

void kt__adapters_free(kt__adapters *a)
{
    free(a->items);
    memset(a, 0, sizeof *a);
}

const kt__adapter *kt__adapters_lookup(const kt__adapters *a, const char *module)
{
    size_t lo = 0, hi = a->n; /* sorted by module */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(a->items[mid].module, module);
        if (c == 0)
            return &a->items[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}
