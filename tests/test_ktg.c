/* The model-description language (docs/ktg.md): every class of error message with its
 * position and caret, several errors in one file, a parsed model against the same model
 * built through the C API (bitwise), repeat, -D overrides, the annotations, kt_program_dot,
 * and inputs that must never crash or hang the parser. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "graph/graph_internal.h"
#include "tests/support/test_util.h"

static char diag[1 << 16];

/* Parses src as "m.ktg"; returns the status, the graph (or NULL) and the error count. */
static kt_status parse_d(const char *src, const kt_ktg_define *defs, int n_defs, kt_graph **g,
                         int *n_errors)
{
    /* an exact-size copy: the parser must not rely on a terminating NUL */
    size_t len = strlen(src);
    char *copy = malloc(len ? len : 1);
    memcpy(copy, src, len);
    kt_status st = kt_ktg_parse(copy, len, "m.ktg", defs, n_defs, g, diag, sizeof diag,
                                n_errors);
    free(copy);
    return st;
}

static kt_graph *parse_ok(const char *src)
{
    kt_graph *g = NULL;
    int n = -1;
    kt_status st = parse_d(src, NULL, 0, &g, &n);
    if (st != KT_OK)
        fail_msg("parse failed (%d errors):\n%s", n, diag);
    assert_int_equal(n, 0);
    assert_non_null(g);
    return g;
}

static const char prelude[] = "input x: f32[4, 8]\n"
                              "input y: i32[4]\n"
                              "param w: f32[8, 3] = normal(0.1)\n";

/* One error: the prelude plus `body`; the diagnostic must contain every expected piece. */
static void expect_one_error(const char *body, kt_status status, const char *first, ...)
{
    char src[2048];
    snprintf(src, sizeof src, "%s%s", prelude, body);
    kt_graph *g = (kt_graph *)1;
    int n = -1;
    kt_status st = parse_d(src, NULL, 0, &g, &n);
    if (st != status || n != 1 || g != NULL)
        fail_msg("for:\n%s\nstatus %d (want %d), %d errors:\n%s", body, st, status, n, diag);
    va_list ap;
    va_start(ap, first);
    for (const char *s = first; s != NULL; s = va_arg(ap, const char *))
        if (strstr(diag, s) == NULL)
            fail_msg("for:\n%s\nno '%s' in:\n%s", body, s, diag);
    va_end(ap);
    /* the last error is the first diagnostic */
    assert_non_null(strstr(diag, kt_last_error()));
    assert_true(strncmp(kt_last_error(), "m.ktg:", 6) == 0);
}

#define ERR(body, status, ...) expect_one_error((body), (status), __VA_ARGS__, (const char *)NULL)

