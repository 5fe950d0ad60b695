/* matmul: a [...,M,K] (trans_a: [...,K,M]) times b [...,K,N] (trans_b: [...,N,K]) -> [...,M,N],
 * the leading (batch) dims broadcast as numpy's do. f32 runs kt__sgemm (OpenBLAS or the
 * portable kernel, as it always has: the f32 results keep their bits); bf16 runs the kernel
 * registry's bf16 kernels with f32 accumulation (kernels/bf16_matmul.h), the f32 result rounded
 * once on the way out; f16 operands are staged to f32 in the caller's scratch, multiplied
 * through kt__sgemm and rounded once.
 *
 * Mixed: an f32 a with a bf16 or f16 b (frozen low-precision weights under f32 activations)
 * gives f32, the product of a with b widened exactly (kernels/mixed_matmul.h: b read in place,
 * widened as its panels are packed). a's gradient is the mixed products of the gradient with b;
 * b's (when b is trained) the f32 product of a and the gradient, computed in blocks of rows in
 * scratch (never one the size of b) and rounded to b's dtype.
 *
 * A product whose b is one matrix (plain [K,N], or batch dims all 1) and whose a is not
 * transposed is one 2-D product of a's stacked rows: the 2-D op's path, call for call. Any
 * other batch is one kernel call per output item (matmul_batch.c), and a broadcast operand's
 * gradient sums its items' products in item order. */
#include "lib/kernels/bf16_matmul.h"
#include "lib/kernels/mixed_matmul.h"
#include "lib/kernels/sgemm.h"
#include "lib/ops/matmul_batch.h"
#include "lib/ops/op_desc.h"
#include "lib/ops/op_util.h"

/* Whether a and b are matmul operands (ranks, K, batch dims), without an error message: for
 * the size functions, which may see anything. */
static int operands_ok(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (n != 2 || in[0].ndim < 2 || in[1].ndim < 2 || in[0].ndim > KT_MAX_DIMS ||
        in[1].ndim > KT_MAX_DIMS)
        return 0;
    const kt_tensor *a = &in[0], *b = &in[1];
    const int64_t K = at->trans_a ? a->shape[a->ndim - 2] : a->shape[a->ndim - 1];
    if (b->shape[b->ndim - (at->trans_b ? 1 : 2)] != K)
        return 0;
    for (int d = 0; d < KT__MM_BATCH; d++) {
        const int64_t ad = kt__mm_batch_dim(a, d), bd = kt__mm_batch_dim(b, d);
        if (ad != bd && ad != 1 && bd != 1)
            return 0;
    }
    return 1;
}

/* The dtypes matmul takes: a and b of one float dtype, or an f32 a with a bf16 or f16 b. */
static kt_status check_dtypes(const kt_tensor *a, const kt_tensor *b)
{
    KT__TRY(kt__check_float("matmul", "a", a));
    if (a->dtype == KT_F32 && (b->dtype == KT_F32 || kt__mm_mixed_dtypes(a, b)))
        return KT_OK;
    if (a->dtype == KT_F32)
        return kt__error(KT_EINVAL, "matmul: b must be f32, bf16 or f16 with an f32 a, got %s",
                         kt_dtype_name(b->dtype));
    if (b->dtype == a->dtype)
        return KT_OK;
    return kt__error(KT_EINVAL,
                     "matmul: b must be %s like a, got %s (mixed precision takes an f32 a with "
                     "a bf16 or f16 b, giving f32)",
                     kt_dtype_name(a->dtype), kt_dtype_name(b->dtype));
}

