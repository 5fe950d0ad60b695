/* Activation checkpointing as a rewrite of the schedule, before lifetimes and the memory plan.
 *
 * The forward nodes are cut into segments (explicit `checkpoint` blocks, grouped k at a time,
 * or about sqrt(n) of them). For every segment but the last, the backward steps of its nodes
 * stop reading the activations the segment computed; instead the segment's forward steps are
 * cloned into the backward schedule, right before the first backward step that needs them,
 * and the backward reads the clones. The lifetimes pass then lets the original activations
 * die during the forward pass and the clones live only until the segment's backward is done.
 * Values the segment hands to later nodes (its outputs) are read by those nodes and so stay:
 * they are the checkpoints. The clones run the same kernels on the same inputs, so gradients
 * are bitwise those of the uncheckpointed program.
 *
 * Nodes on the save-list (kt_graph_mark_save, or ops the table marks must-save) are never
 * cloned: their outputs are kept, and the clones read them.
 *
 * A stateful op may keep intermediates for its backward outside the plan (its state). In a
 * recomputed segment, where the graph trades compute for memory, the pass marks the forward
 * step of an op whose hooks ask for it (kt__op_state.state_recompute)
 * KT__STEP_STATE_RECOMPUTES: whoever creates the op's state creates it keeping none there, so
 * that its backward recomputes them. What that costs and saves is the op's to say (see
 * lib/ops/moe_state.c for the first user). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/compiler/compiler.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"

/* [first, last) node ranges */
typedef struct range {
    int32_t first, last;
} range;

static int must_save(const kt__compiler *c, int32_t node)
{
    const kt__gnode *n = &c->g->nodes[node];
    return n->must_save || (!c->opt.recompute_must_save && kt__op_get(n->op)->must_save);
}

/* The checkpointable units: the explicit blocks, or else every node on its own. */
static int32_t units(const kt__compiler *c, range *out)
{
    const kt_graph *g = c->g;
    if (g->n_segments > 0) {
        for (int32_t i = 0; i < g->n_segments; i++)
            out[i] = (range){g->segments[i].first, g->segments[i].last};
        return g->n_segments;
    }
    int32_t n = 0;
    for (int32_t node = 0; node < g->n_nodes; node++)
        if (c->node_live[node])
            out[n++] = (range){node, node + 1};
    return n;
}

typedef struct rewrite {
    kt__compiler *c;
    int32_t *clone_of;   /* buffer -> its clone in the segment being rewritten, or -1 */
    char *needed;        /* node -> a clone of it is needed */
    kt__pstep *clones;   /* the segment's clone steps, in forward order */
    int32_t n_clones;
} rewrite;

static int reads(const kt__pstep *s, int out_side, int32_t i)
{
    const kt__op_desc *d = kt__op_get(s->op);
    return out_side ? (d->bwd_reads_out >> i) & 1u : (d->bwd_reads_in >> i) & 1u;
}

static int in_segment(const kt__pstep *s, range seg)
{
    return s->node >= seg.first && s->node < seg.last;
}

/* Marks the nodes whose clones the segment's backward needs: those producing an activation
 * a backward step of the segment reads, and (transitively) what those clones read. */
static void mark_needed(rewrite *rw, range seg, const int32_t *producer)
{
    kt__compiler *c = rw->c;
    for (int32_t at = c->n_forward; at < c->n_steps; at++) {
        const kt__pstep *s = &c->steps[at];
        if (s->kind != KT__STEP_BACKWARD || !in_segment(s, seg))
            continue;
        for (int32_t i = 0; i < s->n_in; i++)
            if (reads(s, 0, i) && producer[s->in[i]] >= seg.first && producer[s->in[i]] < seg.last)
                rw->needed[producer[s->in[i]]] = 1;
        for (int32_t o = 0; o < s->n_out; o++)
            if (reads(s, 1, o) && producer[s->out[o]] >= seg.first &&
                producer[s->out[o]] < seg.last)
                rw->needed[producer[s->out[o]]] = 1;
    }
    for (int32_t n = seg.last - 1; n >= seg.first; n--) {
        if (!rw->needed[n] || must_save(c, n)) {
            rw->needed[n] = 0;
            continue;
        }
        const kt__gnode *node = &c->g->nodes[n];
        for (int32_t i = 0; i < node->n_in; i++) {
            int32_t b = c->value_buf[c->remap[node->in[i]]];
            if (b >= 0 && producer[b] >= seg.first && producer[b] < seg.last)
                rw->needed[producer[b]] = 1;
        }
    }
}

