/* The tensor struct's helpers: construction, sizes, views. */
#include <stdio.h>
#include <string.h>

#include "lib/core/error.h"
#include "kt/tensor.h"

static const struct {
    const char *name;
    const char *safetensors_name;
    size_t size;
} dtype_info[KT_DTYPE_COUNT] = {
#define KT__DTYPE_INFO(upper, lower, size) {#lower, #upper, size},
    KT_DTYPE_LIST(KT__DTYPE_INFO)
#undef KT__DTYPE_INFO
};

static int dtype_valid(kt_dtype d) { return (unsigned)d < KT_DTYPE_COUNT; }

const char *kt_dtype_name(kt_dtype dtype)
{
    return dtype_valid(dtype) ? dtype_info[dtype].name : "?";
}

size_t kt_dtype_size(kt_dtype dtype) { return dtype_valid(dtype) ? dtype_info[dtype].size : 0; }

kt_status kt_dtype_from_name(const char *name, kt_dtype *dtype_out)
{
    if (name == NULL || dtype_out == NULL)
        return kt__error(KT_EINVAL, "kt_dtype_from_name: NULL argument");
    for (int d = 0; d < KT_DTYPE_COUNT; d++) {
        if (strcmp(name, dtype_info[d].name) == 0 ||
            strcmp(name, dtype_info[d].safetensors_name) == 0) {
            *dtype_out = (kt_dtype)d;
            return KT_OK;
        }
    }
    return kt__error(KT_EINVAL, "unknown dtype '%s' (expected f32, bf16, f16, i32 or i64)",
                     name);
}

static void set_contiguous_strides(kt_tensor *t)
{
    int64_t stride = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        t->strides[d] = stride;
        stride *= t->shape[d];
    }
}

kt_status kt_tensor_init(kt_tensor *t, void *data, kt_dtype dtype, int ndim,
                         const int64_t *shape)
{
    if (t == NULL)
        return kt__error(KT_EINVAL, "kt_tensor_init: tensor is NULL");
    if (!dtype_valid(dtype))
        return kt__error(KT_EINVAL, "kt_tensor_init: invalid dtype %d", (int)dtype);
    if (ndim < 0 || ndim > KT_MAX_DIMS)
        return kt__error(KT_EINVAL, "kt_tensor_init: ndim %d outside 0..%d", ndim,
                         KT_MAX_DIMS);
    if (ndim > 0 && shape == NULL)
        return kt__error(KT_EINVAL, "kt_tensor_init: shape is NULL");
    int64_t product = 1; /* of the non-zero dims: strides are computed from them */
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return kt__error(KT_EINVAL, "kt_tensor_init: dimension %d is negative (%lld)", d,
                             (long long)shape[d]);
        if (shape[d] > 0 && product > INT64_MAX / 16 / shape[d])
            return kt__error(KT_EINVAL, "kt_tensor_init: the shape's element count overflows "
                             "(dimension %d is %lld)", d, (long long)shape[d]);
        if (shape[d] > 0)
            product *= shape[d];
    }
    kt_tensor r;
    memset(&r, 0, sizeof r);
    r.data = data;
    r.dtype = dtype;
    r.ndim = ndim;
    for (int d = 0; d < ndim; d++)
        r.shape[d] = shape[d];
    set_contiguous_strides(&r);
    r.device.type = KT_DEVICE_CPU;
    *t = r;
    return KT_OK;
}

int64_t kt_tensor_numel(const kt_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

size_t kt_tensor_nbytes(const kt_tensor *t)
{
    return (size_t)kt_tensor_numel(t) * kt_dtype_size(t->dtype);
}

int kt_tensor_is_contiguous(const kt_tensor *t)
{
    int64_t stride = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != stride)
            return 0;
        stride *= t->shape[d];
    }
    return 1;
}

int kt_tensor_same_shape(const kt_tensor *a, const kt_tensor *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            return 0;
    return 1;
}

char *kt_tensor_describe(const kt_tensor *t, char *buf, size_t size)
{
    if (size == 0)
        return buf;
    int n = snprintf(buf, size, "%s[", kt_dtype_name(t->dtype));
    for (int d = 0; d < t->ndim && n > 0 && (size_t)n < size; d++)
        n += snprintf(buf + n, size - (size_t)n, d ? ",%lld" : "%lld", (long long)t->shape[d]);
    if (n > 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, "]");
    return buf;
}