static kt_status infer_matmul(const kt_op_attrs *at, const kt_tensor *in, int n,
                              kt_tensor *out)
{
    (void)n;
    const kt_tensor *a = &in[0], *b = &in[1];
    KT__TRY(check_dtypes(a, b));
    KT__TRY(kt__check_rank("matmul", "a", a, 2, KT_MAX_DIMS));
    KT__TRY(kt__check_rank("matmul", "b", b, 2, KT_MAX_DIMS));
    const kt__mm_dims d = kt__mm_dims_of(at, in);
    const int b_k_dim = b->ndim - (at->trans_b ? 1 : 2);
    if (b->shape[b_k_dim] != d.K) {
        char db[96];
        return kt__error(KT_EINVAL, "matmul: b dimension %d must be %lld (a's K%s), got %s%s",
                         b_k_dim, (long long)d.K, at->trans_a ? ", a transposed" : "",
                         kt_tensor_describe(b, db, sizeof db),
                         at->trans_b ? " (b transposed)" : "");
    }
    if (!operands_ok(at, in, n)) {
        char da[96], db[96];
        return kt__error(KT_EINVAL,
                         "matmul: the batch dims of b %s do not broadcast against a's %s (each "
                         "pair, aligned from the end, must be equal or 1)",
                         kt_tensor_describe(b, db, sizeof db),
                         kt_tensor_describe(a, da, sizeof da));
    }
    int64_t shape[KT_MAX_DIMS];
    const int nb = (a->ndim > b->ndim ? a->ndim : b->ndim) - 2;
    for (int k = 0; k < nb; k++)
        shape[k] = d.ob[KT__MM_BATCH - nb + k];
    shape[nb] = d.m;
    shape[nb + 1] = d.N;
    kt__shape_out(&out[0], a->dtype, nb + 2, shape);
    return KT_OK;
}

static double flops_matmul(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (!operands_ok(at, in, n))
        return 0.0;
    const kt__mm_dims d = kt__mm_dims_of(at, in);
    return 2.0 * (double)d.items * (double)d.m * (double)d.N * (double)d.K;
}

/* The 2-D path sees the flat product's dims: M is every row of a. */
typedef struct mm_dims {
    int64_t M, N, K;
} mm_dims;

static mm_dims dims_of(const kt_op_attrs *at, const kt_tensor *in)
{
    const kt__mm_dims b = kt__mm_dims_of(at, in);
    return (mm_dims){b.M, b.N, b.K};
}

/* Rows of b's gradient a mixed backward computes at a time in f32 scratch: about 4 MiB of them,
 * and all of them where that is more than b has. */
static int64_t grad_b_rows(int64_t rows, int64_t cols)
{
    const int64_t per = (int64_t)1 << 20;
    int64_t r = cols > 0 ? per / cols : rows;
    r = r < 1 ? 1 : r;
    return r < rows ? r : rows;
}

/* The mixed products' work (mixed_matmul.h) and b's gradient block, forward or backward (the
 * gradient of a first, then b's in the same place). */
static size_t mixed_scratch(const kt_op_attrs *at, const kt_tensor *in, int backward)
{
    const int ta = at->trans_a, tb = at->trans_b;
    const mm_dims d = dims_of(at, in);
    if (!backward)
        return kt__mixed_matmul_work_bytes(d.M, d.N);
    const size_t ga = ta ? kt__mixed_matmul_work_bytes(d.K, d.M)
                         : kt__mixed_matmul_work_bytes(d.M, d.K);
    const int64_t rows = tb ? d.N : d.K, cols = tb ? d.K : d.N;
    const size_t gb = kt__f32_scratch_bytes(grad_b_rows(rows, cols) * cols);
    return ga > gb ? ga : gb;
}

/* bf16 and f16 products of the 2-D path run on f32 staged in scratch. Scratch is only sized
 * for inputs that pass infer (operands_ok); anything else needs none, and the kernel is never
 * reached for it. */
static int staged(const kt_tensor *in)
{
    return in[0].dtype == KT_BF16 || in[0].dtype == KT_F16;
}

static int mixed(const kt_tensor *in) { return kt__mm_mixed_dtypes(&in[0], &in[1]); }

/* The bf16 kernels' work buffer (after the f32 result) for the forward, or for the larger of
 * the backward's two products. */