static void test_error_classes(void **state)
{
    (void)state;
    ERR("h = matmull(x, w)\n", KT_EFORMAT, "m.ktg:4:5: error: unknown op 'matmull' (did you "
        "mean 'matmul'?)");
    ERR("h = frobnicate(x, w)\n", KT_EFORMAT, "unknown op 'frobnicate', expected an op");
    ERR("h = matmul(x, w2)\n", KT_EFORMAT, "m.ktg:4:15: error: 'w2' is not defined (did you "
        "mean 'w'?)");
    ERR("const A = 1\nconst A = 2\n", KT_EFORMAT, "m.ktg:5:7: error: redefinition of 'A' (a "
        "constant defined at line 4, column 7), expected a new name");
    ERR("input z: f64[2]\n", KT_EFORMAT, "m.ktg:4:10: error: unknown dtype 'f64'",
        "expected f32, bf16, f16, i32 or i64");
    ERR("param v: f32[2] = gauss(1)\n", KT_EFORMAT, "unknown initialiser 'gauss'",
        "expected zeros, ones, normal(std), uniform(lo, hi) or loaded");
    ERR("param v: f32[2] = normall(1)\n", KT_EFORMAT, "(did you mean 'normal'?)");
    ERR("param v: f32[2] = normal(-0.5)\n", KT_EFORMAT, "negative standard deviation");
    ERR("param v: f32[2] = uniform(1, 1)\n", KT_EFORMAT, "an empty range, expected lo < hi");
    ERR("param v: i32[2] = normal(1)\n", KT_EINVAL, "m.ktg:4:1: error: param 'v': trainable "
        "parameters are f32");
    ERR("h = matmul(x, w, trans = 1)\n", KT_EFORMAT, "m.ktg:4:18: error: unknown attribute "
        "'trans' for 'matmul' (did you mean 'trans_a'?), expected trans_a or trans_b");
    ERR("h = silu(x, alpha = 1)\n", KT_EFORMAT, "unknown attribute 'alpha' ('silu' takes no "
        "attributes)");
    ERR("h = matmul(x, w, trans_a = 2)\n", KT_EFORMAT, "trans_a = 2, expected 0 or 1");
    ERR("h = matmul(x, w, trans_b = 0, trans_b = 0)\n", KT_EFORMAT, "given twice");
    /* attributes without a default: a zero would silently mean scale by 0, an empty narrow */
    ERR("h = scale(x)\n", KT_EFORMAT, "'scale' needs alpha, expected alpha = value");
    ERR("h = narrow(x, dim = 1, start = 0)\n", KT_EFORMAT, "'narrow' needs length");
    ERR("h = transpose(x)\n", KT_EFORMAT, "'transpose' needs dim0");
    ERR("h = matmul(trans_a = 0, x)\n", KT_EFORMAT, "a value after the attributes");
    ERR("h = matmul(x, w\n", KT_EFORMAT, "m.ktg:4:16: error: unexpected end of line, "
        "expected ',' or ')'");
    ERR("h = matmul(x, w))\n", KT_EFORMAT, "m.ktg:4:17: error: unexpected ')', expected the "
        "end of the statement");
    ERR("h = matmul x, w)\n", KT_EFORMAT, "expected '(' and the op's arguments");
    ERR("repeat i in 0..2 {\n  h = silu(x)\n", KT_EFORMAT, "m.ktg:4:18: error: unterminated "
        "'repeat' block (line 4), expected '}' before the end of the file");
    ERR("checkpoint {\n", KT_EFORMAT, "unterminated 'checkpoint' block");
    ERR("const A = 3 +\n", KT_EFORMAT, "m.ktg:4:14: error: unexpected end of line, expected "
        "an integer, a constant or '('");
    ERR("const A = (3\n", KT_EFORMAT, "expected ')' to close the '('");
    ERR("const A = 2.5\n", KT_EFORMAT, "a float in an integer expression");
    ERR("const A = 4 / (2 - 2)\n", KT_EFORMAT, "m.ktg:4:13: error: division by zero");
    ERR("const A = 4 % 0\n", KT_EFORMAT, "division by zero");
    ERR("const A = 9223372036854775807 + 1\n", KT_EFORMAT, "integer overflow");
    ERR("const A = 4294967296 * 4294967296\n", KT_EFORMAT, "integer overflow");
    ERR("const A = 99999999999999999999\n", KT_EFORMAT, "integer too large");
    ERR("const A = B + 1\n", KT_EFORMAT, "'B' is not defined");
    ERR("const A = x\n", KT_EFORMAT, "'x' is a tensor, expected an integer");
    ERR("h = matmul(x, x)\n", KT_EINVAL, "m.ktg:4:5: error: node 0 (matmul 'h'): matmul: b "
        "dimension 0");
    ERR("input x: f32[2]\n", KT_EFORMAT, "redefinition of 'x' (a tensor defined at line 1, "
        "column 7)");
    ERR("param y: f32[2] = zeros\n", KT_EFORMAT, "redefinition of 'y'");
    ERR("loss x\n", KT_EINVAL, "m.ktg:4:1: error: loss: must be a scalar f32, got f32[4,8]");
    ERR("h = silu(x, x)\n", KT_EFORMAT, "'silu' given 2 values, expected 1");
    ERR("h = topk_router(x, k = 2)\n", KT_EFORMAT, "'topk_router' has 2 outputs, expected 2 "
        "names");
    ERR("h = conv1d(x, w, mode = casual)\n", KT_EFORMAT, "unknown conv1d mode 'casual' (did "
        "you mean 'causal'?)");
    ERR("parm v: f32[2] = zeros\n", KT_EFORMAT, "unknown statement 'parm' (did you mean "
        "'param'?)");
    ERR("input v: f32[2, 0]\n", KT_EFORMAT, "dimension 1 is 0, expected a positive size");
    ERR("input v: f32[1, 2, 3, 4, 5]\n", KT_EFORMAT, "too many dimensions, expected at most 4");
    ERR("policy checkpoint = evry(2)\n", KT_EFORMAT, "unknown checkpoint policy 'evry' (did you "
        "mean 'every'?)");
    ERR("policy checkpoint = every(0)\n", KT_EFORMAT, "every(0), expected a positive value");
    ERR("shard w dim 0\n", KT_EFORMAT, "'w' is not an input");
    ERR("shard x dim 5\n", KT_EINVAL, "shard: input 'x' has 2 dimensions");
    ERR("output q\n", KT_EFORMAT, "'q' is not defined");
    ERR("output x\noutput y as x\n", KT_EINVAL, "output 'x': the name is already taken");
    ERR("const N = 2\nN = silu(x)\n", KT_EFORMAT, "'N' is an integer constant");
    ERR("h = silu(x)\n}\n", KT_EFORMAT, "'}' with no open block");
    ERR("repeat x in 0..2 {\n}\n", KT_EFORMAT, "loop variable 'x' is already defined");
    ERR("checkpoint {\n  checkpoint {\n  }\n}\n", KT_EINVAL, "segments do not nest");
    ERR("repeat i in 0..2 {\n  const Q = 1\n}\n", KT_EFORMAT, "'const' inside a block");
    ERR("h = silu(x) @\n", KT_EFORMAT, "unexpected '@', expected the end of the statement");
}

static void test_define_errors(void **state)
{
    (void)state;
    kt_graph *g;
    int n;
    kt_ktg_define d[] = {{"NN", 3}};
    assert_int_equal(parse_d("const N = 2\n", d, 1, &g, &n), KT_EFORMAT);
    assert_int_equal(n, 1);
    assert_null(g);
    assert_string_equal(diag, "m.ktg: error: -D NN=3 names no constant of the file (did you "
                              "mean 'N'?), expected the name of a 'const'\n");
    kt_ktg_define bad[] = {{NULL, 1}};
    assert_int_equal(parse_d("const N = 2\n", bad, 1, &g, &n), KT_EFORMAT);
    assert_non_null(strstr(diag, "names no constant"));
}

