/* concat, narrow, transpose, reshape: layout ops that move bytes and never look at values,
 * so one kernel serves every dtype (integer ids as well as floats, NaN payloads intact).
 *
 * Every result is materialised contiguous. The copies are expressed as "rows of bytes":
 * a block of `rows` rows, `row_bytes` long, at a stride on each side. That covers concat,
 * its split, narrow, the narrow gradient's zero fill and reshape; transpose gathers. */
#include <stdio.h>
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

/* Bytes per part before a copy is split over the pool: below this, waking threads costs
 * more than the copy. */
#define KT__COPY_GRAIN ((int64_t)1 << 17)

/* ---- block copy --------------------------------------------------------------------------- */

/* dst[r * dst_stride + c] = src[r * src_stride + c] (or 0 when src is NULL) for r < rows,
 * c < row_bytes. The work is indexed by byte so one long row (dim 0 of concat, reshape) is
 * split as readily as many short ones. */
typedef struct block_job {
    unsigned char *dst;
    const unsigned char *src;
    int64_t dst_stride, src_stride, row_bytes;
} block_job;

static void block_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const block_job *j = ctx;
    int64_t r = begin / j->row_bytes, c = begin % j->row_bytes;
    for (int64_t k = begin; k < end; r++, c = 0) {
        int64_t n = j->row_bytes - c;
        if (n > end - k)
            n = end - k;
        unsigned char *d = j->dst + r * j->dst_stride + c;
        if (j->src != NULL)
            memcpy(d, j->src + r * j->src_stride + c, (size_t)n);
        else
            memset(d, 0, (size_t)n);
        k += n;
    }
}

/* Offsets are applied only once there is something to copy: an empty tensor may have NULL
 * data, and NULL plus an offset is undefined. */
static void copy_block(kt_threadpool *pool, void *dst, int64_t dst_off, int64_t dst_stride,
                       const void *src, int64_t src_off, int64_t src_stride, int64_t rows,
                       int64_t row_bytes)
{
    if (rows <= 0 || row_bytes <= 0)
        return;
    block_job j = {.dst = (unsigned char *)dst + dst_off,
                   .src = src ? (const unsigned char *)src + src_off : NULL,
                   .dst_stride = dst_stride, .src_stride = src_stride, .row_bytes = row_bytes};
    kt_parallel_for(pool, rows * row_bytes, KT__COPY_GRAIN, block_range, &j);
}

/* The whole of a contiguous tensor into another of the same byte size; a no-op when they
 * are the same memory (reshape in place). */
static void copy_all(kt_threadpool *pool, void *dst, const void *src, size_t bytes)
{
    if (dst == src)
        return;
    copy_block(pool, dst, 0, 0, src, 0, 0, 1, (int64_t)bytes);
}

/* Bytes of one slab along `dim`: the product of the dims after it, times the element. */
static int64_t inner_bytes(const kt_tensor *t, int dim)
{
    return kt__dims_product(t, dim + 1, t->ndim) * (int64_t)kt_dtype_size(t->dtype);
}

/* A dim attribute (negative: counted from the end, -1 the last) as an index into t's dims;
 * valid once infer accepted it. */
static int dim_in(int dim, const kt_tensor *t) { return dim < 0 ? dim + t->ndim : dim; }

/* ---- concat -------------------------------------------------------------------------------- */

static kt_status infer_concat(const kt_op_attrs *at, const kt_tensor *in, int n_in,
                              kt_tensor *out)
{
    const kt_tensor *a = &in[0];
    KT__TRY(kt__check_rank("concat", "input 0", a, 1, KT_MAX_DIMS));
    if (at->dim < -a->ndim || at->dim >= a->ndim) {
        char d[96];
        return kt__error(KT_EINVAL, "concat: dim %d outside -%d..%d for input 0 %s", at->dim,
                         a->ndim, a->ndim - 1, kt_tensor_describe(a, d, sizeof d));
    }
    const int dim = dim_in(at->dim, a);
    int64_t shape[KT_MAX_DIMS];
    memcpy(shape, a->shape, sizeof shape);
    for (int i = 1; i < n_in; i++) {
        char arg[32];
        snprintf(arg, sizeof arg, "input %d", i);
        KT__TRY(kt__check_same_dtype("concat", arg, &in[i], a));
        KT__TRY(kt__check_rank("concat", arg, &in[i], a->ndim, a->ndim));
        for (int d = 0; d < a->ndim; d++)
            if (d != dim)
                KT__TRY(kt__check_dim("concat", arg, &in[i], d, a->shape[d]));
        shape[dim] += in[i].shape[dim];
    }
    kt__shape_out(&out[0], a->dtype, a->ndim, shape);
    return KT_OK;
}

