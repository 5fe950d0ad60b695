/* The fixture of kt-run's MoE test (test_kt_run_moe.sh), for tests/run/moe_hf.ktg compiled
 * to a .ktp: an imported checkpoint's layout, with the experts under Hugging Face's names.
 *
 *   moe_fixture write KTP DIR
 *       writes DIR/params.safetensors (every parameter and every expert by name, no libkt
 *       metadata), params_lora (and the experts' LoRA adapters), params_dense (no experts),
 *       params_missing (no experts.2.up_proj), params_misshapen (experts.1.gate_proj
 *       [24,17]), params_extra (an expert 4 of 4), inputs.safetensors (input_ids and labels,
 *       i64, some labels -100).
 *   moe_fixture check KTP OUT MODE THREADS [backward]
 *       runs the program in a session of its own (MoE layers of MODE full|lora|frozen, f32,
 *       LoRA rank 8 alpha 16: kt-run's defaults) with every value set directly from the
 *       formulas the files were written from, and compares OUT, written by kt-run, bitwise:
 *       the outputs, the loss and, with backward, "grad.<param>" and "grad.<expert tensor>"
 *       (kt_moe_weight_grad in full mode, kt_moe_lora_grad in LoRA mode), and nothing else.
 *
 * Exit status 0 on success, 1 on a mismatch or error (with a message on stderr). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/kt.h"

#define CHECK(expr)                                                                           \
    do {                                                                                      \
        if ((expr) != KT_OK) {                                                                \
            fprintf(stderr, "moe_fixture: %s: %s\n", #expr, kt_last_error());                 \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

enum { PARAM_SEED = 3, EXPERT_SEED = 7, MAX_ITEMS = 256 };

static const char *const lora_suffix[2] = {"lora_A.weight", "lora_B.weight"};

typedef struct model {
    kt_program *p;
    kt_threadpool *pool;
    kt_moe_layers moe;
    kt_session *s;
} model;

/* The program, its layers (experts from EXPERT_SEED, adapters from a formula) and a session
 * whose parameters come from PARAM_SEED, inputs from a formula. */
static void model_open(model *m, const char *ktp, kt_moe_mode mode, int threads)
{
    memset(m, 0, sizeof *m);
    CHECK(kt_program_load(ktp, &m->p));
    CHECK(kt_threadpool_create(threads, &m->pool));
    const kt_moe_layers_options o = {.weight_dtype = KT_F32, .mode = mode, .lora_rank = 8,
                                     .lora_alpha = 16.0f};
    CHECK(kt_moe_layers_create(m->p, &o, m->pool, &m->moe));
    CHECK(kt_moe_layers_init(&m->moe, EXPERT_SEED));
    for (int b = 0; b < m->moe.n; b++) {
        kt_moe *l = m->moe.layers[b];
        for (int64_t e = 0; l != NULL && mode == KT_MOE_LORA && e < 4; e++)
            for (int p = 0; p < 3; p++)
                for (int k = 0; k < 2; k++) {
                    kt_tensor t;
                    CHECK(kt_moe_lora(l, e, (kt_moe_proj)p, k, &t));
                    for (int64_t i = 0; i < kt_tensor_numel(&t); i++)
                        ((float *)t.data)[i] =
                            (float)((i * 7 + e * 3 + p * 5 + k) % 13 - 6) * 0.01f;
                }
    }
    kt_session_options so = {.pool = m->pool, .seed = PARAM_SEED, .moe_layers = m->moe.layers,
                             .n_moe_layers = m->moe.n};
    CHECK(kt_session_create(m->p, &so, &m->s));
    kt_tensor ids, labels;
    CHECK(kt_session_tensor(m->s, KT_ROLE_INPUT, "input_ids", &ids));
    CHECK(kt_session_tensor(m->s, KT_ROLE_INPUT, "labels", &labels));
    for (int64_t i = 0; i < kt_tensor_numel(&ids); i++)
        ((int64_t *)ids.data)[i] = (i * 5 + 1) % 11;
    for (int64_t i = 0; i < kt_tensor_numel(&labels); i++)
        ((int64_t *)labels.data)[i] = i % 5 == 2 ? -100 : (i * 3 + 2) % 11;
}

static void model_close(model *m)
{
    kt_session_destroy(m->s);
    kt_moe_layers_destroy(&m->moe);
    kt_threadpool_destroy(m->pool);
    kt_program_destroy(m->p);
}

typedef struct item_list {
    kt_st_item items[MAX_ITEMS];
    char names[MAX_ITEMS][160];
    size_t n;
} item_list;

