/* The whole model.ktg: header, the config's sizes as consts, the embedding, the decoder
 * layers (runs of dense and MoE layers, each run one repeat), the final norm and lm_head,
 * the shifted cross-entropy and the optional load-balancing loss. Or its decode twin
 * (model_decode.ktg, e->context > 0): the same layers fed NEW tokens a step and their key/value
 * cache, the logits and the new keys and values out, no loss. */
#include <stdio.h>
#include <string.h>

#include "lib/hf/hf_internal.h"

static const char *arch_title(kt__hf_arch a)
{
    switch (a) {
    case KT__HF_LLAMA:
        return "Llama (transformers' LlamaForCausalLM)";
    case KT__HF_QWEN2:
        return "Qwen2 (transformers' Qwen2ForCausalLM): q/k/v biases";
    case KT__HF_QWEN3:
        return "Qwen3 (transformers' Qwen3ForCausalLM): per-head q/k RMSNorm before RoPE";
    case KT__HF_MIXTRAL:
        return "Mixtral (transformers' MixtralForCausalLM): softmax router, top-k "
               "renormalised, experts w1/w3/w2";
    case KT__HF_QWEN2_MOE:
        return "Qwen2-MoE (transformers' Qwen2MoeForCausalLM): softmax router, a "
               "sigmoid-gated shared expert, q/k/v biases";
    case KT__HF_QWEN3_MOE:
        return "Qwen3-MoE (transformers' Qwen3MoeForCausalLM): softmax router, per-head q/k "
               "RMSNorm";
    case KT__HF_OLMOE:
        return "OLMoE (transformers' OlmoeForCausalLM): softmax router, q/k RMSNorm over "
               "the whole projections";
    case KT__HF_DEEPSEEK_V2:
        return "DeepSeek-V2 (transformers' DeepseekV2ForCausalLM): multi-head latent "
               "attention, softmax router, shared experts";
    case KT__HF_DEEPSEEK_V3:
        return "DeepSeek-V3 (transformers' DeepseekV3ForCausalLM): multi-head latent "
               "attention, sigmoid router with the score-correction bias, shared experts";
    }
    return "?";
}

static const char *expert_key(kt__hf_arch a)
{
    switch (a) {
    case KT__HF_MIXTRAL:
    case KT__HF_QWEN3_MOE:
        return "num_local_experts";
    case KT__HF_DEEPSEEK_V2:
    case KT__HF_DEEPSEEK_V3:
        return "n_routed_experts";
    default:
        return "num_experts";
    }
}

static int has_dense_layer(const kt__hf_config *c)
{
    for (int64_t l = 0; l < c->layers; l++)
        if (!c->moe_layer[l])
            return 1;
    return 0;
}

static int has_moe_layer(const kt__hf_config *c)
{
    for (int64_t l = 0; l < c->layers; l++)
        if (c->moe_layer[l])
            return 1;
    return 0;
}

static void konst(kt__hf_emit *e, const char *name, long long v, const char *comment)
{
    char head[64];
    snprintf(head, sizeof head, "const %s = %lld", name, v);
    kt__hf_line(e, "%-21s # %s", head, comment);
}

static void emit_header(kt__hf_emit *e, const char *source)
{
    const kt__hf_config *c = e->cfg;
    kt__hf_line(e, "# %s", arch_title(c->arch));
    char src[1024]; /* a comment line: no control characters (a newline would end it) */
    snprintf(src, sizeof src, "%s", source);
    for (char *ch = src; *ch != '\0'; ch++)
        if ((unsigned char)*ch < 0x20 || *ch == 0x7f)
            *ch = '?';
    kt__hf_line(e, "# Imported by kt-import from %s", src);
    kt__hf_line(e, "# (config.json: model_type \"%s\"); the parameters carry the checkpoint's "
                   "names and", c->model_type);
    kt__hf_line(e, "# shapes and are read from there by name (kt_session_load, kt-run/kt-train "
                   "--params).");
    if (has_moe_layer(c))
        kt__hf_line(e, "# The routed experts run in the session's MoE layers (the moe op), "
                       "under the checkpoint's names.");
    if (e->context > 0) {
        kt__hf_line(e, "# The decode twin of model.ktg (the same parameters under the same names) "
                       "for kt-generate:");
        kt__hf_line(e, "# each step feeds S = NEW new tokens, their positions and every layer's "
                       "cached keys and");
        kt__hf_line(e, "# values (past_k<l>, past_v<l>: the C - S slots before the new ones), "
                       "and reads back the");
        kt__hf_line(e, "# logits and the new tokens' keys and values (k<l>, v<l>, after RoPE). "
                       "segments marks the");
        kt__hf_line(e, "# slots: 0 filled or new, 1 empty (never attended). kt-generate sets "
                       "NEW and may set C.");
        return;
    }
    if (e->lora_rank > 0)
        kt__hf_line(e, "# Fine-tuning: LoRA rank %lld, alpha %g; every base weight is frozen "
                       "(%s).", (long long)e->lora_rank, e->lora_alpha,
                    e->bf16 ? "the matrices in bf16" : "f32");
    else
        kt__hf_line(e, "# Fine-tuning: full, f32 master weights.");
    kt__hf_line(e, "# Loss: mean cross-entropy over the shifted labels (-100 ignored)%s.",
                e->aux_loss ? " plus router_aux_loss_coef x the load-balancing loss" : "");
}