/* Each input is a block of outer rows at its running offset in the output's rows: forward
 * copies the inputs into the output (`whole` = the output), backward the output gradient's
 * blocks back into the input gradients that exist (`whole` = the output gradient). */
static void concat_blocks(const kt__op_call *c, const kt_tensor *whole, int backward)
{
    const int dim = dim_in(c->attrs->dim, whole);
    int64_t outer = kt__dims_product(whole, 0, dim), slab = inner_bytes(whole, dim);
    int64_t out_row = whole->shape[dim] * slab, offset = 0;
    for (int i = 0; i < c->n_in; i++) {
        int64_t in_row = c->in[i].shape[dim] * slab;
        if (!backward)
            copy_block(c->pool, whole->data, offset, out_row, c->in[i].data, 0, in_row, outer,
                       in_row);
        else if (c->gin[i].data != NULL)
            copy_block(c->pool, c->gin[i].data, 0, in_row, whole->data, offset, out_row, outer,
                       in_row);
        offset += in_row;
    }
}

static kt_status fwd_concat(const kt__op_call *c)
{
    concat_blocks(c, &c->out_w[0], 0);
    return KT_OK;
}

static kt_status bwd_concat(const kt__op_call *c)
{
    concat_blocks(c, &c->gout[0], 1);
    return KT_OK;
}

/* ---- narrow -------------------------------------------------------------------------------- */

static kt_status infer_narrow(const kt_op_attrs *at, const kt_tensor *in, int n_in,
                              kt_tensor *out)
{
    (void)n_in;
    KT__TRY(kt__check_rank("narrow", "x", &in[0], 1, KT_MAX_DIMS));
    /* A data-less copy: the view's bounds checks are the op's, its pointer is not needed. */
    kt_tensor x, v;
    kt__like(&x, &in[0]);
    if (at->dim < -x.ndim || at->dim >= x.ndim) {
        char d[96];
        return kt__error(KT_EINVAL, "narrow: dim %d outside -%d..%d for x %s", at->dim, x.ndim,
                         x.ndim - 1, kt_tensor_describe(&x, d, sizeof d));
    }
    KT__TRY(kt_tensor_narrow(&x, dim_in(at->dim, &x), at->start, at->length, &v));
    kt__shape_out(&out[0], v.dtype, v.ndim, v.shape);
    return KT_OK;
}

static kt_status fwd_narrow(const kt__op_call *c)
{
    const kt_tensor *x = &c->in[0];
    const kt_op_attrs *at = c->attrs;
    const int dim = dim_in(at->dim, x);
    int64_t outer = kt__dims_product(x, 0, dim), slab = inner_bytes(x, dim);
    int64_t in_row = x->shape[dim] * slab, out_row = at->length * slab;
    copy_block(c->pool, c->out_w[0].data, 0, out_row, x->data, at->start * slab, in_row, outer,
               out_row);
    return KT_OK;
}

/* Only the parts of each row outside the slice are zeroed, so no byte is written twice. */
static kt_status bwd_narrow(const kt__op_call *c)
{
    kt_tensor *gx = &c->gin[0];
    if (gx->data == NULL)
        return KT_OK;
    const kt_op_attrs *at = c->attrs;
    const int dim = dim_in(at->dim, gx);
    int64_t outer = kt__dims_product(gx, 0, dim), slab = inner_bytes(gx, dim);
    int64_t in_row = gx->shape[dim] * slab, out_row = at->length * slab;
    int64_t head = at->start * slab, tail_at = head + out_row;
    copy_block(c->pool, gx->data, 0, in_row, NULL, 0, 0, outer, head);
    copy_block(c->pool, gx->data, tail_at, in_row, NULL, 0, 0, outer, in_row - tail_at);
    copy_block(c->pool, gx->data, head, in_row, c->gout[0].data, 0, out_row, outer, out_row);
    return KT_OK;
}

