/* The graph + session suite.
 *
 * 1. Models built through the graph API against the same computation written directly with
 *    the kernels (kt_op_forward / kt_op_backward): outputs and every parameter gradient
 *    within 1e-6 relative. An MLP; a temporal-conv stack (a value used twice); an
 *    embedding language model with ignored targets; tied weights and a value with three
 *    consumers.
 * 2. Training each of three models to a stated loss in a fixed number of steps.
 * 3. The session's optimizer against a float64 reference of PyTorch's update applied to the
 *    session's own gradients: SGD (momentum, nesterov, weight decay), AdamW, gradient
 *    clipping, the cosine schedule with warm-up.
 * 4. Gradient accumulation over micro-batches and the state machine (KT_ESTATE).
 * 5. Saving and loading weights and optimizer state; bad files change nothing.
 * 6. Frozen parameters (f32 and bf16): no gradient, never updated.
 * 7. Tracing, and the trace JSON.
 * 8. Determinism with two threads. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/support/test_util.h"

#define TOL 1e-6
#define IGNORE (-100)

/* ---- building graphs ------------------------------------------------------------------- */

static kt_program *compile(kt_graph *g)
{
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    return p;
}

/* ---- the direct side: kernels on heap tensors ------------------------------------------ */

/* Every tensor the direct side allocates, freed at once. */
#define POOL_MAX 128
typedef struct tpool {
    kt_tensor t[POOL_MAX];
    int n;
} tpool;

static kt_tensor keep(tpool *tp, kt_tensor t)
{
    assert_true(tp->n < POOL_MAX);
    tp->t[tp->n++] = t;
    return t;
}

static void pool_free(tpool *tp)
{
    for (int i = 0; i < tp->n; i++)
        tu_free(&tp->t[i]);
    tp->n = 0;
}

static kt_tensor direct_fwd(tpool *tp, kt_op op, const kt_op_attrs *attrs, const kt_tensor *in,
                            int n_in)
{
    const kt_op_attrs a = attrs != NULL ? *attrs : kt_op_defaults(op);
    kt_tensor out;
    OK(kt_op_infer(op, &a, in, n_in, &out, 1));
    out = keep(tp, tu_alloc(out.dtype, out.ndim, out.shape));
    size_t scratch = kt_op_scratch_bytes(op, &a, in, n_in, 0);
    kt_exec ex = {.scratch = scratch ? malloc(scratch) : NULL, .scratch_bytes = scratch};
    OK(kt_op_forward(op, &a, in, n_in, &out, 1, &ex));
    free(ex.scratch);
    return out;
}

static kt_tensor F1(tpool *tp, kt_op op, const kt_op_attrs *attrs, kt_tensor a)
{
    return direct_fwd(tp, op, attrs, &a, 1);
}

static kt_tensor F2(tpool *tp, kt_op op, const kt_op_attrs *attrs, kt_tensor a, kt_tensor b)
{
    kt_tensor in[2] = {a, b};
    return direct_fwd(tp, op, attrs, in, 2);
}

/* gin[i] is allocated where wanted[i] != 0, else left with data NULL. */
static void direct_bwd(tpool *tp, kt_op op, const kt_op_attrs *attrs, const kt_tensor *in,
                       int n_in, kt_tensor out, kt_tensor gout, const int *wanted,
                       kt_tensor *gin)
{
    const kt_op_attrs a = attrs != NULL ? *attrs : kt_op_defaults(op);
    for (int i = 0; i < n_in; i++) {
        gin[i] = in[i];
        gin[i].data = NULL;
        if (wanted[i])
            gin[i] = keep(tp, tu_alloc(in[i].dtype, in[i].ndim, in[i].shape));
    }
    size_t scratch = kt_op_scratch_bytes(op, &a, in, n_in, 1);
    kt_exec ex = {.scratch = scratch ? malloc(scratch) : NULL, .scratch_bytes = scratch};
    OK(kt_op_backward(op, &a, in, n_in, &out, 1, &gout, gin, &ex));
    free(ex.scratch);
}

static kt_tensor B1(tpool *tp, kt_op op, const kt_op_attrs *attrs, kt_tensor a, kt_tensor out,
                    kt_tensor gout)
{
    kt_tensor g;
    direct_bwd(tp, op, attrs, &a, 1, out, gout, (const int[]){1}, &g);
    return g;
}

static void B2(tpool *tp, kt_op op, const kt_op_attrs *attrs, kt_tensor a, kt_tensor b,
               kt_tensor out, kt_tensor gout, int want_a, int want_b, kt_tensor *ga,
               kt_tensor *gb)
{
    kt_tensor in[2] = {a, b}, g[2];
    direct_bwd(tp, op, attrs, in, 2, out, gout, (const int[]){want_a, want_b}, g);
    if (ga)
        *ga = g[0];
    if (gb)
        *gb = g[1];
}

/* a + b in plain C: how the test sums the partial gradients of a value used twice. */
static kt_tensor sum2(tpool *tp, kt_tensor a, kt_tensor b)
{
    assert_true(a.dtype == KT_F32 && kt_tensor_same_shape(&a, &b));
    kt_tensor s = keep(tp, tu_clone(&a));
    for (int64_t i = 0; i < kt_tensor_numel(&a); i++)
        ((float *)s.data)[i] += ((const float *)b.data)[i];
    return s;
}

static kt_tensor loss_seed(tpool *tp)
{
    kt_tensor one = keep(tp, tu_alloc(KT_F32, 0, NULL));
    tu_set(&one, 0, 1.0);
    return one;
}

static double max_abs(const kt_tensor *t)
{
    double m = 0;
    for (int64_t i = 0; i < kt_tensor_numel(t); i++)
        m = fmax(m, fabs(tu_get(t, i)));
    return m;
}

static void expect_close(const char *what, const kt_tensor *got, const kt_tensor *want)
{
    double e = tu_rel_err(got, want, 1e-12);
    if (!(e <= TOL))
        fail_msg("%s: graph and direct kernels differ by %.3g (relative)", what, e);
}

/* ---- sessions -------------------------------------------------------------------------- */

static kt_tensor get(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(s, role, name, &t));
    return t;
}

static void set_from(kt_session *s, kt_tensor_role role, const char *name, const kt_tensor *v)
{
    kt_tensor t = get(s, role, name);
    assert_int_equal(t.dtype, v->dtype);
    assert_true(kt_tensor_same_shape(&t, v));
    memcpy(t.data, v->data, kt_tensor_nbytes(v));
}

static kt_session *new_session(const kt_program *p, const kt_session_options *o)
{
    kt_session *s;
    OK(kt_session_create(p, o, &s));
    return s;
}

static int n_params(const kt_program *p) { return kt_program_count(p, KT_ROLE_PARAM); }

static const char *param_name(const kt_program *p, int i)
{
    const char *name;
    kt_tensor meta;
    OK(kt_program_tensor_info(p, KT_ROLE_PARAM, i, &name, &meta));
    return name;
}

/* Copies of every parameter (role PARAM) or every trainable parameter's gradient (GRAD;
 * frozen ones stay empty). */
#define SNAP_MAX 16
typedef struct snap {
    int n;
    kt_tensor t[SNAP_MAX];
} snap;

static snap take(kt_session *s, const kt_program *p, kt_tensor_role role)
{
    snap sn;
    memset(&sn, 0, sizeof sn);
    sn.n = n_params(p);
    assert_true(sn.n <= SNAP_MAX);
    for (int i = 0; i < sn.n; i++) {
        kt_tensor v;
        if (kt_session_tensor(s, role, param_name(p, i), &v) == KT_OK)
            sn.t[i] = tu_clone(&v);
        else
            assert_int_equal(role, KT_ROLE_GRAD);
    }
    kt_clear_error();
    return sn;
}

static void snap_free(snap *sn)
{
    for (int i = 0; i < sn->n; i++)
        tu_free(&sn->t[i]);
}

static void expect_bitwise(const char *what, const kt_tensor *a, const kt_tensor *b)
{
    if (!tu_bitwise_equal(a, b))
        fail_msg("%s: not bitwise identical (max rel diff %.3g)", what, tu_rel_err(a, b, 1e-30));
}

/* The session's current parameters equal the snapshot, bit for bit. */
static void expect_params_bitwise(const char *what, kt_session *s, const kt_program *p,
                                  const snap *sn)
{
    for (int i = 0; i < sn->n; i++) {
        kt_tensor v = get(s, KT_ROLE_PARAM, param_name(p, i));
        char label[160];
        snprintf(label, sizeof label, "%s: parameter '%s'", what, param_name(p, i));
        expect_bitwise(label, &v, &sn->t[i]);
    }
}

static int bitwise_same_float(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* ---- model (a): MLP -------------------------------------------------------------------- */

/* loss = CE(silu(x W1 + b1) W2, y) */
enum { MN = 24, MD = 16, MH = 32, MC = 5 };

static kt_graph *build_mlp(int n)
{
    kt_graph *g;
    kt_value x, y, w1, b1, w2, h, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(n, MD), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(n), &y));
    OK(kt_graph_param(g, "w1", KT_F32, 2, TU_SHAPE(MD, MH), kt_init_normal(0.3f), &w1));
    OK(kt_graph_param(g, "b1", KT_F32, 1, TU_SHAPE(MH), kt_init_normal(0.1f), &b1));
    OK(kt_graph_param(g, "w2", KT_F32, 2, TU_SHAPE(MH, MC), kt_init_normal(0.3f), &w2));
    h = tu_op2(g, "fc1", KT_OP_MATMUL, NULL, x, w1);
    h = tu_op2(g, "bias1", KT_OP_ADD, NULL, h, b1);
    h = tu_op1(g, "act", KT_OP_SILU, NULL, h);
    logits = tu_op2(g, "fc2", KT_OP_MATMUL, NULL, h, w2);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

/* x uniform in [-1,1); y from a fixed linear teacher (learnable), with tokens 3 and 15
 * ignored (one in each half of a 24-token batch). */
static void mlp_data(int n, uint64_t seed, kt_tensor *x, kt_tensor *y)
{
    tu_rng rng;
    tu_rng_seed(&rng, 1000);
    double teacher[MD][MC];
    for (int d = 0; d < MD; d++)
        for (int c = 0; c < MC; c++)
            teacher[d][c] = tu_rng_normal(&rng);
    tu_rng_seed(&rng, seed);
    *x = tu_new(KT_F32, n, MD);
    *y = tu_new(KT_I32, n);
    tu_fill_uniform(x, &rng, -1, 1);
    for (int i = 0; i < n; i++) {
        int best = 0;
        double best_v = -INFINITY;
        for (int c = 0; c < MC; c++) {
            double v = 0;
            for (int d = 0; d < MD; d++)
                v += tu_get(x, (int64_t)i * MD + d) * teacher[d][c];
            if (v > best_v)
                best_v = v, best = c;
        }
        tu_set(y, i, (i % 12 == 3) ? IGNORE : best);
    }
}

static void mlp_set_inputs(kt_session *s, int n, uint64_t seed)
{
    kt_tensor x, y;
    mlp_data(n, seed, &x, &y);
    set_from(s, KT_ROLE_INPUT, "x", &x);
    set_from(s, KT_ROLE_INPUT, "y", &y);
    tu_free(&x);
    tu_free(&y);
}

