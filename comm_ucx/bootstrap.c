/* Bootstrap of the UCX communicator: rank, size and master from the options or the
 * environment, and a TCP rendezvous at the master that exchanges UCX worker addresses.
 *
 * No MPI or PMIx: rank 0 listens on the master port, every other rank connects (retrying
 * until the deadline, since it may start before rank 0), sends its worker address, and gets
 * the table of all of them. Every socket operation polls against the same deadline, so a
 * rank that never arrives, a dead master, or a port in use ends in an error naming the
 * address, never in a hang. The sockets stay open until every rank has created its
 * endpoints, so a failure on one rank is reported to all. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm_ucx/ucx_internal.h"
#include "lib/core/env.h"
#include "lib/core/error.h"

/* The hello (rank -> master): magic, rank, world size, address length, job id length, then
 * the job id and the address. Every reply (master -> rank) starts with its own magic, the
 * status and a length (the world size in the table, else the reason's length), so that a
 * rank that reached something else on the port can say what it got. */
#define BOOT_MAGIC 0x4b544332u /* "KTC2": with the job id */
#define BOOT_REPLY_MAGIC 0x4b545232u /* "KTR2" */
#define BOOT_MAX_ADDR (1u << 20) /* a UCX worker address is a few hundred bytes */

struct kt__ucx_boot {
    kt__ucx_setup s;
    int64_t deadline;
    int *fds; /* master: one per rank (fds[0] unused); others: fds[0] = the master */
    int n_fds;
};

int64_t kt__ucx_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- environment ---------------------------------------------------------------------- */

/* libkt's strict reading (core/env.h: " 5" or "5x" is refused), into an int */
static kt_status env_int(const char *name, long lo, long hi, int *out, int *found)
{
    long long x = 0;
    kt_status st = kt__env_int(name, lo, hi, "a number", &x, found);
    if (st != KT_OK)
        return kt__error_context(st, "kt_comm_create_ucx");
    if (*found)
        *out = (int)x;
    return KT_OK;
}

/* The job id: the options', else the first launcher's that is set. Slurm's job id names an
 * allocation, which may run several steps (several jobs) at once: the step goes with it. */
static kt_status resolve_job_id(const kt_comm_options *o, kt__ucx_setup *s)
{
    static const char *const vars[] = {"KT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                       "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"};
    const char *id = o != NULL ? o->job_id : NULL, *from = "kt_comm_options.job_id";
    for (size_t i = 0; i < sizeof vars / sizeof vars[0] && (id == NULL || id[0] == '\0'); i++) {
        id = getenv(vars[i]);
        from = vars[i];
    }
    if (id == NULL)
        id = "";
    const char *step = strcmp(from, "SLURM_JOB_ID") == 0 ? getenv("SLURM_STEP_ID") : NULL;
    int n = snprintf(s->job_id, sizeof s->job_id, "%s%s%s", id, step != NULL ? "." : "",
                     step != NULL ? step : "");
    if (n < 0 || (size_t)n >= sizeof s->job_id)
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: the job id from %s ('%.40s...') is "
                         "longer than %zu bytes", from, id, sizeof s->job_id - 1);
    return KT_OK;
}

