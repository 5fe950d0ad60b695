/* kt-bench train's LoRA model: a Hugging Face Qwen3-MoE directory with random bf16 weights,
 * which kt-import reads for libkt and from_pretrained for transformers, so that both sides
 * train the same weights. Written from C so that the libkt side needs no Python.
 *
 * Every tensor is a slice of one pool of random bf16 values, at an offset of its own: the
 * weights differ from tensor to tensor (routing and activations behave as with independent
 * draws) while the writer holds tens of MB rather than the whole checkpoint (2.4 GB of
 * experts at the benchmark's size). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-bench/bench_train.h"


typedef struct writer {
    kt_st_item *items;
    char **names;
    size_t n, cap;
    uint16_t *pool, *ones;
    int64_t pool_n, ones_n;
    uint64_t rng;
} writer;

static uint64_t next(uint64_t *s)
{
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

static int add(writer *w, const char *name, int64_t rows, int64_t cols, int ones)
{
    const int64_t n = rows * (cols > 0 ? cols : 1);
    if ((ones ? w->ones_n : w->pool_n) < n) {
        fprintf(stderr, "kt-bench train: tensor %s (%lld values) is larger than the writer's "
                "pool\n", name, (long long)n);
        return 1;
    }
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 64;
        kt_st_item *items = realloc(w->items, w->cap * sizeof *items);
        char **names = items ? realloc(w->names, w->cap * sizeof *names) : NULL;
        if (items != NULL)
            w->items = items;
        if (names == NULL) {
            fprintf(stderr, "kt-bench train: out of memory\n");
            return 1;
        }
        w->names = names;
    }
    const int64_t at = ones ? 0 : (int64_t)(next(&w->rng) % (uint64_t)(w->pool_n - n + 1));
    int64_t shape[2] = {rows, cols};
    w->names[w->n] = strdup(name);
    w->items[w->n].name = w->names[w->n];
    kt_tensor_init(&w->items[w->n].tensor, (ones ? w->ones : w->pool) + at, KT_BF16,
                   cols > 0 ? 2 : 1, shape);
    w->n++;
    return w->names[w->n - 1] == NULL;
}

static int write_config(const char *dir, const train_shape *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    kt_out_file *f;
    if (kt_out_open(path, &f) != KT_OK) {
        fprintf(stderr, "kt-bench train: %s\n", kt_last_error());
        return 1;
    }
    kt_out_printf(f,
        "{\n  \"architectures\": [\"Qwen3MoeForCausalLM\"],\n  \"model_type\": \"qwen3_moe\",\n"
        "  \"dtype\": \"bfloat16\",\n  \"vocab_size\": %lld,\n  \"hidden_size\": %lld,\n"
        "  \"num_hidden_layers\": %lld,\n  \"num_attention_heads\": %lld,\n"
        "  \"num_key_value_heads\": %lld,\n  \"head_dim\": %lld,\n"
        "  \"num_local_experts\": %lld,\n  \"num_experts_per_tok\": %lld,\n"
        "  \"moe_intermediate_size\": %lld,\n  \"intermediate_size\": %lld,\n"
        "  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [],\n"
        "  \"norm_topk_prob\": %s,\n  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": 1e-06,\n"
        "  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %.1f},\n"
        "  \"max_position_embeddings\": %lld,\n  \"attention_bias\": false,\n"
        "  \"attention_dropout\": 0.0,\n  \"use_sliding_window\": false,\n"
        "  \"sliding_window\": null,\n  \"tie_word_embeddings\": false,\n"
        "  \"output_router_logits\": false,\n  \"router_aux_loss_coef\": 0.001,\n"
        "  \"initializer_range\": 0.02,\n  \"pad_token_id\": null,\n  \"bos_token_id\": null,\n"
        "  \"eos_token_id\": null,\n  \"use_cache\": false\n}\n",
        (long long)s->vocab, (long long)s->hidden, (long long)s->layers, (long long)s->heads,
        (long long)s->kv_heads, (long long)s->head_dim, (long long)s->experts,
        (long long)s->top_k, (long long)s->inter, (long long)s->inter,
        s->norm_topk ? "true" : "false", s->rope_theta,
        (long long)(s->seq > 4096 ? s->seq : 4096));
    if (kt_out_commit(f) != KT_OK) {
        fprintf(stderr, "kt-bench train: %s\n", kt_last_error());
        return 1;
    }
    return 0;
}

/* DeepSeek-V2-Lite's config.json (transformers 4's keys as the model's repository has them),
 * at the shape's sizes. */
