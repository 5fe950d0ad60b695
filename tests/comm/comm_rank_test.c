/* One rank of the multi-rank communicator tests (run_comm_tests.sh starts it through
 * kt-launch). argv[1] names the scenario; every rank that ends the way the scenario expects
 * prints "PASS rank r ..." and exits 0, otherwise "FAIL rank r: why" and exits 1.
 *
 * Correctness scenarios compare every result with what this rank computes locally from
 * the same deterministic inputs (the single-rank result); fault scenarios check that the
 * surviving ranks fail within the deadline with a message that names the faulty peer. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm_ucx/coll_plan.h"
#include "lib/core/error.h"
#include "kt/comm.h"
#include "kt/tensor.h"

static int g_rank = -1, g_size = 0;
static const char *g_scenario = "?";
static pid_t g_victim_pid = 0; /* a stopped rank the survivors must end, pass or fail */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL rank %d %s: ", g_rank, g_scenario);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    if (g_victim_pid > 0)
        kill(g_victim_pid, SIGKILL);
    exit(1);
}

#define CHECK(expr)                                                                            \
    do {                                                                                       \
        kt_status s_ = (expr);                                                                 \
        if (s_ != KT_OK)                                                                       \
            fail("%s: %s: %s", #expr, kt_status_str(s_), kt_last_error());                     \
    } while (0)

static unsigned char pattern(size_t i, int src, int dst, size_t salt)
{
    return (unsigned char)((i * 131u + (size_t)src * 7u + (size_t)dst * 13u + salt) & 0xffu);
}

static void fill(unsigned char *b, size_t n, int src, int dst, size_t salt)
{
    for (size_t i = 0; i < n; i++)
        b[i] = pattern(i, src, dst, salt);
}

static void expect_bytes(const unsigned char *b, size_t n, int src, int dst, size_t salt,
                         const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != pattern(i, src, dst, salt))
            fail("%s: byte %zu of %zu from rank %d differs", what, i, n, src);
}

static const size_t sizes[] = {0, 1, 8, 100, 4096, 65536, 1 << 20, 16 << 20};
#define N_SIZES (sizeof sizes / sizeof sizes[0])

/* ---- correctness ---------------------------------------------------------------------------- */

static void scenario_p2p(kt_comm *c)
{
    unsigned char *buf = malloc(16 << 20);
    if (buf == NULL)
        fail("out of memory");
    for (size_t k = 0; k < N_SIZES; k++) {
        size_t n = sizes[k];
        /* rank 0 <-> every other rank, both directions, blocking send/recv */
        for (int p = 1; p < g_size; p++) {
            if (g_rank == 0) {
                fill(buf, n, 0, p, k);
                CHECK(kt_comm_send(c, p, 5, buf, n));
                memset(buf, 0xee, n);
                CHECK(kt_comm_recv(c, p, 6, buf, n));
                expect_bytes(buf, n, p, 0, k, "p2p reply");
            } else if (g_rank == p) {
                memset(buf, 0xee, n);
                CHECK(kt_comm_recv(c, 0, 5, buf, n));
                expect_bytes(buf, n, 0, p, k, "p2p");
                fill(buf, n, p, 0, k);
                CHECK(kt_comm_send(c, 0, 6, buf, n));
            }
        }
    }
    /* A receive larger than the message is an error, not silent garbage. */
    if (g_size >= 2 && g_rank <= 1) {
        unsigned char small[8] = {0};
        kt_comm_set_timeout(c, 2000);
        kt_status s = g_rank == 0 ? kt_comm_send(c, 1, 9, small, 4) : kt_comm_recv(c, 0, 9, small, 8);
        if (g_rank == 1 && (s == KT_OK || strstr(kt_last_error(), "4 bytes, 8 expected") == NULL))
            fail("a short message was not reported: %s", kt_last_error());
        printf("ok: length mismatch reported: %s\n", g_rank == 1 ? kt_last_error() : "(sender)");
    }
    free(buf);
}

