/* Greedy-by-size, best-fit memory planning (compile time). */
#include <stdlib.h>

#include "lib/core/error.h"
#include "graph/plan.h"

static uint64_t aligned(uint64_t b) { return (b + KT__PLAN_ALIGN - 1) / KT__PLAN_ALIGN * KT__PLAN_ALIGN; }

/* qsort has no context argument in C11; thread-local keeps concurrent compiles apart */
static _Thread_local const kt__plan_item *sort_items;

static int by_size_desc(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    const kt__plan_item *ix = &sort_items[x], *iy = &sort_items[y];
    if (ix->bytes != iy->bytes)
        return ix->bytes > iy->bytes ? -1 : 1;
    if (ix->first != iy->first) /* earlier-born first: a stable, deterministic order */
        return ix->first < iy->first ? -1 : 1;
    return x < y ? -1 : 1;
}

static int by_offset(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b; /* pairs (offset, end) */
    if (x[0] != y[0])
        return x[0] < y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : (x[1] > y[1]);
}

kt_status kt__plan_greedy(const kt__plan_item *items, int32_t n, uint64_t *offsets,
                          uint64_t *total_out)
{
    int32_t *order = malloc(sizeof *order * (size_t)(n + 1));
    int32_t *placed = malloc(sizeof *placed * (size_t)(n + 1));
    uint64_t *spans = malloc(sizeof *spans * 2 * (size_t)(n + 1));
    kt_status status = KT_OK;
    if (order == NULL || placed == NULL || spans == NULL) {
        status = kt__error(KT_ENOMEM, "memory plan: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < n; i++)
        order[i] = i;
    sort_items = items;
    qsort(order, (size_t)n, sizeof *order, by_size_desc);
    sort_items = NULL;

    uint64_t total = 0;
    int32_t n_placed = 0;
    for (int32_t k = 0; k < n; k++) {
        int32_t it = order[k];
        uint64_t size = aligned(items[it].bytes);
        if (size == 0) {
            offsets[it] = 0;
            continue;
        }
        /* the placed buffers alive at the same time, sorted by offset */
        int32_t ns = 0;
        for (int32_t p = 0; p < n_placed; p++) {
            int32_t o = placed[p];
            if (items[o].first <= items[it].last && items[it].first <= items[o].last) {
                spans[2 * ns] = offsets[o];
                spans[2 * ns + 1] = offsets[o] + aligned(items[o].bytes);
                ns++;
            }
        }
        qsort(spans, (size_t)ns, 2 * sizeof *spans, by_offset);
        /* smallest gap that fits; else right after the highest end */
        uint64_t best = UINT64_MAX, best_gap = UINT64_MAX, cursor = 0;
        for (int32_t s = 0; s < ns; s++) {
            if (spans[2 * s] > cursor) {
                uint64_t gap = spans[2 * s] - cursor;
                if (gap >= size && gap < best_gap) {
                    best_gap = gap;
                    best = cursor;
                }
            }
            if (spans[2 * s + 1] > cursor)
                cursor = spans[2 * s + 1];
        }
        offsets[it] = best != UINT64_MAX ? best : cursor;
        if (offsets[it] + size > total)
            total = offsets[it] + size;
        placed[n_placed++] = it;
    }
    *total_out = total;
out:
    free(order);
    free(placed);
    free(spans);
    return status;
}