kt_status kt__ucx_resolve(const kt_comm_options *o, kt__ucx_setup *out)
{
    static const char *const pairs[][2] = {{"KT_RANK", "KT_WORLD_SIZE"},
                                           {"RANK", "WORLD_SIZE"},
                                           {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                           {"SLURM_PROCID", "SLURM_NTASKS"}};
    const long max_ranks = 1l << KT__TAG_SRC_BITS;
    kt__ucx_setup s = {.rank = -1, .size = 0};
    int found_r, found_s;
    const char *source = "options"; /* the variable that gave the rank */
    if (o != NULL && o->world_size != 0) {
        s.rank = o->rank;
        s.size = o->world_size;
    } else {
        for (size_t i = 0; i < sizeof pairs / sizeof pairs[0] && s.size == 0; i++) {
            int r = -1, n = 0;
            KT__TRY(env_int(pairs[i][0], 0, max_ranks - 1, &r, &found_r));
            KT__TRY(env_int(pairs[i][1], 1, max_ranks, &n, &found_s));
            if (found_r && found_s) {
                s.rank = r;
                s.size = n;
                source = pairs[i][0];
            }
        }
        if (s.size == 0)
            return kt__error(KT_EINVAL,
                             "kt_comm_create_ucx: no rank and world size: set KT_RANK and "
                             "KT_WORLD_SIZE (or RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, "
                             "SLURM_PROCID/SLURM_NTASKS), or pass them in the options");
    }
    if (s.size < 1 || s.size > max_ranks || s.rank < 0 || s.rank >= s.size)
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: rank %d of world size %d is invalid",
                         s.rank, s.size);

    const char *addr = o != NULL ? o->master_addr : NULL;
    if (addr == NULL || addr[0] == '\0')
        addr = getenv("KT_MASTER_ADDR");
    if (addr == NULL || addr[0] == '\0')
        addr = getenv("MASTER_ADDR");
    char derived[256];
    if ((addr == NULL || addr[0] == '\0') && s.size > 1) {
        KT__TRY(kt__ucx_default_master(source, s.size, derived));
        addr = derived;
    }
    if (addr == NULL || addr[0] == '\0')
        addr = "127.0.0.1";
    if (strlen(addr) >= sizeof s.master_addr)
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: master address '%.40s...' is too long",
                         addr);
    memcpy(s.master_addr, addr, strlen(addr) + 1);

    s.master_port = o != NULL ? o->master_port : 0;
    if (s.master_port == 0) {
        KT__TRY(env_int("KT_MASTER_PORT", 1, 65535, &s.master_port, &found_r));
        if (!found_r)
            KT__TRY(env_int("MASTER_PORT", 1, 65535, &s.master_port, &found_r));
        if (!found_r)
            s.master_port = 29500; /* torchrun's default */
    }
    if (s.master_port < 1 || s.master_port > 65535)
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: master port %d is outside 1..65535",
                         s.master_port);

    s.transport = o != NULL ? o->transport : KT_COMM_TRANSPORT_DEFAULT;
    if (s.transport == KT_COMM_TRANSPORT_DEFAULT) {
        int t = -1; /* the choices are in kt_comm_transport's order */
        if (kt__env_choice("KT_COMM_TRANSPORT", kt__transport_choices, 3, &t) != KT_OK)
            return kt__error_context(KT_EINVAL, "kt_comm_create_ucx");
        s.transport = t >= 0 ? (kt_comm_transport)t : KT_COMM_TRANSPORT_DEFAULT;
    } else if (s.transport != KT_COMM_TRANSPORT_SHM && s.transport != KT_COMM_TRANSPORT_TCP) {
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: unknown transport %d", (int)s.transport);
    }

    s.timeout_ms = o != NULL ? o->timeout_ms : 0;
    if (s.timeout_ms < 0)
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: timeout %d ms is negative", s.timeout_ms);
    if (s.timeout_ms == 0)
        KT__TRY(kt__comm_env_timeout(&s.timeout_ms));
    KT__TRY(resolve_job_id(o, &s));
    *out = s;
    return KT_OK;
}

const char *kt__ucx_job_name(const kt__ucx_setup *s, char buf[136])
{
    if (s->job_id[0] == '\0')
        return "(unnamed)";
    snprintf(buf, 136, "'%s'", s->job_id);
    return buf;
}

/* ---- sockets with deadlines ------------------------------------------------------------ */

static int remaining(int64_t deadline)
{
    int64_t left = deadline - kt__ucx_now_ms();
    return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* 1 ready, 0 deadline passed, -1 error (errno) */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int left = remaining(deadline);
        int n = poll(&p, 1, left);
        if (n > 0)
            return 1;
        if (n == 0)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

static int set_nonblocking(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* KT_OK, or a status with errno-based text in *why (left to the caller to name the peer). */
static kt_status write_all(int fd, const void *buf, size_t n, int64_t deadline, const char **why)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = wait_fd(fd, POLLOUT, deadline);
            if (w == 0) {
                *why = "timed out sending";
                return KT_ETIMEDOUT;
            }
            if (w > 0)
                continue;
        }
        *why = strerror(errno);
        return KT_EPEER;
    }
    return KT_OK;
}

static kt_status read_all(int fd, void *buf, size_t n, int64_t deadline, const char **why)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) {
            *why = "the connection was closed";
            return KT_EPEER;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(fd, POLLIN, deadline);
            if (w == 0) {
                *why = "timed out waiting for data";
                return KT_ETIMEDOUT;
            }
            if (w > 0)
                continue;
        }
        *why = strerror(errno);
        return KT_EPEER;
    }
    return KT_OK;
}

static kt_status put_u32s(int fd, const uint32_t *v, int n, int64_t deadline, const char **why)
{
    uint32_t be[8];
    for (int i = 0; i < n; i++)
        be[i] = htonl(v[i]);
    return write_all(fd, be, (size_t)n * 4, deadline, why);
}

