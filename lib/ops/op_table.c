/* The op table and the public entry points that validate a direct kernel call.
 *
 * The graph executor validates once at build time and calls the rows' kernels directly;
 * kt_op_forward/kt_op_backward are for callers that run kernels on their own tensors, so
 * they check everything on every call. */
#include <stdint.h>
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static const kt__op_desc *const op_table[KT_OP_COUNT] = {
#define KT__OP_ROW(upper, lower) &kt__op_##lower,
    KT_OP_LIST(KT__OP_ROW)
#undef KT__OP_ROW
};

static const kt__op_desc *test_rows[KT_OP_COUNT]; /* see kt__op_override_for_test */

const kt__op_desc *kt__op_get(kt_op op)
{
    if ((unsigned)op >= KT_OP_COUNT)
        return NULL;
    return test_rows[op] != NULL ? test_rows[op] : op_table[op];
}

const kt__op_desc *kt__op_get_builtin(kt_op op)
{
    return (unsigned)op < KT_OP_COUNT ? op_table[op] : NULL;
}

void kt__op_override_for_test(kt_op op, const kt__op_desc *row)
{
    if ((unsigned)op < KT_OP_COUNT)
        test_rows[op] = row;
}

const char *kt_op_name(kt_op op)
{
    const kt__op_desc *d = kt__op_get(op);
    return d ? d->name : "?";
}

kt_status kt_op_from_name(const char *name, kt_op *op_out)
{
    if (name == NULL || op_out == NULL)
        return kt__error(KT_EINVAL, "kt_op_from_name: NULL argument");
    for (int i = 0; i < KT_OP_COUNT; i++) {
        if (strcmp(op_table[i]->name, name) == 0) {
            *op_out = (kt_op)i;
            return KT_OK;
        }
    }
    return kt__error(KT_EINVAL, "unknown op '%s'", name);
}

kt_status kt_op_arity(kt_op op, int *min_in, int *max_in, int *n_out)
{
    const kt__op_desc *d = kt__op_get(op);
    if (d == NULL)
        return kt__error(KT_EINVAL, "invalid op %d", (int)op);
    if (min_in)
        *min_in = d->min_in;
    if (max_in)
        *max_in = d->max_in;
    if (n_out)
        *n_out = d->n_out;
    return KT_OK;
}

static kt_status check_inputs(const kt__op_desc *d, const kt_tensor *in, int n_in,
                              int need_data)
{
    if (n_in < d->min_in || n_in > d->max_in) {
        if (d->min_in == d->max_in)
            return kt__error(KT_EINVAL, "%s: takes %d input%s, got %d", d->name, d->min_in,
                             d->min_in == 1 ? "" : "s", n_in);
        return kt__error(KT_EINVAL, "%s: takes %d to %d inputs, got %d", d->name, d->min_in,
                         d->max_in, n_in);
    }
    if (n_in > 0 && in == NULL)
        return kt__error(KT_EINVAL, "%s: inputs are NULL", d->name);
    for (int i = 0; i < n_in; i++) {
        const kt_tensor *t = &in[i];
        if ((unsigned)t->dtype >= KT_DTYPE_COUNT || t->ndim < 0 || t->ndim > KT_MAX_DIMS)
            return kt__error(KT_EINVAL, "%s: input %d is not a valid tensor (dtype %d, ndim %d)",
                             d->name, i, (int)t->dtype, t->ndim);
        for (int k = 0; k < t->ndim; k++)
            if (t->shape[k] < 0)
                return kt__error(KT_EINVAL, "%s: input %d has a negative dimension", d->name,
                                 i);
        if (t->device.type != KT_DEVICE_CPU)
            return kt__error(KT_EUNSUPPORTED, "%s: input %d is not on the CPU", d->name, i);
        if (!need_data)
            continue;
        if (!kt_tensor_is_contiguous(t))
            return kt__error(KT_EINVAL, "%s: input %d is not contiguous", d->name, i);
        if (t->data == NULL && kt_tensor_numel(t) > 0)
            return kt__error(KT_EINVAL, "%s: input %d has no data", d->name, i);
    }
    return KT_OK;
}

