/* The executor: runs prepared steps in order. Everything was validated and bound when the
 * session was created, so each step is a kernel call through a function pointer; nothing is
 * allocated and nothing is checked twice. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "lib/core/error.h"
#include "graph/runtime/session_internal.h"
#include "lib/optim/optim.h"

uint64_t kt__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kt__session_trace(kt_session *s, const char *name, const char *category, uint64_t t0,
                       uint64_t t1, int32_t step)
{
    if (s->trace_count >= s->opt.trace_capacity)
        return;
    s->opt.trace[s->trace_count++] =
        (kt_trace_event){.name = name, .category = category, .start_ns = t0, .end_ns = t1,
                         .step = step};
}

static void fill(kt_tensor *t, float value)
{
    int64_t n = kt_tensor_numel(t);
    if (t->dtype == KT_F32) {
        float *p = t->data;
        for (int64_t i = 0; i < n; i++)
            p[i] = value;
        return;
    }
    uint16_t h = t->dtype == KT_BF16 ? kt_f32_to_bf16_1(value) : kt_f32_to_f16_1(value);
    uint16_t *p = t->data;
    for (int64_t i = 0; i < n; i++)
        p[i] = h;
}

static kt_status injected_failure(const kt__op_call *call)
{
    (void)call;
    return kt__error(KT_EINTERNAL, "injected failure (a test hook)");
}

/* The step's kernel is swapped for one that fails, and swapped back when it has failed:
 * the run loop pays nothing for the hook. */
kt_status kt__session_inject_failure(kt_session *s, int32_t step)
{
    if (step < 0 || step >= s->p->n_steps || s->exec[step].kernel == NULL)
        return kt__error(KT_EINVAL, "inject: step %d runs no kernel", step);
    s->inject_at = step;
    s->injected_kernel = s->exec[step].kernel;
    s->exec[step].kernel = injected_failure;
    return KT_OK;
}

static kt_status run_step(kt_session *s, int32_t at)
{
    const kt__pstep *ps = &s->p->steps[at];
    kt__exec_step *e = &s->exec[at];
    switch (ps->kind) {
    case KT__STEP_FILL:
        fill(&s->tensors[ps->out[0]], ps->attrs.alpha);
        return KT_OK;
    case KT__STEP_ACCUM_GRAD: {
        const kt_tensor *src = &s->tensors[ps->in[0]];
        kt_tensor *dst = &s->tensors[ps->out[0]];
        if (s->micro == 0)
            memcpy(dst->data, src->data, kt_tensor_nbytes(src));
        else
            kt__accumulate(s->pool, dst->data, src->data, kt_tensor_numel(src));
        return KT_OK;
    }
    default:
        return e->kernel(&e->call);
    }
}

kt_status kt__session_run(kt_session *s, int32_t begin, int32_t end)
{
    const int tracing = s->opt.trace != NULL;
    for (int32_t at = begin; at < end; at++) {
        uint64_t t0 = tracing ? kt__now_ns() : 0;
        if (at == s->hold_at) { /* KT_FAULT hold, once */
            s->hold_at = -1;
            kt__session_fault_hold(s->fault.hold_ms);
        }
        kt_status status = run_step(s, at);
        if (status != KT_OK) {
            if (at == s->inject_at) { /* the hook fires once */
                s->exec[at].kernel = s->injected_kernel;
                s->inject_at = -1;
            }
            const kt__pstep *ps = &s->p->steps[at];
            s->failed_at = at;
            snprintf(s->failed_message, sizeof s->failed_message, "%s",
                     kt_last_error()[0] != '\0' ? kt_last_error() : kt_status_str(status));
            return kt__error_context(status, "step %d (%s of %s '%s')", at, s->exec[at].category,
                                     ps->kind <= KT__STEP_BACKWARD ? kt_op_name(ps->op) : "-",
                                     kt__strings_get(&s->p->strings, ps->name));
        }
        if (tracing)
            kt__session_trace(s, kt__strings_get(&s->p->strings, s->p->steps[at].name),
                              s->exec[at].category, t0, kt__now_ns(), at);
    }
    return KT_OK;
}

/* A failed step may leave a stateful op's state stale (a cached forward output): its poison
 * hook makes sure it is never reused (the failure's message is kept). */
static kt_status poison_state(kt_session *s, kt_status status)
{
    for (int i = 0; i < s->n_stateful; i++)
        if (s->stateful[i].hooks->poison != NULL)
            s->stateful[i].hooks->poison(s->stateful[i].state);
    return status;
}

/* Each poisoned state recovers; the first one's failure is reported (once), the others are
 * cleared quietly. */
static kt_status recover_state(kt_session *s)
{
    kt_status status = KT_OK;
    for (int i = 0; i < s->n_stateful; i++) {
        const kt__op_state *h = s->stateful[i].hooks;
        if (h->forward_begin == NULL)
            continue;
        kt_status st = h->forward_begin(s->stateful[i].state, status == KT_OK);
        if (status == KT_OK)
            status = st;
    }
    return status;
}

kt_status kt_session_forward(kt_session *s)
{
    if (s == NULL)
        return kt__error(KT_EINVAL, "kt_session_forward: session is NULL");
    s->forward_ok = 0;
    s->failed_at = -1;
    kt_status status = recover_state(s);
    if (status != KT_OK)
        return kt__session_fail(s, status, "forward");
    kt__session_fault_arm(s, KT__FAULT_FORWARD);
    status = kt__session_run(s, 0, s->p->n_forward);
    if (status != KT_OK)
        return kt__session_fail(s, poison_state(s, status), "forward");
    if (s->p->loss_buf >= 0)
        s->loss = *(const float *)s->tensors[s->p->loss_buf].data;
    s->forward_ok = 1;
    return KT_OK;
}

kt_status kt_session_backward(kt_session *s)
{
    if (s == NULL)
        return kt__error(KT_EINVAL, "kt_session_backward: session is NULL");
    if (s->p->n_steps == s->p->n_forward)
        return kt__error(KT_ESTATE, "backward: the program was compiled without training");
    if (!s->forward_ok)
        return kt__error(KT_ESTATE, "backward: no successful forward to differentiate");
    int micro_batches = s->opt.micro_batches > 0 ? s->opt.micro_batches : 1;
    if (s->micro >= micro_batches)
        return kt__error(KT_ESTATE, "backward: %d micro-batch gradients are accumulated already; "
                         "call kt_session_step first", s->micro);
    s->forward_ok = 0; /* the backward consumes the forward's saved activations */
    for (int i = 0; s->micro == 0 && i < s->n_stateful; i++) /* a new accumulation */
        if (s->stateful[i].hooks->backward_begin != NULL)
            s->stateful[i].hooks->backward_begin(s->stateful[i].state);
    s->failed_at = -1;
    kt__session_fault_arm(s, KT__FAULT_BACKWARD);
    kt_status status = kt__session_run(s, s->p->n_forward, s->p->n_steps);
    if (status != KT_OK)
        return kt__session_fail(s, poison_state(s, status), "backward");
    s->micro++;
    for (int i = 0; i < s->n_stateful; i++)
        if (s->stateful[i].hooks->backward_end != NULL)
            s->stateful[i].hooks->backward_end(s->stateful[i].state);
    return KT_OK;
}
