/* The UCX communicator: context, worker, endpoints, and the wait loop every operation ends in.
 *
 * Facts this follows (measured on UCX 1.13, shared/research/baseline_comm.md):
 * - A posted tag receive is never completed by a peer's death, in any error mode: the wait
 *   loop has its own deadline and cancels what is still posted.
 * - Peer error mode (needed to hear about a dead peer at all) drops shared memory unless
 *   UCX_POSIX_ERROR_HANDLING / UCX_SYSV_ERROR_HANDLING are set, leaving TCP loopback at 40x
 *   the latency; they are set here (unless the user set them) whenever shm may be used.
 * - A stopped (SIGSTOP) peer is reported by nothing in UCX; only the deadline catches it.
 * - Force-closing an endpoint completes its outstanding sends, so no caller buffer is left
 *   referenced after a failure; it needs peer error mode on both sides, which is always on.
 * The communicator is not thread-safe: one thread at a time (the worker is SERIALIZED). */
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ucs/config/global_opts.h>

#include "comm_ucx/ucx_internal.h"
#include "lib/core/error.h"

#define ABORT_GRACE_MS 300 /* how long a failing rank spends telling its peers */
#define CLOSE_GRACE_MS 1000

static const char *const kind_names[KT__KIND_COUNT] = {
    "send/recv", "barrier", "broadcast", "all_gather", "gatherv", "scatterv", "all_reduce",
    "agree", "reduce_scatter", "all_to_all_v"};

const char *kt__ucx_kind_name(unsigned kind)
{
    return kind < KT__KIND_COUNT ? kind_names[kind] : "unknown operation";
}

/* Runs from inside ucp_worker_progress (UCX schedules it there), so it only records. */
static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kt__ucx_peer *p = arg;
    (void)ep;
    if (p->failed == UCS_OK)
        p->failed = status != UCS_OK ? status : UCS_ERR_CONNECTION_RESET;
}

/* Progress until no request in reqs is pending or the grace period ends; used only on the
 * way out, after a failure. */
static void progress_until_done(kt__ucx_comm *c, void **reqs, int n, int grace_ms)
{
    int64_t end = kt__ucx_now_ms() + grace_ms;
    for (;;) {
        int pending = 0;
        for (int i = 0; i < n; i++) {
            if (reqs[i] == NULL)
                continue;
            if (ucp_request_check_status(reqs[i]) == UCS_INPROGRESS) {
                pending = 1;
            } else {
                ucp_request_free(reqs[i]);
                reqs[i] = NULL;
            }
        }
        if (!pending || kt__ucx_now_ms() >= end)
            break;
        if (ucp_worker_progress(c->worker) == 0)
            sched_yield();
    }
    for (int i = 0; i < n; i++)
        if (reqs[i] != NULL)
            ucp_request_free(reqs[i]); /* released by UCX when it completes */
}

/* ---- posting and waiting ----------------------------------------------------------------- */

static ucp_tag_t op_tag(const kt__ucx_op *op, unsigned low, int src)
{
    return op->kind == KT__KIND_P2P
               ? kt__tag_make(KT__TAG_CLASS_P2P, 0, 0, src, low)
               : kt__tag_make(KT__TAG_CLASS_COLL, op->kind, op->seq, src, low);
}

/* What a request is, for messages: "broadcast #12", or for point to point "recv #3 (tag 7)",
 * the fourth message from that peer. */
typedef struct op_label {
    char s[64];
} op_label;

static op_label label(const kt__ucx_op *op, const kt__ucx_req *r)
{
    op_label l;
    if (op->kind == KT__KIND_P2P && r == NULL)
        snprintf(l.s, sizeof l.s, "a point-to-point wait");
    else if (op->kind == KT__KIND_P2P)
        snprintf(l.s, sizeof l.s, "%s #%u (tag %u)", r->is_recv ? "recv" : "send", r->nth,
                 r->step);
    else
        snprintf(l.s, sizeof l.s, "%s #%u", kt__ucx_kind_name(op->kind), op->seq);
    return l;
}

static kt_status peer_failed_error(kt__ucx_comm *c, const kt__ucx_op *op, const kt__ucx_req *r,
                                   int peer)
{
    return kt__error(KT_EPEER, "rank %d: peer %d failed during %s (%s)", c->base.rank, peer,
                     label(op, r).s, ucs_status_string(c->peers[peer].failed));
}

