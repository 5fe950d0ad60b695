/* The MoE layer: every mode against a float64 reference written here (forward, grad_x,
 * grad_w, LoRA and full weight gradients), accumulation across backwards, keep_activations
 * 0 vs 1 and thread counts bitwise, validation errors, the forward cache state machine,
 * submit/sync, load/save. Shapes stay small: the bf16 kernels may be the scalar ones. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>

#include "lib/kernels/bf16_gemm.h"
#include "lib/moe/moe_internal.h"
#include "tests/support/test_util.h"


static kt_moe_config make_cfg(kt_dtype wd, kt_dtype ad, kt_moe_mode mode, int64_t H, int64_t I,
                              int64_t E, int64_t K, int64_t T)
{
    kt_moe_config c;
    memset(&c, 0, sizeof c);
    c.n_experts = E;
    c.hidden = H;
    c.intermediate = I;
    c.top_k = K;
    c.max_tokens = T;
    c.weight_dtype = wd;
    c.act_dtype = ad;
    c.mode = mode;
    c.lora_rank = mode == KT_MOE_LORA ? 4 : 0;
    c.lora_alpha = 8.0f;
    c.keep_activations = 1;
    c.check_finite = 1;
    c.name = "L7";
    c.numa_node = -1;
    return c;
}

/* Random weights (and a non-zero LoRA B, so the adapters matter). */
static void fill_params(kt_moe *m, uint64_t seed)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    tu_rng r;
    tu_rng_seed(&r, seed);
    for (int64_t e = 0; e < c->n_experts; e++)
        for (int p = 0; p < 3; p++) {
            /* set, not written through a view: a quantized layer quantizes them */
            kt_tensor v = p == 2 ? tu_new(c->weight_dtype, c->hidden, c->intermediate)
                                 : tu_new(c->weight_dtype, c->intermediate, c->hidden);
            tu_fill_uniform(&v, &r, -0.25, 0.25);
            OK(kt_moe_set_weight(m, e, (kt_moe_proj)p, &v));
            tu_free(&v);
            if (c->mode == KT_MOE_LORA) {
                OK(kt_moe_lora(m, e, (kt_moe_proj)p, 1, &v));
                tu_fill_uniform(&v, &r, -0.2, 0.2);
            }
        }
}

typedef struct inputs {
    int64_t qlen;
    kt_tensor x, ids, w, y, gy, gx, gw;
} inputs;

static void make_inputs(inputs *in, const kt_moe_config *c, int64_t qlen, kt_dtype id_dtype,
                        uint64_t seed)
{
    tu_rng r;
    tu_rng_seed(&r, seed);
    in->qlen = qlen;
    in->x = tu_new(c->act_dtype, qlen, c->hidden);
    in->ids = tu_new(id_dtype, qlen, c->top_k);
    in->w = tu_new(KT_F32, qlen, c->top_k);
    in->y = tu_new(c->act_dtype, qlen, c->hidden);
    in->gy = tu_new(c->act_dtype, qlen, c->hidden);
    in->gx = tu_new(c->act_dtype, qlen, c->hidden);
    in->gw = tu_new(KT_F32, qlen, c->top_k);
    tu_fill_uniform(&in->x, &r, -1.0, 1.0);
    tu_fill_uniform(&in->gy, &r, -1.0, 1.0);
    tu_fill_uniform(&in->w, &r, 0.1, 1.0);
    for (int64_t t = 0; t < qlen; t++)
        for (int64_t j = 0; j < c->top_k; j++) {
            int64_t e;
            int dup;
            do { /* distinct experts per token */
                e = (int64_t)(tu_rng_next(&r) % (uint64_t)c->n_experts);
                dup = 0;
                for (int64_t i = 0; i < j; i++)
                    dup |= (int64_t)tu_get(&in->ids, t * c->top_k + i) == e;
            } while (dup);
            tu_set(&in->ids, t * c->top_k + j, (double)e);
        }
}

static void free_inputs(inputs *in)
{
    tu_free(&in->x);
    tu_free(&in->ids);
    tu_free(&in->w);
    tu_free(&in->y);
    tu_free(&in->gy);
    tu_free(&in->gx);
    tu_free(&in->gw);
}

/* ---- the float64 reference ----------------------------------------------------------------- */

typedef struct ref {
    double *y, *gx, *gw, *dw, *dl;
} ref;

static int64_t pin(const kt_moe_config *c, int p) { return p == 2 ? c->intermediate : c->hidden; }
static int64_t lora_size(const kt_moe_config *c)
{
    return c->n_experts * 3 * c->lora_rank * (c->hidden + c->intermediate);
}

static double *tensor_d(const kt_tensor *t)
{
    int64_t n = kt_tensor_numel(t);
    double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
    for (int64_t i = 0; i < n; i++)
        d[i] = tu_get(t, i);
    return d;
}

static double sigm(double g) { return 1.0 / (1.0 + exp(-g)); }

/* y, grad_x, grad_w and the weight/LoRA gradients (times s) of one forward+backward. */
static void reference(kt_moe *m, const inputs *in, double s, ref *o)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    int64_t H = c->hidden, I = c->intermediate, E = c->n_experts, K = c->top_k;
    int64_t R = c->lora_rank, q = in->qlen;
    double sc = R ? c->lora_alpha / (double)R : 0.0;
    int lora = c->mode == KT_MOE_LORA;
    double *W[64][3], *LA[64][3], *LB[64][3];
    assert_true(E <= 64);
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            /* the values the layer multiplies by (a quantized layer's dequantized ones) */
            kt_tensor v = p == 2 ? tu_new(KT_F32, H, I) : tu_new(KT_F32, I, H);
            OK(kt_moe_get_weight(m, e, (kt_moe_proj)p, &v));
            W[e][p] = tensor_d(&v);
            tu_free(&v);
            LA[e][p] = LB[e][p] = NULL;
            if (lora) {
                OK(kt_moe_lora(m, e, (kt_moe_proj)p, 0, &v));
                LA[e][p] = tensor_d(&v);
                OK(kt_moe_lora(m, e, (kt_moe_proj)p, 1, &v));
                LB[e][p] = tensor_d(&v);
            }
        }
    o->y = calloc((size_t)(q * H + 1), sizeof(double));
    o->gx = calloc((size_t)(q * H + 1), sizeof(double));
    o->gw = calloc((size_t)(q * K + 1), sizeof(double));
    o->dw = calloc((size_t)(E * 3 * H * I), sizeof(double));
    o->dl = calloc((size_t)(lora_size(c) + 1), sizeof(double));
    double *x = malloc((size_t)H * sizeof(double)), *gy = malloc((size_t)H * sizeof(double));
    double *G = malloc((size_t)I * 8), *U = malloc((size_t)I * 8), *A = malloc((size_t)I * 8);
    double *D = malloc((size_t)H * 8), *gA = malloc((size_t)I * 8), *gG = malloc((size_t)I * 8);
    double *gU = malloc((size_t)I * 8), *gD = malloc((size_t)H * 8);
    double Z[3][16], gZ[3][16];
    for (int64_t t = 0; t < q; t++) {
        for (int64_t h = 0; h < H; h++) {
            x[h] = tu_get(&in->x, t * H + h);
            gy[h] = tu_get(&in->gy, t * H + h);
        }
        for (int64_t j = 0; j < K; j++) {
            int64_t e = (int64_t)tu_get(&in->ids, t * K + j);
            double wt = tu_get(&in->w, t * K + j);
            double *Wg = W[e][0], *Wu = W[e][1], *Wd = W[e][2];
            for (int p = 0; lora && p < 2; p++)
                for (int64_t r = 0; r < R; r++) {
                    Z[p][r] = 0;
                    for (int64_t h = 0; h < H; h++)
                        Z[p][r] += x[h] * LA[e][p][r * H + h];
                }
            for (int64_t n = 0; n < I; n++) {
                double g = 0, u = 0;
                for (int64_t h = 0; h < H; h++) {
                    g += x[h] * Wg[n * H + h];
                    u += x[h] * Wu[n * H + h];
                }
                for (int64_t r = 0; lora && r < R; r++) {
                    g += sc * Z[0][r] * LB[e][0][n * R + r];
                    u += sc * Z[1][r] * LB[e][1][n * R + r];
                }
                G[n] = g;
                U[n] = u;
                A[n] = g * sigm(g) * u;
            }
            for (int64_t r = 0; lora && r < R; r++) {
                Z[2][r] = 0;
                for (int64_t n = 0; n < I; n++)
                    Z[2][r] += A[n] * LA[e][2][r * I + n];
            }
            double gwv = 0;
            for (int64_t h = 0; h < H; h++) {
                double d = 0;
                for (int64_t n = 0; n < I; n++)
                    d += A[n] * Wd[h * I + n];
                for (int64_t r = 0; lora && r < R; r++)
                    d += sc * Z[2][r] * LB[e][2][h * R + r];
                D[h] = d;
                o->y[t * H + h] += wt * d;
                gwv += gy[h] * d;
                gD[h] = wt * gy[h];
            }
            o->gw[t * K + j] = gwv;
            double *dl[3][2];
            for (int p = 0; p < 3; p++) {
                dl[p][0] = o->dl + (e * 3 + p) * R * (H + I);
                dl[p][1] = dl[p][0] + R * pin(c, p);
            }
            for (int64_t r = 0; lora && r < R; r++) {
                gZ[2][r] = 0;
                for (int64_t h = 0; h < H; h++)
                    gZ[2][r] += sc * gD[h] * LB[e][2][h * R + r];
            }
            for (int64_t n = 0; n < I; n++) {
                double ga = 0;
                for (int64_t h = 0; h < H; h++)
                    ga += gD[h] * Wd[h * I + n];
                for (int64_t r = 0; lora && r < R; r++)
                    ga += gZ[2][r] * LA[e][2][r * I + n];
                gA[n] = ga;
                double sg = sigm(G[n]);
                gG[n] = ga * U[n] * sg * (1 + G[n] * (1 - sg));
                gU[n] = ga * G[n] * sg;
            }
            double *dWg = o->dw + (e * 3 + 0) * H * I, *dWu = o->dw + (e * 3 + 1) * H * I;
            double *dWd = o->dw + (e * 3 + 2) * H * I;
            for (int64_t h = 0; h < H; h++)
                for (int64_t n = 0; n < I; n++) {
                    dWd[h * I + n] += s * gD[h] * A[n];
                    dWg[n * H + h] += s * gG[n] * x[h];
                    dWu[n * H + h] += s * gU[n] * x[h];
                }
            if (lora) {
                for (int64_t r = 0; r < R; r++) {
                    gZ[0][r] = gZ[1][r] = 0;
                    for (int64_t n = 0; n < I; n++) {
                        gZ[0][r] += sc * gG[n] * LB[e][0][n * R + r];
                        gZ[1][r] += sc * gU[n] * LB[e][1][n * R + r];
                    }
                }
                for (int64_t r = 0; r < R; r++) {
                    for (int64_t h = 0; h < H; h++) {
                        dl[2][1][h * R + r] += s * sc * gD[h] * Z[2][r];
                        dl[0][0][r * H + h] += s * gZ[0][r] * x[h];
                        dl[1][0][r * H + h] += s * gZ[1][r] * x[h];
                    }
                    for (int64_t n = 0; n < I; n++) {
                        dl[2][0][r * I + n] += s * gZ[2][r] * A[n];
                        dl[0][1][n * R + r] += s * sc * gG[n] * Z[0][r];
                        dl[1][1][n * R + r] += s * sc * gU[n] * Z[1][r];
                    }
                }
            }
            for (int64_t h = 0; h < H; h++) {
                double g = 0;
                for (int64_t n = 0; n < I; n++)
                    g += gG[n] * Wg[n * H + h] + gU[n] * Wu[n * H + h];
                for (int64_t r = 0; lora && r < R; r++)
                    g += gZ[0][r] * LA[e][0][r * H + h] + gZ[1][r] * LA[e][1][r * H + h];
                o->gx[t * H + h] += g;
            }
            (void)gA;
        }
    }
    free(x), free(gy), free(G), free(U), free(A), free(D), free(gA), free(gG), free(gU), free(gD);
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++)
            free(W[e][p]), free(LA[e][p]), free(LB[e][p]);
}

static void free_ref(ref *o) { free(o->y), free(o->gx), free(o->gw), free(o->dw), free(o->dl); }

