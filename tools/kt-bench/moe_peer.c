/* kt-bench's PyTorch peer processes (see moe_peer.h): moe's, attention's. The protocol, one line each way:
 * kt-bench writes "fwd C" or "fwdbwd C" (C: the call's index, for its ids) and the peer
 * answers {"ms": T}; "quit" ends it. Before the first request the peer prints {"ready": ...}
 * once its inputs are loaded. Lines that are not JSON objects (Python's warnings, a
 * traceback) are skipped, the last one kept as the reason should the peer fail. A peer that
 * does not answer in time is killed: the benchmark then goes on without it. */
#define _POSIX_C_SOURCE 200809L
#include "tools/kt-bench/moe_peer.h"
#include "tools/kt-bench/bench.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Loading torch and inputs of a few GB; one call of the largest configurations (PyTorch's f32
 * loop takes seconds at dsv2lite's 1024 tokens). KT_BENCH_PEER_TIMEOUT_S, when set, replaces
 * both (the tests' hanging stand-in). */
#define START_TIMEOUT_S 600
#define CALL_TIMEOUT_S 300
#define QUIT_TIMEOUT_S 10

static double timeout_s(int fallback)
{
    const char *e = getenv("KT_BENCH_PEER_TIMEOUT_S");
    const double v = e != NULL ? atof(e) : 0.0;
    return v > 0 ? v : (double)fallback;
}

struct moe_peer {
    pid_t pid; /* -1 once reaped */
    int to;    /* the peer's stdin */
    int from;  /* its stdout and stderr */
    int failed;
    char label[40]; /* "torch bf16": how notes name it */
    char buf[8192]; /* what has been read from `from` and not yet taken as lines */
    size_t len;
};

/* The next line into line (without its newline): 1, 0 at end of file, -1 past the deadline */
static int read_line(moe_peer *p, double deadline, char *line, size_t size)
{
    for (;;) {
        char *nl = memchr(p->buf, '\n', p->len);
        if (nl != NULL || p->len == sizeof p->buf) { /* a line, or one too long: its start */
            const size_t n = nl ? (size_t)(nl - p->buf) : p->len;
            snprintf(line, size, "%.*s", (int)n, p->buf);
            const size_t used = nl ? n + 1 : n;
            memmove(p->buf, p->buf + used, p->len - used);
            p->len -= used;
            return 1;
        }
        const double left = deadline - bench_now_s();
        if (left <= 0)
            return -1;
        struct pollfd pf = {p->from, POLLIN, 0};
        const int r = poll(&pf, 1, left > 1e6 ? 1000000000 : (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0)
            return -1;
        const ssize_t got = r > 0 ? read(p->from, p->buf + p->len, sizeof p->buf - p->len) : -1;
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) { /* end of file (or an error): a last unterminated line, then 0 */
            if (p->len == 0)
                return 0;
            snprintf(line, size, "%.*s", (int)p->len, p->buf);
            p->len = 0;
            return 1;
        }
        p->len += (size_t)got;
    }
}

/* The next line that starts with '{' into line: 1; 0 at end of file and -1 past the deadline
 * (line: the last other line, or an explanation) */
static int read_object(moe_peer *p, double deadline, char *line, size_t size)
{
    char buf[4096];
    int r;
    snprintf(line, size, "no answer");
    while ((r = read_line(p, deadline, buf, sizeof buf)) == 1) {
        snprintf(line, size, "%s", buf);
        if (buf[0] == '{')
            return 1;
    }
    if (r < 0)
        snprintf(line, size, "no answer in time");
    return r;
}

/* Waits up to wait_s for the process to end, then kills it; "exit N" or "killed by signal
 * N" into what */
static void reap(moe_peer *p, int wait_s, char *what, size_t size)
{
    int status = 0;
    const double deadline = bench_now_s() + wait_s;
    pid_t r;
    while ((r = waitpid(p->pid, &status, WNOHANG)) == 0 && bench_now_s() < deadline) {
        const struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
    }
    if (r == 0) {
        kill(p->pid, SIGKILL);
        while ((r = waitpid(p->pid, &status, 0)) < 0 && errno == EINTR) {
        }
    }
    p->pid = -1;
    if (r < 0)
        snprintf(what, size, "not reaped");
    else if (WIFEXITED(status))
        snprintf(what, size, "exit %d", WEXITSTATUS(status));
    else
        snprintf(what, size, "killed by signal %d", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

static void close_all(moe_peer *p)
{
    if (p->to >= 0)
        close(p->to);
    if (p->from >= 0)
        close(p->from);
    p->to = p->from = -1;
}

/* The peer failed: killed at once (it may be stuck, and nothing more is wanted of it) */
static void fail(moe_peer *p)
{
    char what[64];
    p->failed = 1;
    if (p->pid > 0) {
        kill(p->pid, SIGKILL);
        reap(p, 0, what, sizeof what);
    }
    close_all(p);
}

static int cloexec_pipe(int fd[2])
{
    if (pipe(fd) != 0)
        return -1;
    fcntl(fd[0], F_SETFD, FD_CLOEXEC); /* a second peer must not hold this one's pipes */
    fcntl(fd[1], F_SETFD, FD_CLOEXEC);
    return 0;
}

moe_peer *moe_peer_start(const char *script, const char *inputs, const char *mode,
                         const char *dtype, int threads, int rotate, int64_t shift, char *note,
                         size_t note_size)
{
    char th[16], rot[16], sh[24], label[40];
    snprintf(th, sizeof th, "%d", threads);
    snprintf(rot, sizeof rot, "%d", rotate);
    snprintf(sh, sizeof sh, "%lld", (long long)shift);
    snprintf(label, sizeof label, "torch %s", dtype);
    const char *const args[] = {script, inputs, "--mode", mode, "--dtype", dtype, "--threads",
                                th, "--rotate", rot, "--shift", sh};
    return bench_peer_start("/usr/bin/python3", args, (int)(sizeof args / sizeof args[0]), label,
                            NULL, 0, note, note_size);
}

moe_peer *bench_peer_start(const char *python, const char *const *args, int n_args,
                           const char *label, char *ready, size_t ready_size, char *note,
                           size_t note_size)
{
    moe_peer *p = calloc(1, sizeof *p);
    int in[2] = {-1, -1}, out[2] = {-1, -1};
    /* the child's argv, made before the fork (no allocation after it) */
    char **argv = n_args >= 0 && n_args < 64 ? calloc((size_t)n_args + 2, sizeof *argv) : NULL;
    char failed_msg[600];
    if (p == NULL || argv == NULL || cloexec_pipe(in) != 0 || cloexec_pipe(out) != 0)
        goto cannot_start;
    argv[0] = (char *)python;
    for (int i = 0; i < n_args; i++)
        argv[i + 1] = (char *)args[i];
    const int msg_len = snprintf(failed_msg, sizeof failed_msg, "could not run %.500s\n", python);
    fflush(NULL); /* nothing buffered here is written twice by the child */
    const pid_t pid = fork();
    if (pid == 0) { /* only async-signal-safe calls from here */
        dup2(in[0], 0);
        dup2(out[1], 1);
        dup2(out[1], 2);
        execvp(python, argv);
        (void)!write(1, failed_msg, (size_t)msg_len);
        _exit(127);
    }
    free(argv);
    argv = NULL;
    if (pid < 0)
        goto cannot_start;
    close(in[0]), close(out[1]);
    /* a peer that dies makes our writes fail with EPIPE instead of killing kt-bench */
    signal(SIGPIPE, SIG_IGN);
    p->pid = pid;
    p->to = in[1];
    p->from = out[0];
    snprintf(p->label, sizeof p->label, "%s", label);
    char line[4096];
    const int r = read_object(p, bench_now_s() + timeout_s(START_TIMEOUT_S), line, sizeof line);
    if (r == 1 && strstr(line, "\"ready\"") != NULL) {
        if (ready != NULL && ready_size > 0)
            snprintf(ready, ready_size, "%s", line);
        return p;
    }
    char what[64];
    if (r < 0)
        kill(p->pid, SIGKILL);
    close_all(p);
    reap(p, QUIT_TIMEOUT_S, what, sizeof what);
    snprintf(note, note_size, "%s peer did not run (%s): %.200s", label, what, line);
    free(p);
    return NULL;

cannot_start: /* no process: the pipes made so far closed */
    for (int i = 0; i < 2; i++) {
        if (in[i] >= 0)
            close(in[i]);
        if (out[i] >= 0)
            close(out[i]);
    }
    free(p);
    free(argv);
    snprintf(note, note_size, "could not start the %s peer", label);
    return NULL;
}

double moe_peer_call(moe_peer *p, int backward, int call, char *note, size_t note_size)
{
    if (p == NULL || p->failed)
        return -1.0;
    char req[32], line[4096];
    const int n = snprintf(req, sizeof req, "%s %d\n", backward ? "fwdbwd" : "fwd", call);
    const int sent = write(p->to, req, (size_t)n) == n;
    /* even when the request could not be written, what the peer said last (a traceback) */
    const int r = read_object(p, bench_now_s() + timeout_s(CALL_TIMEOUT_S), line, sizeof line);
    const char *ms = sent && r == 1 ? strstr(line, "\"ms\":") : NULL;
    const double v = ms != NULL ? atof(ms + 5) : -1.0;
    if (v > 0)
        return v;
    snprintf(note, note_size, "%s peer failed on a %s call: %.200s", p->label,
             backward ? "fwd+bwd" : "fwd", line);
    fail(p);
    return -1.0;
}

int moe_peer_failed(const moe_peer *p) { return p == NULL || p->failed; }

void moe_peer_gap(void)
{
    const struct timespec ts = {0, MOE_PEER_GAP_MS * 1000000L};
    nanosleep(&ts, NULL);
}

void moe_peer_stop(moe_peer *p)
{
    if (p == NULL)
        return;
    if (!p->failed) {
        static const char quit[] = "quit\n";
        (void)!write(p->to, quit, sizeof quit - 1);
        close_all(p);
        char what[64];
        reap(p, QUIT_TIMEOUT_S, what, sizeof what);
    }
    free(p);
}
