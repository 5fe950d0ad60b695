/* Optimizer kernels: SGD and AdamW against float64 references of torch.optim's update rules
 * over 20 steps, sum of squares against a double sum and across thread counts, the learning
 * rate schedules, accumulate/scale, and the n = 0 / n = 1 edges. When /usr/bin/python3 can
 * import torch, the same updates are also compared with torch.optim itself. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/optim/optim.h"
#include "tests/support/test_util.h"

#define STEPS 20

static float *alloc_f32(int64_t n)
{
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    assert_non_null(p);
    return p;
}

static double *alloc_f64(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    assert_non_null(p);
    return p;
}

static void fill(float *x, int64_t n, tu_rng *rng, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)tu_rng_uniform(rng, lo, hi);
}

static void widen(double *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = src[i];
}

/* max |a - ref| over max(max |ref|, floor): error on the scale of the reference, so elements
 * that pass near zero do not blow the measure up. */
static double rel_err(const float *a, const double *ref, int64_t n, double floor)
{
    double diff = 0.0, scale = floor;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - ref[i]);
        if (d > diff || isnan(d))
            diff = d;
        if (fabs(ref[i]) > scale)
            scale = fabs(ref[i]);
    }
    return diff / scale;
}

static kt_threadpool *make_pool(int threads)
{
    kt_threadpool *pool = NULL;
    assert_int_equal(kt_threadpool_create(threads, &pool), KT_OK);
    assert_int_equal(kt_threadpool_size(pool), threads);
    return pool;
}

/* ---- float64 references, written from torch.optim's documented algorithms -------------------- */

static void ref_sgd_step(double *p, const double *g_in, double *buf, int64_t n,
                         const kt__sgd_params *hp, int first)
{
    double lr = hp->lr, mu = hp->momentum, tau = hp->dampening, wd = hp->weight_decay;
    for (int64_t i = 0; i < n; i++) {
        double g = g_in[i];
        if (wd != 0.0)
            g += wd * p[i];
        if (mu != 0.0) {
            buf[i] = first ? g : mu * buf[i] + (1.0 - tau) * g;
            g = hp->nesterov ? g + mu * buf[i] : buf[i];
        }
        p[i] -= lr * g;
    }
}

