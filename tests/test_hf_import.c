/* kt_hf_import (kt/hf.h): config.json reading, the generated program against the checkpoints
 * transformers wrote (tests/hf/fixtures, made by tests/hf/make_fixtures.py), the dense
 * models' logits, loss and gradients against transformers' through the C API, and bad
 * input: each refusal names the file, the key or the tensor, and leaves OUT as it was. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kt/kt.h"
#include "lib/hf/hf_internal.h"
#include "lib/io/json.h"
#include "tests/support/test_util.h"

#ifndef KT_HF_FIXTURES
#error "KT_HF_FIXTURES: the fixture directory (tests/CMakeLists.txt defines it)"
#endif
#ifndef KT_HF_WORK
#error "KT_HF_WORK: a scratch directory (tests/CMakeLists.txt defines it)"
#endif

static const char *const archs[] = {"mixtral",     "qwen2_moe",   "qwen3_moe",
                                    "olmoe",       "deepseek_v2", "deepseek_v3",
                                    "llama",       "qwen2",       "qwen3",
                                    "mixtral_sharded"};
#define N_ARCHS (sizeof archs / sizeof archs[0])

/* ---- small file helpers ---- */

static char *slurp(const char *path, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = '\0';
    if (len_out != NULL)
        *len_out = (size_t)n;
    return buf;
}

static void spit(const char *path, const char *text, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static int exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

static void rm_dir(const char *dir)
{
    static const char *const files[] = {"config.json", "model.safetensors", "model.ktg",
                                        "model.ktp", "model_decode.ktg", "import.json",
                                        "user.txt"};
    char p[2048];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(dir);
}

static void fixture(const char *arch, char *buf, size_t size)
{
    snprintf(buf, size, "%s/%s", KT_HF_FIXTURES, arch);
}

/* The fixtures are committed (tests/hf/make_fixtures.py writes them): one missing is a broken
 * checkout, never a pass. */
static void need_fixture(const char *arch)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s/config.json", KT_HF_FIXTURES, arch);
    if (!exists(p))
        fail_msg("no fixture %s/%s (tests/hf/make_fixtures.py writes them)", KT_HF_FIXTURES, arch);
}

static void out_dir(const char *name, char *buf, size_t size)
{
    mkdir(KT_HF_WORK, 0777);
    snprintf(buf, size, "%s/%s", KT_HF_WORK, name);
    rm_dir(buf);
}

/* ---- JSON numbers ---- */

static void test_json_numbers(void **state)
{
    (void)state;
    const char *text = "{\"a\": 1e-06, \"b\": 10000.0, \"c\": -0.5, \"d\": 7, \"e\": 2.5E+3}";
    kt__json_doc *doc = NULL;
    OK(kt__json_parse_numbers(text, strlen(text), &doc));
    const kt__json_value *root = kt__json_root(doc);
    assert_int_equal(root->u.list.count, 5);
    const kt__json_value *v = root->u.list.items;
    assert_int_equal(v[0].type, KT__JSON_FLOAT);
    assert_true(v[0].u.number == 1e-6);
    assert_true(v[1].u.number == 10000.0);
    assert_true(v[2].u.number == -0.5);
    assert_int_equal(v[3].type, KT__JSON_INT); /* whole numbers stay integers */
    assert_true(v[4].u.number == 2500.0);
    kt__json_free(doc);
    doc = NULL;
    /* the safetensors parser still refuses fractions; malformed numbers are refused */
    TU_EXPECT_ERROR(kt__json_parse("[1.5]", 5, &doc), KT_EFORMAT, "fractions");
    assert_null(doc);
    TU_EXPECT_ERROR(kt__json_parse_numbers("[1.]", 4, &doc), KT_EFORMAT, "digit after '.'");
    TU_EXPECT_ERROR(kt__json_parse_numbers("[1e]", 4, &doc), KT_EFORMAT, "exponent");
    TU_EXPECT_ERROR(kt__json_parse_numbers("[1e999]", 7, &doc), KT_EFORMAT, "out of range");
    TU_EXPECT_ERROR(kt__json_parse_numbers("[NaN]", 5, &doc), KT_EFORMAT, "expected a value");
}

/* ---- config.json ---- */

#define LLAMA_BASE                                                                           \
    "\"model_type\": \"llama\", \"vocab_size\": 256, \"hidden_size\": 64, "                 \
    "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "    \
    "\"intermediate_size\": 128, \"rms_norm_eps\": 1e-05, \"hidden_act\": \"silu\""

static kt_status parse(const char *json, kt__hf_config *c)
{
    return kt__hf_config_parse(json, strlen(json), "dir/config.json", c);
}

