/* The op table's promises, checked against the kernels for every op in KT_OP_LIST.
 *
 * The graph compiler trusts each row: it frees every activation the backward does not
 * declare (bwd_reads_in / bwd_reads_out), lets output 0 take an input's memory when
 * inplace_in allows it (whenever the byte sizes match), and gives no gradient to no_grad_in
 * inputs. A row that claims too little makes training compute garbage without any error, so
 * for representative calls of every op (and variants where the kernel takes another path)
 * this suite checks, with no thread pool and with one:
 *   - forward writes every element of its outputs (outputs pre-filled with NaN / garbage
 *     give the same bytes as pre-zeroed ones), does not depend on the scratch's contents and
 *     leaves its inputs alone;
 *   - for each inplace_in bit whose input has output 0's byte size, forward with output 0 in
 *     the input's memory gives the out-of-place bytes;
 *   - backward reads only what the row declares: every input and output it does not declare
 *     is replaced by a copy of its shape filled with NaN (floats) or garbage (integers), the
 *     input gradients are pre-filled with NaN / garbage (backward overwrites, it does not
 *     accumulate), scratch is poisoned, and the gradients are bitwise those of a clean run,
 *     all requested together or each alone; backward leaves in/out/grad_out alone;
 *   - no_grad_in is the integer inputs (ids, targets) and float inputs that only select
 *     (topk_router's bias: nudging it leaves every output bitwise the same), and a gradient
 *     request for any of them is refused; the layout ops, which also move integer tensors,
 *     refuse a gradient request for them instead.
 * Every op needs at least one case here, so adding an op to KT_OP_LIST without one fails. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/ops/op_desc.h"
#include "tests/support/test_util.h"

/* ---- cases ------------------------------------------------------------------------------- */

typedef struct in_spec {
    kt_dtype dtype;
    int ndim;
    int64_t shape[KT_MAX_DIMS];
    double lo, hi; /* fill range; integers in [lo, hi) */
} in_spec;

enum { IGNORE_NONE = 0, IGNORE_SOME = 1, IGNORE_ALL = 2 };

typedef struct op_case {
    char name[64];
    kt_op op;
    kt_op_attrs attrs;
    int n_in;
    in_spec in[KT_OP_MAX_IN];
    int ignore; /* cross_entropy: targets set to attrs.ignore_index */
} op_case;

#define MAX_CASES 256
static op_case cases[MAX_CASES];
static int n_cases;

static void add_case(kt_op op, const char *variant, kt_op_attrs attrs, int ignore, int n_in,
                     const in_spec *in)
{
    assert_true(n_cases < MAX_CASES);
    assert_true(n_in >= 1 && n_in <= KT_OP_MAX_IN);
    op_case *c = &cases[n_cases++];
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s/%s", kt_op_name(op), variant);
    c->op = op;
    tu_attrs_into(&c->attrs, op, attrs);
    c->ignore = ignore;
    c->n_in = n_in;
    memcpy(c->in, in, (size_t)n_in * sizeof *in);
}

#define T(dt, lo, hi, ...) ((in_spec){(dt), TU_NDIM(__VA_ARGS__), {__VA_ARGS__}, (lo), (hi)})
#define T_SCALAR(dt) ((in_spec){(dt), 0, {0}, -1.0, 1.0})
#define A(...) ((kt_op_attrs){__VA_ARGS__})
#define N_SPECS(...) ((int)(sizeof((in_spec[]){__VA_ARGS__}) / sizeof(in_spec)))
#define CASE(op, variant, attrs, ...) \
    add_case((op), (variant), (attrs), IGNORE_NONE, N_SPECS(__VA_ARGS__), (in_spec[]){__VA_ARGS__})
#define CASE_CE(variant, attrs, ignore, ...)                                       \
    add_case(KT_OP_CROSS_ENTROPY, (variant), (attrs), (ignore), N_SPECS(__VA_ARGS__), \
             (in_spec[]){__VA_ARGS__})

#define F32 KT_F32
#define BF16 KT_BF16
#define F16 KT_F16
#define I32 KT_I32
#define I64 KT_I64

/* rope's attributes (theta and max_positions have no zero default, so A() cannot make them) */
static kt_op_attrs rope_at(int interleaved, int deinterleave, int rotary_dim, int yarn)
{
    kt_op_attrs a = kt_op_defaults(KT_OP_ROPE);
    a.rope_interleaved = interleaved, a.rope_deinterleave = deinterleave;
    a.rope_rotary_dim = rotary_dim, a.rope_max_positions = 64;
    if (yarn)
        a.rope_scaling = KT_ROPE_SCALING_YARN, a.rope_factor = 4.0f,
        a.rope_original_max_positions = 16;
    return a;
}

