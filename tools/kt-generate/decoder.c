/* The decode session and its key/value cache. The cache is the program's past_k<l>/past_v<l>
 * inputs themselves: a session's inputs keep their memory and are never written by a step, so
 * after each forward the new token's key and value (the k<l>, v<l> outputs) are copied into
 * the slot of its position and segments marks the slot filled. Slots fill in order and are
 * never moved: the keys carry their RoPE positions already and the one query attends to every
 * filled slot, so a step costs one token's forward plus the copy of one key and value. */
#include <stdlib.h>
#include <string.h>

#include "tools/kt-generate/generate.h"

#define EMPTY_SEGMENT 1 /* a slot no token has filled; filled slots and the new token: 0 */

static int index_dtype(kt_dtype t)
{
    return t == KT_I32 || t == KT_I64;
}

static void set_index(kt_tensor *t, int64_t i, int64_t v)
{
    if (t->dtype == KT_I32)
        ((int32_t *)t->data)[i] = (int32_t)v;
    else
        ((int64_t *)t->data)[i] = v;
}

static int has_tensor(kt_session *s, kt_tensor_role role, const char *name, kt_tensor *view)
{
    int yes = kt_session_tensor(s, role, name, view) == KT_OK;
    kt_clear_error();
    return yes;
}

/* An index input of shape [1, n]. */
static int find_index_input(gen_decoder *d, const char *name, int64_t n, kt_tensor *view)
{
    char got[96];
    if (!has_tensor(d->session, KT_ROLE_INPUT, name, view))
        return gen_error("the program has no input '%s': it is not a decode program (one "
                         "token a step: examples/moe_lm_decode.ktg)", name);
    if (!index_dtype(view->dtype) || view->ndim != 2 || view->shape[0] != 1 ||
        (n > 0 && view->shape[1] != n))
        return gen_error("the program's input '%s' is %s; a decode program takes i32 or i64 "
                         "[1, %lld]", name, kt_tensor_describe(view, got, sizeof got),
                         n > 0 ? (long long)n : 1ll);
    return 0;
}

/* past_<kv><l> [1, C-1, HKV, D] and the output <kv><l> [1, 1, HKV, D] of the same dtype. */
static int check_cache_pair(const gen_decoder *d, const char *what, int l, const kt_tensor *past,
                            const kt_tensor *out)
{
    char a[96], b[96];
    if (past->ndim != 4 || past->shape[0] != 1 || past->shape[1] != d->context - 1)
        return gen_error("the program's input 'past_%s%d' is %s; expected [1, C-1 = %lld, "
                         "heads, head_dim]", what, l, kt_tensor_describe(past, a, sizeof a),
                         (long long)(d->context - 1));
    if (out->dtype != past->dtype || out->ndim != 4 || out->shape[0] != 1 ||
        out->shape[1] != 1 || out->shape[2] != past->shape[2] || out->shape[3] != past->shape[3])
        return gen_error("the program's output '%s%d' is %s; the cache 'past_%s%d' %s wants "
                         "one token's: [1, 1, %lld, %lld] %s", what, l,
                         kt_tensor_describe(out, a, sizeof a), what, l,
                         kt_tensor_describe(past, b, sizeof b), (long long)past->shape[2],
                         (long long)past->shape[3], kt_dtype_name(past->dtype));
    return 0;
}

static int find_layers(gen_decoder *d)
{
    for (;;) {
        char name[4][32];
        kt_tensor t[4];
        const int l = d->n_layers;
        snprintf(name[0], sizeof name[0], "past_k%d", l);
        snprintf(name[1], sizeof name[1], "past_v%d", l);
        snprintf(name[2], sizeof name[2], "k%d", l);
        snprintf(name[3], sizeof name[3], "v%d", l);
        if (!has_tensor(d->session, KT_ROLE_INPUT, name[0], &t[0]))
            return 0;
        if (!has_tensor(d->session, KT_ROLE_INPUT, name[1], &t[1]))
            return gen_error("the program has an input '%s' but no '%s'", name[0], name[1]);
        for (int j = 2; j < 4; j++)
            if (!has_tensor(d->session, KT_ROLE_OUTPUT, name[j], &t[j]))
                return gen_error("the program has an input '%s' but no output '%s' (the new "
                                 "token's, to cache)", name[j - 2], name[j]);
        if (check_cache_pair(d, "k", l, &t[0], &t[2]) != 0 ||
            check_cache_pair(d, "v", l, &t[1], &t[3]) != 0)
            return 1;
        gen_cache_layer *grown = realloc(d->layers, (size_t)(l + 1) * sizeof *grown);
        if (grown == NULL)
            return gen_error("out of memory");
        d->layers = grown;
        d->layers[l] = (gen_cache_layer){t[0], t[1], t[2], t[3]};
        d->n_layers++;
    }
}

