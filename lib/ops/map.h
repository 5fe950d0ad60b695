/* Element-wise drivers: run an f32 chunk function over whole tensors of any float dtype,
 * split over the thread pool. Used by the element-wise and activation op families. */
#ifndef KT_OPS_MAP_H
#define KT_OPS_MAP_H

#include "lib/ops/op_desc.h"

/* o[i] = f(a[i]) for one chunk */
typedef void (*kt__map1_fn)(float *o, const float *a, int64_t n, const kt_op_attrs *attrs);
/* o[i] = f(a[i], b[i]) for one chunk */
typedef void (*kt__map2_fn)(float *o, const float *a, const float *b, int64_t n,
                            const kt_op_attrs *attrs);

void kt__map1(kt_threadpool *pool, kt_tensor *o, const kt_tensor *a, kt__map1_fn fn,
              const kt_op_attrs *attrs);
/* o[i] = attrs->alpha * a[i]: the scale op's chunk function */
void kt__map_scale(float *o, const float *a, int64_t n, const kt_op_attrs *attrs);
/* b is either a's shape or broadcast: numel(b) divides numel(a) and b repeats every
 * numel(b) elements of a (b's shape is a suffix of a's). */
void kt__map2(kt_threadpool *pool, kt_tensor *o, const kt_tensor *a, const kt_tensor *b,
              kt__map2_fn fn, const kt_op_attrs *attrs);

/* db[j] = sum over rows r of f(g[r*inner + j], a[r*inner + j]) (a may be NULL: f gets NULL),
 * rows summed in order, for the gradient of a broadcast operand. fn writes products into o
 * for one chunk; the driver accumulates. */
void kt__reduce_rows(kt_threadpool *pool, kt_tensor *db, const kt_tensor *g,
                     const kt_tensor *a, kt__map2_fn fn, const kt_op_attrs *attrs);

#endif