static void build_cases(void)
{
    n_cases = 0;
    const kt_op_attrs none = A(.dim = 0);

    CASE(KT_OP_MATMUL, "plain", none, T(F32, -1, 1, 5, 7), T(F32, -1, 1, 7, 6));
    CASE(KT_OP_MATMUL, "trans_a", A(.trans_a = 1), T(F32, -1, 1, 7, 5), T(F32, -1, 1, 7, 6));
    CASE(KT_OP_MATMUL, "trans_b", A(.trans_b = 1), T(F32, -1, 1, 5, 7), T(F32, -1, 1, 6, 7));
    CASE(KT_OP_MATMUL, "trans_ab", A(.trans_a = 1, .trans_b = 1), T(F32, -1, 1, 7, 5),
         T(F32, -1, 1, 6, 7));
    CASE(KT_OP_MATMUL, "bf16", none, T(BF16, -1, 1, 5, 7), T(BF16, -1, 1, 7, 6));
    CASE(KT_OP_MATMUL, "bf16 trans_ab", A(.trans_a = 1, .trans_b = 1), T(BF16, -1, 1, 7, 5),
         T(BF16, -1, 1, 6, 7));
    CASE(KT_OP_MATMUL, "square", none, T(F32, -1, 1, 6, 6), T(F32, -1, 1, 6, 6));
    CASE(KT_OP_MATMUL, "square trans_a", A(.trans_a = 1), T(F32, -1, 1, 6, 6),
         T(F32, -1, 1, 6, 6));
    CASE(KT_OP_MATMUL, "large", none, T(F32, -1, 1, 70, 40), T(F32, -1, 1, 40, 90));
    /* batched: a's stacked rows (one 2-D product), per item, broadcast either way */
    CASE(KT_OP_MATMUL, "3d a, 2d b", none, T(F32, -1, 1, 2, 5, 7), T(F32, -1, 1, 7, 6));
    CASE(KT_OP_MATMUL, "batch", none, T(F32, -1, 1, 3, 5, 7), T(F32, -1, 1, 3, 7, 6));
    CASE(KT_OP_MATMUL, "batch trans_a, 2d b", A(.trans_a = 1), T(F32, -1, 1, 3, 7, 5),
         T(F32, -1, 1, 7, 6));
    CASE(KT_OP_MATMUL, "2d a, batch b", A(.trans_b = 1), T(F32, -1, 1, 5, 7),
         T(F32, -1, 1, 2, 3, 6, 7));
    CASE(KT_OP_MATMUL, "4d broadcast trans_ab", A(.trans_a = 1, .trans_b = 1),
         T(F32, -1, 1, 2, 1, 7, 5), T(F32, -1, 1, 3, 6, 7));
    CASE(KT_OP_MATMUL, "bf16 batch broadcast", A(.trans_a = 1), T(BF16, -1, 1, 1, 7, 5),
         T(BF16, -1, 1, 4, 7, 6));
    CASE(KT_OP_MATMUL, "f16 batch", A(.trans_b = 1), T(F16, -1, 1, 2, 5, 7),
         T(F16, -1, 1, 2, 6, 7));
    CASE(KT_OP_MATMUL, "large batch", none, T(F32, -1, 1, 8, 40, 30), T(F32, -1, 1, 8, 30, 50));
    /* mixed: f32 a, bf16 or f16 b -> f32 */
    CASE(KT_OP_MATMUL, "f32 x bf16 trans_b", A(.trans_b = 1), T(F32, -1, 1, 5, 7),
         T(BF16, -1, 1, 6, 7));
    CASE(KT_OP_MATMUL, "f32 x f16 trans_a", A(.trans_a = 1), T(F32, -1, 1, 7, 5),
         T(F16, -1, 1, 7, 6));
    CASE(KT_OP_MATMUL, "f32 x bf16 large", none, T(F32, -1, 1, 70, 40), T(BF16, -1, 1, 40, 90));
    CASE(KT_OP_MATMUL, "f32 x bf16 batch broadcast", A(.trans_a = 1, .trans_b = 1),
         T(F32, -1, 1, 1, 7, 5), T(BF16, -1, 1, 4, 6, 7));

    const kt_op binary[3] = {KT_OP_ADD, KT_OP_SUB, KT_OP_MUL};
    for (int b = 0; b < 3; b++) {
        CASE(binary[b], "same shape", none, T(F32, -1, 1, 4, 6), T(F32, -1, 1, 4, 6));
        CASE(binary[b], "broadcast row", none, T(F32, -1, 1, 2, 3, 8), T(F32, -1, 1, 8));
        CASE(binary[b], "broadcast suffix", none, T(F32, -1, 1, 2, 3, 8), T(F32, -1, 1, 3, 8));
        CASE(binary[b], "broadcast scalar", none, T(F32, -1, 1, 3, 5), T_SCALAR(F32));
        CASE(binary[b], "bf16 broadcast", none, T(BF16, -1, 1, 4, 6), T(BF16, -1, 1, 6));
        CASE(binary[b], "f16 same shape", none, T(F16, -1, 1, 4, 6), T(F16, -1, 1, 4, 6));
        CASE(binary[b], "large broadcast", none, T(F32, -1, 1, 64, 520), T(F32, -1, 1, 520));
        CASE(binary[b], "large same shape", none, T(F32, -1, 1, 40000), T(F32, -1, 1, 40000));
        CASE(binary[b], "per row", none, T(F32, -1, 1, 5, 6), T(F32, -1, 1, 5, 1));
        CASE(binary[b], "leading 1", none, T(F32, -1, 1, 5, 6), T(F32, -1, 1, 1, 6));
        CASE(binary[b], "middle 1", none, T(F32, -1, 1, 2, 3, 8), T(F32, -1, 1, 2, 1, 8));
        CASE(binary[b], "bf16 per row", none, T(BF16, -1, 1, 4, 6), T(BF16, -1, 1, 4, 1));
        CASE(binary[b], "large per row", none, T(F32, -1, 1, 300, 96), T(F32, -1, 1, 300, 1));
        CASE(binary[b], "large column", none, T(F32, -1, 1, 300, 700), T(F32, -1, 1, 1, 700));
    }

    CASE(KT_OP_SCALE, "f32", A(.alpha = 0.75f), T(F32, -1, 1, 3, 5));
    CASE(KT_OP_SCALE, "bf16", A(.alpha = -1.5f), T(BF16, -1, 1, 3, 5));
    CASE(KT_OP_SCALE, "large", A(.alpha = 3.0f), T(F32, -1, 1, 40000));

    CASE(KT_OP_SILU, "f32", none, T(F32, -4, 4, 4, 9));
    CASE(KT_OP_SILU, "f16", none, T(F16, -4, 4, 4, 9));
    CASE(KT_OP_SILU, "large", none, T(F32, -4, 4, 40000));

    CASE(KT_OP_SWIGLU, "f32", none, T(F32, -3, 3, 4, 9), T(F32, -1, 1, 4, 9));
    CASE(KT_OP_SWIGLU, "bf16", none, T(BF16, -3, 3, 4, 9), T(BF16, -1, 1, 4, 9));
    CASE(KT_OP_SWIGLU, "large", none, T(F32, -3, 3, 40000), T(F32, -1, 1, 40000));

    CASE(KT_OP_SIGMOID, "f32", none, T(F32, -30, 30, 4, 9));
    CASE(KT_OP_SIGMOID, "bf16", none, T(BF16, -4, 4, 4, 9));
    CASE(KT_OP_SIGMOID, "large", none, T(F32, -4, 4, 40000));

    CASE(KT_OP_CLAMP, "f32", A(.clamp_min = -0.5f, .clamp_max = 0.5f), T(F32, -1, 1, 4, 9));
    CASE(KT_OP_CLAMP, "bf16", A(.clamp_min = -0.25f, .clamp_max = 0.75f), T(BF16, -1, 1, 4, 9));
    CASE(KT_OP_CLAMP, "large", A(.clamp_min = -0.5f, .clamp_max = 0.5f), T(F32, -1, 1, 40000));

    const kt_op reductions[2] = {KT_OP_SUM, KT_OP_MEAN};
    for (int r = 0; r < 2; r++) {
        CASE(reductions[r], "middle", A(.dim = 1), T(F32, -1, 1, 3, 5, 7));
        CASE(reductions[r], "last keepdim", A(.dim = -1, .reduce_keepdim = 1), T(F32, -1, 1, 4, 9));
        CASE(reductions[r], "bf16 first", A(.dim = 0), T(BF16, -1, 1, 6, 5));
        CASE(reductions[r], "1d", A(.dim = 0), T(F32, -1, 1, 700));
        CASE(reductions[r], "large", A(.dim = 0), T(F32, -1, 1, 300, 200));
        CASE(reductions[r], "large rows", A(.dim = -1), T(F32, -1, 1, 300, 200));
    }

    CASE(KT_OP_EXPAND, "4d heads", A(.dim = 2, .expand_size = 4), T(F32, -1, 1, 2, 3, 1, 5));
    CASE(KT_OP_EXPAND, "last", A(.dim = -1, .expand_size = 6), T(F32, -1, 1, 4, 1));
    CASE(KT_OP_EXPAND, "bf16 first", A(.dim = 0, .expand_size = 3), T(BF16, -1, 1, 1, 7));
    CASE(KT_OP_EXPAND, "large", A(.dim = 1, .expand_size = 16), T(F32, -1, 1, 64, 1, 700));

    CASE(KT_OP_RMSNORM, "3d", A(.eps = 1e-5f), T(F32, -2, 2, 3, 4, 16), T(F32, 0.5, 1.5, 16));
    CASE(KT_OP_RMSNORM, "bf16", none, T(BF16, -2, 2, 5, 12), T(BF16, 0.5, 1.5, 12));
    CASE(KT_OP_RMSNORM, "long rows", none, T(F32, -2, 2, 3, 700), T(F32, 0.5, 1.5, 700));
    CASE(KT_OP_RMSNORM, "many rows", none, T(F32, -2, 2, 300, 96), T(F32, 0.5, 1.5, 96));

    const kt_op rowwise[2] = {KT_OP_SOFTMAX, KT_OP_LOG_SOFTMAX};
    for (int r = 0; r < 2; r++) {
        CASE(rowwise[r], "2d", none, T(F32, -3, 3, 3, 10));
        CASE(rowwise[r], "1d", none, T(F32, -3, 3, 17));
        CASE(rowwise[r], "long rows", none, T(F32, -3, 3, 2, 700));
        CASE(rowwise[r], "bf16 3d", none, T(BF16, -3, 3, 2, 4, 9));
        CASE(rowwise[r], "many rows", none, T(F32, -3, 3, 300, 96));
    }

    CASE_CE("i32 some ignored", A(.ignore_index = -100), IGNORE_SOME, T(F32, -3, 3, 6, 10),
            T(I32, 0, 10, 6));
    CASE_CE("i64", A(.ignore_index = -100), IGNORE_NONE, T(F32, -3, 3, 5, 7), T(I64, 0, 7, 5));
    CASE_CE("bf16 long rows", A(.ignore_index = -100), IGNORE_SOME, T(BF16, -3, 3, 4, 700),
            T(I32, 0, 700, 4));
    CASE_CE("all ignored", A(.ignore_index = 2), IGNORE_ALL, T(F32, -3, 3, 4, 5),
            T(I32, 0, 5, 4));
    CASE_CE("many rows", A(.ignore_index = -1), IGNORE_SOME, T(F32, -3, 3, 600, 40),
            T(I64, 0, 40, 600));

    CASE(KT_OP_EMBEDDING, "i32 2d ids", none, T(F32, -1, 1, 10, 8), T(I32, 0, 10, 2, 3));
    CASE(KT_OP_EMBEDDING, "i64 ids", none, T(F32, -1, 1, 10, 8), T(I64, 0, 10, 5));
    CASE(KT_OP_EMBEDDING, "bf16", none, T(BF16, -1, 1, 10, 8), T(I32, 0, 10, 7));
    CASE(KT_OP_EMBEDDING, "long rows", none, T(F32, -1, 1, 6, 700), T(I32, 0, 6, 4));
    CASE(KT_OP_EMBEDDING, "many tokens", none, T(F32, -1, 1, 50, 64), T(I64, 0, 50, 400));

    CASE(KT_OP_TOPK_ROUTER, "k2", A(.k = 2), T(F32, -3, 3, 6, 8));
    CASE(KT_OP_TOPK_ROUTER, "k3 norm_topk", A(.k = 3, .norm_topk = 1), T(F32, -3, 3, 6, 8));
    CASE(KT_OP_TOPK_ROUTER, "k=E norm_topk", A(.k = 8, .norm_topk = 1), T(F32, -3, 3, 5, 8));
    CASE(KT_OP_TOPK_ROUTER, "many tokens", A(.k = 2), T(F32, -3, 3, 700, 16));
    CASE(KT_OP_TOPK_ROUTER, "v2 group-limited scaled",
         A(.k = 3, .router_n_group = 4, .router_topk_group = 2, .router_scaling = 16.0f),
         T(F32, -3, 3, 6, 16));
    CASE(KT_OP_TOPK_ROUTER, "v3 sigmoid bias top2 groups",
         A(.k = 4, .norm_topk = 1, .router_scoring = KT_ROUTER_SIGMOID, .router_n_group = 4,
           .router_topk_group = 2, .router_group_score = KT_ROUTER_GROUP_TOP2_SUM,
           .router_scaling = 2.5f),
         T(F32, -3, 3, 6, 16), T(F32, -0.3, 0.3, 16));
    CASE(KT_OP_TOPK_ROUTER, "sigmoid plain many tokens",
         A(.k = 2, .router_scoring = KT_ROUTER_SIGMOID), T(F32, -3, 3, 700, 16),
         T(F32, -0.3, 0.3, 16));

    CASE(KT_OP_LOAD_BALANCE_LOSS, "i32", none, T(F32, -3, 3, 6, 8), T(I32, 0, 8, 6, 2));
    CASE(KT_OP_LOAD_BALANCE_LOSS, "i64 many rows", none, T(F32, -3, 3, 1300, 16),
         T(I64, 0, 16, 1300, 4));

    CASE(KT_OP_CONV1D, "full causal", A(.conv_mode = KT_CONV_CAUSAL), T(F32, -1, 1, 2, 9, 3),
         T(F32, -1, 1, 4, 3, 3));
    CASE(KT_OP_CONV1D, "full same", A(.conv_mode = KT_CONV_SAME), T(F32, -1, 1, 2, 9, 3),
         T(F32, -1, 1, 4, 3, 3));
    CASE(KT_OP_CONV1D, "full same even K 2d", A(.conv_mode = KT_CONV_SAME),
         T(F32, -1, 1, 9, 3), T(F32, -1, 1, 4, 2, 3));
    CASE(KT_OP_CONV1D, "full valid", A(.conv_mode = KT_CONV_VALID), T(F32, -1, 1, 2, 9, 3),
         T(F32, -1, 1, 4, 3, 3));
    CASE(KT_OP_CONV1D, "full bf16 causal", A(.conv_mode = KT_CONV_CAUSAL),
         T(BF16, -1, 1, 2, 9, 3), T(BF16, -1, 1, 4, 3, 3));
    CASE(KT_OP_CONV1D, "depthwise causal", A(.depthwise = 1, .conv_mode = KT_CONV_CAUSAL),
         T(F32, -1, 1, 2, 9, 4), T(F32, -1, 1, 4, 3));
    CASE(KT_OP_CONV1D, "depthwise same 2d", A(.depthwise = 1, .conv_mode = KT_CONV_SAME),
         T(F32, -1, 1, 9, 4), T(F32, -1, 1, 4, 4));
    CASE(KT_OP_CONV1D, "depthwise valid", A(.depthwise = 1, .conv_mode = KT_CONV_VALID),
         T(F32, -1, 1, 2, 9, 4), T(F32, -1, 1, 4, 3));
    CASE(KT_OP_CONV1D, "depthwise bf16 same", A(.depthwise = 1, .conv_mode = KT_CONV_SAME),
         T(BF16, -1, 1, 2, 9, 4), T(BF16, -1, 1, 4, 3));
    CASE(KT_OP_CONV1D, "depthwise large", A(.depthwise = 1, .conv_mode = KT_CONV_CAUSAL),
         T(F32, -1, 1, 4, 300, 64), T(F32, -1, 1, 64, 4));
    CASE(KT_OP_CONV1D, "full large", A(.conv_mode = KT_CONV_SAME), T(F32, -1, 1, 2, 100, 32),
         T(F32, -1, 1, 48, 3, 32));

    CASE(KT_OP_CONCAT, "dim1 three", A(.dim = 1), T(F32, -1, 1, 2, 3), T(F32, -1, 1, 2, 1),
         T(F32, -1, 1, 2, 4));
    CASE(KT_OP_CONCAT, "dim0 one", A(.dim = 0), T(F32, -1, 1, 3, 4));
    CASE(KT_OP_CONCAT, "dim0 two", A(.dim = 0), T(F32, -1, 1, 2, 3), T(F32, -1, 1, 1, 3));
    CASE(KT_OP_CONCAT, "dim2 bf16", A(.dim = 2), T(BF16, -1, 1, 2, 3, 2),
         T(BF16, -1, 1, 2, 3, 5));
    CASE(KT_OP_CONCAT, "eight", A(.dim = 1), T(F32, -1, 1, 3, 1), T(F32, -1, 1, 3, 2),
         T(F32, -1, 1, 3, 3), T(F32, -1, 1, 3, 1), T(F32, -1, 1, 3, 2), T(F32, -1, 1, 3, 3),
         T(F32, -1, 1, 3, 1), T(F32, -1, 1, 3, 2));
    CASE(KT_OP_CONCAT, "i32", A(.dim = 1), T(I32, 0, 100, 2, 3), T(I32, 0, 100, 2, 2));

    CASE(KT_OP_NARROW, "dim1", A(.dim = 1, .start = 2, .length = 3), T(F32, -1, 1, 4, 6));
    /* one rank (no communicator): the halos are zeros */
    CASE(KT_OP_HALO, "causal", A(.dim = 0, .halo_left = 2), T(F32, -1, 1, 7, 3));
    CASE(KT_OP_HALO, "both sides, time dim 1", A(.dim = 1, .halo_left = 1, .halo_right = 2),
         T(BF16, -1, 1, 2, 6, 4));
    CASE(KT_OP_NARROW, "dim0 3d", A(.dim = 0, .start = 1, .length = 2),
         T(F32, -1, 1, 4, 3, 2));
    CASE(KT_OP_NARROW, "whole", A(.dim = 1, .start = 0, .length = 5), T(BF16, -1, 1, 2, 5));
    CASE(KT_OP_NARROW, "i64", A(.dim = 0, .start = 1, .length = 3), T(I64, 0, 100, 5, 3));

    CASE(KT_OP_TRANSPOSE, "3d 0<->2", A(.dim0 = 0, .dim1 = 2), T(F32, -1, 1, 2, 3, 4));
    CASE(KT_OP_TRANSPOSE, "2d", A(.dim0 = 1, .dim1 = 0), T(F32, -1, 1, 5, 7));
    CASE(KT_OP_TRANSPOSE, "same dim", A(.dim0 = 1, .dim1 = 1), T(F32, -1, 1, 3, 4));
    CASE(KT_OP_TRANSPOSE, "bf16 1<->2", A(.dim0 = 1, .dim1 = 2), T(BF16, -1, 1, 2, 3, 4));
    CASE(KT_OP_TRANSPOSE, "i32", A(.dim0 = 0, .dim1 = 1), T(I32, 0, 100, 3, 4));

    CASE(KT_OP_RESHAPE, "f32 -1", A(.ndim = 2, .shape = {2, -1}), T(F32, -1, 1, 3, 4));
    CASE(KT_OP_RESHAPE, "bf16 split", A(.ndim = 2, .shape = {2, 3}), T(BF16, -1, 1, 6));
    CASE(KT_OP_RESHAPE, "i64 flatten", A(.ndim = 1, .shape = {24}), T(I64, 0, 100, 2, 3, 4));
    CASE(KT_OP_RESHAPE, "large", A(.ndim = 2, .shape = {-1, 100}), T(F32, -1, 1, 200, 300));

    CASE(KT_OP_ROPE, "half, no positions", rope_at(0, 0, 0, 0), T(F32, -1, 1, 5, 3, 8));
    CASE(KT_OP_ROPE, "interleaved partial, i32 [T]", rope_at(1, 0, 8, 0),
         T(F32, -1, 1, 5, 3, 12), T(I32, 0, 64, 5));
    CASE(KT_OP_ROPE, "deinterleave yarn bf16, i64 [B,T]", rope_at(1, 1, 6, 1),
         T(BF16, -1, 1, 2, 5, 3, 8), T(I64, 0, 64, 2, 5));
    CASE(KT_OP_ROPE, "large", rope_at(0, 0, 24, 1), T(F32, -1, 1, 4, 64, 8, 32),
         T(I32, 0, 64, 64));

    CASE(KT_OP_ATTENTION, "gqa causal", A(.attn_causal = 1), T(F32, -2, 2, 2, 9, 4, 8),
         T(F32, -2, 2, 2, 9, 2, 8), T(F32, -1, 1, 2, 9, 2, 8));
    CASE(KT_OP_ATTENTION, "bf16 segments window softcap",
         A(.attn_causal = 1, .attn_window = 20, .attn_softcap = 3.0f),
         T(BF16, -2, 2, 1, 70, 2, 16), T(BF16, -2, 2, 1, 80, 1, 16),
         T(BF16, -1, 1, 1, 80, 1, 12), T(I32, 0, 3, 1, 80));
    CASE(KT_OP_ATTENTION, "f16 cross S < T", A(.attn_scale = 0.5f), T(F16, -2, 2, 1, 20, 2, 8),
         T(F16, -2, 2, 1, 7, 2, 8), T(F16, -1, 1, 1, 7, 2, 8));
    CASE(KT_OP_ATTENTION, "causal S < T rows see nothing", A(.attn_causal = 1),
         T(F32, -2, 2, 1, 70, 2, 8), T(F32, -2, 2, 1, 10, 1, 8), T(F32, -1, 1, 1, 10, 1, 5));
    CASE(KT_OP_ATTENTION, "many blocks i64 segments", A(.attn_causal = 1),
         T(F32, -2, 2, 1, 130, 2, 24), T(F32, -2, 2, 1, 150, 2, 24),
         T(F32, -1, 1, 1, 150, 2, 24), T(I64, 0, 2, 1, 150));

    /* one rank (no communicator): causal attention through the chunked path */
    CASE(KT_OP_CP_ATTENTION, "gqa balanced", A(.attn_window = 0), T(F32, -2, 2, 2, 10, 4, 8),
         T(F32, -2, 2, 2, 10, 2, 8), T(F32, -1, 1, 2, 10, 2, 8));
    CASE(KT_OP_CP_ATTENTION, "bf16 segments window contiguous",
         A(.attn_window = 20, .attn_softcap = 3.0f, .cp_layout = KT_CP_CONTIGUOUS),
         T(BF16, -2, 2, 1, 80, 2, 16), T(BF16, -2, 2, 1, 80, 1, 16),
         T(BF16, -1, 1, 1, 80, 1, 12), T(I32, 0, 3, 1, 80));
    CASE(KT_OP_CP_ATTENTION, "many blocks i64 segments", A(.attn_scale = 0.3f),
         T(F32, -2, 2, 1, 150, 2, 24), T(F32, -2, 2, 1, 150, 2, 24),
         T(F32, -1, 1, 1, 150, 2, 20), T(I64, 0, 2, 1, 150));

    CASE(KT_OP_CAST, "f32 to bf16", A(.cast_dtype = KT_BF16), T(F32, -3, 3, 4, 9));
    CASE(KT_OP_CAST, "bf16 to f32", A(.cast_dtype = KT_F32), T(BF16, -3, 3, 2, 3, 5));
    CASE(KT_OP_CAST, "f16 to bf16 (in place)", A(.cast_dtype = KT_BF16), T(F16, -3, 3, 7));
    CASE(KT_OP_CAST, "same dtype", A(.cast_dtype = KT_BF16), T(BF16, -3, 3, 4, 6));
    CASE(KT_OP_CAST, "large f32 to f16", A(.cast_dtype = KT_F16), T(F32, -3, 3, 40000));

    CASE(KT_OP_SHIFT_LABELS, "i64 [B,S]", A(.ignore_index = -100), T(I64, 0, 50, 3, 7));
    CASE(KT_OP_SHIFT_LABELS, "i32 1d", A(.ignore_index = -1), T(I32, 0, 50, 9));
    CASE(KT_OP_SHIFT_LABELS, "S = 1", A(.ignore_index = -100), T(I64, 0, 50, 4, 1));
    CASE(KT_OP_SHIFT_LABELS, "many rows", A(.ignore_index = -100), T(I32, 0, 1000, 3, 600, 40));
}

