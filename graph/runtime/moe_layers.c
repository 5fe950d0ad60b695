/* Every CPU MoE layer a program needs (kt/program.h: kt_moe_layers_create and the rest): the
 * program says how many moe ops there are and their shapes (kt_program_moe_info), the options
 * say the rest (weight dtype, training mode, the intermediate size the program leaves open).
 * With several ranks only rank 0 creates them: the moe op gathers every rank's rows to rank 0
 * and runs its layers on the whole batch, so they are sized for W times a rank's rows; an op
 * in expert parallelism gets a layer on every rank, of the rank's share of the experts. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/program.h"
#include "lib/core/error.h"
#include "lib/core/mix.h"

#define LAYER_NAME_BYTES 32

static int world_of(const kt_moe_layers_options *o) { return o->world > 0 ? o->world : 1; }

static int is_ep(const kt_moe_layers_options *o, const kt_program_moe *info)
{
    return world_of(o) > 1 &&
           (o->parallel == KT_MOE_PARALLEL_ALL_EP ||
            (o->parallel == KT_MOE_PARALLEL_PROGRAM && info->parallel == KT_MOE_PARALLEL_EP));
}

/* Moe op i's layer configuration on this rank, named "moe.<binding>" (name:
 * LAYER_NAME_BYTES); expert parallelism: the rank's share, its model ids in ids[] (room for
 * the op's E). *held 0: this rank holds none of the op's experts. */
static kt_status op_config(const kt_program *p, const kt_moe_layers_options *o, int i,
                           kt_program_moe *info, kt_moe_config *c, char *name, int64_t *ids,
                           int *held)
{
    KT__TRY(kt_program_moe_info(p, i, info));
    if (info->intermediate == 0 && o->intermediate <= 0)
        return kt__error(KT_EINVAL, "moe node '%s' (layer %d) leaves the experts' intermediate "
                         "size to whoever creates its layer, and none was given", info->name,
                         info->binding);
    /* the options' size is the fallback of the ops that leave it open, never a second
     * opinion on an op that says its own */
    KT__TRY(kt_program_moe_config(info, info->intermediate > 0 ? 0 : o->intermediate,
                                  o->weight_dtype, o->mode, o->lora_rank, o->lora_alpha,
                                  world_of(o), c));
    c->quant = o->quant;
    c->quant_group = o->quant_group;
    snprintf(name, LAYER_NAME_BYTES, "moe.%d", info->binding);
    c->name = name;
    *held = o->rank == 0 || is_ep(o, info);
    if (!is_ep(o, info))
        return KT_OK;
    /* a consecutive range of E/W, the first E % W ranks one more (what the op assumes of
     * layers without ids, written out so that names and LoRA init follow the model's ids) */
    const int64_t w = world_of(o), e = c->n_experts;
    int64_t first = 0;
    for (int r = 0; r < o->rank; r++)
        first += e / w + (r < e % w);
    c->n_experts = e / w + (o->rank < e % w);
    for (int64_t k = 0; k < c->n_experts; k++)
        ids[k] = first + k;
    c->expert_ids = ids;
    if (__builtin_mul_overflow(c->max_tokens, c->top_k, &c->max_tokens))
        return kt__error(KT_EINVAL, "moe node '%s': too many (token, slot) pairs", info->name);
    c->top_k = 1; /* each (token, slot) pair is one row of its owner's layer */
    *held = c->n_experts > 0;
    return KT_OK;
}

static int64_t *ids_room(const kt_program *p, int i)
{
    kt_program_moe info;
    if (kt_program_moe_info(p, i, &info) != KT_OK || info.n_experts < 1)
        return malloc(sizeof(int64_t));
    return malloc((size_t)info.n_experts * sizeof(int64_t));
}

static kt_status check_args(const kt_program *p, const kt_moe_layers_options *o, const char *fn)
{
    if (p == NULL || o == NULL)
        return kt__error(KT_EINVAL, "%s: NULL argument", fn);
    if (o->world < 0 || o->rank < 0 || o->rank >= world_of(o))
        return kt__error(KT_EINVAL, "%s: rank %d of world %d", fn, o->rank, o->world);
    return KT_OK;
}

void kt_moe_layers_destroy(kt_moe_layers *layers)
{
    if (layers == NULL)
        return;
    for (int b = 0; b < layers->n && layers->layers != NULL; b++)
        kt_moe_destroy(layers->layers[b]);
    kt_moe_scratch_destroy(layers->scratch); /* after its layers */
    free(layers->layers);
    memset(layers, 0, sizeof *layers);
}