/* Reads up to n bytes by the deadline; the count read (short: *why says why). */
static size_t read_upto(int fd, void *buf, size_t n, int64_t deadline, const char **why)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, (char *)buf + got, n - got, 0);
        if (k > 0) {
            got += (size_t)k;
            continue;
        }
        if (k == 0) {
            *why = "the connection was closed";
            break;
        }
        if (errno == EINTR)
            continue;
        if ((errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = wait_fd(fd, POLLIN, deadline);
            if (w > 0)
                continue;
            if (w == 0) {
                *why = "timed out waiting for data";
                break;
            }
        }
        *why = strerror(errno);
        break;
    }
    return got;
}

/* Bytes as text for a message: printable ASCII as is, the rest as \xNN. */
static void show_bytes(const unsigned char *p, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\' && p[i] != '"')
            out[o++] = (char)p[i];
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", p[i]);
    }
    out[o] = '\0';
}

static kt_status get_u32s(int fd, uint32_t *v, int n, int64_t deadline, const char **why)
{
    uint32_t be[8];
    kt_status st = read_all(fd, be, (size_t)n * 4, deadline, why);
    for (int i = 0; st == KT_OK && i < n; i++)
        v[i] = ntohl(be[i]);
    return st;
}

static kt_status resolve_addr(const kt__ucx_setup *s, int passive, struct addrinfo **res_out)
{
    char port[16];
    snprintf(port, sizeof port, "%d", s->master_port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    int rc = getaddrinfo(s->master_addr, port, &hints, res_out);
    if (rc != 0)
        return kt__error(KT_EINVAL, "rank %d: cannot resolve the master address %s:%d: %s",
                         s->rank, s->master_addr, s->master_port, gai_strerror(rc));
    return KT_OK;
}

/* ---- master side ------------------------------------------------------------------------- */

#define MASTER_BUSY_RETRY_MS 1000

static kt_status listen_master(const kt__ucx_setup *s, int *fd_out)
{
    struct addrinfo *res = NULL;
    KT__TRY(resolve_addr(s, 1, &res));
    int fd = -1, err = 0;
    /* A rank that connects before this listens can be given this very port as its own local
     * port and connect to itself (it then drops that socket and retries, see
     * connect_master): the port is briefly in use, so "in use" is retried for a moment. */
    const int64_t busy_until = kt__ucx_now_ms() + MASTER_BUSY_RETRY_MS;
    for (;;) {
        for (struct addrinfo *a = res; a != NULL && fd < 0; a = a->ai_next) {
            fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) {
                err = errno;
                continue;
            }
            int one = 1;
            /* A previous run's connections in TIME_WAIT must not block the port. */
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0 ||
                set_nonblocking(fd) != 0) {
                err = errno;
                close(fd);
                fd = -1;
            }
        }
        if (fd >= 0 || err != EADDRINUSE || kt__ucx_now_ms() >= busy_until)
            break;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(res);
    char job[136];
    if (fd < 0)
        return kt__error(KT_EIO, "rank 0 of job %s: cannot listen on the master address %s:%d: "
                         "%s%s", kt__ucx_job_name(s, job), s->master_addr, s->master_port,
                         strerror(err), err == EADDRINUSE ? " (another job's master, or another "
                         "program, holds the port)" : "");
    *fd_out = fd;
    return KT_OK;
}

/* Tells one connected process why the rendezvous failed (best effort, by the deadline). */
static void report_to(int fd, kt_status status, const char *text, int64_t deadline)
{
    const char *why;
    size_t len = strlen(text);
    uint32_t hdr[3] = {BOOT_REPLY_MAGIC, (uint32_t)(int32_t)status, (uint32_t)len};
    if (put_u32s(fd, hdr, 3, deadline, &why) == KT_OK)
        write_all(fd, text, len, deadline, &why);
}

/* Tells every connected rank why the rendezvous failed (best effort, short deadline). */
static void master_report(kt__ucx_boot *b, kt_status status, const char *text)
{
    int64_t deadline = kt__ucx_now_ms() + 500;
    for (int r = 1; r < b->n_fds; r++)
        if (b->fds[r] >= 0)
            report_to(b->fds[r], status, text, deadline);
}

/* Closes a connection whose peer may still be sending (its address, after a header the
 * master refused): what it sent is read and dropped first, until it closes or the deadline,
 * since closing with unread data sends a reset, which can destroy the reply before the peer
 * has read it. */
