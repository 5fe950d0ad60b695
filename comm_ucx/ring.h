/* Ring reduce-scatter and all-gather (ring.c), the building blocks of the UCX collectives. */
#ifndef KT_COMM_UCX_RING_H
#define KT_COMM_UCX_RING_H

#include "comm_ucx/ucx_internal.h"

/* The blocks of `total` elements are split over the ranks as coll_plan.h says. in holds
 * every block (dtype); this rank's reduced block goes to out (which may be its block of in).
 * phase: a bit of the tag's step, so the two halves of an all-reduce check apart. */
kt_status kt__ring_reduce_scatter(kt__ucx_comm *c, const kt__ucx_op *op, unsigned phase,
                                  const void *in, void *out, size_t total, kt_dtype dt,
                                  kt_reduce_op rop);
/* buf holds `total` elements of es bytes; this rank's block is in place, the others arrive. */
kt_status kt__ring_all_gather(kt__ucx_comm *c, const kt__ucx_op *op, unsigned phase, void *buf,
                              size_t total, size_t es);

#endif
