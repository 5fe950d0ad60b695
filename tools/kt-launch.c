/* kt-launch: starts N ranks of a program on this machine for the UCX communicator.
 *
 *   kt-launch -n N [--transport shm|tcp] [--port P] [--timeout-ms MS] [--grace-ms MS]
 *             [--keep-going] -- program args...
 *   kt-launch --print-env [-n RANKS_PER_HOST] [--port P] HOSTS...
 *
 * Each rank gets KT_RANK, KT_WORLD_SIZE, KT_MASTER_ADDR=127.0.0.1 and KT_MASTER_PORT (a free
 * port unless --port), KT_COMM_TRANSPORT with --transport, KT_COMM_TIMEOUT_MS with
 * --timeout-ms. Its stdout and stderr lines come out prefixed with "[rank r] ". SIGINT and
 * SIGTERM are forwarded to the ranks. When a rank fails (non-zero exit or a signal) the
 * others are stopped (SIGTERM, then SIGKILL after the grace period) and kt-launch exits with
 * that rank's status (128 + signal for a signal); --keep-going lets the others finish (the
 * fault tests, where one rank is meant to die). Signals go to each rank's process group, so
 * what a rank started goes too, also after the rank itself has exited; once every rank has
 * exited, processes they left behind holding their output get the grace period, then SIGTERM
 * and SIGKILL. If kt-launch itself is killed (SIGKILL), its guard process kills the process
 * groups of the ranks still running. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/free_port.h"
#ifdef __linux__
#include <sys/prctl.h>
#endif

typedef struct stream {
    int fd;      /* -1 once closed */
    char buf[4096];
    size_t len;
} stream;

typedef struct rank_proc {
    pid_t pid;
    int running;
    int status;  /* waitpid status */
    int guarded; /* the guard holds its process group (started, group not yet known empty) */
    int open[2]; /* its stdout / stderr pipe has a writer still (the relay reports the ends) */
    stream streams[2]; /* the read ends: the relay's */
} rank_proc;

static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    unsigned char c = (unsigned char)sig;
    int saved = errno;
    if (write(sig_pipe[1], &c, 1) < 0) {
        /* the pipe is full: the loop will wake up anyway */
    }
    errno = saved;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kt-launch -n N [options] -- program [args...]\n"
            "       kt-launch --print-env [-n RANKS_PER_HOST] [--port P] [--transport T] HOSTS...\n"
            "\n"
            "Starts N ranks of program on this machine for libkt's UCX communicator, with\n"
            "KT_RANK, KT_WORLD_SIZE, KT_MASTER_ADDR=127.0.0.1 and KT_MASTER_PORT set, and\n"
            "prefixes their output lines with \"[rank r] \".\n"
            "\n"
            "options:\n"
            "  -n N              number of ranks (with --print-env: ranks per host, default 1)\n"
            "  --transport T     shm or tcp (sets KT_COMM_TRANSPORT; default: UCX's choice)\n"
            "  --port P          rendezvous port (default: a free port; 29500 with --print-env)\n"
            "  --timeout-ms MS   the communicator deadline (sets KT_COMM_TIMEOUT_MS)\n"
            "  --grace-ms MS     after a failure, SIGTERM then SIGKILL after MS (default 3000);\n"
            "                    also how long processes the exited ranks left behind may\n"
            "                    hold their output before they are stopped the same way\n"
            "  --keep-going      let the other ranks run on when one fails\n"
            "  --print-env       print the environment each host needs for a multi-host run\n"
            "                    (the first host is the master); starts nothing\n"
            "  -h, --help        this text\n"
            "\n"
            "exit status: 0 when every rank exited 0; else the first failing rank's status\n"
            "(128 + signal number when it was killed by a signal); 128 + the signal when\n"
            "kt-launch itself got SIGINT or SIGTERM; 2 for a usage error.\n"
            "\n"
            "Each rank runs in its own process group. If kt-launch is killed (SIGKILL), a\n"
            "guard process it started kills the groups of the ranks still running.\n");
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