static void close_after_reply(int fd, int64_t deadline)
{
    shutdown(fd, SHUT_WR);
    char sink[256];
    while (wait_fd(fd, POLLIN, deadline) > 0) {
        ssize_t got = read(fd, sink, sizeof sink);
        if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN))
            break;
    }
    close(fd);
}

/* After a failed rendezvous: the processes whose connections wait in the listen queue (or
 * come within a moment) are told why too; closing the socket would only reset them. */
static void refuse_pending(int lfd, kt_status status, const char *text, int wait_ms)
{
    const int64_t deadline = kt__ucx_now_ms() + wait_ms;
    while (wait_fd(lfd, POLLIN, deadline) > 0) {
        int cfd = accept(lfd, NULL, NULL);
        if (cfd < 0)
            break;
        if (set_nonblocking(cfd) == 0)
            report_to(cfd, status, text, kt__ucx_now_ms() + 300);
        close_after_reply(cfd, kt__ucx_now_ms() + 300);
    }
}

/* How long one accepted connection may take to send its header and address: a rank sends
 * them at once, so an idle connection (a port scanner, a stuck process) costs the others no
 * more than this, not the whole rendezvous timeout. */
#define BOOT_HELLO_MS 1000

static kt_status master_gather(kt__ucx_boot *b, int lfd, const void *addr, size_t addr_len,
                               void **block, size_t *lens)
{
    const kt__ucx_setup *s = &b->s;
    int joined = 1;
    void **addrs = calloc((size_t)s->size, sizeof *addrs);
    kt_status st = KT_OK;
    const char *why = NULL;
    char stranger[256] = "";
    int strangers = 0;
    if (addrs == NULL)
        return kt__error(KT_ENOMEM, "rank 0: rendezvous: out of memory");
    lens[0] = addr_len;
    while (joined < s->size && st == KT_OK) {
        int w = wait_fd(lfd, POLLIN, b->deadline);
        if (w <= 0) {
            char missing[256] = "";
            size_t m = 0;
            for (int r = 1; r < s->size && m + 12 < sizeof missing; r++)
                if (b->fds[r] < 0)
                    m += (size_t)snprintf(missing + m, sizeof missing - m, "%s%d", m ? ", " : "", r);
            char name[136];
            st = kt__error(KT_ETIMEDOUT,
                           "rank 0 of job %s: rank(s) %s did not join the rendezvous at %s:%d "
                           "within %d ms%s", kt__ucx_job_name(s, name), missing, s->master_addr,
                           s->master_port, s->timeout_ms, stranger);
            break;
        }
        int cfd = accept(lfd, NULL, NULL);
        if (cfd < 0)
            continue; /* the connecting process gave up, or EINTR: keep waiting */
        uint32_t hdr[5];
        char job[128];
        int bad = set_nonblocking(cfd) != 0;
        int64_t hello = kt__ucx_now_ms() + BOOT_HELLO_MS;
        hello = hello < b->deadline ? hello : b->deadline;
        kt_status rs = bad ? KT_EIO : get_u32s(cfd, hdr, 5, hello, &why);
        if (rs == KT_OK && hdr[0] == BOOT_MAGIC && hdr[4] < sizeof job)
            rs = read_all(cfd, job, hdr[4], hello, &why);
        if (rs != KT_OK || hdr[0] != BOOT_MAGIC || hdr[4] >= sizeof job) {
            /* A stray connection (a port scanner, an idle or older client) must not end the
             * rendezvous. */
            close(cfd);
            continue;
        }
        job[hdr[4]] = '\0';
        if (strcmp(job, s->job_id) != 0) {
            /* A rank of another job on the same port: refused, and this job keeps waiting
             * for its own ranks; the stranger learns which job it reached. */
            kt__ucx_setup other = *s;
            memcpy(other.job_id, job, hdr[4] + 1);
            char mine_name[136], other_name[136], text[KT__COMM_MSG_MAX];
            snprintf(text, sizeof text, "the master at %s:%d is rank 0 of job %s, not of job %s "
                     "(which this process, claiming rank %u of %u, belongs to): two jobs share "
                     "the rendezvous port; give each its own (kt-launch --port, MASTER_PORT)",
                     s->master_addr, s->master_port, kt__ucx_job_name(s, mine_name),
                     kt__ucx_job_name(&other, other_name), hdr[1], hdr[2]);
            snprintf(stranger, sizeof stranger, "; refused %d process(es) of other jobs, "
                     "the last of job %s", ++strangers, other_name);
            report_to(cfd, KT_EPEER, text, kt__ucx_now_ms() + 500);
            close_after_reply(cfd, kt__ucx_now_ms() + 500);
            continue;
        }
        if (hdr[2] != (uint32_t)s->size || hdr[1] == 0 || hdr[1] >= (uint32_t)s->size ||
            b->fds[hdr[1]] >= 0 || hdr[3] == 0 || hdr[3] > BOOT_MAX_ADDR) {
            /* A rank of this job that disagrees about the world, or a second claim to a rank
             * number, leaves no way to tell which process is right: the job fails, and the
             * process that disagrees learns why too, not just a closed socket. */
            const char *what = hdr[2] != (uint32_t)s->size ? "" :
                               hdr[1] == 0 ? "; rank 0 is this master" :
                               hdr[1] >= (uint32_t)s->size ? "; no such rank" :
                               b->fds[hdr[1]] >= 0 ? "; that rank already joined" :
                               "; with an invalid address length";
            char name[136];
            st = kt__error(KT_EINVAL,
                           "rank 0 of job %s: a process claiming rank %u of world size %u "
                           "joined the rendezvous at %s:%d (this world has size %d%s)",
                           kt__ucx_job_name(s, name), hdr[1], hdr[2], s->master_addr,
                           s->master_port, s->size, what);
            report_to(cfd, st, kt_last_error(), kt__ucx_now_ms() + 500);
            close_after_reply(cfd, kt__ucx_now_ms() + 500);
            continue;
        }
        int r = (int)hdr[1];
        addrs[r] = malloc(hdr[3]);
        if (addrs[r] == NULL) {
            close(cfd);
            st = kt__error(KT_ENOMEM, "rank 0: rendezvous: out of memory");
            break;
        }
        rs = read_all(cfd, addrs[r], hdr[3], hello, &why);
        if (rs != KT_OK) {
            close(cfd);
            free(addrs[r]);
            addrs[r] = NULL;
            st = kt__error(rs, "rank 0: reading rank %d's address at %s:%d: %s", r,
                           s->master_addr, s->master_port, why);
            break;
        }
        lens[r] = hdr[3];
        b->fds[r] = cfd;
        joined++;
    }
    size_t total = 0;
    for (int r = 0; r < s->size && st == KT_OK; r++)
        total += lens[r];
    char *blk = st == KT_OK ? malloc(total) : NULL;
    if (st == KT_OK && blk == NULL)
        st = kt__error(KT_ENOMEM, "rank 0: rendezvous: out of memory");
    if (st == KT_OK) {
        size_t off = 0;
        for (int r = 0; r < s->size; r++) {
            memcpy(blk + off, r == 0 ? addr : addrs[r], lens[r]);
            off += lens[r];
        }
        /* The table: status 0, size, the lengths, then the addresses in rank order. */
        for (int r = 1; r < s->size && st == KT_OK; r++) {
            uint32_t hdr[3] = {BOOT_REPLY_MAGIC, 0, (uint32_t)s->size};
            kt_status ws = put_u32s(b->fds[r], hdr, 3, b->deadline, &why);
            for (int q = 0; q < s->size && ws == KT_OK; q++) {
                uint32_t l = (uint32_t)lens[q];
                ws = put_u32s(b->fds[r], &l, 1, b->deadline, &why);
            }
            if (ws == KT_OK)
                ws = write_all(b->fds[r], blk, total, b->deadline, &why);
            if (ws != KT_OK)
                st = kt__error(ws, "rank 0: sending the address table to rank %d: %s", r, why);
        }
    }
    if (st != KT_OK) {
        master_report(b, st, kt_last_error());
        refuse_pending(lfd, st, kt_last_error(), 200);
        free(blk);
    } else {
        /* Connections already queued come from no rank of this job (they have all joined):
         * they are told so, without waiting for more. */
        char name[136], text[KT__COMM_MSG_MAX];
        snprintf(text, sizeof text, "the rendezvous of job %s at %s:%d is already complete (all "
                 "%d ranks joined): a process of another job on the same port, or one rank "
                 "too many", kt__ucx_job_name(s, name), s->master_addr, s->master_port, s->size);
        refuse_pending(lfd, KT_EPEER, text, 0);
        *block = blk;
    }
    for (int r = 0; r < s->size; r++)
        free(addrs[r]);
    free(addrs);
    return st;
}

