/* kt-bench checkpoint: activation checkpointing on a stack of conv + MoE layers.
 *
 * The same model (examples-like: causal conv, silu, router, CPU MoE, residual, rmsnorm per
 * layer, each layer a checkpoint block) is compiled with every policy, with the MoE output
 * kept (moe_cache on: the MoE forward cache of the design) or recomputed (off), and trained
 * for a few steps. The MoE layers keep what the program advises (their gate/up intermediates
 * only outside the recomputed segments), as kt-train creates them. Reported per configuration: the
 * planned activation peak plus what the MoE layers hold for their backward, the allocated arena,
 * the step time, the recomputed FLOPs and the expert FLOPs run again, each as a ratio to the
 * uncheckpointed program. The MoE layers' working buffers (sized for a forward, held per layer
 * whatever is saved) are reported on their own (moe_workspace_bytes): they are not activations kept
 * for backward, but they are memory, and the figure says how much. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"
#include "tools/common/usage.h"
#include "lib/moe/moe_internal.h"

#define MAX_LAYERS 64

static const char model[] =
    "const T = 256\n"
    "const H = 256\n"
    "const E = 8\n"
    "const K = 2\n"
    "const L = 16\n"
    "const V = 16\n"
    "input x: f32[1, T, H]\n"
    "input y: i32[T]\n"
    "h = x\n"
    "repeat l in 0..L {\n"
    "  checkpoint {\n"
    "    param conv{l}.w: f32[H, 3, H] = normal(0.02)\n"
    "    param router{l}.w: f32[H, E] = normal(0.02)\n"
    "    param norm{l}.w: f32[H] = ones\n"
    "    a = conv1d(h, conv{l}.w, mode = causal)\n"
    "    a = silu(a)\n"
    "    f = reshape(a, shape = [T, H])\n"
    "    r = matmul(f, router{l}.w)\n"
    "    ids, w = topk_router(r, k = K, norm_topk = 1)\n"
    "    m = moe(f, ids, w, layer = l)\n"
    "    m = reshape(m, shape = [1, T, H])\n"
    "    h = add(h, m)\n"
    "    h = rmsnorm(h, norm{l}.w, eps = 1e-6)\n"
    "  }\n"
    "}\n"
    "param head.w: f32[H, V] = normal(0.02)\n"
    "flat = reshape(h, shape = [T, H])\n"
    "logits = matmul(flat, head.w)\n"
    "loss = cross_entropy(logits, y)\n"
    "loss loss\n";

enum { TOKENS = 256, HIDDEN = 256, EXPERTS = 8, TOP_K = 2, INTER = 128 };

typedef struct config {
    const char *policy;
    kt_checkpoint_policy_kind kind;
    int64_t k;
    int moe_cache;
} config;

typedef struct measured {
    uint64_t arena, moe_saved, moe_workspace;
    double step_s, recompute_flops, forward_flops;
    uint64_t moe_flops; /* expert FLOPs run per step */
} measured;

static int fail(const char *what)
{
    fprintf(stderr, "kt-bench checkpoint: %s: %s\n", what, kt_last_error());
    return 1;
}

/* The layers of the program's moe ops, each keeping what the program advises
 * (kt_program_moe.keep_activations: nothing inside a recomputed segment), as kt-train
 * creates them. */
static int make_layers(const kt_program *prog, int layers, kt_moe **out)
{
    uint64_t s = 12345;
    for (int op = 0; op < layers; op++) {
        kt_program_moe info;
        kt_moe_config c;
        if (kt_program_moe_info(prog, op, &info) != KT_OK || info.binding < 0 ||
            info.binding >= layers || out[info.binding] != NULL ||
            kt_program_moe_config(&info, INTER, KT_BF16, KT_MOE_FROZEN, 0, 0.0f, 1, &c) != KT_OK)
            return 1;
        const int l = info.binding;
        c.name = "bench";
        if (kt_moe_create(&c, NULL, &out[l]) != KT_OK)
            return 1;
        for (int64_t e = 0; e < EXPERTS; e++)
            for (int p = 0; p < 3; p++) {
                kt_tensor w;
                if (kt_moe_weight(out[l], e, (kt_moe_proj)p, &w) != KT_OK)
                    return 1;
                for (int64_t i = 0; i < kt_tensor_numel(&w); i++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    float v = ((float)(s >> 40) / 16777216.0f - 0.5f) * 0.1f;
                    ((uint16_t *)w.data)[i] = kt_f32_to_bf16_1(v);
                }
            }
    }
    return 0;
}