static int write_config_dsv2(const char *dir, const train_shape *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    kt_out_file *f;
    if (kt_out_open(path, &f) != KT_OK) {
        fprintf(stderr, "kt-bench train: %s\n", kt_last_error());
        return 1;
    }
    kt_out_printf(f,
        "{\n  \"architectures\": [\"DeepseekV2ForCausalLM\"],\n"
        "  \"attention_bias\": false,\n  \"attention_dropout\": 0.0,\n"
        "  \"aux_loss_alpha\": 0.001,\n  \"bos_token_id\": 100000,\n"
        "  \"eos_token_id\": 100001,\n  \"first_k_dense_replace\": %lld,\n"
        "  \"hidden_act\": \"silu\",\n  \"hidden_size\": %lld,\n"
        "  \"initializer_range\": 0.02,\n  \"intermediate_size\": %lld,\n"
        "  \"kv_lora_rank\": %lld,\n  \"max_position_embeddings\": 163840,\n"
        "  \"model_type\": \"deepseek_v2\",\n  \"moe_intermediate_size\": %lld,\n"
        "  \"moe_layer_freq\": 1,\n  \"n_group\": 1,\n  \"n_routed_experts\": %lld,\n"
        "  \"n_shared_experts\": %lld,\n  \"norm_topk_prob\": %s,\n"
        "  \"num_attention_heads\": %lld,\n  \"num_experts_per_tok\": %lld,\n"
        "  \"num_hidden_layers\": %lld,\n  \"num_key_value_heads\": %lld,\n"
        "  \"pretraining_tp\": 1,\n  \"q_lora_rank\": null,\n"
        "  \"qk_nope_head_dim\": %lld,\n  \"qk_rope_head_dim\": %lld,\n"
        "  \"rms_norm_eps\": 1e-06,\n"
        "  \"rope_scaling\": {\n    \"beta_fast\": 32,\n    \"beta_slow\": 1,\n"
        "    \"factor\": 40,\n    \"mscale\": 0.707,\n    \"mscale_all_dim\": 0.707,\n"
        "    \"original_max_position_embeddings\": 4096,\n    \"type\": \"yarn\"\n  },\n"
        "  \"rope_theta\": %.0f,\n  \"routed_scaling_factor\": 1.0,\n"
        "  \"scoring_func\": \"softmax\",\n  \"seq_aux\": true,\n"
        "  \"tie_word_embeddings\": false,\n  \"topk_group\": 1,\n"
        "  \"topk_method\": \"greedy\",\n  \"torch_dtype\": \"bfloat16\",\n"
        "  \"transformers_version\": \"4.33.1\",\n  \"use_cache\": true,\n"
        "  \"v_head_dim\": %lld,\n  \"vocab_size\": %lld\n}\n",
        (long long)s->first_dense, (long long)s->hidden, (long long)s->dense_inter,
        (long long)s->kv_lora, (long long)s->inter, (long long)s->experts,
        (long long)s->shared, s->norm_topk ? "true" : "false", (long long)s->heads,
        (long long)s->top_k, (long long)s->layers, (long long)s->kv_heads,
        (long long)s->qk_nope, (long long)s->qk_rope, s->rope_theta, (long long)s->v_head,
        (long long)s->vocab);
    if (kt_out_commit(f) != KT_OK) {
        fprintf(stderr, "kt-bench train: %s\n", kt_last_error());
        return 1;
    }
    return 0;
}

/* A DeepSeek-V2 layer without q LoRA: MLA (q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
 * kv_b_proj, o_proj), then a dense MLP (the first first_dense layers) or the router, the
 * routed experts and the shared experts (one MLP of shared * inter). */
