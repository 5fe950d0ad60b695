/* Batched matmul products that are not one 2-D product: one kernel call per output item.
 *
 * Items run one after the other with the pool inside each call when they are few and large, or
 * are shared out whole over the pool (each call on the caller's thread) when they are many or
 * small; both kernels give every element the same bits whatever their pool, so this choice
 * never changes a result. OpenBLAS threads itself, so under it the items run one by one. A
 * broadcast operand's gradient is each item's product in scratch, summed into the operand's
 * items in item order (deterministic; the sum runs over elements, never over items).
 *
 * Mixed (an f32 a, a bf16 or f16 b): the output's and a's gradient's products are mixed products
 * (mixed_matmul.h) on b as it is; b's gradient products are f32 ones (a and the gradient), held
 * in the scratch as f32 like every batch gradient here and rounded once into b. */
#include <stdatomic.h>
#include <string.h>

#include "lib/kernels/bf16_matmul.h"
#include "lib/kernels/mixed_matmul.h"
#include "lib/kernels/sgemm.h"
#include "lib/ops/matmul_batch.h"
#include "lib/ops/op_util.h"

int64_t kt__mm_batch_dim(const kt_tensor *t, int d)
{
    const int from_end = KT__MM_BATCH - 1 - d, nb = t->ndim - 2;
    return from_end < nb ? t->shape[nb - 1 - from_end] : 1;
}

kt__mm_dims kt__mm_dims_of(const kt_op_attrs *at, const kt_tensor *in)
{
    const kt_tensor *a = &in[0], *b = &in[1];
    const int na = a->ndim, nb = b->ndim;
    kt__mm_dims d;
    d.m = at->trans_a ? a->shape[na - 1] : a->shape[na - 2];
    d.K = at->trans_a ? a->shape[na - 2] : a->shape[na - 1];
    d.N = at->trans_b ? b->shape[nb - 2] : b->shape[nb - 1];
    int64_t sa = 1, sb = 1;
    d.items = 1;
    for (int k = KT__MM_BATCH - 1; k >= 0; k--) {
        const int64_t ad = kt__mm_batch_dim(a, k), bd = kt__mm_batch_dim(b, k);
        d.ob[k] = ad == 1 ? bd : ad;
        d.as[k] = ad == 1 ? 0 : sa;
        d.bs[k] = bd == 1 ? 0 : sb;
        sa *= ad;
        sb *= bd;
        d.items *= d.ob[k];
    }
    d.a_items = sa;
    d.b_items = sb;
    d.flat = sb == 1 && (!at->trans_a || sa == 1);
    d.M = d.flat ? d.items * d.m : d.m;
    return d;
}

/* The operand item that output item o reads, by the strides xs (d.as or d.bs). */
static int64_t item_of(const kt__mm_dims *d, const int64_t *xs, int64_t o)
{
    int64_t x = 0;
    for (int k = KT__MM_BATCH - 1; k >= 0; k--) {
        x += o % d->ob[k] * xs[k];
        o /= d->ob[k];
    }
    return x;
}

/* The bytes of work one bf16 call of an item may need (bf16_matmul.h: MM's buffer or the
 * transposed operand's rows), for the output or for the larger of the two gradients' products,
 * rounded up so that every item's part of the work stays 64-byte aligned. */
static int64_t work_bytes(const kt__mm_dims *d, int ta, int tb, int backward)
{
    const int64_t m = d->m, N = d->N, K = d->K;
    size_t w = kt__bf16_matmul_work_bytes(ta, tb, m, N, K);
    if (backward) {
        const size_t ga = ta ? kt__bf16_matmul_work_bytes(tb, 1, K, m, N)
                             : kt__bf16_matmul_work_bytes(0, !tb, m, K, N);
        const size_t gb = tb ? kt__bf16_matmul_work_bytes(1, ta, N, K, m)
                             : kt__bf16_matmul_work_bytes(!ta, 0, K, N, m);
        w = ga > gb ? ga : gb;
    }
    return (int64_t)((w + 63) / 64 * 64);
}

/* The same for the mixed products: the output's, or a's gradient's (b's are f32). */
static int64_t mixed_work_bytes(const kt__mm_dims *d, int ta, int backward)
{
    const int64_t m = d->m, N = d->N, K = d->K;
    const size_t w = !backward ? kt__mixed_matmul_work_bytes(m, N)
                     : ta      ? kt__mixed_matmul_work_bytes(K, m)
                               : kt__mixed_matmul_work_bytes(m, K);
    return (int64_t)((w + 63) / 64 * 64);
}

