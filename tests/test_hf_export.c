/* kt_hf_export_peft / kt_hf_export_full on a synthetic source checkpoint (one MoE layer: a
 * dense q/k attention, a shared-expert projection, three routed experts; f32, bf16 and f16
 * tensors; one file or two shards with an index) and run files made with kt_st_save: PEFT's
 * names, shapes and the block-diagonal, expert-fastest gate_up layout; the full checkpoint's
 * shards, dtypes and index; merged values against a float64 fold; errors that leave no
 * output directory. tests/hf/check_export.py loads the same kind of export with PEFT. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kt/hf_export.h"
#include "kt/io.h"
#include "kt/moe.h"
#include "tests/support/test_util.h"

enum { H = 4, I = 6, E = 3, V = 8, R = 2, NT = 17 };
static const double ALPHA = 5.0;
static const char *const PROJ[3] = {"gate_proj", "up_proj", "down_proj"};

typedef struct fixture {
    char dir[256];    /* the test's scratch directory */
    char source[300]; /* the source checkpoint */
    char run[300];    /* a run file with adapters */
    char plain[300];  /* the same without adapters (a full fine-tune) */
    char out[300];    /* where exports go */
    int n;
    char names[NT][96];
    kt_tensor src[NT]; /* the source tensors */
    kt_tensor run_t[NT]; /* the run's values (f32) */
    int shard[NT];
    int n_ad;
    char ad_names[2 * (1 + 3 * E) + 2][96];
    kt_tensor ad[2 * (1 + 3 * E) + 2]; /* A, B, A, B, ... */
} fixture;

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void path_in(char *buf, size_t size, const char *dir, const char *name)
{
    size_t n = strlen(dir), m = strlen(name);
    assert_true(n + 1 + m < size);
    memcpy(buf, dir, n);
    buf[n] = '/';
    memcpy(buf + n + 1, name, m + 1);
}

static void add(fixture *fx, const char *name, kt_dtype dtype, int64_t rows, int64_t cols,
                int shard, tu_rng *rng)
{
    int i = fx->n++;
    snprintf(fx->names[i], sizeof fx->names[i], "%s", name);
    int64_t shape[2] = {rows, cols};
    int nd = cols > 0 ? 2 : 1;
    fx->run_t[i] = tu_alloc(KT_F32, nd, shape);
    tu_fill_uniform(&fx->run_t[i], rng, -1, 1);
    kt_tensor s = tu_alloc(KT_F32, nd, shape);
    tu_fill_uniform(&s, rng, -1, 1); /* the source differs from the run: the run is used */
    fx->src[i] = dtype == KT_F32 ? s : tu_convert(&s, dtype);
    if (dtype != KT_F32)
        tu_free(&s);
    fx->shard[i] = shard;
}

static void add_adapter(fixture *fx, const char *module, int64_t in, int64_t out, tu_rng *rng)
{
    for (int k = 0; k < 2; k++) {
        int i = fx->n_ad++;
        snprintf(fx->ad_names[i], sizeof fx->ad_names[i], "%s.lora_%c.weight", module,
                 k ? 'B' : 'A');
        fx->ad[i] = k ? tu_new(KT_F32, out, R) : tu_new(KT_F32, R, in);
        tu_fill_uniform(&fx->ad[i], rng, -1, 1);
    }
}

static const kt_tensor *find_ad(const fixture *fx, const char *module, int b)
{
    char name[128];
    snprintf(name, sizeof name, "%s.lora_%c.weight", module, b ? 'B' : 'A');
    for (int i = 0; i < fx->n_ad; i++)
        if (strcmp(fx->ad_names[i], name) == 0)
            return &fx->ad[i];
    return NULL;
}

