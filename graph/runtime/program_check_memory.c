/* Programs: the memory checks of validation (after the tables, steps and data flow):
 * inputs, outputs and the loss alive whenever the caller may touch them and in memory of
 * their own, in-place sharing as the compiler chains it, no two live activations nor any two
 * parameters or gradients overlapping, and region sizes and the lower bound as the buffers
 * give them. So a damaged file can never make two live tensors share memory, nor a tensor the
 * caller reads die early. */
#include <stdlib.h>

#include "lib/core/error.h"
#include "graph/plan.h"
#include "graph/program_internal.h"
#include "lib/ops/op_desc.h"

/* ---- lifetimes the caller relies on, and in-place sharing --------------------------------- */

/* The caller writes an input before forward and may run forward again without rewriting it;
 * it reads an output or the loss after forward or backward. So (as lifetimes.c pins them)
 * inputs live from step 0 and all three to the last step, each in memory of its own. */
static kt_status check_pinned_buf(const kt_program *p, const int32_t *sharers, int32_t b, int input)
{
    const kt__pbuf *pb = &p->bufs[b];
    int32_t end = p->n_steps > 0 ? p->n_steps - 1 : 0;
    if (pb->region != KT__REGION_ACT) /* an output may be a parameter */
        return KT_OK;
    char bt[96];
    kt__program_buf_label(p, b, bt, sizeof bt);
    if ((input && pb->first != 0) || pb->last != end)
        return kt__error(KT_EFORMAT,
                         "%s lives from step %d to %d, but %s must live %sto the "
                         "last step (%d): another buffer could reuse its memory",
                         bt, pb->first, pb->last, input ? "an input" : "an output or the loss",
                         input ? "from step 0 " : "", end);
    if (pb->storage != b || sharers[b] > 1)
        return kt__error(KT_EFORMAT, "%s shares its memory in place with another buffer", bt);
    return KT_OK;
}

static kt_status check_pinned(const kt_program *p, const int32_t *sharers)
{
    for (int32_t i = 0; i < p->n_entries[KT_ROLE_INPUT]; i++)
        KT__TRY(check_pinned_buf(p, sharers, p->entries[KT_ROLE_INPUT][i].buf, 1));
    for (int32_t i = 0; i < p->n_entries[KT_ROLE_OUTPUT]; i++)
        KT__TRY(check_pinned_buf(p, sharers, p->entries[KT_ROLE_OUTPUT][i].buf, 0));
    return p->loss_buf >= 0 ? check_pinned_buf(p, sharers, p->loss_buf, 0) : KT_OK;
}

/* Step t hands buffer a's memory to buffer b: a forward op writes b as output 0 over a, an
 * input it reads once and that the op allows in place (each element read before written). */
static int hands_over(const kt_program *p, int32_t t, int32_t a, int32_t b)
{
    if (t < 0 || t >= p->n_steps)
        return 0;
    const kt__pstep *s = &p->steps[t];
    if (s->kind != KT__STEP_FORWARD || s->n_out < 1 || s->out[0] != b)
        return 0;
    unsigned inplace = kt__op_get(s->op)->inplace_in;
    int uses = 0, allowed = 0;
    for (int32_t i = 0; i < s->n_in; i++)
        if (s->in[i] == a) {
            uses++;
            allowed = (inplace >> i) & 1u;
        }
    return uses == 1 && allowed;
}

typedef struct member {
    int32_t storage, first, last, buf;
} member;

static int by_storage(const void *x, const void *y)
{
    const member *a = x, *b = y;
    if (a->storage != b->storage)
        return a->storage < b->storage ? -1 : 1;
    if (a->first != b->first)
        return a->first < b->first ? -1 : 1;
    return (a->buf > b->buf) - (a->buf < b->buf);
}

/* Buffers sharing storage (which the memory plan treats as one) take turns, as lifetimes.c
 * chains them: each starts no earlier than the one before it ends, and on that very step
 * only when the step computes it in place over that buffer. */
static kt_status check_turns(const kt_program *p, const member *m, int32_t n)
{
    for (int32_t k = 1; k < n; k++) {
        const member *a = &m[k - 1], *b = &m[k];
        if (a->storage != b->storage)
            continue;
        if (b->first < a->last)
            return kt__error(KT_EFORMAT,
                             "buffers %d and %d share memory in place while both "
                             "are alive at step %d",
                             a->buf, b->buf, b->first);
        if (b->first == a->last && !hands_over(p, b->first, a->buf, b->buf))
            return kt__error(KT_EFORMAT,
                             "buffer %d takes the memory of buffer %d at step %d, "
                             "which does not compute it in place",
                             b->buf, a->buf, b->first);
    }
    return KT_OK;
}

static kt_status check_sharing(const kt_program *p)
{
    member *m = malloc(sizeof *m * ((size_t)p->n_bufs + 1));
    int32_t *sharers = calloc((size_t)p->n_bufs + 1, sizeof *sharers);
    kt_status status = KT_OK;
    if (m == NULL || sharers == NULL) {
        status = kt__error(KT_ENOMEM, "program check: out of memory");
        goto out;
    }
    int32_t n = 0;
    for (int32_t b = 0; b < p->n_bufs; b++) {
        const kt__pbuf *pb = &p->bufs[b];
        if (pb->region != KT__REGION_ACT)
            continue;
        sharers[pb->storage]++;
        m[n++] = (member){pb->storage, pb->first, pb->last, b};
    }
    if ((status = check_pinned(p, sharers)) != KT_OK)
        goto out;
    qsort(m, (size_t)n, sizeof *m, by_storage);
    status = check_turns(p, m, n);
out:
    free(m);
    free(sharers);
    return status;
}