static void ref_adamw_step(double *p, const double *g, double *m, double *v, int64_t n,
                           const kt__adamw_params *hp)
{
    double lr = hp->lr, b1 = hp->beta1, b2 = hp->beta2, eps = hp->eps, wd = hp->weight_decay;
    double t = (double)hp->step;
    for (int64_t i = 0; i < n; i++) {
        p[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        double m_hat = m[i] / (1.0 - pow(b1, t));
        double v_hat = v[i] / (1.0 - pow(b2, t));
        p[i] -= lr * m_hat / (sqrt(v_hat) + eps);
    }
}

/* ---- SGD ----------------------------------------------------------------------------------- */

static const kt__sgd_params sgd_cases[] = {
    {.lr = 0.05f},                                             /* plain, no buffer */
    {.lr = 0.05f, .weight_decay = 0.02f},                      /* decay without momentum */
    {.lr = 0.02f, .momentum = 0.9f},                           /* heavy ball */
    {.lr = 0.02f, .momentum = 0.9f, .dampening = 0.3f},        /* dampened */
    {.lr = 0.02f, .momentum = 0.8f, .nesterov = 1},            /* nesterov */
    {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = 1},
    {.lr = 0.03f, .momentum = 0.5f, .dampening = 0.5f, .weight_decay = 0.1f},
};

/* One configuration for 20 steps with a fresh gradient each step: the inline run against the
 * reference, and a pooled run that must give the same bits as the inline one. */
static void run_sgd_case(const kt__sgd_params *hp, int64_t n, kt_threadpool *pool,
                         uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *p = alloc_f32(n), *pp = alloc_f32(n), *g = alloc_f32(n);
    float *buf = alloc_f32(n), *pbuf = alloc_f32(n);
    double *rp = alloc_f64(n), *rg = alloc_f64(n), *rbuf = alloc_f64(n);
    fill(p, n, &rng, -1, 1);
    memcpy(pp, p, (size_t)n * sizeof(float));
    widen(rp, p, n);
    /* the buffer's contents before the first step must not matter */
    for (int64_t i = 0; i < n; i++)
        buf[i] = pbuf[i] = 123.0f;
    int has_buf = hp->momentum != 0.0f;
    for (int s = 0; s < STEPS; s++) {
        /* gradients shrink and change sign pattern step to step, like a real run */
        fill(g, n, &rng, -1.0 / (1 + 0.1 * s), 1.0 / (1 + 0.1 * s));
        widen(rg, g, n);
        kt__sgd_update(NULL, p, g, has_buf ? buf : NULL, n, hp, s == 0);
        kt__sgd_update(pool, pp, g, has_buf ? pbuf : NULL, n, hp, s == 0);
        ref_sgd_step(rp, rg, rbuf, n, hp, s == 0);
    }
    double e = rel_err(p, rp, n, 1.0);
    if (e > 1e-5)
        fail_msg("sgd lr=%g mom=%g damp=%g wd=%g nest=%d n=%lld: rel err %g", (double)hp->lr,
                 (double)hp->momentum, (double)hp->dampening, (double)hp->weight_decay,
                 hp->nesterov, (long long)n, e);
    if (has_buf)
        assert_true(rel_err(buf, rbuf, n, 1.0) <= 1e-5);
    else
        assert_true(buf[0] == 123.0f); /* without momentum the buffer is not touched */
    assert_memory_equal(p, pp, (size_t)n * sizeof(float));
    assert_memory_equal(buf, pbuf, (size_t)n * sizeof(float));
    free(p), free(pp), free(g), free(buf), free(pbuf), free(rp), free(rg), free(rbuf);
}

static void test_sgd(void **state)
{
    (void)state;
    kt_threadpool *pool = make_pool(3);
    for (size_t c = 0; c < sizeof sgd_cases / sizeof sgd_cases[0]; c++) {
        run_sgd_case(&sgd_cases[c], 1, pool, 100 + c);
        run_sgd_case(&sgd_cases[c], 777, pool, 200 + c);
        run_sgd_case(&sgd_cases[c], 70001, pool, 300 + c); /* enough to split over 3 threads */
    }
    kt_threadpool_destroy(pool);
}

/* The grad buffer is an input: the weight-decay and momentum terms must not be folded into
 * it, since the session reads the gradients again (norms, the next accumulation). */
static void test_sgd_keeps_grad(void **state)
{
    (void)state;
    float p[3] = {1, 2, 3}, g[3] = {0.5f, -0.5f, 0.25f}, buf[3] = {0};
    const kt__sgd_params hp = {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.1f,
                               .nesterov = 1};
    kt__sgd_update(NULL, p, g, buf, 3, &hp, 1);
    assert_true(g[0] == 0.5f && g[1] == -0.5f && g[2] == 0.25f);
    /* first step: buf = g + wd*p exactly, and nesterov p -= lr*(d + mu*buf) */
    assert_true(buf[0] == 0.5f + 0.1f * 1.0f);
    assert_float_equal(p[0], 1.0 - 0.1 * (0.6 + 0.9 * 0.6), 1e-6);
}

/* ---- AdamW ---------------------------------------------------------------------------------- */

static const kt__adamw_params adamw_cases[] = {
    {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f},
    {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f},
    {.lr = 3e-3f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-8f},
    /* 1 - beta1 >= 0.5 takes the other branch of PyTorch's lerp */
    {.lr = 5e-3f, .beta1 = 0.3f, .beta2 = 0.9f, .eps = 1e-7f, .weight_decay = 0.05f},
};

static void run_adamw_case(const kt__adamw_params *base, int64_t n, kt_threadpool *pool,
                           uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *p = alloc_f32(n), *pp = alloc_f32(n), *g = alloc_f32(n);
    float *m = alloc_f32(n), *v = alloc_f32(n), *pm = alloc_f32(n), *pv = alloc_f32(n);
    double *rp = alloc_f64(n), *rg = alloc_f64(n), *rm = alloc_f64(n), *rv = alloc_f64(n);
    fill(p, n, &rng, -1, 1);
    memcpy(pp, p, (size_t)n * sizeof(float));
    widen(rp, p, n);
    for (int s = 0; s < STEPS; s++) {
        kt__adamw_params hp = *base;
        hp.step = s + 1;
        /* a drifting mean plus noise, so m and v do not settle to a constant */
        double mean = 0.3 * sin(0.7 * s);
        fill(g, n, &rng, mean - 0.5, mean + 0.5);
        widen(rg, g, n);
        kt__adamw_update(NULL, p, g, m, v, n, &hp);
        kt__adamw_update(pool, pp, g, pm, pv, n, &hp);
        ref_adamw_step(rp, rg, rm, rv, n, &hp);
    }
    double ep = rel_err(p, rp, n, 1.0), em = rel_err(m, rm, n, 1e-3),
           ev = rel_err(v, rv, n, 1e-3);
    if (ep > 1e-5 || em > 1e-5 || ev > 1e-5)
        fail_msg("adamw lr=%g b1=%g b2=%g wd=%g n=%lld: rel err p %g m %g v %g",
                 (double)base->lr, (double)base->beta1, (double)base->beta2,
                 (double)base->weight_decay, (long long)n, ep, em, ev);
    assert_memory_equal(p, pp, (size_t)n * sizeof(float));
    assert_memory_equal(m, pm, (size_t)n * sizeof(float));
    assert_memory_equal(v, pv, (size_t)n * sizeof(float));
    free(p), free(pp), free(g), free(m), free(v), free(pm), free(pv);
    free(rp), free(rg), free(rm), free(rv);
}

static void test_adamw(void **state)
{
    (void)state;
    kt_threadpool *pool = make_pool(4);
    for (size_t c = 0; c < sizeof adamw_cases / sizeof adamw_cases[0]; c++) {
        run_adamw_case(&adamw_cases[c], 1, pool, 400 + c);
        run_adamw_case(&adamw_cases[c], 1001, pool, 500 + c);
        run_adamw_case(&adamw_cases[c], 90001, pool, 600 + c);
    }
    kt_threadpool_destroy(pool);
}

/* The first step's bias correction makes the update lr * sign(g) (up to eps), whatever g's
 * magnitude: a hand-checkable value. */
static void test_adamw_first_step(void **state)
{
    (void)state;
    float p[2] = {0.0f, 1.0f}, g[2] = {4.0f, -1e-3f}, m[2] = {0}, v[2] = {0};
    const kt__adamw_params hp = {.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                 .step = 1};
    kt__adamw_update(NULL, p, g, m, v, 2, &hp);
    assert_float_equal(p[0], -0.01, 1e-6);
    assert_float_equal(p[1], 1.01, 1e-6);
}

/* ---- sum of squares ----------------------------------------------------------------------- */

static void test_sum_squares(void **state)
{
    (void)state;
    /* below one block, exactly one, one past, many blocks, and past the block cap */
    const int64_t sizes[] = {1, 7, 4096, 4097, 100003, 3000017};
    kt_threadpool *pools[4];
    for (int t = 0; t < 4; t++)
        pools[t] = make_pool(t + 1);
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int64_t n = sizes[k];
        float *x = alloc_f32(n);
        /* magnitudes over ~12 decades, so the summation order shows in the low bits */
        for (int64_t i = 0; i < n; i++)
            x[i] = (float)(tu_rng_normal(&rng) * exp(tu_rng_uniform(&rng, -14, 14)));
        long double ref = 0.0L;
        for (int64_t i = 0; i < n; i++)
            ref += (long double)x[i] * (long double)x[i];
        double inline_sum = kt__sum_squares(NULL, x, n);
        double err = fabs(inline_sum - (double)ref) / (double)ref;
        if (err > 1e-12)
            fail_msg("sum_squares n=%lld: rel err %g", (long long)n, err);
        for (int t = 0; t < 4; t++) {
            double s = kt__sum_squares(pools[t], x, n);
            if (memcmp(&s, &inline_sum, sizeof s) != 0)
                fail_msg("sum_squares n=%lld, %d threads: %.17g != %.17g inline", (long long)n,
                         t + 1, s, inline_sum);
        }
        free(x);
    }
    for (int t = 0; t < 4; t++)
        kt_threadpool_destroy(pools[t]);
}

