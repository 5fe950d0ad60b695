/* Optimizer kernels over flat f32 parameter buffers, used by the session's optimizer steps.
 * Internal: the public configuration lives in kt/program.h (kt_optimizer_config). */
#ifndef KT_OPTIM_OPTIM_H
#define KT_OPTIM_OPTIM_H

#include <stdint.h>

#include "kt/program.h"
#include "kt/runtime.h"
#include "kt/status.h"

/* The hyper-parameters one update needs (lr already scheduled for this step). */
typedef struct kt__sgd_params {
    float lr, momentum, dampening, weight_decay;
    int nesterov;
} kt__sgd_params;

typedef struct kt__adamw_params {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step; /* 1 for the first update: bias correction uses it */
} kt__adamw_params;

/* SGD with momentum, PyTorch's semantics (torch.optim.SGD): g += wd*p; buf = g on the first
 * update (first != 0), else buf = momentum*buf + (1-dampening)*g; nesterov: g += momentum*buf,
 * else g = buf; p -= lr*g. momentum_buf may be NULL when momentum == 0 (it is then neither
 * read nor written; a NULL buffer with momentum != 0 gives plain SGD). grad is not modified. */
void kt__sgd_update(kt_threadpool *pool, float *param, const float *grad, float *momentum_buf,
                    int64_t n, const kt__sgd_params *hp, int first);

/* AdamW, PyTorch's semantics (torch.optim.AdamW): p *= 1 - lr*wd; m = b1*m + (1-b1)*g;
 * v = b2*v + (1-b2)*g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). Evaluated in
 * f32 in PyTorch's order (m as a lerp towards g), to stay within a few ulps of it. A step
 * below 1 counts as 1. */
void kt__adamw_update(kt_threadpool *pool, float *param, const float *grad, float *m, float *v,
                      int64_t n, const kt__adamw_params *hp);

/* Sum of squares of a buffer in double, in a fixed order whatever the thread count: the
 * same bits for any pool. 0 for n <= 0. */
double kt__sum_squares(kt_threadpool *pool, const float *x, int64_t n);

/* x *= s */
void kt__scale_inplace(kt_threadpool *pool, float *x, int64_t n, float s);
/* dst += src (accumulating micro-batch gradients) */
void kt__accumulate(kt_threadpool *pool, float *dst, const float *src, int64_t n);

/* Learning-rate schedules (kt_lr_schedule_kind, kt/program.h). Every kind first warms up
 * linearly from 0 over warmup_steps (step 0 -> base_lr/warmup, reaching base_lr at step
 * warmup_steps-1); then constant stays at base_lr, linear falls in a straight line and cosine
 * along half a cosine from base_lr to min_lr over the remaining total_steps - warmup_steps,
 * both at min_lr from total_steps on. step counts from 0; a step inside the warm-up ramps even
 * when total_steps <= warmup_steps. */
float kt__lr_at(kt_lr_schedule_kind kind, float base_lr, float min_lr, int64_t warmup_steps,
                int64_t total_steps, int64_t step);

#endif