static void add(item_list *l, const char *name, kt_tensor t)
{
    if (l->n == MAX_ITEMS)
        exit(1);
    snprintf(l->names[l->n], sizeof l->names[l->n], "%s", name);
    l->items[l->n] = (kt_st_item){l->names[l->n], t};
    l->n++;
}

static void save(const char *dir, const char *file, const item_list *l)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    CHECK(kt_st_save(path, l->items, l->n, NULL));
}

/* The parameters, then (unless without_experts) each expert weight and with lora the
 * adapters, under the ops' names; skip: a name left out (or NULL). */
static void list_params(const model *m, item_list *l, int with_experts, int lora,
                        const char *skip)
{
    l->n = 0;
    for (int i = 0; i < kt_program_count(m->p, KT_ROLE_PARAM); i++) {
        const char *name;
        kt_tensor t;
        CHECK(kt_program_tensor_info(m->p, KT_ROLE_PARAM, i, &name, NULL));
        CHECK(kt_session_tensor(m->s, KT_ROLE_PARAM, name, &t));
        add(l, name, t);
    }
    for (int i = 0; with_experts && i < kt_program_moe_count(m->p); i++) {
        kt_program_moe info;
        CHECK(kt_program_moe_info(m->p, i, &info));
        kt_moe *layer = m->moe.layers[info.binding];
        for (int64_t e = 0; e < info.n_experts; e++)
            for (int p = 0; p < 3; p++)
                for (int k = 0; k < (lora ? 3 : 1); k++) {
                    char name[160];
                    kt_tensor t;
                    CHECK(kt_moe_tensor_name(info.names, info.binding, e, (kt_moe_proj)p,
                                             k == 0 ? "weight" : lora_suffix[k - 1], name,
                                             sizeof name));
                    if (k == 0)
                        CHECK(kt_moe_weight(layer, e, (kt_moe_proj)p, &t));
                    else
                        CHECK(kt_moe_lora(layer, e, (kt_moe_proj)p, k - 1, &t));
                    if (skip == NULL || strcmp(name, skip) != 0)
                        add(l, name, t);
                }
    }
}

static int write_fixture(const char *ktp, const char *dir)
{
    model lora;
    model_open(&lora, ktp, KT_MOE_LORA, 1);
    item_list *l = calloc(1, sizeof *l);
    if (l == NULL)
        return 1;
    list_params(&lora, l, 1, 0, NULL);
    save(dir, "params.safetensors", l);
    list_params(&lora, l, 1, 1, NULL);
    save(dir, "params_lora.safetensors", l);
    list_params(&lora, l, 0, 0, NULL);
    save(dir, "params_dense.safetensors", l);
    list_params(&lora, l, 1, 0, "model.layers.1.mlp.experts.2.up_proj.weight");
    save(dir, "params_missing.safetensors", l);
    float *wide = calloc(24 * 17, sizeof *wide), *extra = calloc(24 * 16, sizeof *extra);
    if (wide == NULL || extra == NULL)
        return 1;
    kt_tensor t;
    list_params(&lora, l, 1, 0, "model.layers.1.mlp.experts.1.gate_proj.weight");
    CHECK(kt_tensor_init(&t, wide, KT_F32, 2, (const int64_t[]){24, 17}));
    add(l, "model.layers.1.mlp.experts.1.gate_proj.weight", t);
    save(dir, "params_misshapen.safetensors", l);
    list_params(&lora, l, 1, 0, NULL);
    CHECK(kt_tensor_init(&t, extra, KT_F32, 2, (const int64_t[]){24, 16}));
    add(l, "model.layers.1.mlp.experts.4.gate_proj.weight", t);
    save(dir, "params_extra.safetensors", l);
    l->n = 0;
    kt_tensor ids, labels;
    CHECK(kt_session_tensor(lora.s, KT_ROLE_INPUT, "input_ids", &ids));
    CHECK(kt_session_tensor(lora.s, KT_ROLE_INPUT, "labels", &labels));
    add(l, "input_ids", ids);
    add(l, "labels", labels);
    save(dir, "inputs.safetensors", l);
    free(wide);
    free(extra);
    free(l);
    model_close(&lora);
    return 0;
}