kt_status kt__ucx_post_send(kt__ucx_comm *c, const kt__ucx_op *op, unsigned low, int peer,
                            const void *buf, size_t bytes, kt__ucx_req *r)
{
    static const char empty = 0;
    *r = (kt__ucx_req){.req = NULL, .peer = peer, .is_recv = 0, .step = low, .bytes = bytes,
                       .nth = op->kind == KT__KIND_P2P ? c->peers[peer].sent++ : 0};
    if (c->peers[peer].failed != UCS_OK)
        return peer_failed_error(c, op, r, peer);
    /* FAST_CMPL: every send is waited for at once, and it keeps messages up to UCX's local
     * threshold on the eager path (64 KiB exchange 2.7 instead of 6.2 us, note 2.6). Not
     * over TCP, where that eager path is the slow one (kt-bench comm --transport tcp: 16 KiB
     * one-way 14 us with the flag, 5 without; 64 KiB 40 and 23). */
    ucp_request_param_t prm = {.op_attr_mask = c->send_flags};
    ucs_status_ptr_t p = ucp_tag_send_nbx(c->peers[peer].ep, bytes ? buf : &empty, bytes,
                                          op_tag(op, low, c->base.rank), &prm);
    if (UCS_PTR_IS_ERR(p))
        return kt__error(KT_EPEER, "rank %d: sending %s to peer %d failed: %s", c->base.rank,
                         label(op, r).s, peer, ucs_status_string(UCS_PTR_STATUS(p)));
    r->req = p; /* NULL: already complete */
    return KT_OK;
}

kt_status kt__ucx_post_recv(kt__ucx_comm *c, const kt__ucx_op *op, unsigned low, int peer,
                            void *buf, size_t bytes, kt__ucx_req *r)
{
    static char empty;
    *r = (kt__ucx_req){.req = NULL, .peer = peer, .is_recv = 1, .step = low, .bytes = bytes,
                       .nth = op->kind == KT__KIND_P2P ? c->peers[peer].received++ : 0};
    /* A request always comes back, so the received tag and length can be checked. */
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL};
    ucp_tag_t mask = op->kind == KT__KIND_P2P ? KT__TAG_MASK_FULL : KT__TAG_MASK_COLL;
    ucs_status_ptr_t p = ucp_tag_recv_nbx(c->worker, bytes ? buf : &empty, bytes,
                                          op_tag(op, low, peer), mask, &prm);
    if (UCS_PTR_IS_ERR(p))
        return kt__error(KT_EINTERNAL, "rank %d: posting the receive of %s from peer %d "
                         "failed: %s", c->base.rank, label(op, r).s, peer,
                         ucs_status_string(UCS_PTR_STATUS(p)));
    r->req = p;
    return KT_OK;
}

/* Cancels the receives, then gives the requests a short grace to complete before they are
 * released (UCX frees a released request when it completes). No allocation: it runs on
 * every failure path, and the steady state must not allocate at all. */
void kt__ucx_drop(kt__ucx_comm *c, kt__ucx_req *reqs, int n)
{
    int pending = 0;
    for (int i = 0; i < n; i++) {
        if (reqs[i].req == NULL)
            continue;
        pending = 1;
        if (reqs[i].is_recv)
            ucp_request_cancel(c->worker, reqs[i].req);
    }
    int64_t end = pending ? kt__ucx_now_ms() + ABORT_GRACE_MS : 0;
    while (pending) {
        pending = 0;
        for (int i = 0; i < n; i++) {
            if (reqs[i].req == NULL)
                continue;
            if (ucp_request_check_status(reqs[i].req) == UCS_INPROGRESS) {
                pending = 1;
            } else {
                ucp_request_free(reqs[i].req);
                reqs[i].req = NULL;
            }
        }
        if (!pending || kt__ucx_now_ms() >= end)
            break;
        if (ucp_worker_progress(c->worker) == 0)
            sched_yield();
    }
    for (int i = 0; i < n; i++) {
        if (reqs[i].req != NULL)
            ucp_request_free(reqs[i].req);
        reqs[i].req = NULL;
    }
}

/* Checks a completed receive: status, length, and that the sender was in the same
 * collective (kind and step are not part of the match, see ucx_internal.h). */
static kt_status check_recv(kt__ucx_comm *c, const kt__ucx_op *op, const kt__ucx_req *r,
                            ucs_status_t s, const ucp_tag_recv_info_t *info)
{
    const op_label l = label(op, r);
    const char *name = l.s;
    int rank = c->base.rank;
    if (s == UCS_ERR_MESSAGE_TRUNCATED)
        return kt__error(op->kind == KT__KIND_P2P ? KT_EINVAL : KT_ESTATE,
                         "rank %d: %s: the message from peer %d for %s is larger than the "
                         "%zu bytes expected", rank,
                         op->kind == KT__KIND_P2P ? "message too long"
                                                  : "mismatched collectives or counts",
                         r->peer, name, r->bytes);
    if (s != UCS_OK)
        return kt__error(KT_EPEER, "rank %d: receiving %s from peer %d failed: %s", rank,
                         name, r->peer, ucs_status_string(s));
    if (op->kind != KT__KIND_P2P) {
        unsigned kind = kt__tag_kind(info->sender_tag);
        if (kind != (unsigned)op->kind || kt__tag_low(info->sender_tag) != r->step)
            return kt__error(KT_ESTATE, "rank %d: mismatched collectives: this rank is in %s "
                             "but peer %d sent %s #%u (every rank must call the same collectives "
                             "in the same order)", rank, name, r->peer,
                             kt__ucx_kind_name(kind), kt__tag_seq(info->sender_tag));
    }
    if (info->length != r->bytes)
        return kt__error(op->kind == KT__KIND_P2P ? KT_EINVAL : KT_ESTATE,
                         "rank %d: %s: peer %d sent %zu bytes, %zu expected", rank, name,
                         r->peer, info->length, r->bytes);
    return KT_OK;
}