/* The whole text of a diagnostic: position, message, source line and caret line. */
static void test_exact_format(void **state)
{
    (void)state;
    kt_graph *g;
    int n;
    const char *src = "input x: f32[4, 8]\n"
                      "param w1: f32[8, 3] = zeros\n"
                      "h = matmull(x, w1)\n"
                      "y = add(h2, w1)\n";
    assert_int_equal(parse_d(src, NULL, 0, &g, &n), KT_EFORMAT);
    assert_int_equal(n, 2);
    assert_string_equal(diag, "m.ktg:3:5: error: unknown op 'matmull' (did you mean "
                              "'matmul'?)\n"
                              "    h = matmull(x, w1)\n"
                              "        ^~~~~~~\n"
                              "m.ktg:4:9: error: 'h2' is not defined\n"
                              "    y = add(h2, w1)\n"
                              "            ^~\n");
    assert_string_equal(kt_last_error(),
                        "m.ktg:3:5: error: unknown op 'matmull' (did you mean 'matmul'?)");
    /* tabs are kept in the caret line so the caret stays under the text */
    assert_int_equal(parse_d("\th = silu(q)\n", NULL, 0, &g, &n), KT_EFORMAT);
    assert_string_equal(diag, "m.ktg:1:11: error: 'q' is not defined\n"
                              "    \th = silu(q)\n"
                              "    \t         ^\n");
    /* a name with interpolations is underlined whole */
    assert_int_equal(parse_d("const i = 3\nh = silu(w{i}.b)\n", NULL, 0, &g, &n), KT_EFORMAT);
    assert_non_null(strstr(diag, "m.ktg:2:10: error: 'w3.b' is not defined\n"
                                 "    h = silu(w{i}.b)\n"
                                 "             ^~~~~~\n"));
    /* bytes that are not UTF-8 are shown as '?', UTF-8 as it is, one caret column each */
    assert_int_equal(parse_d("h = silu(\xc3\xb6 \xff q)\n", NULL, 0, &g, &n), KT_EFORMAT);
    assert_non_null(strstr(diag, "    h = silu(\xc3\xb6 ? q)\n"
                                 "             ^\n"));
    /* a UTF-8 byte-order mark before the text is not part of it */
    kt_graph_destroy(parse_ok("\xef\xbb\xbfinput x: f32[4]\ny = silu(x)\noutput y\n"));
    assert_int_equal(parse_d("\xef\xbb\xbfh = silu(q)\n", NULL, 0, &g, &n), KT_EFORMAT);
    assert_non_null(strstr(diag, "m.ktg:1:10: error: 'q' is not defined"));
    /* a small buffer is cut and stays terminated */
    char small[16];
    memset(small, 'z', sizeof small);
    assert_int_equal(kt_ktg_parse("h = silu(q)\n", 12, "m.ktg", NULL, 0, &g, small,
                                  sizeof small, &n),
                     KT_EFORMAT);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_int_equal(kt_ktg_parse("h = silu(q)\n", 12, "m.ktg", NULL, 0, &g, NULL, 0, &n),
                     KT_EFORMAT);
    assert_int_equal(n, 1);
}

static int count(const char *hay, const char *needle)
{
    int c = 0;
    for (const char *s = strstr(hay, needle); s != NULL; s = strstr(s + 1, needle))
        c++;
    return c;
}

static void test_many_errors(void **state)
{
    (void)state;
    const char *src = "const N = 4\n"
                      "input x: f32[N, 8]\n"
                      "h = silu(x\n"                 /* 3: missing ')' */
                      "h = siluu(x)\n"               /* 4: unknown op */
                      "param w: f64[8] = zeros\n"    /* 5: bad dtype */
                      "g = silu(x)\n"                /* fine */
                      "q = add(g, nope)\n"           /* 7: unknown name */
                      "repeat i in 0..3 {\n"
                      "  k{i} = silu(g, x)\n"        /* 9: arity, reported once */
                      "}\n"
                      "const M = N / 0\n"            /* 11: division by zero */
                      "output g\n";
    kt_graph *g;
    int n;
    assert_int_equal(parse_d(src, NULL, 0, &g, &n), KT_EFORMAT);
    assert_null(g);
    assert_int_equal(n, 6);
    assert_int_equal(count(diag, ": error: "), 6);
    const char *where[] = {"m.ktg:3:11:", "m.ktg:4:5:", "m.ktg:5:10:", "m.ktg:7:12:",
                           "m.ktg:9:10:", "m.ktg:11:13:"};
    for (int i = 0; i < 6; i++)
        if (strstr(diag, where[i]) == NULL)
            fail_msg("no %s in:\n%s", where[i], diag);

    /* the cap: 150 bad lines give 100 errors and a note */
    size_t cap = 150 * 16 + 1;
    char *many = malloc(cap);
    many[0] = '\0';
    for (int i = 0; i < 150; i++)
        strcat(many, "h = nope(x)\n");
    assert_int_equal(parse_d(many, NULL, 0, &g, &n), KT_EFORMAT);
    assert_int_equal(n, 100);
    assert_non_null(strstr(diag, "too many errors (100)"));
    free(many);
}

/* ---- a parsed model against the C API --------------------------------------------------- */

static const char mlp_src[] = "const N = 6\nconst D = 5\nconst H = 2 * D\nconst C = 3\n"
                              "input x: f32[N, D]\ninput y: i32[N]\n"
                              "param w1: f32[D, H] = normal(0.3)\n"
                              "param b1: f32[H] = uniform(-0.1, 0.1)\n"
                              "param w2: f32[H, C] = normal(0.3)\n"
                              "h = matmul(x, w1)\nh = add(h, b1)\nh = silu(h)\n"
                              "repeat i in 0..2 {\n"
                              "  param r{i}.w: f32[H, H] = normal(0.2)\n"
                              "  param r{i}.g: f32[H] = ones\n"
                              "  a = matmul(h, r{i}.w)\n"
                              "  a = rmsnorm(a, r{i}.g, eps = 1e-5)\n"
                              "  h = add(h, a)\n"
                              "}\n"
                              "logits = matmul(h, w2)\n"
                              "loss = cross_entropy(logits, y, ignore_index = -100)\n"
                              "output logits\nloss loss\n";

static kt_value op(kt_graph *g, kt_op o, const kt_op_attrs *attrs, kt_value a, kt_value b,
                   int n)
{
    kt_value in[2] = {a, b}, out;
    OK(kt_graph_op(g, NULL, o, attrs, in, n, &out));
    return out;
}