/* Builds the clone steps of a segment (forward order) and their output buffers. */
static kt_status make_clones(rewrite *rw, range seg)
{
    kt__compiler *c = rw->c;
    rw->n_clones = 0;
    for (int32_t at = 0; at < c->n_forward; at++) {
        const kt__pstep *s = &c->steps[at];
        if (!in_segment(s, seg) || !rw->needed[s->node])
            continue;
        kt__pstep k = *s;
        k.flags = KT__STEP_RECOMPUTE;
        for (int32_t i = 0; i < k.n_in; i++)
            if (rw->clone_of[k.in[i]] >= 0)
                k.in[i] = rw->clone_of[k.in[i]];
        for (int32_t o = 0; o < k.n_out; o++) {
            int32_t b;
            KT__TRY(kt__compiler_add_buf(c, &c->bufs[s->out[o]].meta, KT__REGION_ACT, &b));
            rw->clone_of[s->out[o]] = b;
            k.out[o] = b;
        }
        rw->clones[rw->n_clones++] = k;
    }
    return KT_OK;
}

/* The backward steps of the segment read the clones. Returns the first step that does. */
static int32_t redirect_backward(rewrite *rw, range seg)
{
    kt__compiler *c = rw->c;
    int32_t first = -1;
    for (int32_t at = c->n_forward; at < c->n_steps; at++) {
        kt__pstep *s = &c->steps[at];
        if (s->kind != KT__STEP_BACKWARD || !in_segment(s, seg))
            continue;
        int changed = 0;
        for (int32_t i = 0; i < s->n_in; i++)
            if (reads(s, 0, i) && rw->clone_of[s->in[i]] >= 0) {
                s->in[i] = rw->clone_of[s->in[i]];
                changed = 1;
            }
        for (int32_t o = 0; o < s->n_out; o++)
            if (reads(s, 1, o) && rw->clone_of[s->out[o]] >= 0) {
                s->out[o] = rw->clone_of[s->out[o]];
                changed = 1;
            }
        if (changed && first < 0)
            first = at;
    }
    return first;
}

/* Appends a step as it is (its scratch buffer already exists). */
static kt_status append(kt__pstep **steps, int32_t *n, int32_t *cap, const kt__pstep *s)
{
    KT__TRY(kt__grow_array((void **)steps, cap, *n, sizeof **steps, "checkpoint"));
    (*steps)[(*n)++] = *s;
    return KT_OK;
}

/* Rewrites the segments; inserts every segment's clones before its first backward use. */
static kt_status apply(kt__compiler *c, const range *segs, int32_t n_segs)
{
    kt_status status = KT_OK;
    int32_t cap_steps = 0, n_steps = 0;
    int32_t *producer = malloc(sizeof *producer * ((size_t)c->n_bufs + 1));
    int32_t *insert_at = malloc(sizeof *insert_at * ((size_t)n_segs + 1));
    kt__pstep **clones = calloc((size_t)n_segs + 1, sizeof *clones);
    int32_t *n_clones = calloc((size_t)n_segs + 1, sizeof *n_clones);
    rewrite rw = {.c = c};
    rw.needed = calloc((size_t)c->g->n_nodes + 1, 1);
    kt__pstep *steps = NULL;
    if (!producer || !insert_at || !clones || !n_clones || !rw.needed) {
        status = kt__error(KT_ENOMEM, "checkpoint: out of memory");
        goto out;
    }
    for (int32_t b = 0; b < c->n_bufs; b++)
        producer[b] = -1;
    for (int32_t at = 0; at < c->n_forward; at++)
        for (int32_t o = 0; o < c->steps[at].n_out; o++)
            producer[c->steps[at].out[o]] = c->steps[at].node;

    for (int32_t k = 0; k < n_segs; k++) {
        memset(rw.needed, 0, (size_t)c->g->n_nodes);
        mark_needed(&rw, segs[k], producer);
        /* the clones' outputs are new buffers: size the map for all of them */
        rw.clone_of = malloc(sizeof *rw.clone_of * ((size_t)c->n_bufs + 2 * (size_t)c->n_forward + 1));
        clones[k] = malloc(sizeof *clones[k] * ((size_t)c->n_forward + 1));
        if (rw.clone_of == NULL || clones[k] == NULL) {
            free(rw.clone_of);
            status = kt__error(KT_ENOMEM, "checkpoint: out of memory");
            goto out;
        }
        for (int32_t b = 0; b < c->n_bufs + 2 * c->n_forward; b++)
            rw.clone_of[b] = -1;
        rw.clones = clones[k];
        status = make_clones(&rw, segs[k]);
        if (status == KT_OK)
            insert_at[k] = redirect_backward(&rw, segs[k]);
        n_clones[k] = rw.n_clones;
        free(rw.clone_of);
        if (status != KT_OK)
            goto out;
    }
    for (int32_t at = 0; at <= c->n_steps; at++) {
        for (int32_t k = 0; k < n_segs; k++) {
            if (insert_at[k] != at)
                continue;
            for (int32_t i = 0; i < n_clones[k]; i++) {
                kt__pstep s = clones[k][i];
                /* a clone needs its own scratch: the original's lifetime is elsewhere */
                if (s.scratch >= 0) {
                    int32_t sb;
                    if ((status = kt__compiler_add_buf(c, &c->bufs[s.scratch].meta,
                                                       KT__REGION_ACT, &sb)) != KT_OK)
                        goto out;
                    s.scratch = sb;
                }
                if ((status = append(&steps, &n_steps, &cap_steps, &s)) != KT_OK)
                    goto out;
            }
        }
        if (at < c->n_steps && (status = append(&steps, &n_steps, &cap_steps, &c->steps[at])) != KT_OK)
            goto out;
    }
    free(c->steps);
    c->steps = steps;
    c->n_steps = n_steps;
    c->cap_steps = cap_steps;
    steps = NULL;
out:
    free(steps);
    free(producer);
    free(insert_at);
    for (int32_t k = 0; clones && k < n_segs; k++)
        free(clones[k]);
    free(clones);
    free(n_clones);
    free(rw.needed);
    return status;
}

