/* How the UCX collectives split their work: block and slice geometry, the pipeline's bounds
 * and the all-reduce's choice of algorithm. No UCX types: the tests include it to compute the
 * reference results in the same fixed order as the ranks (docs/parallel.md, "Collectives").
 *
 * Blocks: a reduction of `total` elements over W ranks gives rank b the block of
 * total / W elements (one more for the first total % W ranks), starting at kt__blk_start.
 * Ring reduce-scatter adds block b's contributions in the order of ranks b+1, b+2, ..., b
 * (mod W), left to right, in f32; recursive doubling (small all-reduces) adds the pairs of
 * a binary tree (see kt__rd_* below). The sum is rounded to bf16 once, after the mean. */
#ifndef KT_COMM_UCX_COLL_PLAN_H
#define KT_COMM_UCX_COLL_PLAN_H

#include <stddef.h>

/* Slices in flight per ring step, and their size on the wire: the pipeline's buffers are
 * 2 x KT__RING_DEPTH slices, whatever the message and the world size. */
#define KT__RING_DEPTH 4
#define KT__RING_SLICE_BYTES ((size_t)128 << 10)
#define KT__RING_MIN_SLICE_BYTES ((size_t)4 << 10)

/* All-reduces of at most this many bytes of f32 partial sums use recursive doubling
 * (log2 W rounds of the whole message) instead of the ring's 2 (W - 1) steps. */
#define KT__RD_MAX_BYTES ((size_t)32 << 10)

/* The arena of the collectives, allocated with the communicator: send and receive slices,
 * and recursive doubling's two f32 vectors. */
#define KT__COLL_ARENA_BYTES (2 * KT__RING_DEPTH * KT__RING_SLICE_BYTES)

static inline size_t kt__blk_len(size_t total, int w, int b)
{
    return total / (size_t)w + ((size_t)b < total % (size_t)w);
}

static inline size_t kt__blk_start(size_t total, int w, int b)
{
    size_t rem = total % (size_t)w;
    return (size_t)b * (total / (size_t)w) + ((size_t)b < rem ? (size_t)b : rem);
}

static inline int kt__all_reduce_uses_rd(size_t count) { return count * 4 <= KT__RD_MAX_BYTES; }

/* Recursive doubling over W ranks: the largest power of two p2 <= W takes part; rank
 * r < W - p2 first adds rank r + p2's vector to its own (x_r + x_{r+p2}); then for mask =
 * 1, 2, .., p2 / 2 every rank adds the partner r ^ mask's partial sum to its own. */
static inline int kt__rd_pow2(int w)
{
    int p = 1;
    while (p * 2 <= w)
        p *= 2;
    return p;
}

#endif
