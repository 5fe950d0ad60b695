/* The plan checker, the lower bound, and overlap among buffers held for good. Part of the
 * runtime half: loading a program checks its plan, so a damaged file can never make two live
 * tensors share memory. */
#include <stdio.h>
#include <stdlib.h>

#include "lib/core/error.h"
#include "graph/plan.h"

static uint64_t aligned(uint64_t b) { return (b + KT__PLAN_ALIGN - 1) / KT__PLAN_ALIGN * KT__PLAN_ALIGN; }

typedef struct event {
    int32_t step;
    int32_t item;
    int start; /* 1: item becomes alive; 0: item dies after this step */
} event;

static int event_order(const void *a, const void *b)
{
    const event *x = a, *y = b;
    if (x->step != y->step)
        return x->step < y->step ? -1 : 1;
    return x->start - y->start; /* a death at step t (alive until t-1) before a birth at t */
}

/* Sweeps the steps in order keeping the set of live items; calls visit on each birth. */
static kt_status sweep(const kt__plan_item *items, int32_t n, const uint64_t *offsets,
                       uint64_t *peak_out)
{
    event *ev = malloc(sizeof *ev * (size_t)(2 * n + 1));
    int32_t *live = malloc(sizeof *live * (size_t)(n + 1));
    int32_t *pos = malloc(sizeof *pos * (size_t)(n + 1));
    kt_status status = KT_OK;
    if (ev == NULL || live == NULL || pos == NULL) {
        status = kt__error(KT_ENOMEM, "memory plan check: out of memory");
        goto out;
    }
    int32_t ne = 0;
    for (int32_t i = 0; i < n; i++) {
        if (items[i].bytes == 0)
            continue;
        ev[ne++] = (event){items[i].first, i, 1};
        ev[ne++] = (event){items[i].last + 1, i, 0};
    }
    qsort(ev, (size_t)ne, sizeof *ev, event_order);
    int32_t n_live = 0;
    uint64_t cur = 0, peak = 0;
    for (int32_t e = 0; e < ne; e++) {
        int32_t it = ev[e].item;
        if (!ev[e].start) {
            int32_t p = pos[it];
            live[p] = live[--n_live];
            pos[live[p]] = p;
            cur -= aligned(items[it].bytes);
            continue;
        }
        if (offsets != NULL) {
            uint64_t a0 = offsets[it], a1 = a0 + items[it].bytes;
            for (int32_t k = 0; k < n_live; k++) {
                int32_t o = live[k];
                uint64_t b0 = offsets[o], b1 = b0 + items[o].bytes;
                if (a0 < b1 && b0 < a1) {
                    status = kt__error(KT_EINTERNAL,
                                       "memory plan: buffers %d [%llu, %llu) and %d [%llu, %llu) "
                                       "overlap while both are alive at step %d",
                                       it, (unsigned long long)a0, (unsigned long long)a1, o,
                                       (unsigned long long)b0, (unsigned long long)b1,
                                       ev[e].step);
                    goto out;
                }
            }
        }
        pos[it] = n_live;
        live[n_live++] = it;
        cur += aligned(items[it].bytes);
        if (cur > peak)
            peak = cur;
    }
    *peak_out = peak;
out:
    free(ev);
    free(live);
    free(pos);
    return status;
}

uint64_t kt__plan_lower_bound(const kt__plan_item *items, int32_t n)
{
    uint64_t peak = 0;
    if (sweep(items, n, NULL, &peak) != KT_OK)
        return 0;
    return peak;
}

kt_status kt__plan_check(const kt__plan_item *items, const uint64_t *offsets, int32_t n,
                         uint64_t total)
{
    uint64_t peak;
    return kt__plan_check_peak(items, offsets, n, total, &peak);
}

kt_status kt__plan_check_peak(const kt__plan_item *items, const uint64_t *offsets, int32_t n,
                              uint64_t total, uint64_t *peak_out)
{
    for (int32_t i = 0; i < n; i++) {
        if (items[i].first > items[i].last)
            return kt__error(KT_EINTERNAL, "memory plan: buffer %d lives from step %d to %d", i,
                             items[i].first, items[i].last);
        if (offsets[i] % KT__PLAN_ALIGN != 0 || offsets[i] > total ||
            items[i].bytes > total - offsets[i])
            return kt__error(KT_EINTERNAL, "memory plan: buffer %d at offset %llu (%llu bytes) "
                             "is misaligned or outside the %llu-byte arena", i,
                             (unsigned long long)offsets[i], (unsigned long long)items[i].bytes,
                             (unsigned long long)total);
    }
    return sweep(items, n, offsets, peak_out);
}

static int by_offset(const void *x, const void *y)
{
    const kt__plan_span *a = x, *b = y;
    if (a->offset != b->offset)
        return a->offset < b->offset ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

void kt__plan_find_overlap(kt__plan_span *spans, int32_t n, int32_t *a_out, int32_t *b_out)
{
    *a_out = *b_out = -1;
    qsort(spans, (size_t)n, sizeof *spans, by_offset);
    /* in offset order, a span overlaps an earlier one exactly when it starts before the
     * furthest end so far (empty spans hold no byte) */
    uint64_t reach = 0;
    int32_t reacher = -1;
    for (int32_t k = 0; k < n; k++) {
        if (spans[k].bytes == 0)
            continue;
        if (reacher >= 0 && spans[k].offset < reach) {
            *a_out = reacher;
            *b_out = spans[k].id;
            return;
        }
        uint64_t end = spans[k].offset + spans[k].bytes;
        if (reacher < 0 || end > reach) {
            reach = end;
            reacher = spans[k].id;
        }
    }
}
