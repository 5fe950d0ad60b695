/* Collectives of the UCX communicator, built on tagged point-to-point messages.
 *
 * The bandwidth-bound ones are rings (ring.c): all_gather, reduce_scatter, and all_reduce
 * as a reduce-scatter followed by an all-gather. Small all_reduces and agree use recursive
 * doubling (log2 W rounds); agree's message follows by a binomial tree. Broadcast, barrier,
 * gatherv and scatterv stay linear through their root. Every result is deterministic: the
 * order of the additions is fixed (coll_plan.h), and all_reduce computes each element once,
 * on one rank, and passes those bits to the others. Each call takes the next sequence
 * number; every message carries it (and the kind and step) in its tag, so a late message
 * from an earlier call or a different collective on a peer is never taken for this one's.
 * Nothing here allocates: the request slots and the pipeline's arena come with the
 * communicator (kt__ucx_coll_init). */
#include <stdlib.h>
#include <string.h>

#include "comm_ucx/coll_plan.h"
#include "comm_ucx/ring.h"
#include "comm_ucx/ucx_internal.h"
#include "lib/core/error.h"

static kt__ucx_op next_op(kt__ucx_comm *c, kt__ucx_kind kind)
{
    kt__ucx_op op = {kind, c->seq};
    c->seq = (c->seq + 1) & ((1u << KT__TAG_SEQ_BITS) - 1);
    return op;
}

kt_status kt__ucx_coll_init(kt__ucx_comm *c)
{
    int per = 2 * (c->base.size > 0 ? c->base.size : 1);
    c->reqs = calloc((size_t)per * 2, sizeof *c->reqs);
    c->scratch = malloc(KT__COLL_ARENA_BYTES);
    if (c->reqs == NULL || c->scratch == NULL)
        return kt__error(KT_ENOMEM, "rank %d: out of memory for the collectives' buffers",
                         c->base.rank);
    c->reqs_per_level = per;
    c->scratch_bytes = KT__COLL_ARENA_BYTES;
    return KT_OK;
}

/* Request slots for one collective (at most 2 * size), from the array made with the
 * communicator. release_reqs gives them back. */
static kt_status alloc_reqs(kt__ucx_comm *c, int n, kt__ucx_req **out)
{
    if (n > c->reqs_per_level || c->reqs_depth >= 2)
        return kt__error(KT_EINTERNAL, "rank %d: collective request slots exhausted (%d wanted, "
                         "depth %d)", c->base.rank, n, c->reqs_depth);
    *out = c->reqs + (size_t)c->reqs_depth * (size_t)c->reqs_per_level;
    memset(*out, 0, (size_t)c->reqs_per_level * sizeof **out);
    c->reqs_depth++;
    return KT_OK;
}

static void release_reqs(kt__ucx_comm *c) { c->reqs_depth--; }

/* Posts, waits, and releases in one exit path; post errors release what was posted. */
typedef struct batch {
    kt__ucx_comm *c;
    const kt__ucx_op *op;
    kt__ucx_req *reqs;
    int n;
    kt_status st;
} batch;

static void b_send(batch *b, unsigned step, int peer, const void *buf, size_t bytes)
{
    if (b->st == KT_OK &&
        (b->st = kt__ucx_post_send(b->c, b->op, step, peer, buf, bytes, &b->reqs[b->n])) == KT_OK)
        b->n++;
}

static void b_recv(batch *b, unsigned step, int peer, void *buf, size_t bytes)
{
    if (b->st == KT_OK &&
        (b->st = kt__ucx_post_recv(b->c, b->op, step, peer, buf, bytes, &b->reqs[b->n])) == KT_OK)
        b->n++;
}

static kt_status b_wait(batch *b)
{
    kt_status st = b->st;
    if (st != KT_OK)
        kt__ucx_drop(b->c, b->reqs, b->n);
    else
        st = kt__ucx_wait(b->c, b->op, b->reqs, b->n);
    b->n = 0;
    return st;
}

