/* Ring reduce-scatter and all-gather, chunked and pipelined: the bandwidth-optimal half of
 * the all-reduce (each rank sends and receives (W - 1) / W of the message per phase).
 *
 * Every rank sends to rank + 1 and receives from rank - 1. Reduce-scatter: at step s (0 ..
 * W - 2) rank r sends its partial sum of block r - s - 1 and receives block r - s - 2, adds
 * its own contribution and passes it on; after W - 1 steps it holds the sum of block r.
 * All-gather: at step s rank r forwards block r - s and receives block r - s - 1, straight
 * into the caller's buffer.
 *
 * Pipelining: a block is cut into groups of KT__RING_DEPTH slices; within a step the slices
 * of a group travel at once, and slice j of step s is reduced and sent on while the other
 * slices are in flight. The buffers are 2 x KT__RING_DEPTH slices from the communicator's
 * arena (allocated with it): memory is O(slice), not O(message). Partial sums travel as
 * f32 (bf16 input is widened once and the sum rounded once), so the order of the additions
 * is fixed by coll_plan.h and the result is the same on every run.
 *
 * Slices are matched in posting order (one sender per receive queue), so the tag's step
 * only checks that both sides agree; empty slices (blocks one element shorter) are skipped
 * by both sides alike. */
#include <string.h>

#include "comm_ucx/coll_plan.h"
#include "comm_ucx/ring.h"
#include "lib/core/error.h"

typedef struct ring {
    kt__ucx_comm *c;
    const kt__ucx_op *op;
    int w, rank, left, right;
    size_t total;  /* elements, all blocks */
    size_t slice;  /* elements per slice */
    size_t groups; /* groups of KT__RING_DEPTH slices per block */
    unsigned phase;
    kt__ucx_req sreq[KT__RING_DEPTH], rreq[KT__RING_DEPTH];
} ring;

static int mod(int a, int w) { return ((a % w) + w) % w; }

static void ring_init(ring *g, kt__ucx_comm *c, const kt__ucx_op *op, size_t total,
                      size_t wire, unsigned phase)
{
    int w = c->base.size, r = c->base.rank;
    *g = (ring){.c = c, .op = op, .w = w, .rank = r, .left = mod(r - 1, w),
                .right = mod(r + 1, w), .total = total, .phase = phase};
    size_t maxblk = total / (size_t)w + (total % (size_t)w != 0);
    size_t s = (maxblk + KT__RING_DEPTH - 1) / KT__RING_DEPTH;
    size_t smin = KT__RING_MIN_SLICE_BYTES / wire, smax = KT__RING_SLICE_BYTES / wire;
    s = s < smin ? smin : s > smax ? smax : s;
    g->slice = s > 0 ? s : 1;
    g->groups = (maxblk + KT__RING_DEPTH * g->slice - 1) / (KT__RING_DEPTH * g->slice);
}

/* Slice j of group gi in block b: its first element (in the whole buffer) and length. */
static size_t slice_at(const ring *g, int b, size_t gi, int j, size_t *start)
{
    size_t blen = kt__blk_len(g->total, g->w, b);
    size_t s0 = (gi * KT__RING_DEPTH + (size_t)j) * g->slice;
    *start = kt__blk_start(g->total, g->w, b) + s0;
    return s0 >= blen ? 0 : blen - s0 < g->slice ? blen - s0 : g->slice;
}

static unsigned step_tag(const ring *g, size_t gi, int s, int j)
{
    return (g->phase << 15) |
           (unsigned)(((gi * (size_t)g->w + (size_t)s) * KT__RING_DEPTH + (size_t)j) & 0x7fff);
}

static kt_status wait1(ring *g, kt__ucx_req *r)
{
    return r->req == NULL ? KT_OK : kt__ucx_wait(g->c, g->op, r, 1);
}

/* After a failure: nothing posted may still point at the caller's memory or the arena. */
static kt_status ring_fail(ring *g, kt_status st)
{
    kt__ucx_drop(g->c, g->sreq, KT__RING_DEPTH);
    kt__ucx_drop(g->c, g->rreq, KT__RING_DEPTH);
    return st;
}

