/* kt_hf_import: config.json -> model.ktg -> compiled program, checked against the
 * checkpoint, then OUT written whole. Nothing is written before every check passed. */
#define _XOPEN_SOURCE 700 /* realpath */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt/graph.h"
#include "kt/hf.h"
#include "kt/io.h"
#include "kt/moe.h"
#include "kt/program.h"
#include "lib/core/error.h"
#include "lib/core/read_upto.h"
#include "lib/hf/hf_internal.h"
#include "lib/hf/options.h"
#include "lib/hf/out_dir.h"

#define MAX_CONFIG_BYTES ((size_t)16 << 20)
#define DIAG_BYTES ((size_t)64 << 10)

static kt_status read_config(const char *path, char **text_out, size_t *len_out)
{
    int fd;
    KT__TRY(kt_in_open(path, &fd, NULL));
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    kt_status s = kt__read_upto(fd, path, &buf, &len, &cap, MAX_CONFIG_BYTES + 1);
    close(fd);
    if (s == KT_OK && len > MAX_CONFIG_BYTES)
        s = kt__error(KT_EFORMAT, "%s: larger than %zu MiB: not a config.json", path,
                      MAX_CONFIG_BYTES >> 20);
    if (s != KT_OK) {
        free(buf);
        return s;
    }
    *text_out = (char *)buf;
    *len_out = len;
    return KT_OK;
}

/* The tensors the checkpoint must hold: the program's parameters (LoRA adapters aside: they
 * are new) and every MoE layer's experts. */
static kt_status expected_tensors(const kt_program *p, const kt__hf_config *c,
                                  kt__hf_tensor **out, size_t *n_out)
{
    int np = kt_program_count(p, KT_ROLE_PARAM);
    size_t n_moe = 0;
    for (int64_t l = 0; l < c->layers; l++)
        n_moe += c->moe_layer[l];
    size_t cap = (size_t)np + n_moe * (size_t)c->n_experts * 3;
    kt__hf_tensor *t = calloc(cap ? cap : 1, sizeof *t);
    if (t == NULL)
        return kt__error(KT_ENOMEM, "kt_hf_import: out of memory listing %zu tensors", cap);
    size_t n = 0;
    for (int i = 0; i < np; i++) {
        const char *name;
        kt_tensor meta;
        kt_status s = kt_program_tensor_info(p, KT_ROLE_PARAM, i, &name, &meta);
        if (s != KT_OK) {
            free(t);
            return s;
        }
        if (strstr(name, ".lora_A.weight") != NULL || strstr(name, ".lora_B.weight") != NULL)
            continue;
        snprintf(t[n].name, sizeof t[n].name, "%s", name);
        t[n].ndim = meta.ndim;
        for (int d = 0; d < meta.ndim && d < 4; d++)
            t[n].shape[d] = meta.shape[d];
        n++;
    }
    /* the experts under the names the moe ops give their layers (kt_moe_tensor_name) */
    kt_moe_names names = c->arch == KT__HF_MIXTRAL ? KT_MOE_NAMES_MIXTRAL : KT_MOE_NAMES_HF;
    for (int64_t l = 0; l < c->layers; l++) {
        if (!c->moe_layer[l])
            continue;
        for (int64_t e = 0; e < c->n_experts; e++)
            for (int proj = 0; proj < 3; proj++) {
                kt_status s = kt_moe_tensor_name(names, (int)l, e, (kt_moe_proj)proj, "weight",
                                                 t[n].name, sizeof t[n].name);
                if (s != KT_OK) {
                    free(t);
                    return s;
                }
                t[n].ndim = 2;
                t[n].shape[0] = proj == 2 ? c->hidden : c->moe_intermediate;
                t[n].shape[1] = proj == 2 ? c->moe_intermediate : c->hidden;
                n++;
            }
    }
    *out = t;
    *n_out = n;
    return KT_OK;
}

static void json_string(kt__hf_buf *b, const char *s)
{
    kt__hf_put(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        if (*p == '"' || *p == '\\')
            kt__hf_put(b, "\\%c", *p);
        else if (*p < 0x20)
            kt__hf_put(b, "\\u%04x", *p);
        else
            kt__hf_put(b, "%c", *p);
    }
    kt__hf_put(b, "\"");
}