/* Every input is one the decoder feeds: a program that wants more is not a decode program. */
static int check_inputs(const gen_decoder *d)
{
    for (int i = 0; i < kt_program_count(d->program, KT_ROLE_INPUT); i++) {
        const char *name = "";
        kt_program_tensor_info(d->program, KT_ROLE_INPUT, i, &name, NULL);
        int known = strcmp(name, "tokens") == 0 || strcmp(name, "positions") == 0 ||
                    strcmp(name, "segments") == 0;
        for (int l = 0; l < d->n_layers && !known; l++) {
            char k[32], v[32];
            snprintf(k, sizeof k, "past_k%d", l);
            snprintf(v, sizeof v, "past_v%d", l);
            known = strcmp(name, k) == 0 || strcmp(name, v) == 0;
        }
        if (!known)
            return gen_error("the program's input '%s' is not one kt-generate feeds (tokens, "
                             "positions, segments, past_k<l>, past_v<l>: a decode program as "
                             "examples/moe_lm_decode.ktg)", name);
    }
    return 0;
}

/* logits [1, VOCAB] f32; ids fed back must be rows of the embedding and positions 0..C-1
 * within RoPE's table. */
static int check_logits_and_bounds(gen_decoder *d)
{
    char got[96];
    kt_tensor *lg = &d->logits;
    if (!has_tensor(d->session, KT_ROLE_OUTPUT, "logits", lg))
        return gen_error("the program has no output 'logits'");
    if (lg->dtype != KT_F32 || lg->ndim < 1 || kt_tensor_numel(lg) != lg->shape[lg->ndim - 1])
        return gen_error("the program's output 'logits' is %s; expected f32 [1, VOCAB]",
                         kt_tensor_describe(lg, got, sizeof got));
    d->vocab = lg->shape[lg->ndim - 1];
    int64_t rows = -1, positions = -1;
    if (kt_program_index_bound(d->program, "tokens", &rows) != KT_OK ||
        kt_program_index_bound(d->program, "positions", &positions) != KT_OK)
        return gen_error("cannot read the program's input bounds: %s", kt_last_error());
    if (rows >= 0 && rows < d->vocab)
        return gen_error("the logits have %lld classes but the token input takes ids below "
                         "%lld: a sampled id could not be fed back", (long long)d->vocab,
                         (long long)rows);
    if (positions >= 0 && positions < d->context)
        return gen_error("the context C = %lld is longer than the program's RoPE table "
                         "(max_positions = %lld)", (long long)d->context,
                         (long long)positions);
    return 0;
}

/* The program's experts must be in the checkpoint (kt_session_load leaves absent ones as they
 * are); a moe op that does not say its intermediate size takes the checkpoint's (gate [I, H]). */
static int experts_in_checkpoint(const kt_program *p, const char *params, int64_t *inter_out)
{
    kt_st_file *f = NULL;
    *inter_out = 0;
    if (kt_st_open(params, &f) != KT_OK)
        return gen_error("cannot read the checkpoint: %s", kt_last_error());
    int rc = 0;
    for (int i = 0; i < kt_program_moe_count(p) && rc == 0; i++) {
        kt_program_moe info;
        char name[512];
        kt_tensor gate;
        if (kt_program_moe_info(p, i, &info) != KT_OK ||
            kt_moe_tensor_name(info.names, info.binding, 0, KT_MOE_GATE, "weight", name,
                               sizeof name) != KT_OK) {
            rc = gen_error("cannot read the program's moe ops: %s", kt_last_error());
        } else if (kt_st_find(f, name, &gate) != KT_OK) {
            rc = gen_error("%s: no tensor '%s': the experts of moe node '%s' (layer %d) are "
                           "missing (a checkpoint of this model: kt-train --save, or a run "
                           "directory's state)", params, name, info.name, info.binding);
        } else if (info.intermediate == 0 && *inter_out == 0 && gate.ndim == 2) {
            *inter_out = gate.shape[0];
        }
    }
    kt_clear_error();
    kt_st_close(f);
    return rc;
}

/* segments' length, C, from the program's tables (before a session exists); 1 without it */
static int64_t program_context(const kt_program *p)
{
    for (int i = 0; i < kt_program_count(p, KT_ROLE_INPUT); i++) {
        const char *name = "";
        kt_tensor meta;
        if (kt_program_tensor_info(p, KT_ROLE_INPUT, i, &name, &meta) == KT_OK &&
            strcmp(name, "segments") == 0 && meta.ndim == 2 && meta.shape[1] > 0)
            return meta.shape[1];
    }
    return 1;
}

