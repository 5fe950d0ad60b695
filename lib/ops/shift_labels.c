/* shift_labels: the causal language model's targets from its labels. labels [..., S] (i32 or
 * i64) -> the same shape and dtype, out[..., t] = labels[..., t + 1] for t < S - 1 and
 * out[..., S - 1] = ignore_index: position t predicts the next token, and the last position
 * has nothing to predict (transformers shifts its labels so before the cross-entropy). An
 * integer op: no gradient.
 *
 * Each row is moved down by one element with memmove, so output 0 may lie over the labels. */
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static kt_status infer_shift_labels(const kt_op_attrs *at, const kt_tensor *in, int n,
                                    kt_tensor *out)
{
    (void)n;
    KT__TRY(kt__check_index("shift_labels", "labels", &in[0]));
    KT__TRY(kt__check_rank("shift_labels", "labels", &in[0], 1, KT_MAX_DIMS));
    if (in[0].dtype == KT_I32 && (at->ignore_index < INT32_MIN || at->ignore_index > INT32_MAX))
        return kt__error(KT_EINVAL,
                         "shift_labels: ignore_index %lld does not fit the labels' dtype i32",
                         (long long)at->ignore_index);
    kt__like(&out[0], &in[0]);
    return KT_OK;
}

typedef struct shift_job {
    const kt_tensor *labels;
    kt_tensor *out;
    int64_t S;
    size_t es;
    int64_t ignore;
} shift_job;

static void shift_rows(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const shift_job *j = ctx;
    for (int64_t r = begin; r < end; r++) {
        char *dst = kt__elem_ptr(j->out, r * j->S);
        const char *src = kt__elem_ptr(j->labels, r * j->S + 1);
        memmove(dst, src, (size_t)(j->S - 1) * j->es);
        const int64_t last = r * j->S + j->S - 1;
        if (j->out->dtype == KT_I32)
            ((int32_t *)j->out->data)[last] = (int32_t)j->ignore;
        else
            ((int64_t *)j->out->data)[last] = j->ignore;
    }
}

static kt_status fwd_shift_labels(const kt__op_call *c)
{
    const kt_tensor *labels = &c->in[0];
    shift_job j = {.labels = labels, .out = &c->out_w[0], .S = kt__row_len(labels),
                   .es = kt_dtype_size(labels->dtype), .ignore = c->attrs->ignore_index};
    if (j.S == 0)
        return KT_OK;
    kt_parallel_for(c->pool, kt__rows(labels), kt__rows_grain(j.S), shift_rows, &j);
    return KT_OK;
}

/* Integer in, integer out: nothing takes a gradient (kt_op_backward refuses a request). */
static kt_status bwd_shift_labels(const kt__op_call *c)
{
    (void)c;
    return KT_OK;
}

static const kt__attr_desc shift_labels_attrs[] = {
    KT__A_I64("ignore_index", ignore_index, -100, INT64_MIN, INT64_MAX,
              "the last position's target (cross_entropy's ignore_index)"),
};

const kt__op_desc kt__op_shift_labels = {
    .name = "shift_labels", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .no_grad_in = 1u, .infer = infer_shift_labels, .forward = fwd_shift_labels,
    .backward = bwd_shift_labels,
    KT__ATTR_LIST(shift_labels_attrs)};