static void manifest(kt__hf_buf *b, const char *source, const kt__hf_config *c,
                     const kt__hf_resolved *r)
{
    char alpha[40], coef[40];
    kt__hf_float(alpha, sizeof alpha, r->lora_alpha);
    kt__hf_float(coef, sizeof coef, c->aux_coef);
    kt__hf_put(b, "{\n  \"format\": \"kt-import 1\",\n  \"source\": ");
    json_string(b, source);
    kt__hf_put(b, ",\n  \"model_type\": \"%s\",\n  \"dtype\": \"%s\",\n", c->model_type,
               r->bf16 ? "bf16" : "f32");
    kt__hf_put(b, "  \"batch\": %lld,\n  \"seq\": %lld,\n", (long long)r->batch,
               (long long)r->seq);
    kt__hf_put(b, "  \"lora_rank\": %lld,\n  \"lora_alpha\": %s,\n  \"lora_targets\": [",
               (long long)r->lora_rank, r->lora_rank > 0 ? alpha : "0");
    int first = 1;
    for (unsigned bit = 1; bit <= KT__HF_T_KV_B; bit <<= 1)
        if (r->targets & bit) {
            kt__hf_put(b, "%s\"%s\"", first ? "" : ", ", kt__hf_target_name(bit));
            first = 0;
        }
    kt__hf_put(b, "],\n");
    if (kt__hf_has_moe(c)) {
        const char *mode = r->lora_rank == 0 ? "full" : r->expert_lora ? "lora" : "frozen";
        kt__hf_put(b, "  \"moe_mode\": \"%s\",\n  \"moe_intermediate\": %lld,\n"
                      "  \"moe_names\": \"%s\",\n", mode, (long long)c->moe_intermediate,
                   c->arch == KT__HF_MIXTRAL ? "mixtral" : "hf");
    } else {
        kt__hf_put(b, "  \"moe_mode\": null,\n");
    }
    kt__hf_put(b, "  \"segments\": %s,\n", r->segments ? "true" : "false");
    kt__hf_put(b, "  \"aux_loss\": %s,\n  \"router_aux_loss_coef\": %s\n}\n",
               r->aux_loss ? "true" : "false", coef);
}

static kt_status write_text(const char *path, const kt__hf_buf *b)
{
    kt_out_file *f = NULL;
    KT__TRY(kt_out_open(path, &f));
    kt_status s = kt_out_write(f, b->p, b->len);
    if (s != KT_OK) {
        kt_out_discard(f);
        return s;
    }
    return kt_out_commit(f);
}

static kt_status write_out(const char *out_dir, const kt__hf_buf *ktg, const kt__hf_buf *decode,
                           const kt__hf_buf *json, const kt_program *p)
{
    kt__hf_out o;
    KT__TRY(kt__hf_out_begin(out_dir, &o));
    char path[4096];
    kt__hf_out_path(&o, "model.ktg", path, sizeof path);
    kt_status s = write_text(path, ktg);
    if (s == KT_OK) {
        kt__hf_out_path(&o, "model_decode.ktg", path, sizeof path);
        s = write_text(path, decode);
    }
    if (s == KT_OK) {
        kt__hf_out_path(&o, "model.ktp", path, sizeof path);
        s = kt_program_save(p, path);
    }
    if (s == KT_OK) {
        kt__hf_out_path(&o, "import.json", path, sizeof path);
        s = write_text(path, json);
    }
    if (s != KT_OK) {
        kt__hf_out_abort(&o);
        return s;
    }
    return kt__hf_out_commit(&o);
}

/* The checkpoint of model_dir: its model.safetensors.index.json (every shard) or its
 * model.safetensors (kt_st_open of the directory). */
static kt_status open_checkpoint(const char *model_dir, char *path, size_t size,
                                 kt_st_file **out)
{
    snprintf(path, size, "%s", model_dir);
    KT__TRY(kt_st_open(model_dir, out));
    if (!kt_st_is_sharded(*out))
        snprintf(path, size, "%s/model.safetensors", model_dir);
    else
        snprintf(path, size, "%s/model.safetensors.index.json", model_dir);
    return KT_OK;
}

/* config.json -> cfg, the resolved options, model.ktg's, model_decode.ktg's (when decode is
 * not NULL) and import.json's text. */
static kt_status generate(const char *model_dir, const kt_hf_options *options,
                          kt__hf_config *cfg, kt__hf_resolved *r, kt__hf_buf *ktg,
                          kt__hf_buf *decode, kt__hf_buf *json)
{
    char path[4200], source[PATH_MAX];
    char *text = NULL;
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    kt_status s = read_config(path, &text, &len);
    if (s == KT_OK)
        s = kt__hf_config_parse(text, len, path, cfg);
    free(text);
    if (s == KT_OK)
        s = kt__hf_resolve_options(options, cfg, r);
    if (s != KT_OK)
        return s;
    if (realpath(model_dir, source) == NULL)
        return kt__error(KT_EIO, "%s: cannot resolve the model directory's path", model_dir);
    kt__hf_emit e = {.cfg = cfg, .b = ktg, .batch = r->batch, .seq = r->seq, .bf16 = r->bf16,
                     .lora_rank = r->lora_rank, .lora_alpha = r->lora_alpha,
                     .targets = r->targets, .aux_loss = r->aux_loss,
                     .segments = r->segments};
    kt__hf_emit_model(&e, source);
    if (decode != NULL) {
        int64_t context = options != NULL ? options->context : 0;
        if (context < 0 || context == 1)
            return kt__error(KT_EINVAL, "kt_hf_import: context %lld: the decode twin needs at "
                             "least 2 slots (a cached token beside the new one)",
                             (long long)context);
        e.b = decode;
        e.context = context > 0 ? context : r->seq > 2 ? r->seq : 2;
        kt__hf_emit_model(&e, source);
    }
    manifest(json, source, cfg, r);
    if (ktg->failed || json->failed || (decode != NULL && decode->failed))
        return kt__error(KT_ENOMEM, "kt_hf_import: out of memory writing model.ktg");
    return KT_OK;
}

