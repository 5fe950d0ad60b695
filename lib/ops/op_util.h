/* Helpers shared by the op kernels: argument checks whose messages name the op and the
 * argument, and chunked f32 access to f32/bf16/f16 tensors so that each kernel is written
 * once, in f32. */
#ifndef KT_OPS_OP_UTIL_H
#define KT_OPS_OP_UTIL_H

#include <stdint.h>

#include "lib/core/error.h"
#include "kt/ops.h"

/* Elements processed per chunk by the chunked helpers (a stack buffer of floats). */
#define KT__CHUNK 512

/* Elements a part of a parallel loop should hold at least, to pay for waking a thread. */
#define KT__GRAIN_ELEMS 16384

/* The grain, in rows, of a loop over rows of row_len elements. */
static inline int64_t kt__rows_grain(int64_t row_len)
{
    return row_len > 0 && row_len < KT__GRAIN_ELEMS ? KT__GRAIN_ELEMS / row_len : 1;
}

/* The grain, in columns, of a loop over the columns of `rows` rows (at least 16 columns: a
 * part's columns are contiguous in each row). */
static inline int64_t kt__cols_grain(int64_t rows)
{
    const int64_t g = KT__GRAIN_ELEMS / (rows > 0 ? rows : 1);
    return g < 16 ? 16 : g;
}

/* ---- checks (each returns KT_EINVAL with "<op>: <arg> ..." on failure) ---------------- */
kt_status kt__check_rank(const char *op, const char *arg, const kt_tensor *t, int min_ndim,
                         int max_ndim);
kt_status kt__check_float(const char *op, const char *arg, const kt_tensor *t);
kt_status kt__check_f32(const char *op, const char *arg, const kt_tensor *t);
kt_status kt__check_index(const char *op, const char *arg, const kt_tensor *t);
/* b has a's dtype. */
kt_status kt__check_same_dtype(const char *op, const char *arg, const kt_tensor *b,
                               const kt_tensor *a);
kt_status kt__check_same_shape(const char *op, const char *arg, const kt_tensor *b,
                               const kt_tensor *a);
/* The dimension `dim` of t has `size`. */
kt_status kt__check_dim(const char *op, const char *arg, const kt_tensor *t, int dim,
                        int64_t size);

/* out = a contiguous tensor of the given dtype and shape, data NULL. */
void kt__shape_out(kt_tensor *out, kt_dtype dtype, int ndim, const int64_t *shape);
/* out = like t (dtype and shape), contiguous, data NULL. */
void kt__like(kt_tensor *out, const kt_tensor *t);

/* Product of t's dims [from, to). */
int64_t kt__dims_product(const kt_tensor *t, int from, int to);
/* Rows = product of all dims but the last; the last dim is the row length. */
int64_t kt__rows(const kt_tensor *t);
int64_t kt__row_len(const kt_tensor *t);

/* ---- chunked f32 access (contiguous tensors) ---------------------------------------- */

/* Elements [i, i + n) of t as f32: a pointer into t for f32, else converted into buf. */
const float *kt__load_f32(const kt_tensor *t, int64_t i, int64_t n, float *buf);
/* Where to compute elements [i, i + n) of t: into t directly for f32, else into buf. */
float *kt__store_ptr(kt_tensor *t, int64_t i, float *buf);
/* Finishes a store begun with kt__store_ptr (converts buf into t for bf16/f16). */
void kt__store_commit(kt_tensor *t, int64_t i, int64_t n, const float *buf);

/* Element i of an i32/i64 tensor. */
static inline int64_t kt__index_at(const kt_tensor *t, int64_t i)
{
    return t->dtype == KT_I32 ? (int64_t)((const int32_t *)t->data)[i]
                              : ((const int64_t *)t->data)[i];
}

/* Pointer to element i of a contiguous tensor, whatever its dtype. */
static inline void *kt__elem_ptr(const kt_tensor *t, int64_t i)
{
    return (char *)t->data + i * (int64_t)kt_dtype_size(t->dtype);
}

#endif