static size_t bf16_work(const kt_op_attrs *at, const kt_tensor *in, int backward)
{
    if (in[0].dtype != KT_BF16)
        return 0;
    const int ta = at->trans_a, tb = at->trans_b;
    const mm_dims d = dims_of(at, in);
    if (!backward)
        return kt__bf16_matmul_work_bytes(ta, tb, d.M, d.N, d.K);
    const size_t ga = ta ? kt__bf16_matmul_work_bytes(tb, 1, d.K, d.M, d.N)
                         : kt__bf16_matmul_work_bytes(0, !tb, d.M, d.K, d.N);
    const size_t gb = tb ? kt__bf16_matmul_work_bytes(1, ta, d.N, d.K, d.M)
                         : kt__bf16_matmul_work_bytes(!ta, 0, d.K, d.N, d.M);
    return ga > gb ? ga : gb;
}

/* forward: a, b, out */
static size_t scratch_fwd_matmul(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (!operands_ok(at, in, n))
        return 0;
    if (!kt__mm_dims_of(at, in).flat)
        return kt__mm_batch_scratch(at, in, 0);
    if (mixed(in))
        return mixed_scratch(at, in, 0);
    if (!staged(in))
        return 0;
    const mm_dims d = dims_of(at, in);
    return kt__f32_scratch_bytes(d.M * d.K) + kt__f32_scratch_bytes(d.K * d.N) +
           kt__f32_scratch_bytes(d.M * d.N) + bf16_work(at, in, 0);
}

/* backward: a, b, grad out, and one gradient at a time (da, then db in the same place) */
static size_t scratch_bwd_matmul(const kt_op_attrs *at, const kt_tensor *in, int n)
{
    if (!operands_ok(at, in, n))
        return 0;
    if (!kt__mm_dims_of(at, in).flat)
        return kt__mm_batch_scratch(at, in, 1);
    if (mixed(in))
        return mixed_scratch(at, in, 1);
    if (!staged(in))
        return 0;
    const mm_dims d = dims_of(at, in);
    const int64_t grad = d.M * d.K > d.K * d.N ? d.M * d.K : d.K * d.N;
    return kt__f32_scratch_bytes(d.M * d.K) + kt__f32_scratch_bytes(d.K * d.N) +
           kt__f32_scratch_bytes(d.M * d.N) + kt__f32_scratch_bytes(grad) +
           bf16_work(at, in, 1);
}

/* The bf16 forward: the scratch (scratch_fwd_matmul) holds the f32 result first, then the
 * kernels' work (bf16_matmul.h). */
static kt_status fwd_matmul_bf16(const kt__op_call *c)
{
    const int ta = c->attrs->trans_a, tb = c->attrs->trans_b;
    const mm_dims d = dims_of(c->attrs, c->in);
    char *cursor = c->scratch;
    float *yf = kt__scratch_take(&cursor, d.M * d.N);
    kt__bf16_matmul(c->pool, ta, tb, d.M, d.N, d.K, c->in[0].data, ta ? d.M : d.K, c->in[1].data,
                    tb ? d.K : d.N, yf, d.N, cursor);
    kt__unstage_f32(c->pool, &c->out_w[0], yf);
    return KT_OK;
}

/* The bf16 backward: the products of bwd_matmul on bf16 a, b and grad out, each gradient in
 * f32 in the scratch, then rounded; the kernels' work after it. */
static kt_status bwd_matmul_bf16(const kt__op_call *c, kt_tensor *ga, kt_tensor *gb)
{
    const int ta = c->attrs->trans_a, tb = c->attrs->trans_b;
    const mm_dims d = dims_of(c->attrs, c->in);
    const int64_t lda = ta ? d.M : d.K, ldb = tb ? d.K : d.N, ldg = d.N;
    const kt_tensor *a = &c->in[0], *b = &c->in[1], *g = &c->gout[0];
    char *cursor = c->scratch;
    float *grad = kt__scratch_take(&cursor, d.M * d.K > d.K * d.N ? d.M * d.K : d.K * d.N);
    if (ga) {
        if (!ta)
            kt__bf16_matmul(c->pool, 0, !tb, d.M, d.K, d.N, g->data, ldg, b->data, ldb, grad, d.K, cursor);
        else
            kt__bf16_matmul(c->pool, tb, 1, d.K, d.M, d.N, b->data, ldb, g->data, ldg, grad, d.M, cursor);
        kt__unstage_f32(c->pool, ga, grad);
    }
    if (gb) {
        if (!tb)
            kt__bf16_matmul(c->pool, !ta, 0, d.K, d.N, d.M, a->data, lda, g->data, ldg, grad, d.N, cursor);
        else
            kt__bf16_matmul(c->pool, 1, ta, d.N, d.K, d.M, g->data, ldg, a->data, lda, grad, d.K, cursor);
        kt__unstage_f32(c->pool, gb, grad);
    }
    return KT_OK;
}