static void test_config_reads(void **state)
{
    (void)state;
    kt__hf_config *c = calloc(1, sizeof *c);
    assert_non_null(c);
    /* transformers 4's rope_theta + rope_scaling */
    OK(parse("{" LLAMA_BASE ", \"rope_theta\": 500000.0, \"rope_scaling\": {\"type\": "
             "\"linear\", \"factor\": 4.0}, \"head_dim\": 32}", c));
    assert_int_equal(c->arch, KT__HF_LLAMA);
    assert_int_equal(c->head_dim, 32);
    assert_true(c->eps == 1e-5);
    assert_true(c->rope.theta == 500000.0);
    assert_int_equal(c->rope.type, KT__HF_ROPE_LINEAR);
    assert_true(c->rope.factor == 4.0);
    /* transformers 5's rope_parameters, yarn with its defaults */
    OK(parse("{" LLAMA_BASE ", \"max_position_embeddings\": 8192, \"rope_parameters\": "
             "{\"rope_type\": \"yarn\", \"rope_theta\": 10000.0, \"factor\": 2.0, "
             "\"original_max_position_embeddings\": 4096, \"beta_fast\": null}}", c));
    assert_int_equal(c->rope.type, KT__HF_ROPE_YARN);
    assert_int_equal(c->rope.original_max_positions, 4096);
    assert_true(c->rope.beta_fast == 32.0 && c->rope.beta_slow == 1.0 && c->rope.truncate);
    assert_int_equal(c->head_dim, 16); /* hidden / heads */
    /* Qwen2-MoE: mlp_only_layers and decoder_sparse_step make dense layers */
    OK(parse("{\"model_type\": \"qwen2_moe\", \"vocab_size\": 256, \"hidden_size\": 64, "
             "\"num_hidden_layers\": 4, \"num_attention_heads\": 4, \"intermediate_size\": 48, "
             "\"moe_intermediate_size\": 32, \"shared_expert_intermediate_size\": 64, "
             "\"num_experts\": 8, \"num_experts_per_tok\": 2, \"decoder_sparse_step\": 2, "
             "\"mlp_only_layers\": [3], \"norm_topk_prob\": true}", c));
    assert_int_equal(c->moe_layer[0], 0);
    assert_int_equal(c->moe_layer[1], 1);
    assert_int_equal(c->moe_layer[2], 0);
    assert_int_equal(c->moe_layer[3], 0); /* (3+1) % 2 == 0 but listed dense */
    assert_true(c->qkv_bias && !c->o_bias && c->norm_topk);
    assert_true(c->aux_coef == 0.001);
    /* DeepSeek-V3: yarn's mscale^2 on the attention scale, q_lora_rank null = q_proj */
    OK(parse("{\"model_type\": \"deepseek_v3\", \"vocab_size\": 256, \"hidden_size\": 64, "
             "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
             "\"intermediate_size\": 128, \"moe_intermediate_size\": 32, "
             "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
             "\"first_k_dense_replace\": 1, \"q_lora_rank\": null, \"kv_lora_rank\": 16, "
             "\"qk_nope_head_dim\": 8, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16, "
             "\"n_group\": 4, \"topk_group\": 2, \"rope_scaling\": {\"type\": \"yarn\", "
             "\"factor\": 40, \"mscale\": 1.0, \"mscale_all_dim\": 1.0, "
             "\"original_max_position_embeddings\": 4096}}", c));
    assert_int_equal(c->q_lora_rank, 0);
    assert_int_equal(c->moe_layer[0], 0);
    assert_int_equal(c->moe_layer[2], 1);
    assert_true(c->sigmoid && c->group_top2 && c->norm_topk && c->rope_deinterleave);
    assert_true(c->routed_scaling == 2.5);
    double m = 0.1 * 1.0 * log(40.0) + 1.0;
    assert_true(fabs(c->attn_scale - m * m / 4.0) < 1e-12);
    free(c);
}

static void test_config_refusals(void **state)
{
    (void)state;
    kt__hf_config *c = calloc(1, sizeof *c);
    assert_non_null(c);
    TU_EXPECT_ERROR(parse("{\"model_type\": \"llama\",", c), KT_EFORMAT, "dir/config.json",
                    "not JSON");
    TU_EXPECT_ERROR(parse("[1]", c), KT_EFORMAT, "dir/config.json", "object");
    TU_EXPECT_ERROR(parse("{\"model_type\": \"gpt2\"}", c), KT_EUNSUPPORTED, "dir/config.json",
                    "'model_type' = \"gpt2\"");
    TU_EXPECT_ERROR(parse("{\"hidden_size\": 4}", c), KT_EFORMAT, "no 'model_type'");
    TU_EXPECT_ERROR(parse("{" LLAMA_BASE ", \"hidden_act\": \"gelu\"}", c), KT_EUNSUPPORTED,
                    "'hidden_act' = \"gelu\"");
    TU_EXPECT_ERROR(parse("{" LLAMA_BASE ", \"rope_scaling\": {\"rope_type\": \"dynamic\", "
                          "\"factor\": 2.0}}", c),
                    KT_EUNSUPPORTED, "'rope_scaling.rope_type' = \"dynamic\"");
    TU_EXPECT_ERROR(parse("{" LLAMA_BASE ", \"rope_parameters\": {\"rope_type\": \"llama3\"}}",
                          c),
                    KT_EUNSUPPORTED, "'rope_parameters.rope_type' = \"llama3\"");
    TU_EXPECT_ERROR(parse("{" LLAMA_BASE ", \"num_hidden_layers\": 0}", c), KT_EFORMAT,
                    "'num_hidden_layers' = 0");
    TU_EXPECT_ERROR(parse("{" LLAMA_BASE ", \"vocab_size\": \"x\"}", c), KT_EFORMAT,
                    "'vocab_size' = \"x\"");
    TU_EXPECT_ERROR(parse("{\"model_type\": \"qwen3\", \"vocab_size\": 256, \"hidden_size\": "
                          "64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                          "\"intermediate_size\": 128, \"use_sliding_window\": true}", c),
                    KT_EUNSUPPORTED, "'use_sliding_window' = true");
    TU_EXPECT_ERROR(parse("{\"model_type\": \"mixtral\", \"vocab_size\": 256, \"hidden_size\": "
                          "64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                          "\"intermediate_size\": 32, \"num_local_experts\": 8, "
                          "\"num_experts_per_tok\": 2, \"sliding_window\": 4096}", c),
                    KT_EUNSUPPORTED, "'sliding_window' = 4096");
    TU_EXPECT_ERROR(parse("{\"model_type\": \"mixtral\", \"vocab_size\": 256, \"hidden_size\": "
                          "64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                          "\"intermediate_size\": 32, \"num_local_experts\": 8, "
                          "\"num_experts\": 4, \"num_experts_per_tok\": 2}", c),
                    KT_EFORMAT, "disagree");
    TU_EXPECT_ERROR(parse("{\"model_type\": \"deepseek_v2\", \"vocab_size\": 256, "
                          "\"hidden_size\": 64, \"num_hidden_layers\": 2, "
                          "\"num_attention_heads\": 4, \"moe_intermediate_size\": 32, "
                          "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, "
                          "\"n_shared_experts\": 1, \"kv_lora_rank\": 16, "
                          "\"qk_nope_head_dim\": 8, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16, "
                          "\"topk_method\": \"noaux_tc\"}", c),
                    KT_EUNSUPPORTED, "'topk_method' = \"noaux_tc\"");
    free(c);
}

/* ---- the fixtures: import, the program against the checkpoint ---- */

static int lora_name(const char *name)
{
    return strstr(name, ".lora_A.weight") != NULL || strstr(name, ".lora_B.weight") != NULL;
}

/* Every program parameter but the adapters is a checkpoint tensor of the same shape; every
 * checkpoint tensor is a parameter or an expert of a layer the program runs as MoE. */
