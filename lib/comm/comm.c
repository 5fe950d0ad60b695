/* The kt_comm front end and the single-rank communicator.
 *
 * Every public call goes through here: arguments are checked once for all backends, a
 * poisoned communicator fails at once with its original error, and a backend failure
 * poisons it (a rank that failed part-way through a collective has left its peers out of
 * step, so nothing after it could be trusted). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib/comm/comm_internal.h"
#include "lib/core/env.h"
#include "lib/core/error.h"

void kt__comm_init(kt_comm *comm, const kt__comm_ops *ops, int rank, int size, int timeout_ms)
{
    comm->ops = ops;
    comm->rank = rank;
    comm->size = size;
    comm->timeout_ms = timeout_ms;
    comm->poison = KT_OK;
    comm->poison_message[0] = '\0';
    comm->agreed_rank = -1;
    comm->agreed_message[0] = '\0';
}

kt_status kt__comm_env_timeout(int *timeout_ms_out)
{
    long long ms = 60000;
    int found;
    KT__TRY(kt__env_int("KT_COMM_TIMEOUT_MS", 1, INT_MAX, "a time in milliseconds", &ms, &found));
    *timeout_ms_out = (int)ms;
    return KT_OK;
}

void kt__comm_accumulate(float *acc, const void *src, size_t count, kt_dtype dtype)
{
    if (dtype == KT_F32) {
        const float *s = src;
        for (size_t i = 0; i < count; i++)
            acc[i] += s[i];
    } else {
        const uint16_t *s = src;
        for (size_t i = 0; i < count; i++)
            acc[i] += kt_bf16_to_f32_1(s[i]);
    }
}

/* ---- front end ------------------------------------------------------------------------- */

static kt_status usable(const kt_comm *c, const char *fn)
{
    if (c == NULL)
        return kt__error(KT_EINVAL, "%s: comm is NULL", fn);
    if (c->poison != KT_OK)
        return kt__error(c->poison, "%s", c->poison_message);
    return KT_OK;
}

/* Records a backend failure as the poison and lets the backend tell the peers. The message
 * is restored afterwards: the abort hook may record errors of its own. */
static kt_status finish(kt_comm *c, kt_status s)
{
    if (s == KT_OK || c->poison != KT_OK)
        return s;
    c->poison = s;
    snprintf(c->poison_message, sizeof c->poison_message, "%s",
             kt_last_error()[0] != '\0' ? kt_last_error() : kt_status_str(s));
    if (c->ops->abort != NULL)
        c->ops->abort(c, s, c->poison_message);
    return kt__error(s, "%s", c->poison_message);
}

static kt_status check_peer(const kt_comm *c, const char *fn, const char *what, int peer)
{
    if (peer < 0 || peer >= c->size)
        return kt__error(KT_EINVAL, "%s: %s %d is not a rank of this communicator (size %d)", fn,
                         what, peer, c->size);
    if (peer == c->rank)
        return kt__error(KT_EINVAL, "%s: %s %d is this rank; messages to self are not supported",
                         fn, what, peer);
    return KT_OK;
}

static kt_status check_buf(const char *fn, const char *what, const void *buf, size_t bytes)
{
    if (buf == NULL && bytes > 0)
        return kt__error(KT_EINVAL, "%s: %s is NULL but %zu bytes were given", fn, what, bytes);
    return KT_OK;
}

static kt_status check_tag(const char *fn, int tag)
{
    if (tag < 0 || tag > 65535)
        return kt__error(KT_EINVAL, "%s: tag %d is outside 0..65535", fn, tag);
    return KT_OK;
}

static kt_status check_root(const kt_comm *c, const char *fn, int root)
{
    if (root < 0 || root >= c->size)
        return kt__error(KT_EINVAL, "%s: root %d is not a rank of this communicator (size %d)", fn,
                         root, c->size);
    return KT_OK;
}

/* The total of counts[], or KT_ERANGE when it does not fit a size_t. */
static kt_status sum_counts(const kt_comm *c, const char *fn, const size_t *counts,
                            size_t *total_out)
{
    if (counts == NULL)
        return kt__error(KT_EINVAL, "%s: counts is NULL", fn);
    size_t total = 0;
    for (int r = 0; r < c->size; r++) {
        if (counts[r] > SIZE_MAX - total)
            return kt__error(KT_ERANGE, "%s: the counts add up to more than SIZE_MAX", fn);
        total += counts[r];
    }
    *total_out = total;
    return KT_OK;
}

void kt_comm_destroy(kt_comm *comm)
{
    if (comm != NULL)
        comm->ops->destroy(comm);
}

