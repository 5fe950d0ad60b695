/* cp_attention: causal attention over a sequence sharded along time over the ranks of the
 * session's communicator (context parallelism, as Llama 3 trains long contexts).
 *
 * The whole sequence is cut into 2W chunks of C = T/2 positions (T: the local length). In
 * the balanced layout rank r holds chunks r and 2W-1-r (an early one and a late one, so every
 * rank sees the same number of causal query-key pairs); in the contiguous layout chunks 2r
 * and 2r+1 (frames [rT, (r+1)T), as halo shards). q, k, v and segments are those two chunks
 * concatenated along time.
 *
 * Forward: one all-gather brings every rank's K, V (and segments) to every rank; they are
 * put in global order, and each local query chunk of global index g runs the single-rank
 * attention kernels on the key prefix [0, (g+1)C): the end-aligned causal mask on that prefix
 * is exactly the global causal mask, and window and segment ids keep their meaning.
 *
 * Backward re-gathers K and V (nothing of the forward's gather is kept), recomputes each
 * chunk from its saved lse, sums each chunk's dK and dV of the prefix (f32, in a fixed order)
 * into a buffer laid out by owner rank, and kt_comm_reduce_scatter sums those over the ranks
 * (in rank order) and hands every rank the gradients of its own chunks. dq never leaves the
 * rank. With no communicator (or one rank) the same path runs on the local sequence, which
 * is then the whole one: the op is plain causal attention. */
#include <float.h>
#include <stdio.h>
#include <string.h>

#include "kt/comm.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

/* ---- geometry --------------------------------------------------------------------------- */

typedef struct cp_geom {
    int world, rank;
    int64_t B, T, C, Hq, Hkv, D, Dv, S; /* S: the whole sequence, W * T */
    size_t es, is;                      /* bytes of a q/k/v element, of a segment id (0: none) */
    size_t block;                       /* one rank's gathered bytes: K, V, segments */
} cp_geom;

static cp_geom geom_of(const kt_tensor *in, int n_in, int world, int rank)
{
    cp_geom g;
    g.world = world, g.rank = rank;
    g.B = in[0].shape[0], g.T = in[0].shape[1], g.C = g.T / 2, g.Hq = in[0].shape[2];
    g.D = in[0].shape[3], g.Hkv = in[1].shape[2], g.Dv = in[2].shape[3];
    g.S = (int64_t)world * g.T;
    g.es = kt_dtype_size(in[0].dtype);
    g.is = n_in == 4 ? kt_dtype_size(in[3].dtype) : 0;
    g.block = (size_t)(g.B * g.T) * ((size_t)(g.Hkv * (g.D + g.Dv)) * g.es + g.is);
    return g;
}

/* The global chunk that local chunk c (0 or 1) of rank r holds. */
static int64_t chunk_of(kt_cp_layout layout, int world, int r, int c)
{
    if (layout == KT_CP_CONTIGUOUS)
        return 2 * (int64_t)r + c;
    return c == 0 ? r : 2 * (int64_t)world - 1 - r;
}

static size_t al64(size_t n) { return (n + 63) & ~(size_t)63; }

/* One chunk's call of the single-rank op: q [1, C, Hq, D] against keys [1, S, Hkv, .]. */
static void chunk_shapes(const cp_geom *g, const kt_tensor *in, int n_in, kt_tensor *call_in)
{
    kt_dtype dt = in[0].dtype;
    kt_tensor_init(&call_in[0], NULL, dt, 4, (const int64_t[]){1, g->C, g->Hq, g->D});
    kt_tensor_init(&call_in[1], NULL, dt, 4, (const int64_t[]){1, g->S, g->Hkv, g->D});
    kt_tensor_init(&call_in[2], NULL, dt, 4, (const int64_t[]){1, g->S, g->Hkv, g->Dv});
    if (n_in == 4)
        kt_tensor_init(&call_in[3], NULL, in[3].dtype, 2, (const int64_t[]){1, g->S});
}

