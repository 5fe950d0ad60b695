/* DeepSeek-V2/V3's multi-head latent attention: q from q_proj or the q_a/q_b pair with its
 * latent norm, the key/value latent plus one shared rotary key head, RoPE on the rope parts
 * only (adjacent pairs; V3 writes them de-interleaved), scale 1/sqrt(qk head dim) times
 * yarn's mscale^2 where the config asks. The latent norms use eps 1e-6 whatever
 * rms_norm_eps says, as transformers builds them. The decode twin caches every head's
 * whole key and value (k{l}, v{l}), not the latent. */
#include <stdio.h>

#include "lib/hf/hf_internal.h"

void kt__hf_emit_mla(kt__hf_emit *e)
{
    const kt__hf_config *c = e->cfg;
    char rope[512];
    kt__hf_rope_attrs(e, rope, sizeof rope);
    const char *k = e->context > 0 ? "k{l}" : "k", *v = e->context > 0 ? "v{l}" : "v";

    kt__hf_norm(e, "a", "h", "input_layernorm", "H", c->eps);
    kt__hf_open(e, "scope self_attn");
    if (c->q_lora_rank > 0) {
        kt__hf_linear(e, "q", "a", "q_a_proj", "QR", "H", c->hidden, 0, KT__HF_T_Q_A);
        kt__hf_norm(e, "q", "q", "q_a_layernorm", "QR", 1e-6);
        kt__hf_linear(e, "q", "q", "q_b_proj", "NH * (DN + DR)", "QR", c->q_lora_rank, 0,
                      KT__HF_T_Q_B);
    } else {
        kt__hf_linear(e, "q", "a", "q_proj", "NH * (DN + DR)", "H", c->hidden, 0, KT__HF_T_Q);
    }
    kt__hf_line(e, "q = reshape(q, shape = [B, S, NH, DN + DR])");
    kt__hf_line(e, "q_nope = narrow(q, dim = 3, start = 0, length = DN)");
    kt__hf_line(e, "q_pe = narrow(q, dim = 3, start = DN, length = DR)");
    kt__hf_rope_line(e, "q_pe", "q_pe", rope);
    kt__hf_linear(e, "ckv", "a", "kv_a_proj_with_mqa", "KVR + DR", "H", c->hidden, 0,
                  KT__HF_T_KV_A);
    kt__hf_line(e, "c = narrow(ckv, dim = 1, start = 0, length = KVR)");
    kt__hf_line(e, "k_pe = narrow(ckv, dim = 1, start = KVR, length = DR)");
    kt__hf_norm(e, "c", "c", "kv_a_layernorm", "KVR", 1e-6);
    kt__hf_linear(e, "kv", "c", "kv_b_proj", "NH * (DN + DV)", "KVR", c->kv_lora_rank, 0,
                  KT__HF_T_KV_B);
    kt__hf_line(e, "kv = reshape(kv, shape = [B, S, NH, DN + DV])");
    kt__hf_line(e, "k_nope = narrow(kv, dim = 3, start = 0, length = DN)");
    kt__hf_line(e, "%s = narrow(kv, dim = 3, start = DN, length = DV)", v);
    kt__hf_line(e, "# one rotary key head, shared by every head");
    kt__hf_line(e, "k_pe = reshape(k_pe, shape = [B, S, 1, DR])");
    kt__hf_rope_line(e, "k_pe", "k_pe", rope);
    kt__hf_line(e, "k_pe = expand(k_pe, dim = 2, size = NH)");
    kt__hf_line(e, "q = concat(q_nope, q_pe, dim = 3)");
    kt__hf_line(e, "%s = concat(k_nope, k_pe, dim = 3)", k);
    if (c->attn_scale > 0) {
        char s[40];
        kt__hf_float(s, sizeof s, c->attn_scale);
        char extra[64];
        snprintf(extra, sizeof extra, ", scale = %s", s);
        kt__hf_line(e, "# yarn: 1/sqrt(DN + DR) times mscale(factor, mscale_all_dim)^2");
        kt__hf_attend(e, "q", k, v, extra);
    } else {
        kt__hf_attend(e, "q", k, v, "");
    }
    kt__hf_line(e, "o = reshape(o, shape = [N, NH * DV])");
    kt__hf_linear(e, "o", "o", "o_proj", "H", "NH * DV", c->heads * c->v_head, 0, KT__HF_T_O);
    kt__hf_close(e);
    kt__hf_line(e, "h = add(h, o)");
}
