/* A program's MoE layers from one safetensors file of experts (kt_moe_layers_load,
 * kt/program.h): every layer under its own names, and nothing else in the file, so that the
 * experts of another model (more layers, more experts, adapters a run would drop) are refused
 * rather than loaded in part. */
#include "kt/program.h"
#include "lib/core/error.h"
#include "lib/moe/trainable.h"

static kt_status check_no_extra(const kt_moe_layers *m, const kt_st_file *f, const char *path)
{
    const kt_moe_config *first = NULL;
    int n_layers = 0;
    for (int b = 0; b < m->n; b++)
        if (m->layers[b] != NULL) {
            first = first ? first : kt_moe_get_config(m->layers[b]);
            n_layers++;
        }
    for (size_t i = 0; i < kt_st_count(f); i++) {
        const char *name = NULL;
        kt_tensor view;
        KT__TRY(kt_st_entry(f, i, &name, &view));
        int known = 0;
        for (int b = 0; b < m->n && !known; b++) {
            if (m->layers[b] == NULL)
                continue;
            kt__moe_naming nm = kt__moe_own_naming(m->layers[b]);
            known = kt__moe_names_tensor(m->layers[b], &nm, name);
        }
        if (known)
            continue;
        const int lora = first != NULL && first->mode == KT_MOE_LORA;
        return kt__error(KT_EINVAL, "%s: tensor '%s' is not one this run loads (%d MoE layer%s "
                         "of %lld experts%s): the experts of another model?", path, name,
                         n_layers, n_layers == 1 ? "" : "s",
                         (long long)(first ? first->n_experts : 0),
                         lora ? ", with LoRA adapters"
                              : "; LoRA adapters load in LoRA mode");
    }
    return KT_OK;
}

kt_status kt_moe_layers_load(const kt_moe_layers *layers, const char *path)
{
    if (layers == NULL || path == NULL)
        return kt__error(KT_EINVAL, "kt_moe_layers_load: NULL argument");
    kt_st_file *f = NULL;
    KT__TRY(kt_st_open(path, &f));
    kt_status st = check_no_extra(layers, f, path);
    /* every layer checked before any is copied */
    for (int dry = 1; dry >= 0 && st == KT_OK; dry--)
        for (int b = 0; b < layers->n && st == KT_OK; b++) {
            kt_moe *l = layers->layers[b];
            if (l == NULL)
                continue;
            kt__moe_naming nm = kt__moe_own_naming(l);
            if ((st = kt__moe_load_named(l, f, &nm, dry)) != KT_OK)
                kt__error_context(st, "%s: MoE layer %d", path, b);
        }
    kt_st_close(f);
    return st;
}
