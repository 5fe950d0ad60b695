/* cast: x converted to another float dtype (f32, bf16 or f16), rounding to nearest even where
 * the target is narrower; the backward converts the gradient back to x's dtype the same way.
 * Mixed-precision models use it where a bf16 tensor enters f32 arithmetic (a bf16 embedding's
 * rows into an f32 residual stream) or the reverse. A cast to x's own dtype copies.
 *
 * Conversions between the narrow dtypes go through f32, which holds every bf16 and f16 value
 * exactly, so each element is rounded once. Chunks are converted whole (read, then written),
 * so output 0 may lie over x when their byte sizes match (bf16 <-> f16, or the same dtype). */
#include <string.h>

#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

static const char *const cast_dtypes[] = {"f32", "bf16", "f16"};
_Static_assert(KT_F32 == 0 && KT_BF16 == 1 && KT_F16 == 2,
               "cast's dtype names are kt_dtype's first values, in order");

static kt_status infer_cast(const kt_op_attrs *at, const kt_tensor *in, int n, kt_tensor *out)
{
    (void)n;
    KT__TRY(kt__check_float("cast", "x", &in[0]));
    const kt_dtype to = at->cast_dtype;
    if (to != KT_F32 && to != KT_BF16 && to != KT_F16)
        return kt__error(KT_EINVAL, "cast: dtype must be f32, bf16 or f16, got %d", (int)to);
    kt__shape_out(&out[0], to, in[0].ndim, in[0].shape);
    return KT_OK;
}

typedef struct convert_job {
    const kt_tensor *src;
    kt_tensor *dst;
} convert_job;

static void convert_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const convert_job *j = ctx;
    float buf[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t i = begin; i < end; i += KT__CHUNK) {
        const int64_t n = end - i < KT__CHUNK ? end - i : KT__CHUNK;
        const float *v = kt__load_f32(j->src, i, n, buf);
        float *o = kt__store_ptr(j->dst, i, obuf);
        if (o != v) /* (f32 to f32 never gets here: convert copies it) */
            memcpy(o, v, (size_t)n * sizeof *o);
        kt__store_commit(j->dst, i, n, o);
    }
}

/* dst = src converted to dst's dtype (same shape, contiguous; dst may lie exactly over src
 * when the byte sizes match). */
static void convert(kt_threadpool *pool, const kt_tensor *src, kt_tensor *dst)
{
    if (src->dtype == dst->dtype) {
        if (dst->data != src->data)
            memcpy(dst->data, src->data, kt_tensor_nbytes(src));
        return;
    }
    convert_job j = {src, dst};
    kt_parallel_for(pool, kt_tensor_numel(src), KT__GRAIN_ELEMS, convert_range, &j);
}

static kt_status fwd_cast(const kt__op_call *c)
{
    convert(c->pool, &c->in[0], &c->out_w[0]);
    return KT_OK;
}

static kt_status bwd_cast(const kt__op_call *c)
{
    if (c->gin[0].data != NULL)
        convert(c->pool, &c->gout[0], &c->gin[0]);
    return KT_OK;
}

static const kt__attr_desc cast_attrs[] = {
    KT__A_ENUM("dtype", cast_dtype, KT_F32, cast_dtypes,
               "the output's dtype (round to nearest even)"),
};

const kt__op_desc kt__op_cast = {
    .name = "cast", .min_in = 1, .max_in = 1, .n_out = 1, .inplace_in = 1u,
    .infer = infer_cast, .forward = fwd_cast, .backward = bwd_cast,
    KT__ATTR_LIST(cast_attrs)};
