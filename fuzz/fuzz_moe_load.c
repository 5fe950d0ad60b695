/* libFuzzer target: a MoE layer reading its experts from a safetensors file (kt_moe_load),
 * for a quantized layer (int4, LoRA: the codes and scales, float weights it quantizes, or
 * adapters alone) and a bf16 one.
 *
 * Invariants: a load that fails leaves the layer's weights as they were where it failed
 * before copying anything (every failure but a non-finite float weight met while
 * quantizing, which the reader reports after the experts before it are in); a load that
 * succeeds leaves a layer whose forward runs (KT_OK, or a clear error for a non-finite
 * output). A broken invariant aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt/moe.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { H = 64, I = 64, E = 2, K = 2, T = 2 };

static kt_moe *layer(kt_moe_quant quant)
{
    const kt_moe_config c = {.n_experts = E, .hidden = H, .intermediate = I, .top_k = K,
                             .max_tokens = T, .weight_dtype = KT_BF16, .act_dtype = KT_F32,
                             .mode = KT_MOE_LORA, .lora_rank = 2, .lora_alpha = 4.0f,
                             .name = "fuzz", .numa_node = -1, .quant = quant,
                             .quant_group = 32};
    kt_moe *m = NULL;
    if (kt_moe_create(&c, NULL, &m) != KT_OK)
        abort();
    return m;
}

/* Every projection's values as the layer multiplies by them, into out (E * 3 * H * I). */
static void weights(const kt_moe *m, float *out)
{
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            const int64_t shape[2] = {p == KT_MOE_DOWN ? H : I, p == KT_MOE_DOWN ? I : H};
            kt_tensor t;
            kt_tensor_init(&t, out + (e * 3 + p) * H * I, KT_F32, 2, shape);
            if (kt_moe_get_weight(m, e, (kt_moe_proj)p, &t) != KT_OK)
                abort();
        }
}

static void forward(kt_moe *m)
{
    static float x[T * H], w[T * K], y[T * H];
    static int32_t ids[T * K] = {0, 1, 1, 0};
    for (int i = 0; i < T * H; i++)
        x[i] = 0.01f * (float)(i % 7);
    for (int i = 0; i < T * K; i++)
        w[i] = 0.5f;
    kt_tensor tx, tids, tw, ty;
    const int64_t sx[2] = {T, H}, sk[2] = {T, K};
    kt_tensor_init(&tx, x, KT_F32, 2, sx);
    kt_tensor_init(&ty, y, KT_F32, 2, sx);
    kt_tensor_init(&tids, ids, KT_I32, 2, sk);
    kt_tensor_init(&tw, w, KT_F32, 2, sk);
    kt_status st = kt_moe_forward(m, &tx, &tids, &tw, &ty);
    if (st != KT_OK && st != KT_EINVAL && st != KT_ERANGE)
        abort();
}

static void one(kt_moe *m, const kt_st_file *f)
{
    static float before[E * 3 * H * I], after[E * 3 * H * I];
    weights(m, before);
    const kt_status st = kt_moe_load(m, f, NULL);
    if (st != KT_OK) {
        weights(m, after);
        const char *msg = kt_last_error();
        const int midway = strstr(msg, "not finite") != NULL && strstr(msg, "weight [") != NULL;
        if (!midway && memcmp(before, after, sizeof before) != 0)
            abort(); /* a refused file changed the layer */
        return;
    }
    forward(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kt_moe *q, *b;
    if (q == NULL)
        q = layer(KT_MOE_QUANT_INT4), b = layer(KT_MOE_QUANT_NONE);
    kt_st_file *f = NULL;
    if (kt_st_open_memory(data, size, "fuzz", &f) != KT_OK)
        return 0;
    one(q, f);
    one(b, f);
    kt_st_close(f);
    return 0;
}