static double rel_err(const double *got, const double *want, int64_t n)
{
    double scale = 1e-6, err = 0;
    for (int64_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(want[i]));
    for (int64_t i = 0; i < n; i++)
        err = fmax(err, fabs(got[i] - want[i]));
    return err / scale;
}

/* rel_err of the weight gradients taken per tensor (each expert's gate, up and down, or each
 * LoRA A and B, in the reference's layout) and the worst kept: normalised over all of them
 * at once, an error in small tensors (LoRA's A next to its B) would hide under the large. */
static double rel_err_per_tensor(const double *got, const double *want, const kt_moe_config *c)
{
    int64_t H = c->hidden, I = c->intermediate, R = c->lora_rank, at = 0;
    double worst = 0;
    for (int64_t e = 0; e < c->n_experts; e++)
        for (int p = 0; p < 3; p++) {
            const int64_t sizes[2] = {c->mode == KT_MOE_LORA ? R * pin(c, p) : H * I,
                                      c->mode == KT_MOE_LORA ? R * (H + I - pin(c, p)) : 0};
            for (int k = 0; k < 2; k++) {
                if (sizes[k] > 0)
                    worst = fmax(worst, rel_err(got + at, want + at, sizes[k]));
                at += sizes[k];
            }
        }
    return worst;
}

/* The layer's gradients in the reference's layout. */
static double *collect_grads(kt_moe *m, int lora)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    int64_t H = c->hidden, I = c->intermediate, R = c->lora_rank;
    int64_t n = lora ? lora_size(c) : c->n_experts * 3 * H * I;
    double *d = calloc((size_t)n + 1, sizeof *d);
    for (int64_t e = 0; e < c->n_experts; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor v;
            if (lora) {
                double *base = d + (e * 3 + p) * R * (H + I);
                OK(kt_moe_lora_grad(m, e, (kt_moe_proj)p, 0, &v));
                for (int64_t i = 0; i < kt_tensor_numel(&v); i++)
                    base[i] = tu_get(&v, i);
                OK(kt_moe_lora_grad(m, e, (kt_moe_proj)p, 1, &v));
                for (int64_t i = 0; i < kt_tensor_numel(&v); i++)
                    base[R * pin(c, p) + i] = tu_get(&v, i);
            } else {
                OK(kt_moe_weight_grad(m, e, (kt_moe_proj)p, &v));
                for (int64_t i = 0; i < H * I; i++)
                    d[(e * 3 + p) * H * I + i] = tu_get(&v, i);
            }
        }
    return d;
}

static void check_against_ref(kt_moe *m, const inputs *in, const ref *o, double tol,
                              const char *what)
{
    const kt_moe_config *c = kt_moe_get_config(m);
    int64_t H = c->hidden, K = c->top_k, q = in->qlen;
    double *y = tensor_d(&in->y), *gx = tensor_d(&in->gx), *gw = tensor_d(&in->gw);
    double e_y = rel_err(y, o->y, q * H), e_gx = rel_err(gx, o->gx, q * H);
    double e_gw = rel_err(gw, o->gw, q * K), e_g = 0;
    if (c->mode != KT_MOE_FROZEN) {
        int lora = c->mode == KT_MOE_LORA;
        double *g = collect_grads(m, lora);
        e_g = rel_err_per_tensor(g, lora ? o->dl : o->dw, c);
        free(g);
    }
    if (getenv("KT_TEST_VERBOSE") != NULL)
        printf("%s: qlen %lld: rel err y %.3g grad_x %.3g grad_w %.3g weight grads %.3g\n", what,
               (long long)q, e_y, e_gx, e_gw, e_g);
    if (!(e_y < tol && e_gx < tol && e_gw < tol && e_g < tol))
        fail_msg("%s: qlen %lld: rel err y %.3g grad_x %.3g grad_w %.3g weight grads %.3g "
                 "(tol %.1g)",
                 what, (long long)q, e_y, e_gx, e_gw, e_g, tol);
    free(y), free(gx), free(gw);
}

/* One layer of cfg (max_tokens the largest of qlens) against the reference at each qlen. */
static void run_cfg(kt_moe_config cfg, const int64_t *qlens, int nq, kt_dtype id_dtype,
                    kt_threadpool *pool, double tol, const char *what)
{
    for (int i = 0; i < nq; i++)
        cfg.max_tokens = qlens[i] > cfg.max_tokens ? qlens[i] : cfg.max_tokens;
    kt_moe *m = NULL;
    OK(kt_moe_create(&cfg, pool, &m));
    fill_params(m, 11 + (uint64_t)cfg.mode);
    for (int i = 0; i < nq; i++) {
        inputs in;
        make_inputs(&in, &cfg, qlens[i], id_dtype, 100 + (uint64_t)i);
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        kt_moe_zero_grad(m);
        OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));
        ref o;
        reference(m, &in, 1.0, &o);
        check_against_ref(m, &in, &o, tol, what);
        free_ref(&o);
        free_inputs(&in);
    }
    kt_moe_destroy(m);
}

static void run_modes(kt_dtype wd, kt_dtype ad, int64_t H, int64_t I, int64_t E, int64_t K,
                      const int64_t *qlens, int nq, kt_dtype id_dtype, kt_threadpool *pool)
{
    double tol = (wd == KT_BF16 || ad == KT_BF16) ? 1e-2 : 1e-5;
    for (int mode = 0; mode < 3; mode++) {
        char what[96];
        snprintf(what, sizeof what, "%s weights, %s act, mode %d, H %lld I %lld",
                 kt_dtype_name(wd), kt_dtype_name(ad), mode, (long long)H, (long long)I);
        run_cfg(make_cfg(wd, ad, (kt_moe_mode)mode, H, I, E, K, 1), qlens, nq, id_dtype, pool,
                tol, what);
    }
}

static void test_reference_small(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    const int64_t q[] = {1, 5, 33};
    run_modes(KT_F32, KT_F32, 64, 48, 8, 2, q, 3, KT_I32, pool);
    run_modes(KT_BF16, KT_F32, 64, 48, 8, 2, q, 3, KT_I64, pool);
    kt_threadpool_destroy(pool);
}

static void test_reference_odd(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(3, &pool));
    const int64_t q[] = {7};
    run_modes(KT_F32, KT_F32, 45, 27, 5, 3, q, 1, KT_I64, pool);
    run_modes(KT_BF16, KT_BF16, 45, 27, 5, 3, q, 1, KT_I32, pool);
    run_modes(KT_F32, KT_BF16, 45, 27, 5, 3, q, 1, KT_I32, NULL);
    kt_threadpool_destroy(pool);
}

/* Rows x H large enough (1200 x 2048 f32 = 9.4 MiB) that the gate/up input gradients are
 * stored past the caches (backward.c: GX_STREAM_BYTES), and 600 rows per expert: above 512,
 * where the down projection's input gradient runs in chunks of rows (GA_MAX_ROWS), NN in
 * chunks of rows and TN in its work buffer; against the float64 reference, bf16 and f32
 * weights (both tiled where the CPU has AVX-512). */
static void test_reference_large_rows(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    const int64_t q[] = {600};
    run_modes(KT_BF16, KT_F32, 2048, 16, 2, 2, q, 1, KT_I32, pool);
    run_modes(KT_F32, KT_F32, 2048, 16, 2, 2, q, 1, KT_I64, pool);
    kt_threadpool_destroy(pool);
}

/* Two backwards with scale 0.5 add up; zero_grad makes the next one overwrite. */
static void test_accumulate(void **state)
{
    (void)state;
    for (int wdi = 0; wdi < 2; wdi++)
        for (int mode = 1; mode < 3; mode++) {
            kt_dtype wd = wdi ? KT_BF16 : KT_F32;
            double tol = wdi ? 1e-2 : 1e-5;
            kt_moe_config cfg = make_cfg(wd, KT_F32, (kt_moe_mode)mode, 32, 24, 4, 2, 6);
            kt_moe *m = NULL;
            OK(kt_moe_create(&cfg, NULL, &m));
            fill_params(m, 5);
            inputs a, b;
            make_inputs(&a, &cfg, 6, KT_I32, 1);
            make_inputs(&b, &cfg, 4, KT_I32, 2);
            OK(kt_moe_forward(m, &a.x, &a.ids, &a.w, &a.y));
            OK(kt_moe_backward(m, &a.gy, &a.gx, &a.gw, 0.5f));
            OK(kt_moe_forward(m, &b.x, &b.ids, &b.w, &b.y));
            OK(kt_moe_backward(m, &b.gy, &b.gx, &b.gw, 0.5f));
            ref ra, rb;
            reference(m, &a, 0.5, &ra);
            reference(m, &b, 0.5, &rb);
            int lora = mode == KT_MOE_LORA;
            int64_t n = lora ? lora_size(&cfg) : cfg.n_experts * 3 * 32 * 24;
            double *want = lora ? ra.dl : ra.dw, *wb = lora ? rb.dl : rb.dw;
            for (int64_t i = 0; i < n; i++)
                want[i] += wb[i];
            double *got = collect_grads(m, lora);
            assert_true(rel_err(got, want, n) < tol);
            free(got);
            /* zero_grad: the next backward overwrites */
            kt_moe_zero_grad(m);
            OK(kt_moe_forward(m, &b.x, &b.ids, &b.w, &b.y));
            OK(kt_moe_backward(m, &b.gy, &b.gx, &b.gw, 0.5f));
            got = collect_grads(m, lora);
            assert_true(rel_err(got, wb, n) < tol);
            free(got);
            free_ref(&ra), free_ref(&rb);
            free_inputs(&a), free_inputs(&b);
            kt_moe_destroy(m);
        }
}

/* Everything a forward + backward produces, as bytes, for bitwise comparisons. */
typedef struct blob {
    unsigned char *p;
    size_t n;
} blob;

static void blob_add(blob *b, const void *data, size_t n)
{
    b->p = realloc(b->p, b->n + n + 1);
    memcpy(b->p + b->n, data, n);
    b->n += n;
}

/* The outputs, input gradients and (by mode) the weight or LoRA gradients of the last call. */
static void add_results(blob *b, kt_moe *m, const inputs *in, const kt_moe_config *cfg)
{
    blob_add(b, in->y.data, kt_tensor_nbytes(&in->y));
    blob_add(b, in->gx.data, kt_tensor_nbytes(&in->gx));
    blob_add(b, in->gw.data, kt_tensor_nbytes(&in->gw));
    if (cfg->mode != KT_MOE_FROZEN) {
        double *g = collect_grads(m, cfg->mode == KT_MOE_LORA);
        int64_t n = cfg->mode == KT_MOE_LORA ? lora_size(cfg)
                                             : cfg->n_experts * 3 * cfg->hidden * cfg->intermediate;
        blob_add(b, g, (size_t)n * sizeof(double));
        free(g);
    }
}

/* What kt__moe_run_parts did with each task of a plan. */
typedef struct plan_probe {
    int *runs;       /* [tasks]: how many times it ran */
    int *ran_on;     /* [tasks]: the thread that ran it (-1: none) */
    int slow_thread; /* in its first task, waits for another thread to take one of its tasks
                      * (for at most 5 s; -1: none) */
    int64_t slow_first, slow_end; /* the slow thread's share of the tasks */
} plan_probe;

static int probe_taken_over(const plan_probe *p)
{
    for (int64_t i = p->slow_first; i < p->slow_end; i++) {
        const int on = __atomic_load_n(&p->ran_on[i], __ATOMIC_RELAXED);
        if (on >= 0 && on != p->slow_thread)
            return 1;
    }
    return 0;
}

static void probe_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    plan_probe *p = vctx;
    for (int64_t i = b; i < end; i++) {
        __atomic_add_fetch(&p->runs[i], 1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->ran_on[i], thread, __ATOMIC_RELAXED);
        if (thread == p->slow_thread && i == p->slow_first)
            for (int ms = 0; ms < 5000 && !probe_taken_over(p); ms++)
                nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
}

/* Plans a phase over `cols` columns and runs it through kt__moe_run_parts with probe_tasks:
 * the tasks cover each expert's columns once, in order, each runs exactly once, on a thread
 * of its expert's node group; with KT__MOE_CUT_KEEP_SMALL an expert of at most
 * KT__BF16_NN_STREAM_MAX_M rows is cut only where one thread's share ends. Returns the task
 * count; the probe holds what ran where. */