static void scenario_ring(kt_comm *c)
{
    unsigned char *out = malloc(16 << 20), *in = malloc(16 << 20);
    if (out == NULL || in == NULL)
        fail("out of memory");
    int to = (g_rank + 1) % g_size, from = (g_rank + g_size - 1) % g_size;
    for (int rep = 0; rep < 3; rep++)
        for (size_t k = 0; k < N_SIZES; k++) {
            size_t n = sizes[k];
            fill(out, n, g_rank, to, k + (size_t)rep);
            memset(in, 0xee, n);
            CHECK(kt_comm_sendrecv(c, to, out, n, from, in, n, 100 + (int)k));
            expect_bytes(in, n, from, g_rank, k + (size_t)rep, "ring");
        }
    /* the halo edges: a send only and a receive only */
    if (g_size >= 2) {
        unsigned char v = 0x5a, w = 0;
        if (g_rank == 0)
            CHECK(kt_comm_sendrecv(c, 1, &v, 1, -1, NULL, 0, 1));
        if (g_rank == 1) {
            CHECK(kt_comm_sendrecv(c, -1, NULL, 0, 0, &w, 1, 1));
            if (w != 0x5a)
                fail("one-sided sendrecv");
        }
    }
    free(out);
    free(in);
}

static float contrib_f32(int r, size_t i) { return (float)((int)((i * 37 + (size_t)r * 11) % 97) - 48) * 0.37f + (float)r * 0.001f; }

/* Rank r's contribution to element i, as the reduction sees it (bf16: rounded, widened). */
static float contrib(int r, size_t i, kt_dtype dt)
{
    float v = contrib_f32(r, i);
    return dt == KT_BF16 ? kt_bf16_to_f32_1(kt_f32_to_bf16_1(v)) : v;
}

/* The reference of element i of block b, in the order the ring adds it (coll_plan.h):
 * ranks b+1, b+2, ..., b; or recursive doubling's tree. Mean and rounding once, at the end. */
static float ref_ring(int b, size_t i, kt_dtype dt, kt_reduce_op op)
{
    float acc = contrib((b + 1) % g_size, i, dt);
    for (int k = 2; k <= g_size; k++)
        acc += contrib((b + k) % g_size, i, dt);
    return op == KT_REDUCE_MEAN ? acc / (float)g_size : acc;
}

static float ref_rd(size_t i, kt_dtype dt, kt_reduce_op op)
{
    float v[64], nv[64];
    int p2 = kt__rd_pow2(g_size), rem = g_size - p2;
    for (int r = 0; r < p2; r++) {
        v[r] = contrib(r, i, dt);
        if (r < rem)
            v[r] += contrib(r + p2, i, dt);
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
        for (int r = 0; r < p2; r++)
            nv[r] = v[r] + v[r ^ mask];
        memcpy(v, nv, sizeof v);
    }
    return op == KT_REDUCE_MEAN ? v[0] / (float)g_size : v[0];
}

static void store(void *buf, size_t i, float v, kt_dtype dt)
{
    if (dt == KT_F32)
        ((float *)buf)[i] = v;
    else
        ((uint16_t *)buf)[i] = kt_f32_to_bf16_1(v);
}

static uint64_t fnv(const void *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h;
}

/* Every rank's hash of `what` must be the same bits. */
static void expect_same_everywhere(kt_comm *c, const void *buf, size_t n, const char *what)
{
    uint64_t mine = fnv(buf, n), all[64];
    CHECK(kt_comm_all_gather(c, &mine, sizeof mine, all));
    for (int r = 0; r < g_size; r++)
        if (all[r] != mine)
            fail("%s: rank %d holds other bits than this rank", what, r);
}

static void check_all_reduce(kt_comm *c, size_t count, kt_dtype dt, kt_reduce_op op)
{
    size_t es = dt == KT_F32 ? 4 : 2;
    void *buf = malloc(count * es + 1), *want = malloc(count * es + 1);
    if (!buf || !want)
        fail("out of memory");
    int rd = kt__all_reduce_uses_rd(count);
    for (int b = 0; b < g_size; b++) {
        size_t s0 = kt__blk_start(count, g_size, b), n = kt__blk_len(count, g_size, b);
        for (size_t i = s0; i < s0 + n; i++) {
            store(buf, i, contrib_f32(g_rank, i), dt);
            store(want, i, rd ? ref_rd(i, dt, op) : ref_ring(b, i, dt, op), dt);
        }
    }
    CHECK(kt_comm_all_reduce(c, buf, count, dt, op));
    if (count > 0 && memcmp(buf, want, count * es) != 0)
        fail("all_reduce %s %s of %zu differs from the reference", kt_dtype_name(dt),
             op == KT_REDUCE_SUM ? "sum" : "mean", count);
    expect_same_everywhere(c, buf, count * es, "all_reduce");
    free(buf);
    free(want);
}

