/* The CPU MoE layers. The program says how many moe ops there are and their shapes
 * (kt_program_moe_info: H and k from the op's inputs, E from the router that chose the ids);
 * the options say the rest (I, weight dtype, training mode). With several ranks only rank 0
 * creates them: the session's moe op gathers every rank's rows to rank 0 and runs its layers
 * on the whole batch, so rank 0 sizes them for W times the per-rank token count.
 *
 * Initial weights are drawn from the seed alone (not from the rank or the world size), like
 * nn.Linear's: uniform in +-1/sqrt(fan_in). So a run on W ranks starts from exactly the
 * weights of the same run on one rank. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/kt-train/train.h"

#define LORA_RANK 8
#define LORA_ALPHA 16.0f

/* splitmix64 */
static uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* One independent stream per (layer, expert, projection), so that the weights do not depend
 * on the order the layers are created in. */
static void init_weight(kt_tensor *w, uint64_t seed, int layer, int64_t expert, int proj)
{
    uint64_t state = mix(mix(mix(seed ^ 0x6d6f65ull) ^ (uint64_t)layer) ^ (uint64_t)expert);
    state = mix(state ^ (uint64_t)proj);
    double limit = 1.0 / sqrt((double)w->shape[1]); /* [out, in] */
    for (int64_t i = 0; i < kt_tensor_numel(w); i++) {
        state = mix(state);
        float v = (float)(limit * (2.0 * (double)(state >> 11) / 9007199254740992.0 - 1.0));
        if (w->dtype == KT_BF16)
            ((uint16_t *)w->data)[i] = kt_f32_to_bf16_1(v);
        else
            ((float *)w->data)[i] = v;
    }
}

static int init_layer(kt_moe *m, const train_args *a, int layer)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    for (int64_t e = 0; e < c->n_experts; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor w;
            if (kt_moe_weight(m, e, (kt_moe_proj)p, &w) != KT_OK)
                return train_fail("cannot initialise the experts", kt_last_error());
            init_weight(&w, a->seed, layer, e, p);
        }
    return 0;
}

/* The layer configuration of moe op `i`; 0 or 1 after printing why it cannot be made. */
static int layer_config(const train_args *a, const kt_program_moe *info, const ranks *r,
                        kt_moe_config *c, char *name, size_t name_size)
{
    if (kt_program_moe_config(info, a->moe_inter > 0 ? a->moe_inter : 2 * info->hidden,
                              a->moe_dtype, a->moe_mode, LORA_RANK, LORA_ALPHA, r->world,
                              c) != KT_OK)
        return train_error("%s", kt_last_error());
    snprintf(name, name_size, "moe.%d", info->binding);
    c->name = name;
    return 0;
}

/* The slots array covers every binding the program uses. */
static int alloc_slots(moe_layers *m, const kt_program *p)
{
    int max_binding = -1;
    for (int i = 0; i < m->n_ops; i++) {
        kt_program_moe info;
        if (kt_program_moe_info(p, i, &info) != KT_OK)
            return train_fail("cannot read the program's moe ops", kt_last_error());
        if (info.binding < 0 || info.binding >= KT_MOE_MAX_LAYERS) {
            train_error("moe node '%s' runs layer %d: kt-train creates layers 0 to "
                        "%d",
                        info.name, info.binding, KT_MOE_MAX_LAYERS - 1);
            return 1;
        }
        if (info.binding > max_binding)
            max_binding = info.binding;
    }
    m->n = max_binding + 1;
    m->layers = calloc((size_t)(m->n > 0 ? m->n : 1), sizeof *m->layers);
    return m->layers == NULL ? train_fail("out of memory", NULL) : 0;
}

/* Whether `name` is a tensor of one of this run's layers, as kt_moe_save names them:
 * "moe.<layer>.experts.<e>.<gate|up|down>_proj.weight" (and lora_A / lora_B in LoRA mode). */
static int is_expert_tensor(const moe_layers *m, const char *name)
{
    int b = -1, used = -1;
    long long e = -1;
    char proj[16], kind[16];
    if (sscanf(name, "moe.%d.experts.%lld.%15[a-z]_proj.%15[A-Za-z_.]%n", &b, &e, proj, kind,
               &used) != 4 ||
        used != (int)strlen(name) || b < 0 || b >= m->n || m->layers[b] == NULL)
        return 0;
    const kt_moe_config *c = kt_moe_get_config(m->layers[b]);
    const int lora = c->mode == KT_MOE_LORA;
    return e >= 0 && e < c->n_experts &&
           (!strcmp(proj, "gate") || !strcmp(proj, "up") || !strcmp(proj, "down")) &&
           (!strcmp(kind, "weight") ||
            (lora && (!strcmp(kind, "lora_A.weight") || !strcmp(kind, "lora_B.weight"))));
}