static int64_t probe_plan(kt_moe *m, int64_t cols, int cut, plan_probe *p)
{
    const int64_t n = kt__moe_plan_parts(m, cols, cut);
    assert_int_equal(m->route.share[m->n_threads], n);
    assert_true(n <= m->route.max_tasks);
    int64_t *next_col = calloc((size_t)m->dim.E, sizeof *next_col);
    for (int64_t i = 0; i < n; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        assert_true(m->route.row_start[t->e + 1] > m->route.row_start[t->e]);
        assert_int_equal(t->c0, next_col[t->e]);
        assert_true(t->c1 > t->c0 && t->c1 <= cols);
        next_col[t->e] = t->c1;
    }
    for (int64_t e = 0; e < m->dim.E; e++)
        assert_int_equal(next_col[e], m->route.row_start[e + 1] > m->route.row_start[e] ? cols : 0);
    free(next_col);
    for (int64_t t = 0; cut == KT__MOE_CUT_KEEP_SMALL && t < m->n_threads; t++)
        for (int64_t i = m->route.share[t]; i < m->route.share[t + 1]; i++) {
            const kt__moe_task *k = &m->route.tasks[i];
            if (m->route.row_start[k->e + 1] - m->route.row_start[k->e] > KT__BF16_NN_STREAM_MAX_M)
                continue;
            if ((i > m->route.share[t] && k->c0 != 0) ||
                (i + 1 < m->route.share[t + 1] && k->c1 != cols))
                fail_msg("thread %lld's task %lld cuts expert %lld (%lld rows) at [%lld, %lld)",
                         (long long)t, (long long)i, (long long)k->e,
                         (long long)(m->route.row_start[k->e + 1] - m->route.row_start[k->e]),
                         (long long)k->c0, (long long)k->c1);
        }
    p->runs = calloc((size_t)n + 1, sizeof *p->runs);
    p->ran_on = malloc(((size_t)n + 1) * sizeof *p->ran_on);
    for (int64_t i = 0; i <= n; i++)
        p->ran_on[i] = -1;
    if (p->slow_thread >= 0) {
        p->slow_first = m->route.share[p->slow_thread];
        p->slow_end = m->route.share[p->slow_thread + 1];
    }
    kt__moe_run_parts(m, probe_tasks, p);
    for (int g = 0; g < m->numa.n_groups; g++)
        for (int64_t i = 0; i < n; i++) {
            if (m->route.tasks[i].e < m->numa.expert_start[g] ||
                m->route.tasks[i].e >= m->numa.expert_start[g + 1])
                continue;
            assert_int_equal(p->runs[i], 1);
            if (p->ran_on[i] < m->numa.thread_start[g] ||
                p->ran_on[i] >= m->numa.thread_start[g + 1])
                fail_msg("thread %d (not of group %d) ran expert %lld", p->ran_on[i], g,
                         (long long)m->route.tasks[i].e);
        }
    return n;
}

/* Every task of a phase plan runs once, on a thread of its expert's node group. */
static void expect_node_local_plan(kt_moe *m, int64_t cols)
{
    plan_probe p = {NULL, NULL, -1, 0, 0};
    probe_plan(m, cols, KT__MOE_CUT_ANY, &p);
    for (int g = 0; g < m->numa.n_groups; g++)
        for (int64_t t = m->numa.thread_start[g]; t < m->numa.thread_start[g + 1]; t++)
            for (int64_t i = m->route.share[t]; i < m->route.share[t + 1]; i++)
                if (m->route.tasks[i].e < m->numa.expert_start[g] ||
                    m->route.tasks[i].e >= m->numa.expert_start[g + 1])
                    fail_msg("thread %lld (group %d) was given expert %lld", (long long)t, g,
                             (long long)m->route.tasks[i].e);
    free(p.runs);
    free(p.ran_on);
}

/* numa_split: the layer splits its experts over the nodes of a kt_threadpool_create_numa
 * pool (the caller sets KT_NUMA_FAKE_NODES on a one-node machine). */
static blob run_blob_on(kt_moe_config cfg, int threads, int64_t qlen, int numa_split)
{
    kt_threadpool *pool = NULL;
    if (numa_split) {
        OK(kt_threadpool_create_numa(threads, &pool));
        cfg.numa_node = KT_MOE_NUMA_SPLIT;
    } else if (threads > 1) {
        OK(kt_threadpool_create(threads, &pool));
    }
    kt_moe *m = NULL;
    OK(kt_moe_create(&cfg, pool, &m));
    fill_params(m, 77);
    inputs in;
    make_inputs(&in, &cfg, qlen, KT_I32, 78);
    blob b = {NULL, 0};
    for (int rep = 0; rep < 2; rep++) { /* the second accumulates */
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 0.75f));
    }
    if (numa_split) {
        assert_int_equal(m->numa.n_groups,
                         kt_numa_node_count() < threads ? kt_numa_node_count() : threads);
        expect_node_local_plan(m, cfg.hidden);
        expect_node_local_plan(m, cfg.intermediate);
    }
    add_results(&b, m, &in, &cfg);
    free_inputs(&in);
    kt_moe_destroy(m);
    kt_threadpool_destroy(pool);
    return b;
}

static blob run_blob(kt_moe_config cfg, int threads, int64_t qlen)
{
    return run_blob_on(cfg, threads, qlen, 0);
}

static void expect_same(blob a, blob b, const char *what)
{
    if (a.n != b.n || memcmp(a.p, b.p, a.n) != 0)
        fail_msg("%s: results differ bitwise", what);
    free(a.p);
    free(b.p);
}

static void test_keep_activations_bitwise(void **state)
{
    (void)state;
    for (int wdi = 0; wdi < 2; wdi++)
        for (int mode = 0; mode < 3; mode++) {
            kt_moe_config c =
                make_cfg(wdi ? KT_BF16 : KT_F32, KT_F32, (kt_moe_mode)mode, 40, 24, 6, 2, 9);
            blob a = run_blob(c, 2, 9);
            c.keep_activations = 0;
            blob b = run_blob(c, 2, 9);
            expect_same(a, b, "keep_activations 1 vs 0");
        }
}

/* The results of 1, 2 and 3 threads, bitwise the same. */
static void expect_same_over_threads(kt_moe_config c, int64_t qlen, const char *what)
{
    blob one = run_blob(c, 1, qlen);
    blob two = run_blob(c, 2, qlen);
    blob three = run_blob(c, 3, qlen);
    blob copy = {malloc(one.n + 1), one.n};
    memcpy(copy.p, one.p, one.n);
    char msg[96];
    snprintf(msg, sizeof msg, "%s: 1 vs 2 threads", what);
    expect_same(one, two, msg);
    snprintf(msg, sizeof msg, "%s: 1 vs 3 threads", what);
    expect_same(copy, three, msg);
}

static void test_threads_bitwise(void **state)
{
    (void)state;
    for (int wdi = 0; wdi < 2; wdi++)
        for (int mode = 0; mode < 3; mode++)
            expect_same_over_threads(
                make_cfg(wdi ? KT_BF16 : KT_F32, KT_F32, (kt_moe_mode)mode, 48, 40, 6, 2, 11), 11,
                "H 48 I 40");
}

/* 600 rows per expert and H = 320 (bf16 and f32 weights): the paths for long row counts (NN
 * in chunks of rows, TN in its work buffer, the down gradient's row chunks) and LoRA's
 * input-gradient adds in 128-column steps with a ragged last one, bitwise over 1, 2 and 3
 * threads and between kept and recomputed activations, in every mode. */
static void test_long_rows_bitwise(void **state)
{
    (void)state;
    for (int i = 0; i < 6; i++) {
        const int mode = i % 3;
        kt_moe_config c =
            make_cfg(i < 3 ? KT_BF16 : KT_F32, KT_F32, (kt_moe_mode)mode, 320, 16, 2, 2, 600);
        expect_same_over_threads(c, 600, "H 320 I 16, 600 rows per expert");
        blob a = run_blob(c, 2, 600);
        c.keep_activations = 0;
        blob b = run_blob(c, 2, 600);
        expect_same(a, b, "600 rows per expert: keep_activations 1 vs 0");
    }
}

/* I = 330 with hundreds of rows per expert: the backward's per-thread blocks for the down
 * projection's input gradient (several column steps, a ragged last one, LoRA's offsets into
 * them), against the reference and bitwise over 1, 2 and 3 threads; a few tokens (under 12
 * rows per expert, one step per task) in the same layer. */
static void test_wide_intermediate(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    const int64_t q[] = {320, 5};
    run_modes(KT_BF16, KT_F32, 64, 330, 3, 2, q, 2, KT_I32, pool);
    run_modes(KT_F32, KT_F32, 64, 330, 3, 2, q, 2, KT_I64, pool);
    const kt_moe_config c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 64, 330, 3, 2, 320);
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, pool, &m));
    assert_true(kt__moe_ga_per_thread(m)); /* the path this test is for */
    kt_moe_destroy(m);
    kt_threadpool_destroy(pool);
    for (int i = 0; i < 6; i++)
        expect_same_over_threads(
            make_cfg(i < 3 ? KT_BF16 : KT_F32, KT_F32, (kt_moe_mode)(i % 3), 64, 330, 3, 2, 320),
            320, "I 330");
}

/* The driver routes from the caller's ids again after submit validated them: ids changed in
 * between (out of range, or one expert named by more slots than there are tokens, which the
 * per-row buffers are not sized for) are refused with a message, not followed. */
static void test_route_rechecks_ids(void **state)
{
    (void)state;
    kt_moe_config c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 32, 16, 4, 2, 6);
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, NULL, &m));
    inputs in;
    make_inputs(&in, &c, 6, KT_I32, 5);
    kt__moe_job job;
    memset(&job, 0, sizeof job);
    job.x = &in.x, job.ids = &in.ids, job.w = &in.w, job.y = &in.y, job.qlen = 6;
    OK(kt__moe_route(m, &job));
    for (int64_t s = 0; s < 12; s++) /* every slot names expert 1: 12 rows for 6 tokens */
        tu_set(&in.ids, s, 1.0);
    assert_int_equal(kt__moe_route(m, &job), KT_EINVAL);
    assert_non_null(strstr(kt_last_error(), "changed after"));
    free_inputs(&in);
    make_inputs(&in, &c, 6, KT_I32, 5);
    tu_set(&in.ids, 7, 9.0); /* token 3 slot 1 */
    assert_int_equal(kt__moe_route(m, &job), KT_EINVAL);
    assert_non_null(strstr(kt_last_error(), "token 3 slot 1: expert id 9"));
    free_inputs(&in);
    kt_moe_destroy(m);
}

/* KT_MOE_NUMA_SPLIT on 2 and 3 (fake) nodes: each node's threads run only its experts, and
 * the results are bitwise those of an ordinary pool of the same size. */
static void test_numa_split_bitwise(void **state)
{
    (void)state;
    const char *env = getenv("KT_NUMA_FAKE_NODES");
    char *fake = env ? strdup(env) : NULL;
    unsetenv("KT_NUMA_FAKE_NODES");
    const int real = kt_numa_node_count();
    for (int nodes = 2; nodes <= 3; nodes++) {
        char v[8];
        snprintf(v, sizeof v, "%d", nodes);
        if (real < nodes) /* stand-in nodes (each the real node 0, with every CPU) */
            setenv("KT_NUMA_FAKE_NODES", v, 1);
        else
            print_message("%d real NUMA nodes: the split runs on them\n", real);
        for (int mode = 0; mode < 3; mode++) {
            kt_moe_config c = make_cfg(KT_BF16, KT_F32, (kt_moe_mode)mode, 48, 40, 7, 2, 11);
            blob plain = run_blob_on(c, 4, 11, 0);
            blob split = run_blob_on(c, 4, 11, 1);
            expect_same(plain, split, "NUMA split vs one pool");
        }
    }
    if (fake != NULL)
        setenv("KT_NUMA_FAKE_NODES", fake, 1);
    else
        unsetenv("KT_NUMA_FAKE_NODES");
    free(fake);

    /* the split needs a NUMA-placed pool */
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    kt_moe_config c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 16, 16, 4, 2, 3);
    c.numa_node = KT_MOE_NUMA_SPLIT;
    kt_moe *m = NULL;
    TU_EXPECT_ERROR(kt_moe_create(&c, pool, &m), KT_EINVAL, "kt_threadpool_create_numa");
    c.numa_node = -3;
    TU_EXPECT_ERROR(kt_moe_create(&c, pool, &m), KT_EINVAL, "numa_node -3");
    kt_threadpool_destroy(pool);
}

