/* kt-bench: measures libkt against the limit or peer it is judged by, in the same run.
 *
 *   kt-bench <what> [options] [--json]
 *
 * Each subcommand prints one line (or one JSON object with --json) per configuration. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "tools/common/files.h"
#include "tools/kt-bench/bench.h"
#include "tools/common/usage.h"
#include "kt/kt.h"

double bench_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#ifndef KT_BENCH_DATADIR
#define KT_BENCH_DATADIR "/usr/local/share/kt"
#define KT_BENCH_DATADIR_REL "share/kt"
#endif

const char *bench_find_script(const char *built_in, const char *name, char *buf, size_t size)
{
    if (access(built_in, R_OK) == 0)
        return built_in;
    snprintf(buf, size, "%s/%s", KT_BENCH_DATADIR, name);
    if (access(buf, R_OK) == 0)
        return buf;
    char exe[2048];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char *slash = NULL;
    if (n > 0) {
        exe[n] = '\0';
        slash = strrchr(exe, '/'); /* .../bin/kt-bench -> ... */
        if (slash != NULL) {
            *slash = '\0';
            slash = strrchr(exe, '/');
        }
    }
    if (slash != NULL) {
        *slash = '\0';
        snprintf(buf, size, "%s/%s/%s", exe, KT_BENCH_DATADIR_REL, name);
        if (access(buf, R_OK) == 0)
            return buf;
    }
    return built_in;
}

int bench_is_one_of(const char *s, const char *const *names, int n)
{
    for (int k = 0; k < n; k++)
        if (strcmp(s, names[k]) == 0)
            return 1;
    return 0;
}

double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const char *bench_jnum(char *buf, size_t size, const char *fmt, double v)
{
    if (!isfinite(v))
        return "null";
    snprintf(buf, size, fmt, v);
    return buf;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kt-bench <what> [options] [--json]\n"
               "\n"
               "what:\n"
               "  graph   executor overhead per step: a graph of many tiny ops run by a\n"
               "          session against the same kernels called directly\n"
               "  gemm    the bf16 MoE GEMM kernels (nt, nn, tn) against their\n"
               "          instruction's register peak measured in the same run\n"
               "  moe     the CPU MoE layer: forward and forward+backward against the\n"
               "          register peak / OpenBLAS sgemm, memory bandwidth and PyTorch\n"
               "  checkpoint  activation checkpointing policies on a conv + MoE stack:\n"
               "          peaks, step times and recomputed FLOPs against none\n"
               "  comm    the UCX communicator on 2 local ranks: latency and bandwidth\n"
               "          against raw UCX (ucx_perftest) and torch.distributed gloo\n"
               "  halo    the context-parallel halo exchange forward (p2p and all-gather)\n"
               "          on 2 (or 4) local ranks against gloo\n"
               "  attention  the attention op forward and forward+backward against the\n"
               "          register peak and PyTorch's scaled_dot_product_attention\n"
               "          (--torch-python PATH or KT_TORCH_PYTHON: a python with torch >= 2)\n"
               "  layer   one Qwen3-MoE decoder layer forward+backward through a session:\n"
               "          its step time and the share of it each op takes\n"
               "  train   training a model (the main job's, and LoRA on a Qwen3-MoE of\n"
               "          30B-A3B's layer size) against PyTorch (transformers, PEFT):\n"
               "          tokens/s and peak RSS of each\n"
               "\n"
               "common options:\n"
               "  --json         one JSON object per configuration\n"
               "  --repeats N    timed repetitions, the median is reported (default: graph\n"
               "                 and gemm 15, moe, checkpoint and attention 5, layer 3, moe at\n"
               "                 qlen <= 16 31; comm and halo time their own counts per size)\n"
               "  --threads N    thread-pool size (default: graph 1; gemm, moe, checkpoint,\n"
               "                 attention and layer all CPUs; comm and halo one thread per\n"
               "                 rank)\n"
               "  -h, --help     this text; 'kt-bench <what> --help' for a subcommand\n");
}

static int bench_main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "__rank") == 0) /* a rank kt-bench comm / halo started */
        return bench_rank(argc - 2, argv + 2);
    if (kt_check_environment() != KT_OK)
        return kt_tool_usage_error("kt-bench", "%s", kt_last_error());
    bench_args common = {.json = 0, .repeats = 15, .warmup = 3, .threads = 1};
    /* common options may appear anywhere after the subcommand; the rest go to it */
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    int n_rest = 0;
    if (rest == NULL)
        return 1;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            common.json = 1;
        } else if ((strcmp(argv[i], "--repeats") == 0 || strcmp(argv[i], "--threads") == 0) &&
                   i + 1 < argc) {
            long long v = 0;
            const long long hi = argv[i][2] == 'r' ? 1000000 : KT_MAX_THREADS;
            if (kt_tool_parse_int("kt-bench", argv[i], argv[i + 1], 1, hi, &v) != 0) {
                free(rest);
                return 2;
            }
            if (argv[i][2] == 'r') {
                common.repeats = (int)v;
                common.repeats_given = 1;
            } else {
                common.threads = (int)v;
                common.threads_given = 1;
            }
            i++;
        } else {
            rest[n_rest++] = argv[i];
        }
    }
    int rc;
    if (strcmp(argv[1], "graph") == 0) {
        rc = bench_graph(n_rest, rest, &common);
    } else if (strcmp(argv[1], "gemm") == 0) {
        rc = bench_gemm(n_rest, rest, &common);
    } else if (strcmp(argv[1], "moe") == 0) {
        rc = bench_moe(n_rest, rest, &common);
    } else if (strcmp(argv[1], "checkpoint") == 0) {
        rc = bench_checkpoint(n_rest, rest, &common);
    } else if (strcmp(argv[1], "comm") == 0) {
        rc = bench_comm(n_rest, rest, &common);
    } else if (strcmp(argv[1], "halo") == 0) {
        rc = bench_halo(n_rest, rest, &common);
    } else if (strcmp(argv[1], "attention") == 0) {
        rc = bench_attention(n_rest, rest, &common);
    } else if (strcmp(argv[1], "layer") == 0) {
        rc = bench_layer(n_rest, rest, &common);
    } else if (strcmp(argv[1], "train") == 0) {
        rc = bench_train(n_rest, rest, &common);
    } else {
        fprintf(stderr, "kt-bench: unknown benchmark '%s'\n\n", argv[1]);
        usage(stderr);
        rc = 2;
    }
    free(rest);
    return rc;
}

int main(int argc, char **argv)
{
    int rc = bench_main(argc, argv);
    int out = tool_finish_stdout("kt-bench");
    return rc != 0 ? rc : out;
}
