/* kt_hf_export_peft: the run's adapters as a PEFT 0.21 LoRA adapter directory.
 *
 * Dense projections go through target_modules under PEFT's names
 * ("base_model.model.<module>.lora_A.weight" [r, in], "...lora_B.weight" [out, r]). Routed
 * experts are nn.Parameters in transformers 5 (gate_up_proj [E, 2I, H], down_proj [E, H, I]),
 * reached through target_parameters; PEFT keeps one adapter per layer and parameter with
 * A [R E, in] (expert e's rows e R .. e R + R - 1) and B [out, R E] (expert e's rank j in
 * column j E + e: rank-major, expert fastest). libkt's separate gate and up adapters are the
 * rank R = 2r gate_up adapter with A_e = [A_gate; A_up] and B_e = [B_gate 0; 0 B_up], and
 * alpha 2a keeps the scale a/r (rank_pattern / alpha_pattern); down is rank r as it is. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/export_internal.h"
#include "lib/io/json.h"

#define PREFIX "base_model.model."
#define GATE_UP "experts.gate_up_proj"
#define DOWN "experts.down_proj"

/* Model types whose v4 expert names PEFT 0.21.2 rewrites, on transformers 5, into the fused
 * experts' target_parameters (peft/utils/transformers_weight_conversion.py): a target_modules
 * entry with one of these last names never reaches a dense nn.Linear in those models (and
 * gate_proj without up_proj is refused outright). */
static const char *const remapped_mixtral[] = {"mixtral", "minimax", "minimax_m2", NULL};
static const char *const remapped_qwen2[] = {"qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                             "deepseek_v32", "glm4_moe", "dots1",
                                             "ernie4_5_moe", "qwen3_next", NULL};
static const char *const leaves_mixtral[] = {"w1", "w2", "w3", "gate", NULL};
static const char *const leaves_qwen2[] = {"gate_proj", "up_proj", "down_proj", "gate", NULL};

static int in_list(const char *const *list, const char *s)
{
    for (; *list; list++)
        if (strcmp(*list, s) == 0)
            return 1;
    return 0;
}

static const char *leaf_name(const char *module)
{
    const char *dot = strrchr(module, '.');
    return dot ? dot + 1 : module;
}

/* ---- model_type ----------------------------------------------------------------------------- */

static kt_status read_model_type(const char *source_dir, char *buf, size_t size)
{
    char path[KT_HF_EXPORT_PATH_BYTES], *text = NULL;
    size_t len = 0;
    KT__TRY(kt__path_join(path, sizeof path, source_dir, "config.json"));
    KT__TRY(kt__read_text(path, 16u << 20, &text, &len));
    kt__json_doc *doc = NULL;
    kt_status st = kt__json_parse_numbers(text, len, &doc); /* configs hold 1e-06 and the like */
    if (st != KT_OK)
        st = kt__error_context(st, "%s (give the model type, e.g. through import.json)", path);
    const kt__json_value *v = st == KT_OK ? kt__json_member(kt__json_root(doc), "model_type") : NULL;
    if (st == KT_OK && (v == NULL || v->type != KT__JSON_STRING || v->u.string.len >= size))
        st = kt__error(KT_EFORMAT, "%s: no \"model_type\" string", path);
    if (st == KT_OK)
        memcpy(buf, v->u.string.s, v->u.string.len + 1);
    kt__json_free(doc);
    free(text);
    return st;
}

/* ---- the adapters as PEFT has them ------------------------------------------------------------ */

typedef struct peft_out {
    kt_st_item *items;
    char (*names)[KT__HF_NAME_BYTES + 64];
    size_t n, cap;
} peft_out;

static kt_status add_tensor(peft_out *o, const char *name, int64_t rows, int64_t cols,
                            float **data_out)
{
    if (o->n == o->cap)
        return kt__error(KT_EINTERNAL, "peft export: tensor table full");
    float *data = calloc((size_t)(rows * cols), sizeof *data);
    if (data == NULL)
        return kt__error(KT_ENOMEM, "peft export: out of memory for '%s'", name);
    snprintf(o->names[o->n], sizeof o->names[o->n], "%s", name);
    o->items[o->n].name = o->names[o->n];
    (void)kt_tensor_init(&o->items[o->n].tensor, data, KT_F32, 2, (int64_t[]){rows, cols});
    o->n++;
    *data_out = data;
    return KT_OK;
}

static void free_out(peft_out *o)
{
    for (size_t i = 0; o->items != NULL && i < o->n; i++)
        free(o->items[i].tensor.data);
    free(o->items);
    free(o->names);
}