/* The output is staged in f32 only when it must be (the cache on, or check_finite, which
 * leaves y unchanged on a NaN); otherwise combine writes the caller's y directly. The three
 * ways, and a forward served by the cache, give the same bits, for f32 and bf16 activations,
 * rows of one piece and of two (H > KT__MOE_ROW_CHUNK), frozen and full mode; the staging
 * buffer is held only by layers that stage. */
static void test_output_staging(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    const int64_t hs[] = {48, KT__MOE_ROW_CHUNK + 64}, T = 9;
    for (int hi = 0; hi < 2; hi++)
        for (int bf = 0; bf < 2; bf++) {
            const int64_t H = hs[hi];
            const uint64_t y_bytes = (uint64_t)(T * H * 4 + 63) / 64 * 64;
            kt_moe_config c = make_cfg(KT_BF16, bf ? KT_BF16 : KT_F32,
                                       hi ? KT_MOE_FULL : KT_MOE_FROZEN, H, 40, 6, 2, T);
            inputs in;
            make_inputs(&in, &c, T, KT_I32, 21);
            kt_tensor want = tu_new(c.act_dtype, T, H);
            uint64_t held[2];
            for (int way = 0; way < 3; way++) { /* check_finite, direct, cache on */
                c.check_finite = way == 0;
                kt_moe *m = NULL;
                OK(kt_moe_create(&c, pool, &m));
                fill_params(m, 22);
                kt_moe_memory mem;
                kt_moe_get_memory(m, &mem);
                if (way < 2)
                    held[way] = mem.workspace_bytes;
                if (way == 2) {
                    OK(kt_moe_cache_enable(m, 1));
                    kt_moe_get_memory(m, &mem);
                    assert_int_equal(mem.workspace_bytes, held[1] + y_bytes);
                }
                OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
                if (way == 0)
                    memcpy(want.data, in.y.data, kt_tensor_nbytes(&in.y));
                else
                    assert_true(tu_bitwise_equal(&in.y, &want));
                if (way == 2) { /* the recompute: served by the cache */
                    memset(in.y.data, 0, kt_tensor_nbytes(&in.y));
                    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
                    assert_true(tu_bitwise_equal(&in.y, &want));
                    kt_moe_phase_times pt;
                    kt_moe_get_phase_times(m, &pt);
                    assert_int_equal(pt.forward_calls, 1);
                }
                kt_moe_destroy(m);
            }
            assert_int_equal(held[0], held[1] + y_bytes);
            tu_free(&want);
            free_inputs(&in);
        }
    kt_threadpool_destroy(pool);
}

/* The phase runner shares work: with thread 0 held in its first task, thread 1 runs the last
 * tasks of thread 0's share once its own are done; every task still runs once. The plans of
 * a phase (200, 1 and 20 tokens; cut anywhere, or keeping small experts whole) cover every
 * column of every expert once. */
static void test_work_sharing(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    const kt_moe_config c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 64, 256, 8, 2, 200);
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, pool, &m));
    fill_params(m, 5);
    const int64_t qlens[] = {200, 1, 20};
    for (int q = 0; q < 3; q++) {
        inputs in;
        make_inputs(&in, &c, qlens[q], KT_I32, 6);
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        plan_probe p = {NULL, NULL, q == 0 ? 0 : -1, 0, 0};
        probe_plan(m, c.intermediate, KT__MOE_CUT_ANY, &p);
        if (q == 0) {
            /* the last quarter of a share is cut finer: thread 0 has more tasks than experts */
            assert_true(m->route.share[1] - m->route.share[0] > 4);
            int64_t taken = 0;
            for (int64_t i = m->route.share[0]; i < m->route.share[1]; i++)
                taken += p.ran_on[i] == 1;
            print_message("thread 1 ran %lld of held thread 0's %lld tasks\n", (long long)taken,
                          (long long)(m->route.share[1] - m->route.share[0]));
            assert_true(taken > 0);
        }
        free(p.runs);
        free(p.ran_on);
        /* the input gradients' plans leave small experts whole: at one token, one task an
         * expert; at 20 (5 rows an expert, some more) cut only where a share ends; at 200 (50
         * rows an expert) pieces as above */
        plan_probe k = {NULL, NULL, -1, 0, 0};
        const int64_t n = probe_plan(m, c.hidden, KT__MOE_CUT_KEEP_SMALL, &k);
        if (q == 1)
            assert_int_equal(n, 2);
        else if (q == 0)
            assert_true(m->route.share[1] - m->route.share[0] > 4);
        free(k.runs);
        free(k.ran_on);
        free_inputs(&in);
    }
    kt_moe_destroy(m);
    kt_threadpool_destroy(pool);
}

/* Two layers of different sizes and modes on one kt_moe_scratch, their calls interleaved
 * (A forward, B forward, B backward, A backward, ...; B created after A's first call, so the
 * scratch grows): each gives bitwise what it gives with its own scratch, the shared scratch
 * holds the larger need once, and the layers hold only what forward keeps. */
static void test_shared_scratch(void **state)
{
    (void)state;
    for (int keep = 0; keep < 2; keep++) {
        kt_moe_config ca = make_cfg(KT_BF16, KT_F32, KT_MOE_FULL, 40, 24, 6, 2, 9);
        kt_moe_config cb = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 48, 40, 7, 2, 11);
        ca.keep_activations = cb.keep_activations = keep;
        blob want_a = run_blob(ca, 2, 9), want_b = run_blob(cb, 2, 11);

        kt_threadpool *pool = NULL;
        OK(kt_threadpool_create(2, &pool));
        kt_moe_scratch *sc = NULL;
        OK(kt_moe_scratch_create(-1, &sc));
        assert_int_equal(kt_moe_scratch_bytes(sc), 0);
        ca.scratch = cb.scratch = sc;
        kt_moe *a = NULL, *b = NULL;
        OK(kt_moe_create(&ca, pool, &a));
        fill_params(a, 77);
        inputs ia, ib;
        make_inputs(&ia, &ca, 9, KT_I32, 78);
        make_inputs(&ib, &cb, 11, KT_I32, 78);
        OK(kt_moe_forward(a, &ia.x, &ia.ids, &ia.w, &ia.y));
        kt_moe_memory ma, mb;
        kt_moe_get_memory(a, &ma);
        assert_int_equal(kt_moe_scratch_bytes(sc), ma.scratch_bytes);
        OK(kt_moe_create(&cb, pool, &b));
        fill_params(b, 77);
        kt_moe_get_memory(b, &mb);
        assert_true(mb.scratch_bytes > ma.scratch_bytes);
        OK(kt_moe_forward(b, &ib.x, &ib.ids, &ib.w, &ib.y));
        assert_int_equal(kt_moe_scratch_bytes(sc), mb.scratch_bytes); /* grown */
        OK(kt_moe_backward(b, &ib.gy, &ib.gx, &ib.gw, 0.75f));
        OK(kt_moe_backward(a, &ia.gy, &ia.gx, &ia.gw, 0.75f));
        OK(kt_moe_forward(b, &ib.x, &ib.ids, &ib.w, &ib.y));
        OK(kt_moe_forward(a, &ia.x, &ia.ids, &ia.w, &ia.y));
        OK(kt_moe_backward(a, &ia.gy, &ia.gx, &ia.gw, 0.75f));
        OK(kt_moe_backward(b, &ib.gy, &ib.gx, &ib.gw, 0.75f));
        blob got_a = {NULL, 0}, got_b = {NULL, 0};
        add_results(&got_a, a, &ia, &ca);
        add_results(&got_b, b, &ib, &cb);
        expect_same(want_a, got_a, "layer A: shared vs own scratch");
        expect_same(want_b, got_b, "layer B: shared vs own scratch");
        /* a layer on shared scratch holds only its kept buffers */
        kt_moe_config own = cb;
        own.scratch = NULL;
        kt_moe *c = NULL;
        OK(kt_moe_create(&own, pool, &c));
        kt_moe_memory mc;
        kt_moe_get_memory(c, &mc);
        assert_int_equal(mc.workspace_bytes, mb.workspace_bytes + mb.scratch_bytes);
        kt_moe_destroy(c);
        free_inputs(&ia), free_inputs(&ib);
        kt_moe_destroy(a), kt_moe_destroy(b);
        kt_moe_scratch_destroy(sc);
        kt_threadpool_destroy(pool);
    }
}

/* ---- validation ------------------------------------------------------------------------------ */

static void test_create_errors(void **state)
{
    (void)state;
    kt_moe *m = NULL;
    kt_moe_config c = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 16, 16, 4, 5, 4);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "L7", "top_k");
    c = make_cfg(KT_F16, KT_F32, KT_MOE_FROZEN, 16, 16, 4, 2, 4);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "L7", "weight_dtype");
    c = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 16, 16, 4, 2, 4);
    c.lora_rank = 0;
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "L7", "lora_rank");
    c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 16, 16, 4, 2, 0);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "max_tokens");
    /* products that wrap around int64 are refused, not sized from the wrapped value */
    c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 16, 16, 4, 4, (int64_t)1 << 62);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "L7", "max_tokens * top_k");
    c = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, 1 << 24, 1 << 24, 1 << 16, 1, 1);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "L7", "overflows int64");
    assert_null(m);
}