static void check_program_against(const kt_program *p, const char *model_dir, int64_t *n_lora)
{
    kt_st_file *f = NULL;
    OK(kt_st_open(model_dir, &f)); /* the directory: one file or every shard of the index */
    int np = kt_program_count(p, KT_ROLE_PARAM);
    size_t matched = 0;
    *n_lora = 0;
    for (int i = 0; i < np; i++) {
        const char *name;
        kt_tensor meta, view;
        OK(kt_program_tensor_info(p, KT_ROLE_PARAM, i, &name, &meta));
        if (lora_name(name)) {
            (*n_lora)++;
            continue;
        }
        if (kt_st_find(f, name, &view) != KT_OK)
            fail_msg("%s: the program's parameter %s is not in the checkpoint", model_dir, name);
        assert_int_equal(view.ndim, meta.ndim);
        for (int d = 0; d < meta.ndim; d++)
            assert_int_equal(view.shape[d], meta.shape[d]);
        matched++;
    }
    int n_moe = kt_program_moe_count(p);
    size_t experts = 0;
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name;
        kt_tensor view;
        OK(kt_st_entry(f, i, &name, &view));
        long long layer, e;
        int at = 0;
        if (sscanf(name, "model.layers.%lld.mlp.experts.%lld.%n", &layer, &e, &at) == 2 ||
            sscanf(name, "model.layers.%lld.block_sparse_moe.experts.%lld.%n", &layer, &e,
                   &at) == 2) {
            int bound = 0;
            for (int m = 0; m < n_moe; m++) {
                kt_program_moe info;
                OK(kt_program_moe_info(p, m, &info));
                if (info.binding == layer) {
                    bound = 1;
                    assert_true(e < info.n_experts);
                    assert_int_equal(view.shape[strstr(name, "down_proj") ||
                                                        strstr(name, ".w2.")
                                                    ? 0
                                                    : 1],
                                     info.hidden);
                }
            }
            if (!bound)
                fail_msg("%s: expert tensor %s of a layer without a moe op", model_dir, name);
            experts++;
        }
    }
    assert_int_equal(matched + experts, kt_st_count(f));
    kt_st_close(f);
}

static void test_import_fixtures(void **state)
{
    (void)state;
    for (size_t a = 0; a < N_ARCHS; a++) {
        need_fixture(archs[a]);
        char src[1024], out[1024], path[1200];
        fixture(archs[a], src, sizeof src);
        out_dir(archs[a], out, sizeof out);
        kt_hf_options o = {.batch = 2, .seq = 16};
        OK(kt_hf_import(src, &o, out));
        /* the decode twin beside it (kt-generate runs it: tests/hf/import_decode_test.sh) */
        snprintf(path, sizeof path, "%s/model_decode.ktg", out);
        assert_true(exists(path));
        snprintf(path, sizeof path, "%s/model.ktp", out);
        kt_program *p = NULL;
        OK(kt_program_load(path, &p));
        int64_t n_lora;
        check_program_against(p, src, &n_lora);
        assert_int_equal(n_lora, 0);
        /* full fine-tuning: every parameter but V3's correction biases trains */
        int frozen = 0;
        for (int i = 0; i < kt_program_count(p, KT_ROLE_PARAM); i++) {
            const char *pname;
            OK(kt_program_tensor_info(p, KT_ROLE_PARAM, i, &pname, NULL));
            frozen += strstr(pname, "e_score_correction_bias") != NULL;
        }
        assert_int_equal(frozen > 0, strcmp(archs[a], "deepseek_v3") == 0);
        assert_int_equal(kt_program_count(p, KT_ROLE_GRAD),
                         kt_program_count(p, KT_ROLE_PARAM) - frozen);
        /* the interface: input_ids/labels i64 [B,S], logits f32 [B,S,V] */
        const char *name;
        kt_tensor meta;
        OK(kt_program_tensor_info(p, KT_ROLE_INPUT, 0, &name, &meta));
        assert_string_equal(name, "input_ids");
        assert_int_equal(meta.dtype, KT_I64);
        assert_int_equal(meta.shape[0], 2);
        assert_int_equal(meta.shape[1], 16);
        OK(kt_program_tensor_info(p, KT_ROLE_OUTPUT, 0, &name, &meta));
        assert_string_equal(name, "logits");
        assert_int_equal(meta.ndim, 3);
        assert_int_equal(meta.dtype, KT_F32);
        kt_program_destroy(p);
        /* model.ktg compiles as it stands (kt-graphc reads the same file) */
        snprintf(path, sizeof path, "%s/model.ktg", out);
        size_t len;
        char *text = slurp(path, &len);
        assert_non_null(text);
        kt_graph *g = NULL;
        OK(kt_ktg_parse(text, len, path, NULL, 0, &g, NULL, 0, NULL));
        assert_non_null(strstr(text, "scope model.layers.{l}"));
        kt_graph_destroy(g);
        free(text);
        snprintf(path, sizeof path, "%s/import.json", out);
        text = slurp(path, NULL);
        assert_non_null(text);
        char want[64];
        snprintf(want, sizeof want, "\"model_type\": \"%s\"",
                 strcmp(archs[a], "mixtral_sharded") == 0 ? "mixtral" : archs[a]);
        assert_non_null(strstr(text, want));
        assert_non_null(strstr(text, "\"source\": \"/"));
        free(text);
    }
}

