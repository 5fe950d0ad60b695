/* Results of one build as hash lines, so that two builds can be compared bit for bit (see
 * compare.sh beside it):
 *   golden moe           the MoE layer, forward and backward, over a grid of configurations
 *   golden inputs P OUT  random inputs for program P (integer ids within their bounds)
 *   golden hash FILE     one hash per tensor of a safetensors file */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kt/kt.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double uni(void)
{
    rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
    return (double)((rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}
static uint64_t fnv(const void *p, size_t n)
{
    const unsigned char *b = p; uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}
#define CK(e) do { if ((e) != KT_OK) { fprintf(stderr, "%s: %s\n", #e, kt_last_error()); exit(1); } } while (0)

static void fill(kt_tensor *t, double lo, double hi)
{
    int64_t n = kt_tensor_numel(t);
    float *f = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) f[i] = (float)(lo + (hi - lo) * uni());
    if (t->dtype == KT_F32) memcpy(t->data, f, (size_t)n * 4);
    else if (t->dtype == KT_BF16) kt_f32_to_bf16(t->data, f, (size_t)n);
    else { fprintf(stderr, "fill: dtype %s\n", kt_dtype_name(t->dtype)); exit(1); }
    free(f);
}
static kt_tensor mk(kt_dtype dt, int nd, int64_t a, int64_t b)
{
    kt_tensor t; int64_t sh[2] = {a, b};
    CK(kt_tensor_init(&t, NULL, dt, nd, sh));
    t.data = calloc(1, kt_tensor_nbytes(&t) + 64);
    return t;
}
static void pr(const char *cfg, const char *what, const kt_tensor *t)
{
    printf("%s %s %016llx\n", cfg, what, (unsigned long long)fnv(t->data, kt_tensor_nbytes(t)));
}

static void moe_case(int64_t E, int64_t H, int64_t I, int64_t K, int64_t Q, kt_dtype wd,
                     kt_dtype ad, kt_moe_mode mode, int keep, int threads)
{
    char cfg[160];
    snprintf(cfg, sizeof cfg, "moe E%lld H%lld I%lld k%lld q%lld w%s a%s m%d keep%d t%d",
             (long long)E, (long long)H, (long long)I, (long long)K, (long long)Q,
             kt_dtype_name(wd), kt_dtype_name(ad), (int)mode, keep, threads);
    rng = 0x9e3779b97f4a7c15ull ^ fnv(cfg, strlen(cfg));
    kt_threadpool *pool = NULL;
    CK(kt_threadpool_create(threads, &pool));
    kt_moe_config c = {.n_experts = E, .hidden = H, .intermediate = I, .top_k = K,
                       .max_tokens = Q, .weight_dtype = wd, .act_dtype = ad, .mode = mode,
                       .lora_rank = 8, .lora_alpha = 16.0f, .keep_activations = keep,
                       .numa_node = -1};
    kt_moe *m;
    CK(kt_moe_create(&c, pool, &m));
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor w = mk(wd, 2, p == 2 ? H : I, p == 2 ? I : H);
            fill(&w, -0.1, 0.1);
            CK(kt_moe_set_weight(m, e, (kt_moe_proj)p, &w));
            free(w.data);
            if (mode == KT_MOE_LORA) {
                kt_tensor v;
                CK(kt_moe_lora(m, e, (kt_moe_proj)p, 1, &v));
                fill(&v, -0.05, 0.05);
            }
        }
    kt_tensor x = mk(ad, 2, Q, H), ids = mk(KT_I32, 2, Q, K), wts = mk(KT_F32, 2, Q, K);
    kt_tensor y = mk(ad, 2, Q, H), gy = mk(ad, 2, Q, H), gx = mk(ad, 2, Q, H);
    kt_tensor gw = mk(KT_F32, 2, Q, K);
    fill(&x, -1, 1); fill(&wts, 0, 1); fill(&gy, -1, 1);
    int32_t *id = ids.data;
    for (int64_t t = 0; t < Q; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t v; int dup;
            do { v = (int32_t)(uni() * (double)E); if (v >= E) v = (int32_t)E - 1; dup = 0;
                 for (int64_t j = 0; j < k; j++) dup |= id[t * K + j] == v; } while (dup);
            id[t * K + k] = v;
        }
    for (int rep = 0; rep < 2; rep++) { /* twice: the second call reuses the layer's buffers */
        CK(kt_moe_forward(m, &x, &ids, &wts, &y));
        kt_moe_zero_grad(m);
        CK(kt_moe_backward(m, &gy, &gx, &gw, 0.5f));
    }
    pr(cfg, "y", &y); pr(cfg, "gx", &gx); pr(cfg, "gw", &gw);
    uint64_t h = 0;
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor v;
            if (mode == KT_MOE_LORA)
                for (int b = 0; b < 2; b++) {
                    CK(kt_moe_lora_grad(m, e, (kt_moe_proj)p, b, &v));
                    h = h * 31 + fnv(v.data, kt_tensor_nbytes(&v));
                }
            if (mode == KT_MOE_FULL) {
                CK(kt_moe_weight_grad(m, e, (kt_moe_proj)p, &v));
                h = h * 31 + fnv(v.data, kt_tensor_nbytes(&v));
            }
        }
    printf("%s wgrad %016llx\n", cfg, (unsigned long long)h);
    kt_moe_destroy(m);
    kt_threadpool_destroy(pool);
    free(x.data); free(ids.data); free(wts.data); free(y.data); free(gy.data); free(gx.data);
    free(gw.data);
}

