/* The flat views of a layer's trainable values (see trainable.h). */
#include "lib/moe/moe_internal.h"
#include "lib/moe/trainable.h"

int64_t kt__moe_trainable(kt_moe *m, float **param_out, float **grad_out)
{
    switch (m->cfg.mode) {
    case KT_MOE_LORA:
        *param_out = m->train.lora;
        *grad_out = m->train.lora_grad;
        return m->dim.E * 3 * m->dim.R * (m->dim.H + m->dim.I);
    case KT_MOE_FULL:
        if (m->dim.bf16)
            return -1;
        /* the store is [E][gate, up, down] of H*I each, as the gradients are */
        *param_out = (float *)(void *)m->store.weights;
        *grad_out = m->train.weight_grad;
        return m->dim.E * 3 * m->dim.H * m->dim.I;
    default:
        return 0;
    }
}

void kt__moe_session_poison(kt_moe *moe) { kt__moe_poison(moe); }

kt_status kt__moe_session_check(const kt_moe *moe, const char *what)
{
    return kt__moe_check_poison(moe, what);
}

void kt__moe_retain(kt_moe *moe) { atomic_fetch_add(&moe->extra_refs, 1); }

int kt__moe_release(kt_moe *moe) { return atomic_fetch_sub(&moe->extra_refs, 1) == 0; }