kt_status kt_tensor_narrow(const kt_tensor *t, int dim, int64_t start, int64_t length,
                           kt_tensor *view_out)
{
    if (dim < 0 || dim >= t->ndim)
        return kt__error(KT_EINVAL, "narrow: dim %d outside 0..%d", dim, t->ndim - 1);
    if (start < 0 || length < 0 || start > t->shape[dim] - length) {
        /* The end is only reported; saturated, since start + length may not fit. */
        int64_t end = start > 0 && length > INT64_MAX - start   ? INT64_MAX
                      : start < 0 && length < INT64_MIN - start ? INT64_MIN
                                                                : start + length;
        return kt__error(KT_EINVAL, "narrow: range [%lld, %lld) outside dim %d of size %lld",
                         (long long)start, (long long)end, dim, (long long)t->shape[dim]);
    }
    kt_tensor v = *t;
    if (v.data != NULL)
        v.data = (char *)v.data + start * t->strides[dim] * (int64_t)kt_dtype_size(t->dtype);
    v.shape[dim] = length;
    *view_out = v;
    return KT_OK;
}

kt_status kt_tensor_transpose(const kt_tensor *t, int dim0, int dim1, kt_tensor *view_out)
{
    if (dim0 < 0 || dim0 >= t->ndim || dim1 < 0 || dim1 >= t->ndim)
        return kt__error(KT_EINVAL, "transpose: dims (%d, %d) outside 0..%d", dim0, dim1,
                         t->ndim - 1);
    kt_tensor v = *t;
    v.shape[dim0] = t->shape[dim1];
    v.shape[dim1] = t->shape[dim0];
    v.strides[dim0] = t->strides[dim1];
    v.strides[dim1] = t->strides[dim0];
    *view_out = v;
    return KT_OK;
}

kt_status kt_tensor_reshape(const kt_tensor *t, int ndim, const int64_t *shape,
                            kt_tensor *view_out)
{
    if (!kt_tensor_is_contiguous(t))
        return kt__error(KT_EINVAL, "reshape: the tensor is not contiguous");
    if (ndim < 0 || ndim > KT_MAX_DIMS)
        return kt__error(KT_EINVAL, "reshape: ndim %d outside 0..%d", ndim, KT_MAX_DIMS);
    if (ndim > 0 && shape == NULL)
        return kt__error(KT_EINVAL, "reshape: shape is NULL");
    int64_t resolved[KT_MAX_DIMS];
    int infer_at = -1;
    int64_t known = 1;
    for (int d = 0; d < ndim; d++) {
        resolved[d] = shape[d];
        if (shape[d] == -1) {
            if (infer_at >= 0)
                return kt__error(KT_EINVAL, "reshape: more than one dimension is -1");
            infer_at = d;
        } else if (shape[d] < 0) {
            return kt__error(KT_EINVAL, "reshape: dimension %d is negative (%lld)", d,
                             (long long)shape[d]);
        } else {
            if (shape[d] > 0 && known > INT64_MAX / shape[d])
                return kt__error(KT_EINVAL, "reshape: the shape's element count overflows "
                                 "(dimension %d is %lld)", d, (long long)shape[d]);
            known *= shape[d];
        }
    }
    int64_t numel = kt_tensor_numel(t);
    if (infer_at >= 0) {
        if (known == 0 || numel % known != 0)
            return kt__error(KT_EINVAL, "reshape: cannot infer dimension %d: %lld elements "
                             "do not divide by %lld", infer_at, (long long)numel,
                             (long long)known);
        resolved[infer_at] = numel / known;
        known = numel;
    }
    if (known != numel)
        return kt__error(KT_EINVAL, "reshape: %lld elements cannot take a shape of %lld",
                         (long long)numel, (long long)known);
    kt_tensor v;
    kt_status s = kt_tensor_init(&v, t->data, t->dtype, ndim, resolved);
    if (s != KT_OK)
        return s;
    v.device = t->device;
    *view_out = v;
    return KT_OK;
}