size_t kt__mm_batch_scratch(const kt_op_attrs *at, const kt_tensor *in, int backward)
{
    const kt__mm_dims d = kt__mm_dims_of(at, in);
    const kt_dtype dt = in[0].dtype;
    size_t bytes = 0;
    if (kt__mm_mixed_dtypes(&in[0], &in[1])) /* f32 out; the gradient products; the work */
        return (backward ? kt__f32_scratch_bytes(d.items * (d.m * d.K > d.K * d.N ? d.m * d.K
                                                                                  : d.K * d.N))
                         : 0) +
               (size_t)(d.items * mixed_work_bytes(&d, at->trans_a, backward));
    if (dt == KT_F16) /* a, b (and grad out) staged to f32 */
        bytes += kt__f32_scratch_bytes(kt_tensor_numel(&in[0])) +
                 kt__f32_scratch_bytes(kt_tensor_numel(&in[1])) +
                 (backward ? kt__f32_scratch_bytes(d.items * d.m * d.N) : 0);
    if (!backward && dt != KT_F32) /* the f32 result */
        bytes += kt__f32_scratch_bytes(d.items * d.m * d.N);
    if (backward) /* each item's gradient product */
        bytes += kt__f32_scratch_bytes(d.items * (d.m * d.K > d.K * d.N ? d.m * d.K : d.K * d.N));
    if (dt == KT_BF16)
        bytes += (size_t)(d.items * work_bytes(&d, at->trans_a, at->trans_b, backward));
    return bytes;
}

/* What one item computes: 0 the output, 1 a's gradient, 2 b's. */
enum { MM_OUT = 0, MM_GRAD_A = 1, MM_GRAD_B = 2 };

typedef struct batch_job {
    const kt__mm_dims *d;
    int ta, tb, bf16, mixed, which;
    const void *A, *B, *G; /* f32 (staged), bf16, or (mixed) b as it is */
    kt_dtype adt, bdt, gdt; /* what A, B and G hold */
    float *out;            /* items x item_len */
    int64_t item_len;
    char *work; /* bf16: work_len bytes an item (work_bytes) */
    int64_t work_len;
    atomic_int failed;
} batch_job;

/* C = op(X) op(Y), [rows x cols] over `inner`, by the operands' kernel (xdt, ydt: what X and
 * Y hold) */
static int product(kt_threadpool *pool, int tx, int ty, int64_t rows, int64_t cols,
                   int64_t inner, const void *X, kt_dtype xdt, int64_t ldx, const void *Y,
                   kt_dtype ydt, int64_t ldy, float *C, int64_t ldc, char *work)
{
    if (xdt == KT_BF16 && ydt == KT_BF16) {
        kt__bf16_matmul(pool, tx, ty, rows, cols, inner, X, ldx, Y, ldy, C, ldc, work);
        return 1;
    }
    if (xdt != KT_F32 || ydt != KT_F32)
        return kt__mixed_matmul(pool, tx, ty, rows, cols, inner, X, xdt, ldx, Y, ydt, ldy, C,
                                ldc, work) == KT_OK;
    return kt__sgemm(pool, tx, ty, rows, cols, inner, 1.0f, X, ldx, Y, ldy, 0.0f, C, ldc) ==
           KT_OK;
}

static const void *at_item(kt_dtype dt, const void *base, int64_t item, int64_t len)
{
    return (const char *)base + (size_t)(item * len) * kt_dtype_size(dt);
}