static int add_layer_dsv2(writer *w, const train_shape *s, int64_t l)
{
    const int64_t H = s->hidden, NH = s->heads, I = s->inter, SI = s->shared * s->inter;
    char n[256];
    int rc = 0;
    const long long L = (long long)l;
#define ADD(rows, cols, ones, ...) \
    (snprintf(n, sizeof n, __VA_ARGS__), rc = rc ? rc : add(w, n, rows, cols, ones))
    ADD(H, 0, 1, "model.layers.%lld.input_layernorm.weight", L);
    ADD(H, 0, 1, "model.layers.%lld.post_attention_layernorm.weight", L);
    ADD(NH * (s->qk_nope + s->qk_rope), H, 0, "model.layers.%lld.self_attn.q_proj.weight", L);
    ADD(s->kv_lora + s->qk_rope, H, 0, "model.layers.%lld.self_attn.kv_a_proj_with_mqa.weight",
        L);
    ADD(s->kv_lora, 0, 1, "model.layers.%lld.self_attn.kv_a_layernorm.weight", L);
    ADD(NH * (s->qk_nope + s->v_head), s->kv_lora, 0,
        "model.layers.%lld.self_attn.kv_b_proj.weight", L);
    ADD(H, NH * s->v_head, 0, "model.layers.%lld.self_attn.o_proj.weight", L);
    if (l < s->first_dense) {
        ADD(s->dense_inter, H, 0, "model.layers.%lld.mlp.gate_proj.weight", L);
        ADD(s->dense_inter, H, 0, "model.layers.%lld.mlp.up_proj.weight", L);
        ADD(H, s->dense_inter, 0, "model.layers.%lld.mlp.down_proj.weight", L);
        return rc;
    }
    ADD(s->experts, H, 0, "model.layers.%lld.mlp.gate.weight", L);
    for (int64_t e = 0; e < s->experts && rc == 0; e++) {
        const long long E = (long long)e;
        ADD(I, H, 0, "model.layers.%lld.mlp.experts.%lld.gate_proj.weight", L, E);
        ADD(I, H, 0, "model.layers.%lld.mlp.experts.%lld.up_proj.weight", L, E);
        ADD(H, I, 0, "model.layers.%lld.mlp.experts.%lld.down_proj.weight", L, E);
    }
    if (SI > 0) {
        ADD(SI, H, 0, "model.layers.%lld.mlp.shared_experts.gate_proj.weight", L);
        ADD(SI, H, 0, "model.layers.%lld.mlp.shared_experts.up_proj.weight", L);
        ADD(H, SI, 0, "model.layers.%lld.mlp.shared_experts.down_proj.weight", L);
    }
#undef ADD
    return rc;
}

static int add_layer(writer *w, const train_shape *s, int64_t l)
{
    const int64_t H = s->hidden, D = s->head_dim, I = s->inter;
    char n[256];
    int rc = 0;
#define ADD(rows, cols, ones, ...) \
    (snprintf(n, sizeof n, __VA_ARGS__), rc = rc ? rc : add(w, n, rows, cols, ones))
    ADD(H, 0, 1, "model.layers.%lld.input_layernorm.weight", (long long)l);
    ADD(H, 0, 1, "model.layers.%lld.post_attention_layernorm.weight", (long long)l);
    ADD(s->heads * D, H, 0, "model.layers.%lld.self_attn.q_proj.weight", (long long)l);
    ADD(s->kv_heads * D, H, 0, "model.layers.%lld.self_attn.k_proj.weight", (long long)l);
    ADD(s->kv_heads * D, H, 0, "model.layers.%lld.self_attn.v_proj.weight", (long long)l);
    ADD(H, s->heads * D, 0, "model.layers.%lld.self_attn.o_proj.weight", (long long)l);
    ADD(D, 0, 1, "model.layers.%lld.self_attn.q_norm.weight", (long long)l);
    ADD(D, 0, 1, "model.layers.%lld.self_attn.k_norm.weight", (long long)l);
    ADD(s->experts, H, 0, "model.layers.%lld.mlp.gate.weight", (long long)l);
    for (int64_t e = 0; e < s->experts && rc == 0; e++) {
        ADD(I, H, 0, "model.layers.%lld.mlp.experts.%lld.gate_proj.weight", (long long)l,
            (long long)e);
        ADD(I, H, 0, "model.layers.%lld.mlp.experts.%lld.up_proj.weight", (long long)l,
            (long long)e);
        ADD(H, I, 0, "model.layers.%lld.mlp.experts.%lld.down_proj.weight", (long long)l,
            (long long)e);
    }
#undef ADD
    return rc;
}

