/* moe over several ranks with expert parallelism: each rank holds a share of the layer's
 * experts, as a kt_moe of top_k 1 whose experts are the model's experts of the ids its config
 * names (kt_moe_config.expert_ids; without them, the ranks' layers hold consecutive ranges in
 * rank order). Each (token, slot) pair is one row for the owner of its expert:
 *
 *   forward   every rank counts its pairs per owner, the counts go round (all-gather of the
 *             W x W matrix), the agreed status decides whether to go on, the pairs travel
 *             (x row, the owner's local expert, the routing weight) by all-to-all-v in
 *             (token, slot) order, each owner runs its layer on what it received (sources in
 *             rank order), the pair outputs come back the same way and each token's output
 *             is the sum of its slots' outputs in slot order, in f32: deterministic, and
 *             whatever the ranks, an expert's rows are in the concatenated batch's order;
 *   backward  the output gradient of each pair goes to its owner, whose layer returns the
 *             pair's grad_x and routing-weight gradient; grad_x is summed per token at the
 *             origin in slot order. The experts' weight gradients stay with their owner:
 *             the mean over the ranks' losses, as in the rank-0 mode (moe_rank0.c explains
 *             the 1/W scaling and why it is applied to the output gradients).
 *
 * Ranks may bring different row counts. With bf16 activations each pair's output is rounded
 * to bf16 before the sum (one rounding more than a single layer does). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt/comm.h"
#include "lib/ops/moe_dist.h"
#include "lib/ops/op_util.h"

/* A pair's record going out: x row, local expert (i32), routing weight (f32); coming back
 * after backward: grad_x row and the weight's gradient. Forward's results are bare rows. */
static size_t rec_bytes(size_t row) { return (row + 8 + 7) / 8 * 8; }

size_t kt__moe_ep_scratch(const kt_tensor *in, int world)
{
    const size_t w = (size_t)world, pairs = (size_t)(in[1].shape[0] * in[1].shape[1]);
    const size_t rec = rec_bytes(kt__moe_row_bytes(&in[0]));
    return sizeof(int64_t) * w * w + 2 * sizeof(size_t) * w + sizeof(int32_t) * pairs * 2 +
           2 * pairs * rec + 2 * sizeof(float) * (size_t)in[0].shape[1] + 10 * 64;
}

size_t kt__moe_ep_rows_bytes(const kt_moe_config *cfg)
{
    const size_t n = (size_t)cfg->max_tokens;
    const size_t row = kt_dtype_size(cfg->act_dtype) * (size_t)cfg->hidden;
    /* received records, x, y / gy, gx, ids, w, gw, the records going back */
    return n * (2 * rec_bytes(row) + 3 * row + 12) + 10 * 64;
}

/* ---- the placement: which rank runs each of the layer's experts ------------------------------ */