static int run_config(const kt_graph *g, int layers, const config *c, int reps,
                      kt_threadpool *pool, measured *out)
{
    kt_moe *moe[MAX_LAYERS] = {0};
    /* with the cache off the graph recomputes the MoE output */
    kt_compile_options o = {.training = 1, .override_checkpoint = 1,
                            .checkpoint = {.kind = c->kind, .k = c->k},
                            .recompute_must_save = !c->moe_cache};
    kt_program *p;
    if (kt_compile(g, &o, &p) != KT_OK)
        return fail("compile");
    if (make_layers(p, layers, moe) != 0)
        return fail("MoE layers");
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    kt_session_options so = {.pool = pool, .seed = 1, .moe_layers = moe, .n_moe_layers = layers,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 1e-3f}};
    kt_session *s;
    if (kt_session_create(p, &so, &s) != KT_OK)
        return fail("session");
    kt_tensor x, y;
    if (kt_session_tensor(s, KT_ROLE_INPUT, "x", &x) != KT_OK ||
        kt_session_tensor(s, KT_ROLE_INPUT, "y", &y) != KT_OK)
        return fail("inputs");
    for (int64_t i = 0; i < kt_tensor_numel(&x); i++)
        ((float *)x.data)[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    for (int64_t i = 0; i < kt_tensor_numel(&y); i++)
        ((int32_t *)y.data)[i] = (int32_t)(i % 16);
    double *t = calloc((size_t)reps + 2, sizeof *t);
    uint64_t flops0 = 0, flops1 = 0;
    for (int r = 0; r < reps + 2; r++) {
        if (r == 2)
            for (int l = 0; l < layers; l++)
                flops0 += kt__moe_flops_run(moe[l]);
        double t0 = bench_now_s();
        if (kt_session_forward(s) != KT_OK || kt_session_backward(s) != KT_OK ||
            kt_session_step(s) != KT_OK)
            return fail("step");
        t[r] = bench_now_s() - t0;
    }
    for (int l = 0; l < layers; l++)
        flops1 += kt__moe_flops_run(moe[l]);
    out->step_s = bench_median(t + 2, reps);
    out->arena = st.arena_bytes;
    out->recompute_flops = st.recompute_flops;
    out->forward_flops = st.forward_flops;
    out->moe_flops = (flops1 - flops0) / (uint64_t)reps;
    out->moe_saved = out->moe_workspace = 0;
    for (int l = 0; l < layers; l++) {
        kt_moe_memory mem;
        kt_moe_get_memory(moe[l], &mem);
        out->moe_saved += mem.saved_bytes_per_token * TOKENS;
        out->moe_workspace += mem.workspace_bytes;
    }
    free(t);
    kt_session_destroy(s);
    kt_program_destroy(p);
    for (int l = 0; l < layers; l++)
        kt_moe_destroy(moe[l]);
    return 0;
}