static void copy_values(const kt_tensor *t, float *dst)
{
    size_t n = (size_t)kt_tensor_numel(t);
    for (size_t i = 0; i < n; i++)
        dst[i] = (float)kt__elem_get(t, i);
}

static kt_status add_dense(peft_out *o, const kt__adapter *a, const kt__source *src,
                           const char *run_path)
{
    char name[KT__HF_NAME_BYTES + 64];
    kt_tensor w;
    /* Mixtral's block_sparse_moe is "mlp" in memory: PEFT would look for another name */
    if (strstr(a->module, ".block_sparse_moe.") != NULL)
        return kt__error(KT_EINVAL, "%s: adapter '%s': a Mixtral router adapter has no PEFT "
                                    "name here; export the merged weights instead "
                                    "(--hf DIR --merged)",
                         run_path, a->module);
    snprintf(name, sizeof name, "%s.weight", a->module);
    if (kt__source_find(src, name, &w) != KT_OK)
        return kt__error(KT_EINVAL, "%s: adapter '%s': the source checkpoint has no '%s'",
                         run_path, a->module, name);
    if (w.ndim != 2 || w.shape[0] != a->b.shape[0] || w.shape[1] != a->a.shape[1]) {
        char d1[64], d2[64], d3[64];
        return kt__error(KT_EINVAL, "%s: adapter '%s' (A %s, B %s) does not fit weight %s",
                         run_path, a->module, kt_tensor_describe(&a->a, d1, sizeof d1),
                         kt_tensor_describe(&a->b, d2, sizeof d2),
                         kt_tensor_describe(&w, d3, sizeof d3));
    }
    float *A, *B;
    snprintf(name, sizeof name, PREFIX "%s.lora_A.weight", a->module);
    KT__TRY(add_tensor(o, name, a->a.shape[0], a->a.shape[1], &A));
    snprintf(name, sizeof name, PREFIX "%s.lora_B.weight", a->module);
    KT__TRY(add_tensor(o, name, a->b.shape[0], a->b.shape[1], &B));
    copy_values(&a->a, A);
    copy_values(&a->b, B);
    return KT_OK;
}

/* The number of routed experts of a layer in the source (its gate projections). */
static int64_t count_experts(const kt__source *src, int64_t layer, int mixtral)
{
    int64_t e = 0;
    char name[KT__HF_NAME_BYTES];
    kt_tensor v;
    for (;; e++) {
        snprintf(name, sizeof name,
                 mixtral ? "model.layers.%lld.block_sparse_moe.experts.%lld.w1.weight"
                         : "model.layers.%lld.mlp.experts.%lld.gate_proj.weight",
                 (long long)layer, (long long)e);
        if (kt__source_find(src, name, &v) != KT_OK)
            break;
    }
    kt_clear_error();
    return e;
}

