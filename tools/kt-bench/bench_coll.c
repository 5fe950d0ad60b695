/* kt-bench comm --collectives: all_reduce, reduce_scatter and all_gather on W local ranks,
 * against ucx_perftest's point-to-point bandwidth (the same UCX transports, measured in the
 * same run) and torch.distributed gloo's same collective (comm_gloo_peer.py coll).
 *
 * bytes is the whole buffer: all_reduce's vector, reduce_scatter's input (W blocks),
 * all_gather's output (W blocks), f32. Time: rank 0's median over repeats of one call,
 * each started after a barrier. Bus bandwidth as NCCL defines it: bytes / time, times
 * 2 (W - 1) / W for all_reduce and (W - 1) / W for reduce_scatter and all_gather. Latency
 * (the time of one call) is printed for sizes up to 64 KiB. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"

#define MAX_SIZES 32
static const char *const op_names[] = {"all_reduce", "reduce_scatter", "all_gather"};
#define N_OPS 3

static double bus_factor(int op, int w)
{
    return op == 0 ? 2.0 * (w - 1) / w : (double)(w - 1) / w;
}

static kt_status run_op(kt_comm *c, int op, float *a, float *b, size_t bytes)
{
    size_t w = (size_t)kt_comm_size(c), n = bytes / sizeof(float);
    if (op == 0)
        return kt_comm_all_reduce(c, a, n, KT_F32, KT_REDUCE_SUM);
    if (op == 1)
        return kt_comm_reduce_scatter(c, a, b, n / w, KT_F32, KT_REDUCE_SUM);
    return kt_comm_all_gather(c, a, n / w * sizeof(float), b);
}

/* __rank coll OPS SIZES REPEATS: prints "coll OP BYTES SECONDS" on rank 0 */
int bench_coll_rank(int argc, char **argv)
{
    size_t sizes[MAX_SIZES];
    int n = argc >= 3 ? bench_parse_sizes(argv[1], sizes, MAX_SIZES) : -1, repeats;
    if (n <= 0 || (repeats = atoi(argv[2])) <= 0)
        return 2;
    kt_comm *c = bench_rank_comm("comm --collectives");
    if (c == NULL)
        return 1;
    FILE *out = kt_comm_rank(c) == 0 ? bench_result_stream() : NULL;
    size_t max = 64;
    for (int i = 0; i < n; i++)
        max = sizes[i] > max ? sizes[i] : max;
    float *a = calloc(max / sizeof(float) + 16, sizeof(float));
    float *b = calloc(max / sizeof(float) + 16, sizeof(float));
    double *t = calloc((size_t)repeats, sizeof *t);
    kt_status st = a && b && t ? KT_OK : KT_ENOMEM;
    for (int op = 0; op < N_OPS && st == KT_OK; op++) {
        if (strstr(argv[0], op_names[op]) == NULL)
            continue;
        for (int i = 0; i < n && st == KT_OK; i++) {
            size_t bytes = sizes[i] / (sizeof(float) * (size_t)kt_comm_size(c)) *
                           sizeof(float) * (size_t)kt_comm_size(c);
            if (bytes == 0)
                bytes = sizeof(float) * (size_t)kt_comm_size(c);
            int reps = bytes <= (64u << 10) ? repeats * 20 : bytes >= (64u << 20) ? repeats / 2 + 2
                                                                                   : repeats;
            double *tt = reps > repeats ? realloc(t, (size_t)reps * sizeof *t) : t;
            if (tt == NULL) {
                st = KT_ENOMEM;
                break;
            }
            t = tt;
            for (int k = 0; k < 2 && st == KT_OK; k++) /* warm-up */
                st = run_op(c, op, a, b, bytes);
            for (int k = 0; k < reps && st == KT_OK; k++) {
                st = kt_comm_barrier(c);
                double t0 = bench_now_s();
                if (st == KT_OK)
                    st = run_op(c, op, a, b, bytes);
                t[k] = bench_now_s() - t0;
            }
            double med = st == KT_OK ? bench_median(t, reps) : 0;
            if (st == KT_OK && out != NULL)
                fprintf(out, "coll %s %zu %.9f\n", op_names[op], bytes, med);
        }
    }
    if (st != KT_OK)
        fprintf(stderr, "kt-bench comm --collectives: rank %d: %s\n", kt_comm_rank(c),
                kt_last_error());
    if (out != NULL)
        fclose(out);
    free(a), free(b), free(t);
    kt_comm_destroy(c);
    return st == KT_OK ? 0 : 1;
}

