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

/* ---- numpy-style broadcasting of b into a's shape ----------------------------------------- */

/* Whether b broadcasts into a: b's dims, aligned from the end, are each 1 or a's, and b has
 * no more dims than a but for leading 1s. */
int kt__bcast_ok(const kt_tensor *a, const kt_tensor *b);
/* Whether b (broadcasting into a) is, without its leading 1s, a suffix of a's shape: it then
 * repeats every numel(b) elements of a, which kt__map2 and kt__reduce_rows serve. */
int kt__bcast_flat(const kt_tensor *a, const kt_tensor *b);
/* o[i] = f(a[i], b[bcast(i)]) for any b that broadcasts into a (o has a's shape), cut by rows
 * of a; element-wise, so the thread count changes nothing. */
void kt__map2_bcast(kt_threadpool *pool, kt_tensor *o, const kt_tensor *a, const kt_tensor *b,
                    kt__map2_fn fn, const kt_op_attrs *attrs);
/* db[j] = sum of f(g[i], a[i]) over the elements i of g (a's shape) that b's element j
 * broadcasts to, in increasing i (a may be NULL), for any db that broadcasts into g. The
 * partition is over elements of db, so the summation order is fixed for any pool. */
void kt__reduce_bcast(kt_threadpool *pool, kt_tensor *db, const kt_tensor *g,
                      const kt_tensor *a, kt__map2_fn fn, const kt_op_attrs *attrs);

#endif