/* Writes the source (sharded: two files and an index) and both run files. */
static void write_files(fixture *fx, int sharded, const char *model_type, int shared_adapter)
{
    char path[400], text[4096];
    mkdir(fx->source, 0777);
    snprintf(text, sizeof text, "{\"model_type\": \"%s\", \"hidden_size\": %d}\n", model_type,
             H);
    path_in(path, sizeof path, fx->source, "config.json");
    write_text(path, text);
    path_in(path, sizeof path, fx->source, "tokenizer.json");
    write_text(path, "{\"tokens\": []}\n");
    kt_st_item items[NT + 2 * (1 + 3 * E) + 4];
    for (int s = 0; s < (sharded ? 2 : 1); s++) {
        size_t n = 0;
        for (int i = 0; i < fx->n; i++)
            if (!sharded || fx->shard[i] == s)
                items[n++] = (kt_st_item){fx->names[i], fx->src[i]};
        snprintf(text, sizeof text, sharded ? "model-0000%d-of-00002.safetensors" : "model.safetensors",
                 s + 1);
        path_in(path, sizeof path, fx->source, text);
        OK(kt_st_save(path, items, n, (const char *const[]){"format", "pt", NULL}));
    }
    if (sharded) {
        int at = snprintf(text, sizeof text, "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {");
        for (int i = 0; i < fx->n; i++)
            at += snprintf(text + at, sizeof text - (size_t)at,
                           "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "",
                           fx->names[i], fx->shard[i] + 1);
        snprintf(text + at, sizeof text - (size_t)at, "}}\n");
        path_in(path, sizeof path, fx->source, "model.safetensors.index.json");
        write_text(path, text);
    }
    size_t n = 0;
    for (int i = 0; i < fx->n; i++)
        items[n++] = (kt_st_item){fx->names[i], fx->run_t[i]};
    OK(kt_st_save(fx->plain, items, n, NULL));
    for (int i = 0; i < fx->n_ad; i++)
        if (shared_adapter || strstr(fx->ad_names[i], "shared_experts") == NULL)
            items[n++] = (kt_st_item){fx->ad_names[i], fx->ad[i]};
    kt_tensor opt = tu_new(KT_F32, 3); /* optimizer state: skipped */
    items[n++] = (kt_st_item){"optimizer.m.model.layers.0.self_attn.q_proj.lora_A.weight", opt};
    OK(kt_st_save(fx->run, items, n, NULL));
    tu_free(&opt);
}

static int setup(void **state)
{
    fixture *fx = calloc(1, sizeof *fx);
    assert_non_null(fx);
    const char *tmp = getenv("TMPDIR");
    snprintf(fx->dir, sizeof fx->dir, "%s/kt_hf_export.XXXXXX", tmp ? tmp : "/tmp");
    assert_non_null(mkdtemp(fx->dir));
    path_in(fx->source, sizeof fx->source, fx->dir, "source");
    path_in(fx->run, sizeof fx->run, fx->dir, "run.safetensors");
    path_in(fx->plain, sizeof fx->plain, fx->dir, "plain.safetensors");
    path_in(fx->out, sizeof fx->out, fx->dir, "out");
    tu_rng rng;
    tu_rng_seed(&rng, 30);
    add(fx, "model.embed_tokens.weight", KT_F32, V, H, 0, &rng);
    add(fx, "model.layers.0.input_layernorm.weight", KT_F32, H, 0, 0, &rng);
    add(fx, "model.layers.0.self_attn.q_proj.weight", KT_BF16, H, H, 0, &rng);
    add(fx, "model.layers.0.self_attn.k_proj.weight", KT_F16, 2, H, 0, &rng);
    add(fx, "model.layers.0.mlp.gate.weight", KT_F32, E, H, 0, &rng);
    /* another q_proj, without an adapter: target_modules must name layer 0's by its path */
    add(fx, "model.layers.1.self_attn.q_proj.weight", KT_F32, H, H, 0, &rng);
    add(fx, "model.layers.0.mlp.shared_experts.gate_proj.weight", KT_F32, I, H, 1, &rng);
    char name[96];
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.%s.weight", e, PROJ[p]);
            add(fx, name, KT_F32, p == 2 ? H : I, p == 2 ? I : H, 1, &rng);
        }
    add(fx, "lm_head.weight", KT_F32, V, H, 1, &rng);
    assert_int_equal(fx->n, NT);
    add_adapter(fx, "model.layers.0.self_attn.q_proj", H, H, &rng);
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.%s", e, PROJ[p]);
            add_adapter(fx, name, p == 2 ? I : H, p == 2 ? H : I, &rng);
        }
    add_adapter(fx, "model.layers.0.mlp.shared_experts.gate_proj", H, I, &rng);
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fixture *fx = *state;
    tu_remove_tree(fx->dir);
    for (int i = 0; i < fx->n; i++) {
        tu_free(&fx->src[i]);
        tu_free(&fx->run_t[i]);
    }
    for (int i = 0; i < fx->n_ad; i++)
        tu_free(&fx->ad[i]);
    free(fx);
    return 0;
}