/* ---- learning-rate schedules ------------------------------------------------------------- */

static void expect_lr(float got, double want)
{
    if (fabs((double)got - want) > 1e-6 * fabs(want) + 1e-12)
        fail_msg("lr %.9g, expected %.9g", (double)got, want);
}

static void test_lr_schedules(void **state)
{
    (void)state;
    const float base = 0.1f, lo = 0.01f;
    const int64_t warm = 10, total = 110;
    /* constant: the warm-up, then base whatever min and total say */
    expect_lr(kt__lr_at(KT_LR_CONSTANT, base, lo, warm, total, 0), (double)base / 10);
    expect_lr(kt__lr_at(KT_LR_CONSTANT, base, lo, warm, total, 4), (double)base * 5 / 10);
    for (int64_t s = warm - 1; s < 300; s += 37)
        assert_true(kt__lr_at(KT_LR_CONSTANT, base, lo, warm, total, s) == base);
    for (int64_t s = 0; s < 300; s += 37)
        assert_true(kt__lr_at(KT_LR_CONSTANT, base, lo, 0, total, s) == base);
    /* warm-up: step 0 gives base/warm, step warm-1 reaches base, linear in between */
    expect_lr(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, 0), (double)base / 10);
    expect_lr(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, 4), (double)base * 5 / 10);
    assert_true(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, warm - 1) == base);
    /* the cosine starts at base, passes (base+min)/2 halfway, and ends at min */
    assert_true(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, warm) == base);
    expect_lr(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, warm + (total - warm) / 2),
              ((double)base + (double)lo) / 2);
    expect_lr(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, warm + (total - warm) / 4),
              (double)lo + ((double)base - lo) * 0.5 * (1 + cos(3.14159265358979323846 / 4)));
    float prev = base;
    for (int64_t s = warm + 1; s < total; s++) {
        float lr = kt__lr_at(KT_LR_COSINE, base, lo, warm, total, s);
        assert_true(lr <= prev && lr > lo);
        prev = lr;
    }
    assert_true(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, total) == lo);
    assert_true(kt__lr_at(KT_LR_COSINE, base, lo, warm, total, total + 1000) == lo);
    /* no warm-up: the cosine starts at step 0 */
    assert_true(kt__lr_at(KT_LR_COSINE, base, lo, 0, 100, 0) == base);
    expect_lr(kt__lr_at(KT_LR_COSINE, base, lo, 0, 100, 50), ((double)base + lo) / 2);
    assert_true(kt__lr_at(KT_LR_COSINE, base, lo, 0, 100, 100) == lo);
    /* min 0 decays to exactly 0 */
    assert_true(kt__lr_at(KT_LR_COSINE, base, 0.0f, 0, 100, 100) == 0.0f);
}

