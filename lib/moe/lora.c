/* LoRA adapters on each expert projection: W_eff = W + s * B A, s = alpha / r, A [r, in],
 * B [out, r] (f32). The rank is small (at most KT__MOE_LORA_MAX_RANK), so each adapter
 * product is r dot products or r axpys over the long dimension (moe/vec.h, AVX-512 where the
 * CPU has it), in a fixed order that does not depend on the thread split; they read the
 * compute-dtype activations the GEMMs read, widened to f32 as they go.
 *
 *   forward:  z = x A^T [rows, r];         out += s * z B^T
 *   backward: gz = s * gout B [rows, r];    gin += gz A
 *             dB += scale * s * gout^T z;   dA += scale * gz^T x
 *
 * All take an expert's rows at a time: z, gz (kt__vec_rows_dots), gin and out
 * (kt__vec_rows_axpys). out and the gradients cut long rows into pieces of piece(r) columns:
 * their stack buffers hold r pieces of B transposed, or of accumulators and one piece of a row
 * (at most r + 2 pieces: 64 KiB). */
#include "lib/moe/moe_internal.h"
#include "lib/kernels/vec.h"

#define LORA_BUF 16384 /* floats of stack per call */

typedef struct lora_ctx {
    kt_moe *m;
    int proj;
    const void *a; /* rows of the input (in wide) or output gradient (out wide), cdt */
    int64_t lda;   /* a's row stride */
    const void *b; /* (gradients) rows of the input */
    int64_t ldb;
    float scale;
} lora_ctx;

/* Columns per piece for rank R: R + 2 pieces fit LORA_BUF, a multiple of 16. */
static int64_t piece(int64_t R) { return LORA_BUF / (R + 2) / 16 * 16; }

/* out[r] = a's row r times the adapter matrix's transpose for rows [r0, r1), an expert's run
 * of rows at a time: A [r, in] (which_b 0: x A^T) or B [out, r] read as the r rows of B^T
 * (which_b 1: gout B). */
static void adapter_dots(const lora_ctx *c, int64_t r0, int64_t r1, int which_b, float *out)
{
    kt_moe *m = c->m;
    const int64_t R = m->dim.R;
    const int64_t n = which_b ? kt__moe_proj_out(m, c->proj) : kt__moe_proj_in(m, c->proj);
    for (int64_t s0 = r0; s0 < r1;) {
        const int64_t e = m->route.row_expert[s0];
        const int64_t s1 = m->route.row_start[e + 1] < r1 ? m->route.row_start[e + 1]
                                                          : r1; /* this expert's rows */
        kt__vec_rows_dots(n, s1 - s0, kt__moe_cdt_at(m, c->a, s0 * c->lda), c->lda, m->dim.bf16,
                          kt__moe_lora_ptr(m, m->train.lora, e, c->proj, which_b), which_b ? 1 : n,
                          which_b ? R : 1, R, out + s0 * R);
        s0 = s1;
    }
}

/* z[r] = x[r] A^T for rows [r0, r1) */
static void z_part(void *vctx, int64_t r0, int64_t r1, int thread)
{
    (void)thread;
    const lora_ctx *c = vctx;
    adapter_dots(c, r0, r1, 0, c->m->fwd.lora_xa[c->proj]);
}

void kt__moe_lora_z(kt_moe *m, int proj, const void *in_c, int64_t ld_in)
{
    lora_ctx c = {m, proj, in_c, ld_in, NULL, 0, 0.0f};
    kt_parallel_for(m->pool, m->route.row_start[m->dim.E], 1, z_part, &c);
}

/* out[r, c0..c1) += s * sum_q z[r, q] B[n, q] for the task's expert: B's columns transposed
 * once per piece into bt[q][n], then kt__vec_rows_axpys over the expert's rows (each column
 * block of bt read once for all rows, each out element read and written once). */
void kt__moe_lora_add(kt_moe *m, int proj, const kt__moe_task *t, float *out)
{
    const int64_t outw = kt__moe_proj_out(m, proj), R = m->dim.R, W = piece(R);
    const float *B = kt__moe_lora_ptr(m, m->train.lora, t->e, proj, 1);
    const int64_t row0 = m->route.row_start[t->e], rows = m->route.row_start[t->e + 1] - row0;
    float bt[LORA_BUF];
    for (int64_t n0 = t->c0; n0 < t->c1; n0 += W) {
        const int64_t w = t->c1 - n0 < W ? t->c1 - n0 : W;
        for (int64_t q = 0; q < R; q++)
            for (int64_t n = 0; n < w; n++)
                bt[q * W + n] = B[(n0 + n) * R + q];
        kt__vec_rows_axpys(w, rows, m->fwd.lora_xa[proj] + row0 * R, R, bt, W, m->dim.lora_scale,
                           out + row0 * outw + n0, outw);
    }
}

