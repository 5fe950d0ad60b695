/* Programs: freeing and validation (the runtime half: no compiler code). Validation is what
 * makes a hand-edited or damaged .ktp file an error rather than wrong numbers: here the
 * tables' indices, the steps' shapes and the entries; then the data through the schedule
 * (program_check_flow.c: who writes each buffer, who reads it) and the memory
 * (program_check_memory.c: what stays alive for the caller to see, the plan, the regions). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/error.h"
#include "graph/plan.h"
#include "graph/program_internal.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_state.h"

void kt__scratch_meta(kt_tensor *meta, uint64_t bytes)
{
    int64_t words = (int64_t)((bytes + 3) / 4);
    (void)kt_tensor_init(meta, NULL, KT_I32, 1, &words);
}

void kt__program_free(kt_program *p)
{
    if (p == NULL)
        return;
    free(p->bufs);
    free(p->steps);
    for (int r = 0; r < 3; r++)
        free(p->entries[r]);
    kt__strings_free(&p->strings);
    free(p);
}

void kt__program_retain(const kt_program *p)
{
    /* the count is not part of the program's value: a const program may be shared */
    atomic_fetch_add(&((kt_program *)p)->extra_refs, 1);
}

void kt__program_release(const kt_program *p)
{
    if (p != NULL && atomic_fetch_sub(&((kt_program *)p)->extra_refs, 1) == 0)
        kt__program_free((kt_program *)p);
}

void kt_program_destroy(kt_program *p) { kt__program_release(p); }

/* ---- validation ----------------------------------------------------------------------------- */

/* A name is -1 or the start of a string in the pool (not the middle of another one, which
 * the compiler never writes and which could make two names the same). */
static int name_ok(const kt_program *p, int32_t name)
{
    return name == -1 || (name >= 0 && (size_t)name < p->strings.len &&
                          (name == 0 || p->strings.data[name - 1] == '\0'));
}

static kt_status check_buf(const kt_program *p, int32_t i)
{
    const kt__pbuf *b = &p->bufs[i];
    const kt_tensor *m = &b->meta;
    if (b->region < 0 || b->region >= KT__REGION_COUNT)
        return kt__error(KT_EFORMAT, "buffer %d: invalid region %d", i, b->region);
    if ((unsigned)m->dtype >= KT_DTYPE_COUNT || m->ndim < 0 || m->ndim > KT_MAX_DIMS)
        return kt__error(KT_EFORMAT, "buffer %d: invalid dtype or rank", i);
    uint64_t numel = 1;
    for (int d = 0; d < m->ndim; d++) {
        if (m->shape[d] < 0 || (m->shape[d] > 0 && numel > (UINT64_MAX >> 4) / (uint64_t)m->shape[d]))
            return kt__error(KT_EFORMAT, "buffer %d: invalid shape", i);
        numel *= (uint64_t)m->shape[d];
    }
    if (b->bytes < numel * kt_dtype_size(m->dtype))
        return kt__error(KT_EFORMAT, "buffer %d: %llu bytes cannot hold its tensor", i,
                         (unsigned long long)b->bytes);
    uint64_t region = p->region_bytes[b->region];
    if (b->offset % KT__PLAN_ALIGN != 0 || b->offset > region || b->bytes > region - b->offset)
        return kt__error(KT_EFORMAT, "buffer %d: offset %llu + %llu bytes outside its %llu-byte "
                         "region", i, (unsigned long long)b->offset,
                         (unsigned long long)b->bytes, (unsigned long long)region);
    if (b->region == KT__REGION_ACT) {
        if (b->first < 0 || b->first > b->last || b->last >= (p->n_steps > 0 ? p->n_steps : 1))
            return kt__error(KT_EFORMAT, "buffer %d: invalid lifetime [%d, %d]", i, b->first,
                             b->last);
        if (b->storage < 0 || b->storage >= p->n_bufs)
            return kt__error(KT_EFORMAT, "buffer %d: invalid storage %d", i, b->storage);
        const kt__pbuf *root = &p->bufs[b->storage];
        if (root->region != KT__REGION_ACT || root->storage != b->storage ||
            root->offset != b->offset || root->bytes != b->bytes)
            return kt__error(KT_EFORMAT, "buffer %d: inconsistent in-place sharing", i);
    }
    return KT_OK;
}

