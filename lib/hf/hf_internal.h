/* kt_hf_import's parts: the config reader, the .ktg emitters, the checkpoint check. */
#ifndef KT_HF_INTERNAL_H
#define KT_HF_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kt/hf.h"
#include "kt/io.h"
#include "kt/status.h"

#define KT__HF_MAX_LAYERS 4096 /* the moe op's layer attribute bound (KT_MOE_MAX_LAYERS) */

typedef enum kt__hf_arch {
    KT__HF_LLAMA,
    KT__HF_QWEN2,
    KT__HF_QWEN3,
    KT__HF_MIXTRAL,
    KT__HF_QWEN2_MOE,
    KT__HF_QWEN3_MOE,
    KT__HF_OLMOE,
    KT__HF_DEEPSEEK_V2,
    KT__HF_DEEPSEEK_V3
} kt__hf_arch;

typedef enum kt__hf_rope_type { KT__HF_ROPE_DEFAULT, KT__HF_ROPE_LINEAR, KT__HF_ROPE_YARN } kt__hf_rope_type;

typedef struct kt__hf_rope {
    kt__hf_rope_type type;
    double theta;
    double factor;                  /* linear, yarn */
    int64_t original_max_positions; /* yarn */
    double beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor; /* yarn (0: unset) */
    int truncate;                                                          /* yarn */
    int64_t rotary_dim; /* partial_rotary_factor * head_dim; 0: all */
} kt__hf_rope;

/* What the config says, in the terms the emitters need. Sizes are checked positive. */
typedef struct kt__hf_config {
    kt__hf_arch arch;
    char model_type[32];
    int64_t vocab, hidden, layers, heads, kv_heads, head_dim, intermediate;
    double eps;
    kt__hf_rope rope;
    int qkv_bias;  /* q, k, v projections have biases (Qwen2, Qwen2-MoE's qkv_bias) */
    int o_bias;    /* o_proj too (attention_bias of Llama, Qwen3, OLMoE, ...) */
    int mlp_bias;  /* the dense MLP's projections (Llama's mlp_bias) */
    int tie_embeddings;
    double clip_qkv; /* OLMoE: 0 = none */
    /* MoE (n_experts 0: a dense model) */
    int64_t n_experts, top_k, moe_intermediate;
    int64_t shared_intermediate; /* Qwen2-MoE's shared expert; DeepSeek: n_shared * moe_inter */
    int norm_topk;
    double aux_coef;
    unsigned char moe_layer[KT__HF_MAX_LAYERS]; /* 1: layer l is MoE, 0: dense MLP */
    /* DeepSeek */
    int64_t q_lora_rank; /* 0: q_proj */
    int64_t kv_lora_rank, qk_nope, qk_rope, v_head;
    int sigmoid;           /* V3's scores */
    int n_group, topk_group;
    int group_top2;        /* V3: a group's score is the sum of its best two */
    double routed_scaling;
    int rope_interleave, rope_deinterleave;
    double attn_scale; /* 0: 1/sqrt(qk dim); yarn's mscale^2 for DeepSeek */
    int64_t mtp_layers; /* DeepSeek-V3's num_nextn_predict_layers (not loaded by transformers) */
} kt__hf_config;

/* Parses config.json's text (path names it in messages). */
kt_status kt__hf_config_parse(const char *text, size_t len, const char *path,
                              kt__hf_config *cfg);

/* ---- emitting .ktg text ---- */

typedef struct kt__hf_buf {
    char *p;
    size_t len, cap;
    int failed; /* out of memory: reported once at the end */
} kt__hf_buf;