static kt_status post_abort_recv(kt__ucx_comm *c)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL};
    ucs_status_ptr_t p = ucp_tag_recv_nbx(c->worker, &c->abort_in, sizeof c->abort_in,
                                          kt__tag_make(KT__TAG_CLASS_ABORT, 0, 0, 0, 0),
                                          KT__TAG_MASK_CLASS, &prm);
    if (UCS_PTR_IS_ERR(p))
        return kt__error(KT_EINTERNAL, "rank %d: posting the abort receive failed: %s",
                         c->base.rank, ucs_status_string(UCS_PTR_STATUS(p)));
    c->abort_req = p;
    return KT_OK;
}

/* Checks for an abort notice from a peer. Returns 1 with *src_out and the text in
 * c->abort_in when one arrived that this rank must act on. A peer's death or a protocol
 * error always counts; a peer's timeout counts only when this rank waits for that peer
 * (reqs[0..n) pending): a bystander that timed out waiting for the same stuck rank, or a
 * peer that waited for this rank, says nothing about who is at fault, and this rank's own
 * deadline comes soon. Ignored notices are dropped and the receive posted again. */
static int abort_arrived(kt__ucx_comm *c, const kt__ucx_req *reqs, int n, int *src_out)
{
    while (c->abort_req != NULL) {
        ucp_tag_recv_info_t info;
        ucs_status_t s = ucp_tag_recv_request_test(c->abort_req, &info);
        if (s == UCS_INPROGRESS)
            return 0;
        ucp_request_free(c->abort_req);
        c->abort_req = NULL;
        if (s != UCS_OK && s != UCS_ERR_MESSAGE_TRUNCATED)
            return 0;
        int src = (int)((info.sender_tag >> 16) & ((1u << KT__TAG_SRC_BITS) - 1));
        size_t head = offsetof(kt__ucx_abort_msg, text);
        size_t len = info.length > head ? info.length - head : 0;
        if (len >= sizeof c->abort_in.text)
            len = sizeof c->abort_in.text - 1;
        c->abort_in.text[len] = '\0';
        if (info.length < head) /* not a notice of this version: a failure without details */
            c->abort_in = (kt__ucx_abort_msg){.status = KT_EPEER, .blame = -1, .origin = -1};
        else if (src < c->base.size) /* whom its failure came through */
            c->peers[src].waits_for = c->abort_in.blame;
        int relevant = c->abort_in.status != KT_ETIMEDOUT || c->abort_in.origin >= 0;
        for (int i = 0; i < n && !relevant; i++)
            relevant = reqs[i].req != NULL && reqs[i].peer == src &&
                       c->abort_in.blame != c->base.rank;
        if (!relevant) {
            if (post_abort_recv(c) != KT_OK)
                return 0;
            continue;
        }
        *src_out = src;
        return 1;
    }
    return 0;
}

/* Tells every live peer why this rank stops, so they fail now instead of at their deadline.
 * Bounded: a stopped peer never takes the message, and the send is left behind. */
static void send_notices(kt__ucx_comm *c, kt_status status, const char *message)
{
    int n = c->base.size;
    if (c->notified || c->eps_closed)
        return;
    c->notified = 1;
    kt__ucx_abort_msg *msg = malloc(sizeof *msg);
    void **reqs = calloc(2 * (size_t)n, sizeof *reqs); /* the notices, then the flushes */
    if (msg != NULL && reqs != NULL) {
        msg->status = (int32_t)status;
        msg->blame = (int32_t)c->blame;
        msg->origin = (int32_t)c->origin;
        snprintf(msg->text, sizeof msg->text, "%s", message);
        size_t len = offsetof(kt__ucx_abort_msg, text) + strlen(msg->text) + 1;
        ucp_tag_t tag = kt__tag_make(KT__TAG_CLASS_ABORT, 0, 0, c->base.rank, 0);
        ucp_request_param_t prm = {.op_attr_mask = 0};
        for (int p = 0; p < n; p++) {
            if (p == c->base.rank || c->peers[p].failed != UCS_OK)
                continue;
            ucs_status_ptr_t r = ucp_tag_send_nbx(c->peers[p].ep, msg, len, tag, &prm);
            if (UCS_PTR_IS_PTR(r))
                reqs[p] = r;
            /* delivered, with what went before it, before the endpoints are force-closed:
             * over TCP a close can discard what the peer has not read yet */
            ucs_status_ptr_t f = ucp_ep_flush_nbx(c->peers[p].ep, &prm);
            if (UCS_PTR_IS_PTR(f))
                reqs[n + p] = f;
        }
        progress_until_done(c, reqs, 2 * n, ABORT_GRACE_MS);
    }
    free(reqs);
    free(msg);
}

