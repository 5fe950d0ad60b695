/* Hugging Face checkpoints in: a model directory (config.json + safetensors) as a libkt
 * program (docs/huggingface.md).
 *
 * kt_hf_import reads MODEL_DIR/config.json, generates the model's description in the .ktg
 * language (docs/ktg.md) with the checkpoint's own tensor names, compiles it for training,
 * checks that the checkpoint holds exactly the tensors the program needs (names and
 * shapes, the routed experts under the moe op's names), and writes OUT_DIR:
 *
 *     model.ktg         the description (readable, editable: the config's sizes as consts)
 *     model.ktp         the compiled training program (kt_program_load)
 *     model_decode.ktg  its decode twin for kt-generate: the same parameters, NEW tokens a
 *                       step with a key/value cache of C slots (inputs tokens, positions,
 *                       segments, past_k<l>, past_v<l>; outputs logits, k<l>, v<l>)
 *     import.json       the source directory (absolute), model_type, dtype, LoRA, aux loss, B, S
 *
 * The weights are not copied: a session reads them from MODEL_DIR by name
 * (kt_session_load, kt_moe_load). The program's interface: inputs `input_ids` i64 [B,S] and
 * `labels` i64 [B,S] (-100 ignored; shifted as transformers does: position t predicts
 * labels[t+1]), output `logits` f32 [B,S,V], loss the mean cross-entropy (plus
 * router_aux_loss_coef times the load-balancing loss with aux_loss).
 *
 * Architectures (config.json's model_type): mixtral, qwen2_moe, qwen3_moe, olmoe,
 * deepseek_v2, deepseek_v3, llama, qwen2, qwen3. A configuration option libkt does not
 * compute (another activation, a sliding window, a RoPE type it lacks) is an error naming
 * the key and its value, never approximated.
 */
#ifndef KT_HF_H
#define KT_HF_H

#include <stdint.h>

#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_hf_options {
    int64_t batch; /* B, sequences per step (0: 1) */
    int64_t seq;   /* S, tokens per sequence (0: 128) */
    /* The dense weights' dtype in the program: KT_F32 (0, the default) or KT_BF16. bf16
     * makes the big matrices (embedding, projections, lm_head) frozen bf16 parameters that
     * the matmuls read as they are; it needs LoRA (lora_rank > 0): full fine-tuning keeps
     * f32 master weights. Norms and routers stay f32. */
    kt_dtype dtype;
    /* LoRA (0: full fine-tuning). Each projection named in lora_targets gets adapters
     * `<module>.lora_A.weight` f32 [r, in] and `<module>.lora_B.weight` f32 [out, r] (B zero,
     * A uniform in +-1/sqrt(in), as PEFT initialises them), y = x W^T + (alpha/r) x A^T B^T;
     * every base parameter is frozen. The routed experts' adapters are the MoE layers' LoRA
     * mode (kt/moe.h) with the same rank and alpha, recorded in import.json. */
    int64_t lora_rank;
    float lora_alpha;         /* > 0 with lora_rank */
    const char *lora_targets; /* PEFT's module names, comma-separated (q_proj,k_proj,...);
                               * NULL: every projection the model has */
    /* Add router_aux_loss_coef times the load-balancing loss over all MoE layers' router
     * logits (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; DeepSeek has none in transformers). */
    int aux_loss;
    /* Add an input `segments` i64 [B, S] (the document each token belongs to, as kt-train
     * feeds packed sequences) to every attention: a token never attends to another
     * document's. */
    int segments;
    /* The decode twin's context C: model_decode.ktg takes a key/value cache of C slots (the
     * prompt and the tokens kt-generate adds; its -D C=... changes it). 0: S (at least 2). */
    int64_t context;
} kt_hf_options;

/* options may be NULL (the defaults). out_dir is written whole or not at all: the files go
 * to a temporary sibling directory renamed into place at the end; an existing out_dir (an
 * empty directory, or one an earlier import wrote) is replaced only on success. Errors name
 * the file, the config key or the tensor. */
kt_status kt_hf_import(const char *model_dir, const kt_hf_options *options,
                       const char *out_dir);

#ifdef __cplusplus
}
#endif
#endif