static void test_validation(void **state)
{
    (void)state;
    kt_moe_config cfg = make_cfg(KT_BF16, KT_F32, KT_MOE_FULL, 32, 16, 4, 2, 6);
    kt_moe *m = NULL;
    OK(kt_moe_create(&cfg, NULL, &m));
    fill_params(m, 3);
    inputs in;
    make_inputs(&in, &cfg, 5, KT_I32, 4);
    int32_t *ids = in.ids.data;

    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE, "L7",
                    "without a successful forward");
    kt_tensor bad = tu_new(KT_BF16, 5, 32);
    TU_EXPECT_ERROR(kt_moe_forward(m, &bad, &in.ids, &in.w, &in.y), KT_EINVAL, "L7", "x", "f32");
    tu_free(&bad);
    bad = tu_new(KT_F32, 5, 31);
    TU_EXPECT_ERROR(kt_moe_forward(m, &bad, &in.ids, &in.w, &in.y), KT_EINVAL, "L7", "x", "[5,32]");
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &bad), KT_EINVAL, "L7", "y");
    tu_free(&bad);
    bad = tu_new(KT_F32, 7, 32);
    kt_tensor ids7 = tu_new(KT_I32, 7, 2), w7 = tu_new(KT_F32, 7, 2);
    TU_EXPECT_ERROR(kt_moe_forward(m, &bad, &ids7, &w7, &bad), KT_ERANGE, "L7", "qlen 7",
                    "max_tokens 6");
    tu_free(&bad), tu_free(&ids7), tu_free(&w7);
    kt_tensor negx = in.x; /* built by hand: kt_tensor_init refuses a negative dimension */
    negx.shape[0] = -2;
    TU_EXPECT_ERROR(kt_moe_forward(m, &negx, &in.ids, &in.w, &in.y), KT_EINVAL, "L7", "negative");
    bad = tu_new(KT_F16, 5, 2);
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &bad, &in.w, &in.y), KT_EINVAL, "L7", "ids");
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &bad, &in.y), KT_EINVAL, "L7", "weights");
    tu_free(&bad);
    int32_t saved = ids[3 * 2 + 1];
    const int32_t saved_first = ids[0];
    ids[3 * 2 + 1] = 4;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, "L7", "token 3",
                    "expert id 4");
    ids[3 * 2 + 1] = -1;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, "token 3",
                    "expert id -1");
    ids[3 * 2 + 1] = ids[3 * 2];
    char twice[48];
    snprintf(twice, sizeof twice, "expert %d appears twice", (int)ids[3 * 2]);
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_EINVAL, "L7", "token 3",
                    twice);
    ids[3 * 2 + 1] = saved;

    /* still usable */
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    bad = tu_new(KT_F32, 4, 32);
    TU_EXPECT_ERROR(kt_moe_backward(m, &bad, &in.gx, &in.gw, 1.0f), KT_EINVAL, "L7", "grad_y");
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &bad, &in.gw, 1.0f), KT_EINVAL, "L7", "grad_x");
    tu_free(&bad);
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, NAN), KT_EINVAL, "scale");
    /* grad_x / grad_weights with NULL data are skipped */
    kt_tensor nogx = in.gx, nogw = in.gw;
    nogx.data = NULL;
    nogw.data = NULL;
    OK(kt_moe_backward(m, &in.gy, &nogx, &nogw, 1.0f));
    OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));
    /* a refused forward (blocking or submitted) leaves no forward: a backward now would be the
     * previous batch's */
    ids[0] = 9;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, "expert id 9");
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE,
                    "without a successful forward");
    ids[0] = saved_first;
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    ids[0] = 9;
    TU_EXPECT_ERROR(kt_moe_submit_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, "9");
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE,
                    "without a successful forward");
    ids[0] = saved_first;
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));

    /* qlen 0 is a no-op */
    kt_tensor x0 = tu_new(KT_F32, 0, 32), i0 = tu_new(KT_I32, 0, 2), w0 = tu_new(KT_F32, 0, 2);
    kt_tensor y0 = tu_new(KT_F32, 0, 32), gx0 = tu_new(KT_F32, 0, 32), gw0 = tu_new(KT_F32, 0, 2);
    OK(kt_moe_forward(m, &x0, &i0, &w0, &y0));
    OK(kt_moe_backward(m, &y0, &gx0, &gw0, 1.0f));
    tu_free(&x0), tu_free(&i0), tu_free(&w0), tu_free(&y0), tu_free(&gx0), tu_free(&gw0);

    kt_tensor v;
    TU_EXPECT_ERROR(kt_moe_weight(m, 4, KT_MOE_GATE, &v), KT_ERANGE, "L7", "expert 4");
    TU_EXPECT_ERROR(kt_moe_lora(m, 0, KT_MOE_GATE, 0, &v), KT_ESTATE, "LoRA");
    bad = tu_new(KT_BF16, 32, 16);
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 0, KT_MOE_GATE, &bad), KT_EINVAL, "L7", "gate_proj",
                    "bf16[16,32]");
    /* set_weight copies into that expert's projection and nowhere else */
    tu_rng wr;
    tu_rng_seed(&wr, 41);
    tu_fill_uniform(&bad, &wr, -1, 1);
    kt_tensor before[4][3];
    for (int e = 0; e < 4; e++)
        for (int p = 0; p < 3; p++) {
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &v));
            before[e][p] = tu_clone(&v);
        }
    OK(kt_moe_set_weight(m, 2, KT_MOE_DOWN, &bad));
    for (int e = 0; e < 4; e++)
        for (int p = 0; p < 3; p++) {
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &v));
            const int target = e == 2 && p == KT_MOE_DOWN;
            if (!tu_bitwise_equal(&v, target ? &bad : &before[e][p]))
                fail_msg("set_weight(2, down): expert %d projection %d %s", e, p,
                         target ? "does not hold the new values" : "changed");
            tu_free(&before[e][p]);
        }
    tu_free(&bad);
    free_inputs(&in);
    kt_moe_destroy(m);
}

static void test_memory(void **state)
{
    (void)state;
    kt_moe_config c = make_cfg(KT_BF16, KT_F32, KT_MOE_FULL, 64, 48, 8, 2, 16);
    kt_moe *m = NULL;
    OK(kt_moe_create(&c, NULL, &m));
    kt_moe_memory a, b;
    kt_moe_get_memory(m, &a);
    kt_moe_destroy(m);
    c.keep_activations = 0;
    c.numa_node = 0; /* node 0 exists everywhere (bound with libnuma when built) */
    OK(kt_moe_create(&c, NULL, &m));
    kt_moe_get_memory(m, &b);
    kt_moe_destroy(m);
    assert_int_equal(a.raw_weight_bytes, 8 * 3 * 64 * 48 * 2);
    assert_true(a.weight_bytes <= a.raw_weight_bytes * 105 / 100);
    assert_int_equal(a.backward_buffer_bytes, 0);
    assert_true(a.workspace_bytes > 0);
    assert_int_equal(a.grad_bytes >= 8 * 3 * 64 * 48 * 4, 1);
    assert_int_equal(a.saved_bytes_per_token, 2 * 16 + 64 * 2 + 2 * 2 * 48 * 4);
    assert_int_equal(b.saved_bytes_per_token, 2 * 16 + 64 * 2);
    /* LoRA (rank 4) also keeps each projection's x A^T, or nothing without activations */
    for (int keep = 1; keep >= 0; keep--) {
        c = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 64, 48, 8, 2, 16);
        c.keep_activations = keep;
        OK(kt_moe_create(&c, NULL, &m));
        kt_moe_get_memory(m, &a);
        kt_moe_destroy(m);
        assert_int_equal(a.saved_bytes_per_token,
                         2 * 16 + 64 * 2 + (keep ? 2 * 2 * 48 * 4 + 2 * 3 * 4 * 4 : 0));
    }
}

/* Phase times: the phases a call runs are counted (and only those: a frozen layer keeping
 * its activations has no recompute and no weight gradients), they sum to no more than the
 * calls took, a forward served by the cache is not a call that ran the experts, and a reset
 * zeroes everything; every phase has a name. */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void test_phase_times(void **state)
{
    (void)state;
    for (int mode = KT_MOE_FROZEN; mode <= KT_MOE_FULL; mode++) {
        kt_moe_config cfg = make_cfg(KT_BF16, KT_F32, (kt_moe_mode)mode, 64, 48, 8, 2, 16);
        kt_moe *m = NULL;
        OK(kt_moe_create(&cfg, NULL, &m));
        fill_params(m, 5);
        inputs in;
        make_inputs(&in, &cfg, 16, KT_I32, 6);
        kt_moe_phase_times t;
        kt_moe_get_phase_times(m, &t);
        for (int k = 0; k < KT_MOE_PHASE_COUNT; k++)
            assert_int_equal(t.ns[k], 0);
        const uint64_t t0 = now_ns();
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        const uint64_t wall = now_ns() - t0;
        kt_moe_get_phase_times(m, &t);
        assert_int_equal(t.forward_calls, 2);
        assert_int_equal(t.backward_calls, 1);
        uint64_t sum = 0;
        for (int k = 0; k < KT_MOE_PHASE_COUNT; k++) {
            assert_non_null(kt_moe_phase_name(k));
            sum += t.ns[k];
        }
        assert_true(sum <= wall);
        assert_true(t.ns[KT_MOE_PHASE_GATE_UP] > 0 && t.ns[KT_MOE_PHASE_DOWN] > 0);
        assert_true(t.ns[KT_MOE_PHASE_DOWN_GRAD] > 0 && t.ns[KT_MOE_PHASE_GATE_UP_GRAD] > 0);
        if (mode == KT_MOE_FROZEN)
            assert_true(t.ns[KT_MOE_PHASE_RECOMPUTE] == 0 && t.ns[KT_MOE_PHASE_WEIGHT_GRAD] == 0);
        else
            assert_true(t.ns[KT_MOE_PHASE_RECOMPUTE] > 0 && t.ns[KT_MOE_PHASE_WEIGHT_GRAD] > 0);
        /* a forward the cache serves runs no experts */
        OK(kt_moe_cache_enable(m, 1));
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
        kt_moe_get_phase_times(m, &t);
        assert_int_equal(t.forward_calls, 3);
        kt_moe_reset_phase_times(m);
        kt_moe_get_phase_times(m, &t);
        assert_int_equal(t.forward_calls + t.backward_calls, 0);
        for (int k = 0; k < KT_MOE_PHASE_COUNT; k++)
            assert_int_equal(t.ns[k], 0);
        free_inputs(&in);
        kt_moe_destroy(m);
    }
    assert_null(kt_moe_phase_name(-1));
    assert_null(kt_moe_phase_name(KT_MOE_PHASE_COUNT));
    assert_string_equal(kt_moe_phase_name(KT_MOE_PHASE_GATE_UP_GRAD), "gate_up_grad");
    kt_moe_phase_times t;
    kt_moe_get_phase_times(NULL, &t); /* zeroed, no crash */
    assert_int_equal(t.forward_calls, 0);
    kt_moe_reset_phase_times(NULL);
}

/* ---- forward cache -----------------------------------------------------------------------------
 */

static void test_cache(void **state)
{
    (void)state;
    kt_moe_config cfg = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 32, 16, 4, 2, 6);
    kt_moe *m = NULL;
    OK(kt_moe_create(&cfg, NULL, &m));
    fill_params(m, 3);
    inputs in, other;
    make_inputs(&in, &cfg, 5, KT_I32, 4);
    make_inputs(&other, &cfg, 5, KT_I32, 9);
    OK(kt_moe_cache_enable(m, 1));
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_EMPTY);
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_READY);
    uint64_t flops = kt__moe_flops_run(m);
    assert_true(flops > 0);
    kt_tensor y1 = tu_clone(&in.y);
    memset(in.y.data, 0, kt_tensor_nbytes(&in.y));
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y)); /* the recompute: no experts run */
    assert_int_equal(kt__moe_flops_run(m), flops);
    assert_true(tu_bitwise_equal(&in.y, &y1));
    OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_EMPTY);

    /* READY with other ids: an error that poisons */
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    TU_EXPECT_ERROR(kt_moe_forward(m, &other.x, &other.ids, &other.w, &other.y), KT_ESTATE, "L7",
                    "differs from the cached forward");
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_POISONED);
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ESTATE, "poisoned",
                    "differs from the cached forward");
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE, "poisoned");
    kt_moe_cache_clear(m);
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_EMPTY);
    OK(kt_moe_forward(m, &other.x, &other.ids, &other.w, &other.y));
    OK(kt_moe_backward(m, &other.gy, &other.gx, &other.gw, 1.0f));

    /* a validation failure poisons too */
    int32_t *ids = in.ids.data;
    int32_t saved = ids[0];
    ids[0] = 99;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, "expert id 99");
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_POISONED);
    ids[0] = saved;
    kt_moe_cache_clear(m);

    /* an injected NaN (check_finite) poisons; the output is left alone */
    int64_t e = ids[2 * 2 + 1];
    int64_t first_t = -1;
    for (int64_t t = 0; t < 5 && first_t < 0; t++)
        for (int j = 0; j < 2; j++)
            if (ids[t * 2 + j] == e)
                first_t = t;
    kt_tensor wv;
    OK(kt_moe_weight(m, e, KT_MOE_UP, &wv));
    uint16_t keep = ((uint16_t *)wv.data)[3];
    ((uint16_t *)wv.data)[3] = 0x7fc0;
    float *yv = in.y.data;
    for (int64_t i = 0; i < 5 * 32; i++)
        yv[i] = 123.0f;
    char tok[32], exp_s[32];
    snprintf(tok, sizeof tok, "token %lld", (long long)first_t);
    snprintf(exp_s, sizeof exp_s, "expert %lld", (long long)e);
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, "L7", "non-finite",
                    tok, exp_s);
    for (int64_t i = 0; i < 5 * 32; i++)
        assert_true(yv[i] == 123.0f);
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_POISONED);
    ((uint16_t *)wv.data)[3] = keep;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ESTATE, "non-finite");
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE, "non-finite");
    kt_moe_cache_clear(m);
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    assert_true(tu_bitwise_equal(&in.y, &y1));
    OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));

    /* with the cache off, a NaN is an error that leaves nothing poisoned */
    OK(kt_moe_cache_enable(m, 0));
    ((uint16_t *)wv.data)[3] = 0x7fc0;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ERANGE, tok);
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_EMPTY);
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE,
                    "without a successful forward");
    ((uint16_t *)wv.data)[3] = keep;
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));

    /* a NaN reaching the backward only (a gate weight changed after the forward): an error
     * naming the first token and the expert, grad_x and grad_weights left alone */
    kt_tensor gv;
    OK(kt_moe_weight(m, e, KT_MOE_GATE, &gv));
    keep = ((uint16_t *)gv.data)[3];
    ((uint16_t *)gv.data)[3] = 0x7fc0;
    float *gxv = in.gx.data;
    for (int64_t i = 0; i < 5 * 32; i++)
        gxv[i] = 7.0f;
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ERANGE, "L7",
                    "non-finite grad_x", tok, exp_s);
    for (int64_t i = 0; i < 5 * 32; i++)
        assert_true(gxv[i] == 7.0f);
    ((uint16_t *)gv.data)[3] = keep;
    OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));

    /* the same failure in backward with the cache on poisons it: the recompute that would
     * follow must not reuse the output, nor a backward run again, until cleared */
    OK(kt_moe_cache_enable(m, 1));
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_READY);
    ((uint16_t *)gv.data)[3] = 0x7fc0;
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ERANGE, "L7",
                    "non-finite grad_x", tok, exp_s);
    assert_int_equal(kt_moe_cache_get_state(m), KT_MOE_CACHE_POISONED);
    ((uint16_t *)gv.data)[3] = keep;
    TU_EXPECT_ERROR(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y), KT_ESTATE, "L7",
                    "non-finite grad_x");
    TU_EXPECT_ERROR(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f), KT_ESTATE,
                    "non-finite grad_x");
    kt_moe_cache_clear(m);
    OK(kt_moe_forward(m, &in.x, &in.ids, &in.w, &in.y));
    assert_true(tu_bitwise_equal(&in.y, &y1));
    OK(kt_moe_backward(m, &in.gy, &in.gx, &in.gw, 1.0f));
    tu_free(&y1);
    free_inputs(&in), free_inputs(&other);
    kt_moe_destroy(m);
}