/* Sleeping when idle matters here: ranks oversubscribe the cores (4 ranks on 2 CPUs), and a
 * spinning waiter takes the CPU from the peer it waits for. */
static void idle(unsigned *spins)
{
    (*spins)++;
    if (*spins < 64)
        return;
    if (*spins < 2048) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}

/* How long a rank that learned of rank r's own failure listens for a lower rank's: ranks
 * that fail at about the same time (the same bad step everywhere) then all name the lowest. */
static int root_grace_ms(const kt__ucx_comm *c)
{
    return c->base.timeout_ms / 4 < 1000 ? c->base.timeout_ms / 4 : 1000;
}

/* The failure of rank *origin is the story so far (*status, text): listens for the grace
 * period for the notices of lower ranks that failed themselves and keeps the lowest. Other
 * notices (deadlines, relays of the same failure) are dropped. */
static void lowest_root(kt__ucx_comm *c, int *origin, kt_status *status,
                        char text[KT__COMM_MSG_MAX])
{
    int64_t until = kt__ucx_now_ms() + root_grace_ms(c);
    unsigned spins = 0;
    while (*origin > 0 && kt__ucx_now_ms() < until) {
        int src;
        if (c->abort_req == NULL && post_abort_recv(c) != KT_OK)
            return;
        if (abort_arrived(c, NULL, 0, &src)) {
            int o = c->abort_in.origin;
            if (o >= 0 && o < *origin) {
                *origin = o;
                *status = c->abort_in.status < 0 && c->abort_in.status >= KT_EINTERNAL
                              ? (kt_status)c->abort_in.status
                              : KT_EINTERNAL;
                snprintf(text, KT__COMM_MSG_MAX, "%s", c->abort_in.text);
            }
            spins = 0;
            continue;
        }
        if (ucp_worker_progress(c->worker) == 0)
            idle(&spins);
    }
}

/* A peer's notice of a rank's own failure arrived (in c->abort_in): the error every rank
 * reports is that rank's message as it wrote it (or a lower rank's, within the grace). */
static kt_status root_failure(kt__ucx_comm *c)
{
    int origin = c->abort_in.origin;
    kt_status status = c->abort_in.status < 0 && c->abort_in.status >= KT_EINTERNAL
                           ? (kt_status)c->abort_in.status
                           : KT_EINTERNAL;
    char text[KT__COMM_MSG_MAX];
    snprintf(text, sizeof text, "%s",
             c->abort_in.text[0] ? c->abort_in.text : "(no reason given)");
    lowest_root(c, &origin, &status, text);
    c->origin = origin;
    c->blame = origin;
    return kt__error(status, "%s", text);
}

/* Where the deadline notices received so far lead from peer p: the rank every rank in the
 * chain waited for, which said nothing itself. */
static int chain_end(const kt__ucx_comm *c, int p)
{
    for (int hops = 0; hops < c->base.size; hops++) {
        int next = c->peers[p].waits_for;
        if (next < 0 || next >= c->base.size || next == c->base.rank || next == p)
            break;
        p = next;
    }
    return p;
}

/* Listens for the grace period to the deadline notices of the other ranks of a chain of
 * waits (a ring's), recording whom each waited for. Returns 1, the notice in c->abort_in,
 * when one of them is a rank's own failure: that is the root cause, whatever the chain. */
static int settle_chain(kt__ucx_comm *c, unsigned *spins)
{
    int64_t until = kt__ucx_now_ms() + root_grace_ms(c);
    kt__ucx_abort_msg kept = c->abort_in;
    while (kt__ucx_now_ms() < until) {
        int src;
        if (c->abort_req == NULL && post_abort_recv(c) != KT_OK)
            break;
        if (abort_arrived(c, NULL, 0, &src)) {
            if (c->abort_in.origin >= 0)
                return 1;
        } else if (ucp_worker_progress(c->worker) == 0) {
            idle(spins);
        }
    }
    c->abort_in = kept;
    return 0;
}

/* " (...)" naming the end of the chain of waits from peer p when it is another rank. */
typedef struct chain_note {
    char s[96];
} chain_note;

static chain_note chain_text(const kt__ucx_comm *c, int p)
{
    chain_note n = {""};
    int end = chain_end(c, p);
    if (end != p)
        snprintf(n.s, sizeof n.s, " (the chain of waits ends at peer %d, which went quiet)",
                 end);
    return n;
}

