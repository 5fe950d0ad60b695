/* Small models built through the graph API against the same computation written directly
 * with the kernels: outputs and every gradient; and training them to a stated loss. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_util.h"

#define OK(expr)                                                                              \
    do {                                                                                      \
        kt_status s_ = (expr);                                                                \
        if (s_ != KT_OK)                                                                      \
            fail_msg("%s: %s", #expr, kt_last_error());                                       \
    } while (0)

static kt_value op1(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs,
                    kt_value a)
{
    kt_value out;
    OK(kt_graph_op(g, name, op, attrs, &a, 1, &out));
    return out;
}

static kt_value op2(kt_graph *g, const char *name, kt_op op, const kt_op_attrs *attrs,
                    kt_value a, kt_value b)
{
    kt_value in[2] = {a, b}, out;
    OK(kt_graph_op(g, name, op, attrs, in, 2, &out));
    return out;
}

/* Runs one kernel directly on heap tensors (the independent side of the comparison). */
static kt_tensor direct_fwd(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in)
{
    kt_tensor out;
    OK(kt_op_infer(op, attrs, in, n_in, &out, 1));
    out = tu_alloc(out.dtype, out.ndim, out.shape);
    size_t scratch = kt_op_scratch_bytes(op, attrs, in, n_in, 0);
    kt_exec ex = {.scratch = scratch ? malloc(scratch) : NULL, .scratch_bytes = scratch};
    OK(kt_op_forward(op, attrs, in, n_in, &out, 1, &ex));
    free(ex.scratch);
    return out;
}

/* grads[i] allocated for wanted[i] != 0 */
static void direct_bwd(kt_op op, const kt_op_attrs *attrs, const kt_tensor *in, int n_in,
                       const kt_tensor *out, const kt_tensor *gout, const int *wanted,
                       kt_tensor *gin)
{
    for (int i = 0; i < n_in; i++)
        gin[i] = wanted[i] ? tu_alloc(in[i].dtype, in[i].ndim, in[i].shape) : (kt_tensor){0};
    size_t scratch = kt_op_scratch_bytes(op, attrs, in, n_in, 1);
    kt_exec ex = {.scratch = scratch ? malloc(scratch) : NULL, .scratch_bytes = scratch};
    OK(kt_op_backward(op, attrs, in, n_in, out, 1, gout, gin, &ex));
    free(ex.scratch);
}

static void expect_equal(const char *what, const kt_tensor *got, const kt_tensor *want)
{
    double e = tu_rel_err(got, want, 1e-12);
    if (e > 1e-6)
        fail_msg("%s: graph and direct kernels differ by %.3g", what, e);
}

static void set_from(kt_session *s, kt_tensor_role role, const char *name, const kt_tensor *v)
{
    kt_tensor t;
    OK(kt_session_tensor(s, role, name, &t));
    assert_int_equal(kt_tensor_nbytes(&t), kt_tensor_nbytes(v));
    memcpy(t.data, v->data, kt_tensor_nbytes(v));
}

static kt_tensor get(kt_session *s, kt_tensor_role role, const char *name)
{
    kt_tensor t;
    OK(kt_session_tensor(s, role, name, &t));
    return t;
}

/* MLP: loss = CE(silu(x W1 + b1) W2, y); x used once, W1 used once. */
enum { MN = 24, MD = 16, MH = 32, MC = 5 };