static kt_hf_export_options options(const fixture *fx)
{
    kt_hf_export_options o = {.source_dir = fx->source, .lora_alpha = ALPHA};
    return o;
}

static char *read_all(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* ---- PEFT ---------------------------------------------------------------------------------- */

static void test_peft_layout(void **state)
{
    fixture *fx = *state;
    write_files(fx, 0, "qwen3_moe", 0);
    kt_hf_export_options o = options(fx);
    const char *targets[] = {"q_proj", "experts", NULL};
    o.targets = targets;
    OK(kt_hf_export_peft(fx->run, &o, fx->out));
    char path[400];
    path_in(path, sizeof path, fx->out, "adapter_model.safetensors");
    kt_st_file *f = NULL;
    OK(kt_st_open(path, &f));
    assert_int_equal(kt_st_count(f), 6); /* q_proj A, B; gate_up A, B; down A, B */
    kt_tensor t;
    OK(kt_st_find(f, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", &t));
    assert_true(tu_bitwise_equal(&t, find_ad(fx, "model.layers.0.self_attn.q_proj", 0)));
    OK(kt_st_find(f, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", &t));
    assert_true(tu_bitwise_equal(&t, find_ad(fx, "model.layers.0.self_attn.q_proj", 1)));

    kt_tensor gA, gB, dA, dB;
    OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight", &gA));
    OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight", &gB));
    OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.experts.lora_A.weight", &dA));
    OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.experts.lora_B.weight", &dB));
    assert_int_equal(gA.shape[0], 2 * R * E);
    assert_int_equal(gA.shape[1], H);
    assert_int_equal(gB.shape[0], 2 * I);
    assert_int_equal(gB.shape[1], 2 * R * E);
    assert_int_equal(dA.shape[0], R * E);
    assert_int_equal(dA.shape[1], I);
    assert_int_equal(dB.shape[0], H);
    assert_int_equal(dB.shape[1], R * E);
    /* PEFT's expert e: A rows e*R'..; B column j*E + e (rank-major, expert fastest). Its
     * delta (2a / 2r) B_e A_e must be libkt's (a / r) [B_g A_g; B_u A_u], and (a / r) B_d A_d */
    for (int e = 0; e < E; e++) {
        char m[3][96];
        for (int p = 0; p < 3; p++)
            snprintf(m[p], sizeof m[p], "model.layers.0.mlp.experts.%d.%s", e, PROJ[p]);
        for (int row = 0; row < 2 * I; row++)
            for (int col = 0; col < H; col++) {
                double peft = 0, kt = 0;
                for (int j = 0; j < 2 * R; j++)
                    peft += tu_get(&gB, row * 2 * R * E + j * E + e) *
                            tu_get(&gA, (e * 2 * R + j) * H + col);
                const int p = row < I ? 0 : 1, orow = row % I;
                for (int j = 0; j < R; j++)
                    kt += tu_get(find_ad(fx, m[p], 1), orow * R + j) *
                          tu_get(find_ad(fx, m[p], 0), j * H + col);
                assert_float_equal(2 * ALPHA / (2 * R) * peft, ALPHA / R * kt, 1e-5);
            }
        /* the off-diagonal blocks are zero, the diagonal ones libkt's values */
        for (int row = 0; row < 2 * I; row++)
            for (int j = 0; j < 2 * R; j++) {
                double v = tu_get(&gB, row * 2 * R * E + j * E + e);
                if ((row < I) != (j < R))
                    assert_true(v == 0.0);
                else
                    assert_true(v == tu_get(find_ad(fx, m[row < I ? 0 : 1], 1),
                                            (row % I) * R + j % R));
            }
        for (int j = 0; j < R; j++) {
            for (int i = 0; i < I; i++)
                assert_true(tu_get(&dA, (e * R + j) * I + i) ==
                            tu_get(find_ad(fx, m[2], 0), j * I + i));
            for (int h = 0; h < H; h++)
                assert_true(tu_get(&dB, h * R * E + j * E + e) ==
                            tu_get(find_ad(fx, m[2], 1), h * R + j));
        }
    }
    kt_st_close(f);
    path_in(path, sizeof path, fx->out, "adapter_config.json");
    const char *cfg = read_all(path);
    const char *want[] = {"\"peft_type\": \"LORA\"", "\"task_type\": \"CAUSAL_LM\"", "\"r\": 2,",
                          "\"lora_alpha\": 5,",
                          "\"target_modules\": [\"model.layers.0.self_attn.q_proj\"]",
                          "\"target_parameters\": [\"experts.gate_up_proj\", \"experts.down_proj\"]",
                          "\"rank_pattern\": {\"experts.gate_up_proj\": 4}",
                          "\"alpha_pattern\": {\"experts.gate_up_proj\": 10}",
                          "\"base_model_name_or_path\": \"", NULL};
    for (const char *const *w = want; *w; w++)
        if (strstr(cfg, *w) == NULL)
            fail_msg("adapter_config.json lacks %s:\n%s", *w, cfg);
    assert_non_null(strstr(cfg, fx->source));
}

/* The shared expert's gate_proj: a bare target_modules name where it is the only one; for a
 * model type whose gate_proj PEFT rewrites into the fused experts, a target_parameters entry
 * "gate_proj.weight" instead (the same tensor names). */
static void test_peft_dense_mlp(void **state)
{
    fixture *fx = *state;
    const char *types[2] = {"qwen2_moe", "deepseek_v3"};
    for (int k = 0; k < 2; k++) {
        write_files(fx, 1, types[k], 1);
        kt_hf_export_options o = options(fx); /* model_type from config.json */
        OK(kt_hf_export_peft(fx->run, &o, fx->out));
        char path[400];
        path_in(path, sizeof path, fx->out, "adapter_config.json");
        const char *cfg = read_all(path);
        const char *want =
            k == 0 ? "\"target_modules\": [\"gate_proj\", \"model.layers.0.self_attn.q_proj\"]"
                   : "\"target_modules\": [\"model.layers.0.self_attn.q_proj\"]";
        const char *params = k == 0
                                 ? "\"target_parameters\": [\"experts.gate_up_proj\", "
                                   "\"experts.down_proj\"]"
                                 : "\"target_parameters\": [\"experts.gate_up_proj\", "
                                   "\"experts.down_proj\", \"gate_proj.weight\"]";
        if (strstr(cfg, want) == NULL || strstr(cfg, params) == NULL)
            fail_msg("%s: adapter_config.json lacks %s or %s:\n%s", types[k], want, params, cfg);
        path_in(path, sizeof path, fx->out, "adapter_model.safetensors");
        kt_st_file *f = NULL;
        kt_tensor t;
        OK(kt_st_open(path, &f));
        OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.shared_experts.gate_proj.lora_B.weight",
                      &t));
        assert_true(tu_bitwise_equal(&t, find_ad(fx, "model.layers.0.mlp.shared_experts.gate_proj", 1)));
        kt_st_close(f);
        tu_remove_tree(fx->out);
    }
}

/* The run's expert adapters as libkt's MoE layer writes them (kt_moe_save under the checkpoint
 * names, KT_MOE_NAMES_HF): the export finds them and PEFT's tensors hold the layer's values. */
static void test_peft_from_moe_layer(void **state)
{
    fixture *fx = *state;
    write_files(fx, 0, "qwen3_moe", 0);
    kt_moe_config cfg = {.n_experts = E, .hidden = H, .intermediate = I, .top_k = 2,
                         .max_tokens = 4, .weight_dtype = KT_F32, .act_dtype = KT_F32,
                         .mode = KT_MOE_LORA, .lora_rank = R, .lora_alpha = (float)ALPHA,
                         .numa_node = -1, .names = KT_MOE_NAMES_HF, .layer = 0};
    kt_moe *moe = NULL;
    OK(kt_moe_create(&cfg, NULL, &moe));
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++)
            for (int b = 0; b < 2; b++) {
                kt_tensor v;
                OK(kt_moe_lora(moe, e, (kt_moe_proj)p, b, &v));
                tu_fill_uniform(&v, &rng, -1, 1); /* B is zero at creation */
            }
    OK(kt_moe_save(moe, fx->run, NULL));
    kt_hf_export_options o = options(fx);
    OK(kt_hf_export_peft(fx->run, &o, fx->out));
    char path[400];
    path_in(path, sizeof path, fx->out, "adapter_model.safetensors");
    kt_st_file *f = NULL;
    kt_tensor gB, dA;
    OK(kt_st_open(path, &f));
    assert_int_equal(kt_st_count(f), 4); /* the experts' gate_up and down, nothing else */
    OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight", &gB));
    OK(kt_st_find(f, "base_model.model.model.layers.0.mlp.experts.lora_A.weight", &dA));
    for (int e = 0; e < E; e++) {
        kt_tensor ub, da;
        OK(kt_moe_lora(moe, e, KT_MOE_UP, 1, &ub));
        OK(kt_moe_lora(moe, e, KT_MOE_DOWN, 0, &da));
        for (int i = 0; i < I; i++)
            for (int j = 0; j < R; j++) {
                assert_true(tu_get(&gB, (I + i) * 2 * R * E + (R + j) * E + e) ==
                            tu_get(&ub, i * R + j));
                assert_true(tu_get(&dA, (e * R + j) * I + i) == tu_get(&da, j * I + i));
            }
    }
    kt_st_close(f);
    kt_moe_destroy(moe);
}

/* ---- full checkpoints ------------------------------------------------------------------------ */

/* The nearest value of dtype to x, ties to even, by search (independent of the export's
 * rounding). */
static double nearest(double x, kt_dtype dtype)
{
    if (dtype == KT_F32)
        return (float)x;
    uint16_t c = dtype == KT_BF16 ? kt_f32_to_bf16_1((float)x) : kt_f32_to_f16_1((float)x);
    double best = 0, best_d = INFINITY;
    for (int d = -2; d <= 2; d++) {
        uint16_t h = (uint16_t)(c + d);
        double v = dtype == KT_BF16 ? kt_bf16_to_f32_1(h) : kt_f16_to_f32_1(h);
        double dist = fabs(v - x);
        if (dist < best_d || (dist == best_d && (h & 1) == 0))
            best = v, best_d = dist;
    }
    return best;
}

static void check_full(fixture *fx, int sharded, int merged)
{
    const double s = ALPHA / R;
    uint64_t total = 0;
    for (int i = 0; i < fx->n; i++) {
        char path[400];
        path_in(path, sizeof path, fx->out,
                sharded ? (fx->shard[i] ? "model-00002-of-00002.safetensors"
                                        : "model-00001-of-00002.safetensors")
                        : "model.safetensors");
        kt_st_file *f = NULL;
        OK(kt_st_open(path, &f));
        kt_tensor t;
        OK(kt_st_find(f, fx->names[i], &t));
        assert_int_equal(t.dtype, fx->src[i].dtype);
        assert_true(kt_tensor_same_shape(&t, &fx->src[i]));
        total += kt_tensor_nbytes(&t);
        char module[96];
        snprintf(module, sizeof module, "%.*s", (int)strlen(fx->names[i]) - 7, fx->names[i]);
        const kt_tensor *A = merged ? find_ad(fx, module, 0) : NULL, *B = find_ad(fx, module, 1);
        int64_t n = kt_tensor_numel(&t), cols = t.ndim == 2 ? t.shape[1] : n;
        for (int64_t k = 0; k < n; k++) {
            double x = tu_get(&fx->run_t[i], k);
            if (A != NULL)
                for (int j = 0; j < R; j++)
                    x += s * tu_get(B, (k / cols) * R + j) * tu_get(A, j * cols + k % cols);
            double want = nearest(x, t.dtype);
            if (tu_get(&t, k) != want)
                fail_msg("%s[%lld] = %.9g, want %.9g (from %.17g)", fx->names[i], (long long)k,
                         tu_get(&t, k), want, x);
        }
        if (sharded) /* each shard holds exactly its tensors */
            assert_int_equal(kt_st_count(f), fx->shard[i] ? 11 : 6);
        kt_st_close(f);
    }
    char path[400];
    path_in(path, sizeof path, fx->out, "model.safetensors.index.json");
    if (sharded) {
        char want[64];
        snprintf(want, sizeof want, "\"total_size\": %llu", (unsigned long long)total);
        const char *index = read_all(path);
        assert_non_null(strstr(index, want));
        assert_non_null(strstr(index, "\"model.layers.0.mlp.experts.2.down_proj.weight\": "
                                      "\"model-00002-of-00002.safetensors\""));
        assert_non_null(strstr(index, "\"model.embed_tokens.weight\": "
                                      "\"model-00001-of-00002.safetensors\""));
    } else {
        assert_false(access(path, F_OK) == 0);
    }
    path_in(path, sizeof path, fx->out, "config.json");
    assert_non_null(strstr(read_all(path), "\"model_type\""));
    path_in(path, sizeof path, fx->out, "tokenizer.json");
    assert_true(access(path, R_OK) == 0);
}

static void test_full_sharded(void **state)
{
    fixture *fx = *state;
    write_files(fx, 1, "qwen3_moe", 0);
    kt_hf_export_options o = options(fx);
    OK(kt_hf_export_full(fx->plain, &o, fx->out));
    check_full(fx, 1, 0);
}

static void test_full_single_merged(void **state)
{
    fixture *fx = *state;
    write_files(fx, 0, "qwen3_moe", 1);
    kt_hf_export_options o = options(fx);
    /* a plain export of a LoRA run would drop the adapters: refused */
    TU_EXPECT_ERROR(kt_hf_export_full(fx->run, &o, fx->out), KT_EINVAL, "LoRA adapters",
                    "merged");
    assert_false(access(fx->out, F_OK) == 0);
    o.merged = 1;
    OK(kt_hf_export_full(fx->run, &o, fx->out));
    check_full(fx, 0, 1);
}

static void test_full_sharded_merged(void **state)
{
    fixture *fx = *state;
    write_files(fx, 1, "qwen3_moe", 1);
    kt_hf_export_options o = options(fx);
    o.merged = 1;
    OK(kt_hf_export_full(fx->run, &o, fx->out));
    check_full(fx, 1, 1);
}

/* ---- errors --------------------------------------------------------------------------------- */

static void expect_no_output(const fixture *fx)
{
    assert_false(access(fx->out, F_OK) == 0);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | grep -q kt-tmp", fx->dir);
    assert_int_not_equal(system(cmd), 0); /* no temporary left beside it either */
}

static void write_run_without(fixture *fx, const char *skip, int64_t reshape_rows)
{
    kt_st_item items[NT];
    size_t n = 0;
    kt_tensor odd = tu_new(KT_F32, 1, 1);
    for (int i = 0; i < fx->n; i++) {
        if (strcmp(fx->names[i], skip) != 0)
            items[n++] = (kt_st_item){fx->names[i], fx->run_t[i]};
        else if (reshape_rows > 0) {
            tu_free(&odd);
            odd = tu_new(KT_F32, reshape_rows, fx->run_t[i].shape[1]);
            items[n++] = (kt_st_item){fx->names[i], odd};
        }
    }
    OK(kt_st_save(fx->plain, items, n, NULL));
    tu_free(&odd);
}

static void test_errors(void **state)
{
    fixture *fx = *state;
    write_files(fx, 1, "qwen3_moe", 1);
    kt_hf_export_options o = options(fx);
    write_run_without(fx, "model.layers.0.mlp.experts.1.up_proj.weight", 0);
    TU_EXPECT_ERROR(kt_hf_export_full(fx->plain, &o, fx->out), KT_EINVAL, fx->plain,
                    "no tensor 'model.layers.0.mlp.experts.1.up_proj.weight'");
    expect_no_output(fx);
    write_run_without(fx, "model.layers.0.self_attn.k_proj.weight", 3);
    TU_EXPECT_ERROR(kt_hf_export_full(fx->plain, &o, fx->out), KT_EINVAL,
                    "model.layers.0.self_attn.k_proj.weight", "f32[3,4]", "f16[2,4]");
    expect_no_output(fx);
    /* a run without adapters has nothing for PEFT; no alpha, no fold */
    TU_EXPECT_ERROR(kt_hf_export_peft(fx->plain, &o, fx->out), KT_EINVAL, "no LoRA adapters");
    o.lora_alpha = 0, o.merged = 1;
    TU_EXPECT_ERROR(kt_hf_export_full(fx->run, &o, fx->out), KT_EINVAL, "alpha");
    o.lora_alpha = ALPHA;
    o.lora_rank = 3;
    TU_EXPECT_ERROR(kt_hf_export_full(fx->run, &o, fx->out), KT_EINVAL, "rank 2, expected 3");
    o.lora_rank = 0;
    const char *targets[] = {"q_proj", "v_proj", "experts", "gate_proj", NULL};
    o.targets = targets;
    TU_EXPECT_ERROR(kt_hf_export_peft(fx->run, &o, fx->out), KT_EINVAL, "'v_proj'",
                    "no adapter");
    const char *few[] = {"q_proj", "experts", NULL};
    o.targets = few;
    TU_EXPECT_ERROR(kt_hf_export_peft(fx->run, &o, fx->out), KT_EINVAL,
                    "model.layers.0.mlp.shared_experts.gate_proj", "not among");
    o.targets = NULL;
    expect_no_output(fx);
    /* the output directory must be new; the source must be a checkpoint */
    mkdir(fx->out, 0777);
    TU_EXPECT_ERROR(kt_hf_export_full(fx->run, &o, fx->out), KT_EINVAL, "already exists");
    rmdir(fx->out);
    o.source_dir = fx->dir;
    TU_EXPECT_ERROR(kt_hf_export_peft(fx->run, &o, fx->out), KT_EIO, "model.safetensors");
    expect_no_output(fx);
    /* a shard missing from the index */
    char path[400];
    o.source_dir = fx->source;
    path_in(path, sizeof path, fx->source, "model-00002-of-00002.safetensors");
    unlink(path);
    TU_EXPECT_ERROR(kt_hf_export_full(fx->run, &o, fx->out), KT_EIO,
                    "model-00002-of-00002.safetensors");
    expect_no_output(fx);
}

static void test_import_record(void **state)
{
    fixture *fx = *state;
    char path[400];
    kt_hf_import_record r;
    path_in(path, sizeof path, fx->dir, "import.json");
    write_text(path, "{\"source\": \"/models/x\", \"model_type\": \"mixtral\", \"dtype\": "
                     "\"bf16\", \"lora_rank\": 8, \"lora_alpha\": 16, \"lora_targets\": "
                     "[\"q_proj\", \"v_proj\"]}");
    OK(kt_hf_read_import_record(path, &r));
    assert_string_equal(r.source_dir, "/models/x");
    assert_string_equal(r.model_type, "mixtral");
    assert_int_equal(r.lora_rank, 8);
    assert_true(r.lora_alpha == 16.0);
    assert_int_equal(r.n_targets, 2);
    kt_hf_export_options o;
    kt_hf_export_options_from_record(&r, &o);
    assert_string_equal(o.source_dir, "/models/x");
    assert_string_equal(o.targets[1], "v_proj");
    assert_null(o.targets[2]);
    write_text(path, "{\"source\": \"/models/x\", \"model_type\": \"mixtral\"}");
    TU_EXPECT_ERROR(kt_hf_read_import_record(path, &r), KT_EFORMAT, path, "\"dtype\"");
    write_text(path, "{\"source\": 3}");
    TU_EXPECT_ERROR(kt_hf_read_import_record(path, &r), KT_EFORMAT, "\"source\"", "string");
    write_text(path, "not json");
    TU_EXPECT_ERROR(kt_hf_read_import_record(path, &r), KT_EFORMAT, path);
    path_in(path, sizeof path, fx->dir, "missing.json");
    TU_EXPECT_ERROR(kt_hf_read_import_record(path, &r), KT_EIO, path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_peft_layout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peft_dense_mlp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peft_from_moe_layer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_sharded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_single_merged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_sharded_merged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_record, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
