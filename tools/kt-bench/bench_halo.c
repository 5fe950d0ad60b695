/* kt-bench halo: the context-parallel halo exchange forward, libkt against gloo.
 *
 * Each rank runs a forward-only program x[T, H] -> halo(dim 0, left L, right 0) -> y through a
 * session with the UCX communicator: the halo op's kernel exactly as a model step runs it
 * (pack, exchange, unpack, copy of the shard), in p2p and all-gather modes. The causal halo of
 * the end-to-end model's temporal conv is K-1 = 3 frames; a 64-frame halo shows larger
 * messages. The peer is comm_gloo_peer.py doing Sana's cp_halo_exchange forward (p2p:
 * batch_isend_irecv; allgather: all_gather; then the cat) on the same shapes, in the same run
 * (after libkt, not at the same time). Time per forward: the median over batches of the mean
 * of a batch, every batch started by a barrier, on rank 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"

#define MAX_CFG 64

typedef struct halo_cfg {
    int mode; /* kt_halo_mode */
    int64_t hidden, frames, shard;
    int ranks;
    double kt, gloo; /* us; < 0: none */
} halo_cfg;

static const char *mode_name(int m) { return m == KT_HALO_P2P ? "p2p" : "allgather"; }

static int64_t shard_for(int64_t frames) { return frames < 16 ? 16 : frames; }

/* ---- a rank ------------------------------------------------------------------------------- */

static kt_status time_one(kt_comm *c, int mode, int64_t hidden, int64_t frames, double *us)
{
    kt_graph *g = NULL;
    kt_program *p = NULL;
    kt_session *s = NULL;
    kt_value x, y;
    int64_t shape[2] = {shard_for(frames), hidden};
    kt_op_attrs ha = kt_op_defaults(KT_OP_HALO);
    ha.dim = 0;
    ha.halo_left = frames;
    ha.halo_right = 0;
    ha.halo_mode = (kt_halo_mode)mode;
    kt_compile_options co = {.training = 0};
    kt_session_options so = {.threads = 1, .comm = c};
    kt_status st = kt_graph_create(&g);
    if (st == KT_OK)
        st = kt_graph_input(g, "x", KT_F32, 2, shape, &x);
    if (st == KT_OK)
        st = kt_graph_op(g, "halo", KT_OP_HALO, &ha, &x, 1, &y);
    if (st == KT_OK)
        st = kt_graph_output(g, y, "y");
    if (st == KT_OK)
        st = kt_compile(g, &co, &p);
    if (st == KT_OK)
        st = kt_session_create(p, &so, &s);
    kt_tensor xt;
    if (st == KT_OK)
        st = kt_session_tensor(s, KT_ROLE_INPUT, "x", &xt);
    if (st == KT_OK)
        for (int64_t i = 0; i < shape[0] * hidden; i++)
            ((float *)xt.data)[i] = (float)(i % 97) * 0.01f;
    /* batches sized so that one lasts about a millisecond or more */
    size_t bytes = (size_t)(frames * hidden) * 4;
    int batch = bytes <= (64u << 10) ? 200 : 50, batches = 9, warm = 50;
    double means[16];
    for (int i = 0; i < warm && st == KT_OK; i++)
        st = kt_session_forward(s);
    for (int b = 0; b < batches && st == KT_OK; b++) {
        st = kt_comm_barrier(c);
        double t0 = bench_now_s();
        for (int i = 0; i < batch && st == KT_OK; i++)
            st = kt_session_forward(s);
        means[b] = (bench_now_s() - t0) / batch;
    }
    if (st == KT_OK)
        *us = bench_median(means, batches) * 1e6;
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return st;
}

/* args: MODES HIDDEN FRAMES (comma-separated lists) */
int bench_halo_rank(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    size_t hidden[16], frames[16];
    int nh = bench_parse_sizes(argv[1], hidden, 16), nf = bench_parse_sizes(argv[2], frames, 16);
    if (nh <= 0 || nf <= 0)
        return 2;
    kt_comm *c = bench_rank_comm("halo");
    if (c == NULL)
        return 1;
    FILE *out = kt_comm_rank(c) == 0 ? bench_result_stream() : NULL;
    kt_status st = KT_OK;
    for (int m = 0; m < 2 && st == KT_OK; m++) {
        if (strstr(argv[0], mode_name(m)) == NULL)
            continue;
        for (int f = 0; f < nf && st == KT_OK; f++)
            for (int h = 0; h < nh && st == KT_OK; h++) {
                double us = 0;
                st = time_one(c, m, (int64_t)hidden[h], (int64_t)frames[f], &us);
                if (st == KT_OK && out != NULL)
                    fprintf(out, "halo %d %zu %zu %.4f\n", m, hidden[h], frames[f], us);
            }
    }
    if (st != KT_OK)
        fprintf(stderr, "kt-bench halo: rank %d: %s\n", kt_comm_rank(c), kt_last_error());
    if (out != NULL)
        fclose(out);
    kt_comm_destroy(c);
    return st == KT_OK ? 0 : 1;
}