kt_status kt__hf_generate(const char *model_dir, const kt_hf_options *options,
                          char **ktg_out, size_t *len_out)
{
    if (model_dir == NULL || ktg_out == NULL || len_out == NULL)
        return kt__error(KT_EINVAL, "kt__hf_generate: NULL argument");
    kt__hf_config *cfg = calloc(1, sizeof *cfg);
    kt__hf_buf ktg = {0}, json = {0};
    kt__hf_resolved r;
    kt_status s = cfg == NULL ? kt__error(KT_ENOMEM, "kt_hf_import: out of memory")
                              : generate(model_dir, options, cfg, &r, &ktg, NULL, &json);
    free(cfg);
    free(json.p);
    if (s != KT_OK) {
        free(ktg.p);
        return s;
    }
    *ktg_out = ktg.p;
    *len_out = ktg.len;
    return KT_OK;
}

/* The decode twin must parse and compile (for inference) as written: kt-generate compiles it
 * later, and a twin that does not is a bug here, not the user's. */
static kt_status check_decode_twin(const kt__hf_buf *decode, const char *model_dir, char *diag)
{
    kt_graph *g = NULL;
    kt_program *p = NULL;
    kt_compile_options copts = {.training = 0};
    kt_status s = kt_ktg_parse(decode->p, decode->len, "model_decode.ktg", NULL, 0, &g, diag,
                               DIAG_BYTES, NULL);
    if (s != KT_OK)
        return kt__error(KT_EINTERNAL, "kt_hf_import: the model_decode.ktg generated for %s "
                         "does not parse (a bug in kt-import): %.2000s", model_dir, diag);
    s = kt_compile(g, &copts, &p);
    if (s != KT_OK)
        s = kt__error_context(s, "kt_hf_import: compiling the decode twin of %s", model_dir);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return s;
}

kt_status kt_hf_import(const char *model_dir, const kt_hf_options *options, const char *out_dir)
{
    if (model_dir == NULL || out_dir == NULL)
        return kt__error(KT_EINVAL, "kt_hf_import: NULL argument");
    kt_status s;
    char *diag = NULL;
    kt__hf_config *cfg = calloc(1, sizeof *cfg);
    kt__hf_buf ktg = {0}, decode = {0}, json = {0};
    kt__hf_resolved r;
    kt_graph *g = NULL;
    kt_program *prog = NULL;
    kt_st_file *ckpt = NULL;
    kt__hf_tensor *want = NULL;
    size_t n_want = 0;
    char path[4200];
    kt_compile_options copts = {.training = 1};
    if (cfg == NULL) {
        s = kt__error(KT_ENOMEM, "kt_hf_import: out of memory");
        goto done;
    }
    s = generate(model_dir, options, cfg, &r, &ktg, &decode, &json);
    if (s != KT_OK)
        goto done;
    if ((diag = malloc(DIAG_BYTES)) == NULL) {
        s = kt__error(KT_ENOMEM, "kt_hf_import: out of memory");
        goto done;
    }
    s = kt_ktg_parse(ktg.p, ktg.len, "model.ktg", NULL, 0, &g, diag, DIAG_BYTES, NULL);
    if (s != KT_OK) {
        s = kt__error(KT_EINTERNAL, "kt_hf_import: the model.ktg generated for %s does not "
                      "parse (a bug in kt-import): %.2000s", model_dir, diag);
        goto done;
    }
    s = kt_compile(g, &copts, &prog);
    if (s != KT_OK) {
        s = kt__error_context(s, "kt_hf_import: compiling the model of %s", model_dir);
        goto done;
    }
    s = expected_tensors(prog, cfg, &want, &n_want);
    if (s == KT_OK)
        s = open_checkpoint(model_dir, path, sizeof path, &ckpt);
    if (s == KT_OK)
        s = kt__hf_check_tensors(ckpt, path, cfg, want, n_want);
    if (s == KT_OK)
        s = check_decode_twin(&decode, model_dir, diag);
    if (s == KT_OK)
        s = write_out(out_dir, &ktg, &decode, &json, prog);
done:
    kt_st_close(ckpt);
    free(want);
    kt_program_destroy(prog);
    kt_graph_destroy(g);
    free(diag);
    free(ktg.p);
    free(decode.p);
    free(json.p);
    free(cfg);
    return s;
}
