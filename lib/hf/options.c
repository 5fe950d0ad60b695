/* kt_hf_options against the model: defaults, ranges, and the LoRA targets as PEFT names
 * them, each of which must reach a module of this architecture. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/hf/hf_internal.h"
#include "lib/hf/options.h"

static const struct {
    const char *name;
    unsigned bit;
} target_names[] = {
    {"q_proj", KT__HF_T_Q},       {"k_proj", KT__HF_T_K},
    {"v_proj", KT__HF_T_V},       {"o_proj", KT__HF_T_O},
    {"gate_proj", KT__HF_T_GATE}, {"up_proj", KT__HF_T_UP},
    {"down_proj", KT__HF_T_DOWN}, {"q_a_proj", KT__HF_T_Q_A},
    {"q_b_proj", KT__HF_T_Q_B},   {"kv_a_proj_with_mqa", KT__HF_T_KV_A},
    {"kv_b_proj", KT__HF_T_KV_B},
};
#define N_TARGETS (sizeof target_names / sizeof target_names[0])

const char *kt__hf_target_name(unsigned bit)
{
    for (size_t i = 0; i < N_TARGETS; i++)
        if (target_names[i].bit == bit)
            return target_names[i].name;
    return "?";
}

static int has_dense_mlp(const kt__hf_config *c)
{
    if (c->arch == KT__HF_QWEN2_MOE || c->arch == KT__HF_DEEPSEEK_V2 ||
        c->arch == KT__HF_DEEPSEEK_V3)
        return 1; /* shared experts */
    for (int64_t l = 0; l < c->layers; l++)
        if (!c->moe_layer[l])
            return 1;
    return 0;
}

int kt__hf_has_moe(const kt__hf_config *c)
{
    for (int64_t l = 0; l < c->layers; l++)
        if (c->moe_layer[l])
            return 1;
    return 0;
}

/* The projections (nn.Linear modules) the model has, as target bits. */
static unsigned model_modules(const kt__hf_config *c)
{
    unsigned m = KT__HF_T_O;
    if (c->arch == KT__HF_DEEPSEEK_V2 || c->arch == KT__HF_DEEPSEEK_V3)
        m |= (c->q_lora_rank > 0 ? KT__HF_T_Q_A | KT__HF_T_Q_B : KT__HF_T_Q) | KT__HF_T_KV_A |
             KT__HF_T_KV_B;
    else
        m |= KT__HF_T_Q | KT__HF_T_K | KT__HF_T_V;
    if (has_dense_mlp(c))
        m |= KT__HF_T_GATE | KT__HF_T_UP | KT__HF_T_DOWN;
    return m;
}

#define MLP_BITS (KT__HF_T_GATE | KT__HF_T_UP | KT__HF_T_DOWN)

