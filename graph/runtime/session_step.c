/* The optimizer step: average the accumulated micro-batch gradients, measure and clip their
 * global norm, schedule the learning rate, update every trainable parameter. */
#include <math.h>

#include "lib/core/error.h"
#include "graph/runtime/session_internal.h"
#include "kt/comm.h"
#include "lib/optim/optim.h"

static float scheduled_lr(const kt_session *s)
{
    const kt_optimizer_config *o = &s->opt.optimizer;
    return kt__lr_at(o->schedule, o->lr, o->min_lr, o->warmup_steps, o->total_steps,
                     s->steps_done);
}

/* The gradient and optimizer-state arrays of parameter entry i, or 0 if it is frozen. */
static int param_arrays(const kt_session *s, int32_t i, float **param, float **grad,
                        float **st0, float **st1, int64_t *n)
{
    const kt__pentry *e = &s->p->entries[KT_ROLE_PARAM][i];
    if (e->grad_buf < 0)
        return 0;
    const kt__pbuf *gb = &s->p->bufs[e->grad_buf];
    *param = s->tensors[e->buf].data;
    *grad = s->tensors[e->grad_buf].data;
    *st0 = s->opt_state[0] ? s->opt_state[0] + gb->offset / sizeof(float) : NULL;
    *st1 = s->opt_state[1] ? s->opt_state[1] + gb->offset / sizeof(float) : NULL;
    *n = kt_tensor_numel(&gb->meta);
    return 1;
}

/* One optimizer update of a flat array of n values. */
static void update(kt_session *s, float *param, float *grad, float *st0, float *st1, int64_t n)
{
    const kt_optimizer_config *o = &s->opt.optimizer;
    if (o->kind == KT_OPTIM_NONE)
        return;
    if (o->kind == KT_OPTIM_ADAMW) {
        kt__adamw_params hp = {.lr = s->lr,
                               .beta1 = o->beta1 > 0 ? o->beta1 : 0.9f,
                               .beta2 = o->beta2 > 0 ? o->beta2 : 0.999f,
                               .eps = o->eps > 0 ? o->eps : 1e-8f,
                               .weight_decay = o->weight_decay,
                               .step = s->steps_done + 1};
        kt__adamw_update(s->pool, param, grad, st0, st1, n, &hp);
    } else {
        kt__sgd_params hp = {.lr = s->lr, .momentum = o->momentum, .dampening = o->dampening,
                             .weight_decay = o->weight_decay, .nesterov = o->nesterov};
        kt__sgd_update(s->pool, param, grad, st0, n, &hp, s->steps_done == 0);
    }
}

/* Several ranks: every rank gets the mean gradient (and loss) of all ranks, so the
 * replicated parameters stay identical everywhere. */
static kt_status average_over_ranks(kt_session *s)
{
    /* the gradient region holds only f32 gradients at 64-byte offsets, its padding zero:
     * one collective averages all of them (the padding stays zero) */
    size_t n = (size_t)(s->p->region_bytes[KT__REGION_GRAD] / sizeof(float));
    if (n > 0) {
        kt_status st = kt_comm_all_reduce(s->opt.comm, s->region[KT__REGION_GRAD], n, KT_F32,
                                          KT_REDUCE_MEAN);
        if (st != KT_OK)
            return kt__error_context(st, "step: averaging the gradients over ranks");
    }
    float loss = s->loss;
    KT__TRY(kt_comm_all_reduce(s->opt.comm, &loss, 1, KT_F32, KT_REDUCE_MEAN));
    s->loss = loss;
    return KT_OK;
}

kt_status kt_session_step(kt_session *s)
{
    if (s == NULL)
        return kt__error(KT_EINVAL, "kt_session_step: session is NULL");
    if (s->micro == 0)
        return kt__error(KT_ESTATE, "step: no gradients accumulated (call backward first)");
    if (s->opt.optimizer.lr == 0.0f && s->opt.optimizer.kind != KT_OPTIM_NONE)
        return kt__error(KT_EINVAL, "step: the learning rate is 0, so the step would change "
                         "nothing: set kt_session_options.optimizer.lr (e.g. 1e-3), or use "
                         "KT_OPTIM_NONE to step without updating"); /* zeroed options */
    const kt_optimizer_config *o = &s->opt.optimizer;
    uint64_t t0 = s->opt.trace ? kt__now_ns() : 0;
    const int32_t n_params = s->p->n_entries[KT_ROLE_PARAM];
    const int distributed = s->opt.comm != NULL && kt_comm_size(s->opt.comm) > 1;
    float *param, *grad, *st0, *st1;
    int64_t n;
    if (distributed)
        KT__TRY(average_over_ranks(s));

    /* average over micro-batches, then the global norm in a fixed order: the graph's
     * parameters, then each stateful op's spans (an op whose spans are split over the ranks
     * scales its own gradients by 1/world; its part of the norm is summed over the ranks) */
    float average = 1.0f / (float)s->micro;
    double sum_sq = 0.0, state_sq = 0.0;
    for (int32_t i = 0; i < n_params; i++) {
        if (!param_arrays(s, i, &param, &grad, &st0, &st1, &n))
            continue;
        if (s->micro > 1)
            kt__scale_inplace(s->pool, grad, n, average);
        sum_sq += kt__sum_squares(s->pool, grad, n);
    }
    for (int e = 0; e < s->n_stateful; e++) {
        const kt__stateful *st = &s->stateful[e];
        double part = 0.0;
        for (int i = 0; i < st->n_spans; i++) {
            if (s->micro > 1)
                kt__scale_inplace(s->pool, st->spans[i].grad, st->spans[i].n, average);
            part += kt__sum_squares(s->pool, st->spans[i].grad, st->spans[i].n);
        }
        if (distributed && st->hooks->spans_sharded && st->n_nodes > 0) {
            float shared = (float)part; /* every rank joins: rank 0 brings the value */
            KT__TRY(kt_comm_all_reduce(s->opt.comm, &shared, 1, KT_F32, KT_REDUCE_SUM));
            part = shared;
        }
        state_sq += part;
    }
    s->grad_norm = (float)sqrt(sum_sq + state_sq);
    if (!isfinite(s->grad_norm)) {
        s->micro = 0;
        return kt__error(KT_ERANGE, "step %lld: the gradient norm is %g; parameters left "
                         "unchanged", (long long)s->steps_done, (double)s->grad_norm);
    }
    float clip = 1.0f;
    if (o->clip_norm > 0 && s->grad_norm > o->clip_norm)
        clip = o->clip_norm / (s->grad_norm + 1e-6f);

    s->lr = scheduled_lr(s);
    for (int32_t i = 0; i < n_params; i++) {
        if (!param_arrays(s, i, &param, &grad, &st0, &st1, &n))
            continue;
        if (clip != 1.0f)
            kt__scale_inplace(s->pool, grad, n, clip);
        update(s, param, grad, st0, st1, n);
    }
    for (int e = 0; e < s->n_stateful; e++)
        for (int i = 0; i < s->stateful[e].n_spans; i++) {
            kt__state_span *t = &s->stateful[e].spans[i];
            if (clip != 1.0f)
                kt__scale_inplace(s->pool, t->grad, t->n, clip);
            update(s, t->param, t->grad, t->state[0], t->state[1], t->n);
        }
    s->steps_done++;
    s->micro = 0;
    if (s->opt.trace)
        kt__session_trace(s, "optimizer step", "optimizer", t0, kt__now_ns(), -1);
    return KT_OK;
}