int kt_comm_rank(const kt_comm *comm) { return comm != NULL ? comm->rank : -1; }

int kt_comm_size(const kt_comm *comm) { return comm != NULL ? comm->size : 0; }

kt_status kt_comm_set_timeout(kt_comm *comm, int timeout_ms)
{
    if (comm == NULL)
        return kt__error(KT_EINVAL, "kt_comm_set_timeout: comm is NULL");
    if (timeout_ms <= 0)
        return kt__error(KT_EINVAL, "kt_comm_set_timeout: timeout %d ms is not positive",
                         timeout_ms);
    comm->timeout_ms = timeout_ms;
    return KT_OK;
}

kt_status kt_comm_status(const kt_comm *comm)
{
    return comm != NULL ? comm->poison : KT_EINVAL;
}

kt_status kt_comm_sendrecv(kt_comm *comm, int to, const void *send_buf, size_t send_bytes,
                           int from, void *recv_buf, size_t recv_bytes, int tag)
{
    static const char fn[] = "kt_comm_sendrecv";
    KT__TRY(usable(comm, fn));
    KT__TRY(check_tag(fn, tag));
    if (to != -1) {
        KT__TRY(check_peer(comm, fn, "destination", to));
        KT__TRY(check_buf(fn, "send_buf", send_buf, send_bytes));
    }
    if (from != -1) {
        KT__TRY(check_peer(comm, fn, "source", from));
        KT__TRY(check_buf(fn, "recv_buf", recv_buf, recv_bytes));
    }
    if (to == -1 && from == -1)
        return KT_OK;
    return finish(comm, comm->ops->sendrecv(comm, to, send_buf, to == -1 ? 0 : send_bytes, from,
                                            recv_buf, from == -1 ? 0 : recv_bytes, tag));
}

kt_status kt_comm_send(kt_comm *comm, int peer, int tag, const void *buf, size_t bytes)
{
    static const char fn[] = "kt_comm_send";
    KT__TRY(usable(comm, fn));
    KT__TRY(check_tag(fn, tag));
    KT__TRY(check_peer(comm, fn, "peer", peer));
    KT__TRY(check_buf(fn, "buf", buf, bytes));
    return finish(comm, comm->ops->sendrecv(comm, peer, buf, bytes, -1, NULL, 0, tag));
}

kt_status kt_comm_recv(kt_comm *comm, int peer, int tag, void *buf, size_t bytes)
{
    static const char fn[] = "kt_comm_recv";
    KT__TRY(usable(comm, fn));
    KT__TRY(check_tag(fn, tag));
    KT__TRY(check_peer(comm, fn, "peer", peer));
    KT__TRY(check_buf(fn, "buf", buf, bytes));
    return finish(comm, comm->ops->sendrecv(comm, -1, NULL, 0, peer, buf, bytes, tag));
}

kt_status kt_comm_barrier(kt_comm *comm)
{
    KT__TRY(usable(comm, "kt_comm_barrier"));
    if (comm->size == 1)
        return KT_OK;
    return finish(comm, comm->ops->barrier(comm));
}

kt_status kt_comm_broadcast(kt_comm *comm, void *buf, size_t bytes, int root)
{
    static const char fn[] = "kt_comm_broadcast";
    KT__TRY(usable(comm, fn));
    KT__TRY(check_root(comm, fn, root));
    KT__TRY(check_buf(fn, "buf", buf, bytes));
    if (comm->size == 1)
        return KT_OK;
    return finish(comm, comm->ops->broadcast(comm, buf, bytes, root));
}

kt_status kt_comm_all_gather(kt_comm *comm, const void *send, size_t bytes, void *recv)
{
    static const char fn[] = "kt_comm_all_gather";
    KT__TRY(usable(comm, fn));
    if (bytes > SIZE_MAX / (size_t)comm->size)
        return kt__error(KT_ERANGE, "%s: %d x %zu bytes overflow", fn, comm->size, bytes);
    KT__TRY(check_buf(fn, "send", send, bytes));
    KT__TRY(check_buf(fn, "recv", recv, bytes * (size_t)comm->size));
    if (comm->size == 1) {
        if (bytes > 0)
            memmove(recv, send, bytes); /* send may already be the rank's block of recv */
        return KT_OK;
    }
    return finish(comm, comm->ops->all_gather(comm, send, bytes, recv));
}

