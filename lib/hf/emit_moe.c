/* The sparse MoE blocks: each architecture's router (softmax or sigmoid scores, top-k,
 * renormalisation, DeepSeek's group-limited selection and scaling), the routed experts in
 * the session's MoE layer (the moe op, under the checkpoint's expert names), and the
 * shared experts (Qwen2-MoE's gated one, DeepSeek's always-on ones). Router weights stay
 * f32. The router's logits and choices are named router_logits{l} / router_ids{l} so that
 * the load-balancing loss can gather them. */
#include <stdio.h>

#include "lib/hf/hf_internal.h"

void kt__hf_emit_moe(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    const char *kw = kt__hf_param_kw(e);
    int mixtral = c->arch == KT__HF_MIXTRAL;
    int deepseek = c->arch == KT__HF_DEEPSEEK_V2 || c->arch == KT__HF_DEEPSEEK_V3;

    kt__hf_norm(e, "n", "h", "post_attention_layernorm", "H", c->eps);
    kt__hf_open(e, "scope %s", mixtral ? "block_sparse_moe" : "mlp");
    kt__hf_line(e, "%s gate.weight: f32[E, H] = loaded", kw);
    if (c->arch == KT__HF_DEEPSEEK_V3)
        kt__hf_line(e, "param frozen gate.e_score_correction_bias: f32[E] = loaded");
    kt__hf_line(e, "router_logits{l} = matmul(n, gate.weight, trans_b = 1)");
    if (!deepseek) {
        kt__hf_line(e, "router_ids{l}, w = topk_router(router_logits{l}, k = TOPK, "
                       "norm_topk = %d)", c->norm_topk);
    } else {
        char scale[40];
        kt__hf_float(scale, sizeof scale, c->routed_scaling);
        char groups[96] = "";
        if (c->n_group > 1)
            snprintf(groups, sizeof groups, ", n_group = G, topk_group = TG, group_score = %s",
                     c->group_top2 ? "top2_sum" : "max");
        kt__hf_line(e, "router_ids{l}, w = topk_router(router_logits{l}%s, k = TOPK,",
                    c->arch == KT__HF_DEEPSEEK_V3 ? ", gate.e_score_correction_bias" : "");
        kt__hf_line(e, "    norm_topk = %d, scoring = %s%s,", c->norm_topk,
                    c->sigmoid ? "sigmoid" : "softmax", groups);
        kt__hf_line(e, "    routed_scaling_factor = %s)", scale);
    }
    kt__hf_line(e, "m = moe(n, router_ids{l}, w, layer = l, intermediate = I, names = %s)",
                mixtral ? "mixtral" : "hf");
    if (c->arch == KT__HF_QWEN2_MOE) {
        kt__hf_swiglu(e, "s", "n", "shared_expert", "SI", c->shared_intermediate, 0);
        kt__hf_line(e, "%s shared_expert_gate.weight: f32[1, H] = loaded", kw);
        kt__hf_line(e, "sg = matmul(n, shared_expert_gate.weight, trans_b = 1)");
        kt__hf_line(e, "sg = sigmoid(sg)");
        kt__hf_line(e, "s = mul(s, sg)");
        kt__hf_line(e, "m = add(m, s)");
    } else if (deepseek) {
        kt__hf_swiglu(e, "s", "n", "shared_experts", "NS * I", c->shared_intermediate, 0);
        kt__hf_line(e, "m = add(m, s)");
    }
    kt__hf_close(e);
    kt__hf_line(e, "h = add(h, m)");
}
