/* Sessions: all memory allocated and every step bound at creation; then forward, backward
 * and the optimizer step run without allocating. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/core/mix.h"
#include "lib/core/error.h"
#include "lib/core/memory.h"
#include "lib/core/numa_internal.h"
#include "graph/runtime/session_internal.h"
#include "kt/comm.h"

static const char *const category_names[KT__STEP_KIND_COUNT] = {"forward", "backward", "fill",
                                                                 "accumulate"};

/* The allocation size of a region of `bytes` (kt__numa_free needs the same size back: large
 * ones are mappings, small ones heap blocks). */
static size_t region_alloc_size(uint64_t bytes) { return (size_t)(bytes ? bytes : 64); }

static kt_status alloc_zeroed(uint64_t bytes, unsigned char **out)
{
    void *p = NULL;
    KT__TRY(kt__numa_alloc(region_alloc_size(bytes), -1, &p));
    memset(p, 0, region_alloc_size(bytes));
    *out = p;
    return KT_OK;
}

/* Tensors for a step's call: in, out, gout, gin, back to back in s->call_tensors. */
static void bind_step(kt_session *s, int32_t at, kt_tensor **cursor)
{
    const kt__pstep *ps = &s->p->steps[at];
    kt__exec_step *e = &s->exec[at];
    e->category = (ps->flags & KT__STEP_RECOMPUTE) ? "recompute" : category_names[ps->kind];
    if (ps->kind != KT__STEP_FORWARD && ps->kind != KT__STEP_BACKWARD)
        return;
    const kt__op_desc *d = kt__op_get(ps->op);
    kt_tensor *t = *cursor;
    kt_tensor *in = t, *out = t + ps->n_in, *gout = out + ps->n_out, *gin = gout + ps->n_out;
    for (int32_t i = 0; i < ps->n_in; i++)
        in[i] = s->tensors[ps->in[i]];
    for (int32_t o = 0; o < ps->n_out; o++)
        out[o] = s->tensors[ps->out[o]];
    int backward = ps->kind == KT__STEP_BACKWARD;
    if (backward) {
        for (int32_t o = 0; o < ps->n_out; o++) {
            gout[o] = out[o];
            gout[o].data = NULL; /* integer outputs: no gradient */
            if (ps->gout[o] >= 0)
                gout[o] = s->tensors[ps->gout[o]];
        }
        for (int32_t i = 0; i < ps->n_in; i++) {
            gin[i] = in[i];
            gin[i].data = NULL; /* not wanted */
            if (ps->gin[i] >= 0)
                gin[i] = s->tensors[ps->gin[i]];
        }
    }
    *cursor = gin + (backward ? ps->n_in : 0);
    e->kernel = backward ? d->backward : d->forward;
    e->call = (kt__op_call){.attrs = &ps->attrs, .in = in, .n_in = ps->n_in, .out = out,
                            .out_w = backward ? NULL : out, .n_out = ps->n_out,
                            .gout = backward ? gout : NULL, .gin = backward ? gin : NULL,
                            .pool = s->pool};
    if (ps->scratch >= 0) {
        e->call.scratch = s->tensors[ps->scratch].data;
        e->call.scratch_bytes = s->p->bufs[ps->scratch].bytes;
    }
    e->call.bindings = kt__session_bindings(&s->opt, &e->call.n_bindings);
    e->call.comm = s->opt.comm;
    for (int i = 0; i < s->n_stateful; i++)
        if (s->stateful[i].op == ps->op)
            e->call.state = s->stateful[i].state;
    if (s->comm_scratch != NULL && s->comm_scratch[at] != NULL) {
        e->call.comm_scratch = s->comm_scratch[at];
        e->call.comm_scratch_bytes =
            d->comm_scratch(&ps->attrs, in, ps->n_in, kt_comm_size(s->opt.comm));
    }
}

