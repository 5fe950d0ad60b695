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
    const int64_t others[3] = {s->experts * s->hidden, s->inter * s->hidden,
                               s->heads * s->head_dim * s->hidden};
    for (int k = 0; k < 3; k++)
        largest = others[k] > largest ? others[k] : largest;
    w.pool_n = 2 * largest > ((int64_t)16 << 20) ? 2 * largest : (int64_t)16 << 20;
    w.ones_n = s->hidden > s->head_dim ? s->hidden : s->head_dim;
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
        rc = add_layer(&w, s, l);
    if (!rc)
        rc = add(&w, "model.norm.weight", s->hidden, 0, 1);
    if (!rc)
        rc = add(&w, "lm_head.weight", s->vocab, s->hidden, 0);
    if (!rc)
        rc = write_config(dir, s);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
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