/* ---- other ranks ------------------------------------------------------------------------- */

/* A TCP socket whose local and peer addresses are the same (a "self-connect"). */
static int connected_to_self(int fd)
{
    struct sockaddr_storage local, peer;
    socklen_t ll = sizeof local, pl = sizeof peer;
    if (getsockname(fd, (struct sockaddr *)&local, &ll) != 0 ||
        getpeername(fd, (struct sockaddr *)&peer, &pl) != 0)
        return 0;
    return ll == pl && memcmp(&local, &peer, ll) == 0;
}

static kt_status connect_master(kt__ucx_boot *b, int *fd_out)
{
    const kt__ucx_setup *s = &b->s;
    int last_err = ECONNREFUSED;
    for (;;) {
        struct addrinfo *res = NULL;
        KT__TRY(resolve_addr(s, 0, &res));
        for (struct addrinfo *a = res; a != NULL; a = a->ai_next) {
            int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) {
                last_err = errno;
                continue;
            }
            if (set_nonblocking(fd) == 0) {
                int rc = connect(fd, a->ai_addr, a->ai_addrlen);
                if (rc != 0 && errno == EINPROGRESS && wait_fd(fd, POLLOUT, b->deadline) > 0) {
                    int err = 0;
                    socklen_t len = sizeof err;
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
                    rc = err == 0 ? 0 : -1;
                    errno = err;
                } else if (rc != 0 && errno == EINPROGRESS) {
                    errno = ETIMEDOUT;
                }
                if (rc == 0 && connected_to_self(fd)) {
                    /* Before the master listens, Linux may give this socket the master's own
                     * port as its local port (both in the ephemeral range) and connect it to
                     * itself; that also keeps the master from binding. Drop it, retry. */
                    rc = -1;
                    errno = ECONNREFUSED;
                }
                if (rc == 0) {
                    freeaddrinfo(res);
                    *fd_out = fd;
                    return KT_OK;
                }
            }
            last_err = errno;
            close(fd);
        }
        freeaddrinfo(res);
        if (remaining(b->deadline) == 0)
            break;
        /* The master may not be listening yet: try again shortly. */
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return kt__error(KT_ETIMEDOUT,
                     "rank %d: could not connect to the master at %s:%d within %d ms: %s", s->rank,
                     s->master_addr, s->master_port, s->timeout_ms, strerror(last_err));
}