/* count elements per rank; in place: recv is this rank's block of send. */
static void check_reduce_scatter(kt_comm *c, size_t count, kt_dtype dt, kt_reduce_op op,
                                 int in_place)
{
    size_t es = dt == KT_F32 ? 4 : 2;
    char *send = malloc((size_t)g_size * count * es + 1), *recv = malloc(count * es + 1),
         *want = malloc(count * es + 1);
    if (!send || !recv || !want)
        fail("out of memory");
    for (size_t i = 0; i < (size_t)g_size * count; i++)
        store(send, i, contrib_f32(g_rank, i), dt);
    size_t s0 = (size_t)g_rank * count;
    for (size_t i = 0; i < count; i++)
        store(want, i, ref_ring(g_rank, s0 + i, dt, op), dt);
    char *out = in_place ? send + s0 * es : recv;
    CHECK(kt_comm_reduce_scatter(c, send, out, count, dt, op));
    if (count > 0 && memcmp(out, want, count * es) != 0)
        fail("reduce_scatter %s %s of %zu%s differs from the reference", kt_dtype_name(dt),
             op == KT_REDUCE_SUM ? "sum" : "mean", count, in_place ? " (in place)" : "");
    /* the other blocks of send are left as they were */
    for (size_t i = 0; i < (size_t)g_size * count && in_place; i++) {
        if (i >= s0 && i < s0 + count)
            continue;
        char tmp[4];
        store(tmp, 0, contrib_f32(g_rank, i), dt);
        if (memcmp(tmp, send + i * es, es) != 0)
            fail("in-place reduce_scatter changed element %zu of another block", i);
    }
    free(send);
    free(recv);
    free(want);
}

/* Blocks of lengths varying per pair, some empty; every byte checked. */
static size_t a2a_len(int src, int dst) { return (src + dst) % 3 == 0 ? 0 : (size_t)(src * 1000 + dst * 37 + 5) * (size_t)(dst + 1); }

static void check_all_to_all_v(kt_comm *c)
{
    size_t sb[64], rb[64], st = 0, rt = 0;
    for (int p = 0; p < g_size; p++) {
        sb[p] = a2a_len(g_rank, p), rb[p] = a2a_len(p, g_rank);
        st += sb[p], rt += rb[p];
    }
    unsigned char *send = malloc(st + 1), *recv = malloc(rt + 1);
    if (!send || !recv)
        fail("out of memory");
    for (int p = 0, o = 0; p < g_size; o += (int)sb[p], p++)
        fill(send + o, sb[p], g_rank, p, 21);
    memset(recv, 0xee, rt);
    CHECK(kt_comm_all_to_all_v(c, send, sb, recv, rb));
    for (int p = 0, o = 0; p < g_size; o += (int)rb[p], p++)
        expect_bytes(recv + o, rb[p], p, g_rank, 21, "all_to_all_v");
    free(send);
    free(recv);
}

/* Sizes around the recursive-doubling switch, not divisible by 2, 3, 4 or the slices, up to
 * 16 MiB; every dtype and op on the small ones, the large ones once each. */
static void check_reductions(kt_comm *c)
{
    static const size_t counts[] = {0, 1, 7, 1000, 8191, 8192, 8193, 300001};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
        for (int dt = 0; dt < 2; dt++)
            for (int op = 0; op < 2; op++) {
                kt_dtype d = dt ? KT_BF16 : KT_F32;
                kt_reduce_op o = op ? KT_REDUCE_MEAN : KT_REDUCE_SUM;
                check_all_reduce(c, counts[k], d, o);
                check_reduce_scatter(c, counts[k], d, o, (int)k % 2);
            }
    check_all_reduce(c, (4u << 20) - 3, KT_F32, KT_REDUCE_SUM);    /* 16 MiB */
    check_all_reduce(c, (4u << 20) + 5, KT_BF16, KT_REDUCE_MEAN);  /* 8 MiB */
    check_reduce_scatter(c, (size_t)(4u << 20) / (size_t)g_size + 1, KT_F32, KT_REDUCE_MEAN, 1);
    check_all_to_all_v(c);
}

