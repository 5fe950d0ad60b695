/* kt-train: the parts of the trainer, one file per job.
 *
 *   main.c       options, setup, exit codes
 *   ranks.c      the communicator from the launcher's environment (or one rank)
 *   data.c       the token file and the per-rank slices of each step's window
 *   prepared.c   kt-data's prepared files (tokens, loss mask, documents): their header
 *   moe_setup.c  the CPU MoE layers the program's moe ops run: created, initialised, saved
 *   loop.c       the training loop: accumulation, step, evaluation, checkpoints, progress
 *   program.c    the program: a .ktp, or a .ktg compiled in-process with -D overrides
 *   eval.c       the held-out loss and the unigram baseline
 *   run_dir.c    the run directory's checkpoints: written atomically, listed, pruned, read
 *   resume.c     a run's settings in its checkpoint, compared on --resume
 *   stop.c       SIGINT and SIGTERM: finish the step, checkpoint, exit 128+signal
 *
 * Every function that can fail prints one line "kt-train: ..." naming what and where
 * (train_error in errors.c, which also records it for the other ranks), and returns nonzero; main turns
 * that into exit status 1. */
#ifndef KT_TRAIN_H
#define KT_TRAIN_H

#include <stdint.h>
#include <stdio.h>

#include "kt/kt.h"

typedef struct train_args {
    const char *program, *data, *params, *experts, *save, *losses;
    const char *tokens_input, *targets_input; /* program input names */
    const char *labels_input; /* gets the tokens unshifted (the program shifts them) */
    int tokens_input_set;     /* --input-tokens given: no input_ids fallback */
    int allow_cross_document; /* packed documents fed to a program without segments */
    int token_bytes;                          /* --data-format: 1 (u8), 2 (u16), 4 (i32) */
    int64_t data_header;                      /* bytes skipped at the start of the file */
    int64_t steps, log_every;
    float lr;                                 /* < 0: the optimizer's default */
    kt_optimizer_kind optimizer;
    uint64_t seed;
    int64_t moe_inter;                        /* 0: the program's, else 2 * H */
    kt_dtype moe_dtype;
    kt_moe_quant moe_quant;                   /* --moe-dtype int8 / int4 (moe_dtype bf16) */
    int moe_group;                            /* --moe-group: int4's inputs per scale */
    kt_moe_mode moe_mode;
    kt_moe_parallel_choice moe_parallel;      /* --moe-parallel; 0: each moe op's `parallel` */
    int64_t lora_rank;                        /* --moe-mode lora: r (default 8) */
    float lora_alpha;                         /* ... and alpha (default 16) */
    int threads;                              /* 0: KT_NUM_THREADS or the CPU count */
    /* the optimizer and its schedule (trainer.h: what the trainer package adds) */
    float weight_decay, beta1, beta2, momentum, min_lr, clip;
    kt_lr_schedule_kind schedule;
    int64_t warmup, accum;
    /* a .ktg model: its -D overrides */
    kt_ktg_define defines[64];
    int n_defines;
    /* held-out evaluation */
    const char *eval_data;
    int64_t eval_every, eval_windows;         /* 0: only at the end; 0: every whole window */
    /* the run directory and resume */
    const char *run_dir, *resume;
    int64_t save_every, keep;                 /* 0: only at the end */
    int set_flags;                            /* TRAIN_SET_*: options given on the command line */
} train_args;

/* Prints "kt-train: <message>" and records it as the last error (so that the other ranks
 * learn it through ranks_agree); returns 1. */
int train_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* train_error("<what>: <detail>"), or "<what>" without a detail */
int train_fail(const char *what, const char *detail);
/* How many messages train_error has printed in this process (errors.c). */
int train_errors_reported(void);

/* ---- ranks.c ----------------------------------------------------------------------------- */

typedef struct ranks {
    kt_comm *comm; /* NULL with one rank */
    int rank, world;
} ranks;

/* Joins the other ranks when the environment names a world of more than one (kt-launch,
 * torchrun, mpirun, srun); otherwise one rank without a communicator. */
int ranks_open(ranks *r);
void ranks_close(ranks *r);
/* Every rank learns whether any rank failed (local != KT_OK), with the lowest failing rank's
 * message in kt_last_error(); a no-op with one rank. */
kt_status ranks_agree(const ranks *r, kt_status local);

/* ---- data.c ------------------------------------------------------------------------------ */

/* What a program input gets from each window (docs/training.md, "Preparing data"). */
typedef enum feed_kind {
    FEED_TOKENS,   /* the window's tokens */
    FEED_TARGETS,  /* the next tokens; -100 where the next token does not count or starts a
                      document */
    FEED_LABELS,   /* the tokens unshifted (the program shifts them); -100 where the token
                      does not count or starts a document */
    FEED_SEGMENTS, /* per row of the input, 0 and one more at each document start */
    FEED_POSITIONS /* each token's position in its row of the input (rope's positions) */
} feed_kind;

