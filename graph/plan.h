/* The static memory plan: buffers with sizes and lifetimes get offsets in one arena so that
 * no two buffers alive at the same step overlap. */
#ifndef KT_GRAPH_PLAN_H
#define KT_GRAPH_PLAN_H

#include <stdint.h>

#include "kt/status.h"

#define KT__PLAN_ALIGN 64

typedef struct kt__plan_item {
    uint64_t bytes;
    int32_t first, last; /* steps at which the buffer is alive, inclusive */
} kt__plan_item;

/* Greedy by size, best fit (the TensorFlow Lite approach with the smallest-gap rule):
 * largest buffers first, each into the smallest gap between the already placed buffers
 * whose lifetimes overlap its own. offsets receive 64-byte aligned offsets; *total the arena
 * size. Allocates working memory (compile time only). */
kt_status kt__plan_greedy(const kt__plan_item *items, int32_t n, uint64_t *offsets,
                          uint64_t *total_out);

/* max over steps of the bytes alive at that step (each rounded up to the alignment): no
 * plan can be smaller. */
uint64_t kt__plan_lower_bound(const kt__plan_item *items, int32_t n);

/* KT_OK when no two items alive at a common step share a byte and every item lies within
 * total; otherwise KT_EINTERNAL (compiler) naming the two items. */
kt_status kt__plan_check(const kt__plan_item *items, const uint64_t *offsets, int32_t n,
                         uint64_t total);

/* kt__plan_check that also gives the lower bound it met on the way (one sweep for both). */
kt_status kt__plan_check_peak(const kt__plan_item *items, const uint64_t *offsets, int32_t n,
                              uint64_t total, uint64_t *peak_out);

/* A buffer that holds its bytes for good (a parameter, a gradient). */
typedef struct kt__plan_span {
    uint64_t offset, bytes;
    int32_t id;
} kt__plan_span;

/* Two spans that share a byte: their ids in *a_out and *b_out, or -1 in both when there are
 * none. Sorts spans by offset in place (no allocation): O(n log n). */
void kt__plan_find_overlap(kt__plan_span *spans, int32_t n, int32_t *a_out, int32_t *b_out);

#endif