static void scenario_collectives(kt_comm *c)
{
    CHECK(kt_comm_barrier(c));
    unsigned char *buf = malloc(4 << 20), *big = malloc((size_t)g_size * ((5 << 20) / 4 + 3));
    if (buf == NULL || big == NULL)
        fail("out of memory");
    static const size_t bsizes[] = {0, 1, 100, 70000, 1 << 20};
    for (int root = 0; root < g_size; root++)
        for (size_t k = 0; k < 5; k++) {
            size_t n = bsizes[k];
            if (g_rank == root)
                fill(buf, n, root, -1, k);
            else
                memset(buf, 0xee, n);
            CHECK(kt_comm_broadcast(c, buf, n, root));
            expect_bytes(buf, n, root, -1, k, "broadcast");
        }
    static const size_t gsizes[] = {0, 3, 33, 65536, 1 << 20, (5 << 20) / 4 + 3};
    for (size_t k = 0; k < 6; k++) {
        size_t n = gsizes[k];
        fill(buf, n, g_rank, -2, k);
        memset(big, 0xee, (size_t)g_size * n);
        CHECK(kt_comm_all_gather(c, buf, n, big));
        for (int r = 0; r < g_size; r++)
            expect_bytes(big + (size_t)r * n, n, r, -2, k, "all_gather");
    }
    /* gatherv / scatterv: different counts per rank, rank 1 contributes nothing */
    size_t counts[64], total = 0;
    for (int r = 0; r < g_size; r++) {
        counts[r] = r == 1 ? 0 : (size_t)(r * 3001 + 17) * (r == g_size - 1 ? 40 : 1);
        total += counts[r];
    }
    for (int root = 0; root < g_size; root++) {
        fill(buf, counts[g_rank], g_rank, root, 7);
        memset(big, 0xee, total);
        CHECK(kt_comm_gatherv(c, buf, counts, g_rank == root ? big : NULL, root));
        if (g_rank == root) {
            size_t off = 0;
            for (int r = 0; r < g_size; r++) {
                expect_bytes(big + off, counts[r], r, root, 7, "gatherv");
                off += counts[r];
            }
        }
        if (g_rank == root) {
            size_t off = 0;
            for (int r = 0; r < g_size; r++) {
                fill(big + off, counts[r], root, r, 9);
                off += counts[r];
            }
        }
        memset(buf, 0xee, counts[g_rank]);
        CHECK(kt_comm_scatterv(c, g_rank == root ? big : NULL, counts, buf, root));
        expect_bytes(buf, counts[g_rank], root, g_rank, 9, "scatterv");
    }
    check_reductions(c);
    /* a slow but live peer (late by a fraction of the deadline) is not an error */
    kt_comm_set_timeout(c, 2000);
    if (g_rank == g_size - 1)
        nanosleep(&(struct timespec){0, 600 * 1000000L}, NULL);
    double t0 = now_s();
    CHECK(kt_comm_barrier(c));
    printf("ok: barrier with a late peer took %.2f s\n", now_s() - t0);
    /* many small collectives in a row: sequence numbers never confuse them */
    for (int i = 0; i < 2000; i++) {
        int v = g_rank == i % g_size ? i : -1;
        CHECK(kt_comm_broadcast(c, &v, sizeof v, i % g_size));
        if (v != i)
            fail("broadcast #%d gave %d", i, v);
    }
    free(buf);
    free(big);
}