/* root sends buf to every other rank (step); the others receive it. */
static kt_status bcast_step(kt__ucx_comm *c, const kt__ucx_op *op, unsigned step, void *buf,
                            size_t bytes, int root)
{
    int size = c->base.size, rank = c->base.rank;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, size, &reqs));
    batch b = {c, op, reqs, 0, KT_OK};
    if (rank == root) {
        for (int i = 1; i < size; i++)
            b_send(&b, step, (root + i) % size, buf, bytes);
    } else {
        b_recv(&b, step, root, buf, bytes);
    }
    kt_status st = b_wait(&b);
    release_reqs(c);
    return st;
}

kt_status kt__ucx_barrier(kt_comm *comm)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_BARRIER);
    int size = comm->size;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, size, &reqs));
    batch b = {c, &op, reqs, 0, KT_OK};
    kt_status st;
    if (comm->rank == 0) {
        for (int p = 1; p < size; p++)
            b_recv(&b, 0, p, NULL, 0);
        st = b_wait(&b);
        for (int p = 1; p < size && st == KT_OK; p++)
            b_send(&b, 1, p, NULL, 0);
        if (st == KT_OK)
            st = b_wait(&b);
    } else {
        b_recv(&b, 1, 0, NULL, 0);
        b_send(&b, 0, 0, NULL, 0);
        st = b_wait(&b);
    }
    release_reqs(c);
    return st;
}

kt_status kt__ucx_broadcast(kt_comm *comm, void *buf, size_t bytes, int root)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_BROADCAST);
    return bcast_step(c, &op, 0, buf, bytes, root);
}

kt_status kt__ucx_all_gather(kt_comm *comm, const void *send, size_t bytes, void *recv)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_ALL_GATHER);
    if (bytes > 0)
        memmove((char *)recv + (size_t)comm->rank * bytes, send, bytes);
    return kt__ring_all_gather(c, &op, 0, recv, (size_t)comm->size * bytes, 1);
}

kt_status kt__ucx_gatherv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                          int root)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_GATHERV);
    int size = comm->size, rank = comm->rank;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, size, &reqs));
    batch b = {c, &op, reqs, 0, KT_OK};
    if (rank == root) {
        char *out = recv;
        size_t off = 0;
        for (int p = 0; p < size; p++) {
            /* Zero-length blocks are still sent: a rank whose counts differ is caught by
             * the length check instead of leaving the root waiting. */
            if (p == rank) {
                if (counts[p] > 0)
                    memmove(out + off, send, counts[p]);
            } else {
                b_recv(&b, 0, p, counts[p] ? out + off : NULL, counts[p]);
            }
            off += counts[p];
        }
    } else {
        b_send(&b, 0, root, send, counts[rank]);
    }
    kt_status st = b_wait(&b);
    release_reqs(c);
    return st;
}

kt_status kt__ucx_scatterv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                           int root)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_SCATTERV);
    int size = comm->size, rank = comm->rank;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, size, &reqs));
    batch b = {c, &op, reqs, 0, KT_OK};
    if (rank == root) {
        const char *in = send;
        size_t off = 0;
        for (int p = 0; p < size; p++) {
            if (p == rank) {
                if (counts[p] > 0)
                    memmove(recv, in + off, counts[p]);
            } else {
                b_send(&b, 0, p, counts[p] ? in + off : NULL, counts[p]);
            }
            off += counts[p];
        }
    } else {
        b_recv(&b, 0, root, recv, counts[rank]);
    }
    kt_status st = b_wait(&b);
    release_reqs(c);
    return st;
}

/* Recursive doubling over vectors of `bytes` (coll_plan.h has the pairing): combine(acc,
 * in, ctx) folds a partner's vector into this rank's; it must be commutative in its bits,
 * so that both partners hold the same result. acc is this rank's vector, tmp a buffer of
 * the same size. The ranks beyond the power of two get the result at the end. */
typedef void (*rd_combine)(void *acc, const void *in, size_t bytes);