/* Compares the file's tensor `name` with `want` bitwise; 1 on a mismatch. */
static int compare(const kt_st_file *f, const char *name, const kt_tensor *want)
{
    kt_tensor got;
    char a[96], b[96];
    if (kt_st_find(f, name, &got) != KT_OK) {
        fprintf(stderr, "moe_fixture: '%s' is missing from the output\n", name);
        return 1;
    }
    if (got.dtype != want->dtype || !kt_tensor_same_shape(&got, want)) {
        fprintf(stderr, "moe_fixture: '%s' is %s, expected %s\n", name,
                kt_tensor_describe(&got, a, sizeof a), kt_tensor_describe(want, b, sizeof b));
        return 1;
    }
    size_t bytes = kt_tensor_nbytes(want);
    if (bytes > 0 && memcmp(got.data, want->data, bytes) != 0) {
        fprintf(stderr, "moe_fixture: '%s' differs from the session's\n", name);
        return 1;
    }
    return 0;
}

static int check(const char *ktp, const char *out, kt_moe_mode mode, int threads, int backward)
{
    model m;
    model_open(&m, ktp, mode, threads);
    CHECK(kt_session_forward(m.s));
    kt_tensor logits, copy;
    CHECK(kt_session_tensor(m.s, KT_ROLE_OUTPUT, "logits", &logits));
    CHECK(kt_tensor_init(&copy, malloc(kt_tensor_nbytes(&logits)), logits.dtype, logits.ndim,
                         logits.shape));
    memcpy(copy.data, logits.data, kt_tensor_nbytes(&logits));
    float loss = kt_session_loss(m.s);
    if (backward)
        CHECK(kt_session_backward(m.s));
    kt_st_file *f;
    CHECK(kt_st_open(out, &f));
    kt_tensor l;
    CHECK(kt_tensor_init(&l, &loss, KT_F32, 0, NULL));
    int bad = compare(f, "logits", &copy) | compare(f, "loss", &l);
    size_t expected = 2, experts = 0;
    for (int i = 0; backward && i < kt_program_count(m.p, KT_ROLE_GRAD); i++) {
        const char *name;
        char full[192];
        kt_tensor g;
        CHECK(kt_program_tensor_info(m.p, KT_ROLE_GRAD, i, &name, NULL));
        CHECK(kt_session_tensor(m.s, KT_ROLE_GRAD, name, &g));
        snprintf(full, sizeof full, "grad.%s", name);
        bad |= compare(f, full, &g);
        expected++;
    }
    for (int i = 0; backward && mode != KT_MOE_FROZEN && i < kt_program_moe_count(m.p); i++) {
        kt_program_moe info;
        CHECK(kt_program_moe_info(m.p, i, &info));
        kt_moe *layer = m.moe.layers[info.binding];
        for (int64_t e = 0; e < info.n_experts; e++)
            for (int p = 0; p < 3; p++)
                for (int k = 0; k < (mode == KT_MOE_LORA ? 2 : 1); k++) {
                    char name[192] = "grad.";
                    kt_tensor g;
                    CHECK(kt_moe_tensor_name(info.names, info.binding, e, (kt_moe_proj)p,
                                             mode == KT_MOE_LORA ? lora_suffix[k] : "weight",
                                             name + 5, sizeof name - 5));
                    if (mode == KT_MOE_LORA)
                        CHECK(kt_moe_lora_grad(layer, e, (kt_moe_proj)p, k, &g));
                    else
                        CHECK(kt_moe_weight_grad(layer, e, (kt_moe_proj)p, &g));
                    bad |= compare(f, name, &g);
                    experts++;
                }
    }
    expected += experts;
    if (kt_st_count(f) != expected) {
        fprintf(stderr, "moe_fixture: the output holds %zu tensors, expected %zu\n",
                kt_st_count(f), expected);
        bad = 1;
    }
    if (!bad)
        fprintf(stderr, "moe_fixture: %s matches the session bitwise (%zu tensors, %zu of "
                "them the experts' gradients)\n", out, expected, experts);
    kt_st_close(f);
    free(copy.data);
    model_close(&m);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "write") == 0)
        return write_fixture(argv[2], argv[3]);
    if ((argc == 6 || argc == 7) && strcmp(argv[1], "check") == 0) {
        static const char *const modes[3] = {"frozen", "lora", "full"}; /* kt_moe_mode order */
        for (int k = 0; k < 3; k++)
            if (strcmp(argv[4], modes[k]) == 0)
                return check(argv[2], argv[3], (kt_moe_mode)k, atoi(argv[5]),
                             argc == 7 && strcmp(argv[6], "backward") == 0);
    }
    fprintf(stderr, "usage: moe_fixture write KTP DIR | check KTP OUT MODE THREADS "
            "[backward]\n");
    return 2;
}