kt_status kt_moe_layers_create(const kt_program *p, const kt_moe_layers_options *options,
                               kt_threadpool *pool, kt_moe_layers *layers_out)
{
    if (layers_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_layers_create: NULL argument");
    memset(layers_out, 0, sizeof *layers_out);
    KT__TRY(check_args(p, options, "kt_moe_layers_create"));
    kt_moe_layers m = {.n_ops = kt_program_moe_count(p)};
    int max_binding = -1;
    for (int i = 0; i < m.n_ops; i++) {
        kt_program_moe info;
        KT__TRY(kt_program_moe_info(p, i, &info));
        max_binding = info.binding > max_binding ? info.binding : max_binding;
    }
    if (m.n_ops == 0) {
        *layers_out = m;
        return KT_OK;
    }
    m.n = max_binding + 1;
    m.layers = calloc((size_t)m.n, sizeof *m.layers);
    if (m.layers == NULL)
        return kt__error(KT_ENOMEM, "kt_moe_layers_create: out of memory");
    kt_status st = kt_moe_scratch_create(-1, &m.scratch);
    for (int i = 0; i < m.n_ops && st == KT_OK; i++) {
        kt_program_moe info;
        kt_moe_config c;
        char name[LAYER_NAME_BYTES];
        int held = 0;
        int64_t *ids = ids_room(p, i);
        if (ids == NULL)
            st = kt__error(KT_ENOMEM, "kt_moe_layers_create: out of memory");
        if (st == KT_OK)
            st = op_config(p, options, i, &info, &c, name, ids, &held);
        if (st == KT_OK) {
            c.scratch = m.scratch;
            m.n_recompute += !c.keep_activations;
        }
        /* rank 0 owns the experts (or each rank its share); a binding used twice: the
         * session says so */
        if (st == KT_OK && held && m.layers[info.binding] == NULL &&
            (st = kt_moe_create(&c, pool, &m.layers[info.binding])) != KT_OK)
            kt__error_context(st, "MoE layer %d for moe node '%s'", info.binding, info.name);
        free(ids); /* the layer keeps its own copy */
    }
    if (st != KT_OK) {
        kt_moe_layers_destroy(&m);
        return st;
    }
    *layers_out = m;
    return KT_OK;
}

kt_status kt_moe_layers_memory_need(const kt_program *p, const kt_moe_layers_options *options,
                                    int optimizer_states, uint64_t *bytes_out)
{
    if (bytes_out == NULL)
        return kt__error(KT_EINVAL, "kt_moe_layers_memory_need: NULL argument");
    KT__TRY(check_args(p, options, "kt_moe_layers_memory_need"));
    uint64_t total = 0;
    const int n_ops = kt_program_moe_count(p);
    for (int i = 0; i < n_ops; i++) {
        kt_program_moe info;
        kt_moe_config c;
        char name[LAYER_NAME_BYTES];
        uint64_t bytes;
        int held = 0;
        int64_t *ids = ids_room(p, i);
        if (ids == NULL)
            return kt__error(KT_ENOMEM, "kt_moe_layers_memory_need: out of memory");
        kt_status st = op_config(p, options, i, &info, &c, name, ids, &held);
        free(ids);
        if (st != KT_OK)
            return st;
        if (!held)
            continue; /* rank 0 owns the experts, or this rank holds none of this op's */
        c.expert_ids = NULL; /* freed; the size does not depend on them */
        st = kt_moe_memory_need(&c, optimizer_states, &bytes);
        if (st != KT_OK)
            return kt__error_context(st, "MoE layer %d for moe node '%s' (intermediate %lld)",
                                     info.binding, info.name, (long long)c.intermediate);
        total += bytes;
    }
    *bytes_out = total;
    return KT_OK;
}

/* One independent stream per (layer, expert, projection). */
static void init_weight(kt_tensor *w, uint64_t seed, int layer, int64_t expert, int proj)
{
    uint64_t state = kt__splitmix64(
        kt__splitmix64(kt__splitmix64(seed ^ 0x6d6f65ull) ^ (uint64_t)layer) ^ (uint64_t)expert);
    state = kt__splitmix64(state ^ (uint64_t)proj);
    double limit = 1.0 / sqrt((double)w->shape[1]); /* [out, in] */
    for (int64_t i = 0; i < kt_tensor_numel(w); i++) {
        state = kt__splitmix64(state);
        float v = (float)(limit * (2.0 * (double)(state >> 11) / 9007199254740992.0 - 1.0));
        if (w->dtype == KT_BF16)
            ((uint16_t *)w->data)[i] = kt_f32_to_bf16_1(v);
        else
            ((float *)w->data)[i] = v;
    }
}

/* One layer's weights from the seed: in place, or for quantized experts drawn as the bf16
 * layer's would be and quantized (so that a quantized run starts from that run's weights). */
static kt_status init_layer(kt_moe *m, int b, uint64_t seed)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    uint16_t *staging = NULL;
    if (c->quant != KT_MOE_QUANT_NONE &&
        (staging = malloc((size_t)(c->hidden * c->intermediate) * sizeof *staging)) == NULL)
        return kt__error(KT_ENOMEM, "kt_moe_layers_init: out of memory");
    kt_status st = KT_OK;
    for (int64_t e = 0; e < c->n_experts && st == KT_OK; e++)
        for (int p = 0; p < 3 && st == KT_OK; p++) {
            /* the model's expert: a rank's share starts as the one-rank layer's */
            const int64_t id = c->expert_ids ? c->expert_ids[e] : e;
            kt_tensor w;
            if (staging == NULL) {
                st = kt_moe_weight(m, e, (kt_moe_proj)p, &w);
                if (st == KT_OK)
                    init_weight(&w, seed, b, id, p);
                continue;
            }
            const int64_t shape[2] = {p == KT_MOE_DOWN ? c->hidden : c->intermediate,
                                      p == KT_MOE_DOWN ? c->intermediate : c->hidden};
            kt_tensor_init(&w, staging, KT_BF16, 2, shape);
            init_weight(&w, seed, b, id, p);
            st = kt_moe_set_weight(m, e, (kt_moe_proj)p, &w);
        }
    free(staging);
    return st;
}

kt_status kt_moe_layers_init(const kt_moe_layers *layers, uint64_t seed)
{
    if (layers == NULL)
        return kt__error(KT_EINVAL, "kt_moe_layers_init: NULL argument");
    for (int b = 0; b < layers->n; b++)
        if (layers->layers[b] != NULL)
            KT__TRY(init_layer(layers->layers[b], b, seed));
    return KT_OK;
}
