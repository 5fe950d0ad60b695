/* kt-moe-example: one MoE layer from C, as docs/moe.md walks through it. A LoRA layer with
 * bf16 experts: create it, set its weights, run a forward (blocking, then submitted), a
 * backward, and read the adapters' gradients and the layer's memory. Exits 0 when every step
 * worked and the submitted forward equals the blocking one bit for bit.
 *
 * usage: kt-moe-example [threads]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

enum { E = 8, H = 64, I = 128, K = 2, T = 16 };

static int check(kt_status s, const char *what)
{
    if (s != KT_OK)
        fprintf(stderr, "kt-moe-example: %s: %s (%s)\n", what, kt_last_error(), kt_status_str(s));
    return s != KT_OK;
}

/* A small deterministic generator, so that every run sees the same numbers. */
static float next_uniform(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(*s >> 40) / 16777216.0f * 2.0f - 1.0f;
}

static kt_tensor tensor(void *data, kt_dtype dtype, int64_t rows, int64_t cols)
{
    kt_tensor t;
    const int64_t shape[2] = {rows, cols};
    kt_tensor_init(&t, data, dtype, 2, shape); /* a contiguous CPU view of data */
    return t;
}

int main(int argc, char **argv)
{
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    kt_threadpool *pool = NULL;
    kt_moe *moe = NULL;
    int failed = 0;
    if (check(kt_threadpool_create(threads > 0 ? threads : 1, &pool), "thread pool"))
        return 1;

    kt_moe_config config = {.n_experts = E,
                            .hidden = H,
                            .intermediate = I,
                            .top_k = K,
                            .max_tokens = T,
                            .weight_dtype = KT_BF16,
                            .act_dtype = KT_F32,
                            .mode = KT_MOE_LORA,
                            .lora_rank = 4,
                            .lora_alpha = 8.0f,
                            .keep_activations = 1,
                            .check_finite = 1,
                            .name = "example",
                            .numa_node = -1};
    failed = check(kt_moe_create(&config, pool, &moe), "create");

    /* Weights: gate and up are [I, H], down [H, I], in the weight dtype (bf16 here). */
    uint64_t seed = 1;
    static uint16_t w[I * H];
    for (int64_t e = 0; e < E && !failed; e++)
        for (int p = 0; p < 3 && !failed; p++) {
            const int64_t out = p == KT_MOE_DOWN ? H : I, in = p == KT_MOE_DOWN ? I : H;
            for (int64_t i = 0; i < out * in; i++)
                w[i] = kt_f32_to_bf16_1(next_uniform(&seed) / sqrtf((float)in));
            kt_tensor wt = tensor(w, KT_BF16, out, in);
            failed = check(kt_moe_set_weight(moe, e, (kt_moe_proj)p, &wt), "set_weight");
        }

    /* One call of qlen tokens: x [qlen, H], each token's K experts and routing weights. */
    const int64_t qlen = 5;
    static float x[T * H], y[T * H], y2[T * H], gy[T * H], gx[T * H], gw[T * K], rw[T * K];
    static int32_t ids[T * K];
    for (int64_t i = 0; i < qlen * H; i++)
        x[i] = next_uniform(&seed), gy[i] = next_uniform(&seed);
    for (int64_t t = 0; t < qlen; t++) {
        ids[t * K] = (int32_t)(t % E), ids[t * K + 1] = (int32_t)((t + 3) % E);
        rw[t * K] = 0.75f, rw[t * K + 1] = 0.25f;
    }
    kt_tensor xt = tensor(x, KT_F32, qlen, H), idt = tensor(ids, KT_I32, qlen, K);
    kt_tensor wt = tensor(rw, KT_F32, qlen, K), yt = tensor(y, KT_F32, qlen, H);
    kt_tensor y2t = tensor(y2, KT_F32, qlen, H), gyt = tensor(gy, KT_F32, qlen, H);
    kt_tensor gxt = tensor(gx, KT_F32, qlen, H), gwt = tensor(gw, KT_F32, qlen, K);

    /* Blocking forward, then the same forward submitted: the caller may work until sync. */
    if (!failed)
        failed = check(kt_moe_forward(moe, &xt, &idt, &wt, &yt), "forward");
    if (!failed)
        failed = check(kt_moe_submit_forward(moe, &xt, &idt, &wt, &y2t), "submit_forward");
    if (!failed)
        failed = check(kt_moe_sync(moe), "sync");
    if (!failed && memcmp(y, y2, (size_t)(qlen * H) * sizeof(float)) != 0) {
        fprintf(stderr, "kt-moe-example: the submitted forward differs from the blocking one\n");
        failed = 1;
    }

    /* Backward of the last forward: grad_x, the routing weights' gradient and, in LoRA mode,
     * the adapters' gradients (overwritten by the first backward, added by later ones). */
    if (!failed)
        failed = check(kt_moe_backward(moe, &gyt, &gxt, &gwt, 1.0f), "backward");
    kt_tensor db; /* B's gradient: B starts at zero, so A's is zero after the first step */
    if (!failed)
        failed = check(kt_moe_lora_grad(moe, 0, KT_MOE_GATE, 1, &db), "lora_grad");

    /* A mistake is an error that says what is wrong, and the layer stays usable. */
    if (!failed) {
        kt_tensor bad = tensor(x, KT_F32, qlen, H - 1);
        if (kt_moe_forward(moe, &bad, &idt, &wt, &yt) == KT_OK) {
            fprintf(stderr, "kt-moe-example: a wrong shape was accepted\n");
            failed = 1;
        } else {
            printf("a refused call: %s\n", kt_last_error());
        }
    }

    if (!failed) {
        kt_moe_memory mem;
        kt_moe_get_memory(moe, &mem);
        const float *g = db.data;
        printf("y[0][0] %.6f  grad_x[0][0] %.6f  grad_w[0] %.6f  dB(expert 0, gate)[0] %.6g\n",
               (double)y[0], (double)gx[0], (double)gw[0], (double)g[0]);
        printf("weights %llu bytes, adapters and gradients %llu, kept per token %llu, "
               "scratch %llu\n",
               (unsigned long long)mem.weight_bytes, (unsigned long long)mem.grad_bytes,
               (unsigned long long)mem.saved_bytes_per_token,
               (unsigned long long)mem.scratch_bytes);
    }
    kt_moe_destroy(moe); /* NULL after a failed create: harmless */
    kt_threadpool_destroy(pool);
    return failed;
}
