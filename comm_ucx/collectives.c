/* Collectives of the UCX communicator, built on tagged point-to-point messages.
 *
 * Simple linear algorithms through a root: the worlds here are small (a few ranks per
 * machine), and a fixed order makes every result deterministic: all_reduce adds the ranks'
 * contributions in rank order at rank 0 and sends the one result to all, so every rank
 * holds the same bits. Each call takes the next sequence number; every message carries it
 * (and the kind and step) in its tag, so a late message from an earlier call or a different
 * collective on a peer is never taken for this one's. */
#include <stdlib.h>
#include <string.h>

#include "comm_ucx/ucx_internal.h"
#include "lib/core/error.h"

static kt__ucx_op next_op(kt__ucx_comm *c, kt__ucx_kind kind)
{
    kt__ucx_op op = {kind, c->seq};
    c->seq = (c->seq + 1) & ((1u << KT__TAG_SEQ_BITS) - 1);
    return op;
}

/* Request slots for one collective (at most 2 * size), from an array allocated on first
 * use, so steady-state collectives allocate nothing. release_reqs gives them back. */
static kt_status alloc_reqs(kt__ucx_comm *c, int n, kt__ucx_req **out)
{
    int per = 2 * (c->base.size > 0 ? c->base.size : 1);
    if (c->reqs == NULL) {
        c->reqs = calloc((size_t)per * 2, sizeof *c->reqs);
        if (c->reqs == NULL)
            return kt__error(KT_ENOMEM, "rank %d: out of memory", c->base.rank);
        c->reqs_per_level = per;
    }
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
    kt__ucx_req *reqs;
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

/* Every rank's `bytes` from send into recv[r * bytes]. */
static kt_status gather_all_step(kt__ucx_comm *c, const kt__ucx_op *op, unsigned step,
                                 const void *send, size_t bytes, void *recv)
{
    int size = c->base.size, rank = c->base.rank;
    char *out = recv;
    kt__ucx_req *reqs;
    KT__TRY(alloc_reqs(c, 2 * size, &reqs));
    if (bytes > 0)
        memmove(out + (size_t)rank * bytes, send, bytes);
    batch b = {c, op, reqs, 0, KT_OK};
    for (int i = 1; i < size; i++) {
        int p = (rank + size - i) % size;
        b_recv(&b, step, p, out + (size_t)p * bytes, bytes);
    }
    /* Staggered so the ranks do not all send to rank 0 first. */
    for (int i = 1; i < size; i++)
        b_send(&b, step, (rank + i) % size, out + (size_t)rank * bytes, bytes);
    kt_status st = b_wait(&b);
    release_reqs(c);
    return st;
}

kt_status kt__ucx_barrier(kt_comm *comm)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_BARRIER);
    int size = comm->size;
    kt__ucx_req *reqs;
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
    return gather_all_step(c, &op, 0, send, bytes, recv);
}

kt_status kt__ucx_gatherv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                          int root)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_GATHERV);
    int size = comm->size, rank = comm->rank;
    kt__ucx_req *reqs;
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
    kt__ucx_req *reqs;
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

static kt_status grow_scratch(kt__ucx_comm *c, size_t bytes)
{
    if (bytes <= c->scratch_bytes)
        return KT_OK;
    void *p = realloc(c->scratch, bytes);
    if (p == NULL)
        return kt__error(KT_ENOMEM, "rank %d: all_reduce: cannot allocate %zu bytes of scratch",
                         c->base.rank, bytes);
    c->scratch = p;
    c->scratch_bytes = bytes;
    return KT_OK;
}

kt_status kt__ucx_all_reduce(kt_comm *comm, void *buf, size_t count, kt_dtype dtype,
                             kt_reduce_op rop)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_ALL_REDUCE);
    int size = comm->size;
    size_t esize = dtype == KT_F32 ? 4 : 2;
    size_t bytes = count * esize;
    kt__ucx_req *reqs;
    KT__TRY(alloc_reqs(c, size, &reqs));
    batch b = {c, &op, reqs, 0, KT_OK};
    kt_status st;
    if (comm->rank == 0) {
        /* Contributions of ranks 1..size-1, then (bf16) the f32 accumulator. */
        size_t in_bytes = (size_t)(size - 1) * bytes;
        /* the f32 accumulator after the contributions, aligned for floats: the bf16
         * contributions may end at any even offset */
        size_t acc_at = (in_bytes + 63) / 64 * 64;
        size_t acc_bytes = dtype == KT_BF16 ? count * sizeof(float) : 0;
        st = acc_at < in_bytes || acc_at > SIZE_MAX - acc_bytes
                 ? kt__error(KT_ERANGE, "rank 0: all_reduce of %zu elements is too large", count)
                 : grow_scratch(c, acc_at + acc_bytes);
        if (st == KT_OK) {
            char *in = c->scratch;
            for (int p = 1; p < size; p++)
                b_recv(&b, 0, p, in + (size_t)(p - 1) * bytes, bytes);
            st = b_wait(&b);
        }
        if (st == KT_OK) {
            char *in = c->scratch;
            float *acc = dtype == KT_F32 ? (float *)buf : (float *)(void *)(in + acc_at);
            if (dtype == KT_BF16)
                kt_bf16_to_f32(acc, buf, count);
            for (int p = 1; p < size; p++)
                kt__comm_accumulate(acc, in + (size_t)(p - 1) * bytes, count, dtype);
            if (rop == KT_REDUCE_MEAN)
                for (size_t i = 0; i < count; i++)
                    acc[i] /= (float)size;
            if (dtype == KT_BF16)
                kt_f32_to_bf16(buf, acc, count);
            st = bcast_step(c, &op, 1, buf, bytes, 0);
        }
    } else {
        /* The send completes before the result is received into the same buffer. */
        b_send(&b, 0, 0, buf, bytes);
        st = b_wait(&b);
        if (st == KT_OK)
            st = bcast_step(c, &op, 1, buf, bytes, 0);
    }
    release_reqs(c);
    return st;
}