kt_status kt_op_infer(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                      kt_tensor *out, int n_out)
{
    const kt__op_desc *d = kt__op_get(op);
    if (d == NULL)
        return kt__error(KT_EINVAL, "invalid op %d", (int)op);
    if (out == NULL || n_out != d->n_out)
        return kt__error(KT_EINVAL, "%s: produces %d output%s, %d given", d->name, d->n_out,
                         d->n_out == 1 ? "" : "s", out == NULL ? 0 : n_out);
    KT__TRY(check_inputs(d, in, n_in, 0));
    kt_op_attrs a;
    KT__TRY(kt__attrs_resolve(op, attrs, &a));
    kt_tensor tmp[KT_OP_MAX_OUT];
    memset(tmp, 0, sizeof tmp);
    /* the op's own checks first: they know the inputs (k in 1..E, not just k >= 1) */
    KT__TRY(d->infer(&a, in, n_in, tmp));
    KT__TRY(kt__attrs_check_ranges(op, &a));
    memcpy(out, tmp, (size_t)n_out * sizeof *out);
    return KT_OK;
}

size_t kt_op_scratch_bytes(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                           int backward)
{
    const kt__op_desc *d = kt__op_get(op);
    if (d == NULL)
        return 0;
    kt__op_scratch_fn fn = backward ? d->scratch_bwd : d->scratch_fwd;
    kt_op_attrs a;
    if (fn == NULL || kt__attrs_resolve(op, attrs, &a) != KT_OK)
        return 0; /* bad attributes: the kernel call that follows reports them */
    return fn(&a, in, n_in);
}

double kt_op_flops(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in)
{
    const kt__op_desc *d = kt__op_get(op);
    kt_op_attrs a;
    if (d == NULL || d->flops == NULL || kt__attrs_resolve(op, attrs, &a) != KT_OK)
        return 0.0;
    return d->flops(&a, in, n_in);
}

/* t must match the expected dtype and shape, be contiguous and hold data. */
static kt_status check_against(const char *op, const char *what, int index,
                               const kt_tensor *t, const kt_tensor *expected)
{
    char de[96], dt[96];
    if (t->dtype != expected->dtype || !kt_tensor_same_shape(t, expected))
        return kt__error(KT_EINVAL, "%s: %s %d must be %s, got %s", op, what, index,
                         kt_tensor_describe(expected, de, sizeof de),
                         kt_tensor_describe(t, dt, sizeof dt));
    if (t->device.type != KT_DEVICE_CPU)
        return kt__error(KT_EUNSUPPORTED, "%s: %s %d is not on the CPU", op, what, index);
    if (!kt_tensor_is_contiguous(t))
        return kt__error(KT_EINVAL, "%s: %s %d is not contiguous", op, what, index);
    if (t->data == NULL && kt_tensor_numel(t) > 0)
        return kt__error(KT_EINVAL, "%s: %s %d has no data", op, what, index);
    return KT_OK;
}

static kt_status check_scratch(const kt__op_desc *d, kt__op_scratch_fn fn,
                               const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                               const kt_exec *exec)
{
    size_t need = fn ? fn(attrs, in, n_in) : 0;
    size_t have = exec ? exec->scratch_bytes : 0;
    if (need > 0 && (exec == NULL || exec->scratch == NULL || have < need))
        return kt__error(KT_EINVAL, "%s: needs %zu bytes of scratch, %zu given", d->name, need,
                         exec && exec->scratch ? have : 0);
    return KT_OK;
}