/* A one-column layer (H = I = 1, every weight 1: y = sum_j w_j silu(x) x) whose outputs and
 * input gradients are made to overflow by the routing weights and grad_y alone. */
static kt_moe *unit_layer(kt_dtype act, int64_t E, int64_t K)
{
    kt_moe_config cfg = make_cfg(KT_F32, act, KT_MOE_FROZEN, 1, 1, E, K, 1);
    kt_moe *m = NULL;
    OK(kt_moe_create(&cfg, NULL, &m));
    for (int64_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            kt_tensor v;
            OK(kt_moe_weight(m, e, (kt_moe_proj)p, &v));
            tu_set(&v, 0, 1.0);
        }
    return m;
}

/* check_finite tests the values as they are stored: an output that only the sum over a
 * token's slots makes infinite, or that only rounding to bf16 does, is an error naming the
 * expert that brought it, and nothing is written. */
static void test_check_finite_overflow(void **state)
{
    (void)state;
    const int64_t shape1[2] = {1, 1}, shape2[2] = {1, 2};
    kt_tensor x = tu_alloc(KT_F32, 2, shape1), y = tu_alloc(KT_F32, 2, shape1);
    kt_tensor gy = tu_alloc(KT_F32, 2, shape1), gx = tu_alloc(KT_F32, 2, shape1);
    kt_tensor ids = tu_alloc(KT_I32, 2, shape2), w = tu_alloc(KT_F32, 2, shape2);
    kt_tensor gw = tu_alloc(KT_F32, 2, shape2);
    ((int32_t *)ids.data)[0] = 0, ((int32_t *)ids.data)[1] = 3;
    tu_set(&x, 0, 2.0);
    kt_moe *m = unit_layer(KT_F32, 4, 2);
    /* slot 1's weight overflows w * d: the error names expert 3 (slot 1), not slot 0's */
    tu_set(&w, 0, 0.5), tu_set(&w, 1, FLT_MAX);
    tu_set(&y, 0, 7.0);
    TU_EXPECT_ERROR(kt_moe_forward(m, &x, &ids, &w, &y), KT_ERANGE, "L7", "non-finite output",
                    "token 0", "expert 3", "slot 1");
    assert_true(tu_get(&y, 0) == 7.0);
    /* each slot's input gradient finite (about 1.97e38), their sum not */
    tu_set(&w, 0, 1.0), tu_set(&w, 1, 1.0);
    OK(kt_moe_forward(m, &x, &ids, &w, &y));
    tu_set(&gy, 0, 5e37);
    tu_set(&gx, 0, 7.0);
    TU_EXPECT_ERROR(kt_moe_backward(m, &gy, &gx, &gw, 1.0f), KT_ERANGE, "L7",
                    "non-finite grad_x (the sum over the token's slots)", "token 0");
    assert_true(tu_get(&gx, 0) == 7.0);
    tu_set(&gy, 0, 1e37);
    OK(kt_moe_backward(m, &gy, &gx, &gw, 1.0f));
    assert_true(isfinite(tu_get(&gx, 0)) && tu_get(&gx, 0) > 7e37);
    tu_set(&w, 0, 0.0);
    OK(kt_moe_forward(m, &x, &ids, &w, &y));
    const double d = tu_get(&y, 0); /* silu(2) * 2, as the bf16-activation layer computes it */
    kt_moe_destroy(m);

    /* bf16 activations: 3.395e38 is a finite f32 that rounds to bf16's infinity */
    kt_tensor xb = tu_alloc(KT_BF16, 2, shape1), yb = tu_alloc(KT_BF16, 2, shape1);
    tu_set(&xb, 0, 2.0);
    m = unit_layer(KT_BF16, 4, 2);
    tu_set(&w, 1, 3.3e38 / d);
    OK(kt_moe_forward(m, &xb, &ids, &w, &yb));
    assert_true(isfinite(tu_get(&yb, 0)));
    tu_set(&w, 1, 3.397e38 / d);
    tu_set(&yb, 0, 7.0);
    TU_EXPECT_ERROR(kt_moe_forward(m, &xb, &ids, &w, &yb), KT_ERANGE, "L7", "non-finite output",
                    "token 0", "expert 3");
    assert_true(tu_get(&yb, 0) == 7.0);
    kt_moe_destroy(m);
    tu_free(&x), tu_free(&y), tu_free(&gy), tu_free(&gx), tu_free(&ids), tu_free(&w);
    tu_free(&gw), tu_free(&xb), tu_free(&yb);
}

/* ---- submit / sync ----------------------------------------------------------------------------
 */

/* A layer on a two-thread pool (bf16 weights, H 64, I 48, 8 experts, k 2), 33 tokens of
 * inputs, and the output of a blocking forward on them (y1), to compare submitted ones with. */
typedef struct pooled_layer {
    kt_threadpool *pool;
    kt_moe *m;
    kt_moe_config cfg;
    inputs in;
    kt_tensor y1;
} pooled_layer;

static void pooled_layer_init(pooled_layer *p, kt_moe_mode mode, uint64_t seed)
{
    p->pool = NULL, p->m = NULL;
    OK(kt_threadpool_create(2, &p->pool));
    p->cfg = make_cfg(KT_BF16, KT_F32, mode, 64, 48, 8, 2, 33);
    OK(kt_moe_create(&p->cfg, p->pool, &p->m));
    fill_params(p->m, seed);
    make_inputs(&p->in, &p->cfg, 33, KT_I32, seed + 1);
    OK(kt_moe_forward(p->m, &p->in.x, &p->in.ids, &p->in.w, &p->in.y));
    p->y1 = tu_clone(&p->in.y);
}

static void pooled_layer_free(pooled_layer *p)
{
    kt_moe_destroy(p->m); /* waits for a job in flight */
    tu_free(&p->y1);
    free_inputs(&p->in);
    kt_threadpool_destroy(p->pool);
}

static void test_submit_sync(void **state)
{
    (void)state;
    pooled_layer pl;
    pooled_layer_init(&pl, KT_MOE_FULL, 3);
    memset(pl.in.y.data, 0, kt_tensor_nbytes(&pl.in.y));

    TU_EXPECT_ERROR(kt_moe_sync(pl.m), KT_ESTATE, "L7", "without a submitted forward");
    OK(kt_moe_submit_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y));
    /* the caller works meanwhile */
    volatile double acc = 0;
    for (int i = 0; i < 200000; i++)
        acc += sqrt((double)i);
    assert_true(acc > 0);
    TU_EXPECT_ERROR(kt_moe_submit_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y),
                    KT_ESTATE, "L7", "in flight");
    TU_EXPECT_ERROR(kt_moe_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y), KT_ESTATE,
                    "in flight");
    TU_EXPECT_ERROR(kt_moe_backward(pl.m, &pl.in.gy, &pl.in.gx, &pl.in.gw, 1.0f), KT_ESTATE,
                    "in flight");
    OK(kt_moe_sync(pl.m));
    assert_true(tu_bitwise_equal(&pl.in.y, &pl.y1));
    TU_EXPECT_ERROR(kt_moe_sync(pl.m), KT_ESTATE, "without a submitted forward");
    OK(kt_moe_backward(pl.m, &pl.in.gy, &pl.in.gx, &pl.in.gw, 1.0f));

    /* argument errors come back from submit itself */
    int32_t *ids = pl.in.ids.data;
    ids[1] = ids[0];
    TU_EXPECT_ERROR(kt_moe_submit_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y),
                    KT_EINVAL, "appears twice");
    TU_EXPECT_ERROR(kt_moe_sync(pl.m), KT_ESTATE, "without a submitted forward");

    /* a failure inside the job comes back from sync, on the caller's thread */
    free_inputs(&pl.in);
    make_inputs(&pl.in, &pl.cfg, 33, KT_I32, 4);
    kt_tensor wv;
    int64_t e = ((int32_t *)pl.in.ids.data)[0];
    OK(kt_moe_weight(pl.m, e, KT_MOE_GATE, &wv));
    ((uint16_t *)wv.data)[0] = 0x7fc0;
    OK(kt_moe_submit_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y));
    TU_EXPECT_ERROR(kt_moe_sync(pl.m), KT_ERANGE, "L7", "non-finite", "token 0");
    ((uint16_t *)wv.data)[0] = 0;

    /* destroy while a job is in flight waits for it */
    OK(kt_moe_submit_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y));
    pooled_layer_free(&pl);
}

static void sleep_us(long us)
{
    nanosleep(&(struct timespec){us / 1000000, us % 1000000 * 1000}, NULL);
}

/* Holds a pool from another thread: one job whose part 0 waits for `release` (20 s at most,
 * so a broken submit fails the test instead of hanging it). The pool runs a job of one part
 * on the caller alone, without taking the pool, so the job has two. */
typedef struct pool_holder {
    kt_threadpool *pool;
    atomic_int holding, release;
} pool_holder;

static void hold_part(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)end, (void)thread;
    pool_holder *h = ctx;
    if (begin != 0)
        return;
    atomic_store(&h->holding, 1);
    for (int i = 0; i < 20000 && !atomic_load(&h->release); i++)
        sleep_us(1000);
}

static void *hold_pool(void *arg)
{
    pool_holder *h = arg;
    kt_parallel_for(h->pool, 2, 1, hold_part, h); /* two parts: a job that takes the pool */
    return NULL;
}

/* submit hands the forward over and returns: with the layer's pool held by another thread,
 * where the forward cannot run, submit still returns at once and y is untouched; once the
 * pool is free, sync returns the same output as a blocking forward. A submit that ran the
 * forward itself would wait out the holder (20 s) and find y written. */
static void test_submit_returns_at_once(void **state)
{
    (void)state;
    pooled_layer pl;
    pooled_layer_init(&pl, KT_MOE_FROZEN, 5);
    for (int64_t i = 0; i < kt_tensor_numel(&pl.in.y); i++)
        ((float *)pl.in.y.data)[i] = -7.0f;
    kt_tensor untouched = tu_clone(&pl.in.y);

    pool_holder h = {.pool = pl.pool};
    pthread_t holder;
    assert_int_equal(pthread_create(&holder, NULL, hold_pool, &h), 0);
    while (!atomic_load(&h.holding))
        sleep_us(100);
    const uint64_t t0 = now_ns();
    const kt_status submitted =
        kt_moe_submit_forward(pl.m, &pl.in.x, &pl.in.ids, &pl.in.w, &pl.in.y);
    const double submit_s = 1e-9 * (double)(now_ns() - t0);
    sleep_us(50000); /* time enough for a forward this small, were the pool free */
    const int y_was_untouched = tu_bitwise_equal(&pl.in.y, &untouched);
    atomic_store(&h.release, 1); /* before any assertion: h lives in this frame */
    assert_int_equal(pthread_join(holder, NULL), 0);
    OK(submitted);
    assert_true(y_was_untouched);
    assert_true(submit_s < 10.0);
    OK(kt_moe_sync(pl.m));
    assert_true(tu_bitwise_equal(&pl.in.y, &pl.y1));
    print_message("submit returned in %.3f ms with the pool held elsewhere\n", submit_s * 1e3);
    tu_free(&untouched);
    pooled_layer_free(&pl);
}

