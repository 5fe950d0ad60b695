/* cross_entropy: the mean over counted tokens of -log_softmax(logits)[target].
 *
 * attrs.ignore_index marks tokens that do not count; its default is -100 (PyTorch's), for C
 * (kt_op_defaults) and .ktg alike.
 *
 * Targets are checked on the caller's thread before any work, so a bad one is reported by
 * its position. A row's loss is its max-subtracted logsumexp minus the target's logit. The
 * rows are cut into at most LOSS_BLOCKS blocks that depend only on N; one thread sums each
 * block in row order and the block sums are added in order, so the loss is the same for any
 * thread count and needs no scratch. The backward recomputes each row's softmax:
 *   dlogits = gout * (softmax - onehot(target)) / count, zero rows for ignored tokens. */
#include <math.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

#define LOSS_BLOCKS 512

static kt_status infer_ce(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)at, (void)n;
    const kt_tensor *logits = &in[0], *targets = &in[1];
    KT__TRY(kt__check_float("cross_entropy", "logits", logits));
    KT__TRY(kt__check_rank("cross_entropy", "logits", logits, 2, 2));
    KT__TRY(kt__check_index("cross_entropy", "targets", targets));
    KT__TRY(kt__check_rank("cross_entropy", "targets", targets, 1, 1));
    KT__TRY(kt__check_dim("cross_entropy", "targets", targets, 0, logits->shape[0]));
    kt__shape_out(&out[0], KT_F32, 0, NULL);
    return KT_OK;
}

static double flops_ce(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return 4.0 * (double)kt_tensor_numel(&in[0]);
}

/* Counts the tokens not ignored; KT_ERANGE for the first target outside [0, V). */
static kt_status check_targets(const kt_tensor *logits, const kt_tensor *targets,
                               int64_t ignore, int64_t *count)
{
    const int64_t n = logits->shape[0], v = logits->shape[1];
    int64_t cnt = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t t = kt__index_at(targets, i);
        if (t == ignore)
            continue;
        if (t < 0 || t >= v)
            return kt__error(KT_ERANGE,
                             "cross_entropy: targets[%lld] = %lld is outside [0, %lld) and is "
                             "not ignore_index (%lld)",
                             (long long)i, (long long)t, (long long)v, (long long)ignore);
        cnt++;
    }
    *count = cnt;
    return KT_OK;
}

static int64_t chunk_len(int64_t v, int64_t i) { return v - i < KT__CHUNK ? v - i : KT__CHUNK; }

/* The row's maximum and sum of exp(x - max). */
static void row_stats(const kt_tensor *x, int64_t off, int64_t v, float *max, float *sum)
{
    float buf[KT__CHUNK];
    float m = -INFINITY, s = 0.0f;
    for (int64_t i = 0; i < v; i += KT__CHUNK) {
        int64_t n = chunk_len(v, i);
        const float *xs = kt__load_f32(x, off + i, n, buf);
        for (int64_t k = 0; k < n; k++)
            m = xs[k] > m ? xs[k] : m;
    }
    for (int64_t i = 0; i < v; i += KT__CHUNK) {
        int64_t n = chunk_len(v, i);
        const float *xs = kt__load_f32(x, off + i, n, buf);
        for (int64_t k = 0; k < n; k++)
            s += expf(xs[k] - m);
    }
    *max = m;
    *sum = s;
}

typedef struct ce_job {
    const kt_tensor *logits, *targets;
    kt_tensor *dlogits;
    double *block_sum; /* forward: one per block */
    int64_t n, v, ignore, block_rows;
    float scale; /* backward: gout / count */
} ce_job;

static void fwd_blocks(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const ce_job *j = ctx;
    for (int64_t b = begin; b < end; b++) {
        const int64_t first = b * j->block_rows;
        const int64_t last = first + j->block_rows < j->n ? first + j->block_rows : j->n;
        double sum = 0.0;
        for (int64_t r = first; r < last; r++) {
            const int64_t t = kt__index_at(j->targets, r);
            if (t == j->ignore)
                continue;
            float m, s, tbuf;
            row_stats(j->logits, r * j->v, j->v, &m, &s);
            const float xt = *kt__load_f32(j->logits, r * j->v + t, 1, &tbuf);
            sum += (double)(m + logf(s) - xt);
        }
        j->block_sum[b] = sum;
    }
}