static kt_graph *build_mlp(void)
{
    kt_graph *g;
    kt_value x, y, w1, b1, w2, h, logits, loss;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(MN, MD), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(MN), &y));
    OK(kt_graph_param(g, "w1", KT_F32, 2, TU_SHAPE(MD, MH), kt_init_normal(0.3f), &w1));
    OK(kt_graph_param(g, "b1", KT_F32, 1, TU_SHAPE(MH), kt_init_normal(0.1f), &b1));
    OK(kt_graph_param(g, "w2", KT_F32, 2, TU_SHAPE(MH, MC), kt_init_normal(0.3f), &w2));
    h = op2(g, "fc1", KT_OP_MATMUL, NULL, x, w1);
    h = op2(g, "bias1", KT_OP_ADD, NULL, h, b1);
    h = op1(g, "act", KT_OP_SILU, NULL, h);
    logits = op2(g, "fc2", KT_OP_MATMUL, NULL, h, w2);
    kt_op_attrs ce = {.ignore_index = -100};
    loss = op2(g, "loss", KT_OP_CROSS_ENTROPY, &ce, logits, y);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static void test_mlp_matches_kernels(void **state)
{
    (void)state;
    kt_graph *g = build_mlp();
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    kt_session *s;
    kt_session_options so = {.threads = 2, .seed = 7};
    OK(kt_session_create(p, &so, &s));

    tu_rng rng;
    tu_rng_seed(&rng, 3);
    kt_tensor x = tu_new(KT_F32, MN, MD), y = tu_new(KT_I32, MN);
    tu_fill_uniform(&x, &rng, -1, 1);
    tu_fill_uniform(&y, &rng, 0, MC);
    tu_set(&y, 3, -100); /* one ignored token */
    set_from(s, KT_ROLE_INPUT, "x", &x);
    set_from(s, KT_ROLE_INPUT, "y", &y);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));

    /* the same computation with the kernels */
    kt_tensor w1 = get(s, KT_ROLE_PARAM, "w1"), b1 = get(s, KT_ROLE_PARAM, "b1");
    kt_tensor w2 = get(s, KT_ROLE_PARAM, "w2");
    kt_tensor in1[2] = {x, w1};
    kt_tensor h0 = direct_fwd(KT_OP_MATMUL, NULL, in1, 2);
    kt_tensor in2[2] = {h0, b1};
    kt_tensor h1 = direct_fwd(KT_OP_ADD, NULL, in2, 2);
    kt_tensor h2 = direct_fwd(KT_OP_SILU, NULL, &h1, 1);
    kt_tensor in3[2] = {h2, w2};
    kt_tensor lg = direct_fwd(KT_OP_MATMUL, NULL, in3, 2);
    kt_op_attrs ce = {.ignore_index = -100};
    kt_tensor in4[2] = {lg, y};
    kt_tensor loss = direct_fwd(KT_OP_CROSS_ENTROPY, &ce, in4, 2);

    kt_tensor got_logits = get(s, KT_ROLE_OUTPUT, "logits");
    expect_equal("logits", &got_logits, &lg);
    assert_float_equal(kt_session_loss(s), tu_get(&loss, 0), 1e-6);

    kt_tensor one = tu_new(KT_F32, 1);
    tu_set(&one, 0, 1.0);
    one.ndim = 0;
    kt_tensor g4[2], g3[2], g2[2], g1[2], g_h1;
    direct_bwd(KT_OP_CROSS_ENTROPY, &ce, in4, 2, &loss, &one, (int[]){1, 0}, g4);
    direct_bwd(KT_OP_MATMUL, NULL, in3, 2, &lg, &g4[0], (int[]){1, 1}, g3);
    direct_bwd(KT_OP_SILU, NULL, &h1, 1, &h2, &g3[0], (int[]){1}, &g_h1);
    direct_bwd(KT_OP_ADD, NULL, in2, 2, &h1, &g_h1, (int[]){1, 1}, g2);
    direct_bwd(KT_OP_MATMUL, NULL, in1, 2, &h0, &g2[0], (int[]){0, 1}, g1);
    kt_tensor gw1 = get(s, KT_ROLE_GRAD, "w1"), gb1 = get(s, KT_ROLE_GRAD, "b1");
    kt_tensor gw2 = get(s, KT_ROLE_GRAD, "w2");
    expect_equal("grad w2", &gw2, &g3[1]);
    expect_equal("grad b1", &gb1, &g2[1]);
    expect_equal("grad w1", &gw1, &g1[1]);

    kt_tensor *all[] = {&x, &y, &h0, &h1, &h2, &lg, &loss, &one, &g4[0], &g3[0], &g3[1],
                        &g_h1, &g2[0], &g2[1], &g1[1]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_free(all[i]);
    kt_session_destroy(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_matches_kernels),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