static void scenario_agree(kt_comm *c)
{
    CHECK(kt_comm_agree(c, KT_OK));
    /* rank 1 fails; every rank gets its message */
    kt_status local = KT_OK;
    if (g_rank == 1)
        local = kt__error(KT_EIO, "rank-1-local-failure: the disk is on fire (%d)", 42);
    kt_status s = kt_comm_agree(c, local);
    const char *want = "rank 1: rank-1-local-failure: the disk is on fire (42)";
    if (s != KT_EIO || strcmp(kt_last_error(), want) != 0)
        fail("agree gave %s '%s', expected EIO '%s'", kt_status_str(s), kt_last_error(), want);
    /* several fail with different messages: the lowest failing rank's wins */
    local = KT_OK;
    if (g_rank >= 1)
        local = kt__error(g_rank == 1 ? KT_ERANGE : KT_EFORMAT, "failure of rank %d", g_rank);
    s = kt_comm_agree(c, local);
    if (s != KT_ERANGE || strcmp(kt_last_error(), "rank 1: failure of rank 1") != 0)
        fail("agree of several failures gave %s '%s'", kt_status_str(s), kt_last_error());
    /* the failing ranks are the upper half (lowest W / 2): its message on every rank */
    local = g_rank >= g_size / 2 ? kt__error(KT_ENOMEM, "upper-half failure %d", g_rank) : KT_OK;
    s = kt_comm_agree(c, local);
    char want_half[64];
    snprintf(want_half, sizeof want_half, "rank %d: upper-half failure %d", g_size / 2,
             g_size / 2);
    if (s != KT_ENOMEM || strcmp(kt_last_error(), want_half) != 0)
        fail("agree of the upper half gave %s '%s'", kt_status_str(s), kt_last_error());
    /* every rank fails: rank 0's message */
    s = kt_comm_agree(c, kt__error(KT_EIO, "all fail (%d)", g_rank));
    if (s != KT_EIO || strcmp(kt_last_error(), "rank 0: all fail (0)") != 0)
        fail("agree of all failing gave %s '%s'", kt_status_str(s), kt_last_error());
    /* a long message is carried whole (up to the error buffer) */
    char longmsg[1000];
    memset(longmsg, 'x', sizeof longmsg - 1);
    longmsg[sizeof longmsg - 1] = '\0';
    local = g_rank == g_size - 1 ? kt__error(KT_EINVAL, "%s", longmsg) : KT_OK;
    s = kt_comm_agree(c, local);
    char want_long[1100];
    snprintf(want_long, sizeof want_long, "rank %d: %s", g_size - 1, longmsg);
    if (s != KT_EINVAL || strcmp(kt_last_error(), want_long) != 0)
        fail("agree with a long message gave %s (%zu chars)", kt_status_str(s),
             strlen(kt_last_error()));
    /* agreeing on a failure does not poison the communicator */
    CHECK(kt_comm_barrier(c));
    CHECK(kt_comm_agree(c, KT_OK));
}

/* ---- faults ------------------------------------------------------------------------------------ */

/* The survivor's check: an error of the right kind, within the deadline (plus slack for the
 * abort notices and the scheduler), naming `who`; then the communicator stays poisoned. */
static void expect_failure(kt_comm *c, kt_status s, double elapsed, const char *who,
                           double min_s)
{
    double limit = kt_comm_size(c) > 0 ? 2.5 + 2.0 : 0;
    if (s == KT_OK)
        fail("the operation succeeded; an error was expected");
    if (elapsed > limit)
        fail("the error came after %.2f s (limit %.1f s): %s", elapsed, limit, kt_last_error());
    if (elapsed < min_s)
        fail("the error came too early, after %.2f s: %s", elapsed, kt_last_error());
    if (who != NULL && strstr(kt_last_error(), who) == NULL)
        fail("the message does not name %s: %s", who, kt_last_error());
    char first[1100];
    snprintf(first, sizeof first, "%s", kt_last_error());
    double t0 = now_s();
    kt_status again = kt_comm_barrier(c);
    if (again != s || strcmp(kt_last_error(), first) != 0 || now_s() - t0 > 0.1)
        fail("the communicator is not poisoned with the first error: %s '%s'",
             kt_status_str(again), kt_last_error());
    if (kt_comm_status(c) != s)
        fail("kt_comm_status does not report the poison");
    printf("PASS rank %d %s after %.2f s: %s: %s\n", g_rank, g_scenario, elapsed,
           kt_status_str(s), first);
}

