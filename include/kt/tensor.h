/* The tensor: a plain struct that describes memory it does not own.
 *
 * Shapes and strides are counted in elements (not bytes), row-major by default. A view
 * (narrow, reshape, transpose) is a new struct over the same data. Memory comes from arenas
 * (kt/runtime.h) or from the caller.
 */
#ifndef KT_TENSOR_H
#define KT_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KT_MAX_DIMS 4

/* One list generates the dtype enum, the names and the element sizes. */
#define KT_DTYPE_LIST(X)  \
    X(F32, f32, 4)        \
    X(BF16, bf16, 2)      \
    X(F16, f16, 2)        \
    X(I32, i32, 4)        \
    X(I64, i64, 8)

typedef enum kt_dtype {
#define KT__DTYPE_ENUM(upper, lower, size) KT_##upper,
    KT_DTYPE_LIST(KT__DTYPE_ENUM)
#undef KT__DTYPE_ENUM
        KT_DTYPE_COUNT
} kt_dtype;

typedef enum kt_device_type { KT_DEVICE_CPU = 0, KT_DEVICE_CUDA = 1 } kt_device_type;

typedef struct kt_device {
    kt_device_type type;
    int index; /* CUDA device ordinal; 0 for the CPU */
} kt_device;

typedef struct kt_tensor {
    void *data;
    kt_dtype dtype;
    int ndim;                       /* 0 (scalar) .. KT_MAX_DIMS */
    int64_t shape[KT_MAX_DIMS];
    int64_t strides[KT_MAX_DIMS];   /* in elements */
    kt_device device;
} kt_tensor;

/* "f32", "bf16", ... or "?" for an invalid value. */
const char *kt_dtype_name(kt_dtype dtype);
/* Bytes per element; 0 for an invalid dtype. */
size_t kt_dtype_size(kt_dtype dtype);
/* Parses "f32", "bf16", ...; also the safetensors spellings "F32", "BF16", ... */
kt_status kt_dtype_from_name(const char *name, kt_dtype *dtype_out);

/* A contiguous CPU tensor over `data` (which may be NULL for a shape-only description).
 * Fails on a bad dtype, ndim outside 0..KT_MAX_DIMS, or a negative dimension. */
kt_status kt_tensor_init(kt_tensor *t, void *data, kt_dtype dtype, int ndim,
                         const int64_t *shape);

int64_t kt_tensor_numel(const kt_tensor *t);
/* Bytes spanned by the elements of a contiguous tensor: numel * element size. */
size_t kt_tensor_nbytes(const kt_tensor *t);
int kt_tensor_is_contiguous(const kt_tensor *t);
/* 1 when both have the same ndim and shape. */
int kt_tensor_same_shape(const kt_tensor *a, const kt_tensor *b);
/* Writes "f32[2,3]" into buf (always NUL-terminated); returns buf. */
char *kt_tensor_describe(const kt_tensor *t, char *buf, size_t size);

/* Views. The result shares t's data; t itself is not changed. */
kt_status kt_tensor_narrow(const kt_tensor *t, int dim, int64_t start, int64_t length,
                           kt_tensor *view_out);
kt_status kt_tensor_transpose(const kt_tensor *t, int dim0, int dim1, kt_tensor *view_out);
/* t must be contiguous; one entry of shape may be -1 (inferred). */
kt_status kt_tensor_reshape(const kt_tensor *t, int ndim, const int64_t *shape,
                            kt_tensor *view_out);

/* Conversions. To bf16/f16: round-to-nearest-even, a NaN stays a NaN (made quiet), overflow
 * goes to +-Inf. From bf16: exact (a bit shift, so NaN payloads pass unchanged); from f16:
 * exact, with signalling NaNs made quiet as the F16C hardware does.
 * Vectorised with AVX-512 BF16 / F16C where the CPU has them; the bits are the same either
 * way. src and dst must not overlap. */
void kt_f32_to_bf16(uint16_t *dst, const float *src, size_t n);
void kt_bf16_to_f32(float *dst, const uint16_t *src, size_t n);
void kt_f32_to_f16(uint16_t *dst, const float *src, size_t n);
void kt_f16_to_f32(float *dst, const uint16_t *src, size_t n);

/* Scalar forms, for single values. */
uint16_t kt_f32_to_bf16_1(float x);
float kt_bf16_to_f32_1(uint16_t x);
uint16_t kt_f32_to_f16_1(float x);
float kt_f16_to_f32_1(uint16_t x);

#ifdef __cplusplus
}
#endif
#endif