kt_status kt_comm_gatherv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                          int root)
{
    static const char fn[] = "kt_comm_gatherv";
    size_t total = 0;
    KT__TRY(usable(comm, fn));
    KT__TRY(check_root(comm, fn, root));
    KT__TRY(sum_counts(comm, fn, counts, &total));
    KT__TRY(check_buf(fn, "send", send, counts[comm->rank]));
    if (comm->rank == root)
        KT__TRY(check_buf(fn, "recv (at the root)", recv, total));
    if (comm->size == 1) {
        if (counts[0] > 0)
            memmove(recv, send, counts[0]);
        return KT_OK;
    }
    return finish(comm, comm->ops->gatherv(comm, send, counts, recv, root));
}

kt_status kt_comm_scatterv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                           int root)
{
    static const char fn[] = "kt_comm_scatterv";
    size_t total = 0;
    KT__TRY(usable(comm, fn));
    KT__TRY(check_root(comm, fn, root));
    KT__TRY(sum_counts(comm, fn, counts, &total));
    if (comm->rank == root)
        KT__TRY(check_buf(fn, "send (at the root)", send, total));
    KT__TRY(check_buf(fn, "recv", recv, counts[comm->rank]));
    if (comm->size == 1) {
        if (counts[0] > 0)
            memmove(recv, send, counts[0]);
        return KT_OK;
    }
    return finish(comm, comm->ops->scatterv(comm, send, counts, recv, root));
}

static kt_status check_reduction(const kt_comm *c, const char *fn, size_t count, kt_dtype dtype,
                                 kt_reduce_op op)
{
    if (dtype != KT_F32 && dtype != KT_BF16)
        return kt__error(KT_EUNSUPPORTED, "%s: dtype %s (only f32 and bf16 are reduced)", fn,
                         kt_dtype_name(dtype));
    if (op != KT_REDUCE_SUM && op != KT_REDUCE_MEAN)
        return kt__error(KT_EINVAL, "%s: unknown reduce op %d", fn, (int)op);
    if (count > SIZE_MAX / sizeof(float) / (size_t)c->size)
        return kt__error(KT_ERANGE, "%s: %zu elements are too many", fn, count);
    return KT_OK;
}

kt_status kt_comm_all_reduce(kt_comm *comm, void *buf, size_t count, kt_dtype dtype,
                             kt_reduce_op op)
{
    static const char fn[] = "kt_comm_all_reduce";
    KT__TRY(usable(comm, fn));
    KT__TRY(check_reduction(comm, fn, count, dtype, op));
    KT__TRY(check_buf(fn, "buf", buf, count));
    if (comm->size == 1 || count == 0)
        return KT_OK; /* the sum or mean of one contribution is itself, bit for bit */
    return finish(comm, comm->ops->all_reduce(comm, buf, count, dtype, op));
}

kt_status kt_comm_reduce_scatter(kt_comm *comm, const void *send, void *recv, size_t count,
                                 kt_dtype dtype, kt_reduce_op op)
{
    static const char fn[] = "kt_comm_reduce_scatter";
    KT__TRY(usable(comm, fn));
    KT__TRY(check_reduction(comm, fn, count, dtype, op));
    size_t block = count * kt_dtype_size(dtype);
    KT__TRY(check_buf(fn, "send", send, block * (size_t)comm->size));
    KT__TRY(check_buf(fn, "recv", recv, block));
    if (count == 0)
        return KT_OK;
    if (comm->size == 1) {
        memmove(recv, send, block); /* one contribution: its sum and mean are itself */
        return KT_OK;
    }
    return finish(comm, comm->ops->reduce_scatter(comm, send, recv, count, dtype, op));
}

kt_status kt_comm_all_to_all_v(kt_comm *comm, const void *send, const size_t *send_bytes,
                               void *recv, const size_t *recv_bytes)
{
    static const char fn[] = "kt_comm_all_to_all_v";
    size_t send_total = 0, recv_total = 0;
    KT__TRY(usable(comm, fn));
    KT__TRY(sum_counts(comm, fn, send_bytes, &send_total));
    KT__TRY(sum_counts(comm, fn, recv_bytes, &recv_total));
    KT__TRY(check_buf(fn, "send", send, send_total));
    KT__TRY(check_buf(fn, "recv", recv, recv_total));
    int me = comm->rank;
    if (send_bytes[me] != recv_bytes[me])
        return kt__error(KT_EINVAL, "%s: rank %d sends itself %zu bytes but expects %zu", fn, me,
                         send_bytes[me], recv_bytes[me]);
    if (comm->size == 1) {
        if (send_bytes[0] > 0)
            memmove(recv, send, send_bytes[0]);
        return KT_OK;
    }
    return finish(comm, comm->ops->all_to_all_v(comm, send, send_bytes, recv, recv_bytes));
}

