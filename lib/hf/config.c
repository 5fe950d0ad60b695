/* config.json -> kt__hf_config: every key that changes what transformers computes for the
 * nine architectures is read here; a value libkt cannot compute is an error naming it. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/config_json.h"
#include "lib/hf/hf_internal.h"

static const struct {
    const char *name;
    kt__hf_arch arch;
} archs[] = {
    {"llama", KT__HF_LLAMA},           {"qwen2", KT__HF_QWEN2},
    {"qwen3", KT__HF_QWEN3},           {"mixtral", KT__HF_MIXTRAL},
    {"qwen2_moe", KT__HF_QWEN2_MOE},   {"qwen3_moe", KT__HF_QWEN3_MOE},
    {"olmoe", KT__HF_OLMOE},           {"deepseek_v2", KT__HF_DEEPSEEK_V2},
    {"deepseek_v3", KT__HF_DEEPSEEK_V3},
};

#define BIG ((int64_t)1 << 40)

static int is_deepseek(const kt__hf_config *c)
{
    return c->arch == KT__HF_DEEPSEEK_V2 || c->arch == KT__HF_DEEPSEEK_V3;
}

static int is_qwen_moe(const kt__hf_config *c)
{
    return c->arch == KT__HF_QWEN2_MOE || c->arch == KT__HF_QWEN3_MOE;
}

/* A key that must hold `value` (or be absent): anything else would change the computation
 * in a way libkt does not follow. */
static kt_status require_bool(const kt__hf_json *j, const char *key, int value, const char *why)
{
    int v = value;
    KT__TRY(kt__hf_bool(j, key, &v));
    return v == value ? KT_OK : kt__hf_unsupported(j, key, why);
}

static kt_status require_zero(const kt__hf_json *j, const char *key, const char *why)
{
    double v = 0;
    KT__TRY(kt__hf_num(j, key, 0, -1e300, 1e300, &v));
    return v == 0 ? KT_OK : kt__hf_unsupported(j, key, why);
}

