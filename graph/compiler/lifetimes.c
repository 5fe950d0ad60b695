/* Liveness and in-place sharing.
 *
 * A buffer lives from the step that writes it to the last step that reads it. Graph inputs,
 * which the caller writes before forward, live from step 0 to the end (an input is written
 * once and may be read by any later forward). A backward step reads only what its op's
 * table row says the backward needs (bwd_reads_in / bwd_reads_out); that is what lets
 * activations die during the forward pass. Outputs and the loss are pinned: alive to the
 * end, never shared.
 *
 * In place: a forward step's output may take its input's memory when the op's row allows
 * it, the input dies at that step, and the input is neither a graph input nor pinned (a
 * saved, cached or output buffer is never overwritten). */
#include <stdlib.h>

#include "lib/core/error.h"
#include "graph/compiler/compiler.h"
#include "lib/ops/op_desc.h"

static void touch(kt__compiler *c, int32_t buf, int32_t step)
{
    if (buf < 0)
        return;
    kt__cbuf *b = &c->bufs[buf];
    if (b->region != KT__REGION_ACT)
        return;
    if (b->first < 0 || step < b->first)
        b->first = step;
    if (step > b->last)
        b->last = step;
}

static void step_uses(kt__compiler *c, const kt__pstep *s, int32_t at)
{
    const kt__op_desc *d = s->kind == KT__STEP_FORWARD || s->kind == KT__STEP_BACKWARD
                               ? kt__op_get(s->op)
                               : NULL;
    for (int32_t i = 0; i < s->n_in; i++)
        if (s->kind != KT__STEP_BACKWARD || (d->bwd_reads_in & (1u << i)))
            touch(c, s->in[i], at);
    for (int32_t o = 0; o < s->n_out; o++)
        if (s->kind != KT__STEP_BACKWARD || (d->bwd_reads_out & (1u << o)))
            touch(c, s->out[o], at);
    if (s->kind == KT__STEP_BACKWARD) {
        for (int32_t o = 0; o < s->n_out; o++)
            touch(c, s->gout[o], at);
        for (int32_t i = 0; i < s->n_in; i++)
            touch(c, s->gin[i], at);
    }
    touch(c, s->scratch, at);
}

static int32_t storage_root(const kt__compiler *c, int32_t b)
{
    while (c->bufs[b].storage != b)
        b = c->bufs[b].storage;
    return b;
}

static kt_status share_in_place(kt__compiler *c)
{
    /* per storage root: the last step at which any buffer sharing it is alive (a buffer
     * shares directly with its root, so this is kept up to date as buffers join) */
    int32_t *root_last = malloc(sizeof *root_last * ((size_t)c->n_bufs + 1));
    if (root_last == NULL)
        return kt__error(KT_ENOMEM, "compile: out of memory");
    for (int32_t b = 0; b < c->n_bufs; b++)
        root_last[b] = c->bufs[b].last;
    for (int32_t at = 0; at < c->n_steps; at++) {
        const kt__pstep *s = &c->steps[at];
        if (s->kind != KT__STEP_FORWARD)
            continue;
        unsigned inplace = kt__op_get(s->op)->inplace_in;
        int32_t out = s->out[0];
        for (int32_t i = 0; i < s->n_in && inplace; i++) {
            if (!(inplace & (1u << i)))
                continue;
            int32_t in = s->in[i];
            const kt__cbuf *bi = &c->bufs[in], *bo = &c->bufs[out];
            if (bi->region != KT__REGION_ACT || bi->is_input || bi->pinned || bo->pinned ||
                bi->bytes != bo->bytes || bi->bytes == 0)
                continue;
            int32_t root = storage_root(c, in);
            if (c->bufs[root].is_input || c->bufs[root].pinned || root_last[root] != at)
                continue;
            /* the same input may appear twice (add(x, x)): it must die here either way */
            int used_twice = 0;
            for (int32_t k = 0; k < s->n_in; k++)
                used_twice |= k != i && s->in[k] == in;
            if (used_twice)
                continue;
            c->bufs[out].storage = root;
            if (bo->last > root_last[root])
                root_last[root] = bo->last;
            break;
        }
    }
    free(root_last);
    return KT_OK;
}

kt_status kt__pass_lifetimes(kt__compiler *c)
{
    for (int32_t at = 0; at < c->n_steps; at++)
        step_uses(c, &c->steps[at], at);
    int32_t end = c->n_steps > 0 ? c->n_steps - 1 : 0;
    for (int32_t v = 0; v < c->g->n_values; v++) {
        int32_t b = c->value_buf[v];
        if (b < 0 || c->bufs[b].region != KT__REGION_ACT)
            continue;
        if (c->g->values[v].kind == KT__VALUE_INPUT) {
            /* written by the caller before the first step, and kept to the end: the caller
             * writes an input once through its view and may run forward again (the same
             * batch, or evaluation after a step), so no other buffer may reuse its memory */
            c->bufs[b].first = 0;
            c->bufs[b].last = end;
        }
    }
    for (int32_t o = 0; o < c->g->n_outputs; o++) {
        int32_t b = c->value_buf[c->remap[c->g->outputs[o].value]];
        if (c->bufs[b].region == KT__REGION_ACT) {
            c->bufs[b].pinned = 1;
            c->bufs[b].last = end;
        }
    }
    if (c->g->loss >= 0) {
        int32_t b = c->value_buf[c->remap[c->g->loss]];
        c->bufs[b].pinned = 1;
        c->bufs[b].last = end;
    }
    for (int32_t b = 0; b < c->n_bufs; b++) {
        kt__cbuf *buf = &c->bufs[b];
        if (buf->region == KT__REGION_ACT && buf->first < 0) /* never touched */
            buf->first = buf->last = 0;
    }
    if (!c->opt.no_inplace)
        return share_in_place(c);
    return KT_OK;
}