typedef struct coll_result {
    int op;
    size_t bytes;
    double secs, ucx_mbs, gloo_secs; /* < 0: none */
} coll_result;

typedef struct coll_collected {
    coll_result r[N_OPS * MAX_SIZES];
    int n;
} coll_collected;

static void on_coll_line(void *ctx, const char *line)
{
    coll_collected *c = ctx;
    char op[32];
    size_t bytes;
    double s;
    if (c->n < N_OPS * MAX_SIZES && sscanf(line, "coll %31s %zu %lf", op, &bytes, &s) == 3)
        for (int k = 0; k < N_OPS; k++)
            if (strcmp(op, op_names[k]) == 0)
                c->r[c->n++] = (coll_result){k, bytes, s, -1, -1};
}

static void print_coll(const coll_result *r, int w, const char *tr, int json, const char *note)
{
    double bus = (double)r->bytes / r->secs * bus_factor(r->op, w) / 1e9;
    double ucx = r->ucx_mbs > 0 ? r->ucx_mbs / 1e3 : -1;
    double gbus = r->gloo_secs > 0 ? (double)r->bytes / r->gloo_secs * bus_factor(r->op, w) / 1e9
                                   : -1;
    if (json) {
        printf("{\"bench\":\"comm\",\"config\":{\"op\":\"%s\",\"bytes\":%zu,\"ranks\":%d,"
               "\"transport\":\"%s\",\"dtype\":\"f32\"},\"latency_us\":%.3f,"
               "\"bus_bandwidth_gbs\":%.4f",
               op_names[r->op], r->bytes, w, tr, r->secs * 1e6, bus);
        if (ucx > 0)
            printf(",\"ucx_p2p_bandwidth_gbs\":%.4f", ucx);
        if (gbus > 0)
            printf(",\"gloo_bus_bandwidth_gbs\":%.4f", gbus);
        bench_print_ratio("fraction_of_ucx_bandwidth", ucx > 0 ? bus / ucx : 0, ucx > 0);
        bench_print_ratio("ratio_vs_gloo", gbus > 0 ? r->gloo_secs / r->secs : 0, gbus > 0);
        if (ucx <= 0 || gbus <= 0) {
            printf(",\"note\":\"");
            bench_print_json_text(note);
            printf("\"");
        }
        printf("}\n");
        return;
    }
    char u[48] = "-", g[48] = "-";
    if (ucx > 0)
        snprintf(u, sizeof u, "%.2f of ucx %.2f", bus / ucx, ucx);
    if (gbus > 0)
        snprintf(g, sizeof g, "%.2fx gloo", r->gloo_secs / r->secs);
    printf("  %-14s %2d ranks %10zu B  %10.1f us  bus %7.3f GB/s  (%s GB/s)  %s\n",
           op_names[r->op], w, r->bytes, r->secs * 1e6, bus, u, g);
}

