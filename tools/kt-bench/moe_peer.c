/* kt-bench moe's PyTorch peer process (see moe_peer.h). The protocol, one line each way:
 * kt-bench writes "fwd C" or "fwdbwd C" (C: the call's index, for its ids) and the peer
 * answers {"ms": T}; "quit" ends it. Before the first request the peer prints {"ready": ...}
 * once its inputs are loaded. Lines that are not JSON objects (Python's warnings, a
 * traceback) are skipped, the last one kept as the reason should the peer fail. */
#define _POSIX_C_SOURCE 200809L
#include "moe_peer.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct moe_peer {
    pid_t pid;
    FILE *to;   /* the peer's stdin */
    FILE *from; /* its stdout and stderr */
    int failed;
    char dtype[8];
};

/* The next line that starts with '{' into line; 0 at end of file (the last other line, or
 * nothing, in line then). */
static int read_object(moe_peer *p, char *line, size_t size)
{
    char buf[4096];
    line[0] = '\0';
    while (fgets(buf, sizeof buf, p->from) != NULL) {
        buf[strcspn(buf, "\n")] = '\0';
        snprintf(line, size, "%s", buf);
        if (buf[0] == '{')
            return 1;
    }
    return 0;
}

/* Closes the pipes and reaps the process; its exit status (-1: not an exit) */
static int finish(moe_peer *p)
{
    if (p->to != NULL)
        fclose(p->to);
    if (p->from != NULL)
        fclose(p->from);
    int status = 0;
    pid_t r;
    while ((r = waitpid(p->pid, &status, 0)) < 0 && errno == EINTR) {
    }
    free(p);
    if (r < 0)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

moe_peer *moe_peer_start(const char *script, const char *inputs, const char *mode,
                         const char *dtype, int threads, int rotate, int64_t shift, char *note,
                         size_t note_size)
{
    int in[2], out[2];
    if (pipe(in) != 0)
        goto no_process;
    if (pipe(out) != 0) {
        close(in[0]), close(in[1]);
        goto no_process;
    }
    char th[16], rot[16], sh[24];
    snprintf(th, sizeof th, "%d", threads);
    snprintf(rot, sizeof rot, "%d", rotate);
    snprintf(sh, sizeof sh, "%lld", (long long)shift);
    fflush(NULL); /* nothing buffered here is written twice by the child */
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        dup2(out[1], 2);
        close(in[0]), close(in[1]), close(out[0]), close(out[1]);
        execl("/usr/bin/python3", "python3", script, inputs, "--serve", "--mode", mode, "--dtype",
              dtype, "--threads", th, "--rotate", rot, "--shift", sh, (char *)NULL);
        printf("could not run /usr/bin/python3\n");
        _exit(127);
    }
    close(in[0]), close(out[1]);
    if (pid < 0) {
        close(in[1]), close(out[0]);
        goto no_process;
    }
    /* a peer that dies makes our writes fail with EPIPE instead of killing kt-bench */
    signal(SIGPIPE, SIG_IGN);
    moe_peer *p = calloc(1, sizeof *p);
    FILE *to = fdopen(in[1], "w"), *from = fdopen(out[0], "r");
    if (p == NULL || to == NULL || from == NULL) {
        if (to != NULL)
            fclose(to);
        else
            close(in[1]);
        if (from != NULL)
            fclose(from);
        else
            close(out[0]);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        free(p);
        snprintf(note, note_size, "out of memory starting the torch %s peer", dtype);
        return NULL;
    }
    *p = (moe_peer){pid, to, from, 0, ""};
    snprintf(p->dtype, sizeof p->dtype, "%s", dtype);
    char line[4096];
    if (read_object(p, line, sizeof line) && strstr(line, "\"ready\"") != NULL)
        return p;
    const int rc = finish(p);
    snprintf(note, note_size, "torch %s peer did not run (exit %d): %.200s", dtype, rc, line);
    return NULL;

no_process:
    snprintf(note, note_size, "could not start the torch %s peer", dtype);
    return NULL;
}

void moe_peer_gap(void)
{
    const struct timespec ts = {0, MOE_PEER_GAP_MS * 1000000L};
    nanosleep(&ts, NULL);
}

double moe_peer_call(moe_peer *p, int backward, int call, char *note, size_t note_size)
{
    if (p == NULL || p->failed)
        return -1.0;
    char line[4096] = "";
    const char *ms = NULL;
    if (fprintf(p->to, "%s %d\n", backward ? "fwdbwd" : "fwd", call) > 0 && fflush(p->to) == 0 &&
        read_object(p, line, sizeof line))
        ms = strstr(line, "\"ms\":");
    const double v = ms != NULL ? atof(ms + 5) : -1.0;
    if (v > 0)
        return v;
    p->failed = 1;
    snprintf(note, note_size, "torch %s peer failed on a %s call: %.200s", p->dtype,
             backward ? "fwd+bwd" : "fwd", line[0] ? line : "no answer");
    return -1.0;
}

void moe_peer_stop(moe_peer *p)
{
    if (p == NULL)
        return;
    if (!p->failed) {
        fprintf(p->to, "quit\n");
        fflush(p->to);
    } else {
        kill(p->pid, SIGKILL); /* it may be stuck: nothing more is wanted of it */
    }
    (void)finish(p);
}