/* Rank 1 dies (SIGKILL) or stops (SIGSTOP) itself in the middle of a run of all_reduces. */
static void scenario_fault(kt_comm *c, int sig)
{
    const int victim = 1;
    pid_t me = getpid(), *pids = malloc((size_t)g_size * sizeof *pids);
    float *v = calloc(16384, sizeof *v);
    if (pids == NULL || v == NULL)
        fail("out of memory");
    CHECK(kt_comm_all_gather(c, &me, sizeof me, pids));
    if (sig == SIGSTOP && g_rank != victim)
        g_victim_pid = pids[victim];
    kt_status s = KT_OK;
    double t0 = 0;
    for (int it = 0; it < 20 && s == KT_OK; it++) {
        if (it == 10 && g_rank == victim)
            raise(sig);
        t0 = now_s();
        s = kt_comm_all_reduce(c, v, 16384, KT_F32, KT_REDUCE_SUM);
    }
    double elapsed = now_s() - t0;
    if (g_rank == victim)
        fail("the victim is still running");
    char who[32];
    snprintf(who, sizeof who, "peer %d", victim);
    /* A stopped peer is seen only through the deadline: not much before it. */
    expect_failure(c, s, elapsed, who, sig == SIGSTOP ? 2.5 * 0.5 : 0);
    if (sig == SIGSTOP)
        kill(pids[victim], SIGKILL); /* the stopped rank never ends by itself */
    free(pids);
    free(v);
}

/* Rank 0 expects one byte more from peer 1 than it sends: rank 0's all_to_all_v fails,
 * naming peer 1; the others may finish theirs, and hear of it at the next call. */
static void scenario_a2a_mismatch(kt_comm *c)
{
    size_t sb[64], rb[64];
    unsigned char send[64 * 16], recv[64 * 16 + 1];
    for (int p = 0; p < g_size; p++)
        sb[p] = rb[p] = 16;
    if (g_rank == 0)
        rb[1] = 17;
    memset(send, 1, sizeof send);
    double t0 = now_s();
    kt_status s = kt_comm_all_to_all_v(c, send, sb, recv, rb);
    if (g_rank == 0) {
        if (s != KT_ESTATE)
            fail("a length mismatch gave %s: %s", kt_status_str(s), kt_last_error());
        expect_failure(c, s, now_s() - t0, "peer 1", 0);
        return;
    }
    if (s == KT_OK)
        s = kt_comm_barrier(c);
    expect_failure(c, s, now_s() - t0, "peer 0", 0);
}

/* Rank 0 calls broadcast while the others call barrier. */
static void scenario_mismatch(kt_comm *c)
{
    double t0 = now_s();
    kt_status s;
    if (g_rank == 0) {
        int v = 1;
        s = kt_comm_broadcast(c, &v, sizeof v, 0);
        /* the root only sends: it may finish before a peer sees the mismatch; then the
         * peer's abort notice fails its next call */
        if (s == KT_OK)
            s = kt_comm_barrier(c);
    } else {
        s = kt_comm_barrier(c);
    }
    expect_failure(c, s, now_s() - t0, g_rank == 0 ? "mismatched" : "mismatched collectives", 0);
}

/* A TCP connection to the master's port that says nothing (it may have to wait for rank 0
 * to listen) */
static int idle_connection(void)
{
    const char *port = getenv("KT_MASTER_PORT");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int tries = 0; tries < 100; tries++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
            return fd;
        if (fd >= 0)
            close(fd);
        nanosleep(&(struct timespec){0, 20000000}, NULL);
    }
    fail("no connection to the master port %s", port);
    return -1;
}

/* jobs: the rank sleeps TEST_DELAY_US first (the test staggers two jobs on one port), then
 * every rank all-gathers its job's TEST_TOKEN: a rank of another job in this world shows up
 * as a different token ("WRONG"). A refused rank prints REFUSED with the message. */