int bench_coll(int argc, char **argv, const bench_args *common)
{
    const char *transport = "shm", *size_list = NULL, *ops = "all_reduce,reduce_scatter,all_gather";
    const char *rank_list = "2,4";
    int peer = 1, quick = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--transport") == 0 && i + 1 < argc)
            transport = argv[++i];
        else if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc)
            size_list = argv[++i];
        else if (strcmp(argv[i], "--ops") == 0 && i + 1 < argc)
            ops = argv[++i];
        else if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc)
            rank_list = argv[++i];
        else if (strcmp(argv[i], "--no-peer") == 0)
            peer = 0;
        else if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[i], "--collectives") != 0) {
            fprintf(stderr, "kt-bench comm --collectives: unknown option %s (see --help)\n",
                    argv[i]);
            return 2;
        }
    }
    if (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) {
        fprintf(stderr, "kt-bench comm: --transport is shm or tcp\n");
        return 2;
    }
    size_t sizes[MAX_SIZES], ranks[8];
    int n = bench_parse_sizes(size_list ? size_list
                              : quick   ? "4k,1M"
                                        : "8,512,4k,64k,1M,16M,64M,256M",
                              sizes, MAX_SIZES);
    int nr = bench_parse_sizes(quick && strcmp(rank_list, "2,4") == 0 ? "2" : rank_list, ranks, 8);
    if (n <= 0 || nr <= 0) {
        fprintf(stderr, "kt-bench comm: --sizes and --ranks want comma-separated counts\n");
        return 2;
    }
    if (!bench_have_ucx())
        return bench_no_ucx("comm", common->json);
    char list[1024] = "", reps[16];
    for (int i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%zu", i ? "," : "", sizes[i]);
    snprintf(reps, sizeof reps, "%d", quick ? 3 : common->repeats_given ? common->repeats : 9);
    /* ucx_perftest's point-to-point bandwidth, once per size from 1 MiB (the reference of
     * the bandwidth-bound sizes) */
    double ucx_bw[MAX_SIZES];
    char note[400] = "ucx_perftest gave no figure";
    char small_note[64];
    snprintf(small_note, sizeof small_note, "%s", quick ? "--quick: no ucx_perftest"
                                                        : "ucx_perftest is run from 1 MiB");
    for (int i = 0; i < n; i++)
        ucx_bw[i] = sizes[i] >= (1u << 20) && !quick
                        ? bench_ucx_perftest_bw(sizes[i], transport, note, sizeof note)
                        : -1;
    if (!common->json)
        printf("comm --collectives: transport %s, f32; bus bandwidth as NCCL's (all_reduce x "
               "2(W-1)/W, RS/AG x (W-1)/W) against ucx_perftest tag_bw point to point and gloo\n",
               transport);
    for (int k = 0; k < nr; k++) {
        int w = (int)ranks[k];
        coll_collected col = {.n = 0};
        char *rank_args[] = {(char *)"coll", (char *)ops, list, reps};
        if (bench_spawn_ranks(w, transport, rank_args, 4, on_coll_line, &col) != 0 || col.n == 0) {
            fprintf(stderr, "kt-bench comm --collectives: the libkt ranks failed\n");
            return 1;
        }
        char gnote[300] = "";
        if (peer) {
            char cmd[2048];
            snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s coll --ranks %d --ops %s --sizes %s "
                     "--repeats %s 2>&1", bench_comm_peer_script(), w, ops, list, reps);
            char *out = malloc(1 << 16);
            if (out != NULL && bench_run_peer(cmd, out, 1 << 16, gnote, sizeof gnote)) {
                for (int i = 0; i < col.n; i++) {
                    char m1[48], m2[48];
                    snprintf(m1, sizeof m1, "\"op\": \"%s\"", op_names[col.r[i].op]);
                    snprintf(m2, sizeof m2, "\"bytes\": %zu,", col.r[i].bytes);
                    col.r[i].gloo_secs = bench_peer_value(out, m1, m2, "\"seconds\": ");
                }
                snprintf(gnote, sizeof gnote, "gloo gave no figure (torch 1.13's gloo has no "
                         "reduce_scatter)");
            }
            free(out);
        } else {
            snprintf(gnote, sizeof gnote, "gloo peer skipped (--no-peer)");
        }
        for (int i = 0; i < col.n; i++) {
            for (int j = 0; j < n; j++)
                if (sizes[j] / (4u * (unsigned)w) * 4u * (unsigned)w == col.r[i].bytes ||
                    sizes[j] == col.r[i].bytes)
                    col.r[i].ucx_mbs = ucx_bw[j];
            char both[720];
            const char *un = col.r[i].bytes < (1u << 20) || quick ? small_note : note;
            snprintf(both, sizeof both, "%s%s%s", col.r[i].ucx_mbs > 0 ? "" : un,
                     col.r[i].ucx_mbs > 0 || col.r[i].gloo_secs > 0 ? "" : "; ",
                     col.r[i].gloo_secs > 0 ? "" : gnote);
            print_coll(&col.r[i], w, transport, common->json, both);
        }
    }
    return 0;
}