int32_t kt__checkpoint_unit_count(const kt__compiler *c)
{
    if (c->g->n_segments > 0)
        return c->g->n_segments;
    int32_t n = 0;
    for (int32_t node = 0; node < c->g->n_nodes; node++)
        n += c->node_live[node] != 0;
    return n;
}

int32_t kt__checkpoint_group_size(const kt__compiler *c, int32_t n_units)
{
    const kt_checkpoint_policy *p = &c->policy;
    switch (p->kind) {
    case KT_CHECKPOINT_SEGMENTS:
        return 1;
    case KT_CHECKPOINT_EVERY_K:
        return (int32_t)(p->k < n_units ? p->k : n_units);
    case KT_CHECKPOINT_SQRTN: {
        int32_t g = (int32_t)ceil(sqrt((double)n_units));
        return g > 0 ? g : 1;
    }
    default:
        return 0;
    }
}

/* The forward steps inside the recomputed segments of ops whose state then keeps no
 * intermediates. */
static void mark_state_recompute(kt__compiler *c, const range *segs, int32_t n_segs)
{
    for (int32_t at = 0; at < c->n_forward; at++) {
        kt__pstep *s = &c->steps[at];
        if (s->kind != KT__STEP_FORWARD)
            continue;
        const kt__op_desc *d = kt__op_get(s->op);
        for (int32_t k = 0; d->state != NULL && d->state->state_recompute && k < n_segs; k++)
            if (in_segment(s, segs[k]))
                s->flags |= KT__STEP_STATE_RECOMPUTES;
    }
}

kt_status kt__pass_checkpoint(kt__compiler *c, int32_t group)
{
    if (!c->opt.training || group <= 0)
        return KT_OK;
    const kt_graph *g = c->g;
    if (c->policy.kind == KT_CHECKPOINT_SEGMENTS && g->n_segments == 0)
        return kt__error(KT_EINVAL, "checkpoint: policy 'segments' but the graph has no "
                         "checkpoint blocks");
    range *u = malloc(sizeof *u * ((size_t)g->n_nodes + (size_t)g->n_segments + 1));
    range *segs = malloc(sizeof *segs * ((size_t)g->n_nodes + (size_t)g->n_segments + 1));
    kt_status status = KT_OK;
    if (u == NULL || segs == NULL) {
        status = kt__error(KT_ENOMEM, "checkpoint: out of memory");
        goto out;
    }
    int32_t n_units = units(c, u), n_segs = 0;
    /* groups of `group` units; the last group is not recomputed (its backward comes first,
     * right after the forward, while its activations are still alive) */
    for (int32_t i = 0; i + group < n_units; i += group)
        segs[n_segs++] = (range){u[i].first, u[i + group - 1].last};
    if (n_segs > 0) {
        mark_state_recompute(c, segs, n_segs);
        status = apply(c, segs, n_segs);
    }
out:
    free(u);
    free(segs);
    return status;
}
