/* The UCX communicator's internals, shared by its files (bootstrap, engine, collectives). */
#ifndef KT_COMM_UCX_INTERNAL_H
#define KT_COMM_UCX_INTERNAL_H

#include <stdint.h>

#include <ucp/api/ucp.h>

#include "lib/comm/comm_internal.h"

/* Tag layout (64 bits), so that a message can only match the receive it was meant for:
 *
 *   63..62 class   0 = point to point, 1 = collective, 2 = abort notice
 *   61..58 kind    the collective (kt__ucx_kind); 0 for point to point
 *   57..36 seq     the communicator's collective sequence number (mod 2^22)
 *   35..16 src     the sending rank (a tag receive matches any endpoint on the worker)
 *   15..0  low     the caller's tag for point to point; the step inside a collective
 *
 * Point-to-point receives match every bit. Collective receives match class, seq and src but
 * not kind and step, which are checked after completion: a rank that entered a different
 * collective with the same sequence number then sees its peer's message and reports the
 * mismatch at once, instead of both ranks waiting for their deadlines. Abort notices match
 * on class only (any sender). There is no communicator id: each communicator has its own
 * UCX context and worker. */
#define KT__TAG_CLASS_P2P 0ull
#define KT__TAG_CLASS_COLL 1ull
#define KT__TAG_CLASS_ABORT 2ull
#define KT__TAG_SEQ_BITS 22
#define KT__TAG_SRC_BITS 20

typedef enum kt__ucx_kind {
    KT__KIND_P2P = 0,
    KT__KIND_BARRIER,
    KT__KIND_BROADCAST,
    KT__KIND_ALL_GATHER,
    KT__KIND_GATHERV,
    KT__KIND_SCATTERV,
    KT__KIND_ALL_REDUCE,
    KT__KIND_AGREE,
    KT__KIND_REDUCE_SCATTER,
    KT__KIND_ALL_TO_ALL_V,
    KT__KIND_COUNT
} kt__ucx_kind;

static inline ucp_tag_t kt__tag_make(uint64_t cls, unsigned kind, uint32_t seq, int src,
                                     unsigned low)
{
    return (cls << 62) | ((uint64_t)(kind & 0xfu) << 58) |
           ((uint64_t)(seq & ((1u << KT__TAG_SEQ_BITS) - 1)) << 36) |
           ((uint64_t)((unsigned)src & ((1u << KT__TAG_SRC_BITS) - 1)) << 16) | (low & 0xffffu);
}
#define KT__TAG_MASK_FULL (~(ucp_tag_t)0)
#define KT__TAG_MASK_COLL (~(((ucp_tag_t)0xf << 58) | (ucp_tag_t)0xffff))
#define KT__TAG_MASK_CLASS ((ucp_tag_t)3 << 62)
static inline unsigned kt__tag_kind(ucp_tag_t t) { return (unsigned)((t >> 58) & 0xf); }
static inline unsigned kt__tag_low(ucp_tag_t t) { return (unsigned)(t & 0xffff); }
static inline uint32_t kt__tag_seq(ucp_tag_t t)
{
    return (uint32_t)((t >> 36) & ((1u << KT__TAG_SEQ_BITS) - 1));
}

/* The abort notice: a failing rank sends it to every peer so they stop waiting. `blame` is
 * the peer it was waiting for when it timed out (or that failed), -1 if none: a rank that
 * learns a peer was only waiting for it keeps waiting, so the message that finally comes
 * out names the rank at the end of the chain (the stopped one), not a bystander. */
typedef struct kt__ucx_abort_msg {
    int32_t status;
    int32_t blame;
    /* the rank whose own failure (kt_comm_abort) this notice tells, also when another rank
     * passes it on; -1 for a failure of the communication itself (a deadline, a dead peer) */
    int32_t origin;
    char text[KT__COMM_MSG_MAX];
} kt__ucx_abort_msg;

typedef struct kt__ucx_comm kt__ucx_comm;

typedef struct kt__ucx_peer {
    kt__ucx_comm *comm;
    int rank;
    ucp_ep_h ep;
    ucs_status_t failed; /* set by the endpoint's error callback; UCS_OK while healthy */
    /* point-to-point messages posted to / from this peer (any tag), to name them in errors:
     * the tag layout has no room for a point-to-point sequence number */
    uint32_t sent, received;
    /* the peer this peer's abort notice blamed (it waited for it, or heard of the failure
     * from it), -1 if none: in a ring every rank waits for its neighbour, and these links
     * lead to the rank that went quiet */
    int waits_for;
} kt__ucx_peer;

struct kt__ucx_comm {
    struct kt_comm base; /* first: the front end sees a kt_comm */
    ucp_context_h context;
    ucp_worker_h worker;
    kt__ucx_peer *peers; /* size entries; peers[rank].ep is NULL */
    int eps_closed;
    uint32_t seq; /* the next collective's sequence number */
    void *abort_req; /* the posted receive of abort notices from any peer */
    int blame;       /* the peer the last failed wait names, for the abort notice */
    int notified;    /* the abort notices went out already */
    int origin;      /* the failing rank the poison names (kt__ucx_abort_msg.origin), or -1 */
    uint32_t send_flags; /* ucp_tag_send_nbx op_attr_mask for data (FAST_CMPL or not) */
    kt__ucx_abort_msg abort_in;
    void *scratch; /* the collectives' arena (coll_plan.h), made with the communicator */
    size_t scratch_bytes;
    /* request slots of the collectives, allocated once: two levels, because all_reduce
     * runs a broadcast step while its own requests are held */
    struct kt__ucx_req *reqs;
    int reqs_per_level, reqs_depth;
};