/* Whether two tensors' bytes share an address (both contiguous by now) */
static int overlaps(const kt_tensor *a, const kt_tensor *b)
{
    const size_t na = kt_tensor_nbytes(a), nb = kt_tensor_nbytes(b);
    if (na == 0 || nb == 0 || a->data == NULL || b->data == NULL)
        return 0;
    const uintptr_t a0 = (uintptr_t)a->data, b0 = (uintptr_t)b->data;
    return a0 < b0 + nb && b0 < a0 + na;
}

/* Whether a (an output, or an input gradient) lies exactly over b (an input, or output 0's
 * gradient) where the op computes output 0 in place over input i. */
static int exactly_in_place(const kt__op_desc *d, int i, const kt_tensor *a, const kt_tensor *b)
{
    return ((d->inplace_in >> i) & 1u) && a->data == b->data &&
           kt_tensor_nbytes(a) == kt_tensor_nbytes(b);
}

/* An output may share memory with an input only where the op computes in place (output 0
 * exactly over an input its table row allows): any other overlap, or two outputs sharing
 * memory, would be read after it was overwritten, giving wrong numbers without an error. */
static kt_status check_aliasing(const kt__op_desc *d, const kt_tensor *in, int n_in,
                                const kt_tensor *out, int n_out)
{
    for (int o = 0; o < n_out; o++) {
        for (int i = 0; i < n_in; i++) {
            if (!overlaps(&out[o], &in[i]))
                continue;
            if (o != 0 || !exactly_in_place(d, i, &out[o], &in[i]))
                return kt__error(KT_EINVAL,
                                 "%s: output %d overlaps input %d (an op computes in place only "
                                 "as output 0 exactly over an input it allows)",
                                 d->name, o, i);
        }
        for (int q = 0; q < o; q++)
            if (overlaps(&out[o], &out[q]))
                return kt__error(KT_EINVAL, "%s: outputs %d and %d overlap", d->name, q, o);
    }
    return KT_OK;
}

kt_status kt_op_forward(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                        kt_tensor *out, int n_out, const kt_exec *exec)
{
    const kt__op_desc *d = kt__op_get(op);
    if (d == NULL)
        return kt__error(KT_EINVAL, "invalid op %d", (int)op);
    if (out == NULL && n_out > 0)
        return kt__error(KT_EINVAL, "%s: outputs are NULL", d->name);
    KT__TRY(check_inputs(d, in, n_in, 1));
    kt_op_attrs resolved;
    KT__TRY(kt__attrs_resolve(op, attrs, &resolved));
    attrs = &resolved;
    kt_tensor expected[KT_OP_MAX_OUT];
    KT__TRY(kt_op_infer(op, attrs, in, n_in, expected, n_out));
    for (int i = 0; i < n_out; i++)
        KT__TRY(check_against(d->name, "output", i, &out[i], &expected[i]));
    KT__TRY(check_aliasing(d, in, n_in, out, n_out));
    KT__TRY(check_scratch(d, d->scratch_fwd, attrs, in, n_in, exec));
    kt__op_call call = {
        .attrs = attrs, .in = in, .n_in = n_in, .out = out, .out_w = out, .n_out = n_out,
        .pool = exec ? exec->pool : NULL, .scratch = exec ? exec->scratch : NULL,
        .scratch_bytes = exec ? exec->scratch_bytes : 0};
    return d->forward(&call);
}

/* An input gradient the backward writes must not share memory with anything it reads (the
 * inputs and outputs its table row reads, the output gradients, but for the in-place case)
 * nor with another input gradient: it could be overwritten before it is read. */