static void test_lr_linear(void **state)
{
    (void)state;
    const float base = 0.1f, lo = 0.01f;
    const int64_t warm = 10, total = 110;
    /* the same warm-up as the others */
    expect_lr(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, 0), (double)base / 10);
    expect_lr(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, 6), (double)base * 7 / 10);
    assert_true(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, warm - 1) == base);
    /* then a straight line from base at the warm-up's end to min at total */
    assert_true(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, warm) == base);
    for (int64_t s = warm; s < total; s += 7)
        expect_lr(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, s),
                  (double)base + ((double)lo - base) * (double)(s - warm) / (double)(total - warm));
    expect_lr(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, warm + 25),
              (double)base - ((double)base - lo) / 4);
    assert_true(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, total) == lo);
    assert_true(kt__lr_at(KT_LR_LINEAR, base, lo, warm, total, total + 5) == lo);
    /* no warm-up, to 0 (Hugging Face's "linear"): base at step 0, half way base/2 */
    assert_true(kt__lr_at(KT_LR_LINEAR, base, 0.0f, 0, 100, 0) == base);
    expect_lr(kt__lr_at(KT_LR_LINEAR, base, 0.0f, 0, 100, 50), (double)base / 2);
    expect_lr(kt__lr_at(KT_LR_LINEAR, base, 0.0f, 0, 100, 99), (double)base / 100);
    assert_true(kt__lr_at(KT_LR_LINEAR, base, 0.0f, 0, 100, 100) == 0.0f);
    /* a total inside the warm-up still ramps */
    expect_lr(kt__lr_at(KT_LR_LINEAR, base, lo, 20, 5, 3), (double)base * 4 / 20);
}