static int scenario_jobs(void)
{
    const char *d = getenv("TEST_DELAY_US"), *tok = getenv("TEST_TOKEN");
    if (d != NULL)
        nanosleep(&(struct timespec){atol(d) / 1000000, (atol(d) % 1000000) * 1000}, NULL);
    uint64_t mine = tok != NULL ? strtoull(tok, NULL, 10) : 0, all[64];
    kt_comm *c = NULL;
    kt_status s = kt_comm_create_ucx(NULL, &c);
    if (s != KT_OK) {
        printf("REFUSED rank %d: %s\n", g_rank, kt_last_error());
        return 1;
    }
    s = g_size <= 64 ? kt_comm_all_gather(c, &mine, sizeof mine, all) : KT_EINVAL;
    if (s == KT_OK)
        s = kt_comm_barrier(c);
    if (s != KT_OK) {
        printf("REFUSED rank %d (after joining): %s\n", g_rank, kt_last_error());
        kt_comm_destroy(c);
        return 1;
    }
    for (int r = 0; r < g_size; r++)
        if (all[r] != mine) {
            printf("WRONG rank %d: rank %d of this world has token %llu, mine is %llu\n", g_rank,
                   r, (unsigned long long)all[r], (unsigned long long)mine);
            kt_comm_destroy(c);
            return 1;
        }
    printf("PASS rank %d jobs token %llu\n", g_rank, (unsigned long long)mine);
    kt_comm_destroy(c);
    return 0;
}

/* garbage: rank 0 is no master but a listener that answers with text; rank 1's error must
 * say what it received and from where. */
static int scenario_garbage(void)
{
    const char *port = getenv("KT_MASTER_PORT");
    if (g_rank == 0) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 4) != 0)
            fail("cannot listen on %s", port);
        int cfd = accept(fd, NULL, NULL);
        static const char text[] = "HTTP/1.0 400 Bad Request\r\n\r\n";
        if (cfd < 0 || write(cfd, text, sizeof text - 1) != (ssize_t)(sizeof text - 1))
            fail("accept / write");
        nanosleep(&(struct timespec){0, 300000000}, NULL);
        close(cfd);
        close(fd);
        printf("PASS rank 0 garbage (the listener)\n");
        return 0;
    }
    kt_comm *c = NULL;
    if (kt_comm_create_ucx(NULL, &c) == KT_OK)
        fail("joined a listener that is no master");
    char where[64];
    snprintf(where, sizeof where, "127.0.0.1:%s", port);
    if (strstr(kt_last_error(), "HTTP/1.0 400 Bad Request") == NULL ||
        strstr(kt_last_error(), where) == NULL)
        fail("the error does not show what came from %s: %s", where, kt_last_error());
    printf("PASS rank %d garbage: %s\n", g_rank, kt_last_error());
    return 0;
}

/* p2pseq: rank 0 sends three messages of tag 7; rank 1 receives them and waits for a fourth,
 * which times out: the error must name recv #3, tag 7 and peer 0 (not "#0"). */
