/* kt_hf_options resolved against a config: defaults filled in, LoRA targets as bits. */
#ifndef KT_HF_OPTIONS_H
#define KT_HF_OPTIONS_H

#include "lib/hf/hf_internal.h"

typedef struct kt__hf_resolved {
    int64_t batch, seq;
    int bf16;
    int64_t lora_rank;
    double lora_alpha;
    unsigned targets; /* KT__HF_T_* */
    int expert_lora;  /* the routed experts get the MoE layer's LoRA mode */
    int aux_loss;
    int segments;     /* an input of document ids for every attention */
} kt__hf_resolved;

kt_status kt__hf_resolve_options(const kt_hf_options *in, const kt__hf_config *cfg,
                                 kt__hf_resolved *out);
/* "q_proj" for KT__HF_T_Q, ... */
const char *kt__hf_target_name(unsigned bit);
int kt__hf_has_moe(const kt__hf_config *cfg);

#endif