static void emit_consts(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    int deepseek = c->arch == KT__HF_DEEPSEEK_V2 || c->arch == KT__HF_DEEPSEEK_V3;
    if (e->context > 0) {
        konst(e, "C", e->context, "the context: prompt and new tokens (kt-import --context)");
        konst(e, "NEW", 1, "new tokens a step (kt-generate sets it)");
        kt__hf_line(e, "const B = 1");
        kt__hf_line(e, "const S = NEW");
    } else {
        konst(e, "B", e->batch, "sequences per step (kt-import --batch)");
        konst(e, "S", e->seq, "tokens per sequence (kt-import --seq)");
    }
    kt__hf_line(e, "const N = B * S");
    konst(e, "VOCAB", c->vocab, "vocab_size");
    konst(e, "H", c->hidden, "hidden_size");
    konst(e, "L", c->layers, "num_hidden_layers");
    if (deepseek) {
        konst(e, "NH", c->heads, "num_attention_heads (= num_key_value_heads)");
        if (c->q_lora_rank > 0)
            konst(e, "QR", c->q_lora_rank, "q_lora_rank");
        konst(e, "KVR", c->kv_lora_rank, "kv_lora_rank");
        konst(e, "DN", c->qk_nope, "qk_nope_head_dim");
        konst(e, "DR", c->qk_rope, "qk_rope_head_dim");
        konst(e, "DV", c->v_head, "v_head_dim");
    } else {
        konst(e, "HQ", c->heads, "num_attention_heads");
        konst(e, "HKV", c->kv_heads, "num_key_value_heads");
        konst(e, "D", c->head_dim, "head_dim (explicit, or hidden_size / num_attention_heads)");
    }
    if (has_dense_layer(c))
        konst(e, "DI", c->intermediate, "intermediate_size (the dense MLP)");
    if (has_moe_layer(c)) {
        konst(e, "E", c->n_experts, expert_key(c->arch));
        konst(e, "TOPK", c->top_k, "num_experts_per_tok");
        konst(e, "I", c->moe_intermediate,
              c->arch == KT__HF_MIXTRAL || c->arch == KT__HF_OLMOE
                  ? "intermediate_size (each expert)"
                  : "moe_intermediate_size (each expert)");
        if (c->arch == KT__HF_QWEN2_MOE)
            konst(e, "SI", c->shared_intermediate, "shared_expert_intermediate_size");
        if (deepseek) {
            konst(e, "NS", c->shared_intermediate / c->moe_intermediate, "n_shared_experts");
            if (c->n_group > 1) {
                konst(e, "G", c->n_group, "n_group");
                konst(e, "TG", c->topk_group, "topk_group");
            }
        }
    }
    if (e->lora_rank > 0)
        konst(e, "R", e->lora_rank, "LoRA rank (kt-import --lora-rank)");
}

static void emit_dense_mlp(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    kt__hf_norm(e, "n", "h", "post_attention_layernorm", "H", c->eps);
    kt__hf_swiglu(e, "f", "n", "mlp", "DI", c->intermediate, c->mlp_bias);
    kt__hf_line(e, "h = add(h, f)");
}

/* "L" for the layer count, else the number. */
static void bound(const kt__hf_config *c, int64_t v, char *out, size_t size)
{
    if (v == c->layers)
        snprintf(out, size, "L");
    else
        snprintf(out, size, "%lld", (long long)v);
}

static void emit_layers(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    int deepseek = c->arch == KT__HF_DEEPSEEK_V2 || c->arch == KT__HF_DEEPSEEK_V3;
    for (int64_t from = 0; from < c->layers;) {
        int moe = c->moe_layer[from];
        int64_t to = from + 1;
        while (to < c->layers && c->moe_layer[to] == moe)
            to++;
        char a[24], b[24];
        bound(c, from, a, sizeof a);
        bound(c, to, b, sizeof b);
        kt__hf_put(e->b, "\n");
        kt__hf_line(e, "# layers %lld..%lld: %s", (long long)from, (long long)to - 1,
                    moe ? "MoE" : "dense MLP");
        kt__hf_open(e, "repeat l in %s..%s", a, b);
        if (e->context > 0 && deepseek) {
            kt__hf_line(e, "input past_k{l}: f32[B, C - S, NH, DN + DR]");
            kt__hf_line(e, "input past_v{l}: f32[B, C - S, NH, DV]");
        } else if (e->context > 0) {
            kt__hf_line(e, "input past_k{l}: f32[B, C - S, HKV, D]");
            kt__hf_line(e, "input past_v{l}: f32[B, C - S, HKV, D]");
        }
        kt__hf_open(e, "scope model.layers.{l}");
        if (deepseek)
            kt__hf_emit_mla(e);
        else
            kt__hf_emit_gqa(e);
        if (moe)
            kt__hf_emit_moe(e);
        else
            emit_dense_mlp(e);
        kt__hf_close(e);
        if (e->context > 0) {
            kt__hf_line(e, "output k{l}");
            kt__hf_line(e, "output v{l}");
        }
        kt__hf_close(e);
        from = to;
    }
}