/* Message buffers of the steps that talk to other ranks, sized for this world. */
static kt_status alloc_comm_scratch(kt_session *s)
{
    const kt_program *p = s->p;
    int world = s->opt.comm ? kt_comm_size(s->opt.comm) : 1;
    s->comm_scratch = calloc((size_t)p->n_steps + 1, sizeof *s->comm_scratch);
    if (s->comm_scratch == NULL)
        return kt__error(KT_ENOMEM, "session: out of memory");
    for (int32_t at = 0; at < p->n_steps; at++) {
        const kt__pstep *ps = &p->steps[at];
        if (ps->kind != KT__STEP_FORWARD && ps->kind != KT__STEP_BACKWARD)
            continue;
        const kt__op_desc *d = kt__op_get(ps->op);
        if (d->comm_scratch == NULL || s->opt.comm == NULL)
            continue;
        kt_tensor in[KT_OP_MAX_IN];
        for (int32_t i = 0; i < ps->n_in; i++)
            in[i] = p->bufs[ps->in[i]].meta;
        size_t bytes = d->comm_scratch(&ps->attrs, in, ps->n_in, world);
        if (bytes == 0)
            continue;
        if (posix_memalign(&s->comm_scratch[at], 64, bytes) != 0) {
            s->comm_scratch[at] = NULL;
            return kt__error(KT_ENOMEM, "session: cannot allocate %zu bytes of message buffers "
                             "for step %d", bytes, at);
        }
    }
    return KT_OK;
}

static kt_status bind(kt_session *s)
{
    const kt_program *p = s->p;
    size_t n_call = 0;
    for (int32_t at = 0; at < p->n_steps; at++)
        n_call += 2 * (size_t)(p->steps[at].n_in + p->steps[at].n_out);
    s->tensors = calloc((size_t)p->n_bufs + 1, sizeof *s->tensors);
    s->call_tensors = calloc(n_call + 1, sizeof *s->call_tensors);
    s->exec = calloc((size_t)p->n_steps + 1, sizeof *s->exec);
    if (s->tensors == NULL || s->call_tensors == NULL || s->exec == NULL)
        return kt__error(KT_ENOMEM, "session: out of memory");
    for (int32_t b = 0; b < p->n_bufs; b++) {
        s->tensors[b] = p->bufs[b].meta;
        s->tensors[b].data = s->region[p->bufs[b].region] + p->bufs[b].offset;
    }
    kt_tensor *cursor = s->call_tensors;
    for (int32_t at = 0; at < p->n_steps; at++)
        bind_step(s, at, &cursor);
    return KT_OK;
}

/* The optimizer's hyperparameters, as PyTorch's constructors check them (a beta of 1 divides
 * by zero in the bias correction, turning every parameter into NaN at the first step while
 * the step itself succeeds). 0 keeps its meaning of "the default" where the config says so. */
static kt_status check_optimizer(const kt_optimizer_config *o)
{
    if (o->kind != KT_OPTIM_SGD && o->kind != KT_OPTIM_ADAMW && o->kind != KT_OPTIM_NONE)
        return kt__error(KT_EINVAL, "session: unknown optimizer %d", o->kind);
    const struct {
        const char *name;
        float v, hi; /* must be finite, in [0, hi) (hi 0: no upper bound) */
    } range[] = {{"lr", o->lr, 0.0f},           {"min_lr", o->min_lr, 0.0f},
                 {"weight_decay", o->weight_decay, 0.0f}, {"clip_norm", o->clip_norm, 0.0f},
                 {"momentum", o->momentum, 0.0f}, {"dampening", o->dampening, 0.0f},
                 {"beta1", o->beta1, 1.0f},     {"beta2", o->beta2, 1.0f},
                 {"eps", o->eps, 0.0f}};
    for (size_t k = 0; k < sizeof range / sizeof range[0]; k++)
        if (!isfinite(range[k].v) || range[k].v < 0.0f ||
            (range[k].hi > 0.0f && range[k].v >= range[k].hi))
            return kt__error(KT_EINVAL, "session: optimizer %s %g must be %s", range[k].name,
                             (double)range[k].v,
                             range[k].hi > 0.0f ? "in [0, 1) (0: the default)"
                                                : "finite and >= 0");
    if (o->kind == KT_OPTIM_SGD && o->nesterov && (o->momentum <= 0.0f || o->dampening != 0.0f))
        return kt__error(KT_EINVAL, "session: Nesterov momentum needs a momentum > 0 and zero "
                         "dampening (momentum %g, dampening %g)", (double)o->momentum,
                         (double)o->dampening);
    if (o->schedule != KT_LR_CONSTANT && o->schedule != KT_LR_COSINE &&
        o->schedule != KT_LR_LINEAR)
        return kt__error(KT_EINVAL, "session: unknown learning-rate schedule %d", o->schedule);
    if (o->warmup_steps < 0 || o->total_steps < 0)
        return kt__error(KT_EINVAL, "session: learning-rate schedule with warmup_steps %lld and "
                         "total_steps %lld (neither may be negative)",
                         (long long)o->warmup_steps, (long long)o->total_steps);
    return KT_OK;
}

