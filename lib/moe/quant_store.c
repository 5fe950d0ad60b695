/* The quantized expert store (kt_moe_config.quant): the configuration's checks, the store's
 * size, and each (expert, projection)'s matrix descriptor over the store's bytes. */
#include <stdio.h>
#include <stdlib.h>

#include "lib/core/error.h"
#include "lib/moe/moe_internal.h"

#define BLOCK_ALIGN 64

const char *kt_moe_quant_name(kt_moe_quant quant)
{
    switch (quant) {
    case KT_MOE_QUANT_NONE: return "none";
    case KT_MOE_QUANT_INT8: return "int8";
    case KT_MOE_QUANT_INT4: return "int4";
    default: return NULL;
    }
}

kt__qfmt kt__moe_qfmt(const kt_moe_config *c)
{
    return c->quant == KT_MOE_QUANT_INT8   ? KT__Q_INT8
           : c->quant == KT_MOE_QUANT_INT4 ? KT__Q_INT4
                                           : KT__Q_NONE;
}

int64_t kt__moe_quant_group(const kt_moe_config *c)
{
    return c->quant_group > 0 ? c->quant_group : 64;
}

kt_status kt__moe_quant_check(const kt_moe_config *c, const char *name)
{
    if (c->quant == KT_MOE_QUANT_NONE)
        return KT_OK;
    if (kt_moe_quant_name(c->quant) == NULL)
        return kt__error(KT_EINVAL, "moe '%s': unknown quant %d (kt_moe_quant)", name,
                         (int)c->quant);
    if (c->mode == KT_MOE_FULL)
        return kt__error(KT_EINVAL,
                         "moe '%s': %s experts are frozen: full mode would train the weights, which "
                         "have no gradient when quantized (use LoRA, or bf16/f32 experts)",
                         name, kt_moe_quant_name(c->quant));
    if (c->weight_dtype != KT_BF16)
        return kt__error(KT_EINVAL,
                         "moe '%s': %s experts need weight_dtype bf16 (the dtype their kernels "
                         "take the activations in), got %s",
                         name, kt_moe_quant_name(c->quant), kt_dtype_name(c->weight_dtype));
    if (c->quant_group < 0)
        return kt__error(KT_EINVAL, "moe '%s': quant_group %d is negative", name, c->quant_group);
    char why[160];
    const kt__qfmt f = kt__moe_qfmt(c);
    const int64_t g = kt__moe_quant_group(c);
    if (!kt__q_layout_ok(f, c->hidden, g, why, sizeof why))
        return kt__error(KT_EINVAL, "moe '%s': hidden %lld (gate/up's input): %s", name,
                         (long long)c->hidden, why);
    if (!kt__q_layout_ok(f, c->intermediate, g, why, sizeof why))
        return kt__error(KT_EINVAL, "moe '%s': intermediate %lld (down's input): %s", name,
                         (long long)c->intermediate, why);
    return KT_OK;
}

/* Bytes of one projection's block: values, then scales, rounded up so each block is aligned. */
static size_t proj_bytes(const kt_moe_config *c, int proj)
{
    const int64_t rows = proj == KT_MOE_DOWN ? c->hidden : c->intermediate;
    const int64_t cols = proj == KT_MOE_DOWN ? c->intermediate : c->hidden;
    const kt__qfmt f = kt__moe_qfmt(c);
    const size_t b = kt__q_value_bytes(f, rows, cols) +
                     kt__q_scale_bytes(f, rows, cols, kt__moe_quant_group(c));
    return (b + BLOCK_ALIGN - 1) / BLOCK_ALIGN * BLOCK_ALIGN;
}

size_t kt__moe_quant_expert_bytes(const kt_moe_config *c)
{
    return proj_bytes(c, KT_MOE_GATE) + proj_bytes(c, KT_MOE_UP) + proj_bytes(c, KT_MOE_DOWN);
}

kt_status kt__moe_quant_bind(kt_moe *m)
{
    m->store.qmat = calloc((size_t)m->dim.E * 3, sizeof *m->store.qmat);
    if (m->store.qmat == NULL)
        return kt__error(KT_ENOMEM, "moe '%s': out of memory", m->name);
    unsigned char *at = m->store.weights;
    for (int64_t e = 0; e < m->dim.E; e++)
        for (int p = 0; p < 3; p++) {
            kt__q_bind(&m->store.qmat[e * 3 + p], kt__moe_qfmt(&m->cfg), kt__moe_proj_out(m, p),
                       kt__moe_proj_in(m, p), kt__moe_quant_group(&m->cfg), at);
            at += proj_bytes(&m->cfg, p);
        }
    return KT_OK;
}
