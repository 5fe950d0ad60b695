/* SIGINT and SIGTERM: the step in progress finishes, the loop writes a resumable checkpoint,
 * and kt-train ends by the same signal (exit status 130 or 143 for the shell). The handler
 * only records the signal; a second one while stopping restores the default action and
 * re-raises it, so a user who presses Ctrl-C twice is not kept waiting (every checkpoint is
 * written atomically: a kill mid-save leaves the previous ones as they were). With several
 * ranks each may see the signal at a different step (or only one may, from `kill`): they
 * agree once per step, so that all stop after the same step. */
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "tools/kt-train/trainer.h"

static volatile sig_atomic_t caught;

static void on_signal(int sig)
{
    if (caught != 0) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    caught = sig;
}

void stop_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART; /* a read or write in progress goes on */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int stop_signal(void) { return (int)caught; }

int stop_agree(const ranks *r, int *sig)
{
    int own = stop_signal();
    if (r->comm == NULL) {
        *sig = own;
        return 0;
    }
    /* the signal numbers are small integers: exact in f32, and the largest wins */
    float flags[2] = {own == SIGINT ? 1.0f : 0.0f, own == SIGTERM ? 1.0f : 0.0f};
    if (kt_comm_all_reduce(r->comm, flags, 2, KT_F32, KT_REDUCE_SUM) != KT_OK)
        return train_error("rank %d: cannot agree on stopping: %s", r->rank, kt_last_error());
    *sig = flags[1] > 0 ? SIGTERM : flags[0] > 0 ? SIGINT : 0;
    return 0;
}

void stop_exit(int sig)
{
    fflush(stdout);
    fflush(stderr);
    signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    raise(sig);
    _exit(128 + sig); /* not reached: the default action ends the process */
}