/* ---- accumulate and scale ------------------------------------------------------------------ */

static void test_accumulate_scale(void **state)
{
    (void)state;
    kt_threadpool *pool = make_pool(2);
    tu_rng rng;
    tu_rng_seed(&rng, 11);
    const int64_t sizes[] = {1, 33, 50001};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int64_t n = sizes[k];
        float *a = alloc_f32(n), *b = alloc_f32(n), *want = alloc_f32(n);
        fill(a, n, &rng, -3, 3);
        fill(b, n, &rng, -3, 3);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] + b[i];
        kt__accumulate(k % 2 ? pool : NULL, a, b, n);
        assert_memory_equal(a, want, (size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] * 0.37f;
        kt__scale_inplace(k % 2 ? NULL : pool, a, n, 0.37f);
        assert_memory_equal(a, want, (size_t)n * sizeof(float));
        free(a), free(b), free(want);
    }
    kt_threadpool_destroy(pool);
}

/* ---- n = 0 and n = 1 ------------------------------------------------------------------------ */

static void test_edges(void **state)
{
    (void)state;
    float p[1] = {1.5f}, g[1] = {-2.0f}, m[1] = {0.25f}, v[1] = {0.5f};
    const kt__sgd_params shp = {.lr = 0.1f, .momentum = 0.9f};
    const kt__adamw_params ahp = {.lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                  .weight_decay = 0.1f, .step = 3};
    /* n = 0 touches nothing, and with n = 0 no buffer is needed at all */
    kt__sgd_update(NULL, p, g, m, 0, &shp, 1);
    kt__adamw_update(NULL, p, g, m, v, 0, &ahp);
    kt__scale_inplace(NULL, p, 0, 3.0f);
    kt__accumulate(NULL, p, g, 0);
    assert_true(p[0] == 1.5f && g[0] == -2.0f && m[0] == 0.25f && v[0] == 0.5f);
    assert_true(kt__sum_squares(NULL, p, 0) == 0.0);
    kt__sgd_update(NULL, NULL, NULL, NULL, 0, &shp, 1);
    kt__adamw_update(NULL, NULL, NULL, NULL, NULL, 0, &ahp);
    kt__scale_inplace(NULL, NULL, 0, 3.0f);
    kt__accumulate(NULL, NULL, NULL, 0);
    assert_true(kt__sum_squares(NULL, NULL, 0) == 0.0);

    /* n = 1, by hand */
    assert_true(kt__sum_squares(NULL, g, 1) == 4.0);
    kt__accumulate(NULL, p, g, 1);
    assert_true(p[0] == -0.5f);
    kt__scale_inplace(NULL, p, 1, -4.0f);
    assert_true(p[0] == 2.0f);
    /* sgd, a second step on a buffer of 0.25: buf = 0.9*0.25 - 2 = -1.775, p = 2 + 0.1775 */
    kt__sgd_update(NULL, p, g, m, 1, &shp, 0);
    assert_float_equal(m[0], -1.775, 1e-6);
    assert_float_equal(p[0], 2.1775, 1e-6);
    /* adamw, step 3 from m = 0.25, v = 0.5 (state set by hand), against the reference */
    double rp = p[0], rg = g[0], rm = 0.25, rv = 0.5;
    m[0] = 0.25f;
    kt__adamw_update(NULL, p, g, m, v, 1, &ahp);
    ref_adamw_step(&rp, &rg, &rm, &rv, 1, &ahp);
    assert_float_equal(p[0], rp, 1e-6 * fabs(rp));
    assert_float_equal(m[0], rm, 1e-6);
    assert_float_equal(v[0], rv, 1e-6);
}

/* ---- optional: torch.optim itself ---------------------------------------------------------- */

/* Inputs both sides can build bit for bit: small rationals, rounded once to f32. */
static float torch_param(int i) { return (float)((double)((i * 7919) % 2001 - 1000) / 1000.0); }
static float torch_grad(int i, int s)
{
    return (float)((double)((i * 31 + s * 977) % 1999 - 999) / 1000.0);
}