/* The products of bwd_matmul (matmul.c) for one item: the same calls on item pointers. */
static void run_item(batch_job *j, int64_t o, kt_threadpool *pool)
{
    const kt__mm_dims *d = j->d;
    const int ta = j->ta, tb = j->tb;
    const int64_t m = d->m, N = d->N, K = d->K;
    const int64_t lda = ta ? m : K, ldb = tb ? K : N, ldg = N;
    const kt_dtype adt = j->adt, bdt = j->bdt, gdt = j->gdt;
    const void *A = at_item(adt, j->A, item_of(d, d->as, o), m * K);
    const void *B = at_item(bdt, j->B, item_of(d, d->bs, o), K * N);
    const void *G = j->G ? at_item(gdt, j->G, o, m * N) : NULL;
    float *C = j->out + o * j->item_len;
    char *w = j->work ? j->work + o * j->work_len : NULL;
    int ok;
    if (j->which == MM_OUT)
        ok = product(pool, ta, tb, m, N, K, A, adt, lda, B, bdt, ldb, C, N, w);
    else if (j->which == MM_GRAD_A)
        ok = !ta ? product(pool, 0, !tb, m, K, N, G, gdt, ldg, B, bdt, ldb, C, K, w)
                 : product(pool, tb, 1, K, m, N, B, bdt, ldb, G, gdt, ldg, C, m, w);
    else
        ok = !tb ? product(pool, !ta, 0, K, N, m, A, adt, lda, G, gdt, ldg, C, N, w)
                 : product(pool, 1, ta, N, K, m, G, gdt, ldg, A, adt, lda, C, K, w);
    if (!ok)
        atomic_store(&j->failed, 1);
}

static void items_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    for (int64_t o = begin; o < end; o++)
        run_item(ctx, o, NULL);
}

/* An item below this many flops is too small to split over threads by itself. */
#define MM_SMALL_ITEM_FLOPS (4.0 * 1024 * 1024)

static kt_status run_items(kt_threadpool *pool, batch_job *j)
{
    const kt__mm_dims *d = j->d;
    const int threads = kt_threadpool_size(pool);
    const double flops = 2.0 * (double)d->m * (double)d->N * (double)d->K;
    /* (OpenBLAS threads itself: its products run one by one; b's mixed gradient is f32's) */
    const int own = j->bf16 || (j->mixed && j->which != MM_GRAD_B) || !kt__sgemm_is_openblas();
    const int by_items = threads > 1 && d->items > 1 && own &&
                         (d->items >= 2 * threads || flops < MM_SMALL_ITEM_FLOPS);
    if (by_items)
        kt_parallel_for(pool, d->items, 1, items_range, j);
    else
        for (int64_t o = 0; o < d->items; o++)
            run_item(j, o, pool);
    if (atomic_load(&j->failed))
        return kt__error(KT_EINVAL, "matmul: a batch item's product failed");
    return KT_OK;
}

/* t for the kernel: bf16 as it is, f32 as it is, f16 staged to f32 (but b of a mixed product,
 * read as it is); *dt what it then holds */
static const void *operand(kt_threadpool *pool, const kt_tensor *t, int as_is, char **cursor,
                           kt_dtype *dt)
{
    if (t->dtype == KT_BF16 || t->dtype == KT_F32 || as_is) {
        *dt = t->dtype;
        return t->data;
    }
    *dt = KT_F32;
    return kt__stage_operand(pool, t, cursor);
}

static char *take_work(char **cursor, const batch_job *j)
{
    char *w = *cursor;
    *cursor += j->d->items * j->work_len;
    return w;
}

kt_status kt__mm_batch_forward(const kt__op_call *c)
{
    const kt__mm_dims d = kt__mm_dims_of(c->attrs, c->in);
    char *cursor = c->scratch;
    const int mixed = kt__mm_mixed_dtypes(&c->in[0], &c->in[1]);
    batch_job j = {.d = &d, .ta = c->attrs->trans_a, .tb = c->attrs->trans_b,
                   .bf16 = c->in[0].dtype == KT_BF16, .mixed = mixed, .which = MM_OUT,
                   .item_len = d.m * d.N,
                   .work_len = mixed ? mixed_work_bytes(&d, c->attrs->trans_a, 0)
                                     : work_bytes(&d, c->attrs->trans_a, c->attrs->trans_b, 0)};
    atomic_init(&j.failed, 0);
    j.A = operand(c->pool, &c->in[0], 0, &cursor, &j.adt);
    j.B = operand(c->pool, &c->in[1], mixed, &cursor, &j.bdt);
    kt_tensor *y = &c->out_w[0];
    j.out = y->dtype == KT_F32 ? y->data : kt__scratch_take(&cursor, d.items * d.m * d.N);
    if (j.bf16 || mixed)
        j.work = take_work(&cursor, &j);
    if (d.items * d.m * d.N == 0)
        return KT_OK;
    KT__TRY(run_items(c->pool, &j));
    if (y->dtype != KT_F32)
        kt__unstage_f32(c->pool, y, j.out);
    return KT_OK;
}