kt_status kt_comm_agree(kt_comm *comm, kt_status local)
{
    /* Taken first: the checks below may record errors of their own. */
    char local_message[KT__COMM_MSG_MAX];
    snprintf(local_message, sizeof local_message, "%s",
             local == KT_OK                ? ""
             : kt_last_error()[0] != '\0' ? kt_last_error()
                                           : kt_status_str(local));
    KT__TRY(usable(comm, "kt_comm_agree"));
    int lowest = local == KT_OK ? -1 : comm->rank;
    kt_status status = local;
    char message[KT__COMM_MSG_MAX];
    if (comm->size > 1) {
        KT__TRY(finish(comm, comm->ops->agree(comm, local, local_message, &lowest, &status,
                                              message)));
    } else {
        memcpy(message, local_message, sizeof message);
    }
    comm->agreed_rank = lowest;
    if (lowest < 0)
        return KT_OK;
    /* The same bytes on every rank: the failing rank's text, prefixed with its rank. */
    kt__error(status, "rank %d: %s", lowest, message);
    snprintf(comm->agreed_message, sizeof comm->agreed_message, "%s", kt_last_error());
    return status;
}

/* The root cause of a failure every rank has agreed on already: the caller's message holds
 * the agreed "rank L: text" somewhere (after its own context); the result is "rank L:
 * <context><text>". Returns 0 when the message does not hold it (a new failure). */
static int agreed_root(const kt_comm *c, const char *local, char root[KT__COMM_MSG_MAX])
{
    if (c->agreed_rank < 0 || c->agreed_message[0] == '\0')
        return 0;
    const char *at = strstr(local, c->agreed_message);
    if (at == NULL)
        return 0;
    char prefix[32];
    int np = snprintf(prefix, sizeof prefix, "rank %d: ", c->agreed_rank);
    snprintf(root, KT__COMM_MSG_MAX, "%s%.*s%s", prefix, (int)(at - local), local,
             at + np);
    return 1;
}

kt_status kt_comm_abort(kt_comm *comm, kt_status status)
{
    char local[KT__COMM_MSG_MAX];
    snprintf(local, sizeof local, "%s",
             kt_last_error()[0] != '\0' ? kt_last_error() : kt_status_str(status));
    if (comm == NULL)
        return kt__error(KT_EINVAL, "kt_comm_abort: comm is NULL");
    if (status == KT_OK)
        return kt__error(KT_EINVAL, "kt_comm_abort: status is KT_OK (nothing failed)");
    if (comm->poison != KT_OK) /* an earlier failure: the one every rank knows */
        return kt__error(comm->poison, "%s", comm->poison_message);
    int origin = comm->rank;
    if (agreed_root(comm, local, comm->poison_message))
        origin = comm->agreed_rank;
    else
        snprintf(comm->poison_message, sizeof comm->poison_message, "rank %d: %.1000s",
                 comm->rank, local);
    comm->poison = status;
    if (comm->size > 1 && comm->ops->abort_local != NULL)
        comm->ops->abort_local(comm, origin, &comm->poison, comm->poison_message);
    else if (comm->size > 1 && comm->ops->abort != NULL)
        comm->ops->abort(comm, status, comm->poison_message);
    return kt__error(comm->poison, "%s", comm->poison_message);
}

/* ---- the single-rank communicator ---------------------------------------------------- */

static void single_destroy(kt_comm *comm) { free(comm); }

/* Unreachable through the front end (it rejects peers other than self and shortcuts every
 * collective for size 1); here so the table is complete. */
static kt_status single_sendrecv(kt_comm *comm, int to, const void *send_buf, size_t send_bytes,
                                 int from, void *recv_buf, size_t recv_bytes, int tag)
{
    (void)comm, (void)to, (void)send_buf, (void)send_bytes, (void)from, (void)recv_buf;
    (void)recv_bytes, (void)tag;
    return kt__error(KT_EINVAL, "kt_comm: a single-rank communicator has no peers");
}

static const kt__comm_ops single_ops = {
    .name = "single",
    .destroy = single_destroy,
    .sendrecv = single_sendrecv,
};

kt_status kt_comm_create_single(kt_comm **comm_out)
{
    if (comm_out != NULL)
        *comm_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    if (comm_out == NULL)
        return kt__error(KT_EINVAL, "kt_comm_create_single: comm_out is NULL");
    int timeout_ms = 60000; /* nothing waits in a single-rank communicator: no env lookup */
    kt_comm *c = malloc(sizeof *c);
    if (c == NULL)
        return kt__error(KT_ENOMEM, "kt_comm_create_single: out of memory");
    kt__comm_init(c, &single_ops, 0, 1, timeout_ms);
    *comm_out = c;
    return KT_OK;
}
