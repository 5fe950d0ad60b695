/* Argument checks and chunked f32 access for the op kernels. */
#include <string.h>

#include "kt/tensor.h"
#include "lib/ops/op_util.h"

kt_status kt__check_rank(const char *op, const char *arg, const kt_tensor *t, int min_ndim,
                         int max_ndim)
{
    if (t->ndim >= min_ndim && t->ndim <= max_ndim)
        return KT_OK;
    char d[96];
    if (min_ndim == max_ndim)
        return kt__error(KT_EINVAL, "%s: %s must have %d dimension%s, got %s", op, arg,
                         min_ndim, min_ndim == 1 ? "" : "s", kt_tensor_describe(t, d, sizeof d));
    return kt__error(KT_EINVAL, "%s: %s must have %d to %d dimensions, got %s", op, arg,
                     min_ndim, max_ndim, kt_tensor_describe(t, d, sizeof d));
}

kt_status kt__check_float(const char *op, const char *arg, const kt_tensor *t)
{
    if (t->dtype == KT_F32 || t->dtype == KT_BF16 || t->dtype == KT_F16)
        return KT_OK;
    return kt__error(KT_EINVAL, "%s: %s must be f32, bf16 or f16, got %s", op, arg,
                     kt_dtype_name(t->dtype));
}

kt_status kt__check_f32(const char *op, const char *arg, const kt_tensor *t)
{
    if (t->dtype == KT_F32)
        return KT_OK;
    return kt__error(KT_EINVAL, "%s: %s must be f32, got %s", op, arg, kt_dtype_name(t->dtype));
}

kt_status kt__check_index(const char *op, const char *arg, const kt_tensor *t)
{
    if (t->dtype == KT_I32 || t->dtype == KT_I64)
        return KT_OK;
    return kt__error(KT_EINVAL, "%s: %s must be i32 or i64, got %s", op, arg,
                     kt_dtype_name(t->dtype));
}

kt_status kt__check_same_dtype(const char *op, const char *arg, const kt_tensor *b,
                               const kt_tensor *a)
{
    if (a->dtype == b->dtype)
        return KT_OK;
    return kt__error(KT_EINVAL, "%s: %s must be %s like the first input, got %s", op, arg,
                     kt_dtype_name(a->dtype), kt_dtype_name(b->dtype));
}

kt_status kt__check_same_shape(const char *op, const char *arg, const kt_tensor *b,
                               const kt_tensor *a)
{
    if (kt_tensor_same_shape(a, b))
        return KT_OK;
    char da[96], db[96];
    return kt__error(KT_EINVAL, "%s: %s must have shape %s, got %s", op, arg,
                     kt_tensor_describe(a, da, sizeof da), kt_tensor_describe(b, db, sizeof db));
}

kt_status kt__check_dim(const char *op, const char *arg, const kt_tensor *t, int dim,
                        int64_t size)
{
    if (dim < t->ndim && t->shape[dim] == size)
        return KT_OK;
    char d[96];
    return kt__error(KT_EINVAL, "%s: %s dimension %d must be %lld, got %s", op, arg, dim,
                     (long long)size, kt_tensor_describe(t, d, sizeof d));
}

void kt__shape_out(kt_tensor *out, kt_dtype dtype, int ndim, const int64_t *shape)
{
    (void)kt_tensor_init(out, NULL, dtype, ndim, shape);
}

void kt__like(kt_tensor *out, const kt_tensor *t) { kt__shape_out(out, t->dtype, t->ndim, t->shape); }

int64_t kt__dims_product(const kt_tensor *t, int from, int to)
{
    int64_t n = 1;
    for (int d = from; d < to; d++)
        n *= t->shape[d];
    return n;
}

int64_t kt__rows(const kt_tensor *t) { return t->ndim == 0 ? 1 : kt__dims_product(t, 0, t->ndim - 1); }

int64_t kt__row_len(const kt_tensor *t) { return t->ndim == 0 ? 1 : t->shape[t->ndim - 1]; }

const float *kt__load_f32(const kt_tensor *t, int64_t i, int64_t n, float *buf)
{
    switch (t->dtype) {
    case KT_F32:
        return (const float *)t->data + i;
    case KT_BF16:
        kt_bf16_to_f32(buf, (const uint16_t *)t->data + i, (size_t)n);
        return buf;
    case KT_F16:
        kt_f16_to_f32(buf, (const uint16_t *)t->data + i, (size_t)n);
        return buf;
    default:
        memset(buf, 0, (size_t)n * sizeof *buf); /* unreachable: dtypes checked by infer */
        return buf;
    }
}

float *kt__store_ptr(kt_tensor *t, int64_t i, float *buf)
{
    return t->dtype == KT_F32 ? (float *)t->data + i : buf;
}

void kt__store_commit(kt_tensor *t, int64_t i, int64_t n, const float *buf)
{
    if (t->dtype == KT_BF16)
        kt_f32_to_bf16((uint16_t *)t->data + i, buf, (size_t)n);
    else if (t->dtype == KT_F16)
        kt_f32_to_f16((uint16_t *)t->data + i, buf, (size_t)n);
}
