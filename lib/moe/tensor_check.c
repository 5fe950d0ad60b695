/* The layer's tensor checks in words: a message about a tensor the layer refuses names what
 * differs from what it needs (the dtype, the device, the shape, the strides), since the short
 * description of a tensor ("f32[128,64]") shows neither device nor strides. */
#include <stdarg.h>
#include <stdio.h>

#include "lib/moe/moe_internal.h"

/* Appends to buf (size bytes, holding *len) like snprintf, never past the end. */
static void append(char *buf, size_t size, size_t *len, const char *fmt, ...)
{
    if (*len + 1 >= size)
        return;
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(buf + *len, size - *len, fmt, ap);
    va_end(ap);
    if (n > 0)
        *len = *len + (size_t)n < size ? *len + (size_t)n : size - 1;
}

static void append_dims(char *buf, size_t size, size_t *len, int ndim, const int64_t *v)
{
    append(buf, size, len, "[");
    for (int d = 0; d < ndim; d++)
        append(buf, size, len, d ? ",%lld" : "%lld", (long long)v[d]);
    append(buf, size, len, "]");
}

char *kt__moe_tensor_wanted(kt_dtype d1, kt_dtype d2, int ndim, const int64_t *shape, char *buf,
                            size_t size)
{
    size_t len = 0;
    buf[0] = '\0';
    if (d1 == d2)
        append(buf, size, &len, "%s", kt_dtype_name(d1));
    else
        append(buf, size, &len, "%s or %s ", kt_dtype_name(d1), kt_dtype_name(d2));
    append_dims(buf, size, &len, ndim, shape);
    return buf;
}

int kt__moe_tensor_fits(const kt_tensor *t, kt_dtype d1, kt_dtype d2, int ndim,
                        const int64_t *shape, char *why, size_t size)
{
    size_t len = 0;
    why[0] = '\0';
    const char *sep = "";
    if (t->dtype != d1 && t->dtype != d2) {
        append(why, size, &len, "its dtype is %s, not %s", kt_dtype_name(t->dtype),
               kt_dtype_name(d1));
        if (d2 != d1)
            append(why, size, &len, " or %s", kt_dtype_name(d2));
        sep = "; ";
    }
    if (t->device.type != KT_DEVICE_CPU) {
        append(why, size, &len, "%sit is on cuda:%d, not the CPU", sep, t->device.index);
        sep = "; ";
    }
    int same_shape = t->ndim == ndim;
    for (int d = 0; d < ndim && same_shape; d++)
        same_shape = t->shape[d] == shape[d];
    if (!same_shape) {
        append(why, size, &len, "%sits shape is ", sep);
        append_dims(why, size, &len, t->ndim, t->shape);
        append(why, size, &len, ", not ");
        append_dims(why, size, &len, ndim, shape);
        sep = "; ";
    }
    if (t->ndim >= 0 && t->ndim <= KT_MAX_DIMS && !kt_tensor_is_contiguous(t)) {
        int64_t packed[KT_MAX_DIMS], stride = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            packed[d] = stride;
            stride *= t->shape[d];
        }
        append(why, size, &len, "%sits strides are ", sep);
        append_dims(why, size, &len, t->ndim, t->strides);
        append(why, size, &len, ", not the contiguous ");
        append_dims(why, size, &len, t->ndim, packed);
    }
    return why[0] == '\0';
}