static kt_graph *build_mlp_c(void)
{
    enum { N = 6, D = 5, H = 10, C = 3 };
    kt_graph *g;
    kt_value x, y, w1, b1, w2, h, logits, loss, rw, rg;
    OK(kt_graph_create(&g));
    OK(kt_graph_input(g, "x", KT_F32, 2, TU_SHAPE(N, D), &x));
    OK(kt_graph_input(g, "y", KT_I32, 1, TU_SHAPE(N), &y));
    OK(kt_graph_param(g, "w1", KT_F32, 2, TU_SHAPE(D, H), kt_init_normal(0.3f), &w1));
    OK(kt_graph_param(g, "b1", KT_F32, 1, TU_SHAPE(H), kt_init_uniform(-0.1f, 0.1f), &b1));
    OK(kt_graph_param(g, "w2", KT_F32, 2, TU_SHAPE(H, C), kt_init_normal(0.3f), &w2));
    h = op(g, KT_OP_MATMUL, NULL, x, w1, 2);
    h = op(g, KT_OP_ADD, NULL, h, b1, 2);
    h = op(g, KT_OP_SILU, NULL, h, h, 1);
    for (int i = 0; i < 2; i++) {
        char nw[16], ng[16];
        snprintf(nw, sizeof nw, "r%d.w", i);
        snprintf(ng, sizeof ng, "r%d.g", i);
        OK(kt_graph_param(g, nw, KT_F32, 2, TU_SHAPE(H, H), kt_init_normal(0.2f), &rw));
        OK(kt_graph_param(g, ng, KT_F32, 1, TU_SHAPE(H), (kt_init){KT_INIT_ONES, 0, 0}, &rg));
        kt_value a = op(g, KT_OP_MATMUL, NULL, h, rw, 2);
        a = op(g, KT_OP_RMSNORM, &TU_ATTRS(KT_OP_RMSNORM, .eps = 1e-5f), a, rg, 2);
        h = op(g, KT_OP_ADD, NULL, h, a, 2);
    }
    logits = op(g, KT_OP_MATMUL, NULL, h, w2, 2);
    loss = op(g, KT_OP_CROSS_ENTROPY, NULL, logits, y, 2);
    OK(kt_graph_output(g, logits, "logits"));
    OK(kt_graph_set_loss(g, loss));
    return g;
}

static kt_session *session_for(kt_graph *g, kt_program **p)
{
    OK(kt_compile(g, NULL, p));
    kt_session *s;
    kt_session_options so = {.threads = 1, .seed = 11};
    OK(kt_session_create(*p, &so, &s));
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    kt_tensor t;
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "x", &t));
    tu_fill_uniform(&t, &rng, -1, 1);
    OK(kt_session_tensor(s, KT_ROLE_INPUT, "y", &t));
    tu_fill_uniform(&t, &rng, 0, 3);
    OK(kt_session_forward(s));
    OK(kt_session_backward(s));
    return s;
}

static void expect_same(kt_session *a, kt_session *b, kt_tensor_role role, const char *name)
{
    kt_tensor ta, tb;
    OK(kt_session_tensor(a, role, name, &ta));
    OK(kt_session_tensor(b, role, name, &tb));
    if (!tu_bitwise_equal(&ta, &tb))
        fail_msg("%s differs between the parsed and the built model", name);
}

static void test_matches_c_api(void **state)
{
    (void)state;
    kt_graph *gp = parse_ok(mlp_src), *gc = build_mlp_c();
    assert_int_equal(kt_graph_node_count(gp), kt_graph_node_count(gc));
    kt_program *pp, *pc;
    kt_session *sp = session_for(gp, &pp), *sc = session_for(gc, &pc);
    kt_program_stats a, b;
    kt_program_get_stats(pp, &a);
    kt_program_get_stats(pc, &b);
    assert_int_equal(a.n_forward_steps, b.n_forward_steps);
    assert_int_equal(a.n_backward_steps, b.n_backward_steps);
    assert_int_equal(a.arena_bytes, b.arena_bytes);
    assert_true(kt_session_loss(sp) == kt_session_loss(sc));
    expect_same(sp, sc, KT_ROLE_OUTPUT, "logits");
    const char *params[] = {"w1", "b1", "w2", "r0.w", "r0.g", "r1.w", "r1.g"};
    for (int i = 0; i < 7; i++) {
        expect_same(sp, sc, KT_ROLE_PARAM, params[i]);
        expect_same(sp, sc, KT_ROLE_GRAD, params[i]);
    }
    kt_session_destroy(sp);
    kt_session_destroy(sc);
    kt_program_destroy(pp);
    kt_program_destroy(pc);
    kt_graph_destroy(gp);
    kt_graph_destroy(gc);
}

static const char *leaf_name(const kt_graph *g, int32_t id)
{
    return kt__strings_get(&g->strings, g->values[id].name);
}

static void test_repeat_names(void **state)
{
    (void)state;
    kt_graph *g = parse_ok("const L = 2\ninput x: f32[3, 4]\nh = silu(x)\n"
                           "repeat i in 1..L + 1 {\n"
                           "  repeat j in 0..2 {\n"
                           "    param layer{i}.w{j * 10}_b: f32[4] = zeros\n"
                           "    h = add(h, layer{i}.w{j * 10}_b)\n"
                           "  }\n"
                           "}\n"
                           "repeat i in 0..0 {\n  this is never read\n}\n"
                           "output h as out{L}\n");
    const char *want[] = {"x", "layer1.w0_b", "layer1.w10_b", "layer2.w0_b", "layer2.w10_b"};
    int k = 0;
    for (int32_t v = 0; v < g->n_values; v++)
        if (g->values[v].kind != KT__VALUE_NODE) {
            assert_true(k < 5);
            assert_string_equal(leaf_name(g, v), want[k++]);
        }
    assert_int_equal(k, 5);
    assert_int_equal(kt_graph_node_count(g), 5);
    assert_int_equal(g->n_outputs, 1);
    assert_string_equal(kt__strings_get(&g->strings, g->outputs[0].name), "out2");
    kt_graph_destroy(g);

    /* the loop variable is unbound after its loop */
    kt_graph *bad;
    int n;
    assert_int_equal(parse_d("repeat i in 0..2 {\n}\nconst A = i\n", NULL, 0, &bad, &n),
                     KT_EFORMAT);
    assert_non_null(strstr(diag, "'i' is not defined"));
}