/* A job id for this launch, from /dev/urandom (else the clock and pid): the communicator's
 * master refuses ranks of another job that reach its port (KT_JOB_ID). */
static void make_job_id(char out[32])
{
    uint64_t x = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, &x, sizeof x) != (ssize_t)sizeof x) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^
            ((uint64_t)getpid() << 32);
    }
    if (fd >= 0)
        close(fd);
    snprintf(out, 32, "kt-%016llx", (unsigned long long)x);
}

static int print_env(int per_host, int port, const char *transport, const char *timeout,
                     int n_hosts, char **hosts)
{
    char job_id[32];
    make_job_id(job_id);
    int world = per_host * n_hosts;
    printf("# %d host(s) x %d rank(s); start each line's command on its host\n", n_hosts,
           per_host);
    for (int h = 0; h < n_hosts; h++)
        for (int i = 0; i < per_host; i++) {
            printf("%s: KT_RANK=%d KT_WORLD_SIZE=%d KT_MASTER_ADDR=%s KT_MASTER_PORT=%d "
                   "KT_JOB_ID=%s", hosts[h], h * per_host + i, world, hosts[0], port, job_id);
            if (transport != NULL)
                printf(" KT_COMM_TRANSPORT=%s", transport);
            if (timeout != NULL)
                printf(" KT_COMM_TIMEOUT_MS=%s", timeout);
            printf("\n");
        }
    return 0;
}

/* Whether rank r's process group may still have members: its leader runs, or something still
 * holds its output pipes (a child it left behind). An exited rank whose pipes are closed is
 * not signalled: its pid, and so its group id, may belong to another process by now. */
static int group_alive(const rank_proc *r)
{
    return r->running || r->open[0] || r->open[1];
}

static void signal_all(rank_proc *ranks, int n, int sig)
{
    for (int r = 0; r < n; r++)
        if (group_alive(&ranks[r])) {
            /* The rank's process group: a shell's children must go too, or they keep the
             * output pipes open (also after the rank itself has exited). */
            if (kill(-ranks[r].pid, sig) != 0 && ranks[r].running)
                kill(ranks[r].pid, sig);
            if (sig == SIGTERM && kill(-ranks[r].pid, SIGCONT) != 0 && ranks[r].running)
                kill(ranks[r].pid, SIGCONT); /* a stopped rank must run to see SIGTERM */
        }
}

/* ---- the guard --------------------------------------------------------------------------
 * A SIGKILLed kt-launch cannot stop anything itself. Each rank gets PR_SET_PDEATHSIG, but that
 * reaches the rank's own process only, not what it started (a wrapper shell's children keep
 * running, and keep GPUs, ports and files). So kt-launch starts a guard process first: it is
 * sent each rank's pid as the rank starts (the rank's process group id) and the pid negated
 * once that group is known to be empty (group_alive above: after that its id may be another
 * process's). When the pipe from kt-launch reaches its end, kt-launch is gone: the groups
 * still held get SIGKILL. A normal exit forgets every group first, so the guard kills nothing. */
static int guard_fd = -1;

static void guard_run(int fd, pid_t *groups, int max)
{
    signal(SIGINT, SIG_IGN); /* a terminal's ^C is kt-launch's to forward */
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) { /* not holding kt-launch's output open after it */
        dup2(null, STDIN_FILENO);
        dup2(null, STDOUT_FILENO);
        dup2(null, STDERR_FILENO);
    }
    int n = 0;
    pid_t msg;
    for (;;) {
        ssize_t got = read(fd, &msg, sizeof msg); /* messages are written whole (< PIPE_BUF) */
        if (got < 0 && errno == EINTR)
            continue;
        if (got != (ssize_t)sizeof msg)
            break;
        if (msg > 0 && n < max) {
            groups[n++] = msg;
        } else if (msg < 0) {
            for (int i = 0; i < n; i++)
                if (groups[i] == -msg) {
                    groups[i] = groups[--n];
                    break;
                }
        }
    }
    for (int i = 0; i < n; i++)
        kill(-groups[i], SIGKILL);
    _exit(0);
}