/* ---- helpers ------------------------------------------------------------------------------- */

enum { PAT_ZERO = 0, PAT_NAN = 1, PAT_GARBAGE = 2 };
static const char *const pat_names[3] = {"zero", "nan", "garbage"};

static int is_int(kt_dtype d) { return d == KT_I32 || d == KT_I64; }

/* NaN / INT_MAX, or random values (floats in [-3, 3], integers anything). */
static void fill_pattern(kt_tensor *t, int pattern, tu_rng *r)
{
    const int64_t n = kt_tensor_numel(t);
    if (pattern == PAT_ZERO) {
        memset(t->data, 0, kt_tensor_nbytes(t));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        switch (t->dtype) {
        case KT_F32:
            if (pattern == PAT_NAN)
                ((uint32_t *)t->data)[i] = 0x7fc00000u;
            else
                ((float *)t->data)[i] = (float)tu_rng_uniform(r, -3.0, 3.0);
            break;
        case KT_BF16:
            if (pattern == PAT_NAN)
                ((uint16_t *)t->data)[i] = 0x7fc0u;
            else
                tu_set(t, i, tu_rng_uniform(r, -3.0, 3.0));
            break;
        case KT_F16:
            if (pattern == PAT_NAN)
                ((uint16_t *)t->data)[i] = 0x7e00u;
            else
                tu_set(t, i, tu_rng_uniform(r, -3.0, 3.0));
            break;
        case KT_I32:
            ((int32_t *)t->data)[i] =
                pattern == PAT_NAN ? INT32_MAX : (int32_t)(uint32_t)tu_rng_next(r);
            break;
        case KT_I64:
            ((int64_t *)t->data)[i] =
                pattern == PAT_NAN ? INT64_MAX : (int64_t)(tu_rng_next(r) | 1ull << 62);
            break;
        default:
            fail_msg("bad dtype");
        }
    }
}