static void scenario_p2pseq(kt_comm *c)
{
    int v = 0;
    if (g_rank == 0) {
        for (int i = 0; i < 3; i++)
            CHECK(kt_comm_send(c, 1, 7, &v, sizeof v));
        kt_status s = kt_comm_recv(c, 1, 9, &v, sizeof v); /* fails when rank 1 gives up */
        if (s == KT_OK)
            fail("a receive nobody sent completed");
        printf("PASS rank 0 p2pseq: %s\n", kt_last_error());
        return;
    }
    for (int i = 0; i < 3; i++)
        CHECK(kt_comm_recv(c, 0, 7, &v, sizeof v));
    kt_status s = kt_comm_recv(c, 0, 7, &v, sizeof v);
    if (s != KT_ETIMEDOUT || strstr(kt_last_error(), "recv #3 (tag 7) from peer 0") == NULL)
        fail("%s: %s", kt_status_str(s), kt_last_error());
    printf("PASS rank 1 p2pseq: %s\n", kt_last_error());
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: comm_rank_test SCENARIO (run under kt-launch)\n");
        return 2;
    }
    g_scenario = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *r = getenv("KT_RANK"), *n = getenv("KT_WORLD_SIZE");
    g_rank = r ? atoi(r) : -1;
    g_size = n ? atoi(n) : 0;
    if (strcmp(g_scenario, "jobs") == 0)
        return scenario_jobs();
    if (strcmp(g_scenario, "garbage") == 0)
        return scenario_garbage();
    if (strcmp(g_scenario, "absent") == 0 && g_rank == g_size - 1)
        return 0; /* never arrives */
    /* worldsize: the last rank believes in a larger world; every rank must fail, naming it
     * (the last rank too: it is told why, not left with a closed connection).
     * idle: rank 1 first holds a connection to the master open without a word; the others'
     * rendezvous must not wait on it for the whole timeout. */
    if (strcmp(g_scenario, "worldsize") == 0 && g_rank == g_size - 1) {
        char v[16];
        snprintf(v, sizeof v, "%d", g_size + 1);
        setenv("KT_WORLD_SIZE", v, 1);
    }
    int idle_fd = strcmp(g_scenario, "idle") == 0 && g_rank == 1 ? idle_connection() : -1;
    kt_comm *c = NULL;
    double t0 = now_s();
    kt_status s = kt_comm_create_ucx(NULL, &c);
    if (idle_fd >= 0)
        close(idle_fd);
    if (strcmp(g_scenario, "worldsize") == 0) {
        double el = now_s() - t0;
        if (s == KT_OK)
            fail("the communicator was created with rank %d in a world of %d", g_size - 1,
                 g_size + 1);
        /* (a rank that comes after the master has given up finds no master) */
        const int told = strstr(kt_last_error(), "claiming rank") != NULL;
        const int late = g_rank != 0 && g_rank != g_size - 1 &&
                         strstr(kt_last_error(), "could not connect to the master") != NULL;
        if (el > 2.5 + 2.0 || !(told || late))
            fail("after %.2f s: %s", el, kt_last_error());
        printf("PASS rank %d worldsize after %.2f s: %s\n", g_rank, el, kt_last_error());
        return 0;
    }
    if (strcmp(g_scenario, "idle") == 0) {
        if (s != KT_OK)
            fail("kt_comm_create_ucx with an idle connection open: %s", kt_last_error());
        printf("PASS rank %d idle: joined after %.2f s\n", g_rank, now_s() - t0);
        kt_comm_destroy(c);
        return 0;
    }
    if (strcmp(g_scenario, "absent") == 0) {
        char who[32];
        snprintf(who, sizeof who, "rank(s) %d", g_size - 1);
        double el = now_s() - t0;
        if (s == KT_OK)
            fail("the communicator was created without rank %d", g_size - 1);
        if (s != KT_ETIMEDOUT && s != KT_EPEER)
            fail("status %s: %s", kt_status_str(s), kt_last_error());
        if (el > 2.5 + 2.0 || strstr(kt_last_error(), who) == NULL)
            fail("after %.2f s: %s", el, kt_last_error());
        printf("PASS rank %d absent after %.2f s: %s: %s\n", g_rank, el, kt_status_str(s),
               kt_last_error());
        return 0;
    }
    if (s != KT_OK)
        fail("kt_comm_create_ucx: %s: %s", kt_status_str(s), kt_last_error());
    if (kt_comm_rank(c) != g_rank || kt_comm_size(c) != g_size)
        fail("rank/size %d/%d", kt_comm_rank(c), kt_comm_size(c));
    t0 = now_s();
    if (strcmp(g_scenario, "p2p") == 0)
        scenario_p2p(c);
    else if (strcmp(g_scenario, "ring") == 0)
        scenario_ring(c);
    else if (strcmp(g_scenario, "collectives") == 0)
        scenario_collectives(c);
    else if (strcmp(g_scenario, "agree") == 0)
        scenario_agree(c);
    else if (strcmp(g_scenario, "mismatch") == 0)
        scenario_mismatch(c);
    else if (strcmp(g_scenario, "a2a_mismatch") == 0)
        scenario_a2a_mismatch(c);
    else if (strcmp(g_scenario, "kill") == 0)
        scenario_fault(c, SIGKILL);
    else if (strcmp(g_scenario, "stop") == 0)
        scenario_fault(c, SIGSTOP);
    else if (strcmp(g_scenario, "p2pseq") == 0)
        scenario_p2pseq(c);
    else
        fail("unknown scenario");
    int faulty = strcmp(g_scenario, "mismatch") == 0 ||
                 strcmp(g_scenario, "a2a_mismatch") == 0 || strcmp(g_scenario, "kill") == 0 ||
                 strcmp(g_scenario, "stop") == 0 || strcmp(g_scenario, "p2pseq") == 0;
    if (!faulty)
        printf("PASS rank %d %s in %.2f s\n", g_rank, g_scenario, now_s() - t0);
    double td = now_s();
    kt_comm_destroy(c);
    if (now_s() - td > 5.0)
        fail("destroy took %.2f s", now_s() - td);
    return 0;
}