int bench_checkpoint(int argc, char **argv, const bench_args *common)
{
    int layers = 16;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-bench checkpoint [--layers N] [--json] [--repeats N] [--threads N]\n"
                   "Trains a stack of N conv + MoE layers (256 tokens, hidden 256, 8 experts,\n"
                   "top-2) with each checkpoint policy, MoE output kept or recomputed, and\n"
                   "prints peaks, step times and recomputed FLOPs against no checkpointing.\n");
            return 0;
        } else if (strcmp(argv[i], "--layers") == 0 && i + 1 < argc) {
            long long v;
            if (kt_tool_parse_int("kt-bench checkpoint", "--layers", argv[++i], 1, MAX_LAYERS, &v))
                return 2;
            layers = (int)v;
        } else {
            fprintf(stderr, "kt-bench checkpoint: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    if (layers < 1 || layers > MAX_LAYERS) {
        fprintf(stderr, "kt-bench checkpoint: --layers must be 1..%d\n", MAX_LAYERS);
        return 2;
    }
    kt_graph *g;
    char diag[4096];
    kt_ktg_define d = {"L", layers};
    if (kt_ktg_parse(model, sizeof model - 1, "bench.ktg", &d, 1, &g, diag, sizeof diag, NULL) !=
        KT_OK) {
        fprintf(stderr, "%s", diag);
        return 1;
    }
    int threads = common->threads_given ? common->threads : 0;
    kt_threadpool *pool;
    if (kt_threadpool_create(threads, &pool) != KT_OK)
        return fail("pool");
    int reps = common->repeats_given ? common->repeats : 5;

    const config configs[] = {
        {"none", KT_CHECKPOINT_NONE, 0, 1},    {"segments", KT_CHECKPOINT_SEGMENTS, 0, 1},
        {"segments", KT_CHECKPOINT_SEGMENTS, 0, 0}, {"every_k", KT_CHECKPOINT_EVERY_K, 2, 1},
        {"every_k", KT_CHECKPOINT_EVERY_K, 2, 0}, {"sqrtn", KT_CHECKPOINT_SQRTN, 0, 1},
        {"sqrtn", KT_CHECKPOINT_SQRTN, 0, 0},
    };
    measured base = {0};
    int rc = 0;
    if (!common->json)
        printf("checkpoint: %d conv+MoE layers, %d tokens, hidden %d, %d experts top-%d, "
               "%d threads, median of %d steps\n", layers, TOKENS, HIDDEN, EXPERTS, TOP_K,
               kt_threadpool_size(pool), reps);
    for (size_t i = 0; i < sizeof configs / sizeof configs[0] && rc == 0; i++) {
        measured m;
        if ((rc = run_config(g, layers, &configs[i], reps, pool, &m)) != 0)
            break;
        if (i == 0)
            base = m;
        double peak = (double)(m.arena + m.moe_saved), base_peak = (double)(base.arena + base.moe_saved);
        double peak_ratio = peak / base_peak, time_ratio = m.step_s / base.step_s;
        double rec_ratio = m.forward_flops > 0 ? m.recompute_flops / m.forward_flops : 0;
        uint64_t moe_rec = m.moe_flops > base.moe_flops ? m.moe_flops - base.moe_flops : 0;
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        if (common->json)
            printf("{\"bench\":\"checkpoint\",\"config\":{\"policy\":\"%s\",\"moe_cache\":%s,"
                   "\"layers\":%d,\"threads\":%d},\"peak_bytes\":%llu,\"arena_bytes\":%llu,"
                   "\"moe_saved_bytes\":%llu,\"step_ms\":%.3f,\"activation_peak_ratio\":%.3f,"
                   "\"step_time_ratio\":%.3f,\"recompute_flops_ratio\":%.3f,"
                   "\"moe_flops_recomputed\":%llu,\"moe_workspace_bytes\":%llu,"
                   "\"process_peak_rss_kib\":%ld}\n",
                   configs[i].policy, configs[i].moe_cache ? "true" : "false", layers,
                   kt_threadpool_size(pool), (unsigned long long)(m.arena + m.moe_saved),
                   (unsigned long long)m.arena, (unsigned long long)m.moe_saved, m.step_s * 1e3,
                   peak_ratio, time_ratio, rec_ratio, (unsigned long long)moe_rec,
                   (unsigned long long)m.moe_workspace, ru.ru_maxrss);
        else
            printf("  %-8s moe_cache %-3s  peak %9llu B (arena %9llu + MoE saved %9llu) %.3fx  "
                   "step %8.2f ms %.3fx  recompute %.3fx fwd FLOPs  MoE FLOPs recomputed %llu\n",
                   configs[i].policy, configs[i].moe_cache ? "on" : "off",
                   (unsigned long long)(m.arena + m.moe_saved), (unsigned long long)m.arena,
                   (unsigned long long)m.moe_saved, peak_ratio, m.step_s * 1e3, time_ratio,
                   rec_ratio, (unsigned long long)moe_rec);
    }
    kt_threadpool_destroy(pool);
    kt_graph_destroy(g);
    return rc;
}