static kt_tensor alloc_like(const kt_tensor *desc)
{
    return tu_alloc(desc->dtype, desc->ndim, desc->shape);
}

/* 64-byte aligned scratch filled with zeros or 0xff bytes (NaN as f32, -1 as integers). */
typedef struct scratch {
    void *raw, *p;
    size_t bytes;
} scratch;

static scratch scratch_new(size_t bytes, int pattern)
{
    scratch s = {NULL, NULL, bytes};
    if (bytes == 0)
        return s;
    s.raw = malloc(bytes + 64);
    assert_non_null(s.raw);
    s.p = (void *)(((uintptr_t)s.raw + 63) & ~(uintptr_t)63);
    memset(s.p, pattern == PAT_ZERO ? 0 : 0xff, bytes);
    return s;
}

static void scratch_free(scratch *s) { free(s->raw); }

/* Fails with the first differing element of two tensors that should hold the same bytes. */
static void expect_same(const op_case *c, const char *what, const kt_tensor *got,
                        const kt_tensor *want)
{
    assert_int_equal(got->dtype, want->dtype);
    assert_true(kt_tensor_same_shape(got, want));
    if (memcmp(got->data, want->data, kt_tensor_nbytes(want)) == 0)
        return;
    const int64_t n = kt_tensor_numel(want);
    const size_t es = kt_dtype_size(want->dtype);
    for (int64_t i = 0; i < n; i++)
        if (memcmp((const char *)got->data + (size_t)i * es,
                   (const char *)want->data + (size_t)i * es, es) != 0)
            fail_msg("%s: %s: element %lld of %lld is %g, expected %g", c->name, what,
                     (long long)i, (long long)n, tu_get(got, i), tu_get(want, i));
}