/* LoRA: adapters [r, in] / [out, r] on the targets only, everything else frozen; bf16 base. */
static void import_lora(int bf16)
{
    const char *cases[] = {"qwen2_moe", "deepseek_v2", "llama"};
    for (size_t a = 0; a < 3; a++) {
        need_fixture(cases[a]);
        char src[1024], out[1024], path[1200];
        fixture(cases[a], src, sizeof src);
        out_dir("lora", out, sizeof out);
        int deepseek = a == 1;
        kt_hf_options o = {.batch = 1, .seq = 8, .lora_rank = 4, .lora_alpha = 8,
                           .dtype = bf16 ? KT_BF16 : KT_F32,
                           .lora_targets = deepseek ? "q_b_proj,o_proj" : "q_proj,v_proj"};
        OK(kt_hf_import(src, &o, out));
        snprintf(path, sizeof path, "%s/model.ktp", out);
        kt_program *p = NULL;
        OK(kt_program_load(path, &p));
        int64_t n_lora;
        check_program_against(p, src, &n_lora);
        /* two targets, A and B each, in every layer */
        kt__hf_config *c = calloc(1, sizeof *c);
        snprintf(path, sizeof path, "%s/config.json", src);
        size_t len;
        char *text = slurp(path, &len);
        OK(kt__hf_config_parse(text, len, path, c));
        free(text);
        assert_int_equal(n_lora, 4 * c->layers);
        assert_int_equal(kt_program_count(p, KT_ROLE_GRAD), n_lora);
        int np = kt_program_count(p, KT_ROLE_PARAM), seen_bf16 = 0;
        for (int i = 0; i < np; i++) {
            const char *name;
            kt_tensor meta;
            OK(kt_program_tensor_info(p, KT_ROLE_PARAM, i, &name, &meta));
            if (lora_name(name)) {
                assert_int_equal(meta.dtype, KT_F32);
                const char *b = strstr(name, ".lora_B.weight");
                assert_int_equal(meta.shape[b ? 1 : 0], 4);
            } else if (strstr(name, "norm") != NULL || strstr(name, ".gate.") != NULL) {
                assert_int_equal(meta.dtype, KT_F32); /* norms and routers stay f32 */
            } else if (strstr(name, "_proj.weight") != NULL) {
                assert_int_equal(meta.dtype, bf16 ? KT_BF16 : KT_F32);
                seen_bf16 += meta.dtype == KT_BF16;
            }
        }
        assert_true((seen_bf16 > 0) == bf16);
        kt_program_destroy(p);
        free(c);
        snprintf(path, sizeof path, "%s/import.json", out);
        text = slurp(path, NULL);
        assert_non_null(strstr(text, "\"lora_rank\": 4"));
        assert_non_null(strstr(text, bf16 ? "\"dtype\": \"bf16\"" : "\"dtype\": \"f32\""));
        assert_non_null(strstr(text, a == 2 ? "\"moe_mode\": null" : "\"moe_mode\": \"frozen\""));
        free(text);
    }
}

static void test_import_lora(void **state)
{
    (void)state;
    import_lora(0);
}

static void test_import_lora_bf16(void **state)
{
    (void)state;
    import_lora(1);
}

/* ---- running an import through the C API: the dense models against transformers ---- */

/* One run of an imported fixture against transformers' numbers in `ref`. */
typedef struct run_spec {
    const char *arch;        /* the fixture holding config.json and the checkpoint */
    const char *ref;         /* the reference file, relative to the fixtures */
    kt_hf_options o;         /* B and S are the reference's */
    kt_moe_mode mode;        /* the MoE layers' */
    kt_dtype expert_dtype;
    const char *logits_key, *loss_key;
    double tol_logits, tol_loss; /* relative to the largest |logit|; absolute */
    int grads;               /* compare the gradients (within 1e-4 of each one's largest) */
} run_spec;

static double compare(const kt_st_file *ref, const char *key, const kt_tensor *got,
                      const char *arch, double tol)
{
    kt_tensor want;
    OK(kt_st_find(ref, key, &want));
    kt_tensor w = tu_alloc(KT_F32, want.ndim, want.shape);
    OK(kt_st_read(ref, key, &w));
    double e = tu_rel_err(got, &w, 1e-30);
    tu_free(&w);
    if (e > tol)
        fail_msg("%s: %s off by %.3g of its largest magnitude (tolerance %g)", arch, key, e, tol);
    return e;
}

/* Imports the fixture at the reference's B and S, runs forward and backward through the C
 * API (the MoE layers made by kt_moe_layers_create, the weights and experts read by
 * kt_session_load from the model directory under the checkpoint's names, the reference's
 * adapters written into the LoRA parameters) and compares the logits, the loss and the
 * gradients: dense parameters, and each expert's weight (full) or adapters (LoRA). */
static void run_case(const run_spec *r)
{
    char src[1024], out[1024], path[1200];
    fixture(r->arch, src, sizeof src);
    snprintf(path, sizeof path, "%s/%s", KT_HF_FIXTURES, r->ref);
    kt_st_file *ref = NULL;
    OK(kt_st_open(path, &ref));
    kt_tensor ids_view;
    OK(kt_st_find(ref, "input_ids", &ids_view));
    out_dir("run", out, sizeof out);
    kt_hf_options o = r->o;
    o.batch = ids_view.shape[0];
    o.seq = ids_view.shape[1];
    OK(kt_hf_import(src, &o, out));
    snprintf(path, sizeof path, "%s/model.ktp", out);
    kt_program *p = NULL;
    OK(kt_program_load(path, &p));
    kt_moe_layers layers = {0};
    kt_moe_layers_options mo = {.weight_dtype = r->expert_dtype, .mode = r->mode,
                                .lora_rank = o.lora_rank, .lora_alpha = o.lora_alpha};
    OK(kt_moe_layers_create(p, &mo, NULL, &layers));
    kt_session_options so = {.threads = 1, .optimizer = {.kind = KT_OPTIM_NONE},
                             .moe_layers = layers.layers, .n_moe_layers = layers.n};
    kt_session *s = NULL;
    OK(kt_session_create(p, &so, &s));
    /* the model directory: one file or an index; the adapters are not in it */
    OK(kt_session_load(s, src, o.lora_rank > 0 ? KT_LOAD_ALLOW_MISSING : 0));
    kt_tensor v;
    int has_adapters = kt_st_find(ref, "model.layers.0.self_attn.q_proj.lora_A.weight", &v) ==
                       KT_OK;
    kt_clear_error();
    for (int i = 0; has_adapters && i < kt_program_count(p, KT_ROLE_PARAM); i++) {
        const char *name;
        OK(kt_program_tensor_info(p, KT_ROLE_PARAM, i, &name, NULL));
        if (!lora_name(name))
            continue;
        OK(kt_session_tensor(s, KT_ROLE_PARAM, name, &v));
        OK(kt_st_read(ref, name, &v));
    }
    int n_moe = kt_program_moe_count(p);
    for (int m = 0; has_adapters && m < n_moe; m++) {
        kt_program_moe info;
        OK(kt_program_moe_info(p, m, &info));
        for (int64_t e = 0; e < info.n_experts; e++)
            for (int proj = 0; proj < 3; proj++)
                for (int b = 0; b < 2; b++) {
                    char name[160];
                    OK(kt_moe_tensor_name(info.names, info.binding, e, (kt_moe_proj)proj,
                                          b ? "lora_B.weight" : "lora_A.weight", name,
                                          sizeof name));
                    OK(kt_moe_lora(layers.layers[info.binding], e, (kt_moe_proj)proj, b, &v));
                    OK(kt_st_read(ref, name, &v));
                }
    }
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "input_ids", &v));
    OK(kt_st_read(ref, "input_ids", &v));
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "labels", &v));
    OK(kt_st_read(ref, "labels", &v));
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    OK(kt_session_tensor(s, KT_ROLE_OUTPUT, "logits", &v));
    double err = compare(ref, r->logits_key, &v, r->arch, r->tol_logits);
    kt_tensor loss = tu_new(KT_F32, 1);
    OK(kt_st_read(ref, r->loss_key, &loss));
    double want_loss = tu_get(&loss, 0);
    if (o.aux_loss) { /* the cross-entropy plus router_aux_loss_coef x transformers' aux loss */
        const char *coef = kt_st_metadata(ref, "router_aux_loss_coef");
        assert_non_null(coef);
        OK(kt_st_read(ref, "aux_loss", &loss));
        want_loss += atof(coef) * tu_get(&loss, 0);
    }
    double dl = fabs(kt_session_loss(s) - want_loss);
    tu_free(&loss);
    print_message("%s (%s%s): logits rel err %.3g, loss |diff| %.3g\n", r->arch, r->ref,
                  o.aux_loss ? ", aux loss" : "", err, dl);
    assert_true(dl <= r->tol_loss);
    double worst = 0;
    int n_grads = 0;
    for (int i = 0; r->grads && i < kt_program_count(p, KT_ROLE_GRAD); i++) {
        const char *name;
        char key[200];
        OK(kt_program_tensor_info(p, KT_ROLE_GRAD, i, &name, NULL));
        snprintf(key, sizeof key, "grad.%s", name);
        OK(kt_session_tensor(s, KT_ROLE_GRAD, name, &v));
        double e = compare(ref, key, &v, r->arch, 1e-4);
        worst = e > worst ? e : worst;
        n_grads++;
    }
    for (int m = 0; r->grads && r->mode != KT_MOE_FROZEN && m < n_moe; m++) {
        kt_program_moe info;
        OK(kt_program_moe_info(p, m, &info));
        for (int64_t e = 0; e < info.n_experts; e++)
            for (int proj = 0; proj < 3; proj++)
                for (int b = 0; b < (r->mode == KT_MOE_LORA ? 2 : 1); b++) {
                    char name[160], key[200];
                    const char *suffix = r->mode == KT_MOE_FULL ? "weight"
                                         : b               ? "lora_B.weight"
                                                           : "lora_A.weight";
                    OK(kt_moe_tensor_name(info.names, info.binding, e, (kt_moe_proj)proj,
                                          suffix, name, sizeof name));
                    snprintf(key, sizeof key, "grad.%s", name);
                    kt_moe *layer = layers.layers[info.binding];
                    if (r->mode == KT_MOE_FULL)
                        OK(kt_moe_weight_grad(layer, e, (kt_moe_proj)proj, &v));
                    else
                        OK(kt_moe_lora_grad(layer, e, (kt_moe_proj)proj, b, &v));
                    double er = compare(ref, key, &v, r->arch, 1e-4);
                    worst = er > worst ? er : worst;
                    n_grads++;
                }
    }
    if (r->grads) {
        print_message("%s (%s): %d gradients, worst rel err %.3g\n", r->arch, r->ref, n_grads,
                      worst);
        assert_true(n_grads > 0);
    }
    kt_session_destroy(s);
    kt_moe_layers_destroy(&layers);
    kt_program_destroy(p);
    kt_st_close(ref);
}