/* One outstanding operation of a collective or point-to-point call. */
typedef struct kt__ucx_req {
    void *req;      /* NULL once complete (or when it completed at once) */
    int peer;
    int is_recv;
    unsigned step;  /* the step a collective receive expects (checked after completion) */
    size_t bytes;   /* receive: the length expected exactly */
    uint32_t nth;   /* point to point: this message's number among those to / from peer */
} kt__ucx_req;

/* What a wait is for, to name it in messages: "broadcast #12". */
typedef struct kt__ucx_op {
    kt__ucx_kind kind;
    uint32_t seq;
} kt__ucx_op;

const char *kt__ucx_kind_name(unsigned kind);

/* Posts a send / receive into *r. Point-to-point when op->kind is KT__KIND_P2P (low = the
 * caller's tag), else a collective message of op with the given step. */
kt_status kt__ucx_post_send(kt__ucx_comm *c, const kt__ucx_op *op, unsigned low, int peer,
                            const void *buf, size_t bytes, kt__ucx_req *r);
kt_status kt__ucx_post_recv(kt__ucx_comm *c, const kt__ucx_op *op, unsigned low, int peer,
                            void *buf, size_t bytes, kt__ucx_req *r);
/* Waits for all of reqs[0..n) within the communicator's deadline. On failure every request
 * still pending is cancelled and released, and the error names the peer and operation. */
kt_status kt__ucx_wait(kt__ucx_comm *c, const kt__ucx_op *op, kt__ucx_req *reqs, int n);
/* Releases reqs[0..n) after a posting failure part-way through a collective. */
void kt__ucx_drop(kt__ucx_comm *c, kt__ucx_req *reqs, int n);

/* The collectives' request slots and pipeline arena (in reqs and scratch), made once with
 * the communicator so that no collective allocates; freed by the destroy. */
kt_status kt__ucx_coll_init(kt__ucx_comm *c);
/* Collectives (collectives.c), for the ops table. */
kt_status kt__ucx_barrier(kt_comm *comm);
kt_status kt__ucx_broadcast(kt_comm *comm, void *buf, size_t bytes, int root);
kt_status kt__ucx_all_gather(kt_comm *comm, const void *send, size_t bytes, void *recv);
kt_status kt__ucx_gatherv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                          int root);
kt_status kt__ucx_scatterv(kt_comm *comm, const void *send, const size_t *counts, void *recv,
                           int root);
kt_status kt__ucx_all_reduce(kt_comm *comm, void *buf, size_t count, kt_dtype dtype,
                             kt_reduce_op op);
kt_status kt__ucx_reduce_scatter(kt_comm *comm, const void *send, void *recv, size_t count,
                                 kt_dtype dtype, kt_reduce_op op);
kt_status kt__ucx_all_to_all_v(kt_comm *comm, const void *send, const size_t *send_bytes,
                               void *recv, const size_t *recv_bytes);
kt_status kt__ucx_agree(kt_comm *comm, kt_status local, const char *local_message,
                        int *lowest_out, kt_status *status_out,
                        char message_out[KT__COMM_MSG_MAX]);

/* ---- bootstrap (bootstrap.c) ------------------------------------------------------------ */

typedef struct kt__ucx_setup {
    int rank, size;
    char master_addr[256];
    int master_port;
    kt_comm_transport transport;
    int timeout_ms;
    char job_id[128]; /* "" when the job is unnamed */
} kt__ucx_setup;

/* The job id as messages show it: quoted, or "(unnamed)". */
const char *kt__ucx_job_name(const kt__ucx_setup *s, char buf[136]);

/* Rank 0's address when none is given, from the site launcher's variables (master_addr.c):
 * source is the variable the rank came from ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", ...). */
kt_status kt__ucx_default_master(const char *source, int size, char out[256]);

/* Options, else the environment (KT_*, torchrun, Open MPI, Slurm), with defaults. */
kt_status kt__ucx_resolve(const kt_comm_options *options, kt__ucx_setup *setup_out);

/* The TCP rendezvous at the master: every rank gives its worker address and receives all of
 * them (addrs[r], lens[r]; one malloc'd block in *block_out). */
typedef struct kt__ucx_boot kt__ucx_boot;
kt_status kt__ucx_rendezvous(const kt__ucx_setup *s, const void *addr, size_t addr_len,
                             kt__ucx_boot **boot_out, void **block_out,
                             const void ***addrs_out, size_t **lens_out);
/* After every rank created its endpoints: each reports its status to the master, which
 * answers with the first failure (or success) to all; then the sockets are closed. */
kt_status kt__ucx_rendezvous_finish(kt__ucx_boot *boot, kt_status local, const char *message);
void kt__ucx_boot_close(kt__ucx_boot *boot);

/* Milliseconds on the monotonic clock. */
int64_t kt__ucx_now_ms(void);

#endif