/* The work buffer, carved in this order (each part 64-byte aligned). */
typedef struct cp_bufs {
    char *mine, *gathered;  /* this rank's block, every rank's (rank order) */
    char *k, *v, *seg;      /* the whole sequence in global order [B, S, ...] */
    float *lse, *glse;      /* one chunk's [Hq, C] */
    float *dk, *dv;         /* one chunk's prefix gradients [S, Hkv, .] (backward) */
    float *red;             /* by owner rank: [dK of its B x T | dV] (backward) */
    float *mine_grad;       /* this rank's reduced [dK | dV] */
    void *attn_scratch;     /* the single-rank backward's scratch */
    size_t attn_scratch_bytes;
} cp_bufs;

static size_t carve(const cp_geom *g, const kt_op_attrs *at, const kt_tensor *in, int n_in,
                    int backward, char *base, cp_bufs *b)
{
    size_t off = 0;
    const size_t kv = (size_t)(g->B * g->S * g->Hkv);
    const size_t red = (size_t)(g->B * g->T * g->Hkv * (g->D + g->Dv));
#define CP_TAKE(ptr, type, bytes)                                                            \
    do {                                                                                      \
        if (base)                                                                             \
            (ptr) = (type)(base + off);                                                       \
        off += al64(bytes);                                                                   \
    } while (0)
    memset(b, 0, sizeof *b);
    CP_TAKE(b->mine, char *, g->block);
    CP_TAKE(b->gathered, char *, g->block * (size_t)g->world);
    CP_TAKE(b->k, char *, kv * (size_t)g->D * g->es);
    CP_TAKE(b->v, char *, kv * (size_t)g->Dv * g->es);
    CP_TAKE(b->seg, char *, (size_t)(g->B * g->S) * g->is);
    CP_TAKE(b->lse, float *, (size_t)(g->Hq * g->C) * sizeof(float));
    CP_TAKE(b->glse, float *, (size_t)(g->Hq * g->C) * sizeof(float));
    if (backward) {
        kt_tensor ci[4];
        chunk_shapes(g, in, n_in, ci);
        b->attn_scratch_bytes = kt__op_attention.scratch_bwd(at, ci, n_in);
        CP_TAKE(b->dk, float *, (size_t)(g->S * g->Hkv * g->D) * sizeof(float));
        CP_TAKE(b->dv, float *, (size_t)(g->S * g->Hkv * g->Dv) * sizeof(float));
        CP_TAKE(b->red, float *, red * (size_t)g->world * sizeof(float));
        CP_TAKE(b->mine_grad, float *, red * sizeof(float));
        CP_TAKE(b->attn_scratch, void *, b->attn_scratch_bytes);
    }
#undef CP_TAKE
    return off;
}

/* ---- shapes ------------------------------------------------------------------------------ */

static kt_status infer_cp_attention(const kt_op_attrs *at, const kt_tensor *in, int n,
                                    kt_tensor *out)
{
    const char *op = "cp_attention";
    const kt_tensor *q = &in[0], *k = &in[1], *v = &in[2];
    KT__TRY(kt__check_float(op, "q", q));
    KT__TRY(kt__check_rank(op, "q", q, 4, 4));
    KT__TRY(kt__check_same_dtype(op, "k", k, q));
    KT__TRY(kt__check_rank(op, "k", k, 4, 4));
    KT__TRY(kt__check_same_dtype(op, "v", v, q));
    KT__TRY(kt__check_rank(op, "v", v, 4, 4));
    const int64_t B = q->shape[0], T = q->shape[1];
    KT__TRY(kt__check_dim(op, "k (batch)", k, 0, B));
    KT__TRY(kt__check_dim(op, "k (time, as q's: the same shard)", k, 1, T));
    KT__TRY(kt__check_dim(op, "v (batch)", v, 0, B));
    KT__TRY(kt__check_dim(op, "v (time, as q's: the same shard)", v, 1, T));
    if (T % 2 != 0)
        return kt__error(KT_EINVAL, "cp_attention: q: the shard's %lld positions must be even "
                         "(two chunks of the sequence)", (long long)T);
    if (n == 4) {
        KT__TRY(kt__check_index(op, "segments", &in[3]));
        KT__TRY(kt__check_rank(op, "segments", &in[3], 2, 2));
        KT__TRY(kt__check_dim(op, "segments (batch)", &in[3], 0, B));
        KT__TRY(kt__check_dim(op, "segments (time, as q's)", &in[3], 1, T));
    }
    if (at->cp_layout != KT_CP_BALANCED && at->cp_layout != KT_CP_CONTIGUOUS)
        return kt__error(KT_EINVAL, "cp_attention: unknown layout %d", (int)at->cp_layout);
    /* the rest (heads, head dims) as the single-rank op checks them */
    kt_status st = kt__op_attention.infer(at, in, n, out);
    if (st != KT_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", kt_last_error());
        return kt__error(st, "cp_attention: %s", why);
    }
    return KT_OK;
}