/* One MoE layer's 3E adapters (all of them) as PEFT's gate_up and down adapters. */
static kt_status add_layer(peft_out *o, const kt__adapters *ad, int64_t layer, int mixtral,
                           const kt__source *src, const char *run_path)
{
    static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
    static const char *const mx[3] = {"w1", "w3", "w2"};
    const int64_t E = count_experts(src, layer, mixtral), r = ad->rank;
    if (E == 0)
        return kt__error(KT_EINVAL, "%s: layer %lld has expert adapters but the source "
                                    "checkpoint has no routed experts there",
                         run_path, (long long)layer);
    const kt__adapter **by = calloc((size_t)(3 * E), sizeof *by);
    if (by == NULL)
        return kt__error(KT_ENOMEM, "peft export: out of memory");
    kt_status st = KT_OK;
    char module[KT__HF_NAME_BYTES], name[KT__HF_NAME_BYTES + 64];
    for (int64_t e = 0; e < E && st == KT_OK; e++)
        for (int p = 0; p < 3 && st == KT_OK; p++) {
            snprintf(module, sizeof module,
                     mixtral ? "model.layers.%lld.block_sparse_moe.experts.%lld.%s"
                             : "model.layers.%lld.mlp.experts.%lld.%s",
                     (long long)layer, (long long)e, (mixtral ? mx : hf)[p]);
            by[e * 3 + p] = kt__adapters_lookup(ad, module);
            if (by[e * 3 + p] == NULL)
                st = kt__error(KT_EINVAL, "%s: no adapter for '%s' (PEFT adapts all of a "
                                          "layer's experts' projections or none)",
                               run_path, module);
        }
    const int64_t H = st == KT_OK ? by[0]->a.shape[1] : 0, I = st == KT_OK ? by[0]->b.shape[0] : 0;
    for (int64_t e = 0; e < E && st == KT_OK; e++)
        for (int p = 0; p < 3 && st == KT_OK; p++) {
            const kt__adapter *a = by[e * 3 + p];
            int64_t in = p == 2 ? I : H, out = p == 2 ? H : I;
            if (a->a.shape[1] != in || a->b.shape[0] != out)
                st = kt__error(KT_EINVAL, "%s: adapter '%s' is [%lld, %lld] x [%lld, %lld]; the "
                                          "layer's experts need A [r, %lld] and B [%lld, r]",
                               run_path, a->module, (long long)a->b.shape[0],
                               (long long)a->b.shape[1], (long long)a->a.shape[0],
                               (long long)a->a.shape[1], (long long)in, (long long)out);
        }
    float *gA = NULL, *gB = NULL, *dA = NULL, *dB = NULL;
    const char *in_memory = "model.layers.%lld.mlp.experts"; /* Mixtral's too */
    char base[KT__HF_NAME_BYTES];
    snprintf(base, sizeof base, in_memory, (long long)layer);
    if (st == KT_OK) {
        snprintf(name, sizeof name, PREFIX "%s.base_layer.lora_A.weight", base);
        st = add_tensor(o, name, 2 * r * E, H, &gA);
    }
    if (st == KT_OK) {
        snprintf(name, sizeof name, PREFIX "%s.base_layer.lora_B.weight", base);
        st = add_tensor(o, name, 2 * I, 2 * r * E, &gB);
    }
    if (st == KT_OK) {
        snprintf(name, sizeof name, PREFIX "%s.lora_A.weight", base);
        st = add_tensor(o, name, r * E, I, &dA);
    }
    if (st == KT_OK) {
        snprintf(name, sizeof name, PREFIX "%s.lora_B.weight", base);
        st = add_tensor(o, name, H, r * E, &dB);
    }
    for (int64_t e = 0; e < E && st == KT_OK; e++) {
        const kt__adapter *g = by[e * 3], *u = by[e * 3 + 1], *d = by[e * 3 + 2];
        for (int64_t j = 0; j < r; j++) {
            for (int64_t h = 0; h < H; h++) {
                gA[(e * 2 * r + j) * H + h] = (float)kt__elem_get(&g->a, (size_t)(j * H + h));
                gA[(e * 2 * r + r + j) * H + h] = (float)kt__elem_get(&u->a, (size_t)(j * H + h));
            }
            for (int64_t i = 0; i < I; i++) { /* block-diagonal: gate rows x gate ranks, ... */
                gB[i * 2 * r * E + j * E + e] = (float)kt__elem_get(&g->b, (size_t)(i * r + j));
                gB[(I + i) * 2 * r * E + (r + j) * E + e] =
                    (float)kt__elem_get(&u->b, (size_t)(i * r + j));
                dA[(e * r + j) * I + i] = (float)kt__elem_get(&d->a, (size_t)(j * I + i));
            }
            for (int64_t h = 0; h < H; h++)
                dB[h * r * E + j * E + e] = (float)kt__elem_get(&d->b, (size_t)(h * r + j));
        }
    }
    free(by);
    return st;
}

/* ---- adapter_config.json ---------------------------------------------------------------------- */

static kt_status json_number(kt_out_file *f, double x)
{
    if (x == (double)(long long)x)
        return kt_out_printf(f, "%lld", (long long)x);
    return kt_out_printf(f, "%.17g", x);
}

typedef struct target_list {
    const char **names; /* leaf names, or full module paths where a leaf is not everywhere */
    size_t n;
} target_list;

static int has(const target_list *t, const char *s)
{
    for (size_t i = 0; i < t->n; i++)
        if (strcmp(t->names[i], s) == 0)
            return 1;
    return 0;
}

/* Whether every 2-D "<x>.<leaf>.weight" of the source (routed experts aside) has an adapter:
 * then the bare leaf name targets exactly the adapted modules. */
static int leaf_covers(const kt__source *src, const kt__adapters *ad, const char *leaf)
{
    char module[KT__HF_NAME_BYTES];
    for (size_t k = 0; k < src->n_shards; k++)
        for (size_t i = 0; i < kt_st_count(src->shards[k]); i++) {
            const char *name;
            kt_tensor v;
            (void)kt_st_entry(src->shards[k], i, &name, &v);
            size_t n = strlen(name);
            if (v.ndim != 2 || n < 8 || n - 7 >= sizeof module || strcmp(name + n - 7, ".weight"))
                continue;
            memcpy(module, name, n - 7);
            module[n - 7] = '\0';
            if (strcmp(leaf_name(module), leaf) != 0 || strstr(module, ".experts.") != NULL)
                continue; /* routed experts are target_parameters' */
            if (kt__adapters_lookup(ad, module) == NULL)
                return 0;
        }
    return 1;
}

