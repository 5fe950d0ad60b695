/* kt-bench comm: libkt's UCX communicator against raw UCX and torch.distributed (gloo).
 *
 * kt-bench starts its ranks itself: it forks and execs its own binary with the hidden
 * subcommand "__rank" and the rank environment kt-launch would set (KT_RANK, KT_WORLD_SIZE,
 * KT_MASTER_ADDR=127.0.0.1, a free KT_MASTER_PORT, KT_COMM_TRANSPORT). Rank 0 writes its
 * figures as text lines into a pipe (fd in KT_BENCH_RESULT_FD); the parent collects them,
 * then runs the peers one after the other (never at the same time as libkt: the machine
 * may have only two cores):
 *   - raw UCX: ucx_perftest (server in the background, client on 127.0.0.1) with tag_lat /
 *     tag_bw, error handling on (-e) and UCX_TLS as libkt sets it for the transport, so both
 *     sides use the same UCX transports (peer error mode with shm error handling: posix and
 *     sysv, no cma);
 *   - gloo: comm_gloo_peer.py under /usr/bin/python3 (send/recv over TCP loopback).
 *
 * libkt measures one-way latency as half a kt_comm_send/kt_comm_recv round trip (median
 * over single round trips after warm-up; ucx_perftest's 50th percentile is the same
 * statistic) and unidirectional bandwidth as windows of back-to-back kt_comm_send calls
 * closed by a one-byte answer (median over windows). */
#define _GNU_SOURCE /* sched_setaffinity: ranks are pinned to distinct CPUs */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kt/kt.h>

#include "tools/kt-bench/bench.h"
#include "tools/common/free_port.h"
#include "tools/common/rank_env.h"

#ifndef KT_BENCH_COMM_PEER_SCRIPT
#define KT_BENCH_COMM_PEER_SCRIPT "tools/kt-bench/comm_gloo_peer.py"
#endif

#define MAX_SIZES 32
#define LAT_MAX (64 << 10)  /* latency up to 64 KiB */
#define BW_MIN (64 << 10)   /* bandwidth from 64 KiB */

/* ---- helpers shared with bench_halo.c ------------------------------------------------------ */

const char *bench_comm_peer_script(void)
{
    const char *s = getenv("KT_BENCH_COMM_PEER");
    static char found[4096];
    return s != NULL ? s
                     : bench_find_script(KT_BENCH_COMM_PEER_SCRIPT, "comm_gloo_peer.py", found,
                                         sizeof found);
}

int bench_have_ucx(void)
{
#ifdef KT_BENCH_HAVE_UCX
    return 1;
#else
    return 0;
#endif
}

/* The idx-th CPU this process may run on (modulo their count); -1 if unknown. Ranks and
 * peers are pinned one per CPU: on a small shared machine, two ranks that the scheduler
 * happens to put on one core turn every round trip into a context switch, which makes the
 * figures bimodal from run to run. */
int bench_cpu(int idx)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return -1;
    int n = CPU_COUNT(&set);
    if (n <= 0)
        return -1;
    idx %= n;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set) && idx-- == 0)
            return c;
    return -1;
}

static void pin_to(int cpu)
{
    if (cpu < 0 || getenv("KT_BENCH_NO_PIN") != NULL)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        /* not pinned: the figures are only noisier */
    }
}

