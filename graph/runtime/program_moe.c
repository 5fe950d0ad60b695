/* The public query of a program's moe nodes (kt_program_moe_count / _info in kt/program.h):
 * what a trainer needs to create the MoE layers a session binds. It lives apart from the
 * generic runtime, which names no op: this file only reads the forward schedule (the moe
 * steps, the router that chose their ids) and the generic KT__STEP_STATE_RECOMPUTES flag,
 * whose meaning for moe is "the layer keeps no intermediates". */
#include "lib/core/error.h"
#include "graph/program_internal.h"

/* The forward moe steps in schedule order (recompute clones live in the backward part). */
static const kt__pstep *moe_step(const kt_program *p, int i)
{
    for (int32_t at = 0, seen = 0; at < p->n_forward; at++) {
        const kt__pstep *ps = &p->steps[at];
        if (ps->kind == KT__STEP_FORWARD && ps->op == KT_OP_MOE && seen++ == i)
            return ps;
    }
    return NULL;
}

int kt_program_moe_count(const kt_program *p)
{
    int n = 0;
    for (int32_t at = 0; p != NULL && at < p->n_forward; at++)
        n += p->steps[at].kind == KT__STEP_FORWARD && p->steps[at].op == KT_OP_MOE;
    return n;
}

/* E is not an attribute of the moe op: it is the width of the router logits that the ids
 * were chosen from, when a topk_router op chose them. */
static int64_t experts_of(const kt_program *p, int32_t ids_buf)
{
    for (int32_t at = 0; at < p->n_forward; at++) {
        const kt__pstep *ps = &p->steps[at];
        if (ps->kind == KT__STEP_FORWARD && ps->op == KT_OP_TOPK_ROUTER && ps->out[0] == ids_buf)
            return p->bufs[ps->in[0]].meta.shape[1];
    }
    return 0;
}

kt_status kt_program_moe_info(const kt_program *p, int i, kt_program_moe *info_out)
{
    if (p == NULL || info_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_moe_info: NULL argument");
    const kt__pstep *ps = i >= 0 ? moe_step(p, i) : NULL;
    if (ps == NULL)
        return kt__error(KT_EINVAL, "kt_program_moe_info: index %d out of range (the program "
                         "has %d moe ops)", i, kt_program_moe_count(p));
    const kt_tensor *x = &p->bufs[ps->in[0]].meta, *ids = &p->bufs[ps->in[1]].meta;
    /* validation has checked the moe step's shapes: x [T,H], ids [T,k] */
    *info_out =
        (kt_program_moe){.name = ps->name >= 0 ? kt__strings_get(&p->strings, ps->name) : "",
                         .binding = ps->attrs.binding,
                         .tokens = x->shape[0],
                         .hidden = x->shape[1],
                         .top_k = ids->shape[1],
                         .n_experts = experts_of(p, ps->in[1]),
                         .act_dtype = x->dtype,
                         .keep_activations = !(ps->flags & KT__STEP_STATE_RECOMPUTES),
                         .intermediate = ps->attrs.moe_intermediate,
                         .names = ps->attrs.moe_names,
                         .parallel = ps->attrs.moe_parallel};
    return KT_OK;
}
