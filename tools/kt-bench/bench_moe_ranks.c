/* kt-bench moe --ranks W: a MoE layer's forward and backward on W local ranks, rank 0 holding
 * every expert against expert parallelism (the moe op's `parallel`), in the same run.
 *
 * Each rank runs x[T, H] -> router -> top-k -> moe -> cross-entropy through a session with the
 * UCX communicator (the op's kernels as a training step runs them, gradients of x and of the
 * routing weights, then a step that updates nothing; frozen bf16 experts by default). rank0: rank 0's layer holds the E experts
 * and runs the W*T tokens; ep: rank r's layer holds its consecutive share of E/W experts and
 * runs the (token, slot) pairs routed to them. Time per forward + backward: the median over
 * batches of a batch's mean, every batch started by a barrier, on rank 0; tokens/s counts the
 * tokens of all ranks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"

#define MAX_RUNS 16

typedef struct moe_shape {
    int64_t tokens, experts, hidden, inter, top_k;
    kt_moe_mode mode;
} moe_shape;

static const char *par_name(int p) { return p == KT_MOE_PARALLEL_EP ? "ep" : "rank0"; }
static const char *mode_name(kt_moe_mode m)
{
    return m == KT_MOE_FULL ? "full" : m == KT_MOE_LORA ? "lora" : "frozen";
}

/* ---- a rank ------------------------------------------------------------------------------- */

static kt_status build(const moe_shape *sh, kt_moe_parallel par, kt_program **out)
{
    kt_graph *g = NULL;
    kt_value x, y, r, logits, route[2], m, loss;
    kt_op_attrs ra = kt_op_defaults(KT_OP_TOPK_ROUTER), ma = kt_op_defaults(KT_OP_MOE);
    kt_op_attrs ce = kt_op_defaults(KT_OP_CROSS_ENTROPY);
    ra.k = sh->top_k;
    ra.norm_topk = 1;
    ma.moe_parallel = par;
    ce.ignore_index = -100;
    kt_status st = kt_graph_create(&g);
    if (st == KT_OK)
        st = kt_graph_input(g, "x", KT_F32, 2, (int64_t[]){sh->tokens, sh->hidden}, &x);
    if (st == KT_OK)
        st = kt_graph_input(g, "y", KT_I32, 1, (int64_t[]){sh->tokens}, &y);
    if (st == KT_OK)
        st = kt_graph_param(g, "router", KT_F32, 2, (int64_t[]){sh->hidden, sh->experts},
                            kt_init_normal(0.5f), &r);
    if (st == KT_OK)
        st = kt_graph_op(g, "route", KT_OP_MATMUL, NULL, (kt_value[]){x, r}, 2, &logits);
    if (st == KT_OK)
        st = kt_graph_op(g, "topk", KT_OP_TOPK_ROUTER, &ra, &logits, 1, route);
    if (st == KT_OK)
        st = kt_graph_op(g, "moe", KT_OP_MOE, &ma, (kt_value[]){x, route[0], route[1]}, 3, &m);
    if (st == KT_OK)
        st = kt_graph_op(g, "loss", KT_OP_CROSS_ENTROPY, &ce, (kt_value[]){m, y}, 2, &loss);
    if (st == KT_OK)
        st = kt_graph_set_loss(g, loss);
    if (st == KT_OK)
        st = kt_compile(g, NULL, out);
    kt_graph_destroy(g);
    return st;
}

/* This rank's layer: all experts on rank 0 (rank0), its consecutive share (ep); NULL where
 * it holds none. */
static kt_status make_layer(const moe_shape *sh, kt_moe_parallel par, int rank, int world,
                            kt_moe **out)
{
    *out = NULL;
    const int ep = par == KT_MOE_PARALLEL_EP;
    int64_t first = 0, n = sh->experts;
    if (ep) {
        for (int r = 0; r < rank; r++)
            first += sh->experts / world + (r < sh->experts % world);
        n = sh->experts / world + (rank < sh->experts % world);
    }
    if ((!ep && rank != 0) || n < 1)
        return KT_OK;
    int64_t *ids = malloc((size_t)n * sizeof *ids);
    if (ids == NULL)
        return KT_ENOMEM;
    for (int64_t e = 0; e < n; e++)
        ids[e] = first + e;
    kt_moe_config c = {.n_experts = n, .hidden = sh->hidden, .intermediate = sh->inter,
                       .top_k = ep ? 1 : sh->top_k,
                       .max_tokens = sh->tokens * world * (ep ? sh->top_k : 1),
                       .weight_dtype = sh->mode == KT_MOE_FULL ? KT_F32 : KT_BF16,
                       .act_dtype = KT_F32, .mode = sh->mode, .lora_rank = 8, .lora_alpha = 16,
                       .keep_activations = 1, .name = "bench", .expert_ids = ids};
    kt_status st = kt_moe_create(&c, NULL, out);
    free(ids);
    for (int64_t e = 0; st == KT_OK && e < n; e++)
        for (int p = 0; st == KT_OK && p < 3; p++) {
            kt_tensor w;
            st = kt_moe_weight(*out, e, (kt_moe_proj)p, &w);
            for (int64_t i = 0; st == KT_OK && i < kt_tensor_numel(&w); i++) {
                float v = (float)((i * 7 + (first + e) * 13 + p) % 101 - 50) * 1e-3f;
                if (w.dtype == KT_BF16)
                    ((uint16_t *)w.data)[i] = kt_f32_to_bf16_1(v);
                else
                    ((float *)w.data)[i] = v;
            }
        }
    return st;
}