/* Direct: every rank sends block p to rank p and adds the W blocks it receives in rank
 * order (f32 accumulation). */
kt_status kt__ucx_reduce_scatter(kt_comm *comm, const void *send, void *recv, size_t count,
                                 kt_dtype dtype, kt_reduce_op rop)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_REDUCE_SCATTER);
    int size = comm->size, rank = comm->rank;
    size_t esize = dtype == KT_F32 ? 4 : 2, block = count * esize;
    size_t in_bytes = (size_t)size * block, acc_at = (in_bytes + 63) / 64 * 64;
    if (acc_at < in_bytes || acc_at > SIZE_MAX - count * sizeof(float))
        return kt__error(KT_ERANGE, "rank %d: reduce_scatter of %zu elements is too large", rank,
                         count);
    KT__TRY(grow_scratch(c, acc_at + count * sizeof(float)));
    char *in = c->scratch;
    const char *out = send;
    kt__ucx_req *reqs;
    KT__TRY(alloc_reqs(c, 2 * size, &reqs));
    batch b = {c, &op, reqs, 0, KT_OK};
    memcpy(in + (size_t)rank * block, out + (size_t)rank * block, block);
    for (int i = 1; i < size; i++) {
        int p = (rank + size - i) % size;
        b_recv(&b, 0, p, in + (size_t)p * block, block);
    }
    for (int i = 1; i < size; i++) {
        int p = (rank + i) % size;
        b_send(&b, 0, p, out + (size_t)p * block, block);
    }
    kt_status st = b_wait(&b);
    release_reqs(c);
    if (st != KT_OK)
        return st;
    float *acc = (float *)(void *)(in + acc_at);
    memset(acc, 0, count * sizeof(float));
    for (int p = 0; p < size; p++)
        kt__comm_accumulate(acc, in + (size_t)p * block, count, dtype);
    if (rop == KT_REDUCE_MEAN)
        for (size_t i = 0; i < count; i++)
            acc[i] /= (float)size;
    if (dtype == KT_BF16)
        kt_f32_to_bf16(recv, acc, count);
    else
        memcpy(recv, acc, block);
    return KT_OK;
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
    kt__ucx_req *reqs;
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

/* Wire form of one rank's status in agree. */
typedef struct agree_hdr {
    int32_t status;
    uint32_t len;
} agree_hdr;

kt_status kt__ucx_agree(kt_comm *comm, kt_status local, const char *local_message,
                        int *lowest_out, kt_status *status_out,
                        char message_out[KT__COMM_MSG_MAX])
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = next_op(c, KT__KIND_AGREE);
    int size = comm->size;
    size_t len = local == KT_OK ? 0 : strnlen(local_message, KT__COMM_MSG_MAX - 1);
    agree_hdr mine = {(int32_t)local, (uint32_t)len};
    agree_hdr *all = malloc((size_t)size * sizeof *all);
    if (all == NULL)
        return kt__error(KT_ENOMEM, "rank %d: agree: out of memory", comm->rank);
    /* Step 0: everyone's status; step 1: the text of the lowest failing rank, from it. */
    kt_status st = gather_all_step(c, &op, 0, &mine, sizeof mine, all);
    int lowest = -1;
    for (int r = 0; r < size && st == KT_OK && lowest < 0; r++)
        if (all[r].status != 0)
            lowest = r;
    if (st == KT_OK && lowest >= 0) {
        size_t n = all[lowest].len < KT__COMM_MSG_MAX ? all[lowest].len : KT__COMM_MSG_MAX - 1;
        char text[KT__COMM_MSG_MAX];
        if (lowest == comm->rank)
            memcpy(text, local_message, n);
        st = bcast_step(c, &op, 1, text, n, lowest);
        if (st == KT_OK) {
            text[n] = '\0';
            memcpy(message_out, text, n + 1);
            int32_t s = all[lowest].status;
            *status_out = s < 0 && s >= KT_EINTERNAL ? (kt_status)s : KT_EINTERNAL;
        }
    }
    if (st == KT_OK)
        *lowest_out = lowest;
    free(all);
    return st;
}
