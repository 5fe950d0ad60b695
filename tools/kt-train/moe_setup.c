/* The CPU MoE layers: kt_moe_layers_create makes them from the program's moe ops (H and k from
 * the op's inputs, E from the router that chose the ids, I from the op or --moe-inter); the
 * options say the rest (weight dtype, training mode, LoRA rank and alpha). With several ranks
 * only rank 0 creates them (the moe op runs rank 0's on every rank's rows), or, in expert
 * parallelism (--moe-parallel ep, or the op's `parallel = ep`), every rank its share.
 *
 * Initial weights are drawn from the seed alone (kt_moe_layers_init), not from the rank or the
 * world size, so a run on W ranks starts from exactly the weights of the same run on one
 * rank. */
#include <string.h>

#include "tools/kt-train/train.h"

/* The intermediate size for the moe ops that leave it open: --moe-inter, else 2 * H (the
 * same H for all of them). An op that says its own size wants --moe-inter to agree. */
static int intermediate_for(const train_args *a, const kt_program *p, int64_t *inter_out)
{
    int64_t fallback = a->moe_inter;
    for (int i = 0; i < kt_program_moe_count(p); i++) {
        kt_program_moe info;
        if (kt_program_moe_info(p, i, &info) != KT_OK)
            return train_fail("cannot read the program's moe ops", kt_last_error());
        if (info.intermediate > 0 && a->moe_inter > 0 && info.intermediate != a->moe_inter)
            return train_error("--moe-inter %lld: moe node '%s' is written for experts of "
                               "intermediate size %lld", (long long)a->moe_inter, info.name,
                               (long long)info.intermediate);
        if (info.intermediate > 0 || a->moe_inter > 0)
            continue;
        if (fallback > 0 && fallback != 2 * info.hidden)
            return train_error("moe ops of different hidden sizes leave the experts' "
                               "intermediate size open (moe node '%s': H=%lld): give "
                               "--moe-inter", info.name, (long long)info.hidden);
        fallback = 2 * info.hidden;
    }
    *inter_out = fallback;
    return 0;
}

static int layer_options(const train_args *a, const kt_program *p, const ranks *r,
                         kt_moe_layers_options *o)
{
    *o = (kt_moe_layers_options){.weight_dtype = a->moe_dtype,
                                 .quant = a->moe_quant,
                                 .quant_group = a->moe_group,
                                 .mode = a->moe_mode,
                                 .lora_rank = a->lora_rank,
                                 .lora_alpha = a->lora_alpha,
                                 .world = r->world,
                                 .rank = r->rank,
                                 .parallel = a->moe_parallel};
    return intermediate_for(a, p, &o->intermediate);
}

int moe_setup(kt_moe_layers *m, const train_args *a, const kt_program *p, const ranks *r,
              kt_threadpool *pool)
{
    memset(m, 0, sizeof *m);
    kt_moe_layers_options o;
    if (layer_options(a, p, r, &o) != 0)
        return 1;
    if (kt_moe_layers_create(p, &o, pool, m) != KT_OK)
        return train_fail("cannot create the MoE layers", kt_last_error());
    if (a->experts == NULL && kt_moe_layers_init(m, a->seed) != KT_OK)
        return train_fail("cannot initialise the experts", kt_last_error());
    if (a->experts != NULL && r->rank == 0 && kt_moe_layers_load(m, a->experts) != KT_OK)
        return train_fail("cannot load the experts", kt_last_error());
    return 0;
}

int moe_memory_need(const train_args *a, const kt_program *p, const ranks *r, int states,
                    uint64_t *bytes_out)
{
    kt_moe_layers_options o;
    if (layer_options(a, p, r, &o) != 0)
        return 1;
    if (kt_moe_layers_memory_need(p, &o, states, bytes_out) != KT_OK)
        return train_fail("cannot size the MoE layers", kt_last_error());
    return 0;
}

void moe_store_bytes(const kt_moe_layers *m, uint64_t *held, uint64_t *raw)
{
    *held = *raw = 0;
    for (int b = 0; b < m->n; b++)
        if (m->layers[b] != NULL) {
            kt_moe_memory mem;
            kt_moe_get_memory(m->layers[b], &mem);
            *held += mem.weight_bytes;
            *raw += mem.raw_weight_bytes;
        }
}

const kt_moe_config *moe_first_config(const kt_moe_layers *m)
{
    for (int b = 0; b < m->n; b++)
        if (m->layers[b] != NULL)
            return kt_moe_get_config(m->layers[b]);
    return NULL;
}
