/* Grouped-query attention as Llama, Qwen2/3(-MoE), Mixtral and OLMoE compute it:
 * q/k/v projections (Qwen2's biases), OLMoE's whole-projection q/k norms and clip_qkv,
 * Qwen3's per-head q/k norms, RoPE on q and k, causal softmax attention, o_proj. The decode
 * twin names the new tokens' keys and values k{l} and v{l} (its outputs, to cache) and
 * attends over the cache before them. */
#include <stdio.h>

#include "lib/hf/hf_internal.h"

void kt__hf_emit_gqa(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    int olmoe = c->arch == KT__HF_OLMOE;
    int per_head_norm = c->arch == KT__HF_QWEN3 || c->arch == KT__HF_QWEN3_MOE;
    char rope[512];
    kt__hf_rope_attrs(e, rope, sizeof rope);
    const char *k_out = e->context > 0 ? "k{l}" : "k", *v = e->context > 0 ? "v{l}" : "v";

    kt__hf_norm(e, "a", "h", "input_layernorm", "H", c->eps);
    kt__hf_open(e, "scope self_attn");
    kt__hf_linear(e, "q", "a", "q_proj", "HQ * D", "H", c->hidden, c->qkv_bias, KT__HF_T_Q);
    kt__hf_linear(e, "k", "a", "k_proj", "HKV * D", "H", c->hidden, c->qkv_bias, KT__HF_T_K);
    kt__hf_linear(e, v, "a", "v_proj", "HKV * D", "H", c->hidden, c->qkv_bias, KT__HF_T_V);
    if (olmoe) {
        kt__hf_line(e, "# OLMoE normalises the whole projections, before the head split");
        kt__hf_norm(e, "q", "q", "q_norm", "HQ * D", c->eps);
        kt__hf_norm(e, "k", "k", "k_norm", "HKV * D", c->eps);
    }
    if (c->clip_qkv > 0) {
        char lim[40];
        kt__hf_float(lim, sizeof lim, c->clip_qkv);
        kt__hf_line(e, "# clip_qkv");
        kt__hf_line(e, "q = clamp(q, min = -%s, max = %s)", lim, lim);
        kt__hf_line(e, "k = clamp(k, min = -%s, max = %s)", lim, lim);
        kt__hf_line(e, "%s = clamp(%s, min = -%s, max = %s)", v, v, lim, lim);
    }
    kt__hf_line(e, "q = reshape(q, shape = [B, S, HQ, D])");
    kt__hf_line(e, "k = reshape(k, shape = [B, S, HKV, D])");
    kt__hf_line(e, "%s = reshape(%s, shape = [B, S, HKV, D])", v, v);
    if (per_head_norm) {
        kt__hf_line(e, "# per-head RMSNorm over head_dim (rmsnorm normalises the last dim)");
        kt__hf_norm(e, "q", "q", "q_norm", "D", c->eps);
        kt__hf_norm(e, "k", "k", "k_norm", "D", c->eps);
    }
    kt__hf_rope_line(e, "q", "q", rope);
    kt__hf_rope_line(e, k_out, "k", rope);
    kt__hf_attend(e, "q", k_out, v, "");
    kt__hf_line(e, "o = reshape(o, shape = [N, HQ * D])");
    kt__hf_linear(e, "o", "o", "o_proj", "H", "HQ * D", c->heads * c->head_dim, c->o_bias,
                  KT__HF_T_O);
    kt__hf_close(e);
    kt__hf_line(e, "h = add(h, o)");
}