/* Starts the guard for up to n ranks (none if it cannot: the ranks still get PDEATHSIG). */
static void guard_start(int n)
{
    int p[2];
    pid_t *groups = calloc((size_t)n, sizeof *groups);
    if (groups == NULL || pipe(p) != 0) {
        free(groups);
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(p[1]);
        guard_run(p[0], groups, n);
    }
    free(groups);
    close(p[0]);
    if (pid < 0) {
        close(p[1]);
        return;
    }
    fcntl(p[1], F_SETFD, FD_CLOEXEC); /* the ranks must not hold it open */
    guard_fd = p[1];
}

static void guard_send(pid_t msg)
{
    if (guard_fd >= 0 && write(guard_fd, &msg, sizeof msg) != (ssize_t)sizeof msg) {
        close(guard_fd); /* the guard is gone (it never exits first): nothing left to tell */
        guard_fd = -1;
    }
}

/* Tells the guard which ranks' groups are now empty. */
static void guard_forget_finished(rank_proc *ranks, int n)
{
    for (int r = 0; r < n; r++)
        if (ranks[r].guarded && !group_alive(&ranks[r])) {
            guard_send(-ranks[r].pid);
            ranks[r].guarded = 0;
        }
}

/* ---- the relay ------------------------------------------------------------------------
 * The ranks' output goes through pipes to a relay process that prefixes the lines. A rank
 * blocks when its pipe is full, and a stopped reader never empties it: so the reader is not
 * kt-launch, which Ctrl-Z or SIGSTOP may stop while the ranks (in their own process groups)
 * run on, but this relay, which ignores the terminal's stop signals, and which itself never
 * blocks on its output: it writes only what poll says fits, keeps up to RELAY_QUEUE_MAX
 * bytes per destination, and drops whole lines beyond that, saying how many. A rank's
 * progress never waits for a terminal, a pipe reader or kt-launch. */
#define RELAY_QUEUE_MAX (8u << 20)

typedef struct out_queue {
    int fd;
    char *buf;
    size_t len, cap;
    unsigned long dropped; /* lines dropped since the last that fitted */
} out_queue;

static void queue_put(out_queue *q, const char *p, size_t n)
{
    if (q->len + n > q->cap) {
        size_t cap = q->cap ? q->cap : 65536;
        while (cap < q->len + n && cap < RELAY_QUEUE_MAX)
            cap *= 2;
        char *b = cap >= q->len + n ? realloc(q->buf, cap) : NULL;
        if (b == NULL) {
            q->dropped++;
            return;
        }
        q->buf = b;
        q->cap = cap;
    }
    memcpy(q->buf + q->len, p, n);
    q->len += n;
}

static void emit_line(out_queue *q, int rank, const char *line, size_t n)
{
    char head[160];
    if (q->dropped > 0 && q->len + 160 + n + 16 <= RELAY_QUEUE_MAX) {
        int k = snprintf(head, sizeof head, "[kt-launch] %lu line(s) of output dropped here: "
                         "nothing read it in time\n", q->dropped);
        q->dropped = 0;
        queue_put(q, head, (size_t)k);
    }
    int k = snprintf(head, sizeof head, "[rank %d] ", rank);
    if (q->len + (size_t)k + n + 1 > RELAY_QUEUE_MAX) {
        q->dropped++;
        return;
    }
    queue_put(q, head, (size_t)k);
    queue_put(q, line, n);
    queue_put(q, "\n", 1);
}