static void test_mlp_matches_kernels(void **state)
{
    (void)state;
    kt_graph *g = build_mlp(MN);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 7};
    kt_session *s = new_session(p, &so);
    tpool tp = {.n = 0};

    kt_tensor x, y;
    mlp_data(MN, 3, &x, &y);
    keep(&tp, x);
    keep(&tp, y);
    set_from(s, KT_ROLE_INPUT, "x", &x);
    set_from(s, KT_ROLE_INPUT, "y", &y);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));

    kt_tensor w1 = get(s, KT_ROLE_PARAM, "w1"), b1 = get(s, KT_ROLE_PARAM, "b1");
    kt_tensor w2 = get(s, KT_ROLE_PARAM, "w2");
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    kt_tensor h0 = F2(&tp, KT_OP_MATMUL, NULL, x, w1);
    kt_tensor h1 = F2(&tp, KT_OP_ADD, NULL, h0, b1);
    kt_tensor h2 = F1(&tp, KT_OP_SILU, NULL, h1);
    kt_tensor lg = F2(&tp, KT_OP_MATMUL, NULL, h2, w2);
    kt_tensor loss = F2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y);

    kt_tensor got_logits = get(s, KT_ROLE_OUTPUT, "logits");
    expect_close("mlp logits", &got_logits, &lg);
    assert_float_equal(kt_session_loss(s), tu_get(&loss, 0), TOL * fabs(tu_get(&loss, 0)));

    kt_tensor g_lg, g_h2, g_w2, g_h1, g_h0, g_b1, g_w1;
    B2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y, loss, loss_seed(&tp), 1, 0, &g_lg, NULL);
    B2(&tp, KT_OP_MATMUL, NULL, h2, w2, lg, g_lg, 1, 1, &g_h2, &g_w2);
    g_h1 = B1(&tp, KT_OP_SILU, NULL, h1, h2, g_h2);
    B2(&tp, KT_OP_ADD, NULL, h0, b1, h1, g_h1, 1, 1, &g_h0, &g_b1);
    B2(&tp, KT_OP_MATMUL, NULL, x, w1, h0, g_h0, 0, 1, NULL, &g_w1);
    kt_tensor gw1 = get(s, KT_ROLE_GRAD, "w1"), gb1 = get(s, KT_ROLE_GRAD, "b1");
    kt_tensor gw2 = get(s, KT_ROLE_GRAD, "w2");
    expect_close("mlp grad w2", &gw2, &g_w2);
    expect_close("mlp grad b1", &gb1, &g_b1);
    expect_close("mlp grad w1", &gw1, &g_w1);
    /* the reference is not degenerate (all zeros would compare equal to all zeros) */
    assert_true(max_abs(&g_w1) > 1e-4 && max_abs(&g_b1) > 1e-4 && max_abs(&g_w2) > 1e-4);

    pool_free(&tp);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- model (b): causal temporal-conv stack --------------------------------------------- */

/* x [T,CI] -> stem matmul -> h [T,C] (the block input, which carries a gradient) ->
 * conv1d causal full K=3 -> silu -> conv1d depthwise same K=5 -> + h (h used twice: its two
 * partial gradients must be summed) -> rmsnorm -> matmul to classes -> cross_entropy. */
enum { CT = 32, CI = 6, CC = 8, CK = 4 };

#define conv_causal TU_ATTRS(KT_OP_CONV1D, .conv_mode = KT_CONV_CAUSAL)
#define conv_dw_same TU_ATTRS(KT_OP_CONV1D, .conv_mode = KT_CONV_SAME, .depthwise = 1)
#define norm_attrs TU_ATTRS(KT_OP_RMSNORM, .eps = 1e-5f)

static kt_graph *build_conv(int t)
{
    kt_graph *g;
    kt_value x, y, w_in, w_c1, w_dw, gain, w_out, h, c1, a, c2, r, n, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(t, CI), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(t), &y));
    OK(kt_graph_param(g, "w_in", KT_F32, 2, TU_SHAPE(CI, CC), kt_init_normal(0.4f), &w_in));
    OK(kt_graph_param(g, "w_c1", KT_F32, 3, TU_SHAPE(CC, 3, CC), kt_init_normal(0.2f), &w_c1));
    OK(kt_graph_param(g, "w_dw", KT_F32, 2, TU_SHAPE(CC, 5), kt_init_normal(0.3f), &w_dw));
    OK(kt_graph_param(g, "gain", KT_F32, 1, TU_SHAPE(CC), kt_init_uniform(0.8f, 1.2f), &gain));
    OK(kt_graph_param(g, "w_out", KT_F32, 2, TU_SHAPE(CC, CK), kt_init_normal(0.3f), &w_out));
    h = tu_op2(g, "stem", KT_OP_MATMUL, NULL, x, w_in);
    c1 = tu_op2(g, "conv_causal", KT_OP_CONV1D, &conv_causal, h, w_c1);
    a = tu_op1(g, "act", KT_OP_SILU, NULL, c1);
    c2 = tu_op2(g, "conv_dw", KT_OP_CONV1D, &conv_dw_same, a, w_dw);
    r = tu_op2(g, "residual", KT_OP_ADD, NULL, c2, h);
    n = tu_op2(g, "norm", KT_OP_RMSNORM, &norm_attrs, r, gain);
    logits = tu_op2(g, "head", KT_OP_MATMUL, NULL, n, w_out);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

/* y[t] = argmax over classes of (x[t] + x[t-1]) R: a causal, learnable target. */
static void conv_set_inputs(kt_session *s, int t, uint64_t seed, kt_tensor *x_out,
                            kt_tensor *y_out)
{
    tu_rng rng;
    tu_rng_seed(&rng, 2000);
    double teacher[CI][CK];
    for (int d = 0; d < CI; d++)
        for (int c = 0; c < CK; c++)
            teacher[d][c] = tu_rng_normal(&rng);
    tu_rng_seed(&rng, seed);
    kt_tensor x = tu_new(KT_F32, t, CI), y = tu_new(KT_I32, t);
    tu_fill_uniform(&x, &rng, -1, 1);
    for (int i = 0; i < t; i++) {
        int best = 0;
        double best_v = -INFINITY;
        for (int c = 0; c < CK; c++) {
            double v = 0;
            for (int d = 0; d < CI; d++)
                v += (tu_get(&x, (int64_t)i * CI + d) +
                      (i > 0 ? tu_get(&x, (int64_t)(i - 1) * CI + d) : 0.0)) *
                     teacher[d][c];
            if (v > best_v)
                best_v = v, best = c;
        }
        tu_set(&y, i, best);
    }
    set_from(s, KT_ROLE_INPUT, "x", &x);
    set_from(s, KT_ROLE_INPUT, "y", &y);
    if (x_out)
        *x_out = x, *y_out = y;
    else
        tu_free(&x), tu_free(&y);
}

static void test_conv_matches_kernels(void **state)
{
    (void)state;
    kt_graph *g = build_conv(CT);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 11};
    kt_session *s = new_session(p, &so);
    tpool tp = {.n = 0};
    kt_tensor x, y;
    conv_set_inputs(s, CT, 5, &x, &y);
    keep(&tp, x);
    keep(&tp, y);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));

    kt_tensor w_in = get(s, KT_ROLE_PARAM, "w_in"), w_c1 = get(s, KT_ROLE_PARAM, "w_c1");
    kt_tensor w_dw = get(s, KT_ROLE_PARAM, "w_dw"), gain = get(s, KT_ROLE_PARAM, "gain");
    kt_tensor w_out = get(s, KT_ROLE_PARAM, "w_out");
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    kt_tensor h = F2(&tp, KT_OP_MATMUL, NULL, x, w_in);
    kt_tensor c1 = F2(&tp, KT_OP_CONV1D, &conv_causal, h, w_c1);
    kt_tensor a = F1(&tp, KT_OP_SILU, NULL, c1);
    kt_tensor c2 = F2(&tp, KT_OP_CONV1D, &conv_dw_same, a, w_dw);
    kt_tensor r = F2(&tp, KT_OP_ADD, NULL, c2, h);
    kt_tensor n = F2(&tp, KT_OP_RMSNORM, &norm_attrs, r, gain);
    kt_tensor lg = F2(&tp, KT_OP_MATMUL, NULL, n, w_out);
    kt_tensor loss = F2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y);
    kt_tensor got = get(s, KT_ROLE_OUTPUT, "logits");
    expect_close("conv logits", &got, &lg);
    assert_float_equal(kt_session_loss(s), tu_get(&loss, 0), TOL * fabs(tu_get(&loss, 0)));

    kt_tensor g_lg, g_n, g_wout, g_r, g_gain, g_c2, g_h_res, g_a, g_wdw, g_c1, g_h_conv, g_wc1,
        g_win;
    B2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y, loss, loss_seed(&tp), 1, 0, &g_lg, NULL);
    B2(&tp, KT_OP_MATMUL, NULL, n, w_out, lg, g_lg, 1, 1, &g_n, &g_wout);
    B2(&tp, KT_OP_RMSNORM, &norm_attrs, r, gain, n, g_n, 1, 1, &g_r, &g_gain);
    B2(&tp, KT_OP_ADD, NULL, c2, h, r, g_r, 1, 1, &g_c2, &g_h_res);
    B2(&tp, KT_OP_CONV1D, &conv_dw_same, a, w_dw, c2, g_c2, 1, 1, &g_a, &g_wdw);
    g_c1 = B1(&tp, KT_OP_SILU, NULL, c1, a, g_a);
    B2(&tp, KT_OP_CONV1D, &conv_causal, h, w_c1, c1, g_c1, 1, 1, &g_h_conv, &g_wc1);
    kt_tensor g_h = sum2(&tp, g_h_conv, g_h_res); /* h has two consumers */
    B2(&tp, KT_OP_MATMUL, NULL, x, w_in, h, g_h, 0, 1, NULL, &g_win);

    kt_tensor gv;
    gv = get(s, KT_ROLE_GRAD, "w_out"), expect_close("conv grad w_out", &gv, &g_wout);
    gv = get(s, KT_ROLE_GRAD, "gain"), expect_close("conv grad gain", &gv, &g_gain);
    gv = get(s, KT_ROLE_GRAD, "w_dw"), expect_close("conv grad w_dw", &gv, &g_wdw);
    gv = get(s, KT_ROLE_GRAD, "w_c1"), expect_close("conv grad w_c1", &gv, &g_wc1);
    gv = get(s, KT_ROLE_GRAD, "w_in"), expect_close("conv grad w_in", &gv, &g_win);
    /* the residual branch matters: with only one of h's partial gradients, w_in's gradient
     * would be different (so the comparison above would catch a missing sum) */
    kt_tensor g_win_conv_only;
    B2(&tp, KT_OP_MATMUL, NULL, x, w_in, h, g_h_conv, 0, 1, NULL, &g_win_conv_only);
    assert_true(tu_rel_err(&g_win_conv_only, &g_win, 1e-12) > 1e-3);

    pool_free(&tp);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- model (c): embedding language model ----------------------------------------------- */

/* ids -> embedding E [V,H] -> matmul W [H,V] -> logits; outputs log_softmax(logits) and
 * loss = CE(logits, next id) with the unpredictable targets ignored. */
enum { LN = 40, LV = 20, LH = 12 };
#define LM_IGNORE (-1)

