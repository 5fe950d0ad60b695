/* kt-bench layer: one Qwen3-MoE decoder layer, forward+backward through a session, and where
 * its time goes, op by op.
 *
 * The layer is a .ktg text compiled in-process (built in below, or --ktg FILE with its T
 * overridden): RMSNorm, the q/k/v projections, per-head q/k RMSNorm, RoPE, causal GQA
 * attention, the o projection and its residual, RMSNorm, the router (softmax top-k), the CPU
 * MoE experts (the moe op on a kt_moe layer the session binds) and their residual; a tiny
 * classifier head and cross_entropy give backward a scalar loss. The session records a trace
 * (kt_session_options.trace: one clock read per step, only when asked); each event's step
 * names its op and its place in the schedule (forward, backward, recomputed), and the bench
 * adds the times per op and pass. What the steps do not cover (the executor between steps) is
 * "other"; "accumulate" and "fill" are the executor's own steps (parameter gradients copied
 * out, gradients seeded). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kt/kt.h>

#include "graph/program_internal.h"
#include "tools/common/usage.h"
#include "tools/kt-bench/bench.h"

static const char *const tool = "kt-bench layer";

/* Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query heads and 4 KV heads of 128, 128
 * experts, top 8, expert intermediate 768, rope theta 1e6, RMSNorm eps 1e-6, norm_topk_prob);
 * parameters carry the checkpoint's names. */
static const char model[] =
    "const T = 1024\n"
    "const H = 2048\n"
    "const NQ = 32\n"
    "const NKV = 4\n"
    "const D = 128\n"
    "const E = 128\n"
    "const K = 8\n"
    "const V = 16\n"
    "input x: f32[T, H]\n"
    "input y: i32[T]\n"
    "param model.layers.0.input_layernorm.weight: f32[H] = ones\n"
    "param model.layers.0.self_attn.q_proj.weight: f32[NQ * D, H] = normal(0.02)\n"
    "param model.layers.0.self_attn.k_proj.weight: f32[NKV * D, H] = normal(0.02)\n"
    "param model.layers.0.self_attn.v_proj.weight: f32[NKV * D, H] = normal(0.02)\n"
    "param model.layers.0.self_attn.o_proj.weight: f32[H, NQ * D] = normal(0.02)\n"
    "param model.layers.0.self_attn.q_norm.weight: f32[D] = ones\n"
    "param model.layers.0.self_attn.k_norm.weight: f32[D] = ones\n"
    "param model.layers.0.post_attention_layernorm.weight: f32[H] = ones\n"
    "param model.layers.0.mlp.gate.weight: f32[E, H] = normal(0.02)\n"
    "param head.weight: f32[H, V] = normal(0.02)\n"
    "n1 = rmsnorm(x, model.layers.0.input_layernorm.weight, eps = 1e-6)\n"
    "q = matmul(n1, model.layers.0.self_attn.q_proj.weight, trans_b = 1)\n"
    "k = matmul(n1, model.layers.0.self_attn.k_proj.weight, trans_b = 1)\n"
    "v = matmul(n1, model.layers.0.self_attn.v_proj.weight, trans_b = 1)\n"
    "q = reshape(q, shape = [1, T, NQ, D])\n"
    "k = reshape(k, shape = [1, T, NKV, D])\n"
    "v = reshape(v, shape = [1, T, NKV, D])\n"
    "q = rmsnorm(q, model.layers.0.self_attn.q_norm.weight, eps = 1e-6)\n"
    "k = rmsnorm(k, model.layers.0.self_attn.k_norm.weight, eps = 1e-6)\n"
    "q = rope(q, theta = 1000000)\n"
    "k = rope(k, theta = 1000000)\n"
    "o, lse = attention(q, k, v, causal = 1)\n"
    "o = reshape(o, shape = [T, NQ * D])\n"
    "a = matmul(o, model.layers.0.self_attn.o_proj.weight, trans_b = 1)\n"
    "h = add(x, a)\n"
    "n2 = rmsnorm(h, model.layers.0.post_attention_layernorm.weight, eps = 1e-6)\n"
    "logits = matmul(n2, model.layers.0.mlp.gate.weight, trans_b = 1)\n"
    "ids, w = topk_router(logits, k = K, norm_topk = 1)\n"
    "m = moe(n2, ids, w, layer = 0)\n"
    "out = add(h, m)\n"
    "head = matmul(out, head.weight)\n"
    "loss = cross_entropy(head, y)\n"
    "output out\n"
    "loss loss\n";