kt_status kt_session_memory_bytes(const kt_program *p, const kt_session_options *options,
                                  uint64_t *bytes_out)
{
    if (p == NULL || bytes_out == NULL)
        return kt__error(KT_EINVAL, "kt_session_memory_bytes: NULL argument");
    const kt_session_options none = {0}, *o = options != NULL ? options : &none;
    const int states = kt__optimizer_states(&o->optimizer);
    uint64_t total = 0;
    for (int r = 0; r < KT__REGION_COUNT; r++)
        total += region_alloc_size(p->region_bytes[r]);
    total += (uint64_t)states * region_alloc_size(p->region_bytes[KT__REGION_GRAD]);
    uint64_t state_bytes = 0;
    KT__TRY(kt__session_state_bytes(p, o, states, &state_bytes));
    total += state_bytes;
    *bytes_out = total;
    return KT_OK;
}

kt_status kt_session_create(const kt_program *p, const kt_session_options *options,
                            kt_session **session_out)
{
    if (session_out != NULL)
        *session_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (p == NULL || session_out == NULL)
        return kt__error(KT_EINVAL, "kt_session_create: NULL argument");
    kt_session *s = calloc(1, sizeof *s);
    if (s == NULL)
        return kt__error(KT_ENOMEM, "session: out of memory");
    s->p = p;
    kt__program_retain(p); /* released by kt_session_destroy: the program may go first */
    if (options != NULL)
        s->opt = *options;
    s->loss = NAN;
    s->inject_at = -1;
    s->failed_at = -1;
    s->hold_at = -1;
    s->fault.phase = -1;
    kt_status status = KT_OK;
    if (s->opt.trace == NULL)
        s->opt.trace_capacity = 0;
    if ((status = check_optimizer(&s->opt.optimizer)) != KT_OK)
        goto fail;
    if (s->opt.micro_batches < 0) {
        status = kt__error(KT_EINVAL, "session: micro_batches %d is negative",
                           s->opt.micro_batches);
        goto fail;
    }
    if (s->opt.pool != NULL) {
        s->pool = s->opt.pool;
    } else {
        if ((status = kt_threadpool_create(s->opt.threads, &s->pool)) != KT_OK)
            goto fail;
        s->own_pool = 1;
    }
    uint64_t need = 0; /* all of it checked before any is committed */
    if ((status = kt_session_memory_bytes(p, &s->opt, &need)) != KT_OK ||
        (status = kt__memory_admit(need, "session: the program's memory plan")) != KT_OK)
        goto fail;
    for (int r = 0; r < KT__REGION_COUNT; r++)
        if ((status = alloc_zeroed(p->region_bytes[r], &s->region[r])) != KT_OK)
            goto fail;
    int states = kt__optimizer_states(&s->opt.optimizer);
    for (int k = 0; k < states; k++)
        if ((status = alloc_zeroed(p->region_bytes[KT__REGION_GRAD],
                                   (unsigned char **)&s->opt_state[k])) != KT_OK)
            goto fail;
    if ((status = kt__session_keep_bindings(s)) != KT_OK ||
        (status = kt__session_bind_state(s)) != KT_OK ||
        (status = alloc_comm_scratch(s)) != KT_OK || (status = bind(s)) != KT_OK ||
        (status = kt_session_init_params(s, s->opt.seed)) != KT_OK ||
        (status = kt__session_fault_parse(s)) != KT_OK)
        goto fail;
    *session_out = s;
    return KT_OK;
fail:
    kt_session_destroy(s);
    return status;
}