static kt_status rd_all_reduce(kt__ucx_comm *c, const kt__ucx_op *op, void *acc, void *tmp,
                               size_t bytes, rd_combine combine)
{
    int w = c->base.size, r = c->base.rank, p2 = kt__rd_pow2(w), rem = w - p2;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, 2, &reqs));
    batch b = {c, op, reqs, 0, KT_OK};
    kt_status st = KT_OK;
    unsigned step = 0;
    if (r >= p2) {
        b_send(&b, 0, r - p2, acc, bytes);
        if ((st = b_wait(&b)) == KT_OK) {
            b_recv(&b, 1, r - p2, acc, bytes);
            st = b_wait(&b);
        }
        release_reqs(c);
        return st;
    }
    if (r < rem) {
        b_recv(&b, 0, r + p2, tmp, bytes);
        if ((st = b_wait(&b)) == KT_OK)
            combine(acc, tmp, bytes);
    }
    for (int mask = 1; mask < p2 && st == KT_OK; mask <<= 1) {
        int partner = r ^ mask;
        step++;
        b_recv(&b, 1 + step, partner, tmp, bytes);
        b_send(&b, 1 + step, partner, acc, bytes);
        if ((st = b_wait(&b)) == KT_OK)
            combine(acc, tmp, bytes);
    }
    if (st == KT_OK && r < rem) {
        b_send(&b, 1, r + p2, acc, bytes);
        st = b_wait(&b);
    }
    release_reqs(c);
    return st;
}

static void add_f32(void *acc, const void *in, size_t bytes)
{
    float *a = acc;
    const float *x = in;
    for (size_t i = 0; i < bytes / sizeof(float); i++)
        a[i] += x[i];
}

/* Small messages: every rank ends with the same tree of additions (coll_plan.h). */
static kt_status all_reduce_small(kt__ucx_comm *c, const kt__ucx_op *op, void *buf,
                                  size_t count, kt_dtype dtype, kt_reduce_op rop)
{
    float *tmp = (float *)c->scratch, *acc = tmp + KT__RD_MAX_BYTES / sizeof(float);
    if (dtype == KT_F32)
        acc = buf;
    else
        kt_bf16_to_f32(acc, buf, count);
    KT__TRY(rd_all_reduce(c, op, acc, tmp, count * sizeof(float), add_f32));
    if (rop == KT_REDUCE_MEAN)
        for (size_t i = 0; i < count; i++)
            acc[i] /= (float)c->base.size;
    if (dtype == KT_BF16)
        kt_f32_to_bf16(buf, acc, count);
    return KT_OK;
}

kt_status kt__ucx_all_reduce(kt_comm *comm, void *buf, size_t count, kt_dtype dtype,
                             kt_reduce_op rop)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_ALL_REDUCE);
    if (kt__all_reduce_uses_rd(count))
        return all_reduce_small(c, &op, buf, count, dtype, rop);
    size_t es = dtype == KT_F32 ? 4 : 2;
    char *mine = (char *)buf + kt__blk_start(count, comm->size, comm->rank) * es;
    KT__TRY(kt__ring_reduce_scatter(c, &op, 0, buf, mine, count, dtype, rop));
    return kt__ring_all_gather(c, &op, 1, buf, count, es);
}

kt_status kt__ucx_reduce_scatter(kt_comm *comm, const void *send, void *recv, size_t count,
                                 kt_dtype dtype, kt_reduce_op rop)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_REDUCE_SCATTER);
    return kt__ring_reduce_scatter(c, &op, 0, send, recv, (size_t)comm->size * count, dtype,
                                   rop);
}

/* Every pair exchanges its blocks at once; zero-length blocks are sent too, so a rank that
 * expects a different length from a peer learns it from the length check. */