void kt__hf_put(kt__hf_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The shortest decimal text that reads back as the same double. */
void kt__hf_float(char *out, size_t size, double v);

/* The LoRA targets, one bit per PEFT module name. */
enum {
    KT__HF_T_Q = 1 << 0,
    KT__HF_T_K = 1 << 1,
    KT__HF_T_V = 1 << 2,
    KT__HF_T_O = 1 << 3,
    KT__HF_T_GATE = 1 << 4,
    KT__HF_T_UP = 1 << 5,
    KT__HF_T_DOWN = 1 << 6,
    KT__HF_T_Q_A = 1 << 7,   /* DeepSeek's MLA */
    KT__HF_T_Q_B = 1 << 8,
    KT__HF_T_KV_A = 1 << 9,
    KT__HF_T_KV_B = 1 << 10
};

typedef struct kt__hf_emit {
    const kt__hf_config *cfg;
    kt__hf_buf *b;
    int64_t batch, seq;
    int bf16;         /* big matrices frozen bf16 */
    int64_t lora_rank; /* 0: full fine-tuning */
    double lora_alpha;
    unsigned targets;  /* KT__HF_T_* */
    int aux_loss;
    int segments;      /* attention(q, k, v, segments) */
    int64_t context;   /* > 0: the decode twin (model_decode.ktg), a cache of C slots */
    int depth;         /* indentation level */
} kt__hf_emit;

/* model.ktg's text for a model directory, without compiling or checking anything (for tests
 * and for reading what an import would write); *ktg_out is malloc'ed. */
kt_status kt__hf_generate(const char *model_dir, const kt_hf_options *options,
                          char **ktg_out, size_t *len_out);

/* The whole model.ktg. */
void kt__hf_emit_model(kt__hf_emit *e, const char *source);

/* shared pieces (emit_common.c) */
void kt__hf_line(kt__hf_emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kt__hf_open(kt__hf_emit *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kt__hf_close(kt__hf_emit *e);
/* ", segments" when the model takes document ids (kt_hf_options.segments), else "": the
 * attention calls' optional fourth input. */
const char *kt__hf_segments_arg(const kt__hf_emit *e);
/* rope(in[, positions], attrs): the decode twin feeds the tokens' positions. */
void kt__hf_rope_line(kt__hf_emit *e, const char *out, const char *in, const char *attrs);
/* o, lse = attention(q, k, v[, segments], causal = 1<extra>); in the decode twin over the
 * cache (past_k{l}, past_v{l}) followed by k and v. */
void kt__hf_attend(kt__hf_emit *e, const char *q, const char *k, const char *v,
                   const char *extra);
/* "param" or "param frozen": base weights are frozen under LoRA. */
const char *kt__hf_param_kw(const kt__hf_emit *e);
/* A norm weight declared in the current scope and applied: out = rmsnorm(in, NAME.weight). */
void kt__hf_norm(kt__hf_emit *e, const char *out, const char *in, const char *module,
                 const char *dim, double eps);
/* out = in W^T (+ bias) (+ LoRA) for the nn.Linear `module` of the current scope; dims are
 * .ktg expressions. target: the KT__HF_T_* bit that adapts it (0: never). */
void kt__hf_linear(kt__hf_emit *e, const char *out, const char *in, const char *module,
                   const char *out_dim, const char *in_dim, int64_t in_size, int bias,
                   unsigned target);
/* The SwiGLU MLP `module` (gate_proj, up_proj, down_proj) on `in`, result in `out`. */
void kt__hf_swiglu(kt__hf_emit *e, const char *out, const char *in, const char *module,
                   const char *width, int64_t width_size, int bias);
/* The rope call's attributes for head size `dim_expr` ("theta = ..., ..."). */
void kt__hf_rope_attrs(const kt__hf_emit *e, char *out, size_t size);

/* the attention blocks: h += attention(norm(h)) */
void kt__hf_emit_gqa(kt__hf_emit *e);
void kt__hf_emit_mla(kt__hf_emit *e);
/* the MoE blocks: h += moe(norm(h)) (router_logits{l} / router_ids{l} kept for the aux loss) */
void kt__hf_emit_moe(kt__hf_emit *e);

/* ---- the checkpoint check ---- */

/* One tensor the import expects in the checkpoint. */
typedef struct kt__hf_tensor {
    char name[128];
    int ndim;
    int64_t shape[4];
} kt__hf_tensor;

/* Checks that `ckpt` (opened from `path`) holds exactly `want` (n of them): every name with
 * its shape, nothing else (RoPE's inv_freq buffers, and DeepSeek-V3's multi-token-prediction
 * layers past the last layer, aside). */
kt_status kt__hf_check_tensors(const kt_st_file *ckpt, const char *path,
                               const kt__hf_config *cfg, const kt__hf_tensor *want, size_t n);

#endif