/* The single-rank kernels see causal attention with this op's scale, window and softcap. */
static kt_op_attrs attn_attrs(const kt_op_attrs *at)
{
    kt_op_attrs a = *at;
    a.attn_causal = 1;
    return a;
}

static size_t scratch_cp(const kt_op_attrs *at, const kt_tensor *in, int n, int backward)
{
    cp_geom g = geom_of(in, n, 1, 0);
    cp_bufs b;
    kt_op_attrs a = attn_attrs(at);
    return carve(&g, &a, in, n, backward, NULL, &b);
}

static size_t scratch_fwd_cp(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    return scratch_cp(at, in, n, 0);
}

static size_t scratch_bwd_cp(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    return scratch_cp(at, in, n, 1);
}

/* Sized for the backward (the larger); forward and backward steps each get one. */
static size_t comm_scratch_cp(const kt_op_attrs *at, const kt_tensor *in, int n, int world)
{
    if (world <= 1)
        return 0; /* one rank: the op's scratch serves */
    cp_geom g = geom_of(in, n, world, 0);
    cp_bufs b;
    kt_op_attrs a = attn_attrs(at);
    return carve(&g, &a, in, n, 1, NULL, &b);
}

/* ---- the gather ---------------------------------------------------------------------------- */

/* The call's geometry and buffers: the message buffer with several ranks, else scratch. */
static kt_status setup(const kt__op_call *c, const kt_op_attrs *a, int backward, cp_geom *g,
                       cp_bufs *b)
{
    const int world = c->comm ? kt_comm_size(c->comm) : 1;
    const int rank = c->comm ? kt_comm_rank(c->comm) : 0;
    *g = geom_of(c->in, c->n_in, world, rank);
    char *base = world > 1 ? c->comm_scratch : c->scratch;
    size_t have = world > 1 ? c->comm_scratch_bytes : c->scratch_bytes;
    size_t need = carve(g, a, c->in, c->n_in, backward, NULL, b);
    if (base == NULL || have < need)
        return kt__error(KT_EINVAL, "cp_attention: rank %d: needs %zu bytes of %s, %zu given "
                         "(run it in a session)", rank, need,
                         world > 1 ? "message buffer" : "scratch", base ? have : 0);
    carve(g, a, c->in, c->n_in, backward, base, b);
    return KT_OK;
}

