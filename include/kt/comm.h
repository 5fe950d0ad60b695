/* Communication between ranks: the kt_comm interface.
 *
 * A communicator connects `size` ranks (processes on one machine or many). Graph ops that
 * need the network (the distributed MoE, the context-parallel halo exchange) talk only to
 * this interface. Two implementations: a single-rank one that is always there (the embedded
 * build), and UCX tag messaging (comm_ucx/, when built with UCX).
 *
 * Every blocking call has a deadline (kt_comm_set_timeout, or KT_COMM_TIMEOUT_MS from the
 * environment) and fails with KT_ETIMEDOUT or KT_EPEER naming the peer and the operation;
 * nothing waits forever. After a failure the communicator is poisoned: every later call
 * fails at once with the original error. Collectives must be called by every rank in the
 * same order; a mismatch (different operation or sequence) is detected and reported.
 */
#ifndef KT_COMM_H
#define KT_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_comm kt_comm;

typedef enum kt_reduce_op { KT_REDUCE_SUM = 0, KT_REDUCE_MEAN = 1 } kt_reduce_op;

typedef enum kt_comm_transport {
    KT_COMM_TRANSPORT_DEFAULT = 0, /* what UCX picks (shared memory on one host) */
    KT_COMM_TRANSPORT_SHM = 1,
    KT_COMM_TRANSPORT_TCP = 2
} kt_comm_transport;

typedef struct kt_comm_options {
    /* Rank, world size and the rendezvous address. Zero / NULL: read from the environment:
     * KT_RANK / KT_WORLD_SIZE / KT_MASTER_ADDR / KT_MASTER_PORT, else torchrun's RANK /
     * WORLD_SIZE / MASTER_ADDR / MASTER_PORT, else Open MPI's OMPI_COMM_WORLD_RANK /
     * OMPI_COMM_WORLD_SIZE, else Slurm's SLURM_PROCID / SLURM_NTASKS. */
    int rank, world_size; /* world_size 0: from the environment */
    const char *master_addr;
    int master_port;
    kt_comm_transport transport; /* DEFAULT: KT_COMM_TRANSPORT (shm|tcp), else UCX's choice */
    int timeout_ms; /* 0: KT_COMM_TIMEOUT_MS or 60000 */
    /* The job's identity (at most 127 bytes): the master refuses a process of another job
     * that reaches its port. NULL: KT_JOB_ID (kt-launch sets a random one per launch), else
     * TORCHELASTIC_RUN_ID, SLURM_JOB_ID.SLURM_STEP_ID, Open MPI's OMPI_MCA_ess_base_jobid,
     * PMIX_NAMESPACE; with none of them the job is unnamed, and unnamed jobs cannot be told
     * apart from each other (docs/parallel.md). */
    const char *job_id;
} kt_comm_options;

/* A communicator of one rank: collectives are copies, send/recv to self fail. */
kt_status kt_comm_create_single(kt_comm **comm_out);
/* The UCX communicator (KT_EUNSUPPORTED in a build without UCX). Blocks until every rank
 * has joined or the timeout expires. */
kt_status kt_comm_create_ucx(const kt_comm_options *options, kt_comm **comm_out);
/* Lifetime: not reference-counted. A session, program or MoE layer that uses the
 * communicator does not own it: destroy it after every session created with it. On failure
 * the create functions leave *comm_out NULL. */
void kt_comm_destroy(kt_comm *comm);

int kt_comm_rank(const kt_comm *comm);
int kt_comm_size(const kt_comm *comm);
kt_status kt_comm_set_timeout(kt_comm *comm, int timeout_ms);
/* The poisoning error, or KT_OK. */
kt_status kt_comm_status(const kt_comm *comm);

/* Point to point (tag: the caller's channel, 0..65535). */
kt_status kt_comm_send(kt_comm *comm, int peer, int tag, const void *buf, size_t bytes);
kt_status kt_comm_recv(kt_comm *comm, int peer, int tag, void *buf, size_t bytes);
/* Sends to `to` and receives from `from` at once (either may be -1 for none): the halo
 * exchange's step, without the deadlock of two blocking sends. */
kt_status kt_comm_sendrecv(kt_comm *comm, int to, const void *send_buf, size_t send_bytes,
                           int from, void *recv_buf, size_t recv_bytes, int tag);

/* Collectives */
kt_status kt_comm_barrier(kt_comm *comm);
kt_status kt_comm_broadcast(kt_comm *comm, void *buf, size_t bytes, int root);
/* Every rank's `bytes` in rank order into recv (size * bytes). */
kt_status kt_comm_all_gather(kt_comm *comm, const void *send, size_t bytes, void *recv);
/* Variable-length blocks: rank r contributes counts[r] bytes; root receives them in rank
 * order into recv. counts must be the same on every rank. */
kt_status kt_comm_gatherv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                          int root);
/* The inverse: root's send holds counts[r] bytes for each rank r, in rank order. */
kt_status kt_comm_scatterv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                           int root);
/* In place; f32 or bf16 (accumulated in f32). */
kt_status kt_comm_all_reduce(kt_comm *comm, void *buf, size_t count, kt_dtype dtype,
                             kt_reduce_op op);

/* Rank r receives, into recv (count elements), the sum (or mean) over every rank of block r
 * of send (size * count elements in rank order); f32 or bf16 (accumulated in f32). recv may
 * be this rank's block of send. Every rank holds the same bits a one-rank sum would give for
 * its block only up to the order of the additions, which is fixed (the same on every run). */
kt_status kt_comm_reduce_scatter(kt_comm *comm, const void *send, void *recv, size_t count,
                                 kt_dtype dtype, kt_reduce_op op);
/* Every rank sends send_bytes[p] bytes to rank p (blocks of send in rank order) and receives
 * recv_bytes[p] bytes from rank p (blocks of recv in rank order); the block for itself is
 * copied. recv_bytes[p] must equal what p sends to this rank (a mismatch fails with
 * KT_ESTATE naming the peer): exchange the counts first (kt_comm_all_gather) when only the
 * sender knows them. */
kt_status kt_comm_all_to_all_v(kt_comm *comm, const void *send, const size_t *send_bytes,
                               void *recv, const size_t *recv_bytes);

/* Error synchronisation: every rank calls it with its own status (and kt_last_error() as
 * the message when it failed). Returns KT_OK on every rank when all succeeded; otherwise
 * every rank returns the status and the message of the lowest failing rank. */
kt_status kt_comm_agree(kt_comm *comm, kt_status local);

/* This rank stops because of its own failure (status, with kt_last_error() as the message):
 * the communicator is poisoned with "rank R: <message>" and every peer is told, so that a
 * peer waiting in (or entering) any collective fails at once with that message instead of
 * a mismatch or its deadline. When lower ranks fail at about the same time (within a short
 * grace: a quarter of the timeout, at most a second), every rank ends with the lowest
 * one's message. Returns that root cause (status and kt_last_error()) on every rank:
 * - the communicator was poisoned already (a peer's notice, a dead or stopped peer): that
 *   earlier error, unchanged;
 * - the message holds the result of the last kt_comm_agree that failed ("rank L: ..."):
 *   rank L's failure, with the caller's context moved after "rank L: " (every rank that
 *   agreed builds the same text);
 * - otherwise this rank's own failure (or a lower rank's that came within the grace).
 * KT_EINVAL without poisoning for a NULL comm or status KT_OK. */
kt_status kt_comm_abort(kt_comm *comm, kt_status status);

#ifdef __cplusplus
}
#endif
#endif
