/* Entry points of a call: forward (blocking), submit/sync (the forward on a driver thread
 * while the caller works on), and backward.
 *
 * submit validates on the caller's thread, so argument errors come back at once; the driver
 * thread (started by the first submit, joined by kt_moe_destroy) then runs the forward on the
 * MoE pool, which the caller must leave alone until sync. One call may be in flight: refusals
 * of a second one (KT_ESTATE) touch nothing, not even the forward cache, because the job in
 * flight still owns the layer's state. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"
#include "lib/core/thread_internal.h"
#include "lib/moe/moe_internal.h"

static kt_status refuse_busy(const kt_moe *m, const char *what)
{
    return kt__error(KT_ESTATE,
                     "moe '%s': %s while a submitted forward is in flight (call "
                     "kt_moe_sync first)",
                     m->name, what);
}

/* A recompute forward must bring exactly the routing the cached output was made from. */
static kt_status cache_match(const kt_moe *m, const kt__moe_job *job)
{
    if (job->qlen != m->route.qlen)
        return kt__error(KT_ESTATE,
                         "moe '%s': forward with qlen %lld does not match the cached forward "
                         "(qlen %lld)",
                         m->name, (long long)job->qlen, (long long)m->route.qlen);
    const float *w = job->w->data;
    for (int64_t s = 0; s < job->qlen * m->dim.K; s++) {
        int64_t e = kt__moe_get_id(job->ids, s);
        if (e != m->route.slot_expert[s] ||
            memcmp(&w[s], &m->route.slot_weight[s], sizeof(float)) != 0)
            return kt__error(KT_ESTATE,
                             "moe '%s': forward differs from the cached forward at token %lld "
                             "slot %lld (expert %lld weight %g, cached expert %lld weight %g)",
                             m->name, (long long)(s / m->dim.K), (long long)(s % m->dim.K),
                             (long long)e, (double)w[s], (long long)m->route.slot_expert[s],
                             (double)m->route.slot_weight[s]);
    }
    return KT_OK;
}

/* A forward refused here leaves no forward for backward to use: the previous one's kept
 * activations belong to other inputs, and a backward over them would return another batch's
 * gradients without an error. (A refusal because a call is in flight never gets here.) */
static kt_status prepare(kt_moe *m, const kt_tensor *x, const kt_tensor *ids, const kt_tensor *w,
                         kt_tensor *y, kt__moe_job *job)
{
    kt_status st = kt__moe_check_poison(m, "forward");
    if (st == KT_OK)
        st = kt__moe_check_forward(m, x, ids, w, y, job);
    if (st == KT_OK && m->cache.on && atomic_load(&m->cache.state) == KT_MOE_CACHE_READY) {
        st = cache_match(m, job);
        job->cache_hit = st == KT_OK;
    }
    if (st != KT_OK) {
        m->fwd.valid = 0;
        kt__moe_poison(m);
    }
    return st;
}

kt_status kt_moe_forward(kt_moe *moe, const kt_tensor *x, const kt_tensor *ids,
                         const kt_tensor *weights, kt_tensor *y)
{
    if (moe == NULL)
        return kt__error(KT_EINVAL, "kt_moe_forward: moe is NULL");
    if (moe->async.busy)
        return refuse_busy(moe, "forward");
    kt__moe_job job;
    KT__TRY(prepare(moe, x, ids, weights, y, &job));
    return kt__moe_forward_exec(moe, &job);
}

static void *driver_main(void *arg)
{
    kt_moe *m = arg;
    pthread_mutex_lock(&m->async.mu);
    for (;;) {
        while (!m->async.pending && !m->async.stop)
            pthread_cond_wait(&m->async.cv, &m->async.mu);
        if (!m->async.pending)
            break; /* stop with nothing left to run */
        m->async.pending = 0;
        pthread_mutex_unlock(&m->async.mu);
        kt_status st = kt__moe_forward_exec(m, &m->async.job);
        pthread_mutex_lock(&m->async.mu);
        m->async.status = st;
        /* The message lives in this thread's last-error slot; sync re-records it on the
         * caller's thread. */
        snprintf(m->async.msg, sizeof m->async.msg, "%s", st == KT_OK ? "" : kt_last_error());
        m->async.done = 1;
        pthread_cond_broadcast(&m->async.cv);
    }
    pthread_mutex_unlock(&m->async.mu);
    return NULL;
}

kt_status kt_moe_submit_forward(kt_moe *moe, const kt_tensor *x, const kt_tensor *ids,
                                const kt_tensor *weights, kt_tensor *y)
{
    if (moe == NULL)
        return kt__error(KT_EINVAL, "kt_moe_submit_forward: moe is NULL");
    if (moe->async.busy)
        return refuse_busy(moe, "submit_forward");
    kt__moe_job job;
    KT__TRY(prepare(moe, x, ids, weights, y, &job));
    if (!moe->async.started) {
        if (kt__thread_start(&moe->async.thread, driver_main, moe) != 0)
            return kt__error(KT_ENOMEM, "moe '%s': cannot start the driver thread", moe->name);
        moe->async.started = 1;
    }
    pthread_mutex_lock(&moe->async.mu);
    moe->async.job = job;
    /* The copies inside job must be what the driver reads, not the stack's. */
    moe->async.job.x = &moe->async.job.xs;
    moe->async.job.ids = &moe->async.job.idss;
    moe->async.job.w = &moe->async.job.ws;
    moe->async.job.y = &moe->async.job.ys;
    moe->async.done = 0;
    moe->async.pending = 1;
    moe->async.busy = 1;
    pthread_cond_broadcast(&moe->async.cv);
    pthread_mutex_unlock(&moe->async.mu);
    return KT_OK;
}

kt_status kt_moe_sync(kt_moe *moe)
{
    if (moe == NULL)
        return kt__error(KT_EINVAL, "kt_moe_sync: moe is NULL");
    if (!moe->async.busy)
        return kt__error(KT_ESTATE, "moe '%s': sync without a submitted forward", moe->name);
    pthread_mutex_lock(&moe->async.mu);
    while (!moe->async.done)
        pthread_cond_wait(&moe->async.cv, &moe->async.mu);
    kt_status st = moe->async.status;
    moe->async.done = 0;
    moe->async.busy = 0;
    pthread_mutex_unlock(&moe->async.mu);
    if (st != KT_OK)
        return kt__error(st, "%s", moe->async.msg);
    return KT_OK;
}

kt_status kt_moe_backward(kt_moe *moe, const kt_tensor *grad_y, kt_tensor *grad_x,
                          kt_tensor *grad_weights, float weight_grad_scale)
{
    if (moe == NULL)
        return kt__error(KT_EINVAL, "kt_moe_backward: moe is NULL");
    if (moe->async.busy)
        return refuse_busy(moe, "backward");
    KT__TRY(kt__moe_check_poison(moe, "backward"));
    kt_status st = KT_OK;
    if (!moe->fwd.valid)
        st = kt__error(KT_ESTATE, "moe '%s': backward without a successful forward", moe->name);
    if (st == KT_OK)
        st = kt__moe_check_backward(moe, grad_y, grad_x, grad_weights, weight_grad_scale);
    if (st == KT_OK)
        st = kt__moe_backward_exec(moe, grad_y, grad_x, grad_weights, weight_grad_scale);
    if (st != KT_OK) {
        kt__moe_poison(moe);
        return st;
    }
    if (moe->cache.on)
        atomic_store(&moe->cache.state, KT_MOE_CACHE_EMPTY);
    return KT_OK;
}
