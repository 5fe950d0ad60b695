/* The kt_comm object: a vtable so graph code calls kt_comm_* whatever the backend.
 *
 * The front end (comm.c) owns everything backends must not get wrong in different ways:
 * argument checks (an invalid argument fails without poisoning, so the caller can fix it),
 * the poisoned state (the first backend failure is recorded and every later call returns it
 * at once) and the single-rank shortcuts. Backends see only valid arguments, size > 1 for
 * collectives, and a communicator that is not poisoned. */
#ifndef KT_COMM_INTERNAL_H
#define KT_COMM_INTERNAL_H

#include "kt/comm.h"

#define KT__COMM_MSG_MAX 1024 /* the size of the thread-local error buffer (core/status.c) */

typedef struct kt__comm_ops {
    const char *name;
    void (*destroy)(kt_comm *comm);
    /* Called once, when the front end poisons the communicator after a backend failure:
     * tell the peers (so they fail fast instead of waiting for their deadline) and release
     * whatever still references caller memory. Must not block longer than a short bound. */
    void (*abort)(kt_comm *comm, kt_status status, const char *message);
    kt_status (*sendrecv)(kt_comm *comm, int to, const void *send_buf, size_t send_bytes, int from,
                          void *recv_buf, size_t recv_bytes, int tag);
    kt_status (*barrier)(kt_comm *comm);
    kt_status (*broadcast)(kt_comm *comm, void *buf, size_t bytes, int root);
    kt_status (*all_gather)(kt_comm *comm, const void *send, size_t bytes, void *recv);
    kt_status (*gatherv)(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                         int root);
    kt_status (*scatterv)(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                          int root);
    kt_status (*all_reduce)(kt_comm *comm, void *buf, size_t count, kt_dtype dtype,
                            kt_reduce_op op);
    kt_status (*reduce_scatter)(kt_comm *comm, const void *send, void *recv, size_t count,
                                kt_dtype dtype, kt_reduce_op op);
    kt_status (*all_to_all_v)(kt_comm *comm, const void *send, const size_t *send_bytes,
                              void *recv, const size_t *recv_bytes);
    /* Exchanges every rank's status; on success *lowest_out is the lowest failing rank (or -1)
     * and its status and message are in *status_out / message_out. A failure of the exchange
     * itself is returned (and poisons). */
    kt_status (*agree)(kt_comm *comm, kt_status local, const char *local_message,
                       int *lowest_out, kt_status *status_out,
                       char message_out[KT__COMM_MSG_MAX]);
    /* kt_comm_abort, after the front end poisoned the communicator with *status / message:
     * the failure of rank `origin` (this rank, or the lowest failing rank of a failed
     * agree). Tells the peers; when origin is this rank, waits a short grace for the notices
     * of lower ranks that failed too and, when one came, puts the lowest one's status and
     * text in *status / message. Then releases what references caller memory, like abort.
     * NULL: the front end calls abort instead. */
    void (*abort_local)(kt_comm *comm, int origin, kt_status *status,
                        char message[KT__COMM_MSG_MAX]);
} kt__comm_ops;

struct kt_comm {
    const kt__comm_ops *ops;
    int rank, size;
    int timeout_ms;
    kt_status poison; /* KT_OK while usable */
    char poison_message[KT__COMM_MSG_MAX];
    /* the last kt_comm_agree's lowest failing rank (-1: it succeeded) and its result
     * ("rank L: ..."), so that kt_comm_abort knows a failure every rank has learned already */
    int agreed_rank;
    char agreed_message[KT__COMM_MSG_MAX];
};

/* Fills the common part of a backend's communicator (which embeds struct kt_comm first). */
void kt__comm_init(kt_comm *comm, const kt__comm_ops *ops, int rank, int size, int timeout_ms);

/* The timeout from KT_COMM_TIMEOUT_MS, or 60000; KT_EINVAL for a malformed value. */
kt_status kt__comm_env_timeout(int *timeout_ms_out);

/* Deterministic reduction shared by the backends: acc[i] += bf16/f32 src[i] in f32. */
void kt__comm_accumulate(float *acc, const void *src, size_t count, kt_dtype dtype);

#endif