typedef struct feed {
    const char *name; /* the program input */
    feed_kind kind;
    int shard_dim;    /* -1: the whole window */
    int balanced;     /* the shard dim holds chunks r and 2W-1-r of 2W (cp_attention's
                         balanced layout), else the contiguous slice r of W */
    kt_tensor view;   /* the session's input tensor (this rank's part) */
    int64_t global[KT_MAX_DIMS]; /* the input's shape over all ranks */
} feed;

typedef struct token_data {
    const char *path;
    FILE *file;
    int token_bytes;
    int64_t header, n_tokens; /* header: the file offset of the first token */
    uint64_t content_hash; /* of every id in the file, and a prepared file's mask and
                              documents (the ranks compare it) */
    int64_t window;   /* tokens per step over all ranks (T) */
    int64_t bound;    /* token ids must be in [0, bound); -1: no check here */
    int64_t *buf;     /* window + 1 tokens */
    feed feeds[5];
    int n_feeds;
    /* a prepared file (kt-data's kt-tokens-1); a flat file is one document, all counted */
    int prepared;
    int64_t mask_offset, doc_offset; /* file offsets of loss_mask (u8) and doc_index (i32) */
    int64_t vocab, source_bytes;     /* kt.vocab, kt.bytes (0: not given) */
    int64_t n_docs;
    unsigned char *mask, *starts;    /* window + 1: the loss mask, 1 where a document starts */
    int64_t *docs, *values;          /* window + 2 document indices (from the token before
                                        the window on), window values for one input */
} token_data;

/* Finds the program's token inputs and checks the file at `path` (the --data file, or the
 * held-out --eval-data one) against them, every id included: before any memory is
 * committed. */
int data_open(token_data *d, const char *path, const train_args *a, const kt_program *p,
              const ranks *r);
/* Points the inputs at the session's tensors. */
int data_bind(token_data *d, kt_session *s);
/* Writes step `step`'s window (tokens and targets) into the session's inputs: this rank's
 * slice along each input's shard dimension. */
int data_load_step(token_data *d, int64_t step, const ranks *r);
void data_close(token_data *d);
/* Whole windows the file holds without wrapping around: the held-out evaluation reads windows
 * 0 .. data_windows() - 1 (data_load_step with those indices). */
int64_t data_windows(const token_data *d);
/* The source bytes one token stands for (1 for bytes; a tokenizer's from the prepared file;
 * 0 when unknown), for bits per byte. */
double data_bytes_per_token(const token_data *d);
/* The unigram baseline: the mean cross-entropy (nats per predicted token) on `heldout`'s
 * windows of the token frequencies counted over `train`'s file (add-one smoothed over the
 * vocabulary bound, or over the ids seen when the program gives none). */
int data_unigram_loss(token_data *train, token_data *heldout, double *nats_out);

/* ---- prepared.c: kt-data's files ------------------------------------------------------------ */

/* Whether the file of `size` bytes starts as a safetensors file (then it must be a prepared
 * one: data_open does not read it as flat tokens). */
int prepared_detect(FILE *f, int64_t size, int *is_prepared);
/* Reads d->path's metadata and tensor descriptions (kt_st_open) into d: n_tokens, the
 * offsets, kt.vocab (checked against d->bound) and kt.bytes; refuses a file that is not
 * kt-tokens-1, a tensor missing or of the wrong dtype, a mask of the wrong length. */
int prepared_open(token_data *d);

/* ---- moe_setup.c ------------------------------------------------------------------------- */

/* Creates a layer for each moe op of the program (kt_moe_layers_create; on rank 0 only when
 * there are several ranks: rank 0 owns the experts), initialised from the seed, or loaded
 * from --experts. */
int moe_setup(kt_moe_layers *m, const train_args *a, const kt_program *p, const ranks *r,
              kt_threadpool *pool);
/* The bytes the layers moe_setup creates on this rank will hold (kt_moe_memory_need), with
 * `states` optimizer values per trained value. */
int moe_memory_need(const train_args *a, const kt_program *p, const ranks *r, int states,
                    uint64_t *bytes_out);
/* The configuration of the first layer this rank holds, for the summary line (NULL: none). */
const kt_moe_config *moe_first_config(const kt_moe_layers *m);
/* The expert stores' bytes this rank holds, and what they would be in the weight dtype. */
void moe_store_bytes(const kt_moe_layers *m, uint64_t *held, uint64_t *raw);

/* ---- loop.c ------------------------------------------------------------------------------ */

/* The training loop is trainer.h's train_loop (it needs the whole trainer). */

#endif