void kt_session_destroy(kt_session *s)
{
    if (s == NULL)
        return;
    for (int r = 0; r < KT__REGION_COUNT; r++)
        kt__numa_free(s->region[r], region_alloc_size(s->p->region_bytes[r]), -1);
    for (int k = 0; k < 2; k++)
        kt__numa_free(s->opt_state[k], region_alloc_size(s->p->region_bytes[KT__REGION_GRAD]),
                      -1);
    if (s->own_pool)
        kt_threadpool_destroy(s->pool);
    free(s->tensors);
    free(s->call_tensors);
    free(s->exec);
    for (int32_t at = 0; s->comm_scratch != NULL && at < s->p->n_steps; at++)
        free(s->comm_scratch[at]);
    free(s->comm_scratch);
    kt__session_unbind_state(s);
    kt__session_drop_bindings(s);
    kt__program_release(s->p);
    free(s);
}

kt_status kt_session_tensor(kt_session *s, kt_tensor_role role, const char *name,
                            kt_tensor *view_out)
{
    if (s == NULL || name == NULL || view_out == NULL)
        return kt__error(KT_EINVAL, "kt_session_tensor: NULL argument");
    int r = role == KT_ROLE_GRAD ? KT_ROLE_PARAM : (int)role;
    if ((unsigned)r >= 3)
        return kt__error(KT_EINVAL, "kt_session_tensor: invalid role %d", (int)role);
    static const char *const role_names[4] = {"input", "parameter", "output", "gradient"};
    for (int32_t i = 0; i < s->p->n_entries[r]; i++) {
        const kt__pentry *e = &s->p->entries[r][i];
        if (strcmp(kt__strings_get(&s->p->strings, e->name), name) != 0)
            continue;
        int32_t b = role == KT_ROLE_GRAD ? e->grad_buf : e->buf;
        if (b < 0)
            return kt__error(KT_EINVAL, "kt_session_tensor: parameter '%s' is frozen and has no "
                             "gradient", name);
        *view_out = s->tensors[b];
        return KT_OK;
    }
    return kt__error(KT_EINVAL, "kt_session_tensor: no %s named '%s'", role_names[role], name);
}


static double uniform01(uint64_t *state)
{
    *state = kt__splitmix64(*state);
    return (double)(*state >> 11) * (1.0 / 9007199254740992.0);
}

static float draw(const kt_init *init, uint64_t *state)
{
    switch (init->kind) {
    case KT_INIT_ONES:
        return 1.0f;
    case KT_INIT_NORMAL: {
        double u1 = uniform01(state), u2 = uniform01(state);
        return (float)(init->a * sqrt(-2.0 * log(u1 + 1e-300)) * cos(6.283185307179586 * u2));
    }
    case KT_INIT_UNIFORM:
        return (float)(init->a + (init->b - init->a) * uniform01(state));
    default:
        return 0.0f;
    }
}

kt_status kt_session_init_params(kt_session *s, uint64_t seed)
{
    if (s == NULL)
        return kt__error(KT_EINVAL, "kt_session_init_params: session is NULL");
    for (int32_t i = 0; i < s->p->n_entries[KT_ROLE_PARAM]; i++) {
        const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
        if (e->init.kind == KT_INIT_LOADED)
            continue;
        uint64_t state = seed;
        for (const char *c = kt__strings_get(&s->p->strings, e->name); *c; c++)
            state = kt__splitmix64(state ^ (uint8_t)*c); /* a stream per name */
        kt_tensor *t = &s->tensors[e->buf];
        int64_t n = kt_tensor_numel(t);
        if (e->init.kind == KT_INIT_ZEROS) {
            memset(t->data, 0, kt_tensor_nbytes(t));
            continue;
        }
        for (int64_t k = 0; k < n; k++) {
            float v = draw(&e->init, &state);
            if (t->dtype == KT_F32)
                ((float *)t->data)[k] = v;
            else if (t->dtype == KT_BF16)
                ((uint16_t *)t->data)[k] = kt_f32_to_bf16_1(v);
            else
                ((uint16_t *)t->data)[k] = kt_f32_to_f16_1(v);
        }
    }
    return KT_OK;
}

float kt_session_loss(const kt_session *s) { return s ? s->loss : NAN; }
float kt_session_grad_norm(const kt_session *s) { return s ? s->grad_norm : NAN; }
float kt_session_lr(const kt_session *s) { return s ? s->lr : NAN; }
int64_t kt_session_step_count(const kt_session *s) { return s ? s->steps_done : 0; }
size_t kt_session_trace_count(const kt_session *s) { return s ? s->trace_count : 0; }

void kt_session_trace_reset(kt_session *s)
{
    if (s != NULL)
        s->trace_count = 0;
}