static kt_status check_id(const kt_program *p, int32_t at, const char *what, int32_t id,
                          int optional)
{
    if ((optional && id == -1) || (id >= 0 && id < p->n_bufs))
        return KT_OK;
    return kt__error(KT_EFORMAT, "step %d: %s buffer %d does not exist", at, what, id);
}

/* A step's use of an activation buffer must fall inside the buffer's lifetime. */
static kt_status check_live(const kt_program *p, int32_t at, int32_t id)
{
    if (id < 0)
        return KT_OK;
    const kt__pbuf *b = &p->bufs[id];
    if (b->region == KT__REGION_ACT && (at < b->first || at > b->last))
        return kt__error(KT_EFORMAT, "step %d uses buffer %d outside its lifetime [%d, %d]", at,
                         id, b->first, b->last);
    return KT_OK;
}

static int same_meta(const kt_tensor *a, const kt_tensor *b)
{
    return a->dtype == b->dtype && kt_tensor_same_shape(a, b);
}

static kt_status check_op_step(const kt_program *p, int32_t at, const kt__pstep *s)
{
    const kt__op_desc *d = kt__op_get(s->op);
    if (d == NULL)
        return kt__error(KT_EFORMAT, "step %d: invalid op %d", at, (int)s->op);
    if (s->n_in < d->min_in || s->n_in > d->max_in || s->n_out != d->n_out)
        return kt__error(KT_EFORMAT, "step %d (%s): wrong input or output count", at, d->name);
    kt_tensor in[KT_OP_MAX_IN], out[KT_OP_MAX_OUT];
    for (int32_t i = 0; i < s->n_in; i++) {
        KT__TRY(check_id(p, at, "input", s->in[i], 0));
        in[i] = p->bufs[s->in[i]].meta;
    }
    for (int32_t o = 0; o < s->n_out; o++)
        KT__TRY(check_id(p, at, "output", s->out[o], 0));
    if (kt_op_infer(s->op, &s->attrs, in, s->n_in, out, s->n_out) != KT_OK)
        return kt__error_context(KT_EFORMAT, "step %d (%s)", at, d->name);
    for (int32_t o = 0; o < s->n_out; o++)
        if (!same_meta(&out[o], &p->bufs[s->out[o]].meta))
            return kt__error(KT_EFORMAT, "step %d (%s): output %d has the wrong shape", at,
                             d->name, o);
    size_t need = kt_op_scratch_bytes(s->op, &s->attrs, in, s->n_in,
                                      s->kind == KT__STEP_BACKWARD);
    KT__TRY(check_id(p, at, "scratch", s->scratch, 1));
    if (s->scratch >= 0 && p->bufs[s->scratch].region != KT__REGION_ACT)
        return kt__error(KT_EFORMAT,
                         "step %d (%s): scratch buffer %d is outside the activation region", at,
                         d->name, s->scratch);
    if (need > 0 && (s->scratch < 0 || p->bufs[s->scratch].bytes < need ||
                     p->bufs[s->scratch].region != KT__REGION_ACT))
        return kt__error(KT_EFORMAT, "step %d (%s): needs %zu bytes of scratch", at, d->name,
                         need);
    if (s->kind == KT__STEP_BACKWARD) {
        for (int32_t o = 0; o < s->n_out; o++) {
            KT__TRY(check_id(p, at, "output gradient", s->gout[o], 1));
            int integer = out[o].dtype == KT_I32 || out[o].dtype == KT_I64;
            if (integer ? s->gout[o] != -1
                        : s->gout[o] < 0 || !same_meta(&p->bufs[s->gout[o]].meta, &out[o]))
                return kt__error(KT_EFORMAT, "step %d (%s): bad gradient of output %d", at,
                                 d->name, o);
        }
        for (int32_t i = 0; i < s->n_in; i++) {
            KT__TRY(check_id(p, at, "input gradient", s->gin[i], 1));
            if (s->gin[i] >= 0 && ((d->no_grad_in & (1u << i)) ||
                                   !same_meta(&p->bufs[s->gin[i]].meta, &in[i])))
                return kt__error(KT_EFORMAT, "step %d (%s): bad gradient of input %d", at,
                                 d->name, i);
        }
    }
    return KT_OK;
}