#define MAX_KEYS 64

/* Time of one (op, category) over the timed steps */
typedef struct op_time {
    char key[48]; /* "attention backward" */
    double ns;
} op_time;

typedef struct layer_args {
    int64_t T[8];
    int nT;
    int64_t inter;
    kt_moe_mode mode;
    const char *ktg_path;
    int nodes; /* --nodes: per node (op and name) rather than per op */
} layer_args;

/* The whole file into a new buffer (*text, *len); 0, or 1 after saying why. */
static int read_text(const char *path, char **text, size_t *len)
{
    FILE *f = fopen(path, "rb");
    long n = -1;
    if (f != NULL && fseek(f, 0, SEEK_END) == 0)
        n = ftell(f);
    *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
    const int ok = *text != NULL && fseek(f, 0, SEEK_SET) == 0 &&
                   fread(*text, 1, (size_t)n, f) == (size_t)n;
    if (f != NULL)
        fclose(f);
    if (!ok) {
        free(*text);
        *text = NULL;
        fprintf(stderr, "%s: cannot read %s\n", tool, path);
        return 1;
    }
    *len = (size_t)n;
    return 0;
}

static int fail(const char *what)
{
    fprintf(stderr, "%s: %s: %s\n", tool, what, kt_last_error());
    return 1;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static float uniform_pm(float a) /* uniform in [-a, a) */
{
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return ((float)((rng * 0x2545F4914F6CDD1Dull) >> 40) / 16777216.0f * 2.0f - 1.0f) * a;
}

#define MAX_MOE 64

/* The program's MoE layers (bound by their `layer` index), bf16 weights with the variance of
 * a 1/sqrt(fan-in) init. */
static int make_moe(const kt_program *p, const layer_args *a, kt_threadpool *pool, kt_moe **moe,
                    int *n)
{
    *n = kt_program_moe_count(p);
    if (*n < 1 || *n > MAX_MOE) {
        fprintf(stderr, "%s: the model has %d moe ops (1 to %d wanted)\n", tool, *n, MAX_MOE);
        return 1;
    }
    for (int i = 0; i < *n; i++) {
        kt_program_moe info;
        kt_moe_config c;
        if (kt_program_moe_info(p, i, &info) != KT_OK || info.binding < 0 ||
            info.binding >= *n || moe[info.binding] != NULL) {
            fprintf(stderr, "%s: the moe ops' layers are not 0..%d, each once\n", tool, *n - 1);
            return 1;
        }
        if (kt_program_moe_config(&info, a->inter, KT_BF16, a->mode,
                                  a->mode == KT_MOE_LORA ? 8 : 0, 16.0f, 1, &c) != KT_OK)
            return fail("MoE layer");
        c.name = "bench";
        kt_moe *m = NULL;
        if (kt_moe_create(&c, pool, &m) != KT_OK)
            return fail("MoE layer");
        moe[info.binding] = m;
        const float sc_in = 1.7320508f / sqrtf((float)c.hidden);
        const float sc_mid = 1.7320508f / sqrtf((float)c.intermediate);
        for (int64_t e = 0; e < c.n_experts; e++)
            for (int q = 0; q < 3; q++) {
                kt_tensor w;
                if (kt_moe_weight(m, e, (kt_moe_proj)q, &w) != KT_OK)
                    return fail("MoE weights");
                const float sc = q == KT_MOE_DOWN ? sc_mid : sc_in;
                for (int64_t j = 0; j < kt_tensor_numel(&w); j++)
                    ((uint16_t *)w.data)[j] = kt_f32_to_bf16_1(uniform_pm(sc));
            }
    }
    return 0;
}

static void add_time(op_time *t, int *n, const char *key, double ns)
{
    for (int i = 0; i < *n; i++)
        if (strcmp(t[i].key, key) == 0) {
            t[i].ns += ns;
            return;
        }
    if (*n == MAX_KEYS)
        key = "(more)";
    snprintf(t[*n].key, sizeof t[*n].key, "%s", key);
    t[(*n)++].ns = ns;
}

static int by_time(const void *a, const void *b)
{
    const double x = ((const op_time *)a)->ns, y = ((const op_time *)b)->ns;
    return (x < y) - (x > y);
}

/* The trace's events per (op, pass) into times. The pass is the schedule's: a step after
 * the forward schedule is the backward's, also when it runs an op's forward kernel (the sums
 * of gradients autodiff adds), unless it is a recomputed forward step. */
static void collect(const kt_program *p, const kt_trace_event *ev, size_t n, int nodes,
                    op_time *times, int *n_times, double *traced_ns)
{
    for (size_t i = 0; i < n; i++) {
        const double ns = (double)(ev[i].end_ns - ev[i].start_ns);
        const int32_t at = ev[i].step;
        const kt__pstep *ps = at >= 0 && at < p->n_steps ? &p->steps[at] : NULL;
        char key[48];
        if (ps != NULL && ps->kind <= KT__STEP_BACKWARD) {
            const char *pass = at < p->n_forward                  ? "forward"
                               : (ps->flags & KT__STEP_RECOMPUTE) ? "recompute"
                                                                  : "backward";
            if (nodes)
                snprintf(key, sizeof key, "%s %.20s %s", kt_op_name(ps->op),
                         ev[i].name && ev[i].name[0] ? ev[i].name : "-", pass);
            else
                snprintf(key, sizeof key, "%s %s", kt_op_name(ps->op), pass);
        } else {
            snprintf(key, sizeof key, "%s", ev[i].category);
        }
        add_time(times, n_times, key, ns);
        *traced_ns += ns;
    }
}

static int run_T(const kt_graph *g, const layer_args *a, int64_t T, kt_threadpool *pool,
                 const bench_args *common)
{
    kt_compile_options co = {.training = 1};
    kt_program *p = NULL;
    kt_moe *moe[MAX_MOE] = {NULL};
    kt_session *s = NULL;
    kt_trace_event *trace = NULL;
    int n_moe = 0, rc = 1;
    if (kt_compile(g, &co, &p) != KT_OK) {
        fail("compile");
        goto out;
    }
    if (make_moe(p, a, pool, moe, &n_moe) != 0)
        goto out;
    const size_t cap = (size_t)p->n_steps + 16;
    trace = calloc(cap, sizeof *trace);
    kt_session_options so = {.pool = pool, .seed = 1, .moe_layers = moe, .n_moe_layers = n_moe,
                             .trace = trace, .trace_capacity = cap,
                             .optimizer = {.kind = KT_OPTIM_NONE}};
    if (trace == NULL || kt_session_create(p, &so, &s) != KT_OK) {
        fail("session");
        goto out;
    }
    kt_tensor x, y;
    if (kt_session_tensor(s, KT_ROLE_INPUT, "x", &x) != KT_OK ||
        kt_session_tensor(s, KT_ROLE_INPUT, "y", &y) != KT_OK) {
        fail("inputs");
        goto out;
    }
    for (int64_t i = 0; i < kt_tensor_numel(&x); i++)
        ((float *)x.data)[i] = uniform_pm(1.7320508f);
    for (int64_t i = 0; i < kt_tensor_numel(&y); i++)
        ((int32_t *)y.data)[i] = (int32_t)(i * 7 % 16);
    const int warmup = 1, reps = common->repeats_given ? common->repeats : 3;
    double *t = calloc((size_t)(warmup + reps), sizeof *t), traced = 0;
    op_time times[MAX_KEYS + 1];
    int n_times = 0;
    for (int r = 0; t != NULL && r < warmup + reps; r++) {
        kt_session_trace_reset(s);
        const double t0 = bench_now_s();
        if (kt_session_forward(s) != KT_OK || kt_session_backward(s) != KT_OK) {
            fail("step");
            free(t);
            goto out;
        }
        t[r] = bench_now_s() - t0;
        if (r >= warmup)
            collect(p, trace, kt_session_trace_count(s), a->nodes, times, &n_times, &traced);
        /* gradients averaged, nothing updated (KT_OPTIM_NONE), the next backward allowed;
         * not timed, not traced (reset above) */
        if (kt_session_step(s) != KT_OK) {
            fail("step");
            free(t);
            goto out;
        }
    }
    if (t == NULL)
        goto out;
    double total = 0;
    for (int r = warmup; r < warmup + reps; r++)
        total += t[r];
    const double med = bench_median(t + warmup, reps);
    free(t);
    const double other = total * 1e9 - traced;
    add_time(times, &n_times, "other", other > 0 ? other : 0);
    qsort(times, (size_t)n_times, sizeof times[0], by_time);
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    const int threads = kt_threadpool_size(pool);
    static const char *const modes[] = {"frozen", "lora", "full"};
    if (common->json) {
        printf("{\"bench\":\"layer\",\"config\":{\"model\":\"%s\",\"T\":%lld,\"threads\":%d,"
               "\"moe_mode\":\"%s\",\"intermediate\":%lld,\"pass\":\"fwdbwd\"},"
               "\"fwdbwd_ms\":%.3f,\"tokens_per_s\":%.1f,\"arena_bytes\":%llu,"
               "\"share\":{",
               a->ktg_path ? a->ktg_path : "qwen3_moe", (long long)T, threads, modes[a->mode],
               (long long)a->inter, med * 1e3, (double)T / med,
               (unsigned long long)st.arena_bytes);
        for (int i = 0; i < n_times; i++)
            printf("%s\"%s\":%.4f", i ? "," : "", times[i].key, times[i].ns / (total * 1e9));
        printf("},\"ms_per_step\":{");
        for (int i = 0; i < n_times; i++)
            printf("%s\"%s\":%.3f", i ? "," : "", times[i].key, times[i].ns * 1e-6 / reps);
        printf("}}\n");
    } else {
        printf("layer %s T=%lld, MoE %s (I=%lld), %d threads: fwd+bwd %.1f ms (median of %d), "
               "%.0f tokens/s, arena %.1f MiB\n",
               a->ktg_path ? a->ktg_path : "qwen3_moe", (long long)T, modes[a->mode],
               (long long)a->inter, threads, med * 1e3, reps, (double)T / med,
               (double)st.arena_bytes / 1048576.0);
        for (int i = 0; i < n_times; i++)
            printf("  %-28s %9.2f ms  %5.1f%%\n", times[i].key, times[i].ns * 1e-6 / reps,
                   100.0 * times[i].ns / (total * 1e9));
    }
    fflush(stdout);
    rc = 0;
out:
    kt_session_destroy(s);
    free(trace);
    kt_program_destroy(p);
    for (int i = 0; i < MAX_MOE; i++)
        kt_moe_destroy(moe[i]);
    return rc;
}

int bench_layer(int argc, char **argv, const bench_args *common)
{
    layer_args a = {.T = {1024, 4096}, .nT = 2, .inter = 768, .mode = KT_MOE_FROZEN};
    for (int i = 0; i < argc; i += 2) { /* every option but --help takes a value */
        const char *s = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long x;
        if (strcmp(s, "--nodes") == 0) {
            a.nodes = 1;
            i--; /* no value */
            continue;
        }
        if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
            printf("usage: kt-bench layer [--T LIST] [--mode frozen|lora|full] [--inter N]\n"
                   "                      [--ktg FILE] [--nodes] [--threads N] [--repeats N]\n"
                   "                      [--json]\n"
                   "Runs one Qwen3-MoE decoder layer (hidden 2048, 32 query heads and 4 KV\n"
                   "heads of 128, RoPE, causal GQA attention, 128 experts top-8 of\n"
                   "intermediate 768 on the CPU MoE layer, bf16 experts, the rest f32)\n"
                   "forward+backward through a session, and prints the median step time and\n"
                   "the share of it each op takes, forward and backward apart (from the\n"
                   "session's trace; 'other': the time between the steps). The shares are of\n"
                   "the timed steps' total, the ms per op their mean.\n"
                   "--nodes: per node (op and output name: the q, k, v and o projections\n"
                   "apart) rather than per op.\n"
                   "--ktg FILE runs that .ktg instead (it must have inputs x [T,H] f32 and\n"
                   "y [T] i32 (classes from 16 on), moe ops of layers 0..n-1, and a loss;\n"
                   "its constant T is set per --T).\n"
                   "Defaults: --T 1024,4096 --mode frozen --inter 768, all CPUs, 3 repeats\n"
                   "after 1 warm-up step.\n");
            return 0;
        }
        if (v == NULL)
            return kt_tool_usage_error(tool, "unknown option %s (see --help)", s);
        if (strcmp(s, "--T") == 0) {
            char buf[128];
            snprintf(buf, sizeof buf, "%s", v);
            a.nT = 0;
            for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && a.nT < 8;
                 tok = strtok_r(NULL, ",", &save)) {
                if (kt_tool_parse_int(tool, s, tok, 1, 1 << 20, &x) != 0)
                    return 2;
                a.T[a.nT++] = x;
            }
        } else if (strcmp(s, "--inter") == 0) {
            if (kt_tool_parse_int(tool, s, v, 1, 1 << 20, &x) != 0)
                return 2;
            a.inter = x;
        } else if (strcmp(s, "--mode") == 0) {
            if (strcmp(v, "frozen") == 0)
                a.mode = KT_MOE_FROZEN;
            else if (strcmp(v, "lora") == 0)
                a.mode = KT_MOE_LORA;
            else if (strcmp(v, "full") == 0)
                a.mode = KT_MOE_FULL;
            else
                return kt_tool_usage_error(tool, "unknown mode '%s'", v);
        } else if (strcmp(s, "--ktg") == 0) {
            a.ktg_path = v;
        } else {
            return kt_tool_usage_error(tool, "unknown option %s (see --help)", s);
        }
    }
    char *text = NULL;
    size_t len = sizeof model - 1;
    if (a.ktg_path != NULL) {
        if (read_text(a.ktg_path, &text, &len) != 0)
            return 1;
    }
    const int threads = common->threads_given ? common->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    kt_threadpool *pool;
    if (kt_threadpool_create(threads, &pool) != KT_OK) {
        free(text);
        return fail("pool");
    }
    int rc = 0;
    for (int i = 0; i < a.nT && rc == 0; i++) {
        kt_graph *g;
        char diag[4096];
        kt_ktg_define d = {"T", a.T[i]};
        if (kt_ktg_parse(text ? text : model, len, a.ktg_path ? a.ktg_path : "qwen3_moe.ktg", &d,
                         1, &g, diag, sizeof diag, NULL) != KT_OK) {
            fprintf(stderr, "%s", diag);
            rc = 1;
            break;
        }
        rc = run_T(g, &a, a.T[i], pool, common);
        kt_graph_destroy(g);
    }
    kt_threadpool_destroy(pool);
    free(text);
    return rc;
}