/* gz[r] = s * gout[r] B for rows [r0, r1) */
static void gz_part(void *vctx, int64_t r0, int64_t r1, int thread)
{
    (void)thread;
    const lora_ctx *c = vctx;
    kt_moe *m = c->m;
    float *gz = m->bwd.lora_grad_xa[c->proj];
    adapter_dots(c, r0, r1, 1, gz);
    for (int64_t i = r0 * m->dim.R; i < r1 * m->dim.R; i++)
        gz[i] *= m->dim.lora_scale;
}

void kt__moe_lora_gz(kt_moe *m, int proj, const void *gout_c, int64_t ld_gout)
{
    lora_ctx c = {m, proj, gout_c, ld_gout, NULL, 0, 0.0f};
    kt_parallel_for(m->pool, m->route.row_start[m->dim.E], 1, gz_part, &c);
}

/* acc[q][j] = sum over the expert's rows r in order of coef[r, q] * rows[r, c0 + j], for j < w
 * (acc rows W apart): the rank-r sums of both adapter gradients. */
static void accumulate_rows(const kt_moe *m, int64_t e, const void *rows, int64_t ld, int64_t c0,
                            int64_t w, const float *coef, float *acc)
{
    const int64_t r0 = m->route.row_start[e];
    kt__vec_rank_update(w, m->route.row_start[e + 1] - r0, kt__moe_cdt_at(m, rows, r0 * ld + c0),
                        ld, m->dim.bf16, coef + r0 * m->dim.R, m->dim.R, acc, piece(m->dim.R));
}

/* dB rows [c0, c1) of each task's expert (a = gout): acc[q][n] = sum_r z[r, q] gout[r, n],
 * then added to dB (transposed). */
static void db_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    (void)thread;
    lora_ctx *c = vctx;
    kt_moe *m = c->m;
    const int64_t R = m->dim.R, W = piece(R);
    float buf[LORA_BUF];
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        float *dB = kt__moe_lora_ptr(m, m->train.lora_grad, t->e, c->proj, 1);
        for (int64_t n0 = t->c0; n0 < t->c1; n0 += W) {
            const int64_t w = t->c1 - n0 < W ? t->c1 - n0 : W;
            accumulate_rows(m, t->e, c->a, c->lda, n0, w, m->fwd.lora_xa[c->proj], buf);
            for (int64_t n = 0; n < w; n++)
                for (int64_t q = 0; q < R; q++)
                    dB[(n0 + n) * R + q] += c->scale * (m->dim.lora_scale * buf[q * W + n]);
        }
    }
}

/* dA columns [c0, c1) of each task's expert (b = the projection's input rows): acc[q][k] =
 * sum_r gz[r, q] x[r, k], then added to dA. */
static void da_tasks(void *vctx, int64_t b, int64_t end, int thread)
{
    (void)thread;
    lora_ctx *c = vctx;
    kt_moe *m = c->m;
    const int64_t in = kt__moe_proj_in(m, c->proj), R = m->dim.R, W = piece(R);
    float buf[LORA_BUF];
    for (int64_t i = b; i < end; i++) {
        const kt__moe_task *t = &m->route.tasks[i];
        float *dA = kt__moe_lora_ptr(m, m->train.lora_grad, t->e, c->proj, 0);
        for (int64_t k0 = t->c0; k0 < t->c1; k0 += W) {
            const int64_t w = t->c1 - k0 < W ? t->c1 - k0 : W;
            accumulate_rows(m, t->e, c->b, c->ldb, k0, w, m->bwd.lora_grad_xa[c->proj], buf);
            for (int64_t q = 0; q < R; q++)
                kt__vec_axpy(w, c->scale, buf + q * W, dA + q * in + k0);
        }
    }
}

void kt__moe_lora_grads(kt_moe *m, int proj, const void *gout_c, int64_t ld_gout, const void *in_c,
                        int64_t ld_in, float scale)
{
    lora_ctx c = {m, proj, gout_c, ld_gout, in_c, ld_in, scale};
    int64_t n = kt__moe_plan(m, kt__moe_proj_out(m, proj));
    kt_parallel_for(m->pool, n, 1, db_tasks, &c);
    n = kt__moe_plan(m, kt__moe_proj_in(m, proj));
    kt_parallel_for(m->pool, n, 1, da_tasks, &c);
}

/* gin[r - r0, c - t->c0] (row stride ldg) += (gz[r] A)[c] for rows r in [r0, r1) (of the
 * task's expert) and the task's columns c (kt__vec_rows_axpys: A's column blocks read once
 * for all the rows). */
void kt__moe_lora_gin_add(kt_moe *m, int proj, const kt__moe_task *t, int64_t r0, int64_t r1,
                          float *gin, int64_t ldg)
{
    const int64_t in = kt__moe_proj_in(m, proj);
    const float *A = kt__moe_lora_ptr(m, m->train.lora, t->e, proj, 0);
    kt__vec_rows_axpys(t->c1 - t->c0, r1 - r0, m->bwd.lora_grad_xa[proj] + r0 * m->dim.R, m->dim.R,
                       A + t->c0, in, 1.0f, gin, ldg);
}