int bench_spawn_ranks(int n, const char *transport, char *const *args, int n_args,
                      bench_line_fn on_line, void *ctx)
{
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) {
        fprintf(stderr, "kt-bench: cannot find its own binary (/proc/self/exe): %s\n",
                strerror(errno));
        return 1;
    }
    self[len] = '\0';
    int port = kt_tool_free_port(), fds[2];
    if (port < 0 || pipe(fds) != 0) {
        fprintf(stderr, "kt-bench: cannot set up the ranks: %s\n", strerror(errno));
        return 1;
    }
    char **argv = calloc((size_t)n_args + 3, sizeof *argv);
    pid_t *pids = calloc((size_t)n, sizeof *pids);
    if (argv == NULL || pids == NULL) {
        free(argv), free(pids);
        close(fds[0]), close(fds[1]);
        return 1;
    }
    argv[0] = self;
    argv[1] = (char *)"__rank";
    for (int i = 0; i < n_args; i++)
        argv[2 + i] = args[i];
    fflush(NULL);
    int started = 0;
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        if (pid < 0)
            break;
        if (pid == 0) {
            char v[32];
            close(fds[0]);
            kt_tool_set_rank_env(r, n, port, NULL, transport);
            setenv("KT_COMM_TIMEOUT_MS", "30000", 0);
            pin_to(bench_cpu(r));
            if (r == 0) {
                snprintf(v, sizeof v, "%d", fds[1]);
                setenv("KT_BENCH_RESULT_FD", v, 1);
            } else {
                close(fds[1]);
            }
            execv(self, argv);
            _exit(127);
        }
        pids[started++] = pid;
    }
    close(fds[1]);
    FILE *in = fdopen(fds[0], "r");
    char line[1024];
    while (in != NULL && fgets(line, sizeof line, in) != NULL)
        on_line(ctx, line);
    if (in != NULL)
        fclose(in);
    else
        close(fds[0]);
    int rc = started == n ? 0 : 1;
    for (int i = 0; i < started; i++) {
        int status = 0;
        if (waitpid(pids[i], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "kt-bench: rank %d failed (status %d)\n", i, status);
            rc = 1;
        }
    }
    free(argv), free(pids);
    return rc;
}

FILE *bench_result_stream(void)
{
    const char *fd = getenv("KT_BENCH_RESULT_FD");
    if (fd == NULL)
        return NULL;
    FILE *f = fdopen(atoi(fd), "w");
    if (f != NULL)
        setvbuf(f, NULL, _IOLBF, 0);
    return f;
}

kt_comm *bench_rank_comm(const char *who)
{
    kt_comm_options o = {0};
    kt_comm *c = NULL;
    if (kt_comm_create_ucx(&o, &c) != KT_OK) {
        fprintf(stderr, "kt-bench %s: rank %s: %s\n", who,
                getenv("KT_RANK") ? getenv("KT_RANK") : "?", kt_last_error());
        return NULL;
    }
    return c;
}

int bench_parse_sizes(const char *s, size_t *out, int max)
{
    int n = 0;
    while (*s != '\0' && n < max) {
        char *end;
        double v = strtod(s, &end);
        if (end == s || v < 1)
            return -1;
        if (*end == 'k' || *end == 'K')
            v *= 1024, end++;
        else if (*end == 'm' || *end == 'M')
            v *= 1024 * 1024, end++;
        out[n++] = (size_t)v;
        if (*end == ',')
            end++;
        else if (*end != '\0')
            return -1;
        s = end;
    }
    return n;
}

void bench_print_ratio(const char *key, double v, int have)
{
    if (have)
        printf(",\"%s\":%.3f", key, v);
    else
        printf(",\"%s\":null", key);
}

/* JSON string contents: quotes and backslashes escaped, control characters dropped. */
void bench_print_json_text(const char *s)
{
    for (; *s != '\0'; s++) {
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else if ((unsigned char)*s >= 0x20)
            putchar(*s);
    }
}

/* Runs cmd and collects its stdout lines beginning with '{' into buf (one per line). */
int bench_run_peer(const char *cmd, char *buf, size_t size, char *note, size_t note_size)
{
    FILE *f = popen(cmd, "r");
    if (f == NULL) {
        snprintf(note, note_size, "could not start %s", cmd);
        return 0;
    }
    char line[2048], last[2048] = "";
    size_t used = 0;
    buf[0] = '\0';
    while (fgets(line, sizeof line, f) != NULL) {
        if (line[0] == '{' && used + strlen(line) + 1 < size) {
            memcpy(buf + used, line, strlen(line) + 1);
            used += strlen(line);
        }
        if (line[0] != '\n')
            snprintf(last, sizeof last, "%s", line);
    }
    int rc = pclose(f);
    if (rc != 0 || used == 0) {
        last[strcspn(last, "\n")] = '\0';
        snprintf(note, note_size, "gloo peer did not run (exit %d): %.200s",
                 WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, last);
        return 0;
    }
    return 1;
}