kt_status kt__hf_resolve_options(const kt_hf_options *in, const kt__hf_config *c,
                                 kt__hf_resolved *out)
{
    kt_hf_options o;
    memset(&o, 0, sizeof o);
    if (in != NULL)
        o = *in;
    kt__hf_resolved r;
    memset(&r, 0, sizeof r);
    r.batch = o.batch ? o.batch : 1;
    r.seq = o.seq ? o.seq : 128;
    if (r.batch < 1 || r.batch > (1 << 20))
        return kt__error(KT_EINVAL, "kt_hf_import: batch %lld: expected 1 to %d",
                         (long long)r.batch, 1 << 20);
    if (r.seq < 1 || r.seq > (1 << 24))
        return kt__error(KT_EINVAL, "kt_hf_import: seq %lld: expected 1 to %d",
                         (long long)r.seq, 1 << 24);
    if (o.dtype != KT_F32 && o.dtype != KT_BF16)
        return kt__error(KT_EINVAL, "kt_hf_import: dtype %s: expected f32 or bf16",
                         kt_dtype_name(o.dtype));
    r.bf16 = o.dtype == KT_BF16;
    if (o.lora_rank < 0 || o.lora_rank > 4096)
        return kt__error(KT_EINVAL, "kt_hf_import: LoRA rank %lld: expected 0 (none) to 4096",
                         (long long)o.lora_rank);
    r.lora_rank = o.lora_rank;
    if (r.bf16 && r.lora_rank == 0)
        return kt__error(KT_EINVAL, "kt_hf_import: dtype bf16 needs LoRA (a LoRA rank): "
                         "full fine-tuning keeps f32 master weights");
    if (r.lora_rank == 0 && (o.lora_alpha != 0 || o.lora_targets != NULL))
        return kt__error(KT_EINVAL, "kt_hf_import: LoRA alpha or targets given without a "
                         "LoRA rank");
    unsigned have = model_modules(c);
    if (r.lora_rank > 0) {
        if (!(o.lora_alpha > 0) || !isfinite(o.lora_alpha))
            return kt__error(KT_EINVAL, "kt_hf_import: LoRA alpha %g: expected a number > 0",
                             (double)o.lora_alpha);
        r.lora_alpha = o.lora_alpha;
        if (o.lora_targets == NULL) {
            r.targets = have | (kt__hf_has_moe(c) ? MLP_BITS : 0);
        } else {
            const char *p = o.lora_targets;
            while (*p != '\0') {
                const char *end = strchr(p, ',');
                size_t len = end ? (size_t)(end - p) : strlen(p);
                size_t i = 0;
                while (i < N_TARGETS && (strlen(target_names[i].name) != len ||
                                         strncmp(target_names[i].name, p, len) != 0))
                    i++;
                if (i == N_TARGETS)
                    return kt__error(KT_EINVAL, "kt_hf_import: LoRA target '%.*s' is not "
                                     "one of q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                     "up_proj, down_proj, q_a_proj, q_b_proj, "
                                     "kv_a_proj_with_mqa, kv_b_proj", (int)len, p);
                unsigned bit = target_names[i].bit;
                int reaches = (have & bit) || ((bit & MLP_BITS) && kt__hf_has_moe(c));
                if (!reaches)
                    return kt__error(KT_EINVAL, "kt_hf_import: LoRA target '%s' names no "
                                     "module of this %s model", target_names[i].name,
                                     c->model_type);
                r.targets |= bit;
                p += len;
                if (*p == ',')
                    p++;
            }
            if (r.targets == 0)
                return kt__error(KT_EINVAL, "kt_hf_import: no LoRA targets given");
        }
        unsigned mlp = r.targets & MLP_BITS;
        if (kt__hf_has_moe(c) && mlp != 0 && mlp != MLP_BITS)
            return kt__error(KT_EINVAL, "kt_hf_import: LoRA targets name %s%s%s but not all "
                             "three of gate_proj, up_proj and down_proj: the routed experts' "
                             "adapters (the MoE layer's LoRA mode) cover the three together",
                             mlp & KT__HF_T_GATE ? "gate_proj " : "",
                             mlp & KT__HF_T_UP ? "up_proj " : "",
                             mlp & KT__HF_T_DOWN ? "down_proj " : "");
        r.expert_lora = kt__hf_has_moe(c) && mlp == MLP_BITS;
    }
    if (o.aux_loss) {
        if (!kt__hf_has_moe(c))
            return kt__error(KT_EINVAL, "kt_hf_import: aux loss asked for, but this %s model "
                             "has no MoE layer", c->model_type);
        if (c->arch == KT__HF_DEEPSEEK_V2 || c->arch == KT__HF_DEEPSEEK_V3)
            return kt__error(KT_EINVAL, "kt_hf_import: aux loss asked for, but transformers' "
                             "%s computes no load-balancing loss", c->model_type);
        r.aux_loss = 1;
    }
    r.segments = o.segments != 0;
    *out = r;
    return KT_OK;
}