/* A prepared case: its inputs and the inferred outputs. */
typedef struct prep {
    const op_case *c;
    const kt__op_desc *d;
    int n_in, n_out;
    kt_tensor in[KT_OP_MAX_IN];
    kt_tensor out_desc[KT_OP_MAX_OUT];
} prep;

static void prep_init(prep *p, const op_case *c, int index)
{
    memset(p, 0, sizeof *p);
    p->c = c;
    p->d = kt__op_get(c->op);
    assert_non_null(p->d);
    p->n_in = c->n_in;
    p->n_out = p->d->n_out;
    tu_rng rng;
    tu_rng_seed(&rng, 1000 + (uint64_t)index);
    for (int i = 0; i < c->n_in; i++) {
        const in_spec *s = &c->in[i];
        p->in[i] = tu_alloc(s->dtype, s->ndim, s->shape);
        tu_fill_uniform(&p->in[i], &rng, s->lo, s->hi);
    }
    if (c->op == KT_OP_CROSS_ENTROPY && c->ignore != IGNORE_NONE) {
        const int64_t n = kt_tensor_numel(&p->in[1]);
        for (int64_t i = 0; i < n; i++)
            if (c->ignore == IGNORE_ALL || i % 3 == 1)
                tu_set(&p->in[1], i, (double)c->attrs.ignore_index);
    }
    kt_status st = kt_op_infer(c->op, &c->attrs, p->in, p->n_in, p->out_desc, p->n_out);
    if (st != KT_OK)
        fail_msg("%s: infer: %s", c->name, kt_last_error());
}

static void prep_free(prep *p)
{
    for (int i = 0; i < p->n_in; i++)
        tu_free(&p->in[i]);
}

static void free_all(kt_tensor *t, int n)
{
    for (int i = 0; i < n; i++)
        tu_free(&t[i]);
}

static void forward(const prep *p, const kt_tensor *in, kt_tensor *out, kt_threadpool *pool,
                    int scratch_pattern, const char *what)
{
    size_t need = kt_op_scratch_bytes(p->c->op, &p->c->attrs, in, p->n_in, 0);
    scratch s = scratch_new(need, scratch_pattern);
    kt_exec ex = {.pool = pool, .scratch = s.p, .scratch_bytes = need};
    kt_status st = kt_op_forward(p->c->op, &p->c->attrs, in, p->n_in, out, p->n_out, &ex);
    scratch_free(&s);
    if (st != KT_OK)
        fail_msg("%s: forward (%s): %s", p->c->name, what, kt_last_error());
}

/* Outputs of a forward whose output buffers start out filled with `pattern`. */
static void forward_filled(const prep *p, kt_tensor *out, kt_threadpool *pool, int pattern,
                           tu_rng *rng)
{
    for (int o = 0; o < p->n_out; o++) {
        out[o] = alloc_like(&p->out_desc[o]);
        fill_pattern(&out[o], pattern, rng);
    }
    forward(p, p->in, out, pool, pattern, pat_names[pattern]);
}

static kt_threadpool *pools[2]; /* none, and three threads */

/* ---- 0: every op has cases ----------------------------------------------------------------- */

static void test_every_op_has_a_case(void **state)
{
    (void)state;
    int count[KT_OP_COUNT] = {0};
    for (int k = 0; k < n_cases; k++) {
        assert_true((unsigned)cases[k].op < KT_OP_COUNT);
        count[cases[k].op]++;
    }
    for (int op = 0; op < KT_OP_COUNT; op++) {
        /* moe runs a bound layer, which keeps its own saved state and reads no graph
         * activation in backward; test_graph_moe checks it inside sessions */
        if (op == KT_OP_MOE)
            continue;
        if (count[op] == 0)
            fail_msg("op '%s' has no case in test_op_contract: add representative calls",
                     kt_op_name((kt_op)op));
        const kt__op_desc *d = kt__op_get((kt_op)op);
        const unsigned in_mask = (1u << d->max_in) - 1u, out_mask = (1u << d->n_out) - 1u;
        assert_int_equal(d->inplace_in & ~in_mask, 0);
        assert_int_equal(d->bwd_reads_in & ~in_mask, 0);
        assert_int_equal(d->no_grad_in & ~in_mask, 0);
        assert_int_equal(d->bwd_reads_out & ~out_mask, 0);
    }
}