/* Checkpoint names: {expr} in any dotted component, aliases, scopes (docs/ktg.md). */
static void test_checkpoint_names(void **state)
{
    (void)state;
    kt_graph *g = parse_ok(
        "const L = 2\nconst H = 4\ninput x: f32[3, H]\nh = x\n"
        "repeat l in 0..L {\n"
        "  param model.layers.{l}.self_attn.q_proj.weight: f32[H, H] = normal(0.1)\n"
        "  h = matmul(h, model.layers.{l}.self_attn.q_proj.weight, trans_b = 1)\n"
        "  param ln = model.layers.{l}.input_layernorm.weight: f32[H] = ones\n"
        "  h = rmsnorm(h, ln)\n"                        /* the alias, rebound each layer */
        "  scope model.layers.{l}.mlp {\n"
        "    param frozen gate = gate_proj.weight: f32[H, H] = normal(0.1)\n"
        "    param up_proj.weight: f32[H, H] = normal(0.1)\n"
        "    scope experts.{l}.{l + 1} {\n"
        "      param w: f32[H] = ones\n"
        "      h = rmsnorm(h, w)\n"                      /* experts.l.l+1's w */
        "    }\n"
        "    g = matmul(h, gate, trans_b = 1)\n"
        "    u = matmul(h, up_proj.weight, trans_b = 1)\n" /* the scope's name first */
        "    h = swiglu(g, u)\n"
        "  }\n"
        "}\n"
        "output h\n");
    const char *want[] = {"x",
                          "model.layers.0.self_attn.q_proj.weight",
                          "model.layers.0.input_layernorm.weight",
                          "model.layers.0.mlp.gate_proj.weight",
                          "model.layers.0.mlp.up_proj.weight",
                          "model.layers.0.mlp.experts.0.1.w",
                          "model.layers.1.self_attn.q_proj.weight",
                          "model.layers.1.input_layernorm.weight",
                          "model.layers.1.mlp.gate_proj.weight",
                          "model.layers.1.mlp.up_proj.weight",
                          "model.layers.1.mlp.experts.1.2.w"};
    int32_t leaf[11];
    int k = 0;
    for (int32_t v = 0; v < g->n_values; v++)
        if (g->values[v].kind != KT__VALUE_NODE) {
            assert_true(k < 11);
            assert_string_equal(leaf_name(g, v), want[k]);
            leaf[k++] = v;
        }
    assert_int_equal(k, 11);
    /* each use reads the tensor it names: layer l's ops take layer l's parameters */
    assert_int_equal(kt_graph_node_count(g), 12);
    for (int l = 0; l < 2; l++) {
        const kt__gnode *n = &g->nodes[6 * l];
        const int32_t *p = &leaf[1 + 5 * l];
        assert_int_equal(n[0].in[1], p[0]); /* q_proj, written in full */
        assert_int_equal(n[1].in[1], p[1]); /* ln: the alias of this layer's norm */
        assert_int_equal(n[2].in[1], p[4]); /* w inside the experts scope */
        assert_int_equal(n[3].in[1], p[2]); /* gate: the alias */
        assert_int_equal(n[4].in[1], p[3]); /* up_proj.weight: resolved in the mlp scope */
    }
    kt_graph_destroy(g);

    /* an alias of an input shards it; inside a scope its names come first, outside it a name
     * is read as written */
    g = parse_ok("input ids = input_ids: i32[8]\nshard ids dim 0\nparam e: f32[4, 2] = zeros\n"
                 "scope m {\n  param e: f32[4, 2] = ones\n  a = embedding(e, ids)\n}\n"
                 "h = embedding(e, ids)\noutput h\noutput a\n");
    assert_string_equal(leaf_name(g, g->nodes[0].in[1]), "input_ids");
    assert_string_equal(leaf_name(g, g->nodes[0].in[0]), "m.e"); /* the scope's first */
    assert_string_equal(leaf_name(g, g->nodes[1].in[0]), "e");
    kt_graph_destroy(g);

    /* misuse, each at its line and column */
    ERR("param model.layers.: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:19: error: a name that "
        "ends with '.', expected a name part or '{expr}' after the '.'");
    ERR("param a.{1}.: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:12: error: a name that ends "
        "with '.'");
    ERR("param a.{}.b: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:10: error: unexpected '}', "
        "expected an integer, a constant or '('");
    ERR("param a.{1.b: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:11: error: unexpected '.', "
        "expected '}' to close the name's '{'");
    ERR("param a.{x}.b: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:10: error: 'x' is a tensor");
    ERR("h = silu(a.{1}.b)\n", KT_EFORMAT, "m.ktg:4:10: error: 'a.1.b' is not defined");
    ERR("param v{1} = a.b: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:12: error: unexpected '=' "
        "after the name", "expected ':' and the type");
    ERR("const C = 1\nparam C = a.b: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:5:7: error: 'C' "
        "is an integer constant (line 4), expected a new name for the alias");
    ERR("param x = a.b: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:7: error: 'x' is the name of "
        "an input or parameter (line 1, column 7), expected another name for the alias");
    ERR("param v = v: f32[2] = zeros\n", KT_EFORMAT, "m.ktg:4:7: error: the alias 'v' is the "
        "declared name itself");
    ERR("scope {\n}\n", KT_EFORMAT, "m.ktg:4:7: error: unexpected '{', expected the scope's "
        "name");
    ERR("scope a.b\n", KT_EFORMAT, "m.ktg:4:10: error: unexpected end of line, expected '{' "
        "to open the 'scope' body");
    ERR("scope a {\n", KT_EFORMAT, "m.ktg:4:9: error: unterminated 'scope' block");
    ERR("scope a {\n  param v: f32[8] = ones\n  v = silu(x)\n}\n", KT_EFORMAT,
        "m.ktg:6:3: error: 'v' here means the scope's 'a.v'", "expected another name");
    ERR("scope a {\n  const Q = 1\n}\n", KT_EFORMAT, "'const' inside a block");
    /* an error inside an interpolation: its '}' is not taken for the end of the block, so
     * the bad scope's body is skipped and the outer '}' still closes 'a' (one error) */
    ERR("scope a {\n  scope b.{x} {\n  }\n}\n", KT_EFORMAT, "m.ktg:5:12: error: 'x' is a "
        "tensor");
    /* a failed declaration silences its alias too: one error */
    ERR("param v = a.b: f32[8] = gauss\nh = add(v, v)\noutput h\n", KT_EFORMAT,
        "unknown initialiser 'gauss'");
    /* a name too long once the prefix is added */
    char src[512], longname[128];
    memset(longname, 'n', 100);
    longname[100] = '\0';
    snprintf(src, sizeof src, "scope %s {\n  param %.40s: f32[2] = zeros\n}\n", longname,
             longname);
    ERR(src, KT_EFORMAT, "m.ktg:5:9: error: name too long with the scope's prefix");
}

