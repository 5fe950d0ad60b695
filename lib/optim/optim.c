/* Optimizer kernels over flat f32 buffers.
 *
 * Precision: per-element arithmetic is f32, in PyTorch's order of operations; scalar
 * coefficients (1 - lr*wd, lr / (1 - b1^t), sqrt(1 - b2^t), 1 - dampening) are formed in
 * double and rounded to f32 once. That is exactly what torch.optim does on CPU: its
 * coefficients are Python floats (doubles) and its f32 kernels compute in f32 (the opmath type
 * of float is float). Mirroring it keeps libkt a few ulps from PyTorch, where computing in
 * double would round at different places and drift from it over many steps; the state is
 * stored in f32 anyway, and f32 vectorises at twice the width of double.
 *
 * Every kernel is element-wise except kt__sum_squares, so the static partition of the pool
 * cannot change any result; kt__sum_squares cuts its input into blocks that depend on n only
 * (see there). Nothing here allocates. */
#include <math.h>

#include "lib/optim/optim.h"

/* Items per part below which waking another thread costs more than it saves. */
#define KT__OPTIM_GRAIN 16384

/* sum_squares: blocks of at least this many elements, and at most this many blocks, so the
 * per-block partials fit on the stack. */
#define KT__SS_MIN_BLOCK 4096
#define KT__SS_MAX_BLOCKS 256
/* Independent accumulators inside a block: lets the compiler vectorise the loop without
 * reassociating anything, so the order stays fixed. */
#define KT__SS_LANES 8

/* ---- SGD ------------------------------------------------------------------------------------- */

typedef struct sgd_job {
    float *p, *buf;
    const float *g;
    float lr_neg, wd, mom, one_minus_damp;
    int nesterov, first;
} sgd_job;

static void sgd_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const sgd_job *j = ctx;
    float *p = j->p, *buf = j->buf;
    const float *g = j->g;
    for (int64_t i = begin; i < end; i++) {
        float d = g[i];
        /* PyTorch skips the add when wd == 0, which matters for non-finite params. */
        if (j->wd != 0.0f)
            d = d + j->wd * p[i];
        if (buf) {
            float b = j->first ? d : buf[i] * j->mom + j->one_minus_damp * d;
            buf[i] = b;
            d = j->nesterov ? d + j->mom * b : b;
        }
        p[i] = p[i] + j->lr_neg * d;
    }
}

void kt__sgd_update(kt_threadpool *pool, float *param, const float *grad, float *momentum_buf,
                    int64_t n, const kt__sgd_params *hp, int first)
{
    if (n <= 0 || !param || !grad || !hp)
        return;
    sgd_job j = {
        .p = param,
        .g = grad,
        /* momentum 0 means no buffer at all, as in PyTorch; a missing buffer falls back to
         * plain SGD rather than dereferencing NULL. */
        .buf = hp->momentum != 0.0f ? momentum_buf : NULL,
        .lr_neg = -hp->lr,
        .wd = hp->weight_decay,
        .mom = hp->momentum,
        .one_minus_damp = (float)(1.0 - (double)hp->dampening),
        .nesterov = hp->nesterov != 0,
        .first = first != 0,
    };
    kt_parallel_for(pool, n, KT__OPTIM_GRAIN, sgd_range, &j);
}

/* ---- AdamW ----------------------------------------------------------------------------------- */

typedef struct adamw_job {
    float *p, *m, *v;
    const float *g;
    float decay;      /* 1 - lr*wd */
    float w1;         /* 1 - beta1, the lerp weight */
    int w1_small;     /* |w1| < 0.5: which lerp formula PyTorch takes */
    float b2, c2;     /* beta2, 1 - beta2 */
    float bc2_sqrt;   /* sqrt(1 - beta2^t) */
    float step_neg;   /* -lr / (1 - beta1^t) */
    float eps;
} adamw_job;

