/* What a program says about itself: its statistics and tensor tables, and what a data loader
 * needs beyond them: the range of its integer inputs, read off the forward schedule, so it
 * works on any loaded .ktp file. (The MoE layers its moe ops run: program_moe.c.) */
#include <string.h>

#include "lib/core/error.h"
#include "graph/program_internal.h"

/* ---- statistics and tensor tables ------------------------------------------------------------ */

void kt_program_get_stats(const kt_program *p, kt_program_stats *st)
{
    memset(st, 0, sizeof *st);
    st->n_forward_steps = p->n_forward;
    st->n_backward_steps = p->n_steps - p->n_forward;
    st->n_inputs = p->n_entries[KT_ROLE_INPUT];
    st->n_params = p->n_entries[KT_ROLE_PARAM];
    st->n_outputs = p->n_entries[KT_ROLE_OUTPUT];
    st->n_buffers = p->n_bufs;
    st->arena_bytes = p->region_bytes[KT__REGION_ACT];
    st->lower_bound_bytes = p->lower_bound;
    st->param_bytes = p->region_bytes[KT__REGION_PARAM];
    st->grad_bytes = p->region_bytes[KT__REGION_GRAD];
    for (int32_t i = 0; i < p->n_steps; i++) {
        if (p->steps[i].flags & KT__STEP_RECOMPUTE) {
            st->recompute_flops += p->steps[i].flops;
            st->n_recompute_steps++;
        } else if (i < p->n_forward) {
            st->forward_flops += p->steps[i].flops;
        } else {
            st->backward_flops += p->steps[i].flops;
        }
    }
}

int kt_program_count(const kt_program *p, kt_tensor_role role)
{
    if (p == NULL)
        return 0;
    if (role == KT_ROLE_GRAD) {
        int n = 0;
        for (int32_t i = 0; i < p->n_entries[KT_ROLE_PARAM]; i++)
            n += p->entries[KT_ROLE_PARAM][i].grad_buf >= 0;
        return n;
    }
    return (unsigned)role < 3 ? p->n_entries[role] : 0;
}

kt_status kt_program_tensor_info(const kt_program *p, kt_tensor_role role, int i,
                                 const char **name_out, kt_tensor *meta_out)
{
    if (p == NULL)
        return kt__error(KT_EINVAL, "kt_program_tensor_info: program is NULL");
    int r = role == KT_ROLE_GRAD ? KT_ROLE_PARAM : (int)role;
    if ((unsigned)r >= 3)
        return kt__error(KT_EINVAL, "kt_program_tensor_info: invalid role %d", (int)role);
    const kt__pentry *e = NULL;
    if (role == KT_ROLE_GRAD) {
        for (int32_t k = 0, seen = 0; k < p->n_entries[r]; k++)
            if (p->entries[r][k].grad_buf >= 0 && seen++ == i)
                e = &p->entries[r][k];
    } else if (i >= 0 && i < p->n_entries[r]) {
        e = &p->entries[r][i];
    }
    if (e == NULL)
        return kt__error(KT_EINVAL, "kt_program_tensor_info: index %d out of range", i);
    if (name_out)
        *name_out = kt__strings_get(&p->strings, e->name);
    if (meta_out)
        *meta_out = p->bufs[role == KT_ROLE_GRAD ? e->grad_buf : e->buf].meta;
    return KT_OK;
}