/* ---- load / save ---------------------------------------------------------------------------- */

static void test_load_save(void **state)
{
    (void)state;
    char path[] = "/tmp/kt_test_moe_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    const char *prefix = "model.layers.3.mlp.";
    for (int wdi = 0; wdi < 2; wdi++)
        for (int mode = 0; mode < 3; mode += 1) {
            kt_dtype wd = wdi ? KT_BF16 : KT_F32;
            kt_moe_config cfg = make_cfg(wd, KT_F32, (kt_moe_mode)mode, 24, 16, 3, 2, 4);
            kt_moe *a = NULL, *b = NULL;
            OK(kt_moe_create(&cfg, NULL, &a));
            OK(kt_moe_create(&cfg, NULL, &b));
            fill_params(a, 21);
            OK(kt_moe_save(a, path, prefix));
            kt_st_file *f = NULL;
            OK(kt_st_open(path, &f));
            assert_int_equal(kt_st_count(f), 3 * 3 * (mode == KT_MOE_LORA ? 3 : 1));
            kt_tensor v;
            OK(kt_st_find(f, "model.layers.3.mlp.experts.2.down_proj.weight", &v));
            assert_int_equal(v.dtype, wd);
            assert_int_equal(v.shape[0], 24);
            assert_int_equal(v.shape[1], 16);
            OK(kt_moe_load(b, f, prefix));
            kt_st_close(f);
            inputs in, in2;
            make_inputs(&in, &cfg, 4, KT_I32, 1);
            make_inputs(&in2, &cfg, 4, KT_I32, 1);
            OK(kt_moe_forward(a, &in.x, &in.ids, &in.w, &in.y));
            OK(kt_moe_forward(b, &in2.x, &in2.ids, &in2.w, &in2.y));
            assert_true(tu_bitwise_equal(&in.y, &in2.y));
            /* the wrong dtype or a missing tensor is an error naming the tensor */
            kt_moe_config other = cfg;
            other.weight_dtype = wdi ? KT_F32 : KT_BF16;
            kt_moe *c = NULL, *c2 = NULL;
            OK(kt_moe_create(&other, NULL, &c));
            OK(kt_st_open(path, &f));
            TU_EXPECT_ERROR(kt_moe_load(c, f, prefix), KT_EINVAL, "L7",
                            "model.layers.3.mlp.experts.0.gate_proj.weight");
            TU_EXPECT_ERROR(kt_moe_load(b, f, "nope."), KT_EINVAL, "L7",
                            "nope.experts.0.gate_proj.weight");
            kt_st_close(f);
            /* two layers in one file, each read back under its own prefix */
            OK(kt_moe_create(&cfg, NULL, &c2));
            fill_params(c2, 23);
            const kt_moe *both[2] = {a, c2};
            const char *prefixes[2] = {"moe.0.", "moe.5."};
            OK(kt_moe_save_layers(both, prefixes, 2, path));
            OK(kt_st_open(path, &f));
            assert_int_equal(kt_st_count(f), 2 * 3 * 3 * (mode == KT_MOE_LORA ? 3 : 1));
            OK(kt_moe_load(b, f, "moe.5."));
            OK(kt_moe_forward(b, &in2.x, &in2.ids, &in2.w, &in2.y));
            OK(kt_moe_forward(c2, &in.x, &in.ids, &in.w, &in.y));
            assert_true(tu_bitwise_equal(&in.y, &in2.y));
            /* and the first layer under its own prefix (a's weights, not c2's) */
            OK(kt_moe_load(b, f, "moe.0."));
            kt_st_close(f);
            OK(kt_moe_forward(b, &in2.x, &in2.ids, &in2.w, &in2.y));
            OK(kt_moe_forward(a, &in.x, &in.ids, &in.w, &in.y));
            assert_true(tu_bitwise_equal(&in.y, &in2.y));
            kt_moe_destroy(c2);
            kt_moe_destroy(c);
            free_inputs(&in), free_inputs(&in2);
            kt_moe_destroy(a);
            kt_moe_destroy(b);
        }
    unlink(path);
}

/* LoRA adapters load all or none: a file with every adapter but the first is an error naming
 * it (not a load of the base weights alone), and the layer's adapters stay as they were. */
static void test_load_partial_lora(void **state)
{
    (void)state;
    char path[] = "/tmp/kt_test_moe_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    kt_moe_config cfg = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 24, 16, 2, 1, 2);
    kt_moe *a = NULL, *b = NULL;
    OK(kt_moe_create(&cfg, NULL, &a));
    OK(kt_moe_create(&cfg, NULL, &b));
    fill_params(a, 5);
    fill_params(b, 6);
    static const char *const projs[3] = {"gate_proj", "up_proj", "down_proj"};
    static const char *const kinds[3] = {"weight", "lora_A.weight", "lora_B.weight"};
    char names[18][64];
    kt_st_item items[18];
    size_t n = 0;
    for (int e = 0; e < 2; e++)
        for (int p = 0; p < 3; p++)
            for (int k = 0; k < 3; k++) {
                if (e == 0 && p == 0 && k == 1)
                    continue; /* experts.0.gate_proj.lora_A.weight left out */
                snprintf(names[n], sizeof names[n], "experts.%d.%s.%s", e, projs[p], kinds[k]);
                items[n].name = names[n];
                if (k == 0)
                    OK(kt_moe_weight(a, e, (kt_moe_proj)p, &items[n].tensor));
                else
                    OK(kt_moe_lora(a, e, (kt_moe_proj)p, k - 1, &items[n].tensor));
                n++;
            }
    OK(kt_st_save(path, items, n, NULL));
    kt_tensor before, after;
    OK(kt_moe_lora(b, 1, KT_MOE_DOWN, 1, &after));
    before = tu_new(KT_F32, after.shape[0], after.shape[1]);
    memcpy(before.data, after.data, (size_t)kt_tensor_nbytes(&after));
    kt_st_file *f = NULL;
    OK(kt_st_open(path, &f));
    TU_EXPECT_ERROR(kt_moe_load(b, f, ""), KT_EINVAL, "L7", "experts.0.gate_proj.lora_A.weight");
    kt_st_close(f);
    assert_true(tu_bitwise_equal(&before, &after));
    tu_free(&before);
    kt_moe_destroy(a);
    kt_moe_destroy(b);
    unlink(path);
}

/* LoRA A starts small and random (seeded), B at zero. */
static void test_lora_init(void **state)
{
    (void)state;
    kt_moe_config cfg = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 64, 48, 2, 1, 2);
    kt_moe *a = NULL, *b = NULL;
    OK(kt_moe_create(&cfg, NULL, &a));
    OK(kt_moe_create(&cfg, NULL, &b));
    kt_tensor va, vb;
    OK(kt_moe_lora(a, 1, KT_MOE_DOWN, 0, &va));
    OK(kt_moe_lora(b, 1, KT_MOE_DOWN, 0, &vb));
    assert_int_equal(va.shape[0], 4);
    assert_int_equal(va.shape[1], 48);
    assert_true(tu_bitwise_equal(&va, &vb));
    double mx = 0;
    for (int64_t i = 0; i < 4 * 48; i++)
        mx = fmax(mx, fabs(tu_get(&va, i)));
    assert_true(mx > 0.05 && mx <= 1.0 / sqrt(48.0));
    OK(kt_moe_lora(a, 1, KT_MOE_DOWN, 1, &vb));
    assert_int_equal(vb.shape[0], 64);
    for (int64_t i = 0; i < 64 * 4; i++)
        assert_true(tu_get(&vb, i) == 0.0);
    kt_moe_destroy(a);
    kt_moe_destroy(b);
}


/* ---- quantized experts --------------------------------------------------------------------- */

typedef struct qfmt_case {
    kt_moe_quant quant;
    int group;
} qfmt_case;
static const qfmt_case qcases[] = {
    {KT_MOE_QUANT_INT8, 0}, {KT_MOE_QUANT_INT4, 32}, {KT_MOE_QUANT_INT4, 64}, {KT_MOE_QUANT_INT4, 128}};

static kt_moe_config quant_cfg(qfmt_case f, kt_dtype ad, kt_moe_mode mode, int64_t H, int64_t I,
                               int64_t E, int64_t K, int64_t T)
{
    kt_moe_config c = make_cfg(KT_BF16, ad, mode, H, I, E, K, T);
    c.quant = f.quant;
    c.quant_group = f.group;
    return c;
}

/* Frozen and LoRA layers of every format against the float64 reference on the weights they
 * multiply by (their dequantized ones), at row counts of the kernels' few-row and many-row
 * paths: the layer's wiring (every projection, both backward products, the adapters). The
 * activations meet the kernels in bf16, so the tolerance is the bf16 layers' at this size. */
static void test_reference_quant(void **state)
{
    (void)state;
    kt_threadpool *pool = NULL;
    OK(kt_threadpool_create(2, &pool));
    const int64_t q[] = {1, 5, 40};
    for (size_t f = 0; f < sizeof qcases / sizeof qcases[0]; f++)
        for (int mode = 0; mode < 2; mode++)
            for (int a = 0; a < 2; a++) {
                const kt_dtype ad = a ? KT_BF16 : KT_F32;
                char what[128];
                snprintf(what, sizeof what, "%s g%d experts, %s act, mode %d",
                         kt_moe_quant_name(qcases[f].quant), qcases[f].group, kt_dtype_name(ad),
                         mode);
                run_cfg(quant_cfg(qcases[f], ad, (kt_moe_mode)mode, 128, 256, 6, 2, 1), q, 3,
                        KT_I32, pool, 2e-2, what);
            }
    kt_threadpool_destroy(pool);
}

/* max |a - b| / max |b| */
static double tensor_rel(const kt_tensor *a, const kt_tensor *b)
{
    double err = 0, scale = 1e-30;
    for (int64_t i = 0; i < kt_tensor_numel(b); i++) {
        err = fmax(err, fabs(tu_get(a, i) - tu_get(b, i)));
        scale = fmax(scale, fabs(tu_get(b, i)));
    }
    return err / scale;
}

/* The quantization error itself: a quantized layer against the bf16 layer it was quantized
 * from (the same weights), output and input gradient, printed and bounded per format; and the
 * store's bytes against bf16's. */
static void test_quant_error_vs_bf16(void **state)
{
    (void)state;
    const int64_t H = 256, I = 256, E = 4, K = 2, T = 16;
    /* bounds of max|err| / max|y| on uniform weights (a round-to-nearest step's error is a
     * uniform +-scale/2: relative rms 1/(sqrt(3) qmax) of the largest weight) */
    const double bound[] = {0.02, 0.2, 0.2, 0.2};
    const double bytes_bound[] = {0.52, 0.29, 0.27, 0.26};
    kt_moe_config bc = make_cfg(KT_BF16, KT_F32, KT_MOE_FROZEN, H, I, E, K, T);
    kt_moe *ref_layer = NULL;
    OK(kt_moe_create(&bc, NULL, &ref_layer));
    fill_params(ref_layer, 5);
    inputs in, in_q;
    make_inputs(&in, &bc, T, KT_I32, 9);
    make_inputs(&in_q, &bc, T, KT_I32, 9);
    OK(kt_moe_forward(ref_layer, &in.x, &in.ids, &in.w, &in.y));
    OK(kt_moe_backward(ref_layer, &in.gy, &in.gx, &in.gw, 1.0f));
    kt_moe_memory bm;
    kt_moe_get_memory(ref_layer, &bm);
    for (size_t f = 0; f < sizeof qcases / sizeof qcases[0]; f++) {
        kt_moe_config qc = quant_cfg(qcases[f], KT_F32, KT_MOE_FROZEN, H, I, E, K, T);
        kt_moe *m = NULL;
        OK(kt_moe_create(&qc, NULL, &m));
        fill_params(m, 5); /* the same values */
        OK(kt_moe_forward(m, &in_q.x, &in_q.ids, &in_q.w, &in_q.y));
        OK(kt_moe_backward(m, &in_q.gy, &in_q.gx, &in_q.gw, 1.0f));
        kt_moe_memory qm;
        kt_moe_get_memory(m, &qm);
        const double ey = tensor_rel(&in_q.y, &in.y), egx = tensor_rel(&in_q.gx, &in.gx);
        const double ratio = (double)qm.weight_bytes / (double)bm.weight_bytes;
        printf("quantization error of %s g%d vs bf16: y %.4f grad_x %.4f (bound %.2f); store "
               "%.4f of bf16's bytes\n",
               kt_moe_quant_name(qc.quant), qc.quant_group, ey, egx, bound[f], ratio);
        assert_true(ey < bound[f] && egx < bound[f]);
        assert_true(ey > 1e-5); /* quantized for real */
        assert_true(ratio <= bytes_bound[f]);
        kt_moe_destroy(m);
    }
    free_inputs(&in), free_inputs(&in_q);
    kt_moe_destroy(ref_layer);
}

