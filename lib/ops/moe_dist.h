/* The moe op over several ranks: rank 0 holding every expert (moe_rank0.c) or the experts
 * split over the ranks (moe_ep.c), and what the two share with the op (moe_op.c) and its
 * session state (moe_state.c). */
#ifndef KT_OPS_MOE_DIST_H
#define KT_OPS_MOE_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "kt/moe.h"
#include "lib/ops/op_desc.h"

/* Expert parallelism's largest world (its per-peer counts live on the stack). */
#define KT__MOE_MAX_RANKS 1024

/* The call's mode: the op's `parallel`, or the session's choice for every op. */
kt_moe_parallel kt__moe_mode(const kt__op_call *c);

/* The layer bound as the call's `layer` on this rank; NULL where this rank holds none. */
kt_moe *kt__moe_bound(const kt__op_call *c);

/* The buffer for the rows this rank computes on behalf of the others (rank 0's gathered
 * batch, an owner's received pairs): made at bind for the largest layer this rank holds, so a
 * step allocates nothing. KT_ERANGE naming the sizes when `need` exceeds it. */
kt_status kt__moe_rows(const kt__op_call *c, size_t need, char **out);
/* What the rows buffer must hold for a layer of this config in each mode. */
size_t kt__moe_rank0_rows_bytes(const kt_moe_config *cfg);
size_t kt__moe_ep_rows_bytes(const kt_moe_config *cfg);

/* Per-call message buffers (kt__op_call.comm_scratch) of a node with inputs `in`. */
size_t kt__moe_rank0_scratch(const kt_tensor *in, int world);
size_t kt__moe_ep_scratch(const kt_tensor *in, int world);

/* EP: owner rank and local expert of each global expert id, made at the layer's first
 * distributed forward (the ranks' expert lists exchanged) and kept by the session's state. */
typedef struct kt__moe_placement {
    int64_t n_experts; /* in the whole layer */
    int32_t *owner, *local;
} kt__moe_placement;
kt_status kt__moe_placement_of(const kt__op_call *c, kt__moe_placement **out);
/* The placement table for binding b (NULL slot: not made yet); moe_state.c owns them. */
kt__moe_placement **kt__moe_placement_slot(void *state, int binding);

kt_status kt__moe_rank0_forward(const kt__op_call *c);
kt_status kt__moe_rank0_backward(const kt__op_call *c);
kt_status kt__moe_ep_forward(const kt__op_call *c);
kt_status kt__moe_ep_backward(const kt__op_call *c);

/* t *= s in place, in t's dtype (arithmetic in f32). */
void kt__moe_scale_rows(kt_threadpool *pool, kt_tensor *t, float s);

/* A 64-byte aligned piece of a buffer, *cursor moved past it. */
static inline char *kt__moe_carve(char **cursor, size_t bytes)
{
    char *p = *cursor;
    *cursor += (bytes + 63) / 64 * 64;
    return p;
}

/* Bytes of one row of t (its dims after the first). */
static inline size_t kt__moe_row_bytes(const kt_tensor *t)
{
    size_t b = kt_dtype_size(t->dtype);
    for (int d = 1; d < t->ndim; d++)
        b *= (size_t)t->shape[d];
    return b;
}

/* n rows shaped like t, carved from *cursor. */
static inline kt_tensor kt__moe_rows_like(const kt_tensor *t, int64_t n, char **cursor)
{
    kt_tensor r = *t;
    int64_t shape[KT_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++)
        shape[d] = t->shape[d];
    shape[0] = n;
    (void)kt_tensor_init(&r, NULL, t->dtype, t->ndim, shape);
    r.data = kt__moe_carve(cursor, (size_t)n * kt__moe_row_bytes(t));
    return r;
}

#endif