static void test_defines(void **state)
{
    (void)state;
    const char *src = "const N = 4\nconst D = N * 2\ninput x: f32[N, D]\noutput x\n";
    kt_graph *g = parse_ok(src);
    assert_int_equal(g->values[0].meta.shape[0], 4);
    assert_int_equal(g->values[0].meta.shape[1], 8);
    kt_graph_destroy(g);
    kt_ktg_define d[] = {{"N", 7}, {"D", 3}};
    int n;
    OK(parse_d(src, d, 1, &g, &n));
    assert_int_equal(g->values[0].meta.shape[0], 7);
    assert_int_equal(g->values[0].meta.shape[1], 14);
    kt_graph_destroy(g);
    OK(parse_d(src, d, 2, &g, &n));
    assert_int_equal(g->values[0].meta.shape[0], 7);
    assert_int_equal(g->values[0].meta.shape[1], 3);
    kt_graph_destroy(g);
}

static void test_annotations(void **state)
{
    (void)state;
    kt_graph *g = parse_ok("input x: f32[2, 6, 4]\n"
                           "shard x dim 1\n"
                           "policy checkpoint = every(2)\n"
                           "h = silu(x)\n"
                           "checkpoint {\n"
                           "  h = silu(h)\n"
                           "  h = scale(h, alpha = -0.5)\n"
                           "}\n"
                           "output h\n");
    assert_int_equal(g->n_segments, 1);
    assert_int_equal(g->segments[0].first, 1);
    assert_int_equal(g->segments[0].last, 3);
    assert_int_equal(g->open_segment, -1);
    assert_int_equal(g->policy.kind, KT_CHECKPOINT_EVERY_K);
    assert_int_equal(g->policy.k, 2);
    assert_non_null(g->shard_dim);
    assert_int_equal(g->shard_dim[0], 1);
    assert_true(g->nodes[2].attrs.alpha == -0.5f);
    /* the shard survives compilation and a .ktp round trip */
    kt_compile_options fo = {.training = 0};
    kt_program *p, *q;
    assert_int_equal(kt_compile(g, &fo, &p), KT_OK);
    size_t n_bytes;
    assert_int_equal(kt_program_serialized_size(p, &n_bytes), KT_OK);
    void *bytes = malloc(n_bytes);
    assert_int_equal(kt_program_serialize(p, bytes, n_bytes), KT_OK);
    assert_int_equal(kt_program_load_memory(bytes, n_bytes, &q), KT_OK);
    int dim = -2;
    assert_int_equal(kt_program_shard_dim(q, "x", &dim), KT_OK);
    assert_int_equal(dim, 1);
    TU_EXPECT_ERROR(kt_program_shard_dim(q, "nope", &dim), KT_EINVAL, "no input named 'nope'");
    free(bytes);
    kt_program_destroy(p);
    kt_program_destroy(q);
    kt_graph_destroy(g);

    const char *policies[] = {"none", "segments", "sqrtn", "budget(1 << 0)", "budget(4096)"};
    const kt_checkpoint_policy_kind kinds[] = {KT_CHECKPOINT_NONE, KT_CHECKPOINT_SEGMENTS,
                                               KT_CHECKPOINT_SQRTN, KT_CHECKPOINT_BUDGET,
                                               KT_CHECKPOINT_BUDGET};
    for (int i = 0; i < 5; i++) {
        char src[128];
        snprintf(src, sizeof src, "policy checkpoint = %s\n", policies[i]);
        int n;
        kt_status st = parse_d(src, NULL, 0, &g, &n);
        if (i == 3) { /* '<<' is not an operator */
            assert_int_equal(st, KT_EFORMAT);
            continue;
        }
        OK(st);
        assert_int_equal(g->policy.kind, kinds[i]);
        if (i == 4)
            assert_int_equal(g->policy.budget_bytes, 4096);
        kt_graph_destroy(g);
    }

    /* checkpoint blocks: without a policy line they mean themselves (recompute); an explicit
     * "none" leaves them inert */
    for (int explicit_none = 0; explicit_none < 2; explicit_none++) {
        char src[512];
        snprintf(src, sizeof src,
                 "%sinput x: f32[16, 32]\ninput y: i32[16]\nh = x\nrepeat l in 0..4 {\n"
                 "  checkpoint {\n    param w{l}: f32[32, 32] = normal(0.1)\n"
                 "    n = silu(h)\n    m = matmul(n, w{l})\n    h = add(h, m)\n  }\n}\n"
                 "l = cross_entropy(h, y)\nloss l\n",
                 explicit_none ? "policy checkpoint = none\n" : "");
        int n;
        OK(parse_d(src, NULL, 0, &g, &n));
        kt_compile_options to = {.training = 1};
        kt_program *prog;
        OK(kt_compile(g, &to, &prog));
        kt_program_stats ps;
        kt_program_get_stats(prog, &ps);
        if (explicit_none)
            assert_int_equal(ps.n_recompute_steps, 0);
        else
            assert_true(ps.n_recompute_steps > 0);
        kt_program_destroy(prog);
        kt_graph_destroy(g);
    }
}