static void test_quant_errors(void **state)
{
    (void)state;
    const qfmt_case i8 = {KT_MOE_QUANT_INT8, 0}, i4 = {KT_MOE_QUANT_INT4, 64};
    kt_moe *m = NULL;
    kt_moe_config c = quant_cfg(i4, KT_F32, KT_MOE_FULL, 128, 64, 2, 1, 2);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "L7", "int4", "full mode", "LoRA");
    c = quant_cfg(i8, KT_F32, KT_MOE_LORA, 128, 64, 2, 1, 2);
    c.weight_dtype = KT_F32;
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "weight_dtype bf16");
    c = quant_cfg((qfmt_case){KT_MOE_QUANT_INT4, 128}, KT_F32, KT_MOE_LORA, 192, 128, 2, 1, 2);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "hidden 192", "group size 128",
                    "does not divide");
    c = quant_cfg((qfmt_case){KT_MOE_QUANT_INT4, 32}, KT_F32, KT_MOE_LORA, 128, 96, 2, 1, 2);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "intermediate 96", "multiple of 64");
    c = quant_cfg((qfmt_case){KT_MOE_QUANT_INT4, 48}, KT_F32, KT_MOE_LORA, 192, 96, 2, 1, 2);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "48", "not 32, 64 or 128");
    c = quant_cfg((qfmt_case){(kt_moe_quant)7, 0}, KT_F32, KT_MOE_LORA, 128, 64, 2, 1, 2);
    TU_EXPECT_ERROR(kt_moe_create(&c, NULL, &m), KT_EINVAL, "unknown quant 7");

    /* a NaN or Inf weight is refused naming it, the stored weight kept; no view of the store */
    c = quant_cfg(i4, KT_F32, KT_MOE_LORA, 128, 64, 2, 1, 2);
    OK(kt_moe_create(&c, NULL, &m));
    fill_params(m, 3);
    kt_tensor before = tu_new(KT_F32, 64, 128), after = tu_new(KT_F32, 64, 128);
    kt_tensor bad = tu_new(KT_F32, 64, 128);
    OK(kt_moe_get_weight(m, 1, KT_MOE_UP, &before));
    memcpy(bad.data, before.data, kt_tensor_nbytes(&bad));
    ((float *)bad.data)[5 * 128 + 7] = NAN;
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 1, KT_MOE_UP, &bad), KT_EINVAL, "L7", "expert 1",
                    "up_proj", "[5, 7]", "not finite");
    ((float *)bad.data)[5 * 128 + 7] = INFINITY;
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 1, KT_MOE_UP, &bad), KT_EINVAL, "[5, 7]");
    OK(kt_moe_get_weight(m, 1, KT_MOE_UP, &after));
    assert_true(tu_bitwise_equal(&before, &after));
    kt_tensor view;
    TU_EXPECT_ERROR(kt_moe_weight(m, 0, KT_MOE_GATE, &view), KT_ESTATE, "quantized",
                    "kt_moe_get_weight");
    kt_tensor i32w = tu_new(KT_I32, 64, 128);
    TU_EXPECT_ERROR(kt_moe_set_weight(m, 0, KT_MOE_GATE, &i32w), KT_EINVAL, "f32 or bf16");
    tu_free(&i32w), tu_free(&bad), tu_free(&before), tu_free(&after);
    kt_moe_destroy(m);
}

/* A file with float weights is quantized on load (the same as setting them); a quantized
 * layer's own file holds its codes and scales and reads back exactly; a file of adapters alone
 * keeps the weights; a NaN scale is refused before anything is copied. */
static void test_quant_load_save(void **state)
{
    (void)state;
    char pb[] = "/tmp/kt_test_moeq_XXXXXX", pq[] = "/tmp/kt_test_moeq_XXXXXX";
    int fd = mkstemp(pb);
    assert_true(fd >= 0);
    close(fd);
    fd = mkstemp(pq);
    assert_true(fd >= 0);
    close(fd);
    const qfmt_case i4 = {KT_MOE_QUANT_INT4, 32};
    kt_moe_config bc = make_cfg(KT_BF16, KT_F32, KT_MOE_LORA, 128, 64, 3, 2, 4);
    kt_moe_config qc = quant_cfg(i4, KT_F32, KT_MOE_LORA, 128, 64, 3, 2, 4);
    kt_moe *b = NULL, *q1 = NULL, *q2 = NULL;
    OK(kt_moe_create(&bc, NULL, &b));
    OK(kt_moe_create(&qc, NULL, &q1));
    OK(kt_moe_create(&qc, NULL, &q2));
    fill_params(b, 31);
    fill_params(q1, 31); /* the same weights and adapters, set */
    OK(kt_moe_save(b, pb, NULL));
    kt_st_file *f = NULL;
    OK(kt_st_open(pb, &f));
    OK(kt_moe_load(q2, f, NULL)); /* base weights quantized on load, adapters copied */
    kt_st_close(f);
    inputs in1, in2;
    make_inputs(&in1, &qc, 4, KT_I32, 2);
    make_inputs(&in2, &qc, 4, KT_I32, 2);
    OK(kt_moe_forward(q1, &in1.x, &in1.ids, &in1.w, &in1.y));
    OK(kt_moe_forward(q2, &in2.x, &in2.ids, &in2.w, &in2.y));
    assert_true(tu_bitwise_equal(&in1.y, &in2.y));
    /* its own file: codes, scales and adapters, read back exactly over other weights */
    OK(kt_moe_save(q1, pq, NULL));
    OK(kt_st_open(pq, &f));
    assert_int_equal(kt_st_count(f), 3 * 3 * 4);
    size_t at;
    assert_int_not_equal(kt_st_lookup(f, "moe.0.experts.0.gate_proj.weight", &at), KT_OK);
    kt_clear_error();
    kt_tensor codes, scales;
    OK(kt_st_find(f, "moe.0.experts.2.down_proj.weight.qcodes", &codes));
    OK(kt_st_find(f, "moe.0.experts.2.down_proj.weight.qscales", &scales));
    assert_int_equal(codes.dtype, KT_I32);
    assert_int_equal(codes.shape[0], 128 * 64 / 2 / 4);
    assert_int_equal(scales.shape[0], 128);
    assert_int_equal(scales.shape[1], 64 / 32);
    kt_moe_destroy(q2);
    OK(kt_moe_create(&qc, NULL, &q2));
    fill_params(q2, 77);
    OK(kt_moe_load(q2, f, NULL));
    kt_st_close(f);
    OK(kt_moe_forward(q2, &in2.x, &in2.ids, &in2.w, &in2.y));
    assert_true(tu_bitwise_equal(&in1.y, &in2.y));
    /* adapters alone: the weights kept */
    kt_moe_config lc = bc;
    kt_moe *l = NULL;
    OK(kt_moe_create(&lc, NULL, &l));
    fill_params(l, 31);
    kt_tensor lb;
    OK(kt_moe_lora(l, 1, KT_MOE_DOWN, 1, &lb));
    memset(lb.data, 0, kt_tensor_nbytes(&lb));
    kt_st_item items[18];
    char names[18][128];
    int n = 0;
    for (int64_t e = 0; e < 3; e++)
        for (int p = 0; p < 3; p++)
            for (int ab = 0; ab < 2; ab++, n++) {
                OK(kt_moe_tensor_name(KT_MOE_NAMES_MOE, 0, e, (kt_moe_proj)p,
                                      ab ? "lora_B.weight" : "lora_A.weight", names[n], 128));
                items[n].name = names[n];
                OK(kt_moe_lora(l, e, (kt_moe_proj)p, ab, &items[n].tensor));
            }
    OK(kt_st_save(pb, items, 18, NULL));
    OK(kt_st_open(pb, &f));
    OK(kt_moe_load(q2, f, NULL));
    kt_st_close(f);
    OK(kt_moe_forward(q2, &in2.x, &in2.ids, &in2.w, &in2.y));
    assert_false(tu_bitwise_equal(&in1.y, &in2.y)); /* one adapter's B zeroed */
    kt_tensor w_before = tu_new(KT_F32, 128, 64), w_after = tu_new(KT_F32, 128, 64);
    OK(kt_moe_get_weight(q1, 2, KT_MOE_DOWN, &w_before));
    OK(kt_moe_get_weight(q2, 2, KT_MOE_DOWN, &w_after));
    assert_true(tu_bitwise_equal(&w_before, &w_after));
    /* a NaN scale: refused naming it, nothing copied */
    OK(kt_moe_save(q1, pq, NULL));
    OK(kt_st_open(pq, &f));
    const size_t count = kt_st_count(f);
    kt_st_item *all = calloc(count, sizeof *all);
    for (size_t i = 0; i < count; i++) {
        OK(kt_st_entry(f, i, &all[i].name, &all[i].tensor));
        kt_tensor copy = tu_alloc(all[i].tensor.dtype, all[i].tensor.ndim, all[i].tensor.shape);
        memcpy(copy.data, all[i].tensor.data, kt_tensor_nbytes(&copy));
        all[i].tensor = copy;
        all[i].name = strdup(all[i].name);
    }
    kt_st_close(f);
    for (size_t i = 0; i < count; i++)
        if (strcmp(all[i].name, "moe.0.experts.2.up_proj.weight.qscales") == 0)
            ((uint16_t *)all[i].tensor.data)[3] = 0x7fc0; /* NaN */
    OK(kt_st_save(pb, all, count, NULL));
    OK(kt_st_open(pb, &f));
    fill_params(q2, 77);
    kt_tensor g_after = tu_new(KT_F32, 64, 128), g_before = tu_new(KT_F32, 64, 128);
    OK(kt_moe_get_weight(q2, 0, KT_MOE_GATE, &g_before));
    TU_EXPECT_ERROR(kt_moe_load(q2, f, NULL), KT_EINVAL, "experts.2.up_proj.weight.qscales",
                    "scale [0, 3]", "not finite");
    kt_st_close(f);
    OK(kt_moe_get_weight(q2, 0, KT_MOE_GATE, &g_after)); /* expert 0 comes first: untouched */
    assert_true(tu_bitwise_equal(&g_before, &g_after));
    for (size_t i = 0; i < count; i++)
        tu_free(&all[i].tensor), free((void *)all[i].name);
    free(all);
    tu_free(&w_before), tu_free(&w_after), tu_free(&g_after), tu_free(&g_before);
    kt_moe_destroy(l);
    free_inputs(&in1), free_inputs(&in2);
    kt_moe_destroy(b), kt_moe_destroy(q1), kt_moe_destroy(q2);
    unlink(pb), unlink(pq);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_small),
        cmocka_unit_test(test_reference_odd),
        cmocka_unit_test(test_reference_large_rows),
        cmocka_unit_test(test_accumulate),
        cmocka_unit_test(test_keep_activations_bitwise),
        cmocka_unit_test(test_long_rows_bitwise),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_wide_intermediate),
        cmocka_unit_test(test_route_rechecks_ids),
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_validation),
        cmocka_unit_test(test_memory),
        cmocka_unit_test(test_phase_times),
        cmocka_unit_test(test_cache),
        cmocka_unit_test(test_submit_sync),
        cmocka_unit_test(test_submit_returns_at_once),
        cmocka_unit_test(test_load_save),
        cmocka_unit_test(test_load_partial_lora),
        cmocka_unit_test(test_check_finite_overflow),
        cmocka_unit_test(test_lora_init),
        cmocka_unit_test(test_numa_split_bitwise),
        cmocka_unit_test(test_work_sharing),
        cmocka_unit_test(test_output_staging),
        cmocka_unit_test(test_shared_scratch),
        cmocka_unit_test(test_reference_quant),
        cmocka_unit_test(test_quant_error_vs_bf16),
        cmocka_unit_test(test_quant_errors),
        cmocka_unit_test(test_quant_load_save),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