/* ---- memory ------------------------------------------------------------------------------- */

/* The activation plan: no two live buffers overlap, and the stored lower bound is the most
 * bytes alive at any one step, as the compiler computed it. */
static kt_status check_plan(const kt_program *p)
{
    kt__plan_item *items = calloc((size_t)p->n_bufs + 1, sizeof *items);
    uint64_t *offsets = calloc((size_t)p->n_bufs + 1, sizeof *offsets);
    kt_status status = KT_OK;
    if (items == NULL || offsets == NULL) {
        status = kt__error(KT_ENOMEM, "program check: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < p->n_bufs; i++) {
        const kt__pbuf *b = &p->bufs[i];
        if (b->region != KT__REGION_ACT)
            continue;
        kt__plan_item *it = &items[b->storage];
        if (it->bytes == 0) {
            it->first = b->first;
            it->last = b->last;
        }
        it->bytes = b->bytes;
        offsets[b->storage] = b->offset;
        if (b->first < it->first)
            it->first = b->first;
        if (b->last > it->last)
            it->last = b->last;
    }
    uint64_t peak = 0;
    status = kt__plan_check_peak(items, offsets, p->n_bufs, p->region_bytes[KT__REGION_ACT], &peak);
    if (status != KT_OK)
        status = kt__error_context(KT_EFORMAT, "program");
    else if (peak != p->lower_bound)
        status = kt__error(KT_EFORMAT,
                           "program: the lower bound says %llu bytes, the buffers' "
                           "lifetimes give %llu",
                           (unsigned long long)p->lower_bound, (unsigned long long)peak);
out:
    free(items);
    free(offsets);
    return status;
}

static const char *const region_names[KT__REGION_COUNT] = {"activation", "parameter", "gradient"};

/* Parameters and gradients live as long as the session: no two may share a byte. */
static kt_status check_disjoint(const kt_program *p, int32_t region, kt__plan_span *spans)
{
    int32_t n = 0;
    for (int32_t b = 0; b < p->n_bufs; b++)
        if (p->bufs[b].region == region && p->bufs[b].bytes > 0)
            spans[n++] = (kt__plan_span){p->bufs[b].offset, p->bufs[b].bytes, b};
    int32_t a, b;
    kt__plan_find_overlap(spans, n, &a, &b);
    if (a < 0)
        return KT_OK;
    char at[96], bt[96];
    kt__program_buf_label(p, a, at, sizeof at);
    kt__program_buf_label(p, b, bt, sizeof bt);
    return kt__error(KT_EFORMAT,
                     "%s and %s overlap in the %s region ([%llu, %llu) and [%llu, %llu))", at, bt,
                     region_names[region], (unsigned long long)p->bufs[a].offset,
                     (unsigned long long)(p->bufs[a].offset + p->bufs[a].bytes),
                     (unsigned long long)p->bufs[b].offset,
                     (unsigned long long)(p->bufs[b].offset + p->bufs[b].bytes));
}

/* A region is as large as its buffers reach, rounded up to the alignment (how the compiler
 * sizes it): a session allocates each region whole, so a larger one only wastes memory. */
static kt_status check_region_sizes(const kt_program *p)
{
    uint64_t need[KT__REGION_COUNT] = {0, 0, 0};
    for (int32_t b = 0; b < p->n_bufs; b++) {
        const kt__pbuf *pb = &p->bufs[b];
        if (pb->bytes == 0)
            continue;
        uint64_t end = pb->offset + pb->bytes; /* within the region: check_buf */
        end = end > UINT64_MAX - (KT__PLAN_ALIGN - 1)
                  ? UINT64_MAX
                  : (end + KT__PLAN_ALIGN - 1) / KT__PLAN_ALIGN * KT__PLAN_ALIGN;
        if (end > need[pb->region])
            need[pb->region] = end;
    }
    for (int r = 0; r < KT__REGION_COUNT; r++)
        if (p->region_bytes[r] != need[r])
            return kt__error(KT_EFORMAT,
                             "program: the %s region is %llu bytes, its buffers need %llu",
                             region_names[r], (unsigned long long)p->region_bytes[r],
                             (unsigned long long)need[r]);
    return KT_OK;
}

kt_status kt__program_check_memory(const kt_program *p)
{
    KT__TRY(check_sharing(p));
    KT__TRY(check_plan(p));
    kt__plan_span *spans = malloc(sizeof *spans * ((size_t)p->n_bufs + 1));
    if (spans == NULL)
        return kt__error(KT_ENOMEM, "program check: out of memory");
    kt_status status = check_disjoint(p, KT__REGION_PARAM, spans);
    if (status == KT_OK)
        status = check_disjoint(p, KT__REGION_GRAD, spans);
    free(spans);
    return status != KT_OK ? status : check_region_sizes(p);
}