kt_status kt__ucx_wait(kt__ucx_comm *c, const kt__ucx_op *op, kt__ucx_req *reqs, int n)
{
    int64_t deadline = kt__ucx_now_ms() + c->base.timeout_ms;
    unsigned spins = 0;
    kt_status st = KT_OK;
    for (;;) {
        if (ucp_worker_progress(c->worker) != 0)
            spins = 0;
        int pending = 0;
        for (int i = 0; i < n && st == KT_OK; i++) {
            kt__ucx_req *r = &reqs[i];
            if (r->req == NULL)
                continue;
            ucs_status_t s;
            ucp_tag_recv_info_t info = {0, 0};
            s = r->is_recv ? ucp_tag_recv_request_test(r->req, &info)
                           : ucp_request_check_status(r->req);
            if (s == UCS_INPROGRESS) {
                pending = 1;
                continue;
            }
            ucp_request_free(r->req);
            r->req = NULL;
            spins = 0;
            if (r->is_recv)
                st = check_recv(c, op, r, s, &info);
            else if (s != UCS_OK)
                st = kt__error(KT_EPEER, "rank %d: sending %s to peer %d failed: %s",
                               c->base.rank, label(op, r).s, r->peer, ucs_status_string(s));
        }
        if (st != KT_OK)
            break;
        if (!pending)
            return KT_OK;
        int src;
        int notice = abort_arrived(c, reqs, n, &src);
        if (notice && c->abort_in.origin >= 0) { /* the peer stopped by its own failure */
            st = root_failure(c);
            break;
        } else if (notice && c->abort_in.blame >= 0 && c->abort_in.blame != src &&
                   c->abort_in.blame != c->base.rank) {
            /* src stopped because of another rank (it timed out waiting for it, or saw it
             * die): that one is named, not src, which only passes the news on; after a
             * timeout the one at the end of the chain of waits (a ring's) */
            int hung = c->abort_in.status == KT_ETIMEDOUT;
            if (hung && settle_chain(c, &spins)) {
                st = root_failure(c);
                break;
            }
            c->blame = hung ? chain_end(c, src) : c->abort_in.blame;
            st = kt__error(hung ? KT_ETIMEDOUT : KT_EPEER, "rank %d: peer %d %s; peer %d "
                           "reports: %s", c->base.rank, c->blame,
                           hung ? "is not responding" : "failed", src, c->abort_in.text);
            break;
        } else if (notice) { /* the peer's communication failed */
            c->blame = src;
            if (c->abort_in.status == KT_ETIMEDOUT && settle_chain(c, &spins)) {
                st = root_failure(c);
                break;
            }
            st = kt__error(KT_EPEER, "rank %d: peer %d failed: %s%s", c->base.rank, src,
                           c->abort_in.text[0] ? c->abort_in.text : "(no reason given)",
                           chain_text(c, src).s);
            break;
        }
        /* A failed peer: name the one this wait needs, else any (the collective cannot
         * finish without every member). */
        int failed = -1;
        const kt__ucx_req *failed_req = NULL;
        for (int i = 0; i < n && failed < 0; i++)
            if (reqs[i].req != NULL && c->peers[reqs[i].peer].failed != UCS_OK) {
                failed = reqs[i].peer;
                failed_req = &reqs[i];
            }
        for (int p = 0; p < c->base.size && failed < 0; p++)
            if (c->peers[p].failed != UCS_OK)
                failed = p;
        if (failed >= 0) {
            /* A peer that failed by itself tells why before it closes its endpoints; the
             * closing may be seen first (a neighbour in a ring that heard of another
             * rank's death): a grace for its notice, which names the root cause. */
            int from = -1;
            int64_t until = kt__ucx_now_ms() + root_grace_ms(c);
            while (kt__ucx_now_ms() < until) {
                int nsrc;
                if (c->abort_req == NULL && post_abort_recv(c) != KT_OK)
                    break;
                if (abort_arrived(c, NULL, 0, &nsrc) && nsrc == failed &&
                    c->abort_in.status != KT_ETIMEDOUT) {
                    from = nsrc;
                    break;
                }
                if (ucp_worker_progress(c->worker) == 0)
                    idle(&spins);
            }
            c->blame = failed;
            if (from >= 0 && c->abort_in.origin >= 0)
                st = root_failure(c);
            else if (from >= 0)
                st = kt__error(KT_EPEER, "rank %d: peer %d failed: %s", c->base.rank, from,
                               c->abort_in.text[0] ? c->abort_in.text : "(no reason given)");
            else
                st = peer_failed_error(c, op, failed_req, failed);
            break;
        }
        if (kt__ucx_now_ms() >= deadline) {
            const kt__ucx_req *r = NULL;
            for (int i = 0; i < n && r == NULL; i++)
                if (reqs[i].req != NULL)
                    r = &reqs[i];
            char mine[KT__COMM_MSG_MAX];
            if (r->is_recv)
                snprintf(mine, sizeof mine, "rank %d timed out after %d ms waiting for %s "
                         "from peer %d", c->base.rank, c->base.timeout_ms, label(op, r).s,
                         r->peer);
            else
                snprintf(mine, sizeof mine, "rank %d timed out after %d ms waiting for peer %d "
                         "to take %s", c->base.rank, c->base.timeout_ms, r->peer,
                         label(op, r).s);
            c->blame = r->peer;
            send_notices(c, KT_ETIMEDOUT, mine);
            /* The peer may itself be waiting for another rank and time out moments later;
             * its notice names the rank at the end of the chain. A short grace for it. */
            int64_t until = kt__ucx_now_ms() + root_grace_ms(c);
            int got = 0;
            while (!(got = abort_arrived(c, reqs, n, &src)) && kt__ucx_now_ms() < until) {
                if (ucp_worker_progress(c->worker) == 0)
                    idle(&spins);
            }
            /* the peers of a chain of waits (a ring) may time out later than this rank:
             * listen for their notices too, so the message names the chain's end */
            int root = got && c->abort_in.origin >= 0;
            if (!root && (got || c->base.size > 2) && settle_chain(c, &spins))
                root = 1;
            if (root)
                st = root_failure(c); /* a peer stopped because of its own failure */
            else if (got && c->abort_in.status == KT_ETIMEDOUT && c->abort_in.blame >= 0 &&
                     c->abort_in.blame != src && c->abort_in.blame != c->base.rank) {
                c->blame = chain_end(c, src); /* the end of the chain: the stuck rank */
                st = kt__error(KT_ETIMEDOUT, "rank %d: peer %d is not responding (%s; peer %d "
                               "reports: %s)", c->base.rank, c->blame, mine, src,
                               c->abort_in.text);
            } else if (got)
                st = kt__error(KT_ETIMEDOUT, "%s; peer %d reports: %s%s", mine, src,
                               c->abort_in.text, chain_text(c, src).s);
            else
                st = kt__error(KT_ETIMEDOUT, "%s%s", mine, chain_text(c, r->peer).s);
            break;
        }
        idle(&spins);
    }
    kt__ucx_drop(c, reqs, n);
    return st;
}

