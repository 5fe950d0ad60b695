/* kt-train's progress display and run records (progress.c, loss_plot.c).
 *
 * On a terminal, one live line redrawn in place (step, loss, held-out loss, tokens/s, elapsed,
 * ETA and a bar); otherwise a plain line every log_every steps. With a run directory, every
 * step is appended to RUN_DIR/metrics.jsonl and, at each evaluation, RUN_DIR/loss.svg (train
 * and held-out curves, axes labelled) is rewritten whole. */
#ifndef KT_TRAIN_PROGRESS_H
#define KT_TRAIN_PROGRESS_H

#include <stdint.h>
#include <stdio.h>

typedef struct progress progress;

typedef struct progress_options {
    FILE *out;                /* stdout; live line only when isatty(fileno(out)) */
    const char *run_dir;      /* NULL: no metrics.jsonl and no loss.svg */
    int64_t first_step;       /* steps already done (a resumed run starts after them) */
    int64_t total_steps;
    int64_t tokens_per_step;  /* over all ranks */
    int64_t log_every;        /* plain lines: every K steps (and the last) */
    int force_plain;          /* 1: plain lines even on a terminal */
} progress_options;

/* Creates RUN_DIR when it is missing. A new run (first_step 0) starts RUN_DIR/metrics.jsonl
 * empty. On a resumed run (first_step > 0) the records of RUN_DIR/metrics.jsonl up to
 * first_step are kept (the curve goes on, elapsed_s continues) and later ones, from steps the
 * checkpoint does not hold, dropped, with a line cut short by a kill (the file is rewritten
 * whole). Returns 0, or 1 after train_error. */
int progress_open(progress **out, const progress_options *o);
/* Step `step` (1-based) finished with this loss, learning rate and gradient norm (< 0 or NaN
 * when unknown). Values that are not finite are null in metrics.jsonl. */
void progress_step(progress *p, int64_t step, double loss, double lr, double grad_norm);
/* A held-out evaluation after step `step`: its mean loss (nats per token); bits_per_byte < 0
 * when unknown. Prints a line, appends to metrics.jsonl and redraws loss.svg. */
void progress_eval(progress *p, int64_t step, double loss, double bits_per_byte);
/* A message line that does not garble the live line ("saved checkpoint step-200"). */
void progress_note(progress *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Ends the live line; redraws loss.svg, flushes and closes the records. 0, or 1 when a record
 * could not be written (said once per file, with the path, through train_error; the run's
 * other record went on). NULL: 0. */
int progress_close(progress *p);

#endif