static void moe_grid(void)
{
    const int64_t qs[] = {1, 7, 64, 300};
    const kt_dtype wds[] = {KT_BF16, KT_F32}, ads[] = {KT_F32, KT_BF16};
    for (int w = 0; w < 2; w++)
        for (int a = 0; a < 2; a++)
            for (int mode = 0; mode < 3; mode++)
                for (int q = 0; q < 4; q++)
                    moe_case(16, 256, 192, 4, qs[q], wds[w], ads[a], (kt_moe_mode)mode, 1, 2);
    moe_case(16, 256, 192, 4, 300, KT_BF16, KT_F32, KT_MOE_LORA, 0, 2);
    moe_case(16, 256, 192, 4, 300, KT_BF16, KT_F32, KT_MOE_FULL, 0, 1);
    moe_case(8, 1024, 512, 2, 1024, KT_BF16, KT_F32, KT_MOE_FROZEN, 1, 2);
    moe_case(8, 1024, 512, 2, 1024, KT_BF16, KT_BF16, KT_MOE_LORA, 1, 2);
    moe_case(8, 512, 384, 2, 1024, KT_F32, KT_F32, KT_MOE_FULL, 1, 2);
    moe_case(64, 2048, 1408, 6, 1, KT_BF16, KT_F32, KT_MOE_FROZEN, 1, 2);
}

static void inputs(const char *prog, const char *out)
{
    kt_program *p;
    CK(kt_program_load(prog, &p));
    int n = kt_program_count(p, KT_ROLE_INPUT);
    kt_st_item *items = calloc((size_t)n + 1, sizeof *items);
    for (int i = 0; i < n; i++) {
        const char *name; kt_tensor t;
        CK(kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, &t));
        t.data = calloc(1, kt_tensor_nbytes(&t) + 8);
        int64_t bound = -1, nel = kt_tensor_numel(&t);
        if (t.dtype == KT_I32 || t.dtype == KT_I64) {
            CK(kt_program_index_bound(p, name, &bound));
            if (bound <= 0) bound = 2;
            for (int64_t j = 0; j < nel; j++) {
                int64_t v = (int64_t)(uni() * (double)bound); if (v >= bound) v = bound - 1;
                if (t.dtype == KT_I32) ((int32_t *)t.data)[j] = (int32_t)v;
                else ((int64_t *)t.data)[j] = v;
            }
        } else fill(&t, -1, 1);
        items[i].name = name; items[i].tensor = t;
    }
    CK(kt_st_save(out, items, (size_t)n, NULL));
}

static void hash(const char *path)
{
    kt_st_file *f;
    CK(kt_st_open(path, &f));
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name; kt_tensor t;
        CK(kt_st_entry(f, i, &name, &t));
        printf("%s %s %016llx\n", name, kt_dtype_name(t.dtype),
               (unsigned long long)fnv(t.data, kt_tensor_nbytes(&t)));
    }
    kt_st_close(f);
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "moe")) moe_grid();
    else if (argc >= 4 && !strcmp(argv[1], "inputs")) inputs(argv[2], argv[3]);
    else if (argc >= 3 && !strcmp(argv[1], "hash")) hash(argv[2]);
    else { fprintf(stderr, "usage: golden moe | inputs P OUT | hash FILE\n"); return 2; }
    return 0;
}