static void adamw_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const adamw_job *j = ctx;
    float *p = j->p, *m = j->m, *v = j->v;
    const float *g = j->g;
    const float w1 = j->w1, one_minus_w1 = 1.0f - j->w1;
    for (int64_t i = begin; i < end; i++) {
        float gi = g[i];
        float pi = p[i] * j->decay;
        /* torch: exp_avg.lerp_(grad, 1 - beta1), which picks its formula by the weight */
        float mi = j->w1_small ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * one_minus_w1;
        /* torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) */
        float vi = v[i] * j->b2 + j->c2 * gi * gi;
        /* torch: denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
         *        param.addcdiv_(exp_avg, denom, value=-step_size) */
        float denom = sqrtf(vi) / j->bc2_sqrt + j->eps;
        p[i] = pi + j->step_neg * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

void kt__adamw_update(kt_threadpool *pool, float *param, const float *grad, float *m, float *v,
                      int64_t n, const kt__adamw_params *hp)
{
    if (n <= 0 || !param || !grad || !m || !v || !hp)
        return;
    /* step < 1 would make the bias corrections 0 (a division by zero): count it as the first */
    double t = hp->step < 1 ? 1.0 : (double)hp->step;
    double lr = hp->lr, b1 = hp->beta1, b2 = hp->beta2;
    double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    double w1 = 1.0 - b1;
    adamw_job j = {
        .p = param,
        .m = m,
        .v = v,
        .g = grad,
        .decay = (float)(1.0 - lr * (double)hp->weight_decay),
        .w1 = (float)w1,
        .w1_small = fabs(w1) < 0.5,
        .b2 = hp->beta2,
        .c2 = (float)(1.0 - b2),
        .bc2_sqrt = (float)sqrt(bc2),
        .step_neg = (float)(-(lr / bc1)),
        .eps = hp->eps,
    };
    kt_parallel_for(pool, n, KT__OPTIM_GRAIN, adamw_range, &j);
}

/* ---- reductions and element-wise helpers ------------------------------------------------------ */

typedef struct ss_job {
    const float *x;
    int64_t n, block; /* elements per block; the last may be shorter */
    double *partial;  /* one per block */
} ss_job;

static void ss_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const ss_job *j = ctx;
    for (int64_t b = begin; b < end; b++) {
        int64_t lo = b * j->block;
        int64_t hi = lo + j->block < j->n ? lo + j->block : j->n;
        double acc[KT__SS_LANES] = {0};
        int64_t i = lo;
        /* a float squared is exact in double (24+24 bits < 53): only the additions round */
        for (; i + KT__SS_LANES <= hi; i += KT__SS_LANES)
            for (int k = 0; k < KT__SS_LANES; k++)
                acc[k] += (double)j->x[i + k] * (double)j->x[i + k];
        for (int k = 0; i < hi; i++, k++)
            acc[k] += (double)j->x[i] * (double)j->x[i];
        double s = 0.0;
        for (int k = 0; k < KT__SS_LANES; k++)
            s += acc[k];
        j->partial[b] = s;
    }
}

double kt__sum_squares(kt_threadpool *pool, const float *x, int64_t n)
{
    if (n <= 0 || !x)
        return 0.0;
    /* The blocks depend on n alone, and threads only decide who computes which block, so
     * the result is the same for every thread count. Blocks grow past KT__SS_MIN_BLOCK once
     * there would be more than KT__SS_MAX_BLOCKS of them, keeping the partials on the stack. */
    int64_t blocks = (n + KT__SS_MIN_BLOCK - 1) / KT__SS_MIN_BLOCK;
    if (blocks > KT__SS_MAX_BLOCKS)
        blocks = KT__SS_MAX_BLOCKS;
    int64_t block = (n + blocks - 1) / blocks;
    double partial[KT__SS_MAX_BLOCKS];
    ss_job j = {.x = x, .n = n, .block = block, .partial = partial};
    int64_t grain = KT__OPTIM_GRAIN / block;
    kt_parallel_for(pool, blocks, grain < 1 ? 1 : grain, ss_range, &j);
    double s = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        s += partial[b];
    return s;
}

typedef struct axpy_job {
    float *x;
    const float *src;
    float s;
} axpy_job;

static void scale_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const axpy_job *j = ctx;
    float *x = j->x;
    for (int64_t i = begin; i < end; i++)
        x[i] *= j->s;
}

void kt__scale_inplace(kt_threadpool *pool, float *x, int64_t n, float s)
{
    if (n <= 0 || !x)
        return;
    axpy_job j = {.x = x, .s = s};
    kt_parallel_for(pool, n, KT__OPTIM_GRAIN, scale_range, &j);
}

static void accumulate_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const axpy_job *j = ctx;
    float *x = j->x;
    const float *src = j->src;
    for (int64_t i = begin; i < end; i++)
        x[i] += src[i];
}

void kt__accumulate(kt_threadpool *pool, float *dst, const float *src, int64_t n)
{
    if (n <= 0 || !dst || !src)
        return;
    axpy_job j = {.x = dst, .src = src};
    kt_parallel_for(pool, n, KT__OPTIM_GRAIN, accumulate_range, &j);
}

/* ---- learning-rate schedules ------------------------------------------------------------------ */

float kt__lr_at(kt_lr_schedule_kind kind, float base_lr, float min_lr, int64_t warmup_steps,
                int64_t total_steps, int64_t step)
{
    if (step < 0)
        step = 0;
    /* Warm-up wins over total_steps, so a total shorter than the warm-up still ramps up
     * instead of starting at min_lr. */
    if (step < warmup_steps)
        return (float)((double)base_lr * (double)(step + 1) / (double)warmup_steps);
    if (kind != KT_LR_COSINE && kind != KT_LR_LINEAR)
        return base_lr;
    int64_t warm = warmup_steps > 0 ? warmup_steps : 0;
    if (step >= total_steps)
        return min_lr;
    double progress = (double)(step - warm) / (double)(total_steps - warm);
    double left = kind == KT_LR_LINEAR ? 1.0 - progress
                                       : 0.5 * (1.0 + cos(3.14159265358979323846 * progress));
    return (float)((double)min_lr + ((double)base_lr - (double)min_lr) * left);
}