/* ---- point to point -------------------------------------------------------------------------- */

static kt_status ucx_sendrecv(kt_comm *comm, int to, const void *send_buf, size_t send_bytes,
                              int from, void *recv_buf, size_t recv_bytes, int tag)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    kt__ucx_op op = {KT__KIND_P2P, 0};
    kt__ucx_req reqs[2];
    int n = 0;
    kt_status st = KT_OK;
    /* The receive first, so a neighbour's send finds it posted (the halo pattern). */
    if (from >= 0 && (st = kt__ucx_post_recv(c, &op, (unsigned)tag, from, recv_buf, recv_bytes,
                                             &reqs[n])) == KT_OK)
        n++;
    if (st == KT_OK && to >= 0 &&
        (st = kt__ucx_post_send(c, &op, (unsigned)tag, to, send_buf, send_bytes, &reqs[n])) ==
            KT_OK)
        n++;
    if (st != KT_OK) {
        kt__ucx_drop(c, reqs, n);
        return st;
    }
    return kt__ucx_wait(c, &op, reqs, n);
}

/* ---- failure and teardown -------------------------------------------------------------------- */

static void close_endpoints(kt__ucx_comm *c, int force)
{
    if (c->eps_closed)
        return;
    c->eps_closed = 1;
    int n = c->base.size;
    void **reqs = calloc((size_t)n, sizeof *reqs);
    for (int p = 0; p < n; p++) {
        if (c->peers[p].ep == NULL)
            continue;
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                   .flags = force || c->peers[p].failed != UCS_OK
                                                ? UCP_EP_CLOSE_FLAG_FORCE
                                                : 0};
        ucs_status_ptr_t r = ucp_ep_close_nbx(c->peers[p].ep, &prm);
        c->peers[p].ep = NULL;
        if (UCS_PTR_IS_PTR(r)) {
            if (reqs != NULL)
                reqs[p] = r;
            else
                ucp_request_free(r);
        }
    }
    if (reqs != NULL) {
        progress_until_done(c, reqs, n, CLOSE_GRACE_MS);
        free(reqs);
    }
}

static void ucx_abort(kt_comm *comm, kt_status status, const char *message)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    send_notices(c, status, message);
    /* Outstanding sends of the failed operation still point at the caller's buffers; force
     * closing completes them, so nothing is written or read after this returns. */
    close_endpoints(c, 1);
}

static void ucx_abort_local(kt_comm *comm, int origin, kt_status *status,
                            char message[KT__COMM_MSG_MAX])
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    c->origin = origin;
    c->blame = -1;
    send_notices(c, *status, message);
    if (origin == comm->rank) { /* a lower rank may have failed at the same time */
        lowest_root(c, &origin, status, message);
        c->origin = origin;
    }
    close_endpoints(c, 1);
}

/* Messages nobody will receive (after a failure, or a peer's abort notice) are taken off
 * the worker: UCX would otherwise print a warning for each at destroy. */