static kt_status json_list(kt_out_file *f, const char *key, const char *const *first,
                           size_t n_first, const target_list *rest, const char *suffix)
{
    kt_status st = kt_out_printf(f, ",\n  \"%s\": [", key);
    size_t k = 0;
    for (size_t i = 0; i < n_first + rest->n && st == KT_OK; i++, k++) {
        st = kt_out_printf(f, "%s", k ? ", " : "");
        if (st != KT_OK)
            break;
        if (i < n_first) {
            st = kt__out_json_string(f, first[i]);
        } else {
            char name[KT__HF_NAME_BYTES + 16];
            snprintf(name, sizeof name, "%s%s", rest->names[i - n_first], suffix);
            st = kt__out_json_string(f, name);
        }
    }
    return st == KT_OK ? kt_out_printf(f, "]") : st;
}

static kt_status write_config(const char *path, const kt_hf_export_options *o,
                              const target_list *modules, const target_list *params,
                              int experts, int64_t r)
{
    static const char *const fused[2] = {GATE_UP, DOWN};
    kt_out_file *f = NULL;
    KT__TRY(kt_out_open(path, &f));
    kt_status st = kt_out_printf(f, "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": "
                                    "\"CAUSAL_LM\",\n  \"base_model_name_or_path\": ");
    if (st == KT_OK)
        st = kt__out_json_string(f, o->source_dir);
    if (st == KT_OK)
        st = kt_out_printf(f, ",\n  \"r\": %lld,\n  \"lora_alpha\": ", (long long)r);
    if (st == KT_OK)
        st = json_number(f, o->lora_alpha);
    if (st == KT_OK)
        st = kt_out_printf(f, ",\n  \"lora_dropout\": 0.0,\n  \"bias\": \"none\",\n"
                              "  \"fan_in_fan_out\": false,\n  \"use_rslora\": false,\n"
                              "  \"use_dora\": false,\n  \"init_lora_weights\": true,\n"
                              "  \"inference_mode\": true,\n  \"modules_to_save\": null");
    if (st == KT_OK)
        st = json_list(f, "target_modules", NULL, 0, modules, "");
    if (st == KT_OK)
        st = json_list(f, "target_parameters", fused, experts ? 2 : 0, params, ".weight");
    if (st == KT_OK && experts) {
        st = kt_out_printf(f, ",\n  \"rank_pattern\": {\"" GATE_UP "\": %lld},\n"
                              "  \"alpha_pattern\": {\"" GATE_UP "\": ",
                           (long long)(2 * r));
        if (st == KT_OK)
            st = json_number(f, 2 * o->lora_alpha);
        if (st == KT_OK)
            st = kt_out_printf(f, "}\n}\n");
    } else if (st == KT_OK) {
        st = kt_out_printf(f, ",\n  \"rank_pattern\": {},\n  \"alpha_pattern\": {}\n}\n");
    }
    if (st != KT_OK) {
        kt_out_discard(f);
        return st;
    }
    return kt_out_commit(f);
}

/* Each dense adapter's target: its last name where that covers every such module of the
 * source, else the module's full path; in target_modules, except where PEFT would rewrite
 * the name into the fused experts (a gate_proj of DeepSeek's shared experts, say): those go
 * to target_parameters as "<name>.weight", which PEFT wraps as an ordinary rank-r LoRA of
 * the Linear's weight, under the same tensor names. */
static void dense_targets(const kt__adapters *ad, const kt__source *src, const char *model_type,
                          target_list *modules, target_list *params)
{
    const char *const *remapped = in_list(remapped_mixtral, model_type) ? leaves_mixtral
                                  : in_list(remapped_qwen2, model_type) ? leaves_qwen2
                                                                        : NULL;
    for (size_t i = 0; i < ad->n; i++) {
        const kt__adapter *a = &ad->items[i];
        if (a->layer >= 0)
            continue;
        const char *leaf = leaf_name(a->module);
        target_list *t = remapped != NULL && in_list(remapped, leaf) ? params : modules;
        const char *name = leaf_covers(src, ad, leaf) ? leaf : a->module;
        if (!has(t, name))
            t->names[t->n++] = name;
    }
}