static kt_status read_rope(const kt__hf_json *top, kt__hf_config *c, int64_t rope_dim)
{
    kt__hf_rope *r = &c->rope;
    kt__hf_json rp = {NULL, top->path, "rope_parameters."};
    const kt__json_value *v = kt__hf_member(top, "rope_parameters");
    const char *rp_key = "rope_parameters";
    if (v == NULL) { /* transformers 4 wrote rope_scaling (+ a top-level rope_theta) */
        v = kt__hf_member(top, "rope_scaling");
        rp.where = "rope_scaling.";
        rp_key = "rope_scaling";
    }
    if (v != NULL && v->type != KT__JSON_OBJECT)
        return kt__hf_unsupported(top, rp_key, "expected an object");
    rp.obj = v;
    if (v != NULL)
        for (size_t i = 0; i < v->u.list.count; i++)
            if (v->u.list.items[i].type == KT__JSON_OBJECT)
                return kt__hf_unsupported(top, rp_key,
                                          "RoPE parameters per layer type are not supported");
    r->theta = c->arch == KT__HF_MIXTRAL ? 1e6 : 1e4; /* the classes' default_theta */
    KT__TRY(kt__hf_num(top, "rope_theta", 0, 1.0, 1e30, &r->theta));
    KT__TRY(kt__hf_num(&rp, "rope_theta", 0, 1.0, 1e30, &r->theta));
    if (r->theta < 2.0)
        return kt__hf_unsupported(&rp, "rope_theta", "libkt's rope needs theta >= 2");
    const char *type = NULL, *type_key = "rope_type";
    KT__TRY(kt__hf_str(&rp, "rope_type", &type));
    if (type == NULL) {
        KT__TRY(kt__hf_str(&rp, "type", &type));
        type_key = "type";
    }
    double prf = 1.0;
    KT__TRY(kt__hf_num(top, "partial_rotary_factor", 0, 0.0, 1.0, &prf));
    KT__TRY(kt__hf_num(&rp, "partial_rotary_factor", 0, 0.0, 1.0, &prf));
    r->rotary_dim = 0;
    if (prf != 1.0) {
        if (is_deepseek(c))
            return kt__hf_unsupported(top, "partial_rotary_factor",
                                      "DeepSeek's MLA rotates qk_rope_head_dim whole");
        int64_t d = (int64_t)((double)rope_dim * prf);
        if (d < 2 || d % 2 != 0)
            return kt__hf_unsupported(top, "partial_rotary_factor",
                                      "the rotated part of a head must be even and >= 2");
        r->rotary_dim = d == rope_dim ? 0 : d;
    }
    if (type == NULL || strcmp(type, "default") == 0) {
        r->type = KT__HF_ROPE_DEFAULT;
        return KT_OK;
    }
    if (strcmp(type, "linear") == 0) {
        r->type = KT__HF_ROPE_LINEAR;
        return kt__hf_num(&rp, "factor", 1, 1e-6, 1e30, &r->factor);
    }
    if (strcmp(type, "yarn") != 0)
        return kt__hf_unsupported(&rp, type_key,
                                  "libkt's rope computes the RoPE types default, linear and "
                                  "yarn only");
    r->type = KT__HF_ROPE_YARN;
    int64_t max_pos = 0, orig = 0;
    KT__TRY(kt__hf_int(top, "max_position_embeddings", 0, 1, INT32_MAX, &max_pos));
    orig = max_pos;
    KT__TRY(kt__hf_int(top, "original_max_position_embeddings", 0, 1, INT32_MAX, &orig));
    KT__TRY(kt__hf_int(&rp, "original_max_position_embeddings", 0, 1, INT32_MAX, &orig));
    if (orig == 0)
        return kt__error(KT_EFORMAT, "%s: yarn RoPE needs "
                         "rope_parameters.original_max_position_embeddings or "
                         "max_position_embeddings", top->path);
    r->original_max_positions = orig;
    r->factor = 0;
    KT__TRY(kt__hf_num(&rp, "factor", 0, 1e-6, 1e30, &r->factor));
    if (r->factor == 0) {
        if (max_pos == 0)
            return kt__error(KT_EFORMAT, "%s: yarn RoPE without a factor needs "
                             "max_position_embeddings", top->path);
        r->factor = (double)max_pos / (double)orig; /* transformers' rule for factor None */
    }
    r->beta_fast = 32; /* transformers: `or 32`, `or 1`: a 0 also means the default */
    r->beta_slow = 1;
    double bf = 0, bs = 0;
    KT__TRY(kt__hf_num(&rp, "beta_fast", 0, 0.0, 1e30, &bf));
    KT__TRY(kt__hf_num(&rp, "beta_slow", 0, 0.0, 1e30, &bs));
    if (bf != 0)
        r->beta_fast = bf;
    if (bs != 0)
        r->beta_slow = bs;
    KT__TRY(kt__hf_num(&rp, "mscale", 0, 0.0, 1e30, &r->mscale));
    KT__TRY(kt__hf_num(&rp, "mscale_all_dim", 0, 0.0, 1e30, &r->mscale_all_dim));
    KT__TRY(kt__hf_num(&rp, "attention_factor", 0, 0.0, 1e30, &r->attention_factor));
    r->truncate = 1;
    KT__TRY(kt__hf_bool(&rp, "truncate", &r->truncate));
    return KT_OK;
}

