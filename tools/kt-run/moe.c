/* kt-run's MoE layers (run_moe.h): created from the program, their experts read from the
 * parameters file by the moe ops' names (the session's kt_session_load does the reading), and
 * their gradients written under the same names with "grad." in front, as a transformers
 * script names a checkpoint's gradients. */
#include <stdio.h>
#include <string.h>

#include "tools/kt-run/run_moe.h"

static int fail(const char *what, const char *detail)
{
    fprintf(stderr, "kt-run: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    return 1;
}

int run_moe_create(const kt_program *p, const run_moe_args *a, kt_threadpool *pool,
                   kt_moe_layers *m)
{
    for (int i = 0; i < kt_program_moe_count(p); i++) {
        kt_program_moe info;
        if (kt_program_moe_info(p, i, &info) != KT_OK)
            return fail("cannot read the program's moe ops", kt_last_error());
        if (info.intermediate > 0 && a->inter > 0 && info.intermediate != a->inter) {
            fprintf(stderr, "kt-run: --moe-inter %lld: moe node '%s' is written for experts of "
                    "intermediate size %lld\n", (long long)a->inter, info.name,
                    (long long)info.intermediate);
            return 1;
        }
        if (info.intermediate == 0 && a->inter == 0) {
            fprintf(stderr, "kt-run: moe node '%s' (layer %d) does not say its experts' "
                    "intermediate size: give --moe-inter\n", info.name, info.binding);
            return 1;
        }
    }
    const kt_moe_layers_options o = {.weight_dtype = a->dtype,
                                     .mode = a->mode,
                                     .lora_rank = a->lora_rank,
                                     .lora_alpha = a->lora_alpha,
                                     .intermediate = a->inter};
    if (kt_moe_layers_create(p, &o, pool, m) != KT_OK)
        return fail("cannot create the MoE layers", kt_last_error());
    return 0;
}

/* Whether the file has the tensor (NULL file: no). */
static int has(const kt_st_file *f, const char *name)
{
    kt_tensor view;
    int yes = f != NULL && kt_st_find(f, name, &view) == KT_OK;
    kt_clear_error();
    return yes;
}

/* The first expert's gate weight (which_suffix 0) or its LoRA A (1), under the op's names. */
static int first_name(const kt_program_moe *info, int adapter, char *buf, size_t size)
{
    if (kt_moe_tensor_name(info->names, info->binding, 0, KT_MOE_GATE,
                           adapter ? "lora_A.weight" : "weight", buf, size) != KT_OK)
        return fail("cannot name the experts' tensors", kt_last_error());
    return 0;
}

int run_moe_check_params(const kt_program *p, const kt_moe_layers *m, const char *params,
                         int allow_missing)
{
    kt_st_file *f = NULL;
    if (params != NULL && kt_st_open(params, &f) != KT_OK)
        return fail("cannot read the parameters", kt_last_error());
    const char *file = params != NULL ? params : "(no --params)";
    int rc = 0, init = 0;
    for (int i = 0; i < kt_program_moe_count(p) && rc == 0; i++) {
        kt_program_moe info;
        char name[512];
        if (kt_program_moe_info(p, i, &info) != KT_OK) {
            rc = fail("cannot read the program's moe ops", kt_last_error());
            break;
        }
        const kt_moe *layer = m->layers[info.binding];
        if ((rc = first_name(&info, 0, name, sizeof name)) != 0)
            break;
        if (!has(f, name)) {
            if (!allow_missing) {
                fprintf(stderr, "kt-run: %s: no tensor '%s': the experts of moe node '%s' "
                        "(layer %d) are missing (--allow-missing runs them on initial "
                        "values)\n", file, name, info.name, info.binding);
                rc = 1;
            }
            init = 1;
            continue;
        }
        if (kt_moe_get_config(layer)->mode != KT_MOE_LORA)
            continue;
        if ((rc = first_name(&info, 1, name, sizeof name)) != 0)
            break;
        if (!has(f, name) && !allow_missing) {
            fprintf(stderr, "kt-run: %s: no tensor '%s': moe node '%s' (layer %d) has no LoRA "
                    "adapters there (--allow-missing starts them as a new layer does: A "
                    "random, B zero)\n", file, name, info.name, info.binding);
            rc = 1;
        }
    }
    kt_st_close(f);
    /* experts the file lacks start from the seed (a file with some layers' experts and not
     * others is refused by kt_session_load, naming the first it lacks) */
    if (rc == 0 && init && kt_moe_layers_init(m, 0) != KT_OK)
        rc = fail("cannot initialise the experts", kt_last_error());
    return rc;
}

int run_moe_gradients(const kt_program *p, const kt_moe_layers *m,
                      int (*add)(void *ctx, const char *name, const kt_tensor *t), void *ctx)
{
    static const char *const suffix[2] = {"lora_A.weight", "lora_B.weight"};
    for (int i = 0; i < kt_program_moe_count(p); i++) {
        kt_program_moe info;
        if (kt_program_moe_info(p, i, &info) != KT_OK)
            return fail("cannot read the program's moe ops", kt_last_error());
        kt_moe *layer = m->layers[info.binding];
        const kt_moe_config *c = kt_moe_get_config(layer);
        if (c->mode == KT_MOE_FROZEN)
            continue;
        for (int64_t e = 0; e < c->n_experts; e++)
            for (int proj = 0; proj < 3; proj++)
                for (int k = 0; k < (c->mode == KT_MOE_LORA ? 2 : 1); k++) {
                    char name[512] = "grad.";
                    kt_tensor g;
                    kt_status st =
                        c->mode == KT_MOE_LORA
                            ? kt_moe_lora_grad(layer, e, (kt_moe_proj)proj, k, &g)
                            : kt_moe_weight_grad(layer, e, (kt_moe_proj)proj, &g);
                    if (st == KT_OK)
                        st = kt_moe_tensor_name(info.names, info.binding, e, (kt_moe_proj)proj,
                                                c->mode == KT_MOE_LORA ? suffix[k] : "weight",
                                                name + 5, sizeof name - 5);
                    if (st != KT_OK)
                        return fail("cannot read an expert's gradient", kt_last_error());
                    if (add(ctx, name, &g) != 0)
                        return 1;
                }
    }
    return 0;
}