static kt_status make_placement(const kt__op_call *c, kt__moe_placement *pl)
{
    const int world = kt_comm_size(c->comm), me = kt_comm_rank(c->comm);
    kt_moe *m = kt__moe_bound(c);
    const kt_moe_config *cfg = m ? kt_moe_get_config(m) : NULL;
    int64_t mine[3] = {cfg ? cfg->n_experts : 0, cfg ? cfg->hidden : 0,
                       cfg ? (int64_t)cfg->act_dtype : 0};
    int64_t all[3 * KT__MOE_MAX_RANKS];
    KT__TRY(kt_comm_all_gather(c->comm, mine, sizeof mine, all));
    int64_t total = 0, most = 1, first = 0;
    for (int r = 0; r < world; r++) {
        total += all[r * 3];
        first += r < me ? all[r * 3] : 0;
        most = all[r * 3] > most ? all[r * 3] : most;
    }
    /* every rank's global ids, padded to the largest share; every rank joins the second
     * gather whatever it finds wrong, and all of them see the same lists */
    int64_t *ids = calloc((size_t)world * (size_t)most, sizeof *ids);
    int64_t *mine_ids = calloc((size_t)most, sizeof *mine_ids);
    pl->owner = malloc((size_t)(total > 0 ? total : 1) * sizeof *pl->owner);
    pl->local = malloc((size_t)(total > 0 ? total : 1) * sizeof *pl->local);
    if (ids == NULL || mine_ids == NULL || pl->owner == NULL || pl->local == NULL) {
        free(ids), free(mine_ids);
        return kt__error(KT_ENOMEM, "moe: out of memory");
    }
    for (int64_t e = 0; e < mine[0]; e++)
        mine_ids[e] = cfg->expert_ids ? cfg->expert_ids[e] : first + e;
    kt_status st = kt_comm_all_gather(c->comm, mine_ids, sizeof *mine_ids * (size_t)most, ids);
    const int64_t h = c->in[0].shape[1];
    for (int r = 0; st == KT_OK && r < world; r++)
        if (all[r * 3] > 0 && (all[r * 3 + 1] != h || all[r * 3 + 2] != (int64_t)c->in[0].dtype))
            st = kt__error(KT_EINVAL, "moe: rank %d's share of MoE layer %d has H=%lld, act %s, "
                           "but rank %d's x is %s[..,%lld]", r, c->attrs->binding,
                           (long long)all[r * 3 + 1], kt_dtype_name((kt_dtype)all[r * 3 + 2]),
                           me, kt_dtype_name(c->in[0].dtype), (long long)h);
    if (st == KT_OK && total == 0)
        st = kt__error(KT_EINVAL, "moe: no rank holds experts of MoE layer %d (with expert "
                       "parallelism every rank gives its share in kt_session_options.moe_layers)",
                       c->attrs->binding);
    pl->n_experts = total;
    for (int64_t g = 0; g < total; g++)
        pl->owner[g] = -1;
    for (int r = 0; r < world && st == KT_OK; r++)
        for (int64_t e = 0; e < all[r * 3] && st == KT_OK; e++) {
            int64_t g = ids[r * most + e];
            if (g < 0 || g >= total)
                st = kt__error(KT_EINVAL, "moe: rank %d's share of MoE layer %d names expert "
                               "%lld, outside 0 to %lld (the ranks hold %lld experts in all)", r,
                               c->attrs->binding, (long long)g, (long long)total - 1,
                               (long long)total);
            else if (pl->owner[g] >= 0)
                st = kt__error(KT_EINVAL, "moe: expert %lld of MoE layer %d is held by rank %d "
                               "and by rank %d", (long long)g, c->attrs->binding, pl->owner[g], r);
            else {
                pl->owner[g] = r;
                pl->local[g] = (int32_t)e;
            }
        }
    free(ids);
    free(mine_ids);
    return st;
}

kt_status kt__moe_placement_of(const kt__op_call *c, kt__moe_placement **out)
{
    kt__moe_placement **slot = kt__moe_placement_slot(c->state, c->attrs->binding);
    if (slot == NULL)
        return kt__error(KT_EINVAL, "moe: no session state (run it in a session)");
    if (*slot != NULL) {
        *out = *slot;
        return KT_OK;
    }
    kt__moe_placement *pl = calloc(1, sizeof *pl);
    if (pl == NULL)
        return kt__error(KT_ENOMEM, "moe: out of memory");
    /* agreed: a rank that fails here must not leave the others in the next collective */
    kt_status st = kt_comm_agree(c->comm, make_placement(c, pl));
    if (st != KT_OK) {
        free(pl->owner), free(pl->local), free(pl);
        return st;
    }
    *slot = *out = pl;
    return KT_OK;
}

/* ---- routing the pairs ------------------------------------------------------------------------ */

typedef struct ep {
    int world, rank;
    kt__moe_placement *pl;
    int64_t *matrix;           /* [W][W]: pairs rank s sends rank o */
    size_t *send_b, *recv_b;   /* bytes per peer of the current exchange */
    int32_t *pos;              /* [T*k]: the pair's place in the send order */
    int32_t *local;            /* [T*k]: the owner's local expert of the pair */
    char *out, *back;          /* [T*k] records going out and coming back */
    float *acc, *tmp;          /* [H] each: a token's sum over its slots */
    int64_t pairs, received;   /* this rank's pairs; the pairs its experts run */
} ep;

static int64_t id_at(const kt_tensor *ids, int64_t i)
{
    return ids->dtype == KT_I32 ? ((const int32_t *)ids->data)[i]
                                : ((const int64_t *)ids->data)[i];
}