/* ---- the parent ---------------------------------------------------------------------------- */

typedef struct halo_run {
    halo_cfg cfg[MAX_CFG];
    int n, ranks;
} halo_run;

static void on_line(void *ctx, const char *line)
{
    halo_run *run = ctx;
    int mode;
    long long h, f;
    double us;
    if (run->n < MAX_CFG && sscanf(line, "halo %d %lld %lld %lf", &mode, &h, &f, &us) == 4)
        run->cfg[run->n++] = (halo_cfg){.mode = mode, .hidden = h, .frames = f,
                                        .shard = shard_for(f), .ranks = run->ranks, .kt = us,
                                        .gloo = -1};
}

int bench_halo(int argc, char **argv, const bench_args *common)
{
    const char *transport = NULL, *hidden = "256,512,1024,2048", *frames = "3,64";
    const char *modes = "p2p,allgather", *ranks_list = "2";
    int peer = 1;
    static const char *const with_value[] = {"--transport", "--ranks", "--hidden", "--frames",
                                              "--modes"};
    for (int i = 0; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-bench halo [--transport shm|tcp] [--ranks 2[,4]] [--hidden 256,...]\n"
                   "                     [--frames 3,64] [--modes p2p,allgather] [--no-peer]\n"
                   "                     [--json]\n"
                   "Times the halo op's forward (causal: `frames` frames of the previous rank\n"
                   "in front of a shard of max(16, frames) frames of `hidden` f32) through a\n"
                   "session on 2 (or 4) local ranks, in p2p and all-gather modes, against\n"
                   "torch.distributed gloo doing Sana's exchange (batch_isend_irecv /\n"
                   "all_gather) on the same shapes. Target: faster than gloo.\n");
            return 0;
        } else if (v == NULL && bench_is_one_of(argv[i], with_value, 5)) {
            fprintf(stderr, "kt-bench halo: %s needs a value (see --help)\n", argv[i]);
            return 2;
        } else if (strcmp(argv[i], "--transport") == 0) {
            transport = argv[++i];
            if (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) {
                fprintf(stderr, "kt-bench halo: --transport is shm or tcp\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--hidden") == 0) {
            hidden = argv[++i];
        } else if (strcmp(argv[i], "--frames") == 0) {
            frames = argv[++i];
        } else if (strcmp(argv[i], "--modes") == 0) {
            modes = argv[++i];
        } else if (strcmp(argv[i], "--ranks") == 0) {
            ranks_list = argv[++i];
        } else if (strcmp(argv[i], "--no-peer") == 0) {
            peer = 0;
        } else {
            fprintf(stderr, "kt-bench halo: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    size_t tmp[16], ranks[4];
    int nr = bench_parse_sizes(ranks_list, ranks, 4);
    if (bench_parse_sizes(hidden, tmp, 16) <= 0 || bench_parse_sizes(frames, tmp, 16) <= 0 ||
        nr <= 0 || (strstr(modes, "p2p") == NULL && strstr(modes, "allgather") == NULL)) {
        fprintf(stderr, "kt-bench halo: bad --hidden, --frames, --ranks or --modes\n");
        return 2;
    }
    for (int i = 0; i < nr; i++)
        if (ranks[i] < 2 || ranks[i] > 16) {
            fprintf(stderr, "kt-bench halo: --ranks between 2 and 16\n");
            return 2;
        }
    if (!bench_have_ucx())
        return bench_no_ucx("halo", common->json);
    if (!common->json)
        printf("halo: causal halo forward, shard max(16, frames) x hidden f32, transport %s; "
               "ratio > 1: libkt faster\n", transport ? transport : "default");
    int rc = 0;
    for (int ri = 0; ri < nr; ri++) {
        halo_run run = {.n = 0, .ranks = (int)ranks[ri]};
        char *args[] = {(char *)"halo", (char *)modes, (char *)hidden, (char *)frames};
        if (bench_spawn_ranks(run.ranks, transport, args, 4, on_line, &run) != 0 || run.n == 0) {
            fprintf(stderr, "kt-bench halo: the libkt ranks failed\n");
            rc = 1;
            continue;
        }
        char gloo_note[300] = "";
        if (!peer) {
            snprintf(gloo_note, sizeof gloo_note, "gloo peer skipped (--no-peer)");
        } else {
            /* one peer run per frame count (the shard follows it) */
            char *out = malloc(1 << 16);
            for (int i = 0; i < run.n && out != NULL; i++) {
                int seen = 0;
                for (int j = 0; j < i; j++)
                    seen |= run.cfg[j].frames == run.cfg[i].frames;
                if (seen)
                    continue;
                char cmd[2048];
                snprintf(cmd, sizeof cmd,
                         "/usr/bin/python3 %s halo --ranks %d --hidden '%s' --left %lld "
                         "--shard %lld --modes '%s' 2>&1",
                         bench_comm_peer_script(), run.ranks, hidden,
                         (long long)run.cfg[i].frames, (long long)run.cfg[i].shard, modes);
                if (!bench_run_peer(cmd, out, 1 << 16, gloo_note, sizeof gloo_note))
                    break;
                for (int j = i; j < run.n; j++) {
                    halo_cfg *cf = &run.cfg[j];
                    char m1[64], m2[96];
                    if (cf->frames != run.cfg[i].frames)
                        continue;
                    snprintf(m1, sizeof m1, "\"mode\": \"%s\"", mode_name(cf->mode));
                    snprintf(m2, sizeof m2, "\"hidden\": %lld, \"frames\": %lld,",
                             (long long)cf->hidden, (long long)cf->frames);
                    cf->gloo = bench_peer_value(out, m1, m2, "\"latency_us\": ");
                }
                snprintf(gloo_note, sizeof gloo_note, "gloo peer gave no figure for this shape");
            }
            free(out);
        }
        for (int i = 0; i < run.n; i++) {
            const halo_cfg *cf = &run.cfg[i];
            size_t bytes = (size_t)(cf->frames * cf->hidden) * 4;
            int hg = cf->gloo > 0;
            double rg = hg ? cf->gloo / cf->kt : 0;
            if (common->json) {
                printf("{\"bench\":\"halo\",\"config\":{\"op\":\"halo\",\"bytes\":%zu,"
                       "\"ranks\":%d,\"transport\":\"%s\",\"mode\":\"%s\",\"hidden\":%lld,"
                       "\"frames\":%lld,\"shard_frames\":%lld,\"dtype\":\"f32\"},"
                       "\"latency_us\":%.3f",
                       bytes, cf->ranks, transport ? transport : "default", mode_name(cf->mode),
                       (long long)cf->hidden, (long long)cf->frames, (long long)cf->shard, cf->kt);
                if (hg)
                    printf(",\"gloo_latency_us\":%.3f", cf->gloo);
                bench_print_ratio("ratio_vs_gloo", rg, hg);
                printf(",\"ratio_vs_ucx\":null");
                if (hg)
                    printf(",\"target_met\":%s", rg > 1 ? "true" : "false");
                printf(",\"note\":\"");
                if (!hg) {
                    bench_print_json_text(gloo_note);
                    printf("; ");
                }
                printf("no raw UCX figure for this pattern\"}\n");
            } else {
                char g[64] = "n/a", r[64] = "-";
                if (hg) {
                    snprintf(g, sizeof g, "%.1f us", cf->gloo);
                    snprintf(r, sizeof r, "%.1fx%s", rg, rg > 1 ? "" : " (target NOT met)");
                }
                printf("  %d ranks %-9s hidden %5lld  halo %3lld frames (%7zu B)  libkt %9.2f us"
                       "  gloo %10s  ratio %s\n",
                       cf->ranks, mode_name(cf->mode), (long long)cf->hidden,
                       (long long)cf->frames, bytes, cf->kt, g, r);
            }
        }
        if (!common->json && run.n > 0 && run.cfg[0].gloo < 0)
            printf("  gloo: %s\n", gloo_note);
    }
    return rc;
}