static kt_graph *build_lm(int n)
{
    kt_graph *g;
    kt_value ids, tgt, emb, w, e, logits, lsm, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "ids", KT_I32, 1, TU_SHAPE(n), &ids));
    OK(kt_graph_input(g, "targets", KT_I64, 1, TU_SHAPE(n), &tgt));
    OK(kt_graph_param(g, "embed", KT_F32, 2, TU_SHAPE(LV, LH), kt_init_normal(0.5f), &emb));
    OK(kt_graph_param(g, "unembed", KT_F32, 2, TU_SHAPE(LH, LV), kt_init_normal(0.3f), &w));
    e = tu_op2(g, "embed", KT_OP_EMBEDDING, NULL, emb, ids);
    logits = tu_op2(g, "unembed", KT_OP_MATMUL, NULL, e, w);
    lsm = tu_op1(g, "logprobs", KT_OP_LOG_SOFTMAX, NULL, logits);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = LM_IGNORE);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, tgt);
    OK(kt_graph_output(g, lsm, "logprobs"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

/* A sequence following next = (5 id + 3) mod V, restarted at a random id every 10 tokens;
 * the target of the token before a restart (and of the last token) is unpredictable and
 * ignored. */
static void lm_data(int n, uint64_t seed, kt_tensor *ids, kt_tensor *tgt)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    *ids = tu_new(KT_I32, n);
    *tgt = tu_new(KT_I64, n);
    for (int i = 0; i < n; i++) {
        int v = (i % 10 == 0) ? (int)(tu_rng_next(&rng) % LV)
                              : (5 * (int)tu_get(ids, i - 1) + 3) % LV;
        tu_set(ids, i, v);
    }
    for (int i = 0; i < n; i++)
        tu_set(tgt, i, (i + 1 == n || (i + 1) % 10 == 0) ? LM_IGNORE : tu_get(ids, i + 1));
}

static void lm_set_inputs(kt_session *s, int n, uint64_t seed)
{
    kt_tensor ids, tgt;
    lm_data(n, seed, &ids, &tgt);
    set_from(s, KT_ROLE_INPUT, "ids", &ids);
    set_from(s, KT_ROLE_INPUT, "targets", &tgt);
    tu_free(&ids);
    tu_free(&tgt);
}

static void test_lm_matches_kernels(void **state)
{
    (void)state;
    kt_graph *g = build_lm(LN);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 5};
    kt_session *s = new_session(p, &so);
    tpool tp = {.n = 0};
    kt_tensor ids, tgt;
    lm_data(LN, 9, &ids, &tgt);
    keep(&tp, ids);
    keep(&tp, tgt);
    set_from(s, KT_ROLE_INPUT, "ids", &ids);
    set_from(s, KT_ROLE_INPUT, "targets", &tgt);
    int ignored = 0;
    for (int i = 0; i < LN; i++)
        ignored += tu_get(&tgt, i) == LM_IGNORE;
    assert_int_equal(ignored, LN / 10);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));

    kt_tensor emb = get(s, KT_ROLE_PARAM, "embed"), w = get(s, KT_ROLE_PARAM, "unembed");
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = LM_IGNORE);
    kt_tensor e = F2(&tp, KT_OP_EMBEDDING, NULL, emb, ids);
    kt_tensor lg = F2(&tp, KT_OP_MATMUL, NULL, e, w);
    kt_tensor lsm = F1(&tp, KT_OP_LOG_SOFTMAX, NULL, lg);
    kt_tensor loss = F2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, tgt);
    kt_tensor got = get(s, KT_ROLE_OUTPUT, "logprobs");
    expect_close("lm logprobs", &got, &lsm);
    /* the loss is the mean of -logprobs[target] over counted tokens (a check of the op's
     * ignore_index semantics through the graph, in double) */
    double want = 0;
    for (int i = 0; i < LN; i++) {
        int64_t t = (int64_t)tu_get(&tgt, i);
        if (t != LM_IGNORE)
            want -= tu_get(&got, (int64_t)i * LV + t);
    }
    want /= LN - ignored;
    assert_float_equal(kt_session_loss(s), want, 1e-5 * want);
    assert_float_equal(kt_session_loss(s), tu_get(&loss, 0), TOL * fabs(tu_get(&loss, 0)));

    kt_tensor g_lg, g_e, g_w, g_emb;
    B2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, tgt, loss, loss_seed(&tp), 1, 0, &g_lg, NULL);
    B2(&tp, KT_OP_MATMUL, NULL, e, w, lg, g_lg, 1, 1, &g_e, &g_w);
    B2(&tp, KT_OP_EMBEDDING, NULL, emb, ids, e, g_e, 1, 0, &g_emb, NULL);
    kt_tensor gv;
    gv = get(s, KT_ROLE_GRAD, "unembed"), expect_close("lm grad unembed", &gv, &g_w);
    gv = get(s, KT_ROLE_GRAD, "embed"), expect_close("lm grad embed", &gv, &g_emb);
    /* rows of ids that never occur get exactly zero gradient (there are some) */
    int unseen = 0;
    for (int v = 0; v < LV; v++) {
        int seen = 0;
        for (int i = 0; i < LN; i++)
            seen |= (int)tu_get(&ids, i) == v;
        double sq = 0;
        for (int k = 0; k < LH; k++)
            sq += tu_get(&gv, (int64_t)v * LH + k) * tu_get(&gv, (int64_t)v * LH + k);
        if (!seen)
            assert_true(sq == 0.0);
        else
            assert_true(sq > 0.0);
        unseen += !seen;
    }
    assert_true(unseen > 0);

    pool_free(&tp);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- model (d): tied weights, a value with three consumers ----------------------------- */

/* e = embedding(E, ids); s = silu(e); m = e * s; r = m + e  (e has three consumers: silu,
 * mul, add); logits = rmsnorm(r, gain) E^T (E used by two nodes: tied); CE. */
enum { TN = 20, TV = 16, TD = 12 };

static kt_graph *build_tied(void)
{
    kt_graph *g;
    kt_value ids, y, E, gain, e, sv, m, r, n, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "ids", KT_I32, 1, TU_SHAPE(TN), &ids));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(TN), &y));
    OK(kt_graph_param(g, "E", KT_F32, 2, TU_SHAPE(TV, TD), kt_init_normal(0.6f), &E));
    OK(kt_graph_param(g, "gain", KT_F32, 1, TU_SHAPE(TD), kt_init_uniform(0.5f, 1.5f), &gain));
    e = tu_op2(g, "embed", KT_OP_EMBEDDING, NULL, E, ids);
    sv = tu_op1(g, "silu", KT_OP_SILU, NULL, e);
    m = tu_op2(g, "gate", KT_OP_MUL, NULL, e, sv);
    r = tu_op2(g, "skip", KT_OP_ADD, NULL, m, e);
    n = tu_op2(g, "norm", KT_OP_RMSNORM, &norm_attrs, r, gain);
    kt_op_attrs tb = TU_ATTRS(KT_OP_MATMUL, .trans_b = 1);
    logits = tu_op2(g, "tied_head", KT_OP_MATMUL, &tb, n, E);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static void test_tied_matches_kernels(void **state)
{
    (void)state;
    kt_graph *g = build_tied();
    kt_program *p = compile(g);
    assert_int_equal(n_params(p), 2);
    kt_session_options so = {.threads = 2, .seed = 21};
    kt_session *s = new_session(p, &so);
    tpool tp = {.n = 0};
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    kt_tensor ids = keep(&tp, tu_new(KT_I32, TN)), y = keep(&tp, tu_new(KT_I32, TN));
    tu_fill_uniform(&ids, &rng, 0, TV);
    tu_fill_uniform(&y, &rng, 0, TV);
    tu_set(&y, 7, IGNORE);
    set_from(s, KT_ROLE_INPUT, "ids", &ids);
    set_from(s, KT_ROLE_INPUT, "y", &y);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));

    kt_tensor E = get(s, KT_ROLE_PARAM, "E"), gain = get(s, KT_ROLE_PARAM, "gain");
    kt_op_attrs tb = TU_ATTRS(KT_OP_MATMUL, .trans_b = 1);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    kt_tensor e = F2(&tp, KT_OP_EMBEDDING, NULL, E, ids);
    kt_tensor sv = F1(&tp, KT_OP_SILU, NULL, e);
    kt_tensor m = F2(&tp, KT_OP_MUL, NULL, e, sv);
    kt_tensor r = F2(&tp, KT_OP_ADD, NULL, m, e);
    kt_tensor n = F2(&tp, KT_OP_RMSNORM, &norm_attrs, r, gain);
    kt_tensor lg = F2(&tp, KT_OP_MATMUL, &tb, n, E);
    kt_tensor loss = F2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y);
    kt_tensor got = get(s, KT_ROLE_OUTPUT, "logits");
    expect_close("tied logits", &got, &lg);
    assert_float_equal(kt_session_loss(s), tu_get(&loss, 0), TOL * fabs(tu_get(&loss, 0)));

    kt_tensor g_lg, g_n, g_E_head, g_r, g_gain, g_m, g_e_add, g_e_mul, g_s, g_e_silu, g_E_emb;
    B2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y, loss, loss_seed(&tp), 1, 0, &g_lg, NULL);
    B2(&tp, KT_OP_MATMUL, &tb, n, E, lg, g_lg, 1, 1, &g_n, &g_E_head);
    B2(&tp, KT_OP_RMSNORM, &norm_attrs, r, gain, n, g_n, 1, 1, &g_r, &g_gain);
    B2(&tp, KT_OP_ADD, NULL, m, e, r, g_r, 1, 1, &g_m, &g_e_add);
    B2(&tp, KT_OP_MUL, NULL, e, sv, m, g_m, 1, 1, &g_e_mul, &g_s);
    g_e_silu = B1(&tp, KT_OP_SILU, NULL, e, sv, g_s);
    kt_tensor g_e = sum2(&tp, sum2(&tp, g_e_add, g_e_mul), g_e_silu); /* three consumers */
    B2(&tp, KT_OP_EMBEDDING, NULL, E, ids, e, g_e, 1, 0, &g_E_emb, NULL);
    kt_tensor g_E = sum2(&tp, g_E_head, g_E_emb); /* tied: two uses */

    kt_tensor gv;
    gv = get(s, KT_ROLE_GRAD, "gain"), expect_close("tied grad gain", &gv, &g_gain);
    gv = get(s, KT_ROLE_GRAD, "E"), expect_close("tied grad E", &gv, &g_E);
    /* both uses contribute materially */
    assert_true(tu_rel_err(&g_E_head, &g_E, 1e-12) > 1e-3);
    assert_true(tu_rel_err(&g_E_emb, &g_E, 1e-12) > 1e-3);

    pool_free(&tp);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- 2. training ----------------------------------------------------------------------- */

typedef void (*set_inputs_fn)(kt_session *s, int n, uint64_t seed);

static void conv_inputs(kt_session *s, int n, uint64_t seed)
{
    conv_set_inputs(s, n, seed, NULL, NULL);
}

/* Trains on one fixed batch for `steps` steps; returns the loss of the first forward and of a
 * forward after the last step. */
static void train(kt_graph *g, int n, set_inputs_fn set, const kt_optimizer_config *oc,
                  int steps, float *initial, float *final)
{
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 1, .optimizer = *oc};
    kt_session *s = new_session(p, &so);
    set(s, n, 42);
    for (int k = 0; k < steps; k++) {
        OK(kt_session_forward(s));
        if (k == 0)
            *initial = kt_session_loss(s);
        assert_true(isfinite(kt_session_loss(s)));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
    OK(kt_session_forward(s));
    *final = kt_session_loss(s);
    assert_int_equal(kt_session_step_count(s), steps);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

static void test_training_reduces_loss(void **state)
{
    (void)state;
    float l0, l1;

    /* MLP, SGD with momentum 0.9, lr 0.2, 15 steps. Measured: 1.716 -> 0.091 (5.3% of the
     * initial loss); target: below 25% of the initial loss. */
    kt_optimizer_config sgd = {.kind = KT_OPTIM_SGD, .lr = 0.2f, .momentum = 0.9f};
    train(build_mlp(MN), MN, mlp_set_inputs, &sgd, 15, &l0, &l1);
    print_message("mlp (sgd momentum): %.4f -> %.4f\n", l0, l1);
    assert_true(l0 > 1.0f); /* about ln(5) at initialisation */
    assert_true(l1 < 0.25f * l0);

    /* conv stack, AdamW lr 0.02 wd 0.01, 25 steps. Measured: 1.798 -> 0.075 (4.2%); target:
     * below 30% of the initial loss. */
    kt_optimizer_config adamw = {.kind = KT_OPTIM_ADAMW, .lr = 0.02f, .weight_decay = 0.01f};
    train(build_conv(CT), CT, conv_inputs, &adamw, 25, &l0, &l1);
    print_message("conv (adamw): %.4f -> %.4f\n", l0, l1);
    assert_true(l0 > 1.0f);
    assert_true(l1 < 0.3f * l0);

    /* embedding LM, AdamW lr 0.05 wd 0.01, 15 steps. Measured: 3.019 -> 0.017 (0.6%);
     * target: below 10% of the initial loss (the bigram map is deterministic, so it is
     * learnable to 0). */
    kt_optimizer_config adamw_lm = {.kind = KT_OPTIM_ADAMW, .lr = 0.05f, .weight_decay = 0.01f};
    train(build_lm(LN), LN, lm_set_inputs, &adamw_lm, 15, &l0, &l1);
    print_message("lm (adamw): %.4f -> %.4f\n", l0, l1);
    assert_true(l0 > 2.0f);
    assert_true(l1 < 0.1f * l0);
}

/* ---- 3. the optimizer against a float64 reference -------------------------------------- */

/* max |got - want| / max |want| */
static double rel_err_fd(const kt_tensor *got, const double *want)
{
    int64_t n = kt_tensor_numel(got);
    double scale = 1e-30, err = 0;
    for (int64_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(want[i]));
        err = fmax(err, fabs(tu_get(got, i) - want[i]));
    }
    return isnan(err) ? INFINITY : err / scale;
}

