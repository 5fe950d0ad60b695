/* LoRA adapters on each expert projection: W_eff = W + s * B A, s = alpha / r, A [r, in],
 * B [out, r] (f32). The rank is small, so the adapter products are plain f32 loops with a
 * fixed summation order; they read the compute-dtype activations the GEMMs read.
 *
 *   forward:  z = x A^T [rows, r];         out += s * z B^T
 *   backward: gz = s * gout B [rows, r];    gin += gz A
 *             dB += scale * s * gout^T z;   dA += scale * gz^T x
 */
#include "moe/moe_internal.h"

typedef struct lora_ctx {
    kt_moe *m;
    int proj;
    const void *a; /* rows of the input (in wide) or output gradient (out wide), cdt */
    const void *b;
    float scale;
} lora_ctx;

static void z_part(void *vctx, int64_t r0, int64_t r1, int thread)
{
    (void)thread;
    lora_ctx *c = vctx;
    kt_moe *m = c->m;
    int64_t in = kt__moe_proj_in(m, c->proj), R = m->R;
    float *z = m->z[c->proj];
    for (int64_t r = r0; r < r1; r++) {
        const float *A = kt__moe_lora_ptr(m, m->lora, m->row_expert[r], c->proj, 0);
        for (int64_t q = 0; q < R; q++) {
            float s = 0.0f;
            for (int64_t i = 0; i < in; i++)
                s += kt__moe_ld(c->a, m->bf16, r * in + i) * A[q * in + i];
            z[r * R + q] = s;
        }
    }
}

void kt__moe_lora_z(kt_moe *m, int proj, const void *in_c)
{
    lora_ctx c = {m, proj, in_c, NULL, 0.0f};
    kt_parallel_for(m->pool, m->off[m->E], 1, z_part, &c);
}

void kt__moe_lora_add(kt_moe *m, int proj, const kt__moe_task *t, float *out)
{
    int64_t outw = kt__moe_proj_out(m, proj), R = m->R;
    const float *B = kt__moe_lora_ptr(m, m->lora, t->e, proj, 1);
    const float *z = m->z[proj];
    for (int64_t r = m->off[t->e]; r < m->off[t->e + 1]; r++)
        for (int64_t n = t->c0; n < t->c1; n++) {
            float s = 0.0f;
            for (int64_t q = 0; q < R; q++)
                s += z[r * R + q] * B[n * R + q];
            out[r * outw + n] += m->lora_scale * s;
        }
}

static void gz_part(void *vctx, int64_t r0, int64_t r1, int thread)
{
    (void)thread;
    lora_ctx *c = vctx;
    kt_moe *m = c->m;
    int64_t outw = kt__moe_proj_out(m, c->proj), R = m->R;
    float *gz = m->gz[c->proj];
    for (int64_t r = r0; r < r1; r++) {
        const float *B = kt__moe_lora_ptr(m, m->lora, m->row_expert[r], c->proj, 1);
        for (int64_t q = 0; q < R; q++) {
            float s = 0.0f;
            for (int64_t n = 0; n < outw; n++)
                s += kt__moe_ld(c->a, m->bf16, r * outw + n) * B[n * R + q];
            gz[r * R + q] = m->lora_scale * s;
        }
    }
}

void kt__moe_lora_gz(kt_moe *m, int proj, const void *gout_c)
{
    lora_ctx c = {m, proj, gout_c, NULL, 0.0f};
    kt_parallel_for(m->pool, m->off[m->E], 1, gz_part, &c);
}

/* dB rows [c0, c1) of each task's expert: a = gout, over the expert's rows. */
static void db_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    (void)thread;
    lora_ctx *c = vctx;
    kt_moe *m = c->m;
    int64_t outw = kt__moe_proj_out(m, c->proj), R = m->R;
    const float *z = m->z[c->proj];
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->tasks[i];
        float *dB = kt__moe_lora_ptr(m, m->lora_grad, t->e, c->proj, 1);
        for (int64_t n = t->c0; n < t->c1; n++)
            for (int64_t q = 0; q < R; q++) {
                float s = 0.0f;
                for (int64_t r = m->off[t->e]; r < m->off[t->e + 1]; r++)
                    s += kt__moe_ld(c->a, m->bf16, r * outw + n) * z[r * R + q];
                dB[n * R + q] += c->scale * (m->lora_scale * s);
            }
    }
}

/* dA columns [c0, c1) of each task's expert: b = the projection's input rows. */
static void da_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    (void)thread;
    lora_ctx *c = vctx;
    kt_moe *m = c->m;
    int64_t in = kt__moe_proj_in(m, c->proj), R = m->R;
    const float *gz = m->gz[c->proj];
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->tasks[i];
        float *dA = kt__moe_lora_ptr(m, m->lora_grad, t->e, c->proj, 0);
        for (int64_t q = 0; q < R; q++)
            for (int64_t k = t->c0; k < t->c1; k++) {
                float s = 0.0f;
                for (int64_t r = m->off[t->e]; r < m->off[t->e + 1]; r++)
                    s += gz[r * R + q] * kt__moe_ld(c->b, m->bf16, r * in + k);
                dA[q * in + k] += c->scale * s;
            }
    }
}

void kt__moe_lora_grads(kt_moe *m, int proj, const void *gout_c, const void *in_c,
                        float scale)
{
    lora_ctx c = {m, proj, gout_c, in_c, scale};
    int64_t n = kt__moe_plan(m, kt__moe_proj_out(m, proj));
    kt_parallel_for(m->pool, n, 1, db_tasks, &c);
    n = kt__moe_plan(m, kt__moe_proj_in(m, proj));
    kt_parallel_for(m->pool, n, 1, da_tasks, &c);
}

void kt__moe_lora_gin_add(kt_moe *m, int proj, const kt__moe_task *t, float *gin)
{
    int64_t in = kt__moe_proj_in(m, proj), R = m->R;
    const float *A = kt__moe_lora_ptr(m, m->lora, t->e, proj, 0);
    const float *gz = m->gz[proj];
    for (int64_t r = m->off[t->e]; r < m->off[t->e + 1]; r++)
        for (int64_t k = t->c0; k < t->c1; k++) {
            float s = 0.0f;
            for (int64_t q = 0; q < R; q++)
                s += gz[r * R + q] * A[q * in + k];
            gin[r * in + k] += s;
        }
}