/* f32, full fine-tuning: every architecture (and the sharded Mixtral) against transformers
 * within the tolerances: logits 1e-5 of the largest, loss 1e-5 (about 2e-6
 * relative), every gradient 1e-4 of its largest. */
static void test_run_against_transformers(void **state)
{
    (void)state;
    for (size_t a = 0; a < N_ARCHS; a++) {
        char ref[256];
        snprintf(ref, sizeof ref, "%s/reference.safetensors", archs[a]);
        char p[1400];
        snprintf(p, sizeof p, "%s/%s", KT_HF_FIXTURES, ref);
        if (!exists(p))
            fail_msg("no fixture %s (tests/hf/make_fixtures.py writes it)", p);
        run_spec r = {.arch = archs[a], .ref = ref, .mode = KT_MOE_FULL,
                      .expert_dtype = KT_F32, .logits_key = "logits", .loss_key = "loss",
                      .tol_logits = 1e-5, .tol_loss = 1e-5, .grads = 1};
        run_case(&r);
    }
}

/* --aux-loss: the loss adds router_aux_loss_coef x the load-balancing loss over every MoE
 * layer's router rows, as transformers with output_router_logits. */
static void test_run_aux_loss(void **state)
{
    (void)state;
    static const char *const cases[] = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"};
    for (int i = 0; i < 4; i++) {
        need_fixture(cases[i]);
        char ref[256];
        snprintf(ref, sizeof ref, "%s/reference.safetensors", cases[i]);
        run_spec r = {.arch = cases[i], .ref = ref, .o = {.aux_loss = 1}, .mode = KT_MOE_FULL,
                      .expert_dtype = KT_F32, .logits_key = "logits", .loss_key = "loss",
                      .tol_logits = 1e-5, .tol_loss = 1e-5};
        run_case(&r);
    }
}

/* LoRA (rank 4, alpha 8) on the attention projections and the routed experts, with the
 * fixture's non-zero adapters: logits, loss and every adapter's gradient. */
static void test_run_lora(void **state)
{
    (void)state;
    static const char *const cases[][2] = {{"qwen3_moe", "qwen3_moe_lora"},
                                           {"mixtral", "mixtral_lora"}};
    for (int i = 0; i < 2; i++) {
        char ref[256], p[1400];
        snprintf(ref, sizeof ref, "%s/lora_reference.safetensors", cases[i][1]);
        snprintf(p, sizeof p, "%s/%s", KT_HF_FIXTURES, ref);
        if (!exists(p))
            fail_msg("no fixture %s (tests/hf/make_fixtures.py writes it)", p);
        run_spec r = {.arch = cases[i][0], .ref = ref,
                      .o = {.lora_rank = 4, .lora_alpha = 8,
                            .lora_targets =
                                "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"},
                      .mode = KT_MOE_LORA, .expert_dtype = KT_F32, .logits_key = "logits",
                      .loss_key = "loss", .tol_logits = 1e-5, .tol_loss = 1e-5, .grads = 1};
        run_case(&r);
    }
}

/* The bf16 checkpoints with a bf16 frozen base (LoRA adapters at PEFT's init, B = 0, so the
 * model is the base). With f32 expert weights (the bf16 values widened) the model is the
 * bf16 weights computed in f32, as transformers' logits_f32: the f32 tolerances.
 * With bf16 experts (the MoE layer's bf16 GEMMs) against transformers' own bf16 run, within
 * the fixtures' bf16 tolerance: logits 5e-2 of the largest, loss 1e-2 relative. */