/* Whether the op's hooks give KT__STEP_STATE_RECOMPUTES a meaning. */
static int state_recompute(kt_op op)
{
    const kt__op_desc *d = kt__op_get(op);
    return d != NULL && d->state != NULL && d->state->state_recompute;
}

static const char *const kind_names[KT__STEP_KIND_COUNT] = {"forward", "backward", "fill",
                                                            "accumulate"};

static kt_status check_step(const kt_program *p, int32_t at)
{
    const kt__pstep *s = &p->steps[at];
    if (!name_ok(p, s->name))
        return kt__error(KT_EFORMAT, "step %d: invalid name", at);
    if ((s->flags & ~(KT__STEP_RECOMPUTE | KT__STEP_STATE_RECOMPUTES)) != 0 ||
        ((s->flags & KT__STEP_RECOMPUTE) && (s->kind != KT__STEP_FORWARD || at < p->n_forward)) ||
        ((s->flags & KT__STEP_STATE_RECOMPUTES) &&
         (s->kind != KT__STEP_FORWARD || at >= p->n_forward || !state_recompute(s->op))))
        return kt__error(KT_EFORMAT, "step %d: invalid flags 0x%x", at, (unsigned)s->flags);
    if (!isfinite(s->flops) || s->flops < 0.0) /* statistics only, but never nonsense */
        return kt__error(KT_EFORMAT, "step %d: invalid FLOP count %g", at, s->flops);
    /* the forward schedule is what kt_session_forward runs: only forward kernels belong there
     * (the loss seed, backward kernels and gradient moves run in kt_session_backward) */
    if (at < p->n_forward && s->kind != KT__STEP_FORWARD && (unsigned)s->kind < KT__STEP_KIND_COUNT)
        return kt__error(KT_EFORMAT,
                         "step %d: a %s step inside the forward schedule (steps 0 to %d)", at,
                         kind_names[s->kind], p->n_forward - 1);
    switch (s->kind) {
    case KT__STEP_FORWARD:
    case KT__STEP_BACKWARD:
        KT__TRY(check_op_step(p, at, s));
        break;
    case KT__STEP_FILL: /* fill and accumulate steps have no scratch (its id is unchecked) */
        if (s->n_out != 1 || s->n_in != 0 || s->scratch != -1)
            return kt__error(KT_EFORMAT, "step %d: bad fill step", at);
        KT__TRY(check_id(p, at, "output", s->out[0], 0));
        if (p->bufs[s->out[0]].region != KT__REGION_ACT)
            return kt__error(KT_EFORMAT, "step %d: fill outside the activation region", at);
        /* the compiler fills with 1 the loss's gradient (the seed) and with 0 the gradients
         * of outputs nothing downstream used (check_seed says which is which) */
        if (s->attrs.alpha != 0.0f && s->attrs.alpha != 1.0f)
            return kt__error(KT_EFORMAT, "step %d: fill value %g, not 0 or 1", at,
                             (double)s->attrs.alpha);
        break;
    case KT__STEP_ACCUM_GRAD:
        if (s->n_out != 1 || s->n_in != 1 || s->scratch != -1)
            return kt__error(KT_EFORMAT, "step %d: bad accumulate step", at);
        KT__TRY(check_id(p, at, "input", s->in[0], 0));
        KT__TRY(check_id(p, at, "output", s->out[0], 0));
        if (p->bufs[s->out[0]].region != KT__REGION_GRAD ||
            p->bufs[s->in[0]].meta.dtype != KT_F32 ||
            !same_meta(&p->bufs[s->in[0]].meta, &p->bufs[s->out[0]].meta))
            return kt__error(KT_EFORMAT, "step %d: bad accumulate step", at);
        break;
    default:
        return kt__error(KT_EFORMAT, "step %d: invalid kind %d", at, s->kind);
    }
    /* every activation buffer the step touches is alive at that step (what it reads of
     * in/out in backward is a subset, but checking all is only stricter for reads) */
    const kt__op_desc *d = s->kind <= KT__STEP_BACKWARD ? kt__op_get(s->op) : NULL;
    for (int32_t i = 0; i < s->n_in; i++)
        if (s->kind != KT__STEP_BACKWARD || (d->bwd_reads_in & (1u << i)))
            KT__TRY(check_live(p, at, s->in[i]));
    for (int32_t o = 0; o < s->n_out; o++)
        if (s->kind != KT__STEP_BACKWARD || (d->bwd_reads_out & (1u << o)))
            KT__TRY(check_live(p, at, s->out[o]));
    if (s->kind == KT__STEP_BACKWARD) {
        for (int32_t o = 0; o < s->n_out; o++)
            KT__TRY(check_live(p, at, s->gout[o]));
        for (int32_t i = 0; i < s->n_in; i++)
            KT__TRY(check_live(p, at, s->gin[i]));
    }
    return check_live(p, at, s->scratch);
}