/* The session's update (after - before) against the reference's (want - before): relative
 * to the largest reference update, so a wrong update cannot hide behind the parameter's
 * magnitude. */
static double update_err(const kt_tensor *after, const kt_tensor *before, const double *want)
{
    int64_t n = kt_tensor_numel(after);
    double scale = 1e-30, err = 0;
    for (int64_t i = 0; i < n; i++) {
        double u_ref = want[i] - tu_get(before, i);
        double u = tu_get(after, i) - tu_get(before, i);
        scale = fmax(scale, fabs(u_ref));
        err = fmax(err, fabs(u - u_ref));
    }
    return isnan(err) ? INFINITY : err / scale;
}

typedef struct ref_opt {
    double *a[SNAP_MAX], *b[SNAP_MAX]; /* SGD momentum / AdamW m, v */
    int64_t t;                         /* AdamW step */
} ref_opt;

static void ref_opt_free(ref_opt *r)
{
    for (int i = 0; i < SNAP_MAX; i++)
        free(r->a[i]), free(r->b[i]);
}

static double *ref_buf(double **slot, int64_t n)
{
    if (*slot == NULL) {
        *slot = calloc((size_t)n, sizeof **slot);
        assert_non_null(*slot);
    }
    return *slot;
}

/* torch.optim.SGD: d = g + wd p; buf = d (first) or mu buf + (1 - damp) d; nesterov:
 * d += mu buf, else d = buf; p -= lr d.  torch.optim.AdamW: p *= 1 - lr wd; m = b1 m +
 * (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps).
 * `scale` multiplies the gradient first (clipping). Writes the new parameters into want. */
static void ref_step(ref_opt *r, int idx, const kt_optimizer_config *oc, double lr,
                     const kt_tensor *p, const kt_tensor *g, double scale, int first,
                     double *want)
{
    int64_t n = kt_tensor_numel(p);
    if (oc->kind == KT_OPTIM_SGD) {
        double mu = oc->momentum, damp = oc->dampening, wd = oc->weight_decay;
        double *buf = mu != 0 ? ref_buf(&r->a[idx], n) : NULL;
        for (int64_t i = 0; i < n; i++) {
            double pi = tu_get(p, i), d = scale * tu_get(g, i) + wd * pi;
            if (buf) {
                buf[i] = first ? d : mu * buf[i] + (1 - damp) * d;
                d = oc->nesterov ? d + mu * buf[i] : buf[i];
            }
            want[i] = pi - lr * d;
        }
    } else {
        double b1 = oc->beta1, b2 = oc->beta2, eps = oc->eps, wd = oc->weight_decay;
        double *m = ref_buf(&r->a[idx], n), *v = ref_buf(&r->b[idx], n);
        double bc1 = 1 - pow(b1, (double)r->t), bc2 = 1 - pow(b2, (double)r->t);
        for (int64_t i = 0; i < n; i++) {
            double gi = scale * tu_get(g, i), pi = tu_get(p, i) * (1 - lr * wd);
            m[i] = b1 * m[i] + (1 - b1) * gi;
            v[i] = b2 * v[i] + (1 - b2) * gi * gi;
            want[i] = pi - lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + eps);
        }
    }
}

static double grads_norm(const snap *g)
{
    double sq = 0;
    for (int i = 0; i < g->n; i++)
        for (int64_t k = 0; g->t[i].data && k < kt_tensor_numel(&g->t[i]); k++)
            sq += tu_get(&g->t[i], k) * tu_get(&g->t[i], k);
    return sqrt(sq);
}

/* Runs `steps` steps of oc on a model, each on a new batch, comparing every parameter after
 * each step with the reference applied to the session's own parameters and gradients (read
 * before the step). expected_lr(k) gives the scheduled rate of step k. Returns the largest
 * update error seen. */
static double check_optimizer(kt_graph *g, int n, set_inputs_fn set,
                              const kt_optimizer_config *oc, int steps,
                              double (*expected_lr)(const kt_optimizer_config *, int64_t))
{
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 3, .optimizer = *oc};
    kt_session *s = new_session(p, &so);
    ref_opt r;
    memset(&r, 0, sizeof r);
    double worst_update = 0;
    for (int k = 0; k < steps; k++) {
        set(s, n, 100 + (uint64_t)k);
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        snap P = take(s, p, KT_ROLE_PARAM), G = take(s, p, KT_ROLE_GRAD);
        OK(kt_session_step(s));
        assert_int_equal(kt_session_step_count(s), k + 1);

        double norm = grads_norm(&G);
        if (fabs(kt_session_grad_norm(s) - norm) > TOL * norm)
            fail_msg("step %d: grad norm %.9g, reference %.9g", k,
                     (double)kt_session_grad_norm(s), norm);
        double scale = 1.0;
        if (oc->clip_norm > 0) /* every configuration here that clips means to clip */
            assert_true(norm > oc->clip_norm);
        if (oc->clip_norm > 0 && norm > oc->clip_norm)
            scale = oc->clip_norm / (norm + 1e-6); /* torch.nn.utils.clip_grad_norm_ */
        double lr = expected_lr ? expected_lr(oc, k) : oc->lr;
        if (fabs(kt_session_lr(s) - lr) > TOL * lr)
            fail_msg("step %d: lr %.9g, expected %.9g", k, (double)kt_session_lr(s), lr);
        r.t = k + 1;
        for (int i = 0; i < P.n; i++) {
            if (G.t[i].data == NULL)
                continue;
            int64_t numel = kt_tensor_numel(&P.t[i]);
            double *want = malloc((size_t)numel * sizeof *want);
            assert_non_null(want);
            ref_step(&r, i, oc, lr, &P.t[i], &G.t[i], scale, k == 0, want);
            kt_tensor now = get(s, KT_ROLE_PARAM, param_name(p, i));
            double e = rel_err_fd(&now, want), u = update_err(&now, &P.t[i], want);
            if (!(e <= TOL))
                fail_msg("step %d, parameter '%s': differs from the reference by %.3g", k,
                         param_name(p, i), e);
            worst_update = fmax(worst_update, u);
            free(want);
        }
        snap_free(&P);
        snap_free(&G);
    }
    ref_opt_free(&r);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    return worst_update;
}

static void test_sgd_matches_reference(void **state)
{
    (void)state;
    kt_optimizer_config oc = {.kind = KT_OPTIM_SGD, .lr = 0.1f, .momentum = 0.9f,
                              .nesterov = 1, .weight_decay = 0.01f};
    double u = check_optimizer(build_mlp(MN), MN, mlp_set_inputs, &oc, 4, NULL);
    print_message("sgd nesterov: worst update error %.3g\n", u);
    assert_true(u < 1e-4);
    /* plain momentum with dampening, on the conv stack */
    kt_optimizer_config oc2 = {.kind = KT_OPTIM_SGD, .lr = 0.05f, .momentum = 0.8f,
                               .dampening = 0.3f, .weight_decay = 0.02f};
    u = check_optimizer(build_conv(CT), CT, conv_inputs, &oc2, 4, NULL);
    assert_true(u < 1e-4);
}

static void test_adamw_matches_reference(void **state)
{
    (void)state;
    kt_optimizer_config oc = {.kind = KT_OPTIM_ADAMW, .lr = 0.01f, .beta1 = 0.85f,
                              .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.05f};
    double u = check_optimizer(build_lm(LN), LN, lm_set_inputs, &oc, 4, NULL);
    print_message("adamw: worst update error %.3g\n", u);
    assert_true(u < 1e-4);
    oc = (kt_optimizer_config){.kind = KT_OPTIM_ADAMW, .lr = 0.003f, .beta1 = 0.9f,
                               .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};
    u = check_optimizer(build_conv(CT), CT, conv_inputs, &oc, 4, NULL);
    assert_true(u < 1e-4);
}

static void test_clip_norm(void **state)
{
    (void)state;
    /* a threshold far below the gradient norm: every step is clipped (check_optimizer
     * compares the reported norm with the reference's, before clipping, and the clipped
     * update); the MLP's gradient norm is well above 0.01 (asserted below) */
    kt_optimizer_config oc = {.kind = KT_OPTIM_SGD, .lr = 0.5f, .clip_norm = 0.01f};
    double u = check_optimizer(build_mlp(MN), MN, mlp_set_inputs, &oc, 3, NULL);
    assert_true(u < 1e-4);
    /* with momentum and AdamW too */
    oc = (kt_optimizer_config){.kind = KT_OPTIM_SGD, .lr = 0.2f, .momentum = 0.9f,
                               .clip_norm = 0.05f};
    assert_true(check_optimizer(build_mlp(MN), MN, mlp_set_inputs, &oc, 3, NULL) < 1e-4);
    oc = (kt_optimizer_config){.kind = KT_OPTIM_ADAMW, .lr = 0.01f, .beta1 = 0.9f,
                               .beta2 = 0.999f, .eps = 1e-3f, .clip_norm = 0.02f};
    assert_true(check_optimizer(build_lm(LN), LN, lm_set_inputs, &oc, 3, NULL) < 1e-4);

    /* the clipping really happened, and a high threshold leaves the update alone */
    kt_graph *g = build_mlp(MN);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 3,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.5f,
                                           .clip_norm = 0.01f}};
    kt_session_options so_high = so;
    so_high.optimizer.clip_norm = 1e6f;
    kt_session *clipped = new_session(p, &so), *free_run = new_session(p, &so_high);
    mlp_set_inputs(clipped, MN, 100);
    mlp_set_inputs(free_run, MN, 100);
    snap before = take(clipped, p, KT_ROLE_PARAM);
    OK(kt_session_forward(clipped));
    OK(kt_session_backward(clipped));
    OK(kt_session_forward(free_run));
    OK(kt_session_backward(free_run));
    snap G = take(free_run, p, KT_ROLE_GRAD);
    OK(kt_session_step(clipped));
    OK(kt_session_step(free_run));
    double norm = grads_norm(&G);
    assert_true(norm > 0.1);
    assert_float_equal(kt_session_grad_norm(clipped), norm, TOL * norm);
    assert_float_equal(kt_session_grad_norm(free_run), norm, TOL * norm);
    /* the clipped step moved the parameters by 0.5 * 0.01 in norm; the free one by 0.5*norm */
    double moved_c = 0, moved_f = 0;
    for (int i = 0; i < before.n; i++) {
        kt_tensor c = get(clipped, KT_ROLE_PARAM, param_name(p, i));
        kt_tensor f = get(free_run, KT_ROLE_PARAM, param_name(p, i));
        for (int64_t k = 0; k < kt_tensor_numel(&c); k++) {
            double b = tu_get(&before.t[i], k);
            moved_c += (tu_get(&c, k) - b) * (tu_get(&c, k) - b);
            moved_f += (tu_get(&f, k) - b) * (tu_get(&f, k) - b);
        }
    }
    assert_float_equal(sqrt(moved_c), 0.5 * 0.01, 1e-3 * 0.005);
    assert_float_equal(sqrt(moved_f), 0.5 * norm, 1e-3 * norm);
    snap_free(&before);
    snap_free(&G);
    kt_session_destroy(clipped);
    kt_session_destroy(free_run);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* Linear warm-up from base/warmup at step 0 to base at step warmup-1, then half a cosine to
 * min_lr at total_steps, min_lr after. */
static double cosine_lr(const kt_optimizer_config *oc, int64_t k)
{
    double base = oc->lr, lo = oc->min_lr;
    if (k < oc->warmup_steps)
        return base * (double)(k + 1) / (double)oc->warmup_steps;
    if (k >= oc->total_steps)
        return lo;
    double t = (double)(k - oc->warmup_steps) / (double)(oc->total_steps - oc->warmup_steps);
    return lo + (base - lo) * 0.5 * (1 + cos(3.14159265358979323846 * t));
}

