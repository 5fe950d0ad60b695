/* kt-launch's guard (launch.h). */
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

void guard_start(int n)
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

void guard_send(pid_t msg)
{
    if (guard_fd >= 0 && write(guard_fd, &msg, sizeof msg) != (ssize_t)sizeof msg) {
        close(guard_fd); /* the guard is gone (it never exits first): nothing left to tell */
        guard_fd = -1;
    }
}

void guard_forget_finished(rank_proc *ranks, int n)
{
    for (int r = 0; r < n; r++)
        if (ranks[r].guarded && !group_alive(&ranks[r])) {
            guard_send(-ranks[r].pid);
            ranks[r].guarded = 0;
        }
}

int guard_pipe_fd(void) { return guard_fd; }