/* Every rank's K, V and segments, in global order in b->k, b->v, b->seg. */
static kt_status gather_kv(const kt__op_call *c, const cp_geom *g, const cp_bufs *b)
{
    const size_t kb = (size_t)(g->B * g->T * g->Hkv * g->D) * g->es;
    const size_t vb = (size_t)(g->B * g->T * g->Hkv * g->Dv) * g->es;
    memcpy(b->mine, c->in[1].data, kb);
    memcpy(b->mine + kb, c->in[2].data, vb);
    if (g->is)
        memcpy(b->mine + kb + vb, c->in[3].data, (size_t)(g->B * g->T) * g->is);
    if (g->world > 1)
        KT__TRY(kt_comm_all_gather(c->comm, b->mine, g->block, b->gathered));
    else
        memcpy(b->gathered, b->mine, g->block);
    /* rows of one (batch, chunk): C positions of each tensor, contiguous */
    const size_t krow = (size_t)(g->C * g->Hkv * g->D) * g->es;
    const size_t vrow = (size_t)(g->C * g->Hkv * g->Dv) * g->es;
    const size_t srow = (size_t)g->C * g->is;
    for (int p = 0; p < g->world; p++) {
        const char *blk = b->gathered + (size_t)p * g->block;
        for (int ch = 0; ch < 2; ch++) {
            const int64_t gc = chunk_of(c->attrs->cp_layout, g->world, p, ch);
            for (int64_t bb = 0; bb < g->B; bb++) {
                const size_t src = (size_t)(bb * 2 + ch), dst = (size_t)(bb * 2 * g->world + gc);
                memcpy(b->k + dst * krow, blk + src * krow, krow);
                memcpy(b->v + dst * vrow, blk + kb + src * vrow, vrow);
                if (g->is)
                    memcpy(b->seg + dst * srow, blk + kb + vb + src * srow, srow);
            }
        }
    }
    return KT_OK;
}

/* The tensors of one chunk's single-rank call: local query chunk ch of batch bb against the
 * key prefix of its global chunk gc. */
static void chunk_call(const kt__op_call *c, const cp_geom *g, const cp_bufs *b, int64_t bb,
                       int ch, int64_t gc, kt_tensor *ci)
{
    const kt_dtype dt = c->in[0].dtype;
    const int64_t prefix = (gc + 1) * g->C;
    kt_tensor_init(&ci[0],
                   (char *)c->in[0].data + (size_t)((bb * g->T + ch * g->C) * g->Hq * g->D) * g->es,
                   dt, 4, (const int64_t[]){1, g->C, g->Hq, g->D});
    kt_tensor_init(&ci[1], b->k + (size_t)(bb * g->S * g->Hkv * g->D) * g->es, dt, 4,
                   (const int64_t[]){1, prefix, g->Hkv, g->D});
    kt_tensor_init(&ci[2], b->v + (size_t)(bb * g->S * g->Hkv * g->Dv) * g->es, dt, 4,
                   (const int64_t[]){1, prefix, g->Hkv, g->Dv});
    if (c->n_in == 4)
        kt_tensor_init(&ci[3], b->seg + (size_t)(bb * g->S) * g->is, c->in[3].dtype, 2,
                       (const int64_t[]){1, prefix});
}

/* o (or its gradient) rows of (bb, ch) are contiguous; lse [B, Hq, T] goes through the
 * [Hq, C] buffer lse_buf. */
static void chunk_outputs(const cp_geom *g, const kt_tensor *o, float *lse_buf, int64_t bb,
                          int ch, kt_tensor *co)
{
    kt_tensor_init(&co[0], (char *)o->data +
                               (size_t)((bb * g->T + ch * g->C) * g->Hq * g->Dv) * g->es,
                   o->dtype, 4, (const int64_t[]){1, g->C, g->Hq, g->Dv});
    kt_tensor_init(&co[1], lse_buf, KT_F32, 3, (const int64_t[]){1, g->Hq, g->C});
}

static void lse_copy(const cp_geom *g, float *full, float *chunk, int64_t bb, int ch,
                     int to_full)
{
    for (int64_t h = 0; h < g->Hq; h++) {
        float *row = full + (bb * g->Hq + h) * g->T + ch * g->C;
        if (to_full)
            memcpy(row, chunk + h * g->C, (size_t)g->C * sizeof(float));
        else
            memcpy(chunk + h * g->C, row, (size_t)g->C * sizeof(float));
    }
}

/* ---- forward ------------------------------------------------------------------------------- */