/* Attributes reach their kt_op_attrs fields; lines continue inside brackets. */
static void test_attributes(void **state)
{
    (void)state;
    kt_graph *g = parse_ok("const T = 8\n"
                           "input x: f32[T, 4]\n"
                           "param w: f32[4, 3, 4] = normal(0.1)\n"
                           "param dw: f32[4, 3] = normal(0.1)\n"
                           "a = conv1d(x, w, mode = same)\n"
                           "b = conv1d(a, dw, mode = valid, depthwise = 1)\n"
                           "c = narrow(x, dim = 0, start = 2, length = T - 4)\n"
                           "d = transpose(c, dim0 = 0, dim1 = 1)\n"
                           "e = reshape(d,\n"
                           "            shape = [2, -1])  # a comment\n"
                           "f = concat(\n  e,\n  e,\n  dim = 1\n)\n"
                           "l = matmul(x, x, trans_b = 1)\n"
                           "ids, wts = topk_router(l, k = 2, norm_topk = 1)\n"
                           "output wts\n");
    const kt__gnode *n = g->nodes;
    assert_int_equal(n[0].attrs.conv_mode, KT_CONV_SAME);
    assert_int_equal(n[1].attrs.conv_mode, KT_CONV_VALID);
    assert_int_equal(n[1].attrs.depthwise, 1);
    assert_int_equal(n[2].attrs.dim, 0);
    assert_int_equal(n[2].attrs.start, 2);
    assert_int_equal(n[2].attrs.length, 4);
    assert_int_equal(n[3].attrs.dim1, 1);
    assert_int_equal(n[4].attrs.ndim, 2);
    assert_int_equal(n[4].attrs.shape[1], -1);
    assert_int_equal(n[5].n_in, 2);
    assert_int_equal(n[5].attrs.dim, 1);
    assert_int_equal(n[6].attrs.trans_b, 1);
    assert_int_equal(n[7].attrs.k, 2);
    assert_int_equal(n[7].attrs.norm_topk, 1);
    assert_int_equal(n[7].n_out, 2);
    kt_graph_destroy(g);
}

static void test_dot(void **state)
{
    (void)state;
    kt_graph *g = parse_ok(mlp_src);
    kt_program *p;
    OK(kt_compile(g, NULL, &p));
    size_t n = kt_program_dot(p, NULL, 0);
    char *s = malloc(n + 1);
    assert_int_equal(kt_program_dot(p, s, n + 1), n);
    assert_int_equal(strlen(s), n);
    assert_true(strncmp(s, "digraph program {", 17) == 0);
    assert_non_null(strstr(s, "fillcolor=lightblue"));
    assert_non_null(strstr(s, "fillcolor=salmon"));
    assert_non_null(strstr(s, "fillcolor=grey"));
    assert_non_null(strstr(s, "input x"));
    assert_non_null(strstr(s, "-> s0;"));
    assert_string_equal(s + n - 2, "}\n");
    char small[32];
    assert_int_equal(kt_program_dot(p, small, sizeof small), n);
    assert_int_equal(strlen(small), sizeof small - 1);
    free(s);
    kt_program_destroy(p);
    kt_graph_destroy(g);
}

/* ---- never crash, never hang ------------------------------------------------------------- */

/* `h = x` names a value twice; a failed statement's names do not cascade into more errors. */
static void test_alias_and_no_cascade(void **state)
{
    (void)state;
    kt_graph *g = parse_ok("input x: f32[4, 8]\nh = x\nrepeat i in 0..3 {\n h = silu(h)\n}\n"
                           "output h\n");
    assert_int_equal(kt_graph_node_count(g), 3);
    kt_graph_destroy(g);
    /* one misspelt op: its result h is used four more times, yet one error is reported */
    ERR("h = matmull(x, w)\nh = silu(h)\nz = add(h, h)\nk = h\noutput z\n", KT_EFORMAT,
        "unknown op 'matmull'", "did you mean 'matmul'?");
    /* a failed input or param declaration does not cascade either ("not defined" later) */
    ERR("input q: f32[0, 4]\nh = matmul(q, w)\noutput h\n", KT_EFORMAT,
        "dimension 0 is 0");
    ERR("param v: f32[8, 4] = gauss(1)\nh = matmul(x, v)\noutput h\n", KT_EFORMAT,
        "unknown initialiser 'gauss'");
    /* two names from a plain name is an error */
    ERR("a, b = x\n", KT_EFORMAT, "a plain name gives one value");
    /* a name a failed statement bound, declared again (a fuzzer found this reading past a
     * table): reported as a redefinition */
    int n = -1;
    kt_graph *bad = NULL;
    char src[256];
    snprintf(src, sizeof src, "%sh = matmull(x, w)\nparam h: f32[2] = zeros\n", prelude);
    assert_int_equal(parse_d(src, NULL, 0, &bad, &n), KT_EFORMAT);
    assert_int_equal(n, 2);
    assert_non_null(strstr(diag, "redefinition of 'h' (a tensor"));
}

/* Statements that use a failed statement's name are still checked for their own mistakes
 * (a missing ')', a bad attribute): only the name itself reports nothing more. One file,
 * several independent mistakes, each reported once, in order. */
