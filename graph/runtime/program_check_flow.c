/* Programs: the data-flow check of validation. It follows the data through the schedule:
 * who writes each buffer (one writer, in the region its kind of step writes; never an input
 * or a parameter), who reads it (only what an earlier step wrote, or the caller did), and
 * what the caller sees after forward (every output and the loss computed there). */
#include <stdlib.h>

#include "lib/core/error.h"
#include "graph/program_internal.h"
#include "lib/ops/op_desc.h"

/* A buffer's writer: a step index, or one of these. */
enum { UNWRITTEN = -1, BY_CALLER = -2 /* inputs and parameters, through the session */ };

typedef struct flow {
    const kt_program *p;
    int32_t *writer;  /* buffer -> the step that writes it, BY_CALLER or UNWRITTEN */
    int32_t *scratch; /* buffer -> the step using it as scratch, or -1 */
} flow;

static kt_status flow_read(const flow *f, int32_t at, int32_t b)
{
    const char *why = NULL;
    if (f->p->bufs[b].region == KT__REGION_GRAD)
        why = "a gradient, which only the optimizer reads";
    else if (f->writer[b] == UNWRITTEN)
        why = "which no earlier step writes";
    if (why == NULL)
        return KT_OK;
    char st[96], bt[96];
    return kt__error(KT_EFORMAT, "%s reads %s, %s", kt__program_step_label(f->p, at, st, sizeof st),
                     kt__program_buf_label(f->p, b, bt, sizeof bt), why);
}

/* Every buffer has one writer (the compiler never reuses a buffer id; memory is shared
 * through the plan and in-place storage instead), in the region its kind of step writes. */
static kt_status flow_write(flow *f, int32_t at, int32_t b, int32_t region)
{
    const kt_program *p = f->p;
    char st[96], bt[96];
    kt__program_step_label(p, at, st, sizeof st);
    kt__program_buf_label(p, b, bt, sizeof bt);
    if (f->writer[b] == BY_CALLER)
        return kt__error(KT_EFORMAT, "%s writes %s, which only the caller writes", st, bt);
    if (p->bufs[b].region != region)
        return kt__error(KT_EFORMAT, "%s writes %s, which is outside the %s region", st, bt,
                         region == KT__REGION_GRAD ? "gradient" : "activation");
    if (f->writer[b] >= 0)
        return kt__error(KT_EFORMAT, "%s writes %s, which step %d writes already", st, bt,
                         f->writer[b]);
    if (f->scratch[b] >= 0)
        return kt__error(KT_EFORMAT, "%s writes %s, the scratch buffer of step %d", st, bt,
                         f->scratch[b]);
    f->writer[b] = at;
    return KT_OK;
}

/* A scratch buffer belongs to its step alone: nothing else writes or reads it. */
static kt_status flow_scratch(flow *f, int32_t at, int32_t b)
{
    if (b < 0)
        return KT_OK;
    if (f->writer[b] != UNWRITTEN || f->scratch[b] >= 0) {
        char st[96], bt[96];
        kt__program_step_label(f->p, at, st, sizeof st);
        kt__program_buf_label(f->p, b, bt, sizeof bt);
        return kt__error(KT_EFORMAT, "%s uses %s as scratch, but %s", st, bt,
                         f->scratch[b] >= 0 ? "another step does too" : "it holds data");
    }
    f->scratch[b] = at;
    return KT_OK;
}

/* The reads (what the step's kernel reads: for a backward kernel, what its op's table row
 * says it needs) come before the step's own writes: a step never reads what it writes. */
static kt_status flow_step(flow *f, int32_t at)
{
    const kt__pstep *s = &f->p->steps[at];
    const kt__op_desc *d = s->kind <= KT__STEP_BACKWARD ? kt__op_get(s->op) : NULL;
    int backward = s->kind == KT__STEP_BACKWARD;
    for (int32_t i = 0; i < s->n_in; i++) /* (a fill step has none) */
        if (!backward || (d->bwd_reads_in & (1u << i)))
            KT__TRY(flow_read(f, at, s->in[i]));
    for (int32_t o = 0; backward && o < s->n_out; o++) {
        if (d->bwd_reads_out & (1u << o))
            KT__TRY(flow_read(f, at, s->out[o]));
        if (s->gout[o] >= 0)
            KT__TRY(flow_read(f, at, s->gout[o]));
    }
    KT__TRY(flow_scratch(f, at, s->scratch));
    if (backward) {
        for (int32_t i = 0; i < s->n_in; i++)
            if (s->gin[i] >= 0)
                KT__TRY(flow_write(f, at, s->gin[i], KT__REGION_ACT));
        return KT_OK;
    }
    int32_t region = s->kind == KT__STEP_ACCUM_GRAD ? KT__REGION_GRAD : KT__REGION_ACT;
    for (int32_t o = 0; o < s->n_out; o++)
        KT__TRY(flow_write(f, at, s->out[o], region));
    return KT_OK;
}

/* What the caller sees after kt_session_forward: every output and the loss come from the
 * forward schedule (or are an input or parameter themselves). */
static kt_status flow_results(const flow *f)
{
    const kt_program *p = f->p;
    for (int32_t i = 0; i <= p->n_entries[KT_ROLE_OUTPUT]; i++) {
        int32_t b =
            i < p->n_entries[KT_ROLE_OUTPUT] ? p->entries[KT_ROLE_OUTPUT][i].buf : p->loss_buf;
        if (b < 0 || f->writer[b] == BY_CALLER ||
            (f->writer[b] >= 0 && f->writer[b] < p->n_forward))
            continue;
        char bt[96];
        kt__program_buf_label(p, b, bt, sizeof bt);
        if (f->writer[b] == UNWRITTEN)
            return kt__error(KT_EFORMAT, "%s: no step computes it", bt);
        return kt__error(KT_EFORMAT,
                         "%s is computed by step %d, after the forward schedule (steps 0 to %d)",
                         bt, f->writer[b], p->n_forward - 1);
    }
    return KT_OK;
}

kt_status kt__program_check_flow(const kt_program *p)
{
    size_t n = (size_t)p->n_bufs + 1;
    flow f = {
        .p = p, .writer = malloc(n * sizeof *f.writer), .scratch = malloc(n * sizeof *f.scratch)};
    kt_status status = KT_OK;
    if (f.writer == NULL || f.scratch == NULL) {
        status = kt__error(KT_ENOMEM, "program check: out of memory");
        goto out;
    }
    for (int32_t b = 0; b < p->n_bufs; b++)
        f.writer[b] = f.scratch[b] = UNWRITTEN;
    for (int r = 0; r < KT_ROLE_OUTPUT; r++)
        for (int32_t i = 0; i < p->n_entries[r]; i++)
            f.writer[p->entries[r][i].buf] = BY_CALLER;
    for (int32_t at = 0; at < p->n_steps && status == KT_OK; at++)
        status = flow_step(&f, at);
    if (status == KT_OK)
        status = flow_results(&f);
out:
    free(f.writer);
    free(f.scratch);
    return status;
}