static kt_status fwd_ce(const kt__op_call *c)
{
    const kt_tensor *logits = &c->in[0];
    double block_sum[LOSS_BLOCKS];
    ce_job j = {.logits = logits, .targets = &c->in[1], .block_sum = block_sum,
                .n = logits->shape[0], .v = logits->shape[1],
                .ignore = c->attrs->ignore_index};
    int64_t count = 0;
    KT__TRY(check_targets(logits, j.targets, j.ignore, &count));
    float *out = c->out_w[0].data;
    if (count == 0) {
        *out = 0.0f;
        return KT_OK;
    }
    j.block_rows = (j.n + LOSS_BLOCKS - 1) / LOSS_BLOCKS;
    const int64_t blocks = (j.n + j.block_rows - 1) / j.block_rows;
    const int64_t block_elems = j.block_rows * (j.v > 0 ? j.v : 1);
    kt_parallel_for(c->pool, blocks, kt__rows_grain(block_elems), fwd_blocks, &j);
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        sum += block_sum[b];
    *out = (float)(sum / (double)count);
    return KT_OK;
}

static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const ce_job *j = ctx;
    float xbuf[KT__CHUNK], dbuf[KT__CHUNK];
    for (int64_t r = begin; r < end; r++) {
        const int64_t off = r * j->v, t = kt__index_at(j->targets, r);
        const int counted = t != j->ignore;
        float m = 0.0f, s = 1.0f;
        if (counted)
            row_stats(j->logits, off, j->v, &m, &s);
        const float a = j->scale / s;
        for (int64_t i = 0; i < j->v; i += KT__CHUNK) {
            int64_t n = chunk_len(j->v, i);
            float *ds = kt__store_ptr(j->dlogits, off + i, dbuf);
            if (counted) {
                const float *xs = kt__load_f32(j->logits, off + i, n, xbuf);
                for (int64_t k = 0; k < n; k++)
                    ds[k] = a * expf(xs[k] - m);
                if (t >= i && t < i + n)
                    ds[t - i] -= j->scale;
            } else {
                for (int64_t k = 0; k < n; k++)
                    ds[k] = 0.0f;
            }
            kt__store_commit(j->dlogits, off + i, n, dbuf);
        }
    }
}

static kt_status bwd_ce(const kt__op_call *c)
{
    if (c->gin[0].data == NULL)
        return KT_OK;
    const kt_tensor *logits = &c->in[0];
    ce_job j = {.logits = logits, .targets = &c->in[1], .dlogits = &c->gin[0],
                .n = logits->shape[0], .v = logits->shape[1], .ignore = c->attrs->ignore_index};
    int64_t count = 0;
    KT__TRY(check_targets(logits, j.targets, j.ignore, &count));
    /* no counted token: the loss is the constant 0 and every row's gradient is zero */
    j.scale = count > 0 ? *(const float *)c->gout[0].data / (float)count : 0.0f;
    kt_parallel_for(c->pool, logits->shape[0], kt__rows_grain(j.v), bwd_rows, &j);
    return KT_OK;
}

/* -100 as in PyTorch: the one default for C and .ktg (a zero would drop class 0). */
static const kt__attr_desc ce_attrs[] = {
    KT__A_I64("ignore_index", ignore_index, -100, INT64_MIN, INT64_MAX,
              "targets equal to it do not count"),
};

const kt__op_desc kt__op_cross_entropy = {
    .name = "cross_entropy", .min_in = 2, .max_in = 2, .n_out = 1, .bwd_reads_in = 3u,
    .no_grad_in = 2u, .infer = infer_ce, .flops = flops_ce, .forward = fwd_ce,
    .backward = bwd_ce,
    KT__ATTR_LIST(ce_attrs)};