/* forward, backward and a step that updates nothing (the router's gradient averaged) */
static kt_status step(kt_session *s)
{
    kt_status st = kt_session_forward(s);
    if (st == KT_OK)
        st = kt_session_backward(s);
    return st == KT_OK ? kt_session_step(s) : st;
}

static kt_status time_one(kt_comm *c, const moe_shape *sh, kt_moe_parallel par, int steps,
                          double *us)
{
    const int world = kt_comm_size(c), rank = kt_comm_rank(c);
    kt_program *p = NULL;
    kt_session *s = NULL;
    kt_moe *layer = NULL;
    kt_status st = build(sh, par, &p);
    if (st == KT_OK)
        st = make_layer(sh, par, rank, world, &layer);
    kt_moe *layers[1] = {layer};
    kt_session_options so = {.threads = 1, .comm = c, .moe_layers = layers, .n_moe_layers = 1,
                             .seed = 7, .optimizer = {.kind = KT_OPTIM_NONE}};
    if (st == KT_OK)
        st = kt_session_create(p, &so, &s);
    kt_tensor x, y;
    if (st == KT_OK)
        st = kt_session_tensor(s, KT_ROLE_INPUT, "x", &x);
    if (st == KT_OK)
        st = kt_session_tensor(s, KT_ROLE_INPUT, "y", &y);
    for (int64_t i = 0; st == KT_OK && i < sh->tokens * sh->hidden; i++)
        ((float *)x.data)[i] = (float)((i * 31 + rank * 17) % 97 - 48) * 0.02f;
    for (int64_t i = 0; st == KT_OK && i < sh->tokens; i++)
        ((int32_t *)y.data)[i] = (int32_t)((i * 5 + rank) % sh->hidden);
    int batches = 5, warm = 2;
    double means[16];
    for (int i = 0; i < warm && st == KT_OK; i++)
        st = step(s);
    for (int b = 0; b < batches && st == KT_OK; b++) {
        st = kt_comm_barrier(c);
        double t0 = bench_now_s();
        for (int i = 0; i < steps && st == KT_OK; i++)
            st = step(s);
        means[b] = (bench_now_s() - t0) / steps;
    }
    if (st == KT_OK)
        *us = bench_median(means, batches) * 1e6;
    kt_session_destroy(s);
    kt_moe_destroy(layer);
    kt_program_destroy(p);
    return st;
}

/* args: PARALLELS TOKENS EXPERTS HIDDEN INTER TOP_K MODE STEPS */
int bench_moe_rank(int argc, char **argv)
{
    if (argc < 8)
        return 2;
    moe_shape sh = {.tokens = atoll(argv[1]), .experts = atoll(argv[2]),
                    .hidden = atoll(argv[3]), .inter = atoll(argv[4]), .top_k = atoll(argv[5]),
                    .mode = (kt_moe_mode)atoi(argv[6])};
    int steps = atoi(argv[7]);
    kt_comm *c = bench_rank_comm("moe");
    if (c == NULL)
        return 1;
    FILE *out = kt_comm_rank(c) == 0 ? bench_result_stream() : NULL;
    kt_status st = KT_OK;
    for (int par = 0; par < 2 && st == KT_OK; par++) {
        if (strstr(argv[0], par_name(par)) == NULL)
            continue;
        double us = 0;
        st = time_one(c, &sh, (kt_moe_parallel)par, steps, &us);
        if (st == KT_OK && out != NULL)
            fprintf(out, "moe %d %.4f\n", par, us);
    }
    if (st != KT_OK)
        fprintf(stderr, "kt-bench moe: rank %d: %s\n", kt_comm_rank(c), kt_last_error());
    if (out != NULL)
        fclose(out);
    kt_comm_destroy(c);
    return st == KT_OK ? 0 : 1;
}