/* The value of "key": in the first line of buf that contains all of match (NULL: any). */
double bench_peer_value(const char *buf, const char *match1, const char *match2,
                        const char *key)
{
    const char *line = buf;
    while (line != NULL && *line != '\0') {
        const char *eol = strchr(line, '\n');
        size_t n = eol ? (size_t)(eol - line) : strlen(line);
        char tmp[2048];
        snprintf(tmp, sizeof tmp, "%.*s", (int)(n < sizeof tmp ? n : sizeof tmp - 1), line);
        if ((match1 == NULL || strstr(tmp, match1)) && (match2 == NULL || strstr(tmp, match2))) {
            const char *k = strstr(tmp, key);
            if (k != NULL)
                return atof(k + strlen(key));
        }
        line = eol ? eol + 1 : NULL;
    }
    return -1;
}

/* ---- the ranks -------------------------------------------------------------------------- */

#define TAG_DATA 7
#define TAG_ACK 8

static int comm_rank(int argc, char **argv)
{
    size_t sizes[MAX_SIZES];
    int n = argc > 0 ? bench_parse_sizes(argv[0], sizes, MAX_SIZES) : -1;
    if (n <= 0)
        return 2;
    kt_comm *c = bench_rank_comm("comm");
    if (c == NULL)
        return 1;
    int rank = kt_comm_rank(c), peer = 1 - rank;
    FILE *out = rank == 0 ? bench_result_stream() : NULL;
    size_t max = 1;
    for (int i = 0; i < n; i++)
        max = sizes[i] > max ? sizes[i] : max;
    char *buf = calloc(max, 1), ack = 0;
    int iters_max = 20000;
    double *t = calloc((size_t)iters_max, sizeof *t);
    kt_status st = buf && t ? KT_OK : KT_ENOMEM;
    /* latency: ping-pong, every round trip timed alone */
    for (int i = 0; i < n && st == KT_OK; i++) {
        size_t s = sizes[i];
        if (s > LAT_MAX)
            continue;
        int iters = s <= 4096 ? 20000 : s <= 16384 ? 5000 : 2000, warm = iters / 10;
        st = kt_comm_barrier(c);
        for (int k = 0; k < warm + iters && st == KT_OK; k++) {
            double t0 = bench_now_s();
            if (rank == 0) {
                st = kt_comm_send(c, peer, TAG_DATA, buf, s);
                if (st == KT_OK)
                    st = kt_comm_recv(c, peer, TAG_DATA, buf, s);
            } else {
                st = kt_comm_recv(c, peer, TAG_DATA, buf, s);
                if (st == KT_OK)
                    st = kt_comm_send(c, peer, TAG_DATA, buf, s);
            }
            if (k >= warm)
                t[k - warm] = bench_now_s() - t0;
        }
        if (st == KT_OK && out != NULL)
            fprintf(out, "lat %zu %.6f\n", s, bench_median(t, iters) / 2 * 1e6);
    }
    /* bandwidth: windows of back-to-back sends, each closed by a one-byte answer */
    for (int i = 0; i < n && st == KT_OK; i++) {
        size_t s = sizes[i];
        if (s < BW_MIN)
            continue;
        size_t window = ((size_t)64 << 20) / s;
        window = window < 8 ? 8 : window > 256 ? 256 : window;
        int rounds = 9;
        st = kt_comm_barrier(c);
        for (int r = 0; r < 2 + rounds && st == KT_OK; r++) {
            double t0 = bench_now_s();
            for (size_t w = 0; w < window && st == KT_OK; w++)
                st = rank == 0 ? kt_comm_send(c, peer, TAG_DATA, buf, s)
                               : kt_comm_recv(c, peer, TAG_DATA, buf, s);
            if (st == KT_OK)
                st = rank == 0 ? kt_comm_recv(c, peer, TAG_ACK, &ack, 1)
                               : kt_comm_send(c, peer, TAG_ACK, &ack, 1);
            if (r >= 2)
                t[r - 2] = (double)(s * window) / (bench_now_s() - t0) / 1e6;
        }
        if (st == KT_OK && out != NULL)
            fprintf(out, "bw %zu %.3f\n", s, bench_median(t, rounds));
    }
    if (st != KT_OK)
        fprintf(stderr, "kt-bench comm: rank %d: %s\n", rank, kt_last_error());
    if (out != NULL)
        fclose(out);
    free(buf), free(t);
    kt_comm_destroy(c);
    return st == KT_OK ? 0 : 1;
}