/* dst[x] = the sum, in item order, of the products of the output items that read operand item
 * x; work items are KT__CHUNK pieces of dst's items. */
typedef struct sum_job {
    const kt__mm_dims *d;
    const int64_t *xs;
    kt_tensor *dst;
    const float *parts;
    int64_t len, pieces;
} sum_job;

static void sum_range(void *ctx, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    const sum_job *s = ctx;
    float acc[KT__CHUNK], obuf[KT__CHUNK];
    for (int64_t w = begin; w < end; w++) {
        const int64_t x = w / s->pieces, c0 = w % s->pieces * KT__CHUNK;
        const int64_t n = s->len - c0 < KT__CHUNK ? s->len - c0 : KT__CHUNK;
        for (int64_t e = 0; e < n; e++)
            acc[e] = 0.0f;
        for (int64_t o = 0; o < s->d->items; o++) {
            if (item_of(s->d, s->xs, o) != x)
                continue;
            const float *p = s->parts + o * s->len + c0;
            for (int64_t e = 0; e < n; e++)
                acc[e] += p[e];
        }
        float *out = kt__store_ptr(s->dst, x * s->len + c0, obuf);
        memcpy(out, acc, (size_t)n * sizeof *out);
        kt__store_commit(s->dst, x * s->len + c0, n, obuf);
    }
}

/* One operand's gradient: its items' products, then (when it broadcasts) their sums. */
static kt_status grad_of(const kt__op_call *c, batch_job *j, int which, kt_tensor *gx,
                         float *parts)
{
    const kt__mm_dims *d = j->d;
    const int64_t x_items = which == MM_GRAD_A ? d->a_items : d->b_items;
    const int64_t len = which == MM_GRAD_A ? d->m * d->K : d->K * d->N;
    const int own = x_items == d->items; /* every output item reads its own operand item */
    j->which = which;
    j->item_len = len;
    j->out = own && gx->dtype == KT_F32 ? gx->data : parts;
    if (len == 0)
        return KT_OK;
    KT__TRY(run_items(c->pool, j));
    if (j->out == gx->data)
        return KT_OK;
    if (own) {
        kt__unstage_f32(c->pool, gx, parts);
        return KT_OK;
    }
    sum_job s = {.d = d, .xs = which == MM_GRAD_A ? d->as : d->bs, .dst = gx, .parts = parts,
                 .len = len, .pieces = (len + KT__CHUNK - 1) / KT__CHUNK};
    const int64_t per = d->items / (x_items > 0 ? x_items : 1) * KT__CHUNK;
    kt_parallel_for(c->pool, x_items * s.pieces,
                    per > 0 && per < KT__GRAIN_ELEMS ? KT__GRAIN_ELEMS / per : 1, sum_range, &s);
    return KT_OK;
}

kt_status kt__mm_batch_backward(const kt__op_call *c)
{
    const kt__mm_dims d = kt__mm_dims_of(c->attrs, c->in);
    char *cursor = c->scratch;
    const int mixed = kt__mm_mixed_dtypes(&c->in[0], &c->in[1]);
    batch_job j = {.d = &d, .ta = c->attrs->trans_a, .tb = c->attrs->trans_b,
                   .bf16 = c->in[0].dtype == KT_BF16, .mixed = mixed,
                   .work_len = mixed ? mixed_work_bytes(&d, c->attrs->trans_a, 1)
                                     : work_bytes(&d, c->attrs->trans_a, c->attrs->trans_b, 1)};
    atomic_init(&j.failed, 0);
    j.A = operand(c->pool, &c->in[0], 0, &cursor, &j.adt);
    j.B = operand(c->pool, &c->in[1], mixed, &cursor, &j.bdt);
    j.G = operand(c->pool, &c->gout[0], 0, &cursor, &j.gdt);
    float *parts =
        kt__scratch_take(&cursor, d.items * (d.m * d.K > d.K * d.N ? d.m * d.K : d.K * d.N));
    if (j.bf16 || mixed)
        j.work = take_work(&cursor, &j);
    if (c->gin[0].data)
        KT__TRY(grad_of(c, &j, MM_GRAD_A, &c->gin[0], parts));
    if (c->gin[1].data)
        KT__TRY(grad_of(c, &j, MM_GRAD_B, &c->gin[1], parts));
    return KT_OK;
}
