/* kt-launch's output relay (launch.h). */
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
#include <sys/prctl.h>

#include "tools/kt-launch/launch.h"

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

pid_t relay_start(rank_proc *ranks, int n, const int *close_in_child, int n_close,
                  int *ctl_out)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        for (int i = 0; i < n_close; i++)
            if (close_in_child[i] >= 0)
                close(close_in_child[i]);
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
