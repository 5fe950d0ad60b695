/* load_balance_loss: the Switch / Mixtral auxiliary loss that transformers adds to the
 * language-model loss (times router_aux_loss_coef) for Mixtral, Qwen-MoE and OLMoE:
 *   p = softmax(logits) per row, f_e = (the (row, slot) choices of expert e) / R,
 *   P_e = sum_rows p_e / R, aux = E * sum_e f_e P_e.
 * transformers concatenates the rows of all MoE layers before computing it, so a model
 * concatenates its layers' logits and ids along the rows and calls this once (the loss is
 * not the sum of per-layer losses). The ids carry no gradient; the logits get one through P:
 *   d aux / d x_rj = (E / R) p_rj (f_j - q_r),  q_r = sum_e f_e p_re.
 * Written as aux = (E / R) sum_r q_r, the forward needs no per-expert sum over rows: the rows
 * are cut into at most LB_BLOCKS blocks that depend only on R, each summed in row order in
 * double and the block sums added in order, so the loss is the same for any thread count.
 * The counts and f live in scratch, counted on the caller's thread. */
#include <math.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

#define LB_BLOCKS 512

static kt_status infer_lb(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    const kt_tensor *logits = &in[0], *ids = &in[1];
    KT__TRY(kt__check_f32("load_balance_loss", "logits", logits));
    KT__TRY(kt__check_rank("load_balance_loss", "logits", logits, 2, 2));
    KT__TRY(kt__check_index("load_balance_loss", "ids", ids));
    KT__TRY(kt__check_rank("load_balance_loss", "ids", ids, 2, 2));
    KT__TRY(kt__check_dim("load_balance_loss", "ids", ids, 0, logits->shape[0]));
    kt__shape_out(&out[0], KT_F32, 0, NULL);
    return KT_OK;
}

static double flops_lb(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return 6.0 * (double)kt_tensor_numel(&in[0]);
}

/* the counts (int64) and f (float), one of each per expert */
static size_t scratch_lb(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return (size_t)in[0].shape[1] * (sizeof(int64_t) + sizeof(float));
}

static float *f_of(const kt__op_call *c)
{
    return (float *)((int64_t *)c->scratch + c->in[0].shape[1]);
}

/* f_e = count_e / R into f[E], counting in counts[E]; KT_ERANGE for the first id outside
 * [0, E). NaN or infinite logits are refused as topk_router refuses them (the loss would be
 * NaN). */
static kt_status count_choices(const char *what, const kt_tensor *logits, const kt_tensor *ids,
                               int64_t *count, float *f)
{
    const int64_t r = logits->shape[0], e = logits->shape[1], n = kt_tensor_numel(ids);
    const float *x = logits->data;
    for (int64_t i = 0; i < r * e; i++)
        if (!isfinite(x[i]))
            return kt__error(KT_EINVAL,
                             "%s: logits of row %lld are not finite (%g at expert %lld)", what,
                             (long long)(i / e), (double)x[i], (long long)(i % e));
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = kt__index_at(ids, i);
        if (id < 0 || id >= e)
            return kt__error(KT_ERANGE, "%s: ids[%lld] = %lld is outside [0, %lld)", what,
                             (long long)i, (long long)id, (long long)e);
    }
    for (int64_t k = 0; k < e; k++)
        count[k] = 0;
    for (int64_t i = 0; i < n; i++)
        count[kt__index_at(ids, i)]++;
    for (int64_t k = 0; k < e; k++)
        f[k] = (float)((double)count[k] / (double)r);
    return KT_OK;
}

typedef struct lb_job {
    const float *x, *f;
    float *dx;
    double *block_sum;
    int64_t r, e, block_rows;
    float scale; /* backward: gout * E / R */
} lb_job;

/* q = sum_e f_e p_e of one row; m, inv: its max and 1 / sum exp(x - m). */
static float row_q(const lb_job *j, const float *x, float *m_out, float *inv_out)
{
    float m = x[0], s = 0.0f, q = 0.0f;
    for (int64_t i = 1; i < j->e; i++)
        m = x[i] > m ? x[i] : m;
    for (int64_t i = 0; i < j->e; i++) {
        const float z = expf(x[i] - m);
        s += z;
        q += j->f[i] * z;
    }
    *m_out = m;
    *inv_out = 1.0f / s;
    return q / s;
}

static void fwd_blocks(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const lb_job *j = ctx;
    for (int64_t b = begin; b < end; b++) {
        const int64_t first = b * j->block_rows;
        const int64_t last = first + j->block_rows < j->r ? first + j->block_rows : j->r;
        double sum = 0.0;
        float m, inv;
        for (int64_t r = first; r < last; r++)
            sum += (double)row_q(j, j->x + r * j->e, &m, &inv);
        j->block_sum[b] = sum;
    }
}

static kt_status fwd_lb(const kt__op_call *c)
{
    const kt_tensor *logits = &c->in[0];
    lb_job j = {.x = logits->data, .f = f_of(c), .r = logits->shape[0],
                .e = logits->shape[1]};
    float *out = c->out_w[0].data;
    if (j.r == 0 || j.e == 0) {
        *out = 0.0f;
        return KT_OK;
    }
    KT__TRY(count_choices("load_balance_loss", logits, &c->in[1], c->scratch, f_of(c)));
    double block_sum[LB_BLOCKS];
    j.block_sum = block_sum;
    j.block_rows = (j.r + LB_BLOCKS - 1) / LB_BLOCKS;
    const int64_t blocks = (j.r + j.block_rows - 1) / j.block_rows;
    kt_parallel_for(c->pool, blocks, kt__rows_grain(j.block_rows * j.e), fwd_blocks, &j);
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        sum += block_sum[b];
    *out = (float)(sum * (double)j.e / (double)j.r);
    return KT_OK;
}

static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const lb_job *j = ctx;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * j->e;
        float *dx = j->dx + r * j->e;
        float m, inv;
        const float q = row_q(j, x, &m, &inv);
        for (int64_t i = 0; i < j->e; i++)
            dx[i] = j->scale * expf(x[i] - m) * inv * (j->f[i] - q);
    }
}

static kt_status bwd_lb(const kt__op_call *c)
{
    if (c->gin[0].data == NULL)
        return KT_OK;
    const kt_tensor *logits = &c->in[0];
    lb_job j = {.x = logits->data, .f = f_of(c), .dx = c->gin[0].data,
                .r = logits->shape[0], .e = logits->shape[1]};
    if (j.r == 0 || j.e == 0)
        return KT_OK;
    KT__TRY(count_choices("load_balance_loss backward", logits, &c->in[1], c->scratch,
                          f_of(c)));
    j.scale = *(const float *)c->gout[0].data * (float)j.e / (float)j.r;
    kt_parallel_for(c->pool, j.r, kt__rows_grain(j.e), bwd_rows, &j);
    return KT_OK;
}

const kt__op_desc kt__op_load_balance_loss = {
    .name = "load_balance_loss", .min_in = 2, .max_in = 2, .n_out = 1, .bwd_reads_in = 3u,
    .no_grad_in = 2u, .infer = infer_lb, .scratch_fwd = scratch_lb, .scratch_bwd = scratch_lb,
    .flops = flops_lb, .forward = fwd_lb, .backward = bwd_lb};