static kt_status client_exchange(kt__ucx_boot *b, const void *addr, size_t addr_len,
                                 void **block, size_t *lens)
{
    const kt__ucx_setup *s = &b->s;
    const char *why = NULL;
    int fd = b->fds[0];
    size_t job_len = strlen(s->job_id);
    char job[136];
    uint32_t hdr[5] = {BOOT_MAGIC, (uint32_t)s->rank, (uint32_t)s->size, (uint32_t)addr_len,
                       (uint32_t)job_len};
    kt_status st = put_u32s(fd, hdr, 5, b->deadline, &why);
    if (st == KT_OK)
        st = write_all(fd, s->job_id, job_len, b->deadline, &why);
    if (st == KT_OK)
        st = write_all(fd, addr, addr_len, b->deadline, &why);
    if (st != KT_OK)
        return kt__error(st, "rank %d of job %s: rendezvous with the master at %s:%d: %s",
                         s->rank, kt__ucx_job_name(s, job), s->master_addr, s->master_port, why);
    /* The master's deadline decides the rendezvous; it may have started later than this
     * rank, so its answer (the table, or which rank never came) gets a little longer. */
    const int64_t answer_by = b->deadline + 1000 + s->timeout_ms / 4;
    unsigned char raw[12];
    size_t got = read_upto(fd, raw, sizeof raw, answer_by, &why);
    if (got == 0)
        return kt__error(KT_EPEER, "rank %d of job %s: rendezvous with the master at %s:%d: %s",
                         s->rank, kt__ucx_job_name(s, job), s->master_addr, s->master_port, why);
    uint32_t reply[3];
    memcpy(reply, raw, sizeof reply);
    for (int i = 0; i < 3; i++)
        reply[i] = ntohl(reply[i]);
    if (got < sizeof raw || reply[0] != BOOT_REPLY_MAGIC) {
        /* Not a libkt master (another service on the port, another protocol version):
         * say what came back, a little more of it if there is more. */
        unsigned char more[64];
        memcpy(more, raw, got);
        if (got == sizeof raw)
            got += read_upto(fd, more + got, sizeof more - got, kt__ucx_now_ms() + 100, &why);
        char shown[4 * sizeof more + 1];
        show_bytes(more, got, shown, sizeof shown);
        return kt__error(KT_EPEER, "rank %d of job %s: what answers at %s:%d is not a libkt "
                         "rendezvous master of this version: it sent %zu byte(s) \"%s\"%s%s",
                         s->rank, kt__ucx_job_name(s, job), s->master_addr, s->master_port, got,
                         shown, got < sizeof raw ? ", then " : "", got < sizeof raw ? why : "");
    }
    if ((int32_t)reply[1] != 0) {
        char text[KT__COMM_MSG_MAX];
        size_t n = reply[2] < sizeof text - 1 ? reply[2] : sizeof text - 1;
        /* the reason follows the header at once; this rank's own deadline has usually
         * passed by now (the master waited for the same deadline), so give it the same
         * grace as the header */
        size_t k = read_upto(fd, text, n, answer_by, &why);
        text[k] = '\0';
        kt_status rs = (int32_t)reply[1] < 0 && (int32_t)reply[1] >= KT_EINTERNAL
                           ? (kt_status)(int32_t)reply[1]
                           : KT_EPEER;
        if (k < n || n == 0)
            return kt__error(rs, "rank %d of job %s: the rendezvous at %s:%d failed at the "
                             "master (%s) with a reason of %u bytes, of which %zu arrived "
                             "(%s): %s", s->rank, kt__ucx_job_name(s, job), s->master_addr,
                             s->master_port, kt_status_str(rs), reply[2], k,
                             n == 0 ? "none sent" : why, text);
        return kt__error(rs, "rank %d of job %s: the rendezvous at %s:%d refused it: %s", s->rank,
                         kt__ucx_job_name(s, job), s->master_addr, s->master_port, text);
    }
    reply[1] = reply[2];
    if (reply[1] != (uint32_t)s->size)
        return kt__error(KT_EFORMAT, "rank %d: the master at %s:%d sent a table of %u ranks, "
                         "expected %d", s->rank, s->master_addr, s->master_port, reply[1], s->size);
    size_t total = 0;
    for (int r = 0; r < s->size && st == KT_OK; r++) {
        uint32_t l = 0;
        st = get_u32s(fd, &l, 1, b->deadline, &why);
        if (st == KT_OK && (l == 0 || l > BOOT_MAX_ADDR))
            return kt__error(KT_EFORMAT, "rank %d: the master at %s:%d sent an address of %u "
                             "bytes for rank %d", s->rank, s->master_addr, s->master_port, l, r);
        lens[r] = l;
        total += l;
    }
    char *blk = st == KT_OK ? malloc(total) : NULL;
    if (st == KT_OK && blk == NULL)
        return kt__error(KT_ENOMEM, "rank %d: rendezvous: out of memory", s->rank);
    if (st == KT_OK)
        st = read_all(fd, blk, total, b->deadline, &why);
    if (st != KT_OK) {
        free(blk);
        return kt__error(st, "rank %d: receiving the address table from the master at %s:%d: %s",
                         s->rank, s->master_addr, s->master_port, why);
    }
    *block = blk;
    return KT_OK;
}