/* Every tensor of the file must be one the run loads: a file for more experts or layers, or
 * with LoRA adapters for a run that is not in LoRA mode, is refused rather than loaded in
 * part (that would train from another model's weights, with its adapters dropped). */
static int check_no_extra_experts(const moe_layers *m, const kt_st_file *f, const char *path)
{
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name = NULL;
        kt_tensor view;
        if (kt_st_entry(f, i, &name, &view) != KT_OK)
            return train_fail("cannot read the experts", kt_last_error());
        if (is_expert_tensor(m, name))
            continue;
        const int lora = m->first.mode == KT_MOE_LORA;
        train_error("%s: tensor '%s' is not one this run loads (MoE layers 0-%d "
                    "of %lld experts%s): the experts of another model?",
                    path, name, m->n - 1, (long long)m->first.n_experts,
                    lora ? ", with LoRA adapters" : "; LoRA adapters load with --moe-mode lora");
        return 1;
    }
    return 0;
}

static int load_experts(moe_layers *m, const char *path)
{
    kt_st_file *f;
    if (kt_st_open(path, &f) != KT_OK)
        return train_fail("cannot read the experts", kt_last_error());
    int rc = check_no_extra_experts(m, f, path);
    for (int b = 0; b < m->n && rc == 0; b++) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "moe.%d.", b);
        if (m->layers[b] != NULL && kt_moe_load(m->layers[b], f, prefix) != KT_OK)
            rc = train_error("cannot load the experts from %s: %s", path, kt_last_error());
    }
    kt_st_close(f);
    return rc;
}

int moe_setup(moe_layers *m, const train_args *a, const kt_program *p, const ranks *r,
              kt_threadpool *pool)
{
    memset(m, 0, sizeof *m);
    m->n_ops = kt_program_moe_count(p);
    if (m->n_ops == 0)
        return 0;
    if (alloc_slots(m, p) != 0)
        return 1;
    if (r->rank == 0 && kt_moe_scratch_create(-1, &m->scratch) != KT_OK)
        return train_fail("cannot create the MoE scratch", kt_last_error());
    for (int i = 0; i < m->n_ops; i++) {
        kt_program_moe info;
        kt_moe_config c;
        char name[32];
        kt_program_moe_info(p, i, &info);
        if (layer_config(a, &info, r, &c, name, sizeof name) != 0)
            return 1;
        c.scratch = m->scratch;
        m->n_recompute += !c.keep_activations;
        if (i == 0)
            m->first = c, m->first.name = NULL;
        if (r->rank != 0 || m->layers[info.binding] != NULL)
            continue; /* rank 0 owns the experts; a binding used twice: the session says so */
        if (kt_moe_create(&c, pool, &m->layers[info.binding]) != KT_OK) {
            train_error("cannot create MoE layer %d for moe node '%s': %s", info.binding, info.name,
                        kt_last_error());
            return 1;
        }
        if (a->experts == NULL && init_layer(m->layers[info.binding], a, info.binding) != 0)
            return 1;
    }
    if (a->experts != NULL && r->rank == 0)
        return load_experts(m, a->experts);
    return 0;
}

int moe_memory_need(const train_args *a, const kt_program *p, const ranks *r, int states,
                    uint64_t *bytes_out)
{
    uint64_t total = 0;
    const int n_ops = kt_program_moe_count(p);
    for (int i = 0; i < n_ops && r->rank == 0; i++) { /* rank 0 owns the experts */
        kt_program_moe info;
        kt_moe_config c;
        char name[32];
        uint64_t bytes;
        if (kt_program_moe_info(p, i, &info) != KT_OK)
            return train_fail("cannot read the program's moe ops", kt_last_error());
        if (layer_config(a, &info, r, &c, name, sizeof name) != 0)
            return 1;
        if (kt_moe_memory_need(&c, states, &bytes) != KT_OK)
            return train_error("MoE layer %d for moe node '%s' (--moe-inter %lld): %s",
                               info.binding, info.name, (long long)c.intermediate, kt_last_error());
        total += bytes;
    }
    *bytes_out = total;
    return 0;
}

void moe_free(moe_layers *m)
{
    for (int b = 0; b < m->n; b++)
        kt_moe_destroy(m->layers[b]);
    kt_moe_scratch_destroy(m->scratch); /* after its layers */
    free(m->layers);
    memset(m, 0, sizeof *m);
}
