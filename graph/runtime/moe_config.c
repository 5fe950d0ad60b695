/* The MoE layer configuration a program's moe op asks for (kt/program.h:
 * kt_program_moe_config). It lives with the program, not in lib/moe: the layer knows nothing
 * of programs (graph -> lib, never the reverse), and the program knows its moe ops. */
#include "lib/core/error.h"
#include "kt/moe.h"
#include "kt/program.h"

kt_status kt_program_moe_config(const kt_program_moe *info, int64_t intermediate,
                                kt_dtype weight_dtype, kt_moe_mode mode, int64_t lora_rank,
                                float lora_alpha, int world, kt_moe_config *config_out)
{
    if (info == NULL || config_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_moe_config: NULL argument");
    const char *name = info->name != NULL ? info->name : "";
    if (info->n_experts <= 0)
        return kt__error(KT_EINVAL,
                         "moe node '%s': its expert ids do not come from a topk_router op, so "
                         "the number of experts is unknown",
                         name);
    if (info->intermediate > 0 && intermediate > 0 && intermediate != info->intermediate)
        return kt__error(KT_EINVAL, "moe node '%s': the program is written for experts of "
                         "intermediate size %lld, not %lld", name,
                         (long long)info->intermediate, (long long)intermediate);
    if (info->intermediate > 0)
        intermediate = info->intermediate;
    if (intermediate < 1)
        return kt__error(KT_EINVAL, "moe node '%s': intermediate size %lld must be >= 1 (the "
                         "program leaves it to whoever creates the layer)", name,
                         (long long)intermediate);
    int64_t max_tokens = 0;
    if (world < 1)
        return kt__error(KT_EINVAL, "moe node '%s': world %d must be >= 1", name, world);
    if (__builtin_mul_overflow(info->tokens, (int64_t)world, &max_tokens))
        return kt__error(KT_EINVAL, "moe node '%s': %lld tokens a rank times %d ranks overflows",
                         name, (long long)info->tokens, world);
    *config_out = (kt_moe_config){.n_experts = info->n_experts,
                                  .hidden = info->hidden,
                                  .intermediate = intermediate,
                                  .top_k = info->top_k,
                                  .max_tokens = max_tokens,
                                  .weight_dtype = weight_dtype,
                                  .act_dtype = info->act_dtype,
                                  .mode = mode,
                                  .lora_rank = mode == KT_MOE_LORA ? lora_rank : 0,
                                  .lora_alpha = lora_alpha,
                                  .keep_activations = info->keep_activations,
                                  .name = info->name,
                                  .numa_node = -1,
                                  .names = info->names,
                                  .layer = info->binding};
    return KT_OK;
}