/* ---- entry points -------------------------------------------------------------------------- */

void kt__ucx_boot_close(kt__ucx_boot *b)
{
    if (b == NULL)
        return;
    for (int i = 0; i < b->n_fds; i++)
        if (b->fds[i] >= 0)
            close(b->fds[i]);
    free(b->fds);
    free(b);
}

kt_status kt__ucx_rendezvous(const kt__ucx_setup *s, const void *addr, size_t addr_len,
                             kt__ucx_boot **boot_out, void **block_out, const void ***addrs_out,
                             size_t **lens_out)
{
    kt_status st = KT_OK;
    void *block = NULL;
    const void **addrs = calloc((size_t)s->size, sizeof *addrs);
    size_t *lens = calloc((size_t)s->size, sizeof *lens);
    kt__ucx_boot *b = calloc(1, sizeof *b);
    int lfd = -1;
    if (addrs == NULL || lens == NULL || b == NULL) {
        st = kt__error(KT_ENOMEM, "rank %d: rendezvous: out of memory", s->rank);
        goto done;
    }
    b->s = *s;
    b->deadline = kt__ucx_now_ms() + s->timeout_ms;
    b->n_fds = s->rank == 0 ? s->size : 1;
    b->fds = malloc((size_t)b->n_fds * sizeof *b->fds);
    if (b->fds == NULL) {
        b->n_fds = 0;
        st = kt__error(KT_ENOMEM, "rank %d: rendezvous: out of memory", s->rank);
        goto done;
    }
    for (int i = 0; i < b->n_fds; i++)
        b->fds[i] = -1;
    if (s->rank == 0) {
        st = listen_master(s, &lfd);
        if (st == KT_OK)
            st = master_gather(b, lfd, addr, addr_len, &block, lens);
    } else {
        st = connect_master(b, &b->fds[0]);
        if (st == KT_OK)
            st = client_exchange(b, addr, addr_len, &block, lens);
    }
    if (st == KT_OK) {
        size_t off = 0;
        for (int r = 0; r < s->size; r++) {
            addrs[r] = (const char *)block + off;
            off += lens[r];
        }
    }
done:
    if (lfd >= 0)
        close(lfd); /* everyone joined (or failed): late connections are refused */
    if (st != KT_OK) {
        kt__ucx_boot_close(b);
        free(addrs);
        free(lens);
        return st;
    }
    *boot_out = b;
    *block_out = block;
    *addrs_out = addrs;
    *lens_out = lens;
    return KT_OK;
}

