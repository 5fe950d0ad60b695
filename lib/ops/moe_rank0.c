/* moe over several ranks, rank 0 holding every expert (KTransformers' design).
 *
 * Each rank brings its own row count T_r (its program may be compiled for another T, or hold
 * no rows): the ranks exchange their counts and shapes, rank 0 checks that the W batches fit
 * its layer and agrees on that with everyone (so no rank waits on a gather rank 0 refuses),
 * gathers the rows in rank order, runs the layer on them as one batch (the result equals one
 * rank running the concatenated batch), agrees on the status again before the scatter (a
 * failure on rank 0 reaches every rank instead of leaving them waiting) and scatters each
 * rank's rows back. Weight gradients are the mean over the ranks, matching data-parallel
 * averaging. */
#include <stdio.h>
#include <string.h>

#include "kt/comm.h"
#include "lib/ops/map.h"
#include "lib/ops/moe_dist.h"
#include "lib/ops/op_util.h"

/* What each rank tells the others about its rows. */
enum { INFO_T, INFO_H, INFO_K, INFO_ACT, INFO_IDS, INFO_N };

typedef struct rank0 {
    int world, rank;
    int64_t *info;   /* [W][INFO_N] */
    size_t *counts;  /* bytes per rank of the current gather */
    int64_t total;   /* rows of all ranks */
} rank0;

size_t kt__moe_rank0_scratch(const kt_tensor *in, int world)
{
    (void)in;
    return ((sizeof(int64_t) * INFO_N + sizeof(size_t)) * (size_t)world + 63) / 64 * 64 + 128;
}

size_t kt__moe_rank0_rows_bytes(const kt_moe_config *cfg)
{
    /* x, y (gy in backward), gx in the activation dtype; ids (at most 8 bytes), w and gw */
    size_t t = (size_t)cfg->max_tokens, k = (size_t)cfg->top_k;
    size_t act = kt_dtype_size(cfg->act_dtype) * (size_t)cfg->hidden;
    return t * (3 * act + 8 * k + 8 * k) + 8 * 64;
}

void kt__moe_scale_rows(kt_threadpool *pool, kt_tensor *t, float s)
{
    const kt_op_attrs at = {.alpha = s};
    kt__map1(pool, t, t, kt__map_scale, &at); /* elementwise, so in place is safe */
}

/* The counts and shapes of every rank; rank 0 checks them against its own and its layer. */
static kt_status exchange_rows(const kt__op_call *c, rank0 *d)
{
    d->world = kt_comm_size(c->comm);
    d->rank = kt_comm_rank(c->comm);
    if (c->comm_scratch == NULL)
        return kt__error(KT_EINVAL, "moe: no message buffers (run it in a session)");
    char *cursor = c->comm_scratch;
    d->info = (int64_t *)(void *)kt__moe_carve(&cursor, sizeof(int64_t) * INFO_N * (size_t)d->world);
    d->counts = (size_t *)(void *)kt__moe_carve(&cursor, sizeof(size_t) * (size_t)d->world);
    const kt_tensor *x = &c->in[0], *ids = &c->in[1];
    const int64_t mine[INFO_N] = {x->shape[0], x->shape[1], ids->shape[1], (int64_t)x->dtype,
                                  (int64_t)ids->dtype};
    KT__TRY(kt_comm_all_gather(c->comm, mine, sizeof mine, d->info));
    d->total = 0;
    for (int r = 0; r < d->world; r++)
        d->total += d->info[r * INFO_N + INFO_T];
    if (d->rank != 0)
        return KT_OK;
    for (int r = 1; r < d->world; r++) {
        const int64_t *o = d->info + r * INFO_N;
        if (o[INFO_H] != mine[INFO_H] || o[INFO_K] != mine[INFO_K] ||
            o[INFO_ACT] != mine[INFO_ACT] || o[INFO_IDS] != mine[INFO_IDS])
            return kt__error(KT_EINVAL, "moe: rank %d brings x %s[%lld,%lld] with ids %s of k=%lld, "
                             "rank 0 x %s[..,%lld] with ids %s of k=%lld: every rank's program "
                             "must differ in its row count only", r,
                             kt_dtype_name((kt_dtype)o[INFO_ACT]), (long long)o[INFO_T],
                             (long long)o[INFO_H], kt_dtype_name((kt_dtype)o[INFO_IDS]),
                             (long long)o[INFO_K], kt_dtype_name(x->dtype),
                             (long long)mine[INFO_H], kt_dtype_name(ids->dtype),
                             (long long)mine[INFO_K]);
    }
    kt_moe *m = kt__moe_bound(c);
    if (m == NULL)
        return kt__error(KT_EINVAL, "moe: rank 0 holds no MoE layer %d (with rank 0 holding "
                         "the experts, give it the layers in kt_session_options.moe_layers)",
                         c->attrs->binding);
    const kt_moe_config *cfg = kt_moe_get_config(m);
    if (d->total > cfg->max_tokens) {
        char list[160];
        size_t len = 0;
        for (int r = 0; r < d->world && len < sizeof list; r++)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%lld", r ? ", " : "",
                                    (long long)d->info[r * INFO_N + INFO_T]);
        return kt__error(KT_ERANGE, "moe: the %d ranks bring %lld rows in all (%s), more than "
                         "MoE layer %d's max_tokens %lld", d->world, (long long)d->total, list,
                         c->attrs->binding, (long long)cfg->max_tokens);
    }
    return KT_OK;
}