static kt_status fwd_cp_attention(const kt__op_call *c)
{
    const kt_op_attrs a = attn_attrs(c->attrs);
    cp_geom g;
    cp_bufs b;
    KT__TRY(setup(c, &a, 0, &g, &b));
    KT__TRY(gather_kv(c, &g, &b));
    for (int64_t bb = 0; bb < g.B; bb++)
        for (int ch = 0; ch < 2; ch++) {
            const int64_t gc = chunk_of(c->attrs->cp_layout, g.world, g.rank, ch);
            kt_tensor ci[4], co[2];
            chunk_call(c, &g, &b, bb, ch, gc, ci);
            chunk_outputs(&g, &c->out[0], b.lse, bb, ch, co);
            kt__op_call call = {.attrs = &a, .in = ci, .n_in = c->n_in, .out = co, .out_w = co,
                                .n_out = 2, .pool = c->pool};
            KT__TRY(kt__op_attention.forward(&call));
            lse_copy(&g, c->out_w[1].data, b.lse, bb, ch, 1);
        }
    return KT_OK;
}

/* ---- backward ------------------------------------------------------------------------------ */

/* red (by owner) += one chunk call's prefix gradients of batch bb: key chunk kc of the prefix
 * belongs to the rank and local chunk that hold it. */
static void add_prefix(const kt__op_call *c, const cp_geom *g, const cp_bufs *b, int64_t bb,
                       int64_t prefix_chunks)
{
    const int64_t kr = g->C * g->Hkv * g->D, vr = g->C * g->Hkv * g->Dv; /* floats a chunk */
    const int64_t per_rank = g->B * g->T * g->Hkv * (g->D + g->Dv);
    const int64_t k_part = g->B * g->T * g->Hkv * g->D;
    for (int p = 0; p < g->world; p++)
        for (int ch = 0; ch < 2; ch++) {
            const int64_t kc = chunk_of(c->attrs->cp_layout, g->world, p, ch);
            if (kc >= prefix_chunks)
                continue;
            float *dk = b->red + p * per_rank + (bb * 2 + ch) * kr;
            float *dv = b->red + p * per_rank + k_part + (bb * 2 + ch) * vr;
            const float *sk = b->dk + kc * kr, *sv = b->dv + kc * vr;
            for (int64_t i = 0; i < kr; i++)
                dk[i] += sk[i];
            for (int64_t i = 0; i < vr; i++)
                dv[i] += sv[i];
        }
}

/* f32 values into a gradient tensor of any float dtype */
static void store_grad(kt_tensor *t, const float *src)
{
    const int64_t n = kt_tensor_numel(t);
    float buf[KT__CHUNK];
    for (int64_t i = 0; i < n; i += KT__CHUNK) {
        const int64_t m = n - i < KT__CHUNK ? n - i : KT__CHUNK;
        float *dst = kt__store_ptr(t, i, buf);
        memcpy(dst, src + i, (size_t)m * sizeof *dst);
        kt__store_commit(t, i, m, buf);
    }
}