static void emit_aux_loss(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    char coef[40];
    kt__hf_float(coef, sizeof coef, c->aux_coef);
    kt__hf_put(e->b, "\n");
    kt__hf_line(e, "# the load-balancing loss over the router rows of every MoE layer, "
                   "concatenated as transformers does");
    int64_t first = 0;
    while (!c->moe_layer[first])
        first++;
    kt__hf_line(e, "all_logits = router_logits%lld", (long long)first);
    kt__hf_line(e, "all_ids = router_ids%lld", (long long)first);
    for (int64_t from = first + 1; from < c->layers;) {
        if (!c->moe_layer[from]) {
            from++;
            continue;
        }
        int64_t to = from + 1;
        while (to < c->layers && c->moe_layer[to])
            to++;
        char a[24], b[24];
        bound(c, from, a, sizeof a);
        bound(c, to, b, sizeof b);
        kt__hf_open(e, "repeat l in %s..%s", a, b);
        kt__hf_line(e, "all_logits = concat(all_logits, router_logits{l}, dim = 0)");
        kt__hf_line(e, "all_ids = concat(all_ids, router_ids{l}, dim = 0)");
        kt__hf_close(e);
        from = to;
    }
    kt__hf_line(e, "aux = load_balance_loss(all_logits, all_ids)");
    kt__hf_line(e, "aux = scale(aux, alpha = %s)    # router_aux_loss_coef", coef);
    kt__hf_line(e, "loss = add(loss, aux)");
}

void kt__hf_emit_model(kt__hf_emit *e, const char *source)
{
    const kt__hf_config *c = e->cfg;
    const char *big = e->bf16 ? "bf16" : "f32";
    const char *kw = kt__hf_param_kw(e);
    emit_header(e, source);
    kt__hf_put(e->b, "\n");
    emit_consts(e);
    kt__hf_put(e->b, "\n");
    const int decode = e->context > 0;
    if (decode) {
        kt__hf_line(e, "input tokens: i64[B, S]");
        kt__hf_line(e, "input positions: i64[B, S]");
        kt__hf_line(e, "input segments: i64[B, C]");
    } else {
        kt__hf_line(e, "input input_ids: i64[B, S]");
        kt__hf_line(e, "input labels: i64[B, S]");
    }
    if (e->segments && !decode)
        kt__hf_line(e, "input segments: i64[B, S]    # packed documents never attend across");
    kt__hf_put(e->b, "\n");
    kt__hf_line(e, "%s model.embed_tokens.weight: %s[VOCAB, H] = loaded", kw, big);
    kt__hf_line(e, "h = embedding(model.embed_tokens.weight, %s)", decode ? "tokens" : "input_ids");
    if (e->bf16)
        kt__hf_line(e, "h = cast(h, dtype = f32)");
    kt__hf_line(e, "h = reshape(h, shape = [N, H])");
    emit_layers(e);
    kt__hf_put(e->b, "\n");
    kt__hf_norm(e, "h", "h", "model.norm", "H", c->eps);
    const char *flat = decode ? "logits" : "flat_logits";
    if (c->tie_embeddings) {
        kt__hf_line(e, "# tie_word_embeddings: lm_head is the embedding table");
        kt__hf_line(e, "%s = matmul(h, model.embed_tokens.weight, trans_b = 1)", flat);
    } else {
        kt__hf_line(e, "%s lm_head.weight: %s[VOCAB, H] = loaded", kw, big);
        kt__hf_line(e, "%s = matmul(h, lm_head.weight, trans_b = 1)", flat);
    }
    if (decode) {
        kt__hf_line(e, "output logits");
        return;
    }
    kt__hf_line(e, "logits = reshape(flat_logits, shape = [B, S, VOCAB])");
    kt__hf_put(e->b, "\n");
    kt__hf_line(e, "# transformers' causal-LM loss: position t predicts labels[t + 1]");
    kt__hf_line(e, "targets = shift_labels(labels, ignore_index = -100)");
    kt__hf_line(e, "targets = reshape(targets, shape = [N])");
    kt__hf_line(e, "loss = cross_entropy(flat_logits, targets, ignore_index = -100)");
    if (e->aux_loss)
        emit_aux_loss(e);
    kt__hf_put(e->b, "\n");
    kt__hf_line(e, "output logits");
    kt__hf_line(e, "loss loss");
}