#define TORCH_N 64
static const char torch_script[] =
    "import sys, struct\n"
    "try:\n"
    "    import torch\n"
    "except Exception:\n"
    "    print('NO_TORCH'); sys.exit(0)\n"
    "print('TORCH')\n"
    "torch.set_num_threads(1)\n"
    "N, S = 64, 20\n"
    "f32 = lambda x: struct.unpack('f', struct.pack('f', x))[0]\n"
    "def par():\n"
    "    return torch.tensor([((i*7919)%2001-1000)/1000.0 for i in range(N)],"
    " dtype=torch.float32).requires_grad_()\n"
    "def run(opt_fn):\n"
    "    p = par(); o = opt_fn([p])\n"
    "    for s in range(S):\n"
    "        p.grad = torch.tensor([((i*31+s*977)%1999-999)/1000.0 for i in range(N)],"
    " dtype=torch.float32)\n"
    "        o.step()\n"
    "    print(' '.join(repr(x) for x in p.detach().double().tolist()))\n"
    "run(lambda ps: torch.optim.SGD(ps, lr=f32(0.02), momentum=f32(0.9), dampening=f32(0.1),"
    " weight_decay=f32(0.01), foreach=False))\n"
    "run(lambda ps: torch.optim.SGD(ps, lr=f32(0.02), momentum=f32(0.9), nesterov=True,"
    " foreach=False))\n"
    "run(lambda ps: torch.optim.AdamW(ps, lr=f32(0.01), betas=(f32(0.9), f32(0.999)),"
    " eps=f32(1e-8), weight_decay=f32(0.1), foreach=False))\n";

static int read_row(FILE *f, double *row)
{
    for (int i = 0; i < TORCH_N; i++)
        if (fscanf(f, "%lf", &row[i]) != 1)
            return 0;
    return 1;
}

static void test_against_torch(void **state)
{
    (void)state;
    FILE *probe = fopen("/usr/bin/python3", "r");
    if (!probe)
        skip();
    fclose(probe);
    char path[] = "/tmp/kt_test_optim_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *script = fdopen(fd, "w");
    assert_non_null(script);
    fputs(torch_script, script);
    fclose(script);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s 2>/dev/null", path);
    FILE *out = popen(cmd, "r");
    assert_non_null(out);
    double rows[3][TORCH_N];
    char head[16] = {0};
    int ok = fscanf(out, "%15s", head) == 1 && strcmp(head, "TORCH") == 0 &&
             read_row(out, rows[0]) && read_row(out, rows[1]) && read_row(out, rows[2]);
    pclose(out);
    remove(path);
    if (!ok)
        skip(); /* no torch here: the float64 references above still cover the maths */

    const kt__sgd_params sgd[2] = {
        {.lr = 0.02f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 0.01f},
        {.lr = 0.02f, .momentum = 0.9f, .nesterov = 1}};
    float p[TORCH_N], g[TORCH_N], b[TORCH_N], m[TORCH_N], v[TORCH_N];
    for (int c = 0; c < 3; c++) {
        for (int i = 0; i < TORCH_N; i++)
            p[i] = torch_param(i), b[i] = m[i] = v[i] = 0.0f;
        for (int s = 0; s < STEPS; s++) {
            for (int i = 0; i < TORCH_N; i++)
                g[i] = torch_grad(i, s);
            if (c < 2) {
                kt__sgd_update(NULL, p, g, b, TORCH_N, &sgd[c], s == 0);
            } else {
                const kt__adamw_params hp = {.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f,
                                             .eps = 1e-8f, .weight_decay = 0.1f, .step = s + 1};
                kt__adamw_update(NULL, p, g, m, v, TORCH_N, &hp);
            }
        }
        /* same f32 operations in the same order: a few ulps of drift at most (PyTorch's
         * vector paths may fuse multiply-adds where libkt does not) */
        double e = rel_err(p, rows[c], TORCH_N, 1.0);
        if (e > 1e-6)
            fail_msg("case %d: libkt differs from torch.optim by %g", c, e);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sgd),
        cmocka_unit_test(test_sgd_keeps_grad),
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_adamw_first_step),
        cmocka_unit_test(test_sum_squares),
        cmocka_unit_test(test_lr_schedules),
        cmocka_unit_test(test_lr_linear),
        cmocka_unit_test(test_accumulate_scale),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_against_torch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
