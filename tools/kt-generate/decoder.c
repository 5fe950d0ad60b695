/* The decoder: the step program (one token a step) and, for a prompt from a .ktg, a prefill
 * program (the prompt but its last token in one forward), sharing one thread pool and one set
 * of MoE layers. The key/value cache is the step program's past_k<l>/past_v<l> inputs
 * themselves: a session's inputs keep their memory and no step writes them, so after each
 * forward the new keys and values (the k<l>, v<l> outputs) are copied into the slots of their
 * positions and segments marks the slots filled. Slots fill from the end, position p in slot
 * C-2-p, next to the new token's (C-1), so that the filled keys and the new one share
 * attention's key blocks (empty blocks are skipped); they never move. Their order does not
 * matter: the keys carry their RoPE positions already and a step's one query attends to every
 * filled slot. A token costs one token's forward plus the copy of its key and value. */
#include <stdlib.h>
#include <string.h>

#include "tools/kt-generate/generate.h"

/* The step program's cache slot of position p (p < C-1). */
static int64_t slot_of(const gen_decoder *d, int64_t p)
{
    return d->context - 2 - p;
}

/* Row `row` of one's [1, n, HKV, D] into the cache's slot. */
static void cache_store(kt_tensor *past, const kt_tensor *one, int64_t row, int64_t slot)
{
    const size_t bytes = kt_tensor_nbytes(one) / (size_t)one->shape[1];
    memcpy((char *)past->data + (size_t)slot * bytes, (const char *)one->data + row * bytes,
           bytes);
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

/* Frozen f32 experts, sized by the program that feeds the most tokens a step. */
static int create_moe(gen_decoder *d, const kt_program *largest, const char *params)
{
    if (kt_program_moe_count(largest) == 0)
        return 0;
    kt_moe_layers_options mo = {.weight_dtype = KT_F32, .mode = KT_MOE_FROZEN};
    if (experts_in_checkpoint(largest, params, &mo.intermediate) != 0)
        return 1;
    if (kt_moe_layers_create(largest, &mo, d->pool, &d->moe) != KT_OK)
        return gen_error("cannot create the MoE layers: %s", kt_last_error());
    return 0;
}

/* The two programs come from one description: the same cache layout and vocabulary. */
static int check_twins(const gen_stage *a, const gen_stage *b)
{
    if (a->context != b->context || a->vocab != b->vocab || a->n_layers != b->n_layers)
        return gen_error("the prefill compilation differs from the step's (context %lld and "
                         "%lld, vocabulary %lld and %lld, %d and %d cached layers)",
                         (long long)a->context, (long long)b->context, (long long)a->vocab,
                         (long long)b->vocab, a->n_layers, b->n_layers);
    return 0;
}

int gen_decoder_open(gen_decoder *d, const gen_decoder_options *o)
{
    memset(d, 0, sizeof *d);
    int rc = gen_program_load(o->program, o->defines, o->n_defines, 1, &d->step.program);
    if (rc != 0)
        return rc;
    const int64_t c = gen_program_context(d->step.program);
    const int64_t prefill = gen_is_description(o->program) && o->prompt > 1 && o->prompt <= c
                                ? o->prompt - 1
                                : 0;
    if (prefill > 0 && (rc = gen_program_load(o->program, o->defines, o->n_defines, prefill,
                                              &d->prefill.program)) != 0)
        return rc;
    if (kt_threadpool_create(o->threads, &d->pool) != KT_OK)
        return gen_error("cannot start the thread pool: %s", kt_last_error());
    if (create_moe(d, prefill > 0 ? d->prefill.program : d->step.program, o->params) != 0 ||
        gen_stage_open(&d->step, &d->moe, d->pool, o->params, o->threads,
                       o->trace ? c + 1 : 0) != 0)
        return 1;
    if (d->step.n_new != 1)
        return gen_error("%s takes %lld tokens a step; kt-generate's steps take one (compile "
                         "it with -D NEW=1)", o->program, (long long)d->step.n_new);
    if (prefill > 0 && (gen_stage_open(&d->prefill, &d->moe, d->pool, o->params, o->threads,
                                       o->trace ? 1 : 0) != 0 ||
                        check_twins(&d->step, &d->prefill) != 0))
        return 1;
    d->context = d->step.context;
    d->vocab = d->step.vocab;
    return 0;
}

static int check_id(const gen_decoder *d, int64_t token)
{
    if (token < 0 || token >= d->vocab)
        return gen_error("token id %lld is outside the vocabulary (0..%lld)", (long long)token,
                         (long long)(d->vocab - 1));
    return 0;
}

int gen_decoder_prefill(gen_decoder *d, const int64_t *ids,
                        int (*row)(void *ctx, int64_t token, const float *logits), void *ctx)
{
    gen_stage *p = &d->prefill;
    if (p->session == NULL)
        return 0;
    const int64_t n = p->n_new;
    for (int64_t i = 0; i < n; i++) {
        if (check_id(d, ids[i]) != 0)
            return 1;
        gen_stage_set_index(&p->tokens, i, ids[i]);
        gen_stage_set_index(&p->positions, i, i);
    }
    if (kt_session_forward(p->session) != KT_OK)
        return gen_error("the prompt's forward failed: %s", kt_last_error());
    /* the new keys and values fill the step program's slots of positions 0..n-1 */
    for (int64_t i = 0; i < n; i++) {
        for (int l = 0; l < d->step.n_layers; l++) {
            cache_store(&d->step.layers[l].past_k, &p->layers[l].k, i, slot_of(d, i));
            cache_store(&d->step.layers[l].past_v, &p->layers[l].v, i, slot_of(d, i));
        }
        gen_stage_set_index(&d->step.segments, slot_of(d, i), 0);
    }
    d->filled = n;
    for (int64_t i = 0; i < n && row != NULL; i++)
        if (row(ctx, ids[i], (const float *)p->logits.data + i * d->vocab) != 0)
            return 1;
    /* its memory goes; the program stays for the trace's names */
    p->n_trace = kt_session_trace_count(p->session);
    kt_session_destroy(p->session);
    p->session = NULL;
    return 0;
}

int gen_decoder_step(gen_decoder *d, int64_t token, const float **logits_out)
{
    gen_stage *s = &d->step;
    if (d->filled >= d->context)
        return gen_error("the context is full (%lld tokens)", (long long)d->context);
    if (check_id(d, token) != 0)
        return 1;
    gen_stage_set_index(&s->tokens, 0, token);
    gen_stage_set_index(&s->positions, 0, d->filled);
    if (kt_session_forward(s->session) != KT_OK)
        return gen_error("forward failed at position %lld: %s", (long long)d->filled,
                         kt_last_error());
    /* the last position's key stays in the new-token slot: no later step reads it */
    if (d->filled < d->context - 1) {
        const int64_t slot = slot_of(d, d->filled);
        for (int l = 0; l < s->n_layers; l++) {
            cache_store(&s->layers[l].past_k, &s->layers[l].k, 0, slot);
            cache_store(&s->layers[l].past_v, &s->layers[l].v, 0, slot);
        }
        gen_stage_set_index(&s->segments, slot, 0);
    }
    d->filled++;
    *logits_out = s->logits.data;
    return 0;
}

int gen_decoder_write_trace(const gen_decoder *d, const char *path)
{
    const size_t a = d->prefill.n_trace, b = kt_session_trace_count(d->step.session);
    kt_trace_event *all = malloc((a + b + 1) * sizeof *all);
    if (all == NULL)
        return gen_error("out of memory (--trace)");
    if (a > 0)
        memcpy(all, d->prefill.trace, a * sizeof *all);
    if (b > 0)
        memcpy(all + a, d->step.trace, b * sizeof *all);
    kt_status st = kt_trace_write_json(all, a + b, path);
    free(all);
    if (st != KT_OK)
        return gen_error("cannot write the trace: %s", kt_last_error());
    return 0;
}

void gen_decoder_close(gen_decoder *d)
{
    gen_stage_close(&d->prefill);
    gen_stage_close(&d->step);
    kt_moe_layers_destroy(&d->moe);
    kt_threadpool_destroy(d->pool);
    memset(d, 0, sizeof *d);
}