kt_status kt__ucx_all_to_all_v(kt_comm *comm, const void *send, const size_t *send_bytes,
                               void *recv, const size_t *recv_bytes)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_ALL_TO_ALL_V);
    int size = comm->size, rank = comm->rank;
    const char *in = send;
    char *out = recv;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, 2 * size, &reqs));
    batch b = {c, &op, reqs, 0, KT_OK};
    size_t so = 0, ro = 0, my_so = 0, my_ro = 0;
    for (int p = 0; p < size; p++) {
        if (p == rank) {
            my_so = so, my_ro = ro;
        } else {
            b_recv(&b, 0, p, recv_bytes[p] ? out + ro : NULL, recv_bytes[p]);
        }
        so += send_bytes[p];
        ro += recv_bytes[p];
    }
    so = 0;
    for (int p = 0; p < size; p++) {
        if (p != rank)
            b_send(&b, 0, p, send_bytes[p] ? in + so : NULL, send_bytes[p]);
        so += send_bytes[p];
    }
    if (b.st == KT_OK && send_bytes[rank] > 0)
        memmove(out + my_ro, in + my_so, send_bytes[rank]);
    kt_status st = b_wait(&b);
    release_reqs(c);
    return st;
}

/* Wire form of agree's first round: the lowest failing rank seen so far (INT32_MAX: none),
 * its status and the length of its message. */
typedef struct agree_val {
    int32_t lowest;
    int32_t status;
    uint32_t len;
} agree_val;

static void agree_min(void *acc, const void *in, size_t bytes)
{
    agree_val *a = acc;
    const agree_val *x = in;
    (void)bytes;
    if (x->lowest < a->lowest)
        *a = *x;
}

/* root's bytes to every rank along a binomial tree (log2 W rounds). */
static kt_status tree_broadcast(kt__ucx_comm *c, const kt__ucx_op *op, unsigned step,
                                void *buf, size_t bytes, int root)
{
    int w = c->base.size, vr = (c->base.rank - root + w) % w;
    kt__ucx_req *reqs = NULL;
    KT__TRY(alloc_reqs(c, 2, &reqs));
    batch b = {c, op, reqs, 0, KT_OK};
    kt_status st = KT_OK;
    for (int mask = 1; mask < w && st == KT_OK; mask <<= 1) {
        if (vr < mask && vr + mask < w)
            b_send(&b, step, (vr + mask + root) % w, buf, bytes);
        else if (vr >= mask && vr < 2 * mask)
            b_recv(&b, step, (vr - mask + root) % w, buf, bytes);
        st = b_wait(&b);
    }
    release_reqs(c);
    return st;
}

kt_status kt__ucx_agree(kt_comm *comm, kt_status local, const char *local_message,
                        int *lowest_out, kt_status *status_out,
                        char message_out[KT__COMM_MSG_MAX])
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_AGREE);
    size_t len = local == KT_OK ? 0 : strnlen(local_message, KT__COMM_MSG_MAX - 1);
    agree_val v = {local == KT_OK ? INT32_MAX : comm->rank, (int32_t)local, (uint32_t)len},
              tmp;
    /* Round 1: everyone learns the lowest failing rank; round 2: its text, from it. */
    KT__TRY(rd_all_reduce(c, &op, &v, &tmp, sizeof v, agree_min));
    if (v.lowest == INT32_MAX) {
        *lowest_out = -1;
        return KT_OK;
    }
    if (v.lowest < 0 || v.lowest >= comm->size)
        return kt__error(KT_ESTATE, "rank %d: agree: a peer reports failing rank %d of %d",
                         comm->rank, (int)v.lowest, comm->size);
    size_t n = v.len < KT__COMM_MSG_MAX ? v.len : KT__COMM_MSG_MAX - 1;
    char text[KT__COMM_MSG_MAX];
    if (v.lowest == comm->rank)
        memcpy(text, local_message, n);
    KT__TRY(tree_broadcast(c, &op, 0x100, text, n, v.lowest));
    text[n] = '\0';
    memcpy(message_out, text, n + 1);
    *status_out = v.status < 0 && v.status >= KT_EINTERNAL ? (kt_status)v.status : KT_EINTERNAL;
    *lowest_out = v.lowest;
    return KT_OK;
}
