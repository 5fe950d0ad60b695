/* embedding: out[i, :] = table[ids[i], :].
 *
 * Ids are checked on the caller's thread before anything is written, so a bad id is
 * reported by its position and leaves the output untouched. The forward copies rows
 * (table and output share a dtype, so no conversion).
 *
 * The backward is a scatter-add. Rather than adding into dtable in its own dtype (which
 * would round bf16/f16 once per token), the tokens are grouped by id with a stable counting
 * sort in scratch; then each table row is produced by one thread, summing its tokens' output
 * gradients in token order in f32 and storing once. The result is deterministic and the
 * same for any thread count. */
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static kt_status infer_embedding(const kt_op_attrs *at, const kt_tensor *in, int n,
                                 kt_tensor *out)
{
    (void)at, (void)n;
    const kt_tensor *table = &in[0], *ids = &in[1];
    KT__TRY(kt__check_float("embedding", "table", table));
    KT__TRY(kt__check_rank("embedding", "table", table, 2, 2));
    KT__TRY(kt__check_index("embedding", "ids", ids));
    /* the output appends H to the ids' dims and must fit KT_MAX_DIMS */
    KT__TRY(kt__check_rank("embedding", "ids", ids, 0, KT_MAX_DIMS - 1));
    int64_t shape[KT_MAX_DIMS];
    for (int d = 0; d < ids->ndim; d++)
        shape[d] = ids->shape[d];
    shape[ids->ndim] = table->shape[1];
    kt__shape_out(&out[0], table->dtype, ids->ndim + 1, shape);
    return KT_OK;
}

/* Backward scratch: per-id offsets (V + 1) and the tokens sorted by id. */
static size_t scratch_embedding_bwd(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    return (size_t)(in[0].shape[0] + 1 + kt_tensor_numel(&in[1])) * sizeof(int64_t);
}

static kt_status check_ids(const kt_tensor *ids, int64_t v)
{
    const int64_t n = kt_tensor_numel(ids);
    for (int64_t i = 0; i < n; i++) {
        int64_t id = kt__index_at(ids, i);
        if (id < 0 || id >= v)
            return kt__error(KT_ERANGE,
                             "embedding: ids[%lld] = %lld is outside [0, %lld) (the table's "
                             "rows)",
                             (long long)i, (long long)id, (long long)v);
    }
    return KT_OK;
}

typedef struct embed_job {
    const kt_tensor *table, *ids, *g;
    kt_tensor *out; /* forward: the output; backward: dtable */
    const int64_t *start, *order;
    int64_t h;
    size_t row_bytes;
} embed_job;

static void fwd_tokens(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const embed_job *j = ctx;
    for (int64_t i = begin; i < end; i++)
        memcpy(kt__elem_ptr(j->out, i * j->h),
               kt__elem_ptr(j->table, kt__index_at(j->ids, i) * j->h), j->row_bytes);
}

static kt_status fwd_embedding(const kt__op_call *c)
{
    const kt_tensor *table = &c->in[0], *ids = &c->in[1];
    KT__TRY(check_ids(ids, table->shape[0]));
    embed_job j = {.table = table, .ids = ids, .out = &c->out_w[0], .h = table->shape[1],
                   .row_bytes = (size_t)table->shape[1] * kt_dtype_size(table->dtype)};
    kt_parallel_for(c->pool, kt_tensor_numel(ids), kt__rows_grain(j.h), fwd_tokens, &j);
    return KT_OK;
}

/* Table rows [begin, end): the sum of their tokens' gradients, zero for unused rows. */
static void bwd_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const embed_job *j = ctx;
    float gbuf[KT__CHUNK], acc[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t v = begin; v < end; v++) {
        const int64_t first = j->start[v], last = j->start[v + 1];
        if (first == last) {
            memset(kt__elem_ptr(j->out, v * j->h), 0, j->row_bytes);
            continue;
        }
        for (int64_t c = 0; c < j->h; c += KT__CHUNK) {
            int64_t n = j->h - c < KT__CHUNK ? j->h - c : KT__CHUNK;
            for (int64_t k = 0; k < n; k++)
                acc[k] = 0.0f;
            for (int64_t t = first; t < last; t++) {
                const float *gs = kt__load_f32(j->g, j->order[t] * j->h + c, n, gbuf);
                for (int64_t k = 0; k < n; k++)
                    acc[k] += gs[k];
            }
            float *os = kt__store_ptr(j->out, v * j->h + c, obuf);
            for (int64_t k = 0; k < n; k++)
                os[k] = acc[k];
            kt__store_commit(j->out, v * j->h + c, n, obuf);
        }
    }
}

static kt_status bwd_embedding(const kt__op_call *c)
{
    if (c->gin[0].data == NULL)
        return KT_OK;
    const kt_tensor *table = &c->in[0], *ids = &c->in[1];
    const int64_t v = table->shape[0], n = kt_tensor_numel(ids);
    /* the counting sort indexes scratch by id: ids must be valid here too */
    KT__TRY(check_ids(ids, v));
    int64_t *start = c->scratch, *order = start + v + 1;
    /* start[id + 1] = count of id; prefix sums give each id's first slot; placing tokens in
     * order advances start[id] to the next id's first slot, so shifting by one restores
     * the beginnings. Token order within an id is kept (stable). */
    memset(start, 0, (size_t)(v + 1) * sizeof *start);
    for (int64_t i = 0; i < n; i++)
        start[kt__index_at(ids, i) + 1]++;
    for (int64_t k = 0; k < v; k++)
        start[k + 1] += start[k];
    for (int64_t i = 0; i < n; i++)
        order[start[kt__index_at(ids, i)]++] = i;
    for (int64_t k = v; k > 0; k--)
        start[k] = start[k - 1];
    start[0] = 0;
    embed_job j = {.ids = ids, .g = &c->gout[0], .out = &c->gin[0], .start = start,
                   .order = order, .h = table->shape[1],
                   .row_bytes = (size_t)table->shape[1] * kt_dtype_size(table->dtype)};
    kt_parallel_for(c->pool, v, kt__rows_grain(j.h), bwd_rows, &j);
    return KT_OK;
}

const kt__op_desc kt__op_embedding = {
    .name = "embedding", .min_in = 2, .max_in = 2, .n_out = 1, .bwd_reads_in = 2u,
    .no_grad_in = 2u, .infer = infer_embedding, .scratch_bwd = scratch_embedding_bwd,
    .forward = fwd_embedding, .backward = bwd_embedding};