/* This rank's pairs, checked and counted per owner. */
static kt_status route_pairs(const kt__op_call *c, ep *d, int64_t *counts)
{
    const kt_tensor *ids = &c->in[1];
    const int64_t t = ids->shape[0], k = ids->shape[1];
    for (int r = 0; r < d->world; r++)
        counts[r] = 0;
    for (int64_t i = 0; i < t * k; i++) {
        int64_t g = id_at(ids, i);
        if (g < 0 || g >= d->pl->n_experts)
            return kt__error(KT_ERANGE, "moe: rank %d token %lld slot %lld: expert id %lld out "
                             "of range [0, %lld)", d->rank, (long long)(i / k),
                             (long long)(i % k), (long long)g, (long long)d->pl->n_experts);
        for (int64_t j = i - i % k; j < i; j++)
            if (id_at(ids, j) == g)
                return kt__error(KT_EINVAL, "moe: rank %d token %lld: expert %lld appears twice "
                                 "(slots %lld and %lld)", d->rank, (long long)(i / k),
                                 (long long)g, (long long)(j % k), (long long)(i % k));
        counts[d->pl->owner[g]]++;
    }
    /* stable by owner: the send order keeps (token, slot) order within each owner */
    int64_t start[KT__MOE_MAX_RANKS];
    for (int r = 0, at = 0; r < d->world; at += (int)counts[r], r++)
        start[r] = at;
    for (int64_t i = 0; i < t * k; i++) {
        int64_t g = id_at(ids, i);
        d->pos[i] = (int32_t)start[d->pl->owner[g]]++;
        d->local[i] = d->pl->local[g];
    }
    return KT_OK;
}

/* The count matrix goes round; each owner checks what it will receive against its layer. */
static kt_status setup(const kt__op_call *c, ep *d, kt_status st)
{
    d->world = kt_comm_size(c->comm);
    d->rank = kt_comm_rank(c->comm);
    d->pairs = c->in[1].shape[0] * c->in[1].shape[1];
    const size_t rec = rec_bytes(kt__moe_row_bytes(&c->in[0]));
    char *cursor = c->comm_scratch;
    d->matrix = (int64_t *)(void *)kt__moe_carve(&cursor, sizeof(int64_t) * (size_t)(d->world * d->world));
    d->send_b = (size_t *)(void *)kt__moe_carve(&cursor, sizeof(size_t) * (size_t)d->world);
    d->recv_b = (size_t *)(void *)kt__moe_carve(&cursor, sizeof(size_t) * (size_t)d->world);
    d->pos = (int32_t *)(void *)kt__moe_carve(&cursor, sizeof(int32_t) * (size_t)d->pairs);
    d->local = (int32_t *)(void *)kt__moe_carve(&cursor, sizeof(int32_t) * (size_t)d->pairs);
    d->out = kt__moe_carve(&cursor, rec * (size_t)d->pairs);
    d->back = kt__moe_carve(&cursor, rec * (size_t)d->pairs);
    d->acc = (float *)(void *)kt__moe_carve(&cursor, sizeof(float) * (size_t)c->in[0].shape[1]);
    d->tmp = (float *)(void *)kt__moe_carve(&cursor, sizeof(float) * (size_t)c->in[0].shape[1]);
    int64_t counts[KT__MOE_MAX_RANKS];
    if (st == KT_OK)
        st = route_pairs(c, d, counts);
    if (st != KT_OK)
        for (int r = 0; r < d->world; r++)
            counts[r] = 0;
    KT__TRY(kt_comm_all_gather(c->comm, counts, sizeof(int64_t) * (size_t)d->world, d->matrix));
    d->received = 0;
    for (int s = 0; s < d->world; s++)
        d->received += d->matrix[s * d->world + d->rank];
    kt_moe *m = kt__moe_bound(c);
    if (st == KT_OK && d->received > 0 &&
        (m == NULL || d->received > kt_moe_get_config(m)->max_tokens))
        st = kt__error(KT_ERANGE, "moe: rank %d's experts of MoE layer %d get %lld (token, "
                       "slot) pairs, more than its layer's max_tokens %lld", d->rank,
                       c->attrs->binding, (long long)d->received,
                       m ? (long long)kt_moe_get_config(m)->max_tokens : 0LL);
    return st;
}

