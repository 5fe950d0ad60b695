/* matmul's batch: the broadcast of a's and b's leading dims (every product reads it) and the
 * kernels of products that are not one 2-D product (matmul.c runs those). */
#ifndef KT_OPS_MATMUL_BATCH_H
#define KT_OPS_MATMUL_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "lib/ops/op_desc.h"

/* Batch dims a matmul operand can have: all but its matrix's two. */
#define KT__MM_BATCH (KT_MAX_DIMS - 2)

typedef struct kt__mm_dims {
    int64_t m, N, K; /* one item's product: op(a) [m,K] times op(b) [K,N] */
    /* The output's batch dims, padded with 1s in front, and a's and b's item strides along
     * them (0 where the operand broadcasts). */
    int64_t ob[KT__MM_BATCH], as[KT__MM_BATCH], bs[KT__MM_BATCH];
    int64_t items, a_items, b_items;
    /* b is one matrix and a's items are stacked rows (a not transposed, or a single item):
     * one 2-D product of M = items * m rows (else M = m). */
    int flat;
    int64_t M;
} kt__mm_dims;

/* Whether a and b are the mixed product's operands: an f32 a with a bf16 or f16 b. */
static inline int kt__mm_mixed_dtypes(const kt_tensor *a, const kt_tensor *b)
{
    return a->dtype == KT_F32 && (b->dtype == KT_BF16 || b->dtype == KT_F16);
}

/* t's batch dim d of KT__MM_BATCH, the dims padded with 1s in front. */
int64_t kt__mm_batch_dim(const kt_tensor *t, int d);
/* The dims of a product whose operands' ranks (2..KT_MAX_DIMS) and batch dims are valid. */
kt__mm_dims kt__mm_dims_of(const kt_op_attrs *at, const kt_tensor *in);

/* Scratch of a product that is not flat, forward (backward = 0) or backward. */
size_t kt__mm_batch_scratch(const kt_op_attrs *at, const kt_tensor *in, int backward);
kt_status kt__mm_batch_forward(const kt__op_call *c);
kt_status kt__mm_batch_backward(const kt__op_call *c);

#endif
