/* halo: the context-parallel halo exchange, differentiable.
 *
 * A sequence is sharded along `dim` over the ranks of the session's communicator, rank r
 * holding frames [r*T, (r+1)*T). A temporal conv of width K needs K-1 frames before its shard
 * (causal) and maybe some after (bidirectional). Forward returns the shard with halo_left
 * frames of rank r-1 in front and halo_right frames of rank r+1 behind (zeros at the ends of
 * the whole sequence), so a `valid` conv on it equals the conv of the unsharded sequence.
 * Backward sends the halo parts of the output gradient back to the ranks they came from and
 * adds what it receives into its own gradient, in a fixed order.
 *
 * Two modes: point-to-point (each rank trades with its two neighbours: sendrecv twice) and
 * all-gather (every rank joins the same collectives and picks its neighbours' slabs: a
 * pattern independent of who is fast, for transports or debugging that want it). */
#include <string.h>

#include "kt/comm.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

#define TAG_LEFT 101  /* frames travelling to the next rank (its left halo) */
#define TAG_RIGHT 102 /* frames travelling to the previous rank (its right halo) */

/* The tensor seen as [outer, frames, inner bytes] around `dim`. */
typedef struct slab_geom {
    int64_t outer, frames, inner; /* inner in bytes */
} slab_geom;

static slab_geom geom(const kt_tensor *t, int dim)
{
    slab_geom g = {1, t->shape[dim], (int64_t)kt_dtype_size(t->dtype)};
    for (int d = 0; d < dim; d++)
        g.outer *= t->shape[d];
    for (int d = dim + 1; d < t->ndim; d++)
        g.inner *= t->shape[d];
    return g;
}

/* Copies frames [f0, f0+n) of a [outer, frames, inner] tensor to/from a packed slab. */
static void pack(const slab_geom *g, const void *t, int64_t f0, int64_t n, void *slab)
{
    for (int64_t o = 0; o < g->outer; o++)
        memcpy((char *)slab + o * n * g->inner,
               (const char *)t + (o * g->frames + f0) * g->inner, (size_t)(n * g->inner));
}

static void unpack(const slab_geom *g, void *t, int64_t f0, int64_t n, const void *slab)
{
    for (int64_t o = 0; o < g->outer; o++)
        memcpy((char *)t + (o * g->frames + f0) * g->inner,
               (const char *)slab + o * n * g->inner, (size_t)(n * g->inner));
}

static kt_status infer_halo(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    const kt_tensor *x = &in[0];
    KT__TRY(kt__check_rank("halo", "x", x, 1, KT_MAX_DIMS));
    KT__TRY(kt__check_float("halo", "x", x));
    if (at->dim < 0 || at->dim >= x->ndim)
        return kt__error(KT_EINVAL, "halo: dim %d outside 0..%d", at->dim, x->ndim - 1);
    if (at->halo_left < 0 || at->halo_right < 0 || at->halo_left > x->shape[at->dim] ||
        at->halo_right > x->shape[at->dim])
        return kt__error(KT_EINVAL, "halo: halos of %lld and %lld frames do not fit a shard of "
                         "%lld frames (a halo comes from one neighbour)",
                         (long long)at->halo_left, (long long)at->halo_right,
                         (long long)x->shape[at->dim]);
    if (at->halo_mode != KT_HALO_P2P && at->halo_mode != KT_HALO_ALLGATHER)
        return kt__error(KT_EINVAL, "halo: unknown mode %d", (int)at->halo_mode);
    int64_t shape[KT_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++)
        shape[d] = x->shape[d];
    shape[at->dim] += at->halo_left + at->halo_right;
    kt__shape_out(&out[0], x->dtype, x->ndim, shape);
    return KT_OK;
}

/* p2p: two slabs out, two in. all-gather: every rank's two slabs. */
static size_t comm_scratch_halo(const kt_op_attrs *at, const kt_tensor *in, int n, int world)
{
    (void)n;
    if (world <= 1)
        return 0; /* one rank: the kernels pad with zeros and need no message buffer */
    slab_geom g = geom(&in[0], at->dim);
    size_t slab = (size_t)(g.outer * g.inner), per = slab * (size_t)(at->halo_left + at->halo_right);
    /* send and receive slabs, then (all-gather) every rank's and this rank's contribution */
    return at->halo_mode == KT_HALO_ALLGATHER ? per * (size_t)(world + 3) : 2 * per;
}