static kt_status bwd_cp_attention(const kt__op_call *c)
{
    const kt_op_attrs a = attn_attrs(c->attrs);
    cp_geom g;
    cp_bufs b;
    KT__TRY(setup(c, &a, 1, &g, &b));
    KT__TRY(gather_kv(c, &g, &b));
    const int64_t per_rank = g.B * g.T * g.Hkv * (g.D + g.Dv);
    memset(b.red, 0, (size_t)(per_rank * g.world) * sizeof(float));
    for (int64_t bb = 0; bb < g.B; bb++)
        for (int ch = 0; ch < 2; ch++) {
            const int64_t gc = chunk_of(c->attrs->cp_layout, g.world, g.rank, ch);
            const int64_t prefix = (gc + 1) * g.C;
            kt_tensor ci[4], co[2], go[2], gi[4];
            chunk_call(c, &g, &b, bb, ch, gc, ci);
            chunk_outputs(&g, &c->out[0], b.lse, bb, ch, co);
            lse_copy(&g, (float *)c->out[1].data, b.lse, bb, ch, 0);
            chunk_outputs(&g, &c->gout[0], b.glse, bb, ch, go);
            if (c->gout[1].data)
                lse_copy(&g, (float *)c->gout[1].data, b.glse, bb, ch, 0);
            else
                memset(b.glse, 0, (size_t)(g.Hq * g.C) * sizeof(float));
            gi[0] = ci[0];
            gi[0].data = c->gin[0].data == NULL ? NULL
                         : (char *)c->gin[0].data +
                               (size_t)((bb * g.T + ch * g.C) * g.Hq * g.D) * g.es;
            gi[0].dtype = c->gin[0].dtype;
            /* f32 prefix gradients: the kernels follow the gradient tensor's dtype */
            kt_tensor_init(&gi[1], b.dk, KT_F32, 4, (const int64_t[]){1, prefix, g.Hkv, g.D});
            kt_tensor_init(&gi[2], b.dv, KT_F32, 4, (const int64_t[]){1, prefix, g.Hkv, g.Dv});
            if (c->n_in == 4)
                gi[3] = ci[3], gi[3].data = NULL;
            kt__op_call call = {.attrs = &a, .in = ci, .n_in = c->n_in, .out = co, .n_out = 2,
                                .gout = go, .gin = gi, .pool = c->pool,
                                .scratch = b.attn_scratch,
                                .scratch_bytes = b.attn_scratch_bytes};
            KT__TRY(kt__op_attention.backward(&call));
            add_prefix(c, &g, &b, bb, gc + 1);
        }
    float *mine = b.red + (int64_t)g.rank * per_rank;
    if (g.world > 1) {
        KT__TRY(kt_comm_reduce_scatter(c->comm, b.red, b.mine_grad, (size_t)per_rank, KT_F32,
                                       KT_REDUCE_SUM));
        mine = b.mine_grad;
    }
    if (c->gin[1].data)
        store_grad(&c->gin[1], mine);
    if (c->gin[2].data)
        store_grad(&c->gin[2], mine + g.B * g.T * g.Hkv * g.D);
    return KT_OK;
}

/* ---- the row ------------------------------------------------------------------------------- */

/* The causal pairs of the shard's queries, as if the shard were the whole sequence (the
 * world size is not known here): 2 (D + Dv) per pair, batch and head. */
static double flops_cp_attention(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    (void)at, (void)n;
    const double T = (double)in[0].shape[1], D = (double)in[0].shape[3];
    const double Dv = (double)in[2].shape[3], BH = (double)(in[0].shape[0] * in[0].shape[2]);
    return 2.0 * (D + Dv) * T * (T + 1) / 2 * BH;
}

static const char *const cp_layouts[] = {"balanced", "contiguous"}; /* kt_cp_layout order */
_Static_assert(sizeof(kt_cp_layout) == sizeof(int), "an enum attribute is stored as an int");
static const kt__attr_desc cp_attention_attrs[] = {
    KT__A_FLOAT("scale", attn_scale, 0.0, 0.0, FLT_MAX, "multiplies q.k (0: 1/sqrt(D))"),
    KT__A_I64("window", attn_window, 0, 0, INT64_MAX,
              "query at global position p sees key j only if p - j < window (0: no limit)"),
    KT__A_FLOAT("softcap", attn_softcap, 0.0, 0.0, FLT_MAX,
                "scores become softcap tanh(s / softcap) (0: not capped)"),
    KT__A_ENUM("layout", cp_layout, KT_CP_BALANCED, cp_layouts,
               "which chunks of 2W a rank holds: r and 2W-1-r, or 2r and 2r+1 (kt_cp_layout)"),
};

const kt__op_desc kt__op_cp_attention = {
    .name = "cp_attention", .min_in = 3, .max_in = 4, .n_out = 2,
    .bwd_reads_in = 0xfu, .bwd_reads_out = 3u, .no_grad_in = 1u << 3,
    .infer = infer_cp_attention, .scratch_fwd = scratch_fwd_cp, .scratch_bwd = scratch_bwd_cp,
    .flops = flops_cp_attention, .comm_scratch = comm_scratch_cp,
    .forward = fwd_cp_attention, .backward = bwd_cp_attention,
    KT__ATTR_LIST(cp_attention_attrs)};