/* Bytes per peer: what this rank sends each owner and gets from each source, in records of
 * `out_rec` bytes going out and `in_rec` coming in; `to_owner` 0 swaps the roles (results going
 * back to the origins). */
static void set_bytes(ep *d, size_t out_rec, size_t in_rec, int to_owner)
{
    for (int p = 0; p < d->world; p++) {
        int64_t mine_to_p = d->matrix[d->rank * d->world + p];
        int64_t p_to_mine = d->matrix[p * d->world + d->rank];
        d->send_b[p] = (size_t)(to_owner ? mine_to_p : p_to_mine) * out_rec;
        d->recv_b[p] = (size_t)(to_owner ? p_to_mine : mine_to_p) * in_rec;
    }
}

/* The owner's side: what it received, unpacked, and its layer's buffers. */
typedef struct owned {
    kt_tensor x, ids, w, y, gx, gw;
    char *in, *back;
} owned;

static kt_status owned_of(const kt__op_call *c, const ep *d, owned *o)
{
    const kt_tensor *x = &c->in[0];
    const size_t row = kt__moe_row_bytes(x), rec = rec_bytes(row), n = (size_t)d->received;
    char *cursor = NULL;
    KT__TRY(kt__moe_rows(c, n * (2 * rec + 3 * row + 12) + 10 * 64, &cursor));
    o->in = kt__moe_carve(&cursor, n * rec);
    o->back = kt__moe_carve(&cursor, n * rec);
    o->x = kt__moe_rows_like(x, d->received, &cursor);
    o->y = kt__moe_rows_like(x, d->received, &cursor);
    o->gx = kt__moe_rows_like(x, d->received, &cursor);
    const int64_t one[2] = {d->received, 1};
    (void)kt_tensor_init(&o->ids, kt__moe_carve(&cursor, n * 4), KT_I32, 2, one);
    (void)kt_tensor_init(&o->w, kt__moe_carve(&cursor, n * 4), KT_F32, 2, one);
    (void)kt_tensor_init(&o->gw, kt__moe_carve(&cursor, n * 4), KT_F32, 2, one);
    return KT_OK;
}

static kt_status exchange(const kt__op_call *c, ep *d, const void *send, void *recv)
{
    return kt_comm_all_to_all_v(c->comm, send, d->send_b, recv, d->recv_b);
}

static void load_row(float *dst, const char *src, kt_dtype dt, int64_t h)
{
    if (dt == KT_BF16)
        kt_bf16_to_f32(dst, (const uint16_t *)(const void *)src, (size_t)h);
    else
        memcpy(dst, src, (size_t)h * sizeof(float));
}

static void store_row(char *dst, const float *src, kt_dtype dt, int64_t h)
{
    if (dt == KT_BF16)
        kt_f32_to_bf16((uint16_t *)(void *)dst, src, (size_t)h);
    else
        memcpy(dst, src, (size_t)h * sizeof(float));
}

/* out[t] = sum over slots j of rows[pos[t*k+j]] (stride `stride` bytes), in f32 and slot
 * order. */
static void sum_slots(const ep *d, const char *rows, size_t stride, kt_tensor *out, int64_t k)
{
    float *acc = d->acc, *tmp = d->tmp;
    const int64_t t = out->shape[0], h = out->shape[1];
    const size_t row = kt__moe_row_bytes(out);
    for (int64_t i = 0; i < t; i++) {
        for (int64_t x = 0; x < h; x++)
            acc[x] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            load_row(tmp, rows + (size_t)d->pos[i * k + j] * stride, out->dtype, h);
            for (int64_t x = 0; x < h; x++)
                acc[x] += tmp[x];
        }
        store_row((char *)out->data + (size_t)i * row, acc, out->dtype, h);
    }
}

static kt_status begin(const kt__op_call *c, ep *d)
{
    if (c->comm_scratch == NULL)
        return kt__error(KT_EINVAL, "moe: no message buffers (run it in a session)");
    if (kt_comm_size(c->comm) > KT__MOE_MAX_RANKS)
        return kt__error(KT_EUNSUPPORTED, "moe: expert parallelism over %d ranks (at most %d)",
                         kt_comm_size(c->comm), KT__MOE_MAX_RANKS);
    KT__TRY(kt__moe_placement_of(c, &d->pl));
    return KT_OK;
}