/* The mixed forward: one mixed product into the f32 output. */
static kt_status fwd_matmul_mixed(const kt__op_call *c)
{
    const int ta = c->attrs->trans_a, tb = c->attrs->trans_b;
    const mm_dims d = dims_of(c->attrs, c->in);
    const kt_tensor *a = &c->in[0], *b = &c->in[1];
    return kt__mixed_matmul(c->pool, ta, tb, d.M, d.N, d.K, a->data, KT_F32, ta ? d.M : d.K,
                            b->data, b->dtype, tb ? d.K : d.N, c->out_w[0].data, d.N, c->scratch);
}

/* The mixed backward (bwd_matmul's products): da by mixed products straight into its f32
 * tensor; db as f32 products of a and the gradient, a block of its rows at a time in scratch,
 * each rounded to b's dtype. A block of db's rows is the product's first operand read from
 * another row (not transposed) or column (transposed); no sum changes with the blocks. */
static kt_status bwd_matmul_mixed(const kt__op_call *c, kt_tensor *ga, kt_tensor *gb)
{
    const int ta = c->attrs->trans_a, tb = c->attrs->trans_b;
    const mm_dims d = dims_of(c->attrs, c->in);
    const int64_t lda = ta ? d.M : d.K, ldb = tb ? d.K : d.N, ldg = d.N;
    const kt_tensor *a = &c->in[0], *b = &c->in[1], *g = &c->gout[0];
    if (ga) {
        if (!ta)
            KT__TRY(kt__mixed_matmul(c->pool, 0, !tb, d.M, d.K, d.N, g->data, KT_F32, ldg, b->data,
                                     b->dtype, ldb, ga->data, d.K, c->scratch));
        else
            KT__TRY(kt__mixed_matmul(c->pool, tb, 1, d.K, d.M, d.N, b->data, b->dtype, ldb,
                                     g->data, KT_F32, ldg, ga->data, d.M, c->scratch));
    }
    if (gb) {
        /* !tb: db [K,N] = op(a)^T g; tb: db [N,K] = g^T op(a) */
        const int tx = tb ? 1 : !ta, ty = tb ? ta : 0;
        const float *X = tb ? g->data : a->data, *Y = tb ? a->data : g->data;
        const int64_t ldx = tb ? ldg : lda, ldy = tb ? lda : ldg;
        const int64_t rows = tb ? d.N : d.K, cols = tb ? d.K : d.N, inner = d.M;
        const int64_t step = grad_b_rows(rows, cols);
        float *block = c->scratch;
        for (int64_t r0 = 0; r0 < rows; r0 += step) {
            const int64_t r = rows - r0 < step ? rows - r0 : step;
            KT__TRY(kt__sgemm(c->pool, tx, ty, r, cols, inner, 1.0f, tx ? X + r0 : X + r0 * ldx,
                              ldx, Y, ldy, 0.0f, block, cols));
            kt_tensor part;
            KT__TRY(kt_tensor_init(&part, kt__elem_ptr(gb, r0 * cols), gb->dtype, 1,
                                   (int64_t[]){r * cols}));
            kt__unstage_f32(c->pool, &part, block);
        }
    }
    return KT_OK;
}

