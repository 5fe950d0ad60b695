/* Runs the MoE layer for tests/moe/torch_moe_check.py.
 *
 * usage: moe_helper DIR bf16|f32 frozen|full [read]
 * Writes DIR/weights.safetensors (kt_moe_save, prefix "mlp."), DIR/inputs.safetensors
 * (x, ids, weights, grad_y), runs forward and backward (weight_grad_scale 1), and writes
 * DIR/outputs.safetensors: y, grad_x, grad_weights and, in full mode,
 * "experts.<e>.<proj>.grad" (f32). Values come from a fixed xorshift sequence.
 * With `read` the weights and inputs come from those two files instead, as PyTorch wrote
 * them: the experts through kt_moe_load under the prefix "model.layers.0.mlp.", the inputs
 * through kt_st_read (ids int64). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/kt.h"

enum { H = 64, I = 48, E = 8, K = 2, Q = 33 };

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static double uniform(double lo, double hi)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return lo + (hi - lo) * (double)((rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

static int check(kt_status st, const char *what)
{
    if (st != KT_OK)
        fprintf(stderr, "moe_helper: %s: %s\n", what, kt_last_error());
    return st != KT_OK;
}

/* The `read` mode: the experts and the inputs from the files PyTorch wrote in dir. */
static int read_inputs(const char *dir, kt_moe *m, kt_st_item in[4])
{
    char path[1024];
    kt_st_file *f = NULL;
    snprintf(path, sizeof path, "%s/weights.safetensors", dir);
    if (check(kt_st_open(path, &f), "open weights") ||
        check(kt_moe_load(m, f, "model.layers.0.mlp."), "load experts"))
        return 1;
    kt_st_close(f);
    snprintf(path, sizeof path, "%s/inputs.safetensors", dir);
    if (check(kt_st_open(path, &f), "open inputs"))
        return 1;
    for (int i = 0; i < 4; i++)
        if (check(kt_st_read(f, in[i].name, &in[i].tensor), in[i].name))
            return 1;
    kt_st_close(f);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4 && !(argc == 5 && strcmp(argv[4], "read") == 0)) {
        fprintf(stderr, "usage: moe_helper DIR bf16|f32 frozen|full [read]\n");
        return 2;
    }
    int bf16 = strcmp(argv[2], "bf16") == 0, full = strcmp(argv[3], "full") == 0;
    int read = argc == 5;
    char path[1024];
    kt_moe_config c;
    memset(&c, 0, sizeof c);
    c.n_experts = E, c.hidden = H, c.intermediate = I, c.top_k = K, c.max_tokens = Q;
    c.weight_dtype = bf16 ? KT_BF16 : KT_F32;
    c.act_dtype = KT_F32;
    c.mode = full ? KT_MOE_FULL : KT_MOE_FROZEN;
    c.keep_activations = 1;
    c.check_finite = 1;
    c.name = "torch_check";
    c.numa_node = -1;
    kt_threadpool *pool = NULL;
    kt_moe *m = NULL;
    if (check(kt_threadpool_create(2, &pool), "pool") || check(kt_moe_create(&c, pool, &m), "create"))
        return 1;
    for (int e = 0; !read && e < E; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor v;
            if (check(kt_moe_weight(m, e, (kt_moe_proj)p, &v), "weight"))
                return 1;
            for (int64_t i = 0; i < H * I; i++) {
                float f = (float)uniform(-0.25, 0.25);
                if (bf16)
                    ((uint16_t *)v.data)[i] = kt_f32_to_bf16_1(f);
                else
                    ((float *)v.data)[i] = f;
            }
        }
    static float x[Q * H], w[Q * K], gy[Q * H], y[Q * H], gx[Q * H], gw[Q * K];
    static int64_t ids[Q * K];
    for (int i = 0; !read && i < Q * H; i++) {
        x[i] = (float)uniform(-1, 1);
        gy[i] = (float)uniform(-1, 1);
    }
    for (int t = 0; !read && t < Q; t++) {
        for (int j = 0; j < K; j++) {
            int64_t e;
            int dup;
            do {
                e = (int64_t)uniform(0, E);
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= ids[t * K + i] == e;
            } while (dup || e >= E);
            ids[t * K + j] = e;
            w[t * K + j] = (float)uniform(0.1, 1.0);
        }
    }
    kt_tensor tx, tids, tw, tgy, ty, tgx, tgw;
    kt_tensor_init(&tx, x, KT_F32, 2, (int64_t[]){Q, H});
    kt_tensor_init(&tids, ids, KT_I64, 2, (int64_t[]){Q, K});
    kt_tensor_init(&tw, w, KT_F32, 2, (int64_t[]){Q, K});
    kt_tensor_init(&tgy, gy, KT_F32, 2, (int64_t[]){Q, H});
    kt_tensor_init(&ty, y, KT_F32, 2, (int64_t[]){Q, H});
    kt_tensor_init(&tgx, gx, KT_F32, 2, (int64_t[]){Q, H});
    kt_tensor_init(&tgw, gw, KT_F32, 2, (int64_t[]){Q, K});
    kt_st_item in[4] = {{"x", tx}, {"ids", tids}, {"weights", tw}, {"grad_y", tgy}};
    if (read && read_inputs(argv[1], m, in) != 0)
        return 1;
    snprintf(path, sizeof path, "%s/weights.safetensors", argv[1]);
    if (!read && check(kt_moe_save(m, path, "mlp."), "save"))
        return 1;
    snprintf(path, sizeof path, "%s/inputs.safetensors", argv[1]);
    if (!read && check(kt_st_save(path, in, 4, NULL), "save inputs"))
        return 1;
    if (check(kt_moe_forward(m, &tx, &tids, &tw, &ty), "forward") ||
        check(kt_moe_backward(m, &tgy, &tgx, &tgw, 1.0f), "backward"))
        return 1;
    kt_st_item out[3 + 3 * E];
    static char names[3 * E][64];
    static const char *proj[3] = {"gate_proj", "up_proj", "down_proj"};
    int n = 0;
    out[n++] = (kt_st_item){"y", ty};
    out[n++] = (kt_st_item){"grad_x", tgx};
    out[n++] = (kt_st_item){"grad_weights", tgw};
    for (int e = 0; full && e < E; e++)
        for (int p = 0; p < 3; p++) {
            snprintf(names[e * 3 + p], sizeof names[0], "experts.%d.%s.grad", e, proj[p]);
            out[n].name = names[e * 3 + p];
            if (check(kt_moe_weight_grad(m, e, (kt_moe_proj)p, &out[n].tensor), "weight_grad"))
                return 1;
            n++;
        }
    snprintf(path, sizeof path, "%s/outputs.safetensors", argv[1]);
    if (check(kt_st_save(path, out, (size_t)n, NULL), "save outputs"))
        return 1;
    kt_moe_destroy(m);
    kt_threadpool_destroy(pool);
    return 0;
}
