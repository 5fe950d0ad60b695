/* One decode program in its session: the checkpoint loaded, the inputs and outputs the
 * decoder feeds and reads found by name and checked against each other (generate.h), so that
 * a program that is not a decode program, or one of other sizes, is refused by name. */
#include <stdlib.h>
#include <string.h>

#include "tools/kt-generate/generate.h"

void gen_stage_set_index(kt_tensor *t, int64_t i, int64_t v)
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

/* An index input of shape [1, n] (n 0: any). */
static int find_index_input(gen_stage *s, const char *name, int64_t n, kt_tensor *view)
{
    char got[96];
    if (!has_tensor(s->session, KT_ROLE_INPUT, name, view))
        return gen_error("the program has no input '%s': it is not a decode program (tokens "
                         "a step and their cache: examples/moe_lm_decode.ktg)", name);
    if ((view->dtype != KT_I32 && view->dtype != KT_I64) || view->ndim != 2 ||
        view->shape[0] != 1 || (n > 0 && view->shape[1] != n))
        return gen_error("the program's input '%s' is %s; kt-generate feeds it i32 or i64 "
                         "[1, %lld]", name, kt_tensor_describe(view, got, sizeof got),
                         n > 0 ? (long long)n : 1ll);
    return 0;
}

/* past_<kv><l> [1, C-NEW, HKV, D] and the output <kv><l> [1, NEW, HKV, D] of its dtype. */
static int check_cache_pair(const gen_stage *s, const char *what, int l, const kt_tensor *past,
                            const kt_tensor *out)
{
    char a[96], b[96];
    if (past->ndim != 4 || past->shape[0] != 1 || past->shape[1] != s->context - s->n_new)
        return gen_error("the program's input 'past_%s%d' is %s; expected [1, C-NEW = %lld, "
                         "heads, head_dim]", what, l, kt_tensor_describe(past, a, sizeof a),
                         (long long)(s->context - s->n_new));
    if (out->dtype != past->dtype || out->ndim != 4 || out->shape[0] != 1 ||
        out->shape[1] != s->n_new || out->shape[2] != past->shape[2] ||
        out->shape[3] != past->shape[3])
        return gen_error("the program's output '%s%d' is %s; the cache 'past_%s%d' %s wants "
                         "the new tokens': [1, %lld, %lld, %lld] %s", what, l,
                         kt_tensor_describe(out, a, sizeof a), what, l,
                         kt_tensor_describe(past, b, sizeof b), (long long)s->n_new,
                         (long long)past->shape[2], (long long)past->shape[3],
                         kt_dtype_name(past->dtype));
    return 0;
}

static int find_layers(gen_stage *s)
{
    for (;;) {
        char name[4][32];
        kt_tensor t[4];
        const int l = s->n_layers;
        snprintf(name[0], sizeof name[0], "past_k%d", l);
        snprintf(name[1], sizeof name[1], "past_v%d", l);
        snprintf(name[2], sizeof name[2], "k%d", l);
        snprintf(name[3], sizeof name[3], "v%d", l);
        if (!has_tensor(s->session, KT_ROLE_INPUT, name[0], &t[0]))
            return 0;
        if (!has_tensor(s->session, KT_ROLE_INPUT, name[1], &t[1]))
            return gen_error("the program has an input '%s' but no '%s'", name[0], name[1]);
        for (int j = 2; j < 4; j++)
            if (!has_tensor(s->session, KT_ROLE_OUTPUT, name[j], &t[j]))
                return gen_error("the program has an input '%s' but no output '%s' (the new "
                                 "tokens', to cache)", name[j - 2], name[j]);
        if (check_cache_pair(s, "k", l, &t[0], &t[2]) != 0 ||
            check_cache_pair(s, "v", l, &t[1], &t[3]) != 0)
            return 1;
        gen_cache_layer *grown = realloc(s->layers, (size_t)(l + 1) * sizeof *grown);
        if (grown == NULL)
            return gen_error("out of memory");
        s->layers = grown;
        s->layers[l] = (gen_cache_layer){t[0], t[1], t[2], t[3]};
        s->n_layers++;
    }
}