int train_write_checkpoint(const char *dir, const train_shape *s, uint64_t seed)
{
    writer w = {.rng = seed * 0x9E3779B97F4A7C15ull + 1};
    int64_t largest = s->vocab * s->hidden; /* the pool: twice the largest tensor, >= 32 MB */
    const int64_t others[5] = {s->experts * s->hidden, s->inter * s->hidden,
                               s->heads * s->head_dim * s->hidden,
                               s->dense_inter * s->hidden,
                               s->heads * (s->qk_nope + s->qk_rope) * s->hidden};
    for (int k = 0; k < 5; k++)
        largest = others[k] > largest ? others[k] : largest;
    w.pool_n = 2 * largest > ((int64_t)16 << 20) ? 2 * largest : (int64_t)16 << 20;
    w.ones_n = s->hidden > s->head_dim ? s->hidden : s->head_dim;
    w.ones_n = s->kv_lora > w.ones_n ? s->kv_lora : w.ones_n;
    w.pool = malloc((size_t)w.pool_n * sizeof *w.pool);
    w.ones = malloc((size_t)w.ones_n * sizeof *w.ones);
    int rc = w.pool == NULL || w.ones == NULL;
    if (rc)
        fprintf(stderr, "kt-bench train: out of memory\n");
    /* normal(0.02) as transformers initialises, by the sum of four uniforms (variance 1/3
     * each: scaled to 0.02 overall) */
    for (int64_t i = 0; i < w.pool_n && !rc; i++) {
        double u = 0;
        for (int k = 0; k < 4; k++)
            u += (double)(next(&w.rng) >> 11) * (1.0 / 9007199254740992.0) - 0.5;
        w.pool[i] = kt_f32_to_bf16_1((float)(u * 0.02 * sqrt(3.0)));
    }
    for (int64_t i = 0; i < w.ones_n && !rc; i++)
        w.ones[i] = kt_f32_to_bf16_1(1.0f);
    if (!rc)
        rc = add(&w, "model.embed_tokens.weight", s->vocab, s->hidden, 0);
    for (int64_t l = 0; l < s->layers && rc == 0; l++)
        rc = s->deepseek_v2 ? add_layer_dsv2(&w, s, l) : add_layer(&w, s, l);
    if (!rc)
        rc = add(&w, "model.norm.weight", s->hidden, 0, 1);
    if (!rc)
        rc = add(&w, "lm_head.weight", s->vocab, s->hidden, 0);
    if (!rc)
        rc = s->deepseek_v2 ? write_config_dsv2(dir, s) : write_config(dir, s);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    int64_t bytes = 0;
    for (size_t i = 0; i < w.n; i++)
        bytes += 2 * kt_tensor_numel(&w.items[i].tensor);
    if (!rc)
        fprintf(stderr, "kt-bench train: writing %s: %zu tensors, %.2f GB of random bf16 "
                "(tensor by tensor from a %.0f MB pool)\n", path, w.n, (double)bytes / 1e9,
                (double)w.pool_n * 2 / 1e6);
    static const char *const meta[] = {"format", "pt", NULL};
    if (!rc && kt_st_save(path, w.items, w.n, meta) != KT_OK) {
        fprintf(stderr, "kt-bench train: %s\n", kt_last_error());
        rc = 1;
    }
    for (size_t i = 0; i < w.n; i++)
        free(w.names[i]);
    free(w.names);
    free(w.items);
    free(w.pool);
    free(w.ones);
    return rc;
}
