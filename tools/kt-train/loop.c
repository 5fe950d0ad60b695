/* The training loop. Each step: this rank's slice of the window into the inputs, forward,
 * backward, and the optimizer step, which (with several ranks) first averages the replicated
 * parameters' gradients and the loss over the ranks. So the loss read after the step is the
 * loss of the whole window on every rank, and rank 0 reports it. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include "tools/kt-train/train.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One step; prints what failed and where. */
static int run_step(kt_session *s, token_data *d, int64_t step, const ranks *r)
{
    static const char *const phase[3] = {"forward", "backward", "optimizer step"};
    if (data_load_step(d, step, r) != 0)
        return 1;
    for (int k = 0; k < 3; k++) {
        kt_status st = k == 0 ? kt_session_forward(s)
                     : k == 1 ? kt_session_backward(s)
                              : kt_session_step(s);
        if (st != KT_OK) {
            train_error("step %lld: %s failed on rank %d: %s",
                        (long long)step + 1, phase[k], r->rank, kt_last_error());
            return 1;
        }
    }
    return 0;
}

/* The losses are written through the library's writer: the file appears, whole, when the run
 * ends (a killed run leaves any previous file as it was). A failed write is sticky there and
 * reported once, at the end: rank 0 stopping here would leave the other ranks waiting in the
 * next step's collectives. */
static void log_loss(kt_out_file *losses, float loss)
{
    if (losses != NULL)
        kt_out_printf(losses, "%.9g\n", (double)loss);
}

int train_loop(const train_args *a, kt_session *s, token_data *d, const ranks *r,
               kt_out_file *losses)
{
    int rc = 0;
    double since = now_s();
    int64_t logged = 0; /* steps since the last progress line */
    for (int64_t step = 0; step < a->steps && rc == 0; step++) {
        if (run_step(s, d, step, r) != 0) {
            rc = 1;
            break;
        }
        float loss = kt_session_loss(s);
        logged++;
        if (r->rank != 0)
            continue;
        log_loss(losses, loss);
        if (!isfinite(loss))
            fprintf(stderr, "kt-train: warning: step %lld: the loss is %g\n",
                    (long long)step + 1, (double)loss);
        if ((step + 1) % a->log_every == 0 || step + 1 == a->steps) {
            double dt = (now_s() - since) / (double)logged; /* per step */
            printf("step %lld/%lld loss %.4f (%.*f ms, %.0f tokens/s)\n", (long long)step + 1,
                   (long long)a->steps, (double)loss, dt < 0.01 ? 2 : 0, dt * 1e3,
                   (double)d->window / dt);
            fflush(stdout);
            since = now_s();
            logged = 0;
        }
    }
    /* the record of the run, also of one that failed part way */
    if (losses != NULL && kt_out_commit(losses) != KT_OK) {
        fprintf(stderr, "kt-train: cannot write the losses: %s\n", kt_last_error());
        rc = rc != 0 ? rc : 1;
    }
    return rc;
}