static void test_cosine_schedule(void **state)
{
    (void)state;
    /* 11 steps over warm-up 3 and total 8: ramp, cosine, then the floor */
    kt_optimizer_config oc = {.kind = KT_OPTIM_SGD, .lr = 0.2f, .schedule = KT_LR_COSINE,
                              .warmup_steps = 3, .total_steps = 8, .min_lr = 0.02f};
    assert_true(check_optimizer(build_mlp(MN), MN, mlp_set_inputs, &oc, 11, cosine_lr) < 1e-4);
    /* spot values of the formula itself */
    assert_float_equal(cosine_lr(&oc, 0), 0.2 / 3, 1e-12);
    assert_float_equal(cosine_lr(&oc, 2), 0.2, 1e-12);
    assert_float_equal(cosine_lr(&oc, 3), 0.2, 1e-12);
    assert_float_equal(cosine_lr(&oc, 8), 0.02, 1e-12);
    /* with AdamW and momentum, the schedule feeds the update */
    kt_optimizer_config oc2 = {.kind = KT_OPTIM_ADAMW, .lr = 0.01f, .beta1 = 0.9f,
                               .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f,
                               .schedule = KT_LR_COSINE, .warmup_steps = 2, .total_steps = 6,
                               .min_lr = 0.001f};
    assert_true(check_optimizer(build_lm(LN), LN, lm_set_inputs, &oc2, 7, cosine_lr) < 1e-4);
}

/* The same warm-up, then a straight line to min_lr at total_steps; constant: the warm-up, then
 * base. */
static double linear_lr(const kt_optimizer_config *oc, int64_t k)
{
    double base = oc->lr, lo = oc->min_lr;
    if (k < oc->warmup_steps)
        return base * (double)(k + 1) / (double)oc->warmup_steps;
    if (oc->schedule == KT_LR_CONSTANT)
        return base;
    if (k >= oc->total_steps)
        return lo;
    double t = (double)(k - oc->warmup_steps) / (double)(oc->total_steps - oc->warmup_steps);
    return base + (lo - base) * t;
}

static void test_linear_schedule(void **state)
{
    (void)state;
    /* 10 steps over warm-up 2 and total 7: ramp, line, then the floor; SGD and AdamW */
    kt_optimizer_config oc = {.kind = KT_OPTIM_SGD, .lr = 0.2f, .schedule = KT_LR_LINEAR,
                              .warmup_steps = 2, .total_steps = 7, .min_lr = 0.02f};
    assert_true(check_optimizer(build_mlp(MN), MN, mlp_set_inputs, &oc, 10, linear_lr) < 1e-4);
    assert_float_equal(linear_lr(&oc, 0), 0.1, 1e-12);
    assert_float_equal(linear_lr(&oc, 2), 0.2, 1e-12);
    assert_float_equal(linear_lr(&oc, 4), 0.2 - 0.18 * 2 / 5, 1e-12);
    assert_float_equal(linear_lr(&oc, 7), 0.02, 1e-12);
    kt_optimizer_config oc2 = {.kind = KT_OPTIM_ADAMW, .lr = 0.01f, .beta1 = 0.9f,
                               .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f,
                               .schedule = KT_LR_LINEAR, .warmup_steps = 2, .total_steps = 6};
    assert_true(check_optimizer(build_lm(LN), LN, lm_set_inputs, &oc2, 7, linear_lr) < 1e-4);
    /* the warm-up applies to a constant schedule too */
    kt_optimizer_config oc3 = {.kind = KT_OPTIM_SGD, .lr = 0.2f, .schedule = KT_LR_CONSTANT,
                               .warmup_steps = 4, .total_steps = 100, .min_lr = 0.05f};
    assert_true(check_optimizer(build_mlp(MN), MN, mlp_set_inputs, &oc3, 6, linear_lr) < 1e-4);
}

/* ---- 4. gradient accumulation and the session's state machine -------------------------- */

/* Copies rows [first, first+rows) of a [N,...] tensor into a new tensor. */
static kt_tensor rows_of(const kt_tensor *t, int64_t first, int64_t rows)
{
    kt_tensor view;
    OK(kt_tensor_narrow(t, 0, first, rows, &view));
    kt_tensor c = tu_alloc(t->dtype, view.ndim, view.shape);
    memcpy(c.data, view.data, kt_tensor_nbytes(&c));
    return c;
}

/* micro_batches = 2 over two halves against one full batch.
 *
 * Why it holds: cross-entropy is the mean over counted tokens. Each half has the same
 * number c of counted tokens (one ignored token in each), so the full-batch loss is
 * (S1 + S2) / (2c) = (L1 + L2) / 2 where Li = Si / c is half i's loss; the gradient is
 * linear, so grad(full) = (grad L1 + grad L2) / 2. The session accumulates grad L1 + grad L2
 * in the gradient buffers and the step divides by the number of micro-batches, so the
 * update (and the norm it reports) is the full batch's. With unequal counts the halves would
 * need weights c_i / (c1 + c2) instead of 1/2, and the identity would not hold. */
static void test_grad_accumulation(void **state)
{
    (void)state;
    kt_graph *gf = build_mlp(MN), *gh = build_mlp(MN / 2);
    kt_program *pf = compile(gf), *ph = compile(gh);
    kt_optimizer_config oc = {.kind = KT_OPTIM_SGD, .lr = 0.1f, .momentum = 0.9f};
    kt_session_options sof = {.threads = 2, .seed = 7, .optimizer = oc};
    kt_session_options soh = sof;
    soh.micro_batches = 2;
    kt_session *full = new_session(pf, &sof), *half = new_session(ph, &soh);
    for (int i = 0; i < n_params(pf); i++) { /* the same starting point */
        kt_tensor v = get(full, KT_ROLE_PARAM, param_name(pf, i));
        set_from(half, KT_ROLE_PARAM, param_name(pf, i), &v);
    }
    kt_tensor x, y;
    mlp_data(MN, 31, &x, &y);
    int ignored[2] = {0, 0};
    for (int i = 0; i < MN; i++)
        ignored[i / (MN / 2)] += tu_get(&y, i) == IGNORE;
    assert_int_equal(ignored[0], 1);
    assert_int_equal(ignored[1], 1);

    set_from(full, KT_ROLE_INPUT, "x", &x);
    set_from(full, KT_ROLE_INPUT, "y", &y);
    OK(kt_session_forward(full));
    OK(kt_session_backward(full));
    snap Gf = take(full, pf, KT_ROLE_GRAD);

    float half_loss[2];
    for (int h = 0; h < 2; h++) {
        kt_tensor xh = rows_of(&x, h * (MN / 2), MN / 2), yh = rows_of(&y, h * (MN / 2), MN / 2);
        set_from(half, KT_ROLE_INPUT, "x", &xh);
        set_from(half, KT_ROLE_INPUT, "y", &yh);
        OK(kt_session_forward(half));
        half_loss[h] = kt_session_loss(half);
        OK(kt_session_backward(half));
        tu_free(&xh);
        tu_free(&yh);
    }
    assert_float_equal((half_loss[0] + half_loss[1]) / 2, kt_session_loss(full),
                       TOL * kt_session_loss(full));
    /* the buffers hold the sum of the two micro-batch gradients until the step */
    for (int i = 0; i < n_params(pf); i++) {
        kt_tensor sum = get(half, KT_ROLE_GRAD, param_name(pf, i));
        kt_tensor mean = tu_clone(&sum);
        for (int64_t k = 0; k < kt_tensor_numel(&mean); k++)
            tu_set(&mean, k, tu_get(&sum, k) * 0.5);
        char what[96];
        snprintf(what, sizeof what, "accumulated grad %s", param_name(pf, i));
        expect_close(what, &mean, &Gf.t[i]);
        assert_true(tu_rel_err(&sum, &Gf.t[i], 1e-12) > 0.5); /* not already averaged */
        tu_free(&mean);
    }

    /* a third backward before the step fails and changes nothing */
    OK(kt_session_forward(half));
    TU_EXPECT_ERROR(kt_session_backward(half), KT_ESTATE, "micro-batch", "kt_session_step");

    OK(kt_session_step(full));
    OK(kt_session_step(half));
    assert_float_equal(kt_session_grad_norm(half), kt_session_grad_norm(full),
                       TOL * kt_session_grad_norm(full));
    for (int i = 0; i < n_params(pf); i++) {
        kt_tensor a = get(half, KT_ROLE_PARAM, param_name(pf, i));
        kt_tensor b = get(full, KT_ROLE_PARAM, param_name(pf, i));
        expect_close("params after the accumulated step", &a, &b);
    }
    /* a new accumulation starts after the step: one backward overwrites, not adds */
    kt_tensor xh = rows_of(&x, 0, MN / 2), yh = rows_of(&y, 0, MN / 2);
    set_from(half, KT_ROLE_INPUT, "x", &xh);
    set_from(half, KT_ROLE_INPUT, "y", &yh);
    OK(kt_session_forward(half));
    OK(kt_session_backward(half));
    kt_session_options so1 = soh;
    so1.micro_batches = 1;
    kt_session *one = new_session(ph, &so1);
    for (int i = 0; i < n_params(pf); i++) {
        kt_tensor v = get(half, KT_ROLE_PARAM, param_name(pf, i));
        set_from(one, KT_ROLE_PARAM, param_name(pf, i), &v);
    }
    set_from(one, KT_ROLE_INPUT, "x", &xh);
    set_from(one, KT_ROLE_INPUT, "y", &yh);
    OK(kt_session_forward(one));
    OK(kt_session_backward(one));
    for (int i = 0; i < n_params(pf); i++) {
        kt_tensor a = get(half, KT_ROLE_GRAD, param_name(pf, i));
        kt_tensor b = get(one, KT_ROLE_GRAD, param_name(pf, i));
        expect_bitwise("first micro-batch after a step", &a, &b);
    }
    tu_free(&xh);
    tu_free(&yh);
    kt_session_destroy(one);

    snap_free(&Gf);
    tu_free(&x);
    tu_free(&y);
    kt_session_destroy(full);
    kt_session_destroy(half);
    kt_program_destroy(pf);
    kt_program_destroy(ph);
    kt_graph_destroy(gf);
    kt_graph_destroy(gh);
}

/* Hyperparameters PyTorch's optimizers refuse are refused at creation (a beta of 1 had made
 * every parameter NaN at the first step, which itself succeeded). */
/* A parameter the loss does not reach (here one only a side output reads) has no gradient
 * and no optimizer update, weight decay included, as PyTorch skips a parameter whose .grad
 * is None; the one the loss reaches moves. */
static void test_param_without_gradient(void **state)
{
    (void)state;
    kt_graph *g;
    kt_value x, y, w, u;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(4, 8), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(4), &y));
    OK(kt_graph_param(g, "w", KT_F32, 2, TU_SHAPE(8, 3), kt_init_normal(0.3f), &w));
    OK(kt_graph_param(g, "u", KT_F32, 2, TU_SHAPE(8, 3), kt_init_normal(0.3f), &u));
    kt_value h = tu_op2(g, "proj", KT_OP_MATMUL, NULL, x, w);
    kt_value side = tu_op2(g, "side", KT_OP_MATMUL, NULL, x, u);
    kt_value loss = tu_op2(g, "ce", KT_OP_CROSS_ENTROPY, NULL, h, y);
    OK(kt_graph_output(g, side, "side"));
    OK(kt_graph_set_loss(g, loss));
    kt_program *p = compile(g);
    for (int kind = 0; kind < 2; kind++) {
        kt_session_options so = {
            .threads = 1,
            .seed = 3,
            .optimizer = {.kind = kind ? KT_OPTIM_ADAMW : KT_OPTIM_SGD, .lr = 0.1f,
                          .momentum = kind ? 0.0f : 0.9f, .weight_decay = 0.5f}};
        kt_session *s = new_session(p, &so);
        kt_tensor xt = get(s, KT_ROLE_INPUT, "x"), yt = get(s, KT_ROLE_INPUT, "y");
        for (int64_t i = 0; i < 32; i++)
            tu_set(&xt, i, 0.1 * (double)(i % 7) - 0.3);
        for (int64_t i = 0; i < 4; i++)
            tu_set(&yt, i, (double)(i % 3));
        kt_tensor ut = get(s, KT_ROLE_PARAM, "u"), wt = get(s, KT_ROLE_PARAM, "w");
        kt_tensor u0 = tu_clone(&ut), w0 = tu_clone(&wt);
        for (int step = 0; step < 3; step++) {
            OK(kt_session_forward(s));
            OK(kt_session_backward(s));
            OK(kt_session_step(s));
        }
        expect_bitwise("u, which the loss does not reach", &ut, &u0);
        assert_false(tu_bitwise_equal(&wt, &w0));
        tu_free(&u0);
        tu_free(&w0);
        kt_session_destroy(s);
    }
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

