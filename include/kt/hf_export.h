/* Export: the result of a libkt fine-tune back to the Hugging Face ecosystem.
 *
 * The input is what kt_session_save wrote for a program kt-import made (parameters under the
 * checkpoint's names, routed experts under "model.layers.<l>.mlp.experts.<e>.<gate_proj|
 * up_proj|down_proj>.weight" or Mixtral's "...block_sparse_moe.experts.<e>.<w1|w3|w2>.weight",
 * LoRA adapters "<module>.lora_A.weight" f32 [r, in] / "<module>.lora_B.weight" f32 [out, r]
 * with y = W x + (alpha/r) B A x; "optimizer.*" is skipped) and the source checkpoint
 * directory it was imported from. Two outputs (docs/huggingface.md, "Export"):
 *
 * - kt_hf_export_peft: a PEFT 0.21 adapter directory (adapter_config.json +
 *   adapter_model.safetensors) for peft.PeftModel.from_pretrained: dense adapters through
 *   target_modules (or target_parameters "<name>.weight" where PEFT would rewrite the name
 *   into the fused experts), the routed experts through target_parameters
 *   "experts.gate_up_proj" (one rank-2r adapter per layer whose B is block-diagonal
 *   [B_gate 0; 0 B_up], alpha 2a, which is exactly libkt's separate gate and up adapters) and
 *   "experts.down_proj" (rank r).
 * - kt_hf_export_full: a whole checkpoint in the source's names, dtypes and shard files
 *   (model.safetensors.index.json included when the source has one), config.json,
 *   generation_config.json and tokenizer files copied; with `merged` the LoRA deltas folded in
 *   first, W + (alpha/r) B A in float64, rounded once to the source dtype.
 *
 * The output directory must not exist; it is written as a hidden temporary sibling and renamed
 * into place, so it appears whole or not at all. Neither the run file nor the source changes.
 */
#ifndef KT_HF_EXPORT_H
#define KT_HF_EXPORT_H

#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KT_HF_EXPORT_MAX_TARGETS 32
#define KT_HF_EXPORT_PATH_BYTES 4096

typedef struct kt_hf_export_options {
    const char *source_dir; /* the checkpoint the run started from (config.json, safetensors) */
    const char *model_type; /* config.json's model_type; NULL: read from source_dir/config.json */
    int64_t lora_rank;      /* 0: whatever the run's adapters have (all the same); else checked */
    double lora_alpha;      /* the adapters' alpha: required (> 0) when the run holds adapters */
    /* NULL, or a NULL-terminated list of module names (q_proj, ..., gate_proj): when given,
     * every adapter of the run must be on one of them and each must have an adapter */
    const char *const *targets;
    int merged; /* kt_hf_export_full: fold the LoRA deltas in (else a run with adapters is an
                 * error: the export would silently drop them) */
} kt_hf_export_options;

/* What kt-import recorded in OUT/import.json, owned by value. */
typedef struct kt_hf_import_record {
    char source_dir[KT_HF_EXPORT_PATH_BYTES];
    char model_type[64];
    char dtype[16];
    int64_t lora_rank; /* 0: no LoRA */
    double lora_alpha;
    int n_targets;
    char targets[KT_HF_EXPORT_MAX_TARGETS][64];
    const char *target_list[KT_HF_EXPORT_MAX_TARGETS + 1]; /* into targets, NULL-terminated */
} kt_hf_import_record;

/* Reads import.json: KT_EIO when it cannot be read, KT_EFORMAT naming the file and the key
 * when it is not JSON or a key is missing or of the wrong type. */
kt_status kt_hf_read_import_record(const char *path, kt_hf_import_record *record_out);
/* options from a record (pointers into it; merged 0). */
void kt_hf_export_options_from_record(const kt_hf_import_record *record,
                                      kt_hf_export_options *options_out);

/* The PEFT adapter directory. KT_EINVAL naming the tensor for an adapter PEFT cannot express
 * (then docs/huggingface.md says why; kt_hf_export_full with merged is the alternative), for
 * a run without adapters, for shapes that disagree with the source checkpoint. */
kt_status kt_hf_export_peft(const char *run_path, const kt_hf_export_options *options,
                            const char *out_dir);
/* The full checkpoint. Every tensor of the source must be in the run with the source's shape
 * (else KT_EINVAL naming it); float tensors are converted to the source tensor's dtype
 * (round to nearest even), others must have the source's dtype. */
kt_status kt_hf_export_full(const char *run_path, const kt_hf_export_options *options,
                            const char *out_dir);

#ifdef __cplusplus
}
#endif
#endif