/* The neighbours' slabs: from_prev receives rank r-1's last `left` frames, from_next rank
 * r+1's first `right` frames (zeros where there is no neighbour). `send_next` holds this
 * rank's last `left` frames, `send_prev` its first `right` frames. */
static kt_status trade(const kt__op_call *c, const void *send_next, const void *send_prev,
                       void *from_prev, void *from_next, size_t left_bytes, size_t right_bytes,
                       char *gather_buf)
{
    kt_comm *comm = c->comm;
    int world = comm ? kt_comm_size(comm) : 1, r = comm ? kt_comm_rank(comm) : 0;
    int prev = r > 0 ? r - 1 : -1, next = r + 1 < world ? r + 1 : -1;
    if (world == 1) {
        memset(from_prev, 0, left_bytes);
        memset(from_next, 0, right_bytes);
        return KT_OK;
    }
    if (c->attrs->halo_mode == KT_HALO_P2P) {
        KT__TRY(kt_comm_sendrecv(comm, next, send_next, next >= 0 ? left_bytes : 0, prev,
                                 from_prev, prev >= 0 ? left_bytes : 0, TAG_LEFT));
        KT__TRY(kt_comm_sendrecv(comm, prev, send_prev, prev >= 0 ? right_bytes : 0, next,
                                 from_next, next >= 0 ? right_bytes : 0, TAG_RIGHT));
    } else {
        /* each rank contributes [its last left frames | its first right frames] */
        size_t per = left_bytes + right_bytes;
        char *mine = gather_buf + (size_t)world * per;
        memcpy(mine, send_next, left_bytes);
        memcpy(mine + left_bytes, send_prev, right_bytes);
        KT__TRY(kt_comm_all_gather(comm, mine, per, gather_buf));
        if (prev >= 0)
            memcpy(from_prev, gather_buf + (size_t)prev * per, left_bytes);
        if (next >= 0)
            memcpy(from_next, gather_buf + (size_t)next * per + left_bytes, right_bytes);
    }
    if (prev < 0)
        memset(from_prev, 0, left_bytes);
    if (next < 0)
        memset(from_next, 0, right_bytes);
    return KT_OK;
}

static kt_status fwd_halo(const kt__op_call *c)
{
    const kt_op_attrs *at = c->attrs;
    const slab_geom gx = geom(&c->in[0], at->dim), gy = geom(&c->out[0], at->dim);
    const int64_t L = at->halo_left, R = at->halo_right, T = gx.frames;
    size_t frame = (size_t)(gx.outer * gx.inner);
    char *buf = c->comm_scratch;
    char *send_next = buf, *send_prev = buf + L * frame, *from_prev = send_prev + R * frame;
    char *from_next = from_prev + L * frame, *gather = from_next + R * frame;
    if (L + R > 0 && c->comm != NULL && kt_comm_size(c->comm) > 1 && buf == NULL)
        return kt__error(KT_EINVAL, "halo: no message buffer (run it in a session)");
    if (buf == NULL || L + R == 0) { /* one rank, or nothing to trade */
        for (int64_t o = 0; o < gy.outer; o++) {
            char *row = (char *)c->out_w[0].data + o * gy.frames * gy.inner;
            memset(row, 0, (size_t)(L * gy.inner));
            memcpy(row + L * gy.inner, (const char *)c->in[0].data + o * T * gx.inner,
                   (size_t)(T * gx.inner));
            memset(row + (L + T) * gy.inner, 0, (size_t)(R * gy.inner));
        }
        return KT_OK;
    }
    pack(&gx, c->in[0].data, T - L, L, send_next);
    pack(&gx, c->in[0].data, 0, R, send_prev);
    KT__TRY(trade(c, send_next, send_prev, from_prev, from_next, L * frame, R * frame, gather));
    unpack(&gy, c->out_w[0].data, 0, L, from_prev);
    for (int64_t o = 0; o < gy.outer; o++)
        memcpy((char *)c->out_w[0].data + (o * gy.frames + L) * gy.inner,
               (const char *)c->in[0].data + o * T * gx.inner, (size_t)(T * gx.inner));
    unpack(&gy, c->out_w[0].data, L + T, R, from_next);
    return KT_OK;
}