static int create_session(gen_decoder *d, const gen_decoder_options *o)
{
    kt_session_options so;
    memset(&so, 0, sizeof so);
    so.threads = o->threads;
    if (kt_threadpool_create(o->threads, &d->pool) != KT_OK)
        return gen_error("cannot start the thread pool: %s", kt_last_error());
    so.pool = d->pool;
    if (kt_program_moe_count(d->program) > 0) {
        kt_moe_layers_options mo = {.weight_dtype = KT_F32, .mode = KT_MOE_FROZEN};
        if (experts_in_checkpoint(d->program, o->params, &mo.intermediate) != 0)
            return 1;
        if (kt_moe_layers_create(d->program, &mo, d->pool, &d->moe) != KT_OK)
            return gen_error("cannot create the MoE layers: %s", kt_last_error());
        so.moe_layers = d->moe.layers;
        so.n_moe_layers = d->moe.n;
    }
    if (o->trace) {
        /* room for a forward's steps (and the session's own events) at every position */
        kt_program_stats st;
        kt_program_get_stats(d->program, &st);
        so.trace_capacity = ((size_t)st.n_forward_steps + 16) * (size_t)program_context(d->program);
        d->trace = calloc(so.trace_capacity ? so.trace_capacity : 1, sizeof *d->trace);
        if (d->trace == NULL)
            return gen_error("out of memory (--trace)");
        so.trace = d->trace;
    }
    if (kt_session_create(d->program, &so, &d->session) != KT_OK)
        return gen_error("cannot create a session: %s", kt_last_error());
    /* every parameter, nothing another model's (the optimizer state a save holds is fine) */
    if (kt_session_load(d->session, o->params, 0) != KT_OK)
        return gen_error("cannot load the checkpoint: %s", kt_last_error());
    return 0;
}

int gen_decoder_open(gen_decoder *d, const gen_decoder_options *o)
{
    memset(d, 0, sizeof *d);
    int rc = gen_program_load(o->program, o->defines, o->n_defines, &d->program);
    if (rc != 0)
        return rc;
    if (create_session(d, o) != 0 ||
        find_index_input(d, "segments", 0, &d->segments) != 0)
        return 1;
    d->context = d->segments.shape[1];
    if (d->context < 2)
        return gen_error("the program's context (segments [1, %lld]) holds no cache: "
                         "compile it with C >= 2", (long long)d->context);
    if (find_index_input(d, "tokens", 1, &d->tokens) != 0 ||
        find_index_input(d, "positions", 1, &d->positions) != 0 || find_layers(d) != 0 ||
        check_inputs(d) != 0 || check_logits_and_bounds(d) != 0)
        return 1;
    for (int64_t i = 0; i < d->context - 1; i++)
        set_index(&d->segments, i, EMPTY_SEGMENT);
    set_index(&d->segments, d->context - 1, 0);
    for (int l = 0; l < d->n_layers; l++) {
        memset(d->layers[l].past_k.data, 0, kt_tensor_nbytes(&d->layers[l].past_k));
        memset(d->layers[l].past_v.data, 0, kt_tensor_nbytes(&d->layers[l].past_v));
    }
    return 0;
}

/* The new token's key or value into slot `slot` of the cache. */
static void cache_store(kt_tensor *past, const kt_tensor *one, int64_t slot)
{
    const size_t bytes = kt_tensor_nbytes(one);
    memcpy((char *)past->data + (size_t)slot * bytes, one->data, bytes);
}

int gen_decoder_step(gen_decoder *d, int64_t token, const float **logits_out)
{
    if (d->filled >= d->context)
        return gen_error("the context is full (%lld tokens)", (long long)d->context);
    if (token < 0 || token >= d->vocab)
        return gen_error("token id %lld is outside the vocabulary (0..%lld)", (long long)token,
                         (long long)(d->vocab - 1));
    set_index(&d->tokens, 0, token);
    set_index(&d->positions, 0, d->filled);
    if (kt_session_forward(d->session) != KT_OK)
        return gen_error("forward failed at position %lld: %s", (long long)d->filled,
                         kt_last_error());
    /* the last position's key stays in the new-token slot: no later step reads it */
    if (d->filled < d->context - 1) {
        for (int l = 0; l < d->n_layers; l++) {
            cache_store(&d->layers[l].past_k, &d->layers[l].k, d->filled);
            cache_store(&d->layers[l].past_v, &d->layers[l].v, d->filled);
        }
        set_index(&d->segments, d->filled, 0);
    }
    d->filled++;
    *logits_out = d->logits.data;
    return 0;
}

int gen_decoder_write_trace(const gen_decoder *d, const char *path)
{
    if (kt_trace_write_json(d->trace, kt_session_trace_count(d->session), path) != KT_OK)
        return gen_error("cannot write the trace: %s", kt_last_error());
    return 0;
}

void gen_decoder_close(gen_decoder *d)
{
    kt_session_destroy(d->session);
    kt_moe_layers_destroy(&d->moe);
    kt_threadpool_destroy(d->pool);
    kt_program_destroy(d->program);
    free(d->layers);
    free(d->trace);
    memset(d, 0, sizeof *d);
}