/* Every input is one the decoder feeds: a program that wants more is not a decode program. */
static int check_inputs(const gen_stage *s)
{
    for (int i = 0; i < kt_program_count(s->program, KT_ROLE_INPUT); i++) {
        const char *name = "";
        kt_program_tensor_info(s->program, KT_ROLE_INPUT, i, &name, NULL);
        int known = strcmp(name, "tokens") == 0 || strcmp(name, "positions") == 0 ||
                    strcmp(name, "segments") == 0;
        for (int l = 0; l < s->n_layers && !known; l++) {
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

/* logits [NEW, VOCAB] f32; ids fed back must be rows of the embedding and positions 0..C-1
 * within RoPE's table. */
static int check_logits_and_bounds(gen_stage *s)
{
    char got[96];
    kt_tensor *lg = &s->logits;
    if (!has_tensor(s->session, KT_ROLE_OUTPUT, "logits", lg))
        return gen_error("the program has no output 'logits'");
    if (lg->dtype != KT_F32 || lg->ndim < 1 ||
        kt_tensor_numel(lg) != s->n_new * lg->shape[lg->ndim - 1])
        return gen_error("the program's output 'logits' is %s; expected f32 [NEW = %lld, "
                         "VOCAB]", kt_tensor_describe(lg, got, sizeof got),
                         (long long)s->n_new);
    s->vocab = lg->shape[lg->ndim - 1];
    int64_t rows = -1, positions = -1;
    if (kt_program_index_bound(s->program, "tokens", &rows) != KT_OK ||
        kt_program_index_bound(s->program, "positions", &positions) != KT_OK)
        return gen_error("cannot read the program's input bounds: %s", kt_last_error());
    if (rows >= 0 && rows < s->vocab)
        return gen_error("the logits have %lld classes but the token input takes ids below "
                         "%lld: a sampled id could not be fed back", (long long)s->vocab,
                         (long long)rows);
    if (positions >= 0 && positions < s->context)
        return gen_error("the context C = %lld is longer than the program's RoPE table "
                         "(max_positions = %lld)", (long long)s->context,
                         (long long)positions);
    return 0;
}

static int create_session(gen_stage *s, const kt_moe_layers *moe, kt_threadpool *pool,
                          const char *params, int threads, int64_t trace_forwards)
{
    kt_session_options so;
    memset(&so, 0, sizeof so);
    so.threads = threads;
    so.pool = pool;
    so.moe_layers = moe->layers;
    so.n_moe_layers = moe->n;
    if (trace_forwards > 0) {
        /* room for each forward's steps and the session's own events */
        kt_program_stats st;
        kt_program_get_stats(s->program, &st);
        so.trace_capacity = ((size_t)st.n_forward_steps + 16) * (size_t)trace_forwards;
        s->trace = calloc(so.trace_capacity, sizeof *s->trace);
        if (s->trace == NULL)
            return gen_error("out of memory (--trace)");
        so.trace = s->trace;
    }
    if (kt_session_create(s->program, &so, &s->session) != KT_OK)
        return gen_error("cannot create a session: %s", kt_last_error());
    /* every parameter, nothing another model's (the optimizer state a save holds is fine) */
    if (kt_session_load(s->session, params, 0) != KT_OK)
        return gen_error("cannot load the checkpoint: %s", kt_last_error());
    return 0;
}

int gen_stage_open(gen_stage *s, const kt_moe_layers *moe, kt_threadpool *pool,
                   const char *params, int threads, int64_t trace_forwards)
{
    if (create_session(s, moe, pool, params, threads, trace_forwards) != 0 ||
        find_index_input(s, "segments", 0, &s->segments) != 0 ||
        find_index_input(s, "tokens", 0, &s->tokens) != 0 ||
        find_index_input(s, "positions", s->tokens.shape[1], &s->positions) != 0)
        return 1;
    s->context = s->segments.shape[1];
    s->n_new = s->tokens.shape[1];
    if (s->context <= s->n_new)
        return gen_error("the program's context (segments [1, %lld]) holds no cache beside "
                         "its %lld new token%s: compile it with a larger C", (long long)s->context,
                         (long long)s->n_new, s->n_new == 1 ? "" : "s");
    if (find_layers(s) != 0 || check_inputs(s) != 0 || check_logits_and_bounds(s) != 0)
        return 1;
    /* nothing filled yet: every cache slot empty, the new tokens in the last slots */
    for (int64_t i = 0; i < s->context; i++)
        gen_stage_set_index(&s->segments, i, i < s->context - s->n_new ? 1 : 0);
    for (int l = 0; l < s->n_layers; l++) {
        memset(s->layers[l].past_k.data, 0, kt_tensor_nbytes(&s->layers[l].past_k));
        memset(s->layers[l].past_v.data, 0, kt_tensor_nbytes(&s->layers[l].past_v));
    }
    return 0;
}

void gen_stage_close(gen_stage *s)
{
    kt_session_destroy(s->session);
    kt_program_destroy(s->program);
    free(s->layers);
    free(s->trace);
    memset(s, 0, sizeof *s);
}
