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

/* ---- the decode session (decoder.c) ----------------------------------------------------------
 * The program takes one token a step: inputs tokens [1,1], positions [1,1], segments [1,C]
 * and per layer l past_k<l>, past_v<l> [1,C-1,HKV,D]; outputs logits [1,VOCAB] and the new
 * token's k<l>, v<l> [1,1,HKV,D], which the decoder writes into the cache slot of its
 * position (segments: 0 for a filled slot and the new token's, 1 for an empty one). */

typedef struct gen_cache_layer {
    kt_tensor past_k, past_v; /* session inputs: the cache itself */
    kt_tensor k, v;           /* session outputs: the new token's */
} gen_cache_layer;

typedef struct gen_decoder {
    kt_program *program;
    kt_session *session;
    kt_threadpool *pool;
    kt_moe_layers moe;
    kt_tensor tokens, positions, segments, logits;
    gen_cache_layer *layers;
    int n_layers;
    int64_t context; /* C: tokens a generation may feed */
    int64_t vocab;   /* the logits' width; every id fed must be below it */
    int64_t filled;  /* tokens fed so far (the next one's position) */
    kt_trace_event *trace; /* --trace: every step of every forward */
} gen_decoder;

typedef struct gen_decoder_options {
    const char *program; /* .ktp, or .ktg compiled here with the defines */
    const kt_ktg_define *defines;
    int n_defines;
    const char *params;  /* the checkpoint: parameters and experts */
    int threads;
    int trace; /* record the forwards' steps (gen_decoder_write_trace) */
} gen_decoder_options;

int gen_decoder_open(gen_decoder *d, const gen_decoder_options *o);
/* Feeds token at position d->filled; *logits_out: the next token's logits (valid until the
 * next step). Refused once the context is full. */
int gen_decoder_step(gen_decoder *d, int64_t token, const float **logits_out);
void gen_decoder_close(gen_decoder *d);
/* The recorded steps as Chrome trace JSON (chrome://tracing, Perfetto). */
int gen_decoder_write_trace(const gen_decoder *d, const char *path);
/* The program from a .ktp, or compiled (forward only) from a .ktg with the defines. */
int gen_program_load(const char *path, const kt_ktg_define *defines, int n_defines,
                     kt_program **program_out);

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

/* ---- prompts and output (text.c) ------------------------------------------------------------ */

/* "1,2,3" -> ids (malloc'd); 2 on a malformed list. */
int gen_parse_ids(const char *list, int64_t **ids_out, int64_t *n_out);
/* The text's bytes as ids. */
int gen_text_ids(const char *text, int64_t **ids_out, int64_t *n_out);
/* One generated token: as text (a byte; escaped unless printable) or as an id (index: its
 * place in the output, for the separator). */
void gen_print_token(FILE *f, int64_t id, int as_ids, int64_t index);

#endif