/* ---- transpose ----------------------------------------------------------------------------- */

static kt_status infer_transpose(const kt_op_attrs *at, const kt_tensor *in, int n_in,
                                 kt_tensor *out)
{
    (void)n_in;
    const kt_tensor *x = &in[0];
    KT__TRY(kt__check_rank("transpose", "x", x, 1, KT_MAX_DIMS));
    const int dims[2] = {at->dim0, at->dim1};
    for (int k = 0; k < 2; k++) {
        if (dims[k] < -x->ndim || dims[k] >= x->ndim) {
            char d[96];
            return kt__error(KT_EINVAL, "transpose: dim%d %d outside -%d..%d for x %s", k,
                             dims[k], x->ndim, x->ndim - 1, kt_tensor_describe(x, d, sizeof d));
        }
    }
    const int d0 = dim_in(at->dim0, x), d1 = dim_in(at->dim1, x);
    int64_t shape[KT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[d0] = x->shape[d1];
    shape[d1] = x->shape[d0];
    kt__shape_out(&out[0], x->dtype, x->ndim, shape);
    return KT_OK;
}

/* The destination walked row by row (its last dim), each row gathered from the source at
 * the transposed view's strides; both padded to four dims in front. */
typedef struct transpose_job {
    unsigned char *dst;
    const unsigned char *src;
    int64_t shape[KT_MAX_DIMS];   /* the destination's */
    int64_t strides[KT_MAX_DIMS]; /* source strides for each destination dim, in elements */
    size_t esize;
} transpose_job;

static void transpose_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const transpose_job *j = ctx;
    const int64_t n = j->shape[3], s3 = j->strides[3];
    const size_t es = j->esize;
    for (int64_t r = begin; r < end; r++) {
        int64_t i2 = r % j->shape[2], t = r / j->shape[2];
        int64_t i1 = t % j->shape[1], i0 = t / j->shape[1];
        const unsigned char *s =
            j->src + (size_t)(i0 * j->strides[0] + i1 * j->strides[1] + i2 * j->strides[2]) * es;
        unsigned char *d = j->dst + (size_t)(r * n) * es;
        if (s3 == 1) {
            memcpy(d, s, (size_t)n * es);
            continue;
        }
        /* Fixed-size element moves, which the compiler turns into plain loads and stores. */
        switch (es) {
        case 2:
            for (int64_t k = 0; k < n; k++)
                memcpy(d + (size_t)k * 2, s + (size_t)(k * s3) * 2, 2);
            break;
        case 4:
            for (int64_t k = 0; k < n; k++)
                memcpy(d + (size_t)k * 4, s + (size_t)(k * s3) * 4, 4);
            break;
        case 8:
            for (int64_t k = 0; k < n; k++)
                memcpy(d + (size_t)k * 8, s + (size_t)(k * s3) * 8, 8);
            break;
        default:
            for (int64_t k = 0; k < n; k++)
                memcpy(d + (size_t)k * es, s + (size_t)(k * s3) * es, es);
            break;
        }
    }
}

/* dst = src with dims dim0 and dim1 swapped; src contiguous. Swapping twice is the identity,
 * so the same routine is the forward and the backward. */
static void transpose_copy(kt_threadpool *pool, kt_tensor *dst, const kt_tensor *src, int dim0,
                           int dim1)
{
    int64_t numel = kt_tensor_numel(src);
    if (numel == 0)
        return;
    kt_tensor v;
    (void)kt_tensor_transpose(src, dim0, dim1, &v); /* dims checked by infer */
    transpose_job j = {.dst = dst->data, .src = src->data, .esize = kt_dtype_size(src->dtype)};
    int pad = KT_MAX_DIMS - v.ndim;
    for (int d = 0; d < KT_MAX_DIMS; d++) {
        j.shape[d] = d < pad ? 1 : v.shape[d - pad];
        j.strides[d] = d < pad ? 0 : v.strides[d - pad];
    }
    int64_t row_bytes = j.shape[3] * (int64_t)j.esize;
    int64_t grain = KT__COPY_GRAIN / row_bytes;
    kt_parallel_for(pool, numel / j.shape[3], grain > 0 ? grain : 1, transpose_range, &j);
}