static const char *const role_names[3] = {"input", "parameter", "output"};

/* What the graph builder accepts as a parameter's initialiser (the session draws from it). */
static int init_ok(const kt_init *init, kt_dtype dtype)
{
    if ((unsigned)init->kind > KT_INIT_LOADED ||
        (init->kind == KT_INIT_NORMAL && !(init->a >= 0)) ||
        (init->kind == KT_INIT_UNIFORM && !(init->a < init->b)))
        return 0;
    return init->kind == KT_INIT_LOADED || init->kind == KT_INIT_ZEROS || dtype == KT_F32 ||
           dtype == KT_BF16 || dtype == KT_F16;
}

static kt_status check_entry(const kt_program *p, int r, int32_t i)
{
    const kt__pentry *e = &p->entries[r][i];
    if (e->name < 0 || !name_ok(p, e->name) || p->strings.data[e->name] == '\0')
        return kt__error(KT_EFORMAT,
                         "%s %d: invalid entry (name offset %d is not the start of a name)",
                         role_names[r], i, e->name);
    if (e->buf < 0 || e->buf >= p->n_bufs)
        return kt__error(KT_EFORMAT, "%s %d: invalid entry (buffer %d does not exist)",
                         role_names[r], i, e->buf);
    int32_t region = p->bufs[e->buf].region;
    if ((r == KT_ROLE_INPUT && region != KT__REGION_ACT) ||
        (r == KT_ROLE_PARAM && region != KT__REGION_PARAM) ||
        (r == KT_ROLE_OUTPUT && region == KT__REGION_GRAD))
        return kt__error(KT_EFORMAT, "%s %d: buffer in the wrong region", role_names[r], i);
    if (e->grad_buf != -1 &&
        (r != KT_ROLE_PARAM || e->grad_buf < 0 || e->grad_buf >= p->n_bufs ||
         p->bufs[e->grad_buf].region != KT__REGION_GRAD ||
         p->bufs[e->grad_buf].meta.dtype != KT_F32 || /* the optimizer reads f32 */
         !same_meta(&p->bufs[e->grad_buf].meta, &p->bufs[e->buf].meta)))
        return kt__error(KT_EFORMAT, "%s %d: invalid gradient buffer", role_names[r], i);
    if ((unsigned)e->init.kind > KT_INIT_LOADED ||
        (r == KT_ROLE_PARAM && !init_ok(&e->init, p->bufs[e->buf].meta.dtype)))
        return kt__error(KT_EFORMAT, "%s %d: invalid initialiser", role_names[r], i);
    if (e->shard_dim != -1 &&
        (r != KT_ROLE_INPUT || e->shard_dim < 0 || e->shard_dim >= p->bufs[e->buf].meta.ndim))
        return kt__error(KT_EFORMAT, "%s %d: invalid shard dimension %d", role_names[r], i,
                         e->shard_dim);
    return KT_OK;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Callers find inputs and parameters by name (one namespace, as in the graph) and outputs by
 * name (another): a repeated name would leave one of the two tensors unreachable. */
static kt_status check_names_unique(const kt_program *p, const char **names)
{
    int32_t n = 0;
    for (int r = 0; r < 3; r++) {
        int32_t start = r == KT_ROLE_OUTPUT ? n : 0;
        for (int32_t i = 0; i < p->n_entries[r]; i++)
            names[n++] = kt__strings_get(&p->strings, p->entries[r][i].name);
        if (r == KT_ROLE_INPUT)
            continue;
        qsort(names + start, (size_t)(n - start), sizeof *names, by_name);
        for (int32_t k = start + 1; k < n; k++)
            if (strcmp(names[k - 1], names[k]) == 0)
                return kt__error(KT_EFORMAT, "%s name '%s' is used twice",
                                 r == KT_ROLE_OUTPUT ? "output" : "input or parameter", names[k]);
    }
    return KT_OK;
}

/* Each input, parameter and gradient has a buffer of its own: two names on one buffer would
 * make writing one overwrite the other (outputs may name one value twice). */
static kt_status check_buffers_unique(const kt_program *p, int32_t *owner)
{
    static const char *const plural[2] = {"inputs", "parameters"};
    for (int32_t b = 0; b < p->n_bufs; b++)
        owner[b] = -1;
    for (int r = 0; r < KT_ROLE_OUTPUT; r++) {
        for (int32_t i = 0; i < p->n_entries[r]; i++) {
            const kt__pentry *e = &p->entries[r][i];
            for (int g = 0; g < 2; g++) {
                int32_t b = g ? e->grad_buf : e->buf;
                if (b < 0)
                    continue;
                if (owner[b] >= 0)
                    return kt__error(KT_EFORMAT, "%s%s '%s' and '%s' share buffer %d",
                                     g ? "the gradients of " : "", plural[r],
                                     kt__strings_get(&p->strings, owner[b]),
                                     kt__strings_get(&p->strings, e->name), b);
                owner[b] = e->name;
            }
        }
    }
    /* and each parameter or gradient buffer is one of theirs (the session initialises,
     * loads and updates parameters, and the optimizer reads gradients, through the entries) */
    for (int32_t b = 0; b < p->n_bufs; b++)
        if (p->bufs[b].region != KT__REGION_ACT && owner[b] < 0)
            return kt__error(KT_EFORMAT,
                             "buffer %d is in the %s region but belongs to no parameter", b,
                             p->bufs[b].region == KT__REGION_PARAM ? "parameter" : "gradient");
    return KT_OK;
}

static kt_status check_entries(const kt_program *p)
{
    for (int r = 0; r < 3; r++) {
        if (p->n_entries[r] < 0 || (p->n_entries[r] > 0 && p->entries[r] == NULL))
            return kt__error(KT_EFORMAT, "invalid %s table", role_names[r]);
        for (int32_t i = 0; i < p->n_entries[r]; i++)
            KT__TRY(check_entry(p, r, i));
    }
    size_t n = (size_t)p->n_entries[0] + (size_t)p->n_entries[1] + (size_t)p->n_entries[2];
    const char **names = malloc(sizeof *names * (n + 1));
    int32_t *owner = malloc(sizeof *owner * ((size_t)p->n_bufs + 1));
    kt_status status = KT_ENOMEM;
    if (names == NULL || owner == NULL)
        kt__error(status, "program check: out of memory");
    else if ((status = check_names_unique(p, names)) == KT_OK)
        status = check_buffers_unique(p, owner);
    free(names);
    free(owner);
    return status;
}

/* ---- labels for messages ------------------------------------------------------------------ */

const char *kt__program_buf_label(const kt_program *p, int32_t b, char *text, size_t cap)
{
    snprintf(text, cap, "buffer %d", b);
    for (int r = 0; r < 3; r++)
        for (int32_t i = 0; i < p->n_entries[r]; i++) {
            const kt__pentry *e = &p->entries[r][i];
            if (e->buf == b || e->grad_buf == b) {
                snprintf(text, cap, "buffer %d (%s%s '%s')", b,
                         e->buf == b ? "" : "the gradient of ", role_names[r],
                         kt__strings_get(&p->strings, e->name));
                return text;
            }
        }
    if (b == p->loss_buf)
        snprintf(text, cap, "buffer %d (the loss)", b);
    return text;
}

/* "step 3 (fill)", "step 0 (forward matmul 'fc1')" */
const char *kt__program_step_label(const kt_program *p, int32_t at, char *text, size_t cap)
{
    const kt__pstep *s = &p->steps[at];
    const char *name = kt__strings_get(&p->strings, s->name);
    snprintf(text, cap, "step %d (%s%s%s%s%s%s)", at, kind_names[s->kind],
             s->kind <= KT__STEP_BACKWARD ? " " : "",
             s->kind <= KT__STEP_BACKWARD ? kt_op_name(s->op) : "", name[0] ? " '" : "", name,
             name[0] ? "'" : "");
    return text;
}

/* The backward schedule differentiates the loss: it starts by filling the loss's gradient
 * with 1 (the seed); every other fill writes zeros. */
static kt_status check_seed(const kt_program *p)
{
    if (p->n_steps == p->n_forward)
        return KT_OK;
    const kt__pstep *s = &p->steps[p->n_forward];
    if (p->loss_buf < 0 || s->kind != KT__STEP_FILL || s->attrs.alpha != 1.0f ||
        !same_meta(&p->bufs[s->out[0]].meta, &p->bufs[p->loss_buf].meta))
        return kt__error(KT_EFORMAT,
                         "program: the backward schedule (steps %d to %d) does not "
                         "start with the seed of a loss's gradient",
                         p->n_forward, p->n_steps - 1);
    for (int32_t at = p->n_forward + 1; at < p->n_steps; at++)
        if (p->steps[at].kind == KT__STEP_FILL && p->steps[at].attrs.alpha != 0.0f)
            return kt__error(KT_EFORMAT,
                             "step %d: fill value %g, but only the loss seed (step %d) is not 0",
                             at, (double)p->steps[at].attrs.alpha, p->n_forward);
    return KT_OK;
}

kt_status kt__program_validate(const kt_program *p)
{
    if (p->n_bufs < 0 || p->n_steps < 0 || p->n_forward < 0 || p->n_forward > p->n_steps ||
        (p->n_bufs > 0 && p->bufs == NULL) || (p->n_steps > 0 && p->steps == NULL))
        return kt__error(KT_EFORMAT, "program: invalid table sizes");
    /* forward runs steps [0, n_forward): a program with steps has a forward schedule (the
     * compiler writes at least one forward step when there is any step at all) */
    if (p->n_steps > 0 && p->n_forward == 0)
        return kt__error(KT_EFORMAT,
                         "program: n_forward is 0 but the program has %d steps: "
                         "the forward schedule is empty",
                         p->n_steps);
    if (p->strings.len > 0 && p->strings.data[p->strings.len - 1] != '\0')
        return kt__error(KT_EFORMAT, "program: names are not terminated");
    for (int32_t i = 0; i < p->n_bufs; i++)
        KT__TRY(check_buf(p, i));
    for (int32_t at = 0; at < p->n_steps; at++)
        KT__TRY(check_step(p, at));
    KT__TRY(check_entries(p));
    if (p->loss_buf != -1 && (p->loss_buf < 0 || p->loss_buf >= p->n_bufs ||
                              p->bufs[p->loss_buf].region != KT__REGION_ACT ||
                              p->bufs[p->loss_buf].meta.dtype != KT_F32 ||
                              kt_tensor_numel(&p->bufs[p->loss_buf].meta) != 1))
        return kt__error(KT_EFORMAT, "program: invalid loss buffer");
    KT__TRY(kt__program_check_flow(p));
    KT__TRY(check_seed(p));
    return kt__program_check_memory(p);
}