static void test_optimizer_config_errors(void **state)
{
    (void)state;
    kt_graph *g = build_mlp(MN);
    kt_program *p = compile(g);
    const struct {
        kt_optimizer_config o;
        const char *what;
    } bad[] = {
        {{.kind = KT_OPTIM_ADAMW, .lr = 1e-3f, .beta1 = 1.0f}, "beta1 1"},
        {{.kind = KT_OPTIM_ADAMW, .lr = 1e-3f, .beta2 = 1.0f}, "beta2 1"},
        {{.kind = KT_OPTIM_ADAMW, .lr = 1e-3f, .beta2 = 1.5f}, "beta2 1.5"},
        {{.kind = KT_OPTIM_ADAMW, .lr = 1e-3f, .eps = -1e-8f}, "eps"},
        {{.kind = KT_OPTIM_SGD, .lr = -0.1f}, "lr -0.1"},
        {{.kind = KT_OPTIM_SGD, .lr = NAN}, "lr nan"},
        {{.kind = KT_OPTIM_SGD, .lr = 0.1f, .weight_decay = -1.0f}, "weight_decay"},
        {{.kind = KT_OPTIM_SGD, .lr = 0.1f, .nesterov = 1}, "Nesterov"},
        {{.kind = KT_OPTIM_SGD, .lr = 0.1f, .schedule = (kt_lr_schedule_kind)7}, "schedule 7"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kt_session_options so = {.threads = 1, .optimizer = bad[i].o};
        kt_session *s = (kt_session *)1;
        TU_EXPECT_ERROR(kt_session_create(p, &so, &s), KT_EINVAL, "session", bad[i].what);
    }
    /* the defaults (0) and PyTorch's usual values are fine */
    kt_session_options ok = {.threads = 1,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 1e-3f, .beta1 = 0.0f,
                                           .beta2 = 0.95f, .weight_decay = 0.1f}};
    kt_session *s = NULL;
    OK(kt_session_create(p, &ok, &s));
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

static void test_state_errors(void **state)
{
    (void)state;
    kt_graph *g = build_mlp(MN);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 7,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s = new_session(p, &so);
    mlp_set_inputs(s, MN, 1);
    assert_true(isnan(kt_session_loss(s)));
    snap P0 = take(s, p, KT_ROLE_PARAM);

    /* backward without forward */
    TU_EXPECT_ERROR(kt_session_backward(s), KT_ESTATE, "forward");
    /* step without backward: before any forward, and after a forward */
    TU_EXPECT_ERROR(kt_session_step(s), KT_ESTATE, "backward");
    OK(kt_session_forward(s));
    TU_EXPECT_ERROR(kt_session_step(s), KT_ESTATE, "backward");
    expect_params_bitwise("after refused steps", s, p, &P0);
    assert_int_equal(kt_session_step_count(s), 0);

    /* one backward per forward: the backward consumes the forward's activations */
    OK(kt_session_backward(s));
    TU_EXPECT_ERROR(kt_session_backward(s), KT_ESTATE, "forward");
    OK(kt_session_step(s));
    assert_int_equal(kt_session_step_count(s), 1);
    /* a second step without a new backward */
    TU_EXPECT_ERROR(kt_session_step(s), KT_ESTATE, "backward");
    assert_int_equal(kt_session_step_count(s), 1);

    /* micro_batches = 1: a second backward (after a second forward) before the step fails */
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    OK(kt_session_forward(s));
    TU_EXPECT_ERROR(kt_session_backward(s), KT_ESTATE, "kt_session_step");
    OK(kt_session_step(s));

    /* a forward-only program has no backward */
    kt_compile_options co = {.training = 0};
    kt_program *pi;
    OK(kt_compile(g, &co, &pi));
    kt_session *si = new_session(pi, &so);
    mlp_set_inputs(si, MN, 1);
    OK(kt_session_forward(si));
    TU_EXPECT_ERROR(kt_session_backward(si), KT_ESTATE, "without training");
    TU_EXPECT_ERROR(kt_session_step(si), KT_ESTATE, "backward");
    kt_session_destroy(si);
    kt_program_destroy(pi);

    snap_free(&P0);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* Inputs are written once through their views and stay there: forward, backward and the
 * step never reuse their memory, so the same batch can be run again (training on a fixed
 * batch, evaluating after a step) without writing it again. */
static void test_inputs_survive_the_run(void **state)
{
    (void)state;
    kt_graph *g = build_conv(CT);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 4,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s = new_session(p, &so);
    kt_tensor x, y;
    conv_set_inputs(s, CT, 8, &x, &y);
    OK(kt_session_forward(s));
    float first = kt_session_loss(s);
    kt_tensor logits = get(s, KT_ROLE_OUTPUT, "logits");
    kt_tensor logits0 = tu_clone(&logits);
    OK(kt_session_forward(s)); /* again, parameters unchanged: the same numbers */
    assert_true(bitwise_same_float(kt_session_loss(s), first));
    expect_bitwise("logits of a repeated forward", &logits, &logits0);
    OK(kt_session_backward(s));
    kt_tensor xv = get(s, KT_ROLE_INPUT, "x"), yv = get(s, KT_ROLE_INPUT, "y");
    expect_bitwise("input x after forward + backward", &xv, &x);
    expect_bitwise("input y after forward + backward", &yv, &y);
    OK(kt_session_step(s));
    expect_bitwise("input x after a step", &xv, &x);
    expect_bitwise("input y after a step", &yv, &y);
    OK(kt_session_forward(s));
    assert_true(kt_session_loss(s) < first); /* the step on this batch helped */

    /* a forward-only program evaluated twice */
    kt_compile_options co = {.training = 0};
    kt_program *pe;
    OK(kt_compile(g, &co, &pe));
    kt_session *e = new_session(pe, &so);
    set_from(e, KT_ROLE_INPUT, "x", &x);
    set_from(e, KT_ROLE_INPUT, "y", &y);
    OK(kt_session_forward(e));
    kt_tensor el = get(e, KT_ROLE_OUTPUT, "logits"), el0 = tu_clone(&el);
    OK(kt_session_forward(e));
    expect_bitwise("forward-only program run twice", &el, &el0);
    kt_session_destroy(e);
    kt_program_destroy(pe);

    tu_free(&logits0);
    tu_free(&el0);
    tu_free(&x);
    tu_free(&y);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- 5. save and load ------------------------------------------------------------------ */

static char tmpdir[64];

static const char *tmp_path(char *buf, size_t size, const char *name)
{
    snprintf(buf, size, "%s/%s", tmpdir, name);
    return buf;
}

static int setup_tmpdir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kt_graph_models_XXXXXX");
    return mkdtemp(tmpdir) == NULL ? -1 : 0;
}

static int teardown_tmpdir(void **state)
{
    (void)state;
    return rmdir(tmpdir);
}

static void train_steps(kt_session *s, set_inputs_fn set, int n, int steps, uint64_t seed)
{
    for (int k = 0; k < steps; k++) {
        set(s, n, seed + (uint64_t)k);
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
}

static void test_save_load_weights(void **state)
{
    (void)state;
    char path[128];
    tmp_path(path, sizeof path, "weights.safetensors");
    kt_graph *g = build_conv(CT);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 1,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *a = new_session(p, &so);
    train_steps(a, conv_inputs, CT, 2, 50); /* weights that are not the initial ones */
    OK(kt_session_save(a, path, 0));

    so.seed = 999; /* a different initialisation, overwritten by the load */
    kt_session *b = new_session(p, &so);
    kt_tensor la = get(a, KT_ROLE_PARAM, "w_c1"), lb = get(b, KT_ROLE_PARAM, "w_c1");
    assert_false(tu_bitwise_equal(&la, &lb));
    OK(kt_session_load(b, path, 0));
    snap Pa = take(a, p, KT_ROLE_PARAM);
    expect_params_bitwise("loaded weights", b, p, &Pa);

    conv_set_inputs(a, CT, 77, NULL, NULL);
    conv_set_inputs(b, CT, 77, NULL, NULL);
    OK(kt_session_forward(a));
    OK(kt_session_forward(b));
    kt_tensor oa = get(a, KT_ROLE_OUTPUT, "logits"), ob = get(b, KT_ROLE_OUTPUT, "logits");
    expect_bitwise("forward after load", &oa, &ob);
    assert_true(bitwise_same_float(kt_session_loss(a), kt_session_loss(b)));

    /* a weights-only file has no optimizer state to load */
    TU_EXPECT_ERROR(kt_session_load(b, path, KT_LOAD_OPTIMIZER), KT_EFORMAT, path, "kt.step");
    expect_params_bitwise("after a refused optimizer load", b, p, &Pa);

    snap_free(&Pa);
    kt_session_destroy(a);
    kt_session_destroy(b);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    unlink(path);
}

static void test_save_load_optimizer(void **state)
{
    (void)state;
    char path[128];
    tmp_path(path, sizeof path, "with_optimizer.safetensors");
    kt_graph *g = build_conv(CT);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 1,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 0.01f,
                                           .weight_decay = 0.05f, .schedule = KT_LR_COSINE,
                                           .warmup_steps = 2, .total_steps = 10,
                                           .min_lr = 0.001f}};
    kt_session *a = new_session(p, &so);
    train_steps(a, conv_inputs, CT, 3, 60);
    OK(kt_session_save(a, path, 1));

    so.seed = 5;
    kt_session *b = new_session(p, &so), *c = new_session(p, &so);
    OK(kt_session_load(b, path, KT_LOAD_OPTIMIZER));
    OK(kt_session_load(c, path, 0)); /* weights only: fresh moments, step 0 */
    assert_int_equal(kt_session_step_count(b), 3);
    assert_int_equal(kt_session_step_count(c), 0);

    /* two more steps: b continues a exactly */
    for (int k = 0; k < 2; k++) {
        kt_session *all[3] = {a, b, c};
        for (int i = 0; i < 3; i++) {
            conv_set_inputs(all[i], CT, 200 + (uint64_t)k, NULL, NULL);
            OK(kt_session_forward(all[i]));
            OK(kt_session_backward(all[i]));
            OK(kt_session_step(all[i]));
        }
        assert_true(bitwise_same_float(kt_session_loss(a), kt_session_loss(b)));
        assert_true(bitwise_same_float(kt_session_lr(a), kt_session_lr(b)));
        assert_true(bitwise_same_float(kt_session_grad_norm(a), kt_session_grad_norm(b)));
        snap Pa = take(a, p, KT_ROLE_PARAM);
        expect_params_bitwise("step after loading optimizer state", b, p, &Pa);
        snap_free(&Pa);
    }
    assert_int_equal(kt_session_step_count(b), 5);
    /* without the optimizer state the continuation differs (the state matters) */
    kt_tensor wa = get(a, KT_ROLE_PARAM, "w_c1"), wc = get(c, KT_ROLE_PARAM, "w_c1");
    assert_true(tu_rel_err(&wc, &wa, 1e-12) > 1e-4);

    /* the state round-trips: saved names and values */
    kt_st_file *f;
    OK(kt_st_open(path, &f));
    assert_string_equal(kt_st_metadata(f, "kt.step"), "3");
    assert_int_equal(kt_st_count(f), 3 * (size_t)n_params(p));
    kt_tensor view;
    OK(kt_st_find(f, "optimizer.m.w_out", &view));
    OK(kt_st_find(f, "optimizer.v.gain", &view));
    kt_st_close(f);

    kt_session_destroy(a);
    kt_session_destroy(b);
    kt_session_destroy(c);
    kt_program_destroy(p);
    kt_graph_destroy(g);

    /* SGD with momentum: the momentum buffers and the step count (after the first step the
     * buffer is updated, not reset to the gradient) */
    g = build_mlp(MN);
    p = compile(g);
    kt_session_options sgd = {.threads = 2, .seed = 1,
                              .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f, .momentum = 0.9f,
                                            .nesterov = 1, .weight_decay = 0.01f}};
    a = new_session(p, &sgd);
    train_steps(a, mlp_set_inputs, MN, 2, 70);
    OK(kt_session_save(a, path, 1));
    OK(kt_st_open(path, &f));
    assert_string_equal(kt_st_metadata(f, "kt.optimizer"), "sgd");
    OK(kt_st_find(f, "optimizer.momentum.w1", &view));
    kt_st_close(f);
    sgd.seed = 2;
    b = new_session(p, &sgd);
    OK(kt_session_load(b, path, KT_LOAD_OPTIMIZER));
    train_steps(a, mlp_set_inputs, MN, 2, 80);
    train_steps(b, mlp_set_inputs, MN, 2, 80);
    snap Pa = take(a, p, KT_ROLE_PARAM);
    expect_params_bitwise("sgd momentum continued after load", b, p, &Pa);
    snap_free(&Pa);
    kt_session_destroy(a);
    kt_session_destroy(b);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    unlink(path);
}