/* yarn_get_mscale of transformers' DeepSeek files */
static double yarn_mscale(double scale, double mscale)
{
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

static kt_status read_sizes(const kt__hf_json *j, kt__hf_config *c)
{
    KT__TRY(kt__hf_int(j, "vocab_size", 1, 1, INT32_MAX, &c->vocab));
    KT__TRY(kt__hf_int(j, "hidden_size", 1, 1, BIG, &c->hidden));
    KT__TRY(kt__hf_int(j, "num_hidden_layers", 1, 1, KT__HF_MAX_LAYERS, &c->layers));
    KT__TRY(kt__hf_int(j, "num_attention_heads", 1, 1, 1 << 16, &c->heads));
    c->kv_heads = c->heads;
    KT__TRY(kt__hf_int(j, "num_key_value_heads", 0, 1, 1 << 16, &c->kv_heads));
    if (c->heads % c->kv_heads != 0)
        return kt__hf_unsupported(j, "num_key_value_heads",
                                  "num_attention_heads must be a multiple of it");
    c->head_dim = c->hidden / c->heads;
    if (!is_deepseek(c))
        KT__TRY(kt__hf_int(j, "head_dim", 0, 1, 1 << 16, &c->head_dim));
    if (c->head_dim < 1)
        return kt__hf_unsupported(j, "num_attention_heads", "larger than hidden_size");
    c->eps = 1e-6;
    KT__TRY(kt__hf_num(j, "rms_norm_eps", 0, 0.0, 1.0, &c->eps));
    const char *act = NULL;
    KT__TRY(kt__hf_str(j, "hidden_act", &act));
    if (act != NULL && strcmp(act, "silu") != 0)
        return kt__hf_unsupported(j, "hidden_act", "libkt's MLPs and experts are SwiGLU (silu)");
    KT__TRY(kt__hf_bool(j, "tie_word_embeddings", &c->tie_embeddings));
    KT__TRY(require_zero(j, "attention_dropout", "libkt has no dropout"));
    return KT_OK;
}

static kt_status read_attention_options(const kt__hf_json *j, kt__hf_config *c)
{
    int attn_bias = 0;
    switch (c->arch) {
    case KT__HF_QWEN2:
        c->qkv_bias = 1; /* Qwen2's q, k and v always have biases */
        break;
    case KT__HF_QWEN2_MOE:
        c->qkv_bias = 1;
        KT__TRY(kt__hf_bool(j, "qkv_bias", &c->qkv_bias));
        break;
    case KT__HF_LLAMA:
    case KT__HF_QWEN3:
    case KT__HF_QWEN3_MOE:
    case KT__HF_OLMOE:
        KT__TRY(kt__hf_bool(j, "attention_bias", &attn_bias));
        c->qkv_bias = c->o_bias = attn_bias;
        break;
    case KT__HF_MIXTRAL:
        break;
    case KT__HF_DEEPSEEK_V2:
    case KT__HF_DEEPSEEK_V3:
        KT__TRY(require_bool(j, "attention_bias", 0,
                             "biases on DeepSeek's q_a_proj, kv_a_proj_with_mqa and o_proj are "
                             "not supported"));
        break;
    }
    if (c->arch == KT__HF_LLAMA || c->arch == KT__HF_DEEPSEEK_V2)
        KT__TRY(kt__hf_bool(j, "mlp_bias", &c->mlp_bias));
    if (c->arch == KT__HF_DEEPSEEK_V2 && c->mlp_bias)
        return kt__hf_unsupported(j, "mlp_bias", "biases on DeepSeek's MLPs are not supported");
    /* sliding windows: libkt's attention has a window, but these models switch it per layer
     * (max_window_layers, layer_types) and none of the checked configurations use one */
    if (c->arch == KT__HF_MIXTRAL && kt__hf_member(j, "sliding_window") != NULL)
        return kt__hf_unsupported(j, "sliding_window", "sliding-window attention is not supported");
    if (c->arch == KT__HF_QWEN2 || c->arch == KT__HF_QWEN3 || is_qwen_moe(c)) {
        KT__TRY(require_bool(j, "use_sliding_window", 0,
                             "sliding-window attention is not supported"));
        const kt__json_value *lt = kt__hf_member(j, "layer_types");
        for (size_t i = 0; lt != NULL && lt->type == KT__JSON_ARRAY && i < lt->u.list.count; i++) {
            const kt__json_value *t = &lt->u.list.items[i];
            if (t->type != KT__JSON_STRING || strcmp(t->u.string.s, "full_attention") != 0)
                return kt__error(KT_EUNSUPPORTED, "%s: 'layer_types[%zu]' is not "
                                 "\"full_attention\": sliding-window attention is not supported",
                                 j->path, i);
        }
    }
    if (c->arch == KT__HF_OLMOE)
        KT__TRY(kt__hf_num(j, "clip_qkv", 0, 1e-30, 1e30, &c->clip_qkv));
    return KT_OK;
}

/* The expert count's key differs by architecture (each class maps the others to it). */
static kt_status read_experts(const kt__hf_json *j, kt__hf_config *c)
{
    static const char *const keys[] = {"num_local_experts", "num_experts", "n_routed_experts"};
    const char *found = NULL;
    for (int i = 0; i < 3; i++) {
        int64_t e = 0;
        KT__TRY(kt__hf_int(j, keys[i], 0, 0, 1 << 20, &e));
        if (kt__hf_member(j, keys[i]) == NULL)
            continue;
        if (found != NULL && e != c->n_experts)
            return kt__error(KT_EFORMAT, "%s: '%s' = %lld and '%s' = %lld disagree", j->path,
                             found, (long long)c->n_experts, keys[i], (long long)e);
        found = keys[i];
        c->n_experts = e;
    }
    if (found == NULL || c->n_experts < 1)
        return kt__error(KT_EFORMAT, "%s: the expert count (%s) is missing or 0: not a %s "
                         "mixture of experts", j->path,
                         is_deepseek(c) ? "n_routed_experts" : "num_experts", c->model_type);
    KT__TRY(kt__hf_int(j, "num_experts_per_tok", 1, 1, c->n_experts, &c->top_k));
    return KT_OK;
}

static kt_status read_qwen_layers(const kt__hf_json *j, kt__hf_config *c)
{
    int64_t step = 1;
    KT__TRY(kt__hf_int(j, "decoder_sparse_step", 0, 1, KT__HF_MAX_LAYERS, &step));
    for (int64_t l = 0; l < c->layers; l++)
        c->moe_layer[l] = (l + 1) % step == 0;
    const kt__json_value *only = kt__hf_member(j, "mlp_only_layers");
    if (only == NULL)
        return KT_OK;
    if (only->type != KT__JSON_ARRAY)
        return kt__hf_unsupported(j, "mlp_only_layers", "expected a list of layer indices");
    for (size_t i = 0; i < only->u.list.count; i++) {
        const kt__json_value *x = &only->u.list.items[i];
        if (x->type != KT__JSON_INT || x->u.integer.negative)
            return kt__hf_unsupported(j, "mlp_only_layers", "expected a list of layer indices");
        if (x->u.integer.magnitude < (uint64_t)c->layers)
            c->moe_layer[x->u.integer.magnitude] = 0;
    }
    return KT_OK;
}

static kt_status read_deepseek(const kt__hf_json *j, kt__hf_config *c)
{
    int v3 = c->arch == KT__HF_DEEPSEEK_V3;
    if (c->kv_heads != c->heads)
        return kt__hf_unsupported(j, "num_key_value_heads",
                                  "DeepSeek's MLA needs it equal to num_attention_heads");
    c->q_lora_rank = 0; /* null: q_proj */
    KT__TRY(kt__hf_int(j, "q_lora_rank", 0, 1, BIG, &c->q_lora_rank));
    KT__TRY(kt__hf_int(j, "kv_lora_rank", 1, 1, BIG, &c->kv_lora_rank));
    KT__TRY(kt__hf_int(j, "qk_nope_head_dim", 1, 1, 1 << 16, &c->qk_nope));
    KT__TRY(kt__hf_int(j, "qk_rope_head_dim", 1, 2, 1024, &c->qk_rope));
    KT__TRY(kt__hf_int(j, "v_head_dim", 1, 1, 1 << 16, &c->v_head));
    if (c->qk_rope % 2 != 0)
        return kt__hf_unsupported(j, "qk_rope_head_dim", "RoPE needs an even size");
    int64_t first_dense = 0, freq = 1, n_shared = 0;
    KT__TRY(kt__hf_int(j, "first_k_dense_replace", 0, 0, KT__HF_MAX_LAYERS, &first_dense));
    KT__TRY(kt__hf_int(j, "moe_layer_freq", 0, 1, KT__HF_MAX_LAYERS, &freq));
    if (freq != 1)
        return kt__hf_unsupported(j, "moe_layer_freq", "transformers' DeepSeek ignores it; "
                                  "only 1 (every layer from first_k_dense_replace) is "
                                  "unambiguous");
    for (int64_t l = 0; l < c->layers; l++)
        c->moe_layer[l] = l >= first_dense;
    KT__TRY(kt__hf_int(j, "moe_intermediate_size", 1, 1, BIG, &c->moe_intermediate));
    KT__TRY(kt__hf_int(j, "n_shared_experts", 1, 1, 1 << 16, &n_shared));
    c->shared_intermediate = n_shared * c->moe_intermediate;
    const char *method = NULL, *scoring = NULL;
    KT__TRY(kt__hf_str(j, "topk_method", &method));
    KT__TRY(kt__hf_str(j, "scoring_func", &scoring));
    c->routed_scaling = v3 ? 2.5 : 1.0;
    KT__TRY(kt__hf_num(j, "routed_scaling_factor", 0, 1e-6, 1e6, &c->routed_scaling));
    int64_t n_group = 1, topk_group = 0;
    if (v3) {
        if (method != NULL && strcmp(method, "noaux_tc") != 0)
            return kt__hf_unsupported(j, "topk_method", "transformers' DeepSeek-V3 routes as "
                                      "noaux_tc only");
        if (scoring != NULL && strcmp(scoring, "sigmoid") != 0)
            return kt__hf_unsupported(j, "scoring_func", "transformers' DeepSeek-V3 scores "
                                      "with sigmoid only");
        c->sigmoid = 1;
        c->group_top2 = 1;
        c->norm_topk = 1;
        KT__TRY(kt__hf_bool(j, "norm_topk_prob", &c->norm_topk));
        KT__TRY(kt__hf_int(j, "n_group", 1, 1, 1024, &n_group));
        KT__TRY(kt__hf_int(j, "topk_group", 1, 1, n_group, &topk_group));
        c->rope_interleave = 1;
        KT__TRY(kt__hf_bool(j, "rope_interleave", &c->rope_interleave));
        c->rope_deinterleave = c->rope_interleave;
        KT__TRY(kt__hf_int(j, "num_nextn_predict_layers", 0, 0, 64, &c->mtp_layers));
    } else {
        if (scoring != NULL && strcmp(scoring, "softmax") != 0)
            return kt__hf_unsupported(j, "scoring_func", "transformers' DeepSeek-V2 scores "
                                      "with softmax only");
        KT__TRY(require_bool(j, "norm_topk_prob", 0, "transformers' DeepSeek-V2 never "
                             "renormalises the routing weights"));
        if (method == NULL || strcmp(method, "greedy") == 0) {
            n_group = 1;
        } else if (strcmp(method, "group_limited_greedy") == 0) {
            KT__TRY(kt__hf_int(j, "n_group", 1, 1, 1024, &n_group));
            KT__TRY(kt__hf_int(j, "topk_group", 1, 1, n_group, &topk_group));
        } else {
            return kt__hf_unsupported(j, "topk_method",
                                      "DeepSeek-V2 routes as greedy or group_limited_greedy");
        }
        c->rope_interleave = 1;
    }
    if (c->n_experts % n_group != 0)
        return kt__hf_unsupported(j, "n_group", "the experts must split into equal groups");
    if (n_group > 1 && topk_group * (c->n_experts / n_group) < c->top_k)
        return kt__hf_unsupported(j, "topk_group", "the kept groups hold fewer experts than "
                                  "num_experts_per_tok");
    c->n_group = (int)n_group;
    c->topk_group = n_group > 1 ? (int)topk_group : 0;
    /* yarn_apply_mscale: the softmax scale grows with mscale_all_dim */
    if (c->rope.type != KT__HF_ROPE_DEFAULT && c->rope.mscale_all_dim != 0) {
        double m = yarn_mscale(c->rope.factor, c->rope.mscale_all_dim);
        c->attn_scale = m * m / sqrt((double)(c->qk_nope + c->qk_rope));
    }
    return KT_OK;
}

static kt_status read_moe(const kt__hf_json *j, kt__hf_config *c)
{
    KT__TRY(read_experts(j, c));
    c->aux_coef = c->arch == KT__HF_OLMOE ? 0.01 : 0.001;
    if (!is_deepseek(c))
        KT__TRY(kt__hf_num(j, "router_aux_loss_coef", 0, 0.0, 1e6, &c->aux_coef));
    KT__TRY(require_zero(j, "router_jitter_noise", "libkt's router adds no noise"));
    switch (c->arch) {
    case KT__HF_MIXTRAL:
        c->norm_topk = 1; /* Mixtral always renormalises */
        c->moe_intermediate = c->intermediate;
        for (int64_t l = 0; l < c->layers; l++)
            c->moe_layer[l] = 1;
        break;
    case KT__HF_OLMOE:
        KT__TRY(kt__hf_bool(j, "norm_topk_prob", &c->norm_topk));
        c->moe_intermediate = c->intermediate;
        for (int64_t l = 0; l < c->layers; l++)
            c->moe_layer[l] = 1;
        break;
    case KT__HF_QWEN2_MOE:
    case KT__HF_QWEN3_MOE:
        KT__TRY(kt__hf_bool(j, "norm_topk_prob", &c->norm_topk));
        KT__TRY(kt__hf_int(j, "moe_intermediate_size", 1, 1, BIG, &c->moe_intermediate));
        if (c->arch == KT__HF_QWEN2_MOE)
            KT__TRY(kt__hf_int(j, "shared_expert_intermediate_size", 1, 1, BIG,
                               &c->shared_intermediate));
        KT__TRY(read_qwen_layers(j, c));
        break;
    default:
        KT__TRY(read_deepseek(j, c));
    }
    return KT_OK;
}

static kt_status parse_root(const kt__hf_json *j, kt__hf_config *c)
{
    const char *type = NULL;
    KT__TRY(kt__hf_str(j, "model_type", &type));
    if (type == NULL)
        return kt__error(KT_EFORMAT, "%s: no 'model_type': not a transformers config.json",
                         j->path);
    size_t n = sizeof archs / sizeof archs[0], i = 0;
    while (i < n && strcmp(archs[i].name, type) != 0)
        i++;
    if (i == n)
        return kt__hf_unsupported(j, "model_type", "kt-import reads mixtral, qwen2_moe, "
                                  "qwen3_moe, olmoe, deepseek_v2, deepseek_v3, llama, qwen2 "
                                  "and qwen3");
    c->arch = archs[i].arch;
    snprintf(c->model_type, sizeof c->model_type, "%s", type);
    KT__TRY(read_sizes(j, c));
    KT__TRY(read_attention_options(j, c));
    KT__TRY(read_rope(j, c, is_deepseek(c) ? 0 : c->head_dim));
    int dense_arch = c->arch == KT__HF_LLAMA || c->arch == KT__HF_QWEN2 ||
                     c->arch == KT__HF_QWEN3;
    int need_inter = dense_arch || c->arch == KT__HF_MIXTRAL || c->arch == KT__HF_OLMOE;
    if (!dense_arch)
        KT__TRY(kt__hf_int(j, "intermediate_size", need_inter, 1, BIG, &c->intermediate));
    else
        KT__TRY(kt__hf_int(j, "intermediate_size", 1, 1, BIG, &c->intermediate));
    if (!dense_arch)
        KT__TRY(read_moe(j, c));
    for (int64_t l = 0; l < c->layers; l++)
        if (!c->moe_layer[l] && c->intermediate == 0)
            return kt__error(KT_EFORMAT, "%s: layer %lld has a dense MLP but "
                             "'intermediate_size' is missing", j->path, (long long)l);
    return KT_OK;
}

kt_status kt__hf_config_parse(const char *text, size_t len, const char *path,
                              kt__hf_config *cfg)
{
    kt__json_doc *doc = NULL;
    kt_status s = kt__json_parse_numbers(text, len, &doc);
    if (s != KT_OK)
        return kt__error_context(s, "%s: not JSON", path);
    const kt__json_value *root = kt__json_root(doc);
    kt__hf_config c;
    memset(&c, 0, sizeof c);
    kt__hf_json j = {root, path, ""};
    if (root->type != KT__JSON_OBJECT)
        s = kt__error(KT_EFORMAT, "%s: expected a JSON object, found a%s %s", path,
                      root->type == KT__JSON_ARRAY || root->type == KT__JSON_INT ? "n" : "",
                      kt__json_type_name(root->type));
    else
        s = parse_root(&j, &c);
    kt__json_free(doc);
    if (s == KT_OK)
        *cfg = c;
    return s;
}