int bench_rank(int argc, char **argv)
{
    if (argc >= 1 && strcmp(argv[0], "comm") == 0)
        return comm_rank(argc - 1, argv + 1);
    if (argc >= 1 && strcmp(argv[0], "halo") == 0)
        return bench_halo_rank(argc - 1, argv + 1);
    if (argc >= 1 && strcmp(argv[0], "coll") == 0)
        return bench_coll_rank(argc - 1, argv + 1);
    if (argc >= 1 && strcmp(argv[0], "moe") == 0)
        return bench_moe_rank(argc - 1, argv + 1);
    fprintf(stderr, "kt-bench __rank: unknown role\n");
    return 2;
}

/* ---- the parent: collects libkt's figures, runs the peers, prints ------------------------- */

typedef struct result {
    size_t bytes;
    int bw;                  /* 0: latency (us), 1: bandwidth (MB/s) */
    double kt, ucx, gloo;    /* < 0: none */
} result;

typedef struct collected {
    result r[2 * MAX_SIZES];
    int n;
} collected;

static void on_line(void *ctx, const char *line)
{
    collected *c = ctx;
    size_t bytes;
    double v;
    int bw = strncmp(line, "bw ", 3) == 0;
    if (c->n < 2 * MAX_SIZES && sscanf(line + (bw ? 3 : 4), "%zu %lf", &bytes, &v) == 2 &&
        (bw || strncmp(line, "lat ", 4) == 0))
        c->r[c->n++] = (result){.bytes = bytes, .bw = bw, .kt = v, .ucx = -1, .gloo = -1};
}

/* ucx_perftest with the UCX settings libkt uses for the transport; the 50th percentile
 * latency (us) or the overall bandwidth (MB/s). Returns < 0 with a note when it cannot. */