static kt_status check_grad_aliasing(const kt__op_desc *d, const kt_tensor *in, int n_in,
                                     const kt_tensor *out, int n_out, const kt_tensor *grad_out,
                                     const kt_tensor *grad_in)
{
    for (int i = 0; i < n_in; i++) {
        if (grad_in[i].data == NULL)
            continue;
        for (int j = 0; j < n_in; j++)
            if ((d->bwd_reads_in & (1u << j)) && overlaps(&grad_in[i], &in[j]))
                return kt__error(KT_EINVAL, "%s backward: input gradient %d overlaps input %d",
                                 d->name, i, j);
        for (int o = 0; o < n_out; o++) {
            if ((d->bwd_reads_out & (1u << o)) && overlaps(&grad_in[i], &out[o]))
                return kt__error(KT_EINVAL, "%s backward: input gradient %d overlaps output %d",
                                 d->name, i, o);
            /* (the in-place case mirrored: input gradient i exactly over output gradient 0,
             * where the op computes output 0 in place over input i) */
            const int in_place = o == 0 && exactly_in_place(d, i, &grad_in[i], &grad_out[0]);
            if (grad_out[o].data != NULL && !in_place && overlaps(&grad_in[i], &grad_out[o]))
                return kt__error(KT_EINVAL,
                                 "%s backward: input gradient %d overlaps output gradient %d",
                                 d->name, i, o);
        }
        for (int q = 0; q < i; q++)
            if (grad_in[q].data != NULL && overlaps(&grad_in[i], &grad_in[q]))
                return kt__error(KT_EINVAL, "%s backward: input gradients %d and %d overlap",
                                 d->name, q, i);
    }
    return KT_OK;
}

kt_status kt_op_backward(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                         const kt_tensor *out, int n_out, const kt_tensor *grad_out,
                         kt_tensor *grad_in, const kt_exec *exec)
{
    const kt__op_desc *d = kt__op_get(op);
    if (d == NULL)
        return kt__error(KT_EINVAL, "invalid op %d", (int)op);
    if (out == NULL || grad_out == NULL || grad_in == NULL)
        return kt__error(KT_EINVAL, "%s backward: outputs or gradients are NULL", d->name);
    KT__TRY(check_inputs(d, in, n_in, 1));
    kt_op_attrs resolved;
    KT__TRY(kt__attrs_resolve(op, attrs, &resolved));
    attrs = &resolved;
    kt_tensor expected[KT_OP_MAX_OUT];
    KT__TRY(kt_op_infer(op, attrs, in, n_in, expected, n_out));
    for (int i = 0; i < n_out; i++) {
        if (d->bwd_reads_out & (1u << i))
            KT__TRY(check_against(d->name, "output", i, &out[i], &expected[i]));
        int integer = expected[i].dtype == KT_I32 || expected[i].dtype == KT_I64;
        if (integer && grad_out[i].data == NULL)
            continue; /* integer outputs carry no gradient */
        if (integer)
            return kt__error(KT_EINVAL, "%s backward: output %d is an integer tensor and takes "
                             "no gradient", d->name, i);
        KT__TRY(check_against(d->name, "output gradient", i, &grad_out[i], &expected[i]));
    }
    for (int i = 0; i < n_in; i++) {
        if (grad_in[i].data == NULL)
            continue;
        /* ids and targets never take one; nor does any integer tensor (layout ops accept
         * them, and their backward has no output gradient to give) */
        if ((d->no_grad_in & (1u << i)) || in[i].dtype == KT_I32 || in[i].dtype == KT_I64)
            return kt__error(KT_EINVAL, "%s backward: input %d (%s) takes no gradient", d->name,
                             i, kt_dtype_name(in[i].dtype));
        KT__TRY(check_against(d->name, "input gradient", i, &grad_in[i], &in[i]));
    }
    KT__TRY(check_grad_aliasing(d, in, n_in, out, n_out, grad_out, grad_in));
    KT__TRY(check_scratch(d, d->scratch_bwd, attrs, in, n_in, exec));
    kt__op_call call = {
        .attrs = attrs, .in = in, .n_in = n_in, .out = out, .out_w = NULL, .n_out = n_out,
        .gout = grad_out, .gin = grad_in, .pool = exec ? exec->pool : NULL,
        .scratch = exec ? exec->scratch : NULL,
        .scratch_bytes = exec ? exec->scratch_bytes : 0};
    return d->backward(&call);
}