kt_status kt__ucx_rendezvous_finish(kt__ucx_boot *b, kt_status local, const char *message)
{
    const kt__ucx_setup *s = &b->s;
    const char *why = NULL;
    b->deadline = kt__ucx_now_ms() + s->timeout_ms;
    if (s->rank != 0) {
        size_t len = local == KT_OK ? 0 : strnlen(message, KT__COMM_MSG_MAX - 1);
        uint32_t hdr[2] = {(uint32_t)(int32_t)local, (uint32_t)len};
        kt_status st = put_u32s(b->fds[0], hdr, 2, b->deadline, &why);
        if (st == KT_OK)
            st = write_all(b->fds[0], message, len, b->deadline, &why);
        uint32_t reply[2];
        if (st == KT_OK)
            st = get_u32s(b->fds[0], reply, 2, b->deadline, &why);
        if (st != KT_OK)
            return local != KT_OK ? local
                                  : kt__error(st, "rank %d: final handshake with the master at "
                                              "%s:%d: %s", s->rank, s->master_addr,
                                              s->master_port, why);
        if ((int32_t)reply[0] == 0)
            return local;
        char text[KT__COMM_MSG_MAX];
        size_t n = reply[1] < sizeof text - 1 ? reply[1] : sizeof text - 1;
        if (read_all(b->fds[0], text, n, b->deadline, &why) != KT_OK)
            n = 0;
        text[n] = '\0';
        if (local != KT_OK)
            return local; /* keep this rank's own reason */
        kt_status rs = (int32_t)reply[0] < 0 && (int32_t)reply[0] >= KT_EINTERNAL
                           ? (kt_status)(int32_t)reply[0]
                           : KT_EPEER;
        return kt__error(rs, "rank %d: another rank failed to connect: %s", s->rank, text);
    }
    /* Master: collect every rank's result, answer with the first failure. */
    kt_status first = local;
    char text[KT__COMM_MSG_MAX];
    snprintf(text, sizeof text, "rank 0: %s", local == KT_OK ? "" : message);
    for (int r = 1; r < s->size; r++) {
        uint32_t hdr[2];
        kt_status st = get_u32s(b->fds[r], hdr, 2, b->deadline, &why);
        char m[KT__COMM_MSG_MAX];
        size_t n = 0;
        if (st == KT_OK) {
            n = hdr[1] < sizeof m - 1 ? hdr[1] : sizeof m - 1;
            st = read_all(b->fds[r], m, n, b->deadline, &why);
        }
        m[st == KT_OK ? n : 0] = '\0';
        if (first != KT_OK)
            continue;
        if (st != KT_OK) {
            first = st;
            snprintf(text, sizeof text, "rank %d did not finish connecting: %s", r, why);
        } else if ((int32_t)hdr[0] != 0) {
            first = (int32_t)hdr[0] < 0 && (int32_t)hdr[0] >= KT_EINTERNAL
                        ? (kt_status)(int32_t)hdr[0]
                        : KT_EPEER;
            snprintf(text, sizeof text, "%s", m);
        }
    }
    for (int r = 1; r < s->size; r++) {
        size_t len = first == KT_OK ? 0 : strlen(text);
        uint32_t hdr[2] = {(uint32_t)(int32_t)first, (uint32_t)len};
        if (put_u32s(b->fds[r], hdr, 2, b->deadline, &why) == KT_OK)
            write_all(b->fds[r], text, len, b->deadline, &why);
    }
    if (local != KT_OK || first == KT_OK)
        return local;
    return kt__error(first, "rank 0: another rank failed to connect: %s", text);
}