static void test_recovery_after_failed(void **state)
{
    (void)state;
    static const char src[] =
        "input x: f32[4, 8]\n"
        "param w: f32[8, 3] = normal(0.1)\n"
        "h = matmull(x, w)\n"           /* 1: unknown op; h is poisoned */
        "a = silu(h\n"                  /* 2: missing ')' after a poisoned name */
        "b = matmul(h, w, trans_a = 2)\n" /* 3: its own attribute error */
        "c = scale(h)\n"                /* 4: a required attribute missing */
        "d = add(h, zz)\n"              /* 5: another name not defined */
        "e = silu(h)\n"                 /* poisoned only: nothing to report */
        "output e\n"                    /* nor here (e is poisoned in turn) */
        "f = rmsnorm(x, w, eps = -1)\n" /* 6: out of the table's range */
        "g2, g3 = silu(h)\n"            /* 7: output count, whatever h is */
        "loss e\n";                     /* poisoned: nothing */
    int n = -1;
    kt_graph *g = (kt_graph *)1;
    assert_int_equal(parse_d(src, NULL, 0, &g, &n), KT_EFORMAT);
    assert_null(g);
    static const char *const expected[] = {
        "m.ktg:3:5: error: unknown op 'matmull'",
        "m.ktg:4:11: error: unexpected end of line, expected ',' or ')'",
        "m.ktg:5:28: error: trans_a = 2, expected 0 or 1",
        "m.ktg:6:12: error: 'scale' needs alpha",
        "m.ktg:7:12: error: 'zz' is not defined",
        "m.ktg:10:25: error: eps = -1, expected a finite float >= 0",
        "m.ktg:11:1: error: 'silu' has 1 output",
    };
    const int n_expected = (int)(sizeof expected / sizeof expected[0]);
    if (n != n_expected)
        fail_msg("%d errors, expected %d:\n%s", n, n_expected, diag);
    const char *at = diag;
    for (int i = 0; i < n_expected; i++) {
        const char *hit = strstr(at, expected[i]);
        if (hit == NULL)
            fail_msg("no '%s' (in order) in:\n%s", expected[i], diag);
        at = hit + 1;
    }
}

static void parse_any(const char *buf, size_t len)
{
    kt_graph *g = NULL;
    int n;
    kt_status st = kt_ktg_parse(buf, len, "f.ktg", NULL, 0, &g, diag, sizeof diag, &n);
    if (st == KT_OK) {
        assert_non_null(g);
        kt_graph_destroy(g);
    } else {
        assert_null(g);
        assert_true(n > 0);
    }
}

static void test_hostile_inputs(void **state)
{
    (void)state;
    size_t big = 200000;
    char *s = malloc(big);
    /* deep parentheses, deep blocks, deep interpolations */
    const char *starts[] = {"const A = ", "repeat i in 0..2 ", "h = w", "const A = -"};
    const char fill[] = {'(', '{', '{', '('};
    for (int k = 0; k < 4; k++) {
        size_t n = strlen(starts[k]);
        memcpy(s, starts[k], n);
        memset(s + n, fill[k], big - n);
        parse_any(s, big);
    }
    /* a huge range with an empty body, nested ranges */
    parse_any("repeat i in 0..9000000000000000000 {\n}\n", 40);
    const char *nested = "repeat a in 0..1000 {\nrepeat b in 0..1000 {\nrepeat c in 0..1000 {\n"
                         "}\n}\n}\n";
    parse_any(nested, strlen(nested));
    assert_non_null(strstr(diag, "too many statements"));
    /* long names and numbers */
    memset(s, 'a', big);
    parse_any(s, big);
    memcpy(s, "const A = ", 10);
    memset(s + 10, '9', 1000);
    parse_any(s, 1010);
    memcpy(s, "h = scale(x, alpha = ", 21);
    memset(s + 21, '7', 1000);
    parse_any(s, 1021);
    /* NUL bytes and control characters, newlines only */
    parse_any("in\0put x: f32[2]\n\x01\x7f\xff", 21);
    parse_any("input x: f32[2]\0\n", 17); /* a NUL is named by its code, as other bytes are */
    assert_non_null(strstr(diag, "unexpected character 0x00"));
    memset(s, '\n', big);
    parse_any(s, big);
    memset(s, ',', big);
    parse_any(s, big);
    parse_any("", 0);
    parse_any(NULL, 0);
    free(s);

    /* every prefix and random byte flips of a valid model */
    size_t len = strlen(mlp_src);
    char *buf = malloc(len);
    for (size_t cut = 0; cut <= len; cut++) {
        memcpy(buf, mlp_src, cut);
        parse_any(buf, cut);
    }
    tu_rng rng;
    tu_rng_seed(&rng, 99);
    const char alphabet[] = "(){}[],:=+-*/%.#\n\t 0123456789ai_{}";
    for (int round = 0; round < 3000; round++) {
        memcpy(buf, mlp_src, len);
        int flips = 1 + (int)(tu_rng_next(&rng) % 4);
        for (int f = 0; f < flips; f++) {
            size_t at = tu_rng_next(&rng) % len;
            uint64_t r = tu_rng_next(&rng);
            buf[at] = (r & 1) ? alphabet[(r >> 1) % (sizeof alphabet - 1)] : (char)(r >> 8);
        }
        parse_any(buf, len);
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_classes),  cmocka_unit_test(test_define_errors),
        cmocka_unit_test(test_exact_format),   cmocka_unit_test(test_many_errors),
        cmocka_unit_test(test_matches_c_api),  cmocka_unit_test(test_repeat_names),
        cmocka_unit_test(test_defines),        cmocka_unit_test(test_annotations),
        cmocka_unit_test(test_attributes),     cmocka_unit_test(test_dot),
        cmocka_unit_test(test_hostile_inputs), cmocka_unit_test(test_alias_and_no_cascade),
        cmocka_unit_test(test_recovery_after_failed), cmocka_unit_test(test_checkpoint_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
