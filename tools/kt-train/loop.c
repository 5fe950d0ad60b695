/* The training loop. Each optimizer step: --accum forward/backward passes over consecutive
 * windows (step s reads windows s*N .. s*N+N-1), then the optimizer step, which (with several
 * ranks) first averages the replicated parameters' gradients and the loss over the ranks; the
 * reported loss is the mean over the step's windows. After a step, in this order: the ranks
 * agree whether a signal asked to stop, a held-out evaluation when due, and a checkpoint when
 * due or when stopping. At the end: the last evaluation and the last checkpoint. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <string.h>

#include "tools/kt-train/trainer.h"

/* A failure in the step: alone, what failed where; with several ranks, the root cause that
 * every rank reports (the session has told the others already when it failed itself; a
 * failure here, loading the data, is told now). */
static int step_failed(trainer *t, int64_t step, const char *what)
{
    if (t->r.comm == NULL)
        return train_error("step %lld: %s failed on rank %d: %s", (long long)step + 1, what,
                           t->r.rank, kt_last_error());
    kt_comm_abort(t->r.comm, KT_EINTERNAL);
    return train_error("rank %d stops: %s", t->r.rank, kt_last_error());
}

/* One optimizer step; *loss_out: the mean loss of its windows over every rank. */
static int run_step(trainer *t, const train_args *a, int64_t step, float *loss_out)
{
    double sum = 0.0;
    for (int64_t k = 0; k < a->accum; k++) {
        if (data_load_step(&t->data, step * a->accum + k, &t->r) != 0)
            return step_failed(t, step, "loading the data");
        const char *phase = "forward";
        kt_status st = kt_session_forward(t->s);
        if (st == KT_OK) {
            sum += (double)kt_session_loss(t->s); /* this rank's, before the step averages */
            phase = "backward";
            st = kt_session_backward(t->s);
        }
        if (st != KT_OK)
            return step_failed(t, step, phase);
    }
    if (kt_session_step(t->s) != KT_OK)
        return step_failed(t, step, "optimizer step");
    if (a->accum == 1) { /* the step averaged it over the ranks */
        *loss_out = kt_session_loss(t->s);
        return 0;
    }
    float loss = (float)(sum / (double)a->accum);
    if (t->r.comm != NULL &&
        kt_comm_all_reduce(t->r.comm, &loss, 1, KT_F32, KT_REDUCE_MEAN) != KT_OK)
        return train_error("step %lld: cannot average the loss over the ranks: %s",
                           (long long)step + 1, kt_last_error());
    *loss_out = loss;
    return 0;
}

/* rank 0 writes; every rank learns whether it could */
static int save_checkpoint(trainer *t, const train_args *a, int64_t step, const char *why)
{
    kt_status saved = KT_OK;
    if (t->r.rank == 0 && checkpoint_write(t, a, step, why) != 0)
        saved = KT_EIO;
    if (ranks_agree(&t->r, saved) != KT_OK) {
        /* rank 0's failure as agreed (it printed its own already), or a rank lost */
        if (t->r.comm != NULL)
            train_error("rank %d stops: %s", t->r.rank, kt_last_error());
        return 1;
    }
    return 0;
}

static int evaluate(trainer *t, int64_t step)
{
    double loss;
    if (eval_run(t, &loss) != 0)
        return 1;
    t->last_eval = loss;
    double bytes = data_bytes_per_token(&t->eval);
    if (t->progress != NULL)
        progress_eval(t->progress, step, loss, bytes > 0 ? loss / log(2.0) / bytes : -1.0);
    return 0;
}

/* rank 0: the --losses line and the progress display. The losses are written through the
 * library's writer: the file appears, whole, when the run ends (a killed run leaves any
 * previous file as it was). A failed write is sticky there and reported once, at the end:
 * rank 0 stopping here would leave the other ranks waiting in the next step's collectives. */
static void report_step(trainer *t, int64_t done, float loss)
{
    if (t->losses != NULL)
        kt_out_printf(t->losses, "%.9g\n", (double)loss);
    if (!isfinite(loss))
        progress_note(t->progress, "kt-train: warning: step %lld: the loss is %g",
                      (long long)done, (double)loss);
    progress_step(t->progress, done, (double)loss, (double)kt_session_lr(t->s),
                  (double)kt_session_grad_norm(t->s));
}

int train_loop(trainer *t, const train_args *a, int *stopped_by)
{
    int rc = 0, sig = 0;
    int64_t done = t->first_step, evaluated = -1;
    *stopped_by = 0;
    const progress_options po = {.out = stdout,
                                 .run_dir = t->run_dir,
                                 .first_step = t->first_step,
                                 .total_steps = a->steps,
                                 .tokens_per_step = t->data.window * a->accum,
                                 .log_every = a->log_every};
    kt_status opened = KT_OK;
    if (t->r.rank == 0 && progress_open(&t->progress, &po) != 0)
        opened = KT_EIO;
    if (ranks_agree(&t->r, opened) != KT_OK) {
        if (opened == KT_OK)
            train_error("rank %d: stopping: %s", t->r.rank, kt_last_error());
        progress_close(t->progress);
        t->progress = NULL;
        kt_out_discard(t->losses);
        t->losses = NULL;
        return 1;
    }
    for (int64_t step = t->first_step; step < a->steps && rc == 0 && sig == 0; step++) {
        float loss = NAN;
        if (run_step(t, a, step, &loss) != 0) {
            rc = 1;
            break;
        }
        done = step + 1;
        if (t->r.rank == 0)
            report_step(t, done, loss);
        if (stop_agree(&t->r, &sig) != 0) {
            rc = 1;
            break;
        }
        if (sig == 0 && t->eval.path != NULL && a->eval_every > 0 &&
            done % a->eval_every == 0) {
            rc = evaluate(t, done);
            evaluated = done;
        }
        if (rc == 0 && sig == 0 && t->run_dir != NULL && a->save_every > 0 &&
            done % a->save_every == 0 && done != a->steps)
            rc = save_checkpoint(t, a, done, "periodic");
    }
    if (rc == 0 && sig != 0) {
        *stopped_by = sig;
        if (t->r.rank == 0)
            progress_note(t->progress, "kt-train: %s after step %lld: %s",
                          sig == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)",
                          (long long)done, t->run_dir != NULL
                                               ? "saving a checkpoint to resume from"
                                               : "nothing saved (no --run-dir)");
        if (t->run_dir != NULL)
            rc = save_checkpoint(t, a, done, "stopped by a signal");
    } else if (rc == 0) {
        if (t->eval.path != NULL && evaluated != done)
            rc = evaluate(t, done);
        if (rc == 0 && t->run_dir != NULL)
            rc = save_checkpoint(t, a, done, "end of the run");
    }
    if (progress_close(t->progress) != 0)
        rc = rc != 0 ? rc : 1;
    t->progress = NULL;
    /* the record of the run, also of one that failed part way */
    if (t->losses != NULL && kt_out_commit(t->losses) != KT_OK) {
        fprintf(stderr, "kt-train: cannot write the losses: %s\n", kt_last_error());
        rc = rc != 0 ? rc : 1;
    }
    t->losses = NULL;
    return rc;
}