/* Writes what fits now (poll said POLLOUT: a pipe then takes PIPE_BUF bytes at once). */
static void queue_flush_some(out_queue *q)
{
    size_t n = q->len < PIPE_BUF ? q->len : PIPE_BUF;
    ssize_t k = write(q->fd, q->buf, n);
    if (k < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (k <= 0) {
        q->len = 0; /* the output is gone (closed pipe, hung-up terminal): nowhere to go */
        return;
    }
    memmove(q->buf, q->buf + k, q->len - (size_t)k);
    q->len -= (size_t)k;
}

/* Reads what is there; queues whole lines; 0 at EOF. */
static int drain(int rank, stream *s, out_queue *q)
{
    ssize_t k = read(s->fd, s->buf + s->len, sizeof s->buf - s->len);
    if (k < 0 && (errno == EINTR || errno == EAGAIN))
        return 1;
    if (k <= 0) {
        if (s->len > 0)
            emit_line(q, rank, s->buf, s->len);
        s->len = 0;
        close(s->fd);
        s->fd = -1;
        return 0;
    }
    s->len += (size_t)k;
    size_t start = 0;
    for (size_t i = 0; i < s->len; i++) {
        if (s->buf[i] == '\n') {
            emit_line(q, rank, s->buf + start, i - start);
            start = i + 1;
        }
    }
    if (start == 0 && s->len == sizeof s->buf) { /* a line longer than the buffer */
        emit_line(q, rank, s->buf, s->len);
        start = s->len;
    }
    memmove(s->buf, s->buf + start, s->len - start);
    s->len -= start;
    return 1;
}

/* The relay's loop: ranks[r].streams to stdout / stderr; each stream's end is reported to
 * kt-launch on ctl (its index, r * 2 + k). When ctl reaches its end (kt-launch has finished,
 * or died), the streams still open are abandoned; what is queued is written out, then the
 * relay exits. */
static void relay_run(rank_proc *ranks, int n, int ctl)
{
    signal(SIGINT, SIG_IGN); /* kt-launch forwards ^C to the ranks; their output must flow */
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGTSTP, SIG_IGN);
    signal(SIGTTOU, SIG_IGN);
    signal(SIGTTIN, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, SIG_DFL);
    out_queue q[2] = {{.fd = STDOUT_FILENO}, {.fd = STDERR_FILENO}};
    struct pollfd *pfd = calloc((size_t)(2 * n + 3), sizeof *pfd);
    int *idx = calloc((size_t)(2 * n + 3), sizeof *idx);
    if (pfd == NULL || idx == NULL)
        _exit(1);
    int open_streams = 2 * n, ctl_open = 1;
    while (q[0].len > 0 || q[1].len > 0 || (ctl_open && open_streams > 0)) {
        for (int k = 0; k < 2 && (!ctl_open || open_streams == 0); k++)
            if (q[k].dropped > 0) { /* the end: no later line would carry the notice */
                char note[160];
                int len = snprintf(note, sizeof note, "[kt-launch] %lu line(s) of output "
                                   "dropped here: nothing read it in time\n", q[k].dropped);
                q[k].dropped = 0;
                queue_put(&q[k], note, (size_t)len);
            }
        int np = 0;
        for (int k = 0; k < 2; k++)
            if (q[k].len > 0) {
                pfd[np] = (struct pollfd){.fd = q[k].fd, .events = POLLOUT};
                idx[np++] = -1 - k;
            }
        if (ctl_open) {
            pfd[np] = (struct pollfd){.fd = ctl, .events = POLLIN};
            idx[np++] = -3;
            for (int r = 0; r < n; r++)
                for (int k = 0; k < 2; k++)
                    if (ranks[r].streams[k].fd >= 0) {
                        pfd[np] = (struct pollfd){.fd = ranks[r].streams[k].fd, .events = POLLIN};
                        idx[np++] = r * 2 + k;
                    }
        }
        if (poll(pfd, (nfds_t)np, -1) < 0 && errno != EINTR)
            break;
        for (int j = 0; j < np; j++) {
            if (pfd[j].revents == 0)
                continue;
            if (idx[j] < -2) {
                char c;
                if (read(ctl, &c, 1) <= 0)
                    ctl_open = 0;
            } else if (idx[j] < 0) {
                queue_flush_some(&q[-1 - idx[j]]);
            } else {
                int r = idx[j] / 2, k = idx[j] % 2;
                if (!drain(r, &ranks[r].streams[k], &q[k])) {
                    int32_t msg = idx[j];
                    open_streams--;
                    if (write(ctl, &msg, sizeof msg) != (ssize_t)sizeof msg)
                        ctl_open = 0;
                }
            }
        }
    }
    _exit(0);
}