/* ---- 1: forward writes every element, ignores scratch contents, keeps its inputs ---------- */

static void test_forward_writes_all(void **state)
{
    (void)state;
    for (int pi = 0; pi < 2; pi++) {
        for (int k = 0; k < n_cases; k++) {
            prep p;
            prep_init(&p, &cases[k], k);
            tu_rng rng;
            tu_rng_seed(&rng, 77 + (uint64_t)k);
            kt_tensor keep[KT_OP_MAX_IN];
            for (int i = 0; i < p.n_in; i++)
                keep[i] = tu_clone(&p.in[i]);
            kt_tensor ref[KT_OP_MAX_OUT];
            forward_filled(&p, ref, pools[pi], PAT_ZERO, &rng);
            for (int pat = PAT_NAN; pat <= PAT_GARBAGE; pat++) {
                kt_tensor out[KT_OP_MAX_OUT];
                forward_filled(&p, out, pools[pi], pat, &rng);
                for (int o = 0; o < p.n_out; o++) {
                    char what[64];
                    snprintf(what, sizeof what, "output %d pre-filled with %s", o,
                             pat_names[pat]);
                    expect_same(p.c, what, &out[o], &ref[o]);
                }
                free_all(out, p.n_out);
            }
            for (int i = 0; i < p.n_in; i++) {
                char what[64];
                snprintf(what, sizeof what, "input %d after forward", i);
                expect_same(p.c, what, &p.in[i], &keep[i]);
            }
            free_all(ref, p.n_out);
            free_all(keep, p.n_in);
            prep_free(&p);
        }
    }
}

/* ---- 2: in-place forward ---------------------------------------------------------------- */

static unsigned inplace_exercised[KT_OP_COUNT];

static void test_inplace(void **state)
{
    (void)state;
    for (int pi = 0; pi < 2; pi++) {
        for (int k = 0; k < n_cases; k++) {
            prep p;
            prep_init(&p, &cases[k], k);
            const unsigned bits = p.d->inplace_in;
            if (bits == 0) {
                prep_free(&p);
                continue;
            }
            tu_rng rng;
            tu_rng_seed(&rng, 99 + (uint64_t)k);
            kt_tensor ref[KT_OP_MAX_OUT];
            forward_filled(&p, ref, pools[pi], PAT_ZERO, &rng);
            for (int i = 0; i < p.n_in; i++) {
                if (!(bits & (1u << i)))
                    continue;
                /* the planner shares whenever the byte sizes match (lifetimes.c) */
                const size_t in_bytes = kt_tensor_nbytes(&p.in[i]);
                if (in_bytes != kt_tensor_nbytes(&p.out_desc[0]) || in_bytes == 0)
                    continue;
                inplace_exercised[p.c->op] |= 1u << i;
                kt_tensor buf = tu_clone(&p.in[i]);
                kt_tensor in[KT_OP_MAX_IN];
                memcpy(in, p.in, sizeof in);
                in[i].data = buf.data;
                kt_tensor out[KT_OP_MAX_OUT];
                out[0] = p.out_desc[0];
                out[0].data = buf.data;
                for (int o = 1; o < p.n_out; o++) {
                    out[o] = alloc_like(&p.out_desc[o]);
                    fill_pattern(&out[o], PAT_NAN, &rng);
                }
                forward(&p, in, out, pools[pi], PAT_NAN, "in place");
                for (int o = 0; o < p.n_out; o++) {
                    char what[64];
                    snprintf(what, sizeof what, "output %d with output 0 in input %d's memory",
                             o, i);
                    expect_same(p.c, what, &out[o], &ref[o]);
                }
                for (int o = 1; o < p.n_out; o++)
                    tu_free(&out[o]);
                tu_free(&buf);
            }
            free_all(ref, p.n_out);
            prep_free(&p);
        }
    }
    for (int op = 0; op < KT_OP_COUNT; op++) {
        const unsigned bits = kt__op_get((kt_op)op)->inplace_in;
        if ((bits & ~inplace_exercised[op]) != 0)
            fail_msg("%s: inplace_in 0x%x, but no case gives input(s) 0x%x output 0's byte "
                     "size: add one",
                     kt_op_name((kt_op)op), bits, bits & ~inplace_exercised[op]);
    }
}

/* A direct call whose output 0 lies over an input the op does not compute in place from (or
 * over part of one) is refused, not run into wrong numbers; NULL outputs are refused too. */
static void test_aliasing_refused(void **state)
{
    (void)state;
    int refused = 0;
    for (int k = 0; k < n_cases; k++) {
        prep p;
        prep_init(&p, &cases[k], k);
        const size_t out_bytes = kt_tensor_nbytes(&p.out_desc[0]);
        for (int i = 0; i < p.n_in; i++) {
            const size_t in_bytes = kt_tensor_nbytes(&p.in[i]);
            const int allowed = (p.d->inplace_in >> i) & 1u;
            if (in_bytes == 0 || out_bytes == 0 || (allowed && in_bytes == out_bytes))
                continue;
            /* output 0 starting inside input i's bytes (4 bytes in, where it has more) */
            kt_tensor in[KT_OP_MAX_IN], out[KT_OP_MAX_OUT];
            memcpy(in, p.in, sizeof in);
            unsigned char *big = calloc(1, in_bytes + out_bytes + 64);
            assert_non_null(big);
            memcpy(big, p.in[i].data, in_bytes);
            in[i].data = big;
            for (int o = 0; o < p.n_out; o++)
                out[o] = alloc_like(&p.out_desc[o]);
            kt_tensor out0 = out[0];
            out[0].data = big + (in_bytes > 4 ? 4 : 0);
            size_t need = kt_op_scratch_bytes(p.c->op, &p.c->attrs, in, p.n_in, 0);
            scratch sc = scratch_new(need, PAT_ZERO);
            kt_exec ex = {.scratch = sc.p, .scratch_bytes = need};
            kt_status st = kt_op_forward(p.c->op, &p.c->attrs, in, p.n_in, out, p.n_out, &ex);
            if (st != KT_EINVAL || strstr(kt_last_error(), "overlaps input") == NULL)
                fail_msg("%s: output 0 over input %d: status %d (%s)", p.c->name, i, (int)st,
                         kt_last_error());
            refused++;
            scratch_free(&sc);
            out[0] = out0;
            for (int o = 0; o < p.n_out; o++)
                tu_free(&out[o]);
            free(big);
        }
        TU_EXPECT_ERROR(kt_op_forward(p.c->op, &p.c->attrs, p.in, p.n_in, NULL, p.n_out, NULL),
                        KT_EINVAL, "outputs are NULL");
        prep_free(&p);
    }
    assert_true(refused > 0);
}

/* The backward likewise: an input gradient over something the kernel reads, or over another
 * input gradient, is refused (matmul: dA = dY B^T reads B and dY). */
