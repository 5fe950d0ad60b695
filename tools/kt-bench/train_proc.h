/* kt-bench train's child processes: each side of the comparison (libkt's loop in a fork of
 * kt-bench, PyTorch's peer script in a python) runs in a process of its own, so that the peak
 * RSS wait4 reports for it is that side's alone. */
#ifndef KT_BENCH_TRAIN_PROC_H
#define KT_BENCH_TRAIN_PROC_H

#include <signal.h>
#include <stdint.h>

typedef struct train_proc {
    char result[4096]; /* the last line of its output that starts with '{' ("" when none) */
    char last[512];    /* the last other line: the reason, should it fail */
    char what[64];     /* "exit 0", "exit 77", "killed by signal 9", "no result in 600 s" */
    int exit_code;     /* its exit status; -1 when it did not exit by itself */
    int64_t peak_rss_bytes; /* wait4's ru_maxrss: the process's high-water mark */
} train_proc;

/* fn != NULL: forks and runs fn(ctx) in the child, whose return value is its exit status
 * (stdout and stderr go to the parent, which keeps the lines as above).
 * fn == NULL: runs argv (argv[0] a path, or a name looked up in PATH) the same way.
 * The child is killed after timeout_s seconds (KT_BENCH_PEER_TIMEOUT_S, when set, replaces
 * it). echo: copy the child's non-JSON lines to stderr as they come (progress).
 * Returns 0 when the child exited 0 with a result line, else 1 (out says how). */
int train_proc_run(int (*fn)(void *ctx), void *ctx, char *const *argv, double timeout_s,
                   int echo, train_proc *out);

/* Set (to the signal's number) by the handler train_proc_catch_signals installs for SIGINT,
 * SIGTERM and SIGHUP: a running child is then killed and train_proc_run returns 1, so that the
 * caller can remove what it wrote before it dies of the signal (train_proc_reraise). */
extern volatile sig_atomic_t train_proc_interrupted;
void train_proc_catch_signals(void);
/* Restores the default actions and, when a signal came, dies of it. */
void train_proc_reraise(void);

/* The number after "key": in the result line (key given with its quotes, e.g. "\"step_ms\"");
 * -1 when absent or null. */
double train_proc_value(const train_proc *p, const char *key);

#endif