/* Starts the relay over every rank's read ends, which kt-launch then closes; *ctl_out is
 * kt-launch's end of the socket the relay reports on. -1 if it cannot be started. */
static pid_t relay_start(rank_proc *ranks, int n, int *ctl_out)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        if (guard_fd >= 0)
            close(guard_fd); /* the guard must see kt-launch's end, not the relay's */
        close(sig_pipe[0]);
        close(sig_pipe[1]);
        relay_run(ranks, n, sv[1]);
    }
    close(sv[1]);
    if (pid < 0) {
        close(sv[0]);
        return -1;
    }
    for (int r = 0; r < n; r++)
        for (int k = 0; k < 2; k++) {
            close(ranks[r].streams[k].fd);
            ranks[r].streams[k].fd = -1;
        }
    *ctl_out = sv[0];
    return pid;
}

static int exit_code(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 1;
}

static pid_t spawn(int rank, int n, int port, const char *job_id, const char *transport,
                   const char *timeout, char **argv, int out_fd[2], int err_fd[2])
{
    /* kt-launch's handlers must never run in a rank: a SIGTERM between fork and the reset
     * below (kt-launch stopping the ranks as this one starts, on a loaded machine) ran them in
     * the child, which wrote to kt-launch's signal pipe, so kt-launch took its own stop for a
     * signal to itself (exit 143 instead of the failed rank's status), and the rank lived on
     * until the grace period's SIGKILL. Signals stay blocked across fork; the child unblocks
     * them once the defaults are back, and a pending one then acts as the default. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &old);
    pid_t pid = fork();
    if (pid != 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        return pid;
    }
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old, NULL);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* no orphaned ranks if kt-launch itself is killed */
#endif
    setpgid(0, 0); /* signals reach a rank once, through kt-launch */
    dup2(out_fd[1], STDOUT_FILENO);
    dup2(err_fd[1], STDERR_FILENO);
    close(out_fd[0]);
    close(out_fd[1]);
    close(err_fd[0]);
    close(err_fd[1]);
    char v[32];
    snprintf(v, sizeof v, "%d", rank);
    setenv("KT_RANK", v, 1);
    snprintf(v, sizeof v, "%d", n);
    setenv("KT_WORLD_SIZE", v, 1);
    setenv("KT_MASTER_ADDR", "127.0.0.1", 1);
    snprintf(v, sizeof v, "%d", port);
    setenv("KT_MASTER_PORT", v, 1);
    setenv("KT_JOB_ID", job_id, 1);
    if (transport != NULL)
        setenv("KT_COMM_TRANSPORT", transport, 1);
    if (timeout != NULL)
        setenv("KT_COMM_TIMEOUT_MS", timeout, 1);
    execvp(argv[0], argv);
    fprintf(stderr, "kt-launch: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

int main(int argc, char **argv)
{
    int n = 0, port = 0, grace_ms = 3000, keep_going = 0, env_mode = 0, timeout_ms = 0;
    const char *transport = NULL, *timeout = NULL;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "-n") == 0 && has) {
            if (parse_int(argv[++i], 1, 4096, &n) != 0) {
                fprintf(stderr, "kt-launch: -n needs a number of ranks in 1..4096\n");
                return 2;
            }
        } else if (strcmp(a, "--port") == 0 && has) {
            if (parse_int(argv[++i], 1, 65535, &port) != 0) {
                fprintf(stderr, "kt-launch: --port needs a port in 1..65535\n");
                return 2;
            }
        } else if (strcmp(a, "--timeout-ms") == 0 && has) {
            timeout = argv[++i];
            if (parse_int(timeout, 1, 1 << 30, &timeout_ms) != 0) {
                fprintf(stderr, "kt-launch: --timeout-ms needs a positive number\n");
                return 2;
            }
        } else if (strcmp(a, "--grace-ms") == 0 && has) {
            if (parse_int(argv[++i], 0, 1 << 30, &grace_ms) != 0) {
                fprintf(stderr, "kt-launch: --grace-ms needs a number\n");
                return 2;
            }
        } else if (strcmp(a, "--transport") == 0 && has) {
            transport = argv[++i];
            if (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) {
                fprintf(stderr, "kt-launch: --transport is shm or tcp, not '%s'\n", transport);
                return 2;
            }
        } else if (strcmp(a, "--keep-going") == 0) {
            keep_going = 1;
        } else if (strcmp(a, "--print-env") == 0) {
            env_mode = 1;
        } else if (!has && (strcmp(a, "-n") == 0 || strcmp(a, "--port") == 0 ||
                            strcmp(a, "--timeout-ms") == 0 || strcmp(a, "--grace-ms") == 0 ||
                            strcmp(a, "--transport") == 0)) {
            fprintf(stderr, "kt-launch: %s needs a value (see --help)\n", a);
            return 2;
        } else if (a[0] == '-') {
            fprintf(stderr, "kt-launch: unknown option '%s' (see --help)\n", a);
            return 2;
        } else {
            break;
        }
    }
    if (env_mode) {
        if (i >= argc) {
            fprintf(stderr, "kt-launch: --print-env needs at least one host\n");
            return 2;
        }
        for (int h = i; h < argc; h++)
            if (argv[h][0] == '-') {
                fprintf(stderr, "kt-launch: '%s' after the hosts: options go before them\n",
                        argv[h]);
                return 2;
            }
        return print_env(n > 0 ? n : 1, port > 0 ? port : 29500, transport, timeout, argc - i,
                         argv + i);
    }
    if (n <= 0 || i >= argc) {
        usage(stderr);
        return 2;
    }
    char **prog = argv + i;
    if (port == 0 && (port = kt_tool_free_port()) < 0) {
        fprintf(stderr, "kt-launch: cannot find a free port on 127.0.0.1: %s\n", strerror(errno));
        return 1;
    }

    char job_id[32];
    make_job_id(job_id);
    guard_start(n); /* first: it must hold none of the pipes below */
    rank_proc *ranks = calloc((size_t)n, sizeof *ranks);
    struct pollfd *pfd = calloc((size_t)(2 * n + 1), sizeof *pfd);
    int *pfd_rank = calloc((size_t)(2 * n + 1), sizeof *pfd_rank);
    if (ranks == NULL || pfd == NULL || pfd_rank == NULL || pipe(sig_pipe) != 0) {
        fprintf(stderr, "kt-launch: out of resources\n");
        return 1;
    }
    fcntl(sig_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
    fcntl(sig_pipe[0], F_SETFD, FD_CLOEXEC);
    fcntl(sig_pipe[1], F_SETFD, FD_CLOEXEC);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    for (int r = 0; r < n; r++) {
        int out_fd[2], err_fd[2];
        if (pipe(out_fd) != 0 || pipe(err_fd) != 0) {
            fprintf(stderr, "kt-launch: pipe: %s\n", strerror(errno));
            signal_all(ranks, r, SIGKILL);
            return 1;
        }
        fcntl(out_fd[0], F_SETFD, FD_CLOEXEC);
        fcntl(err_fd[0], F_SETFD, FD_CLOEXEC);
        pid_t pid = spawn(r, n, port, job_id, transport, timeout, prog, out_fd, err_fd);
        close(out_fd[1]);
        close(err_fd[1]);
        if (pid > 0)
            setpgid(pid, pid); /* also here: a signal may come before the child ran */
        if (pid < 0) {
            fprintf(stderr, "kt-launch: fork: %s\n", strerror(errno));
            signal_all(ranks, r, SIGKILL);
            return 1;
        }
        ranks[r] = (rank_proc){.pid = pid, .running = 1, .guarded = 1, .open = {1, 1}};
        guard_send(pid);
        ranks[r].streams[0] = (stream){.fd = out_fd[0]};
        ranks[r].streams[1] = (stream){.fd = err_fd[0]};
    }
    int ctl = -1;
    pid_t relay = relay_start(ranks, n, &ctl);
    if (relay < 0) {
        fprintf(stderr, "kt-launch: cannot start the output relay: %s\n", strerror(errno));
        signal_all(ranks, n, SIGKILL);
        return 1;
    }

    int failed_rank = -1, result = 0, running = n, open_streams = 2 * n;
    int got_signal = 0, stopping = 0, linger_stage = 0;
    /* Deadlines in ms (-1: none): the SIGKILL of what a SIGTERM did not stop, and, once every
     * rank has exited, how long processes they left behind may still hold their output. */
    int64_t kill_at = -1, linger_at = -1;
    while (running > 0 || open_streams > 0) {
        int np = 0;
        pfd[np] = (struct pollfd){.fd = sig_pipe[0], .events = POLLIN};
        pfd_rank[np++] = -1;
        if (ctl >= 0) {
            pfd[np] = (struct pollfd){.fd = ctl, .events = POLLIN};
            pfd_rank[np++] = 0;
        }
        int64_t next = kill_at >= 0 && (linger_at < 0 || kill_at < linger_at) ? kill_at
                                                                               : linger_at;
        int wait = -1;
        if (next >= 0) {
            int64_t left = next - now_ms();
            wait = left < 0 ? 0 : left > 1 << 30 ? 1 << 30 : (int)left;
        }
        int k = poll(pfd, (nfds_t)np, wait);
        if (k < 0 && errno != EINTR) {
            fprintf(stderr, "kt-launch: poll: %s\n", strerror(errno));
            signal_all(ranks, n, SIGKILL);
            return 1;
        }
        if (k > 0 && np > 1 && pfd[1].revents != 0) {
            int32_t ends[64];
            ssize_t got = read(ctl, ends, sizeof ends);
            if (got <= 0 && !(got < 0 && (errno == EINTR || errno == EAGAIN))) {
                /* the relay is gone: nothing holds the ranks' output any more */
                close(ctl);
                ctl = -1;
                for (int r = 0; r < n; r++)
                    ranks[r].open[0] = ranks[r].open[1] = 0;
                open_streams = 0;
            }
            for (ssize_t e = 0; e < got / (ssize_t)sizeof ends[0]; e++) {
                int32_t x = ends[e]; /* whole messages: 4 bytes, written at once */
                if (x >= 0 && x < 2 * n && ranks[x / 2].open[x % 2]) {
                    ranks[x / 2].open[x % 2] = 0;
                    open_streams--;
                }
            }
        }
        if (k > 0 && pfd[0].revents != 0) {
            unsigned char sigs[64];
            ssize_t got = read(sig_pipe[0], sigs, sizeof sigs);
            for (ssize_t s = 0; s < got; s++) {
                if (sigs[s] != SIGINT && sigs[s] != SIGTERM)
                    continue;
                /* Forwarded; a second one, or the grace period, escalates to SIGKILL. The
                 * exit status is then 128 + the first signal, whatever the ranks' */
                signal_all(ranks, n, stopping ? SIGKILL : sigs[s]);
                if (!stopping)
                    kill_at = now_ms() + grace_ms;
                stopping = 1;
                if (!got_signal)
                    result = 128 + sigs[s];
                got_signal = 1;
            }
        }
        pid_t pid;
        int status;
        while ((pid = waitpid(-1, &status, WNOHANG | WUNTRACED)) > 0) {
            if (pid == relay)
                relay = -1;
            for (int r = 0; r < n; r++) {
                if (ranks[r].pid != pid || !ranks[r].running)
                    continue;
                if (WIFSTOPPED(status)) {
                    /* A stopped rank stalls every collective: its peers would wait for their
                     * deadline (60 s by default). Unless the stop is the point (--keep-going,
                     * the fault tests), the job ends now, named. */
                    fprintf(stderr, "kt-launch: rank %d was stopped by signal %d (%s)%s\n", r,
                            WSTOPSIG(status), strsignal(WSTOPSIG(status)),
                            WSTOPSIG(status) == SIGTTIN || WSTOPSIG(status) == SIGTTOU
                                ? ": it used the terminal, which belongs to kt-launch"
                                : "");
                    if (keep_going || failed_rank >= 0 || stopping)
                        continue;
                    failed_rank = r;
                    if (!got_signal)
                        result = 128 + WSTOPSIG(status);
                    fprintf(stderr, "kt-launch: stopping the job\n");
                    signal_all(ranks, n, SIGTERM); /* with SIGCONT, so the stopped one sees it */
                    stopping = 1;
                    kill_at = now_ms() + grace_ms;
                    continue;
                }
                ranks[r].running = 0;
                ranks[r].status = status;
                running--;
                int code = exit_code(status);
                if (code != 0 && failed_rank < 0) {
                    failed_rank = r;
                    if (WIFSIGNALED(status))
                        fprintf(stderr, "kt-launch: rank %d was killed by signal %d (%s)\n", r,
                                WTERMSIG(status), strsignal(WTERMSIG(status)));
                    else
                        fprintf(stderr, "kt-launch: rank %d exited with status %d\n", r, code);
                    if (!got_signal)
                        result = code;
                    if (!keep_going && !stopping) {
                        fprintf(stderr, "kt-launch: stopping the other ranks\n");
                        signal_all(ranks, n, SIGTERM); /* with what the failed one left behind */
                        stopping = 1;
                        kill_at = now_ms() + grace_ms;
                    }
                }
            }
        }
        const int64_t now = now_ms();
        if (kill_at >= 0 && now >= kill_at) {
            signal_all(ranks, n, SIGKILL); /* SIGKILL needs no second round */
            kill_at = -1;
        }
        if (running == 0 && open_streams > 0 && linger_at < 0) {
            linger_at = now + grace_ms;
        } else if (running == 0 && open_streams > 0 && now >= linger_at) {
            if (linger_stage == 0) {
                fprintf(stderr, "kt-launch: every rank has exited, but processes they started "
                        "still hold their output: stopping them\n");
                signal_all(ranks, n, SIGTERM);
                linger_at = now + grace_ms;
            } else if (linger_stage == 1) {
                signal_all(ranks, n, SIGKILL);
                linger_at = now + 1000;
            } else {
                fprintf(stderr, "kt-launch: the ranks' output is held open outside their "
                        "process groups; not waiting for it\n");
                for (int r = 0; r < n; r++)
                    ranks[r].open[0] = ranks[r].open[1] = 0;
                open_streams = 0;
            }
            linger_stage++;
        }
        guard_forget_finished(ranks, n);
    }
    guard_forget_finished(ranks, n);
    if (ctl >= 0)
        close(ctl); /* the relay writes out what it holds, then exits */
    /* Its last lines before kt-launch's exit, unless nothing reads them: then it finishes
     * on its own (it holds the output, so a pipe's reader still gets everything). */
    for (int64_t until = now_ms() + 2000; relay > 0 && now_ms() < until;) {
        if (waitpid(relay, NULL, WNOHANG) == relay)
            break;
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    free(ranks);
    free(pfd);
    free(pfd_rank);
    return result;
}