kt_status kt_hf_export_peft(const char *run_path, const kt_hf_export_options *options,
                            const char *out_dir)
{
    if (run_path == NULL || options == NULL || options->source_dir == NULL || out_dir == NULL)
        return kt__error(KT_EINVAL, "kt_hf_export_peft: NULL argument");
    kt_st_file *run = NULL;
    kt__source src = {0};
    kt__adapters ad = {0};
    kt__xdir d = {0};
    peft_out o = {0};
    target_list t = {0}, tp = {0};
    char model_type[64], path[KT_HF_EXPORT_PATH_BYTES];
    int64_t *layers = NULL;
    size_t n_layers = 0;
    int mixtral = 0;
    kt_status st = kt__path_exists(out_dir)
                       ? kt__error(KT_EINVAL, "%s: already exists (the export writes a new "
                                              "directory; remove it or choose another)",
                                   out_dir)
                       : kt_st_open(run_path, &run);
    if (st == KT_OK)
        st = kt__source_open(options->source_dir, &src);
    if (st == KT_OK)
        st = kt__adapters_find(run, run_path, options, &ad);
    if (st == KT_OK && ad.n == 0)
        st = kt__error(KT_EINVAL, "%s: no LoRA adapters (a full fine-tune exports with --hf)",
                       run_path);
    if (st == KT_OK && !(options->lora_alpha > 0))
        st = kt__error(KT_EINVAL, "%s: the LoRA alpha is needed for adapter_config.json",
                       run_path);
    if (st == KT_OK && options->model_type != NULL)
        snprintf(model_type, sizeof model_type, "%s", options->model_type);
    else if (st == KT_OK)
        st = read_model_type(options->source_dir, model_type, sizeof model_type);
    if (st == KT_OK) {
        o.cap = ad.n * 2 + 8;
        o.items = calloc(o.cap, sizeof *o.items);
        o.names = calloc(o.cap, sizeof *o.names);
        t.names = calloc(ad.n + 1, sizeof *t.names);
        tp.names = calloc(ad.n + 1, sizeof *tp.names);
        layers = calloc(ad.n + 1, sizeof *layers);
        if (o.items == NULL || o.names == NULL || t.names == NULL || tp.names == NULL ||
            layers == NULL)
            st = kt__error(KT_ENOMEM, "peft export: out of memory");
    }
    if (st == KT_OK)
        dense_targets(&ad, &src, model_type, &t, &tp);
    for (size_t i = 0; i < ad.n && st == KT_OK; i++) {
        const kt__adapter *a = &ad.items[i];
        if (a->layer < 0) {
            st = add_dense(&o, a, &src, run_path);
            continue;
        }
        size_t k = 0;
        while (k < n_layers && layers[k] != a->layer)
            k++;
        if (k == n_layers) {
            layers[n_layers++] = a->layer;
            mixtral = a->mixtral;
            st = add_layer(&o, &ad, a->layer, a->mixtral, &src, run_path);
        }
    }
    /* target_parameters name every MoE layer: all of them need their adapters */
    for (int64_t l = 0; n_layers > 0 && st == KT_OK; l++) {
        char name[KT__HF_NAME_BYTES];
        snprintf(name, sizeof name, "model.layers.%lld.input_layernorm.weight", (long long)l);
        kt_tensor v;
        if (kt__source_find(&src, name, &v) != KT_OK) {
            kt_clear_error();
            break;
        }
        size_t k = 0;
        while (k < n_layers && layers[k] != l)
            k++;
        if (k == n_layers && count_experts(&src, l, mixtral) > 0)
            st = kt__error(KT_EINVAL, "%s: layer %lld's routed experts have no adapters but "
                                      "other layers' do (PEFT's target_parameters adapt every "
                                      "layer); export the merged weights instead",
                           run_path, (long long)l);
    }
    if (st == KT_OK)
        st = kt__xdir_begin(&d, out_dir);
    if (st == KT_OK)
        st = kt__xdir_path(&d, "adapter_model.safetensors", path, sizeof path);
    if (st == KT_OK)
        st = kt_st_save(path, o.items, o.n, (const char *const[]){"format", "pt", NULL});
    if (st == KT_OK)
        st = kt__xdir_path(&d, "adapter_config.json", path, sizeof path);
    if (st == KT_OK)
        st = write_config(path, options, &t, &tp, n_layers > 0, ad.rank);
    if (st == KT_OK)
        st = kt__xdir_commit(&d);
    kt__xdir_abort(&d);
    free(layers);
    free(t.names);
    free(tp.names);
    free_out(&o);
    kt__adapters_free(&ad);
    kt__source_close(&src);
    kt_st_close(run);
    return st;
}