static void drain_unexpected(kt__ucx_comm *c)
{
    int64_t end = kt__ucx_now_ms() + ABORT_GRACE_MS;
    for (;;) {
        ucp_worker_progress(c->worker);
        ucp_tag_recv_info_t info;
        ucp_tag_message_h msg = ucp_tag_probe_nb(c->worker, 0, 0, 1, &info);
        if (msg == NULL || kt__ucx_now_ms() >= end)
            return;
        void *buf = malloc(info.length ? info.length : 1);
        if (buf == NULL)
            return;
        ucp_request_param_t prm = {.op_attr_mask = 0};
        void *req = ucp_tag_msg_recv_nbx(c->worker, buf, info.length, msg, &prm);
        int done = !UCS_PTR_IS_PTR(req);
        while (!done && kt__ucx_now_ms() < end) {
            ucp_worker_progress(c->worker);
            done = ucp_request_check_status(req) != UCS_INPROGRESS;
        }
        if (UCS_PTR_IS_PTR(req))
            ucp_request_free(req);
        if (!done)
            return; /* UCX may still write into buf: leave it allocated (a bounded leak) */
        free(buf);
    }
}

static void ucx_destroy(kt_comm *comm)
{
    kt__ucx_comm *c = (kt__ucx_comm *)comm;
    if (c->worker != NULL) {
        if (!c->eps_closed && comm->poison == KT_OK) {
            /* All ranks meet before closing, so no rank closes while a peer still waits for
             * its last message; the flush close then delivers what is in flight. */
            int saved = comm->timeout_ms;
            if (comm->timeout_ms > 10000)
                comm->timeout_ms = 10000;
            kt_status st = kt__ucx_barrier(comm);
            comm->timeout_ms = saved;
            if (st != KT_OK)
                ucx_abort(comm, st, kt_last_error());
            close_endpoints(c, 0);
        }
        close_endpoints(c, 1);
        if (c->abort_req != NULL) {
            ucp_request_cancel(c->worker, c->abort_req);
            progress_until_done(c, &c->abort_req, 1, ABORT_GRACE_MS);
            c->abort_req = NULL;
        }
        drain_unexpected(c);
        ucp_worker_destroy(c->worker);
    }
    if (c->context != NULL)
        ucp_cleanup(c->context);
    free(c->peers);
    free(c->scratch);
    free(c->reqs);
    free(c);
}

static const kt__comm_ops ucx_ops = {
    .name = "ucx",
    .destroy = ucx_destroy,
    .abort = ucx_abort,
    .abort_local = ucx_abort_local,
    .sendrecv = ucx_sendrecv,
    .barrier = kt__ucx_barrier,
    .broadcast = kt__ucx_broadcast,
    .all_gather = kt__ucx_all_gather,
    .gatherv = kt__ucx_gatherv,
    .scatterv = kt__ucx_scatterv,
    .all_reduce = kt__ucx_all_reduce,
    .reduce_scatter = kt__ucx_reduce_scatter,
    .all_to_all_v = kt__ucx_all_to_all_v,
    .agree = kt__ucx_agree,
};

/* ---- creation --------------------------------------------------------------------------------- */

static kt_status ucx_error(const kt__ucx_setup *s, const char *what, ucs_status_t us)
{
    return kt__error(KT_EIO, "rank %d: %s failed: %s", s->rank, what, ucs_status_string(us));
}

static kt_status init_context(kt__ucx_comm *c, const kt__ucx_setup *s)
{
    /* Peer error mode keeps shared memory only with these (note section 3); a short
     * keepalive reports a dead peer within about a second instead of 20 s. The user's own
     * settings win (overwrite 0). Set only where shm may be used: UCX warns about variables
     * no transport reads. */
    if (s->transport != KT_COMM_TRANSPORT_TCP) {
        setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
        setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
    }
    setenv("UCX_KEEPALIVE_INTERVAL", "1s", 0);

    /* Expected failures (a peer's death, a peer that went away while we attached to its
     * shared memory) make UCX log errors to stderr; libkt reports them through kt_status and
     * never prints, so UCX's log is limited to fatal errors unless the user chose a level. */
    if (getenv("UCX_LOG_LEVEL") == NULL)
        ucs_global_opts_set_value("LOG_LEVEL", "fatal");

    ucp_config_t *cfg = NULL;
    ucs_status_t us = ucp_config_read("KT", NULL, &cfg);
    if (us != UCS_OK)
        return ucx_error(s, "ucp_config_read", us);
    const char *tls = s->transport == KT_COMM_TRANSPORT_SHM   ? "sm,self"
                      : s->transport == KT_COMM_TRANSPORT_TCP ? "tcp,self"
                                                              : NULL;
    if (tls != NULL && (us = ucp_config_modify(cfg, "TLS", tls)) != UCS_OK) {
        ucp_config_release(cfg);
        return ucx_error(s, "setting UCX_TLS", us);
    }
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES |
                                         UCP_PARAM_FIELD_ESTIMATED_NUM_EPS,
                           .features = UCP_FEATURE_TAG,
                           .estimated_num_eps = (size_t)s->size};
    us = ucp_init(&params, cfg, &c->context);
    ucp_config_release(cfg);
    if (us != UCS_OK) {
        c->context = NULL;
        return ucx_error(s, "ucp_init", us);
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    us = ucp_worker_create(c->context, &wp, &c->worker);
    if (us != UCS_OK) {
        c->worker = NULL;
        return ucx_error(s, "ucp_worker_create", us);
    }
    return KT_OK;
}