static kt_status ring_finish(ring *g)
{
    for (int j = 0; j < KT__RING_DEPTH; j++) {
        kt_status st = wait1(g, &g->sreq[j]);
        if (st != KT_OK)
            return ring_fail(g, st);
    }
    return KT_OK;
}

/* The posting helpers fail the whole ring (releasing the other slices) on error. */
#define RING_TRY(g, expr)                                                                      \
    do {                                                                                       \
        kt_status st_ = (expr);                                                                \
        if (st_ != KT_OK)                                                                      \
            return ring_fail((g), st_);                                                        \
    } while (0)

/* bf16 to f32 is exact: the bits shifted up (inline, so the loops below vectorise). */
static inline float bf16_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void widen(float *dst, const void *src, size_t n, kt_dtype dt)
{
    if (dt == KT_F32)
        memcpy(dst, src, n * sizeof(float));
    else
        kt_bf16_to_f32(dst, src, n);
}

/* out = part + own (own f32 or bf16, widened) */
static void add_own(float *restrict out, const float *restrict part, const void *own, size_t n,
                    kt_dtype dt)
{
    if (dt == KT_F32) {
        const float *o = own;
        for (size_t i = 0; i < n; i++)
            out[i] = part[i] + o[i];
    } else {
        const uint16_t *o = own;
        for (size_t i = 0; i < n; i++)
            out[i] = part[i] + bf16_f32(o[i]);
    }
}

/* The last step: this rank's block, the mean taken and the sum rounded once. out may be own
 * (an in-place reduce-scatter); part is overwritten. */
static void finish_block(void *out, float *part, const void *own, size_t n, kt_dtype dt,
                         int mean_w)
{
    if (dt == KT_F32) {
        float *o = out;
        const float *m = own;
        if (mean_w > 0)
            for (size_t i = 0; i < n; i++)
                o[i] = (part[i] + m[i]) / (float)mean_w;
        else
            for (size_t i = 0; i < n; i++)
                o[i] = part[i] + m[i];
        return;
    }
    const uint16_t *m = own;
    for (size_t i = 0; i < n; i++)
        part[i] += bf16_f32(m[i]);
    if (mean_w > 0)
        for (size_t i = 0; i < n; i++)
            part[i] /= (float)mean_w;
    kt_f32_to_bf16(out, part, n);
}

static kt_status reduce_scatter(kt__ucx_comm *c, const kt__ucx_op *op, unsigned phase,
                                const void *in, void *out, size_t total, kt_dtype dt,
                                kt_reduce_op rop)
{
    ring g;
    ring_init(&g, c, op, total, sizeof(float), phase);
    const size_t es = dt == KT_F32 ? 4 : 2;
    const char *src = in;
    float *rbuf = c->scratch, *sbuf = rbuf + KT__RING_DEPTH * g.slice;
    const int w = g.w, r = g.rank;
    const int mean_w = rop == KT_REDUCE_MEAN ? w : 0;
    for (size_t gi = 0; gi < g.groups; gi++) {
        for (int j = 0; j < KT__RING_DEPTH; j++) {
            size_t st0, n = slice_at(&g, mod(r - 1, w), gi, j, &st0);
            if (n > 0) {
                RING_TRY(&g, wait1(&g, &g.sreq[j]));
                const void *p = src + st0 * es;
                if (dt != KT_F32) {
                    widen(sbuf + (size_t)j * g.slice, p, n, dt);
                    p = sbuf + (size_t)j * g.slice;
                }
                RING_TRY(&g, kt__ucx_post_send(c, op, step_tag(&g, gi, 0, j), g.right, p,
                                               n * sizeof(float), &g.sreq[j]));
            }
            size_t rs0, rn = slice_at(&g, mod(r - 2, w), gi, j, &rs0);
            if (rn > 0)
                RING_TRY(&g, kt__ucx_post_recv(c, op, step_tag(&g, gi, 0, j), g.left,
                                               rbuf + (size_t)j * g.slice, rn * sizeof(float),
                                               &g.rreq[j]));
        }
        for (int s = 1; s < w; s++) {
            for (int j = 0; j < KT__RING_DEPTH; j++) {
                float *rb = rbuf + (size_t)j * g.slice, *sb = sbuf + (size_t)j * g.slice;
                size_t st0, n = slice_at(&g, mod(r - s - 1, w), gi, j, &st0);
                if (n > 0) {
                    RING_TRY(&g, wait1(&g, &g.rreq[j]));
                    if (s < w - 1) {
                        RING_TRY(&g, wait1(&g, &g.sreq[j]));
                        add_own(sb, rb, src + st0 * es, n, dt);
                        RING_TRY(&g, kt__ucx_post_send(c, op, step_tag(&g, gi, s, j), g.right,
                                                       sb, n * sizeof(float), &g.sreq[j]));
                    } else {
                        char *o = (char *)out + (st0 - kt__blk_start(total, w, r)) * es;
                        finish_block(o, rb, src + st0 * es, n, dt, mean_w);
                    }
                }
                if (s < w - 1) {
                    size_t rs0, rn = slice_at(&g, mod(r - s - 2, w), gi, j, &rs0);
                    if (rn > 0)
                        RING_TRY(&g, kt__ucx_post_recv(c, op, step_tag(&g, gi, s, j), g.left,
                                                       rb, rn * sizeof(float), &g.rreq[j]));
                }
            }
        }
    }
    return ring_finish(&g);
}