/* dst[frames f0..f0+n) += slab, in f32 (any float dtype) */
static void add_slab(const slab_geom *g, kt_tensor *dst, int64_t f0, int64_t n, const void *slab)
{
    size_t es = kt_dtype_size(dst->dtype);
    int64_t per_frame = g->inner / (int64_t)es;
    kt_tensor src = *dst, view = *dst;
    float a[KT__CHUNK], b[KT__CHUNK], o[KT__CHUNK];
    for (int64_t r = 0; r < g->outer; r++) {
        int64_t count = n * per_frame, base = (r * g->frames + f0) * per_frame;
        src.data = (char *)slab + (size_t)(r * n * per_frame) * es;
        view.data = dst->data;
        for (int64_t i = 0; i < count; i += KT__CHUNK) {
            int64_t m = count - i < KT__CHUNK ? count - i : KT__CHUNK;
            const float *x = kt__load_f32(&view, base + i, m, a);
            const float *y = kt__load_f32(&src, i, m, b);
            float *z = kt__store_ptr(&view, base + i, o);
            for (int64_t k = 0; k < m; k++)
                z[k] = x[k] + y[k];
            kt__store_commit(&view, base + i, m, o);
        }
    }
}

static kt_status bwd_halo(const kt__op_call *c)
{
    const kt_op_attrs *at = c->attrs;
    kt_tensor *gx = &c->gin[0];
    const slab_geom sx = geom(&c->in[0], at->dim), sy = geom(&c->gout[0], at->dim);
    const int64_t L = at->halo_left, R = at->halo_right, T = sx.frames;
    if (gx->data == NULL)
        return KT_OK;
    /* the shard's own part of the gradient */
    for (int64_t o = 0; o < sx.outer; o++)
        memcpy((char *)gx->data + o * T * sx.inner,
               (const char *)c->gout[0].data + (o * sy.frames + L) * sy.inner,
               (size_t)(T * sx.inner));
    char *buf = c->comm_scratch;
    if (buf == NULL || L + R == 0)
        return KT_OK; /* one rank (the halos were zeros) or no halo: nothing goes anywhere */
    size_t frame = (size_t)(sx.outer * sx.inner);
    /* the left halo's gradient goes back to the previous rank (its last L frames), the
     * right halo's to the next rank (its first R frames) */
    char *to_prev = buf, *to_next = buf + L * frame, *from_next = to_next + R * frame;
    char *from_prev = from_next + L * frame, *gather = from_prev + R * frame;
    pack(&sy, c->gout[0].data, 0, L, to_prev);
    pack(&sy, c->gout[0].data, L + T, R, to_next);
    /* roles mirror the forward: what went to `next` as a left halo comes back from it */
    KT__TRY(trade(c, to_next, to_prev, from_prev, from_next, R * frame, L * frame, gather));
    /* from_next: the next rank's left-halo gradient = my last L frames; from_prev: the
     * previous rank's right-halo gradient = my first R frames. Fixed order: right, then left. */
    add_slab(&sx, gx, T - L, L, from_next);
    add_slab(&sx, gx, 0, R, from_prev);
    return KT_OK;
}

static const char *const halo_modes[] = {"p2p", "allgather"}; /* kt_halo_mode order */
_Static_assert(sizeof(kt_halo_mode) == sizeof(int), "an enum attribute is stored as an int");
static const kt__attr_desc halo_attrs[] = {
    KT__A_INT("dim", dim, 0, 0, KT_MAX_DIMS - 1, "the sharded dimension"),
    KT__A_I64("left", halo_left, 0, 0, INT64_MAX, "frames from the previous rank"),
    KT__A_I64("right", halo_right, 0, 0, INT64_MAX, "frames from the next rank"),
    KT__A_ENUM("mode", halo_mode, KT_HALO_P2P, halo_modes,
               "the exchange (kt_halo_mode)"),
};

const kt__op_desc kt__op_halo = {
    .name = "halo", .min_in = 1, .max_in = 1, .n_out = 1, .infer = infer_halo,
    .comm_scratch = comm_scratch_halo, .forward = fwd_halo, .backward = bwd_halo,
    KT__ATTR_LIST(halo_attrs)};
