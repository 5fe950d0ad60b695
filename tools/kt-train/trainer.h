/* kt-train: the trainer as a whole (main.c sets it up, loop.c runs it), and the parts that
 * need all of it: the program, evaluation, checkpoints, resume and the stop signals. */
#ifndef KT_TRAINER_H
#define KT_TRAINER_H

#include "tools/kt-train/flat_json.h"
#include "tools/kt-train/progress.h"
#include "tools/kt-train/train.h"

/* train_args.set_flags: options given on the command line (contradictions are checked
 * against them, not against their defaults) */
enum {
    TRAIN_SET_BETAS = 1,
    TRAIN_SET_MOMENTUM = 2,
    TRAIN_SET_MIN_LR = 4,
    TRAIN_SET_KEEP = 8,
    TRAIN_SET_EVAL = 16,   /* --eval-every or --eval-windows */
    TRAIN_SET_STEPS = 32,
    TRAIN_SET_PROGRAM = 64 /* a program file on the command line */
};

/* What --resume found: the checkpoint's directory and the numbers to go on from. */
typedef struct resume_point {
    char dir[4096];     /* the step directory */
    char session[4200]; /* its session.safetensors */
    char program[4200]; /* its program.ktp */
    char run_dir[4096]; /* where the run goes on writing checkpoints (without --run-dir) */
    int64_t step;
    int64_t windows;    /* training windows consumed */
    uint64_t session_bytes, session_hash;
} resume_point;

typedef struct trainer {
    ranks r;
    kt_program *p;
    void *program_bytes; /* the program serialised (what each checkpoint's program.ktp holds) */
    size_t program_size;
    uint64_t program_hash;
    kt_threadpool *pool;
    kt_moe_layers moe;
    kt_session *s;
    token_data data;
    token_data eval;       /* --eval-data; eval.path NULL without */
    int64_t eval_windows;  /* held-out windows each evaluation reads */
    double baseline_nats;  /* the unigram baseline on them; < 0 unknown */
    kt_out_file *losses;   /* rank 0's --losses file, opened before the first step */
    const char *run_dir;   /* --run-dir, or the resumed one; NULL: no checkpoints */
    int run_dir_lock;      /* rank 0's lock on it (-1: none) */
    int resumed;
    int saved_since_resume; /* a checkpoint written since (the later ones are then gone) */
    resume_point from;
    int64_t first_step;    /* steps done before this run (a resumed one's) */
    double last_eval;      /* the last held-out loss (NAN: none yet) */
    progress *progress;    /* rank 0's display and records while the loop runs (else NULL) */
} trainer;

/* ---- program.c --------------------------------------------------------------------------- */

/* Loads a->program (.ktp), or compiles it in-process when it is a .ktg (with a->defines), and
 * serialises it (t->program_bytes, program_hash). */
int program_open(trainer *t, const train_args *a);
/* 64-bit FNV-1a (the hashes of the program, the data and the checkpoint's files) */
uint64_t hash_bytes(uint64_t h, const void *data, size_t n);
#define HASH_START 0xcbf29ce484222325ull

/* ---- eval.c ------------------------------------------------------------------------------ */

/* Opens --eval-data, binds it, and measures the unigram baseline of the training file on it. */
int eval_open(trainer *t, const train_args *a);
/* The mean held-out loss (nats per window, over t->eval_windows windows; forward only, every
 * rank joins). Leaves the training exactly as it was: it runs between optimizer steps, and the
 * MoE layers' forward caches are cleared after it. */
int eval_run(trainer *t, double *loss_out);
/* "loss 2.1234 (perplexity 8.36, 1.23 bits/byte)" into buf */
void eval_describe(const trainer *t, double nats, char *buf, size_t size);

/* ---- run_dir.c --------------------------------------------------------------------------- */

/* Rank 0: creates the run directory when absent, locks it (one run at a time) and removes the
 * temporaries a killed save left. */
int run_dir_open(trainer *t);
void run_dir_close(trainer *t);
/* Rank 0: writes DIR/step-NNNNNNNN (the session with its optimizer state, the program and
 * run.json) through a temporary sibling, synced, then renamed; then removes the checkpoints
 * beyond --keep. 0, or 1 after train_error (the older checkpoints are left as they were). */
int checkpoint_write(trainer *t, const train_args *a, int64_t step, const char *why);
/* How many checkpoints of the run directory are after `step` (a resume from an earlier one
 * replaces them as it goes: the first checkpoint it writes removes them). */
int run_dir_later_checkpoints(const trainer *t, int64_t step);
/* Finds the checkpoint --resume names (a step directory, or a run directory's latest
 * complete one) and checks its run.json against this run's settings. */
int checkpoint_find(const char *path, resume_point *out);
/* The size and FNV-1a hash of a file's bytes as they are on disk; 0, or -1 with errno. */
int checkpoint_hash_file(const char *path, uint64_t *bytes, uint64_t *hash);

/* ---- resume.c ---------------------------------------------------------------------------- */

/* Appends run.json's text for this run at `step` to f. */
void resume_write_json(const trainer *t, const train_args *a, int64_t step, uint64_t session_bytes,
                       uint64_t session_hash, kt_out_file *f);
/* Reads from->dir/run.json into from (step, windows, the session file's size and hash) and
 * compares the settings with this run's: a difference that changes the numbers is refused,
 * naming it; one that changes only the rounding (threads, ranks) is a warning. */
int resume_check(trainer *t, const train_args *a, resume_point *from);
/* The checkpoint --resume names (a step or run directory), its run.json read into *settings
 * ("settings.lr", ...): what a resume takes for the options not given again. 0, or 1 after
 * train_error. */
int resume_read_settings(const char *resume, flat_json *settings);
/* Checks the session file against run.json (size, hash), then loads it with its optimizer
 * state into the session. */
int resume_load(trainer *t);
/* A hash of the settings a resume must match (the ranks compare it before the first step). */
uint64_t resume_settings_hash(const trainer *t, const train_args *a);

/* ---- stop.c ------------------------------------------------------------------------------ */

/* Catches SIGINT and SIGTERM: the first asks the loop to stop after the current step; a
 * second while stopping ends the process at once (the checkpoints are atomic). */
void stop_install(void);
/* The signal that asked to stop, or 0. */
int stop_signal(void);
/* Every rank learns whether any rank was asked to stop (once per step); sets *sig. */
int stop_agree(const ranks *r, int *sig);
/* Ends the process by the signal that stopped it (128 + signal for the shell). */
void stop_exit(int sig);

/* ---- loop.c ------------------------------------------------------------------------------ */

/* Steps t->first_step .. a->steps: accumulation, the optimizer step, evaluations, periodic
 * checkpoints. *stopped_by: the signal that stopped it early (0: ran to the end). */
int train_loop(trainer *t, const train_args *a, int *stopped_by);

#endif