static kt_status create_endpoints(kt__ucx_comm *c, const kt__ucx_setup *s, const void **addrs)
{
    for (int p = 0; p < s->size; p++) {
        c->peers[p] = (kt__ucx_peer){.comm = c, .rank = p, .ep = NULL, .failed = UCS_OK,
                                     .waits_for = -1};
        if (p == s->rank)
            continue;
        ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLER,
                              .address = addrs[p],
                              .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                              .err_handler = {.cb = ep_error, .arg = &c->peers[p]}};
        ucs_status_t us = ucp_ep_create(c->worker, &ep, &c->peers[p].ep);
        if (us != UCS_OK) {
            c->peers[p].ep = NULL;
            /* UNREACHABLE here usually means no transport in UCX_TLS supports peer
             * failure (e.g. shm without the error-handling switches). */
            return kt__error(KT_EIO, "rank %d: cannot create the endpoint to peer %d: %s%s",
                             s->rank, p, ucs_status_string(us),
                             us == UCS_ERR_UNREACHABLE
                                 ? " (no transport in UCX_TLS reaches it with peer error "
                                   "handling; check UCX_TLS and UCX_*_ERROR_HANDLING)"
                                 : "");
        }
    }
    return KT_OK;
}

kt_status kt_comm_create_ucx(const kt_comm_options *options, kt_comm **comm_out)
{
    kt__ucx_setup s;
    kt__ucx_boot *boot = NULL;
    void *block = NULL;
    const void **addrs = NULL;
    size_t *lens = NULL;
    ucp_address_t *my_addr = NULL;
    size_t my_len = 0;
    kt__ucx_comm *c = NULL;
    kt_status st;

    if (comm_out == NULL)
        return kt__error(KT_EINVAL, "kt_comm_create_ucx: comm_out is NULL");
    *comm_out = NULL; /* a failed create leaves NULL (SQLite's rule) */
    KT__TRY(kt__ucx_resolve(options, &s));
    c = calloc(1, sizeof *c);
    if (c == NULL)
        return kt__error(KT_ENOMEM, "kt_comm_create_ucx: out of memory");
    kt__comm_init(&c->base, &ucx_ops, s.rank, s.size, s.timeout_ms);
    c->blame = -1;
    c->origin = -1;
    c->send_flags = s.transport == KT_COMM_TRANSPORT_TCP ? 0 : UCP_OP_ATTR_FLAG_FAST_CMPL;
    c->eps_closed = 1; /* until they exist */
    c->peers = calloc((size_t)s.size, sizeof *c->peers);
    if (c->peers == NULL) {
        st = kt__error(KT_ENOMEM, "kt_comm_create_ucx: out of memory");
        goto fail;
    }
    if ((st = init_context(c, &s)) != KT_OK || (st = kt__ucx_coll_init(c)) != KT_OK)
        goto fail;
    ucs_status_t us = ucp_worker_get_address(c->worker, &my_addr, &my_len);
    if (us != UCS_OK) {
        my_addr = NULL;
        st = ucx_error(&s, "ucp_worker_get_address", us);
        goto fail;
    }
    st = kt__ucx_rendezvous(&s, my_addr, my_len, &boot, &block, &addrs, &lens);
    if (st != KT_OK)
        goto fail;
    c->eps_closed = 0;
    st = create_endpoints(c, &s, addrs);
    if (st == KT_OK)
        st = post_abort_recv(c); /* posted for the communicator's lifetime */
    /* Every rank learns whether all of them got this far. */
    st = kt__ucx_rendezvous_finish(boot, st, kt_last_error());
    if (st != KT_OK)
        goto fail;
    kt__ucx_boot_close(boot);
    ucp_worker_release_address(c->worker, my_addr);
    free(block);
    free(addrs);
    free(lens);
    *comm_out = &c->base;
    return KT_OK;

fail:
    kt__ucx_boot_close(boot);
    free(block);
    free(addrs);
    free(lens);
    if (my_addr != NULL)
        ucp_worker_release_address(c->worker, my_addr);
    if (c != NULL) {
        /* Not a working communicator: no teardown barrier, just release. */
        c->base.poison = st;
        if (c->peers != NULL)
            close_endpoints(c, 1);
        char saved[KT__COMM_MSG_MAX];
        snprintf(saved, sizeof saved, "%s", kt_last_error());
        ucx_destroy(&c->base);
        kt__error(st, "%s", saved);
    }
    return st;
}