static void test_grad_aliasing_refused(void **state)
{
    (void)state;
    kt_tensor a = tu_new(KT_F32, 4, 4), b = tu_new(KT_F32, 4, 4), y = tu_new(KT_F32, 4, 4);
    kt_tensor gy = tu_new(KT_F32, 4, 4), ga = tu_new(KT_F32, 4, 4), gb = tu_new(KT_F32, 4, 4);
    for (int64_t i = 0; i < 16; i++)
        tu_set(&a, i, 0.1 * (double)i), tu_set(&b, i, 1.0 - 0.05 * (double)i),
            tu_set(&gy, i, 0.5);
    kt_tensor in[2] = {a, b};
    assert_int_equal(kt_op_forward(KT_OP_MATMUL, NULL, in, 2, &y, 1, NULL), KT_OK);
    kt_tensor gin[2] = {ga, gb};
    assert_int_equal(kt_op_backward(KT_OP_MATMUL, NULL, in, 2, &y, 1, &gy, gin, NULL), KT_OK);
    gin[0].data = b.data; /* dA over B, which the kernel reads */
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_MATMUL, NULL, in, 2, &y, 1, &gy, gin, NULL), KT_EINVAL,
                    "matmul backward", "input gradient 0 overlaps input 1");
    gin[0].data = gy.data; /* dA over dY */
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_MATMUL, NULL, in, 2, &y, 1, &gy, gin, NULL), KT_EINVAL,
                    "overlaps output gradient 0");
    gin[0].data = gb.data; /* dA over dB */
    TU_EXPECT_ERROR(kt_op_backward(KT_OP_MATMUL, NULL, in, 2, &y, 1, &gy, gin, NULL), KT_EINVAL,
                    "input gradients 0 and 1 overlap");
    tu_free(&a), tu_free(&b), tu_free(&y), tu_free(&gy), tu_free(&ga), tu_free(&gb);
}

/* ---- 3: backward reads only what it declares, writes all it is asked for ---------------- */

static int wants_grad(const prep *p, int i)
{
    return !(p->d->no_grad_in & (1u << i)) && !is_int(p->in[i].dtype);
}

static kt_status backward(const prep *p, const kt_tensor *in, const kt_tensor *out,
                          const kt_tensor *gout, kt_tensor *gin, kt_threadpool *pool,
                          int scratch_pattern)
{
    size_t need = kt_op_scratch_bytes(p->c->op, &p->c->attrs, in, p->n_in, 1);
    scratch s = scratch_new(need, scratch_pattern);
    kt_exec ex = {.pool = pool, .scratch = s.p, .scratch_bytes = need};
    kt_status st =
        kt_op_backward(p->c->op, &p->c->attrs, in, p->n_in, out, p->n_out, gout, gin, &ex);
    scratch_free(&s);
    return st;
}

/* gin[i] for the inputs in `mask` (filled with `pattern`), data NULL for the rest. */
static void make_gin(const prep *p, unsigned mask, int pattern, tu_rng *rng, kt_tensor *gin)
{
    for (int i = 0; i < p->n_in; i++) {
        if (mask & (1u << i)) {
            gin[i] = alloc_like(&p->in[i]);
            fill_pattern(&gin[i], pattern, rng);
        } else {
            gin[i] = p->in[i];
            gin[i].data = NULL;
        }
    }
}

static void free_gin(const prep *p, unsigned mask, kt_tensor *gin)
{
    for (int i = 0; i < p->n_in; i++)
        if (mask & (1u << i))
            tu_free(&gin[i]);
}

static void check_backward(const prep *p, kt_threadpool *pool, int index)
{
    const op_case *c = p->c;
    tu_rng rng;
    tu_rng_seed(&rng, 5000 + (uint64_t)index);
    kt_tensor out[KT_OP_MAX_OUT], gout[KT_OP_MAX_OUT];
    forward_filled(p, out, pool, PAT_ZERO, &rng);
    unsigned float_outs = 0;
    for (int o = 0; o < p->n_out; o++) {
        gout[o] = p->out_desc[o];
        gout[o].data = NULL;
        if (is_int(p->out_desc[o].dtype))
            continue; /* integer outputs carry no gradient */
        float_outs |= 1u << o;
        gout[o] = alloc_like(&p->out_desc[o]);
        tu_fill_uniform(&gout[o], &rng, -1.0, 1.0);
    }
    unsigned wanted = 0;
    for (int i = 0; i < p->n_in; i++)
        if (wants_grad(p, i))
            wanted |= 1u << i;
    kt_tensor keep_in[KT_OP_MAX_IN], keep_out[KT_OP_MAX_OUT], keep_gout[KT_OP_MAX_OUT];
    for (int i = 0; i < p->n_in; i++)
        keep_in[i] = tu_clone(&p->in[i]);
    for (int o = 0; o < p->n_out; o++) {
        keep_out[o] = tu_clone(&out[o]);
        if (float_outs & (1u << o))
            keep_gout[o] = tu_clone(&gout[o]);
    }

    /* the clean run: everything present, gradients and scratch zeroed */
    kt_tensor ref[KT_OP_MAX_IN];
    make_gin(p, wanted, PAT_ZERO, &rng, ref);
    if (backward(p, p->in, out, gout, ref, pool, PAT_ZERO) != KT_OK)
        fail_msg("%s: backward: %s", c->name, kt_last_error());
    for (int i = 0; i < p->n_in; i++)
        expect_same(c, "input after backward", &p->in[i], &keep_in[i]);
    for (int o = 0; o < p->n_out; o++) {
        expect_same(c, "output after backward", &out[o], &keep_out[o]);
        if (float_outs & (1u << o))
            expect_same(c, "output gradient after backward", &gout[o], &keep_gout[o]);
    }

    for (int pat = PAT_NAN; pat <= PAT_GARBAGE; pat++) {
        /* what the row does not declare is dead: replaced by poison of the same shape */
        kt_tensor in[KT_OP_MAX_IN], outp[KT_OP_MAX_OUT];
        unsigned in_poisoned = 0, out_poisoned = 0;
        for (int i = 0; i < p->n_in; i++) {
            in[i] = p->in[i];
            if (!(p->d->bwd_reads_in & (1u << i))) {
                in[i] = alloc_like(&p->in[i]);
                fill_pattern(&in[i], pat, &rng);
                in_poisoned |= 1u << i;
            }
        }
        for (int o = 0; o < p->n_out; o++) {
            outp[o] = out[o];
            if (!(p->d->bwd_reads_out & (1u << o))) {
                outp[o] = alloc_like(&out[o]);
                fill_pattern(&outp[o], pat, &rng);
                out_poisoned |= 1u << o;
            }
        }
        /* all wanted gradients at once, then each alone */
        int n_masks = 0;
        unsigned masks[KT_OP_MAX_IN + 1];
        masks[n_masks++] = wanted;
        if ((wanted & (wanted - 1u)) != 0) /* more than one */
            for (int i = 0; i < p->n_in; i++)
                if (wanted & (1u << i))
                    masks[n_masks++] = 1u << i;
        for (int m = 0; m < n_masks; m++) {
            kt_tensor gin[KT_OP_MAX_IN];
            make_gin(p, masks[m], pat, &rng, gin);
            if (backward(p, in, outp, gout, gin, pool, pat) != KT_OK)
                fail_msg("%s: backward with undeclared tensors poisoned (%s): %s", c->name,
                         pat_names[pat], kt_last_error());
            for (int i = 0; i < p->n_in; i++) {
                if (!(masks[m] & (1u << i)))
                    continue;
                char what[160];
                snprintf(what, sizeof what,
                         "gradient of input %d (requested 0x%x; poisoned with %s: gradients, "
                         "scratch, inputs 0x%x, outputs 0x%x)",
                         i, masks[m], pat_names[pat], in_poisoned, out_poisoned);
                expect_same(c, what, &gin[i], &ref[i]);
            }
            free_gin(p, masks[m], gin);
        }
        for (int i = 0; i < p->n_in; i++)
            if (in_poisoned & (1u << i))
                tu_free(&in[i]);
        for (int o = 0; o < p->n_out; o++)
            if (out_poisoned & (1u << o))
                tu_free(&outp[o]);
    }

    free_gin(p, wanted, ref);
    for (int o = 0; o < p->n_out; o++) {
        if (float_outs & (1u << o)) {
            tu_free(&gout[o]);
            tu_free(&keep_gout[o]);
        }
        tu_free(&keep_out[o]);
    }
    free_all(out, p->n_out);
    free_all(keep_in, p->n_in);
}