/* Writes w1, b1, w2 (the MLP's parameters, in program order) with values unlike the
 * session's; `bad` (0 none, 1 w2's shape, 2 w2's dtype (an integer), 3 b1 missing, 4 a "w3" the program
 * does not have, after an "optimizer.m.w1" it may) spoils one entry. */
static void write_mlp_file(const char *path, int bad)
{
    tu_rng rng;
    tu_rng_seed(&rng, 4242);
    kt_tensor w1 = tu_new(KT_F32, MD, MH), b1 = tu_new(KT_F32, MH), w2;
    if (bad == 1)
        w2 = tu_new(KT_F32, MH, MC + 1);
    else if (bad == 2)
        w2 = tu_new(KT_I32, MH, MC); /* a float dtype would convert */
    else
        w2 = tu_new(KT_F32, MH, MC);
    tu_fill_uniform(&w1, &rng, 5, 6);
    tu_fill_uniform(&b1, &rng, 5, 6);
    tu_fill_uniform(&w2, &rng, 5, 6);
    kt_st_item items[5] = {{"w1", w1}, {"b1", b1}, {"w2", w2}, {"optimizer.m.w1", w1},
                           {"w3", w2}};
    if (bad == 3)
        items[1] = items[2];
    OK(kt_st_save(path, items, bad == 3 ? 2 : bad == 4 ? 5 : 3, NULL));
    tu_free(&w1);
    tu_free(&b1);
    tu_free(&w2);
}

static void test_load_errors(void **state)
{
    (void)state;
    char path[128];
    tmp_path(path, sizeof path, "bad.safetensors");
    kt_graph *g = build_mlp(MN);
    kt_program *p = compile(g);
    assert_string_equal(param_name(p, 0), "w1");
    assert_string_equal(param_name(p, 2), "w2");
    kt_session_options so = {.threads = 2, .seed = 7};
    kt_session *s = new_session(p, &so);
    snap P0 = take(s, p, KT_ROLE_PARAM);

    /* the bad entry comes after good ones: a loader that copied as it went would have
     * changed w1 (and b1) before noticing */
    write_mlp_file(path, 1);
    TU_EXPECT_ERROR(kt_session_load(s, path, 0), KT_EINVAL, path, "'w2'", "f32[32,6]",
                    "f32[32,5]");
    expect_params_bitwise("after a wrong-shape load", s, p, &P0);
    TU_EXPECT_ERROR(kt_session_load(s, path, KT_LOAD_ALLOW_MISSING), KT_EINVAL, "'w2'");
    expect_params_bitwise("after a wrong-shape load (allow missing)", s, p, &P0);

    write_mlp_file(path, 2);
    TU_EXPECT_ERROR(kt_session_load(s, path, 0), KT_EUNSUPPORTED, "'w2'", "I32", "f32");
    expect_params_bitwise("after a wrong-dtype load", s, p, &P0);

    write_mlp_file(path, 3);
    TU_EXPECT_ERROR(kt_session_load(s, path, 0), KT_EINVAL, "'b1'", "no tensor");
    expect_params_bitwise("after a load with a missing tensor", s, p, &P0);

    /* allowed: the others load, b1 keeps its value */
    OK(kt_session_load(s, path, KT_LOAD_ALLOW_MISSING));
    kt_st_file *f;
    OK(kt_st_open(path, &f));
    kt_tensor w1 = get(s, KT_ROLE_PARAM, "w1"), w2 = get(s, KT_ROLE_PARAM, "w2");
    kt_tensor b1 = get(s, KT_ROLE_PARAM, "b1");
    kt_tensor f1 = tu_clone(&w1), f2 = tu_clone(&w2);
    OK(kt_st_read(f, "w1", &f1));
    OK(kt_st_read(f, "w2", &f2));
    expect_bitwise("w1 loaded", &w1, &f1);
    expect_bitwise("w2 loaded", &w2, &f2);
    assert_true(tu_get(&w1, 0) >= 5.0);
    expect_bitwise("b1 kept", &b1, &P0.t[1]);
    kt_st_close(f);
    tu_free(&f1);
    tu_free(&f2);

    /* another model's tensor: refused (nothing loaded) unless KT_LOAD_ALLOW_UNUSED */
    snap P1 = take(s, p, KT_ROLE_PARAM);
    write_mlp_file(path, 4);
    TU_EXPECT_ERROR(kt_session_load(s, path, 0), KT_EINVAL, path, "'w3'",
                    "not a parameter of the program");
    expect_params_bitwise("after a load with an unknown tensor", s, p, &P1);
    OK(kt_session_load(s, path, KT_LOAD_ALLOW_UNUSED));
    snap_free(&P1);

    /* a file that is not there */
    tmp_path(path, sizeof path, "absent.safetensors");
    TU_EXPECT_ERROR(kt_session_load(s, path, 0), KT_EIO, "absent.safetensors");

    snap_free(&P0);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
    tmp_path(path, sizeof path, "bad.safetensors");
    unlink(path);
}

/* ---- 6. frozen parameters --------------------------------------------------------------- */

/* loss = CE(silu(x W1) Wf, y) + CE(xb Wb, y): W1 trainable; Wf a frozen f32 weight after
 * the trainable one (so its matmul's backward must produce the input's gradient but not its
 * own); Wb a frozen bf16 weight in a bf16 matmul with bf16 activations (the ops need one
 * dtype per op, so the bf16 branch cannot feed trainable f32 parameters; cross_entropy
 * returns f32 whatever the logits). */
enum { FN = 16, FD = 8, FH = 16, FC = 4 };

static kt_graph *build_frozen(void)
{
    kt_graph *g;
    kt_value x, xb, y, w1, wf, wb, h, lg, lb, la, l2, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(FN, FD), &x));
    OK(kt_graph_input(g, "xb", KT_BF16, 2, TU_SHAPE(FN, FD), &xb));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(FN), &y));
    OK(kt_graph_param(g, "w1", KT_F32, 2, TU_SHAPE(FD, FH), kt_init_normal(0.4f), &w1));
    OK(kt_graph_const_param(g, "wf", KT_F32, 2, TU_SHAPE(FH, FC), kt_init_normal(0.5f), &wf));
    OK(kt_graph_const_param(g, "wb", KT_BF16, 2, TU_SHAPE(FD, FC), kt_init_normal(0.5f), &wb));
    h = tu_op1(g, "act", KT_OP_SILU, NULL, tu_op2(g, "fc1", KT_OP_MATMUL, NULL, x, w1));
    lg = tu_op2(g, "frozen_head", KT_OP_MATMUL, NULL, h, wf);
    lb = tu_op2(g, "bf16_head", KT_OP_MATMUL, NULL, xb, wb);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    la = tu_op2(g, "loss_f32", KT_OP_CROSS_ENTROPY, &ce, lg, y);
    l2 = tu_op2(g, "loss_bf16", KT_OP_CROSS_ENTROPY, &ce, lb, y);
    loss = tu_op2(g, "loss", KT_OP_ADD, NULL, la, l2);
    OK(kt_graph_output(g, lb, "bf16_logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static void frozen_set_inputs(kt_session *s, uint64_t seed, kt_tensor *x_out, kt_tensor *xb_out,
                              kt_tensor *y_out)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    kt_tensor x = tu_new(KT_F32, FN, FD), y = tu_new(KT_I32, FN);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, FC);
    kt_tensor xb = tu_convert(&x, KT_BF16);
    set_from(s, KT_ROLE_INPUT, "x", &x);
    set_from(s, KT_ROLE_INPUT, "xb", &xb);
    set_from(s, KT_ROLE_INPUT, "y", &y);
    *x_out = x, *xb_out = xb, *y_out = y;
}

static void test_frozen_params(void **state)
{
    (void)state;
    kt_graph *g = build_frozen();
    kt_program *p = compile(g);
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    assert_int_equal(st.n_params, 3);
    assert_int_equal(st.grad_bytes, FD * FH * sizeof(float)); /* w1's gradient only */
    kt_session_options so = {.threads = 2, .seed = 9,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 0.05f,
                                           .weight_decay = 0.5f}};
    kt_session *s = new_session(p, &so);
    kt_tensor view;
    TU_EXPECT_ERROR(kt_session_tensor(s, KT_ROLE_GRAD, "wf", &view), KT_EINVAL, "'wf'",
                    "frozen");
    TU_EXPECT_ERROR(kt_session_tensor(s, KT_ROLE_GRAD, "wb", &view), KT_EINVAL, "'wb'",
                    "frozen");
    OK(kt_session_tensor(s, KT_ROLE_GRAD, "w1", &view));
    kt_tensor wb = get(s, KT_ROLE_PARAM, "wb");
    assert_int_equal(wb.dtype, KT_BF16);
    assert_true(max_abs(&wb) > 0.1); /* initialised (normal 0.5), not zeros */
    snap P0 = take(s, p, KT_ROLE_PARAM);

    /* forward and w1's gradient against the kernels */
    tpool tp = {.n = 0};
    kt_tensor x, xb, y;
    frozen_set_inputs(s, 3, &x, &xb, &y);
    keep(&tp, x), keep(&tp, xb), keep(&tp, y);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    kt_tensor w1 = get(s, KT_ROLE_PARAM, "w1"), wf = get(s, KT_ROLE_PARAM, "wf");
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    kt_tensor h0 = F2(&tp, KT_OP_MATMUL, NULL, x, w1), h = F1(&tp, KT_OP_SILU, NULL, h0);
    kt_tensor lg = F2(&tp, KT_OP_MATMUL, NULL, h, wf);
    kt_tensor lb = F2(&tp, KT_OP_MATMUL, NULL, xb, wb);
    assert_int_equal(lb.dtype, KT_BF16);
    kt_tensor la = F2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y);
    kt_tensor l2 = F2(&tp, KT_OP_CROSS_ENTROPY, &ce, lb, y);
    kt_tensor got_lb = get(s, KT_ROLE_OUTPUT, "bf16_logits");
    expect_bitwise("bf16 logits", &got_lb, &lb);
    double want = (double)(float)(tu_get(&la, 0) + tu_get(&l2, 0));
    assert_float_equal(kt_session_loss(s), want, TOL * want);
    kt_tensor g_lg, g_h, g_h0, g_w1;
    B2(&tp, KT_OP_CROSS_ENTROPY, &ce, lg, y, la, loss_seed(&tp), 1, 0, &g_lg, NULL);
    B2(&tp, KT_OP_MATMUL, NULL, h, wf, lg, g_lg, 1, 0, &g_h, NULL);
    g_h0 = B1(&tp, KT_OP_SILU, NULL, h0, h, g_h);
    B2(&tp, KT_OP_MATMUL, NULL, x, w1, h0, g_h0, 0, 1, NULL, &g_w1);
    kt_tensor gw1 = get(s, KT_ROLE_GRAD, "w1");
    expect_close("grad w1 (under a frozen weight)", &gw1, &g_w1);
    OK(kt_session_step(s));

    /* more steps, with weight decay that would move any parameter it touched */
    for (int k = 0; k < 4; k++) {
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
    kt_tensor wf_now = get(s, KT_ROLE_PARAM, "wf"), wb_now = get(s, KT_ROLE_PARAM, "wb");
    expect_bitwise("frozen f32 weight after 5 steps", &wf_now, &P0.t[1]);
    expect_bitwise("frozen bf16 weight after 5 steps", &wb_now, &P0.t[2]);
    kt_tensor w1_now = get(s, KT_ROLE_PARAM, "w1");
    assert_true(tu_rel_err(&w1_now, &P0.t[0], 1e-12) > 1e-3); /* the trainable one moved */

    /* saved with the optimizer: frozen weights are saved, but carry no optimizer state */
    char path[128];
    tmp_path(path, sizeof path, "frozen.safetensors");
    OK(kt_session_save(s, path, 1));
    kt_st_file *f;
    OK(kt_st_open(path, &f));
    assert_int_equal(kt_st_count(f), 3 + 2);
    OK(kt_st_find(f, "wb", &view));
    assert_int_equal(view.dtype, KT_BF16);
    assert_int_not_equal(kt_st_find(f, "optimizer.m.wb", &view), KT_OK);
    kt_st_close(f);
    unlink(path);

    pool_free(&tp);
    snap_free(&P0);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- 7. tracing ------------------------------------------------------------------------ */

/* A node name JSON must escape: quotes, a backslash and a tab. */
#define ODD_NAME "fc \"quoted\" \\ back\tslash"

static kt_graph *build_traced(void)
{
    kt_graph *g;
    kt_value x, y, w, b, h, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(MN, MD), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(MN), &y));
    OK(kt_graph_param(g, "w", KT_F32, 2, TU_SHAPE(MD, MC), kt_init_normal(0.3f), &w));
    OK(kt_graph_param(g, "b", KT_F32, 1, TU_SHAPE(MC), kt_init_zeros(), &b));
    h = tu_op2(g, ODD_NAME, KT_OP_MATMUL, NULL, x, w);
    h = tu_op2(g, "bias", KT_OP_ADD, NULL, h, b);
    kt_op_attrs ce = TU_ATTRS(KT_OP_CROSS_ENTROPY, .ignore_index = IGNORE);
    loss = tu_op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, h, y);
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static const char *const trace_check_py =
    "import json, sys\n"
    "d = json.load(open(sys.argv[1]))\n"
    "ev = d['traceEvents']\n"
    "assert len(ev) == int(sys.argv[2]), (len(ev), sys.argv[2])\n"
    "prev = -1.0\n"
    "for e in ev:\n"
    "    assert isinstance(e['name'], str) and e['name'], e\n"
    "    assert isinstance(e['cat'], str) and e['cat'], e\n"
    "    assert e['ph'] == 'X', e\n"
    "    assert isinstance(e['ts'], (int, float)) and e['ts'] >= prev, e\n"
    "    assert isinstance(e['dur'], (int, float)) and e['dur'] >= 0, e\n"
    "    prev = e['ts']\n"
    "names = [e['name'] for e in ev]\n"
    "assert 'fc \"quoted\" \\\\ back\\tslash' in names, names\n"
    "assert ev[-1]['cat'] == 'optimizer', ev[-1]\n"
    "assert sum(e['cat'] == 'forward' for e in ev) == int(sys.argv[3])\n";

