/* kt-generate's parts: the decode session with its key/value cache (decoder.c), the sampler
 * (sample.c), and prompts in and tokens out (text.c). Functions that can fail print one
 * "kt-generate: ..." line and return nonzero (1: an error, 2: a usage error). */
#ifndef KT_GENERATE_H
#define KT_GENERATE_H

#include <stdint.h>
#include <stdio.h>

#include "kt/kt.h"

#define GEN_TOOL "kt-generate"
#define GEN_MAX_DEFINES 64

int gen_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- the decode sessions (stage.c, decoder.c) ------------------------------------------------
 * A decode program takes NEW tokens a step (its .ktg `const NEW`): inputs tokens [1,NEW],
 * positions [1,NEW], segments [1,C] and per layer l the cache past_k<l>, past_v<l>
 * [1,C-NEW,HKV,D]; outputs logits [NEW,VOCAB] and the new tokens' k<l>, v<l> [1,NEW,HKV,D].
 * The decoder steps with NEW = 1 and, given a .ktg, runs a prompt of P tokens through a
 * second compilation with NEW = P-1 first (the prefill), whose keys and values start the cache.
 * segments: 0 for a filled slot and the new tokens', 1 for an empty one. */

typedef struct gen_cache_layer {
    kt_tensor past_k, past_v; /* session inputs: the cache itself */
    kt_tensor k, v;           /* session outputs: the new tokens' */
} gen_cache_layer;

/* One compiled program in its session, its inputs and outputs found and checked. */
typedef struct gen_stage {
    kt_program *program;
    kt_session *session;
    kt_tensor tokens, positions, segments, logits;
    gen_cache_layer *layers;
    int n_layers;
    int64_t context; /* C */
    int64_t n_new;   /* NEW: tokens a step */
    int64_t vocab;   /* the logits' width */
    kt_trace_event *trace;
    size_t n_trace; /* events recorded, once the session is gone */
} gen_stage;

/* The session for s->program (loaded by the caller), bound to the MoE layers, with the
 * checkpoint loaded and the interface checked; trace_forwards: record the steps of that many
 * forwards (0: none). */
int gen_stage_open(gen_stage *s, const kt_moe_layers *moe, kt_threadpool *pool,
                   const char *params, int threads, int64_t trace_forwards);
void gen_stage_close(gen_stage *s);
void gen_stage_set_index(kt_tensor *t, int64_t i, int64_t v);

typedef struct gen_decoder {
    gen_stage step;    /* NEW = 1 */
    gen_stage prefill; /* NEW = P-1 (program NULL: none, or done) */
    kt_threadpool *pool;
    kt_moe_layers moe;
    int64_t context; /* C: tokens a generation may feed */
    int64_t vocab;   /* every id fed must be below it */
    int64_t filled;  /* tokens fed so far (the next one's position) */
} gen_decoder;

typedef struct gen_decoder_options {
    const char *program; /* .ktp, or .ktg compiled here with the defines */
    const kt_ktg_define *defines;
    int n_defines;
    const char *params;  /* the checkpoint: parameters and experts */
    int threads;
    int trace;           /* record the forwards' steps (gen_decoder_write_trace) */
    int64_t prompt;      /* the prompt's length: a .ktg prefills all but its last token */
} gen_decoder_options;

int gen_decoder_open(gen_decoder *d, const gen_decoder_options *o);
/* Feeds the prompt but its last token (ids[0..NEW), NEW the prefill's) in one forward, then
 * row(ctx, token, its logits) for each of them. A no-op without a prefill program. */
int gen_decoder_prefill(gen_decoder *d, const int64_t *ids,
                        int (*row)(void *ctx, int64_t token, const float *logits), void *ctx);
/* Feeds token at position d->filled; *logits_out: the next token's logits (valid until the
 * next step). Refused once the context is full. */
int gen_decoder_step(gen_decoder *d, int64_t token, const float **logits_out);
void gen_decoder_close(gen_decoder *d);
/* The recorded steps as Chrome trace JSON (chrome://tracing, Perfetto). */
int gen_decoder_write_trace(const gen_decoder *d, const char *path);
/* The program from a .ktp, or compiled (forward only) from a .ktg with the defines and, when
 * n_new > 0, NEW = n_new (a .ktp must take one token a step). */
int gen_program_load(const char *path, const kt_ktg_define *defines, int n_defines,
                     int64_t n_new, kt_program **program_out);
int gen_is_description(const char *path);
/* C: the length of the program's segments input (0 without one). */
int64_t gen_program_context(const kt_program *p);

/* The file --params means (checkpoint.c): a kt-train checkpoint directory's session.safetensors,
 * a run directory's newest checkpoint's; *path_out NULL: params as it is (a file, a Hugging
 * Face directory). */
int gen_checkpoint_path(const char *params, char **path_out);

/* ---- sampling (sample.c) ------------------------------------------------------------------- */

typedef struct gen_sampler {
    int greedy;         /* argmax (also temperature 0) */
    double temperature; /* > 0 unless greedy */
    int64_t top_k;      /* 0: all */
    double top_p;       /* (0, 1]; 1: all */
    uint64_t state[4];  /* xoshiro256** */
    int64_t vocab;
    int64_t *order; /* [vocab] scratch */
    double *prob;   /* [vocab] scratch */
} gen_sampler;

int gen_sampler_init(gen_sampler *s, int greedy, double temperature, int64_t top_k,
                     double top_p, uint64_t seed, int64_t vocab);
/* Temperature, then top-k, then top-p on the sorted probabilities, then one draw. */
int64_t gen_sampler_pick(gen_sampler *s, const float *logits);
void gen_sampler_free(gen_sampler *s);

/* ---- --dump-logits (dump.c) ----------------------------------------------------------------- */

typedef struct gen_logit_log {
    float *rows;     /* [n, vocab] */
    int32_t *tokens; /* [n]: the token fed before each row */
    int64_t n, cap, vocab;
} gen_logit_log;

/* One forward's logits (vocab of them) after feeding token; ctx: the log (a prefill row
 * callback). */
int gen_logit_row(void *ctx, int64_t token, const float *logits);
int gen_logit_save(const gen_logit_log *g, const char *path);
void gen_logit_free(gen_logit_log *g);

/* ---- prompts and output (text.c) ------------------------------------------------------------ */

/* "1,2,3" -> ids (malloc'd); 2 on a malformed list. */
int gen_parse_ids(const char *list, int64_t **ids_out, int64_t *n_out);
/* The text's bytes as ids. */
int gen_text_ids(const char *text, int64_t **ids_out, int64_t *n_out);
/* One generated token: as text (a byte; escaped unless printable) or as an id (index: its
 * place in the output, for the separator). */
void gen_print_token(FILE *f, int64_t id, int as_ids, int64_t index);

#endif
