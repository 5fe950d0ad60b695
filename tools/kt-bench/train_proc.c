/* kt-bench train's child processes (train_proc.h). */
#define _DEFAULT_SOURCE
#include "tools/kt-bench/train_proc.h"
#include "tools/kt-bench/bench.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

volatile sig_atomic_t train_proc_interrupted;

static void on_signal(int sig) { train_proc_interrupted = sig; }

static const int caught[] = {SIGINT, SIGTERM, SIGHUP};

void train_proc_catch_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: poll returns EINTR */
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof caught / sizeof caught[0]; i++)
        sigaction(caught[i], &sa, NULL);
}

void train_proc_reraise(void)
{
    for (size_t i = 0; i < sizeof caught / sizeof caught[0]; i++)
        signal(caught[i], SIG_DFL);
    if (train_proc_interrupted)
        raise(train_proc_interrupted);
}

static double effective_timeout(double fallback)
{
    const char *e = getenv("KT_BENCH_PEER_TIMEOUT_S");
    const double v = e != NULL ? atof(e) : 0.0;
    return v > 0 ? v : fallback;
}

/* One complete line of the child's output: kept as the result or as the last other line. */
static void take_line(train_proc *out, const char *line, int echo)
{
    if (line[0] == '{') {
        snprintf(out->result, sizeof out->result, "%.4000s", line);
    } else if (line[0] != '\0') {
        snprintf(out->last, sizeof out->last, "%.500s", line);
        if (echo)
            fprintf(stderr, "  | %s\n", line);
    }
}

/* Reads the child's output until end of file or the deadline; 1 when the deadline passed. */
static int drain(int fd, double deadline, int echo, train_proc *out)
{
    char buf[8192];
    size_t len = 0;
    for (;;) {
        const double left = deadline - bench_now_s();
        if (left <= 0 || train_proc_interrupted)
            return 1;
        struct pollfd pf = {fd, POLLIN, 0};
        const int r = poll(&pf, 1, left > 1e6 ? 1000000000 : (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0)
            return 1;
        const ssize_t got = read(fd, buf + len, sizeof buf - 1 - len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) { /* end of file: the last, unterminated line */
            buf[len] = '\0';
            take_line(out, buf, echo);
            return 0;
        }
        len += (size_t)got;
        char *start = buf, *nl;
        while ((nl = memchr(start, '\n', len - (size_t)(start - buf))) != NULL) {
            *nl = '\0';
            take_line(out, start, echo);
            start = nl + 1;
        }
        len -= (size_t)(start - buf);
        memmove(buf, start, len);
        if (len == sizeof buf - 1) { /* a line too long to keep: its start */
            buf[len] = '\0';
            take_line(out, buf, echo);
            len = 0;
        }
    }
}

int train_proc_run(int (*fn)(void *ctx), void *ctx, char *const *argv, double timeout_s,
                   int echo, train_proc *out)
{
    memset(out, 0, sizeof *out);
    out->exit_code = -1;
    out->peak_rss_bytes = -1;
    int fd[2];
    if (pipe(fd) != 0) {
        snprintf(out->what, sizeof out->what, "no pipe");
        return 1;
    }
    char failed_msg[600];
    const int msg_len = snprintf(failed_msg, sizeof failed_msg, "could not run %.500s\n",
                                 argv != NULL ? argv[0] : "?");
    fflush(NULL); /* nothing buffered here is written twice by the child */
    const pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[1]);
        if (fn != NULL) {
            const int rc = fn(ctx);
            fflush(NULL);
            _exit(rc);
        }
        execvp(argv[0], argv);
        (void)!write(1, failed_msg, (size_t)msg_len);
        _exit(127);
    }
    close(fd[1]);
    if (pid < 0) {
        close(fd[0]);
        snprintf(out->what, sizeof out->what, "could not fork");
        return 1;
    }
    const double limit = effective_timeout(timeout_s);
    const int late = drain(fd[0], bench_now_s() + limit, echo, out);
    close(fd[0]);
    if (late)
        kill(pid, SIGKILL);
    int status = 0;
    struct rusage ru;
    pid_t r;
    while ((r = wait4(pid, &status, 0, &ru)) < 0 && errno == EINTR) {
    }
    if (r == pid)
        out->peak_rss_bytes = (int64_t)ru.ru_maxrss * 1024; /* Linux: kilobytes */
    if (late && train_proc_interrupted)
        snprintf(out->what, sizeof out->what, "interrupted by signal %d",
                 (int)train_proc_interrupted);
    else if (late)
        snprintf(out->what, sizeof out->what, "no result in %.0f s", limit);
    else if (r == pid && WIFEXITED(status))
        snprintf(out->what, sizeof out->what, "exit %d", out->exit_code = WEXITSTATUS(status));
    else
        snprintf(out->what, sizeof out->what, "killed by signal %d",
                 r == pid && WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    return out->exit_code == 0 && out->result[0] == '{' ? 0 : 1;
}

double train_proc_value(const train_proc *p, const char *key)
{
    const char *k = strstr(p->result, key);
    if (k == NULL)
        return -1;
    k += strlen(key);
    while (*k == ' ' || *k == ':')
        k++;
    char *end;
    const double v = strtod(k, &end);
    return end == k ? -1 : v;
}