static kt_status fwd_matmul(const kt__op_call *c)
{
    if (!kt__mm_dims_of(c->attrs, c->in).flat)
        return kt__mm_batch_forward(c);
    const int ta = c->attrs->trans_a, tb = c->attrs->trans_b;
    const mm_dims d = dims_of(c->attrs, c->in);
    if (mixed(c->in))
        return fwd_matmul_mixed(c);
    if (c->in[0].dtype == KT_BF16)
        return fwd_matmul_bf16(c);
    char *cursor = c->scratch;
    const float *a = kt__stage_operand(c->pool, &c->in[0], &cursor);
    const float *b = kt__stage_operand(c->pool, &c->in[1], &cursor);
    kt_tensor *y = &c->out_w[0];
    float *yf = y->dtype == KT_F32 ? y->data : kt__scratch_take(&cursor, d.M * d.N);
    KT__TRY(kt__sgemm(c->pool, ta, tb, d.M, d.N, d.K, 1.0f, a, ta ? d.M : d.K, b,
                      tb ? d.K : d.N, 0.0f, yf, d.N));
    if (y->dtype != KT_F32)
        kt__unstage_f32(c->pool, y, yf);
    return KT_OK;
}

/* With G = dL/dY [M,N] and Y = op(A) op(B):
 *   d op(A) = G op(B)^T, so dA = G op(B)^T, or for trans_a dA = op(B) G^T;
 *   d op(B) = op(A)^T G, so dB = op(A)^T G, or for trans_b dB = G^T op(A).
 * op(B)^T and op(A)^T are B and A read with the opposite transpose flag. */
static kt_status bwd_matmul(const kt__op_call *c)
{
    const int ta = c->attrs->trans_a, tb = c->attrs->trans_b;
    const mm_dims d = dims_of(c->attrs, c->in);
    kt_tensor *ga = c->gin[0].data ? &c->gin[0] : NULL;
    kt_tensor *gb = c->gin[1].data ? &c->gin[1] : NULL;
    if (!ga && !gb)
        return KT_OK;
    if (!kt__mm_dims_of(c->attrs, c->in).flat)
        return kt__mm_batch_backward(c);
    if (mixed(c->in))
        return bwd_matmul_mixed(c, ga, gb);
    if (c->in[0].dtype == KT_BF16)
        return bwd_matmul_bf16(c, ga, gb);
    const int64_t lda = ta ? d.M : d.K, ldb = tb ? d.K : d.N, ldg = d.N;
    char *cursor = c->scratch;
    const float *a = kt__stage_operand(c->pool, &c->in[0], &cursor);
    const float *b = kt__stage_operand(c->pool, &c->in[1], &cursor);
    const float *g = kt__stage_operand(c->pool, &c->gout[0], &cursor);
    float *grad = (float *)cursor; /* da then db, when they need staging */
    if (ga) {
        float *out = ga->dtype == KT_F32 ? ga->data : grad;
        if (!ta)
            KT__TRY(kt__sgemm(c->pool, 0, !tb, d.M, d.K, d.N, 1.0f, g, ldg, b, ldb, 0.0f, out,
                              d.K));
        else
            KT__TRY(kt__sgemm(c->pool, tb, 1, d.K, d.M, d.N, 1.0f, b, ldb, g, ldg, 0.0f, out,
                              d.M));
        if (out == grad)
            kt__unstage_f32(c->pool, ga, grad);
    }
    if (gb) {
        float *out = gb->dtype == KT_F32 ? gb->data : grad;
        if (!tb)
            KT__TRY(kt__sgemm(c->pool, !ta, 0, d.K, d.N, d.M, 1.0f, a, lda, g, ldg, 0.0f, out,
                              d.N));
        else
            KT__TRY(kt__sgemm(c->pool, 1, ta, d.N, d.K, d.M, 1.0f, g, ldg, a, lda, 0.0f, out,
                              d.K));
        if (out == grad)
            kt__unstage_f32(c->pool, gb, grad);
    }
    return KT_OK;
}

static const kt__attr_desc matmul_attrs[] = {
    KT__A_BOOL("trans_a", trans_a, 0, "a is stored [...,K,M]"),
    KT__A_BOOL("trans_b", trans_b, 0, "b is stored [...,N,K]"),
};

const kt__op_desc kt__op_matmul = {
    .name = "matmul", .min_in = 2, .max_in = 2, .n_out = 1, .bwd_reads_in = 3u,
    .infer = infer_matmul, .scratch_fwd = scratch_fwd_matmul,
    .scratch_bwd = scratch_bwd_matmul, .flops = flops_matmul, .forward = fwd_matmul,
    .backward = bwd_matmul,
    KT__ATTR_LIST(matmul_attrs)};