/* The placement, the routing of this step's pairs and the owned rows' buffers, agreed by
 * every rank (a failure on one reaches all before any rows move). */
static kt_status prepare(const kt__op_call *c, ep *d, owned *o)
{
    KT__TRY(begin(c, d));
    kt_status st = setup(c, d, KT_OK);
    if (st == KT_OK)
        st = owned_of(c, d, o);
    return kt_comm_agree(c->comm, st);
}

kt_status kt__moe_ep_forward(const kt__op_call *c)
{
    ep d;
    owned o;
    KT__TRY(prepare(c, &d, &o));
    kt_status st = KT_OK;
    const kt_tensor *x = &c->in[0], *w = &c->in[2];
    const size_t row = kt__moe_row_bytes(x), rec = rec_bytes(row);
    const int64_t k = c->in[1].shape[1];
    for (int64_t i = 0; i < d.pairs; i++) {
        char *r = d.out + (size_t)d.pos[i] * rec;
        memcpy(r, (const char *)x->data + (size_t)(i / k) * row, row);
        memcpy(r + row, &d.local[i], 4);
        memcpy(r + row + 4, (const float *)w->data + i, 4);
    }
    set_bytes(&d, rec, rec, 1);
    KT__TRY(exchange(c, &d, d.out, o.in));
    for (int64_t i = 0; i < d.received; i++) {
        const char *r = o.in + (size_t)i * rec;
        memcpy((char *)o.x.data + (size_t)i * row, r, row);
        memcpy((int32_t *)o.ids.data + i, r + row, 4);
        memcpy((float *)o.w.data + i, r + row + 4, 4);
    }
    kt_moe *m = kt__moe_bound(c);
    if (m != NULL)
        st = kt_moe_forward(m, &o.x, &o.ids, &o.w, &o.y);
    KT__TRY(kt_comm_agree(c->comm, st));
    set_bytes(&d, row, row, 0);
    KT__TRY(exchange(c, &d, o.y.data, d.back));
    sum_slots(&d, d.back, row, &c->out_w[0], k);
    return KT_OK;
}

kt_status kt__moe_ep_backward(const kt__op_call *c)
{
    ep d;
    owned o;
    KT__TRY(prepare(c, &d, &o));
    kt_status st = KT_OK;
    const kt_tensor *gy = &c->gout[0];
    const size_t row = kt__moe_row_bytes(gy), rec = rec_bytes(row);
    const int64_t k = c->in[1].shape[1];
    for (int64_t i = 0; i < d.pairs; i++)
        memcpy(d.out + (size_t)d.pos[i] * row, (const char *)gy->data + (size_t)(i / k) * row,
               row);
    set_bytes(&d, row, row, 1);
    KT__TRY(exchange(c, &d, d.out, o.y.data));
    kt_moe *m = kt__moe_bound(c);
    if (m != NULL) {
        float w = (float)d.world;
        kt__moe_scale_rows(c->pool, &o.y, 1.0f / w);
        st = kt_moe_backward(m, &o.y, &o.gx, &o.gw, 1.0f);
        if (st == KT_OK) {
            kt__moe_scale_rows(c->pool, &o.gx, w);
            kt__moe_scale_rows(c->pool, &o.gw, w);
        }
    }
    KT__TRY(kt_comm_agree(c->comm, st));
    for (int64_t i = 0; i < d.received; i++) {
        char *r = o.back + (size_t)i * rec;
        memcpy(r, (const char *)o.gx.data + (size_t)i * row, row);
        memcpy(r + row, (const float *)o.gw.data + i, 4);
    }
    set_bytes(&d, rec, rec, 0);
    KT__TRY(exchange(c, &d, o.back, d.back));
    if (c->gin[2].data != NULL)
        for (int64_t i = 0; i < d.pairs; i++)
            memcpy((float *)c->gin[2].data + i, d.back + (size_t)d.pos[i] * rec + row, 4);
    if (c->gin[0].data != NULL)
        sum_slots(&d, d.back, rec, &c->gin[0], k);
    return KT_OK;
}