static kt_status fwd_transpose(const kt__op_call *c)
{
    const kt_tensor *x = &c->in[0];
    transpose_copy(c->pool, &c->out_w[0], x, dim_in(c->attrs->dim0, x),
                   dim_in(c->attrs->dim1, x));
    return KT_OK;
}

static kt_status bwd_transpose(const kt__op_call *c)
{
    if (c->gin[0].data != NULL)
        transpose_copy(c->pool, &c->gin[0], &c->gout[0], dim_in(c->attrs->dim0, &c->in[0]),
                       dim_in(c->attrs->dim1, &c->in[0]));
    return KT_OK;
}

/* ---- reshape ------------------------------------------------------------------------------- */

static kt_status infer_reshape(const kt_op_attrs *at, const kt_tensor *in, int n_in,
                               kt_tensor *out)
{
    (void)n_in;
    /* A contiguous description of x: inference may see x before it has memory or strides. */
    kt_tensor x, v;
    kt__like(&x, &in[0]);
    KT__TRY(kt_tensor_reshape(&x, at->ndim, at->shape, &v));
    kt__shape_out(&out[0], v.dtype, v.ndim, v.shape);
    return KT_OK;
}

static kt_status fwd_reshape(const kt__op_call *c)
{
    copy_all(c->pool, c->out_w[0].data, c->in[0].data, kt_tensor_nbytes(&c->in[0]));
    return KT_OK;
}

static kt_status bwd_reshape(const kt__op_call *c)
{
    if (c->gin[0].data != NULL)
        copy_all(c->pool, c->gin[0].data, c->gout[0].data, kt_tensor_nbytes(&c->in[0]));
    return KT_OK;
}

/* ---- table rows ------------------------------------------------------------------------------ */

#define DIM_MIN (-KT_MAX_DIMS)
#define DIM_MAX (KT_MAX_DIMS - 1)
static const kt__attr_desc concat_attrs[] = {
    KT__A_INT("dim", dim, 0, DIM_MIN, DIM_MAX, "the dimension to join along (negative: from the end)"),
};
static const kt__attr_desc narrow_attrs[] = {
    KT__A_INT_REQ("dim", dim, DIM_MIN, DIM_MAX, "the dimension to cut (negative: from the end)"),
    KT__A_I64_REQ("start", start, 0, INT64_MAX, "the first index kept"),
    KT__A_I64_REQ("length", length, 0, INT64_MAX, "how many are kept"),
};
static const kt__attr_desc transpose_attrs[] = {
    KT__A_INT_REQ("dim0", dim0, DIM_MIN, DIM_MAX, "one dimension to swap (negative: from the end)"),
    KT__A_INT_REQ("dim1", dim1, DIM_MIN, DIM_MAX, "the other"),
};
static const kt__attr_desc reshape_attrs[] = {
    KT__A_SHAPE_REQ("shape", shape, ndim, -1, INT64_MAX,
                    "the new shape; one entry may be -1"),
};

/* No backward reads a forward tensor's data: the gradients only move bytes of grad_out, and
 * the shapes come from the inputs' descriptions. */
const kt__op_desc kt__op_concat = {
    .name = "concat", .min_in = 1, .max_in = KT_OP_MAX_IN, .n_out = 1, .infer = infer_concat,
    .forward = fwd_concat, .backward = bwd_concat,
    KT__ATTR_LIST(concat_attrs)};

const kt__op_desc kt__op_narrow = {
    .name = "narrow", .min_in = 1, .max_in = 1, .n_out = 1, .infer = infer_narrow,
    .forward = fwd_narrow, .backward = bwd_narrow,
    KT__ATTR_LIST(narrow_attrs)};

const kt__op_desc kt__op_transpose = {
    .name = "transpose", .min_in = 1, .max_in = 1, .n_out = 1, .infer = infer_transpose,
    .forward = fwd_transpose, .backward = bwd_transpose,
    KT__ATTR_LIST(transpose_attrs)};

const kt__op_desc kt__op_reshape = {
    .name = "reshape", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .infer = infer_reshape, .forward = fwd_reshape, .backward = bwd_reshape,
    KT__ATTR_LIST(reshape_attrs)};