/* ---- the parent ---------------------------------------------------------------------------- */

typedef struct moe_run {
    double us[2]; /* per kt_moe_parallel; < 0: none */
} moe_run;

static void on_line(void *ctx, const char *line)
{
    moe_run *run = ctx;
    int par;
    double us;
    if (sscanf(line, "moe %d %lf", &par, &us) == 2 && par >= 0 && par < 2)
        run->us[par] = us;
}

static int parse_int(const char *opt, const char *v, int64_t lo, int64_t hi, int64_t *out)
{
    char *end = NULL;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "kt-bench moe: %s takes an integer from %lld to %lld, not '%s'\n", opt,
                (long long)lo, (long long)hi, v);
        return 0;
    }
    *out = x;
    return 1;
}

int bench_moe_ranks(int argc, char **argv, const bench_args *common)
{
    const char *transport = NULL, *ranks_list = "2,4", *parallels = "rank0,ep";
    moe_shape sh = {.tokens = 128, .experts = 8, .hidden = 256, .inter = 512, .top_k = 2,
                    .mode = KT_MOE_FROZEN};
    int64_t steps = 5;
    static const char *const with_value[] = {"--transport", "--ranks", "--parallel", "--tokens",
                                              "--experts", "--hidden", "--inter", "--top-k",
                                              "--mode", "--steps"};
    for (int i = 0; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-bench moe --ranks 2[,4] [--parallel rank0,ep] [--transport shm|tcp]\n"
                   "                    [--tokens T] [--experts E] [--hidden H] [--inter I]\n"
                   "                    [--top-k K] [--mode frozen|lora|full] [--steps N] [--json]\n"
                   "Times a MoE layer's forward + backward (the moe op in a session: router,\n"
                   "top-k, moe, cross-entropy; T tokens per rank, one thread per rank) on W local\n"
                   "ranks with rank 0 holding every expert (rank0) and with the experts split\n"
                   "over the ranks (ep), and prints tokens/s (all ranks' tokens) and the ratio\n"
                   "ep / rank0.\n");
            return 0;
        } else if (v == NULL && bench_is_one_of(argv[i], with_value, 10)) {
            fprintf(stderr, "kt-bench moe: %s needs a value (see --help)\n", argv[i]);
            return 2;
        } else if (strcmp(argv[i], "--transport") == 0) {
            transport = argv[++i];
            if (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) {
                fprintf(stderr, "kt-bench moe: --transport is shm or tcp\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--ranks") == 0) {
            ranks_list = argv[++i];
        } else if (strcmp(argv[i], "--parallel") == 0) {
            parallels = argv[++i];
            if (strstr(parallels, "rank0") == NULL && strstr(parallels, "ep") == NULL) {
                fprintf(stderr, "kt-bench moe: --parallel is rank0, ep or rank0,ep\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--mode") == 0) {
            const char *m = argv[++i];
            sh.mode = strcmp(m, "full") == 0 ? KT_MOE_FULL
                      : strcmp(m, "lora") == 0 ? KT_MOE_LORA : KT_MOE_FROZEN;
            if (strcmp(m, mode_name(sh.mode)) != 0) {
                fprintf(stderr, "kt-bench moe: --mode is frozen, lora or full\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--tokens") == 0) {
            if (!parse_int(argv[i], argv[i + 1], 1, 1 << 16, &sh.tokens))
                return 2;
            i++;
        } else if (strcmp(argv[i], "--experts") == 0) {
            if (!parse_int(argv[i], argv[i + 1], 1, 4096, &sh.experts))
                return 2;
            i++;
        } else if (strcmp(argv[i], "--hidden") == 0) {
            if (!parse_int(argv[i], argv[i + 1], 1, 1 << 14, &sh.hidden))
                return 2;
            i++;
        } else if (strcmp(argv[i], "--inter") == 0) {
            if (!parse_int(argv[i], argv[i + 1], 1, 1 << 15, &sh.inter))
                return 2;
            i++;
        } else if (strcmp(argv[i], "--top-k") == 0) {
            if (!parse_int(argv[i], argv[i + 1], 1, 64, &sh.top_k))
                return 2;
            i++;
        } else if (strcmp(argv[i], "--steps") == 0) {
            if (!parse_int(argv[i], argv[i + 1], 1, 100000, &steps))
                return 2;
            i++;
        } else {
            fprintf(stderr, "kt-bench moe: unknown option %s with --ranks (see --ranks --help)\n",
                    argv[i]);
            return 2;
        }
    }
    size_t ranks[4];
    int nr = bench_parse_sizes(ranks_list, ranks, 4);
    if (nr <= 0) {
        fprintf(stderr, "kt-bench moe: bad --ranks\n");
        return 2;
    }
    for (int i = 0; i < nr; i++)
        if (ranks[i] < 2 || ranks[i] > 16 || (int64_t)ranks[i] > sh.experts) {
            fprintf(stderr, "kt-bench moe: --ranks between 2 and 16, and at most the experts "
                    "(%lld)\n", (long long)sh.experts);
            return 2;
        }
    if (sh.top_k > sh.experts) {
        fprintf(stderr, "kt-bench moe: --top-k exceeds --experts\n");
        return 2;
    }
    if (!bench_have_ucx())
        return bench_no_ucx("moe", common->json);
    if (!common->json)
        printf("moe: forward + backward, %lld tokens per rank, E=%lld H=%lld I=%lld k=%lld, %s "
               "experts, 1 thread per rank, transport %s; ratio > 1: ep faster\n",
               (long long)sh.tokens, (long long)sh.experts, (long long)sh.hidden,
               (long long)sh.inter, (long long)sh.top_k, mode_name(sh.mode),
               transport ? transport : "default");
    int rc = 0;
    for (int ri = 0; ri < nr; ri++) {
        const int w = (int)ranks[ri];
        moe_run run = {.us = {-1, -1}};
        char a[8][32];
        snprintf(a[0], 32, "%s", "moe");
        snprintf(a[1], 32, "%s", parallels);
        snprintf(a[2], 32, "%lld", (long long)sh.tokens);
        snprintf(a[3], 32, "%lld", (long long)sh.experts);
        snprintf(a[4], 32, "%lld", (long long)sh.hidden);
        snprintf(a[5], 32, "%lld", (long long)sh.inter);
        snprintf(a[6], 32, "%lld", (long long)sh.top_k);
        snprintf(a[7], 32, "%d", (int)sh.mode);
        char steps_s[32];
        snprintf(steps_s, sizeof steps_s, "%lld", (long long)steps);
        char *args[] = {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], steps_s};
        if (bench_spawn_ranks(w, transport, args, 9, on_line, &run) != 0 ||
            (run.us[0] < 0 && run.us[1] < 0)) {
            fprintf(stderr, "kt-bench moe: the libkt ranks failed\n");
            rc = 1;
            continue;
        }
        double tps[2];
        for (int p = 0; p < 2; p++)
            tps[p] = run.us[p] > 0 ? (double)(sh.tokens * w) / (run.us[p] * 1e-6) : (double)NAN;
        double ratio = bench_ratio(tps[1], tps[0]);
        if (common->json) {
            printf("{\"bench\":\"moe\",\"config\":{\"op\":\"moe\",\"ranks\":%d,\"transport\":"
                   "\"%s\",\"parallel\":\"%s\",\"tokens_per_rank\":%lld,\"experts\":%lld,"
                   "\"hidden\":%lld,\"inter\":%lld,\"top_k\":%lld,\"mode\":\"%s\","
                   "\"threads_per_rank\":1},\"rank0_tokens_per_s\":%s,\"ep_tokens_per_s\":%s,"
                   "\"rank0_step_us\":%s,\"ep_step_us\":%s,\"ratio_ep_vs_rank0\":%s}\n",
                   w, transport ? transport : "default", parallels, (long long)sh.tokens,
                   (long long)sh.experts, (long long)sh.hidden, (long long)sh.inter,
                   (long long)sh.top_k, mode_name(sh.mode), BENCH_JNUM("%.1f", tps[0]),
                   BENCH_JNUM("%.1f", tps[1]),
                   BENCH_JNUM("%.2f", run.us[0] > 0 ? run.us[0] : (double)NAN),
                   BENCH_JNUM("%.2f", run.us[1] > 0 ? run.us[1] : (double)NAN),
                   BENCH_JNUM("%.3f", ratio));
        } else {
            for (int p = 0; p < 2; p++)
                if (run.us[p] > 0)
                    printf("  %d ranks %-5s  %10.1f us per step  %10.0f tokens/s\n", w,
                           par_name(p), run.us[p], tps[p]);
            if (ratio == ratio)
                printf("  %d ranks ratio ep / rank0: %.2fx\n", w, ratio);
        }
    }
    return rc;
}