static size_t count_substr(const char *hay, const char *needle)
{
    size_t n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static void test_trace(void **state)
{
    (void)state;
    kt_graph *g = build_traced();
    kt_program *p = compile(g);
    kt_program_stats st;
    kt_program_get_stats(p, &st);
    const size_t n_steps = (size_t)(st.n_forward_steps + st.n_backward_steps);
    const size_t cap = 256;
    assert_true(n_steps + 1 < cap);
    kt_trace_event *ev = calloc(cap, sizeof *ev);
    assert_non_null(ev);
    kt_session_options so = {.threads = 2, .seed = 1, .trace = ev, .trace_capacity = cap,
                             .optimizer = {.kind = KT_OPTIM_SGD, .lr = 0.1f}};
    kt_session *s = new_session(p, &so);
    mlp_set_inputs(s, MN, 1);
    assert_int_equal(kt_session_trace_count(s), 0);
    OK(kt_session_forward(s));
    assert_int_equal(kt_session_trace_count(s), (size_t)st.n_forward_steps);
    OK(kt_session_backward(s));
    OK(kt_session_step(s));
    const size_t n = kt_session_trace_count(s);
    assert_int_equal(n, n_steps + 1); /* one per schedule step, plus the optimizer */
    int saw_odd = 0;
    for (size_t i = 0; i < n; i++) {
        assert_non_null(ev[i].name);
        assert_non_null(ev[i].category);
        assert_true(ev[i].start_ns <= ev[i].end_ns);
        if (i > 0)
            assert_true(ev[i - 1].end_ns <= ev[i].start_ns);
        if (i < n_steps) {
            assert_int_equal(ev[i].step, (int32_t)i);
            const char *want = i < (size_t)st.n_forward_steps ? "forward" : NULL;
            if (want)
                assert_string_equal(ev[i].category, want);
            else
                assert_true(strcmp(ev[i].category, "backward") == 0 ||
                            strcmp(ev[i].category, "fill") == 0 ||
                            strcmp(ev[i].category, "accumulate") == 0);
            saw_odd |= strcmp(ev[i].name, ODD_NAME) == 0;
        }
    }
    assert_true(saw_odd);
    assert_string_equal(ev[n - 1].category, "optimizer");
    assert_int_equal(ev[n - 1].step, -1);

    /* the JSON file */
    char path[128], script[128];
    tmp_path(path, sizeof path, "trace.json");
    OK(kt_trace_write_json(ev, n, path));
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *text = calloc(1, 1 << 16);
    assert_non_null(text);
    size_t len = fread(text, 1, (1 << 16) - 1, f);
    fclose(f);
    assert_true(len > 0 && len < (1 << 16) - 1);
    /* structural checks in C (always) */
    assert_true(strncmp(text, "{", 1) == 0);
    assert_non_null(strstr(text, "\"traceEvents\":["));
    assert_int_equal(count_substr(text, "\"ph\":\"X\""), n);
    assert_int_equal(count_substr(text, "\"ts\":"), n);
    assert_int_equal(count_substr(text, "\"dur\":"), n);
    assert_non_null(strstr(text, "fc \\\"quoted\\\" \\\\ back\\u0009slash"));
    free(text);
    /* and Python's json module, where there is one */
    if (access("/usr/bin/python3", X_OK) == 0) {
        tmp_path(script, sizeof script, "check_trace.py");
        FILE *py = fopen(script, "w");
        assert_non_null(py);
        fputs(trace_check_py, py);
        fclose(py);
        char cmd[512];
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s %zu %d", script, path, n,
                 st.n_forward_steps);
        int rc = system(cmd);
        unlink(script);
        assert_int_equal(rc, 0);
    } else {
        print_message("no /usr/bin/python3: JSON checked structurally only\n");
    }
    unlink(path);
    /* an empty trace is valid JSON too */
    OK(kt_trace_write_json(NULL, 0, path));
    unlink(path);

    /* reset, then a capacity smaller than the events: the rest are dropped */
    kt_session_trace_reset(s);
    assert_int_equal(kt_session_trace_count(s), 0);
    kt_session_destroy(s);
    enum { SMALL = 3, GUARD = 4 };
    assert_true((size_t)SMALL < n_steps);
    kt_trace_event small[SMALL + GUARD];
    for (int i = 0; i < SMALL + GUARD; i++)
        small[i] = (kt_trace_event){.name = "guard", .category = "guard", .step = 12345};
    so.trace = small;
    so.trace_capacity = SMALL;
    s = new_session(p, &so);
    mlp_set_inputs(s, MN, 1);
    for (int k = 0; k < 2; k++) {
        OK(kt_session_forward(s));
        OK(kt_session_backward(s));
        OK(kt_session_step(s));
    }
    assert_int_equal(kt_session_trace_count(s), SMALL);
    for (int i = 0; i < SMALL; i++)
        assert_int_equal(small[i].step, i); /* the first events were kept */
    for (int i = SMALL; i < SMALL + GUARD; i++) {
        assert_string_equal(small[i].name, "guard");
        assert_int_equal(small[i].step, 12345);
    }
    kt_session_trace_reset(s);
    OK(kt_session_forward(s));
    assert_int_equal(kt_session_trace_count(s), SMALL);
    assert_int_equal(small[SMALL].step, 12345);
    kt_session_destroy(s);

    /* no buffer: nothing recorded (capacity without a buffer is ignored) */
    so.trace = NULL;
    so.trace_capacity = 100;
    s = new_session(p, &so);
    mlp_set_inputs(s, MN, 1);
    OK(kt_session_forward(s));
    assert_int_equal(kt_session_trace_count(s), 0);
    kt_session_destroy(s);

    free(ev);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- 8. determinism -------------------------------------------------------------------- */

static void test_determinism(void **state)
{
    (void)state;
    kt_graph *g = build_conv(CT);
    kt_program *p = compile(g);
    kt_session_options so = {.threads = 2, .seed = 123,
                             .optimizer = {.kind = KT_OPTIM_ADAMW, .lr = 0.01f,
                                           .weight_decay = 0.01f, .clip_norm = 1.0f}};
    kt_session *a = new_session(p, &so), *b = new_session(p, &so);
    snap Pa = take(a, p, KT_ROLE_PARAM);
    expect_params_bitwise("same seed, same initialisation", b, p, &Pa);
    snap_free(&Pa);
    for (int k = 0; k < 3; k++) {
        conv_set_inputs(a, CT, 300 + (uint64_t)k, NULL, NULL);
        conv_set_inputs(b, CT, 300 + (uint64_t)k, NULL, NULL);
        OK(kt_session_forward(a));
        OK(kt_session_forward(b));
        assert_true(bitwise_same_float(kt_session_loss(a), kt_session_loss(b)));
        OK(kt_session_backward(a));
        OK(kt_session_backward(b));
        snap Ga = take(a, p, KT_ROLE_GRAD), Gb = take(b, p, KT_ROLE_GRAD);
        for (int i = 0; i < Ga.n; i++)
            expect_bitwise(param_name(p, i), &Ga.t[i], &Gb.t[i]);
        snap_free(&Ga);
        snap_free(&Gb);
        OK(kt_session_step(a));
        OK(kt_session_step(b));
        assert_true(bitwise_same_float(kt_session_grad_norm(a), kt_session_grad_norm(b)));
        Pa = take(a, p, KT_ROLE_PARAM);
        expect_params_bitwise("parameters after a step", b, p, &Pa);
        snap_free(&Pa);
    }
    /* a different seed gives a different initialisation (the comparison can fail) */
    so.seed = 124;
    kt_session *c = new_session(p, &so);
    kt_session *fresh = new_session(p, &(kt_session_options){.threads = 2, .seed = 123});
    kt_tensor wc = get(c, KT_ROLE_PARAM, "w_c1"), wf = get(fresh, KT_ROLE_PARAM, "w_c1");
    assert_false(tu_bitwise_equal(&wc, &wf));
    kt_session_destroy(c);
    kt_session_destroy(fresh);
    kt_session_destroy(a);
    kt_session_destroy(b);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_matches_kernels),
        cmocka_unit_test(test_conv_matches_kernels),
        cmocka_unit_test(test_lm_matches_kernels),
        cmocka_unit_test(test_tied_matches_kernels),
        cmocka_unit_test(test_training_reduces_loss),
        cmocka_unit_test(test_sgd_matches_reference),
        cmocka_unit_test(test_adamw_matches_reference),
        cmocka_unit_test(test_clip_norm),
        cmocka_unit_test(test_cosine_schedule),
        cmocka_unit_test(test_linear_schedule),
        cmocka_unit_test(test_grad_accumulation),
        cmocka_unit_test(test_param_without_gradient),
        cmocka_unit_test(test_optimizer_config_errors),
        cmocka_unit_test(test_state_errors),
        cmocka_unit_test(test_inputs_survive_the_run),
        cmocka_unit_test(test_save_load_weights),
        cmocka_unit_test(test_save_load_optimizer),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_frozen_params),
        cmocka_unit_test(test_trace),
        cmocka_unit_test(test_determinism),
    };
    return cmocka_run_group_tests(tests, setup_tmpdir, teardown_tmpdir);
}