static void test_run_bf16(void **state)
{
    (void)state;
    static const char *const cases[] = {"qwen3_moe_bf16", "deepseek_v3_bf16"};
    for (int i = 0; i < 2; i++) {
        need_fixture(cases[i]);
        char ref[256];
        snprintf(ref, sizeof ref, "%s/reference.safetensors", cases[i]);
        run_spec r = {.arch = cases[i], .ref = ref,
                      .o = {.lora_rank = 4, .lora_alpha = 8, .dtype = KT_BF16},
                      .mode = KT_MOE_LORA, .expert_dtype = KT_F32, .logits_key = "logits_f32",
                      .loss_key = "loss_f32", .tol_logits = 1e-5, .tol_loss = 1e-5};
        run_case(&r);
        r.expert_dtype = KT_BF16;
        r.logits_key = "logits";
        r.loss_key = "loss";
        r.tol_logits = 5e-2;
        r.tol_loss = 5e-2; /* 1e-2 relative at a loss of about 5 */
        run_case(&r);
    }
}

/* ---- bad input ---- */

/* A copy of the qwen3_moe fixture in KT_HF_WORK/bad with config.json's text and the
 * checkpoint's tensors edited: `drop` left out, `add` added ([4] f32), `reshape` given
 * one row less. */
static void make_bad(const char *config_from, const char *config_to, const char *drop,
                     const char *add, const char *reshape, char *dir, size_t size)
{
    char src[1024], path[1200];
    fixture("qwen3_moe", src, sizeof src);
    snprintf(dir, size, "%s/bad", KT_HF_WORK);
    mkdir(KT_HF_WORK, 0777);
    rm_dir(dir);
    assert_int_equal(mkdir(dir, 0777), 0);
    snprintf(path, sizeof path, "%s/config.json", src);
    size_t len;
    char *text = slurp(path, &len);
    assert_non_null(text);
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *at = config_from ? strstr(text, config_from) : NULL;
    if (config_from != NULL && at == NULL)
        fail_msg("config.json has no '%s'", config_from);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (at == NULL) {
        fwrite(text, 1, len, f);
    } else {
        fwrite(text, 1, (size_t)(at - text), f);
        fputs(config_to, f);
        fputs(at + strlen(config_from), f);
    }
    fclose(f);
    free(text);
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    kt_st_file *in = NULL;
    OK(kt_st_open(path, &in));
    size_t n = kt_st_count(in), k = 0;
    kt_st_item *items = calloc(n + 1, sizeof *items);
    float extra[4] = {0};
    for (size_t i = 0; i < n; i++) {
        OK(kt_st_entry(in, i, &items[k].name, &items[k].tensor));
        if (drop && strcmp(items[k].name, drop) == 0)
            continue;
        if (reshape && strcmp(items[k].name, reshape) == 0) {
            items[k].tensor.shape[0]--; /* row-major: the strides stay valid */
        }
        k++;
    }
    if (add != NULL) {
        items[k].name = add;
        OK(kt_tensor_init(&items[k].tensor, extra, KT_F32, 1, (const int64_t[]){4}));
        k++;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    OK(kt_st_save(path, items, k, NULL));
    free(items);
    kt_st_close(in);
}

static void expect_refused3(const char *dir, const kt_hf_options *o, kt_status status,
                            const char *what, const char *what2, const char *what3)
{
    char out[1024];
    out_dir("bad_out", out, sizeof out);
    TU_EXPECT_ERROR(kt_hf_import(dir, o, out), status, what, what2, what3);
    assert_false(exists(out)); /* nothing written, not even the directory */
    /* and an earlier import at OUT stays as it was */
    char src[1024], path[1200];
    fixture("qwen3_moe", src, sizeof src);
    OK(kt_hf_import(src, NULL, out));
    snprintf(path, sizeof path, "%s/model.ktg", out);
    size_t before_len, after_len;
    char *before = slurp(path, &before_len);
    assert_int_not_equal(kt_hf_import(dir, o, out), KT_OK);
    char *after = slurp(path, &after_len);
    assert_non_null(after);
    assert_int_equal(before_len, after_len);
    assert_memory_equal(before, after, before_len);
    free(before);
    free(after);
}

static void expect_refused(const char *dir, const kt_hf_options *o, kt_status status,
                           const char *what, const char *what2)
{
    expect_refused3(dir, o, status, what, what2, "");
}

static void test_bad_input(void **state)
{
    (void)state;
    need_fixture("qwen3_moe");
    char dir[1024], path[1200];
    kt_hf_options o = {.batch = 1, .seq = 8};
    /* config.json */
    make_bad("{", "{,", NULL, NULL, NULL, dir, sizeof dir);
    expect_refused(dir, &o, KT_EFORMAT, "config.json: not JSON", "JSON at byte");
    make_bad("\"qwen3_moe\"", "\"qwen3_next\"", NULL, NULL, NULL, dir, sizeof dir);
    expect_refused(dir, &o, KT_EUNSUPPORTED, "config.json", "'model_type' = \"qwen3_next\"");
    make_bad("\"silu\"", "\"gelu_pytorch_tanh\"", NULL, NULL, NULL, dir, sizeof dir);
    expect_refused(dir, &o, KT_EUNSUPPORTED, "config.json", "'hidden_act' = \"gelu_pytorch_tanh\"");
    /* tensors: missing, extra, misshapen */
    make_bad(NULL, NULL, "model.layers.1.self_attn.k_norm.weight", NULL, NULL, dir, sizeof dir);
    expect_refused(dir, &o, KT_EFORMAT, "bad/model.safetensors",
                   "'model.layers.1.self_attn.k_norm.weight' [");
    make_bad(NULL, NULL, "model.layers.0.mlp.experts.3.down_proj.weight", NULL, NULL, dir,
             sizeof dir);
    expect_refused(dir, &o, KT_EFORMAT, "bad/model.safetensors",
                   "'model.layers.0.mlp.experts.3.down_proj.weight' [");
    make_bad(NULL, NULL, NULL, "model.layers.0.mlp.experts.8.up_proj.weight", NULL, dir,
             sizeof dir);
    expect_refused(dir, &o, KT_EFORMAT, "bad/model.safetensors",
                   "'model.layers.0.mlp.experts.8.up_proj.weight' [4] is not part of the model");
    make_bad(NULL, NULL, NULL, NULL, "model.layers.0.self_attn.q_proj.weight", dir, sizeof dir);
    expect_refused3(dir, &o, KT_EFORMAT, "bad/model.safetensors",
                    "'model.layers.0.self_attn.q_proj.weight' has shape [", "model needs [");
    /* a truncated file */
    make_bad(NULL, NULL, NULL, NULL, NULL, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(truncate(path, st.st_size - 100), 0);
    expect_refused(dir, &o, KT_EFORMAT, "bad/model.safetensors", "");
    /* no checkpoint at all */
    unlink(path);
    expect_refused(dir, &o, KT_EIO, "bad", "not a checkpoint directory");
    /* options the model cannot take */
    make_bad(NULL, NULL, NULL, NULL, NULL, dir, sizeof dir);
    kt_hf_options bf16 = {.dtype = KT_BF16};
    expect_refused(dir, &bf16, KT_EINVAL, "bf16 needs LoRA", "");
    kt_hf_options t = {.lora_rank = 2, .lora_alpha = 4, .lora_targets = "q_proj,kv_b_proj"};
    expect_refused(dir, &t, KT_EINVAL, "'kv_b_proj' names no module", "");
    kt_hf_options part = {.lora_rank = 2, .lora_alpha = 4, .lora_targets = "gate_proj"};
    expect_refused(dir, &part, KT_EINVAL, "cover the three together", "");
    kt_hf_options unknown = {.lora_rank = 2, .lora_alpha = 4, .lora_targets = "q_proj,qkv"};
    expect_refused(dir, &unknown, KT_EINVAL, "'qkv' is not one of", "");
    rm_dir(dir);
}

/* A sharded checkpoint: a shard missing, and an extra tensor named with its shard. */
static void test_bad_sharded(void **state)
{
    (void)state;
    need_fixture("mixtral_sharded");
    static const char *const files[] = {"config.json", "model.safetensors.index.json",
                                        "model-00001-of-00003.safetensors",
                                        "model-00002-of-00003.safetensors",
                                        "model-00003-of-00003.safetensors"};
    char src[1024], dir[1024], from[1200], to[1200], out[1024];
    fixture("mixtral_sharded", src, sizeof src);
    snprintf(dir, sizeof dir, "%s/bad_sharded", KT_HF_WORK);
    mkdir(KT_HF_WORK, 0777);
    for (int i = 0; i < 5; i++) {
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        unlink(to);
    }
    rmdir(dir);
    assert_int_equal(mkdir(dir, 0777), 0);
    for (int i = 0; i < 5; i++) {
        size_t len;
        snprintf(from, sizeof from, "%s/%s", src, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        char *data = slurp(from, &len);
        assert_non_null(data);
        spit(to, data, len);
        free(data);
    }
    out_dir("bad_sharded_out", out, sizeof out);
    OK(kt_hf_import(dir, NULL, out)); /* the copy itself is fine */
    rm_dir(out);
    /* an extra tensor in the third shard, listed in the index */
    snprintf(to, sizeof to, "%s/%s", dir, files[4]);
    kt_st_file *f = NULL;
    OK(kt_st_open(to, &f));
    size_t n = kt_st_count(f);
    kt_st_item *items = calloc(n + 1, sizeof *items);
    for (size_t i = 0; i < n; i++)
        OK(kt_st_entry(f, i, &items[i].name, &items[i].tensor));
    float extra[2] = {0};
    items[n].name = "model.layers.0.mlp.bias";
    OK(kt_tensor_init(&items[n].tensor, extra, KT_F32, 1, (const int64_t[]){2}));
    char tmp[1300];
    snprintf(tmp, sizeof tmp, "%s.new", to);
    OK(kt_st_save(tmp, items, n + 1, NULL));
    free(items);
    kt_st_close(f);
    assert_int_equal(rename(tmp, to), 0);
    snprintf(to, sizeof to, "%s/%s", dir, files[1]);
    size_t len;
    char *index = slurp(to, &len);
    char *map = strstr(index, "\"weight_map\": {");
    assert_non_null(map);
    map += strlen("\"weight_map\": {");
    FILE *w = fopen(to, "wb");
    fwrite(index, 1, (size_t)(map - index), w);
    fprintf(w, "\"model.layers.0.mlp.bias\": \"%s\",", files[4]);
    fputs(map, w);
    fclose(w);
    free(index);
    TU_EXPECT_ERROR(kt_hf_import(dir, NULL, out), KT_EFORMAT, files[4],
                    "'model.layers.0.mlp.bias' [2] is not part of the model");
    assert_false(exists(out));
    /* a shard the index names is missing */
    snprintf(to, sizeof to, "%s/%s", dir, files[3]);
    unlink(to);
    TU_EXPECT_ERROR(kt_hf_import(dir, NULL, out), KT_EIO, files[3]);
    assert_false(exists(out));
}

/* The decode twin's context: C slots, at least 2 (a cached token beside the new one). */
static void test_decode_context(void **state)
{
    (void)state;
    need_fixture("llama");
    char src[1024], out[1024], path[1200];
    fixture("llama", src, sizeof src);
    out_dir("context", out, sizeof out);
    kt_hf_options o = {.seq = 8, .context = 1};
    TU_EXPECT_ERROR(kt_hf_import(src, &o, out), KT_EINVAL, "context 1", "at least 2");
    assert_false(exists(out));
    o.context = 40;
    OK(kt_hf_import(src, &o, out));
    snprintf(path, sizeof path, "%s/model_decode.ktg", out);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[256];
    int found = 0;
    while (fgets(line, sizeof line, f) != NULL)
        found |= strncmp(line, "const C = 40 ", 13) == 0;
    fclose(f);
    assert_true(found);
    rm_dir(out);
}

static void test_out_dir(void **state)
{
    (void)state;
    need_fixture("qwen3_moe");
    char src[1024], out[1024], path[1200];
    fixture("qwen3_moe", src, sizeof src);
    out_dir("user", out, sizeof out);
    /* a directory holding someone else's file is never replaced */
    assert_int_equal(mkdir(out, 0777), 0);
    snprintf(path, sizeof path, "%s/user.txt", out);
    spit(path, "mine", 4);
    TU_EXPECT_ERROR(kt_hf_import(src, NULL, out), KT_EINVAL, "holds 'user.txt'");
    assert_true(exists(path));
    unlink(path);
    /* an empty one is, and so is an earlier import; a file is refused */
    OK(kt_hf_import(src, NULL, out));
    snprintf(path, sizeof path, "%s/model.ktp", out);
    assert_true(exists(path));
    kt_hf_options o = {.batch = 3, .seq = 8};
    OK(kt_hf_import(src, &o, out));
    snprintf(path, sizeof path, "%s/model.ktg", out);
    char *text = slurp(path, NULL);
    assert_non_null(strstr(text, "const B = 3"));
    free(text);
    rm_dir(out);
    spit(out, "x", 1);
    TU_EXPECT_ERROR(kt_hf_import(src, NULL, out), KT_EINVAL, "not a directory");
    unlink(out);
    TU_EXPECT_ERROR(kt_hf_import(src, NULL, KT_HF_WORK "/no/such/dir"), KT_EINVAL,
                    "parent directory does not exist");
    /* no leftovers beside OUT */
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s/.user.kt-import-tmp.%ld", KT_HF_WORK, (long)getpid());
    assert_false(exists(tmp));
}

/* ---- --segments: packed documents never attend across ---- */

typedef struct imported {
    kt_program *p;
    kt_moe_layers layers;
    kt_session *s;
    int64_t seq, vocab;
} imported;

static void import_and_open(const char *arch, int64_t seq, int segments, const char *name,
                            imported *m)
{
    char src[1024], out[1024], path[1200];
    fixture(arch, src, sizeof src);
    out_dir(name, out, sizeof out);
    kt_hf_options o = {.batch = 1, .seq = seq, .segments = segments};
    OK(kt_hf_import(src, &o, out));
    snprintf(path, sizeof path, "%s/model.ktp", out);
    memset(m, 0, sizeof *m);
    m->seq = seq;
    OK(kt_program_load(path, &m->p));
    kt_moe_layers_options mo = {.weight_dtype = KT_F32, .mode = KT_MOE_FULL};
    OK(kt_moe_layers_create(m->p, &mo, NULL, &m->layers));
    kt_session_options so = {.threads = 1, .optimizer = {.kind = KT_OPTIM_NONE},
                             .moe_layers = m->layers.layers, .n_moe_layers = m->layers.n};
    OK(kt_session_create(m->p, &so, &m->s));
    OK(kt_session_load(m->s, src, 0));
}

static void close_imported(imported *m)
{
    kt_session_destroy(m->s);
    kt_moe_layers_destroy(&m->layers);
    kt_program_destroy(m->p);
}

/* Forward on ids [seq] (segments: the document of each token, or NULL); the logits view. */
static kt_tensor forward_ids(imported *m, const int64_t *ids, const int64_t *segments)
{
    kt_tensor v;
    const char *inputs[3] = {"input_ids", "labels", "segments"};
    for (int k = 0; k < (segments != NULL ? 3 : 2); k++) {
        OK(kt_session_tensor(m->s, KT_ROLE_INPUT, inputs[k], &v));
        memcpy(v.data, k == 2 ? segments : ids, sizeof *ids * (size_t)m->seq);
    }
    OK(kt_session_forward(m->s));
    OK(kt_session_tensor(m->s, KT_ROLE_OUTPUT, "logits", &v));
    m->vocab = v.shape[2];
    return v;
}

/* The largest |a - b| of `rows` rows of logits, relative to the largest |b|. */
static double rows_diff(const kt_tensor *a, int64_t a_row, const kt_tensor *b, int64_t b_row,
                        int64_t rows, int64_t vocab)
{
    const float *x = (const float *)a->data + a_row * vocab;
    const float *y = (const float *)b->data + b_row * vocab;
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < rows * vocab; i++) {
        worst = fmax(worst, fabs((double)x[i] - y[i]));
        scale = fmax(scale, fabs((double)y[i]));
    }
    return worst / scale;
}

/* Two documents packed into one sequence with segments give each document's logits as if it
 * ran alone (RoPE's scores depend on relative positions only): the second document sees
 * nothing of the first. Without the segments it does (the control: the check can fail). GQA
 * (Qwen3-MoE) and multi-head latent attention (DeepSeek-V2). */
static void test_segments_isolate_documents(void **state)
{
    (void)state;
    static const char *const seg_archs[] = {"qwen3_moe", "deepseek_v2"};
    enum { HALF = 4 };
    for (size_t c = 0; c < sizeof seg_archs / sizeof seg_archs[0]; c++) {
        need_fixture(seg_archs[c]);
        imported packed, alone;
        import_and_open(seg_archs[c], 2 * HALF, 1, "seg_packed", &packed);
        import_and_open(seg_archs[c], HALF, 0, "seg_alone", &alone);
        int64_t ids[2 * HALF], docs[2 * HALF], one_doc[2 * HALF] = {0};
        for (int i = 0; i < 2 * HALF; i++) {
            ids[i] = (7 * i + 3) % 100;
            docs[i] = i / HALF;
        }
        kt_tensor both = forward_ids(&packed, ids, docs);
        double d_first, d_second, d_crossed;
        kt_tensor first = forward_ids(&alone, ids, NULL);
        d_first = rows_diff(&both, 0, &first, 0, HALF, packed.vocab);
        kt_tensor second = forward_ids(&alone, ids + HALF, NULL);
        d_second = rows_diff(&both, HALF, &second, 0, HALF, packed.vocab);
        both = forward_ids(&packed, ids, one_doc);
        d_crossed = rows_diff(&both, HALF, &second, 0, HALF, packed.vocab);
        print_message("%s: packed with segments vs alone: first document %.3g, second %.3g; "
                      "without segments %.3g\n", seg_archs[c], d_first, d_second, d_crossed);
        assert_true(d_first <= 1e-5 && d_second <= 1e-5);
        assert_true(d_crossed > 1e-3);
        close_imported(&packed);
        close_imported(&alone);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_numbers),
        cmocka_unit_test(test_config_reads),
        cmocka_unit_test(test_config_refusals),
        cmocka_unit_test(test_import_fixtures),
        cmocka_unit_test(test_import_lora),
        cmocka_unit_test(test_import_lora_bf16),
        cmocka_unit_test(test_run_against_transformers),
        cmocka_unit_test(test_run_aux_loss),
        cmocka_unit_test(test_run_lora),
        cmocka_unit_test(test_run_bf16),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_bad_sharded),
        cmocka_unit_test(test_decode_context),
        cmocka_unit_test(test_out_dir),
        cmocka_unit_test(test_segments_isolate_documents),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