kt_status kt_program_shard_dim(const kt_program *p, const char *input, int *dim_out)
{
    if (p == NULL || input == NULL || dim_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_shard_dim: NULL argument");
    for (int32_t i = 0; i < p->n_entries[KT_ROLE_INPUT]; i++) {
        const kt__pentry *e = &p->entries[KT_ROLE_INPUT][i];
        if (strcmp(kt__strings_get(&p->strings, e->name), input) == 0) {
            *dim_out = e->shard_dim;
            return KT_OK;
        }
    }
    return kt__error(KT_EINVAL, "kt_program_shard_dim: no input named '%s'", input);
}

/* ---- index bounds ---------------------------------------------------------------------------- */

/* The limit one forward step sets on buffer b when it reads it as indices, or -1. */
static int64_t bound_from(const kt_program *p, const kt__pstep *ps, int32_t b)
{
    if (ps->kind != KT__STEP_FORWARD || ps->n_in < 2 || ps->in[1] != b)
        return -1;
    if (ps->op == KT_OP_EMBEDDING)
        return p->bufs[ps->in[0]].meta.shape[0]; /* table [V, H] */
    if (ps->op == KT_OP_CROSS_ENTROPY)
        return p->bufs[ps->in[0]].meta.shape[1]; /* logits [N, V] */
    if (ps->op == KT_OP_ROPE)
        return ps->attrs.rope_max_positions; /* positions */
    return -1;
}

/* The smallest limit on buffer b's values set by the steps that read it, or by those that
 * read what shift_labels and reshape make of it (they move values without changing them;
 * shift_labels adds its ignore_index, which cross_entropy, the only reader that makes sense,
 * skips). depth bounds the walk. */
static int64_t bound_of(const kt_program *p, int32_t b, int depth)
{
    int64_t bound = -1;
    for (int32_t at = 0; at < p->n_forward; at++) {
        const kt__pstep *ps = &p->steps[at];
        int64_t v = bound_from(p, ps, b);
        if (ps->kind == KT__STEP_FORWARD && ps->n_in >= 1 && ps->in[0] == b &&
            (ps->op == KT_OP_SHIFT_LABELS || ps->op == KT_OP_RESHAPE) && ps->out[0] != b &&
            depth < 8)
            v = bound_of(p, ps->out[0], depth + 1);
        if (v >= 0 && (bound < 0 || v < bound))
            bound = v;
    }
    return bound;
}

kt_status kt_program_index_bound(const kt_program *p, const char *input, int64_t *bound_out)
{
    if (p == NULL || input == NULL || bound_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_index_bound: NULL argument");
    const kt__pentry *e = NULL;
    for (int32_t i = 0; i < p->n_entries[KT_ROLE_INPUT] && e == NULL; i++)
        if (strcmp(kt__strings_get(&p->strings, p->entries[KT_ROLE_INPUT][i].name), input) == 0)
            e = &p->entries[KT_ROLE_INPUT][i];
    if (e == NULL)
        return kt__error(KT_EINVAL, "kt_program_index_bound: no input named '%s'", input);
    const int64_t bound = bound_of(p, e->buf, 0);
    *bound_out = bound;
    return KT_OK;
}

/* ---- the context-parallel layout --------------------------------------------------------------- */

kt_status kt_program_cp_layout(const kt_program *p, kt_cp_layout *layout_out)
{
    if (p == NULL || layout_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_cp_layout: NULL argument");
    const kt__pstep *first = NULL;
    for (int32_t at = 0; at < p->n_forward; at++) {
        const kt__pstep *ps = &p->steps[at];
        if (ps->kind != KT__STEP_FORWARD || ps->op != KT_OP_CP_ATTENTION)
            continue;
        if (first == NULL)
            first = ps;
        else if (ps->attrs.cp_layout != first->attrs.cp_layout)
            return kt__error(KT_EINVAL, "kt_program_cp_layout: cp_attention '%s' has layout %s "
                             "but '%s' has %s: one sequence has one layout",
                             ps->name >= 0 ? kt__strings_get(&p->strings, ps->name) : "?",
                             ps->attrs.cp_layout == KT_CP_BALANCED ? "balanced" : "contiguous",
                             first->name >= 0 ? kt__strings_get(&p->strings, first->name) : "?",
                             first->attrs.cp_layout == KT_CP_BALANCED ? "balanced"
                                                                       : "contiguous");
    }
    *layout_out = first ? first->attrs.cp_layout : KT_CP_CONTIGUOUS;
    return KT_OK;
}