static kt_status all_gather(kt__ucx_comm *c, const kt__ucx_op *op, unsigned phase, void *buf,
                            size_t total, size_t es)
{
    ring g;
    ring_init(&g, c, op, total, es, phase);
    char *b = buf;
    const int w = g.w, r = g.rank;
    for (size_t gi = 0; gi < g.groups; gi++) {
        for (int j = 0; j < KT__RING_DEPTH; j++) {
            size_t st0, n = slice_at(&g, r, gi, j, &st0);
            if (n > 0) {
                RING_TRY(&g, wait1(&g, &g.sreq[j]));
                RING_TRY(&g, kt__ucx_post_send(c, op, step_tag(&g, gi, 0, j), g.right,
                                               b + st0 * es, n * es, &g.sreq[j]));
            }
            size_t rs0, rn = slice_at(&g, mod(r - 1, w), gi, j, &rs0);
            if (rn > 0)
                RING_TRY(&g, kt__ucx_post_recv(c, op, step_tag(&g, gi, 0, j), g.left,
                                               b + rs0 * es, rn * es, &g.rreq[j]));
        }
        for (int s = 1; s < w; s++) {
            for (int j = 0; j < KT__RING_DEPTH; j++) {
                size_t st0, n = slice_at(&g, mod(r - s, w), gi, j, &st0);
                if (n > 0) {
                    RING_TRY(&g, wait1(&g, &g.rreq[j]));
                    if (s < w - 1) {
                        RING_TRY(&g, wait1(&g, &g.sreq[j]));
                        RING_TRY(&g, kt__ucx_post_send(c, op, step_tag(&g, gi, s, j), g.right,
                                                       b + st0 * es, n * es, &g.sreq[j]));
                    }
                }
                if (s < w - 1) {
                    size_t rs0, rn = slice_at(&g, mod(r - s - 1, w), gi, j, &rs0);
                    if (rn > 0)
                        RING_TRY(&g, kt__ucx_post_recv(c, op, step_tag(&g, gi, s, j), g.left,
                                                       b + rs0 * es, rn * es, &g.rreq[j]));
                }
            }
        }
    }
    return ring_finish(&g);
}

/* Slices go without FAST_CMPL: a slice that arrives before its receive is posted (the
 * sender a step ahead) then waits as a rendezvous request instead of eager fragments that
 * UCX would buffer in memory it allocates. */
kt_status kt__ring_reduce_scatter(kt__ucx_comm *c, const kt__ucx_op *op, unsigned phase,
                                  const void *in, void *out, size_t total, kt_dtype dt,
                                  kt_reduce_op rop)
{
    uint32_t flags = c->send_flags;
    c->send_flags = 0;
    kt_status st = reduce_scatter(c, op, phase, in, out, total, dt, rop);
    c->send_flags = flags;
    return st;
}

kt_status kt__ring_all_gather(kt__ucx_comm *c, const kt__ucx_op *op, unsigned phase, void *buf,
                              size_t total, size_t es)
{
    uint32_t flags = c->send_flags;
    c->send_flags = 0;
    kt_status st = all_gather(c, op, phase, buf, total, es);
    c->send_flags = flags;
    return st;
}