static kt_status gather_rows(const kt__op_call *c, rank0 *d, const kt_tensor *local, kt_tensor *all)
{
    const size_t row = kt__moe_row_bytes(local);
    for (int r = 0; r < d->world; r++)
        d->counts[r] = (size_t)d->info[r * INFO_N + INFO_T] * row;
    return kt_comm_gatherv(c->comm, local->data, d->counts, all ? all->data : NULL, 0);
}

static kt_status scatter_rows(const kt__op_call *c, rank0 *d, const kt_tensor *all, kt_tensor *local)
{
    const size_t row = kt__moe_row_bytes(local);
    for (int r = 0; r < d->world; r++)
        d->counts[r] = (size_t)d->info[r * INFO_N + INFO_T] * row;
    return kt_comm_scatterv(c->comm, all ? all->data : NULL, d->counts, local->data, 0);
}

/* Rank 0's tensors of all the rows, carved from its rows buffer. */
typedef struct batch {
    kt_tensor x, ids, w, y, gx, gw; /* y holds gy in backward */
} batch;

static kt_status batch_of(const kt__op_call *c, const rank0 *d, const kt_tensor *x_like,
                          batch *b)
{
    char *cursor = NULL;
    const kt_tensor *ids = &c->in[1], *w = &c->in[2];
    size_t need = (size_t)d->total * (3 * kt__moe_row_bytes(x_like) + kt__moe_row_bytes(ids) +
                                      2 * kt__moe_row_bytes(w)) + 6 * 64;
    KT__TRY(kt__moe_rows(c, need, &cursor));
    b->x = kt__moe_rows_like(x_like, d->total, &cursor);
    b->y = kt__moe_rows_like(x_like, d->total, &cursor);
    b->gx = kt__moe_rows_like(x_like, d->total, &cursor);
    b->ids = kt__moe_rows_like(ids, d->total, &cursor);
    b->w = kt__moe_rows_like(w, d->total, &cursor);
    b->gw = kt__moe_rows_like(w, d->total, &cursor);
    return KT_OK;
}

kt_status kt__moe_rank0_forward(const kt__op_call *c)
{
    rank0 d;
    batch b;
    kt_status st = exchange_rows(c, &d);
    if (st == KT_OK && d.rank == 0)
        st = batch_of(c, &d, &c->in[0], &b);
    KT__TRY(kt_comm_agree(c->comm, st));
    const int root = d.rank == 0;
    KT__TRY(gather_rows(c, &d, &c->in[0], root ? &b.x : NULL));
    KT__TRY(gather_rows(c, &d, &c->in[1], root ? &b.ids : NULL));
    KT__TRY(gather_rows(c, &d, &c->in[2], root ? &b.w : NULL));
    if (root)
        st = kt_moe_forward(kt__moe_bound(c), &b.x, &b.ids, &b.w, &b.y);
    KT__TRY(kt_comm_agree(c->comm, st));
    return scatter_rows(c, &d, root ? &b.y : NULL, &c->out_w[0]);
}

/* Each rank's loss is the mean over its own tokens, so the output gradients gathered on
 * rank 0 are W times those of the mean loss over all ranks' losses, and the ranks' backward
 * expects input gradients of the same scale. Linear algebra does not care where the 1/W is
 * applied, but rounding does: a layer with bf16 weights rounds the output gradients to bf16,
 * and W*g rounds differently from g unless W is a power of two (with 3 ranks and bf16
 * experts, the first step's parameter gradients differed from one rank's by 6x more than
 * with this scaling; what remains comes from x itself rounding to bf16 after f32-level
 * differences upstream). So rank 0 divides the gathered gradients by W, runs the layer's
 * backward exactly as one rank would (weight gradient scale 1: the mean over the ranks),
 * and multiplies the input gradients it returns by W (in f32 arithmetic, stored in the
 * activation dtype: a bf16 grad_x is rounded once by the layer and once more here). */
kt_status kt__moe_rank0_backward(const kt__op_call *c)
{
    rank0 d;
    batch b;
    kt_status st = exchange_rows(c, &d);
    if (st == KT_OK && d.rank == 0)
        st = batch_of(c, &d, &c->gout[0], &b);
    KT__TRY(kt_comm_agree(c->comm, st));
    const int root = d.rank == 0;
    KT__TRY(gather_rows(c, &d, &c->gout[0], root ? &b.y : NULL));
    int want_x = c->gin[0].data != NULL, want_w = c->gin[2].data != NULL;
    if (root) {
        kt_tensor gx = b.gx, gw = b.gw;
        if (!want_x)
            gx.data = NULL;
        if (!want_w)
            gw.data = NULL;
        float w = (float)d.world;
        kt__moe_scale_rows(c->pool, &b.y, 1.0f / w);
        st = kt_moe_backward(kt__moe_bound(c), &b.y, &gx, &gw, 1.0f);
        if (st == KT_OK && want_x)
            kt__moe_scale_rows(c->pool, &gx, w);
        if (st == KT_OK && want_w)
            kt__moe_scale_rows(c->pool, &gw, w);
    }
    KT__TRY(kt_comm_agree(c->comm, st));
    if (want_x)
        KT__TRY(scatter_rows(c, &d, root ? &b.gx : NULL, &c->gin[0]));
    if (want_w)
        KT__TRY(scatter_rows(c, &d, root ? &b.gw : NULL, &c->gin[2]));
    return KT_OK;
}