static double perftest(const result *r, const char *transport, char *note, size_t note_size)
{
    if (system("command -v ucx_perftest >/dev/null 2>&1") != 0) {
        snprintf(note, note_size, "ucx_perftest not on PATH (Debian: ucx-utils)");
        return -1;
    }
    const char *env = transport != NULL && strcmp(transport, "tcp") == 0
                          ? "UCX_TLS=tcp,self UCX_KEEPALIVE_INTERVAL=1s"
                          : "UCX_TLS=sm,self UCX_POSIX_ERROR_HANDLING=y "
                            "UCX_SYSV_ERROR_HANDLING=y UCX_KEEPALIVE_INTERVAL=1s";
    int iters = r->bw ? (int)(((size_t)2 << 30) / r->bytes) : r->bytes <= 4096 ? 20000 : 5000;
    int least = r->bw && r->bytes >= ((size_t)64 << 20) ? 10 : 100; /* 256 MiB: 2.5 GiB */
    iters = iters < least ? least : iters > 20000 ? 20000 : iters;
    char pin_s[32] = "", pin_c[32] = "";
    if (getenv("KT_BENCH_NO_PIN") == NULL && bench_cpu(0) >= 0 && bench_cpu(1) != bench_cpu(0)) {
        snprintf(pin_s, sizeof pin_s, "-c %d", bench_cpu(0));
        snprintf(pin_c, sizeof pin_c, "-c %d", bench_cpu(1));
    }
    double best = -1;
    for (int attempt = 0; attempt < 3 && best < 0; attempt++) {
        int port = kt_tool_free_port();
        char server[512], client[512];
        snprintf(server, sizeof server,
                 "timeout 120 env %s ucx_perftest -p %d %s -e -f >/dev/null 2>&1", env, port,
                 pin_s);
        snprintf(client, sizeof client,
                 "sleep 0.3; timeout 110 env %s ucx_perftest 127.0.0.1 -p %d %s -e -f -t %s "
                 "-s %zu -n %d -w %d 2>&1",
                 env, port, pin_c, r->bw ? "tag_bw" : "tag_lat", r->bytes, iters, iters / 10 + 10);
        FILE *srv = popen(server, "r");
        if (srv == NULL)
            break;
        FILE *cl = popen(client, "r");
        char line[1024], last[1024] = "";
        while (cl != NULL && fgets(line, sizeof line, cl) != NULL)
            if (line[0] != '\n')
                snprintf(last, sizeof last, "%s", line);
        int crc = cl ? pclose(cl) : -1;
        if (crc != 0) {
            /* the server still waits for a client: unblock it by connecting to its port */
            int fd = socket(AF_INET, SOCK_STREAM, 0);
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            if (fd >= 0) {
                if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
                    /* nobody listening: it is gone already */
                }
                close(fd);
            }
        }
        pclose(srv);
        /* final line: iterations, p50, avg, overall latency (us), avg, overall bandwidth
         * (MiB/s), avg, overall message rate */
        double it, p50, avg, overall, bwa, bwo;
        if (crc == 0 &&
            sscanf(last, "%lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &overall, &bwa, &bwo) == 6)
            best = r->bw ? bwo * 1.048576 : p50;
        else {
            last[strcspn(last, "\n")] = '\0';
            snprintf(note, note_size, "ucx_perftest failed: %.200s", last);
        }
    }
    return best;
}

double bench_ucx_perftest_bw(size_t bytes, const char *transport, char *note, size_t note_size)
{
    result r = {.bytes = bytes, .bw = 1, .kt = -1, .ucx = -1, .gloo = -1};
    return perftest(&r, transport, note, note_size);
}

static void print_result(const result *r, const char *transport, int json, const char *ucx_note,
                         const char *gloo_note)
{
    const char *tr = transport ? transport : "default";
    /* ratios: above 1 is libkt better */
    int hu = r->ucx > 0, hg = r->gloo > 0;
    double ru = !hu ? 0 : r->bw ? r->kt / r->ucx : r->ucx / r->kt;
    double rg = !hg ? 0 : r->bw ? r->kt / r->gloo : r->gloo / r->kt;
    int in_target = r->bw ? r->bytes >= (1u << 20) : r->bytes <= LAT_MAX;
    double target = r->bw ? 0.85 : 1.0 / 1.3;
    if (json) {
        printf("{\"bench\":\"comm\",\"config\":{\"op\":\"%s\",\"bytes\":%zu,\"ranks\":2,"
               "\"transport\":\"%s\",\"mode\":\"p2p\"},\"%s\":%.4f",
               r->bw ? "bandwidth" : "latency", r->bytes, tr,
               r->bw ? "bandwidth_mbs" : "latency_us", r->kt);
        if (hu)
            printf(",\"ucx_%s\":%.4f", r->bw ? "bandwidth_mbs" : "latency_us", r->ucx);
        if (hg)
            printf(",\"gloo_%s\":%.4f", r->bw ? "bandwidth_mbs" : "latency_us", r->gloo);
        bench_print_ratio("ratio_vs_ucx", ru, hu);
        bench_print_ratio("ratio_vs_gloo", rg, hg);
        if (in_target) {
            printf(",\"target_ratio_vs_ucx\":%.3f", target);
            if (hu)
                printf(",\"target_met\":%s", ru >= target ? "true" : "false");
        }
        if (!hu || !hg) {
            printf(",\"note\":\"");
            if (!hu)
                bench_print_json_text(ucx_note);
            if (!hu && !hg)
                printf("; ");
            if (!hg)
                bench_print_json_text(gloo_note);
            printf("\"");
        }
        printf("}\n");
        return;
    }
    char u[64] = "n/a", g[64] = "n/a", ratio_u[32] = "-", ratio_g[32] = "-", tg[64] = "";
    const char *fmt = r->bw ? "%.0f MB/s" : "%.3f us";
    if (hu) {
        snprintf(u, sizeof u, fmt, r->ucx);
        snprintf(ratio_u, sizeof ratio_u, "%.2fx", ru);
    }
    if (hg) {
        snprintf(g, sizeof g, fmt, r->gloo);
        snprintf(ratio_g, sizeof ratio_g, "%.2fx", rg);
    }
    if (in_target && hu)
        snprintf(tg, sizeof tg, "  target >= %.2f: %s", target, ru >= target ? "met" : "NOT met");
    char k[64];
    snprintf(k, sizeof k, fmt, r->kt);
    printf("  %-9s %9zu B  libkt %12s  ucx %12s (%6s)  gloo %12s (%6s)%s\n",
           r->bw ? "bandwidth" : "latency", r->bytes, k, u, ratio_u, g, ratio_g, tg);
}

static void no_ucx_line(const char *bench, int json)
{
    const char *note = "this libkt build has no UCX (KT_WITH_UCX=OFF): nothing to measure";
    if (json)
        printf("{\"bench\":\"%s\",\"config\":{\"op\":\"%s\",\"ranks\":2,\"mode\":\"p2p\"},"
               "\"latency_us\":null,\"ratio_vs_ucx\":null,\"ratio_vs_gloo\":null,"
               "\"note\":\"%s\"}\n", bench, strcmp(bench, "halo") == 0 ? "halo" : "latency",
               note);
    else
        printf("%s: %s\n", bench, note);
}

int bench_no_ucx(const char *bench, int json)
{
    no_ucx_line(bench, json);
    return 0;
}

int bench_comm(int argc, char **argv, const bench_args *common)
{
    const char *transport = NULL, *size_list = NULL;
    int peer = 1;
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--collectives") == 0 &&
            !(argc > 0 && (strcmp(argv[0], "--help") == 0 || strcmp(argv[0], "-h") == 0)))
            return bench_coll(argc, argv, common);
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: kt-bench comm [--transport shm|tcp] [--sizes 8,64,...] [--no-peer]\n"
                   "                     [--json]\n"
                   "Starts 2 local ranks and measures libkt's UCX communicator: one-way latency\n"
                   "(half a send/recv round trip, median) for sizes up to 64 KiB, unidirectional\n"
                   "bandwidth (MB/s) from 64 KiB; in the same run raw UCX (ucx_perftest tag_lat /\n"
                   "tag_bw with the same UCX transports) and torch.distributed gloo\n"
                   "(comm_gloo_peer.py under /usr/bin/python3). Sizes take k/M suffixes.\n"
                   "Targets: latency within 1.3x of raw UCX up to 64 KiB; bandwidth >= 0.85x raw\n"
                   "UCX from 1 MiB.\n"
                   "\n"
                   "kt-bench comm --collectives [--transport shm|tcp] [--ranks 2,4] [--sizes ...]\n"
                   "                     [--ops all_reduce,reduce_scatter,all_gather] [--quick]\n"
                   "                     [--no-peer] [--json] [--repeats N]\n"
                   "The collectives on W local ranks (f32; bytes: the whole buffer): the time of\n"
                   "one call (median, rank 0) and NCCL's bus bandwidth (all_reduce: bytes / time x\n"
                   "2(W-1)/W; reduce_scatter, all_gather: x (W-1)/W), as a fraction of\n"
                   "ucx_perftest's point-to-point tag_bw bandwidth (same transports, from 1 MiB)\n"
                   "and against torch.distributed gloo's same collective (ratio > 1: libkt\n"
                   "faster). Targets: >= 0.8 of ucx at 16-256 MiB, faster than gloo at every size.\n"
                   "--quick: 2 ranks, 4 KiB and 1 MiB, no ucx_perftest (the smoke test).\n");
            return 0;
        } else if (strcmp(argv[i], "--transport") == 0 && i + 1 < argc) {
            transport = argv[++i];
            if (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) {
                fprintf(stderr, "kt-bench comm: --transport is shm or tcp\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc) {
            size_list = argv[++i];
        } else if (strcmp(argv[i], "--no-peer") == 0) {
            peer = 0;
        } else {
            fprintf(stderr, "kt-bench comm: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    size_t sizes[MAX_SIZES];
    int n = bench_parse_sizes(size_list ? size_list
                                        : "8,64,512,4096,16384,65536,262144,1048576,4194304,"
                                          "16777216",
                              sizes, MAX_SIZES);
    if (n <= 0) {
        fprintf(stderr, "kt-bench comm: --sizes wants a comma-separated list of byte counts\n");
        return 2;
    }
    if (!bench_have_ucx())
        return bench_no_ucx("comm", common->json);
    char list[1024] = "";
    for (int i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%zu", i ? "," : "", sizes[i]);

    collected col = {.n = 0};
    char *rank_args[] = {(char *)"comm", list};
    if (bench_spawn_ranks(2, transport, rank_args, 2, on_line, &col) != 0 || col.n == 0) {
        fprintf(stderr, "kt-bench comm: the libkt ranks failed\n");
        return 1;
    }
    /* raw UCX, size by size */
    char ucx_note[300] = "", gloo_note[300] = "";
    for (int i = 0; i < col.n; i++)
        col.r[i].ucx = perftest(&col.r[i], transport, ucx_note, sizeof ucx_note);
    /* gloo, all sizes in one run */
    if (!peer) {
        snprintf(gloo_note, sizeof gloo_note, "gloo peer skipped (--no-peer)");
    } else {
        char lat[512] = "", bw[512] = "", cmd[2048];
        for (int i = 0; i < col.n; i++) {
            char *dst = col.r[i].bw ? bw : lat;
            snprintf(dst + strlen(dst), 512 - strlen(dst), "%s%zu", *dst ? "," : "",
                     col.r[i].bytes);
        }
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s comm --lat-sizes '%s' --bw-sizes '%s' 2>&1",
                 bench_comm_peer_script(), lat, bw);
        char *out = malloc(1 << 16);
        if (out != NULL && bench_run_peer(cmd, out, 1 << 16, gloo_note, sizeof gloo_note)) {
            for (int i = 0; i < col.n; i++) {
                char m[64];
                snprintf(m, sizeof m, "\"bytes\": %zu,", col.r[i].bytes);
                col.r[i].gloo = bench_peer_value(out, col.r[i].bw ? "bandwidth" : "latency", m,
                                                 col.r[i].bw ? "\"bandwidth_mbs\": "
                                                             : "\"latency_us\": ");
            }
            snprintf(gloo_note, sizeof gloo_note, "gloo peer gave no figure for this size");
        }
        free(out);
    }
    if (!common->json)
        printf("comm: 2 ranks, transport %s; latency one-way (median of round trips / 2), "
               "bandwidth unidirectional; ratio > 1: libkt better\n",
               transport ? transport : "default");
    int met = 1, judged = 0;
    for (int i = 0; i < col.n; i++) {
        const result *r = &col.r[i];
        print_result(r, transport, common->json, ucx_note, gloo_note);
        int in_target = r->bw ? r->bytes >= (1u << 20) : r->bytes <= LAT_MAX;
        if (in_target && r->ucx > 0) {
            judged++;
            double ratio = r->bw ? r->kt / r->ucx : r->ucx / r->kt;
            met &= ratio >= (r->bw ? 0.85 : 1.0 / 1.3);
        }
    }
    if (!common->json && judged > 0)
        printf("targets (latency >= 1/1.3 of raw UCX to 64 KiB, bandwidth >= 0.85x from 1 MiB): "
               "%s\n", met ? "all met" : "NOT all met");
    return 0;
}