static void test_backward_reads_declared_only(void **state)
{
    (void)state;
    for (int pi = 0; pi < 2; pi++) {
        for (int k = 0; k < n_cases; k++) {
            prep p;
            prep_init(&p, &cases[k], k);
            check_backward(&p, pools[pi], k);
            prep_free(&p);
        }
    }
}

/* ---- 4: no_grad_in is the integer inputs and selection-only floats ----------------------- */

static unsigned no_grad_exercised[KT_OP_COUNT];

/* A float input that takes no gradient must not reach the outputs differentiably: nudged by
 * 1e-4 (far below the case's spread, far above its rounding), every output keeps its bytes;
 * and a gradient request for it is refused. */
static void check_selection_only(const prep *p, int i, int index)
{
    tu_rng rng;
    tu_rng_seed(&rng, 3000 + (uint64_t)index);
    kt_tensor ref[KT_OP_MAX_OUT], out[KT_OP_MAX_OUT];
    forward_filled(p, ref, NULL, PAT_ZERO, &rng);
    kt_tensor in[KT_OP_MAX_IN];
    memcpy(in, p->in, sizeof in);
    in[i] = tu_clone(&p->in[i]);
    for (int64_t e = 0; e < kt_tensor_numel(&in[i]); e++)
        tu_set(&in[i], e, tu_get(&p->in[i], e) + 1e-4);
    for (int o = 0; o < p->n_out; o++)
        out[o] = alloc_like(&p->out_desc[o]);
    forward(p, in, out, NULL, PAT_ZERO, "input nudged");
    for (int o = 0; o < p->n_out; o++) {
        char what[96];
        snprintf(what, sizeof what, "output %d with no_grad float input %d nudged", o, i);
        expect_same(p->c, what, &out[o], &ref[o]);
    }
    kt_tensor gout[KT_OP_MAX_OUT], gin[KT_OP_MAX_IN];
    for (int o = 0; o < p->n_out; o++) {
        gout[o] = p->out_desc[o];
        gout[o].data = NULL;
        if (!is_int(p->out_desc[o].dtype)) {
            gout[o] = alloc_like(&p->out_desc[o]);
            tu_fill_uniform(&gout[o], &rng, -1.0, 1.0);
        }
    }
    make_gin(p, 1u << i, PAT_ZERO, &rng, gin);
    if (backward(p, p->in, ref, gout, gin, NULL, PAT_ZERO) != KT_EINVAL)
        fail_msg("%s: a gradient of no_grad float input %d was accepted", p->c->name, i);
    free_gin(p, 1u << i, gin);
    for (int o = 0; o < p->n_out; o++)
        if (!is_int(p->out_desc[o].dtype))
            tu_free(&gout[o]);
    free_all(out, p->n_out);
    free_all(ref, p->n_out);
    tu_free(&in[i]);
}

static void test_no_grad_in(void **state)
{
    (void)state;
    for (int k = 0; k < n_cases; k++) {
        prep p;
        prep_init(&p, &cases[k], k);
        const op_case *c = p.c;
        for (int i = 0; i < p.n_in; i++) {
            const int flagged = (p.d->no_grad_in >> i) & 1u;
            const int integer = is_int(p.in[i].dtype);
            if (flagged && !integer)
                check_selection_only(&p, i, k);
            if (flagged)
                no_grad_exercised[c->op] |= 1u << i;
            if (!integer)
                continue;
            /* integer input: a gradient request must be refused, whether the row says so
             * (ids, targets) or the layout kernel does (integer tensors moved as data) */
            kt_tensor out[KT_OP_MAX_OUT], gout[KT_OP_MAX_OUT], gin[KT_OP_MAX_IN];
            tu_rng rng;
            tu_rng_seed(&rng, 7 + (uint64_t)k);
            forward_filled(&p, out, NULL, PAT_ZERO, &rng);
            for (int o = 0; o < p.n_out; o++) {
                gout[o] = p.out_desc[o];
                gout[o].data = NULL;
                if (!is_int(p.out_desc[o].dtype)) {
                    gout[o] = alloc_like(&p.out_desc[o]);
                    tu_fill_uniform(&gout[o], &rng, -1.0, 1.0);
                }
            }
            make_gin(&p, 1u << i, PAT_ZERO, &rng, gin);
            kt_status st = backward(&p, p.in, out, gout, gin, NULL, PAT_ZERO);
            if (st != KT_EINVAL)
                fail_msg("%s: a gradient of integer input %d was accepted (status %d)",
                         c->name, i, (int)st);
            if (!flagged) {
                /* only the layout ops may take integer inputs without the flag: their
                 * outputs are then integer too and nothing asks for a gradient */
                for (int o = 0; o < p.n_out; o++)
                    if (!is_int(p.out_desc[o].dtype))
                        fail_msg("%s: integer input %d is not in no_grad_in but output %d is "
                                 "a float that carries gradients",
                                 c->name, i, o);
                /* with no gradient requested the backward is a no-op that succeeds */
                kt_tensor none[KT_OP_MAX_IN];
                make_gin(&p, 0u, PAT_ZERO, &rng, none);
                if (backward(&p, p.in, out, gout, none, NULL, PAT_ZERO) != KT_OK)
                    fail_msg("%s: backward with nothing requested: %s", c->name,
                             kt_last_error());
            }
            free_gin(&p, 1u << i, gin);
            for (int o = 0; o < p.n_out; o++)
                if (!is_int(p.out_desc[o].dtype))
                    tu_free(&gout[o]);
            free_all(out, p.n_out);
        }
        prep_free(&p);
    }
    for (int op = 0; op < KT_OP_COUNT; op++) {
        if (op == KT_OP_MOE) /* see test_every_op_has_a_case */
            continue;
        const unsigned bits = kt__op_get((kt_op)op)->no_grad_in;
        if ((bits & ~no_grad_exercised[op]) != 0)
            fail_msg("%s: no_grad_in 0x%x has input(s) 0x%x that no case covers",
                     kt_op_name((kt_op)op), bits, bits & ~no_grad_exercised[op]);
    }
}

static int setup(void **state)
{
    (void)state;
    build_cases();
    pools[0] = NULL;
    return kt_threadpool_create(3, &pools[1]) == KT_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    kt_threadpool_destroy(pools[1]);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_op_has_a_case),
        cmocka_unit_test(test_forward_writes_all),
        cmocka_unit_test(test_inplace),
        cmocka_unit_test(test_aliasing_refused),
        cmocka_unit_test(test_grad_aliasing_refused),
        cmocka_unit_test(test_backward_reads_declared_only),
        cmocka_unit_test(test_no_grad_in),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
